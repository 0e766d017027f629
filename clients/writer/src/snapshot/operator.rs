//! An operator's pause and resume of an open chunked snapshot: rows of the plans table that
//! every backfill checks before it starts a wave, so a pause holds across processes.

use mssql_cdc_proto::Lsn;
use serde_json::json;
use url::Url;

use super::Snapshots;
use super::status::{SnapshotState, state};
use crate::error::{Result, WriterError};
use crate::events;
use crate::stream::StreamConfig;
use crate::tables;

/// The operator's pause and resume rows of a snapshot in the plans table at `plans`,
/// `(sequence, paused, reason)`, oldest first.
pub(super) async fn operator_rows(plans: &Url, snapshot: Lsn) -> Result<Vec<(i64, bool, String)>> {
    if tables::open(plans).await?.is_none() {
        return Ok(Vec::new());
    }
    let rows = tables::query_text(
        plans,
        &format!(
            "SELECT event, detail FROM t WHERE snapshot = '{snapshot}' AND event IN ({})",
            events::sql_list(&[events::SNAPSHOT_PAUSE, events::SNAPSHOT_RESUME])
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
                row[0].as_deref() == Some(events::SNAPSHOT_PAUSE),
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

impl Snapshots {
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
            events::SNAPSHOT_PAUSE
        } else {
            events::SNAPSHOT_RESUME
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
}
