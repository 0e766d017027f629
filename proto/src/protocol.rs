//! The JSON protocol: descriptor commands, action bodies and app_metadata payloads.
//!
//! Everything a client sends or reads besides Arrow data is JSON, so a pyarrow user needs
//! only the standard library (docs/protocol.md). Unknown fields are refused, so a misspelt
//! option fails loudly instead of being ignored.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::catalog::{KeyGrid, KeySums};
use crate::error::{Error, Result};
use crate::keys::{Bound, KeyColumn, KeySeek, KeyTuple};
use crate::lsn::Lsn;
use crate::offset::{CommitTime, Offset};

/// Default most rows per batch (the seed's `arrowBatchSize`).
pub const DEFAULT_BATCH_ROWS: usize = 10_000;
/// Default most bytes per batch: with rows under 1 MiB, every message stays under the 4 MiB
/// receive limit of stock gRPC clients (arrow-rs, grpc-go, pyarrow).
pub const DEFAULT_BATCH_BYTES: usize = 3 << 20;
/// Default smallest partition: tiles are merged until they hold this many rows.
pub const DEFAULT_MIN_PARTITION_ROWS: u64 = 50_000;
/// Most partitions one plan may ask for.
pub const MAX_PARTITIONS: u32 = 256;

/// HTTP/2 flow-control window per stream, for the server and the Rust client. Fixed and large:
/// the adaptive window sizes itself by the bandwidth-delay product, which on a fast, short link
/// (loopback, a LAN) stays near the 64 KiB default and makes the sender wait for a window
/// update every 64 KiB.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// HTTP/2 connection-level window, shared by the streams of one connection.
pub const CONNECTION_WINDOW: u32 = 64 << 20;

/// A descriptor command (`FlightDescriptor.cmd`): a JSON object with a `type`.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// `{"type": "table", "table": "dbo.orders"}`: a table's schema.
    Table(TableCommand),
    /// `{"type": "changes", ...}`: a change range.
    Changes(ChangesCommand),
    /// `{"type": "snapshot", ...}`: a table's current rows, whole or in chunks.
    Snapshot(SnapshotCommand),
}

/// The `snapshot` command: the table in `partitions` endpoints (a full snapshot, `_chunk`
/// NULL), or one endpoint per chunk of `chunks`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotCommand {
    /// `schema.table`.
    pub table: String,
    /// Chunks to read, one endpoint each; default the whole table.
    #[serde(default)]
    pub chunks: Option<Vec<ChunkSpec>>,
    /// The columns keyset chunk bounds are on (`snapshot_keys`, unique or not); default
    /// the unique index CDC uses.
    #[serde(default)]
    pub keys: Option<Vec<String>>,
    /// Endpoints of a whole-table read, cut on the key at about equal rows; default 1.
    #[serde(default)]
    pub partitions: Option<u32>,
    /// How the rows are served.
    #[serde(flatten)]
    pub serve: ServeOptions,
}

impl SnapshotCommand {
    /// A whole-table snapshot command with every option at its default.
    pub fn new(table: impl Into<String>) -> Self {
        SnapshotCommand {
            table: table.into(),
            chunks: None,
            keys: None,
            partitions: None,
            serve: ServeOptions::default(),
        }
    }
}

/// One chunk of a chunked snapshot: the keys `[lo, hi)` (`null`: unbounded). Bounds are
/// integers on one integer unique key, or tuples (JSON arrays) of key values on the
/// command's `keys` (keyset bounds, as `key_bound` returns them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkSpec {
    /// The chunk number, served as `_chunk`.
    pub chunk: i32,
    /// First key (inclusive); `null` below every key (NULL keys included).
    pub lo: Option<Bound>,
    /// First key after the chunk; `null` above every key.
    pub hi: Option<Bound>,
}

/// Body of `key_max`: the columns a snapshot would be cut on and the largest key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyMaxBody {
    /// `schema.table`.
    pub table: String,
    /// The columns to cut on; default the unique index CDC uses.
    #[serde(default)]
    pub keys: Option<Vec<String>>,
}

/// Answer of `key_max`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMaxAnswer {
    /// The key columns with their types, in key order.
    pub keys: Vec<KeyColumn>,
    /// Whether the columns are the unique index's (every key is one row).
    pub unique: bool,
    /// The largest key; `null` when the table is empty.
    pub max: Option<KeyTuple>,
}

