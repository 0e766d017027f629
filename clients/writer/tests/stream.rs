//! The writer end to end: a simulated database, the Flight server on 127.0.0.1:0, and real
//! Delta tables in a temporary directory.

mod common;

use std::sync::atomic::AtomicBool;

use arrow::array::{Array, Int64Array};
use common::{Lab, bronze_rows, facts_batches, query, run_now, try_run_now, utf8};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::Clock;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::checkpoint::Checkpoint;
use mssql_cdc_writer::control::{self, Granularity};
use mssql_cdc_writer::schema_policy::SchemaChangePolicy;
use mssql_cdc_writer::stream::StreamConfig;
use mssql_cdc_writer::tables::{self, SCHEMA_VERSION_KEY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn available_now_writes_every_change_once_with_facts_and_verdict() {
    let lab = Lab::new().await;
    lab.workload(1, 300);
    let mut config = lab.config();
    config.max_commits = Some(120);
    let outcomes = run_now(config.clone()).await;
    assert!(
        outcomes.len() >= 3,
        "capped at 120 commits per batch: {} batches",
        outcomes.len()
    );
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        lab.committed(),
        "every committed change exactly once"
    );
    // Each batch after the first was planned while the one before streamed, and its plan
    // was used as it was (its range had not grown: the run stops at the max_lsn it found).
    let ahead: Vec<bool> = outcomes
        .iter()
        .map(|outcome| outcome.planned_ahead)
        .collect();
    let mut expected = vec![true; outcomes.len()];
    expected[0] = false;
    assert_eq!(ahead, expected);
    let facts = facts_batches(&lab).await;
    let ids: Vec<i64> = facts.iter().map(|row| row.0).collect();
    assert_eq!(
        ids,
        (0..outcomes.len() as i64).collect::<Vec<_>>(),
        "one facts row per batch"
    );
    assert_eq!(
        facts.iter().map(|row| row.1).sum::<i64>() as usize,
        lab.committed().len()
    );
    // The verdict: the last end's commit time truncated to the minute, after the data.
    let end = outcomes.last().expect("a batch").end;
    let verdict = control::finalized_until(
        &tables::table_url(&lab.lake("control")).expect("url"),
        "dbo.orders",
    )
    .await
    .expect("verdict");
    assert_eq!(
        verdict,
        Some(Granularity::Minute.truncate(end.commit_ts.expect("time")))
    );
    // Tables carry their schema version and comments.
    let bronze = tables::open(&tables::table_url(&lab.lake("bronze_orders")).expect("url"))
        .await
        .expect("open")
        .expect("bronze");
    assert_eq!(tables::schema_version(&bronze).expect("version"), 2);
    let schema = bronze.snapshot().expect("snapshot").schema();
    let field = schema.field("_start_lsn").expect("_start_lsn");
    assert!(field.metadata().contains_key("comment"));
    let facts_table = tables::open(&tables::table_url(&lab.lake("facts")).expect("url"))
        .await
        .expect("open")
        .expect("facts");
    assert_eq!(
        facts_table
            .snapshot()
            .expect("snapshot")
            .table_config()
            .unknown_properties
            .get(SCHEMA_VERSION_KEY)
            .map(String::as_str),
        Some("13")
    );
    // Nothing new: another run writes nothing.
    let again = run_now(config).await;
    assert!(again.is_empty());
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), lab.committed());
}

