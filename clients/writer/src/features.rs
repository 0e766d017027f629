//! The Delta features the writer can keep correct, checked before it writes a table another
//! engine (Spark, Databricks) may have created or altered.
//!
//! The writer writes with delta-rs and rewrites silver's files itself (copy-on-write, reading
//! the Parquet files as they are). Some table features change what a file means or how it
//! must be written, and ignoring them corrupts the table for every reader:
//!
//! - **deletion vectors**: a file's deleted rows live beside it, so reading the file whole
//!   resurrects them; silver's merge honours them (and writes them), the other tables refuse
//!   them;
//! - **column mapping**: Parquet columns carry physical names, so writing logical names makes
//!   every other reader see NULLs;
//! - **partition columns**: their values live in the paths, not in the files;
//! - **change data feed** on a table the writer merges (silver, control): the merges write no
//!   change files, so a reader of the feed misses them;
//! - **type widening, identity and generated columns, row tracking, in-commit timestamps,
//!   v2 checkpoints, clustering** and any feature this release does not know: delta-rs 1.1
//!   writes none of them correctly, or would add one it cannot write.
//!
//! `variantType` passes while no column is a variant (the Python `deltalake` package adds it
//! whenever it sets a table property).
//!
//! Anything outside the allow-list stops the write with the feature named and the way out;
//! nothing is written. Protocol versions up to reader 3 and writer 7 are understood.

use deltalake::DeltaTable;
use serde_json::Value;

use crate::error::{Result, WriterError};
use crate::tables::TableKind;

/// Writer features every table kind may carry.
const ALLOWED: [&str; 5] = [
    "appendOnly",
    "invariants",
    "checkConstraints",
    "timestampNtz",
    "vacuumProtocolCheck",
];

/// Whether `table`'s protocol lists writer feature `name` (delta-rs keeps the kernel's
/// feature accessors internal, so the protocol is read as its JSON action).
pub fn has_writer_feature(table: &DeltaTable, name: &str) -> Result<bool> {
    let protocol = protocol_json(table)?;
    Ok(protocol["writerFeatures"]
        .as_array()
        .is_some_and(|features| features.iter().any(|feature| feature == name)))
}

fn protocol_json(table: &DeltaTable) -> Result<Value> {
    serde_json::to_value(table.snapshot()?.protocol())
        .map_err(|error| WriterError::Internal(format!("protocol: {error}")))
}

/// Refuses a write to `table` (of `kind`, at `location`) whose protocol or properties hold a
/// feature the writer cannot keep correct (see the module).
pub fn check(table: &DeltaTable, kind: TableKind, location: &str) -> Result<()> {
    let protocol = protocol_json(table)?;
    let metadata = serde_json::to_value(table.snapshot()?.metadata())
        .map_err(|error| WriterError::Internal(format!("metadata: {error}")))?;
    let refused = refusals(&protocol, &metadata, kind);
    if refused.is_empty() {
        return Ok(());
    }
    Err(WriterError::invalid(format!(
        "{location} ({kind:?}) uses Delta features this writer cannot keep correct: {}. Nothing \
         was written. Disable them on the table (for deletion vectors: set \
         delta.enableDeletionVectors = false and REORG TABLE ... APPLY (PURGE); for a \
         partitioned or column-mapped table: write a new table), or point the writer at a \
         table it created",
        refused.join("; ")
    )))
}

/// Whether the table's schema (`metadata`'s `schemaString`) holds a column of Spark's
/// `variant` type, which the writer cannot write. The `variantType` feature alone does not
/// change how other columns are stored (the Python `deltalake` package adds it to a table's
/// protocol whenever it sets a property).
fn has_variant_column(metadata: &Value) -> bool {
    fn holds(node: &Value) -> bool {
        match node {
            Value::String(name) => name == "variant",
            Value::Array(items) => items.iter().any(holds),
            Value::Object(fields) => fields
                .iter()
                .any(|(key, value)| key != "metadata" && key != "name" && holds(value)),
            _ => false,
        }
    }
    metadata["schemaString"]
        .as_str()
        .and_then(|schema| serde_json::from_str::<Value>(schema).ok())
        .is_none_or(|schema| holds(&schema))
}

