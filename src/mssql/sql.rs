//! Every statement the SQL Server source sends, one function per statement.
//!
//! Each function returns the exact text; the golden tests pin it and parse it with a T-SQL
//! grammar. Values are always parameters: tiberius sends the text through `sp_executesql`
//! with `@P1`, `@P2`, ... bound in order (LSNs as `varbinary`, names as `nvarchar`, counts
//! as `bigint`). Names that T-SQL cannot take as parameters are validated and
//! bracket-quoted by [`super::ident`]. Only documented CDC functions, CDC procedures, the
//! change tables and catalog views are read; nothing is ever written to the source.

use super::clock::ServerClock;
use super::ident;
use crate::error::{Error, Result};
use crate::keys::{GridUnit, KeyColumn, KeyTuple, KeyValue, KeysetRange};
use crate::source::{KeyRange, TableName};
use crate::types::{OutputColumn, SqlType};

/// How source-table reads are isolated (the seed's `isolationLevel`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    /// The session default, READ COMMITTED (never NOLOCK).
    #[default]
    ReadCommitted,
    /// `SNAPSHOT`: needs `ALLOW_SNAPSHOT_ISOLATION ON` on the database.
    Snapshot,
}

impl std::str::FromStr for Isolation {
    type Err = crate::error::Error;

    fn from_str(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "readcommitted" | "read_committed" | "read committed" => Ok(Isolation::ReadCommitted),
            "snapshot" => Ok(Isolation::Snapshot),
            _ => Err(crate::error::Error::invalid(format!(
                "isolation level '{text}' must be readCommitted or snapshot"
            ))),
        }
    }
}

/// The highest LSN CDC has processed; NULL before any capture.
/// <https://learn.microsoft.com/sql/relational-databases/system-functions/sys-fn-cdc-get-max-lsn-transact-sql>
pub fn max_lsn() -> &'static str {
    "SELECT sys.fn_cdc_get_max_lsn() AS max_lsn"
}

/// The lowest LSN a capture instance still holds (`@P1` = capture instance); 0x00.. or NULL
/// when the instance does not exist or capture has not processed its creation yet.
/// <https://learn.microsoft.com/sql/relational-databases/system-functions/sys-fn-cdc-get-min-lsn-transact-sql>
pub fn min_lsn() -> &'static str {
    "SELECT sys.fn_cdc_get_min_lsn(@P1) AS min_lsn"
}

/// The next LSN after `@P1`.
/// <https://learn.microsoft.com/sql/relational-databases/system-functions/sys-fn-cdc-increment-lsn-transact-sql>
pub fn increment_lsn() -> &'static str {
    "SELECT sys.fn_cdc_increment_lsn(@P1) AS lsn"
}

/// The LSN before `@P1`.
/// <https://learn.microsoft.com/sql/relational-databases/system-functions/sys-fn-cdc-decrement-lsn-transact-sql>
pub fn decrement_lsn() -> &'static str {
    "SELECT sys.fn_cdc_decrement_lsn(@P1) AS lsn"
}

/// The UTC commit time of the commit at exactly `@P1`.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-lsn-time-mapping-transact-sql>
pub fn lsn_to_time(clock: &ServerClock) -> Result<String> {
    Ok(format!(
        "SELECT TOP (1) {} AS commit_ts FROM cdc.lsn_time_mapping m WHERE m.start_lsn = @P1",
        clock.utc_expression("m.tran_end_time", "m")?
    ))
}

/// The UTC commit time of the last commit at or before `@P1` (DDL times: a DDL's LSN is not
/// always a commit of its own in the mapping).
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-lsn-time-mapping-transact-sql>
pub fn commit_time_at_or_before(clock: &ServerClock) -> Result<String> {
    Ok(format!(
        "SELECT TOP (1) {} AS commit_ts FROM cdc.lsn_time_mapping m WHERE m.start_lsn <= @P1 \
         ORDER BY m.start_lsn DESC",
        clock.utc_expression("m.tran_end_time", "m")?
    ))
}

/// The LSN of the last commit whose UTC commit time is at or before `@P1` (text, ISO 8601):
/// `sys.fn_cdc_map_time_to_lsn('largest less than or equal', ...)` on UTC rather than the
/// server's local clock.
/// <https://learn.microsoft.com/sql/relational-databases/system-functions/sys-fn-cdc-map-time-to-lsn-transact-sql>
pub fn commit_at_or_before(clock: &ServerClock) -> Result<String> {
    Ok(format!(
        "SELECT TOP (1) m.start_lsn AS lsn FROM cdc.lsn_time_mapping m WHERE {} <= \
         CONVERT(datetime2(3), @P1, 126) ORDER BY m.start_lsn DESC",
        clock.utc_expression("m.tran_end_time", "m")?
    ))
}

