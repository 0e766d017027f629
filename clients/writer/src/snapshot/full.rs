//! A full snapshot (ADR 0016): S recorded first, the whole table read in `partitions` streams
//! into one bronze append (`<app_id>#snap.<S>`, version 0), then the `bootstrap` facts row (a
//! full re-snapshot's: `resnapshot`); a rerun finds the row (or the append) and returns S
//! without reading again. Also the bootstrap of a stream whose checkpoint is new.

use std::time::Instant;

use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::protocol::{LsnAnswer, SnapshotCommand};
use serde_json::json;

use super::{FullSnapshot, SnapshotMode, Snapshots, micros_now, snapshot_event};
use crate::error::Result;
use crate::events;
use crate::facts::FactsRow;
use crate::shared_table::SharedTable;
use crate::stream::StreamConfig;

/// Bootstraps a stream whose checkpoint is new: takes (or finds) the snapshot of `mode` and
/// sets `config.starting` to its S, so the stream reads the changes after it. A checkpoint
/// that holds a batch is left alone (the stream continues where it was); returns S when a
/// snapshot was taken or found.
pub async fn bootstrap(config: &mut StreamConfig, mode: SnapshotMode) -> Result<Option<Lsn>> {
    if crate::checkpoint::Checkpoint::open(&config.checkpoint)
        .await?
        .last()
        .await?
        .is_some()
    {
        return Ok(None);
    }
    let snapshots = Snapshots::connect(config.clone()).await?;
    let snapshot = match mode {
        SnapshotMode::Full => snapshots.bootstrap_full().await?.snapshot,
        SnapshotMode::Chunked => snapshots.open_chunked().await?,
    };
    // A completed snapshot older than the one open is silver's base until the open one
    // completes: the stream starts after it, as one not bootstrapped would.
    let start = recorded_start(config).await?.unwrap_or(snapshot);
    config.starting = start.to_string();
    Ok(Some(start))
}

/// Where a stream whose checkpoint is new starts (also when it is not bootstrapped itself):
/// after the S of the newest snapshot the facts record complete for its app id, or, before
/// any completed, of the newest chunked one open and not abandoned (one an operator opened
/// before any stream ran). S's rows and the changes after S rebuild the table (ADR 0028): a
/// stream starting later would lose those between S and its start without meeting the purge
/// that took them (a newer snapshot still open heals that purge, recording its gap). A full
/// snapshot left open by a crash is not a start: it is read again whole, or abandoned once a
/// cleanup passed its S.
pub async fn recorded_start(config: &StreamConfig) -> Result<Option<Lsn>> {
    let facts = SharedTable::of(&crate::tables::table_url(&config.facts)?);
    let recorded = super::recorded::recorded_of(&facts, &config.app_id).await?;
    let completed = recorded.completions.iter().map(|(lsn, _)| *lsn).max();
    Ok(completed.or_else(|| Snapshots::open_chunked_of(&recorded)))
}

impl Snapshots {
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
        let recorded = self.release_expired_full(recorded).await?;
        Self::mode_lock(&recorded, SnapshotMode::Full)?;
        // A full snapshot an earlier run opened and crashed in keeps its S (while cleanup
        // has not passed it).
        let snapshot = match Self::open_full_of(&recorded) {
            Some(open) => open,
            None => self.stamp().await?,
        };
        self.read_full(snapshot, false, 0).await
    }

    /// Takes a **full re-snapshot** of a table that has a complete snapshot: generation n+1
    /// at a new S, read whole now, completed by a `resnapshot` row from which silver is
    /// rebuilt (every key it lacks leaves silver). The stream goes on untouched. A full
    /// re-snapshot a crashed run opened keeps its S; without a complete snapshot this is
    /// the full bootstrap.
    pub async fn resnapshot_full(&self) -> Result<FullSnapshot> {
        let recorded = self.recorded().await?;
        let Some(previous) = recorded.completions.iter().map(|(lsn, _)| *lsn).max() else {
            return self.bootstrap_full().await;
        };
        let recorded = self.release_expired_full(recorded).await?;
        Self::mode_lock(&recorded, SnapshotMode::Full)?;
        let snapshot = match Self::open_full_of(&recorded).filter(|open| *open > previous) {
            Some(open) => open,
            None => {
                let snapshot = self.stamp().await?;
                if snapshot <= previous {
                    return Err(crate::error::WriterError::invalid(format!(
                        "{}: no commit since snapshot {previous} (max_lsn is {snapshot}); a \
                         re-snapshot would read the same rows",
                        self.config.table
                    )));
                }
                snapshot
            }
        };
        let generation = recorded.generation_of(snapshot);
        self.read_full(snapshot, true, generation).await
    }

    /// Records the open of full snapshot S, reads the whole table into one bronze append
    /// (or counts what a crashed run appended) and records its completion.
    async fn read_full(
        &self,
        snapshot: Lsn,
        resnapshot: bool,
        generation: usize,
    ) -> Result<FullSnapshot> {
        let kind = events::completion(resnapshot);
        let detail = json!({"mode": SnapshotMode::Full.as_str(), "kind": kind, "generation": generation,
                "lost_from_ts": null, "lost_to_ts": null});
        self.append_facts(
            &self.txn("snapopen", snapshot),
            0,
            vec![FactsRow {
                rows: Some(0),
                min_commit_ts: self.time_of(snapshot).await?,
                detail: Some(detail.to_string()),
                ..snapshot_event(events::SNAPSHOT_OPEN, snapshot)
            }],
        )
        .await?;
        crate::stream::crash_point("after_snapshot_open", 0);
        let started_at = micros_now();
        let clock = Instant::now();
        let bronze_txn = self.txn("snap", snapshot);
        // Where the read ended (the source's max_lsn after it): history applies the rows
        // once the stream has passed it (docs/silver.md, "History"). A crashed run's read
        // ended before now, so the max_lsn now is past it.
        let (rows, read_end): (u64, Option<Lsn>) = match self.held_by_bronze(&bronze_txn, 0).await?
        {
            true => (
                self.count_snapshot_rows(snapshot, None)
                    .await?
                    .iter()
                    .map(|c| c.1)
                    .sum(),
                self.client
                    .action::<LsnAnswer>("max_lsn", &json!({}))
                    .await?
                    .lsn,
            ),
            false => {
                let mut command = SnapshotCommand::new(self.config.table.clone());
                command.partitions = Some(self.config.partitions.max(1));
                let read = self
                    .read_into_bronze(snapshot, command, &bronze_txn, 0)
                    .await?;
                (
                    read.rows.iter().sum(),
                    read.completions
                        .iter()
                        .filter_map(|completion| completion.max_lsn)
                        .max(),
                )
            }
        };
        self.append_facts(
            &self.txn("snapdone", snapshot),
            0,
            vec![FactsRow {
                rows: Some(rows as i64),
                started_at: Some(started_at),
                duration_ms: Some(clock.elapsed().as_millis() as i64),
                detail: Some(
                    json!({"mode": SnapshotMode::Full.as_str(), "snapshot": snapshot,
                        "read_end": read_end.map(|lsn| lsn.max(snapshot))})
                    .to_string(),
                ),
                ..snapshot_event(kind, snapshot)
            }],
        )
        .await?;
        tracing::info!(table = %self.config.table, %snapshot, rows, kind, "full snapshot complete");
        Ok(FullSnapshot {
            snapshot,
            rows,
            reused: false,
        })
    }
}
