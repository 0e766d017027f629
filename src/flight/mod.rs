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
//! The service holds no pipeline state; docs/protocol.md is the reference.

pub mod local;
pub mod planner;
pub mod protocol;
pub mod snapshot;
pub mod status;
pub mod ticket;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arrow::ipc::CompressionType;
use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::offset::Offset;
use crate::source::{CdcSource, ChangeRead, TableName};
use crate::types::output_schema;
use protocol::{
    COMPLETION_TYPE, CaptureInstanceBody, CaptureInstanceInfo, ChangesCommand, Command, Completion,
    Compression, CountAnswer, DEFAULT_BATCH_BYTES, DEFAULT_BATCH_ROWS, InitialOffsetBody,
    LatestOffsetBody, LsnAnswer, LsnBody, NthCommitBody, RangeBody, TableBody, TimeAnswer,
    parse_body,
};
use ticket::{ChangeRangeTicket, TicketBody, TicketColumn, TicketKind, TicketSigner};

/// Largest message the server accepts from a client.
const MAX_DECODING_MESSAGE_SIZE: usize = 16 << 20;
/// The encoder's own split is off: it sizes batches by whole buffers, so a column sliced
/// from an IPC segment would count the entire segment message and every batch would be cut
/// into slivers. Sources bound batches by rows and bytes themselves (`batch_bytes`).
const MAX_FLIGHT_DATA_SIZE: usize = usize::MAX;

/// HTTP/2 flow-control windows. Fixed and large: the adaptive window sizes itself by the
/// bandwidth-delay product, which on a fast, short link (loopback, a LAN) stays near the
/// 64 KiB default and makes the sender wait for a window update every 64 KiB.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Connection-level window, shared by the streams of one connection.
pub const CONNECTION_WINDOW: u32 = 64 << 20;

/// The actions `do_action` serves, with their descriptions (also `list_actions`).
pub const ACTIONS: [(&str, &str); 17] = [
    ("max_lsn", "{} -> {\"lsn\"}: sys.fn_cdc_get_max_lsn()"),
    (
        "min_lsn",
        "{\"capture_instance\"} -> {\"lsn\"}: sys.fn_cdc_get_min_lsn(ci)",
    ),
    (
        "increment_lsn",
        "{\"lsn\"} -> {\"lsn\"}: sys.fn_cdc_increment_lsn",
    ),
    (
        "decrement_lsn",
        "{\"lsn\"} -> {\"lsn\"}: sys.fn_cdc_decrement_lsn",
    ),
    (
        "lsn_to_time",
        "{\"lsn\"} -> {\"commit_ts\"}: commit time (UTC) of the commit at lsn",
    ),
    (
        "nth_commit_after",
        "{\"lsn\", \"n\"} -> {\"lsn\"}: the n-th commit after lsn (or the last)",
    ),
    (
        "capture_instances",
        "{\"table\"} -> [capture instance]: the table's instances, oldest first",
    ),
    (
        "ddl_history",
        "{\"capture_instance\", \"from\", \"to\"} -> [ddl]: DDL with from < lsn <= to",
    ),
    (
        "split_points",
        "{\"capture_instance\", \"from\", \"to\", \"n\"} -> [{\"last_lsn\", \"rows\"}]",
    ),
    (
        "count_changes",
        "{\"capture_instance\", \"from\", \"to\"} -> {\"rows\"}: change rows in [from, to]",
    ),
    (
        "initial_offset",
        "{\"table\", \"starting\"} -> offset: where a new stream starts",
    ),
    (
        "latest_offset",
        "{\"start\", \"max_commits\", \"upper\"} -> offset: the end of the next range",
    ),
    (
        "snapshot_lsn",
        "{\"table\"} -> {\"lsn\"}: the stamp a snapshot read now would get",
    ),
    (
        "key_extent",
        "{\"table\"} -> {\"column\", \"sql_type\", \"min\", \"max\", \"rows\"}: the key and its extent",
    ),
    (
        "key_buckets",
        "{\"table\", \"lo\", \"hi\", \"width\"} -> [{\"lo\", \"hi\", \"rows\"}]: rows per key slice",
    ),
    (
        "key_max",
        "{\"table\", \"keys\"?} -> {\"keys\", \"unique\", \"max\"}: the columns a snapshot is cut on and the largest key",
    ),
    (
        "key_bound",
        "{\"table\", \"keys\"?, \"from\"?, \"from_inclusive\"?, \"to\"?, \"to_inclusive\"?, \"n\"} -> {\"bound\"}: the key of the (n + 1)-th row of a range, in the source's order",
    ),
];

