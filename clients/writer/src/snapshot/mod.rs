//! Snapshots into bronze: a full bootstrap (ADR 0016) and chunked snapshots read in waves
//! next to the running stream (ADR 0028), all state in the lake.
//!
//! **Full**: S = `snapshot_lsn` is recorded first, a `snapshot_open` facts row, then the whole
//! table read in `partitions` streams into one bronze append (`<app_id>#snap.<S>`, version 0)
//! and a `bootstrap` facts row; the stream starts at S. A rerun finds the `bootstrap` row (or
//! the append) and returns S without reading again.
//!
//! **Chunked**: the open records S and the key's extent (plans table) and a `snapshot_open`
//! facts row without key values, and the stream starts at S at once. [`Snapshots::backfill`]
//! plans the chunks on its first call (counted key slices packed into chunks of at most
//! `chunk_rows`, `snapshot_plan` rows), then reads waves of whole rounds of `partitions`
//! chunks: the wave's chunks are recorded in the plans table **before** the read (so a rerun
//! reads exactly them), each chunk stream is stamped by the server before its read and must
//! not be stamped below S, the wave is one bronze append (`<app_id>#snap.<S>`, version =
//! wave), then one `snapshot_chunk` facts row per chunk (`<app_id>#snapchunks.<S>`, wave),
//! and after the last chunk the `bootstrap` completion row. A crash between a wave's append
//! and its facts rows reruns the wave: Delta holds the append, so the rows are counted from
//! bronze instead of read again.
//!
//! Where each condition of ADR 0028 is kept: docs/snapshots.md.
//!
//! One module per concern: [`full`] and [`open`] start snapshots, [`seed`] adopts a copy, [`plan`] cuts the chunks,
//! [`wave`] runs the backfill whose [`read`] fills bronze, [`operator`] pauses and resumes,
//! [`recorded`] reads back what the facts table records, [`status`] answers for a table.

mod full;
mod open;
mod operator;
mod plan;
mod read;
mod recorded;
mod seed;
pub(crate) mod seed_layout;
mod status;
mod wave;

pub use full::{bootstrap, recorded_start};
pub use open::{Lost, open};
pub use operator::{operator_pause, set_paused};
pub use recorded::{SnapshotProgress, open_chunked_apps, progress};
pub use seed::{AsOf, SeedOptions, SeedOutcome};
pub use status::{SnapshotState, state};

use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{Bound, KeyColumn, KeyTuple};
use mssql_cdc_proto::protocol::{LsnAnswer, TimeAnswer};
use mssql_cdc_proto::selection::ColumnSelection;
use serde::{Deserialize, Serialize};
use serde_json::json;
use url::Url;

use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::{self, FactsRow};
use crate::shared_table::SharedTable;
use crate::stream::StreamConfig;
use crate::tables::{self, TableKind};
use recorded::Recorded;

/// How a table is snapshotted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// The whole table in one bronze append before the stream starts.
    Full,
    /// Chunks read in waves next to the running stream.
    Chunked,
}

impl SnapshotMode {
    /// The mode's name: in the CLI, the admin service, status answers and the `mode` of the
    /// facts and plans rows' details.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotMode::Full => "full",
            SnapshotMode::Chunked => "chunked",
        }
    }

    /// The mode a `snapshot_open` row's detail records (anything but chunked is full).
    pub(crate) fn of_detail(detail: &serde_json::Value) -> Self {
        if detail["mode"].as_str() == Some(SnapshotMode::Chunked.as_str()) {
            SnapshotMode::Chunked
        } else {
            SnapshotMode::Full
        }
    }
}

impl std::str::FromStr for SnapshotMode {
    type Err = WriterError;

    fn from_str(text: &str) -> Result<Self> {
        let text = text.to_ascii_lowercase();
        [SnapshotMode::Full, SnapshotMode::Chunked]
            .into_iter()
            .find(|mode| mode.as_str() == text)
            .ok_or_else(|| {
                WriterError::invalid(format!(
                    "snapshot mode '{text}' is neither full nor chunked"
                ))
            })
    }
}

/// Options of [`Snapshots::backfill`].
#[derive(Clone, Debug)]
pub struct BackfillOptions {
    /// Most rows per chunk (used by the first call, which plans; later calls keep the plan).
    pub chunk_rows: u64,
    /// Stop after this many waves (`None`: until done).
    pub max_waves: Option<u32>,
    /// Waves take as many rounds of `partitions` chunks as fit in this many seconds.
    pub target_wave_seconds: f64,
    /// Pause while the stream's retention headroom is below this (or unknown).
    pub min_headroom_hours: Option<f64>,
}

