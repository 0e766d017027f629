"""Authentication and per-table authorization seen from pyarrow, against the real server binary.

Two principals in a tokens file: `writer` reads every table, `analyst` only dbo.customers.
"""

import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import threading
import time

import adbc_driver_flightsql.dbapi as adbc
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from conftest import (
    ROOT,
    binary,
    free_port,
    run,
    sha256,
    start_server,
    stop_server,
    tokens_file,
)
from test_pyarrow_flight import action, read_endpoint

WRITER_TOKEN = "writer-token-0123456789"
ANALYST_TOKEN = "analyst-token-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secured") / "db"
    run("sim", "init", str(directory), "--customers", "20", "--orders", "50")
    tokens = tokens_file(
        directory.parent / "tokens.json",
        {"writer": (["*"], WRITER_TOKEN), "analyst": (["dbo.cust*"], ANALYST_TOKEN)},
    )
    process, url = start_server(directory, "--tokens-file", str(tokens))
    yield url
    stop_server(process)


#: A server's environment that logs at INFO, for the tests that read its log.
LOGGING_INFO = {"PATH": "/usr/bin:/bin", "RUST_LOG": "info"}


def bearer(token: str) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])


def test_no_token_and_a_wrong_token_are_unauthenticated(secured):
    client = flight.FlightClient(secured)
    with pytest.raises(flight.FlightUnauthenticatedError, match="credentials"):
        list(client.list_flights())
    with pytest.raises(flight.FlightUnauthenticatedError, match="not known"):
        list(client.list_flights(options=bearer("a-long-but-wrong-token-0123")))


def test_an_empty_or_short_token_is_refused_before_any_lookup(secured):
    """The attack of an unset `$TOKEN`: `authorization: Bearer ` with nothing after it, or a
    guessable short word, is refused whatever the tokens file holds."""
    client = flight.FlightClient(secured)
    for token, said in [("", "empty"), ("guess", "too short"), (WRITER_TOKEN[:15], "too short")]:
        with pytest.raises(flight.FlightUnauthenticatedError, match=said):
            list(client.list_flights(options=bearer(token)))
    with pytest.raises(flight.FlightUnauthenticatedError, match="too short"):
        client.authenticate_basic_token("writer", "short")


@pytest.mark.parametrize(
    "principals, said",
    [
        ([{"name": "a", "tables": ["*"], "token_sha256": sha256("")}], "the empty string"),
        ([{"name": "a", "tables": ["*"], "token_sha256": sha256("test")}], "well-known token"),
        (
            [
                {"name": "a", "tables": ["*"], "token_sha256": sha256(WRITER_TOKEN)},
                {"name": "b", "tables": ["dbo.orders"], "token_sha256": sha256(WRITER_TOKEN)},
            ],
            "principals 'a' and 'b' share",
        ),
    ],
)
def test_a_tokens_file_with_a_weak_or_shared_credential_does_not_start(tmp_path, principals, said):
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"principals": principals}))
    done = subprocess.run(
        [binary(), "serve", "--source", f"sim:{directory}", "--listen", "127.0.0.1:0"]
        + ["--tokens-file", str(tokens)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stdout
    assert said in done.stderr, done.stderr


def test_a_principal_sees_and_reads_only_its_tables(secured):
    client = flight.FlightClient(secured)
    analyst = bearer(ANALYST_TOKEN)
    tables = [
        json.loads(info.descriptor.command)["table"]
        for info in client.list_flights(options=analyst)
    ]
    assert tables == ["dbo.customers"]
    with pytest.raises(flight.FlightUnauthorizedError, match="may not read table 'dbo.orders'"):
        command = {"type": "changes", "table": "dbo.orders", "from": "0x00"}
        client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)), analyst)
    with pytest.raises(flight.FlightUnauthorizedError):
        list(client.do_action(flight.Action("initial_offset", b'{"table": "dbo.orders"}'), analyst))
    # A ticket of dbo.orders planned by the writer is refused to the analyst at redemption.
    writer = bearer(WRITER_TOKEN)
    start = json.loads(
        list(client.do_action(flight.Action("initial_offset", b'{"table": "dbo.orders"}'), writer))[
            0
        ].body.to_pybytes()
    )
    command = {"type": "changes", "table": "dbo.orders", "from": start["lsn"]}
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)), writer)
    batches, marker = read_endpoint(client, info.endpoints[0], writer)
    assert marker is not None and marker["rows"] == sum(b.num_rows for b in batches) > 0
    with pytest.raises(flight.FlightUnauthorizedError, match="analyst"):
        client.do_get(info.endpoints[0].ticket, analyst).read_all()


