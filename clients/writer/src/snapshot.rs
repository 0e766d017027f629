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

use std::sync::Arc;
use std::time::Instant;

use arrow::record_batch::RecordBatch;
use mssql_cdc_proto::catalog::{KeyBucket, KeyExtent};
use mssql_cdc_proto::chunking::{self, BucketCounter};
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{Bound, KeyColumn, KeySeek, KeyTuple};
use mssql_cdc_proto::protocol::{
    ChunkSpec, Completion, KeyBoundAnswer, KeyMaxAnswer, LsnAnswer, SnapshotCommand,
};
use mssql_cdc_proto::{CommitTime, Lsn};
use serde::{Deserialize, Serialize};
use serde_json::json;
use url::Url;

use crate::bronze::{self, BronzeRows};
use crate::error::{Result, WriterError};
use crate::facts::{self, FactsRow};
use crate::stream::StreamConfig;
use crate::tables::{self, TableKind};

/// How a table is snapshotted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// The whole table in one bronze append before the stream starts.
    Full,
    /// Chunks read in waves next to the running stream.
    Chunked,
}

impl std::str::FromStr for SnapshotMode {
    type Err = WriterError;

    fn from_str(text: &str) -> Result<Self> {
        match text.to_ascii_lowercase().as_str() {
            "full" => Ok(SnapshotMode::Full),
            "chunked" => Ok(SnapshotMode::Chunked),
            other => Err(WriterError::invalid(format!(
                "snapshot mode '{other}' is neither full nor chunked"
            ))),
        }
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

/// What a backfill call did (the seed's `BackfillStatus`).
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
    /// `no_snapshot`, `reading`, `done`, `waiting_headroom`, `waiting_metrics`.
    pub state: String,
    /// Why it paused or stopped.
    pub reason: Option<String>,
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

/// Counts key slices through the server's `key_buckets` action.
struct FlightCounter<'a> {
    client: &'a CdcClient,
    table: &'a str,
}

#[async_trait::async_trait]
impl BucketCounter for FlightCounter<'_> {
    async fn buckets(
        &self,
        lo: i64,
        hi: i64,
        width: u64,
    ) -> mssql_cdc_proto::Result<Vec<KeyBucket>> {
        self.client
            .action(
                "key_buckets",
                &json!({"table": self.table, "lo": lo, "hi": hi, "width": width}),
            )
            .await
            .map_err(|error| mssql_cdc_proto::Error::SourceUnavailable(error.to_string()))
    }
}

/// The snapshot facts of one app id, as read back from the lake.
#[derive(Debug, Default)]
struct Recorded {
    /// S of every `snapshot_open` row with its mode.
    opens: Vec<(Lsn, SnapshotMode)>,
    /// S of every completion row with its rows.
    completions: Vec<(Lsn, u64)>,
    /// S of every snapshot opened as a re-snapshot (generation 1 and later).
    resnapshots: Vec<Lsn>,
}

/// Snapshots of one table into its bronze.
pub struct Snapshots {
    config: StreamConfig,
    client: CdcClient,
    target: Url,
    facts: Url,
    plans: Url,
}

fn micros_now() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

fn quoted(text: &str) -> String {
    text.replace('\'', "''")
}

impl Snapshots {
    /// Connects to the server of `config` (its table, target, facts and app id are used).
    pub async fn connect(config: StreamConfig) -> Result<Self> {
        let client = crate::stream::connect_server(&config.server).await?;
        Ok(Snapshots {
            target: tables::table_url(&config.target)?,
            facts: tables::table_url(&config.facts)?,
            plans: tables::table_url(&plans_location(&config.target))?,
            config,
            client,
        })
    }

    fn txn(&self, kind: &str, snapshot: Lsn) -> String {
        format!("{}#{kind}.{snapshot}", self.config.app_id)
    }