/// The checkpoint's last batch marked not committed, as a crash after its commits but before
/// the checkpoint said so leaves it: the next run replays it. (The commit mark is the file
/// `commits/<batch id>.json` of the checkpoint, docs/writer.md.)
async fn uncommit_last_batch(
    config: &StreamConfig,
) -> (Checkpoint, mssql_cdc_writer::checkpoint::BatchRecord) {
    let checkpoint = Checkpoint::open(&config.checkpoint)
        .await
        .expect("checkpoint");
    let last = checkpoint.last().await.expect("read").expect("a batch");
    let mark = std::path::Path::new(&config.checkpoint)
        .join("commits")
        .join(format!("{:020}.json", last.batch_id));
    std::fs::remove_file(mark).expect("remove the commit mark");
    let uncommitted = checkpoint.last().await.expect("read").expect("a batch");
    assert!(!uncommitted.committed);
    (checkpoint, uncommitted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_batch_is_not_written_twice() {
    let lab = Lab::new().await;
    lab.workload(2, 100);
    let config = lab.config();
    run_now(config.clone()).await;
    let before = bronze_rows(&lab).await.expect("bronze");
    // A crash after the commits but before the checkpoint said so: the batch is replayed.
    let (_, last) = uncommit_last_batch(&config).await;
    let outcomes = run_now(config).await;
    assert!(outcomes[0].replayed);
    assert_eq!(outcomes[0].batch_id, last.batch_id);
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        before,
        "Delta's transaction id made the replay a no-op"
    );
    assert_eq!(
        facts_batches(&lab).await.len(),
        (last.batch_id + 1) as usize
    );
}

/// A busy table adds a small bronze file with every batch; its stream compacts them as it
/// goes, next to maintenance passes compacting the same table. Bronze keeps every change
/// once, silver applied from it equals the source, and a batch replayed after a compaction
/// finds its commit behind the compaction's and writes nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_stream_compacts_bronze_as_it_goes_and_loses_nothing() {
    use mssql_cdc_writer::maintenance::{self, AUTO_COMPACT_FILES, MaintenanceOptions};
    use mssql_cdc_writer::tables::TableKind;

    let lab = Lab::new().await;
    common::orders_workload(&lab, 7, 240, common::churn());
    let mut config = lab.config();
    config.max_commits = Some(3);
    let bronze = lab.lake("bronze_orders");
    let options = MaintenanceOptions {
        min_files: 2,
        ..MaintenanceOptions::default()
    };
    let maintaining = {
        let (bronze, options) = (bronze.clone(), options.clone());
        tokio::spawn(async move {
            let mut passes = 0;
            for _ in 0..10 {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                if maintenance::maintain(&bronze, TableKind::Bronze, &options)
                    .await
                    .expect("maintain")
                    .is_some()
                {
                    passes += 1;
                }
            }
            passes
        })
    };
    // The batches next to the passes, then alone: bronze's live files after each alone.
    let mut stream = mssql_cdc_writer::stream::Stream::connect(config.clone())
        .await
        .expect("connect");
    let (mut batches, mut alone, mut most_files) = (0, 0, 0);
    loop {
        let passes_over = maintaining.is_finished();
        if stream.run_batch(None).await.expect("batch").is_none() {
            break;
        }
        batches += 1;
        if passes_over {
            alone += 1;
            let table = common::open_table(&bronze).await;
            let files = table.snapshot().expect("snapshot").log_data().num_files();
            most_files = most_files.max(files);
        }
    }
    drop(stream);
    assert!(maintaining.await.expect("maintenance task") > 0);
    assert!(
        alone > AUTO_COMPACT_FILES + 8,
        "{alone} of {batches} batches ran alone"
    );
    assert!(
        most_files <= AUTO_COMPACT_FILES + 2,
        "{most_files} live bronze files while the stream ran alone"
    );
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        lab.committed(),
        "every committed change exactly once"
    );
    assert_eq!(facts_batches(&lab).await.len(), batches);
    mssql_cdc_writer::silver::apply_changes(&common::orders_apply_config(&lab))
        .await
        .expect("apply");
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        common::source_rows(&lab).await,
        "silver applied from the compacted bronze equals the source"
    );
    // A compaction after the last batch's commit, then that batch replayed: its commit is
    // found behind the compaction's, and nothing is written twice.
    let before = bronze_rows(&lab).await.expect("bronze");
    let done = maintenance::maintain(&bronze, TableKind::Bronze, &options)
        .await
        .expect("maintain")
        .expect("bronze");
    assert!(done.compacted > 0, "{done:?}");
    let (_, last) = uncommit_last_batch(&config).await;
    let outcomes = run_now(config).await;
    assert!(outcomes[0].replayed);
    assert_eq!(outcomes[0].batch_id, last.batch_id);
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), before);
    assert_eq!(facts_batches(&lab).await.len(), batches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_after_cleanup_purged_its_range_finishes_without_the_source() {
    let lab = Lab::new().await;
    lab.workload(2, 100);
    let config = lab.config();
    run_now(config.clone()).await;
    let before = bronze_rows(&lab).await.expect("bronze");
    let facts_before = facts_batches(&lab).await;
    let (_, last) = uncommit_last_batch(&config).await;
    // Cleanup up to the batch's last commit: its range can no longer be planned or read.
    lab.db.cleanup(None, last.end.lsn).expect("cleanup");
    for fail_on_data_loss in [true, false] {
        let mut replaying = config.clone();
        replaying.fail_on_data_loss = fail_on_data_loss;
        let outcomes = run_now(replaying).await;
        assert_eq!(
            outcomes.len(),
            1,
            "only the replay: nothing new was committed"
        );
        assert!(outcomes[0].replayed);
        let recorded = facts_before
            .iter()
            .find(|(id, _, event)| *id == last.batch_id && event.is_none())
            .map(|(_, rows, _)| *rows as u64);
        assert_eq!(
            Some(outcomes[0].rows),
            recorded,
            "the rows the facts recorded"
        );
        drop(uncommit_last_batch(&config).await);
    }
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), before);
    assert_eq!(
        facts_batches(&lab).await,
        facts_before,
        "no data_skipped row, no facts row twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_range_bronze_holds_otherwise_is_refused_as_a_second_writer() {
    let lab = Lab::new().await;
    lab.workload(3, 100);
    let config = lab.config();
    run_now(config.clone()).await;
    let before = bronze_rows(&lab).await.expect("bronze");
    // A second writer's checkpoint: the same batch id, planned over another range.
    let (checkpoint, mut last) = uncommit_last_batch(&config).await;
    let claimed = last.clone();
    last.end = last.start;
    checkpoint.amend(&claimed, &last).await.expect("amend");
    let error = try_run_now(config).await.expect_err("refused");
    assert!(
        matches!(error, WriterError::CheckpointMismatch(_)),
        "{error}"
    );
    assert!(error.to_string().contains("another writer"), "{error}");
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        before,
        "nothing written"
    );
}

