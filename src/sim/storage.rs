//! How the simulated database lies on disk.
//!
//! ```text
//! <dir>/manifest.json          the catalog and every published position; replaced atomically
//!                              (write a temporary file, then rename): the commit point
//! <dir>/lsn_time_mapping.bin   cdc.lsn_time_mapping: append-only 32-byte records
//!                              (start_lsn, kind, tran_begin_time, tran_end_time)
//! <dir>/ct/<ci>/<n>.arrow      change-table segments: Arrow IPC files sorted by
//!                              (__$start_lsn, __$command_id, __$seqval, __$operation)
//! <dir>/state/<table>-<v>.bin  the tables' current rows as (key, content) pairs
//! <dir>/writer.lock            held by the one process that writes
//! ```
//!
//! A reader (the Flight server) never locks: it reloads the manifest when the file changed and
//! reads only what the manifest publishes, so a workload can run in another process while
//! the server serves. Mapping records past the manifest's count and segments it does not list
//! are invisible; a writer that dies between writing them and the manifest leaves nothing a
//! reader sees.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use arrow::array::{Array, FixedSizeBinaryArray};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use arrow::ipc::convert::fb_to_schema;
use arrow::ipc::reader::{FileDecoder, read_footer_length};
use arrow::ipc::writer::FileWriter;
use arrow::ipc::{Block, root_as_footer, root_as_message};
use arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::lsn::{LSN_LEN, Lsn};
use crate::offset::CommitTime;
use crate::sim::zone::SimZone;
use crate::source::{CapturedColumn, DdlEntry, TableName};
use crate::types::SqlType;

/// Tries at taking the writer lock, 100 ms apart.
const LOCK_ATTEMPTS: u32 = 10;

/// Version of the on-disk format; a directory of another version is refused.
pub const FORMAT_VERSION: u32 = 1;

/// One column of a simulated table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnDef {
    /// Column name.
    pub name: String,
    /// `column_id` in the table (never reused after a drop).
    pub column_id: i32,
    /// SQL Server type.
    #[serde(
        serialize_with = "mssql_cdc_proto::catalog::serialize_sql_type",
        deserialize_with = "mssql_cdc_proto::catalog::deserialize_sql_type"
    )]
    pub sql_type: SqlType,
    /// Whether NULL is allowed.
    pub nullable: bool,
    /// Set when the column's values are a function of the row's key rather than of its
    /// content: key columns of composite or text unique indexes, and repeated columns a
    /// snapshot can be cut on, all stable under updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_key: Option<KeyDerived>,
    /// Set on a nullable column `ALTER TABLE ... ADD` added without a default: the table's
    /// generation it began (see [`content_generation`]). A row last written before it reads
    /// NULL there, as SQL Server gives every existing row NULL
    /// (<https://learn.microsoft.com/sql/t-sql/statements/alter-table-transact-sql>, "Adding
    /// NULL columns"); a row inserted or updated since has a value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub added_in: Option<u16>,
}

/// The bits of a row's content number below its generation.
const CONTENT_VALUE_BITS: u32 = 48;

/// The table generation a row's content number was written in (its top 16 bits): how many
/// columns had been added to the table then.
pub fn content_generation(content: u64) -> u16 {
    (content >> CONTENT_VALUE_BITS) as u16
}

/// A content number written in `generation`, its other bits from `random`.
pub fn content_in(generation: u16, random: u64) -> u64 {
    (u64::from(generation) << CONTENT_VALUE_BITS) | (random & ((1 << CONTENT_VALUE_BITS) - 1))
}

/// How a column derived from the row key repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyDerived {
    /// One value per key (a column of the unique index).
    Unique,
    /// A few values shared by many rows, case-mixed, NULL now and then when nullable.
    Repeated,
}

/// A simulated table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableDef {
    /// Schema and name.
    pub table: TableName,
    /// Columns in `column_id` order.
    pub columns: Vec<ColumnDef>,
    /// The row key: one integer column, unique, which the rows are stored by.
    pub key: String,
    /// The columns of the unique index CDC uses when it is not `[key]`; empty for a heap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<Vec<String>>,
    /// Next key an insert takes.
    pub next_key: i64,
    /// Rows in the table now.
    pub row_count: u64,
    /// File under `state/` holding the current rows, when the table has any.
    pub state_file: Option<String>,
}

