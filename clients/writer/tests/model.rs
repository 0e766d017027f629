//! The lake under every schedule: a seeded random schedule of what a deployment does (workload
//! commits to a busy and a quiet table, streams in every mode, purges, maintenance in this
//! process and in another, silver applies, reconciles after a corruption, a second writer of
//! one app id, crashes at every crash point), some steps two operations at once, over the
//! simulated database and real Delta tables. After every step it checks what the simulator's
//! journal says must hold (docs/design-notes.md, "The model test"):
//!
//! - bronze holds each change row of the journal at most once, every one through the
//!   checkpoint's last committed batch (but those a purge took before they were read);
//! - facts hold one row per batch of each app id, ids contiguous from 0;
//! - no verdict is ahead of the checkpoint's last committed batch;
//! - silver, applied over a current bronze of a table that lost nothing, equals the source;
//! - reconcile records a verified LSN only for a silver equal to the source;
//! - at the end, every table reads in the Python `deltalake` package as it does here.
//!
//! Run as `cargo test -p mssql-cdc-writer --test model` (CI: a fixed set of seeds), or
//! `cargo test -p mssql-cdc-writer --test model -- --seeds 0..50 --steps 200` for a long
//! run, `-- --seed 7 --steps 40` for one seed, `-- --seed 7 --schedule '<json>'` to replay
//! a schedule a failure printed. A failure shrinks its schedule (dropping steps while it
//! still fails) and prints the shortest one found with the command that replays it.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::{Lab, Rows, current_rows_by, source_rows_of, utf8};
use futures::future::BoxFuture;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::checkpoint::Checkpoint;
use mssql_cdc_writer::maintenance::{self, MaintenanceOptions};
use mssql_cdc_writer::stream::{CRASH_AT_VARIABLE, Stream, StreamConfig};
use mssql_cdc_writer::tables::{self, TableKind};
use mssql_cdc_writer::{control, reconcile, silver};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

const WRITER: &str = env!("CARGO_BIN_EXE_mssql-cdc-writer");

/// The seeds CI runs, and the steps of each.
const CI_SEEDS: std::ops::Range<u64> = 0..4;
const CI_STEPS: usize = 30;

/// Schedules that once failed, kept as regressions: each runs in CI beside the seeds.
const REGRESSIONS: &[(&str, &str)] = &[
    (
        "reconcile of a caught-up quiet table read the change table from the control row's \
     lagging end, which a cleanup had passed: DATA_LOSS instead of a verdict",
        r#"[{"Commit":{"table":"Quiet","commits":3,"seed":1}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Apply":{"table":"Quiet","deletion_vectors":false}},
        {"Commit":{"table":"Busy","commits":100,"seed":2}},
        {"Stream":{"table":"Quiet","continuous":false,"live_tail":false,"max_commits":null}},
        {"Purge":{"skip":[true,true]}},
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
];

/// The two tables of the model: dbo.orders takes most commits, dbo.customers few.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
enum Table {
    Busy,
    Quiet,
}

impl Table {
    const ALL: [Table; 2] = [Table::Busy, Table::Quiet];

    fn source(self) -> &'static str {
        match self {
            Table::Busy => "dbo.orders",
            Table::Quiet => "dbo.customers",
        }
    }

    /// The app id, and the name in bronze_<name>, silver_<name>, checkpoint_<name>.
    fn name(self) -> &'static str {
        match self {
            Table::Busy => "orders",
            Table::Quiet => "customers",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Table::Busy => "order_id",
            Table::Quiet => "customer_id",
        }
    }
}

/// The tables a maintenance pass visits.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Maintained {
    Bronze(Table),
    Silver(Table),
    Facts,
    Control,
}

/// Where a crash is injected (the stream's crash points).
const CRASH_POINTS: [&str; 4] = ["after_plan", "after_bronze", "after_facts", "after_control"];

