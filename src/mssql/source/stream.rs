//! The streaming machinery: a change range or snapshot read runs on a connection of its own in
//! a task that decodes rows into Arrow batches bounded by rows and bytes and sends them through
//! a bounded channel, so a slow client slows the read instead of filling memory. When the
//! client goes away between batches the query is cancelled (TDS attention) and the connection
//! returned clean, or dropped if the cancel fails; when it goes away while the query is still
//! working towards a row, the connection is dropped at once, which ends the query on the
//! server. The read ends with an explicit end ([`crate::source::ReadSender::finish`]).

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, Int32Array, StringArray, TimestampMicrosecondArray, new_null_array,
};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::TryStreamExt;
use tiberius::ToSql;

use super::{Param, SqlServerSource};
use crate::error::{Error, Result};
use crate::mssql::decode::{self, ColumnBuilder};
use crate::mssql::pool::{self, Connection};
use crate::source::{BatchBytes, BatchStream, ReadSender, read_channel};

/// A constant column of every row of a statement's batches.
#[derive(Clone, Debug)]
pub(super) enum Fill {
    Text(String),
    NullText,
    Int(Option<i32>),
    Timestamp(Option<i64>),
}

impl Fill {
    pub(super) fn array(&self, rows: usize) -> ArrayRef {
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
pub(super) struct BatchShape {
    pub(super) schema: SchemaRef,
    /// For each schema column: `Some(i)` = the i-th result column, `None` = the next fill.
    pub(super) sources: Vec<Option<usize>>,
    /// The schema column of a change read's commit times, which every row must have: a
    /// change row whose commit has no `cdc.lsn_time_mapping` row is an error, not a row
    /// served without its time (or dropped, as an inner join would).
    pub(super) commit_times: Option<usize>,
}

impl BatchShape {
    pub(super) fn decoders(&self, capacity: usize) -> Result<Vec<ColumnBuilder>> {
        self.sources
            .iter()
            .zip(self.schema.fields())
            .filter(|(source, _)| source.is_some())
            .map(|(_, field)| ColumnBuilder::new(field.data_type(), capacity))
            .collect()
    }

    pub(super) fn batch(
        &self,
        decoders: &mut [ColumnBuilder],
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
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        if let Some(index) = self.commit_times {
            require_commit_times(&batch, index)?;
        }
        Ok(batch)
    }
}

/// Fails on the first row of `batch` whose commit time (column `index`) is NULL, naming its
/// commit LSN (`_start_lsn`).
fn require_commit_times(batch: &RecordBatch, index: usize) -> Result<()> {
    let times = batch.column(index);
    if times.null_count() == 0 {
        return Ok(());
    }
    let row = (0..times.len())
        .find(|row| times.is_null(*row))
        .unwrap_or(0);
    let lsn = batch
        .column_by_name(crate::types::START_LSN_COLUMN)
        .and_then(|column| column.as_any().downcast_ref::<StringArray>())
        .filter(|lsns| lsns.is_valid(row))
        .map_or("?", |lsns| lsns.value(row));
    Err(Error::Internal(format!(
        "a change row of commit {lsn} has no row in cdc.lsn_time_mapping, so its commit time \
         is unknown; the read stops rather than serve it without one (a cleanup racing the \
         read, or a damaged CDC catalog)"
    )))
}

/// Reads one statement's rows into batches; `Ok(false)` when the client went away (the
/// query is then cancelled, or its connection left dirty to be dropped).
#[allow(clippy::too_many_arguments)]
pub(super) async fn read_statement(
    connection: &mut Connection,
    object: &str,
    statement: &str,
    params: &[Param],
    shape: &BatchShape,
    fills: &[Fill],
    batch_rows: usize,
    batch_bytes: &BatchBytes,
    sender: &ReadSender,
) -> Result<bool> {
    let batch_rows = batch_rows.max(1);
    let mut decoders = shape.decoders(batch_rows.min(65_536))?;
    let values: Vec<&dyn ToSql> = params.iter().map(Param::as_sql).collect();
    connection.dirty = true;
    let mut client_gone = false;
    {
        // The connection stays dirty when the client leaves while the server works: the pool
        // drops it, and SQL Server ends the query of a closed connection.
        let query = tokio::select! {
            query = connection.client.query(statement, &values) => query,
            () = sender.closed() => return Ok(false),
        };
        let mut stream = query
            .map_err(|error| SqlServerSource::read_error(object, error))?
            .into_row_stream();
        let (mut rows, mut bytes) = (0usize, 0usize);
        let mut bound = batch_bytes.now();
        loop {
            let row = tokio::select! {
                row = stream.try_next() => row,
                () = sender.closed() => return Ok(false),
            };
            let Some(row) = row.map_err(|error| SqlServerSource::read_error(object, error))? else {
                break;
            };
            bytes += decode::append_row(&mut decoders, row)?;
            rows += 1;
            if rows >= batch_rows || bytes >= bound {
                let batch = shape.batch(&mut decoders, fills, rows)?;
                (rows, bytes) = (0, 0);
                bound = batch_bytes.now();
                if !sender.send(batch).await {
                    client_gone = true;
                    break;
                }
            }
        }
        if !client_gone && rows > 0 {
            let batch = shape.batch(&mut decoders, fills, rows)?;
            client_gone = !sender.send(batch).await;
        }
    }
    if client_gone {
        // Stop the server's work; a connection whose cancel fails, or takes too long, stays
        // dirty and is dropped.
        let cancel = connection.client.cancel_query();
        if let Ok(Ok(())) = tokio::time::timeout(super::super::pool::CANCEL_TIMEOUT, cancel).await {
            connection.dirty = false;
        }
        return Ok(false);
    }
    connection.dirty = false;
    Ok(true)
}

impl SqlServerSource {
    /// A failed read of `object` (a change table or a tracked table, quoted): a missing
    /// permission names the `GRANT` on that object.
    pub(super) fn read_error(object: &str, error: tiberius::error::Error) -> Error {
        match pool::source_error(error) {
            Error::GrantMissing(message) => Error::GrantMissing(format!(
                "cannot read {object}: {message}. Grant it to the server's login: GRANT SELECT \
                 ON {object} TO <user> (ADR 0009)"
            )),
            other => other,
        }
    }

    /// Starts a read task: runs `statements` (reads of `object`, quoted, named in errors)
    /// one after the other on one connection and sends the rows as batches of `shape`.
    pub(super) fn spawn_read(
        &self,
        object: String,
        statements: Vec<(String, Vec<Param>, Vec<Fill>)>,
        shape: BatchShape,
        batch_rows: usize,
        batch_bytes: BatchBytes,
    ) -> BatchStream {
        let (sender, stream) = read_channel();
        let pool = self.pool.clone();
        let sets_options = statements
            .iter()
            .any(|(statement, _, _)| self.sets_session_options(statement));
        tokio::spawn(async move {
            let outcome = async {
                // A stream dropped while its read waits for a connection leaves the pool's
                // queue at once instead of taking the next free connection for nobody.
                let mut connection = tokio::select! {
                    connection = pool.get() => connection?,
                    () = sender.closed() => return Ok(()),
                };
                connection.session_options |= sets_options;
                for (statement, params, fills) in &statements {
                    let finished = read_statement(
                        &mut connection,
                        &object,
                        statement,
                        params,
                        &shape,
                        fills,
                        batch_rows,
                        &batch_bytes,
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
            sender.finish(outcome).await;
        });
        stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{OutputColumn, SqlType, output_schema};

    fn change_batch(times: Vec<Option<i64>>) -> RecordBatch {
        let schema = output_schema(
            &[OutputColumn {
                name: "id".into(),
                sql_type: SqlType::Int,
            }],
            false,
        );
        let rows = times.len();
        let lsns: Vec<String> = (0..rows).map(|row| format!("0x{row:020X}")).collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec!["dbo_t"; rows])),
            Arc::new(StringArray::from(lsns.clone())),
            Arc::new(StringArray::from(lsns)),
            Arc::new(Int32Array::from(vec![2; rows])),
            Arc::new(TimestampMicrosecondArray::from(times)),
            Arc::new(Int32Array::from(vec![1; rows])),
        ];
        RecordBatch::try_new(schema, columns).expect("batch")
    }

    #[test]
    fn a_change_row_without_a_commit_time_stops_the_read_naming_its_commit() {
        let index = 4;
        assert!(require_commit_times(&change_batch(vec![Some(1), Some(2)]), index).is_ok());
        let error = require_commit_times(&change_batch(vec![Some(1), None, Some(3)]), index)
            .expect_err("a NULL commit time");
        let message = error.to_string();
        assert!(
            message.contains("0x00000000000000000001") && message.contains("lsn_time_mapping"),
            "{message}"
        );
    }
}
