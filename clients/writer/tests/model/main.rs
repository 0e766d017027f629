//! The lake under every schedule: a seeded random schedule of what a deployment does (workload
//! commits to a busy and a quiet table and one whose snapshots are cut on a composite unique
//! index, streams in every mode, purges met by fail, skip or a
//! healing re-snapshot, full and chunked re-snapshots with their backfill waves, an
//! operator's pause and resume, added columns with a capture-instance switch and widened
//! columns, maintenance in this process and in another, silver applies, reconciles after a
//! corruption, a second writer of one app id, crashes at every crash point, restarts of the
//! Flight server under whatever runs), some steps two operations at once, over the
//! simulated database and real Delta tables. After every step
//! it checks what the simulator's journal says must hold (docs/design-notes.md, "The model
//! test"):
//!
//! - bronze holds each change row of the journal at most once, every one through the
//!   checkpoint's last committed batch (but those a purge took before they were read, or a
//!   healing re-snapshot stands for); no snapshot row twice;
//! - a backfill of a snapshot an operator paused reads no wave;
//! - facts hold one row per batch of each app id, ids contiguous from 0;
//! - no verdict is ahead of the checkpoint's last committed batch;
//! - silver, applied over a current bronze of a table that lost nothing (or was rebuilt from
//!   a snapshot taken after its loss), equals the source;
//! - history, applied with every snapshot in, equals the journal's versions at the points
//!   bronze saw (its changes, its snapshots), unless a skipped purge took changes for good;
//!   its invariants (one current version per key, ends and times) always hold;
//! - reconcile records a verified LSN only for a silver equal to the source;
//! - at the end, every table reads in the Python `deltalake` package as it does here.
//!
//! Run as `cargo test -p mssql-cdc-writer --test model` (CI: a fixed set of seeds), or
//! `cargo test -p mssql-cdc-writer --test model -- --seeds 0..50 --steps 200 --no-shrink`
//! for a long run (a failure is printed whole with its replay command, and the run goes on), `-- --seed 7 --steps 40` for one seed (`--print` prints its schedule instead), `-- --schedule '<json>'` to replay
//! a schedule a failure printed (with `MSSQL_CDC_MODEL_KEEP=1`, its lake and simulated
//! database stay on disk). A failure shrinks its schedule (dropping steps while it
//! still fails) and prints the shortest one found with the command that replays it.
//!
//! The schedule's operations are in `ops`, what each does to the world in `world` (the
//! snapshot operations in `snapshots`, those run as other processes in `processes`), the
//! checks after every step in `checks`.

mod checks;
#[path = "../common/mod.rs"]
mod common;
mod history;
mod ops;
mod processes;
mod servers;
mod snapshots;
mod world;

use std::collections::BTreeMap;
use std::time::Instant;

use common::python;
use ops::{Op, schedule};
use world::{Failure, World};

pub(crate) const WRITER: &str = env!("CARGO_BIN_EXE_mssql-cdc-writer");

/// Set (to anything) to keep the world of a failing schedule on disk.
const KEEP_VARIABLE: &str = "MSSQL_CDC_MODEL_KEEP";

/// The seeds CI runs, and the steps of each.
const CI_SEEDS: std::ops::Range<u64> = 0..4;
const CI_STEPS: usize = 30;

/// What a coverage schedule must reach: a phrase of its description and the coverage entry
/// its run must count, so the schedule fails when what it covers is gone.
const MUST_COVER: &[(&str, &str)] = &[
    (
        "a killed replica's tables taken over",
        "tables taken over from a killed fleet replica",
    ),
    (
        "a stopped replica's tables taken over",
        "tables taken over from a stopped fleet replica",
    ),
    (
        "stops its stream by the anti-loop guard",
        "re-snapshots refused by the anti-loop guard",
    ),
    (
        "abandons the chunked re-snapshot opened under the old selection",
        "chunked snapshots abandoned as the column selection changed",
    ),
];