impl Default for BackfillOptions {
    fn default() -> Self {
        BackfillOptions {
            chunk_rows: 100_000,
            max_waves: None,
            target_wave_seconds: 30.0,
            min_headroom_hours: None,
        }
    }
}

/// Where a table's chunked snapshot stands: what a backfill call did (the seed's
/// `BackfillStatus`), and the fields of [`SnapshotState`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackfillStatus {
    /// S of the snapshot worked on.
    pub snapshot: Option<Lsn>,
    /// Chunks whose rows are in bronze and facts.
    pub chunks_done: u64,
    /// Chunks of the plan (`None` before it exists).
    pub chunks_total: Option<u64>,
    /// Whether the snapshot is complete.
    pub done: bool,
    /// Whether the call stopped early for a guard.
    pub paused: bool,
    /// After a backfill: `no_snapshot`, `reading`, `done`, `waiting_headroom`,
    /// `waiting_metrics`; in a [`SnapshotState`]: `no_snapshot`, `open`, `paused`, `done`.
    pub state: String,
    /// Why it paused or stopped.
    pub reason: Option<String>,
}

impl BackfillStatus {
    /// The status of a table without a snapshot.
    pub fn no_snapshot() -> Self {
        BackfillStatus {
            snapshot: None,
            chunks_done: 0,
            chunks_total: None,
            done: false,
            paused: false,
            state: "no_snapshot".into(),
            reason: None,
        }
    }
}

/// Progress of a backfill after each wave (for a progress bar).
#[derive(Clone, Debug, PartialEq)]
pub struct WaveProgress {
    /// S of the snapshot.
    pub snapshot: Lsn,
    /// The wave just committed.
    pub wave: i64,
    /// Chunks in bronze and facts.
    pub chunks_done: u64,
    /// Chunks of the plan.
    pub chunks_total: u64,
    /// Rows read by this call so far.
    pub rows: u64,
    /// Rows per second of this call so far.
    pub rows_per_second: f64,
    /// Seconds left at that pace, from the rows the plan counted in the chunks left.
    pub eta_seconds: Option<f64>,
}

/// A full snapshot's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct FullSnapshot {
    /// Its S: the stream starts after it.
    pub snapshot: Lsn,
    /// Rows it holds.
    pub rows: u64,
    /// Whether an earlier run had written it already.
    pub reused: bool,
}

/// One chunk of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedChunk {
    /// Chunk number (`_chunk`).
    pub chunk: i32,
    /// First key (inclusive): an integer, or a keyset tuple as the server wrote it.
    pub lo: Option<Bound>,
    /// First key after the chunk.
    pub hi: Option<Bound>,
    /// Rows counted at planning (integer plans); at most `chunk_rows` on a unique keyset,
    /// `chunk_rows` as the estimate on columns that repeat.
    pub rows: u64,
}

/// How a keyset snapshot is cut, as its `snapshot_open` plans row records it (an integer
/// plan's row is the key's [`KeyExtent`] instead).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysetOpen {
    /// Always `keyset`.
    pub kind: String,
    /// The columns the chunks are cut on, with their types.
    pub keys: Vec<KeyColumn>,
    /// Whether they are the unique index CDC uses.
    pub unique: bool,
    /// The largest key at the open (after S); `None`: the table was empty.
    pub max: Option<KeyTuple>,
}

impl KeysetOpen {
    fn names(&self) -> Vec<String> {
        self.keys.iter().map(|key| key.name.clone()).collect()
    }
}

/// A facts row of a snapshot event at S (`min_lsn` = `max_lsn` = `end_lsn` = S).
fn snapshot_event(event: &str, snapshot: Lsn) -> FactsRow {
    FactsRow {
        event: Some(event.into()),
        min_lsn: Some(snapshot.to_string()),
        max_lsn: Some(snapshot.to_string()),
        end_lsn: Some(snapshot.to_string()),
        ..FactsRow::default()
    }
}

/// The keyset of a `snapshot_open` plans row; `None` for an integer plan's extent.
fn keyset_of(open: &serde_json::Value) -> Result<Option<KeysetOpen>> {
    if open["kind"].as_str() != Some("keyset") {
        return Ok(None);
    }
    serde_json::from_value(open.clone())
        .map(Some)
        .map_err(|error| WriterError::Internal(format!("recorded keyset: {error}")))
}

/// The location of the plans table beside a bronze target.
pub fn plans_location(target: &str) -> String {
    format!("{}_snapshot_plans", target.trim_end_matches('/'))
}

