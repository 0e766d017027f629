//! Golden T-SQL: every statement the SQL Server source sends, pinned as exact text for
//! representative inputs in `tests/golden/sqlserver_statements.sql`, and each parsed with a
//! T-SQL grammar (`sqlparser`'s `MsSqlDialect`) into exactly the statements it should be.
//! Every construct used parses (window functions, `AT TIME ZONE`, `CONVERT` styles, `EXEC`
//! with named parameters, `TOP (@P2)`); a future statement the grammar cannot parse must be
//! listed here with the reason.
//!
//! After a deliberate change of a statement, rewrite the golden file with
//! `UPDATE_GOLDEN=1 cargo test --test sqlserver_statements` and review its diff.

use mssql_cdc_flight::keys::{GridUnit, KeyColumn, KeyValue, KeysetRange};
use mssql_cdc_flight::mssql::clock::{self, ServerClock};
use mssql_cdc_flight::mssql::sql::{self, Isolation};
use mssql_cdc_flight::source::{KeyRange, TableName};
use mssql_cdc_flight::types::{OutputColumn, SqlType};
use sqlparser::dialect::MsSqlDialect;
use sqlparser::parser::Parser;

const GOLDEN: &str = "tests/golden/sqlserver_statements.sql";

/// How many statements a text parses into.
fn statements(text: &str) -> Result<usize, String> {
    Parser::parse_sql(&MsSqlDialect {}, text)
        .map(|parsed| parsed.len())
        .map_err(|error| error.to_string())
}

fn column(name: &str, sql_type: &str, present: bool) -> (OutputColumn, bool) {
    (
        OutputColumn {
            name: name.into(),
            sql_type: sql_type.parse::<SqlType>().expect("type"),
        },
        present,
    )
}

