//! The sidecar's admin service over gRPC (`proto/mssql_cdc_admin.proto`): open a full or
//! chunked snapshot of a table, its status, pause and resume.
//!
//! Every call works on the lake through the same functions as the CLI without `--admin`
//! (`snapshot::{open, state, set_paused}`), with the table's settings from the sidecar file,
//! so the answer is the same whichever way it was asked. Pause and resume are rows of the
//! plans table, which the sidecar's backfill checks before each wave.

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Status};

use crate::error::{Result, WriterError};
use crate::sidecar::SidecarConfig;
use crate::snapshot::{self, SnapshotMode, SnapshotState};
use crate::stream::StreamConfig;

#[allow(missing_docs, clippy::all, clippy::unwrap_used)]
mod generated {
    include!(concat!(
        env!("OUT_DIR"),
        "/mssql_cdc.admin.SnapshotAdmin.rs"
    ));
}

pub use generated::snapshot_admin_client::SnapshotAdminClient;
pub use generated::snapshot_admin_server::{SnapshotAdmin, SnapshotAdminServer};

/// `TableRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TableRequest {
    /// `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
}

/// `OpenRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OpenRequest {
    /// `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
    /// `full` or `chunked`.
    #[prost(string, tag = "2")]
    pub mode: String,
    /// A chunked re-snapshot even when a complete snapshot exists.
    #[prost(bool, tag = "3")]
    pub resnapshot: bool,
}

/// `PauseRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PauseRequest {
    /// `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
    /// Why; shown by status.
    #[prost(string, tag = "2")]
    pub reason: String,
}

/// `SnapshotState`, the answer of every call.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotStateMessage {
    /// `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
    /// S.
    #[prost(string, optional, tag = "2")]
    pub snapshot: Option<String>,
    /// `full` or `chunked`.
    #[prost(string, optional, tag = "3")]
    pub mode: Option<String>,
    /// Chunks with their facts row.
    #[prost(uint64, tag = "4")]
    pub chunks_done: u64,
    /// Chunks planned.
    #[prost(uint64, optional, tag = "5")]
    pub chunks_total: Option<u64>,
    /// Completion row in.
    #[prost(bool, tag = "6")]
    pub done: bool,
    /// Paused by an operator.
    #[prost(bool, tag = "7")]
    pub paused: bool,
    /// `no_snapshot`, `open`, `paused` or `done`.
    #[prost(string, tag = "8")]
    pub state: String,
    /// The operator's reason while paused.
    #[prost(string, optional, tag = "9")]
    pub reason: Option<String>,
}

impl SnapshotStateMessage {
    fn of(table: &str, state: SnapshotState) -> Self {
        SnapshotStateMessage {
            table: table.to_string(),
            snapshot: state.snapshot.map(|lsn| lsn.to_string()),
            mode: state.mode,
            chunks_done: state.chunks_done,
            chunks_total: state.chunks_total,
            done: state.done,
            paused: state.paused,
            state: state.state,
            reason: state.reason,
        }
    }

    fn into_state(self) -> Result<SnapshotState> {
        Ok(SnapshotState {
            snapshot: self
                .snapshot
                .map(|text| text.parse())
                .transpose()
                .map_err(|error| WriterError::Internal(format!("admin answer: {error}")))?,
            mode: self.mode,
            chunks_done: self.chunks_done,
            chunks_total: self.chunks_total,
            done: self.done,
            paused: self.paused,
            state: self.state,
            reason: self.reason,
        })
    }
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

/// Sends a request for `table` to the admin service at `url`.
pub async fn call(url: &str, table: &str, request: Request) -> Result<SnapshotState> {
    let mut client = SnapshotAdminClient::connect(url.to_string())
        .await
        .map_err(|error| {
            WriterError::Internal(format!("cannot reach the admin service at {url}: {error}"))
        })?;
    let table_request = || TableRequest {
        table: table.to_string(),
    };
    let answer = match request {
        Request::Open(mode, resnapshot) => {
            client
                .open(OpenRequest {
                    table: table.to_string(),
                    mode: match mode {
                        SnapshotMode::Full => "full",
                        SnapshotMode::Chunked => "chunked",
                    }
                    .into(),
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
    .map_err(|status| match status.code() {
        Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition => {
            WriterError::InvalidArgument(status.message().to_string())
        }
        _ => WriterError::Internal(format!("admin service: {}", status.message())),
    })?;
    answer.into_inner().into_state()
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
        let entry = self
            .config
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
            })?;
        Ok(self.config.stream(entry))
    }

    async fn answer(
        &self,
        table: &str,
        request: Request,
    ) -> std::result::Result<tonic::Response<SnapshotStateMessage>, Status> {
        let config = self.table(table)?;
        tracing::info!(table, ?request, "admin request");
        let state = run_locally(&config, request).await.map_err(to_status)?;
        Ok(tonic::Response::new(SnapshotStateMessage::of(table, state)))
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
}

/// Serves the admin service on `listener` until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    config: SidecarConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    tonic::transport::Server::builder()
        .add_service(SnapshotAdminServer::new(AdminService::new(config)))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        })
        .await
        .map_err(|error| WriterError::Internal(format!("admin service: {error}")))
}
