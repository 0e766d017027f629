"""Our bronze, facts and control tables read by an independent Delta reader (the Python
`deltalake` package), after the writer's demo streamed a simulated database into a lake, or
a stream of many small batches compacted its tables as it went."""

import json
import math
import re
import struct
import subprocess
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from conftest import (
    change_rows,
    journal_rows,
    run,
    start_server,
    stop_server,
    workload_database,
    writer_binary,
)
from deltalake import DeltaTable, QueryBuilder

FACTS_COLUMNS = [
    "app_id",
    "batch_id",
    "rows",
    "min_lsn",
    "max_lsn",
    "min_commit_ts",
    "max_commit_ts",
    "deletes",
    "inserts",
    "updates",
    "started_at",
    "duration_ms",
    "source_rtt_ms",
    "read_seconds",
    "read_mb",
    "network_wait_ms",
    "retention_watermark_ts",
    "retention_headroom_hours",
    "event",
    "lost_from_ts",
    "lost_to_ts",
    "source_max_commit_ts",
    "capture_lag_seconds",
    "ingestion_lag_seconds",
    "end_lsn",
    "end_commit_ts",
    "detail",
    "target",
    "written_at",
]


def test_tables_carry_their_schema_version_and_comments(lake):
    for name, version in [
        ("bronze_orders", "2"),
        ("bronze_customers", "2"),
        ("facts", "13"),
        ("control", "6"),
        ("reconcile", "1"),
    ]:
        table = DeltaTable(str(lake / name))
        assert table.metadata().configuration["mssql_cdc.schema_version"] == version
        assert table.metadata().description.startswith("mssql_cdc ")
    bronze = DeltaTable(str(lake / "bronze_orders")).schema()
    start_lsn = next(field for field in bronze.fields if field.name == "_start_lsn")
    assert "commit LSN" in start_lsn.metadata["comment"]
    facts = DeltaTable(str(lake / "facts")).schema()
    assert [field.name for field in facts.fields] == FACTS_COLUMNS
    assert all(field.metadata.get("comment") for field in facts.fields)


def test_the_demos_reconcile_report_and_verified_lsns_read_back(lake):
    report = DeltaTable(str(lake / "reconcile"))
    assert all(field.metadata.get("comment") for field in report.schema().fields)
    rows = report.to_pyarrow_table()
    buckets = rows.filter(pc.is_valid(rows["status"]))
    assert buckets.num_rows > 0
    assert set(buckets["status"].to_pylist()) <= {"MATCH", "IN_FLIGHT"}
    assert pc.sum(buckets["source_rows"]).as_py() == pc.sum(buckets["silver_rows"]).as_py()
    assert len(set(rows["run_id"].to_pylist())) == 3  # one run per table
    control = DeltaTable(str(lake / "control")).to_pyarrow_table()
    silver = control.filter(pc.match_substring(control["table_name"], "silver_"))
    assert silver.num_rows == 3
    assert all(lsn.startswith("0x") for lsn in silver["verified_lsn"].to_pylist())
    # The demo compares every bucket row by row: every value is verified too.
    assert silver["values_verified_lsn"].to_pylist() == silver["verified_lsn"].to_pylist()


