//! The live tail, `wait_for_commits`: it answers once `max_lsn` moves past the caller's LSN
//! (a commit during the wait wakes it), answers at once when it already has, times out when
//! nothing commits, refuses waits past its bound, and costs the source one `max_lsn` per
//! interval however many calls wait, and none while no call waits. A wait on named tables
//! answers only for their changes, with the tables that changed.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::faulty::{FaultySource, ReadFault};
use common::{FlightFixture, SimFixture, code, test_signer, with_workload};
use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::protocol::{
    LsnAnswer, MAX_WAIT_MS, MAX_WAIT_TABLES, WaitForCommitsAnswer, WaitForCommitsBody,
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
                tables: None,
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
                            tables: None,
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
                tables: None,
            },
        )
        .await
        .expect_err("too long");
    assert_eq!(code(error), Code::InvalidArgument);
    flight.shutdown_and_wait().await;
}

async fn wait_on(
    flight: &FlightFixture,
    after: Lsn,
    tables: &[&str],
    timeout_ms: u64,
) -> Result<WaitForCommitsAnswer, mssql_cdc_flight::client::ClientError> {
    flight
        .client
        .action(
            "wait_for_commits",
            &WaitForCommitsBody {
                after,
                timeout_ms: Some(timeout_ms),
                tables: Some(tables.iter().map(|table| table.to_string()).collect()),
            },
        )
        .await
}

/// Commits one insert into each table at its delay from now, in order, on a thread; joins to
/// the commit LSNs.
fn commit_later(
    sim: &SimFixture,
    seed: u64,
    commits: &[(&str, Duration)],
) -> std::thread::JoinHandle<Vec<Lsn>> {
    let mut writer = sim.writer(seed);
    let commits: Vec<(mssql_cdc_flight::source::TableName, Duration)> = commits
        .iter()
        .map(|(table, delay)| (table.parse().expect("table"), *delay))
        .collect();
    let started = Instant::now();
    std::thread::spawn(move || {
        let mut lsns = Vec::new();
        for (table, delay) in commits {
            std::thread::sleep(delay.saturating_sub(started.elapsed()));
            let mut tx = writer.begin();
            tx.insert(&table, 1).expect("insert");
            lsns.push(tx.commit().expect("commit").expect("a commit LSN"));
            writer.publish().expect("publish");
        }
        lsns
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_on_tables_answers_only_for_their_changes_and_names_them() {
    let sim = with_workload(6, 10);
    let (source, flight) = tail_server(&sim).await;
    let start = max_lsn(&flight).await;
    let checks = || source.changes_checks.load(Ordering::SeqCst);

    // A commit to orders does not answer a wait on customers: the wait times out, checked
    // through that commit, in one source check.
    let before = checks();
    let orders = commit_later(&sim, 61, &[("dbo.orders", Duration::from_millis(100))]);
    let answer = wait_on(&flight, start, &["dbo.customers"], 1_000)
        .await
        .expect("wait");
    let orders_lsn = orders.join().expect("orders")[0];
    assert!(answer.timed_out, "{answer:?}");
    assert_eq!(answer.changed, Some(Vec::new()));
    assert_eq!(
        answer.lsn,
        Some(orders_lsn),
        "checked through the orders commit"
    );
    assert_eq!(
        checks() - before,
        1,
        "one check for the one move of max_lsn"
    );

    // Nothing commits: checked through the caller's own LSN.
    let answer = wait_on(&flight, orders_lsn, &["dbo.customers"], 200)
        .await
        .expect("wait");
    assert!(answer.timed_out);
    assert_eq!(answer.lsn, Some(orders_lsn));

    // Orders, then customers: the wait answers for customers, and names only the tables
    // listed that changed, in the body's order.
    let both = commit_later(
        &sim,
        62,
        &[
            ("dbo.orders", Duration::from_millis(100)),
            ("dbo.customers", Duration::from_millis(600)),
        ],
    );
    let answer = wait_on(&flight, orders_lsn, &["dbo.customers"], 30_000)
        .await
        .expect("wait");
    let lsns = both.join().expect("commits");
    let (second_orders, customers_lsn) = (lsns[0], lsns[1]);
    assert!(!answer.timed_out, "{answer:?}");
    assert_eq!(answer.changed, Some(vec!["dbo.customers".to_string()]));
    assert_eq!(answer.lsn, Some(customers_lsn));
    // Both changed since the first orders commit: both are named, in the body's order.
    let answer = wait_on(&flight, orders_lsn, &["dbo.orders", "dbo.customers"], 1_000)
        .await
        .expect("wait");
    assert!(second_orders > orders_lsn);
    assert_eq!(
        answer.changed,
        Some(vec!["dbo.orders".to_string(), "dbo.customers".to_string()])
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_on_no_tables_or_too_many_is_refused_and_an_untracked_one_never_changes() {
    let sim = with_workload(7, 5);
    let (_source, flight) = tail_server(&sim).await;
    let after = max_lsn(&flight).await;
    let error = wait_on(&flight, after, &[], 100).await.expect_err("none");
    assert_eq!(code(error), Code::InvalidArgument);
    let many: Vec<String> = (0..=MAX_WAIT_TABLES).map(|n| format!("dbo.t{n}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let error = wait_on(&flight, after, &many, 100)
        .await
        .expect_err("too many");
    assert_eq!(code(error), Code::InvalidArgument);
    let error = wait_on(&flight, after, &["[not closed"], 100)
        .await
        .expect_err("a bad name");
    assert_eq!(code(error), Code::InvalidArgument);
    // A table CDC does not track beside one it does: the wait goes on for the other.
    let orders = commit_later(&sim, 71, &[("dbo.orders", Duration::from_millis(100))]);
    let answer = wait_on(&flight, after, &["dbo.nowhere", "dbo.orders"], 30_000)
        .await
        .expect("wait");
    let lsns = orders.join().expect("orders");
    assert_eq!(answer.changed, Some(vec!["dbo.orders".to_string()]));
    assert_eq!(answer.lsn, Some(lsns[0]));
    flight.shutdown_and_wait().await;
}
