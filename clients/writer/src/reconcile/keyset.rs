//! A reconcile on a text or composite key (or any key the grid cannot sum). The writer cannot
//! order such keys as the source's collation does, so the **source** cuts the buckets: bounds
//! about `bucket_rows` rows apart, sought by `key_bound` as a keyset snapshot is planned.
//!
//! Tier 1 reads the source's keys bucket by bucket (a keyset chunk read of the key columns
//! only) and places each against silver's keys by exact equality of their row-format bytes
//! (held as [`KeyDigest`]s): a bucket MATCHes when every source row of it has its own
//! silver row. Silver's keys no source row equals lie in no bucket (the writer cannot say
//! where the source would sort them); each is a key finding of its own. Tier 2 hashes whole rows as on a grid key:
//! the source's rows of a bucket by the same chunk read, silver's rows of the keys placed
//! in it.

use std::collections::HashMap;

use arrow::array::UInt32Array;
use deltalake::datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use mssql_cdc_proto::Lsn;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{Bound, KeyTuple};
use mssql_cdc_proto::protocol::{ChunkSpec, LsnAnswer, ServeOptions, SnapshotCommand};

use super::buckets::{Bucket, BucketStatus};
use super::in_flight::InFlight;
use super::key::{DigestMap, KeyDigest, KeysetKey, RowKey};
use super::rows::{FailureType, Hashing, KeyFinding, Prints};
use super::{Compared, Positions, ReconcileConfig, Sample};
use crate::error::Result;
use crate::keyset::Keyset;
use crate::tables;

/// Rows of silver hashed in one pass for tier 2: the chosen buckets are taken in groups of
/// about this many rows, one silver scan a group.
const HASH_GROUP_ROWS: u64 = 4_000_000;

/// A silver key: how many of its rows no source row has claimed yet, and the bucket whose
/// source rows claimed the others ([`Placed::NOWHERE`] while none has): eight bytes, as ten
/// million of them are held.
struct Placed {
    unclaimed: u32,
    bucket: u32,
}

impl Default for Placed {
    fn default() -> Self {
        Placed {
            unclaimed: 0,
            bucket: Placed::NOWHERE,
        }
    }
}

impl Placed {
    const NOWHERE: u32 = u32::MAX;

    fn bucket(&self) -> Option<u32> {
        (self.bucket != Placed::NOWHERE).then_some(self.bucket)
    }
}

