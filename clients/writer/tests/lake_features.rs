//! Tables another engine altered: a bronze that gained deletion vectors and a silver created
//! partitioned are refused before anything is written, naming the feature.

mod common;

use common::{Lab, bronze_rows, run_now, try_run_now};
use deltalake::kernel::{DataType, StructField};
use mssql_cdc_writer::silver::apply_changes;
use mssql_cdc_writer::tables;

/// Commits, as another engine would, a protocol action adding `feature` to bronze's reader
/// and writer features.
async fn add_table_feature(location: &str, feature: &str) {
    let table = tables::open(&tables::table_url(location).expect("url"))
        .await
        .expect("open")
        .expect("a table");
    let snapshot = table.snapshot().expect("snapshot");
    let mut protocol = serde_json::to_value(snapshot.protocol()).expect("protocol");
    protocol["minReaderVersion"] = 3.into();
    protocol["minWriterVersion"] = 7.into();
    for key in ["readerFeatures", "writerFeatures"] {
        let mut features = protocol[key].as_array().cloned().unwrap_or_default();
        features.push(feature.into());
        protocol[key] = features.into();
    }
    let version = snapshot.version() + 1;
    let commit = format!(
        "{}\n{}\n",
        serde_json::json!({"commitInfo": {"timestamp": 0, "operation": "SET TBLPROPERTIES", "engineInfo": "another engine"}}),
        serde_json::json!({"protocol": protocol})
    );
    std::fs::write(
        std::path::Path::new(location)
            .join("_delta_log")
            .join(format!("{version:020}.json")),
        commit,
    )
    .expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bronze_with_deletion_vectors_is_refused_with_nothing_written() {
    let lab = Lab::new().await;
    lab.workload(91, 40);
    let config = lab.config();
    run_now(config.clone()).await;
    let before = bronze_rows(&lab).await.expect("bronze");
    add_table_feature(&config.target, "deletionVectors").await;
    lab.workload(92, 20);
    let error = try_run_now(config).await.expect_err("refused");
    let message = error.to_string();
    assert!(
        message.contains("table feature deletionVectors"),
        "{message}"
    );
    assert!(message.contains("Nothing was written"), "{message}");
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silver_created_partitioned_elsewhere_is_refused() {
    let lab = Lab::new().await;
    lab.workload(93, 40);
    run_now(lab.config()).await;
    let silver = lab.lake("silver_orders");
    deltalake::DeltaTableBuilder::from_url(tables::table_url(&silver).expect("url"))
        .expect("builder")
        .build()
        .expect("handle")
        .create()
        .with_columns([
            StructField::new("order_id", DataType::LONG, true),
            StructField::new("region", DataType::STRING, true),
        ])
        .with_partition_columns(["region"])
        .await
        .expect("a partitioned table");
    let error = apply_changes(&common::orders_apply_config(&lab))
        .await
        .expect_err("refused");
    assert!(
        error.to_string().contains("partition columns region"),
        "{error}"
    );
}
