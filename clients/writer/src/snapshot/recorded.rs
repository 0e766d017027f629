//! The snapshot rows of the facts table, read back: which snapshots were opened (and in which
//! mode, and which were re-snapshots), which completed, which chunks are in, and the newest
//! snapshot's progress. The facts table is the record a rerun trusts.

use mssql_cdc_proto::Lsn;

use super::{SnapshotMode, Snapshots, quoted};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts;
use crate::shared_table::SharedTable;

/// The snapshot facts of one app id, as read back from the lake.
#[derive(Clone, Debug, Default)]
pub(super) struct Recorded {
    /// S of every `snapshot_open` row with its mode.
    pub(super) opens: Vec<(Lsn, SnapshotMode)>,
    /// S of every completion row with its rows.
    pub(super) completions: Vec<(Lsn, u64)>,
    /// S of every snapshot opened as a re-snapshot (generation 1 and later).
    pub(super) resnapshots: Vec<Lsn>,
    /// S of every snapshot abandoned.
    pub(super) abandoned: Vec<Lsn>,
}

/// The facts events [`Recorded`] is read from.
const RECORDED_EVENTS: [&str; 4] = [
    events::SNAPSHOT_OPEN,
    events::BOOTSTRAP,
    events::RESNAPSHOT,
    events::SNAPSHOT_ABANDONED,
];

impl Recorded {
    /// Adds one facts row, `[event, min_lsn, detail, rows]`.
    fn add(&mut self, row: &[Option<String>]) -> Result<()> {
        let (Some(event), Some(lsn)) = (&row[0], &row[1]) else {
            return Ok(());
        };
        let lsn: Lsn = lsn
            .parse()
            .map_err(|error| WriterError::Internal(format!("facts min_lsn: {error}")))?;
        if event == events::SNAPSHOT_OPEN {
            let detail = facts::detail_of(row[2].as_deref());
            let mode = SnapshotMode::of_detail(&detail);
            if detail["kind"].as_str() == Some(events::RESNAPSHOT) {
                self.resnapshots.push(lsn);
            }
            self.opens.push((lsn, mode));
        } else if event == events::SNAPSHOT_ABANDONED {
            self.abandoned.push(lsn);
        } else {
            let rows = row[3].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0);
            self.completions.push((lsn, rows));
        }
        Ok(())
    }

    /// The generation a snapshot at `snapshot` has: how many other snapshots were opened
    /// before it (its own open, when a crashed run recorded it, does not count).
    pub(super) fn generation_of(&self, snapshot: Lsn) -> usize {
        self.opens
            .iter()
            .map(|(lsn, _)| *lsn)
            .filter(|lsn| *lsn != snapshot)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    }
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
    /// Why it was abandoned (changes after its S skipped, or cleanup past the S of a full
    /// snapshot a crash left open), when it was.
    pub abandoned: Option<String>,
    /// When its `snapshot_open` row was written (microseconds since the epoch, UTC).
    pub opened_at: Option<i64>,
}

/// The newest snapshot of `app_id` in the facts table `facts`, with its progress.
pub async fn progress(facts: &SharedTable, app_id: &str) -> Result<Option<SnapshotProgress>> {
    let rows = facts
        .query_text(&format!(
            "SELECT event, min_lsn, detail, CAST(written_at AS BIGINT) FROM t WHERE app_id = '{}' \
             AND event IN ({})",
            quoted(app_id),
            events::sql_list(&[
                events::SNAPSHOT_OPEN,
                events::SNAPSHOT_PLAN,
                events::SNAPSHOT_CHUNK,
                events::BOOTSTRAP,
                events::RESNAPSHOT,
                events::SNAPSHOT_ABANDONED,
            ])
        ))
        .await?;
    let detail = |row: &[Option<String>]| facts::detail_of(row[2].as_deref());
    let Some((snapshot, mode, opened_at)) = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_OPEN))
        .filter_map(|row| {
            let lsn: Lsn = row[1].as_deref()?.parse().ok()?;
            let opened_at = row[3].as_deref().and_then(|micros| micros.parse().ok());
            Some((lsn, SnapshotMode::of_detail(&detail(row)), opened_at))
        })
        .max_by_key(|(lsn, _, _)| *lsn)
    else {
        return Ok(None);
    };
    let of_snapshot = |row: &&Vec<Option<String>>| {
        detail(row)["snapshot"].as_str() == Some(snapshot.to_string().as_str())
    };
    let chunks_done = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_CHUNK))
        .filter(of_snapshot)
        .count() as u64;
    let chunks_total = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_PLAN))
        .filter(of_snapshot)
        .find_map(|row| detail(row)["chunk_count"].as_u64());
    let done = rows.iter().any(|row| {
        row[0]
            .as_deref()
            .is_some_and(|event| events::SNAPSHOT_COMPLETIONS.contains(&event))
            && row[1].as_deref() == Some(snapshot.to_string().as_str())
    });
    let abandoned = rows
        .iter()
        .find(|row| {
            row[0].as_deref() == Some(events::SNAPSHOT_ABANDONED)
                && row[1].as_deref() == Some(snapshot.to_string().as_str())
        })
        .map(|row| {
            detail(row)["reason"]
                .as_str()
                .unwrap_or("no reason recorded")
                .to_string()
        });
    Ok(Some(SnapshotProgress {
        snapshot,
        mode,
        chunks_done,
        chunks_total,
        done,
        abandoned,
        opened_at,
    }))
}

