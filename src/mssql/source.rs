//! [`SqlServerSource`]: every [`CdcSource`] call in T-SQL over tiberius.
//!
//! Planning calls run one statement of [`super::sql`] on a pooled connection, retried on
//! transient errors. Streaming reads (change ranges, snapshot pieces) take a connection of
//! their own in a task that decodes rows into Arrow batches ([`super::decode`]) and sends
//! them through a bounded channel, so a slow client slows the read instead of filling
//! memory; when the client goes away the query is cancelled (TDS attention) and the
//! connection returned clean, or dropped if the cancel fails.

use crate::keys::{KeyColumn, KeySeek, KeyTuple, KeyValue};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, Int32Array, StringArray, TimestampMicrosecondArray, new_null_array};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::TryStreamExt;
use tiberius::{ColumnData, Row, ToSql};
use tokio::sync::{Mutex, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::clock::{self, ClockSetting, ServerClock};
use super::config::SqlServerConfig;
use super::decode::{self, ColumnDecoder, RawColumn};
use super::ident;
use super::pool::{self, Connection, Connections, Manager};
use super::sql;
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::offset::CommitTime;
use crate::source::{
    BatchStream, CaptureInstance, CapturedColumn, CdcSource, ChangeRead, DdlEntry, KeyBucket,
    KeyExtent, SnapshotRead, TableName, Tile, TrackedTable, check_bucket_grid,
};
use crate::types::{OutputColumn, output_schema, snapshot_schema};

/// How long an offset read from an older server (no named zone) is trusted before it is
/// read again: a daylight-saving change moves it.
const OFFSET_REFRESH: Duration = Duration::from_secs(60);
/// Retries of a transient failure (ADR 0029).
const RETRIES: u32 = 3;
/// Batches a read may have in flight towards the client.
const READ_AHEAD_BATCHES: usize = 2;

/// A bound parameter, owned so a read task can hold it.
#[derive(Clone, Debug)]
enum Param {
    Bytes(Vec<u8>),
    Text(String),
    Int(i64),
}

impl Param {
    fn lsn(lsn: Lsn) -> Self {
        Param::Bytes(lsn.as_bytes().to_vec())
    }

    fn as_sql(&self) -> &dyn ToSql {
        match self {
            Param::Bytes(bytes) => bytes,
            Param::Text(text) => text,
            Param::Int(value) => value,
        }
    }
}

/// The CDC source of a SQL Server database (2016 or newer).
pub struct SqlServerSource {
    pool: Connections,
    config: SqlServerConfig,
    clock: Mutex<Option<(ServerClock, Instant)>>,
    /// Captured columns per capture instance and creation time (an instance re-created
    /// under the same name gets a new entry), computed columns left out.
    captured: Mutex<BTreeMap<(String, CommitTime), Vec<CapturedColumn>>>,
    retry_base: Duration,
}

impl SqlServerSource {
    /// Opens the pool and checks one connection (retrying transient failures), so a wrong
    /// address or login fails at start with SQL Server's message.
    pub async fn connect(config: SqlServerConfig) -> Result<Self> {
        let manager = Manager::new(config.tiberius.clone(), config.trusts_any_certificate);
        let pool = Connections::new(manager, config.pool_size);
        let source = SqlServerSource {
            pool,
            config,
            clock: Mutex::new(None),
            captured: Mutex::new(BTreeMap::new()),
            retry_base: Duration::from_secs(1),
        };
        source.rows(sql::ping(), &[]).await?;
        let clock = source.clock().await?;
        tracing::info!(source = %source.config.describe(), %clock, "connected to SQL Server");
        Ok(source)
    }

    /// Runs one statement and returns its first result's rows, retrying transient failures.
    async fn rows(&self, statement: &str, params: &[Param]) -> Result<Vec<Row>> {
        pool::with_retries(
            &statement_name(statement),
            RETRIES,
            self.retry_base,
            || async {
                let mut connection = self.pool.get().await?;
                let values: Vec<&dyn ToSql> = params.iter().map(Param::as_sql).collect();
                connection.dirty = true;
                let rows = connection
                    .client
                    .query(statement, &values)
                    .await
                    .map_err(pool::source_error)?
                    .into_first_result()
                    .await
                    .map_err(pool::source_error)?;
                connection.dirty = false;
                Ok(rows)
            },
        )
        .await
    }

    async fn first_row(&self, statement: &str, params: &[Param]) -> Result<Option<Row>> {
        Ok(self.rows(statement, params).await?.into_iter().next())
    }

    /// The server clock, asked for once (a named zone) or every minute (an offset).
    async fn clock(&self) -> Result<ServerClock> {
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

    async fn lsn_query(&self, statement: &str, params: &[Param]) -> Result<Option<Lsn>> {
        match self.first_row(statement, params).await? {
            Some(row) => lsn_at(&row, 0),
            None => Ok(None),
        }
    }

    async fn time_query(&self, statement: &str, lsn: Lsn) -> Result<Option<CommitTime>> {
        Ok(self
            .first_row(statement, &[Param::lsn(lsn)])
            .await?
            .and_then(|row| micros_at(&row, 0))
            .map(CommitTime))
    }

    /// The captured columns of an instance, in ordinal order.
    async fn captured_columns(&self, capture_instance: &str) -> Result<Vec<CapturedColumn>> {
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
            let raw = RawColumn {
                name: named_text(row, "column_name").unwrap_or_default(),
                column_id: named_int(row, "column_id").unwrap_or(0) as i32,
                ordinal: named_int(row, "column_ordinal").unwrap_or(0) as i32,
                data_type: named_text(row, "data_type").unwrap_or_default(),
                character_maximum_length: named_int(row, "character_maximum_length")
                    .map(|n| n as i32),
                numeric_precision: named_int(row, "numeric_precision").map(|n| n as u8),
                numeric_scale: named_int(row, "numeric_scale").map(|n| n as i32),
                datetime_precision: named_int(row, "datetime_precision").map(|n| n as i16),
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
    async fn integer_key(&self, table: &TableName) -> Result<(String, crate::types::SqlType)> {
        let instances = self.capture_instances(table).await?;
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
    async fn table_columns(
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
    /// in every change row, so they are left out (with a warning), as the seed does.
    async fn served_columns(
        &self,
        table: &TableName,
        capture_instance: &str,
        create_date: CommitTime,
    ) -> Result<Vec<CapturedColumn>> {
        let key = (capture_instance.to_string(), create_date);
        if let Some(columns) = self.captured.lock().await.get(&key) {
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
        self.captured.lock().await.insert(key, columns.clone());
        Ok(columns)
    }

    /// A failed read of `object` (a change table or a tracked table, quoted): a missing
    /// permission names the `GRANT` on that object.
    fn read_error(object: &str, error: tiberius::error::Error) -> Error {
        match pool::source_error(error) {
            Error::PermissionDenied(message) => Error::PermissionDenied(format!(
                "cannot read {object}: {message}. Grant it to the server's login: GRANT SELECT \
                 ON {object} TO <user> (ADR 0009)"
            )),
            other => other,
        }
    }

    /// Starts a read task: runs `statements` (reads of `object`, quoted, named in errors)
    /// one after the other on one connection and sends the rows as batches of `shape`.
    fn spawn_read(
        &self,
        object: String,
        statements: Vec<(String, Vec<Param>, Vec<Fill>)>,
        shape: BatchShape,
        batch_rows: usize,
        batch_bytes: usize,
    ) -> BatchStream {
        let (sender, receiver) = mpsc::channel(READ_AHEAD_BATCHES);
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let outcome = async {
                let mut connection = pool.get().await?;
                for (statement, params, fills) in &statements {
                    let finished = read_statement(
                        &mut connection,
                        &object,
                        statement,
                        params,
                        &shape,
                        fills,
                        batch_rows,
                        batch_bytes,
                        &sender,
                    )
                    .await?;
                    if !finished {
                        break;
                    }
                }
                Ok::<(), Error>(())
            }
            .await;
            if let Err(error) = outcome {
                let _ = sender.send(Err(error)).await;
            }
        });
        Box::pin(ReceiverStream::new(receiver))
    }
}

/// A constant column of every row of a statement's batches.
#[derive(Clone, Debug)]
enum Fill {
    Text(String),
    NullText,
    Int(Option<i32>),
    Timestamp(Option<i64>),
}

impl Fill {
    fn array(&self, rows: usize) -> ArrayRef {
        match self {
            Fill::Text(text) => Arc::new(StringArray::from(vec![text.as_str(); rows])),
            Fill::NullText => new_null_array(&arrow::datatypes::DataType::Utf8, rows),
            Fill::Int(value) => Arc::new(Int32Array::from(vec![*value; rows])),
            Fill::Timestamp(value) => Arc::new(TimestampMicrosecondArray::from(vec![*value; rows])),
        }
    }
}

/// Where each schema column comes from: the result's columns in order, or a constant.
#[derive(Clone)]
struct BatchShape {
    schema: SchemaRef,
    /// For each schema column: `Some(i)` = the i-th result column, `None` = the next fill.
    sources: Vec<Option<usize>>,
}

impl BatchShape {
    fn decoders(&self, capacity: usize) -> Result<Vec<ColumnDecoder>> {
        self.sources
            .iter()
            .zip(self.schema.fields())
            .filter(|(source, _)| source.is_some())
            .map(|(_, field)| ColumnDecoder::new(field.data_type(), capacity))
            .collect()
    }

    fn batch(
        &self,
        decoders: &mut [ColumnDecoder],
        fills: &[Fill],
        rows: usize,
    ) -> Result<RecordBatch> {
        let mut fills = fills.iter();
        let columns: Vec<ArrayRef> = self
            .sources
            .iter()
            .map(|source| match source {
                Some(index) => Ok(decoders[*index].finish()),
                None => fills
                    .next()
                    .map(|fill| fill.array(rows))
                    .ok_or_else(|| Error::Internal("a batch shape lacks a constant".into())),
            })
            .collect::<Result<_>>()?;
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), columns)?)
    }
}

/// Reads one statement's rows into batches; `Ok(false)` when the client went away (the
/// query is then cancelled).
#[allow(clippy::too_many_arguments)]
async fn read_statement(
    connection: &mut Connection,
    object: &str,
    statement: &str,
    params: &[Param],
    shape: &BatchShape,
    fills: &[Fill],
    batch_rows: usize,
    batch_bytes: usize,
    sender: &mpsc::Sender<Result<RecordBatch>>,
) -> Result<bool> {
    let batch_rows = batch_rows.max(1);
    let mut decoders = shape.decoders(batch_rows.min(65_536))?;
    let values: Vec<&dyn ToSql> = params.iter().map(Param::as_sql).collect();
    connection.dirty = true;
    let mut client_gone = false;
    {
        let mut stream = connection
            .client
            .query(statement, &values)
            .await
            .map_err(|error| SqlServerSource::read_error(object, error))?
            .into_row_stream();
        let (mut rows, mut bytes) = (0usize, 0usize);
        while let Some(row) = stream
            .try_next()
            .await
            .map_err(|error| SqlServerSource::read_error(object, error))?
        {
            bytes += decode::append_row(&mut decoders, row)?;
            rows += 1;
            if rows >= batch_rows || bytes >= batch_bytes {
                let batch = shape.batch(&mut decoders, fills, rows)?;
                (rows, bytes) = (0, 0);
                if sender.send(Ok(batch)).await.is_err() {
                    client_gone = true;
                    break;
                }
            }
        }
        if !client_gone && rows > 0 {
            let batch = shape.batch(&mut decoders, fills, rows)?;
            client_gone = sender.send(Ok(batch)).await.is_err();
        }
    }
    if client_gone {
        // Stop the server's work; a connection whose cancel fails stays dirty and is dropped.
        if connection.client.cancel_query().await.is_ok() {
            connection.dirty = false;
        }
        return Ok(false);
    }
    connection.dirty = false;
    Ok(true)
}

/// A short name of a statement for retry logs: its first two words, without arguments
/// (never parameter values, which are not in the text anyway).
fn statement_name(statement: &str) -> String {
    statement
        .split_whitespace()
        .take(2)
        .map(|word| word.split('(').next().unwrap_or(word))
        .collect::<Vec<_>>()
        .join(" ")
}

fn int_at(row: &Row, index: usize) -> Option<i64> {
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

fn text_at(row: &Row, index: usize) -> Option<String> {
    match row.get_column_data(index).ok()? {
        ColumnData::String(v) => v.as_ref().map(|text| text.to_string()),
        _ => None,
    }
}

/// The key of a row whose columns are `keys`, as [`sql::key_max`] and [`sql::key_bound`]
/// select them: integers as integers, everything else as text.
fn key_tuple_at(row: &Row, keys: &[KeyColumn]) -> KeyTuple {
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
fn key_params(values: Vec<KeyValue>) -> Vec<Param> {
    values
        .into_iter()
        .filter_map(|value| match value {
            KeyValue::Null => None,
            KeyValue::Int(value) => Some(Param::Int(value)),
            KeyValue::Text(value) => Some(Param::Text(value)),
        })
        .collect()
}

fn column_index(row: &Row, name: &str) -> Option<usize> {
    row.columns()
        .iter()
        .position(|column| column.name().eq_ignore_ascii_case(name))
}

fn named_int(row: &Row, name: &str) -> Option<i64> {
    int_at(row, column_index(row, name)?)
}

fn named_text(row: &Row, name: &str) -> Option<String> {
    text_at(row, column_index(row, name)?)
}

/// An LSN from a binary(10) column; NULL and the zero LSN are `None`.
fn lsn_at(row: &Row, index: usize) -> Result<Option<Lsn>> {
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

fn named_lsn(row: &Row, name: &str) -> Result<Option<Lsn>> {
    match column_index(row, name) {
        Some(index) => lsn_at(row, index),
        None => Ok(None),
    }
}

/// Microseconds since the epoch of a date-time column (datetime, datetime2).
fn micros_at(row: &Row, index: usize) -> Option<i64> {
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

#[async_trait::async_trait]
impl CdcSource for SqlServerSource {
    fn describe(&self) -> String {
        self.config.describe()
    }

    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        let rows = self.rows(sql::help_change_data_capture(), &[]).await?;
        let mut tables: BTreeMap<TableName, Vec<CaptureInstance>> = BTreeMap::new();
        for row in &rows {
            let name = named_text(row, "capture_instance").unwrap_or_default();
            let table = TableName::new(
                named_text(row, "source_schema").unwrap_or_default(),
                named_text(row, "source_table").unwrap_or_default(),
            );
            let create_date = column_index(row, "create_date")
                .and_then(|index| micros_at(row, index))
                .map(CommitTime)
                .unwrap_or_default();
            let instance = CaptureInstance {
                columns: self.served_columns(&table, &name, create_date).await?,
                index_columns: parse_bracket_list(
                    &named_text(row, "index_column_list").unwrap_or_default(),
                ),
                start_lsn: named_lsn(row, "start_lsn")?.unwrap_or(Lsn::ZERO),
                create_date,
                name,
                table: table.clone(),
            };
            tables.entry(table).or_default().push(instance);
        }
        Ok(tables
            .into_iter()
            .map(|(table, mut capture_instances)| {
                capture_instances.sort_by_key(|ci| (ci.create_date, ci.start_lsn));
                TrackedTable {
                    table,
                    capture_instances,
                }
            })
            .collect())
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>> {
        self.lsn_query(sql::max_lsn(), &[]).await
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn> {
        let lsn = self
            .lsn_query(sql::min_lsn(), &[Param::Text(capture_instance.to_string())])
            .await?;
        match lsn {
            Some(lsn) => Ok(lsn),
            None => {
                // Unknown, or known and not yet processed by capture: say which.
                self.capture_instance(capture_instance).await?;
                Err(Error::invalid(format!(
                    "capture instance '{capture_instance}' exists but the capture job has not \
                     processed its creation yet (sys.fn_cdc_get_min_lsn is 0x00); is SQL Server \
                     Agent running?"
                )))
            }
        }
    }

    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        self.lsn_query(sql::increment_lsn(), &[Param::lsn(lsn)])
            .await?
            .ok_or_else(|| Error::Internal(format!("sys.fn_cdc_increment_lsn({lsn}) is NULL")))
    }

    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn> {
        if lsn.is_zero() {
            return Ok(Lsn::ZERO);
        }
        Ok(self
            .lsn_query(sql::decrement_lsn(), &[Param::lsn(lsn)])
            .await?
            .unwrap_or(Lsn::ZERO))
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>> {
        let statement = sql::lsn_to_time(&self.clock().await?)?;
        self.time_query(&statement, lsn).await
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        if n == 0 {
            return Err(Error::invalid("nth_commit_after needs n >= 1"));
        }
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.lsn_query(sql::nth_commit_after(), &[Param::lsn(lsn), Param::Int(n)])
            .await
    }

    async fn ddl_history(
        &self,
        capture_instance: &str,
        from: Lsn,
        to: Lsn,
    ) -> Result<Vec<DdlEntry>> {
        let rows = self
            .rows(
                sql::ddl_history(),
                &[
                    Param::Text(capture_instance.to_string()),
                    Param::lsn(from),
                    Param::lsn(to),
                ],
            )
            .await?;
        let at_or_before = sql::commit_time_at_or_before(&self.clock().await?)?;
        let mut entries = Vec::new();
        for row in &rows {
            let Some(ddl_lsn) = named_lsn(row, "ddl_lsn")? else {
                continue;
            };
            entries.push(DdlEntry {
                capture_instance: capture_instance.to_string(),
                ddl_lsn,
                ddl_time: self
                    .time_query(&at_or_before, ddl_lsn)
                    .await?
                    .unwrap_or_default(),
                ddl_command: named_text(row, "ddl_command").unwrap_or_default(),
            });
        }
        entries.sort_by_key(|entry| entry.ddl_lsn);
        Ok(entries)
    }

    async fn split_points(
        &self,
        capture_instance: &str,
        from: Lsn,
        to: Lsn,
        n: u32,
    ) -> Result<Vec<Tile>> {
        if n == 0 {
            return Err(Error::invalid("split_points needs n >= 1"));
        }
        let statement = sql::split_points(capture_instance)?;
        let rows = self
            .rows(
                &statement,
                &[Param::lsn(from), Param::lsn(to), Param::Int(i64::from(n))],
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(Tile {
                    last_lsn: lsn_at(row, 0)?
                        .ok_or_else(|| Error::Internal("a tile without a last LSN".into()))?,
                    rows: int_at(row, 1).unwrap_or(0).max(0) as u64,
                })
            })
            .collect()
    }

    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream> {
        let captured: BTreeSet<String> = self
            .captured_columns(&read.capture_instance)
            .await?
            .into_iter()
            .map(|column| column.name)
            .collect();
        let columns: Vec<(OutputColumn, bool)> = read
            .columns
            .iter()
            .map(|column| (column.clone(), captured.contains(&column.name)))
            .collect();
        let statement = sql::change_rows(
            &read.capture_instance,
            &columns,
            read.include_command_id,
            &self.clock().await?,
        )?;
        let schema = output_schema(&read.columns, read.include_command_id);
        // _capture_instance is a constant; every other column comes from the result.
        let sources = std::iter::once(None)
            .chain((0..schema.fields().len() - 1).map(Some))
            .collect();
        let shape = BatchShape { schema, sources };
        let params = vec![Param::lsn(read.from), Param::lsn(read.to)];
        let fills = vec![Fill::Text(read.capture_instance.clone())];
        Ok(self.spawn_read(
            ident::change_table(&read.capture_instance)?,
            vec![(statement, params, fills)],
            shape,
            read.batch_rows,
            read.batch_bytes,
        ))
    }

    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        let (key, sql_type) = self.integer_key(table).await?;
        let prefix = sql::source_read_prefix(self.config.lock_timeout_ms, self.config.isolation);
        let row = self
            .first_row(&sql::key_extent(table, &key, &prefix)?, &[])
            .await?;
        let (min, max) = match &row {
            Some(row) => (int_at(row, 0), int_at(row, 1)),
            None => (None, None),
        };
        let rows = self
            .first_row(
                sql::space_used(),
                &[Param::Text(ident::quote_table(table)?)],
            )
            .await?
            .and_then(|row| named_int(&row, "rows"))
            .unwrap_or(0)
            .max(0) as u64;
        Ok(KeyExtent {
            column: key,
            sql_type,
            min,
            max,
            rows,
        })
    }

    async fn key_buckets(
        &self,
        table: &TableName,
        lo: i64,
        hi: i64,
        width: u64,
    ) -> Result<Vec<KeyBucket>> {
        check_bucket_grid(lo, hi, width)?;
        let width_param = i64::try_from(width)
            .map_err(|_| Error::invalid(format!("key_buckets width {width} passes BIGINT")))?;
        let (key, _) = self.integer_key(table).await?;
        let prefix = sql::source_read_prefix(self.config.lock_timeout_ms, self.config.isolation);
        let rows = self
            .rows(
                &sql::key_buckets(table, &key, &prefix)?,
                &[Param::Int(lo), Param::Int(hi), Param::Int(width_param)],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let index = match row.get_column_data(0) {
                    Ok(ColumnData::Numeric(Some(n))) => n.int_part(),
                    _ => return Err(Error::Internal("a key slice without an index".into())),
                };
                Ok(KeyBucket::slice(
                    lo,
                    index,
                    width,
                    int_at(row, 1).unwrap_or(0).max(0) as u64,
                ))
            })
            .collect()
    }

    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        let prefix = sql::source_read_prefix(self.config.lock_timeout_ms, self.config.isolation);
        let row = self
            .first_row(&sql::key_max(table, keys, &prefix)?, &[])
            .await?;
        Ok(row.map(|row| key_tuple_at(&row, keys)))
    }

    async fn key_bound(
        &self,
        table: &TableName,
        keys: &[KeyColumn],
        seek: &KeySeek,
    ) -> Result<Option<KeyTuple>> {
        let prefix = sql::source_read_prefix(self.config.lock_timeout_ms, self.config.isolation);
        let (statement, values) = sql::key_bound(
            table,
            keys,
            seek.from.as_ref().map(|from| (from, seek.from_inclusive)),
            seek.to.as_ref().map(|to| (to, seek.to_inclusive)),
            seek.n,
            &prefix,
        )?;
        let row = self.first_row(&statement, &key_params(values)).await?;
        Ok(row.map(|row| key_tuple_at(&row, keys)))
    }

    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream> {
        let bounded = read.pieces.iter().any(|piece| {
            piece.keyset.is_none() && (piece.range.lo.is_some() || piece.range.hi.is_some())
        });
        let key = if bounded {
            Some(self.integer_key(&read.table).await?.0)
        } else {
            None
        };
        let (present, _) = self.table_columns(&read.table).await?;
        let columns: Vec<(OutputColumn, bool)> = read
            .columns
            .iter()
            .map(|column| (column.clone(), present.contains(&column.name)))
            .collect();
        let schema = snapshot_schema(&read.columns, read.include_command_id);
        let constants = crate::types::metadata_column_count(read.include_command_id);
        // Metadata columns are constants, then the captured columns, then _chunk.
        let mut sources: Vec<Option<usize>> = vec![None; constants];
        sources.extend((0..read.columns.len()).map(Some));
        sources.push(None);
        let shape = BatchShape { schema, sources };
        let prefix = sql::source_read_prefix(self.config.lock_timeout_ms, self.config.isolation);
        let stamp = read.stamp.to_string();
        let statements = read
            .pieces
            .iter()
            .map(|piece| {
                let (statement, params) = match &piece.keyset {
                    Some(range) => {
                        let (statement, values) = sql::snapshot_keyset_rows(
                            &read.table,
                            &read.keys,
                            &columns,
                            range,
                            &prefix,
                        )?;
                        (statement, key_params(values))
                    }
                    None => (
                        sql::snapshot_rows(
                            &read.table,
                            key.as_deref(),
                            &columns,
                            piece.range,
                            &prefix,
                        )?,
                        [piece.range.lo, piece.range.hi]
                            .into_iter()
                            .flatten()
                            .map(Param::Int)
                            .collect(),
                    ),
                };
                let mut fills = vec![
                    Fill::Text(read.capture_instance.clone()),
                    Fill::Text(stamp.clone()),
                    Fill::NullText,
                    Fill::Int(Some(0)),
                ];
                if read.include_command_id {
                    fills.push(Fill::Int(None));
                }
                fills.push(Fill::Timestamp(read.stamp_time.map(CommitTime::micros)));
                fills.push(Fill::Int(piece.chunk));
                Ok((statement, params, fills))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.spawn_read(
            ident::quote_table(&read.table)?,
            statements,
            shape,
            read.batch_rows,
            usize::MAX,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_column_lists_parse_with_doubled_brackets() {
        assert_eq!(parse_bracket_list("[order_id]"), ["order_id"]);
        assert_eq!(parse_bracket_list("[a], [b]]c]"), ["a", "b]c"]);
        assert!(parse_bracket_list("").is_empty());
    }

    #[test]
    fn retry_logs_name_a_statement_without_its_values() {
        assert_eq!(
            statement_name(sql::max_lsn()),
            "SELECT sys.fn_cdc_get_max_lsn"
        );
        assert_eq!(
            statement_name(sql::captured_columns()),
            "EXEC sys.sp_cdc_get_captured_columns"
        );
    }
}
