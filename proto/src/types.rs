//! SQL Server column types and the Arrow types they are served as.
//!
//! The mapping is the seed library's (notes/seed-inventory.md section 4), adjusted to what
//! Delta stores: `tinyint` is Int16 (Delta has no unsigned byte), date-times are microsecond
//! timestamps without a zone (`datetime2(7)` loses its 100 ns digit), `datetimeoffset` is a
//! UTC instant, `time` is text (Delta has no TIME type), `money` is `decimal(19,4)`, and a
//! `uniqueidentifier` is its upper-case text. Types without a default (`sql_variant`, the CLR
//! types) are refused by name, so a user can leave the column out.
//!
//! The output schema of every stream starts with six metadata columns (section 3.7 of the
//! inventory), then the captured columns in capture order.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};

/// The declared length of a character or binary column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Length {
    /// `(n)`: at most n characters (or bytes).
    Limited(u32),
    /// `(max)`.
    Max,
}

impl fmt::Display for Length {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Length::Limited(n) => write!(f, "{n}"),
            Length::Max => f.write_str("max"),
        }
    }
}

/// A SQL Server column type, as the catalog declares it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the variants are the SQL Server type names
pub enum SqlType {
    Bit,
    TinyInt,
    SmallInt,
    Int,
    BigInt,
    Real,
    Float,
    Decimal {
        precision: u8,
        scale: u8,
    },
    Money,
    SmallMoney,
    Date,
    DateTime,
    SmallDateTime,
    DateTime2 {
        precision: u8,
    },
    DateTimeOffset {
        precision: u8,
    },
    Time {
        precision: u8,
    },
    Char(Length),
    VarChar(Length),
    NChar(Length),
    NVarChar(Length),
    Text,
    NText,
    Xml,
    UniqueIdentifier,
    Binary(Length),
    VarBinary(Length),
    Image,
    RowVersion,
    /// A type with no default mapping (`sql_variant`, `geography`, `hierarchyid`, ...).
    Unsupported(String),
}

/// Why a text is not a SQL type this crate knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{text}' is not a SQL Server type: {reason}")]
pub struct SqlTypeParseError {
    /// The text given.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

impl SqlType {
    /// The Arrow type values of this column are served as; `None` for unsupported types.
    pub fn arrow_type(&self) -> Option<DataType> {
        Some(match self {
            SqlType::Bit => DataType::Boolean,
            SqlType::TinyInt | SqlType::SmallInt => DataType::Int16,
            SqlType::Int => DataType::Int32,
            SqlType::BigInt => DataType::Int64,
            SqlType::Real => DataType::Float32,
            SqlType::Float => DataType::Float64,
            SqlType::Decimal { precision, scale } => {
                DataType::Decimal128(*precision, i8::try_from(*scale).ok()?)
            }
            SqlType::Money => DataType::Decimal128(19, 4),
            SqlType::SmallMoney => DataType::Decimal128(10, 4),
            SqlType::Date => DataType::Date32,
            SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
                DataType::Timestamp(TimeUnit::Microsecond, None)
            }
            SqlType::DateTimeOffset { .. } => {
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
            }
            SqlType::Time { .. }
            | SqlType::Char(_)
            | SqlType::VarChar(_)
            | SqlType::NChar(_)
            | SqlType::NVarChar(_)
            | SqlType::Text
            | SqlType::NText
            | SqlType::Xml
            | SqlType::UniqueIdentifier => DataType::Utf8,
            SqlType::Binary(_) | SqlType::VarBinary(_) | SqlType::Image | SqlType::RowVersion => {
                DataType::Binary
            }
            SqlType::Unsupported(_) => return None,
        })
    }

    /// Whether the type is a sized character type (compared under a collation).
    pub fn is_text(&self) -> bool {
        matches!(
            self,
            SqlType::Char(_) | SqlType::VarChar(_) | SqlType::NChar(_) | SqlType::NVarChar(_)
        )
    }

