"""Rows/s of a Spark batch read through the data source with 1, 2 and 4 partitions, beside the
pyarrow client's checked read of the same range, in one run on this machine.

    .venv/bin/python clients/python/benchmarks/spark_read.py [--rows 5000000] [--binary PATH]

It creates a simulated database whose dbo.orders holds `--rows` change rows (its seeded
inserts), serves it with the server binary (a release build is best: `cargo build --release`),
and reads the whole range: each Spark read counts its rows (`count()` forces every partition
to be read and checked, without collecting), the pyarrow client reads into a table. Spark's own
floor is measured too: the same batches, read back from a local Arrow file by a trivial Python
data source with as many partitions (no network, no server), so the table shows what the
data source costs beyond Spark's ingestion of Arrow batches from Python.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--binary", default=str(ROOT / "target" / "release" / "mssql-cdc-flight"))
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import mssql_cdc_flight as cdc
    from mssql_cdc_flight.spark import register

    work = Path(tempfile.mkdtemp())
    subprocess.run(
        [
            args.binary,
            "sim",
            "init",
            str(work / "db"),
            "--customers",
            "0",
            "--orders",
            str(args.rows),
        ],
        check=True,
        capture_output=True,
    )
    server = subprocess.Popen(
        [args.binary, "serve", "--source", f"sim:{work / 'db'}", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = "grpc://" + server.stdout.readline().split()[-1]
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
    results = []
    try:
        for partitions in (1, 2, 4):
            # Warm the page cache and both paths once, then time.
            client.read_changes("dbo.orders", start, partitions=partitions)
            began = time.perf_counter()
            table = client.read_changes("dbo.orders", start, partitions=partitions)
            pyarrow_seconds = time.perf_counter() - began
            frame = (
                spark.read.format("mssql_cdc_flight")
                .option("server", url)
                .option("table", "dbo.orders")
                .option("numPartitions", str(partitions))
                .option("minPartitionRows", "1")
                .load()
            )
            frame.count()
            began = time.perf_counter()
            counted = frame.count()
            spark_seconds = time.perf_counter() - began
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
            began = time.perf_counter()
            assert floor.count() == args.rows
            floor_seconds = time.perf_counter() - began
            results.append(
                (
                    partitions,
                    frame.rdd.getNumPartitions(),
                    table.num_rows,
                    table.num_rows / pyarrow_seconds,
                    counted / spark_seconds,
                    args.rows / floor_seconds,
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
    for partitions, spark_partitions, rows, pyarrow_rate, spark_rate, floor_rate in results:
        print(
            f"| {partitions} | {spark_partitions} | {rows} | {pyarrow_rate:,.0f} | "
            f"{spark_rate:,.0f} | {spark_rate / pyarrow_rate:.2f} | {floor_rate:,.0f} | "
            f"{spark_rate / floor_rate:.2f} |"
        )


if __name__ == "__main__":
    main()
