//! `mssql-cdc-writer demo`: the pipeline end to end on the embedded default.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_proto::CommitTime;
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::reconcile::{self, ReconcileConfig};
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

pub async fn run(dir: Option<PathBuf>, commits: u64) -> anyhow::Result<()> {
    let dir = match dir {
        Some(dir) => dir,
        None => tempfile::Builder::new()
            .prefix("mssql-cdc-demo-")
            .tempdir()?
            .keep(),
    };
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
        .map(|(table, name, _)| StreamConfig {
            server: url.clone(),
            table: (*table).to_string(),
            target: lake.join(format!("bronze_{name}")).display().to_string(),
            facts: lake.join("facts").display().to_string(),
            control: Some(lake.join("control").display().to_string()),
            app_id: format!("demo_{name}"),
            checkpoint: dir.join("checkpoints").join(name),
            starting: "earliest".into(),
            max_commits: Some(1000),
            partitions: 2,
            granularity: Granularity::Minute,
            fail_on_data_loss: true,
            schema_change_policy: mssql_cdc_writer::schema_policy::SchemaChangePolicy::default(),
            on_data_loss: mssql_cdc_writer::data_loss::OnDataLoss::default(),
            snapshot_keys: None,
        })
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
        let silver = ApplyConfig {
            table: config.table.clone(),
            bronze: config.target.clone(),
            target: lake.join(format!("silver_{name}")).display().to_string(),
            capture_instance: None,
            keys: key.iter().map(|column| column.to_string()).collect(),
            control: lake.join("control").display().to_string(),
            facts: Some(config.facts.clone()),
            granularity: Granularity::Minute,
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
    }
    println!("7. reconcile every silver table with the source (docs/reconcile.md)");
    for (config, (_, name, key)) in configs.iter().zip(TABLES) {
        // A composite text key is not compared on yet: dbo.accounts on its integer id.
        let compared = match key {
            [one] => one,
            _ => "id",
        };
        let reconcile = ReconcileConfig {
            keys: Some(vec![compared.to_string()]),
            bucket_rows: 500,
            facts: Some(config.facts.clone()),
            report: Some(lake.join("reconcile").display().to_string()),
            ..ReconcileConfig::new(
                &url,
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
            match result.verified {
                true => format!("verified at {}", result.compared_lsn),
                false => format!("NOT verified: {:?}", result.failures),
            }
        );
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
