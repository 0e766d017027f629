"""Server memory under many concurrent slow readers: peak RSS (VmHWM) of the real server and
the aggregate rows/s, for N readers.

    .venv/bin/python clients/python/benchmarks/concurrent_readers.py \
        [--rows 3400000] [--readers 1,8,32,128] [--pause-ms 2] [--binary PATH] [-- serve flags]

A simulated database holds `--rows` change rows of dbo.orders, planned in 4 endpoints. For each
N, a fresh server (so VmHWM is that run's peak) serves N pyarrow clients, each on its own
connection reading one endpoint (reader i reads endpoint i mod 4) and pausing `--pause-ms`
after every batch, as a busy Spark executor or a slow network would. Every stream is checked
(its completion marker counts its rows). Flags after `--` go to `serve` (for example
`--stream-memory 33554432`). `--max-streams` is raised to N so that every reader is served.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.flight as flight
from bench_server import DEFAULT_BINARY, orders_database, serve


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def read_slowly(url: str, ticket: bytes, pause: float, results: list, index: int) -> None:
    client = flight.FlightClient(url)
    reader = client.do_get(flight.Ticket(ticket))
    rows, marker = 0, None
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            break
        if chunk.app_metadata is not None:
            marker = json.loads(chunk.app_metadata.to_pybytes())
        elif chunk.data is not None:
            rows += chunk.data.num_rows
            time.sleep(pause)
    assert marker is not None and marker["rows"] == rows, (marker, rows)
    results[index] = rows
    client.close()


def measure(binary: str, db: Path, readers: int, pause: float, serve_flags: list[str], batch_bytes):
    server, url = serve(
        binary,
        db,
        "--max-streams",
        str(readers),
        "--max-streams-per-principal",
        str(readers),
        *serve_flags,
    )
    try:
        client = flight.FlightClient(url)
        start = json.loads(
            list(client.do_action(flight.Action("initial_offset", b'{"table": "dbo.orders"}')))[
                0
            ].body.to_pybytes()
        )
        command = {
            "type": "changes",
            "table": "dbo.orders",
            "from": start["lsn"],
            "partitions": 4,
            "min_partition_rows": 1,
        }
        if batch_bytes:
            command["batch_bytes"] = batch_bytes
        info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
        tickets = [endpoint.ticket.ticket for endpoint in info.endpoints]
        results = [0] * readers
        threads = [
            threading.Thread(
                target=read_slowly, args=(url, tickets[i % len(tickets)], pause, results, i)
            )
            for i in range(readers)
        ]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - began
        per_endpoint = [int(json.loads(e.app_metadata)["rows"]) for e in info.endpoints]
        expected = sum(per_endpoint[i % len(per_endpoint)] for i in range(readers))
        assert sum(results) == expected, (sum(results), expected)
        return peak_rss_mib(server.pid), sum(results) / seconds, sum(results)
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    flags, serve_flags = sys.argv[1:], []
    if "--" in flags:
        at = flags.index("--")
        flags, serve_flags = flags[:at], flags[at + 1 :]
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3_400_000)
    parser.add_argument("--readers", default="1,8,32,128")
    parser.add_argument("--pause-ms", type=float, default=2.0)
    parser.add_argument("--batch-bytes", type=int, default=None, help="default: the server's")
    parser.add_argument("--binary", default=DEFAULT_BINARY)
    args = parser.parse_args(flags)
    workdir = tempfile.TemporaryDirectory(prefix="concurrent-readers-")
    db = orders_database(args.binary, Path(workdir.name), args.rows)
    print(f"serve flags: {' '.join(serve_flags) or '(defaults)'}; pause {args.pause_ms} ms/batch")
    print("| readers | rows read | aggregate rows/s | server peak RSS MiB |")
    print("|---|---|---|---|")
    for readers in [int(n) for n in args.readers.split(",")]:
        rss, rate, rows = measure(
            args.binary, db, readers, args.pause_ms / 1000, serve_flags, args.batch_bytes
        )
        print(f"| {readers} | {rows} | {rate:,.0f} | {rss:.0f} |", flush=True)
    workdir.cleanup()


if __name__ == "__main__":
    main()
