//! The files of the seed library's `FakeCdcDatabase` (`mssql_cdc/fake.py` of
//! `mssql-cdc-pyspark`), read as that library's `FakeCdcClient` reads them:
//!
//! ```text
//! <dir>/lsn_time_mapping.jsonl   {"start_lsn", "tran_end_time"} per commit or idle entry
//! <dir>/min_lsn.json             capture instance -> its low watermark
//! <dir>/instances.json           capture instance -> {"table", "created", "columns"}
//! <dir>/keys.json                table -> its key column, or a list of them
//! <dir>/dropped.json             table -> lower names of columns DROP COLUMN removed
//! <dir>/computed.json            table -> lower names of its computed columns
//! <dir>/changes/<ci>.jsonl       {"start_lsn", "seqval", "command_id", "operation", "row"}
//! <dir>/ddl/<ci>.jsonl           {"lsn", "command"}
//! <dir>/tables/<table>.json      the table's current rows by key
//! ```
//!
//! The seed's writer replaces the JSON files whole and appends to the JSONL ones, change rows
//! before their commit's mapping entry; a line still being appended (no newline yet) is left
//! for the next read, so a reader that bounds its change reads by `max_lsn` sees whole commits.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::offset::CommitTime;

/// One row of `lsn_time_mapping.jsonl`.
#[derive(Clone, Debug, Deserialize)]
pub struct MappingEntry {
    /// The commit's LSN, `0x` and 20 hex digits.
    #[serde(deserialize_with = "lsn_text")]
    pub start_lsn: Lsn,
    /// Its commit time, ISO-8601 UTC without a zone.
    #[serde(deserialize_with = "time_text")]
    pub tran_end_time: CommitTime,
}

/// One capture instance of `instances.json`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct InstanceFile {
    /// The table it tracks (named after the table's first instance).
    pub table: String,
    /// When a later instance was added; `None` for a table's first.
    #[serde(default)]
    pub created: Option<String>,
    /// Its captured columns as `[name, Spark type]`; `None` when the seed's test gave none.
    #[serde(default)]
    pub columns: Option<Vec<(String, String)>>,
}

/// One change row of `changes/<ci>.jsonl`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChangeRow {
    /// The commit's LSN.
    #[serde(deserialize_with = "lsn_text")]
    pub start_lsn: Lsn,
    /// The operation's sequence value.
    #[serde(deserialize_with = "lsn_text")]
    pub seqval: Lsn,
    /// The statement's number; files of old releases have none.
    #[serde(default)]
    pub command_id: Option<i32>,
    /// 1 delete, 2 insert, 3 update (before), 4 update (after).
    pub operation: i32,
    /// The captured values by column name.
    pub row: Map<String, Value>,
}

/// One DDL entry of `ddl/<ci>.jsonl`.
#[derive(Clone, Debug, Deserialize)]
pub struct DdlRow {
    /// The LSN the statement was recorded at.
    #[serde(deserialize_with = "lsn_text")]
    pub lsn: Lsn,
    /// The statement.
    pub command: String,
}

/// A table's key columns: one name or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum KeyColumns {
    One(String),
    Many(Vec<String>),
}

/// The catalog state of the seed's database at one read: everything but change rows and
/// table rows, which are read per call.
#[derive(Clone, Debug)]
pub struct Catalog {
    /// The commit timeline, in LSN order.
    pub mapping: Vec<MappingEntry>,
    /// Capture instances: every one of `instances.json`, and those only `min_lsn.json`
    /// names (files of old releases) as their own table.
    pub instances: BTreeMap<String, InstanceFile>,
    /// Low watermarks.
    pub mins: BTreeMap<String, Lsn>,
    /// Key columns per table.
    pub keys: BTreeMap<String, Vec<String>>,
    /// Lower names of the columns computed per table (NULL in every change row).
    pub computed: BTreeMap<String, Vec<String>>,
}

/// The directory of a seed fake database.
#[derive(Clone, Debug)]
pub struct SeedFiles {
    dir: PathBuf,
}

