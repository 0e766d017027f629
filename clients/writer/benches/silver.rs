//! `apply_changes` against a plain delta-rs `MergeBuilder` of the same changes.
//!
//! A simulated `dbo.orders` of `BENCH_SILVER_ROWS` rows (default 10,000,000) is streamed into
//! bronze and applied to silver (a rebuild, untimed). Then `BENCH_SILVER_CHANGES` changes
//! (default rows / 10: 70% updates, 20% inserts, 10% deletes, keys uniform) are committed
//! and streamed, silver is copied, and both apply them from the same starting table:
//!
//! - **apply_changes**: one call (ranking, `=` merge for non-NULL keys);
//! - **plain merge**: the obvious implementation, the same latest image per key merged with
//!   a null-safe key predicate (`target.k IS NOT DISTINCT FROM source.k`).
//!
//! Reported: seconds of each, their ratio (target ≤ 0.5), the peak RSS of each: the timed
//! `apply_changes` runs as `mssql-cdc-writer apply` in its own process (its `VmHWM`), the
//! plain merge in the bench's process (the peak over the RSS before it, reset with
//! `clear_refs`: the process holds the server and the simulator too), and the latency of `BENCH_SILVER_ROUNDS` (default 5)
//! steady-state calls of 10,000 changes each.
//!
//! `cargo bench -p mssql-cdc-writer --bench silver`.

mod common;

use std::path::Path;
use std::time::Instant;

use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_flight::sim::{SimWriter, sample};
use mssql_cdc_flight::source::TableName;
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tables;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Resets the process's peak RSS to its current RSS (Linux `clear_refs` 5), so the next
/// [`peak_rss_mib`] is the peak of what ran in between.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with(field))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

/// The RSS now: what the process holds before a phase (server, simulator, allocator caches).
fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

