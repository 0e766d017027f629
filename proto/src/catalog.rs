//! The catalog's wire types: what the service's planning answers say about tables, capture
//! instances, keys and their extents. Every type here serializes to the JSON of
//! docs/protocol.md; SQL types travel as their T-SQL text (`decimal(18,4)`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::keys::KeysetRange;
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::types::{OutputColumn, SqlType};

/// A table name, `schema.table`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TableName {
    /// The schema, `dbo` by default.
    pub schema: String,
    /// The table.
    pub name: String,
}

impl TableName {
    /// A table name from its parts.
    pub fn new(schema: impl Into<String>, name: impl Into<String>) -> Self {
        TableName {
            schema: schema.into(),
            name: name.into(),
        }
    }

    /// The default capture instance name SQL Server gives the table: `<schema>_<table>`.
    pub fn default_capture_instance(&self) -> String {
        format!("{}_{}", self.schema, self.name)
    }
}

impl fmt::Display for TableName {
    /// `schema.table`, a part bracket-quoted (`]` doubled, as `QUOTENAME` writes it) when it
    /// holds a dot, a bracket or surrounding spaces, so every name prints to text that parses
    /// back to it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{}",
            display_part(&self.schema),
            display_part(&self.name)
        )
    }
}

fn display_part(part: &str) -> std::borrow::Cow<'_, str> {
    let plain = !part.contains(['.', '[', ']']) && part.trim() == part && !part.is_empty();
    if plain {
        part.into()
    } else {
        bracket_quote(part).into()
    }
}

/// `[name]` with `]` doubled, as T-SQL's `QUOTENAME` writes an identifier.
pub fn bracket_quote(name: &str) -> String {
    format!("[{}]", name.replace(']', "]]"))
}

/// Reads a bracket-quoted identifier: `text` starts just after its `[`. Returns the name
/// (`]]` read as `]`) and the text after its closing `]`; `None` when it is not closed.
pub fn unbracket(text: &str) -> Option<(String, &str)> {
    let mut name = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((index, c)) = chars.next() {
        if c != ']' {
            name.push(c);
        } else if chars.next_if(|(_, next)| *next == ']').is_some() {
            name.push(']');
        } else {
            return Some((name, &text[index + 1..]));
        }
    }
    None
}

impl FromStr for TableName {
    type Err = Error;

    /// Parses `schema.table` or `table` (schema `dbo`) as T-SQL reads a multipart name: a part
    /// in square brackets is taken as written, with `]]` standing for `]`, so it may hold dots
    /// and spaces (`[sales.eu].[order]]s]`); a bare part is trimmed and holds no dot or bracket.
    /// <https://learn.microsoft.com/sql/relational-databases/databases/database-identifiers>
    fn from_str(text: &str) -> Result<Self> {
        let malformed = |why: &str| {
            Error::invalid(format!(
                "table '{text}' must be written as schema.table, for example dbo.orders or \
                 [my schema].[my.table] ({why})"
            ))
        };
        let mut parts = Vec::new();
        let mut rest = text;
        loop {
            rest = rest.trim_start();
            let part = if let Some(quoted) = rest.strip_prefix('[') {
                let (part, after) =
                    unbracket(quoted).ok_or_else(|| malformed("a '[' is not closed"))?;
                rest = after.trim_start();
                part
            } else {
                let end = rest.find('.').unwrap_or(rest.len());
                let bare = &rest[..end];
                if bare.contains(['[', ']']) {
                    return Err(malformed(
                        "a bracket inside a name needs the name bracketed",
                    ));
                }
                rest = &rest[end..];
                bare.trim().to_string()
            };
            if part.is_empty() {
                return Err(malformed("a part is empty"));
            }
            parts.push(part);
            match rest.strip_prefix('.') {
                Some(after) => rest = after,
                None if rest.is_empty() => break,
                None => return Err(malformed("text follows a bracketed part")),
            }
        }
        let mut parts = parts.into_iter();
        match (parts.next(), parts.next(), parts.next()) {
            (Some(name), None, None) => Ok(TableName::new("dbo", name)),
            (Some(schema), Some(name), None) => Ok(TableName { schema, name }),
            _ => Err(malformed("more than two parts")),
        }
    }
}

/// One column a capture instance captures (`sys.sp_cdc_get_captured_columns`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapturedColumn {
    /// The column name.
    pub name: String,
    /// The source table's `column_id`.
    pub column_id: i32,
    /// Position in the change table (`column_ordinal`).
    pub ordinal: i32,
    /// The SQL Server type.
    #[serde(with = "sql_type_text")]
    pub sql_type: SqlType,
}

