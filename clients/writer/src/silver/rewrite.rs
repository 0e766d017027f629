//! Silver's MERGE as a copy-on-write of the files that hold a changed key.
//!
//! delta-rs' MERGE joins every file it cannot prune with the source, carries its bookkeeping
//! columns through the join and evaluates every clause per row (stack.md §2.6). Silver's
//! source is one row per key (the ranking), so the merge is a lookup instead:
//!
//! 1. the changed keys go into a hash index, as Arrow row-format bytes: composite, string and
//!    NULL keys compare as bytes, and a NULL equals a NULL (the null-safe match);
//! 2. each silver file's key columns are read and looked up; a file holding no changed key
//!    stays as it is (one integer key: a file whose statistics' key range holds no changed
//!    key is not even read);
//! 3. a file holding one is read whole and written again without the rows a change replaces
//!    or deletes (a change at least as new as the row's `_start_lsn`), followed by the new
//!    images of those keys: a key stays in the file that held it, so silver's layout (the
//!    rebuild's key order) survives the merges;
//! 4. the upserts of keys no file held go into new files, together with the small files
//!    earlier calls' inserts left (read and merged like the others): a steady cadence of
//!    calls keeps a few files, not one per call;
//! 5. one commit removes the rewritten files and adds the written ones.
//!
//! Files are rewritten concurrently, one per core, each read a row group at a time
//! ([`crate::stored_file`]) and written batch by batch.
//!
//! With deletion vectors (`delta.enableDeletionVectors = true` on silver), step 3 marks the
//! replaced and deleted rows of a file in its vector instead ([`super::deletion_vectors`]):
//! the file is added again with its new vector, and the new images of its keys go to the new
//! file with the inserts. A file with more than a quarter of its rows deleted is written
//! again whole, without them. Rows an earlier vector deleted are skipped by every read here.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, BooleanArray, StringArray, new_null_array};
use arrow::compute::{cast, filter_record_batch, interleave_record_batch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};
use deltalake::DeltaTable;
use deltalake::datafile::writer::{DeltaWriter, WriterConfig};
use deltalake::datafusion::execution::SendableRecordBatchStream;
use deltalake::kernel::transaction::CommitBuilder;
use deltalake::kernel::{Action, Add, LogicalFileView, Remove};
use deltalake::logstore::ObjectStoreRef;
use deltalake::operations::write::WriterStatsConfig;
use deltalake::parquet::arrow::ProjectionMask;
use deltalake::parquet::arrow::arrow_reader::ArrowReaderMetadata;
use deltalake::parquet::arrow::async_reader::{
    ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder,
};
use deltalake::parquet::basic::{Encoding, PageType};
use deltalake::parquet::file::metadata::ParquetMetaData;
use deltalake::parquet::schema::types::ColumnPath;
use deltalake::protocol::{DeltaOperation, SaveMode};
use deltalake::table::config::TablePropertiesExt;
use roaring::RoaringTreemap;
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use super::deletion_vectors::{self, Vectors};
use crate::error::{Result, WriterError};
use crate::stored_file::StoredFile;
use crate::tables;

/// The ranked changes, one row per key, indexed by key. A change is named by its number
/// across the ranking's batches, which are kept as they came (not copied into one).
struct Changes {
    /// Silver's columns plus `_operation`, in silver's types.
    batches: Vec<RecordBatch>,
    /// The number of each batch's first change.
    starts: Vec<u32>,
    /// Silver's columns (the part of `batches` that is written).
    silver: SchemaRef,
    keys: Vec<String>,
    key_types: Vec<DataType>,
    converter: RowConverter,
    /// Row-format key bytes → change.
    index: HashMap<Box<[u8]>, u32, ahash::RandomState>,
    lsn: StringArray,
    /// Operations 0, 2 and 4 (the row's image is written); 1 and 3 only delete.
    upsert: Vec<bool>,
}

