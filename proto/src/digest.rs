//! Value digests for reconcile: a hash of every served value of a row, the same whether SQL
//! Server computes it in T-SQL from the source row or the writer from silver's row, summed
//! per slice so that row order does not matter (docs/reconcile.md, "Value digests").
//!
//! A row's digest is built from the values **as the server serves them** (the Arrow types of
//! [`crate::types::SqlType::arrow_type`]), since that is all silver can hold: each value
//! becomes a canonical text, the texts are joined length-prefixed, and the first 7 bytes of
//! the SHA-256 of that text's UTF-16LE bytes are read as a number below 2^56 (what
//! `HASHBYTES('SHA2_256', <nvarchar>)` hashes, as [`crate::catalog::key_hash`] does for keys).
//!
//! | served as | canonical text | T-SQL |
//! |---|---|---|
//! | Boolean, Int16/32/64 | the integer in decimal digits | `CONVERT(nvarchar(20), CAST(v AS bigint))` |
//! | Float32, Float64 | 17 significant digits, `d.dddddddddddddddde±xxx` | `CONVERT(nvarchar(30), v, 3)` |
//! | Decimal128(p, s) | `[-]digits.s-digits` (a `0` before the point) | `CONVERT(nvarchar(42), v)` |
//! | Date32 | `yyyy-mm-dd` | `CONVERT(nvarchar(10), v, 23)` |
//! | Timestamp(µs) | microseconds since 1970-01-01 UTC, decimal | `DATEDIFF_BIG(microsecond, '1970-01-01', v)` |
//! | Utf8 | the text itself | `CAST(v AS nvarchar(max))` |
//! | Binary | upper-case hex, no `0x` | `CONVERT(nvarchar(max), v, 2)` |
//!
//! A row joins its columns in the order asked: a NULL as `-`, a value as its length in UTF-16
//! code units, `:`, and its text (`3:abc`), so no two rows share a joined text.

use arrow::array::{
    Array, AsArray, BinaryArray, BinaryViewArray, BooleanArray, Date32Array, Decimal128Array,
    Float32Array, Float64Array, Int16Array, Int32Array, Int64Array, LargeBinaryArray,
    LargeStringArray, StringArray, StringViewArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, TimeUnit};
use std::fmt::Write as _;

use sha2::Digest;

use crate::error::{Error, Result};

/// Whether values of `data_type` have a canonical text (the types the server serves, and
/// the string and binary views a reader may hand out).
pub fn supports(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Boolean
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::Float32
            | DataType::Float64
            | DataType::Date32
            | DataType::Timestamp(TimeUnit::Microsecond, _)
            | DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    ) || matches!(data_type, DataType::Decimal128(_, scale) if *scale >= 0)
}

/// The digest of each row of `columns` (equal lengths), in order.
pub fn row_digests(columns: &[&dyn Array]) -> Result<Vec<i64>> {
    let rows = columns.first().map_or(0, |column| column.len());
    if let Some(column) = columns.iter().find(|column| column.len() != rows) {
        return Err(Error::Internal(format!(
            "row digests of columns of {rows} and {} rows",
            column.len()
        )));
    }
    let readers: Vec<Canonical<'_>> = columns
        .iter()
        .map(|column| Canonical::of(*column))
        .collect::<Result<_>>()?;
    // Buffers reused row after row: a value's text, its UTF-16 units (encoded once, counted
    // for the prefix and hashed), the prefix's digits, the row's bytes.
    let (mut text, mut units, mut length) = (String::new(), Vec::<u16>::new(), String::new());
    let mut bytes = Vec::new();
    let mut digests = Vec::with_capacity(rows);
    for row in 0..rows {
        bytes.clear();
        for reader in &readers {
            text.clear();
            if reader.write(row, &mut text) {
                units.clear();
                units.extend(text.encode_utf16());
                length.clear();
                write!(length, "{}", units.len()).expect("a String");
                push_utf16(&mut bytes, &length);
                push_utf16(&mut bytes, ":");
                for unit in &units {
                    bytes.extend_from_slice(&unit.to_le_bytes());
                }
            } else {
                push_utf16(&mut bytes, "-");
            }
        }
        digests.push(text_hash(&bytes));
    }
    Ok(digests)
}

