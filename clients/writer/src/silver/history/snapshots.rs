//! What history reads of the facts: how far the stream has read, and every snapshot of the
//! bronze table with what it takes for its rows to be applied.
//!
//! A snapshot row stamped L was read at some moment between L and the end of its read (the
//! source's `max_lsn` after it, `R`): it may already hold a change committed after L. History
//! applies a snapshot's rows only once the stream has read past R ("ripe"): a key with a
//! change after S in bronze then takes its state at S from that change's before-image,
//! which is exact, and a key without one was the same from S to R, so the row is its state
//! at S.

use std::collections::HashMap;

use url::Url;

use super::super::text;
use crate::error::Result;
use crate::events;
use crate::facts;
use crate::snapshot::SnapshotMode;
use crate::tables;

/// One snapshot of bronze, as its facts rows tell it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Snapshot {
    /// S: the LSN every row of the snapshot is positioned at (`_snapshot`, or a full
    /// snapshot's `_start_lsn` in older lakes).
    pub(super) lsn: String,
    /// Chunked: its rows carry `_chunk`, read in waves.
    pub(super) chunked: bool,
    /// Its completion row is recorded.
    pub(super) complete: bool,
    /// Where a full snapshot's read ended (`read_end` of its completion); `None` in lakes
    /// written before it was recorded: such a snapshot is taken as read at S.
    pub(super) read_end: Option<String>,
    /// A chunked snapshot's chunks recorded in the facts, in wave order.
    pub(super) chunks: Vec<Chunk>,
}

/// One chunk of a chunked snapshot, as its `snapshot_chunk` facts row tells it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Chunk {
    pub(super) chunk: i32,
    pub(super) wave: i32,
    /// The source's `max_lsn` after the chunk's read (else its stamp).
    pub(super) read_end: String,
}

impl Snapshot {
    /// Whether the stream (read to `end`) has passed the end of every read of this
    /// snapshot's rows `rows` (its whole, or some of its chunks).
    pub(super) fn ripe<'a>(
        &self,
        end: Option<&str>,
        mut chunks: impl Iterator<Item = &'a Chunk>,
    ) -> bool {
        let passed = |read_end: &str| end.is_some_and(|end| end >= read_end);
        if self.chunked {
            chunks.all(|chunk| passed(&chunk.read_end))
        } else {
            self.read_end.as_deref().is_none_or(passed)
        }
    }
}

/// What the facts say of bronze `bronze`.
#[derive(Debug, Default)]
pub(super) struct Facts {
    /// The end of the stream's last batch recorded: every change up to it is in bronze.
    pub(super) end: Option<String>,
    /// The snapshots whose rows history applies, oldest first: the complete ones, then the
    /// open one (the newest opened with no completion at or after it, not abandoned; full
    /// or chunked). A snapshot superseded before it completed is never applied.
    pub(super) snapshots: Vec<Snapshot>,
    /// The S of every snapshot opened or completed, superseded and abandoned ones too:
    /// where a change whose before-image disagrees with history places what bronze lacks.
    pub(super) points: Vec<String>,
    /// The commit time of each S its open recorded.
    pub(super) times: HashMap<String, i64>,
}

impl Facts {
    /// The S of the newest snapshot at or before `lsn` and after `after`: where a change at
    /// `lsn` whose before-image disagrees with the history places the change bronze lacks.
    pub(super) fn snapshot_between(&self, after: Option<&str>, lsn: &str) -> Option<&str> {
        self.points
            .iter()
            .rev()
            .map(String::as_str)
            .find(|s| *s <= lsn)
            .filter(|s| after.is_none_or(|after| *s > after))
    }
}

pub(super) async fn read(facts: &Url, bronze: &str) -> Result<Facts> {
    let end = tables::query_text(
        facts,
        &format!(
            "SELECT MAX(end_lsn) FROM t WHERE target = {} AND event IS NULL",
            text(bronze)
        ),
    )
    .await?
    .into_iter()
    .next()
    .and_then(|row| row[0].clone());
    let rows = tables::query_text(
        facts,
        &format!(
            "SELECT event, min_lsn, max_lsn, detail, CAST(min_commit_ts AS BIGINT) FROM t \
             WHERE target = {} AND event IN ({})",
            text(bronze),
            events::sql_list(&[
                events::SNAPSHOT_OPEN,
                events::SNAPSHOT_CHUNK,
                events::BOOTSTRAP,
                events::RESNAPSHOT,
                events::SNAPSHOT_ABANDONED,
            ])
        ),
    )
    .await?;
    let times = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_OPEN))
        .filter_map(|row| Some((row[1].clone()?, row[4].as_deref()?.parse().ok()?)))
        .collect();
    Ok(Facts {
        end,
        snapshots: snapshots_of(&rows),
        points: points_of(&rows),
        times,
    })
}

/// The S of every open and completion among the facts rows `[event, min_lsn, ...]`.
fn points_of(rows: &[Vec<Option<String>>]) -> Vec<String> {
    let mut points: Vec<String> = rows
        .iter()
        .filter(|row| {
            row[0].as_deref().is_some_and(|event| {
                event == events::SNAPSHOT_OPEN || events::SNAPSHOT_COMPLETIONS.contains(&event)
            })
        })
        .filter_map(|row| row[1].clone())
        .collect();
    points.sort();
    points.dedup();
    points
}