/// The LSN of the `@P2`-th commit after `@P1` (or the last one when fewer follow), counting
/// every row of the mapping, idle entries included.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-lsn-time-mapping-transact-sql>
pub fn nth_commit_after() -> &'static str {
    "SELECT MAX(t.start_lsn) AS lsn FROM (SELECT TOP (@P2) m.start_lsn \
     FROM cdc.lsn_time_mapping m WHERE m.start_lsn > @P1 ORDER BY m.start_lsn) t"
}

/// Every capture instance the login can see.
/// <https://learn.microsoft.com/sql/relational-databases/system-stored-procedures/sys-sp-cdc-help-change-data-capture-transact-sql>
pub fn help_change_data_capture() -> &'static str {
    "EXEC sys.sp_cdc_help_change_data_capture"
}

/// The captured columns of capture instance `@P1`.
/// <https://learn.microsoft.com/sql/relational-databases/system-stored-procedures/sys-sp-cdc-get-captured-columns-transact-sql>
pub fn captured_columns() -> &'static str {
    "EXEC sys.sp_cdc_get_captured_columns @capture_instance = @P1"
}

/// The DDL recorded for capture instance `@P1` with `@P2 < ddl_lsn <= @P3`, in LSN order.
/// Read from the `cdc.ddl_history` table rather than `sys.sp_cdc_get_ddl_history`, which
/// requires db_owner: the server's login needs no more than `SELECT` on the `cdc` schema.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-ddl-history-transact-sql>
pub fn ddl_history() -> &'static str {
    "SELECT d.ddl_lsn, d.ddl_command FROM cdc.ddl_history d \
     JOIN cdc.change_tables t ON t.object_id = d.object_id \
     WHERE t.capture_instance = @P1 AND d.ddl_lsn > @P2 AND d.ddl_lsn <= @P3 \
     ORDER BY d.ddl_lsn"
}

/// The columns a table has now (`@P1` = the quoted `[schema].[table]`).
/// <https://learn.microsoft.com/sql/relational-databases/system-catalog-views/sys-columns-transact-sql>
pub fn table_columns() -> &'static str {
    "SELECT c.name, c.column_id, c.is_computed FROM sys.columns c \
     WHERE c.object_id = OBJECT_ID(@P1) ORDER BY c.column_id"
}

/// The row estimate of a table (`@P1` = the quoted `[schema].[table]`).
/// <https://learn.microsoft.com/sql/relational-databases/system-stored-procedures/sp-spaceused-transact-sql>
pub fn space_used() -> &'static str {
    "EXEC sys.sp_spaceused @objname = @P1"
}

/// Tiles of the change rows of `[@P1, @P2]` of a capture instance: at most `@P3` groups of
/// whole commits of about equal rows, each with its last commit LSN and row count. Rows are
/// counted per commit first, so a commit never straddles two tiles and each tile's count is
/// exactly what reading `(previous last, last]` returns.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-capture-instance-ct-transact-sql>
pub fn split_points(capture_instance: &str) -> Result<String> {
    let change_table = ident::change_table(capture_instance)?;
    Ok(format!(
        "SELECT MAX(g.start_lsn) AS last_lsn, SUM(g.n) AS row_count FROM (\
         SELECT c.start_lsn, c.n, \
         (SUM(c.n) OVER (ORDER BY c.start_lsn ROWS UNBOUNDED PRECEDING) - c.n) * @P3 \
         / SUM(c.n) OVER () AS tile FROM (\
         SELECT ct.[__$start_lsn] AS start_lsn, COUNT_BIG(*) AS n FROM {change_table} ct \
         WHERE ct.[__$start_lsn] BETWEEN @P1 AND @P2 GROUP BY ct.[__$start_lsn]) c) g \
         GROUP BY g.tile ORDER BY last_lsn"
    ))
}

/// The most capture instances one `instances_with_changes` statement checks; more are
/// checked by several statements.
pub const INSTANCES_PER_STATEMENT: usize = 100;