impl Changes {
    fn new(batches: Vec<RecordBatch>, silver: SchemaRef, keys: &[String]) -> Result<Self> {
        let Some(first) = batches.first() else {
            return Err(WriterError::Internal("no changes to merge".into()));
        };
        // In silver's key types, as the files' keys are looked up: equal keys, equal bytes.
        let key_types = keys
            .iter()
            .map(|key| match silver.field_with_name(key) {
                Ok(field) => Ok(field.data_type().clone()),
                Err(_) => Ok(column(first, key)?.data_type().clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        let converter = RowConverter::new(
            key_types
                .iter()
                .map(|data_type| SortField::new(data_type.clone()))
                .collect(),
        )?;
        let too_many = || WriterError::Internal("more than 2^32 changes in one merge".into());
        let mut index = HashMap::default();
        let mut starts = Vec::with_capacity(batches.len());
        let mut lsns = Vec::with_capacity(batches.len());
        let mut upsert = Vec::new();
        let mut change = 0u32;
        for batch in &batches {
            starts.push(change);
            let encoded = converter.convert_columns(&key_columns(batch, keys, &key_types)?)?;
            for row in encoded.iter() {
                index.insert(Box::from(row.as_ref()), change);
                change = change.checked_add(1).ok_or_else(too_many)?;
            }
            lsns.push(string_column(batch, "_start_lsn")?);
            let operation = cast(column(batch, "_operation")?, &DataType::Int32)?;
            let operation = operation
                .as_any()
                .downcast_ref::<arrow::array::Int32Array>()
                .ok_or_else(|| WriterError::Internal("_operation is not an integer".into()))?;
            upsert.extend(
                operation
                    .iter()
                    .map(|operation| matches!(operation, Some(0 | 2 | 4))),
            );
        }
        let lsns: Vec<&dyn Array> = lsns.iter().map(|lsn| lsn as &dyn Array).collect();
        let lsn = arrow::compute::concat(&lsns)?
            .as_any()
            .downcast_ref::<StringArray>()
            .cloned()
            .ok_or_else(|| WriterError::Internal("_start_lsn is not text".into()))?;
        Ok(Changes {
            batches,
            starts,
            silver,
            keys: keys.to_vec(),
            key_types,
            converter,
            index,
            lsn,
            upsert,
        })
    }

    /// How many changes there are.
    fn len(&self) -> usize {
        self.upsert.len()
    }

    /// The changes of `batch`'s keys: per row of `batch`, the change holding its key.
    fn lookup(&self, batch: &RecordBatch) -> Result<Vec<Option<u32>>> {
        let encoded =
            self.converter
                .convert_columns(&key_columns(batch, &self.keys, &self.key_types)?)?;
        Ok(encoded
            .iter()
            .map(|row| self.index.get(row.as_ref()).copied())
            .collect())
    }

    /// Whether `change` replaces the silver row `row` of `lsn` (its `_start_lsn`s): only a
    /// change at least as new does (a call reapplied after a crash, or a chunk row older
    /// than the change silver holds, leaves the row).
    fn replaces(&self, change: u32, lsn: &StringArray, row: usize) -> bool {
        !lsn.is_valid(row)
            || (self.lsn.is_valid(change as usize)
                && self.lsn.value(change as usize) >= lsn.value(row))
    }

    /// The changed keys, sorted, when the key is one integer column and no change's key is
    /// NULL: a file whose statistics' key range holds none of them is not read.
    fn integer_keys(&self) -> Result<Option<(String, Vec<i64>)>> {
        let ([key], [data_type]) = (self.keys.as_slice(), self.key_types.as_slice()) else {
            return Ok(None);
        };
        if !data_type.is_integer() {
            return Ok(None);
        }
        let mut sorted = Vec::with_capacity(self.len());
        for batch in &self.batches {
            let values = cast(column(batch, key)?, &DataType::Int64)?;
            let values = values
                .as_any()
                .downcast_ref::<arrow::array::Int64Array>()
                .ok_or_else(|| WriterError::Internal(format!("{key} is not an integer")))?;
            if values.null_count() > 0 {
                return Ok(None);
            }
            sorted.extend_from_slice(values.values());
        }
        sorted.sort_unstable();
        Ok(Some((key.clone(), sorted)))
    }

    /// Silver's columns of the changes `which`.
    fn images(&self, which: Vec<u32>) -> Result<RecordBatch> {
        let places: Vec<(usize, usize)> = which
            .into_iter()
            .map(|change| {
                let batch = self.starts.partition_point(|start| *start <= change) - 1;
                (batch, (change - self.starts[batch]) as usize)
            })
            .collect();
        let batches: Vec<&RecordBatch> = self.batches.iter().collect();
        let taken = interleave_record_batch(&batches, &places)?;
        conform(&taken, &self.silver)
    }
}

/// How the writers of new files are configured (silver's own settings).
#[derive(Clone)]
pub(super) struct FileSettings {
    pub(super) store: ObjectStoreRef,
    pub(super) schema: SchemaRef,
    pub(super) target_file_size: std::num::NonZeroU64,
    stats: WriterStatsConfig,
    vectors: Vectors,
    /// Whether the merge marks rows in deletion vectors instead of writing files again.
    deletion_vectors: bool,
}

impl FileSettings {
    pub(super) fn of(table: &DeltaTable) -> Result<Self> {
        let state = table.snapshot()?;
        Ok(FileSettings {
            store: table.log_store().object_store(None),
            schema: state.snapshot().arrow_schema(),
            target_file_size: state.table_config().target_file_size(),
            stats: WriterStatsConfig::from_config(state.snapshot().table_configuration()),
            vectors: Vectors::of(table),
            deletion_vectors: deletion_vectors::enabled(table)?,
        })
    }

    pub(super) fn writer(&self) -> DeltaWriter {
        self.writer_without_dictionary(&[])
    }

    /// A silver file, read in ranges.
    pub(super) fn reader(&self, file: &LogicalFileView) -> StoredFile {
        StoredFile::new(self.store.clone(), file)
    }

    /// A writer that does not try a dictionary for `plain` columns.
    pub(super) fn writer_without_dictionary(&self, plain: &[ColumnPath]) -> DeltaWriter {
        let properties = plain
            .iter()
            .fold(tables::file_properties(), |properties, column| {
                properties.set_column_dictionary_enabled(column.clone(), false)
            });
        DeltaWriter::new(
            self.store.clone(),
            WriterConfig::new(
                self.schema.clone(),
                Vec::new(),
                Some(properties.build()),
                Some(self.target_file_size),
                None,
                self.stats.num_indexed_cols,
                self.stats.stats_columns.clone(),
            ),
        )
    }
}

/// A file smaller than the target file size over this is small: merges fold small files
/// together (the inserts of one call each) so a silver fed by a steady cadence of calls does
/// not gather thousands of files.
pub(super) const SMALL_FILE_FRACTION: u64 = 8;

/// A file with more than this fraction of its rows deleted (by its vector and this merge) is
/// written again without them instead of given a larger vector: each read of a file decodes
/// its deleted rows too.
const DELETED_FRACTION_REWRITTEN: u64 = 4;

/// What merging into one file did.
#[derive(Default)]
struct FileOutcome {
    /// The file, when it held a changed key and was written again or given a new vector.
    rewritten: Option<LogicalFileView>,
    written: Vec<Add>,
    /// The file's new deletion vector, when it is added again with it instead of written,
    /// and the file's rows (its footer's count: the stats of the file added again must say
    /// `numRecords`, which another engine's file may lack).
    vector: Option<(RoaringTreemap, u64)>,
    /// Changes whose images go to the new file (the keys whose rows the vector deletes).
    images: Vec<u32>,
    /// Change rows whose key the file held (applied there, or outranked by its row).
    held: Vec<u32>,
}

/// What a merge changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MergeCounts {
    /// Silver files read whole and written again.
    pub files_rewritten: usize,
    /// Silver files given a new deletion vector (their replaced rows marked, not rewritten).
    pub files_marked: usize,
    /// Silver files left as they were.
    pub files_kept: usize,
    /// Change rows whose key silver held.
    pub keys_found: usize,
}

/// Merges `latest` (one row per key: silver's columns and `_operation`) into `table`.
pub async fn merge(
    table: &DeltaTable,
    latest: Vec<RecordBatch>,
    keys: &[String],
) -> Result<MergeCounts> {
    let state = table.snapshot()?;
    let latest: Vec<RecordBatch> = latest
        .into_iter()
        .filter(|batch| batch.num_rows() > 0)
        .collect();
    if latest.is_empty() {
        return Ok(MergeCounts::default());
    }
    let settings = FileSettings::of(table)?;
    let changes = Arc::new(Changes::new(latest, settings.schema.clone(), keys)?);
    let (small, mut files): (Vec<LogicalFileView>, Vec<LogicalFileView>) =
        state.log_data().iter().partition(|file| {
            (file.size() as u64) < settings.target_file_size.get() / SMALL_FILE_FRACTION
        });
    // Small files (the inserts of earlier calls) are folded into one with this call's new
    // keys whenever it writes images, or when there are several.
    let compaction = if small.len() > 1 || (!small.is_empty() && changes.upsert.contains(&true)) {
        Some(tokio::spawn(compact(
            small,
            Arc::clone(&changes),
            settings.clone(),
        )))
    } else {
        files.extend(small);
        None
    };
    let integer_keys = changes.integer_keys()?;
    let parallel = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut counts = MergeCounts::default();
    let mut held = vec![false; changes.len()];
    let mut removes = Vec::new();
    let mut adds = Vec::new();
    let mut marked = Vec::new();
    let mut images = Vec::new();
    let mut running = JoinSet::new();
    let mut pending = files.into_iter();
    let mut failure = None;
    loop {
        while failure.is_none() && running.len() < parallel {
            let Some(file) = pending.next() else { break };
            if let Some((key, sorted)) = &integer_keys
                && !may_hold(&file, key, sorted)
            {
                counts.files_kept += 1;
                continue;
            }
            running.spawn(rewrite_file(file, Arc::clone(&changes), settings.clone()));
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        let outcome = match joined {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(error)) => {
                failure.get_or_insert(error);
                continue;
            }
            Err(error) => {
                failure.get_or_insert(WriterError::Internal(format!(
                    "a silver file rewrite stopped: {error}"
                )));
                continue;
            }
        };
        for row in &outcome.held {
            held[*row as usize] = true;
        }
        counts.keys_found += outcome.held.len();
        images.extend(outcome.images);
        match (outcome.rewritten, outcome.vector) {
            (Some(file), Some(vector)) => {
                counts.files_marked += 1;
                marked.push((file, vector));
            }
            (Some(file), None) => {
                counts.files_rewritten += 1;
                removes.push(file.remove_action(true));
            }
            (None, _) => counts.files_kept += 1,
        }
        adds.extend(outcome.written);
    }
    let mut writer = None;
    if let Some(compaction) = compaction {
        match compaction.await {
            Ok(Ok(compaction)) => {
                for row in &compaction.held {
                    held[*row as usize] = true;
                }
                counts.keys_found += compaction.held.len();
                counts.files_rewritten += compaction.rewritten.len();
                removes.extend(
                    compaction
                        .rewritten
                        .iter()
                        .map(|file| file.remove_action(true)),
                );
                writer = Some(compaction.writer);
            }
            Ok(Err(error)) => {
                failure.get_or_insert(error);
            }
            Err(error) => {
                failure.get_or_insert(WriterError::Internal(format!(
                    "the compaction of silver's small files stopped: {error}"
                )));
            }
        }
    }
    if let Some(error) = failure {
        // Written files are not committed; vacuum removes them.
        return Err(error);
    }
    let mut new_keys: Vec<u32> = (0..held.len())
        .filter(|row| !held[*row] && changes.upsert[*row])
        .map(|row| row as u32)
        .collect();
    new_keys.extend(images);
    if !new_keys.is_empty() {
        writer
            .get_or_insert_with(|| settings.writer())
            .write(&changes.images(new_keys)?)
            .await?;
    }
    if let Some(writer) = writer {
        adds.extend(writer.close().await?);
    }
    if !marked.is_empty() {
        let (files, vectors): (Vec<_>, Vec<(RoaringTreemap, u64)>) = marked.into_iter().unzip();
        let (vectors, rows): (Vec<_>, Vec<_>) = vectors.into_iter().unzip();
        let descriptors = deletion_vectors::write(&settings.store, vectors).await?;
        for ((file, descriptor), rows) in files.iter().zip(descriptors).zip(rows) {
            removes.push(file.remove_action(true));
            adds.push(Add {
                path: file.path().to_string(),
                partition_values: file.partition_values_map(),
                size: file.size(),
                modification_time: file.modification_time(),
                data_change: true,
                stats: Some(deletion_vectors::wide_bounds(file.stats(), rows)),
                deletion_vector: Some(descriptor),
                ..Default::default()
            });
        }
    }
    if removes.is_empty() && adds.is_empty() {
        return Ok(counts);
    }
    let predicate = keys
        .iter()
        .map(|key| format!("target.{key} <=> source.{key}"))
        .collect::<Vec<_>>()
        .join(" AND ");
    commit_merge(table, removes, adds, predicate).await?;
    Ok(counts)
}

/// [`commit`] as a `MERGE` on `predicate` (what the log shows of it).
pub(super) async fn commit_merge(
    table: &DeltaTable,
    removes: Vec<Remove>,
    adds: Vec<Add>,
    predicate: String,
) -> Result<()> {
    commit(
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
    .await
}

/// Removes `removes` and adds `adds` in one commit on the version `table` was read at, and
/// only there: a table that moved since (another engine's OPTIMIZE among others) refuses it
/// ([`tables::rewrite_commit`]), and the caller applies again.
async fn commit(
    table: &DeltaTable,
    removes: Vec<Remove>,
    adds: Vec<Add>,
    operation: DeltaOperation,
) -> Result<()> {
    let _turn = crate::owner::turn(table.table_url()).await;
    CommitBuilder::from(tables::rewrite_commit())
        .with_actions(
            removes
                .into_iter()
                .map(Action::Remove)
                .chain(adds.into_iter().map(Action::Add))
                .collect(),
        )
        .build(Some(table.snapshot()?), table.log_store(), operation)
        .await?;
    Ok(())
}

/// Whether `file` may hold one of the `sorted` keys, by its statistics' range of `key`
/// (true when it has none).
pub(super) fn may_hold(file: &LogicalFileView, key: &str, sorted: &[i64]) -> bool {
    let Some(stats) = file
        .stats()
        .and_then(|stats| serde_json::from_str::<serde_json::Value>(&stats).ok())
    else {
        return true;
    };
    let (Some(min), Some(max)) = (
        stats["minValues"][key].as_i64(),
        stats["maxValues"][key].as_i64(),
    ) else {
        return true;
    };
    let first = sorted.partition_point(|value| *value < min);
    sorted.get(first).is_some_and(|value| *value <= max)
}

/// Merges the changes into `file` when it holds a changed key: writes it again with its rows
/// no change outranks, then the new images of the keys it held, or (with deletion vectors)
/// marks the rows the changes replace.
async fn rewrite_file(
    file: LogicalFileView,
    changes: Arc<Changes>,
    settings: FileSettings,
) -> Result<FileOutcome> {
    let deleted = settings.vectors.deleted(&file).await?;
    // The key columns first: most files of a large table hold no changed key.
    let mut reader = settings.reader(&file);
    let metadata = ArrowReaderMetadata::load_async(&mut reader, Default::default()).await?;
    let builder =
        ParquetRecordBatchStreamBuilder::new_with_metadata(reader.clone(), metadata.clone());
    let mut columns = changes.keys.clone();
    if settings.deletion_vectors {
        columns.push("_start_lsn".into());
    }
    let roots = columns
        .iter()
        .map(|column| builder.schema().index_of(column))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let mut keys = builder.with_projection(mask).build()?;
    let mut marks = Marks::default();
    let mut position = 0u64;
    while let Some(batch) = keys.next().await {
        let batch = batch?;
        let found = changes.lookup(&batch)?;
        let live = |row: usize| !deleted.contains(position + row as u64);
        if !settings.deletion_vectors {
            if found
                .iter()
                .enumerate()
                .any(|(row, change)| change.is_some() && live(row))
            {
                marks.touched = true;
                break;
            }
        } else {
            let lsn = string_column(&batch, "_start_lsn")?;
            for (row, change) in found.into_iter().enumerate() {
                let Some(change) = change.filter(|_| live(row)) else {
                    continue;
                };
                marks.touched = true;
                marks.held.push(change);
                if changes.replaces(change, &lsn, row) {
                    marks.replaced.insert(position + row as u64);
                    if changes.upsert[change as usize] {
                        marks.images.push(change);
                    }
                }
            }
        }
        position += batch.num_rows() as u64;
    }
    if !marks.touched || (settings.deletion_vectors && marks.replaced.is_empty()) {
        // Without a row to replace the file stays; with vectors, the keys it held are done.
        return Ok(FileOutcome {
            held: marks.held,
            ..FileOutcome::default()
        });
    }
    if settings.deletion_vectors {
        let vector = &deleted | &marks.replaced;
        let rows = metadata.metadata().file_metadata().num_rows().max(0) as u64;
        if vector.len() * DELETED_FRACTION_REWRITTEN <= rows {
            return Ok(FileOutcome {
                rewritten: Some(file),
                vector: Some((vector, rows)),
                images: marks.images,
                held: marks.held,
                ..FileOutcome::default()
            });
        }
    }
    let mut writer = settings.writer_without_dictionary(&plain_columns(metadata.metadata()));
    let mut held = Vec::new();
    let rows = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, metadata).build()?;
    apply_to_file(
        rows,
        &deleted,
        &changes,
        &settings.schema,
        &mut writer,
        &mut held,
    )
    .await?;
    let written = writer.close().await?;
    Ok(FileOutcome {
        rewritten: Some(file),
        written,
        held,
        ..FileOutcome::default()
    })
}

/// What the key scan of one file found.
#[derive(Default)]
struct Marks {
    /// Whether a live row holds a changed key.
    touched: bool,
    /// With deletion vectors: the rows a change replaces or deletes, the changes whose images
    /// replace them and every change whose key a live row holds.
    replaced: RoaringTreemap,
    images: Vec<u32>,
    held: Vec<u32>,
}

/// The columns whose data pages the file holds without a dictionary: the writer gave it up
/// (too many distinct values: keys, amounts, times). Written again, they skip the attempt,
/// which would intern up to a dictionary page of values per row group only to drop them.
pub(super) fn plain_columns(metadata: &ParquetMetaData) -> Vec<ColumnPath> {
    let Some(group) = metadata.row_groups().first() else {
        return Vec::new();
    };
    group
        .columns()
        .iter()
        .filter(|column| {
            // The data pages' encodings (parquet-rs reads them as a mask by default).
            column
                .page_encoding_stats_mask()
                .is_some_and(|data_pages| data_pages.is_set(Encoding::PLAIN))
                || column.page_encoding_stats().is_some_and(|stats| {
                    stats.iter().any(|page| {
                        matches!(page.page_type, PageType::DATA_PAGE | PageType::DATA_PAGE_V2)
                            && page.encoding == Encoding::PLAIN
                    })
                })
        })
        .map(|column| column.column_path().clone())
        .collect()
}

/// Small files, rewritten together into one writer (then the new keys' images): each call
/// that writes images folds the small files earlier calls left into one.
struct Compaction {
    writer: DeltaWriter,
    rewritten: Vec<LogicalFileView>,
    held: Vec<u32>,
}

async fn compact(
    files: Vec<LogicalFileView>,
    changes: Arc<Changes>,
    settings: FileSettings,
) -> Result<Compaction> {
    let mut writer = settings.writer();
    let mut held = Vec::new();
    for file in &files {
        let deleted = settings.vectors.deleted(file).await?;
        let rows = ParquetRecordBatchStreamBuilder::new(settings.reader(file))
            .await?
            .build()?;
        apply_to_file(
            rows,
            &deleted,
            &changes,
            &settings.schema,
            &mut writer,
            &mut held,
        )
        .await?;
    }
    Ok(Compaction {
        writer,
        rewritten: files,
        held,
    })
}

/// Writes the rows of a silver file (`rows`, streamed from it) neither its vector (`deleted`)
/// nor a change removes into `writer`, then the new images of the keys it held; the change
/// rows whose key it held go to `held`.
async fn apply_to_file(
    mut rows: ParquetRecordBatchStream<StoredFile>,
    deleted: &RoaringTreemap,
    changes: &Changes,
    schema: &SchemaRef,
    writer: &mut DeltaWriter,
    held: &mut Vec<u32>,
) -> Result<()> {
    let mut images = Vec::new();
    let mut position = 0u64;
    while let Some(batch) = rows.next().await {
        let batch = conform(&batch?, schema)?;
        let lsn = string_column(&batch, "_start_lsn")?;
        let mut keep = Vec::with_capacity(batch.num_rows());
        for (row, change) in changes.lookup(&batch)?.into_iter().enumerate() {
            if !deleted.is_empty() && deleted.contains(position + row as u64) {
                keep.push(false);
                continue;
            }
            let Some(change) = change else {
                keep.push(true);
                continue;
            };
            held.push(change);
            let newer = changes.replaces(change, &lsn, row);
            if newer && changes.upsert[change as usize] {
                images.push(change);
            }
            keep.push(!newer);
        }
        position += batch.num_rows() as u64;
        let kept = filter_record_batch(&batch, &BooleanArray::from(keep))?;
        if kept.num_rows() > 0 {
            writer.write(&kept).await?;
        }
    }
    if !images.is_empty() {
        writer.write(&changes.images(images)?).await?;
    }
    Ok(())
}

/// Replaces every row of `table` with the rows of `rows` (a rebuild), streamed into files
/// as they come: one commit removes every file and adds the written ones. Returns the rows
/// written.
pub async fn overwrite(table: &DeltaTable, mut rows: SendableRecordBatchStream) -> Result<usize> {
    let settings = FileSettings::of(table)?;
    let mut writer = settings.writer();
    let mut written = 0;
    while let Some(batch) = rows.next().await {
        let batch = conform(&batch?, &settings.schema)?;
        written += batch.num_rows();
        if batch.num_rows() > 0 {
            writer.write(&batch).await?;
        }
    }
    let adds = writer.close().await?;
    // An emptied table's snapshot writes nothing: the removes alone empty silver.
    let removes = table
        .snapshot()?
        .log_data()
        .iter()
        .map(|file| file.remove_action(true))
        .collect();
    commit(
        table,
        removes,
        adds,
        DeltaOperation::Write {
            mode: SaveMode::Overwrite,
            partition_by: None,
            predicate: None,
        },
    )
    .await?;
    Ok(written)
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef> {
    batch
        .column_by_name(name)
        .ok_or_else(|| WriterError::Internal(format!("silver rows without column {name}")))
}

/// The key columns of `batch` in `types` (a file written before a type was widened).
fn key_columns(batch: &RecordBatch, keys: &[String], types: &[DataType]) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .zip(types)
        .map(|(key, data_type)| {
            let column = column(batch, key)?;
            if column.data_type() == data_type {
                Ok(column.clone())
            } else {
                Ok(cast(column, data_type)?)
            }
        })
        .collect()
}

fn string_column(batch: &RecordBatch, name: &str) -> Result<StringArray> {
    let column = cast(column(batch, name)?, &DataType::Utf8)?;
    Ok(column
        .as_any()
        .downcast_ref::<StringArray>()
        .ok_or_else(|| WriterError::Internal(format!("{name} is not text")))?
        .clone())
}

/// `batch` in `schema`'s columns and types: a column it lacks (silver gained one after a
/// capture-instance switch) is NULL.
pub(super) fn conform(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    if batch.schema().as_ref() == schema.as_ref() {
        return Ok(batch.clone());
    }
    let columns = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(column) if column.data_type() == field.data_type() => Ok(column.clone()),
            Some(column) => Ok(cast(column, field.data_type())?),
            None => Ok(new_null_array(field.data_type(), batch.num_rows())),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};
    use bytes::Bytes;
    use deltalake::DeltaTableError;
    use deltalake::parquet::arrow::ArrowWriter;
    use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    /// `(region, code, value, _start_lsn, _operation)`.
    type ChangeRow<'a> = (Option<&'a str>, Option<i64>, &'a str, &'a str, i32);

