"""The client: planning calls, and reads that return rows only when every stream is whole."""

from __future__ import annotations

import ipaddress
import json
import os
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from .errors import (
    DetailsMiddlewareFactory,
    IncompleteStreamError,
    InternalError,
    server_errors,
    translate,
)
from .offset import Offset

OffsetLike = Offset | dict | str

#: Set to ``1`` to let a client send its bearer token over ``grpc://`` to a host off loopback,
#: where something else encrypts the path (a service mesh's mutual TLS); refused otherwise.
INSECURE_CLEARTEXT_TOKEN_VARIABLE = "MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN"


def _is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine: ``localhost`` or a loopback address (no name is
    resolved, so any other name counts as remote; a URL with a user part is remote too, as
    Arrow takes what follows ``@`` for the host)."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc or parts.hostname is None:
        return False
    if parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:
        return False


def _check_cleartext(url: str, token: str | None) -> None:
    """Refuses to send ``token`` in cleartext to a host off loopback."""
    cleartext = url.lower().startswith(("grpc://", "grpc+tcp://", "http://"))
    if not token or not cleartext or _is_loopback(url):
        return
    if os.environ.get(INSECURE_CLEARTEXT_TOKEN_VARIABLE) == "1":
        return
    raise ValueError(
        f"refusing to send a bearer token in cleartext to {url}, a host off loopback: use "
        f"grpc+tls:// with tls_ca or, where something else encrypts the path, set "
        f"{INSECURE_CLEARTEXT_TOKEN_VARIABLE}=1"
    )


@dataclass(frozen=True)
class Endpoint:
    """One stream of a plan: its ticket (opaque, signed by the server) and its app_metadata
    (a change range's ``{"capture_instance", "from", "to", "rows"}``, a snapshot's pieces).
    Picklable, so Spark sends it to executors."""

    ticket: bytes
    metadata: dict = field(default_factory=dict)


@dataclass
class StreamEnd:
    """How a checked stream ended: its completion marker and its schema."""

    marker: dict = field(default_factory=dict)
    schema: pa.Schema | None = None


@dataclass(frozen=True)
class Plan:
    """A planned read: the schema every endpoint serves, its endpoints in order, the plan's
    app_metadata, and the rows counted at planning (-1 when the server did not count)."""

    schema: pa.Schema
    endpoints: list[Endpoint]
    metadata: dict
    total_records: int


def _offset(value: OffsetLike) -> Offset:
    return value if isinstance(value, Offset) else Offset.from_json(value)


def _lsn(value: OffsetLike) -> str:
    """The LSN of an offset, or ``value`` itself when it is a bare LSN (``0x`` and 20 hex
    digits), as :meth:`Client.wait_for_tables` answers one."""
    if isinstance(value, str) and value.strip().lower().startswith("0x"):
        return value.strip()
    return _offset(value).lsn


