//! Shared fixtures of the writer tests: a simulated database served on 127.0.0.1:0, a lake
//! in a temporary directory, and queries over the lake's tables.
#![allow(dead_code)] // each test binary uses a different part

pub mod history;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arrow::array::{Array, Int32Array, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::masking::MaskPolicy;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, SimWriter, sample};
use mssql_cdc_proto::protocol::SnapshotCommand;
pub use mssql_cdc_proto::selection::ColumnSelection;
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::stream::StreamConfig;
use mssql_cdc_writer::tables;
use std::collections::BTreeMap;

/// The Python with pyarrow and the `deltalake` package the tests call: `MSSQL_CDC_PYTHON`,
/// else the repository's `.venv` (scripts/test makes it).
pub fn python() -> PathBuf {
    std::env::var_os("MSSQL_CDC_PYTHON").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"),
        Into::into,
    )
}

/// 2026-01-01T00:00:00Z.
pub const START: CommitTime = CommitTime(1_767_225_600_000_000);

pub struct Lab {
    pub dir: tempfile::TempDir,
    pub db: SimDb,
    pub url: String,
    /// Stopped when the lab is dropped.
    _server: LocalServer,
}

impl Lab {
    pub async fn new() -> Self {
        Self::with_tables(&sample::sample_tables()).await
    }

    /// A lab whose simulated database holds these tables.
    pub async fn with_tables(tables: &[mssql_cdc_flight::sim::TableSpec]) -> Self {
        let signer = TicketSigner::random().expect("key");
        Self::with_options(tables, ServiceOptions::new(signer)).await
    }

    /// A lab of the sample tables whose server masks columns as `masks` says.
    pub async fn masked(masks: MaskPolicy) -> Self {
        let options = ServiceOptions {
            masks: Arc::new(masks),
            ..ServiceOptions::new(TicketSigner::random().expect("key"))
        };
        Self::with_options(&sample::sample_tables(), options).await
    }

    /// A lab whose simulated database holds these tables, served with `options`.
    pub async fn with_options(
        tables: &[mssql_cdc_flight::sim::TableSpec],
        options: ServiceOptions,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp");
        let db = SimDb::create(&dir.path().join("db"), tables, START).expect("sim");
        let server = LocalServer::start_with(Arc::new(db.clone()), options)
            .await
            .expect("server");
        Lab {
            dir,
            db,
            url: server.url.clone(),
            _server: server,
        }
    }

    pub fn writer(&self, seed: u64) -> SimWriter {
        let mut writer = self
            .db
            .writer(Clock::Virtual { step_micros: 1_000 }, seed)
            .expect("writer");
        writer.set_journal(&self.journal()).expect("journal");
        writer
    }

    pub fn journal(&self) -> PathBuf {
        self.dir.path().join("journal.jsonl")
    }

    pub fn lake(&self, name: &str) -> String {
        self.dir
            .path()
            .join("lake")
            .join(name)
            .display()
            .to_string()
    }

    pub fn config(&self) -> StreamConfig {
        StreamConfig {
            server: self.url.clone(),
            table: "dbo.orders".into(),
            target: self.lake("bronze_orders"),
            facts: self.lake("facts"),
            control: Some(self.lake("control")),
            app_id: "orders".into(),
            checkpoint: self.dir.path().join("checkpoint").display().to_string(),
            starting: "earliest".into(),
            max_commits: None,
            partitions: 2,
            granularity: Granularity::Minute,
            fail_on_data_loss: true,
            schema_change_policy: mssql_cdc_writer::schema_policy::SchemaChangePolicy::default(),
            on_data_loss: mssql_cdc_writer::data_loss::OnDataLoss::default(),
            snapshot_on_switch: false,
            resnapshot_every_days: None,
            resnapshot_interval_days: None,
            snapshot_keys: None,
            columns: Default::default(),
        }
    }

    /// The stream of `table` into bronze `bronze_<name>`, app id `name`, its checkpoint
    /// `checkpoint_<name>`: one of several tables of one lab.
    pub fn stream_of(&self, table: &str, name: &str) -> StreamConfig {
        StreamConfig {
            table: table.into(),
            target: self.lake(&format!("bronze_{name}")),
            app_id: name.into(),
            checkpoint: self
                .dir
                .path()
                .join(format!("checkpoint_{name}"))
                .display()
                .to_string(),
            ..self.config()
        }
    }

    pub fn workload(&self, seed: u64, commits: u64) {
        let mut writer = self.writer(seed);
        let spec = WorkloadSpec {
            commits: Some(commits),
            ..WorkloadSpec::default()
        };
        workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    }

