//! Masking at the source: columns the server serves hashed, truncated or nulled.
//!
//! The masks file (`--masks`, docs/security.md "Masking at the source") names, per table,
//! the columns to mask and how ([`Mask`]); hashing is keyed by a secret file beside it, so
//! equal values hash equal (joins on the hash work) and nobody without the key can test a
//! guess against a hash. Every caller gets those columns masked, except a principal whose
//! `clear` grant (tokens file) names the table; no serve option asks for the clear form.
//!
//! A plan resolves the masks for its caller ([`MaskPolicy::served`]): the `FlightInfo`'s
//! schema and the signed ticket carry them, and the stream masks every batch before it is
//! encoded ([`ServedMasks::apply`]). A ticket is redeemed only by a caller whose masks are
//! the ticket's, so a masked caller cannot read a ticket planned for a clear one. A call
//! that would hand out or compare values in clear (keys to cut or seek on, values to digest
//! at the source) is refused for a masked column ([`MaskPolicy::refuse_masked`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, StringArray, StringBuilder, new_null_array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use ring::hmac;
use serde::Deserialize;

use super::auth::Principal;
use super::ticket::TicketColumn;
use crate::error::{Error, Result};
use crate::masking::{HASH_TYPE, MASK_METADATA_KEY, Mask};
use crate::source::TableName;
use crate::types::{OutputColumn, SQL_TYPE_METADATA_KEY};

/// The shortest hash key accepted: as many bytes as HMAC-SHA256's output.
const MIN_KEY_BYTES: usize = 32;

/// The masks file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MasksFile {
    /// The secret keying `hash` (relative to the masks file's folder).
    #[serde(default)]
    hash_key_file: Option<PathBuf>,
    /// `schema.table` → column → mask, in the file's order; a name given twice is refused
    /// (a JSON map would keep the last silently, and serve the first one's column clear).
    #[serde(deserialize_with = "entries")]
    tables: Vec<(String, Entries<String>)>,
}

/// A JSON object's entries in order, duplicates kept for the parser to refuse.
struct Entries<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Entries<V> {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = Entries<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries<V>, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData))
    }
}

fn entries<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<(String, Entries<String>)>, D::Error> {
    Entries::deserialize(deserializer).map(|entries| entries.0)
}

/// One table's masked columns, names lower-cased (SQL Server's default collations ignore
/// case, and a mask must not miss `Email` for `email`).
struct TableMasks {
    table: String,
    columns: Vec<(String, Mask)>,
}

/// The server's masks and the key that hashes.
#[derive(Default)]
pub struct MaskPolicy {
    tables: Vec<TableMasks>,
    key: Option<hmac::Key>,
    key_file: Option<PathBuf>,
}

impl std::fmt::Debug for MaskPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tables: Vec<&str> = self.tables.iter().map(|t| t.table.as_str()).collect();
        f.debug_struct("MaskPolicy")
            .field("tables", &tables)
            .field("key", &self.key.as_ref().map(|_| "<secret>"))
            .finish()
    }
}

impl MaskPolicy {
    /// No masks: every column served as it is.
    pub fn none() -> Self {
        MaskPolicy::default()
    }

