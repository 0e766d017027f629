//! The bounds of everything a client controls, each a `serve` flag with a safe default.
//!
//! A request over a bound is refused before it reaches the source: `INVALID_ARGUMENT` naming
//! the bound for sizes and counts, `RESOURCE_EXHAUSTED` with a retry hint for the stream
//! limits (the caller may come back later), `DEADLINE_EXCEEDED` for a planning call that ran
//! out of time.

use std::time::Duration;

use super::gate::{BATCHES_PER_STREAM, MIN_SHARE_BYTES};
use crate::error::{Error, Result};
use crate::protocol::{DEFAULT_BATCH_BYTES, DEFAULT_BATCH_ROWS};

/// How long a stream waits for its client to take a batch, unless told otherwise.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(600);

/// The service's bounds (docs/protocol.md, "Limits").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most rows a client may ask per batch.
    pub max_batch_rows: usize,
    /// Most bytes (Arrow memory) a client may ask per batch. With the default, a batch of
    /// rows under 1 MiB each stays under gRPC's common 4 MiB message limit.
    pub max_batch_bytes: usize,
    /// Most chunks of one snapshot request (one signed ticket each, so this bounds the size
    /// of the `FlightInfo`).
    pub max_chunks: usize,
    /// Most rows a `key_bound` seek may skip (`n`): the source reads them all.
    pub max_seek_rows: u64,
    /// Most `do_get` streams open at once.
    pub max_streams: usize,
    /// Most `do_get` streams open at once for one principal.
    pub max_streams_per_principal: usize,
    /// Most planning calls (`list_flights`, `get_flight_info`, `get_schema`, `do_action`)
    /// running at once for one principal (the default fits a sidecar's 128 table slots).
    pub max_calls_per_principal: usize,
    /// Bytes all open streams may hold together on their way to clients: each stream's
    /// batches are cut to its share ([`super::gate`]).
    pub stream_memory: usize,
    /// Deadline of a planning call (`list_flights`, `get_flight_info`, `get_schema`,
    /// `do_action`).
    pub call_timeout: Duration,
    /// Largest message the server accepts from a client.
    pub max_request_bytes: usize,
    /// HTTP/2 keepalive ping interval; a peer that does not answer within
    /// `keepalive_timeout` is dropped (and its streams with it).
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered.
    pub keepalive_timeout: Duration,
    /// Most connections open at once from one address (an IPv6 /64); one more is closed when
    /// accepted.
    pub max_connections_per_peer: usize,
    /// Most connections open at once from everyone.
    pub max_connections: usize,
    /// Most calls (HTTP/2 streams) open at once on one connection: a writer multiplexes its
    /// tables' streams and planning calls over few connections.
    pub max_streams_per_connection: u32,
    /// With authentication: how long a connection may stay open before one of its calls
    /// presents valid credentials; then it is closed.
    pub unauthenticated_timeout: Duration,
    /// With authentication: connections open at once from one address before any of their
    /// calls presented valid credentials.
    pub max_unauthenticated_per_peer: usize,
    /// How long a `do_get` stream may wait for its client to take a batch: past it the
    /// stream ends (`STREAM_STALLED`) and its source read, with its connection, is released.
    /// Ten minutes by default, longer than the writer leaves a chunk's stream unread while it
    /// drains the one before (docs/security.md); `None`: no limit.
    pub stall_timeout: Option<Duration>,
    /// Source reads (streams and planning calls) one principal may run at once ([`super::share`]);
    /// `None`: the source's pool less one, `Some(0)`: no bound.
    pub source_share: Option<usize>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_batch_rows: 100_000,
            max_batch_bytes: DEFAULT_BATCH_BYTES,
            max_chunks: 1_000,
            max_seek_rows: 10_000_000,
            max_streams: 64,
            max_streams_per_principal: 16,
            max_calls_per_principal: 256,
            stream_memory: 64 << 20,
            call_timeout: Duration::from_secs(120),
            max_request_bytes: 1 << 20,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            // A writer sidecar holds about 3 a table (its stream, a snapshot's backfill, a
            // second partition's reader), and clients behind one NAT or proxy share an
            // address: room for a thousand tables, not a bound on every client.
            max_connections_per_peer: 4_096,
            max_connections: 16_384,
            // hyper's own default, which the server had before it was a flag: above what a
            // client multiplexes on one connection (the stream and call bounds refuse the
            // excess anyway), far below letting one connection hold requests without end.
            max_streams_per_connection: 200,
            // A client sends its credentials with its first call; a health probe needs none
            // and is done well within it.
            unauthenticated_timeout: Duration::from_secs(10),
            // A sidecar's clients connect in a burst at start, each admitted with its first
            // call a moment later.
            max_unauthenticated_per_peer: 256,
            stall_timeout: Some(DEFAULT_STALL_TIMEOUT),
            source_share: None,
        }
    }
}

