//! The `mssql-cdc-writer` command: stream a table from an mssql-cdc-flight server into Delta.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::{Stream, StreamConfig};
use mssql_cdc_writer::{admin, sidecar};

// As in the server: per-batch multi-megabyte Arrow and Parquet buffers are reused by
// mimalloc instead of going back to mmap/munmap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod demo;

/// Stream SQL Server CDC from an mssql-cdc-flight server into Delta tables.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Stream one table (flags) or every table of a sidecar file (--config) into bronze,
    /// facts and control.
    Run(Box<RunArgs>),
    /// Read waves of the open chunked snapshot of a table into bronze (see docs/snapshots.md).
    Backfill(Box<BackfillArgs>),
    /// Apply bronze's changes to a current-state silver table (see docs/silver.md).
    Apply(Box<ApplyArgs>),
    /// Open, inspect, pause or resume a table's snapshot (see docs/snapshots.md).
    #[command(subcommand)]
    Snapshot(Box<SnapshotCommand>),
    /// Print each table of a sidecar file: last batch, end offset, verdict, lag.
    Status {
        /// The sidecar file.
        #[arg(long)]
        config: PathBuf,
    },
    /// The whole pipeline on the embedded default: a simulated CDC database with a workload,
    /// the Flight server in process, and every table streamed into a local lake.
    Demo(DemoArgs),
}

#[derive(Subcommand)]
enum SnapshotCommand {
    /// Open a snapshot: `full` reads the whole table now, `chunked` records S and the key
    /// extent and leaves the chunks to `backfill` (or the sidecar).
    Open {
        #[command(flatten)]
        table: SnapshotTable,
        /// full or chunked.
        #[arg(long, default_value = "chunked")]
        mode: String,
        /// Open a chunked re-snapshot even when the table has a complete snapshot (silver is
        /// rebuilt from it when it completes).
        #[arg(long)]
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
        #[arg(long)]
        reason: Option<String>,
    },
    /// Resume a paused chunked snapshot.
    Resume {
        #[command(flatten)]
        table: SnapshotTable,
    },
}

#[derive(Args)]
struct SnapshotTable {
    /// A sidecar's admin service (`admin_listen` of its file): the call goes there and the
    /// sidecar's own settings for the table apply; without it the lake is used directly.
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN")]
    admin: Option<String>,
    /// A file holding the admin service's bearer token (its `admin_token_file`).
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN_TOKEN_FILE", requires = "admin")]
    admin_token_file: Option<PathBuf>,
    /// PEM certificate of the CA that signed the admin service's certificate (`https://`).
    #[arg(long, env = "MSSQL_CDC_WRITER_ADMIN_CA", requires = "admin")]
    admin_ca: Option<PathBuf>,
    /// Flight server URL (used by `open`, `pause` and `resume`).
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    server: String,
    /// Source table (schema.table).
    #[arg(long)]
    table: String,
    /// Bronze table location (its plans table lies beside it).
    #[arg(long, required_unless_present = "admin")]
    target: Option<String>,
    /// Facts table location.
    #[arg(long, required_unless_present = "admin")]
    facts: Option<String>,
    /// The stream's app id.
    #[arg(long, required_unless_present = "admin")]
    app_id: Option<String>,
    #[command(flatten)]
    snapshot_keys: SnapshotKeys,
}

impl SnapshotTable {
    fn config(&self) -> anyhow::Result<StreamConfig> {
        let missing =
            || anyhow::anyhow!("--target, --facts and --app-id are needed without --admin");
        Ok(snapshot_config(
            self.server.clone(),
            self.table.clone(),
            self.target.clone().ok_or_else(missing)?,
            self.facts.clone().ok_or_else(missing)?,
            self.app_id.clone().ok_or_else(missing)?,
            2,
            self.snapshot_keys.columns.clone(),
        ))
    }
}

/// `--snapshot-keys`, shared by the commands that can open or read a chunked snapshot.
#[derive(Args, Clone)]
struct SnapshotKeys {
    /// Columns a chunked snapshot is cut on, comma-separated (unique or not; default the
    /// unique index CDC uses; a table without one needs them).
    #[arg(long = "snapshot-keys", value_delimiter = ',')]
    columns: Option<Vec<String>>,
}

/// The stream configuration a snapshot command needs: its table, lake and app id (no
/// checkpoint or control table: snapshots live in bronze, facts and the plans table).
fn snapshot_config(
    server: String,
    table: String,
    target: String,
    facts: String,
    app_id: String,
    partitions: u32,
    snapshot_keys: Option<Vec<String>>,
) -> StreamConfig {
    StreamConfig {
        server,
        table,
        target,
        facts,
        control: None,
        app_id,
        checkpoint: PathBuf::new(),
        starting: "earliest".into(),
        max_commits: None,
        partitions,
        granularity: Granularity::Hour,
        fail_on_data_loss: true,
        snapshot_keys,
    }
}