    /// Whether the type holds integers usable as a numeric key (range partitioning, buckets).
    pub fn is_integer(&self) -> bool {
        matches!(
            self,
            SqlType::TinyInt | SqlType::SmallInt | SqlType::Int | SqlType::BigInt
        )
    }
}

impl fmt::Display for SqlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SqlType::Bit => f.write_str("bit"),
            SqlType::TinyInt => f.write_str("tinyint"),
            SqlType::SmallInt => f.write_str("smallint"),
            SqlType::Int => f.write_str("int"),
            SqlType::BigInt => f.write_str("bigint"),
            SqlType::Real => f.write_str("real"),
            SqlType::Float => f.write_str("float"),
            SqlType::Decimal { precision, scale } => write!(f, "decimal({precision},{scale})"),
            SqlType::Money => f.write_str("money"),
            SqlType::SmallMoney => f.write_str("smallmoney"),
            SqlType::Date => f.write_str("date"),
            SqlType::DateTime => f.write_str("datetime"),
            SqlType::SmallDateTime => f.write_str("smalldatetime"),
            SqlType::DateTime2 { precision } => write!(f, "datetime2({precision})"),
            SqlType::DateTimeOffset { precision } => write!(f, "datetimeoffset({precision})"),
            SqlType::Time { precision } => write!(f, "time({precision})"),
            SqlType::Char(length) => write!(f, "char({length})"),
            SqlType::VarChar(length) => write!(f, "varchar({length})"),
            SqlType::NChar(length) => write!(f, "nchar({length})"),
            SqlType::NVarChar(length) => write!(f, "nvarchar({length})"),
            SqlType::Text => f.write_str("text"),
            SqlType::NText => f.write_str("ntext"),
            SqlType::Xml => f.write_str("xml"),
            SqlType::UniqueIdentifier => f.write_str("uniqueidentifier"),
            SqlType::Binary(length) => write!(f, "binary({length})"),
            SqlType::VarBinary(length) => write!(f, "varbinary({length})"),
            SqlType::Image => f.write_str("image"),
            SqlType::RowVersion => f.write_str("rowversion"),
            SqlType::Unsupported(name) => f.write_str(name),
        }
    }
}

impl FromStr for SqlType {
    type Err = SqlTypeParseError;

