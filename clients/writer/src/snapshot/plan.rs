//! Planning a chunked snapshot's chunks on its first backfill: counted key slices packed into
//! chunks of at most `chunk_rows` (an integer key, through the server's `key_buckets`), or
//! keyset bounds sought on the server (`key_bound`) for composite and text keys; the plan is
//! recorded once and every later call keeps it.

use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::catalog::{KeyBucket, KeyExtent, KeyGrid};
use mssql_cdc_proto::chunking::{self, BucketCounter};
use mssql_cdc_proto::client::{CdcClient, ClientError};
use mssql_cdc_proto::keys::{Bound, KeySeek, KeyTuple};
use mssql_cdc_proto::protocol::KeyBucketsBody;
use mssql_cdc_proto::selection::ColumnSelection;
use serde_json::json;

use super::{
    KeysetOpen, PlannedChunk, PlansRows, Snapshots, keyset_of, plans_location, seed_layout,
};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::FactsRow;
use crate::keyset::Keyset;

/// Counts key slices through the server's `key_buckets` action.
pub(super) struct FlightCounter<'a> {
    pub(super) client: &'a CdcClient,
    pub(super) table: &'a str,
    /// The client's error behind the last failed count, kept whole (the chunking trait
    /// speaks the server's errors): a cut connection stays a transient failure.
    pub(super) failed: std::sync::Mutex<Option<ClientError>>,
}

#[async_trait::async_trait]
impl BucketCounter for FlightCounter<'_> {
    async fn buckets(&self, grid: KeyGrid) -> mssql_cdc_proto::Result<Vec<KeyBucket>> {
        self.client
            .action("key_buckets", &KeyBucketsBody::new(self.table, grid))
            .await
            .map_err(|error| {
                let message = error.to_string();
                *self
                    .failed
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(error);
                mssql_cdc_proto::Error::SourceUnavailable(message)
            })
    }
}

impl Snapshots {
    /// The plan of an open snapshot (`recorded`: its plans rows): made and recorded on the
    /// first call, read back after.
    pub(super) async fn plan(
        &self,
        snapshot: Lsn,
        recorded: &PlansRows,
        chunk_rows: u64,
    ) -> Result<Vec<PlannedChunk>> {
        if let Some(plan) = recorded.last(events::SNAPSHOT_PLAN) {
            if plan["chunk_rows"].as_u64() != Some(chunk_rows) {
                tracing::warn!(planned = %plan["chunk_rows"], asked = chunk_rows,
                    "the snapshot is planned already: its chunk_rows stays");
            }
            return serde_json::from_value(seed_layout::plan_chunks(plan).clone())
                .map_err(|error| WriterError::Internal(format!("recorded plan: {error}")));
        }
        let open = recorded.open_extent().cloned().ok_or_else(|| {
            WriterError::invalid(format!(
                "snapshot {snapshot} has no snapshot_open row in {}: a range without bounds \
                     is never read as the whole table",
                plans_location(&self.config.target)
            ))
        })?;
        // The seed's `snapshot_plan` payload names the extent's kind and the key columns.
        let (key_names, seed_plan) = seed_layout::seed_extent(&open);
        let extent_kind = seed_plan["kind"].as_str().unwrap_or("keyset");
        let chunks = match keyset_of(&open)? {
            Some(keyset) => self.plan_keyset(&keyset, chunk_rows).await?,
            None => {
                let extent: KeyExtent = serde_json::from_value(open)
                    .map_err(|error| WriterError::Internal(format!("recorded extent: {error}")))?;
                let counter = FlightCounter {
                    client: &self.client,
                    table: &self.config.table,
                    failed: std::sync::Mutex::new(None),
                };
                chunking::plan(&counter, extent.min.zip(extent.max), chunk_rows)
                    .await
                    .map_err(|error| {
                        let failed = counter
                            .failed
                            .lock()
                            .ok()
                            .and_then(|mut failed| failed.take());
                        match failed {
                            Some(failed) => WriterError::Flight(failed),
                            None => WriterError::Internal(format!("planning chunks: {error}")),
                        }
                    })?
                    .into_iter()
                    .enumerate()
                    .map(|(index, (range, rows))| PlannedChunk {
                        chunk: index as i32,
                        lo: range.lo.map(Bound::Int),
                        hi: range.hi.map(Bound::Int),
                        rows,
                    })
                    .collect()
            }
        };
        let txn = self.txn("snapplan", snapshot);
        let recorded = self
            .append_plans(
                &txn,
                0,
                snapshot,
                vec![(
                    events::SNAPSHOT_PLAN,
                    seed_layout::plan_row(snapshot, extent_kind, &key_names, chunk_rows, &chunks),
                )],
            )
            .await?;
        self.append_facts(
            &txn,
            0,
            vec![FactsRow {
                event: Some(events::SNAPSHOT_PLAN.into()),
                min_lsn: Some(snapshot.to_string()),
                max_lsn: Some(snapshot.to_string()),
                // As the seed's: a plan reads no row; its estimate is in the detail.
                rows: Some(0),
                detail: Some(
                    json!({"snapshot": snapshot, "kind": extent_kind, "keys": key_names, "chunk_rows": chunk_rows,
                        "chunk_count": chunks.len(), "planned_rows": chunks.iter().map(|c| c.rows).sum::<u64>()})
                        .to_string(),
                ),
                ..FactsRow::default()
            }],
        )
        .await?;
        if recorded {
            return Ok(chunks);
        }
        // Another call recorded its plan first (one plan per snapshot): that one is read.
        let now = self.plans_rows(snapshot).await?;
        Box::pin(self.plan(snapshot, &now, chunk_rows)).await
    }

