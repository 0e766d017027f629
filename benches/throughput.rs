//! Throughput and memory of serving change ranges.
//!
//! For a narrow table (10 captured columns) and a wide one (60), it measures
//! (a) scanning a range of the simulated source in process (`CdcSource::read_changes`) and
//! (b) the same range through `do_get` of the real server binary, on loopback, read by the
//! Rust client, and reports rows/s, MB/s (Arrow memory of the batches), (b)/(a), and the
//! server process's peak RSS (`VmHWM`). Each path reads the range once before it is timed,
//! so both run with a warm page cache and a warm allocator. Then (c) the same `do_get` from a
//! second server with authentication on (a tokens file, the bearer token on every call), and
//! the cost of authentication per call: sequential `max_lsn` actions on both servers.
//!
//! `cargo bench --bench throughput`; sizes with `BENCH_NARROW_ROWS` (default 10,000,000)
//! and `BENCH_WIDE_ROWS` (default 1,000,000); `BENCH_DIR` keeps the generated databases.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use futures::StreamExt;
use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::protocol::ChangesCommand;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_flight::source::{BatchBytes, CdcSource, ChangeRead, TableName};
use mssql_cdc_flight::{CommitTime, Lsn};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SEED_ROWS: usize = 100_000;
const ROWS_PER_TRANSACTION: usize = 1_000;

