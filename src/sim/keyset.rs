//! Keyset seeks of the simulated database, compared as SQL Server compares.
//!
//! Character columns compare under a case-insensitive, accent-sensitive collation that
//! ignores trailing spaces (SQL Server's default `SQL_Latin1_General_CP1_CI_AS` on ASCII
//! text): `'north'`, `'North'` and `'north '` are one value, and `'alpha' < 'Bravo'` although
//! bytes order them the other way. `uniqueidentifier` sorts by its last group first, as SQL
//! Server sorts it. NULL sorts first. A client that compared key values itself would cut
//! wrong chunks here, as it would on SQL Server; clients only hand the source's values back.
//!
//! Every seek computes the key of each current row and sorts them (n log n in the table),
//! which suits the test-sized tables the simulator serves.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use arrow::array::{
    Array, ArrayRef, AsArray, Date32Array, Decimal128Array, Float32Array, Float64Array, Int16Array,
    Int32Array, Int64Array, TimestampMicrosecondArray,
};
use arrow::datatypes::DataType;

use super::storage::TableDef;
use super::values::ColumnBuilder;
use crate::error::{Error, Result};
use crate::keys::{KeyColumn, KeySeek, KeyTuple, KeyValue, KeysetRange};
use crate::types::SqlType;

/// Compares two values of a column of `sql_type` as SQL Server does.
pub fn compare_values(sql_type: &SqlType, a: &KeyValue, b: &KeyValue) -> Ordering {
    match (a, b) {
        (KeyValue::Null, KeyValue::Null) => Ordering::Equal,
        (KeyValue::Null, _) => Ordering::Less,
        (_, KeyValue::Null) => Ordering::Greater,
        (KeyValue::Int(a), KeyValue::Int(b)) => a.cmp(b),
        (KeyValue::Text(a), KeyValue::Text(b)) => compare_text(sql_type, a, b),
        // Mixed kinds are refused by `check_tuple` before any comparison.
        (KeyValue::Int(_), KeyValue::Text(_)) => Ordering::Less,
        (KeyValue::Text(_), KeyValue::Int(_)) => Ordering::Greater,
    }
}

fn compare_text(sql_type: &SqlType, a: &str, b: &str) -> Ordering {
    match sql_type {
        SqlType::Char(_) | SqlType::VarChar(_) | SqlType::NChar(_) | SqlType::NVarChar(_) => {
            // Folded char by char, not into new strings: a keyset read compares every row.
            let (a, b) = (a.trim_end_matches(' '), b.trim_end_matches(' '));
            a.chars()
                .flat_map(char::to_lowercase)
                .cmp(b.chars().flat_map(char::to_lowercase))
        }
        SqlType::UniqueIdentifier => guid_order(a).cmp(&guid_order(b)),
        SqlType::Real
        | SqlType::Float
        | SqlType::Decimal { .. }
        | SqlType::Money
        | SqlType::SmallMoney => {
            let number = |text: &str| text.parse::<f64>().unwrap_or(f64::NAN);
            number(a).total_cmp(&number(b))
        }
        // Dates and times are written at a fixed width (`key_value`), binaries as 0x hex.
        _ => a.cmp(b),
    }
}

/// SQL Server's `uniqueidentifier` order: the last group (6 bytes), then the fourth, third,
/// second and first.
fn guid_order(text: &str) -> Vec<String> {
    let mut groups: Vec<String> = text.split('-').map(str::to_uppercase).collect();
    groups.reverse();
    groups
}

/// Compares two key tuples column by column.
pub fn compare_tuples(columns: &[KeyColumn], a: &KeyTuple, b: &KeyTuple) -> Ordering {
    for ((column, a), b) in columns.iter().zip(a).zip(b) {
        match compare_values(&column.sql_type, a, b) {
            Ordering::Equal => continue,
            other => return other,
        }
    }
    Ordering::Equal
}

/// Whether `key` lies in `[range.lo, range.hi)`.
pub fn in_range(columns: &[KeyColumn], range: &KeysetRange, key: &KeyTuple) -> bool {
    range
        .lo
        .as_ref()
        .is_none_or(|lo| compare_tuples(columns, key, lo) != Ordering::Less)
        && range
            .hi
            .as_ref()
            .is_none_or(|hi| compare_tuples(columns, key, hi) == Ordering::Less)
}

