//! Writing to the simulated database: transactions, DDL, capture instances, publishing.
//!
//! A [`SimWriter`] buffers committed transactions in memory (change rows per capture
//! instance, `lsn_time_mapping` rows, the tables' current rows) and makes them visible to
//! readers with [`SimWriter::publish`], which writes the segment and mapping files first and
//! the manifest last. Readers therefore see whole commits, in LSN order, never a part of one.
//!
//! LSNs: a transaction takes a fresh log block; its operations take slots 1, 2, ... of it
//! (their `__$seqval`) and the commit takes the slot after the last operation (its
//! `__$start_lsn`), so every seqval is below its commit LSN, as in SQL Server's log.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, FixedSizeBinaryBuilder, Int32Builder, TimestampMicrosecondBuilder};
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::SimDb;
use super::storage::{
    CaptureInstanceState, ColumnDef, Manifest, MappingEntry, MappingKind, SegmentReader,
    SegmentRef, segment_schema, write_segment,
};
use super::values::ColumnBuilder;
use crate::error::{Error, Result};
use crate::lsn::{LSN_LEN, Lsn};
use crate::offset::CommitTime;
use crate::source::{CapturedColumn, DdlEntry, TableName};
use crate::types::SqlType;

mod transaction;

pub use transaction::Transaction;

/// Rows per record batch in a segment file.
const SEGMENT_BATCH_ROWS: usize = 4_096;
/// A published segment smaller than this is rewritten together with the next publish's rows,
/// so a slow workload does not leave thousands of tiny files.
const MERGE_BELOW_ROWS: u64 = 16_384;
/// Buffered change rows above which a commit publishes by itself (bounds writer memory).
const AUTO_PUBLISH_ROWS: u64 = 1_000_000;

/// Where commit times come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// The machine's clock (UTC), never going backwards.
    Wall,
    /// Each commit `step_micros` after the previous one: reproducible times for tests.
    Virtual {
        /// Microseconds between two commits.
        step_micros: i64,
    },
}

/// How a primary-key update is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyUpdateStyle {
    /// Delete of the old key and insert of the new (operations 1 and 2): SQL Server's usual
    /// record of an update that changes a unique index key.
    DeleteInsert,
    /// Before-image of the old key and after-image of the new sharing one seqval (3 and 4).
    InPlace,
}

/// The current rows of a table: key to content number, with O(1) random picks.
#[derive(Default)]
struct TableRows {
    keys: Vec<i64>,
    contents: Vec<u64>,
    index: HashMap<i64, usize>,
    dirty: bool,
    /// The table's generation ([`super::storage::content_generation`]): new content numbers
    /// carry it.
    generation: u16,
}

impl TableRows {
    fn from_map(map: BTreeMap<i64, u64>) -> Self {
        let mut rows = TableRows::default();
        for (key, content) in map {
            rows.insert(key, content);
        }
        rows.dirty = false;
        rows
    }

    fn insert(&mut self, key: i64, content: u64) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key, self.keys.len());
        self.keys.push(key);
        self.contents.push(content);
        self.dirty = true;
        true
    }

    fn remove(&mut self, key: i64) -> Option<u64> {
        let position = self.index.remove(&key)?;
        let content = self.contents.swap_remove(position);
        self.keys.swap_remove(position);
        if let Some(&moved) = self.keys.get(position) {
            self.index.insert(moved, position);
        }
        self.dirty = true;
        Some(content)
    }

    fn get(&self, key: i64) -> Option<u64> {
        self.index
            .get(&key)
            .map(|&position| self.contents[position])
    }

    fn set(&mut self, key: i64, content: u64) {
        if let Some(&position) = self.index.get(&key) {
            self.contents[position] = content;
            self.dirty = true;
        }
    }

    fn to_map(&self) -> BTreeMap<i64, u64> {
        self.keys
            .iter()
            .copied()
            .zip(self.contents.iter().copied())
            .collect()
    }
}