impl TableDef {
    /// The column with this name.
    pub fn column(&self, name: &str) -> Option<&ColumnDef> {
        self.columns.iter().find(|column| column.name == name)
    }

    /// The table's generation: how many columns were added to it after its creation.
    pub fn generation(&self) -> u16 {
        self.columns
            .iter()
            .filter_map(|column| column.added_in)
            .max()
            .unwrap_or(0)
    }

    /// The columns of the unique index CDC uses (`index_column_list`); empty for a heap.
    pub fn index_columns(&self) -> Vec<String> {
        self.index.clone().unwrap_or_else(|| vec![self.key.clone()])
    }
}

/// One change-table segment file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    /// File name under `ct/<ci>/`.
    pub file: String,
    /// Lowest commit LSN in the file.
    pub min_lsn: Lsn,
    /// Highest commit LSN in the file.
    pub max_lsn: Lsn,
    /// Rows in the file.
    pub rows: u64,
}

/// A capture instance and its change table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureInstanceState {
    /// Capture instance name.
    pub name: String,
    /// Source table.
    pub table: TableName,
    /// Commit LSN of the enable.
    pub start_lsn: Lsn,
    /// Creation time.
    pub create_date: CommitTime,
    /// Captured columns (types as at the enable).
    pub columns: Vec<CapturedColumn>,
    /// Unique index columns.
    pub index_columns: Vec<String>,
    /// Lowest LSN still held (moved by cleanup): `cdc.change_tables.start_lsn`, which SQL
    /// Server reports as the instance's `start_lsn` and `sys.fn_cdc_get_min_lsn`.
    pub min_lsn: Lsn,
    /// Enabled but not yet processed by the capture job: `start_lsn` reads NULL until the
    /// next `lsn_time_mapping` entry at or past `start_lsn` is published.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub awaiting_capture: bool,
    /// Segments in LSN order.
    pub segments: Vec<SegmentRef>,
    /// Number the next segment file takes.
    pub next_segment: u64,
}

/// The published state of the database: everything a reader may see.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// On-disk format version.
    pub format: u32,
    /// Publication counter.
    pub version: u64,
    /// Database name.
    pub database: String,
    /// The next LSN the writer allocates.
    pub next_lsn: Lsn,
    /// Commit time of the last commit.
    pub last_commit_time: CommitTime,
    /// Tables.
    pub tables: Vec<TableDef>,
    /// Capture instances (also disabled ones are removed from here).
    pub capture_instances: Vec<CaptureInstanceState>,
    /// DDL history of every capture instance.
    pub ddl_history: Vec<DdlEntry>,
    /// Records published in `lsn_time_mapping.bin`.
    pub mapping_entries: u64,
    /// First record not removed by cleanup.
    pub mapping_retained_from: u64,
    /// `sys.fn_cdc_get_max_lsn()`: the last mapping entry's LSN.
    pub max_lsn: Option<Lsn>,
    /// The server clock's named zone; `None`: the clock is UTC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<SimZone>,
}

impl Manifest {
    /// The table with this name.
    pub fn table(&self, table: &TableName) -> Option<&TableDef> {
        self.tables.iter().find(|def| &def.table == table)
    }

    /// The capture instance with this exact name.
    pub fn capture_instance(&self, name: &str) -> Option<&CaptureInstanceState> {
        self.capture_instances.iter().find(|ci| ci.name == name)
    }
}

/// Kind of an `lsn_time_mapping` record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingKind {
    /// A transaction that changed tracked rows (or DDL, or an enable).
    Commit = 1,
    /// An idle ("dummy") entry the capture job writes when nothing happened.
    Idle = 2,
}

/// One `cdc.lsn_time_mapping` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingEntry {
    /// `start_lsn`: the commit LSN.
    pub lsn: Lsn,
    /// Commit or idle entry.
    pub kind: MappingKind,
    /// `tran_begin_time`.
    pub begin_time: CommitTime,
    /// `tran_end_time`, stored in UTC (with a named zone, [`super::zone`] derives the
    /// local time SQL Server records).
    pub end_time: CommitTime,
}

const MAPPING_RECORD: usize = 32;

