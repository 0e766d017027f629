//! Seeding a table's bronze from an existing copy (the seed library's `seed()`, ADR 0025): a
//! Delta table or Parquet files holding the source table's rows as of a time or LSN become
//! its snapshot at L, so the stream starts at L without reading the table again.
//!
//! L is the last commit before the copy's time (`time_to_lsn`). Earlier is safe: a
//! change between L and the copy's real moment is read again by the stream and applied by
//! silver over a row that already holds it, which ends in the same row. Later is not, so a
//! time is never rounded up. The copy's columns are matched to the captured columns by name,
//! ignoring case, and cast to the stream's types; extra columns are dropped; a captured column
//! the copy lacks is an error unless `allow_missing_columns` (then NULL). The rows land as
//! snapshot rows of S = L (`_operation` 0, `_snapshot` L, `_chunk` NULL) in one bronze append
//! (`<app_id>#snap.<L>`, userMetadata `{seed, lsn, commit_ts, rows}`) between a
//! `snapshot_open` and a `bootstrap` facts row, so silver rebuilds from it like from any
//! snapshot. A rerun with the same L finds the append or the completion and reads nothing
//! twice. Refused while a snapshot of either mode is open, when the table already has a
//! complete snapshot (unless `reseed` with a newer L), when L is past `max_lsn`, and when
//! changes after L were purged (the stream could not start at L).

use std::str::FromStr;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, StringArray, new_null_array};
use arrow::compute::cast;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use deltalake::datafusion::prelude::{ParquetReadOptions, SessionContext};
use futures::StreamExt;
use mssql_cdc_proto::protocol::{LsnAnswer, SnapshotCommand};
use mssql_cdc_proto::types::RESERVED_COLUMN_NAMES;
use mssql_cdc_proto::{CommitTime, Lsn, Offset};
use serde_json::json;

use super::{SnapshotMode, Snapshots, snapshot_event};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts::FactsRow;
use crate::tables;

/// Where the copy stands in the source's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsOf {
    /// An LSN the copy holds every commit up to.
    Lsn(Lsn),
    /// A UTC time the copy holds every commit up to.
    Time(CommitTime),
}

impl FromStr for AsOf {
    type Err = WriterError;

    /// `0x…` is an LSN; anything else a time: RFC 3339 with an offset, or a UTC time without
    /// one (`2026-11-30T12:00:00`, `2026-11-30 12:00:00.250`).
    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.starts_with("0x") || text.starts_with("0X") {
            return text
                .parse()
                .map(AsOf::Lsn)
                .map_err(|error| WriterError::invalid(format!("as_of '{text}': {error}")));
        }
        if let Ok(time) = chrono::DateTime::parse_from_rfc3339(text) {
            return Ok(AsOf::Time(CommitTime(time.timestamp_micros())));
        }
        [
            "%Y-%m-%dT%H:%M:%S%.f",
            "%Y-%m-%d %H:%M:%S%.f",
            "%Y-%m-%dT%H:%M:%S",
        ]
        .iter()
        .find_map(|format| chrono::NaiveDateTime::parse_from_str(text, format).ok())
        .map(|time| AsOf::Time(CommitTime(time.and_utc().timestamp_micros())))
        .ok_or_else(|| {
            WriterError::invalid(format!(
                "as_of '{text}' is neither an LSN (0x…) nor a time (2026-11-30T12:00:00Z)"
            ))
        })
    }
}

/// What [`Snapshots::seed`] is asked.
#[derive(Clone, Debug)]
pub struct SeedOptions {
    /// The copy: a Delta table, a Parquet file or a directory of Parquet files (path or URL).
    pub copy: String,
    /// Where it stands.
    pub as_of: AsOf,
    /// Replace the table's complete snapshot with this newer one.
    pub reseed: bool,
    /// Read captured columns the copy lacks as NULL instead of refusing it.
    pub allow_missing_columns: bool,
}

/// What a seed did.
#[derive(Clone, Debug, PartialEq)]
pub struct SeedOutcome {
    /// The snapshot's S (= L), where the stream starts.
    pub offset: Offset,
    /// Rows adopted.
    pub rows: u64,
    /// Whether an earlier run had seeded it already.
    pub reused: bool,
}

