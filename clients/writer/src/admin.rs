//! The sidecar's admin service over gRPC (`proto/mssql_cdc_admin.proto`): open a full or
//! chunked snapshot of a table, its status, pause and resume, and reconcile its silver.
//!
//! Every call works on the lake through the same functions as the CLI without `--admin`
//! (`snapshot::{open, state, set_paused}`), with the table's settings from the sidecar file,
//! so the answer is the same whichever way it was asked. Pause and resume are rows of the
//! plans table, which the sidecar's backfill checks before each wave.
//!
//! Who may call: with `admin_token_file` every call carries `authorization: Bearer <token>`,
//! compared in constant time; a call without it, or with another, is `UNAUTHENTICATED` and
//! touches nothing. A service bound to an address other than loopback needs a token (anybody
//! reaching the port could otherwise open and pause snapshots), and with `admin_tls_cert` and
//! `admin_tls_key` its connections are TLS, so the token does not cross the network in clear.
//! The service also answers `grpc.health.v1.Health` (no token): SERVING while every table of
//! the sidecar streams (`crate::board`'s readiness).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};
use tonic::{Code, Status};

use crate::error::{Result, WriterError};
use crate::reconcile::{self, ReconcileResult};
use crate::sidecar::{self, SidecarConfig};
use crate::snapshot::{self, BackfillStatus, SnapshotMode, SnapshotState};
use crate::stream::StreamConfig;

use mssql_cdc_proto::admin::SnapshotState as SnapshotStateMessage;
pub use mssql_cdc_proto::admin::{
    OpenRequest, PauseRequest, ReconcileReply, ReconcileRequest, SnapshotAdmin,
    SnapshotAdminClient, SnapshotAdminServer, TableRequest,
};

/// The wire form of a table's snapshot state.
fn state_message(table: &str, state: SnapshotState) -> SnapshotStateMessage {
    SnapshotStateMessage {
        table: table.to_string(),
        snapshot: state.status.snapshot.map(|lsn| lsn.to_string()),
        mode: state.mode,
        chunks_done: state.status.chunks_done,
        chunks_total: state.status.chunks_total,
        done: state.status.done,
        paused: state.status.paused,
        state: state.status.state,
        reason: state.status.reason,
    }
}

/// A snapshot state from its wire form.
fn state_from_message(message: SnapshotStateMessage) -> Result<SnapshotState> {
    Ok(SnapshotState {
        mode: message.mode,
        status: BackfillStatus {
            snapshot: message
                .snapshot
                .map(|text| text.parse())
                .transpose()
                .map_err(|error| WriterError::Internal(format!("admin answer: {error}")))?,
            chunks_done: message.chunks_done,
            chunks_total: message.chunks_total,
            done: message.done,
            paused: message.paused,
            state: message.state,
            reason: message.reason,
        },
    })
}

/// One admin request.
#[derive(Clone, Debug)]
pub enum Request {
    /// Open a snapshot of this mode; `true`: a re-snapshot.
    Open(SnapshotMode, bool),
    /// The newest snapshot's state.
    Status,
    /// Pause, with an optional reason.
    Pause(Option<String>),
    /// Resume.
    Resume,
}

/// Shortest bearer token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Idle time before TCP keepalive probes an admin connection, so a peer that vanished
/// without closing it does not hold it open for ever.
const ADMIN_TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a TLS handshake with the admin service may take before its connection drops.
const ADMIN_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections open at once from one address to the admin service: an operator's tools and
/// probes need a few; one more is closed as it is accepted.
const ADMIN_CONNECTIONS_PER_PEER: usize = 64;
/// Connections open at once to the admin service from everyone.
const ADMIN_CONNECTIONS: usize = 256;
/// Calls (HTTP/2 streams) open at once on one admin connection: an admin call is short.
const ADMIN_STREAMS_PER_CONNECTION: u32 = 16;

