//! What the writer's benchmarks share: sizes from the environment and the server in process.

#![allow(dead_code)] // each benchmark uses a different part

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::{Clock, SimDb, SimWriter, sample};
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::silver::ApplyConfig;
use mssql_cdc_writer::stream::StreamConfig;

/// A number from the environment variable `name`, or `default`.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// Writes every dirty page back before a timed run, so no run pays for the writeback of the
/// files an earlier run left in the page cache (the kernel flushes them after 30 s, which
/// otherwise lands inside whichever run comes next).
pub fn settle() -> anyhow::Result<()> {
    let status = std::process::Command::new("sync").status()?;
    anyhow::ensure!(status.success(), "sync failed: {status}");
    Ok(())
}

/// The median of `values` (the mean of the middle two when their count is even).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() % 2 {
        0 if middle > 0 => (values[middle - 1] + values[middle]) / 2.0,
        _ => values[middle],
    }
}

/// The Flight server serving `db` on 127.0.0.1 in this process.
/// Runs `command` to its end: its seconds and peak RSS (MiB, its last `VmHWM` read every
/// 10 ms; the high-water mark only grows). Its standard error is in the error when it fails.
pub async fn run_measured(mut command: tokio::process::Command) -> anyhow::Result<(f64, f64)> {
    let started = std::time::Instant::now();
    let mut child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let status_file = format!("/proc/{}/status", child.id().unwrap_or_default());
    let mut peak = 0.0f64;
    let mut stderr = child.stderr.take();
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
    if !status.success() {
        let mut text = String::new();
        if let Some(stderr) = stderr.as_mut() {
            use tokio::io::AsyncReadExt;
            stderr.read_to_string(&mut text).await?;
        }
        anyhow::bail!("{command:?} failed: {status}: {text}");
    }
    Ok((seconds, peak))
}

pub async fn start_server(db: &SimDb) -> anyhow::Result<LocalServer> {
    Ok(LocalServer::start(Arc::new(db.clone()), TicketSigner::random()?).await?)
}

/// A simulated `dbo.orders` in `base/db` holding `rows` rows, inserted in commits of 10,000,
/// and the writer that inserted them (for the changes a benchmark makes next).
pub fn orders_database(base: &Path, rows: u64) -> anyhow::Result<(SimDb, SimWriter)> {
    let db = SimDb::create(
        &base.join("db"),
        &[sample::orders()],
        CommitTime(1_767_225_600_000_000),
    )?;
    let table = sample::orders().table;
    let mut writer = db.writer(Clock::Virtual { step_micros: 1_000 }, 3)?;
    let mut inserted = 0u64;
    while inserted < rows {
        let count = (rows - inserted).min(10_000);
        let mut tx = writer.begin();
        tx.insert(&table, count as usize)?;
        tx.commit()?;
        inserted += count;
    }
    writer.publish()?;
    Ok((db, writer))
}

/// The stream of `dbo.orders` from `url` into bronze in `base/lake`, and its silver.
pub fn orders_lake(base: &Path, url: &str) -> (StreamConfig, ApplyConfig) {
    let lake = |name: &str| base.join("lake").join(name).display().to_string();
    let table = sample::orders().table.to_string();
    let stream = StreamConfig {
        server: url.to_string(),
        table: table.clone(),
        target: lake("bronze"),
        facts: lake("facts"),
        control: Some(lake("control")),
        app_id: "bench".into(),
        checkpoint: base.join("checkpoint").display().to_string(),
        starting: "earliest".into(),
        max_commits: Some(200),
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
    };
    let apply = ApplyConfig {
        table,
        bronze: lake("bronze"),
        target: lake("silver"),
        capture_instance: None,
        keys: vec!["order_id".into()],
        control: lake("control"),
        facts: Some(lake("facts")),
        granularity: Granularity::Minute,
        deletion_vectors: false,
    };
    (stream, apply)
}

/// Every source call the server made so far, counted by call (its latency histogram's count).
pub fn source_calls(
    metrics: &metrics_exporter_prometheus::PrometheusHandle,
) -> BTreeMap<String, f64> {
    let mut calls = BTreeMap::new();
    for line in metrics.render().lines() {
        let Some(rest) = line.strip_prefix("mssql_cdc_flight_source_call_seconds_count{") else {
            continue;
        };
        let Some((labels, count)) = rest.split_once("} ") else {
            continue;
        };
        let call = labels
            .split(',')
            .find_map(|label| label.strip_prefix("call=\""))
            .map(|call| call.trim_end_matches('"').to_string())
            .unwrap_or_default();
        *calls.entry(call).or_insert(0.0) += count.trim().parse::<f64>().unwrap_or(0.0);
    }
    calls
}
