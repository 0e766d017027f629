"""The seed library's own readers (`mssql-cdc-pyspark` 0.8.0) over a lake our writer made:
its facts and plans readers (`mssql_cdc.events`), the chunk reading of its silver
(`silver._chunks`), its verdict reads (`mssql_cdc.finalization`) and its latest-image ranking
(`silver._latest`), each called as the seed calls it, in Spark's local mode.

The seed reads Delta through Spark's Delta connector, whose jars come from Maven, which these
machines do not reach (docs/design-notes.md). Its two reading primitives,
`tables.delta_table(...).toDF()` and `tables.exists`, are served here by the `deltalake`
package's reader instead; every query after them is the seed's own."""

import json
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
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


def test_the_seeds_facts_and_plans_readers_read_every_chunked_snapshot_whole(seed, spark, lake):
    events, _, silver = seed
    targets = facts_targets(lake)
    assert len(targets) == 3, "the demo's three tables each opened a chunked snapshot"
    kinds = set()
    for target in targets:
        rows = events.read(
            spark,
            str(lake / "facts"),
            target,
            SNAPSHOT_EVENTS,
            ["event", "detail", "min_lsn", "max_lsn"],
        )
        opens = events.chunked_opens(rows)
        assert opens, f"{target}: the seed finds its chunked open"
        completed = events.completions(rows)
        for open_row in opens:
            s = open_row["max_lsn"]
            kept = events.plans(spark, target, s)
            info = kept.whole("snapshot_open", json.loads(open_row["detail"]))
            assert info["mode"] == "chunked" and info["kind"] in ("bootstrap", "resnapshot")
            assert info["keys"] and all(isinstance(key, str) for key in info["keys"])
            extent = info["plan"]
            kinds.add(extent["kind"])
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
            # The seed's tiling: the first chunk open below, each starting where the one
            # before it ended.
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
    assert kinds == {"int", "keyset"}, "an integer key and a composite text key"


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
