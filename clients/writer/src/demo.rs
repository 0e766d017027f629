//! `mssql-cdc-writer demo`: the pipeline end to end on the embedded default.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_proto::CommitTime;
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::data_loss::OnDataLoss;
use mssql_cdc_writer::reconcile::{self, ReconcileConfig};
use mssql_cdc_writer::schema_policy::SchemaChangePolicy;
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::{Stream, StreamConfig};

/// `(table, short name, key columns)` of the demo's tables: two keyed on one integer column
/// (chunks planned from counted key slices) and `dbo.accounts`, whose unique index is
/// `(region, code)` with case-mixed text (chunks cut on keyset bounds).
const TABLES: [(&str, &str, &[&str]); 3] = [
    ("dbo.customers", "customers", &["customer_id"]),
    ("dbo.orders", "orders", &["order_id"]),
    ("dbo.accounts", "accounts", &["region", "code"]),
];

/// The demo's directory: `dir`, or a new temporary one that is kept.
fn demo_dir(dir: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    Ok(match dir {
        Some(dir) => dir,
        None => tempfile::Builder::new()
            .prefix("mssql-cdc-demo-")
            .tempdir()?
            .keep(),
    })
}

/// The stream of table `name` into the lake under `dir`.
fn stream_config(url: &str, dir: &Path, table: &str, name: &str) -> StreamConfig {
    let lake = dir.join("lake");
    StreamConfig {
        server: url.to_string(),
        table: table.to_string(),
        target: lake.join(format!("bronze_{name}")).display().to_string(),
        facts: lake.join("facts").display().to_string(),
        control: Some(lake.join("control").display().to_string()),
        app_id: format!("demo_{name}"),
        checkpoint: dir.join("checkpoints").join(name).display().to_string(),
        starting: "earliest".into(),
        max_commits: Some(1000),
        partitions: 2,
        granularity: Granularity::Minute,
        fail_on_data_loss: true,
        schema_change_policy: SchemaChangePolicy::default(),
        on_data_loss: OnDataLoss::default(),
        snapshot_on_switch: false,
        resnapshot_every_days: None,
        resnapshot_interval_days: None,
        snapshot_keys: None,
        columns: Default::default(),
    }
}

/// Applies the bronze of `config` to its silver table `silver_<name>` and prints the outcome.
async fn apply_silver(config: &StreamConfig, name: &str, key: &[&str]) -> anyhow::Result<()> {
    let lake = lake_of(config);
    let silver = ApplyConfig {
        table: config.table.clone(),
        bronze: config.target.clone(),
        target: lake.join(format!("silver_{name}")).display().to_string(),
        capture_instance: None,
        keys: key.iter().map(|column| column.to_string()).collect(),
        control: lake.join("control").display().to_string(),
        facts: Some(config.facts.clone()),
        granularity: Granularity::Minute,
        deletion_vectors: false,
    };
    let outcome = apply_changes(&silver).await?;
    println!(
        "   {}: {} (rebuilt from the snapshot: {}), applied to {}, finalized_until {}",
        config.table,
        silver.target,
        outcome.rebuilt,
        outcome
            .applied_lsn
            .map_or("-".to_string(), |lsn| lsn.to_string()),
        outcome
            .finalized_until
            .map_or("(held)".to_string(), |time| time.to_iso_millis())
    );
    Ok(())
}

