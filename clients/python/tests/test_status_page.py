"""The writer sidecar's status page in a real browser (headless Chromium) during a chunked
snapshot, its probes flipping while the Flight server is away, and the page's login."""

import base64
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import binary, free_port, run, start_server, workload_database, writer_binary

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    """Debian's Chromium, which .ci/run installs; the test fails (never skips) without it."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: `apt-get install chromium` (.ci/run does)")


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read()


def wait_for(what: str, check, seconds: float):
    deadline = time.monotonic() + seconds
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (ConnectionError, urllib.error.URLError) as error:
            last = error
        else:
            if last:
                return last
        time.sleep(0.2)
    pytest.fail(f"{what} within {seconds} s; last: {last!r}")


def ready(port: int) -> bool:
    status, _, body = get(f"http://127.0.0.1:{port}/readyz")
    return status == 200 and json.loads(body)["ready"]


def not_ready(port: int) -> bool:
    status, _, body = get(f"http://127.0.0.1:{port}/readyz")
    return status == 503 and not json.loads(body)["ready"]


def admin_health(port: int) -> str:
    """The sidecar's gRPC health, asked by the server binary's health command."""
    done = subprocess.run(
        [binary(), "health", "--server", f"http://127.0.0.1:{port}", "--service", ""],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


class Rendered(HTMLParser):
    """What the page rendered: the summary rows, the cells by class, the plots."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict] = {}
        self.plots: list[tuple[str, str]] = []
        self.svg_marks: dict[str, int] = {}
        self.readiness = ""
        self._row = None
        self._cell = None
        self._figure = None
        self._in_readiness = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "data-state" in attrs:
            self._row = attrs["data-table"]
            self.rows[self._row] = {"state": attrs["data-state"], "cells": {}}
        elif tag == "td" and self._row:
            self._cell = (attrs.get("class") or "").split(" ")[-1]
            self.rows[self._row]["cells"].setdefault(self._cell, "")
        elif tag == "p" and attrs.get("id") == "readiness":
            self._in_readiness = True
        elif tag == "figure" and "data-plot" in attrs:
            self._figure = attrs["data-plot"]
        elif tag == "svg" and self._figure:
            self.plots.append((self._figure, tag))
        elif tag in ("polyline", "polygon", "path", "circle") and self._figure:
            self.svg_marks[tag] = self.svg_marks.get(tag, 0) + 1
        elif tag == "progress" and self._row:
            self.rows[self._row]["progress"] = (int(attrs["value"]), int(attrs["max"]))

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._cell = None
        elif tag == "p":
            self._in_readiness = False
        elif tag == "figure":
            self._figure = None

    def handle_data(self, data):
        if self._row and self._cell:
            self.rows[self._row]["cells"][self._cell] += data
        if self._in_readiness:
            self.readiness += data


