//! The embedded simulated CDC database.
//!
//! SQL Server cannot run on the development machines, so this module models what the
//! server's CDC does, faithfully enough that the Flight service, the writer and their tests
//! cannot tell the difference through [`CdcSource`](crate::source::CdcSource):
//!
//! - 10-byte LSNs allocated per commit; every row of a transaction carries the commit LSN as
//!   `__$start_lsn`, its operation's own (lower) LSN as `__$seqval`, and the statement's
//!   number as `__$command_id`;
//! - updates as operation 3 (before) and 4 (after) sharing one seqval; primary-key updates
//!   as delete + insert (1, 2) or, as SQL Server does for some in-place key updates, as 3 + 4
//!   of two different keys;
//! - `cdc.lsn_time_mapping` with a row per commit and idle ("dummy") rows, so `max_lsn`
//!   moves on a quiet database;
//! - up to two capture instances per table with their start LSNs and captured columns, a
//!   column added by DDL captured only by the newer instance, and the DDL history;
//! - retention cleanup moving `min_lsn`, and readers that see a cleanup happen mid-read;
//! - injectable faults ([`Faults`]): latency, a cleanup during a read, a dropped connection.
//!
//! The database lives in a directory ([`storage`] describes the files) and is written by one
//! process at a time ([`SimWriter`]) while any number of readers serve it.
//! What is not modelled is listed in docs/simulator.md.

pub(crate) mod keyset;
mod reader;
pub mod sample;
pub(crate) mod snapshot;
pub mod storage;
pub mod values;
pub mod workload;
mod writer;
pub mod zone;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use writer::{Clock, KeyUpdateStyle, SimWriter, Transaction};

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::source::TableName;
use storage::{ColumnDef, Manifest, Store, TableDef};

/// Faults a test injects into reads of the simulated database (process-local).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Delay added to every source call and every batch of a change read.
    pub latency: Duration,
    /// A cleanup that runs once, after a change read has produced this many rows.
    pub cleanup_during_read: Option<CleanupDuringRead>,
    /// A change read fails as a dropped connection after this many rows (once).
    pub drop_connection_after_rows: Option<u64>,
    /// Runs inside every snapshot read after its stamp was recorded and before the rows are
    /// read: a test commits here to land a commit between a chunk's stamp and its read.
    pub before_snapshot_read: Option<SnapshotHook>,
    /// After this many more snapshot reads have started, the next one fails as a dropped
    /// connection after its first batch (once).
    pub break_snapshot_read_after: Option<u64>,
    /// `key_sums` answers every value sum one more than the digests sum to: a source that
    /// writes some value's canonical text otherwise than the writer (docs/reconcile.md).
    pub perturb_value_sums: bool,
    /// `key_sums` asked for value sums fails (as SQL Server would on a value its digest
    /// expression cannot convert); without them it answers.
    pub fail_value_sums: bool,
}

/// A callback run by snapshot reads (see [`Faults::before_snapshot_read`]).
#[derive(Clone)]
pub struct SnapshotHook(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for SnapshotHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SnapshotHook")
    }
}

/// A cleanup triggered in the middle of a change read.
#[derive(Clone, Debug)]
pub struct CleanupDuringRead {
    /// The capture instance to clean up (`None`: all).
    pub capture_instance: Option<String>,
    /// The new low water mark.
    pub low_water_mark: Lsn,
    /// Rows the read produces before the cleanup runs.
    pub after_rows: u64,
}

/// Definition of a table to create: columns by name and type, one integer key column.
#[derive(Clone, Debug)]
pub struct TableSpec {
    /// The table.
    pub table: TableName,
    /// `(name, type, nullable)` in column order.
    pub columns: Vec<(String, String, bool)>,
    /// The row key column (int, bigint, smallint or tinyint), unique.
    pub key: String,
    /// The unique index CDC uses when it is not `[key]` (a composite or text key); `Some`
    /// of an empty list for a heap without one.
    pub index: Option<Vec<String>>,
    /// Columns whose values derive from the row key ([`storage::KeyDerived`]): unique when
    /// last in `index`, repeated otherwise.
    pub key_derived: Vec<String>,
}