/// The snapshots the facts rows `[event, min_lsn, max_lsn, detail]` record.
fn snapshots_of(rows: &[Vec<Option<String>>]) -> Vec<Snapshot> {
    let of = |event: &'static str| {
        rows.iter()
            .filter(move |row| row[0].as_deref() == Some(event))
            .filter_map(|row| {
                Some((
                    row[1].clone()?,
                    row[2].clone(),
                    facts::detail_of(row[3].as_deref()),
                ))
            })
    };
    let abandoned: Vec<String> = of(events::SNAPSHOT_ABANDONED).map(|(s, ..)| s).collect();
    let mut snapshots: Vec<Snapshot> = Vec::new();
    for event in events::SNAPSHOT_COMPLETIONS {
        for (lsn, _, detail) in of(event) {
            snapshots.push(Snapshot {
                chunked: detail["mode"].as_str() == Some(SnapshotMode::Chunked.as_str()),
                complete: true,
                read_end: detail["read_end"].as_str().map(str::to_string),
                chunks: Vec::new(),
                lsn,
            });
        }
    }
    // The open one: the newest open, unless a completion at or after it or an abandon
    // closed it (an older open a newer one superseded is never applied).
    if let Some((lsn, _, detail)) = of(events::SNAPSHOT_OPEN).max_by(|a, b| a.0.cmp(&b.0))
        && !abandoned.contains(&lsn)
        && !snapshots.iter().any(|done| done.lsn >= lsn)
    {
        snapshots.push(Snapshot {
            chunked: SnapshotMode::of_detail(&detail) == SnapshotMode::Chunked,
            lsn,
            complete: false,
            read_end: None,
            chunks: Vec::new(),
        });
    }
    for (stamp, read_end, detail) in of(events::SNAPSHOT_CHUNK) {
        let Some(snapshot) = snapshots
            .iter_mut()
            .find(|snapshot| detail["snapshot"].as_str() == Some(snapshot.lsn.as_str()))
        else {
            continue;
        };
        let chunk = detail["chunk"].as_i64().unwrap_or(-1) as i32;
        if !snapshot.chunks.iter().any(|known| known.chunk == chunk) {
            snapshot.chunks.push(Chunk {
                chunk,
                wave: detail["wave"].as_i64().unwrap_or(0) as i32,
                read_end: read_end.unwrap_or(stamp),
            });
        }
    }
    for snapshot in &mut snapshots {
        snapshot
            .chunks
            .sort_by_key(|chunk| (chunk.wave, chunk.chunk));
    }
    snapshots.sort_by(|a, b| a.lsn.cmp(&b.lsn));
    snapshots.dedup_by(|a, b| a.lsn == b.lsn);
    snapshots
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(event: &str, min: &str, max: &str, detail: &str) -> Vec<Option<String>> {
        vec![
            Some(event.into()),
            Some(min.into()),
            Some(max.into()),
            Some(detail.into()),
        ]
    }

    #[test]
    fn snapshots_are_read_from_completions_opens_and_chunks() {
        let rows = vec![
            row("snapshot_open", "0x10", "0x10", r#"{"mode":"full"}"#),
            row(
                "bootstrap",
                "0x10",
                "0x10",
                r#"{"mode":"full","snapshot":"0x10","read_end":"0x14"}"#,
            ),
            row("snapshot_open", "0x30", "0x30", r#"{"mode":"chunked"}"#),
            row(
                "snapshot_chunk",
                "0x31",
                "0x35",
                r#"{"snapshot":"0x30","chunk":1,"wave":2}"#,
            ),
            row(
                "snapshot_chunk",
                "0x30",
                "0x33",
                r#"{"snapshot":"0x30","chunk":0,"wave":1}"#,
            ),
            row("snapshot_open", "0x20", "0x20", r#"{"mode":"chunked"}"#),
            row("snapshot_abandoned", "0x20", "0x20", "{}"),
        ];
        let snapshots = snapshots_of(&rows);
        assert_eq!(snapshots.len(), 2, "{snapshots:?}");
        assert_eq!(snapshots[0].read_end.as_deref(), Some("0x14"));
        assert!(snapshots[0].complete && !snapshots[0].chunked);
        let open = &snapshots[1];
        assert!(open.chunked && !open.complete);
        assert_eq!(
            open.chunks
                .iter()
                .map(|c| (c.chunk, c.read_end.as_str()))
                .collect::<Vec<_>>(),
            [(0, "0x33"), (1, "0x35")]
        );
        assert!(open.ripe(Some("0x35"), open.chunks.iter()));
        assert!(!open.ripe(Some("0x34"), open.chunks.iter()));
        assert!(open.ripe(Some("0x34"), open.chunks.iter().take(1)));
        assert!(!snapshots[0].ripe(None, std::iter::empty()));
        // A newer open supersedes an older one never completed; every S is a point.
        let mut superseded = rows.clone();
        superseded.push(row("snapshot_open", "0x40", "0x40", r#"{"mode":"full"}"#));
        let newer = snapshots_of(&superseded);
        assert_eq!(
            newer
                .iter()
                .map(|s| (s.lsn.as_str(), s.chunked, s.complete))
                .collect::<Vec<_>>(),
            [("0x10", false, true), ("0x40", false, false)]
        );
        assert_eq!(points_of(&superseded), ["0x10", "0x20", "0x30", "0x40"]);
        let facts = Facts {
            end: None,
            points: points_of(&rows),
            snapshots,
            ..Facts::default()
        };
        assert_eq!(facts.snapshot_between(None, "0x2f"), Some("0x20"));
        assert_eq!(facts.snapshot_between(Some("0x20"), "0x2f"), None);
        assert_eq!(facts.snapshot_between(Some("0x12"), "0x30"), Some("0x30"));
    }
}