    /// Parses a type as T-SQL writes it: `int`, `decimal(18,4)`, `nvarchar(max)`,
    /// `datetime2(7)`; names are case-insensitive and defaults follow SQL Server
    /// (`decimal` = `decimal(18,0)`, `datetime2` = `datetime2(7)`, `char` = `char(1)`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = |reason: &str| SqlTypeParseError {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let lower = compact.to_ascii_lowercase();
        let (name, arguments) = match lower.split_once('(') {
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix(')')
                    .ok_or_else(|| error("unbalanced parenthesis"))?;
                (name.to_string(), Some(inner.to_string()))
            }
            None => (lower.clone(), None),
        };
        let numbers = |max_count: usize| -> Result<Vec<u32>, SqlTypeParseError> {
            let Some(inner) = &arguments else {
                return Ok(Vec::new());
            };
            let parsed: Result<Vec<u32>, _> = inner.split(',').map(str::parse::<u32>).collect();
            let parsed = parsed.map_err(|_| error("arguments must be whole numbers"))?;
            if parsed.len() > max_count {
                return Err(error("too many arguments"));
            }
            Ok(parsed)
        };
        let length = |default: u32, limit: u32| -> Result<Length, SqlTypeParseError> {
            match arguments.as_deref() {
                None => Ok(Length::Limited(default)),
                Some("max") => Ok(Length::Max),
                Some(_) => {
                    let n = numbers(1)?[0];
                    if n == 0 || n > limit {
                        return Err(error(&format!("length must be 1 to {limit} or max")));
                    }
                    Ok(Length::Limited(n))
                }
            }
        };
        let precision = |default: u8, limit: u8| -> Result<u8, SqlTypeParseError> {
            match numbers(1)?.first() {
                None => Ok(default),
                Some(&p) if p <= u32::from(limit) => Ok(p as u8),
                Some(_) => Err(error(&format!("fractional precision must be 0 to {limit}"))),
            }
        };
        let no_arguments = |value: SqlType| -> Result<SqlType, SqlTypeParseError> {
            if arguments.is_some() {
                return Err(error("this type takes no arguments"));
            }
            Ok(value)
        };
        match name.as_str() {
            "bit" => no_arguments(SqlType::Bit),
            "tinyint" => no_arguments(SqlType::TinyInt),
            "smallint" => no_arguments(SqlType::SmallInt),
            "int" => no_arguments(SqlType::Int),
            "bigint" => no_arguments(SqlType::BigInt),
            "real" => no_arguments(SqlType::Real),
            "float" => match numbers(1)?.first() {
                None => Ok(SqlType::Float),
                Some(&n) if (1..=24).contains(&n) => Ok(SqlType::Real),
                Some(&n) if (25..=53).contains(&n) => Ok(SqlType::Float),
                Some(_) => Err(error("float(n) takes n from 1 to 53")),
            },
            "decimal" | "numeric" => {
                let parts = numbers(2)?;
                let precision = parts.first().copied().unwrap_or(18);
                let scale = parts.get(1).copied().unwrap_or(0);
                if !(1..=38).contains(&precision) || scale > precision {
                    return Err(error(
                        "precision must be 1 to 38 and scale at most precision",
                    ));
                }
                Ok(SqlType::Decimal {
                    precision: precision as u8,
                    scale: scale as u8,
                })
            }
            "money" => no_arguments(SqlType::Money),
            "smallmoney" => no_arguments(SqlType::SmallMoney),
            "date" => no_arguments(SqlType::Date),
            "datetime" => no_arguments(SqlType::DateTime),
            "smalldatetime" => no_arguments(SqlType::SmallDateTime),
            "datetime2" => Ok(SqlType::DateTime2 {
                precision: precision(7, 7)?,
            }),
            "datetimeoffset" => Ok(SqlType::DateTimeOffset {
                precision: precision(7, 7)?,
            }),
            "time" => Ok(SqlType::Time {
                precision: precision(7, 7)?,
            }),
            "char" => Ok(SqlType::Char(length(1, 8000)?)),
            "varchar" => Ok(SqlType::VarChar(length(1, 8000)?)),
            "nchar" => Ok(SqlType::NChar(length(1, 4000)?)),
            "nvarchar" | "sysname" => Ok(SqlType::NVarChar(if name == "sysname" {
                Length::Limited(128)
            } else {
                length(1, 4000)?
            })),
            "text" => no_arguments(SqlType::Text),
            "ntext" => no_arguments(SqlType::NText),
            "xml" => no_arguments(SqlType::Xml),
            "uniqueidentifier" => no_arguments(SqlType::UniqueIdentifier),
            "binary" => Ok(SqlType::Binary(length(1, 8000)?)),
            "varbinary" => Ok(SqlType::VarBinary(length(1, 8000)?)),
            "image" => no_arguments(SqlType::Image),
            "rowversion" | "timestamp" => no_arguments(SqlType::RowVersion),
            "sql_variant" | "geography" | "geometry" | "hierarchyid" => {
                Ok(SqlType::Unsupported(name))
            }
            _ => Err(error("unknown type name")),
        }
    }
}

