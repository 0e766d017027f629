//! `apply_history` against the SCD type 2 MERGE a user of the Python `deltalake` package
//! would write over the same bronze.
//!
//! A simulated `dbo.orders` of `BENCH_HISTORY_ROWS` rows (default 10,000,000) is streamed into
//! bronze and applied to history (every row one current version; untimed). Then
//! `BENCH_HISTORY_CHANGES` changes (default rows / 10: 70% updates, 20% inserts, 10% deletes,
//! keys uniform) are committed and streamed, history is copied, and both apply them from the
//! same starting table, each in its own process:
//!
//! - **apply_history**: `mssql-cdc-writer history` (every column tracked);
//! - **Python MERGE**: the script below (`deltalake` 1.x): the changes past the position from
//!   bronze by SQL, one image per key and commit, the next commit's LSN per key by `LEAD`
//!   (the end of each version), then a MERGE ending each changed key's current version at its
//!   first change, and an append of the new versions. Two commits, not one; no tracked
//!   columns, no snapshots, no replays: the least a user would write.
//!
//! Reported: seconds and peak RSS (`VmHWM`, read every 10 ms) of each, and their ratio
//! (target ≤ 0.3). Both end with the same rows (checked: versions per key and current count).
//!
//! `MSSQL_CDC_PYTHON` (default the repository's `.venv`) runs the script.
//! `cargo bench -p mssql-cdc-writer --bench history`.

mod common;

use std::path::Path;
use std::time::Instant;

use mssql_cdc_flight::sim::{SimWriter, sample};
use mssql_cdc_flight::source::TableName;
use mssql_cdc_writer::control::Granularity;
use mssql_cdc_writer::silver::history::{HistoryConfig, Tracked, apply_history};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tables;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The user's SCD type 2 over bronze: argv = bronze, history, the position (applied LSN).
const PYTHON_MERGE: &str = r#"
import sys
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder, write_deltalake

bronze, history, applied = sys.argv[1], sys.argv[2], sys.argv[3]
target = DeltaTable(history)
columns = [f.name for f in target.schema().fields]
captured = [c for c in columns if not c.startswith("__")]
query = QueryBuilder().register("bronze", DeltaTable(bronze))
# One image per key and commit (the last row of the commit), the next commit of the key.
steps = f"""
    WITH rows AS (
        SELECT *, ROW_NUMBER() OVER (PARTITION BY order_id, _start_lsn
            ORDER BY _command_id DESC, _seqval DESC, _operation DESC) AS n
        FROM bronze WHERE _operation <> 0 AND _start_lsn > '{applied}'),
    commits AS (SELECT * FROM rows WHERE n = 1)
    SELECT *, LEAD(_start_lsn) OVER (PARTITION BY order_id ORDER BY _start_lsn) AS next_lsn,
        LEAD(_commit_ts) OVER (PARTITION BY order_id ORDER BY _start_lsn) AS next_ts,
        LEAD(_operation) OVER (PARTITION BY order_id ORDER BY _start_lsn) AS next_op,
        ROW_NUMBER() OVER (PARTITION BY order_id ORDER BY _start_lsn) AS k
    FROM commits"""
select = ", ".join(f'"{c}"' for c in captured)
versions = query.execute(f"""
    SELECT {select}, _start_lsn AS __valid_from, _commit_ts AS __valid_from_ts,
        next_lsn AS __valid_to, next_ts AS __valid_to_ts, next_lsn IS NULL AS __is_current,
        CASE WHEN next_op IS NULL THEN NULL WHEN next_op IN (1, 3) THEN 'delete'
            ELSE 'update' END AS __ended_by
    FROM ({steps}) WHERE _operation IN (2, 4)""").read_all()
firsts = query.execute(f"""
    SELECT order_id, _start_lsn AS first_lsn, _commit_ts AS first_ts,
        CASE WHEN _operation IN (1, 3) THEN 'delete' ELSE 'update' END AS first_end
    FROM ({steps}) WHERE k = 1""").read_all()
target.merge(
    source=firsts,
    predicate="t.order_id = s.order_id AND t.__is_current",
    source_alias="s",
    target_alias="t",
).when_matched_update(
    updates={
        "__is_current": "false",
        "__valid_to": "s.first_lsn",
        "__valid_to_ts": "s.first_ts",
        "__ended_by": "s.first_end",
    }
).execute()
# Bronze's column comments are not history's: the rows go in without them.
versions = pa.table(versions).select(columns)
versions = pa.Table.from_arrays(versions.columns, names=versions.column_names)
write_deltalake(history, versions, mode="append")
"#;

