//! The backfill: waves of whole rounds of `partitions` chunks, each recorded in the plans table
//! before its read (so a rerun reads exactly them), read while the wave before it commits, one
//! bronze append per wave and one `snapshot_chunk` facts row per chunk, the completion row after
//! the last chunk; guards (retention headroom, an operator's pause) checked before each wave.

use std::time::Instant;

use mssql_cdc_proto::keys::Bound;
use mssql_cdc_proto::{CommitTime, Lsn};
use serde_json::json;

use super::operator::operator_pause;
use super::read::PendingFiles;
use super::recorded::ChunkDone;
use super::{
    BackfillOptions, BackfillStatus, KeysetOpen, PlannedChunk, PlansRows, SnapshotMode, Snapshots,
    WaveProgress, micros_now, quoted, seed_layout, snapshot_event,
};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::FactsRow;
use crate::tables;

/// A wave between its read and its commit.
pub(super) enum WaveStage {
    /// Read into files, to be appended.
    Read(PendingFiles),
    /// Already in bronze (a rerun after the append): each chunk's `(chunk, rows, stamp, high)`.
    Held(Vec<(i32, u64, Lsn, Option<Lsn>)>),
}

/// The wave read last: committed while the next wave is read.
pub(super) struct WaveInFlight {
    pub(super) wave: i64,
    pub(super) chunks: Vec<PlannedChunk>,
    pub(super) stage: WaveStage,
}