def test_bronze_holds_what_the_facts_count(lake):
    facts = DeltaTable(str(lake / "facts")).to_pyarrow_table()
    batches = facts.filter(pc.is_null(facts["event"]))
    completions = facts.filter(pc.equal(facts["event"], "bootstrap"))
    for name, app_id in [
        ("bronze_orders", "demo_orders"),
        ("bronze_customers", "demo_customers"),
        ("bronze_accounts", "demo_accounts"),
    ]:
        bronze = DeltaTable(str(lake / name)).to_pyarrow_table()
        changes = bronze.filter(pc.not_equal(bronze["_operation"], 0))
        snapshot = bronze.filter(pc.equal(bronze["_operation"], 0))
        mine = batches.filter(pc.equal(batches["app_id"], app_id))
        assert changes.num_rows == pc.sum(mine["rows"]).as_py() > 0
        done = completions.filter(pc.equal(completions["app_id"], app_id))
        assert done.num_rows == 1, "one completed snapshot"
        assert snapshot.num_rows == done["rows"][0].as_py() > 0
        assert set(snapshot["_snapshot"].to_pylist()) == {done["min_lsn"][0].as_py()}
        assert all(
            stamp >= done["min_lsn"][0].as_py() for stamp in snapshot["_start_lsn"].to_pylist()
        )
        ids = mine["batch_id"].to_pylist()
        assert sorted(ids) == list(range(len(ids))), "one facts row per batch"
        assert set(changes["_batch_id"].to_pylist()) <= set(ids)
        assert all(re.fullmatch(r"0x[0-9A-F]{20}", lsn) for lsn in bronze["_start_lsn"].to_pylist())
        assert set(changes["_operation"].to_pylist()) <= {1, 2, 3, 4}
        assert pc.sum(mine["inserts"]).as_py() == pc.sum(pc.equal(changes["_operation"], 2)).as_py()


def test_silver_is_typed_commented_and_one_row_per_key(lake):
    for name, keys in [
        ("silver_orders", ["order_id"]),
        ("silver_customers", ["customer_id"]),
        ("silver_accounts", ["region", "code"]),
    ]:
        table = DeltaTable(str(lake / name))
        assert table.metadata().configuration["mssql_cdc.schema_version"] == "1"
        assert table.metadata().description.startswith("mssql_cdc silver")
        fields = {field.name: field for field in table.schema().fields}
        assert "comment" in fields["_start_lsn"].metadata
        assert "_operation" not in fields
        rows = table.to_pyarrow_table()
        assert rows.num_rows > 0
        assert (
            len(set(zip(*(rows[key].to_pylist() for key in keys), strict=False))) == rows.num_rows
        )


def test_the_verdict_is_never_ahead_of_the_data(lake):
    control = DeltaTable(str(lake / "control")).to_pyarrow_table().to_pylist()
    facts = DeltaTable(str(lake / "facts")).to_pyarrow_table()
    bronze = {row["table_name"]: row for row in control if row["table_name"].startswith("dbo.")}
    assert sorted(bronze) == ["dbo.accounts", "dbo.customers", "dbo.orders"]
    latest_end = pc.max(facts["end_commit_ts"]).as_py()
    for row in bronze.values():
        assert row["finalized_until"] is not None
        assert row["finalized_until"] <= latest_end
        assert row["finalized_until"] <= row["end_commit_ts"]
    silver = {row["table_name"]: row for row in control if "silver_" in row["table_name"]}
    assert len(silver) == 3
    for name, row in silver.items():
        table = "dbo." + name.rstrip("/").rsplit("silver_", 1)[1]
        assert row["applied_lsn"] is not None
        assert row["finalized_until"] is not None
        assert row["finalized_until"] <= bronze[table]["finalized_until"]