/// Which of `capture_instances` hold change rows with `@P1 < __$start_lsn <= @P2`: one row
/// per such instance, its position in the list. One seek on each change table's clustered
/// index (`__$start_lsn` leads it), stopped at the first row.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-capture-instance-ct-transact-sql>
pub fn instances_with_changes(capture_instances: &[String]) -> Result<String> {
    let checks = capture_instances
        .iter()
        .enumerate()
        .map(|(position, capture_instance)| {
            let change_table = ident::change_table(capture_instance)?;
            Ok(format!(
                "SELECT {position} AS position WHERE EXISTS (SELECT 1 FROM {change_table} ct \
                 WHERE ct.[__$start_lsn] > @P1 AND ct.[__$start_lsn] <= @P2)"
            ))
        })
        .collect::<Result<Vec<String>>>()?;
    if checks.is_empty() {
        return Err(Error::invalid("no capture instance to check for changes"));
    }
    Ok(checks.join(" UNION ALL "))
}

/// The type a NULL stands in as, for a column the source does not hold.
fn null_type(sql_type: &SqlType) -> String {
    match sql_type {
        SqlType::RowVersion => "binary(8)".to_string(),
        other => other.to_string(),
    }
}

/// The select-list item of one captured column read from `alias`; `present` is false for a
/// column this capture instance (or table) does not have, which reads as a typed NULL.
/// money and smallmoney are cast to decimal in SQL: tiberius decodes them to f64.
pub fn column_expression(alias: &str, column: &OutputColumn, present: bool) -> Result<String> {
    let name = ident::quote("column", &column.name)?;
    Ok(if !present {
        format!("CAST(NULL AS {}) AS {name}", null_type(&column.sql_type))
    } else {
        match column.sql_type {
            SqlType::Money => format!("CAST({alias}.{name} AS decimal(19,4)) AS {name}"),
            SqlType::SmallMoney => format!("CAST({alias}.{name} AS decimal(10,4)) AS {name}"),
            _ => format!("{alias}.{name}"),
        }
    })
}

/// The change rows of `[@P1, @P2]` of a capture instance with their commit times, ordered
/// by `(_start_lsn, _command_id, _seqval, _operation)`. `columns` pairs each output column
/// with whether the instance captures it.
///
/// A named zone converts each commit's `tran_end_time` once, into a table variable holding
/// the range's commits that have changes here, and the rows join it: the conversion (two
/// `AT TIME ZONE` and the fall-back rule's lookup) costs per commit, not per change row. A
/// fixed clock is one `DATEADD` per row. The join is outer so that a change row without its
/// `cdc.lsn_time_mapping` row arrives with a NULL commit time, which the reader turns into an
/// error instead of dropping the row.
/// <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-capture-instance-ct-transact-sql>
/// <https://learn.microsoft.com/sql/t-sql/data-types/table-transact-sql>
pub fn change_rows(
    capture_instance: &str,
    columns: &[(OutputColumn, bool)],
    include_command_id: bool,
    clock: &ServerClock,
) -> Result<String> {
    let change_table = ident::change_table(capture_instance)?;
    let mut select = vec![
        "CONVERT(varchar(22), c.[__$start_lsn], 1) AS [_start_lsn]".to_string(),
        "CONVERT(varchar(22), c.[__$seqval], 1) AS [_seqval]".to_string(),
        "c.[__$operation] AS [_operation]".to_string(),
    ];
    if include_command_id {
        select.push("c.[__$command_id] AS [_command_id]".to_string());
    }
    let (commits, commit_ts, mapping) = match clock {
        ServerClock::Zone(_) => (
            format!(
                "SET NOCOUNT ON; DECLARE @commits TABLE (start_lsn binary(10) PRIMARY KEY, \
                 commit_ts datetime2(3)); INSERT INTO @commits (start_lsn, commit_ts) \
                 SELECT m.start_lsn, {} FROM cdc.lsn_time_mapping m \
                 WHERE m.start_lsn BETWEEN @P1 AND @P2 AND EXISTS (SELECT 1 FROM {change_table} \
                 d WHERE d.[__$start_lsn] = m.start_lsn); ",
                clock.utc_expression("m.tran_end_time", "m")?
            ),
            "m.commit_ts".to_string(),
            "@commits",
        ),
        ServerClock::Utc | ServerClock::Offset(_) => (
            String::new(),
            clock.utc_expression("m.tran_end_time", "m")?,
            "cdc.lsn_time_mapping",
        ),
    };
    select.push(format!("{commit_ts} AS [_commit_ts]"));
    for (column, present) in columns {
        select.push(column_expression("c", column, *present)?);
    }
    let order = if include_command_id {
        "c.[__$start_lsn], c.[__$command_id], c.[__$seqval], c.[__$operation]"
    } else {
        "c.[__$start_lsn], c.[__$seqval], c.[__$operation]"
    };
    Ok(format!(
        "{commits}SELECT {} FROM {change_table} c LEFT JOIN {mapping} m \
         ON m.start_lsn = c.[__$start_lsn] WHERE c.[__$start_lsn] BETWEEN @P1 AND @P2 \
         ORDER BY {order}",
        select.join(", ")
    ))
}