/// A capture instance of a tracked table (`sys.sp_cdc_help_change_data_capture`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureInstance {
    /// The capture instance name.
    pub name: String,
    /// The source table.
    pub table: TableName,
    /// The low endpoint of its change table (`cdc.change_tables.start_lsn`): the commit LSN
    /// of its enable, moved up by every cleanup; `None` until the capture job has processed
    /// the enable, and such an instance is not read yet (see [`CaptureInstance::is_active`]).
    /// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-change-tables-transact-sql>
    pub start_lsn: Option<Lsn>,
    /// When it was created (orders two instances of one table).
    pub create_date: CommitTime,
    /// Captured columns by ordinal.
    pub columns: Vec<CapturedColumn>,
    /// The columns of the unique index CDC uses (`index_column_list`); empty when none.
    pub index_columns: Vec<String>,
}

impl CaptureInstance {
    /// Whether the capture job has processed its enable, so its change table has a low
    /// endpoint and can be read.
    pub fn is_active(&self) -> bool {
        self.start_lsn.is_some()
    }

    /// The captured columns as output columns, in capture order.
    pub fn output_columns(&self) -> Vec<OutputColumn> {
        self.columns
            .iter()
            .map(|column| OutputColumn {
                name: column.name.clone(),
                sql_type: column.sql_type.clone(),
            })
            .collect()
    }
}

/// One DDL statement recorded for a capture instance (`sys.sp_cdc_get_ddl_history`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DdlEntry {
    /// The capture instance it was recorded for.
    pub capture_instance: String,
    /// The commit LSN of the DDL.
    pub ddl_lsn: Lsn,
    /// Its commit time.
    pub ddl_time: CommitTime,
    /// The statement text.
    pub ddl_command: String,
}

/// One tile of a range's change rows (the seed's NTILE split points).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tile {
    /// The last commit LSN in the tile; the next tile starts after it.
    pub last_lsn: Lsn,
    /// Change rows in the tile.
    pub rows: u64,
}

/// The key a snapshot is cut on and its extent, read before planning chunks
/// (`SELECT MIN(key), MAX(key)` and the row estimate of `sys.dm_db_partition_stats`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyExtent {
    /// The key column (the unique index CDC uses; one integer column).
    pub column: String,
    /// Its SQL Server type.
    #[serde(with = "sql_type_text")]
    pub sql_type: SqlType,
    /// The smallest key; `None` when the table is empty.
    pub min: Option<i64>,
    /// The largest key; `None` when the table is empty.
    pub max: Option<i64>,
    /// Rows in the table (an estimate on SQL Server).
    pub rows: u64,
}

/// Rows counted in one slice `[lo, hi)` of the key (`COUNT_BIG(*) ... GROUP BY` a grid).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyBucket {
    /// First key of the slice.
    pub lo: i64,
    /// First key after the slice (`None`: up to the largest key, BIGINT's maximum included).
    pub hi: Option<i64>,
    /// Rows whose key lies in the slice.
    pub rows: u64,
}

/// Rows and the sum of the key in one slice of a reconcile grid (`COUNT_BIG(*)` and
/// `SUM(CAST(key AS decimal(38,0)))` per slice, dates as day numbers from 1970-01-01): two
/// tables with equal rows and sums in every slice hold, with overwhelming likelihood, the
/// same keys there (a missed insert and a missed delete of other keys change the sum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySum {
    /// The slice and its rows.
    #[serde(flatten)]
    pub slice: KeyBucket,
    /// The sum of the slice's keys in grid units, as decimal digits (it passes BIGINT).
    #[serde(with = "decimal_text")]
    pub key_sum: i128,
    /// The sum of [`key_hash`] of the slice's keys, as decimal digits: unlike the plain sum
    /// it does not cancel when missing and extra keys add up alike ({10, 40} against
    /// {20, 30}). `None` from a server that predates it.
    #[serde(
        default,
        with = "optional_decimal_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub key_hash_sum: Option<i128>,
    /// The sum of the slice's rows' value digests ([`crate::digest`]) over the columns the
    /// call named, as decimal digits; `None` when none were named, or from a server that
    /// predates them.
    #[serde(
        default,
        with = "optional_decimal_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub value_sum: Option<i128>,
}

