//! The source seam: what the Flight service needs from a CDC database.
//!
//! [`CdcSource`] is implemented by the embedded simulated database ([`crate::sim`]) and by the
//! SQL Server client. Every call maps to one documented CDC function or catalog read of SQL
//! Server (named on each method), so both implementations answer alike and one conformance
//! suite tests them.
//!
//! A change read covers the closed interval `[from, to]` of commit LSNs of one capture
//! instance and yields Arrow batches in the output schema (see [`crate::types`]), ordered by
//! `(_start_lsn, _command_id, _seqval, _operation)`. The caller turns the half-open offsets
//! `(start, end]` of the protocol into `[increment(start), end]` before asking.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arrow::record_batch::RecordBatch;
use futures::stream::BoxStream;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::keys::{KeyColumn, KeyTuple, KeysetSeek};
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::types::OutputColumn;

// The catalog's wire types are the contract's; the trait speaks in them.
pub use mssql_cdc_proto::catalog::{
    CaptureInstance, CapturedColumn, DdlEntry, KeyBucket, KeyExtent, KeyGrid, KeyRange, KeySum,
    KeySums, SnapshotPiece, TableName, Tile,
};

/// LSNs `from` to `to` of one capture instance: what `ddl_history` and `split_points` read
/// (each method says whether `from` is inclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstanceRange<'a> {
    /// The capture instance.
    pub capture_instance: &'a str,
    /// The lower bound.
    pub from: Lsn,
    /// The upper bound (inclusive).
    pub to: Lsn,
}

impl<'a> InstanceRange<'a> {
    /// `from` to `to` of `capture_instance`.
    pub fn new(capture_instance: &'a str, from: Lsn, to: Lsn) -> Self {
        InstanceRange {
            capture_instance,
            from,
            to,
        }
    }
}

/// The error for an unknown capture instance, suggesting the names among `known` that differ
/// only in case (SQL Server compares names case-insensitively on most collations; we do not).
pub fn capture_instance_not_found<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> Error {
    let similar: Vec<&str> = known
        .filter(|candidate| candidate.eq_ignore_ascii_case(name))
        .collect();
    let hint = if similar.is_empty() {
        String::new()
    } else {
        format!(" (did you mean {}?)", similar.join(", "))
    };
    Error::CaptureInstanceNotFound {
        name: name.to_string(),
        hint,
    }
}

/// The error for a capture instance the capture job has not processed yet (its
/// `start_lsn` is NULL): UNAVAILABLE, a state that passes once SQL Server Agent's capture
/// job runs, so clients retry instead of giving up.
pub fn capture_instance_not_processed(name: &str) -> Error {
    Error::SourceUnavailable(format!(
        "capture instance '{name}' exists but the capture job has not processed its creation \
         yet (its start_lsn is NULL); is SQL Server Agent running?"
    ))
}

/// A tracked table and its capture instances, oldest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrackedTable {
    /// The table.
    pub table: TableName,
    /// Its capture instances, ordered by `(create_date, start_lsn)`.
    pub capture_instances: Vec<CaptureInstance>,
}

/// Cuts change rows, met in LSN order, into tiles of about `total / n` rows, each closed on
/// the first commit boundary after its target so a transaction never spans two tiles: what
/// [`CdcSource::split_points`] answers.
pub struct TileCutter {
    target: u64,
    rows: u64,
    last: Option<Lsn>,
    tiles: Vec<Tile>,
}

impl TileCutter {
    /// A cutter of `total` rows into at most about `n` tiles.
    pub fn new(total: u64, n: u32) -> Self {
        TileCutter {
            target: total.div_ceil(u64::from(n.max(1))),
            rows: 0,
            last: None,
            tiles: Vec::new(),
        }
    }

    /// The next row's commit LSN.
    pub fn push(&mut self, lsn: Lsn) {
        if let Some(previous) = self.last
            && self.rows >= self.target
            && lsn != previous
        {
            self.tiles.push(Tile {
                last_lsn: previous,
                rows: self.rows,
            });
            self.rows = 0;
        }
        self.rows += 1;
        self.last = Some(lsn);
    }

    /// The tiles.
    pub fn finish(mut self) -> Vec<Tile> {
        if let Some(previous) = self.last {
            self.tiles.push(Tile {
                last_lsn: previous,
                rows: self.rows,
            });
        }
        self.tiles
    }
}

/// What to read from a change table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeRead {
    /// The capture instance.
    pub capture_instance: String,
    /// First commit LSN to read (inclusive).
    pub from: Lsn,
    /// Last commit LSN to read (inclusive).
    pub to: Lsn,
    /// Output columns in order; a column this instance does not capture reads NULL.
    pub columns: Vec<OutputColumn>,
    /// Whether to include `_command_id`.
    pub include_command_id: bool,
    /// Upper bound of rows per batch.
    pub batch_rows: usize,
    /// Upper bound of bytes per batch.
    pub batch_bytes: BatchBytes,
}

