//! Freshness: how long a commit takes to be visible in bronze, with the live tail
//! (`wait_for_commits`) and with the 5 s poll it replaces, in one run.
//!
//! For each mode: a simulated database served in process on 127.0.0.1, a continuous stream of
//! dbo.orders into a local lake, and a committer that commits (two updated orders each, wall
//! clock) at a steady `BENCH_FRESHNESS_RATE` commits/s (default 100) for
//! `BENCH_FRESHNESS_SECONDS` (default 60), publishing every commit as SQL Server's capture job
//! would. A commit's latency is its batch's facts `written_at` (taken right after the bronze
//! commit) minus its commit time; the figures are p50, p99 and max over every commit. Then
//! the stream idles for `BENCH_IDLE_SECONDS` (default 10) and the source calls the server
//! made meanwhile are counted per second, by call.
//!
//! `cargo bench -p mssql-cdc-writer --bench freshness`. The ratio printed last is the live
//! tail's p99 over the poll's (target: tail p99 ≤ 1 s).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, Int64Type, TimeUnit};
use arrow::record_batch::RecordBatch;
use common::{env_number, source_calls, start_server};
use deltalake::datafusion::prelude::SessionContext;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::stream::{Stream, StreamConfig};
use mssql_cdc_writer::tables;
use mssql_cdc_writer::tail::Waiting;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What one mode measured.
struct Report {
    commits: usize,
    rate: f64,
    p50: f64,
    p99: f64,
    max: f64,
    batches: usize,
    idle_calls_per_second: BTreeMap<String, f64>,
}

fn main() -> anyhow::Result<()> {
    let rate = env_number("BENCH_FRESHNESS_RATE", 100) as f64;
    let seconds = env_number("BENCH_FRESHNESS_SECONDS", 60);
    let idle = env_number("BENCH_IDLE_SECONDS", 10);
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let poll = Duration::from_secs(5);
    let modes = [
        ("live tail", Waiting::tail(poll)),
        (
            "poll 5 s",
            Waiting {
                poll,
                live_tail: false,
            },
        ),
    ];
    let mut p99s = Vec::new();
    for (name, waiting) in modes {
        let report = runtime.block_on(measure(waiting, rate, seconds, idle, &metrics))?;
        println!(
            "{name:>9}: {} commits at {:.1}/s in {} batches; commit -> bronze p50 {:.3} s, \
             p99 {:.3} s, max {:.3} s",
            report.commits, report.rate, report.batches, report.p50, report.p99, report.max
        );
        let calls: Vec<String> = report
            .idle_calls_per_second
            .iter()
            .map(|(call, per_second)| format!("{call} {per_second:.2}"))
            .collect();
        println!(
            "{name:>9}: source calls per second while idle: {}",
            if calls.is_empty() {
                "none".to_string()
            } else {
                calls.join(", ")
            }
        );
        p99s.push(report.p99);
    }
    println!("p99 live tail / p99 poll = {:.3}", p99s[0] / p99s[1]);
    Ok(())
}

