//! The stream loop for one table: a micro-batch, step by step.
//!
//! 1. Find the batch: replay the checkpoint's batch when it is not committed (same range,
//!    same batch id), else ask the server for the next end offset after the last one.
//! 2. Record the planned range in the checkpoint **before** reading, so a replay after a crash
//!    reads exactly the same range.
//! 3. Plan `(start, end]` over Flight and read every endpoint in parallel; a stream without its
//!    completion marker is refused by the client, so nothing incomplete is committed.
//! 4. Append the rows to bronze in **one** Delta commit with the application transaction
//!    `(app_id, batch_id)` and the facts JSON as userMetadata. delta-rs commits a repeated
//!    transaction version again, so the writer checks `transaction_version` first.
//! 5. Write the facts row and the batch's event rows in one commit, `(<app_id>#facts, batch_id)`.
//! 6. Move the verdict in the control table, after the data.
//! 7. Mark the batch committed in the checkpoint.
//!
//! A replayed batch that bronze (or, without rows, the facts table) already holds is finished
//! from what its commit recorded, never read again: the commit's userMetadata carries the
//! whole facts row and event rows. A batch bronze holds that this writer never wrote means a
//! second writer with the same app id, and stops the stream.
//!
//! A batch with no rows (idle CDC entries) writes no bronze commit but still its facts row and
//! the verdict move. A continuous stream writes such a batch only when it moves the verdict
//! (its end's commit time is in a later granularity period than the last batch's end) or
//! carries an event: a quiet table writes one batch per period, not one per poll. A
//! checkpoint deleted or rewound under the same app_id is refused against the facts and
//! bronze tables' transaction versions.

use std::sync::Arc;
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::{ChangesCommand, LatestOffsetBody, LsnAnswer};
use mssql_cdc_proto::selection::ColumnSelection;
use mssql_cdc_proto::{CommitTime, Lsn, Offset};
use serde_json::json;
use url::Url;

use crate::bronze;
use crate::checkpoint::{BatchRecord, Checkpoint};
use crate::columns;
use crate::control::{self, Granularity};
use crate::data_loss::{self, OnDataLoss};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::{self, FactsRow, Totals};
use crate::ledger::Ledger;
use crate::schema_policy::SchemaChangePolicy;
use crate::shared_table::SharedTable;
use crate::slots::{TableSlots, slot};
use crate::tables::{self, TableKind};
use crate::tail::{Tail, Waiting};

/// How one table is streamed.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Flight server URL (`http://host:port`).
    pub server: String,
    /// Source table, `schema.table`.
    pub table: String,
    /// Bronze table location (path or URL).
    pub target: String,
    /// Facts table location.
    pub facts: String,
    /// Control table location (the verdict); `None` writes no verdict.
    pub control: Option<String>,
    /// Writer identity: the Delta txn app id of bronze commits (`<app_id>#facts` for facts).
    pub app_id: String,
    /// Checkpoint location (one per app id): a directory or an object-store URL.
    pub checkpoint: String,
    /// Where a new checkpoint starts: `earliest`, `latest` or an LSN already processed.
    pub starting: String,
    /// Most commits per batch (the seed's `maxCommitsPerBatch`); `None` reads up to max_lsn.
    pub max_commits: Option<u64>,
    /// Endpoints read in parallel per capture instance.
    pub partitions: u32,
    /// Truncation of the verdict.
    pub granularity: Granularity,
    /// Stop on purged changes (true), or skip to `min_lsn` with a `data_skipped` event.
    pub fail_on_data_loss: bool,
    /// Follow schema changes (`evolve`) or stop at them (`fail`).
    pub schema_change_policy: SchemaChangePolicy,
    /// Stop at purged changes (`fail`) or heal them by a re-snapshot (`resnapshot`).
    pub on_data_loss: OnDataLoss,
    /// Open a chunked re-snapshot when a newer capture instance becomes active (the seed's
    /// `snapshot_on_switch`), so the columns only it captures are filled for every row.
    pub snapshot_on_switch: bool,
    /// Open a chunked re-snapshot once the newest snapshot is this many days old; `None`:
    /// never on a schedule. (The seed has no schedule; its `resnapshot_interval_days` is the
    /// guard below.)
    pub resnapshot_every_days: Option<f64>,
    /// The seed's anti-loop guard on `on_data_loss = resnapshot`: a purge met less than this
    /// many days after the last one healed (its healing `snapshot_open` row) stops the table instead of
    /// re-snapshotting again, since a stream that keeps falling behind the retention would
    /// otherwise re-snapshot for ever. `None`: the seed's 7 days; `0`: no guard.
    pub resnapshot_interval_days: Option<f64>,
    /// The columns a chunked snapshot is cut on (the seed's `snapshotKeys`), unique or not;
    /// `None`: the unique index CDC uses. A table without one needs them.
    pub snapshot_keys: Option<Vec<String>>,
    /// The captured columns the stream and its snapshots ask the server for (`columns` or
    /// `except_columns`): a column left out never crosses the network, so never reaches
    /// bronze, silver or reconcile. Key columns cannot be left out. `None`: the selection
    /// bronze records ([`crate::columns`]; every column for a new bronze); a stream given one
    /// records it on bronze, a snapshot given another than bronze's is refused.
    pub columns: Option<ColumnSelection>,
}

impl StreamConfig {
    /// The column selection the table's readers read with ([`columns::resolve`]), this
    /// config's `snapshot_keys` being key columns it needs.
    pub async fn resolve_columns(
        &self,
        client: &CdcClient,
        role: columns::Role,
    ) -> Result<columns::Resolved> {
        let keys = self
            .snapshot_keys
            .as_deref()
            .map(|keys| ("snapshot_keys", keys));
        columns::resolve(
            client,
            (&self.table, &self.target),
            self.columns.as_ref(),
            keys,
            role,
        )
        .await
    }
}

/// What one batch did.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchOutcome {
    /// The batch id.
    pub batch_id: i64,
    /// Rows written to bronze.
    pub rows: u64,
    /// Offset before the batch.
    pub start: Offset,
    /// Offset after it.
    pub end: Offset,
    /// The verdict after the batch.
    pub verdict: Option<CommitTime>,
    /// Whether the batch was a replay of one a crash left uncommitted.
    pub replayed: bool,
    /// Whether the batch's plan was made while the batch before it streamed (a backlog
    /// whose next range had not grown by the time this batch started).
    pub planned_ahead: bool,
}