/// Rows and bytes per batch of a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBounds {
    /// Most rows per batch.
    pub rows: usize,
    /// Most bytes per batch (one row at least).
    pub bytes: usize,
}

impl Limits {
    /// The batch bounds a command asks for, defaulted and checked against the limits.
    pub fn batch_bounds(&self, rows: Option<usize>, bytes: Option<usize>) -> Result<BatchBounds> {
        let rows = rows.unwrap_or(DEFAULT_BATCH_ROWS.min(self.max_batch_rows));
        let bytes = bytes.unwrap_or(DEFAULT_BATCH_BYTES.min(self.max_batch_bytes));
        within("batch_rows", rows as u64, 1, self.max_batch_rows as u64)?;
        within("batch_bytes", bytes as u64, 1, self.max_batch_bytes as u64)?;
        Ok(BatchBounds { rows, bytes })
    }

    /// Checks that the limits fit together: every stream allowed open gets a share of
    /// the stream memory of at least the smallest batch.
    pub fn check(&self) -> Result<()> {
        let least = self.max_streams * BATCHES_PER_STREAM * MIN_SHARE_BYTES;
        if self.stream_memory < least {
            return Err(Error::invalid(format!(
                "--stream-memory {} is too small for --max-streams {}: every stream needs \
                 {BATCHES_PER_STREAM} batches of at least {MIN_SHARE_BYTES} bytes, \
                 {least} bytes in all",
                self.stream_memory, self.max_streams
            )));
        }
        if self.max_connections_per_peer == 0
            || self.max_connections == 0
            || self.max_unauthenticated_per_peer == 0
            || self.max_streams_per_connection == 0
        {
            return Err(Error::invalid(
                "--max-connections-per-peer, --max-connections, \
                 --max-unauthenticated-per-peer and --max-streams-per-connection must be at \
                 least 1",
            ));
        }
        Ok(())
    }

    /// Checks the number of chunks of a snapshot request.
    pub fn check_chunks(&self, chunks: usize) -> Result<()> {
        within(
            "the number of chunks",
            chunks as u64,
            0,
            self.max_chunks as u64,
        )
    }

    /// Checks the `n` of a `key_bound` seek.
    pub fn check_seek_rows(&self, n: u64) -> Result<()> {
        within("key_bound's n", n, 0, self.max_seek_rows)
    }
}

/// `INVALID_ARGUMENT` unless `low <= value <= high`, naming the bound.
fn within(name: &str, value: u64, low: u64, high: u64) -> Result<()> {
    if (low..=high).contains(&value) {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{name} must be between {low} and {high} (the server's limit), not {value}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_bounds_default_and_refuse_what_is_past_the_limits() {
        let limits = Limits::default();
        assert_eq!(
            limits.batch_bounds(None, None).expect("defaults"),
            BatchBounds {
                rows: DEFAULT_BATCH_ROWS,
                bytes: DEFAULT_BATCH_BYTES
            }
        );
        let error = limits
            .batch_bounds(Some(1), Some(64 << 20))
            .expect_err("over the byte limit");
        assert!(
            error
                .to_string()
                .contains("batch_bytes must be between 1 and"),
            "{error}"
        );
        assert!(limits.batch_bounds(Some(0), None).is_err());
        let small = Limits {
            max_batch_rows: 10,
            ..Limits::default()
        };
        assert_eq!(small.batch_bounds(None, None).expect("clamped").rows, 10);
        assert!(limits.check_chunks(1_000).is_ok());
        assert!(limits.check_chunks(1_001).is_err());
        assert!(limits.check_seek_rows(10_000_001).is_err());
        assert!(limits.check().is_ok());
        let starved = Limits {
            max_streams: 1_000,
            ..Limits::default()
        };
        let error = starved.check().expect_err("64 MiB for 1,000 streams");
        assert!(error.to_string().contains("--stream-memory"), "{error}");
    }
}
