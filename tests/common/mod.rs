//! Shared test fixtures: a simulated database in a temporary directory, a real Flight server
//! on 127.0.0.1:0, and helpers to read every endpoint of a plan.
#![allow(dead_code)] // each test binary uses a different part

pub mod faulty;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arrow::array::{Array, Int32Array, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use arrow_flight::Ticket;
use arrow_flight::flight_service_client::FlightServiceClient;
use mssql_cdc_flight::client::{CdcClient, ChangesPlan, ClientError, ClientResult};
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::protocol::{ChangesCommand, Completion, InitialOffsetBody};
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, SimWriter, sample};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_flight::{CommitTime, Lsn, Offset};
use tempfile::TempDir;
use tonic::Code;

/// 2026-01-01T00:00:00Z.
pub const START: CommitTime = CommitTime(1_767_225_600_000_000);

/// A simulated database with the sample tables in a temporary directory.
pub struct SimFixture {
    pub dir: TempDir,
    pub db: SimDb,
    pub journal: PathBuf,
}

impl SimFixture {
    pub fn new() -> Self {
        Self::with_tables(&sample::sample_tables())
    }

    /// A simulated database with these tables.
    pub fn with_tables(tables: &[mssql_cdc_flight::sim::TableSpec]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = SimDb::create(&dir.path().join("db"), tables, START).expect("create sim");
        let journal = dir.path().join("journal.jsonl");
        SimFixture { dir, db, journal }
    }

    /// A writer with a virtual clock that journals every change row.
    pub fn writer(&self, seed: u64) -> SimWriter {
        let mut writer = self
            .db
            .writer(Clock::Virtual { step_micros: 1_000 }, seed)
            .expect("writer");
        writer.set_journal(&self.journal).expect("journal");
        writer
    }

    /// The journal's rows of one table, in commit order.
    pub fn journal_rows(&self, table: &str) -> Vec<JournalRow> {
        let text = std::fs::read_to_string(&self.journal).unwrap_or_default();
        let mut rows: Vec<JournalRow> = text
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("journal line"))
            .filter(|value| value["table"] == table)
            .map(|value| JournalRow {
                start_lsn: value["start_lsn"].as_str().expect("lsn").to_string(),
                seqval: value["seqval"].as_str().expect("seqval").to_string(),
                operation: value["operation"].as_i64().expect("operation") as i32,
                command_id: value["command_id"].as_i64().expect("command id") as i32,
                key: value["key"].as_i64().expect("key"),
            })
            .collect();
        rows.sort();
        rows
    }
}

/// One change row as the journal and the stream both describe it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct JournalRow {
    pub start_lsn: String,
    pub command_id: i32,
    pub seqval: String,
    pub operation: i32,
    pub key: i64,
}

/// A Flight server serving a source on a loopback port.
pub struct FlightFixture {
    pub url: String,
    pub client: CdcClient,
    server: LocalServer,
}

impl FlightFixture {
    pub async fn start(source: Arc<dyn CdcSource>) -> Self {
        Self::start_with_key(source, test_signer()).await
    }

    pub async fn start_with_key(source: Arc<dyn CdcSource>, signer: TicketSigner) -> Self {
        Self::start_with(source, ServiceOptions::new(signer)).await
    }

    /// A server with these options; the fixture's client sends no token.
    pub async fn start_with(source: Arc<dyn CdcSource>, options: ServiceOptions) -> Self {
        let server = LocalServer::start_with(source, options)
            .await
            .expect("server");
        let client = CdcClient::connect(&server.url).await.expect("connect");
        FlightFixture {
            url: server.url.clone(),
            client,
            server,
        }
    }

    pub async fn shutdown_and_wait(self) {
        self.server.stop().await.expect("server result");
    }
}

/// Reads every endpoint of a plan in order.
pub async fn read_plan(
    client: &CdcClient,
    plan: &ChangesPlan,
) -> ClientResult<(Vec<RecordBatch>, Vec<Completion>)> {
    let mut batches = Vec::new();
    let mut completions = Vec::new();
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.as_ref().expect("ticket");
        let (endpoint_batches, completion) = client.collect_endpoint(ticket).await?;
        batches.extend(endpoint_batches);
        completions.push(completion);
    }
    Ok((batches, completions))
}

/// Plans and reads `(from, to]` of a table.
pub async fn read_range(
    client: &CdcClient,
    table: &str,
    from: Lsn,
    to: Option<Lsn>,
    partitions: u32,
) -> (ChangesPlan, Vec<RecordBatch>) {
    let mut command = ChangesCommand::new(table, from, to);
    command.partitions = Some(partitions);
    command.min_partition_rows = Some(100);
    let plan = client.plan_changes(&command).await.expect("plan");
    let (batches, _) = read_plan(client, &plan).await.expect("read");
    (plan, batches)
}

