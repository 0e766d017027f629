//! Reconcile of a matching table: tier 1 against reading the table once over Flight, and
//! tier 2 of a bucket against reading that bucket over Flight.
//!
//! A simulated `dbo.orders` of `BENCH_RECONCILE_ROWS` rows (default 10,000,000) is streamed
//! into bronze and applied to silver (untimed). Then, in one run:
//!
//! - **Flight read**: the whole table through a snapshot `do_get` (2 endpoints), rows
//!   counted: what tier 1 is measured against (target: tier 1 under a tenth of it);
//! - **tier 1**: `mssql-cdc-writer reconcile --sample 0` in its own process (every bucket
//!   matches, so no row is read over Flight; the source sums every row's value digest in its
//!   scan and the writer digests silver's rows alike, so every value is verified), the
//!   median of three runs: its seconds (target: under 0.3 of the Flight read), its peak RSS
//!   (target ≤ 1 GiB) and the source calls the server made for it
//!   (`mssql_cdc_flight_source_call_seconds_count`);
//! - **tier 1, rows only**: the same with `--value-sums false` (counts and key sums; values
//!   only where a bucket is read row by row), once;
//! - **tier 2**: `--sample 1` (every bucket of `BENCH_RECONCILE_BUCKET_ROWS`, default
//!   1,000,000, compared row by row; no value sums, which would compare every value twice);
//!   its time less the rows-only tier 1's, per bucket, against a Flight read of the table's
//!   rows per bucket (target ≤ 1.5);
//! - **keyset tier 1**: `--sample 0 --keys status,order_id`, a composite text key whose
//!   buckets the source cuts: its seconds against the Flight read, and its peak RSS.
//!
//! `cargo bench -p mssql-cdc-writer --bench reconcile`.

mod common;

use std::time::Instant;

