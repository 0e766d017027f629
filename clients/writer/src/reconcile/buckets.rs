//! Tier 1: silver's keys counted and summed on the source's grid, slices merged into
//! buckets of about `bucket_rows`, each bucket MATCH, IN_FLIGHT or MISMATCH.

use std::collections::BTreeMap;

use arrow::array::{Array, ArrayRef, Int64Array};
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use deltalake::datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use mssql_cdc_proto::catalog::{KeyGrid, KeySums};
use mssql_cdc_proto::keys::Bound;
use serde::{Deserialize, Serialize};

use super::in_flight::InFlight;
use super::key::{GridKey, RowKey};
use crate::error::{Result, WriterError};
use crate::tables;

/// A bucket's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BucketStatus {
    /// Rows and key sums are equal.
    Match,
    /// They differ, and a key of the bucket changed after the compared LSN.
    InFlight,
    /// They differ with no change to explain it.
    Mismatch,
}

impl BucketStatus {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            BucketStatus::Match => "MATCH",
            BucketStatus::InFlight => "IN_FLIGHT",
            BucketStatus::Mismatch => "MISMATCH",
        }
    }
}

/// One side's count of a bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Side {
    /// Rows.
    pub rows: u64,
    /// Sum of the keys in grid units (decimal text in JSON: it passes BIGINT).
    #[serde(with = "mssql_cdc_proto::catalog::decimal_text")]
    pub key_sum: i128,
    /// Sum of the keys' hashes ([`mssql_cdc_proto::catalog::key_hash`]), which missing and
    /// extra keys of equal count and sum do not cancel; 0 on both sides against a server
    /// that does not compute it.
    #[serde(default, with = "mssql_cdc_proto::catalog::decimal_text")]
    pub key_hash_sum: i128,
    /// Sum of the rows' value digests ([`mssql_cdc_proto::digest`]) over the compared
    /// columns; 0 on both sides when the source was not asked for them or cannot.
    #[serde(default, with = "mssql_cdc_proto::catalog::decimal_text")]
    pub value_sum: i128,
}

impl Side {
    fn add(&mut self, other: &Side) {
        self.rows += other.rows;
        self.key_sum += other.key_sum;
        self.key_hash_sum += other.key_hash_sum;
        self.value_sum += other.value_sum;
    }

    /// Whether the two sides differ by their value sums alone.
    pub(super) fn differs_only_in_values(&self, other: &Side) -> bool {
        self.value_sum != other.value_sum
            && Side {
                value_sum: other.value_sum,
                ..*self
            } == *other
    }
}

/// Keys `[lo, hi)`: grid units of a grid key, or keyset bounds the source sought (`None`:
/// open; an open `lo` holds the NULL keys).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// First key, inclusive.
    pub lo: Option<Bound>,
    /// First key after the bucket, exclusive.
    pub hi: Option<Bound>,
    /// The source's count.
    pub source: Side,
    /// Silver's count (a keyset bucket: silver's rows whose key equals one of the source's
    /// rows of the bucket).
    pub silver: Side,
    /// The verdict.
    pub status: BucketStatus,
    /// Whether it was compared row by row.
    pub hashed: bool,
    /// A key near its middle by rows (a slice bound), where a row-by-row read is cut in two
    /// reads side by side; `None` when the bucket is one slice or keyset.
    #[serde(skip)]
    pub split: Option<i64>,
}

impl Bucket {
    /// A bucket `[lo, hi)` with nothing counted yet.
    pub(super) fn new(lo: Option<Bound>, hi: Option<Bound>) -> Self {
        Bucket {
            lo,
            hi,
            source: Side::default(),
            silver: Side::default(),
            status: BucketStatus::Match,
            hashed: false,
            split: None,
        }
    }

    /// The grid units of a grid bucket's `lo` (`None`: open).
    pub(super) fn lo_units(&self) -> Option<i64> {
        units(&self.lo)
    }

    /// The grid units of a grid bucket's `hi` (`None`: open).
    pub(super) fn hi_units(&self) -> Option<i64> {
        units(&self.hi)
    }

    /// Whether the key (grid units; `None` is NULL) lies in the grid bucket.
    pub fn contains(&self, key: Option<i64>) -> bool {
        let (lo, hi) = (self.lo_units(), self.hi_units());
        match key {
            None => lo.is_none(),
            Some(key) => lo.is_none_or(|lo| key >= lo) && hi.is_none_or(|hi| key < hi),
        }
    }

    /// The verdict of the counts alone: MATCH when both sides agree.
    pub(super) fn judge(&mut self) {
        self.status = match self.source == self.silver {
            true => BucketStatus::Match,
            false => BucketStatus::Mismatch,
        };
    }
}

