//! Snapshots into bronze against the in-process server and real Delta tables: a chunked
//! snapshot read in waves next to a running stream and a writing workload, a full bootstrap,
//! the mode lock, the throttle, and a crash between a wave's append and its facts rows. End
//! state every time: bronze's rows of S plus the changes after S rebuild the source table.

mod common;

use std::process::Command;

use arrow::record_batch::RecordBatch;
use common::{Lab, Rows, query, run_now, source_rows, text};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::Faults;
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::CRASH_AT_VARIABLE;

const WRITER: &str = env!("CARGO_BIN_EXE_mssql-cdc-writer");

/// The rebuild rule of ADR 0028 on the lab's bronze_orders (see `common::rebuild`).
async fn rebuild(lab: &Lab, snapshot: Lsn) -> Rows {
    common::rebuild(&lab.lake("bronze_orders"), snapshot, "order_id").await
}

/// `(event, detail)` of every facts row of the lab's app id with an event.
async fn facts_events(lab: &Lab) -> Vec<(String, String)> {
    let batches = query(
        &lab.lake("facts"),
        "SELECT event, detail FROM t WHERE event IS NOT NULL ORDER BY written_at, event",
    )
    .await;
    let mut events = Vec::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            events.push((
                text(batch, 0, row).expect("event"),
                text(batch, 1, row).unwrap_or_default(),
            ));
        }
    }
    events
}

