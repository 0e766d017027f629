//! A stream's IPC messages, with each body made of the batch's own buffers.
//!
//! arrow's `IpcDataGenerator::encode` (and arrow-flight's encoder on top of it) copies every
//! buffer of a batch into one fresh body per message: a profile of our server put that copy,
//! and the page faults of the fresh allocation it lands in, at about a sixth of its CPU while
//! streaming (docs/design-notes.md, "Serving"). arrow's [`StreamEncoder`] lays out the same
//! messages as a list of pieces instead, the uncompressed buffers by reference. A [`Message`]
//! keeps those pieces apart, and the `DoGet` body ([`super::frames`]) hands them to the
//! socket as they are; the bytes on the wire do not change.

use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions, StreamEncoder,
};
use arrow::ipc::{CompressionType, MessageHeader, root_as_message};
use arrow::record_batch::RecordBatch;
use arrow_flight::{FlightData, SchemaAsIpc};
use bytes::{Bytes, BytesMut};

use super::json_bytes;
use crate::error::{Error, Result};
use crate::protocol::{Completion, Compression};

/// Pieces of a body shorter than this are copied together into one; longer ones travel by
/// reference. Each piece becomes at least one HTTP/2 data frame, and a narrow batch's
/// validity bitmaps and paddings are a few bytes to a few KiB each.
const SHARED_PIECE_BYTES: usize = 16 << 10;

/// One `DoGet` message: its `FlightData` without `data_body`, and the body in pieces whose
/// concatenation is the IPC body arrow's encoder would have written.
#[derive(Debug, Clone)]
pub struct Message {
    /// The message less its body (`data_body` is empty).
    pub data: FlightData,
    /// The body.
    pub body: Vec<Bytes>,
}

impl Message {
    /// `data` with its body as one piece.
    pub(super) fn whole(mut data: FlightData) -> Self {
        let body = std::mem::take(&mut data.data_body);
        Message {
            data,
            body: if body.is_empty() { vec![] } else { vec![body] },
        }
    }

    /// The body's length in bytes.
    pub fn body_len(&self) -> usize {
        self.body.iter().map(Bytes::len).sum()
    }

    /// The message as one `FlightData`, its body copied into one buffer: for the generated
    /// server's path, which the service's own `DoGet` body does not take.
    pub fn into_flight_data(self) -> FlightData {
        let mut body = BytesMut::with_capacity(self.body_len());
        for piece in &self.body {
            body.extend_from_slice(piece);
        }
        FlightData {
            data_body: body.freeze(),
            ..self.data
        }
    }
}

/// An arrow buffer as the owner of a `Bytes`, without copying it.
struct Piece(Buffer);

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// Encodes a stream's batches, in its producer task. Batches are never split: the sources
/// bound them by rows and bytes (`batch_bytes`).
pub struct BatchEncoder {
    schema: SchemaRef,
    options: IpcWriteOptions,
    encoder: StreamEncoder,
}

impl BatchEncoder {
    /// An encoder of batches of `schema` with `options`.
    pub fn new(schema: SchemaRef, options: IpcWriteOptions) -> Result<Self> {
        Ok(BatchEncoder {
            encoder: StreamEncoder::try_new_with_options(&schema, options.clone())?,
            schema,
            options,
        })
    }

    /// The stream's first message.
    pub fn schema(&self) -> Message {
        Message::whole(SchemaAsIpc::new(&self.schema, &self.options).into())
    }

    /// A batch's messages: its dictionaries, if any, then the batch. The schema message
    /// arrow's stream encoder writes before the first batch is left out: [`Self::schema`]
    /// went first.
    pub fn encode(&mut self, batch: &RecordBatch) -> Result<Vec<Message>> {
        batch_messages(self.encoder.encode(batch)?)
    }

    /// The completion marker: a zero-row record batch of the stream's schema whose
    /// app_metadata is `completion`, so stock Flight decoders accept it as an ordinary batch.
    pub fn marker(&self, completion: &Completion) -> Result<Message> {
        let empty = RecordBatch::new_empty(std::sync::Arc::clone(&self.schema));
        let (_, encoded) = IpcDataGenerator::default().encode(
            &empty,
            &mut DictionaryTracker::new(false),
            &self.options,
            &mut IpcWriteContext::default(),
        )?;
        Ok(Message::whole(
            FlightData::from(encoded).with_app_metadata(json_bytes(completion)),
        ))
    }
}

