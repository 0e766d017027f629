//! History's write: each touched key folded where its current row is, in one pass over the
//! files, and one commit.
//!
//! Ended versions never change, so a file is read whole and written again only when it holds
//! the current row of a key whose versions the events change: that row goes, the key's
//! versions follow the file's other rows (a key stays in the file that held it). Every file
//! has its key columns, `__is_current` and `__valid_to` read first (one integer key: a file
//! whose statistics' key range holds no touched key is not read at all); a file holding no
//! touched key's current row stays. Keys with no current row anywhere (new keys, keys whose
//! last version ended) are folded after the pass, from the newest end their ended versions
//! have, and go into one new file together with the small files earlier calls left (under an
//! eighth of the target file size), so a steady cadence of calls keeps a few files. History
//! has no deletion vectors (its table features refuse them): a file's rows are all live.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow::array::{Array, BooleanArray, UInt32Array};
use arrow::compute::{concat_batches, filter_record_batch, take_record_batch};
use arrow::record_batch::RecordBatch;
use deltalake::DeltaTable;
use deltalake::kernel::{Add, LogicalFileView};
use deltalake::parquet::arrow::ProjectionMask;
use deltalake::parquet::arrow::arrow_reader::ArrowReaderMetadata;
use deltalake::parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use super::super::rewrite::{self, FileSettings, SMALL_FILE_FRACTION};
use super::fold::{At, KeyState};
use super::snapshots::Facts;
use super::versions::{Events, current_version, string_column};
use crate::error::{Result, WriterError};

/// What a write changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Files read whole and written again (a replaced current row, or small).
    pub files_rewritten: usize,
    /// Files left as they were.
    pub files_kept: usize,
    /// Keys whose versions changed.
    pub keys_changed: usize,
    /// Version rows written (current rows replaced, new versions).
    pub versions_written: usize,
}

/// What the pass over one file found and did.
#[derive(Default)]
struct FileOutcome {
    /// The file, when it was written again, and what was written.
    rewritten: Option<LogicalFileView>,
    written: Vec<Add>,
    /// Touched keys whose current row the file holds (folded here).
    current: Vec<Box<[u8]>>,
    /// Touched keys' ended versions' ends in the file.
    ends: Vec<(Box<[u8]>, String)>,
    keys_changed: usize,
    versions_written: usize,
}

