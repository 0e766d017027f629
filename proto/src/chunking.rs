//! Cutting an integer key into chunks of about equal rows from counted slices.
//!
//! The seed's plan (ADR 0028, Amendment): count the rows per slice of a fixed grid over
//! `[MIN, MAX]`, recount finer any slice holding more than a chunk, then pack consecutive
//! slices into chunks of at most `chunk_rows` (a single key holding more is a chunk of its
//! own). The first chunk is open below and the last ends at `MAX + 1` (open above only at
//! BIGINT's maximum): keys outside `[MIN, MAX]` read after the stamp were inserted after it,
//! so the stream has them (P4), and the rows inserted since do not pile into the last chunk.
//! The same packing splits a full snapshot into partitions on the server.

use crate::catalog::{KeyBucket, KeyGrid, KeyRange};
use crate::error::Result;

/// Slices of the first grid.
pub const GRID_SLICES: u64 = 1_024;

/// Counts rows per slice of a grid (`key_buckets`), locally or over Flight.
#[async_trait::async_trait]
pub trait BucketCounter: Send + Sync {
    /// Row counts per slice of the grid, empty slices left out.
    async fn buckets(&self, grid: KeyGrid) -> Result<Vec<KeyBucket>>;
}

/// The width of slices cutting `[lo, hi]` into about `slices` slices.
fn width_for(lo: i64, hi: i64, slices: u64) -> u64 {
    let span = (i128::from(hi) - i128::from(lo) + 1).max(1) as u128;
    let slices = u128::from(slices.max(1));
    u64::try_from(span.div_ceil(slices))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Counted slices of `[lo, hi]`, every slice wider than one key holding at most `chunk_rows`.
pub async fn counted_slices(
    counter: &dyn BucketCounter,
    lo: i64,
    hi: i64,
    chunk_rows: u64,
) -> Result<Vec<KeyBucket>> {
    let mut pending = vec![KeyGrid::new(lo, hi, width_for(lo, hi, GRID_SLICES))?];
    let mut done: Vec<KeyBucket> = Vec::new();
    while let Some(grid) = pending.pop() {
        for bucket in counter.buckets(grid).await? {
            let slice_hi = bucket.hi.map_or(grid.hi(), |end| (end - 1).min(grid.hi()));
            if bucket.rows > chunk_rows && grid.width() > 1 {
                let parts = bucket.rows.div_ceil(chunk_rows.max(1)).saturating_mul(4);
                let width = width_for(bucket.lo, slice_hi, parts);
                pending.push(KeyGrid::new(bucket.lo, slice_hi, width)?);
            } else {
                done.push(bucket);
            }
        }
    }
    done.sort_by_key(|bucket| bucket.lo);
    Ok(done)
}

/// Packs counted slices into chunks of at most `chunk_rows` rows (a slice holding more is a
/// chunk alone): the first open below, the last ending at `max + 1` (open at BIGINT's max).
/// Returns each chunk's range and its counted rows.
pub fn pack(slices: &[KeyBucket], max: i64, chunk_rows: u64) -> Vec<(KeyRange, u64)> {
    let mut chunks: Vec<(KeyRange, u64)> = Vec::new();
    let mut lo: Option<i64> = None;
    let mut rows = 0u64;
    for slice in slices {
        if rows > 0 && rows + slice.rows > chunk_rows {
            chunks.push((
                KeyRange {
                    lo,
                    hi: Some(slice.lo),
                },
                rows,
            ));
            lo = Some(slice.lo);
            rows = 0;
        }
        rows += slice.rows;
    }
    chunks.push((
        KeyRange {
            lo,
            hi: max.checked_add(1),
        },
        rows,
    ));
    chunks
}

/// Chunks of at most about `chunk_rows` rows over a table whose keys span `[min, max]`; an
/// empty table (`None`) is one chunk holding everything.
pub async fn plan(
    counter: &dyn BucketCounter,
    extent: Option<(i64, i64)>,
    chunk_rows: u64,
) -> Result<Vec<(KeyRange, u64)>> {
    let Some((min, max)) = extent else {
        return Ok(vec![(KeyRange { lo: None, hi: None }, 0)]);
    };
    let slices = counted_slices(counter, min, max, chunk_rows.max(1)).await?;
    Ok(pack(&slices, max, chunk_rows.max(1)))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    struct Keys(BTreeSet<i64>);

    #[async_trait::async_trait]
    impl BucketCounter for Keys {
        async fn buckets(&self, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
            Ok(grid.count(self.0.range(grid.lo()..=grid.hi()).copied()))
        }
    }

    async fn check(keys: BTreeSet<i64>, chunk_rows: u64) -> Vec<(KeyRange, u64)> {
        let extent = keys.first().copied().zip(keys.last().copied());
        let chunks = plan(&Keys(keys.clone()), extent, chunk_rows)
            .await
            .expect("plan");
        // Tiling: the chunks are adjacent, the first open below.
        assert_eq!(chunks[0].0.lo, None);
        for pair in chunks.windows(2) {
            assert_eq!(pair[0].0.hi, pair[1].0.lo, "adjacent chunks");
        }
        // Every key in exactly one chunk, with the counts the plan gives.
        for (range, rows) in &chunks {
            let inside = keys.iter().filter(|key| range.contains(**key)).count() as u64;
            assert_eq!(inside, *rows, "{range:?}");
            assert!(*rows <= chunk_rows || range.hi == range.lo.map(|lo| lo + 1));
        }
        let total: u64 = chunks.iter().map(|(_, rows)| rows).sum();
        assert_eq!(total, keys.len() as u64);
        chunks
    }

    #[tokio::test]
    async fn skewed_keys_pack_into_bounded_chunks() {
        // A dense cluster, a sparse region and a key at BIGINT's maximum.
        let mut keys: BTreeSet<i64> = (1..=50_000).collect();
        keys.extend((0..200).map(|i| 1_000_000_000 + i * 7_919_993));
        keys.insert(i64::MAX);
        let chunks = check(keys, 5_000).await;
        assert!(chunks.len() >= 10, "{} chunks", chunks.len());
        assert_eq!(
            chunks.last().expect("last").0.hi,
            None,
            "open at BIGINT max"
        );
    }

    #[tokio::test]
    async fn the_last_chunk_ends_just_above_max() {
        let keys: BTreeSet<i64> = (-500..500).collect();
        let chunks = check(keys, 300).await;
        assert_eq!(chunks.last().expect("last").0.hi, Some(500));
    }

    #[tokio::test]
    async fn an_empty_table_is_one_open_chunk() {
        let chunks = plan(&Keys(BTreeSet::new()), None, 10).await.expect("plan");
        assert_eq!(chunks, vec![(KeyRange { lo: None, hi: None }, 0)]);
    }
}
