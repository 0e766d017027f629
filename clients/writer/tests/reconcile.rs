//! Reconcile against the in-process server and a silver table the pipeline built: a silver
//! in step is verified; each injected fault is found with its bucket, key and failure type
//! and nothing else; changes not applied yet are IN_FLIGHT, never MISMATCH.

mod common;

use std::collections::BTreeSet;

use common::{ColumnSelection, Lab, run_now};
use mssql_cdc_proto::keys::Bound;
use mssql_cdc_writer::control;
use mssql_cdc_writer::reconcile::{
    BucketStatus, ChunkCheck, FailureType, ReconcileConfig, ReconcileResult, reconcile,
};
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, BackfillOptions, SnapshotMode, Snapshots};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tables;

fn workload(lab: &Lab, seed: u64, commits: u64) {
    common::orders_workload(lab, seed, commits, common::churn());
}

fn apply_config(lab: &Lab) -> ApplyConfig {
    common::orders_apply_config(lab)
}

/// A silver of dbo.orders in step with the source: a full bootstrap, changes, apply.
async fn pipeline(lab: &Lab) {
    workload(lab, 1, 300);
    let mut config = lab.config();
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    workload(lab, 2, 120);
    run_now(config.clone()).await;
    apply_changes(&apply_config(lab)).await.expect("apply");
}

fn config(lab: &Lab) -> ReconcileConfig {
    ReconcileConfig {
        bucket_rows: 40,
        sample: 0.0,
        seed: Some(7),
        report: Some(lab.lake("reconcile")),
        ..ReconcileConfig::new(
            &lab.url,
            "dbo.orders",
            &lab.lake("silver_orders"),
            &lab.lake("bronze_orders"),
            &lab.lake("control"),
        )
    }
}

async fn silver_table(lab: &Lab) -> deltalake::DeltaTable {
    common::open_table(&lab.lake("silver_orders")).await
}

/// The silver keys, ascending.
async fn silver_keys(lab: &Lab) -> Vec<i64> {
    let batches = common::query(
        &lab.lake("silver_orders"),
        "SELECT order_id FROM t ORDER BY order_id",
    )
    .await;
    batches
        .iter()
        .flat_map(|batch| (0..batch.num_rows()).map(|row| common::key_of(batch, row)))
        .collect()
}

fn findings(result: &ReconcileResult) -> Vec<(String, FailureType)> {
    result
        .findings
        .iter()
        .map(|finding| (finding.key.to_string(), finding.failure_type))
        .collect()
}

/// The last line `reconcile` prints: its verdict.
fn rendered_verdict(result: &ReconcileResult) -> String {
    mssql_cdc_writer::reconcile::render(result)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string()
}

fn statuses(result: &ReconcileResult) -> Vec<BucketStatus> {
    result
        .bucket_list
        .iter()
        .map(|bucket| bucket.status)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silver_in_step_is_verified_at_the_compared_lsn() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let control_row = || async {
        control::row(
            &tables::table_url(&lab.lake("control")).expect("url"),
            &lab.lake("silver_orders"),
        )
        .await
        .expect("control")
        .expect("row")
    };
    // Without the sample no bucket is read row by row: the value sums of tier 1 compared
    // every value, and the control row says so.
    let digested = reconcile(&config(&lab)).await.expect("reconcile");
    assert!(digested.verified && digested.hashed == 0 && digested.value_sums);
    assert!(digested.values_verified);
    let row = control_row().await;
    assert_eq!(
        row.verified.map(|(lsn, _)| lsn),
        Some(digested.compared_lsn.to_string())
    );
    assert_eq!(
        row.values_verified.map(|(lsn, _)| lsn),
        Some(digested.compared_lsn.to_string())
    );
    assert!(rendered_verdict(&digested).starts_with("verified: silver equals the source"));
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..config(&lab)
    })
    .await
    .expect("reconcile");
    assert!(result.buckets >= 3, "{} buckets", result.buckets);
    assert_eq!(result.matched, result.buckets, "{:?}", statuses(&result));
    assert_eq!(
        result.hashed, result.buckets,
        "sample 1 hashes every bucket"
    );
    assert!(result.findings.is_empty(), "{:?}", findings(&result));
    assert!(result.verified && result.values_verified && result.clean());
    assert!(rendered_verdict(&result).starts_with("verified: silver equals the source"));
    assert_eq!(
        result.compared_lsn,
        result.silver_lsn.min(result.source_lsn)
    );
    let rows: u64 = result
        .bucket_list
        .iter()
        .map(|bucket| bucket.source.rows)
        .sum();
    assert_eq!(rows, silver_keys(&lab).await.len() as u64);
    let row = control_row().await;
    assert_eq!(
        row.verified.map(|(lsn, _)| lsn),
        Some(result.compared_lsn.to_string())
    );
    assert_eq!(
        row.values_verified.map(|(lsn, _)| lsn),
        Some(result.compared_lsn.to_string())
    );
    // A later run of rows only leaves the values' verification as it was.
    reconcile(&config(&lab)).await.expect("reconcile");
    assert_eq!(
        control_row().await.values_verified.map(|(lsn, _)| lsn),
        Some(result.compared_lsn.to_string())
    );
    // The report holds one row per bucket, all MATCH and hashed.
    let report = common::query(
        &lab.lake("reconcile"),
        &format!(
            "SELECT status, hashed, source_rows, silver_rows FROM t WHERE run_id = '{}'",
            result.run_id
        ),
    )
    .await;
    let report_rows: usize = report.iter().map(|batch| batch.num_rows()).sum();
    assert_eq!(report_rows as u64, result.buckets);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_injected_fault_is_found_with_its_key_and_nothing_else() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let keys = silver_keys(&lab).await;
    assert!(keys.len() > 200, "{} keys", keys.len());
    let deleted = keys[10];
    let changed = keys[keys.len() / 2];
    let added = keys[keys.len() - 1] + 1;
    let table = silver_table(&lab).await;
    let table = common::delete_where(table, &format!("order_id = {deleted}")).await;
    let table = common::update_where(
        table,
        &format!("order_id = {changed}"),
        "quantity",
        "quantity + 1",
    )
    .await;
    let template = common::query(
        &lab.lake("silver_orders"),
        &format!("SELECT * FROM t WHERE order_id = {changed}"),
    )
    .await;
    let mut row = template[0].clone();
    let key_index = row.schema().index_of("order_id").expect("key");
    let mut columns = row.columns().to_vec();
    columns[key_index] = std::sync::Arc::new(arrow::array::Int64Array::from(vec![added]));
    row = arrow::record_batch::RecordBatch::try_new(row.schema(), columns).expect("row");
    table
        .write(vec![row])
        .with_save_mode(deltalake::protocol::SaveMode::Append)
        .await
        .expect("add a row");

    // A changed value keeps its bucket's rows and key sums, not its value sum: tier 1 finds
    // every fault's bucket, and only those are read row by row (sample 0).
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    let mut found = findings(&result);
    found.sort();
    let mut expected = vec![
        (
            format!("{{\"order_id\":{deleted}}}"),
            FailureType::MissingTarget,
        ),
        (
            format!("{{\"order_id\":{changed}}}"),
            FailureType::RecordDiff,
        ),
        (
            format!("{{\"order_id\":{added}}}"),
            FailureType::MissingSource,
        ),
    ];
    expected.sort();
    assert_eq!(found, expected);
    let diff = result
        .findings
        .iter()
        .find(|finding| finding.failure_type == FailureType::RecordDiff)
        .expect("diff");
    assert_eq!(diff.columns, vec!["quantity".to_string()]);
    // Exactly the buckets holding a missing, an extra or a changed row mismatch (the
    // changed one by its value sum).
    for bucket in &result.bucket_list {
        let counted = [deleted, added, changed]
            .iter()
            .any(|key| bucket.contains(Some(*key)));
        let expected = match counted {
            true => BucketStatus::Mismatch,
            false => BucketStatus::Match,
        };
        assert_eq!(
            (bucket.status, bucket.hashed),
            (expected, counted),
            "bucket {:?}..{:?}",
            bucket.lo,
            bucket.hi
        );
    }
    // Without the sample, tier 2 reads only the mismatched buckets, and finds the same.
    let unsampled = reconcile(&config(&lab)).await.expect("reconcile");
    let mut unsampled_found = findings(&unsampled);
    unsampled_found.sort();
    assert_eq!(unsampled_found, expected);
    let hashed: Vec<bool> = unsampled
        .bucket_list
        .iter()
        .map(|bucket| bucket.hashed)
        .collect();
    let mismatched: Vec<bool> = unsampled
        .bucket_list
        .iter()
        .map(|bucket| bucket.status == BucketStatus::Mismatch)
        .collect();
    assert_eq!(hashed, mismatched);
    assert!(!result.verified && !result.clean());
    // The report names each key and failure.
    let report = common::query(
        &lab.lake("reconcile"),
        &format!(
            "SELECT key, failure_type FROM t WHERE run_id = '{}' AND key IS NOT NULL ORDER BY key",
            result.run_id
        ),
    )
    .await;
    let rows: usize = report.iter().map(|batch| batch.num_rows()).sum();
    assert_eq!(rows, 3);
}