/// A key's hash for reconcile's tier 1: the first 7 bytes of SHA-256 of its grid units as
/// 8 bytes big-endian, read as a number below 2^56. What SQL Server computes as
/// `CAST(SUBSTRING(HASHBYTES('SHA2_256', CAST(CAST(u AS bigint) AS binary(8))), 1, 7) AS
/// bigint)`: an integer converts to binary as its big-endian bytes, and 7 bytes back to
/// bigint padded on the left with zeros (docs/reconcile.md, "Tier 1").
pub fn key_hash(units: i64) -> i64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(units.to_be_bytes());
    let mut bytes = [0u8; 8];
    bytes[1..].copy_from_slice(&digest[..7]);
    i64::from_be_bytes(bytes)
}

/// Every row of a table counted on a reconcile grid: the slices holding keys (keys outside
/// the grid in slices past its ends), and the rows whose key is NULL.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySums {
    /// Rows whose key is NULL.
    pub null_rows: u64,
    /// The sum of their value digests, as [`KeySum::value_sum`].
    #[serde(
        default,
        with = "optional_decimal_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub null_value_sum: Option<i128>,
    /// Slices with rows, in key order.
    pub slices: Vec<KeySum>,
}

impl KeySums {
    /// Counts keys (grid units; `None` is NULL) into `grid`'s slices, NULL keys apart: what
    /// a source without SQL computes, and what the writer computes over silver. Slices of
    /// the grid are counted in place; keys past its ends, rare, in a map.
    pub fn count(grid: &KeyGrid, keys: impl IntoIterator<Item = Option<i64>>) -> Self {
        let mut sums = Self::count_rows(grid, keys.into_iter().map(|key| (key, 0)));
        sums.null_value_sum = None;
        for slice in &mut sums.slices {
            slice.value_sum = None;
        }
        sums
    }

    /// [`KeySums::count`] of rows, each a key and its value digest ([`crate::digest`]),
    /// summing the digests per slice too.
    pub fn count_rows(grid: &KeyGrid, rows: impl IntoIterator<Item = (Option<i64>, i64)>) -> Self {
        /// Rows, key sum, key hash sum and value sum of one slice.
        type Counted = (u64, i128, i128, i128);
        let slices = usize::try_from(grid.slices())
            .unwrap_or(usize::MAX)
            .min(1 << 20);
        let mut inside: Vec<Counted> = vec![(0, 0, 0, 0); slices];
        let mut outside = std::collections::BTreeMap::<i128, Counted>::new();
        let (mut null_rows, mut null_value_sum) = (0, 0i128);
        for (key, digest) in rows {
            let Some(key) = key else {
                null_rows += 1;
                null_value_sum += i128::from(digest);
                continue;
            };
            let index = grid.index_of(key);
            let entry = match usize::try_from(index).ok().filter(|index| *index < slices) {
                Some(index) => &mut inside[index],
                None => outside.entry(index).or_default(),
            };
            entry.0 += 1;
            entry.1 += i128::from(key);
            entry.2 += i128::from(key_hash(key));
            entry.3 += i128::from(digest);
        }
        let inside = inside
            .into_iter()
            .enumerate()
            .map(|(index, counted)| (index as i128, counted));
        let mut all: Vec<(i128, Counted)> = inside
            .chain(outside)
            .filter(|(_, (rows, ..))| *rows > 0)
            .collect();
        all.sort_unstable_by_key(|(index, _)| *index);
        KeySums {
            null_rows,
            null_value_sum: Some(null_value_sum),
            slices: all
                .into_iter()
                .map(|(index, (rows, key_sum, key_hash_sum, value_sum))| KeySum {
                    slice: grid.slice(index, rows),
                    key_sum,
                    key_hash_sum: Some(key_hash_sum),
                    value_sum: Some(value_sum),
                })
                .collect(),
        }
    }
}

/// An `i128` as JSON text of decimal digits (a DECIMAL(38,0) passes JSON's safe integers):
/// `#[serde(with = "mssql_cdc_proto::catalog::decimal_text")]`.
pub mod decimal_text {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the digits.
    pub fn serialize<S: Serializer>(value: &i128, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_string())
    }

    /// Reads the digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i128, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// An optional `i128` as JSON text of decimal digits, absent when `None`.
