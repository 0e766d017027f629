//! Chunked snapshot versus full snapshot of the same table, and the fixed cost per wave.
//!
//! A simulated table of `BENCH_SNAPSHOT_ROWS` rows (default 2,000,000, the narrow
//! `dbo.orders`) is served in process; then, each into an empty lake:
//!
//! - **full**: `Snapshots::bootstrap_full` with 2 partitions: one bronze append;
//! - **chunked**: `open_chunked` and `backfill` to the end with `chunk_rows` =
//!   rows / `BENCH_CHUNKS` (default 16), 2 chunks per round and the default
//!   `target_wave_seconds` (30): the first wave one round, later ones as many rounds as fit;
//! - **chunked, one round per wave**: the same with `target_wave_seconds` 0, so every wave is
//!   one round of 2 chunks: the most waves, the most per-wave cost.
//!
//! The three run in turn `BENCH_REPEATS` times (default 5; one untimed round first), each
//! after a `sync` (no run pays for writing back an earlier run's files). Reported
//! per round and as the median of the rounds: rows/s of each, chunked / full (target ≥ 0.9),
//! the chunked open's own seconds (S recorded, the key's extent, plans and facts rows), and
//! the fixed cost per wave = (one-round-waves seconds − full seconds) / waves (target ≤ 1 s).
//! A round takes about 15 s on the 2-core machine; its noise is why the medians are quoted.
//!
//! `cargo bench -p mssql-cdc-writer --bench snapshot`.

mod common;

use std::path::Path;
use std::time::Instant;

use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::snapshot::{BackfillOptions, Snapshots};
use mssql_cdc_writer::stream::StreamConfig;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn config(url: &str, lake: &Path) -> StreamConfig {
    let location = |name: &str| lake.join(name).display().to_string();
    StreamConfig {
        server: url.to_string(),
        table: "dbo.orders".into(),
        target: location("bronze"),
        facts: location("facts"),
        control: None,
        app_id: "bench".into(),
        checkpoint: lake.join("_checkpoint").display().to_string(),
        starting: "earliest".into(),
        max_commits: None,
        partitions: 2,
        granularity: Granularity::Minute,
        fail_on_data_loss: true,
        schema_change_policy: mssql_cdc_writer::schema_policy::SchemaChangePolicy::default(),
        on_data_loss: mssql_cdc_writer::data_loss::OnDataLoss::default(),
        snapshot_on_switch: false,
        resnapshot_every_days: None,
        resnapshot_interval_days: None,
        snapshot_keys: None,
        columns: Default::default(),
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

/// A chunked snapshot opened and backfilled: `(seconds, seconds of the open, waves)`.
async fn chunked(
    url: &str,
    lake: &Path,
    chunk_rows: u64,
    target_wave_seconds: f64,
) -> anyhow::Result<(f64, f64, u64)> {
    let started = Instant::now();
    let snapshots = Snapshots::connect(config(url, lake)).await?;
    snapshots.open_chunked().await?;
    let opened = started.elapsed().as_secs_f64();
    let status = snapshots
        .backfill(&BackfillOptions {
            chunk_rows,
            max_waves: None,
            target_wave_seconds,
            min_headroom_hours: None,
        })
        .await?;
    anyhow::ensure!(status.done, "backfill stopped: {status:?}");
    let seconds = started.elapsed().as_secs_f64();
    let waves = snapshots_waves(lake).await?;
    Ok((seconds, opened, waves))
}

/// One round of the three runs.
struct Round {
    full: f64,
    chunked: f64,
    open: f64,
    waves: u64,
    rounds: f64,
    round_waves: u64,
}

impl Round {
    fn row(&self, label: &str, rows: u64) -> String {
        format!(
            "| {label} | {:.0} | {:.0} ({}) | {:.2} | {:.3} s | {:.0} ({}) | {:.3} s |",
            rows as f64 / self.full,
            rows as f64 / self.chunked,
            self.waves,
            self.full / self.chunked,
            self.open,
            rows as f64 / self.rounds,
            self.round_waves,
            (self.rounds - self.full) / self.round_waves.max(1) as f64,
        )
    }
}

/// Waves the chunked snapshot of `lake` took (its facts' highest wave).
async fn snapshots_waves(lake: &Path) -> anyhow::Result<u64> {
    let facts = mssql_cdc_writer::tables::table_url(&lake.join("facts").display().to_string())?;
    let rows = mssql_cdc_writer::tables::query_text(
        &facts,
        "SELECT MAX(batch_id) FROM t WHERE event = 'snapshot_chunk'",
    )
    .await?;
    Ok(rows
        .first()
        .and_then(|row| row[0].as_deref())
        .and_then(|wave| wave.parse().ok())
        .unwrap_or(0))
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("warn,deltalake_core::operations::merge=error");
    let rows = common::env_number("BENCH_SNAPSHOT_ROWS", 2_000_000);
    let chunks = common::env_number("BENCH_CHUNKS", 16).max(1);
    let repeats = common::env_number("BENCH_REPEATS", 5).max(1);
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
        let server = common::start_server(&db).await?;
        let url = server.url.clone();
        let chunk_rows = rows.div_ceil(chunks);
        let lake = |name: String| temporary.path().join(name);
        full(&url, &lake("warm_full".into())).await?;
        chunked(&url, &lake("warm_chunked".into()), chunk_rows, 0.0).await?;
        let mut rounds = Vec::new();
        for round in 0..repeats {
            common::settle()?;
            let (full_seconds, full_rows) = full(&url, &lake(format!("full{round}"))).await?;
            anyhow::ensure!(full_rows == rows, "the full snapshot read {full_rows} rows");
            common::settle()?;
            let (chunked_seconds, open, waves) =
                chunked(&url, &lake(format!("chunked{round}")), chunk_rows, 30.0).await?;
            common::settle()?;
            let (round_seconds, _, round_waves) =
                chunked(&url, &lake(format!("rounds{round}")), chunk_rows, 0.0).await?;
            rounds.push(Round {
                full: full_seconds,
                chunked: chunked_seconds,
                open,
                waves,
                rounds: round_seconds,
                round_waves,
            });
        }
        println!("{rows} rows, chunks of {chunk_rows}, {repeats} rounds");
        println!(
            "| round | full rows/s | chunked rows/s (waves) | chunked / full | chunked open | one-round waves rows/s (waves) | fixed cost per wave |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (index, round) in rounds.iter().enumerate() {
            println!("{}", round.row(&(index + 1).to_string(), rows));
        }
        let middle = |field: fn(&Round) -> f64| common::median(rounds.iter().map(field).collect());
        let medians = Round {
            full: middle(|r| r.full),
            chunked: middle(|r| r.chunked),
            open: middle(|r| r.open),
            waves: middle(|r| r.waves as f64).round() as u64,
            rounds: middle(|r| r.rounds),
            round_waves: middle(|r| r.round_waves as f64).round() as u64,
        };
        println!("{}", medians.row("median", rows));
        server.stop().await?;
        anyhow::Ok(())
    })
}
