//! A reconcile on one integer or date column: tier 1 counts and sums the key per slice of a
//! grid on both sides (`key_sums` on the source), slices merge into buckets; tier 2 reads
//! each chosen bucket as a key range on both sides.

use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_proto::client::{CdcClient, ClientError};
use mssql_cdc_proto::protocol::{KeySumsAnswer, KeySumsBody, LsnAnswer};

use super::buckets::{Bucket, BucketStatus};
use super::in_flight::InFlight;
use super::key::GridKey;
use super::rows::{self, FailureType, Hashing, KeyFinding};
use super::{Compared, Positions, ReconcileConfig, Sample, buckets};
use crate::error::{Result, WriterError};

/// A MISMATCH bucket's verdict after its row-by-row read found `found`; true when it was a
/// re-read (below).
///
/// - Every difference found is a key changed after the compared LSN: IN_FLIGHT (the scan
///   saw a change the capture job had not yet, whose key the read then found in flight).
/// - Nothing found, the bucket differing by its value sums alone: the source wrote some
///   value's canonical text otherwise than the writer (docs/reconcile.md, "Value digests"),
///   a MATCH, but only where silver holds the served types (`exact`: a cast to a narrower
///   one could make rows that differ compare equal) and no key of the bucket changed since
///   (a change could have undone the difference before the read: IN_FLIGHT).
fn judge_read(bucket: &mut Bucket, found: &[KeyFinding], changed: &InFlight, exact: bool) -> bool {
    if bucket.status != BucketStatus::Mismatch {
        return false;
    }
    if !found.is_empty() {
        if found
            .iter()
            .all(|finding| finding.failure_type == FailureType::InFlight)
        {
            bucket.status = BucketStatus::InFlight;
        }
        return false;
    }
    if !exact || !bucket.source.differs_only_in_values(&bucket.silver) {
        return false;
    }
    let moved = buckets::holds_changed_key(bucket, changed);
    bucket.status = match moved {
        true => BucketStatus::InFlight,
        false => BucketStatus::Match,
    };
    !moved
}

/// Whether `error` is the source refusing or failing a request (not a cut connection, a
/// purge or a denial), or the server refusing to digest a column it serves masked: one
/// asking for value sums is then asked again without them.
fn digest_refused(error: &ClientError) -> bool {
    let masked = match error {
        ClientError::Status(status) => {
            mssql_cdc_proto::status::reason_of_status(status).as_deref() == Some("COLUMN_MASKED")
        }
        _ => false,
    };
    masked
        || matches!(
            error.code(),
            Some(tonic::Code::Internal | tonic::Code::InvalidArgument | tonic::Code::Unknown)
        ) && !error.is_transient()
}

/// Tiers 1 and 2 on a grid key.
pub(super) async fn compare(
    client: &CdcClient,
    config: &ReconcileConfig,
    context: &SessionContext,
    (hashing, key): (&Hashing, &GridKey),
    positions: &Positions,
    sample: &mut Sample,
) -> Result<Compared> {
    // Tier 1: the source's sums on a grid covering both sides, counted while silver's keys
    // (and value digests) are read. Value digests need every compared column on both sides,
    // in one order.
    let started = std::time::Instant::now();
    // At sample 1 every bucket is read row by row: value sums would compare every value
    // twice, for the cost of a scan on each side.
    let values = (config.value_sums
        && config.sample < 1.0
        && hashing.digestible
        && !hashing.summed.is_empty())
    .then_some(hashing.summed.as_slice());
    let cover = buckets::silver_span(context, key).await?;
    let body = KeySumsBody {
        table: config.table.clone(),
        key: Some(key.column.name.clone()),
        cover: cover.map(|(lo, hi)| [lo, hi]),
        slices: None,
        values: values.map(<[String]>::to_vec),
    };
    let (silver_keys, answer) = tokio::join!(
        async {
            let keys = buckets::silver_units(context, key, values).await;
            tracing::debug!(
                seconds = started.elapsed().as_secs_f64(),
                "reconcile: silver's keys read"
            );
            keys
        },
        client.action::<KeySumsAnswer>("key_sums", &body),
    );
    let silver_keys = silver_keys?;
    let mut value_sums_refused = None;
    let answer = match answer {
        Ok(answer) => answer,
        // The source could not digest its values (a value it would not convert, say): the
        // run goes on without value sums (silver's are left out too, `buckets::merge`), and
        // values are compared in the buckets read row by row.
        Err(error) if values.is_some() && digest_refused(&error) => {
            tracing::warn!(
                table = %config.table,
                %error,
                "reconcile: the source could not sum its rows' value digests; comparing \
                 without value sums (values only in the buckets read row by row)"
            );
            value_sums_refused = Some(error.to_string());
            let body = KeySumsBody {
                values: None,
                ..body
            };
            client.action("key_sums", &body).await?
        }
        Err(error) => return Err(error.into()),
    };
    let source_lsn = answer.stamp;
    let grid = answer
        .grid
        .map(|grid| grid.grid())
        .transpose()
        .map_err(|error| WriterError::Internal(format!("key_sums answered a bad grid: {error}")))?;
    let silver_sums = buckets::silver_sums(grid.as_ref(), &silver_keys);
    drop(silver_keys);
    let mut bucket_list = buckets::merge(&answer.sums, &silver_sums, config.bucket_rows);
    let slices = &answer.sums.slices;
    let key_hash_sums =
        !slices.is_empty() && slices.iter().all(|slice| slice.key_hash_sum.is_some());
    let value_sums = values.is_some() && buckets::value_sums(&answer.sums);

    // What is still in flight after the compared LSN.
    let compared_lsn = source_lsn.min(positions.silver);
    let fresh: LsnAnswer = client.action("max_lsn", &serde_json::json!({})).await?;
    let mut in_flight = InFlight::read(
        client,
        config,
        &hashing.key,
        (compared_lsn, positions.rebuilt_from),
        positions.bronze_end,
        fresh.lsn.unwrap_or(source_lsn),
    )
    .await?;
    buckets::classify(&mut bucket_list, &in_flight);
    tracing::debug!(
        seconds = started.elapsed().as_secs_f64(),
        buckets = bucket_list.len(),
        "reconcile: tier 1 done (counts, key sums and the keys in flight)"
    );

    // Tier 2 on every MISMATCH bucket and a sample of the MATCH ones.
    sample.choose(&mut bucket_list);
    let mut findings = Vec::new();
    let to_hash = bucket_list.iter().filter(|bucket| bucket.hashed).count();
    let mut sides = rows::Sides::default();
    let mut value_sum_rereads = 0;
    for (done, bucket) in bucket_list
        .iter_mut()
        .filter(|bucket| bucket.hashed)
        .enumerate()
    {
        let found = rows::compare_grid_bucket(
            client,
            config,
            context,
            (hashing, key),
            bucket,
            (&mut in_flight, &mut sides),
        )
        .await?;
        super::log_bucket(config, (done, to_hash), bucket, found.len());
        if judge_read(bucket, &found, &in_flight, hashing.exact) {
            tracing::warn!(
                table = %config.table,
                lo = ?bucket.lo,
                hi = ?bucket.hi,
                "reconcile: the bucket's value digests differ but every row compared equal: \
                 the source encodes a value otherwise than the writer (a re-read, not a \
                 difference)"
            );
            value_sum_rereads += 1;
        }
        findings.extend(found);
    }
    Ok(Compared {
        source_lsn,
        buckets: bucket_list,
        findings,
        changes_read: in_flight.window(),
        key_hash_sums,
        value_sums,
        value_sum_rereads,
        value_sums_refused,
    })
}

