//! Reading SQL Server's CDC catalog: captured columns, the key a snapshot is cut on, a table's
//! columns, the columns a capture instance serves, and the server clock; plus the typed
//! readers of catalog rows, which refuse a missing or mistyped column instead of defaulting.

use crate::keys::{KeyColumn, KeyTuple, KeyValue};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tiberius::{ColumnData, Row};

use super::{OFFSET_REFRESH, Param, SqlServerSource};
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::mssql::clock::{self, ClockSetting, ServerClock};
use crate::mssql::decode::{self, RawColumn};
use crate::mssql::ident;
use crate::mssql::pool;
use crate::mssql::sql;
use crate::offset::CommitTime;
use crate::source::{CapturedColumn, CdcSource, TableName};

/// How long the captured columns of a capture instance are trusted before they are read
/// again: `ALTER COLUMN` on a tracked column changes its type in the change table under the
/// same instance (no DDL event reaches a running server otherwise), so a stale type lasts at
/// most this long; a read that fails with `SCHEMA_CHANGED` forgets its instance's entry at once.
/// <https://learn.microsoft.com/sql/relational-databases/track-changes/about-change-data-capture-sql-server>
pub const CAPTURED_COLUMNS_TTL: Duration = Duration::from_secs(60);

pub(super) fn int_at(row: &Row, index: usize) -> Option<i64> {
    match row.get_column_data(index).ok()? {
        ColumnData::U8(v) => v.map(i64::from),
        ColumnData::I16(v) => v.map(i64::from),
        ColumnData::I32(v) => v.map(i64::from),
        ColumnData::I64(v) => *v,
        ColumnData::Bit(v) => v.map(i64::from),
        ColumnData::Numeric(v) => v.and_then(|n| i64::try_from(n.int_part()).ok()),
        ColumnData::String(v) => v.as_ref().and_then(|text| text.trim().parse().ok()),
        _ => None,
    }
}

pub(super) fn text_at(row: &Row, index: usize) -> Option<String> {
    match row.get_column_data(index).ok()? {
        ColumnData::String(v) => v.as_ref().map(|text| text.to_string()),
        _ => None,
    }
}

/// The key of a row whose columns are `keys`, as [`sql::key_max`] and [`sql::key_bound`]
/// select them: integers as integers, everything else as text.
pub(super) fn key_tuple_at(row: &Row, keys: &[KeyColumn]) -> KeyTuple {
    keys.iter()
        .enumerate()
        .map(|(index, column)| {
            let value = match column.sql_type.is_integer() {
                true => int_at(row, index).map(KeyValue::Int),
                false => text_at(row, index).map(KeyValue::Text),
            };
            value.unwrap_or(KeyValue::Null)
        })
        .collect()
}

/// The parameters binding keyset values (NULLs never are: the SQL text tests them).
pub(super) fn key_params(values: Vec<KeyValue>) -> Vec<Param> {
    values
        .into_iter()
        .filter_map(|value| match value {
            KeyValue::Null => None,
            KeyValue::Int(value) => Some(Param::Int(value)),
            KeyValue::Text(value) => Some(Param::Text(value)),
        })
        .collect()
}

pub(super) fn column_index(row: &Row, name: &str) -> Option<usize> {
    row.columns()
        .iter()
        .position(|column| column.name().eq_ignore_ascii_case(name))
}

pub(super) fn named_int(row: &Row, name: &str) -> Option<i64> {
    int_at(row, column_index(row, name)?)
}

/// An LSN from a binary(10) column; NULL and the zero LSN are `None`.
pub(super) fn lsn_at(row: &Row, index: usize) -> Result<Option<Lsn>> {
    match row.get_column_data(index) {
        Ok(ColumnData::Binary(Some(bytes))) => {
            let lsn = Lsn::try_from_slice(bytes)
                .map_err(|error| Error::Internal(format!("SQL Server sent an LSN: {error}")))?;
            Ok((!lsn.is_zero()).then_some(lsn))
        }
        Ok(ColumnData::Binary(None)) => Ok(None),
        Ok(other) => Err(Error::Internal(format!(
            "SQL Server sent {other:?} where an LSN was expected"
        ))),
        Err(error) => Err(pool::source_error(error)),
    }
}

/// A row of a catalog procedure's result read by column name: a column the result lacks, or a
/// value of another type, is an error naming the procedure and the column, never a default
/// (a misnamed column once read every ordinal as 0).
pub(super) struct CatalogRow<'a> {
    pub(super) row: &'a Row,
    pub(super) source: &'static str,
}

