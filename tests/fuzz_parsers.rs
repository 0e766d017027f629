//! Structure-aware fuzzing of every parser a client reaches: descriptor commands, action
//! bodies, tickets (forged bytes, and validly signed bodies with arbitrary fields), LSNs,
//! table names, offsets, the authorization header, tables globs, SQL Server connection
//! strings and Flight SQL statements; then the service itself, called in process with generated actions, commands and
//! tickets. Each property asserts no panic (a parser answers `Ok` or an error) and, where a
//! parse succeeds, that its output round-trips.
//!
//! CI runs proptest's default cases; the long run sets `PROPTEST_CASES`, for example
//! `PROPTEST_CASES=1000000 cargo test --release --test fuzz_parsers` (11 parser properties:
//! 11,000,000 inputs), and `MSSQL_CDC_FUZZ_SERVICE_CASES` for the in-process service calls.

mod common;

use std::str::FromStr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{Action, FlightDescriptor, Ticket};
use mssql_cdc_flight::flight::auth::{Authenticator, Principal};
use mssql_cdc_flight::flight::ticket::{
    ChangeRangeTicket, SnapshotPieceTicket, SnapshotTicket, TicketBody, TicketColumn, TicketKind,
    TicketSigner,
};
use mssql_cdc_flight::flight::{ActionKind, CdcFlightService, ServiceOptions};
use mssql_cdc_flight::mssql::SqlServerConfig;
use mssql_cdc_flight::protocol::{
    self, Command, InitialOffsetBody, KeyBoundBody, KeyBucketsBody, KeyMaxBody, LatestOffsetBody,
    LsnBody, NthCommitBody, RangeBody, TableBody, parse_body,
};
use mssql_cdc_flight::source::TableName;
use mssql_cdc_flight::{Lsn, Offset};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Field names the protocol uses, so generated objects reach past "unknown field".
const FIELDS: &[&str] = &[
    "type",
    "table",
    "from",
    "to",
    "capture_instance",
    "partitions",
    "min_partition_rows",
    "columns",
    "include_command_id",
    "batch_rows",
    "batch_bytes",
    "compression",
    "chunks",
    "keys",
    "chunk",
    "lo",
    "hi",
    "lsn",
    "n",
    "start",
    "starting",
    "max_commits",
    "upper",
    "width",
    "from_inclusive",
    "to_inclusive",
    "commit_ts",
];

/// Texts that are almost valid: LSNs, tables, modes, and the awkward cases around them.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("changes".to_string()),
        Just("snapshot".to_string()),
        Just("table".to_string()),
        Just("dbo.orders".to_string()),
        Just("[dbo].[orders]".to_string()),
        Just("earliest".to_string()),
        Just("latest".to_string()),
        Just("lz4".to_string()),
        Just("zstd".to_string()),
        Just("dbo_orders".to_string()),
        Just("0x0000002A000001F00003".to_string()),
        Just("0xFFFFFFFFFFFFFFFFFFFF".to_string()),
        Just("2026-09-28T14:03:12.117".to_string()),
        "0x[0-9A-Fa-f]{0,24}",
        "[a-z_.\\[\\]]{0,12}",
        any::<String>(),
    ]
}

/// Pieces of SQL, so generated statements reach past the parser into the mapping.
fn sql_word() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "SELECT",
            "*",
            "FROM",
            "WHERE",
            "BETWEEN",
            "AND",
            "OR",
            "NOT",
            ">=",
            "<=",
            "(",
            ")",
            ",",
            "-",
            "+",
            "UNION",
            "JOIN",
            "ON",
            "GROUP BY",
            "ORDER BY",
            "TOP 5",
            "WITH",
            "(NOLOCK)",
            "FOR SYSTEM_TIME AS OF",
            "TABLESAMPLE",
            "AS",
            "dbo.orders",
            "[dbo].[orders]",
            "\"dbo\".\"orders\"",
            "order_id",
            "amount",
            "cdc.changes",
            "cdc.max_lsn()",
            "cdc.lsn_to_time",
            "cdc.time_to_lsn",
            "cdc.initial_offset",
            "cdc.latest_offset",
            "'dbo.orders'",
            "'earliest'",
            "'latest'",
            "'0x0000002A000001F00003'",
            "'{\"lsn\": \"0x01\"}'",
            "'2026-09-28T14:03:12.117'",
            "0",
            "1",
            "-9223372036854775808",
            "9223372036854775807",
            "NULL",
            ";",
        ])
        .prop_map(str::to_string),
        text(),
    ]
}