/// The first 7 bytes of SHA-256 of `utf16le`, as a number below 2^56.
fn text_hash(utf16le: &[u8]) -> i64 {
    let digest = sha2::Sha256::digest(utf16le);
    let mut bytes = [0u8; 8];
    bytes[1..].copy_from_slice(&digest[..7]);
    i64::from_be_bytes(bytes)
}

fn push_utf16(bytes: &mut Vec<u8>, text: &str) {
    for unit in text.encode_utf16() {
        bytes.extend_from_slice(&unit.to_le_bytes());
    }
}

/// One column, read as canonical texts.
enum Canonical<'a> {
    Boolean(&'a BooleanArray),
    Int16(&'a Int16Array),
    Int32(&'a Int32Array),
    Int64(&'a Int64Array),
    Float32(&'a Float32Array),
    Float64(&'a Float64Array),
    Decimal(&'a Decimal128Array, u32),
    Date(&'a Date32Array),
    Micros(&'a TimestampMicrosecondArray),
    Text(&'a StringArray),
    LargeText(&'a LargeStringArray),
    TextView(&'a StringViewArray),
    Binary(&'a BinaryArray),
    LargeBinary(&'a LargeBinaryArray),
    BinaryView(&'a BinaryViewArray),
}

impl<'a> Canonical<'a> {
    fn of(array: &'a dyn Array) -> Result<Self> {
        Ok(match array.data_type() {
            DataType::Boolean => Canonical::Boolean(array.as_boolean()),
            DataType::Int16 => Canonical::Int16(array.as_primitive()),
            DataType::Int32 => Canonical::Int32(array.as_primitive()),
            DataType::Int64 => Canonical::Int64(array.as_primitive()),
            DataType::Float32 => Canonical::Float32(array.as_primitive()),
            DataType::Float64 => Canonical::Float64(array.as_primitive()),
            DataType::Decimal128(_, scale) => Canonical::Decimal(
                array.as_primitive(),
                u32::try_from(*scale).map_err(|_| {
                    Error::invalid(format!("a decimal of negative scale {scale} has no digest"))
                })?,
            ),
            DataType::Date32 => Canonical::Date(array.as_primitive()),
            DataType::Timestamp(TimeUnit::Microsecond, _) => {
                Canonical::Micros(array.as_primitive())
            }
            DataType::Utf8 => Canonical::Text(array.as_string()),
            DataType::LargeUtf8 => Canonical::LargeText(array.as_string()),
            DataType::Utf8View => Canonical::TextView(array.as_string_view()),
            DataType::Binary => Canonical::Binary(array.as_binary()),
            DataType::LargeBinary => Canonical::LargeBinary(array.as_binary()),
            DataType::BinaryView => Canonical::BinaryView(array.as_binary_view()),
            other => {
                return Err(Error::invalid(format!(
                    "values of Arrow type {other} have no digest (the server serves none)"
                )));
            }
        })
    }

    /// Writes the canonical text of `row` into `out`; false for a NULL.
    fn write(&self, row: usize, out: &mut String) -> bool {
        macro_rules! value {
            ($array:expr) => {{
                if $array.is_null(row) {
                    return false;
                }
                $array.value(row)
            }};
        }
        match self {
            Canonical::Boolean(array) => out.push(if value!(array) { '1' } else { '0' }),
            Canonical::Int16(array) => write!(out, "{}", value!(array)).expect("a String"),
            Canonical::Int32(array) => write!(out, "{}", value!(array)).expect("a String"),
            Canonical::Int64(array) => write!(out, "{}", value!(array)).expect("a String"),
            Canonical::Float32(array) => float_text(f64::from(value!(array)), out),
            Canonical::Float64(array) => float_text(value!(array), out),
            Canonical::Decimal(array, scale) => decimal_text(value!(array), *scale, out),
            Canonical::Date(array) => date_text(value!(array), out),
            Canonical::Micros(array) => write!(out, "{}", value!(array)).expect("a String"),
            Canonical::Text(array) => out.push_str(value!(array)),
            Canonical::LargeText(array) => out.push_str(value!(array)),
            Canonical::TextView(array) => out.push_str(value!(array)),
            Canonical::Binary(array) => hex_text(value!(array), out),
            Canonical::LargeBinary(array) => hex_text(value!(array), out),
            Canonical::BinaryView(array) => hex_text(value!(array), out),
        }
        true
    }
}

/// A float as `CONVERT(nvarchar(30), v, 3)` writes it: 17 significant digits in scientific
/// notation, a signed exponent of at least three digits (`1.0000000000000000e+000`). A
/// `real` is written as the double it widens to.
fn float_text(value: f64, out: &mut String) {
    let text = format!("{value:.16e}");
    let (mantissa, exponent) = text.split_once('e').expect("{:e} writes an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} writes a decimal exponent");
    let sign = if exponent < 0 { '-' } else { '+' };
    out.push_str(mantissa);
    out.push('e');
    out.push(sign);
    out.push_str(&format!("{:03}", exponent.unsigned_abs()));
}

/// A decimal of `scale` as `CONVERT(nvarchar(42), v)` writes it: every digit of the scale,
/// a `0` before the point of a value below one, a `-` before a negative value.
fn decimal_text(unscaled: i128, scale: u32, out: &mut String) {
    let digits = unscaled.unsigned_abs().to_string();
    if unscaled < 0 {
        out.push('-');
    }
    let scale = scale as usize;
    if scale == 0 {
        out.push_str(&digits);
        return;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (whole, fraction) = padded.split_at(padded.len() - scale);
    out.push_str(whole);
    out.push('.');
    out.push_str(fraction);
}

/// Day `days` from 1970-01-01 as `yyyy-mm-dd` (style 23).
fn date_text(days: i32, out: &mut String) {
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).expect("the epoch is a date");
    match epoch.checked_add_signed(chrono::TimeDelta::days(i64::from(days))) {
        Some(date) => out.push_str(&date.format("%Y-%m-%d").to_string()),
        // Past chrono's range, and so past SQL Server's: still distinct from any date.
        None => out.push_str(&format!("day {days}")),
    }
}

/// Bytes as upper-case hex without `0x` (`CONVERT(nvarchar(max), v, 2)`).
fn hex_text(bytes: &[u8], out: &mut String) {
    out.push_str(&hex::encode_upper(bytes));
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::ArrayRef;

    use super::*;

    fn texts(array: ArrayRef) -> Vec<Option<String>> {
        let reader = Canonical::of(array.as_ref()).expect("a served type");
        (0..array.len())
            .map(|row| {
                let mut text = String::new();
                reader.write(row, &mut text).then_some(text)
            })
            .collect()
    }

    fn some(texts: &[&str]) -> Vec<Option<String>> {
        texts.iter().map(|text| Some(text.to_string())).collect()
    }

    #[test]
    fn each_served_type_has_its_canonical_text() {
        assert_eq!(
            texts(Arc::new(BooleanArray::from(vec![
                Some(true),
                Some(false),
                None
            ]))),
            vec![Some("1".into()), Some("0".into()), None]
        );
        assert_eq!(
            texts(Arc::new(Int64Array::from(vec![-42, i64::MAX]))),
            some(&["-42", "9223372036854775807"])
        );
        assert_eq!(
            texts(Arc::new(Float64Array::from(vec![
                1.0, -0.1, 12345.678, 1e-300, -0.0
            ]))),
            some(&[
                "1.0000000000000000e+000",
                "-1.0000000000000001e-001",
                "1.2345678000000000e+004",
                "1.0000000000000000e-300",
                "-0.0000000000000000e+000",
            ])
        );
        assert_eq!(
            texts(Arc::new(Float32Array::from(vec![0.1f32]))),
            some(&["1.0000000149011612e-001"])
        );
        let decimals = Decimal128Array::from(vec![12_345, -5, 0, 100_000_000])
            .with_precision_and_scale(19, 4)
            .expect("decimal");
        assert_eq!(
            texts(Arc::new(decimals)),
            some(&["1.2345", "-0.0005", "0.0000", "10000.0000"])
        );
        let whole = Decimal128Array::from(vec![-7])
            .with_precision_and_scale(10, 0)
            .expect("decimal");
        assert_eq!(texts(Arc::new(whole)), some(&["-7"]));
        assert_eq!(
            texts(Arc::new(Date32Array::from(vec![0, -719_162, 19_723]))),
            some(&["1970-01-01", "0001-01-01", "2024-01-01"])
        );
        assert_eq!(
            texts(Arc::new(
                TimestampMicrosecondArray::from(vec![-1, 1_700_000_000_123_456])
                    .with_timezone("UTC")
            )),
            some(&["-1", "1700000000123456"])
        );
        assert_eq!(
            texts(Arc::new(StringViewArray::from(vec![
                Some("Ab "),
                Some(""),
                None
            ]))),
            vec![Some("Ab ".into()), Some(String::new()), None]
        );
        assert_eq!(
            texts(Arc::new(BinaryArray::from(vec![
                &[0x0a_u8, 0xff][..],
                &[][..]
            ]))),
            some(&["0AFF", ""])
        );
    }

    #[test]
    fn a_row_hashes_its_joined_text_as_utf16() {
        // "5:Ab cd" + "-" + "2:é1", hashed as UTF-16LE: Python's
        // int.from_bytes(hashlib.sha256("5:Ab cd-2:é1".encode("utf-16-le")).digest()[:7], "big").
        let name: ArrayRef = Arc::new(StringArray::from(vec!["Ab cd"]));
        let none: ArrayRef = Arc::new(Int32Array::from(vec![None]));
        let other: ArrayRef = Arc::new(StringArray::from(vec!["é1"]));
        let digests = row_digests(&[name.as_ref(), none.as_ref(), other.as_ref()]).expect("rows");
        let mut utf16 = Vec::new();
        push_utf16(&mut utf16, "5:Ab cd-2:é1");
        assert_eq!(digests, vec![text_hash(&utf16)]);
        assert_eq!(digests, vec![PYTHON_DIGEST]);
    }

    #[test]
    fn null_empty_and_moved_values_differ() {
        let digest = |a: Option<&str>, b: Option<&str>| {
            let a: ArrayRef = Arc::new(StringArray::from(vec![a]));
            let b: ArrayRef = Arc::new(StringArray::from(vec![b]));
            row_digests(&[a.as_ref(), b.as_ref()]).expect("rows")[0]
        };
        let all = [
            digest(None, Some("")),
            digest(Some(""), None),
            digest(Some(""), Some("")),
            digest(None, None),
            digest(Some("ab"), Some("")),
            digest(Some("a"), Some("b")),
            digest(Some(""), Some("ab")),
        ];
        let distinct: std::collections::BTreeSet<i64> = all.iter().copied().collect();
        assert_eq!(distinct.len(), all.len(), "{all:?}");
    }

    #[test]
    fn a_type_the_server_does_not_serve_is_refused() {
        let array: ArrayRef = Arc::new(arrow::array::UInt8Array::from(vec![1u8]));
        assert!(row_digests(&[array.as_ref()]).is_err());
    }

    /// See [`a_row_hashes_its_joined_text_as_utf16`].
    const PYTHON_DIGEST: i64 = 56_124_946_521_359_005;
}