/// Tiers 1 and 2 on a keyset key.
pub(super) async fn compare(
    client: &CdcClient,
    config: &ReconcileConfig,
    context: &SessionContext,
    (hashing, key): (&Hashing, &KeysetKey),
    positions: &Positions,
    sample: &mut Sample,
) -> Result<Compared> {
    let started = std::time::Instant::now();
    let names = key.names();
    // The source's LSN first, then its buckets.
    let stamp: LsnAnswer = client.action("max_lsn", &serde_json::json!({})).await?;
    let source_lsn = stamp.lsn.unwrap_or(Lsn::ZERO);
    let bounds = Keyset {
        client,
        table: &config.table,
        keys: &names,
        unique: key.unique,
    }
    .walk(None, config.bucket_rows)
    .await?;
    let mut buckets = tile(bounds);
    let mut silver = silver_keys(context, hashing, &names).await?;
    tracing::debug!(
        seconds = started.elapsed().as_secs_f64(),
        buckets = buckets.len(),
        silver_keys = silver.len(),
        "reconcile: the source's buckets cut and silver's keys read"
    );

    // Tier 1: the source's keys, bucket by bucket, each claiming one silver row of its key.
    let (mut differing, after_reads) =
        claim(client, config, hashing, &names, &mut buckets, &mut silver).await?;
    // Silver's rows beyond the source's count of a key lie in the bucket of its source rows
    // (which then mismatches); keys no source row claimed lie in no bucket.
    let mut silver_only = DigestMap::default();
    for (digest, placed) in &silver {
        match placed.bucket() {
            Some(index) if placed.unclaimed > 0 => {
                buckets[index as usize].silver.rows += u64::from(placed.unclaimed);
                differing[index as usize].push(*digest);
            }
            Some(_) => {}
            None => {
                silver_only.insert(*digest, ());
            }
        }
    }
    for bucket in &mut buckets {
        bucket.judge();
    }

    // What is still in flight after the compared LSN: a bucket differs only in flight when
    // every key it differs by changed.
    let compared_lsn = source_lsn.min(positions.silver);
    let fresh: LsnAnswer = client.action("max_lsn", &serde_json::json!({})).await?;
    let mut in_flight = InFlight::read(
        client,
        config,
        &hashing.key,
        (compared_lsn, positions.rebuilt_from),
        positions.bronze_end,
        fresh
            .lsn
            .unwrap_or(source_lsn)
            .max(after_reads.unwrap_or(source_lsn)),
    )
    .await?;
    let changed: DigestMap<()> = in_flight.keys().map(|key| (key.digest(), ())).collect();
    for (bucket, keys) in buckets.iter_mut().zip(&differing) {
        if bucket.status == BucketStatus::Mismatch
            && keys.iter().all(|digest| changed.contains_key(digest))
        {
            bucket.status = BucketStatus::InFlight;
        }
    }
    drop(differing);
    let mut findings = silver_only_findings(context, hashing, &silver_only, &in_flight).await?;
    tracing::debug!(
        seconds = started.elapsed().as_secs_f64(),
        buckets = buckets.len(),
        silver_only = silver_only.len(),
        "reconcile: tier 1 done (keys placed, keys in flight)"
    );

    // Tier 2 on every MISMATCH bucket and a sample of the MATCH ones, silver scanned once
    // for each group of them.
    sample.choose(&mut buckets);
    let chosen: Vec<usize> = (0..buckets.len())
        .filter(|index| buckets[*index].hashed)
        .collect();
    let mut done = 0;
    for group in groups(&buckets, &chosen) {
        let slots: HashMap<u32, usize> = group
            .iter()
            .enumerate()
            .map(|(slot, index)| (*index as u32, slot))
            .collect();
        let expected: Vec<u64> = group
            .iter()
            .map(|index| buckets[*index].silver.rows)
            .collect();
        let mut silver_side = silver_prints(context, hashing, &expected, |digest| {
            silver
                .get(digest)
                .and_then(Placed::bucket)
                .and_then(|bucket| slots.get(&bucket).copied())
        })
        .await?;
        for (slot, index) in group.iter().enumerate() {
            let bucket = &buckets[*index];
            let command =
                hashing.command(&config.table, vec![range(bucket, 0)], Some(names.clone()));
            let (source, after_read) = hashing
                .source_prints(
                    client,
                    &command,
                    Prints::expecting(bucket.source.rows, hashing),
                )
                .await?;
            let silver_rows = std::mem::take(&mut silver_side[slot]);
            let found = hashing
                .differences(
                    client,
                    config,
                    (&source, &silver_rows),
                    after_read,
                    &mut in_flight,
                )
                .await?;
            super::log_bucket(config, (done, chosen.len()), bucket, found.len());
            done += 1;
            findings.extend(found);
        }
    }
    Ok(Compared {
        source_lsn,
        buckets,
        findings,
        changes_read: in_flight.window(),
        key_hash_sums: false,
        value_sum_rereads: 0,
        value_sums_refused: None,
        value_sums: false,
    })
}

/// Reads the source's keys of each bucket (a keyset chunk read of the key columns) and lets
/// each claim one silver row of exactly its key, counting both sides; returns, per bucket,
/// the source's keys that claimed none, and the latest `max_lsn` the reads' completion
/// markers carry.
async fn claim(
    client: &CdcClient,
    config: &ReconcileConfig,
    hashing: &Hashing,
    names: &[String],
    buckets: &mut [Bucket],
    silver: &mut DigestMap<Placed>,
) -> Result<(Vec<Vec<KeyDigest>>, Option<Lsn>)> {
    let mut unclaimed: Vec<Vec<KeyDigest>> = vec![Vec::new(); buckets.len()];
    let mut after_reads = None;
    for (index, bucket) in buckets.iter_mut().enumerate() {
        let command = SnapshotCommand {
            chunks: Some(vec![range(bucket, 0)]),
            keys: Some(names.to_vec()),
            serve: ServeOptions {
                columns: Some(names.to_vec()),
                include_command_id: Some(false),
                ..ServeOptions::default()
            },
            ..SnapshotCommand::new(config.table.clone())
        };
        let plan = client.plan_snapshot(&command).await?;
        for endpoint in &plan.info.endpoint {
            let mut reader = client
                .open_endpoint(super::ticket(endpoint, "snapshot")?)
                .await?;
            while let Some(batch) = reader.next_batch().await? {
                for digest in hashing.key.digests(&batch)? {
                    bucket.source.rows += 1;
                    match silver.get_mut(&digest) {
                        Some(placed) if placed.unclaimed > 0 => {
                            placed.unclaimed -= 1;
                            placed.bucket = index as u32;
                            bucket.silver.rows += 1;
                        }
                        _ => unclaimed[index].push(digest),
                    }
                }
            }
            after_reads = after_reads.max(reader.completion()?.max_lsn);
        }
    }
    Ok((unclaimed, after_reads))
}