/// A source that writes some value's canonical text otherwise than the writer (its value
/// sums one off, `Faults::perturb_value_sums`): every bucket is read row by row and, its rows
/// equal, ends MATCH, counted as a re-read and said; a value changed in silver is still
/// found in its bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn value_sums_computed_otherwise_cost_a_re_read_never_a_verdict() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    lab.db.set_faults(mssql_cdc_flight::sim::Faults {
        perturb_value_sums: true,
        ..Default::default()
    });
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    let rendered = mssql_cdc_writer::reconcile::render(&result);
    assert!(result.verified && result.values_verified, "{rendered}");
    assert!(result.buckets > 1, "{rendered}");
    assert_eq!(
        (result.value_sum_rereads, result.hashed),
        (result.buckets, result.buckets),
        "{rendered}"
    );
    assert!(
        statuses(&result)
            .iter()
            .all(|status| *status == BucketStatus::Match)
    );
    assert!(
        rendered.contains("value sums differed but every row compared equal"),
        "{rendered}"
    );

    let key = silver_keys(&lab).await[3];
    update_lake(
        &lab.lake("silver_orders"),
        &format!("order_id = {key}"),
        "status",
        "concat(status, '~')",
    )
    .await;
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    let rendered = mssql_cdc_writer::reconcile::render(&result);
    assert!(!result.verified && !result.values_verified, "{rendered}");
    assert_eq!(
        findings(&result),
        vec![(format!("{{\"order_id\":{key}}}"), FailureType::RecordDiff)],
        "{rendered}"
    );
    assert_eq!(result.value_sum_rereads, result.buckets - 1, "{rendered}");
}

