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

use super::ReconcileConfig;
use super::key::{CompareKey, RowKey};
use super::rows::FailureType;
use crate::error::{Result, WriterError};
use crate::tables;

/// The keys with a change after the compared LSN, in bronze or in the change table up to
/// [`InFlight::through`].
#[derive(Debug)]
pub(super) struct InFlight {
    keys: BTreeSet<RowKey>,
    /// Where the change table's read started: how far bronze's stream had read.
    from: Lsn,
    through: Lsn,
}

impl InFlight {
    /// No key in flight.
    #[cfg(test)]
    pub(super) fn none() -> Self {
        InFlight {
            keys: BTreeSet::new(),
            from: Lsn::ZERO,
            through: Lsn::ZERO,
        }
    }

    /// Bronze's changes after `after`, then the change table's from where bronze's stream
    /// stands (its newest change row, or the control table's end, or `after`, whichever is
    /// latest) to `fresh`; with the keys of snapshot rows stamped after `after` that silver
    /// has not applied (those of a snapshot newer than `rebuilt_from`, the one silver was
    /// last rebuilt from).
    pub(super) async fn read(
        client: &CdcClient,
        config: &ReconcileConfig,
        key: &CompareKey,
        (after, rebuilt_from): (Lsn, Option<Lsn>),
        bronze_end: Option<Lsn>,
        fresh: Lsn,
    ) -> Result<Self> {
        let mut keys = BTreeSet::new();
        let mut newest_change: Option<String> = None;
        let bronze_url = tables::table_url(&config.bronze)?;
        if let Some(bronze) = tables::open(&bronze_url).await? {
            // Snapshot rows count too: a chunk stamped after silver's position may not be
            // applied yet. Not those of the snapshot silver was rebuilt from (or an older
            // one): the rebuild holds each, and a key that changed between S and its chunk's
            // stamp has a change row after S here. Counting them kept every key of a quiet
            // table bootstrapped beside a busy one in flight for ever, and hid any
            // difference. Only change rows say how far the stream read: a chunk's stamp can
            // be ahead of it.
            let context = SessionContext::new();
            context.register_table("bronze", bronze.table_provider().await?)?;
            let names = key.names();
            let applied_snapshots = match rebuilt_from {
                Some(rebuilt) => format!(
                    " AND NOT (_operation = 0 AND COALESCE(_snapshot, _start_lsn) <= '{rebuilt}')"
                ),
                None => String::new(),
            };
            let frame = context
                .sql(&format!(
                    "SELECT {}, CASE WHEN _operation <> 0 THEN _start_lsn END FROM bronze \
                     WHERE _start_lsn > '{after}'{applied_snapshots}",
                    tables::quote_columns(&names)
                ))
                .await?;
            let mut stream = frame.execute_stream().await?;
            while let Some(batch) = stream.try_next().await? {
                keys.extend(key.row_keys(&batch)?);
                let lsns = arrow::compute::cast(
                    batch.column(names.len()),
                    &arrow::datatypes::DataType::Utf8,
                )?;
                let lsns = lsns
                    .as_any()
                    .downcast_ref::<arrow::array::StringArray>()
                    .ok_or_else(|| WriterError::Internal("bronze's _start_lsn as text".into()))?;
                // LSNs are fixed-width hex text: their text order is theirs.
                if let Some(newest) = arrow::compute::max_string(lsns)
                    && newest_change.as_deref().is_none_or(|seen| newest > seen)
                {
                    newest_change = Some(newest.to_string());
                }
            }
        }
        let newest_change = newest_change
            .map(|lsn| {
                lsn.parse::<Lsn>().map_err(|error| {
                    WriterError::Internal(format!("bronze holds a bad _start_lsn '{lsn}': {error}"))
                })
            })
            .transpose()?;
        // Bronze holds every change up to its newest one (a batch commits whole); the change
        // table the rest.
        let from = [Some(after), bronze_end, newest_change]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(after);
        let mut in_flight = InFlight {
            keys,
            from,
            through: from,
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
        key: &CompareKey,
        lsn: Lsn,
    ) -> Result<()> {
        if lsn <= self.through {
            return Ok(());
        }
        let command = ChangesCommand {
            serve: ServeOptions {
                columns: Some(key.names()),
                include_command_id: Some(false),
                ..ServeOptions::default()
            },
            ..ChangesCommand::new(config.table.clone(), self.through, Some(lsn))
        };
        let plan = client.plan_changes(&command).await?;
        for endpoint in &plan.info.endpoint {
            let mut reader = client
                .open_endpoint(super::ticket(endpoint, "change")?)
                .await?;
            while let Some(batch) = reader.next_batch().await? {
                self.keys.extend(key.row_keys(&batch)?);
            }
            reader.completion()?;
        }
        self.through = lsn;
        Ok(())
    }

    /// Keys known to have changed (tests).
    #[cfg(test)]
    pub(super) fn of_keys(keys: impl IntoIterator<Item = RowKey>) -> Self {
        InFlight {
            keys: keys.into_iter().collect(),
            from: Lsn::ZERO,
            through: Lsn::ZERO,
        }
    }

    /// The change table's LSNs read for keys in flight: `(from, through]`.
    pub(super) fn window(&self) -> (Lsn, Lsn) {
        (self.from, self.through)
    }

    /// Whether `key` changed.
    pub(super) fn contains(&self, key: &RowKey) -> bool {
        self.keys.contains(key)
    }

    /// `failure`, or IN_FLIGHT when `key` changed after the compared LSN.
    pub(super) fn failure(&self, key: &RowKey, failure: FailureType) -> FailureType {
        match self.contains(key) {
            true => FailureType::InFlight,
            false => failure,
        }
    }

    /// The changed keys.
    pub(super) fn keys(&self) -> impl Iterator<Item = &RowKey> + '_ {
        self.keys.iter()
    }
}
