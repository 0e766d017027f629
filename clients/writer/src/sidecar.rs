//! The sidecar: many tables in one process, from a TOML file.
//!
//! ```toml
//! server = "http://127.0.0.1:50051"
//! facts = "/lake/facts"            # shared by every table
//! control = "/lake/control"        # shared; one row per table
//! checkpoints = "/lake/_checkpoints"   # optional: the default, beside the facts table
//! granularity = "hour"             # minute, hour, day
//! poll_seconds = 5.0
//! live_tail = true                 # wait on the server's wait_for_commits (default true)
//!
//! [[tables]]
//! table = "dbo.orders"
//! target = "/lake/bronze_orders"
//! app_id = "orders"
//! max_commits = 1000               # optional
//! partitions = 2                   # optional
//! starting = "earliest"            # optional
//! fail_on_data_loss = true         # optional
//! schema_change_policy = "evolve"  # optional: evolve or fail on a source schema change
//! on_data_loss = "resnapshot"      # optional: fail (default) or heal purged changes by re-snapshot
//! snapshot_on_switch = true        # optional: re-snapshot when a newer capture instance is active
//! resnapshot_every_days = 30.0  # optional: re-snapshot once the newest snapshot is this old
//! resnapshot_interval_days = 7.0  # optional: a second purge healed within it stops the table
//! bootstrap = "chunked"            # optional: full or chunked, for a new checkpoint
//! chunk_rows = 100000              # optional: chunk size of a chunked bootstrap
//! snapshot_keys = ["region"]       # optional: columns chunks are cut on (default: the unique index)
//! except_columns = ["card_number"] # optional: captured columns never copied (or `columns`: the only ones)
//! silver = "/lake/silver_orders"   # optional: keep a current-state table (apply_changes)
//! keys = ["order_id"]              # the silver table's key columns
//! silver_deletion_vectors = true   # optional: merge-on-read silver (deletion vectors)
//! history = "/lake/history_orders" # optional: keep every version of every row (SCD type 2)
//! track_history_columns = ["status"] # optional: only these open a version (or
//!                                  # track_history_except_columns; default every column)
//! apply_seconds = 60.0             # optional: apply interval (default poll_seconds)
//! reconcile_minutes = 60.0         # optional: reconcile silver with the source this often
//! reconcile_keys = ["order_id"]    # optional: the columns compared on (default the unique index)
//! reconcile_sample = 1.0           # optional: share of matching buckets compared row by row
//! reconcile_value_sums = false     # optional: no digest of every row's values (default on)
//! ```
//!
//! `maintenance_minutes = 60.0` (0: none) and `vacuum_retention_hours = 168.0` set the
//! maintenance of every table of the file ([`crate::maintenance`]).
//! `reconcile_report = "/lake/reconcile"` at the top level names the report table every
//! scheduled reconcile appends to (docs/reconcile.md); `status_listen = "127.0.0.1:8088"`
//! serves the live status page and the `/healthz` and `/readyz` probes (docs/operations.md).
//! A `[fleet]` section shares the tables among replicas by lease ([`crate::fleet`]).
//!
//! With `live_tail`, one shared call waits on the server for every table by name
//! ([`SharedTail`]): only the streams of tables that changed wake, and a quiet table costs
//! the source nothing between commits. The tables' facts rows and verdict moves go through
//! one [`Ledger`], which commits those that arrive together in one commit. One task per
//! table. A table that fails is logged and
//! retried with exponential backoff
//! (1 s doubling to 60 s) while the others go on; with available-now each table gets
//! `AVAILABLE_NOW_ATTEMPTS` attempts and the run reports which ones failed. A table with
//! `bootstrap` snapshots itself before its first batch; a chunked snapshot is read by a
//! backfill task next to the table's stream (available-now: after the stream's run).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mssql_cdc_proto::selection::ColumnSelection;
use serde::Deserialize;
use tokio::sync::Notify;

use crate::board::{TableState, board};
use crate::checkpoint::Checkpoint;
use crate::control::{self, Granularity};
use crate::data_loss::OnDataLoss;
use crate::error::{Result, WriterError};
use crate::fleet::FleetConfig;
use crate::fleet::ownership::Ownership;
use crate::ledger::Ledger;
use crate::maintenance::MaintenanceOptions;
use crate::reconcile::{ReconcileConfig, reconcile};
use crate::schema_policy::SchemaChangePolicy;
use crate::shared_table::SharedTable;
use crate::silver::history::{HistoryConfig, Tracked, apply_history};
use crate::silver::{ApplyConfig, apply_changes};
use crate::slots::{MAX_TABLE_SLOTS, TableSlots, slot, table_slots};
use crate::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use crate::stream::{BatchOutcome, Stream, StreamConfig};
use crate::tables::{self, TableKind};
use crate::tail::{SharedTail, Waiting};

/// Attempts per table in an available-now run.
pub const AVAILABLE_NOW_ATTEMPTS: u32 = 3;

/// The sidecar's configuration file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// Flight server URL.
    pub server: String,
    /// Facts table shared by every table.
    pub facts: String,
    /// Control table shared by every table.
    pub control: String,
    /// Directory (a path or a URL) holding one checkpoint per app id; by default
    /// `_checkpoints` beside the facts table, on the lake's store.
    #[serde(default)]
    pub checkpoints: Option<String>,
    /// Verdict granularity (default hour).
    #[serde(default)]
    pub granularity: Granularity,
    /// Seconds between polls of an idle table (default 5).
    #[serde(default = "default_poll")]
    pub poll_seconds: f64,
    /// Whether a busy table waits on the server's live tail (`wait_for_commits`) instead of
    /// the whole poll interval (default true; see [`crate::tail`]).
    #[serde(default = "default_live_tail")]
    pub live_tail: bool,
    /// Address of the admin gRPC service (`proto/mssql_cdc_admin.proto`: open, status,
    /// pause and resume snapshots), for example `127.0.0.1:50061`; none when unset.
    #[serde(default)]
    pub admin_listen: Option<String>,
    /// A file holding the admin service's bearer token (one line, at least 16 characters):
    /// every call must carry it. Required when `admin_listen` is not a loopback address.
    #[serde(default)]
    pub admin_token_file: Option<PathBuf>,
    /// PEM certificate of the admin service (with `admin_tls_key`): TLS on its connections.
    #[serde(default)]
    pub admin_tls_cert: Option<PathBuf>,
    /// PEM private key of `admin_tls_cert`.
    #[serde(default)]
    pub admin_tls_key: Option<PathBuf>,
    /// Address of the status page and the `/healthz` and `/readyz` probes
    /// (`crate::status_page`), for example `127.0.0.1:8088`; none when unset. An address
    /// other than loopback needs `status_token_file` (or `admin_token_file`, warned about).
    #[serde(default)]
    pub status_listen: Option<String>,
    /// A file holding the status page's token (one line, at least 16 characters, not the
    /// admin token): viewers see the page with it and can change nothing.
    #[serde(default)]
    pub status_token_file: Option<PathBuf>,
    /// The report table of scheduled reconciles; none when unset.
    #[serde(default)]
    pub reconcile_report: Option<String>,
    /// Minutes between maintenance passes over every table of the file (compaction, log
    /// checkpoint and cleanup, `VACUUM`; [`crate::maintenance`]) in continuous runs; 0: none
    /// (default 60).
    #[serde(default = "default_maintenance_minutes")]
    pub maintenance_minutes: f64,
    /// Hours `VACUUM` keeps files no version references (default 168, Delta's week).
    #[serde(default = "default_vacuum_retention_hours")]
    pub vacuum_retention_hours: f64,
    /// How many tables do lake work at once: a batch, a snapshot wave, an apply, a
    /// reconcile, an available-now run (default 16, at most [`MAX_TABLE_SLOTS`]). The others
    /// wait their turn ([`crate::slots`]).
    #[serde(default = "default_table_slots")]
    pub table_slots: usize,
    /// Replicas sharing this file's tables by lease (`[fleet]`; [`crate::fleet`]); none:
    /// this process runs every table.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// The tables.
    pub tables: Vec<TableEntry>,
}

