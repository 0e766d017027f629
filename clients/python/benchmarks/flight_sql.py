"""A change range read through Flight SQL against the same range through our own commands.

    .venv/bin/python clients/python/benchmarks/flight_sql.py [--rows 3000000] [--rounds 5] \
        [--binary PATH]

A simulated database holds `--rows` change rows of dbo.orders (inserts); a release server
serves it on 127.0.0.1. Each round reads the whole range three ways, in turn, so all see the
same machine load; each read is timed from its plan to its last row:

- **ours**: pyarrow plans the `changes` command (JSON, 4 partitions) and reads every
  endpoint with `do_get(...).read_all()`, one thread per endpoint;
- **SQL, pyarrow**: the same pyarrow reader, the plan asked for as Flight SQL's
  `CommandStatementQuery` of `SELECT * FROM cdc.changes('dbo.orders', '<start>')` (what the
  server's Flight SQL face costs, with the reader held fixed);
- **SQL, ADBC**: the ADBC Flight SQL driver's `execute` and `fetch_arrow_table` of the same
  statement (what a Flight SQL user gets).

Both SQL ways ask for 4 partitions with the `x-mssql-cdc-partitions` header, as ours does.

Every read must return every row of the range. Printed: each way's median rows/s, every
read, and each SQL way's median divided by ours (issue 56 asks 0.9 or better).
"""

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import adbc_driver_flightsql.dbapi as adbc
import pyarrow.flight as flight
from bench_server import DEFAULT_BINARY, initial_lsn, orders_database, serve

STATEMENT_QUERY = "type.googleapis.com/arrow.flight.protocol.sql.CommandStatementQuery"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def statement_query(sql: str) -> bytes:
    """`Any{CommandStatementQuery{query}}`, encoded by hand: protobuf is not a dependency."""
    return field(1, STATEMENT_QUERY.encode()) + field(2, field(1, sql.encode()))


def read_endpoints(client: flight.FlightClient, info: flight.FlightInfo) -> int:
    with ThreadPoolExecutor(max_workers=max(1, len(info.endpoints))) as pool:
        tables = pool.map(lambda e: client.do_get(e.ticket).read_all(), info.endpoints)
        return sum(table.num_rows for table in tables)


def ours(client: flight.FlightClient, start: str) -> int:
    command = {"type": "changes", "table": "dbo.orders", "from": start, "partitions": 4}
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
    return read_endpoints(client, info)


PARTITIONS = [(b"x-mssql-cdc-partitions", b"4")]


def sql_pyarrow(client: flight.FlightClient, sql: str) -> int:
    descriptor = flight.FlightDescriptor.for_command(statement_query(sql))
    info = client.get_flight_info(descriptor, flight.FlightCallOptions(headers=PARTITIONS))
    return read_endpoints(client, info)


def sql_adbc(cursor, sql: str) -> int:
    cursor.execute(sql)
    return cursor.fetch_arrow_table().num_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--binary", default=DEFAULT_BINARY)
    args = parser.parse_args()
    workdir = tempfile.TemporaryDirectory(prefix="flight-sql-")
    db = orders_database(args.binary, Path(workdir.name), args.rows)
    server, url = serve(args.binary, db)
    try:
        client = flight.FlightClient(url)
        start = initial_lsn(client)
        sql = f"SELECT * FROM cdc.changes('dbo.orders', '{start}')"
        expected = ours(client, start)
        assert expected >= args.rows, (expected, args.rows)
        # One connection each, opened before the rounds, as a user keeps one.
        header = "adbc.flight.sql.rpc.call_header.x-mssql-cdc-partitions"
        connection = adbc.connect(url, db_kwargs={header: "4"}, autocommit=True)
        cursor = connection.cursor()
        ways = {
            "ours": lambda: ours(client, start),
            "SQL, pyarrow": lambda: sql_pyarrow(client, sql),
            "SQL, ADBC": lambda: sql_adbc(cursor, sql),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                began = time.perf_counter()
                rows = way()
                seconds = time.perf_counter() - began
                assert rows == expected, (name, rows, expected)
                rates[name].append(rows / seconds)
        cursor.close()
        connection.close()
        base = statistics.median(rates["ours"])
        print(f"{expected:,} change rows of dbo.orders, {args.rounds} rounds")
        print("| way | rows/s, median | each read, M rows/s | ÷ ours |")
        print("|---|---|---|---|")
        for name, each in rates.items():
            median = statistics.median(each)
            listed = ", ".join(f"{rate / 1e6:.2f}" for rate in each)
            print(f"| {name} | {median:,.0f} | {listed} | {median / base:.2f} |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
