//! The `mssql-cdc-writer` command line: every subcommand's flags, each with its environment
//! variable (`MSSQL_CDC_WRITER_<FLAG>`; the server URL is `MSSQL_CDC_FLIGHT_URL`). Shared
//! groups (`--server`, `--snapshot-keys`) are defined once and flattened.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Arg, Args, Parser, Subcommand};
use mssql_cdc_proto::selection::ColumnSelection;
use mssql_cdc_writer::tables::TableKind;

/// Stream SQL Server CDC from an mssql-cdc-flight server into Delta tables.
#[derive(Parser)]
#[command(version, about)]
pub struct Cli {
    #[command(flatten)]
    pub log: mssql_cdc_proto::logging::LogArgs,
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Subcommand)]
pub enum Commands {
    /// Stream one table (flags) or every table of a sidecar file (--config) into bronze,
    /// facts and control.
    Run(Box<RunArgs>),
    /// Read waves of the open chunked snapshot of a table into bronze (see docs/snapshots.md).
    Backfill(Box<BackfillArgs>),
    /// Apply bronze's changes to a current-state silver table (see docs/silver.md).
    Apply(Box<ApplyArgs>),
    /// Apply bronze's changes to a history table: every version of every row, SCD type 2
    /// (see docs/silver.md, "History").
    History(Box<HistoryArgs>),
    /// Open, inspect, pause or resume a table's snapshot (see docs/snapshots.md).
    #[command(subcommand)]
    Snapshot(Box<SnapshotCommand>),
    /// Adopt an existing copy of a table (a Delta table or Parquet files) as its snapshot at
    /// the copy's time or LSN, so the stream starts there (see docs/snapshots.md).
    Seed(Box<SeedArgs>),
    /// Compare silver with the source table, bucket by bucket and row by row (see
    /// docs/reconcile.md); exits 0 only when every bucket matches or is in flight.
    Reconcile(Box<ReconcileArgs>),
    /// Compact, checkpoint, clean the logs of and VACUUM every table of a sidecar file, or
    /// one table (see docs/operations.md, "Maintenance").
    Maintain(Box<MaintainArgs>),
    /// Print each table of a sidecar file: last batch, end offset, verdict, lag.
    Status {
        /// The sidecar file.
        #[arg(long, env = "MSSQL_CDC_WRITER_CONFIG")]
        config: PathBuf,
    },
    /// How old a table's verdict is now (JSON): finalized_until and when it last moved, as
    /// ages in seconds, and the snapshot holding it; reads the control table only (the seed's
    /// `finalization.freshness`; docs/writer.md, "Freshness").
    Freshness {
        /// The control table.
        #[arg(long, env = "MSSQL_CDC_WRITER_CONTROL")]
        control: String,
        /// The control row: the source table (schema.table) for bronze's verdict, or the
        /// silver table's name given to apply.
        #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
        table: String,
    },
    /// The whole pipeline on the embedded default: a simulated CDC database with a workload,
    /// the Flight server in process, and every table streamed into a local lake.
    #[cfg(feature = "sim")]
    Demo(DemoArgs),
}

#[derive(Args)]
pub struct MaintainArgs {
    /// The sidecar file: every table it names (facts, control, the reconcile report, each
    /// table's bronze, snapshot plans and silver).
    #[arg(
        long,
        required_unless_present = "location",
        conflicts_with = "location",
        env = "MSSQL_CDC_WRITER_CONFIG"
    )]
    pub config: Option<PathBuf>,
    /// One table's location instead of a sidecar file (with --kind).
    #[arg(long, requires = "kind")]
    pub location: Option<String>,
    /// The kind of the table at --location.
    #[arg(long, value_parser = table_kind_parser())]
    pub kind: Option<TableKind>,
    /// Hours VACUUM keeps files no version references (default: the sidecar file's
    /// vacuum_retention_hours, else 168); never less than the table's
    /// delta.deletedFileRetentionDuration.
    #[arg(long)]
    pub vacuum_retention_hours: Option<f64>,
    /// Compact a table once it holds this many small files.
    #[arg(long, default_value_t = 16)]
    pub min_files: usize,
}

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Open a snapshot: `full` reads the whole table now, `chunked` records S and the key
    /// extent and leaves the chunks to `backfill` (or the sidecar).
    Open {
        #[command(flatten)]
        table: SnapshotTable,
        /// full or chunked.
        #[arg(long, default_value = "chunked", env = "MSSQL_CDC_WRITER_MODE")]
        mode: String,
        /// Open a chunked re-snapshot even when the table has a complete snapshot (silver is
        /// rebuilt from it when it completes).
        #[arg(long, env = "MSSQL_CDC_WRITER_RESNAPSHOT")]
        resnapshot: bool,
    },
    /// The newest snapshot of the app id: mode, chunks done of total, paused or done (JSON).
    Status {
        #[command(flatten)]
        table: SnapshotTable,
    },
    /// Pause the open chunked snapshot: every backfill stops before its next wave, in any
    /// process, until `resume` (the wave being read finishes).
    Pause {
        #[command(flatten)]
        table: SnapshotTable,
        /// Why, recorded with the pause and shown by status.
        #[arg(long, env = "MSSQL_CDC_WRITER_REASON")]
        reason: Option<String>,
    },
    /// Resume a paused chunked snapshot.
    Resume {
        #[command(flatten)]
        table: SnapshotTable,
    },
}