fn default_table_slots() -> usize {
    16
}

fn default_poll() -> f64 {
    5.0
}

fn default_maintenance_minutes() -> f64 {
    60.0
}

fn default_vacuum_retention_hours() -> f64 {
    crate::maintenance::DEFAULT_VACUUM_RETENTION.as_secs_f64() / 3600.0
}

fn default_live_tail() -> bool {
    true
}

fn default_partitions() -> u32 {
    2
}

fn default_starting() -> String {
    "earliest".into()
}

fn default_true() -> bool {
    true
}

/// One table of the sidecar.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableEntry {
    /// Source table, `schema.table`.
    pub table: String,
    /// Bronze location.
    pub target: String,
    /// Writer identity (unique per table).
    pub app_id: String,
    /// Most commits per batch.
    #[serde(default)]
    pub max_commits: Option<u64>,
    /// Endpoints read in parallel.
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Where a new checkpoint starts.
    #[serde(default = "default_starting")]
    pub starting: String,
    /// Stop on purged changes (default) or skip them with a `data_skipped` row.
    #[serde(default = "default_true")]
    pub fail_on_data_loss: bool,
    /// `evolve` (default) or `fail` on a schema change in the source.
    #[serde(default)]
    pub schema_change_policy: SchemaChangePolicy,
    /// `fail` (default) or `resnapshot` when changes were purged before they were read.
    #[serde(default)]
    pub on_data_loss: OnDataLoss,
    /// Re-snapshot when a newer capture instance becomes active (default false).
    #[serde(default)]
    pub snapshot_on_switch: bool,
    /// Re-snapshot once the newest snapshot is this many days old (default never).
    #[serde(default)]
    pub resnapshot_every_days: Option<f64>,
    /// With `on_data_loss = "resnapshot"`, the seed's anti-loop guard: a purge met less than
    /// this many days after the last one healed stops the table (default 7; 0: no guard).
    #[serde(default)]
    pub resnapshot_interval_days: Option<f64>,
    /// Snapshot the table before a new checkpoint's first batch (`full` or `chunked`).
    #[serde(default)]
    pub bootstrap: Option<SnapshotMode>,
    /// Most rows per chunk of a chunked bootstrap.
    #[serde(default)]
    pub chunk_rows: Option<u64>,
    /// Columns to cut chunked snapshots on (unique or not); default the unique index.
    #[serde(default)]
    pub snapshot_keys: Option<Vec<String>>,
    /// The only captured columns copied, in order (the key columns among them).
    #[serde(default)]
    pub columns: Option<Vec<String>>,
    /// Captured columns never copied (matched ignoring case; not a key column).
    #[serde(default)]
    pub except_columns: Option<Vec<String>>,
    /// `columns` or `except_columns`, checked by [`SidecarConfig::load`]; `None` when the
    /// entry names neither (bronze's selection holds; `except_columns = []` says every
    /// column).
    #[serde(skip)]
    pub selection: Option<ColumnSelection>,
    /// Silver location: `apply_changes` keeps it in step with bronze.
    #[serde(default)]
    pub silver: Option<String>,
    /// The silver table's key columns.
    #[serde(default)]
    pub keys: Vec<String>,
    /// Whether silver marks replaced rows in deletion vectors instead of writing files again
    /// (docs/silver.md); turned on for the silver table, never off.
    #[serde(default)]
    pub silver_deletion_vectors: bool,
    /// History location: `apply_history` keeps every version of every row (SCD type 2).
    #[serde(default)]
    pub history: Option<String>,
    /// Only changes of these columns open a history version (default every column).
    #[serde(default)]
    pub track_history_columns: Vec<String>,
    /// Changes of every column but these open a history version.
    #[serde(default)]
    pub track_history_except_columns: Vec<String>,
    /// Seconds between `apply_changes` (and `apply_history`) calls (continuous; default
    /// `poll_seconds`).
    #[serde(default)]
    pub apply_seconds: Option<f64>,
    /// Minutes between reconciles of the silver table (continuous; available-now runs one
    /// after its apply); none when unset.
    #[serde(default)]
    pub reconcile_minutes: Option<f64>,
    /// The columns reconcile compares on; default the unique index CDC uses.
    #[serde(default)]
    pub reconcile_keys: Option<Vec<String>>,
    /// The share of matching buckets reconcile compares row by row, in `[0, 1]` (the
    /// command's `--sample`; default [`crate::reconcile::DEFAULT_SAMPLE`]).
    #[serde(default)]
    pub reconcile_sample: Option<f64>,
    /// Whether reconcile sums a digest of every row's values (the command's
    /// `--value-sums`; default true).
    #[serde(default)]
    pub reconcile_value_sums: Option<bool>,
}

impl TableEntry {
    fn backfill_options(&self) -> BackfillOptions {
        BackfillOptions {
            chunk_rows: self
                .chunk_rows
                .unwrap_or(BackfillOptions::default().chunk_rows),
            max_waves: Some(1),
            ..BackfillOptions::default()
        }
    }
}

/// The `apply_changes` configuration of an entry with a silver table.
fn apply_config(config: &SidecarConfig, entry: &TableEntry) -> Option<ApplyConfig> {
    entry.silver.as_ref().map(|silver| ApplyConfig {
        table: entry.table.clone(),
        bronze: entry.target.clone(),
        target: silver.clone(),
        capture_instance: None,
        keys: entry.keys.clone(),
        control: config.control.clone(),
        facts: Some(config.facts.clone()),
        granularity: config.granularity,
        deletion_vectors: entry.silver_deletion_vectors,
    })
}

