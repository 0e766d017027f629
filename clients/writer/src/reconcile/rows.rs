//! Tier 2: a bucket compared row by row. The source's rows come through a snapshot chunk
//! read of the bucket's range, silver's from the pinned version; each row of either side is
//! hashed by the **same** function ([`fingerprint`]): every compared column cast to silver's
//! type and written in Arrow's row format (equal values, equal bytes), a 128-bit XXH3 digest
//! over them, so SQL Server's own formatting never enters. Keys are joined null-safely (a NULL key is a
//! key like any other) and each difference classified as AWS DMS validation does.

use std::cmp::Ordering;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::row::{RowConverter, Rows, SortField};
use deltalake::datafusion::common::hash_utils::{RandomState, create_hashes};
use deltalake::datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{Bound, GridUnit, KeyValue};
use mssql_cdc_proto::protocol::{CaptureInstanceInfo, ChunkSpec, ServeOptions, SnapshotCommand};
use mssql_cdc_proto::selection::ColumnSelection;
use serde::{Deserialize, Serialize};
use twox_hash::XxHash3_128;

use super::buckets::Bucket;
use super::in_flight::InFlight;
use super::key::{CompareKey, GridKey, RowKey};
use super::{ReconcileConfig, date_text};
use crate::error::{Result, WriterError};
use crate::tables;

/// How a key differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FailureType {
    /// In the source, not in silver.
    MissingTarget,
    /// In silver, not in the source.
    MissingSource,
    /// In both, with different captured columns.
    RecordDiff,
    /// Different, with a change of the key newer than the compared LSN.
    InFlight,
}

impl FailureType {
    /// Every type, in report order.
    pub const ALL: [FailureType; 4] = [
        FailureType::MissingTarget,
        FailureType::MissingSource,
        FailureType::RecordDiff,
        FailureType::InFlight,
    ];

    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            FailureType::MissingTarget => "MISSING_TARGET",
            FailureType::MissingSource => "MISSING_SOURCE",
            FailureType::RecordDiff => "RECORD_DIFF",
            FailureType::InFlight => "IN_FLIGHT",
        }
    }
}

/// One key found different.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyFinding {
    /// The key as a JSON object (`{"order_id": 17}`, a NULL key as `null`).
    pub key: serde_json::Value,
    /// How it differs.
    pub failure_type: FailureType,
    /// Silver's `_start_lsn` of the row, when silver has it.
    pub silver_start_lsn: Option<String>,
    /// The compared columns that differ (RECORD_DIFF; empty otherwise).
    pub columns: Vec<String>,
}

/// The fingerprints of one side's rows of a bucket, one entry per row, sorted by key and
/// digest for the merge join: flat vectors, so a bucket of a million rows costs a few
/// allocations, not millions. On a grid key, a bucket's prints are [`Prints::reuse`]d for
/// the next one ([`Sides`]), so their memory is written again rather than faulted in afresh.
#[derive(Default)]
pub(super) struct Prints {
    /// `(key, digest, row)`: the row indexes `columns` and `lsns`.
    rows: Vec<(RowKey, u128, u32)>,
    /// A short hash of each compared column, `width` a row: names the columns that differ.
    columns: Vec<u32>,
    /// The compared columns' count: the short hashes of a row.
    width: usize,
    /// Silver's `_start_lsn` column, batch by batch with the number of its first row (empty
    /// on the source side): parsed only for the rows a finding names.
    lsns: Vec<(u32, ArrayRef)>,
    /// The row-format converter of the compared columns and its buffers, reused batch after
    /// batch.
    encoder: Option<Encoder>,
}

/// One row-format converter of all compared columns, its rows and a column's hashes.
struct Encoder {
    converter: RowConverter,
    rows: Rows,
    hashes: Vec<u64>,
}

impl Prints {
    /// Empty, with room for the `rows` a side of a bucket was counted to hold: a million
    /// rows are written in place, not into vectors that double, copy and fault in fresh
    /// pages as they grow.
    pub(super) fn expecting(rows: u64, hashing: &Hashing) -> Self {
        Prints::default().reuse(rows, hashing)
    }