fn units(bound: &Option<Bound>) -> Option<i64> {
    match bound {
        Some(Bound::Int(units)) => Some(*units),
        _ => None,
    }
}

/// `array` (an integer or date column) in grid units.
pub(crate) fn units_of(array: &ArrayRef, key: &GridKey) -> Result<Int64Array> {
    let array = match array.data_type() {
        DataType::Date32 => arrow::compute::cast(array, &DataType::Int32)?,
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => array.clone(),
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 => array.clone(),
        other => {
            return Err(WriterError::invalid(format!(
                "key column '{}' ({}) reads as {other}, not as an integer or a date",
                key.column.name, key.column.sql_type
            )));
        }
    };
    let array = arrow::compute::cast(&array, &DataType::Int64)?;
    array
        .as_any()
        .downcast_ref::<Int64Array>()
        .cloned()
        .ok_or_else(|| WriterError::Internal("units are not Int64".into()))
}

/// Silver's keys in grid units, batch by batch, and with the value digests asked for, each
/// row's ([`mssql_cdc_proto::digest`]).
pub(super) struct SilverKeys {
    pub(super) units: Vec<Int64Array>,
    pub(super) digests: Option<Vec<Vec<i64>>>,
}

/// Silver's key column in grid units at the registered version and, with `values` (the
/// compared columns, in the order the source digests them), each row's value digest.
pub(super) async fn silver_units(
    context: &SessionContext,
    key: &GridKey,
    values: Option<&[String]>,
) -> Result<SilverKeys> {
    let name = tables::quote_identifier(&key.column.name);
    let select = match values {
        None => format!("SELECT {name} FROM silver"),
        // Aliased (the key is usually a compared column too), by a name no compared column
        // has.
        Some(columns) => {
            let alias = (0..)
                .map(|n| format!("__mssql_cdc_key{n}"))
                .find(|alias| !columns.contains(alias))
                .expect("a free name");
            format!(
                "SELECT {name} AS {}, {} FROM silver",
                tables::quote_identifier(&alias),
                tables::quote_columns(columns)
            )
        }
    };
    let frame = context.sql(&select).await.map_err(|error| {
        WriterError::invalid(format!(
            "silver has no key column '{}': {error}",
            key.column.name
        ))
    })?;
    // Batches digested on blocking threads, one a core at once, in order.
    let digested = values.is_some();
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let mut parts = frame
        .execute_stream()
        .await?
        .map_err(WriterError::from)
        .map_ok(|batch| {
            let key = key.clone();
            async move {
                tokio::task::spawn_blocking(move || batch_units(&batch, &key, digested))
                    .await
                    .map_err(|error| {
                        WriterError::Internal(format!("digesting silver's rows: {error}"))
                    })?
            }
        })
        .try_buffered(cores);
    let mut units = Vec::new();
    let mut digests = values.map(|_| Vec::new());
    while let Some((batch_units, batch_digests)) = parts.try_next().await? {
        units.push(batch_units);
        if let (Some(digests), Some(batch_digests)) = (&mut digests, batch_digests) {
            digests.push(batch_digests);
        }
    }
    Ok(SilverKeys { units, digests })
}

/// A batch of silver's key (its first column) in grid units and, when `digested`, the value
/// digest of each of its rows (the other columns).
fn batch_units(
    batch: &RecordBatch,
    key: &GridKey,
    digested: bool,
) -> Result<(Int64Array, Option<Vec<i64>>)> {
    let units = units_of(batch.column(0), key)?;
    if !digested {
        return Ok((units, None));
    }
    let values: Vec<&dyn Array> = batch.columns()[1..]
        .iter()
        .map(|column| column.as_ref())
        .collect();
    let digests = mssql_cdc_proto::digest::row_digests(&values)
        .map_err(|error| WriterError::invalid(format!("silver's values: {error}")))?;
    Ok((units, Some(digests)))
}

/// Silver's smallest and largest key in grid units; `None` without a non-NULL key. Read
/// apart from the keys so that the source can count while silver's rows are digested.
pub(super) async fn silver_span(
    context: &SessionContext,
    key: &GridKey,
) -> Result<Option<(i64, i64)>> {
    let name = tables::quote_identifier(&key.column.name);
    let frame = context
        .sql(&format!("SELECT MIN({name}), MAX({name}) FROM silver"))
        .await
        .map_err(|error| {
            WriterError::invalid(format!(
                "silver has no key column '{}': {error}",
                key.column.name
            ))
        })?;
    let mut bounds = (None, None);
    for batch in frame.collect().await? {
        let lo = units_of(batch.column(0), key)?;
        let hi = units_of(batch.column(1), key)?;
        bounds = (
            bounds.0.or(arrow::compute::min(&lo)),
            bounds.1.or(arrow::compute::max(&hi)),
        );
    }
    Ok(bounds.0.zip(bounds.1))
}