impl MappingEntry {
    fn encode(&self) -> [u8; MAPPING_RECORD] {
        let mut out = [0u8; MAPPING_RECORD];
        out[..LSN_LEN].copy_from_slice(self.lsn.as_bytes());
        out[LSN_LEN] = self.kind as u8;
        out[16..24].copy_from_slice(&self.begin_time.0.to_le_bytes());
        out[24..32].copy_from_slice(&self.end_time.0.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8; MAPPING_RECORD]) -> Result<Self> {
        let lsn = Lsn::try_from_slice(&bytes[..LSN_LEN]).expect("slice has 10 bytes");
        let kind = match bytes[LSN_LEN] {
            1 => MappingKind::Commit,
            2 => MappingKind::Idle,
            other => {
                return Err(Error::Internal(format!(
                    "lsn_time_mapping record at {lsn} has unknown kind {other}"
                )));
            }
        };
        let time = |range: std::ops::Range<usize>| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[range]);
            CommitTime(i64::from_le_bytes(raw))
        };
        Ok(MappingEntry {
            lsn,
            kind,
            begin_time: time(16..24),
            end_time: time(24..32),
        })
    }
}

/// Read access to the published `lsn_time_mapping` records `[retained_from, entries)`.
pub struct MappingView {
    file: Option<File>,
    retained_from: u64,
    entries: u64,
}

impl MappingView {
    /// Number of visible records.
    pub fn len(&self) -> u64 {
        self.entries - self.retained_from
    }

    /// Whether no record is visible.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The visible record at `index` (0 = first retained).
    pub fn get(&self, index: u64) -> Result<MappingEntry> {
        let file = self
            .file
            .as_ref()
            .ok_or_else(|| Error::Internal("lsn_time_mapping.bin is missing".into()))?;
        let mut bytes = [0u8; MAPPING_RECORD];
        let position = (self.retained_from + index) * MAPPING_RECORD as u64;
        file.read_exact_at(&mut bytes, position)
            .map_err(|error| Error::io("reading lsn_time_mapping.bin", error))?;
        MappingEntry::decode(&bytes)
    }

