//! The Arrow Flight service.
//!
//! - `list_flights`: one `FlightInfo` per tracked table (schema, capture instances).
//! - `get_schema` / `get_flight_info` with a JSON descriptor command ([`protocol::Command`]):
//!   a table's schema, or the plan of a change range with one endpoint per partition.
//! - `do_get`: redeems a signed ticket; streams byte- and row-bounded batches through a
//!   bounded channel (backpressure reaches the source) and ends with a completion marker
//!   whose app_metadata carries the row count and the range; a range whose start CDC
//!   cleanup passed during the read ends with `DATA_LOSS` instead.
//! - `do_action`: the planning calls (offsets, LSN functions, capture instances, DDL
//!   history, split points, counts), JSON in and out.
//!
//! Every call passes [`auth::interceptor`] (the caller's principal) and is checked against the
//! tables it reaches; every size and count a client controls is bounded ([`Limits`]). The
//! service holds no pipeline state; docs/protocol.md is the reference, docs/security.md the
//! guide to authentication and limits.

mod actions;
pub mod auth;
mod ddl;
pub mod encode;
mod frames;
pub mod gate;
pub mod limits;
pub mod local;
pub mod masking;
mod metered;
pub mod metrics;
pub mod planner;
mod refusals;
pub mod share;
pub mod snapshot;
pub mod sql;
pub mod stream;
pub mod tail;
pub mod ticket;

pub use actions::ActionKind;
pub use limits::Limits;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
};
use futures::StreamExt;
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};

use crate::error::{Error, Result};
use crate::protocol::{self, CaptureInstanceInfo, ChangesCommand, Command};
use crate::source::{CdcSource, TableName};
use crate::types::{OutputColumn, metadata_column_count, output_schema};
use auth::{Authenticator, BasicCredentials, Principal, principal_of};
use gate::StreamGate;
use masking::{MaskPolicy, ServedMasks};
use stream::{BoxedStream, StreamRead};
use ticket::{ChangeRangeTicket, TicketBody, TicketColumn, TicketKind, TicketSigner};

/// HTTP/2 receive windows of the server, per stream and per connection. Clients send only
/// small requests (at most `max_request_bytes`), so this is what one client can park in the
/// server's buffers. What the server sends is paced by the client's windows (the Rust client's
/// are `mssql_cdc_proto::protocol::STREAM_WINDOW`) and held in hyper's send buffer, about
/// 400 KiB per stream.
const REQUEST_STREAM_WINDOW: u32 = 1 << 20;
const REQUEST_CONNECTION_WINDOW: u32 = 2 << 20;

/// How long a TLS handshake may take before the connection is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often health asks the source whether it answers, by default.
pub const HEALTH_PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// How a service is set up: its ticket keys, its bounds, who may call it.
#[derive(Clone, Debug)]
pub struct ServiceOptions {
    /// Signs and verifies tickets.
    pub signer: TicketSigner,
    /// The bounds of what clients control.
    pub limits: Limits,
    /// The principals; `None` serves everyone as [`auth::Principal::anonymous`] (loopback, or
    /// `--insecure-no-auth`).
    pub authenticator: Option<Arc<Authenticator>>,
    /// How often health asks the source (`max_lsn`) whether it answers.
    pub health_interval: Duration,
    /// How often the live tail reads `max_lsn` while `wait_for_commits` calls wait.
    pub tail_interval: Duration,
    /// The columns served masked (`--masks`), and to whom.
    pub masks: Arc<MaskPolicy>,
}

impl ServiceOptions {
    /// Default limits, no authentication, tickets signed by `signer`.
    pub fn new(signer: TicketSigner) -> Self {
        ServiceOptions {
            signer,
            limits: Limits::default(),
            authenticator: None,
            health_interval: HEALTH_PROBE_INTERVAL,
            tail_interval: tail::TAIL_INTERVAL,
            masks: Arc::new(MaskPolicy::none()),
        }
    }
}