#[cfg(test)]
mod tests {
    use mssql_cdc_proto::keys::Bound;

    use super::*;
    use crate::reconcile::buckets::Side;
    use crate::reconcile::key::RowKey;

    /// A MISMATCH bucket `[0, 100)`, differing by its value sums alone or by its rows too.
    fn bucket(values_only: bool) -> Bucket {
        let source = Side {
            rows: 10,
            key_sum: 450,
            key_hash_sum: 7,
            value_sum: 1,
        };
        let silver = Side {
            rows: if values_only { 10 } else { 9 },
            value_sum: 2,
            ..source
        };
        Bucket {
            source,
            silver,
            status: BucketStatus::Mismatch,
            hashed: true,
            ..Bucket::new(Some(Bound::Int(0)), Some(Bound::Int(100)))
        }
    }

    fn finding(key: i64, failure_type: FailureType) -> KeyFinding {
        KeyFinding {
            key: serde_json::json!({ "id": key }),
            failure_type,
            silver_start_lsn: None,
            columns: Vec::new(),
        }
    }

    #[test]
    fn a_bucket_whose_differences_all_changed_since_is_in_flight() {
        let changed = InFlight::of_keys([RowKey::Units(Some(5))]);
        let mut only_in_flight = bucket(true);
        let found = [finding(5, FailureType::InFlight)];
        assert!(!judge_read(&mut only_in_flight, &found, &changed, true));
        assert_eq!(only_in_flight.status, BucketStatus::InFlight);
        // One difference no change explains keeps the bucket a MISMATCH.
        let mut one_more = bucket(true);
        let found = [
            finding(5, FailureType::InFlight),
            finding(6, FailureType::RecordDiff),
        ];
        assert!(!judge_read(&mut one_more, &found, &changed, true));
        assert_eq!(one_more.status, BucketStatus::Mismatch);
    }

    #[test]
    fn equal_rows_under_different_value_sums_are_a_re_read_unless_a_key_changed() {
        let nothing = InFlight::of_keys([]);
        let mut reread = bucket(true);
        assert!(judge_read(&mut reread, &[], &nothing, true));
        assert_eq!(reread.status, BucketStatus::Match);
        // A key of the bucket changed since: the change may have undone the difference.
        let mut moved = bucket(true);
        let changed = InFlight::of_keys([RowKey::Units(Some(42))]);
        assert!(!judge_read(&mut moved, &[], &changed, true));
        assert_eq!(moved.status, BucketStatus::InFlight);
        // A key outside it changed: still a re-read.
        let mut outside = bucket(true);
        let changed = InFlight::of_keys([RowKey::Units(Some(420))]);
        assert!(judge_read(&mut outside, &[], &changed, true));
        // Silver in other types than served, or rows that differ too: the bucket stays.
        for (mut kept, exact) in [(bucket(true), false), (bucket(false), true)] {
            assert!(!judge_read(&mut kept, &[], &nothing, exact));
            assert_eq!(kept.status, BucketStatus::Mismatch);
        }
    }
}