def test_basic_credentials_are_traded_for_a_bearer_token(secured):
    client = flight.FlightClient(secured)
    header = client.authenticate_basic_token("analyst", ANALYST_TOKEN)
    options = flight.FlightCallOptions(headers=[header])
    tables = [
        json.loads(info.descriptor.command)["table"]
        for info in client.list_flights(options=options)
    ]
    assert tables == ["dbo.customers"]
    with pytest.raises(flight.FlightUnauthenticatedError):
        flight.FlightClient(secured).authenticate_basic_token("writer", ANALYST_TOKEN)


def test_a_non_loopback_listen_without_authentication_is_refused(tmp_path):
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "0")
    done = subprocess.run(
        [binary(), "serve", "--source", f"sim:{directory}", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--insecure-no-auth" in done.stderr and "--tokens-file" in done.stderr


def the_recipes_certificate(directory):
    """Runs docs/security.md's certificate recipe in `directory`: its secrets/ (tls.crt,
    tls.key, ca.crt)."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index("## TLS by default") :]
    recipe = re.search(r"```sh\n(.*?)```", section, flags=re.DOTALL).group(1)
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", recipe],
        cwd=directory,
        check=True,
        capture_output=True,
    )
    return directory / "secrets"


def serve_everywhere(directory, *flags: str):
    """`serve` on 0.0.0.0 (a port of its choosing) with `flags`: the process and its port,
    or the finished process when it refused to start."""
    process = subprocess.Popen(
        [binary(), "serve", "--source", f"sim:{directory}", "--listen", "0.0.0.0:0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.wait(timeout=60)
        return process, None
    return process, line.split()[-1].rsplit(":", 1)[1]


def test_a_non_loopback_listen_without_tls_is_refused_unless_insecure_is_said(tmp_path):
    """Attack: read tokens and rows off the wire of a server that serves h2c to the network."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    tokens = tokens_file(tmp_path / "tokens.json", {"writer": (["*"], WRITER_TOKEN)})
    refused, port = serve_everywhere(directory, "--tokens-file", str(tokens))
    assert port is None and refused.returncode != 0
    stderr = refused.stderr.read()
    assert "without TLS" in stderr and "--insecure-no-tls" in stderr, stderr
    # Said out loud, it serves, and says so on every start.
    process, port = serve_everywhere(directory, "--tokens-file", str(tokens), "--insecure-no-tls")
    try:
        assert port is not None
        client = flight.FlightClient(f"grpc://127.0.0.1:{port}")
        assert list(client.list_flights(options=bearer(WRITER_TOKEN)))
    finally:
        process.terminate()
        stderr = process.stderr.read()
        process.wait(timeout=30)
    assert "cleartext" in stderr, stderr


def test_the_images_way_tls_off_loopback_and_its_health_check(tmp_path):
    """The image's settings: 0.0.0.0 with tokens and TLS from docs/security.md's recipe; its
    HEALTHCHECK (`health` with the image's environment) asks https://localhost trusting the
    recipe's CA, and gets SERVING; a client of the CA reads."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    tokens = tokens_file(tmp_path / "tokens.json", {"writer": (["*"], WRITER_TOKEN)})
    secrets = the_recipes_certificate(tmp_path)
    process, port = serve_everywhere(
        directory,
        "--tokens-file",
        str(tokens),
        "--tls-cert",
        str(secrets / "tls.crt"),
        "--tls-key",
        str(secrets / "tls.key"),
    )
    try:
        assert port is not None, process.stderr.read()
        environment = {
            "PATH": "/usr/bin:/bin",
            "MSSQL_CDC_FLIGHT_URL": f"https://localhost:{port}",
            "MSSQL_CDC_FLIGHT_TLS_CA": str(secrets / "ca.crt"),
        }
        health = subprocess.run(
            [binary(), "health"], env=environment, capture_output=True, text=True, timeout=60
        )
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health
        client = flight.FlightClient(
            f"grpc+tls://localhost:{port}", tls_root_certs=(secrets / "ca.crt").read_bytes()
        )
        assert list(client.list_flights(options=bearer(WRITER_TOKEN)))
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_client_refuses_to_send_a_token_in_cleartext_off_loopback(monkeypatch):
    """Attack: a client pointed at grpc://host would hand its token to anyone on the path."""
    import mssql_cdc_flight

    for url in ["grpc://flight.example.com:50051", "grpc://10.1.2.3:50051"]:
        with pytest.raises(ValueError, match="cleartext"):
            mssql_cdc_flight.connect(url, token=WRITER_TOKEN)
    # Loopback, TLS, or no token at all are fine; so is the explicit override.
    mssql_cdc_flight.connect("grpc://127.0.0.1:50051", token=WRITER_TOKEN).close()
    mssql_cdc_flight.connect("grpc://flight.example.com:50051").close()
    mssql_cdc_flight.connect("grpc+tls://flight.example.com:50051", token=WRITER_TOKEN).close()
    monkeypatch.setenv("MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN", "1")
    mssql_cdc_flight.connect("grpc://flight.example.com:50051", token=WRITER_TOKEN).close()


def test_a_flood_of_wrong_tokens_is_logged_once_per_peer_and_refused_every_time(tmp_path):
    """Attack: guess tokens as fast as possible. Every guess is UNAUTHENTICATED; the log
    holds one INFO line for the peer (with how many it suppressed later), not one a guess."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    tokens = tokens_file(tmp_path / "tokens.json", {"writer": (["*"], WRITER_TOKEN)})
    process, url = start_server(
        directory, "--tokens-file", str(tokens), stderr=subprocess.PIPE, env=LOGGING_INFO
    )
    try:
        client = flight.FlightClient(url)
        for guess in range(50):
            with pytest.raises(flight.FlightUnauthenticatedError):
                list(client.list_flights(options=bearer(f"guessed-token-{guess:012d}")))
        assert list(client.list_flights(options=bearer(WRITER_TOKEN)))
    finally:
        process.terminate()
        stderr = process.stderr.read()
        process.wait(timeout=30)
    refusals = [line for line in stderr.splitlines() if "authentication refused" in line]
    assert len(refusals) == 1, refusals
    assert "127.0.0.1" in refusals[0] and "not known" in refusals[0], refusals[0]
    assert WRITER_TOKEN not in stderr and "guessed-token" not in stderr


def test_a_revoked_token_is_refused_after_sighup_and_a_bad_file_changes_nothing(tmp_path):
    """Revocation without a restart: the tokens file read again on SIGHUP."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    tokens = tokens_file(tmp_path / "tokens.json", {"writer": (["*"], WRITER_TOKEN)})
    process, url = start_server(
        directory, "--tokens-file", str(tokens), stderr=subprocess.PIPE, env=LOGGING_INFO
    )

    def reads(token: str) -> bool:
        try:
            return bool(list(client.list_flights(options=bearer(token))))
        except flight.FlightUnauthenticatedError:
            return False

    def hang_up_until(check) -> None:
        process.send_signal(signal.SIGHUP)
        for _ in range(100):
            if check():
                return
            time.sleep(0.05)
        raise AssertionError("the tokens file was not read again")

    try:
        client = flight.FlightClient(url)
        assert reads(WRITER_TOKEN) and not reads(ANALYST_TOKEN)
        # The writer's token revoked, the analyst's added.
        tokens_file(tokens, {"analyst": (["*"], ANALYST_TOKEN)})
        hang_up_until(lambda: reads(ANALYST_TOKEN))
        assert not reads(WRITER_TOKEN)
        # A file that fails the start checks (a weak hash) is not taken.
        tokens.write_text(
            json.dumps({"principals": [{"name": "a", "tables": ["*"], "token_sha256": sha256("")}]})
        )
        process.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert reads(ANALYST_TOKEN)
    finally:
        process.terminate()
        stderr = process.stderr.read()
        process.wait(timeout=30)
    assert "tokens file read again" in stderr and "not read again" in stderr, stderr


def test_a_secret_file_others_may_read_is_warned_about(tmp_path):
    """Operator mistake: a ticket key or source file readable by every user of the host, or
    by its group (also the server's own group, unless the file is root's, as Kubernetes
    mounts secrets `root:<fsGroup>` 0440 for a pod running with that group: not tested here,
    it needs root to make)."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    key = tmp_path / "ticket.key"
    key.write_text("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n")
    assert key.stat().st_gid == os.getegid(), "created with the test's own group"
    logs = []
    for mode in (0o644, 0o600, 0o640):
        key.chmod(mode)
        process, _ = start_server(
            directory, "--ticket-key-file", str(key), stderr=subprocess.PIPE, env=LOGGING_INFO
        )
        process.terminate()
        logs.append(process.stderr.read())
        process.wait(timeout=30)
    exposed, private, own_group = logs
    assert "ticket key file may be read by its group or others" in exposed, exposed
    assert "0644" in exposed
    assert "may be read by its group or others" not in private, private
    assert "may be read by its group or others" in own_group, "not root's: warned about"


def test_a_caller_without_credentials_is_refused_before_its_request_is_read(secured):
    """Attack: flood the server with large requests and no credentials. A 2 MiB ticket
    without a token is refused on its headers (UNAUTHENTICATED), not read up to the 1 MiB
    bound first (which answers OUT_OF_RANGE, as it does for a caller with a token)."""
    client = flight.FlightClient(secured)
    oversized = flight.Ticket(b"x" * (2 << 20))
    with pytest.raises(flight.FlightUnauthenticatedError, match="credentials"):
        client.do_get(oversized).read_all()
    with pytest.raises(flight.FlightUnauthenticatedError, match="credentials"):
        list(client.do_action(flight.Action("max_lsn", b"x" * (2 << 20))))
    with pytest.raises(pa.ArrowException) as read:
        client.do_get(oversized, bearer(WRITER_TOKEN)).read_all()
    assert not isinstance(read.value, flight.FlightUnauthenticatedError), read.value


def test_oversized_and_malformed_messages_of_a_valid_principal_are_refused(secured):
    """Attack with a valid token: messages over the size bound, tickets that are not ours
    (garbage, a signed one with a byte changed), commands that are not JSON or name nothing
    served, and unknown actions. Each is refused with a reason, and the server serves the
    same principal right after."""
    client = flight.FlightClient(secured)
    writer = bearer(WRITER_TOKEN)
    with pytest.raises(pa.ArrowException, match="(?i)message|larger|length|size"):
        list(client.do_action(flight.Action("max_lsn", b"x" * (2 << 20)), writer))
    for ticket in (b"", b"\x00" * 64, b"not a ticket at all", bytes(range(256)) * 8):
        with pytest.raises(pa.ArrowException, match="(?i)ticket") as refused:
            client.do_get(flight.Ticket(ticket), writer).read_all()
        assert not isinstance(refused.value, flight.FlightInternalError), refused.value
    start = action_as(client, writer, "initial_offset", {"table": "dbo.orders"})
    command = {"type": "changes", "table": "dbo.orders", "from": start["lsn"]}
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)), writer)
    forged = bytearray(info.endpoints[0].ticket.ticket)
    forged[len(forged) // 2] ^= 0x01
    with pytest.raises(pa.ArrowException, match="(?i)ticket") as refused:
        client.do_get(flight.Ticket(bytes(forged)), writer).read_all()
    assert not isinstance(refused.value, flight.FlightInternalError), refused.value
    for body in (
        b"{not json",
        b"[]",
        b'{"type": "changes"}',
        b'{"type": "drop", "table": "dbo.orders"}',
    ):
        with pytest.raises(pa.ArrowInvalid):
            client.get_flight_info(flight.FlightDescriptor.for_command(body), writer)
    with pytest.raises(pa.ArrowInvalid, match="unknown action"):
        action_as(client, writer, "shutdown", {})
    with pytest.raises(pa.ArrowInvalid):
        list(client.do_action(flight.Action("max_lsn", b"\xff\xfe not json"), writer))
    batches, marker = read_endpoint(client, info.endpoints[0], writer)
    assert marker is not None and marker["rows"] == sum(b.num_rows for b in batches)


def test_the_unauthenticated_server_still_answers_actions_on_loopback(tmp_path):
    # Loopback without a tokens file is the developer's default: everyone is anonymous.
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "3")
    process, url = start_server(directory)
    try:
        assert action(flight.FlightClient(url), "max_lsn", {})["lsn"].startswith("0x")
    finally:
        stop_server(process)


def test_a_reader_that_stops_reading_is_cut_and_its_read_released(tmp_path):
    """The starvation attack: redeem a ticket of small batches, read one, and never read
    again, so the stream would hold its source read (and, on SQL Server, a pooled connection)
    for ever. Past the server's stall timeout the stream ends with DEADLINE_EXCEEDED, and
    the server goes on serving others meanwhile."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "100000")
    process, url = start_server(directory, "--stall-timeout", "1")
    try:
        client = flight.FlightClient(url)
        command = {"type": "snapshot", "table": "dbo.orders", "batch_rows": 20}
        info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
        [endpoint] = info.endpoints
        stalled = client.do_get(endpoint.ticket)
        stalled.read_chunk()
        # Another caller is served while the first one holds its stream unread.
        assert action(client, "max_lsn", {})["lsn"].startswith("0x")
        time.sleep(4)
        with pytest.raises(flight.FlightError, match="took no batch"):
            while True:
                stalled.read_chunk()
        # A reader that keeps reading is never cut: the same plan, read whole.
        batches, marker = read_endpoint(client, endpoint)
        assert marker is not None and marker["rows"] == 100_000
    finally:
        stop_server(process)


def test_a_principal_looping_planning_calls_is_bounded(tmp_path):
    """One principal's planning calls at once are bounded (here to 1): while its long
    `wait_for_commits` runs, its next call is refused with a retry hint, another
    principal's is served, and once the first returns the principal is served again."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "3")
    tokens = writer_and_analyst(tmp_path)
    process, url = start_server(
        directory, "--tokens-file", str(tokens), "--max-calls-per-principal", "1"
    )
    try:
        client = flight.FlightClient(url)
        writer, analyst = bearer(WRITER_TOKEN), bearer(ANALYST_TOKEN)
        now = action_as(client, writer, "max_lsn", {})["lsn"]
        waiting = threading.Thread(
            target=action_as,
            args=(client, writer, "wait_for_commits", {"after": now, "timeout_ms": 3000}),
        )
        waiting.start()
        time.sleep(1)
        # pyarrow raises RESOURCE_EXHAUSTED as ArrowInvalid.
        with pytest.raises(pa.ArrowInvalid, match="1 planning calls running"):
            action_as(client, writer, "max_lsn", {})
        assert action_as(client, analyst, "max_lsn", {})["lsn"] == now
        waiting.join()
        assert action_as(client, writer, "max_lsn", {})["lsn"] == now
    finally:
        stop_server(process)


def test_one_principal_cannot_hold_every_source_connection(tmp_path):
    """The starvation attack with the pool's share: a principal redeems tickets of small
    batches and never reads them. It holds at most its share of the source's reads (here 2,
    as `--source-share 2` sets; on SQL Server the default is the pool less one): its third
    stream and its planning calls wait for its share, and are refused with a retry hint when
    none frees up in time (here the call deadline, 1 s), while another principal
    streams and plans as before. The stall timeout then ends its reads and gives the share
    back."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "100000")
    tokens = writer_and_analyst(tmp_path)
    process, url = start_server(
        directory,
        "--tokens-file",
        str(tokens),
        "--source-share",
        "2",
        "--stall-timeout",
        "6",
        "--call-timeout",
        "1",
    )
    try:
        client = flight.FlightClient(url)
        writer, analyst = bearer(WRITER_TOKEN), bearer(ANALYST_TOKEN)
        command = {"type": "snapshot", "table": "dbo.orders", "batch_rows": 20}
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command))
        [endpoint] = client.get_flight_info(descriptor, analyst).endpoints
        held = [client.do_get(endpoint.ticket, writer) for _ in range(2)]
        for stream in held:
            stream.read_chunk()
        # pyarrow raises RESOURCE_EXHAUSTED as ArrowInvalid.
        with pytest.raises(pa.ArrowInvalid, match="2 source reads at once.*none ended within 1 s"):
            client.do_get(endpoint.ticket, writer).read_chunk()
        with pytest.raises(pa.ArrowInvalid, match="2 source reads at once"):
            action_as(client, writer, "max_lsn", {})
        # The other principal is served whole meanwhile: planned and read.
        assert action_as(client, analyst, "max_lsn", {})["lsn"].startswith("0x")
        batches, marker = read_endpoint(client, endpoint, analyst)
        assert marker is not None and marker["rows"] == 100_000
        # Past the stall timeout the held reads end and the share is the writer's again.
        time.sleep(8)
        for stream in held:
            with pytest.raises(flight.FlightError, match="took no batch"):
                while True:
                    stream.read_chunk()
        assert action_as(client, writer, "max_lsn", {})["lsn"].startswith("0x")
        batches, marker = read_endpoint(client, endpoint, writer)
        assert marker is not None and marker["rows"] == 100_000
    finally:
        stop_server(process)