/// Schedules that once failed, kept as regressions, and a few that reach what random seeds
/// rarely do: each runs in CI beside the seeds.
const REGRESSIONS: &[(&str, &str)] = &[
    (
        "coverage, not a failure: fleets of sidecar replicas sharing the tables by lease, a \
         killed replica's tables taken over by the others and a stopped replica's tables \
         taken over once it gave them back, then a stream, silver and a reconcile (issue 57)",
        r#"[{"Commit":{"table":"Busy","commits":30,"seed":1}},
        {"Commit":{"table":"Keyed","commits":20,"seed":2}},
        {"Sidecar":{"tenths":40,"kill":true,"deletion_vectors":false,"replicas":3}},
        {"Commit":{"table":"Quiet","commits":10,"seed":3}},
        {"Sidecar":{"tenths":40,"kill":false,"deletion_vectors":true,"replicas":2}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Busy","deletion_vectors":false}},
        {"Reconcile":{"table":"Busy","corrupt":false}}]"#,
    ),
    (
        "coverage, not a failure: an operator leaves one more column of the quiet table out \
         while a chunked re-snapshot is open: its stream records the change and abandons the \
         chunked re-snapshot opened under the old selection; a new one, silver, reconcile, \
         then the column taken back in through a crashed run and the sidecar (issue 58)",
        r#"[{"Commit":{"table":"Quiet","commits":5,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Commit":{"table":"Quiet","commits":5,"seed":2}},
        {"Snapshot":{"table":"Quiet","chunked":true}},
        {"Reselect":{"table":"Quiet","narrow":true}},
        {"Commit":{"table":"Quiet","commits":5,"seed":3}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Backfill":{"table":"Quiet","waves":3}},
        {"Snapshot":{"table":"Quiet","chunked":true}},
        {"Backfill":{"table":"Quiet","waves":4}},
        {"Apply":{"table":"Quiet","deletion_vectors":true}},
        {"Reconcile":{"table":"Quiet","corrupt":false,"value":false}},
        {"Reselect":{"table":"Quiet","narrow":false}},
        {"Commit":{"table":"Quiet","commits":5,"seed":4}},
        {"Crash":{"table":"Quiet","point":1}},
        {"Sidecar":{"tenths":20,"kill":false,"deletion_vectors":false}},
        {"Reconcile":{"table":"Quiet","corrupt":true,"value":true}}]"#,
    ),
    (
        "coverage, not a failure: the table keyed by a composite, case-insensitive unique \
         index through its bootstrap, a full re-snapshot read in two keyset partitions, a \
         chunked one cut on keyset bounds with commits between its waves, a column added with \
         a capture-instance switch, a purge healed by re-snapshot, silver and reconciles",
        r#"[{"Commit":{"table":"Keyed","commits":60,"seed":1}},
        {"Stream":{"table":"Keyed","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Keyed","deletion_vectors":false}},
        {"Commit":{"table":"Keyed","commits":40,"seed":2}},
        {"Snapshot":{"table":"Keyed","chunked":false}},
        {"Stream":{"table":"Keyed","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Keyed","deletion_vectors":true}},
        {"Reconcile":{"table":"Keyed","corrupt":false,"value":true}},
        {"Commit":{"table":"Keyed","commits":40,"seed":3}},
        {"Snapshot":{"table":"Keyed","chunked":true}},
        {"Backfill":{"table":"Keyed","waves":1}},
        {"Commit":{"table":"Keyed","commits":30,"seed":4}},
        {"Stream":{"table":"Keyed","continuous":false,"live_tail":false,"max_commits":null}},
        {"Backfill":{"table":"Keyed","waves":4}},
        {"Apply":{"table":"Keyed","deletion_vectors":false}},
        {"Reconcile":{"table":"Keyed","corrupt":true,"value":false}},
        {"Schema":{"table":"Keyed","change":"AddColumnAndSwitch"}},
        {"Commit":{"table":"Keyed","commits":30,"seed":5}},
        {"Stream":{"table":"Keyed","continuous":false,"live_tail":false,"max_commits":null}},
        {"Purge":{"on_loss":["Skip","Skip","Resnapshot"]}},
        {"Commit":{"table":"Keyed","commits":30,"seed":6}},
        {"Stream":{"table":"Keyed","continuous":false,"live_tail":false,"max_commits":null}},
        {"Backfill":{"table":"Keyed","waves":6}},
        {"Apply":{"table":"Keyed","deletion_vectors":true}},
        {"Reconcile":{"table":"Keyed","corrupt":false,"value":true}}]"#,
    ),
    (
        "coverage, not a failure: a second purge of a table under resnapshot, met within \
         resnapshot_interval_days of the first heal, stops its stream by the anti-loop guard; \
         the operator's rerun with the guard at 0 heals it (issue 55)",
        r#"[{"Commit":{"table":"Busy","commits":20,"seed":1}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Commit":{"table":"Busy","commits":20,"seed":2}},
        {"Purge":{"on_loss":["Resnapshot","Resnapshot"]}},
        {"Commit":{"table":"Busy","commits":20,"seed":3}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Commit":{"table":"Busy","commits":20,"seed":4}},
        {"Purge":{"on_loss":["Resnapshot","Resnapshot"]}},
        {"Commit":{"table":"Busy","commits":20,"seed":5}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Busy","deletion_vectors":false}},
        {"Reconcile":{"table":"Busy","corrupt":false}}]"#,
    ),
    (
        "a stream first run after an operator's chunked bootstrap and a cleanup past its S \
         started at the cleanup's low watermark: the changes between S and it were lost \
         without a data_loss row or a heal, and history lacked a key (seed 4)",
        r#"[{"Snapshot":{"table":"Quiet","chunked":true}},
        {"Backfill":{"table":"Quiet","waves":2}},
        {"Commit":{"table":"Quiet","commits":2,"seed":7466566959123160176}},
        {"Purge":{"on_loss":["Skip","Resnapshot","Resnapshot"]}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}}]"#,
    ),
    (
        "reconcile of a caught-up quiet table read the change table from the control row's \
     lagging end, which a cleanup had passed: DATA_LOSS instead of a verdict",
        r#"[{"Commit":{"table":"Quiet","commits":3,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Commit":{"table":"Busy","commits":100,"seed":2}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Purge":{"on_loss":["Skip","Skip"]}},
        {"Reconcile":{"table":"Quiet","corrupt":false}}]"#,
    ),
    (
        "a silver row deleted beside a key changed in the lag: the grid bucket holding both was \
         IN_FLIGHT and never compared row by row, and the LSN was verified (seed 12)",
        r#"[{"Together":[{"Commit":{"table":"Busy","commits":120,"seed":11108836186891495317}},
            {"Commit":{"table":"Quiet","commits":3,"seed":1464525436300282101}}]},
        {"Commit":{"table":"Busy","commits":158,"seed":13834461579297841671}},
        {"Commit":{"table":"Quiet","commits":3,"seed":13784495773053659873}},
        {"Apply":{"table":"Quiet","deletion_vectors":true}},
        {"Commit":{"table":"Quiet","commits":3,"seed":4137154366908614171}},
        {"Reconcile":{"table":"Quiet","corrupt":true}}]"#,
    ),
    (
        "a quiet table re-snapshotted (chunked) while a busy one committed: its chunks' stamps \
         were after silver's position, so every key stayed in flight after the rebuild and a \
         row another engine deleted from silver was verified",
        r#"[{"Commit":{"table":"Quiet","commits":5,"seed":2}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Snapshot":{"table":"Quiet","chunked":true}},
        {"Together":[{"Backfill":{"table":"Quiet","waves":30}},
            {"Commit":{"table":"Busy","commits":100,"seed":7}}]},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Reconcile":{"table":"Quiet","corrupt":true}}]"#,
    ),
    (
        "a caught-up stream whose position a purge passed (others committed after its last \
         batch) heals by a re-snapshot and resumes at its S: the model counted it as losing \
         nothing (seed 215)",
        r#"[{"Commit":{"table":"Busy","commits":195,"seed":15251972920729059618}},
        {"Together":[{"Commit":{"table":"Busy","commits":125,"seed":8572627218112100071}},{"Maintain":{"target":{"Bronze":"Busy"},"beside":true}}]},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Purge":{"on_loss":["Fail","Skip"]}},
        {"Commit":{"table":"Busy","commits":176,"seed":14918622067911104634}},
        {"Reconcile":{"table":"Busy","corrupt":false}},
        {"Commit":{"table":"Quiet","commits":3,"seed":6775308584637349669}},
        {"Commit":{"table":"Quiet","commits":3,"seed":18428248110072954662}},
        {"Purge":{"on_loss":["Skip","Resnapshot"]}},
        {"Purge":{"on_loss":["Resnapshot","Resnapshot"]}},
        {"Commit":{"table":"Busy","commits":144,"seed":7876802233058381191}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":true,"max_commits":null}}]"#,
    ),
    (
        "two writers of one app id replaying a batch across a capture-instance switch both \
         added the new column to bronze: the second's schema change failed on the first's \
         (Metadata changed since last commit) instead of reading the table again (seed 311)",
        r#"[{"Commit":{"table":"Quiet","commits":5,"seed":11404669864430334539}},
        {"Apply":{"table":"Busy","deletion_vectors":true}},
        {"Reconcile":{"table":"Quiet","corrupt":false}},
        {"Commit":{"table":"Quiet","commits":2,"seed":15594466202953123596}},
        {"Reconcile":{"table":"Quiet","corrupt":false}},
        {"Schema":{"table":"Quiet","change":"AddColumnAndSwitch"}},
        {"Crash":{"table":"Quiet","point":0}},
        {"SecondWriter":{"table":"Quiet"}}]"#,
    ),
    (
        "a purge healed by re-snapshot reused a chunked snapshot opened after the stream's \
         position but since passed by the cleanup too: the stream resumed at its S and met \
         the purge again (seed 1030)",
        r#"[{"Commit":{"table":"Quiet","commits":5,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Commit":{"table":"Quiet","commits":3,"seed":2}},
        {"Snapshot":{"table":"Quiet","chunked":true}},
        {"Commit":{"table":"Busy","commits":20,"seed":3}},
        {"Purge":{"on_loss":["Skip","Resnapshot"]}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}}]"#,
    ),
    (
        "the server restarted under a stream, a backfill and a snapshot open: each failed on \
         the cut connection (\"operation was canceled\", \"transport error\") instead of \
         trying again",
        r#"[{"Commit":{"table":"Busy","commits":190,"seed":1}},
        {"Together":[{"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":10}},
            {"Restart":{"tenths":3,"down":5}}]},
        {"Snapshot":{"table":"Busy","chunked":true}},
        {"Together":[{"Backfill":{"table":"Busy","waves":4}},{"Restart":{"tenths":1,"down":5}}]},
        {"Together":[{"Snapshot":{"table":"Quiet","chunked":true}},{"Restart":{"tenths":0,"down":5}}]}]"#,
    ),
    (
        "the writer killed after the bronze commit of a batch a re-snapshot healed: its claim \
         already starts at S, while its data_loss row is still only in the claim, not in facts; \
         the model asked bronze for the changes the snapshot stands for (seed 3002)",
        r#"[{"Commit":{"table":"Quiet","commits":3,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Commit":{"table":"Quiet","commits":3,"seed":2}},
        {"Commit":{"table":"Busy","commits":20,"seed":3}},
        {"Purge":{"on_loss":["Skip","Resnapshot"]}},
        {"Commit":{"table":"Quiet","commits":2,"seed":4}},
        {"Crash":{"table":"Quiet","point":1}}]"#,
    ),
    (
        "the server restarted with a new ticket key (no key file) under a stream, a backfill \
         and a full snapshot: tickets planned before it were refused as forged, and nothing \
         planned again (review)",
        r#"[{"Commit":{"table":"Busy","commits":190,"seed":1}},
        {"Together":[{"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":10}},
            {"Restart":{"tenths":3,"down":2,"rekey":true}}]},
        {"Snapshot":{"table":"Busy","chunked":true}},
        {"Together":[{"Backfill":{"table":"Busy","waves":4}},{"Restart":{"tenths":1,"down":2,"rekey":true}}]},
        {"Together":[{"Snapshot":{"table":"Quiet","chunked":false}},{"Restart":{"tenths":1,"down":2,"rekey":true}}]}]"#,
    ),
    (
        "a reconcile after the writer was killed in a batch a re-snapshot healed: the open \
         claim starts past the purge, but bronze and facts still show the stream before it, \
         so reconcile rightly met the purge (DATA_LOSS), which the model took for a failure \
         (seed 3013)",
        r#"[{"Commit":{"table":"Quiet","commits":3,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Commit":{"table":"Quiet","commits":3,"seed":2}},
        {"Commit":{"table":"Busy","commits":20,"seed":3}},
        {"Purge":{"on_loss":["Skip","Resnapshot"]}},
        {"Commit":{"table":"Quiet","commits":2,"seed":4}},
        {"Crash":{"table":"Quiet","point":1}},
        {"Reconcile":{"table":"Quiet","corrupt":false}}]"#,
    ),
    (
        "a value another engine changed in silver, reconciled reading no bucket row by row \
         (sample 0): counts and key sums match, so only the value sums of tier 1 find it",
        r#"[{"Commit":{"table":"Quiet","commits":5,"seed":3}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Quiet","deletion_vectors":true}},
        {"Reconcile":{"table":"Quiet","corrupt":true,"value":true}},
        {"Commit":{"table":"Busy","commits":20,"seed":4}},
        {"Reconcile":{"table":"Quiet","corrupt":false}}]"#,
    ),
    (
        "a value another engine changed in silver, then reconciled without value sums at \
         sample 0: silver's rows may be verified, its values must not be",
        r#"[{"Commit":{"table":"Busy","commits":5,"seed":3}},
        {"Stream":{"table":"Busy","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Busy","deletion_vectors":false}},
        {"Reconcile":{"table":"Busy","corrupt":true,"value":true}},
        {"Reconcile":{"table":"Busy","corrupt":false,"value":true}}]"#,
    ),
];