/// The Flight service over a [`CdcSource`]; [`serve`] runs it.
pub struct CdcFlightService {
    source: Arc<dyn CdcSource>,
    signer: TicketSigner,
    limits: Limits,
    streams: Arc<StreamGate>,
    calls: Arc<gate::CallGate>,
    /// Each principal's share of the source's connections.
    share: Arc<share::SourceShare>,
    commits: tail::CommitWatch,
    masks: Arc<MaskPolicy>,
}

/// TLS of the server, PEM encoded.
#[derive(Clone)]
pub struct TlsIdentity {
    /// Certificate chain.
    pub certificate: Vec<u8>,
    /// Private key.
    pub key: Vec<u8>,
    /// With mutual TLS: the CA that signs client certificates. Every client must then
    /// present one, and its principal is the tokens file's entry with its SHA-256.
    pub client_ca: Option<Vec<u8>>,
}

/// Serves Flight and gRPC health on `listener` until `shutdown` resolves, then finishes the
/// calls in flight. Health says `NOT_SERVING` while the source does not answer.
pub async fn serve(
    listener: TcpListener,
    source: Arc<dyn CdcSource>,
    options: ServiceOptions,
    tls: Option<TlsIdentity>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    // Health's Watch streams end as the shutdown begins, which would otherwise wait for them.
    let (closing, closed) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        let _ = closing.send(true);
    };
    let (health_reporter, health_service) = mssql_cdc_proto::health::health_reporter(closed);
    health_reporter
        .set_serving::<FlightServiceServer<CdcFlightService>>()
        .await;
    let probe = tokio::spawn(probe_health(
        Arc::clone(&source),
        health_reporter,
        options.health_interval,
    ));
    let limits = &options.limits;
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(REQUEST_STREAM_WINDOW))
        .initial_connection_window_size(Some(REQUEST_CONNECTION_WINDOW))
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .max_concurrent_streams(Some(limits.max_streams_per_connection));
    if let Some(identity) = tls {
        crate::install_crypto_provider();
        // A peer that never finishes its handshake is dropped instead of holding its
        // connection.
        let mut config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                identity.certificate,
                identity.key,
            ))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        if let Some(ca) = identity.client_ca {
            config = config.client_ca_root(tonic::transport::Certificate::from_pem(ca));
        }
        builder = builder
            .tls_config(config)
            .map_err(|error| Error::invalid(format!("bad TLS identity: {error}")))?;
    }
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(address = ?local, source = %source.describe(),
        authentication = options.authenticator.is_some(), "serving flight");
    // With authentication, a connection none of whose calls is admitted in time is closed.
    let admissions = options
        .authenticator
        .as_ref()
        .map(|_| mssql_cdc_proto::serving::Admissions::default());
    let interceptor = auth::interceptor(options.authenticator.clone(), admissions.clone());
    let max_request_bytes = options.limits.max_request_bytes;
    let keepalive = options.limits.keepalive_interval;
    let bounds = mssql_cdc_proto::serving::ConnectionBounds {
        per_peer: options.limits.max_connections_per_peer,
        total: options.limits.max_connections,
        unadmitted: admissions.map(|admissions| mssql_cdc_proto::serving::Unadmitted {
            within: options.limits.unauthenticated_timeout,
            per_peer: options.limits.max_unauthenticated_per_peer,
            admissions,
        }),
    };
    let service = Arc::new(CdcFlightService::new(source, options));
    let flight = frames::ZeroCopyDoGet::new(
        FlightServiceServer::from_arc(Arc::clone(&service))
            .max_decoding_message_size(max_request_bytes)
            .max_encoding_message_size(usize::MAX),
        service,
        max_request_bytes,
    );
    let served = builder
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            flight,
            interceptor,
        ))
        // TCP_NODELAY and keepalive on each connection (tonic's builder settings for them do
        // not apply to an incoming stream).
        .serve_with_incoming_shutdown(
            mssql_cdc_proto::serving::accepted_at_most(listener, keepalive, bounds),
            shutdown,
        )
        .await
        .map_err(|error| Error::Internal(format!("the server failed: {error}")));
    probe.abort();
    served
}

