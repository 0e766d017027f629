//! Snapshot reads of the simulated database: the tables' current rows.
//!
//! A table's rows are published with the manifest as `(key, content)` pairs, every column's
//! value a function of the two (`values.rs`), so a read at any moment sees exactly the rows
//! of the newest publication, which holds every commit up to its `max_lsn`. The Flight layer
//! records the stamp before calling [`SimDb::snapshot_rows`]; a commit published in between
//! (see `Faults::before_snapshot_read`) is seen by the read, as SQL Server's READ COMMITTED
//! would see it.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, StringArray, TimestampMicrosecondArray, new_null_array};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::SimDb;
use super::keyset;
use super::reader::own_rows;
use super::storage::TableDef;
use super::values::ColumnBuilder;
use crate::error::{Error, Result};
use crate::keys::{KeyColumn, KeySeek, KeyTuple};
use crate::source::{
    BatchBytes, KeyBucket, KeyExtent, KeyGrid, ReadSender, SnapshotRead, TableName,
};
use crate::types::{CHUNK_COLUMN, OutputColumn, batch_slice_size, snapshot_schema};

/// Sends `batch` in slices of at most about `batch_bytes` (one row at least), as SQL Server's
/// reader cuts its batches; `Ok(false)` when the reader has gone.
pub(crate) fn send_bounded(
    sender: &ReadSender,
    batch: &RecordBatch,
    batch_bytes: &BatchBytes,
) -> Result<bool> {
    let rows = batch.num_rows();
    let row_width = batch_slice_size(batch).div_ceil(rows.max(1)).max(1);
    let mut offset = 0;
    while offset < rows {
        let length = (batch_bytes.now() / row_width).clamp(1, rows - offset);
        let piece = own_rows(&batch.slice(offset, length), rows)?;
        if !sender.blocking_send(piece) {
            return Ok(false);
        }
        offset += length;
    }
    Ok(true)
}

/// Each row's key in grid units (`None`: NULL) and, when digests were asked, each row's
/// value digest, in key order.
pub(super) type GridRows = (Vec<Option<i64>>, Option<Vec<i64>>);