/// Session defaults restored on a pooled connection after a source read changed them, as a
/// plain batch: READ COMMITTED and no lock timeout (`-1`, wait forever).
/// <https://learn.microsoft.com/sql/t-sql/statements/set-transaction-isolation-level-transact-sql>
pub fn reset_session_options() -> &'static str {
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SET LOCK_TIMEOUT -1"
}

/// What precedes every read of a source table: the lock timeout and isolation asked for
/// (`SET` inside `sp_executesql` lasts for that call only, and the pool resets a connection
/// that ran one before reusing it: [`reset_session_options`]).
/// <https://learn.microsoft.com/sql/t-sql/statements/set-lock-timeout-transact-sql>
pub fn source_read_prefix(lock_timeout_ms: Option<u32>, isolation: Isolation) -> String {
    let mut prefix = String::new();
    if isolation == Isolation::Snapshot {
        prefix.push_str("SET TRANSACTION ISOLATION LEVEL SNAPSHOT; ");
    }
    if let Some(ms) = lock_timeout_ms {
        prefix.push_str(&format!("SET LOCK_TIMEOUT {ms}; "));
    }
    prefix
}

/// The smallest and largest key of a table, as two index seeks.
/// <https://learn.microsoft.com/sql/t-sql/functions/min-transact-sql>
pub fn key_extent(table: &TableName, key: &str, prefix: &str) -> Result<String> {
    let (table, key) = (ident::quote_table(table)?, ident::quote("column", key)?);
    Ok(format!(
        "{prefix}SELECT CAST((SELECT MIN({key}) FROM {table}) AS bigint) AS lo, \
         CAST((SELECT MAX({key}) FROM {table}) AS bigint) AS hi"
    ))
}

/// Row counts per slice of the grid `@P1 + i * @P3` over keys in `[@P1, @P2]`: the slice
/// index `i` (as decimal: it can pass BIGINT for a grid of width 1 over the whole range)
/// and its rows, empty slices left out.
pub fn key_buckets(table: &TableName, key: &str, prefix: &str) -> Result<String> {
    let (table, key) = (ident::quote_table(table)?, ident::quote("column", key)?);
    Ok(format!(
        "{prefix}SELECT x.slice, COUNT_BIG(*) AS row_count FROM (\
         SELECT CAST(FLOOR((CAST(t.{key} AS decimal(20,0)) - @P1) / @P3) AS decimal(20,0)) \
         AS slice FROM {table} t WHERE t.{key} BETWEEN @P1 AND @P2) x \
         GROUP BY x.slice ORDER BY x.slice"
    ))
}

/// A column's value in the grid units of a reconcile (`unit` of `t.{key}`): an integer as
/// itself, a date as its day number from 1970-01-01.
/// <https://learn.microsoft.com/sql/t-sql/functions/datediff-big-transact-sql>
fn grid_units(value: &str, unit: GridUnit) -> String {
    match unit {
        GridUnit::Integer => format!("CAST({value} AS decimal(38,0))"),
        GridUnit::Days => {
            format!("CAST(DATEDIFF_BIG(day, CAST('19700101' AS date), {value}) AS decimal(38,0))")
        }
    }
}

/// The smallest and largest value of a column in grid units, as two seeks when an index
/// leads with it (the conversion applies to `MIN` and `MAX`, not to every row).
pub fn key_span(table: &TableName, key: &str, unit: GridUnit, prefix: &str) -> Result<String> {
    let (table, key) = (ident::quote_table(table)?, ident::quote("column", key)?);
    let lo = grid_units(&format!("(SELECT MIN(t.{key}) FROM {table} t)"), unit);
    let hi = grid_units(&format!("(SELECT MAX(t.{key}) FROM {table} t)"), unit);
    Ok(format!(
        "{prefix}SELECT CAST({lo} AS bigint) AS lo, CAST({hi} AS bigint) AS hi"
    ))
}

