//! History's write: a copy-on-write of the files holding a current row the fold replaced,
//! and the new version rows, in one commit.
//!
//! Ended versions never change, so only files holding a current row of a changed key are
//! read whole and written again without it (one integer key: a file whose statistics' key
//! range holds no changed key is not read at all); every other file stays. The version rows
//! go into one new file together with the small files earlier calls left (under an eighth of
//! the target file size), so a steady cadence of calls keeps a few files. History has no
//! deletion vectors (its table features refuse them), so a file's rows are all live.

use std::sync::Arc;

use arrow::array::{Array, BooleanArray};
use arrow::compute::filter_record_batch;
use arrow::record_batch::RecordBatch;
use deltalake::DeltaTable;
use deltalake::datafile::writer::DeltaWriter;
use deltalake::kernel::{Add, LogicalFileView};
use deltalake::parquet::arrow::ProjectionMask;
use deltalake::parquet::arrow::arrow_reader::ArrowReaderMetadata;
use deltalake::parquet::arrow::async_reader::{
    ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder,
};
use deltalake::protocol::DeltaOperation;
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use super::super::rewrite::{self, FileSettings, SMALL_FILE_FRACTION};
use super::versions::KeyIndex;
use crate::error::{Result, WriterError};
use crate::stored_file::StoredFile;

/// What a write changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Files read whole and written again (a replaced current row, or small).
    pub files_rewritten: usize,
    /// Files left as they were.
    pub files_kept: usize,
    /// Current rows replaced.
    pub rows_replaced: usize,
}

/// Replaces the current rows of `index.replaced`'s keys in `table` and adds `versions`.
pub(super) async fn replace(
    table: &DeltaTable,
    index: KeyIndex,
    versions: RecordBatch,
) -> Result<WriteCounts> {
    let settings = FileSettings::of(table)?;
    let index = Arc::new(index);
    let state = table.snapshot()?;
    let small_size = settings.target_file_size.get() / SMALL_FILE_FRACTION;
    let (small, files): (Vec<LogicalFileView>, Vec<LogicalFileView>) = state
        .log_data()
        .iter()
        .partition(|file| (file.size() as u64) < small_size);
    let mut counts = WriteCounts::default();
    let mut removes = Vec::new();
    let mut adds: Vec<Add> = Vec::new();
    let parallel = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut running = JoinSet::new();
    let mut pending = files.into_iter();
    let mut failure = None;
    loop {
        while failure.is_none() && running.len() < parallel && !index.replaced.is_empty() {
            let Some(file) = pending.next() else { break };
            if let Some(sorted) = &index.integers
                && !rewrite::may_hold(&file, &index.keys[0], sorted)
            {
                counts.files_kept += 1;
                continue;
            }
            running.spawn(rewrite_file(file, Arc::clone(&index), settings.clone()));
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        match joined {
            Ok(Ok(Some((file, written, replaced)))) => {
                counts.files_rewritten += 1;
                counts.rows_replaced += replaced;
                removes.push(file.remove_action(true));
                adds.extend(written);
            }
            Ok(Ok(None)) => counts.files_kept += 1,
            Ok(Err(error)) => {
                failure.get_or_insert(error);
            }
            Err(error) => {
                failure.get_or_insert(WriterError::Internal(format!(
                    "a history file rewrite stopped: {error}"
                )));
            }
        }
    }
    if let Some(error) = failure {
        // Written files are not committed; vacuum removes them.
        return Err(error);
    }
    counts.files_kept += pending.len();
    // The new versions, with the small files folded in when there is something to write or
    // several of them.
    if versions.num_rows() > 0 || small.len() > 1 {
        let mut writer = settings.writer();
        for file in &small {
            let rows = ParquetRecordBatchStreamBuilder::new(settings.reader(file))
                .await?
                .build()?;
            counts.rows_replaced += without_replaced(rows, &index, &settings, &mut writer).await?;
            counts.files_rewritten += 1;
            removes.push(file.remove_action(true));
        }
        if versions.num_rows() > 0 {
            writer
                .write(&rewrite::conform(&versions, &settings.schema)?)
                .await?;
        }
        adds.extend(writer.close().await?);
    } else {
        counts.files_kept += small.len();
    }
    if removes.is_empty() && adds.is_empty() {
        return Ok(counts);
    }
    let predicate = index
        .keys
        .iter()
        .map(|key| format!("target.{key} <=> source.{key}"))
        .chain(["target.__is_current".to_string()])
        .collect::<Vec<_>>()
        .join(" AND ");
    rewrite::commit(
        table,
        removes,
        adds,
        DeltaOperation::Merge {
            predicate: None,
            merge_predicate: Some(predicate),
            matched_predicates: Vec::new(),
            not_matched_predicates: Vec::new(),
            not_matched_by_source_predicates: Vec::new(),
        },
    )
    .await?;
    Ok(counts)
}

/// Writes `file` again without the current rows of replaced keys, when it holds one: the
/// file, what was written and how many rows were replaced.
async fn rewrite_file(
    file: LogicalFileView,
    index: Arc<KeyIndex>,
    settings: FileSettings,
) -> Result<Option<(LogicalFileView, Vec<Add>, usize)>> {
    // The key columns and `__is_current` first: most files hold no replaced row.
    let reader = settings.reader(&file);
    let mut probe = reader.clone();
    let metadata = ArrowReaderMetadata::load_async(&mut probe, Default::default()).await?;
    let builder =
        ParquetRecordBatchStreamBuilder::new_with_metadata(reader.clone(), metadata.clone());
    let roots = index
        .keys
        .iter()
        .map(String::as_str)
        .chain(["__is_current"])
        .map(|column| builder.schema().index_of(column))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let mut keys = builder.with_projection(mask).build()?;
    let mut holds = false;
    while let Some(batch) = keys.next().await {
        if replaced_rows(&batch?, &index)?.true_count() > 0 {
            holds = true;
            break;
        }
    }
    if !holds {
        return Ok(None);
    }
    let rows = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, metadata).build()?;
    let mut writer = settings.writer();
    let replaced = without_replaced(rows, &index, &settings, &mut writer).await?;
    Ok(Some((file, writer.close().await?, replaced)))
}