/// One operation of a schedule.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Op {
    /// Workload commits to one table (`seed` makes them).
    Commit {
        table: Table,
        commits: u64,
        seed: u64,
    },
    /// A stream of one table: available-now, or continuous until it holds every change
    /// committed before it started (on the server's live tail or polling).
    Stream {
        table: Table,
        continuous: bool,
        live_tail: bool,
        max_commits: Option<u64>,
    },
    /// A maintenance pass over one table of the lake, in this process, and with `beside` a
    /// second pass at once in another process (`mssql-cdc-writer maintain`).
    Maintain { target: Maintained, beside: bool },
    /// Cleanup purges every change up to the source's `max_lsn`; each table's next stream
    /// meets it as `on_data_loss` says: `skip` passes it with a `data_skipped` row, `fail`
    /// stops until an operator sets skip.
    Purge { skip: [bool; 2] },
    /// Silver of `table` applied (after an available-now stream).
    Apply {
        table: Table,
        deletion_vectors: bool,
    },
    /// Silver of `table` reconciled with the source, silver first corrupted by another
    /// engine (a row deleted) when `corrupt`.
    Reconcile { table: Table, corrupt: bool },
    /// Two available-now streams of one app id at once: one may be fenced, nothing doubles.
    SecondWriter { table: Table },
    /// The writer binary streaming `table` available-now, aborted at a crash point.
    Crash { table: Table, point: usize },
    /// Two operations at once.
    Together(Box<Op>, Box<Op>),
}

/// What the model knows beyond the journal.
#[derive(Default)]
struct Knowledge {
    /// The highest LSN a cleanup purged through.
    purged_through: Option<Lsn>,
    /// Tables whose stream skipped purged changes (their silver cannot equal the source).
    lossy: BTreeSet<Table>,
    /// Tables whose stream meets a purge by failing (until set to skip).
    failing_on_loss: BTreeSet<Table>,
    /// Tables silver was applied to.
    applied: BTreeSet<Table>,
    /// Tables whose silver another engine corrupted, and the key of the row it deleted.
    corrupted: BTreeMap<Table, i64>,
    /// Operations run, by kind, and pairs run together.
    covered: BTreeMap<String, u64>,
}

struct World {
    lab: Lab,
    /// Shared by the two operations of a step that runs two at once.
    known: Mutex<Knowledge>,
}

/// A failed check: what it found.
type Failure = String;

impl World {
    async fn new() -> World {
        World {
            lab: Lab::new().await,
            known: Mutex::default(),
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Knowledge> {
        self.known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn config(&self, table: Table) -> StreamConfig {
        let mut config = self.lab.stream_of(table.source(), table.name());
        config.fail_on_data_loss = self.known().failing_on_loss.contains(&table);
        config
    }

    fn apply_config(&self, table: Table, deletion_vectors: bool) -> silver::ApplyConfig {
        silver::ApplyConfig {
            table: table.source().into(),
            bronze: self.lab.lake(&format!("bronze_{}", table.name())),
            target: self.lab.lake(&format!("silver_{}", table.name())),
            capture_instance: None,
            keys: vec![table.key().into()],
            control: self.lab.lake("control"),
            facts: Some(self.lab.lake("facts")),
            granularity: control::Granularity::Minute,
            deletion_vectors,
        }
    }

    fn commit(&self, table: Table, commits: u64, seed: u64) {
        let mut writer = self.lab.writer(seed);
        let spec = WorkloadSpec {
            commits: Some(commits),
            tables: vec![table.source().parse().expect("table name")],
            ..WorkloadSpec::default()
        };
        workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    }

    /// Runs `op`; a check that fails inside it is its failure.
    fn run<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            *self.known().covered.entry(kind(op)).or_default() += 1;
            match op {
                Op::Commit {
                    table,
                    commits,
                    seed,
                } => {
                    let (world, table, commits, seed) = (self, *table, *commits, *seed);
                    tokio::task::block_in_place(|| world.commit(table, commits, seed));
                    Ok(())
                }
                Op::Stream {
                    table,
                    continuous,
                    live_tail,
                    max_commits,
                } => {
                    let mut config = self.config(*table);
                    config.max_commits = *max_commits;
                    if *continuous {
                        self.stream_continuous(*table, config, *live_tail).await
                    } else {
                        let outcome = common::try_run_now(config).await.map(|_| ());
                        self.stream_outcome(*table, outcome, false)
                    }
                }
                Op::Maintain { target, beside } => self.maintain(*target, *beside).await,
                Op::Purge { skip } => self.purge(*skip).await,
                Op::Apply {
                    table,
                    deletion_vectors,
                } => self.apply(*table, *deletion_vectors).await,
                Op::Reconcile { table, corrupt } => self.reconcile(*table, *corrupt).await,
                Op::SecondWriter { table } => {
                    let config = self.config(*table);
                    let (first, second) = tokio::join!(
                        common::try_run_now(config.clone()),
                        common::try_run_now(config)
                    );
                    self.stream_outcome(*table, first.map(|_| ()), true)?;
                    self.stream_outcome(*table, second.map(|_| ()), true)
                }
                Op::Crash { table, point } => self.crash(*table, CRASH_POINTS[*point]).await,
                Op::Together(first, second) => {
                    *self
                        .known()
                        .covered
                        .entry(format!("{} + {}", kind(first), kind(second)))
                        .or_default() += 1;
                    let (a, b) = tokio::join!(self.run(first), self.run(second));
                    a.and(b)
                }
            }
        })
    }

