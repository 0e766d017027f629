//! What Flight SQL clients browse before they query: the server's `SqlInfo`, the tables a
//! principal may read (schema `dbo` and the like, with their Arrow schemas), the `cdc`
//! functions, primary keys (the index CDC uses) and the types served. There is one catalog,
//! named `""`: a capture source is one database.

use std::sync::{Arc, LazyLock};

use arrow::array::{ArrayRef, Int32Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow_flight::sql::metadata::{
    SqlInfoData, SqlInfoDataBuilder, XdbcTypeInfo, XdbcTypeInfoData, XdbcTypeInfoDataBuilder,
};
use arrow_flight::sql::{
    Command, CommandGetPrimaryKeys, Nullable, Searchable, SqlInfo, SqlSupportedTransaction,
    XdbcDataType,
};

use super::super::auth::Principal;
use super::CdcFlightService;
use crate::error::{Error, Result};

/// The one catalog's name.
const CATALOG: &str = "";
/// The schema the planning functions are listed under.
const FUNCTIONS_SCHEMA: &str = "cdc";
/// Table types: tracked tables, and the `cdc` functions.
const TABLE: &str = "TABLE";
const FUNCTION: &str = "FUNCTION";

/// The `SqlInfo` ids [`SQL_INFO`] answers.
const SERVED_INFO: [u32; 14] = [
    SqlInfo::FlightSqlServerName as u32,
    SqlInfo::FlightSqlServerVersion as u32,
    SqlInfo::FlightSqlServerArrowVersion as u32,
    SqlInfo::FlightSqlServerReadOnly as u32,
    SqlInfo::FlightSqlServerSql as u32,
    SqlInfo::FlightSqlServerSubstrait as u32,
    SqlInfo::FlightSqlServerTransaction as u32,
    SqlInfo::FlightSqlServerCancel as u32,
    SqlInfo::SqlDdlCatalog as u32,
    SqlInfo::SqlDdlSchema as u32,
    SqlInfo::SqlDdlTable as u32,
    SqlInfo::SqlIdentifierQuoteChar as u32,
    SqlInfo::SqlAllTablesAreSelectable as u32,
    SqlInfo::SqlTransactionsSupported as u32,
];

static SQL_INFO: LazyLock<SqlInfoData> = LazyLock::new(|| {
    let mut builder = SqlInfoDataBuilder::new();
    builder.append(SqlInfo::FlightSqlServerName, "mssql-cdc-flight");
    builder.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    // The Arrow format version of Schema.fbs.
    builder.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
    builder.append(SqlInfo::FlightSqlServerReadOnly, true);
    builder.append(SqlInfo::FlightSqlServerSql, true);
    builder.append(SqlInfo::FlightSqlServerSubstrait, false);
    builder.append(
        SqlInfo::FlightSqlServerTransaction,
        SqlSupportedTransaction::None as i32,
    );
    builder.append(SqlInfo::FlightSqlServerCancel, false);
    builder.append(SqlInfo::SqlDdlCatalog, false);
    builder.append(SqlInfo::SqlDdlSchema, false);
    builder.append(SqlInfo::SqlDdlTable, false);
    builder.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    // The `cdc` functions GetTables lists are called, not selected from.
    builder.append(SqlInfo::SqlAllTablesAreSelectable, false);
    builder.append(SqlInfo::SqlTransactionsSupported, false);
    match builder.build() {
        Ok(data) => data,
        Err(error) => unreachable!("the server's SqlInfo builds: {error}"),
    }
});

/// One served type: its SQL Server name, its XDBC type and size.
fn xdbc(name: &str, data_type: XdbcDataType, column_size: Option<i32>) -> XdbcTypeInfo {
    XdbcTypeInfo {
        type_name: name.into(),
        data_type,
        column_size,
        literal_prefix: None,
        literal_suffix: None,
        create_params: None,
        nullable: Nullable::NullabilityNullable,
        case_sensitive: matches!(data_type, XdbcDataType::XdbcVarchar),
        searchable: Searchable::None,
        unsigned_attribute: None,
        fixed_prec_scale: false,
        auto_increment: Some(false),
        local_type_name: Some(name.into()),
        minimum_scale: None,
        maximum_scale: None,
        sql_data_type: data_type,
        datetime_subcode: None,
        num_prec_radix: None,
        interval_precision: None,
    }
}

/// The types rows are served in (docs/protocol.md, "Types").
static XDBC_TYPES: LazyLock<XdbcTypeInfoData> = LazyLock::new(|| {
    let mut builder = XdbcTypeInfoDataBuilder::new();
    for info in [
        xdbc("bit", XdbcDataType::XdbcBit, Some(1)),
        xdbc("smallint", XdbcDataType::XdbcSmallint, Some(5)),
        xdbc("int", XdbcDataType::XdbcInteger, Some(10)),
        xdbc("bigint", XdbcDataType::XdbcBigint, Some(19)),
        xdbc("real", XdbcDataType::XdbcReal, Some(24)),
        xdbc("float", XdbcDataType::XdbcDouble, Some(53)),
        xdbc("decimal", XdbcDataType::XdbcDecimal, Some(38)),
        xdbc("date", XdbcDataType::XdbcDate, Some(10)),
        xdbc("datetime2", XdbcDataType::XdbcTimestamp, Some(26)),
        xdbc("nvarchar", XdbcDataType::XdbcVarchar, None),
        xdbc("varbinary", XdbcDataType::XdbcVarbinary, None),
    ] {
        builder.append(info);
    }
    match builder.build() {
        Ok(data) => data,
        Err(error) => unreachable!("the served types build: {error}"),
    }
});

/// The schema of `GetPrimaryKeys` rows (Flight SQL's `CommandGetPrimaryKeys`).
fn primary_keys_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("catalog_name", DataType::Utf8, true),
        Field::new("db_schema_name", DataType::Utf8, true),
        Field::new("table_name", DataType::Utf8, false),
        Field::new("column_name", DataType::Utf8, false),
        Field::new("key_name", DataType::Utf8, true),
        Field::new("key_sequence", DataType::Int32, false),
    ]))
}