/// Writes the rows of a file's stream but the current rows of replaced keys into `writer`;
/// returns how many those were.
async fn without_replaced(
    mut rows: ParquetRecordBatchStream<StoredFile>,
    index: &KeyIndex,
    settings: &FileSettings,
    writer: &mut DeltaWriter,
) -> Result<usize> {
    let mut replaced = 0;
    while let Some(batch) = rows.next().await {
        let batch = rewrite::conform(&batch?, &settings.schema)?;
        let drop = replaced_rows(&batch, index)?;
        replaced += drop.true_count();
        let batch = filter_record_batch(&batch, &arrow::compute::not(&drop)?)?;
        if batch.num_rows() > 0 {
            writer.write(&batch).await?;
        }
    }
    Ok(replaced)
}

/// Which rows of `batch` are the current row of a replaced key.
fn replaced_rows(batch: &RecordBatch, index: &KeyIndex) -> Result<BooleanArray> {
    if index.replaced.is_empty() {
        return Ok(BooleanArray::from(vec![false; batch.num_rows()]));
    }
    let current = batch
        .column_by_name("__is_current")
        .and_then(|column| column.as_any().downcast_ref::<BooleanArray>())
        .ok_or_else(|| WriterError::Internal("history file without __is_current".into()))?;
    let keys = index.rows(batch)?;
    Ok((0..batch.num_rows())
        .map(|row| {
            Some(
                current.is_valid(row)
                    && current.value(row)
                    && index.replaced.contains(keys.row(row).as_ref()),
            )
        })
        .collect())
}
