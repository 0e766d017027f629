//! Keys a snapshot is cut on, and the bounds of its chunks.
//!
//! A unique index of one integer column is cut on integer bounds planned from row counts
//! ([`crate::chunking`]). Any other key (composite, string, date, datetime2,
//! uniqueidentifier, or `snapshot_keys` columns, unique or not, integers included) is cut on
//! **keyset bounds**: tuples of key values, each chunk the range `[lo, hi)` in the order the
//! source sorts the key in (its collation: SQL Server compares `'n'` and `'N'` equal under a
//! case-insensitive one). Only the source compares key values: clients carry them as the
//! source wrote them and hand them back, so no client needs to know a collation.
//!
//! A key value travels as JSON: `null`, an integer (integer columns), or text (every other
//! type, in a form the source casts back to the column's type without loss: SQL Server's
//! `CONVERT(..., 126)` for dates and times, canonical GUID text, decimal digits).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::types::SqlType;

/// One value of a key column.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KeyValue {
    /// SQL NULL (sorts before every value, as SQL Server sorts it).
    Null,
    /// A value of an integer column.
    Int(i64),
    /// A value of any other column, as text the source casts back to the column's type.
    Text(String),
}

/// The values of a key's columns, in key order.
pub type KeyTuple = Vec<KeyValue>;

/// A chunk bound: one integer, or a tuple of key values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Bound {
    /// A bound on one integer key.
    Int(i64),
    /// A keyset bound on the snapshot's key columns.
    Keys(KeyTuple),
}

/// A half-open range `[lo, hi)` of keyset bounds; `None` is unbounded on that side (NULL
/// sorts first, so an open `lo` holds the NULL keys).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysetRange {
    /// Inclusive lower bound.
    pub lo: Option<KeyTuple>,
    /// Exclusive upper bound.
    pub hi: Option<KeyTuple>,
}

/// A key column and its type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyColumn {
    /// The column name.
    pub name: String,
    /// Its SQL Server type.
    #[serde(
        serialize_with = "crate::catalog::serialize_sql_type",
        deserialize_with = "crate::catalog::deserialize_sql_type"
    )]
    pub sql_type: SqlType,
}

impl KeyColumn {
    /// Refuses a column no chunk bound can be cut on: `bit` (SQL Server has no MIN or MAX of
    /// it), the LOB types `text`, `ntext`, `image` and `xml` (not sortable), `rowversion`
    /// (changes under the read) and types this service does not serve.
    pub fn check_cuttable(&self) -> Result<()> {
        let refused = match &self.sql_type {
            SqlType::Bit => Some("bit has no MIN or MAX"),
            SqlType::Text | SqlType::NText | SqlType::Image | SqlType::Xml => {
                Some("SQL Server cannot sort it")
            }
            SqlType::RowVersion => Some("its values change while the snapshot is read"),
            SqlType::Unsupported(_) => Some("this service does not read the type"),
            _ => None,
        };
        match refused {
            Some(why) => Err(Error::invalid(format!(
                "a snapshot cannot be cut on column '{}' of type {}: {why}; name other columns \
                 in snapshot_keys",
                self.name, self.sql_type
            ))),
            None => Ok(()),
        }
    }

    /// Whether bounds on this column are integers (JSON numbers) rather than text.
    pub fn is_integer(&self) -> bool {
        self.sql_type.is_integer()
    }
}

/// How a column's values map to the integers of a reconcile grid (`key_sums`): integers as
/// they are, dates as day numbers from 1970-01-01 (`DATEDIFF_BIG(day, '19700101', d)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GridUnit {
    /// tinyint, smallint, int, bigint.
    Integer,
    /// date: days from 1970-01-01.
    Days,
}

impl KeyColumn {
    /// The grid unit of the column; `None` for a type a reconcile grid cannot sum (every
    /// type but the integers and `date`).
    pub fn grid_unit(&self) -> Option<GridUnit> {
        match self.sql_type {
            SqlType::Date => Some(GridUnit::Days),
            _ if self.is_integer() => Some(GridUnit::Integer),
            _ => None,
        }
    }

    /// [`KeyColumn::grid_unit`], or the error naming the column and its type.
    pub fn require_grid_unit(&self) -> Result<GridUnit> {
        self.grid_unit().ok_or_else(|| {
            Error::invalid(format!(
                "key sums need an integer or date column; '{}' is {}",
                self.name, self.sql_type
            ))
        })
    }
}