/// Change rows of one capture instance waiting to be published.
struct CaptureBuffer {
    table: TableName,
    start_lsn: Lsn,
    /// Table columns in capture order, with whether each is the key.
    columns: Vec<(ColumnDef, bool)>,
    schema: SchemaRef,
    start_lsns: FixedSizeBinaryBuilder,
    seqvals: FixedSizeBinaryBuilder,
    operations: Int32Builder,
    command_ids: Int32Builder,
    commit_times: TimestampMicrosecondBuilder,
    values: Vec<ColumnBuilder>,
    buffered: usize,
    batches: Vec<RecordBatch>,
}

impl CaptureBuffer {
    fn new(state: &CaptureInstanceState, table: &super::storage::TableDef) -> Result<Self> {
        let mut columns = Vec::new();
        for captured in &state.columns {
            let mut definition = table.column(&captured.name).cloned().ok_or_else(|| {
                Error::Internal(format!(
                    "captured column {} is not in {}",
                    captured.name, table.table
                ))
            })?;
            // The change table keeps the type the column had when capture began.
            definition.sql_type = captured.sql_type.clone();
            let is_key = captured.name == table.key;
            columns.push((definition, is_key));
        }
        let values = columns
            .iter()
            .map(|(column, _)| ColumnBuilder::for_sql_type(&column.sql_type, SEGMENT_BATCH_ROWS))
            .collect();
        Ok(CaptureBuffer {
            table: state.table.clone(),
            start_lsn: state.start_lsn,
            schema: segment_schema(&state.columns),
            columns,
            start_lsns: FixedSizeBinaryBuilder::with_capacity(SEGMENT_BATCH_ROWS, LSN_LEN as i32),
            seqvals: FixedSizeBinaryBuilder::with_capacity(SEGMENT_BATCH_ROWS, LSN_LEN as i32),
            operations: Int32Builder::with_capacity(SEGMENT_BATCH_ROWS),
            command_ids: Int32Builder::with_capacity(SEGMENT_BATCH_ROWS),
            commit_times: TimestampMicrosecondBuilder::with_capacity(SEGMENT_BATCH_ROWS),
            values,
            buffered: 0,
            batches: Vec::new(),
        })
    }

    fn append(&mut self, commit: Lsn, time: CommitTime, change: &Change) -> Result<()> {
        self.start_lsns.append_value(commit.as_bytes())?;
        self.seqvals.append_value(change.seqval.as_bytes())?;
        self.operations.append_value(change.operation);
        self.command_ids.append_value(change.command_id);
        self.commit_times
            .append_value(time.to_millis_precision().micros());
        for ((column, is_key), builder) in self.columns.iter().zip(self.values.iter_mut()) {
            builder.append_generated(column, *is_key, change.key, change.content);
        }
        self.buffered += 1;
        if self.buffered >= SEGMENT_BATCH_ROWS {
            self.seal()?;
        }
        Ok(())
    }

    fn seal(&mut self) -> Result<()> {
        if self.buffered == 0 {
            return Ok(());
        }
        let mut arrays: Vec<ArrayRef> = vec![
            Arc::new(self.start_lsns.finish()),
            Arc::new(self.seqvals.finish()),
            Arc::new(self.operations.finish()),
            Arc::new(self.command_ids.finish()),
            Arc::new(self.commit_times.finish()),
        ];
        arrays.extend(self.values.iter_mut().map(ColumnBuilder::finish));
        self.batches
            .push(RecordBatch::try_new(Arc::clone(&self.schema), arrays)?);
        self.buffered = 0;
        Ok(())
    }
}

/// One row change inside a transaction.
struct Change {
    table: TableName,
    operation: i32,
    seqval: Lsn,
    command_id: i32,
    key: i64,
    content: u64,
}

/// The single writer of a simulated database.
pub struct SimWriter {
    db: SimDb,
    clock: Clock,
    rng: StdRng,
    next_lsn: Lsn,
    last_time: CommitTime,
    tables: BTreeMap<TableName, TableRows>,
    next_keys: BTreeMap<TableName, i64>,
    buffers: BTreeMap<String, CaptureBuffer>,
    mapping: Vec<MappingEntry>,
    pending_rows: u64,
    journal: Option<BufWriter<File>>,
}