class Client:
    """A connection to one server. Use :func:`connect`."""

    def __init__(
        self,
        url: str,
        *,
        tls_ca: bytes | None = None,
        token: str | None = None,
        cert_chain: bytes | None = None,
        private_key: bytes | None = None,
    ) -> None:
        _check_cleartext(url, token)
        self.url = url
        kwargs: dict[str, Any] = {"middleware": [DetailsMiddlewareFactory()]}
        if tls_ca is not None:
            kwargs["tls_root_certs"] = tls_ca
        if cert_chain is not None:
            kwargs["cert_chain"] = cert_chain
            kwargs["private_key"] = private_key
        self._flight = flight.FlightClient(url, **kwargs)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers)
        self._settings = (url, tls_ca, token, cert_chain, private_key)

    def __reduce__(self):
        # Spark ships clients to executors: reconnect there with the same settings.
        return (_reconnect, self._settings)

    def close(self) -> None:
        self._flight.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- planning calls ---

    def action(self, name: str, body: dict | None = None) -> Any:
        """Calls the action ``name`` with a JSON body; returns its decoded JSON answer."""
        payload = json.dumps(body or {}).encode()
        with server_errors():
            results = list(self._flight.do_action(flight.Action(name, payload), self._options))
        if len(results) != 1:
            raise InternalError(f"action {name} answered {len(results)} results, not one")
        return json.loads(results[0].body.to_pybytes())

    def tables(self) -> list[str]:
        """The tracked tables this principal may read."""
        with server_errors():
            infos = list(self._flight.list_flights(options=self._options))
        return [json.loads(info.descriptor.command)["table"] for info in infos]

    def capture_instances(self, table: str) -> list[dict]:
        """The table's capture instances, oldest first."""
        return self.action("capture_instances", {"table": table})

    def initial_offset(self, table: str, starting: str = "earliest") -> Offset:
        """Where a new stream starts: ``"earliest"``, ``"latest"`` or an LSN already processed."""
        return Offset.from_json(
            self.action("initial_offset", {"table": table, "starting": starting})
        )

    def latest_offset(
        self, start: OffsetLike, max_commits: int | None = None, upper: str | None = None
    ) -> Offset:
        """The end of the next range after ``start``: ``max_lsn`` (or ``upper``, an LSN the
        range may not pass: an available-now run's target), capped at ``max_commits`` commits
        (the seed's ``maxCommitsPerBatch``); ``start`` itself when nothing is newer."""
        body: dict[str, Any] = {"start": _offset(start).to_dict()}
        if max_commits is not None:
            body["max_commits"] = max_commits
        if upper is not None:
            body["upper"] = upper
        return Offset.from_json(self.action("latest_offset", body))

    def wait_for_commits(self, after: OffsetLike, timeout: float = 10.0) -> bool:
        """Waits on the server's live tail until a commit past ``after`` lands, at most
        ``timeout`` seconds (60 at most); ``True`` when one did. A stream loop calls it when
        ``latest_offset`` answers its own offset, instead of sleeping."""
        if not 0 < timeout <= 60:
            raise ValueError(f"timeout must be more than 0 and at most 60 seconds, not {timeout}")
        body = {"after": _offset(after).lsn, "timeout_ms": max(1, int(timeout * 1000))}
        return not self.action("wait_for_commits", body)["timed_out"]

    def wait_for_tables(
        self, after: OffsetLike, tables: list[str], timeout: float = 10.0
    ) -> tuple[str | None, list[str]]:
        """Waits until one of ``tables`` (``schema.table``, at most 10,000) has change rows
        past ``after`` (an offset or a bare LSN), at most ``timeout`` seconds (60 at most).
        Returns the LSN the tables were checked through and those that changed (none at the
        timeout); the next wait passes that LSN as ``after``, so no change falls between two
        waits. One call watches many tables, and a commit to a table not listed does not end
        it."""
        if not 0 < timeout <= 60:
            raise ValueError(f"timeout must be more than 0 and at most 60 seconds, not {timeout}")
        if not tables:
            raise ValueError("name at least one table to wait on")
        body = {
            "after": _lsn(after),
            "timeout_ms": max(1, int(timeout * 1000)),
            "tables": list(tables),
        }
        answer = self.action("wait_for_commits", body)
        return answer["lsn"], list(answer.get("changed") or [])

    def _plan(self, command: dict) -> Plan:
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command))
        with server_errors():
            info = self._flight.get_flight_info(descriptor, self._options)
        endpoints = [
            Endpoint(
                ticket=endpoint.ticket.ticket,
                metadata=json.loads(endpoint.app_metadata) if endpoint.app_metadata else {},
            )
            for endpoint in info.endpoints
        ]
        metadata = json.loads(info.app_metadata) if info.app_metadata else {}
        return Plan(info.schema, endpoints, metadata, info.total_records)

    def plan_changes(
        self,
        table: str,
        start: OffsetLike,
        end: OffsetLike | None = None,
        *,
        partitions: int = 1,
        **options: Any,
    ) -> Plan:
        """Plans the changes of ``(start, end]`` (``end`` default ``max_lsn``) in at most
        ``partitions`` endpoints per capture instance. ``options`` are the ``changes``
        command's (``columns`` or ``except_columns``, ``include_command_id``, ``batch_rows``,
        ``batch_bytes``, ``compression``, ``min_partition_rows``, ``capture_instance``)."""
        command: dict[str, Any] = {
            "type": "changes",
            "table": table,
            "from": _offset(start).lsn,
            "partitions": partitions,
            **options,
        }
        if end is not None:
            command["to"] = _offset(end).lsn
        return self._plan(command)

    def plan_snapshot(self, table: str, *, partitions: int = 1, **options: Any) -> Plan:
        """Plans a read of the table's current rows in ``partitions`` endpoints; ``options``
        are the ``snapshot`` command's (``chunks``, ``keys``, ``columns``, ``except_columns``,
        ...)."""
        return self._plan({"type": "snapshot", "table": table, "partitions": partitions, **options})

    # --- checked reads ---

    def iter_endpoint(self, endpoint: Endpoint, end: StreamEnd | None = None):
        """Yields the endpoint's record batches as they arrive, then checks the stream: raises
        :class:`IncompleteStreamError` after the last batch when the completion marker did not
        arrive or counts other rows. A caller that commits only after the iteration ended
        (a Spark task, :meth:`read_endpoint`) never commits a short stream. ``end`` receives
        the marker and the schema."""
        rows = 0
        seen: dict | None = None
        schema = None
        try:
            reader = self._flight.do_get(flight.Ticket(endpoint.ticket), self._options)
            schema = reader.schema
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                if seen is not None:
                    raise IncompleteStreamError("data after the completion marker", rows=rows)
                if chunk.app_metadata is not None:
                    seen = json.loads(chunk.app_metadata.to_pybytes())
                elif chunk.data is not None:
                    rows += chunk.data.num_rows
                    yield chunk.data
        except IncompleteStreamError:
            raise
        except Exception as error:
            translated = translate(error)
            if translated.reason is None and schema is not None:
                # The stream broke after it began without a verdict of the server (a killed
                # server, a cut connection): what arrived is not a whole read.
                raise IncompleteStreamError(
                    f"the stream broke after {rows} rows: {translated.message}",
                    rows=rows,
                    code=translated.code,
                ) from error
            raise translated from error
        if seen is None:
            raise IncompleteStreamError(
                f"the stream ended without its completion marker after {rows} rows", rows=rows
            )
        if seen.get("type") != "complete" or seen.get("rows") != rows:
            raise IncompleteStreamError(
                f"the completion marker says {seen.get('rows')} rows but {rows} arrived",
                rows=rows,
            )
        if end is not None:
            end.marker, end.schema = seen, schema

    def read_endpoint_with_marker(self, endpoint: Endpoint) -> tuple[pa.Table, dict]:
        """Reads one endpoint; returns its rows and its completion marker, only when the marker
        arrived and counts exactly the rows that did. Else :class:`IncompleteStreamError`."""
        end = StreamEnd()
        batches = list(self.iter_endpoint(endpoint, end))
        return pa.Table.from_batches(batches, schema=end.schema), end.marker

    def read_endpoint(self, endpoint: Endpoint) -> pa.Table:
        """Reads one endpoint; its rows only when the stream is whole (see
        :meth:`read_endpoint_with_marker`)."""
        return self.read_endpoint_with_marker(endpoint)[0]

    def read_plan(self, plan: Plan, *, parallelism: int = 4) -> pa.Table:
        """Reads every endpoint of ``plan``, ``parallelism`` at a time; the rows in plan order."""
        if not plan.endpoints:
            return plan.schema.empty_table()
        with ThreadPoolExecutor(max_workers=max(1, parallelism)) as pool:
            tables = list(pool.map(self.read_endpoint, plan.endpoints))
        return pa.concat_tables(tables)

    def read_changes(
        self,
        table: str,
        start: OffsetLike,
        end: OffsetLike | None = None,
        *,
        partitions: int = 4,
        **options: Any,
    ) -> pa.Table:
        """The changes of ``(start, end]``, read from ``partitions`` endpoints concurrently
        and checked; ordered by ``(_start_lsn, _command_id, _seqval, _operation)``."""
        plan = self.plan_changes(table, start, end, partitions=partitions, **options)
        return self.read_plan(plan, parallelism=partitions)

    def read_snapshot(self, table: str, *, partitions: int = 1, **options: Any) -> pa.Table:
        """The table's current rows, read from ``partitions`` endpoints and checked."""
        plan = self.plan_snapshot(table, partitions=partitions, **options)
        return self.read_plan(plan, parallelism=partitions)


def _reconnect(url, tls_ca, token, cert_chain, private_key) -> Client:
    return Client(url, tls_ca=tls_ca, token=token, cert_chain=cert_chain, private_key=private_key)


def connect(
    url: str,
    *,
    tls_ca: bytes | str | None = None,
    token: str | None = None,
    cert_chain: bytes | None = None,
    private_key: bytes | None = None,
) -> Client:
    """Connects to a server: ``grpc://host:port``, or ``grpc+tls://host:port`` verified
    against ``tls_ca`` (PEM bytes, or a path to a PEM file); ``token`` is a bearer token of
    the server's tokens file, sent in cleartext only to loopback (``ValueError`` otherwise,
    unless ``MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN=1``); ``cert_chain`` and
    ``private_key`` (PEM) for mutual TLS."""
    if isinstance(tls_ca, str):
        with open(tls_ca, "rb") as file:
            tls_ca = file.read()
    return Client(url, tls_ca=tls_ca, token=token, cert_chain=cert_chain, private_key=private_key)