    /// Index of the first visible record whose LSN is greater than `lsn` (`len()` when none).
    pub fn first_after(&self, lsn: Lsn) -> Result<u64> {
        let (mut low, mut high) = (0, self.len());
        while low < high {
            let middle = low + (high - low) / 2;
            if self.get(middle)?.lsn <= lsn {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        Ok(low)
    }

    /// The index of the record with exactly this LSN.
    pub fn index_of(&self, lsn: Lsn) -> Result<Option<u64>> {
        let after = self.first_after(lsn)?;
        if after == 0 {
            return Ok(None);
        }
        Ok((self.get(after - 1)?.lsn == lsn).then_some(after - 1))
    }
}

/// The internal schema of a change-table segment: the CDC columns, the commit time copied
/// from `lsn_time_mapping` (so a read needs no join), then the captured columns.
pub fn segment_schema(columns: &[CapturedColumn]) -> SchemaRef {
    let mut fields = vec![
        Field::new(
            "__$start_lsn",
            DataType::FixedSizeBinary(LSN_LEN as i32),
            false,
        ),
        Field::new(
            "__$seqval",
            DataType::FixedSizeBinary(LSN_LEN as i32),
            false,
        ),
        Field::new("__$operation", DataType::Int32, false),
        Field::new("__$command_id", DataType::Int32, false),
        Field::new(
            "__$commit_ts",
            DataType::Timestamp(TimeUnit::Microsecond, None),
            false,
        ),
    ];
    for column in columns {
        let data_type = column
            .sql_type
            .arrow_type()
            .expect("simulated tables only use mapped types");
        fields.push(Field::new(&column.name, data_type, true));
    }
    Arc::new(Schema::new(fields))
}

/// Index of `__$start_lsn` in a segment.
pub const SEGMENT_START_LSN: usize = 0;
/// Number of CDC columns in front of the captured columns in a segment.
pub const SEGMENT_CDC_COLUMNS: usize = 5;
/// Footer metadata key listing each record batch's first and last commit LSN.
const BATCH_BOUNDS_KEY: &str = "mssql_cdc_sim.batch_bounds";

/// The commit LSNs of a segment batch's rows.
pub fn start_lsns(batch: &RecordBatch) -> Result<&FixedSizeBinaryArray> {
    batch
        .column(SEGMENT_START_LSN)
        .as_any()
        .downcast_ref::<FixedSizeBinaryArray>()
        .ok_or_else(|| Error::Internal("segment column __$start_lsn is not binary(10)".into()))
}

/// The LSN of row `index` of a binary(10) column.
pub fn lsn_at(array: &FixedSizeBinaryArray, index: usize) -> Lsn {
    Lsn::try_from_slice(array.value(index)).expect("binary(10) values have 10 bytes")
}

/// Writes a segment file from batches sorted by commit LSN; returns its [`SegmentRef`].
pub fn write_segment(
    path: &Path,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<SegmentRef> {
    let file_name = path
        .file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| Error::Internal(format!("bad segment path {}", path.display())))?
        .to_string();
    let temporary = path.with_extension("arrow.tmp");
    let file = File::create(&temporary)
        .map_err(|error| Error::io(format!("creating {}", temporary.display()), error))?;
    let mut writer = FileWriter::try_new(std::io::BufWriter::new(file), schema)?;
    let mut bounds = Vec::new();
    let mut rows = 0u64;
    for batch in batches.iter().filter(|batch| batch.num_rows() > 0) {
        let lsns = start_lsns(batch)?;
        bounds.push((lsn_at(lsns, 0), lsn_at(lsns, lsns.len() - 1)));
        rows += batch.num_rows() as u64;
        writer.write(batch)?;
    }
    let (Some(first), Some(last)) = (bounds.first().copied(), bounds.last().copied()) else {
        return Err(Error::Internal("a segment needs at least one row".into()));
    };
    let bounds_text: Vec<String> = bounds
        .iter()
        .map(|(low, high)| format!("{low}-{high}"))
        .collect();
    writer.write_metadata(BATCH_BOUNDS_KEY, bounds_text.join(","));
    writer.finish()?;
    let mut inner = writer.into_inner()?;
    inner
        .flush()
        .map_err(|error| Error::io(format!("writing {}", temporary.display()), error))?;
    drop(inner);
    fs::rename(&temporary, path)
        .map_err(|error| Error::io(format!("publishing {}", path.display()), error))?;
    Ok(SegmentRef {
        file: file_name,
        min_lsn: first.0,
        max_lsn: last.1,
        rows,
    })
}

/// An open segment file and the LSN bounds of its batches.
pub struct SegmentReader {
    file: File,
    schema: SchemaRef,
    decoder: FileDecoder,
    blocks: Vec<Block>,
    bounds: Vec<(Lsn, Lsn)>,
}

impl SegmentReader {
    /// Opens a segment.
    ///
    /// It parses the IPC file's footer itself rather than through arrow's `FileReader`, which
    /// zero-fills a fresh buffer for every batch before reading into it: here a batch is read
    /// into uninitialised capacity and decoded in place (docs/design-notes.md, "Serving").
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .map_err(|error| Error::io(format!("opening {}", path.display()), error))?;
        let corrupt = |what: String| {
            Error::Internal(format!("segment {} is corrupt: {what}", path.display()))
        };
        let read_error = |error| Error::io(format!("reading {}", path.display()), error);
        let size = file.metadata().map_err(read_error)?.len();
        let mut trailer = [0u8; 10];
        let trailer_at = size
            .checked_sub(trailer.len() as u64)
            .ok_or_else(|| corrupt(format!("{size} bytes")))?;
        file.read_exact_at(&mut trailer, trailer_at)
            .map_err(read_error)?;
        let footer_length = read_footer_length(trailer)?;
        let footer_at = trailer_at
            .checked_sub(footer_length as u64)
            .ok_or_else(|| corrupt(format!("a footer of {footer_length} bytes")))?;
        let mut footer_bytes = vec![0u8; footer_length];
        file.read_exact_at(&mut footer_bytes, footer_at)
            .map_err(read_error)?;
        let footer = root_as_footer(&footer_bytes).map_err(|error| corrupt(error.to_string()))?;
        let schema = footer.schema().ok_or_else(|| corrupt("no schema".into()))?;
        let schema = Arc::new(fb_to_schema(schema));
        let decoder = FileDecoder::new(Arc::clone(&schema), footer.version());
        let blocks: Vec<Block> = footer
            .recordBatches()
            .map(|blocks| blocks.iter().copied().collect())
            .unwrap_or_default();
        let bounds_text = footer
            .custom_metadata()
            .into_iter()
            .flatten()
            .find(|pair| pair.key() == Some(BATCH_BOUNDS_KEY))
            .and_then(|pair| pair.value())
            .unwrap_or_default();
        let mut bounds = Vec::new();
        for pair in bounds_text.split(',').filter(|pair| !pair.is_empty()) {
            let parsed = pair
                .split_once('-')
                .and_then(|(low, high)| Some((low.parse().ok()?, high.parse().ok()?)));
            let Some(bound) = parsed else {
                return Err(corrupt("its batch bounds".into()));
            };
            bounds.push(bound);
        }
        if bounds.len() != blocks.len() {
            return Err(Error::Internal(format!(
                "segment {} lists {} batch bounds for {} batches",
                path.display(),
                bounds.len(),
                blocks.len()
            )));
        }
        Ok(SegmentReader {
            file,
            schema,
            decoder,
            blocks,
            bounds,
        })
    }

    /// The segment's schema (its captured columns' types when it was written).
    pub fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    /// Indexes of the batches that may hold commits in `[from, to]`.
    pub fn batches_overlapping(&self, from: Lsn, to: Lsn) -> std::ops::Range<usize> {
        let start = self.bounds.partition_point(|(_, high)| *high < from);
        let end = self.bounds.partition_point(|(low, _)| *low <= to);
        start..end.max(start)
    }

    /// Reads batch `index`.
    pub fn read(&mut self, index: usize) -> Result<RecordBatch> {
        let missing = || Error::Internal(format!("segment batch {index} is missing"));
        let block = self.blocks.get(index).ok_or_else(missing)?;
        let length = usize::try_from(block.metaDataLength())
            .ok()
            .zip(usize::try_from(block.bodyLength()).ok())
            .map(|(metadata, body)| metadata + body)
            .ok_or_else(missing)?;
        let offset = u64::try_from(block.offset()).map_err(|_| missing())?;
        // `read_to_end` fills spare capacity without zeroing it first.
        let mut bytes = Vec::with_capacity(length);
        let io_error = |error| Error::io(format!("reading segment batch {index}"), error);
        (&self.file)
            .seek(SeekFrom::Start(offset))
            .map_err(io_error)?;
        (&self.file)
            .take(length as u64)
            .read_to_end(&mut bytes)
            .map_err(io_error)?;
        if bytes.len() != length {
            return Err(missing());
        }
        self.decoder
            .read_record_batch(block, &Buffer::from_vec(bytes))?
            .ok_or_else(missing)
    }

    /// The commit LSNs of batch `index`, read alone: its message header, then only the
    /// `__$start_lsn` values from the body (10 bytes a row of a batch's ~300), since a plan
    /// reads nothing else. A compressed batch is read whole.
    pub fn read_start_lsns(&mut self, index: usize) -> Result<FixedSizeBinaryArray> {
        let corrupt = |what: &str| Error::Internal(format!("segment batch {index}: {what}"));
        let block = *self.blocks.get(index).ok_or_else(|| corrupt("missing"))?;
        let (Ok(offset), Ok(metadata_length)) = (
            u64::try_from(block.offset()),
            usize::try_from(block.metaDataLength()),
        ) else {
            return Err(corrupt("a negative block offset or length"));
        };
        let io_error = |error| Error::io(format!("reading segment batch {index}"), error);
        let mut metadata = vec![0u8; metadata_length];
        self.file
            .read_exact_at(&mut metadata, offset)
            .map_err(io_error)?;
        // An encapsulated message: a continuation marker, its length, then the flatbuffer
        // (or, before format 0.15, the length alone).
        let flatbuffer = match metadata.get(..4) {
            Some([0xff, 0xff, 0xff, 0xff]) => metadata.get(8..),
            Some(_) => metadata.get(4..),
            None => None,
        }
        .ok_or_else(|| corrupt("a truncated message header"))?;
        let message = root_as_message(flatbuffer).map_err(|error| corrupt(&error.to_string()))?;
        let header = message
            .header_as_record_batch()
            .ok_or_else(|| corrupt("not a record batch"))?;
        if header.compression().is_some() {
            let batch = self.read(index)?;
            return Ok(start_lsns(&batch)?.clone());
        }
        let rows = usize::try_from(header.length()).map_err(|_| corrupt("a negative length"))?;
        // Column 0's buffers are its validity bitmap (empty: never NULL) and its values.
        let values = header
            .buffers()
            .and_then(|buffers| buffers.iter().nth(1))
            .ok_or_else(|| corrupt("no buffers"))?;
        let length = rows * LSN_LEN;
        if usize::try_from(values.length()).ok() < Some(length) {
            return Err(corrupt("fewer start LSN bytes than rows"));
        }
        let values_at = u64::try_from(values.offset())
            .ok()
            .and_then(|at| at.checked_add(offset + metadata_length as u64))
            .ok_or_else(|| corrupt("a bad buffer offset"))?;
        let mut bytes = vec![0u8; length];
        self.file
            .read_exact_at(&mut bytes, values_at)
            .map_err(io_error)?;
        Ok(FixedSizeBinaryArray::try_new(
            LSN_LEN as i32,
            Buffer::from_vec(bytes),
            None,
        )?)
    }
}

/// The file stamp used to notice that another process published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    size: u64,
    modified_nanos: i64,
}