    /// These prints emptied for a side of `rows` rows, keeping their memory and encoder.
    pub(super) fn reuse(mut self, rows: u64, hashing: &Hashing) -> Self {
        let rows = usize::try_from(rows.min(u64::from(u32::MAX))).unwrap_or(0);
        let width = hashing.columns.len();
        self.rows.clear();
        self.rows.reserve(rows);
        self.columns.clear();
        self.columns.reserve(rows.saturating_mul(width));
        self.width = width;
        self.lsns.clear();
        self
    }

    fn column_hashes(&self, row: u32) -> &[u32] {
        let start = row as usize * self.width;
        &self.columns[start..start + self.width]
    }

    /// Silver's `_start_lsn` of `row` (None on the source side or when NULL).
    fn lsn(&self, row: u32) -> Option<Lsn> {
        let batch = self.lsns.partition_point(|(first, _)| *first <= row);
        let (first, lsns) = self.lsns.get(batch.checked_sub(1)?)?;
        let at = (row - first) as usize;
        if lsns.is_null(at) {
            return None;
        }
        arrow::util::display::array_value_to_string(lsns, at)
            .ok()?
            .parse()
            .ok()
    }

    /// Each row's key and silver `_start_lsn`, in key order once sorted.
    pub(super) fn keys(&self) -> impl Iterator<Item = (&RowKey, Option<Lsn>)> + '_ {
        self.rows.iter().map(|(key, _, row)| (key, self.lsn(*row)))
    }

    /// Sorts the rows by key and digest, for [`classify`]. The rows arrive as runs already
    /// in key order (a chunk's batches, silver's files), which the stable sort merges
    /// instead of partitioning them afresh as the unstable one does.
    pub(super) fn sort(&mut self) {
        self.rows.sort();
    }
}

/// Both sides' prints of the bucket compared last, kept for the next.
#[derive(Default)]
pub(super) struct Sides {
    source: Prints,
    silver: Prints,
}

/// The captured columns of the newest instance that the stream selects and silver holds,
/// in capture order: what tier 2 compares (a column dropped from either side cannot be; one
/// the selection leaves out is never asked of the server).
pub(super) async fn compared_columns(
    instance: &CaptureInstanceInfo,
    selection: &ColumnSelection,
    context: &SessionContext,
) -> Result<Vec<String>> {
    let silver = context.table("silver").await?.schema().clone();
    Ok(instance
        .columns
        .iter()
        .filter(|column| !selection.excludes(&column.name))
        .filter(|column| silver.field_with_unqualified_name(&column.name).is_ok())
        .map(|column| column.name.clone())
        .collect())
}

/// What tier 2 hashes: the compared columns in silver's types, and the key.
#[derive(Clone)]
pub(super) struct Hashing {
    pub(super) key: CompareKey,
    pub(super) columns: Vec<String>,
    /// Captured columns of the newest instance silver does not hold (but those the stream
    /// leaves out), or holds but the stream leaves out: never compared, so the values are
    /// not verified.
    pub(super) uncompared: Vec<String>,
    /// Captured columns of the newest instance the stream's selection leaves out and silver
    /// does not hold: not copied, so not compared, and no part of what is verified.
    pub(super) excluded: Vec<String>,
    /// The compared columns the server serves masked (`capture_instances` says so): it
    /// digests no masked value at the source, so they are compared row by row only.
    pub(super) masked: Vec<String>,
    /// The compared columns the value sums cover: `columns` but the masked ones.
    pub(super) summed: Vec<String>,
    /// Silver's schema of `columns`: both sides are cast to it.
    pub(super) types: SchemaRef,
    /// Whether silver holds every compared column in the type the server serves it as (up
    /// to string and binary views and a timestamp's zone): the cast to `types` then changes
    /// no value, and rows equal here are equal as served.
    pub(super) exact: bool,
    /// Whether the value sums can cover the summed columns: each of silver's types has a
    /// canonical text ([`mssql_cdc_proto::digest::supports`]) and they are few enough for
    /// one call.
    pub(super) digestible: bool,
}

