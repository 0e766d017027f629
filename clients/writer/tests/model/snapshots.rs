//! The snapshot operations of a schedule: an operator's opens, backfill waves, pauses and
//! resumes, and what the model learns of the rebuilds silver makes from them.

use mssql_cdc_flight::Lsn;
use mssql_cdc_writer::WriterError;
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::{control, tables};

use crate::ops::Table;
use crate::world::{Failure, World};

impl World {
    /// An operator's re-snapshot: refused while one of the other mode is open, or when
    /// nothing was committed since the last one.
    pub(crate) async fn open_snapshot(&self, table: Table, chunked: bool) -> Result<(), Failure> {
        let mode = if chunked {
            SnapshotMode::Chunked
        } else {
            SnapshotMode::Full
        };
        match snapshot::open(&self.reader_config(table).await, mode, true).await {
            Ok(state) => {
                if state.status.done
                    && let Some(done) = state.status.snapshot
                {
                    self.completed(table, done);
                }
                Ok(())
            }
            Err(WriterError::InvalidArgument(message))
                if message.contains("one snapshot mode per run")
                    || message.contains("no commit since snapshot") =>
            {
                Ok(())
            }
            Err(error) => Err(format!("snapshot open of {}: {error}", table.source())),
        }
    }

    pub(crate) fn completed(&self, table: Table, snapshot: Lsn) {
        let mut known = self.known();
        let newest = known.completed.entry(table).or_insert(snapshot);
        *newest = (*newest).max(snapshot);
    }

    /// Waves of the open chunked snapshot: none while an operator's pause holds it. Fenced
    /// only beside another operation (another backfill, or an open superseding the plan).
    pub(crate) async fn backfill(
        &self,
        table: Table,
        waves: u32,
        paired: bool,
    ) -> Result<(), Failure> {
        // A pause that lands while this backfill reads may let its first waves through.
        let paused = self.known().paused.get(&table).copied();
        let config = self.reader_config(table).await;
        let options = BackfillOptions {
            chunk_rows: chunk_rows(table),
            max_waves: Some(waves),
            target_wave_seconds: 0.0,
            min_headroom_hours: None,
        };
        let before = snapshot::state(&config)
            .await
            .map_err(|error| format!("snapshot state of {}: {error}", table.source()))?;
        let snapshots = Snapshots::connect(config)
            .await
            .map_err(|error| format!("backfill of {}: {error}", table.source()))?;
        let status = match snapshots.backfill(&options).await {
            Ok(status) => status,
            Err(WriterError::Fenced(_)) if paired => return Ok(()),
            Err(error) => return Err(format!("backfill of {}: {error}", table.source())),
        };
        if let Some(snapshot) = status.snapshot
            && paused == Some(snapshot)
            && (!status.paused || status.chunks_done > before.status.chunks_done)
        {
            return Err(format!(
                "backfill of {}: snapshot {snapshot} is paused by an operator, yet the backfill \
                 read waves ({} chunks done, {} before)",
                table.source(),
                status.chunks_done,
                before.status.chunks_done
            ));
        }
        if status.done
            && let Some(done) = status.snapshot
        {
            self.completed(table, done);
        }
        Ok(())
    }

    /// An operator pauses or resumes: refused when no chunked snapshot is open.
    pub(crate) async fn pause(&self, table: Table, paused: bool) -> Result<(), Failure> {
        match snapshot::set_paused(&self.config(table), paused, Some("model")).await {
            Ok(state) => {
                let mut known = self.known();
                match (paused, state.status.snapshot) {
                    (true, Some(snapshot)) => {
                        known.paused.insert(table, snapshot);
                    }
                    _ => {
                        known.paused.remove(&table);
                    }
                }
                Ok(())
            }
            Err(WriterError::InvalidArgument(message))
                if message.contains("no open chunked snapshot") =>
            {
                Ok(())
            }
            Err(error) => Err(format!(
                "{} of {}: {error}",
                if paused { "pause" } else { "resume" },
                table.source()
            )),
        }
    }

    /// What silver of `table` holds, as its control row says: applied (a position), and
    /// the snapshot it was last rebuilt from, returned. A rebuild newer than the model knew
    /// writes silver whole: another engine's deletion is gone, and so is a purge's hole when
    /// the snapshot is past the cut and past every healing re-snapshot's S.
    pub(crate) async fn observe_silver(&self, table: Table) -> Result<Option<Lsn>, Failure> {
        let silver = self.lab.lake(&format!("silver_{}", table.name()));
        let control = tables::table_url(&self.lab.lake("control")).expect("url");
        let Some(position) = control::row(&control, &silver)
            .await
            .map_err(|error| format!("control: {error}"))?
            .map(|row| row.position)
        else {
            return Ok(None);
        };
        let rebuilt = position
            .snapshot_lsn
            .and_then(|text| text.parse::<Lsn>().ok());
        let healed = self.heals(table).await;
        let mut known = self.known();
        if position.applied_lsn.is_some() {
            known.applied.insert(table);
        }
        if let Some(rebuilt) = rebuilt
            && known
                .rebuilt_from
                .get(&table)
                .is_none_or(|known_rebuilt| rebuilt > *known_rebuilt)
        {
            known.rebuilt_from.insert(table, rebuilt);
            known.corrupted.remove(&table);
            if known.lost_at.get(&table).is_some_and(|cut| {
                rebuilt > *cut && healed.iter().all(|(_, healing)| rebuilt >= *healing)
            }) {
                known.lost_at.remove(&table);
            }
        }
        Ok(rebuilt)
    }
}

/// Rows per chunk of a table's chunked snapshots: a few waves each.
pub(crate) fn chunk_rows(table: Table) -> u64 {
    match table {
        Table::Busy => 400,
        Table::Quiet => 8,
        Table::Keyed => 25,
    }
}