/// The `apply_history` configuration of an entry with a history table (its track lists
/// were checked at load).
fn history_config(config: &SidecarConfig, entry: &TableEntry) -> Option<HistoryConfig> {
    let history = entry.history.as_ref()?;
    Some(HistoryConfig {
        table: entry.table.clone(),
        bronze: entry.target.clone(),
        target: history.clone(),
        capture_instance: None,
        keys: entry.keys.clone(),
        control: config.control.clone(),
        facts: config.facts.clone(),
        granularity: config.granularity,
        tracked: Tracked::of(
            entry.track_history_columns.clone(),
            entry.track_history_except_columns.clone(),
        )
        .unwrap_or_default(),
    })
}

/// What the sidecar applies of one table after its stream: silver, history, or both.
#[derive(Clone)]
struct Applies {
    silver: Option<ApplyConfig>,
    history: Option<HistoryConfig>,
}

impl Applies {
    fn of(config: &SidecarConfig, entry: &TableEntry) -> Option<Self> {
        let applies = Applies {
            silver: apply_config(config, entry),
            history: history_config(config, entry),
        };
        (applies.silver.is_some() || applies.history.is_some()).then_some(applies)
    }

    async fn run(&self) -> Result<()> {
        if let Some(silver) = &self.silver {
            apply_changes(silver).await?;
        }
        if let Some(history) = &self.history {
            apply_history(history).await?;
        }
        Ok(())
    }

    fn table(&self) -> &str {
        match (&self.silver, &self.history) {
            (Some(silver), _) => &silver.table,
            (None, Some(history)) => &history.table,
            (None, None) => "",
        }
    }
}

/// The reconcile of an entry with a silver table (scheduled with `reconcile_minutes`, or
/// asked for through the admin service).
pub fn reconcile_config(config: &SidecarConfig, entry: &TableEntry) -> Option<ReconcileConfig> {
    let silver = entry.silver.as_ref()?;
    let defaults = ReconcileConfig::new(
        &config.server,
        &entry.table,
        silver,
        &entry.target,
        &config.control,
    );
    Some(ReconcileConfig {
        keys: entry.reconcile_keys.clone(),
        sample: entry.reconcile_sample.unwrap_or(defaults.sample),
        value_sums: entry.reconcile_value_sums.unwrap_or(defaults.value_sums),
        report: config.reconcile_report.clone(),
        facts: Some(config.facts.clone()),
        // Bronze's, as the table's stream recorded it (the file's may be newer than that).
        columns: None,
        ..defaults
    })
}

/// Runs one reconcile and logs its verdict: INFO when clean, WARN naming the mismatched
/// buckets and failures otherwise.
async fn reconcile_logged(config: &ReconcileConfig) -> Result<()> {
    let result = reconcile(config).await?;
    crate::metrics::reconcile(&config.table, &result);
    if result.values_verified {
        tracing::info!(table = %config.table, buckets = result.buckets,
            in_flight = result.in_flight, verified_lsn = %result.compared_lsn,
            "reconcile: silver equals the source, every value of every row compared");
    } else if result.verified {
        tracing::info!(table = %config.table, buckets = result.buckets, hashed = result.hashed,
            in_flight = result.in_flight, verified_lsn = %result.compared_lsn,
            "reconcile: silver's rows match the source; values compared in the hashed buckets only (reconcile_sample = 1 compares every value)");
    } else if let Some(snapshot) = result.pending_snapshot
        && result.clean()
    {
        tracing::info!(table = %config.table, buckets = result.buckets, in_flight = result.in_flight,
            %snapshot, "reconcile: nothing differs but in flight; not verified until silver takes the snapshot in");
    } else {
        tracing::warn!(table = %config.table, buckets = result.buckets, mismatch = result.mismatch,
            failures = ?result.failures, run_id = %result.run_id, "reconcile: silver differs from the source");
    }
    Ok(())
}

/// Reconciles every `every` until `stop`, the first after one interval (silver is applied
/// first); a failing run is logged and tried again at the next tick.
async fn reconcile_loop(
    config: &ReconcileConfig,
    every: Duration,
    slots: TableSlots,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    while !sleep_unless_stopped(every, &stop).await {
        let reconciled = {
            let _slot = slot(&slots).await;
            if *stop.borrow() {
                return;
            }
            reconcile_logged(config).await
        };
        if let Err(error) = reconciled {
            board().failure(&config.table, &format!("reconcile: {error}"));
            tracing::warn!(table = %config.table, %error, "reconcile failed; retrying at the next tick");
        }
    }
}

/// Bootstraps a new checkpoint when the entry asks for it.
async fn bootstrap(entry: &TableEntry, config: &mut StreamConfig) -> Result<()> {
    if let Some(mode) = entry.bootstrap {
        snapshot::bootstrap(config, mode).await?;
    }
    Ok(())
}

/// Reads the open chunked snapshot of a table to its end, one wave per call of `backfill`
/// (available-now runs of a table with a chunked bootstrap or healing purges by re-snapshot;
/// a paused snapshot is left for a later run).
async fn backfill_to_end(entry: &TableEntry, config: &StreamConfig) -> Result<()> {
    if entry.bootstrap != Some(SnapshotMode::Chunked)
        && entry.on_data_loss != OnDataLoss::Resnapshot
        && !entry.snapshot_on_switch
        && entry.resnapshot_every_days.is_none()
    {
        return Ok(());
    }
    let snapshots = Snapshots::connect(config.clone()).await?;
    loop {
        let status = snapshots.backfill(&entry.backfill_options()).await?;
        if status.done || status.paused {
            return Ok(());
        }
    }
}

/// Next to a continuous stream: reads the waves of any open chunked snapshot of the table
/// (the entry's bootstrap, or one an operator opened with `snapshot open`) until `stop`.
/// While it is paused or none is open, it waits for [`watch_snapshots`] to find one open
/// (`poll` without the watcher). With the watcher, only a table whose entry asks for a chunked
/// bootstrap reads its snapshots at once; the others wait for the watcher's first query, so a
/// thousand starting tables do not each query the shared facts table. A failed wave is
/// logged (WARN), counted (`mssql_cdc_writer_backfill_failures_total`) and tried again after
/// `poll`, the stream going on beside it; only an error retrying cannot fix ([`is_final`])
/// ends the task.
async fn backfill_continuous(
    entry: &TableEntry,
    config: &StreamConfig,
    columns: ColumnSelection,
    poll: Duration,
    shared: &Shared,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let snapshots = Snapshots::connect_resolved(config.clone(), columns).await?;
    let mut last_state = String::new();
    if let Some(wake) = &shared.snapshot_wake
        && entry.bootstrap != Some(SnapshotMode::Chunked)
    {
        woken_or_stopped(wake, &stop).await;
    }
    while !*stop.borrow() {
        let wave = {
            let _slot = slot(&shared.slots).await;
            if *stop.borrow() {
                break;
            }
            snapshots.backfill(&entry.backfill_options()).await
        };
        match wave {
            Ok(status) => {
                if status.state != last_state {
                    tracing::info!(table = %entry.table, state = %status.state,
                        reason = status.reason.as_deref().unwrap_or(""), "backfill");
                    last_state = status.state.clone();
                }
                if !(status.done || status.paused || status.state == "no_snapshot") {
                    continue; // the next wave at once
                }
                if let Some(wake) = &shared.snapshot_wake {
                    woken_or_stopped(wake, &stop).await;
                    continue;
                }
            }
            // What retrying cannot fix (a second writer, a checkpoint that contradicts the
            // lake, bad configuration) ends the attempt, to be retried with the long backoff;
            // any other failure of a wave is the wave's: the stream beside it goes on (a
            // failing wave ended the attempt, throttling the stream to a batch per backoff),
            // and the wave is tried again after `poll`.
            Err(error) if is_final(&error) => return Err(error),
            Err(error) => {
                tracing::warn!(table = %entry.table, %error,
                    "a wave of the table's snapshot failed; it is tried again after the poll interval");
                crate::metrics::backfill_failed(&entry.table);
            }
        }
        sleep_unless_stopped(poll, &stop).await;
    }
    Ok(())
}