fn strings<'a>(batch: &'a RecordBatch, name: &str) -> &'a StringArray {
    batch
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no column {name}"))
        .as_any()
        .downcast_ref::<StringArray>()
        .expect("utf8 column")
}

fn int32s<'a>(batch: &'a RecordBatch, name: &str) -> &'a Int32Array {
    batch
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no column {name}"))
        .as_any()
        .downcast_ref::<Int32Array>()
        .expect("int32 column")
}

/// The change rows of batches, keyed by the integer key column `key`.
pub fn stream_rows(batches: &[RecordBatch], key: &str) -> Vec<JournalRow> {
    let mut rows = Vec::new();
    for batch in batches {
        let keys: Vec<i64> = match batch
            .column_by_name(key)
            .expect("key column")
            .as_any()
            .downcast_ref::<Int64Array>()
        {
            Some(array) => array.values().to_vec(),
            None => int32s(batch, key)
                .values()
                .iter()
                .map(|value| i64::from(*value))
                .collect(),
        };
        let (lsns, seqvals) = (strings(batch, "_start_lsn"), strings(batch, "_seqval"));
        let (operations, commands) = (int32s(batch, "_operation"), int32s(batch, "_command_id"));
        for (row, key) in keys.into_iter().enumerate() {
            rows.push(JournalRow {
                start_lsn: lsns.value(row).to_string(),
                command_id: commands.value(row),
                seqval: seqvals.value(row).to_string(),
                operation: operations.value(row),
                key,
            });
        }
    }
    rows
}

/// Total rows of batches.
pub fn row_count(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// Whether a column holds only NULLs in every batch.
pub fn all_null(batches: &[RecordBatch], name: &str) -> bool {
    batches
        .iter()
        .all(|batch| batch.column_by_name(name).expect("column").null_count() == batch.num_rows())
}

/// `dbo.orders`, a sample table.
pub fn orders() -> mssql_cdc_flight::source::TableName {
    "dbo.orders".parse().expect("table")
}

/// A database with seeded rows and a mixed workload of `commits` (seeded by `seed`).
pub fn with_workload(seed: u64, commits: u64) -> SimFixture {
    let sim = SimFixture::new();
    let mut writer = sim.writer(seed);
    let spec = WorkloadSpec {
        commits: Some(commits),
        max_rows_per_statement: 5,
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    sim
}

/// [`with_workload`], served by a fixture.
pub async fn loaded(seed: u64, commits: u64) -> (SimFixture, FlightFixture) {
    let sim = with_workload(seed, commits);
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    (sim, flight)
}

/// The plan of `table` from its earliest offset with every option at its default, and its
/// first endpoint's ticket.
pub async fn first_ticket(flight: &FlightFixture, table: &str) -> (ChangesPlan, Ticket) {
    let start = earliest(flight, table).await;
    let plan = flight
        .client
        .plan_changes(&ChangesCommand::new(table, start.lsn, None))
        .await
        .expect("plan");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    (plan, ticket)
}

/// The offset a new stream of `table` starts at.
pub async fn earliest(flight: &FlightFixture, table: &str) -> Offset {
    initial_offset(&flight.client, table, None).await
}

/// The `initial_offset` action's answer for `table` starting at `starting`.
pub async fn initial_offset(client: &CdcClient, table: &str, starting: Option<&str>) -> Offset {
    client
        .action(
            "initial_offset",
            &InitialOffsetBody {
                table: table.into(),
                starting: starting.map(String::from),
            },
        )
        .await
        .expect("initial offset")
}

/// The test fixture's ticket key.
pub fn test_signer() -> TicketSigner {
    TicketSigner::new(b"the test key of the flight fixture, 32+ bytes").expect("key")
}

/// A stock arrow-flight client of the fixture, for calls our client does not make (tonic's
/// default 4 MiB receive limit, as stock clients have).
pub async fn raw_client(flight: &FlightFixture) -> FlightServiceClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(flight.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    FlightServiceClient::new(channel)
}

/// A client of the fixture sending `token` on every call.
pub async fn as_principal(flight: &FlightFixture, token: &str) -> CdcClient {
    CdcClient::connect(&flight.url)
        .await
        .expect("connect")
        .with_token(token)
        .expect("token")
}

/// The gRPC code of a client error that must carry one.
pub fn code(error: ClientError) -> Code {
    error
        .code()
        .unwrap_or_else(|| panic!("expected a status, got {error}"))
}
