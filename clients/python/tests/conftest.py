"""Fixtures shared by the Python tests: the real server binary over a simulated database."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def binary() -> str:
    explicit = os.environ.get("MSSQL_CDC_FLIGHT_BIN")
    if explicit:
        return explicit
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    path = target / "debug" / "mssql-cdc-flight"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build` first or set MSSQL_CDC_FLIGHT_BIN")
    return str(path)


def run(*args: str) -> str:
    done = subprocess.run([binary(), *args], check=True, capture_output=True, text=True)
    return done.stdout


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sim") / "db"
    journal = directory.parent / "journal.jsonl"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0")
    run(
        "sim",
        "run",
        str(directory),
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


def start_server(directory, *flags: str):
    """Starts `serve` over a simulated database on a free loopback port; returns the process
    and its grpc:// URL."""
    process = subprocess.Popen(
        [binary(), "serve", "--source", f"sim:{directory}", "--listen", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
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
