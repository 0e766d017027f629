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
use std::io::Write as _;

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
    // Buffers reused row after row: an ASCII value's text, the row's UTF-16LE bytes.
    let (mut ascii, mut bytes) = (Vec::new(), Vec::new());
    let mut digests = Vec::with_capacity(rows);
    for row in 0..rows {
        bytes.clear();
        for reader in &readers {
            ascii.clear();
            match reader.write(row, &mut ascii) {
                None => bytes.extend_from_slice(b"-\0"),
                Some(Value::Ascii) => {
                    push_joined(&mut bytes, ascii.len(), |bytes| push_ascii(bytes, &ascii))
                }
                Some(Value::Text(text)) if text.is_ascii() => {
                    push_joined(&mut bytes, text.len(), |bytes| {
                        push_ascii(bytes, text.as_bytes())
                    })
                }
                Some(Value::Text(text)) => {
                    push_joined(&mut bytes, text.encode_utf16().count(), |bytes| {
                        for unit in text.encode_utf16() {
                            bytes.extend_from_slice(&unit.to_le_bytes());
                        }
                    })
                }
            }
        }
        digests.push(text_hash(&bytes));
    }
    Ok(digests)
}

/// Calls `each` with the canonical text of every value of `column` as UTF-8 bytes, in
/// order, `None` for a NULL: what the server's hash mask keys
/// ([`crate::masking::Mask::Hash`]), so a value hashes alike whatever integer width or
/// string layout it arrives in.
pub fn each_text(column: &dyn Array, mut each: impl FnMut(Option<&[u8]>)) -> Result<()> {
    let reader = Canonical::of(column)?;
    let mut ascii = Vec::new();
    for row in 0..column.len() {
        ascii.clear();
        match reader.write(row, &mut ascii) {
            None => each(None),
            Some(Value::Ascii) => each(Some(&ascii)),
            Some(Value::Text(text)) => each(Some(text.as_bytes())),
        }
    }
    Ok(())
}

/// A value's part of its row, as UTF-16LE: its length in UTF-16 units, `:`, its text.
fn push_joined(bytes: &mut Vec<u8>, units: usize, text: impl FnOnce(&mut Vec<u8>)) {
    push_ascii(bytes, itoa::Buffer::new().format(units).as_bytes());
    bytes.extend_from_slice(b":\0");
    text(bytes);
}

/// ASCII bytes as UTF-16LE.
fn push_ascii(bytes: &mut Vec<u8>, ascii: &[u8]) {
    bytes.reserve(2 * ascii.len());
    for &byte in ascii {
        bytes.extend_from_slice(&[byte, 0]);
    }
}

/// The first 7 bytes of SHA-256 of `utf16le`, as a number below 2^56.
fn text_hash(utf16le: &[u8]) -> i64 {
    let digest = sha2::Sha256::digest(utf16le);
    let mut bytes = [0u8; 8];
    bytes[1..].copy_from_slice(&digest[..7]);
    i64::from_be_bytes(bytes)
}

/// Where a value's canonical text is.
enum Value<'a> {
    /// Written (ASCII) into the buffer [`Canonical::write`] was given.
    Ascii,
    /// The column's own text.
    Text(&'a str),
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

    /// The canonical text of `row`: written into `ascii`, or the column's own text; `None`
    /// for a NULL.
    fn write(&self, row: usize, ascii: &mut Vec<u8>) -> Option<Value<'a>> {
        macro_rules! value {
            ($array:expr) => {{
                if $array.is_null(row) {
                    return None;
                }
                $array.value(row)
            }};
        }
        let mut integer =
            |value: i64| ascii.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
        match self {
            Canonical::Boolean(array) => ascii.push(if value!(array) { b'1' } else { b'0' }),
            Canonical::Int16(array) => integer(value!(array).into()),
            Canonical::Int32(array) => integer(value!(array).into()),
            Canonical::Int64(array) => integer(value!(array)),
            Canonical::Micros(array) => integer(value!(array)),
            Canonical::Float32(array) => float_text(f64::from(value!(array)), ascii),
            Canonical::Float64(array) => float_text(value!(array), ascii),
            Canonical::Decimal(array, scale) => decimal_text(value!(array), *scale, ascii),
            Canonical::Date(array) => date_text(value!(array), ascii),
            Canonical::Text(array) => return Some(Value::Text(value!(array))),
            Canonical::LargeText(array) => return Some(Value::Text(value!(array))),
            Canonical::TextView(array) => return Some(Value::Text(value!(array))),
            Canonical::Binary(array) => hex_text(value!(array), ascii),
            Canonical::LargeBinary(array) => hex_text(value!(array), ascii),
            Canonical::BinaryView(array) => hex_text(value!(array), ascii),
        }
        Some(Value::Ascii)
    }
}

/// A float as `CONVERT(nvarchar(30), v, 3)` writes it: 17 significant digits in scientific
/// notation, a signed exponent of at least three digits (`1.0000000000000000e+000`). A
/// `real` is written as the double it widens to.
fn float_text(value: f64, out: &mut Vec<u8>) {
    let start = out.len();
    write!(out, "{value:.16e}").expect("a Vec");
    // SQL Server has no NaN or infinity; one read from silver is written as Rust does.
    let Some(e) = out[start..].iter().position(|&byte| byte == b'e') else {
        return;
    };
    let exponent: i32 = std::str::from_utf8(&out[start + e + 1..])
        .ok()
        .and_then(|text| text.parse().ok())
        .expect("{:e} writes a decimal exponent");
    out.truncate(start + e + 1);
    out.push(if exponent < 0 { b'-' } else { b'+' });
    let exponent = exponent.unsigned_abs();
    if exponent < 100 {
        out.push(b'0');
    }
    if exponent < 10 {
        out.push(b'0');
    }
    out.extend_from_slice(itoa::Buffer::new().format(exponent).as_bytes());
}

