//! How a continuous stream waits when nothing is new: on the server's live tail
//! (`wait_for_commits`), which answers as soon as a commit lands, or the poll interval.
//!
//! `max_lsn` is database-wide, so the tail wakes a table's stream for any table's commit. A
//! stream therefore rides the tail only while its batches bring rows: after a batch that
//! brought none (the table is quiet while others are busy), it waits the poll interval, as a
//! polling writer does, and a quiet table costs no more batches than before.
//!
//! The sidecar instead runs one [`SharedTail`] for all its tables: one call waits on every
//! table by name, and only the streams of tables that changed wake.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::{
    LsnAnswer, MAX_WAIT_MS, TimeAnswer, WaitForCommitsAnswer, WaitForCommitsBody,
};
use mssql_cdc_proto::{CommitTime, Lsn};
use serde_json::json;
use tokio::sync::Notify;

use crate::control::Granularity;

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
    /// The table's wake from the sidecar's [`SharedTail`], when it has one.
    shared: Option<Arc<Notify>>,
}

impl Default for Tail {
    fn default() -> Self {
        Tail {
            after: None,
            busy: true,
            unsupported: false,
            woken_after: None,
            shared: None,
        }
    }
}

impl Tail {
    /// A tail woken by the sidecar's shared tail (`wake` is the table's).
    pub fn shared(wake: Arc<Notify>) -> Self {
        Tail {
            shared: Some(wake),
            ..Tail::default()
        }
    }

    /// The stream found nothing new past `lsn`.
    pub fn caught_up(&mut self, lsn: Lsn) {
        self.after = Some(lsn);
    }

    /// The stream found nothing to write up to `lsn` (a range without rows left for later):
    /// the table is quiet.
    pub fn quiet(&mut self, lsn: Lsn) {
        self.caught_up(lsn);
        self.busy = false;
        self.woken_after = None;
    }

    /// The stream committed a batch of `rows` rows.
    pub fn batch(&mut self, rows: u64) {
        self.busy = rows > 0;
        self.woken_after = None;
    }

    /// Waits for new commits as `waiting` says; returns once a commit may be there. A
    /// stream of the sidecar's shared tail waits for its table's wake instead.
    pub async fn wait(&mut self, client: &CdcClient, waiting: Waiting) {
        if let Some(wake) = &self.shared {
            wake.notified().await;
            return;
        }
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
            tables: None,
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

/// The sidecar's one live tail for all its tables: a single `wait_for_commits` call names
/// every table and wakes the streams of those that changed. A quiet table costs the source
/// nothing between commits; the server checks all listed tables in one call each time
/// `max_lsn` moves (docs/protocol.md, "Many tables").
///
/// A quiet table's verdict still moves once per granularity period: when the database's
/// commits cross into a new period, every table is woken, and each writes the batch that
/// moves its verdict.
pub struct SharedTail {
    tables: Vec<String>,
    wakes: HashMap<String, Arc<Notify>>,
    granularity: Granularity,
}

impl SharedTail {
    /// A shared tail over `tables` (each listed once).
    pub fn new(tables: impl IntoIterator<Item = String>, granularity: Granularity) -> Self {
        let mut names = Vec::new();
        let mut wakes = HashMap::new();
        for table in tables {
            if !wakes.contains_key(&table) {
                wakes.insert(table.clone(), Arc::new(Notify::new()));
                names.push(table);
            }
        }
        SharedTail {
            tables: names,
            wakes,
            granularity,
        }
    }

    /// The wake of `table`'s stream; `None` for a table not listed.
    pub fn wake(&self, table: &str) -> Option<Arc<Notify>> {
        self.wakes.get(table).cloned()
    }

    /// Whether the server waits on named tables (an older one refuses the `tables` field).
    pub async fn supported(&self, client: &CdcClient) -> bool {
        let Some(first) = self.tables.first() else {
            return false;
        };
        let probe = async {
            let max: LsnAnswer = client.action("max_lsn", &json!({})).await?;
            let body = WaitForCommitsBody {
                after: max.lsn.unwrap_or(Lsn::ZERO),
                timeout_ms: Some(1),
                tables: Some(vec![first.clone()]),
            };
            client
                .action::<WaitForCommitsAnswer>("wait_for_commits", &body)
                .await
        };
        match probe.await {
            Ok(answer) => answer.changed.is_some(),
            Err(error) => {
                tracing::warn!(%error, "the server does not wait on named tables: each table waits on its own");
                false
            }
        }
    }

    /// Waits on the server for every table until `stop`, waking the streams of tables that
    /// changed, and all of them when the commits cross into a new verdict period. A failed
    /// call is retried after `retry`, from the same LSN, so no change is missed.
    pub async fn run(
        &self,
        client: &CdcClient,
        retry: std::time::Duration,
        stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut position: Option<(Lsn, Option<CommitTime>)> = None;
        while !*stop.borrow() {
            let step = async {
                let (after, period) = match position {
                    Some(known) => known,
                    None => {
                        let max: LsnAnswer = client.action("max_lsn", &json!({})).await?;
                        let after = max.lsn.unwrap_or(Lsn::ZERO);
                        (after, self.period_of(client, after).await?)
                    }
                };
                let body = WaitForCommitsBody {
                    after,
                    timeout_ms: Some(MAX_WAIT_MS),
                    tables: Some(self.tables.clone()),
                };
                let answer: WaitForCommitsAnswer = client.action("wait_for_commits", &body).await?;
                for table in answer.changed.iter().flatten() {
                    if let Some(wake) = self.wakes.get(table) {
                        wake.notify_one();
                    }
                }
                let lsn = answer.lsn.filter(|lsn| *lsn > after).unwrap_or(after);
                let mut period = period;
                if lsn > after && self.period_may_have_moved(period) {
                    let now = self.period_of(client, lsn).await?;
                    if now > period {
                        if period.is_some() {
                            tracing::debug!(
                                tables = self.tables.len(),
                                "a new verdict period: every table writes its batch"
                            );
                            for wake in self.wakes.values() {
                                wake.notify_one();
                            }
                        }
                        period = now;
                    }
                }
                Ok::<_, crate::error::WriterError>((lsn, period))
            };
            let mut stopping = stop.clone();
            let stepped = tokio::select! {
                stepped = step => stepped,
                _ = stopping.wait_for(|stopped| *stopped) => return,
            };
            match stepped {
                Ok(next) => position = Some(next),
                Err(error) => {
                    tracing::warn!(%error, "the shared live tail failed: retrying");
                    // Every table asks the server itself: one that cannot reach it says so
                    // (its state, the readiness probe) and retries on its own backoff,
                    // instead of waiting quietly on a tail that cannot wake it.
                    for wake in self.wakes.values() {
                        wake.notify_one();
                    }
                    crate::sidecar::sleep_unless_stopped(retry, &stop).await;
                }
            }
        }
    }

    /// Whether the wall clock has passed the end of `period` (so a commit may be in the next).
    fn period_may_have_moved(&self, period: Option<CommitTime>) -> bool {
        let now = CommitTime(chrono::Utc::now().timestamp_micros());
        period.is_none_or(|period| self.granularity.truncate(now) > period)
    }

    /// The verdict period of the commit at `lsn`.
    async fn period_of(
        &self,
        client: &CdcClient,
        lsn: Lsn,
    ) -> crate::error::Result<Option<CommitTime>> {
        if lsn == Lsn::ZERO {
            return Ok(None);
        }
        let answer: TimeAnswer = client.action("lsn_to_time", &json!({ "lsn": lsn })).await?;
        Ok(answer.commit_ts.map(|time| self.granularity.truncate(time)))
    }
}
