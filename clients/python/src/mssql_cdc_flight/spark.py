"""The PySpark data source ``mssql_cdc_flight`` (Spark 4's Python Data Source API).

Register it once per session, then read a change range, a snapshot, or a stream::

    from mssql_cdc_flight.spark import register
    register(spark)
    changes = (spark.read.format("mssql_cdc_flight")
               .option("server", "grpc+tls://cdc-flight:50051").option("table", "dbo.orders")
               .load())
    stream = (spark.readStream.format("mssql_cdc_flight")
              .option("server", "grpc+tls://cdc-flight:50051").option("table", "dbo.orders")
              .option("maxCommitsPerBatch", 1000).load())

A token goes only over TLS (``grpc+tls://`` with the ``tlsCa`` option) or to loopback; the
client refuses ``grpc://`` off loopback on the driver and on every executor unless
``MSSQL_CDC_FLIGHT_INSECURE_CLEARTEXT_TOKEN=1`` is set on each.

The driver plans; every Flight endpoint of the plan is one Spark input partition, read on an
executor as Arrow record batches (no per-row Python). A partition whose stream ends without
its completion marker, or with another row count, fails its task, so Spark retries it and
never commits a short read. Offsets of the stream are this package's :class:`Offset` JSON.

Options (the seed library's names where they mean the same thing):

- ``server`` (required), ``table`` (required), ``token``, ``tlsCa`` (a PEM file path);
- ``startingOffset`` / ``endingOffset`` for batch reads: ``earliest`` (default), ``latest``,
  an LSN already processed, or an offset's JSON; the end defaults to the latest;
- ``snapshot`` = ``true``: the table's current rows instead of changes;
- ``startingOffsets`` for streams (``earliest`` default, ``latest``, an LSN or an offset's
  JSON) and ``maxCommitsPerBatch`` (on Spark 4.2+ Spark's admission control: every batch
  capped, and ``trigger(availableNow=True)`` reads batch after batch up to where it began);
- ``numPartitions`` (default 4): endpoints per capture instance; ``columns`` or
  ``exceptColumns`` (comma separated; the server leaves the latter out, matched ignoring
  case), ``includeCommandId`` (default true), ``batchRows``, ``compression``,
  ``minPartitionRows`` (tiles are merged until each holds this many rows, default 50,000).

Any other option is refused, naming it: a misspelt option is an error, not a default. Flags
read ``true``/``false``, ``1``/``0`` or ``yes``/``no``; counts are whole numbers of at least 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from .client import Client, Endpoint, Plan, connect
from .offset import Offset

try:  # Spark 4.2+: admission control and Trigger.AvailableNow for Python sources (SPARK-55304)
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )

    HAS_ADMISSION_CONTROL = True
except ImportError:  # Spark 4.0 and 4.1
    HAS_ADMISSION_CONTROL = False

NAME = "mssql_cdc_flight"

# Every option the source reads (lower-cased, as Spark passes them case-insensitively); any
# other is refused, as a misspelt one would otherwise be ignored without a word.
OPTIONS = (
    "server",
    "table",
    "token",
    "tlsca",
    "startingoffset",
    "endingoffset",
    "snapshot",
    "startingoffsets",
    "maxcommitsperbatch",
    "numpartitions",
    "columns",
    "exceptcolumns",
    "includecommandid",
    "batchrows",
    "compression",
    "minpartitionrows",
)


def _options(options: dict[str, str]) -> dict[str, str]:
    """The options lower-cased, every name checked against :data:`OPTIONS`."""
    lower = {key.lower(): value for key, value in options.items()}
    unknown = sorted(set(lower) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"the {NAME} source has no option(s) {', '.join(unknown)}; "
            f"it reads {', '.join(OPTIONS)} (case-insensitive)"
        )
    return lower


def _flag(lower: dict[str, str], name: str, default: bool) -> bool:
    """A boolean option: true/false, 1/0 or yes/no in any case; anything else is refused."""
    text = str(lower.get(name, default)).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(
        f"the {NAME} option {name} is true or false (or 1/0, yes/no), not {lower[name]!r}"
    )


def _count(lower: dict[str, str], name: str) -> int | None:
    """A whole-number option of at least 1, or None when it is not given."""
    if not lower.get(name):
        return None
    try:
        value = int(str(lower[name]).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"the {NAME} option {name} is a whole number >= 1, not {lower[name]!r}")
    return value


def register(spark) -> None:
    """Registers the data source ``mssql_cdc_flight`` with a Spark session."""
    spark.dataSource.register(CdcFlightDataSource)


@dataclass(frozen=True)
class Settings:
    """What every driver and executor call needs to reach the server (picklable)."""

    server: str
    table: str
    token: str | None = field(repr=False)  # a secret: never in a repr Spark may log
    tls_ca: bytes | None = field(repr=False)
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, options: dict[str, str]) -> Settings:
        lower = _options(options)
        missing = [name for name in ("server", "table") if not lower.get(name)]
        if missing:
            raise ValueError(f"the {NAME} source needs the option(s) {', '.join(missing)}")
        tls_ca = None
        if lower.get("tlsca"):
            with open(lower["tlsca"], "rb") as file:
                tls_ca = file.read()
        command: dict[str, Any] = {}
        for option, name in (("columns", "columns"), ("exceptcolumns", "except_columns")):
            if lower.get(option):
                command[name] = [c.strip() for c in lower[option].split(",") if c.strip()]
        if "includecommandid" in lower:
            command["include_command_id"] = _flag(lower, "includecommandid", True)
        if _count(lower, "batchrows"):
            command["batch_rows"] = _count(lower, "batchrows")
        if lower.get("compression"):
            command["compression"] = lower["compression"]
        if _count(lower, "minpartitionrows"):
            command["min_partition_rows"] = _count(lower, "minpartitionrows")
        return cls(lower["server"], lower["table"], lower.get("token"), tls_ca, command)

    def client(self) -> Client:
        return connect(self.server, tls_ca=self.tls_ca, token=self.token)

    @property
    def snapshot_options(self) -> dict[str, Any]:
        """The options a snapshot command takes (tiles are a change range's)."""
        return {k: v for k, v in self.options.items() if k != "min_partition_rows"}


def _offset(client: Client, table: str, text: str) -> Offset:
    """An offset option: ``earliest``, ``latest``, an LSN, or an offset's JSON."""
    text = text.strip()
    if text.startswith("{"):
        return Offset.from_json(text)
    return client.initial_offset(table, starting=text)


class EndpointPartition(InputPartition):
    """One Flight endpoint of a plan: one Spark input partition."""

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint.ticket)
        self.endpoint = endpoint