def assert_seed_payload(event, detail):
    """`detail` of a facts row of `event` holds every key the seed's payload type of that
    event requires, each of the type it declares (mssql_cdc.payloads); events the seed does
    not know are skipped (design-notes: they are ours alone)."""
    import typing

    from mssql_cdc import payloads

    shapes = {
        "snapshot_open": payloads.SnapshotOpenDetail,
        "snapshot_plan": payloads.SnapshotPlanDetail,
        "snapshot_chunk": payloads.SnapshotChunkDetail,
        "data_skipped": payloads.DataSkippedDetail,
    }
    value = json.loads(detail) if detail else None
    if event in ("bootstrap", "resnapshot") and value and value.get("mode") == "chunked":
        shape = payloads.SnapshotCompletionDetail
    elif event in shapes:
        shape = shapes[event]
    else:
        return
    hints = typing.get_type_hints(shape)
    missing = shape.__required_keys__ - set(value)
    assert not missing, f"{event} lacks {sorted(missing)} the seed requires: {value}"

    def fits(item, hint):
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is typing.Any:
            return True
        if origin is typing.Literal:
            return item in args
        if origin in (typing.Union, __import__("types").UnionType):
            return any(fits(item, arg) for arg in args)
        if hint is type(None):
            return item is None
        if origin is list:
            return isinstance(item, list)
        if hint is int:
            return isinstance(item, int) and not isinstance(item, bool)
        if isinstance(hint, type) and hint.__name__.endswith("Extent"):
            return isinstance(item, dict)
        if isinstance(hint, type):
            return isinstance(item, hint)
        return isinstance(item, dict)  # a TypedDict union (SnapshotExtent)

    for key, item in value.items():
        if key in hints:
            assert fits(item, hints[key]), f"{event}.{key} = {item!r} is not {hints[key]}"