fn stamp_of(path: &Path) -> Result<FileStamp> {
    let metadata = fs::metadata(path)
        .map_err(|error| Error::io(format!("reading {}", path.display()), error))?;
    Ok(FileStamp {
        inode: metadata.ino(),
        size: metadata.size(),
        modified_nanos: metadata.mtime() * 1_000_000_000 + metadata.mtime_nsec(),
    })
}

struct Inner {
    manifest: Arc<Manifest>,
    stamp: FileStamp,
    /// The directory's writer lock, held while a [`super::SimWriter`] of this process lives.
    writer_lock: Option<File>,
}

/// The directory of a simulated database, shared by its readers and its writer in one
/// process.
pub struct Store {
    dir: PathBuf,
    inner: Mutex<Inner>,
    mapping_file: Mutex<Option<File>>,
    /// The newest state file read per table, parsed: state files never change once written,
    /// so every snapshot read of one publication shares one copy, and a chunk read costs a
    /// range seek, as an index seek does on SQL Server, not a parse of the whole table.
    states: Mutex<BTreeMap<TableName, (String, StateRows)>>,
}

/// A table's current rows, `row key -> content`, shared by the readers of one state file.
pub type StateRows = Arc<BTreeMap<i64, u64>>;

impl Store {
    /// Opens an initialised directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest_path = dir.join("manifest.json");
        if !manifest_path.exists() {
            return Err(Error::invalid(format!(
                "{} is not a simulated CDC database (no manifest.json); create one with \
                 `mssql-cdc-flight sim init {}`",
                dir.display(),
                dir.display()
            )));
        }
        let (manifest, stamp) = read_manifest(&manifest_path)?;
        Ok(Store {
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner {
                manifest: Arc::new(manifest),
                stamp,
                writer_lock: None,
            }),
            mapping_file: Mutex::new(None),
            states: Mutex::default(),
        })
    }

    /// Creates a new directory holding `manifest` (which must be empty of data).
    pub fn create(dir: &Path, manifest: Manifest) -> Result<Self> {
        fs::create_dir_all(dir.join("ct"))
            .and_then(|()| fs::create_dir_all(dir.join("state")))
            .map_err(|error| Error::io(format!("creating {}", dir.display()), error))?;
        if dir.join("manifest.json").exists() {
            return Err(Error::invalid(format!(
                "{} already holds a simulated database",
                dir.display()
            )));
        }
        File::create(dir.join("lsn_time_mapping.bin"))
            .map_err(|error| Error::io("creating lsn_time_mapping.bin", error))?;
        write_manifest(&dir.join("manifest.json"), &manifest)?;
        Store::open(dir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The newest published manifest (re-read when another process published).
    pub fn manifest(&self) -> Result<Arc<Manifest>> {
        let mut inner = self.lock_inner();
        self.refresh(&mut inner)?;
        Ok(Arc::clone(&inner.manifest))
    }

    fn refresh(&self, inner: &mut Inner) -> Result<()> {
        let path = self.dir.join("manifest.json");
        let stamp = stamp_of(&path)?;
        if stamp != inner.stamp {
            let (manifest, stamp) = read_manifest(&path)?;
            inner.manifest = Arc::new(manifest);
            inner.stamp = stamp;
        }
        Ok(())
    }

    /// A view of the published mapping records of `manifest`.
    pub fn mapping(&self, manifest: &Manifest) -> Result<MappingView> {
        let mut cached = self
            .mapping_file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if cached.is_none() {
            let path = self.dir.join("lsn_time_mapping.bin");
            *cached = Some(
                File::open(&path)
                    .map_err(|error| Error::io(format!("opening {}", path.display()), error))?,
            );
        }
        let file = cached
            .as_ref()
            .map(File::try_clone)
            .transpose()
            .map_err(|error| Error::io("opening lsn_time_mapping.bin", error))?;
        Ok(MappingView {
            file,
            retained_from: manifest.mapping_retained_from,
            entries: manifest.mapping_entries,
        })
    }

    fn lock_directory(&self) -> Result<File> {
        let path = self.dir.join("writer.lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|error| Error::io(format!("opening {}", path.display()), error))?;
        // A lock can outlive its holder by a moment: a process spawned while this one held
        // the lock keeps a duplicate of the descriptor until its exec closes it. Retry
        // briefly before calling the directory busy.
        for attempt in 0..LOCK_ATTEMPTS {
            if file.try_lock().is_ok() {
                return Ok(file);
            }
            if attempt + 1 < LOCK_ATTEMPTS {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        Err(Error::invalid(format!(
            "another process is writing to {} (a `sim run`?); wait for it to finish",
            self.dir.display()
        )))
    }

    /// Takes the directory's writer lock for a writer of this process, which holds it until
    /// [`Store::release_writer`]: one writer allocates LSNs at a time.
    pub fn acquire_writer(&self) -> Result<()> {
        let mut inner = self.lock_inner();
        if inner.writer_lock.is_some() {
            return Err(Error::invalid(format!(
                "a writer is already open on {} in this process",
                self.dir.display()
            )));
        }
        inner.writer_lock = Some(self.lock_directory()?);
        Ok(())
    }

    /// Releases the writer lock taken by [`Store::acquire_writer`].
    pub fn release_writer(&self) {
        self.lock_inner().writer_lock = None;
    }

    /// Path of a segment file.
    pub fn segment_path(&self, capture_instance: &str, file: &str) -> PathBuf {
        self.dir.join("ct").join(capture_instance).join(file)
    }

    /// Applies `change` to the newest manifest and publishes the result, under the writer
    /// lock (this process's writer's, or taken for this publish alone, as a cleanup does).
    pub fn publish<T>(&self, change: impl FnOnce(&Store, &mut Manifest) -> Result<T>) -> Result<T> {
        let mut inner = self.lock_inner();
        let _lock_for_this_publish = match inner.writer_lock {
            Some(_) => None,
            None => Some(self.lock_directory()?),
        };
        self.refresh(&mut inner)?;
        let mut next = (*inner.manifest).clone();
        let result = change(self, &mut next)?;
        next.version += 1;
        let path = self.dir.join("manifest.json");
        write_manifest(&path, &next)?;
        inner.stamp = stamp_of(&path)?;
        inner.manifest = Arc::new(next);
        Ok(result)
    }

    /// Appends mapping records after the published ones (call inside [`Store::publish`],
    /// then raise `mapping_entries`).
    pub fn append_mapping(&self, manifest: &Manifest, entries: &[MappingEntry]) -> Result<()> {
        let path = self.dir.join("lsn_time_mapping.bin");
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|error| Error::io(format!("opening {}", path.display()), error))?;
        let mut bytes = Vec::with_capacity(entries.len() * MAPPING_RECORD);
        for entry in entries {
            bytes.extend_from_slice(&entry.encode());
        }
        // Records past the published count (left by a writer that died) are overwritten.
        file.write_all_at(&bytes, manifest.mapping_entries * MAPPING_RECORD as u64)
            .map_err(|error| Error::io("appending to lsn_time_mapping.bin", error))?;
        Ok(())
    }

    /// Writes a table's rows to a new state file; returns its name.
    pub fn write_state(
        &self,
        table: &TableName,
        version: u64,
        rows: &BTreeMap<i64, u64>,
    ) -> Result<String> {
        let name = format!("{}.{}-{version}.bin", table.schema, table.name);
        let path = self.dir.join("state").join(&name);
        let mut bytes = Vec::with_capacity(rows.len() * 16);
        for (key, content) in rows {
            bytes.extend_from_slice(&key.to_le_bytes());
            bytes.extend_from_slice(&content.to_le_bytes());
        }
        fs::write(&path, bytes)
            .map_err(|error| Error::io(format!("writing {}", path.display()), error))?;
        Ok(name)
    }

    /// A table's rows as its state file holds them, parsed once per file.
    pub fn read_state(&self, table: &TableDef) -> Result<StateRows> {
        let Some(name) = &table.state_file else {
            return Ok(Arc::default());
        };
        let cached = |states: &BTreeMap<TableName, (String, StateRows)>| {
            states
                .get(&table.table)
                .filter(|(file, _)| file == name)
                .map(|(_, rows)| Arc::clone(rows))
        };
        let states = || self.states.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rows) = cached(&states()) {
            return Ok(rows);
        }
        let rows = Arc::new(self.parse_state(name)?);
        states().insert(table.table.clone(), (name.clone(), Arc::clone(&rows)));
        Ok(rows)
    }

    fn parse_state(&self, name: &str) -> Result<BTreeMap<i64, u64>> {
        let path = self.dir.join("state").join(name);
        let bytes = fs::read(&path)
            .map_err(|error| Error::io(format!("reading {}", path.display()), error))?;
        if bytes.len() % 16 != 0 {
            return Err(Error::Internal(format!("{} is truncated", path.display())));
        }
        Ok(bytes
            .chunks_exact(16)
            .map(|pair| {
                let mut key = [0u8; 8];
                let mut content = [0u8; 8];
                key.copy_from_slice(&pair[..8]);
                content.copy_from_slice(&pair[8..]);
                (i64::from_le_bytes(key), u64::from_le_bytes(content))
            })
            .collect())
    }

    /// Removes a file no published manifest refers to any more; failures only warn, since a
    /// reader may still hold it open (it stays readable until closed).
    pub fn remove_unreferenced(&self, path: &Path) {
        if let Err(error) = fs::remove_file(path)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), %error, "could not remove an unreferenced file");
        }
    }
}

