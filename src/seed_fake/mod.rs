//! A source serving the seed library's simulator: the database `FakeCdcDatabase` of
//! `mssql-cdc-pyspark` (`mssql_cdc/fake.py`) keeps in plain files, served read-only with
//! `--source seed-fake:<DIR>`.
//!
//! It is a second model of CDC written by other people: histories the seed's own code wrote
//! (two capture instances, DDL, idle entries, cleanup, computed columns) run through this
//! service and its writer in the tests, and the conformance suite holds for them. The files
//! are re-read at every call (they are test-sized), so a Python process committing with the
//! seed's code while the server serves is seen at the next call. What the seed's model leaves
//! out or models otherwise is listed in docs/design-notes.md ("The seed's simulator as a
//! source").

mod files;
#[cfg(test)]
mod tests;
mod values;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, StringArray, TimestampMicrosecondArray, new_null_array};
use arrow::record_batch::RecordBatch;
use serde_json::{Map, Value};

pub use files::SeedFiles;
use files::{Catalog, ChangeRow, InstanceFile};
pub use values::sql_type_of;

use crate::column_builder::ColumnBuilder;
use crate::error::{Error, Result};
use crate::keys::{KeyColumn, KeyTuple, KeyValue, KeysetSeek};
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::sim::keyset;
use crate::sim::snapshot::{grid_units, send_bounded, snapshot_batch, span};
use crate::source::{
    BatchStream, CaptureInstance, CapturedColumn, CdcSource, ChangeRead, DdlEntry, InstanceRange,
    KeyBucket, KeyExtent, KeyGrid, KeySums, ReadSender, SnapshotRead, TableName, Tile, TileCutter,
    TrackedTable, blocking_read, capture_instance_not_found, capture_instance_not_processed,
};
use crate::types::{OutputColumn, output_schema, snapshot_schema};

/// A row of the seed's files: values by column name.
type JsonRow = Map<String, Value>;

/// A table's columns and their types.
type ColumnTypes = BTreeMap<String, crate::types::SqlType>;

/// A table's rows and their keys in grid units.
type GridRows = (Vec<JsonRow>, Vec<Option<i64>>);

/// The schema every table of the seed's fake is in.
const SCHEMA: &str = "dbo";

/// The seed's fake database as a [`CdcSource`].
#[derive(Clone, Debug)]
pub struct SeedFake {
    files: SeedFiles,
}

impl SeedFake {
    /// Serves the fake database in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        Ok(SeedFake {
            files: SeedFiles::open(dir)?,
        })
    }
}

impl Catalog {
    fn max_lsn(&self) -> Option<Lsn> {
        self.mapping.last().map(|entry| entry.start_lsn)
    }

    /// The commit time of the last entry at or before `lsn`.
    fn time_at_or_before(&self, lsn: Lsn) -> Option<CommitTime> {
        self.mapping
            .iter()
            .take_while(|entry| entry.start_lsn <= lsn)
            .last()
            .map(|entry| entry.tran_end_time)
    }

    /// The instances of `table`, oldest first, as the seed orders them: by creation (a
    /// table's first has none), then low watermark.
    fn instances_of(&self, table: &str) -> Vec<(&String, &InstanceFile)> {
        let mut same: Vec<(&String, &InstanceFile)> = self
            .instances
            .iter()
            .filter(|(_, instance)| instance.table == table)
            .collect();
        same.sort_by_key(|(name, instance)| (instance.created.clone(), self.mins.get(*name)));
        same
    }

