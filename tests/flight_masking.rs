//! Masking at the source, through the Rust client and a stock arrow-flight client: a masked
//! column's clear value never leaves the server for a caller without a clear grant (not in
//! the rows, not in the bytes on the wire, not through a ticket planned for another caller,
//! not through key or digest calls), and the masked values are what the masks file says.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use common::{FlightFixture, SimFixture, as_principal, code, loaded, raw_client, test_signer};
use futures::TryStreamExt;
use mssql_cdc_flight::client::{CdcClient, ClientError};
use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::flight::auth::{Authenticator, sha256};
use mssql_cdc_flight::flight::masking::MaskPolicy;
use mssql_cdc_flight::masking::{MASK_METADATA_KEY, Mask};
use mssql_cdc_flight::protocol::{ChangesCommand, ChunkSpec, SnapshotCommand};
use mssql_cdc_flight::status::reason_of_status;
use mssql_cdc_flight::{Lsn, Offset};
use ring::hmac;
use tonic::Code;

const CLEAR: &str = "clear-token-of-the-masking-test";
const MASKED: &str = "masked-token-of-the-masking-test";
const HASH_KEY: &[u8] = b"the hash key of the masking test, 32+ bytes";

/// `writer` reads dbo.customers in clear; `analyst` reads every table, masked.
fn authenticator() -> Arc<Authenticator> {
    let json = serde_json::json!({"principals": [
        {"name": "writer", "tables": ["*"], "clear": ["dbo.customers"],
         "token_sha256": hex::encode(sha256(CLEAR.as_bytes()))},
        {"name": "analyst", "tables": ["*"], "token_sha256": hex::encode(sha256(MASKED.as_bytes()))},
    ]});
    Arc::new(Authenticator::from_json(json.to_string().as_bytes()).expect("tokens"))
}

fn masks(tables: serde_json::Value) -> Arc<MaskPolicy> {
    let json = serde_json::json!({"hash_key_file": "mask.key", "tables": tables});
    Arc::new(
        MaskPolicy::parse(json.to_string().as_bytes(), |_| Ok(HASH_KEY.to_vec())).expect("masks"),
    )
}

/// The customers' email hashed, name cut to 3 characters, balance nulled.
fn customer_masks() -> Arc<MaskPolicy> {
    masks(serde_json::json!({"dbo.customers": {
        "Email": "hash", "name": "truncate(3)", "balance": "null",
    }}))
}

async fn masked_server(sim: &SimFixture, masks: Arc<MaskPolicy>, auth: bool) -> FlightFixture {
    let options = ServiceOptions {
        authenticator: auth.then(authenticator),
        masks,
        ..ServiceOptions::new(test_signer())
    };
    FlightFixture::start_with(Arc::new(sim.db.clone()), options).await
}

async fn earliest(client: &CdcClient, table: &str) -> Lsn {
    let offset: Offset = client
        .action("initial_offset", &serde_json::json!({"table": table}))
        .await
        .expect("offset");
    offset.lsn
}

/// Every row of every endpoint of a changes plan of dbo.customers.
async fn changes(client: &CdcClient) -> (Vec<RecordBatch>, Vec<arrow_flight::Ticket>) {
    let command = ChangesCommand::new(
        "dbo.customers",
        earliest(client, "dbo.customers").await,
        None,
    );
    let plan = client.plan_changes(&command).await.expect("plan");
    let mut batches = Vec::new();
    let mut tickets = Vec::new();
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.clone().expect("ticket");
        batches.extend(client.collect_endpoint(&ticket).await.expect("read").0);
        tickets.push(ticket);
    }
    (batches, tickets)
}

async fn snapshot(client: &CdcClient) -> Vec<RecordBatch> {
    let plan = client
        .plan_snapshot(&SnapshotCommand::new("dbo.customers"))
        .await
        .expect("plan snapshot");
    let mut batches = Vec::new();
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.clone().expect("ticket");
        batches.extend(
            client
                .collect_endpoint(&ticket)
                .await
                .expect("snapshot read")
                .0,
        );
    }
    batches
}

