//! Arrow Flight SQL on the service's own port, read-only (docs/sql.md).
//!
//! A Flight SQL message is a protobuf `Any` in a descriptor, a ticket or an action body; the
//! service's own commands are JSON, so the two never meet. A query is parsed
//! ([`statement`]) into one of the service's plans: a snapshot or a change range gets the
//! same `FlightInfo` as the JSON command, its endpoints the same signed tickets, so `DoGet`,
//! authentication, grants, limits and metrics are the service's own. Planning calls and
//! catalog listings are answered at `DoGet` from a ticket holding the request itself.
//!
//! Stateless like the rest: a prepared statement's handle is its SQL text, so any replica
//! serves it, no server memory is held per handle and closing one frees nothing.

mod catalog;
mod statement;

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, Any, Command, ProstMessageExt, TicketStatementQuery,
};
use arrow_flight::{
    Action, FlightDescriptor, FlightEndpoint, FlightInfo, IpcMessage, SchemaAsIpc, Ticket,
};
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use tonic::Status;

use super::CdcFlightService;
use super::auth::Principal;
use super::encode;
use super::stream::BoxedStream;
use crate::Lsn;
use crate::error::{Error, Result};
use crate::protocol::{self, ChangesCommand, LsnAnswer};
use crate::source::TableName;
pub use statement::{ChangesQuery, Function, KeyRange, MAX_SQL_BYTES, Point, Statement, parse};

/// The prefix of every Flight SQL message's type URL.
const TYPE_URL_PREFIX: &str = "type.googleapis.com/arrow.flight.protocol.sql.";

/// The request header asking a query's plan for up to this many endpoints (a whole-table
/// read cut on its key; each capture instance's change range, in tiles of at least the
/// planner's 50,000 rows): ADBC reads them as partitions, in parallel.
pub const PARTITIONS_HEADER: &str = "x-mssql-cdc-partitions";

/// Endpoints a plan is cut into unless the header asks for more: one (one per capture
/// instance of a change range). Some Flight SQL clients read only a plan's first endpoint
/// (flightsql-dbapi, behind SQLAlchemy), and would drop the others' rows without a word.
const DEFAULT_PARTITIONS: u32 = 1;

/// The endpoints a request asks its plan for ([`PARTITIONS_HEADER`]); the planner bounds it.
pub(super) fn partitions(metadata: &tonic::metadata::MetadataMap) -> Result<u32> {
    let Some(value) = metadata.get(PARTITIONS_HEADER) else {
        return Ok(DEFAULT_PARTITIONS);
    };
    value
        .to_str()
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| {
            Error::invalid(format!(
                "{PARTITIONS_HEADER} is a number of endpoints, 1 to {}",
                protocol::MAX_PARTITIONS
            ))
        })
}

/// The Flight SQL message `bytes` hold, if they hold one; one whose body does not decode is
/// refused as such rather than taken for a JSON command.
pub(super) fn command(bytes: &[u8]) -> Option<Result<Command>> {
    let any = Any::decode(bytes).ok()?;
    if !any.type_url.starts_with(TYPE_URL_PREFIX) {
        return None;
    }
    Some(
        Command::try_from(any).map_err(|error| {
            Error::invalid(format!("the Flight SQL message is malformed: {error}"))
        }),
    )
}

/// Whether an action is one of Flight SQL's this service takes.
pub(super) fn is_sql_action(name: &str) -> bool {
    matches!(name, "CreatePreparedStatement" | "ClosePreparedStatement")
}

/// A statement's SQL text from a prepared statement's handle.
fn handle_text(handle: &[u8]) -> Result<String> {
    String::from_utf8(handle.to_vec())
        .map_err(|_| Error::invalid("the prepared statement handle is not this server's"))
}

/// The schema of a planning call's row: its answer's fields, as text.
fn function_schema(function: &statement::Function) -> SchemaRef {
    text_schema(function.columns())
}

/// A schema of nullable text columns named `columns`.
fn text_schema(columns: &[&str]) -> SchemaRef {
    let fields: Vec<Field> = columns
        .iter()
        .map(|name| Field::new(*name, DataType::Utf8, true))
        .collect();
    Arc::new(Schema::new(fields))
}

