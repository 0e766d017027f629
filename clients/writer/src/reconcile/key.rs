//! The key a reconcile compares on. One integer or date column is summed on a grid
//! ([`GridKey`], tier 1 by `key_sums`); any other key (text, composite, a key the grid cannot
//! sum) is cut into buckets by the source's keyset walk ([`KeysetKey`]). Either way each
//! row's key becomes a [`RowKey`] that the two sides are joined on.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::datatypes::DataType;
use arrow::row::{RowConverter, SortField};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_proto::keys::{GridUnit, KeyColumn};
use mssql_cdc_proto::protocol::CaptureInstanceInfo;
use sha2::{Digest, Sha256};

use super::buckets::units_of;
use super::{ReconcileConfig, date_text};
use crate::error::{Result, WriterError};

/// One row's key as both sides are joined on it: grid units (`None` is NULL) of a grid
/// key, or the key columns in Arrow's row format (equal values, equal bytes; NULLs
/// included) of a keyset key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum RowKey {
    /// A grid key's value.
    Units(Option<i64>),
    /// A keyset key's columns, row-encoded.
    Bytes(Box<[u8]>),
}

/// A keyset key as tier 1 holds silver's keys: the first 16 bytes of the SHA-256 of its
/// row-format bytes. Ten million keys then take a few hundred MiB, not the keys' bytes and
/// an allocation each; two different keys share a digest with odds near 2^-128 × n².
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyDigest(u64, u64);

impl KeyDigest {
    fn of(bytes: &[u8]) -> Self {
        let digest = Sha256::digest(bytes);
        let word = |at: usize| {
            u64::from_le_bytes(digest[at..at + 8].try_into().expect("eight bytes of 32"))
        };
        KeyDigest(word(0), word(8))
    }
}

impl RowKey {
    /// The key's digest.
    pub(crate) fn digest(&self) -> KeyDigest {
        match self {
            RowKey::Bytes(bytes) => KeyDigest::of(bytes),
            RowKey::Units(None) => KeyDigest::of(&[]),
            RowKey::Units(Some(units)) => KeyDigest::of(&units.to_le_bytes()),
        }
    }
}

impl Hash for KeyDigest {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0);
    }
}

/// The hasher of a [`DigestMap`]: a digest's first word is already uniform, so it is the
/// hash (SipHash over it again would only cost time).
#[derive(Default)]
pub(crate) struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = word;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by key digests.
pub(crate) type DigestMap<V> = HashMap<KeyDigest, V, BuildHasherDefault<DigestHasher>>;

/// The one integer or date column a grid reconcile sums.
#[derive(Clone, Debug)]
pub(crate) struct GridKey {
    pub(crate) column: KeyColumn,
    pub(crate) unit: GridUnit,
    /// Whether the column is the table's unique index, alone.
    pub(crate) unique: bool,
}

impl GridKey {
    /// Whether the column is the table's one-integer unique key: its ranges are integer
    /// chunks, which the source reads by index seeks.
    pub(crate) fn is_unique_integer(&self) -> bool {
        self.unique && self.unit == GridUnit::Integer
    }

    /// A key value in grid units as JSON: an integer, or a date's `YYYY-MM-DD`.
    pub(crate) fn json(&self, units: Option<i64>) -> serde_json::Value {
        match (units, self.unit) {
            (None, _) => serde_json::Value::Null,
            (Some(value), GridUnit::Integer) => value.into(),
            (Some(days), GridUnit::Days) => date_text(days).into(),
        }
    }
}

/// The columns a keyset reconcile compares on: the source orders them (its collation), the
/// writer only tests them for equality, in silver's types.
#[derive(Clone, Debug)]
pub(crate) struct KeysetKey {
    pub(crate) columns: Vec<KeyColumn>,
    /// Whether they are the table's unique index.
    pub(crate) unique: bool,
    /// Silver's type of each column: both sides' keys are cast to it before encoding.
    types: Vec<DataType>,
    converter: Arc<RowConverter>,
}

impl KeysetKey {
    /// The key columns of `batch` (by name) in silver's types, row-encoded.
    fn encode(&self, batch: &RecordBatch) -> Result<arrow::row::Rows> {
        let arrays = self
            .columns
            .iter()
            .zip(&self.types)
            .map(|(column, to)| Ok(arrow::compute::cast(&key_column(batch, &column.name)?, to)?))
            .collect::<Result<Vec<ArrayRef>>>()?;
        Ok(self.converter.convert_columns(&arrays)?)
    }

