//! From SQL Server's catalog and TDS values to Arrow.
//!
//! Three steps, each done once per read and not per row:
//! - **Raw**: a row of `sys.sp_cdc_get_captured_columns` ([`RawColumn`]), as the catalog
//!   spells a type;
//! - **Desc**: the [`SqlType`] it declares ([`RawColumn::sql_type`]), whose Arrow type is the
//!   crate-wide mapping of [`crate::types`];
//! - **Decoder**: one typed Arrow builder per result column ([`ColumnDecoder`]), fed the
//!   `ColumnData` of each row by position (`Row::into_iter`), so there is no name lookup and
//!   no `FromSql` dispatch per value.
//!
//! Values are converted as the seed maps them: date-times to microseconds (datetime2(7) loses
//! its 100 ns digit, as in Delta), `datetimeoffset` to its UTC instant (tiberius carries the
//! UTC date-time and the offset separately; its chrono conversion to `DateTime<Utc>`
//! subtracts the offset a second time, so the raw parts are used), `uniqueidentifier` to
//! upper-case text, `time` to `HH:MM:SS.fffffff`, `xml` to its text, money (cast to decimal in
//! SQL) to Decimal128.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryBuilder, BooleanBuilder, Date32Builder, Decimal128Builder, Float32Builder,
    Float64Builder, Int16Builder, Int32Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow::datatypes::DataType;
use tiberius::ColumnData;
use tiberius::time::{Date, DateTime, DateTime2, Time};

use crate::error::{Error, Result};
use crate::types::{Length, SqlType};

/// Days from 0001-01-01 (SQL Server's `date` origin) to 1970-01-01.
const DAYS_0001_TO_1970: i64 = 719_162;
/// Days from 1900-01-01 (`datetime`'s origin) to 1970-01-01.
const DAYS_1900_TO_1970: i64 = 25_567;
const MICROS_PER_DAY: i64 = 86_400_000_000;

/// One row of `sys.sp_cdc_get_captured_columns`, the type as the catalog spells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawColumn {
    /// `column_name`.
    pub name: String,
    /// `column_id` in the source table.
    pub column_id: i32,
    /// `column_ordinal` in the change table.
    pub ordinal: i32,
    /// `data_type`, the base type name (`nvarchar`, `decimal`, ...).
    pub data_type: String,
    /// `character_maximum_length`: characters (or bytes), -1 for `(max)`.
    pub character_maximum_length: Option<i32>,
    /// `numeric_precision`.
    pub numeric_precision: Option<u8>,
    /// `numeric_scale`.
    pub numeric_scale: Option<i32>,
    /// `datetime_precision`.
    pub datetime_precision: Option<i16>,
}

impl RawColumn {
    /// The declared type. Types without a default mapping come back as
    /// [`SqlType::Unsupported`], which the planner refuses by column name unless the caller
    /// leaves the column out.
    pub fn sql_type(&self) -> Result<SqlType> {
        let name = self.data_type.trim().to_ascii_lowercase();
        let length = || match self.character_maximum_length {
            Some(-1) => Ok(Length::Max),
            Some(n) if n > 0 => Ok(Length::Limited(n as u32)),
            other => Err(Error::Internal(format!(
                "column '{}' of type {name} has no usable length ({other:?})",
                self.name
            ))),
        };
        let fraction = || {
            u8::try_from(self.datetime_precision.unwrap_or(7))
                .unwrap_or(7)
                .min(7)
        };
        Ok(match name.as_str() {
            "bit" => SqlType::Bit,
            "tinyint" => SqlType::TinyInt,
            "smallint" => SqlType::SmallInt,
            "int" => SqlType::Int,
            "bigint" => SqlType::BigInt,
            "real" => SqlType::Real,
            "float" => match self.numeric_precision {
                Some(p) if p <= 24 => SqlType::Real,
                _ => SqlType::Float,
            },
            "decimal" | "numeric" => SqlType::Decimal {
                precision: self.numeric_precision.unwrap_or(18),
                scale: u8::try_from(self.numeric_scale.unwrap_or(0)).unwrap_or(0),
            },
            "money" => SqlType::Money,
            "smallmoney" => SqlType::SmallMoney,
            "date" => SqlType::Date,
            "datetime" => SqlType::DateTime,
            "smalldatetime" => SqlType::SmallDateTime,
            "datetime2" => SqlType::DateTime2 {
                precision: fraction(),
            },
            "datetimeoffset" => SqlType::DateTimeOffset {
                precision: fraction(),
            },
            "time" => SqlType::Time {
                precision: fraction(),
            },
            "char" => SqlType::Char(length()?),
            "varchar" => SqlType::VarChar(length()?),
            "nchar" => SqlType::NChar(length()?),
            "nvarchar" => SqlType::NVarChar(length()?),
            "sysname" => SqlType::NVarChar(Length::Limited(128)),
            "text" => SqlType::Text,
            "ntext" => SqlType::NText,
            "xml" => SqlType::Xml,
            "uniqueidentifier" => SqlType::UniqueIdentifier,
            "binary" => SqlType::Binary(length()?),
            "varbinary" => SqlType::VarBinary(length()?),
            "image" => SqlType::Image,
            "timestamp" | "rowversion" => SqlType::RowVersion,
            _ => SqlType::Unsupported(name),
        })
    }
}