/// Folds `events` into `table` and commits.
pub(super) async fn apply(
    table: &DeltaTable,
    events: Arc<Events>,
    facts: Arc<Facts>,
    times: Arc<HashMap<String, i64>>,
) -> Result<WriteCounts> {
    let settings = FileSettings::of(table)?;
    let state = table.snapshot()?;
    let small_size = settings.target_file_size.get() / SMALL_FILE_FRACTION;
    let (small, files): (Vec<LogicalFileView>, Vec<LogicalFileView>) = state
        .log_data()
        .iter()
        .partition(|file| (file.size() as u64) < small_size);
    let mut counts = WriteCounts::default();
    let mut removes = Vec::new();
    let mut adds: Vec<Add> = Vec::new();
    let mut current: HashSet<Box<[u8]>> = HashSet::new();
    let mut ends: HashMap<Box<[u8]>, String> = HashMap::new();
    let mut absorb = |outcome: FileOutcome,
                      counts: &mut WriteCounts,
                      removes: &mut Vec<_>,
                      adds: &mut Vec<Add>| {
        match &outcome.rewritten {
            Some(file) => {
                counts.files_rewritten += 1;
                removes.push(file.remove_action(true));
            }
            None => counts.files_kept += 1,
        }
        adds.extend(outcome.written);
        counts.keys_changed += outcome.keys_changed;
        counts.versions_written += outcome.versions_written;
        current.extend(outcome.current);
        for (key, end) in outcome.ends {
            let newest = ends.entry(key).or_default();
            if end > *newest {
                *newest = end;
            }
        }
    };
    let parallel = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut running = JoinSet::new();
    let mut pending = files.into_iter();
    let mut failure = None;
    loop {
        while failure.is_none() && running.len() < parallel {
            let Some(file) = pending.next() else { break };
            if let Some(sorted) = &events.integers
                && !rewrite::may_hold(&file, &events.index.keys[0], sorted)
            {
                counts.files_kept += 1;
                continue;
            }
            running.spawn(fold_file(
                file,
                Arc::clone(&events),
                Arc::clone(&facts),
                Arc::clone(&times),
                settings.clone(),
            ));
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        match joined {
            Ok(Ok(outcome)) => absorb(outcome, &mut counts, &mut removes, &mut adds),
            Ok(Err(error)) => {
                failure.get_or_insert(error);
            }
            Err(error) => {
                failure.get_or_insert(WriterError::Internal(format!(
                    "a history file's fold stopped: {error}"
                )));
            }
        }
    }
    if let Some(error) = failure {
        // Written files are not committed; vacuum removes them.
        return Err(error);
    }
    // The small files, read whole into one new file with the keys no file holds current (a
    // call that changes nothing commits nothing: their copies are orphans for VACUUM).
    let mut writer = settings.writer();
    for file in small {
        let (rows, outcome) =
            fold_rows(read_whole(&settings, &file).await?, &events, &facts, &times)?;
        for batch in [rows.0, rows.1] {
            if batch.num_rows() > 0 {
                writer.write(&batch).await?;
            }
        }
        absorb(
            FileOutcome {
                rewritten: Some(file),
                ..outcome
            },
            &mut counts,
            &mut removes,
            &mut adds,
        );
    }
    let (versions, keys) = events.fold_from_nothing(&facts, &times, &ends, &current)?;
    counts.keys_changed += keys;
    counts.versions_written += versions.num_rows();
    if versions.num_rows() > 0 {
        writer
            .write(&rewrite::conform(&versions, &settings.schema)?)
            .await?;
    }
    adds.extend(writer.close().await?);
    if counts.keys_changed == 0 {
        // Nothing to change (a replay): no commit, the small files' copies are orphans.
        return Ok(counts);
    }
    let predicate = events
        .index
        .keys
        .iter()
        .map(|key| format!("target.{key} <=> source.{key}"))
        .chain(["target.__is_current".to_string()])
        .collect::<Vec<_>>()
        .join(" AND ");
    rewrite::commit_merge(table, removes, adds, predicate).await?;
    Ok(counts)
}

/// One file: its touched keys' ends, and, when it holds a touched key's current row whose
/// versions change, the file written again with them.
async fn fold_file(
    file: LogicalFileView,
    events: Arc<Events>,
    facts: Arc<Facts>,
    times: Arc<HashMap<String, i64>>,
    settings: FileSettings,
) -> Result<FileOutcome> {
    // The key columns, `__is_current` and `__valid_to` first: most files hold no touched key.
    let reader = settings.reader(&file);
    let mut probe = reader.clone();
    let metadata = ArrowReaderMetadata::load_async(&mut probe, Default::default()).await?;
    let plain = rewrite::plain_columns(metadata.metadata());
    let builder =
        ParquetRecordBatchStreamBuilder::new_with_metadata(reader.clone(), metadata.clone());
    let roots = events
        .index
        .keys
        .iter()
        .map(String::as_str)
        .chain(["__is_current", "__valid_to"])
        .map(|column| builder.schema().index_of(column))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let mut scan = builder.with_projection(mask).build()?;
    let mut outcome = FileOutcome::default();
    while let Some(batch) = scan.next().await {
        let touched = Touched::of(&batch?, &events)?;
        outcome
            .current
            .extend(touched.current.iter().map(|row| touched.key(*row)));
        outcome.ends.extend(touched.ends);
    }
    if outcome.current.is_empty() {
        return Ok(outcome);
    }
    let rows = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, metadata)
        .build()?
        .collect::<std::result::Result<Vec<_>, _>>()
        .await?;
    let batch = concat_batches(&settings.schema, &rows_in(&rows, &settings)?)?;
    let ((kept, versions), folded) = fold_rows(batch, &events, &facts, &times)?;
    if folded.keys_changed == 0 {
        // Nothing changed for the keys it holds: the file stays.
        return Ok(FileOutcome {
            current: outcome.current,
            ends: outcome.ends,
            ..FileOutcome::default()
        });
    }
    let mut writer = settings.writer_without_dictionary(&plain);
    for batch in [kept, versions] {
        if batch.num_rows() > 0 {
            writer.write(&batch).await?;
        }
    }
    Ok(FileOutcome {
        rewritten: Some(file),
        written: writer.close().await?,
        current: outcome.current,
        ends: outcome.ends,
        keys_changed: folded.keys_changed,
        versions_written: folded.versions_written,
    })
}