def test_connections_that_never_authenticate_are_closed_and_bounded(tmp_path):
    """Slowloris: connections that open and never present credentials (silent, or a
    request without a token) are closed at `--unauthenticated-timeout`, so they cannot keep
    the places of a peer or of the server for ever; past `--max-connections` one more is
    closed as it is accepted. A client whose call was admitted keeps its idle connection."""
    import socket

    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "1", "--orders", "1")
    tokens = tokens_file(tmp_path / "tokens.json", {"writer": (["*"], WRITER_TOKEN)})
    process, url = start_server(
        directory,
        "--tokens-file",
        str(tokens),
        "--unauthenticated-timeout",
        "3",
        "--max-connections",
        "3",
    )
    host, port = url.removeprefix("grpc://").rsplit(":", 1)
    try:
        admitted = flight.FlightClient(url)
        assert action_as(admitted, bearer(WRITER_TOKEN), "max_lsn", {})["lsn"].startswith("0x")
        silent = socket.create_connection((host, int(port)))
        refused = flight.FlightClient(url)
        with pytest.raises(flight.FlightUnauthenticatedError):
            action(refused, "max_lsn", {})
        # Three open: a fourth is closed at once, before a byte is read.
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(5)
        assert extra.recv(1) == b"", "past --max-connections a connection is closed"
        silent.settimeout(10)
        started = time.monotonic()
        assert silent.recv(64) != b"", "served: the server's HTTP/2 settings come first"
        while silent.recv(1024 * 1024) != b"":
            pass
        assert time.monotonic() - started < 8, "closed at its deadline"
        time.sleep(1.5)
        # The refused client's connection is closed too, and the admitted client's, idle past
        # the deadline, is not: of the three places, two are free again (a new connection
        # reads the server's settings) and the third is still the admitted client's (one
        # more is closed as it is accepted).
        fresh = [socket.create_connection((host, int(port))) for _ in range(3)]
        for connection in fresh:
            connection.settimeout(5)
        assert fresh[0].recv(64) != b"" and fresh[1].recv(64) != b"", "two places freed"
        assert fresh[2].recv(64) == b"", "the admitted connection still holds its place"
        for connection in fresh:
            connection.close()
        assert action_as(admitted, bearer(WRITER_TOKEN), "max_lsn", {})["lsn"].startswith("0x")
    finally:
        stop_server(process)