/// Every statement, by name, for representative inputs, with its statement count.
fn every_statement() -> Vec<(&'static str, String, usize)> {
    let orders = TableName::new("dbo", "orders");
    let columns = vec![
        column("order_id", "int", true),
        column("price", "money", true),
        column("fee", "smallmoney", true),
        column("note", "nvarchar(max)", false),
        column("version", "rowversion", false),
    ];
    // One column of each type the server serves, and one the table no longer has.
    let digested: Vec<(OutputColumn, bool)> = [
        "bit",
        "tinyint",
        "int",
        "bigint",
        "real",
        "float",
        "decimal(18,4)",
        "money",
        "smallmoney",
        "date",
        "datetime",
        "smalldatetime",
        "datetime2(7)",
        "datetimeoffset(3)",
        "time(0)",
        "time(3)",
        "char(4)",
        "varchar(max)",
        "nvarchar(40)",
        "text",
        "ntext",
        "xml",
        "uniqueidentifier",
        "binary(4)",
        "varbinary(max)",
        "image",
        "rowversion",
    ]
    .iter()
    .enumerate()
    .map(|(index, sql_type)| column(&format!("c{index}"), sql_type, true))
    .chain([column("dropped", "int", false)])
    .collect();
    let zone = ServerClock::Zone("E. South America Standard Time".into());
    let offset = ServerClock::Offset(-180);
    let both = sql::source_read_prefix(Some(5000), Isolation::Snapshot);
    let ok = |result: mssql_cdc_flight::Result<String>| result.expect("statement");
    let accounts = TableName::new("dbo", "accounts");
    let key = |name: &str, sql_type: &str| KeyColumn {
        name: name.into(),
        sql_type: sql_type.parse().expect("type"),
    };
    let composite = vec![key("region", "varchar(20)"), key("id", "int")];
    let typed = vec![
        key("opened", "datetime2(7)"),
        key("token", "uniqueidentifier"),
        key("hash", "varbinary(16)"),
        key("ratio", "float"),
    ];
    let lo = vec![KeyValue::Text("North".into()), KeyValue::Int(17)];
    let hi = vec![KeyValue::Text("south".into()), KeyValue::Int(4)];
    let with_null = vec![KeyValue::Null, KeyValue::Int(3)];
    let typed_lo = vec![
        KeyValue::Text("2026-01-01T00:00:00.1234567".into()),
        KeyValue::Text("6F9619FF-8B86-D011-B42D-00C04FC964FF".into()),
        KeyValue::Text("0x00FF".into()),
        KeyValue::Null,
    ];
    vec![
        ("max_lsn", sql::max_lsn().into(), 1),
        (
            "reset_session_options",
            sql::reset_session_options().into(),
            2,
        ),
        ("min_lsn", sql::min_lsn().into(), 1),
        ("increment_lsn", sql::increment_lsn().into(), 1),
        ("decrement_lsn", sql::decrement_lsn().into(), 1),
        (
            "lsn_to_time utc",
            ok(sql::lsn_to_time(&ServerClock::Utc)),
            1,
        ),
        ("lsn_to_time offset", ok(sql::lsn_to_time(&offset)), 1),
        ("lsn_to_time zone", ok(sql::lsn_to_time(&zone)), 1),
        (
            "commit_time_at_or_before utc",
            ok(sql::commit_time_at_or_before(&ServerClock::Utc)),
            1,
        ),
        (
            "commit_at_or_before zone",
            ok(sql::commit_at_or_before(&zone)),
            1,
        ),
        ("nth_commit_after", sql::nth_commit_after().into(), 1),
        (
            "help_change_data_capture",
            sql::help_change_data_capture().into(),
            1,
        ),
        ("captured_columns", sql::captured_columns().into(), 1),
        ("ddl_history", sql::ddl_history().into(), 1),
        ("table_columns", sql::table_columns().into(), 1),
        ("space_used", sql::space_used().into(), 1),
        ("split_points", ok(sql::split_points("dbo_orders")), 1),
        (
            "instances_with_changes",
            ok(sql::instances_with_changes(&[
                "dbo_orders".to_string(),
                "dbo_customers_v2".to_string(),
            ])),
            1,
        ),
        (
            "change_rows utc with command id",
            ok(sql::change_rows(
                "dbo_orders",
                &columns,
                true,
                &ServerClock::Utc,
            )),
            1,
        ),
        (
            "change_rows zone without command id",
            ok(sql::change_rows("dbo_orders", &columns[..1], false, &zone)),
            4,
        ),
        (
            "key_extent",
            ok(sql::key_extent(&orders, "order_id", "")),
            1,
        ),
        (
            "key_extent snapshot isolation and lock timeout",
            ok(sql::key_extent(&orders, "order_id", &both)),
            3,
        ),
        (
            "key_buckets",
            ok(sql::key_buckets(&orders, "order_id", "")),
            1,
        ),
        (
            "key_span",
            ok(sql::key_span(&orders, "order_id", GridUnit::Integer, "")),
            1,
        ),
        (
            "key_span date snapshot isolation and lock timeout",
            ok(sql::key_span(&orders, "shipped_on", GridUnit::Days, &both)),
            3,
        ),
        (
            "key_sums",
            ok(sql::key_sums(
                &orders,
                "order_id",
                GridUnit::Integer,
                &[],
                "",
            )),
            1,
        ),
        (
            "key_sums date with lock timeout",
            ok(sql::key_sums(
                &orders,
                "shipped_on",
                GridUnit::Days,
                &[],
                &sql::source_read_prefix(Some(5000), Isolation::ReadCommitted),
            )),
            2,
        ),
        (
            "key_sums with value digests of every served type",
            ok(sql::key_sums(
                &orders,
                "order_id",
                GridUnit::Integer,
                &digested,
                "",
            )),
            1,
        ),
        (
            "snapshot_rows bounded",
            ok(sql::snapshot_rows(
                &orders,
                Some("order_id"),
                &columns,
                KeyRange {
                    lo: Some(1),
                    hi: Some(9),
                },
                "",
            )),
            1,
        ),
        (
            "snapshot_rows first chunk (NULL keys first)",
            ok(sql::snapshot_rows(
                &orders,
                Some("order_id"),
                &columns[..1],
                KeyRange {
                    lo: None,
                    hi: Some(9),
                },
                "",
            )),
            1,
        ),
        (
            "snapshot_rows last chunk with lock timeout",
            ok(sql::snapshot_rows(
                &orders,
                Some("order_id"),
                &columns[..1],
                KeyRange {
                    lo: Some(9),
                    hi: None,
                },
                &sql::source_read_prefix(Some(250), Isolation::ReadCommitted),
            )),
            2,
        ),
        (
            "snapshot_rows whole table",
            ok(sql::snapshot_rows(
                &orders,
                None,
                &columns[..2],
                KeyRange { lo: None, hi: None },
                "",
            )),
            1,
        ),
        (
            "key_max composite",
            ok(sql::key_max(&accounts, &composite, "")),
            1,
        ),
        (
            "key_max typed columns with snapshot isolation",
            ok(sql::key_max(&accounts, &typed, &both)),
            3,
        ),
        (
            "key_bound from a bound through MAX",
            ok(sql::key_bound(
                &accounts,
                &composite,
                Some((&lo, true)),
                Some((&hi, true)),
                100_000,
                "",
            )
            .map(|(text, values)| {
                assert_eq!(values.len(), 4, "two values per bound");
                text
            })),
            1,
        ),
        (
            "key_bound first key after MAX with a NULL in it",
            ok(sql::key_bound(
                &accounts,
                &composite,
                Some((&with_null, false)),
                None,
                0,
                "",
            )
            .map(|(text, values)| {
                assert_eq!(values.len(), 1, "a NULL is never bound");
                text
            })),
            1,
        ),
        (
            "key_bound typed values",
            ok(
                sql::key_bound(&accounts, &typed, Some((&typed_lo, true)), None, 7, "")
                    .map(|(text, _)| text),
            ),
            1,
        ),
        (
            "snapshot_keyset_rows chunk",
            ok(sql::snapshot_keyset_rows(
                &accounts,
                &composite,
                &columns[..2],
                &KeysetRange {
                    lo: Some(lo.clone()),
                    hi: Some(hi.clone()),
                },
                "",
            )
            .map(|(text, _)| text)),
            1,
        ),
        (
            "snapshot_keyset_rows first chunk (NULL keys first)",
            ok(sql::snapshot_keyset_rows(
                &accounts,
                &composite,
                &columns[..1],
                &KeysetRange {
                    lo: None,
                    hi: Some(hi.clone()),
                },
                "",
            )
            .map(|(text, _)| text)),
            1,
        ),
        (
            "named_zone_capability",
            clock::named_zone_capability_sql().into(),
            1,
        ),
        ("zone", clock::zone_sql().into(), 1),
        ("offset", clock::offset_sql().into(), 1),
        ("ping", sql::ping().into(), 1),
    ]
}

