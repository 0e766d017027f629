//! Reconcile on keys a grid cannot sum, against the in-process server and silver tables the
//! pipeline built: the composite unique index `(region, code)` of dbo.accounts, whose
//! leading column repeats in mixed case under the simulated database's case-insensitive
//! collation, and the repeated, nullable text column `source` of the heap dbo.events. The
//! source cuts the buckets (`key_bound`); each injected fault is found with its key and
//! failure type and nothing else; changes not applied yet are IN_FLIGHT, never MISMATCH.

mod common;

use std::sync::Arc;

use arrow::array::{Array, RecordBatch, StringArray};
use common::{Lab, run_now, text};
use mssql_cdc_flight::sim::sample;
use mssql_cdc_proto::keys::Bound;
use mssql_cdc_writer::reconcile::{
    BucketStatus, FailureType, ReconcileConfig, ReconcileResult, reconcile,
};
use mssql_cdc_writer::silver::{ApplyConfig, apply_changes};
use mssql_cdc_writer::snapshot::{self, SnapshotMode};

fn apply_config(lab: &Lab, table: &str, name: &str, keys: &[&str]) -> ApplyConfig {
    ApplyConfig {
        table: table.into(),
        bronze: lab.lake(&format!("bronze_{name}")),
        target: lab.lake(&format!("silver_{name}")),
        keys: keys.iter().map(|key| key.to_string()).collect(),
        ..common::orders_apply_config(lab)
    }
}

/// A silver of `table` in step with the source: a full bootstrap, changes, apply.
async fn pipeline(lab: &Lab, table: &str, name: &str, keys: &[&str]) {
    lab.workload(81, 300);
    let mut config = lab.stream_of(table, name);
    snapshot::bootstrap(&mut config, SnapshotMode::Full)
        .await
        .expect("bootstrap");
    lab.workload(82, 100);
    run_now(config).await;
    apply_changes(&apply_config(lab, table, name, keys))
        .await
        .expect("apply");
}

async fn accounts() -> Lab {
    let lab = Lab::with_tables(&[sample::accounts()]).await;
    pipeline(&lab, "dbo.accounts", "accounts", &["region", "code"]).await;
    lab
}

fn config(lab: &Lab, table: &str, name: &str) -> ReconcileConfig {
    ReconcileConfig {
        bucket_rows: 40,
        sample: 0.0,
        seed: Some(7),
        report: Some(lab.lake("reconcile")),
        ..ReconcileConfig::new(
            &lab.url,
            table,
            &lab.lake(&format!("silver_{name}")),
            &lab.lake(&format!("bronze_{name}")),
            &lab.lake("control"),
        )
    }
}

fn accounts_config(lab: &Lab) -> ReconcileConfig {
    config(lab, "dbo.accounts", "accounts")
}

fn findings(result: &ReconcileResult) -> Vec<(String, FailureType)> {
    let mut found: Vec<(String, FailureType)> = result
        .findings
        .iter()
        .map(|finding| (finding.key.to_string(), finding.failure_type))
        .collect();
    found.sort();
    found
}

fn statuses(result: &ReconcileResult) -> Vec<BucketStatus> {
    result
        .bucket_list
        .iter()
        .map(|bucket| bucket.status)
        .collect()
}

async fn silver_table(lab: &Lab, name: &str) -> deltalake::DeltaTable {
    common::open_table(&lab.lake(&format!("silver_{name}"))).await
}

/// Silver's rows `WHERE condition`, whole.
async fn silver_rows(lab: &Lab, name: &str, condition: &str) -> Vec<RecordBatch> {
    common::query(
        &lab.lake(&format!("silver_{name}")),
        &format!("SELECT * FROM t WHERE {condition}"),
    )
    .await
    .into_iter()
    .filter(|batch| batch.num_rows() > 0)
    .collect()
}

