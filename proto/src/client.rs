//! A Rust client of the Flight service.
//!
//! It wraps the protocol (JSON actions and commands, signed tickets) and, above all, the
//! completeness rule: [`CdcClient::read_endpoint`] succeeds only when the stream ended with
//! its completion marker, so a caller never commits a stream that was cut short.

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Criteria, FlightData, FlightDescriptor, FlightInfo, Ticket};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::Request;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

mod decode;

use crate::protocol::{
    COMPLETION_TYPE, ChangesCommand, Command, Completion, InitialOffsetBody, PlanMetadata,
    SnapshotCommand, SnapshotPlanMetadata,
};

/// What a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status.
    #[error("{}: {}", .0.code(), .0.message())]
    Status(Box<tonic::Status>),
    /// The client's own settings are wrong: a URL that does not parse, a TLS file missing
    /// or unreadable, half a client certificate.
    #[error("cannot connect to {url}: {message}")]
    Setting {
        /// The server address.
        url: String,
        /// What is wrong.
        message: String,
    },
    /// The connection could not be made.
    #[error("cannot connect to {url}: {message}")]
    Connect {
        /// The server address.
        url: String,
        /// Why.
        message: String,
    },
    /// The stream ended without its completion marker: do not commit it.
    #[error("the stream ended without its completion marker after {rows} rows; do not commit it")]
    Incomplete {
        /// Rows received before the end.
        rows: u64,
    },
    /// A payload that does not decode.
    #[error("bad response: {0}")]
    Protocol(String),
}

impl ClientError {
    /// The gRPC code, when the server answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Status(status) => Some(status.code()),
            _ => None,
        }
    }

    /// Whether the server did not answer: it could not be reached, the connection was cut
    /// (a restart: a status the transport made, without the server's error details), a
    /// stream ended without its completion marker, the server ended a stream its client
    /// stopped reading (`STREAM_STALLED`), or refused a call for a moment (`SERVER_BUSY`). The server is stateless and its calls
    /// read only, so the same call, to it or another replica, may succeed a moment later.
    /// What the server answered (a pending capture instance, a source it cannot reach) is
    /// its own error, and not this.
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Connect { .. } | ClientError::Incomplete { .. } => true,
            ClientError::Status(status) => {
                let reason = crate::status::reason_of_status(status);
                // A stream the server ended because this client took too long between
                // batches (a slow commit, a paused process), or a call it refused for a
                // moment (its principal's streams or share of the source taken: the
                // retry hint says a moment): the same call again is safe.
                matches!(reason.as_deref(), Some("STREAM_STALLED" | "SERVER_BUSY"))
                    || matches!(
                        status.code(),
                        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
                    ) && reason.is_none()
            }
            ClientError::Protocol(_) | ClientError::Setting { .. } => false,
        }
    }

    /// Whether the server refused a ticket it signed before (a restart with another key, a
    /// ticket past its lifetime, other masks than the caller's): planning again gives fresh
    /// tickets.
    pub fn is_stale_ticket(&self) -> bool {
        match self {
            ClientError::Status(status) => matches!(
                crate::status::reason_of_status(status).as_deref(),
                Some("TICKET_FORGED" | "TICKET_EXPIRED" | "TICKET_MASKS_CHANGED")
            ),
            _ => false,
        }
    }
}

/// The waits between tries of a call the server did not answer ([`ClientError::is_transient`]):
/// doubling from 0.2 s with jitter, 4 at most (about 3 s: a replica restarting, a connection
/// cut). Short on purpose: the sidecar retries a failing table itself, with its own backoff,
/// and must show the error on its status page and stop on SIGTERM promptly; a longer wait
/// inside each call delayed both by minutes.
pub fn transient_retries() -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(2))
        .with_max_times(4)
        .with_jitter()
}

/// `call` (named `what` in the log), tried again as [`transient_retries`] says while the
/// server does not answer.
async fn retried<T, F, Fut>(what: &str, call: F) -> ClientResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ClientResult<T>>,
{
    use backon::Retryable;
    call.retry(transient_retries())
        .when(ClientError::is_transient)
        .notify(|error: &ClientError, wait: Duration| {
            tracing::warn!(call = what, %error, retry_in_ms = wait.as_millis() as u64,
                "the server did not answer; the call is tried again");
        })
        .await
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        ClientError::Status(Box::new(status))
    }
}

