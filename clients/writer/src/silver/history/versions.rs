//! A call's events, grouped by key and commit, and what [`super::fold`] reads of them and of
//! the history rows it folds them onto; the version rows it leaves.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, StringArray, TimestampMicrosecondArray,
};
use arrow::compute::{cast, interleave_record_batch};
use arrow::datatypes::{DataType, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows as RowBytes, SortField};

use super::super::rewrite;
use super::fold::{self, At, Event, KeyState, Point, Version};
use super::plan::{ABSENT, CHANGE, IMAGE};
use super::snapshots::Facts;
use crate::error::{Result, WriterError};

/// Keys as Arrow row-format bytes in history's key types: equal keys, equal bytes (a NULL
/// equal to a NULL, as the unique index CDC uses admits one).
pub(super) struct KeyIndex {
    pub(super) keys: Vec<String>,
    types: Vec<DataType>,
    converter: RowConverter,
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

/// A batch of history's captured columns, `_start_lsn` and `_commit_ts` (an event batch, or
/// a history file's rows), with the bytes the fold compares.
pub(super) struct Values {
    pub(super) batch: RecordBatch,
    tracked: RowBytes,
    all: RowBytes,
    lsn: StringArray,
}

/// How a batch of values becomes the bytes the fold compares: its tracked columns, and every
/// column but `_start_lsn` and `_commit_ts`.
struct Converters {
    schema: SchemaRef,
    tracked_columns: Vec<usize>,
    tracked: RowConverter,
    all_columns: Vec<usize>,
    all: RowConverter,
}

impl Converters {
    fn new(schema: &SchemaRef, tracked: &[String]) -> Result<Self> {
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
        Ok(Converters {
            tracked: converter(&tracked_columns)?,
            all: converter(&all_columns)?,
            schema: schema.clone(),
            tracked_columns,
            all_columns,
        })
    }

    /// `batch` (any columns history holds) as values.
    fn values(&self, batch: &RecordBatch) -> Result<Values> {
        let batch = rewrite::conform(batch, &self.schema)?;
        let pick = |columns: &[usize]| -> Vec<ArrayRef> {
            columns
                .iter()
                .map(|index| batch.column(*index).clone())
                .collect()
        };
        Ok(Values {
            tracked: self.tracked.convert_columns(&pick(&self.tracked_columns))?,
            all: self.all.convert_columns(&pick(&self.all_columns))?,
            lsn: string_column(&batch, "_start_lsn")?,
            batch,
        })
    }
}

/// A call's events: each touched key's, in order, over the event batches' values.
pub(super) struct Events {
    pub(super) index: KeyIndex,
    converters: Converters,
    /// History's columns.
    history: SchemaRef,
    values: Vec<Values>,
    by_key: HashMap<Box<[u8]>, Vec<Event>>,
    /// The touched keys sorted, when the key is one integer column without NULL: a history
    /// file whose statistics hold none of them is not read.
    pub(super) integers: Option<Vec<i64>>,
}

impl Events {
    /// The events of `batches` (sorted by key and order, [`super::plan`]): history's values
    /// columns, `_operation`, `__position`, `__kind`.
    pub(super) fn new(
        batches: Vec<RecordBatch>,
        history: SchemaRef,
        values_schema: SchemaRef,
        keys: &[String],
        tracked: &[String],
        times: &HashMap<String, i64>,
    ) -> Result<Self> {
        let index = KeyIndex::new(keys, &values_schema)?;
        let converters = Converters::new(&values_schema, tracked)?;
        let snapshot_time = |s: &str| times.get(s).copied();
        let mut values = Vec::with_capacity(batches.len());
        let mut by_key: HashMap<Box<[u8]>, Vec<Event>> = HashMap::new();
        let mut integers = (keys.len() == 1 && index.types[0].is_integer()).then(Vec::new);
        let mut last: Option<Box<[u8]>> = None;
        for batch in batches.into_iter().filter(|batch| batch.num_rows() > 0) {
            let rows = EventRows::of(&batch)?;
            let at_batch = values.len();
            let batch_values = converters.values(&batch)?;
            let key_bytes = index.rows(&batch_values.batch)?;
            let integer_keys = match &integers {
                Some(_) => Some(integer_column(&batch_values.batch, &keys[0])?),
                None => None,
            };
            for row in 0..batch.num_rows() {
                let key = key_bytes.row(row);
                if last.as_deref() != Some(key.as_ref()) {
                    last = Some(Box::from(key.as_ref()));
                    if let (Some(sorted), Some(column)) = (integers.as_mut(), &integer_keys) {
                        match column.is_valid(row) {
                            true => sorted.push(column.value(row)),
                            false => integers = None,
                        }
                    }
                }
                let events = by_key.entry(Box::from(key.as_ref())).or_default();
                rows.push(
                    events,
                    At {
                        batch: at_batch,
                        row,
                    },
                    &snapshot_time,
                );
            }
            values.push(batch_values);
        }
        if let Some(sorted) = integers.as_mut() {
            sorted.sort_unstable();
            sorted.dedup();
        }
        Ok(Events {
            index,
            converters,
            history,
            values,
            by_key,
            integers,
        })
    }