/// Metadata column: the capture instance a row was read from.
pub const CAPTURE_INSTANCE_COLUMN: &str = "_capture_instance";
/// Metadata column: the commit LSN (`__$start_lsn`).
pub const START_LSN_COLUMN: &str = "_start_lsn";
/// Metadata column: the operation's LSN inside its transaction (`__$seqval`).
pub const SEQVAL_COLUMN: &str = "_seqval";
/// Metadata column: 1 delete, 2 insert, 3 update before, 4 update after (0 snapshot).
pub const OPERATION_COLUMN: &str = "_operation";
/// Metadata column: the statement's number inside its transaction (`__$command_id`).
pub const COMMAND_ID_COLUMN: &str = "_command_id";
/// Metadata column: the commit time in UTC (`cdc.lsn_time_mapping.tran_end_time`).
pub const COMMIT_TS_COLUMN: &str = "_commit_ts";

/// Names no captured column may have (compared case-insensitively): the metadata columns and
/// the columns bronze adds.
pub const RESERVED_COLUMN_NAMES: [&str; 9] = [
    CAPTURE_INSTANCE_COLUMN,
    START_LSN_COLUMN,
    SEQVAL_COLUMN,
    OPERATION_COLUMN,
    COMMAND_ID_COLUMN,
    COMMIT_TS_COLUMN,
    "_batch_id",
    "_snapshot",
    "_chunk",
];

/// The text a `time(precision)` value is served as: `HH:MM:SS` and, for a fractional
/// precision, seven digits (100 ns) with those past the precision zero. `ticks` counts 100 ns
/// since midnight.
pub fn time_text(ticks: u64, precision: u8) -> String {
    let (seconds, fraction) = (ticks / 10_000_000, ticks % 10_000_000);
    let clock = format!(
        "{:02}:{:02}:{:02}",
        seconds / 3600,
        (seconds / 60) % 60,
        seconds % 60
    );
    if precision == 0 {
        return clock;
    }
    let unit = 10u64.pow(7 - u32::from(precision.min(7)));
    format!("{clock}.{:07}", fraction / unit * unit)
}

/// The Arrow type of `_commit_ts`.
pub fn commit_ts_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, None)
}

/// Field metadata key carrying a captured column's SQL Server type on the output schema.
pub const SQL_TYPE_METADATA_KEY: &str = "mssql_cdc.sql_type";

/// One captured column of an output schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputColumn {
    /// The column name.
    pub name: String,
    /// Its SQL Server type.
    pub sql_type: SqlType,
}

/// The output schema: the six metadata columns (without `_command_id` when
/// `include_command_id` is false), then the captured columns, each nullable and tagged with
/// its SQL type in the field metadata.
pub fn output_schema(columns: &[OutputColumn], include_command_id: bool) -> SchemaRef {
    let mut fields = vec![
        Field::new(CAPTURE_INSTANCE_COLUMN, DataType::Utf8, false),
        Field::new(START_LSN_COLUMN, DataType::Utf8, false),
        Field::new(SEQVAL_COLUMN, DataType::Utf8, true),
        Field::new(OPERATION_COLUMN, DataType::Int32, false),
    ];
    if include_command_id {
        fields.push(Field::new(COMMAND_ID_COLUMN, DataType::Int32, true));
    }
    fields.push(Field::new(COMMIT_TS_COLUMN, commit_ts_type(), true));
    for column in columns {
        let data_type = column
            .sql_type
            .arrow_type()
            .expect("output columns are validated to have an arrow type");
        fields.push(
            Field::new(&column.name, data_type, true).with_metadata(
                [(
                    SQL_TYPE_METADATA_KEY.to_string(),
                    column.sql_type.to_string(),
                )]
                .into(),
            ),
        );
    }
    Arc::new(Schema::new(fields))
}

/// Name of the chunk column of snapshot rows (`_chunk`, NULL in a full snapshot).
pub const CHUNK_COLUMN: &str = "_chunk";

/// The schema of snapshot rows: the output schema plus `_chunk`.
pub fn snapshot_schema(columns: &[OutputColumn], include_command_id: bool) -> SchemaRef {
    let base = output_schema(columns, include_command_id);
    let mut fields: Vec<Field> = base.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(CHUNK_COLUMN, DataType::Int32, true));
    Arc::new(Schema::new(fields))
}

