//! Connections to SQL Server: a small pool of tiberius 0.13 clients, and retries.
//!
//! A connection is marked dirty when a result stream starts and clean only when the stream
//! was read to its end or the query was cancelled (TDS attention); the pool drops a dirty
//! connection instead of handing it out, because a half-read result would be drained by the
//! next query. A statement whose caller stopped waiting (a call past its deadline, a client
//! gone) still runs on SQL Server until it is told: the pool first cancels it (at most
//! [`CANCEL_TIMEOUT`]) and keeps the connection's place meanwhile, so no more than
//! `pool_size` statements run for this server, abandoned ones included. Every streaming read holds its own connection for its whole stream, so the
//! partitions of one plan read in parallel.
//!
//! The pool is ours (no pool crate supports tiberius 0.13, and bb8 0.9 connects in the
//! background, so a caller learned of a refused login only by timing out): a fair (FIFO)
//! semaphore of `pool_size` permits, one per connection that may exist, and a stack of idle
//! connections. A caller takes a permit (waiting in line, at most `checkout_timeout_s`, 300 s
//! by default, then `UNAVAILABLE` saying so; past [`MAX_WAITING`] callers in line at once,
//! at once), then an idle connection, else opens one in its own task, so a failed login is
//! its error at once. No more than `pool_size` connections exist or are being opened, so a
//! burst of reads makes no burst of logins.
//!
//! Transient failures (the network, login timeouts, a deadlock victim, Azure SQL's
//! reconfiguration errors) are retried three times on a new connection with backoff 1-2 s,
//! 2-4 s and 4-8 s (backon), as ADR 0029 does for planning calls; other errors, and a
//! command timeout, are returned at once.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tiberius::{AuthMethod, Client, Config};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use crate::error::{Error, Result};
use crate::mssql::sql;

/// A tiberius client over tokio's TCP stream.
pub type TdsClient = Client<Compat<TcpStream>>;

/// A pooled connection and whether a result stream on it was left unfinished.
pub struct Connection {
    /// The client.
    pub client: TdsClient,
    /// Set while a result stream is being read; a dirty connection is never reused.
    pub dirty: bool,
    /// Set when a statement on it changed session options (a source read's lock timeout or
    /// isolation): they are reset before the connection serves another caller.
    pub session_options: bool,
}

/// Opens tiberius connections; follows Azure SQL's redirect once.
#[derive(Clone)]
pub struct Manager {
    config: Config,
    trusts_any_certificate: bool,
    access_token_file: Option<PathBuf>,
    login_timeout: Option<Duration>,
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
            login_timeout: Some(crate::mssql::config::DEFAULT_LOGIN_TIMEOUT),
        }
    }

    /// The same manager with `timeout` as the bound of each connect (TCP, TLS, login and a
    /// redirect followed, together); `None`: no bound.
    pub fn with_login_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.login_timeout = timeout;
        self
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

/// What the pool pools: opens connections and tells a broken one.
pub trait Connector: Send + Sync + 'static {
    /// The pooled connection.
    type Connection: Send + 'static;
    /// Opens a new connection.
    fn connect(&self) -> impl Future<Output = tiberius::Result<Self::Connection>> + Send;
    /// Whether a returned connection must be closed instead of reused.
    fn is_broken(connection: &Self::Connection) -> bool;
    /// Whether an idle connection carries session state the next caller must not inherit.
    fn needs_reset(connection: &Self::Connection) -> bool;
    /// Restores an idle connection's session defaults before it is handed out again.
    fn reset(
        &self,
        connection: &mut Self::Connection,
    ) -> impl Future<Output = tiberius::Result<()>> + Send;
    /// Tells the server to stop the statement a broken connection may still run (TDS
    /// attention).
    fn cancel(
        &self,
        connection: &mut Self::Connection,
    ) -> impl Future<Output = tiberius::Result<()>> + Send;
}

impl Connector for Manager {
    type Connection = Connection;