/// JSON values shaped like the protocol's, nested.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        prop_oneof![Just(0i64), Just(1), Just(-1), Just(256), Just(257)].prop_map(|n| json!(n)),
        any::<f64>().prop_map(|n| json!(n)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(FIELDS), inner), 0..8).prop_map(|pairs| {
                Value::Object(
                    pairs
                        .into_iter()
                        .map(|(key, value)| (key.to_string(), value))
                        .collect(),
                )
            }),
        ]
    })
}

/// An object with protocol fields, the shape commands and bodies have.
fn object() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec((prop::sample::select(FIELDS), value()), 0..9).prop_map(
            |pairs| {
                let map: serde_json::Map<String, Value> = pairs
                    .into_iter()
                    .map(|(key, value)| (key.to_string(), value))
                    .collect();
                serde_json::to_vec(&Value::Object(map)).expect("json")
            }
        ),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

fn parse_every_body(bytes: &[u8]) {
    let _ = parse_body::<LsnBody>("lsn", bytes);
    let _ = parse_body::<NthCommitBody>("nth_commit_after", bytes);
    let _ = parse_body::<TableBody>("table", bytes);
    let _ = parse_body::<RangeBody>("range", bytes);
    let _ = parse_body::<InitialOffsetBody>("initial_offset", bytes);
    let _ = parse_body::<LatestOffsetBody>("latest_offset", bytes);
    let _ = parse_body::<KeyBucketsBody>("key_buckets", bytes);
    let _ = parse_body::<KeyMaxBody>("key_max", bytes);
    let _ = parse_body::<KeyBoundBody>("key_bound", bytes);
    let _ = parse_body::<protocol::CaptureInstanceBody>("min_lsn", bytes);
}

fn signer() -> TicketSigner {
    TicketSigner::new(b"the fuzzing run's ticket key, 32+ bytes").expect("key")
}

/// Ticket bodies with arbitrary fields, as only a holder of the key could sign them.
fn ticket_body() -> impl Strategy<Value = TicketBody> {
    let columns = || {
        prop::collection::vec(
            (text(), text(), text()).prop_map(|(name, sql_type, mask)| TicketColumn {
                name,
                sql_type,
                mask,
            }),
            0..4,
        )
    };
    let bytes = prop::collection::vec(any::<u8>(), 0..12);
    let change = (
        text(),
        text(),
        bytes.clone(),
        bytes,
        columns(),
        any::<(bool, u64, u64, u32, u64)>(),
    )
        .prop_map(
            |(table, capture_instance, from_lsn, to_lsn, columns, numbers)| {
                TicketKind::ChangeRange(ChangeRangeTicket {
                    table,
                    capture_instance,
                    from_lsn,
                    to_lsn,
                    columns,
                    include_command_id: numbers.0,
                    batch_rows: numbers.1,
                    batch_bytes: numbers.2,
                    compression: numbers.3,
                    planned_rows: numbers.4,
                })
            },
        );
    let piece = (
        any::<(i32, Option<i64>, Option<i64>)>(),
        prop::option::of(text()),
        prop::option::of(text()),
    )
        .prop_map(
            |((chunk, lo, hi), keyset_lo, keyset_hi)| SnapshotPieceTicket {
                chunk: Some(chunk),
                lo,
                hi,
                keyset_lo,
                keyset_hi,
            },
        );
    let snapshot = (
        text(),
        columns(),
        prop::collection::vec(piece, 0..3),
        columns(),
        any::<(u64, u64, u32)>(),
    )
        .prop_map(|(table, columns, pieces, keys, numbers)| {
            TicketKind::Snapshot(SnapshotTicket {
                table,
                capture_instance: "dbo_orders".into(),
                columns,
                pieces,
                include_command_id: true,
                batch_rows: numbers.0,
                compression: numbers.2,
                keys,
                batch_bytes: numbers.1,
            })
        });
    prop_oneof![change, snapshot].prop_map(|kind| TicketBody {
        kind: Some(kind),
        expires_at: 0,
    })
}