/// The byte bound of a read's batches (Arrow buffer memory, one row at least): the bound the
/// ticket asked for, lowered while many streams share the server's stream memory
/// (docs/operations.md, "Memory"). Readers ask [`BatchBytes::now`] for every batch they cut,
/// so a long read follows the server's load.
#[derive(Clone, Debug)]
pub struct BatchBytes {
    requested: usize,
    share: Option<Arc<AtomicUsize>>,
}

impl BatchBytes {
    /// A bound that never changes.
    pub fn fixed(bytes: usize) -> Self {
        BatchBytes {
            requested: bytes,
            share: None,
        }
    }

    /// `requested`, lowered to `share` whenever that is smaller.
    pub fn shared(requested: usize, share: Arc<AtomicUsize>) -> Self {
        BatchBytes {
            requested,
            share: Some(share),
        }
    }

    /// The bound the ticket asked for.
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// The bound of the next batch.
    pub fn now(&self) -> usize {
        let share = self
            .share
            .as_ref()
            .map_or(usize::MAX, |share| share.load(Ordering::Relaxed));
        self.requested.min(share).max(1)
    }
}

/// Two reads are alike when they asked for the same bound; the share is the server's load.
impl PartialEq for BatchBytes {
    fn eq(&self, other: &Self) -> bool {
        self.requested == other.requested
    }
}

impl Eq for BatchBytes {}

/// A stream of change batches in the output schema. It ends cleanly only when the read was
/// whole: a read that stopped early ends with an error (see [`read_channel`]).
pub type BatchStream = BoxStream<'static, Result<RecordBatch>>;

/// One message of a read task to its stream.
enum ReadItem {
    Batch(RecordBatch),
    End,
}

/// The sending half of a source read, held by the task that reads: batches, then
/// [`ReadSender::finish`]. The stream ends cleanly only on the explicit end that `finish(Ok)`
/// sends; a task that panics or drops its sender without it ends the stream with
/// `Error::Internal`, so a cut-short read can never pass for a whole one.
pub struct ReadSender {
    sender: mpsc::Sender<Result<ReadItem>>,
}

/// The message a stream ends with when its read task stopped without finishing.
const READ_STOPPED: &str = "the source read stopped before its end (its task failed); \
                            the stream is incomplete";

/// A read's channel: the [`ReadSender`] for the task and the [`BatchStream`] it feeds, with
/// one batch queued between them (backpressure reaches the read). The task may build the
/// next batch meanwhile, and hold it while it waits: three batches of the
/// [`crate::flight::gate::BATCHES_PER_STREAM`] a stream holds.
pub fn read_channel() -> (ReadSender, BatchStream) {
    let (sender, receiver) = mpsc::channel(1);
    let stream = futures::stream::unfold(Some(receiver), |receiver| async move {
        let mut receiver = receiver?;
        match receiver.recv().await {
            Some(Ok(ReadItem::Batch(batch))) => Some((Ok(batch), Some(receiver))),
            Some(Ok(ReadItem::End)) => None,
            Some(Err(error)) => Some((Err(error), None)),
            None => Some((Err(Error::Internal(READ_STOPPED.into())), None)),
        }
    });
    (ReadSender { sender }, Box::pin(stream))
}

/// A read produced by `produce` on a blocking task: its stream ends as `produce` returns
/// (cleanly on `Ok`), or with an error should the task fail first.
pub fn blocking_read(
    produce: impl FnOnce(&ReadSender) -> Result<()> + Send + 'static,
) -> BatchStream {
    let (sender, stream) = read_channel();
    tokio::task::spawn_blocking(move || {
        let outcome = produce(&sender);
        sender.blocking_finish(outcome);
    });
    stream
}

impl ReadSender {
    /// Sends a batch; `false` when the stream's reader has gone (stop reading).
    pub async fn send(&self, batch: RecordBatch) -> bool {
        self.sender.send(Ok(ReadItem::Batch(batch))).await.is_ok()
    }

    /// [`ReadSender::send`] from a blocking task.
    pub fn blocking_send(&self, batch: RecordBatch) -> bool {
        self.sender
            .blocking_send(Ok(ReadItem::Batch(batch)))
            .is_ok()
    }

    /// Ends the stream: cleanly after `Ok`, with the error otherwise.
    pub async fn finish(self, outcome: Result<()>) {
        let _ = self.sender.send(Self::last(outcome)).await;
    }