    /// The key columns' names.
    pub(crate) fn names(&self) -> Vec<String> {
        self.columns
            .iter()
            .map(|column| column.name.clone())
            .collect()
    }
}

/// The key of a reconcile.
#[derive(Clone, Debug)]
pub(crate) enum CompareKey {
    /// One integer or date column: tier 1 sums it on a grid.
    Grid(GridKey),
    /// Any other key: the source cuts the buckets.
    Keyset(KeysetKey),
}

impl CompareKey {
    /// The key columns' names, in key order.
    pub(crate) fn names(&self) -> Vec<String> {
        match self {
            CompareKey::Grid(key) => vec![key.column.name.clone()],
            CompareKey::Keyset(key) => key.names(),
        }
    }

    /// The key as the report and the result name it: the columns joined by commas.
    pub(crate) fn label(&self) -> String {
        self.names().join(", ")
    }

    /// Each row's key in `batch`, whose key columns go by their names.
    pub(crate) fn row_keys(&self, batch: &RecordBatch) -> Result<Vec<RowKey>> {
        match self {
            CompareKey::Grid(key) => Ok(units_of(&key_column(batch, &key.column.name)?, key)?
                .iter()
                .map(RowKey::Units)
                .collect()),
            CompareKey::Keyset(key) => Ok(key
                .encode(batch)?
                .iter()
                .map(|row| RowKey::Bytes(row.as_ref().into()))
                .collect()),
        }
    }

    /// Each row's key digest in `batch`: [`CompareKey::row_keys`] without keeping the keys.
    pub(crate) fn digests(&self, batch: &RecordBatch) -> Result<Vec<KeyDigest>> {
        match self {
            CompareKey::Grid(_) => Ok(self.row_keys(batch)?.iter().map(RowKey::digest).collect()),
            CompareKey::Keyset(key) => Ok(key
                .encode(batch)?
                .iter()
                .map(|row| KeyDigest::of(row.as_ref()))
                .collect()),
        }
    }

    /// A key as a JSON object of its columns (`{"order_id": 17}`; a NULL column `null`;
    /// integers as numbers, every other value as text).
    pub(crate) fn json(&self, key: &RowKey) -> serde_json::Value {
        match (self, key) {
            (CompareKey::Grid(grid), RowKey::Units(units)) => {
                serde_json::json!({ grid.column.name.clone(): grid.json(*units) })
            }
            (CompareKey::Keyset(keyset), RowKey::Bytes(bytes)) => keyset_json(keyset, bytes)
                .unwrap_or_else(
                    |error| serde_json::json!({ "undecodable_key": error.to_string() }),
                ),
            _ => serde_json::Value::Null,
        }
    }
}

/// The key column `name` of `batch`.
fn key_column(batch: &RecordBatch, name: &str) -> Result<ArrayRef> {
    batch
        .column_by_name(name)
        .cloned()
        .ok_or_else(|| WriterError::Internal(format!("the compared rows lack key column '{name}'")))
}

/// A row-encoded keyset key decoded to JSON.
fn keyset_json(key: &KeysetKey, bytes: &[u8]) -> Result<serde_json::Value> {
    let parser = key.converter.parser();
    let arrays = key.converter.convert_rows([parser.parse(bytes)])?;
    let mut object = serde_json::Map::new();
    for (column, array) in key.columns.iter().zip(&arrays) {
        let value = if array.is_null(0) {
            serde_json::Value::Null
        } else if column.is_integer() {
            let wide = arrow::compute::cast(array, &DataType::Int64)?;
            let wide = wide
                .as_any()
                .downcast_ref::<arrow::array::Int64Array>()
                .ok_or_else(|| WriterError::Internal("an integer key is not Int64".into()))?;
            wide.value(0).into()
        } else {
            let formatter = ArrayFormatter::try_new(array.as_ref(), &FormatOptions::default())?;
            formatter.value(0).to_string().into()
        };
        object.insert(column.name.clone(), value);
    }
    Ok(serde_json::Value::Object(object))
}

/// The columns a reconcile compares on, resolved against the capture instance.
pub(super) struct KeyColumns {
    columns: Vec<KeyColumn>,
    unique: bool,
}

