//! The seed's column types and JSON values as this service serves them.
//!
//! The seed's fake declares captured columns in Spark DDL (`id INT, amount DECIMAL(18,2)`,
//! what its `sp_cdc_get_captured_columns` would report once mapped) and keeps values as JSON.
//! Each Spark type is served as the SQL Server type SQL Server's own mapping would have
//! produced it from (docs/design-notes.md, "The seed's simulator as a source").

use std::str::FromStr;

use chrono::{NaiveDate, NaiveDateTime};
use serde_json::Value;

use crate::column_builder::ColumnBuilder;
use crate::error::{Error, Result};
use crate::types::SqlType;

/// The SQL Server type a Spark DDL type of the seed's fake is served as.
pub fn sql_type_of(spark: &str) -> Result<SqlType> {
    let compact: String = spark.chars().filter(|c| !c.is_whitespace()).collect();
    let upper = compact.to_ascii_uppercase();
    let (name, arguments) = match upper.split_once('(') {
        Some((name, rest)) => (name, rest.strip_suffix(')').unwrap_or(rest)),
        None => (upper.as_str(), ""),
    };
    let text = match (name, arguments) {
        ("INT" | "INTEGER", "") => "int".to_string(),
        ("BIGINT" | "LONG", "") => "bigint".to_string(),
        ("SMALLINT" | "SHORT", "") => "smallint".to_string(),
        ("TINYINT" | "BYTE", "") => "tinyint".to_string(),
        ("BOOLEAN", "") => "bit".to_string(),
        ("DOUBLE", "") => "float".to_string(),
        ("FLOAT" | "REAL", "") => "real".to_string(),
        ("STRING", "") => "nvarchar(max)".to_string(),
        ("VARCHAR" | "CHAR", length) => format!("nvarchar({length})"),
        ("DECIMAL" | "NUMERIC", "") => "decimal(10,0)".to_string(),
        ("DECIMAL" | "NUMERIC", arguments) => format!("decimal({arguments})"),
        ("DATE", "") => "date".to_string(),
        ("TIMESTAMP" | "TIMESTAMP_NTZ", "") => "datetime2(6)".to_string(),
        _ => {
            return Err(Error::invalid(format!(
                "the seed's column type '{spark}' has no SQL Server type here (supported: \
                 INT, BIGINT, SMALLINT, TINYINT, BOOLEAN, DOUBLE, FLOAT, STRING, VARCHAR(n), \
                 DECIMAL(p,s), DATE, TIMESTAMP)"
            )));
        }
    };
    SqlType::from_str(&text).map_err(|error| Error::invalid(error.to_string()))
}

impl ColumnBuilder {
    /// Appends a JSON value of the seed's files as a value of `column`'s `sql_type` (the
    /// builder's); a value of another kind is an error naming the column, never a silent NULL.
    pub fn append_json(
        &mut self,
        column: &str,
        sql_type: &SqlType,
        value: Option<&Value>,
    ) -> Result<()> {
        let value = match value {
            None | Some(Value::Null) => {
                self.append_null();
                return Ok(());
            }
            Some(value) => value,
        };
        let wrong = || {
            Error::invalid(format!(
                "column '{column}' holds {value} in the seed's files, which its type cannot hold"
            ))
        };
        match self {
            ColumnBuilder::Boolean(b) => b.append_value(match value {
                Value::Bool(flag) => *flag,
                Value::Number(number) => number.as_i64().ok_or_else(wrong)? != 0,
                _ => return Err(wrong()),
            }),
            ColumnBuilder::Int16(b) => b.append_value(integer(value).ok_or_else(wrong)?),
            ColumnBuilder::Int32(b) => b.append_value(integer(value).ok_or_else(wrong)?),
            ColumnBuilder::Int64(b) => b.append_value(integer(value).ok_or_else(wrong)?),
            ColumnBuilder::Float32(b) => b.append_value(value.as_f64().ok_or_else(wrong)? as f32),
            ColumnBuilder::Float64(b) => b.append_value(value.as_f64().ok_or_else(wrong)?),
            ColumnBuilder::Decimal(b, scale) => {
                let text = match value {
                    Value::Number(number) => number.to_string(),
                    Value::String(text) => text.clone(),
                    _ => return Err(wrong()),
                };
                let precision = match sql_type {
                    SqlType::Decimal { precision, .. } => *precision,
                    SqlType::Money => 19,
                    SqlType::SmallMoney => 10,
                    _ => 38,
                };
                b.append_value(scaled_decimal(&text, precision, *scale).ok_or_else(wrong)?);
            }
            ColumnBuilder::Date32(b) => {
                let text = value.as_str().ok_or_else(wrong)?;
                let date = NaiveDate::parse_from_str(text, "%Y-%m-%d").map_err(|_| wrong())?;
                let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).expect("the epoch is a date");
                let days = (date - epoch).num_days();
                b.append_value(i32::try_from(days).map_err(|_| wrong())?);
            }
            ColumnBuilder::Timestamp(b) => {
                let text = value.as_str().ok_or_else(wrong)?;
                let time = ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"]
                    .iter()
                    .find_map(|format| NaiveDateTime::parse_from_str(text, format).ok())
                    .ok_or_else(wrong)?;
                b.append_value(time.and_utc().timestamp_micros());
            }
            ColumnBuilder::Utf8(b) => b.append_value(value.as_str().ok_or_else(wrong)?),
            ColumnBuilder::Binary(_) => return Err(wrong()),
        }
        Ok(())
    }
}