    /// Reads a masks file and the hash key it names.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read(path)
            .map_err(|error| Error::io(format!("reading masks {}", path.display()), error))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut key_file = None;
        let mut policy = Self::parse(&text, |key| {
            let key = folder.join(key);
            let bytes = std::fs::read(&key)
                .map_err(|error| Error::io(format!("reading hash key {}", key.display()), error))?;
            key_file = Some(key);
            Ok(bytes)
        })
        .map_err(|error| Error::invalid(format!("{}: {error}", path.display())))?;
        policy.key_file = key_file;
        Ok(policy)
    }

    /// The hash key's file, when one was read.
    pub fn hash_key_file(&self) -> Option<&Path> {
        self.key_file.as_deref()
    }

    /// Parses a masks file's JSON; `read_key` reads the hash key file it names.
    pub fn parse(text: &[u8], read_key: impl FnOnce(&Path) -> Result<Vec<u8>>) -> Result<Self> {
        let file: MasksFile = serde_json::from_slice(text)
            .map_err(|error| Error::invalid(format!("masks file: {error}")))?;
        let mut tables: Vec<TableMasks> = Vec::new();
        for (table, Entries(columns)) in file.tables {
            let name: TableName = table
                .parse()
                .map_err(|error| Error::invalid(format!("masks file: table '{table}': {error}")))?;
            let name = name.to_string().to_lowercase();
            if tables.iter().any(|other| other.table == name) {
                return Err(Error::invalid(format!(
                    "masks file: table '{table}' appears twice"
                )));
            }
            let mut masked: Vec<(String, Mask)> = Vec::new();
            for (column, mask) in columns {
                let mask: Mask = mask.parse().map_err(|error| {
                    Error::invalid(format!("masks file: {table}.{column}: {error}"))
                })?;
                let column = column.trim().to_lowercase();
                if column.is_empty() || masked.iter().any(|(other, _)| *other == column) {
                    return Err(Error::invalid(format!(
                        "masks file: table '{table}' names a column twice or an empty one"
                    )));
                }
                masked.push((column, mask));
            }
            tables.push(TableMasks {
                table: name,
                columns: masked,
            });
        }
        let hashes = tables
            .iter()
            .any(|table| table.columns.iter().any(|(_, mask)| *mask == Mask::Hash));
        let key = match (file.hash_key_file, hashes) {
            (Some(path), _) => Some(hash_key(&read_key(&path)?)?),
            (None, true) => {
                return Err(Error::invalid(
                    "masks file: a column is hashed but no hash_key_file is named (make one \
                     with `openssl rand -hex 32 > mask.key`)",
                ));
            }
            (None, false) => None,
        };
        Ok(MaskPolicy {
            tables,
            key,
            key_file: None,
        })
    }

    /// The masks file's entries of `table`, whoever asks.
    fn of_table(&self, table: &TableName) -> Option<&TableMasks> {
        let name = table.to_string().to_lowercase();
        self.tables.iter().find(|masks| masks.table == name)
    }

    /// The masked columns of `table` for `principal` (none with a `clear` grant).
    fn masks_for(&self, principal: &Principal, table: &TableName) -> &[(String, Mask)] {
        match self.of_table(table) {
            Some(masks) if !principal.reads_clear(table) => &masks.columns,
            _ => &[],
        }
    }

    /// Whether the masks file masks a column of `table` (for some caller).
    pub fn masks_table(&self, table: &TableName) -> bool {
        self.of_table(table).is_some()
    }

    /// `INVALID_ARGUMENT` when the masks file does not fit `table`'s capture instances: a
    /// masked name no instance captures (a typo, or a column renamed: its new name would be
    /// served clear) or a column of the unique index CDC uses (a truncated or nulled key
    /// merges rows, and a hashed one still shows its order in every read). The table's plans
    /// are refused until the masks file is fixed: failing closed, never serving clear.
    pub fn check_table(
        &self,
        table: &TableName,
        instances: &[crate::source::CaptureInstance],
    ) -> Result<()> {
        let Some(masks) = self.of_table(table) else {
            return Ok(());
        };
        for (column, mask) in &masks.columns {
            let same = |name: &String| name.to_lowercase() == *column;
            if !instances
                .iter()
                .any(|instance| instance.columns.iter().any(|captured| same(&captured.name)))
            {
                return Err(Error::invalid(format!(
                    "the server's masks file masks {table}.{column} ({mask}), which no capture \
                     instance of the table captures: its reads are refused until the masks \
                     file names the column as captured (a renamed column would be served \
                     clear under its new name)"
                )));
            }
            if instances
                .iter()
                .any(|instance| instance.index_columns.iter().any(same))
            {
                return Err(Error::invalid(format!(
                    "the server's masks file masks {table}.{column} ({mask}), a column of the \
                     unique index CDC uses: a key cannot be masked (truncated or nulled keys \
                     merge rows, and every read shows a key's order); its reads are refused \
                     until the masks file leaves it out"
                )));
            }
        }
        Ok(())
    }

    /// The mask of `column` of `table` served to `principal`.
    pub fn mask_of(&self, principal: &Principal, table: &TableName, column: &str) -> Option<Mask> {
        let column = column.to_lowercase();
        self.masks_for(principal, table)
            .iter()
            .find(|(name, _)| *name == column)
            .map(|(_, mask)| *mask)
    }

    /// The masks `principal` is served `columns` of `table` with; an error when a mask does
    /// not fit its column's type (a truncated number), which the masks file must fix.
    pub fn served(
        &self,
        principal: &Principal,
        table: &TableName,
        columns: &[OutputColumn],
    ) -> Result<ServedMasks> {
        let masks = columns
            .iter()
            .map(|column| {
                let mask = self.mask_of(principal, table, &column.name);
                if let Some(mask) = mask {
                    mask.served_type(&column.sql_type).map_err(|error| {
                        Error::invalid(format!(
                            "the server's masks file: {table}.{}: {error}",
                            column.name
                        ))
                    })?;
                }
                Ok(mask)
            })
            .collect::<Result<Vec<_>>>()?;
        let key = masks
            .contains(&Some(Mask::Hash))
            .then(|| self.key.clone())
            .flatten();
        Ok(ServedMasks {
            masks,
            key: key.map(Arc::new),
        })
    }

    /// `TicketMasksChanged` unless the key columns a snapshot ticket is cut on carry the
    /// masks `principal` is served them with (its bounds hold their values).
    pub fn check_ticket_keys(
        &self,
        principal: &Principal,
        table: &TableName,
        keys: &[TicketColumn],
    ) -> Result<()> {
        let differs = keys.iter().any(|key| {
            let mask = self.mask_of(principal, table, &key.name);
            mask.map(|mask| mask.to_string()).unwrap_or_default() != key.mask
        });
        match differs {
            true => Err(masks_changed()),
            false => Ok(()),
        }
    }

    /// `Masked` when `principal` gets a column of `names` of `table` masked: `what` needs
    /// its values in clear.
    pub fn refuse_masked<'a>(
        &self,
        principal: &Principal,
        table: &TableName,
        names: impl IntoIterator<Item = &'a str>,
        what: &str,
    ) -> Result<()> {
        for name in names {
            if let Some(mask) = self.mask_of(principal, table, name) {
                return Err(Error::Masked(format!(
                    "{table}.{name} is served to '{}' masked ({mask}): {what} would reveal \
                     its values in clear; the server's masks file masks it, and only a \
                     principal with a clear grant on the table may {what}",
                    principal.name
                )));
            }
        }
        Ok(())
    }
}

