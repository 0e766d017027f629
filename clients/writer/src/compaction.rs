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
//! delta-rs' conflict check refuses a commit when a commit since its read carries an app id
//! the commit carries too: so of two compactions read at one version the second one refuses,
//! whichever files it picked, while the appends it meets (each with its own app id) let it
//! through. A concurrent removal with `dataChange = true` of one of its files (a rewrite, a
//! MERGE) is refused by the same check (`ConcurrentDeleteDelete`). A refused compaction
//! deletes the files it wrote; the next one starts from the table as it is then.

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::sync::{Arc, LazyLock, Mutex};

use arrow::array::{ArrayRef, new_null_array};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use deltalake::DeltaTable;
use deltalake::datafile::writer::{DeltaWriter, WriterConfig};
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake::kernel::{Action, Transaction};
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::logstore::object_store::path::Path;
use deltalake::operations::write::WriterStatsConfig;
use deltalake::parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;
use deltalake::protocol::DeltaOperation;
use futures::TryStreamExt;

use crate::error::Result;
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
        let key = table.table_url().as_str().trim_end_matches('/').to_string();
        let mut compacting = COMPACTING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        compacting.insert(key.clone()).then_some(Compacting(key))
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
        .filter(|file| {
            (file.size() as u64) < bins.small_below && file.deletion_vector_descriptor().is_none()
        })
        .count())
}

/// Compacts `table` as `bins` says; the files folded (0 when there were too few, or this
/// process is compacting the table already). A commit refused because another commit removed
/// one of the files, or another compaction landed since the read, is an error
/// (`DeltaTableError::Transaction`): nothing of this compaction is in the table, and the
/// files it wrote are deleted.
pub async fn compact(table: &DeltaTable, bins: Bins) -> Result<u64> {
    let Some(_mark) = Compacting::start(table) else {
        return Ok(0);
    };
    let snapshot = table.snapshot()?;
    let files: Vec<_> = snapshot
        .log_data()
        .iter()
        .filter(|file| {
            (file.size() as u64) < bins.small_below && file.deletion_vector_descriptor().is_none()
        })
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
    let read_version = i64::try_from(table.version().unwrap_or(0)).unwrap_or(i64::MAX - 1);
    let actions: Vec<Action> = files
        .iter()
        .map(|file| Action::Remove(file.remove_action(false)))
        .chain(adds.iter().cloned().map(Action::Add))
        .collect();
    let properties = CommitProperties::default()
        .with_application_transaction(Transaction::new(COMPACTION_APP_ID, read_version + 1));
    let turn = crate::owner::turn(table.table_url()).await;
    let committed = CommitBuilder::from(properties)
        .with_actions(actions)
        .build(
            Some(snapshot),
            table.log_store(),
            DeltaOperation::Optimize {
                predicate: None,
                target_size: bins.target.get() as i64,
            },
        )
        .await;
    drop(turn);
    if let Err(error) = committed {
        for add in &adds {
            let path = Path::from(add.path.as_str());
            if let Err(error) = store.delete(&path).await {
                tracing::debug!(%error, path = %add.path, "a refused compaction's file stays for VACUUM");
            }
        }
        return Err(error.into());
    }
    Ok(files.len() as u64)
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
            Some(column) => Ok(arrow::compute::cast(column, field.data_type())?),
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
        for batch_id in 0..files {
            let row = crate::facts::FactsRow {
                app_id: Some("orders".into()),
                batch_id: Some(batch_id),
                ..crate::facts::FactsRow::default()
            };
            let batch = crate::facts::to_batch(&[row]).expect("batch");
            tables::append_once(&url, TableKind::Facts, "facts", "orders", batch_id, batch)
                .await
                .expect("append");
        }
        url
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
        let refused = compact(&second, BINS).await;
        assert!(
            matches!(
                refused,
                Err(crate::error::WriterError::Delta(
                    deltalake::DeltaTableError::Transaction { .. }
                ))
            ),
            "{refused:?}"
        );
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
    async fn a_compaction_lets_appends_since_its_read_through_and_keeps_their_rows() {
        let dir = tempfile::tempdir().expect("temp");
        let url = facts_of_small_files(&dir, 10).await;
        let read = tables::open(&url).await.expect("open").expect("table");
        for batch_id in 10..13 {
            let row = crate::facts::FactsRow {
                app_id: Some("orders".into()),
                batch_id: Some(batch_id),
                ..crate::facts::FactsRow::default()
            };
            let batch = crate::facts::to_batch(&[row]).expect("batch");
            tables::append_once(&url, TableKind::Facts, "facts", "orders", batch_id, batch)
                .await
                .expect("append");
        }
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