/// Keeps health true: `NOT_SERVING` while `max_lsn` fails or hangs, `SERVING` again once it
/// answers.
async fn probe_health(
    source: Arc<dyn CdcSource>,
    reporter: tonic_health::server::HealthReporter,
    interval: Duration,
) {
    let mut serving = true;
    loop {
        tokio::time::sleep(interval).await;
        let answer = tokio::time::timeout(interval * 2, source.max_lsn()).await;
        let healthy = matches!(answer, Ok(Ok(_)));
        metrics::source_up(healthy);
        if healthy == serving {
            continue;
        }
        serving = healthy;
        match healthy {
            true => {
                tracing::info!("the source answers again: health SERVING");
                reporter
                    .set_serving::<FlightServiceServer<CdcFlightService>>()
                    .await;
            }
            false => {
                let reason = match answer {
                    Ok(Err(error)) => error.to_string(),
                    _ => "max_lsn did not answer in time".into(),
                };
                tracing::warn!(%reason, "the source does not answer: health NOT_SERVING");
                reporter
                    .set_not_serving::<FlightServiceServer<CdcFlightService>>()
                    .await;
            }
        }
    }
}

fn json_bytes(value: &impl Serialize) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(value).expect("protocol payloads serialise"))
}

impl CdcFlightService {
    /// The service over `source`, without the transport: [`serve`] wraps it in the
    /// authentication interceptor. Called directly (tests, fuzzing), each request must carry
    /// its `Arc<Principal>` in its extensions.
    pub fn new(source: Arc<dyn CdcSource>, options: ServiceOptions) -> Self {
        let limits = options.limits;
        let source: Arc<dyn CdcSource> = Arc::new(metered::MeteredSource(source));
        let share =
            share::SourceShare::of_pool(limits.source_share, source.pool().map(|pool| pool.size));
        CdcFlightService {
            commits: tail::CommitWatch::new(Arc::clone(&source), options.tail_interval),
            source,
            signer: options.signer,
            streams: StreamGate::new(
                limits.max_streams,
                limits.max_streams_per_principal,
                limits.stream_memory,
            ),
            calls: gate::CallGate::new(limits.max_calls_per_principal),
            share: share::SourceShare::new(share),
            masks: options.masks,
            limits,
        }
    }

    /// `DoGet`: the stream `ticket` names, each message with its body in the pieces
    /// [`encode`] made. The service's own `DoGet` body ([`frames`]) sends them as they are;
    /// the generated server's path joins them.
    pub async fn open_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<BoxedStream<encode::Message>>, Status> {
        metrics::observe("DoGet", async {
            let principal = principal_of(&request)?;
            if let Some(command) = sql::command(&request.get_ref().ticket) {
                let command = command?;
                let stream = self
                    .within_deadline(&principal, self.sql_get(&principal, command))
                    .await?;
                return Ok(Response::new(stream));
            }
            let body = self.signer.verify(&request.get_ref().ticket)?;
            let (mut read, compression, table, columns, keys) = match body.kind {
                Some(TicketKind::ChangeRange(ticket)) => (
                    StreamRead::changes(&ticket)?,
                    ticket.compression,
                    ticket.table,
                    ticket.columns,
                    Vec::new(),
                ),
                Some(TicketKind::Snapshot(ticket)) => (
                    StreamRead::Snapshot(snapshot::ticket_read(&ticket)?),
                    ticket.compression,
                    ticket.table,
                    ticket.columns,
                    ticket.keys,
                ),
                None => {
                    return Err(Status::invalid_argument(
                        "ticket is malformed: it names nothing to read",
                    ));
                }
            };
            // Checked again at redemption: a ticket may travel to another principal, who
            // must be allowed the table and served the ticket's masks.
            let table: TableName = table.parse()?;
            principal.check(&table)?;
            let masks =
                self.masks
                    .served(&principal, &table, &TicketColumn::to_output(&columns)?)?;
            masks.check_ticket(&columns)?;
            self.masks.check_ticket_keys(&principal, &table, &keys)?;
            let slot = self.streams.enter(principal.bounded_name())?;
            // A stream waits for its share as long as it would wait for a pooled connection.
            let within = self
                .source
                .pool()
                .map_or(self.limits.call_timeout, |pool| pool.checkout_timeout);
            let permit = self.share.wait(principal.bounded_name(), Some(within));
            read.share(self.streams.batch_share());
            let stall = self.limits.stall_timeout;
            let stream = stream::respond(
                Arc::clone(&self.source),
                read,
                masks,
                (compression, stall),
                permit,
            )?;
            // The slot is held until the response is dropped: read to its end, or abandoned.
            Ok(Response::new(
                stream
                    .map(move |item| {
                        let _held = &slot;
                        item
                    })
                    .boxed(),
            ))
        })
        .await
    }