/// Rows, key sums (decimal(38,0), in grid units) and sums of the keys' hashes
/// ([`mssql_cdc_proto::catalog::key_hash`]) per slice `FLOOR((u - @P1) / @P2)` of every row,
/// in one scan; NULL keys form the slice NULL. With `values` (each output column and whether
/// the table has it), the same scan sums each row's value digest too
/// ([`mssql_cdc_proto::digest`], [`value_text`]) as a fifth column.
/// <https://learn.microsoft.com/sql/t-sql/functions/sum-transact-sql>,
/// <https://learn.microsoft.com/sql/t-sql/functions/hashbytes-transact-sql>,
/// <https://learn.microsoft.com/sql/t-sql/functions/cast-and-convert-transact-sql#binary-and-varbinary-data>
pub fn key_sums(
    table: &TableName,
    key: &str,
    unit: GridUnit,
    values: &[(OutputColumn, bool)],
    prefix: &str,
) -> Result<String> {
    let (table, key) = (ident::quote_table(table)?, ident::quote("column", key)?);
    let units = grid_units(&format!("t.{key}"), unit);
    let (digest, digest_sum) = match values.is_empty() {
        true => (String::new(), String::new()),
        false => (
            format!(", {} AS d", first_bytes_hash(&row_text("t", values)?)),
            ", SUM(x.d) AS value_sum".to_string(),
        ),
    };
    let carried = if values.is_empty() { "" } else { ", v.d" };
    Ok(format!(
        "{prefix}SELECT x.slice, COUNT_BIG(*) AS row_count, SUM(x.u) AS key_sum, \
         SUM(x.h) AS key_hash_sum{digest_sum} FROM (\
         SELECT CAST(FLOOR((v.u - @P1) / @P2) AS decimal(38,0)) AS slice, v.u, \
         {} AS h{carried} FROM (\
         SELECT {units} AS u{digest} FROM {table} t) v) x GROUP BY x.slice ORDER BY x.slice",
        first_bytes_hash("CAST(CAST(v.u AS bigint) AS binary(8))")
    ))
}

/// The first 7 bytes of `HASHBYTES('SHA2_256', bytes)` as a decimal(38,0) below 2^56.
fn first_bytes_hash(bytes: &str) -> String {
    format!(
        "CAST(CAST(SUBSTRING(HASHBYTES('SHA2_256', {bytes}), 1, 7) AS bigint) AS decimal(38,0))"
    )
}

/// A row's joined text for its value digest ([`mssql_cdc_proto::digest`]): per column `-`
/// for NULL, else the text's length in UTF-16 code units (`DATALENGTH` of an nvarchar over
/// 2), `:` and the text. The first argument is an nvarchar(max): `CONCAT` of no large
/// value truncates to 8,000 bytes. `CONCAT` takes at most 254 arguments, so columns are
/// joined 200 at a time.
/// <https://learn.microsoft.com/sql/t-sql/functions/concat-transact-sql>,
/// <https://learn.microsoft.com/sql/t-sql/functions/datalength-transact-sql>
fn row_text(alias: &str, values: &[(OutputColumn, bool)]) -> Result<String> {
    let pieces: Vec<String> = values
        .iter()
        .map(|(column, present)| {
            let text = value_text(alias, column, *present)?;
            // CONCAT reads a NULL as empty: the NULL is told apart first.
            Ok(format!(
                "CASE WHEN {text} IS NULL THEN N'-' \
                 ELSE CONCAT(DATALENGTH({text}) / 2, N':', {text}) END"
            ))
        })
        .collect::<Result<_>>()?;
    let groups: Vec<String> = pieces
        .chunks(200)
        .map(|group| format!("CONCAT(CAST(N'' AS nvarchar(max)), {})", group.join(", ")))
        .collect();
    Ok(match groups.as_slice() {
        [one] => one.clone(),
        many => format!("CONCAT(CAST(N'' AS nvarchar(max)), {})", many.join(", ")),
    })
}