/// The Flight service over a [`CdcSource`]; build it with [`make_server`].
pub struct CdcFlightService {
    source: Arc<dyn CdcSource>,
    signer: TicketSigner,
}

/// The service wrapped for tonic, with message limits set.
pub fn make_server(
    source: Arc<dyn CdcSource>,
    signer: TicketSigner,
) -> FlightServiceServer<CdcFlightService> {
    FlightServiceServer::new(CdcFlightService { source, signer })
        .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
        .max_encoding_message_size(usize::MAX)
}

/// TLS identity of the server, PEM encoded.
#[derive(Clone)]
pub struct TlsIdentity {
    /// Certificate chain.
    pub certificate: Vec<u8>,
    /// Private key.
    pub key: Vec<u8>,
}

/// Serves Flight and gRPC health on `listener` until `shutdown` resolves, then finishes the
/// calls in flight.
pub async fn serve(
    listener: TcpListener,
    source: Arc<dyn CdcSource>,
    signer: TicketSigner,
    tls: Option<TlsIdentity>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<FlightServiceServer<CdcFlightService>>()
        .await;
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .tcp_nodelay(true);
    if let Some(identity) = tls {
        crate::install_crypto_provider();
        let config = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(identity.certificate, identity.key),
        );
        builder = builder
            .tls_config(config)
            .map_err(|error| Error::invalid(format!("bad TLS identity: {error}")))?;
    }
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(address = ?local, source = %source.describe(), "serving flight");
    builder
        .add_service(health_service)
        .add_service(make_server(source, signer))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .map_err(|error| Error::Internal(format!("the server failed: {error}")))
}

fn json_bytes(value: &impl Serialize) -> bytes::Bytes {
    bytes::Bytes::from(serde_json::to_vec(value).expect("protocol payloads serialise"))
}

fn flight_error(error: &Error) -> FlightError {
    FlightError::Tonic(Box::new(status::to_status(error)))
}

fn ipc_options(compression: u32) -> Result<IpcWriteOptions> {
    let kind = match compression {
        0 => None,
        1 => Some(CompressionType::LZ4_FRAME),
        2 => Some(CompressionType::ZSTD),
        other => {
            return Err(Error::TicketMalformed(format!(
                "unknown compression {other}"
            )));
        }
    };
    Ok(IpcWriteOptions::default().try_with_compression(kind)?)
}

fn compression_code(compression: Compression) -> u32 {
    match compression {
        Compression::None => 0,
        Compression::Lz4 => 1,
        Compression::Zstd => 2,
    }
}

impl CdcFlightService {
    /// Streams a snapshot ticket: stamped and read by [`snapshot::produce`].
    fn serve_snapshot(
        &self,
        ticket: &ticket::SnapshotTicket,
    ) -> std::result::Result<Response<BoxedStream<FlightData>>, Status> {
        let read = snapshot::ticket_read(ticket)?;
        let schema = crate::types::snapshot_schema(&read.columns, read.include_command_id);
        let options = ipc_options(ticket.compression)?;
        let (batch_sender, batch_receiver) = mpsc::channel(2);
        let (done_sender, done_receiver) = oneshot::channel();
        tokio::spawn(snapshot::produce(
            Arc::clone(&self.source),
            read,
            batch_sender,
            done_sender,
        ));
        Ok(Response::new(flight_stream(
            schema,
            options,
            batch_receiver,
            done_receiver,
        )))
    }

    async fn table_info(&self, table: &TableName) -> Result<FlightInfo> {
        let instances = self.source.capture_instances(table).await?;
        let columns = planner::union_columns(table, &instances)?;
        let mut infos = Vec::new();
        for instance in &instances {
            infos.push(self.instance_info(instance.clone()).await?);
        }
        let command = Command::Table(protocol::TableCommand {
            table: table.to_string(),
        });
        Ok(FlightInfo::new()
            .try_with_schema(&output_schema(&columns, true))?
            .with_descriptor(FlightDescriptor::new_cmd(command.to_bytes()))
            .with_app_metadata(json_bytes(&serde_json::json!({
                "table": table.to_string(),
                "capture_instances": infos,
            }))))
    }

