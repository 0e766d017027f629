//! Facts appends: one appender commits `BENCH_APPENDS` (default 2,000) one-row facts batches,
//! each with its own application transaction, to one facts table in a temp directory, as the
//! ledger does (the table kept between commits), and prints the wall time an append took
//! over each 250. delta-rs rebuilds a loaded table's file list on every update, so without
//! compaction the time grows with the table's files (docs/writer.md, "Small files
//! compacted as they are appended").
//!
//! `cargo bench -p mssql-cdc-writer --bench facts_appends`. The ratio printed last is the
//! last 250's time an append over the first 250's.

mod common;

use std::time::Instant;

use common::env_number;
use mssql_cdc_writer::facts::{self, FactsRow};
use mssql_cdc_writer::tables::{self, TableKind};

const WINDOW: usize = 250;

fn main() -> anyhow::Result<()> {
    let appends = (env_number("BENCH_APPENDS", 2_000) as usize).max(WINDOW);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        let url = tables::table_url(&dir.path().join("facts").display().to_string())?;
        let mut cached = None;
        let mut windows = Vec::new();
        let mut started = Instant::now();
        for n in 0..appends {
            let batch = facts::to_batch(&[FactsRow {
                app_id: Some(format!("t{n:05}")),
                batch_id: Some(0),
                rows: Some(5),
                min_lsn: Some("0x0000002A000001A80003".into()),
                max_lsn: Some("0x0000002A000001A80009".into()),
                started_at: Some(1_700_000_000_000_000 + n as i64),
                ..FactsRow::default()
            }])?;
            let transaction = (format!("t{n:05}#facts"), 0, batch);
            tables::append_once_each(
                &mut cached,
                &url,
                TableKind::Facts,
                "facts",
                vec![transaction],
            )
            .await?;
            if (n + 1) % WINDOW == 0 {
                let millis = started.elapsed().as_secs_f64() * 1000.0 / WINDOW as f64;
                let files = cached.as_ref().map_or(0, |table| {
                    table.snapshot().map_or(0, |s| s.log_data().num_files())
                });
                println!(
                    "appends {:>5}-{:>5}: {millis:.1} ms an append; {files} live files after",
                    n + 2 - WINDOW,
                    n + 1
                );
                windows.push(millis);
                started = Instant::now();
            }
        }
        println!(
            "last {WINDOW} / first {WINDOW}, time an append: {:.2}",
            windows.last().copied().unwrap_or(0.0) / windows.first().copied().unwrap_or(1.0)
        );
        anyhow::Ok(())
    })
}
