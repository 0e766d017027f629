"""Operating signals, read as a machine would: the server's and the writer's Prometheus
metrics (`--metrics-listen`), scraped over HTTP after real calls and batches, and logs as JSON
lines."""

import json
import os
import re
import subprocess
import time
import urllib.request

from conftest import (
    binary,
    free_port,
    start_server,
    stop_server,
    workload_database,
    writer_binary,
)

import mssql_cdc_flight as cdc


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def scrape_until(port: int, ready, *, seconds: float, pause: float = 0.1) -> dict[str, float]:
    """Scrapes until `ready(samples)` holds or `seconds` have passed (the exporter may not
    listen yet: no samples then); returns the last samples."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            samples = scrape(port)
        except OSError:
            samples = {}
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(pause)


def test_metrics_count_calls_rows_and_streams(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "120", "--seed", "4", "--clock", "virtual")
    port = free_port()
    process, url = start_server(directory, "--metrics-listen", f"127.0.0.1:{port}")
    try:
        client = cdc.connect(url)
        changes = client.read_changes("dbo.orders", client.initial_offset("dbo.orders"))
        try:
            client.initial_offset("dbo.nope")
        except cdc.NotFoundError:
            pass
        rows_key = 'mssql_cdc_flight_rows_served_total{kind="changes"}'
        # The last stream's counters land as its producer finishes.
        samples = scrape_until(
            port, lambda samples: samples.get(rows_key) == changes.num_rows, seconds=5
        )
        assert samples[rows_key] == changes.num_rows
        assert samples['mssql_cdc_flight_calls_total{method="GetFlightInfo",code="OK"}'] >= 1
        assert samples['mssql_cdc_flight_calls_total{method="DoAction",code="NOT_FOUND"}'] == 1
        assert samples['mssql_cdc_flight_streams_total{kind="changes",outcome="complete"}'] >= 1
        assert samples["mssql_cdc_flight_streams_active"] == 0
        assert any(name.startswith("mssql_cdc_flight_call_seconds") for name in samples)
        calls = 'mssql_cdc_flight_source_call_seconds_count{{call="{}",outcome="{}"}}'
        assert samples[calls.format("read_changes", "ok")] >= 1
        assert samples[calls.format("max_lsn", "ok")] >= 1
        # No stream open: the next one alone may use 64 MiB / 8 batches.
        assert samples["mssql_cdc_flight_batch_share_bytes"] == 8 * 1024 * 1024
    finally:
        stop_server(process)


def test_the_writer_counts_batches_rows_and_lag(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "120", "--seed", "6", "--clock", "virtual")
    process, url = start_server(directory)
    port = free_port()
    lake = tmp_path / "lake"
    writer = subprocess.Popen(
        [
            writer_binary(),
            "run",
            "--server",
            url.replace("grpc://", "http://"),
            "--table",
            "dbo.orders",
            "--target",
            str(lake / "bronze"),
            "--facts",
            str(lake / "facts"),
            "--control",
            str(lake / "control"),
            "--app-id",
            "orders",
            "--checkpoint",
            str(lake / "checkpoint"),
            "--poll-seconds",
            "0.2",
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = cdc.connect(url)
        expected = client.read_changes("dbo.orders", client.initial_offset("dbo.orders")).num_rows
        rows_key = 'mssql_cdc_writer_rows_total{table="dbo.orders"}'
        verdict = 'mssql_cdc_writer_finalized_until_seconds{table="dbo.orders",layer="bronze"}'
        # The verdict moves after the batch's rows are counted.
        samples = scrape_until(
            port,
            lambda samples: samples.get(rows_key) == expected and verdict in samples,
            seconds=30,
        )
        assert samples.get(rows_key) == expected, samples
        assert samples['mssql_cdc_writer_batches_total{table="dbo.orders"}'] >= 1
        assert samples['mssql_cdc_writer_bytes_total{table="dbo.orders"}'] > 0
        assert 'mssql_cdc_writer_capture_lag_seconds{table="dbo.orders"}' in samples
        assert samples[verdict] > 1_000_000_000, "a Unix timestamp"
    finally:
        writer.kill()
        writer.wait()
        stop_server(process)


def test_logs_are_json_lines_when_asked(tmp_path):
    done = subprocess.run(
        [binary(), "sim", "init", str(tmp_path / "db"), "--customers", "0", "--orders", "1"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MSSQL_CDC_LOG_FORMAT": "json", "RUST_LOG": "info"},
    )
    entries = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert entries, "sim init logged nothing"
    assert all(entry["level"] in ("INFO", "WARN", "ERROR") for entry in entries)
    assert any(entry["fields"].get("capture_instance") == "dbo_orders" for entry in entries)


def test_the_writer_reports_a_chunked_snapshots_progress(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "150", "--seed", "7", "--clock", "virtual")
    process, url = start_server(directory)
    port = free_port()
    lake = tmp_path / "lake"
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f'server = "{url.replace("grpc://", "http://")}"\n'
        f'facts = "{lake / "facts"}"\n'
        f'control = "{lake / "control"}"\n'
        f'checkpoints = "{lake / "checkpoints"}"\n'
        "poll_seconds = 0.2\n\n"
        "[[tables]]\n"
        'table = "dbo.orders"\n'
        f'target = "{lake / "bronze_orders"}"\n'
        'app_id = "orders"\n'
        'bootstrap = "chunked"\n'
        "chunk_rows = 10\n"
    )
    writer = subprocess.Popen(
        [writer_binary(), "run", "--config", str(config), "--metrics-listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    done_key = 'mssql_cdc_writer_snapshot_chunks_done{table="dbo.orders"}'
    total_key = 'mssql_cdc_writer_snapshot_chunks_total{table="dbo.orders"}'
    try:
        partway = []

        def finished(samples: dict[str, float]) -> bool:
            total = samples.get(total_key)
            if total and samples.get(done_key, 0) < total:
                partway.append(samples.get(done_key, 0))
            return bool(total) and samples.get(done_key) == total

        samples = scrape_until(port, finished, seconds=30, pause=0.05)
        assert samples.get(total_key, 0) > 1, samples
        assert samples.get(done_key) == samples[total_key], samples
        assert partway, "the gauges follow the waves, not only the end"
    finally:
        writer.kill()
        writer.wait()
        stop_server(process)