/// The app ids of `facts` with a chunked snapshot open and not complete, read in one query
/// for all of them: a sidecar checks this once per poll instead of each table reading the
/// shared facts table on its own.
pub async fn open_chunked_apps(facts: &SharedTable) -> Result<std::collections::HashSet<String>> {
    let rows = facts
        .query_text(&format!(
            "SELECT app_id, event, min_lsn, detail, rows FROM t WHERE event IN ({})",
            events::sql_list(&RECORDED_EVENTS)
        ))
        .await?;
    let mut by_app: std::collections::HashMap<String, Recorded> = Default::default();
    for row in &rows {
        if let Some(app_id) = &row[0] {
            by_app.entry(app_id.clone()).or_default().add(&row[1..])?;
        }
    }
    Ok(by_app
        .into_iter()
        .filter(|(_, recorded)| Snapshots::open_chunked_of(recorded).is_some())
        .map(|(app_id, _)| app_id)
        .collect())
}

/// What the facts table `facts` records of the snapshots of `app_id`.
pub(super) async fn recorded_of(facts: &SharedTable, app_id: &str) -> Result<Recorded> {
    let rows = facts
        .query_text(&format!(
            "SELECT event, min_lsn, detail, rows FROM t WHERE app_id = '{}' AND event IN ({})",
            quoted(app_id),
            events::sql_list(&RECORDED_EVENTS)
        ))
        .await?;
    let mut recorded = Recorded::default();
    for row in &rows {
        recorded.add(row)?;
    }
    Ok(recorded)
}

impl Snapshots {
    /// What the facts table records of this app id's snapshots.
    pub(super) async fn recorded(&self) -> Result<Recorded> {
        recorded_of(&self.facts, &self.config.app_id).await
    }

    /// The newest chunked snapshot opened and not complete.
    pub(super) fn open_chunked_of(recorded: &Recorded) -> Option<Lsn> {
        recorded
            .opens
            .iter()
            .filter(|(lsn, mode)| {
                *mode == SnapshotMode::Chunked
                    && !recorded.completions.iter().any(|(done, _)| done >= lsn)
                    && !recorded.abandoned.contains(lsn)
            })
            .map(|(lsn, _)| *lsn)
            .max()
    }

    /// Every chunk of `snapshot` whose facts row is in.
    pub(super) async fn chunks_done(&self, snapshot: Lsn) -> Result<Vec<ChunkDone>> {
        let rows = self
            .facts
            .query_text(&format!(
                "SELECT detail, rows, min_lsn FROM t WHERE app_id = '{}' AND event = '{}' AND min_lsn >= '{snapshot}'",
                quoted(&self.config.app_id),
                events::SNAPSHOT_CHUNK
            ))
            .await?;
        let mut done = Vec::new();
        for row in rows {
            let detail = facts::detail_of(row[0].as_deref());
            if detail["snapshot"].as_str() == Some(&snapshot.to_string()) {
                done.push(ChunkDone {
                    chunk: detail["chunk"].as_i64().unwrap_or(-1) as i32,
                    wave: detail["wave"].as_i64().unwrap_or(0),
                    rows: row[1].as_deref().and_then(|n| n.parse().ok()).unwrap_or(0),
                    stamp: row[2]
                        .as_deref()
                        .and_then(|lsn| lsn.parse().ok())
                        .unwrap_or(snapshot),
                });
            }
        }
        Ok(done)
    }
}

/// A chunk whose facts row is in: its wave, rows, and the stamp its read was taken at (its
/// row's `min_lsn`).
#[derive(Clone, Copy, Debug)]
pub(super) struct ChunkDone {
    pub(super) chunk: i32,
    pub(super) wave: i64,
    pub(super) rows: u64,
    pub(super) stamp: Lsn,
}