    /// Purges every change up to the source's `max_lsn`, after an idle entry (by a writer
    /// of `seed`) past it, so the source's `max_lsn` stays beyond the cut; the cut, `None`
    /// when nothing was committed yet.
    pub async fn purge_to_max_lsn(&self, seed: u64) -> Option<mssql_cdc_flight::Lsn> {
        use mssql_cdc_flight::source::CdcSource;
        let cut = self.db.max_lsn().await.expect("max_lsn")?;
        let mut writer = self.writer(seed);
        writer.idle();
        writer.publish().expect("publish");
        drop(writer);
        self.db.cleanup(None, cut).expect("cleanup");
        Some(cut)
    }

    /// `(start_lsn, seqval, operation, key)` of every journal row of dbo.orders.
    pub fn committed(&self) -> Vec<(String, String, i32, i64)> {
        self.committed_of("dbo.orders")
    }

    /// `(start_lsn, seqval, operation, key)` of every journal row of `table`.
    pub fn committed_of(&self, table: &str) -> Vec<(String, String, i32, i64)> {
        let text = std::fs::read_to_string(self.journal()).unwrap_or_default();
        let mut rows: Vec<_> = text
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("json"))
            .filter(|value| value["table"] == table)
            .map(|value| {
                (
                    value["start_lsn"].as_str().expect("lsn").to_string(),
                    value["seqval"].as_str().expect("seqval").to_string(),
                    value["operation"].as_i64().expect("op") as i32,
                    value["key"].as_i64().expect("key"),
                )
            })
            .collect();
        rows.sort();
        rows
    }
}

pub async fn query(location: &str, sql: &str) -> Vec<RecordBatch> {
    let url = tables::table_url(location).expect("url");
    let table = tables::open(&url)
        .await
        .expect("open")
        .expect("table exists");
    let context = SessionContext::new();
    context
        .register_table("t", table.table_provider().await.expect("provider"))
        .expect("register");
    context
        .sql(sql)
        .await
        .expect("sql")
        .collect()
        .await
        .expect("collect")
}

/// Runs a stream of `config` available-now, panicking on any error.
/// The Delta table at `location`, which must exist.
pub async fn open_table(location: &str) -> deltalake::DeltaTable {
    mssql_cdc_writer::tables::open(&mssql_cdc_writer::tables::table_url(location).expect("url"))
        .await
        .expect("open")
        .unwrap_or_else(|| panic!("no table at {location}"))
}

/// `table` without the rows `predicate` holds for.
pub async fn delete_where(table: deltalake::DeltaTable, predicate: &str) -> deltalake::DeltaTable {
    table
        .delete()
        .with_predicate(predicate)
        .await
        .unwrap_or_else(|error| panic!("delete where {predicate}: {error}"))
        .0
}

/// `table` with `column` set to the SQL expression `value` where `predicate` holds.
pub async fn update_where(
    table: deltalake::DeltaTable,
    predicate: &str,
    column: &str,
    value: &str,
) -> deltalake::DeltaTable {
    table
        .update()
        .with_predicate(predicate)
        .with_update(column, value)
        .await
        .unwrap_or_else(|error| panic!("update {column} = {value} where {predicate}: {error}"))
        .0
}

pub async fn run_now(config: StreamConfig) -> Vec<mssql_cdc_writer::stream::BatchOutcome> {
    try_run_now(config).await.expect("stream run")
}

/// Runs a stream of `config` available-now.
pub async fn try_run_now(
    config: StreamConfig,
) -> mssql_cdc_writer::Result<Vec<mssql_cdc_writer::stream::BatchOutcome>> {
    mssql_cdc_writer::stream::Stream::connect(config)
        .await?
        .run_available_now()
        .await
}

/// A column as plain Utf8 (DataFusion scans strings as Utf8View).
pub fn utf8(array: &arrow::array::ArrayRef) -> StringArray {
    let cast =
        arrow::compute::cast(array, &arrow::datatypes::DataType::Utf8).expect("cast to utf8");
    cast.as_any()
        .downcast_ref::<StringArray>()
        .expect("utf8")
        .clone()
}

pub async fn bronze_rows(lab: &Lab) -> Option<Vec<(String, String, i32, i64)>> {
    change_rows(
        &lab.lake("bronze_orders"),
        "SELECT _start_lsn, _seqval, _operation, order_id FROM t",
    )
    .await
}

/// `(start_lsn, seqval, operation, key)` of the rows `sql` selects (those four columns, the
/// key a BIGINT) from the table at `location`, sorted; `None` when there is no table there.
pub async fn change_rows(location: &str, sql: &str) -> Option<Vec<(String, String, i32, i64)>> {
    let url = tables::table_url(location).expect("url");
    tables::open(&url).await.expect("open")?;
    let batches = query(location, sql).await;
    let mut rows = Vec::new();
    for batch in batches {
        let (lsns, seqvals) = (utf8(batch.column(0)), utf8(batch.column(1)));
        let operations = batch
            .column(2)
            .as_any()
            .downcast_ref::<Int32Array>()
            .expect("int")
            .clone();
        let keys = batch
            .column(3)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("bigint")
            .clone();
        for row in 0..batch.num_rows() {
            rows.push((
                lsns.value(row).to_string(),
                seqvals.value(row).to_string(),
                operations.value(row),
                keys.value(row),
            ));
        }
    }
    rows.sort();
    Some(rows)
}