/// The lake directory a demo stream writes into (its facts table's parent).
fn lake_of(config: &StreamConfig) -> PathBuf {
    Path::new(&config.facts)
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Reconciles silver `silver_<name>` with the source on `key` and prints the result.
async fn reconcile_silver(
    url: &str,
    config: &StreamConfig,
    name: &str,
) -> anyhow::Result<reconcile::ReconcileResult> {
    let lake = lake_of(config);
    // Each table on its unique index: dbo.accounts on its composite text key (region, code).
    // The demo's tables are small: every bucket is compared row by row, so every value is.
    let reconcile = ReconcileConfig {
        bucket_rows: 500,
        sample: 1.0,
        facts: Some(config.facts.clone()),
        report: Some(lake.join("reconcile").display().to_string()),
        ..ReconcileConfig::new(
            url,
            &config.table,
            &lake.join(format!("silver_{name}")).display().to_string(),
            &config.target,
            &lake.join("control").display().to_string(),
        )
    };
    let result = reconcile::reconcile(&reconcile).await?;
    println!(
        "   {} on {}: {} buckets, {} match, {} in flight, {} mismatch, {} hashed, chunks of {} checked; {}",
        config.table,
        result.key,
        result.buckets,
        result.matched,
        result.in_flight,
        result.mismatch,
        result.hashed,
        result
            .checked_snapshot
            .map_or("no chunked snapshot".to_string(), |lsn| lsn.to_string()),
        match (result.verified, result.values_verified) {
            (true, true) => format!(
                "verified at {}, every value of every row compared",
                result.compared_lsn
            ),
            (true, false) => format!(
                "rows verified at {}, values in {} of {} buckets",
                result.compared_lsn, result.hashed, result.buckets
            ),
            (false, _) => format!("NOT verified: {:?}", result.failures),
        }
    );
    Ok(result)
}

pub async fn run(dir: Option<PathBuf>, commits: u64) -> anyhow::Result<()> {
    let dir = demo_dir(dir)?;
    let lake = dir.join("lake");
    println!(
        "1. a simulated SQL Server CDC database in {}",
        dir.join("db").display()
    );
    let mut tables = sample::sample_tables();
    tables.push(sample::accounts());
    let db = SimDb::create(
        &dir.join("db"),
        &tables,
        CommitTime(chrono::Utc::now().timestamp_micros()),
    )?;
    let mut writer = db.writer(Clock::Wall, 7)?;
    let spec = WorkloadSpec {
        commits: Some(commits),
        max_rows_per_statement: 4,
        ..WorkloadSpec::default()
    };
    let report = workload::run(&mut writer, &spec, &AtomicBool::new(false))?;
    println!(
        "   workload: {} transactions, {} change rows",
        report.transactions, report.rows
    );

    let server = LocalServer::start(Arc::new(db.clone()), TicketSigner::random()?).await?;
    let url = server.url.clone();
    println!("2. the Flight server on {url}");

    let configs: Vec<StreamConfig> = TABLES
        .iter()
        .map(|(table, name, _)| stream_config(&url, &dir, table, name))
        .collect();
    let mut configs = configs;
    println!("3. open a chunked snapshot of every table; each stream starts at its S");
    for config in &mut configs {
        if let Some(snapshot) = snapshot::bootstrap(config, SnapshotMode::Chunked).await? {
            println!("   {}: snapshot S = {snapshot}", config.table);
        }
    }
    println!(
        "4. stream and backfill every table into {} while the workload runs",
        lake.display()
    );
    let workload = tokio::task::spawn_blocking(move || {
        workload::run(&mut writer, &spec, &AtomicBool::new(false))
    });
    stream_all(&configs).await?;
    backfill_all(&configs).await?;
    let report = workload.await??;
    println!(
        "5. {} more transactions committed meanwhile; stream again from the checkpoints",
        report.transactions
    );
    stream_all(&configs).await?;
    println!("6. apply bronze to the current-state silver tables");
    for (config, (_, name, key)) in configs.iter().zip(TABLES) {
        apply_silver(config, name, key).await?;
    }
    println!("7. reconcile every silver table with the source (docs/reconcile.md)");
    for (config, (_, name, _)) in configs.iter().zip(TABLES) {
        reconcile_silver(&url, config, name).await?;
    }
    server.stop().await?;
    println!("8. done. The tables are Delta tables; read them with any Delta reader, e.g.");
    println!(
        "   python -c \"import deltalake; print(deltalake.DeltaTable('{}').to_pandas().tail())\"",
        lake.join("silver_orders").display()
    );
    println!(
        "   facts: {}  control (the verdict): {}",
        lake.join("facts").display(),
        lake.join("control").display()
    );
    Ok(())
}

/// `demo --scenario data-loss`: dbo.orders streamed and verified, then the writer stopped
/// while the workload goes on and retention cleanup purges past its offset; restarted with
/// `on_data_loss = resnapshot`, it heals by a chunked re-snapshot and silver is verified
/// against the source again.
pub async fn run_data_loss(dir: Option<PathBuf>, commits: u64) -> anyhow::Result<()> {
    use mssql_cdc_flight::source::CdcSource;
    let dir = demo_dir(dir)?;
    println!(
        "1. a simulated SQL Server CDC database in {}",
        dir.join("db").display()
    );
    let db = SimDb::create(
        &dir.join("db"),
        &sample::sample_tables(),
        CommitTime(chrono::Utc::now().timestamp_micros()),
    )?;
    let mut writer = db.writer(Clock::Wall, 11)?;
    let spec = WorkloadSpec {
        commits: Some(commits),
        max_rows_per_statement: 4,
        tables: vec!["dbo.orders".parse()?],
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false))?;
    let server = LocalServer::start(Arc::new(db.clone()), TicketSigner::random()?).await?;
    let url = server.url.clone();
    println!("2. the Flight server on {url}");
    let (table, name, key) = ("dbo.orders", "orders", "order_id");
    let mut config = stream_config(&url, &dir, table, name);
    config.on_data_loss = OnDataLoss::Resnapshot;
    println!("3. a chunked bootstrap, the stream, silver and a reconcile of {table}");
    snapshot::bootstrap(&mut config, SnapshotMode::Chunked).await?;
    let configs = [config];
    stream_all(&configs).await?;
    backfill_all(&configs).await?;
    apply_silver(&configs[0], name, &[key]).await?;
    reconcile_silver(&url, &configs[0], name).await?;
    println!("4. the writer stops; {commits} more commits land, then retention cleanup runs");
    workload::run(&mut writer, &spec, &AtomicBool::new(false))?;
    let purged_to = db.max_lsn().await?.unwrap_or_default();
    db.cleanup(None, purged_to)?;
    println!("   cleanup purged every change below {purged_to}: past the writer's offset");
    workload::run(&mut writer, &spec, &AtomicBool::new(false))?;
    println!("5. the writer restarts with on_data_loss = resnapshot");
    stream_all(&configs).await?;
    let state = snapshot::state(&configs[0]).await?;
    println!(
        "   a data_loss facts row names the gap; re-snapshot {} is {}; the stream resumed at it",
        state
            .status
            .snapshot
            .map_or("-".to_string(), |lsn| lsn.to_string()),
        state.status.state
    );
    println!("6. the backfill reads the re-snapshot's waves; silver is rebuilt from it");
    backfill_all(&configs).await?;
    stream_all(&configs).await?;
    apply_silver(&configs[0], name, &[key]).await?;
    println!("7. reconcile silver with the source after the healing");
    let result = reconcile_silver(&url, &configs[0], name).await?;
    server.stop().await?;
    anyhow::ensure!(
        result.values_verified,
        "silver does not match the source after the re-snapshot: {:?}",
        result.failures
    );
    println!(
        "8. done: healed without an operator. Facts: {}",
        lake_of(&configs[0]).join("facts").display()
    );
    Ok(())
}