/// Body of `key_bound`: a [`KeySeek`] on a table's key columns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyBoundBody {
    /// `schema.table`.
    pub table: String,
    /// The columns sought on; default the unique index CDC uses.
    #[serde(default)]
    pub keys: Option<Vec<String>>,
    /// The range and the rows skipped.
    #[serde(flatten)]
    pub seek: KeySeek,
}

/// Answer of `key_bound`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyBoundAnswer {
    /// The key found; `null` when the range holds `n` rows or fewer.
    pub bound: Option<KeyTuple>,
}

/// app_metadata of a snapshot `FlightInfo`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotPlanMetadata {
    /// `schema.table`.
    pub table: String,
    /// The capture instance the rows are served for.
    pub capture_instance: String,
    /// The key column; empty when the table has no single integer key and is read whole.
    pub key: String,
    /// Rows in the table when planned (an estimate on SQL Server; 0 when unknown).
    pub rows: u64,
}

/// app_metadata of one snapshot endpoint: its pieces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotEndpointMetadata {
    /// The key ranges the endpoint reads, with their chunk numbers.
    pub pieces: Vec<crate::catalog::SnapshotPiece>,
}

/// `key_buckets` action body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyBucketsBody {
    /// `schema.table`.
    pub table: String,
    /// First key of the grid.
    pub lo: i64,
    /// Last key counted.
    pub hi: i64,
    /// Width of a slice.
    pub width: u64,
}

impl KeyBucketsBody {
    /// The body asking for `grid`'s slices of `table`.
    pub fn new(table: impl Into<String>, grid: KeyGrid) -> Self {
        KeyBucketsBody {
            table: table.into(),
            lo: grid.lo(),
            hi: grid.hi(),
            width: grid.width(),
        }
    }
}

/// `key_sums` action body: a table's rows and key sums per slice of a fine grid on one
/// integer or date column (reconcile's tier 1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySumsBody {
    /// `schema.table`.
    pub table: String,
    /// The column; default the unique index CDC uses (one integer or date column).
    #[serde(default)]
    pub key: Option<String>,
    /// Grid units `[lo, hi]` the grid must cover besides the table's own extent (the
    /// other side's extent, so both sides count on one grid).
    #[serde(default)]
    pub cover: Option<[i64; 2]>,
    /// Most slices of the grid; default and maximum [`MAX_KEY_SUM_SLICES`].
    #[serde(default)]
    pub slices: Option<u64>,
    /// Captured columns each row's value digest covers, in this order
    /// ([`crate::digest`]): the answer then carries `value_sum` per slice and
    /// `null_value_sum`. At most [`MAX_DIGEST_COLUMNS`]; absent or empty: no value sums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<String>>,
}

/// The most columns a `key_sums` value digest covers (SQL Server's most columns a table).
pub const MAX_DIGEST_COLUMNS: usize = 1_024;

/// The default and most slices of a `key_sums` grid (the seed's fine grid).
pub const MAX_KEY_SUM_SLICES: u64 = 100_000;

/// Answer of `key_sums`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySumsAnswer {
    /// `max_lsn` read before the table was: every commit up to it is counted.
    pub stamp: Lsn,
    /// The column, with its type.
    pub key: KeyColumn,
    /// The grid: slices of `width` grid units from `lo`, covering `[lo, hi]`; `null` when
    /// neither the table nor `cover` holds a key.
    pub grid: Option<GridAnswer>,
    /// Rows per slice and rows whose key is NULL.
    #[serde(flatten)]
    pub sums: KeySums,
}

/// A grid as `key_sums` answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GridAnswer {
    /// First grid unit.
    pub lo: i64,
    /// Last grid unit covered.
    pub hi: i64,
    /// Units per slice.
    pub width: u64,
}

impl GridAnswer {
    /// The grid, checked.
    pub fn grid(&self) -> Result<KeyGrid> {
        KeyGrid::new(self.lo, self.hi, self.width)
    }
}

impl From<KeyGrid> for GridAnswer {
    fn from(grid: KeyGrid) -> Self {
        GridAnswer {
            lo: grid.lo(),
            hi: grid.hi(),
            width: grid.width(),
        }
    }
}

