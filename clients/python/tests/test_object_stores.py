"""The writer on real object-store protocols: S3 served by moto's server and Azure Blob served
by Azurite, both installed from the package registries (PyPI, npm) and started here. The
writer binary is built with its `s3` and `azure` features (scripts/test); it reads its
credentials and endpoints from the environment as delta-rs does, and the Python `deltalake`
package reads its tables back independently.

Each store gets: the sidecar's whole pipeline (chunked bootstrap, stream, silver, reconcile,
the checkpoint beside the facts on the store, `status` read from the lake, maintenance), and
two writers of one app id killed and restarted under a running workload (delta-rs's
conditional-put commits and the checkpoint's put-if-absent claims on the store itself)."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pyarrow.compute as pc
import pytest
from azure.storage.blob import BlobServiceClient
from conftest import (
    ROOT,
    binary,
    free_port,
    journal_rows,
    run,
    start_server,
    stop_server,
    writer_binary,
)
from deltalake import DeltaTable

# Azurite's well-known development account (published by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


@dataclass
class Store:
    """An emulated object store: URLs under one bucket (container), and the settings the
    writer (its environment) and the Python reader (storage options) need for it."""

    scheme: str
    bucket: str
    settings: dict = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        return "/".join([f"{self.scheme}://{self.bucket}", *parts])

    def env(self) -> dict:
        return {**os.environ, **self.settings, "RUST_LOG": "warn"}

    def table(self, url: str) -> DeltaTable:
        return DeltaTable(url, storage_options=self.settings)


def wait_for_port(port: int, process: subprocess.Popen, what: str) -> None:
    for _ in range(300):
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"{what} did not listen on {port} within 30 s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def s3():
    moto = Path(sys.executable).parent / "moto_server"
    if not moto.exists():
        pytest.fail(
            f"{moto} is missing: install moto[server] (clients/python/requirements-test.txt)"
        )
    port = free_port()
    process = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, process, "moto_server")
        settings = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "moto",
            "AWS_SECRET_ACCESS_KEY": "moto-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }
        boto3.client(
            "s3",
            endpoint_url=settings["AWS_ENDPOINT_URL"],
            aws_access_key_id="moto",
            aws_secret_access_key="moto-secret",
            region_name="us-east-1",
        ).create_bucket(Bucket="lake")
        yield Store("s3", "lake", settings)
    finally:
        stop(process)


def azurite_binary() -> Path:
    explicit = os.environ.get("AZURITE_BLOB_BIN")
    path = (
        Path(explicit)
        if explicit
        else ROOT / "scripts" / "emulators" / "node_modules" / ".bin" / "azurite-blob"
    )
    if not path.exists():
        pytest.fail(
            f"{path} is missing: scripts/test installs Azurite with npm (or set AZURITE_BLOB_BIN)"
        )
    return path


@pytest.fixture(scope="module")
def azure(tmp_path_factory):
    port = free_port()
    process = subprocess.Popen(
        [str(azurite_binary()), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
        + ["--location", str(tmp_path_factory.mktemp("azurite")), "--silent"]
        + ["--skipApiVersionCheck"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, process, "azurite-blob")
        endpoint = f"http://127.0.0.1:{port}"
        BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
        ).create_container("lake")
        settings = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": endpoint,
        }
        # object_store reads the emulator's URL from the environment only, so the Python
        # reader in this process needs it there too.
        previous = os.environ.get("AZURITE_BLOB_STORAGE_URL")
        os.environ["AZURITE_BLOB_STORAGE_URL"] = endpoint
        try:
            yield Store("az", "lake", settings)
        finally:
            if previous is None:
                del os.environ["AZURITE_BLOB_STORAGE_URL"]
            else:
                os.environ["AZURITE_BLOB_STORAGE_URL"] = previous
    finally:
        stop(process)


@pytest.fixture(params=["s3", "azure"])
def store(request):
    return request.getfixturevalue(request.param)


def bronze_change_rows(store: Store, url: str):
    """Bronze's change rows (snapshot rows, `_operation` 0, left out) as `journal_rows` gives
    the journal's."""
    table = store.table(url).to_pyarrow_table()
    changes = table.filter(pc.not_equal(table["_operation"], 0))
    return sorted(
        zip(
            changes["_start_lsn"].to_pylist(),
            changes["_command_id"].to_pylist(),
            changes["_seqval"].to_pylist(),
            changes["_operation"].to_pylist(),
            changes["order_id"].to_pylist(),
            strict=True,
        )
    )