/// The values of a text column of `batches`, NULLs as `None`.
fn texts(batches: &[RecordBatch], name: &str) -> Vec<Option<String>> {
    batches
        .iter()
        .flat_map(|batch| {
            let column = batch.column_by_name(name).expect("column");
            let column = column.as_string::<i32>();
            column
                .iter()
                .map(|value| value.map(str::to_string))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn hmac_hex(text: &str) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, HASH_KEY);
    hex::encode(hmac::sign(&key, text.as_bytes()).as_ref())
}

fn reason(error: &ClientError) -> Option<String> {
    match error {
        ClientError::Status(status) => reason_of_status(status),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_masked_caller_gets_hashes_cuts_and_nulls_and_a_clear_grant_the_values() {
    let (sim, plain) = loaded(71, 120).await;
    plain.shutdown_and_wait().await;
    let flight = masked_server(&sim, customer_masks(), true).await;
    let clear = as_principal(&flight, CLEAR).await;
    let masked = as_principal(&flight, MASKED).await;
    let (clear_rows, _) = changes(&clear).await;
    let (masked_rows, _) = changes(&masked).await;
    let emails = texts(&clear_rows, "email");
    let hashes = texts(&masked_rows, "email");
    assert_eq!(emails.len(), hashes.len());
    assert!(
        emails.iter().flatten().count() > 10,
        "a workload with emails"
    );
    // The masked form is the keyed HMAC of the clear one, row by row; NULL stays NULL.
    for (email, hash) in emails.iter().zip(&hashes) {
        assert_eq!(hash.clone(), email.as_deref().map(hmac_hex));
    }
    for (name, cut) in texts(&clear_rows, "name")
        .iter()
        .zip(texts(&masked_rows, "name"))
    {
        let name = name.as_deref().expect("names are NOT NULL");
        assert_eq!(
            cut.as_deref(),
            Some(
                &name[..name
                    .char_indices()
                    .nth(3)
                    .map_or(name.len(), |(end, _)| end)]
            )
        );
    }
    let balance = |batches: &[RecordBatch]| -> usize {
        batches
            .iter()
            .map(|batch| {
                batch
                    .column_by_name("balance")
                    .expect("balance")
                    .null_count()
            })
            .sum()
    };
    assert_eq!(balance(&masked_rows), hashes.len());
    assert_eq!(balance(&clear_rows), 0);
    // The schema says what was masked and how, and the key column is served as it is.
    let schema = masked_rows[0].schema();
    let mask = |name: &str| {
        Mask::of_field(schema.field_with_name(name).expect("field"))
            .map(|mask| mask.expect("parses"))
    };
    assert_eq!(mask("email"), Some(Mask::Hash));
    assert_eq!(mask("name"), Some(Mask::Truncate(3)));
    assert_eq!(mask("balance"), Some(Mask::Null));
    assert_eq!(mask("customer_id"), None);
    assert!(
        clear_rows[0]
            .schema()
            .fields()
            .iter()
            .all(|field| !field.metadata().contains_key(MASK_METADATA_KEY))
    );
    // A snapshot is masked alike.
    let snapshot_hashes: BTreeSet<String> = texts(&snapshot(&masked).await, "email")
        .into_iter()
        .flatten()
        .collect();
    let snapshot_emails: BTreeSet<String> = texts(&snapshot(&clear).await, "email")
        .into_iter()
        .flatten()
        .collect();
    assert!(!snapshot_emails.is_empty());
    assert_eq!(
        snapshot_hashes,
        snapshot_emails
            .iter()
            .map(|email| hmac_hex(email))
            .collect()
    );
    // A table without masks is served whole to both.
    let orders = ChangesCommand::new("dbo.orders", earliest(&masked, "dbo.orders").await, None);
    let plan = masked.plan_changes(&orders).await.expect("orders");
    assert!(
        plan.info
            .clone()
            .try_decode_schema()
            .expect("schema")
            .fields()
            .iter()
            .all(|field| !field.metadata().contains_key(MASK_METADATA_KEY))
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clear_value_is_not_in_the_bytes_a_stock_client_receives() {
    let (sim, plain) = loaded(72, 80).await;
    plain.shutdown_and_wait().await;
    // Without authentication every caller is served masked.
    let flight = masked_server(&sim, customer_masks(), false).await;
    let snapshot_emails = {
        let clear = FlightFixture::start(Arc::new(sim.db.clone())).await;
        let emails: Vec<String> = texts(&snapshot(&clear.client).await, "email")
            .into_iter()
            .flatten()
            .collect();
        clear.shutdown_and_wait().await;
        emails
    };
    assert!(snapshot_emails.len() > 5);
    let plan = flight
        .client
        .plan_snapshot(&SnapshotCommand::new("dbo.customers"))
        .await
        .expect("plan");
    let mut raw = raw_client(&flight).await;
    let mut wire = Vec::new();
    let mut decoded = Vec::new();
    for endpoint in &plan.info.endpoint {
        let ticket = endpoint.ticket.clone().expect("ticket");
        let messages: Vec<arrow_flight::FlightData> = raw
            .do_get(ticket)
            .await
            .expect("do_get")
            .into_inner()
            .try_collect()
            .await
            .expect("messages");
        for message in &messages {
            wire.extend_from_slice(&message.data_header);
            wire.extend_from_slice(&message.data_body);
            wire.extend_from_slice(&message.app_metadata);
        }
        // arrow-rs' stock decoder reads the masked stream.
        let stream = futures::stream::iter(messages.into_iter().map(Ok::<_, FlightError>));
        decoded.extend(
            FlightRecordBatchStream::new_from_flight_data(stream)
                .try_collect::<Vec<_>>()
                .await
                .expect("decoded"),
        );
    }
    for email in &snapshot_emails {
        assert!(
            !wire
                .windows(email.len())
                .any(|window| window == email.as_bytes()),
            "{email} crossed the wire"
        );
    }
    let hashes: BTreeSet<String> = texts(&decoded, "email").into_iter().flatten().collect();
    assert_eq!(
        hashes,
        snapshot_emails
            .iter()
            .map(|email| hmac_hex(email))
            .collect()
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_masked_caller_cannot_reach_the_clear_form_by_any_call() {
    let (sim, plain) = loaded(73, 80).await;
    plain.shutdown_and_wait().await;
    let flight = masked_server(&sim, customer_masks(), true).await;
    let clear = as_principal(&flight, CLEAR).await;
    let masked = as_principal(&flight, MASKED).await;
    let masked_reason = |error: ClientError| {
        assert_eq!(reason(&error).as_deref(), Some("COLUMN_MASKED"), "{error}");
        assert_eq!(code(error), Code::PermissionDenied);
    };
    let other_masks = |error: ClientError| {
        assert_eq!(
            reason(&error).as_deref(),
            Some("TICKET_MASKS_CHANGED"),
            "{error}"
        );
        assert!(error.is_stale_ticket(), "a client plans again");
        assert_eq!(code(error), Code::FailedPrecondition);
    };
    // A ticket planned for the clear principal is not redeemed by the masked one.
    let (_, tickets) = changes(&clear).await;
    other_masks(
        masked
            .collect_endpoint(&tickets[0])
            .await
            .expect_err("clear ticket"),
    );
    // Nor the other way: a clear caller replanning gets its own form.
    let (_, masked_tickets) = changes(&masked).await;
    other_masks(
        clear
            .collect_endpoint(&masked_tickets[0])
            .await
            .expect_err("masked ticket"),
    );
    // A clear caller's snapshot cut on the masked e-mail, the e-mail itself left out of its
    // columns: its tickets' bounds hold clear addresses, so a masked caller redeems none.
    let mut cut_on_email = SnapshotCommand::new("dbo.customers");
    cut_on_email.keys = Some(vec!["email".into()]);
    cut_on_email.chunks = Some(vec![ChunkSpec {
        chunk: 0,
        lo: None,
        hi: None,
    }]);
    cut_on_email.serve.except_columns = Some(vec!["email".into()]);
    let plan = clear.plan_snapshot(&cut_on_email).await.expect("clear cut");
    let ticket = plan.info.endpoint[0].ticket.clone().expect("ticket");
    other_masks(
        masked
            .collect_endpoint(&ticket)
            .await
            .expect_err("cut on email"),
    );
    clear
        .collect_endpoint(&ticket)
        .await
        .expect("its own ticket");
    // Digests, seeks and cuts on a masked column would test guesses at its clear values.
    for (name, body) in [
        (
            "key_sums",
            serde_json::json!({"table": "dbo.customers", "values": ["name", "email"]}),
        ),
        (
            "key_max",
            serde_json::json!({"table": "dbo.customers", "keys": ["email"]}),
        ),
        (
            "key_bound",
            serde_json::json!({"table": "dbo.customers", "keys": ["email"], "n": 10}),
        ),
    ] {
        masked_reason(
            masked
                .action::<serde_json::Value>(name, &body)
                .await
                .expect_err(name),
        );
        clear
            .action::<serde_json::Value>(name, &body)
            .await
            .unwrap_or_else(|error| panic!("{name} in clear: {error}"));
    }
    let mut keyset = SnapshotCommand::new("dbo.customers");
    keyset.keys = Some(vec!["email".into()]);
    keyset.chunks = Some(vec![ChunkSpec {
        chunk: 0,
        lo: None,
        hi: None,
    }]);
    masked_reason(
        masked
            .plan_snapshot(&keyset)
            .await
            .expect_err("cut on email"),
    );
    clear
        .plan_snapshot(&keyset)
        .await
        .expect("a clear caller cuts on email");
    // Calls on the unmasked key still answer the masked caller.
    masked
        .action::<serde_json::Value>(
            "key_sums",
            &serde_json::json!({"table": "dbo.customers", "values": ["segment"]}),
        )
        .await
        .expect("sums of unmasked values");
    masked
        .action::<serde_json::Value>("key_extent", &serde_json::json!({"table": "dbo.customers"}))
        .await
        .expect("extent of an unmasked key");
    flight.shutdown_and_wait().await;
    // A masks file that masks a key column, or names a column no instance captures, fails
    // closed: every plan of the table is refused with the reason, and key calls are refused.
    for (masks_json, said) in [
        (
            serde_json::json!({"dbo.customers": {"customer_id": "hash"}}),
            "unique index",
        ),
        (
            serde_json::json!({"dbo.customers": {"emial": "hash"}}),
            "no capture instance",
        ),
    ] {
        let flight = masked_server(&sim, masks(masks_json), true).await;
        for token in [MASKED, CLEAR] {
            let client = as_principal(&flight, token).await;
            let command = ChangesCommand::new(
                "dbo.customers",
                earliest(&client, "dbo.customers").await,
                None,
            );
            let error = client.plan_changes(&command).await.expect_err("changes");
            assert!(error.to_string().contains(said), "{error}");
            let error = client
                .plan_snapshot(&SnapshotCommand::new("dbo.customers"))
                .await
                .expect_err("snapshot");
            assert!(error.to_string().contains(said), "{error}");
            // Key calls too: a misspelt masked name leaves the column to none of them.
            for (name, body) in [
                (
                    "key_max",
                    serde_json::json!({"table": "dbo.customers", "keys": ["email"]}),
                ),
                ("key_extent", serde_json::json!({"table": "dbo.customers"})),
                (
                    "key_sums",
                    serde_json::json!({"table": "dbo.customers", "values": ["email"]}),
                ),
            ] {
                let error = client
                    .action::<serde_json::Value>(name, &body)
                    .await
                    .expect_err(name);
                assert!(error.to_string().contains(said), "{name}: {error}");
            }
        }
        flight.shutdown_and_wait().await;
    }
}
