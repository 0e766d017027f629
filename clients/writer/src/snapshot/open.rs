//! Opening a chunked snapshot (or a re-snapshot, its next generation): S and the key's extent
//! (or the keyset and its largest key) recorded in the plans table with a `snapshot_open`
//! facts row, before any chunk is read; the stream may start at S at once.

use mssql_cdc_proto::catalog::KeyExtent;
use mssql_cdc_proto::protocol::KeyMaxAnswer;
use mssql_cdc_proto::{CommitTime, Lsn};
use serde_json::json;

use super::recorded::Recorded;
use super::status::{SnapshotState, state};
use super::{KeysetOpen, SnapshotMode, Snapshots, seed_layout, snapshot_event};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::FactsRow;
use crate::stream::StreamConfig;

/// What a re-snapshot that heals a purge lost, in its `snapshot_open` payload as the seed's:
/// the commit time (UTC) of the last offset processed and of the `min_lsn` cleanup had got
/// to (`null` on other opens), and where the stream stood.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lost {
    /// The stream's position; `None` on an open that heals nothing.
    pub at: Option<Lsn>,
    /// The commit time of the stream's position.
    pub from: Option<mssql_cdc_proto::CommitTime>,
    /// The commit time of `min_lsn`.
    pub to: Option<mssql_cdc_proto::CommitTime>,
}

/// The `reason` a healing re-snapshot's `snapshot_open` payload carries: the anti-loop guard
/// measures from the newest such open.
pub(super) const HEALING_REASON: &str = "data_loss";

/// The facts transaction (`<app_id>#snapgen`, version = generation) of a chunked open.
const GENERATION_TXN: &str = "snapgen";

/// Opens a snapshot of `mode` for the table of `config` (a full one is read now); with
/// `resnapshot`, a chunked re-snapshot even when a complete snapshot exists.
pub async fn open(
    config: &StreamConfig,
    mode: SnapshotMode,
    resnapshot: bool,
) -> Result<SnapshotState> {
    use backon::Retryable;
    let snapshots = Snapshots::connect(config.clone()).await?;
    // Each way finds what an earlier try recorded (an open S, a full read's bronze append),
    // so a server that fails in passing is met by opening again.
    let opening = || async {
        match (mode, resnapshot) {
            (SnapshotMode::Full, false) => snapshots.bootstrap_full().await.map(drop),
            (SnapshotMode::Full, true) => snapshots.resnapshot_full().await.map(drop),
            (SnapshotMode::Chunked, false) => snapshots.open_chunked().await.map(drop),
            (SnapshotMode::Chunked, true) => snapshots.open_resnapshot().await.map(drop),
        }
    };
    opening
        .retry(crate::retry::server_retries())
        .when(WriterError::is_redoable)
        .notify(|error: &WriterError, wait| {
            crate::retry::log("the snapshot's open", &config.table, error, wait);
        })
        .await?;
    state(config).await
}

