//! The report table: one row per bucket and one per key finding of a run, all sharing its
//! `run_id` (the seed's three row kinds; chunk rows come with the chunk checks).

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Decimal128Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use mssql_cdc_proto::CommitTime;

use super::rows::KeyFinding;
use super::{GridKey, ReconcileResult};
use crate::error::Result;
use crate::facts;
use crate::tables::{self, TableKind};

/// Appends the run's rows to the report table at `location` (created when missing).
pub(super) async fn write(
    location: &str,
    result: &ReconcileResult,
    key: &GridKey,
    findings: &[KeyFinding],
    run_at: CommitTime,
) -> Result<()> {
    let buckets = &result.bucket_list;
    let rows = buckets.len() + findings.len();
    let repeat = |value: &str| Arc::new(StringArray::from(vec![value; rows])) as ArrayRef;
    let bound = |units: Option<i64>| units.map(|units| key.json(Some(units)).to_string());
    let on_buckets = |values: Vec<Option<String>>| {
        let mut values = values;
        values.resize(rows, None);
        Arc::new(StringArray::from(values)) as ArrayRef
    };
    let counts = |pick: &dyn Fn(&super::Bucket) -> i64| {
        let mut values: Vec<Option<i64>> = buckets.iter().map(|b| Some(pick(b))).collect();
        values.resize(rows, None);
        Arc::new(Int64Array::from(values)) as ArrayRef
    };
    let sums = |pick: &dyn Fn(&super::Bucket) -> i128| -> Result<ArrayRef> {
        let mut values: Vec<Option<i128>> = buckets.iter().map(|b| Some(pick(b))).collect();
        values.resize(rows, None);
        Ok(Arc::new(
            Decimal128Array::from(values).with_precision_and_scale(38, 0)?,
        ))
    };
    let on_findings = |values: Vec<Option<String>>| {
        let mut all = vec![None; buckets.len()];
        all.extend(values);
        Arc::new(StringArray::from(all)) as ArrayRef
    };
    let mut hashed: Vec<Option<bool>> = buckets.iter().map(|b| Some(b.hashed)).collect();
    hashed.resize(rows, None);
    let columns: Vec<ArrayRef> = vec![
        repeat(&result.run_id),
        Arc::new(TimestampMicrosecondArray::from(vec![run_at.0; rows])),
        repeat(&result.silver),
        Arc::new(Int64Array::from(vec![result.silver_version; rows])),
        repeat(&result.silver_lsn.to_string()),
        repeat(&result.source_lsn.to_string()),
        on_buckets(buckets.iter().map(|b| bound(b.lo)).collect()),
        on_buckets(buckets.iter().map(|b| bound(b.hi)).collect()),
        counts(&|b| b.source.rows as i64),
        sums(&|b| b.source.key_sum)?,
        counts(&|b| b.silver.rows as i64),
        sums(&|b| b.silver.key_sum)?,
        on_buckets(
            buckets
                .iter()
                .map(|b| Some(b.status.name().to_string()))
                .collect(),
        ),
        Arc::new(BooleanArray::from(hashed)),
        on_findings(findings.iter().map(|f| Some(f.key.to_string())).collect()),
        on_findings(
            findings
                .iter()
                .map(|f| Some(f.failure_type.name().to_string()))
                .collect(),
        ),
        on_findings(
            findings
                .iter()
                .map(|f| {
                    Some(
                        serde_json::json!({
                            "silver_start_lsn": f.silver_start_lsn,
                            "columns": f.columns,
                        })
                        .to_string(),
                    )
                })
                .collect(),
        ),
    ];
    let batch = RecordBatch::try_new(facts::arrow_schema(TableKind::Reconcile), columns)?;
    let url = tables::table_url(location)?;
    tables::append_once(
        &url,
        TableKind::Reconcile,
        "reconcile",
        &format!("reconcile#{}", result.run_id),
        0,
        batch,
    )
    .await?;
    Ok(())
}