/// A running stream of one table.
pub struct Stream {
    config: StreamConfig,
    /// The column selection every plan asks for, as bronze records it.
    columns: ColumnSelection,
    client: CdcClient,
    /// Connections a batch's endpoints after the first are read over, opened when a batch
    /// first has that many and kept: HTTP/2 frames all streams of one connection in one task
    /// at each end, so endpoints sharing a connection share one core for their framing
    /// (docs/writer.md, "Benchmark").
    readers: Vec<CdcClient>,
    target: Url,
    /// The facts table, shared with the other readers of this process.
    facts: Arc<SharedTable>,
    control: Option<Url>,
    checkpoint: Checkpoint,
    verified: bool,
    tail: Tail,
    /// When the re-snapshot schedule was last looked at (at most once a minute).
    schedule_checked: Option<Instant>,
    /// Whether a range with nothing to write is left for later (continuous runs) instead of
    /// written as an empty batch (available-now runs record reaching their target).
    skip_quiet: bool,
    /// A plan made before its batch started, reused by the batch of its range: by a quiet
    /// check, or ahead while the batch before streamed.
    planned: Option<Planned>,
    /// The group committer of facts rows and verdicts shared with other tables' streams.
    ledger: Option<Arc<Ledger>>,
    /// The last batch's end and the end of the quiet ranges passed over after it
    /// ([`Stream::next_range`]).
    quiet_past: Option<(Offset, Offset)>,
    /// The sidecar's turns at lake work, a slot taken per continuous batch.
    slots: Option<TableSlots>,
    /// Bronze as the last batch loaded it.
    bronze: Option<deltalake::DeltaTable>,
    /// The table's verdict as control last answered it. Verdicts only move forward and only
    /// this stream moves its table's, so a batch ending in a period at or before it would
    /// move nothing: it skips the MERGE (one per batch otherwise, the sidecar's busiest
    /// control work while verdicts are hourly).
    verdict: Option<CommitTime>,
}

/// Endpoints a batch is planned in per reader (`partitions` > 1; the server keeps 50,000
/// rows or more in each): two readers given a half each ended 60-120 ms apart in a 700 ms
/// read of 1M rows here (whatever the machine gave one more than the other), a core idle
/// meanwhile; readers taking the next of 4 endpoints each as they finish one end closer
/// together (docs/writer.md, "Benchmark").
const ENDPOINTS_PER_READER: u32 = 4;

/// The most quiet ranges one call of [`Stream::next_range`] passes over before it lets the
/// table wait (and the sidecar's other tables take its slot).
const QUIET_RANGES_PER_CALL: usize = 1000;

/// Environment variable naming a step boundary where the process aborts, for crash tests:
/// `after_plan`, `after_bronze`, `after_facts` or `after_control` of a stream batch, or
/// `after_wave_bronze` of a snapshot wave, `after_snapshot_open` of a full snapshot or
/// `after_seed_open` of a seed,
/// optionally `:<batch_id or wave>`.
pub const CRASH_AT_VARIABLE: &str = "MSSQL_CDC_WRITER_CRASH_AT";

/// Aborts the process (as a SIGKILL would end it) when [`CRASH_AT_VARIABLE`] names this step.
pub(crate) fn crash_point(step: &str, batch_id: i64) {
    let Ok(wanted) = std::env::var(CRASH_AT_VARIABLE) else {
        return;
    };
    let (wanted_step, wanted_batch) = match wanted.split_once(':') {
        Some((step, batch)) => (step.to_string(), batch.parse::<i64>().ok()),
        None => (wanted, None),
    };
    if wanted_step == step && wanted_batch.is_none_or(|batch| batch == batch_id) {
        eprintln!("{CRASH_AT_VARIABLE}: aborting {step} of batch {batch_id}");
        std::process::abort();
    }
}

fn micros_now() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// The variable naming the PEM file of the CA that signed the Flight server's certificate,
/// read when the server URL is `https://` (the server binary's client commands read it too).
pub const FLIGHT_CA_VARIABLE: &str = mssql_cdc_proto::client::TLS_CA_VARIABLE;

/// Connects to the Flight server at `server` as [`CdcClient::connect_from_env`] does:
/// plaintext for `http://`, TLS verified against the CA in [`FLIGHT_CA_VARIABLE`] for
/// `https://` (refused without it), the bearer token of `MSSQL_CDC_FLIGHT_TOKEN` and the
/// client certificate of `MSSQL_CDC_FLIGHT_TLS_CLIENT_CERT`/`_KEY` when set.
/// Connection refused or cut while the server restarts is tried again as
/// [`crate::retry`] says.
pub async fn connect_server(server: &str) -> Result<CdcClient> {
    use backon::Retryable;
    (|| async { Ok(CdcClient::connect_from_env(server).await?) })
        .retry(mssql_cdc_proto::client::transient_retries())
        .when(WriterError::is_transient)
        .notify(|error: &WriterError, wait| crate::retry::log("connecting", server, error, wait))
        .await
}

impl Stream {
    /// Connects to the server and opens the checkpoint.
    pub async fn connect(config: StreamConfig) -> Result<Self> {
        if let Some(days) = config.resnapshot_every_days
            && !(days > 0.0 && days.is_finite())
        {
            return Err(WriterError::invalid(format!(
                "{}: resnapshot_every_days must be a positive number of days, not {days}",
                config.table
            )));
        }
        if config.resnapshot_interval_days.is_some()
            && config.on_data_loss != OnDataLoss::Resnapshot
        {
            return Err(WriterError::invalid(format!(
                "{}: resnapshot_interval_days is the anti-loop guard of on_data_loss = resnapshot \
                 (the seed's meaning); a re-snapshot on a schedule is resnapshot_every_days (this \
                 name meant it before)",
                config.table
            )));
        }
        if let Some(days) = config.resnapshot_interval_days
            && !(days >= 0.0 && days.is_finite())
        {
            return Err(WriterError::invalid(format!(
                "{}: resnapshot_interval_days must be a number of days, 0 or more, not {days}",
                config.table
            )));
        }
        if config.on_data_loss == OnDataLoss::Resnapshot && !config.fail_on_data_loss {
            return Err(WriterError::invalid(format!(
                "{}: on_data_loss = resnapshot heals purged changes, fail_on_data_loss = false \
                 (--skip-data-loss) skips them: choose one",
                config.table
            )));
        }
        if config.app_id.is_empty() || config.app_id.contains('#') {
            return Err(WriterError::invalid(
                "app_id must be non-empty and without '#'",
            ));
        }
        let client = connect_server(&config.server).await?;
        let mut config = config;
        let resolved = config
            .resolve_columns(&client, columns::Role::Stream)
            .await?;
        let selection = resolved.selection.clone();
        config.columns = Some(selection.clone());
        // Before a change is recorded (a crash between the two finds the change still to
        // make), and while bronze is still to be made by this stream: an open chunked
        // snapshot read with other columns is abandoned.
        if resolved.replaces.is_some() || resolved.bronze.is_none() {
            crate::snapshot::Snapshots::resolved(
                config.clone(),
                client.clone(),
                selection.clone(),
            )?
            .abandon_under_other_columns()
            .await?;
        }
        // The selection when it changed, and the masks the server serves now.
        columns::record(&config.table, &config.target, resolved).await?;
        Ok(Stream {
            columns: selection,
            target: tables::table_url(&config.target)?,
            facts: SharedTable::of(&tables::table_url(&config.facts)?),
            control: config
                .control
                .as_deref()
                .map(tables::table_url)
                .transpose()?,
            checkpoint: Checkpoint::open(&config.checkpoint).await?,
            client,
            readers: Vec::new(),
            verified: false,
            tail: Tail::default(),
            schedule_checked: None,
            skip_quiet: false,
            planned: None,
            quiet_past: None,
            ledger: None,
            slots: None,
            bronze: None,
            verdict: None,
            config,
        })
    }

