//! Compaction: a table's small files bin-packed into larger ones, in a commit that no other
//! compaction of the same files can also land.
//!
//! delta-rs' OPTIMIZE (1.1) commits with up to 15 retries, and its conflict check ignores
//! removes with `dataChange = false`: two OPTIMIZEs of the same files, read at one version,
//! both commit, and every row of those files is then in the table twice (seen with two
//! `maintain` passes, and with a maintenance pass beside a stream's own compaction). It also
//! ignores the commit properties it is given, so it cannot be told to commit only on the
//! version it read. This module compacts itself instead:
//!
//! 1. it picks the table's files smaller than `small_below` (none with a deletion vector)
//!    once there are `min_files` of them,
//! 2. reads them (a row group at a time, [`crate::stored_file`]) and writes their rows,
//!    conformed to the table's schema, into files of about `target` bytes, and
//! 3. commits the removes and adds (`dataChange = false`: readers of the change log see no
//!    change) with an application transaction of [`COMPACTION_APP_ID`].
//!
//! The commit goes in only on the version the compaction read (no delta-rs retry: its
//! conflict check ignores a concurrent removal with `dataChange = false`, so it let two
//! compactions of the same files both land, ours or another engine's OPTIMIZE). When the
//! table moved, the compaction reads the commits since: one that removed any of its files
//! (whatever its `dataChange`), or another compaction of ours (its transaction), refuses it;
//! appends let it commit again on the newer version. A refused compaction deletes the files
//! it wrote that the table does not reference; the next one starts from the table as it is
//! then. Another engine's OPTIMIZE committing *after* ours is that engine's conflict check to
//! make (Spark's refuses a concurrent delete of one file whatever its `dataChange`; delta-rs'
//! OPTIMIZE, an older release of this writer's among them, does not).

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::sync::{Arc, LazyLock, Mutex};

use arrow::array::{ArrayRef, new_null_array};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use deltalake::datafile::writer::{DeltaWriter, WriterConfig};
use deltalake::kernel::transaction::{
    CommitBuilder, CommitConflictError, CommitProperties, TransactionError,
};
use deltalake::kernel::{Action, LogicalFileView, Transaction};
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::logstore::object_store::path::Path;
use deltalake::operations::write::WriterStatsConfig;
use deltalake::parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;
use deltalake::protocol::DeltaOperation;
use deltalake::{DeltaTable, DeltaTableError};
use futures::TryStreamExt;

use crate::error::{Result, WriterError};
use crate::stored_file::StoredFile;

/// The app id of the application transaction every compaction commit carries (its version:
/// the table version it was read at, plus one).
pub const COMPACTION_APP_ID: &str = "mssql_cdc.compaction";

/// The tables this process is compacting now: a second compaction of one of them (a
/// maintenance pass beside a stream's auto-compaction) leaves it to the first instead of
/// writing files its commit would be refused for.
static COMPACTING: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

/// The mark of a table being compacted in this process, removed when dropped.
struct Compacting(String);

impl Compacting {
    fn start(table: &DeltaTable) -> Option<Compacting> {
        let key = crate::owner::key(table.table_url());
        let started = COMPACTING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(key.clone());
        // Built only when this call marked the table: a mark dropped here would lock the set
        // it is held under, and unmark the compaction running.
        started.then(|| Compacting(key))
    }
}

impl Drop for Compacting {
    fn drop(&mut self) {
        COMPACTING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.0);
    }
}

/// What to compact: files under `small_below` bytes, into files of about `target`, once there
/// are `min_files` of them.
#[derive(Clone, Copy, Debug)]
pub struct Bins {
    /// Files smaller than this are compacted.
    pub small_below: u64,
    /// The size the new files are written to.
    pub target: NonZeroU64,
    /// Compact only once this many small files are there (at least 2).
    pub min_files: usize,
}

/// The files of `table` a compaction with `bins` would fold.
pub fn small_files(table: &DeltaTable, bins: Bins) -> Result<usize> {
    Ok(table
        .snapshot()?
        .log_data()
        .iter()
        .filter(|file| bins.folds(file))
        .count())
}

impl Bins {
    /// Whether a compaction with these bins folds `file`: small, without a deletion vector.
    fn folds(&self, file: &LogicalFileView) -> bool {
        (file.size() as u64) < self.small_below && file.deletion_vector_descriptor().is_none()
    }
}

