//! What `snapshot status` answers for a table: its newest snapshot and whether it is open,
//! paused by an operator, or done (lake only).

use mssql_cdc_proto::Lsn;
use serde::Serialize;

use super::operator::operator_pause;
use super::plans_location;
use super::recorded::progress;
use crate::error::Result;
use crate::stream::StreamConfig;
use crate::tables;

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
        mode: Some(progress.mode.as_str().into()),
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