/// Waits for `wake` (from [`watch_snapshots`]) or `stop`, whichever comes first.
async fn woken_or_stopped(wake: &Notify, stop: &tokio::sync::watch::Receiver<bool>) {
    let mut stopping = stop.clone();
    tokio::select! {
        _ = wake.notified() => {}
        _ = stopping.wait_for(|stopped| *stopped) => {}
    }
}

impl SidecarConfig {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| WriterError::Io {
            context: format!("reading {}", path.display()),
            source,
        })?;
        let mut config: SidecarConfig = toml::from_str(&text)
            .map_err(|error| WriterError::invalid(format!("{}: {error}", path.display())))?;
        for entry in &mut config.tables {
            let invalid = |error: String| {
                WriterError::invalid(format!(
                    "{}: table {}: {error}",
                    path.display(),
                    entry.table
                ))
            };
            let Some(selection) =
                ColumnSelection::given(entry.columns.clone(), entry.except_columns.clone())
                    .map_err(|error| invalid(error.to_string()))?
            else {
                continue;
            };
            if let Some(key) = entry.keys.iter().find(|key| selection.excludes(key)) {
                return Err(invalid(format!(
                    "the selection leaves out silver's key column '{key}'"
                )));
            }
            entry.selection = Some(selection);
        }
        if config.tables.is_empty() {
            return Err(WriterError::invalid(format!(
                "{}: no [[tables]]",
                path.display()
            )));
        }
        let mut app_ids: Vec<&str> = config
            .tables
            .iter()
            .map(|entry| entry.app_id.as_str())
            .collect();
        app_ids.sort_unstable();
        if let Some(pair) = app_ids.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(WriterError::invalid(format!(
                "app_id '{}' is used by two tables",
                pair[0]
            )));
        }
        // The control table keeps one verdict row per source table (the seed's contract): two
        // entries of one table would move one verdict for two bronze tables, each claiming
        // the other's progress.
        let mut sources: Vec<&str> = config
            .tables
            .iter()
            .map(|entry| entry.table.as_str())
            .collect();
        sources.sort_unstable();
        if let Some(pair) = sources.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(WriterError::invalid(format!(
                "{}: table '{}' is streamed by two entries, which would share its one verdict \
                 row in the control table {}; stream it once (or the second pipeline into \
                 a lake with its own control table)",
                path.display(),
                pair[0],
                config.control
            )));
        }
        if config.admin_tls_cert.is_some() != config.admin_tls_key.is_some() {
            return Err(WriterError::invalid(format!(
                "{}: admin_tls_cert and admin_tls_key go together",
                path.display()
            )));
        }
        if !(config.poll_seconds.is_finite() && config.poll_seconds > 0.0) {
            return Err(WriterError::invalid(
                "poll_seconds must be a positive number",
            ));
        }
        if !(config.maintenance_minutes.is_finite() && config.maintenance_minutes >= 0.0) {
            return Err(WriterError::invalid(
                "maintenance_minutes must be a number of minutes, 0 for none",
            ));
        }
        if !(config.vacuum_retention_hours.is_finite() && config.vacuum_retention_hours > 0.0) {
            return Err(WriterError::invalid(
                "vacuum_retention_hours must be a positive number of hours",
            ));
        }
        if let Some(fleet) = &config.fleet {
            fleet
                .check()
                .map_err(|error| WriterError::invalid(format!("{}: {error}", path.display())))?;
        }
        if !(1..=MAX_TABLE_SLOTS).contains(&config.table_slots) {
            return Err(WriterError::invalid(format!(
                "table_slots must be 1 to {MAX_TABLE_SLOTS}, not {}",
                config.table_slots
            )));
        }
        for entry in &config.tables {
            let refuse = |what: &str| {
                Err(WriterError::invalid(format!(
                    "{}: table {} {what}",
                    path.display(),
                    entry.table
                )))
            };
            let positive = |value: Option<f64>| value.is_none_or(|v| v.is_finite() && v > 0.0);
            if entry.silver.is_some() && entry.keys.is_empty() {
                return refuse("has a silver table but no keys");
            }
            if entry.history.is_some() && entry.keys.is_empty() {
                return refuse("has a history table but no keys");
            }
            let tracks = !entry.track_history_columns.is_empty()
                || !entry.track_history_except_columns.is_empty();
            if tracks && entry.history.is_none() {
                return refuse("has track_history_columns but no history table");
            }
            if let Err(error) = Tracked::of(
                entry.track_history_columns.clone(),
                entry.track_history_except_columns.clone(),
            ) {
                return refuse(&error.to_string());
            }
            if entry.reconcile_minutes.is_some() && entry.silver.is_none() {
                return refuse("has reconcile_minutes but no silver table to reconcile");
            }
            if entry
                .reconcile_sample
                .is_some_and(|sample| !(0.0..=1.0).contains(&sample))
            {
                return refuse("has a reconcile_sample outside [0, 1]");
            }
            if !positive(entry.reconcile_minutes) {
                return refuse("has a reconcile_minutes that is not a positive number");
            }
            if !positive(entry.apply_seconds) {
                return refuse("has an apply_seconds that is not a positive number");
            }
        }
        Ok(config)
    }

    /// Every lake table of the file, with its kind: facts, control, the reconcile report,
    /// and each table's bronze, snapshot plans and silver.
    pub fn lake_tables(&self) -> Vec<(String, TableKind)> {
        self.lake_tables_by_app_id()
            .into_iter()
            .map(|(location, kind, _)| (location, kind))
            .collect()
    }

    /// [`Self::lake_tables`], each with the app id of the entry it belongs to (none for the
    /// tables every entry shares).
    pub fn lake_tables_by_app_id(&self) -> Vec<(String, TableKind, Option<String>)> {
        let mut lake = vec![
            (self.facts.clone(), TableKind::Facts, None),
            (self.control.clone(), TableKind::Control, None),
        ];
        lake.extend(
            self.reconcile_report
                .iter()
                .map(|report| (report.clone(), TableKind::Reconcile, None)),
        );
        for entry in &self.tables {
            let app_id = Some(entry.app_id.clone());
            lake.push((entry.target.clone(), TableKind::Bronze, app_id.clone()));
            lake.push((
                snapshot::plans_location(&entry.target),
                TableKind::Plans,
                app_id.clone(),
            ));
            lake.extend(
                entry
                    .silver
                    .iter()
                    .map(|silver| (silver.clone(), TableKind::Silver, app_id.clone())),
            );
            lake.extend(
                entry
                    .history
                    .iter()
                    .map(|history| (history.clone(), TableKind::History, app_id.clone())),
            );
        }
        lake
    }

    /// What a maintenance pass of this file does.
    pub fn maintenance(&self) -> MaintenanceOptions {
        MaintenanceOptions {
            vacuum_retention: Duration::from_secs_f64(self.vacuum_retention_hours * 3600.0),
            ..MaintenanceOptions::default()
        }
    }

    /// The checkpoint location of `app_id`.
    pub fn checkpoint(&self, app_id: &str) -> String {
        crate::checkpoint::location(self.checkpoints.as_deref(), &self.facts, app_id)
    }

    /// The stream configuration of one table.
    pub fn stream(&self, entry: &TableEntry) -> StreamConfig {
        StreamConfig {
            server: self.server.clone(),
            table: entry.table.clone(),
            target: entry.target.clone(),
            facts: self.facts.clone(),
            control: Some(self.control.clone()),
            app_id: entry.app_id.clone(),
            checkpoint: self.checkpoint(&entry.app_id),
            starting: entry.starting.clone(),
            max_commits: entry.max_commits,
            partitions: entry.partitions,
            granularity: self.granularity,
            fail_on_data_loss: entry.fail_on_data_loss,
            schema_change_policy: entry.schema_change_policy,
            on_data_loss: entry.on_data_loss,
            snapshot_on_switch: entry.snapshot_on_switch,
            resnapshot_every_days: entry.resnapshot_every_days,
            resnapshot_interval_days: entry.resnapshot_interval_days,
            snapshot_keys: entry.snapshot_keys.clone(),
            columns: entry.selection.clone(),
        }
    }
}

