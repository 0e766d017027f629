//! What each `mssql-cdc-writer` subcommand does with its parsed flags (`cli`).

use std::path::PathBuf;
use std::time::Duration;

use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::maintenance::{self, MaintenanceOptions};
use mssql_cdc_writer::reconcile::ReconcileConfig;
use mssql_cdc_writer::schema_policy::SchemaChangePolicy;
use mssql_cdc_writer::silver::history::{HistoryConfig, Tracked, apply_history};
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SeedOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::status_page::StatusPage;
use mssql_cdc_writer::stream::{Stream, StreamConfig};
use mssql_cdc_writer::tail::Waiting;
use mssql_cdc_writer::{admin, sidecar};

use crate::cli::{
    AdminArgs, ApplyArgs, BackfillArgs, HistoryArgs, MaintainArgs, ReconcileArgs, RunArgs,
    SeedArgs, SnapshotCommand, TableArgs,
};

/// `run`: one table from flags, or every table of a sidecar file.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    if let Some(address) = args.metrics_listen {
        mssql_cdc_writer::metrics::serve(address).await?;
        tracing::info!(%address, "serving Prometheus metrics at /metrics");
    }
    if let Some(path) = &args.config {
        return run_sidecar(path, args.available_now, args.status_listen).await;
    }
    let missing =
        || anyhow::anyhow!("--table, --target, --facts and --app-id are required without --config");
    let facts = args.lake.facts.ok_or_else(missing)?;
    let app_id = args.lake.app_id.ok_or_else(missing)?;
    let checkpoint = args
        .checkpoint
        .unwrap_or_else(|| mssql_cdc_writer::checkpoint::location(None, &facts, &app_id));
    let mut config = StreamConfig {
        server: args.server.url,
        table: args.table.ok_or_else(missing)?,
        target: args.lake.target.ok_or_else(missing)?,
        facts,
        control: args.control,
        app_id,
        checkpoint,
        starting: args.starting,
        max_commits: args.max_commits,
        partitions: args.partitions,
        granularity: args.granularity.parse::<Granularity>()?,
        fail_on_data_loss: !args.skip_data_loss,
        schema_change_policy: args.schema_change_policy.parse()?,
        on_data_loss: args.on_data_loss.parse()?,
        snapshot_on_switch: args.snapshot_on_switch,
        resnapshot_every_days: args.resnapshot_every_days,
        resnapshot_interval_days: args.resnapshot_interval_days,
        snapshot_keys: args.snapshot_keys.columns,
        columns: args.columns.selection()?,
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
        let stopped = stopped_by_signal();
        let batches = stream
            .run_continuous(
                Waiting {
                    poll: Duration::from_secs_f64(args.poll_seconds),
                    live_tail: !args.no_live_tail,
                },
                stopped,
            )
            .await?;
        println!("stopped after {batches} batches");
    }
    Ok(())
}

/// A flag that turns true at Ctrl-C or SIGTERM: continuous runs stop after the batch in
/// flight, and the process exits 0.
fn stopped_by_signal() -> tokio::sync::watch::Receiver<bool> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signal = mssql_cdc_proto::signals::shutdown();
    tokio::spawn(async move {
        signal.await;
        tracing::info!("stopping after the batch in flight");
        let _ = stop.send(true);
    });
    stopped
}

