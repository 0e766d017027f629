//! The live tail: `wait_for_commits` answers as soon as `max_lsn` moves past the caller's LSN,
//! so a client waits for new commits instead of polling.
//!
//! One watcher per service reads `max_lsn` every `interval`, and only while at least one call
//! waits; every waiting call, whatever its table or client, shares that one read. A quiet
//! server costs the source nothing, and a busy tail costs one `max_lsn` per interval. On SQL
//! Server a commit becomes visible in the change tables when the capture job's next log scan
//! picks it up, so the tail's latency is that scan's plus at most one interval
//! (docs/protocol.md, "The live tail").

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use crate::lsn::Lsn;
use crate::source::CdcSource;

/// How often the watcher reads `max_lsn` while calls wait, by default.
pub const TAIL_INTERVAL: Duration = Duration::from_millis(100);

/// How long an idle watcher sleeps before it checks again whether its service still exists.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What the watcher shares with the waiting calls.
struct Shared {
    /// `max_lsn` as last read (`None`: not read yet, or no commit).
    max_lsn: watch::Sender<Option<Lsn>>,
    /// Wakes an idle watcher when a call starts to wait.
    wake: Notify,
}

/// The service's `max_lsn` watcher.
pub struct CommitWatch {
    shared: Arc<Shared>,
    source: Arc<dyn CdcSource>,
    interval: Duration,
    started: OnceLock<()>,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitOutcome {
    /// `max_lsn` as last read.
    pub max_lsn: Option<Lsn>,
    /// Whether the timeout passed with `max_lsn` not past the caller's LSN.
    pub timed_out: bool,
}

impl CommitWatch {
    /// A watcher over `source` reading `max_lsn` every `interval` while calls wait. It starts
    /// with the first wait (inside the runtime) and ends when the service is dropped.
    pub fn new(source: Arc<dyn CdcSource>, interval: Duration) -> Self {
        CommitWatch {
            shared: Arc::new(Shared {
                max_lsn: watch::Sender::new(None),
                wake: Notify::new(),
            }),
            source,
            interval,
            started: OnceLock::new(),
        }
    }

    /// Waits until `max_lsn` is past `after`, or `timeout` has passed.
    pub async fn wait_after(&self, after: Lsn, timeout: Duration) -> WaitOutcome {
        self.start();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = self.shared.max_lsn.subscribe();
        self.shared.wake.notify_one();
        loop {
            // `max_lsn` only grows, so a value read before this call began and already past
            // `after` is a true answer.
            let max_lsn = *seen.borrow_and_update();
            if max_lsn.is_some_and(|lsn| lsn > after) {
                return WaitOutcome {
                    max_lsn,
                    timed_out: false,
                };
            }
            tokio::select! {
                changed = seen.changed() => {
                    if changed.is_err() {
                        return WaitOutcome { max_lsn, timed_out: true };
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return WaitOutcome { max_lsn, timed_out: true };
                }
            }
        }
    }

    fn start(&self) {
        self.started.get_or_init(|| {
            tokio::spawn(watch_max_lsn(
                Arc::clone(&self.shared),
                Arc::clone(&self.source),
                self.interval,
            ));
        });
    }
}

/// The watcher: reads `max_lsn` every `interval` while a call waits, sleeps while none does,
/// and ends once it holds the last reference to what it shares (the service is gone).
async fn watch_max_lsn(shared: Arc<Shared>, source: Arc<dyn CdcSource>, interval: Duration) {
    while Arc::strong_count(&shared) > 1 {
        if shared.max_lsn.receiver_count() == 0 {
            let _ = tokio::time::timeout(IDLE_CHECK, shared.wake.notified()).await;
            continue;
        }
        match source.max_lsn().await {
            Ok(lsn) => {
                shared.max_lsn.send_if_modified(|last| {
                    let moved = *last != lsn;
                    *last = lsn;
                    moved
                });
            }
            // The waiting calls time out and their callers' next calls see the error.
            Err(error) => tracing::debug!(%error, "the live tail could not read max_lsn"),
        }
        tokio::time::sleep(interval).await;
    }
}
