//! From event rows to version rows: what history holds of the touched keys, the events of
//! each key grouped by commit, [`super::fold`], and the rows it leaves.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, StringArray, TimestampMicrosecondArray,
};
use arrow::compute::{cast, filter_record_batch, interleave_record_batch};
use arrow::datatypes::{DataType, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows as RowBytes, SortField};
use deltalake::datafusion::datasource::MemTable;
use deltalake::datafusion::prelude::SessionContext;

use super::super::quote;
use super::fold::{self, At, Event, KeyState, Point, Version};
use super::plan::{ABSENT, CHANGE, IMAGE};
use super::snapshots::Facts;
use crate::error::{Result, WriterError};

/// Keys as Arrow row-format bytes in history's key types: equal keys, equal bytes (a NULL
/// equal to a NULL, as the unique index CDC uses admits one).
pub(super) struct KeyIndex {
    pub(super) keys: Vec<String>,
    pub(super) types: Vec<DataType>,
    converter: RowConverter,
    /// The keys whose current row the call replaces.
    pub(super) replaced: HashSet<Box<[u8]>>,
    /// Those keys sorted, when the key is one integer column without NULL: a file whose
    /// statistics hold none of them is not read.
    pub(super) integers: Option<Vec<i64>>,
}

impl KeyIndex {
    fn new(keys: &[String], schema: &SchemaRef) -> Result<Self> {
        let types = keys
            .iter()
            .map(|key| Ok(schema.field_with_name(key)?.data_type().clone()))
            .collect::<Result<Vec<_>>>()?;
        let converter =
            RowConverter::new(types.iter().map(|t| SortField::new(t.clone())).collect())?;
        Ok(KeyIndex {
            keys: keys.to_vec(),
            types,
            converter,
            replaced: HashSet::new(),
            integers: None,
        })
    }

    /// The key bytes of every row of `batch`.
    pub(super) fn rows(&self, batch: &RecordBatch) -> Result<RowBytes> {
        let columns = self
            .keys
            .iter()
            .zip(&self.types)
            .map(|(key, data_type)| {
                let column = batch.column_by_name(key).ok_or_else(|| {
                    WriterError::Internal(format!("history rows without key column {key}"))
                })?;
                Ok(cast(column, data_type)?)
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        Ok(self.converter.convert_columns(&columns)?)
    }
}

/// What a fold leaves to write.
pub(super) struct Folded {
    /// The keys whose current row the versions replace.
    pub(super) index: KeyIndex,
    /// The version rows to add, in history's schema.
    pub(super) versions: RecordBatch,
    /// Keys whose versions changed.
    pub(super) keys: usize,
}

/// Runs the fold of one call.
pub(super) struct Folder<'a> {
    pub(super) context: &'a SessionContext,
    /// History's columns.
    pub(super) history: SchemaRef,
    /// History's captured columns with `_start_lsn` and `_commit_ts`.
    pub(super) values: SchemaRef,
    pub(super) keys: &'a [String],
    /// The columns whose changes open a version.
    pub(super) tracked: &'a [String],
}

impl Folder<'_> {
    /// Folds `events` (sorted by key and order) into the touched keys' versions.
    pub(super) async fn fold(
        &self,
        events: Vec<RecordBatch>,
        facts: &Facts,
        times: &HashMap<String, i64>,
    ) -> Result<Folded> {
        let mut index = KeyIndex::new(self.keys, &self.values)?;
        let events: Vec<EventRows> = events
            .into_iter()
            .filter(|batch| batch.num_rows() > 0)
            .map(|batch| EventRows::of(&batch, &self.values, &index))
            .collect::<Result<_>>()?;
        let state = self.state(&events, &index).await?;
        let mut values: Vec<RecordBatch> = events.iter().map(|rows| rows.values.clone()).collect();
        let state_base = values.len();
        values.extend(state.iter().map(|(values, _)| values.clone()));
        let mut states = self.key_states(&state, state_base, &index)?;
        let rows = ValueRows::new(&values, self.tracked)?;
        let snapshot_time = |s: &str| times.get(s).copied();

        let mut output = Output::default();
        let mut group = Group::default();
        for (batch, rows_of_batch) in events.iter().enumerate() {
            for row in 0..rows_of_batch.values.num_rows() {
                let key = rows_of_batch.keys.row(row);
                if group.key.as_deref() != Some(key.as_ref()) {
                    output.finish(
                        std::mem::take(&mut group),
                        &mut states,
                        &rows,
                        facts,
                        &snapshot_time,
                    );
                    group.key = Some(Box::from(key.as_ref()));
                }
                group.push(rows_of_batch, At { batch, row }, &snapshot_time);
            }
        }
        output.finish(group, &mut states, &rows, facts, &snapshot_time);
        let Output {
            versions,
            keys: changed_keys,
            replaced,
        } = output;
        index.replaced = replaced;
        let mut integers = Vec::new();
        let mut integer_keys = index.types.len() == 1 && index.types[0].is_integer();
        if integer_keys {
            for version in &versions {
                let key = &values[version.values.batch];
                let column = cast(
                    key.column_by_name(&index.keys[0])
                        .ok_or_else(|| WriterError::Internal("key column".into()))?,
                    &DataType::Int64,
                )?;
                let column = column
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .ok_or_else(|| WriterError::Internal("integer key".into()))?;
                if column.is_null(version.values.row) {
                    integer_keys = false;
                    break;
                }
                integers.push(column.value(version.values.row));
            }
        }
        if integer_keys {
            integers.sort_unstable();
            integers.dedup();
            index.integers = Some(integers);
        }
        Ok(Folded {
            versions: self.version_rows(&values, &versions)?,
            index,
            keys: changed_keys,
        })
    }

