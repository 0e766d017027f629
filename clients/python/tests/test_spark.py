"""The PySpark data source in local mode (real pyspark from the registry, the machine's JDK)
against the real server binary: batch reads of a range and of a snapshot, a streaming query
stopped and restarted while a workload runs, partitions per endpoint, and server errors.

pyspark and Java are required: without them this module fails, it never skips.
"""

import subprocess
import sys

import pytest
from conftest import binary, journal_rows, start_server, stop_server, workload_database

import mssql_cdc_flight as cdc


def keyed_rows(rows):
    return sorted(
        (row["_start_lsn"], row["_command_id"], row["_seqval"], row["_operation"], row["order_id"])
        for row in rows
    )


def run_available_now(spark, server, sink, checkpoint, **options):
    """One `trigger(availableNow=True)` run of a stream of dbo.orders into Parquet at `sink`,
    to its end; the finished query."""
    stream = spark.readStream.format("mssql_cdc_flight").option("server", server)
    for key, value in {"table": "dbo.orders", **options}.items():
        stream = stream.option(key, value)
    query = (
        stream.load()
        .writeStream.format("parquet")
        .option("path", str(sink))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return query


def reader(spark, server, **options):
    read = spark.read.format("mssql_cdc_flight").option("server", server)
    for key, value in {"table": "dbo.orders", **options}.items():
        read = read.option(key, str(value))
    return read.load()


def test_a_batch_read_of_a_range_equals_the_journal_one_partition_per_endpoint(
    spark, server, database
):
    _, journal = database
    frame = reader(spark, server, numPartitions=3, minPartitionRows=50)
    rows = frame.collect()
    assert keyed_rows(rows) == journal_rows(journal, "dbo.orders")
    client = cdc.connect(server)
    start = client.initial_offset("dbo.orders")
    plan = client.plan_changes(
        "dbo.orders", start, client.latest_offset(start), partitions=3, min_partition_rows=50
    )
    assert frame.rdd.getNumPartitions() == len(plan.endpoints) == 3
    assert frame.schema["_commit_ts"].dataType.typeName() == "timestamp_ntz"
    assert frame.schema["amount"].dataType.typeName() == "decimal"


def test_a_batch_read_of_a_snapshot_equals_the_tables_rows(spark, server):
    frame = reader(spark, server, snapshot="true", numPartitions=2)
    keys = sorted(row["order_id"] for row in frame.select("order_id").collect())
    expected = cdc.connect(server).read_snapshot("dbo.orders", partitions=1)
    assert keys == sorted(expected.column("order_id").to_pylist())
    assert {row["_operation"] for row in frame.select("_operation").collect()} == {0}


def test_a_server_error_surfaces_with_the_servers_message(spark, server):
    with pytest.raises(Exception, match="is not tracked by CDC here"):
        reader(spark, server, table="dbo.nope").collect()


def test_options_are_strict_and_flags_read_every_spelling(spark, server):
    """A misspelt option, a flag that is not one, a count below 1 are errors naming the
    option (through Spark's reader too); `1`, `yes`, `FALSE` read as the flags they mean."""
    from mssql_cdc_flight.spark import CdcFlightDataSource

    base = {"server": server, "table": "dbo.orders"}
    source = CdcFlightDataSource({**base, "includeCommandId": "1", "SNAPSHOT": "yes"})
    assert source.snapshot and source.settings.options["include_command_id"] is True
    source = CdcFlightDataSource({**base, "includecommandid": "FALSE", "snapshot": "0"})
    assert not source.snapshot and source.settings.options["include_command_id"] is False
    refused = [
        ({"maxCommitPerBatch": "5"}, "no option"),
        ({"snapshot": "on"}, "snapshot is true or false"),
        ({"numPartitions": "0"}, "numpartitions is a whole number"),
        ({"batchRows": "many"}, "batchrows is a whole number"),
    ]
    for options, message in refused:
        with pytest.raises(ValueError, match=message):
            CdcFlightDataSource({**base, **options})
    with pytest.raises(Exception, match=r"no option\(s\) numpartition;"):
        reader(spark, server, numPartition=2).collect()
    rows = reader(spark, server, includeCommandId="0", exceptColumns="Note, amount").limit(1)
    row = rows.collect()[0].asDict()
    assert "_command_id" not in row and "note" not in row and "amount" not in row
    assert "quantity" in row


def test_a_stream_stopped_and_restarted_while_a_workload_runs_lands_every_change_once(
    spark, tmp_path
):
    directory = tmp_path / "db"
    journal = tmp_path / "journal.jsonl"
    workload_database(
        directory,
        "--commits",
        "150",
        "--seed",
        "8",
        "--clock",
        "virtual",
        "--journal",
        str(journal),
    )
    process, url = start_server(directory)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"

    def run_stream_once():
        return run_available_now(spark, url, sink, checkpoint, numPartitions="2")

    try:
        first = run_stream_once()
        assert first.lastProgress is not None
        workload = subprocess.Popen(
            [
                binary(),
                "sim",
                "run",
                str(directory),
                "--commits",
                "150",
                "--seed",
                "9",
                "--rate",
                "100",
                "--journal",
                str(journal),
            ],
            stdout=subprocess.DEVNULL,
            stderr=sys.stderr,
        )
        # Restarted from its checkpoint while commits arrive, then once more after them.
        run_stream_once()
        assert workload.wait(timeout=120) == 0
        run_stream_once()
        landed = spark.read.parquet(str(sink)).collect()
        assert keyed_rows(landed) == journal_rows(journal, "dbo.orders")
        assert len(landed) > 300
    finally:
        stop_server(process)


def test_an_available_now_run_capped_per_batch_reads_every_change_in_many_batches(spark, tmp_path):
    """Spark 4.2's admission control: `maxCommitsPerBatch` caps each batch, the first one
    included, and `trigger(availableNow=True)` reads batch after batch until the `max_lsn` the
    run began at (on Spark 4.0 a capped run read one batch); a second run, restarted from the
    first's checkpoint after more commits, reads them the same way, each change once."""
    from mssql_cdc_flight.spark import HAS_ADMISSION_CONTROL

    assert HAS_ADMISSION_CONTROL, "requirements-test.txt pins a pyspark with admission control"
    directory, journal = tmp_path / "db", tmp_path / "journal.jsonl"
    workload_database(directory, "--commits", "120", "--seed", "12", "--journal", str(journal))
    process, url = start_server(directory)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"

    def capped_run(commits_before):
        """A run; the table's commits it read, after checking it took one batch per 25."""
        query = run_available_now(spark, url, sink, checkpoint, maxCommitsPerBatch="25")
        batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
        landed = spark.read.parquet(str(sink)).collect()
        assert keyed_rows(landed) == journal_rows(journal, "dbo.orders")
        commits = len({row["_start_lsn"] for row in landed})
        assert commits - commits_before > 30, (commits_before, commits)
        assert len(batches) >= -(-(commits - commits_before) // 25), (commits, len(batches))
        return commits

    try:
        first = capped_run(0)
        more = [binary(), "sim", "run", str(directory), "--commits", "80", "--seed", "13"]
        subprocess.run([*more, "--journal", str(journal)], check=True, capture_output=True)
        capped_run(first)
    finally:
        stop_server(process)
