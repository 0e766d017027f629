//! The world a schedule runs in (a simulated database, its server, a lake) and what each
//! operation does to it.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::maintenance::{self, MaintenanceOptions};
use mssql_cdc_writer::stream::{CRASH_AT_VARIABLE, Stream, StreamConfig};
use mssql_cdc_writer::tables::{self, TableKind};
use mssql_cdc_writer::{control, reconcile, silver};

use crate::WRITER;
use crate::checks::{Change, bronze_rows, difference};
use crate::common::{self, Lab, Rows, current_rows_by, source_rows_of};
use crate::ops::{CRASH_POINTS, Maintained, Op, Table, kind};

/// What the model knows beyond the journal.
#[derive(Default)]
pub(crate) struct Knowledge {
    /// The highest LSN a cleanup purged through.
    pub(crate) purged_through: Option<Lsn>,
    /// Tables whose stream skipped purged changes (their silver cannot equal the source).
    pub(crate) lossy: BTreeSet<Table>,
    /// Tables whose stream meets a purge by failing (until set to skip).
    pub(crate) failing_on_loss: BTreeSet<Table>,
    /// Tables silver was applied to.
    pub(crate) applied: BTreeSet<Table>,
    /// Tables whose silver another engine corrupted, and the key of the row it deleted.
    pub(crate) corrupted: BTreeMap<Table, i64>,
    /// Operations run, by kind, and pairs run together.
    pub(crate) covered: BTreeMap<String, u64>,
}

pub(crate) struct World {
    pub(crate) lab: Lab,
    /// Shared by the two operations of a step that runs two at once.
    pub(crate) known: Mutex<Knowledge>,
}

/// A failed check: what it found.
pub(crate) type Failure = String;

impl World {
    pub(crate) async fn new() -> World {
        World {
            lab: Lab::new().await,
            known: Mutex::default(),
        }
    }

    pub(crate) fn known(&self) -> std::sync::MutexGuard<'_, Knowledge> {
        self.known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn config(&self, table: Table) -> StreamConfig {
        let mut config = self.lab.stream_of(table.source(), table.name());
        config.fail_on_data_loss = self.known().failing_on_loss.contains(&table);
        config
    }

    pub(crate) fn apply_config(&self, table: Table, deletion_vectors: bool) -> silver::ApplyConfig {
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

    pub(crate) fn commit(&self, table: Table, commits: u64, seed: u64) {
        let mut writer = self.lab.writer(seed);
        let spec = WorkloadSpec {
            commits: Some(commits),
            tables: vec![table.source().parse().expect("table name")],
            ..WorkloadSpec::default()
        };
        workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("workload");
    }

    /// Runs `op`; a check that fails inside it is its failure.
    pub(crate) fn run<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<(), Failure>> {
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
    pub(crate) fn stream_outcome(
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
    pub(crate) fn stopped_by_purge(&self, table: Table) -> Result<(), Failure> {
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
    pub(crate) async fn stream_continuous(
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
    pub(crate) fn purged(&self, table: Table, row: &Change) -> bool {
        let known = self.known();
        known.lossy.contains(&table)
            && known
                .purged_through
                .is_some_and(|cut| row.0.parse::<Lsn>().is_ok_and(|lsn| lsn <= cut))
    }

    pub(crate) async fn maintain(&self, target: Maintained, beside: bool) -> Result<(), Failure> {
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

    pub(crate) async fn purge(&self, skip: [bool; 2]) -> Result<(), Failure> {
        let Some(cut) = self.lab.purge_to_max_lsn(0).await else {
            return Ok(());
        };
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

    pub(crate) async fn apply(&self, table: Table, deletion_vectors: bool) -> Result<(), Failure> {
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
        if let Some(difference) = self.silver_differs(table).await {
            return Err(format!(
                "silver of {} differs from the source after an apply over a current bronze: \
                 {difference}",
                table.source()
            ));
        }
        Ok(())
    }

    /// Silver's rows of `table` (none before its first apply made it).
    pub(crate) async fn silver_rows(&self, table: Table) -> Rows {
        let location = self.lab.lake(&format!("silver_{}", table.name()));
        let url = tables::table_url(&location).expect("url");
        match tables::open(&url).await.expect("open") {
            Some(_) => current_rows_by(&location, table.key()).await,
            None => Rows::new(),
        }
    }

    /// Where silver of `table` differs from the source now (its first keys), if it does.
    pub(crate) async fn silver_differs(&self, table: Table) -> Option<String> {
        let silver = self.silver_rows(table).await;
        let source = source_rows_of(&self.lab, table.source(), table.key()).await;
        (silver != source).then(|| difference(&silver, &source))
    }

    /// Whether bronze holds every change of `table` the journal has.
    pub(crate) async fn stream_current(&self, table: Table) -> bool {
        let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
        self.journal(table).iter().all(|row| held.contains(row))
    }

    pub(crate) async fn reconcile(&self, table: Table, corrupt: bool) -> Result<(), Failure> {
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
        if let Some(difference) = self.silver_differs(table).await {
            return Err(format!(
                "reconcile verified {} at {} while silver differs from the source: {difference}",
                table.source(),
                result.compared_lsn
            ));
        }
        Ok(())
    }

    pub(crate) async fn crash(&self, table: Table, point: &str) -> Result<(), Failure> {
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

    pub(crate) fn journal(&self, table: Table) -> Vec<Change> {
        self.lab.committed_of(table.source())
    }
}
