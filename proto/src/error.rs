//! The crate's error type.
//!
//! One enum for every failure a source, the planner or the Flight service can report. Each
//! variant carries the context a person needs to act (which capture instance, which LSNs),
//! and `flight::status` maps every variant to exactly one gRPC code, with no catch-all arm, so
//! a new variant cannot reach a client without a deliberate decision.

use crate::lsn::Lsn;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong serving CDC data.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The changes a range starts with were purged by CDC cleanup before planning.
    #[error(
        "capture instance '{capture_instance}': changes from {requested} were purged by CDC cleanup \
         (current min_lsn is {min_lsn}); a re-snapshot of the table is required{hint}"
    )]
    ChangesPurged {
        /// The capture instance read.
        capture_instance: String,
        /// The first LSN the range needed.
        requested: Lsn,
        /// The capture instance's lowest retained LSN.
        min_lsn: Lsn,
        /// Extra context (an older capture instance that was dropped, for example).
        hint: String,
    },
    /// CDC cleanup passed the start of a range while it was being read: rows may be missing.
    #[error(
        "capture instance '{capture_instance}': CDC cleanup moved min_lsn to {min_lsn} while the \
         range from {from} was being read, so the stream may be short; a re-snapshot of the table \
         is required"
    )]
    PurgedDuringRead {
        /// The capture instance read.
        capture_instance: String,
        /// The first LSN of the range.
        from: Lsn,
        /// The capture instance's lowest retained LSN after the read.
        min_lsn: Lsn,
    },
    /// No tracked table of that name.
    #[error("table '{table}' is not tracked by CDC here (list_flights shows the tracked tables)")]
    TableNotFound {
        /// The name asked for.
        table: String,
    },
    /// No capture instance of that name.
    #[error("capture instance '{name}' does not exist{hint}")]
    CaptureInstanceNotFound {
        /// The name asked for.
        name: String,
        /// Similar names, when there are some.
        hint: String,
    },
    /// A request that cannot be served as given.
    #[error("{0}")]
    InvalidArgument(String),
    /// The source's schema changed in a way the request cannot hold.
    #[error("{0}")]
    SchemaChanged(String),
    /// A ticket that does not decode.
    #[error("ticket is malformed: {0}")]
    TicketMalformed(String),
    /// A ticket whose signature does not match: edited, forged or signed with another key.
    #[error("ticket signature does not match: the ticket was edited or signed with another key")]
    TicketForged,
    /// A ticket past its expiry: plan the range again.
    #[error("the ticket expired at {expired_at} (unix seconds); plan the read again")]
    TicketExpired {
        /// When it expired, in seconds since the Unix epoch.
        expired_at: u64,
    },
    /// The call carries no valid credentials (no token, a wrong one, an unknown certificate).
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller is authenticated but may not read this table.
    #[error("principal '{principal}' may not read table '{table}'")]
    NotAuthorized {
        /// Who asked.
        principal: String,
        /// The table asked for.
        table: String,
    },
    /// The call needs a column in clear that the server serves this caller masked (a key
    /// to cut or seek on, a value to digest).
    #[error("{0}")]
    Masked(String),
    /// A ticket planned under other masks than its redeemer is served: plan again.
    #[error("{0}")]
    TicketMasksChanged(String),
    /// A limit of the server is reached for now (open streams); retry after a while.
    #[error("{what}; retry in about {retry_after_seconds} s")]
    Busy {
        /// Which limit, with its value.
        what: String,
        /// A hint of when a retry may succeed.
        retry_after_seconds: u64,
    },
    /// A planning call ran past the server's deadline.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A stream's client took no batch for the server's stall timeout: the stream was ended
    /// and its source read released. Reading the same ticket again may succeed.
    #[error("{0}")]
    StreamStalled(String),
    /// The source refuses the server's login a read it needs (SQL Server error 229 on a
    /// change table): the DBA must run the `GRANT` the message names.
    #[error("{0}")]
    GrantMissing(String),
    /// A transient failure of the source (connection dropped, timeout): retrying may succeed.
    #[error("source unavailable: {0}")]
    SourceUnavailable(String),
    /// An I/O failure on local state (the simulated database's directory).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An Arrow failure while building or encoding batches.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// State that breaks an invariant (a corrupt file, an impossible position).
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// An [`Error::InvalidArgument`] from anything printable.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument(message.into())
    }

    /// An [`Error::Io`] with its context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Whether retrying the same call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::SourceUnavailable(_))
    }
}
