//! From SQL Server's catalog and TDS values to Arrow.
//!
//! Three steps, each done once per read and not per row:
//! - **Raw**: a row of `sys.sp_cdc_get_captured_columns` ([`RawColumn`]), as the catalog
//!   spells a type;
//! - **Desc**: the [`SqlType`] it declares ([`RawColumn::sql_type`]), whose Arrow type is the
//!   crate-wide mapping of [`crate::types`];
//! - **Decoder**: one typed Arrow builder per result column ([`ColumnBuilder`]), fed the
//!   `ColumnData` of each row by position (`Row::into_iter`), so there is no name lookup and
//!   no `FromSql` dispatch per value.
//!
//! Values are converted as the seed maps them: date-times to microseconds (datetime2(7) loses
//! its 100 ns digit, as in Delta), `datetimeoffset` to its UTC instant (tiberius carries the
//! UTC date-time and the offset separately; its chrono conversion to `DateTime<Utc>`
//! subtracts the offset a second time, so the raw parts are used), `uniqueidentifier` to
//! upper-case text, `time` to `HH:MM:SS.fffffff`, `xml` to its text, money (cast to decimal in
//! SQL) to Decimal128.

use tiberius::ColumnData;
use tiberius::time::{Date, DateTime, DateTime2, Time};

pub use crate::column_builder::ColumnBuilder;
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

impl ColumnBuilder {
    /// Appends one value; returns the bytes it added (for batch sizing). A value of a kind
    /// the column cannot hold is an error naming what arrived.
    pub fn append(&mut self, value: ColumnData<'static>) -> Result<usize> {
        use ColumnBuilder as D;
        use ColumnData as V;
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

    fn expected(&self) -> &'static str {
        match self {
            ColumnBuilder::Boolean(_) => "bit",
            ColumnBuilder::Int16(_) => "smallint",
            ColumnBuilder::Int32(_) => "int",
            ColumnBuilder::Int64(_) => "bigint",
            ColumnBuilder::Float32(_) => "real",
            ColumnBuilder::Float64(_) => "float",
            ColumnBuilder::Decimal(..) => "decimal",
            ColumnBuilder::Date32(_) => "date",
            ColumnBuilder::Timestamp(_) => "a date-time",
            ColumnBuilder::Utf8(_) => "text",
            ColumnBuilder::Binary(_) => "binary",
        }
    }
}

/// Appends one row's values to the decoders, by position; returns the bytes added.
pub fn append_row(decoders: &mut [ColumnBuilder], row: tiberius::Row) -> Result<usize> {
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

/// A decimal's unscaled value at `from` scale, at the column's `to` scale. A value that
/// would lose digits (the column's scale grew by an `ALTER COLUMN` after the read was
/// planned) or overflow is `SCHEMA_CHANGED`, never silently truncated.
fn rescale(value: i128, from: u8, to: u8) -> Result<i128> {
    if from == to {
        return Ok(value);
    }
    let factor = |digits: u8| 10i128.checked_pow(u32::from(digits));
    let scaled = if to > from {
        factor(to - from).and_then(|f| value.checked_mul(f))
    } else {
        factor(from - to).and_then(|f| (value % f == 0).then(|| value / f))
    };
    scaled.ok_or_else(|| {
        Error::SchemaChanged(format!(
            "a decimal value at scale {from} does not fit the planned scale {to} (the value is \
             not said: it may be a masked column's): the column's type changed since the read \
             was planned; plan the range again"
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

/// The served text of a `time` value ([`crate::types::time_text`]).
pub fn time_text(time: Time) -> String {
    crate::types::time_text(time_ticks(time), time.scale())
}

#[cfg(test)]
mod tests;