    async fn instance_info(
        &self,
        instance: crate::source::CaptureInstance,
    ) -> Result<CaptureInstanceInfo> {
        Ok(CaptureInstanceInfo {
            min_lsn: self.source.min_lsn(&instance.name).await?,
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
        command: &ChangesCommand,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo> {
        let batch_rows = command.batch_rows.unwrap_or(DEFAULT_BATCH_ROWS);
        let batch_bytes = command.batch_bytes.unwrap_or(DEFAULT_BATCH_BYTES);
        if batch_rows == 0 || batch_bytes == 0 {
            return Err(Error::invalid(
                "batch_rows and batch_bytes must be at least 1",
            ));
        }
        let include_command_id = command.include_command_id.unwrap_or(true);
        let plan = planner::plan_changes(self.source.as_ref(), command).await?;
        let columns: Vec<TicketColumn> = plan.columns.iter().map(TicketColumn::of).collect();
        let mut info = FlightInfo::new()
            .try_with_schema(&output_schema(&plan.columns, include_command_id))?
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
                    batch_rows: batch_rows as u64,
                    batch_bytes: batch_bytes as u64,
                    compression: compression_code(command.compression.unwrap_or_default()),
                    planned_rows: read.rows,
                })),
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

    async fn action(&self, action: &Action) -> Result<bytes::Bytes> {
        let name = action.r#type.as_str();
        let body = action.body.as_ref();
        let source = self.source.as_ref();
        Ok(match name {
            "max_lsn" => {
                parse_body::<serde_json::Map<String, serde_json::Value>>(name, body).and_then(
                    |map| {
                        map.is_empty()
                            .then_some(())
                            .ok_or_else(|| Error::invalid("max_lsn takes no fields"))
                    },
                )?;
                json_bytes(&LsnAnswer {
                    lsn: source.max_lsn().await?,
                })
            }
            "min_lsn" => {
                let body: CaptureInstanceBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.min_lsn(&body.capture_instance).await?),
                })
            }
            "increment_lsn" => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.increment_lsn(body.lsn).await?),
                })
            }
            "decrement_lsn" => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.decrement_lsn(body.lsn).await?),
                })
            }
            "lsn_to_time" => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&TimeAnswer {
                    commit_ts: source.lsn_to_time(body.lsn).await?,
                })
            }
            "nth_commit_after" => {
                let body: NthCommitBody = parse_body(name, body)?;
                if body.n == 0 {
                    return Err(Error::invalid("nth_commit_after needs n >= 1"));
                }
                json_bytes(&LsnAnswer {
                    lsn: source.nth_commit_after(body.lsn, body.n).await?,
                })
            }
            "capture_instances" => {
                let body: TableBody = parse_body(name, body)?;
                let mut infos = Vec::new();
                for instance in source.capture_instances(&body.table.parse()?).await? {
                    infos.push(self.instance_info(instance).await?);
                }
                json_bytes(&infos)
            }
            "ddl_history" => {
                let body: RangeBody = parse_body(name, body)?;
                check_range(&body)?;
                json_bytes(
                    &source
                        .ddl_history(&body.capture_instance, body.from, body.to)
                        .await?,
                )
            }
            "split_points" => {
                let body: RangeBody = parse_body(name, body)?;
                check_range(&body)?;
                let n = body
                    .n
                    .ok_or_else(|| Error::invalid("split_points needs n"))?;
                if n == 0 || n > protocol::MAX_PARTITIONS {
                    return Err(Error::invalid(format!(
                        "n must be 1 to {}",
                        protocol::MAX_PARTITIONS
                    )));
                }
                json_bytes(
                    &source
                        .split_points(&body.capture_instance, body.from, body.to, n)
                        .await?,
                )
            }
            "snapshot_lsn" => {
                let body: TableBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.snapshot_lsn(&body.table.parse()?).await?),
                })
            }
            "key_extent" => {
                let body: TableBody = parse_body(name, body)?;
                json_bytes(&source.key_extent(&body.table.parse()?).await?)
            }
            "key_buckets" => {
                let body: protocol::KeyBucketsBody = parse_body(name, body)?;
                if body.width == 0 || body.hi < body.lo {
                    return Err(Error::invalid("key_buckets needs lo <= hi and width >= 1"));
                }
                let slices = (i128::from(body.hi) - i128::from(body.lo)) / i128::from(body.width);
                if slices >= 100_000 {
                    return Err(Error::invalid(
                        "key_buckets answers at most 100,000 slices: widen the slices",
                    ));
                }
                json_bytes(
                    &source
                        .key_buckets(&body.table.parse()?, body.lo, body.hi, body.width)
                        .await?,
                )
            }
            "key_max" => {
                let body: protocol::KeyMaxBody = parse_body(name, body)?;
                let table = body.table.parse()?;
                let (keys, unique) =
                    snapshot::table_keys(source, &table, body.keys.as_deref()).await?;
                let max = source.key_max(&table, &keys).await?;
                json_bytes(&protocol::KeyMaxAnswer { keys, unique, max })
            }
            "key_bound" => {
                let body: protocol::KeyBoundBody = parse_body(name, body)?;
                let table = body.table.parse()?;
                let (keys, _) = snapshot::table_keys(source, &table, body.keys.as_deref()).await?;
                body.seek.check(&keys)?;
                json_bytes(&protocol::KeyBoundAnswer {
                    bound: source.key_bound(&table, &keys, &body.seek).await?,
                })
            }
            "count_changes" => {
                let body: RangeBody = parse_body(name, body)?;
                check_range(&body)?;
                let tiles = source
                    .split_points(&body.capture_instance, body.from, body.to, 1)
                    .await?;
                json_bytes(&CountAnswer {
                    rows: tiles.iter().map(|tile| tile.rows).sum(),
                })
            }
            "initial_offset" => {
                let body: InitialOffsetBody = parse_body(name, body)?;
                json_bytes(&self.initial_offset(&body).await?)
            }
            "latest_offset" => {
                let body: LatestOffsetBody = parse_body(name, body)?;
                json_bytes(&self.latest_offset(&body).await?)
            }
            other => {
                let known: Vec<&str> = ACTIONS.iter().map(|(name, _)| *name).collect();
                return Err(Error::invalid(format!(
                    "unknown action '{other}' (known: {})",
                    known.join(", ")
                )));
            }
        })
    }

    async fn offset_at(&self, lsn: Lsn) -> Result<Offset> {
        Ok(Offset::new(lsn, self.source.lsn_to_time(lsn).await?))
    }

    /// Where a new stream starts: `earliest` is just before the oldest instance's `min_lsn`
    /// (so the first range starts at it); `latest` is `max_lsn`, or just before a newer
    /// instance's start LSN the database has not reached yet.
    async fn initial_offset(&self, body: &InitialOffsetBody) -> Result<Offset> {
        let table: TableName = body.table.parse()?;
        let instances = self.source.capture_instances(&table).await?;
        match body.starting.as_deref().unwrap_or("earliest") {
            "earliest" => {
                let oldest = instances.first().ok_or_else(|| Error::TableNotFound {
                    table: table.to_string(),
                })?;
                let min_lsn = self.source.min_lsn(&oldest.name).await?;
                self.offset_at(min_lsn.decrement()).await
            }
            "latest" => {
                let mut lsn = self.source.max_lsn().await?.unwrap_or(Lsn::ZERO);
                for instance in &instances {
                    if instance.start_lsn > lsn {
                        lsn = lsn.max(instance.start_lsn.decrement());
                    }
                }
                self.offset_at(lsn).await
            }
            explicit => {
                let lsn: Lsn = explicit.parse().map_err(|error| {
                    Error::invalid(format!(
                        "starting must be earliest, latest or an LSN: {error}"
                    ))
                })?;
                self.offset_at(lsn).await
            }
        }
    }

    /// The end of the next range: `max_lsn` (or `upper`), capped at `max_commits` commits
    /// after `start`; `start` itself when nothing is newer.
    async fn latest_offset(&self, body: &LatestOffsetBody) -> Result<Offset> {
        if body.max_commits == Some(0) {
            return Err(Error::invalid(
                "max_commits must be at least 1; omit it to read up to max_lsn",
            ));
        }
        let max_lsn = self.source.max_lsn().await?.unwrap_or(Lsn::ZERO);
        let mut upper = body.upper.map_or(max_lsn, |upper| upper.min(max_lsn));
        if let Some(start) = &body.start {
            if upper <= start.lsn {
                return Ok(*start);
            }
            if let Some(n) = body.max_commits
                && let Some(nth) = self.source.nth_commit_after(start.lsn, n).await?
            {
                upper = upper.min(nth);
            }
        }
        self.offset_at(upper).await
    }
}