impl SeedFiles {
    /// The files in `dir`, which must hold a `min_lsn.json` (the seed writes it first).
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.join("min_lsn.json").is_file() {
            return Err(Error::invalid(format!(
                "{} is not a database of the seed library's FakeCdcDatabase (no min_lsn.json)",
                dir.display()
            )));
        }
        Ok(SeedFiles {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the catalog.
    pub fn catalog(&self) -> Result<Catalog> {
        let mins: BTreeMap<String, String> = self.json("min_lsn.json")?;
        let mins = mins
            .into_iter()
            .map(|(name, lsn)| Ok((name, parse_lsn(&lsn)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let mut instances: BTreeMap<String, InstanceFile> = self.json("instances.json")?;
        for name in mins.keys() {
            instances
                .entry(name.clone())
                .or_insert_with(|| InstanceFile {
                    table: name.clone(),
                    ..InstanceFile::default()
                });
        }
        let keys: BTreeMap<String, KeyColumns> = self.json("keys.json")?;
        let keys = keys
            .into_iter()
            .map(|(table, key)| match key {
                KeyColumns::One(column) => (table, vec![column]),
                KeyColumns::Many(columns) => (table, columns),
            })
            .collect();
        Ok(Catalog {
            mapping: self.jsonl("lsn_time_mapping.jsonl")?,
            instances,
            mins,
            keys,
            computed: self.json("computed.json")?,
        })
    }

    /// The change rows of a capture instance, in file order.
    pub fn changes(&self, capture_instance: &str) -> Result<Vec<ChangeRow>> {
        self.jsonl(&format!("changes/{}.jsonl", file_name(capture_instance)?))
    }

    /// The DDL entries of a capture instance.
    pub fn ddl(&self, capture_instance: &str) -> Result<Vec<DdlRow>> {
        self.jsonl(&format!("ddl/{}.jsonl", file_name(capture_instance)?))
    }

    /// The current rows of a table (none when the seed keeps none: a table without a key).
    pub fn rows(&self, table: &str) -> Result<Vec<Map<String, Value>>> {
        let rows: BTreeMap<String, Map<String, Value>> =
            self.json(&format!("tables/{}.json", file_name(table)?))?;
        Ok(rows.into_values().collect())
    }

    /// A JSON object file; an absent file is empty, as the seed reads it.
    fn json<T: DeserializeOwned + Default>(&self, name: &str) -> Result<T> {
        match self.read(name)? {
            Some(text) => parse(name, 1, &text),
            None => Ok(T::default()),
        }
    }

    /// The whole lines of a JSONL file; an absent file has none.
    fn jsonl<T: DeserializeOwned>(&self, name: &str) -> Result<Vec<T>> {
        let Some(text) = self.read(name)? else {
            return Ok(Vec::new());
        };
        // The last line is whole only when a newline ends it: the writer may be appending.
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        whole
            .lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(number, line)| parse(name, number + 1, line))
            .collect()
    }

    /// The text of a file of the directory; `None` when it does not exist. Errors name the
    /// file as the seed does, never the server's path (they reach clients).
    fn read(&self, name: &str) -> Result<Option<String>> {
        match fs::read_to_string(self.dir.join(name)) {
            Ok(text) => Ok(Some(text)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(Error::SourceUnavailable(format!(
                "cannot read {name} of the seed's database: {error}"
            ))),
        }
    }
}

/// One JSON value of `name` (line `line`). Python's `json.dumps` writes a float that is not a
/// number as the bare token `NaN`, `Infinity` or `-Infinity`, which JSON has not: those are
/// read as text, so the column's type check refuses that one value (SQL Server's `float`
/// holds none of them) instead of the whole file failing to parse.
fn parse<T: DeserializeOwned>(name: &str, line: usize, text: &str) -> Result<T> {
    let text = quote_non_numbers(text);
    serde_json::from_str(&text).map_err(|error| {
        Error::Internal(format!(
            "{name} line {line} is not as the seed's FakeCdcDatabase writes it: {error}"
        ))
    })
}

/// `text` with the bare tokens `NaN`, `Infinity` and `-Infinity` outside strings quoted.
fn quote_non_numbers(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("NaN") && !text.contains("Infinity") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if !in_string
            && let Some(token) = ["NaN", "Infinity", "-Infinity"]
                .into_iter()
                .find(|token| rest.starts_with(token))
        {
            out.push('"');
            out.push_str(token);
            out.push('"');
            rest = &rest[token.len()..];
            continue;
        }
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            _ => {}
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

/// A name as the seed puts it in a file name, refused when it could leave the directory.
fn file_name(name: &str) -> Result<&str> {
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(Error::invalid(format!(
            "'{name}' cannot name a file of the seed's database"
        )));
    }
    Ok(name)
}

/// An LSN as the seed writes it (`0x` and 20 hex digits).
pub fn parse_lsn(text: &str) -> Result<Lsn> {
    text.parse()
        .map_err(|error| Error::Internal(format!("the seed's files hold a bad LSN: {error}")))
}

fn lsn_text<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Lsn, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

fn time_text<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<CommitTime, D::Error> {
    let text = String::deserialize(deserializer)?;
    CommitTime::parse_iso(&text).map_err(|error| serde::de::Error::custom(error.0))
}