/// Compacts `table` as `bins` says; the files folded: 0 when there were too few, when this
/// process is compacting the table already, or when the commit was refused because another
/// commit removed one of the files or another compaction landed since the read (nothing of
/// this compaction is in the table then, and the files it wrote are deleted: the other one
/// did the work, or the next compaction starts from the table as it is).
pub async fn compact(table: &DeltaTable, bins: Bins) -> Result<u64> {
    let Some(_mark) = Compacting::start(table) else {
        return Ok(0);
    };
    let snapshot = table.snapshot()?;
    let files: Vec<_> = snapshot
        .log_data()
        .iter()
        .filter(|file| bins.folds(file))
        .collect();
    if files.len() < bins.min_files.max(2) {
        return Ok(0);
    }
    let schema = snapshot.snapshot().arrow_schema();
    let store = table.log_store().object_store(None);
    let stats = WriterStatsConfig::from_config(snapshot.snapshot().table_configuration());
    let config = WriterConfig::new(
        Arc::clone(&schema),
        Vec::new(),
        Some(crate::tables::file_properties().build()),
        Some(bins.target),
        None,
        stats.num_indexed_cols,
        stats.stats_columns.clone(),
    );
    let mut writer = DeltaWriter::new(Arc::clone(&store), config);
    for file in &files {
        let reader = StoredFile::new(Arc::clone(&store), file);
        let mut rows = ParquetRecordBatchStreamBuilder::new(reader)
            .await?
            .build()?;
        while let Some(batch) = rows.try_next().await? {
            writer.write(&conformed(&batch, &schema)?).await?;
        }
    }
    let mut adds = writer.close().await?;
    for add in &mut adds {
        add.data_change = false;
    }
    let read_version = table.version().unwrap_or(0);
    let removes: Vec<_> = files.iter().map(|file| file.remove_action(false)).collect();
    let removed: HashSet<String> = removes.iter().map(|remove| remove.path.clone()).collect();
    let actions: Vec<Action> = removes
        .into_iter()
        .map(Action::Remove)
        .chain(adds.iter().cloned().map(Action::Add))
        .collect();
    let transaction = i64::try_from(read_version + 1).unwrap_or(i64::MAX);
    let operation = DeltaOperation::Optimize {
        predicate: None,
        target_size: bins.target.get() as i64,
    };
    match commit_checked(table, actions, transaction, &removed, operation).await {
        Ok(Committed::Landed) => Ok(files.len() as u64),
        Ok(Committed::Refused(conflict)) => {
            tracing::debug!(table = %table.table_url(), ?conflict,
                "compaction refused: its files were removed or compacted since it read them");
            delete_unreferenced(table, &adds).await;
            Ok(0)
        }
        Err(error) => {
            delete_unreferenced(table, &adds).await;
            Err(error)
        }
    }
}

/// How a compaction's commit ended.
enum Committed {
    Landed,
    /// A commit since the read removed one of its files or compacted.
    Refused(CommitConflictError),
}

/// How many times a compaction checks the commits that landed since its read and commits
/// again on the newer version before it gives up (a busy bronze gains a commit per batch).
const COMMIT_ATTEMPTS: usize = 30;

/// Commits `actions` (a compaction's removes and adds, and its transaction) on the version
/// `table` was read at, and only there (no delta-rs retry, whose conflict check ignores a
/// concurrent removal with `dataChange = false`, another engine's OPTIMIZE among them). When
/// the table moved, the commits since are read: one that removed a file of `removed`, or
/// another compaction of ours, refuses this one; otherwise it commits on the newer version.
async fn commit_checked(
    table: &DeltaTable,
    actions: Vec<Action>,
    transaction: i64,
    removed: &HashSet<String>,
    operation: DeltaOperation,
) -> Result<Committed> {
    let mut base = table.clone();
    for _ in 0..COMMIT_ATTEMPTS {
        let properties = CommitProperties::default()
            .with_max_retries(0)
            .with_application_transaction(Transaction::new(COMPACTION_APP_ID, transaction));
        let turn = crate::owner::turn(table.table_url()).await;
        let committed = CommitBuilder::from(properties)
            .with_actions(actions.clone())
            .build(Some(base.snapshot()?), base.log_store(), operation.clone())
            .await;
        drop(turn);
        let error = match committed {
            Ok(_) => return Ok(Committed::Landed),
            Err(error) => error,
        };
        let from = base.version().unwrap_or(0);
        base.update_incremental(None).await?;
        let to = base.version().unwrap_or(0);
        if to <= from {
            return Err(error.into());
        }
        if let Some(conflict) = conflict_since(&base, from + 1, to, removed).await? {
            return Ok(Committed::Refused(conflict));
        }
    }
    Err(WriterError::Delta(DeltaTableError::Transaction {
        source: TransactionError::MaxCommitAttempts(COMMIT_ATTEMPTS as i32),
    }))
}

