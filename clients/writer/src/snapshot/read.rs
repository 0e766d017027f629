//! Reading a snapshot command's endpoints in parallel into bronze files: each reader opens its
//! next chunk's stream while it drains the current one, a stream stamped below S is refused
//! (P2), and nothing is committed until every stream ended with its completion marker.

use std::sync::Arc;
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::{ChunkSpec, Completion, SnapshotCommand};
use serde_json::json;

use super::wave::WaveStage;
use super::{KeysetOpen, PlannedChunk, Snapshots, poisoned, seed_layout};
use crate::bronze::{self, BronzeRows};
use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind};

/// An endpoint's stream being opened ahead of its read; dropped unread, it is cancelled.
pub(super) struct OpeningEndpoint(
    tokio::task::JoinHandle<Result<mssql_cdc_proto::client::EndpointReader>>,
);

impl OpeningEndpoint {
    /// Starts opening the stream of endpoint `index`.
    pub(super) fn start(
        client: &CdcClient,
        (index, ticket): (usize, arrow_flight::Ticket),
    ) -> (usize, Self) {
        let client = client.clone();
        let opening = tokio::spawn(async move {
            client
                .open_endpoint(&ticket)
                .await
                .map_err(WriterError::from)
        });
        (index, OpeningEndpoint(opening))
    }

    pub(super) async fn reader(mut self) -> Result<mssql_cdc_proto::client::EndpointReader> {
        (&mut self.0)
            .await
            .map_err(|error| WriterError::Internal(format!("opening a snapshot stream: {error}")))?
    }
}

impl Drop for OpeningEndpoint {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Bronze files of a snapshot read, written and not yet committed.
pub(super) struct PendingFiles {
    pub(super) appender: Arc<bronze::Appender>,
    pub(super) files: Vec<deltalake::kernel::Add>,
    pub(super) read: SnapshotRead,
    pub(super) total: u64,
    pub(super) metadata: String,
    /// The capture instance the rows were read under.
    pub(super) capture_instance: String,
}

/// Rows and completion markers of a snapshot read, one per endpoint in plan order.
#[derive(Default)]
pub(super) struct SnapshotRead {
    pub(super) rows: Vec<u64>,
    pub(super) completions: Vec<Completion>,
}

impl Snapshots {
    /// Reads one wave's chunks into bronze files, not yet committed; or, when bronze already
    /// holds the wave (a rerun after its append), counts its rows there.
    pub(super) async fn read_wave_files(
        &self,
        snapshot: Lsn,
        wave: i64,
        chunks: &[PlannedChunk],
        plan_last: Option<i32>,
        keyset: Option<&KeysetOpen>,
    ) -> Result<WaveStage> {
        let bronze_txn = self.txn("snap", snapshot);
        if self.held_by_bronze(&bronze_txn, wave).await? {
            let counted = self
                .count_snapshot_rows(snapshot, Some(chunks.iter().map(|c| c.chunk).collect()))
                .await?;
            return Ok(WaveStage::Held(
                chunks
                    .iter()
                    .map(|chunk| {
                        let found = counted.iter().find(|(id, ..)| *id == Some(chunk.chunk));
                        let stamp = found.and_then(|(_, _, stamp)| *stamp).unwrap_or(snapshot);
                        (
                            chunk.chunk,
                            found.map_or(0, |(_, rows, _)| *rows),
                            stamp,
                            None,
                        )
                    })
                    .collect(),
            ));
        }
        let mut command = SnapshotCommand::new(self.config.table.clone());
        command.chunks = Some(
            chunks
                .iter()
                .map(|chunk| ChunkSpec {
                    chunk: chunk.chunk,
                    lo: chunk.lo.clone(),
                    hi: chunk.hi.clone(),
                })
                .collect(),
        );
        command.keys = keyset.map(KeysetOpen::names);
        let mut pending = self.read_files(snapshot, command, wave).await?;
        pending.metadata = wave_metadata(&bronze_txn, snapshot, wave, chunks, plan_last, &pending);
        Ok(WaveStage::Read(pending))
    }

