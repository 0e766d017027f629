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

use super::buckets::units_of;
use super::{GridKey, ReconcileConfig};
use crate::error::{Result, WriterError};
use crate::tables;

/// The keys (grid units; `None` is NULL) with a change after the compared LSN, in bronze
/// or in the change table up to [`InFlight::through`].
#[derive(Debug)]
pub(super) struct InFlight {
    keys: BTreeSet<Option<i64>>,
    through: Lsn,
}

impl InFlight {
    /// Bronze's changes after `after`, then the change table's from bronze's end (or
    /// `after`) to `fresh`.
    pub(super) async fn read(
        client: &CdcClient,
        config: &ReconcileConfig,
        key: &GridKey,
        after: Lsn,
        bronze_end: Option<Lsn>,
        fresh: Lsn,
    ) -> Result<Self> {
        let mut keys = BTreeSet::new();
        let bronze_url = tables::table_url(&config.bronze)?;
        if let Some(bronze) = tables::open(&bronze_url).await? {
            // Snapshot rows count too: a chunk stamped after silver's position is not
            // applied yet.
            let context = SessionContext::new();
            context.register_table("bronze", bronze.table_provider().await?)?;
            let frame = context
                .sql(&format!(
                    "SELECT {} FROM bronze WHERE _start_lsn > '{after}'",
                    tables::quote_identifier(&key.column.name)
                ))
                .await?;
            let mut stream = frame.execute_stream().await?;
            while let Some(batch) = stream.try_next().await? {
                keys.extend(units_of(batch.column(0), key)?.iter());
            }
        }
        // Bronze holds (after, bronze_end]; the change table the rest.
        let mut in_flight = InFlight {
            keys,
            through: bronze_end.map_or(after, |end| end.max(after)),
        };
        in_flight.extend_to(client, config, key, fresh).await?;
        Ok(in_flight)
    }

    /// Adds the keys the change table holds changes of after [`InFlight::through`] up to
    /// `lsn` (nothing when `lsn` is not later): a row read later than the counts may show a
    /// change the counts did not see.
    pub(super) async fn extend_to(
        &mut self,
        client: &CdcClient,
        config: &ReconcileConfig,
        key: &GridKey,
        lsn: Lsn,
    ) -> Result<()> {
        if lsn <= self.through {
            return Ok(());
        }
        let command = ChangesCommand {
            serve: ServeOptions {
                columns: Some(vec![key.column.name.clone()]),
                include_command_id: Some(false),
                ..ServeOptions::default()
            },
            ..ChangesCommand::new(config.table.clone(), self.through, Some(lsn))
        };
        let plan = client.plan_changes(&command).await?;
        for endpoint in &plan.info.endpoint {
            let ticket = endpoint.ticket.as_ref().ok_or_else(|| {
                WriterError::Internal("a change endpoint without a ticket".into())
            })?;
            let mut reader = client.open_endpoint(ticket).await?;
            while let Some(batch) = reader.next_batch().await? {
                let column = batch.column_by_name(&key.column.name).ok_or_else(|| {
                    WriterError::Internal(format!(
                        "the change rows lack the key column '{}'",
                        key.column.name
                    ))
                })?;
                self.keys.extend(units_of(column, key)?.iter());
            }
            reader.completion()?;
        }
        self.through = lsn;
        Ok(())
    }

    /// Keys known to have changed (tests).
    #[cfg(test)]
    pub(super) fn of_keys(keys: impl IntoIterator<Item = Option<i64>>) -> Self {
        InFlight {
            keys: keys.into_iter().collect(),
            through: Lsn::ZERO,
        }
    }

    /// Whether `key` changed.
    pub(super) fn contains(&self, key: Option<i64>) -> bool {
        self.keys.contains(&key)
    }

    /// The changed keys.
    pub(super) fn keys(&self) -> impl Iterator<Item = Option<i64>> + '_ {
        self.keys.iter().copied()
    }
}