#[derive(Args)]
struct BackfillArgs {
    /// Flight server URL.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    server: String,
    /// Source table (schema.table).
    #[arg(long)]
    table: String,
    /// Bronze table location (its plans table lies beside it).
    #[arg(long)]
    target: String,
    /// Facts table location.
    #[arg(long)]
    facts: String,
    /// The stream's app id.
    #[arg(long)]
    app_id: String,
    /// Chunks read in parallel per round.
    #[arg(long, default_value_t = 2)]
    partitions: u32,
    /// Most rows per chunk (the first call plans; later calls keep its plan).
    #[arg(long, default_value_t = 100_000)]
    chunk_rows: u64,
    /// Stop after this many waves.
    #[arg(long)]
    max_waves: Option<u32>,
    /// Seconds a wave aims at (whole rounds of --partitions chunks).
    #[arg(long, default_value_t = 30.0)]
    target_wave_seconds: f64,
    /// Pause while the stream's retention headroom is below this many hours (or unknown).
    #[arg(long)]
    min_headroom_hours: Option<f64>,
    #[command(flatten)]
    snapshot_keys: SnapshotKeys,
}

#[derive(Args)]
struct ApplyArgs {
    /// Source table (schema.table): names bronze's verdict in the control table.
    #[arg(long)]
    table: String,
    /// Bronze location (as the stream's --target).
    #[arg(long)]
    bronze: String,
    /// Silver location.
    #[arg(long)]
    target: String,
    /// Key columns, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    keys: Vec<String>,
    /// Control table location.
    #[arg(long)]
    control: String,
    /// Facts table location (needed for chunked snapshots and for silver's verdict).
    #[arg(long)]
    facts: Option<String>,
    /// Refuse bronze rows of any other capture instance.
    #[arg(long)]
    capture_instance: Option<String>,
    /// Verdict granularity: minute, hour or day.
    #[arg(long, default_value = "hour")]
    granularity: String,
}

#[derive(Args)]
struct DemoArgs {
    /// Directory of the simulated database and the lake (default: a new temporary one, kept).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Workload commits before the first stream run, and again before the second.
    #[arg(long, default_value_t = 2000)]
    commits: u64,
}

#[derive(Args)]
struct RunArgs {
    /// Flight server URL.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    server: String,
    /// Source table (schema.table).
    #[arg(long, required_unless_present = "config")]
    table: Option<String>,
    /// Bronze table location (a path or an object-store URL).
    #[arg(long, required_unless_present = "config")]
    target: Option<String>,
    /// Facts table location.
    #[arg(long, required_unless_present = "config")]
    facts: Option<String>,
    /// Control table location (the completeness verdict).
    #[arg(long)]
    control: Option<String>,
    /// Writer identity; a new checkpoint needs a new app id.
    #[arg(long, required_unless_present = "config")]
    app_id: Option<String>,
    /// Checkpoint directory.
    #[arg(long, required_unless_present = "config")]
    checkpoint: Option<PathBuf>,
    /// A sidecar file listing many tables (see docs/writer.md); replaces the per-table flags.
    #[arg(long, conflicts_with_all = ["table", "target", "facts", "app_id", "checkpoint"])]
    config: Option<PathBuf>,
    /// Where a new checkpoint starts: earliest, latest, or an LSN already processed.
    #[arg(long, default_value = "earliest")]
    starting: String,
    /// Most commits per batch (default: up to max_lsn).
    #[arg(long)]
    max_commits: Option<u64>,
    /// Endpoints read in parallel.
    #[arg(long, default_value_t = 2)]
    partitions: u32,
    /// Verdict granularity: minute, hour or day.
    #[arg(long, default_value = "hour")]
    granularity: String,
    /// Read to the max_lsn recorded at start, then exit (default: run until Ctrl-C).
    #[arg(long)]
    available_now: bool,
    /// Seconds between polls when nothing is new (continuous mode).
    #[arg(long, default_value_t = 5.0)]
    poll_seconds: f64,
    /// Skip purged changes (with a data_skipped facts row) instead of stopping. Loses changes.
    #[arg(long)]
    skip_data_loss: bool,
    /// With a new checkpoint, snapshot the table first and start the stream at its S: `full`
    /// (read now, one append) or `chunked` (opened now, read by `backfill` next to the stream).
    #[arg(long)]
    bootstrap: Option<String>,
    #[command(flatten)]
    snapshot_keys: SnapshotKeys,
}