/// The `table` command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableCommand {
    /// `schema.table`.
    pub table: String,
}

/// IPC compression of a stream's batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    /// Uncompressed (fastest on a local network).
    #[default]
    None,
    /// LZ4 frame per buffer.
    Lz4,
    /// ZSTD per buffer.
    Zstd,
}

impl Compression {
    /// Its code in a ticket (`compression` of `mssql_cdc_flight.proto`).
    pub fn ticket_code(self) -> u32 {
        match self {
            Compression::None => 0,
            Compression::Lz4 => 1,
            Compression::Zstd => 2,
        }
    }

    /// The compression a ticket's code names; an unknown code is a malformed ticket.
    pub fn of_ticket_code(code: u32) -> Result<Self> {
        [Compression::None, Compression::Lz4, Compression::Zstd]
            .into_iter()
            .find(|compression| compression.ticket_code() == code)
            .ok_or_else(|| Error::TicketMalformed(format!("unknown compression {code}")))
    }
}

/// The `changes` command: plan the change range `(from, to]` of a table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChangesCommand {
    /// `schema.table`.
    pub table: String,
    /// The last processed commit LSN (exclusive).
    pub from: Lsn,
    /// The last commit LSN to read (inclusive); default `max_lsn`.
    #[serde(default)]
    pub to: Option<Lsn>,
    /// Start from this capture instance instead of the table's oldest.
    #[serde(default)]
    pub capture_instance: Option<String>,
    /// Most partitions (endpoints) per capture instance; default 1.
    #[serde(default)]
    pub partitions: Option<u32>,
    /// Tiles are merged until each holds this many rows; default 50,000.
    #[serde(default)]
    pub min_partition_rows: Option<u64>,
    /// How the rows are served.
    #[serde(flatten)]
    pub serve: ServeOptions,
}

/// How a read's rows are served: the options the `changes` and `snapshot` commands share
/// (flattened into each command's JSON).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServeOptions {
    /// Captured columns to serve, in order; default all of the table's instances.
    #[serde(default)]
    pub columns: Option<Vec<String>>,
    /// Captured columns never to serve (names matched ignoring case; a name no instance
    /// captures is passed over, so a column a later DDL dropped does not break a reader);
    /// every other captured column is served. Not with `columns`.
    #[serde(default)]
    pub except_columns: Option<Vec<String>>,
    /// Serve `_command_id` (NULL on snapshot rows, as the stream has none there); default
    /// true.
    #[serde(default)]
    pub include_command_id: Option<bool>,
    /// Most rows per batch; default 10,000.
    #[serde(default)]
    pub batch_rows: Option<usize>,
    /// Most bytes per batch; default 3 MiB.
    #[serde(default)]
    pub batch_bytes: Option<usize>,
    /// IPC compression; default none.
    #[serde(default)]
    pub compression: Option<Compression>,
}

impl ChangesCommand {
    /// A command for `(from, to]` of `table` with every option at its default.
    pub fn new(table: impl Into<String>, from: Lsn, to: Option<Lsn>) -> Self {
        ChangesCommand {
            table: table.into(),
            from,
            to,
            capture_instance: None,
            partitions: None,
            min_partition_rows: None,
            serve: ServeOptions::default(),
        }
    }
}

impl Command {
    /// Parses a descriptor command.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut value: serde_json::Value = serde_json::from_slice(bytes).map_err(|error| {
            Error::invalid(format!("the descriptor command is not JSON: {error}"))
        })?;
        let object = value
            .as_object_mut()
            .ok_or_else(|| Error::invalid("the descriptor command must be a JSON object"))?;
        let kind = object
            .remove("type")
            .and_then(|kind| kind.as_str().map(str::to_string))
            .ok_or_else(|| {
                Error::invalid(
                    "the descriptor command needs a \"type\": \"table\", \"changes\" or \"snapshot\"",
                )
            })?;
        match kind.as_str() {
            "table" => Ok(Command::Table(command_from_json("table command", value)?)),
            "changes" => Ok(Command::Changes(command_from_json(
                "changes command",
                value,
            )?)),
            "snapshot" => Ok(Command::Snapshot(command_from_json(
                "snapshot command",
                value,
            )?)),
            other => Err(Error::invalid(format!(
                "unknown command type '{other}' (use \"table\", \"changes\" or \"snapshot\")"
            ))),
        }
    }

    /// The command as descriptor bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (kind, mut value) = match self {
            Command::Table(command) => ("table", serde_json::to_value(command)),
            Command::Changes(command) => ("changes", serde_json::to_value(command)),
            Command::Snapshot(command) => ("snapshot", serde_json::to_value(command)),
        };
        let value = value.as_mut().expect("commands serialise");
        if let Some(object) = value.as_object_mut() {
            object.retain(|_, field| !field.is_null());
            object.insert("type".into(), serde_json::Value::String(kind.into()));
        }
        serde_json::to_vec(value).expect("commands serialise")
    }
}

