//! A table's data file read from its store in byte ranges, as Parquet's async reader asks
//! for them: the footer, then one row group's column chunks at a time. A silver rewrite or a
//! compaction so holds the row group it decodes, not the whole file (silver's files are up
//! to the target file size, 100 MiB by default, and two are rewritten at a time).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use deltalake::kernel::LogicalFileView;
use deltalake::logstore::ObjectStoreRef;
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::logstore::object_store::path::Path;
use deltalake::parquet::arrow::arrow_reader::ArrowReaderOptions;
use deltalake::parquet::arrow::async_reader::AsyncFileReader;
use deltalake::parquet::errors::ParquetError;
use deltalake::parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use futures::FutureExt;
use futures::future::BoxFuture;

/// The footer's bytes fetched at once: the metadata of the writer's files fits, so it is one
/// request, not the footer's length and then the metadata.
const FOOTER_HINT: usize = 64 << 10;

/// One data file of a table: its store, path and size (from the Delta log).
#[derive(Clone)]
pub struct StoredFile {
    store: ObjectStoreRef,
    path: Path,
    size: u64,
}

impl StoredFile {
    /// The data file `file` of the table whose store (rooted at the table) is `store`.
    pub fn new(store: ObjectStoreRef, file: &LogicalFileView) -> Self {
        StoredFile {
            store,
            path: file.object_store_path(),
            size: file.size() as u64,
        }
    }
}

fn parquet_error(error: deltalake::logstore::object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(error))
}

impl AsyncFileReader for StoredFile {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, Result<Bytes, ParquetError>> {
        async move {
            self.store
                .get_range(&self.path, range)
                .await
                .map_err(parquet_error)
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, Result<Vec<Bytes>, ParquetError>> {
        async move {
            self.store
                .get_ranges(&self.path, &ranges)
                .await
                .map_err(parquet_error)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, Result<Arc<ParquetMetaData>, ParquetError>> {
        async move {
            let size = self.size;
            let metadata = ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .with_prefetch_hint(Some(FOOTER_HINT))
                .load_and_finish(self, size)
                .await?;
            Ok(Arc::new(metadata))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use deltalake::logstore::object_store::local::LocalFileSystem;
    use deltalake::parquet::arrow::ArrowWriter;
    use deltalake::parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;
    use deltalake::parquet::file::properties::WriterProperties;
    use futures::TryStreamExt;

    #[tokio::test]
    async fn a_file_whose_footer_outgrows_the_hint_streams_as_it_was_written() {
        // 300 columns and 20 row groups: a footer of several hundred KiB, fetched past the
        // first 64 KiB asked for.
        let schema = Arc::new(Schema::new(
            (0..300)
                .map(|column| Field::new(format!("c{column}"), DataType::Int64, true))
                .collect::<Vec<_>>(),
        ));
        let batch = |group: i64| {
            let columns: Vec<ArrayRef> = (0..300)
                .map(|column| {
                    Arc::new(Int64Array::from_iter_values(
                        (0..50).map(|row| group * 1_000_000 + column * 1_000 + row),
                    )) as ArrayRef
                })
                .collect();
            RecordBatch::try_new(schema.clone(), columns).expect("batch")
        };
        let dir = tempfile::tempdir().expect("temp");
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(50))
            .build();
        let mut bytes = Vec::new();
        let mut writer =
            ArrowWriter::try_new(&mut bytes, schema.clone(), Some(properties)).expect("writer");
        let written: Vec<RecordBatch> = (0..20).map(batch).collect();
        for batch in &written {
            writer.write(batch).expect("write");
        }
        let footer = writer.close().expect("close");
        assert_eq!(footer.row_groups().len(), 20);
        std::fs::write(dir.path().join("f.parquet"), &bytes).expect("file");

        let store: ObjectStoreRef =
            Arc::new(LocalFileSystem::new_with_prefix(dir.path()).expect("store"));
        let mut file = StoredFile {
            store,
            path: Path::from("f.parquet"),
            size: bytes.len() as u64,
        };
        let end = bytes.len() - 8;
        let footer_length = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("length"));
        assert!(footer_length as usize > FOOTER_HINT, "{footer_length}");
        let metadata = file.get_metadata(None).await.expect("footer");
        assert_eq!(metadata.num_row_groups(), 20);
        let read: Vec<RecordBatch> = ParquetRecordBatchStreamBuilder::new(file)
            .await
            .expect("builder")
            .build()
            .expect("stream")
            .try_collect()
            .await
            .expect("rows");
        assert_eq!(
            arrow::compute::concat_batches(&schema, &read).expect("read"),
            arrow::compute::concat_batches(&schema, &written).expect("written")
        );
    }
}