    /// Runs a planning call of `principal` within the server's deadline, its bound on
    /// calls at once and its share of the source's connections.
    async fn within_deadline<T>(
        &self,
        principal: &Principal,
        call: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        self.bounded_call(principal, true, call).await
    }

    /// [`Self::within_deadline`]; a call that mostly waits (`wait_for_commits`, on the shared
    /// watcher) takes no place in the share while it waits (`shared` false: its source reads
    /// take one each), so a sidecar's waits on many tables do not hold up its streams. The
    /// wait for the share is bounded by the deadline too, and answered `SERVER_BUSY`.
    async fn bounded_call<T>(
        &self,
        principal: &Principal,
        shared: bool,
        call: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let _slot = self.calls.enter(principal.bounded_name())?;
        let limit = self.limits.call_timeout;
        let _permit = match shared {
            true => Some(
                self.share
                    .wait(principal.bounded_name(), Some(limit))
                    .await?,
            ),
            false => None,
        };
        tokio::time::timeout(limit, call).await.map_err(|_| {
            Error::DeadlineExceeded(format!(
                "the call ran past the server's deadline of {} s (--call-timeout); ask for \
                 less (a shorter range, fewer rows per seek) or retry",
                limit.as_secs_f64()
            ))
        })?
    }

    async fn table_info(&self, principal: &Principal, table: &TableName) -> Result<FlightInfo> {
        let instances = self.source.capture_instances(table).await?;
        self.table_info_of(principal, table, &instances).await
    }

    /// `INVALID_ARGUMENT` when the masks file does not fit `table`'s capture instances (read
    /// only for a masked table): its plans and key calls are refused, never served clear.
    async fn masks_fit(&self, table: &TableName) -> Result<()> {
        if !self.masks.masks_table(table) {
            return Ok(());
        }
        let instances = self.source.capture_instances(table).await?;
        self.masks.check_table(table, &instances)
    }

    /// The masks `principal` is served `columns` of `table` with, once the masks file is
    /// checked against the table.
    async fn served_masks(
        &self,
        principal: &Principal,
        table: &TableName,
        columns: &[OutputColumn],
    ) -> Result<ServedMasks> {
        self.masks_fit(table).await?;
        self.masks.served(principal, table, columns)
    }

    /// The change schema of `table` as `principal` is served it, from every capture instance
    /// of it (as a listing read them: the masks file is checked against them, no second
    /// catalog read).
    fn table_schema(
        &self,
        principal: &Principal,
        table: &TableName,
        instances: &[crate::source::CaptureInstance],
    ) -> Result<arrow::datatypes::SchemaRef> {
        self.masks.check_table(table, instances)?;
        let columns = planner::union_columns(table, instances)?;
        Ok(self
            .masks
            .served(principal, table, &columns)?
            .schema(output_schema(&columns, true), metadata_column_count(true)))
    }

    /// A table's `FlightInfo` from its capture instances (as the catalog listed them, so a
    /// listing reads the catalog once, not once per table).
    async fn table_info_of(
        &self,
        principal: &Principal,
        table: &TableName,
        instances: &[crate::source::CaptureInstance],
    ) -> Result<FlightInfo> {
        let schema = self.table_schema(principal, table, instances)?;
        let mut infos = Vec::new();
        for instance in instances {
            infos.push(self.instance_info(principal, instance.clone()).await?);
        }
        Ok(FlightInfo::new()
            .try_with_schema(&schema)?
            .with_descriptor(table_descriptor(table))
            .with_app_metadata(json_bytes(&serde_json::json!({
                "table": table.to_string(),
                "capture_instances": infos,
            }))))
    }