/// A finding for each of silver's keys no source row claimed (MISSING_SOURCE, or IN_FLIGHT),
/// with silver's `_start_lsn` of its row.
async fn silver_only_findings(
    context: &SessionContext,
    hashing: &Hashing,
    silver_only: &DigestMap<()>,
    in_flight: &InFlight,
) -> Result<Vec<KeyFinding>> {
    if silver_only.is_empty() {
        return Ok(Vec::new());
    }
    let prints = silver_prints(context, hashing, &[0], |digest| {
        silver_only.contains_key(digest).then_some(0)
    })
    .await?;
    let mut findings = Vec::new();
    let mut last: Option<&RowKey> = None;
    for (row_key, lsn) in prints[0].keys() {
        if last != Some(row_key) {
            findings.push(KeyFinding {
                key: hashing.key.json(row_key),
                failure_type: in_flight.failure(row_key, FailureType::MissingSource),
                silver_start_lsn: lsn.map(|lsn| lsn.to_string()),
                columns: Vec::new(),
            });
        }
        last = Some(row_key);
    }
    Ok(findings)
}

/// The buckets the bounds cut: `[None, b1), [b1, b2), ..., [bn, None)`; one open bucket
/// without bounds (a table of fewer rows than a bucket, or none).
fn tile(bounds: Vec<KeyTuple>) -> Vec<Bucket> {
    let mut buckets = Vec::with_capacity(bounds.len() + 1);
    let mut lo: Option<Bound> = None;
    for bound in bounds {
        let hi = Bound::Keys(bound);
        buckets.push(Bucket::new(lo.take(), Some(hi.clone())));
        lo = Some(hi);
    }
    buckets.push(Bucket::new(lo, None));
    buckets
}

/// The bucket's keys as chunk `number` of a keyset read.
fn range(bucket: &Bucket, number: i32) -> ChunkSpec {
    ChunkSpec {
        chunk: number,
        lo: bucket.lo.clone(),
        hi: bucket.hi.clone(),
    }
}

/// The chosen buckets (indexes, in key order) in groups of about [`HASH_GROUP_ROWS`] rows.
fn groups(buckets: &[Bucket], chosen: &[usize]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut rows = 0;
    for index in chosen {
        let bucket_rows = buckets[*index].source.rows.max(buckets[*index].silver.rows);
        match groups.last_mut() {
            Some(group) if rows + bucket_rows <= HASH_GROUP_ROWS => group.push(*index),
            _ => {
                groups.push(vec![*index]);
                rows = 0;
            }
        }
        rows += bucket_rows;
    }
    groups
}

/// Silver's keys, each with the number of rows holding it.
async fn silver_keys(
    context: &SessionContext,
    hashing: &Hashing,
    names: &[String],
) -> Result<DigestMap<Placed>> {
    let frame = context
        .sql(&format!(
            "SELECT {} FROM silver",
            tables::quote_columns(names)
        ))
        .await?;
    let mut stream = frame.execute_stream().await?;
    let mut keys = DigestMap::<Placed>::default();
    while let Some(batch) = stream.try_next().await? {
        for digest in hashing.key.digests(&batch)? {
            keys.entry(digest).or_default().unclaimed += 1;
        }
    }
    Ok(keys)
}

/// Silver's rows whose key (by its digest) `slot` places, fingerprinted into one
/// [`Prints`] per slot (of `expected`, each expecting that many rows), sorted; one scan.
async fn silver_prints(
    context: &SessionContext,
    hashing: &Hashing,
    expected: &[u64],
    slot: impl Fn(&KeyDigest) -> Option<usize>,
) -> Result<Vec<Prints>> {
    let slots = expected.len();
    let mut prints: Vec<Prints> = expected
        .iter()
        .map(|rows| Prints::expecting(*rows, hashing))
        .collect();
    let mut stream = context
        .sql(&hashing.silver_select())
        .await?
        .execute_stream()
        .await?;
    while let Some(batch) = stream.try_next().await? {
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); slots];
        for (row, digest) in hashing.key.digests(&batch)?.iter().enumerate() {
            if let Some(slot) = slot(digest) {
                rows[slot].push(row as u32);
            }
        }
        for (slot, rows) in rows.into_iter().enumerate() {
            if !rows.is_empty() {
                let taken = arrow::compute::take_record_batch(&batch, &UInt32Array::from(rows))?;
                hashing.silver_batch(&taken, &mut prints[slot])?;
            }
        }
    }
    for side in &mut prints {
        side.sort();
    }
    Ok(prints)
}
