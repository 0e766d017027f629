//! The one `do_get` stream producer, shared by change ranges and snapshots.
//!
//! A spawned task reads the source and encodes its batches into Flight data in a bounded
//! channel, so backpressure from the client reaches the source and the connection sends one
//! batch while the next is read and encoded; the completion marker,
//! a zero-row record batch whose app_metadata is the [`Completion`], follows the last batch,
//! and only when the read was whole. Stock decoders read it as an ordinary empty batch (arrow-rs'
//! and pyarrow's are tested). Nothing else ends a stream cleanly: a read that fails ends it with
//! its status, a source read task that stops without its explicit end
//! ([`crate::source::read_channel`]) or a producer that panics ends it with `INTERNAL`, and a
//! client that leaves stops the task at once. What differs between the two kinds of read is
//! what is checked around it:
//!
//! - a change range refuses a start CDC cleanup has already passed (`ChangesPurged`); after
//!   the read, a start cleanup passed meanwhile is `PurgedDuringRead` (rows may be missing),
//!   and rows sent other than the ticket's planned rows are `INTERNAL` (never a marker);
//! - a snapshot records its stamp `L = max_lsn` before the read (P1 of docs/snapshots.md), so
//!   the read sees every commit up to it; the marker carries it as `snapshot_lsn`.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::encode::{BatchEncoder, Message, ipc_options};
use super::masking::{Recut, ServedMasks};
use super::share::SharePermit;
use super::ticket::{ChangeRangeTicket, TicketColumn, batch_bound};
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::protocol::{COMPLETION_TYPE, Completion};
use crate::source::{BatchBytes, BatchStream, CdcSource, ChangeRead, SnapshotRead};
use crate::types::{batch_slice_size, metadata_column_count, output_schema, snapshot_schema};

/// Encoded batches the producer may queue ahead of the connection (one of the
/// [`super::gate::BATCHES_PER_STREAM`]).
const BATCHES_AHEAD: usize = 1;

/// A response stream of the service.
pub type BoxedStream<T> = BoxStream<'static, std::result::Result<T, Status>>;

/// What one `do_get` reads.
pub enum StreamRead {
    /// A change range of one capture instance, with the rows counted when it was planned
    /// (the rows of a closed LSN range never change while retention holds).
    Changes {
        /// The range.
        read: ChangeRead,
        /// Rows the read must send.
        planned_rows: u64,
    },
    /// Current rows of a table, stamped when the stream opens.
    Snapshot(SnapshotRead),
}

impl StreamRead {
    /// The change range a ticket names.
    pub fn changes(ticket: &ChangeRangeTicket) -> Result<Self> {
        let lsn = |bytes: &[u8]| {
            Lsn::try_from_slice(bytes).map_err(|error| Error::TicketMalformed(error.to_string()))
        };
        Ok(StreamRead::Changes {
            read: ChangeRead {
                capture_instance: ticket.capture_instance.clone(),
                from: lsn(&ticket.from_lsn)?,
                to: lsn(&ticket.to_lsn)?,
                columns: TicketColumn::to_output(&ticket.columns)?,
                include_command_id: ticket.include_command_id,
                batch_rows: batch_bound(ticket.batch_rows),
                batch_bytes: BatchBytes::fixed(batch_bound(ticket.batch_bytes)),
            },
            planned_rows: ticket.planned_rows,
        })
    }

    /// Cuts the read's batches at `share` whenever it is below the ticket's bound.
    pub fn share(&mut self, share: Arc<AtomicUsize>) {
        let bound = match self {
            StreamRead::Changes { read, .. } => &mut read.batch_bytes,
            StreamRead::Snapshot(read) => &mut read.batch_bytes,
        };
        *bound = BatchBytes::shared(bound.requested(), share);
    }

    /// The schema the source reads, before masks.
    fn schema(&self) -> SchemaRef {
        match self {
            StreamRead::Changes { read, .. } => {
                output_schema(&read.columns, read.include_command_id)
            }
            StreamRead::Snapshot(read) => snapshot_schema(&read.columns, read.include_command_id),
        }
    }