    /// Reads every endpoint of a snapshot command in parallel into bronze files and commits
    /// them in one append `(txn, version)`; refuses a stream stamped below S (P2).
    pub(super) async fn read_into_bronze(
        &self,
        snapshot: Lsn,
        command: SnapshotCommand,
        txn: &str,
        version: i64,
    ) -> Result<SnapshotRead> {
        let pending = self.read_files(snapshot, command, version).await?;
        self.commit_files(pending, txn, version).await
    }

    /// Bronze (created when missing) ready for the snapshot rows of S, streamed in `schema`.
    pub(super) async fn snapshot_appender(
        &self,
        schema: &SchemaRef,
        snapshot: Lsn,
    ) -> Result<Arc<bronze::Appender>> {
        let rows_kind = BronzeRows::Snapshot(snapshot.to_string());
        let empty = RecordBatch::new_empty(Arc::clone(schema));
        let table = tables::ensure_with(
            &self.target,
            TableKind::Bronze,
            bronze::fields(&rows_kind.convert(&empty)?.schema())?,
            "bronze",
            bronze::creation_properties(&self.columns, schema),
        )
        .await?;
        Ok(Arc::new(
            bronze::Appender::prepare(table, schema, &self.config.target, rows_kind)
                .await?
                .reading(self.columns.clone())?,
        ))
    }