/// Cuts the pieces of an IPC stream into its dictionary and record batch messages, leaving
/// out a schema message: each is the continuation marker and the metadata's padded length
/// (8 bytes), the flatbuffer metadata (one piece) and its padding, then as many bytes of
/// body as the metadata's `bodyLength` says.
fn batch_messages(pieces: Vec<Buffer>) -> Result<Vec<Message>> {
    let malformed = |what: &str| Error::Internal(format!("arrow's IPC stream encoder: {what}"));
    let mut messages = Vec::new();
    // The encoder lists an empty array's buffers as empty pieces.
    let mut pieces = pieces.into_iter().filter(|piece| !piece.is_empty());
    while let Some(prefix) = pieces.next() {
        let prefix = prefix.as_slice();
        let Some((&[0xff, 0xff, 0xff, 0xff], length)) = prefix.split_first_chunk::<4>() else {
            return Err(malformed("a message without the continuation marker"));
        };
        let padded_length = length
            .try_into()
            .map(|length| i32::from_le_bytes(length) as usize)
            .map_err(|_| malformed("a message prefix of other than 8 bytes"))?;
        let metadata = pieces
            .next()
            .ok_or_else(|| malformed("a message without metadata"))?;
        let header = root_as_message(metadata.as_slice())
            .map_err(|error| malformed(&format!("unreadable metadata: {error}")))?;
        let is_schema = header.header_type() == MessageHeader::Schema;
        let body_length = header.bodyLength();
        let mut padding = padded_length
            .checked_sub(metadata.len())
            .ok_or_else(|| malformed("metadata longer than its prefix says"))?;
        while padding > 0 {
            next_within(&mut pieces, &mut padding, "the metadata's padding")?;
        }
        let mut remaining =
            usize::try_from(body_length).map_err(|_| malformed("a negative body length"))?;
        let mut body = Vec::new();
        let mut shared = BytesMut::new();
        while remaining > 0 {
            let piece = next_within(&mut pieces, &mut remaining, "the body")?;
            if piece.len() < SHARED_PIECE_BYTES {
                shared.extend_from_slice(piece.as_slice());
            } else {
                if !shared.is_empty() {
                    body.push(shared.split().freeze());
                }
                body.push(Bytes::from_owner(Piece(piece)));
            }
        }
        if !shared.is_empty() {
            body.push(shared.freeze());
        }
        if is_schema {
            continue;
        }
        messages.push(Message {
            data: FlightData {
                data_header: Bytes::from_owner(Piece(metadata)),
                ..FlightData::default()
            },
            body,
        });
    }
    Ok(messages)
}

/// The next piece of a part of a message that has `remaining` bytes still to come.
fn next_within(
    pieces: &mut impl Iterator<Item = Buffer>,
    remaining: &mut usize,
    part: &str,
) -> Result<Buffer> {
    let piece = pieces.next().ok_or_else(|| {
        Error::Internal(format!(
            "arrow's IPC stream encoder: {part} ends {remaining} bytes short"
        ))
    })?;
    *remaining = remaining.checked_sub(piece.len()).ok_or_else(|| {
        Error::Internal(format!(
            "arrow's IPC stream encoder: {part} runs past its length"
        ))
    })?;
    Ok(piece)
}

