//! What masking at the source costs a stream: one change range of dbo.orders read through
//! `do_get` from two servers of one simulated database, in process on loopback, by the Rust
//! client: one serving every column in clear (the peer), one masking three of them for every
//! caller (`note` hashed, a text of up to a few dozen characters; `customer_id` hashed, an
//! integer; `status` cut to two characters). Rounds alternate so both see the same machine
//! load; the ratio is of the medians.
//!
//! `cargo bench --bench masking`; size with `BENCH_MASK_ROWS` (change rows, default
//! 2,000,000).

use std::sync::Arc;
use std::time::Instant;

use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::masking::MaskPolicy;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::protocol::ChangesCommand;
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_flight::{CommitTime, Lsn};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROUNDS: usize = 5;
const SEED_ROWS: usize = 100_000;
const ROWS_PER_TRANSACTION: usize = 1_000;

/// Seeds rows, then updates them until about `rows` change rows exist.
fn generate(db: &SimDb, rows: u64) -> anyhow::Result<()> {
    let table = sample::orders().table;
    let mut writer = db.writer(Clock::Virtual { step_micros: 1_000 }, 42)?;
    for _ in 0..SEED_ROWS / ROWS_PER_TRANSACTION {
        let mut tx = writer.begin();
        tx.insert(&table, ROWS_PER_TRANSACTION)?;
        tx.commit()?;
    }
    let mut written = SEED_ROWS as u64;
    while written < rows {
        let mut tx = writer.begin();
        let keys = tx.random_keys(&table, ROWS_PER_TRANSACTION / 2)?;
        tx.update(&table, &keys)?;
        written += tx.change_count() as u64;
        tx.commit()?;
    }
    writer.publish()?;
    Ok(())
}

/// Reads every change row of dbo.orders once; returns rows and seconds.
async fn read_all(client: &CdcClient, to: Lsn) -> anyhow::Result<(u64, f64)> {
    let started = Instant::now();
    let from = client.initial_offset("dbo.orders", "earliest").await?.lsn;
    let plan = client
        .plan_changes(&ChangesCommand::new("dbo.orders", from, Some(to)))
        .await?;
    let mut rows = 0u64;
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.as_ref().expect("a ticket per endpoint");
        let (batches, _) = client.collect_endpoint(ticket).await?;
        rows += batches
            .iter()
            .map(|batch| batch.num_rows() as u64)
            .sum::<u64>();
    }
    Ok((rows, started.elapsed().as_secs_f64()))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rows: u64 = std::env::var("BENCH_MASK_ROWS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(2_000_000);
    let dir = tempfile::tempdir()?;
    let db = SimDb::create(
        &dir.path().join("db"),
        &[sample::orders()],
        CommitTime(1_767_225_600_000_000),
    )?;
    generate(&db, rows)?;
    let masks = serde_json::json!({
        "hash_key_file": "mask.key",
        "tables": {"dbo.orders": {"note": "hash", "customer_id": "hash", "status": "truncate(2)"}},
    });
    let masks = MaskPolicy::parse(masks.to_string().as_bytes(), |_| {
        Ok(b"the masking bench's hash key, 32+ bytes".to_vec())
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let source: Arc<dyn CdcSource> = Arc::new(db.clone());
        let to = source.max_lsn().await?.unwrap_or(Lsn::ZERO);
        let clear = LocalServer::start(Arc::clone(&source), TicketSigner::random()?).await?;
        let options = ServiceOptions {
            masks: Arc::new(masks),
            ..ServiceOptions::new(TicketSigner::random()?)
        };
        let masked = LocalServer::start_with(Arc::clone(&source), options).await?;
        let clear_client = CdcClient::connect(&clear.url).await?;
        let masked_client = CdcClient::connect(&masked.url).await?;
        // Warm both (page cache, allocator), then alternate.
        let (served, _) = read_all(&clear_client, to).await?;
        read_all(&masked_client, to).await?;
        let (mut clear_rates, mut masked_rates) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (rows, seconds) = read_all(&clear_client, to).await?;
            clear_rates.push(rows as f64 / seconds);
            let (rows, seconds) = read_all(&masked_client, to).await?;
            masked_rates.push(rows as f64 / seconds);
        }
        let (clear_rate, masked_rate) = (median(clear_rates), median(masked_rates));
        println!(
            "| table | change rows | clear do_get rows/s (median of {ROUNDS}) | masked do_get rows/s | masked / clear |"
        );
        println!("|---|---|---|---|---|");
        println!(
            "| dbo.orders (10 columns; note and customer_id hashed, status cut) | {served} | {clear_rate:.0} | {masked_rate:.0} | {:.2} |",
            masked_rate / clear_rate
        );
        clear.stop().await?;
        masked.stop().await?;
        Ok::<_, anyhow::Error>(())
    })
}
