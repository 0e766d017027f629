"""Checked reads of SQL Server change data capture from an mssql-cdc-flight server.

``connect(url)`` returns a :class:`Client`; its reads return a ``pyarrow.Table`` only when
every stream ended with its completion marker and the marker's row count matched. Server
errors are the typed exceptions of :mod:`mssql_cdc_flight.errors`. With the ``spark`` extra,
:mod:`mssql_cdc_flight.spark` registers the PySpark data source ``mssql_cdc_flight``.
"""

from .client import Client, Endpoint, Plan, connect
from .errors import (
    CdcFlightError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    IncompleteStreamError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    SchemaChangedError,
    ServerBusyError,
    TicketExpiredError,
    UnauthenticatedError,
    UnavailableError,
)
from .offset import Offset

__all__ = [
    "CdcFlightError",
    "Client",
    "DataLossError",
    "DeadlineExceededError",
    "Endpoint",
    "FailedPreconditionError",
    "IncompleteStreamError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "Offset",
    "PermissionDeniedError",
    "Plan",
    "SchemaChangedError",
    "ServerBusyError",
    "TicketExpiredError",
    "UnauthenticatedError",
    "UnavailableError",
    "connect",
]