fn history_command(config: &HistoryConfig) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
    command
        .args([
            "history",
            "--table",
            &config.table,
            "--bronze",
            &config.bronze,
        ])
        .args(["--target", &config.target, "--keys", &config.keys.join(",")])
        .args(["--control", &config.control, "--facts", &config.facts])
        .args(["--granularity", "minute"]);
    command
}

fn python() -> std::path::PathBuf {
    std::env::var_os("MSSQL_CDC_PYTHON").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"),
        Into::into,
    )
}

/// Commits `changes` changes: 70% updates, 20% inserts, 10% deletes of uniform random keys.
fn change(writer: &mut SimWriter, table: &TableName, changes: u64) -> anyhow::Result<()> {
    let mut done = 0u64;
    while done < changes {
        let batch = (changes - done).min(10_000);
        let mut tx = writer.begin();
        let updates = tx.random_keys(table, (batch * 7 / 10) as usize)?;
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

/// `(versions, current versions, keys)` of a history table.
async fn shape(location: &str) -> anyhow::Result<Vec<Option<String>>> {
    let rows = tables::query_text(
        &tables::table_url(location)?,
        "SELECT COUNT(*), SUM(CASE WHEN __is_current THEN 1 ELSE 0 END), \
         COUNT(DISTINCT order_id) FROM t",
    )
    .await?;
    Ok(rows.into_iter().next().unwrap_or_default())
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("warn");
    let rows = common::env_number("BENCH_HISTORY_ROWS", 10_000_000);
    let changes = common::env_number("BENCH_HISTORY_CHANGES", rows / 10);
    let temporary = tempfile::tempdir()?;
    let base = temporary.path();
    let (db, writer) = common::orders_database(base, rows)?;
    let table = sample::orders().table;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let server = common::start_server(&db).await?;
        let lake = |name: &str| base.join("lake").join(name).display().to_string();
        let (stream, _) = common::orders_lake(base, &server.url);
        let config = HistoryConfig {
            table: table.to_string(),
            bronze: lake("bronze"),
            target: lake("history"),
            capture_instance: None,
            keys: vec!["order_id".into()],
            control: lake("control"),
            facts: lake("facts"),
            granularity: Granularity::Minute,
            tracked: Tracked::All,
        };
        Stream::connect(stream.clone()).await?.run_available_now().await?;
        let started = Instant::now();
        let first = apply_history(&config).await?;
        let load_seconds = started.elapsed().as_secs_f64();
        let applied = first
            .applied_lsn
            .map(|lsn| lsn.to_string())
            .unwrap_or_default();

        let mut writer = writer;
        change(&mut writer, &table, changes)?;
        Stream::connect(stream.clone()).await?.run_available_now().await?;
        copy_dir(&base.join("lake").join("history"), &base.join("lake").join("python"))?;
        common::settle()?;

        let (ours, rss_ours) = common::run_measured(history_command(&config)).await?;
        common::settle()?;
        let mut python_command = tokio::process::Command::new(python());
        python_command
            .args(["-c", PYTHON_MERGE])
            .args([&lake("bronze"), &lake("python"), &applied]);
        let (theirs, rss_theirs) = common::run_measured(python_command).await?;
        let (ours_shape, theirs_shape) = (shape(&lake("history")).await?, shape(&lake("python")).await?);
        anyhow::ensure!(
            ours_shape == theirs_shape,
            "the two histories differ: (versions, current, keys) {ours_shape:?} against {theirs_shape:?}"
        );
        println!(
            "| history rows before | changes | initial load s | apply_history s (peak RSS MiB) | Python deltalake MERGE s (peak RSS MiB) | ratio |"
        );
        println!("|---|---|---|---|---|---|");
        println!(
            "| {rows} | {changes} | {load_seconds:.1} | {ours:.1} ({rss_ours:.0}) | {theirs:.1} ({rss_theirs:.0}) | {:.2} |",
            ours / theirs
        );
        println!("versions, current, keys after: {ours_shape:?}");
        server.stop().await?;
        anyhow::Ok(())
    })
}