    /// Opens a connection: the access token of the moment, Azure SQL's redirect followed.
    async fn connect(&self) -> tiberius::Result<Connection> {
        let mut config = self.config.clone();
        if let Some(login) = Self::access_token(self.access_token_file.as_deref()).await? {
            config.authentication(login);
        }
        if self.trusts_any_certificate {
            tracing::warn!(
                "trusting any SQL Server certificate (trust_server_certificate): the \
                 connection can be intercepted; pin the server's CA with ca= instead"
            );
        }
        // No bound asked for: a day, longer than any login.
        let bound = self.login_timeout.unwrap_or(Duration::from_secs(86_400));
        let opened = tokio::time::timeout(bound, async {
            match Self::open(config.clone()).await {
                Err(tiberius::error::Error::Routing { host, port }) => {
                    let mut routed = config;
                    routed.host(&host);
                    routed.port(port);
                    Self::open(routed).await
                }
                other => other,
            }
        })
        .await;
        let client = opened.map_err(|_| tiberius::error::Error::Io {
            kind: std::io::ErrorKind::TimedOut,
            message: format!(
                "opening a connection took longer than the login timeout of {} s \
                 (login_timeout_s)",
                bound.as_secs()
            ),
        })??;
        Ok(Connection {
            client,
            dirty: false,
            session_options: false,
        })
    }

    fn is_broken(connection: &Connection) -> bool {
        connection.dirty
    }

    fn needs_reset(connection: &Connection) -> bool {
        connection.session_options
    }

    async fn cancel(&self, connection: &mut Connection) -> tiberius::Result<()> {
        connection.client.cancel_query().await
    }

    /// Restores the session defaults as a plain batch (a `SET` there lasts for the session).
    async fn reset(&self, connection: &mut Connection) -> tiberius::Result<()> {
        connection
            .client
            .simple_query(sql::reset_session_options())
            .await?
            .into_results()
            .await?;
        connection.session_options = false;
        Ok(())
    }
}

/// How long the pool waits for SQL Server to acknowledge the cancel of an abandoned
/// statement before it closes the connection anyway.
pub const CANCEL_TIMEOUT: Duration = Duration::from_secs(10);

/// Most callers waiting in line for a connection at once; one more is refused at once.
pub const MAX_WAITING: usize = 1024;

/// Idle connections older than this are closed rather than reused (SQL Server, a load
/// balancer or a firewall may have dropped them meanwhile).
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// The default of `checkout_timeout_s`: how long a caller waits in line for a connection.
pub const DEFAULT_CHECKOUT_TIMEOUT: Duration = Duration::from_secs(300);

/// The pool of one source.
pub struct Pool<C: Connector> {
    shared: Arc<Shared<C>>,
}

impl<C: Connector> Clone for Pool<C> {
    fn clone(&self) -> Self {
        Pool {
            shared: Arc::clone(&self.shared),
        }
    }
}

struct Shared<C: Connector> {
    connector: C,
    /// One permit per connection that may exist (idle, in use or being opened).
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<(Instant, C::Connection)>>,
    waiting: AtomicUsize,
    size: u32,
    checkout_timeout: Duration,
}

/// The pool of SQL Server connections.
pub type Connections = Pool<Manager>;

impl<C: Connector> Pool<C> {
    /// A pool of at most `size` connections whose callers wait at most `checkout_timeout`.
    pub fn new(connector: C, size: u32, checkout_timeout: Duration) -> Self {
        Pool {
            shared: Arc::new(Shared {
                connector,
                permits: Arc::new(Semaphore::new(size as usize)),
                idle: Mutex::new(Vec::new()),
                waiting: AtomicUsize::new(0),
                size,
                checkout_timeout,
            }),
        }
    }

