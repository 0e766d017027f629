//! Maintenance keeps a month of polls to a few files, on a fast clock, losing nothing.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use common::{Lab, bronze_rows, facts_batches};
use deltalake::operations::vacuum::Clock;
use mssql_cdc_writer::maintenance::{self, MaintenanceOptions};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tables::TableKind;

/// The wall clock moved `offset` milliseconds ahead: a simulated day passes in an instant.
#[derive(Debug, Default)]
struct FastClock {
    offset: AtomicI64,
}

impl FastClock {
    fn advance_days(&self, days: i64) {
        self.offset.fetch_add(days * 86_400_000, Ordering::Relaxed);
    }
}

impl Clock for FastClock {
    fn current_timestamp_millis(&self) -> i64 {
        chrono::Utc::now().timestamp_millis() + self.offset.load(Ordering::Relaxed)
    }
}

/// Files under a table's directory: (data files, `_delta_log` files).
fn file_counts(table: &Path) -> (usize, usize) {
    fn count(dir: &Path, log: bool, counts: &mut (usize, usize)) {
        for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
            let path = entry.path();
            let in_log = log || entry.file_name() == "_delta_log";
            if path.is_dir() {
                count(&path, in_log, counts);
            } else if in_log {
                counts.1 += 1;
            } else {
                counts.0 += 1;
            }
        }
    }
    let mut counts = (0, 0);
    count(table, false, &mut counts);
    counts
}

/// A month (33 days of a fast clock) of polls of one table, each day's followed by a
/// maintenance pass: each table keeps fewer small files than `min_files`, the files VACUUM
/// keeps for its week, and a log of at most 30 days of commits (the default
/// `delta.logRetentionDuration`); a day without maintenance leaves a file per poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_of_polls_stays_a_few_files_per_table_and_loses_nothing() {
    const DAYS: usize = 33;
    const POLLS_PER_DAY: usize = 5;
    let lab = Lab::new().await;
    let mut config = lab.config();
    config.max_commits = Some(2);
    let mut stream = Stream::connect(config.clone()).await.expect("connect");
    let clock = Arc::new(FastClock::default());
    let options = MaintenanceOptions {
        min_files: 4,
        clock: clock.clone(),
        ..MaintenanceOptions::default()
    };
    let tables = [
        (lab.lake("bronze_orders"), TableKind::Bronze),
        (lab.lake("facts"), TableKind::Facts),
        (lab.lake("control"), TableKind::Control),
    ];
    let mut batches = 0;
    // Per table: the most data and log files seen, the table's version after each day.
    let mut most = vec![(0, 0); tables.len()];
    let mut versions = vec![vec![0u64]; tables.len()];
    let mut logs_removed = vec![0; tables.len()];
    for day in 0..DAYS {
        for poll in 0..POLLS_PER_DAY {
            lab.workload((1000 + day * POLLS_PER_DAY + poll) as u64, 2);
            batches += usize::from(stream.run_batch(None).await.expect("batch").is_some());
        }
        if day == 0 {
            for (location, _) in &tables[..2] {
                let (data, log) = file_counts(Path::new(location));
                assert!(
                    data >= POLLS_PER_DAY && log >= POLLS_PER_DAY,
                    "{location}: a file per poll"
                );
            }
        }
        clock.advance_days(1);
        for (index, (location, kind)) in tables.iter().enumerate() {
            let done = maintenance::maintain(location, *kind, &options)
                .await
                .expect("maintain")
                .expect("a table");
            assert!(done.files_after < options.min_files, "{done:?}");
            let (data, log) = file_counts(Path::new(location));
            most[index] = (most[index].0.max(data), most[index].1.max(log));
            versions[index].push(done.checkpoint_version.expect("a checkpoint"));
            logs_removed[index] += done.log_files_removed;
        }
    }
    assert_eq!(batches, DAYS * POLLS_PER_DAY, "every poll brought a batch");
    for (index, (location, kind)) in tables.iter().enumerate() {
        let (data, log) = most[index];
        let per_day = versions[index]
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .max()
            .expect("days") as usize;
        println!(
            "{}: at most {data} data and {log} log files; {} commits in {DAYS} days, at most \
             {per_day} a day; {} log files removed",
            kind.name(),
            versions[index].last().expect("a version"),
            logs_removed[index]
        );
        // The small files of a day, what compaction wrote, and the files VACUUM keeps a week
        // (day 8 of a week's retention comes before its pass).
        assert!(
            data <= 8 * (POLLS_PER_DAY + 1) + options.min_files,
            "{location}: {data} data files"
        );
        assert!(log <= 31 * per_day + 31 + 1, "{location}: {log} log files");
        // At the end, the commit files of the last 31 days at most (the checkpoint before
        // the retention's start is the oldest file kept), a checkpoint a day, _last_checkpoint.
        let (_, log_now) = file_counts(Path::new(location));
        let recent = (versions[index][DAYS] - versions[index][DAYS - 31]) as usize;
        assert!(
            log_now <= recent + 31 + 1,
            "{location}: {log_now} log files, {recent} recent commits"
        );
    }
    assert!(
        logs_removed[..2].iter().all(|removed| *removed > 0),
        "after 30 days the log is cleaned: {logs_removed:?}"
    );
    // A month later: nothing lost, nothing doubled, and the stream goes on.
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), lab.committed());
    assert_eq!(facts_batches(&lab).await.len(), batches);
    lab.workload(7, 5);
    let mut again = Stream::connect(config).await.expect("connect");
    while again.run_batch(None).await.expect("batch").is_some() {}
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), lab.committed());
}

