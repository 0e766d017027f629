//! Prometheus metrics of the service, recorded through the `metrics` facade: no-ops unless
//! `serve --metrics-listen` installed the exporter (docs/operations.md lists them).
//!
//! - `mssql_cdc_flight_calls_total{method, code}` and `mssql_cdc_flight_call_seconds{method}`:
//!   every call and how it ended (a `do_get` counts when its stream is accepted);
//! - `mssql_cdc_flight_streams_active`: `do_get` streams open now;
//! - `mssql_cdc_flight_batch_share_bytes`: the batch bound of every open stream now, their
//!   share of `--stream-memory` (lower than a ticket's `batch_bytes` under load);
//! - `mssql_cdc_flight_streams_total{kind, outcome}`, `mssql_cdc_flight_stream_seconds{kind}`,
//!   `mssql_cdc_flight_rows_served_total{kind}`, `mssql_cdc_flight_bytes_served_total{kind}`:
//!   streams by how they ended (`complete` or the gRPC code), and what complete ones served;
//! - `mssql_cdc_flight_source_up`: 1 while health's probe of the source answers, else 0;
//! - `mssql_cdc_flight_source_call_seconds{call, outcome}`: every source call the service
//!   makes ([`super::metered`]).

use std::future::Future;
use std::time::Instant;

use tonic::{Code, Status};

/// Runs the call `method` and records how it ended and how long it took.
pub async fn observe<T>(
    method: &'static str,
    call: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let started = Instant::now();
    let result = call.await;
    let code = match &result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    };
    metrics::counter!("mssql_cdc_flight_calls_total", "method" => method, "code" => code_name(code))
        .increment(1);
    metrics::histogram!("mssql_cdc_flight_call_seconds", "method" => method)
        .record(started.elapsed().as_secs_f64());
    result
}

/// One more (`delta` 1) or one fewer (`delta` -1) open stream.
pub fn streams_active(delta: f64) {
    metrics::gauge!("mssql_cdc_flight_streams_active").increment(delta);
}

/// The batch bound the open streams share now.
pub fn batch_share(bytes: usize) {
    metrics::gauge!("mssql_cdc_flight_batch_share_bytes").set(bytes as f64);
}

/// Records a stream of `kind` (`changes` or `snapshot`) that ended complete.
pub fn stream_complete(kind: &'static str, rows: u64, bytes: u64, seconds: f64) {
    metrics::counter!("mssql_cdc_flight_streams_total", "kind" => kind, "outcome" => "complete")
        .increment(1);
    metrics::counter!("mssql_cdc_flight_rows_served_total", "kind" => kind).increment(rows);
    metrics::counter!("mssql_cdc_flight_bytes_served_total", "kind" => kind).increment(bytes);
    metrics::histogram!("mssql_cdc_flight_stream_seconds", "kind" => kind).record(seconds);
}

/// Records a stream of `kind` that ended with an error status.
pub fn stream_failed(kind: &'static str, code: Code) {
    metrics::counter!("mssql_cdc_flight_streams_total", "kind" => kind, "outcome" => code_name(code))
        .increment(1);
}

/// Whether the source answered health's last probe.
pub fn source_up(up: bool) {
    metrics::gauge!("mssql_cdc_flight_source_up").set(if up { 1.0 } else { 0.0 });
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