    async fn instance_info(
        &self,
        principal: &Principal,
        instance: crate::source::CaptureInstance,
    ) -> Result<CaptureInstanceInfo> {
        // A pending instance has no low endpoint yet; asking would be UNAVAILABLE.
        let min_lsn = match instance.start_lsn {
            Some(_) => Some(self.source.min_lsn(&instance.name).await?),
            None => None,
        };
        let masks = instance
            .columns
            .iter()
            .filter_map(|column| {
                self.masks
                    .mask_of(principal, &instance.table, &column.name)
                    .map(|mask| (column.name.clone(), mask.to_string()))
            })
            .collect();
        Ok(CaptureInstanceInfo {
            masks,
            min_lsn,
            name: instance.name,
            table: instance.table.to_string(),
            start_lsn: instance.start_lsn,
            create_date: instance.create_date,
            columns: instance.columns,
            index_columns: instance.index_columns,
        })
    }

    async fn changes_info(
        &self,
        principal: &Principal,
        command: &ChangesCommand,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo> {
        let bounds = self
            .limits
            .batch_bounds(command.serve.batch_rows, command.serve.batch_bytes)?;
        let include_command_id = command.serve.include_command_id.unwrap_or(true);
        let plan = planner::plan_changes(self.source.as_ref(), command).await?;
        let table: TableName = command.table.parse()?;
        let masks = self.served_masks(principal, &table, &plan.columns).await?;
        let columns = masks.ticket_columns(&plan.columns);
        let schema = masks.schema(
            output_schema(&plan.columns, include_command_id),
            metadata_column_count(include_command_id),
        );
        let mut info = FlightInfo::new()
            .try_with_schema(&schema)?
            .with_descriptor(descriptor)
            .with_ordered(true)
            .with_total_records(i64::try_from(plan.metadata.rows).unwrap_or(i64::MAX))
            .with_app_metadata(json_bytes(&plan.metadata));
        for read in &plan.reads {
            let body = TicketBody {
                kind: Some(TicketKind::ChangeRange(ChangeRangeTicket {
                    table: plan.metadata.table.clone(),
                    capture_instance: read.capture_instance.clone(),
                    from_lsn: read.from.as_bytes().to_vec(),
                    to_lsn: read.to.as_bytes().to_vec(),
                    columns: columns.clone(),
                    include_command_id,
                    batch_rows: bounds.rows as u64,
                    batch_bytes: bounds.bytes as u64,
                    compression: command.serve.compression.unwrap_or_default().ticket_code(),
                    planned_rows: read.rows,
                })),
                expires_at: 0,
            };
            let endpoint_metadata = protocol::EndpointMetadata {
                capture_instance: read.capture_instance.clone(),
                from: read.from,
                to: read.to,
                rows: read.rows,
            };
            info = info.with_endpoint(
                FlightEndpoint::new()
                    .with_ticket(Ticket::new(self.signer.sign(&body)))
                    .with_app_metadata(json_bytes(&endpoint_metadata)),
            );
        }
        tracing::debug!(table = %plan.metadata.table, from = %plan.metadata.from, to = %plan.metadata.to,
            endpoints = plan.reads.len(), rows = plan.metadata.rows, "planned change range");
        Ok(info)
    }
}

#[tonic::async_trait]
impl FlightService for CdcFlightService {
    type HandshakeStream = BoxedStream<HandshakeResponse>;
    type ListFlightsStream = BoxedStream<FlightInfo>;
    type DoGetStream = BoxedStream<FlightData>;
    type DoPutStream = BoxedStream<PutResult>;
    type DoActionStream = BoxedStream<arrow_flight::Result>;
    type ListActionsStream = BoxedStream<ActionType>;
    type DoExchangeStream = BoxedStream<FlightData>;

    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> std::result::Result<Response<Self::HandshakeStream>, Status> {
        metrics::observe("Handshake", async {
            // Basic credentials verified by the interceptor are traded for the bearer token;
            // without authentication the handshake succeeds with nothing to trade.
            let credentials = request.extensions().get::<BasicCredentials>().cloned();
            let principal = match &credentials {
                Some(credentials) => Arc::clone(&credentials.principal),
                None => principal_of(&request)?,
            };
            tracing::debug!(principal = %principal.name, "handshake");
            let reply = HandshakeResponse {
                protocol_version: 0,
                payload: bytes::Bytes::new(),
            };
            let mut response =
                Response::new(futures::stream::once(async move { Ok(reply) }).boxed());
            if let Some(credentials) = credentials {
                let value = format!("Bearer {}", credentials.token)
                    .parse()
                    .map_err(|_| {
                        Status::unauthenticated("the token is not a valid header value")
                    })?;
                response.metadata_mut().insert("authorization", value);
            }
            Ok(response)
        })
        .await
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> std::result::Result<Response<Self::ListFlightsStream>, Status> {
        metrics::observe("ListFlights", async {
            let principal = principal_of(&request)?;
            let infos = self
                .within_deadline(&principal, async {
                    let mut infos = Vec::new();
                    for tracked in self.source.tracked_tables().await? {
                        if !principal.may_read(&tracked.table) {
                            continue;
                        }
                        let info = self
                            .table_info_of(&principal, &tracked.table, &tracked.capture_instances)
                            .await;
                        infos.push(Ok(match info {
                            Ok(info) => info,
                            // One table the service cannot describe (a column type without a
                            // mapping, two instances typing a column apart) is listed with its
                            // reason; the others are listed as usual.
                            Err(error) if !error.is_transient() => unlisted(&tracked.table, &error),
                            Err(error) => return Err(error),
                        }));
                    }
                    Ok(infos)
                })
                .await?;
            Ok(Response::new(futures::stream::iter(infos).boxed()))
        })
        .await
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        metrics::observe("GetFlightInfo", async {
            let principal = principal_of(&request)?;
            let (metadata, _, descriptor) = request.into_parts();
            if let Some(command) = sql::command(&descriptor.cmd) {
                let asked = (command?, sql::partitions(&metadata)?);
                let plan = self.sql_flight_info(&principal, asked, descriptor);
                return Ok(Response::new(self.within_deadline(&principal, plan).await?));
            }
            let command = Command::parse(&descriptor.cmd)?;
            principal.check(&command_table(&command)?)?;
            let info = self
                .within_deadline(&principal, async {
                    match command {
                        Command::Table(command) => {
                            self.table_info(&principal, &command.table.parse()?).await
                        }
                        Command::Changes(command) => {
                            self.changes_info(&principal, &command, descriptor).await
                        }
                        Command::Snapshot(command) => {
                            self.snapshot_info(&principal, &command, descriptor).await
                        }
                    }
                })
                .await?;
            Ok(Response::new(info))
        })
        .await
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented(
            "poll_flight_info: plans are immediate, use get_flight_info",
        ))
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<SchemaResult>, Status> {
        metrics::observe("GetSchema", async {
            let principal = principal_of(&request)?;
            let schema = match sql::command(&request.get_ref().cmd) {
                Some(command) => {
                    let schema = self.sql_schema(&principal, command?);
                    self.within_deadline(&principal, schema).await?
                }
                None => {
                    let command = Command::parse(&request.get_ref().cmd)?;
                    let table = command_table(&command)?;
                    principal.check(&table)?;
                    let schema = self.command_schema(&principal, &table, &command);
                    self.within_deadline(&principal, schema).await?
                }
            };
            let result =
                SchemaResult::try_from(SchemaAsIpc::new(&schema, &IpcWriteOptions::default()))
                    .map_err(|error| Status::internal(error.to_string()))?;
            Ok(Response::new(result))
        })
        .await
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<Self::DoGetStream>, Status> {
        let response = self.open_get(request).await?;
        Ok(response.map(|stream| {
            stream
                .map(|message| message.map(encode::Message::into_flight_data))
                .boxed()
        }))
    }

    async fn do_put(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoPutStream>, Status> {
        Err(Status::unimplemented("do_put: the server is read-only"))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> std::result::Result<Response<Self::DoActionStream>, Status> {
        metrics::observe("DoAction", async {
            let principal = principal_of(&request)?;
            let action = request.get_ref();
            let answer = match sql::is_sql_action(&action.r#type) {
                true => {
                    let answer = self.sql_action(&principal, action);
                    self.within_deadline(&principal, answer).await?
                }
                false => {
                    let waits = action.r#type == actions::ActionKind::WaitForCommits.name();
                    let answer = self.action(&principal, action);
                    self.bounded_call(&principal, !waits, answer).await?
                }
            };
            let result = arrow_flight::Result { body: answer };
            Ok(Response::new(
                futures::stream::once(async move { Ok(result) }).boxed(),
            ))
        })
        .await
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> std::result::Result<Response<Self::ListActionsStream>, Status> {
        metrics::observe("ListActions", async {
            principal_of(&request)?;
            let actions = ActionKind::ALL.iter().map(|kind| {
                Ok(ActionType {
                    r#type: kind.name().to_string(),
                    description: kind.description().to_string(),
                })
            });
            Ok(Response::new(
                futures::stream::iter(actions.collect::<Vec<_>>()).boxed(),
            ))
        })
        .await
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange: use do_get"))
    }
}

/// The descriptor of a table's `FlightInfo`.
fn table_descriptor(table: &TableName) -> FlightDescriptor {
    let command = Command::Table(protocol::TableCommand {
        table: table.to_string(),
    });
    FlightDescriptor::new_cmd(command.to_bytes())
}

/// The `FlightInfo` of a table `list_flights` cannot describe: no schema, and its app_metadata
/// says why (`{"table", "error": {"reason", "message"}}`).
fn unlisted(table: &TableName, error: &Error) -> FlightInfo {
    tracing::warn!(%table, %error, "list_flights: the table cannot be described");
    FlightInfo::new()
        .with_descriptor(table_descriptor(table))
        .with_app_metadata(json_bytes(&serde_json::json!({
            "table": table.to_string(),
            "error": {
                "reason": crate::status::reason_of(error),
                "message": error.to_string(),
            },
        })))
}

/// The table a descriptor command reads.
fn command_table(command: &Command) -> Result<TableName> {
    match command {
        Command::Table(command) => command.table.parse(),
        Command::Changes(command) => command.table.parse(),
        Command::Snapshot(command) => command.table.parse(),
    }
}

impl CdcFlightService {
    /// The plan of a `snapshot` command of `principal`.
    async fn snapshot_info(
        &self,
        principal: &Principal,
        command: &protocol::SnapshotCommand,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo> {
        snapshot::plan(
            self.source.as_ref(),
            (&self.signer, &self.limits),
            (&self.masks, principal),
            command,
            descriptor,
        )
        .await
    }

    /// The schema `command` would serve `principal`.
    async fn command_schema(
        &self,
        principal: &Principal,
        table: &TableName,
        command: &Command,
    ) -> Result<arrow::datatypes::SchemaRef> {
        let instances = match command {
            Command::Changes(command) => {
                planner::stream_instances(
                    self.source.as_ref(),
                    table,
                    command.capture_instance.as_deref(),
                )
                .await?
            }
            Command::Snapshot(_) => self.source.active_capture_instances(table).await?,
            Command::Table(_) => self.source.capture_instances(table).await?,
        };
        let columns = planner::union_columns(table, &instances)?;
        let (columns, include_command_id) = match command {
            Command::Table(_) => (columns, true),
            Command::Changes(command) => (
                planner::served_columns(table, columns, &command.serve)?,
                command.serve.include_command_id.unwrap_or(true),
            ),
            Command::Snapshot(command) => (
                planner::served_columns(table, columns, &command.serve)?,
                command.serve.include_command_id.unwrap_or(true),
            ),
        };
        let schema = match command {
            Command::Snapshot(_) => crate::types::snapshot_schema(&columns, include_command_id),
            _ => output_schema(&columns, include_command_id),
        };
        Ok(self
            .served_masks(principal, table, &columns)
            .await?
            .schema(schema, metadata_column_count(include_command_id)))
    }
}