impl Snapshots {
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
        self.open_chunked_generation(&recorded, None, Lost::default(), None)
            .await
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
            return self
                .open_chunked_generation(&recorded, None, Lost::default(), None)
                .await;
        };
        self.open_chunked_generation(&recorded, Some(previous), Lost::default(), None)
            .await
    }

    /// Opens the chunked snapshot `snapshot_on_switch` takes after batch `batch_id` first read
    /// a newer capture instance, so that rows unchanged since carry the columns only it
    /// captures. As the seed's, its open names the batch (`switch_batch_id`) and its kind is
    /// `bootstrap` (no change was lost), so its completion is a `bootstrap` row; unlike the
    /// seed's, its S is `max_lsn` now, as any re-snapshot's. An open chunked snapshot is
    /// returned as it is.
    pub async fn open_on_switch(&self, batch_id: i64) -> Result<Lsn> {
        let recorded = self.recorded().await?;
        if let Some(open) = Self::open_chunked_of(&recorded) {
            return Ok(open);
        }
        let previous = recorded.completions.iter().map(|(lsn, _)| *lsn).max();
        self.open_chunked_generation(&recorded, previous, Lost::default(), Some(batch_id))
            .await
    }

    /// The chunked snapshot that heals a purge the stream met at `position`: one opened
    /// after `position` (this heal's own, found again by a rerun), else a new generation.
    /// A chunked snapshot opened at or before `position` is superseded by it, as ADR 0028
    /// requires: the purged changes after its S are ones its rebuild needed, and the newer
    /// generation's completion closes it.
    /// A new one is opened only past the seed's anti-loop guard ([`Snapshots::healing_guard`]).
    pub async fn open_healing(&self, position: Lsn, lost: Lost) -> Result<Lsn> {
        let recorded = self.recorded().await?;
        if let Some(open) = Self::open_chunked_of(&recorded)
            && open > position
        {
            return Ok(open);
        }
        self.healing_guard(lost.at.unwrap_or(position)).await?;
        let previous = recorded.completions.iter().map(|(lsn, _)| *lsn).max();
        self.open_chunked_generation(&recorded, previous, lost, None)
            .await
    }

    /// Records a new chunked snapshot: generation 0, or a re-snapshot after `previous`.
    pub(super) async fn open_chunked_generation(
        &self,
        recorded: &Recorded,
        previous: Option<Lsn>,
        lost: Lost,
        switch_batch_id: Option<i64>,
    ) -> Result<Lsn> {
        let released = self.release_expired_full(recorded.clone()).await?;
        let recorded = &released;
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
        let generation = recorded.generation_of(snapshot);
        // A switch's snapshot is a bootstrap, as the seed's: it fills columns, nothing was lost.
        let kind = events::completion(previous.is_some() && switch_batch_id.is_none());
        // The columns to cut on, checked and typed by the server, and MAX read after S.
        let cut: KeyMaxAnswer = self
            .client
            .action(
                "key_max",
                &json!({"table": self.config.table, "keys": self.config.snapshot_keys}),
            )
            .await?;
        let extent = match cut.keys.as_slice() {
            // One integer unique key: chunks packed from counted slices.
            [key] if cut.unique && key.is_integer() => {
                let extent: KeyExtent = self
                    .client
                    .action("key_extent", &json!({"table": self.config.table}))
                    .await?;
                serde_json::to_value(&extent).unwrap_or_default()
            }
            _ => {
                let open = KeysetOpen {
                    kind: "keyset".into(),
                    keys: cut.keys,
                    unique: cut.unique,
                    max: cut.max,
                };
                serde_json::to_value(&open).unwrap_or_default()
            }
        };
        // The key names live in the plans row: the seed takes a facts open that carries
        // them for an old release's whole payload.
        let mut payload = healing_detail(
            json!({"mode": SnapshotMode::Chunked.as_str(), "kind": kind, "generation": generation,
                "lost_from_ts": lost.from, "lost_to_ts": lost.to}),
            &lost,
        );
        if let Some(batch_id) = switch_batch_id {
            payload["switch_batch_id"] = json!(batch_id);
        }
        // The columns its waves read: whoever reads them later reads these or none.
        let serve = self.columns.serve();
        let open_row = seed_layout::open_row(
            &payload,
            extent,
            &[
                ("columns", json!(serve.columns)),
                ("except_columns", json!(serve.except_columns)),
            ],
        );
        // Plans first: the key values live beside bronze, not in the facts.
        self.append_plans(
            &self.txn("snapopen", snapshot),
            0,
            snapshot,
            vec![(events::SNAPSHOT_OPEN, open_row)],
        )
        .await?;
        // The facts row is the open, keyed by its generation: of two opens racing for one
        // generation (two writers healing the same loss) Delta lets one commit; the other
        // finds it and takes its S. Its plans row stays unread (rows are read by S).
        let opened = self
            .append_facts(
                &format!("{}#{GENERATION_TXN}", self.config.app_id),
                i64::try_from(generation).unwrap_or(i64::MAX),
                vec![FactsRow {
                    rows: Some(0),
                    detail: Some(payload.to_string()),
                    min_commit_ts: self.time_of(snapshot).await?,
                    // As the seed's: the heal's gap on its open row, which its completion copies.
                    lost_from_ts: lost.from.map(CommitTime::micros),
                    lost_to_ts: lost.to.map(CommitTime::micros),
                    ..snapshot_event(events::SNAPSHOT_OPEN, snapshot)
                }],
            )
            .await?;
        if !opened {
            let winner = Self::open_chunked_of(&self.recorded().await?).ok_or_else(|| {
                WriterError::Internal(format!(
                    "{}: generation {generation} is recorded but no open snapshot holds it",
                    self.config.table
                ))
            })?;
            tracing::info!(table = %self.config.table, snapshot = %winner, generation,
                "another writer opened this generation first: its snapshot is taken");
            return Ok(winner);
        }
        tracing::info!(table = %self.config.table, %snapshot, kind, generation, "chunked snapshot opened");
        Ok(snapshot)
    }
}