/// The wait after failed attempt `attempt` (from 0): 1 s doubling to a minute.
fn backoff(attempt: u32) -> Duration {
    Duration::from_secs(1u64 << attempt.min(LONGEST_BACKOFF_STEP)).min(Duration::from_secs(60))
}

/// The backoff step of a continuous table whose attempt `attempt` just failed with `error`:
/// its own for an error that may pass, the longest (a minute) at once for one retrying cannot
/// fix (data loss, a checkpoint the lake contradicts, a second writer, a type bronze cannot
/// hold, bad configuration). Those are still tried again, as an operator's fix or the other
/// writer's stop ends them, but without hammering the server and the lake meanwhile.
fn continuous_attempt_after(attempt: u32, error: &WriterError) -> u32 {
    if is_final(error) {
        attempt.max(LONGEST_BACKOFF_STEP)
    } else {
        attempt
    }
}

/// The step from which [`backoff`] waits its longest.
const LONGEST_BACKOFF_STEP: u32 = 6;

/// The state of a table whose attempt `attempt` (from 0) just failed: retried after its
/// backoff.
fn retrying(attempt: u32) -> TableState {
    TableState::Retrying {
        attempt: attempt + 1,
        retry_at: crate::board::iso(chrono::Utc::now() + backoff(attempt)),
    }
}

/// Runs every table to the `max_lsn` recorded at its start; returns each table's outcome.
pub async fn run_available_now(config: &SidecarConfig) -> Vec<(String, Result<Vec<BatchOutcome>>)> {
    let slots = table_slots(config.table_slots);
    let mut tasks = Vec::new();
    for entry in &config.tables {
        let mut stream_config = config.stream(entry);
        let apply = Applies::of(config, entry);
        let check = entry
            .reconcile_minutes
            .and_then(|_| reconcile_config(config, entry));
        let entry = entry.clone();
        let slots = Arc::clone(&slots);
        tasks.push((
            entry.table.clone(),
            tokio::spawn(async move {
                let mut attempt = 0;
                loop {
                    let result = async {
                        let _slot = slot(&slots).await;
                        bootstrap(&entry, &mut stream_config).await?;
                        let mut stream = Stream::connect(stream_config.clone()).await?;
                        board().state(&entry.table, TableState::Running);
                        let outcomes = stream.run_available_now().await?;
                        backfill_to_end(&entry, &stream_config).await?;
                        if let Some(apply) = &apply {
                            apply.run().await?;
                        }
                        if let Some(check) = &check {
                            reconcile_logged(check).await?;
                        }
                        Ok(outcomes)
                    }
                    .await;
                    match result {
                        Ok(outcomes) => {
                            board().state(&entry.table, TableState::Finished);
                            return Ok(outcomes);
                        }
                        Err(error) if attempt + 1 < AVAILABLE_NOW_ATTEMPTS && !is_final(&error) => {
                            crate::metrics::failure(&stream_config.table, &error);
                            board().state(&entry.table, retrying(attempt));
                            tracing::warn!(table = %stream_config.table, %error, attempt, "table failed; retrying");
                            tokio::time::sleep(backoff(attempt)).await;
                            attempt += 1;
                        }
                        Err(error) => {
                            crate::metrics::failure(&stream_config.table, &error);
                            board().state(&entry.table, TableState::Failed);
                            return Err(error);
                        }
                    }
                }
            }),
        ));
    }
    let mut results = Vec::new();
    for (table, task) in tasks {
        let result = task
            .await
            .unwrap_or_else(|error| Err(WriterError::Internal(format!("task: {error}"))));
        match &result {
            // Loss and a lake that contradicts the checkpoint are what ERROR is kept for.
            Err(
                error @ (WriterError::DataLoss { .. }
                | WriterError::ResnapshotRefused { .. }
                | WriterError::CheckpointMismatch(_)
                | WriterError::Fenced(_)),
            ) => {
                tracing::error!(%table, %error, "table failed");
            }
            Err(error) => tracing::warn!(%table, %error, "table failed"),
            Ok(_) => {}
        }
        results.push((table, result));
    }
    results
}

/// Errors that retrying cannot fix: data loss, a checkpoint that does not match the lake, a
/// second writer of the app id, a type bronze cannot hold, bad configuration.
fn is_final(error: &WriterError) -> bool {
    matches!(
        error,
        WriterError::DataLoss { .. }
            | WriterError::ResnapshotRefused { .. }
            | WriterError::CheckpointMismatch(_)
            | WriterError::Fenced(_)
            | WriterError::SchemaChanged(_)
            | WriterError::InvalidArgument(_)
    )
}

