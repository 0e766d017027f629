"""pyarrow's stock `read_all` against the server: rows/s per read, plan included.

    .venv/bin/python clients/python/benchmarks/read_all.py [--rows 3000000] [--reads 7] \
        [--binary PATH]

A simulated database holds `--rows` change rows of dbo.orders (inserts). A release server
serves it on 127.0.0.1; for 1 and then 2 endpoints, pyarrow plans the whole range and reads
every endpoint with `do_get(...).read_all()` one after the other, `--reads` times, and the
median and every read's rows/s are printed (issue 22's P1: at least 4M narrow rows/s).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.flight as flight
from bench_server import DEFAULT_BINARY, initial_lsn, orders_database, serve


def read_once(client: flight.FlightClient, start: str, partitions: int) -> float:
    began = time.perf_counter()
    command = {"type": "changes", "table": "dbo.orders", "from": start, "partitions": partitions}
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
    rows = sum(client.do_get(e.ticket).read_all().num_rows for e in info.endpoints)
    seconds = time.perf_counter() - began
    expected = sum(int(json.loads(e.app_metadata)["rows"]) for e in info.endpoints)
    assert rows == expected, (rows, expected)
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--reads", type=int, default=7)
    parser.add_argument("--binary", default=DEFAULT_BINARY)
    args = parser.parse_args()
    workdir = tempfile.TemporaryDirectory(prefix="read-all-")
    db = orders_database(args.binary, Path(workdir.name), args.rows)
    server, url = serve(args.binary, db)
    try:
        client = flight.FlightClient(url)
        start = initial_lsn(client)
        print("| endpoints | rows/s, median | each read, M rows/s |")
        print("|---|---|---|")
        for partitions in (1, 2):
            rates = [read_once(client, start, partitions) for _ in range(args.reads)]
            each = ", ".join(f"{rate / 1e6:.2f}" for rate in rates)
            print(f"| {partitions} | {statistics.median(rates):,.0f} | {each} |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