def test_the_data_loss_demo_heals_by_resnapshot_and_its_tables_say_how(tmp_path):
    completed = subprocess.run(
        [writer_binary(), "demo", "--scenario", "data-loss", "--dir", str(tmp_path)]
        + ["--commits", "200"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "healed without an operator" in completed.stdout
    lake = tmp_path / "lake"
    facts = DeltaTable(str(lake / "facts")).to_pyarrow_table()
    losses = facts.filter(pc.equal(facts["event"], "data_loss"))
    assert losses.num_rows == 1, "one data_loss row names the gap"
    loss = losses.to_pylist()[0]
    assert loss["min_lsn"] < loss["max_lsn"], "the lost range runs from the offset to S"
    # The offset's own commit time went with the purged lsn_time_mapping rows: unknown here.
    assert loss["lost_to_ts"] is not None
    assert loss["lost_from_ts"] is None or loss["lost_from_ts"] < loss["lost_to_ts"]
    resnapshot = facts.filter(pc.equal(facts["event"], "resnapshot"))
    assert resnapshot["min_lsn"].to_pylist() == [loss["max_lsn"]], "completed at S"
    opens = facts.filter(pc.equal(facts["event"], "snapshot_open")).to_pylist()
    kinds = {row["min_lsn"]: json.loads(row["detail"])["kind"] for row in opens}
    assert kinds[loss["max_lsn"]] == "resnapshot"
    assert sorted(kinds.values()) == ["bootstrap", "resnapshot"]
    # As the seed's: the healing open carries the gap, from the stream's position to the
    # commit time of the min_lsn cleanup had reached (at or before S's, the data_loss row's
    # end), and its completion copies it; no other open has one.
    for row in opens:
        if row["min_lsn"] != loss["max_lsn"]:
            assert (row["lost_from_ts"], row["lost_to_ts"]) == (None, None)
            continue
        gap = (row["lost_from_ts"], row["lost_to_ts"])
        assert row["lost_from_ts"] == loss["lost_from_ts"]
        assert row["lost_to_ts"] is not None and row["lost_to_ts"] <= loss["lost_to_ts"]
    completed = resnapshot.to_pylist()[0]
    assert (completed["lost_from_ts"], completed["lost_to_ts"]) == gap
    # Event rows count no change: 0, as the seed writes them.
    for row in facts.to_pylist():
        if row["event"] is not None:
            counts = (row["deletes"], row["inserts"], row["updates"])
            assert counts == (0, 0, 0), row
    # Every snapshot payload has the keys and value types the seed's readers take
    # (mssql_cdc.payloads, the seed library's own TypedDicts).
    for row in facts.to_pylist():
        assert_seed_payload(row["event"], row["detail"])
    report = DeltaTable(str(lake / "reconcile")).to_pyarrow_table()
    runs = report.filter(pc.is_valid(report["status"]))
    assert set(runs["status"].to_pylist()) == {"MATCH"}, "both reconciles match"
    assert len(set(runs["run_id"].to_pylist())) == 2


def test_bronze_and_facts_compacted_as_the_stream_went_read_whole(server, database, tmp_path):
    """A stream of many small batches: its bronze and facts tables compacted their small
    files as they grew (OPTIMIZE commits in their logs, few live files), and an independent
    reader finds every journaled change once and one facts row per batch."""
    _, journal = database
    lake = tmp_path / "lake"
    subprocess.run(
        [writer_binary(), "run", "--server", server, "--table", "dbo.orders"]
        + ["--target", str(lake / "bronze_orders"), "--facts", str(lake / "facts")]
        + ["--control", str(lake / "control"), "--checkpoint", str(tmp_path / "checkpoint")]
        + ["--app-id", "orders", "--max-commits", "8", "--available-now"],
        check=True,
        capture_output=True,
        text=True,
    )
    bronze = DeltaTable(str(lake / "bronze_orders"))
    assert change_rows(bronze.to_pyarrow_table()) == journal_rows(journal, "dbo.orders")
    facts = DeltaTable(str(lake / "facts"))
    batches = facts.to_pyarrow_table()["batch_id"].to_pylist()
    assert sorted(batches) == list(range(len(batches))), "one facts row per batch"
    for table in [bronze, facts]:
        assert "OPTIMIZE" in [entry["operation"] for entry in table.history()]
        assert len(table.file_uris()) < len(batches) // 2, (len(table.file_uris()), len(batches))


def test_silver_with_deletion_vectors_reads_as_the_copy_on_write_silver(tmp_path):
    """Two silvers of one bronze, one merged with deletion vectors (replaced rows marked
    beside their files) and one by copy-on-write: an independent reader finds the same rows
    in both, and the first one's log holds vectors."""
    database = tmp_path / "db"
    workload = ["--table", "dbo.orders", "--clock", "virtual", "--max-rows-per-statement", "4"]
    workload_database(database, "--commits", "1000", "--seed", "5", *workload)
    process, server = start_server(database)
    lake = tmp_path / "lake"
    silvers = {"vectors": lake / "silver_vectors", "copy": lake / "silver_copy"}

    def stream_and_apply():
        subprocess.run(
            [writer_binary(), "run", "--server", server, "--table", "dbo.orders"]
            + ["--target", str(lake / "bronze"), "--facts", str(lake / "facts")]
            + ["--control", str(lake / "control"), "--checkpoint", str(tmp_path / "checkpoint")]
            + ["--app-id", "orders", "--available-now"],
            check=True,
            capture_output=True,
            text=True,
        )
        for name, silver in silvers.items():
            subprocess.run(
                [writer_binary(), "apply", "--table", "dbo.orders", "--keys", "order_id"]
                + ["--bronze", str(lake / "bronze"), "--target", str(silver)]
                + ["--control", str(lake / "control"), "--facts", str(lake / "facts")]
                + (["--deletion-vectors"] if name == "vectors" else []),
                check=True,
                capture_output=True,
                text=True,
            )

    try:
        stream_and_apply()
        # Files of a few KiB are then not small: the merge marks them instead of folding them.
        for silver in silvers.values():
            DeltaTable(str(silver)).alter.set_table_properties({"delta.targetFileSize": "1024"})
        # Few changes: each file keeps most of its rows, so the merge marks them.
        run("sim", "run", str(database), "--commits", "30", "--seed", "6", *workload)
        stream_and_apply()
    finally:
        stop_server(process)

    vectors = DeltaTable(str(silvers["vectors"]))
    assert "deletionVectors" in vectors.protocol().reader_features
    marked = 0
    for entry in (silvers["vectors"] / "_delta_log").glob("*.json"):
        for line in entry.read_text().splitlines():
            add = json.loads(line).get("add")
            marked += bool(add and add.get("deletionVector"))
    assert marked > 0, "the merge marked rows in deletion vectors"

    # The package's pyarrow reading path refuses deletion vectors; its DataFusion one applies them.
    def read(table):
        query = QueryBuilder().register("silver", table)
        return pa.table(query.execute("SELECT * FROM silver ORDER BY order_id").read_all())

    rows = read(vectors)
    copy = read(DeltaTable(str(silvers["copy"])))
    assert rows.num_rows > 0
    assert len(set(rows["order_id"].to_pylist())) == rows.num_rows, "one row per key"
    assert rows.to_pylist() == copy.to_pylist()
    physical = sum(
        pq.read_metadata(uri.removeprefix("file://")).num_rows for uri in vectors.file_uris()
    )
    assert physical > rows.num_rows, "replaced rows are still in their files, marked"


def test_a_value_changed_by_another_engine_is_found_by_the_value_sums_alone(tmp_path):
    """One value of one silver row changed by the Python `deltalake` package, for each type
    the simulator serves (the last fraction of a decimal, one microsecond, one float ulp,
    NULL to empty text, a letter's case, a byte of binary): reconcile at sample 0 finds its
    bucket by the value sums alone (rows, key sum and key hash sum equal) and names the key
    and the column; silver restored, every value is verified."""
    database = tmp_path / "db"
    run("sim", "init", str(database), "--customers", "0", "--orders", "0", "--types", "200")
    process, server = start_server(database)
    lake = tmp_path / "lake"
    silver = str(lake / "silver")
    tables = ["--bronze", str(lake / "bronze"), "--control", str(lake / "control")]

    def writer(*args):
        return subprocess.run([writer_binary(), *args], capture_output=True, text=True)

    def reconcile():
        done = writer(
            "reconcile", "--server", server, "--table", "dbo.types", "--silver", silver,
            *tables, "--sample", "0", "--output", "json",
        )  # fmt: skip
        assert done.returncode in (0, 1), done.stderr
        return done.returncode, json.loads(done.stdout)

    try:
        streamed = writer(
            "run", "--server", server, "--table", "dbo.types", "--target", str(lake / "bronze"),
            "--facts", str(lake / "facts"), "--control", str(lake / "control"),
            "--checkpoint", str(tmp_path / "checkpoint"), "--app-id", "types", "--available-now",
        )  # fmt: skip
        assert streamed.returncode == 0, streamed.stderr
        applied = writer(
            "apply", "--table", "dbo.types", "--keys", "id", "--target", silver, *tables,
            "--facts", str(lake / "facts"),
        )  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        code, clean = reconcile()
        assert code == 0 and clean["value_sums"] and clean["values_verified"], clean
        assert clean["hashed"] == 0, "sample 0: no bucket read row by row"

        table = DeltaTable(silver)
        rows = table.to_pyarrow_table().sort_by("id").to_pylist()

        def first(column, holds):
            return next(row for row in rows if holds(row[column]))

        def text_case(value):
            """The value with its first letter's case swapped."""
            at = next(i for i, char in enumerate(value) if char.isalpha())
            return value[:at] + value[at].swapcase() + value[at + 1 :]

        def quoted(text):
            return "'" + text.replace("'", "''") + "'"

        def float_ulp(value):
            return f"CAST('{math.nextafter(value, math.inf)!r}' AS DOUBLE)"

        def real_ulp(value):
            bits = struct.unpack("<I", struct.pack("<f", value))[0]
            bits += 1 if value >= 0 else -1
            return f"CAST('{struct.unpack('<f', struct.pack('<I', bits))[0]!r}' AS REAL)"

        def one_byte(value):
            changed = value[:-1] + bytes([value[-1] ^ 1])
            return f"X'{changed.hex()}'"

        is_value = lambda value: value is not None  # noqa: E731
        has_letter = lambda value: value is not None and any(c.isalpha() for c in value)  # noqa: E731
        step = "INTERVAL '1 microsecond'"
        # (what changes, column, which row, the new value as a SQL expression of the old)
        cases = [
            ("a bit", "c_bit", is_value, lambda v: str(not v).lower()),
            ("a tinyint", "c_tinyint", is_value, lambda v: f"CAST({v ^ 1} AS SMALLINT)"),
            ("a smallint", "c_smallint", is_value, lambda v: f"CAST({v ^ 1} AS SMALLINT)"),
            ("a bigint", "c_bigint", is_value, lambda v: f"CAST({v ^ 1} AS BIGINT)"),
            ("a real's ulp", "c_real", is_value, real_ulp),
            ("a float's ulp", "c_float", is_value, float_ulp),
            ("a decimal's last fraction", "c_decimal", is_value,
             lambda v: f"CAST('{v + Decimal('1e-10')}' AS DECIMAL(38,10))"),
            ("money's last fraction", "c_money", is_value,
             lambda v: f"CAST('{v + Decimal('0.0001')}' AS DECIMAL(19,4))"),
            ("smallmoney's last fraction", "c_smallmoney", is_value,
             lambda v: f"CAST('{v + Decimal('0.0001')}' AS DECIMAL(10,4))"),
            ("a date's day", "c_date", is_value, lambda v: "c_date + INTERVAL '1 day'"),
            ("a datetime's microsecond", "c_datetime", is_value, lambda v: f"c_datetime + {step}"),
            ("a smalldatetime's microsecond", "c_smalldatetime", is_value,
             lambda v: f"c_smalldatetime + {step}"),
            ("a datetime2's microsecond", "c_datetime2", is_value,
             lambda v: f"c_datetime2 + {step}"),
            ("a datetimeoffset's microsecond", "c_datetimeoffset", is_value,
             lambda v: f"c_datetimeoffset + {step}"),
            ("a time's last digit", "c_time", is_value,
             lambda v: quoted(v[:-1] + ("1" if v[-1] == "0" else "0"))),
            ("a char's letter case", "c_char", has_letter, lambda v: quoted(text_case(v))),
            ("a varchar's letter case", "c_varchar", has_letter, lambda v: quoted(text_case(v))),
            ("an nchar's letter case", "c_nchar", has_letter, lambda v: quoted(text_case(v))),
            ("an nvarchar's letter case", "c_nvarchar", has_letter,
             lambda v: quoted(text_case(v))),
            ("NULL to empty text", "c_nvarchar", lambda v: v is None, lambda v: "''"),
            ("text to NULL", "c_nvarchar_max", is_value,
             lambda v: "CAST(NULL AS VARCHAR)"),
            ("a GUID's letter case", "c_uniqueidentifier", has_letter,
             lambda v: quoted(text_case(v))),
            ("a binary's byte", "c_binary", is_value, one_byte),
            ("a varbinary's byte", "c_varbinary", lambda v: bool(v), one_byte),
        ]  # fmt: skip
        for what, column, holds, changed in cases:
            row = first(column, holds)
            before = table.version()
            table.update(updates={column: changed(row[column])}, predicate=f"id = {row['id']}")
            code, result = reconcile()
            assert code == 1 and not result["verified"], (what, result)
            [bucket] = [b for b in result["bucket_list"] if b["status"] == "MISMATCH"]
            source, held = bucket["source"], bucket["silver"]
            for same in ("rows", "key_sum", "key_hash_sum"):
                assert source[same] == held[same], (what, same, bucket)
            assert source["value_sum"] != held["value_sum"], (what, bucket)
            assert [(f["key"], f["failure_type"], f["columns"]) for f in result["findings"]] == [
                ({"id": row["id"]}, "RECORD_DIFF", [column])
            ], (what, result["findings"])
            table.restore(before)
            table = DeltaTable(silver)
        code, restored = reconcile()
        assert code == 0 and restored["values_verified"], restored
    finally:
        stop_server(process)
