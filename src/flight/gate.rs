//! The bound on open `do_get` streams, in total and per principal, and their share of the
//! server's stream memory; and the bound on one principal's planning calls at once.
//!
//! A stream holds a [`StreamSlot`] from the moment its ticket is accepted until its response
//! is dropped (read to its end, failed, or abandoned by the client). Over either bound the
//! call is refused at once with `RESOURCE_EXHAUSTED` and a retry hint, instead of queueing:
//! the caller (a Spark task, the writer's retry loop) knows best whether to wait.
//!
//! Memory: a stream holds at most [`BATCHES_PER_STREAM`] batches on its way to the client,
//! so the gate bounds what all streams hold by bounding their batch size. The open streams
//! share `stream_memory` equally; every open and close moves the share, and readers cut each
//! batch at the share of that moment ([`crate::source::BatchBytes`]). A stream alone keeps
//! the batch size its ticket asked for; 32 slow readers each get small batches instead of
//! 32 times the memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The retry hint of a refused stream: about the time a batch of streams takes.
const RETRY_AFTER_SECONDS: u64 = 2;

/// Batches one stream may hold at once, counted along its path: in the source reader, the
/// batch being built, the one queued and the one waiting to be queued (3); in the producer,
/// the one it holds and the IPC message it encodes it into (2); the message queued for the
/// connection (1); the message being framed and the one in the HTTP/2 send buffer (2).
pub const BATCHES_PER_STREAM: usize = 8;

/// The smallest batch the share lowers a stream to: below it, per-message costs dominate.
pub const MIN_SHARE_BYTES: usize = 32 << 10;

/// Counts the open streams and sets their share of the stream memory.
#[derive(Debug)]
pub struct StreamGate {
    max_total: usize,
    max_per_principal: usize,
    stream_memory: usize,
    open: Mutex<Open>,
    /// The byte bound of every open stream's next batch.
    share: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_principal: HashMap<String, usize>,
}

/// One open stream's place; dropping it frees the place.
#[derive(Debug)]
pub struct StreamSlot {
    gate: Arc<StreamGate>,
    principal: Option<String>,
}

impl StreamGate {
    /// A gate of `max_total` streams, `max_per_principal` of them for one principal, sharing
    /// `stream_memory` bytes.
    pub fn new(max_total: usize, max_per_principal: usize, stream_memory: usize) -> Arc<Self> {
        Arc::new(StreamGate {
            max_total,
            max_per_principal,
            stream_memory,
            open: Mutex::new(Open::default()),
            share: Arc::new(AtomicUsize::new(batch_share(stream_memory, 0))),
        })
    }

    /// The byte bound of every open stream's next batch, kept current by the gate.
    pub fn batch_share(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.share)
    }

    /// A place for one more stream of `principal` (`None`: the anonymous caller of a server
    /// without authentication, bound by the total only), or `Busy` when a bound is reached.
    pub fn enter(self: &Arc<Self>, principal: Option<&str>) -> Result<StreamSlot> {
        let mut open = self.lock();
        let mine = principal
            .and_then(|name| open.by_principal.get(name).copied())
            .unwrap_or(0);
        if open.total >= self.max_total {
            return Err(Error::Busy {
                what: format!(
                    "the server has {} streams open, its limit (--max-streams)",
                    self.max_total
                ),
                retry_after_seconds: RETRY_AFTER_SECONDS,
            });
        }
        if let Some(name) = principal
            && mine >= self.max_per_principal
        {
            return Err(Error::Busy {
                what: format!(
                    "principal '{name}' has {mine} streams open, its limit \
                     (--max-streams-per-principal)"
                ),
                retry_after_seconds: RETRY_AFTER_SECONDS,
            });
        }
        open.total += 1;
        self.share_among(open.total);
        super::metrics::streams_active(1.0);
        if let Some(name) = principal {
            *open.by_principal.entry(name.to_string()).or_default() += 1;
        }
        Ok(StreamSlot {
            gate: Arc::clone(self),
            principal: principal.map(str::to_string),
        })
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.lock().total
    }

    fn share_among(&self, streams: usize) {
        let share = batch_share(self.stream_memory, streams);
        self.share.store(share, Ordering::Relaxed);
        super::metrics::batch_share(share);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // A panic while holding the lock leaves counts that are still whole numbers.
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.gate.lock();
        open.total = open.total.saturating_sub(1);
        self.gate.share_among(open.total);
        super::metrics::streams_active(-1.0);
        if let Some(name) = &self.principal
            && let Some(count) = open.by_principal.get_mut(name)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.by_principal.remove(name);
            }
        }
    }
}

/// The batch bound of each of `streams` open streams sharing `stream_memory`.
pub fn batch_share(stream_memory: usize, streams: usize) -> usize {
    (stream_memory / (streams.max(1) * BATCHES_PER_STREAM)).max(MIN_SHARE_BYTES)
}