impl SimWriter {
    pub(super) fn new(db: SimDb, clock: Clock, seed: u64) -> Result<Self> {
        db.store.acquire_writer()?;
        let release = |error: Error| {
            db.store.release_writer();
            error
        };
        let manifest = db.manifest().map_err(release)?;
        let mut tables = BTreeMap::new();
        let mut next_keys = BTreeMap::new();
        for table in &manifest.tables {
            let rows = db.store.read_state(table).map_err(release)?;
            let mut rows = TableRows::from_map(Arc::unwrap_or_clone(rows));
            rows.generation = table.generation();
            tables.insert(table.table.clone(), rows);
            next_keys.insert(table.table.clone(), table.next_key);
        }
        let mut writer = SimWriter {
            clock,
            rng: StdRng::seed_from_u64(seed),
            next_lsn: manifest.next_lsn,
            last_time: manifest.last_commit_time,
            tables,
            next_keys,
            buffers: BTreeMap::new(),
            mapping: Vec::new(),
            pending_rows: 0,
            journal: None,
            db,
        };
        writer.rebuild_buffers(&manifest)?;
        Ok(writer)
    }

    fn rebuild_buffers(&mut self, manifest: &Manifest) -> Result<()> {
        self.buffers.clear();
        for state in &manifest.capture_instances {
            let table = manifest.table(&state.table).ok_or_else(|| {
                Error::Internal(format!("capture instance {} has no table", state.name))
            })?;
            self.buffers
                .insert(state.name.clone(), CaptureBuffer::new(state, table)?);
        }
        Ok(())
    }