pub async fn facts_batches(lab: &Lab) -> Vec<(i64, i64, Option<String>)> {
    let batches = query(
        &lab.lake("facts"),
        "SELECT batch_id, rows, event FROM t ORDER BY batch_id, event NULLS FIRST",
    )
    .await;
    let mut rows = Vec::new();
    for batch in batches {
        let ids = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("bigint")
            .clone();
        let counts = batch
            .column(1)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("bigint")
            .clone();
        let events = utf8(batch.column(2));
        for row in 0..batch.num_rows() {
            rows.push((
                ids.value(row),
                counts.value(row),
                events.is_valid(row).then(|| events.value(row).to_string()),
            ));
        }
    }
    rows
}

/// Captured values of rows by key, formatted as text.
pub type Rows = BTreeMap<i64, Vec<String>>;

pub fn text(batch: &RecordBatch, column: usize, row: usize) -> Option<String> {
    let array = batch.column(column);
    if array.is_null(row) {
        return None;
    }
    Some(
        ArrayFormatter::try_new(array.as_ref(), &FormatOptions::default())
            .expect("formatter")
            .value(row)
            .to_string(),
    )
}

pub fn captured(batch: &RecordBatch, row: usize) -> Vec<String> {
    captured_of(batch, row, &ColumnSelection::All)
}

/// The captured values of a row, of the columns `selection` keeps.
pub fn captured_of(batch: &RecordBatch, row: usize, selection: &ColumnSelection) -> Vec<String> {
    batch
        .schema()
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, field)| !field.name().starts_with('_') && !selection.excludes(field.name()))
        .map(|(index, _)| text(batch, index, row).unwrap_or_else(|| "NULL".into()))
        .collect()
}

pub fn key_of(batch: &RecordBatch, row: usize) -> i64 {
    integer_at(batch, "order_id", row)
}

/// The value of an integer column of a row.
pub fn integer_at(batch: &RecordBatch, column: &str, row: usize) -> i64 {
    let index = batch.schema().index_of(column).expect("key");
    text(batch, index, row)
        .expect("key")
        .parse()
        .expect("integer key")
}

/// Lands one commit (3 updates, 3 deletes, 3 inserts of `table`) inside the next snapshot
/// read, between its stamp and its rows; the returned slot is empty once it ran.
pub fn commit_during_next_snapshot_read(
    lab: &Lab,
    table: &str,
    seed: u64,
) -> std::sync::Arc<std::sync::Mutex<Option<SimWriter>>> {
    let writer = std::sync::Arc::new(std::sync::Mutex::new(Some(lab.writer(seed))));
    let hook_writer = std::sync::Arc::clone(&writer);
    let table: mssql_cdc_flight::source::TableName = table.parse().expect("table");
    lab.db.set_faults(mssql_cdc_flight::sim::Faults {
        before_snapshot_read: Some(mssql_cdc_flight::sim::SnapshotHook(std::sync::Arc::new(
            move || {
                let Some(mut writer) = hook_writer.lock().expect("lock").take() else {
                    return;
                };
                let mut tx = writer.begin();
                let keys = tx.random_keys(&table, 6).expect("keys");
                tx.update(&table, &keys[..3]).expect("update");
                tx.delete(&table, &keys[3..]).expect("delete");
                tx.insert(&table, 3).expect("insert");
                tx.commit().expect("commit");
                writer.publish().expect("publish");
            },
        ))),
        ..mssql_cdc_flight::sim::Faults::default()
    });
    writer
}

/// `apply_changes` of the lab's dbo.orders bronze into `silver_orders`, with the facts.
pub fn orders_apply_config(lab: &Lab) -> mssql_cdc_writer::silver::ApplyConfig {
    mssql_cdc_writer::silver::ApplyConfig {
        table: "dbo.orders".into(),
        bronze: lab.lake("bronze_orders"),
        target: lab.lake("silver_orders"),
        capture_instance: None,
        keys: vec!["order_id".into()],
        control: lab.lake("control"),
        facts: Some(lab.lake("facts")),
        granularity: Granularity::Minute,
        deletion_vectors: false,
    }
}

/// The silver tests' mix: inserts, updates, deletes and key updates of dbo.orders.
pub fn churn() -> workload::Mix {
    workload::Mix {
        insert: 0.3,
        update: 0.35,
        delete: 0.2,
        key_update: 0.15,
        idle: 0.0,
    }
}

