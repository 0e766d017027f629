//! Snapshot reads over Flight: planning a `snapshot` command and serving its tickets.
//!
//! A full snapshot is cut into `partitions` endpoints of about equal rows on the key (the
//! first open below, the last open above, so every row is read); a chunked one gets one
//! endpoint per chunk. The stamp `L` is recorded when a ticket is redeemed, **before** the
//! rows are read, and every row carries it as `_start_lsn`; the completion marker repeats it
//! (`snapshot_lsn`) with `max_lsn` after the read. Tickets hold no stamp, so a replayed
//! ticket reads the rows again under a new stamp, which is what a rerun wave wants.

use arrow_flight::{FlightDescriptor, FlightEndpoint, FlightInfo, Ticket};

use super::auth::Principal;
use super::json_bytes;
use super::limits::Limits;
use super::masking::MaskPolicy;
use super::planner;
use super::ticket::{
    SnapshotPieceTicket, SnapshotTicket, TicketBody, TicketColumn, TicketKind, TicketSigner,
    batch_bound,
};
use crate::chunking::{self, BucketCounter};
use crate::error::{Error, Result};
use crate::keys::{
    Bound, KeyColumn, KeySeek, KeyTuple, KeyValue, KeysetRange, KeysetSeek, check_tuple,
    resolve_columns,
};
use crate::protocol::{
    ChunkSpec, MAX_PARTITIONS, SnapshotCommand, SnapshotEndpointMetadata, SnapshotPlanMetadata,
};
use crate::source::{
    BatchBytes, CaptureInstance, CdcSource, KeyBucket, KeyGrid, KeyRange, SnapshotPiece,
    SnapshotRead, TableName,
};
use crate::types::{metadata_column_count, snapshot_schema};

/// Counts key slices straight from a source.
struct SourceCounter<'a> {
    source: &'a dyn CdcSource,
    table: &'a TableName,
}

#[async_trait::async_trait]
impl BucketCounter for SourceCounter<'_> {
    async fn buckets(&self, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        self.source.key_buckets(self.table, grid).await
    }
}

