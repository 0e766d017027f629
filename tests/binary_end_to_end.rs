//! The real binaries: `serve` on port 0, `sim run` in another process while it serves, a
//! server killed in the middle of a stream, and a graceful shutdown.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use mssql_cdc_flight::Offset;
use mssql_cdc_flight::client::{CdcClient, ClientError};
use mssql_cdc_flight::protocol::{ChangesCommand, InitialOffsetBody, LatestOffsetBody, LsnAnswer};
use serde_json::json;

const BINARY: &str = env!("CARGO_BIN_EXE_mssql-cdc-flight");

fn run(args: &[&str]) -> String {
    let output = Command::new(BINARY)
        .args(args)
        .output()
        .expect("run the binary");
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf8")
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(dir: &Path) -> Self {
        Server::start_with(dir, &[])
    }

    /// Starts `serve` on port 0 with extra flags and reads the address it prints.
    fn start_with(dir: &Path, flags: &[&str]) -> Self {
        let mut child = Command::new(BINARY)
            .args([
                "serve",
                "--source",
                &format!("sim:{}", dir.display()),
                "--listen",
                "127.0.0.1:0",
            ])
            .args(flags)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("address line");
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .expect("listening on ADDR")
            .to_string();
        Server {
            child,
            url: format!("http://{address}"),
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn earliest(client: &CdcClient) -> Offset {
    client
        .action(
            "initial_offset",
            &InitialOffsetBody {
                table: "dbo.orders".into(),
                starting: None,
            },
        )
        .await
        .expect("initial offset")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_in_another_process_is_served_as_it_commits() {
    let dir = tempfile::tempdir().expect("temp");
    let db = dir.path().join("db");
    let db_text = db.display().to_string();
    run(&[
        "sim",
        "init",
        &db_text,
        "--customers",
        "10",
        "--orders",
        "10",
    ]);
    let server = Server::start(&db);
    let client = CdcClient::connect(&server.url).await.expect("connect");
    let start = earliest(&client).await;
    let before: LsnAnswer = client.action("max_lsn", &json!({})).await.expect("max");
    let journal = dir.path().join("journal.jsonl");
    run(&[
        "sim",
        "run",
        &db_text,
        "--commits",
        "300",
        "--journal",
        &journal.display().to_string(),
    ]);
    let after: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(start),
                max_commits: None,
                upper: None,
            },
        )
        .await
        .expect("latest");
    assert!(
        Some(after.lsn) > before.lsn,
        "the server sees the other process's commits"
    );
    let mut command = ChangesCommand::new("dbo.orders", before.lsn.expect("max"), Some(after.lsn));
    command.partitions = Some(3);
    command.min_partition_rows = Some(10);
    let plan = client.plan_changes(&command).await.expect("plan");
    let mut rows = 0;
    for endpoint in &plan.info.endpoint {
        let (_, completion) = client
            .collect_endpoint(endpoint.ticket.as_ref().expect("ticket"))
            .await
            .expect("read");
        rows += completion.rows;
    }
    let journaled = std::fs::read_to_string(&journal)
        .expect("journal")
        .lines()
        .filter(|line| line.contains("\"dbo.orders\""))
        .count();
    assert_eq!(
        rows as usize, journaled,
        "every committed change of the workload, once"
    );
    server.signal("-TERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_stream_never_yields_a_complete_stream() {
    let dir = tempfile::tempdir().expect("temp");
    let db = dir.path().join("db");
    // About 38 MB of change rows: more than the HTTP/2 windows and socket buffers hold, so
    // the stream is still running when the server dies.
    run(&[
        "sim",
        "init",
        &db.display().to_string(),
        "--customers",
        "0",
        "--orders",
        "150000",
    ]);
    let mut server = Server::start(&db);
    let client = CdcClient::connect(&server.url).await.expect("connect");
    let start = earliest(&client).await;
    let mut command = ChangesCommand::new("dbo.orders", start.lsn, None);
    command.serve.batch_rows = Some(500);
    let plan = client.plan_changes(&command).await.expect("plan");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    let mut rows = 0usize;
    let mut killed = false;
    let result = client
        .read_endpoint(&ticket, |batch| {
            rows += batch.num_rows();
            if !killed {
                server.child.kill().expect("kill -9");
                killed = true;
            }
        })
        .await;
    assert!(killed);
    match result {
        Err(ClientError::Status(_))
        | Err(ClientError::Incomplete { .. })
        | Err(ClientError::Protocol(_)) => {}
        other => {
            panic!("a killed server must not give a complete stream: {other:?} after {rows} rows")
        }
    }
    assert!(rows < 150_000, "the stream was cut: {rows} rows");
    let _ = server.child.wait();
    // With a shared key file, a ticket planned by one process is read whole by the next.
    let key = dir.path().join("ticket.key");
    std::fs::write(
        &key,
        "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
    )
    .expect("key");
    let key_flags = ["--ticket-key-file", key.to_str().expect("utf8 path")];
    let restarted = Server::start_with(&db, &key_flags);
    let client = CdcClient::connect(&restarted.url).await.expect("connect");
    let plan = client.plan_changes(&command).await.expect("plan");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    drop(restarted);
    let replica = Server::start_with(&db, &key_flags);
    let client = CdcClient::connect(&replica.url).await.expect("connect");
    let (_, completion) = client
        .collect_endpoint(&ticket)
        .await
        .expect("another process redeems the ticket");
    assert_eq!(completion.rows, 150_000);
    replica.signal("-TERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sources_and_keys_fail_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("temp");
    let output = Command::new(BINARY)
        .args([
            "serve",
            "--source",
            &format!("sim:{}", dir.path().join("missing").display()),
        ])
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("sim init"),
        "tells how to create one: {stderr}"
    );
    let output = Command::new(BINARY)
        .args(["serve", "--source", "postgres://x"])
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown source"));
    let short = dir.path().join("short.key");
    std::fs::write(&short, "tiny").expect("key");
    run(&[
        "sim",
        "init",
        &dir.path().join("db").display().to_string(),
        "--customers",
        "1",
        "--orders",
        "1",
    ]);
    let output = Command::new(BINARY)
        .args([
            "serve",
            "--source",
            &format!("sim:{}", dir.path().join("db").display()),
        ])
        .args([
            "--ticket-key-file",
            &short.display().to_string(),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&output.stderr).contains("at least 32 bytes"));
}
