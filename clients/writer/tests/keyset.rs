//! Chunked snapshots cut on keyset bounds, against the in-process server and real Delta
//! tables: a composite unique index whose leading column repeats in mixed case (compared
//! case-insensitively by the simulated database, as SQL Server's default collation does), a
//! heap cut on a repeated column with NULLs (`snapshot_keys`), and an integer column that
//! grows at the top, whose last chunk ends at the first key after MAX sought before its wave.
//! End state every time: bronze's rows of S plus the changes after S rebuild the table.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{Lab, captured, query, run_now, text};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::{Faults, sample};
use mssql_cdc_flight::source::TableName;
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};

type Rows = BTreeMap<i64, Vec<String>>;

fn options(chunk_rows: u64, max_waves: Option<u32>) -> BackfillOptions {
    BackfillOptions {
        chunk_rows,
        max_waves,
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    }
}

fn row_id(batch: &arrow::record_batch::RecordBatch, row: usize) -> i64 {
    common::integer_at(batch, "id", row)
}

/// The table now, read whole through the server, by its row id.
async fn source_rows(lab: &Lab, table: &str) -> Rows {
    common::source_rows_of(lab, table, "id", &common::ColumnSelection::All).await
}

/// ADR 0028's rebuild by row id (see `common::rebuild`).
async fn rebuild(bronze: &str, snapshot: Lsn) -> Rows {
    common::rebuild(bronze, snapshot, "id").await
}

/// `(id, _chunk, cut column as text)` of every snapshot row of S in bronze.
async fn snapshot_rows(
    bronze: &str,
    snapshot: Lsn,
    column: &str,
) -> Vec<(i64, i32, Option<String>)> {
    let batches = query(
        bronze,
        &format!(
            "SELECT id, _chunk, CAST(\"{column}\" AS VARCHAR) AS cut FROM t WHERE _operation = 0 \
             AND _snapshot = '{snapshot}'"
        ),
    )
    .await;
    let mut rows = Vec::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            rows.push((
                text(batch, 0, row).expect("id").parse().expect("id"),
                text(batch, 1, row).expect("chunk").parse().expect("chunk"),
                text(batch, 2, row),
            ));
        }
    }
    rows
}

/// Plans rows of one event, as JSON.
/// What this writer reads of a plans row: nested under `extent` (open) and `planned` (plan,
/// chunk) beside the seed's keys (the writer's `snapshot::seed_layout`).
fn ours(row: serde_json::Value) -> serde_json::Value {
    if let Some(extent) = row.get("extent").filter(|extent| extent.is_object()) {
        return extent.clone();
    }
    match row.get("planned").cloned() {
        Some(serde_json::Value::Array(chunks)) => serde_json::json!({"chunks": chunks}),
        Some(mut chunk @ serde_json::Value::Object(_)) => {
            chunk["wave"] = row["wave"].clone();
            chunk
        }
        _ => row,
    }
}

/// Our part ([`ours`]) of every plans row of `event`.
async fn plans_rows(bronze: &str, event: &str) -> Vec<serde_json::Value> {
    let batches = query(
        &snapshot::plans_location(bronze),
        &format!("SELECT detail FROM t WHERE event = '{event}'"),
    )
    .await;
    let mut rows = Vec::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            let detail = serde_json::from_str(&text(batch, 0, row).expect("detail"));
            rows.push(ours(detail.expect("json")));
        }
    }
    rows
}

