//! Tier 2: a bucket compared row by row. The source's rows come through a snapshot chunk
//! read of the bucket's range, silver's from the pinned version; each row of either side is
//! hashed by the **same** function ([`fingerprint`]): every compared column cast to silver's
//! type and written in Arrow's row format (equal values, equal bytes), SHA-256 over them, so
//! SQL Server's own formatting never enters. Keys are joined null-safely (a NULL key is a
//! key like any other) and each difference classified as AWS DMS validation does.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::SchemaRef;
use arrow::row::{RowConverter, SortField};
use deltalake::datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{Bound, GridUnit, KeyValue};
use mssql_cdc_proto::protocol::{CaptureInstanceInfo, ChunkSpec, ServeOptions, SnapshotCommand};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::buckets::{Bucket, quote, units_of};
use super::in_flight::InFlight;
use super::{GridKey, ReconcileConfig, date_text};
use crate::error::{Result, WriterError};

/// How a key differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize)]
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

/// One row's fingerprint: the digest of every compared column, and a short hash of each
/// to name the columns that differ.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RowPrint {
    digest: [u8; 32],
    columns: Vec<u64>,
    start_lsn: Option<String>,
}

/// The captured columns of the newest instance that silver holds, in capture order: what
/// tier 2 compares (a column dropped from either side cannot be).
pub(super) async fn compared_columns(
    instance: &CaptureInstanceInfo,
    context: &SessionContext,
) -> Result<Vec<String>> {
    let silver = context.table("silver").await?.schema().clone();
    Ok(instance
        .columns
        .iter()
        .filter(|column| silver.field_with_unqualified_name(&column.name).is_ok())
        .map(|column| column.name.clone())
        .collect())
}

/// Compares one bucket row by row; returns its key findings.
pub(super) async fn compare_bucket(
    client: &CdcClient,
    config: &ReconcileConfig,
    context: &SessionContext,
    key: &GridKey,
    columns: &[String],
    bucket: &Bucket,
    in_flight: &mut InFlight,
) -> Result<Vec<KeyFinding>> {
    let silver_frame = context
        .sql(&format!(
            "SELECT {}, \"_start_lsn\" FROM silver WHERE {}",
            columns
                .iter()
                .map(|name| quote(name))
                .collect::<Vec<_>>()
                .join(", "),
            range_condition(key, bucket)
        ))
        .await?;
    let silver_schema: SchemaRef = Arc::new(silver_frame.schema().as_arrow().clone());
    let mut silver = HashMap::<Option<i64>, Vec<RowPrint>>::new();
    let mut stream = silver_frame.execute_stream().await?;
    while let Some(batch) = stream.try_next().await? {
        fingerprint(
            &batch,
            columns,
            &silver_schema,
            key,
            Some("_start_lsn"),
            &mut silver,
        )?;
    }
    let mut source = HashMap::<Option<i64>, Vec<RowPrint>>::new();
    let command = SnapshotCommand {
        chunks: Some(vec![ChunkSpec {
            chunk: 0,
            lo: bucket.lo.map(|lo| bound(key, lo)),
            hi: bucket.hi.map(|hi| bound(key, hi)),
        }]),
        keys: Some(vec![key.column.name.clone()]),
        serve: ServeOptions {
            columns: Some(columns.to_vec()),
            include_command_id: Some(false),
            ..ServeOptions::default()
        },
        ..SnapshotCommand::new(config.table.clone())
    };
    let plan = client.plan_snapshot(&command).await?;
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint
            .ticket
            .as_ref()
            .ok_or_else(|| WriterError::Internal("a snapshot endpoint without a ticket".into()))?;
        let mut reader = client.open_endpoint(ticket).await?;
        while let Some(batch) = reader.next_batch().await? {
            fingerprint(&batch, columns, &silver_schema, key, None, &mut source)?;
        }
        // The rows may show commits after the counts: their keys are in flight too.
        if let Some(after_read) = reader.completion()?.max_lsn {
            in_flight.extend_to(client, config, key, after_read).await?;
        }
    }
    Ok(classify(key, columns, source, silver, in_flight))
}