/// The capture job's idle entries: three, two minutes apart, and no changes.
fn idle_six_minutes(lab: &Lab) {
    let mut writer = lab
        .db
        .writer(
            Clock::Virtual {
                step_micros: 120_000_000,
            },
            4,
        )
        .expect("writer");
    for _ in 0..3 {
        writer.idle();
    }
    writer.publish().expect("publish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_batches_move_the_verdict_without_rows() {
    let lab = Lab::new().await;
    lab.workload(3, 50);
    let config = lab.config();
    run_now(config.clone()).await;
    let control_url = tables::table_url(&lab.lake("control")).expect("url");
    let first = control::finalized_until(&control_url, "dbo.orders")
        .await
        .expect("verdict")
        .expect("some");
    idle_six_minutes(&lab);
    let outcomes = run_now(config).await;
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].rows, 0);
    let second = control::finalized_until(&control_url, "dbo.orders")
        .await
        .expect("verdict")
        .expect("some");
    assert!(
        second > first,
        "idle entries six minutes later move the verdict: {first:?} -> {second:?}"
    );
    let facts = facts_batches(&lab).await;
    assert_eq!(
        facts.last().map(|row| (row.1, row.2.clone())),
        Some((0, None)),
        "a facts row with 0 rows"
    );
    assert!(
        control::is_final(&control_url, "dbo.orders", first)
            .await
            .expect("is_final")
    );
}

