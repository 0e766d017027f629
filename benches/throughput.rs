//! Throughput and memory of serving change ranges.
//!
//! For a narrow table (10 captured columns) and a wide one (60), it measures
//! (a) scanning a range of the simulated source in process (`CdcSource::read_changes`) and
//! (b) the same range through `do_get` of the real server binary, on loopback, read by the
//! Rust client, and reports rows/s, MB/s (Arrow memory of the batches), (b)/(a), and the
//! server process's peak RSS (`VmHWM`). Each path reads the range once before it is timed,
//! so both run with a warm page cache and a warm allocator; (b)'s server runs without the
//! stall timeout. Then (c) the same `do_get` from a second server secured as off loopback (a
//! tokens file, the bearer token on every call, TLS with a certificate for `localhost`,
//! `--stall-timeout 60`) and (e) from a third with the tokens file and the default bounds but
//! no TLS, read in rounds alternating with (b), and the cost of authentication per call:
//! sequential `max_lsn` actions on the servers.
//! Then (d) P1 of issue 22: our `do_get` against a stock arrow-flight server serving the same
//! batches from memory ([`stock_server`]), read by the same client, with 1 and 2 endpoints,
//! in alternating rounds so both see the same machine load; the ratio is of the medians.
//!
//! `cargo bench --bench throughput`; sizes with `BENCH_NARROW_ROWS` (default 10,000,000)
//! and `BENCH_WIDE_ROWS` (default 1,000,000); `BENCH_DIR` keeps the generated databases.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use arrow::record_batch::RecordBatch;
use arrow_flight::Ticket;
use futures::StreamExt;
use mssql_cdc_flight::client::{CdcClient, ClientTls};
use mssql_cdc_flight::protocol::ChangesCommand;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_flight::source::{BatchBytes, CdcSource, ChangeRead, TableName};
use mssql_cdc_flight::{CommitTime, Lsn};

#[path = "throughput/stock_server.rs"]
mod stock_server;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Alternating rounds of our server and the stock one.
const ROUNDS: usize = 3;

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

/// Reads the whole range of `table` in process, handing each batch to `on_batch`.
async fn scan_in_process(
    db: &SimDb,
    table: &TableName,
    mut on_batch: impl FnMut(RecordBatch),
) -> anyhow::Result<Measure> {
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
        on_batch(batch);
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

/// The secured server's TLS: a self-signed certificate for `localhost` (PEM files in `dir`)
/// and what a client trusts it by.
fn tls_files(dir: &Path) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf, ClientTls)> {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    let (certificate, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&certificate, certified.cert.pem())?;
    std::fs::write(&key, certified.signing_key.serialize_pem())?;
    let trust = ClientTls {
        ca_certificate: certified.cert.pem().into_bytes(),
        domain: None,
        identity: None,
    };
    Ok((certificate, key, trust))
}

