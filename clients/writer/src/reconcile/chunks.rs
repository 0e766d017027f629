//! Chunk checks of the newest chunked snapshot of bronze (seed ADR 0028 "Validation"):
//! its plan tiles the key range from below every key to the end recorded at its open, bronze holds the rows each chunk's facts row counts, and
//! every chunk was stamped at or after the snapshot's S. They read only the lake: the facts
//! table, the plans table beside bronze, and bronze.

use std::collections::BTreeMap;

use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::keys::Bound;
use serde::{Deserialize, Serialize};

use crate::error::{Result, WriterError};
use crate::events;
use crate::facts;
use crate::snapshot::{PlannedChunk, SnapshotMode, plans_location, seed_layout};
use crate::tables;

/// What a chunk check found wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChunkCheck {
    /// The plan's chunks do not tile the key range, or a chunk was read over other bounds.
    #[serde(rename = "CHUNK_TILING")]
    Tiling,
    /// Bronze does not hold the rows a chunk's facts row counts.
    #[serde(rename = "CHUNK_ROWS")]
    Rows,
    /// A chunk was stamped below the snapshot's S.
    #[serde(rename = "CHUNK_STAMP")]
    Stamp,
}

impl ChunkCheck {
    /// Every check, in report order.
    pub const ALL: [ChunkCheck; 3] = [ChunkCheck::Tiling, ChunkCheck::Rows, ChunkCheck::Stamp];

    /// The name in the report (`failure_type`).
    pub fn name(self) -> &'static str {
        match self {
            ChunkCheck::Tiling => "CHUNK_TILING",
            ChunkCheck::Rows => "CHUNK_ROWS",
            ChunkCheck::Stamp => "CHUNK_STAMP",
        }
    }
}

/// One chunk check that failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkFinding {
    /// The check.
    pub check: ChunkCheck,
    /// The snapshot's S.
    pub snapshot: Lsn,
    /// The chunk, when the finding is about one.
    pub chunk: Option<i32>,
    /// What is wrong, in words.
    pub finding: String,
}

/// A chunk's facts row.
struct ChunkFacts {
    rows: u64,
    stamp: Option<Lsn>,
}

