//! History (SCD type 2): apply_history against the in-process server, the stream and real
//! Delta tables. After every apply that has every snapshot applied, the history table equals
//! the model the simulator's journal gives (common/history.rs): each key's versions, their
//! intervals, how they ended and their tracked values.

mod common;

use std::collections::BTreeSet;

use common::Lab;
use common::history::{self, VersionRow};
use mssql_cdc_flight::sim::workload::Mix;
use mssql_cdc_writer::control::{self, Granularity};
use mssql_cdc_writer::silver::history::{HistoryConfig, HistoryOutcome, Tracked, apply_history};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::StreamConfig;

/// Inserts, updates (of the tracked column or not), deletes and key updates.
fn mix() -> Mix {
    common::churn()
}

/// The table the tests follow, its key, and its name in the lab's lake.
const TABLE: &str = "dbo.customers";
const KEY: &str = "customer_id";
const NAME: &str = "customers";

/// `commits` commits of the mix to the table.
fn workload(lab: &Lab, seed: u64, commits: u64) {
    let spec = mssql_cdc_flight::sim::workload::WorkloadSpec {
        commits: Some(commits),
        mix: mix(),
        tables: vec![TABLE.parse().expect("table")],
        ..Default::default()
    };
    // Ten seconds between commits: verdicts of minute granularity move between calls.
    let mut writer = lab
        .db
        .writer(
            mssql_cdc_flight::sim::Clock::Virtual {
                step_micros: 10_000_000,
            },
            seed,
        )
        .expect("writer");
    writer.set_journal(&lab.journal()).expect("journal");
    mssql_cdc_flight::sim::workload::run(
        &mut writer,
        &spec,
        &std::sync::atomic::AtomicBool::new(false),
    )
    .expect("workload");
}

/// The two histories of the table: one tracking only `is_active` (a change of any other
/// column, half the updates, updates the current version in place), one tracking every
/// column.
fn configs(lab: &Lab) -> [(HistoryConfig, Vec<&'static str>); 2] {
    let base = |target: &str, tracked: Tracked| HistoryConfig {
        table: TABLE.into(),
        bronze: lab.lake(&format!("bronze_{NAME}")),
        target: lab.lake(target),
        capture_instance: None,
        keys: vec![KEY.into()],
        control: lab.lake("control"),
        facts: lab.lake("facts"),
        granularity: Granularity::Minute,
        tracked,
    };
    [
        (
            base("history_active", Tracked::Only(vec!["is_active".into()])),
            vec!["is_active"],
        ),
        // Every column: a row's content changes every column the simulator derives from it,
        // so versions change with the content (the balance alone takes more values than a
        // run has updates), and the comparison reads the balance.
        (base("history_all", Tracked::All), vec!["balance"]),
    ]
}

async fn apply_all(lab: &Lab) -> Vec<HistoryOutcome> {
    let mut outcomes = Vec::new();
    for (config, _) in configs(lab) {
        outcomes.push(apply_history(&config).await.expect("apply_history"));
    }
    outcomes
}

/// Each history equals the model of the journal.
async fn assert_as_journal(lab: &Lab, context: &str) {
    let journal = history::journal(lab, TABLE);
    let bronze = lab.lake(&format!("bronze_{NAME}"));
    let held = history::held_commits(&bronze, KEY).await;
    let snapshots = history::complete_snapshots(lab, &bronze).await;
    for (config, compared) in configs(lab) {
        let tracked =
            |key: i64, content: u64| history::generated(&lab.db, TABLE, &compared, key, content);
        let expected = history::expected(&journal, &held, &snapshots, &tracked);
        let lake = history::held(&config.target, KEY, &compared)
            .await
            .expect("history's invariants");
        if let Some(differences) = history::differences(&expected, &lake) {
            panic!("{context}: {}: {differences}", config.target);
        }
        assert!(
            expected.len() > 100,
            "{context}: {} versions",
            expected.len()
        );
    }
    // Current versions hold the source's rows, every column.
    let source = common::source_rows_of(lab, TABLE, KEY, &common::ColumnSelection::All).await;
    for (config, _) in configs(lab) {
        assert_eq!(
            current_versions(&config.target).await,
            source,
            "{context}: current versions of {}",
            config.target
        );
    }
}

/// The current versions of a history, by key.
async fn current_versions(location: &str) -> common::Rows {
    let batches = common::query(location, "SELECT * FROM t WHERE __is_current").await;
    let mut rows = common::Rows::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            rows.insert(
                common::integer_at(batch, KEY, row),
                common::captured(batch, row),
            );
        }
    }
    rows
}