    /// [`ReadSender::finish`] from a blocking task.
    pub fn blocking_finish(self, outcome: Result<()>) {
        let _ = self.sender.blocking_send(Self::last(outcome));
    }

    /// Resolves when the stream's reader has gone, so a read waiting on its source can stop
    /// at once instead of at its next batch.
    pub async fn closed(&self) {
        self.sender.closed().await;
    }

    /// Whether the stream's reader has gone.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    fn last(outcome: Result<()>) -> Result<ReadItem> {
        outcome.map(|()| ReadItem::End)
    }
}

/// What to read from a table's current rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRead {
    /// The table.
    pub table: TableName,
    /// The capture instance the rows are served for (`_capture_instance`).
    pub capture_instance: String,
    /// Output columns in order; a column the table lacks reads NULL.
    pub columns: Vec<OutputColumn>,
    /// The pieces, read in order.
    pub pieces: Vec<SnapshotPiece>,
    /// The columns keyset pieces are cut on, in key order; empty when no piece is keyset.
    pub keys: Vec<KeyColumn>,
    /// Whether `_command_id` (NULL on snapshot rows) is served, as in the change stream.
    pub include_command_id: bool,
    /// The stamp `L`: `max_lsn` recorded before the read (`_start_lsn` of every row).
    pub stamp: Lsn,
    /// The commit time of the stamp (`_commit_ts` of every row).
    pub stamp_time: Option<CommitTime>,
    /// Upper bound of rows per batch.
    pub batch_rows: usize,
    /// Upper bound of bytes per batch.
    pub batch_bytes: BatchBytes,
}

/// A source's pool of connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourcePool {
    /// Connections it holds at most.
    pub size: usize,
    /// How long a read waits in line for one.
    pub checkout_timeout: std::time::Duration,
}

