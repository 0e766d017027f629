//! The live tail, `wait_for_commits`: it answers once `max_lsn` moves past the caller's LSN
//! (a commit during the wait wakes it), answers at once when it already has, times out when
//! nothing commits, refuses waits past its bound, and costs the source one `max_lsn` per
//! interval however many calls wait, and none while no call waits.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::faulty::{FaultySource, ReadFault};
use common::{FlightFixture, SimFixture, code, test_signer, with_workload};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::protocol::{
    LsnAnswer, MAX_WAIT_MS, WaitForCommitsAnswer, WaitForCommitsBody,
};
use serde_json::json;
use tonic::Code;

async fn max_lsn(flight: &FlightFixture) -> Lsn {
    let answer: LsnAnswer = flight
        .client
        .action("max_lsn", &json!({}))
        .await
        .expect("max_lsn");
    answer.lsn.expect("a commit")
}

async fn wait(flight: &FlightFixture, after: Lsn, timeout_ms: u64) -> WaitForCommitsAnswer {
    flight
        .client
        .action(
            "wait_for_commits",
            &WaitForCommitsBody {
                after,
                timeout_ms: Some(timeout_ms),
            },
        )
        .await
        .expect("wait_for_commits")
}

/// A server over `sim` whose tail reads `max_lsn` every 50 ms, and the source it counts on.
async fn tail_server(sim: &SimFixture) -> (Arc<FaultySource>, FlightFixture) {
    let source = Arc::new(FaultySource::new(sim.db.clone(), ReadFault::None));
    let mut options = ServiceOptions::new(test_signer());
    options.tail_interval = Duration::from_millis(50);
    let flight = FlightFixture::start_with(source.clone(), options).await;
    (source, flight)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_during_the_wait_wakes_it_and_a_quiet_database_times_it_out() {
    let sim = with_workload(3, 20);
    let (_source, flight) = tail_server(&sim).await;
    let before = max_lsn(&flight).await;

    // Already past: the answer comes at once, with the current max_lsn.
    let answer = wait(&flight, before.decrement(), 30_000).await;
    assert_eq!(answer.lsn, Some(before));
    assert!(!answer.timed_out);

    // Nothing commits: the wait ends at its timeout and says so.
    let answer = wait(&flight, before, 300).await;
    assert_eq!(answer.lsn, Some(before));
    assert!(answer.timed_out);

    // A commit 300 ms into a 30 s wait wakes it.
    let writer = {
        let mut writer = sim.writer(99);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let mut tx = writer.begin();
            tx.insert(&common::orders(), 1).expect("insert");
            let lsn = tx.commit().expect("commit").expect("a commit LSN");
            writer.publish().expect("publish");
            lsn
        })
    };
    let answer = wait(&flight, before, 30_000).await;
    let committed = writer.join().expect("writer");
    assert!(!answer.timed_out, "{answer:?}");
    assert_eq!(answer.lsn, Some(committed));
    assert!(committed > before);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_calls_share_one_read_per_interval_and_an_idle_server_reads_nothing() {
    let sim = with_workload(4, 10);
    let (source, flight) = tail_server(&sim).await;
    let after = max_lsn(&flight).await;
    let calls = || source.max_lsn_calls.load(Ordering::SeqCst);

    // Sixteen calls wait 1 s each, side by side.
    let before = calls();
    let started = Instant::now();
    let waits: Vec<_> = (0..16)
        .map(|_| {
            let url = flight.url.clone();
            tokio::spawn(async move {
                let client = mssql_cdc_flight::client::CdcClient::connect(&url)
                    .await
                    .expect("connect");
                client
                    .action::<WaitForCommitsAnswer>(
                        "wait_for_commits",
                        &WaitForCommitsBody {
                            after,
                            timeout_ms: Some(1_000),
                        },
                    )
                    .await
                    .expect("wait")
            })
        })
        .collect();
    for waiting in waits {
        assert!(waiting.await.expect("task").timed_out);
    }
    let reads = calls() - before;
    let intervals = started.elapsed().as_millis() as u64 / 50 + 2;
    assert!(
        reads >= 1 && reads <= intervals,
        "{reads} max_lsn reads for 16 waiting calls over {intervals} intervals"
    );

    // No call waits: the tail reads nothing.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = calls();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(calls(), idle, "an idle tail reads max_lsn");
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_the_bound_is_refused() {
    let sim = with_workload(5, 5);
    let (_source, flight) = tail_server(&sim).await;
    let error = flight
        .client
        .action::<WaitForCommitsAnswer>(
            "wait_for_commits",
            &WaitForCommitsBody {
                after: Lsn::ZERO,
                timeout_ms: Some(MAX_WAIT_MS + 1),
            },
        )
        .await
        .expect_err("too long");
    assert_eq!(code(error), Code::InvalidArgument);
    flight.shutdown_and_wait().await;
}