fn main() -> anyhow::Result<()> {
    // delta-rs' kernel logs every snapshot load at INFO and its MERGE a WARN about its own
    // metrics; neither is news to a user of the writer.
    mssql_cdc_flight::init_process(
        "info,buoyant_kernel=warn,deltalake_core::operations::merge=error,deltalake_core::kernel::transaction=warn",
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let args = match Cli::parse().command {
        Commands::Run(args) => *args,
        Commands::Status { config } => return runtime.block_on(print_status(config)),
        Commands::Backfill(args) => return runtime.block_on(backfill(*args)),
        Commands::Snapshot(command) => return runtime.block_on(snapshot_command(*command)),
        Commands::Apply(args) => return runtime.block_on(apply(*args)),
        Commands::Demo(args) => return runtime.block_on(demo::run(args.dir, args.commits)),
    };
    if let Some(path) = &args.config {
        return runtime.block_on(run_sidecar(path, args.available_now));
    }
    let missing = || {
        anyhow::anyhow!(
            "--table, --target, --facts, --app-id and --checkpoint are required without --config"
        )
    };
    runtime.block_on(async move {
        let mut config = StreamConfig {
            server: args.server,
            table: args.table.ok_or_else(missing)?,
            target: args.target.ok_or_else(missing)?,
            facts: args.facts.ok_or_else(missing)?,
            control: args.control,
            app_id: args.app_id.ok_or_else(missing)?,
            checkpoint: args.checkpoint.ok_or_else(missing)?,
            starting: args.starting,
            max_commits: args.max_commits,
            partitions: args.partitions,
            granularity: args.granularity.parse::<Granularity>()?,
            fail_on_data_loss: !args.skip_data_loss,
            snapshot_keys: args.snapshot_keys.columns,
        };
        if let Some(mode) = &args.bootstrap {
            let mode: SnapshotMode = mode.parse()?;
            if let Some(snapshot) = snapshot::bootstrap(&mut config, mode).await? {
                println!("snapshot {snapshot} ({mode:?}); the stream starts after it");
            }
        }
        let mut stream = Stream::connect(config).await?;
        if args.available_now {
            let outcomes = stream.run_available_now().await?;
            let rows: u64 = outcomes.iter().map(|outcome| outcome.rows).sum();
            println!("{} batches, {rows} rows", outcomes.len());
            if let Some(last) = outcomes.last() {
                println!(
                    "offset {} verdict {:?}",
                    last.end.to_json(),
                    last.verdict.map(|time| time.to_iso_millis())
                );
            }
        } else {
            let (stop, stopped) = tokio::sync::watch::channel(false);
            tokio::spawn(async move {
                if tokio::signal::ctrl_c().await.is_ok() {
                    let _ = stop.send(true);
                }
            });
            let batches = stream
                .run_continuous(Duration::from_secs_f64(args.poll_seconds), stopped)
                .await?;
            println!("stopped after {batches} batches");
        }
        anyhow::Ok(())
    })
}

async fn apply(args: ApplyArgs) -> anyhow::Result<()> {
    let config = ApplyConfig {
        table: args.table,
        bronze: args.bronze,
        target: args.target,
        capture_instance: args.capture_instance,
        keys: args.keys,
        control: args.control,
        facts: args.facts,
        granularity: args.granularity.parse()?,
    };
    let outcome = apply_changes(&config).await?;
    println!(
        "{}",
        serde_json::json!({
            "rebuilt": outcome.rebuilt,
            "applied_lsn": outcome.applied_lsn,
            "finalized_until": outcome.finalized_until.map(|time| time.to_iso_millis()),
            "bronze_found": outcome.bronze_found,
        })
    );
    Ok(())
}

async fn snapshot_command(command: SnapshotCommand) -> anyhow::Result<()> {
    let (table, request) = match command {
        SnapshotCommand::Open {
            table,
            mode,
            resnapshot,
        } => {
            let mode: SnapshotMode = mode.parse()?;
            (table, admin::Request::Open(mode, resnapshot))
        }
        SnapshotCommand::Status { table } => (table, admin::Request::Status),
        SnapshotCommand::Pause { table, reason } => (table, admin::Request::Pause(reason)),
        SnapshotCommand::Resume { table } => (table, admin::Request::Resume),
    };
    let state = match &table.admin {
        Some(url) => {
            let access = admin::AdminAccess {
                token: table
                    .admin_token_file
                    .as_deref()
                    .map(admin::AdminToken::from_file)
                    .transpose()?,
                ca_certificate: table
                    .admin_ca
                    .as_ref()
                    .map(|path| {
                        std::fs::read(path).map_err(|error| {
                            anyhow::anyhow!("reading --admin-ca {}: {error}", path.display())
                        })
                    })
                    .transpose()?,
            };
            admin::call(url, &access, &table.table, request).await?
        }
        None => admin::run_locally(&table.config()?, request).await?,
    };
    println!("{}", serde_json::to_string(&state)?);
    Ok(())
}

async fn backfill(args: BackfillArgs) -> anyhow::Result<()> {
    let config = snapshot_config(
        args.server,
        args.table,
        args.target,
        args.facts,
        args.app_id,
        args.partitions,
        args.snapshot_keys.columns,
    );
    let options = BackfillOptions {
        chunk_rows: args.chunk_rows,
        max_waves: args.max_waves,
        target_wave_seconds: args.target_wave_seconds,
        min_headroom_hours: args.min_headroom_hours,
    };
    let status = Snapshots::connect(config)
        .await?
        .backfill_with_progress(&options, |progress| {
            // One line per wave on stderr: a progress bar that survives logs and pipes.
            let width = 30usize;
            let filled = (progress.chunks_done as usize * width)
                .checked_div(progress.chunks_total as usize)
                .unwrap_or(0);
            eprintln!(
                "[{}{}] {}/{} chunks  wave {}  {:.0} rows/s  ETA {}",
                "#".repeat(filled),
                "-".repeat(width - filled),
                progress.chunks_done,
                progress.chunks_total,
                progress.wave,
                progress.rows_per_second,
                progress
                    .eta_seconds
                    .map_or("?".to_string(), |seconds| format!("{seconds:.0} s")),
            );
        })
        .await?;
    println!("{}", serde_json::to_string(&status)?);
    Ok(())
}

async fn run_sidecar(path: &std::path::Path, available_now: bool) -> anyhow::Result<()> {
    let config = sidecar::SidecarConfig::load(path)?;
    if available_now {
        let mut failed = Vec::new();
        for (table, result) in sidecar::run_available_now(&config).await {
            match result {
                Ok(outcomes) => {
                    let rows: u64 = outcomes.iter().map(|outcome| outcome.rows).sum();
                    println!("{table}: {} batches, {rows} rows", outcomes.len());
                }
                Err(error) => {
                    println!("{table}: FAILED: {error}");
                    failed.push(table);
                }
            }
        }
        if !failed.is_empty() {
            anyhow::bail!(
                "{} of {} tables failed: {}",
                failed.len(),
                config.tables.len(),
                failed.join(", ")
            );
        }
        return Ok(());
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = stop.send(true);
        }
    });
    if let Some(server) = admin::AdminServer::bind(&config).await? {
        println!("admin service on {}", server.local_addr()?);
        let stopped = stopped.clone();
        tokio::spawn(async move {
            if let Err(error) = server.serve(stopped).await {
                tracing::error!(%error, "the admin service stopped");
            }
        });
    }
    sidecar::run_continuous(&config, stopped).await;
    Ok(())
}

