"""Flight SQL clients from the package registry against the real server binary: the ADBC
Flight SQL driver (a compiled Go driver), DuckDB over its results, and SQLAlchemy through
`flightsql-dbapi`.

Two principals in a tokens file: `reader` reads every table, `analyst` only dbo.customers.
"""

from concurrent.futures import ThreadPoolExecutor

import adbc_driver_flightsql.dbapi as adbc
import adbc_driver_manager
import duckdb
import pyarrow as pa
import pytest
import sqlalchemy
from conftest import start_server, stop_server, tokens_file, workload_database

import mssql_cdc_flight

READER_TOKEN = "reader-token-0123456789abcdef"
ANALYST_TOKEN = "analyst-token-0123456789abcdef"
METADATA = ["_capture_instance", "_start_lsn", "_seqval", "_operation", "_command_id", "_commit_ts"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("flight_sql") / "db"
    workload_database(
        directory,
        "--commits",
        "300",
        "--seed",
        "11",
        "--clock",
        "virtual",
        "--max-rows-per-statement",
        "4",
    )
    tokens = tokens_file(
        directory.parent / "tokens.json",
        {"reader": (["*"], READER_TOKEN), "analyst": (["dbo.customers"], ANALYST_TOKEN)},
    )
    process, url = start_server(directory, "--tokens-file", str(tokens))
    yield url
    stop_server(process)


def connect(url: str, token: str = READER_TOKEN, partitions: int | None = None):
    options = {"adbc.flight.sql.authorization_header": f"Bearer {token}"}
    if partitions is not None:
        # A request header asks the plan for more endpoints than its default one.
        options["adbc.flight.sql.rpc.call_header.x-mssql-cdc-partitions"] = str(partitions)
    return adbc.connect(url, db_kwargs=options, autocommit=True)


def query(url: str, sql: str, token: str = READER_TOKEN) -> pa.Table:
    with connect(url, token) as connection, connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetch_arrow_table()


def rows(table: pa.Table, *columns: str):
    return sorted(zip(*(table.column(name).to_pylist() for name in columns), strict=True))


def test_bearer_and_basic_credentials_connect_and_nothing_else_does(served):
    assert query(served, "SELECT * FROM cdc.max_lsn()").num_rows == 1
    basic = adbc.connect(
        served, db_kwargs={"username": "reader", "password": READER_TOKEN}, autocommit=True
    )
    with basic, basic.cursor() as cursor:
        cursor.execute("SELECT * FROM cdc.max_lsn()")
        assert cursor.fetch_arrow_table().column("lsn")[0].as_py().startswith("0x")
    with pytest.raises(adbc_driver_manager.Error, match="UNAUTHENTICATED|Unauthenticated"):
        query(served, "SELECT * FROM cdc.max_lsn()", token="not-a-token-of-this-server-01")


def test_browsing_lists_the_granted_tables_with_schemas_keys_and_functions(served):
    with connect(served) as connection:
        info = connection.adbc_get_info()
        assert info["vendor_name"] == "mssql-cdc-flight"
        objects = connection.adbc_get_objects().read_all().to_pylist()
        schemas = {
            schema["db_schema_name"]: schema["db_schema_tables"]
            for catalog in objects
            for schema in catalog["catalog_db_schemas"]
        }
        tables = {table["table_name"]: table for table in schemas["dbo"]}
        assert sorted(tables) == ["customers", "orders"]
        columns = [column["column_name"] for column in tables["orders"]["table_columns"]]
        assert columns[:6] == METADATA and "amount" in columns
        functions = {table["table_name"] for table in schemas["cdc"]}
        assert functions == {
            "changes",
            "max_lsn",
            "lsn_to_time",
            "time_to_lsn",
            "initial_offset",
            "latest_offset",
        }
        assert sorted(connection.adbc_get_table_types()) == ["FUNCTION", "TABLE"]
        schema = connection.adbc_get_table_schema("orders", db_schema_filter="dbo")
        assert schema.field("amount").type == pa.decimal128(19, 4)
    # The analyst sees only the table granted to it.
    with connect(served, ANALYST_TOKEN) as connection:
        objects = connection.adbc_get_objects(depth="tables").read_all().to_pylist()
        listed = [
            (schema["db_schema_name"], table["table_name"])
            for catalog in objects
            for schema in catalog["catalog_db_schemas"]
            for table in schema["db_schema_tables"] or []
            if table["table_type"] == "TABLE"
        ]
        assert listed == [("dbo", "customers")]


def test_a_snapshot_query_reads_the_tables_rows(served):
    client = mssql_cdc_flight.connect(served, token=READER_TOKEN)
    expected = client.read_snapshot("dbo.orders")
    every = query(served, "SELECT * FROM dbo.orders")
    assert every.schema.names[:6] == METADATA
    assert rows(every, "order_id", "amount", "status") == rows(
        expected, "order_id", "amount", "status"
    )
    # Named columns come after the metadata columns, in the order named.
    named = query(served, "SELECT status, [order_id] FROM [dbo].[orders]")
    assert named.schema.names[-3:] == ["status", "order_id", "_chunk"]
    assert rows(named, "order_id", "status") == rows(expected, "order_id", "status")
    in_range = sorted(key for key in expected.column("order_id").to_pylist() if 5 <= key <= 40)
    ranged = query(served, "SELECT * FROM dbo.orders WHERE order_id BETWEEN 5 AND 40")
    assert sorted(ranged.column("order_id").to_pylist()) == in_range
    compared = query(served, "SELECT * FROM dbo.orders WHERE order_id >= 5 AND order_id <= 40")
    assert sorted(compared.column("order_id").to_pylist()) == in_range


def test_a_change_range_query_equals_the_clients_read_of_the_range(served):
    client = mssql_cdc_flight.connect(served, token=READER_TOKEN)
    start = client.initial_offset("dbo.orders")
    end = client.latest_offset(start, max_commits=50)
    expected = client.read_changes("dbo.orders", start, end)
    keyed = ("_start_lsn", "_seqval", "_operation", "_command_id", "order_id", "amount")
    lsn_range = query(
        served,
        f"SELECT * FROM cdc.changes('dbo.orders', '{start.lsn}', '{end.lsn}')",
    )
    assert lsn_range.num_rows == expected.num_rows > 0
    assert rows(lsn_range, *keyed) == rows(expected, *keyed)
    # The same range named by 'earliest' and a commit cap, and by the offsets' JSON.
    capped = query(served, "select * from CDC.CHANGES('dbo.orders', 'Earliest', 'LATEST', 50)")
    assert rows(capped, *keyed) == rows(expected, *keyed)
    by_offset = query(
        served,
        f"SELECT * FROM cdc.changes('dbo.orders', '{start.to_json()}', '{end.to_json()}')",
    )
    assert rows(by_offset, *keyed) == rows(expected, *keyed)
    # All of it, with one captured column.
    everything = client.read_changes("dbo.orders", start)
    narrow = query(served, "SELECT order_id FROM cdc.changes('dbo.orders', 'earliest')")
    assert narrow.schema.names == [*METADATA, "order_id"]
    assert rows(narrow, "_start_lsn", "_seqval", "_operation", "order_id") == rows(
        everything, "_start_lsn", "_seqval", "_operation", "order_id"
    )


def test_the_planning_functions_answer_as_the_client_does(served):
    client = mssql_cdc_flight.connect(served, token=READER_TOKEN)
    max_lsn = query(served, "SELECT * FROM cdc.max_lsn()").column("lsn")[0].as_py()
    assert max_lsn == client.action("max_lsn")["lsn"]
    start = client.initial_offset("dbo.orders")
    initial = query(served, "SELECT * FROM cdc.initial_offset('dbo.orders', 'earliest')")
    # An unknown commit time ("" in the protocol's JSON) is NULL in SQL.
    assert initial.to_pylist() == [{"lsn": start.lsn, "commit_ts": start.commit_ts or None}]
    latest = query(served, f"SELECT * FROM cdc.latest_offset('{start.lsn}', 7)")
    assert latest.column("lsn")[0].as_py() == client.latest_offset(start, max_commits=7).lsn
    end = client.latest_offset(start)
    at = query(served, f"SELECT * FROM cdc.lsn_to_time('{end.lsn}')").column("commit_ts")
    assert at[0].as_py() == end.commit_ts
    back = query(served, f"SELECT * FROM cdc.time_to_lsn('{end.commit_ts}')").column("lsn")
    assert back[0].as_py() == end.lsn


def test_partitions_are_read_in_parallel_when_asked_for(served):
    client = mssql_cdc_flight.connect(served, token=READER_TOKEN)
    cases = [
        ("SELECT * FROM dbo.orders", client.read_snapshot("dbo.orders"), ("order_id", "amount")),
        (
            "SELECT * FROM cdc.changes('dbo.orders', 'earliest', 'latest')",
            client.read_changes("dbo.orders", client.initial_offset("dbo.orders")),
            ("_start_lsn", "_seqval", "_operation", "order_id"),
        ),
    ]
    for sql, expected, keyed in cases:
        # One endpoint by default: a client that reads only the first loses nothing.
        with connect(served) as connection, connection.cursor() as cursor:
            partitions, _ = cursor.adbc_execute_partitions(sql)
            assert len(partitions) == 1, sql
        with connect(served, partitions=4) as connection, connection.cursor() as cursor:
            partitions, schema = cursor.adbc_execute_partitions(sql)
        assert schema.names[:6] == METADATA
        if sql.endswith("dbo.orders"):
            assert len(partitions) == 4, "a snapshot cut on its key"

        def read(partition):
            with connect(served) as other, other.cursor() as reader:
                reader.adbc_read_partition(partition)
                return reader.fetch_arrow_table()

        with ThreadPoolExecutor(max_workers=4) as pool:
            parts = list(pool.map(read, partitions))
        assert rows(pa.concat_tables(parts), *keyed) == rows(expected, *keyed), sql
    with pytest.raises(adbc_driver_manager.Error, match="partitions"):
        with connect(served, partitions=0) as connection, connection.cursor() as cursor:
            cursor.execute("SELECT * FROM dbo.orders")


def test_a_prepared_statement_runs_until_closed(served):
    sql = "SELECT order_id FROM dbo.orders WHERE order_id BETWEEN 1 AND 30"
    with connect(served) as connection, connection.cursor() as cursor:
        cursor.adbc_prepare(sql)
        results = []
        for _ in range(2):
            cursor.execute(sql)
            results.append(cursor.fetch_arrow_table())
    first, second = results
    assert first.num_rows == second.num_rows > 0
    assert rows(first, "order_id") == rows(second, "order_id")
    assert max(first.column("order_id").to_pylist()) <= 30


def test_unsupported_sql_and_ungranted_tables_are_refused_with_the_reason(served):
    refused = [
        ("SELECT count(*) FROM dbo.orders", "aggregates"),
        (
            "SELECT * FROM dbo.orders o JOIN dbo.customers c ON o.customer_id = c.customer_id",
            "joins",
        ),
        ("DELETE FROM dbo.orders", "read-only"),
        ("SELECT * FROM dbo.orders WHERE status = 'x'", "BETWEEN"),
        ("SELECT * FROM dbo.customers WHERE email BETWEEN 1 AND 2", "bounded only on its key"),
        ("SELECT * FROM cdc.changes('dbo.orders', 'whenever')", "LSN"),
        ("SELECT * FROM dbo.nothing", "nothing"),
        ("SELECT * FROM dbo.orders WITH (NOLOCK)", "hints"),
        ("SELECT * FROM dbo.orders FOR SYSTEM_TIME AS OF '2026-01-01'", "SYSTEM_TIME"),
        (
            "SELECT * FROM cdc.changes('dbo.orders', 'earliest', '0xFFFFFFFFFFFFFFFFFFFF', 5)",
            "past max_lsn",
        ),
        ("SELECT * FROM dbo.orders WHERE order_id " + "+ 1 " * 10_000, "operators"),
    ]
    for sql, reason in refused:
        with pytest.raises(adbc_driver_manager.Error, match=reason):
            query(served, sql)
    for sql in [
        "SELECT * FROM dbo.orders",
        "SELECT * FROM cdc.changes('dbo.orders', 'earliest')",
        "SELECT * FROM cdc.initial_offset('dbo.orders')",
    ]:
        with pytest.raises(adbc_driver_manager.Error, match="may not read"):
            query(served, sql, token=ANALYST_TOKEN)
    assert query(served, "SELECT * FROM dbo.customers", token=ANALYST_TOKEN).num_rows > 0


def test_duckdb_queries_an_adbc_result(served):
    changes = query(served, "SELECT * FROM cdc.changes('dbo.orders', 'earliest')")
    counted = duckdb.sql(
        "SELECT _operation, count(*) AS n FROM changes GROUP BY _operation ORDER BY _operation"
    ).fetchall()
    by_hand = {}
    for operation in changes.column("_operation").to_pylist():
        by_hand[operation] = by_hand.get(operation, 0) + 1
    assert counted == sorted(by_hand.items())


def test_sqlalchemy_reads_through_flightsql_dbapi(served):
    host, port = served.removeprefix("grpc://").split(":")
    engine = sqlalchemy.create_engine(
        f"datafusion://{host}:{port}?insecure=true&token={READER_TOKEN}"
    )
    with engine.connect() as connection:
        result = connection.execute(sqlalchemy.text("SELECT * FROM cdc.max_lsn()")).fetchall()
        changes = connection.execute(
            sqlalchemy.text("SELECT order_id FROM cdc.changes('dbo.orders', 'earliest')")
        ).fetchall()
        snapshot = connection.execute(sqlalchemy.text("SELECT order_id FROM dbo.orders")).fetchall()
    client = mssql_cdc_flight.connect(served, token=READER_TOKEN)
    assert result[0][0] == client.action("max_lsn")["lsn"]
    expected = client.read_changes("dbo.orders", client.initial_offset("dbo.orders"))
    assert len(changes) == expected.num_rows > 0
    # A row is a tuple of the metadata columns, then order_id, then the snapshot's _chunk.
    assert sorted(row[6] for row in snapshot) == sorted(
        client.read_snapshot("dbo.orders").column("order_id").to_pylist()
    )