/// Runs every table until `stop` turns true; a failing table is retried with backoff. In a
/// fleet (`[fleet]`), only the tables this replica holds the lease of ([`crate::fleet`]).
pub async fn run_continuous(config: &SidecarConfig, stop: tokio::sync::watch::Receiver<bool>) {
    let poll = Duration::from_secs_f64(config.poll_seconds);
    let waiting = Waiting {
        poll,
        live_tail: config.live_tail,
    };
    let mut tasks = Vec::new();
    let ownership = Ownership::new(
        config
            .tables
            .iter()
            .map(|entry| (entry.app_id.as_str(), entry.table.as_str())),
        config.fleet.is_none(),
    );
    if let Some(fleet) = &config.fleet {
        let (fleet, facts, ownership, stop) = (
            fleet.clone(),
            config.facts.clone(),
            Arc::clone(&ownership),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            if let Err(error) = crate::fleet::run(fleet, facts, ownership, stop).await {
                tracing::error!(%error, "this replica cannot join the fleet: it runs no table");
            }
        }));
    }
    let slots = table_slots(config.table_slots);
    let shared_tail = if config.live_tail {
        shared_tail(config, poll, &stop, &mut tasks).await
    } else {
        None
    };
    // A location that does not parse is reported by each table's stream.
    let ledger = match (
        tables::table_url(&config.facts),
        tables::table_url(&config.control),
    ) {
        (Ok(facts), Ok(control)) => Some(Ledger::start(facts, Some(control), config.granularity)),
        _ => None,
    };
    let snapshot_wakes: HashMap<String, Arc<Notify>> = config
        .tables
        .iter()
        .map(|entry| (entry.app_id.clone(), Arc::new(Notify::new())))
        .collect();
    if let Ok(facts) = tables::table_url(&config.facts) {
        tasks.push(tokio::spawn(watch_snapshots(
            facts,
            snapshot_wakes.clone(),
            poll,
            stop.clone(),
        )));
    }
    if config.maintenance_minutes > 0.0 {
        let every = Duration::from_secs_f64(config.maintenance_minutes * 60.0);
        tasks.push(tokio::spawn(maintenance_loop(
            config.lake_tables_by_app_id(),
            Arc::clone(&ownership),
            config.maintenance(),
            every,
            stop.clone(),
        )));
    }
    for entry in &config.tables {
        let table = TableRun {
            applies: Applies::of(config, entry).map(|apply| {
                let every =
                    Duration::from_secs_f64(entry.apply_seconds.unwrap_or(config.poll_seconds));
                (Arc::new(apply), every)
            }),
            reconcile: reconcile_config(config, entry)
                .zip(entry.reconcile_minutes)
                .map(|(check, minutes)| (check, Duration::from_secs_f64(minutes * 60.0))),
            stream: config.stream(entry),
            entry: entry.clone(),
            waiting,
            shared: Shared {
                wake: shared_tail
                    .as_ref()
                    .and_then(|shared| shared.wake(&entry.table)),
                ledger: ledger.clone(),
                slots: Arc::clone(&slots),
                snapshot_wake: snapshot_wakes.get(&entry.app_id).cloned(),
            },
        };
        let table = Arc::new(table);
        tasks.push(tokio::spawn(Arc::clone(&ownership).while_held(
            entry.app_id.clone(),
            stop.clone(),
            move |stop| Arc::clone(&table).run(stop),
        )));
    }
    for task in tasks {
        let _ = task.await;
    }
}

/// Everything one table of a continuous run needs to run, each time it is held.
struct TableRun {
    entry: TableEntry,
    stream: StreamConfig,
    waiting: Waiting,
    shared: Shared,
    /// Its silver and history applies and their interval.
    applies: Option<(Arc<Applies>, Duration)>,
    /// Its scheduled reconcile and its interval.
    reconcile: Option<(ReconcileConfig, Duration)>,
}

impl TableRun {
    /// Runs the table's stream (with its snapshot's waves), applies and reconcile until
    /// `stop`; a failing stream is retried with backoff.
    async fn run(self: Arc<Self>, stop: tokio::sync::watch::Receiver<bool>) {
        // Tasks of their own, so they run in parallel; one that ends before the stop (a
        // panic) ends the others too, and the run ends so the table can start again.
        let (end, ended) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        let (mut outer, mut inner) = (stop.clone(), ended.clone());
        tasks.spawn({
            let end = end.clone();
            async move {
                tokio::select! {
                    _ = outer.wait_for(|stopped| *stopped) => {}
                    _ = inner.wait_for(|ended| *ended) => {}
                }
                let _ = end.send(true);
            }
        });
        if self.applies.is_some() {
            let (table, stop) = (Arc::clone(&self), ended.clone());
            tasks.spawn(async move {
                if let Some((apply, every)) = &table.applies {
                    apply_loop(apply, *every, Arc::clone(&table.shared.slots), stop).await;
                }
            });
        }
        if self.reconcile.is_some() {
            let (table, stop) = (Arc::clone(&self), ended.clone());
            tasks.spawn(async move {
                if let Some((check, every)) = &table.reconcile {
                    reconcile_loop(check, *every, Arc::clone(&table.shared.slots), stop).await;
                }
            });
        }
        let (table, stop) = (Arc::clone(&self), ended.clone());
        tasks.spawn(async move { table.stream_until(stop).await });
        while let Some(done) = tasks.join_next().await {
            if let Err(error) = done {
                tracing::error!(table = %self.entry.table, %error, "a task of the table ended abnormally: its others stop, and it starts again");
            }
            let _ = end.send(true);
        }
    }

    async fn stream_until(&self, stop: tokio::sync::watch::Receiver<bool>) {
        let entry = &self.entry;
        let mut stream_config = self.stream.clone();
        let mut attempt = 0;
        while !*stop.borrow() {
            let began = std::time::Instant::now();
            if let Err(error) =
                continuous_attempt(entry, &mut stream_config, self.waiting, &self.shared, &stop)
                    .await
            {
                // A table that ran a while before failing starts its backoff over.
                if began.elapsed() > backoff(u32::MAX) {
                    attempt = 0;
                }
                attempt = continuous_attempt_after(attempt, &error);
                crate::metrics::failure(&stream_config.table, &error);
                board().state(&stream_config.table, retrying(attempt));
                if is_final(&error) {
                    tracing::error!(table = %stream_config.table, %error, retry_in_seconds = backoff(attempt).as_secs(),
                        "table failed with an error retrying cannot fix; tried again every minute until an operator acts");
                } else {
                    tracing::warn!(table = %stream_config.table, %error, attempt, "table failed; retrying");
                }
                sleep_unless_stopped(backoff(attempt), &stop).await;
                attempt += 1;
            }
        }
        board().state(&stream_config.table, TableState::Stopped);
    }
}

/// The sidecar's shared live tail over every table ([`SharedTail`]), started as one of
/// `tasks`; `None` when the server cannot wait on named tables (each table then waits on its
/// own, as `live_tail` says) or cannot be reached now (the tables report that).
async fn shared_tail(
    config: &SidecarConfig,
    retry: Duration,
    stop: &tokio::sync::watch::Receiver<bool>,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Option<Arc<SharedTail>> {
    let client = match crate::stream::connect_server(&config.server).await {
        Ok(client) => client,
        Err(error) => {
            tracing::warn!(%error, "the shared live tail could not connect: each table waits on its own");
            return None;
        }
    };
    let shared = Arc::new(SharedTail::new(
        config.tables.iter().map(|entry| entry.table.clone()),
        config.granularity,
    ));
    if !shared.supported(&client).await {
        return None;
    }
    tracing::info!(
        tables = config.tables.len(),
        "one shared live tail waits on every table"
    );
    let running = Arc::clone(&shared);
    let stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        running.run(&client, retry, stop).await;
    }));
    Some(shared)
}