fn env_rows(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// Seeds `SEED_ROWS` rows, then updates them until `rows` change rows exist (2 per update).
fn generate(db: &SimDb, table: &TableName, rows: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut writer = db.writer(Clock::Virtual { step_micros: 1_000 }, 42)?;
    for _ in 0..SEED_ROWS / ROWS_PER_TRANSACTION {
        let mut tx = writer.begin();
        tx.insert(table, ROWS_PER_TRANSACTION)?;
        tx.commit()?;
    }
    let mut written = SEED_ROWS as u64;
    while written < rows {
        let mut tx = writer.begin();
        let keys = tx.random_keys(table, ROWS_PER_TRANSACTION / 2)?;
        tx.update(table, &keys)?;
        written += tx.change_count() as u64;
        tx.commit()?;
    }
    writer.publish()?;
    Ok(written as f64 / started.elapsed().as_secs_f64())
}

struct Measure {
    rows: u64,
    bytes: u64,
    seconds: f64,
}

impl Measure {
    fn rows_per_second(&self) -> f64 {
        self.rows as f64 / self.seconds
    }
    fn mb_per_second(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.seconds
    }
}

async fn scan_in_process(db: &SimDb, table: &TableName) -> anyhow::Result<Measure> {
    let instance = db.capture_instances(table).await?.remove(0);
    let columns = instance.output_columns();
    let read = ChangeRead {
        capture_instance: instance.name.clone(),
        from: db.min_lsn(&instance.name).await?,
        to: db.max_lsn().await?.unwrap_or(Lsn::ZERO),
        columns,
        include_command_id: true,
        batch_rows: mssql_cdc_flight::protocol::DEFAULT_BATCH_ROWS,
        batch_bytes: BatchBytes::fixed(mssql_cdc_flight::protocol::DEFAULT_BATCH_BYTES),
    };
    let started = Instant::now();
    let mut stream = db.read_changes(read).await?;
    let (mut rows, mut bytes) = (0u64, 0u64);
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        rows += batch.num_rows() as u64;
        bytes += mssql_cdc_flight::types::batch_slice_size(&batch) as u64;
    }
    Ok(Measure {
        rows,
        bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

struct Server {
    child: Child,
    url: String,
}

/// The bench's bearer token, and the tokens file naming it.
const TOKEN: &str = "the throughput bench's bearer token";

fn tokens_file(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let hash = ring::digest::digest(&ring::digest::SHA256, TOKEN.as_bytes());
    let path = dir.join("tokens.json");
    std::fs::write(
        &path,
        serde_json::json!({"principals": [
            {"name": "bench", "tables": ["*"], "token_sha256": hex::encode(hash.as_ref())}
        ]})
        .to_string(),
    )?;
    Ok(path)
}

impl Server {
    fn start(dir: &Path, tokens: Option<&Path>) -> anyhow::Result<Self> {
        let mut args = vec![
            "serve".to_string(),
            "--source".into(),
            format!("sim:{}", dir.display()),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        if let Some(tokens) = tokens {
            args.extend(["--tokens-file".into(), tokens.display().to_string()]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_mssql-cdc-flight"))
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line)?;
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .ok_or_else(|| anyhow::anyhow!("server said {line}"))?;
        Ok(Server {
            url: format!("http://{address}"),
            child,
        })
    }

    /// Peak resident memory of the server process so far, in MiB.
    fn peak_rss_mib(&self) -> anyhow::Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let line = status
            .lines()
            .find(|line| line.starts_with("VmHWM:"))
            .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
        let kib: f64 = line.split_whitespace().nth(1).unwrap_or("0").parse()?;
        Ok(kib / 1024.0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect(url: &str, token: Option<&str>) -> anyhow::Result<CdcClient> {
    let client = CdcClient::connect(url).await?;
    Ok(match token {
        Some(token) => client.with_token(token)?,
        None => client,
    })
}

/// Microseconds per call of `calls` sequential `max_lsn` actions.
async fn micros_per_call(url: &str, token: Option<&str>, calls: u32) -> anyhow::Result<f64> {
    let client = connect(url, token).await?;
    let body = serde_json::json!({});
    for _ in 0..100 {
        client.action::<serde_json::Value>("max_lsn", &body).await?;
    }
    let started = Instant::now();
    for _ in 0..calls {
        client.action::<serde_json::Value>("max_lsn", &body).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / f64::from(calls))
}

async fn read_through_flight(
    url: &str,
    table: &TableName,
    partitions: u32,
    token: Option<&str>,
) -> anyhow::Result<Measure> {
    let client = connect(url, token).await?;
    let instances: Vec<serde_json::Value> = client
        .action(
            "capture_instances",
            &serde_json::json!({"table": table.to_string()}),
        )
        .await?;
    let min_lsn: Lsn = serde_json::from_value(instances[0]["min_lsn"].clone())?;
    let mut command = ChangesCommand::new(table.to_string(), min_lsn.decrement(), None);
    command.partitions = Some(partitions);
    let started = Instant::now();
    let plan = client.plan_changes(&command).await?;
    let mut reads = Vec::new();
    for endpoint in &plan.info.endpoint {
        let client = client.clone();
        let ticket = endpoint.ticket.clone().expect("ticket");
        reads.push(tokio::spawn(async move {
            let mut bytes = 0u64;
            let completion = client
                .read_endpoint(&ticket, |batch| {
                    bytes += mssql_cdc_flight::types::batch_slice_size(&batch) as u64
                })
                .await?;
            anyhow::Ok((completion.rows, bytes))
        }));
    }
    let (mut rows, mut bytes) = (0u64, 0u64);
    for read in reads {
        let (endpoint_rows, endpoint_bytes) = read.await??;
        rows += endpoint_rows;
        bytes += endpoint_bytes;
    }
    Ok(Measure {
        rows,
        bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let temporary = tempfile::tempdir()?;
    let base = std::env::var("BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| temporary.path().to_path_buf());
    let cases = [
        (
            "narrow (10 columns)",
            sample::orders(),
            env_rows("BENCH_NARROW_ROWS", 10_000_000),
        ),
        (
            "wide (60 columns)",
            sample::wide_table("dbo.wide".parse()?, 60),
            env_rows("BENCH_WIDE_ROWS", 1_000_000),
        ),
    ];
    let tokens = tokens_file(temporary.path())?;
    let mut call_costs = Vec::new();
    println!(
        "| table | rows | generate rows/s | (a) in-process rows/s | (a) MB/s | (b) do_get rows/s | (b) MB/s | (b)/(a) | (b) 2 partitions rows/s | server peak RSS MiB | (c) do_get with auth rows/s | (c)/(b) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, spec, rows) in cases {
        let dir = base.join(spec.table.name.clone());
        let db = if dir.join("manifest.json").exists() {
            SimDb::open(&dir)?
        } else {
            SimDb::create(
                &dir,
                std::slice::from_ref(&spec),
                CommitTime(1_767_225_600_000_000),
            )?
        };
        let generated = if db.manifest()?.capture_instances[0].segments.is_empty() {
            format!("{:.0}", generate(&db, &spec.table, rows)?)
        } else {
            "reused".to_string()
        };
        let (scan, flight, flight_two, rss, authenticated) = runtime.block_on(async {
            // Warm the page cache once so both paths read from memory.
            scan_in_process(&db, &spec.table).await?;
            let scan = scan_in_process(&db, &spec.table).await?;
            let server = Server::start(&dir, None)?;
            // Warm the server the same way (its allocator's first pass pays the page faults).
            read_through_flight(&server.url, &spec.table, 1, None).await?;
            let flight = read_through_flight(&server.url, &spec.table, 1, None).await?;
            let flight_two = read_through_flight(&server.url, &spec.table, 2, None).await?;
            let rss = server.peak_rss_mib()?;
            let secured = Server::start(&dir, Some(&tokens))?;
            read_through_flight(&secured.url, &spec.table, 1, Some(TOKEN)).await?;
            let authenticated =
                read_through_flight(&secured.url, &spec.table, 1, Some(TOKEN)).await?;
            // Calls alternate between the two servers, so both see the same machine load.
            let mut open = Vec::new();
            let mut with_auth = Vec::new();
            for _ in 0..3 {
                open.push(micros_per_call(&server.url, None, 2_000).await?);
                with_auth.push(micros_per_call(&secured.url, Some(TOKEN), 2_000).await?);
            }
            call_costs.push((name, open, with_auth));
            anyhow::Ok((scan, flight, flight_two, rss, authenticated))
        })?;
        assert_eq!(scan.rows, flight.rows, "both paths read the same rows");
        println!(
            "| {name} | {} | {generated} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.2} |",
            scan.rows,
            scan.rows_per_second(),
            scan.mb_per_second(),
            flight.rows_per_second(),
            flight.mb_per_second(),
            flight.rows_per_second() / scan.rows_per_second(),
            flight_two.rows_per_second(),
            rss,
            authenticated.rows_per_second(),
            authenticated.rows_per_second() / flight.rows_per_second(),
        );
    }
    println!();
    println!(
        "| server of | max_lsn µs/call, no auth (3 runs of 2,000) | with bearer token | auth cost µs/call (medians) |"
    );
    println!("|---|---|---|---|");
    for (name, open, with_auth) in call_costs {
        let median = |values: &[f64]| {
            let mut sorted = values.to_vec();
            sorted.sort_by(f64::total_cmp);
            sorted[sorted.len() / 2]
        };
        let show = |values: &[f64]| {
            values
                .iter()
                .map(|value| format!("{value:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "| {name} | {} | {} | {:.1} |",
            show(&open),
            show(&with_auth),
            median(&with_auth) - median(&open)
        );
    }
    Ok(())
}