    /// Records every committed change row as a JSON line in `path` (the tests' oracle):
    /// `{"table", "start_lsn", "seqval", "operation", "command_id", "key", "content"}`.
    pub fn set_journal(&mut self, path: &Path) -> Result<()> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|error| Error::io(format!("opening journal {}", path.display()), error))?;
        self.journal = Some(BufWriter::new(file));
        Ok(())
    }

    /// The random number generator the workload draws from (seeded).
    pub fn rng(&mut self) -> &mut StdRng {
        &mut self.rng
    }

    /// Tables of the database.
    pub fn tables(&self) -> Vec<TableName> {
        self.tables.keys().cloned().collect()
    }

    /// Rows currently in a table.
    pub fn row_count(&self, table: &TableName) -> usize {
        self.tables.get(table).map_or(0, |rows| rows.keys.len())
    }

    /// The content number of a row (its values are a function of it).
    pub fn content_of(&self, table: &TableName, key: i64) -> Option<u64> {
        self.tables.get(table)?.get(key)
    }

    /// Starts a transaction.
    pub fn begin(&mut self) -> Transaction<'_> {
        Transaction {
            writer: self,
            changes: Vec::new(),
            operations: 0,
            command_id: 0,
        }
    }

    fn next_time(&mut self) -> CommitTime {
        let candidate = match self.clock {
            Clock::Wall => CommitTime(chrono::Utc::now().timestamp_micros()),
            Clock::Virtual { step_micros } => CommitTime(self.last_time.0 + step_micros),
        };
        self.last_time = candidate.max(self.last_time);
        self.last_time
    }

    /// Allocates a fresh log block; returns its first LSN (slot 0).
    fn next_block(&mut self) -> Lsn {
        let value = self.next_lsn.to_u128();
        let block = (value + 0xFFFF) & !0xFFFF;
        Lsn::from_u128(block).expect("the simulator never exhausts 80-bit LSNs")
    }

    fn record_mapping(&mut self, lsn: Lsn, kind: MappingKind, time: CommitTime) {
        self.mapping.push(MappingEntry {
            lsn,
            kind,
            begin_time: CommitTime(time.0 - 500),
            end_time: time,
        });
        self.next_lsn = lsn.increment();
    }

    /// Sets the server clock's named zone (`None`: UTC), as a server moved to another zone
    /// would: commit times are recorded in its local time from now on and read back through
    /// the fall-back rule ([`crate::sim::zone`]). Publishes at once.
    pub fn set_time_zone(&mut self, zone: Option<crate::sim::zone::SimZone>) -> Result<()> {
        self.publish()?;
        self.db.store.publish(move |_, manifest| {
            manifest.zone = zone;
            Ok(())
        })
    }

    /// Writes an idle ("dummy") `lsn_time_mapping` row, as the capture job does when nothing
    /// happened: `max_lsn` moves, no change rows appear. Returns its LSN.
    pub fn idle(&mut self) -> Lsn {
        let lsn = self.next_block().increment();
        let time = self.next_time();
        self.record_mapping(lsn, MappingKind::Idle, time);
        lsn
    }

    fn commit(&mut self, mut changes: Vec<Change>, operations: u32) -> Result<Option<Lsn>> {
        if changes.is_empty() {
            return Ok(None);
        }
        let base = self.next_block().to_u128();
        let commit = Lsn::from_u128(base + u128::from(operations) + 1).expect("80-bit lsn");
        for change in &mut changes {
            // Seqvals were numbered 1..=operations inside the block.
            change.seqval = Lsn::from_u128(base + change.seqval.to_u128()).expect("80-bit lsn");
        }
        let time = self.next_time();
        for buffer in self.buffers.values_mut() {
            if buffer.start_lsn > commit {
                continue;
            }
            for change in &changes {
                if change.table == buffer.table {
                    buffer.append(commit, time, change)?;
                }
            }
        }
        self.pending_rows += changes.len() as u64;
        if let Some(journal) = &mut self.journal {
            for change in &changes {
                let line = serde_json::json!({
                    "table": change.table.to_string(),
                    "start_lsn": commit,
                    "seqval": change.seqval,
                    "operation": change.operation,
                    "command_id": change.command_id,
                    "key": change.key,
                    "content": change.content.to_string(),
                });
                writeln!(journal, "{line}")
                    .map_err(|error| Error::io("writing the journal", error))?;
            }
        }
        self.record_mapping(commit, MappingKind::Commit, time);
        if self.pending_rows >= AUTO_PUBLISH_ROWS {
            self.publish()?;
        }
        Ok(Some(commit))
    }

    /// Makes everything committed so far visible to readers.
    pub fn publish(&mut self) -> Result<()> {
        if let Some(journal) = &mut self.journal {
            journal
                .flush()
                .map_err(|error| Error::io("writing the journal", error))?;
        }
        for buffer in self.buffers.values_mut() {
            buffer.seal()?;
        }
        let mut pending: Vec<(String, SchemaRef, Vec<RecordBatch>)> = Vec::new();
        for (name, buffer) in &mut self.buffers {
            if !buffer.batches.is_empty() {
                pending.push((
                    name.clone(),
                    Arc::clone(&buffer.schema),
                    std::mem::take(&mut buffer.batches),
                ));
            }
        }
        let dirty: Vec<(TableName, BTreeMap<i64, u64>, usize)> = self
            .tables
            .iter()
            .filter(|(_, rows)| rows.dirty)
            .map(|(name, rows)| (name.clone(), rows.to_map(), rows.keys.len()))
            .collect();
        let mapping = std::mem::take(&mut self.mapping);
        let (next_lsn, last_time) = (self.next_lsn, self.last_time);
        let next_keys = self.next_keys.clone();
        let store = Arc::clone(&self.db.store);
        let replaced = store.publish(|store, manifest| {
            let mut replaced = Vec::new();
            for (name, schema, batches) in &pending {
                let state = manifest
                    .capture_instances
                    .iter_mut()
                    .find(|ci| &ci.name == name)
                    .ok_or_else(|| Error::Internal(format!("capture instance {name} vanished")))?;
                replaced.extend(append_segment(store, state, schema, batches)?);
            }
            store.append_mapping(manifest, &mapping)?;
            manifest.mapping_entries += mapping.len() as u64;
            if let Some(last) = mapping.last() {
                manifest.max_lsn = Some(last.lsn);
                // The capture job's scan reached these enables.
                for state in &mut manifest.capture_instances {
                    if state.start_lsn <= last.lsn {
                        state.awaiting_capture = false;
                    }
                }
            }
            manifest.next_lsn = next_lsn;
            manifest.last_commit_time = last_time;
            let version = manifest.version + 1;
            for (name, rows, count) in &dirty {
                let table = manifest
                    .tables
                    .iter_mut()
                    .find(|table| &table.table == name)
                    .ok_or_else(|| Error::Internal(format!("table {name} vanished")))?;
                let file = store.write_state(name, version, rows)?;
                if let Some(old) = table.state_file.replace(file) {
                    replaced.push(store.dir().join("state").join(old));
                }
                table.row_count = *count as u64;
            }
            for table in &mut manifest.tables {
                if let Some(&next_key) = next_keys.get(&table.table) {
                    table.next_key = next_key;
                }
            }
            Ok(replaced)
        })?;
        for path in replaced {
            store.remove_unreferenced(&path);
        }
        for rows in self.tables.values_mut() {
            rows.dirty = false;
        }
        self.pending_rows = 0;
        Ok(())
    }

    /// Enables CDC on a table under a new capture instance capturing `columns`: one commit
    /// whose LSN becomes the instance's start LSN; every later commit is captured by it.
    /// A table has at most two capture instances, as in SQL Server.
    pub fn enable_capture_instance(
        &mut self,
        table: &TableName,
        name: &str,
        columns: &[String],
    ) -> Result<Lsn> {
        self.enable(table, name, columns, true)
    }

    /// [`SimWriter::enable_capture_instance`] while SQL Server Agent's capture job has not run
    /// since: the instance is listed with a NULL `start_lsn` (and `sys.fn_cdc_get_min_lsn`
    /// has nothing for it) until the capture job's next scan, which here is the next commit
    /// or idle entry this writer publishes. `max_lsn` stays below the enable until then.
    /// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-change-tables-transact-sql>
    pub fn enable_capture_instance_unprocessed(
        &mut self,
        table: &TableName,
        name: &str,
        columns: &[String],
    ) -> Result<Lsn> {
        self.enable(table, name, columns, false)
    }

    fn enable(
        &mut self,
        table: &TableName,
        name: &str,
        columns: &[String],
        processed: bool,
    ) -> Result<Lsn> {
        validate_identifier(name)?;
        self.publish()?;
        let manifest = self.db.manifest()?;
        let definition = manifest
            .table(table)
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })?
            .clone();
        if manifest.capture_instance(name).is_some() {
            return Err(Error::invalid(format!(
                "capture instance '{name}' already exists"
            )));
        }
        if manifest
            .capture_instances
            .iter()
            .filter(|ci| &ci.table == table)
            .count()
            >= 2
        {
            return Err(Error::invalid(format!(
                "{table} already has two capture instances; disable one first"
            )));
        }
        let mut captured = Vec::new();
        for (ordinal, column_name) in columns.iter().enumerate() {
            let column = definition.column(column_name).ok_or_else(|| {
                Error::invalid(format!("column '{column_name}' is not a column of {table}"))
            })?;
            captured.push(CapturedColumn {
                name: column.name.clone(),
                column_id: column.column_id,
                ordinal: i32::try_from(ordinal + 1)
                    .map_err(|_| Error::invalid("too many columns"))?,
                sql_type: column.sql_type.clone(),
            });
        }
        if !columns.contains(&definition.key) {
            return Err(Error::invalid(format!(
                "capture instance '{name}' must capture the key column '{}'",
                definition.key
            )));
        }
        let start = self.next_block().increment();
        let time = self.next_time();
        if processed {
            self.record_mapping(start, MappingKind::Commit, time);
        } else {
            self.next_lsn = start.increment();
        }
        let state = CaptureInstanceState {
            name: name.to_string(),
            table: table.clone(),
            start_lsn: start,
            create_date: time,
            columns: captured,
            index_columns: definition.index_columns(),
            min_lsn: start,
            awaiting_capture: !processed,
            segments: Vec::new(),
            next_segment: 0,
        };
        let added = state.clone();
        self.db.store.publish(move |store, manifest| {
            std::fs::create_dir_all(store.dir().join("ct").join(&added.name))
                .map_err(|error| Error::io("creating the change table directory", error))?;
            manifest.capture_instances.push(added);
            Ok(())
        })?;
        self.publish()?;
        let manifest = self.db.manifest()?;
        self.rebuild_buffers(&manifest)?;
        tracing::info!(capture_instance = name, %table, start_lsn = %start, "capture instance enabled");
        Ok(start)
    }

    /// `ALTER TABLE ... ADD <column>`: a DDL commit recorded in the DDL history of every
    /// capture instance of the table. Existing instances do not capture the new column.
    pub fn add_column(
        &mut self,
        table: &TableName,
        name: &str,
        sql_type: &str,
        nullable: bool,
    ) -> Result<Lsn> {
        validate_identifier(name)?;
        let parsed = simulated_type(sql_type)?;
        let manifest = self.db.manifest()?;
        let definition = manifest.table(table).ok_or_else(|| Error::TableNotFound {
            table: table.to_string(),
        })?;
        if definition.column(name).is_some() {
            return Err(Error::invalid(format!(
                "{table} already has a column '{name}'"
            )));
        }
        let null_text = if nullable { "NULL" } else { "NOT NULL" };
        let command = format!(
            "ALTER TABLE [{}].[{}] ADD [{name}] {parsed} {null_text}",
            table.schema, table.name
        );
        let generation = definition.generation() + 1;
        let column = ColumnDef {
            from_key: None,
            added_in: nullable.then_some(generation),
            name: name.to_string(),
            column_id: definition
                .columns
                .iter()
                .map(|c| c.column_id)
                .max()
                .unwrap_or(0)
                + 1,
            sql_type: parsed,
            nullable,
        };
        let lsn = self.record_ddl(table, &command, Some(ColumnChange::Add(column)))?;
        if nullable && let Some(rows) = self.tables.get_mut(table) {
            rows.generation = generation;
        }
        Ok(lsn)
    }

    /// `ALTER TABLE ... ALTER COLUMN <name> <type>`: SQL Server propagates a tracked column's
    /// new type to the change table, so the rows captured afterwards carry it, and records
    /// the DDL in the history of every capture instance of the table.
    /// <https://learn.microsoft.com/sql/relational-databases/track-changes/about-change-data-capture-sql-server>
    /// ("Handling changes to source tables").
    pub fn alter_column(&mut self, table: &TableName, name: &str, sql_type: &str) -> Result<Lsn> {
        let parsed = simulated_type(sql_type)?;
        let manifest = self.db.manifest()?;
        let definition = manifest.table(table).ok_or_else(|| Error::TableNotFound {
            table: table.to_string(),
        })?;
        let column = definition
            .column(name)
            .ok_or_else(|| Error::invalid(format!("{table} has no column '{name}'")))?;
        if column.from_key.is_some() || definition.key == name {
            return Err(Error::invalid(format!(
                "the simulator does not alter '{name}': its values derive from the row key"
            )));
        }
        let null_text = if column.nullable { "NULL" } else { "NOT NULL" };
        let command = format!(
            "ALTER TABLE [{}].[{}] ALTER COLUMN [{name}] {parsed} {null_text}",
            table.schema, table.name
        );
        let lsn = self.record_ddl(
            table,
            &command,
            Some(ColumnChange::Alter {
                name: name.to_string(),
                sql_type: parsed,
            }),
        )?;
        // Rows captured from now on are written with the new type.
        let manifest = self.db.manifest()?;
        self.rebuild_buffers(&manifest)?;
        Ok(lsn)
    }

    /// Records a DDL statement on a table (without changing its columns), as SQL Server does
    /// for any DDL on a tracked table: one commit and a DDL history row per capture instance.
    pub fn ddl(&mut self, table: &TableName, command: &str) -> Result<Lsn> {
        self.record_ddl(table, command, None)
    }

    fn record_ddl(
        &mut self,
        table: &TableName,
        command: &str,
        column: Option<ColumnChange>,
    ) -> Result<Lsn> {
        self.publish()?;
        let lsn = self.next_block().increment();
        let time = self.next_time();
        self.record_mapping(lsn, MappingKind::Commit, time);
        let table_name = table.clone();
        let command = command.to_string();
        self.db.store.publish(move |_, manifest| {
            let instances: Vec<String> = manifest
                .capture_instances
                .iter()
                .filter(|ci| ci.table == table_name)
                .map(|ci| ci.name.clone())
                .collect();
            for capture_instance in instances {
                manifest.ddl_history.push(DdlEntry {
                    capture_instance,
                    ddl_lsn: lsn,
                    ddl_time: time,
                    ddl_command: command.clone(),
                });
            }
            let Some(change) = column else {
                return Ok(());
            };
            let definition = manifest
                .tables
                .iter_mut()
                .find(|def| def.table == table_name)
                .ok_or_else(|| Error::TableNotFound {
                    table: table_name.to_string(),
                })?;
            match change {
                ColumnChange::Add(column) => definition.columns.push(column),
                ColumnChange::Alter { name, sql_type } => {
                    for column in definition.columns.iter_mut().filter(|c| c.name == name) {
                        column.sql_type = sql_type.clone();
                    }
                    let captured = manifest
                        .capture_instances
                        .iter_mut()
                        .filter(|ci| ci.table == table_name)
                        .flat_map(|ci| ci.columns.iter_mut())
                        .filter(|c| c.name == name);
                    for column in captured {
                        column.sql_type = sql_type.clone();
                    }
                }
            }
            Ok(())
        })?;
        self.publish()?;
        Ok(lsn)
    }
}

