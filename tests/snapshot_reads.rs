//! Snapshot reads through the real Flight server: whole tables in partitions, chunks planned
//! from counted key slices, and a commit landing between a stream's stamp and its read.

mod common;

use mssql_cdc_flight::keys::{Bound, KeyColumn, KeyTuple, KeyValue, KeysetSeek};
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use arrow::array::{Array, Int32Array, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use common::{FlightFixture, loaded};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::chunking::{self, BucketCounter};
use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::protocol::{
    ChangesCommand, ChunkSpec, Completion, KeyBucketsBody, SnapshotCommand,
};
use mssql_cdc_flight::sim::{Faults, SnapshotHook};
use mssql_cdc_flight::source::{InstanceRange, KeyBucket, KeyExtent, KeyGrid};
use serde_json::json;

const TABLE: &str = "dbo.orders";
const KEY: &str = "order_id";

/// Captured values of a row, formatted, by key.
type Rows = BTreeMap<i64, Vec<String>>;

fn captured_values(batch: &RecordBatch, row: usize) -> Vec<String> {
    let options = FormatOptions::default();
    batch
        .schema()
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, field)| !field.name().starts_with('_'))
        .map(|(index, _)| {
            ArrayFormatter::try_new(batch.column(index).as_ref(), &options)
                .expect("formatter")
                .value(row)
                .to_string()
        })
        .collect()
}

fn keys(batch: &RecordBatch) -> Vec<i64> {
    batch
        .column_by_name(KEY)
        .expect("key")
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("bigint key")
        .values()
        .to_vec()
}

/// The current rows the changes of `batches` leave (every change, in order).
fn replay(rows: &mut Rows, batches: &[RecordBatch]) {
    let mut changes = Vec::new();
    for batch in batches {
        let lsns = batch.column_by_name("_start_lsn").expect("lsn");
        let lsns = lsns.as_any().downcast_ref::<StringArray>().expect("utf8");
        let seqvals = batch.column_by_name("_seqval").expect("seqval");
        let seqvals = seqvals
            .as_any()
            .downcast_ref::<StringArray>()
            .expect("utf8");
        let commands = batch.column_by_name("_command_id").expect("command id");
        let commands = commands.as_any().downcast_ref::<Int32Array>().expect("int");
        let operations = batch.column_by_name("_operation").expect("operation");
        let operations = operations
            .as_any()
            .downcast_ref::<Int32Array>()
            .expect("int");
        for (row, key) in keys(batch).into_iter().enumerate() {
            changes.push((
                lsns.value(row).to_string(),
                commands.value(row),
                seqvals.value(row).to_string(),
                operations.value(row),
                key,
                captured_values(batch, row),
            ));
        }
    }
    changes.sort();
    for (_, _, _, operation, key, values) in changes {
        match operation {
            1 | 3 => {
                rows.remove(&key);
            }
            _ => {
                rows.insert(key, values);
            }
        }
    }
}

async fn changes_after(client: &CdcClient, from: Lsn) -> Vec<RecordBatch> {
    let mut command = ChangesCommand::new(TABLE, from, None);
    command.partitions = Some(2);
    let plan = client.plan_changes(&command).await.expect("plan");
    let mut batches = Vec::new();
    for endpoint in &plan.info.endpoint {
        let (read, _) = client
            .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
            .await
            .expect("read");
        batches.extend(read);
    }
    batches
}

/// One snapshot row: its key, values, `_start_lsn`, `_operation` and `_chunk`.
type SnapshotRow = (i64, Vec<String>, String, i32, Option<i32>);

/// Every snapshot row of a read and the completion markers of its streams.
struct SnapshotRows {
    rows: Vec<SnapshotRow>,
    completions: Vec<Completion>,
}

