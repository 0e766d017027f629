//! The writer reads a Flight server that speaks TLS (`https://`), trusting the CA named by
//! `MSSQL_CDC_FLIGHT_TLS_CA`, and refuses an `https://` server without it.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::{Lab, bronze_rows};
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_writer::stream::FLIGHT_CA_VARIABLE;

const WRITER: &str = env!("CARGO_BIN_EXE_mssql-cdc-writer");

/// `mssql-cdc-writer run --available-now` of dbo.orders from `server` into the lab's lake.
fn run_writer(lab: &Lab, server: &str, ca: Option<&std::path::Path>) -> std::process::Output {
    let config = lab.config();
    let mut command = Command::new(WRITER);
    command
        .args(["run", "--server", server, "--table", "dbo.orders"])
        .args(["--target", &config.target, "--facts", &config.facts])
        .args(["--app-id", "orders", "--checkpoint"])
        .arg(&config.checkpoint)
        .args(["--granularity", "minute", "--available-now"])
        .env("RUST_LOG", "warn")
        .env_remove(FLIGHT_CA_VARIABLE);
    if let Some(ca) = ca {
        command.env(FLIGHT_CA_VARIABLE, ca);
    }
    command.output().expect("run the writer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_streams_from_a_tls_server_it_trusts_and_refuses_one_it_cannot_verify() {
    let lab = Lab::new().await;
    lab.workload(81, 120);
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
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().expect("address").port()
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(mssql_cdc_flight::flight::serve(
        listener,
        Arc::new(lab.db.clone()),
        mssql_cdc_flight::flight::ServiceOptions::new(TicketSigner::random().expect("key")),
        Some(identity),
        async {
            let _ = stopped.await;
        },
    ));
    let ca = lab.dir.path().join("ca.pem");
    std::fs::write(&ca, certified.cert.pem()).expect("write CA");
    let stranger = lab.dir.path().join("stranger.pem");
    std::fs::write(
        &stranger,
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
            .expect("other certificate")
            .cert
            .pem(),
    )
    .expect("write other CA");

    let without = run_writer(&lab, &url, None);
    assert!(!without.status.success());
    assert!(
        String::from_utf8_lossy(&without.stderr).contains(FLIGHT_CA_VARIABLE),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
    let untrusted = run_writer(&lab, &url, Some(&stranger));
    assert!(
        !untrusted.status.success(),
        "a server whose certificate the CA did not sign was read"
    );
    assert!(bronze_rows(&lab).await.is_none(), "nothing reached bronze");

    let trusted = run_writer(&lab, &url, Some(&ca));
    assert!(
        trusted.status.success(),
        "{}",
        String::from_utf8_lossy(&trusted.stderr)
    );
    let over_tls = bronze_rows(&lab).await.expect("bronze written");
    // The same changes as read over the lab's plaintext server into another app's bronze.
    let plain = Lab::new().await;
    plain.workload(81, 120);
    let plain_run = run_writer(&plain, &plain.url, None);
    assert!(plain_run.status.success());
    let over_plaintext = bronze_rows(&plain).await.expect("bronze written");
    assert!(!over_tls.is_empty());
    assert_eq!(over_tls.len(), over_plaintext.len());
    let _ = stop.send(());
    server.await.expect("join").expect("server");
}