/// Resolves snapshot key names against a capture instance's columns (exact names), refusing
/// unknown, repeated and uncuttable columns.
pub fn resolve_columns(
    table: &str,
    names: &[String],
    columns: &[crate::catalog::CapturedColumn],
) -> Result<Vec<KeyColumn>> {
    if names.is_empty() {
        return Err(Error::invalid(format!(
            "{table} has no unique index: name the columns to cut its snapshot on \
             (snapshot_keys)"
        )));
    }
    let mut resolved: Vec<KeyColumn> = Vec::new();
    for name in names {
        if resolved.iter().any(|column| &column.name == name) {
            return Err(Error::invalid(format!(
                "snapshot key column '{name}' is named twice"
            )));
        }
        let column = columns
            .iter()
            .find(|column| &column.name == name)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "snapshot key column '{name}' is not a captured column of {table} (known: {})",
                    columns
                        .iter()
                        .map(|column| column.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        let key = KeyColumn {
            name: column.name.clone(),
            sql_type: column.sql_type.clone(),
        };
        key.check_cuttable()?;
        resolved.push(key);
    }
    Ok(resolved)
}

/// A seek for the key of the `(n + 1)`-th row, in key order, of a range of a table (the
/// seed's `key_bound`: `TOP (n + 1) ... ORDER BY key`, the last row kept).
///
/// - the bound n rows after `lo`: `from = lo` (inclusive), `to = MAX` (inclusive);
/// - whether `[lo, bound)` holds a row at all: `from = lo`, `to = bound` (exclusive), `n = 0`;
/// - the first key after MAX (`last_bound`): `from = MAX` (exclusive), no `to`, `n = 0`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySeek {
    /// Lower end of the range; `None` from the first row (NULL keys first).
    #[serde(default)]
    pub from: Option<KeyTuple>,
    /// Whether a row at `from` is in the range.
    #[serde(default = "yes")]
    pub from_inclusive: bool,
    /// Upper end of the range; `None` to the last row.
    #[serde(default)]
    pub to: Option<KeyTuple>,
    /// Whether a row at `to` is in the range.
    #[serde(default)]
    pub to_inclusive: bool,
    /// Rows skipped before the one whose key is returned.
    pub n: u64,
}

fn yes() -> bool {
    true
}

impl KeySeek {
    /// Checks that the bounds have one value per key column and integer columns get integers.
    pub fn check(&self, columns: &[KeyColumn]) -> Result<()> {
        for tuple in self.from.iter().chain(&self.to) {
            check_tuple(tuple, columns)?;
        }
        Ok(())
    }
}

/// A [`KeySeek`] checked against the key columns it seeks on: what a source's `key_bound` is
/// handed. Made only by [`KeysetSeek::new`], so its bounds always fit its columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeysetSeek {
    columns: Vec<KeyColumn>,
    seek: KeySeek,
}

impl KeysetSeek {
    /// `seek` on `columns`, refused unless each bound has one value per column, integers for
    /// integer columns.
    pub fn new(columns: Vec<KeyColumn>, seek: KeySeek) -> Result<Self> {
        seek.check(&columns)?;
        Ok(KeysetSeek { columns, seek })
    }

    /// The key columns, in key order.
    pub fn columns(&self) -> &[KeyColumn] {
        &self.columns
    }

    /// The range and the rows to skip.
    pub fn seek(&self) -> &KeySeek {
        &self.seek
    }
}

