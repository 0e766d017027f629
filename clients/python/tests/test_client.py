"""The installable client (``mssql_cdc_flight``) against the real server binary: checked reads
equal the simulator's journal, a stream cut mid-way is never a short table, every error code
is its typed exception with the server's fields, and TLS."""

import socket
import subprocess
import threading
import time

import pyarrow.flight as flight
import pytest
from conftest import change_rows, journal_rows, run, start_server, stop_server, workload_database

import mssql_cdc_flight as cdc


def test_a_checked_read_is_three_lines_and_equals_the_journal(server, database):
    _, journal = database
    client = cdc.connect(server)
    start = client.initial_offset("dbo.orders")
    changes = client.read_changes("dbo.orders", start, partitions=3, min_partition_rows=50)
    assert change_rows(changes) == journal_rows(journal, "dbo.orders")
    assert changes.schema.names[:6] == [
        "_capture_instance",
        "_start_lsn",
        "_seqval",
        "_operation",
        "_command_id",
        "_commit_ts",
    ]
    assert "dbo.orders" in client.tables()
    assert client.capture_instances("dbo.orders")[0]["name"] == "dbo_orders"


def test_offsets_step_through_a_range_in_the_seeds_json_form(server, database):
    _, journal = database
    client = cdc.connect(server)
    offset = client.initial_offset("dbo.orders")
    assert cdc.Offset.from_json(offset.to_json()) == offset
    seen = []
    while True:
        end = client.latest_offset(offset, max_commits=50)
        if end == offset:
            break
        seen.extend(change_rows(client.read_changes("dbo.orders", offset, end, partitions=2)))
        offset = end
    assert sorted(seen) == journal_rows(journal, "dbo.orders")


def test_a_snapshot_read_is_checked_too(server):
    client = cdc.connect(server)
    snapshot = client.read_snapshot("dbo.orders", partitions=2)
    assert snapshot.num_rows > 0
    assert set(snapshot.column("_operation").to_pylist()) == {0}
    assert "_chunk" in snapshot.schema.names


def test_columns_left_out_are_not_served(server, database):
    """``except_columns`` (matched ignoring case) leaves columns out of the plan's schema and
    of every batch, read by the client and by pyarrow's stock Flight reader alike."""
    client = cdc.connect(server)
    snapshot = client.read_snapshot("dbo.orders", except_columns=["NOTE", "amount"])
    assert "note" not in snapshot.schema.names and "amount" not in snapshot.schema.names
    assert "order_id" in snapshot.schema.names and snapshot.num_rows > 0
    start = client.initial_offset("dbo.orders", "earliest")
    plan = client.plan_changes("dbo.orders", start, except_columns=["note"])
    stock = flight.connect(server)
    for endpoint in plan.endpoints:
        table = stock.do_get(flight.Ticket(endpoint.ticket)).read_all()
        assert "note" not in table.schema.names and "amount" in table.schema.names
    with pytest.raises(cdc.InvalidRequestError, match="not both"):
        client.plan_snapshot("dbo.orders", columns=["order_id"], except_columns=["note"])


def test_a_column_left_out_is_not_in_the_bytes_on_the_wire(server):
    """The note values of the table are in the bytes a full read receives (so the check can
    fail), and in none of the bytes a read leaving the column out receives."""
    notes = cdc.connect(server).read_snapshot("dbo.orders").column("note").to_pylist()
    values = [note.encode() for note in notes if note and len(note) >= 8]
    assert values, "the workload wrote notes"

    def received(**options) -> bytes:
        proxy = CuttingProxy(server, 1 << 40)
        try:
            cdc.connect(proxy.url).read_snapshot("dbo.orders", **options)
            return bytes(proxy.received)
        finally:
            proxy.listener.close()

    everything = received()
    assert any(value in everything for value in values)
    without = received(except_columns=["note"])
    assert len(without) > 0 and not [value for value in values if value in without]


class CuttingProxy:
    """A TCP proxy that closes the connection after `limit` bytes from the server: a network
    that breaks in the middle of a stream. ``received`` keeps every byte the server sent."""

    def __init__(self, upstream: str, limit: int) -> None:
        host, port = upstream.removeprefix("grpc://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.limit = limit
        self.received = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"grpc://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(server, client, self.limit, self.received), daemon=True
            ).start()

    @staticmethod
    def _pump(source, target, limit, record=None) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if record is not None:
                    record.extend(data)
                if limit is not None and sent + len(data) > limit:
                    target.sendall(data[: limit - sent])
                    break
                target.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for end in (source, target):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()


def test_a_stream_cut_mid_way_is_incomplete_never_a_short_table(server):
    client = cdc.connect(server)
    start = client.initial_offset("dbo.orders")
    plan = client.plan_changes("dbo.orders", start, batch_rows=20)
    assert plan.total_records > 500
    cut = cdc.connect(CuttingProxy(server, limit=40_000).url)
    with pytest.raises(cdc.IncompleteStreamError) as raised:
        cut.read_endpoint(plan.endpoints[0])
    assert raised.value.rows < plan.total_records
    # The same endpoint through a whole connection is read whole.
    assert client.read_endpoint(plan.endpoints[0]).num_rows == plan.total_records


