//! Chunked snapshot versus full snapshot of the same table, and the fixed cost per wave.
//!
//! A simulated table of `BENCH_SNAPSHOT_ROWS` rows (default 2,000,000, the narrow
//! `dbo.orders`) is served in process; then, each into an empty lake:
//!
//! - **full**: `Snapshots::bootstrap_full` with 2 partitions: one bronze append;
//! - **chunked**: `open_chunked` and `backfill` to the end with `chunk_rows` =
//!   rows / `BENCH_CHUNKS` (default 16), 2 chunks per round and `target_wave_seconds` 0, so
//!   every wave is one round: the most waves, the most per-wave cost.
//!
//! Reported: rows/s of both, their ratio (target ≥ 0.9), waves, and the fixed cost per wave
//! = (chunked seconds − full seconds) / waves (target ≤ 1 s). Each mode runs once untimed
//! first.
//!
//! `cargo bench -p mssql-cdc-writer --bench snapshot`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::snapshot::{BackfillOptions, Snapshots};
use mssql_cdc_writer::stream::StreamConfig;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn config(url: &str, lake: &Path) -> StreamConfig {
    let location = |name: &str| lake.join(name).display().to_string();
    StreamConfig {
        server: url.to_string(),
        table: "dbo.orders".into(),
        target: location("bronze"),
        facts: location("facts"),
        control: None,
        app_id: "bench".into(),
        checkpoint: lake.join("_checkpoint"),
        starting: "earliest".into(),
        max_commits: None,
        partitions: 2,
        granularity: Granularity::Minute,
        fail_on_data_loss: true,
    }
}

async fn full(url: &str, lake: &Path) -> anyhow::Result<(f64, u64)> {
    let started = Instant::now();
    let snapshot = Snapshots::connect(config(url, lake))
        .await?
        .bootstrap_full()
        .await?;
    Ok((started.elapsed().as_secs_f64(), snapshot.rows))
}

async fn chunked(url: &str, lake: &Path, chunk_rows: u64) -> anyhow::Result<(f64, u64)> {
    let started = Instant::now();
    let snapshots = Snapshots::connect(config(url, lake)).await?;
    snapshots.open_chunked().await?;
    let status = snapshots
        .backfill(&BackfillOptions {
            chunk_rows,
            max_waves: None,
            target_wave_seconds: 0.0,
            min_headroom_hours: None,
        })
        .await?;
    anyhow::ensure!(status.done, "backfill stopped: {status:?}");
    let chunks = status.chunks_total.unwrap_or(0);
    Ok((started.elapsed().as_secs_f64(), chunks.div_ceil(2)))
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("warn,deltalake_core::operations::merge=error");
    let rows = env_number("BENCH_SNAPSHOT_ROWS", 2_000_000);
    let chunks = env_number("BENCH_CHUNKS", 16).max(1);
    let temporary = tempfile::tempdir()?;
    let db = SimDb::create(
        &temporary.path().join("db"),
        &[sample::orders()],
        CommitTime(1_767_225_600_000_000),
    )?;
    let table = sample::orders().table;
    let mut writer = db.writer(Clock::Virtual { step_micros: 1_000 }, 7)?;
    let mut inserted = 0u64;
    while inserted < rows {
        let count = (rows - inserted).min(10_000) as usize;
        let mut tx = writer.begin();
        tx.insert(&table, count)?;
        tx.commit()?;
        inserted += count as u64;
    }
    writer.publish()?;
    drop(writer);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(mssql_cdc_flight::flight::serve(
            listener,
            Arc::new(db.clone()),
            TicketSigner::random()?,
            None,
            async {
                let _ = stopped.await;
            },
        ));
        let chunk_rows = rows.div_ceil(chunks);
        let lake = |name: &str| temporary.path().join(name);
        full(&url, &lake("warm_full")).await?;
        chunked(&url, &lake("warm_chunked"), chunk_rows).await?;
        let (full_seconds, full_rows) = full(&url, &lake("full")).await?;
        anyhow::ensure!(full_rows == rows, "the full snapshot read {full_rows} rows");
        let (chunked_seconds, waves) = chunked(&url, &lake("chunked"), chunk_rows).await?;
        println!(
            "| rows | chunk rows | waves | full rows/s | chunked rows/s | chunked / full | fixed cost per wave |"
        );
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| {rows} | {chunk_rows} | {waves} | {:.0} | {:.0} | {:.2} | {:.3} s |",
            rows as f64 / full_seconds,
            rows as f64 / chunked_seconds,
            full_seconds / chunked_seconds,
            (chunked_seconds - full_seconds) / waves.max(1) as f64,
        );
        let _ = stop.send(());
        server.await??;
        anyhow::Ok(())
    })
}
