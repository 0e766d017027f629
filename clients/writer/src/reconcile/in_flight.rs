//! The keys still in flight: changed after the LSN a reconcile compares at, so a difference
//! of theirs may be lag, not loss (seed ADR 0028 Amendment 2). Bronze holds the changes the
//! stream read; the change table, read over Flight from bronze's end to a `max_lsn` read
//! after the source was counted, holds the ones it has not read yet.

use std::collections::BTreeSet;

use deltalake::datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::{ChangesCommand, ServeOptions};

use super::buckets::{quote, units_of};
use super::{GridKey, ReconcileConfig};
use crate::error::{Result, WriterError};
use crate::tables;

/// Keys (grid units; `None` is NULL) with a change after `after` in bronze or in the
/// change table up to `fresh`.
pub(super) async fn changed_keys(
    client: &CdcClient,
    config: &ReconcileConfig,
    key: &GridKey,
    after: Lsn,
    bronze_end: Option<Lsn>,
    fresh: Lsn,
) -> Result<BTreeSet<Option<i64>>> {
    let mut changed = BTreeSet::new();
    let bronze_url = tables::table_url(&config.bronze)?;
    if let Some(bronze) = tables::open(&bronze_url).await? {
        // Snapshot rows count too: a chunk stamped after silver's position is not applied.
        let context = SessionContext::new();
        context.register_table("bronze", bronze.table_provider().await?)?;
        let frame = context
            .sql(&format!(
                "SELECT {} FROM bronze WHERE _start_lsn > '{after}'",
                quote(&key.column.name)
            ))
            .await?;
        let mut stream = frame.execute_stream().await?;
        while let Some(batch) = stream.try_next().await? {
            changed.extend(units_of(batch.column(0), key)?.iter());
        }
    }
    // Bronze holds (after, bronze_end]; the change table the rest, to `fresh`.
    let from = bronze_end.map_or(after, |end| end.max(after));
    if from < fresh {
        let command = ChangesCommand {
            serve: ServeOptions {
                columns: Some(vec![key.column.name.clone()]),
                include_command_id: Some(false),
                ..ServeOptions::default()
            },
            ..ChangesCommand::new(config.table.clone(), from, Some(fresh))
        };
        let plan = client.plan_changes(&command).await?;
        for endpoint in &plan.info.endpoint {
            let ticket = endpoint.ticket.as_ref().ok_or_else(|| {
                WriterError::Internal("a change endpoint without a ticket".into())
            })?;
            let mut failed = None;
            client
                .read_endpoint(ticket, |batch| {
                    if failed.is_some() {
                        return;
                    }
                    match batch
                        .column_by_name(&key.column.name)
                        .map(|column| units_of(column, key))
                    {
                        Some(Ok(units)) => changed.extend(units.iter()),
                        Some(Err(error)) => failed = Some(error),
                        None => {
                            failed = Some(WriterError::Internal(format!(
                                "the change rows lack the key column '{}'",
                                key.column.name
                            )))
                        }
                    }
                })
                .await?;
            if let Some(error) = failed {
                return Err(error);
            }
        }
    }
    Ok(changed)
}
