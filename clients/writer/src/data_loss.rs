//! What a table's stream does when changes it needs were purged (`on_data_loss`).
//!
//! `fail` (the default) stops the table with `DataLoss`, naming the range and the fixes.
//! `resnapshot` heals it without an operator, as the seed's generations do (ADR 0028): a
//! chunked re-snapshot is opened at a new S (generation n+1; a chunked bootstrap when there
//! is no complete snapshot yet), a `data_loss` facts row names the lost range `(start, S]`
//! and its times, and the stream resumes at S. The backfill then reads the waves next to the
//! stream; each wave deletes from silver the keys of its chunks' ranges that the source no
//! longer holds, and the completion rebuilds silver, so keys deleted during the gap leave it.
//! (`fail_on_data_loss = false` instead skips to `min_lsn`, losing the changes; see
//! [`crate::stream`].)

use std::str::FromStr;

use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::{CommitTime, Offset};
use serde_json::json;

use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::FactsRow;
use crate::snapshot::{Lost, Snapshots};

/// The policy of one table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDataLoss {
    /// Stop the table.
    #[default]
    Fail,
    /// Re-snapshot it and go on.
    Resnapshot,
}

impl FromStr for OnDataLoss {
    type Err = WriterError;

    fn from_str(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "fail" => Ok(OnDataLoss::Fail),
            "resnapshot" => Ok(OnDataLoss::Resnapshot),
            other => Err(WriterError::invalid(format!(
                "on_data_loss must be fail or resnapshot, not '{other}'"
            ))),
        }
    }
}

/// Opens the re-snapshot (by the stream's `snapshots`) that heals a purge the batch starting
/// at `start` ran into, and
/// returns where the stream resumes (the snapshot's S) with the `data_loss` facts row.
/// A rerun after a crash finds the snapshot it opened and resumes at the same S; a chunked
/// snapshot open from before `start` is superseded (see [`Snapshots::open_healing`]).
pub async fn resnapshot(
    snapshots: &Snapshots,
    client: &CdcClient,
    start: Offset,
    reason: &str,
) -> Result<(Offset, FactsRow)> {
    // An open chunked snapshot heals this purge only when its S is past the purge too: one
    // opened after the stream's position but since passed by a later cleanup needs changes
    // after its S that are gone, and a newer generation supersedes it (resuming at its S
    // ran into the purge again).
    let table = snapshots.table();
    let earliest = client.initial_offset(table, "earliest").await?;
    let min_time: mssql_cdc_proto::protocol::TimeAnswer = client
        .action("lsn_to_time", &json!({"lsn": earliest.lsn.increment()}))
        .await?;
    let lost = Lost {
        at: Some(start.lsn),
        from: start.commit_ts,
        to: min_time.commit_ts,
    };
    let snapshot = snapshots
        .open_healing(start.lsn.max(earliest.lsn), lost)
        .await?;
    let resume = client.initial_offset(table, &snapshot.to_string()).await?;
    tracing::warn!(%table, from = %start.lsn, to = %snapshot,
        "changes purged before they were read: re-snapshot opened, the stream resumes at its S");
    let row = FactsRow {
        event: Some(events::DATA_LOSS.into()),
        rows: Some(0),
        min_lsn: Some(start.lsn.to_string()),
        max_lsn: Some(snapshot.to_string()),
        end_lsn: Some(snapshot.to_string()),
        end_commit_ts: resume.commit_ts.map(CommitTime::micros),
        lost_from_ts: start.commit_ts.map(CommitTime::micros),
        lost_to_ts: resume.commit_ts.map(CommitTime::micros),
        detail: Some(
            json!({"from": start.lsn, "to": snapshot, "snapshot": snapshot, "reason": reason})
                .to_string(),
        ),
        ..FactsRow::default()
    };
    Ok((resume, row))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_parses_its_two_names_and_refuses_others() {
        assert_eq!(
            "Resnapshot".parse::<OnDataLoss>().expect("parse"),
            OnDataLoss::Resnapshot
        );
        assert_eq!(
            "fail".parse::<OnDataLoss>().expect("parse"),
            OnDataLoss::Fail
        );
        let error = "skip".parse::<OnDataLoss>().expect_err("refused");
        assert!(error.to_string().contains("fail or resnapshot"), "{error}");
    }
}
