//! Silver: apply_changes against the in-process server, the stream and real Delta tables.
//! End state every time: silver equals the source table, row by row.

mod common;

use common::{Lab, Rows, churn, run_now, source_rows};
use mssql_cdc_flight::sim::workload::Mix;
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::control::{self, Position};
use mssql_cdc_writer::reconcile::ReconcileConfig;
use mssql_cdc_writer::silver::{ApplyConfig, ApplyOutcome, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::StreamConfig;

fn apply_config(lab: &Lab, facts: bool) -> ApplyConfig {
    ApplyConfig {
        facts: facts.then(|| lab.lake("facts")),
        ..common::orders_apply_config(lab)
    }
}

async fn apply(lab: &Lab) -> ApplyOutcome {
    apply_changes(&apply_config(lab, true))
        .await
        .expect("apply_changes")
}

async fn silver_rows(lab: &Lab) -> Rows {
    common::current_rows(&lab.lake("silver_orders")).await
}

async fn assert_in_step(lab: &Lab, context: &str) {
    assert_eq!(silver_rows(lab).await, source_rows(lab).await, "{context}");
}

fn workload(lab: &Lab, seed: u64, commits: u64, mix: Mix) {
    common::orders_workload(lab, seed, commits, mix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_applied_in_order_and_reruns_change_nothing() {
    let lab = Lab::new().await;
    workload(&lab, 1, 150, churn());
    let config = lab.config();
    let outcome = apply(&lab).await;
    assert!(
        !outcome.bronze_found,
        "nothing before the stream wrote bronze"
    );
    run_now(config.clone()).await;
    let first = apply(&lab).await;
    assert!(first.bronze_found && first.applied_lsn.is_some());
    assert_in_step(&lab, "after the first call").await;
    workload(&lab, 2, 150, churn());
    run_now(config.clone()).await;
    let second = apply(&lab).await;
    assert!(!second.rebuilt, "no snapshot: changes merged");
    assert!(second.applied_lsn > first.applied_lsn);
    assert_in_step(&lab, "after the merge").await;
    let again = apply(&lab).await;
    assert_eq!(
        again.applied_lsn, second.applied_lsn,
        "a rerun moves nothing"
    );
    assert_in_step(&lab, "after a rerun").await;
    // A position left behind by a crash between the MERGE and the position: reapplying
    // from behind is idempotent.
    control::set_position(
        &mssql_cdc_writer::tables::table_url(&lab.lake("control")).expect("url"),
        &lab.lake("silver_orders"),
        &Position {
            applied_lsn: first.applied_lsn.map(|lsn| lsn.to_string()),
            ..Position::default()
        },
    )
    .await
    .expect("rewind");
    let replayed = apply(&lab).await;
    assert_eq!(replayed.applied_lsn, second.applied_lsn);
    assert_in_step(&lab, "after reapplying from behind").await;
    // The verdict: bronze's, as read before the rows.
    let verdict = bronze_verdict(&lab).await;
    assert!(verdict.is_some());
    assert_eq!(replayed.finalized_until, verdict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_a_newer_capture_instance_adds_reaches_silver() {
    let lab = Lab::new().await;
    workload(&lab, 41, 80, churn());
    let config = lab.config();
    run_now(config.clone()).await;
    apply(&lab).await;
    let mut writer = common::add_discount_and_switch(&lab, 42);
    common::run_orders_workload(&mut writer, 80, churn());
    drop(writer);
    run_now(config).await;
    apply(&lab).await;
    let filled = common::query(
        &lab.lake("silver_orders"),
        "SELECT COUNT(discount) AS filled FROM t",
    )
    .await;
    let filled = filled[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .expect("count")
        .value(0);
    assert!(
        filled > 0,
        "keys changed after the switch carry the new column"
    );
    // Keys last written by the newer instance equal the source's rows, new column included.
    // The simulator derives every column of a row from its content, so for keys untouched
    // since the ALTER it shows a value SQL Server would hold as NULL; there silver must equal
    // the source on the older columns and read NULL in the new one.
    let touched = common::query(
        &lab.lake("bronze_orders"),
        "SELECT DISTINCT order_id FROM t WHERE _capture_instance = 'dbo_orders_v2'",
    )
    .await;
    let touched: std::collections::BTreeSet<i64> = touched
        .iter()
        .flat_map(|batch| {
            (0..batch.num_rows()).map(|row| common::integer_at(batch, "order_id", row))
        })
        .collect();
    let (silver, source) = (silver_rows(&lab).await, source_rows(&lab).await);
    assert_eq!(
        silver.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>(),
        "the same keys"
    );
    for (key, row) in &source {
        let held = &silver[key];
        if touched.contains(key) {
            assert_eq!(held, row, "key {key}, changed after the switch");
        } else {
            let (new_column, older) = held.split_last().expect("columns");
            assert_eq!(new_column, "NULL", "key {key}: untouched since the ALTER");
            assert_eq!(older, &row[..row.len() - 1], "key {key}: the older columns");
        }
    }
}

/// A lab of `commits` commits (`seed`) streamed under `configure`d options: a chunked
/// bootstrap read whole, the stream run and silver applied.
async fn bootstrapped(
    seed: u64,
    commits: u64,
    configure: impl FnOnce(&mut StreamConfig),
) -> (Lab, StreamConfig, Snapshots) {
    let lab = Lab::new().await;
    workload(&lab, seed, commits, churn());
    let mut config = stream_config(&lab);
    configure(&mut config);
    let (_, snapshots) = chunked_bootstrap(&mut config).await;
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    apply(&lab).await;
    (lab, config, snapshots)
}

/// [`bootstrapped`] with `snapshot_on_switch` on (80 commits).
async fn streaming_with_snapshot_on_switch(seed: u64) -> (Lab, StreamConfig, Snapshots) {
    bootstrapped(seed, 80, |config| config.snapshot_on_switch = true).await
}

/// [`bootstrapped`] healing purges by re-snapshot (150 commits).
async fn streaming_healing_purges(seed: u64) -> (Lab, StreamConfig, Snapshots) {
    bootstrapped(seed, 150, |config| {
        config.on_data_loss = mssql_cdc_writer::data_loss::OnDataLoss::Resnapshot;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_on_switch_fills_the_new_column_for_every_row() {
    let (lab, config, snapshots) = streaming_with_snapshot_on_switch(43).await;
    let first = snapshot::state(&config)
        .await
        .expect("state")
        .status
        .snapshot;
    let mut writer = common::add_discount_and_switch(&lab, 44);
    common::run_orders_workload(&mut writer, 40, churn());
    drop(writer);
    run_now(config.clone()).await;
    let state = snapshot::state(&config).await.expect("state");
    assert!(
        state.status.snapshot > first,
        "the switch opened a re-snapshot"
    );
    assert_eq!(state.status.state, "open");
    // As the seed's: the open names the batch that read the switch and is a bootstrap.
    let switched = common::query(
        &lab.lake("facts"),
        "SELECT batch_id FROM t WHERE event = 'capture_instance_switched'",
    )
    .await;
    let switch_batch = common::integer_at(&switched[0], "batch_id", 0);
    let second = state.status.snapshot.expect("the switch's snapshot");
    let open = common::query(
        &lab.lake("facts"),
        &format!("SELECT detail FROM t WHERE event = 'snapshot_open' AND min_lsn = '{second}'"),
    )
    .await;
    let detail: serde_json::Value =
        serde_json::from_str(&common::text(&open[0], 0, 0).expect("detail")).expect("json");
    assert_eq!(detail["switch_batch_id"], serde_json::json!(switch_batch));
    assert_eq!(detail["kind"], "bootstrap", "nothing was lost: {detail}");
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    let completed = common::query(
        &lab.lake("facts"),
        &format!("SELECT event FROM t WHERE min_lsn = '{second}' AND event IN ('bootstrap', 'resnapshot')"),
    )
    .await;
    assert_eq!(
        common::text(&completed[0], 0, 0).as_deref(),
        Some("bootstrap")
    );
    assert!(apply(&lab).await.rebuilt);
    // Every row, the ones untouched since the switch included, holds the new column as the
    // source does (compare a_column_a_newer_capture_instance_adds_reaches_silver).
    assert_in_step(&lab, "the re-snapshot filled the new column").await;
}

/// A captured column whose name Delta's Spark connector takes only with column mapping
/// (`[Unit Price]`: a space) reaches bronze and silver under its own name, and silver equals
/// the source. The seed turns column mapping on for such a name; delta-rs writes it as it is
/// (docs/design-notes.md "Column names as the source has them").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_named_with_a_space_reaches_bronze_and_silver_as_it_is() {
    let (lab, config, snapshots) = streaming_with_snapshot_on_switch(48).await;
    let mut writer = common::add_column_and_switch(&lab, 49, "Unit Price", "decimal(9,2)");
    common::run_orders_workload(&mut writer, 40, churn());
    drop(writer);
    run_now(config.clone()).await;
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    assert!(apply(&lab).await.rebuilt);
    for table in ["bronze_orders", "silver_orders"] {
        let filled = common::query(
            &lab.lake(table),
            "SELECT COUNT(\"Unit Price\") AS filled FROM t",
        )
        .await;
        assert!(
            common::integer_at(&filled[0], "filled", 0) > 0,
            "{table} holds the column"
        );
    }
    assert_in_step(&lab, "a column named with a space").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_older_than_resnapshot_every_days_is_taken_again() {
    let lab = Lab::new().await;
    workload(&lab, 45, 80, churn());
    let mut config = stream_config(&lab);
    let (first, snapshots) = chunked_bootstrap(&mut config).await;
    read_all(&snapshots, &WHOLE).await;
    workload(&lab, 46, 30, churn());
    config.resnapshot_every_days = Some(10.0);
    run_now(config.clone()).await;
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(state.status.snapshot, Some(first), "not due yet");
    // A second-old snapshot is due under an interval of 0.864 s.
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    workload(&lab, 47, 30, churn());
    config.resnapshot_every_days = Some(1e-5);
    run_now(config.clone()).await;
    let state = snapshot::state(&config).await.expect("state");
    let second = state.status.snapshot.expect("a snapshot");
    assert!(second > first, "due: a re-snapshot was opened");
    assert_eq!(state.status.state, "open");
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "after the scheduled re-snapshot").await;
    for bad in [0.0, -1.0, f64::NAN] {
        config.resnapshot_every_days = Some(bad);
        let error = common::try_run_now(config.clone())
            .await
            .expect_err("refused");
        assert!(
            error.to_string().contains("resnapshot_every_days"),
            "{error}"
        );
    }
}

/// Bronze's verdict as the stream advances it (under the source table's name).
async fn bronze_verdict(lab: &Lab) -> Option<mssql_cdc_flight::CommitTime> {
    control::finalized_until(
        &mssql_cdc_writer::tables::table_url(&lab.lake("control")).expect("url"),
        "dbo.orders",
    )
    .await
    .expect("verdict")
}

fn stream_config(lab: &Lab) -> StreamConfig {
    lab.config()
}

/// Every wave of a snapshot in one backfill call, chunks of 20 rows.
const WHOLE: BackfillOptions = BackfillOptions {
    chunk_rows: 20,
    max_waves: None,
    target_wave_seconds: 0.0,
    min_headroom_hours: None,
};

/// One wave per backfill call.
const ONE_WAVE: BackfillOptions = BackfillOptions {
    max_waves: Some(1),
    ..WHOLE
};

/// Opens a chunked bootstrap of `config`'s table (its stream then starts at S): S, and a
/// connection to read its waves.
async fn chunked_bootstrap(config: &mut StreamConfig) -> (mssql_cdc_flight::Lsn, Snapshots) {
    let snapshot = snapshot::bootstrap(config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    (snapshot, snapshots)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_snapshot_is_applied_wave_by_wave_then_rebuilt_at_completion() {
    let lab = Lab::new().await;
    workload(&lab, 11, 250, churn());
    let mut config = stream_config(&lab);
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    workload(&lab, 12, 60, churn());
    run_now(config.clone()).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let options = BackfillOptions {
        chunk_rows: 8,
        max_waves: Some(1),
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    };
    let mut waves = 0;
    loop {
        let status = snapshots.backfill(&options).await.expect("wave");
        run_now(config.clone()).await;
        let outcome = apply(&lab).await;
        if status.done {
            assert!(outcome.rebuilt, "the completion row rebuilds silver");
            break;
        }
        assert!(!outcome.rebuilt);
        assert_eq!(
            outcome.finalized_until, None,
            "the verdict is held while the snapshot is open"
        );
        waves += 1;
        // Every key silver holds is the source's current row (a chunk row never outranks
        // a later change); keys of chunks not read yet are missing until their wave.
        let silver = silver_rows(&lab).await;
        let source = source_rows(&lab).await;
        for (key, values) in &silver {
            assert_eq!(
                source.get(key),
                Some(values),
                "key {key} after wave {waves}"
            );
        }
        workload(&lab, 100 + waves, 20, churn());
    }
    assert!(waves >= 2, "{waves} waves");
    run_now(config.clone()).await;
    apply(&lab).await;
    assert_in_step(&lab, "after the snapshot completed").await;
    let _ = snapshot;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_bootstrap_rebuilds_silver_then_changes_merge() {
    let lab = Lab::new().await;
    workload(&lab, 21, 200, churn());
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    workload(&lab, 22, 80, churn());
    run_now(config.clone()).await;
    let first = apply(&lab).await;
    assert!(first.rebuilt);
    assert_in_step(&lab, "rebuilt from the snapshot and the changes after it").await;
    workload(&lab, 23, 80, churn());
    run_now(config.clone()).await;
    let second = apply(&lab).await;
    assert!(!second.rebuilt);
    assert_in_step(&lab, "changes merged after the rebuild").await;
    assert_eq!(second.finalized_until, bronze_verdict(&lab).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_are_refused_with_the_reason() {
    let lab = Lab::new().await;
    workload(&lab, 31, 50, churn());
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open");
    workload(&lab, 32, 20, churn());
    run_now(config.clone()).await;
    Snapshots::connect(config.clone())
        .await
        .expect("connect")
        .backfill(&BackfillOptions {
            chunk_rows: 20,
            max_waves: Some(1),
            target_wave_seconds: 0.0,
            min_headroom_hours: None,
        })
        .await
        .expect("wave");
    let mut no_keys = apply_config(&lab, true);
    no_keys.keys.clear();
    let error = apply_changes(&no_keys).await.expect_err("no keys");
    assert!(error.to_string().contains("key columns"), "{error}");
    let error = apply_changes(&apply_config(&lab, false))
        .await
        .expect_err("chunk rows without facts");
    assert!(error.to_string().contains("facts table"), "{error}");
    let mut other = apply_config(&lab, true);
    other.capture_instance = Some("dbo_orders_v9".into());
    let error = apply_changes(&other).await.expect_err("another instance");
    assert!(matches!(error, WriterError::InvalidArgument(_)));
    assert!(error.to_string().contains("dbo_orders"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_workloads_with_snapshots_mid_way_end_in_step() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        std::env::var("SILVER_PROPERTY_SEED")
            .ok()
            .and_then(|seed| seed.parse().ok())
            .unwrap_or(20_261_130),
    );
    for case in 0..4u64 {
        let lab = Lab::new().await;
        let mix = Mix {
            insert: rng.random_range(0.2..0.6),
            update: rng.random_range(0.0..0.4),
            delete: rng.random_range(0.0..0.3),
            key_update: rng.random_range(0.0..0.2),
            idle: 0.05,
        };
        workload(&lab, 1_000 + case, rng.random_range(50..200), mix);
        let mut config = stream_config(&lab);
        let mode = match case % 3 {
            0 => None,
            1 => Some(SnapshotMode::Full),
            _ => Some(SnapshotMode::Chunked),
        };
        if let Some(mode) = mode {
            snapshot::bootstrap(&mut config, mode)
                .await
                .expect("bootstrap");
        }
        for round in 0..3u64 {
            workload(
                &lab,
                2_000 + case * 10 + round,
                rng.random_range(10..80),
                mix,
            );
            run_now(config.clone()).await;
            if mode == Some(SnapshotMode::Chunked) {
                Snapshots::connect(config.clone())
                    .await
                    .expect("connect")
                    .backfill(&BackfillOptions {
                        chunk_rows: rng.random_range(5..40),
                        max_waves: Some(1),
                        target_wave_seconds: 0.0,
                        min_headroom_hours: None,
                    })
                    .await
                    .expect("wave");
            }
            apply(&lab).await;
        }
        if mode == Some(SnapshotMode::Chunked) {
            Snapshots::connect(config.clone())
                .await
                .expect("connect")
                .backfill(&BackfillOptions {
                    chunk_rows: 10,
                    max_waves: None,
                    target_wave_seconds: 0.0,
                    min_headroom_hours: None,
                })
                .await
                .expect("rest");
        }
        run_now(config.clone()).await;
        apply(&lab).await;
        assert_in_step(&lab, &format!("case {case} ({mode:?}, {mix:?})")).await;
    }
}

/// How many add actions in silver's log carry a deletion vector.
fn adds_with_vectors(lab: &Lab) -> usize {
    let log = std::path::Path::new(&lab.lake("silver_orders")).join("_delta_log");
    let mut marked = 0;
    for entry in std::fs::read_dir(log).expect("log") {
        let path = entry.expect("entry").path();
        if path
            .extension()
            .is_some_and(|extension| extension == "json")
        {
            let text = std::fs::read_to_string(&path).expect("commit");
            for line in text.lines() {
                let action: serde_json::Value = serde_json::from_str(line).expect("action");
                marked += usize::from(action["add"]["deletionVector"].is_object());
            }
        }
    }
    marked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_workloads_merged_with_deletion_vectors_end_in_step() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        std::env::var("SILVER_PROPERTY_SEED")
            .ok()
            .and_then(|seed| seed.parse().ok())
            .unwrap_or(20_261_205),
    );
    for case in 0..2u64 {
        let lab = Lab::new().await;
        // The table grows (few deletes), so later rounds change a fraction of its rows.
        let mix = Mix {
            insert: rng.random_range(0.4..0.6),
            update: rng.random_range(0.1..0.4),
            delete: rng.random_range(0.0..0.1),
            key_update: rng.random_range(0.0..0.1),
            idle: 0.05,
        };
        workload(&lab, 3_000 + case, rng.random_range(300..500), mix);
        let mut config = stream_config(&lab);
        if case == 1 {
            snapshot::bootstrap(&mut config, SnapshotMode::Full)
                .await
                .expect("bootstrap");
        }
        let vectors = ApplyConfig {
            deletion_vectors: true,
            ..apply_config(&lab, true)
        };
        run_now(config.clone()).await;
        apply_changes(&vectors).await.expect("first apply");
        // Files of a few KiB are not small then: merges mark them instead of folding them.
        set_target_file_size(&lab, 1024).await;
        for round in 0..4u64 {
            workload(
                &lab,
                4_000 + case * 10 + round,
                rng.random_range(5..30),
                mix,
            );
            run_now(config.clone()).await;
            apply_changes(&vectors).await.expect("apply");
            assert_in_step(&lab, &format!("case {case} round {round} ({mix:?})")).await;
        }
        assert!(
            adds_with_vectors(&lab) > 0,
            "case {case}: no row was marked"
        );
        // Reconcile reads silver through delta-rs' scan, which applies the vectors: every
        // bucket matches, row by row too.
        let checked = mssql_cdc_writer::reconcile::reconcile(&ReconcileConfig {
            bucket_rows: 50,
            sample: 1.0,
            seed: Some(5),
            ..ReconcileConfig::new(
                &lab.url,
                "dbo.orders",
                &lab.lake("silver_orders"),
                &lab.lake("bronze_orders"),
                &lab.lake("control"),
            )
        })
        .await
        .expect("reconcile");
        assert!(checked.buckets > 0);
        assert_eq!(checked.matched, checked.buckets, "case {case}");
    }
}

/// Reads every remaining wave of the open snapshot.
async fn read_all(snapshots: &Snapshots, options: &BackfillOptions) {
    let status = snapshots.backfill(options).await.expect("backfill");
    assert!(status.done, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resnapshot_rebuilds_silver_after_the_table_was_emptied_and_refilled() {
    let lab = Lab::new().await;
    workload(&lab, 31, 150, churn());
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let options = BackfillOptions {
        chunk_rows: 25,
        max_waves: None,
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    };
    read_all(&snapshots, &options).await;
    run_now(config.clone()).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "after the bootstrap").await;
    let error = snapshots.open_resnapshot().await.expect_err("nothing new");
    assert!(error.to_string().contains("no commit since"), "{error}");

    // Every row deleted; silver learns it from the re-snapshot alone (the stream has not
    // run since), which has no rows at all: only its completion row says so.
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(32);
    while writer.row_count(&orders) > 0 {
        let mut transaction = writer.begin();
        let keys = transaction.random_keys(&orders, 64).expect("keys");
        transaction.delete(&orders, &keys).expect("delete");
        transaction.commit().expect("commit");
    }
    writer.publish().expect("publish");
    drop(writer);
    let emptied = snapshots.open_resnapshot().await.expect("re-snapshot");
    read_all(&snapshots, &options).await;
    let outcome = apply(&lab).await;
    assert!(outcome.rebuilt, "the resnapshot row rebuilds silver");
    assert!(
        silver_rows(&lab).await.is_empty(),
        "an empty re-snapshot empties silver"
    );
    assert_in_step(&lab, "after the empty re-snapshot").await;
    run_now(config.clone()).await;
    assert!(!apply(&lab).await.rebuilt);
    assert_in_step(
        &lab,
        "the deletes streamed after the rebuild change nothing",
    )
    .await;

    // Refilled, re-snapshotted again (generation 2), then streamed on.
    workload(&lab, 33, 120, churn());
    let refilled = snapshots.open_resnapshot().await.expect("re-snapshot");
    assert!(refilled > emptied);
    read_all(&snapshots, &options).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "after the second re-snapshot").await;
    workload(&lab, 34, 60, churn());
    run_now(config.clone()).await;
    assert!(!apply(&lab).await.rebuilt);
    assert_in_step(&lab, "changes merged after it").await;
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(state.status.snapshot, Some(refilled));
    assert_eq!(state.status.state, "done", "{state:?}");
}

/// A gap the stream never sees: 25 keys deleted, then inserts, updates and deletes, all
/// purged by cleanup, then changes after the purge. Returns the keys deleted first.
async fn purged_gap(lab: &Lab, seed: u64) -> Vec<i64> {
    use mssql_cdc_flight::source::CdcSource;
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(seed);
    let mut transaction = writer.begin();
    let deleted = transaction.random_keys(&orders, 25).expect("keys");
    transaction.delete(&orders, &deleted).expect("delete");
    transaction.commit().expect("commit");
    common::run_orders_workload(&mut writer, 60, churn());
    drop(writer);
    let cut = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
    lab.db.cleanup(None, cut).expect("cleanup past the stream");
    workload(lab, seed + 1, 40, churn());
    deleted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_while_a_chunked_snapshot_is_open_is_healed_by_a_newer_generation() {
    let lab = Lab::new().await;
    workload(&lab, 56, 150, churn());
    let mut config = stream_config(&lab);
    config.on_data_loss = mssql_cdc_writer::data_loss::OnDataLoss::Resnapshot;
    let (first, snapshots) = chunked_bootstrap(&mut config).await;
    snapshots.backfill(&ONE_WAVE).await.expect("a wave");
    run_now(config.clone()).await;
    apply(&lab).await;
    purged_gap(&lab, 57).await;
    run_now(config.clone()).await;
    let state = snapshot::state(&config).await.expect("state");
    let second = state.status.snapshot.expect("open");
    assert!(
        second > first,
        "a newer generation supersedes the broken snapshot"
    );
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "healed by the newer generation").await;
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(
        (state.status.snapshot, state.status.state.as_str()),
        (Some(second), "done")
    );
}

/// A purge met while a snapshot that is not a heal is open past it (here a switch's
/// bootstrap) is healed by that snapshot: its completion is then a `resnapshot` row carrying
/// the gap from the `data_loss` row, as the seed's readers look for a heal's gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_healed_by_a_snapshot_already_open_completes_it_as_a_resnapshot_with_the_gap() {
    let (lab, config, snapshots) = streaming_healing_purges(66).await;
    purged_gap(&lab, 67).await;
    let open = snapshots
        .open_on_switch(7)
        .await
        .expect("a switch's snapshot");
    run_now(config.clone()).await;
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(
        state.status.snapshot,
        Some(open),
        "the open snapshot heals the purge"
    );
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    let completed = common::query(
        &lab.lake("facts"),
        &format!(
            "SELECT event, CAST(lost_to_ts AS BIGINT) AS lost_to FROM t WHERE min_lsn = '{open}' \
             AND event IN ('bootstrap', 'resnapshot')"
        ),
    )
    .await;
    assert_eq!(
        common::text(&completed[0], 0, 0).as_deref(),
        Some("resnapshot")
    );
    assert!(common::text(&completed[0], 1, 0).is_some(), "the gap's end");
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "healed by the snapshot already open").await;
}

/// The seed's anti-loop guard: a second purge met within `resnapshot_interval_days` of the
/// first heal stops the table, naming the setting (a rerun stops again: nothing was opened);
/// the operator's rerun with the guard at 0 heals it; a guard shorter than the time since the
/// last heal lets it heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_purge_within_the_resnapshot_interval_stops_until_the_guard_is_lifted() {
    let lab = Lab::new().await;
    workload(&lab, 58, 150, churn());
    let mut config = stream_config(&lab);
    config.on_data_loss = mssql_cdc_writer::data_loss::OnDataLoss::Resnapshot;
    run_now(config.clone()).await;
    purged_gap(&lab, 59).await;
    run_now(config.clone()).await; // the first purge heals
    let opened = snapshot::state(&config)
        .await
        .expect("state")
        .status
        .snapshot;
    assert!(opened.is_some(), "the first purge opened a re-snapshot");
    purged_gap(&lab, 61).await;
    for _ in 0..2 {
        match common::try_run_now(config.clone()).await {
            Err(WriterError::ResnapshotRefused { message, .. }) => {
                assert!(message.contains("resnapshot_interval_days"), "{message}")
            }
            other => panic!("the guard stops a second heal within 7 days: {other:?}"),
        }
        let state = snapshot::state(&config).await.expect("state");
        assert_eq!(state.status.snapshot, opened, "no re-snapshot opened");
    }
    let mut lifted = config.clone();
    lifted.resnapshot_interval_days = Some(0.0);
    run_now(lifted).await;
    let healed = snapshot::state(&config)
        .await
        .expect("state")
        .status
        .snapshot;
    assert!(healed > opened, "the rerun with the guard at 0 heals");
    // The guard back at its default: the runs after the heal go on.
    run_now(config.clone()).await;
    let mut schedule = config.clone();
    schedule.on_data_loss = mssql_cdc_writer::data_loss::OnDataLoss::Fail;
    schedule.resnapshot_interval_days = Some(30.0);
    let error = common::try_run_now(schedule)
        .await
        .expect_err("the old meaning");
    assert!(
        error.to_string().contains("resnapshot_every_days"),
        "{error}"
    );
    purged_gap(&lab, 63).await;
    let mut short = config.clone();
    short.resnapshot_interval_days = Some(1e-9);
    run_now(short).await;
    let again = snapshot::state(&config)
        .await
        .expect("state")
        .status
        .snapshot;
    assert!(again > healed, "past a shorter interval the purge heals");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skipping_purged_changes_abandons_the_open_chunked_snapshot() {
    let lab = Lab::new().await;
    workload(&lab, 58, 150, churn());
    let mut config = stream_config(&lab);
    let (first, snapshots) = chunked_bootstrap(&mut config).await;
    snapshots.backfill(&ONE_WAVE).await.expect("a wave");
    run_now(config.clone()).await;
    apply(&lab).await;
    purged_gap(&lab, 59).await;
    let mut skipping = config.clone();
    skipping.fail_on_data_loss = false;
    run_now(skipping.clone()).await;
    let events: Vec<String> = common::facts_batches(&lab)
        .await
        .into_iter()
        .filter_map(|row| row.2)
        .collect();
    assert!(events.contains(&"data_skipped".to_string()), "{events:?}");
    assert!(
        events.contains(&"snapshot_abandoned".to_string()),
        "{events:?}"
    );
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(
        (state.status.snapshot, state.status.state.as_str()),
        (Some(first), "abandoned")
    );
    let status = snapshots.backfill(&WHOLE).await.expect("backfill");
    assert_eq!(
        status.state, "no_snapshot",
        "an abandoned snapshot is never read again"
    );
    apply(&lab).await;
    // A new snapshot (generation 1) replaces it, and silver is whole again.
    let second = snapshots.open_resnapshot().await.expect("open");
    assert!(second > first);
    read_all(&snapshots, &WHOLE).await;
    run_now(skipping).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "after the snapshot that replaced the abandoned one").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_mid_stream_heals_by_resnapshot_and_silver_ends_equal_to_the_source() {
    let (lab, config, snapshots) = streaming_healing_purges(51).await;
    assert_in_step(&lab, "before the gap").await;
    let deleted = purged_gap(&lab, 52).await;
    // The stream meets the purge, opens a re-snapshot at S and resumes at S.
    let outcomes = run_now(config.clone()).await;
    assert!(!outcomes.is_empty());
    let facts = common::facts_batches(&lab).await;
    assert_eq!(
        facts
            .iter()
            .filter(|row| row.2.as_deref() == Some("data_loss"))
            .count(),
        1,
        "one data_loss row names the gap: {facts:?}"
    );
    let state = snapshot::state(&config).await.expect("state");
    let resnapshot = state.status.snapshot.expect("a re-snapshot is open");
    assert_eq!(state.status.state, "open", "{state:?}");
    assert_eq!(outcomes[0].start.lsn, resnapshot, "the stream resumed at S");
    // Changes after S stream on while the waves are read; silver follows both.
    workload(&lab, 54, 40, churn());
    run_now(config.clone()).await;
    snapshots.backfill(&ONE_WAVE).await.expect("a wave");
    apply(&lab).await;
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    assert!(
        apply(&lab).await.rebuilt,
        "the re-snapshot's completion rebuilds silver"
    );
    let (silver, source) = (silver_rows(&lab).await, source_rows(&lab).await);
    let gone: Vec<&i64> = deleted
        .iter()
        .filter(|key| !source.contains_key(key))
        .collect();
    assert!(!gone.is_empty(), "the gap deleted keys for good");
    assert!(
        gone.iter().all(|key| !silver.contains_key(key)),
        "keys deleted in the gap left silver"
    );
    assert_in_step(&lab, "healed").await;
    let kinds = common::query(
        &lab.lake("facts"),
        &format!(
            "SELECT event, detail FROM t WHERE event IN ('snapshot_open', 'snapshot_plan', \
             'resnapshot') AND min_lsn = '{resnapshot}' ORDER BY event"
        ),
    )
    .await;
    let events = common::utf8(kinds[0].column(0));
    let details = common::utf8(kinds[0].column(1));
    assert_eq!(kinds[0].num_rows(), 3, "an open, a plan and a completion");
    assert_eq!(events.value(0), "resnapshot");
    // The seed's payloads: the open says why (a re-snapshot healing a purge, with the lost
    // range's times), the plan the extent's kind and keys, the completion rows and last_lsn.
    let open: serde_json::Value = serde_json::from_str(details.value(1)).expect("json");
    assert_eq!(
        (open["kind"].as_str(), open["reason"].as_str()),
        (Some("resnapshot"), Some("data_loss")),
        "{open}"
    );
    assert!(open["lost_to_ts"].is_string(), "{open}");
    let plan: serde_json::Value = serde_json::from_str(details.value(2)).expect("json");
    assert_eq!(
        (plan["kind"].as_str(), plan["keys"][0].as_str()),
        (Some("int"), Some("order_id")),
        "{plan}"
    );
    let done: serde_json::Value = serde_json::from_str(details.value(0)).expect("json");
    assert!(
        done["rows"].is_u64() && done["last_lsn"].as_str() >= Some(resnapshot.to_string().as_str()),
        "{done}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_resnapshot_wave_deletes_the_keys_its_chunks_lack() {
    let lab = Lab::new().await;
    workload(&lab, 41, 150, churn());
    let mut config = stream_config(&lab);
    let (_, snapshots) = chunked_bootstrap(&mut config).await;
    read_all(&snapshots, &WHOLE).await;
    run_now(config.clone()).await;
    apply(&lab).await;
    assert_in_step(&lab, "after the bootstrap").await;

    // Rows deleted while no stream runs (as in a purged gap), then a re-snapshot.
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(42);
    let mut transaction = writer.begin();
    let deleted = transaction.random_keys(&orders, 30).expect("keys");
    transaction.delete(&orders, &deleted).expect("delete");
    transaction.commit().expect("commit");
    writer.publish().expect("publish");
    drop(writer);
    let resnapshot = snapshots.open_resnapshot().await.expect("re-snapshot");
    let status = snapshots.backfill(&ONE_WAVE).await.expect("wave 1");
    assert!(!status.done, "{status:?}");
    let outcome = apply(&lab).await;
    assert!(!outcome.rebuilt);

    // The ranges wave 1 read, from the plans table.
    let plans = common::query(
        &format!("{}_snapshot_plans", lab.lake("bronze_orders")),
        &format!(
            "SELECT detail FROM t WHERE event = 'snapshot_chunk' AND snapshot = '{resnapshot}'"
        ),
    )
    .await;
    let mut ranges = Vec::new();
    for batch in &plans {
        let details = common::utf8(batch.column(0));
        for row in 0..batch.num_rows() {
            let detail: serde_json::Value =
                serde_json::from_str(details.value(row)).expect("detail");
            if detail["wave"] == 1 {
                ranges.push((detail["lo"].as_i64(), detail["hi"].as_i64()));
            }
        }
    }
    assert!(!ranges.is_empty());
    let read = |key: i64| {
        ranges
            .iter()
            .any(|(lo, hi)| lo.is_none_or(|lo| key >= lo) && hi.is_none_or(|hi| key < hi))
    };
    let silver = silver_rows(&lab).await;
    let (inside, outside): (Vec<i64>, Vec<i64>) = deleted.iter().partition(|key| read(**key));
    assert!(
        !inside.is_empty(),
        "some deleted keys lie in wave 1's chunks"
    );
    for key in &inside {
        assert!(!silver.contains_key(key), "key {key} deleted by wave 1");
    }
    for key in &outside {
        assert!(silver.contains_key(key), "key {key} waits for its own wave");
    }
    let source = source_rows(&lab).await;
    for (key, values) in &silver {
        if !outside.contains(key) {
            assert_eq!(source.get(key), Some(values), "key {key}");
        }
    }
    // The other waves delete the rest; the completion rebuilds to the same rows.
    read_all(&snapshots, &WHOLE).await;
    assert!(apply(&lab).await.rebuilt);
    assert_in_step(&lab, "after the re-snapshot completed").await;
}

/// Silver's data files, by path.
async fn silver_files(lab: &Lab) -> std::collections::BTreeSet<String> {
    let url = mssql_cdc_writer::tables::table_url(&lab.lake("silver_orders")).expect("url");
    let table = mssql_cdc_writer::tables::open(&url)
        .await
        .expect("open silver")
        .expect("silver exists");
    table
        .snapshot()
        .expect("snapshot")
        .log_data()
        .iter()
        .map(|file| file.path().to_string())
        .collect()
}

/// Sets silver's target file size (its files below an eighth of it are small).
async fn set_target_file_size(lab: &Lab, bytes: i64) {
    let url = mssql_cdc_writer::tables::table_url(&lab.lake("silver_orders")).expect("url");
    mssql_cdc_writer::tables::open(&url)
        .await
        .expect("open silver")
        .expect("silver exists")
        .set_tbl_properties()
        .with_properties(std::collections::HashMap::from([(
            "delta.targetFileSize".to_string(),
            bytes.to_string(),
        )]))
        .await
        .expect("set the target file size");
}

/// Commits what `change` does in one transaction; the keys it returns.
fn commit(
    writer: &mut mssql_cdc_flight::sim::SimWriter,
    change: &dyn Fn(&mut mssql_cdc_flight::sim::Transaction<'_>) -> Vec<i64>,
) -> Vec<i64> {
    let mut tx = writer.begin();
    let keys = change(&mut tx);
    tx.commit().expect("commit");
    writer.publish().expect("publish");
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_rewrites_only_the_files_holding_a_changed_key() {
    let lab = Lab::new().await;
    let table: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(7);
    let config = lab.config();
    let older = commit(&mut writer, &|tx| tx.insert(&table, 2_000).expect("insert"));
    run_now(config.clone()).await;
    apply(&lab).await;
    let first = silver_files(&lab).await;
    assert_eq!(first.len(), 1, "the first call's rows in one file");
    // Files of this size are not small (no compaction): each stays as it is unless it holds
    // a changed key.
    let url = mssql_cdc_writer::tables::table_url(&lab.lake("silver_orders")).expect("url");
    let size = mssql_cdc_writer::tables::open(&url)
        .await
        .expect("open")
        .expect("silver")
        .snapshot()
        .expect("snapshot")
        .log_data()
        .iter()
        .map(|file| file.size())
        .sum::<i64>();
    set_target_file_size(&lab, 2 * size).await;
    // New keys go to a new file; no file holds them, so none is rewritten.
    let newer = commit(&mut writer, &|tx| tx.insert(&table, 2_000).expect("insert"));
    run_now(config.clone()).await;
    apply(&lab).await;
    let second = silver_files(&lab).await;
    assert!(
        second.len() > 1 && second.is_superset(&first),
        "the older file stays"
    );
    assert_in_step(&lab, "after the inserts").await;
    // An update and a delete of the newer keys rewrite only the files holding them.
    commit(&mut writer, &|tx| {
        tx.update(&table, &newer[..3]).expect("update");
        tx.delete(&table, &newer[3..5]).expect("delete");
        Vec::new()
    });
    run_now(config.clone()).await;
    apply(&lab).await;
    let third = silver_files(&lab).await;
    assert!(
        third.is_superset(&first),
        "the file of the older keys stays"
    );
    assert!(
        third.intersection(&second).count() < second.len(),
        "the newer keys' file rewritten"
    );
    assert_in_step(&lab, "after the updates of newer keys").await;
    // A delete of an older key rewrites that file and leaves the newer ones.
    commit(&mut writer, &|tx| {
        tx.delete(&table, &older[..1]).expect("delete");
        Vec::new()
    });
    run_now(config.clone()).await;
    apply(&lab).await;
    let fourth = silver_files(&lab).await;
    assert!(fourth.is_disjoint(&first), "the older keys' file rewritten");
    let newer_files: std::collections::BTreeSet<String> =
        third.difference(&first).cloned().collect();
    assert!(
        fourth.is_superset(&newer_files),
        "the newer keys' files stay"
    );
    assert_in_step(&lab, "after the delete of an older key").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_files_are_folded_into_one_by_the_next_merge() {
    let lab = Lab::new().await;
    let table: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("table");
    let mut writer = lab.writer(8);
    let config = lab.config();
    commit(&mut writer, &|tx| tx.insert(&table, 300).expect("insert"));
    run_now(config.clone()).await;
    apply(&lab).await;
    // Files this small (the default target is far larger) are folded together by every
    // call that writes images: a cadence of calls leaves one file, not one per call.
    for round in 0..4 {
        commit(&mut writer, &|tx| {
            let updated = tx.random_keys(&table, 5).expect("keys");
            tx.update(&table, &updated).expect("update");
            tx.insert(&table, 20).expect("insert")
        });
        run_now(config.clone()).await;
        apply(&lab).await;
        assert_eq!(silver_files(&lab).await.len(), 1, "round {round}");
        assert_in_step(&lab, &format!("round {round}")).await;
    }
    // Several small files (written by another writer) are folded even by a call of deletes.
    set_target_file_size(&lab, 1).await;
    commit(&mut writer, &|tx| tx.insert(&table, 20).expect("insert"));
    run_now(config.clone()).await;
    apply(&lab).await;
    assert_eq!(silver_files(&lab).await.len(), 2, "two files, none small");
    set_target_file_size(&lab, 100 * 1024 * 1024).await;
    commit(&mut writer, &|tx| {
        let deleted = tx.random_keys(&table, 3).expect("keys");
        tx.delete(&table, &deleted).expect("delete");
        Vec::new()
    });
    run_now(config.clone()).await;
    apply(&lab).await;
    assert_eq!(silver_files(&lab).await.len(), 1, "folded by deletes");
    assert_in_step(&lab, "after the deletes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_without_later_changes_stamps_the_position_at_its_lsn() {
    let lab = Lab::new().await;
    workload(&lab, 31, 120, churn());
    let mut config = stream_config(&lab);
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap")
        .expect("a full snapshot");
    run_now(config.clone()).await;
    let first = apply(&lab).await;
    assert!(first.rebuilt);
    assert_eq!(
        first.applied_lsn,
        Some(snapshot),
        "no change after S: the position is S itself"
    );
    assert_in_step(&lab, "rebuilt from the snapshot alone").await;
    // The changes after S merge from there; none before S comes back.
    workload(&lab, 32, 60, churn());
    run_now(config.clone()).await;
    let second = apply(&lab).await;
    assert!(!second.rebuilt && second.applied_lsn > Some(snapshot));
    assert_in_step(&lab, "changes after S merged").await;
}

/// Rows of bronze committed at or before `until` that silver's position does not cover.
async fn bronze_rows_past(lab: &Lab, until: mssql_cdc_flight::CommitTime, applied: &str) -> i64 {
    let until = chrono::DateTime::from_timestamp_micros(until.0)
        .expect("time")
        .format("%Y-%m-%dT%H:%M:%S%.6f");
    let batches = common::query(
        &lab.lake("bronze_orders"),
        &format!(
            "SELECT COUNT(*) FROM t WHERE _operation <> 0 AND _commit_ts <= \
             CAST('{until}' AS TIMESTAMP) AND _start_lsn > '{applied}'"
        ),
    )
    .await;
    common::text(&batches[0], 0, 0)
        .expect("count")
        .parse()
        .expect("integer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_verdict_never_covers_a_batch_committed_during_the_call() {
    let lab = Lab::new().await;
    workload(&lab, 41, 60, churn());
    let config = stream_config(&lab);
    run_now(config.clone()).await;
    apply(&lab).await;
    // The stream commits batches while apply_changes runs, again and again: whatever batch
    // lands between the verdict's read and bronze's pinning, silver's verdict may only cover
    // changes it applied (the verdict is read first, so it can lag, never lead).
    let streaming = {
        let config = config.clone();
        // A minute per commit: the verdict (truncated to the minute) moves with every batch.
        let mut writer = lab
            .db
            .writer(
                mssql_cdc_flight::sim::Clock::Virtual {
                    step_micros: 60_000_000,
                },
                42,
            )
            .expect("writer");
        writer.set_journal(&lab.journal()).expect("journal");
        tokio::spawn(async move {
            for _ in 0..12 {
                common::run_orders_workload(&mut writer, 10, churn());
                run_now(config.clone()).await;
            }
        })
    };
    let mut checked = 0;
    while !streaming.is_finished() {
        let outcome = apply(&lab).await;
        if let (Some(until), Some(applied)) = (outcome.finalized_until, outcome.applied_lsn) {
            assert_eq!(
                bronze_rows_past(&lab, until, &applied.to_string()).await,
                0,
                "silver's verdict {until:?} covers rows past its position {applied}"
            );
            checked += 1;
        }
    }
    streaming.await.expect("stream");
    let last = apply(&lab).await;
    assert_eq!(last.finalized_until, bronze_verdict(&lab).await);
    assert_in_step(&lab, "after the stream stopped").await;
    assert!(checked > 2, "{checked} calls checked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_memory_not_a_number_or_too_small_is_refused_by_name() {
    let lab = Lab::new().await;
    workload(&lab, 51, 20, churn());
    run_now(lab.config()).await;
    let config = apply_config(&lab, true);
    let run = |memory: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
            .args([
                "apply",
                "--table",
                &config.table,
                "--bronze",
                &config.bronze,
                "--target",
                &config.target,
                "--keys",
                "order_id",
                "--control",
                &config.control,
            ])
            .env(mssql_cdc_writer::silver::QUERY_MEMORY_VARIABLE, memory)
            .output()
            .expect("run the CLI")
    };
    let output = run("lots");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("MSSQL_CDC_WRITER_QUERY_MEMORY_MIB=lots"),
        "{stderr}"
    );
    assert!(
        mssql_cdc_writer::tables::open(
            &mssql_cdc_writer::tables::table_url(&config.target).expect("url")
        )
        .await
        .expect("open")
        .is_none(),
        "nothing written"
    );
    // Too little memory for the ranking: refused naming the variable, no row written.
    let output = run("1");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("set MSSQL_CDC_WRITER_QUERY_MEMORY_MIB above 1 MiB"),
        "{stderr}"
    );
    let position = control::row(
        &mssql_cdc_writer::tables::table_url(&config.control).expect("url"),
        &config.target,
    )
    .await
    .expect("control");
    assert!(position.is_none_or(|row| row.position.applied_lsn.is_none()));
    assert!(silver_rows_if_any(&config.target).await.is_empty());
    // With the default, the same call succeeds.
    apply(&lab).await;
    assert_in_step(&lab, "with the default query memory").await;
}

/// Silver's rows, none when it does not exist.
async fn silver_rows_if_any(location: &str) -> Rows {
    let url = mssql_cdc_writer::tables::table_url(location).expect("url");
    match mssql_cdc_writer::tables::open(&url).await.expect("open") {
        Some(_) => common::current_rows(location).await,
        None => Rows::new(),
    }
}