impl Hashing {
    /// The compared columns of silver, with its types.
    pub(super) async fn new(
        key: &CompareKey,
        instance: &CaptureInstanceInfo,
        selection: &ColumnSelection,
        context: &SessionContext,
    ) -> Result<Self> {
        let columns = compared_columns(instance, selection, context).await?;
        let silver = context.table("silver").await?;
        let schema = silver.schema().as_arrow();
        let fields: Vec<arrow::datatypes::FieldRef> = columns
            .iter()
            .map(|name| Ok(Arc::new(schema.field_with_name(name)?.clone())))
            .collect::<Result<_>>()?;
        // A column left out is no part of what is verified, unless silver still holds it
        // (copied before the selection changed): its values there are then unchecked.
        let (excluded, uncompared) = instance
            .columns
            .iter()
            .filter(|column| !columns.contains(&column.name))
            .map(|column| column.name.clone())
            .partition(|name| selection.excludes(name) && schema.field_with_name(name).is_err());
        // Served as: a masked column in its mask's type (a hash is text).
        let served_type = |column: &mssql_cdc_proto::catalog::CapturedColumn| match instance
            .masks
            .get(&column.name)
        {
            Some(mask) => mask
                .parse::<mssql_cdc_proto::masking::Mask>()
                .ok()
                .and_then(|mask| mask.served_type(&column.sql_type).ok()),
            None => Some(column.sql_type.clone()),
        };
        let exact = fields.iter().all(|field| {
            instance
                .columns
                .iter()
                .find(|column| &column.name == field.name())
                .and_then(served_type)
                .and_then(|served| served.arrow_type())
                .is_some_and(|served| same_values(&served, field.data_type()))
        });
        let (masked, summed): (Vec<String>, Vec<String>) = columns
            .iter()
            .cloned()
            .partition(|name| instance.masks.contains_key(name));
        let digestible = summed.len() <= mssql_cdc_proto::protocol::MAX_DIGEST_COLUMNS
            && fields
                .iter()
                .filter(|field| summed.contains(field.name()))
                .all(|field| mssql_cdc_proto::digest::supports(field.data_type()));
        Ok(Hashing {
            key: key.clone(),
            columns,
            uncompared,
            excluded,
            masked,
            summed,
            types: Arc::new(arrow::datatypes::Schema::new(fields)),
            exact,
            digestible,
        })
    }

    /// `SELECT` of the compared columns and `_start_lsn` from silver.
    pub(super) fn silver_select(&self) -> String {
        format!(
            "SELECT {}, \"_start_lsn\" FROM silver",
            tables::quote_columns(&self.columns)
        )
    }

    /// Fingerprints silver's rows in `batch` into `into`.
    pub(super) fn silver_batch(&self, batch: &RecordBatch, into: &mut Prints) -> Result<()> {
        fingerprint(batch, self, Some("_start_lsn"), into)
    }

    /// Reads the source's rows of `command` (a chunked snapshot of the compared columns, its
    /// chunks read side by side) and fingerprints them into `prints` (readied for tier 1's
    /// count) on a task of their own, so decoding the next batch overlaps hashing this one;
    /// with the latest `max_lsn` the reads' completion markers carry.
    pub(super) async fn source_prints(
        &self,
        client: &CdcClient,
        command: &SnapshotCommand,
        mut prints: Prints,
    ) -> Result<(Prints, Option<Lsn>)> {
        let (batches, mut arriving) = tokio::sync::mpsc::channel::<RecordBatch>(4);
        let hashing = {
            let hashing = self.clone();
            tokio::spawn(async move {
                while let Some(batch) = arriving.recv().await {
                    fingerprint(&batch, &hashing, None, &mut prints)?;
                }
                prints.sort();
                Ok::<_, WriterError>(prints)
            })
        };
        let plan = client.plan_snapshot(command).await?;
        let reads = plan.info.endpoint.iter().map(|endpoint| {
            let batches = batches.clone();
            async move {
                let mut reader = client
                    .open_endpoint(super::ticket(endpoint, "snapshot")?)
                    .await?;
                while let Some(batch) = reader.next_batch().await? {
                    if batches.send(batch).await.is_err() {
                        return Ok(None); // the hashing task failed: its error is returned below
                    }
                }
                Ok::<_, WriterError>(reader.completion()?.max_lsn)
            }
        });
        let after_read = futures::future::try_join_all(reads)
            .await?
            .into_iter()
            .flatten()
            .max();
        drop(batches);
        let prints = hashing.await.map_err(joined)??;
        Ok((prints, after_read))
    }