def orders_in_source(directory: Path) -> int:
    info = run("sim", "info", str(directory))
    return int(re.search(r"table dbo\.orders \((\d+) rows", info).group(1))


def test_the_sidecar_pipeline_runs_on_the_store(store, tmp_path):
    directory, journal = tmp_path / "db", tmp_path / "journal.jsonl"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "400")
    workload = ["--table", "dbo.orders", "--clock", "virtual", "--journal", str(journal)]
    run("sim", "run", str(directory), "--commits", "150", "--seed", "5", *workload)
    server, url = start_server(directory)
    lake = tmp_path.name
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f'server = "{url.replace("grpc://", "http://")}"\n'
        f'facts = "{store.url(lake, "facts")}"\n'
        f'control = "{store.url(lake, "control")}"\n'
        f'reconcile_report = "{store.url(lake, "reconcile")}"\n\n'
        "[[tables]]\n"
        'table = "dbo.orders"\n'
        f'target = "{store.url(lake, "bronze_orders")}"\n'
        'app_id = "orders"\n'
        'bootstrap = "chunked"\n'
        "chunk_rows = 100\n"
        f'silver = "{store.url(lake, "silver_orders")}"\n'
        'keys = ["order_id"]\n'
        "reconcile_minutes = 60.0\n"
    )
    sidecar = [writer_binary(), "run", "--config", str(config), "--available-now"]
    try:
        subprocess.run(sidecar, check=True, env=store.env(), capture_output=True, text=True)
        # Changes after the snapshot: the second run streams them and applies them to silver.
        open(journal, "w").close()
        run("sim", "run", str(directory), "--commits", "150", "--seed", "6", *workload)
        subprocess.run(sidecar, check=True, env=store.env(), capture_output=True, text=True)
        status = subprocess.run(
            [writer_binary(), "status", "--config", str(config)],
            check=True,
            env=store.env(),
            capture_output=True,
            text=True,
        ).stdout
    finally:
        stop_server(server)

    bronze_url = store.url(lake, "bronze_orders")
    assert bronze_change_rows(store, bronze_url) == journal_rows(journal, "dbo.orders")
    bronze = store.table(bronze_url).to_pyarrow_table()
    snapshot_rows = bronze.filter(pc.equal(bronze["_operation"], 0)).num_rows
    assert snapshot_rows > 100, "the chunked bootstrap wrote its chunks to the store"
    silver = store.table(store.url(lake, "silver_orders")).to_pyarrow_table()
    assert silver.num_rows == orders_in_source(directory)
    assert len(set(silver["order_id"].to_pylist())) == silver.num_rows
    report = store.table(store.url(lake, "reconcile")).to_pyarrow_table()
    buckets = report.filter(pc.is_valid(report["status"]))
    assert set(buckets["status"].to_pylist()) == {"MATCH"}, "silver equals the source"
    assert len(set(report["run_id"].to_pylist())) == 2, "one reconcile per run"
    # The checkpoint lives beside the facts on the store (no local directory was named), so
    # `status` reads the last batch from there.
    row = next(line for line in status.splitlines() if line.startswith("dbo.orders"))
    control = store.table(store.url(lake, "control")).to_pyarrow_table()
    verified = [lsn for lsn in control["verified_lsn"].to_pylist() if lsn]
    assert verified and verified[0] in row, status

    # Maintenance on the store: every table of many small files compacted, nothing lost.
    tables = ("bronze_orders", "silver_orders", "facts", "control")
    before = {}
    for name in tables:
        table = store.table(store.url(lake, name))
        before[name] = (table.to_pyarrow_table().num_rows, len(table.file_uris()))
    assert before["bronze_orders"][1] > 2 and before["facts"][1] > 2
    subprocess.run(
        [writer_binary(), "maintain", "--config", str(config), "--min-files", "2"],
        check=True,
        env=store.env(),
        capture_output=True,
        text=True,
    )
    for name, (rows, files) in before.items():
        table = store.table(store.url(lake, name))
        assert table.to_pyarrow_table().num_rows == rows, f"{name} lost rows to maintenance"
        assert len(table.file_uris()) == 1, f"{name} compacted: {table.file_uris()}"
        compacted = "OPTIMIZE" in [entry["operation"] for entry in table.history()]
        assert compacted == (files >= 2), f"{name}: {files} files before"