    /// Reads every endpoint of a snapshot command in parallel into bronze files, not yet
    /// committed; refuses a stream stamped below S (P2).
    pub(super) async fn read_files(
        &self,
        snapshot: Lsn,
        command: SnapshotCommand,
        version: i64,
    ) -> Result<PendingFiles> {
        let preparing = Instant::now();
        // Every snapshot read of the stream asks for its columns, whoever built the command.
        let mut command = command;
        self.columns.apply(&mut command.serve);
        let plan = self.client.plan_snapshot(&command).await?;
        let schema = Arc::new(
            plan.info
                .clone()
                .try_decode_schema()
                .map_err(|error| WriterError::Internal(format!("snapshot schema: {error}")))?,
        );
        let appender = self.snapshot_appender(&schema, snapshot).await?;
        tracing::debug!(
            version,
            ms = preparing.elapsed().as_millis() as u64,
            "snapshot read planned, bronze prepared"
        );
        // `partitions` readers, each taking the next endpoint when it is done with one and
        // writing every endpoint it reads into its own Parquet files: a wave of many chunks
        // is read like a full snapshot, with as many streams and as many open files, instead
        // of a stream and a file per chunk (each new file starts its column dictionaries and
        // buffers over). Each chunk is stamped when its read starts; its rows and completion
        // are kept per endpoint, and all files commit together in one append. A reader opens
        // its next endpoint while it drains the current one, so the server has the next
        // chunk's first batches on the way when the current stream ends (a stream opened at
        // each chunk's end left both sides idle for its round trip and first batch, once per
        // chunk); the stamp is still taken before that chunk's read.
        let tickets = plan
            .info
            .endpoint
            .iter()
            .map(|endpoint| {
                endpoint.ticket.clone().ok_or_else(|| {
                    WriterError::Internal("a snapshot endpoint without ticket".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let endpoints = tickets.len();
        let queue = Arc::new(std::sync::Mutex::new(
            tickets
                .into_iter()
                .enumerate()
                .collect::<std::collections::VecDeque<_>>(),
        ));
        let mut readers = Vec::new();
        for _ in 0..(self.config.partitions.max(1) as usize).min(endpoints) {
            let queue = Arc::clone(&queue);
            let client = self.client.clone();
            let mut files = appender.file_writer();
            // Every reader's first endpoint is taken here, so none takes two before another
            // has one.
            let first = queue.lock().map_err(|_| poisoned())?.pop_front();
            let mut upcoming = first.map(|next| OpeningEndpoint::start(&client, next));
            readers.push(tokio::spawn(async move {
                let mut read: Vec<(usize, u64, Completion)> = Vec::new();
                let open_next = || -> Result<Option<(usize, OpeningEndpoint)>> {
                    let next = queue.lock().map_err(|_| poisoned())?.pop_front();
                    Ok(next.map(|next| OpeningEndpoint::start(&client, next)))
                };
                let streamed: Result<()> = async {
                    while let Some((index, opening)) = upcoming.take() {
                        let mut reader = opening.reader().await?;
                        upcoming = open_next()?;
                        let mut rows = 0u64;
                        while let Some(batch) = reader.next_batch().await? {
                            rows += batch.num_rows() as u64;
                            files.write(&batch).await?;
                        }
                        read.push((index, rows, reader.completion()?));
                    }
                    Ok(())
                }
                .await;
                // A stream opened ahead and not read (a failure) is closed by the drop.
                drop(upcoming);
                match streamed {
                    Ok(()) => Ok((read, files.close().await?)),
                    Err(error) => {
                        // The others stop after the endpoint they are reading.
                        if let Ok(mut queue) = queue.lock() {
                            queue.clear();
                        }
                        files.abort().await;
                        Err(error)
                    }
                }
            }));
        }
        let mut by_endpoint: Vec<Option<(u64, Completion)>> =
            (0..endpoints).map(|_| None).collect();
        let mut files = Vec::new();
        for reader in readers {
            let (read, reader_files) = reader
                .await
                .map_err(|error| WriterError::Internal(format!("snapshot read task: {error}")))??;
            for (index, rows, completion) in read {
                by_endpoint[index] = Some((rows, completion));
            }
            files.extend(reader_files);
        }
        let mut out = SnapshotRead::default();
        for read in by_endpoint {
            let (rows, completion) = read
                .ok_or_else(|| WriterError::Internal("a snapshot endpoint was not read".into()))?;
            if let Some(stamp) = completion.snapshot_lsn
                && stamp < snapshot
            {
                return Err(WriterError::invalid(format!(
                    "a snapshot stream was stamped {stamp}, below the snapshot's S {snapshot}: \
                     is the server reading a readable secondary behind the primary? Chunks \
                     must be read where S was recorded"
                )));
            }
            out.rows.push(rows);
            out.completions.push(completion);
        }
        let total: u64 = out.rows.iter().sum();
        // A full snapshot's commit; a wave's is the seed's `WaveMetadata` (read_wave_files).
        let metadata = json!({
            "snapshot": plan.metadata.capture_instance,
            "lsn": snapshot,
            "wave": version,
            "rows": total,
        });
        Ok(PendingFiles {
            appender,
            files,
            read: out,
            total,
            metadata: metadata.to_string(),
            capture_instance: plan.metadata.capture_instance,
        })
    }

    /// Commits files read by [`Self::read_files`] in one bronze append `(txn, version)` (none
    /// when no row was read).
    pub(super) async fn commit_files(
        &self,
        pending: PendingFiles,
        txn: &str,
        version: i64,
    ) -> Result<SnapshotRead> {
        if pending.total > 0 {
            pending
                .appender
                .commit(pending.files, txn, version, pending.metadata)
                .await?;
        }
        Ok(pending.read)
    }
}

/// The userMetadata of a wave's bronze commit, the seed's `WaveMetadata`: its transaction
/// (`backfill`, `wave`), the stamp it read under (`lsn`: its chunks' oldest), an `attempt` id
/// telling this commit from an earlier attempt's, and each chunk's bounds (the seed's JSON),
/// rows and read; with ours beside them (the capture instance, the rows, each chunk's stamp).
fn wave_metadata(
    txn: &str,
    snapshot: Lsn,
    wave: i64,
    chunks: &[PlannedChunk],
    plan_last: Option<i32>,
    pending: &PendingFiles,
) -> String {
    let read = &pending.read;
    let stamps = read.completions.iter().filter_map(|c| c.snapshot_lsn);
    let described: Vec<serde_json::Value> = chunks
        .iter()
        .zip(read.rows.iter().zip(&read.completions))
        .map(|(chunk, (rows, completion))| {
            json!({
                "chunk": chunk.chunk,
                "lo": seed_layout::seed_bound(chunk.lo.as_ref()),
                "hi": seed_layout::seed_bound(chunk.hi.as_ref()),
                "last": Some(chunk.chunk) == plan_last,
                "rows": rows,
                "high_lsn": completion.max_lsn,
                "read_seconds": completion.seconds,
                "read_mb": completion.bytes as f64 / 1e6,
                "stamp": completion.snapshot_lsn,
            })
        })
        .collect();
    json!({
        "backfill": txn,
        "wave": wave,
        "lsn": stamps.min().unwrap_or(snapshot),
        "attempt": uuid::Uuid::new_v4().to_string(),
        "chunks": described,
        "capture_instance": pending.capture_instance,
        "rows": pending.total,
    })
    .to_string()
}
