"""The seed library's simulator as a source (issue 55): histories that `mssql-cdc-pyspark`'s
own `FakeCdcDatabase` writes, served by our server (`--source seed-fake:<DIR>`), read back
equal to what the seed's own `FakeCdcClient` reads from the same files, and streamed by our
writer through a snapshot, a capture-instance switch, a cleanup of what was read and a purge
healed by re-snapshot into a silver that equals the seed's current rows and reconciles."""

import json
import subprocess
from datetime import date, datetime
from decimal import Decimal

from conftest import start_server, stop_server, writer_binary
from deltalake import DeltaTable
from mssql_cdc.fake import FakeCdcClient
from seed_workload import KEYS, LINES, ORDERS_V2, SeedWorkload, captured

import mssql_cdc_flight


def served_changes(client, table: str) -> list:
    """The table's changes from the first offset to max_lsn, as our server serves them."""
    start = client.initial_offset(table, "earliest")
    read = client.read_changes(table, start, include_command_id=True).to_pylist()
    return [{k: v for k, v in row.items() if k != "_capture_instance"} for row in read]


def seed_changes(path, table: str, instances: list) -> list:
    """What the seed's own client reads of the table: each instance from its low watermark,
    the older one up to the newer one's start (the switch both libraries make)."""
    client = FakeCdcClient(str(path))
    end = client.max_lsn()
    out = []
    for number, instance in enumerate(instances):
        start = client.min_lsn(instance)
        stop = end
        if number + 1 < len(instances):
            stop = client.decrement_lsn(client.min_lsn(instances[number + 1]))
        columns = [c for c in client.capture_instances(table)[-1].columns]
        for batch in client.iter_changes(instance, start, stop, columns, True, 1000):
            out.extend(batch.to_pylist())
    return out


def normalized(row: dict) -> dict:
    """A row as comparable text: both clients' values by column, dates and decimals as text."""
    out = {}
    for name, value in row.items():
        name = name.lstrip("_")
        if isinstance(value, (date, Decimal)):
            value = str(value)
        if name == "commit_ts" and isinstance(value, datetime):
            value = value.isoformat(timespec="milliseconds")
        out[name] = value
    return out


def test_our_server_serves_the_seeds_history_as_the_seeds_own_client_reads_it(tmp_path):
    workload = SeedWorkload(tmp_path / "seed", seed=55)
    workload.commits(60)
    workload.switch()
    workload.commits(40)
    process, url = start_server(tmp_path / "seed", scheme="seed-fake")
    try:
        client = mssql_cdc_flight.connect(url)
        assert sorted(client.tables()) == ["dbo.lines", "dbo.orders"]
        instances = [ci["name"] for ci in client.capture_instances("dbo.orders")]
        assert instances == ["orders", "orders_v2"]
        for table, names in [("orders", instances), ("lines", ["lines"])]:
            ours = [normalized(row) for row in served_changes(client, f"dbo.{table}")]
            theirs = [normalized(row) for row in seed_changes(tmp_path / "seed", table, names)]
            assert len(ours) > 50
            assert ours == theirs, table
        snapshot = client.read_snapshot("dbo.orders").to_pylist()
        expected = sorted(workload.rows["orders"].values(), key=lambda row: row["id"])
        columns = captured(ORDERS_V2, "orders")
        assert [{c: normalized(row)[c] for c in columns} for row in snapshot] == [
            {c: row.get(c) for c in columns} for row in expected
        ]
        # A composite key, no integer bounds: three keyset ranges the source seeks, read in
        # parallel, hold the seed's rows once each.
        plan = client.plan_snapshot("dbo.lines", partitions=3)
        assert len(plan.endpoints) == 3
        lines = client.read_snapshot("dbo.lines", partitions=3).to_pylist()
        columns = captured(LINES, "lines")
        key = lambda row: (row["order_id"], row["line"])  # noqa: E731
        assert sorted(({c: normalized(row)[c] for c in columns} for row in lines), key=key) == [
            {c: row.get(c) for c in columns}
            for row in sorted(workload.rows["lines"].values(), key=key)
        ]
    finally:
        stop_server(process)


