//! Group commits to the facts and control tables the sidecar's tables share.
//!
//! Each stream of a sidecar writes one facts commit per batch and one verdict MERGE per batch
//! that can move its verdict, to the same two Delta tables. Done one by one, a thousand
//! tables whose verdicts move at the same hour contend for the same log: a MERGE fails on
//! any concurrent commit ([`tables::rewrite_commit`]) and each retry loses again to the
//! others. The ledger takes
//! every stream's facts rows and verdict move instead. Its task commits whatever has queued
//! while the previous commit ran in one commit: the facts rows of many batches with one
//! application transaction per batch, `(<app_id>#facts, batch_id)` each, exactly what a
//! stream's own commit records; and one MERGE moving many tables' verdicts. A lone batch
//! commits alone, as before. A replay after a crash finds its transaction as it would have.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use mssql_cdc_proto::{CommitTime, Offset};
use tokio::sync::{mpsc, oneshot};
use url::Url;

use crate::control::{self, Granularity};
use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind};

/// The most batches or verdicts one group commit holds.
pub const MAX_GROUP: usize = 1_000;

/// How many requests may wait for the next group (beyond it, a stream waits to queue).
const QUEUE: usize = 4 * MAX_GROUP;

/// One batch's facts rows.
struct FactsEntry {
    app_id: String,
    version: i64,
    rows: RecordBatch,
    written: oneshot::Sender<std::result::Result<bool, String>>,
}

/// One table's verdict move.
struct VerdictEntry {
    table: String,
    end: Offset,
    verdict: oneshot::Sender<std::result::Result<Option<CommitTime>, String>>,
}

/// The group committer of one facts table and (optionally) one control table. Its tasks end
/// when the last handle is dropped.
pub struct Ledger {
    facts: mpsc::Sender<FactsEntry>,
    control: Option<mpsc::Sender<VerdictEntry>>,
}

impl Ledger {
    /// Starts the tasks committing to `facts` and `control` (verdicts truncated to
    /// `granularity`).
    pub fn start(facts: Url, control: Option<Url>, granularity: Granularity) -> Arc<Self> {
        let (facts_queue, facts_entries) = mpsc::channel(QUEUE);
        tokio::spawn(commit_facts(facts, facts_entries));
        let control = control.map(|url| {
            let (queue, entries) = mpsc::channel(QUEUE);
            tokio::spawn(commit_verdicts(url, granularity, entries));
            queue
        });
        Arc::new(Ledger {
            facts: facts_queue,
            control,
        })
    }

    /// Appends `rows` to the facts table with the transaction `(app_id, version)`, unless
    /// the table holds it already; whether it wrote.
    pub async fn append_facts(
        &self,
        app_id: &str,
        version: i64,
        rows: RecordBatch,
    ) -> Result<bool> {
        let (written, answer) = oneshot::channel();
        let entry = FactsEntry {
            app_id: app_id.to_string(),
            version,
            rows,
            written,
        };
        self.facts.send(entry).await.map_err(|_| stopped())?;
        answer
            .await
            .map_err(|_| stopped())?
            .map_err(WriterError::Internal)
    }

    /// Moves `table`'s verdict to `end`'s commit time truncated to the granularity, if that
    /// is later; the verdict after the move (`None` without a control table or verdict).
    pub async fn advance(&self, table: &str, end: Offset) -> Result<Option<CommitTime>> {
        let Some(control) = &self.control else {
            return Ok(None);
        };
        let (verdict, answer) = oneshot::channel();
        let entry = VerdictEntry {
            table: table.to_string(),
            end,
            verdict,
        };
        control.send(entry).await.map_err(|_| stopped())?;
        answer
            .await
            .map_err(|_| stopped())?
            .map_err(WriterError::Internal)
    }
}

fn stopped() -> WriterError {
    WriterError::Internal("the facts and control ledger stopped".into())
}

/// The next group: the entry `carried` over from the last group or the next to arrive, then
/// the entries queued now, up to [`MAX_GROUP`], stopping before a second entry of one key
/// (carried into the next group). `None` once every sender is gone.
async fn next_group<T>(
    carried: &mut Option<T>,
    entries: &mut mpsc::Receiver<T>,
    key: impl Fn(&T) -> &str,
) -> Option<Vec<T>> {
    let first = match carried.take() {
        Some(entry) => entry,
        None => entries.recv().await?,
    };
    let mut keys = HashSet::from([key(&first).to_string()]);
    let mut group = vec![first];
    while group.len() < MAX_GROUP {
        let Ok(entry) = entries.try_recv() else {
            break;
        };
        if !keys.insert(key(&entry).to_string()) {
            *carried = Some(entry);
            break;
        }
        group.push(entry);
    }
    Some(group)
}

async fn commit_facts(url: Url, mut entries: mpsc::Receiver<FactsEntry>) {
    // The facts table as the last commit left it: each group reads only the commits since.
    let mut table = None;
    let mut carried = None;
    while let Some(group) = next_group(&mut carried, &mut entries, |entry| &entry.app_id).await {
        let batches: Vec<(String, i64, RecordBatch)> = group
            .iter()
            .map(|entry| (entry.app_id.clone(), entry.version, entry.rows.clone()))
            .collect();
        match tables::append_once_each(&mut table, &url, TableKind::Facts, "facts", batches).await {
            Ok(written) => {
                for (entry, wrote) in group.into_iter().zip(written) {
                    let _ = entry.written.send(Ok(wrote));
                }
            }
            Err(error) => {
                let message = format!("facts commit: {error}");
                for entry in group {
                    let _ = entry.written.send(Err(message.clone()));
                }
            }
        }
    }
}

async fn commit_verdicts(
    url: Url,
    granularity: Granularity,
    mut entries: mpsc::Receiver<VerdictEntry>,
) {
    // The control table as the last MERGE left it: each group reads only the commits since.
    let mut table = None;
    let mut carried = None;
    while let Some(group) = next_group(&mut carried, &mut entries, |entry| &entry.table).await {
        let moves: Vec<(String, Offset)> = group
            .iter()
            .map(|entry| (entry.table.clone(), entry.end))
            .collect();
        match control::advance_each(&mut table, &url, &moves, granularity).await {
            Ok(verdicts) => {
                for entry in group {
                    let verdict = verdicts.get(&entry.table).copied().flatten();
                    let _ = entry.verdict.send(Ok(verdict));
                }
            }
            Err(error) => {
                let message = format!("verdict MERGE: {error}");
                for entry in group {
                    let _ = entry.verdict.send(Err(message.clone()));
                }
            }
        }
    }
}
