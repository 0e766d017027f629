//! The `CdcSource` conformance suite: what every implementation must answer alike.
//!
//! The checks only read, so they hold for any database with CDC data: here the simulated one
//! after a mixed workload (with a second capture instance, DDL, idle entries and a cleanup).
//! The SQL Server source runs the same `conformance` function against a real server wherever
//! `MSSQL_CDC_TEST_URL` is set (docs/sqlserver.md: a SQL Server 2022 with the Agent, the
//! sample database of `sql/00_setup.sql` and its workload); without it that test is listed
//! as ignored, with the reason (`build.rs`).

mod common;

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arrow::array::{Array, Decimal128Array, Int32Array, StringArray, TimestampMicrosecondArray};
use common::SimFixture;
use futures::StreamExt;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::keys::{KeyColumn, KeySeek, KeyTuple, KeysetRange, KeysetSeek};
use mssql_cdc_flight::offset::CommitTime;
use mssql_cdc_flight::sim::Clock;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::zone::{OffsetChange, SimZone};
use mssql_cdc_flight::source::{
    BatchBytes, CdcSource, ChangeRead, InstanceRange, KeyGrid, KeyRange, KeySums, SnapshotPiece,
    SnapshotRead, TrackedTable,
};

/// What a source models as SQL Server does, where a simulator of other people's differs.
#[derive(Clone, Copy)]
struct Model {
    /// `__$seqval` below `__$start_lsn`: SQL Server logs a transaction's operations before its
    /// commit record. The seed's `FakeCdcDatabase` numbers them from the commit's LSN upward
    /// (at or above it).
    seqval_below_commit: bool,
    /// A snapshot is stamped at `max_lsn` or later. The seed's files may show a commit's
    /// mapping entry before its table rows, so that source stamps one LSN below.
    stamp_at_max_lsn: bool,
}

impl Model {
    /// The lowest stamp a snapshot read may get when `max_lsn` is the last commit.
    fn lowest_stamp(self, max_lsn: Lsn) -> Lsn {
        match self.stamp_at_max_lsn {
            true => max_lsn,
            false => max_lsn.decrement(),
        }
    }
}

/// SQL Server's behaviour, which our simulator and source model.
const SQL_SERVER: Model = Model {
    seqval_below_commit: true,
    stamp_at_max_lsn: true,
};

/// Every check, on every capture instance of every tracked table.
async fn conformance(source: Arc<dyn CdcSource>) {
    conformance_of(source, SQL_SERVER).await;
}

/// [`conformance`] of a source modelling SQL Server as `model` says.
async fn conformance_of(source: Arc<dyn CdcSource>, model: Model) {
    let max_lsn = source
        .max_lsn()
        .await
        .expect("max_lsn")
        .expect("a database with commits");
    assert!(
        source.lsn_to_time(max_lsn).await.expect("time").is_some(),
        "max_lsn is a commit"
    );
    assert_eq!(
        source.increment_lsn(max_lsn).await.expect("inc"),
        max_lsn.increment()
    );
    assert_eq!(
        source.decrement_lsn(max_lsn).await.expect("dec"),
        max_lsn.decrement()
    );
    assert_eq!(
        source.nth_commit_after(max_lsn, 1).await.expect("nth"),
        None,
        "nothing after max_lsn"
    );
    assert!(
        source.nth_commit_after(max_lsn, 0).await.is_err(),
        "n = 0 is refused"
    );
    // Time to LSN: the last commit at or before a commit's own time is that commit or a
    // later one of the same time; nothing is at or before the epoch.
    let max_time = source
        .lsn_to_time(max_lsn)
        .await
        .expect("time")
        .expect("a commit");
    let at = source
        .commit_at_or_before(max_time)
        .await
        .expect("time_to_lsn")
        .expect("max_lsn's own time finds a commit");
    assert!(at <= max_lsn, "no commit after max_lsn");
    assert_eq!(
        source.lsn_to_time(at).await.expect("time"),
        Some(max_time),
        "the newest commit at max_lsn's time"
    );
    assert_eq!(
        source
            .commit_at_or_before(mssql_cdc_flight::CommitTime(0))
            .await
            .expect("time_to_lsn"),
        None,
        "nothing at or before 1970"
    );

    let tables = source.tracked_tables().await.expect("tables");
    assert!(!tables.is_empty());
    for tracked in tables {
        let instances = &tracked.capture_instances;
        assert!(
            !instances.is_empty() && instances.len() <= 2,
            "{}: 1 or 2 instances",
            tracked.table
        );
        // Oldest first by creation. Start LSNs are not ordered: cleanup moves them, and a
        // cleanup of one instance can move the older one's past the newer one's.
        for pair in instances.windows(2) {
            assert!(pair[0].create_date <= pair[1].create_date, "oldest first");
        }
        for instance in instances {
            assert_eq!(
                source
                    .capture_instance(&instance.name)
                    .await
                    .expect("by name"),
                *instance
            );
            let Some(start_lsn) = instance.start_lsn else {
                // Not processed by the capture job yet: nothing to read, and asking for its
                // low endpoint is a passing state (UNAVAILABLE), not an unknown instance.
                let error = source.min_lsn(&instance.name).await.expect_err("pending");
                assert!(error.is_transient(), "{error}");
                continue;
            };
            // Both read `cdc.change_tables.start_lsn`; a cleanup may run between the two.
            let min_lsn = source.min_lsn(&instance.name).await.expect("min_lsn");
            assert!(min_lsn >= start_lsn && min_lsn <= max_lsn.increment());
            check_commit_walk(source.as_ref(), min_lsn, max_lsn).await;
            check_changes(source.as_ref(), instance, min_lsn, max_lsn, model).await;
            for entry in source
                .ddl_history(InstanceRange::new(&instance.name, Lsn::ZERO, max_lsn))
                .await
                .expect("ddl")
            {
                assert_eq!(entry.capture_instance, instance.name);
                assert!(entry.ddl_lsn <= max_lsn);
            }
            let none = source
                .ddl_history(InstanceRange::new(&instance.name, max_lsn, max_lsn))
                .await
                .expect("empty ddl range");
            assert!(none.is_empty(), "(max, max] holds no DDL");
        }
        assert!(source.capture_instance("no_such_instance").await.is_err());
        assert!(source.min_lsn("no_such_instance").await.is_err());
        let lowest_stamp = model.lowest_stamp(max_lsn);
        check_snapshot_primitives(source.as_ref(), &tracked, lowest_stamp).await;
        check_keyset_primitives(source.as_ref(), &tracked, lowest_stamp).await;
    }
}