fn render(all: &[(&'static str, String, usize)]) -> String {
    let mut out = String::from(
        "-- Every statement the SQL Server source sends, for representative inputs.\n\
         -- Generated by tests/sqlserver_statements.rs; do not edit by hand.\n",
    );
    for (name, text, _) in all {
        out.push_str(&format!("\n-- {name}\n{text};\n"));
    }
    out
}

#[test]
fn statements_match_the_golden_file() {
    let rendered = render(&every_statement());
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all("tests/golden").expect("dir");
        std::fs::write(GOLDEN, &rendered).expect("write golden");
    }
    let golden = std::fs::read_to_string(GOLDEN).expect("golden file");
    for (expected, actual) in golden.lines().zip(rendered.lines()) {
        assert_eq!(
            actual, expected,
            "a statement changed (UPDATE_GOLDEN=1 to accept)"
        );
    }
    assert_eq!(golden.lines().count(), rendered.lines().count());
}

#[test]
fn every_statement_parses_as_tsql() {
    for (name, text, count) in every_statement() {
        assert_eq!(statements(&text), Ok(count), "{name}: {text}");
    }
}

#[test]
fn hostile_names_stay_one_identifier() {
    let table = TableName::new("sales]; DROP TABLE x; --", "o'rders;");
    for name in [
        "x] FROM t; DROP TABLE y; --",
        "it's",
        "semi;colon",
        "Größe €",
        "[already]",
    ] {
        let columns = vec![column(name, "int", true), column(name, "money", true)];
        let text = sql::snapshot_rows(
            &table,
            Some(name),
            &columns,
            KeyRange {
                lo: Some(1),
                hi: None,
            },
            "",
        )
        .expect("quoted");
        assert_eq!(statements(&text), Ok(1), "{text}");
        let text = sql::change_rows(name, &columns, true, &ServerClock::Utc).expect("quoted");
        assert_eq!(statements(&text), Ok(1), "{text}");
        let text = sql::key_buckets(&table, name, "").expect("quoted");
        assert_eq!(statements(&text), Ok(1), "{text}");
        let text = sql::key_sums(&table, name, GridUnit::Days, &columns, "").expect("quoted");
        assert_eq!(statements(&text), Ok(1), "{text}");
        let keys = [KeyColumn {
            name: name.into(),
            sql_type: "nvarchar(40)".parse().expect("type"),
        }];
        let bound = vec![KeyValue::Text("v'); DELETE FROM z; --".into())];
        let (text, values) =
            sql::key_bound(&table, &keys, Some((&bound, true)), None, 3, "").expect("quoted");
        assert_eq!(statements(&text), Ok(1), "{text}");
        assert!(
            !text.contains("DELETE FROM z"),
            "values are parameters: {text}"
        );
        assert_eq!(values, bound);
    }
    // Without the quoting, the same name would have been two statements.
    assert_eq!(
        statements("SELECT c.[x] FROM t; DROP TABLE y; --] FROM cdc.t c"),
        Ok(2)
    );
    assert!(sql::split_points("bad\u{0}name").is_err());
    assert!(sql::instances_with_changes(&["dbo_orders".into(), "bad\u{0}name".into()]).is_err());
    assert!(sql::instances_with_changes(&[]).is_err());
}