/// The admin service's bearer token. `Debug` never shows it.
#[derive(Clone)]
pub struct AdminToken(Arc<str>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// The token in the first line of `path`, surrounding whitespace removed.
    pub fn from_file(path: &Path) -> Result<Self> {
        mssql_cdc_proto::secrets::warn_if_exposed("token", path);
        let text = std::fs::read_to_string(path).map_err(|source| WriterError::Io {
            context: format!("reading the admin token file {}", path.display()),
            source,
        })?;
        Self::new(text.lines().next().unwrap_or_default()).map_err(|error| {
            WriterError::invalid(format!("admin token file {}: {error}", path.display()))
        })
    }

    /// A token of at least [`MIN_TOKEN_CHARS`] visible ASCII characters (what an HTTP header
    /// value carries).
    pub fn new(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.chars().count() < MIN_TOKEN_CHARS {
            return Err(WriterError::invalid(format!(
                "the admin token must have at least {MIN_TOKEN_CHARS} characters"
            )));
        }
        if !text.bytes().all(|byte| byte.is_ascii_graphic()) {
            return Err(WriterError::invalid(
                "the admin token must be visible ASCII characters without spaces",
            ));
        }
        Ok(AdminToken(Arc::from(text)))
    }

    /// Whether `other` is the same token.
    pub fn same_as(&self, other: &AdminToken) -> bool {
        self.equals(other.0.as_bytes())
    }

    /// Whether an `authorization` header value is `Bearer <this token>`; the comparison takes
    /// the same time wherever the first difference lies.
    fn admits(&self, header: &[u8]) -> bool {
        header
            .strip_prefix(b"Bearer ")
            .is_some_and(|offered| self.equals(offered))
    }

    /// Whether an HTTP `authorization` header carries the token: `Bearer <token>`, or a
    /// browser's `Basic` login with any user name and the token as its password (the status
    /// page).
    pub fn admits_http(&self, header: &[u8]) -> bool {
        use base64::Engine as _;
        if self.admits(header) {
            return true;
        }
        let Some(encoded) = header.strip_prefix(b"Basic ") else {
            return false;
        };
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded) else {
            return false;
        };
        decoded
            .iter()
            .position(|&byte| byte == b':')
            .is_some_and(|colon| self.equals(&decoded[colon + 1..]))
    }

    /// Compares in the same time wherever the first difference lies.
    fn equals(&self, offered: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        offered.len() == expected.len()
            && offered
                .iter()
                .zip(expected)
                .fold(0u8, |difference, (a, b)| difference | (a ^ b))
                == 0
    }
}

/// How a caller reaches the admin service: its token and, for `https://` URLs, the CA that
/// signed the service's certificate.
#[derive(Clone, Debug, Default)]
pub struct AdminAccess {
    /// Sent as `authorization: Bearer <token>` with every call.
    pub token: Option<AdminToken>,
    /// PEM certificate(s) of the CA to trust.
    pub ca_certificate: Option<Vec<u8>>,
}

/// Runs a request on the lake of `config` (what the service does, and the CLI without
/// `--admin`).
pub async fn run_locally(config: &StreamConfig, request: Request) -> Result<SnapshotState> {
    match request {
        Request::Open(mode, resnapshot) => snapshot::open(config, mode, resnapshot).await,
        Request::Status => snapshot::state(config).await,
        Request::Pause(reason) => snapshot::set_paused(config, true, reason.as_deref()).await,
        Request::Resume => snapshot::set_paused(config, false, None).await,
    }
}

