//! What `snapshot status` answers for a table: its newest snapshot and whether it is open,
//! paused by an operator, or done (lake only).

use serde::Serialize;

use super::operator::operator_pause;
use super::recorded::progress;
use super::{BackfillStatus, plans_location};
use crate::error::Result;
use crate::shared_table::SharedTable;
use crate::stream::StreamConfig;
use crate::tables;

/// What `snapshot status` answers for a table (lake only): its newest snapshot's mode and
/// where it stands (`state`: `no_snapshot`, `open`, `paused`, `done` or `abandoned`; `paused`
/// when an operator paused it, with the operator's reason).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SnapshotState {
    /// `full` or `chunked`.
    pub mode: Option<String>,
    /// Where it stands, in the fields a backfill answers.
    #[serde(flatten)]
    pub status: BackfillStatus,
}

/// The [`SnapshotState`] of the table of `config` (its facts, target and app id).
pub async fn state(config: &StreamConfig) -> Result<SnapshotState> {
    let facts = tables::table_url(&config.facts)?;
    let Some(progress) = progress(&SharedTable::of(&facts), &config.app_id).await? else {
        return Ok(SnapshotState {
            mode: None,
            status: BackfillStatus::no_snapshot(),
        });
    };
    let reason = if progress.done {
        None
    } else if let Some(why) = &progress.abandoned {
        Some(format!("abandoned: {why}; open a new snapshot"))
    } else {
        let plans = tables::table_url(&plans_location(&config.target))?;
        operator_pause(&plans, progress.snapshot).await?
    };
    Ok(SnapshotState {
        mode: Some(progress.mode.as_str().into()),
        status: BackfillStatus {
            snapshot: Some(progress.snapshot),
            chunks_done: progress.chunks_done,
            chunks_total: progress.chunks_total,
            done: progress.done,
            paused: reason.is_some() && progress.abandoned.is_none(),
            state: if progress.done {
                "done"
            } else if progress.abandoned.is_some() {
                "abandoned"
            } else if reason.is_some() {
                "paused"
            } else {
                "open"
            }
            .into(),
            reason,
        },
    })
}