fn read_manifest(path: &Path) -> Result<(Manifest, FileStamp)> {
    // Stamp first: a publish racing this read changes the stamp, so the next call re-reads.
    let stamp = stamp_of(path)?;
    let text = fs::read_to_string(path)
        .map_err(|error| Error::io(format!("reading {}", path.display()), error))?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|error| Error::Internal(format!("{} is corrupt: {error}", path.display())))?;
    if manifest.format != FORMAT_VERSION {
        return Err(Error::invalid(format!(
            "{} has format {} but this build reads format {FORMAT_VERSION}",
            path.display(),
            manifest.format
        )));
    }
    Ok((manifest, stamp))
}

fn write_manifest(path: &Path, manifest: &Manifest) -> Result<()> {
    let temporary = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(manifest)
        .map_err(|error| Error::Internal(format!("manifest does not serialise: {error}")))?;
    fs::write(&temporary, text)
        .and_then(|()| fs::rename(&temporary, path))
        .map_err(|error| Error::io(format!("writing {}", path.display()), error))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int32Array, TimestampMicrosecondArray};

    use super::*;

    fn lsns(values: impl Iterator<Item = u64>) -> FixedSizeBinaryArray {
        FixedSizeBinaryArray::try_from_iter(values.map(|value| {
            let mut bytes = [0u8; LSN_LEN];
            bytes[2..].copy_from_slice(&value.to_be_bytes());
            bytes
        }))
        .expect("binary(10)")
    }

    #[test]
    fn a_batch_s_start_lsns_read_alone_equal_those_of_the_whole_batch() {
        let schema = segment_schema(&[]);
        let batch = |first: u64, rows: usize| {
            let columns: Vec<arrow::array::ArrayRef> = vec![
                Arc::new(lsns((first..).step_by(3).take(rows))),
                Arc::new(lsns((first..).take(rows))),
                Arc::new(Int32Array::from(vec![2; rows])),
                Arc::new(Int32Array::from(vec![1; rows])),
                Arc::new(TimestampMicrosecondArray::from(vec![7; rows])),
            ];
            RecordBatch::try_new(Arc::clone(&schema), columns).expect("segment batch")
        };
        let directory = tempfile::tempdir().expect("temporary directory");
        let path = directory.path().join("segment.arrow");
        // Row counts whose LSN bytes are not a multiple of the IPC format's 8-byte padding.
        let batches = [batch(1, 5), batch(100, 4096), batch(20_000, 1)];
        write_segment(&path, &schema, &batches).expect("segment written");
        let mut reader = SegmentReader::open(&path).expect("segment opened");
        for (index, written) in batches.iter().enumerate() {
            let whole = reader.read(index).expect("batch read");
            let alone = reader.read_start_lsns(index).expect("start LSNs read");
            assert_eq!(
                &alone,
                start_lsns(&whole).expect("binary(10)"),
                "batch {index}"
            );
            assert_eq!(alone.len(), written.num_rows());
        }
        assert!(reader.read_start_lsns(batches.len()).is_err());
    }
}