/// Snapshots of one table into its bronze.
pub struct Snapshots {
    config: StreamConfig,
    /// The column selection every snapshot read asks for, as bronze records it.
    columns: ColumnSelection,
    /// Whether `columns` are the table's: bronze records them, or its stream gave them.
    columns_of_table: bool,
    client: CdcClient,
    target: Url,
    /// The facts table, shared with the other readers of this process.
    facts: Arc<SharedTable>,
    plans: Url,
}

fn micros_now() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

fn quoted(text: &str) -> String {
    text.replace('\'', "''")
}

/// A snapshot's plans rows, `(event, detail)` (one `snapshot_open` and one `snapshot_plan`
/// per snapshot; `last` takes the last a scan returns, as the reads before it did).
struct PlansRows(Vec<(String, serde_json::Value)>);

impl PlansRows {
    /// The detail of the last row of `event`.
    fn last(&self, event: &str) -> Option<&serde_json::Value> {
        self.0
            .iter()
            .rev()
            .find(|(name, _)| name == event)
            .map(|(_, detail)| detail)
    }

    /// Our extent of the last `snapshot_open` row.
    fn open_extent(&self) -> Option<&serde_json::Value> {
        self.last(events::SNAPSHOT_OPEN)
            .map(seed_layout::open_extent)
    }

    /// The chunks recorded for `wave`; a chunk row that does not read is an error, never a
    /// wave taken for unrecorded.
    fn wave(&self, wave: i64) -> Result<Vec<PlannedChunk>> {
        self.0
            .iter()
            .filter(|(name, detail)| {
                name == events::SNAPSHOT_CHUNK && detail["wave"].as_i64() == Some(wave)
            })
            .map(|(_, detail)| {
                serde_json::from_value(seed_layout::chunk_of(detail).clone()).map_err(|error| {
                    WriterError::Internal(format!("wave {wave}'s chunk row {detail}: {error}"))
                })
            })
            .collect()
    }
}

fn poisoned() -> WriterError {
    WriterError::Internal("a snapshot reader panicked while taking an endpoint".into())
}

impl Snapshots {
    /// Connects to the server of `config` (its table, target, facts and app id are used).
    pub async fn connect(config: StreamConfig) -> Result<Self> {
        let client = crate::stream::connect_server(&config.server).await?;
        let resolved = config
            .resolve_columns(&client, crate::columns::Role::Reader)
            .await?;
        let mut snapshots = Self::resolved(config, client, resolved.selection)?;
        snapshots.columns_of_table = resolved.bronze.is_some();
        Ok(snapshots)
    }

    /// The source table (`schema.table`).
    pub fn table(&self) -> &str {
        &self.config.table
    }

    /// Snapshots of `config`'s table read with `columns` as the table's stream resolved them
    /// (it owns the selection): no second look at bronze.
    pub async fn connect_resolved(config: StreamConfig, columns: ColumnSelection) -> Result<Self> {
        let client = crate::stream::connect_server(&config.server).await?;
        Self::resolved(config, client, columns)
    }

    /// Snapshots of `config`'s table read with `columns`, resolved by the caller (the stream,
    /// which owns the selection).
    pub fn resolved(
        config: StreamConfig,
        client: CdcClient,
        columns: ColumnSelection,
    ) -> Result<Self> {
        Ok(Snapshots {
            columns,
            columns_of_table: true,
            target: tables::table_url(&config.target)?,
            facts: SharedTable::of(&tables::table_url(&config.facts)?),
            plans: tables::table_url(&plans_location(&config.target))?,
            config,
            client,
        })
    }

    fn txn(&self, kind: &str, snapshot: Lsn) -> String {
        format!("{}#{kind}.{snapshot}", self.config.app_id)
    }

    /// The commit time of `snapshot`'s S, recorded on its open (history places versions at
    /// S with it: docs/silver.md, "History").
    async fn time_of(&self, snapshot: Lsn) -> Result<Option<i64>> {
        let answer: TimeAnswer = self
            .client
            .action("lsn_to_time", &json!({"lsn": snapshot}))
            .await?;
        Ok(answer.commit_ts.map(|time| time.micros()))
    }

    async fn stamp(&self) -> Result<Lsn> {
        let answer: LsnAnswer = self
            .client
            .action("snapshot_lsn", &json!({"table": self.config.table}))
            .await?;
        answer
            .lsn
            .ok_or_else(|| WriterError::Internal("the server gave no snapshot_lsn".into()))
    }

    /// Appends the rows once under `(txn, version)`; `false` when the facts table held that
    /// transaction already (a rerun, or a concurrent writer that won).
    async fn append_facts(&self, txn: &str, version: i64, rows: Vec<FactsRow>) -> Result<bool> {
        let written_at = micros_now();
        let rows: Vec<FactsRow> = rows
            .into_iter()
            .map(|row| FactsRow {
                app_id: Some(self.config.app_id.clone()),
                target: Some(self.config.target.clone()),
                written_at: Some(written_at),
                ..row
            })
            .collect();
        tables::append_once(
            self.facts.url(),
            TableKind::Facts,
            "facts",
            txn,
            version,
            facts::to_batch(&rows)?,
        )
        .await
    }