/// The keys of both sides joined, each difference classified.
fn classify(
    key: &GridKey,
    columns: &[String],
    mut source: HashMap<Option<i64>, Vec<RowPrint>>,
    silver: HashMap<Option<i64>, Vec<RowPrint>>,
    in_flight: &InFlight,
) -> Vec<KeyFinding> {
    let mut findings = Vec::new();
    let mut finding = |units: Option<i64>,
                       failure: FailureType,
                       silver_row: Option<&RowPrint>,
                       differ: Vec<String>| {
        let failure = match in_flight.contains(units) {
            true => FailureType::InFlight,
            false => failure,
        };
        findings.push(KeyFinding {
            key: serde_json::json!({ key.column.name.clone(): key.json(units) }),
            failure_type: failure,
            silver_start_lsn: silver_row.and_then(|row| row.start_lsn.clone()),
            columns: differ,
        });
    };
    for (units, mut silver_rows) in silver {
        let Some(mut source_rows) = source.remove(&units) else {
            finding(
                units,
                FailureType::MissingSource,
                silver_rows.first(),
                Vec::new(),
            );
            continue;
        };
        silver_rows.sort_by_key(|row| row.digest);
        source_rows.sort_by_key(|row| row.digest);
        let same = silver_rows.len() == source_rows.len()
            && silver_rows
                .iter()
                .zip(&source_rows)
                .all(|(a, b)| a.digest == b.digest);
        if !same {
            let differ = match (silver_rows.first(), source_rows.first()) {
                (Some(a), Some(b)) => columns
                    .iter()
                    .zip(a.columns.iter().zip(&b.columns))
                    .filter(|(_, (x, y))| x != y)
                    .map(|(name, _)| name.clone())
                    .collect(),
                _ => Vec::new(),
            };
            finding(units, FailureType::RecordDiff, silver_rows.first(), differ);
        }
    }
    for (units, _) in source {
        finding(units, FailureType::MissingTarget, None, Vec::new());
    }
    findings.sort_by_key(|finding| finding.key.to_string());
    findings
}

/// Fingerprints every row of `batch` into `into`, by key.
fn fingerprint(
    batch: &RecordBatch,
    columns: &[String],
    types: &SchemaRef,
    key: &GridKey,
    lsn_column: Option<&str>,
    into: &mut HashMap<Option<i64>, Vec<RowPrint>>,
) -> Result<()> {
    let column = |name: &str| {
        batch
            .column_by_name(name)
            .cloned()
            .ok_or_else(|| WriterError::Internal(format!("the compared rows lack column '{name}'")))
    };
    let mut encoded = Vec::with_capacity(columns.len());
    for name in columns {
        let target = types.field_with_name(name)?.data_type().clone();
        let values: ArrayRef = arrow::compute::cast(&column(name)?, &target)?;
        let converter = RowConverter::new(vec![SortField::new(target)])?;
        encoded.push(converter.convert_columns(&[values])?);
    }
    let keys = units_of(&column(&key.column.name)?, key)?;
    let lsns = match lsn_column {
        Some(name) => Some(
            arrow::compute::cast(&column(name)?, &arrow::datatypes::DataType::Utf8)?
                .as_any()
                .downcast_ref::<StringArray>()
                .cloned()
                .ok_or_else(|| WriterError::Internal("_start_lsn is not text".into()))?,
        ),
        None => None,
    };
    for row in 0..batch.num_rows() {
        let mut digest = Sha256::new();
        let mut hashes = Vec::with_capacity(encoded.len());
        for rows in &encoded {
            let bytes = rows.row(row);
            let bytes = bytes.as_ref();
            digest.update((bytes.len() as u64).to_le_bytes());
            digest.update(bytes);
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut hasher);
            hashes.push(hasher.finish());
        }
        let print = RowPrint {
            digest: digest.finalize().into(),
            columns: hashes,
            start_lsn: lsns
                .as_ref()
                .and_then(|lsns| lsns.is_valid(row).then(|| lsns.value(row).to_string())),
        };
        let units = keys.is_valid(row).then(|| keys.value(row));
        into.entry(units).or_default().push(print);
    }
    Ok(())
}

/// A chunk bound on the key column: the value as the source reads it back.
fn bound(key: &GridKey, units: i64) -> Bound {
    Bound::Keys(vec![match key.unit {
        GridUnit::Integer => KeyValue::Int(units),
        GridUnit::Days => KeyValue::Text(date_text(units)),
    }])
}

/// Silver's rows of the bucket, as a SQL condition (an open `lo` holds the NULL keys).
fn range_condition(key: &GridKey, bucket: &Bucket) -> String {
    let column = quote(&key.column.name);
    let literal = |units: i64| match key.unit {
        GridUnit::Integer => units.to_string(),
        GridUnit::Days => format!("CAST('{}' AS DATE)", date_text(units)),
    };
    let mut conditions = Vec::new();
    if let Some(lo) = bucket.lo {
        conditions.push(format!("{column} >= {}", literal(lo)));
    }
    if let Some(hi) = bucket.hi {
        conditions.push(match bucket.lo {
            Some(_) => format!("{column} < {}", literal(hi)),
            None => format!("({column} < {} OR {column} IS NULL)", literal(hi)),
        });
    }
    match conditions.is_empty() {
        true => "TRUE".into(),
        false => conditions.join(" AND "),
    }
}
