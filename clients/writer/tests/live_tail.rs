//! A continuous stream on the server's live tail takes a new commit as soon as it lands, not
//! at the next poll; with the tail off it waits the poll interval.

mod common;

use std::time::{Duration, Instant};

use common::{Lab, bronze_rows};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tail::Waiting;

/// Waits until bronze holds every committed change, for at most `limit`; whether it did.
async fn caught_up_within(lab: &Lab, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if bronze_rows(lab).await.as_ref() == Some(&lab.committed()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Streams continuously as `waiting` says; returns whether commits made while it waits reach
/// bronze within `limit`.
async fn takes_new_commits_within(waiting: Waiting, limit: Duration) -> bool {
    let lab = Lab::new().await;
    lab.workload(7, 40);
    let mut stream = Stream::connect(lab.config()).await.expect("connect");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move { stream.run_continuous(waiting, stopped).await });
    assert!(
        caught_up_within(&lab, Duration::from_secs(30)).await,
        "the first batch"
    );
    // A batch that brought rows is followed at once by another plan, which finds nothing and
    // starts the wait; under load that can take a while, so the commits come 2 s later (well
    // inside a 60 s poll interval) and land during the wait.
    tokio::time::sleep(Duration::from_secs(2)).await;
    lab.workload(8, 20);
    let caught_up = caught_up_within(&lab, limit).await;
    stop.send(true).expect("stop");
    running.await.expect("task").expect("stream");
    caught_up
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_on_the_live_tail_takes_a_commit_without_waiting_the_poll_interval() {
    // A 60 s poll interval: only the tail can bring the commits within 20 s.
    assert!(
        takes_new_commits_within(
            Waiting::tail(Duration::from_secs(60)),
            Duration::from_secs(20)
        )
        .await,
        "bronze did not take the commits within 20 s of a 60 s poll interval"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_tail_off_the_stream_waits_its_poll_interval() {
    let polling = Waiting {
        poll: Duration::from_secs(60),
        live_tail: false,
    };
    assert!(
        !takes_new_commits_within(polling, Duration::from_secs(3)).await,
        "a polling stream took the commits before its poll interval ended"
    );
}