async fn read_snapshot(client: &CdcClient, command: &SnapshotCommand) -> SnapshotRows {
    let plan = client.plan_snapshot(command).await.expect("plan snapshot");
    let mut out = SnapshotRows {
        rows: Vec::new(),
        completions: Vec::new(),
    };
    for endpoint in &plan.info.endpoint {
        let (batches, completion) = client
            .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
            .await
            .expect("snapshot read");
        for batch in &batches {
            let lsns = batch.column_by_name("_start_lsn").expect("lsn");
            let lsns = lsns.as_any().downcast_ref::<StringArray>().expect("utf8");
            let operations = batch.column_by_name("_operation").expect("op");
            let operations = operations
                .as_any()
                .downcast_ref::<Int32Array>()
                .expect("int");
            let chunks = batch.column_by_name("_chunk").expect("_chunk");
            let chunks = chunks.as_any().downcast_ref::<Int32Array>().expect("int");
            assert_eq!(
                batch
                    .column_by_name("_seqval")
                    .expect("seqval")
                    .null_count(),
                batch.num_rows()
            );
            for (row, key) in keys(batch).into_iter().enumerate() {
                out.rows.push((
                    key,
                    captured_values(batch, row),
                    lsns.value(row).to_string(),
                    operations.value(row),
                    chunks.is_valid(row).then(|| chunks.value(row)),
                ));
            }
        }
        out.completions.push(completion);
    }
    out
}

/// The table's current rows, rebuilt from every change it ever had.
async fn current(client: &CdcClient) -> Rows {
    let earliest: mssql_cdc_flight::Offset = client
        .action(
            "initial_offset",
            &json!({"table": TABLE, "starting": "earliest"}),
        )
        .await
        .expect("earliest");
    let mut rows = Rows::new();
    replay(&mut rows, &changes_after(client, earliest.lsn).await);
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_in_partitions_is_the_current_table_stamped_before_its_read() {
    let (_sim, flight) = loaded(5, 300).await;
    let client = &flight.client;
    let expected = current(client).await;
    let mut command = SnapshotCommand::new(TABLE);
    command.partitions = Some(3);
    let plan = client.plan_snapshot(&command).await.expect("plan");
    assert_eq!(plan.info.endpoint.len(), 3, "three partitions");
    let snapshot = read_snapshot(client, &command).await;
    let stamp = snapshot.completions[0].snapshot_lsn.expect("stamp");
    let mut seen = Rows::new();
    for (key, values, lsn, operation, chunk) in snapshot.rows {
        assert_eq!((operation, chunk), (0, None));
        assert_eq!(lsn, stamp.to_string(), "every row carries the stamp");
        assert!(seen.insert(key, values).is_none(), "key {key} read twice");
    }
    assert_eq!(seen, expected, "the snapshot is the table's current rows");
    let max_lsn: serde_json::Value = client.action("max_lsn", &json!({})).await.expect("max");
    assert_eq!(
        max_lsn["lsn"],
        json!(stamp.to_string()),
        "stamped at max_lsn"
    );
}

/// Counts key slices through the `key_buckets` action.
struct FlightCounter<'a>(&'a CdcClient);

