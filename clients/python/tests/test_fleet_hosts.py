"""A fleet of writer replicas on hosts of their own (issue 57): network namespaces on this
machine (`ip netns`, veth pairs on one bridge, Debian's iproute2), the Flight server in one,
S3 (moto's server) in another, and each replica in its own. A workload runs while a replica
is cut off from the network and brought back, another is killed, and a new one joins;
afterwards every table's bronze holds exactly its journal, and the lease moves are the ones
the faults call for.

The test needs root and iproute2, as CI gives it; it fails (never skips) without them.
`MSSQL_CDC_FLEET_COMMITS` (default 400, at 10 a second) makes the run longer."""

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow.compute as pc
import pytest
from conftest import binary, change_rows, journal_rows, run, writer_binary
from deltalake import DeltaTable

TABLES = {"dbo.customers": "customer_id", "dbo.orders": "order_id", "dbo.types": "id"}
# Seconds a replica's heartbeat holds its tables: the shortest the writer allows on an
# object store (S3 keeps modification times in whole seconds).
LEASE_SECONDS = 10
TOKEN = "fleet-test-token-0123456789"
COMMITS = int(os.environ.get("MSSQL_CDC_FLEET_COMMITS", "400"))


class Hosts:
    """Namespaces on one bridge of a private /24: `add` makes a host, `cut` and `restore`
    take its link down and up (it loses every other host), `start` runs a command in it."""

    def __init__(self):
        self.tag = f"{os.getpid() % 10000:04d}"
        self.subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 250)}"
        self.bridge = f"cbr{self.tag}"
        self.hosts: dict[str, tuple[str, str]] = {}
        self.processes: list[subprocess.Popen] = []
        self.ip("link", "add", self.bridge, "type", "bridge")
        self.ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        self.ip("link", "set", self.bridge, "up")

    @staticmethod
    def ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(
                f"`ip {' '.join(args)}` failed ({done.stderr.strip()}): this test needs root "
                "and iproute2 to make network namespaces, as CI has"
            )

    def add(self, name: str) -> str:
        """A host `name`; its address."""
        number = len(self.hosts) + 2
        namespace, outside = f"c{self.tag}{name}", f"v{self.tag}{name}"
        address = f"{self.subnet}.{number}"
        self.ip("netns", "add", namespace)
        self.ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        self.ip("link", "set", outside, "master", self.bridge)
        self.ip("link", "set", outside, "up")
        for args in (
            ("addr", "add", f"{address}/24", "dev", "eth0"),
            ("link", "set", "eth0", "up"),
            ("link", "set", "lo", "up"),
        ):
            self.ip("netns", "exec", namespace, "ip", *args)
        self.hosts[name] = (namespace, outside)
        return address

    def cut(self, name: str) -> None:
        self.ip("link", "set", self.hosts[name][1], "down")

    def restore(self, name: str) -> None:
        self.ip("link", "set", self.hosts[name][1], "up")

    def start(self, name: str, command: list[str], log: Path, env: dict) -> subprocess.Popen:
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[name][0], *command],
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 (the process holds it)
            text=True,
            env=env,
        )
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for namespace, outside in self.hosts.values():
            subprocess.run(["ip", "link", "del", outside], capture_output=True)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.fail("iproute2's `ip` is missing: CI installs it (Debian's iproute2)")
    made = Hosts()
    try:
        yield made
    finally:
        made.close()