/// What a catalog command's rows look like; a command the server does not answer is
/// refused with what it does.
pub(super) fn schema(command: &Command) -> Result<SchemaRef> {
    Ok(match command {
        Command::CommandGetSqlInfo(query) => query.clone().into_builder(&SQL_INFO).schema(),
        Command::CommandGetCatalogs(query) => (*query).into_builder().schema(),
        Command::CommandGetDbSchemas(query) => query.clone().into_builder().schema(),
        Command::CommandGetTables(query) => query.clone().into_builder().schema(),
        Command::CommandGetTableTypes(query) => (*query).into_builder().schema(),
        Command::CommandGetXdbcTypeInfo(query) => (*query).into_builder(&XDBC_TYPES).schema(),
        Command::CommandGetPrimaryKeys(_) => primary_keys_schema(),
        other => return Err(refused(other)),
    })
}

/// A catalog builder's failure: a bug of ours, not the caller's.
fn internal(error: arrow_flight::error::FlightError) -> Error {
    Error::Internal(format!("building a catalog answer: {error}"))
}

/// The refusal of a Flight SQL command this read-only server does not take.
fn refused(command: &Command) -> Error {
    let name = command.type_url();
    let name = name.trim_start_matches("type.googleapis.com/arrow.flight.protocol.sql.");
    Error::invalid(format!(
        "{} is not supported: the server is read-only and answers queries, prepared queries, \
         SqlInfo, catalogs, schemas, tables, table types, primary keys and type info \
         (docs/sql.md)",
        name.chars().take(100).collect::<String>()
    ))
}

