//! Deletion vectors: the rows a merge replaces or deletes in a silver file, marked beside the
//! file instead of writing it again (merge-on-read), when silver has
//! `delta.enableDeletionVectors = true`.
//!
//! A file's vector is the set of its deleted row positions (0-based, in the order of its row
//! groups). delta-rs 1.1 honours them when it reads (its scan, VACUUM) but writes none, so the
//! merge writes them: delta-rs' kernel lays out the file (`StreamingDeletionVectorWriter`: a
//! version byte, then per vector its size, magic, roaring treemap and CRC) and reads one back
//! (`DeletionVectorDescriptor::read`, also the inline and absolute ones another engine
//! writes). One merge writes one file holding every vector it changed, at its own offset,
//! named `deletion_vector_<uuid>.bin` at the table's root as the protocol derives it from the
//! descriptor's Z85-encoded uuid.

use std::sync::Arc;

use delta_kernel::Engine;
use delta_kernel::actions::deletion_vector::DeletionVectorDescriptor as KernelDescriptor;
use delta_kernel::actions::deletion_vector_writer::{
    KernelDeletionVector, StreamingDeletionVectorWriter,
};
use deltalake::kernel::{DeletionVectorDescriptor, LogicalFileView, StorageType};
use deltalake::logstore::ObjectStoreRef;
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::{DeltaTable, Path};
use roaring::RoaringTreemap;
use url::Url;

use crate::error::{Result, WriterError};

/// Whether the merge into `table` writes deletion vectors: its `delta.enableDeletionVectors`
/// is true and its protocol has the `deletionVectors` writer feature (which setting the
/// property adds, in delta-rs as in Spark).
pub(super) fn enabled(table: &DeltaTable) -> Result<bool> {
    let property = table
        .snapshot()?
        .metadata()
        .configuration()
        .get(PROPERTY)
        .is_some_and(|value| value.eq_ignore_ascii_case("true"));
    Ok(property && crate::features::has_writer_feature(table, "deletionVectors")?)
}

/// `table` (silver at `location`) with deletion vectors turned on: the property set, which
/// raises its protocol to reader 3 / writer 7 with the `deletionVectors` feature. Readers
/// without deletion vector support can no longer read it.
pub(super) async fn turn_on(table: DeltaTable, location: &str) -> Result<DeltaTable> {
    if enabled(&table)? {
        return Ok(table);
    }
    let table = table
        .set_tbl_properties()
        .with_properties([(PROPERTY.to_string(), "true".to_string())].into())
        .await?;
    tracing::info!(silver = location, "deletion vectors turned on");
    Ok(table)
}

/// The table property that turns deletion vectors on.
pub const PROPERTY: &str = "delta.enableDeletionVectors";

/// Reads the deletion vectors of a table's files.
#[derive(Clone)]
pub(super) struct Vectors {
    engine: Arc<dyn Engine>,
    root: Url,
}

impl Vectors {
    pub(super) fn of(table: &DeltaTable) -> Self {
        let log_store = table.log_store();
        Vectors {
            engine: log_store.engine(None),
            root: log_store.root_url().clone(),
        }
    }

    /// The rows of `file` deleted so far (none without a vector).
    pub(super) async fn deleted(&self, file: &LogicalFileView) -> Result<RoaringTreemap> {
        let Some(descriptor) = file.deletion_vector_descriptor() else {
            return Ok(RoaringTreemap::new());
        };
        let path = file.path().to_string();
        let descriptor = KernelDescriptor::try_from(descriptor).map_err(|error| {
            WriterError::Internal(format!("the deletion vector of {path}: {error}"))
        })?;
        let storage = self.engine.storage_handler();
        let root = self.root.clone();
        // The kernel's read blocks on its storage handler.
        tokio::task::spawn_blocking(move || descriptor.read(storage, &root))
            .await
            .map_err(|error| WriterError::Internal(format!("a deletion vector read: {error}")))?
            .map_err(|error| {
                WriterError::Internal(format!("the deletion vector of {path}: {error}"))
            })
    }
}

/// Writes `vectors` into one new file of the table whose object store is `store` (rooted at
/// the table) and returns each one's descriptor, in order.
pub(super) async fn write(
    store: &ObjectStoreRef,
    vectors: Vec<RoaringTreemap>,
) -> Result<Vec<DeletionVectorDescriptor>> {
    let id = uuid::Uuid::new_v4();
    let encoded_id = z85::encode(id.as_bytes());
    let mut bytes = Vec::new();
    let mut writer = StreamingDeletionVectorWriter::new(&mut bytes);
    let mut descriptors = Vec::with_capacity(vectors.len());
    for deleted in vectors {
        let mut vector = KernelDeletionVector::new();
        vector.add_deleted_row_indexes(deleted);
        let written = writer
            .write_deletion_vector(vector)
            .map_err(|error| WriterError::Internal(format!("a deletion vector: {error}")))?;
        descriptors.push(DeletionVectorDescriptor {
            storage_type: StorageType::UuidRelativePath,
            path_or_inline_dv: encoded_id.clone(),
            offset: Some(written.offset),
            size_in_bytes: written.size_in_bytes,
            cardinality: written.cardinality,
        });
    }
    writer
        .finalize()
        .map_err(|error| WriterError::Internal(format!("a deletion vector file: {error}")))?;
    store
        .put(
            &Path::from(format!("deletion_vector_{id}.bin")),
            bytes::Bytes::from(bytes).into(),
        )
        .await?;
    Ok(descriptors)
}

/// `stats` (an add action's statistics, JSON) marked as wide: once rows are deleted beside
/// the file, its minimums, maximums and null counts may cover rows no longer there, which the
/// protocol says with `tightBounds = false`. `numRecords` stays the file's physical rows,
/// `rows`, set where the stats lack it (another engine's file written without statistics):
/// the protocol requires it of a file with a deletion vector.
pub(super) fn wide_bounds(stats: Option<String>, rows: u64) -> String {
    let mut fields = match stats.as_deref().map(serde_json::from_str) {
        Some(Ok(serde_json::Value::Object(fields))) => fields,
        _ => serde_json::Map::new(),
    };
    fields.insert("tightBounds".into(), serde_json::Value::Bool(false));
    fields
        .entry("numRecords")
        .or_insert_with(|| serde_json::Value::from(rows));
    serde_json::Value::Object(fields).to_string()
}

#[cfg(test)]
mod tests {
    use super::wide_bounds;

    #[test]
    fn a_marked_file_says_its_rows_and_wide_bounds_with_or_without_stats() {
        // Another engine's file written without statistics: the re-added file still says
        // numRecords, which readers of a file with a deletion vector need.
        let bare: serde_json::Value = serde_json::from_str(&wide_bounds(None, 40)).expect("json");
        assert_eq!(bare["numRecords"], 40);
        assert_eq!(bare["tightBounds"], false);
        let ours =
            r#"{"numRecords":7,"minValues":{"k":1},"maxValues":{"k":9},"nullCount":{"k":0}}"#;
        let wide: serde_json::Value =
            serde_json::from_str(&wide_bounds(Some(ours.into()), 40)).expect("json");
        assert_eq!(wide["numRecords"], 7, "the stats' own count stays");
        assert_eq!(wide["minValues"]["k"], 1);
        assert_eq!(wide["tightBounds"], false);
    }
}
