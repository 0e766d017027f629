//! Seeding from an existing copy (ADR 0025): a copy of dbo.orders written by someone else
//! (Parquet files, a Delta table, other column case, an extra column) adopted as the
//! snapshot at its time or LSN, the stream started there, silver equal to the source.

mod common;

use std::sync::Arc;

use arrow::datatypes::{Field, Schema};
use arrow::record_batch::RecordBatch;
use common::{Lab, churn, run_now, source_rows};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::SnapshotCommand;
use mssql_cdc_writer::silver::apply_changes;
use mssql_cdc_writer::snapshot::{AsOf, SeedOptions, Snapshots};

/// The source table now, as a user's copy: the captured columns only, `order_id` spelled
/// `ORDER_ID`, one column of their own, and `drop` left out. Returns the batches and the
/// LSN the copy stands at.
async fn user_copy(lab: &Lab, drop: Option<&str>) -> (Vec<RecordBatch>, Lsn) {
    let client = CdcClient::connect(&lab.url).await.expect("connect");
    let plan = client
        .plan_snapshot(&SnapshotCommand::new("dbo.orders"))
        .await
        .expect("plan");
    let mut copy = Vec::new();
    let mut stamp = None;
    for endpoint in &plan.info.endpoint {
        let (batches, completion) = client
            .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
            .await
            .expect("read");
        stamp = completion.snapshot_lsn;
        for batch in batches {
            let keep: Vec<usize> = (0..batch.num_columns())
                .filter(|index| {
                    let name = batch.schema().field(*index).name().clone();
                    !name.starts_with('_') && Some(name.as_str()) != drop
                })
                .collect();
            let projected = batch.project(&keep).expect("project");
            let mut fields: Vec<Field> = projected
                .schema()
                .fields()
                .iter()
                .map(|field| match field.name().as_str() {
                    "order_id" => field.as_ref().clone().with_name("ORDER_ID"),
                    _ => field.as_ref().clone(),
                })
                .collect();
            fields.push(Field::new(
                "etl_note",
                arrow::datatypes::DataType::Utf8,
                true,
            ));
            let mut columns = projected.columns().to_vec();
            columns.push(Arc::new(arrow::array::StringArray::from(vec![
                Some(
                    "copied"
                );
                projected
                    .num_rows(
                    )
            ])));
            copy.push(RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("batch"));
        }
    }
    (copy, stamp.expect("a stamped read"))
}

/// The copy as one Parquet file in `dir`.
fn write_parquet(dir: &std::path::Path, batches: &[RecordBatch]) -> String {
    std::fs::create_dir_all(dir).expect("dir");
    let path = dir.join("orders.parquet");
    let file = std::fs::File::create(&path).expect("file");
    let mut writer =
        deltalake::parquet::arrow::ArrowWriter::try_new(file, batches[0].schema(), None)
            .expect("writer");
    for batch in batches {
        writer.write(batch).expect("write");
    }
    writer.close().expect("close");
    path.display().to_string()
}