/// `seed`: the table, its stream's lake and the copy.
#[derive(Args)]
pub struct SeedArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// The copy: a Delta table, a Parquet file or a directory of Parquet files.
    #[arg(long, env = "MSSQL_CDC_WRITER_COPY")]
    pub copy: String,
    /// Where the copy stands: an LSN (0x...) or a time (UTC without an offset), every commit
    /// up to it included; a time maps to the last commit before it (earlier is safe).
    #[arg(long, env = "MSSQL_CDC_WRITER_AS_OF")]
    pub as_of: String,
    /// Replace the table's complete snapshot with this newer copy.
    #[arg(long, env = "MSSQL_CDC_WRITER_RESEED")]
    pub reseed: bool,
    /// Read captured columns the copy lacks as NULL instead of refusing the copy.
    #[arg(long, env = "MSSQL_CDC_WRITER_ALLOW_MISSING_COLUMNS")]
    pub allow_missing_columns: bool,
}

/// `--admin` and its credentials: a call sent to a sidecar's admin service.
#[derive(Args, Clone)]
pub struct AdminArgs {
    /// A sidecar's admin service (`admin_listen` of its file): the call goes there and the
    /// sidecar's own settings for the table apply; without it the lake is used directly.
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN")]
    pub admin: Option<String>,
    /// A file holding the admin service's bearer token (its `admin_token_file`).
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN_TOKEN_FILE", requires = "admin")]
    pub admin_token_file: Option<PathBuf>,
    /// PEM certificate of the CA that signed the admin service's certificate (`https://`).
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN_CA", requires = "admin")]
    pub admin_ca: Option<PathBuf>,
}

#[derive(Args)]
#[command(mut_args(StreamLake::required_unless("admin", &[])))]
pub struct SnapshotTable {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// The table; without `--admin`, its stream's lake (the server is used by `open`,
    /// `pause` and `resume`).
    #[command(flatten)]
    pub stream: TableArgs,
    #[command(flatten)]
    pub snapshot_keys: SnapshotKeys,
}

/// The table a snapshot command works on: the Flight server, the source table and its
/// stream's lake.
#[derive(Args)]
pub struct TableArgs {
    #[command(flatten)]
    pub server: FlightServer,
    /// Source table (schema.table).
    #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
    pub table: String,
    #[command(flatten)]
    pub lake: StreamLake,
    #[command(flatten)]
    pub columns: ColumnArgs,
}

/// `--target`, `--facts` and `--app-id`: a stream's bronze and facts tables and its app id.
/// Each command flattening them says when they are required (`#[command(mut_args(...))]`
/// with [`StreamLake::required_unless`] or [`StreamLake::required`]), so a missing one
/// stays a usage error.
#[derive(Args, Clone)]
pub struct StreamLake {
    /// Bronze table location (a path or an object-store URL; its plans table lies beside it).
    #[arg(long, env = "MSSQL_CDC_WRITER_TARGET")]
    pub target: Option<String>,
    /// Facts table location.
    #[arg(long, env = "MSSQL_CDC_WRITER_FACTS")]
    pub facts: Option<String>,
    /// The stream's app id (the writer's identity; a new checkpoint needs a new app id).
    #[arg(long, env = "MSSQL_CDC_WRITER_APP_ID")]
    pub app_id: Option<String>,
}

impl StreamLake {
    const IDS: [&'static str; 3] = ["target", "facts", "app_id"];

    /// For `mut_args`: the three flags, and the command's flags named in `also`, are
    /// required unless the flag `other` is given.
    pub fn required_unless(
        other: &'static str,
        also: &'static [&'static str],
    ) -> impl FnMut(Arg) -> Arg {
        move |arg| {
            let id = arg.get_id().as_str();
            if Self::IDS.contains(&id) || also.contains(&id) {
                arg.required_unless_present(other)
            } else {
                arg
            }
        }
    }