/// What the Flight service needs from a CDC database.
///
/// Implementations are cheap to share (`Arc<dyn CdcSource>`) and hold no per-client state:
/// every call carries what it needs.
#[async_trait::async_trait]
pub trait CdcSource: Send + Sync + 'static {
    /// A short description for logs (never a secret).
    fn describe(&self) -> String;

    /// The source's connection pool, when reads share one (SQL Server): the server then gives
    /// each principal a share of it ([`crate::flight::share`]).
    fn pool(&self) -> Option<SourcePool> {
        None
    }

    /// Tracked tables and their capture instances (`sys.sp_cdc_help_change_data_capture`).
    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>>;

    /// The capture instances of one table, oldest first; `Error::TableNotFound` when none.
    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>> {
        let tables = self.tracked_tables().await?;
        tables
            .into_iter()
            .find(|tracked| &tracked.table == table)
            .map(|tracked| tracked.capture_instances)
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })
    }

    /// The capture instances of one table that can be read, oldest first: a newly enabled
    /// instance is left out until the capture job has processed it (its `start_lsn` is
    /// NULL until then, and the older instance still captures every change). UNAVAILABLE
    /// when the table has no other.
    async fn active_capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>> {
        let instances = self.capture_instances(table).await?;
        let pending: Vec<&str> = instances
            .iter()
            .filter(|instance| !instance.is_active())
            .map(|instance| instance.name.as_str())
            .collect();
        if pending.len() == instances.len()
            && let Some(name) = pending.first()
        {
            return Err(capture_instance_not_processed(name));
        }
        Ok(instances
            .into_iter()
            .filter(CaptureInstance::is_active)
            .collect())
    }

    /// One capture instance by exact name.
    async fn capture_instance(&self, name: &str) -> Result<CaptureInstance> {
        let tables = self.tracked_tables().await?;
        let all: Vec<CaptureInstance> = tables
            .into_iter()
            .flat_map(|tracked| tracked.capture_instances)
            .collect();
        match all.iter().find(|ci| ci.name == name) {
            Some(found) => Ok(found.clone()),
            None => Err(capture_instance_not_found(
                name,
                all.iter().map(|ci| ci.name.as_str()),
            )),
        }
    }

    /// The highest LSN CDC has processed (`sys.fn_cdc_get_max_lsn()`); `None` before any.
    async fn max_lsn(&self) -> Result<Option<Lsn>>;

    /// The lowest LSN still held for a capture instance (`sys.fn_cdc_get_min_lsn(ci)`).
    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn>;

    /// The next LSN (`sys.fn_cdc_increment_lsn`).
    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        Ok(lsn.increment())
    }

    /// The previous LSN (`sys.fn_cdc_decrement_lsn`).
    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        Ok(lsn.decrement())
    }

    /// The commit time (UTC) of the commit at exactly `lsn` (`cdc.lsn_time_mapping`);
    /// `None` when no commit has that LSN.
    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>>;

    /// The LSN of the last commit (a `cdc.lsn_time_mapping` row, idle entries included) whose
    /// commit time (UTC) is at or before `time` (`sys.fn_cdc_map_time_to_lsn`'s `largest less
    /// than or equal`, on UTC times); `None` when none is (or none is left after cleanup).
    async fn commit_at_or_before(&self, time: CommitTime) -> Result<Option<Lsn>>;

    /// The LSN of the n-th commit after `lsn` (database-wide `cdc.lsn_time_mapping` rows,
    /// idle entries included), or the last one when fewer follow; `None` when none follows.
    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>>;

    /// DDL recorded for the range's capture instance with `from < ddl_lsn <= to`.
    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>>;

    /// Splits the change rows of `[from, to]` into at most `tiles` tiles of about equal rows,
    /// each ending on a commit boundary, in LSN order. An empty range gives no tiles.
    async fn split_points(&self, range: InstanceRange<'_>, tiles: NonZeroU32) -> Result<Vec<Tile>>;

    /// Those of `instances` holding change rows with `after < __$start_lsn <= to`, in the
    /// given order: the live tail's check of many quiet tables at once. This default asks
    /// `split_points` of each instance; sources override it with one query.
    async fn instances_with_changes(
        &self,
        instances: &[String],
        after: Lsn,
        to: Lsn,
    ) -> Result<Vec<String>> {
        let mut changed = Vec::new();
        if to <= after {
            return Ok(changed);
        }
        for instance in instances {
            let range = InstanceRange::new(instance, after.increment(), to);
            if !self.split_points(range, NonZeroU32::MIN).await?.is_empty() {
                changed.push(instance.clone());
            }
        }
        Ok(changed)
    }

    /// Streams the change rows of `[read.from, read.to]` in the output schema.
    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream>;

    /// The LSN a snapshot read is stamped with: `max_lsn` read before the read, never below
    /// the LSN just before the start of a capture instance of the table that capture has not
    /// reached yet (its changes before that start are not in any change table the stream
    /// reads). Just before, not at: a commit at exactly the start is the instance's first
    /// (the seed's simulator puts one there), and the stream after the stamp must read it.
    async fn snapshot_lsn(&self, table: &TableName) -> Result<Lsn> {
        let max_lsn = self.max_lsn().await?.unwrap_or(Lsn::ZERO);
        let newest_start = self
            .active_capture_instances(table)
            .await?
            .iter()
            .filter_map(|instance| instance.start_lsn)
            .max()
            .unwrap_or(Lsn::ZERO);
        Ok(max_lsn.max(newest_start.decrement()))
    }

    /// The key column, its type and extent, and the row count of a table.
    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent>;

    /// About how many rows `table` holds (SQL Server's `sp_spaceused`, from the catalog
    /// without a scan): how a full snapshot on a key without integer bounds is cut into
    /// partitions of about equal rows.
    async fn table_rows(&self, table: &TableName) -> Result<u64>;

    /// Row counts of the grid's slices of the table's key; empty slices are left out.
    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>>;

    /// The smallest and largest value of `key`, one integer or `date` column (see
    /// [`KeyColumn::grid_unit`]), in grid units: `MIN` and `MAX`, dates as day numbers from
    /// 1970-01-01. `None` when no row has a non-NULL key.
    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>>;

    /// Rows and key sums of `key` (as [`CdcSource::key_span`]) per slice of `grid`, in one
    /// scan (`COUNT_BIG(*)`, `SUM(CAST(key AS decimal(38,0)))` grouped by slice): every row is
    /// counted, a key outside the grid in a slice past its ends, a NULL key in `null_rows`.
    /// With `values`, the same scan sums each row's digest of those columns as served
    /// ([`mssql_cdc_proto::digest`]) per slice; a source that cannot leaves them `None`.
    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums>;

    /// The largest key on `keys` (`SELECT TOP (1) keys ... ORDER BY keys DESC`); `None` when
    /// the table is empty. NULL sorts first, so a key of NULLs is the largest only when every
    /// row holds it.
    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>>;

    /// The key of the `(seek.n + 1)`-th row of the seek's range in key order, compared as the
    /// source compares the columns (collation included); `None` when the range holds fewer
    /// rows. See [`KeySeek`](crate::keys::KeySeek) for the three seeks a keyset plan makes.
    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>>;

    /// Streams the table's current rows in the pieces' ranges, as snapshot rows of the output
    /// schema plus `_chunk`: `_operation = 0`, `_start_lsn = read.stamp`, `_seqval` NULL,
    /// ordered by piece, then key. The read sees every commit up to the stamp (it starts
    /// after the stamp was recorded) and may see later ones.
    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream>;
}