/// The newest capture instance of `tracked` the capture job has processed: what snapshots
/// are served for.
fn newest_active(tracked: &TrackedTable) -> &mssql_cdc_flight::source::CaptureInstance {
    tracked
        .capture_instances
        .iter()
        .rev()
        .find(|instance| instance.is_active())
        .expect("an active instance")
}

/// The keys a snapshot read returns, in order, with each row's value digest of its captured
/// columns as served ([`mssql_cdc_flight::digest`]), and the checks every batch must pass.
async fn snapshot_keys(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    key: &str,
    pieces: Vec<SnapshotPiece>,
    stamp: Lsn,
) -> (Vec<(Option<i32>, i64)>, Vec<i64>) {
    let instance = newest_active(tracked);
    let columns = instance.output_columns();
    let key_index = 6 + columns
        .iter()
        .position(|column| column.name == key)
        .expect("the key is captured");
    let read = SnapshotRead {
        table: tracked.table.clone(),
        capture_instance: instance.name.clone(),
        columns: columns.clone(),
        pieces,
        keys: Vec::new(),
        include_command_id: true,
        stamp,
        stamp_time: None,
        batch_rows: 97,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_snapshot(read).await.expect("snapshot read");
    let (mut keys, mut digests) = (Vec::new(), Vec::new());
    while let Some(batch) = stream.next().await {
        let batch = batch.expect("batch");
        assert!(batch.num_rows() <= 97);
        let captured: Vec<&dyn Array> = (6..6 + columns.len())
            .map(|index| batch.column(index).as_ref())
            .collect();
        digests.extend(mssql_cdc_flight::digest::row_digests(&captured).expect("digests"));
        assert_eq!(
            batch.num_columns(),
            6 + columns.len() + 1,
            "metadata, columns, _chunk"
        );
        let key_column =
            arrow::compute::cast(batch.column(key_index), &arrow::datatypes::DataType::Int64)
                .expect("integer key");
        let key_values = key_column
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>()
            .expect("int64");
        let lsns = batch
            .column(1)
            .as_any()
            .downcast_ref::<StringArray>()
            .expect("lsn");
        let operations = batch
            .column(3)
            .as_any()
            .downcast_ref::<Int32Array>()
            .expect("op");
        let chunks = batch
            .column(batch.num_columns() - 1)
            .as_any()
            .downcast_ref::<Int32Array>()
            .expect("chunk");
        for row in 0..batch.num_rows() {
            assert_eq!(
                lsns.value(row),
                stamp.to_string(),
                "every row carries the stamp"
            );
            assert_eq!(operations.value(row), 0);
            assert!(batch.column(2).is_null(row), "no seqval on snapshot rows");
            keys.push((
                chunks.is_valid(row).then(|| chunks.value(row)),
                key_values.value(row),
            ));
        }
    }
    (keys, digests)
}

/// Key extent, slice counts and snapshot reads agree: the slices count what a whole read
/// returns, and two chunks cut at any key read the same rows once each, tagged.
async fn check_snapshot_primitives(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    lowest_stamp: Lsn,
) {
    let Ok(extent) = source.key_extent(&tracked.table).await else {
        return; // no single integer key: not cut into chunks
    };
    let stamp = source
        .snapshot_lsn(&tracked.table)
        .await
        .expect("snapshot_lsn");
    assert!(stamp >= lowest_stamp, "the stamp is max_lsn or later");
    let (whole, digests) = snapshot_keys(
        source,
        tracked,
        &extent.column,
        vec![SnapshotPiece {
            chunk: None,
            range: KeyRange { lo: None, hi: None },
            keyset: None,
        }],
        stamp,
    )
    .await;
    let (Some(min), Some(max)) = (extent.min, extent.max) else {
        assert!(whole.is_empty(), "no extent: an empty table");
        return;
    };
    assert!(
        whole.windows(2).all(|pair| pair[0].1 < pair[1].1),
        "key order, no repeats"
    );
    assert_eq!((whole[0].1, whole[whole.len() - 1].1), (min, max));
    let width = u64::try_from((i128::from(max) - i128::from(min) + 1) / 7)
        .unwrap_or(1)
        .max(1);
    let buckets = source
        .key_buckets(&tracked.table, KeyGrid::new(min, max, width).expect("grid"))
        .await
        .expect("buckets");
    assert_eq!(
        buckets.iter().map(|bucket| bucket.rows).sum::<u64>(),
        whole.len() as u64
    );
    for bucket in &buckets {
        let inside = whole
            .iter()
            .filter(|(_, key)| *key >= bucket.lo && bucket.hi.is_none_or(|hi| *key < hi))
            .count();
        assert_eq!(
            inside as u64, bucket.rows,
            "slice [{}, {:?})",
            bucket.lo, bucket.hi
        );
    }
    check_key_sums(source, tracked, &extent, &whole).await;
    check_value_sums(source, tracked, &extent, &whole, digests).await;
    let cut = whole[whole.len() / 2].1;
    let (chunked, _) = snapshot_keys(
        source,
        tracked,
        &extent.column,
        vec![
            SnapshotPiece {
                chunk: Some(1),
                range: KeyRange {
                    lo: None,
                    hi: Some(cut),
                },
                keyset: None,
            },
            SnapshotPiece {
                chunk: Some(2),
                range: KeyRange {
                    lo: Some(cut),
                    hi: None,
                },
                keyset: None,
            },
        ],
        stamp,
    )
    .await;
    assert_eq!(
        chunked.iter().map(|(_, key)| *key).collect::<Vec<_>>(),
        whole.iter().map(|(_, key)| *key).collect::<Vec<_>>()
    );
    assert!(
        chunked
            .iter()
            .all(|(chunk, key)| *chunk == Some(if *key < cut { 1 } else { 2 }))
    );
}

/// Value digests: the sums the source computes in its `key_sums` scan equal the digests
/// of the rows a snapshot read serves (`whole` in key order, with `digests`), per slice.
/// Against SQL Server this checks its T-SQL (`sql::value_text`) against the Rust canonical
/// texts.
async fn check_value_sums(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    extent: &mssql_cdc_flight::source::KeyExtent,
    whole: &[(Option<i32>, i64)],
    digests: Vec<i64>,
) {
    let (lo, hi) = (whole[0].1, whole[whole.len() - 1].1);
    let grid = KeyGrid::covering(lo, hi, 5).expect("grid");
    let key = KeyColumn {
        name: extent.column.clone(),
        sql_type: extent.sql_type.clone(),
    };
    let columns = newest_active(tracked).output_columns();
    let sums = source
        .key_sums(&tracked.table, &key, grid, &columns)
        .await
        .expect("key_sums with values");
    let rows = whole.iter().map(|(_, key)| Some(*key)).zip(digests);
    assert_eq!(
        sums,
        KeySums::count_rows(&grid, rows),
        "the source's value sums are the digests of the rows it serves"
    );
}

/// `key_span` and `key_sums` on the integer key agree with the keys a snapshot read returns,
/// on a grid covering them and on one that starts mid-way (keys below it fall in slices
/// before it); a `date` column, when the table has one, counts every row once, NULL or not.
async fn check_key_sums(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    extent: &mssql_cdc_flight::source::KeyExtent,
    whole: &[(Option<i32>, i64)],
) {
    let key = KeyColumn {
        name: extent.column.clone(),
        sql_type: extent.sql_type.clone(),
    };
    let (min, max) = source
        .key_span(&tracked.table, &key)
        .await
        .expect("key_span")
        .expect("a span");
    assert_eq!((min, max), (whole[0].1, whole[whole.len() - 1].1));
    let middle = whole[whole.len() / 2].1;
    for grid in [
        KeyGrid::covering(min, max, 7).expect("grid"),
        KeyGrid::covering(middle, max, 3).expect("grid"),
    ] {
        let sums = source
            .key_sums(&tracked.table, &key, grid, &[])
            .await
            .expect("key_sums");
        assert_eq!(sums.null_rows, 0, "a unique key has no NULL");
        let keys = whole.iter().map(|(_, key)| Some(*key));
        assert_eq!(sums, KeySums::count(&grid, keys), "grid {grid:?}");
    }
    let instance = newest_active(tracked);
    if let Some(date) = instance
        .columns
        .iter()
        .find(|column| column.sql_type == mssql_cdc_flight::types::SqlType::Date)
    {
        let date = KeyColumn {
            name: date.name.clone(),
            sql_type: date.sql_type.clone(),
        };
        let span = source.key_span(&tracked.table, &date).await.expect("span");
        let grid = match span {
            Some((lo, hi)) => KeyGrid::covering(lo, hi, 5).expect("grid"),
            None => KeyGrid::new(0, 0, 1).expect("grid"),
        };
        let sums = source
            .key_sums(&tracked.table, &date, grid, &[])
            .await
            .expect("date sums");
        let counted: u64 = sums.slices.iter().map(|slice| slice.slice.rows).sum();
        assert_eq!(
            counted + sums.null_rows,
            whole.len() as u64,
            "every row once"
        );
        for slice in &sums.slices {
            let (lo, hi) = span.expect("slices need a span");
            assert!(slice.slice.lo <= hi && slice.slice.hi.is_none_or(|end| end > lo));
            let rows = i128::from(slice.slice.rows);
            assert!(
                slice.key_sum >= rows * i128::from(slice.slice.lo.max(lo))
                    && slice.key_sum <= rows * i128::from(hi),
                "day sums lie within the slice"
            );
        }
    }
    let text = KeyColumn {
        name: "no_such_column".into(),
        sql_type: "nvarchar(10)".parse().expect("type"),
    };
    assert!(
        source
            .key_sums(
                &tracked.table,
                &text,
                KeyGrid::new(0, 1, 1).expect("grid"),
                &[]
            )
            .await
            .is_err(),
        "text columns have no key sum"
    );
}

/// The rows of a keyset read, each as the text of its captured columns, with its chunk.
async fn keyset_rows(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    keys: &[KeyColumn],
    ranges: Vec<KeysetRange>,
    stamp: Lsn,
) -> Vec<(Option<i32>, String)> {
    let instance = newest_active(tracked);
    let columns = instance.output_columns();
    let read = SnapshotRead {
        table: tracked.table.clone(),
        capture_instance: instance.name.clone(),
        columns: columns.clone(),
        pieces: ranges
            .into_iter()
            .enumerate()
            .map(|(index, range)| SnapshotPiece {
                chunk: Some(index as i32),
                range: KeyRange { lo: None, hi: None },
                keyset: Some(range),
            })
            .collect(),
        keys: keys.to_vec(),
        include_command_id: true,
        stamp,
        stamp_time: None,
        batch_rows: 89,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_snapshot(read).await.expect("keyset read");
    let mut rows = Vec::new();
    while let Some(batch) = stream.next().await {
        let batch = batch.expect("batch");
        let chunks = batch
            .column(batch.num_columns() - 1)
            .as_any()
            .downcast_ref::<arrow::array::Int32Array>()
            .expect("_chunk")
            .clone();
        let captured = batch
            .project(&(6..6 + columns.len()).collect::<Vec<_>>())
            .expect("project");
        for row in 0..batch.num_rows() {
            let text = (0..captured.num_columns())
                .map(|column| {
                    arrow::util::display::array_value_to_string(captured.column(column), row)
                        .expect("display")
                })
                .collect::<Vec<_>>()
                .join("|");
            rows.push((chunks.is_valid(row).then(|| chunks.value(row)), text));
        }
    }
    rows
}

/// Keyset seeks on the unique index CDC uses, whatever its columns: bounds walked with
/// key_bound tile the table, each chunk `n` rows but the last, no row twice or lost, and no
/// key after MAX; `table_rows` counts the rows. Only the source compares keys; the test only
/// hands its bounds back.
async fn check_keyset_primitives(
    source: &dyn CdcSource,
    tracked: &TrackedTable,
    lowest_stamp: Lsn,
) {
    let instance = newest_active(tracked);
    if instance.index_columns.is_empty() {
        return;
    }
    let keys: Vec<KeyColumn> = instance
        .index_columns
        .iter()
        .map(|name| {
            let column = instance
                .columns
                .iter()
                .find(|column| &column.name == name)
                .expect("index columns are captured");
            KeyColumn {
                name: column.name.clone(),
                sql_type: column.sql_type.clone(),
            }
        })
        .collect();
    let stamp = source.snapshot_lsn(&tracked.table).await.expect("stamp");
    assert!(stamp >= lowest_stamp);
    let whole = keyset_rows(source, tracked, &keys, vec![KeysetRange::default()], stamp).await;
    // The row count partitions of a key without integer bounds are cut by: exact on the
    // simulators; SQL Server's `sp_spaceused` is an estimate (Microsoft's page), so it is held
    // only to say whether the table has rows.
    let rows = source.table_rows(&tracked.table).await.expect("table_rows");
    match source.describe().starts_with("mssql://") {
        true => assert_eq!(rows > 0, !whole.is_empty(), "{rows} rows estimated"),
        false => assert_eq!(
            rows,
            whole.len() as u64,
            "table_rows counts what a read returns"
        ),
    }
    let Some(max) = source
        .key_max(&tracked.table, &keys)
        .await
        .expect("key_max")
    else {
        assert!(whole.is_empty(), "no MAX: an empty table");
        return;
    };
    let n = (whole.len() as u64 / 5).max(1);
    let mut bounds: Vec<KeyTuple> = Vec::new();
    loop {
        let seek = KeySeek {
            from: bounds.last().cloned(),
            from_inclusive: true,
            to: Some(max.clone()),
            to_inclusive: true,
            n,
        };
        match source
            .key_bound(
                &tracked.table,
                &KeysetSeek::new(keys.clone(), seek).expect("seek"),
            )
            .await
            .expect("key_bound")
        {
            Some(bound) => bounds.push(bound),
            None => break,
        }
    }
    let after_max = KeySeek {
        from: Some(max.clone()),
        from_inclusive: false,
        to: None,
        to_inclusive: false,
        n: 0,
    };
    assert_eq!(
        source
            .key_bound(
                &tracked.table,
                &KeysetSeek::new(keys.clone(), after_max).expect("seek"),
            )
            .await
            .expect("last_bound"),
        None,
        "{}: no key after MAX on a quiet table",
        tracked.table
    );
    let mut ranges = Vec::new();
    let mut lo: Option<KeyTuple> = None;
    for bound in &bounds {
        ranges.push(KeysetRange {
            lo: lo.clone(),
            hi: Some(bound.clone()),
        });
        lo = Some(bound.clone());
    }
    ranges.push(KeysetRange { lo, hi: None });
    let chunked = keyset_rows(source, tracked, &keys, ranges, stamp).await;
    let sorted = |rows: &[(Option<i32>, String)]| {
        let mut texts: Vec<String> = rows.iter().map(|(_, text)| text.clone()).collect();
        texts.sort();
        texts
    };
    assert_eq!(
        sorted(&chunked),
        sorted(&whole),
        "{}: chunks tile the table",
        tracked.table
    );
    for chunk in 0..bounds.len() as i32 {
        assert_eq!(
            chunked.iter().filter(|(id, _)| *id == Some(chunk)).count() as u64,
            n,
            "{}: chunk {chunk} holds n rows",
            tracked.table
        );
    }
}

/// Commits after min_lsn, walked with nth_commit_after, have increasing LSNs and
/// non-decreasing commit times.
async fn check_commit_walk(source: &dyn CdcSource, min_lsn: Lsn, max_lsn: Lsn) {
    let mut position = min_lsn.decrement();
    let mut previous_time = None;
    let mut steps = 0;
    while let Some(next) = source.nth_commit_after(position, 7).await.expect("nth") {
        assert!(next > position && next <= max_lsn);
        let time = source
            .lsn_to_time(next)
            .await
            .expect("time")
            .expect("a commit has a time");
        assert!(
            previous_time <= Some(time),
            "commit time order follows LSN order"
        );
        previous_time = Some(time);
        position = next;
        steps += 1;
        if next == max_lsn || steps > 10_000 {
            break;
        }
    }
    assert_eq!(position, max_lsn, "the walk ends at max_lsn");
}

/// Change rows of [min_lsn, max_lsn]: in the ordering key, inside the range, well formed,
/// and counted the same by split_points.
async fn check_changes(
    source: &dyn CdcSource,
    instance: &mssql_cdc_flight::source::CaptureInstance,
    min_lsn: Lsn,
    max_lsn: Lsn,
    model: Model,
) {
    let columns = instance.output_columns();
    let read = ChangeRead {
        capture_instance: instance.name.clone(),
        from: min_lsn,
        to: max_lsn,
        columns: columns.clone(),
        include_command_id: true,
        batch_rows: 333,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_changes(read).await.expect("read");
    let mut rows: Vec<(String, i32, String, i32)> = Vec::new();
    let mut commit_times: Vec<(String, i64)> = Vec::new();
    while let Some(batch) = stream.next().await {
        let batch = batch.expect("batch");
        assert!(batch.num_rows() <= 333, "batch_rows is a bound");
        assert_eq!(batch.num_columns(), 6 + columns.len());
        let text = |index: usize| {
            batch
                .column(index)
                .as_any()
                .downcast_ref::<StringArray>()
                .expect("utf8")
                .clone()
        };
        let int = |index: usize| {
            batch
                .column(index)
                .as_any()
                .downcast_ref::<Int32Array>()
                .expect("int")
                .clone()
        };
        let (names, lsns, seqvals, operations, commands) =
            (text(0), text(1), text(2), int(3), int(4));
        let times = batch
            .column(5)
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .expect("_commit_ts")
            .clone();
        assert_eq!(
            times.null_count(),
            0,
            "every change row has its commit time"
        );
        for row in 0..batch.num_rows() {
            commit_times.push((lsns.value(row).into(), times.value(row)));
            assert_eq!(names.value(row), instance.name);
            assert!((1..=4).contains(&operations.value(row)));
            rows.push((
                lsns.value(row).into(),
                commands.value(row),
                seqvals.value(row).into(),
                operations.value(row),
            ));
        }
    }
    let mut sorted = rows.clone();
    sorted.sort();
    assert_eq!(
        rows, sorted,
        "rows come in (_start_lsn, _command_id, _seqval, _operation) order"
    );
    let (low, high) = (min_lsn.to_string(), max_lsn.to_string());
    assert!(
        rows.iter().all(|row| row.0 >= low && row.0 <= high),
        "rows stay in the range"
    );
    match model.seqval_below_commit {
        true => assert!(
            rows.iter().all(|row| row.2 < row.0),
            "an operation's seqval is below its commit"
        ),
        false => assert!(
            rows.iter().all(|row| row.2 >= row.0),
            "the seed's model: seqvals from the commit's LSN upward"
        ),
    }
    // A before-image (3) is followed by its after-image (4) with the same seqval.
    for (index, row) in rows.iter().enumerate().filter(|(_, row)| row.3 == 3) {
        let next = &rows[index + 1];
        assert_eq!(
            (next.2.as_str(), next.3),
            (row.2.as_str(), 4),
            "3 then 4 sharing a seqval"
        );
    }
    check_commit_times(source, &commit_times).await;
    let tiles = source
        .split_points(
            InstanceRange::new(&instance.name, min_lsn, max_lsn),
            NonZeroU32::new(5).expect("5"),
        )
        .await
        .expect("split");
    assert_eq!(
        tiles.iter().map(|tile| tile.rows).sum::<u64>(),
        rows.len() as u64
    );
    assert!(tiles.len() <= 6, "about n tiles, not {}", tiles.len());
    let commits: BTreeSet<&str> = rows.iter().map(|row| row.0.as_str()).collect();
    let mut previous = min_lsn.decrement();
    for tile in &tiles {
        assert!(tile.last_lsn > previous, "tiles in LSN order");
        assert!(
            commits.contains(tile.last_lsn.to_string().as_str()),
            "a tile ends on a commit holding rows"
        );
        let inside = rows
            .iter()
            .filter(|row| row.0 > previous.to_string() && row.0 <= tile.last_lsn.to_string())
            .count();
        assert_eq!(
            inside as u64, tile.rows,
            "a tile's count is what its range reads"
        );
        previous = tile.last_lsn;
    }
    check_instances_with_changes(source, &instance.name, &commits, max_lsn).await;
}

/// `instances_with_changes` names an instance exactly when `(after, to]` holds one of its
/// change rows: `after` itself excluded, `to` included.
async fn check_instances_with_changes(
    source: &dyn CdcSource,
    name: &str,
    commits: &BTreeSet<&str>,
    max_lsn: Lsn,
) {
    let names = vec![name.to_string()];
    let names = &names;
    let changed = |after: Lsn, to: Lsn| async move {
        source
            .instances_with_changes(names, after, to)
            .await
            .expect("instances_with_changes")
    };
    let commits: Vec<Lsn> = commits
        .iter()
        .map(|lsn| lsn.parse().expect("lsn"))
        .collect();
    for pair in commits.windows(2).take(10) {
        let (first, second) = (pair[0], pair[1]);
        assert_eq!(&changed(first, second).await, names, "({first}, {second}]");
        assert!(
            changed(first, second.decrement()).await.is_empty(),
            "({first}, {second}) holds no row of {name}"
        );
        assert!(changed(second, first).await.is_empty(), "a reversed range");
    }
    if let Some(last) = commits.last() {
        assert_eq!(&changed(last.decrement(), *last).await, names);
        assert!(
            changed(*last, max_lsn).await.is_empty(),
            "nothing of {name} after its last commit"
        );
    }
}

/// Change rows' commit times (`(_start_lsn, _commit_ts)` in read order) rise with their
/// LSNs, even across a fall-back hour, and each commit's is what `lsn_to_time` says.
async fn check_commit_times(source: &dyn CdcSource, commit_times: &[(String, i64)]) {
    assert!(
        commit_times.windows(2).all(|pair| pair[0].1 <= pair[1].1),
        "commit-time order follows LSN order"
    );
    let mut commits: Vec<&(String, i64)> = commit_times.iter().collect();
    commits.dedup_by(|a, b| a.0 == b.0);
    // Every commit of a small range; a sample of a large one, ends included.
    let step = (commits.len() / 200).max(1);
    let sample = commits
        .iter()
        .step_by(step)
        .chain(commits.last())
        .collect::<Vec<_>>();
    for (lsn, time) in sample {
        let lsn: Lsn = lsn.parse().expect("lsn");
        assert_eq!(
            source
                .lsn_to_time(lsn)
                .await
                .expect("time")
                .map(|time| time.0),
            Some(*time),
            "the change rows of commit {lsn} carry lsn_to_time's time"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_database_conforms() {
    let mut tables = mssql_cdc_flight::sim::sample::sample_tables();
    tables.extend([
        mssql_cdc_flight::sim::sample::accounts(),
        mssql_cdc_flight::sim::sample::events(),
    ]);
    let sim = SimFixture::with_tables(&tables);
    let mut writer = sim.writer(17);
    let spec = WorkloadSpec {
        commits: Some(400),
        max_rows_per_statement: 6,
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    writer
        .add_column(&orders, "discount", "decimal(9,2)", true)
        .expect("ddl");
    writer
        .ddl(
            &orders,
            "CREATE INDEX ix_orders_status ON dbo.orders (status)",
        )
        .expect("ddl");
    let columns = ["order_id", "status", "amount", "discount"].map(String::from);
    writer
        .enable_capture_instance(&orders, "dbo_orders_v2", &columns)
        .expect("second instance");
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    drop(writer);
    let cut = sim
        .db
        .nth_commit_after(Lsn::ZERO, 100)
        .await
        .expect("nth")
        .expect("commit");
    sim.db.cleanup(None, cut).expect("cleanup");
    // A second instance of dbo.accounts the capture job has not processed yet.
    let mut writer = sim.writer(18);
    let accounts = mssql_cdc_flight::sim::sample::accounts();
    let columns: Vec<String> = accounts.columns.iter().map(|c| c.0.clone()).collect();
    writer
        .enable_capture_instance_unprocessed(&accounts.table, "dbo_accounts_v2", &columns)
        .expect("pending instance");
    drop(writer);
    let tables = sim.db.tracked_tables().await.expect("tables");
    let pending = tables
        .iter()
        .flat_map(|tracked| &tracked.capture_instances)
        .find(|instance| instance.name == "dbo_accounts_v2")
        .expect("listed");
    assert_eq!(pending.start_lsn, None, "NULL until the capture job ran");
    conformance(Arc::new(sim.db.clone())).await;
}

/// The seed library's simulator (issue 55): the same checks over a history the seed's own
/// `FakeCdcDatabase` wrote (clients/python/tests/seed_workload.py: two tables, one with a
/// composite key, idle entries, a second capture instance with a new column, a cleanup of the
/// oldest third), served by the `seed-fake:` source. The Python is `MSSQL_CDC_PYTHON` or the
/// repository's `.venv`, which scripts/test makes with `mssql-cdc-pyspark` installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_librarys_simulator_conforms() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("MSSQL_CDC_PYTHON")
        .map_or_else(|| root.join(".venv/bin/python"), Into::into);
    let dir = tempfile::tempdir().expect("tempdir");
    let written = std::process::Command::new(&python)
        .arg(root.join("clients/python/tests/seed_workload.py"))
        .arg(dir.path())
        .args(["--commits", "120", "--switch", "--cleanup"])
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "{} cannot run ({error}): scripts/test makes .venv with the seed library \
                 (mssql-cdc-pyspark); or set MSSQL_CDC_PYTHON",
                python.display()
            )
        });
    assert!(
        written.status.success(),
        "the seed's workload failed: {}",
        String::from_utf8_lossy(&written.stderr)
    );
    let source = mssql_cdc_flight::seed_fake::SeedFake::open(dir.path()).expect("seed files");
    // The differences of the seed's model the suite knows (docs/design-notes.md).
    let seed = Model {
        seqval_below_commit: false,
        stamp_at_max_lsn: false,
    };
    conformance_of(Arc::new(source), seed).await;
}

/// A server clock in a named zone that falls back an hour: SQL Server records local times,
/// which repeat an hour, and the source's rule must still serve every commit at its true
/// instant (commits every 4 minutes, so the drop is seen) in LSN order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_zone_serves_each_commit_at_its_instant_across_a_fall_back_hour() {
    const MINUTE: i64 = 60_000_000;
    let sim = SimFixture::with_tables(&mssql_cdc_flight::sim::sample::sample_tables());
    let start = sim.db.manifest().expect("manifest").last_commit_time;
    let zone = SimZone {
        name: "E. South America Standard Time".into(),
        initial_offset_minutes: -180,
        changes: vec![OffsetChange {
            at: CommitTime(start.0 + 120 * MINUTE),
            offset_minutes: -240,
        }],
    };
    let mut writer = sim
        .db
        .writer(
            Clock::Virtual {
                step_micros: 4 * MINUTE,
            },
            31,
        )
        .expect("writer");
    writer.set_time_zone(Some(zone.clone())).expect("zone");
    let spec = WorkloadSpec {
        commits: Some(75),
        max_rows_per_statement: 4,
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    let max_lsn = sim.db.max_lsn().await.expect("max").expect("commits");
    let served = commit_times(&sim.db, max_lsn).await;
    conformance(Arc::new(sim.db.clone())).await;
    // The same commits with the zone taken away are served at their stored UTC instants.
    writer.set_time_zone(None).expect("utc");
    drop(writer);
    let instants = commit_times(&sim.db, max_lsn).await;
    assert_eq!(served.len(), instants.len());
    let locals: Vec<i64> = instants
        .iter()
        .map(|(_, time)| zone.local(*time).0)
        .collect();
    assert!(
        locals.windows(2).any(|pair| pair[1] < pair[0]),
        "the workload crosses the fall-back: local times go back"
    );
    assert_eq!(
        served, instants,
        "every commit is served at its instant, the repeated hour included"
    );
}

/// `ALTER COLUMN` of a tracked column (`decimal(12,2)` to `decimal(14,4)`): SQL Server gives
/// the change table the new type under the same capture instance. A read planned on the old
/// type that meets a value it cannot hold is refused as `SCHEMA_CHANGED`, never rounded; a
/// read planned on the new type serves every row, those captured before exactly widened;
/// the DDL history names the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_altered_column_is_read_exactly_or_refused_as_schema_changed() {
    let sim = SimFixture::with_tables(&mssql_cdc_flight::sim::sample::sample_tables());
    let customers: mssql_cdc_flight::source::TableName = "dbo.customers".parse().expect("table");
    let spec = WorkloadSpec {
        commits: Some(60),
        tables: vec![customers.clone()],
        ..WorkloadSpec::default()
    };
    let mut writer = sim.writer(41);
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    let instance = || async {
        sim.db
            .tracked_tables()
            .await
            .expect("tables")
            .into_iter()
            .find(|tracked| tracked.table == customers)
            .expect("customers")
            .capture_instances
            .remove(0)
    };
    let planned = instance().await;
    let altered_at = writer
        .alter_column(&customers, "balance", "decimal(14,4)")
        .expect("alter");
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    drop(writer);
    let min_lsn = sim.db.min_lsn(&planned.name).await.expect("min");
    let max_lsn = sim.db.max_lsn().await.expect("max").expect("commits");
    let old_columns = planned.output_columns();
    let error = balances(&sim.db, &planned.name, &old_columns, min_lsn, max_lsn)
        .await
        .expect_err("values of scale 4 read at scale 2");
    assert!(
        matches!(error, mssql_cdc_flight::Error::SchemaChanged(_))
            && error.to_string().contains("balance"),
        "{error}"
    );
    let altered = instance().await;
    let new_columns = altered.output_columns();
    let balance_type = |columns: &[mssql_cdc_flight::types::OutputColumn]| {
        columns
            .iter()
            .find(|column| column.name == "balance")
            .map(|column| column.sql_type.to_string())
    };
    assert_eq!(balance_type(&new_columns).as_deref(), Some("decimal(14,4)"));
    let before = altered_at.decrement();
    let old = balances(&sim.db, &planned.name, &old_columns, min_lsn, before)
        .await
        .expect("rows captured before the change, at the old type");
    let widened = balances(&sim.db, &planned.name, &new_columns, min_lsn, before)
        .await
        .expect("the same rows at the new type");
    assert!(!old.is_empty());
    assert_eq!(
        widened,
        old.iter()
            .map(|value| value.map(|v| v * 100))
            .collect::<Vec<_>>(),
        "widened exactly"
    );
    let all = balances(&sim.db, &planned.name, &new_columns, min_lsn, max_lsn)
        .await
        .expect("every row at the new type");
    assert!(all.len() > old.len());
    let history = sim
        .db
        .ddl_history(InstanceRange::new(&planned.name, min_lsn, max_lsn))
        .await
        .expect("history");
    assert!(
        history.iter().any(|entry| entry.ddl_lsn == altered_at
            && entry
                .ddl_command
                .contains("ALTER COLUMN [balance] decimal(14,4)")),
        "{history:?}"
    );
}

/// The `balance` values (unscaled) of a change read of `[from, to]` with `columns`.
async fn balances(
    source: &dyn CdcSource,
    capture_instance: &str,
    columns: &[mssql_cdc_flight::types::OutputColumn],
    from: Lsn,
    to: Lsn,
) -> mssql_cdc_flight::Result<Vec<Option<i128>>> {
    let read = ChangeRead {
        capture_instance: capture_instance.into(),
        from,
        to,
        columns: columns.to_vec(),
        include_command_id: false,
        batch_rows: 1000,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_changes(read).await?;
    let mut values = Vec::new();
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let balance = batch
            .column_by_name("balance")
            .expect("balance")
            .as_any()
            .downcast_ref::<Decimal128Array>()
            .expect("decimal")
            .clone();
        values.extend(balance.iter());
    }
    Ok(values)
}

/// `(lsn, lsn_to_time)` of every commit up to `max_lsn`.
async fn commit_times(source: &dyn CdcSource, max_lsn: Lsn) -> Vec<(Lsn, CommitTime)> {
    let mut times = Vec::new();
    let mut position = Lsn::ZERO;
    while let Some(next) = source.nth_commit_after(position, 1).await.expect("nth") {
        let time = source
            .lsn_to_time(next)
            .await
            .expect("time")
            .expect("a time");
        times.push((next, time));
        position = next;
        if next >= max_lsn {
            break;
        }
    }
    times
}

/// The same suite against a real SQL Server, when `MSSQL_CDC_TEST_URL` names one.
#[cfg(feature = "mssql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mssql_test_url),
    ignore = "MSSQL_CDC_TEST_URL is not set: no SQL Server to check (docs/sqlserver.md)"
)]
async fn sql_server_conforms() {
    let url = std::env::var("MSSQL_CDC_TEST_URL").expect("MSSQL_CDC_TEST_URL (set at build)");
    mssql_cdc_flight::init_process("warn");
    let config = mssql_cdc_flight::mssql::SqlServerConfig::parse(&url).expect("MSSQL_CDC_TEST_URL");
    let source = mssql_cdc_flight::mssql::SqlServerSource::connect(config)
        .await
        .expect("connect");
    conformance(Arc::new(source)).await;
}