    async fn recorded(&self) -> Result<Recorded> {
        let rows = tables::query_text(
            &self.facts,
            &format!(
                "SELECT event, min_lsn, detail, rows FROM t WHERE app_id = '{}' AND event IN \
                 ('snapshot_open', 'bootstrap', 'resnapshot')",
                quoted(&self.config.app_id)
            ),
        )
        .await?;
        let mut recorded = Recorded::default();
        for row in rows {
            let (Some(event), Some(lsn)) = (&row[0], &row[1]) else {
                continue;
            };
            let lsn: Lsn = lsn
                .parse()
                .map_err(|error| WriterError::Internal(format!("facts min_lsn: {error}")))?;
            if event == "snapshot_open" {
                let detail: serde_json::Value =
                    serde_json::from_str(row[2].as_deref().unwrap_or("{}")).unwrap_or_default();
                let mode = match detail["mode"].as_str() {
                    Some("chunked") => SnapshotMode::Chunked,
                    _ => SnapshotMode::Full,
                };
                if detail["kind"].as_str() == Some("resnapshot") {
                    recorded.resnapshots.push(lsn);
                }
                recorded.opens.push((lsn, mode));
            } else {
                let rows = row[3].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0);
                recorded.completions.push((lsn, rows));
            }
        }
        Ok(recorded)
    }

    /// The newest chunked snapshot opened and not complete.
    fn open_chunked_of(recorded: &Recorded) -> Option<Lsn> {
        recorded
            .opens
            .iter()
            .filter(|(lsn, mode)| {
                *mode == SnapshotMode::Chunked
                    && !recorded.completions.iter().any(|(done, _)| done >= lsn)
            })
            .map(|(lsn, _)| *lsn)
            .max()
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

    async fn append_facts(&self, txn: &str, version: i64, rows: Vec<FactsRow>) -> Result<()> {
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
            &self.facts,
            TableKind::Facts,
            "facts",
            txn,
            version,
            facts::to_batch(&rows)?,
        )
        .await?;
        Ok(())
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

    /// Refuses to start a snapshot of `mode` while one of the other mode is open.
    fn mode_lock(recorded: &Recorded, mode: SnapshotMode) -> Result<()> {
        let open_full = recorded
            .opens
            .iter()
            .filter(|(lsn, open_mode)| {
                *open_mode == SnapshotMode::Full
                    && !recorded.completions.iter().any(|(done, _)| done >= lsn)
            })
            .map(|(lsn, _)| *lsn)
            .max();
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

    /// Takes a full snapshot (or returns the one an earlier run completed): the stream starts
    /// after its S.
    pub async fn bootstrap_full(&self) -> Result<FullSnapshot> {
        let recorded = self.recorded().await?;
        if let Some((snapshot, rows)) = recorded.completions.iter().max().copied() {
            return Ok(FullSnapshot {
                snapshot,
                rows,
                reused: true,
            });
        }
        Self::mode_lock(&recorded, SnapshotMode::Full)?;
        // A full snapshot an earlier run opened and crashed in keeps its S.
        let snapshot = match recorded
            .opens
            .iter()
            .filter(|(_, mode)| *mode == SnapshotMode::Full)
            .map(|(lsn, _)| *lsn)
            .max()
        {
            Some(open) => open,
            None => self.stamp().await?,
        };
        let detail = json!({"mode": "full", "kind": "bootstrap", "generation": 0});
        self.append_facts(
            &self.txn("snapopen", snapshot),
            0,
            vec![FactsRow {
                rows: Some(0),
                detail: Some(detail.to_string()),
                ..snapshot_event("snapshot_open", snapshot)
            }],
        )
        .await?;
        crate::stream::crash_point("after_snapshot_open", 0);
        let started_at = micros_now();
        let clock = Instant::now();
        let bronze_txn = self.txn("snap", snapshot);
        let rows = match self.held_by_bronze(&bronze_txn, 0).await? {
            true => self
                .count_snapshot_rows(snapshot, None)
                .await?
                .iter()
                .map(|c| c.1)
                .sum(),
            false => {
                let mut command = SnapshotCommand::new(self.config.table.clone());
                command.partitions = Some(self.config.partitions.max(1));
                let read = self
                    .read_into_bronze(snapshot, command, &bronze_txn, 0)
                    .await?;
                read.rows.iter().sum()
            }
        };
        self.append_facts(
            &self.txn("snapdone", snapshot),
            0,
            vec![FactsRow {
                rows: Some(rows as i64),
                started_at: Some(started_at),
                duration_ms: Some(clock.elapsed().as_millis() as i64),
                detail: Some(json!({"mode": "full", "snapshot": snapshot}).to_string()),
                ..snapshot_event("bootstrap", snapshot)
            }],
        )
        .await?;
        Ok(FullSnapshot {
            snapshot,
            rows,
            reused: false,
        })
    }

    /// Opens a chunked snapshot (or returns the S of the open or complete one an earlier run
    /// recorded): the stream starts after S at once, [`Snapshots::backfill`] reads the rows.
    pub async fn open_chunked(&self) -> Result<Lsn> {
        let recorded = self.recorded().await?;
        if let Some(open) = Self::open_chunked_of(&recorded) {
            return Ok(open);
        }
        if let Some((done, _)) = recorded.completions.iter().max() {
            return Ok(*done);
        }
        self.open_chunked_generation(&recorded, None).await
    }

    /// Opens a chunked **re-snapshot** of a table that has a complete snapshot (generation
    /// 1 and later): a new S, its own plan and waves, and a `resnapshot` completion row after
    /// the last chunk, from which silver is rebuilt (every key the new snapshot lacks, rows
    /// deleted meanwhile included, leaves silver). The stream goes on untouched. An open
    /// chunked snapshot is returned as it is; without a complete snapshot this is a chunked
    /// bootstrap.
    pub async fn open_resnapshot(&self) -> Result<Lsn> {
        let recorded = self.recorded().await?;
        if let Some(open) = Self::open_chunked_of(&recorded) {
            return Ok(open);
        }
        let Some(previous) = recorded.completions.iter().map(|(lsn, _)| *lsn).max() else {
            return self.open_chunked_generation(&recorded, None).await;
        };
        self.open_chunked_generation(&recorded, Some(previous))
            .await
    }

    /// Records a new chunked snapshot: generation 0, or a re-snapshot after `previous`.
    async fn open_chunked_generation(
        &self,
        recorded: &Recorded,
        previous: Option<Lsn>,
    ) -> Result<Lsn> {
        Self::mode_lock(recorded, SnapshotMode::Chunked)?;
        let snapshot = self.stamp().await?;
        if let Some(previous) = previous
            && snapshot <= previous
        {
            return Err(WriterError::invalid(format!(
                "{}: no commit since snapshot {previous} (max_lsn is {snapshot}); a re-snapshot \
                 would read the same rows",
                self.config.table
            )));
        }
        let generation = recorded
            .opens
            .iter()
            .map(|(lsn, _)| *lsn)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        let kind = if previous.is_some() {
            "resnapshot"
        } else {
            "bootstrap"
        };
        // The columns to cut on, checked and typed by the server, and MAX read after S.
        let cut: KeyMaxAnswer = self
            .client
            .action(
                "key_max",
                &json!({"table": self.config.table, "keys": self.config.snapshot_keys}),
            )
            .await?;
        let (open_detail, key_names) = match cut.keys.as_slice() {
            // One integer unique key: chunks packed from counted slices.
            [key] if cut.unique && key.is_integer() => {
                let extent: KeyExtent = self
                    .client
                    .action("key_extent", &json!({"table": self.config.table}))
                    .await?;
                let names = vec![extent.column.clone()];
                (serde_json::to_value(&extent).unwrap_or_default(), names)
            }
            _ => {
                let open = KeysetOpen {
                    kind: "keyset".into(),
                    keys: cut.keys,
                    unique: cut.unique,
                    max: cut.max,
                };
                let names = open.names();
                (serde_json::to_value(&open).unwrap_or_default(), names)
            }
        };
        let txn = self.txn("snapopen", snapshot);
        // Plans first: the key values live beside bronze, not in the facts.
        self.append_plans(&txn, 0, snapshot, vec![("snapshot_open", open_detail)])
            .await?;
        self.append_facts(
            &txn,
            0,
            vec![FactsRow {
                rows: Some(0),
                detail: Some(
                    json!({"mode": "chunked", "kind": kind, "generation": generation, "keys": key_names})
                        .to_string(),
                ),
                ..snapshot_event("snapshot_open", snapshot)
            }],
        )
        .await?;
        tracing::info!(table = %self.config.table, %snapshot, kind, generation, "chunked snapshot opened");
        Ok(snapshot)
    }

    /// The plan of an open snapshot (`recorded`: its plans rows): made and recorded on the
    /// first call, read back after.
    async fn plan(
        &self,
        snapshot: Lsn,
        recorded: &PlansRows,
        chunk_rows: u64,
    ) -> Result<Vec<PlannedChunk>> {
        if let Some(plan) = recorded.last("snapshot_plan") {
            if plan["chunk_rows"].as_u64() != Some(chunk_rows) {
                tracing::warn!(planned = %plan["chunk_rows"], asked = chunk_rows,
                    "the snapshot is planned already: its chunk_rows stays");
            }
            return serde_json::from_value(plan["chunks"].clone())
                .map_err(|error| WriterError::Internal(format!("recorded plan: {error}")));
        }
        let open = recorded.last("snapshot_open").cloned().ok_or_else(|| {
            WriterError::invalid(format!(
                "snapshot {snapshot} has no snapshot_open row in {}: a range without bounds \
                     is never read as the whole table",
                plans_location(&self.config.target)
            ))
        })?;
        let chunks = match keyset_of(&open)? {
            Some(keyset) => self.plan_keyset(&keyset, chunk_rows).await?,
            None => {
                let extent: KeyExtent = serde_json::from_value(open)
                    .map_err(|error| WriterError::Internal(format!("recorded extent: {error}")))?;
                let counter = FlightCounter {
                    client: &self.client,
                    table: &self.config.table,
                };
                chunking::plan(&counter, extent.min.zip(extent.max), chunk_rows)
                    .await
                    .map_err(|error| WriterError::Internal(format!("planning chunks: {error}")))?
                    .into_iter()
                    .enumerate()
                    .map(|(index, (range, rows))| PlannedChunk {
                        chunk: index as i32,
                        lo: range.lo.map(Bound::Int),
                        hi: range.hi.map(Bound::Int),
                        rows,
                    })
                    .collect()
            }
        };
        let txn = self.txn("snapplan", snapshot);
        let recorded = self
            .append_plans(
                &txn,
                0,
                snapshot,
                vec![(
                    "snapshot_plan",
                    json!({"chunk_rows": chunk_rows, "chunk_count": chunks.len(), "chunks": chunks}),
                )],
            )
            .await?;
        self.append_facts(
            &txn,
            0,
            vec![FactsRow {
                event: Some("snapshot_plan".into()),
                min_lsn: Some(snapshot.to_string()),
                max_lsn: Some(snapshot.to_string()),
                rows: Some(chunks.iter().map(|c| c.rows as i64).sum()),
                detail: Some(
                    json!({"snapshot": snapshot, "kind": "bootstrap", "chunk_rows": chunk_rows, "chunk_count": chunks.len()})
                        .to_string(),
                ),
                ..FactsRow::default()
            }],
        )
        .await?;
        if recorded {
            return Ok(chunks);
        }
        // Another call recorded its plan first (one plan per snapshot): that one is read.
        let now = self.plans_rows(snapshot).await?;
        Box::pin(self.plan(snapshot, &now, chunk_rows)).await
    }

    /// The key of the `(n + 1)`-th row of a range, sought by the server on the open's keys.
    async fn seek(&self, open: &KeysetOpen, seek: KeySeek) -> Result<Option<KeyTuple>> {
        let mut body = serde_json::to_value(&seek).unwrap_or_default();
        body["table"] = json!(self.config.table);
        body["keys"] = json!(open.names());
        let answer: KeyBoundAnswer = self.client.action("key_bound", &body).await?;
        Ok(answer.bound)
    }

    /// The first key after MAX (`last_bound`), past MAX's own copies; `None` when no row
    /// holds one (yet).
    async fn last_bound(&self, open: &KeysetOpen) -> Result<Option<KeyTuple>> {
        let Some(max) = &open.max else {
            return Ok(None);
        };
        self.seek(
            open,
            KeySeek {
                from: Some(max.clone()),
                from_inclusive: false,
                to: None,
                to_inclusive: false,
                n: 0,
            },
        )
        .await
    }

    /// Keyset bounds `chunk_rows` rows apart, walked up front below the MAX recorded at the
    /// open; the last chunk ends at the first key after MAX (open when there is none yet:
    /// it is sought again before the wave that reads it).
    async fn plan_keyset(&self, open: &KeysetOpen, chunk_rows: u64) -> Result<Vec<PlannedChunk>> {
        let Some(max) = &open.max else {
            // An empty table at the open: one chunk, the whole key (rows inserted since S).
            return Ok(vec![PlannedChunk {
                chunk: 0,
                lo: None,
                hi: None,
                rows: 0,
            }]);
        };
        let mut bounds: Vec<KeyTuple> = Vec::new();
        loop {
            let lo = bounds.last().cloned();
            let mut n = chunk_rows;
            let bound = loop {
                let seek = KeySeek {
                    from: lo.clone(),
                    from_inclusive: true,
                    to: Some(max.clone()),
                    to_inclusive: true,
                    n,
                };
                let Some(bound) = self.seek(open, seek).await? else {
                    break None;
                };
                // On columns that repeat, the (n + 1)-th row can hold lo's own value (equal
                // only under the source's collation, maybe): the chunk would end where it
                // starts. Seek twice as far until [lo, bound) holds a row (Amendment 6).
                let holds_a_row = open.unique
                    || self
                        .seek(
                            open,
                            KeySeek {
                                from: lo.clone(),
                                from_inclusive: true,
                                to: Some(bound.clone()),
                                to_inclusive: false,
                                n: 0,
                            },
                        )
                        .await?
                        .is_some();
                if holds_a_row {
                    break Some(bound);
                }
                n = n.saturating_mul(2);
            };
            match bound {
                Some(bound) => bounds.push(bound),
                None => break,
            }
        }
        let last_hi = self.last_bound(open).await?;
        let mut chunks = Vec::with_capacity(bounds.len() + 1);
        let mut lo: Option<KeyTuple> = None;
        for bound in bounds {
            chunks.push(PlannedChunk {
                chunk: chunks.len() as i32,
                lo: lo.take().map(Bound::Keys),
                hi: Some(Bound::Keys(bound.clone())),
                rows: chunk_rows,
            });
            lo = Some(bound);
        }
        chunks.push(PlannedChunk {
            chunk: chunks.len() as i32,
            lo: lo.map(Bound::Keys),
            hi: last_hi.map(Bound::Keys),
            rows: chunk_rows,
        });
        Ok(chunks)
    }

    /// The keyset an open snapshot is cut on; `None` for an integer plan. Refuses a stream
    /// configured to cut on other columns (the option changed or dropped since the open).
    fn keyset_open_of(&self, snapshot: Lsn, recorded: &PlansRows) -> Result<Option<KeysetOpen>> {
        let Some(open) = recorded.last("snapshot_open") else {
            return Ok(None);
        };
        let keyset = keyset_of(open)?;
        let cut_on: Option<Vec<String>> = match &keyset {
            Some(keyset) => (!keyset.unique).then(|| keyset.names()),
            None => None,
        };
        let asked = match (&self.config.snapshot_keys, &keyset) {
            // Naming the unique index's own columns is the default spelled out.
            (Some(keys), Some(keyset)) if keyset.unique && *keys == keyset.names() => None,
            (Some(keys), None)
                if open["column"].as_str() == keys.first().map(String::as_str)
                    && keys.len() == 1 =>
            {
                None
            }
            (asked, _) => asked.clone(),
        };
        if asked != cut_on {
            return Err(WriterError::invalid(format!(
                "{}: snapshot {snapshot} was opened cut on {}, but snapshot_keys is now {}: a \
                 plan never moves to other columns; set snapshot_keys back to finish it, or \
                 open a new snapshot",
                self.config.table,
                cut_on.map_or("the unique index".to_string(), |keys| format!("{keys:?}")),
                asked.map_or("unset (the unique index)".to_string(), |keys| format!(
                    "{keys:?}"
                )),
            )));
        }
        Ok(keyset)
    }

    /// `(chunk, wave, rows)` of every chunk whose facts row is in.
    async fn chunks_done(&self, snapshot: Lsn) -> Result<Vec<(i32, i64, u64)>> {
        let rows = tables::query_text(
            &self.facts,
            &format!(
                "SELECT detail, rows FROM t WHERE app_id = '{}' AND event = 'snapshot_chunk' AND min_lsn >= '{snapshot}'",
                quoted(&self.config.app_id)
            ),
        )
        .await?;
        let mut done = Vec::new();
        for row in rows {
            let detail: serde_json::Value =
                serde_json::from_str(row[0].as_deref().unwrap_or("{}")).unwrap_or_default();
            if detail["snapshot"].as_str() == Some(&snapshot.to_string()) {
                done.push((
                    detail["chunk"].as_i64().unwrap_or(-1) as i32,
                    detail["wave"].as_i64().unwrap_or(0),
                    row[1].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0),
                ));
            }
        }
        Ok(done)
    }

    /// Pauses (or resumes) the open chunked snapshot: a plans row every backfill checks
    /// before it starts a wave, so the pause holds across processes and restarts; the wave
    /// being read finishes. Returns the snapshot's S.
    pub async fn set_paused(&self, paused: bool, reason: Option<&str>) -> Result<Lsn> {
        let recorded = self.recorded().await?;
        let snapshot = Self::open_chunked_of(&recorded).ok_or_else(|| {
            WriterError::invalid(format!(
                "{} has no open chunked snapshot to {}",
                self.config.table,
                if paused { "pause" } else { "resume" }
            ))
        })?;
        let rows = operator_rows(&self.plans, snapshot).await?;
        if rows
            .last()
            .map(|(_, was_paused, _)| *was_paused)
            .unwrap_or(false)
            == paused
        {
            return Ok(snapshot); // already in that state
        }
        let sequence = rows.last().map_or(0, |(sequence, ..)| *sequence) + 1;
        let event = if paused {
            "snapshot_pause"
        } else {
            "snapshot_resume"
        };
        self.append_plans(
            &self.txn("snapcontrol", snapshot),
            sequence,
            snapshot,
            vec![(
                event,
                json!({"sequence": sequence, "reason": reason.unwrap_or_default()}),
            )],
        )
        .await?;
        tracing::info!(table = %self.config.table, %snapshot, paused, "snapshot {event}");
        Ok(snapshot)
    }

    /// Why to pause while the stream's retention headroom is short or unknown, or `None`.
    async fn headroom_guard(&self, min_hours: f64) -> Result<Option<(String, String)>> {
        let rows = tables::query_text(
            &self.facts,
            &format!(
                "SELECT retention_headroom_hours, written_at FROM t WHERE app_id = '{}' AND event IS NULL \
                 ORDER BY written_at DESC LIMIT 1",
                quoted(&self.config.app_id)
            ),
        )
        .await?;
        let headroom = rows
            .first()
            .and_then(|row| row[0].as_deref())
            .and_then(|value| value.parse::<f64>().ok());
        let Some(headroom) = headroom else {
            return Ok(Some((
                "waiting_metrics".into(),
                "no micro-batch facts row with retention headroom yet: run the stream first".into(),
            )));
        };
        let age_hours = rows
            .first()
            .and_then(|row| row[1].as_deref())
            .and_then(|text| CommitTime::parse_iso(text).ok())
            .map_or(0.0, |written| {
                (micros_now() - written.micros()) as f64 / 3.6e9
            });
        if headroom - age_hours < min_hours {
            return Ok(Some((
                "waiting_headroom".into(),
                format!(
                    "the stream's retention headroom is {:.2} h, below min_headroom_hours {min_hours}",
                    headroom - age_hours
                ),
            )));
        }
        Ok(None)
    }

    /// Reads waves of the newest open chunked snapshot until it is complete (or `max_waves`).
    pub async fn backfill(&self, options: &BackfillOptions) -> Result<BackfillStatus> {
        self.backfill_with_progress(options, |_| {}).await
    }

    /// [`Snapshots::backfill`], calling `on_wave` after every wave.
    pub async fn backfill_with_progress(
        &self,
        options: &BackfillOptions,
        mut on_wave: impl FnMut(&WaveProgress),
    ) -> Result<BackfillStatus> {
        if options.chunk_rows == 0 {
            return Err(WriterError::invalid("chunk_rows must be at least 1"));
        }
        if options.target_wave_seconds.is_nan() || options.target_wave_seconds < 0.0 {
            return Err(WriterError::invalid(
                "target_wave_seconds must be 0 or more",
            ));
        }
        let recorded = self.recorded().await?;
        let Some(snapshot) = Self::open_chunked_of(&recorded) else {
            let done = recorded.completions.iter().max().map(|(lsn, _)| *lsn);
            return Ok(BackfillStatus {
                snapshot: done,
                chunks_done: 0,
                chunks_total: None,
                done: done.is_some(),
                paused: done.is_none(),
                state: if done.is_some() {
                    "done"
                } else {
                    "no_snapshot"
                }
                .into(),
                reason: done
                    .is_none()
                    .then(|| "no chunked snapshot is open for this app_id".into()),
            });
        };
        let planning = Instant::now();
        let recorded_plans = self.plans_rows(snapshot).await?;
        let keyset = self.keyset_open_of(snapshot, &recorded_plans)?;
        let plan = self
            .plan(snapshot, &recorded_plans, options.chunk_rows)
            .await?;
        tracing::debug!(%snapshot, chunks = plan.len(), ms = planning.elapsed().as_millis() as u64,
            "backfill planned");
        let total = plan.len() as u64;
        let partitions = self.config.partitions.max(1) as usize;
        let mut rounds = 1usize;
        let mut waves_read = 0u32;
        let (call, mut rows_read) = (Instant::now(), 0u64);
        // The facts are read once; the waves this call commits are added as they land.
        let mut done = self.chunks_done(snapshot).await?;
        // The wave read last, committed while the next one is read.
        let mut in_flight: Option<WaveInFlight> = None;
        loop {
            let taken = |chunk: &PlannedChunk| {
                done.iter().any(|(id, ..)| *id == chunk.chunk)
                    || in_flight
                        .as_ref()
                        .is_some_and(|wave| wave.chunks.iter().any(|c| c.chunk == chunk.chunk))
            };
            let remaining: Vec<PlannedChunk> =
                plan.iter().filter(|chunk| !taken(chunk)).cloned().collect();
            let between = Instant::now();
            let mut stop: Option<(String, String, bool)> = None;
            if remaining.is_empty() {
                stop = Some(("done".into(), String::new(), false));
            } else if options
                .max_waves
                .is_some_and(|max| waves_read + u32::from(in_flight.is_some()) >= max)
            {
                let waves = waves_read + u32::from(in_flight.is_some());
                stop = Some((
                    "reading".into(),
                    format!("max_waves {waves} reached"),
                    false,
                ));
            } else if let Some(reason) = operator_pause(&self.plans, snapshot).await? {
                stop = Some(("paused".into(), reason, true));
            } else if let Some(min) = options.min_headroom_hours
                && let Some((state, reason)) = self.headroom_guard(min).await?
            {
                stop = Some((state, reason, true));
            }
            let next = match stop {
                Some(_) => None,
                None => {
                    let wave = done
                        .iter()
                        .map(|(_, wave, _)| *wave)
                        .chain(in_flight.as_ref().map(|w| w.wave))
                        .max()
                        .unwrap_or(0)
                        + 1;
                    let chunks = self
                        .wave_chunks(
                            snapshot,
                            &recorded_plans,
                            wave,
                            &remaining,
                            partitions * rounds,
                            keyset.as_ref(),
                        )
                        .await?;
                    Some((wave, chunks))
                }
            };
            // Commit the wave in flight (bronze append, facts rows) while the next is read.
            let finishing = async {
                match in_flight.take() {
                    Some(wave) => {
                        let clock = Instant::now();
                        let finished = self.finish_wave(snapshot, &plan, wave).await?;
                        tracing::debug!(
                            wave = finished.0,
                            ms = clock.elapsed().as_millis() as u64,
                            "wave committed to bronze and facts"
                        );
                        Ok::<_, WriterError>(Some(finished))
                    }
                    None => Ok(None),
                }
            };
            if let Some((wave, _)) = &next {
                tracing::debug!(
                    wave,
                    ms = between.elapsed().as_millis() as u64,
                    "wave checked and recorded"
                );
            }
            let reading = async {
                match &next {
                    Some((wave, chunks)) => {
                        let clock = Instant::now();
                        let stage = self
                            .read_wave_files(snapshot, *wave, chunks, keyset.as_ref())
                            .await?;
                        tracing::debug!(wave, ms = clock.elapsed().as_millis() as u64, "wave read");
                        Ok(Some((stage, clock.elapsed())))
                    }
                    None => Ok::<_, WriterError>(None),
                }
            };
            let (finished, read) = tokio::join!(finishing, reading);
            if let Some((wave, wave_rows)) = finished? {
                rows_read += wave_rows.iter().map(|(_, rows)| rows).sum::<u64>();
                done.extend(wave_rows.iter().map(|(chunk, rows)| (*chunk, wave, *rows)));
                waves_read += 1;
                let rows_per_second = rows_read as f64 / call.elapsed().as_secs_f64().max(1e-9);
                let rows_left: u64 = plan
                    .iter()
                    .filter(|chunk| !done.iter().any(|(id, ..)| *id == chunk.chunk))
                    .map(|chunk| chunk.rows)
                    .sum();
                on_wave(&WaveProgress {
                    snapshot,
                    wave,
                    chunks_done: done.len() as u64,
                    chunks_total: total,
                    rows: rows_read,
                    rows_per_second,
                    eta_seconds: (rows_per_second > 0.0)
                        .then(|| rows_left as f64 / rows_per_second),
                });
                tracing::info!(%snapshot, wave, chunks_done = done.len(), chunks_total = total,
                    "wave committed");
            }
            match (next, read?) {
                (Some((wave, chunks)), Some((stage, elapsed))) => {
                    let rounds_read = chunks.len().div_ceil(partitions).max(1);
                    let per_round = elapsed.as_secs_f64() / rounds_read as f64;
                    rounds = if per_round > 0.0 {
                        ((options.target_wave_seconds / per_round) as usize).clamp(1, 64)
                    } else {
                        64
                    };
                    in_flight = Some(WaveInFlight {
                        wave,
                        chunks,
                        stage,
                    });
                }
                _ => {
                    let (state, reason, paused) = stop.unwrap_or_default();
                    let complete = plan
                        .iter()
                        .all(|chunk| done.iter().any(|(id, ..)| *id == chunk.chunk));
                    if complete {
                        let rows = done.iter().map(|(_, _, rows)| rows).sum();
                        let resnapshot = recorded.resnapshots.contains(&snapshot);
                        self.complete(snapshot, &plan, rows, resnapshot).await?;
                    }
                    return Ok(BackfillStatus {
                        snapshot: Some(snapshot),
                        chunks_done: done.len() as u64,
                        chunks_total: Some(total),
                        done: complete,
                        paused: !complete && paused,
                        state: if complete { "done".into() } else { state },
                        reason: (!complete).then_some(reason),
                    });
                }
            }
        }
    }

    /// The chunks of `wave`: those its plans rows recorded (a rerun reads exactly them), or
    /// the next `count` remaining ones, recorded before they are read. `recorded` holds the
    /// plans rows as the call began: a wave recorded later by another call is found when its
    /// transaction refuses this call's record.
    async fn wave_chunks(
        &self,
        snapshot: Lsn,
        recorded: &PlansRows,
        wave: i64,
        remaining: &[PlannedChunk],
        count: usize,
        keyset: Option<&KeysetOpen>,
    ) -> Result<Vec<PlannedChunk>> {
        let recorded = recorded.wave(wave);
        if !recorded.is_empty() {
            return Ok(recorded);
        }
        let mut chunks: Vec<PlannedChunk> = remaining.iter().take(count).cloned().collect();
        // A keyset plan's last chunk left open (no key after MAX when planned) ends at the
        // first key after MAX sought now, so the rows the stream inserted above MAX since do
        // not pile into it; the plans row keeps the bound for a rerun.
        if let Some(keyset) = keyset
            && let Some(last) = chunks.last_mut()
            && last.hi.is_none()
            && Some(last.chunk) == remaining.last().map(|chunk| chunk.chunk)
        {
            last.hi = self.last_bound(keyset).await?.map(Bound::Keys);
        }
        let rows = chunks
            .iter()
            .map(|chunk| {
                let mut detail = serde_json::to_value(chunk).unwrap_or_default();
                detail["wave"] = json!(wave);
                ("snapshot_chunk", detail)
            })
            .collect();
        if self
            .append_plans(&self.txn("snapchunks", snapshot), wave, snapshot, rows)
            .await?
        {
            return Ok(chunks);
        }
        // Another call recorded this wave first: its chunks win.
        Ok(self.plans_rows(snapshot).await?.wave(wave))
    }

    /// Reads one wave's chunks into bronze files, not yet committed; or, when bronze already
    /// holds the wave (a rerun after its append), counts its rows there.
    async fn read_wave_files(
        &self,
        snapshot: Lsn,
        wave: i64,
        chunks: &[PlannedChunk],
        keyset: Option<&KeysetOpen>,
    ) -> Result<WaveStage> {
        let bronze_txn = self.txn("snap", snapshot);
        if self.held_by_bronze(&bronze_txn, wave).await? {
            let counted = self
                .count_snapshot_rows(snapshot, Some(chunks.iter().map(|c| c.chunk).collect()))
                .await?;
            return Ok(WaveStage::Held(
                chunks
                    .iter()
                    .map(|chunk| {
                        let found = counted.iter().find(|(id, ..)| *id == Some(chunk.chunk));
                        let stamp = found.and_then(|(_, _, stamp)| *stamp).unwrap_or(snapshot);
                        (
                            chunk.chunk,
                            found.map_or(0, |(_, rows, _)| *rows),
                            stamp,
                            None,
                        )
                    })
                    .collect(),
            ));
        }
        let mut command = SnapshotCommand::new(self.config.table.clone());
        command.chunks = Some(
            chunks
                .iter()
                .map(|chunk| ChunkSpec {
                    chunk: chunk.chunk,
                    lo: chunk.lo.clone(),
                    hi: chunk.hi.clone(),
                })
                .collect(),
        );
        command.keys = keyset.map(KeysetOpen::names);
        Ok(WaveStage::Read(
            self.read_files(snapshot, command, wave).await?,
        ))
    }

    /// Commits a wave read by [`Self::read_wave_files`] (one bronze append unless bronze
    /// holds it), then its facts rows; returns each chunk's rows.
    async fn finish_wave(
        &self,
        snapshot: Lsn,
        plan: &[PlannedChunk],
        in_flight: WaveInFlight,
    ) -> Result<(i64, Vec<(i32, u64)>)> {
        let WaveInFlight {
            wave,
            chunks,
            stage,
        } = in_flight;
        let last_chunk = plan.last().map(|chunk| chunk.chunk);
        let outcome: Vec<(i32, u64, Lsn, Option<Lsn>)> = match stage {
            WaveStage::Held(counted) => counted,
            WaveStage::Read(pending) => {
                let read = self
                    .commit_files(pending, &self.txn("snap", snapshot), wave)
                    .await?;
                crate::stream::crash_point("after_wave_bronze", wave);
                chunks
                    .iter()
                    .zip(read.rows.iter().zip(&read.completions))
                    .map(|(chunk, (rows, completion))| {
                        (
                            chunk.chunk,
                            *rows,
                            completion.snapshot_lsn.unwrap_or(snapshot),
                            completion.max_lsn,
                        )
                    })
                    .collect()
            }
        };
        let rows: Vec<FactsRow> = outcome
            .iter()
            .map(|(chunk, rows, stamp, high)| FactsRow {
                event: Some("snapshot_chunk".into()),
                rows: Some(*rows as i64),
                min_lsn: Some(stamp.to_string()),
                max_lsn: Some(high.unwrap_or(*stamp).to_string()),
                end_lsn: Some(snapshot.to_string()),
                batch_id: Some(wave),
                detail: Some(
                    json!({"snapshot": snapshot, "chunk": chunk, "wave": wave, "last": Some(*chunk) == last_chunk})
                        .to_string(),
                ),
                ..FactsRow::default()
            })
            .collect();
        self.append_facts(&self.txn("snapchunks", snapshot), wave, rows)
            .await?;
        Ok((
            wave,
            outcome
                .iter()
                .map(|(chunk, rows, ..)| (*chunk, *rows))
                .collect(),
        ))
    }

    /// Writes the completion row once every chunk is in, with the chunks' rows.
    async fn complete(
        &self,
        snapshot: Lsn,
        plan: &[PlannedChunk],
        rows: u64,
        resnapshot: bool,
    ) -> Result<()> {
        let event = if resnapshot {
            "resnapshot"
        } else {
            "bootstrap"
        };
        self.append_facts(
            &self.txn("snapdone", snapshot),
            0,
            vec![FactsRow {
                rows: Some(rows as i64),
                detail: Some(
                    json!({"mode": "chunked", "snapshot": snapshot, "chunks": plan.len()})
                        .to_string(),
                ),
                ..snapshot_event(event, snapshot)
            }],
        )
        .await?;
        tracing::info!(table = %self.config.table, %snapshot, rows, event, "chunked snapshot complete");
        Ok(())
    }

    async fn held_by_bronze(&self, txn: &str, version: i64) -> Result<bool> {
        match tables::open(&self.target).await? {
            Some(table) => tables::holds_transaction(&table, txn, version).await,
            None => Ok(false),
        }
    }

    /// `(_chunk, rows, smallest stamp)` of the snapshot's rows in bronze, for some chunks.
    async fn count_snapshot_rows(
        &self,
        snapshot: Lsn,
        chunks: Option<Vec<i32>>,
    ) -> Result<Vec<(Option<i32>, u64, Option<Lsn>)>> {
        let filter = match &chunks {
            Some(chunks) if chunks.is_empty() => return Ok(Vec::new()),
            Some(chunks) => format!(
                " AND _chunk IN ({})",
                chunks
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => String::new(),
        };
        let rows = tables::query_text(
            &self.target,
            &format!(
                "SELECT _chunk, COUNT(*), MIN(_start_lsn) FROM t WHERE _operation = 0 AND \
                 _snapshot = '{snapshot}'{filter} GROUP BY _chunk"
            ),
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                (
                    row[0].as_deref().and_then(|chunk| chunk.parse().ok()),
                    row[1].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0),
                    row[2].as_deref().and_then(|lsn| lsn.parse().ok()),
                )
            })
            .collect())
    }

    /// Reads every endpoint of a snapshot command in parallel into bronze files and commits
    /// them in one append `(txn, version)`; refuses a stream stamped below S (P2).
    async fn read_into_bronze(
        &self,
        snapshot: Lsn,
        command: SnapshotCommand,
        txn: &str,
        version: i64,
    ) -> Result<SnapshotRead> {
        let pending = self.read_files(snapshot, command, version).await?;
        self.commit_files(pending, txn, version).await
    }

    /// Reads every endpoint of a snapshot command in parallel into bronze files, not yet
    /// committed; refuses a stream stamped below S (P2).
    async fn read_files(
        &self,
        snapshot: Lsn,
        command: SnapshotCommand,
        version: i64,
    ) -> Result<PendingFiles> {
        let preparing = Instant::now();
        let plan = self.client.plan_snapshot(&command).await?;
        let schema = Arc::new(
            plan.info
                .clone()
                .try_decode_schema()
                .map_err(|error| WriterError::Internal(format!("snapshot schema: {error}")))?,
        );
        let rows_kind = BronzeRows::Snapshot(snapshot.to_string());
        let empty = RecordBatch::new_empty(Arc::clone(&schema));
        let table = tables::ensure(
            &self.target,
            TableKind::Bronze,
            bronze::fields(&rows_kind.convert(&empty)?.schema())?,
            "bronze",
        )
        .await?;
        let appender = Arc::new(
            bronze::Appender::prepare(table, &schema, &self.config.target, rows_kind).await?,
        );
        tracing::debug!(
            version,
            ms = preparing.elapsed().as_millis() as u64,
            "snapshot read planned, bronze prepared"
        );
        // `partitions` readers, each taking the next endpoint when it is done with one and
        // writing every endpoint it reads into its own Parquet files: a wave of many chunks
        // is read like a full snapshot, with as many streams and as many open files, instead
        // of a stream and a file per chunk (each new file starts its column dictionaries and
        // buffers over). Each chunk is stamped when its read starts; its rows and completion
        // are kept per endpoint, and all files commit together in one append. A reader opens
        // its next endpoint while it drains the current one, so the server has the next
        // chunk's first batches on the way when the current stream ends (a stream opened at
        // each chunk's end left both sides idle for its round trip and first batch, once per
        // chunk); the stamp is still taken before that chunk's read.
        let tickets = plan
            .info
            .endpoint
            .iter()
            .map(|endpoint| {
                endpoint.ticket.clone().ok_or_else(|| {
                    WriterError::Internal("a snapshot endpoint without ticket".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let endpoints = tickets.len();
        let queue = Arc::new(std::sync::Mutex::new(
            tickets
                .into_iter()
                .enumerate()
                .collect::<std::collections::VecDeque<_>>(),
        ));
        let mut readers = Vec::new();
        for _ in 0..(self.config.partitions.max(1) as usize).min(endpoints) {
            let queue = Arc::clone(&queue);
            let client = self.client.clone();
            let mut files = appender.file_writer();
            // Every reader's first endpoint is taken here, so none takes two before another
            // has one.
            let first = queue.lock().map_err(|_| poisoned())?.pop_front();
            let mut upcoming = first.map(|next| OpeningEndpoint::start(&client, next));
            readers.push(tokio::spawn(async move {
                let mut read: Vec<(usize, u64, Completion)> = Vec::new();
                let open_next = || -> Result<Option<(usize, OpeningEndpoint)>> {
                    let next = queue.lock().map_err(|_| poisoned())?.pop_front();
                    Ok(next.map(|next| OpeningEndpoint::start(&client, next)))
                };
                let streamed: Result<()> = async {
                    while let Some((index, opening)) = upcoming.take() {
                        let mut reader = opening.reader().await?;
                        upcoming = open_next()?;
                        let mut rows = 0u64;
                        while let Some(batch) = reader.next_batch().await? {
                            rows += batch.num_rows() as u64;
                            files.write(&batch).await?;
                        }
                        read.push((index, rows, reader.completion()?));
                    }
                    Ok(())
                }
                .await;
                // A stream opened ahead and not read (a failure) is closed by the drop.
                drop(upcoming);
                match streamed {
                    Ok(()) => Ok((read, files.close().await?)),
                    Err(error) => {
                        // The others stop after the endpoint they are reading.
                        if let Ok(mut queue) = queue.lock() {
                            queue.clear();
                        }
                        files.abort().await;
                        Err(error)
                    }
                }
            }));
        }
        let mut by_endpoint: Vec<Option<(u64, Completion)>> =
            (0..endpoints).map(|_| None).collect();
        let mut files = Vec::new();
        for reader in readers {
            let (read, reader_files) = reader
                .await
                .map_err(|error| WriterError::Internal(format!("snapshot read task: {error}")))??;
            for (index, rows, completion) in read {
                by_endpoint[index] = Some((rows, completion));
            }
            files.extend(reader_files);
        }
        let mut out = SnapshotRead::default();
        for read in by_endpoint {
            let (rows, completion) = read
                .ok_or_else(|| WriterError::Internal("a snapshot endpoint was not read".into()))?;
            if let Some(stamp) = completion.snapshot_lsn
                && stamp < snapshot
            {
                return Err(WriterError::invalid(format!(
                    "a snapshot stream was stamped {stamp}, below the snapshot's S {snapshot}: \
                     is the server reading a readable secondary behind the primary? Chunks \
                     must be read where S was recorded"
                )));
            }
            out.rows.push(rows);
            out.completions.push(completion);
        }
        let total: u64 = out.rows.iter().sum();
        let metadata = json!({
            "snapshot": plan.metadata.capture_instance,
            "lsn": snapshot,
            "wave": version,
            "rows": total,
            "chunks": command.chunks.as_ref().map(|chunks| chunks
                .iter()
                .zip(out.rows.iter().zip(&out.completions))
                .map(|(chunk, (rows, completion))| json!({
                    "chunk": chunk.chunk, "lo": chunk.lo, "hi": chunk.hi, "rows": rows,
                    "stamp": completion.snapshot_lsn, "high_lsn": completion.max_lsn,
                    "read_seconds": completion.seconds, "read_mb": completion.bytes as f64 / 1e6,
                }))
                .collect::<Vec<_>>()),
        });
        Ok(PendingFiles {
            appender,
            files,
            read: out,
            total,
            metadata: metadata.to_string(),
        })
    }

    /// Commits files read by [`Self::read_files`] in one bronze append `(txn, version)` (none
    /// when no row was read).
    async fn commit_files(
        &self,
        pending: PendingFiles,
        txn: &str,
        version: i64,
    ) -> Result<SnapshotRead> {
        if pending.total > 0 {
            pending
                .appender
                .commit(pending.files, txn, version, pending.metadata)
                .await?;
        }
        Ok(pending.read)
    }
}

/// An endpoint's stream being opened ahead of its read; dropped unread, it is cancelled.
struct OpeningEndpoint(tokio::task::JoinHandle<Result<mssql_cdc_proto::client::EndpointReader>>);

impl OpeningEndpoint {
    /// Starts opening the stream of endpoint `index`.
    fn start(client: &CdcClient, (index, ticket): (usize, arrow_flight::Ticket)) -> (usize, Self) {
        let client = client.clone();
        let opening = tokio::spawn(async move {
            client
                .open_endpoint(&ticket)
                .await
                .map_err(WriterError::from)
        });
        (index, OpeningEndpoint(opening))
    }

    async fn reader(mut self) -> Result<mssql_cdc_proto::client::EndpointReader> {
        (&mut self.0)
            .await
            .map_err(|error| WriterError::Internal(format!("opening a snapshot stream: {error}")))?
    }
}

impl Drop for OpeningEndpoint {
    fn drop(&mut self) {
        self.0.abort();
    }
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

    /// The chunks recorded for `wave`.
    fn wave(&self, wave: i64) -> Vec<PlannedChunk> {
        self.0
            .iter()
            .filter(|(name, detail)| {
                name == "snapshot_chunk" && detail["wave"].as_i64() == Some(wave)
            })
            .filter_map(|(_, detail)| serde_json::from_value(detail.clone()).ok())
            .collect()
    }
}

/// Bronze files of a snapshot read, written and not yet committed.
struct PendingFiles {
    appender: Arc<bronze::Appender>,
    files: Vec<deltalake::kernel::Add>,
    read: SnapshotRead,
    total: u64,
    metadata: String,
}

/// A wave between its read and its commit.
enum WaveStage {
    /// Read into files, to be appended.
    Read(PendingFiles),
    /// Already in bronze (a rerun after the append): each chunk's `(chunk, rows, stamp, high)`.
    Held(Vec<(i32, u64, Lsn, Option<Lsn>)>),
}

/// The wave read last: committed while the next wave is read.
struct WaveInFlight {
    wave: i64,
    chunks: Vec<PlannedChunk>,
    stage: WaveStage,
}

/// The operator's pause and resume rows of a snapshot in the plans table at `plans`,
/// `(sequence, paused, reason)`, oldest first.
async fn operator_rows(plans: &Url, snapshot: Lsn) -> Result<Vec<(i64, bool, String)>> {
    if tables::open(plans).await?.is_none() {
        return Ok(Vec::new());
    }
    let rows = tables::query_text(
        plans,
        &format!(
            "SELECT event, detail FROM t WHERE snapshot = '{snapshot}' AND event IN \
             ('snapshot_pause', 'snapshot_resume')"
        ),
    )
    .await?;
    let mut parsed: Vec<(i64, bool, String)> = rows
        .into_iter()
        .filter_map(|row| {
            let detail: serde_json::Value =
                serde_json::from_str(row[1].as_deref().unwrap_or("null")).ok()?;
            Some((
                detail["sequence"].as_i64()?,
                row[0].as_deref() == Some("snapshot_pause"),
                detail["reason"].as_str().unwrap_or_default().to_string(),
            ))
        })
        .collect();
    parsed.sort();
    Ok(parsed)
}

/// Why a snapshot is paused by an operator (its newest pause/resume row in the plans table
/// at `plans` is a pause), or `None`.
pub async fn operator_pause(plans: &Url, snapshot: Lsn) -> Result<Option<String>> {
    Ok(operator_rows(plans, snapshot)
        .await?
        .last()
        .filter(|(_, paused, _)| *paused)
        .map(|(_, _, reason)| {
            format!(
                "paused by an operator ({}); `mssql-cdc-writer snapshot resume` resumes it",
                if reason.is_empty() {
                    "no reason given"
                } else {
                    reason
                }
            )
        }))
}

/// What `snapshot status` answers for a table (lake only): its newest snapshot and whether
/// it is open, paused by an operator, or done.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SnapshotState {
    /// S of the newest snapshot; `None` when the table has none.
    pub snapshot: Option<Lsn>,
    /// `full` or `chunked`.
    pub mode: Option<String>,
    /// Chunks with their facts row.
    pub chunks_done: u64,
    /// Chunks planned (`None` before the plan, and for a full snapshot).
    pub chunks_total: Option<u64>,
    /// Whether its completion row is in.
    pub done: bool,
    /// Whether an operator paused it.
    pub paused: bool,
    /// `no_snapshot`, `open`, `paused` or `done`.
    pub state: String,
    /// The operator's reason while paused.
    pub reason: Option<String>,
}

/// The [`SnapshotState`] of the table of `config` (its facts, target and app id).
pub async fn state(config: &StreamConfig) -> Result<SnapshotState> {
    let facts = tables::table_url(&config.facts)?;
    let Some(progress) = progress(&facts, &config.app_id).await? else {
        return Ok(SnapshotState {
            snapshot: None,
            mode: None,
            chunks_done: 0,
            chunks_total: None,
            done: false,
            paused: false,
            state: "no_snapshot".into(),
            reason: None,
        });
    };
    let reason = if progress.done {
        None
    } else {
        let plans = tables::table_url(&plans_location(&config.target))?;
        operator_pause(&plans, progress.snapshot).await?
    };
    Ok(SnapshotState {
        snapshot: Some(progress.snapshot),
        mode: Some(
            match progress.mode {
                SnapshotMode::Full => "full",
                SnapshotMode::Chunked => "chunked",
            }
            .into(),
        ),
        chunks_done: progress.chunks_done,
        chunks_total: progress.chunks_total,
        done: progress.done,
        paused: reason.is_some(),
        state: if progress.done {
            "done"
        } else if reason.is_some() {
            "paused"
        } else {
            "open"
        }
        .into(),
        reason,
    })
}

/// Opens a snapshot of `mode` for the table of `config` (a full one is read now); with
/// `resnapshot`, a chunked re-snapshot even when a complete snapshot exists.
pub async fn open(
    config: &StreamConfig,
    mode: SnapshotMode,
    resnapshot: bool,
) -> Result<SnapshotState> {
    let snapshots = Snapshots::connect(config.clone()).await?;
    match (mode, resnapshot) {
        (SnapshotMode::Full, false) => {
            snapshots.bootstrap_full().await?;
        }
        (SnapshotMode::Full, true) => {
            return Err(WriterError::invalid(
                "re-snapshots are chunked in this release: use --mode chunked --resnapshot",
            ));
        }
        (SnapshotMode::Chunked, false) => {
            snapshots.open_chunked().await?;
        }
        (SnapshotMode::Chunked, true) => {
            snapshots.open_resnapshot().await?;
        }
    }
    state(config).await
}

/// Pauses or resumes the open chunked snapshot of the table of `config`.
pub async fn set_paused(
    config: &StreamConfig,
    paused: bool,
    reason: Option<&str>,
) -> Result<SnapshotState> {
    Snapshots::connect(config.clone())
        .await?
        .set_paused(paused, reason)
        .await?;
    state(config).await
}

/// The newest snapshot of an app id as the facts table records it (lake only).
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotProgress {
    /// Its S.
    pub snapshot: Lsn,
    /// `full` or `chunked`.
    pub mode: SnapshotMode,
    /// Chunks with their facts row (chunked).
    pub chunks_done: u64,
    /// Chunks planned (`None` before the plan, and for a full snapshot).
    pub chunks_total: Option<u64>,
    /// Whether its completion row is in.
    pub done: bool,
}

/// The newest snapshot of `app_id` in the facts table at `facts`, with its progress.
pub async fn progress(facts: &Url, app_id: &str) -> Result<Option<SnapshotProgress>> {
    let rows = tables::query_text(
        facts,
        &format!(
            "SELECT event, min_lsn, detail FROM t WHERE app_id = '{}' AND event IN \
             ('snapshot_open', 'snapshot_plan', 'snapshot_chunk', 'bootstrap', 'resnapshot')",
            quoted(app_id)
        ),
    )
    .await?;
    let detail = |row: &[Option<String>]| -> serde_json::Value {
        serde_json::from_str(row[2].as_deref().unwrap_or("{}")).unwrap_or_default()
    };
    let Some((snapshot, mode)) = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some("snapshot_open"))
        .filter_map(|row| {
            let lsn: Lsn = row[1].as_deref()?.parse().ok()?;
            let mode = match detail(row)["mode"].as_str() {
                Some("chunked") => SnapshotMode::Chunked,
                _ => SnapshotMode::Full,
            };
            Some((lsn, mode))
        })
        .max_by_key(|(lsn, _)| *lsn)
    else {
        return Ok(None);
    };
    let of_snapshot = |row: &&Vec<Option<String>>| {
        detail(row)["snapshot"].as_str() == Some(snapshot.to_string().as_str())
    };
    let chunks_done = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some("snapshot_chunk"))
        .filter(of_snapshot)
        .count() as u64;
    let chunks_total = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some("snapshot_plan"))
        .filter(of_snapshot)
        .find_map(|row| detail(row)["chunk_count"].as_u64());
    let done = rows.iter().any(|row| {
        matches!(row[0].as_deref(), Some("bootstrap" | "resnapshot"))
            && row[1].as_deref() == Some(snapshot.to_string().as_str())
    });
    Ok(Some(SnapshotProgress {
        snapshot,
        mode,
        chunks_done,
        chunks_total,
        done,
    }))
}

/// Bootstraps a stream whose checkpoint is new: takes (or finds) the snapshot of `mode` and
/// sets `config.starting` to its S, so the stream reads the changes after it. A checkpoint
/// that holds a batch is left alone (the stream continues where it was); returns S when a
/// snapshot was taken or found.
pub async fn bootstrap(config: &mut StreamConfig, mode: SnapshotMode) -> Result<Option<Lsn>> {
    if crate::checkpoint::Checkpoint::open(&config.checkpoint)?
        .last()?
        .is_some()
    {
        return Ok(None);
    }
    let snapshots = Snapshots::connect(config.clone()).await?;
    let snapshot = match mode {
        SnapshotMode::Full => snapshots.bootstrap_full().await?.snapshot,
        SnapshotMode::Chunked => snapshots.open_chunked().await?,
    };
    config.starting = snapshot.to_string();
    Ok(Some(snapshot))
}

/// Rows and completion markers of a snapshot read, one per endpoint in plan order.
#[derive(Default)]
struct SnapshotRead {
    rows: Vec<u64>,
    completions: Vec<Completion>,
}

fn poisoned() -> WriterError {
    WriterError::Internal("a snapshot reader panicked while taking an endpoint".into())
}