/// A schema as IPC bytes, for a `FlightInfo` or a prepared statement.
fn schema_bytes(schema: &Schema) -> Result<bytes::Bytes> {
    let message = IpcMessage::try_from(SchemaAsIpc::new(schema, &IpcWriteOptions::default()))?;
    Ok(message.0)
}

/// One batch as a `DoGet` stream.
fn batch_stream(batch: RecordBatch) -> BoxedStream<encode::Message> {
    FlightDataEncoderBuilder::new()
        .with_schema(batch.schema())
        .build(futures::stream::once(async move { Ok(batch) }))
        .map_ok(encode::Message::whole)
        .map_err(Status::from)
        .boxed()
}

impl CdcFlightService {
    /// `GetFlightInfo` of a Flight SQL command.
    pub(super) async fn sql_flight_info(
        &self,
        principal: &Principal,
        (command, partitions): (Command, u32),
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo> {
        let ticketed = |schema: &Schema, ticket: Vec<u8>| -> Result<FlightInfo> {
            Ok(FlightInfo::new()
                .try_with_schema(schema)?
                .with_descriptor(descriptor.clone())
                .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(ticket))))
        };
        match command {
            Command::CommandStatementQuery(query) => {
                self.statement_info(principal, &query.query, descriptor, partitions)
                    .await
            }
            Command::CommandPreparedStatementQuery(query) => {
                let sql = handle_text(&query.prepared_statement_handle)?;
                self.statement_info(principal, &sql, descriptor, partitions)
                    .await
            }
            command => {
                let schema = catalog::schema(&command)?;
                ticketed(&schema, command.into_any().encode_to_vec())
            }
        }
    }

    /// `GetSchema` of a Flight SQL command.
    pub(super) async fn sql_schema(
        &self,
        principal: &Principal,
        command: Command,
    ) -> Result<SchemaRef> {
        match command {
            Command::CommandStatementQuery(query) => {
                self.statement_schema(principal, &parse(&query.query)?)
                    .await
            }
            Command::CommandPreparedStatementQuery(query) => {
                let sql = handle_text(&query.prepared_statement_handle)?;
                self.statement_schema(principal, &parse(&sql)?).await
            }
            command => catalog::schema(&command),
        }
    }

    /// `DoGet` of a ticket holding a Flight SQL message: a planning call's row or a
    /// catalog listing. Reads of rows carry the service's signed tickets instead.
    pub(super) async fn sql_get(
        &self,
        principal: &Principal,
        command: Command,
    ) -> Result<BoxedStream<encode::Message>> {
        let batch = match command {
            Command::TicketStatementQuery(ticket) => {
                let sql = handle_text(&ticket.statement_handle)?;
                let Statement::Function(function) = parse(&sql)? else {
                    return Err(Error::invalid(
                        "a read of rows is redeemed by the tickets of its FlightInfo, not by \
                         its statement",
                    ));
                };
                self.function_row(principal, &function).await?
            }
            command => self.catalog_batch(principal, command).await?,
        };
        Ok(batch_stream(batch))
    }

    /// `DoAction` of a Flight SQL action: a prepared statement's handle is its checked SQL
    /// text; closing one frees nothing.
    pub(super) async fn sql_action(
        &self,
        principal: &Principal,
        action: &Action,
    ) -> Result<bytes::Bytes> {
        let body = Any::decode(action.body.as_ref()).map_err(|error| {
            Error::invalid(format!("{}: the body is malformed: {error}", action.r#type))
        })?;
        let malformed = |error: arrow::error::ArrowError| {
            Error::invalid(format!("{}: the body is malformed: {error}", action.r#type))
        };
        match action.r#type.as_str() {
            "CreatePreparedStatement" => {
                let request: ActionCreatePreparedStatementRequest = body
                    .unpack()
                    .map_err(malformed)?
                    .ok_or_else(|| Error::invalid("CreatePreparedStatement: not its request"))?;
                if request.transaction_id.is_some() {
                    return Err(Error::invalid(
                        "transactions are not supported: the server is read-only",
                    ));
                }
                let schema = self
                    .statement_schema(principal, &parse(&request.query)?)
                    .await?;
                let result = ActionCreatePreparedStatementResult {
                    prepared_statement_handle: request.query.into_bytes().into(),
                    dataset_schema: schema_bytes(&schema)?,
                    parameter_schema: bytes::Bytes::new(),
                };
                Ok(result.as_any().encode_to_vec().into())
            }
            _ => {
                let _: ActionClosePreparedStatementRequest = body
                    .unpack()
                    .map_err(malformed)?
                    .ok_or_else(|| Error::invalid("ClosePreparedStatement: not its request"))?;
                Ok(bytes::Bytes::new())
            }
        }
    }

    /// The plan of a query: a snapshot's or a change range's `FlightInfo`, the service's
    /// own; a planning call's, with one ticket holding the statement.
    async fn statement_info(
        &self,
        principal: &Principal,
        sql: &str,
        descriptor: FlightDescriptor,
        partitions: u32,
    ) -> Result<FlightInfo> {
        match parse(sql)? {
            Statement::Snapshot { mut command, range } => {
                let table: TableName = command.table.parse()?;
                principal.check(&table)?;
                match range {
                    Some(range) => {
                        self.check_key(&table, &range.column).await?;
                        command.chunks = Some(vec![range.chunk()]);
                    }
                    None => command.partitions = Some(partitions),
                }
                self.snapshot_info(principal, &command, descriptor).await
            }
            Statement::Changes(query) => {
                let command = self.changes_command(principal, &query, partitions).await?;
                self.changes_info(principal, &command, descriptor).await
            }
            Statement::Function(function) => {
                if let Some(table) = function.table() {
                    principal.check(&table.parse()?)?;
                }
                let ticket = TicketStatementQuery {
                    statement_handle: sql.as_bytes().to_vec().into(),
                };
                Ok(FlightInfo::new()
                    .try_with_schema(&function_schema(&function))?
                    .with_descriptor(descriptor)
                    .with_endpoint(
                        FlightEndpoint::new()
                            .with_ticket(Ticket::new(ticket.as_any().encode_to_vec())),
                    ))
            }
        }
    }

    /// The schema a statement's rows have.
    async fn statement_schema(
        &self,
        principal: &Principal,
        statement: &Statement,
    ) -> Result<SchemaRef> {
        let (table, command) = match statement {
            Statement::Snapshot { command, range } => {
                let table = command.table.parse::<TableName>()?;
                principal.check(&table)?;
                if let Some(range) = range {
                    self.check_key(&table, &range.column).await?;
                }
                (table, protocol::Command::Snapshot(command.clone()))
            }
            Statement::Changes(query) => (
                query.table.parse::<TableName>()?,
                protocol::Command::Changes(query.command(Lsn::ZERO, None, DEFAULT_PARTITIONS)),
            ),
            Statement::Function(function) => {
                if let Some(table) = function.table() {
                    principal.check(&table.parse()?)?;
                }
                return Ok(function_schema(function));
            }
        };
        principal.check(&table)?;
        self.command_schema(principal, &table, &command).await
    }

    /// `BETWEEN` bounds only the table's own integer key, the one a chunk is cut on.
    async fn check_key(&self, table: &TableName, column: &str) -> Result<()> {
        let key = self.key_of(table).await?;
        match key.as_slice() {
            [only] if only.eq_ignore_ascii_case(column) => Ok(()),
            _ => Err(Error::invalid(format!(
                "WHERE bounds '{column}', but a snapshot of {table} is bounded only on its key \
                 ({})",
                key.join(", ")
            ))),
        }
    }

    /// The columns of the index CDC uses for `table`, in order (its newest instance's).
    async fn key_of(&self, table: &TableName) -> Result<Vec<String>> {
        let instances = self.source.active_capture_instances(table).await?;
        Ok(instances
            .last()
            .map(|instance| instance.index_columns.clone())
            .unwrap_or_default())
    }

    /// The changes command of `cdc.changes(...)`: its ends resolved to LSNs as the
    /// planning calls resolve them.
    async fn changes_command(
        &self,
        principal: &Principal,
        query: &statement::ChangesQuery,
        partitions: u32,
    ) -> Result<ChangesCommand> {
        let table: TableName = query.table.parse()?;
        principal.check(&table)?;
        let from = match &query.from {
            Point::Lsn(lsn) => *lsn,
            Point::Earliest => {
                let body = serde_json::json!({ "table": query.table, "starting": "earliest" });
                self.answer_lsn(principal, "initial_offset", body).await?
            }
            Point::Latest => {
                self.answer_lsn(principal, "max_lsn", serde_json::json!({}))
                    .await?
            }
        };
        let mut to = match &query.to {
            Point::Lsn(lsn) => Some(*lsn),
            Point::Latest => None,
            Point::Earliest => {
                return Err(Error::invalid(
                    "a change range ends at 'latest' or an LSN, not 'earliest'",
                ));
            }
        };
        if let Some(max_commits) = query.max_commits {
            // `latest_offset` clamps an end past max_lsn and answers an empty range for an
            // end before the start; the planner refuses both, and so does SQL, capped or not.
            if let Some(end) = to {
                let ceiling = self
                    .answer_lsn(principal, "max_lsn", serde_json::json!({}))
                    .await?;
                if end > ceiling {
                    return Err(Error::invalid(format!(
                        "to {end} is past max_lsn {ceiling}: a range ends at or before the last \
                         commit CDC has processed"
                    )));
                }
                if from > end {
                    return Err(Error::invalid(format!(
                        "from {from} is past to {end}: a range (from, to] needs from <= to"
                    )));
                }
            }
            let body = serde_json::json!({
                "start": crate::Offset::new(from, None),
                "max_commits": max_commits,
                "upper": to,
            });
            to = Some(self.answer_lsn(principal, "latest_offset", body).await?);
        }
        Ok(query.command(from, to, partitions))
    }

    /// The LSN a planning call answers (`lsn` of its JSON).
    async fn answer_lsn(
        &self,
        principal: &Principal,
        name: &str,
        body: serde_json::Value,
    ) -> Result<Lsn> {
        let answer = self.call(principal, name, body).await?;
        let answer: LsnAnswer = serde_json::from_slice(&answer)
            .map_err(|error| Error::Internal(format!("{name} answered {error}")))?;
        answer.lsn.ok_or_else(|| {
            Error::invalid(format!(
                "{name} has no LSN to give: the database holds no commit"
            ))
        })
    }

    /// A planning action, as `DoAction` runs it.
    async fn call(
        &self,
        principal: &Principal,
        name: &str,
        body: serde_json::Value,
    ) -> Result<bytes::Bytes> {
        let action = Action::new(
            name,
            serde_json::to_vec(&body).map_err(|error| Error::Internal(error.to_string()))?,
        );
        self.action(principal, &action).await
    }

    /// A planning call's answer as one row of text columns.
    async fn function_row(
        &self,
        principal: &Principal,
        function: &statement::Function,
    ) -> Result<RecordBatch> {
        let (name, body) = function.action();
        let answer = self.call(principal, name, body).await?;
        let answer: serde_json::Value = serde_json::from_slice(&answer)
            .map_err(|error| Error::Internal(format!("{name} answered {error}")))?;
        let schema = function_schema(function);
        let columns: Vec<ArrayRef> = function
            .columns()
            .iter()
            .map(|column| {
                // An unknown commit time is "" in the protocol's JSON, NULL in SQL.
                let value = match answer.get(*column) {
                    None | Some(serde_json::Value::Null) => None,
                    Some(serde_json::Value::String(text)) if text.is_empty() => None,
                    Some(serde_json::Value::String(text)) => Some(text.clone()),
                    Some(other) => Some(other.to_string()),
                };
                Arc::new(StringArray::from(vec![value])) as ArrayRef
            })
            .collect();
        Ok(RecordBatch::try_new(schema, columns)?)
    }
}