/// One small facts batch of `app_id`.
fn facts_row(app_id: &str) -> arrow::record_batch::RecordBatch {
    mssql_cdc_writer::facts::to_batch(&[mssql_cdc_writer::facts::FactsRow {
        app_id: Some(app_id.to_string()),
        batch_id: Some(0),
        rows: Some(1),
        ..Default::default()
    }])
    .expect("a facts batch")
}

/// An appender of one small commit at a time keeps the table's live files under
/// `AUTO_COMPACT_FILES` by compacting after its own commits, while maintenance passes
/// compact the same table next to it: every row and every application transaction stays,
/// once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_compact_themselves_next_to_maintenance_and_lose_nothing() {
    use mssql_cdc_writer::maintenance::AUTO_COMPACT_FILES;
    use mssql_cdc_writer::tables;

    let dir = tempfile::tempdir().expect("temp dir");
    let location = dir.path().join("facts").display().to_string();
    let url = tables::table_url(&location).expect("url");
    let maintaining = {
        let location = location.clone();
        tokio::spawn(async move {
            let options = MaintenanceOptions {
                min_files: 2,
                ..MaintenanceOptions::default()
            };
            let mut passes = 0;
            for _ in 0..20 {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                if maintenance::maintain(&location, TableKind::Facts, &options)
                    .await
                    .expect("maintain")
                    .is_some()
                {
                    passes += 1;
                }
            }
            passes
        })
    };
    // Appends next to the maintenance passes, then alone: the files live after each of
    // the appends alone (no pass compacted them).
    let mut cached = None;
    let mut most_files = 0;
    let (mut appends, mut alone) = (0, 0);
    while alone < 2 * AUTO_COMPACT_FILES {
        let n = appends;
        appends += 1;
        let passes_over = maintaining.is_finished();
        let app_id = format!("t{n:03}#facts");
        let written = tables::append_once_each(
            &mut cached,
            &url,
            TableKind::Facts,
            "facts",
            vec![(app_id, 0, facts_row(&format!("t{n:03}")))],
        )
        .await
        .expect("append");
        assert_eq!(written, [true]);
        if passes_over {
            alone += 1;
            let table = cached.as_ref().expect("the appender's table");
            let files = table.snapshot().expect("snapshot").log_data().num_files();
            most_files = most_files.max(files);
        }
    }
    let passes = maintaining.await.expect("maintenance task");
    assert!(passes > 0, "maintenance ran next to the appends");
    // Compacted files plus fewer than AUTO_COMPACT_FILES small ones.
    assert!(
        most_files <= AUTO_COMPACT_FILES + 2,
        "{most_files} live files while appending alone"
    );
    let table = tables::open(&url).await.expect("open").expect("a table");
    let rows = tables::query_table_text(&table, "SELECT app_id, COUNT(*) FROM t GROUP BY app_id")
        .await
        .expect("query");
    assert_eq!(rows.len(), appends, "every batch's row");
    assert!(
        rows.iter().all(|row| row[1].as_deref() == Some("1")),
        "each once"
    );
    for n in 0..appends {
        let app_id = format!("t{n:03}#facts");
        assert!(
            tables::holds_transaction(&table, &app_id, 0)
                .await
                .expect("transaction"),
            "{app_id}"
        );
    }
    // A batch appended again is left out, compaction or not.
    let written = tables::append_once_each(
        &mut None,
        &url,
        TableKind::Facts,
        "facts",
        vec![("t000#facts".to_string(), 0, facts_row("t000"))],
    )
    .await
    .expect("append again");
    assert_eq!(written, [false]);
}