/// Checks the newest chunked snapshot recorded for `bronze` in `facts`; `None` when no
/// chunked snapshot was ever opened for it.
pub(super) async fn check(
    facts_location: &str,
    bronze: &str,
) -> Result<Option<(Lsn, Vec<ChunkFinding>)>> {
    let facts_url = tables::table_url(facts_location)?;
    let target = tables::quote_text(bronze);
    let opens = tables::query_text(
        &facts_url,
        &format!(
            "SELECT min_lsn, detail FROM t WHERE target = {target} AND event = '{}'",
            events::SNAPSHOT_OPEN
        ),
    )
    .await?;
    let Some(snapshot) = opens
        .iter()
        .filter(|row| {
            SnapshotMode::of_detail(&facts::detail_of(row[1].as_deref())) == SnapshotMode::Chunked
        })
        .filter_map(|row| row[0].as_deref()?.parse::<Lsn>().ok())
        .max()
    else {
        return Ok(None);
    };
    let mut findings = Vec::new();
    let mut finding = |check: ChunkCheck, chunk: Option<i32>, text: String| {
        findings.push(ChunkFinding {
            check,
            snapshot,
            chunk,
            finding: text,
        });
    };

    // The facts rows of its chunks (their key values are in the plans table).
    let mut chunk_facts: BTreeMap<i32, ChunkFacts> = BTreeMap::new();
    for row in tables::query_text(
        &facts_url,
        &format!(
            "SELECT detail, rows, min_lsn FROM t WHERE target = {target} AND event = '{}'",
            events::SNAPSHOT_CHUNK
        ),
    )
    .await?
    {
        let detail = facts::detail_of(row[0].as_deref());
        if detail["snapshot"].as_str() != Some(snapshot.to_string().as_str()) {
            continue;
        }
        let Some(chunk) = detail["chunk"].as_i64().map(|chunk| chunk as i32) else {
            finding(
                ChunkCheck::Rows,
                None,
                "a snapshot_chunk facts row names no chunk".into(),
            );
            continue;
        };
        let facts_row = ChunkFacts {
            rows: row[1]
                .as_deref()
                .and_then(|rows| rows.parse().ok())
                .unwrap_or(0),
            stamp: row[2].as_deref().and_then(|lsn| lsn.parse().ok()),
        };
        if chunk_facts.insert(chunk, facts_row).is_some() {
            finding(
                ChunkCheck::Rows,
                Some(chunk),
                format!("chunk {chunk} has two facts rows"),
            );
        }
    }

    // The plan and the bounds each chunk was read over.
    let plans_url = tables::table_url(&plans_location(bronze))?;
    let mut plan: Option<Vec<PlannedChunk>> = None;
    let mut read: BTreeMap<i32, PlannedChunk> = BTreeMap::new();
    for row in tables::query_text(
        &plans_url,
        &format!("SELECT event, detail FROM t WHERE snapshot = '{snapshot}'"),
    )
    .await?
    {
        let detail: serde_json::Value =
            serde_json::from_str(row[1].as_deref().unwrap_or("null"))
                .map_err(|error| WriterError::Internal(format!("plans detail: {error}")))?;
        match row[0].as_deref() {
            Some(events::SNAPSHOT_PLAN) => {
                plan = Some(
                    serde_json::from_value(seed_layout::plan_chunks(&detail).clone()).map_err(
                        |error| WriterError::Internal(format!("the plan's chunks: {error}")),
                    )?,
                );
            }
            Some(events::SNAPSHOT_CHUNK) => {
                let chunk: PlannedChunk = serde_json::from_value(
                    seed_layout::chunk_of(&detail).clone(),
                )
                .map_err(|error| WriterError::Internal(format!("a chunk's plans row: {error}")))?;
                read.insert(chunk.chunk, chunk);
            }
            _ => {}
        }
    }

    // CHUNK_TILING: the plan covers the key once, and each chunk was read as planned.
    match &plan {
        None if !chunk_facts.is_empty() || !read.is_empty() => finding(
            ChunkCheck::Tiling,
            None,
            "chunks were read but the plans table holds no snapshot_plan row".into(),
        ),
        None => {}
        Some(plan) => {
            let mut sorted = plan.clone();
            sorted.sort_by_key(|chunk| chunk.chunk);
            for pair in sorted.windows(2) {
                if pair[0].chunk == pair[1].chunk {
                    finding(
                        ChunkCheck::Tiling,
                        Some(pair[0].chunk),
                        format!("chunk {} is planned twice", pair[0].chunk),
                    );
                } else if let Some(problem) = adjacency(&pair[0], &pair[1]) {
                    finding(ChunkCheck::Tiling, Some(pair[1].chunk), problem);
                }
            }
            if let Some(first) = sorted.first().filter(|chunk| chunk.lo.is_some()) {
                finding(
                    ChunkCheck::Tiling,
                    Some(first.chunk),
                    format!(
                        "the first chunk {} starts at {} instead of below every key",
                        first.chunk,
                        bound_text(&first.lo)
                    ),
                );
            }
            // The last chunk ends at MAX + 1 or at the first key after MAX recorded at the
            // open: rows inserted above since S are the stream's, not the snapshot's.
            for chunk in &sorted {
                if let (Some(Bound::Int(lo)), Some(Bound::Int(hi))) = (&chunk.lo, &chunk.hi)
                    && lo >= hi
                {
                    finding(
                        ChunkCheck::Tiling,
                        Some(chunk.chunk),
                        format!("chunk {} is empty: [{lo}, {hi})", chunk.chunk),
                    );
                }
            }
            let last = sorted.last().map(|chunk| chunk.chunk);
            for (number, was_read) in &read {
                match sorted.iter().find(|chunk| chunk.chunk == *number) {
                    None => finding(
                        ChunkCheck::Tiling,
                        Some(*number),
                        format!("chunk {number} was read but is not in the plan"),
                    ),
                    Some(planned) => {
                        // A keyset plan's open last chunk is closed when read (the first key
                        // after MAX), so only its hi may differ.
                        let hi_agrees = planned.hi == was_read.hi
                            || (Some(*number) == last && planned.hi.is_none());
                        if planned.lo != was_read.lo || !hi_agrees {
                            finding(
                                ChunkCheck::Tiling,
                                Some(*number),
                                format!(
                                    "chunk {number} was read over [{}, {}) but planned over [{}, {})",
                                    bound_text(&was_read.lo),
                                    bound_text(&was_read.hi),
                                    bound_text(&planned.lo),
                                    bound_text(&planned.hi)
                                ),
                            );
                        }
                    }
                }
            }
            for number in chunk_facts.keys() {
                if !sorted.iter().any(|chunk| chunk.chunk == *number) {
                    finding(
                        ChunkCheck::Tiling,
                        Some(*number),
                        format!("chunk {number} has a facts row but is not in the plan"),
                    );
                }
            }
        }
    }

    // CHUNK_ROWS: bronze holds what each facts row counts, and no chunk without one.
    let mut in_bronze: BTreeMap<i32, u64> = BTreeMap::new();
    for row in tables::query_text(
        &tables::table_url(bronze)?,
        &format!("SELECT _chunk, COUNT(*) FROM t WHERE _snapshot = '{snapshot}' AND _chunk IS NOT NULL GROUP BY _chunk"),
    )
    .await?
    {
        if let (Some(chunk), Some(rows)) = (
            row[0].as_deref().and_then(|chunk| chunk.parse().ok()),
            row[1].as_deref().and_then(|rows| rows.parse().ok()),
        ) {
            in_bronze.insert(chunk, rows);
        }
    }
    for (chunk, facts_row) in &chunk_facts {
        let held = in_bronze.get(chunk).copied().unwrap_or(0);
        if held != facts_row.rows {
            finding(
                ChunkCheck::Rows,
                Some(*chunk),
                format!(
                    "the facts row of chunk {chunk} counts {} rows; bronze holds {held}",
                    facts_row.rows
                ),
            );
        }
    }
    for (chunk, held) in &in_bronze {
        if !chunk_facts.contains_key(chunk) {
            finding(
                ChunkCheck::Rows,
                Some(*chunk),
                format!(
                    "bronze holds {held} rows of chunk {chunk}, which has no facts row (a wave \
                 cut short: the next backfill rebuilds its facts from bronze)"
                ),
            );
        }
    }

    // CHUNK_STAMP: every chunk read at or after S.
    for (chunk, facts_row) in &chunk_facts {
        match facts_row.stamp {
            Some(stamp) if stamp >= snapshot => {}
            Some(stamp) => finding(
                ChunkCheck::Stamp,
                Some(*chunk),
                format!("chunk {chunk} was stamped {stamp}, below the snapshot's S {snapshot}"),
            ),
            None => finding(
                ChunkCheck::Stamp,
                Some(*chunk),
                format!("chunk {chunk}'s facts row has no stamp"),
            ),
        }
    }
    Ok(Some((snapshot, findings)))
}

