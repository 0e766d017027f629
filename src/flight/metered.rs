//! The source as the service sees it, timed: every call records
//! `mssql_cdc_flight_source_call_seconds{call, outcome}` (docs/operations.md), so a slow SQL
//! Server shows as slow `max_lsn` or `split_points` calls, apart from the network and the
//! clients. A read is timed until its stream is returned; the stream itself is timed by
//! `mssql_cdc_flight_stream_seconds`.

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use crate::error::Result;
use crate::keys::{KeyColumn, KeyTuple, KeysetSeek};
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::source::{
    BatchStream, CaptureInstance, CdcSource, ChangeRead, DdlEntry, InstanceRange, KeyBucket,
    KeyExtent, KeyGrid, KeySums, SnapshotRead, TableName, Tile, TrackedTable,
};
use crate::types::OutputColumn;

/// A source whose calls are timed.
pub struct MeteredSource(pub Arc<dyn CdcSource>);

/// Runs `call` named `name` and records its duration and outcome.
async fn timed<T>(name: &'static str, call: impl Future<Output = Result<T>>) -> Result<T> {
    let started = Instant::now();
    let result = call.await;
    let outcome = if result.is_ok() { "ok" } else { "error" };
    metrics::histogram!("mssql_cdc_flight_source_call_seconds", "call" => name, "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
    result
}

#[async_trait::async_trait]
impl CdcSource for MeteredSource {
    fn describe(&self) -> String {
        self.0.describe()
    }

    fn pool(&self) -> Option<crate::source::SourcePool> {
        self.0.pool()
    }

    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        timed("tracked_tables", self.0.tracked_tables()).await
    }

    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>> {
        timed("capture_instances", self.0.capture_instances(table)).await
    }

    async fn capture_instance(&self, name: &str) -> Result<CaptureInstance> {
        timed("capture_instance", self.0.capture_instance(name)).await
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>> {
        timed("max_lsn", self.0.max_lsn()).await
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn> {
        timed("min_lsn", self.0.min_lsn(capture_instance)).await
    }

    async fn commit_at_or_before(&self, time: CommitTime) -> Result<Option<Lsn>> {
        timed("commit_at_or_before", self.0.commit_at_or_before(time)).await
    }

    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        timed("increment_lsn", self.0.increment_lsn(lsn)).await
    }

    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        timed("decrement_lsn", self.0.decrement_lsn(lsn)).await
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>> {
        timed("lsn_to_time", self.0.lsn_to_time(lsn)).await
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        timed("nth_commit_after", self.0.nth_commit_after(lsn, n)).await
    }

    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>> {
        timed("ddl_history", self.0.ddl_history(range)).await
    }

    async fn split_points(&self, range: InstanceRange<'_>, tiles: NonZeroU32) -> Result<Vec<Tile>> {
        timed("split_points", self.0.split_points(range, tiles)).await
    }

    async fn instances_with_changes(
        &self,
        instances: &[String],
        after: Lsn,
        to: Lsn,
    ) -> Result<Vec<String>> {
        timed(
            "instances_with_changes",
            self.0.instances_with_changes(instances, after, to),
        )
        .await
    }

    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream> {
        timed("read_changes", self.0.read_changes(read)).await
    }

    async fn snapshot_lsn(&self, table: &TableName) -> Result<Lsn> {
        timed("snapshot_lsn", self.0.snapshot_lsn(table)).await
    }

    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        timed("key_extent", self.0.key_extent(table)).await
    }

    async fn table_rows(&self, table: &TableName) -> Result<u64> {
        timed("table_rows", self.0.table_rows(table)).await
    }

    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        timed("key_buckets", self.0.key_buckets(table, grid)).await
    }

    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>> {
        timed("key_span", self.0.key_span(table, key)).await
    }

    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums> {
        timed("key_sums", self.0.key_sums(table, key, grid, values)).await
    }

    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        timed("key_max", self.0.key_max(table, keys)).await
    }

    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>> {
        timed("key_bound", self.0.key_bound(table, seek)).await
    }

    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream> {
        timed("read_snapshot", self.0.read_snapshot(read)).await
    }
}