fn options(chunk_rows: u64, max_waves: Option<u32>) -> BackfillOptions {
    BackfillOptions {
        chunk_rows,
        max_waves,
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_snapshot_read_next_to_a_running_stream_rebuilds_the_table() {
    let lab = Lab::new().await;
    lab.workload(21, 300);
    let mut config = lab.config();
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("a new checkpoint is bootstrapped");
    assert_eq!(
        config.starting,
        snapshot.to_string(),
        "the stream starts at S"
    );
    lab.workload(22, 40);
    run_now(config.clone()).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let first = snapshots
        .backfill(&options(25, Some(1)))
        .await
        .expect("wave 1");
    assert!(!first.done && first.chunks_done > 0, "{first:?}");
    let total = first.chunks_total.expect("planned");
    assert!(total > 4, "{total} chunks");

    // Rows inserted, updated and deleted between waves, and a commit landing between a
    // chunk's stamp and its read.
    lab.workload(23, 60);
    let writer = common::commit_during_next_snapshot_read(&lab, "dbo.orders", 24);
    let second = snapshots
        .backfill(&options(9_999, Some(1)))
        .await
        .expect("wave 2");
    lab.db.set_faults(Faults::default());
    assert!(
        writer.lock().expect("lock").take().is_none(),
        "the hook committed inside the wave's read"
    );
    assert_eq!(
        second.chunks_total,
        Some(total),
        "the plan of the first call stays"
    );
    assert!(second.chunks_done > first.chunks_done);
    run_now(config.clone()).await;
    lab.workload(25, 60);
    let done = snapshots.backfill(&options(25, None)).await.expect("rest");
    assert!(done.done && done.chunks_done == total, "{done:?}");
    run_now(config.clone()).await;

    assert_eq!(rebuild(&lab, snapshot).await, source_rows(&lab).await);
    let events = facts_events(&lab).await;
    let count = |name: &str| events.iter().filter(|(event, _)| event == name).count();
    assert_eq!(count("snapshot_open"), 1);
    assert_eq!(count("snapshot_plan"), 1);
    assert_eq!(
        count("snapshot_chunk") as u64,
        total,
        "one facts row per chunk"
    );
    assert_eq!(count("bootstrap"), 1, "one completion row");
    let (_, open) = events
        .iter()
        .find(|(event, _)| event == "snapshot_open")
        .expect("open row");
    assert!(
        !open.contains("\"min\""),
        "no key values in the facts: {open}"
    );
    let plans = query(
        &snapshot::plans_location(&lab.lake("bronze_orders")),
        "SELECT event, COUNT(*) FROM t GROUP BY event ORDER BY event",
    )
    .await;
    let plan_counts: Vec<(String, String)> = (0..plans[0].num_rows())
        .map(|row| {
            (
                text(&plans[0], 0, row).expect("event"),
                text(&plans[0], 1, row).expect("count"),
            )
        })
        .collect();
    assert_eq!(
        plan_counts,
        [
            ("snapshot_chunk".to_string(), total.to_string()),
            ("snapshot_open".to_string(), "1".to_string()),
            ("snapshot_plan".to_string(), "1".to_string()),
        ]
    );
    let again = snapshots
        .backfill(&options(60, None))
        .await
        .expect("after done");
    assert!(again.done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_stream_broken_mid_wave_commits_nothing_of_the_wave_and_the_rerun_reads_it_once() {
    let lab = Lab::new().await;
    lab.workload(26, 300);
    let mut config = lab.config();
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("a new checkpoint is bootstrapped");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    // Waves of one round (2 chunks); each reader opens its next chunk's stream while reading
    // one. The fourth chunk stream breaks after its first batch: wave 2 fails, wave 1 stays.
    lab.db.set_faults(Faults {
        break_snapshot_read_after: Some(3),
        ..Faults::default()
    });
    let broken = snapshots
        .backfill(&options(25, None))
        .await
        .expect_err("a broken chunk stream fails the wave");
    assert!(broken.to_string().contains("dropped"), "{broken}");
    lab.db.set_faults(Faults::default());
    let snapshot_rows = || async {
        let batches = query(
            &lab.lake("bronze_orders"),
            &format!(
                "SELECT COUNT(*), COUNT(DISTINCT _chunk), COUNT(DISTINCT order_id) FROM t \
                 WHERE _snapshot = '{snapshot}'"
            ),
        )
        .await;
        (0..3)
            .map(|column| text(&batches[0], column, 0).expect("count"))
            .collect::<Vec<_>>()
    };
    let after_failure = snapshot_rows().await;
    assert_eq!(
        after_failure[1], "2",
        "only wave 1's two chunks are in bronze: {after_failure:?}"
    );
    let chunk_rows_in_facts = facts_events(&lab)
        .await
        .iter()
        .filter(|(event, _)| event == "snapshot_chunk")
        .count();
    assert_eq!(chunk_rows_in_facts, 2, "facts rows of wave 1 only");

    run_now(config.clone()).await;
    let done = snapshots.backfill(&options(25, None)).await.expect("rerun");
    assert!(done.done, "{done:?}");
    let total = done.chunks_total.expect("planned");
    let counts = snapshot_rows().await;
    assert_eq!(counts[0], counts[2], "no snapshot row twice: {counts:?}");
    assert_eq!(counts[1], total.to_string(), "every chunk once: {counts:?}");
    assert_eq!(
        facts_events(&lab)
            .await
            .iter()
            .filter(|(event, _)| event == "snapshot_chunk")
            .count() as u64,
        total
    );
    run_now(config.clone()).await;
    assert_eq!(rebuild(&lab, snapshot).await, source_rows(&lab).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_opening_a_resnapshot_at_once_take_one_generation() {
    use mssql_cdc_flight::sim::Clock;
    use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let lab = Lab::new().await;
    lab.workload(61, 80);
    let mut config = lab.config();
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    // Commits land all the time and every source call is slow, so the two opens read the
    // record before either writes and stamp different S: a race for each generation.
    let stop = Arc::new(AtomicBool::new(false));
    let mut writer = lab.db.writer(Clock::Wall, 62).expect("sim writer");
    writer.set_journal(&lab.journal()).expect("journal");
    let flag = Arc::clone(&stop);
    let commits = std::thread::spawn(move || {
        let spec = WorkloadSpec {
            commits: None,
            rate: Some(300.0),
            publish_interval: std::time::Duration::from_millis(5),
            ..WorkloadSpec::default()
        };
        workload::run(&mut writer, &spec, &flag).expect("workload");
    });
    lab.db.set_faults(Faults {
        latency: std::time::Duration::from_millis(40),
        ..Faults::default()
    });
    let (first, second) = (
        Snapshots::connect(config.clone()).await.expect("connect"),
        Snapshots::connect(config.clone()).await.expect("connect"),
    );
    let whole = BackfillOptions {
        chunk_rows: 50,
        max_waves: None,
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    };
    for generation in 1..=3 {
        let (a, b) = tokio::join!(first.open_resnapshot(), second.open_resnapshot());
        let (a, b) = (a.expect("open"), b.expect("open"));
        assert_eq!(
            a, b,
            "generation {generation}: both take the one snapshot opened"
        );
        let opens = facts_events(&lab)
            .await
            .into_iter()
            .filter(|(event, _)| event == "snapshot_open")
            .count();
        assert_eq!(
            opens,
            generation + 1,
            "one open per generation, the bootstrap's too"
        );
        let status = first.backfill(&whole).await.expect("backfill");
        assert!(status.done, "{status:?}");
    }
    stop.store(true, Ordering::Relaxed);
    commits.join().expect("workload thread");
    lab.db.set_faults(Faults::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_resnapshot_is_a_new_generation_and_silver_is_rebuilt_from_it() {
    let lab = Lab::new().await;
    lab.workload(63, 80);
    let mut config = lab.config();
    let first = snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap")
        .expect("taken");
    run_now(config.clone()).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let error = snapshots.resnapshot_full().await.expect_err("nothing new");
    assert!(error.to_string().contains("no commit since"), "{error}");
    common::orders_workload(&lab, 64, 60, common::churn());
    let second = snapshots.resnapshot_full().await.expect("resnapshot");
    assert!(second.snapshot > first && !second.reused, "{second:?}");
    let events: Vec<(String, String)> = facts_events(&lab).await;
    let kinds: Vec<&str> = events.iter().map(|(event, _)| event.as_str()).collect();
    assert_eq!(
        kinds,
        ["snapshot_open", "bootstrap", "snapshot_open", "resnapshot"],
        "generation 1 opens and completes as a re-snapshot"
    );
    assert!(events[2].1.contains("\"generation\":1"), "{}", events[2].1);
    common::orders_workload(&lab, 65, 30, common::churn());
    run_now(config.clone()).await;
    assert_eq!(
        rebuild(&lab, second.snapshot).await,
        source_rows(&lab).await
    );
    let applied = mssql_cdc_writer::silver::apply_changes(&common::orders_apply_config(&lab))
        .await
        .expect("apply");
    assert!(applied.rebuilt, "the resnapshot row rebuilds silver");
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        source_rows(&lab).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_bootstrap_is_read_once_and_the_stream_starts_after_it() {
    let lab = Lab::new().await;
    lab.workload(31, 200);
    let mut config = lab.config();
    let snapshot = snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap")
        .expect("taken");
    lab.workload(32, 80);
    run_now(config.clone()).await;
    let rerun = Snapshots::connect(config.clone())
        .await
        .expect("connect")
        .bootstrap_full()
        .await
        .expect("rerun");
    assert!(rerun.reused, "a rerun finds the snapshot");
    assert_eq!(rerun.snapshot, snapshot);
    let held = query(
        &lab.lake("bronze_orders"),
        "SELECT COUNT(*) FROM t WHERE _operation = 0",
    )
    .await;
    assert_eq!(
        text(&held[0], 0, 0).expect("count"),
        rerun.rows.to_string(),
        "read once"
    );
    assert_eq!(rebuild(&lab, snapshot).await, source_rows(&lab).await);
    let events = facts_events(&lab).await;
    assert_eq!(
        events
            .iter()
            .map(|(event, _)| event.as_str())
            .collect::<Vec<_>>(),
        ["snapshot_open", "bootstrap"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_snapshot_mode_at_a_time_and_backfill_waits_for_headroom() {
    let lab = Lab::new().await;
    lab.workload(41, 50);
    let config = lab.config();
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let none = snapshots
        .backfill(&options(50, None))
        .await
        .expect("nothing open");
    assert_eq!(none.state, "no_snapshot");
    let snapshot = snapshots.open_chunked().await.expect("open");
    assert_eq!(
        snapshots.open_chunked().await.expect("again"),
        snapshot,
        "opened once"
    );
    let locked = snapshots.bootstrap_full().await.expect_err("mode lock");
    assert!(locked.to_string().contains("backfill"), "{locked}");
    let mut throttled = options(50, None);
    throttled.min_headroom_hours = Some(1.0);
    let waiting = snapshots.backfill(&throttled).await.expect("throttle");
    assert_eq!(
        (waiting.state.as_str(), waiting.paused),
        ("waiting_metrics", true)
    );
    lab.workload(42, 20);
    let mut stream = config.clone();
    stream.starting = snapshot.to_string();
    run_now(stream).await;
    throttled.min_headroom_hours = Some(1e9);
    let waiting = snapshots.backfill(&throttled).await.expect("throttle");
    assert_eq!(waiting.state, "waiting_headroom", "{waiting:?}");
    throttled.min_headroom_hours = None;
    assert!(snapshots.backfill(&throttled).await.expect("read").done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_left_open_by_a_crash_holds_its_mode_until_a_rerun_completes_it() {
    let lab = Lab::new().await;
    lab.workload(71, 60);
    let config = lab.config();
    crash_after_a_full_open(&lab).await;
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let locked = snapshots.open_chunked().await.expect_err("mode lock");
    assert!(locked.to_string().contains("--bootstrap full"), "{locked}");
    let full = snapshots.bootstrap_full().await.expect("rerun");
    assert!(!full.reused && full.rows > 0, "{full:?}");
    let events = facts_events(&lab).await;
    assert_eq!(
        events
            .iter()
            .map(|(event, _)| event.as_str())
            .collect::<Vec<_>>(),
        ["snapshot_open", "bootstrap"],
        "the rerun kept the open's S"
    );
    let mut stream = config.clone();
    stream.starting = full.snapshot.to_string();
    lab.workload(72, 30);
    run_now(stream).await;
    assert_eq!(rebuild(&lab, full.snapshot).await, source_rows(&lab).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_left_open_by_a_crash_is_released_once_cleanup_passes_its_s() {
    use mssql_cdc_flight::source::CdcSource;
    let lab = Lab::new().await;
    lab.workload(73, 60);
    let config = lab.config();
    crash_after_a_full_open(&lab).await;
    lab.workload(74, 30);
    let cut = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
    lab.db.cleanup(None, cut).expect("cleanup past the open S");
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    let chunked = snapshots
        .open_chunked()
        .await
        .expect("the lock is released");
    let events: Vec<String> = facts_events(&lab)
        .await
        .into_iter()
        .map(|(event, _)| event)
        .collect();
    assert_eq!(
        events,
        ["snapshot_open", "snapshot_abandoned", "snapshot_open"]
    );
    let state = snapshot::state(&config).await.expect("state");
    assert_eq!(
        (state.status.snapshot, state.status.state.as_str()),
        (Some(chunked), "open")
    );
}

/// Runs the writer binary with a full bootstrap that aborts right after its open.
async fn crash_after_a_full_open(lab: &Lab) {
    let config = lab.config();
    let crashed = tokio::task::spawn_blocking({
        let mut command = Command::new(WRITER);
        command
            .args(["run", "--server", &lab.url, "--table", "dbo.orders"])
            .args(["--target", &config.target, "--facts", &config.facts])
            .args([
                "--app-id",
                &config.app_id,
                "--available-now",
                "--bootstrap",
                "full",
            ])
            .args(["--checkpoint", &config.checkpoint])
            .env("RUST_LOG", "warn")
            .env(CRASH_AT_VARIABLE, "after_snapshot_open");
        move || command.output().expect("run")
    })
    .await
    .expect("join");
    assert!(!crashed.status.success(), "aborted after the open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_a_waves_append_and_its_facts_rows_reruns_the_wave_once() {
    let lab = Lab::new().await;
    lab.workload(51, 250);
    let config = lab.config();
    let backfill = |crash: Option<&str>| {
        let mut command = Command::new(WRITER);
        command
            .args(["backfill", "--server", &lab.url, "--table", "dbo.orders"])
            .args(["--target", &config.target, "--facts", &config.facts])
            .args(["--app-id", &config.app_id, "--chunk-rows", "40"])
            .args(["--target-wave-seconds", "0"])
            .env("RUST_LOG", "warn");
        command.env_remove(CRASH_AT_VARIABLE);
        if let Some(step) = crash {
            command.env(CRASH_AT_VARIABLE, step);
        }
        command
    };
    let snapshot = Snapshots::connect(config.clone())
        .await
        .expect("connect")
        .open_chunked()
        .await
        .expect("open");
    let crashed = tokio::task::spawn_blocking({
        let mut command = backfill(Some("after_wave_bronze:2"));
        move || command.output().expect("run")
    })
    .await
    .expect("join");
    assert!(
        !crashed.status.success(),
        "the writer aborted after wave 2's append"
    );
    // Wave 3 was being read while wave 2 committed: its chunks were recorded first, so the
    // rerun reads exactly them after finishing wave 2.
    let recorded_next = query(
        &format!("{}_snapshot_plans", config.target),
        "SELECT detail FROM t WHERE event = 'snapshot_chunk' AND detail LIKE '%\"wave\":3%'",
    )
    .await;
    assert!(
        recorded_next
            .iter()
            .map(RecordBatch::num_rows)
            .sum::<usize>()
            > 0,
        "wave 3 was read ahead"
    );
    lab.workload(52, 40);
    let finished = tokio::task::spawn_blocking({
        let mut command = backfill(None);
        move || command.output().expect("run")
    })
    .await
    .expect("join");
    assert!(
        finished.status.success(),
        "{}",
        String::from_utf8_lossy(&finished.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&finished.stdout).expect("status JSON");
    assert_eq!(status["done"], true, "{status}");
    let duplicates = query(
        &lab.lake("bronze_orders"),
        "SELECT order_id FROM t WHERE _operation = 0 GROUP BY order_id HAVING COUNT(*) > 1",
    )
    .await;
    assert_eq!(
        duplicates.iter().map(RecordBatch::num_rows).sum::<usize>(),
        0,
        "no snapshot row twice"
    );
    let chunk_rows = query(
        &lab.lake("facts"),
        "SELECT COUNT(*), COUNT(DISTINCT detail) FROM t WHERE event = 'snapshot_chunk'",
    )
    .await;
    assert_eq!(
        text(&chunk_rows[0], 0, 0),
        text(&chunk_rows[0], 1, 0),
        "one facts row per chunk"
    );
    let mut stream = config.clone();
    stream.starting = snapshot.to_string();
    run_now(stream).await;
    assert_eq!(rebuild(&lab, snapshot).await, source_rows(&lab).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_bootstraps_its_tables_and_status_shows_the_snapshots() {
    let lab = Lab::new().await;
    lab.workload(61, 200);
    let text = format!(
        "server = \"{}\"\nfacts = \"{}\"\ncontrol = \"{}\"\ncheckpoints = \"{}\"\n\
         \n[[tables]]\ntable = \"dbo.orders\"\ntarget = \"{}\"\napp_id = \"orders\"\n\
         bootstrap = \"chunked\"\nchunk_rows = 30\nsilver = \"{}\"\nkeys = [\"order_id\"]\n\
         \n[[tables]]\ntable = \"dbo.customers\"\ntarget = \"{}\"\napp_id = \"customers\"\n\
         bootstrap = \"full\"\n",
        lab.url,
        lab.lake("facts"),
        lab.lake("control"),
        lab.dir.path().join("checkpoints").display(),
        lab.lake("bronze_orders"),
        lab.lake("silver_orders"),
        lab.lake("bronze_customers"),
    );
    let path = lab.dir.path().join("sidecar.toml");
    std::fs::write(&path, text).expect("config");
    let config = mssql_cdc_writer::sidecar::SidecarConfig::load(&path).expect("config");
    lab.workload(62, 0);
    for (table, result) in mssql_cdc_writer::sidecar::run_available_now(&config).await {
        result.unwrap_or_else(|error| panic!("{table}: {error}"));
    }
    lab.workload(63, 50);
    for (table, result) in mssql_cdc_writer::sidecar::run_available_now(&config).await {
        result.unwrap_or_else(|error| panic!("{table}: {error}"));
    }
    let statuses = mssql_cdc_writer::sidecar::status(&config)
        .await
        .expect("status");
    for status in &statuses {
        let snapshot = status.snapshot.as_ref().expect("a snapshot");
        assert!(snapshot.done, "{}: {snapshot:?}", status.table);
    }
    let orders = statuses
        .iter()
        .find(|status| status.table == "dbo.orders")
        .expect("orders");
    let progress = orders.snapshot.as_ref().expect("snapshot");
    assert_eq!(progress.mode, SnapshotMode::Chunked);
    assert_eq!(Some(progress.chunks_done), progress.chunks_total);
    assert_eq!(
        rebuild(&lab, progress.snapshot).await,
        source_rows(&lab).await,
        "orders rebuilt from its chunked snapshot and stream"
    );
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        source_rows(&lab).await,
        "the sidecar's apply step keeps silver in step"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_pauses_and_resumes_a_chunked_snapshot_from_the_cli() {
    let lab = Lab::new().await;
    lab.workload(61, 200);
    let config = lab.config();
    let writer = |arguments: Vec<String>| {
        let lab_arguments = [
            "--server".to_string(),
            lab.url.clone(),
            "--table".into(),
            "dbo.orders".into(),
            "--target".into(),
            config.target.clone(),
            "--facts".into(),
            config.facts.clone(),
            "--app-id".into(),
            config.app_id.clone(),
        ];
        async move {
            let output = tokio::task::spawn_blocking(move || {
                Command::new(WRITER)
                    .args(&arguments)
                    .args(lab_arguments)
                    .env("RUST_LOG", "warn")
                    .env_remove(CRASH_AT_VARIABLE)
                    .output()
                    .expect("run")
            })
            .await
            .expect("join");
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            serde_json::from_slice::<serde_json::Value>(&output.stdout).expect("JSON")
        }
    };
    let args = |words: &[&str]| {
        words
            .iter()
            .map(|word| word.to_string())
            .collect::<Vec<_>>()
    };
    let opened = writer(args(&["snapshot", "open", "--mode", "chunked"])).await;
    assert_eq!(opened["mode"], "chunked");
    let status = writer(args(&["snapshot", "status"])).await;
    assert_eq!(status["state"], "open", "{status}");
    assert_eq!(status["snapshot"], opened["snapshot"]);

    let paused = writer(args(&[
        "snapshot",
        "pause",
        "--reason",
        "nightly maintenance",
    ]))
    .await;
    assert_eq!(paused["paused"], true);
    let status = writer(args(&["snapshot", "status"])).await;
    assert_eq!(status["state"], "paused", "{status}");
    assert!(
        status["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("nightly maintenance")
    );
    // A backfill in any process stops before its first wave while paused.
    let held = writer(args(&[
        "backfill",
        "--chunk-rows",
        "30",
        "--target-wave-seconds",
        "0",
    ]))
    .await;
    assert_eq!(held["state"], "paused", "{held}");
    assert_eq!(held["paused"], true);
    assert_eq!(held["chunks_done"], 0, "no wave read while paused");
    // Pausing twice records nothing new; resuming lets the backfill finish.
    writer(args(&["snapshot", "pause"])).await;
    let resumed = writer(args(&["snapshot", "resume"])).await;
    assert_eq!(resumed["paused"], false);
    let finished = writer(args(&[
        "backfill",
        "--chunk-rows",
        "30",
        "--target-wave-seconds",
        "0",
    ]))
    .await;
    assert_eq!(finished["done"], true, "{finished}");
    let status = writer(args(&["snapshot", "status"])).await;
    assert_eq!(status["state"], "done", "{status}");
    assert_eq!(status["chunks_done"], status["chunks_total"]);
    let snapshot: Lsn = opened["snapshot"]
        .as_str()
        .expect("lsn")
        .parse()
        .expect("lsn");
    let rebuilt = rebuild(&lab, snapshot).await;
    assert_eq!(
        rebuilt,
        source_rows(&lab).await,
        "bronze rebuilds the table"
    );
    let operator_rows = query(
        &format!("{}_snapshot_plans", config.target),
        "SELECT event FROM t WHERE event IN ('snapshot_pause', 'snapshot_resume')",
    )
    .await;
    assert_eq!(
        operator_rows
            .iter()
            .map(RecordBatch::num_rows)
            .sum::<usize>(),
        2,
        "one pause and one resume recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_started_after_an_operators_bootstrap_starts_at_its_s_and_meets_a_purge() {
    let lab = Lab::new().await;
    lab.workload(91, 60);
    let config = lab.config();
    // An operator opens the table's bootstrap before any stream ran; then the stream runs,
    // not bootstrapped itself (no `bootstrap` setting).
    let opened = snapshot::open(&config, SnapshotMode::Chunked, true)
        .await
        .expect("open");
    let snapshot = opened.status.snapshot.expect("its S");
    lab.workload(92, 30);
    let outcomes = common::try_run_now(config.clone()).await.expect("stream");
    assert_eq!(
        outcomes[0].start.lsn, snapshot,
        "the first batch starts after S"
    );

    // Another table's bootstrap, then a cleanup past its S before its stream first ran: the
    // stream meets the purge (here: fails) instead of starting at the cleanup's low
    // watermark and losing the changes between S and it without a word.
    let purged = Lab::new().await;
    purged.workload(93, 60);
    let config = purged.config();
    snapshot::open(&config, SnapshotMode::Chunked, true)
        .await
        .expect("open");
    purged.workload(94, 30);
    purged.purge_to_max_lsn(95).await.expect("purged");
    let Err(error) = common::try_run_now(config).await else {
        panic!("the stream passed a purge of changes after its bootstrap's S");
    };
    assert!(
        matches!(error, mssql_cdc_writer::WriterError::DataLoss { .. }),
        "{error}"
    );
}