    /// Whether `key` (its bytes) has events.
    pub(super) fn touches(&self, key: &[u8]) -> bool {
        self.by_key.contains_key(key)
    }

    /// A batch of history rows as values the fold can read beside the events: its rows are
    /// `At { batch: self.local_batch(), row }`.
    pub(super) fn local(&self, batch: &RecordBatch) -> Result<Values> {
        self.converters.values(batch)
    }

    /// The `At::batch` of a local batch's rows.
    pub(super) fn local_batch(&self) -> usize {
        self.values.len()
    }

    /// `key`'s versions from `state` on (its current version's values in `local`), when its
    /// events change anything.
    pub(super) fn fold(
        &self,
        key: &[u8],
        state: KeyState,
        local: Option<&Values>,
        facts: &Facts,
        times: &HashMap<String, i64>,
    ) -> Option<Vec<Version>> {
        let events = self.by_key.get(key)?;
        let rows = Pair {
            events: &self.values,
            local,
        };
        fold::fold_key(state, events, &rows, facts, &|s: &str| {
            times.get(s).copied()
        })
    }

    /// The rows of `versions` (values in the events or `local`), in history's schema.
    pub(super) fn rows(&self, versions: &[Version], local: Option<&Values>) -> Result<RecordBatch> {
        if versions.is_empty() {
            return Ok(RecordBatch::new_empty(self.history.clone()));
        }
        let mut sources: Vec<&RecordBatch> = self.values.iter().map(|v| &v.batch).collect();
        if let Some(local) = local {
            sources.push(&local.batch);
        }
        let places: Vec<(usize, usize)> = versions
            .iter()
            .map(|version| (version.values.batch, version.values.row))
            .collect();
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

    /// Every touched key folded from nothing (a history that holds none of them): the
    /// version rows.
    pub(super) fn fold_from_nothing(
        &self,
        facts: &Facts,
        times: &HashMap<String, i64>,
        last_ends: &HashMap<Box<[u8]>, String>,
        skip: &std::collections::HashSet<Box<[u8]>>,
    ) -> Result<(RecordBatch, usize)> {
        let mut versions = Vec::new();
        let mut keys = 0;
        for key in self.by_key.keys().filter(|key| !skip.contains(*key)) {
            let state = KeyState {
                current: None,
                last_end: last_ends.get(key).cloned(),
            };
            if let Some(folded) = self.fold(key, state, None, facts, times) {
                keys += 1;
                versions.extend(folded);
            }
        }
        Ok((self.rows(&versions, None)?, keys))
    }
}

/// The current version a history row holds: its values at `at`.
pub(super) fn current_version(batch: &RecordBatch, row: usize, at: At) -> Result<Version> {
    let from = string_column(batch, "__valid_from")?;
    let from_ts = time_column(batch, "__valid_from_ts")?;
    Ok(Version {
        values: at,
        valid_from: from.is_valid(row).then(|| from.value(row).to_string()),
        valid_from_ts: from_ts.is_valid(row).then(|| from_ts.value(row)),
        valid_to: None,
        valid_to_ts: None,
        ended_by: None,
    })
}

/// The fold's view of the event values and one batch of history rows.
struct Pair<'a> {
    events: &'a [Values],
    local: Option<&'a Values>,
}

impl Pair<'_> {
    fn of(&self, at: At) -> &Values {
        match (self.events.get(at.batch), self.local) {
            (Some(values), _) => values,
            (None, Some(local)) => local,
            // The fold only names rows of the batches it was given.
            (None, None) => unreachable!("a row past the events without a local batch"),
        }
    }
}