const WHOLE: BackfillOptions = BackfillOptions {
    chunk_rows: 20,
    max_waves: None,
    target_wave_seconds: 0.0,
    min_headroom_hours: None,
};

fn stream_config(lab: &Lab) -> StreamConfig {
    let mut config = lab.stream_of(TABLE, NAME);
    config.on_data_loss = mssql_cdc_writer::data_loss::OnDataLoss::Resnapshot;
    config
}

/// A gap the stream never sees (a purge past it), then changes after it.
async fn purged_gap(lab: &Lab, seed: u64) {
    use mssql_cdc_flight::source::CdcSource;
    workload(lab, seed, 60);
    let cut = lab.db.max_lsn().await.expect("max_lsn").expect("lsn");
    lab.db.cleanup(None, cut).expect("cleanup past the stream");
    workload(lab, seed + 1, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_follows_the_journal_through_snapshots_a_purge_and_a_crash() {
    let lab = Lab::new().await;
    workload(&lab, 61, 150);
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    // Changes committed after the stamp and before the stream reads them.
    workload(&lab, 62, 60);
    common::run_now(config.clone()).await;
    apply_all(&lab).await;
    assert_as_journal(&lab, "after the bootstrap and the first changes").await;
    let again = apply_all(&lab).await;
    assert!(
        again.iter().all(|outcome| outcome.versions_written == 0),
        "a second call writes nothing: {again:?}"
    );

    // A crash after the write and before the position: the next call lands on the same rows.
    workload(&lab, 63, 60);
    common::run_now(config.clone()).await;
    let control_url = mssql_cdc_writer::tables::table_url(&lab.lake("control")).expect("url");
    let mut positions = Vec::new();
    for (history, _) in configs(&lab) {
        let row = control::row(&control_url, &history.target)
            .await
            .expect("row");
        positions.push(row.expect("a position").position);
    }
    apply_all(&lab).await;
    let written: Vec<_> = history_rows(&lab).await;
    for ((history, _), position) in configs(&lab).iter().zip(&positions) {
        control::set_position(&control_url, &history.target, position)
            .await
            .expect("position back");
    }
    apply_all(&lab).await;
    assert_eq!(
        history_rows(&lab).await,
        written,
        "a replay lands on the same rows"
    );
    assert_as_journal(&lab, "after a replayed call").await;

    // A full re-snapshot beside the stream, with a commit landing between its stamp and its
    // read: its rows wait for the stream to pass the read's end, and the key that commit
    // touched takes its state at S from the commit's before-image.
    let landed = common::commit_during_next_snapshot_read(&lab, TABLE, 90);
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    snapshots.resnapshot_full().await.expect("resnapshot");
    assert!(
        landed.lock().expect("lock").is_none(),
        "the commit landed in the read"
    );
    let waiting = apply_all(&lab).await;
    assert!(
        waiting
            .iter()
            .all(|outcome| outcome.waiting_snapshot.is_some()),
        "the re-snapshot's rows wait for the stream: {waiting:?}"
    );
    workload(&lab, 64, 40);
    common::run_now(config.clone()).await;
    apply_all(&lab).await;
    assert_as_journal(&lab, "after a full re-snapshot").await;

    // A purge the stream meets: a chunked re-snapshot heals it, the stream resumes at S.
    purged_gap(&lab, 65).await;
    common::run_now(config.clone()).await;
    let outcomes = apply_all(&lab).await;
    assert!(
        outcomes
            .iter()
            .all(|outcome| outcome.waiting_snapshot.is_some()
                && outcome.finalized_until == outcomes[0].finalized_until),
        "the verdict holds while the re-snapshot is open: {outcomes:?}"
    );
    workload(&lab, 67, 40);
    common::run_now(config.clone()).await;
    snapshots
        .backfill(&BackfillOptions {
            max_waves: Some(1),
            ..WHOLE
        })
        .await
        .expect("a wave");
    common::run_now(config.clone()).await;
    apply_all(&lab).await;
    loop {
        let status = snapshots.backfill(&WHOLE).await.expect("waves");
        if status.done {
            break;
        }
    }
    workload(&lab, 68, 20);
    common::run_now(config.clone()).await;
    let outcomes = apply_all(&lab).await;
    assert!(
        outcomes
            .iter()
            .all(|outcome| outcome.waiting_snapshot.is_none()),
        "{outcomes:?}"
    );
    assert_as_journal(&lab, "after the purge was healed").await;
    let resnapshot_ends = history::held(&lab.lake("history_active"), KEY, &["is_active"])
        .await
        .expect("history's invariants")
        .into_iter()
        .filter(|version| version.3.as_deref() == Some("resnapshot"))
        .count();
    assert!(
        resnapshot_ends > 0,
        "the purge's changes end versions at the re-snapshot"
    );
    let [active, all] = history_rows(&lab).await.try_into().expect("two histories");
    assert!(
        active.len() < all.len(),
        "updates of other columns than is_active open no version: {} against {}",
        active.len(),
        all.len()
    );
    python_reads(&lab.lake("history_active")).await;
}

/// Every history's rows.
async fn history_rows(lab: &Lab) -> Vec<BTreeSet<VersionRow>> {
    let mut all = Vec::new();
    for (config, compared) in configs(lab) {
        all.push(
            history::held(&config.target, KEY, &compared)
                .await
                .expect("history's invariants"),
        );
    }
    all
}

/// The Python `deltalake` package reads the history as we do.
async fn python_reads(location: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let ours = history::held(location, KEY, &["is_active"])
        .await
        .expect("history's invariants");
    let python = common::python();
    let mut child = Command::new(&python)
        .args([
            "-c",
            // os._exit: the reader's threads must not outlive teardown (a pyarrow or
            // deltalake thread still running there aborts the interpreter now and then).
            "import json, sys\n\
             from deltalake import DeltaTable\n\
             t = DeltaTable(sys.stdin.read()).to_pyarrow_table().to_pylist()\n\
             print(json.dumps(sorted([[r['customer_id'], r['__valid_from'], r['__valid_to'], \
             r['__ended_by'], str(r['is_active']).lower()] for r in t], \
             key=lambda r: (r[0], r[1] or ''))), flush=True)\n\
             import os; os._exit(0)",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "{} cannot run ({error}); set MSSQL_CDC_PYTHON",
                python.display()
            )
        });
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(location.as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("python");
    assert!(
        output.status.success(),
        "deltalake could not read the history: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    type PythonRow = (
        i64,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let theirs: Vec<PythonRow> = serde_json::from_slice(&output.stdout).expect("json");
    let theirs: BTreeSet<VersionRow> = theirs
        .into_iter()
        .map(|(key, from, to, ended, status)| {
            (
                key,
                from,
                to,
                ended,
                status.unwrap_or_else(|| "NULL".into()),
            )
        })
        .collect();
    assert_eq!(theirs, ours, "deltalake reads the history we wrote");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_history_calls_are_refused_with_the_reason_and_nothing_written() {
    let lab = Lab::new().await;
    workload(&lab, 71, 30);
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    common::run_now(config).await;
    let (base, _) = configs(&lab)[0].clone();
    for (tracked, reason) in [
        (Tracked::Only(vec!["colour".into()]), "colour"),
        (Tracked::Only(vec![KEY.into()]), "tracks no column"),
    ] {
        let error = apply_history(&HistoryConfig {
            tracked,
            ..base.clone()
        })
        .await
        .expect_err("refused");
        assert!(error.to_string().contains(reason), "{error}");
    }
    let error = apply_history(&HistoryConfig {
        keys: vec!["customer".into()],
        ..base.clone()
    })
    .await
    .expect_err("refused");
    assert!(error.to_string().contains("customer"), "{error}");
    let url = mssql_cdc_writer::tables::table_url(&base.target).expect("url");
    assert!(
        mssql_cdc_writer::tables::open(&url)
            .await
            .expect("open")
            .is_none(),
        "no history table was made"
    );
    assert!(
        Tracked::of(vec!["a".into()], vec!["b".into()]).is_err(),
        "both lists at once are refused"
    );
    // A history records what it tracks; a call asking otherwise is refused.
    apply_history(&base).await.expect("apply");
    let error = apply_history(&HistoryConfig {
        tracked: Tracked::All,
        ..base.clone()
    })
    .await
    .expect_err("refused");
    assert!(error.to_string().contains("tracks"), "{error}");
}

/// Runs `snapshot open --mode full --resnapshot` for the test's table, aborting at
/// `crash_at` when given.
async fn full_resnapshot_command(lab: &Lab, crash_at: Option<&str>) -> std::process::Output {
    let config = stream_config(lab);
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
    command
        .args(["snapshot", "open", "--server", &lab.url, "--table", TABLE])
        .args(["--target", &config.target, "--facts", &config.facts])
        .args(["--app-id", &config.app_id, "--mode", "full", "--resnapshot"])
        .env("RUST_LOG", "warn");
    if let Some(step) = crash_at {
        command.env(mssql_cdc_writer::stream::CRASH_AT_VARIABLE, step);
    }
    tokio::task::spawn_blocking(move || command.output().expect("run"))
        .await
        .expect("join")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_still_being_read_holds_the_verdict_until_its_rows_are_in() {
    let lab = Lab::new().await;
    workload(&lab, 81, 120);
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    workload(&lab, 82, 40);
    common::run_now(config.clone()).await;
    let before = apply_all(&lab).await;
    assert!(before[0].finalized_until.is_some(), "{before:?}");
    // A full re-snapshot whose process died after recording its S, before its rows.
    let crashed = full_resnapshot_command(&lab, Some("after_snapshot_open")).await;
    assert!(!crashed.status.success(), "aborted after the open");
    workload(&lab, 83, 40);
    common::run_now(config.clone()).await;
    let during = apply_all(&lab).await;
    for (outcome, before) in during.iter().zip(&before) {
        assert!(outcome.waiting_snapshot.is_some(), "{outcome:?}");
        assert_eq!(
            outcome.finalized_until, before.finalized_until,
            "the verdict holds while a snapshot's rows are still to come"
        );
    }
    // The rerun finds the open and reads it; the stream passes its read; history takes it.
    let finished = full_resnapshot_command(&lab, None).await;
    assert!(
        finished.status.success(),
        "{}",
        String::from_utf8_lossy(&finished.stderr)
    );
    workload(&lab, 84, 20);
    common::run_now(config.clone()).await;
    let after = apply_all(&lab).await;
    assert!(
        after
            .iter()
            .all(|outcome| outcome.waiting_snapshot.is_none()
                && outcome.finalized_until > before[0].finalized_until),
        "{after:?}"
    );
    assert_as_journal(&lab, "after the re-snapshot completed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_compares_a_history_with_the_source_and_replays_it_from_bronze() {
    use mssql_cdc_writer::reconcile::{ReconcileConfig, reconcile};
    let lab = Lab::new().await;
    workload(&lab, 91, 120);
    let mut config = stream_config(&lab);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    // Applied twice: rows a snapshot brought in, then changes of some of those keys (the
    // replay must decide about their snapshot rows as the first call did).
    common::run_now(config.clone()).await;
    apply_all(&lab).await;
    workload(&lab, 92, 60);
    common::run_now(config.clone()).await;
    apply_all(&lab).await;
    let (history, _) = configs(&lab)[0].clone();
    let check = ReconcileConfig {
        facts: Some(lab.lake("facts")),
        bucket_rows: 20,
        sample: 1.0,
        ..ReconcileConfig::new(
            &lab.url,
            TABLE,
            &history.target,
            &config.target,
            &history.control,
        )
    };
    let clean = reconcile(&check).await.expect("reconcile");
    let replay = clean.history_replay.clone().expect("a history is replayed");
    assert!(
        clean.verified && clean.values_verified && replay.differences == 0,
        "{clean:?}"
    );
    assert!(replay.versions > 100, "{replay:?}");
    // Another engine deletes an ended version: the current versions still match the source,
    // the replay from bronze does not.
    let table = common::open_table(&history.target).await;
    let ended = common::query(
        &history.target,
        &format!("SELECT MIN({KEY}) FROM t WHERE NOT __is_current"),
    )
    .await;
    let key = common::text(&ended[0], 0, 0).expect("an ended version");
    common::delete_where(table, &format!("{KEY} = {key} AND NOT __is_current")).await;
    let broken = reconcile(&check).await.expect("reconcile");
    let replay = broken.history_replay.clone().expect("replayed");
    assert!(
        broken.mismatch == 0 && replay.differences > 0 && !broken.verified,
        "{broken:?}"
    );
    assert!(
        replay.first[0].contains("replayed, not held") && replay.first[0].contains(&key),
        "{replay:?}"
    );
}