use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::sim::sample;
use mssql_cdc_proto::protocol::SnapshotCommand;
use mssql_cdc_writer::silver::apply_changes;
use mssql_cdc_writer::stream::Stream;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs `mssql-cdc-writer reconcile` with `args`: its seconds, its peak RSS (MiB, the last
/// `VmHWM` read every 10 ms before it exits) and its JSON result.
async fn reconcile_in_a_process(args: &[String]) -> anyhow::Result<(f64, f64, serde_json::Value)> {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
    command
        .arg("reconcile")
        .args(args)
        .args(["--output", "json"])
        .stdout(std::process::Stdio::piped());
    let started = Instant::now();
    let mut child = command.spawn()?;
    let status_path = format!("/proc/{}/status", child.id().unwrap_or(0));
    let mut peak = 0.0f64;
    let mut stdout = child.stdout.take().expect("piped");
    let reader = tokio::spawn(async move {
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut text).await?;
        anyhow::Ok(text)
    });
    loop {
        if let Ok(status) = std::fs::read_to_string(&status_path)
            && let Some(kib) = status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        {
            peak = peak.max(kib / 1024.0);
        }
        if let Some(status) = child.try_wait()? {
            let seconds = started.elapsed().as_secs_f64();
            let text = reader.await??;
            anyhow::ensure!(status.success(), "reconcile failed: {status}\n{text}");
            return Ok((seconds, peak, serde_json::from_str(&text)?));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Source calls the server made so far, from its Prometheus metrics.
fn source_calls(metrics: &metrics_exporter_prometheus::PrometheusHandle) -> u64 {
    metrics
        .render()
        .lines()
        .filter(|line| line.starts_with("mssql_cdc_flight_source_call_seconds_count"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("warn,deltalake_core::operations::merge=error");
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let rows = common::env_number("BENCH_RECONCILE_ROWS", 10_000_000);
    let bucket_rows = common::env_number("BENCH_RECONCILE_BUCKET_ROWS", 1_000_000);
    let temporary = tempfile::tempdir()?;
    let base = temporary.path();
    let (db, _) = common::orders_database(base, rows)?;
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
        apply_changes(&apply).await?;

        // The peer: the whole table read once over Flight.
        let client = CdcClient::connect(&url).await?;
        let started = Instant::now();
        let plan = client
            .plan_snapshot(&SnapshotCommand {
                partitions: Some(2),
                ..SnapshotCommand::new(table.to_string())
            })
            .await?;
        let reads = plan.info.endpoint.iter().map(|endpoint| {
            let client = client.clone();
            let ticket = endpoint.ticket.clone().expect("ticket");
            async move {
                let mut read = 0u64;
                client
                    .read_endpoint(&ticket, |batch| read += batch.num_rows() as u64)
                    .await?;
                anyhow::Ok(read)
            }
        });
        let read: u64 = futures::future::try_join_all(reads).await?.into_iter().sum();
        let flight_seconds = started.elapsed().as_secs_f64();
        anyhow::ensure!(read == rows, "the Flight read got {read} of {rows} rows");

        let args = |sample: &str| -> Vec<String> {
            [
                "--server", &url, "--table", &table.to_string(), "--silver", &lake("silver"),
                "--bronze", &lake("bronze"), "--control", &lake("control"),
                "--bucket-rows", &bucket_rows.to_string(), "--sample", sample, "--seed", "1",
            ]
            .iter()
            .map(|arg| arg.to_string())
            .collect()
        };
        // Tier 1 three times (the median; the first also warms the page cache as the Flight
        // read did for the peer), its source calls counted on the first.
        let calls_before = source_calls(&metrics);
        let (first, rss1, result1) = reconcile_in_a_process(&args("0")).await?;
        let calls = source_calls(&metrics) - calls_before;
        let mut tier1_runs = vec![first];
        for _ in 0..2 {
            tier1_runs.push(reconcile_in_a_process(&args("0")).await?.0);
        }
        tier1_runs.sort_by(f64::total_cmp);
        let tier1 = tier1_runs[1];
        let mut rows_only_args = args("0");
        rows_only_args.extend(["--value-sums".to_string(), "false".to_string()]);
        let (rows_only, _, rows_result) = reconcile_in_a_process(&rows_only_args).await?;
        anyhow::ensure!(
            rows_result["match"] == rows_result["buckets"] && rows_result["value_sums"] == false,
            "a matching table, rows only: {rows_result}"
        );
        let (tiers12, rss2, result2) = reconcile_in_a_process(&args("1")).await?;
        let buckets = result1["buckets"].as_u64().unwrap_or(0);
        anyhow::ensure!(
            result1["match"] == result1["buckets"] && result2["hashed"] == result2["buckets"],
            "a matching table: {result1} / {result2}"
        );
        anyhow::ensure!(
            result1["values_verified"] == true && result1["hashed"] == 0,
            "tier 1 alone verifies every value by the value sums: {result1}"
        );
        let per_bucket = (tiers12 - rows_only).max(0.0) / buckets.max(1) as f64;
        let flight_per_bucket = flight_seconds / buckets.max(1) as f64;
        println!(
            "| rows | buckets | Flight read s | tier 1, values verified, s (÷ Flight) | source calls | tier 1 peak RSS MiB | tier 1 rows only s (÷ Flight) | tier 2 s per bucket (÷ Flight read of a bucket) | tiers 1+2 peak RSS MiB |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        println!(
            "| {rows} | {buckets} | {flight_seconds:.2} | {tier1:.2} ({:.3}; runs {}) | {calls} | {rss1:.0} | {rows_only:.2} ({:.3}) | {per_bucket:.2} ({:.2}) | {rss2:.0} |",
            tier1 / flight_seconds,
            tier1_runs
                .iter()
                .map(|seconds| format!("{seconds:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            rows_only / flight_seconds,
            per_bucket / flight_per_bucket,
        );
        // The same table compared on a composite text key the source cuts into buckets:
        // tier 1 reads the key columns over Flight and holds silver's keys.
        let mut keyset_args = args("0");
        keyset_args.extend(["--keys".to_string(), "status,order_id".to_string()]);
        let (keyset_seconds, keyset_rss, keyset) = reconcile_in_a_process(&keyset_args).await?;
        anyhow::ensure!(
            keyset["match"] == keyset["buckets"] && keyset["key_sums"] == false,
            "a matching table on a keyset key: {keyset}"
        );
        println!(
            "\n| keyset tier 1 (`--keys status,order_id`) | buckets | s (÷ Flight read) | peak RSS MiB |"
        );
        println!("|---|---|---|---|");
        println!(
            "| {rows} rows | {} | {keyset_seconds:.2} ({:.3}) | {keyset_rss:.0} |",
            keyset["buckets"],
            keyset_seconds / flight_seconds
        );
        server.stop().await?;
        anyhow::Ok(())
    })
}