def _spark_schema(plan_schema) -> StructType:
    return from_arrow_schema(plan_schema, prefer_timestamp_ntz=True)


def _read(settings: Settings, partition: EndpointPartition):
    """An executor's read of one endpoint: batches as they arrive; the task fails after the
    last one when the stream was not whole, so its rows are never committed."""
    with settings.client() as client:
        yield from client.iter_endpoint(partition.endpoint)


class CdcFlightDataSource(DataSource):
    """``spark.read.format("mssql_cdc_flight")`` and ``spark.readStream.format(...)``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.settings = Settings.of(dict(options))
        self.lower = _options(dict(options))
        self.partitions = _count(self.lower, "numpartitions") or 4
        self.snapshot = _flag(self.lower, "snapshot", False)

    def _plan(self) -> Plan:
        settings = self.settings
        with settings.client() as client:
            if self.snapshot:
                return client.plan_snapshot(
                    settings.table, partitions=self.partitions, **settings.snapshot_options
                )
            start = _offset(client, settings.table, self.lower.get("startingoffset", "earliest"))
            end_text = self.lower.get("endingoffset", "latest")
            end = (
                client.latest_offset(start)
                if end_text == "latest"
                else _offset(client, settings.table, end_text)
            )
            return client.plan_changes(
                settings.table, start, end, partitions=self.partitions, **settings.options
            )

    def schema(self) -> StructType:
        # The schema of an empty plan: the server answers it without counting any rows.
        settings = self.settings
        with settings.client() as client:
            if self.snapshot:
                plan = client.plan_snapshot(
                    settings.table, partitions=1, **settings.snapshot_options
                )
            else:
                latest = client.initial_offset(settings.table, starting="latest")
                plan = client.plan_changes(settings.table, latest, latest, **settings.options)
        return _spark_schema(plan.schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(self.settings, self._plan())

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if HAS_ADMISSION_CONTROL:
            return AdmittingStreamReader(self.settings, self.lower, self.partitions)
        return StreamReader(self.settings, self.lower, self.partitions)


class BatchReader(DataSourceReader):
    """A batch read: the plan made on the driver, one partition per endpoint."""

    def __init__(self, settings: Settings, plan: Plan) -> None:
        self.settings = settings
        self.endpoints = plan.endpoints

    def partitions(self) -> list[InputPartition]:
        return [EndpointPartition(endpoint) for endpoint in self.endpoints]

    def read(self, partition: InputPartition):
        assert isinstance(partition, EndpointPartition)
        return _read(self.settings, partition)


class StreamReader(DataSourceStreamReader):
    """A stream on Spark 4.0 and 4.1: offsets are :class:`Offset` JSON, each micro-batch the
    range ``(start, end]`` planned on the driver with one partition per endpoint.

    ``latestOffset`` is capped at ``maxCommitsPerBatch`` commits after the end of the last
    batch this reader planned; the first batch after a restart from a checkpoint, whose start
    this reader has not seen yet, reads up to ``max_lsn``. These releases' Python API has no
    admission control: under ``trigger(availableNow=True)`` Spark asks ``latestOffset`` once
    per run, so a capped run reads one batch. Leave ``maxCommitsPerBatch`` unset there; Spark
    4.2 reads with :class:`AdmittingStreamReader` instead.
    """

    def __init__(self, settings: Settings, lower: dict[str, str], partitions: int) -> None:
        self.settings = settings
        self.partitions_per_instance = partitions
        self.starting = lower.get("startingoffsets", "earliest")
        self.max_commits = _count(lower, "maxcommitsperbatch")
        self.last_end: Offset | None = None

    def initialOffset(self) -> dict:
        with self.settings.client() as client:
            offset = _offset(client, self.settings.table, self.starting)
        self.last_end = offset
        return offset.to_dict()

    def latestOffset(self) -> dict:
        with self.settings.client() as client:
            if self.last_end is None:
                start = client.initial_offset(self.settings.table, starting="latest")
                return start.to_dict()
            return client.latest_offset(self.last_end, self.max_commits).to_dict()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, finish = Offset.from_json(start), Offset.from_json(end)
        self.last_end = finish
        if finish.lsn <= begin.lsn:
            return []
        with self.settings.client() as client:
            plan = client.plan_changes(
                self.settings.table,
                begin,
                finish,
                partitions=self.partitions_per_instance,
                **self.settings.options,
            )
        return [EndpointPartition(endpoint) for endpoint in plan.endpoints]

    def read(self, partition: InputPartition):
        assert isinstance(partition, EndpointPartition)
        return _read(self.settings, partition)

    def commit(self, end: dict) -> None:
        self.last_end = Offset.from_json(end)


if HAS_ADMISSION_CONTROL:

    class AdmittingStreamReader(StreamReader, SupportsTriggerAvailableNow):
        """A stream on Spark 4.2+, with admission control: Spark hands ``latestOffset`` the
        batch's start and a limit, so every batch, the first after a restart included, holds
        at most ``maxCommitsPerBatch`` commits; under ``trigger(availableNow=True)`` a run
        reads batch after batch up to the ``max_lsn`` it started at, then stops.

        ``maxCommitsPerBatch`` travels as a ``ReadMaxRows`` counting commits, as the seed's
        reader does: Python sources take only Spark's own limits, and a batch ends on a commit
        boundary."""

        def __init__(self, settings: Settings, lower: dict[str, str], partitions: int) -> None:
            super().__init__(settings, lower, partitions)
            self.target: str | None = None  # an available-now run's max_lsn at its start

        def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
            if self.max_commits:
                return ReadMaxRows(self.max_commits)
            return ReadAllAvailable()

        def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
            with self.settings.client() as client:
                # The source's max_lsn, as the seed's: nothing committed after the run began.
                self.target = client.action("max_lsn", {})["lsn"] or ""

        def latestOffset(self, start: dict, limit: ReadLimit) -> dict:  # noqa: N802
            begin = Offset.from_json(start)
            if self.target is not None and self.target <= begin.lsn:
                return start  # AvailableNow: its target reached, the run ends
            cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
            with self.settings.client() as client:
                return client.latest_offset(begin, cap, upper=self.target).to_dict()