/// A command from its JSON object, refusing a field it does not know. serde's
/// `deny_unknown_fields` does not combine with a flattened [`ServeOptions`], so the fields
/// sent are checked against those the command serialises back (every field, null or not).
fn command_from_json<T: Serialize + DeserializeOwned>(
    what: &str,
    value: serde_json::Value,
) -> Result<T> {
    let sent: Vec<String> = value
        .as_object()
        .map(|object| object.keys().cloned().collect())
        .unwrap_or_default();
    let command: T = serde_json::from_value(value)
        .map_err(|error| Error::invalid(format!("bad {what}: {error}")))?;
    let known = serde_json::to_value(&command).expect("commands serialise");
    let known = known.as_object().expect("commands serialise as objects");
    if let Some(unknown) = sent
        .iter()
        .find(|field| !known.contains_key(field.as_str()))
    {
        let expected: Vec<String> = known.keys().map(|field| format!("`{field}`")).collect();
        return Err(Error::invalid(format!(
            "bad {what}: unknown field `{unknown}`, expected one of {}",
            expected.join(", ")
        )));
    }
    Ok(command)
}

/// Parses an action body (empty means `{}`).
pub fn parse_body<T: DeserializeOwned>(action: &str, body: &[u8]) -> Result<T> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|error| Error::invalid(format!("bad body for action '{action}': {error}")))
}

/// Body of actions that take one LSN (`increment_lsn`, `decrement_lsn`, `lsn_to_time`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LsnBody {
    /// The LSN.
    pub lsn: Lsn,
}

/// Body of `time_to_lsn`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeBody {
    /// A UTC time.
    pub time: CommitTime,
}

/// Body of `nth_commit_after`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NthCommitBody {
    /// Count commits after this LSN.
    pub lsn: Lsn,
    /// Which commit (1 = the next).
    pub n: u64,
}

/// Body of actions about one capture instance (`min_lsn`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureInstanceBody {
    /// The capture instance.
    pub capture_instance: String,
}

/// Body of actions about one table (`capture_instances`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableBody {
    /// `schema.table`.
    pub table: String,
}

/// Body of `ddl_history`, `split_points` and `count_changes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RangeBody {
    /// The capture instance.
    pub capture_instance: String,
    /// Lower bound: exclusive for `ddl_history`, inclusive otherwise.
    pub from: Lsn,
    /// Upper bound (inclusive).
    pub to: Lsn,
    /// Tiles wanted (`split_points` only).
    #[serde(default)]
    pub n: Option<u32>,
}

/// Where a new stream starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitialOffsetBody {
    /// `schema.table`.
    pub table: String,
    /// `earliest` (default), `latest`, or an LSN already processed.
    #[serde(default)]
    pub starting: Option<String>,
}

/// Body of `latest_offset`: the end of the next range.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestOffsetBody {
    /// The current offset (none: any end up to `upper`).
    #[serde(default)]
    pub start: Option<Offset>,
    /// Cap the range at this many commits after `start` (the seed's `maxCommitsPerBatch`).
    #[serde(default)]
    pub max_commits: Option<u64>,
    /// An upper bound below `max_lsn` (an available-now target recorded at start).
    #[serde(default)]
    pub upper: Option<Lsn>,
}