    /// The snapshot command reading `chunks` of the compared columns.
    pub(super) fn command(
        &self,
        table: &str,
        chunks: Vec<ChunkSpec>,
        keys: Option<Vec<String>>,
    ) -> SnapshotCommand {
        SnapshotCommand {
            chunks: Some(chunks),
            keys,
            serve: ServeOptions {
                columns: Some(self.columns.clone()),
                include_command_id: Some(false),
                ..ServeOptions::default()
            },
            ..SnapshotCommand::new(table)
        }
    }

    /// The keys of both sides joined and classified, after the keys in flight are read up to
    /// `after_read` (the rows may show commits after the counts: their keys are in flight).
    pub(super) async fn differences(
        &self,
        client: &CdcClient,
        config: &ReconcileConfig,
        (source, silver): (&Prints, &Prints),
        after_read: Option<Lsn>,
        in_flight: &mut InFlight,
    ) -> Result<Vec<KeyFinding>> {
        if let Some(after_read) = after_read {
            in_flight
                .extend_to(client, config, &self.key, after_read)
                .await?;
        }
        Ok(classify(self, source, silver, in_flight))
    }
}

fn joined(error: tokio::task::JoinError) -> WriterError {
    WriterError::Internal(format!("a row digest task failed: {error}"))
}

/// Compares one bucket of a grid key row by row, in the memory of `sides`; returns its key
/// findings. Silver's rows are read and hashed on a task of their own while the source's
/// arrive over Flight.
pub(super) async fn compare_grid_bucket(
    client: &CdcClient,
    config: &ReconcileConfig,
    context: &SessionContext,
    (hashing, grid): (&Hashing, &GridKey),
    bucket: &Bucket,
    (in_flight, sides): (&mut InFlight, &mut Sides),
) -> Result<Vec<KeyFinding>> {
    let silver_frame = context
        .sql(&format!(
            "{} WHERE {}",
            hashing.silver_select(),
            range_condition(grid, bucket)
        ))
        .await?;
    let silver_side = {
        let hashing = hashing.clone();
        let mut prints = std::mem::take(&mut sides.silver).reuse(bucket.silver.rows, &hashing);
        tokio::spawn(async move {
            let mut stream = silver_frame.execute_stream().await?;
            while let Some(batch) = stream.try_next().await? {
                hashing.silver_batch(&batch, &mut prints)?;
            }
            prints.sort();
            Ok::<_, WriterError>(prints)
        })
    };
    // The bucket in two chunks read side by side when it has a middle, as a snapshot's
    // partitions are.
    let cuts: Vec<Option<i64>> = std::iter::once(bucket.lo_units())
        .chain(bucket.split.map(Some))
        .chain(std::iter::once(bucket.hi_units()))
        .collect();
    let chunks = cuts
        .windows(2)
        .enumerate()
        .map(|(number, pair)| ChunkSpec {
            chunk: number as i32,
            lo: pair[0].map(|lo| bound(grid, lo)),
            hi: pair[1].map(|hi| bound(grid, hi)),
        })
        .collect();
    // The table's own integer key reads as an integer range (an index seek); any other
    // column as a keyset range on it.
    let keys = (!grid.is_unique_integer()).then(|| vec![grid.column.name.clone()]);
    let started = std::time::Instant::now();
    let (source, after_read) = hashing
        .source_prints(
            client,
            &hashing.command(&config.table, chunks, keys),
            std::mem::take(&mut sides.source).reuse(bucket.source.rows, hashing),
        )
        .await?;
    let read_seconds = started.elapsed().as_secs_f64();
    let silver = silver_side.await.map_err(joined)??;
    tracing::debug!(
        read_seconds,
        hashed_seconds = started.elapsed().as_secs_f64(),
        source_rows = source.rows.len(),
        silver_rows = silver.rows.len(),
        "reconcile: a bucket's rows read and hashed"
    );
    let found = hashing
        .differences(client, config, (&source, &silver), after_read, in_flight)
        .await;
    *sides = Sides { source, silver };
    found
}