proptest! {
    #[test]
    fn descriptor_commands_parse_or_refuse_and_round_trip(bytes in object()) {
        if let Ok(command) = Command::parse(&bytes) {
            prop_assert_eq!(Command::parse(&command.to_bytes()).expect("round trip"), command);
        }
    }

    #[test]
    fn action_bodies_parse_or_refuse(bytes in object()) {
        parse_every_body(&bytes);
    }

    #[test]
    fn forged_and_edited_tickets_are_refused(
        bytes in prop::collection::vec(any::<u8>(), 0..400),
        body in ticket_body(),
        flip in any::<(usize, u8)>(),
    ) {
        let signer = signer();
        prop_assert!(signer.verify(&bytes).is_err());
        let mut ticket = signer.sign(&body);
        let index = flip.0 % ticket.len();
        ticket[index] ^= flip.1.max(1);
        prop_assert!(signer.verify(&ticket).is_err());
    }

    #[test]
    fn validly_signed_tickets_with_any_fields_are_read_or_refused(body in ticket_body()) {
        let signer = signer();
        let verified = signer.verify(&signer.sign(&body)).expect("our own signature");
        match verified.kind.expect("kind") {
            TicketKind::ChangeRange(ticket) => {
                let _ = mssql_cdc_flight::flight::stream::StreamRead::changes(&ticket);
            }
            TicketKind::Snapshot(ticket) => {
                let _ = mssql_cdc_flight::flight::snapshot::ticket_read(&ticket);
            }
        }
    }

    #[test]
    fn lsns_parse_or_refuse_and_print_back(text in text()) {
        if let Ok(lsn) = Lsn::from_str(&text) {
            prop_assert_eq!(Lsn::from_str(&lsn.to_string()).expect("round trip"), lsn);
        }
    }

    #[test]
    fn table_names_parse_or_refuse_and_print_back(text in text()) {
        if let Ok(table) = TableName::from_str(&text) {
            prop_assert_eq!(TableName::from_str(&table.to_string()).expect("round trip"), table);
        }
    }

    #[test]
    fn offsets_parse_or_refuse(bytes in object()) {
        if let Ok(offset) = serde_json::from_slice::<Offset>(&bytes) {
            let again: Offset = serde_json::from_slice(&serde_json::to_vec(&offset).expect("json"))
                .expect("round trip");
            prop_assert_eq!(again, offset);
        }
    }

    #[test]
    fn sql_statements_parse_or_refuse(words in prop::collection::vec(sql_word(), 0..40)) {
        // Flight SQL's statements: a parse answers a statement or INVALID_ARGUMENT, never
        // panics; an accepted snapshot reads the table it names.
        let sql = words.join(" ");
        match mssql_cdc_flight::flight::sql::parse(&sql) {
            Ok(mssql_cdc_flight::flight::sql::Statement::Snapshot { command, .. }) => {
                prop_assert!(TableName::from_str(&command.table).is_ok(), "{}", command.table);
            }
            Ok(_) => {}
            Err(error) => prop_assert!(
                matches!(error, mssql_cdc_flight::Error::InvalidArgument(_)),
                "{error:?}"
            ),
        }
    }

    #[test]
    fn connection_strings_parse_or_refuse(
        text in prop_oneof![
            any::<String>(),
            "mssql://[a-z:@%]{0,10}@[a-z0-9.\\[\\]:]{0,20}(/[a-z]{0,6})?(\\?[a-z=&]{0,20})?",
            "([A-Za-z ]{1,12}=[^;]{0,12};){0,5}",
        ]
    ) {
        let _ = SqlServerConfig::parse(&text);
    }

    #[test]
    fn authorization_headers_and_globs_never_panic(
        header in prop_oneof![
            any::<String>(),
            "(Bearer|Basic|bearer) [A-Za-z0-9+/=:]{0,40}",
        ],
        // A tokens file refuses a glob without a dot other than `*`.
        glob in prop_oneof![Just("*".to_string()), "[a-z*?]{0,5}\\.[a-z.*?]{0,5}"],
        name in "[a-z.]{0,12}",
    ) {
        let json = format!(
            r#"{{"principals": [{{"name": "p", "tables": [{}], "token_sha256": "{}"}}]}}"#,
            serde_json::to_string(&glob).expect("json"),
            "00".repeat(32),
        );
        let authenticator = Arc::new(Authenticator::from_json(json.as_bytes()).expect("tokens"));
        let interceptor = mssql_cdc_flight::flight::auth::interceptor(Some(authenticator), None);
        let mut request = tonic::Request::new(());
        if let Ok(value) = header.parse() {
            request.metadata_mut().insert("authorization", value);
        }
        let _ = interceptor(request);
        if let Ok(table) = TableName::from_str(&name) {
            let principal = Principal::anonymous();
            prop_assert!(principal.may_read(&table));
        }
    }

    #[test]
    fn tokens_files_parse_or_refuse(bytes in object()) {
        let _ = Authenticator::from_json(&bytes);
    }
}