impl CdcFlightService {
    /// The rows of a catalog command, of the tables `principal` may read.
    pub(super) async fn catalog_batch(
        &self,
        principal: &Principal,
        command: Command,
    ) -> Result<RecordBatch> {
        let tables = || async {
            let tracked = self.source.tracked_tables().await?;
            Ok::<_, Error>(
                tracked
                    .into_iter()
                    .filter(|tracked| principal.may_read(&tracked.table))
                    .collect::<Vec<_>>(),
            )
        };
        Ok(match command {
            Command::CommandGetSqlInfo(mut query) => {
                // The builder keeps an array per id asked: ask it only for ids it holds, once
                // each (none of them, when none asked for is served).
                let asked = !query.info.is_empty();
                query.info.sort_unstable();
                query.info.dedup();
                query.info.retain(|id| SERVED_INFO.contains(id));
                if asked && query.info.is_empty() {
                    return Ok(RecordBatch::new_empty(
                        query.into_builder(&SQL_INFO).schema(),
                    ));
                }
                query.into_builder(&SQL_INFO).build().map_err(internal)?
            }
            Command::CommandGetXdbcTypeInfo(query) => {
                query.into_builder(&XDBC_TYPES).build().map_err(internal)?
            }
            Command::CommandGetCatalogs(query) => {
                let mut builder = query.into_builder();
                builder.append(CATALOG);
                builder.build().map_err(internal)?
            }
            Command::CommandGetTableTypes(query) => {
                let mut builder = query.into_builder();
                builder.append(TABLE);
                builder.append(FUNCTION);
                builder.build().map_err(internal)?
            }
            Command::CommandGetDbSchemas(query) => {
                let mut builder = query.into_builder();
                let mut schemas: Vec<String> = tables()
                    .await?
                    .into_iter()
                    .map(|tracked| tracked.table.schema)
                    .collect();
                schemas.push(FUNCTIONS_SCHEMA.into());
                schemas.sort();
                schemas.dedup();
                for schema in schemas {
                    builder.append(CATALOG, schema);
                }
                builder.build().map_err(internal)?
            }
            Command::CommandGetTables(mut query) => {
                // The builder filters once per type asked: only the two there are, once each.
                let asked = !query.table_types.is_empty();
                query.table_types.sort_unstable();
                query.table_types.dedup();
                query
                    .table_types
                    .retain(|kind| kind == TABLE || kind == FUNCTION);
                if asked && query.table_types.is_empty() {
                    return Ok(RecordBatch::new_empty(query.into_builder().schema()));
                }
                let mut builder = query.into_builder();
                for tracked in tables().await? {
                    // A table no schema describes (a type without a mapping, a masks file
                    // that does not fit it) is listed with none rather than hiding the others.
                    let schema = self
                        .table_schema(principal, &tracked.table, &tracked.capture_instances)
                        .map_or_else(|_| Schema::empty(), |schema| schema.as_ref().clone());
                    let table = &tracked.table;
                    builder
                        .append(CATALOG, &table.schema, &table.name, TABLE, &schema)
                        .map_err(internal)?;
                }
                for (name, columns) in super::statement::FUNCTIONS {
                    let schema = super::text_schema(columns);
                    builder
                        .append(CATALOG, FUNCTIONS_SCHEMA, name, FUNCTION, &schema)
                        .map_err(internal)?;
                }
                builder.build().map_err(internal)?
            }
            Command::CommandGetPrimaryKeys(query) => self.primary_keys(principal, &query).await?,
            other => return Err(refused(&other)),
        })
    }

    /// The columns of the index CDC uses for the table, in order.
    async fn primary_keys(
        &self,
        principal: &Principal,
        query: &CommandGetPrimaryKeys,
    ) -> Result<RecordBatch> {
        // The parts as GetTables listed them, not parsed again: a part may hold a dot.
        let schema_name = query.db_schema.clone().unwrap_or_else(|| "dbo".into());
        let table = crate::source::TableName::new(schema_name, query.table.clone());
        if query
            .catalog
            .as_deref()
            .is_some_and(|catalog| catalog != CATALOG)
        {
            return Ok(RecordBatch::new_empty(primary_keys_schema()));
        }
        principal.check(&table)?;
        let key = self.key_of(&table).await?;
        let rows = key.len();
        let repeat = |value: &str| Arc::new(StringArray::from(vec![value; rows])) as ArrayRef;
        let sequence: Vec<i32> = (1..=i32::try_from(rows).unwrap_or(i32::MAX)).collect();
        Ok(RecordBatch::try_new(
            primary_keys_schema(),
            vec![
                repeat(CATALOG),
                repeat(&table.schema),
                repeat(&table.name),
                Arc::new(StringArray::from(key)),
                Arc::new(StringArray::from(vec![None::<&str>; rows])),
                Arc::new(Int32Array::from(sequence)),
            ],
        )?)
    }
}