pub mod optional_decimal_text {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the digits (with `skip_serializing_if = "Option::is_none"`, never `None`).
    pub fn serialize<S: Serializer>(
        value: &Option<i128>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => serializer.serialize_str(&value.to_string()),
            None => serializer.serialize_none(),
        }
    }

    /// Reads the digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<i128>, D::Error> {
        Option::<String>::deserialize(deserializer)?
            .map(|digits| digits.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A grid of key slices `[lo + i * width, lo + (i + 1) * width)` covering `[lo, hi]` (the last
/// slice may end after `hi`): what `key_buckets` counts. Made only by [`KeyGrid::new`], so
/// every grid a source is handed is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyGrid {
    lo: i64,
    hi: i64,
    width: u64,
}

impl KeyGrid {
    /// The grid of `width`-key slices over `[lo, hi]`; refused unless `lo <= hi` and
    /// `width >= 1`.
    pub fn new(lo: i64, hi: i64, width: u64) -> Result<Self> {
        if width == 0 || hi < lo {
            return Err(Error::invalid(format!(
                "key_buckets needs lo <= hi and width >= 1 (got lo {lo}, hi {hi}, width {width})"
            )));
        }
        Ok(KeyGrid { lo, hi, width })
    }

    /// The grid of at most `slices` equal slices over `[lo, hi]` (the fine grid a reconcile
    /// compares on); refused unless `lo <= hi` and `slices >= 1`.
    pub fn covering(lo: i64, hi: i64, slices: u64) -> Result<Self> {
        if slices == 0 {
            return Err(Error::invalid("a grid needs at least one slice"));
        }
        let span = (i128::from(hi) - i128::from(lo) + 1).max(1) as u128;
        let width = span.div_ceil(u128::from(slices)).min(u128::from(u64::MAX)) as u64;
        Self::new(lo, hi, width)
    }

    /// The first key of the grid.
    pub fn lo(&self) -> i64 {
        self.lo
    }

    /// The last key the grid covers.
    pub fn hi(&self) -> i64 {
        self.hi
    }

    /// Keys per slice.
    pub fn width(&self) -> u64 {
        self.width
    }

    /// How many slices cover `[lo, hi]`.
    pub fn slices(&self) -> u128 {
        ((i128::from(self.hi) - i128::from(self.lo)) / i128::from(self.width)) as u128 + 1
    }

    /// The index of the slice holding `key`; a key outside `[lo, hi]` gets the index of the
    /// slice it would lie in past the grid's ends (negative below `lo`).
    pub fn index_of(&self, key: i64) -> i128 {
        // 64-bit arithmetic where it cannot overflow (every key of a realistic grid).
        if let (Some(offset), Ok(width)) = (key.checked_sub(self.lo), i64::try_from(self.width)) {
            return i128::from(offset.div_euclid(width));
        }
        (i128::from(key) - i128::from(self.lo)).div_euclid(i128::from(self.width))
    }

    /// Slice `index` with its rows (i128: a grid reaching BIGINT's maximum does not
    /// overflow; a slice ending past it is open above, one starting below BIGINT's minimum
    /// starts there).
    pub fn slice(&self, index: i128, rows: u64) -> KeyBucket {
        let start = i128::from(self.lo) + index * i128::from(self.width);
        KeyBucket {
            lo: i64::try_from(start).unwrap_or(if start < 0 { i64::MIN } else { i64::MAX }),
            hi: i64::try_from(start + i128::from(self.width)).ok(),
            rows,
        }
    }

    /// Counts ascending keys into the grid's slices, empty slices left out; keys outside
    /// `[lo, hi]` are skipped.
    pub fn count(&self, keys: impl IntoIterator<Item = i64>) -> Vec<KeyBucket> {
        let mut buckets: Vec<KeyBucket> = Vec::new();
        for key in keys {
            if key < self.lo || key > self.hi {
                continue;
            }
            let slice = self.slice(self.index_of(key), 1);
            match buckets.last_mut() {
                Some(last) if last.lo == slice.lo => last.rows += 1,
                _ => buckets.push(slice),
            }
        }
        buckets
    }
}

/// A half-open range of the key, `[lo, hi)`; `None` is unbounded on that side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRange {
    /// Inclusive lower bound.
    pub lo: Option<i64>,
    /// Exclusive upper bound.
    pub hi: Option<i64>,
}

impl KeyRange {
    /// Whether `key` lies in the range.
    pub fn contains(&self, key: i64) -> bool {
        self.lo.is_none_or(|lo| key >= lo) && self.hi.is_none_or(|hi| key < hi)
    }
}

/// One piece of a snapshot read: a key range, tagged with its chunk number (`_chunk`) in a
/// chunked snapshot, untagged in a full one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPiece {
    /// The chunk number; `None` in a full snapshot.
    pub chunk: Option<i32>,
    /// The integer key range read (unbounded when `keyset` is set).
    pub range: KeyRange,
    /// The keyset range read, on the read's key columns, in a snapshot cut on keyset bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyset: Option<KeysetRange>,
}

mod sql_type_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::types::SqlType;

    /// Writes a SQL type as its T-SQL text.
    pub fn serialize<S: Serializer>(value: &SqlType, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_string())
    }

    /// Reads a SQL type from its T-SQL text.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SqlType, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

