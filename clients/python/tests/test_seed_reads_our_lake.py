"""The seed library's own readers (`mssql-cdc-pyspark` 0.8.0) over a lake our writer made:
its facts and plans readers (`mssql_cdc.events`), the chunk reading of its silver
(`silver._chunks`), its verdict reads (`mssql_cdc.finalization`) and its latest-image ranking
(`silver._latest`), each called as the seed calls it, in Spark's local mode.

The seed reads Delta through Spark's Delta connector, whose jars come from Maven, which these
machines do not reach (docs/design-notes.md). Its two reading primitives,
`tables.delta_table(...).toDF()` and `tables.exists`, are served here by the `deltalake`
package's reader instead; every query after them is the seed's own."""

import json
import subprocess
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
from conftest import writer_binary
from deltalake import DeltaTable

# The demo's tables by the key silver keeps one row per (the unique index CDC uses).
SILVER_KEYS = {"orders": ["order_id"], "customers": ["customer_id"], "accounts": ["region", "code"]}
SNAPSHOT_EVENTS = ["snapshot_open", "snapshot_plan", "snapshot_chunk", "bootstrap", "resnapshot"]


class _ReadOnlyDelta:
    """What the seed's readers ask of `delta.tables.DeltaTable`: its rows as a DataFrame."""

    def __init__(self, spark, path):
        self.spark, self.table = spark, DeltaTable(path)

    def toDF(self):  # noqa: N802 - the seed's name
        arrow = self.table.to_pyarrow_table()
        # Spark takes a timestamp without a zone as TIMESTAMP_NTZ, as Delta's connector does.
        return self.spark.createDataFrame(arrow)


@pytest.fixture(scope="module")
def seed(spark):
    import mssql_cdc.events as events
    import mssql_cdc.finalization as finalization
    import mssql_cdc.silver as silver
    import mssql_cdc.tables as tables

    def delta_table(_spark, path):
        return _ReadOnlyDelta(spark, path)

    def exists(_spark, path):
        try:
            DeltaTable(path)
        except Exception:  # deltalake raises TableNotFoundError and kin
            return False
        return True

    patched = [(tables, "delta_table"), (tables, "exists"), (finalization, "delta_table")]
    patched += [(silver, "delta_table"), (silver, "exists")]
    saved = [(module, name, getattr(module, name)) for module, name in patched]
    for module, name in patched:
        setattr(module, name, delta_table if name == "delta_table" else exists)
    yield events, finalization, silver
    for module, name, original in saved:
        setattr(module, name, original)


def plain(row):
    """`row` with a zoned time as the UTC time Spark gives back (its session is in UTC)."""
    return {
        name: value.astimezone(timezone.utc).replace(tzinfo=None)
        if isinstance(value, datetime) and value.tzinfo
        else value
        for name, value in row.items()
    }


def facts_targets(lake):
    facts = DeltaTable(str(lake / "facts")).to_pyarrow_table(columns=["target", "event"])
    return sorted({row["target"] for row in facts.to_pylist() if row["event"] == "snapshot_open"})


def read_chunked_snapshots(seed, spark, lake, target):
    """Every chunked snapshot of `target` as the seed's readers find it, checked whole: its
    open's payload, its plan tiling the key, every chunk read once with the plan's bounds, and
    its completion. Returns `(info, completion row)` of each, by S."""
    events, _, silver = seed
    columns = ["event", "detail", "min_lsn", "max_lsn", "lost_from_ts", "lost_to_ts"]
    rows = events.read(spark, str(lake / "facts"), target, SNAPSHOT_EVENTS, columns)
    opens = events.chunked_opens(rows)
    assert opens, f"{target}: the seed finds its chunked open"
    completed = events.completions(rows)
    found = {}
    for open_row in opens:
        s = open_row["max_lsn"]
        kept = events.plans(spark, target, s)
        info = kept.whole("snapshot_open", json.loads(open_row["detail"]))
        assert info["mode"] == "chunked" and info["kind"] in ("bootstrap", "resnapshot")
        assert info["keys"] and all(isinstance(key, str) for key in info["keys"])
        extent = info["plan"]
        if extent["kind"] == "int":
            assert len(info["keys"]) == 1 and extent["lo"] <= extent["hi"]
            assert isinstance(extent["rows"], int)
        else:
            assert extent["kind"] == "keyset" and "max" in extent
        plan = events.plan_of(rows, s, kept)
        assert plan is not None, f"{target}: the seed finds the plan of {s}"
        assert plan["kind"] == extent["kind"] and plan["keys"] == info["keys"]
        pairs = plan["chunks"]
        assert len(pairs) == plan["chunk_count"] > 0
        # The seed's tiling: the first chunk open below, each starting where the one before
        # it ended.
        assert pairs[0][0] is None
        for before, after in zip(pairs, pairs[1:], strict=False):
            assert before[1] == after[0], f"{target}: {before} then {after}"
        announced = [r for _, r in events.chunks_of(rows, s)]
        chunks = silver._chunks(announced, kept)
        assert sorted(chunks) == list(range(len(pairs))), "every chunk read once"
        for index, chunk in chunks.items():
            assert chunk.lo == pairs[index][0]
            last = index == len(pairs) - 1
            # A keyset plan's last chunk, open when planned, ends where it was sought.
            assert chunk.hi == pairs[index][1] or (last and pairs[index][1] is None)
            assert chunk.stamp >= s
        assert s in completed, f"{target}: the seed sees {s} complete"
        done = [r for r in rows if r["event"] in ("bootstrap", "resnapshot") and r["max_lsn"] == s]
        found[s] = (info, done[0])
    return found