/// What a batch of history rows holds of the touched keys.
struct Touched {
    /// The key bytes of every row.
    keys: arrow::row::Rows,
    /// The rows that are a touched key's current version.
    current: Vec<u32>,
    /// The touched keys' ended versions' ends.
    ends: Vec<(Box<[u8]>, String)>,
}

impl Touched {
    fn of(batch: &RecordBatch, events: &Events) -> Result<Self> {
        let keys = events.index.rows(batch)?;
        let current = current_column(batch)?;
        let ends = string_column(batch, "__valid_to")?;
        let mut touched = Touched {
            current: Vec::new(),
            ends: Vec::new(),
            keys,
        };
        for row in 0..batch.num_rows() {
            let key = touched.keys.row(row);
            if !events.touches(key.as_ref()) {
                continue;
            }
            if current.is_valid(row) && current.value(row) {
                touched.current.push(row as u32);
            } else if ends.is_valid(row) {
                let end = ends.value(row).to_string();
                touched.ends.push((Box::from(key.as_ref()), end));
            }
        }
        Ok(touched)
    }

    fn key(&self, row: u32) -> Box<[u8]> {
        Box::from(self.keys.row(row as usize).as_ref())
    }
}

/// Folds the touched keys whose current row `batch` (a whole file, in history's columns)
/// holds: the batch's rows but the changed keys' current ones, and those keys' versions;
/// what changed, the touched keys' current rows and ends.
#[allow(clippy::type_complexity)]
fn fold_rows(
    batch: RecordBatch,
    events: &Events,
    facts: &Facts,
    times: &HashMap<String, i64>,
) -> Result<((RecordBatch, RecordBatch), FileOutcome)> {
    // The touched keys' current rows, taken out: only they are compared with the events.
    let mut touched = Touched::of(&batch, events)?;
    let mut outcome = FileOutcome {
        ends: std::mem::take(&mut touched.ends),
        ..FileOutcome::default()
    };
    let currents = take_record_batch(&batch, &UInt32Array::from(touched.current.clone()))?;
    let local = events.local(&currents)?;
    let mut keep = vec![true; batch.num_rows()];
    let mut versions = Vec::new();
    for (at_row, row) in touched.current.iter().enumerate() {
        let key = touched.key(*row);
        let at = At {
            batch: events.local_batch(),
            row: at_row,
        };
        let state = KeyState {
            current: Some(current_version(&currents, at_row, at)?),
            last_end: None,
        };
        if let Some(folded) = events.fold(&key, state, Some(&local), facts, times) {
            outcome.keys_changed += 1;
            versions.extend(folded);
            keep[*row as usize] = false;
        }
        outcome.current.push(key);
    }
    let kept = filter_record_batch(&batch, &BooleanArray::from(keep))?;
    let rows = events.rows(&versions, Some(&local))?;
    outcome.versions_written = rows.num_rows();
    Ok(((kept, rows), outcome))
}

async fn read_whole(settings: &FileSettings, file: &LogicalFileView) -> Result<RecordBatch> {
    let rows = ParquetRecordBatchStreamBuilder::new(settings.reader(file))
        .await?
        .build()?
        .collect::<std::result::Result<Vec<_>, _>>()
        .await?;
    Ok(concat_batches(
        &settings.schema,
        &rows_in(&rows, settings)?,
    )?)
}

/// `rows` in history's columns.
fn rows_in(rows: &[RecordBatch], settings: &FileSettings) -> Result<Vec<RecordBatch>> {
    rows.iter()
        .map(|batch| rewrite::conform(batch, &settings.schema))
        .collect()
}

fn current_column(batch: &RecordBatch) -> Result<BooleanArray> {
    batch
        .column_by_name("__is_current")
        .and_then(|column| column.as_any().downcast_ref::<BooleanArray>())
        .cloned()
        .ok_or_else(|| WriterError::Internal("history rows without __is_current".into()))
}