    /// A connection: first in line for a permit, then an idle connection or a new one.
    pub async fn get(&self) -> Result<Pooled<C>> {
        let shared = &self.shared;
        let permit = match Arc::clone(&shared.permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // Leaves the line when the wait ends, also when its caller drops it.
                let in_line = InLine::join(&shared.waiting);
                if in_line.ahead >= MAX_WAITING {
                    return Err(Error::SourceUnavailable(format!(
                        "{MAX_WAITING} reads already wait for one of the {} SQL Server \
                         connections; raise pool_size or read fewer partitions at once",
                        shared.size
                    )));
                }
                let waited = tokio::time::timeout(
                    shared.checkout_timeout,
                    Arc::clone(&shared.permits).acquire_owned(),
                )
                .await;
                drop(in_line);
                match waited {
                    Ok(permit) => {
                        permit.map_err(|_| Error::Internal("the pool is closed".into()))?
                    }
                    Err(_) => {
                        return Err(Error::SourceUnavailable(format!(
                            "every one of the {} SQL Server connections stayed busy for {} s \
                             (checkout_timeout_s); raise pool_size or checkout_timeout_s",
                            shared.size,
                            shared.checkout_timeout.as_secs()
                        )));
                    }
                }
            }
        };
        let idle = {
            let mut idle = shared.idle.lock().unwrap_or_else(PoisonError::into_inner);
            // Oldest first: the stale ones are at the bottom.
            idle.retain(|(since, _)| since.elapsed() < IDLE_TIMEOUT);
            idle.pop()
        };
        let connection = match idle {
            Some((_, mut connection)) if C::needs_reset(&connection) => {
                match shared.connector.reset(&mut connection).await {
                    Ok(()) => Some(connection),
                    Err(error) => {
                        // A new session starts with the defaults.
                        tracing::debug!(%error, "resetting a pooled connection failed; opening another");
                        None
                    }
                }
            }
            idle => idle.map(|(_, connection)| connection),
        };
        let connection = match connection {
            Some(connection) => connection,
            // The permit is released with the error: the next in line tries its own connect.
            None => shared.connector.connect().await.map_err(source_error)?,
        };
        Ok(Pooled {
            connection: Some(connection),
            pool: Arc::clone(shared),
            permit: Some(permit),
        })
    }
}

/// A caller's place in the line for a connection, counted while it lasts.
struct InLine<'a> {
    waiting: &'a AtomicUsize,
    /// Callers in line before this one.
    ahead: usize,
}

