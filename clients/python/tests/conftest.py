"""Fixtures shared by the Python tests: the real server binary over a simulated database."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def built(name: str, variable: str) -> str:
    """The workspace binary `name`: the path in `variable`, or the debug build's."""
    explicit = os.environ.get(variable)
    if explicit:
        return explicit
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    path = target / "debug" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --workspace` or set {variable}")
    return str(path)


def binary() -> str:
    return built("mssql-cdc-flight", "MSSQL_CDC_FLIGHT_BIN")


def writer_binary() -> str:
    return built("mssql-cdc-writer", "MSSQL_CDC_WRITER_BIN")


def run(*args: str) -> str:
    done = subprocess.run([binary(), *args], check=True, capture_output=True, text=True)
    return done.stdout


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """The lake the writer's demo makes (300 commits): bronze, facts, plans, control, silver
    and reconcile of its three tables, each bootstrapped by a chunked snapshot."""
    directory = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [writer_binary(), "demo", "--dir", str(directory), "--commits", "300"],
        check=True,
        capture_output=True,
        text=True,
    )
    return directory / "lake"


def workload_database(directory, *workload: str) -> None:
    """A simulated database with empty sample tables, then `sim run` with these flags."""
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0")
    run("sim", "run", str(directory), *workload)


def journal_rows(journal: Path, table: str):
    """The change rows the workload journaled for `table`, as `change_rows` gives them."""
    rows = []
    for line in journal.read_text().splitlines():
        entry = json.loads(line)
        if entry["table"] == table:
            rows.append(
                (
                    entry["start_lsn"],
                    entry["command_id"],
                    entry["seqval"],
                    entry["operation"],
                    entry["key"],
                )
            )
    return sorted(rows)


def change_rows(table, key: str = "order_id"):
    """The change rows of a pyarrow table (dbo.orders' unless `key` names another key
    column), keyed and sorted as the journal's."""
    return sorted(
        zip(
            table.column("_start_lsn").to_pylist(),
            table.column("_command_id").to_pylist(),
            table.column("_seqval").to_pylist(),
            table.column("_operation").to_pylist(),
            table.column(key).to_pylist(),
            strict=True,
        )
    )


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sim") / "db"
    journal = directory.parent / "journal.jsonl"
    workload_database(
        directory,
        "--commits",
        "400",
        "--seed",
        "3",
        "--clock",
        "virtual",
        "--max-rows-per-statement",
        "4",
        "--journal",
        str(journal),
    )
    return directory, journal


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokens_file(path: Path, principals: dict[str, tuple[list[str], str]]) -> Path:
    """A tokens file at `path` of principals `{name: (tables, token)}`."""
    entries = [
        {"name": name, "tables": tables, "token_sha256": sha256(token)}
        for name, (tables, token) in principals.items()
    ]
    path.write_text(json.dumps({"principals": entries}))
    return path


def free_port() -> int:
    """A loopback port free at the time of the call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(
    directory, *flags: str, port: int = 0, stderr=sys.stderr, env=None, scheme: str = "sim"
):
    """Starts `serve` over a simulated database on loopback (a free port unless `port` is
    given, so a test can restart it where its clients look); returns the process and its
    grpc:// URL. `stderr=subprocess.PIPE` keeps the server's log for the test to read, `env`
    replaces its environment; `scheme="seed-fake"` serves a directory of the seed library's
    FakeCdcDatabase instead of our simulator's."""
    process = subprocess.Popen(
        [
            binary(),
            "serve",
            "--source",
            f"{scheme}:{directory}",
            "--listen",
            f"127.0.0.1:{port}",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    line = process.stdout.readline()
    assert line.startswith("listening on "), line
    return process, f"grpc://{line.split()[-1]}"


def stop_server(process):
    process.terminate()
    assert process.wait(timeout=30) == 0, "graceful shutdown exits 0"


@pytest.fixture(scope="module")
def server(database):
    directory, _ = database
    key = directory.parent / "ticket.key"
    key.write_text("0123456789abcdef0123456789abcdef")
    process, url = start_server(directory, "--ticket-key-file", str(key))
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def spark():
    # Spark's Python workers (the data source's planner among them) run this interpreter,
    # where the package is installed; the JVM reads the variable when it starts.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("mssql-cdc-flight tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    from mssql_cdc_flight.spark import register

    register(session)
    yield session
    session.stop()