/// The keys of both sides joined (both sorted by key, then digest), each difference
/// classified; the rows of one key compare as a multiset.
fn classify(
    hashing: &Hashing,
    source: &Prints,
    silver: &Prints,
    in_flight: &InFlight,
) -> Vec<KeyFinding> {
    let mut findings = Vec::new();
    let (mut at_source, mut at_silver) = (0, 0);
    let run = |prints: &Prints, from: usize| {
        let key = &prints.rows[from].0;
        prints.rows[from..]
            .iter()
            .take_while(|row| &row.0 == key)
            .count()
    };
    loop {
        let next_source = source.rows.get(at_source).map(|row| &row.0);
        let next_silver = silver.rows.get(at_silver).map(|row| &row.0);
        let order = match (next_source, next_silver) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(ours), Some(theirs)) => ours.cmp(theirs),
        };
        let (key, failure, silver_row, differ) = match order {
            Ordering::Less => {
                let key = &source.rows[at_source].0;
                at_source += run(source, at_source);
                (key, FailureType::MissingTarget, None, Vec::new())
            }
            Ordering::Greater => {
                let (key, _, row) = &silver.rows[at_silver];
                at_silver += run(silver, at_silver);
                (key, FailureType::MissingSource, Some(*row), Vec::new())
            }
            Ordering::Equal => {
                let key = &source.rows[at_source].0;
                let (source_run, silver_run) = (run(source, at_source), run(silver, at_silver));
                let ours = &source.rows[at_source..at_source + source_run];
                let theirs = &silver.rows[at_silver..at_silver + silver_run];
                at_source += source_run;
                at_silver += silver_run;
                let same =
                    ours.len() == theirs.len() && ours.iter().zip(theirs).all(|(a, b)| a.1 == b.1);
                if same {
                    continue;
                }
                let (a, b) = (
                    source.column_hashes(ours[0].2),
                    silver.column_hashes(theirs[0].2),
                );
                let differ = hashing
                    .columns
                    .iter()
                    .zip(a.iter().zip(b))
                    .filter(|(_, (x, y))| x != y)
                    .map(|(name, _)| name.clone())
                    .collect();
                (key, FailureType::RecordDiff, Some(theirs[0].2), differ)
            }
        };
        findings.push(KeyFinding {
            key: hashing.key.json(key),
            failure_type: in_flight.failure(key, failure),
            silver_start_lsn: silver_row
                .and_then(|row| silver.lsn(row))
                .map(|lsn| lsn.to_string()),
            columns: differ,
        });
    }
    findings
}

/// Whether values served as `served` keep every value in `silver`'s type: the same type,
/// a string or binary type and its view, or microsecond timestamps of any zone.
fn same_values(served: &DataType, silver: &DataType) -> bool {
    use DataType as T;
    let family = |data_type: &DataType| match data_type {
        T::Utf8 | T::LargeUtf8 | T::Utf8View => Some(0),
        T::Binary | T::LargeBinary | T::BinaryView => Some(1),
        T::Timestamp(arrow::datatypes::TimeUnit::Microsecond, _) => Some(2),
        _ => None,
    };
    served == silver || family(served).is_some_and(|family_of| family(silver) == Some(family_of))
}

/// Seeds the short column hashes of both sides alike.
const SHORT_HASH: RandomState = RandomState::with_seed(0x51_7c_c1_b7_27_22_0a_95);