impl Snapshots {
    /// The seed's anti-loop guard (`resnapshot_interval_days`, 7 days by default, 0 off): a
    /// purge met less than that after the last heal stops the table with
    /// `ResnapshotRefused` instead of re-snapshotting again. The last heal is the newest
    /// healing `snapshot_open` row (written when the re-snapshot opens, before the batch that
    /// records its `data_loss` row, as the seed's state time) or `data_loss` row (a lake of an
    /// earlier release) whose S is at or below `position`, where the stream stood: a heal of
    /// this very purge (S past it), which a second writer opened first, is not a last one. A stream that keeps falling behind the CDC retention would otherwise
    /// re-snapshot for ever; the operator fixes the cause and reruns with the guard at 0.
    async fn healing_guard(&self, position: Lsn) -> Result<()> {
        let days = self
            .config
            .resnapshot_interval_days
            .unwrap_or(DEFAULT_RESNAPSHOT_INTERVAL_DAYS);
        if days <= 0.0 {
            return Ok(());
        }
        let rows = self
            .facts
            .query_text(&format!(
                "SELECT CAST(MAX(written_at) AS BIGINT) FROM t WHERE app_id = '{}' AND \
                 ((event = '{}' AND max_lsn <= '{position}') OR (event = '{}' AND \
                 min_lsn <= '{position}' AND detail LIKE '%\"reason\":\"{HEALING_REASON}\"%'))",
                super::quoted(&self.config.app_id),
                events::DATA_LOSS,
                events::SNAPSHOT_OPEN,
            ))
            .await?;
        let last = rows
            .first()
            .and_then(|row| row.first().cloned().flatten())
            .and_then(|micros| micros.parse().ok())
            .map(mssql_cdc_proto::CommitTime);
        let Some(last) = last else {
            return Ok(());
        };
        let now = chrono::Utc::now().timestamp_micros();
        let age = (now - last.micros()) as f64 / 86_400e6;
        if age >= days {
            return Ok(());
        }
        Err(WriterError::ResnapshotRefused {
            table: self.config.table.clone(),
            message: format!(
                "changes after {position}, where the stream stood, were purged by CDC cleanup \
                 before they were read, and the last automatic re-snapshot healed a purge \
                 {age:.3} days ago ({last}), less than resnapshot_interval_days = {days}: the \
                 stream does not keep up with the CDC retention, or stops for longer than it, \
                 again. Fix that, then rerun once with resnapshot_interval_days = 0 \
                 (--resnapshot-interval-days 0) to re-snapshot now"
            ),
        })
    }
}

/// `detail` with the healing `reason` when `lost` is a heal's.
fn healing_detail(mut detail: serde_json::Value, lost: &Lost) -> serde_json::Value {
    if lost.at.is_some() {
        detail["reason"] = json!(HEALING_REASON);
    }
    detail
}

/// The seed's default of `resnapshot_interval_days`.
pub const DEFAULT_RESNAPSHOT_INTERVAL_DAYS: f64 = 7.0;