/// `(region, code)` of the silver row of account `id`.
async fn account_key(lab: &Lab, id: i64) -> (String, String) {
    let rows = silver_rows(lab, "accounts", &format!("id = {id}")).await;
    let column = |name: &str| {
        let index = rows[0].schema().index_of(name).expect("column");
        text(&rows[0], index, 0).expect("a key column is not NULL")
    };
    (column("region"), column("code"))
}

fn key_json(region: &str, code: &str) -> String {
    serde_json::json!({"region": region, "code": code}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_composite_case_insensitive_key_in_step_is_verified_on_the_sources_buckets() {
    let lab = accounts().await;
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..accounts_config(&lab)
    })
    .await
    .expect("reconcile");
    assert_eq!(result.key, "region, code");
    assert!(!result.key_sums, "a keyset key's buckets count rows only");
    assert!(result.buckets >= 3, "{} buckets", result.buckets);
    assert_eq!(result.matched, result.buckets, "{:?}", statuses(&result));
    assert_eq!(
        result.hashed, result.buckets,
        "sample 1 hashes every bucket"
    );
    assert!(result.findings.is_empty(), "{:?}", findings(&result));
    assert!(result.verified && result.clean());
    // The buckets tile the key on the source's own bounds: two values each, in order.
    for pair in result.bucket_list.windows(2) {
        assert_eq!(pair[0].hi, pair[1].lo);
        match &pair[0].hi {
            Some(Bound::Keys(tuple)) => assert_eq!(tuple.len(), 2, "{tuple:?}"),
            other => panic!("a keyset bucket ends at a key tuple, not {other:?}"),
        }
    }
    assert_eq!(result.bucket_list[0].lo, None);
    assert_eq!(result.bucket_list.last().expect("a bucket").hi, None);
    let rows: u64 = result
        .bucket_list
        .iter()
        .map(|bucket| bucket.source.rows)
        .sum();
    let silver: usize = silver_rows(&lab, "accounts", "TRUE")
        .await
        .iter()
        .map(|batch| batch.num_rows())
        .sum();
    assert_eq!(rows, silver as u64);
    assert!(
        result
            .bucket_list
            .iter()
            .all(|bucket| bucket.source.rows <= 2 * 40),
        "about bucket_rows rows a bucket"
    );
    // The report: bounds as the source's tuples, no key sums.
    let report = common::query(
        &lab.lake("reconcile"),
        "SELECT bucket_lo, source_key_sum, silver_key_sum FROM t WHERE status IS NOT NULL \
         AND bucket_lo IS NOT NULL",
    )
    .await;
    let mut bounds = 0;
    for batch in &report {
        for row in 0..batch.num_rows() {
            let lo: serde_json::Value =
                serde_json::from_str(&text(batch, 0, row).expect("lo")).expect("json");
            assert_eq!(lo.as_array().map(Vec::len), Some(2), "{lo}");
            assert!(batch.column(1).is_null(row) && batch.column(2).is_null(row));
            bounds += 1;
        }
    }
    assert_eq!(bounds, result.buckets - 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_on_a_composite_key_is_found_with_its_key_and_nothing_else() {
    let lab = accounts().await;
    let ids: Vec<i64> = silver_rows(&lab, "accounts", "TRUE")
        .await
        .iter()
        .flat_map(|batch| (0..batch.num_rows()).map(|row| common::integer_at(batch, "id", row)))
        .collect();
    assert!(ids.len() > 150, "{} rows", ids.len());
    let (deleted, changed, recased) = (ids[10], ids[ids.len() / 2], ids[ids.len() - 5]);
    let deleted_key = account_key(&lab, deleted).await;
    let changed_key = account_key(&lab, changed).await;
    let recased_key = account_key(&lab, recased).await;
    let table = silver_table(&lab, "accounts").await;
    let table = common::delete_where(table, &format!("id = {deleted}")).await;
    let table = common::update_where(
        table,
        &format!("id = {changed}"),
        "balance",
        "coalesce(balance, 0) + 1",
    )
    .await;
    // Silver holds the region in other letters: equal under the source's collation, but not
    // the value the source holds, so it is that key missing and another one added.
    let table = common::update_where(
        table,
        &format!("id = {recased}"),
        "region",
        "concat(upper(region), '~')",
    )
    .await;
    let template = silver_rows(&lab, "accounts", &format!("id = {changed}")).await;
    let row = &template[0];
    let mut columns = row.columns().to_vec();
    let region = row.schema().index_of("region").expect("region");
    let region_type = row.schema().field(region).data_type().clone();
    columns[region] = arrow::compute::cast(
        &(Arc::new(StringArray::from(vec!["Atlantis"])) as arrow::array::ArrayRef),
        &region_type,
    )
    .expect("region");
    let added = RecordBatch::try_new(row.schema(), columns).expect("row");
    let added_key = ("Atlantis".to_string(), changed_key.1.clone());
    table
        .write(vec![added])
        .with_save_mode(deltalake::protocol::SaveMode::Append)
        .await
        .expect("add a row");
    let recased_silver = format!("{}~", recased_key.0.to_uppercase());

    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..accounts_config(&lab)
    })
    .await
    .expect("reconcile");
    let mut expected = vec![
        (
            key_json(&deleted_key.0, &deleted_key.1),
            FailureType::MissingTarget,
        ),
        (
            key_json(&changed_key.0, &changed_key.1),
            FailureType::RecordDiff,
        ),
        (
            key_json(&added_key.0, &added_key.1),
            FailureType::MissingSource,
        ),
        (
            key_json(&recased_key.0, &recased_key.1),
            FailureType::MissingTarget,
        ),
        (
            key_json(&recased_silver, &recased_key.1),
            FailureType::MissingSource,
        ),
    ];
    expected.sort();
    assert_eq!(findings(&result), expected);
    let diff = result
        .findings
        .iter()
        .find(|finding| finding.failure_type == FailureType::RecordDiff)
        .expect("diff");
    assert_eq!(diff.columns, vec!["balance".to_string()]);
    let added_finding = result
        .findings
        .iter()
        .find(|finding| {
            finding.key == serde_json::json!({"region": added_key.0, "code": added_key.1})
        })
        .expect("added");
    assert!(
        added_finding.silver_start_lsn.is_some(),
        "silver's LSN of the row"
    );
    // Only the buckets of the two keys silver lacks count short, by one row each; the keys
    // silver holds alone lie in no bucket.
    let short: u64 = result
        .bucket_list
        .iter()
        .map(|bucket| bucket.source.rows - bucket.silver.rows)
        .sum();
    assert_eq!(short, 2, "{:?}", result.bucket_list);
    for bucket in &result.bucket_list {
        let expected = match bucket.source.rows == bucket.silver.rows {
            true => BucketStatus::Match,
            false => BucketStatus::Mismatch,
        };
        assert_eq!(bucket.status, expected, "{bucket:?}");
    }
    assert!(!result.verified);

    // At sample 0, value sums (the default) on a keyset key read every bucket row by row:
    // the same findings, every value compared.
    let valued = reconcile(&accounts_config(&lab)).await.expect("reconcile");
    assert_eq!(valued.hashed, valued.buckets);
    assert_eq!(findings(&valued), expected);
    assert!(!valued.value_sums, "a keyset source sums no values");

    // Without value sums, the changed value is found only if its bucket mismatches; the
    // keys silver lacks or holds alone are found either way.
    let unsampled = reconcile(&ReconcileConfig {
        value_sums: false,
        ..accounts_config(&lab)
    })
    .await
    .expect("reconcile");
    assert_eq!(unsampled.hashed, unsampled.mismatch);
    let found = findings(&unsampled);
    for (key, failure) in &expected {
        if *failure != FailureType::RecordDiff {
            assert!(
                found.contains(&(key.clone(), *failure)),
                "{key} in {found:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_not_applied_yet_on_a_composite_key_are_in_flight_never_mismatch() {
    let lab = accounts().await;
    // Committed to the source, in neither bronze nor silver.
    lab.workload(83, 80);
    let result = reconcile(&ReconcileConfig {
        sample: 1.0,
        ..accounts_config(&lab)
    })
    .await
    .expect("reconcile");
    assert_eq!(result.mismatch, 0, "{:?}", result.bucket_list);
    assert!(result.in_flight > 0, "{:?}", statuses(&result));
    assert!(
        result
            .findings
            .iter()
            .all(|finding| finding.failure_type == FailureType::InFlight),
        "{:?}",
        findings(&result)
    );
    assert!(result.verified, "in flight is not a failure");
    // Streamed and applied: every bucket matches.
    run_now(lab.stream_of("dbo.accounts", "accounts")).await;
    apply_changes(&apply_config(
        &lab,
        "dbo.accounts",
        "accounts",
        &["region", "code"],
    ))
    .await
    .expect("apply");
    let after = reconcile(&accounts_config(&lab)).await.expect("reconcile");
    assert_eq!(after.matched, after.buckets, "{:?}", statuses(&after));
    assert!(after.findings.is_empty(), "{:?}", findings(&after));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_text_column_with_nulls_compares_each_value_as_a_multiset() {
    let lab = Lab::with_tables(&[sample::events()]).await;
    pipeline(&lab, "dbo.events", "events", &["id"]).await;
    let on_source = ReconcileConfig {
        keys: Some(vec!["source".into()]),
        sample: 1.0,
        ..config(&lab, "dbo.events", "events")
    };
    let clean = reconcile(&on_source).await.expect("reconcile on source");
    assert!(clean.verified, "{:?}", clean.bucket_list);
    assert!(clean.buckets >= 3, "{} buckets", clean.buckets);
    // One row's payload changed: its value of `source` (maybe NULL) differs, nothing else.
    let rows = silver_rows(&lab, "events", "TRUE").await;
    let id = common::integer_at(&rows[0], "id", 3);
    let index = rows[0].schema().index_of("source").expect("source");
    let value = text(&rows[0], index, 3);
    common::update_where(
        silver_table(&lab, "events").await,
        &format!("id = {id}"),
        "payload",
        "concat(coalesce(payload, ''), '!')",
    )
    .await;
    let result = reconcile(&on_source).await.expect("reconcile");
    assert_eq!(
        findings(&result),
        vec![(
            serde_json::json!({ "source": value }).to_string(),
            FailureType::RecordDiff
        )]
    );
    assert_eq!(
        result.mismatch,
        0,
        "counts still match: {:?}",
        statuses(&result)
    );

    // A second copy of a row with another value of `source`: that value's bucket counts one
    // silver row more than the source's and mismatches; row by row the value's rows differ.
    let (copied, copied_value) = (0..rows[0].num_rows())
        .map(|row| (row, text(&rows[0], index, row)))
        .find(|(_, other)| *other != value)
        .expect("another value");
    let mut columns = rows[0].slice(copied, 1).columns().to_vec();
    let id_index = rows[0].schema().index_of("id").expect("id");
    columns[id_index] = Arc::new(arrow::array::Int64Array::from(vec![1_000_000]));
    silver_table(&lab, "events")
        .await
        .write(vec![
            RecordBatch::try_new(rows[0].schema(), columns).expect("row"),
        ])
        .with_save_mode(deltalake::protocol::SaveMode::Append)
        .await
        .expect("add a copy");
    let result = reconcile(&on_source).await.expect("reconcile");
    let mut expected = vec![
        (
            serde_json::json!({ "source": value }).to_string(),
            FailureType::RecordDiff,
        ),
        (
            serde_json::json!({ "source": copied_value }).to_string(),
            FailureType::RecordDiff,
        ),
    ];
    expected.sort();
    assert_eq!(findings(&result), expected);
    assert_eq!(result.mismatch, 1, "{:?}", statuses(&result));
    let extra: Vec<i64> = result
        .bucket_list
        .iter()
        .map(|bucket| bucket.silver.rows as i64 - bucket.source.rows as i64)
        .collect();
    assert_eq!(extra.iter().sum::<i64>(), 1, "{extra:?}");
}

/// Random workloads, random corruptions of a composite-keyed silver: reconcile (every
/// bucket hashed, random bucket sizes) finds exactly the corrupted keys, each with its
/// failure type, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_corruptions_on_a_composite_key_are_found_exactly() {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    for case in 0..3u64 {
        let seed = 2000 + case;
        let mut random = rand::rngs::StdRng::seed_from_u64(seed);
        let lab = Lab::with_tables(&[sample::accounts()]).await;
        lab.workload(seed, random.random_range(150..400));
        let mut stream = lab.stream_of("dbo.accounts", "accounts");
        snapshot::bootstrap(&mut stream, SnapshotMode::Full)
            .await
            .expect("bootstrap");
        lab.workload(seed + 1, random.random_range(20..150));
        run_now(stream).await;
        apply_changes(&apply_config(
            &lab,
            "dbo.accounts",
            "accounts",
            &["region", "code"],
        ))
        .await
        .expect("apply");

        let mut rows: Vec<(i64, String)> = Vec::new();
        for batch in silver_rows(&lab, "accounts", "TRUE").await {
            let (region, code) = (
                batch.schema().index_of("region").expect("region"),
                batch.schema().index_of("code").expect("code"),
            );
            for row in 0..batch.num_rows() {
                let key = key_json(
                    &text(&batch, region, row).expect("region"),
                    &text(&batch, code, row).expect("code"),
                );
                rows.push((common::integer_at(&batch, "id", row), key));
            }
        }
        rows.shuffle(&mut random);
        let deleted = &rows[..random.random_range(0..6)];
        let changed = &rows[6..6 + random.random_range(0..6)];
        let added: Vec<String> = (0..random.random_range(0..5))
            .map(|number| format!("added{seed}-{number}"))
            .collect();
        let ids = |rows: &[(i64, String)]| {
            rows.iter()
                .map(|(id, _)| id.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut table = silver_table(&lab, "accounts").await;
        if !deleted.is_empty() {
            table = common::delete_where(table, &format!("id IN ({})", ids(deleted))).await;
        }
        if !changed.is_empty() {
            table = common::update_where(
                table,
                &format!("id IN ({})", ids(changed)),
                "note",
                "concat(coalesce(note, ''), '!')",
            )
            .await;
        }
        if !added.is_empty() {
            let template = silver_rows(&lab, "accounts", &format!("id = {}", rows[20].0)).await;
            let row = &template[0];
            let code = row.schema().index_of("code").expect("code");
            let batches: Vec<RecordBatch> = added
                .iter()
                .map(|new_code| {
                    let mut columns = row.columns().to_vec();
                    let value: arrow::array::ArrayRef =
                        Arc::new(StringArray::from(vec![new_code.as_str()]));
                    columns[code] =
                        arrow::compute::cast(&value, row.schema().field(code).data_type())
                            .expect("code");
                    RecordBatch::try_new(row.schema(), columns).expect("row")
                })
                .collect();
            table
                .write(batches)
                .with_save_mode(deltalake::protocol::SaveMode::Append)
                .await
                .expect("add");
        }
        let template_region = {
            let template = silver_rows(&lab, "accounts", &format!("id = {}", rows[20].0)).await;
            let index = template[0].schema().index_of("region").expect("region");
            text(&template[0], index, 0).expect("region")
        };
        let result = reconcile(&ReconcileConfig {
            sample: 1.0,
            bucket_rows: random.random_range(10..120),
            ..accounts_config(&lab)
        })
        .await
        .expect("reconcile");
        let mut expected: Vec<(String, FailureType)> = deleted
            .iter()
            .map(|(_, key)| (key.clone(), FailureType::MissingTarget))
            .chain(
                changed
                    .iter()
                    .map(|(_, key)| (key.clone(), FailureType::RecordDiff)),
            )
            .chain(
                added
                    .iter()
                    .map(|code| (key_json(&template_region, code), FailureType::MissingSource)),
            )
            .collect();
        expected.sort();
        assert_eq!(findings(&result), expected, "case {case}");
        assert_eq!(result.verified, expected.is_empty(), "case {case}");
    }
}
