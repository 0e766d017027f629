//! A source that answers as the simulated database does, except where a test breaks it: a
//! read task that panics, a stream that panics when polled, a read that loses its last batch,
//! a read that never yields a row, a source that stops answering, a captured column of a type
//! no Arrow type serves (the simulator generates only servable types).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::error::{Error, Result};
use mssql_cdc_flight::keys::{KeyColumn, KeyTuple, KeysetSeek};
use mssql_cdc_flight::offset::CommitTime;
use mssql_cdc_flight::sim::SimDb;
use mssql_cdc_flight::source::{
    BatchStream, CapturedColumn, CdcSource, ChangeRead, DdlEntry, InstanceRange, KeyBucket,
    KeyExtent, KeyGrid, KeySums, SnapshotRead, TableName, Tile, TrackedTable, read_channel,
};
use mssql_cdc_flight::types::OutputColumn;

/// How a [`FaultySource`] breaks its change reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFault {
    /// Reads are whole.
    None,
    /// The read task sends its first batch, then panics.
    TaskPanics,
    /// The stream panics when the producer polls it.
    StreamPanics,
    /// The read ends cleanly without its last batch.
    LosesLastBatch,
    /// The read never yields a row; it records when its reader went away.
    NeverAnswers,
}

/// The simulated database with injected faults.
pub struct FaultySource {
    pub db: SimDb,
    pub fault: std::sync::Mutex<ReadFault>,
    /// Makes every `max_lsn` fail, as a source that went away.
    pub down: AtomicBool,
    /// How many times `max_lsn` was called.
    pub max_lsn_calls: AtomicU64,
    /// How many times `instances_with_changes` was called.
    pub changes_checks: AtomicU64,
    /// Set by a [`ReadFault::NeverAnswers`] read when its reader went away.
    pub reader_left: Arc<AtomicBool>,
    /// A column the catalog reports for a table's capture instances besides its own, as SQL
    /// Server does for a `geography` column the simulator cannot generate.
    pub extra_column: std::sync::Mutex<Option<(TableName, CapturedColumn)>>,
}

impl FaultySource {
    pub fn new(db: SimDb, fault: ReadFault) -> Self {
        FaultySource {
            db,
            fault: std::sync::Mutex::new(fault),
            down: AtomicBool::new(false),
            max_lsn_calls: AtomicU64::new(0),
            changes_checks: AtomicU64::new(0),
            reader_left: Arc::new(AtomicBool::new(false)),
            extra_column: std::sync::Mutex::new(None),
        }
    }

    fn fault(&self) -> ReadFault {
        *self.fault.lock().expect("fault")
    }
}

#[async_trait::async_trait]
impl CdcSource for FaultySource {
    fn describe(&self) -> String {
        format!("faulty {}", self.db.describe())
    }
    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        let mut tracked = self.db.tracked_tables().await?;
        if let Some((table, column)) = self.extra_column.lock().expect("column").clone() {
            for entry in tracked.iter_mut().filter(|entry| entry.table == table) {
                for instance in &mut entry.capture_instances {
                    instance.columns.push(column.clone());
                }
            }
        }
        Ok(tracked)
    }
    async fn max_lsn(&self) -> Result<Option<Lsn>> {
        self.max_lsn_calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::SourceUnavailable(
                "the source is down (injected)".into(),
            ));
        }
        self.db.max_lsn().await
    }
    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn> {
        self.db.min_lsn(capture_instance).await
    }
    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>> {
        self.db.lsn_to_time(lsn).await
    }
    async fn commit_at_or_before(&self, time: mssql_cdc_flight::CommitTime) -> Result<Option<Lsn>> {
        self.db.commit_at_or_before(time).await
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        self.db.nth_commit_after(lsn, n).await
    }
    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>> {
        self.db.ddl_history(range).await
    }
    async fn split_points(&self, range: InstanceRange<'_>, n: NonZeroU32) -> Result<Vec<Tile>> {
        self.db.split_points(range, n).await
    }
    async fn instances_with_changes(
        &self,
        instances: &[String],
        after: Lsn,
        to: Lsn,
    ) -> Result<Vec<String>> {
        self.changes_checks.fetch_add(1, Ordering::SeqCst);
        self.db.instances_with_changes(instances, after, to).await
    }
    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream> {
        let whole = self.db.read_changes(read).await?;
        Ok(match self.fault() {
            ReadFault::None => whole,
            ReadFault::TaskPanics => {
                let (sender, stream) = read_channel();
                tokio::spawn(async move {
                    let mut whole = whole;
                    if let Some(Ok(batch)) = whole.next().await {
                        sender.send(batch).await;
                    }
                    panic!("injected: the read task panics after its first batch");
                });
                stream
            }
            ReadFault::StreamPanics => {
                futures::stream::once(async { panic!("injected: the stream panics when polled") })
                    .boxed()
            }
            ReadFault::LosesLastBatch => {
                let batches: Vec<_> = whole.collect().await;
                let keep = batches.len().saturating_sub(1);
                futures::stream::iter(batches.into_iter().take(keep)).boxed()
            }
            ReadFault::NeverAnswers => {
                let (sender, stream) = read_channel();
                let left = Arc::clone(&self.reader_left);
                tokio::spawn(async move {
                    // A source query still working towards its first row: it ends when its
                    // reader goes, or after a minute (a test failure).
                    tokio::select! {
                        () = sender.closed() => left.store(true, Ordering::SeqCst),
                        () = tokio::time::sleep(Duration::from_secs(60)) => {}
                    }
                });
                stream
            }
        })
    }
    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        self.db.key_extent(table).await
    }
    async fn table_rows(&self, table: &TableName) -> Result<u64> {
        self.db.table_rows(table).await
    }
    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        self.db.key_buckets(table, grid).await
    }
    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>> {
        self.db.key_span(table, key).await
    }
    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums> {
        self.db.key_sums(table, key, grid, values).await
    }
    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        self.db.key_max(table, keys).await
    }
    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>> {
        self.db.key_bound(table, seek).await
    }
    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream> {
        self.db.read_snapshot(read).await
    }
}