/// The Arrow memory the rows of `batch` use, counting only the parts of shared buffers its
/// (possibly sliced) columns reach. `RecordBatch::get_array_memory_size` counts whole
/// buffers, so a column sliced from an IPC message reports the entire message.
pub fn batch_slice_size(batch: &arrow::record_batch::RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|column| {
            let data = column.to_data();
            data.get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size())
        })
        .sum()
}

/// Number of metadata columns in front of the captured columns.
pub fn metadata_column_count(include_command_id: bool) -> usize {
    if include_command_id { 6 } else { 5 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_shape() {
        for text in [
            "bit",
            "tinyint",
            "int",
            "bigint",
            "decimal(18,4)",
            "money",
            "datetime2(7)",
            "datetime2(3)",
            "datetimeoffset(7)",
            "time(7)",
            "nvarchar(100)",
            "nvarchar(max)",
            "varbinary(max)",
            "char(10)",
            "uniqueidentifier",
            "rowversion",
        ] {
            let parsed: SqlType = text.parse().expect(text);
            assert_eq!(parsed.to_string(), text);
        }
    }

    #[test]
    fn applies_sql_server_defaults_and_case() {
        assert_eq!(
            "DECIMAL".parse::<SqlType>().expect("ok").to_string(),
            "decimal(18,0)"
        );
        assert_eq!(
            "Numeric(9, 2)".parse::<SqlType>().expect("ok").to_string(),
            "decimal(9,2)"
        );
        assert_eq!(
            "datetime2".parse::<SqlType>().expect("ok").to_string(),
            "datetime2(7)"
        );
        assert_eq!("float(10)".parse::<SqlType>().expect("ok"), SqlType::Real);
        assert_eq!(
            "sysname".parse::<SqlType>().expect("ok").to_string(),
            "nvarchar(128)"
        );
    }

    #[test]
    fn refuses_bad_types_with_the_reason() {
        let error = "decimal(50,2)".parse::<SqlType>().expect_err("too wide");
        assert!(
            error.to_string().contains("precision must be 1 to 38"),
            "{error}"
        );
        assert!("nvarchar(5000)".parse::<SqlType>().is_err());
        assert!("int(4)".parse::<SqlType>().is_err());
        assert!("strange".parse::<SqlType>().is_err());
        assert!("varchar(10".parse::<SqlType>().is_err());
    }

    #[test]
    fn maps_to_delta_safe_arrow_types() {
        assert_eq!(SqlType::TinyInt.arrow_type(), Some(DataType::Int16));
        assert_eq!(
            SqlType::Money.arrow_type(),
            Some(DataType::Decimal128(19, 4))
        );
        assert_eq!(
            SqlType::DateTime2 { precision: 7 }.arrow_type(),
            Some(DataType::Timestamp(TimeUnit::Microsecond, None))
        );
        assert_eq!(
            SqlType::Time { precision: 7 }.arrow_type(),
            Some(DataType::Utf8)
        );
        assert_eq!(SqlType::Unsupported("geography".into()).arrow_type(), None);
    }

    #[test]
    fn output_schema_starts_with_the_metadata_columns() {
        let schema = output_schema(
            &[OutputColumn {
                name: "id".into(),
                sql_type: SqlType::Int,
            }],
            true,
        );
        let names: Vec<_> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "_capture_instance",
                "_start_lsn",
                "_seqval",
                "_operation",
                "_command_id",
                "_commit_ts",
                "id"
            ]
        );
        assert_eq!(
            schema
                .field(6)
                .metadata()
                .get(SQL_TYPE_METADATA_KEY)
                .map(String::as_str),
            Some("int")
        );
        assert_eq!(output_schema(&[], false).fields().len(), 5);
    }
}