/// What of commits `from..=to` refuses a compaction of the files `removed`: one of them
/// removed (by any commit, whatever its `dataChange`), or another compaction of ours.
async fn conflict_since(
    table: &DeltaTable,
    from: u64,
    to: u64,
    removed: &HashSet<String>,
) -> Result<Option<CommitConflictError>> {
    let store = table.log_store();
    for version in from..=to {
        let Some(bytes) = store.read_commit_entry(version).await? else {
            continue;
        };
        for line in bytes.split(|byte| *byte == b'\n') {
            let Ok(action) = serde_json::from_slice::<serde_json::Value>(line) else {
                continue;
            };
            if action["remove"]["path"]
                .as_str()
                .is_some_and(|path| removed.contains(path))
            {
                return Ok(Some(CommitConflictError::ConcurrentDeleteDelete));
            }
            if action["txn"]["appId"].as_str() == Some(COMPACTION_APP_ID) {
                return Ok(Some(CommitConflictError::ConcurrentTransaction));
            }
        }
    }
    Ok(None)
}

/// Deletes the files a compaction wrote that the table (loaded again) does not reference: a
/// commit refused before it landed left them orphans. After an error raised once the commit
/// was in (a failed post-commit checkpoint, a lost response to a conditional put) the table
/// references them, and they stay; when the table cannot be loaded, every file stays for
/// VACUUM.
async fn delete_unreferenced(table: &DeltaTable, adds: &[deltalake::kernel::Add]) {
    let Ok(Some(latest)) = crate::tables::open(table.table_url()).await else {
        return;
    };
    let Ok(snapshot) = latest.snapshot() else {
        return;
    };
    let referenced: HashSet<String> = snapshot
        .log_data()
        .iter()
        .map(|file| file.path().to_string())
        .collect();
    let store = table.log_store().object_store(None);
    for add in adds.iter().filter(|add| !referenced.contains(&add.path)) {
        if let Err(error) = store.delete(&Path::from(add.path.as_str())).await {
            tracing::debug!(%error, path = %add.path, "a refused compaction's file stays for VACUUM");
        }
    }
}