def test_the_seeds_facts_and_plans_readers_read_every_chunked_snapshot_whole(seed, spark, lake):
    targets = facts_targets(lake)
    assert len(targets) == 3, "the demo's three tables each opened a chunked snapshot"
    kinds = set()
    for target in targets:
        for info, _ in read_chunked_snapshots(seed, spark, lake, target).values():
            kinds.add(info["plan"]["kind"])
    assert kinds == {"int", "keyset"}, "an integer key and a composite text key"


def test_the_seeds_readers_find_a_heals_gap_on_its_open_and_its_resnapshot_row(
    seed, spark, tmp_path
):
    """The data-loss demo: a purge healed by a chunked re-snapshot. The seed reads the gap
    from the healing open's payload and from its 'resnapshot' row's lost_* columns."""
    subprocess.run(
        [writer_binary(), "demo", "--scenario", "data-loss", "--dir", str(tmp_path)]
        + ["--commits", "200"],
        check=True,
        capture_output=True,
        text=True,
    )
    lake = tmp_path / "lake"
    [target] = facts_targets(lake)
    found = read_chunked_snapshots(seed, spark, lake, target)
    kinds = sorted(info["kind"] for info, _ in found.values())
    assert kinds == ["bootstrap", "resnapshot"]
    for info, done in found.values():
        if info["kind"] == "bootstrap":
            assert done["event"] == "bootstrap" and done["lost_to_ts"] is None
            continue
        assert done["event"] == "resnapshot"
        assert info["lost_to_ts"] is not None, info
        assert done["lost_to_ts"] is not None, done


def test_the_seeds_verdict_reads_give_our_control_tables_verdict(seed, spark, lake):
    _, finalization, _ = seed
    control = str(lake / "control")
    ours = DeltaTable(control).to_pyarrow_table().to_pylist()
    assert ours, "the demo wrote a verdict"
    for row in ours:
        name = row["table_name"]
        until = finalization.finalized_until(spark, control, name)
        assert until == row["finalized_until"] is not None
        fresh = finalization.freshness(spark, control, name)
        assert fresh["finalized_until"] == row["finalized_until"]
        assert fresh["updated_at"] == row["updated_at"]
        assert fresh["open_snapshot_lsn"] == row["open_snapshot_lsn"]
        assert fresh["age_seconds"] > 0
        assert finalization.is_final(spark, control, name, until)
        assert not finalization.is_final(spark, control, name, until + timedelta(hours=1))


def test_the_seeds_latest_image_ranking_over_our_bronze_gives_our_silver(seed, spark, lake):
    """Silver is each key's last image in bronze after the last complete snapshot. The seed's
    `_latest` ranks bronze rows by `(_start_lsn, _command_id, _seqval, _operation)`: over the
    snapshot's rows and the changes after it, its live keys are our silver row for row."""
    _, _, silver = seed
    for name, keys in SILVER_KEYS.items():
        silver_path = lake / f"silver_{name}"
        ours = DeltaTable(str(silver_path)).to_pyarrow_table()
        bronze = DeltaTable(str(lake / f"bronze_{name}")).to_pyarrow_table()
        columns = [name for name in ours.column_names if not name.startswith("_")]
        # The rows silver is built from: the newest complete snapshot's and the changes after S.
        rows = bronze.select(["_snapshot", "_start_lsn", "_operation"]).to_pylist()
        snapshot = max(r["_snapshot"] or r["_start_lsn"] for r in rows if r["_operation"] == 0)
        frame = spark.createDataFrame(bronze).where(
            f"(_operation = 0 AND coalesce(_snapshot, _start_lsn) = '{snapshot}') "
            f"OR (_operation != 0 AND _start_lsn > '{snapshot}')"
        )
        latest = silver._latest(frame, keys, columns, "_command_id" in bronze.column_names)
        # As the seed's apply_changes reads it: 1 deletes the key, and so does a 3 that ranks
        # last (an update that moved the row to another key).
        live = latest.where("_operation NOT IN (1, 3)").drop("_operation")
        theirs = pa.Table.from_pylist([row.asDict() for row in live.collect()])
        order = [(key, "ascending") for key in keys]
        left = [plain(row) for row in theirs.select(columns).sort_by(order).to_pylist()]
        right = [plain(row) for row in ours.select(columns).sort_by(order).to_pylist()]
        assert left == right, f"{name}: the seed's ranking and our silver differ"
