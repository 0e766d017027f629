"""What the benchmarks share: a simulated dbo.orders and the server binary serving it."""

import json
import subprocess
from pathlib import Path

import pyarrow.flight as flight

ROOT = Path(__file__).resolve().parents[3]
# A release build is best: `cargo build --release`.
DEFAULT_BINARY = str(ROOT / "target" / "release" / "mssql-cdc-flight")


def orders_database(binary: str, directory: Path, rows: int) -> Path:
    """A simulated database in `directory`/db whose dbo.orders holds `rows` change rows (its
    seeded inserts)."""
    db = directory / "db"
    subprocess.run(
        [binary, "sim", "init", str(db), "--customers", "0", "--orders", str(rows)],
        check=True,
        capture_output=True,
    )
    return db


def initial_lsn(client) -> str:
    """Where a read of all of dbo.orders starts: its `initial_offset`'s LSN."""
    action = flight.Action("initial_offset", b'{"table": "dbo.orders"}')
    return json.loads(list(client.do_action(action))[0].body.to_pybytes())["lsn"]


def serve(binary: str, db: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """The server serving `db` on a free loopback port with `flags`: its process (the caller
    terminates it) and its grpc:// URL."""
    server = subprocess.Popen(
        [binary, "serve", "--source", f"sim:{db}", "--listen", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return server, "grpc://" + server.stdout.readline().split()[-1]
