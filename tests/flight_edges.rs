//! The service at its edges: streams that never lie (a read task or the producer panicking,
//! a short read, a client leaving before the first row), stock arrow-rs decoding a whole
//! stream with its completion marker, every limit's refusal and code, and health that tells
//! the truth about the source.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder, FlightRecordBatchStream};
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightDescriptor};
use common::faulty::{FaultySource, ReadFault};
use common::{
    FlightFixture, SimFixture, code, earliest, first_ticket, raw_client, row_count, test_signer,
    with_workload,
};
use futures::TryStreamExt;
use mssql_cdc_flight::client::ClientError;
use mssql_cdc_flight::flight::{Limits, ServiceOptions};
use mssql_cdc_flight::protocol::{ChangesCommand, Command, Completion, SnapshotCommand};
use mssql_cdc_flight::sim::Faults;
use mssql_cdc_flight::status::reason_of_status;
use mssql_cdc_flight::types::batch_slice_size;
use serde_json::json;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

/// A database with a workload of `commits`, served through a [`FaultySource`].
async fn faulty(
    seed: u64,
    commits: u64,
    fault: ReadFault,
    options: ServiceOptions,
) -> (SimFixture, Arc<FaultySource>, FlightFixture) {
    let sim = with_workload(seed, commits);
    let source = Arc::new(FaultySource::new(sim.db.clone(), fault));
    let flight = FlightFixture::start_with(source.clone(), options).await;
    (sim, source, flight)
}