async fn measure(
    waiting: Waiting,
    rate: f64,
    seconds: u64,
    idle: u64,
    metrics: &PrometheusHandle,
) -> anyhow::Result<Report> {
    let dir = tempfile::tempdir()?;
    let db = SimDb::create(
        &dir.path().join("db"),
        &sample::sample_tables(),
        CommitTime(chrono::Utc::now().timestamp_micros() - 60_000_000),
    )?;
    let orders = "dbo.orders".parse()?;
    let mut writer = db.writer(Clock::Wall, 7)?;
    let mut seed = writer.begin();
    seed.insert(&orders, 1_000)?;
    seed.commit()?;
    writer.publish()?;
    let server = start_server(&db).await?;
    let lake = |name: &str| dir.path().join("lake").join(name).display().to_string();
    let config = StreamConfig {
        server: server.url.clone(),
        table: "dbo.orders".into(),
        target: lake("bronze"),
        facts: lake("facts"),
        control: Some(lake("control")),
        app_id: "orders".into(),
        checkpoint: dir.path().join("checkpoint").display().to_string(),
        starting: "earliest".into(),
        max_commits: None,
        partitions: 1,
        granularity: Granularity::Minute,
        fail_on_data_loss: true,
        schema_change_policy: mssql_cdc_writer::schema_policy::SchemaChangePolicy::default(),
        on_data_loss: mssql_cdc_writer::data_loss::OnDataLoss::default(),
        snapshot_on_switch: false,
        resnapshot_every_days: None,
        resnapshot_interval_days: None,
        snapshot_keys: None,
        columns: Default::default(),
    };
    let mut stream = Stream::connect(config).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move { stream.run_continuous(waiting, stopped).await });
    // The seed reaches bronze before the clock starts.
    tokio::time::sleep(Duration::from_secs(6)).await;

    let total = (rate * seconds as f64) as u64;
    let committing = Arc::new(AtomicBool::new(true));
    let committer = {
        let committing = Arc::clone(&committing);
        std::thread::spawn(move || -> anyhow::Result<f64> {
            let started = Instant::now();
            for tick in 0..total {
                let due = started + Duration::from_secs_f64(tick as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let mut tx = writer.begin();
                let keys = tx.random_keys(&orders, 2)?;
                tx.update(&orders, &keys)?;
                tx.commit()?;
                writer.publish()?;
            }
            committing.store(false, Ordering::SeqCst);
            Ok(total as f64 / started.elapsed().as_secs_f64())
        })
    };
    while committing.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let achieved = committer.join().expect("committer")?;
    // The last commits reach bronze (within a poll interval), then the stream idles.
    tokio::time::sleep(waiting.poll + Duration::from_secs(2)).await;
    let before = source_calls(metrics);
    tokio::time::sleep(Duration::from_secs(idle)).await;
    let after = source_calls(metrics);
    // A stream that failed has dropped its end of the channel; its error is the result.
    let _ = stop.send(true);
    running.await??;
    server.stop().await?;

    let idle_calls_per_second = after
        .iter()
        .filter_map(|(call, count)| {
            let calls = count - before.get(call).copied().unwrap_or(0.0);
            (calls > 0.0).then(|| (call.clone(), calls / idle as f64))
        })
        .collect();
    let (mut latencies, batches) = latencies(&lake("bronze"), &lake("facts")).await?;
    latencies.sort_by(f64::total_cmp);
    let at = |share: f64| latencies[((latencies.len() - 1) as f64 * share).round() as usize];
    Ok(Report {
        commits: latencies.len(),
        rate: achieved,
        p50: at(0.5),
        p99: at(0.99),
        max: *latencies.last().expect("commits"),
        batches,
        idle_calls_per_second,
    })
}

/// Seconds from each commit (after the seed) to its batch's facts row, and the batches.
async fn latencies(bronze: &str, facts: &str) -> anyhow::Result<(Vec<f64>, usize)> {
    let written: BTreeMap<i64, i64> = pairs(
        facts,
        "SELECT batch_id, written_at FROM t WHERE event IS NULL",
    )
    .await?
    .into_iter()
    .collect();
    let commits = pairs(
        bronze,
        "SELECT _batch_id, MIN(_commit_ts) FROM t WHERE _batch_id > 0 \
         GROUP BY _batch_id, _start_lsn",
    )
    .await?;
    let latencies = commits
        .iter()
        .map(|(batch, committed)| (written[batch] - committed) as f64 / 1e6)
        .collect();
    Ok((latencies, written.len()))
}

/// The rows of a two-column query as integers (timestamps as microseconds).
async fn pairs(location: &str, sql: &str) -> anyhow::Result<Vec<(i64, i64)>> {
    let table = tables::open(&tables::table_url(location)?)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{location} has no table"))?;
    let context = SessionContext::new();
    context.register_table("t", table.table_provider().await?)?;
    let batches: Vec<RecordBatch> = context.sql(sql).await?.collect().await?;
    let mut rows = Vec::new();
    for batch in &batches {
        let first = micros(batch.column(0))?;
        let second = micros(batch.column(1))?;
        rows.extend(first.into_iter().zip(second));
    }
    Ok(rows)
}

/// An integer or microsecond-timestamp column as `i64`s.
fn micros(column: &dyn Array) -> anyhow::Result<Vec<i64>> {
    let scale = match column.data_type() {
        DataType::Timestamp(TimeUnit::Millisecond, _) => 1_000,
        DataType::Timestamp(TimeUnit::Microsecond, _) | DataType::Int64 | DataType::Int32 => 1,
        other => anyhow::bail!("unexpected column type {other}"),
    };
    let values = arrow::compute::cast(column, &DataType::Int64)?;
    Ok(values
        .as_primitive::<Int64Type>()
        .iter()
        .map(|value| value.unwrap_or_default() * scale)
        .collect())
}
