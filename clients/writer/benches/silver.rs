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
//! `clear_refs`: the process holds the server and the simulator too). Then
//! `BENCH_SILVER_ROUNDS` (default 5) steady-state calls of 10,000 changes each, updates of
//! uniform keys, then with 80% of updates among the newest 5% of keys: each workload's
//! median call, and the plain merge of its first call's changes (on a copy of silver).
//!
//! `BENCH_SILVER_DELETION_VECTORS=1` (default 0) creates silver with deletion vectors, so
//! `apply_changes` marks replaced rows instead of writing files again (the plain merge,
//! delta-rs' MERGE, writes files again on either table).
//!
//! `cargo bench -p mssql-cdc-writer --bench silver`.

mod common;

use std::path::Path;
use std::time::Instant;

use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_flight::sim::{SimWriter, sample};
use mssql_cdc_flight::source::TableName;
use mssql_cdc_writer::control;
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
    if config.deletion_vectors {
        command.arg("--deletion-vectors");
    }
    common::run_measured(command).await
}

/// How a workload picks the keys it updates.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// Uniformly.
    Uniform,
    /// 80% of updates among the newest 5% of keys, as an orders table's updates are.
    Recent,
}

/// Commits `changes` changes: 70% updates, 20% inserts, 10% deletes of uniform random keys
/// (updates as `keys` says).
fn change(
    writer: &mut SimWriter,
    table: &TableName,
    changes: u64,
    keys: Keys,
) -> anyhow::Result<()> {
    let mut done = 0u64;
    while done < changes {
        let batch = (changes - done).min(10_000);
        let mut tx = writer.begin();
        let count = (batch * 7 / 10) as usize;
        let updates = match keys {
            Keys::Uniform => tx.random_keys(table, count)?,
            Keys::Recent => {
                let mut recent = tx.random_recent_keys(table, count * 8 / 10, 0.05)?;
                let seen: std::collections::HashSet<i64> = recent.iter().copied().collect();
                let others = tx.random_keys(table, count - recent.len())?;
                recent.extend(others.into_iter().filter(|key| !seen.contains(key)));
                recent
            }
        };
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

/// Silver's position: the highest change LSN it applied.
async fn applied_lsn(apply: &ApplyConfig) -> anyhow::Result<String> {
    let row = control::row(&tables::table_url(&apply.control)?, &apply.target).await?;
    row.and_then(|row| row.position.applied_lsn)
        .ok_or_else(|| anyhow::anyhow!("silver has no position"))
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
    let deletion_vectors = common::env_number("BENCH_SILVER_DELETION_VECTORS", 0) == 1;
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
        let apply = ApplyConfig {
            deletion_vectors,
            ..apply
        };
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
        change(&mut writer, &table, changes, Keys::Uniform)?;
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

        // Steady-state calls of 10,000 changes, uniform then recent keys; the first of each
        // also by the plain merge, on a copy of silver as it was before the call.
        let mut medians = Vec::new();
        for keys in [Keys::Uniform, Keys::Recent] {
            let mut latencies = Vec::new();
            let mut plain = None;
            for round in 0..rounds {
                let position = applied_lsn(&apply).await?;
                change(&mut writer, &table, 10_000, keys)?;
                Stream::connect(stream.clone()).await?.run_available_now().await?;
                if round == 0 {
                    let copy = base.join("lake").join(format!("plain-{}", medians.len()));
                    copy_dir(&base.join("lake").join("silver"), &copy)?;
                    let started = Instant::now();
                    plain_merge(&lake("bronze"), &copy.display().to_string(), &position).await?;
                    plain = Some(started.elapsed().as_secs_f64());
                    std::fs::remove_dir_all(&copy)?;
                }
                let started = Instant::now();
                apply_changes(&apply).await?;
                latencies.push(started.elapsed().as_secs_f64());
            }
            latencies.sort_by(f64::total_cmp);
            let median = latencies.get(latencies.len() / 2).copied().unwrap_or(0.0);
            medians.push((median, plain.unwrap_or(f64::NAN)));
        }
        let [(uniform, uniform_plain), (recent, recent_plain)] = medians[..] else {
            anyhow::bail!("two workloads");
        };
        println!(
            "silver with deletion vectors: {}",
            if deletion_vectors { "yes" } else { "no" }
        );
        println!(
            "| silver rows | changes | initial load s (peak RSS MiB) | apply_changes s | plain merge s | ratio | peak RSS apply_changes (own process) / plain merge (added to the bench's) MiB |"
        );
        println!("|---|---|---|---|---|---|---|");
        println!(
            "| {rows} | {changes} | {load_seconds:.1} ({rss_load:.0}) | {ours:.1} | {plain:.1} | {:.2} | {rss_ours:.0} / {rss_plain:.0} |",
            ours / plain
        );
        println!();
        println!(
            "| 10k-change calls | apply_changes median s ({rounds} calls) | plain merge s (first call) | ratio |"
        );
        println!("|---|---|---|---|");
        println!(
            "| uniform keys | {uniform:.2} | {uniform_plain:.2} | {:.2} |",
            uniform / uniform_plain
        );
        println!(
            "| 80% of updates to the newest 5% of keys | {recent:.2} | {recent_plain:.2} | {:.2} |",
            recent / recent_plain
        );
        server.stop().await?;
        anyhow::Ok(())
    })
}