/// Why `next` does not start where `previous` ends; `None` when it does.
fn adjacency(previous: &PlannedChunk, next: &PlannedChunk) -> Option<String> {
    if previous.hi.is_some() && previous.hi == next.lo {
        return None;
    }
    let what = match (&previous.hi, &next.lo) {
        (Some(Bound::Int(hi)), Some(Bound::Int(lo))) if hi < lo => format!("a gap [{hi}, {lo})"),
        (Some(Bound::Int(hi)), Some(Bound::Int(lo))) if hi > lo => {
            format!("an overlap [{lo}, {hi})")
        }
        (None, _) => format!(
            "chunk {} is open above and overlaps every later chunk",
            previous.chunk
        ),
        (_, None) => format!(
            "chunk {} is open below and overlaps every earlier chunk",
            next.chunk
        ),
        _ => "bounds that differ".to_string(),
    };
    Some(format!(
        "chunk {} ends at {} but chunk {} starts at {}: {what}",
        previous.chunk,
        bound_text(&previous.hi),
        next.chunk,
        bound_text(&next.lo)
    ))
}

fn bound_text(bound: &Option<Bound>) -> String {
    match bound {
        None => "open".into(),
        Some(bound) => serde_json::to_string(bound).unwrap_or_default(),
    }
}
