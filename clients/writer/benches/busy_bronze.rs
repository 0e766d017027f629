//! A busy table's bronze: one stream writes `BENCH_BATCHES` (default 1,500) batches of one
//! small commit each (two updated orders) into one bronze table in a temp directory, and
//! prints the wall time a batch took over each 250, with bronze's live files after them.
//! Every batch adds a small bronze file, and delta-rs rebuilds a loaded table's file list on
//! every update, so without compaction a batch's time grows with the table's files
//! (docs/writer.md, "Small files compacted as they are appended").
//!
//! `cargo bench -p mssql-cdc-writer --bench busy_bronze`. The ratio printed last is the last
//! 250's time a batch over the first 250's.

mod common;

use std::time::Instant;

use common::{env_number, orders_database, orders_lake, start_server};
use mssql_cdc_flight::sim::sample;
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tables;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WINDOW: usize = 250;

fn main() -> anyhow::Result<()> {
    // `RUST_LOG=mssql_cdc_writer::stream=debug` logs each batch's laps.
    mssql_cdc_flight::init_process("warn,deltalake_core::operations::merge=error");
    let batches = (env_number("BENCH_BATCHES", 1_500) as usize).max(WINDOW);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        let (db, mut writer) = orders_database(dir.path(), 1_000)?;
        let server = start_server(&db).await?;
        let (config, _) = orders_lake(dir.path(), &server.url);
        let bronze = tables::table_url(&config.target)?;
        let mut stream = Stream::connect(config).await?;
        // The seed's batch, before the clock starts.
        stream.run_batch(None).await?;
        let orders = sample::orders().table;
        let mut windows = Vec::new();
        let mut started = Instant::now();
        for n in 0..batches {
            let mut tx = writer.begin();
            let keys = tx.random_keys(&orders, 2)?;
            tx.update(&orders, &keys)?;
            tx.commit()?;
            writer.publish()?;
            let outcome = stream.run_batch(None).await?;
            anyhow::ensure!(
                outcome.is_some_and(|outcome| outcome.rows == 4),
                "batch {n} did not write its commit's 4 rows"
            );
            if (n + 1) % WINDOW == 0 {
                let millis = started.elapsed().as_secs_f64() * 1000.0 / WINDOW as f64;
                let table = tables::open(&bronze).await?;
                let files = table.map_or(0, |table| {
                    table.snapshot().map_or(0, |s| s.log_data().num_files())
                });
                println!(
                    "batches {:>5}-{:>5}: {millis:.1} ms a batch; {files} live bronze files after",
                    n + 2 - WINDOW,
                    n + 1
                );
                windows.push(millis);
                started = Instant::now();
            }
        }
        println!(
            "last {WINDOW} / first {WINDOW}, time a batch: {:.2}",
            windows.last().copied().unwrap_or(0.0) / windows.first().copied().unwrap_or(1.0)
        );
        anyhow::Ok(())
    })
}