/// A change of a table's columns a DDL commit makes.
enum ColumnChange {
    /// `ADD`: a new column, not captured by existing instances.
    Add(ColumnDef),
    /// `ALTER COLUMN`: a new type, propagated to the change tables that capture it.
    Alter { name: String, sql_type: SqlType },
}

impl Drop for SimWriter {
    fn drop(&mut self) {
        // Unpublished commits are lost, as uncommitted work is when a process dies.
        self.db.store.release_writer();
    }
}

/// Appends batches to a capture instance's last segment when it is small (rewriting it as
/// one file) or as a new segment; returns the paths of files no longer referenced.
fn append_segment(
    store: &super::storage::Store,
    state: &mut CaptureInstanceState,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Vec<std::path::PathBuf>> {
    let mut combined: Vec<RecordBatch> = Vec::new();
    let mut replaced = Vec::new();
    let merge = state
        .segments
        .last()
        .is_some_and(|last| last.rows < MERGE_BELOW_ROWS);
    if merge {
        let last: SegmentRef = state.segments.pop().expect("checked above");
        let path = store.segment_path(&state.name, &last.file);
        let mut reader = SegmentReader::open(&path)?;
        if reader.schema().fields() == schema.fields() {
            for index in 0..reader.batches_overlapping(Lsn::ZERO, Lsn::MAX).end {
                combined.push(reader.read(index)?);
            }
            replaced.push(path);
        } else {
            // Written before an ALTER COLUMN: its rows keep their type.
            state.segments.push(last);
        }
    }
    combined.extend(batches.iter().cloned());
    // Rebatch so that small publishes do not leave many tiny IPC batches.
    let whole = concat_batches(schema, &combined)?;
    let mut rebatched = Vec::new();
    let mut offset = 0;
    while offset < whole.num_rows() {
        let length = SEGMENT_BATCH_ROWS.min(whole.num_rows() - offset);
        rebatched.push(whole.slice(offset, length));
        offset += length;
    }
    let file = format!("{:08}.arrow", state.next_segment);
    state.next_segment += 1;
    let segment = write_segment(&store.segment_path(&state.name, &file), schema, &rebatched)?;
    state.segments.push(segment);
    Ok(replaced)
}

/// A column type the simulator can generate values of.
fn simulated_type(sql_type: &str) -> Result<SqlType> {
    let parsed: SqlType = sql_type
        .parse()
        .map_err(|error: crate::types::SqlTypeParseError| Error::invalid(error.to_string()))?;
    if parsed.arrow_type().is_none() {
        return Err(Error::invalid(format!(
            "the simulator does not generate {parsed} values"
        )));
    }
    Ok(parsed)
}

/// Refuses identifiers SQL Server would need quoting tricks for.
fn validate_identifier(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 100
        && !name.contains(']')
        && !name.contains('/')
        && !name.chars().any(char::is_control);
    if valid {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "'{name}' is not a valid name: 1 to 100 characters without ']', '/' or control characters"
        )))
    }
}