impl From<FlightError> for ClientError {
    fn from(error: FlightError) -> Self {
        match error {
            FlightError::Tonic(status) => ClientError::Status(status),
            other => ClientError::Protocol(other.to_string()),
        }
    }
}

/// Result of client calls.
pub type ClientResult<T> = Result<T, ClientError>;

/// A client of one server (cheap to clone: calls multiplex on one HTTP/2 connection).
#[derive(Clone)]
pub struct CdcClient {
    inner: FlightServiceClient<Channel>,
    /// `Bearer <token>`, sent on every call when set; never printed.
    authorization: Option<MetadataValue<Ascii>>,
    /// The server's URL: no token is sent to it in cleartext off loopback
    /// ([`CdcClient::with_token`]).
    url: String,
}

/// Set to `1` to let a client send its bearer token over `http://` to a host off loopback,
/// where something else encrypts the path (a service mesh's mutual TLS); refused otherwise.
pub const INSECURE_CLEARTEXT_TOKEN_VARIABLE: &str = "MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN";

/// Whether a bearer token may be sent to `url`: over `https://`, to loopback, or where
/// [`INSECURE_CLEARTEXT_TOKEN_VARIABLE`] is `1`.
pub fn token_may_go_to(url: &str) -> bool {
    is_https_url(url)
        || is_loopback_url(url)
        || std::env::var(INSECURE_CLEARTEXT_TOKEN_VARIABLE).as_deref() == Ok("1")
}

/// Whether `url`'s scheme is `https` (in any case).
pub fn is_https_url(url: &str) -> bool {
    url.get(..8)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
}

/// Whether `url` names this machine: `localhost` or a loopback address (no name is
/// resolved, so any other name counts as remote; a user part before `@` is not the host).
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(uri) = url.parse::<tonic::codegen::http::Uri>() else {
        return false;
    };
    let Some(host) = uri.host() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}

/// A plan of a change range.
#[derive(Debug, Clone)]
pub struct ChangesPlan {
    /// The `FlightInfo` as served (schema, endpoints with tickets).
    pub info: FlightInfo,
    /// Its app_metadata.
    pub metadata: PlanMetadata,
}

/// A plan of a snapshot read.
#[derive(Debug, Clone)]
pub struct SnapshotPlan {
    /// The `FlightInfo` as served (schema, one endpoint per partition or chunk).
    pub info: FlightInfo,
    /// Its app_metadata.
    pub metadata: SnapshotPlanMetadata,
}

/// TLS settings of a client: the CA that signed the server's certificate, and for mutual
/// TLS the client's own certificate.
#[derive(Clone)]
pub struct ClientTls {
    /// PEM certificate(s) of the CA to trust.
    pub ca_certificate: Vec<u8>,
    /// The name to verify the server certificate against (default: the URL's host).
    pub domain: Option<String>,
    /// Mutual TLS: the client's PEM certificate chain and private key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("domain", &self.domain)
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<certificate and key>"),
            )
            .finish()
    }
}

/// The variable naming the PEM file of the CA that signed the server's certificate, read by
/// every client of this project (the server binary's `read`, the writer).
pub const TLS_CA_VARIABLE: &str = "MSSQL_CDC_FLIGHT_TLS_CA";
/// The variable holding the bearer token clients of this project send.
pub const TOKEN_VARIABLE: &str = "MSSQL_CDC_FLIGHT_TOKEN";
/// The variable naming a file that holds the bearer token (first line), so the token need not
/// sit in the environment; [`TOKEN_VARIABLE`] wins when both are set.
pub const TOKEN_FILE_VARIABLE: &str = "MSSQL_CDC_FLIGHT_TOKEN_FILE";
/// The variables naming the PEM files of a client certificate and its key (mutual TLS).
pub const TLS_CLIENT_CERT_VARIABLE: &str = "MSSQL_CDC_FLIGHT_TLS_CLIENT_CERT";
/// See [`TLS_CLIENT_CERT_VARIABLE`].
pub const TLS_CLIENT_KEY_VARIABLE: &str = "MSSQL_CDC_FLIGHT_TLS_CLIENT_KEY";