/// Whether `key` lies in the seek's range.
pub fn in_seek(columns: &[KeyColumn], seek: &KeySeek, key: &KeyTuple) -> bool {
    let above = seek
        .from
        .as_ref()
        .is_none_or(|from| match compare_tuples(columns, key, from) {
            Ordering::Greater => true,
            Ordering::Equal => seek.from_inclusive,
            Ordering::Less => false,
        });
    let below = seek
        .to
        .as_ref()
        .is_none_or(|to| match compare_tuples(columns, key, to) {
            Ordering::Less => true,
            Ordering::Equal => seek.to_inclusive,
            Ordering::Greater => false,
        });
    above && below
}

/// The key tuples of the rows `(row key, content)`, in the rows' order.
pub fn row_keys(
    definition: &TableDef,
    columns: &[KeyColumn],
    rows: &BTreeMap<i64, u64>,
) -> Result<Vec<KeyTuple>> {
    let mut arrays: Vec<ArrayRef> = Vec::new();
    for column in columns {
        let source = definition.column(&column.name).ok_or_else(|| {
            Error::invalid(format!(
                "{} has no column '{}'",
                definition.table, column.name
            ))
        })?;
        let mut builder = ColumnBuilder::for_sql_type(&source.sql_type, rows.len());
        let is_key = source.name == definition.key;
        for (key, content) in rows {
            builder.append_generated(source, is_key, *key, *content);
        }
        arrays.push(builder.finish());
    }
    (0..rows.len())
        .map(|row| arrays.iter().map(|array| key_value(array, row)).collect())
        .collect()
}

/// The rows of `[range.lo, range.hi)` in key order (ties in row-key order, as a heap's are
/// stable): every row's key is computed, only the range's are sorted.
pub fn rows_in_range(
    definition: &TableDef,
    columns: &[KeyColumn],
    rows: &BTreeMap<i64, u64>,
    range: &KeysetRange,
) -> Result<Vec<(i64, u64)>> {
    let keys = row_keys(definition, columns, rows)?;
    let mut inside: Vec<(KeyTuple, (i64, u64))> = keys
        .into_iter()
        .zip(rows.iter().map(|(key, content)| (*key, *content)))
        .filter(|(key, _)| in_range(columns, range, key))
        .collect();
    inside.sort_by(|(a, ra), (b, rb)| compare_tuples(columns, a, b).then(ra.0.cmp(&rb.0)));
    Ok(inside.into_iter().map(|(_, row)| row).collect())
}

/// The key of the `(n + 1)`-th row of the seek's range.
pub fn seek(
    definition: &TableDef,
    columns: &[KeyColumn],
    rows: &BTreeMap<i64, u64>,
    seek: &KeySeek,
) -> Result<Option<KeyTuple>> {
    Ok(nth_key(columns, row_keys(definition, columns, rows)?, seek))
}

/// The key of the `(n + 1)`-th of `keys` (every row's, in any order) in the seek's range.
pub fn nth_key(columns: &[KeyColumn], keys: Vec<KeyTuple>, seek: &KeySeek) -> Option<KeyTuple> {
    // The (n + 1)-th smallest key of the range: a selection, not a sort of the whole table
    // per seek. Equal keys are the same value whichever of them is picked.
    let mut keys: Vec<KeyTuple> = keys
        .into_iter()
        .filter(|key| in_seek(columns, seek, key))
        .collect();
    let n = usize::try_from(seek.n).unwrap_or(usize::MAX);
    if n >= keys.len() {
        return None;
    }
    let (_, nth, _) = keys.select_nth_unstable_by(n, |a, b| compare_tuples(columns, a, b));
    Some(std::mem::take(nth))
}