/// A ticket planned under other masks than its redeemer's.
fn masks_changed() -> Error {
    Error::TicketMasksChanged(
        "the ticket's masks are not this caller's (planned by a caller the server serves \
         another form, or before the masks file changed): plan the read again"
            .into(),
    )
}

/// A hash key: the file's bytes, a final line break left off.
fn hash_key(bytes: &[u8]) -> Result<hmac::Key> {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    if bytes.len() < MIN_KEY_BYTES {
        return Err(Error::invalid(format!(
            "the hash key needs at least {MIN_KEY_BYTES} bytes (make one with `openssl rand \
             -hex 32`): a short key lets anyone holding hashes test guesses offline"
        )));
    }
    Ok(hmac::Key::new(hmac::HMAC_SHA256, bytes))
}

/// The masks of one read's captured columns, in their order.
#[derive(Clone, Default)]
pub struct ServedMasks {
    masks: Vec<Option<Mask>>,
    key: Option<Arc<hmac::Key>>,
}

impl std::fmt::Debug for ServedMasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.masks).finish()
    }
}

impl ServedMasks {
    /// Whether no column is masked.
    pub fn is_clear(&self) -> bool {
        self.masks.iter().all(Option::is_none)
    }

    /// The ticket's columns of `columns`, each with its mask.
    pub fn ticket_columns(&self, columns: &[OutputColumn]) -> Vec<TicketColumn> {
        columns
            .iter()
            .enumerate()
            .map(|(index, column)| {
                let mut ticket = TicketColumn::of(column);
                if let Some(Some(mask)) = self.masks.get(index) {
                    ticket.mask = mask.to_string();
                }
                ticket
            })
            .collect()
    }

    /// `TicketMasksChanged` unless a ticket's columns carry exactly these masks: a ticket
    /// planned for another caller (or before the masks changed) is not redeemed.
    pub fn check_ticket(&self, columns: &[TicketColumn]) -> Result<()> {
        let asked: Vec<Option<Mask>> = columns
            .iter()
            .map(|column| match column.mask.as_str() {
                "" => Ok(None),
                text => text.parse().map(Some).map_err(Error::TicketMalformed),
            })
            .collect::<Result<_>>()?;
        match asked == self.masks {
            true => Ok(()),
            false => Err(masks_changed()),
        }
    }