fn check_range(body: &RangeBody) -> Result<()> {
    if body.from > body.to {
        return Err(Error::invalid(format!(
            "from {} is past to {}",
            body.from, body.to
        )));
    }
    Ok(())
}

fn change_read(ticket: &ChangeRangeTicket) -> Result<ChangeRead> {
    let lsn = |bytes: &[u8]| {
        Lsn::try_from_slice(bytes).map_err(|error| Error::TicketMalformed(error.to_string()))
    };
    let columns = TicketColumn::to_output(&ticket.columns)?;
    let usize_of = |value: u64| usize::try_from(value).unwrap_or(usize::MAX).max(1);
    Ok(ChangeRead {
        capture_instance: ticket.capture_instance.clone(),
        from: lsn(&ticket.from_lsn)?,
        to: lsn(&ticket.to_lsn)?,
        columns,
        include_command_id: ticket.include_command_id,
        batch_rows: usize_of(ticket.batch_rows),
        batch_bytes: usize_of(ticket.batch_bytes),
    })
}

/// Reads a change range into `batches`; sends the completion marker to `done` only when the
/// whole range was read and CDC cleanup did not pass its start meanwhile.
async fn produce_range(
    source: Arc<dyn CdcSource>,
    read: ChangeRead,
    batches: mpsc::Sender<std::result::Result<RecordBatch, FlightError>>,
    done: oneshot::Sender<FlightData>,
) {
    let started = Instant::now();
    let outcome = async {
        let min_before = source.min_lsn(&read.capture_instance).await?;
        if read.from < min_before {
            return Err(Error::ChangesPurged {
                capture_instance: read.capture_instance.clone(),
                requested: read.from,
                min_lsn: min_before,
                hint: String::new(),
            });
        }
        let mut stream = source.read_changes(read.clone()).await?;
        let (mut rows, mut bytes) = (0u64, 0u64);
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            rows += batch.num_rows() as u64;
            bytes += crate::types::batch_slice_size(&batch) as u64;
            if batches.send(Ok(batch)).await.is_err() {
                return Ok(None); // the client went away
            }
        }
        let min_lsn = source.min_lsn(&read.capture_instance).await?;
        if min_lsn > read.from {
            return Err(Error::PurgedDuringRead {
                capture_instance: read.capture_instance.clone(),
                from: read.from,
                min_lsn,
            });
        }
        let max_lsn = source.max_lsn().await?;
        let max_commit_ts = match max_lsn {
            Some(lsn) => source.lsn_to_time(lsn).await?,
            None => None,
        };
        Ok(Some(Completion {
            kind: COMPLETION_TYPE.into(),
            capture_instance: read.capture_instance.clone(),
            from: read.from,
            to: read.to,
            rows,
            bytes,
            seconds: started.elapsed().as_secs_f64(),
            min_lsn,
            max_lsn,
            max_commit_ts,
            snapshot_lsn: None,
        }))
    }
    .await;
    match outcome {
        Ok(Some(completion)) => {
            tracing::debug!(capture_instance = %completion.capture_instance, rows = completion.rows,
                seconds = completion.seconds, "range served");
            let _ = done.send(FlightData::new().with_app_metadata(json_bytes(&completion)));
        }
        Ok(None) => tracing::debug!("client closed the stream before its end"),
        Err(error) => {
            let _ = batches.send(Err(flight_error(&error))).await;
        }
    }
}