    /// The column selection every plan asks for, as bronze records it.
    pub fn columns(&self) -> &ColumnSelection {
        &self.columns
    }

    /// This stream's snapshots: over its connection, with the columns it resolved.
    fn snapshots(&self) -> Result<crate::snapshot::Snapshots> {
        crate::snapshot::Snapshots::resolved(
            self.config.clone(),
            self.client.clone(),
            self.columns.clone(),
        )
    }

    /// Waits for `wake` (the sidecar's [`crate::tail::SharedTail`]) when nothing is new,
    /// instead of its own tail or poll.
    pub fn wake_on(&mut self, wake: Arc<tokio::sync::Notify>) {
        self.tail = Tail::shared(wake);
    }

    /// Commits facts rows and verdict moves through `ledger`, together with the other
    /// streams that share it (the sidecar's tables), instead of one commit each.
    pub fn share_ledger(&mut self, ledger: Arc<Ledger>) {
        self.ledger = Some(ledger);
    }

    /// Takes a slot of `slots` for each continuous batch, so the sidecar's tables take
    /// turns at lake work ([`crate::slots`]).
    pub fn share_slots(&mut self, slots: TableSlots) {
        self.slots = Some(slots);
    }

    fn facts_app_id(&self) -> String {
        format!("{}#facts", self.config.app_id)
    }

    /// Refuses a checkpoint that is behind what the lake already holds for this app id, and
    /// one ahead of it (the lake restored from an older backup, or its facts table lost):
    /// going on would leave a gap of the batches the lake no longer holds.
    async fn verify_checkpoint(&self, last: Option<&BatchRecord>) -> Result<()> {
        let facts_batch = match self.facts.latest().await? {
            Some(facts) => tables::transaction(&facts, &self.facts_app_id()).await?,
            None => None,
        };
        let bronze_batch = match tables::open(&self.target).await? {
            Some(bronze) => tables::transaction(&bronze, &self.config.app_id).await?,
            None => None,
        };
        let lake_batch = facts_batch.max(bronze_batch);
        // Every committed batch wrote its facts row (`<app_id>#facts`, batch id) first.
        let committed = last
            .filter(|batch| batch.app_id == self.config.app_id)
            .map(|batch| batch.batch_id - i64::from(!batch.committed))
            .filter(|id| *id >= 0);
        if let Some(committed) = committed
            && facts_batch.is_none_or(|held| held < committed)
        {
            return Err(WriterError::CheckpointMismatch(format!(
                "the checkpoint {} has committed batch {committed} of app_id '{}' but the facts \
                 table {} holds {}: the lake was restored behind the checkpoint or lost its \
                 facts. Restore the lake to the checkpoint, or start a new checkpoint with a \
                 new app_id (a re-snapshot fills the gap)",
                self.config.checkpoint,
                self.config.app_id,
                self.config.facts,
                facts_batch.map_or("no batch".to_string(), |held| format!("batch {held}")),
            )));
        }
        let Some(lake_batch) = lake_batch else {
            return Ok(());
        };
        let behind = match last {
            None => true,
            Some(batch) => batch.app_id != self.config.app_id || batch.batch_id < lake_batch,
        };
        if behind {
            return Err(WriterError::CheckpointMismatch(format!(
                "the lake holds batch {lake_batch} of app_id '{}' but the checkpoint {} is at {}: it was \
                 deleted or rewound. Restore the checkpoint, or start a new checkpoint with a new app_id",
                self.config.app_id,
                self.config.checkpoint,
                last.map_or("no batch".to_string(), |batch| format!(
                    "batch {}",
                    batch.batch_id
                )),
            )));
        }
        Ok(())
    }

    async fn latest(&self, start: Offset, upper: Option<Lsn>) -> Result<Offset> {
        Ok(self
            .client
            .action(
                "latest_offset",
                &LatestOffsetBody {
                    start: Some(start),
                    max_commits: self.config.max_commits,
                    upper,
                },
            )
            .await?)
    }

    /// Runs one batch; `None` when nothing new was committed (up to `upper` if given).
    pub async fn run_batch(&mut self, upper: Option<Lsn>) -> Result<Option<BatchOutcome>> {
        self.scheduled_resnapshot().await?;
        let last = self.checkpoint.last().await?;
        if !self.verified {
            self.verify_checkpoint(last.as_ref()).await?;
            self.verified = true;
        }
        let (batch_id, start, end, replayed, (events, amendment)) = match last {
            Some(batch) if !batch.committed => {
                let amended = (batch.events, batch.amendment);
                (batch.batch_id, batch.start, batch.end, true, amended)
            }
            Some(batch) => match self.next_range(batch.end, upper).await? {
                Some(end) => (batch.batch_id + 1, batch.end, end, false, (Vec::new(), 0)),
                None => return Ok(None),
            },
            None => {
                // Where `starting` says, resolved first: a snapshot opened after this has an
                // S at or past it, so nothing between them is skipped.
                let fallback = self
                    .client
                    .initial_offset(&self.config.table, &self.config.starting)
                    .await?;
                // Nothing new: no batch, and no read of the facts on every idle poll.
                let fallback_end = self.latest(fallback, upper).await?;
                if fallback_end.lsn <= fallback.lsn {
                    self.tail.caught_up(fallback.lsn);
                    return Ok(None);
                }
                let (start, end) = match crate::snapshot::recorded_start(&self.config).await? {
                    Some(snapshot) if snapshot.to_string() != self.config.starting => {
                        if self.config.starting != "earliest" {
                            tracing::warn!(table = %self.config.table, %snapshot,
                                starting = %self.config.starting,
                                "a new checkpoint starts after the snapshot the facts record, \
                                 not where `starting` says");
                        }
                        let start = self
                            .client
                            .initial_offset(&self.config.table, &snapshot.to_string())
                            .await?;
                        (start, self.latest(start, upper).await?)
                    }
                    _ => (fallback, fallback_end),
                };
                if end.lsn <= start.lsn {
                    self.tail.caught_up(start.lsn);
                    return Ok(None);
                }
                (0, start, end, false, (Vec::new(), 0))
            }
        };
        let mut record = BatchRecord {
            app_id: self.config.app_id.clone(),
            batch_id,
            start,
            end,
            committed: false,
            events,
            amendment,
        };
        if !replayed {
            // The fence: a batch id another writer of this app id claimed stops this one here.
            self.checkpoint.claim_batch(&record).await?;
        }
        let outcome = self.write_batch(&mut record, replayed, upper).await?;
        self.checkpoint.commit(record.batch_id).await?;
        Ok(Some(outcome))
    }