impl SimDb {
    fn table_def(&self, table: &TableName) -> Result<TableDef> {
        self.store
            .manifest()?
            .table(table)
            .cloned()
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })
    }

    /// The rows of a table now.
    pub(super) fn row_count(&self, table: &TableName) -> Result<u64> {
        let definition = self.table_def(table)?;
        Ok(self.store.read_state(&definition)?.len() as u64)
    }

    /// The key column and extent of a table.
    pub(super) fn extent(&self, table: &TableName) -> Result<KeyExtent> {
        let definition = self.table_def(table)?;
        let rows = self.store.read_state(&definition)?;
        // Integer plans need one integer column that is the unique index (the row key); a
        // composite or text index, or a heap, is cut on keyset bounds.
        if definition.index_columns() != [definition.key.clone()] {
            return Err(Error::invalid(format!(
                "{table} has no single integer unique key (its unique index is [{}]): cut its \
                 chunks on keyset bounds",
                definition.index_columns().join(", ")
            )));
        }
        let key = definition
            .column(&definition.key)
            .ok_or_else(|| Error::Internal(format!("{table} has no key column")))?;
        Ok(KeyExtent {
            column: key.name.clone(),
            sql_type: key.sql_type.clone(),
            min: rows.keys().next().copied(),
            max: rows.keys().next_back().copied(),
            rows: rows.len() as u64,
        })
    }

    /// The largest key on `keys`.
    pub(super) fn keyset_max(
        &self,
        table: &TableName,
        keys: &[KeyColumn],
    ) -> Result<Option<KeyTuple>> {
        let definition = self.table_def(table)?;
        let rows = self.store.read_state(&definition)?;
        // Cut on the row key itself: the last entry of the ordered rows, as SQL Server's MAX
        // is one seek to the end of the index (this is every integer-keyed table's open).
        if let [key] = keys
            && key.name == definition.key
            && key.is_integer()
        {
            let last: std::collections::BTreeMap<i64, u64> = rows
                .iter()
                .next_back()
                .map(|(k, v)| (*k, *v))
                .into_iter()
                .collect();
            return Ok(keyset::row_keys(&definition, keys, &last)?.pop());
        }
        Ok(keyset::row_keys(&definition, keys, &rows)?
            .into_iter()
            .max_by(|a, b| keyset::compare_tuples(keys, a, b)))
    }

    /// The key of the `(n + 1)`-th row of a seek's range.
    pub(super) fn keyset_bound(
        &self,
        table: &TableName,
        keys: &[KeyColumn],
        seek: &KeySeek,
    ) -> Result<Option<KeyTuple>> {
        let definition = self.table_def(table)?;
        let rows = self.store.read_state(&definition)?;
        keyset::seek(&definition, keys, &rows, seek)
    }

    /// Row counts per slice of the grid over the table's key.
    pub(super) fn buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        let rows = self.store.read_state(&self.table_def(table)?)?;
        Ok(grid.count(rows.range(grid.lo()..=grid.hi()).map(|(key, _)| *key)))
    }

    /// The values of `key` (an integer or `date` column) in grid units, one per row, NULL as
    /// `None`: what `key_span` and `key_sums` aggregate.
    pub(super) fn grid_values(
        &self,
        table: &TableName,
        key: &KeyColumn,
    ) -> Result<Vec<Option<i64>>> {
        Ok(self.grid_rows(table, key, &[])?.0)
    }

    /// [`SimDb::grid_values`] and, with `values`, each row's digest of those columns as a
    /// snapshot read serves them ([`mssql_cdc_proto::digest`]), from one read of the table.
    pub(super) fn grid_rows(
        &self,
        table: &TableName,
        key: &KeyColumn,
        values: &[OutputColumn],
    ) -> Result<GridRows> {
        key.require_grid_unit()?;
        let definition = self.table_def(table)?;
        let rows = self.store.read_state(&definition)?;
        let digests = match values.is_empty() {
            true => None,
            false => Some(Self::digests(&definition, &rows, values)?),
        };
        Ok((Self::key_units(&definition, &rows, key, table)?, digests))
    }

    /// Each row's value digest over `values`, in key order, 65,536 rows at a time, built as
    /// a snapshot read builds its columns.
    fn digests(
        definition: &TableDef,
        rows: &BTreeMap<i64, u64>,
        values: &[OutputColumn],
    ) -> Result<Vec<i64>> {
        let sources: Vec<_> = values
            .iter()
            .map(|column| definition.column(&column.name))
            .collect();
        let all: Vec<(i64, u64)> = rows.iter().map(|(key, content)| (*key, *content)).collect();
        let mut digests = Vec::with_capacity(all.len());
        for part in all.chunks(1 << 16) {
            let columns: Vec<ArrayRef> = values
                .iter()
                .zip(&sources)
                .map(|(column, source)| match source {
                    Some(source) => {
                        let mut builder = ColumnBuilder::for_sql_type(&column.sql_type, part.len());
                        let is_key = source.name == definition.key;
                        for (key, content) in part {
                            builder.append_generated(source, is_key, *key, *content);
                        }
                        builder.finish()
                    }
                    // A column the table no longer has reads NULL, as a snapshot serves it.
                    None => new_null_array(
                        &column.sql_type.arrow_type().unwrap_or(DataType::Null),
                        part.len(),
                    ),
                })
                .collect();
            let arrays: Vec<&dyn arrow::array::Array> =
                columns.iter().map(|column| column.as_ref()).collect();
            digests.extend(mssql_cdc_proto::digest::row_digests(&arrays)?);
        }
        Ok(digests)
    }

    fn key_units(
        definition: &TableDef,
        rows: &BTreeMap<i64, u64>,
        key: &KeyColumn,
        table: &TableName,
    ) -> Result<Vec<Option<i64>>> {
        if key.name == definition.key {
            // The row key is its own value: no column to generate.
            return Ok(rows.keys().map(|row_key| Some(*row_key)).collect());
        }
        let source = definition
            .column(&key.name)
            .ok_or_else(|| Error::invalid(format!("{table} has no column '{}'", key.name)))?;
        let mut builder = ColumnBuilder::for_sql_type(&source.sql_type, rows.len());
        for (row_key, content) in rows.iter() {
            builder.append_generated(source, false, *row_key, *content);
        }
        grid_units(&builder.finish())
    }

    /// Sends the rows of `read` in batches to `sender`; returns early when it is gone.
    pub(super) fn snapshot_rows(&self, read: &SnapshotRead, sender: &ReadSender) -> Result<()> {
        if let Some(hook) = self.faults().before_snapshot_read {
            (hook.0)();
        }
        let broken = self.take_broken_snapshot_read();
        let definition = self.table_def(&read.table)?;
        let rows = self.store.read_state(&definition)?;
        let schema = snapshot_schema(&read.columns, read.include_command_id);
        let sources: Vec<Option<&super::storage::ColumnDef>> = read
            .columns
            .iter()
            .map(|column| definition.column(&column.name))
            .collect();
        for piece in &read.pieces {
            let keys: Vec<(i64, u64)> = match &piece.keyset {
                Some(range) => keyset::rows_in_range(&definition, &read.keys, &rows, range)?,
                None => rows
                    .range(piece.range.lo.unwrap_or(i64::MIN)..)
                    .take_while(|(key, _)| piece.range.hi.is_none_or(|hi| **key < hi))
                    .map(|(key, content)| (*key, *content))
                    .collect(),
            };
            for part in keys.chunks(read.batch_rows.max(1)) {
                let count = part.len();
                let mut columns = Vec::with_capacity(read.columns.len());
                for (column, source) in read.columns.iter().zip(&sources) {
                    match source {
                        Some(source) => {
                            let mut builder = ColumnBuilder::for_sql_type(&column.sql_type, count);
                            let is_key = source.name == definition.key;
                            for (key, content) in part {
                                builder.append_generated(source, is_key, *key, *content);
                            }
                            columns.push(builder.finish());
                        }
                        None => columns.push(new_null_array(
                            schema.field_with_name(&column.name)?.data_type(),
                            count,
                        )),
                    }
                }
                let batch = snapshot_batch(read, &schema, piece.chunk, count, columns)?;
                if !send_bounded(sender, &batch, &read.batch_bytes)? {
                    return Ok(());
                }
                if broken {
                    return Err(Error::SourceUnavailable(
                        "the connection to the source was dropped during a snapshot read \
                         (injected fault)"
                            .into(),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The values of a key column (an integer or `date` array) in grid units, NULL as `None`:
/// a date is its day number (Date32 counts days from 1970-01-01), an integer itself.
pub(crate) fn grid_units(values: &ArrayRef) -> Result<Vec<Option<i64>>> {
    let mut values = Arc::clone(values);
    if values.data_type() == &DataType::Date32 {
        values = arrow::compute::cast(&values, &DataType::Int32)?;
    }
    let values = arrow::compute::cast(&values, &DataType::Int64)?;
    Ok(values
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .ok_or_else(|| Error::Internal("grid values are not Int64".into()))?
        .iter()
        .collect())
}

/// The smallest and largest of `units` (NULLs left out): what `key_span` answers.
pub(crate) fn span(units: &[Option<i64>]) -> Option<(i64, i64)> {
    let present = units.iter().flatten();
    present.clone().min().copied().zip(present.max().copied())
}

/// A batch of snapshot rows of `read` in `schema` ([`snapshot_schema`]): the metadata columns
/// every row shares (`_operation` 0, `_start_lsn` the stamp, `_seqval` and `_command_id`
/// NULL), the `captured` columns of `count` rows, and `_chunk`.
pub(crate) fn snapshot_batch(
    read: &SnapshotRead,
    schema: &SchemaRef,
    chunk: Option<i32>,
    count: usize,
    captured: Vec<ArrayRef>,
) -> Result<RecordBatch> {
    let stamp = read.stamp.to_string();
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec![
            read.capture_instance.as_str();
            count
        ])),
        Arc::new(StringArray::from(vec![stamp.as_str(); count])),
        new_null_array(&DataType::Utf8, count),
        Arc::new(Int32Array::from(vec![0; count])),
    ];
    if read.include_command_id {
        columns.push(new_null_array(&DataType::Int32, count));
    }
    columns.push(Arc::new(TimestampMicrosecondArray::from(vec![
        read.stamp_time.map(|t| t.micros());
        count
    ])));
    columns.extend(captured);
    columns.push(Arc::new(Int32Array::from(vec![chunk; count])));
    debug_assert_eq!(schema.field(schema.fields().len() - 1).name(), CHUNK_COLUMN);
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}