    /// For `mut_args`: the three flags are required.
    pub fn required(arg: Arg) -> Arg {
        if Self::IDS.contains(&arg.get_id().as_str()) {
            arg.required(true)
        } else {
            arg
        }
    }
}

/// `--server`, shared by every command that reads the Flight server.
#[derive(Args, Clone)]
pub struct FlightServer {
    /// Flight server URL (`https://` verifies the server against `MSSQL_CDC_FLIGHT_TLS_CA`).
    #[arg(
        id = "server",
        long = "server",
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    pub url: String,
}

/// `--columns` or `--except-columns`: the captured columns a table's stream, snapshots and
/// reconcile ask the server for. Every command of one table takes the same (the sidecar's
/// file says it once per table).
#[derive(Args, Clone, Default)]
pub struct ColumnArgs {
    /// Captured columns to copy, comma-separated, in this order (the key columns among
    /// them); default every captured column.
    #[arg(
        long,
        value_delimiter = ',',
        env = "MSSQL_CDC_WRITER_COLUMNS",
        conflicts_with = "except_columns"
    )]
    pub columns: Option<Vec<String>>,
    /// Captured columns never to copy, comma-separated, matched ignoring case: the server
    /// leaves them out, so they never cross the network. Not a key column.
    #[arg(long, value_delimiter = ',', env = "MSSQL_CDC_WRITER_EXCEPT_COLUMNS")]
    pub except_columns: Option<Vec<String>>,
}

impl ColumnArgs {
    /// The selection the flags say; `None` without either (bronze's selection holds; an
    /// empty `--except-columns=` says every column).
    pub fn selection(&self) -> anyhow::Result<Option<ColumnSelection>> {
        // `--except-columns=` parses as one empty name: it means none.
        let names = |list: &Option<Vec<String>>| {
            list.as_ref().map(|names| {
                names
                    .iter()
                    .filter(|name| !name.is_empty())
                    .cloned()
                    .collect::<Vec<_>>()
            })
        };
        Ok(ColumnSelection::given(
            names(&self.columns),
            names(&self.except_columns),
        )?)
    }

    /// Refuses the flags beside `--admin`: the sidecar's file says the table's selection.
    pub fn refuse_with_admin(&self, admin: &AdminArgs) -> anyhow::Result<()> {
        match (self.selection()?, &admin.admin) {
            (Some(_), Some(_)) => Err(anyhow::anyhow!(
                "--columns and --except-columns do not go with --admin: the sidecar's file \
                 says the table's selection"
            )),
            _ => Ok(()),
        }
    }
}

/// `--snapshot-keys`, shared by the commands that can open or read a chunked snapshot.
#[derive(Args, Clone)]
pub struct SnapshotKeys {
    /// Columns a chunked snapshot is cut on, comma-separated (unique or not; default the
    /// unique index CDC uses; a table without one needs them).
    #[arg(
        id = "snapshot_keys",
        long = "snapshot-keys",
        value_delimiter = ',',
        env = "MSSQL_CDC_WRITER_SNAPSHOT_KEYS"
    )]
    pub columns: Option<Vec<String>>,
}

#[derive(Args)]
#[command(mut_args(StreamLake::required))]
pub struct BackfillArgs {
    #[command(flatten)]
    pub stream: TableArgs,
    /// Chunks read in parallel per round.
    #[arg(long, default_value_t = 2, env = "MSSQL_CDC_WRITER_PARTITIONS")]
    pub partitions: u32,
    /// Most rows per chunk (the first call plans; later calls keep its plan).
    #[arg(long, default_value_t = 100_000, env = "MSSQL_CDC_WRITER_CHUNK_ROWS")]
    pub chunk_rows: u64,
    /// Stop after this many waves.
    #[arg(long, env = "MSSQL_CDC_WRITER_MAX_WAVES")]
    pub max_waves: Option<u32>,
    /// Seconds a wave aims at (whole rounds of --partitions chunks).
    #[arg(
        long,
        default_value_t = 30.0,
        env = "MSSQL_CDC_WRITER_TARGET_WAVE_SECONDS"
    )]
    pub target_wave_seconds: f64,
    /// Pause while the stream's retention headroom is below this many hours (or unknown).
    #[arg(long, env = "MSSQL_CDC_WRITER_MIN_HEADROOM_HOURS")]
    pub min_headroom_hours: Option<f64>,
    #[command(flatten)]
    pub snapshot_keys: SnapshotKeys,
}