impl CatalogRow<'_> {
    fn index(&self, name: &str) -> Result<usize> {
        column_index(self.row, name).ok_or_else(|| {
            Error::Internal(format!(
                "{} returned no column '{name}' (columns: {})",
                self.source,
                self.row
                    .columns()
                    .iter()
                    .map(|column| column.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }

    fn mistyped(&self, name: &str, wanted: &str, got: &ColumnData<'_>) -> Error {
        Error::Internal(format!(
            "{} returned column '{name}' as {got:?}, not {wanted}",
            self.source
        ))
    }

    /// An integer column; `None` for NULL.
    pub(super) fn int(&self, name: &str) -> Result<Option<i64>> {
        let data = self
            .row
            .get_column_data(self.index(name)?)
            .map_err(pool::source_error)?;
        Ok(match data {
            ColumnData::U8(v) => v.map(i64::from),
            ColumnData::I16(v) => v.map(i64::from),
            ColumnData::I32(v) => v.map(i64::from),
            ColumnData::I64(v) => *v,
            ColumnData::Numeric(v) => match v {
                Some(n) => Some(
                    i64::try_from(n.int_part())
                        .map_err(|_| self.mistyped(name, "a BIGINT", data))?,
                ),
                None => None,
            },
            other => return Err(self.mistyped(name, "an integer", other)),
        })
    }

    /// An integer column that may not be NULL.
    pub(super) fn required_int(&self, name: &str) -> Result<i64> {
        self.int(name)?.ok_or_else(|| self.null(name))
    }

    /// A text column; `None` for NULL.
    pub(super) fn text(&self, name: &str) -> Result<Option<String>> {
        let data = self
            .row
            .get_column_data(self.index(name)?)
            .map_err(pool::source_error)?;
        match data {
            ColumnData::String(v) => Ok(v.as_ref().map(|text| text.to_string())),
            other => Err(self.mistyped(name, "text", other)),
        }
    }

    /// A text column that may not be NULL.
    pub(super) fn required_text(&self, name: &str) -> Result<String> {
        self.text(name)?.ok_or_else(|| self.null(name))
    }

    /// A binary(10) LSN column; NULL and the zero LSN are `None`.
    pub(super) fn lsn(&self, name: &str) -> Result<Option<Lsn>> {
        lsn_at(self.row, self.index(name)?)
    }

    fn null(&self, name: &str) -> Error {
        Error::Internal(format!(
            "{} returned NULL in column '{name}', which is never NULL",
            self.source
        ))
    }
}

/// Microseconds since the epoch of a date-time column (datetime, datetime2).
pub(super) fn micros_at(row: &Row, index: usize) -> Option<i64> {
    match row.get_column_data(index).ok()? {
        ColumnData::DateTime2(v) => v.map(decode::datetime2_micros),
        ColumnData::DateTime(v) => v.map(decode::datetime_micros),
        _ => None,
    }
}

/// The names of an `index_column_list`: `[a], [b]]c]` → `a`, `b]c`.
pub fn parse_bracket_list(list: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut chars = list.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '[' {
            continue;
        }
        let mut name = String::new();
        while let Some(c) = chars.next() {
            if c == ']' {
                if chars.peek() == Some(&']') {
                    chars.next();
                    name.push(']');
                } else {
                    break;
                }
            } else {
                name.push(c);
            }
        }
        names.push(name);
    }
    names
}

impl SqlServerSource {
    /// The server clock, asked for once (a named zone) or every minute (an offset).
    pub(super) async fn clock(&self) -> Result<ServerClock> {
        if let ClockSetting::Fixed(clock) = &self.config.clock {
            return Ok(clock.clone());
        }
        let mut cached = self.clock.lock().await;
        if let Some((clock, read_at)) = cached.as_ref()
            && (!matches!(clock, ServerClock::Offset(_)) || read_at.elapsed() < OFFSET_REFRESH)
        {
            return Ok(clock.clone());
        }
        let named = self
            .first_row(clock::named_zone_capability_sql(), &[])
            .await?
            .and_then(|row| int_at(&row, 0))
            == Some(1);
        let clock = if named {
            let zone = self
                .first_row(clock::zone_sql(), &[])
                .await?
                .and_then(|row| text_at(&row, 0))
                .unwrap_or_else(|| "UTC".to_string());
            if zone.eq_ignore_ascii_case("UTC") {
                ServerClock::Utc
            } else {
                ServerClock::Zone(zone)
            }
        } else {
            let minutes = self
                .first_row(clock::offset_sql(), &[])
                .await?
                .and_then(|row| int_at(&row, 0))
                .unwrap_or(0);
            let clock = ServerClock::Offset(i32::try_from(minutes).unwrap_or(0));
            if minutes != 0 {
                tracing::warn!(
                    %clock,
                    "this SQL Server cannot name its time zone (before 2022): commit times are \
                     converted with its current offset, which is wrong across a daylight-saving \
                     change; set source_time_zone to the server's Windows zone to fix"
                );
            }
            clock
        };
        *cached = Some((clock.clone(), Instant::now()));
        Ok(clock)
    }

    /// The captured columns of an instance, in ordinal order.
    pub(super) async fn captured_columns(
        &self,
        capture_instance: &str,
    ) -> Result<Vec<CapturedColumn>> {
        let rows = self
            .rows(
                sql::captured_columns(),
                &[Param::Text(capture_instance.to_string())],
            )
            .await
            .map_err(|error| match error {
                Error::Internal(message) => Error::invalid(format!(
                    "capture instance '{capture_instance}': sys.sp_cdc_get_captured_columns \
                     failed. Cause: {message}"
                )),
                other => other,
            })?;
        let mut columns = Vec::with_capacity(rows.len());
        for row in &rows {
            // The result set of sys.sp_cdc_get_captured_columns: `ordinal_position` is the
            // column's position in the change table.
            // <https://learn.microsoft.com/sql/relational-databases/system-stored-procedures/sys-sp-cdc-get-captured-columns-transact-sql>
            let row = CatalogRow {
                row,
                source: "sys.sp_cdc_get_captured_columns",
            };
            let raw = RawColumn {
                name: row.required_text("column_name")?,
                column_id: row.required_int("column_id")? as i32,
                ordinal: row.required_int("ordinal_position")? as i32,
                data_type: row.required_text("data_type")?,
                character_maximum_length: row.int("character_maximum_length")?.map(|n| n as i32),
                numeric_precision: row.int("numeric_precision")?.map(|n| n as u8),
                numeric_scale: row.int("numeric_scale")?.map(|n| n as i32),
                datetime_precision: row.int("datetime_precision")?.map(|n| n as i16),
            };
            columns.push(CapturedColumn {
                sql_type: raw.sql_type()?,
                name: raw.name,
                column_id: raw.column_id,
                ordinal: raw.ordinal,
            });
        }
        columns.sort_by_key(|column| column.ordinal);
        Ok(columns)
    }

    /// The single integer key snapshots are cut on, or an error saying why there is none.
    pub(super) async fn integer_key(
        &self,
        table: &TableName,
    ) -> Result<(String, crate::types::SqlType)> {
        let instances = self.active_capture_instances(table).await?;
        let newest = instances.last().ok_or_else(|| Error::TableNotFound {
            table: table.to_string(),
        })?;
        match newest.index_columns.as_slice() {
            [key] => {
                let column = newest
                    .columns
                    .iter()
                    .find(|column| &column.name == key)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "{table}: key column '{key}' is not captured by '{}'",
                            newest.name
                        ))
                    })?;
                if !column.sql_type.is_integer() {
                    return Err(Error::invalid(format!(
                        "{table}: snapshots are cut on one integer key column; '{key}' is {}",
                        column.sql_type
                    )));
                }
                Ok((key.clone(), column.sql_type.clone()))
            }
            [] => Err(Error::invalid(format!(
                "{table} has no unique index CDC uses ('{}' lists none): snapshots need one",
                newest.name
            ))),
            keys => Err(Error::invalid(format!(
                "{table}: snapshots are cut on one integer key column; the unique index is ({})",
                keys.join(", ")
            ))),
        }
    }

    /// The columns a table has now: every name, and the computed ones.
    pub(super) async fn table_columns(
        &self,
        table: &TableName,
    ) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
        let rows = self
            .rows(
                sql::table_columns(),
                &[Param::Text(ident::quote_table(table)?)],
            )
            .await?;
        let mut present = BTreeSet::new();
        let mut computed = BTreeSet::new();
        for row in &rows {
            if let Some(name) = text_at(row, 0) {
                if int_at(row, 2) == Some(1) {
                    computed.insert(name.clone());
                }
                present.insert(name);
            }
        }
        Ok((present, computed))
    }

    /// The captured columns of an instance as served: CDC records computed columns as NULL
    /// in every change row, so they are left out (with a warning), as the seed does. Kept
    /// for [`CAPTURED_COLUMNS_TTL`]: an `ALTER COLUMN` changes a change table's column type
    /// without a new capture instance, and a read planned on the old type that meets a
    /// value it cannot hold fails with `SCHEMA_CHANGED` (see `decode`).
    pub(super) async fn served_columns(
        &self,
        table: &TableName,
        capture_instance: &str,
        create_date: CommitTime,
    ) -> Result<Vec<CapturedColumn>> {
        let key = (capture_instance.to_string(), create_date);
        if let Some((columns, read_at)) = self.captured.lock().await.get(&key)
            && read_at.elapsed() < CAPTURED_COLUMNS_TTL
        {
            return Ok(columns.clone());
        }
        let mut columns = self.captured_columns(capture_instance).await?;
        let (_, computed) = self.table_columns(table).await?;
        columns.retain(|column| {
            let keep = !computed.contains(&column.name);
            if !keep {
                tracing::warn!(
                    capture_instance,
                    column = %column.name,
                    "computed column left out: CDC records it as NULL in every change row"
                );
            }
            keep
        });
        self.captured
            .lock()
            .await
            .insert(key, (columns.clone(), Instant::now()));
        Ok(columns)
    }
}