/// Two `maintain` processes started together on a facts table of 40 one-row files, in
/// rounds: each round leaves every row once. Before compactions carried their own
/// application transaction, both processes' OPTIMIZEs landed on the same files and every
/// row was there twice (the issue saw it in 15 rounds of 15).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_maintain_processes_at_once_double_no_row() {
    use deltalake::protocol::SaveMode;
    use mssql_cdc_writer::tables;

    let dir = tempfile::tempdir().expect("temp dir");
    for round in 0..6 {
        let location = dir.path().join(format!("facts_{round}"));
        let location = location.display().to_string();
        let url = tables::table_url(&location).expect("url");
        let mut table = tables::ensure(&url, TableKind::Facts, TableKind::Facts.fields(), "facts")
            .await
            .expect("facts");
        // Plain appends: the writer's own appends would compact at 32 small files.
        for n in 0..40 {
            table = table
                .write(vec![facts_row(&format!("t{n:02}"))])
                .with_save_mode(SaveMode::Append)
                .await
                .expect("append");
        }
        let maintain = || {
            std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
                .args(["maintain", "--location", &location, "--kind", "facts"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("maintain")
        };
        let (first, second) = (maintain(), maintain());
        for child in [first, second] {
            let output = child.wait_with_output().expect("wait");
            assert!(
                output.status.success(),
                "maintain failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let rows = tables::query_text(&url, "SELECT count(*), count(DISTINCT app_id) FROM t")
            .await
            .expect("count");
        assert_eq!(
            rows,
            [[Some("40".to_string()), Some("40".to_string())]],
            "round {round}: every row once"
        );
        let table = tables::open(&url).await.expect("open").expect("table");
        let files = table.snapshot().expect("snapshot").log_data().num_files();
        assert!(files < 40, "round {round}: compacted ({files} files)");
    }
}

/// The deletion vector files in silver's directory.
fn vector_files(silver: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(silver)
        .expect("silver")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "bin"))
        .collect()
}

/// A deletion vector written long ago and replaced by a merge within the retention is still
/// read by the versions before that merge: VACUUM keeps it. delta-rs judges such a file by
/// its age alone, and deleted it (the read of the older version then failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vacuum_keeps_a_replaced_deletion_vector_the_retention_still_reads() {
    use mssql_cdc_writer::silver::apply_changes;
    use mssql_cdc_writer::tables;

    let lab = Lab::new().await;
    lab.workload(1, 800);
    let config = lab.config();
    let mut apply = common::orders_apply_config(&lab);
    apply.deletion_vectors = true;
    common::run_now(config.clone()).await;
    apply_changes(&apply).await.expect("apply");
    // Files of a few KiB are not small then: merges mark them instead of folding them.
    let url = tables::table_url(&apply.target).expect("url");
    tables::open(&url)
        .await
        .expect("open")
        .expect("silver")
        .set_tbl_properties()
        .with_properties(std::collections::HashMap::from([(
            "delta.targetFileSize".to_string(),
            "1024".to_string(),
        )]))
        .await
        .expect("target file size");
    // Two merges of a few updates each: the first gives silver's file a vector, the second
    // replaces it with a larger one.
    let update = mssql_cdc_flight::sim::workload::Mix {
        insert: 0.0,
        update: 1.0,
        delete: 0.0,
        key_update: 0.0,
        idle: 0.0,
    };
    common::orders_workload(&lab, 2, 5, update);
    common::run_now(config.clone()).await;
    apply_changes(&apply).await.expect("apply");
    let marked = tables::open(&url).await.expect("open").expect("silver");
    let marked_version = marked.version().expect("version");
    let rows_then = tables::query_table_text(&marked, "SELECT count(*) FROM t")
        .await
        .expect("count");
    assert_eq!(
        vector_files(&apply.target).len(),
        1,
        "the first merge's vector"
    );
    common::orders_workload(&lab, 3, 5, update);
    common::run_now(config).await;
    apply_changes(&apply).await.expect("apply");
    let vectors = vector_files(&apply.target);
    assert_eq!(vectors.len(), 2, "the second merge replaced the vector");
    // Both vectors written more than the retention ago; the first replaced just now.
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(8 * 24 * 3600);
    for path in &vectors {
        std::fs::File::options()
            .write(true)
            .open(path)
            .expect("vector file")
            .set_modified(long_ago)
            .expect("mtime");
    }
    maintenance::maintain(
        &apply.target,
        TableKind::Silver,
        &MaintenanceOptions::default(),
    )
    .await
    .expect("maintain");
    assert_eq!(vector_files(&apply.target).len(), 2, "both vectors kept");
    let mut then = tables::open(&url).await.expect("open").expect("silver");
    then.load_version(marked_version)
        .await
        .expect("the version before the second merge");
    let rows = tables::query_table_text(&then, "SELECT count(*) FROM t")
        .await
        .expect("the older version reads its vector");
    assert_eq!(rows, rows_then);
}