    /// The table's capture instances as SQL Server reports them. A column keeps one
    /// `column_id` across instances (the seed matches columns by name); computed columns,
    /// NULL in every change row, are not captured. As in the seed's model, an instance is
    /// readable from its creation: its start is the LSN its first commit will take.
    fn capture_instances(&self, table: &str) -> Result<Vec<CaptureInstance>> {
        let computed = self.computed.get(table).cloned().unwrap_or_default();
        let mut column_ids: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for (name, instance) in self.instances_of(table) {
            let declared = instance.columns.as_ref().ok_or_else(|| {
                Error::invalid(format!(
                    "capture instance '{name}' of the seed's database declares no captured \
                     columns (FakeCdcDatabase(columns=...)): this source needs their types"
                ))
            })?;
            let mut columns = Vec::new();
            for (column, spark) in declared {
                if computed.contains(&column.to_lowercase()) {
                    continue;
                }
                let id = match column_ids.iter().position(|known| known == column) {
                    Some(position) => position,
                    None => {
                        column_ids.push(column.clone());
                        column_ids.len() - 1
                    }
                };
                columns.push(CapturedColumn {
                    name: column.clone(),
                    column_id: i32::try_from(id + 1).unwrap_or(i32::MAX),
                    ordinal: i32::try_from(columns.len() + 1).unwrap_or(i32::MAX),
                    sql_type: sql_type_of(spark)?,
                });
            }
            let start = self.mins.get(name).copied();
            let create_date = match &instance.created {
                Some(text) => CommitTime::parse_iso(text).map_err(|error| {
                    Error::Internal(format!(
                        "bad creation time in the seed's files: {}",
                        error.0
                    ))
                })?,
                None => CommitTime(0),
            };
            out.push(CaptureInstance {
                name: name.clone(),
                table: TableName::new(SCHEMA, table),
                start_lsn: start,
                create_date,
                columns,
                index_columns: self.keys.get(table).cloned().unwrap_or_default(),
            });
        }
        Ok(out)
    }

    /// The instance named exactly `name`.
    fn instance(&self, name: &str) -> Result<&InstanceFile> {
        self.instances.get(name).ok_or_else(|| {
            capture_instance_not_found(name, self.instances.keys().map(String::as_str))
        })
    }

    /// The table's current columns and their types, the newest instance's type winning.
    fn table_types(&self, table: &TableName) -> Result<ColumnTypes> {
        if table.schema != SCHEMA {
            return Err(Error::TableNotFound {
                table: table.to_string(),
            });
        }
        let instances = self.capture_instances(&table.name)?;
        if instances.is_empty() {
            return Err(Error::TableNotFound {
                table: table.to_string(),
            });
        }
        Ok(instances
            .into_iter()
            .flat_map(|instance| instance.columns)
            .map(|column| (column.name, column.sql_type))
            .collect())
    }
}

/// One column of JSON rows as an Arrow array of `sql_type` (a column the rows lack reads
/// NULL).
fn column_of<'a>(
    name: &str,
    sql_type: &crate::types::SqlType,
    rows: impl ExactSizeIterator<Item = &'a JsonRow>,
) -> Result<ArrayRef> {
    let mut builder = ColumnBuilder::for_sql_type(sql_type, rows.len());
    for row in rows {
        builder.append_json(name, sql_type, value_of(row, name))?;
    }
    Ok(builder.finish())
}

/// A row's value of `column`, by its exact name as the seed's reader takes it (`row.get`).
fn value_of<'a>(row: &'a JsonRow, column: &str) -> Option<&'a Value> {
    row.get(column)
}

/// An error unless the table has every one of `columns` (the simulator and SQL Server refuse
/// a key on a column the table lacks, where reading it would give NULLs).
fn require_columns<'a>(
    table: &TableName,
    types: &ColumnTypes,
    mut columns: impl Iterator<Item = &'a str>,
) -> Result<()> {
    match columns.find(|name| !types.contains_key(*name)) {
        Some(missing) => Err(Error::invalid(format!("{table} has no column '{missing}'"))),
        None => Ok(()),
    }
}

/// The rows' keys on `columns`, in the rows' order.
fn key_tuples(columns: &[KeyColumn], rows: &[JsonRow]) -> Result<Vec<KeyTuple>> {
    let arrays = columns
        .iter()
        .map(|column| column_of(&column.name, &column.sql_type, rows.iter()))
        .collect::<Result<Vec<_>>>()?;
    (0..rows.len())
        .map(|row| {
            arrays
                .iter()
                .map(|array| keyset::key_value(array, row))
                .collect()
        })
        .collect()
}