/// `batch` with the columns of `schema`, in its order and types: a column the file predates
/// (bronze gains columns with a capture instance's) is NULL, one stored with another
/// representation of the type is cast.
fn conformed(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let columns = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(column) if column.data_type() == field.data_type() => Ok(Arc::clone(column)),
            // Unsafe casts: a value that does not convert is an error, never a NULL.
            Some(column) => Ok(arrow::compute::cast_with_options(
                column,
                field.data_type(),
                &arrow::compute::CastOptions {
                    safe: false,
                    ..Default::default()
                },
            )?),
            None => Ok(new_null_array(field.data_type(), batch.num_rows())),
        })
        .collect::<Result<Vec<ArrayRef>>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::{self, TableKind};

    /// A facts table of `files` one-row files.
    async fn facts_of_small_files(dir: &tempfile::TempDir, files: i64) -> url::Url {
        let location = dir.path().join("facts");
        let url = tables::table_url(location.to_str().expect("utf-8")).expect("url");
        append_batches(&url, 0..files).await;
        url
    }

    /// Appends one one-row facts file per batch id of `ids`.
    async fn append_batches(url: &url::Url, ids: std::ops::Range<i64>) {
        for batch_id in ids {
            let row = crate::facts::FactsRow {
                app_id: Some("orders".into()),
                batch_id: Some(batch_id),
                ..crate::facts::FactsRow::default()
            };
            let batch = crate::facts::to_batch(&[row]).expect("batch");
            tables::append_once(url, TableKind::Facts, "facts", "orders", batch_id, batch)
                .await
                .expect("append");
        }
    }

    async fn batch_ids(url: &url::Url) -> Vec<i64> {
        let rows = tables::query_text(url, "SELECT batch_id FROM t ORDER BY batch_id")
            .await
            .expect("query");
        rows.into_iter()
            .map(|row| row[0].as_deref().expect("id").parse().expect("number"))
            .collect()
    }

    const BINS: Bins = Bins {
        small_below: 1 << 20,
        target: NonZeroU64::new(8 << 20).expect("nonzero"),
        min_files: 2,
    };

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_compactions_read_at_one_version_land_once_and_double_nothing() {
        let dir = tempfile::tempdir().expect("temp");
        let url = facts_of_small_files(&dir, 20).await;
        // Two processes' compactions, read at one version: each is its own table handle and
        // (as another process's would) bypasses this process's mark.
        let first = tables::open(&url).await.expect("open").expect("table");
        let second = tables::open(&url).await.expect("open").expect("table");
        let folded = compact(&first, BINS).await.expect("the first lands");
        assert_eq!(folded, 20);
        let refused = compact(&second, BINS).await.expect("refused, not failed");
        assert_eq!(refused, 0, "the second compaction is refused");
        assert_eq!(batch_ids(&url).await, (0..20).collect::<Vec<_>>());
        let table = tables::open(&url).await.expect("open").expect("table");
        assert_eq!(
            table.snapshot().expect("snapshot").log_data().num_files(),
            1
        );
        // The refused compaction's file was deleted: only the table's files are on disk.
        let parquet = std::fs::read_dir(dir.path().join("facts"))
            .expect("dir")
            .filter(|entry| {
                entry
                    .as_ref()
                    .is_ok_and(|entry| entry.path().extension().is_some_and(|e| e == "parquet"))
            })
            .count();
        assert_eq!(
            parquet, 21,
            "20 small files (removed, kept for readers) and one compacted"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_engines_optimize_since_the_read_refuses_the_compaction() {
        // delta-rs' own conflict check lets the compaction land after the OPTIMIZE (their
        // removes are dataChange = false), which doubled every row.
        let dir = tempfile::tempdir().expect("temp");
        let url = facts_of_small_files(&dir, 12).await;
        let read = tables::open(&url).await.expect("open").expect("table");
        let (_, metrics) = tables::open(&url)
            .await
            .expect("open")
            .expect("table")
            .optimize()
            .await
            .expect("another engine's OPTIMIZE");
        assert_eq!(metrics.num_files_removed, 12);
        let refused = compact(&read, BINS).await.expect("refused, not failed");
        assert_eq!(refused, 0, "the compaction is refused");
        assert_eq!(batch_ids(&url).await, (0..12).collect::<Vec<_>>());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compaction_lets_appends_since_its_read_through_and_keeps_their_rows() {
        let dir = tempfile::tempdir().expect("temp");
        let url = facts_of_small_files(&dir, 10).await;
        let read = tables::open(&url).await.expect("open").expect("table");
        append_batches(&url, 10..13).await;
        assert_eq!(compact(&read, BINS).await.expect("lands after appends"), 10);
        assert_eq!(batch_ids(&url).await, (0..13).collect::<Vec<_>>());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn files_written_before_a_column_was_added_compact_with_it_null() {
        let dir = tempfile::tempdir().expect("temp");
        let url = facts_of_small_files(&dir, 3).await;
        let table = tables::open(&url).await.expect("open").expect("table");
        let extra = deltalake::kernel::StructField::new(
            "added_later",
            deltalake::kernel::DataType::LONG,
            true,
        );
        let (table, added) = tables::add_missing_columns(table, &[extra], "facts")
            .await
            .expect("column");
        assert_eq!(added, ["added_later"]);
        assert_eq!(compact(&table, BINS).await.expect("compacts"), 3);
        let rows = tables::query_text(&url, "SELECT count(*), count(added_later) FROM t")
            .await
            .expect("query");
        assert_eq!(rows, [[Some("3".to_string()), Some("0".to_string())]]);
    }
}