impl ClientTls {
    /// Trusts the CA in the PEM file at `path`, verifying the URL's host.
    pub fn from_ca_file(path: &std::path::Path) -> std::io::Result<Self> {
        Ok(ClientTls {
            ca_certificate: std::fs::read(path)?,
            domain: None,
            identity: None,
        })
    }
}

impl CdcClient {
    /// Connects to `url` (`http://host:port`) without TLS.
    pub async fn connect(url: &str) -> ClientResult<Self> {
        Self::connect_with(url, None).await
    }

    /// Connects to `url`; with `tls`, over TLS (`https://host:port`) verifying the server's
    /// certificate against the given CA.
    pub async fn connect_with(url: &str, tls: Option<&ClientTls>) -> ClientResult<Self> {
        let endpoint = Self::endpoint(url, tls)?;
        let channel = endpoint
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(crate::protocol::STREAM_WINDOW))
            .initial_connection_window_size(Some(crate::protocol::CONNECTION_WINDOW))
            .connect()
            .await
            .map_err(|error| ClientError::Connect {
                url: url.to_string(),
                message: error.to_string(),
            })?;
        Ok(Self::over(url, channel))
    }

    /// A client of `url` over `channel`. Only the scheme says whether the channel is TLS:
    /// tonic connects to an `http://` URL in cleartext whatever TLS settings it was given.
    fn over(url: &str, channel: Channel) -> Self {
        CdcClient {
            inner: FlightServiceClient::new(channel).max_decoding_message_size(256 << 20),
            authorization: None,
            url: url.to_string(),
        }
    }

    /// The endpoint of `url`; with `tls`, trusting its CA, verifying its domain and presenting
    /// its client certificate. Other gRPC clients of the server (the health check) use it too.
    pub fn endpoint(url: &str, tls: Option<&ClientTls>) -> ClientResult<Endpoint> {
        let connect_error = |message: String| ClientError::Setting {
            url: url.to_string(),
            message,
        };
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|error| connect_error(error.to_string()))?;
        let Some(tls) = tls else {
            return Ok(endpoint);
        };
        crate::install_crypto_provider();
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&tls.ca_certificate));
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        if let Some((certificate, key)) = &tls.identity {
            config = config.identity(tonic::transport::Identity::from_pem(certificate, key));
        }
        endpoint
            .tls_config(config)
            .map_err(|error| connect_error(error.to_string()))
    }

    /// Connects as this project's clients do: TLS for `https://` verified against the CA in
    /// [`TLS_CA_VARIABLE`] (refused without it, rather than trusting whatever answers), a
    /// client certificate from [`TLS_CLIENT_CERT_VARIABLE`] and [`TLS_CLIENT_KEY_VARIABLE`]
    /// when set, and the bearer token of [`TOKEN_VARIABLE`] (or the file named by
    /// [`TOKEN_FILE_VARIABLE`]) when set.
    pub async fn connect_from_env(url: &str) -> ClientResult<Self> {
        let setting = |message: String| ClientError::Setting {
            url: url.to_string(),
            message,
        };
        let read = |variable: &str| -> ClientResult<Option<Vec<u8>>> {
            let Some(path) = std::env::var_os(variable).map(std::path::PathBuf::from) else {
                return Ok(None);
            };
            if [TOKEN_FILE_VARIABLE, TLS_CLIENT_KEY_VARIABLE].contains(&variable) {
                crate::secrets::warn_if_exposed(variable, &path);
            }
            std::fs::read(&path)
                .map(Some)
                .map_err(|error| setting(format!("reading {variable} {}: {error}", path.display())))
        };
        let tls = match url.starts_with("https://") {
            false => None,
            true => {
                let ca_certificate = read(TLS_CA_VARIABLE)?.ok_or_else(|| {
                    setting(format!(
                        "the server is TLS: set {TLS_CA_VARIABLE} to the PEM file of the CA \
                         that signed its certificate"
                    ))
                })?;
                let identity = match (
                    read(TLS_CLIENT_CERT_VARIABLE)?,
                    read(TLS_CLIENT_KEY_VARIABLE)?,
                ) {
                    (Some(certificate), Some(key)) => Some((certificate, key)),
                    (None, None) => None,
                    _ => {
                        return Err(setting(format!(
                            "set both {TLS_CLIENT_CERT_VARIABLE} and {TLS_CLIENT_KEY_VARIABLE}, \
                             or neither"
                        )));
                    }
                };
                Some(ClientTls {
                    ca_certificate,
                    domain: None,
                    identity,
                })
            }
        };
        let client = Self::connect_with(url, tls.as_ref()).await?;
        let token = match std::env::var(TOKEN_VARIABLE) {
            Ok(token) if !token.trim().is_empty() => Some(token),
            _ => read(TOKEN_FILE_VARIABLE)?.map(|bytes| {
                let text = String::from_utf8_lossy(&bytes).into_owned();
                text.lines().next().unwrap_or_default().to_string()
            }),
        };
        match token {
            Some(token) if !token.trim().is_empty() => client.with_token(token.trim()),
            _ => Ok(client),
        }
    }

    /// This client sending `token` as `authorization: Bearer` on every call; refused over
    /// `http://` to a host off loopback (anyone on the path would read the token) unless
    /// [`INSECURE_CLEARTEXT_TOKEN_VARIABLE`] is `1`.
    pub fn with_token(mut self, token: &str) -> ClientResult<Self> {
        if !token_may_go_to(&self.url) {
            return Err(ClientError::Setting {
                url: self.url.clone(),
                message: format!(
                    "refusing to send a bearer token in cleartext to a host off loopback: use \
                     https:// (with {TLS_CA_VARIABLE}) or, where something else encrypts the \
                     path, set {INSECURE_CLEARTEXT_TOKEN_VARIABLE}=1"
                ),
            });
        }
        let mut value: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| ClientError::Protocol("the token is not valid header text".into()))?;
        value.set_sensitive(true);
        self.authorization = Some(value);
        Ok(self)
    }

    /// A request of `message` with this client's credentials.
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        request
    }

    /// Calls an action with a JSON body and decodes its JSON answer.
    pub async fn action<T: DeserializeOwned>(
        &self,
        name: &str,
        body: &impl Serialize,
    ) -> ClientResult<T> {
        let body: bytes::Bytes = serde_json::to_vec(body)
            .map_err(|error| ClientError::Protocol(error.to_string()))?
            .into();
        let result = retried(name, || async {
            let mut results = self
                .inner
                .clone()
                .do_action(self.request(Action {
                    r#type: name.to_string(),
                    body: body.clone(),
                }))
                .await?
                .into_inner();
            results.message().await.map_err(ClientError::from)
        })
        .await?
        .ok_or_else(|| ClientError::Protocol(format!("action {name} returned no result")))?;
        serde_json::from_slice(&result.body)
            .map_err(|error| ClientError::Protocol(error.to_string()))
    }

    /// The `initial_offset` action: where a stream of `table` starting at `starting`
    /// (`earliest`, `latest` or an LSN already processed) stands before its first range.
    pub async fn initial_offset(&self, table: &str, starting: &str) -> ClientResult<crate::Offset> {
        self.action(
            "initial_offset",
            &InitialOffsetBody {
                table: table.to_string(),
                starting: Some(starting.to_string()),
            },
        )
        .await
    }

    /// Every tracked table's `FlightInfo`.
    pub async fn list_tables(&self) -> ClientResult<Vec<FlightInfo>> {
        retried("list_flights", || async {
            let stream = self
                .inner
                .clone()
                .list_flights(self.request(Criteria::default()))
                .await?
                .into_inner();
            Ok(stream.try_collect().await?)
        })
        .await
    }

    /// Plans a change range.
    pub async fn plan_changes(&self, command: &ChangesCommand) -> ClientResult<ChangesPlan> {
        let (info, metadata) = self.plan(Command::Changes(command.clone())).await?;
        Ok(ChangesPlan { info, metadata })
    }

    /// `get_flight_info` of a command, with its app_metadata decoded.
    async fn plan<M: DeserializeOwned>(&self, command: Command) -> ClientResult<(FlightInfo, M)> {
        let descriptor = FlightDescriptor::new_cmd(command.to_bytes());
        let info = retried("get_flight_info", || async {
            Ok(self
                .inner
                .clone()
                .get_flight_info(self.request(descriptor.clone()))
                .await?
                .into_inner())
        })
        .await?;
        let metadata = serde_json::from_slice(&info.app_metadata)
            .map_err(|error| ClientError::Protocol(format!("plan metadata: {error}")))?;
        Ok((info, metadata))
    }

    /// Plans a snapshot read (a whole table in partitions, or chunks).
    pub async fn plan_snapshot(&self, command: &SnapshotCommand) -> ClientResult<SnapshotPlan> {
        let (info, metadata) = self.plan(Command::Snapshot(command.clone())).await?;
        Ok(SnapshotPlan { info, metadata })
    }

    /// Opens one endpoint's stream; [`EndpointReader::next_batch`] hands out its batches and
    /// [`EndpointReader::completion`] checks its completion marker at the end.
    pub async fn open_endpoint(&self, ticket: &Ticket) -> ClientResult<EndpointReader> {
        // Opening is retried; a stream cut later is its caller's to read again.
        let response = retried("do_get", || async {
            Ok(self
                .inner
                .clone()
                .do_get(self.request(ticket.clone()))
                .await?
                .into_inner())
        })
        .await?;
        Ok(EndpointReader {
            messages: response,
            decoder: decode::BatchDecoder::default(),
            marker: None,
            rows: 0,
        })
    }

    /// Reads one endpoint, handing each batch to `on_batch`; returns the completion marker,
    /// or [`ClientError::Incomplete`] when the stream ended without it.
    pub async fn read_endpoint(
        &self,
        ticket: &Ticket,
        mut on_batch: impl FnMut(RecordBatch),
    ) -> ClientResult<Completion> {
        let mut reader = self.open_endpoint(ticket).await?;
        while let Some(batch) = reader.next_batch().await? {
            on_batch(batch);
        }
        reader.completion()
    }

    /// Reads one endpoint into memory.
    pub async fn collect_endpoint(
        &self,
        ticket: &Ticket,
    ) -> ClientResult<(Vec<RecordBatch>, Completion)> {
        let mut batches = Vec::new();
        let completion = self
            .read_endpoint(ticket, |batch| batches.push(batch))
            .await?;
        Ok((batches, completion))
    }
}

