//! A continuous stream on the server's live tail takes a new commit as soon as it lands, not
//! at the next poll; with the tail off it waits the poll interval. A quiet table writes a
//! batch only when its verdict moves, and the sidecar's one shared tail wakes only the
//! tables that changed.

mod common;

use std::time::{Duration, Instant};

use common::{Lab, bronze_rows, facts_batches};
use mssql_cdc_flight::sim::{Clock, SimWriter};
use mssql_cdc_writer::checkpoint::Checkpoint;
use mssql_cdc_writer::control::{self, Granularity};
use mssql_cdc_writer::sidecar::{self, SidecarConfig};
use mssql_cdc_writer::stream::Stream;
use mssql_cdc_writer::tail::{SharedTail, Waiting};

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

/// Commits `commits` transactions of one insert each into `table`, published at once.
fn commit_to(writer: &mut SimWriter, table: &str, commits: usize) {
    let table = table.parse().expect("table");
    for _ in 0..commits {
        let mut tx = writer.begin();
        tx.insert(&table, 1).expect("insert");
        tx.commit().expect("commit");
        writer.publish().expect("publish");
    }
}

/// Waits until `ready` holds, for at most `limit`; whether it did.
async fn within<F, Fut>(limit: Duration, mut ready: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ready().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_table_writes_a_batch_only_when_its_verdict_moves() {
    let lab = Lab::new().await;
    lab.workload(17, 30);
    let mut config = lab.config();
    config.granularity = Granularity::Minute;
    let control_url = mssql_cdc_writer::tables::table_url(&lab.lake("control")).expect("url");
    let mut stream = Stream::connect(config).await.expect("connect");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Polling every 100 ms: each poll sees max_lsn move while customers commits.
    let waiting = Waiting {
        poll: Duration::from_millis(100),
        live_tail: false,
    };
    let running = tokio::spawn(async move { stream.run_continuous(waiting, stopped).await });
    assert!(
        caught_up_within(&lab, Duration::from_secs(30)).await,
        "the first batch"
    );
    // Its facts row follows the bronze commit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let written = facts_batches(&lab).await.len();
    let verdict = control::finalized_until(&control_url, "dbo.orders")
        .await
        .expect("control")
        .expect("a verdict");

    // Customers commits 1 ms apart, inside one minute: orders has nothing to write.
    let mut close = lab.writer(171);
    for _ in 0..10 {
        commit_to(&mut close, "dbo.customers", 1);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        facts_batches(&lab).await.len(),
        written,
        "orders wrote batches while only customers committed within one minute"
    );

    // A customers commit a minute later moves orders' verdict: one empty batch.
    drop(close);
    let mut later = lab
        .db
        .writer(
            Clock::Virtual {
                step_micros: 61_000_000,
            },
            172,
        )
        .expect("writer");
    commit_to(&mut later, "dbo.customers", 1);
    assert!(
        within(Duration::from_secs(20), || async {
            control::finalized_until(&control_url, "dbo.orders")
                .await
                .expect("control")
                .is_some_and(|now| now > verdict)
        })
        .await,
        "the verdict did not move past {verdict:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let facts = facts_batches(&lab).await;
    assert_eq!(facts.len(), written + 1, "one batch moved the verdict");
    assert_eq!(facts.last().map(|row| row.1), Some(0), "without rows");
    stop.send(true).expect("stop");
    running.await.expect("task").expect("stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecars_shared_tail_wakes_only_the_table_that_changed() {
    let lab = Lab::new().await;
    lab.workload(19, 60);
    let text = format!(
        "server = \"{}\"\nfacts = \"{}\"\ncontrol = \"{}\"\ncheckpoints = \"{}\"\n\
         granularity = \"day\"\npoll_seconds = 60.0\nmaintenance_minutes = 0.0\n\
         [[tables]]\ntable = \"dbo.orders\"\ntarget = \"{}\"\napp_id = \"orders\"\n\
         [[tables]]\ntable = \"dbo.customers\"\ntarget = \"{}\"\napp_id = \"customers\"\n",
        lab.url,
        lab.lake("facts"),
        lab.lake("control"),
        lab.dir.path().join("checkpoints").display(),
        lab.lake("bronze_orders"),
        lab.lake("bronze_customers"),
    );
    let path = lab.dir.path().join("sidecar.toml");
    std::fs::write(&path, text).expect("config");
    let config = SidecarConfig::load(&path).expect("config");
    let customers_checkpoint = config.checkpoint("customers");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move { sidecar::run_continuous(&config, stopped).await });
    let last_customers_batch = || async {
        Checkpoint::open(&customers_checkpoint)
            .await
            .expect("checkpoint")
            .last()
            .await
            .expect("last")
            .map(|batch| (batch.batch_id, batch.committed))
    };
    assert!(
        caught_up_within(&lab, Duration::from_secs(30)).await,
        "orders' first batch"
    );
    assert!(
        within(Duration::from_secs(30), || async {
            last_customers_batch()
                .await
                .is_some_and(|(_, committed)| committed)
        })
        .await,
        "customers' first batch"
    );
    let customers_before = last_customers_batch().await;

    // Orders commits; the poll interval is a minute, so only the tail brings them in time,
    // and customers, which did not change, writes nothing.
    let mut writer = lab.writer(191);
    commit_to(&mut writer, "dbo.orders", 5);
    assert!(
        caught_up_within(&lab, Duration::from_secs(20)).await,
        "the shared tail did not wake orders within 20 s of a 60 s poll interval"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        last_customers_batch().await,
        customers_before,
        "customers wrote a batch though only orders changed"
    );

    // Then customers commits: its stream wakes too.
    commit_to(&mut writer, "dbo.customers", 2);
    assert!(
        within(Duration::from_secs(20), || async {
            last_customers_batch().await > customers_before
        })
        .await,
        "the shared tail did not wake customers"
    );
    stop.send(true).expect("stop");
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the sidecar stops")
        .expect("join");
}

/// Whether `wake` fires within `limit`.
async fn woken(wake: &tokio::sync::Notify, limit: Duration) -> bool {
    tokio::time::timeout(limit, wake.notified()).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_tail_wakes_a_table_for_its_commits_and_every_table_for_a_new_period() {
    let lab = Lab::new().await;
    lab.workload(23, 20);
    let shared = std::sync::Arc::new(SharedTail::new(
        ["dbo.orders".to_string(), "dbo.customers".to_string()],
        Granularity::Minute,
    ));
    let client = mssql_cdc_writer::stream::connect_server(&lab.url)
        .await
        .expect("connect");
    assert!(shared.supported(&client).await);
    let (orders, customers) = (
        shared.wake("dbo.orders").expect("orders"),
        shared.wake("dbo.customers").expect("customers"),
    );
    assert!(shared.wake("dbo.elsewhere").is_none());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = {
        let shared = std::sync::Arc::clone(&shared);
        tokio::spawn(async move {
            shared
                .run(&client, Duration::from_millis(100), stopped)
                .await;
        })
    };
    // Let the tail take its starting LSN before the commits.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Orders commits within the minute: orders wakes, customers does not.
    let mut writer = lab.writer(231);
    commit_to(&mut writer, "dbo.orders", 3);
    assert!(woken(&orders, Duration::from_secs(10)).await, "orders");
    assert!(
        !woken(&customers, Duration::from_secs(1)).await,
        "customers woke for orders' commits"
    );
    drop(writer);

    // An orders commit a minute later: a new verdict period wakes every table.
    let mut later = lab
        .db
        .writer(
            Clock::Virtual {
                step_micros: 61_000_000,
            },
            232,
        )
        .expect("writer");
    commit_to(&mut later, "dbo.orders", 1);
    assert!(woken(&orders, Duration::from_secs(10)).await, "orders");
    assert!(
        woken(&customers, Duration::from_secs(10)).await,
        "customers did not wake for the new period"
    );
    stop.send(true).expect("stop");
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("the shared tail stops")
        .expect("join");
}