def writer(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([writer_binary(), *args], capture_output=True, text=True)
    assert done.returncode == 0, (args[0], done.stderr[:3000])
    return done


def test_our_writer_streams_the_seeds_history_into_a_silver_equal_to_the_seeds_rows(tmp_path):
    path, lake = tmp_path / "seed", tmp_path / "lake"
    workload = SeedWorkload(path, seed=56)
    workload.commits(40)
    process, url = start_server(path, scheme="seed-fake")

    def stream(table: str, *flags: str):
        writer(
            "run", "--server", url, "--table", f"dbo.{table}",
            "--target", str(lake / f"bronze_{table}"), "--facts", str(lake / "facts"),
            "--control", str(lake / "control"), "--checkpoint", str(tmp_path / f"cp_{table}"),
            "--app-id", table, "--available-now", "--bootstrap", "full",
            "--on-data-loss", "resnapshot", "--max-commits", "7", *flags,
        )  # fmt: skip

    try:
        for table in ["orders", "lines"]:
            stream(table)
        # Cleanup of what the writer has read, a new capture instance with a new column, and a
        # purge of lines' changes before the writer read them.
        workload.db.cleanup("orders", FakeCdcClient(str(path)).max_lsn())
        workload.switch()
        workload.commits(30)
        stream("orders")
        purged_to = workload.commits(10)
        workload.db.cleanup("lines", purged_to)
        workload.commits(5)
        for table in ["orders", "lines"]:
            stream(table)
        writer(
            "backfill", "--server", url, "--table", "dbo.lines",
            "--target", str(lake / "bronze_lines"), "--facts", str(lake / "facts"),
            "--app-id", "lines",
        )  # fmt: skip
        stream("lines")
        for table in ["orders", "lines"]:
            keys = KEYS[table] if isinstance(KEYS[table], list) else [KEYS[table]]
            writer(
                "apply", "--table", f"dbo.{table}", "--keys", ",".join(keys),
                "--bronze", str(lake / f"bronze_{table}"), "--target", str(lake / table),
                "--control", str(lake / "control"), "--facts", str(lake / "facts"),
            )  # fmt: skip
            silver = DeltaTable(str(lake / table)).to_pyarrow_table().to_pylist()
            columns = captured(ORDERS_V2 if table == "orders" else LINES, table)
            ours = sorted(
                ({c: normalized(row)[c] for c in columns} for row in silver),
                key=lambda row: [row[k] for k in keys],
            )
            theirs = sorted(
                ({c: row.get(c) for c in columns} for row in workload.rows[table].values()),
                key=lambda row: [row[k] for k in keys],
            )
            assert ours == theirs, table
            done = writer(
                "reconcile", "--server", url, "--table", f"dbo.{table}",
                "--silver", str(lake / table), "--bronze", str(lake / f"bronze_{table}"),
                "--control", str(lake / "control"), "--sample", "0", "--output", "json",
            )  # fmt: skip
            report = json.loads(done.stdout)
            assert report["values_verified"], report
            # The verdict's freshness in one call (the seed's finalization.freshness).
            fresh = json.loads(
                writer(
                    "freshness", "--control", str(lake / "control"), "--table", f"dbo.{table}"
                ).stdout
            )
            control = DeltaTable(str(lake / "control")).to_pyarrow_table().to_pylist()
            (row,) = [row for row in control if row["table_name"] == f"dbo.{table}"]
            assert fresh["finalized_until"] == row["finalized_until"].isoformat(
                timespec="milliseconds"
            ), (fresh, row)
            # The seed's clock is in 2026-03; now is later.
            assert fresh["age_seconds"] > 0 and 0 <= fresh["seconds_since_update"] < 600, fresh
        # A name without a control row is an error, not a verdict not yet given.
        control = ["--control", str(lake / "control"), "--table", "dbo.no_such_table"]
        absent = subprocess.run(
            [writer_binary(), "freshness", *control], capture_output=True, text=True
        )
        assert absent.returncode == 1 and "has no row for dbo.no_such_table" in absent.stderr
        # lines' purge was healed: one data_loss row, a re-snapshot completed at its S.
        facts = DeltaTable(str(lake / "facts")).to_pyarrow_table().to_pylist()
        losses = [row for row in facts if row["event"] == "data_loss"]
        assert [row["app_id"] for row in losses] == ["lines"], losses
        healed = [row["min_lsn"] for row in facts if row["event"] == "resnapshot"]
        assert healed == [losses[0]["max_lsn"]], facts
    finally:
        stop_server(process)


def test_a_commit_at_a_new_instances_start_follows_a_snapshot_taken_before_it(tmp_path):
    """The seed's model puts an instance's first commit exactly at its start LSN: a snapshot
    taken before that commit is stamped just below the start, so the stream reads the commit
    (a stamp at the start itself would skip it, as `snapshot_lsn` once did)."""
    path, lake = tmp_path / "seed", tmp_path / "lake"
    workload = SeedWorkload(path, seed=57)
    process, url = start_server(path, scheme="seed-fake")
    flags = [
        "--server", url, "--table", "dbo.orders", "--target", str(lake / "bronze"),
        "--facts", str(lake / "facts"), "--control", str(lake / "control"),
        "--checkpoint", str(tmp_path / "checkpoint"), "--app-id", "orders", "--available-now",
        "--bootstrap", "full",
    ]  # fmt: skip
    try:
        writer("run", *flags)
        start = FakeCdcClient(str(path)).min_lsn("orders")
        first = workload.db.commit("orders", [(2, workload._order(1))], workload._at())
        assert first == start, "the instance's first commit is at its start"
        # The same command again: no batch was written, so it finds its snapshot and streams
        # from that snapshot's stamp.
        writer("run", *flags)
    finally:
        stop_server(process)
    bronze = DeltaTable(str(lake / "bronze")).to_pyarrow_table().to_pylist()
    assert [(row["_start_lsn"], row["_operation"], row["id"]) for row in bronze] == [(first, 2, 1)]