#[derive(Args)]
pub struct ApplyArgs {
    /// Source table (schema.table): names bronze's verdict in the control table.
    #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
    pub table: String,
    /// Bronze location (as the stream's --target).
    #[arg(long, env = "MSSQL_CDC_WRITER_BRONZE")]
    pub bronze: String,
    /// Silver location.
    #[arg(long, env = "MSSQL_CDC_WRITER_TARGET")]
    pub target: String,
    /// Key columns, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        required = true,
        env = "MSSQL_CDC_WRITER_KEYS"
    )]
    pub keys: Vec<String>,
    /// Control table location.
    #[arg(long, env = "MSSQL_CDC_WRITER_CONTROL")]
    pub control: String,
    /// Facts table location (needed for chunked snapshots and for silver's verdict).
    #[arg(long, env = "MSSQL_CDC_WRITER_FACTS")]
    pub facts: Option<String>,
    /// Refuse bronze rows of any other capture instance.
    #[arg(long, env = "MSSQL_CDC_WRITER_CAPTURE_INSTANCE")]
    pub capture_instance: Option<String>,
    /// Verdict granularity: minute, hour or day.
    #[arg(long, default_value = "hour", env = "MSSQL_CDC_WRITER_GRANULARITY")]
    pub granularity: String,
    /// Turn on deletion vectors for silver (`delta.enableDeletionVectors`): a merge marks the
    /// rows it replaces beside their file instead of writing the file again. Readers need
    /// deletion vector support (Spark, Databricks, delta-rs 1.1 and later); a silver that has
    /// them keeps them without this flag.
    #[arg(long, env = "MSSQL_CDC_WRITER_DELETION_VECTORS")]
    pub deletion_vectors: bool,
}

#[derive(Args)]
pub struct HistoryArgs {
    /// Source table (schema.table): names bronze's verdict in the control table.
    #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
    pub table: String,
    /// Bronze location (as the stream's --target).
    #[arg(long, env = "MSSQL_CDC_WRITER_BRONZE")]
    pub bronze: String,
    /// History location.
    #[arg(long, env = "MSSQL_CDC_WRITER_TARGET")]
    pub target: String,
    /// Key columns, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        required = true,
        env = "MSSQL_CDC_WRITER_KEYS"
    )]
    pub keys: Vec<String>,
    /// Control table location.
    #[arg(long, env = "MSSQL_CDC_WRITER_CONTROL")]
    pub control: String,
    /// Facts table location: where the stream has read to, and the snapshots.
    #[arg(long, env = "MSSQL_CDC_WRITER_FACTS")]
    pub facts: String,
    /// Refuse bronze rows of any other capture instance.
    #[arg(long, env = "MSSQL_CDC_WRITER_CAPTURE_INSTANCE")]
    pub capture_instance: Option<String>,
    /// Verdict granularity: minute, hour or day.
    #[arg(long, default_value = "hour", env = "MSSQL_CDC_WRITER_GRANULARITY")]
    pub granularity: String,
    /// Only changes of these columns open a new version (comma-separated); a change of
    /// another updates the current version in place. Default: every captured column.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "track_history_except_columns",
        env = "MSSQL_CDC_WRITER_TRACK_HISTORY_COLUMNS"
    )]
    pub track_history_columns: Vec<String>,
    /// Changes of every captured column but these open a new version (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        env = "MSSQL_CDC_WRITER_TRACK_HISTORY_EXCEPT_COLUMNS"
    )]
    pub track_history_except_columns: Vec<String>,
}

