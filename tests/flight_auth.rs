//! Who may call and what they may read, through the Rust client and a stock arrow-flight
//! client: bearer tokens, the basic-credentials handshake, mutual TLS, per-table
//! authorization (list filtered, plans, actions and redemptions refused), and tickets that
//! expire and survive a key rotation.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow_flight::{Criteria, HandshakeRequest};
use base64::Engine;
use common::{
    FlightFixture, SimFixture, as_principal, code, earliest, loaded, raw_client, test_signer,
};
use mssql_cdc_flight::client::{CdcClient, ClientTls};
use mssql_cdc_flight::flight::auth::{Authenticator, sha256};
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::flight::{ServiceOptions, TlsIdentity};
use mssql_cdc_flight::protocol::{ChangesCommand, InitialOffsetBody};
use mssql_cdc_flight::status::reason_of_status;
use mssql_cdc_flight::{Lsn, Offset};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::Code;

const WRITER: &str = "writer-token-of-the-test";
const ANALYST: &str = "analyst-token-of-the-test";

/// Two principals: `writer` reads everything, `analyst` only dbo.customers; with mutual TLS,
/// `spark` is known by its certificate's hash.
fn authenticator(spark_certificate: Option<&[u8]>) -> Arc<Authenticator> {
    let mut principals = vec![
        serde_json::json!({"name": "writer", "tables": ["*"], "token_sha256": hex::encode(sha256(WRITER.as_bytes()))}),
        serde_json::json!({"name": "analyst", "tables": ["dbo.customers"], "token_sha256": hex::encode(sha256(ANALYST.as_bytes()))}),
    ];
    if let Some(der) = spark_certificate {
        principals.push(serde_json::json!({"name": "spark", "tables": ["dbo.orders"], "certificate_sha256": hex::encode(sha256(der))}));
    }
    let json = serde_json::json!({ "principals": principals });
    Arc::new(Authenticator::from_json(json.to_string().as_bytes()).expect("tokens"))
}

async fn secured(sim: &SimFixture) -> FlightFixture {
    let options = ServiceOptions {
        authenticator: Some(authenticator(None)),
        ..ServiceOptions::new(test_signer())
    };
    FlightFixture::start_with(Arc::new(sim.db.clone()), options).await
}