impl SeedFake {
    /// The table's single integer key (what integer plans and grids cut on).
    fn integer_key(&self, catalog: &Catalog, table: &TableName) -> Result<KeyColumn> {
        let types = catalog.table_types(table)?;
        let keys = catalog.keys.get(&table.name).cloned().unwrap_or_default();
        match keys.as_slice() {
            [key]
                if types
                    .get(key)
                    .is_some_and(crate::types::SqlType::is_integer) =>
            {
                Ok(KeyColumn {
                    name: key.clone(),
                    sql_type: types[key].clone(),
                })
            }
            _ => Err(Error::invalid(format!(
                "{table} has no single integer unique key (its key is [{}]): cut its chunks on \
                 keyset bounds",
                keys.join(", ")
            ))),
        }
    }

    /// Every row's key on `columns`. On the table's unique key, two rows whose keys the seed
    /// holds apart (it compares exactly) but SQL Server's collation holds equal (`'a'` and
    /// `'A '`) are refused: a keyset walk trusts a unique key to move on.
    fn keys_of(&self, table: &TableName, columns: &[KeyColumn]) -> Result<Vec<KeyTuple>> {
        let catalog = self.files.catalog()?;
        let types = catalog.table_types(table)?;
        require_columns(
            table,
            &types,
            columns.iter().map(|column| column.name.as_str()),
        )?;
        let keys = key_tuples(columns, &self.files.rows(&table.name)?)?;
        let unique = catalog
            .keys
            .get(&table.name)
            .is_some_and(|index| index.iter().eq(columns.iter().map(|column| &column.name)));
        if unique {
            let mut sorted: Vec<&KeyTuple> = keys.iter().collect();
            sorted.sort_by(|a, b| keyset::compare_tuples(columns, a, b));
            if let Some(pair) = sorted.windows(2).find(|pair| {
                keyset::compare_tuples(columns, pair[0], pair[1]).is_eq() && pair[0] != pair[1]
            }) {
                return Err(Error::invalid(format!(
                    "{table}: the keys {:?} and {:?} differ in the seed's files but are one \
                     value under SQL Server's collation (case and trailing spaces ignored); \
                     a unique key on SQL Server could not hold both",
                    pair[0], pair[1]
                )));
            }
        }
        Ok(keys)
    }

    /// The table's rows and their values of `key` in grid units (`types`: the table's, from
    /// the catalog the caller read).
    fn grid_rows(
        &self,
        table: &TableName,
        types: &ColumnTypes,
        key: &KeyColumn,
    ) -> Result<GridRows> {
        key.require_grid_unit()?;
        require_columns(table, types, [key.name.as_str()].into_iter())?;
        let rows = self.files.rows(&table.name)?;
        let units = grid_units(&column_of(&key.name, &key.sql_type, rows.iter())?)?;
        Ok((rows, units))
    }

    /// The change rows of `read` in the order SQL Server returns them. Rows past `max_lsn`
    /// belong to a commit still being written (the seed appends change rows before the
    /// commit's mapping entry) and are left for a later read; a row at or below it without
    /// a mapping entry is an error, as in the seed's reader, never dropped.
    fn change_rows(&self, catalog: &Catalog, read: &ChangeRead) -> Result<Vec<ChangeRow>> {
        catalog.instance(&read.capture_instance)?;
        let committed: std::collections::BTreeSet<Lsn> = catalog
            .mapping
            .iter()
            .map(|entry| entry.start_lsn)
            .collect();
        let max_lsn = catalog.max_lsn().unwrap_or(Lsn::ZERO);
        let mut rows = Vec::new();
        for row in self.files.changes(&read.capture_instance)? {
            if row.start_lsn < read.from || row.start_lsn > read.to.min(max_lsn) {
                continue;
            }
            if !committed.contains(&row.start_lsn) {
                return Err(Error::Internal(format!(
                    "a change row of capture instance '{}' at {} has no lsn_time_mapping entry \
                     although the timeline passed it: the seed's files are out of order",
                    read.capture_instance, row.start_lsn
                )));
            }
            rows.push(row);
        }
        rows.sort_by(|a, b| {
            (a.start_lsn, a.command_id, a.seqval, a.operation).cmp(&(
                b.start_lsn,
                b.command_id,
                b.seqval,
                b.operation,
            ))
        });
        Ok(rows)
    }

