//! Retries of work the Flight server did not finish ([`WriterError::is_redoable`]: a
//! restart, a cut connection, a ticket it no longer honours). The client retries each call
//! itself; a stream cut mid-way, or a plan whose tickets went stale, is redone here by the
//! unit that can be redone whole: a stream's batch (replayed from its checkpoint record), a
//! backfill call (read on from facts), a snapshot open (found again in the plans table), and
//! a connection.

use std::time::Duration;

use mssql_cdc_proto::client::transient_retries;

use crate::error::WriterError;

/// The waits between tries: those of each call ([`transient_retries`]: about 3 s), but 3 at
/// most, as each try's calls wait themselves.
pub(crate) fn server_retries() -> backon::ExponentialBuilder {
    transient_retries().with_max_times(3)
}

/// The waits of [`server_retries`], for a loop that retries by hand.
pub(crate) fn waits() -> impl Iterator<Item = Duration> {
    backon::BackoffBuilder::build(server_retries())
}

/// Logs a retry of `what` (for `table`) after `error`, in `wait`.
pub(crate) fn log(what: &str, table: &str, error: &WriterError, wait: Duration) {
    tracing::warn!(%table, %error, retry_in_ms = wait.as_millis() as u64,
        "the server failed in passing; {what} runs again");
}