impl<'a> InLine<'a> {
    fn join(waiting: &'a AtomicUsize) -> Self {
        let ahead = waiting.fetch_add(1, Ordering::SeqCst);
        InLine { waiting, ahead }
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection taken from the pool: returned when dropped, unless broken.
pub struct Pooled<C: Connector> {
    connection: Option<C::Connection>,
    pool: Arc<Shared<C>>,
    // Dropped after the connection went back, so the next in line finds it idle; or, for a
    // broken one, once its statement is cancelled.
    permit: Option<OwnedSemaphorePermit>,
}

impl<C: Connector> std::ops::Deref for Pooled<C> {
    type Target = C::Connection;

    fn deref(&self) -> &C::Connection {
        self.connection
            .as_ref()
            .expect("a pooled connection until dropped")
    }
}

impl<C: Connector> std::ops::DerefMut for Pooled<C> {
    fn deref_mut(&mut self) -> &mut C::Connection {
        self.connection
            .as_mut()
            .expect("a pooled connection until dropped")
    }
}

impl<C: Connector> Drop for Pooled<C> {
    fn drop(&mut self) {
        let Some(mut connection) = self.connection.take() else {
            return;
        };
        if !C::is_broken(&connection) {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((Instant::now(), connection));
            return;
        }
        // A statement may still run on it (its caller's future was dropped): SQL Server goes
        // on until told, so tell it, then close the connection. Its place in the pool is
        // held until then.
        let (Ok(runtime), Some(permit)) =
            (tokio::runtime::Handle::try_current(), self.permit.take())
        else {
            return;
        };
        let pool = Arc::clone(&self.pool);
        runtime.spawn(async move {
            let cancelled =
                tokio::time::timeout(CANCEL_TIMEOUT, pool.connector.cancel(&mut connection)).await;
            if !matches!(cancelled, Ok(Ok(()))) {
                tracing::debug!("an abandoned statement's cancel failed; its connection is closed");
            }
            drop(connection);
            drop(permit);
        });
    }
}

/// SQL Server error numbers worth a retry on a new connection: deadlock victim (1205,
/// SQLSTATE 40001), lock request timeout (1222), login and network failures, Azure SQL's
/// transient errors (database unavailable, reconfiguration, throttling).
/// <https://learn.microsoft.com/azure/azure-sql/database/troubleshoot-common-errors-issues>
const TRANSIENT_CODES: [u32; 15] = [
    20, 64, 233, 1205, 1222, 4060, 4221, 10053, 10054, 10060, 10928, 10929, 40197, 40501, 40613,
];

/// Whether a tiberius error is its command timeout (`command_timeout_s`): SQL Server did not
/// answer a statement in time. Never retried: the statement would run as long again.
/// tiberius reports it as an I/O `TimedOut` that leaves the connection out of sync (a
/// handshake or TCP timeout is a `TimedOut` too, and is retried).
pub fn is_command_timeout(error: &tiberius::error::Error) -> bool {
    matches!(error, tiberius::error::Error::Io { kind: std::io::ErrorKind::TimedOut, message }
        if message.contains("out of sync") || message.contains("command timeout"))
}

/// Whether a tiberius error may pass on a new connection.
pub fn is_transient(error: &tiberius::error::Error) -> bool {
    use tiberius::error::Error as E;
    match error {
        _ if is_command_timeout(error) => false,
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
    if is_command_timeout(&error) {
        Error::DeadlineExceeded(format!(
            "SQL Server did not answer within command_timeout_s: {error}"
        ))
    } else if is_transient(&error) {
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

/// Runs `call` and retries it up to `retries` times while it fails with a transient error,
/// logging each retry. The waits double from `base` with jitter (backon's exponential
/// backoff): 1-2 s, 2-4 s, 4-8 s for a base of one second.
pub async fn with_retries<T, F, Fut>(what: &str, retries: u32, base: Duration, call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    use backon::{ExponentialBuilder, Retryable};
    let policy = ExponentialBuilder::default()
        .with_min_delay(base)
        .with_factor(2.0)
        .with_max_delay(base * 2u32.pow(retries))
        .with_max_times(retries as usize)
        .with_jitter();
    let mut attempt = 0;
    call.retry(policy)
        .sleep(tokio::time::sleep)
        .when(Error::is_transient)
        .notify(|error, wait| {
            attempt += 1;
            tracing::warn!(
                "{what} failed ({error}); retry {attempt} of {retries} in {:.1} s",
                wait.as_secs_f64()
            );
        })
        .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Connections numbered in the order they were opened; `broken` set by the test.
    #[derive(Default)]
    struct Fake {
        opened: AtomicU32,
        opening: AtomicU32,
        most_opening: AtomicU32,
        refuse: std::sync::atomic::AtomicBool,
        refuse_reset: std::sync::atomic::AtomicBool,
        resets: AtomicU32,
        cancels: AtomicU32,
        /// Released by the test to let a cancel finish.
        cancel_gate: tokio::sync::Notify,
        slow_cancel: std::sync::atomic::AtomicBool,
    }

    struct FakeConnection {
        number: u32,
        broken: bool,
        /// Session options a read changed, as `SET LOCK_TIMEOUT` would.
        lock_timeout: Option<u32>,
    }

    impl Connector for Arc<Fake> {
        type Connection = FakeConnection;

        fn connect(&self) -> impl Future<Output = tiberius::Result<FakeConnection>> + Send {
            let fake = Arc::clone(self);
            async move {
                let now = fake.opening.fetch_add(1, Ordering::SeqCst) + 1;
                fake.most_opening.fetch_max(now, Ordering::SeqCst);
                // A TLS login takes a while: a burst of callers overlaps here.
                tokio::time::sleep(Duration::from_millis(20)).await;
                fake.opening.fetch_sub(1, Ordering::SeqCst);
                if fake.refuse.load(Ordering::SeqCst) {
                    return Err(tiberius::error::Error::Protocol(
                        "Login failed for user 'cdc'.".into(),
                    ));
                }
                Ok(FakeConnection {
                    number: fake.opened.fetch_add(1, Ordering::SeqCst),
                    broken: false,
                    lock_timeout: None,
                })
            }
        }

        fn is_broken(connection: &FakeConnection) -> bool {
            connection.broken
        }

        fn needs_reset(connection: &FakeConnection) -> bool {
            connection.lock_timeout.is_some()
        }

        fn reset(
            &self,
            connection: &mut FakeConnection,
        ) -> impl Future<Output = tiberius::Result<()>> + Send {
            let fail = self.refuse_reset.load(Ordering::SeqCst);
            self.resets.fetch_add(1, Ordering::SeqCst);
            if !fail {
                connection.lock_timeout = None;
            }
            async move {
                if fail {
                    return Err(tiberius::error::Error::Protocol("connection reset".into()));
                }
                Ok(())
            }
        }

        fn cancel(
            &self,
            _connection: &mut FakeConnection,
        ) -> impl Future<Output = tiberius::Result<()>> + Send {
            let fake = Arc::clone(self);
            async move {
                if fake.slow_cancel.load(Ordering::SeqCst) {
                    fake.cancel_gate.notified().await;
                }
                fake.cancels.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_statement_is_cancelled_before_its_place_is_given_back() {
        let fake = Arc::new(Fake::default());
        fake.slow_cancel.store(true, Ordering::SeqCst);
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_secs(30));
        let mut abandoned = pool.get().await.expect("a connection");
        abandoned.broken = true;
        let first = abandoned.number;
        drop(abandoned);
        let next = tokio::spawn({
            let pool = pool.clone();
            async move { pool.get().await.map(|connection| connection.number) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !next.is_finished(),
            "the place is held while the abandoned statement is cancelled"
        );
        fake.cancel_gate.notify_one();
        let number = tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("the place is given back")
            .expect("joined")
            .expect("a connection");
        assert_eq!(fake.cancels.load(Ordering::SeqCst), 1);
        assert_ne!(
            number, first,
            "the cancelled connection is closed, not reused"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_opens_at_most_pool_size_connections_and_waits_in_line() {
        let fake = Arc::new(Fake::default());
        let pool = Pool::new(Arc::clone(&fake), 3, Duration::from_secs(30));
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        for reader in 0..12 {
            let (pool, served) = (pool.clone(), Arc::clone(&served));
            readers.push(tokio::spawn(async move {
                let connection = pool.get().await.expect("a connection");
                served.lock().expect("lock").push(reader);
                // A stream holds its connection while it is read.
                tokio::time::sleep(Duration::from_millis(30)).await;
                drop(connection);
            }));
            // Callers arrive one after another.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for reader in readers {
            reader.await.expect("reader");
        }
        assert_eq!(
            fake.opened.load(Ordering::SeqCst),
            3,
            "a connection per permit, reused"
        );
        assert!(
            fake.most_opening.load(Ordering::SeqCst) <= 3,
            "no login storm"
        );
        let served = served.lock().expect("lock").clone();
        assert_eq!(
            served[3..],
            (3..12).collect::<Vec<_>>(),
            "waiters served first come, first served"
        );
    }

    #[tokio::test]
    async fn a_refused_login_is_the_callers_error_at_once_and_frees_its_place() {
        let fake = Arc::new(Fake::default());
        fake.refuse.store(true, Ordering::SeqCst);
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_secs(30));
        let started = Instant::now();
        let Err(error) = pool.get().await else {
            panic!("refused");
        };
        assert!(error.to_string().contains("Login failed"), "{error}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "not after the checkout timeout"
        );
        fake.refuse.store(false, Ordering::SeqCst);
        assert!(
            pool.get().await.is_ok(),
            "the failed connect gave its permit back"
        );
    }

    #[tokio::test]
    async fn a_broken_connection_is_closed_and_a_busy_pool_answers_unavailable_in_time() {
        let fake = Arc::new(Fake::default());
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_millis(100));
        let mut first = pool.get().await.expect("connection");
        assert_eq!(first.number, 0);
        let Err(error) = pool.get().await else {
            panic!("busy");
        };
        assert!(matches!(error, Error::SourceUnavailable(_)), "{error}");
        assert!(error.to_string().contains("checkout_timeout_s"), "{error}");
        first.broken = true;
        drop(first);
        assert_eq!(pool.get().await.expect("connection").number, 1, "a new one");
        assert_eq!(pool.get().await.expect("connection").number, 1, "reused");
    }

    /// [`MAX_WAITING`] callers waiting for a connection of `pool`, once all are in line.
    async fn fill_the_line(pool: &Pool<Arc<Fake>>) -> Vec<tokio::task::JoinHandle<Result<()>>> {
        let waiting: Vec<_> = (0..MAX_WAITING)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.get().await.map(|_| ()) })
            })
            .collect();
        while pool.shared.waiting.load(Ordering::SeqCst) < MAX_WAITING {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        waiting
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_line_is_bounded() {
        let fake = Arc::new(Fake::default());
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_secs(30));
        let held = pool.get().await.expect("connection");
        let waiting = fill_the_line(&pool).await;
        let Err(error) = pool.get().await else {
            panic!("the line is full");
        };
        assert!(error.to_string().contains("already wait"), "{error}");
        drop(held);
        for waiter in waiting {
            waiter.await.expect("waiter").expect("served in the end");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_that_give_up_leave_the_line() {
        let fake = Arc::new(Fake::default());
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_secs(30));
        let held = pool.get().await.expect("connection");
        let waiting = fill_the_line(&pool).await;
        for waiter in &waiting {
            waiter.abort();
        }
        for waiter in waiting {
            assert!(waiter.await.expect_err("aborted").is_cancelled());
        }
        assert_eq!(pool.shared.waiting.load(Ordering::SeqCst), 0);
        drop(held);
        pool.get().await.expect("the line is free again");
    }

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
        // tiberius' command timeout (its wording, tiberius 0.13 src/tds/stream/token.rs).
        let command_timeout = tiberius::error::Error::Io {
            kind: std::io::ErrorKind::TimedOut,
            message: "the server did not send the next part of the command result within 30s \
                      (it may have stalled, or be responding too slowly for the configured \
                      bound); the connection is now out of sync and must be dropped."
                .into(),
        };
        assert!(
            !is_transient(&command_timeout),
            "a command timeout is never retried"
        );
        let error = source_error(command_timeout);
        assert!(matches!(error, Error::DeadlineExceeded(_)), "{error}");
        assert!(!error.is_transient());
        assert!(error.to_string().contains("command_timeout_s"), "{error}");
        let handshake = tiberius::error::Error::Io {
            kind: std::io::ErrorKind::TimedOut,
            message: "the connection handshake (prelogin, TLS negotiation and login) did not \
                      complete within 15s"
                .into(),
        };
        assert!(is_transient(&handshake), "a login that stalled is retried");
    }

    #[tokio::test]
    async fn session_options_a_read_set_are_reset_before_the_connection_serves_again() {
        let fake = Arc::new(Fake::default());
        let pool = Pool::new(Arc::clone(&fake), 1, Duration::from_secs(5));
        let mut snapshot_read = pool.get().await.expect("connection");
        snapshot_read.lock_timeout = Some(250);
        let first = snapshot_read.number;
        drop(snapshot_read);
        let change_read = pool.get().await.expect("connection");
        assert_eq!(change_read.number, first, "the same connection, reused");
        assert_eq!(change_read.lock_timeout, None, "without the lock timeout");
        assert_eq!(fake.resets.load(Ordering::SeqCst), 1);
        drop(change_read);
        // A clean connection is handed out without a round trip.
        drop(pool.get().await.expect("connection"));
        assert_eq!(fake.resets.load(Ordering::SeqCst), 1);
        // A connection whose reset fails is closed and replaced by a new session.
        let mut snapshot_read = pool.get().await.expect("connection");
        snapshot_read.lock_timeout = Some(250);
        drop(snapshot_read);
        fake.refuse_reset.store(true, Ordering::SeqCst);
        let change_read = pool.get().await.expect("connection");
        assert_ne!(change_read.number, first, "a new connection");
        assert_eq!(change_read.lock_timeout, None);
    }

    #[tokio::test]
    async fn a_server_that_accepts_but_never_answers_fails_the_connect_at_the_login_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listener");
        let address = listener.local_addr().expect("address");
        // Accepts and holds the connection without a byte of TDS.
        let held = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(socket);
        });
        let config = crate::mssql::config::SqlServerConfig::parse(&format!(
            "mssql://u:p@127.0.0.1:{}/db?login_timeout_s=1",
            address.port()
        ))
        .expect("config");
        let manager =
            Manager::new(config.tiberius, false, None).with_login_timeout(config.login_timeout);
        let started = Instant::now();
        let error = match manager.connect().await {
            Ok(_) => panic!("a silent server cannot log in"),
            Err(error) => error,
        };
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert!(
            error.to_string().contains("login timeout of 1 s"),
            "{error}"
        );
        assert!(is_transient(&error), "retried, as a stalled login is");
        held.abort();
    }
}
