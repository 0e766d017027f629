//! The world a schedule runs in (a simulated database, its server, a lake) and what each
//! operation does to it.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::sim::sample;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::data_loss::OnDataLoss;
use mssql_cdc_writer::maintenance::{self, MaintenanceOptions};
use mssql_cdc_writer::snapshot;
use mssql_cdc_writer::stream::{Stream, StreamConfig};
use mssql_cdc_writer::tables::{self, TableKind};
use mssql_cdc_writer::{control, reconcile, silver};

use crate::WRITER;
use crate::checks::{Change, bronze_rows, difference};
use crate::common::{self, ColumnSelection, Lab, Rows, current_rows_of, source_rows_of};
use crate::ops::{CRASH_POINTS, Maintained, OnLoss, Op, SchemaChange, Table, kind};
use crate::servers::Servers;
use mssql_cdc_flight::source::TableName;

/// What the model knows beyond the journal.
#[derive(Default)]
pub(crate) struct Knowledge {
    /// The highest LSN a cleanup purged through.
    pub(crate) purged_through: Option<Lsn>,
    /// Per table, the ranges `(where its stream stood, cut]` of the purges that passed it:
    /// bronze may lack the changes there.
    pub(crate) purged_ranges: BTreeMap<Table, Vec<(Option<Lsn>, Lsn)>>,
    /// Tables whose silver lacks what a purge took, since the cut (until a rebuild from a
    /// snapshot after the cut).
    pub(crate) lost_at: BTreeMap<Table, Lsn>,
    /// Tables whose bronze lost changes for good (a purge skipped, not healed by a
    /// re-snapshot): history keeps what it made of them, so it is not compared with the
    /// journal's model from then on (its invariants still are).
    pub(crate) history_inexact: BTreeSet<Table>,
    /// Each history's newest verdict (micros) and the versions it covered then: what a
    /// verdict covers never changes afterwards.
    pub(crate) history_verdicts: BTreeMap<Table, (i64, BTreeSet<common::history::VersionRow>)>,
    /// How each table's stream meets a purge (skip when not set).
    pub(crate) on_loss: BTreeMap<Table, OnLoss>,
    /// Tables under `resnapshot` whose stream the anti-loop guard stopped (a purge met after
    /// one healed, within `resnapshot_interval_days`): the operator reruns with the guard at
    /// 0, as its message says, until the next purge sets the policy anew.
    pub(crate) guard_off: BTreeSet<Table>,
    /// Each stop by the guard with the purge it met (`purged_through` then), checked against
    /// the facts: a heal came before it, at an S below that purge.
    pub(crate) guard_stops: Vec<(Table, Option<Lsn>)>,
    /// The newest complete snapshot of each table (its S).
    pub(crate) completed: BTreeMap<Table, Lsn>,
    /// The snapshot each silver was last rebuilt from.
    pub(crate) rebuilt_from: BTreeMap<Table, Lsn>,
    /// The chunked snapshot an operator paused, per table.
    pub(crate) paused: BTreeMap<Table, Lsn>,
    /// Tables silver was applied to.
    pub(crate) applied: BTreeSet<Table>,
    /// Tables whose silver another engine corrupted, and the key of the row it deleted or
    /// changed.
    pub(crate) corrupted: BTreeMap<Table, i64>,
    /// Tables whose stream leaves their toggled column out now (`Op::Reselect`).
    pub(crate) narrowed: BTreeSet<Table>,
    /// Tables whose selection an operator changed: silver's copy of the toggled column is
    /// not compared from then on (stale where no change touched a row since).
    pub(crate) reselected: BTreeSet<Table>,
    /// Operations run, by kind, and pairs run together.
    pub(crate) covered: BTreeMap<String, u64>,
}

pub(crate) struct World {
    pub(crate) lab: Lab,
    /// The servers every client of the world reads through (`lab.url`).
    pub(crate) servers: Servers,
    /// Shared by the two operations of a step that runs two at once.
    pub(crate) known: Mutex<Knowledge>,
}