def render(url: str, profile: Path, screenshot: Path | None = None) -> Rendered:
    """The page as headless Chromium renders it (its DOM after load)."""
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    done = subprocess.run(
        [chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<html" in done.stdout, done.stdout[:500]
    if screenshot is not None:
        subprocess.run(
            [chromium(), *flags, f"--screenshot={screenshot}", "--window-size=1500,1100", url],
            capture_output=True,
            timeout=120,
            check=True,
        )
    page = Rendered()
    page.feed(done.stdout)
    return page


def snapshot_command(verb: str, server: str, lake: Path, *flags: str) -> None:
    """`mssql-cdc-writer snapshot VERB` on dbo.orders's lake."""
    subprocess.run(
        [
            writer_binary(),
            "snapshot",
            verb,
            "--server",
            server,
            "--table",
            "dbo.orders",
            "--target",
            str(lake / "bronze_orders"),
            "--facts",
            str(lake / "facts"),
            "--app-id",
            "orders",
            *flags,
        ],
        check=True,
        capture_output=True,
    )


def test_the_status_page_follows_a_chunked_snapshot_and_the_probes_follow_the_server(tmp_path):
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "150", "--seed", "7", "--clock", "virtual")
    server_port, page_port, admin_port = free_port(), free_port(), free_port()
    server, _ = start_server(directory, port=server_port)
    url = f"http://127.0.0.1:{server_port}"
    lake = tmp_path / "lake"
    # An operator opens a chunked snapshot of dbo.orders and pauses it: the page must show
    # it open, part-way, until it is resumed.
    snapshot_command("open", url, lake, "--mode", "chunked")
    snapshot_command("pause", url, lake, "--reason", "test")
    # Commits after its S: the stream, which starts after the snapshot, has batches to write.
    run("sim", "run", str(directory), "--commits", "20", "--seed", "8", "--clock", "virtual")
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f'server = "{url}"\n'
        f'facts = "{lake / "facts"}"\n'
        f'control = "{lake / "control"}"\n'
        f'checkpoints = "{lake / "checkpoints"}"\n'
        "poll_seconds = 0.3\n"
        f'admin_listen = "127.0.0.1:{admin_port}"\n\n'
        "[[tables]]\n"
        'table = "dbo.orders"\n'
        f'target = "{lake / "bronze_orders"}"\n'
        'app_id = "orders"\n'
        "chunk_rows = 10\n"
        f'silver = "{lake / "silver_orders"}"\n'
        'keys = ["order_id"]\n\n'
        "[[tables]]\n"
        'table = "dbo.customers"\n'
        f'target = "{lake / "bronze_customers"}"\n'
        'app_id = "customers"\n'
    )
    sidecar = subprocess.Popen(
        [
            writer_binary(),
            "--log-format",
            "json",
            "run",
            "--config",
            str(config),
            "--status-listen",
            f"127.0.0.1:{page_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    page_url = f"http://127.0.0.1:{page_port}/"
    try:
        status, _, body = wait_for(
            "the liveness probe", lambda: get(f"{page_url}healthz"), seconds=30
        )
        assert (status, body) == (200, b"ok\n")
        wait_for("every table streaming", lambda: ready(page_port), seconds=60)
        assert wait_for("gRPC health SERVING", lambda: admin_health(admin_port) == "SERVING", 10)

        def planned_and_streamed() -> bool:
            tables = json.loads(get(f"{page_url}status.json")[2])["tables"]
            orders = next(table for table in tables if table["table"] == "dbo.orders")
            chunks = orders["snapshot_chunks"]
            return bool(orders["batches"]) and chunks is not None and chunks[1] is not None

        wait_for("dbo.orders's first batch and its snapshot's plan", planned_and_streamed, 30)
        page = render(page_url, tmp_path / "chrome", screenshot=tmp_path / "page.png")
        assert page.readiness == "Ready: every table streams"
        assert set(page.rows) == {"dbo.orders", "dbo.customers"}
        assert {row["state"] for row in page.rows.values()} == {"running"}
        done, total = page.rows["dbo.orders"]["progress"]
        assert done < total and total > 1, "the paused snapshot shows part-way"
        assert f"{done}/{total} chunks" in page.rows["dbo.orders"]["cells"]["snapshot"]
        assert page.rows["dbo.customers"]["cells"]["snapshot"] == "–"
        # Two plots per table, drawn: the rows as an area, the lag as a line with markers.
        assert sorted(kind for kind, _ in page.plots) == ["behind"] * 2 + ["rows"] * 2
        assert page.svg_marks.get("polygon", 0) + page.svg_marks.get("polyline", 0) >= 2
        assert page.svg_marks.get("circle", 0) >= 2, page.svg_marks
        assert Path(tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # Resumed, the snapshot completes and the page says so.
        snapshot_command("resume", url, lake)

        def complete():
            return render(page_url, tmp_path / "chrome").rows["dbo.orders"]["cells"]["snapshot"]

        assert wait_for("the snapshot complete", lambda: complete() == "complete", 60)

        # The Flight server goes away: both tables retry, the probes say not ready, the page
        # names the error; back on its port, everything is ready again.
        server.kill()
        server.wait()
        wait_for("/readyz 503", lambda: not_ready(page_port), seconds=30)
        assert wait_for(
            "gRPC health NOT_SERVING", lambda: admin_health(admin_port) == "NOT_SERVING", 10
        )
        page = render(page_url, tmp_path / "chrome")
        assert page.readiness.startswith("Not ready: dbo.customers (retrying)")
        assert {row["state"] for row in page.rows.values()} == {"retrying"}
        assert page.rows["dbo.customers"]["cells"]["error"] not in ("", "–")
        server, _ = start_server(directory, port=server_port)
        wait_for("ready again", lambda: ready(page_port), seconds=60)
        assert wait_for("SERVING again", lambda: admin_health(admin_port) == "SERVING", 10)
        page = render(page_url, tmp_path / "chrome")
        assert {row["state"] for row in page.rows.values()} == {"running"}
        # The last error stays on the page after the recovery, with the count of failures.
        assert "failures" in page.rows["dbo.customers"]["cells"]["error"]
    finally:
        sidecar.terminate()
        _, logs = sidecar.communicate(timeout=60)
        server.kill()
        server.wait()
    # Every log line is JSON; the retries are warnings, not errors.
    entries = [json.loads(line) for line in logs.splitlines() if line.strip()]
    retries = [e for e in entries if e["fields"].get("message") == "table failed; retrying"]
    assert retries and {entry["level"] for entry in retries} == {"WARN"}
    assert sidecar.returncode == 0, "SIGTERM stops the sidecar cleanly"


def test_the_page_asks_for_its_own_token_and_the_probes_do_not(tmp_path):
    """The page's token is a viewer's (`status_token_file`): the admin token, which pauses,
    resumes and re-snapshots, does not open the page."""
    directory = tmp_path / "db"
    workload_database(directory, "--commits", "20", "--seed", "3", "--clock", "virtual")
    server_port, page_port = free_port(), free_port()
    server, _ = start_server(directory, port=server_port)
    token = "status-page-token-0123456789"
    admin_token = "admin-service-token-0123456789"
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "admin.token").write_text(admin_token + "\n")
    lake = tmp_path / "lake"
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f'server = "http://127.0.0.1:{server_port}"\n'
        f'facts = "{lake / "facts"}"\n'
        f'control = "{lake / "control"}"\n'
        f'checkpoints = "{lake / "checkpoints"}"\n'
        f'admin_token_file = "{tmp_path / "admin.token"}"\n'
        f'status_token_file = "{tmp_path / "token"}"\n'
        f'status_listen = "127.0.0.1:{page_port}"\n\n'
        "[[tables]]\n"
        'table = "dbo.orders"\n'
        f'target = "{lake / "bronze_orders"}"\n'
        'app_id = "orders"\n'
    )
    sidecar = subprocess.Popen(
        [writer_binary(), "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{page_port}"
    try:
        wait_for("ready", lambda: ready(page_port), seconds=60)
        for path in ("/", "/status.json"):
            status, headers, _ = get(base + path)
            assert status == 401
            assert headers.get("www-authenticate", headers.get("WWW-Authenticate", "")).startswith(
                "Basic"
            )
            wrong = get(base + path, {"Authorization": "Bearer not-the-token-at-all"})
            assert wrong[0] == 401
            admin = get(base + path, {"Authorization": f"Bearer {admin_token}"})
            assert admin[0] == 401, "the admin token is not the page's"
        assert get(base + "/", {"Authorization": f"Bearer {token}"})[0] == 200
        login = base64.b64encode(f"operator:{token}".encode()).decode()
        status, _, body = get(base + "/status.json", {"Authorization": f"Basic {login}"})
        assert status == 200 and json.loads(body)["tables"][0]["table"] == "dbo.orders"
        assert get(base + "/healthz")[0] == 200
        assert get(base + "/readyz")[0] == 200
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=60)
        server.kill()
        server.wait()