impl fold::Rows for Pair<'_> {
    fn tracked_equal(&self, a: At, b: At) -> bool {
        self.of(a).tracked.row(a.row) == self.of(b).tracked.row(b.row)
    }

    fn equal(&self, a: At, b: At) -> bool {
        self.of(a).all.row(a.row) == self.of(b).all.row(b.row)
    }

    fn lsn(&self, at: At) -> Option<String> {
        let lsn = &self.of(at).lsn;
        lsn.is_valid(at.row).then(|| lsn.value(at.row).to_string())
    }
}

/// What the fold reads of an event batch: operation, position and kind.
struct EventRows {
    operation: Int64Array,
    position: StringArray,
    kind: Int64Array,
    commit_ts: TimestampMicrosecondArray,
}

impl EventRows {
    fn of(batch: &RecordBatch) -> Result<Self> {
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
            operation: integer("_operation")?,
            position: string_column(batch, "__position")?,
            kind: integer("__kind")?,
            commit_ts: time_column(batch, "_commit_ts")?,
        })
    }

    /// Adds event row `at` to its key's `events`: a change row joins its commit's event (the
    /// first row of a commit opens it, each later one is its last), a snapshot row replaces
    /// an image at the same S.
    fn push(&self, events: &mut Vec<Event>, at: At, snapshot_time: &impl Fn(&str) -> Option<i64>) {
        let row = at.row;
        let position = self.position.value(row).to_string();
        let operation = self
            .operation
            .is_valid(row)
            .then(|| self.operation.value(row) as i32);
        match self.kind.value(row) {
            CHANGE => {
                let operation = operation.unwrap_or(0);
                if let Some(Event::Commit {
                    at: point, last, ..
                }) = events.last_mut()
                    && point.lsn == position
                {
                    *last = (operation, at);
                    return;
                }
                events.push(Event::Commit {
                    at: Point {
                        lsn: position,
                        ts: self
                            .commit_ts
                            .is_valid(row)
                            .then(|| self.commit_ts.value(row)),
                    },
                    first: (operation, at),
                    last: (operation, at),
                });
            }
            IMAGE => {
                if let Some(Event::Image {
                    snapshot,
                    row: last,
                }) = events.last_mut()
                    && snapshot.lsn == position
                {
                    *last = at;
                    return;
                }
                let ts = snapshot_time(&position);
                events.push(Event::Image {
                    snapshot: Point { lsn: position, ts },
                    row: at,
                });
            }
            ABSENT => {
                let ts = snapshot_time(&position);
                events.push(Event::Absent {
                    snapshot: Point { lsn: position, ts },
                });
            }
            _ => {}
        }
    }
}

fn integer_column(batch: &RecordBatch, name: &str) -> Result<Int64Array> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| WriterError::Internal(format!("events without {name}")))?;
    cast(column, &DataType::Int64)?
        .as_any()
        .downcast_ref::<Int64Array>()
        .cloned()
        .ok_or_else(|| WriterError::Internal(format!("{name} is not an integer")))
}

pub(super) fn string_column(batch: &RecordBatch, name: &str) -> Result<StringArray> {
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