/// A failed check: what it found.
pub(crate) type Failure = String;

impl World {
    pub(crate) async fn new() -> World {
        let mut lab =
            Lab::with_tables(&[sample::customers(), sample::orders(), sample::accounts()]).await;
        let servers = Servers::start(lab.db.clone()).await;
        lab.url = servers.url.clone();
        World {
            lab,
            servers,
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
        // Where the sidecar keeps the checkpoint of this app id: one checkpoint, whichever
        // process streams.
        config.checkpoint = format!("{}/{}", self.checkpoints(), table.name());
        let on_loss = self.on_loss(table);
        config.fail_on_data_loss = on_loss != OnLoss::Skip;
        config.columns = Some(self.selection(table));
        config.partitions = table.partitions();
        if on_loss == OnLoss::Resnapshot {
            config.on_data_loss = OnDataLoss::Resnapshot;
            if self.known().guard_off.contains(&table) {
                config.resnapshot_interval_days = Some(0.0);
            }
        }
        config
    }

    /// The column selection `table`'s stream is given now.
    pub(crate) fn selection(&self, table: Table) -> ColumnSelection {
        table.selection(self.known().narrowed.contains(&table))
    }

    /// The configuration of an operator's snapshot command (open, backfill): given no
    /// selection, it follows the one bronze records; before bronze exists, the stream's.
    pub(crate) async fn reader_config(&self, table: Table) -> StreamConfig {
        let mut config = self.config(table);
        let bronze = tables::table_url(&config.target).expect("url");
        if tables::open(&bronze).await.expect("open").is_some() {
            config.columns = None;
        }
        config
    }

    /// The selection a comparison of silver with the source uses: the stream's widest, and
    /// the toggled column left out too once it was ever changed.
    pub(crate) fn compared_selection(&self, table: Table) -> ColumnSelection {
        table.selection(self.known().reselected.contains(&table))
    }

    /// Counts a chunked snapshot the stream abandoned because its column selection changed.
    async fn learn_abandoned_by_selection(&self, config: &StreamConfig) -> Result<(), Failure> {
        let state = snapshot::state(config)
            .await
            .map_err(|error| format!("snapshot state of {}: {error}", config.table))?;
        if state
            .status
            .reason
            .is_some_and(|reason| reason.contains("the column selection changed"))
        {
            *self
                .known()
                .covered
                .entry("chunked snapshots abandoned as the column selection changed".into())
                .or_default() += 1;
        }
        Ok(())
    }

    /// Whether bronze of `table` records its toggled column as copied (reconcile compares
    /// it then).
    async fn toggled_copied(&self, table: Table) -> bool {
        let bronze = self.lab.lake(&format!("bronze_{}", table.name()));
        let url = tables::table_url(&bronze).expect("url");
        let Some(bronze) = tables::open(&url).await.expect("open") else {
            return true;
        };
        let recorded = mssql_cdc_writer::columns::recorded(&bronze).expect("recorded");
        !recorded
            .unwrap_or_default()
            .excludes(table.toggled_column())
    }

    /// The checkpoints' directory (the sidecar file's `checkpoints`).
    pub(crate) fn checkpoints(&self) -> String {
        self.lab
            .dir
            .path()
            .join("checkpoints")
            .display()
            .to_string()
    }

    pub(crate) fn on_loss(&self, table: Table) -> OnLoss {
        self.known()
            .on_loss
            .get(&table)
            .copied()
            .unwrap_or(OnLoss::Skip)
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

    /// A DBA's DDL (and capture-instance switch) on `table`.
    pub(crate) fn change_schema(&self, table: Table, change: SchemaChange) -> Result<(), Failure> {
        let name: TableName = table.source().parse().expect("table name");
        let mut writer = self.lab.writer(0);
        let failed = |error: mssql_cdc_flight::Error| format!("DDL on {}: {error}", table.source());
        match change {
            SchemaChange::AddColumnAndSwitch => {
                let manifest = self.lab.db.manifest().map_err(failed)?;
                let instances = manifest
                    .capture_instances
                    .iter()
                    .filter(|instance| instance.table == name)
                    .count();
                if instances >= 2 {
                    return Ok(()); // SQL Server allows two; the simulator disables none
                }
                writer
                    .add_column(&name, "extra", "decimal(9,2)", true)
                    .map_err(failed)?;
                let columns = self.lab.db.columns_of(&name).map_err(failed)?;
                writer
                    .enable_capture_instance(
                        &name,
                        &format!("{}_{}_v2", name.schema, name.name),
                        &columns,
                    )
                    .map_err(failed)?;
            }
            SchemaChange::WidenText => {
                let (column, wider) = match table {
                    Table::Busy => ("status", "varchar(40)"),
                    Table::Quiet => ("email", "nvarchar(400)"),
                    Table::Keyed => ("note", "nvarchar(200)"),
                };
                writer.alter_column(&name, column, wider).map_err(failed)?;
            }
        }
        writer.publish().map_err(failed)
    }

    /// Runs `op`; a check that fails inside it is its failure.
    pub(crate) fn run<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<(), Failure>> {
        self.run_beside(op, false)
    }

    /// Runs `op`, `paired` when another operation runs at once.
    fn run_beside<'a>(&'a self, op: &'a Op, paired: bool) -> BoxFuture<'a, Result<(), Failure>> {
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
                        let outcome = common::try_run_now(config.clone()).await.map(|_| ());
                        self.stream_outcome(*table, outcome, false)?;
                        self.learn_abandoned_by_selection(&config).await
                    }
                }
                Op::Maintain { target, beside } => self.maintain(*target, *beside).await,
                Op::Purge { on_loss } => self.purge(on_loss).await,
                Op::Snapshot { table, chunked } => self.open_snapshot(*table, *chunked).await,
                Op::Backfill { table, waves } => self.backfill(*table, *waves, paired).await,
                Op::Pause { table, paused } => self.pause(*table, *paused).await,
                Op::Schema { table, change } => {
                    let (world, table, change) = (self, *table, *change);
                    tokio::task::block_in_place(|| world.change_schema(table, change))
                }
                Op::Apply {
                    table,
                    deletion_vectors,
                } => self.apply(*table, *deletion_vectors).await,
                Op::Reconcile {
                    table,
                    corrupt,
                    value,
                } => {
                    self.reconcile(*table, corrupt.then_some(*value), *corrupt || !*value)
                        .await
                }
                Op::SecondWriter { table } => {
                    let config = self.config(*table);
                    let failing = self.on_loss(*table) == OnLoss::Fail;
                    let (first, second) = tokio::join!(
                        common::try_run_now(config.clone()),
                        common::try_run_now(config)
                    );
                    // Both ran under the policy of their start: under fail, each may stop
                    // at the purge (the first one's stop has the operator set skip).
                    for outcome in [first.map(|_| ()), second.map(|_| ())] {
                        match outcome {
                            Err(WriterError::DataLoss { .. }) if failing => {
                                self.known().on_loss.insert(*table, OnLoss::Skip);
                            }
                            outcome => self.stream_outcome(*table, outcome, true)?,
                        }
                    }
                    Ok(())
                }
                Op::Crash { table, point } => self.crash(*table, CRASH_POINTS[*point]).await,
                Op::Reselect { table, narrow } => {
                    let mut known = self.known();
                    let changed = match narrow {
                        true => known.narrowed.insert(*table),
                        false => known.narrowed.remove(table),
                    };
                    if changed {
                        known.reselected.insert(*table);
                    }
                    Ok(())
                }
                Op::Sidecar {
                    tenths,
                    kill,
                    deletion_vectors,
                    replicas,
                } => {
                    self.sidecar(*tenths, *kill, *deletion_vectors, *replicas)
                        .await
                }
                Op::Restart {
                    tenths,
                    down,
                    rekey,
                } => {
                    tokio::time::sleep(Duration::from_millis(100 * tenths)).await;
                    let cut = self
                        .servers
                        .restart(Duration::from_millis(100 * down), *rekey)
                        .await;
                    *self
                        .known()
                        .covered
                        .entry("connections cut by server restarts".into())
                        .or_default() += cut as u64;
                    Ok(())
                }
                Op::Together(first, second) => {
                    *self
                        .known()
                        .covered
                        .entry(format!("{} + {}", kind(first), kind(second)))
                        .or_default() += 1;
                    let (a, b) =
                        tokio::join!(self.run_beside(first, true), self.run_beside(second, true));
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
            Ok(()) => {
                // The operator's rerun with the guard at 0 went through: back to the default.
                self.known().guard_off.remove(&table);
                Ok(())
            }
            Err(WriterError::DataLoss { message, .. })
            | Err(WriterError::ResnapshotRefused { message, .. }) => {
                self.stopped_by_purge(table, &message)
            }
            Err(WriterError::Fenced(_)) if fenced_allowed => Ok(()),
            Err(error) => Err(format!("stream of {}: {error}", table.source())),
        }
    }

