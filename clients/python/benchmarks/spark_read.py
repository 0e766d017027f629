"""Rows/s of a Spark batch read through the data source with 1, 2 and 4 partitions, beside the
pyarrow client's checked read of the same range, in one run on this machine.

    .venv/bin/python clients/python/benchmarks/spark_read.py [--rows 5000000] [--binary PATH]

It creates a simulated database whose dbo.orders holds `--rows` change rows (its seeded
inserts), serves it with the server binary (a release build is best: `cargo build --release`),
and reads the whole range: each Spark read counts its rows (`count()` forces every partition
to be read and checked, without collecting), the pyarrow client reads into a table. Spark's own
floor is measured too: the same batches, read back from a local Arrow file by a trivial Python
data source with as many partitions (no network, no server), so the table shows what the
data source costs beyond Spark's ingestion of Arrow batches from Python. A second table splits
each read's CPU time per row between the server, Spark (its JVM and Python workers) and the
pyarrow client, from /proc (Linux): on two shared cores, the rates follow from these sums.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_server import DEFAULT_BINARY, orders_database, serve


def file_source(path: str, arrow_schema, partitions: int):
    """A Python data source yielding the batches of the Arrow file at `path`, `partitions`
    partitions taking every n-th batch: Spark's ingestion with nothing in front of it."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
    from pyspark.sql.pandas.types import from_arrow_schema

    class FileReader(DataSourceReader):
        def partitions(self):
            return [InputPartition(index) for index in range(partitions)]

        def read(self, partition):
            import pyarrow as pa

            reader = pa.ipc.open_file(path)
            for index in range(partition.value, reader.num_record_batches, partitions):
                yield reader.get_batch(index)

    class ArrowFileSource(DataSource):
        @classmethod
        def name(cls):
            return f"arrow_file_{partitions}"

        def schema(self):
            return from_arrow_schema(arrow_schema, prefer_timestamp_ntz=True)

        def reader(self, schema):
            return FileReader()

    return ArrowFileSource


def cpu_seconds(root: int) -> float:
    """CPU seconds of process `root` and its live descendants (with their reaped children),
    from /proc: where a phase's time went, the server's beside Spark's JVM and workers."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(value) for value in fields[11:15]) / ticks
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0)
        stack.extend(child for child, parent in parents.items() if parent == pid)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--binary", default=DEFAULT_BINARY)
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import mssql_cdc_flight as cdc
    from mssql_cdc_flight.spark import register

    work = Path(tempfile.mkdtemp())
    server, url = serve(args.binary, orders_database(args.binary, work, args.rows))
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    client = cdc.connect(url)
    start = client.initial_offset("dbo.orders")
    jvm = spark.sparkContext._gateway.proc.pid

    def timed(read):
        """Runs `read`; its answer, wall seconds, and the CPU seconds of the server, of
        Spark's JVM with its Python workers, and of this process (the pyarrow client)."""
        before = (cpu_seconds(server.pid), cpu_seconds(jvm), time.process_time())
        began = time.perf_counter()
        answer = read()
        seconds = time.perf_counter() - began
        after = (cpu_seconds(server.pid), cpu_seconds(jvm), time.process_time())
        return answer, seconds, [b - a for a, b in zip(before, after, strict=True)]

    results = []
    try:
        for partitions in (1, 2, 4):
            # Warm the page cache and both paths once, then time.
            client.read_changes("dbo.orders", start, partitions=partitions)
            table, pyarrow_seconds, pyarrow_cpu = timed(
                lambda n=partitions: client.read_changes("dbo.orders", start, partitions=n)
            )
            frame = (
                spark.read.format("mssql_cdc_flight")
                .option("server", url)
                .option("table", "dbo.orders")
                .option("numPartitions", str(partitions))
                .option("minPartitionRows", "1")
                .load()
            )
            frame.count()
            counted, spark_seconds, spark_cpu = timed(frame.count)
            assert counted == table.num_rows == args.rows, (counted, table.num_rows)
            import pyarrow as pa

            path = str(work / "batches.arrow")
            with pa.ipc.new_file(path, table.schema) as writer:
                for batch in table.to_batches():
                    writer.write_batch(batch)
            source = file_source(path, table.schema, partitions)
            spark.dataSource.register(source)
            floor = spark.read.format(source.name()).load()
            floor.count()
            floor_count, floor_seconds, floor_cpu = timed(floor.count)
            assert floor_count == args.rows
            results.append(
                (
                    partitions,
                    frame.rdd.getNumPartitions(),
                    args.rows,
                    (pyarrow_seconds, pyarrow_cpu),
                    (spark_seconds, spark_cpu),
                    (floor_seconds, floor_cpu),
                )
            )
    finally:
        spark.stop()
        server.terminate()
        server.wait()
    print(
        "| partitions | Spark partitions | rows | pyarrow client rows/s | Spark rows/s "
        "| Spark ÷ pyarrow | Spark from an Arrow file rows/s | Spark ÷ that floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for partitions, spark_partitions, rows, pyarrow, spark_read, floor in results:
        rates = [rows / seconds for seconds, _ in (pyarrow, spark_read, floor)]
        print(
            f"| {partitions} | {spark_partitions} | {rows} | {rates[0]:,.0f} | "
            f"{rates[1]:,.0f} | {rates[1] / rates[0]:.2f} | {rates[2]:,.0f} | "
            f"{rates[1] / rates[2]:.2f} |"
        )
    print()
    print("CPU microseconds per row: server / Spark's JVM and Python workers / pyarrow client")
    print()
    print("| partitions | pyarrow client read | Spark read | Spark from an Arrow file |")
    print("|---|---|---|---|")
    for partitions, _, rows, *phases in results:
        cells = [" / ".join(f"{cpu * 1e6 / rows:.2f}" for cpu in used) for _, used in phases]
        print(f"| {partitions} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