/// The canonical text of one column's value as the server serves it (its output type),
/// NULL for NULL: the T-SQL side of [`mssql_cdc_proto::digest`]'s table, built from
/// documented conversions. A column the table does not have is NULL.
/// <https://learn.microsoft.com/sql/t-sql/functions/cast-and-convert-transact-sql>,
/// <https://learn.microsoft.com/sql/t-sql/functions/datediff-big-transact-sql>,
/// <https://learn.microsoft.com/sql/t-sql/functions/switchoffset-transact-sql>
pub fn value_text(alias: &str, column: &OutputColumn, present: bool) -> Result<String> {
    if !present {
        return Ok("CAST(NULL AS nvarchar(max))".to_string());
    }
    let value = format!("{alias}.{}", ident::quote("column", &column.name)?);
    let micros = |datetime2: &str| {
        format!(
            "CONVERT(nvarchar(20), DATEDIFF_BIG(microsecond, CAST('19700101' AS datetime2(7)), \
             {datetime2}))"
        )
    };
    Ok(match &column.sql_type {
        SqlType::Bit | SqlType::TinyInt | SqlType::SmallInt | SqlType::Int | SqlType::BigInt => {
            format!("CONVERT(nvarchar(20), CAST({value} AS bigint))")
        }
        // Style 3: 17 digits, every distinct value its own text; a real widens to float
        // exactly, as the digest's side widens f32 to f64.
        SqlType::Real | SqlType::Float => {
            format!("CONVERT(nvarchar(30), CAST({value} AS float), 3)")
        }
        SqlType::Decimal { precision, scale } => {
            format!("CONVERT(nvarchar(42), CAST({value} AS decimal({precision},{scale})))")
        }
        SqlType::Money => format!("CONVERT(nvarchar(42), CAST({value} AS decimal(19,4)))"),
        SqlType::SmallMoney => format!("CONVERT(nvarchar(42), CAST({value} AS decimal(10,4)))"),
        SqlType::Date => format!("CONVERT(nvarchar(10), {value}, 23)"),
        // Served rounded to the microsecond (1/300 s ticks): datetime2(6) rounds alike.
        SqlType::DateTime => micros(&format!("CAST({value} AS datetime2(6))")),
        // Served with the digits below a microsecond dropped: DATEDIFF_BIG counts whole ones.
        SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
            micros(&format!("CAST({value} AS datetime2(7))"))
        }
        SqlType::DateTimeOffset { .. } => micros(&format!(
            "CAST(SWITCHOFFSET({value}, '+00:00') AS datetime2(7))"
        )),
        // Served as `hh:mm:ss`, and seven fraction digits unless the precision is 0.
        SqlType::Time { precision: 0 } => format!("CONVERT(nvarchar(8), {value}, 108)"),
        SqlType::Time { .. } => format!("CONVERT(nvarchar(16), CAST({value} AS time(7)))"),
        SqlType::Char(_)
        | SqlType::VarChar(_)
        | SqlType::NChar(_)
        | SqlType::NVarChar(_)
        | SqlType::Text
        | SqlType::NText
        | SqlType::Xml => format!("CAST({value} AS nvarchar(max))"),
        // Upper case, as the server serves it.
        SqlType::UniqueIdentifier => format!("CONVERT(nvarchar(36), {value})"),
        SqlType::Binary(_) | SqlType::VarBinary(_) | SqlType::Image | SqlType::RowVersion => {
            format!("CONVERT(nvarchar(max), CAST({value} AS varbinary(max)), 2)")
        }
        SqlType::Unsupported(name) => {
            return Err(Error::invalid(format!(
                "column '{}' of type {name} has no value digest",
                column.name
            )));
        }
    })
}

/// The current rows of a table in `range` of its key, in key order. Bounds present in the
/// range are `@P1` (lower, inclusive) then the next parameter (upper, exclusive). A range
/// open below also holds a NULL key (NULL sorts first, into the first chunk).
pub fn snapshot_rows(
    table: &TableName,
    key: Option<&str>,
    columns: &[(OutputColumn, bool)],
    range: KeyRange,
    prefix: &str,
) -> Result<String> {
    let table = ident::quote_table(table)?;
    let select: Vec<String> = columns
        .iter()
        .map(|(column, present)| column_expression("t", column, *present))
        .collect::<Result<_>>()?;
    let mut text = format!("{prefix}SELECT {} FROM {table} t", select.join(", "));
    if let Some(key) = key {
        let key = ident::quote("column", key)?;
        let mut conditions = Vec::new();
        let mut parameter = 0;
        if range.lo.is_some() {
            parameter += 1;
            conditions.push(format!("t.{key} >= @P{parameter}"));
        }
        if range.hi.is_some() {
            parameter += 1;
            conditions.push(if range.lo.is_some() {
                format!("t.{key} < @P{parameter}")
            } else {
                format!("(t.{key} < @P{parameter} OR t.{key} IS NULL)")
            });
        }
        if !conditions.is_empty() {
            text.push_str(&format!(" WHERE {}", conditions.join(" AND ")));
        }
        text.push_str(&format!(" ORDER BY t.{key}"));
    }
    Ok(text)
}