    async fn append_plans(
        &self,
        txn: &str,
        version: i64,
        snapshot: Lsn,
        rows: Vec<(&str, serde_json::Value)>,
    ) -> Result<bool> {
        use arrow::array::{ArrayRef, StringArray, TimestampMicrosecondArray};
        let written_at = micros_now();
        let count = rows.len();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec![snapshot.to_string(); count])),
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.1.to_string()),
            )),
            Arc::new(TimestampMicrosecondArray::from(vec![written_at; count])),
        ];
        let batch = RecordBatch::try_new(facts::arrow_schema(TableKind::Plans), columns)?;
        tables::append_once(
            &self.plans,
            TableKind::Plans,
            "snapshot_plans",
            txn,
            version,
            batch,
        )
        .await
    }

    /// Every plans row of a snapshot, read in one query: a backfill reads them once and
    /// takes its keys, plan and recorded waves from them.
    async fn plans_rows(&self, snapshot: Lsn) -> Result<PlansRows> {
        let rows = tables::query_text(
            &self.plans,
            &format!("SELECT event, detail FROM t WHERE snapshot = '{snapshot}'"),
        )
        .await?;
        let rows = rows
            .into_iter()
            .map(|row| {
                let detail = serde_json::from_str(row[1].as_deref().unwrap_or("null"))
                    .map_err(|error| WriterError::Internal(format!("plans detail: {error}")))?;
                Ok((row[0].clone().unwrap_or_default(), detail))
            })
            .collect::<Result<_>>()?;
        Ok(PlansRows(rows))
    }

    /// The full snapshot a crashed run left open (not complete, not abandoned).
    fn open_full_of(recorded: &Recorded) -> Option<Lsn> {
        recorded
            .opens
            .iter()
            .filter(|(lsn, open_mode)| {
                *open_mode == SnapshotMode::Full
                    && !recorded.completions.iter().any(|(done, _)| done >= lsn)
                    && !recorded.abandoned.contains(lsn)
            })
            .map(|(lsn, _)| *lsn)
            .max()
    }

    /// `recorded` after releasing a full snapshot left open whose S cleanup has passed: a
    /// stream could no longer start at it, so completing it would only fail later; it is
    /// abandoned (a `snapshot_abandoned` row), which frees the mode lock it held.
    async fn release_expired_full(&self, mut recorded: Recorded) -> Result<Recorded> {
        let Some(open) = Self::open_full_of(&recorded) else {
            return Ok(recorded);
        };
        let earliest = self
            .client
            .initial_offset(&self.config.table, "earliest")
            .await?;
        if earliest.lsn <= open {
            return Ok(recorded);
        }
        tracing::warn!(table = %self.config.table, snapshot = %open, min_lsn = %earliest.lsn.increment(),
            "a full snapshot left open by a crash is released: cleanup passed its S");
        self.append_facts(
            &self.txn("snapabandon", open),
            0,
            vec![FactsRow {
                rows: Some(0),
                detail: Some(
                    json!({"snapshot": open, "mode": SnapshotMode::Full.as_str(), "reason": "cleanup passed its S before it completed", "min_lsn": earliest.lsn.increment()})
                        .to_string(),
                ),
                ..snapshot_event(events::SNAPSHOT_ABANDONED, open)
            }],
        )
        .await?;
        recorded.abandoned.push(open);
        Ok(recorded)
    }

    /// Refuses to start a snapshot of `mode` while one of the other mode is open.
    fn mode_lock(recorded: &Recorded, mode: SnapshotMode) -> Result<()> {
        let open_full = Self::open_full_of(recorded);
        if mode == SnapshotMode::Chunked
            && let Some(open) = open_full
        {
            return Err(WriterError::invalid(format!(
                "a full snapshot ({open}) was opened for this app_id and did not complete: \
                 finish it with `mssql-cdc-writer run --bootstrap full` before opening a \
                 chunked one; one snapshot mode per run"
            )));
        }
        if mode == SnapshotMode::Full
            && let Some(open) = Self::open_chunked_of(recorded)
        {
            return Err(WriterError::invalid(format!(
                "a chunked snapshot ({open}) is open for this app_id: finish it with \
                 `mssql-cdc-writer backfill` (or open with snapshot = chunked) before taking a \
                 full snapshot; one snapshot mode per run"
            )));
        }
        Ok(())
    }
}
