//! Connections to SQL Server: a small bb8 pool of tiberius 0.13 clients, and retries.
//!
//! No pool crate supports tiberius 0.13 yet, so the manager is here. A connection is marked
//! dirty when a result stream starts and clean only when the stream was read to its end or
//! the query was cancelled (TDS attention); the pool drops a dirty connection instead of
//! handing it out, because a half-read result would be drained by the next query. Every
//! streaming read takes its own connection, so the partitions of one plan read in parallel.
//!
//! Transient failures (the network, login timeouts, a deadlock victim, Azure SQL's
//! reconfiguration errors) are retried three times on a new connection with backoff 1-2 s,
//! 2-4 s and 4-8 s, as ADR 0029 does for planning calls; other errors are returned at once.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tiberius::{AuthMethod, Client, Config};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use super::sql;
use crate::error::{Error, Result};

/// A tiberius client over tokio's TCP stream.
pub type TdsClient = Client<Compat<TcpStream>>;

/// A pooled connection and whether a result stream on it was left unfinished.
pub struct Connection {
    /// The client.
    pub client: TdsClient,
    /// Set while a result stream is being read; a dirty connection is never reused.
    pub dirty: bool,
}

/// Opens tiberius connections; follows Azure SQL's redirect once.
#[derive(Clone)]
pub struct Manager {
    config: Config,
    trusts_any_certificate: bool,
    access_token_file: Option<PathBuf>,
}

impl Manager {
    /// A manager for `config`; with `access_token_file`, every connect logs in with the
    /// Microsoft Entra ID access token the file holds at that moment.
    pub fn new(
        config: Config,
        trusts_any_certificate: bool,
        access_token_file: Option<PathBuf>,
    ) -> Self {
        Manager {
            config,
            trusts_any_certificate,
            access_token_file,
        }
    }