/// One endpoint's stream being read: batches, then the completion marker (a zero-row batch
/// whose app_metadata is the [`Completion`]).
pub struct EndpointReader {
    messages: tonic::Streaming<FlightData>,
    decoder: decode::BatchDecoder,
    marker: Option<bytes::Bytes>,
    rows: u64,
}

impl EndpointReader {
    /// The next batch, or `None` at the end of the stream.
    pub async fn next_batch(&mut self) -> ClientResult<Option<RecordBatch>> {
        while let Some(message) = self.messages.next().await {
            let message = message?;
            let Some(batch) = self.decoder.decode(&message)? else {
                continue;
            };
            if self.marker.is_some() {
                return Err(ClientError::Protocol(
                    "data after the completion marker".into(),
                ));
            }
            if !message.app_metadata.is_empty() {
                if batch.num_rows() != 0 {
                    return Err(ClientError::Protocol(format!(
                        "a batch of {} rows carries app_metadata; only the zero-row \
                         completion marker does",
                        batch.num_rows()
                    )));
                }
                self.marker = Some(message.app_metadata);
                continue;
            }
            self.rows += batch.num_rows() as u64;
            return Ok(Some(batch));
        }
        Ok(None)
    }

    /// The completion marker of a stream read to its end, checked against the rows that
    /// arrived; [`ClientError::Incomplete`] when the stream ended without it.
    pub fn completion(self) -> ClientResult<Completion> {
        let rows = self.rows;
        let Some(metadata) = self.marker else {
            return Err(ClientError::Incomplete { rows });
        };
        let marker: Completion = serde_json::from_slice(&metadata)
            .map_err(|error| ClientError::Protocol(format!("completion marker: {error}")))?;
        if marker.kind != COMPLETION_TYPE || marker.rows != rows {
            return Err(ClientError::Protocol(format!(
                "completion marker says {} rows of type {} but {rows} arrived",
                marker.rows, marker.kind
            )));
        }
        Ok(marker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_token_is_sent_in_cleartext_only_to_loopback() {
        let client = |url: &str| {
            let channel = Endpoint::from_shared(url.to_string())
                .expect("a url")
                .connect_lazy();
            CdcClient::over(url, channel)
        };
        // A CA given with an http:// URL does not make it TLS: only the scheme does.
        for url in [
            "http://flight:50051",
            "http://localhost@flight:50051",
            "http://127.0.0.1.example.com:1",
        ] {
            let refused = client(url)
                .with_token("a-token-of-sixteen-chars")
                .err()
                .expect("refused off loopback");
            assert!(
                refused
                    .to_string()
                    .contains(INSECURE_CLEARTEXT_TOKEN_VARIABLE),
                "{url}: {refused}"
            );
        }
        for url in [
            "http://127.0.0.1:50051",
            "http://localhost:50051",
            "https://flight:50051",
            "HTTPS://flight:50051",
        ] {
            assert!(
                client(url).with_token("a-token-of-sixteen-chars").is_ok(),
                "{url}"
            );
        }
    }

    #[test]
    fn only_localhost_and_loopback_addresses_are_loopback_urls() {
        for url in [
            "http://127.0.0.1:50051",
            "http://localhost:1",
            "http://LOCALHOST:1",
            "http://[::1]:50051",
            "http://127.3.2.1:9",
        ] {
            assert!(is_loopback_url(url), "{url}");
        }
        for url in [
            "http://flight:50051",
            "http://10.0.0.1:50051",
            "http://localhost.example.com:1",
            "http://[::2]:1",
            "http://localhost@evil.example.com:1",
            "http://127.0.0.1:1@evil.example.com",
            "not a url",
        ] {
            assert!(!is_loopback_url(url), "{url}");
        }
    }
    use crate::error::Error;
    use crate::status::to_status;

    #[test]
    fn only_what_the_server_did_not_answer_is_transient() {
        let status = |status: tonic::Status| ClientError::from(status);
        // Statuses the transport makes carry none of the server's error details.
        assert!(status(tonic::Status::unavailable("connection refused")).is_transient());
        assert!(status(tonic::Status::cancelled("operation was canceled")).is_transient());
        assert!(status(tonic::Status::unknown("transport error")).is_transient());
        assert!(ClientError::Incomplete { rows: 3 }.is_transient());
        let connect = ClientError::Connect {
            url: "http://127.0.0.1:1".into(),
            message: "refused".into(),
        };
        assert!(connect.is_transient());
        // A call the server refused for a moment, with its retry hint, may be made again.
        let busy = status(to_status(&Error::Busy {
            what: "principal 'writer' runs 7 source reads at once".into(),
            retry_after_seconds: 2,
        }));
        assert!(busy.is_transient());
        // What the server answered, and the client's own settings, are not.
        let answered = status(to_status(&Error::SourceUnavailable("down".into())));
        assert!(!answered.is_transient() && !answered.is_stale_ticket());
        let setting = ClientError::Setting {
            url: "https://x".into(),
            message: "set the CA".into(),
        };
        assert!(!setting.is_transient());
        assert!(!ClientError::Protocol("bad".into()).is_transient());
        // A ticket of another key or past its lifetime asks for a new plan.
        let forged = status(to_status(&Error::TicketForged));
        assert!(forged.is_stale_ticket() && !forged.is_transient());
        assert!(status(to_status(&Error::TicketExpired { expired_at: 1 })).is_stale_ticket());
    }
}
