//! The `CdcSource` conformance suite: what every implementation must answer alike.
//!
//! The checks only read, so they hold for any database with CDC data: here the simulated one
//! after a mixed workload (with a second capture instance, DDL, idle entries and a cleanup).
//! The SQL Server source (issue 6) is to run the same `conformance` function against a real
//! server wherever `MSSQL_CDC_TEST_URL` is set.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arrow::array::{Array, Int32Array, StringArray};
use common::SimFixture;
use futures::StreamExt;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::source::{CdcSource, ChangeRead};

/// Every check, on every capture instance of every tracked table.
async fn conformance(source: Arc<dyn CdcSource>) {
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

    let tables = source.tracked_tables().await.expect("tables");
    assert!(!tables.is_empty());
    for tracked in tables {
        let instances = &tracked.capture_instances;
        assert!(
            !instances.is_empty() && instances.len() <= 2,
            "{}: 1 or 2 instances",
            tracked.table
        );
        for pair in instances.windows(2) {
            assert!(pair[0].start_lsn < pair[1].start_lsn, "oldest first");
        }
        for instance in instances {
            assert_eq!(
                source
                    .capture_instance(&instance.name)
                    .await
                    .expect("by name"),
                *instance
            );
            let min_lsn = source.min_lsn(&instance.name).await.expect("min_lsn");
            assert!(min_lsn >= instance.start_lsn && min_lsn <= max_lsn.increment());
            check_commit_walk(source.as_ref(), min_lsn, max_lsn).await;
            check_changes(source.as_ref(), instance, min_lsn, max_lsn).await;
            for entry in source
                .ddl_history(&instance.name, Lsn::ZERO, max_lsn)
                .await
                .expect("ddl")
            {
                assert_eq!(entry.capture_instance, instance.name);
                assert!(entry.ddl_lsn <= max_lsn);
            }
            let none = source
                .ddl_history(&instance.name, max_lsn, max_lsn)
                .await
                .expect("empty ddl range");
            assert!(none.is_empty(), "(max, max] holds no DDL");
        }
        assert!(source.capture_instance("no_such_instance").await.is_err());
        assert!(source.min_lsn("no_such_instance").await.is_err());
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
) {
    let columns = instance.output_columns();
    let read = ChangeRead {
        capture_instance: instance.name.clone(),
        from: min_lsn,
        to: max_lsn,
        columns: columns.clone(),
        include_command_id: true,
        batch_rows: 333,
        batch_bytes: 1 << 20,
    };
    let mut stream = source.read_changes(read).await.expect("read");
    let mut rows: Vec<(String, i32, String, i32)> = Vec::new();
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
        for row in 0..batch.num_rows() {
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
    assert!(
        rows.iter().all(|row| row.2 < row.0),
        "an operation's seqval is below its commit"
    );
    // A before-image (3) is followed by its after-image (4) with the same seqval.
    for (index, row) in rows.iter().enumerate().filter(|(_, row)| row.3 == 3) {
        let next = &rows[index + 1];
        assert_eq!(
            (next.2.as_str(), next.3),
            (row.2.as_str(), 4),
            "3 then 4 sharing a seqval"
        );
    }
    let tiles = source
        .split_points(&instance.name, min_lsn, max_lsn, 5)
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
    assert!(
        source
            .split_points(&instance.name, min_lsn, max_lsn, 0)
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_database_conforms() {
    let sim = SimFixture::new();
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
    conformance(Arc::new(sim.db.clone())).await;
}