impl Snapshots {
    /// Adopts the copy as the table's snapshot at L (see the module).
    pub async fn seed(&self, options: &SeedOptions) -> Result<SeedOutcome> {
        let table = &self.config.table;
        let lsn = self.seed_lsn(options.as_of).await?;
        let offset = self.client.initial_offset(table, &lsn.to_string()).await?;
        let recorded = self.recorded().await?;
        if let Some((_, rows)) = recorded.completions.iter().find(|(done, _)| *done == lsn) {
            return Ok(SeedOutcome {
                offset,
                rows: *rows,
                reused: true,
            });
        }
        // A seed at this L that a crash left open (recorded as a full snapshot) is finished
        // below; any other open snapshot refuses.
        let open_full = Self::open_full_of(&recorded).filter(|open| *open != lsn);
        if let Some(open) = Self::open_chunked_of(&recorded).or(open_full) {
            return Err(WriterError::invalid(format!(
                "{table}: snapshot {open} is open for this app_id; finish it (backfill, or a \
                 rerun of the full bootstrap) before seeding"
            )));
        }
        if let Some(done) = recorded.completions.iter().map(|(done, _)| *done).max() {
            if !options.reseed {
                return Err(WriterError::invalid(format!(
                    "{table}: bronze already holds the complete snapshot {done}; pass reseed \
                     (--reseed) to replace it with the copy"
                )));
            }
            if lsn <= done {
                return Err(WriterError::invalid(format!(
                    "{table}: a reseed must be newer than the snapshot it replaces ({done}); \
                     the copy stands at {lsn}"
                )));
            }
        }
        let earliest = self.client.initial_offset(table, "earliest").await?;
        if earliest.lsn > lsn {
            return Err(WriterError::DataLoss {
                table: table.clone(),
                from: lsn,
                message: format!(
                    "the copy stands at {lsn} but changes are kept only from {}: the stream \
                     could not start at the copy; take a newer copy or a snapshot",
                    earliest.lsn.increment()
                ),
            });
        }
        // The copy and its columns are checked before anything is written.
        let copy = self.open_copy(options, offset).await?;
        let txn = self.txn("snapopen", lsn);
        self.append_facts(
            &txn,
            0,
            vec![FactsRow {
                rows: Some(0),
                detail: Some(
                    json!({"mode": SnapshotMode::Full.as_str(), "kind": events::BOOTSTRAP, "generation": 0,
                        "lost_from_ts": null, "lost_to_ts": null, "seed": options.copy})
                        .to_string(),
                ),
                min_commit_ts: self.time_of(lsn).await?,
                ..snapshot_event(events::SNAPSHOT_OPEN, lsn)
            }],
        )
        .await?;
        crate::stream::crash_point("after_seed_open", 0);
        let bronze_txn = self.txn("snap", lsn);
        let rows = if self.held_by_bronze(&bronze_txn, 0).await? {
            self.count_snapshot_rows(lsn, None)
                .await?
                .iter()
                .map(|counted| counted.1)
                .sum()
        } else {
            self.append_copy(copy, &options.copy, &bronze_txn).await?
        };
        // The copy may be newer than L ("earlier is safe"): its reads ended by now at the
        // latest, so history applies its rows once the stream has read past this.
        let read_end: LsnAnswer = self.client.action("max_lsn", &json!({})).await?;
        self.append_facts(
            &self.txn("snapdone", lsn),
            0,
            vec![FactsRow {
                rows: Some(rows as i64),
                end_commit_ts: offset.commit_ts.map(CommitTime::micros),
                detail: Some(
                    json!({"mode": SnapshotMode::Full.as_str(), "snapshot": lsn, "seed": options.copy,
                        "read_end": read_end.lsn.map(|end| end.max(lsn))})
                        .to_string(),
                ),
                ..snapshot_event(events::BOOTSTRAP, lsn)
            }],
        )
        .await?;
        tracing::info!(table = %table, snapshot = %lsn, rows, copy = %options.copy, "seeded from a copy");
        Ok(SeedOutcome {
            offset,
            rows,
            reused: false,
        })
    }