    /// Sends the change rows of `read` in the output schema.
    fn produce_changes(&self, read: &ChangeRead, sender: &ReadSender) -> Result<()> {
        let catalog = self.files.catalog()?;
        let rows = self.change_rows(&catalog, read)?;
        let times: BTreeMap<Lsn, CommitTime> = catalog
            .mapping
            .iter()
            .map(|entry| (entry.start_lsn, entry.tran_end_time))
            .collect();
        let captured: Vec<String> = catalog
            .instance(&read.capture_instance)?
            .columns
            .iter()
            .flatten()
            .map(|(name, _)| name.clone())
            .collect();
        let schema = output_schema(&read.columns, read.include_command_id);
        for part in rows.chunks(read.batch_rows.max(1)) {
            let count = part.len();
            let mut columns: Vec<ArrayRef> = vec![
                Arc::new(StringArray::from(vec![
                    read.capture_instance.as_str();
                    count
                ])),
                Arc::new(StringArray::from_iter_values(
                    part.iter().map(|row| row.start_lsn.to_string()),
                )),
                Arc::new(StringArray::from_iter_values(
                    part.iter().map(|row| row.seqval.to_string()),
                )),
                Arc::new(Int32Array::from_iter_values(
                    part.iter().map(|row| row.operation),
                )),
            ];
            if read.include_command_id {
                columns.push(Arc::new(Int32Array::from_iter(
                    part.iter().map(|row| row.command_id),
                )));
            }
            columns.push(Arc::new(TimestampMicrosecondArray::from_iter(
                part.iter()
                    .map(|row| times.get(&row.start_lsn).map(|time| time.micros())),
            )));
            for column in &read.columns {
                // A column this instance does not capture reads NULL.
                columns.push(match captured.contains(&column.name) {
                    true => column_of(&column.name, &column.sql_type, part.iter().map(|r| &r.row))?,
                    false => {
                        new_null_array(schema.field_with_name(&column.name)?.data_type(), count)
                    }
                });
            }
            let batch = RecordBatch::try_new(Arc::clone(&schema), columns)?;
            if !send_bounded(sender, &batch, &read.batch_bytes)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Sends the current rows of `read`'s pieces, each in key order.
    fn produce_snapshot(&self, read: &SnapshotRead, sender: &ReadSender) -> Result<()> {
        let catalog = self.files.catalog()?;
        let types = catalog.table_types(&read.table)?;
        require_columns(
            &read.table,
            &types,
            read.keys.iter().map(|key| key.name.as_str()),
        )?;
        let rows = self.files.rows(&read.table.name)?;
        let schema = snapshot_schema(&read.columns, read.include_command_id);
        let integer = self.integer_key(&catalog, &read.table).ok();
        for piece in &read.pieces {
            let bounded = piece.range.lo.is_some() || piece.range.hi.is_some();
            if piece.keyset.is_none() && bounded && integer.is_none() {
                // The plan cut on an integer key the table no longer has.
                self.integer_key(&catalog, &read.table)?;
            }
            // Cut on keyset bounds, on the integer key, or (a table without one, read whole)
            // ordered by its unique index.
            let order = match (&piece.keyset, &integer) {
                (Some(_), _) => read.keys.clone(),
                (None, Some(key)) => vec![key.clone()],
                (None, None) => {
                    let index = catalog
                        .keys
                        .get(&read.table.name)
                        .cloned()
                        .unwrap_or_default();
                    index
                        .into_iter()
                        .filter_map(|name| {
                            let sql_type = types.get(&name)?.clone();
                            Some(KeyColumn { name, sql_type })
                        })
                        .collect()
                }
            };
            let mut inside: Vec<(KeyTuple, &JsonRow)> = key_tuples(&order, &rows)?
                .into_iter()
                .zip(&rows)
                .filter(|(key, _)| match (&piece.keyset, key.first()) {
                    (Some(range), _) => keyset::in_range(&read.keys, range, key),
                    (None, Some(KeyValue::Int(value))) if integer.is_some() => {
                        piece.range.contains(*value)
                    }
                    // NULL sorts first: the piece open below holds it, as SQL Server's
                    // `key < hi OR key IS NULL` does.
                    (None, Some(KeyValue::Null)) if integer.is_some() => piece.range.lo.is_none(),
                    _ => piece.range.lo.is_none() && piece.range.hi.is_none(),
                })
                .collect();
            inside.sort_by(|(a, _), (b, _)| keyset::compare_tuples(&order, a, b));
            for part in inside.chunks(read.batch_rows.max(1)) {
                let mut captured = Vec::with_capacity(read.columns.len());
                for column in &read.columns {
                    // A column the table no longer has (DROP COLUMN) reads NULL.
                    captured.push(match types.contains_key(&column.name) {
                        true => column_of(
                            &column.name,
                            &column.sql_type,
                            part.iter().map(|(_, row)| *row),
                        )?,
                        false => new_null_array(
                            schema.field_with_name(&column.name)?.data_type(),
                            part.len(),
                        ),
                    });
                }
                let batch = snapshot_batch(read, &schema, piece.chunk, part.len(), captured)?;
                if !send_bounded(sender, &batch, &read.batch_bytes)? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl CdcSource for SeedFake {
    fn describe(&self) -> String {
        format!("seed-fake:{}", self.files.dir().display())
    }

    /// Every table the seed's files describe; one they describe incompletely (an instance
    /// without captured columns or of a type without a mapping, or caught between the two
    /// file writes of the seed's `add_capture_instance`) is left out with a warning, and calls
    /// about it fail with the reason, so the other tables stay readable.
    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        let catalog = self.files.catalog()?;
        let tables: std::collections::BTreeSet<&String> = catalog
            .instances
            .values()
            .map(|instance| &instance.table)
            .collect();
        let mut tracked = Vec::new();
        for table in tables {
            match catalog.capture_instances(table) {
                Ok(capture_instances) => tracked.push(TrackedTable {
                    table: TableName::new(SCHEMA, table.as_str()),
                    capture_instances,
                }),
                Err(error) => {
                    tracing::warn!(%table, %error, "a table of the seed's files is left out")
                }
            }
        }
        Ok(tracked)
    }

    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>> {
        let catalog = self.files.catalog()?;
        catalog.table_types(table)?;
        catalog.capture_instances(&table.name)
    }

    /// `max_lsn` less one: the seed's `commit` writes a commit's mapping entry before the
    /// table's rows, so a read at `max_lsn` may not hold its last commit yet; every earlier
    /// one is whole (one writer commits at a time). The stream after the stamp reads that
    /// commit again, which a snapshot may always see. Never below the LSN just before the
    /// newest instance's start, as [`CdcSource::snapshot_lsn`].
    async fn snapshot_lsn(&self, table: &TableName) -> Result<Lsn> {
        let catalog = self.files.catalog()?;
        catalog.table_types(table)?;
        let newest_start = catalog
            .capture_instances(&table.name)?
            .iter()
            .filter_map(|instance| instance.start_lsn)
            .max()
            .unwrap_or(Lsn::ZERO);
        let max_lsn = catalog.max_lsn().unwrap_or(Lsn::ZERO);
        Ok(max_lsn.decrement().max(newest_start.decrement()))
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>> {
        Ok(self.files.catalog()?.max_lsn())
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn> {
        let catalog = self.files.catalog()?;
        catalog.instance(capture_instance)?;
        catalog
            .mins
            .get(capture_instance)
            .copied()
            .ok_or_else(|| capture_instance_not_processed(capture_instance))
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>> {
        let catalog = self.files.catalog()?;
        Ok(catalog
            .mapping
            .iter()
            .find(|entry| entry.start_lsn == lsn)
            .map(|entry| entry.tran_end_time))
    }

    async fn commit_at_or_before(&self, time: CommitTime) -> Result<Option<Lsn>> {
        let catalog = self.files.catalog()?;
        // The newest entry in time, as `ORDER BY start_lsn DESC` finds it.
        Ok(catalog
            .mapping
            .iter()
            .rev()
            .find(|entry| entry.tran_end_time <= time)
            .map(|entry| entry.start_lsn))
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        if n == 0 {
            return Err(Error::invalid("nth_commit_after needs n >= 1"));
        }
        let catalog = self.files.catalog()?;
        let after: Vec<Lsn> = catalog
            .mapping
            .iter()
            .map(|entry| entry.start_lsn)
            .filter(|start| *start > lsn)
            .collect();
        let index = usize::try_from(n - 1).unwrap_or(usize::MAX);
        Ok(after.get(index).or(after.last()).copied())
    }

    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>> {
        let catalog = self.files.catalog()?;
        catalog.instance(range.capture_instance)?;
        Ok(self
            .files
            .ddl(range.capture_instance)?
            .into_iter()
            .filter(|row| row.lsn > range.from && row.lsn <= range.to)
            .map(|row| DdlEntry {
                capture_instance: range.capture_instance.to_string(),
                ddl_lsn: row.lsn,
                // The seed times a DDL as the last commit at or before it.
                ddl_time: catalog.time_at_or_before(row.lsn).unwrap_or(CommitTime(0)),
                ddl_command: row.command,
            })
            .collect())
    }

    async fn split_points(&self, range: InstanceRange<'_>, tiles: NonZeroU32) -> Result<Vec<Tile>> {
        let catalog = self.files.catalog()?;
        catalog.instance(range.capture_instance)?;
        let read = ChangeRead {
            capture_instance: range.capture_instance.to_string(),
            from: range.from,
            to: range.to,
            columns: Vec::new(),
            include_command_id: false,
            batch_rows: 1,
            batch_bytes: crate::source::BatchBytes::fixed(1),
        };
        let rows = self.change_rows(&catalog, &read)?;
        let mut cutter = TileCutter::new(rows.len() as u64, tiles.get());
        for row in &rows {
            cutter.push(row.start_lsn);
        }
        Ok(cutter.finish())
    }

    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream> {
        if read.from > read.to {
            return Err(Error::invalid(format!(
                "read from {} is past its end {}",
                read.from, read.to
            )));
        }
        self.files.catalog()?.instance(&read.capture_instance)?;
        let source = self.clone();
        Ok(blocking_read(move |sender| {
            source.produce_changes(&read, sender)
        }))
    }

    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        let catalog = self.files.catalog()?;
        let key = self.integer_key(&catalog, table)?;
        let (rows, units) = self.grid_rows(table, &catalog.table_types(table)?, &key)?;
        let (min, max) = span(&units).unzip();
        Ok(KeyExtent {
            column: key.name,
            sql_type: key.sql_type,
            min,
            max,
            rows: rows.len() as u64,
        })
    }

    async fn table_rows(&self, table: &TableName) -> Result<u64> {
        self.files.catalog()?.table_types(table)?;
        Ok(self.files.rows(&table.name)?.len() as u64)
    }

    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        let catalog = self.files.catalog()?;
        let key = self.integer_key(&catalog, table)?;
        let mut units: Vec<i64> = self
            .grid_rows(table, &catalog.table_types(table)?, &key)?
            .1
            .into_iter()
            .flatten()
            .collect();
        units.sort_unstable();
        Ok(grid.count(units))
    }

    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>> {
        let types = self.files.catalog()?.table_types(table)?;
        Ok(span(&self.grid_rows(table, &types, key)?.1))
    }

    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums> {
        let types = self.files.catalog()?.table_types(table)?;
        let (rows, units) = self.grid_rows(table, &types, key)?;
        if values.is_empty() {
            return Ok(KeySums::count(&grid, units));
        }
        let columns = values
            .iter()
            .map(|column| match types.contains_key(&column.name) {
                true => column_of(&column.name, &column.sql_type, rows.iter()),
                false => Ok(new_null_array(
                    &column
                        .sql_type
                        .arrow_type()
                        .unwrap_or(arrow::datatypes::DataType::Null),
                    rows.len(),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let arrays: Vec<&dyn arrow::array::Array> =
            columns.iter().map(|column| column.as_ref()).collect();
        let digests = mssql_cdc_proto::digest::row_digests(&arrays)?;
        Ok(KeySums::count_rows(&grid, units.into_iter().zip(digests)))
    }

    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        Ok(self
            .keys_of(table, keys)?
            .into_iter()
            .max_by(|a, b| keyset::compare_tuples(keys, a, b)))
    }

    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>> {
        let keys = self.keys_of(table, seek.columns())?;
        Ok(keyset::nth_key(seek.columns(), keys, seek.seek()))
    }

    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream> {
        self.files.catalog()?.table_types(&read.table)?;
        let source = self.clone();
        Ok(blocking_read(move |sender| {
            source.produce_snapshot(&read, sender)
        }))
    }
}