/// A key column read as a keyset value: integers as bigint, everything else as text that
/// casts back to the column's type without loss (ISO 8601 for dates and times, style 3 for
/// floats, 0x hex for binaries).
fn key_select(alias: &str, column: &KeyColumn) -> Result<String> {
    let name = ident::quote("column", &column.name)?;
    Ok(match &column.sql_type {
        sql_type if sql_type.is_integer() => format!("CAST({alias}.{name} AS bigint) AS {name}"),
        SqlType::Date
        | SqlType::DateTime
        | SqlType::SmallDateTime
        | SqlType::DateTime2 { .. }
        | SqlType::Time { .. } => format!("CONVERT(nvarchar(40), {alias}.{name}, 126) AS {name}"),
        SqlType::DateTimeOffset { .. } => {
            format!("CONVERT(nvarchar(40), {alias}.{name}, 127) AS {name}")
        }
        SqlType::Real | SqlType::Float => {
            format!("CONVERT(nvarchar(40), {alias}.{name}, 3) AS {name}")
        }
        SqlType::Binary(_) | SqlType::VarBinary(_) => {
            format!("CONVERT(nvarchar(max), {alias}.{name}, 1) AS {name}")
        }
        _ => format!("CONVERT(nvarchar(max), {alias}.{name}) AS {name}"),
    })
}

/// A bound value as the column's type: `@Pn` itself for integers, cast from text otherwise
/// (binaries converted from 0x hex). The comparison then takes the column's collation.
fn key_parameter(column: &KeyColumn, parameter: usize) -> String {
    match &column.sql_type {
        sql_type if sql_type.is_integer() => format!("@P{parameter}"),
        SqlType::Binary(_) | SqlType::VarBinary(_) => {
            format!("CONVERT({}, @P{parameter}, 1)", column.sql_type)
        }
        sql_type => format!("CAST(@P{parameter} AS {sql_type})"),
    }
}

/// One side of a keyset range: `(k1, ..., kn) > tuple` (or `>=`, `<`, `<=`) expanded into
/// the lexicographic OR of prefixes SQL Server can seek on, with NULL sorting first:
/// `k > NULL` is `k IS NOT NULL`, `k = NULL` is `k IS NULL`, `k < x` holds for a NULL `k`,
/// and nothing is below NULL. Values are bound as parameters from `first_parameter` on,
/// returned in order.
pub fn keyset_comparison(
    alias: &str,
    keys: &[KeyColumn],
    tuple: &KeyTuple,
    above: bool,
    inclusive: bool,
    first_parameter: usize,
) -> Result<(String, Vec<KeyValue>)> {
    let mut bound = Vec::new();
    let mut operands = Vec::new();
    for (column, value) in keys.iter().zip(tuple) {
        let name = format!("{alias}.{}", ident::quote("column", &column.name)?);
        let parameter = match value {
            KeyValue::Null => None,
            value => {
                bound.push(value.clone());
                Some(key_parameter(column, first_parameter + bound.len() - 1))
            }
        };
        operands.push((name, parameter));
    }
    let equal = |(name, parameter): &(String, Option<String>)| match parameter {
        Some(parameter) => format!("{name} = {parameter}"),
        None => format!("{name} IS NULL"),
    };
    let beyond = |(name, parameter): &(String, Option<String>)| match (above, parameter) {
        (true, Some(parameter)) => format!("{name} > {parameter}"),
        (true, None) => format!("{name} IS NOT NULL"),
        (false, Some(parameter)) => format!("({name} < {parameter} OR {name} IS NULL)"),
        (false, None) => "1 = 0".to_string(),
    };
    let mut terms = Vec::new();
    for index in 0..operands.len() {
        let mut parts: Vec<String> = operands[..index].iter().map(equal).collect();
        parts.push(beyond(&operands[index]));
        terms.push(parts.join(" AND "));
    }
    if inclusive {
        terms.push(operands.iter().map(equal).collect::<Vec<_>>().join(" AND "));
    }
    Ok((format!("(({}))", terms.join(") OR (")), bound))
}