/// Body of `wait_for_commits`: the live tail. The call answers as soon as `max_lsn` is past
/// `after`, or when `timeout_ms` has passed. With `tables`, it answers only once one of those
/// tables has change rows past `after`, and names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitForCommitsBody {
    /// The last LSN the caller has seen (its offset's LSN).
    pub after: Lsn,
    /// How long to wait at most, in milliseconds; default [`DEFAULT_WAIT_MS`], at most
    /// [`MAX_WAIT_MS`] (and below the server's call deadline).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Tables (`schema.table`, at most [`MAX_WAIT_TABLES`]) to wait on: the call answers
    /// when one of them has change rows in `(after, lsn]`, so one call serves many quiet
    /// tables and a commit to another table does not wake it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tables: Option<Vec<String>>,
}

/// How long `wait_for_commits` waits when the body does not say.
pub const DEFAULT_WAIT_MS: u64 = 10_000;
/// The longest wait `wait_for_commits` accepts.
pub const MAX_WAIT_MS: u64 = 60_000;
/// The most tables one `wait_for_commits` call waits on.
pub const MAX_WAIT_TABLES: usize = 10_000;

/// Answer of `wait_for_commits`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaitForCommitsAnswer {
    /// `max_lsn` as the server last read it (null: no commit yet, or not read yet). With
    /// `tables`: the LSN the tables were checked through; none of them but those in
    /// `changed` has change rows in `(after, lsn]`, so the next call waits after it.
    pub lsn: Option<Lsn>,
    /// Whether the wait ended at its timeout with `max_lsn` not past `after` (with `tables`:
    /// with none of them changed).
    pub timed_out: bool,
    /// With `tables`: those with change rows in `(after, lsn]`, in the body's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<Vec<String>>,
}

/// Answer of actions that return an LSN.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LsnAnswer {
    /// The LSN, or null when there is none.
    pub lsn: Option<Lsn>,
}

/// Answer of `lsn_to_time`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimeAnswer {
    /// Commit time (UTC, ms), or null when no commit has the LSN.
    pub commit_ts: Option<CommitTime>,
}

/// Answer of `count_changes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CountAnswer {
    /// Change rows in the range.
    pub rows: u64,
}

/// A capture instance as actions and `list_flights` describe it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaptureInstanceInfo {
    /// Name.
    pub name: String,
    /// `schema.table`.
    pub table: String,
    /// Low endpoint of its change table (the enable's commit LSN until a cleanup moves it);
    /// null until the capture job has processed the enable.
    pub start_lsn: Option<Lsn>,
    /// Lowest LSN still held (`sys.fn_cdc_get_min_lsn`); null while `start_lsn` is.
    pub min_lsn: Option<Lsn>,
    /// Creation time.
    pub create_date: CommitTime,
    /// Captured columns in order, `{"name", "column_id", "ordinal", "sql_type"}`.
    pub columns: Vec<crate::catalog::CapturedColumn>,
    /// Unique index columns.
    pub index_columns: Vec<String>,
    /// The captured columns the server serves this caller masked, each with its mask
    /// (`hash`, `truncate(n)`, `null`; [`crate::masking::Mask`]); absent when none is.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub masks: std::collections::BTreeMap<String, String>,
}

/// [`RangeEvent::event`] of a range that crosses into a newer capture instance.
pub const CAPTURE_INSTANCE_SWITCHED: &str = "capture_instance_switched";
/// [`RangeEvent::event`] of a DDL recorded inside a range.
pub const SCHEMA_CHANGE: &str = "schema_change";

/// An event of a planned range (app_metadata of the `FlightInfo`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RangeEvent {
    /// `capture_instance_switched` or `schema_change`.
    pub event: String,
    /// The capture instance it concerns (the newer one for a switch).
    pub capture_instance: String,
    /// The LSN it happened at.
    pub lsn: Lsn,
    /// Its commit time.
    pub commit_ts: Option<CommitTime>,
    /// `old -> new` (and the columns the newer one lacks) or the DDL text.
    pub detail: String,
}

/// One capture-instance range of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RangeInfo {
    /// Capture instance read.
    pub capture_instance: String,
    /// First commit LSN (inclusive).
    pub from: Lsn,
    /// Last commit LSN (inclusive).
    pub to: Lsn,
    /// Change rows counted at planning.
    pub rows: u64,
}

