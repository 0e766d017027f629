//! The status board: what this writer process has seen of each table since it started (its
//! state, its last error, its recent batches and a per-minute history of rows and lag), for
//! the sidecar's status page and its readiness (`status_page`).
//!
//! The lake stays the record: the board only remembers what the process observed, seeded at
//! start with each table's positions from the lake (`Board::seed`). It is fed at the same
//! points as the Prometheus metrics (`crate::metrics`) and by the sidecar's supervisor, and it
//! records nothing until a sidecar run enables it, so one-off commands keep no history. The
//! sidecar's readiness (`/readyz`, gRPC health on the admin service) is read off it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};

use chrono::{DateTime, Utc};
use serde::Serialize;

/// Minutes of history kept per table (six hours): what the plots show.
pub const HISTORY_MINUTES: usize = 360;
/// Batches kept per table for the page's "last batches".
pub const RECENT_BATCHES: usize = 10;
/// The longest error message kept (the rest is cut with an ellipsis).
const MAX_ERROR_CHARS: usize = 2_000;

/// Where a table's supervision stands.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum TableState {
    /// Its first attempt has not connected yet (a bootstrap snapshot runs here).
    #[default]
    Starting,
    /// Its stream runs.
    Running,
    /// Its last attempt failed; the next starts at `retry_at`.
    Retrying {
        /// Failed attempts in a row.
        attempt: u32,
        /// When the next attempt starts (ISO 8601, UTC).
        retry_at: String,
    },
    /// Given up (an available-now run out of attempts, or an error retrying cannot fix).
    Failed,
    /// An available-now run reached its end.
    Finished,
    /// Stopped by a signal.
    Stopped,
    /// Run by another replica of the fleet (`holder`, when one holds its lease).
    Elsewhere {
        /// The replica that holds its lease.
        holder: Option<String>,
    },
}

impl TableState {
    /// A short name for the page.
    pub fn name(&self) -> &'static str {
        match self {
            TableState::Starting => "starting",
            TableState::Running => "running",
            TableState::Retrying { .. } => "retrying",
            TableState::Failed => "failed",
            TableState::Finished => "finished",
            TableState::Stopped => "stopped",
            TableState::Elsewhere { .. } => "elsewhere",
        }
    }

    /// Whether the table counts as ready: streaming, an available-now run done, or another
    /// replica's to run.
    pub fn is_ready(&self) -> bool {
        matches!(
            self,
            TableState::Running | TableState::Finished | TableState::Elsewhere { .. }
        )
    }
}

/// What a committed batch's facts row says, as the board keeps it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BatchSeen {
    /// The batch id.
    pub batch_id: i64,
    /// Rows written to bronze.
    pub rows: u64,
    /// Seconds from plan to the bronze commit.
    pub seconds: f64,
    /// The batch's end LSN.
    pub end_lsn: String,
    /// Seconds the batch's end lies behind the source's newest commit.
    pub behind_seconds: Option<f64>,
    /// When it committed (ISO 8601, UTC).
    pub at: String,
}

/// One minute of a table's history.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Minute {
    /// Minutes since the Unix epoch.
    pub minute: i64,
    /// Rows written to bronze in the minute.
    pub rows: u64,
    /// Batches committed in the minute (idle polls included).
    pub batches: u32,
    /// The most the table lay behind the source in the minute, in seconds.
    pub behind_seconds: Option<f64>,
}

/// The last failure of a table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ErrorSeen {
    /// When (ISO 8601, UTC).
    pub at: String,
    /// The error's message.
    pub message: String,
}

/// The last reconcile of a table's silver.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReconcileSeen {
    /// Its run id (the report table's `run_id`).
    pub run_id: String,
    /// When it ended (ISO 8601, UTC).
    pub at: String,
    /// Buckets compared.
    pub buckets: u64,
    /// Buckets that differ with no change in flight to explain it.
    pub mismatch: u64,
    /// The LSN it verified silver's rows at, when it found no difference.
    pub verified_lsn: Option<String>,
    /// Whether it compared every value of every row there too.
    pub values_verified: bool,
}

