//! The Flight service end to end: a real server on 127.0.0.1:0 over a simulated database,
//! each call's happy and error path, and the faults production brings.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use arrow::array::{Array, StringArray};
use arrow_flight::Ticket;
use common::{
    FlightFixture, SimFixture, all_null, code, earliest, first_ticket, initial_offset, loaded,
    orders, read_plan, read_range, row_count, stream_rows,
};
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::protocol::{
    ChangesCommand, InitialOffsetBody, LatestOffsetBody, LsnAnswer, PlanMetadata,
};
use mssql_cdc_flight::sim::workload::{self, WorkloadSpec};
use mssql_cdc_flight::sim::{CleanupDuringRead, Faults, KeyUpdateStyle};
use mssql_cdc_flight::source::CdcSource;
use mssql_cdc_flight::{Lsn, Offset};
use serde_json::json;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_read_through_flight_equals_what_the_database_committed() {
    let (sim, flight) = loaded(11, 600).await;
    let start = earliest(&flight, "dbo.orders").await;
    let (plan, batches) = read_range(&flight.client, "dbo.orders", start.lsn, None, 4).await;
    let expected = sim.journal_rows("dbo.orders");
    assert!(
        expected.len() > 1000,
        "workload too small: {}",
        expected.len()
    );
    let streamed = stream_rows(&batches, "order_id");
    // Same rows, once each, in the ordering key (_start_lsn, _command_id, _seqval, _operation).
    assert_eq!(streamed, expected);
    assert!(
        plan.info.endpoint.len() > 1,
        "4 partitions asked, {} endpoints",
        plan.info.endpoint.len()
    );
    assert_eq!(plan.info.total_records as usize, expected.len());
    assert_eq!(plan.metadata.rows as usize, expected.len());
    // Updates are 3 then 4 sharing a seqval; every seqval is below its commit LSN.
    for pair in streamed.windows(2) {
        if pair[0].operation == 3 && pair[1].operation == 4 && pair[0].key == pair[1].key {
            assert_eq!(pair[0].seqval, pair[1].seqval);
        }
    }
    assert!(streamed.iter().all(|row| row.seqval < row.start_lsn));
    let capture_instances: &StringArray = batches[0]
        .column(0)
        .as_any()
        .downcast_ref()
        .expect("_capture_instance is utf8");
    assert_eq!(capture_instances.value(0), "dbo_orders");
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_survive_the_trip() {
    let sim = SimFixture::new();
    let mut writer = sim.writer(5);
    let mut tx = writer.begin();
    let keys = tx.insert(&orders(), 50).expect("insert");
    tx.commit().expect("commit");
    writer.publish().expect("publish");
    let manifest = sim.db.manifest().expect("manifest");
    let definition = manifest.table(&orders()).expect("orders").clone();
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let start = earliest(&flight, "dbo.orders").await;
    let (_, batches) = read_range(&flight.client, "dbo.orders", start.lsn, None, 1).await;
    // Regenerate the expected rows column by column from (key, content) and compare arrays.
    let batch = arrow::compute::concat_batches(&batches[0].schema(), &batches).expect("concat");
    for column in &definition.columns {
        let mut builder = mssql_cdc_flight::sim::values::ColumnBuilder::for_sql_type(
            &column.sql_type,
            keys.len(),
        );
        for key in &keys {
            let content = writer.content_of(&orders(), *key).expect("row");
            builder.append_generated(column, column.name == definition.key, *key, content);
        }
        let expected = builder.finish();
        let actual = batch.column_by_name(&column.name).expect("column");
        assert_eq!(actual.as_ref(), expected.as_ref(), "column {}", column.name);
    }
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_updates_are_recorded_as_delete_insert_or_in_place() {
    let sim = SimFixture::new();
    let mut writer = sim.writer(3);
    let mut tx = writer.begin();
    tx.insert(&orders(), 2).expect("insert");
    tx.commit().expect("commit");
    let mut tx = writer.begin();
    tx.update_key(&orders(), 1, 100, KeyUpdateStyle::DeleteInsert)
        .expect("split");
    tx.update_key(&orders(), 2, 200, KeyUpdateStyle::InPlace)
        .expect("in place");
    tx.commit().expect("commit").expect("lsn");
    writer.publish().expect("publish");
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let start = earliest(&flight, "dbo.orders").await;
    let (_, batches) = read_range(&flight.client, "dbo.orders", start.lsn, None, 1).await;
    let rows = stream_rows(&batches, "order_id");
    let last: Vec<(i32, i32, i64)> = rows[2..]
        .iter()
        .map(|row| (row.command_id, row.operation, row.key))
        .collect();
    assert_eq!(last, vec![(1, 1, 1), (1, 2, 100), (2, 3, 2), (2, 4, 200)]);
    assert_ne!(
        rows[2].seqval, rows[3].seqval,
        "a split update has two log records"
    );
    assert_eq!(
        rows[4].seqval, rows[5].seqval,
        "an in-place key update shares its seqval"
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_is_cut_at_a_newer_capture_instance() {
    let sim = SimFixture::new();
    let mut writer = sim.writer(21);
    let spec = WorkloadSpec {
        commits: Some(150),
        mix: "insert=1,update=1,delete=0.2".parse().expect("mix"),
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("before");
    let added_at = writer
        .add_column(&orders(), "discount", "decimal(9,2)", true)
        .expect("add column");
    let mut columns: Vec<String> = sim
        .db
        .manifest()
        .expect("manifest")
        .table(&orders())
        .expect("t")
        .columns
        .iter()
        .map(|c| c.name.clone())
        .collect();
    columns.sort();
    let switch_at = writer
        .enable_capture_instance(&orders(), "dbo_orders_v2", &columns)
        .expect("enable");
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("after");
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let start = earliest(&flight, "dbo.orders").await;
    let (plan, batches) = read_range(&flight.client, "dbo.orders", start.lsn, None, 2).await;
    let metadata: &PlanMetadata = &plan.metadata;
    let ranges: Vec<(&str, Lsn, Lsn)> = metadata
        .ranges
        .iter()
        .map(|range| (range.capture_instance.as_str(), range.from, range.to))
        .collect();
    assert_eq!(ranges.len(), 2);
    assert_eq!(ranges[0].0, "dbo_orders");
    assert_eq!(
        ranges[0].2,
        switch_at.decrement(),
        "older instance ends just before S"
    );
    assert_eq!(
        (ranges[1].0, ranges[1].1),
        ("dbo_orders_v2", switch_at),
        "newer instance starts at S"
    );
    let events: Vec<(&str, Lsn)> = metadata
        .events
        .iter()
        .map(|event| (event.event.as_str(), event.lsn))
        .collect();
    assert_eq!(
        events,
        vec![
            ("schema_change", added_at),
            ("capture_instance_switched", switch_at)
        ]
    );
    assert!(
        metadata.events[1]
            .detail
            .starts_with("dbo_orders -> dbo_orders_v2")
    );
    // What changed, then the statement as cdc.ddl_history holds it.
    assert!(
        metadata.events[0]
            .detail
            .starts_with("column [discount] added as decimal(9,2): ALTER TABLE"),
        "{}",
        metadata.events[0].detail
    );
    // Every change exactly once (no commit from both instances), the union schema holding
    // the new column: NULL before the switch, values after it.
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    let (before, after): (Vec<_>, Vec<_>) = batches.iter().cloned().partition(|batch| {
        let instance: &StringArray = batch.column(0).as_any().downcast_ref().expect("utf8");
        instance.value(0) == "dbo_orders"
    });
    assert!(!before.is_empty() && !after.is_empty());
    assert!(all_null(&before, "discount"));
    assert!(!all_null(&after, "discount"));
    // A range entirely after the switch reads only the newer instance, with no event.
    let (late, _) = read_range(&flight.client, "dbo.orders", switch_at, None, 1).await;
    assert_eq!(late.metadata.ranges.len(), 1);
    assert!(late.metadata.events.is_empty());
    flight.shutdown_and_wait().await;
}

/// A capture instance the capture job has not processed (its `start_lsn` is NULL, as after
/// `sql/switch_capture_instance.sql` while SQL Server Agent has not run) is left out of
/// planning, UNAVAILABLE by name; once processed the range is cut at its start, and a cleanup
/// of both instances past that cut leaves the plans of what is still held as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_instance_the_capture_job_has_not_processed_is_left_out_until_it_is() {
    let sim = SimFixture::new();
    let mut writer = sim.writer(23);
    let spec = WorkloadSpec {
        commits: Some(120),
        ..WorkloadSpec::default()
    };
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("before");
    let columns: Vec<String> = ["order_id", "status", "amount"].map(String::from).into();
    let enabled_at = writer
        .enable_capture_instance_unprocessed(&orders(), "dbo_orders_v2", &columns)
        .expect("enable");
    let flight = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let client = &flight.client;
    let start = earliest(&flight, "dbo.orders").await;

    // Pending: listed with NULL positions, read from the older instance only.
    let listed: Vec<serde_json::Value> = client
        .action("capture_instances", &json!({"table": "dbo.orders"}))
        .await
        .expect("capture instances");
    assert_eq!(listed[1]["name"], "dbo_orders_v2");
    assert!(listed[1]["start_lsn"].is_null() && listed[1]["min_lsn"].is_null());
    let (plan, batches) = read_range(client, "dbo.orders", start.lsn, None, 2).await;
    let instances: Vec<&str> = plan
        .metadata
        .ranges
        .iter()
        .map(|range| range.capture_instance.as_str())
        .collect();
    assert_eq!(instances, vec!["dbo_orders"]);
    assert!(plan.metadata.events.is_empty());
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    let mut by_name = ChangesCommand::new("dbo.orders", start.lsn, None);
    by_name.capture_instance = Some("dbo_orders_v2".into());
    let refused = client.plan_changes(&by_name).await.expect_err("pending");
    assert_eq!(code(refused), Code::Unavailable);
    let latest = initial_offset(client, "dbo.orders", Some("latest")).await;
    assert!(
        latest.lsn < enabled_at,
        "max_lsn stays below the unprocessed enable"
    );

    // The capture job's next scan: the newer instance starts at its enable.
    workload::run(&mut writer, &spec, &AtomicBool::new(false)).expect("after");
    drop(writer);
    let (plan, batches) = read_range(client, "dbo.orders", start.lsn, None, 2).await;
    let ranges: Vec<(&str, Lsn)> = plan
        .metadata
        .ranges
        .iter()
        .map(|range| (range.capture_instance.as_str(), range.from))
        .collect();
    assert_eq!(
        ranges,
        vec![
            ("dbo_orders", start.lsn.increment()),
            ("dbo_orders_v2", enabled_at)
        ]
    );
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    by_name.from = enabled_at.decrement();
    client
        .plan_changes(&by_name)
        .await
        .expect("by name once processed");

    // A cleanup of both instances past the cut moves both start LSNs to the same mark.
    let mark = sim
        .db
        .nth_commit_after(enabled_at, 20)
        .await
        .expect("nth")
        .expect("commit");
    let held = |plan: &mssql_cdc_flight::client::ChangesPlan| {
        plan.metadata
            .ranges
            .iter()
            .map(|range| {
                (
                    range.capture_instance.clone(),
                    range.from,
                    range.to,
                    range.rows,
                )
            })
            .collect::<Vec<_>>()
    };
    let (before_cleanup, _) = read_range(client, "dbo.orders", mark.decrement(), None, 2).await;
    sim.db.cleanup(None, mark).expect("cleanup");
    let instances = sim
        .db
        .capture_instances(&orders())
        .await
        .expect("instances");
    assert!(
        instances
            .iter()
            .all(|instance| instance.start_lsn == Some(mark))
    );
    let (after_cleanup, batches) =
        read_range(client, "dbo.orders", mark.decrement(), None, 2).await;
    assert_eq!(
        held(&after_cleanup),
        held(&before_cleanup),
        "the cut is stable"
    );
    assert_eq!(held(&after_cleanup)[0].0, "dbo_orders_v2");
    let expected: Vec<_> = sim
        .journal_rows("dbo.orders")
        .into_iter()
        .filter(|row| row.start_lsn.parse::<Lsn>().expect("lsn") >= mark)
        .collect();
    assert_eq!(stream_rows(&batches, "order_id"), expected);
    let purged = client
        .plan_changes(&ChangesCommand::new("dbo.orders", start.lsn, None))
        .await
        .expect_err("purged below the mark");
    assert_eq!(code(purged), Code::DataLoss);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_entries_advance_the_offset_of_a_quiet_table() {
    let (sim, flight) = loaded(11, 30).await;
    let client = &flight.client;
    let before: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: None,
                max_commits: None,
                upper: None,
            },
        )
        .await
        .expect("latest");
    let mut writer = sim.writer(9);
    for _ in 0..3 {
        writer.idle();
    }
    writer.publish().expect("publish");
    let after: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(before),
                max_commits: None,
                upper: None,
            },
        )
        .await
        .expect("latest");
    assert!(after.lsn > before.lsn, "idle entries move max_lsn");
    assert!(
        after.commit_ts > before.commit_ts,
        "and the commit time the verdict needs"
    );
    let (plan, batches) = read_range(client, "dbo.orders", before.lsn, Some(after.lsn), 1).await;
    assert_eq!(
        plan.info.endpoint.len(),
        1,
        "an idle range is still read, so its guard runs"
    );
    assert_eq!(row_count(&batches), 0);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purged_changes_are_data_loss_before_planning() {
    let (sim, flight) = loaded(11, 100).await;
    let start = earliest(&flight, "dbo.orders").await;
    let cut = sim
        .db
        .nth_commit_after(start.lsn, 40)
        .await
        .expect("nth")
        .expect("commit");
    sim.db.cleanup(Some("dbo_orders"), cut).expect("cleanup");
    let error = flight
        .client
        .plan_changes(&ChangesCommand::new("dbo.orders", start.lsn, None))
        .await
        .expect_err("purged");
    let message = error.to_string();
    assert_eq!(code(error), Code::DataLoss);
    assert!(message.contains("dbo_orders"), "{message}");
    assert!(
        message.contains(&start.lsn.increment().to_string()),
        "names the requested lsn: {message}"
    );
    assert!(
        message.contains(&cut.to_string()),
        "names min_lsn: {message}"
    );
    // From just before the new min_lsn on, the range is whole again.
    let (_, batches) = read_range(&flight.client, "dbo.orders", cut.decrement(), None, 1).await;
    let expected: Vec<_> = sim
        .journal_rows("dbo.orders")
        .into_iter()
        .filter(|row| row.start_lsn >= cut.to_string())
        .collect();
    assert_eq!(stream_rows(&batches, "order_id"), expected);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_during_the_read_is_data_loss_never_a_short_stream() {
    let (sim, flight) = loaded(11, 400).await;
    let start = earliest(&flight, "dbo.orders").await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_rows = Some(100);
    let plan = flight.client.plan_changes(&command).await.expect("plan");
    let cut = sim
        .db
        .nth_commit_after(start.lsn, 300)
        .await
        .expect("nth")
        .expect("commit");
    sim.db.set_faults(Faults {
        cleanup_during_read: Some(CleanupDuringRead {
            capture_instance: Some("dbo_orders".into()),
            low_water_mark: cut,
            after_rows: 200,
        }),
        ..Faults::default()
    });
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    let mut rows = 0;
    let error = flight
        .client
        .read_endpoint(&ticket, |batch| rows += batch.num_rows())
        .await
        .expect_err("loss");
    assert!(rows >= 200, "the read was under way: {rows} rows");
    assert!(error.to_string().contains("while the range"), "{error}");
    assert_eq!(code(error), Code::DataLoss);
    // Replaying the ticket now fails at once: its start is purged.
    let replay = flight
        .client
        .collect_endpoint(&ticket)
        .await
        .expect_err("replay");
    assert_eq!(code(replay), Code::DataLoss);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_source_connection_is_unavailable_and_incomplete() {
    let (sim, flight) = loaded(11, 200).await;
    let start = earliest(&flight, "dbo.orders").await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_rows = Some(50);
    let plan = flight.client.plan_changes(&command).await.expect("plan");
    sim.db.set_faults(Faults {
        drop_connection_after_rows: Some(100),
        ..Faults::default()
    });
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    let error = flight
        .client
        .collect_endpoint(&ticket)
        .await
        .expect_err("dropped");
    assert_eq!(code(error), Code::Unavailable);
    // The fault is spent: the same ticket now reads whole.
    let (batches, completion) = flight
        .client
        .collect_endpoint(&ticket)
        .await
        .expect("retry");
    assert_eq!(completion.rows as usize, row_count(&batches));
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_ticket_read_twice_gives_identical_rows_and_on_another_replica() {
    let (sim, flight) = loaded(11, 300).await;
    let start = earliest(&flight, "dbo.orders").await;
    let plan = flight
        .client
        .plan_changes(&ChangesCommand::new("dbo.orders", start.lsn, None))
        .await
        .expect("plan");
    // More commits after planning must not change what the ticket reads.
    let mut writer = sim.writer(77);
    workload::run(
        &mut writer,
        &WorkloadSpec {
            commits: Some(50),
            ..WorkloadSpec::default()
        },
        &AtomicBool::new(false),
    )
    .expect("more");
    let (first, _) = read_plan(&flight.client, &plan).await.expect("first");
    let (second, _) = read_plan(&flight.client, &plan).await.expect("second");
    assert_eq!(first, second);
    // A replica with the same key redeems the ticket; one with another key refuses it.
    let replica = FlightFixture::start(Arc::new(sim.db.clone())).await;
    let (third, _) = read_plan(&replica.client, &plan).await.expect("replica");
    assert_eq!(first, third);
    let stranger = FlightFixture::start_with_key(
        Arc::new(sim.db.clone()),
        TicketSigner::random().expect("key"),
    )
    .await;
    let error = read_plan(&stranger.client, &plan)
        .await
        .expect_err("other key");
    assert_eq!(code(error), Code::PermissionDenied);
    for fixture in [flight, replica, stranger] {
        fixture.shutdown_and_wait().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_reads_all_complete() {
    let (sim, flight) = loaded(11, 500).await;
    let start = earliest(&flight, "dbo.orders").await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.partitions = Some(8);
    command.min_partition_rows = Some(1);
    command.serve.batch_rows = Some(64);
    let plan = flight.client.plan_changes(&command).await.expect("plan");
    assert_eq!(plan.info.endpoint.len(), 8);
    let mut reads = Vec::new();
    for endpoint in &plan.info.endpoint {
        let client = flight.client.clone();
        let ticket = endpoint.ticket.clone().expect("ticket");
        reads.push(tokio::spawn(async move {
            client.collect_endpoint(&ticket).await
        }));
    }
    let mut batches = Vec::new();
    for read in reads {
        let (endpoint_batches, completion) = read.await.expect("task").expect("read");
        assert_eq!(completion.rows as usize, row_count(&endpoint_batches));
        batches.extend(endpoint_batches);
    }
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_and_garbage_tickets_are_refused() {
    let (_sim, flight) = loaded(11, 50).await;
    let (_, ticket) = first_ticket(&flight, "dbo.orders").await;
    let mut bytes = ticket.ticket.to_vec();
    // Widen the range: flip a bit of the body (the to_lsn sits near the middle).
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    let error = flight
        .client
        .collect_endpoint(&Ticket::new(bytes))
        .await
        .expect_err("tampered");
    assert_eq!(code(error), Code::PermissionDenied);
    let error = flight
        .client
        .collect_endpoint(&Ticket::new(b"hello".to_vec()))
        .await
        .expect_err("garbage");
    assert_eq!(code(error), Code::InvalidArgument);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_published_while_serving_are_seen_on_the_next_request() {
    let (sim, flight) = loaded(11, 20).await;
    let before: LsnAnswer = flight
        .client
        .action("max_lsn", &json!({}))
        .await
        .expect("max");
    // A second handle on the directory, as `sim run` in another process would be.
    let other = mssql_cdc_flight::sim::SimDb::open(&sim.db.dir()).expect("open");
    let mut writer = other
        .writer(mssql_cdc_flight::sim::Clock::Wall, 4)
        .expect("writer");
    let mut tx = writer.begin();
    tx.insert(&orders(), 3).expect("insert");
    let lsn = tx.commit().expect("commit").expect("lsn");
    writer.publish().expect("publish");
    let after: LsnAnswer = flight
        .client
        .action("max_lsn", &json!({}))
        .await
        .expect("max");
    assert!(after.lsn > before.lsn);
    assert_eq!(after.lsn, Some(lsn));
    // The live writer's lock stops a second writer of the directory.
    let error = sim
        .db
        .writer(mssql_cdc_flight::sim::Clock::Wall, 1)
        .err()
        .expect("locked");
    assert!(
        error.to_string().contains("another process is writing"),
        "{error}"
    );
    let error = other
        .writer(mssql_cdc_flight::sim::Clock::Wall, 1)
        .err()
        .expect("one per process");
    assert!(error.to_string().contains("already open"), "{error}");
    drop(writer);
    other
        .writer(mssql_cdc_flight::sim::Clock::Wall, 1)
        .expect("free again");
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_slows_but_does_not_break_reads() {
    let (sim, flight) = loaded(11, 50).await;
    sim.db.set_faults(Faults {
        latency: Duration::from_millis(20),
        ..Faults::default()
    });
    let start = earliest(&flight, "dbo.orders").await;
    let started = std::time::Instant::now();
    let (_, batches) = read_range(&flight.client, "dbo.orders", start.lsn, None, 1).await;
    assert!(started.elapsed() >= Duration::from_millis(20));
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_clients_that_trust_its_ca_only() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (sim, plain) = loaded(11, 50).await;
    plain.shutdown_and_wait().await;
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
    let identity = mssql_cdc_flight::flight::TlsIdentity {
        certificate: certified.cert.pem().into_bytes(),
        key: certified.signing_key.serialize_pem().into_bytes(),
        client_ca: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(mssql_cdc_flight::flight::serve(
        listener,
        Arc::new(sim.db.clone()),
        mssql_cdc_flight::flight::ServiceOptions::new(TicketSigner::random().expect("key")),
        Some(identity),
        async {
            let _ = stopped.await;
        },
    ));
    let url = format!("https://localhost:{port}");
    let tls = mssql_cdc_flight::client::ClientTls {
        ca_certificate: certified.cert.pem().into_bytes(),
        domain: None,
        identity: None,
    };
    let client = mssql_cdc_flight::client::CdcClient::connect_with(&url, Some(&tls))
        .await
        .expect("tls connect");
    let start: Offset = client
        .action(
            "initial_offset",
            &InitialOffsetBody {
                table: "dbo.orders".into(),
                starting: None,
            },
        )
        .await
        .expect("initial offset over tls");
    let (_, batches) = read_range(&client, "dbo.orders", start.lsn, None, 1).await;
    assert_eq!(
        stream_rows(&batches, "order_id"),
        sim.journal_rows("dbo.orders")
    );
    // A client that does not trust the CA, or speaks plaintext, gets nothing.
    let stranger = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .expect("other certificate");
    let untrusted = mssql_cdc_flight::client::ClientTls {
        ca_certificate: stranger.cert.pem().into_bytes(),
        domain: None,
        identity: None,
    };
    let refused =
        match mssql_cdc_flight::client::CdcClient::connect_with(&url, Some(&untrusted)).await {
            Err(_) => true,
            Ok(client) => client
                .action::<LsnAnswer>("max_lsn", &json!({}))
                .await
                .is_err(),
        };
    assert!(refused, "an untrusted certificate must not be accepted");
    let plaintext =
        match mssql_cdc_flight::client::CdcClient::connect(&format!("http://localhost:{port}"))
            .await
        {
            Err(_) => true,
            Ok(client) => client
                .action::<LsnAnswer>("max_lsn", &json!({}))
                .await
                .is_err(),
        };
    assert!(plaintext, "plaintext must not reach a TLS server");
    let _ = stop.send(());
    server.await.expect("task").expect("server");
}