/// Runs `schedule` on a new world; the step that failed and why, or the coverage. A panic
/// (a helper's `expect`) is a failure of the step it happened in.
async fn run_schedule(
    schedule: &[Op],
    python_check: bool,
) -> Result<BTreeMap<String, u64>, (usize, Failure)> {
    let step = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ran = tokio::spawn(run_steps(schedule.to_vec(), python_check, step.clone())).await;
    match ran {
        Ok(outcome) => outcome,
        Err(error) => {
            let message = match error.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                    .unwrap_or_else(|| "a panic".into()),
                Err(error) => error.to_string(),
            };
            Err((
                step.load(std::sync::atomic::Ordering::SeqCst),
                format!("panicked: {message}"),
            ))
        }
    }
}

async fn run_steps(
    schedule: Vec<Op>,
    python_check: bool,
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Result<BTreeMap<String, u64>, (usize, Failure)> {
    let world = World::new().await;
    for (step, op) in schedule.iter().enumerate() {
        current.store(step, std::sync::atomic::Ordering::SeqCst);
        let outcome = match world.run(op).await {
            Ok(()) => world.check().await,
            failed => failed,
        };
        if let Err(failure) = outcome {
            if std::env::var_os(KEEP_VARIABLE).is_some() {
                // The lake and the simulated database stay for a look.
                println!("  kept: {}", world.lab.dir.path().display());
                std::mem::forget(world);
            }
            return Err((step, failure));
        }
    }
    if python_check {
        world
            .check_python_reads()
            .await
            .map_err(|failure| (schedule.len(), failure))?;
    }
    let covered = std::mem::take(&mut world.known().covered);
    Ok(covered)
}

/// The shortest schedule found that still fails the same way: the schedule cut after the
/// failing step, then runs of steps dropped while a failure of the kind of `first` stays,
/// halves first, then quarters, down to single steps (so a failure at step 150 needs tens of
/// replays, not thousands).
async fn shrink(mut schedule: Vec<Op>, failed_at: usize, first: &str) -> (Vec<Op>, Failure) {
    schedule.truncate(failed_at + 1);
    let mut failure = first.to_string();
    let mut run = schedule.len().div_ceil(2).max(1);
    loop {
        // From the end: a later step more often depends on an earlier one than the reverse.
        let mut end = schedule.len();
        while end > 0 {
            let start = end.saturating_sub(run);
            let mut shorter = schedule.clone();
            shorter.drain(start..end);
            if !shorter.is_empty()
                && let Err((at, found)) = run_schedule(&shorter, false).await
                && same_kind(&found, first)
            {
                shorter.truncate(at + 1);
                schedule = shorter;
                failure = found;
                end = start.min(schedule.len());
            } else {
                end = start;
            }
        }
        if run == 1 {
            return (schedule, failure);
        }
        run = run.div_ceil(2);
    }
}

/// Whether two failures are of one kind: the same text before the first ": " (the check or
/// operation that failed), so shrinking keeps the failure it started from.
fn same_kind(found: &str, first: &str) -> bool {
    let head = |text: &str| text.split(": ").next().unwrap_or(text).to_string();
    head(found) == head(first)
}

struct Args {
    seeds: Vec<u64>,
    steps: usize,
    schedule: Option<Vec<Op>>,
    /// Print each seed's schedule as JSON (one line a seed) instead of running it.
    print: bool,
    /// Shrink a failing schedule (`--no-shrink`: print it whole and go on, for long runs).
    shrink: bool,
}

fn args() -> Args {
    let mut args = Args {
        seeds: CI_SEEDS.collect(),
        steps: CI_STEPS,
        schedule: None,
        print: false,
        shrink: true,
    };
    let mut given = std::env::args().skip(1);
    while let Some(arg) = given.next() {
        let mut value = || {
            given
                .next()
                .unwrap_or_else(|| panic!("{arg} needs a value"))
        };
        match arg.as_str() {
            "--seed" => args.seeds = vec![value().parse().expect("--seed N")],
            "--seeds" => {
                let text = value();
                let (from, to) = text.split_once("..").expect("--seeds A..B");
                args.seeds = (from.parse().expect("A")..to.parse().expect("B")).collect();
            }
            "--steps" => args.steps = value().parse().expect("--steps N"),
            "--print" => args.print = true,
            "--no-shrink" => args.shrink = false,
            "--schedule" => {
                args.schedule = Some(serde_json::from_str(&value()).expect("--schedule JSON"));
            }
            // cargo test's own flags (--nocapture, --test-threads, a filter) mean nothing here.
            _ => {}
        }
    }
    args
}

fn main() {
    let args = args();
    if args.print {
        for seed in &args.seeds {
            let json = serde_json::to_string(&schedule(*seed, args.steps)).expect("json");
            println!("{json}");
        }
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let python = python();
    assert!(
        python.exists(),
        "the model test reads the lake with the Python deltalake package: {} is missing \
         (scripts/test makes .venv; or set MSSQL_CDC_PYTHON)",
        python.display()
    );
    let started = Instant::now();
    let (mut passed, mut failed, mut steps) = (0, 0, 0);
    let mut covered: BTreeMap<String, u64> = BTreeMap::new();
    let runs: Vec<(String, Vec<Op>)> = match &args.schedule {
        Some(schedule) => vec![("the given schedule".to_string(), schedule.clone())],
        None => REGRESSIONS
            .iter()
            .map(|(what, json)| {
                let ops = serde_json::from_str(json).expect("a regression schedule");
                (format!("regression ({what})"), ops)
            })
            .chain(
                args.seeds
                    .iter()
                    .map(|seed| (format!("seed {seed}"), schedule(*seed, args.steps))),
            )
            .collect(),
    };
    for (name, ops) in runs {
        let outcome = runtime
            .block_on(run_schedule(&ops, true))
            .and_then(|coverage| {
                let missing = MUST_COVER.iter().find(|(phrase, entry)| {
                    name.contains(phrase) && !coverage.contains_key(*entry)
                });
                match missing {
                    Some((_, entry)) => Err((
                        ops.len() - 1,
                        format!("the schedule passed without reaching \"{entry}\""),
                    )),
                    None => Ok(coverage),
                }
            });
        match outcome {
            Ok(coverage) => {
                passed += 1;
                steps += ops.len();
                for (name, count) in coverage {
                    *covered.entry(name).or_default() += count;
                }
                println!("model {name}: {} steps passed", ops.len());
            }
            Err((at, failure)) => {
                failed += 1;
                println!("model {name}: step {at} failed: {failure}");
                if !args.shrink {
                    let json = serde_json::to_string(&ops[..=at]).expect("json");
                    println!(
                        "  replay: cargo test -p mssql-cdc-writer --test model -- --schedule '{json}'"
                    );
                    continue;
                }
                let (shortest, failure) = runtime.block_on(shrink(ops, at, &failure));
                let json = serde_json::to_string(&shortest).expect("json");
                println!(
                    "  shortest failing schedule ({} steps): {failure}\n  replay: cargo test -p \
                     mssql-cdc-writer --test model -- --schedule '{json}'",
                    shortest.len()
                );
            }
        }
    }
    println!("model coverage (operations and pairs run):");
    for (name, count) in &covered {
        println!("  {count:6}  {name}");
    }
    println!(
        "model: {steps} steps in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