async fn backfill_all(configs: &[StreamConfig]) -> anyhow::Result<()> {
    let options = BackfillOptions {
        chunk_rows: 500,
        target_wave_seconds: 1.0,
        max_waves: Some(1),
        ..BackfillOptions::default()
    };
    for config in configs {
        let snapshots = Snapshots::connect(config.clone()).await?;
        let started = Instant::now();
        loop {
            let status = snapshots.backfill(&options).await?;
            println!(
                "   {}: snapshot chunks {}/{} ({})",
                config.table,
                status.chunks_done,
                status
                    .chunks_total
                    .map_or("?".to_string(), |total| total.to_string()),
                status.state
            );
            if status.done || status.paused {
                break;
            }
        }
        println!(
            "   {}: snapshot read in {:.1} s next to the stream",
            config.table,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

async fn stream_all(configs: &[StreamConfig]) -> anyhow::Result<()> {
    for config in configs {
        let started = Instant::now();
        let mut stream = Stream::connect(config.clone()).await?;
        let outcomes = stream.run_available_now().await?;
        let rows: u64 = outcomes.iter().map(|outcome| outcome.rows).sum();
        let verdict = outcomes
            .last()
            .and_then(|outcome| outcome.verdict)
            .map(|time| time.to_iso_millis());
        println!(
            "   {}: {} batches, {rows} rows in {:.1} s; finalized_until {}",
            config.table,
            outcomes.len(),
            started.elapsed().as_secs_f64(),
            verdict.unwrap_or_else(|| "(unchanged)".into())
        );
    }
    Ok(())
}
