//! The writer's error type.

use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::ClientError;

/// Result with the writer's [`WriterError`].
pub type Result<T, E = WriterError> = std::result::Result<T, E>;

/// What can stop a stream.
#[derive(Debug, thiserror::Error)]
pub enum WriterError {
    /// Changes the stream needs were purged by CDC cleanup.
    #[error(
        "table {table}: changes after {from} were purged by CDC cleanup before they were read \
         ({message}); set on_data_loss = resnapshot (--on-data-loss resnapshot) to heal it by a \
         re-snapshot, or fail_on_data_loss = false to skip to min_lsn \
         (the skipped changes are lost)"
    )]
    DataLoss {
        /// The source table.
        table: String,
        /// The offset the stream stood at.
        from: Lsn,
        /// The server's message (capture instance, requested LSN, min_lsn).
        message: String,
    },
    /// Changes were purged again within `resnapshot_interval_days` of the last heal: the
    /// seed's anti-loop guard refuses another automatic re-snapshot (the message says why and
    /// how to go on).
    #[error("table {table}: {message}")]
    ResnapshotRefused {
        /// The source table.
        table: String,
        /// What happened and the way on.
        message: String,
    },
    /// The checkpoint does not match the facts table (deleted or rewound under the same app_id).
    #[error("{0}")]
    CheckpointMismatch(String),
    /// Another writer of the same app id claimed the batch this one planned (the checkpoint's
    /// fence): this writer stops before reading or writing anything.
    #[error("{0}")]
    Fenced(String),
    /// The source delivers a column type the target table cannot hold.
    #[error("{0}")]
    SchemaChanged(String),
    /// Bad configuration or input.
    #[error("{0}")]
    InvalidArgument(String),
    /// The server refused or failed a call.
    #[error("flight: {0}")]
    Flight(#[from] ClientError),
    /// Delta failed.
    #[error("delta: {0}")]
    Delta(#[from] deltalake::DeltaTableError),
    /// A DataFusion query over a lake table failed.
    #[error("query: {0}")]
    Query(#[from] deltalake::datafusion::error::DataFusionError),
    /// Reading or writing a Parquet file failed.
    #[error("parquet: {0}")]
    Parquet(#[from] deltalake::parquet::errors::ParquetError),
    /// The object store failed.
    #[error("storage: {0}")]
    Storage(#[from] deltalake::ObjectStoreError),
    /// Arrow failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Local I/O (the checkpoint).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

impl WriterError {
    /// An [`WriterError::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        WriterError::InvalidArgument(message.into())
    }

    /// Whether the server did not answer ([`ClientError::is_transient`]: a restart, a cut
    /// connection, a stream ended without its completion marker).
    pub fn is_transient(&self) -> bool {
        matches!(self, WriterError::Flight(error) if error.is_transient())
    }

    /// Whether redoing the unit of work the error cut (a batch, a backfill call, a snapshot
    /// open) from what the lake and the checkpoint record can succeed: the server did not
    /// answer, or refused a ticket it signed before (it restarted with another key, or the
    /// ticket outlived its lifetime: planning again gives fresh ones).
    pub fn is_redoable(&self) -> bool {
        matches!(self, WriterError::Flight(error) if error.is_transient() || error.is_stale_ticket())
    }
}
