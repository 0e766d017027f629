//! Tests of the SQL surface: what maps onto which plan, and what is refused.

use super::*;

fn snapshot(sql: &str) -> (SnapshotCommand, Option<KeyRange>) {
    match parse(sql) {
        Ok(Statement::Snapshot { command, range }) => (command, range),
        other => panic!("{sql}: {other:?}"),
    }
}

#[test]
fn a_table_is_a_snapshot_read_of_its_columns() {
    let (command, range) = snapshot("SELECT * FROM dbo.orders");
    assert_eq!(
        (command.table.as_str(), command.serve.columns),
        ("dbo.orders", None)
    );
    assert_eq!(range, None);
    let (command, range) = snapshot(
        "select [order_id], amount, _start_lsn from [dbo].[orders] \
         where order_id between -5 and 20",
    );
    assert_eq!(
        command.serve.columns,
        Some(vec!["order_id".to_string(), "amount".to_string()])
    );
    let range = range.expect("a key range");
    assert_eq!(
        (range.column.as_str(), range.lo, range.hi),
        ("order_id", -5, 20)
    );
    assert_eq!(range.chunk().hi, Some(Bound::Int(21)));
    // A part that holds a dot or a bracket keeps its brackets, as the protocol names it.
    let (command, _) = snapshot(r#"SELECT * FROM [sales.eu]."order]s""#);
    assert_eq!(command.table, "[sales.eu].[order]]s]");
    let table: crate::source::TableName = command.table.parse().expect("a table name");
    assert_eq!(
        (table.schema.as_str(), table.name.as_str()),
        ("sales.eu", "order]s")
    );
    let (_, range) = snapshot("SELECT * FROM dbo.orders WHERE order_id >= 3 AND order_id <= 3");
    assert_eq!(range.map(|range| (range.lo, range.hi)), Some((3, 3)));
    // The largest key bounds nothing above it.
    let (_, range) = snapshot(&format!(
        "SELECT * FROM dbo.orders WHERE order_id BETWEEN 0 AND {}",
        i64::MAX
    ));
    assert_eq!(range.expect("a range").chunk().hi, None);
}

#[test]
fn a_change_range_takes_names_lsns_offsets_and_a_commit_cap() {
    let parsed =
        parse("SELECT * FROM cdc.changes('dbo.orders', 'earliest', '0x0000002A000000010003', 10)");
    let Ok(Statement::Changes(query)) = parsed else {
        panic!("{parsed:?}")
    };
    assert_eq!(query.table, "dbo.orders");
    assert_eq!(query.from, Point::Earliest);
    assert_eq!(
        query.to,
        Point::Lsn("0x0000002A000000010003".parse().expect("lsn"))
    );
    assert_eq!(query.max_commits, Some(10));
    let parsed = parse(
        r#"SELECT order_id FROM cdc.changes('dbo.orders', '{"lsn": "0x0000002A000000010003", "commit_ts": "2026-01-01T00:00:00.000Z"}')"#,
    );
    let Ok(Statement::Changes(query)) = parsed else {
        panic!("{parsed:?}")
    };
    assert_eq!(query.to, Point::Latest);
    assert_eq!(query.columns, Some(vec!["order_id".to_string()]));
    let command = query.command(Lsn::ZERO, None, 4);
    assert_eq!(command.partitions, Some(4));
}

#[test]
fn planning_functions_map_to_their_actions() {
    let cases = [
        ("SELECT * FROM cdc.max_lsn()", "max_lsn"),
        ("SELECT * FROM cdc.lsn_to_time('0x01')", "lsn_to_time"),
        (
            "SELECT * FROM cdc.time_to_lsn('2026-01-01T00:00:00Z')",
            "time_to_lsn",
        ),
        (
            "SELECT * FROM cdc.initial_offset('dbo.orders')",
            "initial_offset",
        ),
        (
            "SELECT * FROM cdc.latest_offset('0x01', 5)",
            "latest_offset",
        ),
    ];
    for (sql, action) in cases {
        match parse(sql) {
            Ok(Statement::Function(function)) => assert_eq!(function.action().0, action),
            other => panic!("{sql}: {other:?}"),
        }
    }
}

#[test]
fn long_chains_are_refused_on_their_tokens_before_any_tree_is_built() {
    // A tree as deep as the chain is long would overflow the stack when cloned or
    // dropped: each is refused from its flat tokens, quickly.
    let chain = format!("SELECT * FROM dbo.t WHERE {}1", "1+".repeat(30_000));
    let unions = format!(
        "SELECT * FROM dbo.t{}",
        " UNION SELECT * FROM dbo.t".repeat(2_000)
    );
    let nested = format!(
        "SELECT * FROM cdc.max_lsn{}{}",
        "(".repeat(50),
        ")".repeat(50)
    );
    let huge = format!("SELECT {} FROM dbo.t", "a, ".repeat(MAX_SQL_BYTES / 3));
    for (sql, reason) in [
        (chain, "operators"),
        (unions, "set operations"),
        (nested, "nest deeper"),
        (huge, "bytes"),
    ] {
        let error = parse(&sql).expect_err("refused");
        let text = error.to_string();
        assert!(text.contains(reason), "{text}");
        assert!(
            text.len() < 2_000,
            "the refusal repeats the client's text: {}",
            text.len()
        );
    }
    // A wide table's column list is a list, not a chain.
    let columns: Vec<String> = (0..1_000).map(|n| format!("c{n}")).collect();
    let (command, _) = snapshot(&format!("SELECT {} FROM dbo.wide", columns.join(", ")));
    assert_eq!(
        command.serve.columns.map(|columns| columns.len()),
        Some(1_000)
    );
}

#[test]
fn names_and_ends_are_case_insensitive_and_offsets_keep_their_time() {
    let parsed = parse("SELECT * FROM CDC.Changes('dbo.orders', 'EARLIEST', 'Latest')");
    let Ok(Statement::Changes(query)) = parsed else {
        panic!("{parsed:?}")
    };
    assert_eq!((query.from, query.to), (Point::Earliest, Point::Latest));
    let start = r#"{"lsn": "0x0000002A000000010003", "commit_ts": "2026-01-01T00:00:00.000"}"#;
    let parsed = parse(&format!("SELECT * FROM cdc.latest_offset('{start}')"));
    let Ok(Statement::Function(Function::LatestOffset { start, .. })) = parsed else {
        panic!("{parsed:?}")
    };
    assert!(
        start.commit_ts.is_some(),
        "the offset's time is kept: {start:?}"
    );
    let (_, range) = snapshot(&format!(
        "SELECT * FROM dbo.t WHERE k BETWEEN {} AND -1",
        i64::MIN
    ));
    assert_eq!(range.map(|range| range.lo), Some(i64::MIN));
}

#[test]
fn anything_else_is_refused_with_what_is_supported() {
    let refused = [
        (
            "SELECT * FROM dbo.orders o JOIN dbo.customers c ON o.id = c.id",
            "joins",
        ),
        ("SELECT count(*) FROM dbo.orders", "aggregates"),
        ("SELECT * FROM dbo.orders ORDER BY order_id", "ORDER BY"),
        ("SELECT TOP 5 * FROM dbo.orders", "TOP"),
        ("SELECT * FROM dbo.orders GROUP BY order_id", "GROUP BY"),
        ("DELETE FROM dbo.orders", "read-only"),
        ("INSERT INTO dbo.orders VALUES (1)", "read-only"),
        ("SELECT * FROM dbo.orders; SELECT 1", "one statement"),
        ("SELECT * FROM dbo.orders WHERE amount > 5", "BETWEEN"),
        (
            "SELECT * FROM dbo.orders WHERE order_id BETWEEN 5 AND 1",
            "empty",
        ),
        ("SELECT * FROM cdc.nothing()", "unknown function"),
        ("SELECT * FROM cdc.changes('dbo.orders')", "arguments"),
        ("SELECT * FROM cdc.changes('dbo.orders', 'soon')", "LSN"),
        (
            "SELECT * FROM cdc.changes('dbo.orders', 'earliest', 'latest', 0)",
            "positive",
        ),
        ("SELECT * FROM (SELECT * FROM dbo.orders) t", "subqueries"),
        ("SELECT _start_lsn FROM dbo.orders", "at least one"),
        ("SELECT * FROM", "parse"),
        (
            "SELECT * FROM dbo.orders FOR SYSTEM_TIME AS OF '2024-01-01'",
            "SYSTEM_TIME",
        ),
        (
            "SELECT * FROM dbo.orders TABLESAMPLE (10 PERCENT)",
            "TABLESAMPLE",
        ),
        ("SELECT * FROM dbo.orders AS o(a, b)", "column aliases"),
        ("SELECT * FROM dbo.orders WITH (NOLOCK)", "hints"),
        ("SELECT * FROM dbo.orders (NOLOCK)", "not a cdc function"),
        (
            "SELECT * FROM dbo.orders WHERE order_id BETWEEN 1 AND 99999999999999999999",
            "BETWEEN",
        ),
    ];
    for (sql, reason) in refused {
        match parse(sql) {
            Err(error) => {
                let text = error.to_string();
                assert!(text.contains(reason), "{sql}: {text}");
                assert!(
                    matches!(error, Error::InvalidArgument(_)),
                    "{sql}: {error:?}"
                );
            }
            Ok(statement) => panic!("{sql} was taken as {statement:?}"),
        }
    }
}
