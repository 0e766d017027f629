//! The cost of listing a large catalog: `list_flights` over a simulated database with 1,000
//! tracked tables (4 columns each), through the real service on a loopback port, read by the
//! Rust client. Prints the calls' median time and the time per table.
//!
//! `cargo bench --bench catalog`; `BENCH_TABLES` sets the table count (default 1,000).

use std::sync::Arc;
use std::time::Instant;

use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::client::CdcClient;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::{SimDb, sample};

fn main() -> anyhow::Result<()> {
    let tables: usize = std::env::var("BENCH_TABLES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(1_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let specs: Vec<_> = (0..tables)
        .map(|index| sample::wide_table(format!("dbo.t{index:05}").parse().expect("name"), 4))
        .collect();
    let db = SimDb::create(
        &dir.path().join("db"),
        &specs,
        CommitTime(1_767_225_600_000_000),
    )?;
    runtime.block_on(async {
        let server = LocalServer::start(Arc::new(db), TicketSigner::random()?).await?;
        let client = CdcClient::connect(&server.url).await?;
        let listed = client.list_tables().await?;
        assert_eq!(listed.len(), tables);
        let mut seconds = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            client.list_tables().await?;
            seconds.push(started.elapsed().as_secs_f64());
        }
        seconds.sort_by(f64::total_cmp);
        let median = seconds[seconds.len() / 2];
        println!("| tables | list_flights median s (5 calls) | ms per table |");
        println!("|---|---|---|");
        println!(
            "| {tables} | {median:.3} | {:.3} |",
            median * 1e3 / tables as f64
        );
        server.stop().await?;
        anyhow::Ok(())
    })
}