/// One running stream's batches: the verdict each returns is control's, whether the batch
/// moved it or ended in a period the stream's last verdict covers (and skipped the MERGE);
/// idle entries six minutes later still move it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_stream_returns_controls_verdict_and_moves_it_when_its_period_passes() {
    let lab = Lab::new().await;
    lab.workload(3, 50);
    let mut config = lab.config();
    config.max_commits = Some(2);
    let mut stream = mssql_cdc_writer::stream::Stream::connect(config)
        .await
        .expect("connect");
    let control_url = tables::table_url(&lab.lake("control")).expect("url");
    let verdict = || async {
        control::finalized_until(&control_url, "dbo.orders")
            .await
            .expect("verdict")
    };
    let mut batches = 0;
    let mut last = None;
    while let Some(outcome) = stream.run_batch(None).await.expect("batch") {
        assert_eq!(
            outcome.verdict,
            verdict().await,
            "batch {}",
            outcome.batch_id
        );
        assert!(outcome.verdict >= last, "the verdict never goes back");
        last = outcome.verdict;
        batches += 1;
    }
    assert!(batches > 2, "{batches} batches");
    idle_six_minutes(&lab);
    let moved = stream
        .run_batch(None)
        .await
        .expect("batch")
        .expect("the idle entries' batch");
    assert!(moved.verdict > last, "{last:?} -> {:?}", moved.verdict);
    assert_eq!(moved.verdict, verdict().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_table_follows_max_lsn_so_cleanup_up_to_its_last_run_never_strands_it() {
    let lab = Lab::new().await;
    lab.workload(15, 40);
    let quiet = StreamConfig {
        table: "dbo.customers".into(),
        target: lab.lake("bronze_customers"),
        app_id: "customers".into(),
        checkpoint: lab
            .dir
            .path()
            .join("checkpoint_customers")
            .display()
            .to_string(),
        ..lab.config()
    };
    run_now(quiet.clone()).await;
    let control_url = tables::table_url(&lab.lake("control")).expect("url");
    let mut verdict = control::finalized_until(&control_url, "dbo.customers")
        .await
        .expect("verdict");
    for round in 0..3u64 {
        // Only dbo.orders changes, then the capture job's idle entries, six minutes apart.
        let mut writer = lab.writer(16 + round);
        common::run_orders_workload(
            &mut writer,
            30,
            mssql_cdc_flight::sim::workload::Mix::default(),
        );
        writer.idle();
        writer.publish().expect("publish");
        drop(writer);
        let before = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
        let outcomes = run_now(quiet.clone()).await;
        assert!(
            outcomes.iter().all(|outcome| outcome.rows == 0),
            "round {round}: the quiet table has no rows to read"
        );
        assert_eq!(
            outcomes.last().map(|outcome| outcome.end.lsn),
            Some(before),
            "round {round}: its offset follows max_lsn without rows"
        );
        // Retention passes everything the writer has read: cleanup up to its offset.
        lab.db.cleanup(None, before).expect("cleanup");
        let now = control::finalized_until(&control_url, "dbo.customers")
            .await
            .expect("verdict");
        assert!(now >= verdict, "round {round}: the verdict never goes back");
        verdict = now;
    }
    lab.workload(19, 20);
    run_now(quiet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lake_restored_behind_the_checkpoint_is_refused() {
    let lab = Lab::new().await;
    lab.workload(17, 40);
    let config = lab.config();
    run_now(config.clone()).await;
    let facts = std::path::PathBuf::from(lab.lake("facts"));
    let backup = lab.dir.path().join("facts_backup");
    copy_dir(&facts, &backup);
    lab.workload(18, 40);
    run_now(config.clone()).await;
    // The facts table restored from the older backup: its last batches are gone.
    std::fs::remove_dir_all(&facts).expect("remove");
    copy_dir(&backup, &facts);
    let error = try_run_now(config).await.expect_err("refused");
    assert!(
        matches!(error, WriterError::CheckpointMismatch(_)),
        "{error}"
    );
    assert!(error.to_string().contains("restored behind"), "{error}");
}

/// Copies a directory tree (a Delta table) file by file.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("dir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_checkpoint_is_refused() {
    let lab = Lab::new().await;
    lab.workload(5, 40);
    let config = lab.config();
    run_now(config.clone()).await;
    std::fs::remove_dir_all(&config.checkpoint).expect("delete checkpoint");
    lab.workload(6, 10);
    let error = try_run_now(config).await.expect_err("refused");
    assert!(
        matches!(error, WriterError::CheckpointMismatch(_)),
        "{error}"
    );
    assert!(error.to_string().contains("deleted or rewound"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purged_changes_stop_the_stream_or_are_skipped_with_an_event() {
    let lab = Lab::new().await;
    lab.workload(7, 100);
    let cut = lab
        .db
        .nth_commit_after(Lsn::ZERO, 60)
        .await
        .expect("nth")
        .expect("commit");
    lab.db.cleanup(None, cut).expect("cleanup");
    let config = lab.config();
    // earliest starts at min_lsn, so the first batch is whole; purge again past its end.
    run_now(config.clone()).await;
    lab.workload(8, 100);
    lab.purge_to_max_lsn(9)
        .await
        .expect("a purge past the stream");
    let error = try_run_now(config.clone()).await.expect_err("loss");
    assert!(matches!(error, WriterError::DataLoss { .. }), "{error}");
    assert!(
        error.to_string().contains("re-snapshot"),
        "names the fix: {error}"
    );
    let mut skipping = config;
    skipping.fail_on_data_loss = false;
    run_now(skipping).await;
    let facts = facts_batches(&lab).await;
    assert!(
        facts
            .iter()
            .any(|row| row.2.as_deref() == Some("data_skipped")),
        "{facts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_skipped_past_a_purge_and_then_broken_keeps_its_data_skipped_row_on_replay() {
    // Before the fix the replay planned the amended range, which no longer met the purge,
    // and wrote the batch without its data_skipped row.
    let lab = Lab::new().await;
    lab.workload(7, 60);
    let config = lab.config();
    run_now(config.clone()).await;
    lab.workload(8, 100);
    lab.purge_to_max_lsn(9)
        .await
        .expect("a purge past the stream");
    lab.workload(10, 30);
    let mut skipping = config;
    skipping.fail_on_data_loss = false;
    // The batch is amended past the purge, then its read breaks as a dropped connection.
    lab.db.set_faults(mssql_cdc_flight::sim::Faults {
        drop_connection_after_rows: Some(3),
        ..mssql_cdc_flight::sim::Faults::default()
    });
    let broken = try_run_now(skipping.clone()).await;
    assert!(broken.is_err(), "the read broke: {broken:?}");
    let amended = Checkpoint::open(&skipping.checkpoint)
        .await
        .expect("checkpoint")
        .last()
        .await
        .expect("last")
        .expect("a batch");
    assert!(!amended.committed, "the broken batch is left to replay");
    assert_eq!(amended.events.len(), 1, "{amended:?}");
    run_now(skipping).await;
    let skipped: Vec<_> = facts_batches(&lab)
        .await
        .into_iter()
        .filter(|row| row.2.as_deref() == Some("data_skipped"))
        .collect();
    assert_eq!(
        skipped.len(),
        1,
        "one data_skipped row, written by the replay"
    );
    assert_eq!(skipped[0].0, amended.batch_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_change_policy_fail_stops_at_a_switch_with_nothing_written() {
    let lab = Lab::new().await;
    lab.workload(13, 60);
    let mut config = lab.config();
    config.schema_change_policy = SchemaChangePolicy::Fail;
    run_now(config.clone()).await;
    let (bronze, facts) = (bronze_rows(&lab).await, facts_batches(&lab).await);
    let mut writer = common::add_discount_and_switch(&lab, 14);
    common::run_orders_workload(
        &mut writer,
        40,
        mssql_cdc_flight::sim::workload::Mix::default(),
    );
    drop(writer);
    let error = try_run_now(config.clone()).await.expect_err("stopped");
    assert!(matches!(error, WriterError::SchemaChanged(_)), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("schema_change") || message.contains("capture_instance_switched"),
        "{message}"
    );
    assert!(message.contains("evolve"), "names the way on: {message}");
    assert_eq!(
        bronze_rows(&lab).await,
        bronze,
        "nothing of the batch in bronze"
    );
    assert_eq!(facts_batches(&lab).await, facts, "nor in the facts");
    config.schema_change_policy = SchemaChangePolicy::Evolve;
    run_now(config).await;
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        lab.committed(),
        "evolve goes on"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_instance_switch_adds_the_new_column_and_its_events() {
    let lab = Lab::new().await;
    lab.workload(11, 60);
    let config = lab.config();
    run_now(config.clone()).await;
    let mut writer = common::add_discount_and_switch(&lab, 12);
    let spec = WorkloadSpec {
        commits: Some(60),
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("after");
    drop(writer);
    run_now(config).await;
    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        lab.committed(),
        "every change once across the switch"
    );
    let discounts = query(
        &lab.lake("bronze_orders"),
        "SELECT _capture_instance, COUNT(discount) AS n, COUNT(*) AS total FROM t GROUP BY _capture_instance ORDER BY 1",
    )
    .await;
    let batch = &discounts[0];
    let names = utf8(batch.column(0));
    let counts = batch
        .column(1)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("count");
    assert_eq!(
        (names.value(0), counts.value(0)),
        ("dbo_orders", 0),
        "older rows read NULL"
    );
    assert_eq!(names.value(1), "dbo_orders_v2");
    assert!(
        counts.value(1) > 0,
        "the newer instance's rows carry the new column"
    );
    let mut events: Vec<String> = facts_batches(&lab)
        .await
        .into_iter()
        .filter_map(|row| row.2)
        .collect();
    events.sort();
    assert_eq!(
        events,
        [
            "capture_instance_switched",
            "columns_added",
            "schema_change"
        ],
        "one event row each, in the batch's facts"
    );
}

/// Creates a bronze table at `location` holding only `column` typed `data_type`.
async fn bronze_with(location: &str, column: &str, data_type: deltalake::kernel::DataType) {
    let url = tables::table_url(location).expect("url");
    tables::ensure(
        &url,
        tables::TableKind::Bronze,
        vec![tables::field_with_comment(
            column,
            data_type,
            "made by the test",
        )],
        "bronze",
    )
    .await
    .expect("bronze");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_bronze_holds_wider_is_cast_and_one_it_cannot_hold_stops_the_stream() {
    let lab = Lab::new().await;
    lab.workload(13, 30);

    // customer_id (int) into a bronze that holds it as bigint: cast, every change written.
    let mut wider = lab.config();
    bronze_with(
        &wider.target,
        "customer_id",
        deltalake::kernel::DataType::LONG,
    )
    .await;
    wider.checkpoint = lab
        .dir
        .path()
        .join("checkpoint_wider")
        .display()
        .to_string();
    run_now(wider.clone()).await;
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), lab.committed());
    let table = tables::open(&tables::table_url(&wider.target).expect("url"))
        .await
        .expect("open")
        .expect("bronze");
    let schema = table.snapshot().expect("snapshot").schema();
    assert_eq!(
        schema.field("customer_id").expect("column").data_type(),
        &deltalake::kernel::DataType::LONG,
        "bronze keeps its wider type"
    );

    // status (varchar) into a bronze that holds it as bigint: stopped, naming the column.
    let mut narrower = lab.config();
    narrower.target = lab.lake("bronze_status_as_bigint");
    narrower.app_id = "orders_status".into();
    narrower.checkpoint = lab
        .dir
        .path()
        .join("checkpoint_narrower")
        .display()
        .to_string();
    bronze_with(
        &narrower.target,
        "status",
        deltalake::kernel::DataType::LONG,
    )
    .await;
    let error = try_run_now(narrower.clone())
        .await
        .expect_err("a string does not fit a bigint");
    assert!(matches!(error, WriterError::SchemaChanged(_)), "{error}");
    let message = error.to_string();
    assert!(message.contains("'status'"), "{message}");
    assert!(message.contains("a new bronze target"), "{message}");
    let written = query(&narrower.target, "SELECT COUNT(*) FROM t").await;
    let count = written[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("count")
        .value(0);
    assert_eq!(
        count, 0,
        "nothing appended to the bronze that cannot hold it"
    );
    let facts = query(
        &lab.lake("facts"),
        "SELECT COUNT(*) FROM t WHERE app_id = 'orders_status'",
    )
    .await;
    let facts_rows = facts[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("count")
        .value(0);
    assert_eq!(facts_rows, 0, "no facts row for the refused batch");
}

/// A batch the server plans in more endpoints than the stream has readers: each reader
/// takes the next endpoint no reader took as it finishes one, into the files it keeps for
/// the batch, so every row lands once in one file per reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_more_endpoints_than_readers_lands_every_row_once_in_a_file_per_reader() {
    let lab = Lab::new().await;
    let orders: mssql_cdc_flight::source::TableName = "dbo.orders".parse().expect("name");
    let mut writer = lab.writer(7);
    for _ in 0..240 {
        let mut transaction = writer.begin();
        transaction.insert(&orders, 1_000).expect("insert");
        transaction.commit().expect("commit");
    }
    writer.publish().expect("publish");
    let config = lab.config();
    assert_eq!(config.partitions, 2);
    let outcomes = run_now(config).await;
    assert_eq!(outcomes.len(), 1, "one batch: no max_commits");
    let batch = &outcomes[0];
    assert_eq!(batch.rows, 240_000);

    // The range as the stream planned it (2 readers, 4 endpoints each at most): the server
    // cuts it into tiles of at least 50,000 rows, more endpoints than readers.
    let client = mssql_cdc_flight::client::CdcClient::connect(&lab.url)
        .await
        .expect("client");
    let mut command = mssql_cdc_proto::protocol::ChangesCommand::new(
        "dbo.orders".to_string(),
        batch.start.lsn,
        Some(batch.end.lsn),
    );
    command.partitions = Some(8);
    let plan = client.plan_changes(&command).await.expect("plan");
    assert!(
        plan.info.endpoint.len() >= 3,
        "{} endpoints",
        plan.info.endpoint.len()
    );

    assert_eq!(
        bronze_rows(&lab).await.expect("bronze"),
        lab.committed(),
        "every committed change exactly once"
    );
    let bronze = tables::open(&tables::table_url(&lab.lake("bronze_orders")).expect("url"))
        .await
        .expect("open")
        .expect("bronze");
    assert_eq!(
        bronze.snapshot().expect("snapshot").log_data().num_files(),
        2,
        "one file per reader"
    );
}

/// Commits `commits` transactions of the workload to `table` alone.
fn workload_on(lab: &Lab, seed: u64, table: &str, commits: u64) {
    let mut writer = lab.writer(seed);
    let spec = WorkloadSpec {
        commits: Some(commits),
        tables: vec![table.parse().expect("table name")],
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
}

/// How many change rows bronze `bronze_<name>` holds.
async fn bronze_count(lab: &Lab, name: &str) -> usize {
    let location = lab.lake(&format!("bronze_{name}"));
    let url = tables::table_url(&location).expect("url");
    if tables::open(&url).await.expect("open").is_none() {
        return 0;
    }
    let rows = tables::query_text(&url, "SELECT count(*) FROM t")
        .await
        .expect("count");
    rows[0][0]
        .as_deref()
        .expect("count")
        .parse()
        .expect("number")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_table_streamed_with_max_commits_beside_a_busy_one_keeps_up() {
    // Before the fix a capped range holding nothing of dbo.customers was asked for again on
    // every poll: the 5 later commits never reached bronze.
    let lab = Lab::new().await;
    workload_on(&lab, 1, "dbo.customers", 3);
    workload_on(&lab, 2, "dbo.orders", 400);
    workload_on(&lab, 3, "dbo.customers", 5);
    let mut config = lab.stream_of("dbo.customers", "customers");
    config.max_commits = Some(50);
    let mut stream = mssql_cdc_writer::stream::Stream::connect(config)
        .await
        .expect("connect");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let waiting = mssql_cdc_writer::tail::Waiting {
        poll: std::time::Duration::from_millis(100),
        live_tail: false,
    };
    let running = tokio::spawn(async move { stream.run_continuous(waiting, stopped).await });
    let expected = lab.committed_of("dbo.customers").len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while bronze_count(&lab, "customers").await < expected && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    stop.send(true).expect("stop");
    running.await.expect("task").expect("stream");
    assert_eq!(
        bronze_count(&lab, "customers").await,
        expected,
        "every change of the quiet table, its later commits past 400 of the busy one included"
    );
}