/// Fingerprints every row of `batch` into `into`: the compared columns cast to silver's
/// types (`types`) and written in Arrow's row format as one row (equal values, equal bytes;
/// the format decodes, so different rows never share bytes), XXH3-128 over those bytes where
/// they lie; and a short hash of each column (DataFusion's vectorized `create_hashes`).
fn fingerprint(
    batch: &RecordBatch,
    hashing: &Hashing,
    lsn_column: Option<&str>,
    into: &mut Prints,
) -> Result<()> {
    let column = |name: &str| {
        batch
            .column_by_name(name)
            .cloned()
            .ok_or_else(|| WriterError::Internal(format!("the compared rows lack column '{name}'")))
    };
    let values: Vec<ArrayRef> = hashing
        .types
        .fields()
        .iter()
        .map(|field| {
            Ok(arrow::compute::cast(
                &column(field.name())?,
                field.data_type(),
            )?)
        })
        .collect::<Result<_>>()?;
    let count = batch.num_rows();
    let encoder = match &mut into.encoder {
        Some(encoder) => encoder,
        None => {
            let fields = hashing.types.fields().iter();
            let converter = RowConverter::new(
                fields
                    .map(|field| SortField::new(field.data_type().clone()))
                    .collect(),
            )?;
            let rows = converter.empty_rows(count, count * 64);
            into.encoder.insert(Encoder {
                converter,
                rows,
                hashes: Vec::new(),
            })
        }
    };
    encoder.rows.clear();
    encoder.converter.append(&mut encoder.rows, &values)?;

    // The short hashes, row by row: `width` a row, one column at a time.
    let width = into.width;
    let first = into.columns.len();
    into.columns.resize(first + count * width, 0);
    let block = &mut into.columns[first..];
    for (index, values) in values.iter().enumerate() {
        encoder.hashes.clear();
        encoder.hashes.resize(count, 0);
        create_hashes([values], &SHORT_HASH, &mut encoder.hashes)?;
        for (row, hash) in encoder.hashes.iter().enumerate() {
            block[row * width + index] = (hash ^ (hash >> 32)) as u32;
        }
    }

    let start = u32::try_from(into.rows.len() + count)
        .map_err(|_| WriterError::invalid("a bucket holds more than 4 billion rows"))?
        - count as u32;
    if let Some(name) = lsn_column {
        into.lsns.push((start, column(name)?));
    }
    let keys = hashing.key.row_keys(batch)?;
    into.rows
        .extend(keys.into_iter().enumerate().map(|(row, key)| {
            let digest = XxHash3_128::oneshot(encoder.rows.row(row).as_ref());
            (key, digest, start + row as u32)
        }));
    Ok(())
}

/// A chunk bound on a grid key's column: the value as the source reads it back.
fn bound(key: &GridKey, units: i64) -> Bound {
    if key.is_unique_integer() {
        return Bound::Int(units);
    }
    Bound::Keys(vec![match key.unit {
        GridUnit::Integer => KeyValue::Int(units),
        GridUnit::Days => KeyValue::Text(date_text(units)),
    }])
}