/// `commits` commits of `mix` to dbo.orders through `writer`.
pub fn run_orders_workload(writer: &mut SimWriter, commits: u64, mix: workload::Mix) {
    let spec = WorkloadSpec {
        commits: Some(commits),
        mix,
        tables: vec!["dbo.orders".parse().expect("table")],
        ..WorkloadSpec::default()
    };
    workload::run(writer, &spec, &AtomicBool::new(false)).expect("workload");
}

/// `ALTER TABLE dbo.orders ADD discount decimal(9,2) NULL`, then a capture instance
/// `dbo_orders_v2` capturing every column (the DBA's switch); returns the writer for the
/// changes after it.
pub fn add_discount_and_switch(lab: &Lab, seed: u64) -> SimWriter {
    add_column_and_switch(lab, seed, "discount", "decimal(9,2)")
}

/// A DBA's `ALTER TABLE dbo.orders ADD <name> <sql_type> NULL` and a second capture
/// instance `dbo_orders_v2` capturing every column; returns the lab's writer to go on with.
pub fn add_column_and_switch(lab: &Lab, seed: u64, name: &str, sql_type: &str) -> SimWriter {
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(seed);
    writer
        .add_column(&orders, name, sql_type, true)
        .expect("ddl");
    let columns = lab.db.columns_of(&orders).expect("columns");
    writer
        .enable_capture_instance(&orders, "dbo_orders_v2", &columns)
        .expect("switch");
    writer
}

/// `commits` commits of `mix` to dbo.orders by the lab's journaled writer.
pub fn orders_workload(lab: &Lab, seed: u64, commits: u64, mix: workload::Mix) {
    run_orders_workload(&mut lab.writer(seed), commits, mix);
}

/// The source table now, read whole through the server.
pub async fn source_rows(lab: &Lab) -> Rows {
    source_rows_of(lab, "dbo.orders", "order_id", &ColumnSelection::All).await
}

/// A source table now, read whole through the server, by an integer column that is unique.
pub async fn source_rows_of(lab: &Lab, table: &str, key: &str, columns: &ColumnSelection) -> Rows {
    let client = CdcClient::connect(&lab.url).await.expect("connect");
    let command = SnapshotCommand {
        serve: columns.serve(),
        ..SnapshotCommand::new(table)
    };
    let plan = client.plan_snapshot(&command).await.expect("plan");
    let mut rows = Rows::new();
    for endpoint in &plan.info.endpoint {
        let (batches, _) = client
            .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
            .await
            .expect("read");
        for batch in &batches {
            for row in 0..batch.num_rows() {
                rows.insert(integer_at(batch, key, row), captured(batch, row));
            }
        }
    }
    rows
}

/// The rows of a current-state table (silver) of dbo.orders by key, each key once.
pub async fn current_rows(location: &str) -> Rows {
    current_rows_by(location, "order_id").await
}

/// The rows of a current-state table (silver) by its integer `key`, each key once.
pub async fn current_rows_by(location: &str, key: &str) -> Rows {
    current_rows_of(location, key, &ColumnSelection::All).await
}

/// [`current_rows_by`] of the columns `selection` keeps.
pub async fn current_rows_of(location: &str, key: &str, selection: &ColumnSelection) -> Rows {
    let batches = query(location, "SELECT * FROM t").await;
    let mut rows = Rows::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            assert!(
                rows.insert(
                    integer_at(batch, key, row),
                    captured_of(batch, row, selection)
                )
                .is_none(),
                "a key twice in {location}"
            );
        }
    }
    rows
}

/// The rebuild rule of ADR 0028 over a bronze table: the rows of snapshot S and the changes
/// after S, the latest row per key (an integer column) by (_start_lsn, _command_id, _seqval,
/// _operation); deletes drop the key.
pub async fn rebuild(bronze: &str, snapshot: mssql_cdc_flight::Lsn, key: &str) -> Rows {
    let batches = query(
        bronze,
        &format!(
            "SELECT * FROM t WHERE (_operation = 0 AND _snapshot = '{snapshot}') \
             OR (_operation <> 0 AND _start_lsn > '{snapshot}') \
             ORDER BY _start_lsn, _command_id NULLS FIRST, _seqval NULLS FIRST, _operation"
        ),
    )
    .await;
    let mut rows = Rows::new();
    for batch in &batches {
        let operation = batch.schema().index_of("_operation").expect("op");
        for row in 0..batch.num_rows() {
            let id = integer_at(batch, key, row);
            match text(batch, operation, row).as_deref() {
                Some("1") | Some("3") => {
                    rows.remove(&id);
                }
                _ => {
                    rows.insert(id, captured(batch, row));
                }
            }
        }
    }
    rows
}