/// Generated calls to the service itself, in process over a small simulated database:
/// actions with generated bodies, plans of generated commands, tickets signed over generated
/// bodies. Every call answers (an error is fine); none panics.
#[test]
fn the_service_answers_generated_calls_without_panicking() {
    let cases: u32 = std::env::var("MSSQL_CDC_FUZZ_SERVICE_CASES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(300);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let sim = common::SimFixture::new();
    let mut writer = sim.writer(41);
    let spec = mssql_cdc_flight::sim::workload::WorkloadSpec {
        commits: Some(60),
        ..Default::default()
    };
    mssql_cdc_flight::sim::workload::run(
        &mut writer,
        &spec,
        &std::sync::atomic::AtomicBool::new(false),
    )
    .expect("workload");
    let service = CdcFlightService::new(Arc::new(sim.db.clone()), ServiceOptions::new(signer()));
    let principal = Arc::new(Principal::anonymous());
    fn request<T>(message: T, principal: &Arc<Principal>) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.extensions_mut().insert(Arc::clone(principal));
        request
    }
    let config = proptest::test_runner::Config {
        cases,
        ..Default::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let call = (
        prop::sample::select(ActionKind::ALL),
        object(),
        ticket_body(),
    );
    runner
        .run(&call, |(kind, bytes, body)| {
            runtime.block_on(async {
                let _ = service
                    .do_action(request(Action::new(kind.name(), bytes.clone()), &principal))
                    .await;
                let _ = service
                    .get_flight_info(request(
                        FlightDescriptor::new_cmd(bytes.clone()),
                        &principal,
                    ))
                    .await;
                let _ = service
                    .get_schema(request(FlightDescriptor::new_cmd(bytes), &principal))
                    .await;
                let ticket = Ticket::new(signer().sign(&body));
                if let Ok(response) = service.do_get(request(ticket, &principal)).await {
                    use futures::StreamExt;
                    let mut stream = response.into_inner();
                    while stream.next().await.is_some() {}
                }
            });
            Ok(())
        })
        .expect("no generated call panics the service");
}
