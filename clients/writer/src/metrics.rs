//! What the writer observes of its tables, recorded twice: as Prometheus metrics through the
//! `metrics` facade (no-ops unless `run --metrics-listen` installed the exporter;
//! docs/operations.md lists them) and on the status board (`crate::board`, no-ops unless a
//! sidecar run enabled it).

use crate::board::board;

/// A committed batch of a table (idle polls included), as its facts row gives it.
pub struct BatchFigures {
    /// The batch id.
    pub batch_id: i64,
    /// Rows written to bronze.
    pub rows: u64,
    /// Arrow bytes read from the server.
    pub bytes: u64,
    /// Seconds from plan to the bronze commit.
    pub seconds: f64,
    /// The batch's end LSN.
    pub end_lsn: String,
    /// Seconds from the source's newest commit to now.
    pub capture_lag: Option<f64>,
    /// Seconds the batch's end lies behind the source's newest commit.
    pub behind: Option<f64>,
}

/// Records a committed batch of `table`.
pub fn batch(table: &str, figures: BatchFigures) {
    let BatchFigures {
        batch_id,
        rows,
        bytes,
        seconds,
        end_lsn,
        capture_lag,
        behind,
    } = figures;
    board().batch(table, batch_id, rows, seconds, end_lsn, behind);
    let table = table.to_string();
    metrics::counter!("mssql_cdc_writer_batches_total", "table" => table.clone()).increment(1);
    metrics::counter!("mssql_cdc_writer_rows_total", "table" => table.clone()).increment(rows);
    metrics::counter!("mssql_cdc_writer_bytes_total", "table" => table.clone()).increment(bytes);
    metrics::histogram!("mssql_cdc_writer_batch_seconds", "table" => table.clone()).record(seconds);
    if let Some(lag) = capture_lag {
        metrics::gauge!("mssql_cdc_writer_capture_lag_seconds", "table" => table.clone()).set(lag);
    }
    if let Some(behind) = behind {
        metrics::gauge!("mssql_cdc_writer_ingestion_lag_seconds", "table" => table).set(behind);
    }
}

/// Records the progress of `table`'s chunked snapshot: chunks in bronze and facts, and of
/// the plan (unknown before it exists; both 0 when no snapshot is open).
pub fn snapshot_chunks(table: &str, done: u64, total: Option<u64>) {
    board().snapshot(table, done, total);
    let table = table.to_string();
    metrics::gauge!("mssql_cdc_writer_snapshot_chunks_done", "table" => table.clone())
        .set(done as f64);
    if let Some(total) = total {
        metrics::gauge!("mssql_cdc_writer_snapshot_chunks_total", "table" => table)
            .set(total as f64);
    }
}

/// Records how far `layer` (`bronze` or `silver`) of `table` is complete: its verdict's
/// commit time as a Unix timestamp, so that its age is `time() - value` in PromQL.
pub fn finalized_until(
    table: &str,
    layer: &'static str,
    until: Option<mssql_cdc_proto::CommitTime>,
) {
    board().verdict(table, layer, until);
    if let Some(until) = until {
        metrics::gauge!("mssql_cdc_writer_finalized_until_seconds", "table" => table.to_string(), "layer" => layer)
            .set(until.micros() as f64 / 1e6);
    }
}

/// Records a reconcile of `table`'s silver: buckets by status, key findings by type, and
/// the time (a Unix timestamp) its rows were verified, and every value, when the run did.
pub fn reconcile(table: &str, result: &crate::reconcile::ReconcileResult) {
    board().reconcile(table, result);
    let table = table.to_string();
    for (status, count) in [
        ("match", result.matched),
        ("in_flight", result.in_flight),
        ("mismatch", result.mismatch),
    ] {
        metrics::gauge!("mssql_cdc_writer_reconcile_buckets", "table" => table.clone(), "status" => status)
            .set(count as f64);
    }
    for (failure, count) in &result.failures {
        metrics::gauge!("mssql_cdc_writer_reconcile_key_failures", "table" => table.clone(), "type" => failure.clone())
            .set(*count as f64);
    }
    let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
    if result.verified {
        metrics::gauge!("mssql_cdc_writer_reconcile_verified_seconds", "table" => table.clone())
            .set(now);
    }
    if result.values_verified {
        metrics::gauge!("mssql_cdc_writer_reconcile_values_verified_seconds", "table" => table)
            .set(now);
    }
}

/// Records silver's position after an `apply_changes` of `table` (the board only: the
/// verdict gauge says how far silver is complete).
pub fn silver_applied(table: &str, applied_lsn: Option<mssql_cdc_proto::Lsn>) {
    board().silver_applied(table, applied_lsn.map(|lsn| lsn.to_string()));
}

/// Records a failed attempt at `table`'s stream and its error (the sidecar retries it, but
/// for the last attempt of an available-now run).
pub fn failure(table: &str, error: &crate::error::WriterError) {
    board().failure(table, &error.to_string());
    metrics::counter!("mssql_cdc_writer_failures_total", "table" => table.to_string()).increment(1);
}

/// Records a failed wave of `table`'s snapshot (the sidecar tries it again after its poll,
/// the stream going on).
pub fn backfill_failed(table: &str) {
    metrics::counter!("mssql_cdc_writer_backfill_failures_total", "table" => table.to_string())
        .increment(1);
}

/// Serves the metrics at `http://address/metrics`, within the pages' connection bounds.
pub async fn serve(address: std::net::SocketAddr) -> crate::error::Result<()> {
    mssql_cdc_proto::pages::serve_metrics(
        address,
        &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0],
    )
    .await
    .map_err(crate::error::WriterError::invalid)
}