    /// History's rows of the keys `events` touch (current ones and ended ones), each batch
    /// with its values part.
    async fn state(
        &self,
        events: &[EventRows],
        index: &KeyIndex,
    ) -> Result<Vec<(RecordBatch, RecordBatch)>> {
        // One row per touched key: the first of each run of equal keys.
        let mut touched = Vec::new();
        let mut last: Option<Box<[u8]>> = None;
        for rows in events {
            let mut first = Vec::with_capacity(rows.values.num_rows());
            for row in 0..rows.values.num_rows() {
                let key = rows.keys.row(row);
                let new = last.as_deref() != Some(key.as_ref());
                if new {
                    last = Some(Box::from(key.as_ref()));
                }
                first.push(new);
            }
            let keys = rows.values.project(
                &index
                    .keys
                    .iter()
                    .map(|key| rows.values.schema().index_of(key))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            )?;
            touched.push(filter_record_batch(&keys, &BooleanArray::from(first))?);
        }
        let Some(schema) = touched.first().map(RecordBatch::schema) else {
            return Ok(Vec::new());
        };
        if self.context.table_exist("touched")? {
            self.context.deregister_table("touched")?;
        }
        self.context.register_table(
            "touched",
            Arc::new(MemTable::try_new(schema, vec![touched])?),
        )?;
        let key_match = self
            .keys
            .iter()
            .map(|key| format!("h.{k} IS NOT DISTINCT FROM t.{k}", k = quote(key)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let batches = self
            .context
            .sql(&format!(
                "SELECT h.* FROM history h WHERE EXISTS (SELECT 1 FROM touched t WHERE {key_match})"
            ))
            .await?
            .collect()
            .await?;
        batches
            .into_iter()
            .filter(|batch| batch.num_rows() > 0)
            .map(|batch| {
                let full = super::super::rewrite::conform(&batch, &self.history)?;
                let values = super::super::rewrite::conform(&full, &self.values)?;
                Ok((full, values))
            })
            .collect()
    }

    /// What history holds of each touched key: its current version (its values at the
    /// state batches from `base` on) and the end of its newest ended one.
    fn key_states(
        &self,
        state: &[(RecordBatch, RecordBatch)],
        base: usize,
        index: &KeyIndex,
    ) -> Result<HashMap<Box<[u8]>, KeyState>> {
        let mut states: HashMap<Box<[u8]>, KeyState> = HashMap::new();
        for (offset, (full, _)) in state.iter().enumerate() {
            let keys = index.rows(full)?;
            let text = |name: &str| string_column(full, name);
            let time = |name: &str| time_column(full, name);
            let (from, to) = (text("__valid_from")?, text("__valid_to")?);
            let from_ts = time("__valid_from_ts")?;
            let current = full
                .column_by_name("__is_current")
                .and_then(|column| column.as_any().downcast_ref::<BooleanArray>())
                .ok_or_else(|| WriterError::Internal("history without __is_current".into()))?;
            for row in 0..full.num_rows() {
                let state = states.entry(Box::from(keys.row(row).as_ref())).or_default();
                let value =
                    |array: &StringArray| array.is_valid(row).then(|| array.value(row).to_string());
                if current.is_valid(row) && current.value(row) {
                    if state.current.is_some() {
                        return Err(WriterError::invalid(format!(
                            "history holds two current versions of one key (another engine \
                             wrote it?): a key has at most one; {}",
                            "delete the extra row or rebuild the history table"
                        )));
                    }
                    state.current = Some(Version {
                        values: At {
                            batch: base + offset,
                            row,
                        },
                        valid_from: value(&from),
                        valid_from_ts: from_ts.is_valid(row).then(|| from_ts.value(row)),
                        valid_to: None,
                        valid_to_ts: None,
                        ended_by: None,
                    });
                } else if let Some(end) = value(&to)
                    && state.last_end.as_ref().is_none_or(|last| &end > last)
                {
                    state.last_end = Some(end);
                }
            }
        }
        Ok(states)
    }

    /// The rows of `versions`: their values, then their intervals.
    fn version_rows(&self, values: &[RecordBatch], versions: &[Version]) -> Result<RecordBatch> {
        if versions.is_empty() {
            return Ok(RecordBatch::new_empty(self.history.clone()));
        }
        let places: Vec<(usize, usize)> = versions
            .iter()
            .map(|version| (version.values.batch, version.values.row))
            .collect();
        let sources: Vec<&RecordBatch> = values.iter().collect();
        let taken = interleave_record_batch(&sources, &places)?;
        let text = |pick: &dyn Fn(&Version) -> Option<&str>| -> ArrayRef {
            Arc::new(StringArray::from_iter(versions.iter().map(pick)))
        };
        let time = |pick: &dyn Fn(&Version) -> Option<i64>| -> ArrayRef {
            Arc::new(TimestampMicrosecondArray::from_iter(
                versions.iter().map(pick),
            ))
        };
        let intervals: [(&str, ArrayRef); 6] = [
            ("__valid_from", text(&|v| v.valid_from.as_deref())),
            ("__valid_from_ts", time(&|v| v.valid_from_ts)),
            ("__valid_to", text(&|v| v.valid_to.as_deref())),
            ("__valid_to_ts", time(&|v| v.valid_to_ts)),
            (
                "__is_current",
                Arc::new(BooleanArray::from_iter(
                    versions.iter().map(|v| Some(v.ended_by.is_none())),
                )),
            ),
            (
                "__ended_by",
                text(&|v| v.ended_by.map(fold::Ending::as_str)),
            ),
        ];
        // In history's order: a column bronze added later follows the interval columns.
        let columns = self
            .history
            .fields()
            .iter()
            .map(|field| {
                let column = match intervals.iter().find(|(name, _)| name == field.name()) {
                    Some((_, column)) => column.clone(),
                    None => taken.column_by_name(field.name()).cloned().ok_or_else(|| {
                        WriterError::Internal(format!("versions without {}", field.name()))
                    })?,
                };
                if column.data_type() == field.data_type() {
                    Ok(column)
                } else {
                    Ok(cast(&column, field.data_type())?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecordBatch::try_new(self.history.clone(), columns)?)
    }
}

/// A batch of event rows: history's values, the key bytes, and what the fold reads.
struct EventRows {
    values: RecordBatch,
    keys: RowBytes,
    operation: Int64Array,
    position: StringArray,
    kind: Int64Array,
    commit_ts: TimestampMicrosecondArray,
}

impl EventRows {
    fn of(batch: &RecordBatch, values: &SchemaRef, index: &KeyIndex) -> Result<Self> {
        let values = super::super::rewrite::conform(batch, values)?;
        let integer = |name: &str| -> Result<Int64Array> {
            let column = cast(
                batch
                    .column_by_name(name)
                    .ok_or_else(|| WriterError::Internal(format!("events without {name}")))?,
                &DataType::Int64,
            )?;
            column
                .as_any()
                .downcast_ref::<Int64Array>()
                .cloned()
                .ok_or_else(|| WriterError::Internal(format!("{name} is not an integer")))
        };
        Ok(EventRows {
            keys: index.rows(&values)?,
            operation: integer("_operation")?,
            position: string_column(batch, "__position")?,
            kind: integer("__kind")?,
            commit_ts: time_column(&values, "_commit_ts")?,
            values,
        })
    }
}

/// The events of the key being read, and the commit or snapshot being gathered.
#[derive(Default)]
struct Group {
    key: Option<Box<[u8]>>,
    events: Vec<Event>,
}

impl Group {
    /// Adds event row `at` of `rows`: a change row joins its commit's event (the first row
    /// of a commit opens it, each later one is its last), a snapshot row replaces an image
    /// at the same S.
    fn push(&mut self, rows: &EventRows, at: At, snapshot_time: &impl Fn(&str) -> Option<i64>) {
        let row = at.row;
        let position = rows.position.value(row).to_string();
        let operation = rows
            .operation
            .is_valid(row)
            .then(|| rows.operation.value(row) as i32);
        match rows.kind.value(row) {
            CHANGE => {
                let operation = operation.unwrap_or(0);
                if let Some(Event::Commit {
                    at: point, last, ..
                }) = self.events.last_mut()
                    && point.lsn == position
                {
                    *last = (operation, at);
                    return;
                }
                self.events.push(Event::Commit {
                    at: Point {
                        lsn: position,
                        ts: rows
                            .commit_ts
                            .is_valid(row)
                            .then(|| rows.commit_ts.value(row)),
                    },
                    first: (operation, at),
                    last: (operation, at),
                });
            }
            IMAGE => {
                if let Some(Event::Image {
                    snapshot,
                    row: last,
                }) = self.events.last_mut()
                    && snapshot.lsn == position
                {
                    *last = at;
                    return;
                }
                let ts = snapshot_time(&position);
                self.events.push(Event::Image {
                    snapshot: Point { lsn: position, ts },
                    row: at,
                });
            }
            ABSENT => {
                let ts = snapshot_time(&position);
                self.events.push(Event::Absent {
                    snapshot: Point { lsn: position, ts },
                });
            }
            _ => {}
        }
    }
}

/// The versions of the keys folded so far.
#[derive(Default)]
struct Output {
    versions: Vec<Version>,
    /// Keys whose versions changed.
    keys: usize,
    /// Keys whose current row the versions replace.
    replaced: HashSet<Box<[u8]>>,
}

impl Output {
    /// Folds the events of the key `group` gathered.
    fn finish(
        &mut self,
        group: Group,
        states: &mut HashMap<Box<[u8]>, KeyState>,
        rows: &ValueRows,
        facts: &Facts,
        snapshot_time: &impl Fn(&str) -> Option<i64>,
    ) {
        let Some(key) = group.key else {
            return;
        };
        let state = states.remove(&key).unwrap_or_default();
        let replaces = state.current.is_some();
        if let Some(versions) = fold::fold_key(state, &group.events, rows, facts, snapshot_time) {
            self.keys += 1;
            self.versions.extend(versions);
            if replaces {
                self.replaced.insert(key);
            }
        }
    }
}

/// The fold's view of the value batches: tracked and whole-row bytes, `_start_lsn`.
struct ValueRows {
    tracked: Vec<RowBytes>,
    all: Vec<RowBytes>,
    lsn: Vec<StringArray>,
}

impl ValueRows {
    fn new(values: &[RecordBatch], tracked: &[String]) -> Result<Self> {
        let Some(first) = values.first() else {
            return Ok(ValueRows {
                tracked: Vec::new(),
                all: Vec::new(),
                lsn: Vec::new(),
            });
        };
        let schema = first.schema();
        let all_columns: Vec<usize> = schema
            .fields()
            .iter()
            .enumerate()
            .filter(|(_, field)| !matches!(field.name().as_str(), "_start_lsn" | "_commit_ts"))
            .map(|(index, _)| index)
            .collect();
        let tracked_columns: Vec<usize> = tracked
            .iter()
            .map(|name| schema.index_of(name))
            .collect::<std::result::Result<_, _>>()?;
        let converter = |columns: &[usize]| {
            RowConverter::new(
                columns
                    .iter()
                    .map(|index| SortField::new(schema.field(*index).data_type().clone()))
                    .collect(),
            )
        };
        let (tracked_converter, all_converter) =
            (converter(&tracked_columns)?, converter(&all_columns)?);
        let pick = |batch: &RecordBatch, columns: &[usize]| -> Vec<ArrayRef> {
            columns
                .iter()
                .map(|index| batch.column(*index).clone())
                .collect()
        };
        let mut rows = ValueRows {
            tracked: Vec::new(),
            all: Vec::new(),
            lsn: Vec::new(),
        };
        for batch in values {
            rows.tracked
                .push(tracked_converter.convert_columns(&pick(batch, &tracked_columns))?);
            rows.all
                .push(all_converter.convert_columns(&pick(batch, &all_columns))?);
            rows.lsn.push(string_column(batch, "_start_lsn")?);
        }
        Ok(rows)
    }
}

impl fold::Rows for ValueRows {
    fn tracked_equal(&self, a: At, b: At) -> bool {
        self.tracked[a.batch].row(a.row) == self.tracked[b.batch].row(b.row)
    }

    fn equal(&self, a: At, b: At) -> bool {
        self.all[a.batch].row(a.row) == self.all[b.batch].row(b.row)
    }

    fn lsn(&self, at: At) -> Option<String> {
        let lsn = &self.lsn[at.batch];
        lsn.is_valid(at.row).then(|| lsn.value(at.row).to_string())
    }
}

fn string_column(batch: &RecordBatch, name: &str) -> Result<StringArray> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| WriterError::Internal(format!("history rows without {name}")))?;
    cast(column, &DataType::Utf8)?
        .as_any()
        .downcast_ref::<StringArray>()
        .cloned()
        .ok_or_else(|| WriterError::Internal(format!("{name} is not text")))
}

fn time_column(batch: &RecordBatch, name: &str) -> Result<TimestampMicrosecondArray> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| WriterError::Internal(format!("history rows without {name}")))?;
    cast(column, &DataType::Timestamp(TimeUnit::Microsecond, None))?
        .as_any()
        .downcast_ref::<TimestampMicrosecondArray>()
        .cloned()
        .ok_or_else(|| WriterError::Internal(format!("{name} is not a time")))
}