fn initial(table: &str) -> InitialOffsetBody {
    InitialOffsetBody {
        table: table.into(),
        starting: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_or_a_wrong_one_is_unauthenticated_on_every_call() {
    let (sim, plain) = loaded(31, 40).await;
    plain.shutdown_and_wait().await;
    let flight = secured(&sim).await;
    let anonymous = &flight.client;
    let wrong = as_principal(&flight, "guessed").await;
    for client in [anonymous, &wrong] {
        let error = client.list_tables().await.expect_err("list");
        if let mssql_cdc_flight::client::ClientError::Status(status) = &error {
            assert_eq!(
                reason_of_status(status).as_deref(),
                Some("UNAUTHENTICATED"),
                "{status:?}"
            );
        }
        assert_eq!(code(error), Code::Unauthenticated);
        let error = client
            .action::<Offset>("initial_offset", &initial("dbo.orders"))
            .await
            .expect_err("action");
        assert_eq!(code(error), Code::Unauthenticated);
        let error = client
            .plan_changes(&ChangesCommand::new("dbo.orders", Lsn::ZERO, None))
            .await
            .expect_err("plan");
        assert_eq!(code(error), Code::Unauthenticated);
    }
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_sees_plans_and_redeems_only_its_tables() {
    let (sim, plain) = loaded(32, 80).await;
    plain.shutdown_and_wait().await;
    let flight = secured(&sim).await;
    let writer = as_principal(&flight, WRITER).await;
    let analyst = as_principal(&flight, ANALYST).await;
    assert_eq!(writer.list_tables().await.expect("writer lists").len(), 2);
    let listed = analyst.list_tables().await.expect("analyst lists");
    assert_eq!(listed.len(), 1);
    assert!(
        String::from_utf8_lossy(
            &listed[0]
                .flight_descriptor
                .as_ref()
                .expect("descriptor")
                .cmd
        )
        .contains("dbo.customers")
    );
    // Planning, actions naming the table or one of its capture instances: refused.
    let start: Offset = writer
        .action("initial_offset", &initial("dbo.orders"))
        .await
        .expect("writer's offset");
    let command = ChangesCommand::new("dbo.orders", start.lsn, None);
    let error = analyst.plan_changes(&command).await.expect_err("plan");
    let status = match &error {
        mssql_cdc_flight::client::ClientError::Status(status) => status.as_ref().clone(),
        other => panic!("{other}"),
    };
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(
        reason_of_status(&status).as_deref(),
        Some("TABLE_NOT_GRANTED")
    );
    for (name, body) in [
        ("initial_offset", serde_json::json!({"table": "dbo.orders"})),
        ("key_extent", serde_json::json!({"table": "dbo.orders"})),
    ] {
        let error = analyst
            .action::<serde_json::Value>(name, &body)
            .await
            .expect_err(name);
        assert_eq!(code(error), Code::PermissionDenied, "{name}");
    }
    // A capture instance of a table not granted is answered as one that does not exist,
    // word for word, and a missing name gets no hint of similar ones (other tables' names).
    let refused = |name: &str| {
        let analyst = analyst.clone();
        let body = serde_json::json!({"capture_instance": name});
        async move {
            match analyst.action::<serde_json::Value>("min_lsn", &body).await {
                Err(mssql_cdc_flight::client::ClientError::Status(status)) => (
                    status.code(),
                    status.message().replace(&*name_of(&body), "NAME"),
                ),
                other => panic!("{other:?}"),
            }
        }
    };
    fn name_of(body: &serde_json::Value) -> String {
        body["capture_instance"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
    let existing = refused("dbo_orders").await;
    assert_eq!(existing.0, Code::NotFound);
    assert_eq!(existing, refused("dbo_nothing").await);
    assert_eq!(
        existing,
        refused("DBO_ORDERS").await,
        "no 'did you mean dbo_orders'"
    );
    // The database-wide LSN functions stay open to every principal.
    analyst
        .action::<serde_json::Value>("max_lsn", &serde_json::json!({}))
        .await
        .expect("max_lsn");
    // A ticket the writer planned is refused to the analyst when redeemed.
    let plan = writer.plan_changes(&command).await.expect("writer plans");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    let (batches, completion) = writer
        .collect_endpoint(&ticket)
        .await
        .expect("writer reads");
    assert_eq!(
        batches
            .iter()
            .map(|batch| batch.num_rows() as u64)
            .sum::<u64>(),
        completion.rows
    );
    let error = analyst.collect_endpoint(&ticket).await.expect_err("redeem");
    assert_eq!(code(error), Code::PermissionDenied);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handshake_trades_basic_credentials_for_the_bearer_token() {
    let (sim, plain) = loaded(33, 10).await;
    plain.shutdown_and_wait().await;
    let flight = secured(&sim).await;
    let mut raw = raw_client(&flight).await;
    let basic = |user: &str, password: &str| {
        let encoded =
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let mut request =
            tonic::Request::new(futures::stream::iter(vec![HandshakeRequest::default()]));
        request.metadata_mut().insert(
            "authorization",
            format!("Basic {encoded}").parse().expect("header"),
        );
        request
    };
    let response = raw
        .handshake(basic("analyst", ANALYST))
        .await
        .expect("handshake");
    let bearer = response
        .metadata()
        .get("authorization")
        .expect("bearer header")
        .to_str()
        .expect("text")
        .to_string();
    assert_eq!(bearer, format!("Bearer {ANALYST}"));
    let mut request = tonic::Request::new(Criteria::default());
    request
        .metadata_mut()
        .insert("authorization", bearer.parse().expect("header"));
    let listed: Vec<_> = futures::TryStreamExt::try_collect::<Vec<_>>(
        raw.list_flights(request).await.expect("list").into_inner(),
    )
    .await
    .expect("infos");
    assert_eq!(listed.len(), 1);
    let refused = raw
        .handshake(basic("writer", ANALYST))
        .await
        .expect_err("another principal's token");
    assert_eq!(refused.code(), Code::Unauthenticated);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_knows_a_client_by_its_certificate() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (sim, plain) = loaded(34, 40).await;
    plain.shutdown_and_wait().await;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
    let issue = |names: Vec<String>| {
        let key = KeyPair::generate().expect("key");
        let certificate = CertificateParams::new(names)
            .expect("params")
            .signed_by(&key, &ca)
            .expect("signed");
        (certificate, key)
    };
    let (server_certificate, server_key) = issue(vec!["localhost".into()]);
    let (spark_certificate, spark_key) = issue(vec!["spark".into()]);
    let (stranger_certificate, stranger_key) = issue(vec!["stranger".into()]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().expect("address").port()
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServiceOptions {
        authenticator: Some(authenticator(Some(spark_certificate.der()))),
        ..ServiceOptions::new(test_signer())
    };
    let server = tokio::spawn(mssql_cdc_flight::flight::serve(
        listener,
        Arc::new(sim.db.clone()),
        options,
        Some(TlsIdentity {
            certificate: server_certificate.pem().into_bytes(),
            key: server_key.serialize_pem().into_bytes(),
            client_ca: Some(ca.pem().into_bytes()),
        }),
        async {
            let _ = stopped.await;
        },
    ));
    let tls = |identity: Option<(String, String)>| ClientTls {
        ca_certificate: ca.pem().into_bytes(),
        domain: None,
        identity: identity.map(|(certificate, key)| (certificate.into_bytes(), key.into_bytes())),
    };
    let spark = CdcClient::connect_with(
        &url,
        Some(&tls(Some((
            spark_certificate.pem(),
            spark_key.serialize_pem(),
        )))),
    )
    .await
    .expect("spark connects");
    let start: Offset = spark
        .action("initial_offset", &initial("dbo.orders"))
        .await
        .expect("spark's principal reads dbo.orders");
    assert!(start.lsn > Lsn::ZERO);
    let error = spark
        .action::<Offset>("initial_offset", &initial("dbo.customers"))
        .await
        .expect_err("not its table");
    assert_eq!(code(error), Code::PermissionDenied);
    // A certificate the CA signed but the tokens file does not name: no principal.
    let stranger = CdcClient::connect_with(
        &url,
        Some(&tls(Some((
            stranger_certificate.pem(),
            stranger_key.serialize_pem(),
        )))),
    )
    .await
    .expect("the CA signed it");
    let error = stranger
        .list_tables()
        .await
        .expect_err("unknown certificate");
    assert_eq!(code(error), Code::Unauthenticated);
    // No certificate at all: the TLS handshake itself fails.
    let refused = match CdcClient::connect_with(&url, Some(&tls(None))).await {
        Err(_) => true,
        Ok(client) => client.list_tables().await.is_err(),
    };
    assert!(refused);
    let _ = stop.send(());
    server.await.expect("join").expect("served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_expire_and_survive_a_key_rotation() {
    let (sim, plain) = loaded(35, 40).await;
    let start = earliest(&plain, "dbo.orders").await;
    plain.shutdown_and_wait().await;
    let old_key =
        TicketSigner::from_key_bytes(b"the fleet's ticket key of last month\n").expect("key");
    let rotated = TicketSigner::from_key_bytes(
        b"the fleet's ticket key of this month\nthe fleet's ticket key of last month\n",
    )
    .expect("keys");
    let old = FlightFixture::start_with_key(Arc::new(sim.db.clone()), old_key).await;
    let new = FlightFixture::start_with_key(Arc::new(sim.db.clone()), rotated).await;
    let command = ChangesCommand::new("dbo.orders", start.lsn, None);
    let in_flight = old.client.plan_changes(&command).await.expect("old plan");
    let ticket = in_flight.info.endpoint[0].ticket.clone().expect("ticket");
    new.client
        .collect_endpoint(&ticket)
        .await
        .expect("the rotated server redeems the old key's ticket");
    let fresh = new.client.plan_changes(&command).await.expect("new plan");
    let error = old
        .client
        .collect_endpoint(&fresh.info.endpoint[0].ticket.clone().expect("ticket"))
        .await
        .expect_err("the old server lacks the new key");
    assert_eq!(code(error), Code::PermissionDenied);
    // A ticket past its lifetime asks for a new plan.
    let brief = FlightFixture::start_with_key(
        Arc::new(sim.db.clone()),
        test_signer().with_lifetime(Duration::from_secs(1)),
    )
    .await;
    let plan = brief.client.plan_changes(&command).await.expect("plan");
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let error = brief
        .client
        .collect_endpoint(&plan.info.endpoint[0].ticket.clone().expect("ticket"))
        .await
        .expect_err("expired");
    let text = error.to_string();
    assert_eq!(code(error), Code::FailedPrecondition);
    assert!(text.contains("plan the read again"), "{text}");
    for fixture in [old, new, brief] {
        fixture.shutdown_and_wait().await;
    }
}
