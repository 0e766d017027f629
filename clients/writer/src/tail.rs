//! How a continuous stream waits when nothing is new: on the server's live tail
//! (`wait_for_commits`), which answers as soon as a commit lands, or the poll interval.
//!
//! `max_lsn` is database-wide, so the tail wakes a table's stream for any table's commit. A
//! stream therefore rides the tail only while its batches bring rows: after a batch that
//! brought none (the table is quiet while others are busy), it waits the poll interval, as a
//! polling writer does, and a quiet table costs no more batches than before.

use std::time::Duration;

use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::{MAX_WAIT_MS, WaitForCommitsAnswer, WaitForCommitsBody};

/// How a continuous stream waits when nothing is new.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Waiting {
    /// The longest wait, and the whole wait where the tail is not used.
    pub poll: Duration,
    /// Whether to wait on the server's live tail.
    pub live_tail: bool,
}

impl Waiting {
    /// Waiting on the live tail, at most `poll` at a time.
    pub fn tail(poll: Duration) -> Self {
        Waiting {
            poll,
            live_tail: true,
        }
    }
}

/// The tail's state of one stream.
#[derive(Debug)]
pub struct Tail {
    /// The LSN the stream has read to, when it last found nothing new.
    after: Option<Lsn>,
    /// Whether the last batch brought rows (true until a batch says otherwise).
    busy: bool,
    /// The server answered that it has no `wait_for_commits` (an older server).
    unsupported: bool,
    /// The tail last woke the stream past this LSN. Finding nothing new past it again (a
    /// range capped below `max_lsn`) waits the poll interval, so the stream never spins.
    woken_after: Option<Lsn>,
}

impl Default for Tail {
    fn default() -> Self {
        Tail {
            after: None,
            busy: true,
            unsupported: false,
            woken_after: None,
        }
    }
}

impl Tail {
    /// The stream found nothing new past `lsn`.
    pub fn caught_up(&mut self, lsn: Lsn) {
        self.after = Some(lsn);
    }

    /// The stream committed a batch of `rows` rows.
    pub fn batch(&mut self, rows: u64) {
        self.busy = rows > 0;
        self.woken_after = None;
    }

    /// Waits for new commits as `waiting` says; returns once a commit may be there.
    pub async fn wait(&mut self, client: &CdcClient, waiting: Waiting) {
        if !self.wait_on_tail(client, waiting).await {
            tokio::time::sleep(waiting.poll).await;
        }
    }

    /// Waits on the server's live tail where the stream may; `false` when it must wait the
    /// poll interval instead (tail off or unusable, a quiet table, a wake that found nothing).
    async fn wait_on_tail(&mut self, client: &CdcClient, waiting: Waiting) -> bool {
        let after = match self.after {
            Some(after)
                if waiting.live_tail
                    && self.busy
                    && !self.unsupported
                    && self.woken_after != Some(after) =>
            {
                after
            }
            _ => {
                self.woken_after = None;
                return false;
            }
        };
        let body = WaitForCommitsBody {
            after,
            timeout_ms: Some((waiting.poll.as_millis() as u64).clamp(1, MAX_WAIT_MS)),
        };
        match client
            .action::<WaitForCommitsAnswer>("wait_for_commits", &body)
            .await
        {
            Ok(answer) => {
                if !answer.timed_out {
                    self.woken_after = Some(after);
                }
                true
            }
            Err(error) if error.to_string().contains("unknown action") => {
                tracing::warn!(%error, "the server has no live tail (wait_for_commits): polling");
                self.unsupported = true;
                false
            }
            Err(error) => {
                // The next batch meets the same server and reports what is wrong.
                tracing::debug!(%error, "the live tail failed: waiting the poll interval");
                false
            }
        }
    }
}
