//! [`SqlServerSource`]: every [`CdcSource`] call in T-SQL over tiberius.
//!
//! Planning calls run one statement of [`super::sql`] on a pooled connection, retried on
//! transient errors. Streaming reads (change ranges, snapshot pieces) take a connection of
//! their own in a task that decodes rows into Arrow batches ([`super::decode`]) and sends
//! them through a bounded channel, so a slow client slows the read instead of filling
//! memory; when the client goes away the query is cancelled (TDS attention) and the
//! connection returned clean, or dropped if the cancel fails.
//!
//! [`catalog`] reads the CDC catalog, [`stream`] runs the streaming reads; this module holds
//! the source, its pool and retries, and the trait implementation.

mod catalog;
mod stream;

use crate::keys::{KeyColumn, KeyTuple, KeysetSeek};
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use tiberius::{ColumnData, Row, ToSql};
use tokio::sync::Mutex;

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::mssql::clock::ServerClock;
use crate::mssql::config::SqlServerConfig;
use crate::mssql::ident;
use crate::mssql::pool::{self, Connections, Manager};
use crate::mssql::sql;
use crate::offset::CommitTime;
use crate::source::{
    BatchStream, CaptureInstance, CapturedColumn, CdcSource, ChangeRead, DdlEntry, InstanceRange,
    KeyBucket, KeyExtent, KeyGrid, KeySum, KeySums, SnapshotRead, TableName, Tile, TrackedTable,
};
use crate::types::{OutputColumn, output_schema, snapshot_schema};
use catalog::{
    CatalogRow, column_index, int_at, key_params, key_tuple_at, lsn_at, micros_at, named_int,
    parse_bracket_list,
};
use stream::{BatchShape, Fill};

/// How long an offset read from an older server (no named zone) is trusted before it is
/// read again: a daylight-saving change moves it.
const OFFSET_REFRESH: Duration = Duration::from_secs(60);

/// Retries of a transient failure (ADR 0029).
const RETRIES: u32 = 3;

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

/// Captured columns per capture instance and creation time, with when they were read.
type CapturedCache = BTreeMap<(String, CommitTime), (Vec<CapturedColumn>, Instant)>;

/// The CDC source of a SQL Server database (2016 or newer).
pub struct SqlServerSource {
    pool: Connections,
    config: SqlServerConfig,
    clock: Mutex<Option<(ServerClock, Instant)>>,
    /// Captured columns per capture instance and creation time (an instance re-created
    /// under the same name gets a new entry), computed columns left out; read again after
    /// [`catalog::CAPTURED_COLUMNS_TTL`].
    captured: Arc<Mutex<CapturedCache>>,
    retry_base: Duration,
    /// What precedes every read of a source table: the configured lock timeout and
    /// isolation ([`sql::source_read_prefix`]).
    read_prefix: String,
}

impl SqlServerSource {
    /// Opens the pool and checks one connection (retrying transient failures), so a wrong
    /// address or login fails at start with SQL Server's message.
    pub async fn connect(config: SqlServerConfig) -> Result<Self> {
        if let Some(path) = &config.access_token_file {
            mssql_cdc_proto::secrets::warn_if_exposed("access token", path);
        }
        let manager = Manager::new(
            config.tiberius.clone(),
            config.trusts_any_certificate,
            config.access_token_file.clone(),
        )
        .with_login_timeout(config.login_timeout);
        let pool = Connections::new(manager, config.pool_size, config.checkout_timeout);
        let read_prefix = sql::source_read_prefix(config.lock_timeout_ms, config.isolation);
        let source = SqlServerSource {
            read_prefix,
            pool,
            config,
            clock: Mutex::new(None),
            captured: Arc::new(Mutex::new(BTreeMap::new())),
            retry_base: Duration::from_secs(1),
        };
        source.rows(sql::ping(), &[]).await?;
        let clock = source.clock().await?;
        tracing::info!(source = %source.config.describe(), %clock, "connected to SQL Server");
        Ok(source)
    }