    /// The metrics' name of this kind of read.
    fn kind(&self) -> &'static str {
        match self {
            StreamRead::Changes { .. } => "changes",
            StreamRead::Snapshot(_) => "snapshot",
        }
    }

    /// The rows and bytes a batch may hold now (bytes within the server's share under
    /// load, which depends on the streams open, not on any value).
    fn batch_bounds(&self) -> (usize, usize) {
        match self {
            StreamRead::Changes { read, .. } => (read.batch_rows, read.batch_bytes.now()),
            StreamRead::Snapshot(read) => (read.batch_rows, read.batch_bytes.now()),
        }
    }

    /// Where the captured columns start.
    fn first_captured(&self) -> usize {
        metadata_column_count(match self {
            StreamRead::Changes { read, .. } => read.include_command_id,
            StreamRead::Snapshot(read) => read.include_command_id,
        })
    }

    fn capture_instance(&self) -> &str {
        match self {
            StreamRead::Changes { read, .. } => &read.capture_instance,
            StreamRead::Snapshot(read) => &read.capture_instance,
        }
    }

    /// Checks what must hold before the read, then opens it.
    async fn open(&mut self, source: &dyn CdcSource) -> Result<BatchStream> {
        match self {
            StreamRead::Changes { read, .. } => {
                let min_lsn = source.min_lsn(&read.capture_instance).await?;
                if read.from < min_lsn {
                    return Err(Error::ChangesPurged {
                        capture_instance: read.capture_instance.clone(),
                        requested: read.from,
                        min_lsn,
                        hint: String::new(),
                    });
                }
                source.read_changes(read.clone()).await
            }
            StreamRead::Snapshot(read) => {
                // P1: the stamp is recorded before the read, so the read sees every commit up
                // to it.
                read.stamp = source.snapshot_lsn(&read.table).await?;
                read.stamp_time = source.lsn_to_time(read.stamp).await?;
                source.read_snapshot(read.clone()).await
            }
        }
    }

    /// The completion marker of a whole read of `rows` rows and `bytes` bytes, after checking
    /// what must still hold once the rows are out.
    async fn completion(
        &self,
        source: &dyn CdcSource,
        rows: u64,
        bytes: u64,
        started: Instant,
    ) -> Result<Completion> {
        let min_lsn = source.min_lsn(self.capture_instance()).await?;
        let (from, to, snapshot_lsn) = match self {
            StreamRead::Changes { read, planned_rows } => {
                if min_lsn > read.from {
                    return Err(Error::PurgedDuringRead {
                        capture_instance: read.capture_instance.clone(),
                        from: read.from,
                        min_lsn,
                    });
                }
                if rows != *planned_rows {
                    return Err(Error::Internal(format!(
                        "the read of {} [{}, {}] sent {rows} rows but {planned_rows} were \
                         planned; the stream is incomplete",
                        read.capture_instance, read.from, read.to
                    )));
                }
                (read.from, read.to, None)
            }
            StreamRead::Snapshot(read) => (read.stamp, read.stamp, Some(read.stamp)),
        };
        let max_lsn = source.max_lsn().await?;
        let max_commit_ts = match max_lsn {
            Some(lsn) => source.lsn_to_time(lsn).await?,
            None => None,
        };
        Ok(Completion {
            kind: COMPLETION_TYPE.into(),
            capture_instance: self.capture_instance().to_string(),
            from,
            to,
            rows,
            bytes,
            seconds: started.elapsed().as_secs_f64(),
            min_lsn,
            max_lsn,
            max_commit_ts,
            snapshot_lsn,
        })
    }
}

/// The `do_get` response for `read`: its batches masked by `masks`, in IPC with
/// `compression` (the ticket's code: 0 none, 1 LZ4 frame, 2 ZSTD), then its completion
/// marker, or the status the read ended with; `STREAM_STALLED` once the client took no
/// batch for `stall`. The read starts once `share` gives it a place in its principal's share
/// of the source, which is given back when the read ends, before the client has taken the
/// last batches.
pub fn respond(
    source: Arc<dyn CdcSource>,
    read: StreamRead,
    masks: ServedMasks,
    (compression, stall): (u32, Option<Duration>),
    share: impl Future<Output = Result<SharePermit>> + Send + 'static,
) -> Result<BoxedStream<Message>> {
    let schema = masks.schema(read.schema(), read.first_captured());
    let encoder = BatchEncoder::new(Arc::clone(&schema), ipc_options(compression)?)?;
    let first = encoder.schema();
    let (batch_sender, batch_receiver) = mpsc::channel(BATCHES_AHEAD);
    let (end_sender, end_receiver) = oneshot::channel();
    tokio::spawn(produce(
        source,
        (read, masks, schema),
        (encoder, stall, share),
        batch_sender,
        end_sender,
    ));
    let data = futures::stream::once(async { first })
        .chain(ReceiverStream::new(batch_receiver))
        .map(Ok);
    // The end comes after every queued batch: the producer drops its batch sender first.
    let end = futures::stream::once(end_receiver).map(|end| match end {
        Ok(end) => end,
        // The producer stopped without saying how the read ended: it panicked.
        Err(_) => Err(Status::internal(
            "the stream's producer stopped before its end (a server bug); do not commit it",
        )),
    });
    Ok(data.chain(end).boxed())
}