/// What a table's stream shares with the sidecar's other tables.
#[derive(Clone)]
struct Shared {
    /// Its wake from the shared live tail, when there is one.
    wake: Option<Arc<Notify>>,
    /// The group committer of facts rows and verdicts.
    ledger: Option<Arc<Ledger>>,
    /// The tables' turns at lake work.
    slots: TableSlots,
    /// Its wake from [`watch_snapshots`], when the facts table's location parses.
    snapshot_wake: Option<Arc<Notify>>,
}

/// Wakes the snapshot reader of every table with a chunked snapshot open, at start and once
/// per `poll`, from one query of the facts table (or every reader, when that fails, so each
/// checks and reports for itself). A table without one then costs nothing between polls:
/// with 1,000 tables, each reading the shared facts table every poll kept both cores busy.
async fn watch_snapshots(
    facts: url::Url,
    wakes: HashMap<String, Arc<Notify>>,
    poll: Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let facts = SharedTable::of(&facts);
    loop {
        match snapshot::open_chunked_apps(&facts).await {
            Ok(open) => {
                for app_id in open {
                    if let Some(wake) = wakes.get(&app_id) {
                        wake.notify_one();
                    }
                }
            }
            Err(error) => {
                tracing::debug!(%error, "the open snapshots could not be read: every table checks its own");
                for wake in wakes.values() {
                    wake.notify_one();
                }
            }
        }
        if sleep_unless_stopped(poll, &stop).await {
            return;
        }
    }
}

/// One continuous attempt at a table: its stream and, next to it, the waves of its chunked
/// snapshot. The first of the two to end, with an error or at `stop`, ends the other after
/// its batch or wave in flight, so a failure of either ends the attempt with that error (to be
/// logged and retried) instead of leaving the table waiting on the other.
async fn continuous_attempt(
    entry: &TableEntry,
    config: &mut StreamConfig,
    waiting: Waiting,
    shared: &Shared,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    {
        let _slot = slot(&shared.slots).await;
        bootstrap(entry, config).await?;
    }
    let config: &StreamConfig = config;
    let (end_attempt, attempt_ended) = tokio::sync::watch::channel(false);
    let (connected, stream_connected) = tokio::sync::watch::channel(None);
    let stream = async {
        let streamed = async {
            let mut stream = {
                let _slot = slot(&shared.slots).await;
                Stream::connect(config.clone()).await?
            };
            let _ = connected.send(Some(stream.columns().clone()));
            stream.share_slots(Arc::clone(&shared.slots));
            if let Some(wake) = &shared.wake {
                stream.wake_on(Arc::clone(wake));
            }
            if let Some(ledger) = &shared.ledger {
                stream.share_ledger(Arc::clone(ledger));
            }
            board().state(&config.table, TableState::Running);
            stream.run_continuous(waiting, attempt_ended.clone()).await
        }
        .await;
        let _ = end_attempt.send(true);
        streamed
    };
    let backfill = async {
        // After the stream's connect, which records a selection the file changed on bronze:
        // the waves read with the columns it resolved.
        let (mut connected, mut ended) = (stream_connected, attempt_ended.clone());
        let columns = tokio::select! {
            columns = connected.wait_for(Option::is_some) => match columns.as_deref() {
                Ok(Some(columns)) => columns.clone(),
                _ => return Ok(()),
            },
            _ = ended.wait_for(|ended| *ended) => return Ok(()),
        };
        let backfilled = backfill_continuous(
            entry,
            config,
            columns,
            waiting.poll,
            shared,
            attempt_ended.clone(),
        )
        .await;
        let _ = end_attempt.send(true);
        backfilled
    };
    let stopped = async {
        let (mut stop, mut ended) = (stop.clone(), attempt_ended.clone());
        tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => { let _ = end_attempt.send(true); }
            _ = ended.wait_for(|ended| *ended) => {}
        }
    };
    let (streamed, backfilled, ()) = tokio::join!(stream, backfill, stopped);
    streamed.and(backfilled)
}

/// Maintains every table of `lake` every `every` (the first pass one interval after start)
/// until `stop`; a table that fails is logged and tried again at the next pass. Only the
/// tables of held app ids, and the shared ones where [`Ownership::holds_shared`].
async fn maintenance_loop(
    lake: Vec<(String, TableKind, Option<String>)>,
    ownership: Arc<Ownership>,
    options: MaintenanceOptions,
    every: Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    while !sleep_unless_stopped(every, &stop).await {
        for (location, kind, app_id) in &lake {
            let held = match app_id {
                Some(app_id) => ownership.holds(app_id),
                None => ownership.holds_shared(),
            };
            if !held {
                continue;
            }
            match crate::maintenance::maintain(location, *kind, &options).await {
                Ok(Some(done)) => tracing::info!(table = %location, kind = kind.name(),
                    files_before = done.files_before, files_after = done.files_after,
                    compacted = done.compacted, log_files_removed = done.log_files_removed,
                    vacuumed = done.vacuumed, "maintained"),
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(table = %location, kind = kind.name(), %error, "maintenance failed; next pass tries again");
                }
            }
            if *stop.borrow() {
                return;
            }
        }
    }
}

/// Applies bronze to silver and history every `every` until `stop`; a failing call is
/// logged and retried at the next tick (each call is idempotent).
async fn apply_loop(
    apply: &Applies,
    every: Duration,
    slots: TableSlots,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let applied = {
            let _slot = slot(&slots).await;
            // Stopped while waiting its turn (the table moved to another replica).
            if *stop.borrow() {
                return;
            }
            apply.run().await
        };
        if let Err(error) = applied {
            board().failure(apply.table(), &format!("apply: {error}"));
            tracing::warn!(table = %apply.table(), %error, "apply failed; retrying");
        }
        sleep_unless_stopped(every, &stop).await;
    }
}