def test_each_error_code_is_its_exception_with_the_servers_fields(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "200", "--seed", "5", "--clock", "virtual")
    process, url = start_server(directory, "--max-streams", "0", "--ticket-hours", "0.001")
    try:
        client = cdc.connect(url)
        with pytest.raises(cdc.NotFoundError) as raised:
            client.initial_offset("dbo.nope")
        assert raised.value.reason == "TABLE_NOT_FOUND"
        assert raised.value.fields == {"table": "dbo.nope"}
        with pytest.raises(cdc.InvalidRequestError, match="partitons"):
            client.plan_changes("dbo.orders", client.initial_offset("dbo.orders"), partitons=2)
        start = client.initial_offset("dbo.orders")
        plan = client.plan_changes("dbo.orders", start)
        with pytest.raises(cdc.ServerBusyError) as busy:
            client.read_endpoint(plan.endpoints[0])
        assert busy.value.retry_after == 2
        forged = cdc.Endpoint(ticket=plan.endpoints[0].ticket[:-1] + b"\0")
        with pytest.raises(cdc.PermissionDeniedError) as denied:
            client.read_endpoint(forged)
        assert denied.value.reason == "TICKET_FORGED"
        time.sleep(4)  # the tickets live 3.6 s
        with pytest.raises(cdc.TicketExpiredError):
            client.read_endpoint(plan.endpoints[0])
        # Cleanup passes the stream's start: the plan is data loss, with the LSNs to act on.
        end = client.latest_offset(start)
        run("sim", "cleanup", str(directory), "--low-water-mark", end.lsn)
        with pytest.raises(cdc.DataLossError) as lost:
            client.plan_changes("dbo.orders", start)
        assert lost.value.reason == "CHANGES_PURGED"
        assert lost.value.fields["capture_instance"] == "dbo_orders"
        assert lost.value.fields["min_lsn"] > start.lsn
    finally:
        stop_server(process)


def test_tls_with_the_servers_ca(tmp_path, database):
    directory, _ = database
    certificate, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(certificate),
        ],
        check=True,
        capture_output=True,
    )
    process, url = start_server(directory, "--tls-cert", str(certificate), "--tls-key", str(key))
    try:
        port = url.rsplit(":", 1)[1]
        client = cdc.connect(f"grpc+tls://localhost:{port}", tls_ca=str(certificate))
        assert "dbo.orders" in client.tables()
        untrusting = cdc.connect(f"grpc+tls://localhost:{port}")
        with pytest.raises(cdc.CdcFlightError):
            untrusting.tables()
    finally:
        stop_server(process)


def test_the_live_tail_wakes_on_a_commit_and_times_out_on_a_quiet_database(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "5", "--seed", "4", "--clock", "virtual")
    process, url = start_server(directory)
    try:
        client = cdc.connect(url)
        latest = client.latest_offset(client.initial_offset("dbo.orders"))
        assert client.wait_for_commits(latest, timeout=0.3) is False
        committer = threading.Timer(
            0.5, run, ("sim", "run", str(directory), "--commits", "2", "--seed", "5")
        )
        committer.start()
        started = time.monotonic()
        assert client.wait_for_commits(latest, timeout=30) is True
        assert time.monotonic() - started < 30
        committer.join()
        assert client.latest_offset(latest).lsn > latest.lsn
        with pytest.raises(ValueError):
            client.wait_for_commits(latest, timeout=61)
    finally:
        stop_server(process)


def test_a_wait_on_named_tables_ends_only_for_their_changes(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "5", "--seed", "6", "--clock", "virtual")
    process, url = start_server(directory)
    try:
        client = cdc.connect(url)
        latest = client.latest_offset(client.initial_offset("dbo.orders"))
        lsn, changed = client.wait_for_tables(latest, ["dbo.orders", "dbo.customers"], 0.3)
        assert (lsn, changed) == (latest.lsn, [])
        # The workload commits to both tables: the wait names what changed, in the
        # order asked, checked through a later LSN.
        committer = threading.Timer(
            0.5, run, ("sim", "run", str(directory), "--commits", "20", "--seed", "7")
        )
        committer.start()
        lsn, changed = client.wait_for_tables(latest, ["dbo.customers", "dbo.orders"], 30)
        committer.join()
        assert changed and set(changed) <= {"dbo.customers", "dbo.orders"}
        assert changed == sorted(changed, key=["dbo.customers", "dbo.orders"].index)
        assert lsn > latest.lsn
        with pytest.raises(ValueError):
            client.wait_for_tables(latest, [], 1)
        # A table CDC does not track never changes: the wait times out.
        assert client.wait_for_tables(lsn, ["dbo.nowhere"], 0.3) == (lsn, [])
    finally:
        stop_server(process)