/// A simulated CDC database, shared by its readers and writer in one process.
#[derive(Clone)]
pub struct SimDb {
    store: Arc<Store>,
    faults: Arc<Mutex<Faults>>,
}

impl SimDb {
    /// Opens an existing directory.
    pub fn open(dir: &Path) -> Result<Self> {
        Ok(SimDb {
            store: Arc::new(Store::open(dir)?),
            faults: Arc::default(),
        })
    }

    /// Creates a database in `dir` with these tables, CDC enabled on each (capture instance
    /// `<schema>_<table>`, one enable commit each), and no rows yet.
    pub fn create(dir: &Path, tables: &[TableSpec], start_time: CommitTime) -> Result<Self> {
        let mut definitions = Vec::new();
        for spec in tables {
            definitions.push(table_def(spec)?);
        }
        let manifest = Manifest {
            format: storage::FORMAT_VERSION,
            version: 0,
            database: "cdc_sim".into(),
            // VLF 0x2A, block 0x10: an LSN shape like a young SQL Server database's.
            next_lsn: "0x0000002A000000100000".parse().expect("constant lsn"),
            last_commit_time: start_time,
            tables: definitions,
            capture_instances: Vec::new(),
            ddl_history: Vec::new(),
            mapping_entries: 0,
            mapping_retained_from: 0,
            max_lsn: None,
            zone: None,
        };
        let db = SimDb {
            store: Arc::new(Store::create(dir, manifest)?),
            faults: Arc::default(),
        };
        let mut writer = db.writer(Clock::Virtual { step_micros: 1_000 }, 0)?;
        for spec in tables {
            let columns: Vec<String> = spec
                .columns
                .iter()
                .map(|(name, _, _)| name.clone())
                .collect();
            writer.enable_capture_instance(
                &spec.table,
                &spec.table.default_capture_instance(),
                &columns,
            )?;
        }
        writer.publish()?;
        Ok(db)
    }

    /// The directory.
    pub fn dir(&self) -> PathBuf {
        self.store.dir().to_path_buf()
    }

    /// The published catalog and positions.
    pub fn manifest(&self) -> Result<Arc<Manifest>> {
        self.store.manifest()
    }

    /// The names of `table`'s columns now, in `column_id` order: what a capture instance of
    /// every column captures (after an `ALTER TABLE ... ADD`, the switch a DBA makes).
    pub fn columns_of(&self, table: &TableName) -> Result<Vec<String>> {
        let manifest = self.manifest()?;
        let definition = manifest.table(table).ok_or_else(|| Error::TableNotFound {
            table: table.to_string(),
        })?;
        Ok(definition
            .columns
            .iter()
            .map(|column| column.name.clone())
            .collect())
    }

    /// A writer (takes the directory's writer lock on its first publish). Commit times come
    /// from `clock`; `seed` makes the generated keys and values reproducible.
    pub fn writer(&self, clock: Clock, seed: u64) -> Result<SimWriter> {
        SimWriter::new(self.clone(), clock, seed)
    }

    /// Sets the faults injected into this process's reads.
    pub fn set_faults(&self, faults: Faults) {
        *self
            .faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = faults;
    }