    /// L: the LSN given, or the last commit at or before the time given; never past
    /// `max_lsn`.
    async fn seed_lsn(&self, as_of: AsOf) -> Result<Lsn> {
        let max_lsn: LsnAnswer = self.client.action("max_lsn", &json!({})).await?;
        let max_lsn = max_lsn.lsn.unwrap_or(Lsn::ZERO);
        let lsn = match as_of {
            AsOf::Lsn(lsn) => lsn,
            AsOf::Time(time) => {
                // Strictly before: a commit at the copy's very millisecond may be missing
                // from it, and replaying one it holds is harmless.
                let before = CommitTime(time.0 - 1);
                let at: LsnAnswer = self
                    .client
                    .action("time_to_lsn", &json!({"time": before}))
                    .await?;
                at.lsn.ok_or_else(|| WriterError::DataLoss {
                    table: self.config.table.clone(),
                    from: Lsn::ZERO,
                    message: format!(
                        "no commit at or before {time} is left in cdc.lsn_time_mapping: the \
                         copy is older than CDC's retention"
                    ),
                })?
            }
        };
        if lsn > max_lsn {
            return Err(WriterError::invalid(format!(
                "{}: the copy stands at {lsn}, past max_lsn {max_lsn}",
                self.config.table
            )));
        }
        Ok(lsn)
    }

    /// The copy opened for reading, its columns checked against the stream's.
    async fn open_copy(&self, options: &SeedOptions, at: Offset) -> Result<OpenCopy> {
        let plan = self
            .client
            .plan_snapshot(&SnapshotCommand {
                serve: self.columns.serve(),
                ..SnapshotCommand::new(self.config.table.clone())
            })
            .await?;
        let schema: SchemaRef = Arc::new(
            plan.info
                .clone()
                .try_decode_schema()
                .map_err(|error| WriterError::Internal(format!("snapshot schema: {error}")))?,
        );
        // A copy holds clear values: it may not stand in for columns the server masks for
        // this writer, or bronze would hold what the server never serves it.
        let masked: Vec<String> = crate::masks::served_by(&schema).into_keys().collect();
        if !masked.is_empty() {
            return Err(WriterError::invalid(format!(
                "{}: the server serves this writer {} masked (its masks file), and a copy holds \
                 them in clear: seed a masked table from a snapshot (bootstrap) instead",
                self.config.table,
                masked.join(", ")
            )));
        }
        let instances: serde_json::Value = self
            .client
            .action("capture_instances", &json!({"table": self.config.table}))
            .await?;
        let capture_instance = instances
            .as_array()
            .and_then(|all| all.last())
            .and_then(|newest| newest["name"].as_str())
            .unwrap_or_default()
            .to_string();
        let shape = CopyShape {
            schema,
            capture_instance,
            at,
            allow_missing_columns: options.allow_missing_columns,
        };
        let rows = read_copy(&options.copy).await?;
        shape.check(rows.schema().as_ref())?;
        Ok(OpenCopy { shape, rows })
    }

    /// Appends the copy's rows to bronze as snapshot rows in one commit; returns how many.
    async fn append_copy(&self, copy: OpenCopy, location: &str, txn: &str) -> Result<u64> {
        let OpenCopy { shape, mut rows } = copy;
        let appender = self.snapshot_appender(&shape.schema, shape.at.lsn).await?;
        let mut files = appender.file_writer();
        let mut count = 0u64;
        while let Some(batch) = rows.next().await {
            let batch = batch?;
            count += batch.num_rows() as u64;
            files.write(&shape.snapshot_rows(&batch)?).await?;
        }
        let added = files.close().await?;
        if count > 0 {
            appender
                .commit(
                    added,
                    txn,
                    0,
                    json!({"seed": shape.capture_instance, "lsn": shape.at.lsn, "commit_ts": shape.at.commit_ts, "rows": count, "copy": location})
                        .to_string(),
                )
                .await?;
        }
        Ok(count)
    }
}

/// A copy being read: its rows and how they become snapshot rows.
struct OpenCopy {
    shape: CopyShape,
    rows: deltalake::datafusion::physical_plan::SendableRecordBatchStream,
}

/// The copy's rows, streamed: a Delta table's current version, or Parquet files.
async fn read_copy(
    copy: &str,
) -> Result<deltalake::datafusion::physical_plan::SendableRecordBatchStream> {
    let context = SessionContext::new();
    let url = tables::table_url(copy)?;
    match tables::open(&url).await? {
        Some(table) => {
            context.register_table("copy", table.table_provider().await?)?;
        }
        None => {
            context
                .register_parquet("copy", copy, ParquetReadOptions::default())
                .await?;
        }
    }
    Ok(context
        .sql("SELECT * FROM copy")
        .await?
        .execute_stream()
        .await?)
}

