"""Rows/s of a Spark batch read through the data source with 1, 2 and 4 partitions, beside the
pyarrow client's checked read of the same range, in one run on this machine.

    .venv/bin/python clients/python/benchmarks/spark_read.py [--rows 5000000] [--binary PATH]

It creates a simulated database whose dbo.orders holds `--rows` change rows (its seeded
inserts), serves it with the server binary (a release build is best: `cargo build --release`),
and reads the whole range: each Spark read counts its rows (`count()` forces every partition
to be read and checked, without collecting), the pyarrow client reads into a table.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


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
            results.append(
                (
                    partitions,
                    frame.rdd.getNumPartitions(),
                    table.num_rows,
                    table.num_rows / pyarrow_seconds,
                    counted / spark_seconds,
                )
            )
    finally:
        spark.stop()
        server.terminate()
        server.wait()
    print(
        "| partitions | Spark partitions | rows | pyarrow client rows/s | Spark rows/s "
        "| Spark ÷ pyarrow |"
    )
    print("|---|---|---|---|---|---|")
    for partitions, spark_partitions, rows, pyarrow_rate, spark_rate in results:
        print(
            f"| {partitions} | {spark_partitions} | {rows} | {pyarrow_rate:,.0f} | "
            f"{spark_rate:,.0f} | {spark_rate / pyarrow_rate:.2f} |"
        )


if __name__ == "__main__":
    main()