impl Snapshots {
    /// Why to pause while the stream's retention headroom is short or unknown, or `None`.
    pub(super) async fn headroom_guard(&self, min_hours: f64) -> Result<Option<(String, String)>> {
        let rows = self
            .facts
            .query_text(&format!(
                "SELECT retention_headroom_hours, written_at FROM t WHERE app_id = '{}' AND event IS NULL \
                 ORDER BY written_at DESC LIMIT 1",
                quoted(&self.config.app_id)
            ))
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

    /// [`Snapshots::backfill`], calling `on_wave` after every wave; the metrics follow both.
    pub async fn backfill_with_progress(
        &self,
        options: &BackfillOptions,
        mut on_wave: impl FnMut(&WaveProgress),
    ) -> Result<BackfillStatus> {
        let table = &self.config.table;
        // A server that fails in passing (a restart) costs the wave it cut: the call reads
        // again from what facts hold, the cut wave as its plans rows recorded it.
        let mut waits = crate::retry::waits();
        let status = loop {
            let waves = self.backfill_waves(options, |progress| {
                crate::metrics::snapshot_chunks(
                    table,
                    progress.chunks_done,
                    Some(progress.chunks_total),
                );
                on_wave(progress);
            });
            match waves.await {
                Err(error) if error.is_redoable() => {
                    let Some(wait) = waits.next() else {
                        return Err(error);
                    };
                    crate::retry::log("the backfill", table, &error, wait);
                    tokio::time::sleep(wait).await;
                }
                status => break status?,
            }
        };
        // Without an open snapshot there is no plan: the gauges keep the last one's count.
        if status.chunks_total.is_some() {
            crate::metrics::snapshot_chunks(table, status.chunks_done, status.chunks_total);
        }
        Ok(status)
    }

    async fn backfill_waves(
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
        if !self.waves_readable(snapshot, &recorded_plans).await? {
            return Ok(BackfillStatus {
                snapshot: Some(snapshot),
                chunks_done: 0,
                chunks_total: None,
                done: false,
                paused: false,
                state: "abandoned".into(),
                reason: Some("abandoned: the column selection changed; open a new snapshot".into()),
            });
        }
        let keyset = self.keyset_open_of(snapshot, &recorded_plans)?;
        let plan = self
            .plan(snapshot, &recorded_plans, options.chunk_rows)
            .await?;
        tracing::debug!(%snapshot, chunks = plan.len(), ms = planning.elapsed().as_millis() as u64,
            "backfill planned");
        let total = plan.len() as u64;
        let plan_last = plan.last().map(|chunk| chunk.chunk);
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
                done.iter().any(|done| done.chunk == chunk.chunk)
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
                        .map(|done| done.wave)
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
                            .read_wave_files(snapshot, *wave, chunks, plan_last, keyset.as_ref())
                            .await?;
                        tracing::debug!(wave, ms = clock.elapsed().as_millis() as u64, "wave read");
                        Ok(Some((stage, clock.elapsed())))
                    }
                    None => Ok::<_, WriterError>(None),
                }
            };
            let (finished, read) = tokio::join!(finishing, reading);
            if let Some((wave, wave_rows)) = finished? {
                rows_read += wave_rows.iter().map(|chunk| chunk.rows).sum::<u64>();
                done.extend(wave_rows);
                waves_read += 1;
                let rows_per_second = rows_read as f64 / call.elapsed().as_secs_f64().max(1e-9);
                let rows_left: u64 = plan
                    .iter()
                    .filter(|chunk| !done.iter().any(|done| done.chunk == chunk.chunk))
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
                        .all(|chunk| done.iter().any(|done| done.chunk == chunk.chunk));
                    if complete {
                        let resnapshot = recorded.resnapshots.contains(&snapshot);
                        self.complete(snapshot, &plan, &done, resnapshot).await?;
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
    pub(super) async fn wave_chunks(
        &self,
        snapshot: Lsn,
        recorded: &PlansRows,
        wave: i64,
        remaining: &[PlannedChunk],
        count: usize,
        keyset: Option<&KeysetOpen>,
    ) -> Result<Vec<PlannedChunk>> {
        let recorded = recorded.wave(wave)?;
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
        let plan_last = remaining.last().map(|chunk| chunk.chunk);
        let rows = chunks
            .iter()
            .map(|chunk| {
                let last = Some(chunk.chunk) == plan_last;
                let row = seed_layout::chunk_row(snapshot, wave, chunk, last);
                (events::SNAPSHOT_CHUNK, row)
            })
            .collect();
        if self
            .append_plans(&self.txn("snapchunks", snapshot), wave, snapshot, rows)
            .await?
        {
            return Ok(chunks);
        }
        // Another call recorded this wave first: its chunks win.
        self.plans_rows(snapshot).await?.wave(wave)
    }

    /// Commits a wave read by [`Self::read_wave_files`] (one bronze append unless bronze
    /// holds it), then its facts rows; returns each chunk's rows.
    pub(super) async fn finish_wave(
        &self,
        snapshot: Lsn,
        plan: &[PlannedChunk],
        in_flight: WaveInFlight,
    ) -> Result<(i64, Vec<ChunkDone>)> {
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
                event: Some(events::SNAPSHOT_CHUNK.into()),
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
                .map(|(chunk, rows, stamp, _)| ChunkDone {
                    chunk: *chunk,
                    wave,
                    rows: *rows,
                    stamp: *stamp,
                })
                .collect(),
        ))
    }

    /// Writes the completion row once every chunk is in (`done`), with the chunks' rows and,
    /// as the seed's completion payload, the newest stamp of its chunks.
    pub(super) async fn complete(
        &self,
        snapshot: Lsn,
        plan: &[PlannedChunk],
        done: &[ChunkDone],
        resnapshot: bool,
    ) -> Result<()> {
        let healed = self.gap_healed_by(snapshot).await?;
        // A heal completes as a re-snapshot, as the seed's: also one that took over a snapshot
        // already open (a switch's bootstrap, an operator's re-snapshot).
        let event = events::completion(resnapshot || healed.is_some());
        let (lost_from_ts, lost_to_ts) = healed.unwrap_or_default();
        let rows: u64 = done.iter().map(|chunk| chunk.rows).sum();
        let last_lsn = done
            .iter()
            .map(|chunk| chunk.stamp)
            .max()
            .unwrap_or(snapshot);
        self.append_facts(
            &self.txn("snapdone", snapshot),
            0,
            vec![FactsRow {
                rows: Some(rows as i64),
                detail: Some(
                    json!({"mode": SnapshotMode::Chunked.as_str(), "snapshot": snapshot, "chunks": plan.len(), "rows": rows, "last_lsn": last_lsn})
                        .to_string(),
                ),
                lost_from_ts,
                lost_to_ts,
                ..snapshot_event(event, snapshot)
            }],
        )
        .await?;
        tracing::info!(table = %self.config.table, %snapshot, rows, event, "chunked snapshot complete");
        Ok(())
    }

    /// The gap the snapshot at `snapshot` heals (`lost_from_ts`, `lost_to_ts`), which its
    /// completion row carries, as the seed's does: its healing open's, or, when the heal took
    /// over a snapshot already open, the `data_loss` row naming it (whose end is S's commit
    /// time); `None` when it heals nothing. A `data_loss` row the stream has not committed
    /// yet when the last wave lands is not seen: that completion then carries no gap.
    async fn gap_healed_by(&self, snapshot: Lsn) -> Result<Option<(Option<i64>, Option<i64>)>> {
        let rows = self
            .facts
            .query_text(&format!(
                "SELECT event, detail, CAST(lost_from_ts AS BIGINT), CAST(lost_to_ts AS BIGINT) \
                 FROM t WHERE app_id = '{}' AND ((event = '{}' AND min_lsn = '{snapshot}') OR \
                 (event = '{}' AND max_lsn = '{snapshot}'))",
                quoted(&self.config.app_id),
                events::SNAPSHOT_OPEN,
                events::DATA_LOSS,
            ))
            .await?;
        let micros = |value: &Option<String>| value.as_deref().and_then(|text| text.parse().ok());
        let gap = |row: &Vec<Option<String>>| (micros(&row[2]), micros(&row[3]));
        let healing_open = rows.iter().find(|row| {
            row[0].as_deref() == Some(events::SNAPSHOT_OPEN)
                && crate::facts::detail_of(row[1].as_deref())["reason"]
                    == super::open::HEALING_REASON
        });
        let loss = rows
            .iter()
            .find(|row| row[0].as_deref() == Some(events::DATA_LOSS));
        Ok(healing_open.or(loss).map(gap))
    }

    pub(super) async fn held_by_bronze(&self, txn: &str, version: i64) -> Result<bool> {
        match tables::open(&self.target).await? {
            Some(table) => tables::holds_transaction(&table, txn, version).await,
            None => Ok(false),
        }
    }

    /// `(_chunk, rows, smallest stamp)` of the snapshot's rows in bronze, for some chunks.
    pub(super) async fn count_snapshot_rows(
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
}