impl Server {
    /// The server over `dir`; with `tokens`, authenticated with the default bounds (else
    /// without the stall timeout), and with `tls` (certificate and key files), over TLS with
    /// a stall timeout of a minute, as a server off loopback runs.
    fn start(
        dir: &Path,
        tokens: Option<&Path>,
        tls: Option<(&Path, &Path)>,
    ) -> anyhow::Result<Self> {
        let mut args = vec![
            "serve".to_string(),
            "--source".into(),
            format!("sim:{}", dir.display()),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        match tokens {
            Some(tokens) => args.extend(["--tokens-file".into(), tokens.display().to_string()]),
            None => args.extend(["--stall-timeout".into(), "0".into()]),
        }
        if let Some((certificate, key)) = tls {
            args.extend([
                "--tls-cert".into(),
                certificate.display().to_string(),
                "--tls-key".into(),
                key.display().to_string(),
                "--stall-timeout".into(),
                "60".into(),
            ]);
        }
        let mut command = Command::new(env!("CARGO_BIN_EXE_mssql-cdc-flight"));
        command.args(&args).env("RUST_LOG", "warn");
        let mut server = Self::spawn(command)?;
        if tls.is_some() {
            let port = server
                .url
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .to_string();
            server.url = format!("https://localhost:{port}");
        }
        Ok(server)
    }

    /// The stock arrow-flight server holding the whole range of `table` in memory: this
    /// bench's binary again, as `stock-server DIR TABLE`.
    fn stock(dir: &Path, table: &TableName) -> anyhow::Result<Self> {
        let mut command = Command::new(std::env::current_exe()?);
        command.arg(STOCK_SERVER).arg(dir).arg(table.to_string());
        Self::spawn(command)
    }

    /// Starts `command` and waits for its `listening on ADDRESS` line.
    fn spawn(mut command: Command) -> anyhow::Result<Self> {
        let mut child = command
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

/// How a client reaches a server: its bearer token and the TLS it trusts.
#[derive(Clone, Copy)]
struct Credentials<'a> {
    token: Option<&'a str>,
    tls: Option<&'a ClientTls>,
}

const OPEN: Credentials<'static> = Credentials {
    token: None,
    tls: None,
};

/// The bearer token over h2c (loopback), for the server of (e).
const BEARER: Credentials<'static> = Credentials {
    token: Some(TOKEN),
    tls: None,
};

async fn connect(url: &str, credentials: Credentials<'_>) -> anyhow::Result<CdcClient> {
    let client = CdcClient::connect_with(url, credentials.tls).await?;
    let token = credentials.token;
    Ok(match token {
        Some(token) => client.with_token(token)?,
        None => client,
    })
}

