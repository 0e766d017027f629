//! One typed Arrow builder per column of the output schema, shared by both sources: the SQL
//! Server reader appends the TDS values of each row (`mssql::decode`), the simulator its
//! generated values (`sim::values`). Each adds its own `append` in its module.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryBuilder, BooleanBuilder, Date32Builder, Decimal128Builder, Float32Builder,
    Float64Builder, Int16Builder, Int32Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, TimeUnit};

use crate::error::{Error, Result};

/// A typed Arrow builder for one column, by the Arrow type the column is served as
/// ([`crate::types`] maps SQL types to these).
pub enum ColumnBuilder {
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
    /// decimal, numeric, money, smallmoney, with the column's scale.
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

impl ColumnBuilder {
    /// A builder for values of `data_type` with room for `capacity` rows.
    pub fn new(data_type: &DataType, capacity: usize) -> Result<Self> {
        Ok(match data_type {
            DataType::Boolean => ColumnBuilder::Boolean(BooleanBuilder::with_capacity(capacity)),
            DataType::Int16 => ColumnBuilder::Int16(Int16Builder::with_capacity(capacity)),
            DataType::Int32 => ColumnBuilder::Int32(Int32Builder::with_capacity(capacity)),
            DataType::Int64 => ColumnBuilder::Int64(Int64Builder::with_capacity(capacity)),
            DataType::Float32 => ColumnBuilder::Float32(Float32Builder::with_capacity(capacity)),
            DataType::Float64 => ColumnBuilder::Float64(Float64Builder::with_capacity(capacity)),
            DataType::Decimal128(precision, scale) => ColumnBuilder::Decimal(
                Decimal128Builder::with_capacity(capacity)
                    .with_precision_and_scale(*precision, *scale)?,
                u8::try_from(*scale)
                    .map_err(|_| Error::Internal(format!("negative decimal scale {scale}")))?,
            ),
            DataType::Date32 => ColumnBuilder::Date32(Date32Builder::with_capacity(capacity)),
            DataType::Timestamp(TimeUnit::Microsecond, zone) => ColumnBuilder::Timestamp(
                TimestampMicrosecondBuilder::with_capacity(capacity)
                    .with_timezone_opt(zone.clone()),
            ),
            DataType::Utf8 => ColumnBuilder::Utf8(StringBuilder::with_capacity(capacity, 0)),
            DataType::Binary => ColumnBuilder::Binary(BinaryBuilder::with_capacity(capacity, 0)),
            other => {
                return Err(Error::Internal(format!(
                    "no column builder for Arrow type {other}"
                )));
            }
        })
    }

    /// Appends NULL.
    pub fn append_null(&mut self) {
        match self {
            ColumnBuilder::Boolean(b) => b.append_null(),
            ColumnBuilder::Int16(b) => b.append_null(),
            ColumnBuilder::Int32(b) => b.append_null(),
            ColumnBuilder::Int64(b) => b.append_null(),
            ColumnBuilder::Float32(b) => b.append_null(),
            ColumnBuilder::Float64(b) => b.append_null(),
            ColumnBuilder::Decimal(b, _) => b.append_null(),
            ColumnBuilder::Date32(b) => b.append_null(),
            ColumnBuilder::Timestamp(b) => b.append_null(),
            ColumnBuilder::Utf8(b) => b.append_null(),
            ColumnBuilder::Binary(b) => b.append_null(),
        }
    }

    /// The column built so far; the builder starts over empty.
    pub fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::Boolean(b) => Arc::new(b.finish()),
            ColumnBuilder::Int16(b) => Arc::new(b.finish()),
            ColumnBuilder::Int32(b) => Arc::new(b.finish()),
            ColumnBuilder::Int64(b) => Arc::new(b.finish()),
            ColumnBuilder::Float32(b) => Arc::new(b.finish()),
            ColumnBuilder::Float64(b) => Arc::new(b.finish()),
            ColumnBuilder::Decimal(b, _) => Arc::new(b.finish()),
            ColumnBuilder::Date32(b) => Arc::new(b.finish()),
            ColumnBuilder::Timestamp(b) => Arc::new(b.finish()),
            ColumnBuilder::Utf8(b) => Arc::new(b.finish()),
            ColumnBuilder::Binary(b) => Arc::new(b.finish()),
        }
    }
}