    /// A batch of change rows.
    fn changes(rows: &[ChangeRow<'_>]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("region", DataType::Utf8, true),
            Field::new("code", DataType::Int64, true),
            Field::new("value", DataType::Utf8, true),
            Field::new("_start_lsn", DataType::Utf8, true),
            Field::new("_operation", DataType::Int32, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter(rows.iter().map(|row| row.0))),
                Arc::new(Int64Array::from_iter(rows.iter().map(|row| row.1))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|row| row.2))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|row| row.3))),
                Arc::new(arrow::array::Int32Array::from_iter_values(
                    rows.iter().map(|row| row.4),
                )),
            ],
        )
        .expect("changes")
    }

    async fn rows_of(url: &url::Url) -> Vec<String> {
        let table = crate::tables::open(url)
            .await
            .expect("open")
            .expect("table");
        let context = deltalake::datafusion::prelude::SessionContext::new();
        context
            .register_table("t", table.table_provider().await.expect("provider"))
            .expect("register");
        let batches = context
            .sql("SELECT region, code, value FROM t")
            .await
            .expect("query")
            .collect()
            .await
            .expect("rows");
        let mut rows = Vec::new();
        for batch in &batches {
            let text = |column: usize, row: usize| {
                arrow::util::display::array_value_to_string(batch.column(column), row)
                    .expect("text")
            };
            for row in 0..batch.num_rows() {
                rows.push(format!(
                    "{}|{}|{}",
                    text(0, row),
                    text(1, row),
                    text(2, row)
                ));
            }
        }
        rows.sort();
        rows
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn composite_keys_with_nulls_match_whole_and_null_safely() {
        let dir = tempfile::tempdir().expect("temp");
        let url = url::Url::from_directory_path(dir.path()).expect("url");
        let fields = vec![
            deltalake::kernel::StructField::new(
                "region",
                deltalake::kernel::DataType::STRING,
                true,
            ),
            deltalake::kernel::StructField::new("code", deltalake::kernel::DataType::LONG, true),
            deltalake::kernel::StructField::new("value", deltalake::kernel::DataType::STRING, true),
            deltalake::kernel::StructField::new(
                "_start_lsn",
                deltalake::kernel::DataType::STRING,
                true,
            ),
        ];
        let keys = vec!["region".to_string(), "code".to_string()];
        let table = crate::tables::ensure(&url, crate::tables::TableKind::Silver, fields, "t")
            .await
            .expect("create");
        merge(
            &table,
            vec![changes(&[
                (None, Some(1), "a", "0x01", 2),
                (Some("x"), None, "b", "0x01", 2),
                (Some("x"), Some(1), "c", "0x01", 2),
                (None, None, "d", "0x01", 2),
            ])],
            &keys,
        )
        .await
        .expect("first merge");
        let table = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        let counts = merge(
            &table,
            vec![changes(&[
                (None, Some(1), "a2", "0x02", 4),
                (Some("x"), None, "", "0x02", 1),
                (None, None, "d2", "0x02", 4),
                (Some("x"), Some(2), "e", "0x02", 2),
                // Older than silver's row: left as it is (a call reapplied from behind).
                (Some("x"), Some(1), "stale", "0x00", 4),
            ])],
            &keys,
        )
        .await
        .expect("second merge");
        assert_eq!(counts.keys_found, 4, "{counts:?}");
        // Sorted as `rows_of` sorts ('|' after letters and digits).
        assert_eq!(rows_of(&url).await, ["x|1|c", "x|2|e", "|1|a2", "||d2"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_of_several_row_groups_is_read_in_ranges_and_rewritten_whole() {
        let dir = tempfile::tempdir().expect("temp");
        let (url, table) = empty_silver(&dir).await;
        // Three row groups and a bit: one file (far under the target file size).
        let rows = 3 * tables::ROW_GROUP_ROWS as i64 + 10;
        let batches = (0..rows)
            .step_by(8192)
            .map(|start| silver_rows(start..(start + 8192).min(rows), |_| "a".into()))
            .collect();
        rebuild(&table, batches).await;
        let table = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        let state = table.snapshot().expect("snapshot");
        let files: Vec<_> = state.log_data().iter().collect();
        assert_eq!(files.len(), 1);
        let mut reader = StoredFile::new(table.log_store().object_store(None), &files[0]);
        let metadata = ArrowReaderMetadata::load_async(&mut reader, Default::default())
            .await
            .expect("footer");
        assert_eq!(metadata.metadata().num_row_groups(), 4);

        // Keys in the first and the third row group, and a new one.
        let counts = merge(
            &table,
            vec![changes(&[
                (Some("x"), Some(5), "b", "0x02", 4),
                (
                    Some("x"),
                    Some(2 * tables::ROW_GROUP_ROWS as i64 + 7),
                    "",
                    "0x02",
                    1,
                ),
                (Some("x"), Some(rows), "c", "0x02", 2),
            ])],
            &["region".to_string(), "code".to_string()],
        )
        .await
        .expect("merge");
        assert_eq!(
            (counts.files_rewritten, counts.keys_found),
            (1, 2),
            "{counts:?}"
        );
        let summary = tables::query_text(
            &url,
            "SELECT COUNT(*), COUNT(DISTINCT code), SUM(CASE WHEN value = 'a' THEN 1 ELSE 0 END), \
             MAX(CASE WHEN code = 5 THEN value END), MAX(CASE WHEN code = 5 THEN _start_lsn END) \
             FROM t",
        )
        .await
        .expect("query");
        // One key deleted, one inserted; the rest once each, all but the two changed as they were.
        let expected = [
            rows.to_string(),
            rows.to_string(),
            (rows - 2).to_string(),
            "b".to_string(),
            "0x02".to_string(),
        ];
        assert_eq!(summary, [expected.map(Some).to_vec()]);
    }

    /// The `code`s of the rows `table`'s deletion vectors delete, read by delta-rs' kernel.
    async fn deleted_codes(table: &DeltaTable) -> Vec<i64> {
        use deltalake::logstore::object_store::ObjectStoreExt;
        let vectors = Vectors::of(table);
        let store = table.log_store().object_store(None);
        let mut codes = Vec::new();
        for file in table.snapshot().expect("snapshot").log_data().iter() {
            let deleted = vectors.deleted(&file).await.expect("vector");
            if deleted.is_empty() {
                continue;
            }
            let bytes = store
                .get(&file.object_store_path())
                .await
                .expect("get")
                .bytes()
                .await
                .expect("bytes");
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
                .expect("parquet")
                .build()
                .expect("reader");
            let mut position = 0u64;
            for batch in reader {
                let batch = batch.expect("batch");
                let code = batch
                    .column_by_name("code")
                    .expect("code")
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .expect("int64")
                    .clone();
                for row in 0..batch.num_rows() {
                    if deleted.contains(position + row as u64) {
                        codes.push(code.value(row));
                    }
                }
                position += batch.num_rows() as u64;
            }
        }
        codes.sort_unstable();
        codes
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_deletion_vectors_a_merge_marks_the_rows_it_replaces_and_readers_skip_them() {
        let dir = tempfile::tempdir().expect("temp");
        let (url, table) = empty_silver(&dir).await;
        // Files of 500 rows (a batch each, over the 4 KiB target), none of them small.
        let table = table
            .set_tbl_properties()
            .with_properties(
                [
                    (deletion_vectors::PROPERTY.to_string(), "true".to_string()),
                    ("delta.targetFileSize".to_string(), "4096".to_string()),
                ]
                .into(),
            )
            .await
            .expect("properties");
        assert!(deletion_vectors::enabled(&table).expect("protocol"));
        let batches = (0..4)
            .map(|file| silver_rows(file * 500..(file + 1) * 500, |code| format!("{code:0>40}")))
            .collect();
        rebuild(&table, batches).await;
        let open = || async { crate::tables::open(&url).await.expect("open").expect("t") };
        let files = open()
            .await
            .snapshot()
            .expect("snapshot")
            .log_data()
            .iter()
            .count();
        assert_eq!(files, 4);
        let keys = ["region".to_string(), "code".to_string()];
        let value = |code: i64| format!("x|{code}|{code:0>40}");

        let counts = merge(
            &open().await,
            vec![changes(&[
                (Some("x"), Some(10), "b", "0x02", 4),
                (Some("x"), Some(600), "", "0x02", 1),
                // Older than silver's row: left as it is.
                (Some("x"), Some(700), "stale", "0x00", 4),
                (Some("x"), Some(5000), "new", "0x02", 2),
            ])],
            &keys,
        )
        .await
        .expect("first merge");
        assert_eq!(
            (
                counts.files_marked,
                counts.files_rewritten,
                counts.keys_found
            ),
            (2, 0, 3),
            "{counts:?}"
        );
        let table = open().await;
        assert_eq!(deleted_codes(&table).await, [10, 600]);
        let mut expected: Vec<String> = (0..2000)
            .filter(|code| ![10, 600].contains(code))
            .map(value)
            .chain(["x|10|b".to_string(), "x|5000|new".to_string()])
            .collect();
        expected.sort();
        assert_eq!(
            rows_of(&url).await,
            expected,
            "delta-rs' scan skips marked rows"
        );

        // Key 10's live row is now in the new file: its marked row is not found again, and
        // the vector of the first file grows by key 11.
        let counts = merge(
            &table,
            vec![changes(&[
                (Some("x"), Some(10), "c", "0x03", 4),
                (Some("x"), Some(11), "d", "0x03", 4),
            ])],
            &keys,
        )
        .await
        .expect("second merge");
        assert_eq!(counts.keys_found, 2, "{counts:?}");
        let table = open().await;
        assert_eq!(deleted_codes(&table).await, [10, 11, 600]);
        let rows = rows_of(&url).await;
        assert_eq!(rows.len(), 2000);
        for row in ["x|10|c", "x|11|d", "x|5000|new"] {
            assert_eq!(rows.iter().filter(|r| *r == row).count(), 1, "{row}");
        }
        assert!(!rows.contains(&"x|10|b".to_string()));

        // Past a quarter of its rows deleted, the third file is written again without them.
        let deletes: Vec<ChangeRow> = (1000..1200)
            .map(|code| (Some("x"), Some(code), "", "0x04", 1))
            .collect();
        let counts = merge(&table, vec![changes(&deletes)], &keys)
            .await
            .expect("third merge");
        assert_eq!(
            (counts.files_marked, counts.files_rewritten),
            (0, 1),
            "{counts:?}"
        );
        let table = open().await;
        assert_eq!(deleted_codes(&table).await, [10, 11, 600]);
        let rows = rows_of(&url).await;
        assert_eq!(rows.len(), 1800);
        assert!(rows.contains(&value(1200)) && !rows.contains(&value(1199)));
    }

    /// Silver's columns of the keys `("x", code)` for `codes`, each with `value(code)`, at
    /// `_start_lsn` 0x01.
    fn silver_rows(codes: std::ops::Range<i64>, value: impl Fn(i64) -> String) -> RecordBatch {
        let silver = changes(&[])
            .project(&[0, 1, 2, 3])
            .expect("columns")
            .schema();
        RecordBatch::try_new(
            silver,
            vec![
                Arc::new(StringArray::from_iter_values(codes.clone().map(|_| "x"))),
                Arc::new(Int64Array::from_iter_values(codes.clone())),
                Arc::new(StringArray::from_iter_values(codes.clone().map(value))),
                Arc::new(StringArray::from_iter_values(codes.map(|_| "0x01"))),
            ],
        )
        .expect("silver rows")
    }

    /// Rebuilds `table` from `batches`, streamed as a rebuild's ranked rows are.
    async fn rebuild(table: &DeltaTable, batches: Vec<RecordBatch>) {
        let schema = batches.first().expect("a batch").schema();
        let stream = deltalake::datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
            schema,
            futures::stream::iter(batches.into_iter().map(Ok)),
        );
        overwrite(table, Box::pin(stream)).await.expect("rebuild");
    }

    /// An empty silver of `(region, code, value, _start_lsn)` in `dir`, and its url.
    async fn empty_silver(dir: &tempfile::TempDir) -> (url::Url, DeltaTable) {
        let url = url::Url::from_directory_path(dir.path()).expect("url");
        let field =
            |name: &str, data_type| deltalake::kernel::StructField::new(name, data_type, true);
        let fields = vec![
            field("region", deltalake::kernel::DataType::STRING),
            field("code", deltalake::kernel::DataType::LONG),
            field("value", deltalake::kernel::DataType::STRING),
            field("_start_lsn", deltalake::kernel::DataType::STRING),
        ];
        let table = crate::tables::ensure(&url, crate::tables::TableKind::Silver, fields, "t")
            .await
            .expect("create");
        (url, table)
    }

    /// A silver of three small files (keys 1-3, one append each), its url and key columns.
    async fn silver_of_three_files(dir: &tempfile::TempDir) -> (url::Url, Vec<String>) {
        let (url, mut table) = empty_silver(dir).await;
        for code in 1..=3 {
            let row = changes(&[(Some("x"), Some(code), "a", "0x01", 2)]);
            let row = row.project(&[0, 1, 2, 3]).expect("silver's columns");
            table = table.write(vec![row]).await.expect("append");
        }
        (url, vec!["region".to_string(), "code".to_string()])
    }

    /// Whether `result` is a refused commit (which `retry_conflicts` runs again).
    fn refused(result: &Result<impl std::fmt::Debug>) -> bool {
        matches!(
            result,
            Err(WriterError::Delta(DeltaTableError::Transaction { .. }))
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_merge_or_rebuild_read_before_another_engines_optimize_does_not_commit() {
        // delta-rs's own conflict check refuses the merge here (the compacted file is an
        // added file its read of the whole table should have seen) but lets the rebuild's
        // overwrite through, which would leave the compacted file's old rows beside the
        // rebuilt ones.
        let dir = tempfile::tempdir().expect("temp");
        let (url, keys) = silver_of_three_files(&dir).await;
        let read_before = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        let (_, metrics) = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table")
            .optimize()
            .await
            .expect("another engine's OPTIMIZE");
        assert_eq!(metrics.num_files_removed, 3);
        let update = changes(&[(Some("x"), Some(2), "b", "0x02", 4)]);
        let merged = merge(&read_before, vec![update.clone()], &keys).await;
        assert!(refused(&merged), "{merged:?}");
        let schema = update.schema();
        let rebuild = deltalake::datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
            schema,
            futures::stream::iter([Ok(update.clone())]),
        );
        let rebuilt = overwrite(&read_before, Box::pin(rebuild)).await;
        assert!(refused(&rebuilt), "{rebuilt:?}");
        assert_eq!(
            rows_of(&url).await,
            ["x|1|a", "x|2|a", "x|3|a"],
            "nothing committed"
        );
        // Read again, the merge goes through.
        let fresh = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        merge(&fresh, vec![update], &keys).await.expect("merge");
        assert_eq!(rows_of(&url).await, ["x|1|a", "x|2|b", "x|3|a"]);
    }

    #[test]
    fn a_column_that_outgrew_its_dictionary_is_written_again_without_one() {
        let rows = 300_000;
        let schema = Arc::new(Schema::new(vec![
            Field::new("order_id", DataType::Int64, false),
            Field::new("status", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|row| ["new", "paid", "shipped"][row as usize % 3]),
                )),
            ],
        )
        .expect("batch");
        let mut file = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut file, schema, None).expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let builder =
            ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file)).expect("read back");
        let plain: Vec<String> = plain_columns(builder.metadata())
            .iter()
            .map(|column| column.string())
            .collect();
        assert_eq!(plain, vec!["order_id".to_string()]);
    }
}