/// Plans a `snapshot` command of `principal` into a `FlightInfo` with one signed ticket per
/// endpoint, its columns masked as `masks` serve them to `principal`.
pub async fn plan(
    source: &dyn CdcSource,
    (signer, limits): (&TicketSigner, &Limits),
    (masks, principal): (&MaskPolicy, &Principal),
    command: &SnapshotCommand,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo> {
    let table: TableName = command.table.parse()?;
    let instances = source.active_capture_instances(&table).await?;
    let instance = instances.last().ok_or_else(|| Error::TableNotFound {
        table: table.to_string(),
    })?;
    let newest = instance.name.clone();
    let columns = planner::served_columns(
        &table,
        planner::union_columns(&table, &instances)?,
        &command.serve,
    )?;
    let bounds = limits.batch_bounds(command.serve.batch_rows, command.serve.batch_bytes)?;
    if let Some(chunks) = &command.chunks {
        limits.check_chunks(chunks.len())?;
    }
    let include_command_id = command.serve.include_command_id.unwrap_or(true);
    let keyset = command.chunks.as_ref().is_some_and(|chunks| {
        command.keys.is_some()
            || chunks.iter().any(|chunk| {
                matches!(chunk.lo, Some(Bound::Keys(_))) || matches!(chunk.hi, Some(Bound::Keys(_)))
            })
    });
    let extent = match keyset {
        true => None,
        false => match source.key_extent(&table).await {
            Ok(extent) => Some(extent),
            // No single integer key to cut on (a composite or text key, a heap): a full
            // snapshot is cut on keyset bounds of the unique index instead, or read whole in
            // one stream when there is none (the seed's rule for tables without a usable
            // index); chunks need keyset bounds.
            Err(Error::InvalidArgument(reason)) if command.chunks.is_none() => {
                tracing::debug!(%table, %reason, "no integer key to cut the snapshot on");
                None
            }
            Err(error) => return Err(error),
        },
    };
    let partitions = command.partitions.unwrap_or(1);
    if partitions == 0 || partitions > MAX_PARTITIONS {
        return Err(Error::invalid(format!(
            "partitions must be between 1 and {MAX_PARTITIONS}"
        )));
    }
    let mut keyset_partitions = command.chunks.is_none()
        && !keyset
        && extent.is_none()
        && partitions > 1
        && (!instance.index_columns.is_empty() || command.keys.is_some());
    // Partitions of a unique index nobody named are the server's choice: an index it cannot
    // cut on (a `bit` or `sql_variant` column) reads the table whole in one stream instead,
    // as before, rather than refusing a plain full snapshot. (A masks file cannot mask a
    // unique index's column: `MaskPolicy::check_table` refuses it.)
    let (keys, unique) = match (keyset, keyset_partitions) {
        (true, _) => cut_keys(&table, instance, command.keys.as_deref())?,
        (false, true) => match cut_keys(&table, instance, command.keys.as_deref()) {
            Ok(cut) => cut,
            Err(reason) if command.keys.is_none() => {
                tracing::debug!(%table, %reason, "an index not to cut on: the snapshot is read whole");
                keyset_partitions = false;
                (Vec::new(), false)
            }
            Err(error) => return Err(error),
        },
        (false, false) => (Vec::new(), false),
    };
    // Bounds on a masked key would hand out (chunk bounds, split points) or probe (a
    // client's bounds) its values in clear.
    masks.refuse_masked(
        principal,
        &table,
        keys.iter().map(|key| key.name.as_str()),
        "cut a snapshot on it",
    )?;
    if let Some(extent) = &extent
        && (command.chunks.is_some() || command.partitions.is_some_and(|n| n > 1))
    {
        masks.refuse_masked(
            principal,
            &table,
            [extent.column.as_str()],
            "cut a snapshot on it",
        )?;
    }
    let endpoints: Vec<Vec<SnapshotPiece>> = match &command.chunks {
        Some(chunks) => {
            if chunks.is_empty() {
                return Err(Error::invalid("a chunked snapshot command needs chunks"));
            }
            chunks
                .iter()
                .map(|chunk| chunk_piece(chunk, &keys).map(|piece| vec![piece]))
                .collect::<Result<_>>()?
        }
        None if keyset_partitions => {
            let cut = (&keys[..], unique);
            // Half the call's deadline for the walk, so the plan is answered in time.
            let bounds = (limits.max_seek_rows, limits.call_timeout / 2);
            keyset_partitions_of(source, &table, cut, partitions, bounds).await?
        }
        None => {
            let mut ranges = if let (Some(extent), true) = (&extent, partitions > 1) {
                let bounds = extent.min.zip(extent.max);
                let chunk_rows = extent.rows.div_ceil(u64::from(partitions)).max(1);
                let counter = SourceCounter {
                    source,
                    table: &table,
                };
                chunking::plan(&counter, bounds, chunk_rows)
                    .await?
                    .into_iter()
                    .map(|(range, _)| range)
                    .collect()
            } else {
                vec![KeyRange { lo: None, hi: None }]
            };
            // A full snapshot reads every row: the last partition is open above.
            if let Some(last) = ranges.last_mut() {
                last.hi = None;
            }
            ranges
                .into_iter()
                .map(|range| {
                    vec![SnapshotPiece {
                        chunk: None,
                        range,
                        keyset: None,
                    }]
                })
                .collect()
        }
    };
    masks.check_table(&table, &instances)?;
    let served = masks.served(principal, &table, &columns)?;
    let ticket_columns = served.ticket_columns(&columns);
    let metadata = SnapshotPlanMetadata {
        table: table.to_string(),
        capture_instance: newest.clone(),
        key: match (&extent, keys.is_empty()) {
            (Some(extent), _) => extent.column.clone(),
            (None, false) => keys
                .iter()
                .map(|key| key.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            (None, true) => String::new(),
        },
        rows: extent.as_ref().map_or(0, |extent| extent.rows),
    };
    let mut info = FlightInfo::new()
        .try_with_schema(&served.schema(
            snapshot_schema(&columns, include_command_id),
            metadata_column_count(include_command_id),
        ))?
        .with_descriptor(descriptor)
        .with_ordered(true)
        .with_total_records(
            extent
                .as_ref()
                .map_or(-1, |extent| i64::try_from(extent.rows).unwrap_or(i64::MAX)),
        )
        .with_app_metadata(json_bytes(&metadata));
    for pieces in endpoints {
        let body = TicketBody {
            kind: Some(TicketKind::Snapshot(SnapshotTicket {
                table: table.to_string(),
                capture_instance: newest.clone(),
                columns: ticket_columns.clone(),
                pieces: pieces
                    .iter()
                    .map(|piece| SnapshotPieceTicket {
                        chunk: piece.chunk,
                        lo: piece.range.lo,
                        hi: piece.range.hi,
                        keyset_lo: piece
                            .keyset
                            .as_ref()
                            .and_then(|range| range.lo.as_ref())
                            .map(|lo| serde_json::to_string(lo).unwrap_or_default()),
                        keyset_hi: piece
                            .keyset
                            .as_ref()
                            .and_then(|range| range.hi.as_ref())
                            .map(|hi| serde_json::to_string(hi).unwrap_or_default()),
                    })
                    .collect(),
                keys: keys
                    .iter()
                    .map(|key| TicketColumn {
                        name: key.name.clone(),
                        sql_type: key.sql_type.to_string(),
                        // A ticket's bounds on a key its redeemer gets masked would hand them
                        // its clear values: redemption checks these too.
                        mask: masks
                            .mask_of(principal, &table, &key.name)
                            .map(|mask| mask.to_string())
                            .unwrap_or_default(),
                    })
                    .collect(),
                include_command_id,
                batch_rows: bounds.rows as u64,
                batch_bytes: bounds.bytes as u64,
                compression: command.serve.compression.unwrap_or_default().ticket_code(),
            })),
            expires_at: 0,
        };
        info = info.with_endpoint(
            FlightEndpoint::new()
                .with_ticket(Ticket::new(signer.sign(&body)))
                .with_app_metadata(json_bytes(&SnapshotEndpointMetadata { pieces })),
        );
    }
    Ok(info)
}

/// A full snapshot of `table` in at most `partitions` keyset ranges of about equal rows on the
/// columns `keys` (the unique index, or `snapshot_keys`: `unique` says which) as `[None, b1)`,
/// ..., `[bn, None)`, so every row is read once: the bounds are sought by the source,
/// `rows / partitions` rows apart (at most `max_seek_rows`, the seek's own bound), for at most
/// `budget`; the last range holds what the walk did not reach.
async fn keyset_partitions_of(
    source: &dyn CdcSource,
    table: &TableName,
    (keys, unique): (&[KeyColumn], bool),
    partitions: u32,
    (max_seek_rows, budget): (u64, std::time::Duration),
) -> Result<Vec<Vec<SnapshotPiece>>> {
    let rows = source.table_rows(table).await?;
    let apart = rows
        .div_ceil(u64::from(partitions))
        .max(1)
        .min(max_seek_rows.max(1));
    // Each seek reads the rows it skips: past the budget (or a seek past the bound, which a
    // walk on repeating values can double into) the walk stops, and the last range, open
    // above, holds the rest. The ranges tile the table whatever the walk found.
    let started = std::time::Instant::now();
    let seek = |seek: KeySeek| async move {
        if seek.n > max_seek_rows || started.elapsed() > budget {
            return Ok(None);
        }
        let seek = KeysetSeek::new(keys.to_vec(), seek)?;
        source.key_bound(table, &seek).await
    };
    let most = partitions as usize - 1;
    let bounds = crate::keys::walk(seek, (unique, None), apart, Some(most)).await?;
    let mut lows = vec![None];
    lows.extend(bounds.iter().cloned().map(Some));
    let highs = bounds.into_iter().map(Some).chain([None]);
    Ok(lows
        .into_iter()
        .zip(highs)
        .map(|(lo, hi)| {
            vec![SnapshotPiece {
                chunk: None,
                range: KeyRange { lo: None, hi: None },
                keyset: Some(KeysetRange { lo, hi }),
            }]
        })
        .collect())
}

/// The columns a snapshot of `table` is cut on: `names` (`snapshot_keys`, unique or not) or
/// the unique index CDC uses; with whether they are that index.
pub fn cut_keys(
    table: &TableName,
    instance: &CaptureInstance,
    names: Option<&[String]>,
) -> Result<(Vec<KeyColumn>, bool)> {
    let index = &instance.index_columns;
    let names = names.unwrap_or(index);
    let unique = !index.is_empty() && names == index.as_slice();
    let keys = resolve_columns(&table.to_string(), names, &instance.columns)?;
    Ok((keys, unique))
}

/// [`cut_keys`] on the newest capture instance of `table`.
pub async fn table_keys(
    source: &dyn CdcSource,
    table: &TableName,
    names: Option<&[String]>,
) -> Result<(Vec<KeyColumn>, bool)> {
    let instances = source.active_capture_instances(table).await?;
    let instance = instances.last().ok_or_else(|| Error::TableNotFound {
        table: table.to_string(),
    })?;
    cut_keys(table, instance, names)
}

/// The piece a chunk spec reads: an integer range, or a keyset range on `keys`.
fn chunk_piece(chunk: &ChunkSpec, keys: &[KeyColumn]) -> Result<SnapshotPiece> {
    if keys.is_empty() {
        let int = |bound: &Option<Bound>| match bound {
            None => Ok(None),
            Some(Bound::Int(value)) => Ok(Some(*value)),
            Some(Bound::Keys(_)) => Err(Error::invalid(format!(
                "chunk {}: keyset bounds need the command's keys",
                chunk.chunk
            ))),
        };
        let (lo, hi) = (int(&chunk.lo)?, int(&chunk.hi)?);
        if let (Some(lo), Some(hi)) = (lo, hi)
            && lo >= hi
        {
            return Err(Error::invalid(format!(
                "chunk {} is empty: lo {lo} is not below hi {hi}",
                chunk.chunk
            )));
        }
        return Ok(SnapshotPiece {
            chunk: Some(chunk.chunk),
            range: KeyRange { lo, hi },
            keyset: None,
        });
    }
    let tuple = |bound: &Option<Bound>| -> Result<Option<KeyTuple>> {
        let tuple = match bound {
            None => return Ok(None),
            Some(Bound::Keys(tuple)) => tuple.clone(),
            // One integer key column written as a plain number.
            Some(Bound::Int(value)) => vec![KeyValue::Int(*value)],
        };
        check_tuple(&tuple, keys)
            .map_err(|error| Error::invalid(format!("chunk {}: {error}", chunk.chunk)))?;
        Ok(Some(tuple))
    };
    Ok(SnapshotPiece {
        chunk: Some(chunk.chunk),
        range: KeyRange { lo: None, hi: None },
        keyset: Some(KeysetRange {
            lo: tuple(&chunk.lo)?,
            hi: tuple(&chunk.hi)?,
        }),
    })
}

/// The read a snapshot ticket asks for, without its stamp.
pub fn ticket_read(ticket: &SnapshotTicket) -> Result<SnapshotRead> {
    let columns = TicketColumn::to_output(&ticket.columns)?;
    let keys: Vec<KeyColumn> = TicketColumn::to_output(&ticket.keys)?
        .into_iter()
        .map(|column| KeyColumn {
            name: column.name,
            sql_type: column.sql_type,
        })
        .collect();
    let bound = |text: &Option<String>| -> Result<Option<KeyTuple>> {
        text.as_deref()
            .map(|text| {
                serde_json::from_str(text)
                    .map_err(|error| Error::TicketMalformed(format!("keyset bound: {error}")))
            })
            .transpose()
    };
    Ok(SnapshotRead {
        table: ticket.table.parse()?,
        capture_instance: ticket.capture_instance.clone(),
        columns,
        pieces: ticket
            .pieces
            .iter()
            .map(|piece| {
                Ok(SnapshotPiece {
                    chunk: piece.chunk,
                    range: KeyRange {
                        lo: piece.lo,
                        hi: piece.hi,
                    },
                    keyset: match keys.is_empty() {
                        true => None,
                        false => Some(KeysetRange {
                            lo: bound(&piece.keyset_lo)?,
                            hi: bound(&piece.keyset_hi)?,
                        }),
                    },
                })
            })
            .collect::<Result<_>>()?,
        keys,
        include_command_id: ticket.include_command_id,
        stamp: crate::lsn::Lsn::ZERO,
        stamp_time: None,
        batch_rows: batch_bound(ticket.batch_rows),
        batch_bytes: BatchBytes::fixed(batch_bound(ticket.batch_bytes)),
    })
}
