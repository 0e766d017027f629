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

mod actions;
pub mod local;
pub mod planner;
pub mod snapshot;
pub mod stream;
pub mod ticket;

pub use actions::ActionKind;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
};
use futures::StreamExt;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status, Streaming};

use crate::error::{Error, Result};
use crate::protocol::{
    self, CaptureInstanceInfo, ChangesCommand, Command, DEFAULT_BATCH_BYTES, DEFAULT_BATCH_ROWS,
};
use crate::source::{CdcSource, TableName};
use crate::types::output_schema;
use stream::{BoxedStream, StreamRead};
use ticket::{ChangeRangeTicket, TicketBody, TicketColumn, TicketKind, TicketSigner};

/// Largest message the server accepts from a client.
const MAX_DECODING_MESSAGE_SIZE: usize = 16 << 20;

pub use mssql_cdc_proto::protocol::{CONNECTION_WINDOW, STREAM_WINDOW};

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
    FlightError::Tonic(Box::new(crate::status::to_status(error)))
}

impl CdcFlightService {
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
                    compression: command.compression.unwrap_or_default().ticket_code(),
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
        let (read, compression) = match body.kind {
            Some(TicketKind::ChangeRange(ticket)) => {
                (StreamRead::changes(&ticket)?, ticket.compression)
            }
            Some(TicketKind::Snapshot(ticket)) => (
                StreamRead::Snapshot(snapshot::ticket_read(&ticket)?),
                ticket.compression,
            ),
            None => {
                return Err(Status::invalid_argument(
                    "ticket is malformed: it names nothing to read",
                ));
            }
        };
        Ok(Response::new(stream::respond(
            Arc::clone(&self.source),
            read,
            compression,
        )?))
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
        let actions = ActionKind::ALL.iter().map(|kind| {
            Ok(ActionType {
                r#type: kind.name().to_string(),
                description: kind.description().to_string(),
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
