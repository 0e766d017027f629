//! The Flight service's planning calls end to end, on a real server on 127.0.0.1:0 over a
//! simulated database: `list_flights`, `get_schema`, `list_actions`, every action with its
//! happy and error paths, the offsets, and plans refused with a reason.

mod common;

use arrow_flight::{Criteria, Empty, FlightDescriptor};
use common::faulty::{FaultySource, ReadFault};
use common::{code, earliest, initial_offset, loaded, raw_client, read_range, row_count};
use futures::TryStreamExt;
use mssql_cdc_flight::protocol::{
    CaptureInstanceInfo, ChangesCommand, Command, CountAnswer, LatestOffsetBody, LsnAnswer,
    ServeOptions, TableCommand, TimeAnswer,
};
use mssql_cdc_flight::source::{CapturedColumn, CdcSource, Tile};
use mssql_cdc_flight::{Lsn, Offset};
use serde_json::json;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_flights_get_schema_and_list_actions() {
    let (_sim, flight) = loaded(11, 20).await;
    let infos = flight.client.list_tables().await.expect("list");
    assert_eq!(infos.len(), 2);
    let metadata: serde_json::Value = serde_json::from_slice(&infos[1].app_metadata).expect("json");
    assert_eq!(metadata["table"], "dbo.orders");
    assert_eq!(metadata["capture_instances"][0]["name"], "dbo_orders");
    assert_eq!(
        metadata["capture_instances"][0]["index_columns"],
        json!(["order_id"])
    );

    let mut raw = raw_client(&flight).await;
    let table = Command::Table(TableCommand {
        table: "dbo.customers".into(),
    });
    let schema = raw
        .get_schema(FlightDescriptor::new_cmd(table.to_bytes()))
        .await
        .expect("schema")
        .into_inner();
    let schema = arrow::datatypes::Schema::try_from(&schema).expect("ipc schema");
    assert_eq!(schema.fields().len(), 6 + 9);
    assert_eq!(schema.field(6).name(), "customer_id");

    let mut changes = ChangesCommand::new("dbo.orders", Lsn::ZERO, None);
    changes.serve.columns = Some(vec!["status".into(), "order_id".into()]);
    changes.serve.include_command_id = Some(false);
    let schema = raw
        .get_schema(FlightDescriptor::new_cmd(
            Command::Changes(changes).to_bytes(),
        ))
        .await
        .expect("schema")
        .into_inner();
    let schema = arrow::datatypes::Schema::try_from(&schema).expect("ipc schema");
    let names: Vec<&str> = schema
        .fields()
        .iter()
        .map(|field| field.name().as_str())
        .collect();
    assert_eq!(
        names,
        [
            "_capture_instance",
            "_start_lsn",
            "_seqval",
            "_operation",
            "_commit_ts",
            "status",
            "order_id"
        ]
    );

    let missing = Command::Table(TableCommand {
        table: "dbo.nope".into(),
    });
    let error = raw
        .get_schema(FlightDescriptor::new_cmd(missing.to_bytes()))
        .await
        .expect_err("unknown");
    assert_eq!(error.code(), Code::NotFound);
    let error = raw
        .get_schema(FlightDescriptor::new_cmd(b"{".to_vec()))
        .await
        .expect_err("bad json");
    assert_eq!(error.code(), Code::InvalidArgument);

    let actions: Vec<_> = raw
        .list_actions(Empty {})
        .await
        .expect("actions")
        .into_inner()
        .try_collect()
        .await
        .expect("list");
    assert_eq!(
        actions.len(),
        mssql_cdc_flight::flight::ActionKind::ALL.len()
    );
    let flights: Vec<_> = raw
        .list_flights(Criteria::default())
        .await
        .expect("flights")
        .into_inner()
        .try_collect()
        .await
        .expect("list");
    assert_eq!(flights.len(), 2);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_answers_and_refuses_bad_input() {
    let (sim, flight) = loaded(11, 200).await;
    let client = &flight.client;
    let source = sim.db.clone();
    let max: LsnAnswer = client.action("max_lsn", &json!({})).await.expect("max_lsn");
    let max = max.lsn.expect("a max lsn");
    assert_eq!(Some(max), source.max_lsn().await.expect("source max"));
    let min: LsnAnswer = client
        .action("min_lsn", &json!({"capture_instance": "dbo_orders"}))
        .await
        .expect("min");
    let min = min.lsn.expect("min lsn");
    let next: LsnAnswer = client
        .action("increment_lsn", &json!({"lsn": min}))
        .await
        .expect("increment");
    assert_eq!(next.lsn, Some(min.increment()));
    let previous: LsnAnswer = client
        .action("decrement_lsn", &json!({"lsn": min}))
        .await
        .expect("decrement");
    assert_eq!(previous.lsn, Some(min.decrement()));
    let time: TimeAnswer = client
        .action("lsn_to_time", &json!({"lsn": max}))
        .await
        .expect("time");
    assert!(time.commit_ts.is_some());
    let none: TimeAnswer = client
        .action("lsn_to_time", &json!({"lsn": max.increment()}))
        .await
        .expect("time");
    assert_eq!(none.commit_ts, None);
    let third: LsnAnswer = client
        .action("nth_commit_after", &json!({"lsn": min, "n": 3}))
        .await
        .expect("nth");
    assert_eq!(
        third.lsn,
        source.nth_commit_after(min, 3).await.expect("source nth")
    );
    let beyond: LsnAnswer = client
        .action("nth_commit_after", &json!({"lsn": max, "n": 3}))
        .await
        .expect("nth");
    assert_eq!(beyond.lsn, None);
    let capped: LsnAnswer = client
        .action("nth_commit_after", &json!({"lsn": min, "n": 1_000_000}))
        .await
        .expect("nth");
    assert_eq!(capped.lsn, Some(max));
    let instances: Vec<CaptureInstanceInfo> = client
        .action("capture_instances", &json!({"table": "dbo.orders"}))
        .await
        .expect("instances");
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0].columns.len(), 10);
    let ddl: Vec<serde_json::Value> = client
        .action(
            "ddl_history",
            &json!({"capture_instance": "dbo_orders", "from": Lsn::ZERO, "to": max}),
        )
        .await
        .expect("ddl");
    assert!(ddl.is_empty());
    let tiles: Vec<Tile> = client
        .action(
            "split_points",
            &json!({"capture_instance": "dbo_orders", "from": min, "to": max, "n": 4}),
        )
        .await
        .expect("split");
    assert!((2..=4).contains(&tiles.len()), "{} tiles", tiles.len());
    let count: CountAnswer = client
        .action(
            "count_changes",
            &json!({"capture_instance": "dbo_orders", "from": min, "to": max}),
        )
        .await
        .expect("count");
    assert_eq!(count.rows, tiles.iter().map(|tile| tile.rows).sum::<u64>());
    assert_eq!(count.rows as usize, sim.journal_rows("dbo.orders").len());

    for (name, body, expected) in [
        ("no_such_action", json!({}), Code::InvalidArgument),
        ("max_lsn", json!({"extra": 1}), Code::InvalidArgument),
        (
            "min_lsn",
            json!({"capture_instance": "dbo_nope"}),
            Code::NotFound,
        ),
        (
            "min_lsn",
            json!({"capture_instance": "DBO_ORDERS"}),
            Code::NotFound,
        ),
        (
            "increment_lsn",
            json!({"lsn": "0xZZ"}),
            Code::InvalidArgument,
        ),
        ("lsn_to_time", json!({}), Code::InvalidArgument),
        (
            "nth_commit_after",
            json!({"lsn": min, "n": 0}),
            Code::InvalidArgument,
        ),
        (
            "capture_instances",
            json!({"table": "dbo.nope"}),
            Code::NotFound,
        ),
        (
            "split_points",
            json!({"capture_instance": "dbo_orders", "from": max, "to": min, "n": 2}),
            Code::InvalidArgument,
        ),
        (
            "split_points",
            json!({"capture_instance": "dbo_orders", "from": min, "to": max, "n": 0}),
            Code::InvalidArgument,
        ),
        (
            "initial_offset",
            json!({"table": "dbo.orders", "starting": "yesterday"}),
            Code::InvalidArgument,
        ),
        (
            "latest_offset",
            json!({"max_commits": 0}),
            Code::InvalidArgument,
        ),
    ] {
        let error = client
            .action::<serde_json::Value>(name, &body)
            .await
            .expect_err(name);
        assert_eq!(code(error), expected, "{name} {body}");
    }
    let hint = client
        .action::<serde_json::Value>("min_lsn", &json!({"capture_instance": "DBO_ORDERS"}))
        .await
        .expect_err("case");
    assert!(
        hint.to_string().contains("did you mean dbo_orders"),
        "{hint}"
    );
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_follow_the_seed_rules() {
    let (_sim, flight) = loaded(11, 100).await;
    let client = &flight.client;
    let start = earliest(&flight, "dbo.orders").await;
    let min: LsnAnswer = client
        .action("min_lsn", &json!({"capture_instance": "dbo_orders"}))
        .await
        .expect("min");
    assert_eq!(
        start.lsn,
        min.lsn.expect("min").decrement(),
        "earliest is just before min_lsn"
    );
    let latest: Offset = client
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
    let max: LsnAnswer = client.action("max_lsn", &json!({})).await.expect("max");
    assert_eq!(Some(latest.lsn), max.lsn);
    assert!(latest.commit_ts.is_some());
    let capped: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(start),
                max_commits: Some(5),
                upper: None,
            },
        )
        .await
        .expect("capped");
    let fifth: LsnAnswer = client
        .action("nth_commit_after", &json!({"lsn": start.lsn, "n": 5}))
        .await
        .expect("nth");
    assert_eq!(Some(capped.lsn), fifth.lsn);
    let same: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(latest),
                max_commits: Some(5),
                upper: None,
            },
        )
        .await
        .expect("nothing new");
    assert_eq!(same, latest, "nothing newer: the start comes back");
    let upper: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(start),
                max_commits: None,
                upper: Some(capped.lsn),
            },
        )
        .await
        .expect("upper");
    assert_eq!(upper.lsn, capped.lsn);
    let newest = initial_offset(client, "dbo.orders", Some("latest")).await;
    assert_eq!(newest.lsn, latest.lsn);
    let explicit = initial_offset(client, "dbo.orders", Some("2a")).await;
    assert_eq!(explicit.lsn.to_string(), "0x0000000000000000002A");
    // Batches capped at 5 commits walk the history without gaps or overlaps.
    let mut position = start;
    let mut total = 0;
    for _ in 0..200 {
        let end: Offset = client
            .action(
                "latest_offset",
                &LatestOffsetBody {
                    start: Some(position),
                    max_commits: Some(5),
                    upper: None,
                },
            )
            .await
            .expect("step");
        if end == position {
            break;
        }
        let (_, batches) = read_range(client, "dbo.orders", position.lsn, Some(end.lsn), 1).await;
        total += row_count(&batches);
        position = end;
    }
    assert_eq!(position.lsn, latest.lsn);
    let count: CountAnswer = client
        .action("count_changes", &json!({"capture_instance": "dbo_orders", "from": start.lsn.increment(), "to": latest.lsn}))
        .await
        .expect("count");
    assert_eq!(total as u64, count.rows);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_plans_are_refused_with_a_reason() {
    let (_sim, flight) = loaded(11, 50).await;
    let client = &flight.client;
    let max: LsnAnswer = client.action("max_lsn", &json!({})).await.expect("max");
    let max = max.lsn.expect("max");
    let cases: Vec<(ChangesCommand, Code, &str)> = vec![
        (
            ChangesCommand::new("dbo.orders", max, Some(max.decrement())),
            Code::InvalidArgument,
            "is past to",
        ),
        (
            ChangesCommand::new("dbo.orders", Lsn::ZERO, Some(max.increment())),
            Code::InvalidArgument,
            "past max_lsn",
        ),
        (
            ChangesCommand::new("dbo.nope", Lsn::ZERO, None),
            Code::NotFound,
            "dbo.nope",
        ),
        (
            ChangesCommand::new("a.b.c", Lsn::ZERO, None),
            Code::InvalidArgument,
            "schema.table",
        ),
        (
            ChangesCommand {
                serve: ServeOptions {
                    columns: Some(vec!["nope".into()]),
                    ..ServeOptions::default()
                },
                ..ChangesCommand::new("dbo.orders", max, None)
            },
            Code::InvalidArgument,
            "not captured",
        ),
        (
            ChangesCommand {
                partitions: Some(0),
                ..ChangesCommand::new("dbo.orders", max, None)
            },
            Code::InvalidArgument,
            "partitions",
        ),
        (
            ChangesCommand {
                capture_instance: Some("dbo_nope".into()),
                ..ChangesCommand::new("dbo.orders", max, None)
            },
            Code::NotFound,
            "dbo_nope",
        ),
    ];
    for (command, expected, text) in cases {
        let error = client.plan_changes(&command).await.expect_err("refused");
        assert!(error.to_string().contains(text), "{error}");
        assert_eq!(code(error), expected);
    }
    let mut raw = raw_client(&flight).await;
    let misspelt =
        br#"{"type":"changes","table":"dbo.orders","from":"0x00","partitons":2}"#.to_vec();
    let error = raw
        .get_flight_info(FlightDescriptor::new_cmd(misspelt))
        .await
        .expect_err("unknown option");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("partitons"), "{}", error.message());
    // An empty range plans no endpoint.
    let empty = client
        .plan_changes(&ChangesCommand::new("dbo.orders", max, Some(max)))
        .await
        .expect("empty");
    assert!(empty.info.endpoint.is_empty());
    assert_eq!(empty.info.total_records, 0);
    flight.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_the_service_cannot_describe_does_not_hide_the_others() {
    // dbo.customers gains a geography column in the catalog, which no Arrow type serves.
    let sim = common::SimFixture::new();
    let source = std::sync::Arc::new(FaultySource::new(sim.db.clone(), ReadFault::None));
    *source.extra_column.lock().expect("column") = Some((
        "dbo.customers".parse().expect("table"),
        CapturedColumn {
            name: "location".into(),
            column_id: 99,
            ordinal: 99,
            sql_type: "geography".parse().expect("type"),
        },
    ));
    let flight = common::FlightFixture::start(source).await;
    let infos = flight.client.list_tables().await.expect("list_flights");
    assert_eq!(infos.len(), 2);
    let metadata: Vec<serde_json::Value> = infos
        .iter()
        .map(|info| serde_json::from_slice(&info.app_metadata).expect("json"))
        .collect();
    let customers = metadata
        .iter()
        .find(|m| m["table"] == "dbo.customers")
        .expect("listed");
    assert_eq!(customers["error"]["reason"], "INVALID_REQUEST");
    assert!(
        customers["error"]["message"]
            .as_str()
            .expect("text")
            .contains("'location' has type geography"),
        "{customers}"
    );
    let orders = metadata
        .iter()
        .find(|m| m["table"] == "dbo.orders")
        .expect("listed");
    assert!(orders.get("error").is_none(), "{orders}");
    assert!(
        orders["capture_instances"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    );
    // Planning the table names the column to leave out.
    let start = earliest(&flight, "dbo.customers").await;
    let error = flight
        .client
        .plan_changes(&ChangesCommand::new("dbo.customers", start.lsn, None))
        .await
        .expect_err("unsupported column");
    assert_eq!(code(error), Code::InvalidArgument);
    flight.shutdown_and_wait().await;
}