/// Encodes `batch` and queues its messages; `false` when the client left. A client that
/// stops reading (HTTP/2's windows full, then this queue) would hold the source read and its
/// connection for ever: past `stall` the read ends, which releases both.
async fn send(
    encoder: &mut BatchEncoder,
    batch: &RecordBatch,
    batches: &mpsc::Sender<Message>,
    stall: Option<Duration>,
    (kind, rows): (&str, u64),
) -> Result<bool> {
    for message in encoder.encode(batch)? {
        let sent = match stall {
            None => batches.send(message).await,
            Some(stall) => match tokio::time::timeout(stall, batches.send(message)).await {
                Ok(sent) => sent,
                Err(_) => {
                    tracing::info!(
                        kind,
                        rows,
                        "a stream's client took no batch for the stall timeout: ended"
                    );
                    return Err(Error::StreamStalled(format!(
                        "the client took no batch for {} s: the stream was ended and its \
                         source read released (the server's --stall-timeout); read the ticket \
                         again from its start",
                        stall.as_secs_f64()
                    )));
                }
            },
        };
        if sent.is_err() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Reads `read` into `batches`; then sends to `end` the completion marker when the whole read
/// succeeded, or the status it failed with.
async fn produce(
    source: Arc<dyn CdcSource>,
    (mut read, masks, schema): (StreamRead, ServedMasks, SchemaRef),
    (mut encoder, stall, share): (
        BatchEncoder,
        Option<Duration>,
        impl Future<Output = Result<SharePermit>>,
    ),
    batches: mpsc::Sender<Message>,
    end: oneshot::Sender<std::result::Result<Message, Status>>,
) {
    let started = Instant::now();
    let outcome = async {
        // Held until the read and its checks are done (the outcome's end).
        let _permit = tokio::select! {
            permit = share => permit?,
            () = batches.closed() => return Ok(None),
        };
        // Opening runs source queries (the range's checks, the snapshot's LSN): a client
        // that leaves meanwhile stops them too.
        let mut stream = tokio::select! {
            stream = read.open(source.as_ref()) => stream?,
            () = batches.closed() => return Ok(None),
        };
        let (mut rows, mut bytes) = (0u64, 0u64);
        // A masked read is cut again on its served sizes: the source cut on the clear ones,
        // and a client choosing `batch_bytes` could measure a masked value by where it cut.
        let mut recut = (!masks.is_clear()).then(|| {
            let (batch_rows, batch_bytes) = read.batch_bounds();
            Recut::new(Arc::clone(&schema), batch_rows, batch_bytes)
        });
        let first = read.first_captured();
        loop {
            // A client that leaves stops the read at once, also while the source is still
            // working towards its next batch (dropping the stream cancels the source query).
            let next = tokio::select! {
                next = stream.next() => next,
                () = batches.closed() => return Ok(None),
            };
            let served = match next {
                // Masked before anything leaves the producer: the clear values are dropped here.
                Some(batch) => {
                    let batch = masks.apply(batch?, first, &schema)?;
                    match &mut recut {
                        Some(recut) => recut.push(&batch)?,
                        None => vec![batch],
                    }
                }
                None => break,
            };
            for batch in served {
                rows += batch.num_rows() as u64;
                bytes += batch_slice_size(&batch) as u64;
                if !send(&mut encoder, &batch, &batches, stall, (read.kind(), rows)).await? {
                    return Ok(None);
                }
            }
        }
        if let Some(last) = recut.as_mut().map(Recut::finish).transpose()?.flatten() {
            rows += last.num_rows() as u64;
            bytes += batch_slice_size(&last) as u64;
            if !send(&mut encoder, &last, &batches, stall, (read.kind(), rows)).await? {
                return Ok(None);
            }
        }
        drop(stream);
        let completion = read
            .completion(source.as_ref(), rows, bytes, started)
            .await?;
        let marker = encoder.marker(&completion)?;
        Ok(Some((completion, marker)))
    }
    .await;
    drop(batches);
    let kind = read.kind();
    match outcome {
        Ok(Some((completion, marker))) => {
            tracing::debug!(capture_instance = %completion.capture_instance, rows = completion.rows,
                seconds = completion.seconds, snapshot = ?completion.snapshot_lsn, "stream served");
            super::metrics::stream_complete(
                kind,
                completion.rows,
                completion.bytes,
                completion.seconds,
            );
            let _ = end.send(Ok(marker));
        }
        Ok(None) => {
            tracing::debug!("client closed the stream before its end");
            super::metrics::stream_failed(kind, tonic::Code::Cancelled);
        }
        Err(error) => {
            let status = crate::status::to_status(&error);
            super::metrics::stream_failed(kind, status.code());
            let _ = end.send(Err(status));
        }
    }
}