/// A key value of one row of an array built by [`ColumnBuilder`], in the text form the
/// simulator writes: dates `YYYY-MM-DD`, date-times `YYYY-MM-DDTHH:MM:SS.ffffff`.
pub fn key_value(array: &ArrayRef, row: usize) -> Result<KeyValue> {
    if array.is_null(row) {
        return Ok(KeyValue::Null);
    }
    Ok(match array.data_type() {
        DataType::Int16 => KeyValue::Int(i64::from(
            array
                .as_any()
                .downcast_ref::<Int16Array>()
                .map_or(0, |a| a.value(row)),
        )),
        DataType::Int32 => KeyValue::Int(i64::from(
            array
                .as_any()
                .downcast_ref::<Int32Array>()
                .map_or(0, |a| a.value(row)),
        )),
        DataType::Int64 => KeyValue::Int(
            array
                .as_any()
                .downcast_ref::<Int64Array>()
                .map_or(0, |a| a.value(row)),
        ),
        DataType::Utf8 => KeyValue::Text(array.as_string::<i32>().value(row).to_string()),
        DataType::Date32 => {
            let days = array
                .as_any()
                .downcast_ref::<Date32Array>()
                .map_or(0, |a| a.value(row));
            let date = chrono::NaiveDate::from_num_days_from_ce_opt(days + 719_163)
                .ok_or_else(|| Error::Internal(format!("date {days} out of range")))?;
            KeyValue::Text(date.format("%Y-%m-%d").to_string())
        }
        DataType::Timestamp(..) => {
            let micros = array
                .as_any()
                .downcast_ref::<TimestampMicrosecondArray>()
                .map_or(0, |a| a.value(row));
            let time = chrono::DateTime::from_timestamp_micros(micros)
                .ok_or_else(|| Error::Internal(format!("timestamp {micros} out of range")))?;
            KeyValue::Text(time.format("%Y-%m-%dT%H:%M:%S%.6f").to_string())
        }
        DataType::Decimal128(_, scale) => {
            let value = array
                .as_any()
                .downcast_ref::<Decimal128Array>()
                .map_or(0, |a| a.value(row));
            KeyValue::Text(format_decimal(value, *scale))
        }
        DataType::Float32 => KeyValue::Text(
            array
                .as_any()
                .downcast_ref::<Float32Array>()
                .map_or(0.0, |a| a.value(row))
                .to_string(),
        ),
        DataType::Float64 => KeyValue::Text(
            array
                .as_any()
                .downcast_ref::<Float64Array>()
                .map_or(0.0, |a| a.value(row))
                .to_string(),
        ),
        DataType::Binary => {
            let bytes = array.as_binary::<i32>().value(row);
            KeyValue::Text(format!(
                "0x{}",
                bytes.iter().map(|b| format!("{b:02X}")).collect::<String>()
            ))
        }
        other => {
            return Err(Error::invalid(format!(
                "the simulator cannot cut a snapshot on a column served as {other}"
            )));
        }
    })
}

fn format_decimal(value: i128, scale: i8) -> String {
    if scale <= 0 {
        return value.to_string();
    }
    let divisor = 10i128.pow(u32::from(scale.unsigned_abs()));
    let sign = if value < 0 { "-" } else { "" };
    let magnitude = value.unsigned_abs();
    format!(
        "{sign}{}.{:0width$}",
        magnitude / divisor.unsigned_abs(),
        magnitude % divisor.unsigned_abs(),
        width = usize::from(scale.unsigned_abs())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &str) -> KeyValue {
        KeyValue::Text(value.into())
    }

    #[test]
    fn strings_compare_case_insensitively_and_without_trailing_spaces() {
        let varchar: SqlType = "varchar(20)".parse().expect("type");
        assert_eq!(
            compare_values(&varchar, &text("north"), &text("NORTH ")),
            Ordering::Equal
        );
        assert_eq!(
            compare_values(&varchar, &text("alpha"), &text("Bravo")),
            Ordering::Less
        );
        assert_eq!(
            compare_values(&varchar, &KeyValue::Null, &text("")),
            Ordering::Less
        );
    }

    #[test]
    fn guids_sort_by_their_last_group_first() {
        let guid: SqlType = "uniqueidentifier".parse().expect("type");
        let a = text("FFFFFFFF-FFFF-FFFF-FFFF-000000000001");
        let b = text("00000000-0000-0000-0000-000000000002");
        assert_eq!(compare_values(&guid, &a, &b), Ordering::Less);
    }

    #[test]
    fn decimals_compare_as_numbers() {
        let decimal: SqlType = "decimal(18,2)".parse().expect("type");
        assert_eq!(
            compare_values(&decimal, &text("9.50"), &text("10.00")),
            Ordering::Less
        );
        assert_eq!(format_decimal(-1234, 2), "-12.34");
        assert_eq!(format_decimal(5, 2), "0.05");
    }
}