    /// The server's keyset walk on the open's keys.
    fn keyset<'a>(&'a self, open: &'a KeysetOpen, names: &'a [String]) -> Keyset<'a> {
        Keyset {
            client: &self.client,
            table: &self.config.table,
            keys: names,
            unique: open.unique,
        }
    }

    /// The first key after MAX (`last_bound`), past MAX's own copies; `None` when no row
    /// holds one (yet).
    pub(super) async fn last_bound(&self, open: &KeysetOpen) -> Result<Option<KeyTuple>> {
        let Some(max) = &open.max else {
            return Ok(None);
        };
        let names = open.names();
        self.keyset(open, &names)
            .seek(KeySeek {
                from: Some(max.clone()),
                from_inclusive: false,
                to: None,
                to_inclusive: false,
                n: 0,
            })
            .await
    }

    /// Keyset bounds `chunk_rows` rows apart, walked up front below the MAX recorded at the
    /// open; the last chunk ends at the first key after MAX (open when there is none yet:
    /// it is sought again before the wave that reads it).
    pub(super) async fn plan_keyset(
        &self,
        open: &KeysetOpen,
        chunk_rows: u64,
    ) -> Result<Vec<PlannedChunk>> {
        let Some(max) = &open.max else {
            // An empty table at the open: one chunk, the whole key (rows inserted since S).
            return Ok(vec![PlannedChunk {
                chunk: 0,
                lo: None,
                hi: None,
                rows: 0,
            }]);
        };
        let names = open.names();
        let bounds = self
            .keyset(open, &names)
            .walk(Some(max), chunk_rows)
            .await?;
        let last_hi = self.last_bound(open).await?;
        let mut chunks = Vec::with_capacity(bounds.len() + 1);
        let mut lo: Option<KeyTuple> = None;
        for bound in bounds {
            chunks.push(PlannedChunk {
                chunk: chunks.len() as i32,
                lo: lo.take().map(Bound::Keys),
                hi: Some(Bound::Keys(bound.clone())),
                rows: chunk_rows,
            });
            lo = Some(bound);
        }
        chunks.push(PlannedChunk {
            chunk: chunks.len() as i32,
            lo: lo.map(Bound::Keys),
            hi: last_hi.map(Bound::Keys),
            rows: chunk_rows,
        });
        Ok(chunks)
    }

    /// The column selection snapshot `snapshot`'s open row records (every column for an
    /// open from before selections were recorded).
    fn opened_with(snapshot: Lsn, recorded: &PlansRows) -> Result<ColumnSelection> {
        let Some(open) = recorded.last(events::SNAPSHOT_OPEN) else {
            return Ok(ColumnSelection::All);
        };
        let names = |field: &str| -> Result<Option<Vec<String>>> {
            serde_json::from_value(open[field].clone()).map_err(|error| {
                WriterError::Internal(format!("snapshot {snapshot}'s open row: {field}: {error}"))
            })
        };
        ColumnSelection::new(names("columns")?, names("except_columns")?)
            .map_err(|error| WriterError::Internal(format!("snapshot {snapshot}: {error}")))
    }

    /// Whether the waves of `snapshot` may be read with this reader's columns: yes when its
    /// open chose the same. Otherwise the snapshot can never be finished as one set of
    /// columns: when this reader's columns are the table's (bronze records them, or the
    /// stream gave them) it is abandoned (`Ok(false)`), as its unread waves would copy the
    /// old columns and waves under the new ones would mix two sets in one snapshot; a reader
    /// of a table without bronze yet is refused (the snapshot's open row is then the only
    /// record).
    pub(super) async fn waves_readable(&self, snapshot: Lsn, recorded: &PlansRows) -> Result<bool> {
        let opened = Self::opened_with(snapshot, recorded)?;
        if opened.same_as(&self.columns) {
            return Ok(true);
        }
        if !self.columns_of_table {
            return Err(WriterError::invalid(format!(
                "{}: snapshot {snapshot} was opened reading {opened}, and this command asks for \
                 {} while the table has no bronze yet: give it the snapshot's selection",
                self.config.table, self.columns
            )));
        }
        self.abandon_opened_with(snapshot, &opened).await?;
        Ok(false)
    }

    /// Abandons the open chunked snapshot when it was opened under another column selection
    /// than the stream's ([`Snapshots::waves_readable`] says why); the stream does this
    /// before it records a new selection on bronze, and when it creates bronze.
    pub async fn abandon_under_other_columns(&self) -> Result<()> {
        let recorded = self.recorded().await?;
        let Some(open) = Self::open_chunked_of(&recorded) else {
            return Ok(());
        };
        let opened = Self::opened_with(open, &self.plans_rows(open).await?)?;
        if opened.same_as(&self.columns) {
            return Ok(());
        }
        self.abandon_opened_with(open, &opened).await
    }

    /// A `snapshot_abandoned` row for `open`, opened under `opened`: it frees the table for a
    /// new snapshot (`snapshot open --resnapshot`, or a heal), which the log asks for.
    async fn abandon_opened_with(&self, open: Lsn, opened: &ColumnSelection) -> Result<()> {
        tracing::warn!(table = %self.config.table, snapshot = %open, from = %opened, to = %self.columns,
            "the open chunked snapshot is abandoned: the column selection changed; open a new one");
        self.append_facts(
            &self.txn("snapabandon", open),
            0,
            vec![FactsRow {
                rows: Some(0),
                detail: Some(
                    json!({"snapshot": open, "mode": super::SnapshotMode::Chunked.as_str(), "reason": "the column selection changed"})
                        .to_string(),
                ),
                ..super::snapshot_event(events::SNAPSHOT_ABANDONED, open)
            }],
        )
        .await
        .map(drop)
    }

    /// The keyset an open snapshot is cut on; `None` for an integer plan. Refuses a stream
    /// configured to cut on other columns (the option changed or dropped since the open).
    pub(super) fn keyset_open_of(
        &self,
        snapshot: Lsn,
        recorded: &PlansRows,
    ) -> Result<Option<KeysetOpen>> {
        let Some(open) = recorded.open_extent() else {
            return Ok(None);
        };
        let keyset = keyset_of(open)?;
        let cut_on: Option<Vec<String>> = match &keyset {
            Some(keyset) => (!keyset.unique).then(|| keyset.names()),
            None => None,
        };
        let asked = match (&self.config.snapshot_keys, &keyset) {
            // Naming the unique index's own columns is the default spelled out.
            (Some(keys), Some(keyset)) if keyset.unique && *keys == keyset.names() => None,
            (Some(keys), None)
                if open["column"].as_str() == keys.first().map(String::as_str)
                    && keys.len() == 1 =>
            {
                None
            }
            (asked, _) => asked.clone(),
        };
        if asked != cut_on {
            return Err(WriterError::invalid(format!(
                "{}: snapshot {snapshot} was opened cut on {}, but snapshot_keys is now {}: a \
                 plan never moves to other columns; set snapshot_keys back to finish it, or \
                 open a new snapshot",
                self.config.table,
                cut_on.map_or("the unique index".to_string(), |keys| format!("{keys:?}")),
                asked.map_or("unset (the unique index)".to_string(), |keys| format!(
                    "{keys:?}"
                )),
            )));
        }
        Ok(keyset)
    }
}