/// Silver's sums on the grid (no grid: neither side has a non-NULL key).
pub(super) fn silver_sums(grid: Option<&KeyGrid>, silver: &SilverKeys) -> KeySums {
    let keys = || silver.units.iter().flat_map(|array| array.iter());
    // Paired as they are counted, not collected: a row costs its key and its digest.
    let digests = || silver.digests.iter().flatten().flatten().copied();
    let digested = silver.digests.is_some();
    match grid {
        Some(grid) if digested => KeySums::count_rows(grid, keys().zip(digests())),
        Some(grid) => KeySums::count(grid, keys()),
        None => KeySums {
            null_rows: keys().filter(Option::is_none).count() as u64,
            null_value_sum: digested.then(|| {
                keys()
                    .zip(digests())
                    .filter(|(key, _)| key.is_none())
                    .map(|(_, digest)| i128::from(digest))
                    .sum()
            }),
            slices: Vec::new(),
        },
    }
}

/// Merges the slices of both sides, in key order, into buckets of at least `bucket_rows`
/// rows on the larger side (the last may hold fewer); the first is open below (NULL keys
/// included), the last open above, so every row of either side is in exactly one bucket.
pub(super) fn merge(source: &KeySums, silver: &KeySums, bucket_rows: u64) -> Vec<Bucket> {
    let mut slices: BTreeMap<i64, (Option<i64>, Side, Side)> = BTreeMap::new();
    for (sums, is_source) in [(source, true), (silver, false)] {
        for slice in &sums.slices {
            let entry = slices.entry(slice.slice.lo).or_insert((
                slice.slice.hi,
                Side::default(),
                Side::default(),
            ));
            let side = if is_source {
                &mut entry.1
            } else {
                &mut entry.2
            };
            side.rows += slice.slice.rows;
            side.key_sum += slice.key_sum;
            side.key_hash_sum += slice.key_hash_sum.unwrap_or(0);
            side.value_sum += slice.value_sum.unwrap_or(0);
        }
    }
    // A server that does not hash keys: silver's hashes are left out too.
    if source
        .slices
        .iter()
        .any(|slice| slice.key_hash_sum.is_none())
    {
        for (_, _, silver) in slices.values_mut() {
            silver.key_hash_sum = 0;
        }
    }
    // A source without value sums (not asked, or a server before them): silver's are left
    // out too.
    let without_values = !value_sums(source);
    if without_values {
        for (_, source, silver) in slices.values_mut() {
            source.value_sum = 0;
            silver.value_sum = 0;
        }
    }
    let null = |sums: &KeySums| Side {
        rows: sums.null_rows,
        value_sum: match without_values {
            true => 0,
            false => sums.null_value_sum.unwrap_or(0),
        },
        ..Side::default()
    };
    let mut buckets = Vec::new();
    let mut current = Bucket {
        source: null(source),
        silver: null(silver),
        ..Bucket::new(None, None)
    };
    let mut empty = source.null_rows == 0 && silver.null_rows == 0;
    for (lo, (hi, from_source, from_silver)) in slices {
        if current.split.is_none()
            && !empty
            && current.source.rows.max(current.silver.rows) >= bucket_rows / 2
        {
            current.split = Some(lo);
        }
        current.source.add(&from_source);
        current.silver.add(&from_silver);
        empty = false;
        if current.source.rows.max(current.silver.rows) >= bucket_rows
            && let Some(hi) = hi
        {
            current.hi = Some(Bound::Int(hi));
            let next = Bucket::new(Some(Bound::Int(hi)), None);
            buckets.push(std::mem::replace(&mut current, next));
            empty = true;
        }
    }
    if !empty {
        buckets.push(current);
    } else if let Some(last) = buckets.last_mut() {
        last.hi = None; // the last bucket is open above
    }
    for bucket in &mut buckets {
        bucket.judge();
    }
    buckets
}

/// Whether `sums` carry value sums on every slice (and on the NULL keys' rows).
pub(super) fn value_sums(sums: &KeySums) -> bool {
    (sums.null_rows == 0 || sums.null_value_sum.is_some())
        && (sums.null_value_sum.is_some() || !sums.slices.is_empty())
        && sums.slices.iter().all(|slice| slice.value_sum.is_some())
}

/// Turns MISMATCH into IN_FLIGHT where a changed key lies in the bucket.
pub(super) fn classify(buckets: &mut [Bucket], changed: &InFlight) {
    for bucket in buckets {
        if bucket.status == BucketStatus::Mismatch && holds_changed_key(bucket, changed) {
            bucket.status = BucketStatus::InFlight;
        }
    }
}