    /// [`Stream::run_batch`], run again while the server fails in passing (a restart, a cut
    /// connection, a ticket it no longer honours: [`WriterError::is_redoable`]) after the
    /// waits of [`crate::retry`].
    /// The batch is the unit of exactly-once: the batch the
    /// failure left claimed is replayed from its checkpoint record as after a crash, and a
    /// plan made ahead is dropped (its tickets may be of a server that restarted with
    /// another key).
    pub async fn run_batch_retrying(&mut self, upper: Option<Lsn>) -> Result<Option<BatchOutcome>> {
        let mut waits = crate::retry::waits();
        loop {
            match self.run_batch(upper).await {
                Err(error) if error.is_redoable() => {
                    let Some(wait) = waits.next() else {
                        return Err(error);
                    };
                    crate::retry::log("the batch", &self.config.table, &error, wait);
                    self.planned = None;
                    tokio::time::sleep(wait).await;
                }
                outcome => return outcome,
            }
        }
    }

    /// The end of the batch after the last one (which ended at `last_end`), or `None` when
    /// there is nothing to write yet. With `max_commits` a range ends after that many commits
    /// of the whole database, so a quiet table's range can end with nothing of it while more
    /// is committed past it: such a range is passed over (remembered past this call), and
    /// the next one asked from its end, so the batch written at last spans every quiet range
    /// before it. Asking the same capped range again on every poll left a quiet table beside
    /// a busy one behind for good, until cleanup passed it.
    async fn next_range(&mut self, last_end: Offset, upper: Option<Lsn>) -> Result<Option<Offset>> {
        let mut from = match self.quiet_past {
            Some((after, reached)) if after == last_end => reached,
            _ => last_end,
        };
        for _ in 0..QUIET_RANGES_PER_CALL {
            let end = self.latest(from, upper).await?;
            if end.lsn <= from.lsn {
                if from == last_end {
                    self.tail.caught_up(from.lsn);
                } else {
                    self.tail.quiet(from.lsn);
                }
                return Ok(None);
            }
            if !self.skip_quiet || !self.nothing_to_write(last_end, from, end).await? {
                return Ok(Some(end));
            }
            self.quiet_past = Some((last_end, end));
            from = end;
        }
        self.tail.quiet(from.lsn);
        Ok(None)
    }