def writer_and_analyst(directory):
    """A tokens file of two principals that read every table."""
    principals = {"writer": (["*"], WRITER_TOKEN), "analyst": (["*"], ANALYST_TOKEN)}
    return tokens_file(directory / "tokens.json", principals)


def action_as(client, options, name, body):
    results = list(client.do_action(flight.Action(name, json.dumps(body).encode()), options))
    return json.loads(results[0].body.to_pybytes())


def test_a_masked_column_never_reaches_a_pyarrow_client_or_the_log(tmp_path):
    """The server's masks file hashes dbo.customers.email for every caller but `writer`,
    whose clear grant names the table: `analyst` reads keyed HMACs (the same for equal
    values, as Python's own hmac computes them), cannot redeem the writer's clear ticket,
    and the server's debug log holds no clear address."""
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "30", "--orders", "0")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "principals": [
                    {
                        "name": "writer",
                        "tables": ["*"],
                        "clear": ["dbo.customers"],
                        "token_sha256": sha256(WRITER_TOKEN),
                    },
                    {"name": "analyst", "tables": ["*"], "token_sha256": sha256(ANALYST_TOKEN)},
                ]
            }
        )
    )
    key = b"the pytest hash key of the masks, 32+ bytes"
    (tmp_path / "mask.key").write_bytes(key + b"\n")
    masks = tmp_path / "masks.json"
    masks.write_text(
        json.dumps({"hash_key_file": "mask.key", "tables": {"dbo.customers": {"email": "hash"}}})
    )
    env = {"PATH": "/usr/bin:/bin", "RUST_LOG": "debug"}
    process, url = start_server(
        directory,
        "--tokens-file",
        str(tokens),
        "--masks",
        str(masks),
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        client = flight.FlightClient(url)
        command = json.dumps({"type": "snapshot", "table": "dbo.customers"})

        def read_as(token):
            options = bearer(token)
            info = client.get_flight_info(flight.FlightDescriptor.for_command(command), options)
            [endpoint] = info.endpoints
            batches, marker = read_endpoint(client, endpoint, options)
            assert marker is not None
            return pa.Table.from_batches(batches), endpoint

        clear, clear_endpoint = read_as(WRITER_TOKEN)
        masked, _ = read_as(ANALYST_TOKEN)
        emails = [email for email in clear.column("email").to_pylist() if email is not None]
        assert len(emails) > 5
        expected = [
            None if email is None else hmac.new(key, email.encode(), hashlib.sha256).hexdigest()
            for email in clear.column("email").to_pylist()
        ]
        assert masked.column("email").to_pylist() == expected
        field = masked.schema.field("email")
        assert field.metadata[b"mssql_cdc.mask"] == b"hash"
        assert b"mssql_cdc.mask" not in (clear.schema.field("email").metadata or {})
        with pytest.raises(pa.ArrowInvalid, match="precondition failed.*masks"):
            read_endpoint(client, clear_endpoint, bearer(ANALYST_TOKEN))
        # Flight SQL plans through the same masks (the ADBC driver, as a SQL tool reads).
        options = {"adbc.flight.sql.authorization_header": f"Bearer {ANALYST_TOKEN}"}
        with (
            adbc.connect(url, db_kwargs=options, autocommit=True) as connection,
            connection.cursor() as cursor,
        ):
            cursor.execute("SELECT * FROM dbo.customers")
            sql_rows = cursor.fetch_arrow_table()
        by_key = dict(zip(clear.column("customer_id").to_pylist(), expected, strict=True))
        assert (
            dict(
                zip(
                    sql_rows.column("customer_id").to_pylist(),
                    sql_rows.column("email").to_pylist(),
                    strict=True,
                )
            )
            == by_key
        )
    finally:
        process.terminate()
        log = process.communicate(timeout=30)[1]
    assert "serving masked columns" in log
    leaked = [email for email in emails if email in log]
    assert not leaked, f"clear values in the server's log: {leaked[:3]}"
    assert key.decode() not in log


def test_silent_connections_to_the_metrics_page_hold_only_their_peers_places(tmp_path):
    """Slowloris on `--metrics-listen`: connections that never send a request take at most
    the pages' 32 places of their peer (one more is closed unanswered) and are closed at the
    pages' 10 s header timeout; once one leaves, a scrape is answered again."""
    import socket
    import urllib.request

    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "1", "--orders", "1")
    port = free_port()
    process, _ = start_server(directory, "--metrics-listen", f"127.0.0.1:{port}")
    silent = []

    def scrape():
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).status

    def scraped_within(seconds):
        deadline = time.monotonic() + seconds
        while True:
            try:
                return scrape() == 200
            except OSError:
                # The server may not have seen a closed one go yet on a loaded machine.
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)

    try:
        assert scraped_within(10), "the metrics page answers"
        started = time.monotonic()
        for _ in range(32):
            silent.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.5)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(5)
        try:
            extra.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = extra.recv(64)
        except OSError:
            answer = b""
        assert answer == b"", "past the peer's places a connection is closed unanswered"
        silent.pop().close()
        assert scraped_within(10), "answered after a place was freed"
        for connection in silent:
            connection.settimeout(30)
            try:
                assert connection.recv(64) == b"", "a silent connection was answered"
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < 25, "silent connections closed at the header timeout"
    finally:
        for connection in silent:
            connection.close()
        stop_server(process)