    /// Whether a statement changes session options: a source read with its prefix. The
    /// change lasts for the `sp_executesql` call only, and the pool also resets such a
    /// connection before its next use, so no later read inherits it.
    fn sets_session_options(&self, statement: &str) -> bool {
        !self.read_prefix.is_empty() && statement.starts_with(&self.read_prefix)
    }

    /// Runs one statement and returns its first result's rows, retrying transient failures.
    async fn rows(&self, statement: &str, params: &[Param]) -> Result<Vec<Row>> {
        let sets_options = self.sets_session_options(statement);
        pool::with_retries(
            &statement_name(statement),
            RETRIES,
            self.retry_base,
            || async {
                let mut connection = self.pool.get().await?;
                let values: Vec<&dyn ToSql> = params.iter().map(Param::as_sql).collect();
                connection.dirty = true;
                connection.session_options |= sets_options;
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

#[async_trait::async_trait]
impl CdcSource for SqlServerSource {
    fn describe(&self) -> String {
        self.config.describe()
    }

    fn pool(&self) -> Option<crate::source::SourcePool> {
        Some(crate::source::SourcePool {
            size: self.config.pool_size as usize,
            checkout_timeout: self.config.checkout_timeout,
        })
    }

    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        let rows = self.rows(sql::help_change_data_capture(), &[]).await?;
        let mut tables: BTreeMap<TableName, Vec<CaptureInstance>> = BTreeMap::new();
        for row in &rows {
            // <https://learn.microsoft.com/sql/relational-databases/system-stored-procedures/sys-sp-cdc-help-change-data-capture-transact-sql>
            let catalog = CatalogRow {
                row,
                source: "sys.sp_cdc_help_change_data_capture",
            };
            let name = catalog.required_text("capture_instance")?;
            let table = TableName::new(
                catalog.required_text("source_schema")?,
                catalog.required_text("source_table")?,
            );
            let create_date = column_index(row, "create_date")
                .and_then(|index| micros_at(row, index))
                .map(CommitTime)
                .unwrap_or_default();
            let instance = CaptureInstance {
                columns: self.served_columns(&table, &name, create_date).await?,
                // NULL for a table without a unique index CDC can use.
                index_columns: parse_bracket_list(
                    &catalog.text("index_column_list")?.unwrap_or_default(),
                ),
                // `cdc.change_tables.start_lsn`: moved up by cleanup, and NULL until the
                // capture job processed a newly enabled instance, which planning leaves out.
                // <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-change-tables-transact-sql>
                start_lsn: catalog.lsn("start_lsn")?,
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
                Err(crate::source::capture_instance_not_processed(
                    capture_instance,
                ))
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

    async fn commit_at_or_before(&self, time: CommitTime) -> Result<Option<Lsn>> {
        let statement = sql::commit_at_or_before(&self.clock().await?)?;
        self.lsn_query(&statement, &[Param::Text(time.to_iso_millis())])
            .await
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        if n == 0 {
            return Err(Error::invalid("nth_commit_after needs n >= 1"));
        }
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.lsn_query(sql::nth_commit_after(), &[Param::lsn(lsn), Param::Int(n)])
            .await
    }

    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>> {
        let InstanceRange {
            capture_instance,
            from,
            to,
        } = range;
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
            // <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-ddl-history-transact-sql>
            let catalog = CatalogRow {
                row,
                source: "cdc.ddl_history",
            };
            let Some(ddl_lsn) = catalog.lsn("ddl_lsn")? else {
                return Err(Error::Internal(
                    "cdc.ddl_history returned a NULL or zero ddl_lsn".into(),
                ));
            };
            entries.push(DdlEntry {
                capture_instance: capture_instance.to_string(),
                ddl_lsn,
                ddl_time: self
                    .time_query(&at_or_before, ddl_lsn)
                    .await?
                    .unwrap_or_default(),
                ddl_command: catalog.required_text("ddl_command")?,
            });
        }
        entries.sort_by_key(|entry| entry.ddl_lsn);
        Ok(entries)
    }

    async fn split_points(&self, range: InstanceRange<'_>, tiles: NonZeroU32) -> Result<Vec<Tile>> {
        let statement = sql::split_points(range.capture_instance)?;
        let params = [
            Param::lsn(range.from),
            Param::lsn(range.to),
            Param::Int(i64::from(tiles.get())),
        ];
        let rows = self.rows(&statement, &params).await?;
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

    async fn instances_with_changes(
        &self,
        instances: &[String],
        after: Lsn,
        to: Lsn,
    ) -> Result<Vec<String>> {
        let mut changed = Vec::new();
        if to <= after {
            return Ok(changed);
        }
        for group in instances.chunks(sql::INSTANCES_PER_STATEMENT) {
            let statement = sql::instances_with_changes(group)?;
            let rows = self
                .rows(&statement, &[Param::lsn(after), Param::lsn(to)])
                .await?;
            // UNION ALL promises no order: the positions put the list's back.
            let mut positions = rows
                .iter()
                .map(|row| {
                    int_at(row, 0)
                        .and_then(|position| usize::try_from(position).ok())
                        .filter(|position| *position < group.len())
                        .ok_or_else(|| {
                            Error::Internal(
                                "instances_with_changes: a position outside the list".into(),
                            )
                        })
                })
                .collect::<Result<Vec<usize>>>()?;
            positions.sort_unstable();
            changed.extend(
                positions
                    .into_iter()
                    .map(|position| group[position].clone()),
            );
        }
        Ok(changed)
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
        let commit_times = schema.index_of(crate::types::COMMIT_TS_COLUMN).ok();
        let shape = BatchShape {
            schema,
            sources,
            commit_times,
        };
        let params = vec![Param::lsn(read.from), Param::lsn(read.to)];
        let fills = vec![Fill::Text(read.capture_instance.clone())];
        let stream = self.spawn_read(
            ident::change_table(&read.capture_instance)?,
            vec![(statement, params, fills)],
            shape,
            read.batch_rows,
            read.batch_bytes.clone(),
        );
        // A column's type changed under the read (ALTER COLUMN): its captured columns are
        // read again for the next plan instead of trusted until the cache's TTL.
        let (captured, instance) = (Arc::clone(&self.captured), read.capture_instance);
        Ok(stream
            .inspect(move |item| {
                if let Err(Error::SchemaChanged(_)) = item {
                    let (captured, instance) = (Arc::clone(&captured), instance.clone());
                    tokio::spawn(async move {
                        captured
                            .lock()
                            .await
                            .retain(|(name, _), _| *name != instance);
                    });
                }
            })
            .boxed())
    }

    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        let (key, sql_type) = self.integer_key(table).await?;
        let row = self
            .first_row(&sql::key_extent(table, &key, &self.read_prefix)?, &[])
            .await?;
        let (min, max) = match &row {
            Some(row) => (int_at(row, 0), int_at(row, 1)),
            None => (None, None),
        };
        Ok(KeyExtent {
            column: key,
            sql_type,
            min,
            max,
            rows: self.table_rows(table).await?,
        })
    }

    async fn table_rows(&self, table: &TableName) -> Result<u64> {
        Ok(self
            .first_row(
                sql::space_used(),
                &[Param::Text(ident::quote_table(table)?)],
            )
            .await?
            .and_then(|row| named_int(&row, "rows"))
            .unwrap_or(0)
            .max(0) as u64)
    }

    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        let width = grid.width();
        let width_param = i64::try_from(width)
            .map_err(|_| Error::invalid(format!("key_buckets width {width} passes BIGINT")))?;
        let (key, _) = self.integer_key(table).await?;
        let rows = self
            .rows(
                &sql::key_buckets(table, &key, &self.read_prefix)?,
                &[
                    Param::Int(grid.lo()),
                    Param::Int(grid.hi()),
                    Param::Int(width_param),
                ],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let index = match row.get_column_data(0) {
                    Ok(ColumnData::Numeric(Some(n))) => n.int_part(),
                    _ => return Err(Error::Internal("a key slice without an index".into())),
                };
                Ok(grid.slice(index, int_at(row, 1).unwrap_or(0).max(0) as u64))
            })
            .collect()
    }

    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>> {
        let unit = key.require_grid_unit()?;
        let row = self
            .first_row(
                &sql::key_span(table, &key.name, unit, &self.read_prefix)?,
                &[],
            )
            .await?;
        Ok(row.and_then(|row| int_at(&row, 0).zip(int_at(&row, 1))))
    }

    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums> {
        let unit = key.require_grid_unit()?;
        let width = i64::try_from(grid.width()).map_err(|_| {
            Error::invalid(format!("key_sums width {} passes BIGINT", grid.width()))
        })?;
        let values: Vec<(OutputColumn, bool)> = match values.is_empty() {
            true => Vec::new(),
            false => {
                let (present, _) = self.table_columns(table).await?;
                values
                    .iter()
                    .map(|column| (column.clone(), present.contains(&column.name)))
                    .collect()
            }
        };
        let rows = self
            .rows(
                &sql::key_sums(table, &key.name, unit, &values, &self.read_prefix)?,
                &[Param::Int(grid.lo()), Param::Int(width)],
            )
            .await?;
        let decimal = |row: &Row, index: usize, what: &str| match row.get_column_data(index) {
            Ok(ColumnData::Numeric(value)) => Ok(value.map(|n| n.int_part())),
            other => Err(Error::Internal(format!(
                "key_sums: {what} is not a decimal ({other:?})"
            ))),
        };
        let digested = !values.is_empty();
        let value_sum = |row: &Row| match digested {
            true => decimal(row, 4, "the value sum").map(|sum| Some(sum.unwrap_or(0))),
            false => Ok(None),
        };
        let mut sums = KeySums {
            null_value_sum: digested.then_some(0),
            ..KeySums::default()
        };
        for row in &rows {
            let count = int_at(row, 1).unwrap_or(0).max(0) as u64;
            match decimal(row, 0, "the slice")? {
                None => {
                    sums.null_rows += count;
                    sums.null_value_sum = value_sum(row)?;
                }
                Some(index) => sums.slices.push(KeySum {
                    slice: grid.slice(index, count),
                    key_sum: decimal(row, 2, "the key sum")?.unwrap_or(0),
                    key_hash_sum: Some(decimal(row, 3, "the key hash sum")?.unwrap_or(0)),
                    value_sum: value_sum(row)?,
                }),
            }
        }
        Ok(sums)
    }

    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        let row = self
            .first_row(&sql::key_max(table, keys, &self.read_prefix)?, &[])
            .await?;
        Ok(row.map(|row| key_tuple_at(&row, keys)))
    }

    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>> {
        let (keys, seek) = (seek.columns(), seek.seek());
        let (statement, values) = sql::key_bound(
            table,
            keys,
            seek.from.as_ref().map(|from| (from, seek.from_inclusive)),
            seek.to.as_ref().map(|to| (to, seek.to_inclusive)),
            seek.n,
            &self.read_prefix,
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
        // A snapshot row's commit time is the stamp's, a constant.
        let shape = BatchShape {
            schema,
            sources,
            commit_times: None,
        };
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
                            &self.read_prefix,
                        )?;
                        (statement, key_params(values))
                    }
                    None => (
                        sql::snapshot_rows(
                            &read.table,
                            key.as_deref(),
                            &columns,
                            piece.range,
                            &self.read_prefix,
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
            read.batch_bytes.clone(),
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
