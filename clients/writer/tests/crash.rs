//! Crash tests: the writer binary aborted at each step boundary, and killed with SIGKILL at
//! random moments under a running workload, restarted each time; in the end every committed
//! change is in bronze exactly once, there is one facts row per batch, and the verdict was
//! never ahead of the data.

mod common;

use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arrow::array::{Array, Int64Array, TimestampMicrosecondArray};
use common::{Lab, bronze_rows, query};
use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::sim::Clock;
use mssql_cdc_flight::sim::values::mix;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_writer::control::{self, Granularity};
use mssql_cdc_writer::stream::CRASH_AT_VARIABLE;
use mssql_cdc_writer::tables;

const WRITER: &str = env!("CARGO_BIN_EXE_mssql-cdc-writer");

fn writer_command(lab: &Lab, available_now: bool) -> Command {
    let config = lab.config();
    let mut command = Command::new(WRITER);
    command
        .args(["run", "--server", &lab.url, "--table", "dbo.orders"])
        .args(["--target", &config.target, "--facts", &config.facts])
        .args(["--control", config.control.as_deref().expect("control")])
        .args(["--app-id", "orders", "--checkpoint", &config.checkpoint])
        .args([
            "--max-commits",
            "40",
            "--granularity",
            "minute",
            "--poll-seconds",
            "0.05",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if available_now {
        command.arg("--available-now");
    }
    command
}

async fn run_writer(lab: &Lab, crash_at: Option<String>) -> ExitStatus {
    let mut command = writer_command(lab, true);
    if let Some(step) = crash_at {
        command.env(CRASH_AT_VARIABLE, step);
    }
    tokio::task::spawn_blocking(move || command.status().expect("run the writer"))
        .await
        .expect("task")
}

/// Facts batch ids (micro-batch rows only) and the latest end commit time they record.
async fn facts_state(lab: &Lab) -> (Vec<i64>, Option<i64>) {
    let url = tables::table_url(&lab.lake("facts")).expect("url");
    if tables::open(&url).await.expect("open").is_none() {
        return (Vec::new(), None);
    }
    let batches = query(
        &lab.lake("facts"),
        "SELECT batch_id, end_commit_ts FROM t WHERE event IS NULL ORDER BY batch_id",
    )
    .await;
    let mut ids = Vec::new();
    let mut latest = None;
    for batch in batches {
        let id = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("bigint")
            .clone();
        let ends = arrow::compute::cast(
            batch.column(1),
            &arrow::datatypes::DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, None),
        )
        .expect("cast");
        let ends = ends
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .expect("times")
            .clone();
        for row in 0..batch.num_rows() {
            ids.push(id.value(row));
            if ends.is_valid(row) {
                latest = latest.max(Some(ends.value(row)));
            }
        }
    }
    (ids, latest)
}

/// What must hold after any crash: no change twice, one facts row per batch, and the verdict
/// not ahead of what the facts say was written.
async fn check_invariants(lab: &Lab) {
    let rows = bronze_rows(lab).await.unwrap_or_default();
    let mut unique = rows.clone();
    unique.dedup();
    assert_eq!(rows.len(), unique.len(), "a change was written twice");
    let committed = lab.committed();
    assert!(
        rows.iter().all(|row| committed.binary_search(row).is_ok()),
        "bronze holds a change never committed"
    );
    let (ids, latest_end) = facts_state(lab).await;
    assert_eq!(
        ids,
        (0..ids.len() as i64).collect::<Vec<_>>(),
        "one facts row per batch, in order"
    );
    let control_url = tables::table_url(&lab.lake("control")).expect("url");
    let verdict = control::finalized_until(&control_url, "dbo.orders")
        .await
        .expect("verdict");
    if let Some(verdict) = verdict {
        let latest = latest_end.expect("a verdict implies facts");
        assert!(
            verdict <= Granularity::Minute.truncate(CommitTime(latest)),
            "verdict ahead of the data"
        );
    }
}

/// Runs the writer to the end without a crash and checks every change landed exactly once.
async fn restart_and_check_exactly_once(lab: &Lab) {
    let status = run_writer(lab, None).await;
    assert!(status.success(), "the restarted writer finishes");
    check_invariants(lab).await;
    assert_eq!(
        bronze_rows(lab).await.unwrap_or_default(),
        lab.committed(),
        "every committed change, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_each_step_boundary_and_restarted_every_change_lands_once() {
    let lab = Lab::new().await;
    lab.workload(21, 300);
    for (step, batch) in [
        ("after_plan", 1),
        ("after_bronze", 2),
        ("after_facts", 3),
        ("after_control", 4),
    ] {
        let status = run_writer(&lab, Some(format!("{step}:{batch}"))).await;
        assert!(!status.success(), "{step}: the writer was meant to die");
        check_invariants(&lab).await;
    }
    restart_and_check_exactly_once(&lab).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_under_a_running_workload() {
    let lab = Lab::new().await;
    lab.workload(31, 50);
    let (stop, workload) = running_workload(&lab, 32, WorkloadSpec::default().mix);
    let mut seed = 7u64;
    for _ in 0..50 {
        seed = mix(seed);
        let mut child = writer_command(&lab, false)
            .spawn()
            .expect("start the writer");
        tokio::time::sleep(Duration::from_millis(50 + seed % 400)).await;
        child.kill().expect("SIGKILL");
        let _ = child.wait();
    }
    stop.store(true, Ordering::Relaxed);
    workload.join().expect("workload thread");
    check_invariants(&lab).await;
    restart_and_check_exactly_once(&lab).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_killed_after_its_bronze_commit_finishes_from_bronze_after_cleanup() {
    let lab = Lab::new().await;
    // Fewer commits than --max-commits: one batch, ending at max_lsn.
    lab.workload(35, 30);
    let status = run_writer(&lab, Some("after_bronze:0".into())).await;
    assert!(!status.success(), "the writer was meant to die");
    let written = bronze_rows(&lab).await.expect("bronze");
    assert_eq!(written, lab.committed(), "bronze holds the whole batch");
    // Cleanup up to the batch's last commit: the replay cannot plan or read the range again.
    let max_lsn = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
    lab.db.cleanup(None, max_lsn).expect("cleanup");
    let status = run_writer(&lab, None).await;
    assert!(status.success(), "the replay finishes from bronze's commit");
    check_invariants(&lab).await;
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), written);
    let facts = query(
        &lab.lake("facts"),
        "SELECT batch_id, rows, min_lsn, max_lsn, event FROM t ORDER BY batch_id",
    )
    .await;
    let facts = arrow::compute::concat_batches(&facts[0].schema(), &facts).expect("concat");
    assert_eq!(facts.num_rows(), 1, "one facts row, no data_skipped event");
    let rows = facts
        .column(1)
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("bigint");
    assert_eq!(
        rows.value(0),
        written.len() as i64,
        "the facts count what bronze holds"
    );
    let lsns = common::utf8(facts.column(2));
    assert!(lsns.is_valid(0), "the commit carried the LSN extent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_with_a_cleanup_past_the_writer_heals_by_resnapshot() {
    let lab = Lab::new().await;
    lab.workload(36, 50);
    let (stop, workload) = running_workload(&lab, 37, common::churn());
    let healing = |available_now: bool| {
        let mut command = writer_command(&lab, available_now);
        command.args(["--on-data-loss", "resnapshot"]);
        command
    };
    let mut seed = 11u64;
    let mut purged_to = None;
    for kill in 0..24 {
        seed = mix(seed);
        let mut child = healing(false).spawn().expect("start the writer");
        tokio::time::sleep(Duration::from_millis(50 + seed % 400)).await;
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        if kill == 8 {
            // The writer is down while retention cleanup purges past its offset.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let cut = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
            lab.db.cleanup(None, cut).expect("cleanup");
            purged_to = Some(cut);
        }
    }
    stop.store(true, Ordering::Relaxed);
    workload.join().expect("workload thread");
    let mut last = healing(true);
    let status = tokio::task::spawn_blocking(move || last.status().expect("run"))
        .await
        .expect("join");
    assert!(status.success(), "the last run finishes");
    let config = lab.config();
    let snapshots = mssql_cdc_writer::snapshot::Snapshots::connect(config.clone())
        .await
        .expect("connect");
    let options = mssql_cdc_writer::snapshot::BackfillOptions {
        chunk_rows: 50,
        max_waves: None,
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    };
    let backfilled = snapshots.backfill(&options).await.expect("backfill");
    assert!(
        backfilled.done,
        "the healing re-snapshot is read: {backfilled:?}"
    );
    let healed_at = backfilled.snapshot.expect("its S");
    assert!(
        Some(healed_at) > purged_to,
        "the re-snapshot is newer than the purge"
    );
    mssql_cdc_writer::silver::apply_changes(&common::orders_apply_config(&lab))
        .await
        .expect("apply");
    // Bronze: no change twice, none never committed, and every change after S once.
    let changes: Vec<_> = bronze_rows(&lab)
        .await
        .expect("bronze")
        .into_iter()
        .filter(|row| row.2 != 0)
        .collect();
    let mut unique = changes.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(changes.len(), unique.len(), "a change was written twice");
    let committed = lab.committed();
    assert!(
        unique
            .iter()
            .all(|row| committed.binary_search(row).is_ok())
    );
    let after: Vec<_> = committed
        .iter()
        .filter(|row| row.0 > healed_at.to_string())
        .cloned()
        .collect();
    let bronze_after: Vec<_> = unique
        .into_iter()
        .filter(|row| row.0 > healed_at.to_string())
        .collect();
    assert_eq!(
        bronze_after, after,
        "every change after the re-snapshot's S, once"
    );
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        common::source_rows(&lab).await,
        "silver equals the source"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_of_one_app_id_under_a_workload_lose_and_double_nothing() {
    let lab = Lab::new().await;
    lab.workload(41, 50);
    let (stop, workload) = running_workload(&lab, 42, WorkloadSpec::default().mix);
    // Two sidecars started together by mistake: one app id, one checkpoint, one lake.
    let mut writers: Vec<_> = (0..2)
        .map(|_| {
            let mut command = writer_command(&lab, false);
            command.stderr(Stdio::piped());
            command.spawn().expect("start a writer")
        })
        .collect();
    let mut fenced = None;
    for _ in 0..400 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Some(index) = writers
            .iter_mut()
            .position(|child| child.try_wait().expect("wait").is_some())
        {
            fenced = Some(writers.remove(index));
            break;
        }
    }
    let loser = fenced.expect("one of two writers of one app id is stopped");
    let output = loser.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the loser fails: {stderr}");
    assert!(
        stderr.contains("two writers of one app id"),
        "the loser says why: {stderr}"
    );
    // The winner goes on alone while the workload runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut winner = writers.pop().expect("the winner");
    assert!(
        winner.try_wait().expect("wait").is_none(),
        "the winner keeps streaming"
    );
    winner.kill().expect("SIGKILL");
    let _ = winner.wait();
    stop.store(true, Ordering::Relaxed);
    workload.join().expect("workload thread");
    check_invariants(&lab).await;
    restart_and_check_exactly_once(&lab).await;
}

/// A journaled workload of `mix` at 200 commits per second on a thread, until the flag is
/// set.
fn running_workload(
    lab: &Lab,
    seed: u64,
    mix: mssql_cdc_flight::sim::workload::Mix,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut writer = lab.db.writer(Clock::Wall, seed).expect("sim writer");
    writer.set_journal(&lab.journal()).expect("journal");
    let flag = Arc::clone(&stop);
    let workload = std::thread::spawn(move || {
        let spec = WorkloadSpec {
            commits: None,
            rate: Some(200.0),
            publish_interval: Duration::from_millis(50),
            mix,
            ..WorkloadSpec::default()
        };
        workload::run(&mut writer, &spec, &flag).expect("workload");
    });
    (stop, workload)
}

/// Waits until bronze holds every committed change of dbo.orders.
async fn wait_for_bronze_to_catch_up(lab: &Lab) {
    for _ in 0..300 {
        if bronze_rows(lab).await.as_deref() == Some(lab.committed().as_slice()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("bronze did not catch up with the source in 30 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_continuous_writer_cleanly_and_a_restart_goes_on() {
    let lab = Lab::new().await;
    lab.workload(33, 120);
    let mut command = writer_command(&lab, false);
    command.stdout(Stdio::piped());
    let child = command.spawn().expect("start the writer");
    wait_for_bronze_to_catch_up(&lab).await;
    let terminated = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(terminated.success());
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || child.wait_with_output().expect("wait")),
    )
    .await
    .expect("the writer stops within 30 s of SIGTERM")
    .expect("join");
    assert!(
        output.status.success(),
        "SIGTERM is a stop, not a crash: {:?}",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("stopped after"), "{stdout}");
    lab.workload(34, 30);
    restart_and_check_exactly_once(&lab).await;
}