/// Everything the board knows of one table.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TableBoard {
    /// Source table.
    pub table: String,
    /// Where its supervision stands.
    pub state: TableState,
    /// Since when (ISO 8601, UTC).
    pub state_since: String,
    /// Failed attempts since the process started.
    pub failures: u64,
    /// The last failure, kept after the table recovers.
    pub last_error: Option<ErrorSeen>,
    /// The last batch's id (from the checkpoint until this process commits one).
    pub last_batch_id: Option<i64>,
    /// End LSN of the last batch.
    pub end_lsn: Option<String>,
    /// Seconds the last batch's end lay behind the source's newest commit.
    pub behind_seconds: Option<f64>,
    /// Bronze's verdict (`finalized_until`).
    pub bronze_verdict: Option<String>,
    /// Silver's position (`applied_lsn`), for a table with silver.
    pub silver_applied_lsn: Option<String>,
    /// Silver's verdict.
    pub silver_verdict: Option<String>,
    /// Chunks done and planned of the table's chunked snapshot, when one was read.
    pub snapshot_chunks: Option<(u64, Option<u64>)>,
    /// Whether that snapshot is complete.
    pub snapshot_done: bool,
    /// The last reconcile.
    pub reconcile: Option<ReconcileSeen>,
    /// Newest last.
    pub batches: VecDeque<BatchSeen>,
    /// One entry per minute with a batch, oldest first, at most [`HISTORY_MINUTES`] old.
    pub history: VecDeque<Minute>,
}

impl TableBoard {
    fn new(table: &str, now: DateTime<Utc>) -> Self {
        TableBoard {
            table: table.to_string(),
            state_since: iso(now),
            ..TableBoard::default()
        }
    }

    fn record_batch(&mut self, batch: BatchSeen, now: DateTime<Utc>) {
        let minute = now.timestamp().div_euclid(60);
        if self.history.back().is_none_or(|last| last.minute != minute) {
            self.history.push_back(Minute {
                minute,
                ..Minute::default()
            });
        }
        let current = self.history.back_mut().expect("pushed above");
        current.rows += batch.rows;
        current.batches += 1;
        if let Some(behind) = batch.behind_seconds {
            current.behind_seconds = Some(current.behind_seconds.map_or(behind, |b| b.max(behind)));
        }
        let oldest = minute - HISTORY_MINUTES as i64;
        while self
            .history
            .front()
            .is_some_and(|first| first.minute <= oldest)
        {
            self.history.pop_front();
        }
        self.last_batch_id = Some(batch.batch_id);
        self.end_lsn = Some(batch.end_lsn.clone());
        self.behind_seconds = batch.behind_seconds;
        if self.batches.len() == RECENT_BATCHES {
            self.batches.pop_front();
        }
        self.batches.push_back(batch);
    }
}

/// Why the process is not ready: the tables that are not streaming, with their state.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Readiness {
    /// Every table streams (or finished its available-now run).
    pub ready: bool,
    /// The tables that do not, with their state's name.
    pub waiting: Vec<(String, &'static str)>,
}

/// The board of every table of this process.
pub struct Board {
    enabled: AtomicBool,
    tables: Mutex<BTreeMap<String, TableBoard>>,
}

static BOARD: LazyLock<Board> = LazyLock::new(Board::new);

/// The process's board.
pub fn board() -> &'static Board {
    &BOARD
}

