"""Typed errors: every gRPC status of the server becomes one exception class.

The server attaches gRPC's rich error details to every status (a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer, holding an ``ErrorInfo`` with a stable ``reason`` and the
error's fields, and a ``RetryInfo`` when the server is busy). pyarrow does not expose that
trailer on its exceptions, so a client middleware records it per thread; ``translate`` turns a
pyarrow exception and those details into the exception of this module.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.flight as flight

ERROR_DOMAIN = "mssql-cdc-flight"


class CdcFlightError(Exception):
    """A call to the server failed.

    Attributes:
        code: the gRPC status code name (``"DATA_LOSS"``, ...), when known.
        reason: the server's stable reason code (``"CHANGES_PURGED"``, ...), when it sent one.
        fields: the error's fields (``{"capture_instance": ..., "min_lsn": ...}``).
        message: the server's message.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        fields: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.fields = dict(fields or {})


class DataLossError(CdcFlightError):
    """Changes of the range were purged by CDC cleanup: a re-snapshot is required."""


class NotFoundError(CdcFlightError):
    """An unknown table or capture instance."""


class InvalidRequestError(CdcFlightError):
    """A request the server cannot serve as given (a bad option, a limit passed, ...)."""


class UnauthenticatedError(CdcFlightError):
    """No credentials, or credentials the server does not know."""


class PermissionDeniedError(CdcFlightError):
    """The principal may not read this table, or a ticket was edited."""


class FailedPreconditionError(CdcFlightError):
    """The server's state does not allow the request (see the subclasses)."""


class SchemaChangedError(FailedPreconditionError):
    """A schema change the request cannot hold."""


class TicketExpiredError(FailedPreconditionError):
    """A ticket past its expiry: plan the read again."""


class ServerBusyError(CdcFlightError):
    """Too many streams are open; retry after ``retry_after`` seconds."""

    @property
    def retry_after(self) -> float:
        return float(self.fields.get("retry_after_seconds", "1"))


class DeadlineExceededError(CdcFlightError):
    """A planning call ran past the server's deadline, or (reason ``STREAM_STALLED``) the
    server ended a stream its client took no batch of for its stall timeout: read the ticket
    again."""


class UnavailableError(CdcFlightError):
    """The source is unavailable for now: retry."""


class InternalError(CdcFlightError):
    """A server fault (a stream that stopped early, a bug)."""