    /// Reads to the `max_lsn` recorded at the start, batch after batch, then returns.
    pub async fn run_available_now(&mut self) -> Result<Vec<BatchOutcome>> {
        let target: LsnAnswer = self.client.action("max_lsn", &json!({})).await?;
        let mut outcomes = Vec::new();
        // A batch left uncommitted by a crash is replayed first, whatever its end.
        while let Some(outcome) = self.run_batch_retrying(target.lsn).await? {
            tracing::info!(table = %self.config.table, batch = outcome.batch_id, rows = outcome.rows,
                end = %outcome.end.lsn, "batch committed");
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    /// Runs batches until `stop` resolves, waiting as `waiting` says when nothing is new (on
    /// the server's live tail, at most the poll interval; see [`crate::tail`]). A range with
    /// no rows and no event is written only once it moves the verdict.
    pub async fn run_continuous(
        &mut self,
        waiting: Waiting,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<u64> {
        self.skip_quiet = true;
        let mut batches = 0;
        while !*stop.borrow() {
            let slot = match &self.slots {
                Some(slots) => Some(slot(slots).await),
                None => None,
            };
            // Stopped while waiting its turn (a signal, or the table moved to another
            // replica of a fleet): no batch begun after it.
            if *stop.borrow() {
                break;
            }
            let batch = self.run_batch_retrying(None).await?;
            drop(slot);
            match batch {
                Some(outcome) => {
                    batches += 1;
                    self.tail.batch(outcome.rows);
                    tracing::info!(table = %self.config.table, batch = outcome.batch_id, rows = outcome.rows,
                        end = %outcome.end.lsn, "batch committed");
                }
                None => {
                    let mut stop = stop.clone();
                    tokio::select! {
                        _ = self.tail.wait(&self.client, waiting) => {}
                        _ = stop.changed() => {}
                    }
                }
            }
        }
        Ok(batches)
    }

    async fn write_batch(
        &mut self,
        record: &mut BatchRecord,
        replayed: bool,
        upper: Option<Lsn>,
    ) -> Result<BatchOutcome> {
        if replayed && let Some(outcome) = self.finish_written(record).await? {
            return Ok(outcome);
        }
        let started_at = micros_now();
        let clock = Instant::now();
        let mut laps = Laps::start();
        let ping = Instant::now();
        let source_max: LsnAnswer = self.client.action("max_lsn", &json!({})).await?;
        let rtt_ms = ping.elapsed().as_secs_f64() * 1000.0;
        // The events of a batch amended past purged changes, recorded with the amendment.
        let mut events: Vec<FactsRow> = record.events.clone();
        let mut planned_ahead = false;
        let planned = match self.planned.take() {
            Some(planned) if planned.start == record.start && planned.end == record.end => {
                planned_ahead = planned.ahead;
                Ok(planned.plan)
            }
            _ => self.plan(record.start, record.end).await,
        };
        let plan = match planned {
            Ok(plan) => plan,
            Err(WriterError::DataLoss { message, .. })
                if self.config.on_data_loss == OnDataLoss::Resnapshot =>
            {
                let (resume, event) =
                    data_loss::resnapshot(&self.snapshots()?, &self.client, record.start, &message)
                        .await?;
                events.push(event);
                self.resume_at(record, resume, &events).await?;
                self.plan(record.start, record.end).await?
            }
            Err(WriterError::DataLoss { message, .. }) if !self.config.fail_on_data_loss => {
                let skipped_from = record.start;
                let resume = self.min_lsn().await?;
                tracing::warn!(table = %self.config.table, from = %skipped_from.lsn, to = %resume.lsn,
                    "changes purged before they were read were skipped (fail_on_data_loss = false)");
                events.push(FactsRow {
                    event: Some(events::DATA_SKIPPED.into()),
                    min_lsn: Some(resume.lsn.to_string()),
                    max_lsn: Some(resume.lsn.to_string()),
                    end_lsn: Some(resume.lsn.to_string()),
                    lost_from_ts: skipped_from.commit_ts.map(CommitTime::micros),
                    lost_to_ts: resume.commit_ts.map(CommitTime::micros),
                    detail: Some(json!({"from": skipped_from.lsn, "to": resume.lsn, "certain": true, "reason": message}).to_string()),
                    ..FactsRow::default()
                });
                events.extend(self.abandon_broken_snapshot(resume.lsn).await?);
                self.resume_at(record, resume, &events).await?;
                self.plan(record.start, record.end).await?
            }
            Err(error) => return Err(error),
        };
        laps.lap("plan");
        crash_point("after_plan", record.batch_id);
        if self.config.schema_change_policy == SchemaChangePolicy::Fail {
            let bronze = tables::open(&self.target).await?;
            let bronze_schema = bronze.as_ref().map(|table| table.snapshot()).transpose()?;
            self.config.schema_change_policy.check(
                &self.config.table,
                &plan.events,
                &plan.schema,
                bronze_schema
                    .as_ref()
                    .map(|snapshot| snapshot.schema())
                    .as_deref(),
            )?;
        }
        if self.config.snapshot_on_switch
            && let Some(switch) = plan
                .events
                .iter()
                .find(|event| event.event == mssql_cdc_proto::protocol::CAPTURE_INSTANCE_SWITCHED)
        {
            // Before the batch's commits: a replay after a crash finds this snapshot open.
            let snapshot = self.snapshots()?.open_on_switch(record.batch_id).await?;
            tracing::info!(table = %self.config.table, %snapshot, switch = %switch.detail,
                "a newer capture instance is active: re-snapshot opened (snapshot_on_switch)");
        }
        let appender = self.prepare_bronze(&plan, record.batch_id).await?;
        if let Some(added) = appender
            .as_ref()
            .map(|appender| appender.added_columns())
            .filter(|added| !added.is_empty())
        {
            events.push(FactsRow {
                event: Some(events::COLUMNS_ADDED.into()),
                rows: Some(0),
                end_lsn: Some(record.end.lsn.to_string()),
                detail: Some(json!({"columns": added, "policy": "evolve"}).to_string()),
                ..FactsRow::default()
            });
        }
        laps.lap("prepare");
        // With more committed past this batch, the next batch is planned while this one
        // streams: on SQL Server a plan is a scan of the range's LSNs, time the read hides.
        let backlog = source_max.lsn.filter(|max| {
            *max > record.end.lsn && upper.is_none_or(|upper| record.end.lsn < upper)
        });
        self.open_readers(&plan).await?;
        let (read, next) = tokio::join!(self.read(&plan, appender.clone()), async {
            match backlog {
                Some(source_max) => self.plan_after(record.end, upper, source_max).await,
                None => None,
            }
        });
        let read = read?;
        if let Some(next) = next {
            self.planned = Some(next);
        }
        laps.lap("read");
        let rows = read.totals.rows();
        if rows > 0 && appender.is_none() {
            return Err(WriterError::Internal(format!(
                "planning counted no rows in ({}, {}] but {rows} arrived",
                record.start.lsn, record.end.lsn
            )));
        }
        let completions = read.completions;
        let mut row = read.totals.to_row();
        row.app_id = Some(self.config.app_id.clone());
        row.batch_id = Some(record.batch_id);
        row.started_at = Some(started_at);
        // Rounded as the seed rounds them (Python's round: ties to even).
        row.source_rtt_ms = Some(facts::round(rtt_ms, 1));
        let read_seconds = completions.iter().map(|c| c.seconds).sum::<f64>();
        row.read_seconds = Some(facts::round(read_seconds, 3));
        let read_bytes = completions.iter().map(|c| c.bytes as f64).sum::<f64>();
        row.read_mb = Some(facts::round(read_bytes / 1e6, 6));
        row.end_lsn = Some(record.end.lsn.to_string());
        row.end_commit_ts = record.end.commit_ts.map(CommitTime::micros);
        row.target = Some(self.config.target.clone());
        if let Some(last) = completions.last() {
            row.source_max_commit_ts = last.max_commit_ts.map(CommitTime::micros);
            let watermark: mssql_cdc_proto::protocol::TimeAnswer = self
                .client
                .action("lsn_to_time", &json!({"lsn": last.min_lsn}))
                .await?;
            row.retention_watermark_ts = watermark.commit_ts.map(CommitTime::micros);
        }
        if let (Some(watermark), Some(end)) = (
            row.retention_watermark_ts,
            row.end_commit_ts.or(row.max_commit_ts),
        ) {
            row.retention_headroom_hours = Some(facts::round((end - watermark) as f64 / 3.6e9, 2));
        }
        if let Some(source_max) = row.source_max_commit_ts {
            row.capture_lag_seconds =
                Some(facts::round((micros_now() - source_max) as f64 / 1e6, 3));
            if let Some(end) = row.end_commit_ts {
                row.ingestion_lag_seconds = Some(facts::round((source_max - end) as f64 / 1e6, 3));
            }
        }
        events.extend(plan.events.iter().map(|event| FactsRow {
            event: Some(event.event.clone()),
            min_lsn: Some(event.lsn.to_string()),
            max_lsn: Some(event.lsn.to_string()),
            end_lsn: Some(event.lsn.to_string()),
            end_commit_ts: event.commit_ts.map(CommitTime::micros),
            detail: Some(event.detail.clone()),
            rows: Some(0),
            ..FactsRow::default()
        }));
        laps.lap("watermark");
        if let Some(appender) = &appender
            && rows > 0
        {
            row.duration_ms = Some(clock.elapsed().as_millis() as i64);
            appender
                .commit(
                    read.files,
                    &self.config.app_id,
                    record.batch_id,
                    self.user_metadata(record.batch_id, &row, &events),
                )
                .await?;
        }
        laps.lap("bronze_commit");
        crash_point("after_bronze", record.batch_id);
        row.duration_ms = Some(clock.elapsed().as_millis() as i64);
        crate::metrics::batch(
            &self.config.table,
            crate::metrics::BatchFigures {
                batch_id: record.batch_id,
                rows: u64::try_from(rows).unwrap_or(0),
                bytes: row
                    .read_mb
                    .map_or(0, |megabytes| (megabytes * 1e6).round() as u64),
                seconds: clock.elapsed().as_secs_f64(),
                end_lsn: record.end.lsn.to_string(),
                capture_lag: row.capture_lag_seconds,
                behind: row.ingestion_lag_seconds,
            },
        );
        self.append_facts(record.batch_id, row, events).await?;
        laps.lap("facts");
        crash_point("after_facts", record.batch_id);
        let verdict = self.advance_verdict(record).await?;
        laps.lap("control");
        tracing::debug!(table = %self.config.table, batch = record.batch_id, rows, steps = %laps,
            "batch written");
        crash_point("after_control", record.batch_id);
        Ok(BatchOutcome {
            batch_id: record.batch_id,
            rows: rows as u64,
            start: record.start,
            end: record.end,
            verdict,
            replayed,
            planned_ahead,
        })
    }

    /// Finishes a replayed batch whose data a crash left written: bronze holds it (its facts
    /// and events come from bronze's commit) or, for a batch without rows, the facts do. The
    /// source is not read again: after a cleanup it could not be, and skipping the purged
    /// range would record a new range under a batch id bronze already holds. `None` when
    /// neither holds the batch (it is planned and read as any other).
    async fn finish_written(&mut self, record: &BatchRecord) -> Result<Option<BatchOutcome>> {
        let batch_id = record.batch_id;
        let committed = match tables::open(&self.target).await? {
            Some(bronze) => bronze::committed_batch(&bronze, &self.config.app_id, batch_id).await?,
            None => None,
        };
        let rows = match committed {
            Some(committed) => {
                let planned_end = record.end.lsn.to_string();
                if committed.facts.end_lsn.as_deref() != Some(planned_end.as_str()) {
                    return Err(WriterError::CheckpointMismatch(format!(
                        "bronze {} holds batch {batch_id} of app_id '{}' ending at {}, but this \
                         writer's checkpoint {} planned it to end at {planned_end}: another \
                         writer runs with the same app_id. Stop it; each writer needs its own \
                         app_id and checkpoint",
                        self.config.target,
                        self.config.app_id,
                        committed
                            .facts
                            .end_lsn
                            .as_deref()
                            .unwrap_or("an unknown end"),
                        self.config.checkpoint,
                    )));
                }
                let rows = committed.facts.rows.unwrap_or(0);
                self.append_facts(batch_id, committed.facts, committed.events)
                    .await?;
                rows
            }
            None => match self.facts.latest().await? {
                Some(facts)
                    if tables::holds_transaction(&facts, &self.facts_app_id(), batch_id)
                        .await? =>
                {
                    0
                }
                _ => return Ok(None),
            },
        };
        tracing::info!(table = %self.config.table, batch_id, rows,
            "the replayed batch was already written: finished without reading the source");
        let verdict = self.advance_verdict(record).await?;
        Ok(Some(BatchOutcome {
            batch_id,
            rows: u64::try_from(rows).unwrap_or(0),
            start: record.start,
            end: record.end,
            verdict,
            replayed: true,
            planned_ahead: false,
        }))
    }

    /// Moves the table's verdict to the batch's end (only forward), when there is a control
    /// table.
    async fn advance_verdict(&mut self, record: &BatchRecord) -> Result<Option<CommitTime>> {
        let granularity = self.config.granularity;
        if let Some(known) = self.verdict
            && record
                .end
                .commit_ts
                .is_none_or(|commit| granularity.truncate(commit) <= known)
        {
            return Ok(Some(known));
        }
        let verdict = match (&self.control, &self.ledger) {
            (Some(_), Some(ledger)) => ledger.advance(&self.config.table, record.end).await?,
            (Some(url), None) => {
                control::advance(
                    url,
                    &self.config.table,
                    &record.end,
                    self.config.granularity,
                )
                .await?
            }
            (None, _) => None,
        };
        crate::metrics::finalized_until(&self.config.table, "bronze", verdict);
        self.verdict = verdict;
        Ok(verdict)
    }

    /// Whether `(start, end]` can wait: a batch ending at `end` after the last one (ending at
    /// `last_end`; `(last_end, start]` holds nothing to write) would not move the verdict (its
    /// end's commit time is in the granularity period of `last_end`'s) and the plan of
    /// `(start, end]` holds no row and no event. The plan is kept for the batch when there is
    /// something to write.
    async fn nothing_to_write(
        &mut self,
        last_end: Offset,
        start: Offset,
        end: Offset,
    ) -> Result<bool> {
        let granularity = self.config.granularity;
        let moves_verdict = match (last_end.commit_ts, end.commit_ts) {
            (Some(from), Some(to)) => granularity.truncate(to) > granularity.truncate(from),
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if moves_verdict {
            return Ok(false);
        }
        let plan = match self.plan(start, end).await {
            Ok(plan) => plan,
            // Purged changes are the batch's to handle, as configured.
            Err(WriterError::DataLoss { .. }) => return Ok(false),
            Err(error) => return Err(error),
        };
        if plan.rows == 0 && plan.events.is_empty() {
            return Ok(true);
        }
        self.planned = Some(Planned {
            start,
            end,
            plan,
            ahead: false,
        });
        Ok(false)
    }

    /// The plan of `(start, end]`.
    async fn plan(&self, start: Offset, end: Offset) -> Result<PlannedBatch> {
        let mut command = ChangesCommand::new(self.config.table.clone(), start.lsn, Some(end.lsn));
        command.serve = self.columns.serve();
        command.partitions = Some(match self.config.partitions {
            0 | 1 => 1,
            readers => readers
                .saturating_mul(ENDPOINTS_PER_READER)
                .min(mssql_cdc_proto::protocol::MAX_PARTITIONS),
        });
        match self.client.plan_changes(&command).await {
            Ok(plan) => Ok(PlannedBatch {
                schema: Arc::new(
                    plan.info
                        .clone()
                        .try_decode_schema()
                        .map_err(|error| WriterError::Internal(format!("plan schema: {error}")))?,
                ),
                rows: plan.metadata.rows,
                events: plan.metadata.events,
                tickets: plan
                    .info
                    .endpoint
                    .into_iter()
                    .filter_map(|endpoint| endpoint.ticket)
                    .collect(),
            }),
            Err(error) if error.code() == Some(tonic::Code::DataLoss) => {
                Err(WriterError::DataLoss {
                    table: self.config.table.clone(),
                    from: start.lsn,
                    message: error.to_string(),
                })
            }
            Err(error) => Err(error.into()),
        }
    }

    /// The offset just before the oldest capture instance's min_lsn, where a batch whose
    /// changes were purged resumes.
    async fn min_lsn(&self) -> Result<Offset> {
        Ok(self
            .client
            .initial_offset(&self.config.table, "earliest")
            .await?)
    }

    /// The `snapshot_abandoned` row of an open chunked snapshot whose S is before `resume`,
    /// where the stream skips purged changes to: its rebuild needs changes after S that are
    /// gone, so it is given up (ADR 0028) and never read or applied again. A re-snapshot
    /// (`snapshot open --resnapshot`, or `on_data_loss = resnapshot`) replaces it.
    async fn abandon_broken_snapshot(&self, resume: Lsn) -> Result<Option<FactsRow>> {
        let state = crate::snapshot::state(&self.config).await?;
        let open = state.mode.as_deref() == Some(crate::snapshot::SnapshotMode::Chunked.as_str())
            && matches!(state.status.state.as_str(), "open" | "paused");
        let Some(snapshot) = state.status.snapshot.filter(|s| open && *s < resume) else {
            return Ok(None);
        };
        tracing::warn!(table = %self.config.table, %snapshot,
            "the open chunked snapshot is abandoned: changes after its S were skipped");
        Ok(Some(FactsRow {
            event: Some(events::SNAPSHOT_ABANDONED.into()),
            rows: Some(0),
            min_lsn: Some(snapshot.to_string()),
            max_lsn: Some(snapshot.to_string()),
            detail: Some(
                json!({"snapshot": snapshot, "reason": "changes after its S were skipped", "skipped_to": resume})
                    .to_string(),
            ),
            ..FactsRow::default()
        }))
    }

    /// Opens a chunked re-snapshot when `resnapshot_every_days` says the newest snapshot
    /// is due (opened that long ago, complete, and with commits since its S). The stream goes
    /// on untouched; the backfill reads it. Looked at once a minute at most.
    async fn scheduled_resnapshot(&mut self) -> Result<()> {
        let Some(days) = self.config.resnapshot_every_days else {
            return Ok(());
        };
        if self
            .schedule_checked
            .is_some_and(|checked| checked.elapsed() < std::time::Duration::from_secs(60))
        {
            return Ok(());
        }
        self.schedule_checked = Some(Instant::now());
        let Some(newest) = crate::snapshot::progress(&self.facts, &self.config.app_id).await?
        else {
            return Ok(());
        };
        let age_days = newest
            .opened_at
            .map(|opened| (micros_now() - opened) as f64 / 86_400e6);
        if !newest.done || age_days.is_none_or(|age| age < days) {
            return Ok(());
        }
        let max_lsn: LsnAnswer = self.client.action("max_lsn", &json!({})).await?;
        if max_lsn.lsn.is_none_or(|lsn| lsn <= newest.snapshot) {
            return Ok(()); // nothing committed since: a re-snapshot would read the same rows
        }
        let snapshot = self.snapshots()?.open_resnapshot().await?;
        tracing::info!(table = %self.config.table, %snapshot, previous = %newest.snapshot, days,
            "scheduled re-snapshot opened (resnapshot_every_days)");
        Ok(())
    }

    /// Moves the batch to start at `resume` (its end too, when `resume` is past it), recorded
    /// in the checkpoint with the batch's `events` so far before anything is read: a replay
    /// of the amended batch plans its range without the purge, and writes the events
    /// recorded here instead of losing them.
    async fn resume_at(
        &mut self,
        record: &mut BatchRecord,
        resume: Offset,
        events: &[FactsRow],
    ) -> Result<()> {
        let claimed = record.clone();
        record.start = resume;
        if record.end.lsn <= resume.lsn {
            record.end = self.latest(resume, None).await?;
        }
        record.events = events.to_vec();
        self.checkpoint.amend(&claimed, record).await?;
        record.amendment = claimed.amendment + 1;
        Ok(())
    }

    /// Bronze ready for the batch's files; `None` when planning counted no rows (no bronze
    /// commit). A batch bronze already holds was written by another writer with this app id
    /// since this one planned it (a replay of one a crash left written finishes before
    /// planning): fenced, as going on would record this writer's range under the other's
    /// batch. Bronze's small files are compacted first once there are enough of them
    /// ([`crate::maintenance::auto_compact`]), as a busy table adds one with every batch.
    async fn prepare_bronze(
        &mut self,
        plan: &PlannedBatch,
        batch_id: i64,
    ) -> Result<Option<Arc<bronze::Appender>>> {
        if plan.rows == 0 {
            return Ok(None);
        }
        // Bronze as the last batch found it, caught up with the commits since: loading it
        // anew would replay its log since the last checkpoint on every batch.
        let table = match self.bronze.take() {
            Some(mut table) => {
                table.update_incremental(None).await?;
                crate::features::check(&table, TableKind::Bronze, self.target.as_str())?;
                table
            }
            None => {
                let empty = RecordBatch::new_empty(plan.schema.clone());
                tables::ensure_with(
                    &self.target,
                    TableKind::Bronze,
                    bronze::fields(&bronze::stream_rows(&empty, batch_id)?.schema())?,
                    "bronze",
                    bronze::creation_properties(&self.columns, &plan.schema),
                )
                .await?
            }
        };
        // Compacted before the check below: the appender's commit checks its application
        // transaction only against the commits after the snapshot it starts from, so that
        // snapshot must be the one the check saw (a compaction's commit after the check could
        // carry another writer's commit of this batch into it unseen).
        let table = match tables::compacted(table, self.target.as_str()).await {
            Some(table) => table,
            None => tables::open(&self.target).await?.ok_or_else(|| {
                WriterError::Internal(format!("bronze {} disappeared", self.config.target))
            })?,
        };
        self.bronze = Some(table.clone());
        if tables::holds_transaction(&table, &self.config.app_id, batch_id).await? {
            return Err(WriterError::Fenced(format!(
                "bronze {} received batch {batch_id} of app_id '{}' from another writer while \
                 this one planned it (checkpoint {}): two writers of one app id are running. \
                 This one stopped before writing; stop the other, or give this one its own \
                 app_id and checkpoint",
                self.config.target, self.config.app_id, self.config.checkpoint,
            )));
        }
        let appender = bronze::Appender::prepare(
            table,
            &plan.schema,
            &self.config.target,
            bronze::BronzeRows::Stream(batch_id),
        )
        .await?
        .reading(self.columns.clone())?;
        Ok(Some(Arc::new(appender)))
    }

    /// The next batch's range after `start` and its plan, planned ahead; `None` when there
    /// is nothing after `start`, when the range reaches `source_max` without an `upper` (it
    /// will have grown by the time its batch starts) or when asking failed (the batch then
    /// asks again, and meets the error where it handles it). The batch reuses the plan when
    /// its range ends where this one does.
    async fn plan_after(
        &self,
        start: Offset,
        upper: Option<Lsn>,
        source_max: Lsn,
    ) -> Option<Planned> {
        let planned = async {
            let end = self.latest(start, upper).await?;
            if end.lsn <= start.lsn || (upper.is_none() && end.lsn >= source_max) {
                return Ok(None);
            }
            Ok::<_, WriterError>(Some(Planned {
                start,
                end,
                plan: self.plan(start, end).await?,
                ahead: true,
            }))
        };
        planned.await.unwrap_or_else(|error| {
            tracing::debug!(table = %self.config.table, %error, "planning ahead failed");
            None
        })
    }

    /// Opens the connections `plan`'s endpoints are read over that are not open yet: one
    /// per reader, a reader per endpoint up to `partitions`.
    async fn open_readers(&mut self, plan: &PlannedBatch) -> Result<()> {
        let connections = plan
            .tickets
            .len()
            .min(self.config.partitions.max(1) as usize);
        while 1 + self.readers.len() < connections {
            self.readers
                .push(connect_server(&self.config.server).await?);
        }
        Ok(())
    }

    /// Reads the endpoints with up to `partitions` readers in parallel, each over a
    /// connection of its own (the ones [`Stream::open_readers`] opened) taking the next
    /// endpoint no reader took yet, streaming its batches into the reader's own bronze files
    /// (when `bronze` is given) and its totals.
    async fn read(
        &self,
        plan: &PlannedBatch,
        bronze: Option<Arc<bronze::Appender>>,
    ) -> Result<EndpointReads> {
        let clients: Vec<&CdcClient> = std::iter::once(&self.client).chain(&self.readers).collect();
        let tickets = Arc::new(plan.tickets.clone());
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut reads = Vec::new();
        for client in clients.iter().take(tickets.len()) {
            let client = (*client).clone();
            let (tickets, next) = (Arc::clone(&tickets), Arc::clone(&next));
            let mut files = bronze.as_ref().map(bronze::Appender::file_writer);
            reads.push(tokio::spawn(async move {
                let mut totals = Totals::default();
                let mut completions = Vec::new();
                let streamed: Result<()> = async {
                    // The next endpoint no reader took yet: a reader the machine serves
                    // faster reads more of them, and all end about together.
                    loop {
                        let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(ticket) = tickets.get(index) else {
                            return Ok(());
                        };
                        let mut reader = client.open_endpoint(ticket).await?;
                        while let Some(batch) = reader.next_batch().await? {
                            totals.add(&batch)?;
                            if let Some(files) = files.as_mut() {
                                files.write(&batch).await?;
                            }
                        }
                        completions.push((index, reader.completion()?));
                    }
                }
                .await;
                match (streamed, files) {
                    (Ok(()), Some(files)) => Ok((totals, completions, files.close().await?)),
                    (Ok(()), None) => Ok((totals, completions, Vec::new())),
                    (Err(error), files) => {
                        if let Some(files) = files {
                            files.abort().await;
                        }
                        Err(error)
                    }
                }
            }));
        }
        let (mut totals, mut completions, mut files) = (Totals::default(), Vec::new(), Vec::new());
        let mut reads = reads.into_iter();
        while let Some(read) = reads.next() {
            let read = read
                .await
                .map_err(|error| WriterError::Internal(format!("read task: {error}")))
                .and_then(|read| read);
            let (read_totals, read_completions, read_files) = match read {
                Ok(read) => read,
                Err(error) => {
                    // The batch fails: the other readers would read on (their opens retried
                    // for a restarted server) into files nothing commits.
                    for other in reads {
                        other.abort();
                    }
                    return Err(error);
                }
            };
            totals.merge(read_totals);
            completions.extend(read_completions);
            files.extend(read_files);
        }
        completions.sort_by_key(|(index, _)| *index);
        Ok(EndpointReads {
            totals,
            completions: completions
                .into_iter()
                .map(|(_, completion)| completion)
                .collect(),
            files,
        })
    }

    /// A bronze commit's userMetadata: the seed's facts JSON, then the whole facts row and
    /// event rows of the batch, from which a replay finishes it without the source.
    fn user_metadata(&self, batch_id: i64, facts: &FactsRow, events: &[FactsRow]) -> String {
        let mut metadata = json!({
            "rows": facts.rows, "min_lsn": facts.min_lsn, "max_lsn": facts.max_lsn,
            "min_commit_ts": facts.min_commit_ts.map(|t| CommitTime(t).to_iso_millis()),
            "max_commit_ts": facts.max_commit_ts.map(|t| CommitTime(t).to_iso_millis()),
            "deletes": facts.deletes, "inserts": facts.inserts, "updates": facts.updates,
            "batch_id": batch_id, "app_id": self.config.app_id,
        });
        metadata[bronze::FACTS_KEY] = json!(facts);
        metadata[bronze::EVENTS_KEY] = json!(events);
        metadata.to_string()
    }

    async fn append_facts(
        &self,
        batch_id: i64,
        row: FactsRow,
        events: Vec<FactsRow>,
    ) -> Result<()> {
        let written_at = micros_now();
        let mut rows = vec![row];
        rows.extend(events.into_iter().map(|event| FactsRow {
            app_id: Some(self.config.app_id.clone()),
            batch_id: Some(batch_id),
            target: Some(self.config.target.clone()),
            ..event
        }));
        for row in &mut rows {
            row.written_at = Some(written_at);
        }
        let rows = facts::to_batch(&rows)?;
        // Either way a facts row the table holds already (a replay's) is left out.
        match &self.ledger {
            Some(ledger) => {
                ledger
                    .append_facts(&self.facts_app_id(), batch_id, rows)
                    .await?;
            }
            None => {
                let batch = vec![(self.facts_app_id(), batch_id, rows)];
                self.facts
                    .append_once_each(TableKind::Facts, "facts", batch)
                    .await?;
            }
        }
        Ok(())
    }
}

/// Wall time of a batch's steps, in milliseconds (logged at debug level).
struct Laps {
    last: Instant,
    steps: Vec<(&'static str, u128)>,
}

impl Laps {
    fn start() -> Self {
        Laps {
            last: Instant::now(),
            steps: Vec::new(),
        }
    }

    fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps.push((step, (now - self.last).as_millis()));
        self.last = now;
    }
}

impl std::fmt::Display for Laps {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, (step, millis)) in self.steps.iter().enumerate() {
            let separator = if index == 0 { "" } else { " " };
            write!(formatter, "{separator}{step}={millis}ms")?;
        }
        Ok(())
    }
}

/// A planned batch: its events, schema, rows counted and one ticket per endpoint.
struct PlannedBatch {
    events: Vec<mssql_cdc_proto::protocol::RangeEvent>,
    schema: SchemaRef,
    rows: u64,
    tickets: Vec<arrow_flight::Ticket>,
}

/// A plan of `(start, end]` made before its batch started.
struct Planned {
    start: Offset,
    end: Offset,
    plan: PlannedBatch,
    /// Made while the batch before streamed (not by a quiet check just before its batch).
    ahead: bool,
}

/// What reading a batch's endpoints gathered.
struct EndpointReads {
    totals: Totals,
    completions: Vec<mssql_cdc_proto::protocol::Completion>,
    files: Vec<deltalake::kernel::Add>,
}