/// Adds the bearer token to every call of an admin client.
#[derive(Clone)]
pub struct WithToken(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for WithToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A client of the admin service.
pub type AdminClient = SnapshotAdminClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, WithToken>,
>;

/// Connects to the admin service at `url` with `access`.
async fn connect(url: &str, access: &AdminAccess) -> Result<AdminClient> {
    let unreachable = |error: &dyn std::fmt::Display| {
        WriterError::Internal(format!("cannot reach the admin service at {url}: {error}"))
    };
    let https = mssql_cdc_proto::client::is_https_url(url);
    if access.token.is_some() && !mssql_cdc_proto::client::token_may_go_to(url) {
        return Err(WriterError::invalid(format!(
            "refusing to send the admin token in cleartext to {url}, a host off loopback: use \
             https:// with the admin service's CA or, where something else encrypts the path, \
             set {}=1",
            mssql_cdc_proto::client::INSECURE_CLEARTEXT_TOKEN_VARIABLE
        )));
    }
    let mut endpoint = Endpoint::from_shared(url.to_string()).map_err(|e| unreachable(&e))?;
    // Only an https:// address is TLS: tonic ignores TLS settings on an http:// one.
    if let Some(ca) = access.ca_certificate.as_ref().filter(|_| https) {
        mssql_cdc_proto::install_crypto_provider();
        endpoint = endpoint
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
            .map_err(|e| unreachable(&e))?;
    }
    let channel = endpoint.connect().await.map_err(|e| unreachable(&e))?;
    let authorization = access
        .token
        .as_ref()
        .map(|token| MetadataValue::try_from(format!("Bearer {}", token.0)))
        .transpose()
        .map_err(|_| WriterError::invalid("the admin token is not a valid header value"))?;
    Ok(SnapshotAdminClient::with_interceptor(
        channel,
        WithToken(authorization),
    ))
}

/// The writer's error for a status the admin service at `url` answered.
fn refused(url: &str, status: Status) -> WriterError {
    match status.code() {
        Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition => {
            WriterError::InvalidArgument(status.message().to_string())
        }
        Code::Unauthenticated => WriterError::InvalidArgument(format!(
            "the admin service at {url} refused the call: {} (the sidecar's admin_token_file; \
             callers pass it with --admin-token-file or MSSQL_CDC_WRITER_ADMIN_TOKEN_FILE)",
            status.message()
        )),
        _ => WriterError::Internal(format!("admin service: {}", status.message())),
    }
}

/// Sends a request for `table` to the admin service at `url`.
pub async fn call(
    url: &str,
    access: &AdminAccess,
    table: &str,
    request: Request,
) -> Result<SnapshotState> {
    let mut client = connect(url, access).await?;
    let table_request = || TableRequest {
        table: table.to_string(),
    };
    let answer = match request {
        Request::Open(mode, resnapshot) => {
            client
                .open(OpenRequest {
                    table: table.to_string(),
                    mode: mode.as_str().into(),
                    resnapshot,
                })
                .await
        }
        Request::Status => client.status(table_request()).await,
        Request::Pause(reason) => {
            client
                .pause(PauseRequest {
                    table: table.to_string(),
                    reason: reason.unwrap_or_default(),
                })
                .await
        }
        Request::Resume => client.resume(table_request()).await,
    }
    .map_err(|status| refused(url, status))?;
    state_from_message(answer.into_inner())
}

/// Asks the admin service at `url` to reconcile a table's silver; the result as the sidecar
/// found it.
pub async fn call_reconcile(
    url: &str,
    access: &AdminAccess,
    request: ReconcileRequest,
) -> Result<ReconcileResult> {
    let reply = connect(url, access)
        .await?
        .reconcile(request)
        .await
        .map_err(|status| refused(url, status))?
        .into_inner();
    serde_json::from_str(&reply.result_json).map_err(|error| {
        WriterError::Internal(format!("the admin service's reconcile result: {error}"))
    })
}

/// The service over a sidecar's configuration.
#[derive(Clone)]
pub struct AdminService {
    config: SidecarConfig,
}

impl AdminService {
    /// The service for the tables of `config`.
    pub fn new(config: SidecarConfig) -> Self {
        AdminService { config }
    }

    fn table(&self, table: &str) -> std::result::Result<StreamConfig, Status> {
        Ok(self.config.stream(self.entry(table)?))
    }

    /// The sidecar file's entry of `table`; NOT_FOUND naming the file's tables otherwise.
    fn entry(&self, table: &str) -> std::result::Result<&sidecar::TableEntry, Status> {
        self.config
            .tables
            .iter()
            .find(|entry| entry.table.eq_ignore_ascii_case(table))
            .ok_or_else(|| {
                Status::not_found(format!(
                    "table '{table}' is not in this sidecar's file (tables: {})",
                    self.config
                        .tables
                        .iter()
                        .map(|entry| entry.table.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }

    async fn answer(
        &self,
        table: &str,
        request: Request,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        let config = self.table(table)?;
        tracing::info!(table, ?request, "admin request");
        let state = run_locally(&config, request).await.map_err(to_status)?;
        Ok(tonic::Response::new(state_message(table, state)))
    }
}

fn to_status(error: WriterError) -> Status {
    match &error {
        WriterError::InvalidArgument(message) => Status::failed_precondition(message.clone()),
        WriterError::Flight(_) => Status::unavailable(error.to_string()),
        _ => Status::internal(error.to_string()),
    }
}

#[tonic::async_trait]
impl SnapshotAdmin for AdminService {
    async fn open(
        &self,
        request: tonic::Request<OpenRequest>,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        let request = request.into_inner();
        let mode: SnapshotMode = request
            .mode
            .parse()
            .map_err(|error: WriterError| Status::invalid_argument(error.to_string()))?;
        self.answer(&request.table, Request::Open(mode, request.resnapshot))
            .await
    }

    async fn status(
        &self,
        request: tonic::Request<TableRequest>,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        self.answer(&request.into_inner().table, Request::Status)
            .await
    }

    async fn pause(
        &self,
        request: tonic::Request<PauseRequest>,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        let request = request.into_inner();
        let reason = (!request.reason.is_empty()).then_some(request.reason);
        self.answer(&request.table, Request::Pause(reason)).await
    }

    async fn resume(
        &self,
        request: tonic::Request<TableRequest>,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        self.answer(&request.into_inner().table, Request::Resume)
            .await
    }

    async fn reconcile(
        &self,
        request: tonic::Request<ReconcileRequest>,
    ) -> std::result::Result<tonic::Response<ReconcileReply>, Status> {
        let request = request.into_inner();
        let entry = self.entry(&request.table)?;
        let mut config = sidecar::reconcile_config(&self.config, entry).ok_or_else(|| {
            Status::failed_precondition(format!(
                "table {} has no silver table in this sidecar's file: nothing to reconcile",
                entry.table
            ))
        })?;
        config.sample = request.sample.unwrap_or(config.sample);
        config.bucket_rows = request.bucket_rows.unwrap_or(config.bucket_rows);
        config.seed = request.seed.or(config.seed);
        config.value_sums = request.value_sums.unwrap_or(config.value_sums);
        tracing::info!(table = %entry.table, sample = config.sample, "admin request: reconcile");
        let result = reconcile::reconcile(&config).await.map_err(to_status)?;
        let result_json = serde_json::to_string(&result)
            .map_err(|error| Status::internal(format!("the result as JSON: {error}")))?;
        Ok(tonic::Response::new(ReconcileReply {
            run_id: result.run_id.clone(),
            buckets: result.buckets,
            matched: result.matched,
            in_flight: result.in_flight,
            mismatch: result.mismatch,
            hashed: result.hashed,
            verified: result.verified,
            values_verified: result.values_verified,
            compared_lsn: result.compared_lsn.to_string(),
            failures: result.failures.clone().into_iter().collect(),
            result_json,
        }))
    }
}

/// The admin service of a sidecar, bound and checked, not yet serving.
pub struct AdminServer {
    listener: TcpListener,
    config: SidecarConfig,
    token: Option<AdminToken>,
    tls: Option<Identity>,
}

impl AdminServer {
    /// Binds `admin_listen` of `config` (none when unset) after reading its token and TLS
    /// identity; refuses an address other than loopback without a token.
    pub async fn bind(config: &SidecarConfig) -> Result<Option<Self>> {
        let Some(address) = &config.admin_listen else {
            return Ok(None);
        };
        let token = config
            .admin_token_file
            .as_deref()
            .map(AdminToken::from_file)
            .transpose()?;
        let tls = match (&config.admin_tls_cert, &config.admin_tls_key) {
            (Some(certificate), Some(key)) => {
                mssql_cdc_proto::secrets::warn_if_exposed("admin TLS key", key);
                let read = |path: &Path| {
                    std::fs::read(path).map_err(|source| WriterError::Io {
                        context: format!("reading {}", path.display()),
                        source,
                    })
                };
                Some(Identity::from_pem(read(certificate)?, read(key)?))
            }
            _ => None,
        };
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| WriterError::Io {
                context: format!("binding the admin service to {address}"),
                source,
            })?;
        let local = listener.local_addr().map_err(|source| WriterError::Io {
            context: "the admin service's address".into(),
            source,
        })?;
        if !local.ip().is_loopback() {
            if token.is_none() {
                return Err(WriterError::invalid(format!(
                    "admin_listen {address} is not a loopback address: set admin_token_file \
                     (and admin_tls_cert, admin_tls_key) so that only operators holding the \
                     token can open and pause snapshots"
                )));
            }
            if tls.is_none() {
                tracing::warn!(%local, "the admin token crosses the network in clear text: \
                    set admin_tls_cert and admin_tls_key");
            }
        }
        Ok(Some(AdminServer {
            listener,
            config: config.clone(),
            token,
            tls,
        }))
    }

    /// The address bound.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|source| WriterError::Io {
                context: "the admin service's address".into(),
                source,
            })
    }

    /// Serves until `stop` turns true.
    pub async fn serve(self, mut stop: tokio::sync::watch::Receiver<bool>) -> Result<()> {
        let mut builder = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(ADMIN_STREAMS_PER_CONNECTION));
        if let Some(identity) = self.tls {
            mssql_cdc_proto::install_crypto_provider();
            builder = builder
                .tls_config(
                    ServerTlsConfig::new()
                        .identity(identity)
                        .timeout(ADMIN_TLS_HANDSHAKE_TIMEOUT),
                )
                .map_err(|error| WriterError::invalid(format!("admin TLS identity: {error}")))?;
        }
        let (reporter, health) = mssql_cdc_proto::health::health_reporter(stop.clone());
        tokio::spawn(report_readiness(reporter, stop.clone()));
        let token = self.token;
        let service = SnapshotAdminServer::with_interceptor(
            AdminService::new(self.config),
            move |request: tonic::Request<()>| authorize(token.as_ref(), request),
        );
        builder
            .add_service(health)
            .add_service(service)
            .serve_with_incoming_shutdown(
                mssql_cdc_proto::serving::accepted_at_most(
                    self.listener,
                    ADMIN_TCP_KEEPALIVE,
                    mssql_cdc_proto::serving::ConnectionBounds {
                        per_peer: ADMIN_CONNECTIONS_PER_PEER,
                        total: ADMIN_CONNECTIONS,
                        unadmitted: None,
                    },
                ),
                async move {
                    let _ = stop.wait_for(|stopped| *stopped).await;
                },
            )
            .await
            .map_err(|error| WriterError::Internal(format!("admin service: {error}")))
    }
}

/// Keeps gRPC health (the overall service, `""`) in step with the sidecar's readiness:
/// SERVING while every table streams, NOT_SERVING otherwise; checked every second until
/// `stop`. Health needs no token: orchestrators' probes carry none, and it tells no more than
/// `/readyz`.
async fn report_readiness(
    reporter: tonic_health::server::HealthReporter,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    use tonic_health::ServingStatus;
    while !*stop.borrow() {
        let status = match crate::board::board().readiness().ready {
            true => ServingStatus::Serving,
            false => ServingStatus::NotServing,
        };
        reporter.set_service_status("", status).await;
        sidecar::sleep_unless_stopped(Duration::from_secs(1), &stop).await;
    }
}

/// Lets a call through when no token is set or it carries the token.
fn authorize(
    token: Option<&AdminToken>,
    request: tonic::Request<()>,
) -> std::result::Result<tonic::Request<()>, Status> {
    let Some(token) = token else {
        return Ok(request);
    };
    let offered = request.metadata().get("authorization");
    if offered.is_some_and(|value| token.admits(value.as_bytes())) {
        return Ok(request);
    }
    let peer = request.remote_addr();
    tracing::warn!(?peer, token_sent = offered.is_some(), "admin call refused");
    Err(Status::unauthenticated(match offered {
        Some(_) => "the bearer token does not match",
        None => "a bearer token is required",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_admits_only_its_own_bearer_header() {
        let token = AdminToken::new("  abcdefghijklmnop0123 \n").expect("token");
        assert!(token.admits(b"Bearer abcdefghijklmnop0123"));
        assert!(!token.admits(b"Bearer abcdefghijklmnop0124"));
        assert!(!token.admits(b"Bearer abcdefghijklmnop012"));
        assert!(!token.admits(b"bearer abcdefghijklmnop0123"));
        assert!(!token.admits(b"abcdefghijklmnop0123"));
        assert!(!format!("{token:?}").contains("abcdef"));
    }

    #[test]
    fn http_callers_may_log_in_with_the_token_as_password() {
        use base64::Engine as _;
        let token = AdminToken::new("abcdefghijklmnop0123").expect("token");
        let basic = |login: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(login)
            )
        };
        assert!(token.admits_http(b"Bearer abcdefghijklmnop0123"));
        assert!(token.admits_http(basic("operator:abcdefghijklmnop0123").as_bytes()));
        assert!(token.admits_http(basic(":abcdefghijklmnop0123").as_bytes()));
        assert!(!token.admits_http(basic("abcdefghijklmnop0123:").as_bytes()));
        assert!(!token.admits_http(basic("operator:abcdefghijklmnop012").as_bytes()));
        assert!(!token.admits_http(b"Basic not-base64!"));
        assert!(!token.admits_http(b""));
    }

    #[test]
    fn short_or_spaced_tokens_are_refused() {
        assert!(AdminToken::new("short").is_err());
        assert!(AdminToken::new("has a space inside of it").is_err());
        assert!(AdminToken::new("0123456789abcdef").is_ok());
    }
}