/// A typed Arrow builder for one result column.
pub enum ColumnDecoder {
    /// bit.
    Boolean(BooleanBuilder),
    /// tinyint, smallint.
    Int16(Int16Builder),
    /// int.
    Int32(Int32Builder),
    /// bigint.
    Int64(Int64Builder),
    /// real.
    Float32(Float32Builder),
    /// float.
    Float64(Float64Builder),
    /// decimal, numeric, money (cast in SQL), with the column's scale.
    Decimal(Decimal128Builder, u8),
    /// date.
    Date32(Date32Builder),
    /// datetime, smalldatetime, datetime2, datetimeoffset (UTC): microseconds.
    Timestamp(TimestampMicrosecondBuilder),
    /// Text: the string types, xml, uniqueidentifier, time, LSN text.
    Utf8(StringBuilder),
    /// binary, varbinary, image, rowversion.
    Binary(BinaryBuilder),
}

impl ColumnDecoder {
    /// A builder for values of `data_type` with room for `capacity` rows.
    pub fn new(data_type: &DataType, capacity: usize) -> Result<Self> {
        Ok(match data_type {
            DataType::Boolean => ColumnDecoder::Boolean(BooleanBuilder::with_capacity(capacity)),
            DataType::Int16 => ColumnDecoder::Int16(Int16Builder::with_capacity(capacity)),
            DataType::Int32 => ColumnDecoder::Int32(Int32Builder::with_capacity(capacity)),
            DataType::Int64 => ColumnDecoder::Int64(Int64Builder::with_capacity(capacity)),
            DataType::Float32 => ColumnDecoder::Float32(Float32Builder::with_capacity(capacity)),
            DataType::Float64 => ColumnDecoder::Float64(Float64Builder::with_capacity(capacity)),
            DataType::Decimal128(precision, scale) => ColumnDecoder::Decimal(
                Decimal128Builder::with_capacity(capacity)
                    .with_precision_and_scale(*precision, *scale)?,
                u8::try_from(*scale)
                    .map_err(|_| Error::Internal(format!("negative decimal scale {scale}")))?,
            ),
            DataType::Date32 => ColumnDecoder::Date32(Date32Builder::with_capacity(capacity)),
            DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, zone) => {
                ColumnDecoder::Timestamp(
                    TimestampMicrosecondBuilder::with_capacity(capacity)
                        .with_timezone_opt(zone.clone()),
                )
            }
            DataType::Utf8 => ColumnDecoder::Utf8(StringBuilder::with_capacity(capacity, 0)),
            DataType::Binary => ColumnDecoder::Binary(BinaryBuilder::with_capacity(capacity, 0)),
            other => {
                return Err(Error::Internal(format!(
                    "no SQL Server decoder for Arrow type {other}"
                )));
            }
        })
    }

    /// Appends one value; returns the bytes it added (for batch sizing). A value of a kind
    /// the column cannot hold is an error naming what arrived.
    pub fn append(&mut self, value: ColumnData<'static>) -> Result<usize> {
        use ColumnData as V;
        use ColumnDecoder as D;
        let mismatch = |value: &ColumnData<'_>, expected: &str| {
            Error::SchemaChanged(format!(
                "SQL Server sent {} where {expected} was expected; the column's type changed \
                 (re-plan the read)",
                variant_name(value)
            ))
        };
        Ok(match (self, value) {
            (D::Boolean(b), V::Bit(v)) => {
                b.append_option(v);
                1
            }
            (D::Int16(b), V::U8(v)) => {
                b.append_option(v.map(i16::from));
                2
            }
            (D::Int16(b), V::I16(v)) => {
                b.append_option(v);
                2
            }
            (D::Int32(b), V::U8(v)) => {
                b.append_option(v.map(i32::from));
                4
            }
            (D::Int32(b), V::I16(v)) => {
                b.append_option(v.map(i32::from));
                4
            }
            (D::Int32(b), V::I32(v)) => {
                b.append_option(v);
                4
            }
            (D::Int64(b), V::U8(v)) => {
                b.append_option(v.map(i64::from));
                8
            }
            (D::Int64(b), V::I16(v)) => {
                b.append_option(v.map(i64::from));
                8
            }
            (D::Int64(b), V::I32(v)) => {
                b.append_option(v.map(i64::from));
                8
            }
            (D::Int64(b), V::I64(v)) => {
                b.append_option(v);
                8
            }
            (D::Float32(b), V::F32(v)) => {
                b.append_option(v);
                4
            }
            (D::Float64(b), V::F64(v)) => {
                b.append_option(v);
                8
            }
            (D::Float64(b), V::F32(v)) => {
                b.append_option(v.map(f64::from));
                8
            }
            (D::Decimal(b, scale), V::Numeric(v)) => {
                match v {
                    Some(n) => b.append_value(rescale(n.value(), n.scale(), *scale)?),
                    None => b.append_null(),
                }
                16
            }
            (D::Date32(b), V::Date(v)) => {
                b.append_option(v.map(date_days));
                4
            }
            (D::Timestamp(b), V::DateTime2(v)) => {
                b.append_option(v.map(datetime2_micros));
                8
            }
            (D::Timestamp(b), V::DateTimeOffset(v)) => {
                // The wire carries the UTC date-time; the offset only says how it was written.
                b.append_option(v.map(|v| datetime2_micros(v.datetime2())));
                8
            }
            (D::Timestamp(b), V::DateTime(v)) => {
                b.append_option(v.map(datetime_micros));
                8
            }
            (D::Timestamp(b), V::SmallDateTime(v)) => {
                b.append_option(v.map(|v| {
                    (i64::from(v.days()) - DAYS_1900_TO_1970) * MICROS_PER_DAY
                        + i64::from(v.seconds_fragments()) * 60_000_000
                }));
                8
            }
            (D::Utf8(b), V::String(v)) => match v {
                Some(text) => {
                    b.append_value(&text);
                    text.len()
                }
                None => {
                    b.append_null();
                    0
                }
            },
            (D::Utf8(b), V::Guid(v)) => match v {
                Some(guid) => {
                    let text = guid.hyphenated().to_string().to_ascii_uppercase();
                    b.append_value(&text);
                    text.len()
                }
                None => {
                    b.append_null();
                    0
                }
            },
            (D::Utf8(b), V::Xml(v)) => match v {
                Some(xml) => {
                    let text = xml.into_owned().into_string();
                    b.append_value(&text);
                    text.len()
                }
                None => {
                    b.append_null();
                    0
                }
            },
            (D::Utf8(b), V::Time(v)) => match v {
                Some(time) => {
                    let text = time_text(time);
                    b.append_value(&text);
                    text.len()
                }
                None => {
                    b.append_null();
                    0
                }
            },
            (D::Binary(b), V::Binary(v)) => match v {
                Some(bytes) => {
                    b.append_value(&bytes);
                    bytes.len()
                }
                None => {
                    b.append_null();
                    0
                }
            },
            // A NULL of any kind is a NULL (an untyped NULL arrives as an int).
            (decoder, value) if is_null(&value) => {
                decoder.append_null();
                0
            }
            (decoder, value) => return Err(mismatch(&value, decoder.expected())),
        })
    }

    fn append_null(&mut self) {
        match self {
            ColumnDecoder::Boolean(b) => b.append_null(),
            ColumnDecoder::Int16(b) => b.append_null(),
            ColumnDecoder::Int32(b) => b.append_null(),
            ColumnDecoder::Int64(b) => b.append_null(),
            ColumnDecoder::Float32(b) => b.append_null(),
            ColumnDecoder::Float64(b) => b.append_null(),
            ColumnDecoder::Decimal(b, _) => b.append_null(),
            ColumnDecoder::Date32(b) => b.append_null(),
            ColumnDecoder::Timestamp(b) => b.append_null(),
            ColumnDecoder::Utf8(b) => b.append_null(),
            ColumnDecoder::Binary(b) => b.append_null(),
        }
    }

    fn expected(&self) -> &'static str {
        match self {
            ColumnDecoder::Boolean(_) => "bit",
            ColumnDecoder::Int16(_) => "smallint",
            ColumnDecoder::Int32(_) => "int",
            ColumnDecoder::Int64(_) => "bigint",
            ColumnDecoder::Float32(_) => "real",
            ColumnDecoder::Float64(_) => "float",
            ColumnDecoder::Decimal(..) => "decimal",
            ColumnDecoder::Date32(_) => "date",
            ColumnDecoder::Timestamp(_) => "a date-time",
            ColumnDecoder::Utf8(_) => "text",
            ColumnDecoder::Binary(_) => "binary",
        }
    }

    /// The column built so far; the builder starts over empty.
    pub fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnDecoder::Boolean(b) => Arc::new(b.finish()),
            ColumnDecoder::Int16(b) => Arc::new(b.finish()),
            ColumnDecoder::Int32(b) => Arc::new(b.finish()),
            ColumnDecoder::Int64(b) => Arc::new(b.finish()),
            ColumnDecoder::Float32(b) => Arc::new(b.finish()),
            ColumnDecoder::Float64(b) => Arc::new(b.finish()),
            ColumnDecoder::Decimal(b, _) => Arc::new(b.finish()),
            ColumnDecoder::Date32(b) => Arc::new(b.finish()),
            ColumnDecoder::Timestamp(b) => Arc::new(b.finish()),
            ColumnDecoder::Utf8(b) => Arc::new(b.finish()),
            ColumnDecoder::Binary(b) => Arc::new(b.finish()),
        }
    }
}