fn seed_options(copy: &str, as_of: AsOf) -> SeedOptions {
    SeedOptions {
        copy: copy.to_string(),
        as_of,
        reseed: false,
        allow_missing_columns: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_copy_seeds_at_its_time_and_the_stream_and_silver_go_on_from_it() {
    let lab = Lab::new().await;
    common::orders_workload(&lab, 81, 150, churn());
    let (copy, stamp) = user_copy(&lab, None).await;
    let path = write_parquet(&lab.dir.path().join("copy"), &copy);
    let taken_at = lab
        .db
        .lsn_to_time(stamp)
        .await
        .expect("time")
        .expect("a commit");
    common::orders_workload(&lab, 82, 80, churn());
    let mut config = lab.config();
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    // A time maps to the last commit before it: earlier than the copy, which is safe.
    let seeded = snapshots
        .seed(&seed_options(&path, AsOf::Time(taken_at)))
        .await
        .expect("seed");
    assert!(!seeded.reused);
    assert!(seeded.offset.lsn < stamp, "strictly before the copy's time");
    assert_eq!(
        seeded.rows,
        copy.iter().map(|b| b.num_rows() as u64).sum::<u64>()
    );
    let again = snapshots
        .seed(&seed_options(&path, AsOf::Time(taken_at)))
        .await
        .expect("rerun");
    assert!(again.reused, "a rerun adopts nothing twice");
    let state = mssql_cdc_writer::snapshot::state(&config)
        .await
        .expect("state");
    assert_eq!(
        (state.status.snapshot, state.status.state.as_str()),
        (Some(seeded.offset.lsn), "done")
    );
    config.starting = seeded.offset.lsn.to_string();
    run_now(config.clone()).await;
    let applied = apply_changes(&common::orders_apply_config(&lab))
        .await
        .expect("apply");
    assert!(
        applied.rebuilt,
        "silver is built from the seed and the changes after it"
    );
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        source_rows(&lab).await,
        "silver equals the source: the changes replayed over the copy change nothing"
    );
    let refused = snapshots
        .seed(&seed_options(&path, AsOf::Lsn(stamp)))
        .await
        .expect_err("a snapshot is complete already");
    assert!(refused.to_string().contains("--reseed"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_copy_reseeds_and_bad_copies_are_refused_with_nothing_written() {
    let lab = Lab::new().await;
    common::orders_workload(&lab, 83, 120, churn());
    let mut config = lab.config();
    let snapshots = Snapshots::connect(config.clone()).await.expect("connect");
    // Refused: a copy lacking a captured column, an LSN past max_lsn, a purged start.
    let (partial, stamp) = user_copy(&lab, Some("note")).await;
    let partial_path = write_parquet(&lab.dir.path().join("partial"), &partial);
    let error = snapshots
        .seed(&seed_options(&partial_path, AsOf::Lsn(stamp)))
        .await
        .expect_err("a column is missing");
    assert!(error.to_string().contains("note"), "names it: {error}");
    let max_lsn = lab.db.max_lsn().await.expect("max").expect("lsn");
    let error = snapshots
        .seed(&seed_options(&partial_path, AsOf::Lsn(max_lsn.increment())))
        .await
        .expect_err("past max_lsn");
    assert!(error.to_string().contains("past max_lsn"), "{error}");
    assert!(
        mssql_cdc_writer::tables::open(
            &mssql_cdc_writer::tables::table_url(&config.target).expect("url")
        )
        .await
        .expect("open")
        .is_none(),
        "nothing written to bronze"
    );
    let lenient = SeedOptions {
        allow_missing_columns: true,
        ..seed_options(&partial_path, AsOf::Lsn(stamp))
    };
    let seeded = snapshots.seed(&lenient).await.expect("seed with NULLs");
    assert_eq!(seeded.offset.lsn, stamp, "an LSN is taken as it is");
    config.starting = stamp.to_string();
    run_now(config.clone()).await;

    // A newer copy, as a Delta table, replaces it.
    common::orders_workload(&lab, 84, 60, churn());
    let (copy, newer) = user_copy(&lab, None).await;
    let delta_path = lab.lake("orders_copy");
    deltalake::DeltaTableBuilder::from_url(
        mssql_cdc_writer::tables::table_url(&delta_path).expect("url"),
    )
    .expect("builder")
    .build()
    .expect("handle")
    .write(copy)
    .await
    .expect("write the copy as a Delta table");
    let error = snapshots
        .seed(&seed_options(&delta_path, AsOf::Lsn(newer)))
        .await
        .expect_err("needs --reseed");
    assert!(error.to_string().contains("--reseed"), "{error}");
    let reseeded = snapshots
        .seed(&SeedOptions {
            reseed: true,
            ..seed_options(&delta_path, AsOf::Lsn(newer))
        })
        .await
        .expect("reseed");
    assert_eq!(reseeded.offset.lsn, newer);
    common::orders_workload(&lab, 85, 40, churn());
    run_now(config).await;
    assert!(
        apply_changes(&common::orders_apply_config(&lab))
            .await
            .expect("apply")
            .rebuilt
    );
    assert_eq!(
        common::current_rows(&lab.lake("silver_orders")).await,
        source_rows(&lab).await,
        "the reseed's rows, with every column, and the changes after it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_is_refused_while_a_snapshot_is_open() {
    let lab = Lab::new().await;
    common::orders_workload(&lab, 86, 60, churn());
    let (copy, stamp) = user_copy(&lab, None).await;
    let path = write_parquet(&lab.dir.path().join("copy"), &copy);
    let snapshots = Snapshots::connect(lab.config()).await.expect("connect");
    let open = snapshots.open_chunked().await.expect("open");
    let error = snapshots
        .seed(&seed_options(&path, AsOf::Lsn(stamp)))
        .await
        .expect_err("refused");
    assert!(
        error
            .to_string()
            .contains(&format!("snapshot {open} is open")),
        "{error}"
    );
}

/// Runs the `seed` command for the lab's stream, aborting at `crash_at` when given.
async fn seed_command(
    lab: &Lab,
    path: &str,
    as_of: Lsn,
    crash_at: Option<&str>,
) -> std::process::Output {
    let config = lab.config();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"));
    command
        .args(["seed", "--server", &lab.url, "--table", "dbo.orders"])
        .args(["--target", &config.target, "--facts", &config.facts])
        .args(["--app-id", &config.app_id, "--copy", path])
        .args(["--as-of", &as_of.to_string()])
        .env("RUST_LOG", "warn");
    if let Some(step) = crash_at {
        command.env(mssql_cdc_writer::stream::CRASH_AT_VARIABLE, step);
    }
    tokio::task::spawn_blocking(move || command.output().expect("run"))
        .await
        .expect("join")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_command_prints_where_the_stream_starts_and_finishes_a_crashed_seed() {
    let lab = Lab::new().await;
    common::orders_workload(&lab, 87, 60, churn());
    let (copy, stamp) = user_copy(&lab, None).await;
    let path = write_parquet(&lab.dir.path().join("copy"), &copy);
    let crashed = seed_command(&lab, &path, stamp, Some("after_seed_open")).await;
    assert!(!crashed.status.success(), "aborted after the open");
    let output = seed_command(&lab, &path, stamp, None).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON line");
    assert_eq!(answer["snapshot"], stamp.to_string());
    assert_eq!(
        answer["rows"],
        copy.iter().map(|b| b.num_rows()).sum::<usize>()
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&format!("--starting {stamp}")),
        "says how to start the stream"
    );
    let state = mssql_cdc_writer::snapshot::state(&lab.config())
        .await
        .expect("state");
    assert_eq!(
        (state.status.snapshot, state.status.state.as_str()),
        (Some(stamp), "done"),
        "the rerun finished the seed the crash left open"
    );
}