type BoxedStream<T> = BoxStream<'static, std::result::Result<T, Status>>;

/// A `do_get` response: the batches a producer sends, encoded, then its completion marker
/// (sent only when the read was whole).
fn flight_stream(
    schema: arrow::datatypes::SchemaRef,
    options: IpcWriteOptions,
    batches: mpsc::Receiver<std::result::Result<RecordBatch, FlightError>>,
    done: oneshot::Receiver<FlightData>,
) -> BoxedStream<FlightData> {
    let data = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_options(options)
        .with_max_flight_data_size(MAX_FLIGHT_DATA_SIZE)
        .build(ReceiverStream::new(batches))
        .map_err(Status::from);
    let marker =
        futures::stream::once(done).filter_map(|marker| async move { marker.ok().map(Ok) });
    data.chain(marker).boxed()
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
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> std::result::Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented(
            "handshake is not needed: calls carry no session",
        ))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> std::result::Result<Response<Self::ListFlightsStream>, Status> {
        let mut infos = Vec::new();
        for tracked in self.source.tracked_tables().await? {
            infos.push(Ok(self.table_info(&tracked.table).await?));
        }
        Ok(Response::new(futures::stream::iter(infos).boxed()))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let descriptor = request.into_inner();
        let info = match Command::parse(&descriptor.cmd)? {
            Command::Table(command) => self.table_info(&command.table.parse()?).await?,
            Command::Changes(command) => self.changes_info(&command, descriptor).await?,
            Command::Snapshot(command) => {
                snapshot::plan(self.source.as_ref(), &self.signer, &command, descriptor).await?
            }
        };
        Ok(Response::new(info))
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
        let schema = match Command::parse(&request.get_ref().cmd)? {
            Command::Table(command) => {
                let table: TableName = command.table.parse()?;
                let instances = self.source.capture_instances(&table).await?;
                output_schema(&planner::union_columns(&table, &instances)?, true)
            }
            Command::Changes(command) => {
                let table: TableName = command.table.parse()?;
                let instances = planner::stream_instances(
                    self.source.as_ref(),
                    &table,
                    command.capture_instance.as_deref(),
                )
                .await?;
                let columns = planner::select_columns(
                    &table,
                    planner::union_columns(&table, &instances)?,
                    command.columns.as_deref(),
                )?;
                output_schema(&columns, command.include_command_id.unwrap_or(true))
            }
            Command::Snapshot(command) => {
                let table: TableName = command.table.parse()?;
                let instances = self.source.capture_instances(&table).await?;
                let columns = planner::select_columns(
                    &table,
                    planner::union_columns(&table, &instances)?,
                    command.columns.as_deref(),
                )?;
                crate::types::snapshot_schema(&columns, command.include_command_id.unwrap_or(true))
            }
        };
        let result = SchemaResult::try_from(SchemaAsIpc::new(&schema, &IpcWriteOptions::default()))
            .map_err(|error| Status::internal(error.to_string()))?;
        Ok(Response::new(result))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<Self::DoGetStream>, Status> {
        let body = self.signer.verify(&request.get_ref().ticket)?;
        let range = match body.kind {
            Some(TicketKind::ChangeRange(range)) => range,
            Some(TicketKind::Snapshot(ticket)) => return self.serve_snapshot(&ticket),
            None => {
                return Err(Status::invalid_argument(
                    "ticket is malformed: it names nothing to read",
                ));
            }
        };
        let read = change_read(&range)?;
        let schema = output_schema(&read.columns, read.include_command_id);
        let options = ipc_options(range.compression)?;
        let (batch_sender, batch_receiver) = mpsc::channel(2);
        let (done_sender, done_receiver) = oneshot::channel();
        tokio::spawn(produce_range(
            Arc::clone(&self.source),
            read,
            batch_sender,
            done_sender,
        ));
        Ok(Response::new(flight_stream(
            schema,
            options,
            batch_receiver,
            done_receiver,
        )))
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
        let answer = self.action(request.get_ref()).await?;
        let result = arrow_flight::Result { body: answer };
        Ok(Response::new(
            futures::stream::once(async move { Ok(result) }).boxed(),
        ))
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> std::result::Result<Response<Self::ListActionsStream>, Status> {
        let actions = ACTIONS.iter().map(|(name, description)| {
            Ok(ActionType {
                r#type: (*name).to_string(),
                description: (*description).to_string(),
            })
        });
        Ok(Response::new(
            futures::stream::iter(actions.collect::<Vec<_>>()).boxed(),
        ))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange: use do_get"))
    }
}