/// Microseconds per call of `calls` sequential `max_lsn` actions.
async fn micros_per_call(
    url: &str,
    credentials: Credentials<'_>,
    calls: u32,
) -> anyhow::Result<f64> {
    let client = connect(url, credentials).await?;
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

/// Reads `table`'s whole range through our server's plan of `partitions` endpoints, each
/// endpoint checked against its completion marker; timed from the plan.
async fn read_through_flight(
    url: &str,
    table: &TableName,
    partitions: u32,
    credentials: Credentials<'_>,
) -> anyhow::Result<Measure> {
    let client = connect(url, credentials).await?;
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
    let tickets = plan
        .info
        .endpoint
        .iter()
        .map(|endpoint| endpoint.ticket.clone().expect("ticket"))
        .collect();
    read_tickets(&client, tickets, true, started).await
}

/// Reads the stock server's batches in `shares` endpoints.
async fn read_stock(url: &str, shares: u32) -> anyhow::Result<Measure> {
    let client = connect(url, OPEN).await?;
    let tickets = (0..shares)
        .map(|share| Ticket::new(format!("{share}/{shares}")))
        .collect();
    read_tickets(&client, tickets, false, Instant::now()).await
}

/// Reads `tickets` concurrently with the one client both servers are read by; with
/// `checked`, each ends with its completion marker and its rows.
async fn read_tickets(
    client: &CdcClient,
    tickets: Vec<Ticket>,
    checked: bool,
    started: Instant,
) -> anyhow::Result<Measure> {
    let mut reads = Vec::new();
    for ticket in tickets {
        let client = client.clone();
        reads.push(tokio::spawn(async move {
            let (mut rows, mut bytes) = (0u64, 0u64);
            let mut reader = client.open_endpoint(&ticket).await?;
            while let Some(batch) = reader.next_batch().await? {
                rows += batch.num_rows() as u64;
                bytes += mssql_cdc_flight::types::batch_slice_size(&batch) as u64;
            }
            if checked {
                reader.completion()?;
            }
            anyhow::Ok((rows, bytes))
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

/// The rows/s of `reads`.
fn rates(reads: &[Costed]) -> Vec<f64> {
    reads.iter().map(|read| read.rows_per_second).collect()
}

/// The median of one figure of `reads`.
fn median_of(reads: &[Costed], figure: fn(&Costed) -> f64) -> f64 {
    median(&reads.iter().map(figure).collect::<Vec<_>>())
}

/// `values` with `decimals` digits each, separated by commas.
fn listed(values: &[f64], decimals: usize) -> String {
    values
        .iter()
        .map(|value| format!("{value:.decimals$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median of `values`.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// CPU seconds (user and system) that process `pid` has used so far.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("no command in /proc/{pid}/stat"))?
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command; the
    // kernel counts them in USER_HZ ticks, 100 per second on Linux.
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

/// One timed read with the CPU each side spent on it, per million rows.
struct Costed {
    rows_per_second: f64,
    server_cpu: f64,
    client_cpu: f64,
}

/// Times `read` and charges the CPU that `server` and this process spent meanwhile.
async fn costed(
    server: &Server,
    read: impl Future<Output = anyhow::Result<Measure>>,
) -> anyhow::Result<Costed> {
    let (server_before, client_before) = (
        cpu_seconds(server.child.id())?,
        cpu_seconds(std::process::id())?,
    );
    let measure = read.await?;
    let per_million = 1e6 / measure.rows as f64;
    Ok(Costed {
        rows_per_second: measure.rows_per_second(),
        server_cpu: (cpu_seconds(server.child.id())? - server_before) * per_million,
        client_cpu: (cpu_seconds(std::process::id())? - client_before) * per_million,
    })
}

/// Our server's and the stock one's reads with 1 and 2 endpoints, and the secured server's
/// with 1, in alternating rounds.
struct Peers {
    ours: [Vec<Costed>; 2],
    stock: [Vec<Costed>; 2],
    secured: Vec<Costed>,
    /// (e): tokens and the default bounds, no TLS.
    authenticated: Vec<Costed>,
}

/// The first argument that makes this binary the stock server.
const STOCK_SERVER: &str = "stock-server";

/// Runs the stock server of `stock-server DIR TABLE`: reads the range in process, then serves.
fn stock_server_main(dir: &str, table: &str) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let db = SimDb::open(Path::new(dir))?;
        let mut batches = Vec::new();
        scan_in_process(&db, &table.parse()?, |batch| batches.push(batch)).await?;
        stock_server::serve(batches).await
    })
}

fn main() -> anyhow::Result<()> {
    let arguments: Vec<String> = std::env::args().collect();
    if arguments.get(1).map(String::as_str) == Some(STOCK_SERVER) {
        return stock_server_main(&arguments[2], &arguments[3]);
    }
    // The client's TLS as the project's clients have it.
    mssql_cdc_flight::install_crypto_provider();
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
    let (certificate, key, trust) = tls_files(temporary.path())?;
    let secure = Credentials {
        token: Some(TOKEN),
        tls: Some(&trust),
    };
    let mut call_costs = Vec::new();
    let mut stock_rows = Vec::new();
    println!(
        "| table | rows | generate rows/s | (a) in-process rows/s | (a) MB/s | (b) do_get rows/s | (b) MB/s | (b)/(a) | (b) 2 partitions rows/s | server peak RSS MiB | (c) do_get with auth, TLS and stall timeout rows/s | (c)/(b) | (e) do_get with auth and bounds, no TLS, rows/s | (e)/(b) | server CPU-s per 1M rows, (b) / (e) / (c) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
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
        let (scan, served_rows, peers, rss) = runtime.block_on(async {
            // Warm the page cache once so both paths read from memory.
            scan_in_process(&db, &spec.table, drop).await?;
            let scan = scan_in_process(&db, &spec.table, drop).await?;
            let server = Server::start(&dir, None, None)?;
            let stock = Server::stock(&dir, &spec.table)?;
            let secured = Server::start(&dir, Some(&tokens), Some((&certificate, &key)))?;
            let authenticated = Server::start(&dir, Some(&tokens), None)?;
            // Warm the servers the same way (an allocator's first pass pays the page faults).
            let warm = read_through_flight(&server.url, &spec.table, 1, OPEN).await?;
            read_through_flight(&secured.url, &spec.table, 1, secure).await?;
            read_through_flight(&authenticated.url, &spec.table, 1, BEARER).await?;
            let warm_stock = read_stock(&stock.url, 1).await?;
            assert_eq!(
                warm.rows, warm_stock.rows,
                "both servers serve the same rows"
            );
            let mut peers = Peers {
                ours: [Vec::new(), Vec::new()],
                stock: [Vec::new(), Vec::new()],
                secured: Vec::new(),
                authenticated: Vec::new(),
            };
            for _ in 0..ROUNDS {
                for (slot, endpoints) in [1u32, 2].into_iter().enumerate() {
                    let ours = read_through_flight(&server.url, &spec.table, endpoints, OPEN);
                    peers.ours[slot].push(costed(&server, ours).await?);
                    let theirs = read_stock(&stock.url, endpoints);
                    peers.stock[slot].push(costed(&stock, theirs).await?);
                }
                let guarded = read_through_flight(&secured.url, &spec.table, 1, secure);
                peers.secured.push(costed(&secured, guarded).await?);
                let bearer = read_through_flight(&authenticated.url, &spec.table, 1, BEARER);
                peers
                    .authenticated
                    .push(costed(&authenticated, bearer).await?);
            }
            drop(stock);
            let rss = server.peak_rss_mib()?;
            // Calls alternate between the two servers, so both see the same machine load.
            let mut open = Vec::new();
            let mut with_auth = Vec::new();
            for _ in 0..3 {
                open.push(micros_per_call(&server.url, OPEN, 2_000).await?);
                with_auth.push(micros_per_call(&secured.url, secure, 2_000).await?);
            }
            call_costs.push((name, open, with_auth));
            anyhow::Ok((scan, warm.rows, peers, rss))
        })?;
        assert_eq!(scan.rows, served_rows, "both paths read the same rows");
        let flight = median(&rates(&peers.ours[0]));
        let flight_two = median(&rates(&peers.ours[1]));
        let secured = median(&rates(&peers.secured));
        let authenticated = median(&rates(&peers.authenticated));
        println!(
            "| {name} | {} | {generated} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.2} / {:.2} / {:.2} |",
            scan.rows,
            scan.rows_per_second(),
            scan.mb_per_second(),
            flight,
            flight * scan.bytes as f64 / scan.rows as f64 / 1e6,
            flight / scan.rows_per_second(),
            flight_two,
            rss,
            secured,
            secured / flight,
            authenticated,
            authenticated / flight,
            median_of(&peers.ours[0], |read| read.server_cpu),
            median_of(&peers.authenticated, |read| read.server_cpu),
            median_of(&peers.secured, |read| read.server_cpu),
        );
        stock_rows.push((name, peers));
    }
    println!();
    println!(
        "| server of | max_lsn µs/call, no auth (3 runs of 2,000) | with bearer token and TLS | auth and TLS cost µs/call (medians) |"
    );
    println!("|---|---|---|---|");
    for (name, open, with_auth) in call_costs {
        println!(
            "| {name} | {} | {} | {:.1} |",
            listed(&open, 1),
            listed(&with_auth, 1),
            median(&with_auth) - median(&open)
        );
    }
    println!();
    println!(
        "| table | endpoints | ours rows/s ({ROUNDS} rounds) | stock arrow-flight rows/s | ours ÷ stock (medians) | server CPU-s per 1M rows, ours / stock | client CPU-s per 1M rows, reading ours / stock |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, peers) in stock_rows {
        for (slot, endpoints) in [1, 2].into_iter().enumerate() {
            let (ours, stock) = (&peers.ours[slot], &peers.stock[slot]);
            println!(
                "| {name} | {endpoints} | {} | {} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |",
                listed(&rates(ours), 0),
                listed(&rates(stock), 0),
                median(&rates(ours)) / median(&rates(stock)),
                median_of(ours, |read| read.server_cpu),
                median_of(stock, |read| read.server_cpu),
                median_of(ours, |read| read.client_cpu),
                median_of(stock, |read| read.client_cpu),
            );
        }
    }
    Ok(())
}