/// Runs `mssql-cdc-writer apply` for `config` in a child process: its seconds and peak RSS
/// (MiB, the last `VmHWM` read every 10 ms before it exits; the high-water mark only grows).
async fn apply_in_a_process(config: &ApplyConfig) -> anyhow::Result<(f64, f64)> {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
    command.args([
        "apply",
        "--table",
        &config.table,
        "--bronze",
        &config.bronze,
        "--target",
        &config.target,
        "--keys",
        &config.keys.join(","),
        "--control",
        &config.control,
        "--granularity",
        "minute",
    ]);
    if let Some(facts) = &config.facts {
        command.args(["--facts", facts]);
    }
    let started = Instant::now();
    let mut child = command.stdout(std::process::Stdio::null()).spawn()?;
    let status_file = format!("/proc/{}/status", child.id().unwrap_or_default());
    let mut peak = 0.0f64;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Ok(text) = std::fs::read_to_string(&status_file)
            && let Some(kib) = text
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        {
            peak = peak.max(kib / 1024.0);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(status.success(), "mssql-cdc-writer apply failed: {status}");
    Ok((seconds, peak))
}

/// Commits `changes` changes: 70% updates, 20% inserts, 10% deletes of uniform random keys.
fn change(writer: &mut SimWriter, table: &TableName, changes: u64) -> anyhow::Result<()> {
    let mut done = 0u64;
    while done < changes {
        let batch = (changes - done).min(10_000);
        let mut tx = writer.begin();
        let updates = tx.random_keys(table, (batch * 7 / 10) as usize)?;
        tx.update(table, &updates)?;
        tx.insert(table, (batch * 2 / 10) as usize)?;
        let deletes = tx.random_keys(table, (batch / 10) as usize)?;
        tx.delete(table, &deletes)?;
        tx.commit()?;
        done += batch;
    }
    writer.publish()?;
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// The plain merge: the latest image per key of the rows past `applied`, merged null-safely.
async fn plain_merge(bronze: &str, silver: &str, applied: &str) -> anyhow::Result<()> {
    let bronze = tables::open(&tables::table_url(bronze)?)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no bronze"))?;
    let context = SessionContext::new();
    context.register_table("bronze", bronze.table_provider().await?)?;
    let latest = context
        .sql(&format!(
            "SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY order_id ORDER BY \
             _start_lsn DESC, _command_id DESC, _seqval DESC, _operation DESC) AS _rank FROM \
             bronze WHERE _operation <> 0 AND _start_lsn > '{applied}') WHERE _rank = 1"
        ))
        .await?;
    let silver_table = tables::open(&tables::table_url(silver)?)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no silver"))?;
    let columns: Vec<String> = silver_table
        .snapshot()?
        .schema()
        .fields()
        .map(|field| field.name().to_string())
        .collect();
    silver_table
        .merge(
            latest,
            "target.order_id IS NOT DISTINCT FROM source.order_id",
        )
        .with_source_alias("source")
        .with_target_alias("target")
        .when_matched_delete(|delete| delete.predicate("source._operation IN (1, 3)"))?
        .when_matched_update(|update| {
            columns.iter().fold(
                update.predicate("source._operation IN (2, 4)"),
                |update, column| update.update(column.as_str(), format!("source.{column}")),
            )
        })?
        .when_not_matched_insert(|insert| {
            columns.iter().fold(
                insert.predicate("source._operation IN (2, 4)"),
                |insert, column| insert.set(column.as_str(), format!("source.{column}")),
            )
        })?
        .await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("warn,deltalake_core::operations::merge=error");
    let rows = common::env_number("BENCH_SILVER_ROWS", 10_000_000);
    let changes = common::env_number("BENCH_SILVER_CHANGES", rows / 10);
    let rounds = common::env_number("BENCH_SILVER_ROUNDS", 5);
    let temporary = tempfile::tempdir()?;
    let base = temporary.path();
    let (db, writer) = common::orders_database(base, rows)?;
    let table = sample::orders().table;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let server = common::start_server(&db).await?;
        let url = server.url.clone();
        let lake = |name: &str| base.join("lake").join(name).display().to_string();
        let (stream, apply) = common::orders_lake(base, &url);
        Stream::connect(stream.clone()).await?.run_available_now().await?;
        reset_peak_rss();
        let started = Instant::now();
        let first = apply_changes(&apply).await?;
        let load_seconds = started.elapsed().as_secs_f64();
        let rss_load = peak_rss_mib();
        let applied = first
            .applied_lsn
            .map(|lsn| lsn.to_string())
            .unwrap_or_default();

        let mut writer = writer;
        change(&mut writer, &table, changes)?;
        Stream::connect(stream.clone()).await?.run_available_now().await?;
        copy_dir(&base.join("lake").join("silver"), &base.join("lake").join("plain"))?;

        // The timed call runs as the writer does in production: the CLI in its own process,
        // so its peak RSS is the writer's alone (not the simulator's and server's here).
        let (ours, rss_ours) = apply_in_a_process(&apply).await?;
        reset_peak_rss();
        let rss_before = rss_mib();
        let started = Instant::now();
        plain_merge(&lake("bronze"), &lake("plain"), &applied).await?;
        let plain = started.elapsed().as_secs_f64();
        let rss_plain = peak_rss_mib() - rss_before;

        let mut latencies = Vec::new();
        for _ in 0..rounds {
            change(&mut writer, &table, 10_000)?;
            Stream::connect(stream.clone()).await?.run_available_now().await?;
            let started = Instant::now();
            apply_changes(&apply).await?;
            latencies.push(started.elapsed().as_secs_f64());
        }
        latencies.sort_by(f64::total_cmp);
        let median = latencies.get(latencies.len() / 2).copied().unwrap_or(0.0);
        println!(
            "| silver rows | changes | initial load s (peak RSS MiB) | apply_changes s | plain merge s | ratio | peak RSS apply_changes (own process) / plain merge (added to the bench's) MiB | 10k-change call median s |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        println!(
            "| {rows} | {changes} | {load_seconds:.1} ({rss_load:.0}) | {ours:.1} | {plain:.1} | {:.2} | {rss_ours:.0} / {rss_plain:.0} | {median:.2} |",
            ours / plain
        );
        server.stop().await?;
        anyhow::Ok(())
    })
}