def writer(store: Store, url: str, lake: str) -> subprocess.Popen:
    return subprocess.Popen(
        [writer_binary(), "run", "--server", url, "--table", "dbo.orders"]
        + ["--target", store.url(lake, "bronze_orders"), "--facts", store.url(lake, "facts")]
        + ["--control", store.url(lake, "control"), "--app-id", "orders"]
        + ["--max-commits", "25", "--granularity", "minute", "--poll-seconds", "0.05"],
        env=store.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_writers_killed_and_restarted_under_a_workload_lose_and_double_nothing(store, tmp_path):
    directory, journal = tmp_path / "db", tmp_path / "journal.jsonl"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0")
    server, url = start_server(directory)
    lake = tmp_path.name
    workload = subprocess.Popen(
        [binary(), "sim", "run", str(directory), "--commits", "600", "--rate", "100"]
        + ["--seed", "9", "--table", "dbo.orders", "--journal", str(journal)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    randomness = random.Random(20)
    fenced, rounds = [], 0
    try:
        # Two writers of one app id started together, then both killed at a random moment;
        # again and again while the workload runs.
        while workload.poll() is None:
            rounds += 1
            pair = [writer(store, url, lake), writer(store, url, lake)]
            deadline = time.monotonic() + randomness.uniform(0.8, 2.5)
            while time.monotonic() < deadline:
                time.sleep(0.05)
            for process in pair:
                if process.poll() is None:
                    process.send_signal(signal.SIGKILL)
                process.wait()
                stderr = process.stderr.read()
                if process.returncode > 0:
                    fenced.append(stderr)
        assert workload.returncode == 0
        finished = subprocess.run(
            [writer_binary(), "run", "--server", url, "--table", "dbo.orders"]
            + ["--target", store.url(lake, "bronze_orders"), "--facts", store.url(lake, "facts")]
            + ["--control", store.url(lake, "control"), "--app-id", "orders", "--available-now"],
            env=store.env(),
            capture_output=True,
            text=True,
        )
        assert finished.returncode == 0, finished.stderr
    finally:
        if workload.poll() is None:
            workload.kill()
        stop_server(server)

    assert rounds >= 3, "the writers were killed mid-way more than once"
    assert fenced, "a second writer of one app id is stopped"
    reasons = [
        line for stderr in fenced for line in stderr.splitlines() if line.startswith("Error: ")
    ]
    assert len(reasons) == len(fenced), fenced
    assert all("two writers of one app id are running" in reason for reason in reasons), reasons
    assert bronze_change_rows(store, store.url(lake, "bronze_orders")) == journal_rows(
        journal, "dbo.orders"
    ), "every change in bronze exactly once"
    facts = store.table(store.url(lake, "facts")).to_pyarrow_table()
    batches = facts.filter(pc.is_null(facts["event"]))["batch_id"].to_pylist()
    assert sorted(batches) == list(range(len(batches))), "one facts row per batch"