/// A JSON integer in the range of `T`.
fn integer<T: TryFrom<i64>>(value: &Value) -> Option<T> {
    T::try_from(value.as_i64()?).ok()
}

/// Decimal text (`-12.5`, `3`, `1e2` refused) as an integer of `scale` digits; `None` when it
/// is not a decimal, has more fractional digits than the scale (never rounded) or more
/// digits than `precision`.
fn scaled_decimal(text: &str, precision: u8, scale: u8) -> Option<i128> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let fraction = fraction.trim_end_matches('0');
    if whole.is_empty()
        || fraction.len() > usize::from(scale)
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let padded = format!("{whole}{fraction:0<width$}", width = usize::from(scale));
    let magnitude: i128 = padded.parse().ok()?;
    if magnitude >= 10i128.checked_pow(u32::from(precision))? {
        return None;
    }
    Some(if negative { -magnitude } else { magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spark_types_map_to_the_types_sql_server_would_report() {
        let mapped = |spark: &str| sql_type_of(spark).expect(spark).to_string();
        assert_eq!(mapped("INT"), "int");
        assert_eq!(mapped("decimal(18, 2)"), "decimal(18,2)");
        assert_eq!(mapped("STRING"), "nvarchar(max)");
        assert_eq!(mapped("TIMESTAMP"), "datetime2(6)");
        assert!(sql_type_of("MAP<STRING,INT>").is_err());
    }

    #[test]
    fn decimals_are_scaled_exactly_or_refused() {
        assert_eq!(scaled_decimal("12.5", 18, 2), Some(1250));
        assert_eq!(scaled_decimal("-0.01", 18, 2), Some(-1));
        assert_eq!(scaled_decimal("7", 18, 3), Some(7000));
        assert_eq!(scaled_decimal("1.250", 18, 2), Some(125));
        assert_eq!(scaled_decimal("1.255", 18, 2), None, "never rounded");
        assert_eq!(scaled_decimal("1e2", 18, 2), None);
        assert_eq!(scaled_decimal("999.99", 5, 2), Some(99_999));
        assert_eq!(scaled_decimal("1000.00", 5, 2), None, "past the precision");
    }

    #[test]
    fn a_value_of_another_kind_is_an_error_not_a_null() {
        let mut builder = ColumnBuilder::for_sql_type(&SqlType::Int, 2);
        builder
            .append_json("qty", &SqlType::Int, Some(&Value::from(3)))
            .expect("an integer");
        let error = builder
            .append_json("qty", &SqlType::Int, Some(&Value::from("three")))
            .expect_err("text in an int column");
        assert!(error.to_string().contains("qty"), "{error}");
    }
}