/// Appends one row's values to the decoders, by position; returns the bytes added.
pub fn append_row(decoders: &mut [ColumnDecoder], row: tiberius::Row) -> Result<usize> {
    if row.len() != decoders.len() {
        return Err(Error::Internal(format!(
            "SQL Server sent {} columns where {} were expected",
            row.len(),
            decoders.len()
        )));
    }
    let mut bytes = 0;
    for (decoder, value) in decoders.iter_mut().zip(row) {
        bytes += decoder.append(value)?;
    }
    Ok(bytes)
}

fn is_null(value: &ColumnData<'_>) -> bool {
    use ColumnData as V;
    matches!(
        value,
        V::U8(None)
            | V::I16(None)
            | V::I32(None)
            | V::I64(None)
            | V::F32(None)
            | V::F64(None)
            | V::Bit(None)
            | V::String(None)
            | V::Guid(None)
            | V::Binary(None)
            | V::Numeric(None)
            | V::Xml(None)
            | V::DateTime(None)
            | V::SmallDateTime(None)
            | V::Time(None)
            | V::Date(None)
            | V::DateTime2(None)
            | V::DateTimeOffset(None)
    )
}

fn variant_name(value: &ColumnData<'_>) -> &'static str {
    use ColumnData as V;
    match value {
        V::U8(_) => "tinyint",
        V::I16(_) => "smallint",
        V::I32(_) => "int",
        V::I64(_) => "bigint",
        V::F32(_) => "real",
        V::F64(_) => "float",
        V::Bit(_) => "bit",
        V::String(_) => "text",
        V::Guid(_) => "uniqueidentifier",
        V::Binary(_) => "binary",
        V::Numeric(_) => "decimal",
        V::Xml(_) => "xml",
        V::DateTime(_) => "datetime",
        V::SmallDateTime(_) => "smalldatetime",
        V::Time(_) => "time",
        V::Date(_) => "date",
        V::DateTime2(_) => "datetime2",
        V::DateTimeOffset(_) => "datetimeoffset",
    }
}

/// A decimal's unscaled value at `from` scale, at the column's `to` scale.
fn rescale(value: i128, from: u8, to: u8) -> Result<i128> {
    if from == to {
        return Ok(value);
    }
    let factor = |digits: u8| 10i128.checked_pow(u32::from(digits));
    let scaled = if to > from {
        factor(to - from).and_then(|f| value.checked_mul(f))
    } else {
        factor(from - to).map(|f| value / f)
    };
    scaled.ok_or_else(|| {
        Error::Internal(format!(
            "decimal value {value} at scale {from} does not fit scale {to}"
        ))
    })
}

/// Days since the Unix epoch of a `date`.
pub fn date_days(date: Date) -> i32 {
    (i64::from(date.days()) - DAYS_0001_TO_1970) as i32
}

/// Microseconds since the Unix epoch of a `datetime` (days since 1900-01-01 and ticks of
/// 1/300 s, rounded to the nearest microsecond).
pub fn datetime_micros(value: DateTime) -> i64 {
    (i64::from(value.days()) - DAYS_1900_TO_1970) * MICROS_PER_DAY
        + (i64::from(value.seconds_fragments()) * 1_000_000 + 150) / 300
}

/// 100 ns ticks since midnight of a `time` at its scale.
fn time_ticks(time: Time) -> u64 {
    let scale = u32::from(time.scale().min(7));
    time.increments() * 10u64.pow(7 - scale)
}

/// Microseconds since the Unix epoch of a `datetime2` (digits below a microsecond dropped).
pub fn datetime2_micros(value: DateTime2) -> i64 {
    let days = i64::from(value.date().days()) - DAYS_0001_TO_1970;
    days * MICROS_PER_DAY + (time_ticks(value.time()) / 10) as i64
}

/// `HH:MM:SS` and, for a fractional scale, seven digits (100 ns), as the simulated database
/// writes `time` values.
pub fn time_text(time: Time) -> String {
    let ticks = time_ticks(time);
    let (seconds, fraction) = (ticks / 10_000_000, ticks % 10_000_000);
    let clock = format!(
        "{:02}:{:02}:{:02}",
        seconds / 3600,
        (seconds / 60) % 60,
        seconds % 60
    );
    if time.scale() == 0 {
        clock
    } else {
        format!("{clock}.{fraction:07}")
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use arrow::array::{
        Array, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float64Array, Int16Array,
        Int32Array, StringArray, TimestampMicrosecondArray,
    };
    use arrow::datatypes::TimeUnit;
    use tiberius::numeric::Numeric;
    use tiberius::time::{DateTimeOffset, SmallDateTime};
    use tiberius::xml::XmlData;
    use tiberius::{ColumnType, Row};

    use super::*;

    /// Decodes `values` into one column of `sql_type`.
    fn decode(sql_type: &str, values: Vec<ColumnData<'static>>) -> ArrayRef {
        let data_type = sql_type
            .parse::<SqlType>()
            .expect("type")
            .arrow_type()
            .expect("mapped");
        let mut decoders = vec![ColumnDecoder::new(&data_type, values.len()).expect("decoder")];
        for value in values {
            let row = Row::builder().column("c", ColumnType::Null, value).build();
            append_row(&mut decoders, row).expect("decodes");
        }
        let array = decoders[0].finish();
        assert_eq!(array.data_type(), &data_type);
        array
    }

    fn downcast<T: 'static>(array: &ArrayRef) -> &T {
        array.as_any().downcast_ref::<T>().expect("array type")
    }

    fn datetime2(days: u32, increments: u64, scale: u8) -> DateTime2 {
        DateTime2::new(Date::new(days), Time::new(increments, scale))
    }

    const LAST_DAY: u32 = 3_652_058; // 9999-12-31 in days since 0001-01-01

    #[test]
    fn integers_widen_and_tinyint_is_unsigned() {
        let array = decode(
            "tinyint",
            vec![ColumnData::U8(Some(255)), ColumnData::U8(None)],
        );
        let values = downcast::<Int16Array>(&array);
        assert_eq!(values.value(0), 255);
        assert!(values.is_null(1));
        let array = decode(
            "int",
            vec![
                ColumnData::I32(Some(i32::MIN)),
                ColumnData::I32(Some(i32::MAX)),
                ColumnData::I16(Some(-7)),
            ],
        );
        assert_eq!(
            downcast::<Int32Array>(&array).values().to_vec(),
            [i32::MIN, i32::MAX, -7]
        );
        let array = decode(
            "bit",
            vec![ColumnData::Bit(Some(true)), ColumnData::Bit(None)],
        );
        assert!(downcast::<BooleanArray>(&array).value(0));
        let array = decode(
            "float",
            vec![ColumnData::F64(Some(-0.5)), ColumnData::F64(None)],
        );
        assert_eq!(downcast::<Float64Array>(&array).value(0), -0.5);
    }

    #[test]
    fn decimals_keep_38_digits_and_money_its_four_places() {
        let widest = 10i128.pow(38) - 1;
        let array = decode(
            "decimal(38,4)",
            vec![
                ColumnData::Numeric(Some(Numeric::new_with_scale(widest, 4))),
                ColumnData::Numeric(Some(Numeric::new_with_scale(-widest, 4))),
                // A value sent at a smaller scale is rescaled to the column's.
                ColumnData::Numeric(Some(Numeric::new_with_scale(125, 2))),
                ColumnData::Numeric(None),
            ],
        );
        let values = downcast::<Decimal128Array>(&array);
        assert_eq!(values.value(0), widest);
        assert_eq!(values.value(1), -widest);
        assert_eq!(values.value(2), 12_500);
        assert!(values.is_null(3));
        // money is cast to decimal(19,4) in SQL, so it arrives as a numeric.
        let array = decode(
            "money",
            vec![ColumnData::Numeric(Some(Numeric::new_with_scale(
                i128::from(i64::MIN),
                4,
            )))],
        );
        assert_eq!(
            downcast::<Decimal128Array>(&array).value_as_string(0),
            "-922337203685477.5808"
        );
    }

    #[test]
    fn dates_cover_year_one_to_9999() {
        let array = decode(
            "date",
            vec![
                ColumnData::Date(Some(Date::new(0))),
                ColumnData::Date(Some(Date::new(LAST_DAY))),
                ColumnData::Date(Some(Date::new(719_162))),
                ColumnData::Date(None),
            ],
        );
        let values = downcast::<Date32Array>(&array);
        assert_eq!(
            values.value_as_date(0).expect("date").to_string(),
            "0001-01-01"
        );
        assert_eq!(
            values.value_as_date(1).expect("date").to_string(),
            "9999-12-31"
        );
        assert_eq!(values.value(2), 0, "1970-01-01 is day 0");
        assert!(values.is_null(3));
    }

    #[test]
    fn datetime2_keeps_microseconds_and_drops_the_100ns_digit() {
        let array = decode(
            "datetime2(7)",
            vec![
                ColumnData::DateTime2(Some(datetime2(0, 0, 7))),
                ColumnData::DateTime2(Some(datetime2(LAST_DAY, 863_999_999_999, 7))),
                // 1970-01-01 12:00:00.1234567
                ColumnData::DateTime2(Some(datetime2(719_162, 432_001_234_567, 7))),
                // datetime2(3): increments are milliseconds.
                ColumnData::DateTime2(Some(datetime2(719_162, 1_234, 3))),
                ColumnData::DateTime2(None),
            ],
        );
        let values = downcast::<TimestampMicrosecondArray>(&array);
        let text = |row| values.value_as_datetime(row).expect("time").to_string();
        assert_eq!(text(0), "0001-01-01 00:00:00");
        assert_eq!(text(1), "9999-12-31 23:59:59.999999");
        assert_eq!(values.value(2), 43_200_123_456);
        assert_eq!(values.value(3), 1_234_000);
        assert!(values.is_null(4));
    }

    #[test]
    fn datetimeoffset_is_the_utc_instant_whatever_the_offset() {
        // 2020-04-20T16:20:00Z written at +02:00 and at -03:00: one instant. (tiberius'
        // chrono DateTime<Utc> conversion reads the first as 14:20Z.)
        let days = 737_534; // 2020-04-20 since 0001-01-01
        let at_1620 = 16 * 3600 + 20 * 60;
        let array = decode(
            "datetimeoffset(7)",
            vec![
                ColumnData::DateTimeOffset(Some(DateTimeOffset::new(
                    datetime2(days, at_1620 * 10_000_000, 7),
                    120,
                ))),
                ColumnData::DateTimeOffset(Some(DateTimeOffset::new(
                    datetime2(days, at_1620 * 10_000_000, 7),
                    -180,
                ))),
            ],
        );
        let values = downcast::<TimestampMicrosecondArray>(&array);
        assert_eq!(
            array.data_type(),
            &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
        );
        for row in 0..2 {
            assert_eq!(
                values.value_as_datetime(row).expect("time").to_string(),
                "2020-04-20 16:20:00"
            );
        }
    }

    #[test]
    fn datetime_and_smalldatetime_use_their_own_units() {
        let array = decode(
            "datetime",
            vec![
                // 1900-01-01 plus one 1/300 s tick: 3.333 ms.
                ColumnData::DateTime(Some(DateTime::new(0, 1))),
                // 1753-01-01, the smallest datetime.
                ColumnData::DateTime(Some(DateTime::new(-53_690, 0))),
            ],
        );
        let values = downcast::<TimestampMicrosecondArray>(&array);
        assert_eq!(
            values.value_as_datetime(0).expect("time").to_string(),
            "1900-01-01 00:00:00.003333"
        );
        assert_eq!(
            values.value_as_datetime(1).expect("time").to_string(),
            "1753-01-01 00:00:00"
        );
        let array = decode(
            "smalldatetime",
            vec![ColumnData::SmallDateTime(Some(SmallDateTime::new(1, 61)))],
        );
        assert_eq!(
            downcast::<TimestampMicrosecondArray>(&array)
                .value_as_datetime(0)
                .expect("time")
                .to_string(),
            "1900-01-02 01:01:00"
        );
    }

    #[test]
    fn texts_guids_xml_and_times_become_strings() {
        let big = "x".repeat(1 << 20);
        let array = decode(
            "nvarchar(max)",
            vec![
                ColumnData::String(Some(Cow::Borrowed(""))),
                ColumnData::String(Some(Cow::Owned(big.clone()))),
                ColumnData::String(Some(Cow::Borrowed("Größe €"))),
                ColumnData::String(None),
            ],
        );
        let values = downcast::<StringArray>(&array);
        assert_eq!(values.value(0), "");
        assert_eq!(values.value(1).len(), 1 << 20);
        assert_eq!(values.value(2), "Größe €");
        assert!(values.is_null(3));

        let guid = uuid_from_text("6f9619ff-8b86-d011-b42d-00c04fc964ff");
        let array = decode("uniqueidentifier", vec![ColumnData::Guid(Some(guid))]);
        assert_eq!(
            downcast::<StringArray>(&array).value(0),
            "6F9619FF-8B86-D011-B42D-00C04FC964FF"
        );

        let array = decode(
            "xml",
            vec![ColumnData::Xml(Some(Cow::Owned(XmlData::new(
                "<a b=\"1\"/>",
            ))))],
        );
        assert_eq!(downcast::<StringArray>(&array).value(0), "<a b=\"1\"/>");

        let array = decode(
            "time(7)",
            vec![
                ColumnData::Time(Some(Time::new(499_011_234_567, 7))),
                ColumnData::Time(Some(Time::new(863_999_999_999, 7))),
                ColumnData::Time(Some(Time::new(45_296, 0))),
                ColumnData::Time(Some(Time::new(45_296_123, 3))),
            ],
        );
        let values = downcast::<StringArray>(&array);
        assert_eq!(values.value(0), "13:51:41.1234567");
        assert_eq!(values.value(1), "23:59:59.9999999");
        assert_eq!(values.value(2), "12:34:56");
        assert_eq!(values.value(3), "12:34:56.1230000");
    }

    fn uuid_from_text(text: &str) -> tiberius::Uuid {
        text.parse().expect("uuid")
    }

    #[test]
    fn binaries_keep_their_bytes() {
        let array = decode(
            "varbinary(max)",
            vec![
                ColumnData::Binary(Some(Cow::Borrowed(&[]))),
                ColumnData::Binary(Some(Cow::Owned(vec![0, 255, 16]))),
                ColumnData::Binary(None),
            ],
        );
        let values = downcast::<BinaryArray>(&array);
        assert_eq!(values.value(0), b"");
        assert_eq!(values.value(1), [0, 255, 16]);
        assert!(values.is_null(2));
    }

    #[test]
    fn a_value_of_another_type_is_a_schema_change_not_garbage() {
        let mut decoders = vec![ColumnDecoder::new(&DataType::Int32, 1).expect("decoder")];
        let row = Row::builder()
            .column("c", ColumnType::Int8, ColumnData::I64(Some(1)))
            .build();
        let error = append_row(&mut decoders, row).expect_err("bigint into int");
        assert!(matches!(error, Error::SchemaChanged(_)), "{error}");
        assert!(error.to_string().contains("bigint"), "{error}");
        // Any NULL is a NULL, whatever type it claims.
        let row = Row::builder()
            .column("c", ColumnType::Null, ColumnData::String(None))
            .build();
        append_row(&mut decoders, row).expect("null");
        let two = Row::builder()
            .column("a", ColumnType::Int4, ColumnData::I32(Some(1)))
            .column("b", ColumnType::Int4, ColumnData::I32(Some(2)))
            .build();
        assert!(
            append_row(&mut decoders, two).is_err(),
            "column count is checked"
        );
    }

    fn raw(
        data_type: &str,
        length: Option<i32>,
        precision: Option<u8>,
        scale: Option<i32>,
        fraction: Option<i16>,
    ) -> SqlType {
        RawColumn {
            name: "c".into(),
            column_id: 1,
            ordinal: 1,
            data_type: data_type.into(),
            character_maximum_length: length,
            numeric_precision: precision,
            numeric_scale: scale,
            datetime_precision: fraction,
        }
        .sql_type()
        .expect("type")
    }

    #[test]
    fn catalog_rows_become_declared_types() {
        assert_eq!(
            raw("nvarchar", Some(-1), None, None, None).to_string(),
            "nvarchar(max)"
        );
        assert_eq!(
            raw("varchar", Some(20), None, None, None).to_string(),
            "varchar(20)"
        );
        assert_eq!(
            raw("decimal", None, Some(38), Some(6), None).to_string(),
            "decimal(38,6)"
        );
        assert_eq!(
            raw("numeric", None, Some(9), Some(2), None).to_string(),
            "decimal(9,2)"
        );
        assert_eq!(raw("float", None, Some(53), None, None), SqlType::Float);
        assert_eq!(raw("float", None, Some(24), None, None), SqlType::Real);
        assert_eq!(
            raw("datetime2", None, None, None, Some(3)).to_string(),
            "datetime2(3)"
        );
        assert_eq!(
            raw("datetimeoffset", None, None, None, Some(7)).to_string(),
            "datetimeoffset(7)"
        );
        assert_eq!(
            raw("timestamp", Some(8), None, None, None),
            SqlType::RowVersion
        );
        assert_eq!(raw("money", None, Some(19), Some(4), None), SqlType::Money);
        for unsupported in ["sql_variant", "geography", "geometry", "hierarchyid"] {
            let sql_type = raw(unsupported, None, None, None, None);
            assert_eq!(sql_type, SqlType::Unsupported(unsupported.into()));
            assert_eq!(
                sql_type.arrow_type(),
                None,
                "refused by the planner by name"
            );
        }
    }
}