    /// The login of the next connection: the access token file read now (a refreshed token
    /// is used from the next connect on), or `None` for the configured login.
    async fn access_token(file: Option<&Path>) -> tiberius::Result<Option<AuthMethod>> {
        let Some(path) = file else {
            return Ok(None);
        };
        let unreadable = |kind, message: String| tiberius::error::Error::Io { kind, message };
        let text = tokio::fs::read_to_string(path).await.map_err(|error| {
            unreadable(
                error.kind(),
                format!("reading the access token file {}: {error}", path.display()),
            )
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(unreadable(
                std::io::ErrorKind::InvalidData,
                format!("the access token file {} is empty", path.display()),
            ));
        }
        Ok(Some(AuthMethod::aad_token(token)))
    }

    async fn open(config: Config) -> tiberius::Result<TdsClient> {
        let tcp = TcpStream::connect(config.get_addr()).await?;
        tcp.set_nodelay(true)?;
        Client::connect(config, tcp.compat_write()).await
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Connection;
    type Error = tiberius::error::Error;

    fn connect(&self) -> impl Future<Output = tiberius::Result<Connection>> + Send {
        let mut config = self.config.clone();
        let trusts_any = self.trusts_any_certificate;
        let token_file = self.access_token_file.clone();
        async move {
            if let Some(login) = Self::access_token(token_file.as_deref()).await? {
                config.authentication(login);
            }
            if trusts_any {
                tracing::warn!(
                    "trusting any SQL Server certificate (trust_server_certificate): the \
                     connection can be intercepted; pin the server's CA with ca= instead"
                );
            }
            let client = match Self::open(config.clone()).await {
                Err(tiberius::error::Error::Routing { host, port }) => {
                    let mut routed = config;
                    routed.host(&host);
                    routed.port(port);
                    Self::open(routed).await?
                }
                other => other?,
            };
            Ok(Connection {
                client,
                dirty: false,
            })
        }
    }

    async fn is_valid(&self, connection: &mut Connection) -> tiberius::Result<()> {
        connection
            .client
            .simple_query(sql::ping())
            .await?
            .into_results()
            .await?;
        Ok(())
    }

    fn has_broken(&self, connection: &mut Connection) -> bool {
        connection.dirty
    }
}

/// The pool of one source.
///
/// bb8 0.9 connects in the background and a waiting `get` only learns of a failed connect by
/// timing out, so when no connection is idle a new one is opened here, in the caller's task:
/// a refused connection or a failed login is reported at once, with SQL Server's message.
#[derive(Clone)]
pub struct Connections {
    pool: bb8::Pool<Manager>,
    manager: Manager,
    max_size: u32,
}

/// How long a caller waits for a connection another read holds.
const CHECKOUT_TIMEOUT: Duration = Duration::from_secs(30);

impl Connections {
    /// A pool of at most `max_size` connections.
    pub fn new(manager: Manager, max_size: u32) -> Self {
        let pool = bb8::Pool::builder()
            .max_size(max_size)
            .min_idle(Some(0))
            .connection_timeout(CHECKOUT_TIMEOUT)
            // A connection that failed a query is dirty and never handed out again, so no
            // ping on every checkout; failed connects are retried by `with_retries`.
            .retry_connection(false)
            .test_on_check_out(false)
            .build_unchecked(manager.clone());
        Connections {
            pool,
            manager,
            max_size,
        }
    }

    /// A connection: an idle one, a new one while the pool has room, else the next one
    /// returned (waiting at most 30 s).
    pub async fn get(&self) -> Result<bb8::PooledConnection<'static, Manager>> {
        let state = self.pool.state();
        if state.idle_connections == 0 && state.connections < self.max_size {
            use bb8::ManageConnection as _;
            let connection = self.manager.connect().await.map_err(source_error)?;
            // Full meanwhile: the extra connection is closed.
            let _ = self.pool.add(connection);
        }
        self.pool.get_owned().await.map_err(|error| match error {
            bb8::RunError::User(error) => source_error(error),
            bb8::RunError::TimedOut => Error::SourceUnavailable(format!(
                "every one of the {} SQL Server connections stayed busy for {} s",
                self.max_size,
                CHECKOUT_TIMEOUT.as_secs()
            )),
        })
    }
}

/// SQL Server error numbers worth a retry on a new connection: deadlock victim (1205,
/// SQLSTATE 40001), lock request timeout (1222), login and network failures, Azure SQL's
/// transient errors (database unavailable, reconfiguration, throttling).
/// <https://learn.microsoft.com/azure/azure-sql/database/troubleshoot-common-errors-issues>
const TRANSIENT_CODES: [u32; 15] = [
    20, 64, 233, 1205, 1222, 4060, 4221, 10053, 10054, 10060, 10928, 10929, 40197, 40501, 40613,
];

/// Whether a tiberius error may pass on a new connection.
pub fn is_transient(error: &tiberius::error::Error) -> bool {
    use tiberius::error::Error as E;
    match error {
        E::Io { .. } | E::Routing { .. } => true,
        E::Server(token) => {
            TRANSIENT_CODES.contains(&token.code()) || (49918..=49920).contains(&token.code())
        }
        _ => false,
    }
}

/// SQL Server errors a request's own values cause (a key bound that does not convert to the
/// key's type, an LSN range `cdc.fn_cdc_get_all_changes_*` refuses): the client's to fix, so
/// `INVALID_ARGUMENT` and logged at debug, not `INTERNAL`. 241/242/295: date and time
/// conversion; 245/8114: conversion; 8115: arithmetic overflow; 313: too few arguments (the
/// CDC table functions' answer to a range outside the instance).
/// <https://learn.microsoft.com/sql/relational-databases/errors-events/database-engine-events-and-errors>
const CLIENT_CAUSED_CODES: &[u32] = &[241, 242, 245, 295, 313, 8114, 8115];

/// A tiberius error as this crate's error. Transient failures become
/// [`Error::SourceUnavailable`]; others keep SQL Server's message (never the connection
/// string, which tiberius does not include in errors).
pub fn source_error(error: tiberius::error::Error) -> Error {
    if is_transient(&error) {
        Error::SourceUnavailable(error.to_string())
    } else {
        match &error {
            tiberius::error::Error::Server(token) if matches!(token.code(), 229 | 230) => {
                Error::GrantMissing(format!(
                    "SQL Server refused a read: {} (sql/least_privilege.sql lists the grants \
                     the server's login needs)",
                    token.message()
                ))
            }
            tiberius::error::Error::Server(token)
                if CLIENT_CAUSED_CODES.contains(&token.code()) =>
            {
                Error::invalid(format!(
                    "SQL Server refused the request's values: error {}: {}",
                    token.code(),
                    token.message()
                ))
            }
            tiberius::error::Error::Server(token) => Error::Internal(format!(
                "SQL Server error {}: {}",
                token.code(),
                token.message()
            )),
            _ => Error::Internal(format!("SQL Server: {error}")),
        }
    }
}

/// Backoff before retry `attempt` (1-based): a random wait in `[base * 2^(attempt-1),
/// 2 * base * 2^(attempt-1))`, so 1-2 s, 2-4 s, 4-8 s for a base of one second.
pub fn backoff(base: Duration, attempt: u32) -> Duration {
    let low = base * 2u32.pow(attempt.saturating_sub(1));
    // Jitter from the clock's nanoseconds: enough to spread retries of many replicas.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.subsec_nanos())
        .unwrap_or(0);
    let jitter = f64::from(nanos) / 1e9;
    low + low.mul_f64(jitter)
}

/// Runs `call` and retries it up to `retries` times while it fails with a transient error,
/// waiting [`backoff`] between tries and logging each retry.
pub async fn with_retries<T, F, Fut>(
    what: &str,
    retries: u32,
    base: Duration,
    mut call: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match call().await {
            Err(error) if error.is_transient() && attempt < retries => {
                attempt += 1;
                let wait = backoff(base, attempt);
                tracing::warn!(
                    "{what} failed ({error}); retry {attempt} of {retries} in {:.1} s",
                    wait.as_secs_f64()
                );
                tokio::time::sleep(wait).await;
            }
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test]
    async fn each_connect_reads_the_access_token_file_anew() {
        let directory = tempfile::tempdir().expect("temp dir");
        let path = directory.path().join("entra-token");
        let read = || Manager::access_token(Some(&path));
        let missing = read().await.expect_err("no file yet");
        assert!(missing.to_string().contains("entra-token"), "{missing}");
        std::fs::write(&path, "first-token\n").expect("write");
        assert_eq!(
            read().await.expect("read"),
            Some(AuthMethod::aad_token("first-token"))
        );
        // Refreshed by whatever renews it: the next connect logs in with the new token.
        std::fs::write(&path, "second-token").expect("write");
        assert_eq!(
            read().await.expect("read"),
            Some(AuthMethod::aad_token("second-token"))
        );
        std::fs::write(&path, "  \n").expect("write");
        let empty = read().await.expect_err("empty");
        assert!(empty.to_string().contains("is empty"), "{empty}");
        assert_eq!(Manager::access_token(None).await.expect("none"), None);
    }

    #[test]
    fn backoff_doubles_within_its_window() {
        let base = Duration::from_secs(1);
        for (attempt, (low, high)) in [(1, (1.0, 2.0)), (2, (2.0, 4.0)), (3, (4.0, 8.0))] {
            for _ in 0..50 {
                let wait = backoff(base, attempt).as_secs_f64();
                assert!(wait >= low && wait < high, "attempt {attempt}: {wait}");
            }
        }
    }

    #[tokio::test]
    async fn transient_errors_are_retried_and_others_are_not() {
        let calls = AtomicU32::new(0);
        let outcome = with_retries("probe", 3, Duration::from_millis(1), || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(Error::SourceUnavailable("connection reset".into())),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(outcome.expect("third try"), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        let calls = AtomicU32::new(0);
        let outcome: Result<()> = with_retries("probe", 3, Duration::from_millis(1), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::invalid("bad input"))
        })
        .await;
        assert!(outcome.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "not transient: no retry");

        let calls = AtomicU32::new(0);
        let outcome: Result<()> = with_retries("probe", 2, Duration::from_millis(1), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(Error::SourceUnavailable("down".into()))
        })
        .await;
        assert!(outcome.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 3, "one try and two retries");
    }

    #[test]
    fn io_errors_and_azure_codes_are_transient() {
        let io = tiberius::error::Error::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(is_transient(&io));
        assert!(!is_transient(&tiberius::error::Error::Conversion(
            "bad".into()
        )));
        assert!(matches!(source_error(io), Error::SourceUnavailable(_)));
    }
}