/// Checks that a bound has one value per key column, integers for integer columns.
pub fn check_tuple(tuple: &KeyTuple, columns: &[KeyColumn]) -> Result<()> {
    if tuple.len() != columns.len() {
        return Err(Error::invalid(format!(
            "a key bound needs {} values ({}), got {}",
            columns.len(),
            columns
                .iter()
                .map(|column| column.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            tuple.len()
        )));
    }
    for (value, column) in tuple.iter().zip(columns) {
        let fits = match value {
            KeyValue::Null => true,
            KeyValue::Int(_) => column.is_integer(),
            KeyValue::Text(_) => !column.is_integer(),
        };
        if !fits {
            return Err(Error::invalid(format!(
                "key column '{}' ({}) cannot be bound by {value:?}: integer columns take JSON \
                 numbers, the others text",
                column.name, column.sql_type
            )));
        }
    }
    Ok(())
}

/// Bounds about `rows` rows apart from the first key up to `to` (inclusive; `None`: the last
/// key), at most `most` of them, in the source's order: `[None, b1), [b1, b2), ..., [bn, ...)`
/// tile the key. `seek` asks the source for the key of the `(n + 1)`-th row of a range. Each
/// range holds at least one row: on columns that repeat (`unique` false), the `(rows + 1)`-th
/// row can hold the range's own first value (equal only under the source's collation, maybe),
/// so the walk seeks twice as far until the range holds a row (seed ADR 0028 Amendment 6).
pub async fn walk<E, F, Fut>(
    mut seek: F,
    (unique, to): (bool, Option<&KeyTuple>),
    rows: u64,
    most: Option<usize>,
) -> std::result::Result<Vec<KeyTuple>, E>
where
    F: FnMut(KeySeek) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<Option<KeyTuple>, E>>,
{
    let mut bounds: Vec<KeyTuple> = Vec::new();
    while most.is_none_or(|most| bounds.len() < most) {
        let lo = bounds.last().cloned();
        let mut n = rows;
        let bound = loop {
            let Some(bound) = seek(KeySeek {
                from: lo.clone(),
                from_inclusive: true,
                to: to.cloned(),
                to_inclusive: true,
                n,
            })
            .await?
            else {
                break None;
            };
            let holds_a_row = unique
                || seek(KeySeek {
                    from: lo.clone(),
                    from_inclusive: true,
                    to: Some(bound.clone()),
                    to_inclusive: false,
                    n: 0,
                })
                .await?
                .is_some();
            if holds_a_row {
                break Some(bound);
            }
            n = n.saturating_mul(2);
        };
        match bound {
            Some(bound) => bounds.push(bound),
            None => break,
        }
    }
    Ok(bounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_read_as_integers_or_tuples() {
        let int: Bound = serde_json::from_str("17").expect("int");
        assert_eq!(int, Bound::Int(17));
        let tuple: Bound = serde_json::from_str(r#"["North", 5, null]"#).expect("tuple");
        assert_eq!(
            tuple,
            Bound::Keys(vec![
                KeyValue::Text("North".into()),
                KeyValue::Int(5),
                KeyValue::Null
            ])
        );
        assert_eq!(
            serde_json::to_string(&tuple).expect("json"),
            r#"["North",5,null]"#
        );
    }

    #[test]
    fn uncuttable_types_are_refused_by_name() {
        for sql_type in ["bit", "text", "ntext", "image", "xml"] {
            let column = KeyColumn {
                name: "flag".into(),
                sql_type: sql_type.parse().expect("type"),
            };
            let error = column.check_cuttable().expect_err(sql_type).to_string();
            assert!(error.contains("'flag'"), "{error}");
        }
        for sql_type in [
            "int",
            "nvarchar(40)",
            "date",
            "datetime2(7)",
            "uniqueidentifier",
            "time(7)",
        ] {
            let column = KeyColumn {
                name: "k".into(),
                sql_type: sql_type.parse().expect("type"),
            };
            column.check_cuttable().expect(sql_type);
        }
    }

    #[test]
    fn tuples_are_checked_against_the_key_columns() {
        let columns = vec![
            KeyColumn {
                name: "region".into(),
                sql_type: "varchar(20)".parse().expect("type"),
            },
            KeyColumn {
                name: "id".into(),
                sql_type: "int".parse().expect("type"),
            },
        ];
        check_tuple(
            &vec![KeyValue::Text("a".into()), KeyValue::Int(1)],
            &columns,
        )
        .expect("ok");
        check_tuple(&vec![KeyValue::Null, KeyValue::Null], &columns).expect("nulls");
        assert!(check_tuple(&vec![KeyValue::Text("a".into())], &columns).is_err());
        assert!(check_tuple(&vec![KeyValue::Int(1), KeyValue::Int(1)], &columns).is_err());
        assert!(
            check_tuple(
                &vec![KeyValue::Text("a".into()), KeyValue::Text("1".into())],
                &columns
            )
            .is_err()
        );
    }
}