/// The columns a reconcile compares on: `keys`, or the unique index CDC uses.
pub(super) fn key_columns(
    config: &ReconcileConfig,
    instance: &CaptureInstanceInfo,
) -> Result<KeyColumns> {
    let names = match &config.keys {
        Some(keys) => keys.clone(),
        None => instance.index_columns.clone(),
    };
    if names.is_empty() {
        return Err(WriterError::invalid(format!(
            "{} has no unique index CDC could name: pass the key columns to compare on (keys)",
            config.table
        )));
    }
    let columns = mssql_cdc_proto::keys::resolve_columns(&config.table, &names, &instance.columns)
        .map_err(|error| {
            WriterError::invalid(format!(
                "reconcile cannot compare {} on ({}): {error}",
                config.table,
                names.join(", ")
            ))
        })?;
    Ok(KeyColumns {
        unique: instance.index_columns == names,
        columns,
    })
}

impl KeyColumns {
    /// One integer or date column is a grid key; anything else a keyset key in the types
    /// silver (registered in `context`) holds its columns in.
    pub(super) async fn in_silver(self, context: &SessionContext) -> Result<CompareKey> {
        let KeyColumns { columns, unique } = self;
        if let [column] = columns.as_slice()
            && let Some(unit) = column.grid_unit()
        {
            return Ok(CompareKey::Grid(GridKey {
                column: column.clone(),
                unit,
                unique,
            }));
        }
        let silver = context.table("silver").await?.schema().as_arrow().clone();
        let types = columns
            .iter()
            .map(|column| {
                silver
                    .field_with_name(&column.name)
                    .map(|field| field.data_type().clone())
                    .map_err(|_| {
                        WriterError::invalid(format!(
                            "silver has no key column '{}' to compare on",
                            column.name
                        ))
                    })
            })
            .collect::<Result<Vec<DataType>>>()?;
        let converter = RowConverter::new(types.iter().cloned().map(SortField::new).collect())?;
        Ok(CompareKey::Keyset(KeysetKey {
            columns,
            unique,
            types,
            converter: Arc::new(converter),
        }))
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};
    use mssql_cdc_proto::types::{Length, SqlType};

    use super::*;

    fn region_and_id() -> CompareKey {
        let types = vec![DataType::Utf8, DataType::Int64];
        let converter = RowConverter::new(types.iter().cloned().map(SortField::new).collect())
            .expect("a converter");
        CompareKey::Keyset(KeysetKey {
            columns: vec![
                KeyColumn {
                    name: "region".into(),
                    sql_type: SqlType::NVarChar(Length::Limited(20)),
                },
                KeyColumn {
                    name: "id".into(),
                    sql_type: SqlType::BigInt,
                },
            ],
            unique: true,
            types,
            converter: Arc::new(converter),
        })
    }

    #[test]
    fn a_keys_digest_is_the_digest_of_its_row_key_and_tells_keys_apart() {
        let key = region_and_id();
        // The id arrives as Int32 from one side: cast to silver's Int64 first, equal bytes.
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int32, true),
                Field::new("region", DataType::Utf8, true),
            ])),
            vec![
                Arc::new(arrow::array::Int32Array::from(vec![
                    Some(1),
                    Some(1),
                    None,
                    Some(1),
                ])),
                Arc::new(StringArray::from(vec![
                    Some("north"),
                    Some("North"),
                    None,
                    Some("north"),
                ])),
            ],
        )
        .expect("a batch");
        let digests = key.digests(&batch).expect("digests");
        let from_keys: Vec<KeyDigest> = key
            .row_keys(&batch)
            .expect("row keys")
            .iter()
            .map(RowKey::digest)
            .collect();
        assert_eq!(digests, from_keys);
        assert_eq!(digests[0], digests[3], "equal keys, equal digests");
        assert_ne!(digests[0], digests[1], "letter case is another value");
        assert_ne!(digests[0], digests[2]);
        let wide = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("region", DataType::Utf8, true),
                Field::new("id", DataType::Int64, true),
            ])),
            vec![
                Arc::new(StringArray::from(vec!["north"])),
                Arc::new(Int64Array::from(vec![1])),
            ],
        )
        .expect("a batch");
        assert_eq!(key.digests(&wide).expect("digests")[0], digests[0]);
        let mut map = DigestMap::<u32>::default();
        for digest in &digests {
            *map.entry(*digest).or_default() += 1;
        }
        assert_eq!(map.len(), 3);
        assert_eq!(map[&digests[0]], 2);
    }
}