/// The `WHERE` conditions of a keyset range (lower and upper side, each with its
/// inclusiveness) and the values they bind from `@P1` on.
pub fn keyset_where(
    alias: &str,
    keys: &[KeyColumn],
    lower: Option<(&KeyTuple, bool)>,
    upper: Option<(&KeyTuple, bool)>,
) -> Result<(String, Vec<KeyValue>)> {
    let mut conditions = Vec::new();
    let mut values = Vec::new();
    for (side, above) in [(lower, true), (upper, false)] {
        if let Some((tuple, inclusive)) = side {
            let (condition, bound) =
                keyset_comparison(alias, keys, tuple, above, inclusive, values.len() + 1)?;
            conditions.push(condition);
            values.extend(bound);
        }
    }
    let text = match conditions.is_empty() {
        true => String::new(),
        false => format!(" WHERE {}", conditions.join(" AND ")),
    };
    Ok((text, values))
}

fn key_order(alias: &str, keys: &[KeyColumn], descending: bool) -> Result<String> {
    let direction = if descending { " DESC" } else { "" };
    Ok(keys
        .iter()
        .map(|key| {
            Ok(format!(
                "{alias}.{}{direction}",
                ident::quote("column", &key.name)?
            ))
        })
        .collect::<Result<Vec<_>>>()?
        .join(", "))
}

/// The largest key (`TOP (1) ... ORDER BY keys DESC`).
/// <https://learn.microsoft.com/sql/t-sql/queries/top-transact-sql>
pub fn key_max(table: &TableName, keys: &[KeyColumn], prefix: &str) -> Result<String> {
    let select = keys
        .iter()
        .map(|key| key_select("t", key))
        .collect::<Result<Vec<_>>>()?;
    Ok(format!(
        "{prefix}SELECT TOP (1) {} FROM {} t ORDER BY {}",
        select.join(", "),
        ident::quote_table(table)?,
        key_order("t", keys, true)?
    ))
}

/// The key of the `(n + 1)`-th row of a keyset range in key order (`OFFSET n ROWS FETCH
/// NEXT 1 ROWS ONLY`); `n` is inlined (an integer the service computed), bounds are bound.
/// <https://learn.microsoft.com/sql/t-sql/queries/select-order-by-clause-transact-sql#using-offset-and-fetch-to-limit-the-rows-returned>
pub fn key_bound(
    table: &TableName,
    keys: &[KeyColumn],
    lower: Option<(&KeyTuple, bool)>,
    upper: Option<(&KeyTuple, bool)>,
    n: u64,
    prefix: &str,
) -> Result<(String, Vec<KeyValue>)> {
    let select = keys
        .iter()
        .map(|key| key_select("t", key))
        .collect::<Result<Vec<_>>>()?;
    let (conditions, values) = keyset_where("t", keys, lower, upper)?;
    Ok((
        format!(
            "{prefix}SELECT {} FROM {} t{conditions} ORDER BY {} OFFSET {n} ROWS FETCH NEXT 1 \
             ROWS ONLY",
            select.join(", "),
            ident::quote_table(table)?,
            key_order("t", keys, false)?
        ),
        values,
    ))
}

/// The current rows of a table in a keyset range `[lo, hi)`, in key order.
pub fn snapshot_keyset_rows(
    table: &TableName,
    keys: &[KeyColumn],
    columns: &[(OutputColumn, bool)],
    range: &KeysetRange,
    prefix: &str,
) -> Result<(String, Vec<KeyValue>)> {
    let select: Vec<String> = columns
        .iter()
        .map(|(column, present)| column_expression("t", column, *present))
        .collect::<Result<_>>()?;
    let (conditions, values) = keyset_where(
        "t",
        keys,
        range.lo.as_ref().map(|lo| (lo, true)),
        range.hi.as_ref().map(|hi| (hi, false)),
    )?;
    Ok((
        format!(
            "{prefix}SELECT {} FROM {} t{conditions} ORDER BY {}",
            select.join(", "),
            ident::quote_table(table)?,
            key_order("t", keys, false)?
        ),
        values,
    ))
}

/// A cheap round trip to check a pooled connection.
pub fn ping() -> &'static str {
    "SELECT 1 AS ok"
}