/// A source whose value digests fail (a value SQL Server would not convert): the run goes on
/// without value sums, verifies rows, and does not claim every value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_cannot_sum_values_is_compared_without_them() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    lab.db.set_faults(mssql_cdc_flight::sim::Faults {
        fail_value_sums: true,
        ..Default::default()
    });
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    let rendered = mssql_cdc_writer::reconcile::render(&result);
    assert!(result.verified && !result.value_sums, "{rendered}");
    assert!(
        result
            .value_sums_refused
            .as_deref()
            .is_some_and(|error| error.contains("injected")),
        "{rendered}"
    );
    assert!(
        rendered.contains("could not sum its rows' value digests"),
        "{rendered}"
    );
    assert!(!result.values_verified && result.hashed == 0, "{rendered}");
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..config(&lab)
    })
    .await
    .expect("reconcile");
    assert!(
        result.values_verified && !result.value_sums,
        "every bucket read row by row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_extra_keys_of_equal_count_and_sum_are_found_by_tier_one() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let keys = silver_keys(&lab).await;
    // Two rows missing from silver and two extra ones whose keys add up alike, in one
    // bucket: its count and key sum stay those of the source.
    let missing = [keys[keys.len() - 2], keys[keys.len() - 1]];
    let extra = [-5, missing[0] + missing[1] + 5];
    let template = common::query(
        &lab.lake("silver_orders"),
        &format!("SELECT * FROM t WHERE order_id = {}", missing[0]),
    )
    .await;
    let mut table = silver_table(&lab).await;
    for key in missing {
        table = common::delete_where(table, &format!("order_id = {key}")).await;
    }
    for key in extra {
        let row = &template[0];
        let key_index = row.schema().index_of("order_id").expect("key");
        let mut columns = row.columns().to_vec();
        columns[key_index] = std::sync::Arc::new(arrow::array::Int64Array::from(vec![key]));
        let row = arrow::record_batch::RecordBatch::try_new(row.schema(), columns).expect("row");
        table = table
            .write(vec![row])
            .with_save_mode(deltalake::protocol::SaveMode::Append)
            .await
            .expect("add a row");
    }
    // No sample: only a bucket tier 1 finds different is read row by row.
    let result = reconcile(&ReconcileConfig {
        bucket_rows: 1_000_000,
        sample: 0.0,
        ..config(&lab)
    })
    .await
    .expect("reconcile");
    assert_eq!(result.bucket_list.len(), 1);
    let bucket = &result.bucket_list[0];
    assert_eq!(
        (bucket.source.rows, bucket.source.key_sum),
        (bucket.silver.rows, bucket.silver.key_sum)
    );
    assert_eq!(
        bucket.status,
        BucketStatus::Mismatch,
        "the key hash sums differ"
    );
    let mut found = findings(&result);
    found.sort();
    let mut expected: Vec<(String, FailureType)> = missing
        .iter()
        .map(|key| {
            (
                format!("{{\"order_id\":{key}}}"),
                FailureType::MissingTarget,
            )
        })
        .chain(extra.iter().map(|key| {
            (
                format!("{{\"order_id\":{key}}}"),
                FailureType::MissingSource,
            )
        }))
        .collect();
    expected.sort();
    assert_eq!(found, expected);
    assert!(!result.verified);
    // The report's bucket row shows why: equal key sums, different key hash sums.
    assert!(result.key_hash_sums);
    let report = common::query(
        &lab.lake("reconcile"),
        &format!(
            "SELECT CAST(source_key_sum = silver_key_sum AS VARCHAR), \
             CAST(source_key_hash_sum = silver_key_hash_sum AS VARCHAR) \
             FROM t WHERE run_id = '{}' AND status IS NOT NULL",
            result.run_id
        ),
    )
    .await;
    assert_eq!(
        report.iter().map(|batch| batch.num_rows()).sum::<usize>(),
        1
    );
    let row = report
        .iter()
        .find(|batch| batch.num_rows() > 0)
        .expect("a row");
    assert_eq!(
        (common::text(row, 0, 0), common::text(row, 1, 0)),
        (Some("true".to_string()), Some("false".to_string()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_bucket_is_one_mismatch_with_every_key_missing() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let first = reconcile(&config(&lab)).await.expect("reconcile");
    assert!(first.verified);
    let bucket = first.bucket_list[1].clone();
    let units = |bound: Option<Bound>| match bound {
        Some(Bound::Int(units)) => units,
        other => panic!("a grid bucket's bound is an integer, not {other:?}"),
    };
    let (lo, hi) = (units(bucket.lo), units(bucket.hi));
    let dropped: BTreeSet<i64> = silver_keys(&lab)
        .await
        .into_iter()
        .filter(|key| (lo..hi).contains(key))
        .collect();
    common::delete_where(
        silver_table(&lab).await,
        &format!("order_id >= {lo} AND order_id < {hi}"),
    )
    .await;
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    assert_eq!(result.mismatch, 1, "{:?}", statuses(&result));
    assert_eq!(result.bucket_list[1].status, BucketStatus::Mismatch);
    assert_eq!(result.bucket_list[1].silver.rows, 0);
    assert_eq!(
        result.failures.get("MISSING_TARGET").copied(),
        Some(dropped.len() as u64)
    );
    let missing: BTreeSet<i64> = result
        .findings
        .iter()
        .map(|finding| finding.key["order_id"].as_i64().expect("key"))
        .collect();
    assert_eq!(missing, dropped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_not_applied_yet_are_in_flight_never_mismatch() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    // Some changes reach bronze but not silver, more stay in the change table only.
    workload(&lab, 3, 40);
    run_now(lab.config()).await;
    workload(&lab, 4, 40);
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..config(&lab)
    })
    .await
    .expect("reconcile");
    assert_eq!(result.mismatch, 0, "{:?}", statuses(&result));
    assert!(result.in_flight >= 1, "{:?}", statuses(&result));
    for (kind, count) in &result.failures {
        assert!(
            *count == 0 || kind == "IN_FLIGHT",
            "{kind}: {count} ({:?})",
            findings(&result)
        );
    }
    assert!(result.clean() && result.verified);
    // The change table was read from where bronze's stream stands (its newest change row),
    // not from the control table's end, which trails it until the verdict moves.
    let newest = tables::query_text(
        &tables::table_url(&lab.lake("bronze_orders")).expect("url"),
        "SELECT MAX(_start_lsn) FROM t WHERE _operation <> 0",
    )
    .await
    .expect("bronze's newest change");
    let newest = newest[0][0].clone().expect("bronze holds changes");
    assert_eq!(result.changes_read.0.to_string(), newest);
    let control_end = control::row(
        &tables::table_url(&lab.lake("control")).expect("url"),
        "dbo.orders",
    )
    .await
    .expect("control")
    .and_then(|row| row.end)
    .map(|end| end.lsn);
    assert!(
        control_end.is_none_or(|end| end < result.changes_read.0),
        "the control table's end {control_end:?} trails bronze here"
    );
    assert!(result.changes_read.1 > result.changes_read.0);
    // Once applied, everything matches again.
    run_now(lab.config()).await;
    apply_changes(&apply_config(&lab)).await.expect("apply");
    let later = reconcile(&config(&lab)).await.expect("reconcile");
    assert_eq!(later.matched, later.buckets, "{:?}", statuses(&later));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_landing_while_a_bucket_is_read_row_by_row_is_in_flight() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    // The counts match; the first row-by-row read then sees a commit they did not.
    let hook = common::commit_during_next_snapshot_read(&lab, "dbo.orders", 9);
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        bucket_rows: 1_000_000,
        ..config(&lab)
    })
    .await
    .expect("reconcile");
    assert!(hook.lock().expect("lock").is_none(), "the commit landed");
    assert_eq!(result.buckets, 1);
    assert_eq!(result.bucket_list[0].status, BucketStatus::Match);
    let found = findings(&result);
    assert!(!found.is_empty(), "the commit's keys differ");
    assert!(
        found.iter().all(|(_, kind)| *kind == FailureType::InFlight),
        "{found:?}"
    );
    assert!(result.clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_date_column_with_nulls_and_repeats_is_compared_by_day() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let date_config = ReconcileConfig {
        keys: Some(vec!["shipped_on".into()]),
        bucket_rows: 25,
        // No bucket read row by row unless tier 1 finds it different: the value sums find
        // the changed values.
        sample: 0.0,
        ..config(&lab)
    };
    let clean = reconcile(&date_config).await.expect("reconcile");
    assert_eq!(clean.key, "shipped_on");
    assert_eq!(clean.matched, clean.buckets, "{:?}", statuses(&clean));
    assert!(
        clean.bucket_list[0].lo.is_none(),
        "the first bucket holds the NULL dates"
    );
    // A NULL-date row changed, and a dated row changed: each named by its date.
    let nulls = common::query(
        &lab.lake("silver_orders"),
        "SELECT order_id FROM t WHERE shipped_on IS NULL ORDER BY order_id LIMIT 1",
    )
    .await;
    let dated = common::query(
        &lab.lake("silver_orders"),
        "SELECT order_id, CAST(shipped_on AS VARCHAR) FROM t WHERE shipped_on IS NOT NULL ORDER BY order_id LIMIT 1",
    )
    .await;
    let null_key = common::key_of(&nulls[0], 0);
    let dated_key = common::key_of(&dated[0], 0);
    let day = common::text(&dated[0], 1, 0).expect("day");
    let table = silver_table(&lab).await;
    let table = common::update_where(
        table,
        &format!("order_id = {null_key}"),
        "quantity",
        "quantity + 1",
    )
    .await;
    common::update_where(
        table,
        &format!("order_id = {dated_key}"),
        "status",
        "'tampered'",
    )
    .await;
    let result = reconcile(&date_config).await.expect("reconcile");
    let mut found = findings(&result);
    found.sort();
    let mut expected = vec![
        ("{\"shipped_on\":null}".to_string(), FailureType::RecordDiff),
        (
            format!("{{\"shipped_on\":\"{day}\"}}"),
            FailureType::RecordDiff,
        ),
    ];
    expected.sort();
    assert_eq!(found, expected);
    // Counts and day sums still match: the value sums find the changes, the NULL date's
    // in the first bucket, the other's in it or one more.
    assert_eq!(result.bucket_list[0].status, BucketStatus::Mismatch);
    assert!(
        (1..=2).contains(&result.mismatch),
        "{:?}",
        statuses(&result)
    );
    assert!(!result.verified, "a key failure is not verified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_are_refused_with_the_reason() {
    let lab = Lab::new().await;
    let refused = |config: ReconcileConfig| async move {
        reconcile(&config).await.expect_err("refused").to_string()
    };
    let error = refused(ReconcileConfig {
        bucket_rows: 0,
        ..config(&lab)
    })
    .await;
    assert!(error.contains("bucket_rows"), "{error}");
    let error = refused(ReconcileConfig {
        sample: 1.5,
        ..config(&lab)
    })
    .await;
    assert!(error.contains("sample"), "{error}");
    let error = refused(config(&lab)).await;
    assert!(error.contains("no position"), "{error}");
    let error = refused(ReconcileConfig {
        keys: Some(vec!["order_id".into(), "order_id".into()]),
        ..config(&lab)
    })
    .await;
    assert!(error.contains("named twice"), "{error}");
    let error = refused(ReconcileConfig {
        keys: Some(vec!["nope".into()]),
        ..config(&lab)
    })
    .await;
    assert!(error.contains("not a captured column"), "{error}");
    let error = refused(ReconcileConfig {
        table: "dbo.no_such_table".into(),
        ..config(&lab)
    })
    .await;
    assert!(error.contains("no_such_table"), "{error}");
}

/// A silver of dbo.orders built through a chunked bootstrap read to its end.
async fn chunked_pipeline(lab: &Lab) {
    workload(lab, 5, 300);
    let mut stream = lab.config();
    snapshot::bootstrap(&mut stream, SnapshotMode::Chunked)
        .await
        .expect("open")
        .expect("opened");
    let snapshots = snapshot::Snapshots::connect(stream.clone())
        .await
        .expect("connect");
    let options = snapshot::BackfillOptions {
        chunk_rows: 40,
        max_waves: Some(1),
        target_wave_seconds: 0.0,
        min_headroom_hours: None,
    };
    while !snapshots.backfill(&options).await.expect("wave").done {}
    run_now(stream).await;
    apply_changes(&apply_config(lab)).await.expect("apply");
}

async fn update_lake(location: &str, predicate: &str, column: &str, value: &str) {
    common::update_where(common::open_table(location).await, predicate, column, value).await;
}

fn chunk_findings(result: &ReconcileResult) -> Vec<(ChunkCheck, Option<i32>)> {
    let mut found: Vec<_> = result
        .chunk_findings
        .iter()
        .map(|finding| (finding.check, finding.chunk))
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chunks_of_a_chunked_snapshot_are_checked_against_facts_plans_and_bronze() {
    let lab = Lab::new().await;
    chunked_pipeline(&lab).await;
    let with_facts = ReconcileConfig {
        facts: Some(lab.lake("facts")),
        ..config(&lab)
    };
    let clean = reconcile(&with_facts).await.expect("reconcile");
    let snapshot = clean
        .checked_snapshot
        .expect("the chunked snapshot was checked");
    assert!(
        clean.chunk_findings.is_empty(),
        "{:?}",
        clean.chunk_findings
    );
    assert!(clean.verified);

    // A stamp below S, a chunk's facts row counting other rows, and a chunk read over other
    // bounds than planned (overlapping its neighbour).
    let facts = lab.lake("facts");
    let chunk =
        |number: i32| format!("event = 'snapshot_chunk' AND detail LIKE '%\"chunk\":{number},%'");
    update_lake(&facts, &chunk(1), "min_lsn", "'0x00000000000000000001'").await;
    update_lake(&facts, &chunk(2), "rows", "rows + 1").await;
    let plans = mssql_cdc_writer::snapshot::plans_location(&lab.lake("bronze_orders"));
    let plans_rows = common::query(
        &plans,
        "SELECT detail FROM t WHERE event = 'snapshot_chunk' AND detail LIKE '%\"chunk\":3,%'",
    )
    .await;
    let detail: serde_json::Value =
        serde_json::from_str(&common::text(&plans_rows[0], 0, 0).expect("detail")).expect("json");
    let lo = detail["lo"].as_i64().expect("an integer plan");
    let mut moved = detail.clone();
    // The seed's bound and the writer's own chunk (`planned`) alike.
    moved["lo"] = serde_json::json!(lo - 5);
    moved["planned"]["lo"] = serde_json::json!(lo - 5);
    update_lake(
        &plans,
        "event = 'snapshot_chunk' AND detail LIKE '%\"chunk\":3,%'",
        "detail",
        &format!("'{}'", moved),
    )
    .await;
    let result = reconcile(&with_facts).await.expect("reconcile");
    assert_eq!(result.checked_snapshot, Some(snapshot));
    assert_eq!(
        chunk_findings(&result),
        vec![
            (ChunkCheck::Tiling, Some(3)),
            (ChunkCheck::Rows, Some(2)),
            (ChunkCheck::Stamp, Some(1)),
        ]
    );
    assert_eq!(result.mismatch, 0, "silver itself still matches");
    assert!(!result.clean() && !result.verified);

    // A chunk's facts row gone: bronze holds rows no facts row counts.
    common::delete_where(common::open_table(&facts).await, &chunk(0)).await;
    let result = reconcile(&with_facts).await.expect("reconcile");
    assert!(
        chunk_findings(&result).contains(&(ChunkCheck::Rows, Some(0))),
        "{:?}",
        result.chunk_findings
    );
    let report = common::query(
        &lab.lake("reconcile"),
        &format!(
            "SELECT failure_type FROM t WHERE run_id = '{}' AND failure_type LIKE 'CHUNK_%' AND source_lsn IS NULL",
            result.run_id
        ),
    )
    .await;
    let rows: usize = report.iter().map(|batch| batch.num_rows()).sum();
    assert_eq!(rows, result.chunk_findings.len());
}

/// Random workloads, random corruptions of silver: reconcile (every bucket hashed) finds
/// exactly the corrupted keys, each with its failure type, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_corruptions_are_found_exactly() {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    for case in 0..3u64 {
        let seed = 1000 + case;
        let mut random = rand::rngs::StdRng::seed_from_u64(seed);
        let lab = Lab::new().await;
        workload(&lab, seed, random.random_range(150..400));
        let mut stream = lab.config();
        snapshot::bootstrap(&mut stream, SnapshotMode::Full)
            .await
            .expect("bootstrap");
        workload(&lab, seed + 1, random.random_range(20..150));
        run_now(stream).await;
        apply_changes(&apply_config(&lab)).await.expect("apply");

        let mut keys = silver_keys(&lab).await;
        let present: BTreeSet<i64> = keys.iter().copied().collect();
        keys.shuffle(&mut random);
        let deleted: Vec<i64> = keys[..random.random_range(0..6)].to_vec();
        let changed: Vec<i64> = keys[6..6 + random.random_range(0..6)].to_vec();
        let (low, high) = (
            *present.first().expect("keys"),
            *present.last().expect("keys"),
        );
        let mut added = BTreeSet::new();
        while added.len() < random.random_range(0..5) {
            let candidate = random.random_range(low..high + 50);
            if !present.contains(&candidate) {
                added.insert(candidate);
            }
        }
        let list = |keys: &[i64]| {
            keys.iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut table = silver_table(&lab).await;
        if !deleted.is_empty() {
            table = common::delete_where(table, &format!("order_id IN ({})", list(&deleted))).await;
        }
        if !changed.is_empty() {
            table = common::update_where(
                table,
                &format!("order_id IN ({})", list(&changed)),
                "amount",
                "amount + 1",
            )
            .await;
        }
        if !added.is_empty() {
            let template = common::query(
                &lab.lake("silver_orders"),
                &format!("SELECT * FROM t WHERE order_id = {}", keys[20]),
            )
            .await;
            let row = &template[0];
            let key_index = row.schema().index_of("order_id").expect("key");
            let rows: Vec<arrow::record_batch::RecordBatch> = added
                .iter()
                .map(|key| {
                    let mut columns = row.columns().to_vec();
                    columns[key_index] =
                        std::sync::Arc::new(arrow::array::Int64Array::from(vec![*key]));
                    arrow::record_batch::RecordBatch::try_new(row.schema(), columns).expect("row")
                })
                .collect();
            table
                .write(rows)
                .with_save_mode(deltalake::protocol::SaveMode::Append)
                .await
                .expect("add");
        }
        let result = reconcile(&ReconcileConfig {
            sample: 1.0,
            bucket_rows: random.random_range(10..120),
            ..config(&lab)
        })
        .await
        .expect("reconcile");
        let found: BTreeSet<(i64, FailureType)> = result
            .findings
            .iter()
            .map(|finding| {
                (
                    finding.key["order_id"].as_i64().expect("key"),
                    finding.failure_type,
                )
            })
            .collect();
        let expected: BTreeSet<(i64, FailureType)> = deleted
            .iter()
            .map(|key| (*key, FailureType::MissingTarget))
            .chain(changed.iter().map(|key| (*key, FailureType::RecordDiff)))
            .chain(added.iter().map(|key| (*key, FailureType::MissingSource)))
            .collect();
        assert_eq!(found, expected, "case seed {seed}");
        assert_eq!(result.verified, expected.is_empty(), "case seed {seed}");
        let mismatched = result.mismatch > 0;
        assert_eq!(
            mismatched,
            !deleted.is_empty() || !added.is_empty(),
            "case seed {seed}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_exits_zero_only_when_silver_matches() {
    let lab = Lab::new().await;
    pipeline(&lab).await;
    let run = |extra: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
        command.args([
            "reconcile",
            "--server",
            &lab.url,
            "--table",
            "dbo.orders",
            "--silver",
            &lab.lake("silver_orders"),
            "--bronze",
            &lab.lake("bronze_orders"),
            "--control",
            &lab.lake("control"),
            "--bucket-rows",
            "50",
        ]);
        command.args(extra);
        command.output().expect("run the writer")
    };
    // The value sums compare every value without reading a bucket row by row.
    let clean = tokio::task::block_in_place(|| run(&["--sample", "0"]));
    let text = String::from_utf8_lossy(&clean.stdout);
    assert!(clean.status.success(), "{text}");
    assert!(
        text.contains("0 hashed") && text.contains("verified: silver equals the source at"),
        "{text}"
    );
    // Every bucket read row by row: silver equals the source.
    let every_value = tokio::task::block_in_place(|| run(&["--sample", "1"]));
    let text = String::from_utf8_lossy(&every_value.stdout);
    assert!(every_value.status.success(), "{text}");
    assert!(
        text.contains("verified: silver equals the source at")
            && text.contains("every value of every row compared"),
        "{text}"
    );
    let keys = silver_keys(&lab).await;
    common::delete_where(silver_table(&lab).await, &format!("order_id = {}", keys[3])).await;
    let broken = tokio::task::block_in_place(|| run(&["--output", "json"]));
    assert_eq!(broken.status.code(), Some(1));
    let result: serde_json::Value = serde_json::from_slice(&broken.stdout).expect("json");
    assert_eq!(result["failures"]["MISSING_TARGET"], 1);
    assert_eq!(result["findings"][0]["key"]["order_id"], keys[3]);
    let usage = tokio::task::block_in_place(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
            .args(["reconcile", "--table", "dbo.orders"])
            .output()
            .expect("run the writer")
    });
    assert_eq!(
        usage.status.code(),
        Some(2),
        "a usage error names the missing flags"
    );
    assert!(String::from_utf8_lossy(&usage.stderr).contains("--silver"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_is_refused_unless_a_key_column_is_named() {
    let lab = Lab::with_tables(&[mssql_cdc_flight::sim::sample::events()]).await;
    lab.workload(91, 200);
    let stream = mssql_cdc_writer::stream::StreamConfig {
        table: "dbo.events".into(),
        target: lab.lake("bronze_events"),
        app_id: "events".into(),
        checkpoint: lab
            .dir
            .path()
            .join("checkpoint_events")
            .display()
            .to_string(),
        ..lab.config()
    };
    run_now(stream).await;
    apply_changes(&ApplyConfig {
        table: "dbo.events".into(),
        bronze: lab.lake("bronze_events"),
        target: lab.lake("silver_events"),
        keys: vec!["id".into()],
        ..apply_config(&lab)
    })
    .await
    .expect("apply");
    let heap = ReconcileConfig {
        table: "dbo.events".into(),
        silver: lab.lake("silver_events"),
        bronze: lab.lake("bronze_events"),
        sample: 1.0,
        ..config(&lab)
    };
    let refused = reconcile(&heap).await.expect_err("no unique index");
    assert!(refused.to_string().contains("no unique index"), "{refused}");
    let keyed = reconcile(&ReconcileConfig {
        keys: Some(vec!["id".into()]),
        ..heap.clone()
    })
    .await
    .expect("reconcile on id");
    assert!(keyed.verified && keyed.hashed == keyed.buckets, "{keyed:?}");
    // A repeated integer column with NULLs compares too: the rows of a value as a multiset.
    let repeated = reconcile(&ReconcileConfig {
        keys: Some(vec!["kind".into()]),
        ..heap
    })
    .await
    .expect("reconcile on kind");
    assert!(repeated.verified, "{repeated:?}");
}

/// Every wave of the open chunked snapshot of `stream`'s table.
async fn backfill(stream: &mssql_cdc_writer::stream::StreamConfig) {
    Snapshots::connect(stream.clone())
        .await
        .expect("connect")
        .backfill(&BackfillOptions::default())
        .await
        .expect("backfill");
}

/// The field names of the Delta table at `location`.
async fn field_names(location: &str) -> Vec<String> {
    let table = common::open_table(location).await;
    let schema = table.snapshot().expect("snapshot").schema();
    schema
        .fields()
        .map(|field| field.name().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_left_out_never_reach_the_lake_and_reconcile_verifies_the_rest() {
    let lab = Lab::new().await;
    workload(&lab, 1, 200);
    let except = ColumnSelection::Except(vec!["NOTE".into(), "discount_rate".into()]);
    let mut stream = lab.config();
    // Refused before anything is read: a key column, and a name no instance captures.
    for (refused, why) in [
        (
            ColumnSelection::Except(vec!["Order_ID".into()]),
            "key column 'order_id'",
        ),
        (
            ColumnSelection::Only(vec!["amount".into()]),
            "key column 'order_id'",
        ),
        (ColumnSelection::Except(vec!["nite".into()]), "'nite'"),
    ] {
        let mut bad = stream.clone();
        bad.columns = Some(refused);
        let error = Stream::connect(bad.clone()).await.err().expect("refused");
        assert!(error.to_string().contains(why), "{error}");
        let error = snapshot::open(&bad, SnapshotMode::Chunked, false)
            .await
            .expect_err("refused");
        assert!(error.to_string().contains(why), "{error}");
    }
    // The bootstrap creates bronze recording the selection; the stream follows it.
    stream.columns = Some(except.clone());
    snapshot::bootstrap(&mut stream, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    workload(&lab, 2, 120);
    run_now(stream.clone()).await;
    let left_out = |fields: &[String]| {
        fields
            .iter()
            .any(|field| field == "note" || field == "discount_rate")
    };
    let bronze = field_names(&lab.lake("bronze_orders")).await;
    assert!(
        !left_out(&bronze) && bronze.contains(&"amount".to_string()),
        "{bronze:?}"
    );
    apply_changes(&apply_config(&lab)).await.expect("apply");
    assert!(!left_out(&field_names(&lab.lake("silver_orders")).await));
    let source = common::source_rows_of(&lab, "dbo.orders", "order_id", &except).await;
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        source
    );

    // Reconcile follows bronze's selection and verifies every value it copies; given
    // another selection, it is refused.
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    assert!(result.values_verified, "{}", rendered_verdict(&result));
    assert_eq!(result.excluded_columns, ["note", "discount_rate"]);
    let other = ReconcileConfig {
        columns: Some(ColumnSelection::Except(vec!["note".into()])),
        ..config(&lab)
    };
    let refused = reconcile(&other).await.expect_err("another selection");
    assert!(refused.to_string().contains("records"), "{refused}");

    // A snapshot command given no selection follows bronze's; one given another is refused.
    let mut unflagged = stream.clone();
    unflagged.columns = None;
    snapshot::open(&unflagged, SnapshotMode::Chunked, true)
        .await
        .expect("re-snapshot");
    let mut changed = stream.clone();
    changed.columns = Some(ColumnSelection::Except(vec!["note".into()]));
    let refused = Snapshots::connect(changed.clone())
        .await
        .err()
        .expect("refused");
    assert!(refused.to_string().contains("records"), "{refused}");
    backfill(&unflagged).await;
    assert!(!left_out(&field_names(&lab.lake("bronze_orders")).await));

    // The stream changes it: recorded on bronze, and a chunked snapshot opened under the old
    // one is abandoned (its waves would copy the old columns); a new one reads the new.
    workload(&lab, 3, 40);
    snapshot::open(&unflagged, SnapshotMode::Chunked, true)
        .await
        .expect("re-snapshot");
    workload(&lab, 4, 40);
    run_now(changed.clone()).await;
    let state = snapshot::state(&unflagged).await.expect("state");
    assert_eq!(state.status.state, "abandoned", "{state:?}");
    let bronze = field_names(&lab.lake("bronze_orders")).await;
    assert!(bronze.contains(&"discount_rate".to_string()), "{bronze:?}");
    assert!(!bronze.contains(&"note".to_string()), "{bronze:?}");
    snapshot::open(&unflagged, SnapshotMode::Chunked, true)
        .await
        .expect("a new re-snapshot");
    backfill(&unflagged).await;
    apply_changes(&apply_config(&lab)).await.expect("apply");
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    assert!(result.values_verified, "{}", rendered_verdict(&result));

    // Left out again while silver holds it: its values there are unchecked, so not verified.
    run_now(stream.clone()).await;
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    assert!(result.verified && !result.values_verified);
    assert_eq!(result.uncompared_columns, ["discount_rate"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_snapshot_under_other_columns_than_the_tables_is_abandoned_not_stuck() {
    let lab = Lab::new().await;
    workload(&lab, 1, 60);
    let mut stream = lab.config();
    // Opened with every column before bronze exists; the stream then leaves `note` out.
    snapshot::open(&stream, SnapshotMode::Chunked, false)
        .await
        .expect("open");
    stream.columns = Some(ColumnSelection::Except(vec!["note".into()]));
    let refused = Snapshots::connect(stream.clone())
        .await
        .expect("connect")
        .backfill(&BackfillOptions::default())
        .await
        .expect_err("no bronze yet: the open row is the only record");
    assert!(refused.to_string().contains("no bronze yet"), "{refused}");
    run_now(stream.clone()).await;
    let state = snapshot::state(&stream).await.expect("state");
    assert_eq!(state.status.state, "abandoned", "{state:?}");
    assert!(
        !field_names(&lab.lake("bronze_orders"))
            .await
            .contains(&"note".to_string())
    );

    // Opened under bronze's selection, which changes before its waves are read (a stream's
    // change racing the open): the backfill abandons it instead of failing for ever.
    workload(&lab, 2, 20);
    snapshot::open(&stream, SnapshotMode::Chunked, true)
        .await
        .expect("re-snapshot");
    common::open_table(&lab.lake("bronze_orders"))
        .await
        .set_tbl_properties()
        .with_properties(std::collections::HashMap::from([(
            mssql_cdc_writer::columns::PROPERTY.to_string(),
            r#"{"except_columns": ["note", "amount"]}"#.to_string(),
        )]))
        .with_raise_if_not_exists(false)
        .await
        .expect("the selection changed");
    let mut unflagged = stream.clone();
    unflagged.columns = None;
    let status = Snapshots::connect(unflagged)
        .await
        .expect("connect")
        .backfill(&BackfillOptions::default())
        .await
        .expect("backfill");
    assert_eq!(status.state, "abandoned", "{status:?}");
}

/// The key the masked lab's server hashes with.
const HASH_KEY: &[u8] = b"the reconcile test's hash key, 32+ bytes";

/// dbo.orders served with its note hashed and its status cut to two characters.
fn order_masks() -> mssql_cdc_flight::flight::masking::MaskPolicy {
    let json = serde_json::json!({
        "hash_key_file": "mask.key",
        "tables": {"dbo.orders": {"note": "hash", "status": "truncate(2)"}},
    });
    mssql_cdc_flight::flight::masking::MaskPolicy::parse(json.to_string().as_bytes(), |_| {
        Ok(HASH_KEY.to_vec())
    })
    .expect("masks")
}

/// `(order_id, note, status)` of every row `batches` hold, texts as Rust strings.
fn orders_texts(
    batches: &[arrow::array::RecordBatch],
) -> Vec<(i64, Option<String>, Option<String>)> {
    use arrow::array::{Array, AsArray};
    let mut rows = Vec::new();
    for batch in batches {
        let text = |name: &str| {
            let column = batch.column_by_name(name).expect("column");
            arrow::compute::cast(column, &arrow::datatypes::DataType::Utf8).expect("text")
        };
        let (note, status) = (text("note"), text("status"));
        let ids = arrow::compute::cast(
            batch.column_by_name("order_id").expect("key"),
            &arrow::datatypes::DataType::Int64,
        )
        .expect("ids");
        let ids = ids.as_primitive::<arrow::datatypes::Int64Type>();
        let value = |column: &arrow::array::ArrayRef, row: usize| {
            let column = column.as_string::<i32>();
            (!column.is_null(row)).then(|| column.value(row).to_string())
        };
        for row in 0..batch.num_rows() {
            rows.push((ids.value(row), value(&note, row), value(&status, row)));
        }
    }
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_columns_reach_the_lake_masked_and_reconcile_compares_them_so() {
    let lab = Lab::masked(order_masks()).await;
    pipeline(&lab).await;
    // The clear rows, from a server of the same database without masks.
    let clear_server = mssql_cdc_flight::flight::local::LocalServer::start(
        std::sync::Arc::new(lab.db.clone()),
        mssql_cdc_flight::flight::ticket::TicketSigner::random().expect("key"),
    )
    .await
    .expect("server");
    let client = mssql_cdc_flight::client::CdcClient::connect(&clear_server.url)
        .await
        .expect("connect");
    let plan = client
        .plan_snapshot(&mssql_cdc_proto::protocol::SnapshotCommand::new(
            "dbo.orders",
        ))
        .await
        .expect("plan");
    let mut clear = Vec::new();
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.as_ref().expect("ticket");
        clear.extend(client.collect_endpoint(ticket).await.expect("read").0);
    }
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, HASH_KEY);
    let expected: Vec<_> = orders_texts(&clear)
        .into_iter()
        .map(|(id, note, status)| {
            let hash = note.map(|note| hex::encode(ring::hmac::sign(&key, note.as_bytes())));
            (
                id,
                hash,
                status.map(|status| status.chars().take(2).collect::<String>()),
            )
        })
        .collect();
    assert!(expected.iter().any(|row| row.1.is_some()), "notes to hash");
    // Silver holds the masked form of every current row: the keyed hash, the cut text.
    let silver = common::query(&lab.lake("silver_orders"), "SELECT * FROM t").await;
    assert_eq!(orders_texts(&silver), expected);
    // Bronze holds no clear note or status either.
    let bronze = common::query(&lab.lake("bronze_orders"), "SELECT * FROM t").await;
    let clear_notes: BTreeSet<String> = orders_texts(&clear)
        .into_iter()
        .filter_map(|row| row.1)
        .collect();
    for (_, note, status) in orders_texts(&bronze) {
        assert!(note.is_none_or(|note| note.len() == 64 && !clear_notes.contains(&note)));
        assert!(status.is_none_or(|status| status.chars().count() <= 2));
    }
    // Bronze records what it holds masked; a stream through a server that serves the
    // column clear (a replica started without the masks file) is refused before it reads.
    let recorded =
        mssql_cdc_writer::masks::recorded(&common::open_table(&lab.lake("bronze_orders")).await)
            .expect("recorded");
    assert_eq!(
        recorded,
        mssql_cdc_writer::masks::Masks::from([
            ("note".into(), "hash".into()),
            ("status".into(), "truncate(2)".into()),
        ])
    );
    let mut through_clear = lab.config();
    through_clear.server = clear_server.url.clone();
    let refused = Stream::connect(through_clear)
        .await
        .err()
        .expect("a clear replica");
    assert!(
        refused
            .to_string()
            .contains("no clear value joins the lake"),
        "{refused}"
    );
    clear_server.stop().await.expect("stopped");

    // Value sums cover the unmasked columns; the masked ones are compared row by row.
    let result = reconcile(&config(&lab)).await.expect("reconcile");
    let rendered = mssql_cdc_writer::reconcile::render(&result);
    assert!(result.verified && result.value_sums, "{rendered}");
    assert_eq!(result.masked_columns, ["status", "note"], "{rendered}");
    assert!(!result.values_verified, "masked columns unread: {rendered}");
    assert!(rendered.contains("serves masked"), "{rendered}");
    let every_row = ReconcileConfig {
        sample: 1.0,
        ..config(&lab)
    };
    let result = reconcile(&every_row).await.expect("reconcile");
    assert!(
        result.values_verified,
        "{}",
        mssql_cdc_writer::reconcile::render(&result)
    );
    // A masked value changed in silver is found, compared in its masked form.
    let changed = silver_keys(&lab).await[3];
    update_lake(
        &lab.lake("silver_orders"),
        &format!("order_id = {changed}"),
        "note",
        "'0000000000000000000000000000000000000000000000000000000000000000'",
    )
    .await;
    let result = reconcile(&every_row).await.expect("reconcile");
    assert_eq!(
        result.findings.len(),
        1,
        "{}",
        mssql_cdc_writer::reconcile::render(&result)
    );
    let finding = &result.findings[0];
    assert_eq!(
        (finding.key["order_id"].as_i64(), finding.failure_type),
        (Some(changed), FailureType::RecordDiff)
    );
}