#[async_trait::async_trait]
impl BucketCounter for FlightCounter<'_> {
    async fn buckets(&self, grid: KeyGrid) -> mssql_cdc_flight::Result<Vec<KeyBucket>> {
        Ok(self
            .0
            .action("key_buckets", &KeyBucketsBody::new(TABLE, grid))
            .await
            .expect("key_buckets"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_planned_from_counted_slices_tile_the_table() {
    let (_sim, flight) = loaded(5, 400).await;
    let client = &flight.client;
    let expected = current(client).await;
    let extent: KeyExtent = client
        .action("key_extent", &json!({"table": TABLE}))
        .await
        .expect("extent");
    assert_eq!(extent.column, KEY);
    assert_eq!(extent.rows, expected.len() as u64);
    assert_eq!(extent.min, expected.keys().next().copied());
    let chunks = chunking::plan(&FlightCounter(client), extent.min.zip(extent.max), 50)
        .await
        .expect("plan chunks");
    assert!(chunks.len() > 3, "{} chunks", chunks.len());
    let mut command = SnapshotCommand::new(TABLE);
    command.chunks = Some(
        chunks
            .iter()
            .enumerate()
            .map(|(index, (range, _))| ChunkSpec {
                chunk: index as i32,
                lo: range.lo.map(Bound::Int),
                hi: range.hi.map(Bound::Int),
            })
            .collect(),
    );
    let snapshot = read_snapshot(client, &command).await;
    assert_eq!(
        snapshot.completions.len(),
        chunks.len(),
        "one stream per chunk"
    );
    let mut seen = Rows::new();
    let mut per_chunk = vec![0u64; chunks.len()];
    for (key, values, _, operation, chunk) in snapshot.rows {
        let chunk = chunk.expect("chunk rows carry _chunk") as usize;
        assert_eq!(operation, 0);
        assert!(
            chunks[chunk].0.contains(key),
            "key {key} outside chunk {chunk}"
        );
        per_chunk[chunk] += 1;
        assert!(seen.insert(key, values).is_none(), "key {key} read twice");
    }
    assert_eq!(seen, expected, "the chunks tile the table");
    let planned: Vec<u64> = chunks.iter().map(|(_, rows)| *rows).collect();
    assert_eq!(
        per_chunk, planned,
        "the counts the plan used are the rows read"
    );
    assert!(planned.iter().all(|rows| *rows <= 50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_between_the_stamp_and_the_read_only_replays_in_the_rebuild() {
    let (sim, flight) = loaded(5, 200).await;
    let client = &flight.client;
    let orders = "dbo.orders".parse().expect("table");
    let writer = Arc::new(Mutex::new(Some(sim.writer(77))));
    let landed: Arc<Mutex<Option<Lsn>>> = Arc::new(Mutex::new(None));
    let (hook_writer, hook_landed) = (Arc::clone(&writer), Arc::clone(&landed));
    sim.db.set_faults(Faults {
        before_snapshot_read: Some(SnapshotHook(Arc::new(move || {
            let Some(mut writer) = hook_writer.lock().expect("lock").take() else {
                return;
            };
            let mut tx = writer.begin();
            tx.insert(&orders, 3).expect("insert");
            let keys = tx.random_keys(&orders, 2).expect("keys");
            tx.update(&orders, &keys).expect("update");
            let lsn = tx.commit().expect("commit").expect("lsn");
            writer.publish().expect("publish");
            *hook_landed.lock().expect("lock") = Some(lsn);
        }))),
        ..Faults::default()
    });
    let snapshot = read_snapshot(client, &SnapshotCommand::new(TABLE)).await;
    sim.db.set_faults(Faults::default());
    let stamp = snapshot.completions[0].snapshot_lsn.expect("stamp");
    let commit = landed.lock().expect("lock").expect("the hook committed");
    assert!(commit > stamp, "the commit landed after the stamp");
    assert_eq!(
        snapshot.completions[0].max_lsn,
        Some(commit),
        "max_lsn after the read"
    );
    // The read saw the commit: the snapshot already equals the table after it.
    let after = current(client).await;
    let mut rebuilt: Rows = snapshot
        .rows
        .iter()
        .map(|(key, values, ..)| (*key, values.clone()))
        .collect();
    assert_eq!(rebuilt, after, "the read saw the commit after its stamp");
    // The rebuild rule (rows of S plus the changes after S) replays it to the same state.
    replay(&mut rebuilt, &changes_after(client, stamp).await);
    assert_eq!(rebuilt, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_snapshot_commands_are_refused() {
    let (_sim, flight) = loaded(5, 20).await;
    let client = &flight.client;
    let mut empty_chunk = SnapshotCommand::new(TABLE);
    empty_chunk.chunks = Some(vec![ChunkSpec {
        chunk: 0,
        lo: Some(Bound::Int(10)),
        hi: Some(Bound::Int(10)),
    }]);
    let error = client
        .plan_snapshot(&empty_chunk)
        .await
        .expect_err("empty chunk");
    assert!(error.to_string().contains("chunk 0 is empty"), "{error}");
    let mut no_chunks = SnapshotCommand::new(TABLE);
    no_chunks.chunks = Some(Vec::new());
    assert!(client.plan_snapshot(&no_chunks).await.is_err());
    let unknown = client
        .plan_snapshot(&SnapshotCommand::new("dbo.missing"))
        .await
        .expect_err("unknown table");
    assert_eq!(unknown.code(), Some(tonic::Code::NotFound));
    let error = client
        .action::<serde_json::Value>(
            "key_buckets",
            &json!({"table": TABLE, "lo": 0, "hi": 10, "width": 0}),
        )
        .await
        .expect_err("width 0");
    assert_eq!(error.code(), Some(tonic::Code::InvalidArgument));

    // Keyset commands: unknown and uncuttable columns named, bounds of the wrong shape.
    let customers = "dbo.customers";
    let refused = |keys: serde_json::Value| async move {
        client
            .action::<serde_json::Value>("key_max", &json!({"table": customers, "keys": keys}))
            .await
    };
    let unknown = refused(json!(["nope"])).await.expect_err("unknown column");
    assert!(unknown.to_string().contains("'nope'"), "{unknown}");
    let bit = refused(json!(["is_active"])).await.expect_err("bit");
    assert!(bit.to_string().contains("bit has no MIN or MAX"), "{bit}");
    let twice = refused(json!(["name", "name"])).await.expect_err("twice");
    assert!(twice.to_string().contains("twice"), "{twice}");
    let mut short = SnapshotCommand::new(customers);
    short.keys = Some(vec!["name".into(), "customer_id".into()]);
    short.chunks = Some(vec![ChunkSpec {
        chunk: 3,
        lo: Some(Bound::Keys(vec![KeyValue::Text("a".into())])),
        hi: None,
    }]);
    let error = client
        .plan_snapshot(&short)
        .await
        .expect_err("one value short");
    assert!(error.to_string().contains("chunk 3"), "{error}");
    let error = client
        .action::<serde_json::Value>(
            "key_bound",
            &json!({"table": customers, "keys": ["customer_id"], "from": ["7"], "n": 1}),
        )
        .await
        .expect_err("text for an int column");
    assert_eq!(error.code(), Some(tonic::Code::InvalidArgument));
}

/// The simulated database, seen as a table whose unique index is no single integer column
/// (a composite or text key on SQL Server): `key_extent` refuses, everything else answers.
struct KeylessSource(mssql_cdc_flight::sim::SimDb);

#[async_trait::async_trait]
impl mssql_cdc_flight::source::CdcSource for KeylessSource {
    fn describe(&self) -> String {
        "keyless view of the simulated database".into()
    }
    async fn tracked_tables(
        &self,
    ) -> mssql_cdc_flight::Result<Vec<mssql_cdc_flight::source::TrackedTable>> {
        self.0.tracked_tables().await
    }
    async fn max_lsn(&self) -> mssql_cdc_flight::Result<Option<Lsn>> {
        self.0.max_lsn().await
    }
    async fn min_lsn(&self, capture_instance: &str) -> mssql_cdc_flight::Result<Lsn> {
        self.0.min_lsn(capture_instance).await
    }
    async fn lsn_to_time(
        &self,
        lsn: Lsn,
    ) -> mssql_cdc_flight::Result<Option<mssql_cdc_flight::CommitTime>> {
        self.0.lsn_to_time(lsn).await
    }
    async fn commit_at_or_before(
        &self,
        time: mssql_cdc_flight::CommitTime,
    ) -> mssql_cdc_flight::Result<Option<Lsn>> {
        self.0.commit_at_or_before(time).await
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> mssql_cdc_flight::Result<Option<Lsn>> {
        self.0.nth_commit_after(lsn, n).await
    }
    async fn ddl_history(
        &self,
        range: InstanceRange<'_>,
    ) -> mssql_cdc_flight::Result<Vec<mssql_cdc_flight::source::DdlEntry>> {
        self.0.ddl_history(range).await
    }
    async fn split_points(
        &self,
        range: InstanceRange<'_>,
        tiles: NonZeroU32,
    ) -> mssql_cdc_flight::Result<Vec<mssql_cdc_flight::source::Tile>> {
        self.0.split_points(range, tiles).await
    }
    async fn read_changes(
        &self,
        read: mssql_cdc_flight::source::ChangeRead,
    ) -> mssql_cdc_flight::Result<mssql_cdc_flight::source::BatchStream> {
        self.0.read_changes(read).await
    }
    async fn key_extent(
        &self,
        table: &mssql_cdc_flight::source::TableName,
    ) -> mssql_cdc_flight::Result<KeyExtent> {
        Err(mssql_cdc_flight::Error::invalid(format!(
            "{table}: snapshots are cut on one integer key column; the unique index is (a, b)"
        )))
    }
    async fn table_rows(
        &self,
        table: &mssql_cdc_flight::source::TableName,
    ) -> mssql_cdc_flight::Result<u64> {
        self.0.table_rows(table).await
    }
    async fn key_buckets(
        &self,
        table: &mssql_cdc_flight::source::TableName,
        _grid: KeyGrid,
    ) -> mssql_cdc_flight::Result<Vec<KeyBucket>> {
        Err(mssql_cdc_flight::Error::invalid(format!(
            "{table} has no integer key"
        )))
    }
    async fn key_span(
        &self,
        table: &mssql_cdc_flight::source::TableName,
        key: &KeyColumn,
    ) -> mssql_cdc_flight::Result<Option<(i64, i64)>> {
        self.0.key_span(table, key).await
    }
    async fn key_sums(
        &self,
        table: &mssql_cdc_flight::source::TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[mssql_cdc_flight::types::OutputColumn],
    ) -> mssql_cdc_flight::Result<mssql_cdc_flight::source::KeySums> {
        self.0.key_sums(table, key, grid, values).await
    }
    async fn key_max(
        &self,
        table: &mssql_cdc_flight::source::TableName,
        keys: &[KeyColumn],
    ) -> mssql_cdc_flight::Result<Option<KeyTuple>> {
        self.0.key_max(table, keys).await
    }
    async fn key_bound(
        &self,
        table: &mssql_cdc_flight::source::TableName,
        seek: &KeysetSeek,
    ) -> mssql_cdc_flight::Result<Option<KeyTuple>> {
        self.0.key_bound(table, seek).await
    }
    async fn read_snapshot(
        &self,
        read: mssql_cdc_flight::source::SnapshotRead,
    ) -> mssql_cdc_flight::Result<mssql_cdc_flight::source::BatchStream> {
        self.0.read_snapshot(read).await
    }
}

/// Without an integer key, a full snapshot of one partition is read whole in one stream, and
/// one of `partitions` is cut on keyset bounds of the unique index the source seeks (as the
/// seed cuts a composite or text key); chunks still need keyset bounds from the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_an_integer_key_is_cut_on_keyset_bounds_of_its_index() {
    let (sim, flight) = loaded(5, 120).await;
    let expected = current(&flight.client).await;
    let keyless = FlightFixture::start(Arc::new(KeylessSource(sim.db.clone()))).await;
    let client = &keyless.client;
    let plan = client
        .plan_snapshot(&SnapshotCommand::new(TABLE))
        .await
        .expect("a whole read needs no key");
    assert_eq!(plan.info.endpoint.len(), 1);
    assert_eq!(plan.metadata.key, "", "no key to report");
    assert_eq!(plan.info.total_records, -1, "row count unknown");
    let read = read_snapshot(client, &SnapshotCommand::new(TABLE)).await;
    let rows: Rows = read
        .rows
        .iter()
        .map(|(key, values, ..)| (*key, values.clone()))
        .collect();
    assert_eq!(rows, expected, "the whole table, once");
    let mut partitioned = SnapshotCommand::new(TABLE);
    partitioned.partitions = Some(4);
    let plan = client
        .plan_snapshot(&partitioned)
        .await
        .expect("cut on the unique index");
    assert_eq!(plan.info.endpoint.len(), 4, "four keyset ranges");
    assert_eq!(
        plan.metadata.key, "order_id",
        "the index the ranges are cut on"
    );
    let read = read_snapshot(client, &partitioned).await;
    let mut keys: Vec<i64> = read.rows.iter().map(|(key, ..)| *key).collect();
    let every: Vec<i64> = expected.keys().copied().collect();
    assert_eq!(keys.len(), every.len(), "every row once, none twice");
    keys.sort_unstable();
    assert_eq!(keys, every, "the four ranges tile the table");
    let rows: Rows = read
        .rows
        .iter()
        .map(|(key, values, ..)| (*key, values.clone()))
        .collect();
    assert_eq!(rows, expected);
    // About equal: each range holds about a quarter of the rows (its completion's count).
    let counts: Vec<usize> = read.completions.iter().map(|c| c.rows as usize).collect();
    assert_eq!(counts.len(), 4, "one completion per range");
    let quarter = every.len().div_ceil(4);
    assert!(
        counts[..3].iter().all(|count| *count == quarter),
        "{counts:?} of {}",
        every.len()
    );
    let mut chunked = SnapshotCommand::new(TABLE);
    chunked.chunks = Some(vec![ChunkSpec {
        chunk: 1,
        lo: None,
        hi: Some(Bound::Int(10)),
    }]);
    let error = client
        .plan_snapshot(&chunked)
        .await
        .expect_err("chunks need a key");
    assert!(error.to_string().contains("one integer key"), "{error}");
    keyless.shutdown_and_wait().await;
}

/// `ALTER TABLE ... ADD <column> NULL` gives every existing row NULL there (Microsoft's
/// ALTER TABLE docs, "Adding NULL columns"); rows inserted or updated afterwards have values.
/// A snapshot of the table (through a capture instance that captures the column) reads so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_added_later_reads_null_in_the_rows_no_write_touched_since() {
    let (sim, flight) = loaded(9, 120).await;
    let orders: mssql_cdc_flight::source::TableName = TABLE.parse().expect("table");
    let mut writer = sim.writer(10);
    writer
        .add_column(&orders, "discount", "decimal(9,2)", true)
        .expect("ddl");
    let columns = sim.db.columns_of(&orders).expect("columns");
    writer
        .enable_capture_instance(&orders, "dbo_orders_v2", &columns)
        .expect("switch");
    let before: Vec<i64> = {
        let mut keys = writer.begin().random_keys(&orders, 4).expect("keys");
        keys.sort();
        keys
    };
    let (updated, untouched) = before.split_at(2);
    let mut tx = writer.begin();
    tx.update(&orders, updated).expect("update");
    let inserted = tx.insert(&orders, 30).expect("insert");
    tx.commit().expect("commit");
    writer.publish().expect("publish");
    drop(writer);
    let snapshot = read_snapshot(&flight.client, &SnapshotCommand::new(TABLE)).await;
    let discount = |key: i64| {
        let (_, values, ..) = snapshot
            .rows
            .iter()
            .find(|row| row.0 == key)
            .expect("key in the snapshot");
        values.last().cloned().expect("the added column is last")
    };
    for key in untouched {
        assert_eq!(
            discount(*key),
            "",
            "row {key}, untouched since the ADD, reads NULL"
        );
    }
    // A nullable column is NULL in one generated row of eight: most rows written since the
    // ADD have a value.
    let written: Vec<i64> = updated.iter().chain(&inserted).copied().collect();
    let valued = written
        .iter()
        .filter(|key| !discount(**key).is_empty())
        .count();
    assert!(
        valued * 2 > written.len(),
        "{valued} of the {} rows written since the ADD have a value",
        written.len()
    );
}

/// A full snapshot in keyset partitions on the keys the simulator's odd tables have: the
/// composite index of `dbo.accounts` (a repeated leading column), and `snapshot_keys` on the
/// heap `dbo.events` (repeated, case-mixed, sometimes NULL values: not unique). Each plan's
/// ranges hold every row once, whatever the keys; a heap without keys is read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyset_partitions_tile_composite_and_repeating_keys() {
    use mssql_cdc_flight::sim::sample;
    use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
    let sim = common::SimFixture::with_tables(&[sample::accounts(), sample::events()]);
    let mut writer = sim.writer(23);
    let spec = WorkloadSpec {
        commits: Some(300),
        max_rows_per_statement: 6,
        ..WorkloadSpec::default()
    };
    workload::run(
        &mut writer,
        &spec,
        &std::sync::atomic::AtomicBool::new(false),
    )
    .expect("workload");
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let client = &flight.client;
    // The ids every endpoint of a plan of `command` reads, and how many endpoints.
    let ids_of = |command: SnapshotCommand| async move {
        let plan = client.plan_snapshot(&command).await.expect("plan");
        let mut ids = Vec::new();
        for endpoint in &plan.info.endpoint {
            let (batches, _) = client
                .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
                .await
                .expect("a range");
            for batch in &batches {
                let column = batch.column_by_name("id").expect("id");
                let id = arrow::compute::cast(column, &arrow::datatypes::DataType::Int64)
                    .expect("an integer id");
                let id = id.as_any().downcast_ref::<Int64Array>().expect("int64");
                ids.extend(id.values().iter().copied());
            }
        }
        (plan.info.endpoint.len(), ids)
    };
    for (table, keys) in [
        ("dbo.accounts", None),
        (
            "dbo.events",
            Some(vec!["source".to_string(), "kind".to_string()]),
        ),
    ] {
        let mut whole = SnapshotCommand::new(table);
        whole.keys = keys.clone();
        let (one, mut expected) = ids_of(whole.clone()).await;
        assert_eq!(one, 1, "{table}: one partition, one stream");
        expected.sort_unstable();
        assert!(expected.len() > 20, "{table}: {} rows", expected.len());
        let mut partitioned = whole;
        partitioned.partitions = Some(5);
        let (ranges, mut ids) = ids_of(partitioned).await;
        assert!((2..=5).contains(&ranges), "{table}: {ranges} ranges");
        ids.sort_unstable();
        assert_eq!(ids, expected, "{table}: every row once");
    }
    let mut heap = SnapshotCommand::new("dbo.events");
    heap.partitions = Some(5);
    let (ranges, _) = ids_of(heap).await;
    assert_eq!(ranges, 1, "a heap without keys: one stream");
    flight.shutdown_and_wait().await;
}