def wait_for(what: str, seconds: float, done, logs=None):
    """Waits up to `seconds` for `done()` to be truthy; its value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.5)
    detail = "".join(f"\n--- {path.name}:\n{path.read_text()[-3000:]}" for path in (logs or []))
    pytest.fail(f"never within {seconds} s: {what}{detail}")


def holders(config: Path, env: dict) -> dict[str, str]:
    """The replica holding each table's lease, by `mssql-cdc-writer status` (its name, or
    '-')."""
    done = subprocess.run(
        [writer_binary(), "status", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        return {}
    found = {}
    for line in done.stdout.splitlines():
        table = line.split(" ", 1)[0]
        if table in TABLES:
            held = re.search(r"\s(r\d)@\S+\s", line)
            found[table] = held.group(1) if held else "-"
    return found


def bronze_changes(url: str, key: str, options: dict):
    table = DeltaTable(url, storage_options=options).to_pyarrow_table()
    return change_rows(table.filter(pc.not_equal(table["_operation"], 0)), key)


def test_replicas_on_hosts_of_their_own_share_tables_through_cuts_kills_and_joins(hosts, tmp_path):
    directory, journal = tmp_path / "db", tmp_path / "journal.jsonl"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0", "--types", "0")
    server_address = hosts.add("srv")
    lake_address = hosts.add("lake")
    replica_addresses = {name: hosts.add(name) for name in ("r0", "r1", "r2", "r3")}
    assert len(set(replica_addresses.values())) == 4

    # The server, authenticating every call off loopback (plain text: a test network).
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "principals": [
                    {
                        "name": "fleet",
                        "tables": ["*"],
                        "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
                    }
                ]
            }
        )
    )
    key = tmp_path / "ticket.key"
    key.write_text("0123456789abcdef0123456789abcdef")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    os.chmod(token_file, 0o600)
    server = hosts.start(
        "srv",
        [binary(), "serve", "--source", f"sim:{directory}"]
        + ["--listen", f"{server_address}:50051", "--tokens-file", str(tokens)]
        + ["--insecure-no-tls", "--ticket-key-file", str(key)],
        tmp_path / "server.log",
        {**os.environ, "RUST_LOG": "warn"},
    )
    line = server.stdout.readline()
    assert line.startswith("listening on "), (tmp_path / "server.log").read_text()

    moto = Path(sys.executable).parent / "moto_server"
    assert moto.exists(), f"{moto} is missing: install moto[server]"
    hosts.start(
        "lake",
        [str(moto), "-H", lake_address, "-p", "5000"],
        tmp_path / "moto.log",
        os.environ.copy(),
    )
    s3 = {
        "AWS_ENDPOINT_URL": f"http://{lake_address}:5000",
        "AWS_ACCESS_KEY_ID": "moto",
        "AWS_SECRET_ACCESS_KEY": "moto-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    client = boto3.client(
        "s3",
        endpoint_url=s3["AWS_ENDPOINT_URL"],
        aws_access_key_id="moto",
        aws_secret_access_key="moto-secret",
        region_name="us-east-1",
    )

    def bucket_made():
        try:
            client.create_bucket(Bucket="lake")
            return True
        except Exception:  # moto still starting
            return False

    wait_for("moto serves S3 in its namespace", 60, bucket_made)

    config = tmp_path / "sidecar.toml"
    text = (
        f'server = "http://{server_address}:50051"\n'
        'facts = "s3://lake/fleet/facts"\ncontrol = "s3://lake/fleet/control"\n'
        'granularity = "minute"\npoll_seconds = 0.5\nmaintenance_minutes = 0.0\n'
    )
    for table in TABLES:
        name = table.split(".")[1]
        text += (
            f'\n[[tables]]\ntable = "{table}"\ntarget = "s3://lake/fleet/bronze_{name}"\n'
            f'app_id = "{name}"\nmax_commits = 20\n'
        )
    text += f"\n[fleet]\nlease_seconds = {LEASE_SECONDS}.0\n"
    config.write_text(text)
    # The token crosses a test network in clear text, which the client refuses unless told.
    env = {
        **os.environ,
        **s3,
        "RUST_LOG": "info",
        "MSSQL_CDC_FLIGHT_TOKEN_FILE": str(token_file),
        "MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN": "1",
    }
    logs = {name: tmp_path / f"{name}.log" for name in replica_addresses}
    replicas = {}

    def start(name: str):
        replicas[name] = hosts.start(
            name,
            [writer_binary(), "run", "--config", str(config)],
            logs[name],
            {**env, "HOSTNAME": name},
        )

    for name in ("r0", "r1", "r2"):
        start(name)
    all_logs = list(logs.values())
    spread = wait_for(
        "three replicas hold a table each",
        120,
        lambda: (
            (held := holders(config, env)) and sorted(held.values()) == ["r0", "r1", "r2"] and held
        ),
        all_logs,
    )
    workload = subprocess.Popen(
        [binary(), "sim", "run", str(directory), "--commits", str(COMMITS), "--rate", "10"]
        + ["--seed", "57", "--journal", str(journal), "--max-rows-per-statement", "3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    hosts.processes.append(workload)
    time.sleep(3)

    # r1 cut off from the server and the lake: its watchdog stops its table, the others
    # take it once its heartbeat is a lease old; back on the network it holds what the
    # shares give it.
    cut_table = next(table for table, holder in spread.items() if holder == "r1")
    hosts.cut("r1")
    cut_at = time.monotonic()
    taken = wait_for(
        "r1's table is taken over while r1 is cut off",
        LEASE_SECONDS * 4,
        lambda: holders(config, env).get(cut_table) in ("r0", "r2"),
        all_logs,
    )
    assert taken
    took_cut = time.monotonic() - cut_at
    hosts.restore("r1")
    wait_for(
        "r1 logs that it stopped its tables while cut off",
        30,
        lambda: "stopping every table" in logs["r1"].read_text(),
        all_logs,
    )

    # r0 killed: its table goes to another.
    killed_table = next(table for table, holder in holders(config, env).items() if holder == "r0")
    replicas["r0"].send_signal(signal.SIGKILL)
    replicas["r0"].wait()
    killed_at = time.monotonic()
    wait_for(
        "r0's table is taken over after the kill",
        LEASE_SECONDS * 4,
        lambda: holders(config, env).get(killed_table) in ("r1", "r2"),
        all_logs,
    )
    took_kill = time.monotonic() - killed_at

    # r3 joins: the shares move one table to it.
    start("r3")
    wait_for(
        "the joining replica gets a table",
        LEASE_SECONDS * 6,
        lambda: "r3" in holders(config, env).values(),
        all_logs,
    )
    assert workload.wait(timeout=COMMITS) == 0, workload.stderr.read()

    options = dict(s3)

    def caught_up():
        for table, key in TABLES.items():
            url = f"s3://lake/fleet/bronze_{table.split('.')[1]}"
            try:
                held = bronze_changes(url, key, options)
            except Exception:  # not created yet
                return False
            if held != journal_rows(journal, table):
                return False
        return True

    wait_for("every table's bronze holds exactly its journal", 180, caught_up, all_logs)
    print(
        f"lease {LEASE_SECONDS} s: a cut-off replica's table taken over after {took_cut:.1f} s, "
        f"a killed one's after {took_kill:.1f} s"
    )
    fenced = {name: log.read_text().count("Fenced") for name, log in logs.items()}
    print(f"fence refusals logged by replica: {fenced}")

    # Stopped by SIGTERM, the replicas give their leases back.
    for name in ("r1", "r2", "r3"):
        replicas[name].send_signal(signal.SIGTERM)
    for name in ("r1", "r2", "r3"):
        assert replicas[name].wait(timeout=120) == 0, logs[name].read_text()[-3000:]
    assert set(holders(config, env).values()) == {"-"}, "leases given back at the stop"
    server.terminate()
    server.wait(timeout=30)