/// Sleeps `duration`, or less when `stop` turns true; whether it did (a dropped sender
/// counts as a stop).
pub(crate) async fn sleep_unless_stopped(
    duration: Duration,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> bool {
    let mut watching = stop.clone();
    tokio::select! {
        _ = tokio::time::sleep(duration) => *stop.borrow(),
        _ = watching.wait_for(|stopped| *stopped) => true,
    }
}

/// One line of `status` per table.
#[derive(Clone, Debug, PartialEq)]
pub struct TableStatus {
    /// Source table.
    pub table: String,
    /// The checkpoint's last batch and whether it committed.
    pub last_batch: Option<(i64, bool)>,
    /// End offset of the last batch.
    pub end: Option<mssql_cdc_proto::Offset>,
    /// The verdict.
    pub verdict: Option<mssql_cdc_proto::CommitTime>,
    /// Seconds between now and the end offset's commit time.
    pub lag_seconds: Option<f64>,
    /// The newest snapshot: S, chunks done, chunks planned (chunked), complete.
    pub snapshot: Option<snapshot::SnapshotProgress>,
    /// The LSN silver's rows were last verified at and when (`None` without silver or such
    /// a run).
    pub verified: Option<(String, mssql_cdc_proto::CommitTime)>,
    /// The LSN every value of silver was last compared and verified at, and when.
    pub values_verified: Option<(String, mssql_cdc_proto::CommitTime)>,
    /// In a fleet, the replica holding the table's lease (none: free or given back).
    pub holder: Option<String>,
}

/// The status of every table: last batch, end offset, verdict, lag.
pub async fn status(config: &SidecarConfig) -> Result<Vec<TableStatus>> {
    let control_url = tables::table_url(&config.control)?;
    // One load of the facts table for every entry's snapshot progress.
    let facts = SharedTable::of(&tables::table_url(&config.facts)?);
    let holders = match &config.fleet {
        Some(fleet) => {
            let app_ids: Vec<String> = config.tables.iter().map(|e| e.app_id.clone()).collect();
            crate::fleet::leases::Leases::open(&fleet.location(&config.facts))
                .await?
                .leases(&app_ids)
                .await?
        }
        None => Default::default(),
    };
    let mut statuses = Vec::new();
    for entry in &config.tables {
        let last = Checkpoint::open(&config.checkpoint(&entry.app_id))
            .await?
            .last()
            .await?;
        let verdict = control::finalized_until(&control_url, &entry.table).await?;
        let end = last.as_ref().map(|batch| batch.end);
        let lag_seconds = end
            .and_then(|offset| offset.commit_ts)
            .map(|time| (chrono::Utc::now().timestamp_micros() - time.0) as f64 / 1e6);
        let control_row = match &entry.silver {
            Some(silver) => control::row(&control_url, silver).await?,
            None => None,
        };
        statuses.push(TableStatus {
            table: entry.table.clone(),
            last_batch: last.map(|batch| (batch.batch_id, batch.committed)),
            end,
            verdict,
            lag_seconds,
            snapshot: snapshot::progress(&facts, &entry.app_id).await?,
            verified: control_row.as_ref().and_then(|row| row.verified.clone()),
            values_verified: control_row.and_then(|row| row.values_verified),
            holder: holders
                .get(&entry.app_id)
                .and_then(|lease| lease.holder.clone()),
        });
    }
    Ok(statuses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continuous_table_waits_a_minute_after_an_error_retrying_cannot_fix() {
        let fenced = WriterError::Fenced("two writers of one app id are running".into());
        let dropped = WriterError::Internal("the connection dropped".into());
        assert_eq!(
            backoff(continuous_attempt_after(0, &dropped)),
            Duration::from_secs(1)
        );
        assert_eq!(
            backoff(continuous_attempt_after(3, &dropped)),
            Duration::from_secs(8)
        );
        for attempt in [0, 3, 9] {
            assert_eq!(
                backoff(continuous_attempt_after(attempt, &fenced)),
                Duration::from_secs(60)
            );
        }
    }

    #[test]
    fn the_deployed_sidecar_files_load() {
        // Compose's and Kubernetes' files (deploy/): what a deployment starts with must parse.
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        for file in ["sidecar.toml", "k8s/sidecar.toml"] {
            let config = SidecarConfig::load(&deploy.join(file)).expect(file);
            assert!(!config.tables.is_empty(), "{file}");
            assert!(
                config.status_token_file.is_some(),
                "{file}: the page's own token"
            );
        }
    }

    /// A sidecar file of these `[[tables]]` entries, loaded.
    fn load(tables: &str) -> Result<SidecarConfig> {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("sidecar.toml");
        let file = format!(
            "server = \"http://127.0.0.1:1\"\nfacts = \"/lake/facts\"\n\
             control = \"/lake/control\"\n\n{tables}"
        );
        std::fs::write(&path, file).expect("write");
        SidecarConfig::load(&path)
    }

    #[test]
    fn two_entries_of_one_source_table_are_refused_as_sharing_its_verdict() {
        let tables = |second_table: &str| {
            format!(
                "[[tables]]\ntable = \"dbo.orders\"\ntarget = \"/lake/bronze_a\"\napp_id = \"a\"\n\n\
                 [[tables]]\ntable = \"{second_table}\"\ntarget = \"/lake/bronze_b\"\napp_id = \"b\"\n"
            )
        };
        load(&tables("dbo.customers")).expect("two tables load");
        let refused = load(&tables("dbo.orders")).expect_err("one table twice");
        assert!(
            refused.to_string().contains("share its one verdict"),
            "{refused}"
        );
    }

    #[test]
    fn a_table_sets_what_its_scheduled_reconcile_compares() {
        let tables = |sample: &str| {
            format!(
                "[[tables]]\ntable = \"dbo.orders\"\ntarget = \"/lake/bronze\"\napp_id = \"a\"\n\
                 silver = \"/lake/silver\"\nkeys = [\"order_id\"]\n{sample}"
            )
        };
        let config = load(&tables(
            "reconcile_sample = 1.0\nreconcile_value_sums = false\n",
        ))
        .expect("loads");
        let reconcile = reconcile_config(&config, &config.tables[0]).expect("a silver table");
        assert_eq!((reconcile.sample, reconcile.value_sums), (1.0, false));
        let config = load(&tables("")).expect("loads");
        let reconcile = reconcile_config(&config, &config.tables[0]).expect("a silver table");
        assert_eq!(
            (reconcile.sample, reconcile.value_sums),
            (crate::reconcile::DEFAULT_SAMPLE, true)
        );
        let refused = load(&tables("reconcile_sample = 1.5\n")).expect_err("past 1");
        assert!(
            refused.to_string().contains("reconcile_sample"),
            "{refused}"
        );
    }

    #[test]
    fn a_tables_column_selection_reaches_its_stream() {
        let tables = |lists: &str| {
            format!(
                "[[tables]]\ntable = \"dbo.orders\"\ntarget = \"/lake/bronze\"\napp_id = \"a\"\n\
                 silver = \"/lake/silver\"\nkeys = [\"order_id\"]\n{lists}"
            )
        };
        let config = load(&tables("except_columns = [\"note\"]\n")).expect("loads");
        let entry = &config.tables[0];
        let except = ColumnSelection::Except(vec!["note".into()]);
        assert_eq!(config.stream(entry).columns, Some(except.clone()));
        let reconcile = reconcile_config(&config, entry).expect("a silver table");
        assert_eq!(
            reconcile.columns, None,
            "bronze's, as the stream records it"
        );
        let refused = load(&tables(
            "columns = [\"order_id\"]\nexcept_columns = [\"note\"]\n",
        ))
        .expect_err("both lists");
        assert!(refused.to_string().contains("not both"), "{refused}");
    }
}