/// Silver's rows of the bucket, as a SQL condition (an open `lo` holds the NULL keys).
fn range_condition(key: &GridKey, bucket: &Bucket) -> String {
    let column = tables::quote_identifier(&key.column.name);
    let (lo, hi) = (bucket.lo_units(), bucket.hi_units());
    let literal = |units: i64| match key.unit {
        GridUnit::Integer => units.to_string(),
        GridUnit::Days => format!("CAST('{}' AS DATE)", date_text(units)),
    };
    let mut conditions = Vec::new();
    if let Some(lo) = lo {
        conditions.push(format!("{column} >= {}", literal(lo)));
    }
    if let Some(hi) = hi {
        conditions.push(match lo {
            Some(_) => format!("{column} < {}", literal(hi)),
            None => format!("({column} < {} OR {column} IS NULL)", literal(hi)),
        });
    }
    match conditions.is_empty() {
        true => "TRUE".into(),
        false => conditions.join(" AND "),
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Float64Array, Int32Array, Int64Array, StringArray, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use mssql_cdc_proto::types::SqlType;

    use super::*;
    use mssql_cdc_proto::keys::KeyColumn;

    /// Compares `id` (the grid key), `name` and `score` in silver's types: Int64, Utf8View
    /// and Float64.
    fn hashing() -> Hashing {
        Hashing {
            key: CompareKey::Grid(GridKey {
                column: KeyColumn {
                    name: "id".into(),
                    sql_type: SqlType::BigInt,
                },
                unit: GridUnit::Integer,
                unique: true,
            }),
            columns: vec!["id".into(), "name".into(), "score".into()],
            uncompared: Vec::new(),
            excluded: Vec::new(),
            masked: Vec::new(),
            summed: vec!["id".into(), "name".into(), "score".into()],
            types: Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("name", DataType::Utf8View, true),
                Field::new("score", DataType::Float64, true),
            ])),
            // The source serves `id` as Int32: not silver's type.
            exact: false,
            digestible: true,
        }
    }

    /// The source's rows as the server serves them: `id` as Int32, `name` as Utf8.
    fn source(ids: &[i32], names: &[Option<&str>], scores: &[Option<f64>]) -> RecordBatch {
        RecordBatch::try_from_iter([
            ("id", Arc::new(Int32Array::from(ids.to_vec())) as ArrayRef),
            ("name", Arc::new(StringArray::from(names.to_vec()))),
            ("score", Arc::new(Float64Array::from(scores.to_vec()))),
        ])
        .expect("a batch")
    }

    /// Silver's rows in its own types, with `_start_lsn`.
    fn silver(ids: &[i64], names: &[Option<&str>], scores: &[Option<f64>]) -> RecordBatch {
        let lsn = "0x0000002A000000010003";
        RecordBatch::try_from_iter([
            ("id", Arc::new(Int64Array::from(ids.to_vec())) as ArrayRef),
            ("name", Arc::new(StringViewArray::from(names.to_vec()))),
            ("score", Arc::new(Float64Array::from(scores.to_vec()))),
            (
                "_start_lsn",
                Arc::new(StringViewArray::from(vec![lsn; ids.len()])),
            ),
        ])
        .expect("a batch")
    }

    fn prints(batches: &[RecordBatch], lsn: Option<&str>) -> Prints {
        let hashing = hashing();
        let mut prints = Prints::expecting(4, &hashing);
        for batch in batches {
            fingerprint(batch, &hashing, lsn, &mut prints).expect("fingerprinted");
        }
        prints.sort();
        prints
    }

    fn findings(
        source: &Prints,
        silver: &Prints,
    ) -> Vec<(serde_json::Value, FailureType, Vec<String>)> {
        classify(&hashing(), source, silver, &InFlight::none())
            .into_iter()
            .map(|finding| (finding.key, finding.failure_type, finding.columns))
            .collect()
    }

    #[test]
    fn equal_values_in_other_types_and_batches_match_and_each_difference_names_its_column() {
        let names = [Some("ann"), None, Some("")];
        let scores = [Some(1.5), Some(-0.0), None];
        let ours = prints(&[source(&[1, 2, 3], &names, &scores)], None);
        // Silver's rows in two batches, in another order.
        let theirs = prints(
            &[
                silver(&[3], &[Some("")], &[None]),
                silver(&[1, 2], &[Some("ann"), None], &[Some(1.5), Some(-0.0)]),
            ],
            Some("_start_lsn"),
        );
        assert!(findings(&ours, &theirs).is_empty());
        assert_eq!(
            theirs.keys().map(|(_, lsn)| lsn).collect::<Vec<_>>(),
            vec![Some("0x0000002A000000010003".parse().expect("an LSN")); 3]
        );

        // A NULL for an empty string, a value changed, a row added, a row missing.
        let theirs = prints(
            &[silver(
                &[1, 2, 4],
                &[Some("ann"), Some(""), Some("x")],
                &[Some(2.5), Some(-0.0), None],
            )],
            Some("_start_lsn"),
        );
        assert_eq!(
            findings(&ours, &theirs),
            vec![
                (
                    serde_json::json!({"id": 1}),
                    FailureType::RecordDiff,
                    vec!["score".to_string()]
                ),
                (
                    serde_json::json!({"id": 2}),
                    FailureType::RecordDiff,
                    vec!["name".to_string()]
                ),
                (
                    serde_json::json!({"id": 3}),
                    FailureType::MissingTarget,
                    vec![]
                ),
                (
                    serde_json::json!({"id": 4}),
                    FailureType::MissingSource,
                    vec![]
                ),
            ]
        );
    }

    #[test]
    fn reused_prints_forget_the_last_bucket() {
        let hashing = hashing();
        let mut reused = prints(
            &[silver(&[7, 8], &[None, None], &[None, None])],
            Some("_start_lsn"),
        );
        reused = reused.reuse(1, &hashing);
        fingerprint(
            &source(&[1], &[Some("a")], &[None]),
            &hashing,
            None,
            &mut reused,
        )
        .expect("fingerprinted");
        reused.sort();
        let fresh = prints(&[source(&[1], &[Some("a")], &[None])], None);
        assert!(findings(&fresh, &reused).is_empty());
        assert_eq!(
            reused.keys().map(|(_, lsn)| lsn).collect::<Vec<_>>(),
            vec![None]
        );
    }
}