/// Whether a key of `changed` lies in `bucket` (a grid bucket: keys in grid units).
pub(super) fn holds_changed_key(bucket: &Bucket, changed: &InFlight) -> bool {
    changed.keys().any(|key| match key {
        RowKey::Units(units) => bucket.contains(*units),
        RowKey::Bytes(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(grid: &KeyGrid, keys: &[Option<i64>]) -> KeySums {
        KeySums::count(grid, keys.iter().copied())
    }

    #[test]
    fn slices_merge_into_buckets_that_hold_every_row_once() {
        let grid = KeyGrid::covering(0, 99, 10).expect("grid");
        let source: Vec<Option<i64>> = (0..100).map(Some).chain([None]).collect();
        let mut silver = source.clone();
        silver.retain(|key| *key != Some(42)); // a row missing in silver
        silver.push(Some(150)); // a row past the grid
        let buckets = merge(&sums(&grid, &source), &sums(&grid, &silver), 30);
        let bounds: Vec<(Option<i64>, Option<i64>)> = buckets
            .iter()
            .map(|bucket| (bucket.lo_units(), bucket.hi_units()))
            .collect();
        assert_eq!(
            bounds,
            vec![
                (None, Some(30)),
                (Some(30), Some(60)),
                (Some(60), Some(90)),
                (Some(90), None)
            ]
        );
        assert_eq!(
            buckets[0].source.rows, 31,
            "the NULL key joins the first bucket"
        );
        assert_eq!(
            buckets[0].split,
            Some(20),
            "about half the bucket's rows below it"
        );
        assert_eq!(buckets[1].split, Some(50));
        let statuses: Vec<BucketStatus> = buckets.iter().map(|bucket| bucket.status).collect();
        use BucketStatus::{Match, Mismatch};
        assert_eq!(statuses, vec![Match, Mismatch, Match, Mismatch]);
        let rows: u64 = buckets.iter().map(|bucket| bucket.silver.rows).sum();
        assert_eq!(rows, silver.len() as u64);
        let mut classified = buckets.clone();
        classify(
            &mut classified,
            &InFlight::of_keys([RowKey::Units(Some(42))]),
        );
        assert_eq!(classified[1].status, BucketStatus::InFlight);
        assert_eq!(
            classified[3].status,
            BucketStatus::Mismatch,
            "150 did not change"
        );
    }

    #[test]
    fn a_missed_insert_and_a_missed_delete_do_not_cancel() {
        let grid = KeyGrid::covering(0, 9, 10).expect("grid");
        let source = sums(&grid, &[Some(1), Some(2), Some(3)]);
        let silver = sums(&grid, &[Some(1), Some(2), Some(4)]);
        let buckets = merge(&source, &silver, 1_000);
        assert_eq!(buckets.len(), 1);
        assert_eq!(buckets[0].source.rows, buckets[0].silver.rows);
        assert_eq!(
            buckets[0].status,
            BucketStatus::Mismatch,
            "the key sums differ"
        );
    }

    #[test]
    fn missing_and_extra_keys_of_equal_count_and_sum_do_not_cancel() {
        let grid = KeyGrid::covering(0, 99, 100).expect("grid");
        let source = sums(&grid, &[Some(10), Some(40)]);
        let silver = sums(&grid, &[Some(20), Some(30)]);
        let buckets = merge(&source, &silver, 1_000);
        assert_eq!(buckets.len(), 1);
        assert_eq!(
            (buckets[0].source.rows, buckets[0].source.key_sum),
            (buckets[0].silver.rows, buckets[0].silver.key_sum),
            "count and sum alone cancel"
        );
        assert_eq!(
            buckets[0].status,
            BucketStatus::Mismatch,
            "the key hashes differ"
        );
    }

    #[test]
    fn a_server_without_key_hashes_is_compared_on_counts_and_sums() {
        let grid = KeyGrid::covering(0, 99, 100).expect("grid");
        let mut source = sums(&grid, &[Some(10), Some(40)]);
        for slice in &mut source.slices {
            slice.key_hash_sum = None;
        }
        let buckets = merge(&source, &sums(&grid, &[Some(10), Some(40)]), 1_000);
        assert_eq!(buckets[0].status, BucketStatus::Match);
        assert_eq!(buckets[0].silver.key_hash_sum, 0, "left out on both sides");
    }

    #[test]
    fn empty_tables_have_no_bucket_and_null_keys_have_one() {
        assert!(merge(&KeySums::default(), &KeySums::default(), 10).is_empty());
        let nulls = KeySums {
            null_rows: 2,
            ..KeySums::default()
        };
        let buckets = merge(&nulls, &KeySums::default(), 10);
        assert_eq!(buckets.len(), 1);
        assert!(buckets[0].contains(None) && buckets[0].contains(Some(5)));
        assert_eq!(buckets[0].status, BucketStatus::Mismatch);
    }
}