#[derive(Args)]
pub struct ReconcileArgs {
    /// With `--admin`, the sidecar reconciles the table with its file's settings (its silver,
    /// bronze, control, facts, keys and report); `--sample`, `--bucket-rows`, `--seed` and
    /// `--value-sums` still apply.
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub server: FlightServer,
    /// Source table (schema.table): names bronze's verdict in the control table.
    #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
    pub table: String,
    /// The stream's column selection (with `--admin`, the sidecar file's): a column it
    /// leaves out is not compared, and does not keep the values from being verified.
    #[command(flatten)]
    pub columns: ColumnArgs,
    /// Silver location (as apply's --target).
    #[arg(
        long,
        env = "MSSQL_CDC_WRITER_SILVER",
        required_unless_present = "admin"
    )]
    pub silver: Option<String>,
    /// Bronze location (its changes newer than the compared LSN make a difference in flight).
    #[arg(
        long,
        env = "MSSQL_CDC_WRITER_BRONZE",
        required_unless_present = "admin"
    )]
    pub bronze: Option<String>,
    /// Control table location (silver's position in, its verified LSN out).
    #[arg(
        long,
        env = "MSSQL_CDC_WRITER_CONTROL",
        required_unless_present = "admin"
    )]
    pub control: Option<String>,
    /// Facts table location: also check the chunks of bronze's newest chunked snapshot.
    #[arg(long, env = "MSSQL_CDC_WRITER_FACTS")]
    pub facts: Option<String>,
    /// The key columns to compare on (default the unique index CDC uses): one integer or
    /// date column is summed on a grid; any other key (text, composite, unique or not) is
    /// cut into buckets by the source.
    #[arg(long, value_delimiter = ',', env = "MSSQL_CDC_WRITER_KEYS")]
    pub keys: Option<Vec<String>>,
    /// Rows a bucket holds about (default 1,000,000; with `--admin`, the sidecar's).
    #[arg(long, env = "MSSQL_CDC_WRITER_BUCKET_ROWS")]
    pub bucket_rows: Option<u64>,
    /// Share of matching buckets also compared row by row, in [0, 1] (default 0.01; with
    /// `--admin`, the sidecar file's `reconcile_sample`).
    #[arg(long, env = "MSSQL_CDC_WRITER_SAMPLE")]
    pub sample: Option<f64>,
    /// Seed of that sample (default random; the result prints it).
    #[arg(long, env = "MSSQL_CDC_WRITER_SEED")]
    pub seed: Option<u64>,
    /// Whether every value is compared: both sides sum a digest of every row's values (a
    /// grid key), or every bucket is read row by row (a keyset key) (default true; with
    /// `--admin`, the sidecar file's `reconcile_value_sums`); false compares values only in
    /// the buckets read row by row.
    #[arg(long, env = "MSSQL_CDC_WRITER_VALUE_SUMS")]
    pub value_sums: Option<bool>,
    /// Report table location: every run's bucket and key rows.
    #[arg(long, env = "MSSQL_CDC_WRITER_REPORT")]
    pub report: Option<String>,
    /// Output: json (the whole result) or table (one line per bucket and finding).
    #[arg(long, default_value = "table", value_parser = ["json", "table"], env = "MSSQL_CDC_WRITER_OUTPUT")]
    pub output: String,
}

#[cfg(feature = "sim")]
#[derive(Args)]
pub struct DemoArgs {
    /// Directory of the simulated database and the lake (default: a new temporary one, kept).
    #[arg(long, env = "MSSQL_CDC_WRITER_DIR")]
    pub dir: Option<PathBuf>,
    /// Workload commits before the first stream run, and again before the second.
    #[arg(long, default_value_t = 2000, env = "MSSQL_CDC_WRITER_COMMITS")]
    pub commits: u64,
    /// `pipeline` (every table end to end) or `data-loss` (a writer stopped past retention
    /// heals by re-snapshot, ending with silver verified against the source).
    #[arg(long, default_value = "pipeline", value_parser = ["pipeline", "data-loss"], env = "MSSQL_CDC_WRITER_SCENARIO")]
    pub scenario: String,
}