/// A decimal of `scale` as `CONVERT(nvarchar(42), v)` writes it: every digit of the scale,
/// a `0` before the point of a value below one, a `-` before a negative value.
fn decimal_text(unscaled: i128, scale: u32, out: &mut Vec<u8>) {
    if unscaled < 0 {
        out.push(b'-');
    }
    let mut buffer = itoa::Buffer::new();
    let digits = buffer.format(unscaled.unsigned_abs()).as_bytes();
    let scale = scale as usize;
    if scale == 0 {
        out.extend_from_slice(digits);
        return;
    }
    match digits.len().checked_sub(scale) {
        Some(whole) if whole > 0 => {
            out.extend_from_slice(&digits[..whole]);
            out.push(b'.');
            out.extend_from_slice(&digits[whole..]);
        }
        // Below one: `0.`, the scale's leading zeros, the digits.
        _ => {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', scale - digits.len()));
            out.extend_from_slice(digits);
        }
    }
}

/// Day `days` from 1970-01-01 as `yyyy-mm-dd` (style 23).
fn date_text(days: i32, out: &mut Vec<u8>) {
    match civil_date(days) {
        Some((year, month, day)) => {
            two_digits(year / 100, out);
            two_digits(year % 100, out);
            out.push(b'-');
            two_digits(month, out);
            out.push(b'-');
            two_digits(day, out);
        }
        // Past SQL Server's range (years 1 to 9999): still distinct from any date.
        None => write!(out, "day {days}").expect("a Vec"),
    }
}

fn two_digits(value: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&[b'0' + (value / 10) as u8, b'0' + (value % 10) as u8]);
}

/// The proleptic Gregorian (year, month, day) of day `days` from 1970-01-01, for years 1 to
/// 9999 (Howard Hinnant's `civil_from_days`).
fn civil_date(days: i32) -> Option<(u32, u32, u32)> {
    let z = i64::from(days) + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (1..=9999)
        .contains(&year)
        .then_some((year as u32, month as u32, day as u32))
}

/// Bytes as upper-case hex without `0x` (`CONVERT(nvarchar(max), v, 2)`).
fn hex_text(bytes: &[u8], out: &mut Vec<u8>) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    out.reserve(2 * bytes.len());
    for &byte in bytes {
        out.extend_from_slice(&[
            DIGITS[usize::from(byte >> 4)],
            DIGITS[usize::from(byte & 15)],
        ]);
    }
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
                let mut ascii = Vec::new();
                reader.write(row, &mut ascii).map(|value| match value {
                    Value::Ascii => String::from_utf8(ascii).expect("ASCII"),
                    Value::Text(text) => text.to_string(),
                })
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

    proptest::proptest! {
        #[test]
        fn dates_are_written_as_chrono_writes_them(days in -719_162i32..=2_932_896) {
            let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).expect("the epoch");
            let date = epoch + chrono::TimeDelta::days(i64::from(days));
            let mut out = Vec::new();
            date_text(days, &mut out);
            proptest::prop_assert_eq!(
                String::from_utf8(out).expect("ASCII"),
                date.format("%Y-%m-%d").to_string()
            );
        }

        #[test]
        fn decimals_are_written_as_their_digits_with_the_point_moved(
            unscaled in proptest::num::i128::ANY,
            scale in 0u32..=38,
        ) {
            let mut out = Vec::new();
            decimal_text(unscaled, scale, &mut out);
            let digits = format!("{:0>width$}", unscaled.unsigned_abs(), width = scale as usize + 1);
            let (whole, fraction) = digits.split_at(digits.len() - scale as usize);
            let sign = if unscaled < 0 { "-" } else { "" };
            let expected = match scale {
                0 => format!("{sign}{whole}"),
                _ => format!("{sign}{whole}.{fraction}"),
            };
            proptest::prop_assert_eq!(String::from_utf8(out).expect("ASCII"), expected);
        }
    }

    #[test]
    fn dates_past_sql_servers_range_and_odd_floats_still_have_a_text() {
        let mut out = Vec::new();
        date_text(2_932_896, &mut out);
        assert_eq!(out, b"9999-12-31");
        for (days, text) in [(2_932_897, "day 2932897"), (-719_163, "day -719163")] {
            let mut out = Vec::new();
            date_text(days, &mut out);
            assert_eq!(String::from_utf8(out).expect("ASCII"), text);
        }
        for (value, text) in [
            (f64::NAN, "NaN"),
            (f64::INFINITY, "inf"),
            (1e300, "1.0000000000000001e+300"),
        ] {
            let mut out = Vec::new();
            float_text(value, &mut out);
            assert_eq!(String::from_utf8(out).expect("ASCII"), text);
        }
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

    fn push_utf16(bytes: &mut Vec<u8>, text: &str) {
        for unit in text.encode_utf16() {
            bytes.extend_from_slice(&unit.to_le_bytes());
        }
    }

    /// See [`a_row_hashes_its_joined_text_as_utf16`].
    const PYTHON_DIGEST: i64 = 56_124_946_521_359_005;
}