    /// A stream of `table` stopped by purged changes: expected under `fail`, after which the
    /// operator sets skip, and under `resnapshot` when the anti-loop guard stopped it (its
    /// message names it), after which the operator reruns with the guard off; a failure
    /// otherwise.
    pub(crate) fn stopped_by_purge(&self, table: Table, message: &str) -> Result<(), Failure> {
        let mut known = self.known();
        let policy = known.on_loss.get(&table).copied();
        if policy == Some(OnLoss::Fail) {
            known.on_loss.insert(table, OnLoss::Skip);
            Ok(())
        } else if policy == Some(OnLoss::Resnapshot)
            && message.contains("resnapshot_interval_days")
            // The guard was on for this run: off only after a stop, and two runs of one step
            // (a second writer) both started before it.
            && (!known.guard_off.contains(&table)
                || known.guard_stops.iter().any(|(stopped, _)| *stopped == table))
        {
            known.guard_off.insert(table);
            let purged_through = known.purged_through;
            known.guard_stops.push((table, purged_through));
            *known
                .covered
                .entry("re-snapshots refused by the anti-loop guard".into())
                .or_default() += 1;
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
            let excused = self.excused(table).await;
            if expected
                .iter()
                .all(|row| held.contains(row) || excused.covers(row))
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

    /// The LSN ranges `(after, through]` where bronze of `table` may lack change rows:
    /// from where its stream stood at a purge to the purge's cut (changes the purge took, or
    /// that the stream skipped past it), and every range a healing re-snapshot replaced by
    /// its rows (a `data_loss` facts row's `(min_lsn, max_lsn]`, its S).
    pub(crate) async fn excused(&self, table: Table) -> Excused {
        let mut ranges = self
            .known()
            .purged_ranges
            .get(&table)
            .cloned()
            .unwrap_or_default();
        ranges.extend(
            self.heals(table)
                .await
                .into_iter()
                .map(|(from, snapshot)| (Some(from), snapshot)),
        );
        Excused(ranges)
    }

    /// Each purge a stream of `table` healed by a re-snapshot: its `data_loss` facts row's
    /// `(min_lsn, max_lsn)`, where the stream stood and the snapshot's S; and the one a
    /// batch left open records in its checkpoint claim (a crash after the amendment, before
    /// its facts row: the claim's start is S already).
    pub(crate) async fn heals(&self, table: Table) -> Vec<(Lsn, Lsn)> {
        let open = self
            .last_batch(table)
            .await
            .filter(|batch| !batch.committed)
            .map(|batch| batch.events)
            .unwrap_or_default();
        let recorded = open
            .iter()
            .filter(|event| event.event.as_deref() == Some("data_loss"))
            .filter_map(|event| {
                let lsn = |text: &Option<String>| text.as_deref()?.parse().ok();
                Some((lsn(&event.min_lsn)?, lsn(&event.max_lsn)?))
            });
        let url = tables::table_url(&self.lab.lake("facts")).expect("url");
        let rows = tables::query_text(
            &url,
            &format!(
                "SELECT min_lsn, max_lsn FROM t WHERE app_id = '{}' AND event = 'data_loss'",
                table.name()
            ),
        )
        .await
        .unwrap_or_default();
        rows.iter()
            .filter_map(|row| {
                let lsn = |index: usize| row[index].as_deref().and_then(|text| text.parse().ok());
                Some((lsn(0)?, lsn(1)?))
            })
            .chain(recorded)
            .collect()
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
            Maintained::History(table) => (
                self.lab.lake(&format!("history_{}", table.name())),
                TableKind::History,
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

    /// A cleanup job purges the change tables to `max_lsn`; each table's stream meets it by
    /// its policy in `on_loss`, in the order of [`Table::ALL`] (a table past its end, in a
    /// schedule from before it joined the model, keeps its own).
    pub(crate) async fn purge(&self, on_loss: &[OnLoss]) -> Result<(), Failure> {
        let Some(cut) = self.lab.purge_to_max_lsn(0).await else {
            return Ok(());
        };
        self.known().purged_through = Some(cut);
        for (table, &on_loss) in Table::ALL.into_iter().zip(on_loss) {
            self.known().on_loss.insert(table, on_loss);
            self.known().guard_off.remove(&table);
            // A stream whose position is before the cut meets the purge (the server cannot
            // tell whether the purged range held changes of its table): skip passes it, a
            // re-snapshot replaces the changes up to its S by its rows. Silver then lacks
            // what the purge took from bronze, or, healing, what the snapshot has yet to
            // bring.
            let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
            let missing = self
                .journal(table)
                .iter()
                .any(|row| !held.contains(row) && row.0.parse::<Lsn>().is_ok_and(|l| l <= cut));
            let through = self.committed_through(table).await;
            let behind = through.is_none_or(|through| through < cut);
            let mut known = self.known();
            if missing || behind {
                known
                    .purged_ranges
                    .entry(table)
                    .or_default()
                    .push((through, cut));
            }
            if missing || (behind && on_loss == OnLoss::Resnapshot) {
                known.lost_at.insert(table, cut);
            }
            if missing && on_loss != OnLoss::Resnapshot {
                known.history_inexact.insert(table);
            }
        }
        Ok(())
    }

    pub(crate) async fn apply(&self, table: Table, deletion_vectors: bool) -> Result<(), Failure> {
        // A snapshot completed before this apply began is one it rebuilds from (one completing
        // beside it may be too, or not).
        let completed = self.known().completed.get(&table).copied();
        let outcome = common::try_run_now(self.config(table)).await.map(|_| ());
        self.stream_outcome(table, outcome, false)?;
        silver::apply_changes(&self.apply_config(table, deletion_vectors))
            .await
            .map_err(|error| format!("apply {}: {error}", table.source()))?;
        self.apply_history(table).await?;
        let silver_url =
            tables::table_url(&self.lab.lake(&format!("silver_{}", table.name()))).expect("url");
        let made = tables::open(&silver_url).await.expect("open").is_some();
        if made {
            self.known().applied.insert(table);
        }
        let rebuilt = self.observe_silver(table).await?;
        if let Some(completed) = completed
            && rebuilt.is_none_or(|rebuilt| rebuilt < completed)
        {
            return Err(format!(
                "apply of {}: snapshot {completed} was complete before it, yet silver was \
                 rebuilt from {rebuilt:?}",
                table.source()
            ));
        }
        let exact = {
            let known = self.known();
            !known.lost_at.contains_key(&table) && !known.corrupted.contains_key(&table)
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
            Some(_) => {
                current_rows_of(&location, table.key(), &self.compared_selection(table)).await
            }
            None => Rows::new(),
        }
    }

    /// The source's rows of `table` now, of the columns silver is compared on.
    pub(crate) async fn source_rows(&self, table: Table) -> Rows {
        let columns = self.compared_selection(table);
        source_rows_of(&self.lab, table.source(), table.key(), &columns).await
    }

    /// Where silver of `table` differs from the source now (its first keys), if it does.
    /// A column the source added after a capture-instance switch joins bronze and silver
    /// with the first change row the newer instance captures (docs/writer.md): until then
    /// silver lacks it, and its rows read NULL there, as the source's untouched rows do.
    pub(crate) async fn silver_differs(&self, table: Table) -> Option<String> {
        let mut silver = self.silver_rows(table).await;
        let source = self.source_rows(table).await;
        let width = source.values().map(Vec::len).max().unwrap_or(0);
        for row in silver.values_mut() {
            row.resize(width.max(row.len()), "NULL".into());
        }
        (silver != source).then(|| difference(&silver, &source))
    }

    /// Whether bronze holds every change of `table` the journal has (but those a purge
    /// excuses).
    pub(crate) async fn stream_current(&self, table: Table) -> bool {
        let held: BTreeSet<_> = bronze_rows(&self.lab, table).await.into_iter().collect();
        let excused = self.excused(table).await;
        self.journal(table)
            .iter()
            .all(|row| held.contains(row) || excused.covers(row))
    }

    /// Reconciles silver of `table`; with `corrupt`, another engine first deletes a row of
    /// it (`Some(false)`) or changes one of its values (`Some(true)`).
    pub(crate) async fn reconcile(
        &self,
        table: Table,
        corrupt: Option<bool>,
        value_sums: bool,
    ) -> Result<(), Failure> {
        if !self.known().applied.contains(&table) {
            return self.apply(table, false).await;
        }
        let location = self.lab.lake(&format!("silver_{}", table.name()));
        if let Some(value) = corrupt {
            // Another engine deletes a row of silver, or changes one of its values: from now
            // on silver differs from the source, and no reconcile of it may verify.
            let rows = self.silver_rows(table).await;
            if let Some(key) = rows.keys().next() {
                let silver = common::open_table(&location).await;
                let which = format!("{} = {key}", table.key());
                match value {
                    false => drop(common::delete_where(silver, &which).await),
                    true => {
                        let column = table.text_column();
                        let changed = format!("concat({column}, '~')");
                        drop(common::update_where(silver, &which, column, &changed).await)
                    }
                }
                self.known().corrupted.insert(table, *key);
            }
        }
        // After a corruption, and on the quiet table, no bucket is read row by row unless
        // tier 1 finds it different: the value sums must find a changed value alone. Without
        // value sums, neither: silver's rows may be verified, never its values.
        let sample = match corrupt.is_some() || table == Table::Quiet || !value_sums {
            true => 0.0,
            false => 1.0,
        };
        let config = reconcile::ReconcileConfig {
            server: self.lab.url.clone(),
            table: table.source().into(),
            silver: location.clone(),
            bronze: self.lab.lake(&format!("bronze_{}", table.name())),
            control: self.lab.lake("control"),
            facts: Some(self.lab.lake("facts")),
            keys: None,
            // At sample 0, buckets of 40 rows: a corruption's bucket is read row by row
            // beside buckets whose value sums match unread.
            bucket_rows: if sample == 0.0 { 40 } else { 1_000_000 },
            sample,
            seed: Some(1),
            report: None,
            value_sums,
            // Bronze's, as it records it.
            columns: None,
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
        // Value sums asked for where no bucket is read unless tier 1 finds it different must
        // have been summed, or every bucket read row by row instead (a keyset key's source
        // sends no sums): else a changed value would go unseen and the checks below pass.
        if config.value_sums
            && config.sample < 1.0
            && !result.value_sums
            && result.hashed < result.buckets
        {
            return Err(format!(
                "reconcile of {} was asked for value sums at sample {} and compared without \
                 them: {}",
                table.source(),
                config.sample,
                reconcile::render(&result)
            ));
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
        // A snapshot the model saw complete, newer than the one silver was rebuilt from, is
        // pending: nothing may be verified until an apply takes it in.
        let unapplied = {
            let known = self.known();
            known.completed.get(&table).copied().filter(|completed| {
                known
                    .rebuilt_from
                    .get(&table)
                    .is_none_or(|rebuilt| completed > rebuilt)
            })
        };
        if let Some(completed) = unapplied
            && result
                .pending_snapshot
                .is_none_or(|pending| pending < completed)
        {
            return Err(format!(
                "reconcile of {} names pending snapshot {:?}, but snapshot {completed} is \
                 complete and silver was not rebuilt from it (verified: {})",
                table.source(),
                result.pending_snapshot,
                result.verified
            ));
        }
        if !result.verified {
            // Not verified, and rightly so only when something stands in the way: a change
            // after the compared LSN, a snapshot silver has not taken in, or a silver that
            // differs from the source.
            // Silver's stale copy of a column taken back in (bronze records it copied again),
            // which no comparison here reads, is a difference reconcile rightly finds.
            let stale =
                self.known().reselected.contains(&table) && self.toggled_copied(table).await;
            if changed_since.is_empty()
                && result.pending_snapshot.is_none()
                && !stale
                && self.silver_differs(table).await.is_none()
            {
                return Err(format!(
                    "reconcile did not verify {} at {} although silver equals the source, no \
                     change came after it and no snapshot is pending: {}",
                    table.source(),
                    result.compared_lsn,
                    reconcile::render(&result)
                ));
            }
            return Ok(());
        }
        // A verified LSN claims silver's rows (every key once); a values-verified one claims
        // every value too. Without value sums and with buckets left unread, only the first.
        let silver = self.silver_rows(table).await;
        let source = self.source_rows(table).await;
        let corrupted = self.known().corrupted.get(&table).copied();
        if let Some(key) = corrupted
            && !changed_since.contains(&key)
            && let Some(source_row) = source.get(&key)
        {
            // A column silver has not met yet reads NULL, as in `silver_differs`.
            let held = silver.get(&key).map(|row| {
                let mut row = row.clone();
                row.resize(source_row.len().max(row.len()), "NULL".into());
                row
            });
            // A key no change touched since the compared LSN, missing from silver or with a
            // value changed: no change in flight explains it.
            // With value sums, a changed value is a difference of its bucket: rows are not
            // verified either.
            let claimed = match held {
                None => Some("verified"),
                Some(row) if row != *source_row && result.values_verified => {
                    Some("values-verified")
                }
                Some(row) if row != *source_row && result.value_sums => {
                    Some("verified (with value sums)")
                }
                Some(_) => None,
            };
            if let Some(claimed) = claimed {
                return Err(format!(
                    "reconcile {claimed} {} at {} although another engine deleted or changed \
                     its row of key {key} from silver, and no change since explains it",
                    table.source(),
                    result.compared_lsn
                ));
            }
        }
        // With no change of the table after the compared LSN, the source now is the source
        // at that LSN: silver must hold its keys, and its values when they were verified.
        if !changed_since.is_empty() {
            return Ok(());
        }
        let keys = |rows: &Rows| rows.keys().copied().collect::<Vec<_>>();
        if keys(&silver) != keys(&source) {
            return Err(format!(
                "reconcile verified {} at {} while silver's keys differ from the source's: {}",
                table.source(),
                result.compared_lsn,
                difference(&silver, &source)
            ));
        }
        if result.values_verified
            && let Some(difference) = self.silver_differs(table).await
        {
            return Err(format!(
                "reconcile values-verified {} at {} while silver differs from the source: \
                 {difference}",
                table.source(),
                result.compared_lsn
            ));
        }
        Ok(())
    }

    pub(crate) fn journal(&self, table: Table) -> Vec<Change> {
        self.lab.committed_of(table.source())
    }
}

/// The ranges `(after, through]` where bronze may lack change rows ([`World::excused`]).
pub(crate) struct Excused(Vec<(Option<Lsn>, Lsn)>);

impl Excused {
    /// Whether `row` lies in one of the ranges.
    pub(crate) fn covers(&self, row: &Change) -> bool {
        row.0.parse::<Lsn>().is_ok_and(|lsn| {
            self.0
                .iter()
                .any(|(after, through)| after.is_none_or(|after| lsn > after) && lsn <= *through)
        })
    }
}
