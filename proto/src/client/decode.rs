//! Flight data into record batches, each message body read where it arrived.
//!
//! arrow-flight's `FlightDataDecoder` copies a record batch's whole body into a fresh buffer
//! unless the body starts 64-byte aligned, which a body tonic cut out of its receive buffer
//! almost never does: one more copy of every byte a stream carries. Arrow needs a buffer
//! aligned only to its own type (8 bytes for an `i64`, none for string bytes); arrow-ipc's
//! decoder uses the body as it lies and copies just the buffers that miss their alignment.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::buffer::Buffer;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::ipc::reader::{RecordBatchDecoder, read_dictionary};
use arrow::ipc::{MessageHeader, root_as_message};
use arrow::record_batch::RecordBatch;
use arrow_flight::FlightData;
use arrow_flight::error::FlightError;

/// What one stream has said so far: its schema and dictionaries.
#[derive(Debug, Default)]
pub(super) struct BatchDecoder {
    schema: Option<SchemaRef>,
    dictionaries: HashMap<i64, ArrayRef>,
}

impl BatchDecoder {
    /// The record batch `data` carries; `None` for a schema, a dictionary or an empty message.
    pub(super) fn decode(&mut self, data: &FlightData) -> Result<Option<RecordBatch>, FlightError> {
        let message = root_as_message(&data.data_header)
            .map_err(|error| FlightError::DecodeError(format!("message header: {error}")))?;
        match message.header_type() {
            MessageHeader::NONE => Ok(None),
            MessageHeader::Schema => {
                self.schema = Some(Arc::new(Schema::try_from(data)?));
                self.dictionaries.clear();
                Ok(None)
            }
            MessageHeader::DictionaryBatch => {
                let schema = self.schema("a dictionary")?;
                let batch = message.header_as_dictionary_batch().ok_or_else(|| {
                    FlightError::DecodeError("a dictionary message without its header".into())
                })?;
                read_dictionary(
                    &Buffer::from(data.data_body.clone()),
                    batch,
                    &schema,
                    &mut self.dictionaries,
                    &message.version(),
                )?;
                Ok(None)
            }
            MessageHeader::RecordBatch => {
                let schema = self.schema("a record batch")?;
                let batch = message.header_as_record_batch().ok_or_else(|| {
                    FlightError::DecodeError("a record batch message without its header".into())
                })?;
                let body = Buffer::from(data.data_body.clone());
                let version = message.version();
                let decoded = RecordBatchDecoder::try_new(
                    &body,
                    batch,
                    schema,
                    &self.dictionaries,
                    &version,
                )?
                .read_record_batch()?;
                Ok(Some(decoded))
            }
            other => Err(FlightError::protocol(format!(
                "unexpected message {}",
                other.variant_name().unwrap_or("UNKNOWN")
            ))),
        }
    }

    fn schema(&self, what: &str) -> Result<SchemaRef, FlightError> {
        self.schema
            .clone()
            .ok_or_else(|| FlightError::protocol(format!("{what} before the schema")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::Int32Type;
    use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
    use futures::TryStreamExt;

    fn sample() -> RecordBatch {
        let keys = Int64Array::from_iter_values(0..1_000);
        let notes = StringArray::from_iter_values((0..1_000).map(|row| format!("note {row}")));
        let status: DictionaryArray<Int32Type> =
            (0..1_000).map(|row| ["open", "shipped"][row % 2]).collect();
        RecordBatch::try_from_iter([
            ("order_id", Arc::new(keys) as ArrayRef),
            ("note", Arc::new(notes) as ArrayRef),
            ("status", Arc::new(status) as ArrayRef),
        ])
        .expect("batch")
    }

    /// `bytes` copied to start `shift` bytes past an 8-byte boundary.
    fn shifted(bytes: &bytes::Bytes, shift: usize) -> bytes::Bytes {
        let mut padded = vec![0u8; shift + 8];
        let start = padded.as_ptr().align_offset(8) + shift;
        padded.truncate(start);
        padded.extend_from_slice(bytes);
        bytes::Bytes::from(padded).slice(start..)
    }

    #[tokio::test]
    async fn misaligned_bodies_decode_to_the_batch_sent_and_string_bytes_stay_in_them() {
        let batch = sample();
        let messages: Vec<FlightData> = FlightDataEncoderBuilder::new()
            .with_dictionary_handling(DictionaryHandling::Resend)
            .build(futures::stream::iter([Ok(batch.clone())]))
            .try_collect()
            .await
            .expect("encode");
        assert!(messages.len() >= 3, "schema, dictionary and batch messages");
        for shift in 0..8 {
            let mut decoder = BatchDecoder::default();
            let mut decoded = Vec::new();
            for message in &messages {
                let body = shifted(&message.data_body, shift);
                let range = body.as_ptr() as usize..body.as_ptr() as usize + body.len();
                let message = FlightData {
                    data_body: body,
                    ..message.clone()
                };
                if let Some(batch) = decoder.decode(&message).expect("decode") {
                    let notes = batch.column(1).as_any().downcast_ref::<StringArray>();
                    let values = notes.expect("strings").values().as_ptr() as usize;
                    assert!(
                        range.contains(&values),
                        "shift {shift}: the string bytes were copied out of the body"
                    );
                    decoded.push(batch);
                }
            }
            assert_eq!(decoded, vec![batch.clone()], "shift {shift}");
        }
    }

    #[test]
    fn a_batch_before_its_schema_is_refused() {
        let batch = sample().project(&[0]).expect("project");
        let messages = arrow_flight::utils::batches_to_flight_data(&batch.schema(), vec![batch])
            .expect("encode");
        let data = messages.last().expect("the batch's message");
        let error = BatchDecoder::default()
            .decode(data)
            .expect_err("no schema yet");
        assert!(error.to_string().contains("before the schema"), "{error}");
    }
}