/// A time as the board shows it: ISO 8601 in UTC, to the second.
pub fn iso(time: DateTime<Utc>) -> String {
    time.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

impl Default for Board {
    fn default() -> Self {
        Board::new()
    }
}

impl Board {
    /// A board that records nothing until [`Board::enable`].
    pub fn new() -> Self {
        Board {
            enabled: AtomicBool::new(false),
            tables: Mutex::new(BTreeMap::new()),
        }
    }

    /// Starts recording, with `tables` listed as starting (a table is listed once).
    pub fn enable<'a>(&self, tables: impl IntoIterator<Item = &'a str>) {
        self.enabled.store(true, Ordering::Release);
        for table in tables {
            self.update(table, |_, _| {});
        }
    }

    /// Applies `change` to `table`'s entry (made when missing) at the current time; nothing
    /// while the board is not enabled.
    fn update(&self, table: &str, change: impl FnOnce(&mut TableBoard, DateTime<Utc>)) {
        if !self.enabled.load(Ordering::Acquire) {
            return;
        }
        let now = Utc::now();
        let mut tables = self
            .tables
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let entry = tables
            .entry(table.to_string())
            .or_insert_with(|| TableBoard::new(table, now));
        change(entry, now);
    }

    /// Records a committed batch (idle polls included: they move the lag).
    pub fn batch(
        &self,
        table: &str,
        batch_id: i64,
        rows: u64,
        seconds: f64,
        end_lsn: String,
        behind_seconds: Option<f64>,
    ) {
        self.update(table, |entry, now| {
            entry.record_batch(
                BatchSeen {
                    batch_id,
                    rows,
                    seconds,
                    end_lsn,
                    behind_seconds,
                    at: iso(now),
                },
                now,
            );
        });
    }

    /// Moves `table` to `state` (the time is kept only when the state's kind changes).
    pub fn state(&self, table: &str, state: TableState) {
        self.update(table, |entry, now| {
            if entry.state.name() != state.name() {
                entry.state_since = iso(now);
            }
            entry.state = state;
        });
    }

    /// Records a failed attempt of `table` with its error.
    pub fn failure(&self, table: &str, error: &str) {
        self.update(table, |entry, now| {
            entry.failures += 1;
            let mut message: String = error.chars().take(MAX_ERROR_CHARS).collect();
            if message.len() < error.len() {
                message.push('…');
            }
            entry.last_error = Some(ErrorSeen {
                at: iso(now),
                message,
            });
        });
    }

    /// Records a layer's verdict (`bronze` or `silver`).
    pub fn verdict(&self, table: &str, layer: &str, until: Option<mssql_cdc_proto::CommitTime>) {
        let until = until.map(|time| time.to_iso_millis());
        self.update(table, |entry, _| match layer {
            "silver" => entry.silver_verdict = until.or(entry.silver_verdict.take()),
            "bronze" => entry.bronze_verdict = until.or(entry.bronze_verdict.take()),
            // History's verdict is in its metric and control row, not on the board.
            _ => {}
        });
    }

    /// Records silver's position after an `apply_changes`.
    pub fn silver_applied(&self, table: &str, applied_lsn: Option<String>) {
        self.update(table, |entry, _| {
            if applied_lsn.is_some() {
                entry.silver_applied_lsn = applied_lsn;
            }
        });
    }

    /// Records the progress of the table's chunked snapshot.
    pub fn snapshot(&self, table: &str, done: u64, total: Option<u64>) {
        self.update(table, |entry, _| {
            let total = total.or(entry.snapshot_chunks.and_then(|(_, total)| total));
            entry.snapshot_done = total.is_some_and(|total| done >= total);
            entry.snapshot_chunks = Some((done, total));
        });
    }

    /// Records a reconcile of the table's silver.
    pub fn reconcile(&self, table: &str, result: &crate::reconcile::ReconcileResult) {
        self.update(table, |entry, now| {
            entry.reconcile = Some(ReconcileSeen {
                run_id: result.run_id.clone(),
                at: iso(now),
                buckets: result.buckets,
                mismatch: result.mismatch,
                verified_lsn: result.verified.then(|| result.compared_lsn.to_string()),
                values_verified: result.values_verified,
            });
        });
    }

    /// Fills the positions the lake holds (checkpoint, verdict, snapshot, verified LSN) in,
    /// for tables the process has not written yet.
    pub fn seed(&self, statuses: &[crate::sidecar::TableStatus]) {
        for status in statuses {
            self.update(&status.table, |entry, _| {
                if entry.last_batch_id.is_none() {
                    entry.last_batch_id = status.last_batch.map(|(id, _)| id);
                    entry.end_lsn = status.end.map(|end| end.lsn.to_string());
                }
                if entry.bronze_verdict.is_none() {
                    entry.bronze_verdict = status.verdict.map(|time| time.to_iso_millis());
                }
                if entry.snapshot_chunks.is_none()
                    && let Some(progress) = &status.snapshot
                {
                    entry.snapshot_chunks = Some((progress.chunks_done, progress.chunks_total));
                    entry.snapshot_done = progress.done;
                }
                if entry.reconcile.is_none()
                    && let Some((lsn, at)) = &status.verified
                {
                    entry.reconcile = Some(ReconcileSeen {
                        run_id: String::new(),
                        at: at.to_iso_millis(),
                        buckets: 0,
                        mismatch: 0,
                        verified_lsn: Some(lsn.clone()),
                        values_verified: status
                            .values_verified
                            .as_ref()
                            .is_some_and(|(values_lsn, _)| values_lsn == lsn),
                    });
                }
            });
        }
    }

    /// A copy of every table's entry, by table name.
    pub fn tables(&self) -> Vec<TableBoard> {
        let tables = self
            .tables
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        tables.values().cloned().collect()
    }

    /// Whether every table streams (false while the board is not enabled: nothing runs).
    pub fn readiness(&self) -> Readiness {
        let tables = self
            .tables
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let waiting: Vec<(String, &'static str)> = tables
            .values()
            .filter(|entry| !entry.state.is_ready())
            .map(|entry| (entry.table.clone(), entry.state.name()))
            .collect();
        Readiness {
            ready: self.enabled.load(Ordering::Acquire) && waiting.is_empty(),
            waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(seconds, 0).expect("time")
    }

    fn batch(id: i64, rows: u64, behind: Option<f64>) -> BatchSeen {
        BatchSeen {
            batch_id: id,
            rows,
            seconds: 0.1,
            end_lsn: format!("lsn{id}"),
            behind_seconds: behind,
            at: String::new(),
        }
    }

    #[test]
    fn batches_sum_into_minutes_and_the_history_keeps_six_hours() {
        let mut entry = TableBoard::new("dbo.orders", at(0));
        entry.record_batch(batch(1, 10, Some(2.0)), at(60));
        entry.record_batch(batch(2, 5, Some(7.0)), at(119));
        entry.record_batch(batch(3, 0, Some(1.0)), at(120));
        assert_eq!(entry.history.len(), 2);
        assert_eq!(
            entry.history[0],
            Minute {
                minute: 1,
                rows: 15,
                batches: 2,
                behind_seconds: Some(7.0)
            }
        );
        assert_eq!(entry.history[1].rows, 0);
        assert_eq!(entry.history[1].behind_seconds, Some(1.0));
        assert_eq!(entry.last_batch_id, Some(3));
        assert_eq!(entry.end_lsn.as_deref(), Some("lsn3"));
        // Six hours later the first two minutes are gone, the newest is kept.
        entry.record_batch(batch(4, 1, None), at(121 + 60 * HISTORY_MINUTES as i64));
        assert_eq!(entry.history.len(), 1);
        assert_eq!(entry.history[0].minute, 2 + HISTORY_MINUTES as i64);
        assert_eq!(entry.behind_seconds, None);
    }

    #[test]
    fn only_the_last_batches_are_kept() {
        let mut entry = TableBoard::new("dbo.orders", at(0));
        for id in 0..(RECENT_BATCHES as i64 + 5) {
            entry.record_batch(batch(id, 1, None), at(id));
        }
        assert_eq!(entry.batches.len(), RECENT_BATCHES);
        assert_eq!(entry.batches.front().map(|b| b.batch_id), Some(5));
        assert_eq!(entry.history.len(), 1);
        assert_eq!(entry.history[0].rows, RECENT_BATCHES as u64 + 5);
    }

    #[test]
    fn readiness_follows_every_table_and_a_disabled_board_records_nothing() {
        let board = Board::new();
        board.state("dbo.orders", TableState::Running);
        assert!(board.tables().is_empty(), "recorded before enable");
        assert!(!board.readiness().ready);
        board.enable(["dbo.orders", "dbo.customers"]);
        let readiness = board.readiness();
        assert!(!readiness.ready);
        assert_eq!(readiness.waiting.len(), 2);
        board.state("dbo.orders", TableState::Running);
        board.state("dbo.customers", TableState::Running);
        assert!(board.readiness().ready);
        board.failure("dbo.customers", "the server went away");
        board.state(
            "dbo.customers",
            TableState::Retrying {
                attempt: 1,
                retry_at: "later".into(),
            },
        );
        assert_eq!(
            board.readiness().waiting,
            vec![("dbo.customers".to_string(), "retrying")]
        );
        let customers = board.tables().remove(0);
        assert_eq!(customers.failures, 1);
        assert_eq!(
            customers.last_error.map(|error| error.message),
            Some("the server went away".to_string())
        );
        board.state("dbo.customers", TableState::Running);
        assert!(board.readiness().ready);
    }

    #[test]
    fn a_long_error_is_cut_and_snapshot_totals_are_kept() {
        let board = Board::new();
        board.enable(["t"]);
        board.failure("t", &"x".repeat(MAX_ERROR_CHARS + 10));
        board.snapshot("t", 1, Some(4));
        board.snapshot("t", 4, None);
        let entry = board.tables().remove(0);
        let message = entry.last_error.expect("error").message;
        assert_eq!(message.chars().count(), MAX_ERROR_CHARS + 1);
        assert!(message.ends_with('…'));
        assert_eq!(entry.snapshot_chunks, Some((4, Some(4))));
        assert!(entry.snapshot_done);
    }
}