/// How a copy's batch becomes snapshot rows of the stream's schema.
struct CopyShape {
    schema: SchemaRef,
    capture_instance: String,
    at: Offset,
    allow_missing_columns: bool,
}

impl CopyShape {
    fn captured(&self) -> impl Iterator<Item = &arrow::datatypes::FieldRef> {
        self.schema
            .fields()
            .iter()
            .filter(|field| !RESERVED_COLUMN_NAMES.contains(&field.name().as_str()))
    }

    /// Refuses a copy that lacks captured columns (unless allowed), naming them.
    fn check(&self, copy: &arrow::datatypes::Schema) -> Result<()> {
        let missing: Vec<&str> = self
            .captured()
            .filter(|field| copy_column(copy, field.name()).is_none())
            .map(|field| field.name().as_str())
            .collect();
        if missing.is_empty() || self.allow_missing_columns {
            return Ok(());
        }
        Err(WriterError::invalid(format!(
            "the copy lacks captured columns {}; pass allow_missing_columns \
             (--allow-missing-columns) to read them as NULL",
            missing.join(", ")
        )))
    }

    /// `batch` (the copy's) as snapshot rows: the metadata of S = L, each captured column
    /// matched by name ignoring case and cast to the stream's type.
    fn snapshot_rows(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let rows = batch.num_rows();
        let copy_schema = batch.schema();
        let columns = self
            .schema
            .fields()
            .iter()
            .map(|field| -> Result<ArrayRef> {
                Ok(match field.name().as_str() {
                    "_capture_instance" => Arc::new(StringArray::from(vec![
                        self.capture_instance
                            .as_str();
                        rows
                    ])),
                    "_start_lsn" => {
                        Arc::new(StringArray::from(vec![self.at.lsn.to_string(); rows]))
                    }
                    "_operation" => Arc::new(Int32Array::from(vec![0; rows])),
                    "_commit_ts" => cast(
                        &arrow::array::TimestampMicrosecondArray::from(vec![
                            self.at.commit_ts.map(
                                CommitTime::micros
                            );
                            rows
                        ]),
                        field.data_type(),
                    )?,
                    "_seqval" | "_command_id" | "_chunk" => new_null_array(field.data_type(), rows),
                    name => match copy_column(&copy_schema, name) {
                        Some(index) => cast_column(batch.column(index), field.data_type(), name)?,
                        None => new_null_array(field.data_type(), rows),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), columns)?)
    }
}

/// The index of the copy's column named `name`, ignoring case.
fn copy_column(copy: &arrow::datatypes::Schema, name: &str) -> Option<usize> {
    copy.fields()
        .iter()
        .position(|field| field.name().eq_ignore_ascii_case(name))
}

/// A copy's column in the stream's type; a value the type cannot hold is an error naming
/// the column (arrow's safe cast would turn it into NULL).
fn cast_column(column: &ArrayRef, to: &DataType, name: &str) -> Result<ArrayRef> {
    if column.data_type() == to {
        return Ok(Arc::clone(column));
    }
    let options = arrow::compute::CastOptions {
        safe: false,
        ..Default::default()
    };
    arrow::compute::cast_with_options(column, to, &options).map_err(|error| {
        WriterError::invalid(format!(
            "the copy's column {name} ({}) does not fit the stream's {to}: {error}",
            column.data_type()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_of_is_an_lsn_or_a_utc_time() {
        assert_eq!(
            "0x0000002A000000410008".parse::<AsOf>().expect("lsn"),
            AsOf::Lsn("0x0000002A000000410008".parse().expect("lsn"))
        );
        let utc = "2026-11-30T12:00:00".parse::<AsOf>().expect("time");
        assert_eq!(
            "2026-11-30T09:00:00-03:00".parse::<AsOf>().expect("offset"),
            utc
        );
        assert_eq!(
            "2026-11-30 12:00:00.000".parse::<AsOf>().expect("space"),
            utc
        );
        let error = "yesterday".parse::<AsOf>().expect_err("refused");
        assert!(error.to_string().contains("neither an LSN"), "{error}");
    }
}