/// IPC options for a ticket's compression code.
pub fn ipc_options(code: u32) -> Result<IpcWriteOptions> {
    let kind = match Compression::of_ticket_code(code)? {
        Compression::None => None,
        Compression::Lz4 => Some(CompressionType::LZ4_FRAME),
        Compression::Zstd => Some(CompressionType::ZSTD),
    };
    Ok(IpcWriteOptions::default().try_with_compression(kind)?)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, DictionaryArray, Int32Array, Int64Array, StringArray, new_null_array,
    };
    use arrow::datatypes::{DataType, Field, Int32Type, Schema};
    use arrow_flight::utils::flight_data_to_arrow_batch;

    use super::*;

    fn batch(rows: usize) -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
        let names: ArrayRef = Arc::new(StringArray::from_iter(
            (0..rows).map(|row| (row % 7 != 0).then(|| format!("name {row}"))),
        ));
        let nothing = new_null_array(&DataType::Int32, rows);
        RecordBatch::try_from_iter([("id", ids), ("name", names), ("nothing", nothing)])
            .expect("batch")
    }

    /// arrow's own encoding of `batch`: the messages every Flight client has always read.
    fn arrow_messages(batch: &RecordBatch, options: &IpcWriteOptions) -> Vec<FlightData> {
        let generator = IpcDataGenerator::default();
        let mut dictionaries = DictionaryTracker::new(false);
        // The schema message gives each dictionary its id.
        generator.schema_to_bytes_with_dictionary_tracker(
            &batch.schema(),
            &mut dictionaries,
            options,
        );
        let (dictionaries, encoded) = generator
            .encode(
                batch,
                &mut dictionaries,
                options,
                &mut IpcWriteContext::default(),
            )
            .expect("encode");
        dictionaries
            .into_iter()
            .chain([encoded])
            .map(FlightData::from)
            .collect()
    }

    /// `rows` encoded by `encoder`, each message joined into one `FlightData`.
    fn joined(encoder: &mut BatchEncoder, rows: &RecordBatch) -> Vec<FlightData> {
        encoder
            .encode(rows)
            .expect("encode")
            .into_iter()
            .map(Message::into_flight_data)
            .collect()
    }

    /// Slices (a read's batch is often one), sizes on both sides of the shared-piece bound
    /// and every compression: the header and the joined pieces are arrow's bytes.
    #[test]
    fn the_pieces_join_into_arrows_own_messages() {
        let whole = batch(50_000);
        for rows in [
            whole.clone(),
            whole.slice(3, 20_001),
            whole.slice(7, 5),
            batch(0),
        ] {
            for code in [0, 1, 2] {
                let options = ipc_options(code).expect("options");
                let mut encoder = BatchEncoder::new(rows.schema(), options.clone()).expect("new");
                // Twice: the first call also writes the stream's schema, left out.
                for _ in 0..2 {
                    let ours = joined(&mut encoder, &rows);
                    assert_eq!(ours, arrow_messages(&rows, &options), "code {code}");
                    let decoded =
                        flight_data_to_arrow_batch(&ours[0], rows.schema(), &Default::default())
                            .expect("decodes");
                    assert_eq!(decoded, rows);
                }
            }
        }
    }

    #[test]
    fn large_buffers_travel_by_reference_and_small_ones_together() {
        let rows = batch(50_000);
        let mut encoder =
            BatchEncoder::new(rows.schema(), ipc_options(0).expect("options")).expect("new");
        let messages = encoder.encode(&rows).expect("encode");
        assert_eq!(messages.len(), 1);
        let ids = rows.column(0).to_data().buffers()[0].as_ptr();
        let body = &messages[0].body;
        assert!(
            body.iter().any(|piece| piece.as_ptr() == ids),
            "the id column's values are sent from the batch's own buffer"
        );
        assert!(
            body.windows(2)
                .all(|pair| pair[0].len() >= SHARED_PIECE_BYTES
                    || pair[1].len() >= SHARED_PIECE_BYTES),
            "no two small pieces in a row: {:?}",
            body.iter().map(Bytes::len).collect::<Vec<_>>()
        );
    }

    /// The schema, the batches and the completion marker: each carries its body in pieces,
    /// which is what the `DoGet` body sends.
    #[test]
    fn every_message_of_a_stream_keeps_its_body_in_pieces() {
        let rows = batch(10);
        let mut encoder =
            BatchEncoder::new(rows.schema(), ipc_options(0).expect("options")).expect("new");
        let completion = Completion {
            kind: crate::protocol::COMPLETION_TYPE.into(),
            capture_instance: "dbo_t".into(),
            from: crate::Lsn::ZERO,
            to: crate::Lsn::ZERO,
            rows: 10,
            bytes: 0,
            seconds: 0.0,
            min_lsn: crate::Lsn::ZERO,
            max_lsn: None,
            max_commit_ts: None,
            snapshot_lsn: None,
        };
        let mut messages = vec![encoder.schema()];
        messages.extend(encoder.encode(&rows).expect("encode"));
        messages.push(encoder.marker(&completion).expect("marker"));
        for message in &messages {
            assert!(message.data.data_body.is_empty());
            crate::flight::frames::message_head(message).expect("a head");
        }
        assert!(messages[1].body_len() > 0);
    }

    #[test]
    fn dictionaries_go_before_their_batch() {
        let keys = Int32Array::from(vec![0, 1, 0, 1]);
        let values: ArrayRef = Arc::new(StringArray::from(vec!["a", "b"]));
        let dictionary: ArrayRef =
            Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values).expect("dictionary"));
        let schema = Schema::new(vec![Field::new(
            "d",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            false,
        )]);
        let rows = RecordBatch::try_new(Arc::new(schema), vec![dictionary]).expect("batch");
        let options = ipc_options(0).expect("options");
        let mut encoder = BatchEncoder::new(rows.schema(), options.clone()).expect("new");
        let ours = joined(&mut encoder, &rows);
        assert_eq!(ours.len(), 2, "a dictionary, then the batch");
        assert_eq!(ours, arrow_messages(&rows, &options));
    }
}