/// Why `protocol` and `metadata` (the Delta actions as JSON) cannot be written as `kind`.
fn refusals(protocol: &Value, metadata: &Value, kind: TableKind) -> Vec<String> {
    let mut refused = Vec::new();
    let version = |key: &str| protocol[key].as_i64().unwrap_or(0);
    if version("minReaderVersion") > 3 || version("minWriterVersion") > 7 {
        refused.push(format!(
            "protocol reader {} writer {} (at most reader 3, writer 7)",
            version("minReaderVersion"),
            version("minWriterVersion")
        ));
    }
    let merged = matches!(
        kind,
        TableKind::Silver | TableKind::History | TableKind::Control
    );
    let features = ["readerFeatures", "writerFeatures"]
        .iter()
        .flat_map(|key| protocol[*key].as_array().cloned().unwrap_or_default())
        .filter_map(|feature| feature.as_str().map(str::to_string))
        .collect::<std::collections::BTreeSet<String>>();
    for feature in features {
        let allowed = ALLOWED.contains(&feature.as_str())
            || (feature == "changeDataFeed" && !merged)
            || (feature.starts_with("variantType") && !has_variant_column(metadata))
            || (feature == "deletionVectors" && kind == TableKind::Silver);
        if !allowed {
            refused.push(format!("table feature {feature}"));
        }
    }
    let configuration = &metadata["configuration"];
    let setting = |key: &str| configuration[key].as_str().map(str::to_ascii_lowercase);
    if setting("delta.enableDeletionVectors").as_deref() == Some("true")
        && kind != TableKind::Silver
    {
        refused.push("delta.enableDeletionVectors = true".into());
    }
    if let Some(mode) = setting("delta.columnMapping.mode").filter(|mode| mode != "none") {
        refused.push(format!("delta.columnMapping.mode = {mode}"));
    }
    if merged && setting("delta.enableChangeDataFeed").as_deref() == Some("true") {
        refused.push(
            "delta.enableChangeDataFeed = true on a table the writer merges (its merges write \
             no change files)"
                .into(),
        );
    }
    let partitions: Vec<&str> = metadata["partitionColumns"]
        .as_array()
        .map(|columns| columns.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !partitions.is_empty() {
        refused.push(format!("partition columns {}", partitions.join(", ")));
    }
    refused
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn protocol(writer: &[&str]) -> Value {
        json!({"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": [], "writerFeatures": writer})
    }

    #[test]
    fn what_the_writer_keeps_correct_passes_and_the_rest_is_named() {
        let plain = json!({"partitionColumns": [], "configuration": {}});
        let classic = json!({"minReaderVersion": 1, "minWriterVersion": 2});
        assert!(refusals(&classic, &plain, TableKind::Silver).is_empty());
        assert!(
            refusals(
                &protocol(&["appendOnly", "timestampNtz"]),
                &plain,
                TableKind::Bronze
            )
            .is_empty()
        );
        assert!(
            refusals(&protocol(&["changeDataFeed"]), &plain, TableKind::Bronze).is_empty(),
            "an append-only table's feed is its adds"
        );
        let merged = refusals(&protocol(&["changeDataFeed"]), &plain, TableKind::Silver);
        assert_eq!(merged, ["table feature changeDataFeed"]);
        let vectors = refusals(
            &protocol(&["deletionVectors"]),
            &json!({"partitionColumns": ["region"], "configuration": {
                "delta.enableDeletionVectors": "true", "delta.columnMapping.mode": "name"}}),
            TableKind::Bronze,
        );
        assert_eq!(
            vectors,
            [
                "table feature deletionVectors",
                "delta.enableDeletionVectors = true",
                "delta.columnMapping.mode = name",
                "partition columns region"
            ]
        );
        let silver_vectors = json!({"minReaderVersion": 3, "minWriterVersion": 7,
            "readerFeatures": ["deletionVectors"], "writerFeatures": ["deletionVectors"]});
        let vectors_on = json!({"partitionColumns": [], "configuration": {"delta.enableDeletionVectors": "true"}});
        assert!(
            refusals(&silver_vectors, &vectors_on, TableKind::Silver).is_empty(),
            "silver's merge honours and writes deletion vectors"
        );
        assert_eq!(
            refusals(&silver_vectors, &vectors_on, TableKind::Control).len(),
            2
        );
        let variant = json!({"minReaderVersion": 3, "minWriterVersion": 7,
            "readerFeatures": ["variantType"], "writerFeatures": ["variantType"]});
        let schema = |data_type: &str| {
            json!({"partitionColumns": [], "configuration": {}, "schemaString": json!({
                "type": "struct", "fields": [{"name": "variant", "type": data_type,
                "nullable": true, "metadata": {"comment": "variant"}}]}).to_string()})
        };
        assert!(
            refusals(&variant, &schema("string"), TableKind::Silver).is_empty(),
            "the feature without a variant column"
        );
        assert_eq!(
            refusals(&variant, &schema("variant"), TableKind::Silver),
            ["table feature variantType"]
        );
        let newer = json!({"minReaderVersion": 4, "minWriterVersion": 8});
        assert_eq!(refusals(&newer, &plain, TableKind::Facts).len(), 1);
    }
}