class IncompleteStreamError(CdcFlightError):
    """A stream ended without its completion marker, or with another row count: never commit
    its rows. ``rows`` is how many arrived."""

    def __init__(self, message: str, *, rows: int, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.rows = rows


_BY_REASON: dict[str, type[CdcFlightError]] = {
    "CHANGES_PURGED": DataLossError,
    "PURGED_DURING_READ": DataLossError,
    "TABLE_NOT_FOUND": NotFoundError,
    "CAPTURE_INSTANCE_NOT_FOUND": NotFoundError,
    "INVALID_REQUEST": InvalidRequestError,
    "TICKET_MALFORMED": InvalidRequestError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "TABLE_NOT_GRANTED": PermissionDeniedError,
    "COLUMN_MASKED": PermissionDeniedError,
    "TICKET_FORGED": PermissionDeniedError,
    "SCHEMA_CHANGED": SchemaChangedError,
    "TICKET_EXPIRED": TicketExpiredError,
    "TICKET_MASKS_CHANGED": TicketExpiredError,
    "SOURCE_GRANT_MISSING": FailedPreconditionError,
    "SERVER_BUSY": ServerBusyError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "STREAM_STALLED": DeadlineExceededError,
    "SOURCE_UNAVAILABLE": UnavailableError,
    "INTERNAL": InternalError,
    "ARROW": InternalError,
    "LOCAL_IO": InternalError,
}

_CODE_NAMES = {
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}

_BY_CODE: dict[str, type[CdcFlightError]] = {
    "DATA_LOSS": DataLossError,
    "NOT_FOUND": NotFoundError,
    "INVALID_ARGUMENT": InvalidRequestError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "RESOURCE_EXHAUSTED": ServerBusyError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "UNAVAILABLE": UnavailableError,
    "INTERNAL": InternalError,
}


# --- the few protobuf messages of google.rpc, decoded by hand (no protobuf dependency) ---


def _fields(data: bytes):
    """Yields ``(field number, wire type, value)`` of a protobuf message."""
    position = 0

    def varint() -> int:
        nonlocal position
        shift = result = 0
        while True:
            byte = data[position]
            position += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    while position < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 2:
            length = varint()
            yield number, wire, data[position : position + length]
            position += length
        elif wire == 1:
            position += 8
        elif wire == 5:
            position += 4
        else:
            raise ValueError(f"protobuf wire type {wire}")


class Details:
    """What ``grpc-status-details-bin`` said: the code, the ErrorInfo and the RetryInfo."""

    def __init__(self, raw: bytes) -> None:
        self.code: str | None = None
        self.reason: str | None = None
        self.domain: str | None = None
        self.fields: dict[str, str] = {}
        for number, _, value in _fields(raw):
            if number == 1 and isinstance(value, int):
                self.code = _CODE_NAMES.get(value)
            elif number == 3 and isinstance(value, bytes):
                self._any(value)

    def _any(self, raw: bytes) -> None:
        type_url, payload = "", b""
        for number, _, value in _fields(raw):
            if number == 1:
                type_url = bytes(value).decode()
            elif number == 2:
                payload = bytes(value)
        if type_url.endswith("google.rpc.ErrorInfo"):
            for number, _, value in _fields(payload):
                if number == 1:
                    self.reason = bytes(value).decode()
                elif number == 2:
                    self.domain = bytes(value).decode()
                elif number == 3:
                    entry = {n: bytes(v).decode() for n, _, v in _fields(value)}
                    self.fields[entry.get(1, "")] = entry.get(2, "")
        elif type_url.endswith("google.rpc.RetryInfo"):
            for number, _, value in _fields(payload):
                if number == 1:
                    seconds = {n: v for n, _, v in _fields(value)}.get(1, 0)
                    self.fields.setdefault("retry_after_seconds", str(seconds))


_last = threading.local()


class _DetailsMiddleware(flight.ClientMiddleware):
    def received_headers(self, headers) -> None:
        for value in headers.get("grpc-status-details-bin", []):
            _last.details = value if isinstance(value, bytes) else value.encode()


class DetailsMiddlewareFactory(flight.ClientMiddlewareFactory):
    """Records the rich error details of each call, for ``translate``."""

    def start_call(self, info) -> _DetailsMiddleware:
        _last.details = None
        return _DetailsMiddleware()


def _message(error: BaseException) -> str:
    text = str(error)
    # pyarrow wraps the server's message: "Flight returned ... error, with message: <it>.
    # gRPC client debug context: ...".
    marker = "with message: "
    if marker in text:
        text = text.split(marker, 1)[1]
        text = text.split(". gRPC client debug context", 1)[0]
    return text


def translate(error: BaseException) -> CdcFlightError:
    """The exception of this module for a pyarrow exception raised by a call."""
    if isinstance(error, CdcFlightError):
        return error
    raw = getattr(_last, "details", None)
    _last.details = None
    details = None
    if raw:
        try:
            details = Details(raw)
        except (ValueError, IndexError, UnicodeDecodeError):
            details = None
    message = _message(error)
    if details is not None and details.domain == ERROR_DOMAIN and details.reason:
        kind = _BY_REASON.get(details.reason) or _BY_CODE.get(details.code or "", CdcFlightError)
        return kind(message, code=details.code, reason=details.reason, fields=details.fields)
    code = _code_of(error)
    kind = _BY_CODE.get(code or "", CdcFlightError)
    return kind(message, code=code)


# pyarrow's exception classes and the gRPC codes they stand for, most specific first.
_CODE_OF_CLASS: tuple[tuple[type[BaseException], str], ...] = (
    (flight.FlightUnauthenticatedError, "UNAUTHENTICATED"),
    (flight.FlightUnauthorizedError, "PERMISSION_DENIED"),
    (flight.FlightUnavailableError, "UNAVAILABLE"),
    (flight.FlightTimedOutError, "DEADLINE_EXCEEDED"),
    (flight.FlightInternalError, "INTERNAL"),
    (pa.ArrowKeyError, "NOT_FOUND"),
    (pa.ArrowInvalid, "INVALID_ARGUMENT"),
)


def _code_of(error: BaseException) -> str | None:
    """The gRPC code pyarrow's exception class stands for."""
    return next((code for kind, code in _CODE_OF_CLASS if isinstance(error, kind)), None)


@contextmanager
def server_errors():
    """Raises what a call inside raises as the exception of this module."""
    try:
        yield
    except CdcFlightError:
        raise
    except Exception as error:
        raise translate(error) from error