    fn faults(&self) -> Faults {
        self.faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn take_cleanup_during_read(&self, rows_read: u64) -> Option<CleanupDuringRead> {
        let mut faults = self
            .faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let due = faults
            .cleanup_during_read
            .as_ref()
            .is_some_and(|cleanup| rows_read >= cleanup.after_rows);
        if due {
            faults.cleanup_during_read.take()
        } else {
            None
        }
    }

    fn take_dropped_connection(&self, rows_read: u64) -> bool {
        let mut faults = self
            .faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let due = faults
            .drop_connection_after_rows
            .is_some_and(|after| rows_read >= after);
        if due {
            faults.drop_connection_after_rows = None;
        }
        due
    }

    /// Whether the snapshot read starting now is the one [`Faults::break_snapshot_read_after`]
    /// breaks; counts the read down otherwise.
    fn take_broken_snapshot_read(&self) -> bool {
        let mut faults = self
            .faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match faults.break_snapshot_read_after {
            Some(0) => {
                faults.break_snapshot_read_after = None;
                true
            }
            Some(after) => {
                faults.break_snapshot_read_after = Some(after - 1);
                false
            }
            None => false,
        }
    }

    /// Retention cleanup (`sys.sp_cdc_cleanup_change_table`): change rows below
    /// `low_water_mark` are removed and `min_lsn` moves up to it, for one capture instance or
    /// all; `cdc.lsn_time_mapping` rows below every instance's `min_lsn` go too.
    pub fn cleanup(&self, capture_instance: Option<&str>, low_water_mark: Lsn) -> Result<()> {
        let removed = self.store.publish(|store, manifest| {
            let max_lsn = manifest.max_lsn.unwrap_or(Lsn::ZERO);
            if low_water_mark > max_lsn.increment() {
                return Err(Error::invalid(format!(
                    "low water mark {low_water_mark} is past max_lsn {max_lsn}"
                )));
            }
            if let Some(name) = capture_instance
                && manifest.capture_instance(name).is_none()
            {
                return Err(Error::CaptureInstanceNotFound {
                    name: name.to_string(),
                    hint: String::new(),
                });
            }
            let mut removed = Vec::new();
            for ci in manifest
                .capture_instances
                .iter_mut()
                .filter(|ci| capture_instance.is_none_or(|name| ci.name == name))
            {
                ci.min_lsn = ci.min_lsn.max(low_water_mark);
                let min_lsn = ci.min_lsn;
                let (gone, kept): (Vec<_>, Vec<_>) = ci
                    .segments
                    .drain(..)
                    .partition(|segment| segment.max_lsn < min_lsn);
                ci.segments = kept;
                removed.extend(
                    gone.into_iter()
                        .map(|segment| store.segment_path(&ci.name, &segment.file)),
                );
            }
            let lowest = manifest.capture_instances.iter().map(|ci| ci.min_lsn).min();
            if let Some(lowest) = lowest {
                let mapping = store.mapping(manifest)?;
                let first_kept = mapping.first_after(lowest.decrement())?;
                manifest.mapping_retained_from += first_kept;
            }
            Ok(removed)
        })?;
        for path in removed {
            self.store.remove_unreferenced(&path);
        }
        tracing::info!(%low_water_mark, capture_instance = capture_instance.unwrap_or("*"), "cleanup");
        Ok(())
    }
}

fn table_def(spec: &TableSpec) -> Result<TableDef> {
    let mut columns = Vec::new();
    for (index, (name, type_text, nullable)) in spec.columns.iter().enumerate() {
        let sql_type: crate::types::SqlType = type_text
            .parse()
            .map_err(|error| Error::invalid(format!("{}: column '{name}': {error}", spec.table)))?;
        if sql_type.arrow_type().is_none() {
            return Err(Error::invalid(format!(
                "{}: column '{name}' has type {sql_type}, which the simulator does not generate",
                spec.table
            )));
        }
        columns.push(ColumnDef {
            name: name.clone(),
            column_id: i32::try_from(index + 1).map_err(|_| Error::invalid("too many columns"))?,
            from_key: spec.key_derived.contains(name).then(|| {
                // The index's last column makes its tuples unique; the others repeat.
                if spec.index.as_ref().and_then(|index| index.last()) == Some(name) {
                    storage::KeyDerived::Unique
                } else {
                    storage::KeyDerived::Repeated
                }
            }),
            sql_type,
            nullable: *nullable,
            added_in: None,
        });
    }
    for name in spec.index.iter().flatten().chain(&spec.key_derived) {
        if !columns.iter().any(|column| &column.name == name) {
            return Err(Error::invalid(format!(
                "{}: index or derived column '{name}' is not a column",
                spec.table
            )));
        }
    }
    let key = columns
        .iter()
        .find(|column| column.name == spec.key)
        .ok_or_else(|| {
            Error::invalid(format!(
                "{}: key column '{}' is not a column",
                spec.table, spec.key
            ))
        })?;
    if !key.sql_type.is_integer() || key.nullable {
        return Err(Error::invalid(format!(
            "{}: the simulator's key column '{}' must be a NOT NULL integer",
            spec.table, spec.key
        )));
    }
    Ok(TableDef {
        table: spec.table.clone(),
        columns,
        key: spec.key.clone(),
        index: spec.index.clone(),
        next_key: 1,
        row_count: 0,
        state_file: None,
    })
}