/// app_metadata of a change plan's `FlightInfo`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanMetadata {
    /// `schema.table`.
    pub table: String,
    /// Exclusive start as asked.
    pub from: Lsn,
    /// Inclusive end.
    pub to: Lsn,
    /// Commit time of `to` (the next offset's `commit_ts`).
    pub to_commit_ts: Option<CommitTime>,
    /// `max_lsn` when planned.
    pub max_lsn: Option<Lsn>,
    /// Rows counted at planning.
    pub rows: u64,
    /// Capture-instance ranges in order.
    pub ranges: Vec<RangeInfo>,
    /// Events inside the range.
    pub events: Vec<RangeEvent>,
}

/// app_metadata of one endpoint.
pub type EndpointMetadata = RangeInfo;

/// The completion marker: the app_metadata of the last message of every complete stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Always `"complete"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Capture instance read.
    pub capture_instance: String,
    /// First commit LSN of the range.
    pub from: Lsn,
    /// Last commit LSN of the range.
    pub to: Lsn,
    /// Rows sent.
    pub rows: u64,
    /// Arrow memory of the batches sent.
    pub bytes: u64,
    /// Seconds the read took on the server.
    pub seconds: f64,
    /// `min_lsn` of the capture instance after the read (the retention watermark).
    pub min_lsn: Lsn,
    /// `max_lsn` after the read.
    pub max_lsn: Option<Lsn>,
    /// Commit time of `max_lsn` (for capture lag).
    pub max_commit_ts: Option<CommitTime>,
    /// A snapshot stream's stamp `L`: `max_lsn` recorded before its read (every row's
    /// `_start_lsn`); absent on change streams.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_lsn: Option<Lsn>,
}

/// Name of the completion marker's `type`.
pub const COMPLETION_TYPE: &str = "complete";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_read_their_flattened_serve_options_and_refuse_unknown_fields() {
        let command = Command::parse(
            br#"{"type": "changes", "table": "dbo.orders", "from": "0x00000000000000000000", "batch_rows": 7, "columns": ["a"]}"#,
        )
        .expect("changes");
        let Command::Changes(changes) = &command else {
            panic!("{command:?}");
        };
        assert_eq!(changes.serve.batch_rows, Some(7));
        assert_eq!(changes.serve.columns, Some(vec!["a".to_string()]));
        assert_eq!(
            Command::parse(&command.to_bytes()).expect("round trip"),
            command
        );
        for text in [
            r#"{"type": "changes", "table": "t.a", "from": "0x00000000000000000000", "batch_row": 7}"#,
            r#"{"type": "snapshot", "table": "t.a", "partition": 2}"#,
        ] {
            let error = Command::parse(text.as_bytes()).expect_err(text).to_string();
            assert!(error.contains("unknown field"), "{error}");
            assert!(
                error.contains("`batch_rows`"),
                "lists the known fields: {error}"
            );
        }
    }

    #[test]
    fn ticket_compression_codes_round_trip_and_an_unknown_code_is_refused() {
        for compression in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let code = compression.ticket_code();
            assert_eq!(
                Compression::of_ticket_code(code).expect("known code"),
                compression
            );
        }
        assert_eq!(Compression::Zstd.ticket_code(), 2);
        assert!(matches!(
            Compression::of_ticket_code(3),
            Err(Error::TicketMalformed(message)) if message == "unknown compression 3"
        ));
    }

    #[test]
    fn commands_round_trip_and_refuse_unknown_fields() {
        let command = Command::Changes(ChangesCommand::new("dbo.orders", Lsn::ZERO, None));
        assert_eq!(
            Command::parse(&command.to_bytes()).expect("parses"),
            command
        );
        let error =
            Command::parse(br#"{"type":"changes","table":"t","from":"0x01","partitons":2}"#)
                .expect_err("misspelt option");
        assert!(error.to_string().contains("partitons"), "{error}");
        assert!(Command::parse(b"not json").is_err());
        assert!(Command::parse(br#"{"table":"t"}"#).is_err());
        assert!(Command::parse(br#"{"type":"drop","table":"t"}"#).is_err());
        assert!(Command::parse(br#"{"type":"changes","table":"t","from":"0xZZ"}"#).is_err());
    }

    #[test]
    fn empty_action_bodies_read_as_empty_objects() {
        let body: LatestOffsetBody = parse_body("latest_offset", b"").expect("empty");
        assert_eq!(body.start, None);
        assert!(parse_body::<LsnBody>("lsn_to_time", b"{}").is_err());
    }
}