    /// `schema` with its captured columns (from `first_captured` on) as masked: the served type, and
    /// the mask in the field's metadata.
    pub fn schema(&self, schema: SchemaRef, first_captured: usize) -> SchemaRef {
        if self.is_clear() {
            return schema;
        }
        let fields: Vec<Field> = schema
            .fields()
            .iter()
            .enumerate()
            .map(|(index, field)| {
                let mask = index
                    .checked_sub(first_captured)
                    .and_then(|index| self.masks.get(index).copied().flatten());
                match mask {
                    Some(mask) => masked_field(field, mask),
                    None => field.as_ref().clone(),
                }
            })
            .collect();
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
    }

    /// `batch` with its captured columns (from `first_captured` on) masked, under `schema` (what
    /// [`ServedMasks::schema`] made of the batch's).
    pub fn apply(
        &self,
        batch: RecordBatch,
        first_captured: usize,
        schema: &SchemaRef,
    ) -> Result<RecordBatch> {
        if self.is_clear() {
            return Ok(batch);
        }
        let mut columns: Vec<ArrayRef> = batch.columns().to_vec();
        for (index, mask) in self.masks.iter().enumerate() {
            let Some(mask) = mask else { continue };
            let column = columns.get_mut(first_captured + index).ok_or_else(|| {
                Error::Internal(format!("a masked column {index} past the batch's columns"))
            })?;
            *column = self.masked_column(column, *mask)?;
        }
        Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
    }

    /// `column` masked by `mask`.
    fn masked_column(&self, column: &ArrayRef, mask: Mask) -> Result<ArrayRef> {
        Ok(match mask {
            Mask::Null => new_null_array(column.data_type(), column.len()),
            Mask::Truncate(n) => truncated(column, n as usize)?,
            Mask::Hash => {
                let key = self
                    .key
                    .as_deref()
                    .ok_or_else(|| Error::Internal("a hashed column without a key".into()))?;
                let mut hex = [0u8; crate::masking::HASH_CHARS as usize];
                let mut hashes =
                    StringBuilder::with_capacity(column.len(), hex.len() * column.len());
                crate::digest::each_text(column.as_ref(), |text| match text {
                    None => hashes.append_null(),
                    Some(text) => {
                        let tag = hmac::sign(key, text);
                        hex::encode_to_slice(tag.as_ref(), &mut hex)
                            .expect("an HMAC-SHA256 is 32 bytes, 64 hex digits");
                        hashes.append_value(std::str::from_utf8(&hex).expect("hex is ASCII"));
                    }
                })?;
                Arc::new(hashes.finish())
            }
        })
    }
}

/// The first `n` characters of each text, or bytes of each binary value.
fn truncated(column: &ArrayRef, n: usize) -> Result<ArrayRef> {
    match column.data_type() {
        DataType::Utf8 => {
            let cut: StringArray = column
                .as_string::<i32>()
                .iter()
                .map(|text| {
                    text.map(|text| match text.char_indices().nth(n) {
                        Some((end, _)) => &text[..end],
                        None => text,
                    })
                })
                .collect();
            Ok(Arc::new(cut))
        }
        DataType::Binary => {
            let cut: BinaryArray = column
                .as_binary::<i32>()
                .iter()
                .map(|value| value.map(|value| &value[..value.len().min(n)]))
                .collect();
            Ok(Arc::new(cut))
        }
        other => Err(Error::Internal(format!(
            "truncate of a {other} column (the plan checks types)"
        ))),
    }
}

/// `field` as its mask serves it.
fn masked_field(field: &Field, mask: Mask) -> Field {
    let mut metadata = field.metadata().clone();
    metadata.insert(MASK_METADATA_KEY.to_string(), mask.to_string());
    let data_type = match mask {
        Mask::Hash => {
            metadata.insert(SQL_TYPE_METADATA_KEY.to_string(), HASH_TYPE.to_string());
            HASH_TYPE.arrow_type().unwrap_or(DataType::Utf8)
        }
        Mask::Truncate(_) | Mask::Null => field.data_type().clone(),
    };
    Field::new(field.name(), data_type, true).with_metadata(metadata)
}

mod recut;
pub use recut::Recut;

#[cfg(test)]
mod tests;