/// Plans the whole of dbo.orders in one endpoint of small batches.
async fn one_endpoint(flight: &FlightFixture) -> arrow_flight::Ticket {
    let start = earliest(flight, "dbo.orders").await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_rows = Some(50);
    let plan = flight.client.plan_changes(&command).await.expect("plan");
    assert_eq!(plan.info.endpoint.len(), 1);
    assert!(plan.metadata.rows > 100, "rows: {}", plan.metadata.rows);
    plan.info.endpoint[0].ticket.clone().expect("ticket")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_stops_early_never_ends_with_a_marker() {
    for fault in [
        ReadFault::TaskPanics,
        ReadFault::StreamPanics,
        ReadFault::LosesLastBatch,
    ] {
        let (_sim, _source, flight) =
            faulty(21, 200, fault, ServiceOptions::new(test_signer())).await;
        let ticket = one_endpoint(&flight).await;
        // Our client: the status, never a completion.
        let error = flight
            .client
            .collect_endpoint(&ticket)
            .await
            .expect_err("an incomplete read must fail");
        assert_eq!(code(error), Code::Internal, "{fault:?}");
        // A stock decoder: the stream ends with INTERNAL, not OK.
        let mut raw = raw_client(&flight).await;
        let stream = raw.do_get(ticket).await.expect("do_get").into_inner();
        let decoded: Result<Vec<_>, FlightError> =
            FlightRecordBatchStream::new_from_flight_data(stream.map_err(FlightError::from))
                .try_collect()
                .await;
        match decoded {
            Err(FlightError::Tonic(status)) => {
                assert_eq!(status.code(), Code::Internal, "{fault:?}");
                assert!(
                    status.message().contains("incomplete")
                        || status.message().contains("before its end"),
                    "{fault:?}: {}",
                    status.message()
                );
            }
            other => panic!("{fault:?}: expected INTERNAL, got {other:?}"),
        }
        flight.shutdown_and_wait().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_first_row_stops_the_source_read_at_once() {
    let (_sim, source, flight) = faulty(
        22,
        50,
        ReadFault::NeverAnswers,
        ServiceOptions::new(test_signer()),
    )
    .await;
    let ticket = one_endpoint(&flight).await;
    let mut raw = raw_client(&flight).await;
    let mut stream = raw.do_get(ticket).await.expect("do_get").into_inner();
    // The schema comes at once; the rows never do.
    let first = stream.message().await.expect("schema message");
    assert!(first.is_some());
    drop(stream);
    drop(raw);
    let left = Instant::now();
    while !source.reader_left.load(Ordering::SeqCst) {
        assert!(
            left.elapsed() < Duration::from_secs(10),
            "the source read still runs after its client left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_arrow_rs_decodes_a_whole_stream_and_its_marker_without_a_filter() {
    let (_sim, _source, flight) =
        faulty(23, 300, ReadFault::None, ServiceOptions::new(test_signer())).await;
    let (plan, ticket) = first_ticket(&flight, "dbo.orders").await;
    // The record batch stream sees every row and an empty last batch.
    let mut raw = raw_client(&flight).await;
    let stream = raw
        .do_get(ticket.clone())
        .await
        .expect("do_get")
        .into_inner();
    let batches: Vec<_> =
        FlightRecordBatchStream::new_from_flight_data(stream.map_err(FlightError::from))
            .try_collect()
            .await
            .expect("stock decoding");
    assert_eq!(row_count(&batches) as u64, plan.metadata.rows);
    assert_eq!(batches.last().map(|batch| batch.num_rows()), Some(0));
    // The data decoder hands out the marker as the last batch's app_metadata.
    let stream = raw.do_get(ticket).await.expect("do_get").into_inner();
    let messages: Vec<_> = FlightDataDecoder::new(stream.map_err(FlightError::from))
        .try_collect()
        .await
        .expect("stock decoding");
    let last = messages.last().expect("messages");
    assert!(matches!(&last.payload, DecodedPayload::RecordBatch(batch) if batch.num_rows() == 0));
    let marker: Completion = serde_json::from_slice(&last.inner.app_metadata).expect("marker");
    assert_eq!(marker.rows, plan.metadata.rows);
    assert!(
        messages[..messages.len() - 1]
            .iter()
            .all(|message| message.inner.app_metadata.is_empty())
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_limit_refuses_with_its_code() {
    let limits = Limits {
        max_batch_rows: 1_000,
        max_chunks: 3,
        max_seek_rows: 100,
        max_streams: 1,
        ..Limits::default()
    };
    let options = ServiceOptions {
        limits,
        ..ServiceOptions::new(test_signer())
    };
    let (sim, source, flight) = faulty(24, 100, ReadFault::None, options).await;
    let start = earliest(&flight, "dbo.orders").await;
    let invalid = |error: ClientError, what: &str| {
        let text = error.to_string();
        assert_eq!(code(error), Code::InvalidArgument, "{what}");
        assert!(text.contains("the server's limit"), "{what}: {text}");
    };
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_rows = Some(1_001);
    invalid(
        flight
            .client
            .plan_changes(&command)
            .await
            .expect_err("rows"),
        "batch_rows",
    );
    command.serve.batch_rows = None;
    command.serve.batch_bytes = Some(64 << 20);
    invalid(
        flight
            .client
            .plan_changes(&command)
            .await
            .expect_err("bytes"),
        "batch_bytes",
    );
    let mut snapshot = SnapshotCommand::new("dbo.orders");
    snapshot.chunks = Some(
        (0..4)
            .map(|chunk| {
                serde_json::from_value(
                    json!({"chunk": chunk, "lo": chunk * 10, "hi": chunk * 10 + 10}),
                )
                .expect("chunk")
            })
            .collect(),
    );
    invalid(
        flight
            .client
            .plan_snapshot(&snapshot)
            .await
            .expect_err("chunks"),
        "chunks",
    );
    invalid(
        flight
            .client
            .action::<serde_json::Value>("key_bound", &json!({"table": "dbo.orders", "n": 101}))
            .await
            .expect_err("seek"),
        "key_bound n",
    );
    // One stream open (its source still working): the next is RESOURCE_EXHAUSTED with a
    // retry hint in the rich details.
    let (_, ticket) = first_ticket(&flight, "dbo.orders").await;
    let mut raw = raw_client(&flight).await;
    *source.fault.lock().expect("fault") = ReadFault::NeverAnswers;
    let held = raw.do_get(ticket.clone()).await.expect("first stream");
    let refused = raw.do_get(ticket.clone()).await.expect_err("second stream");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(reason_of_status(&refused).as_deref(), Some("SERVER_BUSY"));
    drop(held);
    *source.fault.lock().expect("fault") = ReadFault::None;
    // Its place is free again once the first response is dropped.
    let reopened = async {
        loop {
            match raw.do_get(ticket.clone()).await {
                Ok(response) => return response,
                Err(status) if status.code() == Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(status) => panic!("{status}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), reopened)
        .await
        .expect("the slot is freed");
    // DoGet decodes its own request (src/flight/frames.rs): a ticket over the request limit
    // is OUT_OF_RANGE, as tonic's check answers every other call, and a forged one is refused.
    let oversized = arrow_flight::Ticket::new(vec![b'x'; Limits::default().max_request_bytes + 1]);
    let refused = raw.do_get(oversized).await.expect_err("oversized ticket");
    assert_eq!(refused.code(), Code::OutOfRange, "{refused}");
    let forged = raw
        .do_get(arrow_flight::Ticket::new("not a signed ticket"))
        .await
        .expect_err("forged ticket");
    assert_eq!(forged.code(), Code::InvalidArgument, "{forged}");
    flight.shutdown_and_wait().await;
    drop(sim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planning_call_past_the_deadline_is_deadline_exceeded() {
    let options = ServiceOptions {
        limits: Limits {
            call_timeout: Duration::from_millis(100),
            ..Limits::default()
        },
        ..ServiceOptions::new(test_signer())
    };
    let (sim, _source, flight) = faulty(25, 20, ReadFault::None, options).await;
    sim.db.set_faults(Faults {
        latency: Duration::from_millis(300),
        ..Faults::default()
    });
    let mut raw = raw_client(&flight).await;
    let error = raw
        .do_action(Action::new("max_lsn", "{}"))
        .await
        .expect_err("slow source");
    assert_eq!(error.code(), Code::DeadlineExceeded);
    assert!(
        error.message().contains("--call-timeout"),
        "{}",
        error.message()
    );
    let command = Command::Table(mssql_cdc_flight::protocol::TableCommand {
        table: "dbo.orders".into(),
    });
    let error = raw
        .get_flight_info(FlightDescriptor::new_cmd(command.to_bytes()))
        .await
        .expect_err("slow plan");
    assert_eq!(error.code(), Code::DeadlineExceeded);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_not_serving_while_the_source_is_down() {
    let options = ServiceOptions {
        health_interval: Duration::from_millis(50),
        ..ServiceOptions::new(test_signer())
    };
    let (_sim, source, flight) = faulty(26, 5, ReadFault::None, options).await;
    let channel = tonic::transport::Endpoint::from_shared(flight.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut status_becomes = async |wanted: ServingStatus| {
        let started = Instant::now();
        loop {
            let response = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "arrow.flight.protocol.FlightService".into(),
                })
                .await
                .expect("health")
                .into_inner();
            if response.status == wanted as i32 {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "health never became {wanted:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    status_becomes(ServingStatus::Serving).await;
    source.down.store(true, Ordering::SeqCst);
    status_becomes(ServingStatus::NotServing).await;
    source.down.store(false, Ordering::SeqCst);
    status_becomes(ServingStatus::Serving).await;
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_streams_share_the_stream_memory_through_smaller_batches() {
    // 2 MiB for up to 8 streams of 8 batches: 256 KiB batches alone, 64 KiB among four.
    const ALONE: usize = 256 << 10;
    const AMONG_FOUR: usize = 64 << 10;
    let limits = Limits {
        max_streams: 8,
        stream_memory: 2 << 20,
        ..Limits::default()
    };
    let options = ServiceOptions {
        limits,
        ..ServiceOptions::new(test_signer())
    };
    let (_sim, _source, flight) = faulty(24, 3_000, ReadFault::None, options).await;
    let start = earliest(&flight, "dbo.orders").await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_bytes = Some(1 << 20);
    let plan = flight.client.plan_changes(&command).await.expect("plan");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    let mut raw = raw_client(&flight).await;
    let read = |raw: &mut FlightServiceClient<_>, ticket: arrow_flight::Ticket| {
        let mut raw = raw.clone();
        async move {
            let stream = raw.do_get(ticket).await.expect("do_get").into_inner();
            let batches: Vec<RecordBatch> =
                FlightRecordBatchStream::new_from_flight_data(stream.map_err(FlightError::from))
                    .try_collect()
                    .await
                    .expect("a whole stream");
            let largest = batches.iter().map(batch_slice_size).max().unwrap_or(0);
            (row_count(&batches) as u64, largest)
        }
    };
    assert_eq!(plan.info.endpoint.len(), 1);

    let (rows, largest_alone) = read(&mut raw, ticket.clone()).await;
    assert_eq!(rows, plan.metadata.rows);
    assert!(
        rows as usize * 100 > 4 * ALONE,
        "the read must span several batches: {rows} rows"
    );
    assert!(
        largest_alone > ALONE / 2 && largest_alone <= ALONE * 5 / 4,
        "alone, a stream's batches are near all of its share: {largest_alone} bytes"
    );

    // Three streams stay open, unread, each on its own connection (unread streams would
    // use up a shared connection's window); the fourth shares the memory with them.
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut other = raw_client(&flight).await;
        held.push(other.do_get(ticket.clone()).await.expect("held stream"));
    }
    let (rows, largest_shared) = read(&mut raw, ticket).await;
    assert_eq!(rows, plan.metadata.rows);
    assert!(
        largest_shared <= AMONG_FOUR * 5 / 4,
        "among four, batches shrink to a quarter: {largest_shared} bytes (alone \
         {largest_alone})"
    );
    drop(held);
    flight.shutdown_and_wait().await;
}