async fn print_status(path: PathBuf) -> anyhow::Result<()> {
    let config = sidecar::SidecarConfig::load(&path)?;
    println!(
        "{:<24} {:>10} {:<24} {:<24} {:>10}  snapshot",
        "table", "batch", "end lsn", "finalized_until", "lag s"
    );
    for status in sidecar::status(&config).await? {
        let batch = status
            .last_batch
            .map(|(id, committed)| {
                if committed {
                    id.to_string()
                } else {
                    format!("{id} (open)")
                }
            })
            .unwrap_or_else(|| "-".into());
        let snapshot = match &status.snapshot {
            None => "-".to_string(),
            Some(progress) if progress.done => format!("{} complete", progress.snapshot),
            Some(progress) => format!(
                "{} {:?} open: {}/{} chunks",
                progress.snapshot,
                progress.mode,
                progress.chunks_done,
                progress
                    .chunks_total
                    .map_or("?".to_string(), |total| total.to_string())
            ),
        };
        println!(
            "{:<24} {:>10} {:<24} {:<24} {:>10}  {snapshot}",
            status.table,
            batch,
            status
                .end
                .map(|end| end.lsn.to_string())
                .unwrap_or_else(|| "-".into()),
            status
                .verdict
                .map(|time| time.to_iso_millis())
                .unwrap_or_else(|| "-".into()),
            status
                .lag_seconds
                .map(|lag| format!("{lag:.1}"))
                .unwrap_or_else(|| "-".into()),
        );
    }
    Ok(())
}