fn no_row_twice(rows: &[(i64, i32, Option<String>)]) {
    let ids: BTreeSet<i64> = rows.iter().map(|(id, ..)| *id).collect();
    assert_eq!(ids.len(), rows.len(), "a row read by two chunks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_composite_case_insensitive_key_is_chunked_on_keyset_bounds_next_to_the_stream() {
    let lab = Lab::with_tables(&[sample::accounts()]).await;
    lab.workload(61, 300);
    let mut config = lab.stream_of("dbo.accounts", "accounts");
    let bronze = config.target.clone();
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    let open = plans_rows(&bronze, "snapshot_open").await;
    assert_eq!(open[0]["kind"], "keyset", "{}", open[0]);
    assert_eq!(open[0]["unique"], true);
    assert_eq!(open[0]["keys"][0]["name"], "region");
    assert_eq!(open[0]["keys"][1]["name"], "code");
    lab.workload(62, 40);
    run_now(config.clone()).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let first = snapshots
        .backfill(&options(40, Some(1)))
        .await
        .expect("wave 1");
    let total = first.chunks_total.expect("planned");
    assert!(total > 4, "{total} chunks");
    let plan = &plans_rows(&bronze, "snapshot_plan").await[0]["chunks"];
    assert!(plan[1]["lo"].is_array(), "keyset bounds: {}", plan[1]);

    // Changes between waves, and a commit between a chunk's stamp and its read.
    lab.workload(63, 60);
    let writer = common::commit_during_next_snapshot_read(&lab, "dbo.accounts", 64);
    snapshots
        .backfill(&options(40, Some(1)))
        .await
        .expect("wave 2");
    lab.db.set_faults(Faults::default());
    assert!(writer.lock().expect("lock").is_none(), "the hook ran");
    lab.workload(65, 60);
    let done = snapshots.backfill(&options(40, None)).await.expect("rest");
    assert!(done.done && done.chunks_done == total, "{done:?}");
    run_now(config.clone()).await;

    no_row_twice(&snapshot_rows(&bronze, snapshot, "region").await);
    assert_eq!(
        rebuild(&bronze, snapshot).await,
        source_rows(&lab, "dbo.accounts").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_is_chunked_on_a_repeated_column_with_nulls_each_value_in_one_chunk() {
    let lab = Lab::with_tables(&[sample::events()]).await;
    lab.workload(71, 250);
    let mut config = lab.stream_of("dbo.events", "events");
    let bronze = config.target.clone();

    // Refused before anything is recorded: a heap without snapshot_keys, and a bit column.
    let refused = snapshot::bootstrap(&mut config.clone(), SnapshotMode::Chunked)
        .await
        .expect_err("no unique index");
    assert!(refused.to_string().contains("snapshot_keys"), "{refused}");
    let mut bit = config.clone();
    bit.snapshot_keys = Some(vec!["flag".into()]);
    let refused = snapshot::bootstrap(&mut bit, SnapshotMode::Chunked)
        .await
        .expect_err("bit");
    assert!(refused.to_string().contains("'flag'"), "{refused}");
    let plans_url =
        mssql_cdc_writer::tables::table_url(&snapshot::plans_location(&bronze)).expect("url");
    assert!(
        mssql_cdc_writer::tables::open(&plans_url)
            .await
            .expect("open")
            .is_none(),
        "nothing recorded by a refused open"
    );

    config.snapshot_keys = Some(vec!["source".into()]);
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    lab.workload(72, 40);
    run_now(config.clone()).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    // Chunks of 15 rows: the value holding half the rows is a chunk of its own (the seek
    // doubles past it), and the others are packed by value.
    let first = snapshots
        .backfill(&options(15, Some(1)))
        .await
        .expect("wave 1");
    let total = first.chunks_total.expect("planned");
    assert!(total >= 4, "{total} chunks");

    // A backfill configured without the open's columns is refused: plans never move.
    let mut dropped = config.clone();
    dropped.snapshot_keys = None;
    let refused = Snapshots::connect(dropped)
        .await
        .expect("connect")
        .backfill(&options(15, None))
        .await
        .expect_err("keys dropped");
    assert!(refused.to_string().contains("source"), "{refused}");

    lab.workload(73, 50);
    let done = snapshots.backfill(&options(15, None)).await.expect("rest");
    assert!(done.done && done.chunks_done == total, "{done:?}");
    run_now(config.clone()).await;

    let rows = snapshot_rows(&bronze, snapshot, "source").await;
    no_row_twice(&rows);
    // Each value (case and trailing spaces folded, as the collation compares) in one chunk,
    // the NULLs in the first.
    let mut chunks_of: BTreeMap<Option<String>, BTreeSet<i32>> = BTreeMap::new();
    for (_, chunk, value) in &rows {
        let folded = value.as_ref().map(|v| v.trim_end().to_lowercase());
        chunks_of.entry(folded).or_default().insert(*chunk);
    }
    assert!(chunks_of.contains_key(&None), "the heap has NULLs");
    assert_eq!(chunks_of[&None], BTreeSet::from([0]), "NULLs sort first");
    for (value, chunks) in &chunks_of {
        assert_eq!(chunks.len(), 1, "{value:?} is in chunks {chunks:?}");
    }
    let spellings: BTreeSet<&str> = rows
        .iter()
        .filter_map(|(_, _, value)| value.as_deref())
        .filter(|value| value.trim_end().eq_ignore_ascii_case("north"))
        .collect();
    assert!(
        spellings.len() > 1,
        "mixed case in one value: {spellings:?}"
    );
    assert_eq!(
        rebuild(&bronze, snapshot).await,
        source_rows(&lab, "dbo.events").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_keyset_chunk_ends_at_the_first_key_after_max_sought_before_its_wave() {
    let lab = Lab::with_tables(&[sample::events()]).await;
    lab.workload(81, 200);
    let mut config = lab.stream_of("dbo.events", "events_by_id");
    config.snapshot_keys = Some(vec!["id".into()]);
    let bronze = config.target.clone();
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    let max = plans_rows(&bronze, "snapshot_open").await[0]["max"][0]
        .as_i64()
        .expect("an integer MAX");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let first = snapshots
        .backfill(&options(30, Some(1)))
        .await
        .expect("wave 1");
    let total = first.chunks_total.expect("planned");
    let plan = &plans_rows(&bronze, "snapshot_plan").await[0]["chunks"];
    let last = &plan[plan.as_array().expect("chunks").len() - 1];
    assert!(last["hi"].is_null(), "no key after MAX at planning: {last}");

    // The stream inserts above MAX while the snapshot is read.
    lab.workload(82, 80);
    run_now(config.clone()).await;
    let done = snapshots.backfill(&options(30, None)).await.expect("rest");
    assert!(done.done && done.chunks_done == total, "{done:?}");
    let recorded_last = plans_rows(&bronze, "snapshot_chunk")
        .await
        .into_iter()
        .find(|chunk| chunk["chunk"].as_u64() == Some(total - 1))
        .expect("last chunk recorded");
    let hi = recorded_last["hi"][0]
        .as_i64()
        .expect("closed at the first key after MAX");
    assert!(hi > max, "{hi} after MAX {max}");
    let rows = snapshot_rows(&bronze, snapshot, "id").await;
    no_row_twice(&rows);
    assert!(
        rows.iter().all(|(id, ..)| *id < hi),
        "rows inserted above the last bound are left to the stream"
    );
    run_now(config.clone()).await;
    assert_eq!(
        rebuild(&bronze, snapshot).await,
        source_rows(&lab, "dbo.events").await
    );
}

/// A date-time as the simulator writes keyset bounds, or as Arrow formats a value.
fn instant(text: &str) -> chrono::NaiveDateTime {
    chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f").expect("a date-time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_resnapshot_wave_on_a_datetime2_key_deletes_the_keys_its_chunks_lack() {
    let lab = Lab::with_tables(&[sample::readings()]).await;
    lab.workload(91, 150);
    let mut config = lab.stream_of("dbo.readings", "readings");
    let bronze = config.target.clone();
    let apply = ApplyConfig {
        table: "dbo.readings".into(),
        bronze: bronze.clone(),
        target: lab.lake("silver_readings"),
        capture_instance: None,
        keys: vec!["taken_at".into()],
        control: lab.lake("control"),
        facts: Some(lab.lake("facts")),
        granularity: Granularity::Minute,
        deletion_vectors: false,
    };
    let silver = || async {
        let mut rows = Rows::new();
        for batch in query(&apply.target, "SELECT * FROM t").await {
            for row in 0..batch.num_rows() {
                rows.insert(row_id(&batch, row), captured(&batch, row));
            }
        }
        rows
    };
    snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let whole = options(20, None);
    assert!(snapshots.backfill(&whole).await.expect("bootstrap").done);
    run_now(config.clone()).await;
    apply_changes(&apply).await.expect("apply");
    assert_eq!(silver().await, source_rows(&lab, "dbo.readings").await);

    // Rows deleted while no stream runs (as in a purged gap), then a re-snapshot.
    let before = source_rows(&lab, "dbo.readings").await;
    let readings: TableName = "dbo.readings".parse().expect("table");
    let mut writer = lab.writer(92);
    let mut transaction = writer.begin();
    let deleted = transaction.random_keys(&readings, 30).expect("keys");
    transaction.delete(&readings, &deleted).expect("delete");
    transaction.commit().expect("commit");
    writer.publish().expect("publish");
    drop(writer);
    let resnapshot = snapshots.open_resnapshot().await.expect("re-snapshot");
    let status = snapshots
        .backfill(&options(20, Some(1)))
        .await
        .expect("wave 1");
    assert!(!status.done, "{status:?}");
    assert!(!apply_changes(&apply).await.expect("apply").rebuilt);

    // The ranges wave 1 read, as the source wrote their bounds.
    let ranges: Vec<(Option<String>, Option<String>)> = query(
        &snapshot::plans_location(&bronze),
        &format!(
            "SELECT detail FROM t WHERE event = 'snapshot_chunk' AND snapshot = '{resnapshot}'"
        ),
    )
    .await
    .iter()
    .flat_map(|batch| {
        (0..batch.num_rows()).map(|row| {
            serde_json::from_str::<serde_json::Value>(&text(batch, 0, row).expect("detail"))
                .expect("json")
        })
    })
    .filter(|chunk| chunk["wave"] == 1)
    .map(|chunk| {
        // The seed's bound of one key column: the value itself.
        let bound = |value: &serde_json::Value| value.as_str().map(str::to_string);
        (bound(&chunk["lo"]), bound(&chunk["hi"]))
    })
    .collect();
    assert!(!ranges.is_empty());
    let taken_at = |id: &i64| instant(&before[id][1]);
    let read = |id: &i64| {
        ranges.iter().any(|(lo, hi)| {
            lo.as_deref().is_none_or(|lo| taken_at(id) >= instant(lo))
                && hi.as_deref().is_none_or(|hi| taken_at(id) < instant(hi))
        })
    };
    let now = silver().await;
    let (inside, outside): (Vec<i64>, Vec<i64>) = deleted.iter().partition(|id| read(id));
    assert!(
        !inside.is_empty(),
        "some deleted keys lie in wave 1's chunks"
    );
    assert!(
        !outside.is_empty(),
        "some deleted keys wait for later waves"
    );
    for id in &inside {
        assert!(!now.contains_key(id), "row {id} deleted by wave 1");
    }
    for id in &outside {
        assert!(now.contains_key(id), "row {id} waits for its own wave");
    }
    assert!(snapshots.backfill(&whole).await.expect("rest").done);
    assert!(apply_changes(&apply).await.expect("apply").rebuilt);
    assert_eq!(silver().await, source_rows(&lab, "dbo.readings").await);
}