pub use sql_type_text::{deserialize as deserialize_sql_type, serialize as serialize_sql_type};
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_grids_are_valid_and_count_keys_into_their_slices() {
        assert!(KeyGrid::new(5, 4, 1).is_err(), "hi below lo");
        assert!(KeyGrid::new(1, 10, 0).is_err(), "zero width");
        let grid = KeyGrid::new(-3, 10, 5).expect("grid");
        assert_eq!(grid.slices(), 3);
        let buckets = grid.count([-3, -2, 1, 2, 3, 9, 10, 11]);
        let slices: Vec<(i64, Option<i64>, u64)> = buckets
            .iter()
            .map(|bucket| (bucket.lo, bucket.hi, bucket.rows))
            .collect();
        // 11 lies outside the grid; the last slice ends after hi.
        assert_eq!(
            slices,
            vec![(-3, Some(2), 3), (2, Some(7), 2), (7, Some(12), 2)]
        );
        // A grid reaching BIGINT's maximum: its last slice is open above.
        let top = KeyGrid::new(i64::MAX - 1, i64::MAX, 4).expect("top");
        assert_eq!(top.count([i64::MAX])[0].hi, None);
    }

    #[test]
    fn key_hashes_are_the_first_seven_bytes_of_sha_256_of_big_endian_units() {
        // Python: int.from_bytes(hashlib.sha256(struct.pack('>q', u)).digest()[:7], 'big')
        assert_eq!(key_hash(1), 57_744_572_931_796_342);
        assert_eq!(key_hash(-1), 5_246_518_446_940_622);
        assert_eq!(key_hash(20_454), 48_360_407_291_608_273);
        let grid = KeyGrid::new(0, 99, 100).expect("grid");
        let sums = KeySums::count(&grid, [Some(1), None, Some(20_454)]);
        let hashed: i128 = sums
            .slices
            .iter()
            .filter_map(|slice| slice.key_hash_sum)
            .sum();
        assert_eq!(hashed, 57_744_572_931_796_342 + 48_360_407_291_608_273);
        // An older server's answer has no hash sum.
        let older: KeySum =
            serde_json::from_str(r#"{"lo": 0, "hi": 100, "rows": 1, "key_sum": "1"}"#)
                .expect("json");
        assert_eq!(older.key_hash_sum, None);
        let written = serde_json::to_string(&sums.slices[0]).expect("json");
        let read: KeySum = serde_json::from_str(&written).expect("json");
        assert_eq!(read, sums.slices[0]);
    }

    #[test]
    fn table_names_parse_with_and_without_schema() {
        assert_eq!(
            "dbo.orders".parse::<TableName>().expect("ok"),
            TableName::new("dbo", "orders")
        );
        assert_eq!(
            "orders".parse::<TableName>().expect("ok"),
            TableName::new("dbo", "orders")
        );
        assert_eq!(
            "[sales].[order lines]".parse::<TableName>().expect("ok"),
            TableName::new("sales", "order lines")
        );
        assert!("a.b.c".parse::<TableName>().is_err());
        assert!(".orders".parse::<TableName>().is_err());
        assert_eq!(
            TableName::new("dbo", "orders").default_capture_instance(),
            "dbo_orders"
        );
    }

    #[test]
    fn table_names_parse_as_t_sql_multipart_names() {
        let parsed = |text: &str| TableName::from_str(text).map_err(|error| error.to_string());
        assert_eq!(parsed("dbo.orders"), Ok(TableName::new("dbo", "orders")));
        assert_eq!(parsed(" orders "), Ok(TableName::new("dbo", "orders")));
        assert_eq!(
            parsed("[dbo] . [orders]"),
            Ok(TableName::new("dbo", "orders"))
        );
        assert_eq!(
            parsed("[sales.eu].[order]]s]"),
            Ok(TableName::new("sales.eu", "order]s"))
        );
        assert_eq!(parsed("[a b ].t"), Ok(TableName::new("a b ", "t")));
        for bad in ["", "a.", ".b", "a.b.c", "[a", "a]b", "[a]x.b", "[].b"] {
            assert!(parsed(bad).is_err(), "{bad:?} is refused");
        }
        let odd = TableName::new("sales.eu", "order]s");
        assert_eq!(odd.to_string(), "[sales.eu].[order]]s]");
        assert_eq!(TableName::from_str(&odd.to_string()).expect("back"), odd);
        assert_eq!(TableName::new("dbo", "orders").to_string(), "dbo.orders");
    }
}