/// `apply`: bronze's changes into silver.
pub async fn apply(args: ApplyArgs) -> anyhow::Result<()> {
    let config = ApplyConfig {
        table: args.table,
        bronze: args.bronze,
        target: args.target,
        capture_instance: args.capture_instance,
        keys: args.keys,
        control: args.control,
        facts: args.facts,
        granularity: args.granularity.parse()?,
        deletion_vectors: args.deletion_vectors,
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

pub async fn history(args: HistoryArgs) -> anyhow::Result<()> {
    let config = HistoryConfig {
        table: args.table,
        bronze: args.bronze,
        target: args.target,
        capture_instance: args.capture_instance,
        keys: args.keys,
        control: args.control,
        facts: args.facts,
        granularity: args.granularity.parse()?,
        tracked: Tracked::of(
            args.track_history_columns,
            args.track_history_except_columns,
        )?,
    };
    let outcome = apply_history(&config).await?;
    println!(
        "{}",
        serde_json::json!({
            "applied_lsn": outcome.applied_lsn,
            "snapshot_lsn": outcome.snapshot_lsn,
            "waiting_snapshot": outcome.waiting_snapshot,
            "keys_changed": outcome.keys_changed,
            "versions_written": outcome.versions_written,
            "finalized_until": outcome.finalized_until.map(|time| time.to_iso_millis()),
            "bronze_found": outcome.bronze_found,
        })
    );
    Ok(())
}

/// The admin call of `reconcile --admin`: the settings given on the command line, the
/// sidecar file's for the rest.
fn admin_request(args: &ReconcileArgs) -> admin::ReconcileRequest {
    admin::ReconcileRequest {
        table: args.table.clone(),
        sample: args.sample,
        bucket_rows: args.bucket_rows,
        seed: args.seed,
        value_sums: args.value_sums,
    }
}

/// `reconcile`: the result as JSON or as a table; exits 1 when a bucket or a key differs
/// with no change in flight to explain it.
pub async fn reconcile(args: ReconcileArgs) -> anyhow::Result<()> {
    args.columns.refuse_with_admin(&args.admin)?;
    let result = match &args.admin.admin {
        Some(url) => {
            admin::call_reconcile(url, &admin_access(&args.admin)?, admin_request(&args)).await?
        }
        None => {
            let required = |value: &Option<String>| value.clone().unwrap_or_default();
            let defaults = ReconcileConfig::new(
                &args.server.url,
                &args.table,
                &required(&args.silver),
                &required(&args.bronze),
                &required(&args.control),
            );
            let config = ReconcileConfig {
                facts: args.facts.clone(),
                keys: args.keys.clone(),
                bucket_rows: args.bucket_rows.unwrap_or(defaults.bucket_rows),
                sample: args.sample.unwrap_or(defaults.sample),
                seed: args.seed,
                report: args.report.clone(),
                value_sums: args.value_sums.unwrap_or(defaults.value_sums),
                columns: args.columns.selection()?,
                ..defaults
            };
            mssql_cdc_writer::reconcile::reconcile(&config).await?
        }
    };
    match args.output.as_str() {
        "json" => println!("{}", serde_json::to_string_pretty(&result)?),
        _ => print!("{}", mssql_cdc_writer::reconcile::render(&result)),
    }
    if !result.clean() {
        std::process::exit(1);
    }
    Ok(())
}

/// The credentials `--admin-token-file` and `--admin-ca` name.
fn admin_access(args: &AdminArgs) -> anyhow::Result<admin::AdminAccess> {
    Ok(admin::AdminAccess {
        token: args
            .admin_token_file
            .as_deref()
            .map(admin::AdminToken::from_file)
            .transpose()?,
        ca_certificate: args
            .admin_ca
            .as_ref()
            .map(|path| {
                std::fs::read(path).map_err(|error| {
                    anyhow::anyhow!("reading --admin-ca {}: {error}", path.display())
                })
            })
            .transpose()?,
    })
}

/// `snapshot open|status|pause|resume`, through a sidecar's admin service or on the lake.
pub async fn snapshot_command(command: SnapshotCommand) -> anyhow::Result<()> {
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
    table.stream.columns.refuse_with_admin(&table.admin)?;
    let state = match &table.admin.admin {
        Some(url) => {
            admin::call(
                url,
                &admin_access(&table.admin)?,
                &table.stream.table,
                request,
            )
            .await?
        }
        None => {
            let config = snapshot_config(&table.stream, 2, table.snapshot_keys.columns.clone())?;
            admin::run_locally(&config, request).await?
        }
    };
    println!("{}", serde_json::to_string(&state)?);
    Ok(())
}

/// `backfill`: waves of the open chunked snapshot, with a progress line per wave.
pub async fn backfill(args: BackfillArgs) -> anyhow::Result<()> {
    let config = snapshot_config(&args.stream, args.partitions, args.snapshot_keys.columns)?;
    let options = BackfillOptions {
        chunk_rows: args.chunk_rows,
        max_waves: args.max_waves,
        target_wave_seconds: args.target_wave_seconds,
        min_headroom_hours: args.min_headroom_hours,
    };
    let mut shown = WaveDisplay::new();
    let status = Snapshots::connect(config)
        .await?
        .backfill_with_progress(&options, |progress| shown.wave(progress))
        .await?;
    shown.finish();
    println!("{}", serde_json::to_string(&status)?);
    Ok(())
}

/// How a backfill shows its waves on standard error: a progress bar (indicatif) on a
/// terminal, one plain line per wave otherwise (logs and pipes keep every line).
struct WaveDisplay {
    bar: Option<indicatif::ProgressBar>,
}

impl WaveDisplay {
    fn new() -> Self {
        use std::io::IsTerminal as _;
        let bar = std::io::stderr().is_terminal().then(|| {
            let style = indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} chunks  {msg}  {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            indicatif::ProgressBar::new(0).with_style(style)
        });
        WaveDisplay { bar }
    }

    fn wave(&mut self, progress: &snapshot::WaveProgress) {
        let eta = progress
            .eta_seconds
            .map_or("?".to_string(), |seconds| format!("{seconds:.0} s"));
        let pace = format!(
            "wave {}  {:.0} rows/s  ETA {eta}",
            progress.wave, progress.rows_per_second
        );
        match &self.bar {
            Some(bar) => {
                bar.set_length(progress.chunks_total);
                bar.set_position(progress.chunks_done);
                bar.set_message(pace);
            }
            None => eprintln!(
                "backfill: {}/{} chunks  {pace}",
                progress.chunks_done, progress.chunks_total
            ),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// Every table of a sidecar file, until done (`--available-now`) or Ctrl-C.
async fn run_sidecar(
    path: &std::path::Path,
    available_now: bool,
    status_listen: Option<String>,
) -> anyhow::Result<()> {
    let mut config = sidecar::SidecarConfig::load(path)?;
    config.status_listen = status_listen.or(config.status_listen);
    if available_now && config.fleet.is_some() {
        anyhow::bail!(
            "{}: an available-now run runs every table of the file in this process, and a \
             [fleet] shares the tables of continuous runs among replicas: run it without \
             --available-now, or from a file without [fleet]",
            path.display()
        );
    }
    if let Some(fleet) = &config.fleet {
        fleet.name()?;
    }
    // An available-now run keeps the default signal handling (Ctrl-C ends it at once); its
    // status page serves until the run ends.
    let (_run_lasts, run_ends) = tokio::sync::watch::channel(false);
    let stopped = if available_now {
        run_ends
    } else {
        stopped_by_signal()
    };
    let board = mssql_cdc_writer::board::board();
    board.enable(config.tables.iter().map(|entry| entry.table.as_str()));
    let lake = config.clone();
    tokio::spawn(async move {
        match sidecar::status(&lake).await {
            Ok(statuses) => board.seed(&statuses),
            Err(error) => {
                tracing::warn!(%error, "the status board starts without the lake's positions")
            }
        }
    });
    serve_status_page(&config, stopped.clone()).await?;
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
    if let Some(server) = admin::AdminServer::bind(&config).await? {
        println!("admin service on {}", server.local_addr()?);
        let stopped = stopped.clone();
        tokio::spawn(async move {
            if let Err(error) = server.serve(stopped).await {
                tracing::warn!(%error, "the admin service stopped");
            }
        });
    }
    sidecar::run_continuous(&config, stopped).await;
    Ok(())
}

/// Serves the sidecar's status page and probes when `status_listen` is set.
async fn serve_status_page(
    config: &sidecar::SidecarConfig,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let Some(address) = &config.status_listen else {
        return Ok(());
    };
    let read = |file: &Option<std::path::PathBuf>| {
        file.as_deref()
            .map(admin::AdminToken::from_file)
            .transpose()
    };
    let token = StatusPage::token_of(
        read(&config.status_token_file)?,
        read(&config.admin_token_file)?,
    )?;
    let page = StatusPage::bind(address, token).await?;
    println!("status page on http://{}/", page.local_addr()?);
    tokio::spawn(async move {
        if let Err(error) = page.serve(stopped).await {
            tracing::warn!(%error, "the status page stopped");
        }
    });
    Ok(())
}

/// `maintain`: one pass over every table of a sidecar file (or one table), a line each;
/// exits 1 when a table failed, after trying every other.
pub async fn maintain(args: MaintainArgs) -> anyhow::Result<()> {
    let (lake, mut options) = match (&args.config, &args.location, &args.kind) {
        (Some(path), _, _) => {
            let config = sidecar::SidecarConfig::load(path)?;
            (config.lake_tables(), config.maintenance())
        }
        (None, Some(location), Some(kind)) => (
            vec![(location.clone(), *kind)],
            MaintenanceOptions::default(),
        ),
        _ => anyhow::bail!("maintain needs --config, or --location with --kind"),
    };
    if let Some(hours) = args.vacuum_retention_hours {
        anyhow::ensure!(
            hours.is_finite() && hours > 0.0,
            "--vacuum-retention-hours must be a positive number of hours"
        );
        options.vacuum_retention = Duration::from_secs_f64(hours * 3600.0);
    }
    options.min_files = args.min_files;
    println!(
        "{:<40} {:<9} {:>8} {:>8} {:>9} {:>10} {:>11} {:>9}",
        "table", "kind", "files", "after", "compacted", "checkpoint", "logs gone", "vacuumed"
    );
    let mut failed = 0;
    for (location, kind) in &lake {
        match maintenance::maintain(location, *kind, &options).await {
            Ok(Some(done)) => println!(
                "{:<40} {:<9} {:>8} {:>8} {:>9} {:>10} {:>11} {:>9}",
                done.location,
                done.kind,
                done.files_before,
                done.files_after,
                done.compacted,
                done.checkpoint_version
                    .map_or("-".to_string(), |v| v.to_string()),
                done.log_files_removed,
                done.vacuumed
            ),
            Ok(None) => println!("{location:<40} {:<9} (no table yet)", kind.name()),
            Err(error) => {
                failed += 1;
                eprintln!("{location} ({}): {error}", kind.name());
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} tables failed maintenance", lake.len());
    }
    Ok(())
}

/// `freshness`: the control row's verdict and ages, as JSON on standard output; an error
/// (exit 1) when the control table has no row of that name.
pub async fn print_freshness(control: &str, table: &str) -> anyhow::Result<()> {
    let url = mssql_cdc_writer::tables::table_url(control)?;
    let now = mssql_cdc_proto::CommitTime(chrono::Utc::now().timestamp_micros());
    let Some(freshness) = mssql_cdc_writer::control::freshness(&url, table, now).await? else {
        anyhow::bail!(
            "the control table {control} has no row for {table}: not streamed yet, or another \
             name (the source table schema.table for bronze's verdict, silver's name for its own)"
        );
    };
    println!("{}", serde_json::to_string_pretty(&freshness)?);
    Ok(())
}

/// `status`: one line per table of a sidecar file.
pub async fn print_status(path: PathBuf) -> anyhow::Result<()> {
    let config = sidecar::SidecarConfig::load(&path)?;
    // A fleet's file names the replica holding each table's lease.
    let fleet = config.fleet.is_some();
    println!(
        "{:<24} {:>10} {:<24} {:<24} {:>10}  {:<24} {:<24} {:<24} {}snapshot",
        "table",
        "batch",
        "end lsn",
        "finalized_until",
        "lag s",
        "rows verified lsn",
        "verified at",
        "values verified lsn",
        if fleet {
            format!("{:<32} ", "replica")
        } else {
            String::new()
        }
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
        let (verified_lsn, verified_at) = status
            .verified
            .as_ref()
            .map_or(("-".to_string(), "-".to_string()), |(lsn, at)| {
                (lsn.clone(), at.to_iso_millis())
            });
        let values_lsn = status
            .values_verified
            .as_ref()
            .map_or("-", |(lsn, _)| lsn.as_str());
        let replica = if fleet {
            format!("{:<32} ", status.holder.as_deref().unwrap_or("-"))
        } else {
            String::new()
        };
        println!(
            "{:<24} {:>10} {:<24} {:<24} {:>10}  {verified_lsn:<24} {verified_at:<24} {values_lsn:<24} {replica}{snapshot}",
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

/// `seed`: adopts the copy as the table's snapshot and prints where the stream starts.
pub async fn seed(args: SeedArgs) -> anyhow::Result<()> {
    let config = snapshot_config(&args.table, 2, None)?;
    let snapshots = Snapshots::connect(config).await?;
    let outcome = snapshots
        .seed(&SeedOptions {
            copy: args.copy,
            as_of: args.as_of.parse()?,
            reseed: args.reseed,
            allow_missing_columns: args.allow_missing_columns,
        })
        .await?;
    println!(
        "{}",
        serde_json::json!({"snapshot": outcome.offset.lsn, "offset": outcome.offset, "rows": outcome.rows, "reused": outcome.reused})
    );
    eprintln!(
        "seeded: start a new stream of {} with --starting {}",
        args.table.table, outcome.offset.lsn
    );
    Ok(())
}

/// The stream configuration a snapshot command run on the lake needs: its table, lake and
/// app id (no checkpoint or control table: snapshots live in bronze, facts and the plans
/// table).
fn snapshot_config(
    table: &TableArgs,
    partitions: u32,
    snapshot_keys: Option<Vec<String>>,
) -> anyhow::Result<StreamConfig> {
    let missing = || anyhow::anyhow!("--target, --facts and --app-id are needed without --admin");
    Ok(StreamConfig {
        server: table.server.url.clone(),
        table: table.table.clone(),
        target: table.lake.target.clone().ok_or_else(missing)?,
        facts: table.lake.facts.clone().ok_or_else(missing)?,
        control: None,
        app_id: table.lake.app_id.clone().ok_or_else(missing)?,
        checkpoint: String::new(),
        starting: "earliest".into(),
        max_commits: None,
        partitions,
        granularity: Granularity::Hour,
        fail_on_data_loss: true,
        schema_change_policy: SchemaChangePolicy::default(),
        on_data_loss: mssql_cdc_writer::data_loss::OnDataLoss::default(),
        snapshot_on_switch: false,
        resnapshot_every_days: None,
        resnapshot_interval_days: None,
        snapshot_keys,
        columns: table.columns.selection()?,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Commands};
    use mssql_cdc_proto::selection::ColumnSelection;

    fn reconcile_args(flags: &[&str]) -> ReconcileArgs {
        let mut line = vec![
            "mssql-cdc-writer",
            "reconcile",
            "--admin",
            "http://127.0.0.1:1",
        ];
        line.extend(["--server", "http://127.0.0.1:2", "--table", "dbo.orders"]);
        line.extend(flags);
        match Cli::try_parse_from(line)
            .expect("a valid command line")
            .command
        {
            Commands::Reconcile(args) => *args,
            _ => unreachable!("a reconcile command line"),
        }
    }

    #[test]
    fn an_admin_reconcile_sends_only_the_settings_given() {
        let defaults = admin_request(&reconcile_args(&[]));
        assert_eq!(
            (
                defaults.sample,
                defaults.bucket_rows,
                defaults.seed,
                defaults.value_sums
            ),
            (None, None, None, None),
            "the sidecar file's settings apply"
        );
        let given = admin_request(&reconcile_args(&[
            "--sample",
            "1",
            "--bucket-rows",
            "50",
            "--seed",
            "3",
            "--value-sums",
            "false",
        ]));
        assert_eq!(
            (
                given.sample,
                given.bucket_rows,
                given.seed,
                given.value_sums
            ),
            (Some(1.0), Some(50), Some(3), Some(false))
        );
    }

    #[test]
    fn every_command_line_is_well_formed() {
        // clap checks a command's arguments (unique ids, known conflicts) only when it is
        // built: this builds every subcommand, not only those a test parses.
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn a_column_selection_is_one_list_or_the_other() {
        let args = reconcile_args(&["--except-columns", "email,Phone"]);
        assert_eq!(
            args.columns.selection().expect("valid"),
            Some(ColumnSelection::Except(vec![
                "email".into(),
                "Phone".into()
            ]))
        );
        let refused = args.columns.refuse_with_admin(&args.admin);
        assert!(refused.is_err(), "the sidecar's file says the selection");
        assert_eq!(reconcile_args(&[]).columns.selection().expect("none"), None);
        let every = reconcile_args(&["--except-columns="]).columns.selection();
        assert_eq!(every.expect("valid"), Some(ColumnSelection::All));
        let line = [
            "mssql-cdc-writer",
            "reconcile",
            "--table",
            "dbo.orders",
            "--columns",
            "id",
            "--except-columns",
            "email",
        ];
        let refused = Cli::try_parse_from(line).err().expect("refused");
        assert!(
            refused.to_string().contains("cannot be used with"),
            "{refused}"
        );
    }
}