/// The bound on one principal's planning calls running at once (`list_flights`,
/// `get_flight_info`, `get_schema`, `do_action`): each may cost the source a query, and a
/// loop of them must not take every pooled connection. Over it a call is refused at once
/// with `RESOURCE_EXHAUSTED` and a retry hint.
#[derive(Debug)]
pub struct CallGate {
    max_per_principal: usize,
    running: Mutex<HashMap<String, usize>>,
}

/// One running call's place; dropping it frees the place.
#[derive(Debug)]
pub struct CallSlot {
    gate: Arc<CallGate>,
    principal: Option<String>,
}

impl CallGate {
    /// A gate of `max_per_principal` calls at once for one principal.
    pub fn new(max_per_principal: usize) -> Arc<Self> {
        Arc::new(CallGate {
            max_per_principal,
            running: Mutex::new(HashMap::new()),
        })
    }

    /// A place for one more call of `principal` (`None`: the anonymous caller of a server
    /// without authentication, which is not bound), or `Busy`.
    pub fn enter(self: &Arc<Self>, principal: Option<&str>) -> Result<CallSlot> {
        if let Some(name) = principal {
            let mut running = self.lock();
            let mine = running.entry(name.to_string()).or_default();
            if *mine >= self.max_per_principal {
                return Err(Error::Busy {
                    what: format!(
                        "principal '{name}' has {mine} planning calls running, its limit \
                         (--max-calls-per-principal)"
                    ),
                    retry_after_seconds: RETRY_AFTER_SECONDS,
                });
            }
            *mine += 1;
        }
        Ok(CallSlot {
            gate: Arc::clone(self),
            principal: principal.map(str::to_string),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        if let Some(name) = &self.principal {
            let mut running = self.gate.lock();
            if let Some(count) = running.get_mut(name) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    running.remove(name);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_bounds_streams_in_total_and_per_principal_and_frees_on_drop() {
        let gate = StreamGate::new(3, 2, 64 << 20);
        let a1 = gate.enter(Some("a")).expect("first");
        let _a2 = gate.enter(Some("a")).expect("second");
        let refused = gate.enter(Some("a")).expect_err("a's third");
        assert!(
            refused.to_string().contains("principal 'a' has 2 streams"),
            "{refused}"
        );
        let _b1 = gate.enter(Some("b")).expect("b");
        let full = gate.enter(Some("c")).expect_err("total");
        assert!(matches!(full, Error::Busy { .. }));
        assert_eq!(gate.open_streams(), 3);
        drop(a1);
        assert_eq!(gate.open_streams(), 2);
        let _a3 = gate
            .enter(Some("a"))
            .expect("a again after a slot was freed");
    }

    #[test]
    fn the_anonymous_caller_is_bound_by_the_total_only() {
        let gate = StreamGate::new(3, 1, 64 << 20);
        let slots: Vec<_> = (0..3)
            .map(|_| gate.enter(None).expect("within the total"))
            .collect();
        assert!(gate.enter(None).is_err());
        drop(slots);
        assert_eq!(gate.open_streams(), 0);
    }

    #[test]
    fn open_streams_share_the_stream_memory_and_closing_gives_it_back() {
        let gate = StreamGate::new(8, 8, 8 << 20);
        let share = gate.batch_share();
        let now = || share.load(Ordering::Relaxed);
        assert_eq!(now(), 1 << 20, "nobody open: a first stream's share");
        let first = gate.enter(None).expect("first");
        assert_eq!(now(), 1 << 20, "alone: all of it");
        let others: Vec<_> = (0..3).map(|_| gate.enter(None).expect("more")).collect();
        assert_eq!(now(), 256 << 10, "a quarter each for four");
        drop(others);
        assert_eq!(now(), 1 << 20);
        drop(first);
        assert_eq!(
            batch_share(1 << 20, 64),
            MIN_SHARE_BYTES,
            "never below the floor"
        );
    }

    #[test]
    fn a_principal_runs_at_most_its_calls_at_once_and_anonymous_callers_are_not_bound() {
        let gate = CallGate::new(2);
        let first = gate.enter(Some("a")).expect("first");
        let _second = gate.enter(Some("a")).expect("second");
        let refused = gate.enter(Some("a")).expect_err("third");
        assert!(matches!(refused, Error::Busy { .. }));
        assert!(
            refused.to_string().contains("--max-calls-per-principal"),
            "{refused}"
        );
        let _other = gate.enter(Some("b")).expect("another principal");
        drop(first);
        let _again = gate.enter(Some("a")).expect("a place freed");
        let anonymous: Vec<_> = (0..5)
            .map(|_| gate.enter(None).expect("anonymous"))
            .collect();
        assert_eq!(anonymous.len(), 5);
    }
}
