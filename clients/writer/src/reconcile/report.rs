//! The report table: one row per bucket, one per key finding and one per chunk finding of
//! a run, all sharing its `run_id` (the seed's three row kinds sharing columns).

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Decimal128Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use mssql_cdc_proto::CommitTime;
use mssql_cdc_proto::keys::Bound;

use super::ReconcileResult;
use super::key::CompareKey;
use super::rows::KeyFinding;
use crate::error::Result;
use crate::facts;
use crate::tables::{self, TableKind};

/// The columns that differ between the row kinds (the others are the run's).
#[derive(Default)]
struct Row {
    source_lsn: Option<String>,
    bucket_lo: Option<String>,
    bucket_hi: Option<String>,
    source_rows: Option<i64>,
    source_key_sum: Option<i128>,
    silver_rows: Option<i64>,
    silver_key_sum: Option<i128>,
    source_key_hash_sum: Option<i128>,
    silver_key_hash_sum: Option<i128>,
    status: Option<String>,
    hashed: Option<bool>,
    key: Option<String>,
    failure_type: Option<String>,
    detail: Option<String>,
}

/// The run's rows: buckets, then key findings (both at the source LSN), then chunk
/// findings (no source LSN: they read only the lake).
fn rows(result: &ReconcileResult, key: &CompareKey, findings: &[KeyFinding]) -> Vec<Row> {
    let source_lsn = Some(result.source_lsn.to_string());
    // A grid bound as its key value (a date as text); a keyset bound as the source's tuple.
    let bound = |bound: &Option<Bound>| match (bound, key) {
        (None, _) => None,
        (Some(Bound::Int(units)), CompareKey::Grid(grid)) => {
            Some(grid.json(Some(*units)).to_string())
        }
        (Some(bound), _) => serde_json::to_string(bound).ok(),
    };
    let sum = |sum: i128| result.key_sums.then_some(sum);
    let hash_sum = |sum: i128| result.key_hash_sums.then_some(sum);
    let buckets = result.bucket_list.iter().map(|bucket| Row {
        source_lsn: source_lsn.clone(),
        bucket_lo: bound(&bucket.lo),
        bucket_hi: bound(&bucket.hi),
        source_rows: Some(bucket.source.rows as i64),
        source_key_sum: sum(bucket.source.key_sum),
        silver_rows: Some(bucket.silver.rows as i64),
        silver_key_sum: sum(bucket.silver.key_sum),
        source_key_hash_sum: hash_sum(bucket.source.key_hash_sum),
        silver_key_hash_sum: hash_sum(bucket.silver.key_hash_sum),
        status: Some(bucket.status.name().to_string()),
        hashed: Some(bucket.hashed),
        ..Row::default()
    });
    let keys = findings.iter().map(|finding| Row {
        source_lsn: source_lsn.clone(),
        key: Some(finding.key.to_string()),
        failure_type: Some(finding.failure_type.name().to_string()),
        detail: Some(
            serde_json::json!({
                "silver_start_lsn": finding.silver_start_lsn,
                "columns": finding.columns,
            })
            .to_string(),
        ),
        ..Row::default()
    });
    let chunks = result.chunk_findings.iter().map(|finding| Row {
        failure_type: Some(finding.check.name().to_string()),
        detail: Some(
            serde_json::json!({
                "snapshot": finding.snapshot,
                "chunk": finding.chunk,
                "finding": finding.finding,
            })
            .to_string(),
        ),
        ..Row::default()
    });
    buckets.chain(keys).chain(chunks).collect()
}

/// Appends the run's rows to the report table at `location` (created when missing), in one
/// commit.
pub(super) async fn write(
    location: &str,
    result: &ReconcileResult,
    key: &CompareKey,
    findings: &[KeyFinding],
    run_at: CommitTime,
) -> Result<()> {
    let rows = rows(result, key, findings);
    let count = rows.len();
    let text = |pick: fn(&Row) -> Option<String>| {
        Arc::new(rows.iter().map(pick).collect::<StringArray>()) as ArrayRef
    };
    let long = |pick: fn(&Row) -> Option<i64>| {
        Arc::new(rows.iter().map(pick).collect::<Int64Array>()) as ArrayRef
    };
    let sum = |pick: fn(&Row) -> Option<i128>| -> Result<ArrayRef> {
        let values: Decimal128Array = rows.iter().map(pick).collect();
        Ok(Arc::new(values.with_precision_and_scale(38, 0)?))
    };
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec![result.run_id.as_str(); count])),
        Arc::new(TimestampMicrosecondArray::from(vec![run_at.0; count])),
        Arc::new(StringArray::from(vec![result.silver.as_str(); count])),
        Arc::new(Int64Array::from(vec![result.silver_version; count])),
        Arc::new(StringArray::from(vec![
            result.silver_lsn.to_string();
            count
        ])),
        text(|row| row.source_lsn.clone()),
        text(|row| row.bucket_lo.clone()),
        text(|row| row.bucket_hi.clone()),
        long(|row| row.source_rows),
        sum(|row| row.source_key_sum)?,
        long(|row| row.silver_rows),
        sum(|row| row.silver_key_sum)?,
        text(|row| row.status.clone()),
        Arc::new(rows.iter().map(|row| row.hashed).collect::<BooleanArray>()),
        text(|row| row.key.clone()),
        text(|row| row.failure_type.clone()),
        text(|row| row.detail.clone()),
        sum(|row| row.source_key_hash_sum)?,
        sum(|row| row.silver_key_hash_sum)?,
    ];
    let batch = RecordBatch::try_new(facts::arrow_schema(TableKind::Reconcile), columns)?;
    tables::append_once(
        &tables::table_url(location)?,
        TableKind::Reconcile,
        "reconcile",
        &format!("reconcile#{}", result.run_id),
        0,
        batch,
    )
    .await?;
    Ok(())
}
