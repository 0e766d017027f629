//! A masked read's batches cut again on their served sizes ([`Recut`]).

use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;

use crate::error::Result;

/// Cuts a masked read's batches again on their served sizes. The source cuts on the sizes
/// of the values it read, masked ones in clear; a client choosing `batch_bytes` (or the
/// server's share under load) could then tell a masked value's length by where a batch
/// ended. Here a batch ends after `rows` rows, or at the first row that brings it to `bytes`
/// bytes as served: where depends on served values only.
pub struct Recut {
    schema: SchemaRef,
    rows: usize,
    bytes: usize,
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    pending_bytes: usize,
}

impl Recut {
    /// Batches of `schema` cut at `rows` rows or `bytes` served bytes (each at least 1).
    pub fn new(schema: SchemaRef, rows: usize, bytes: usize) -> Self {
        Recut {
            schema,
            rows: rows.max(1),
            bytes: bytes.max(1),
            pending: Vec::new(),
            pending_rows: 0,
            pending_bytes: 0,
        }
    }

    /// Takes in `batch` (served form); returns the batches it completes.
    pub fn push(&mut self, batch: &RecordBatch) -> Result<Vec<RecordBatch>> {
        let sizes = served_row_sizes(batch);
        let mut done = Vec::new();
        let mut start = 0;
        for (row, size) in sizes.into_iter().enumerate() {
            self.pending_rows += 1;
            self.pending_bytes += size;
            if self.pending_rows >= self.rows || self.pending_bytes >= self.bytes {
                self.pending.push(batch.slice(start, row + 1 - start));
                start = row + 1;
                done.push(self.take()?);
            }
        }
        if start < batch.num_rows() {
            self.pending
                .push(batch.slice(start, batch.num_rows() - start));
        }
        Ok(done)
    }

    /// The rows still held, as the read's last batch.
    pub fn finish(&mut self) -> Result<Option<RecordBatch>> {
        match self.pending_rows {
            0 => Ok(None),
            _ => self.take().map(Some),
        }
    }

    fn take(&mut self) -> Result<RecordBatch> {
        let batch = arrow::compute::concat_batches(&self.schema, &self.pending)?;
        self.pending.clear();
        (self.pending_rows, self.pending_bytes) = (0, 0);
        Ok(batch)
    }
}

/// Each row's bytes in `batch` as served: fixed widths, and a text's or binary value's own
/// length with its offset.
fn served_row_sizes(batch: &RecordBatch) -> Vec<usize> {
    let mut sizes = vec![0usize; batch.num_rows()];
    for column in batch.columns() {
        let variable = match column.data_type() {
            DataType::Utf8 => Some(column.as_string::<i32>().offsets().clone()),
            DataType::Binary => Some(column.as_binary::<i32>().offsets().clone()),
            _ => None,
        };
        match variable {
            Some(offsets) => {
                for (size, ends) in sizes.iter_mut().zip(offsets.windows(2)) {
                    *size += 4 + usize::try_from(ends[1] - ends[0]).unwrap_or(0);
                }
            }
            None => {
                let width = column.data_type().primitive_width().unwrap_or(1);
                for size in &mut sizes {
                    *size += width;
                }
            }
        }
    }
    sizes
}