#[derive(Args)]
#[command(mut_args(StreamLake::required_unless("config", &["table"])))]
pub struct RunArgs {
    #[command(flatten)]
    pub server: FlightServer,
    /// Source table (schema.table).
    #[arg(long, env = "MSSQL_CDC_WRITER_TABLE")]
    pub table: Option<String>,
    #[command(flatten)]
    pub lake: StreamLake,
    /// Control table location (the completeness verdict).
    #[arg(long, env = "MSSQL_CDC_WRITER_CONTROL")]
    pub control: Option<String>,
    /// Checkpoint location, a directory or an object-store URL (default:
    /// `_checkpoints/<app id>` beside the facts table, on the lake's store).
    #[arg(long, env = "MSSQL_CDC_WRITER_CHECKPOINT")]
    pub checkpoint: Option<String>,
    /// A sidecar file listing many tables (see docs/writer.md); replaces the per-table flags.
    #[arg(long, conflicts_with_all = ["table", "target", "facts", "app_id", "checkpoint"], env = "MSSQL_CDC_WRITER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where a new checkpoint starts: earliest, latest, or an LSN already processed.
    #[arg(long, default_value = "earliest", env = "MSSQL_CDC_WRITER_STARTING")]
    pub starting: String,
    /// Most commits per batch (default: up to max_lsn).
    #[arg(long, env = "MSSQL_CDC_WRITER_MAX_COMMITS")]
    pub max_commits: Option<u64>,
    /// Endpoints read in parallel.
    #[arg(long, default_value_t = 2, env = "MSSQL_CDC_WRITER_PARTITIONS")]
    pub partitions: u32,
    /// Verdict granularity: minute, hour or day.
    #[arg(long, default_value = "hour", env = "MSSQL_CDC_WRITER_GRANULARITY")]
    pub granularity: String,
    /// Read to the max_lsn recorded at start, then exit (default: run until Ctrl-C).
    #[arg(long, env = "MSSQL_CDC_WRITER_AVAILABLE_NOW")]
    pub available_now: bool,
    /// Seconds between polls when nothing is new (continuous mode); with the live tail, the
    /// longest wait for a commit.
    #[arg(long, default_value_t = 5.0, env = "MSSQL_CDC_WRITER_POLL_SECONDS")]
    pub poll_seconds: f64,
    /// Poll every --poll-seconds instead of waiting on the server's live tail
    /// (`wait_for_commits`, which wakes the stream as soon as a commit lands).
    #[arg(long, env = "MSSQL_CDC_WRITER_NO_LIVE_TAIL")]
    pub no_live_tail: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (docs/operations.md); none without.
    #[arg(long, env = "MSSQL_CDC_WRITER_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// With --config: serve the sidecar's live status page at http://ADDR/ and its probes
    /// /healthz and /readyz (docs/operations.md); overrides the file's `status_listen`.
    #[arg(long, requires = "config", env = "MSSQL_CDC_WRITER_STATUS_LISTEN")]
    pub status_listen: Option<String>,
    /// Skip purged changes (with a data_skipped facts row) instead of stopping. Loses changes.
    #[arg(long, env = "MSSQL_CDC_WRITER_SKIP_DATA_LOSS")]
    pub skip_data_loss: bool,
    /// On a schema change in the source: `evolve` (new columns join bronze and silver, types
    /// that fit are cast) or `fail` (stop the table, nothing of the batch written).
    #[arg(
        long,
        env = "MSSQL_CDC_WRITER_SCHEMA_CHANGE_POLICY",
        default_value = "evolve"
    )]
    pub schema_change_policy: String,
    /// When changes were purged before they were read: `fail` (stop the table) or
    /// `resnapshot` (open a chunked re-snapshot, resume the stream at its S; `backfill` or the
    /// sidecar reads it).
    #[arg(long, env = "MSSQL_CDC_WRITER_ON_DATA_LOSS", default_value = "fail")]
    pub on_data_loss: String,
    /// Open a chunked re-snapshot when a newer capture instance becomes active, so columns
    /// only it captures are filled for every row (`backfill` or the sidecar reads it).
    #[arg(long, env = "MSSQL_CDC_WRITER_SNAPSHOT_ON_SWITCH")]
    pub snapshot_on_switch: bool,
    /// Open a chunked re-snapshot once the newest snapshot is this many days old.
    #[arg(long, env = "MSSQL_CDC_WRITER_RESNAPSHOT_EVERY_DAYS")]
    pub resnapshot_every_days: Option<f64>,
    /// With `--on-data-loss resnapshot`: a purge met less than this many days after the last
    /// one healed stops the table instead of re-snapshotting again (the seed's anti-loop
    /// guard; default 7, 0 turns it off for a rerun after fixing the cause).
    #[arg(long, env = "MSSQL_CDC_WRITER_RESNAPSHOT_INTERVAL_DAYS")]
    pub resnapshot_interval_days: Option<f64>,
    /// With a new checkpoint, snapshot the table first and start the stream at its S: `full`
    /// (read now, one append) or `chunked` (opened now, read by `backfill` next to the stream).
    #[arg(long, env = "MSSQL_CDC_WRITER_BOOTSTRAP")]
    pub bootstrap: Option<String>,
    #[command(flatten)]
    pub snapshot_keys: SnapshotKeys,
    #[command(flatten)]
    pub columns: ColumnArgs,
}

/// `--kind`: one of [`TableKind::ALL`] by its name (listed in `--help`).
fn table_kind_parser() -> impl TypedValueParser<Value = TableKind> {
    PossibleValuesParser::new(TableKind::ALL.map(TableKind::name))
        .map(|name| TableKind::named(&name).expect("a possible value names a kind"))
}