    /// A stream's end: purged changes under `fail` stop it (and the operator sets skip), a
    /// second writer may be fenced when `fenced_allowed`; any other error is a failure.
    fn stream_outcome(
        &self,
        table: Table,
        outcome: mssql_cdc_writer::Result<()>,
        fenced_allowed: bool,
    ) -> Result<(), Failure> {
        match outcome {
            Ok(()) => Ok(()),
            Err(WriterError::DataLoss { .. }) => self.stopped_by_purge(table),
            Err(WriterError::Fenced(_)) if fenced_allowed => Ok(()),
            Err(error) => Err(format!("stream of {}: {error}", table.source())),
        }
    }

    /// A stream of `table` stopped by purged changes: expected under `fail`, after which the
    /// operator sets skip; a failure under skip.
    fn stopped_by_purge(&self, table: Table) -> Result<(), Failure> {
        if self.known().failing_on_loss.remove(&table) {
            Ok(())
        } else {
            Err(format!(
                "the stream of {} stopped at purged changes although told to skip them",
                table.source()
            ))
        }
    }

    /// Runs a continuous stream until bronze holds every change of the table committed
    /// before it started (60 s at most: a stream that cannot keep up fails the check).
    async fn stream_continuous(
        &self,
        table: Table,
        config: StreamConfig,
        live_tail: bool,
    ) -> Result<(), Failure> {
        let expected = self.journal(table);
        let mut stream = match Stream::connect(config).await {
            Ok(stream) => stream,
            Err(error) => return self.stream_outcome(table, Err(error), false),
        };
        let waiting = mssql_cdc_writer::tail::Waiting {
            poll: Duration::from_millis(100),
            live_tail,
        };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut running =
            tokio::spawn(async move { stream.run_continuous(waiting, stopped).await });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut kept_up = false;
        while Instant::now() < deadline && !running.is_finished() {
            let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
            if expected
                .iter()
                .all(|row| held.contains(row) || self.purged(table, row))
            {
                kept_up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = stop.send(true);
        let ended = tokio::time::timeout(Duration::from_secs(120), &mut running).await;
        let outcome = match ended {
            Ok(joined) => joined
                .map_err(|error| format!("stream task: {error}"))?
                .map(|_| ()),
            Err(_) => {
                running.abort();
                return Err("a stopped continuous stream did not end within 120 s".into());
            }
        };
        let failed = outcome.is_err();
        self.stream_outcome(table, outcome, false)?;
        if !kept_up && !failed {
            return Err(format!(
                "the continuous stream of {} did not reach the {} changes committed before it \
                 started within 60 s",
                table.source(),
                expected.len()
            ));
        }
        Ok(())
    }

    /// Whether `row` of `table` may be missing: purged before its stream read it, with the
    /// stream told to skip.
    fn purged(&self, table: Table, row: &Change) -> bool {
        let known = self.known();
        known.lossy.contains(&table)
            && known
                .purged_through
                .is_some_and(|cut| row.0.parse::<Lsn>().is_ok_and(|lsn| lsn <= cut))
    }

    async fn maintain(&self, target: Maintained, beside: bool) -> Result<(), Failure> {
        let (location, kind) = match target {
            Maintained::Bronze(table) => (
                self.lab.lake(&format!("bronze_{}", table.name())),
                TableKind::Bronze,
            ),
            Maintained::Silver(table) => (
                self.lab.lake(&format!("silver_{}", table.name())),
                TableKind::Silver,
            ),
            Maintained::Facts => (self.lab.lake("facts"), TableKind::Facts),
            Maintained::Control => (self.lab.lake("control"), TableKind::Control),
        };
        let options = MaintenanceOptions {
            min_files: 2,
            ..MaintenanceOptions::default()
        };
        let other = beside.then(|| {
            Command::new(WRITER)
                .args(["maintain", "--location", &location, "--kind", kind.name()])
                .args(["--min-files", "2"])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("maintain process")
        });
        let here = maintenance::maintain(&location, kind, &options).await;
        if let Some(child) = other {
            let output = tokio::task::spawn_blocking(move || child.wait_with_output())
                .await
                .expect("task")
                .expect("wait");
            if !output.status.success() {
                return Err(format!(
                    "the other process's maintain of {location} failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
        here.map(|_| ())
            .map_err(|error| format!("maintain {location}: {error}"))
    }

    async fn purge(&self, skip: [bool; 2]) -> Result<(), Failure> {
        let Some(cut) = self.lab.db.max_lsn().await.expect("max_lsn") else {
            return Ok(());
        };
        // An idle entry past the cut, so the purge leaves the source a max_lsn beyond it.
        let mut writer = self.lab.writer(0);
        writer.idle();
        writer.publish().expect("publish");
        drop(writer);
        self.lab.db.cleanup(None, cut).expect("cleanup");
        self.known().purged_through = Some(cut);
        for (table, skip) in Table::ALL.into_iter().zip(skip) {
            if skip {
                self.known().failing_on_loss.remove(&table);
            } else {
                self.known().failing_on_loss.insert(table);
            }
            // A table whose stream had read everything through the cut loses nothing; one
            // behind it may, once its stream skips.
            let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
            let behind = self
                .journal(table)
                .iter()
                .any(|row| !held.contains(row) && row.0.parse::<Lsn>().is_ok_and(|l| l <= cut));
            if behind {
                self.known().lossy.insert(table);
            }
        }
        Ok(())
    }

    async fn apply(&self, table: Table, deletion_vectors: bool) -> Result<(), Failure> {
        let outcome = common::try_run_now(self.config(table)).await.map(|_| ());
        self.stream_outcome(table, outcome, false)?;
        silver::apply_changes(&self.apply_config(table, deletion_vectors))
            .await
            .map_err(|error| format!("apply {}: {error}", table.source()))?;
        let silver_url =
            tables::table_url(&self.lab.lake(&format!("silver_{}", table.name()))).expect("url");
        let made = tables::open(&silver_url).await.expect("open").is_some();
        let exact = {
            let mut known = self.known();
            if made {
                known.applied.insert(table);
            }
            !known.lossy.contains(&table) && !known.corrupted.contains_key(&table)
        };
        if !exact || !self.stream_current(table).await {
            return Ok(());
        }
        let silver = self.silver_rows(table).await;
        let source = source_rows_of(&self.lab, table.source(), table.key()).await;
        if silver != source {
            return Err(format!(
                "silver of {} differs from the source after an apply over a current bronze: {}",
                table.source(),
                difference(&silver, &source)
            ));
        }
        Ok(())
    }

    /// Silver's rows of `table` (none before its first apply made it).
    async fn silver_rows(&self, table: Table) -> Rows {
        let location = self.lab.lake(&format!("silver_{}", table.name()));
        let url = tables::table_url(&location).expect("url");
        match tables::open(&url).await.expect("open") {
            Some(_) => current_rows_by(&location, table.key()).await,
            None => Rows::new(),
        }
    }

    /// Whether bronze holds every change of `table` the journal has.
    async fn stream_current(&self, table: Table) -> bool {
        let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
        self.journal(table).iter().all(|row| held.contains(row))
    }

    async fn reconcile(&self, table: Table, corrupt: bool) -> Result<(), Failure> {
        if !self.known().applied.contains(&table) {
            return self.apply(table, false).await;
        }
        let location = self.lab.lake(&format!("silver_{}", table.name()));
        if corrupt {
            // Another engine deletes a row of silver: from now on silver differs from the
            // source, and no reconcile of it may verify.
            let rows = self.silver_rows(table).await;
            if let Some(key) = rows.keys().next() {
                let silver = common::open_table(&location).await;
                common::delete_where(silver, &format!("{} = {key}", table.key())).await;
                self.known().corrupted.insert(table, *key);
            }
        }
        let config = reconcile::ReconcileConfig {
            server: self.lab.url.clone(),
            table: table.source().into(),
            silver: location.clone(),
            bronze: self.lab.lake(&format!("bronze_{}", table.name())),
            control: self.lab.lake("control"),
            facts: Some(self.lab.lake("facts")),
            keys: None,
            bucket_rows: 1_000_000,
            sample: 1.0,
            seed: Some(1),
            report: None,
        };
        let result = match reconcile::reconcile(&config).await {
            Ok(result) => result,
            // The keys in flight are read from the change table where the stream stands: a
            // purge past it leaves nothing to read them from, and reconcile says so.
            Err(WriterError::Flight(error))
                if error.code() == Some(tonic::Code::DataLoss)
                    && self.behind_purge(table).await =>
            {
                return Ok(());
            }
            Err(error) => return Err(format!("reconcile {}: {error}", table.source())),
        };
        if !result.verified {
            return Ok(());
        }
        let changed_since: BTreeSet<i64> = self
            .journal(table)
            .iter()
            .filter(|row| {
                row.0
                    .parse::<Lsn>()
                    .is_ok_and(|lsn| lsn > result.compared_lsn)
            })
            .map(|row| row.3)
            .collect();
        let corrupted = self.known().corrupted.get(&table).copied();
        if let Some(key) = corrupted
            && !changed_since.contains(&key)
            && !self.silver_rows(table).await.contains_key(&key)
            && source_rows_of(&self.lab, table.source(), table.key())
                .await
                .contains_key(&key)
        {
            // A key no change touched since the compared LSN, missing from silver: no change
            // in flight explains it. (A deleted row whose key changed since is IN_FLIGHT: a
            // verified LSN claims every row but the keys changed after it; comparing those
            // at the compared LSN is issue "Reconcile that means what it says".)
            return Err(format!(
                "reconcile verified {} at {} although another engine deleted its row of key {key} \
                 from silver, and no change since explains it",
                table.source(),
                result.compared_lsn
            ));
        }
        // With no change of the table after the compared LSN, the source now is the source
        // at that LSN: silver must equal it.
        if !changed_since.is_empty() {
            return Ok(());
        }
        let silver = self.silver_rows(table).await;
        let source = source_rows_of(&self.lab, table.source(), table.key()).await;
        if silver != source {
            return Err(format!(
                "reconcile verified {} at {} while silver differs from the source: {}",
                table.source(),
                result.compared_lsn,
                difference(&silver, &source)
            ));
        }
        Ok(())
    }

    async fn crash(&self, table: Table, point: &str) -> Result<(), Failure> {
        let config = self.config(table);
        let mut command = Command::new(WRITER);
        command
            .args(["run", "--server", &self.lab.url, "--table", table.source()])
            .args(["--target", &config.target, "--facts", &config.facts])
            .args(["--control", config.control.as_deref().expect("control")])
            .args([
                "--app-id",
                &config.app_id,
                "--checkpoint",
                &config.checkpoint,
            ])
            .args(["--max-commits", "40", "--available-now"])
            .env(CRASH_AT_VARIABLE, point)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if !config.fail_on_data_loss {
            command.arg("--skip-data-loss");
        }
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .expect("task")
            .expect("writer");
        let stderr = String::from_utf8_lossy(&output.stderr);
        // Aborted at the point, or ended without reaching it (nothing new), or stopped by a
        // purge under fail: anything else is a failure.
        if output.status.success() || stderr.contains(CRASH_AT_VARIABLE) {
            return Ok(());
        }
        if stderr.contains("DATA_LOSS") || stderr.contains("purged") {
            return self.stopped_by_purge(table);
        }
        Err(format!(
            "the writer run to crash at {point} failed: {stderr}"
        ))
    }

    fn journal(&self, table: Table) -> Vec<Change> {
        self.lab.committed_of(table.source())
    }

    /// The invariants every step keeps.
    async fn check(&self) -> Result<(), Failure> {
        for table in Table::ALL {
            self.check_bronze(table).await?;
            self.check_verdict(table).await?;
        }
        self.check_facts().await
    }

    async fn check_bronze(&self, table: Table) -> Result<(), Failure> {
        let held = bronze_rows(&self.lab, table).await;
        let journal: BTreeSet<_> = self.journal(table).into_iter().collect();
        let mut seen = BTreeSet::new();
        for row in &held {
            if !seen.insert(row) {
                return Err(format!("bronze of {} holds {row:?} twice", table.source()));
            }
            if !journal.contains(row) {
                return Err(format!(
                    "bronze of {} holds {row:?}, which was never committed",
                    table.source()
                ));
            }
        }
        let Some(through) = self.committed_through(table).await else {
            return Ok(());
        };
        if let Some(missing) = journal.iter().find(|row| {
            row.0.parse::<Lsn>().is_ok_and(|lsn| lsn <= through)
                && !seen.contains(row)
                && !self.purged(table, row)
        }) {
            return Err(format!(
                "bronze of {} lacks {missing:?}, through its checkpoint's last committed batch \
                 (end {through})",
                table.source()
            ));
        }
        Ok(())
    }

    /// Whether a purge passed the end of the stream's last committed batch.
    async fn behind_purge(&self, table: Table) -> bool {
        let cut = self.known().purged_through;
        match (cut, self.committed_through(table).await) {
            (Some(cut), Some(through)) => through < cut,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The end of the checkpoint's last committed batch.
    async fn committed_through(&self, table: Table) -> Option<Lsn> {
        let checkpoint = Checkpoint::open(&self.config(table).checkpoint)
            .await
            .expect("checkpoint");
        let last = checkpoint.last().await.expect("last")?;
        if last.committed {
            Some(last.end.lsn)
        } else {
            Some(last.start.lsn)
        }
    }

    async fn check_verdict(&self, table: Table) -> Result<(), Failure> {
        let url = tables::table_url(&self.lab.lake("control")).expect("url");
        let Some(verdict) = control::finalized_until(&url, table.source())
            .await
            .map_err(|error| format!("control: {error}"))?
        else {
            return Ok(());
        };
        let checkpoint = Checkpoint::open(&self.config(table).checkpoint)
            .await
            .expect("checkpoint");
        let Some(last) = checkpoint.last().await.expect("last") else {
            return Err(format!("a verdict for {} before any batch", table.source()));
        };
        let end = if last.committed { last.end } else { last.start };
        // The verdict says every change up to it is in bronze: it cannot pass the commit
        // time of the end of what is committed.
        if end.commit_ts.is_some_and(|ts| verdict > ts) {
            return Err(format!(
                "the verdict of {} ({verdict:?}) is past its last committed batch's end ({:?})",
                table.source(),
                end.commit_ts
            ));
        }
        Ok(())
    }

    async fn check_facts(&self) -> Result<(), Failure> {
        let url = tables::table_url(&self.lab.lake("facts")).expect("url");
        let rows = tables::query_text(
            &url,
            "SELECT app_id, batch_id, count(*) FROM t WHERE event IS NULL AND batch_id IS NOT NULL \
             GROUP BY app_id, batch_id ORDER BY app_id, batch_id",
        )
        .await
        .map_err(|error| format!("facts: {error}"))?;
        let mut ids: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for row in rows {
            let app = row[0].clone().unwrap_or_default();
            let id: i64 = row[1].as_deref().unwrap_or("-1").parse().unwrap_or(-1);
            if row[2].as_deref() != Some("1") {
                return Err(format!(
                    "facts hold batch {id} of {app} {} times",
                    row[2].as_deref().unwrap_or("?")
                ));
            }
            ids.entry(app).or_default().push(id);
        }
        for (app, ids) in &ids {
            if ids.iter().copied().ne(0..ids.len() as i64) {
                return Err(format!("facts batch ids of {app} are not 0..: {ids:?}"));
            }
        }
        for table in Table::ALL {
            let checkpoint = Checkpoint::open(&self.config(table).checkpoint)
                .await
                .expect("checkpoint");
            if let Some(last) = checkpoint.last().await.expect("last")
                && last.committed
            {
                let held = ids.get(table.name()).map_or(0, Vec::len) as i64;
                if held <= last.batch_id {
                    return Err(format!(
                        "the checkpoint of {} committed batch {} but facts hold {held} batches",
                        table.name(),
                        last.batch_id
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every table of the lake read by the Python `deltalake` package: the same row count
    /// as delta-rs reads.
    async fn check_python_reads(&self) -> Result<(), Failure> {
        let python = python();
        let lake = self.lab.dir.path().join("lake");
        let mut expected = BTreeMap::new();
        for entry in std::fs::read_dir(&lake).map_err(|error| format!("lake: {error}"))? {
            let path = entry.map_err(|error| error.to_string())?.path();
            let location = path.display().to_string();
            let url = tables::table_url(&location).expect("url");
            if tables::open(&url).await.ok().flatten().is_none() {
                continue;
            }
            let count = tables::query_text(&url, "SELECT count(*) FROM t")
                .await
                .map_err(|error| format!("{location}: {error}"))?;
            expected.insert(location, count[0][0].clone().unwrap_or_default());
        }
        // The package's pyarrow path refuses deletion vectors; its DataFusion path reads
        // every table.
        let script = "import sys\n\
            from deltalake import DeltaTable, QueryBuilder\n\
            for path in sys.argv[1:]:\n\
            \x20   query = QueryBuilder().register('t', DeltaTable(path))\n\
            \x20   count = query.execute('SELECT count(*) AS n FROM t').read_all()\n\
            \x20   print(path, count.column(0)[0].as_py())\n";
        let output = Command::new(&python)
            .arg("-c")
            .arg(script)
            .args(expected.keys())
            .output()
            .map_err(|error| format!("{}: {error}", python.display()))?;
        if !output.status.success() {
            return Err(format!(
                "the Python deltalake package could not read the lake: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let text = String::from_utf8_lossy(&output.stdout);
        for line in text.lines() {
            let (path, count) = line.rsplit_once(' ').unwrap_or((line, ""));
            if expected.get(path).map(String::as_str) != Some(count) {
                return Err(format!(
                    "the Python deltalake package reads {count} rows in {path}, delta-rs {:?}",
                    expected.get(path)
                ));
            }
        }
        Ok(())
    }
}

/// A journal or bronze row: `(start_lsn, seqval, operation, key)`.
type Change = (String, String, i32, i64);

/// Bronze's change rows of `table` (none when there is no bronze yet).
async fn bronze_rows(lab: &Lab, table: Table) -> Vec<Change> {
    let location = lab.lake(&format!("bronze_{}", table.name()));
    let url = tables::table_url(&location).expect("url");
    if tables::open(&url).await.expect("open").is_none() {
        return Vec::new();
    }
    let batches = common::query(
        &location,
        &format!(
            "SELECT _start_lsn, _seqval, _operation, CAST({} AS BIGINT) FROM t WHERE _operation <> 0",
            table.key()
        ),
    )
    .await;
    let mut rows = Vec::new();
    for batch in batches {
        let (lsns, seqvals) = (utf8(batch.column(0)), utf8(batch.column(1)));
        let operations =
            arrow::compute::cast(batch.column(2), &arrow::datatypes::DataType::Int32).expect("int");
        let operations = operations
            .as_any()
            .downcast_ref::<arrow::array::Int32Array>()
            .expect("int");
        let keys = batch
            .column(3)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>()
            .expect("bigint");
        for row in 0..batch.num_rows() {
            rows.push((
                lsns.value(row).to_string(),
                seqvals.value(row).to_string(),
                operations.value(row),
                keys.value(row),
            ));
        }
    }
    rows.sort();
    rows
}

/// The first keys where two row sets differ.
fn difference(left: &Rows, right: &Rows) -> String {
    let mut text = String::new();
    let keys: BTreeSet<_> = left.keys().chain(right.keys()).collect();
    for key in keys
        .into_iter()
        .filter(|key| left.get(key) != right.get(key))
        .take(3)
    {
        let _ = write!(
            text,
            "key {key}: silver {:?}, source {:?}; ",
            left.get(key),
            right.get(key)
        );
    }
    text
}

/// The operation's kind, for the coverage count.
fn kind(op: &Op) -> String {
    match op {
        Op::Commit { table, .. } => format!("commit {}", table.name()),
        Op::Stream {
            continuous,
            max_commits,
            live_tail,
            ..
        } => format!(
            "stream {}{}{}",
            if *continuous {
                "continuous"
            } else {
                "available-now"
            },
            if *continuous && *live_tail {
                " live-tail"
            } else {
                ""
            },
            if max_commits.is_some() {
                " max_commits"
            } else {
                ""
            }
        ),
        Op::Maintain { target, beside } => format!(
            "maintain {}{}",
            match target {
                Maintained::Bronze(_) => "bronze",
                Maintained::Silver(_) => "silver",
                Maintained::Facts => "facts",
                Maintained::Control => "control",
            },
            if *beside {
                " beside another process"
            } else {
                ""
            }
        ),
        Op::Purge { .. } => "purge".into(),
        Op::Apply {
            deletion_vectors, ..
        } => format!(
            "apply {}",
            if *deletion_vectors {
                "deletion vectors"
            } else {
                "copy-on-write"
            }
        ),
        Op::Reconcile { corrupt, .. } => format!(
            "reconcile{}",
            if *corrupt { " after corruption" } else { "" }
        ),
        Op::SecondWriter { .. } => "second writer".into(),
        Op::Crash { point, .. } => format!("crash {}", CRASH_POINTS[*point]),
        Op::Together(..) => "together".into(),
    }
}

/// A random operation; `alone` ones (purges, reconciles, crashes) are never paired.
fn random_op(rng: &mut StdRng, pairable: bool) -> Op {
    let table = if rng.random_bool(0.5) {
        Table::Busy
    } else {
        Table::Quiet
    };
    let roll = rng.random_range(0..100);
    match roll {
        0..25 => {
            let commits = match table {
                Table::Busy => rng.random_range(20..200),
                Table::Quiet => rng.random_range(1..6),
            };
            Op::Commit {
                table,
                commits,
                seed: rng.random(),
            }
        }
        25..50 => Op::Stream {
            table,
            continuous: rng.random_bool(0.4),
            live_tail: rng.random_bool(0.5),
            max_commits: rng.random_bool(0.5).then(|| rng.random_range(5..60)),
        },
        50..62 => Op::Maintain {
            target: match rng.random_range(0..10) {
                0..5 => Maintained::Bronze(table),
                5..7 => Maintained::Silver(table),
                7..9 => Maintained::Facts,
                _ => Maintained::Control,
            },
            beside: rng.random_bool(0.5),
        },
        62..72 => Op::Apply {
            table,
            deletion_vectors: rng.random_bool(0.5),
        },
        72..80 if !pairable => Op::Reconcile {
            table,
            corrupt: rng.random_bool(0.4),
        },
        80..84 if !pairable => Op::Purge {
            skip: [rng.random_bool(0.6), rng.random_bool(0.6)],
        },
        84..90 if !pairable => Op::SecondWriter { table },
        90..95 if !pairable => Op::Crash {
            table,
            point: rng.random_range(0..CRASH_POINTS.len()),
        },
        95..100 if !pairable => {
            // Two streams of one table at once are a second writer (its own operation).
            let first = random_op(rng, true);
            let mut second = random_op(rng, true);
            while streamed(&first).is_some() && streamed(&first) == streamed(&second) {
                second = random_op(rng, true);
            }
            Op::Together(Box::new(first), Box::new(second))
        }
        _ => Op::Stream {
            table,
            continuous: false,
            live_tail: false,
            max_commits: None,
        },
    }
}

/// The table `op` streams (an apply streams first), if any.
fn streamed(op: &Op) -> Option<Table> {
    match op {
        Op::Stream { table, .. } | Op::Apply { table, .. } => Some(*table),
        _ => None,
    }
}

/// The schedule of `seed`: `steps` operations.
fn schedule(seed: u64, steps: usize) -> Vec<Op> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..steps).map(|_| random_op(&mut rng, false)).collect()
}

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
        world.run(op).await.map_err(|failure| (step, failure))?;
        world.check().await.map_err(|failure| (step, failure))?;
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

/// The shortest schedule found that still fails the same way: steps dropped one at a time
/// (and the schedule cut after the failing step) while a failure of the kind of `first`
/// stays.
async fn shrink(mut schedule: Vec<Op>, failed_at: usize, first: &str) -> (Vec<Op>, Failure) {
    schedule.truncate(failed_at + 1);
    let mut failure = first.to_string();
    let mut index = schedule.len();
    while index > 0 {
        index -= 1;
        let mut shorter = schedule.clone();
        shorter.remove(index);
        if let Err((at, found)) = run_schedule(&shorter, false).await
            && same_kind(&found, first)
        {
            shorter.truncate(at + 1);
            schedule = shorter;
            failure = found;
            index = index.min(schedule.len());
        }
    }
    (schedule, failure)
}

/// Whether two failures are of one kind: the same text before the first ": " (the check or
/// operation that failed), so shrinking keeps the failure it started from.
fn same_kind(found: &str, first: &str) -> bool {
    let head = |text: &str| text.split(": ").next().unwrap_or(text).to_string();
    head(found) == head(first)
}

/// The Python with the `deltalake` package: `MSSQL_CDC_PYTHON`, else the repository's `.venv`
/// (scripts/test makes it).
fn python() -> std::path::PathBuf {
    if let Some(python) = std::env::var_os("MSSQL_CDC_PYTHON") {
        return python.into();
    }
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

struct Args {
    seeds: Vec<u64>,
    steps: usize,
    schedule: Option<Vec<Op>>,
}

fn args() -> Args {
    let mut args = Args {
        seeds: CI_SEEDS.collect(),
        steps: CI_STEPS,
        schedule: None,
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
        match runtime.block_on(run_schedule(&ops, true)) {
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
