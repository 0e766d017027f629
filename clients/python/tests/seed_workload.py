"""A seeded workload written with the seed library's own simulator (`FakeCdcDatabase` of
`mssql-cdc-pyspark`): random inserts, updates, deletes and key updates on two tables (an
integer key and a composite one), idle entries, and on request a second capture instance with
a new column. Used by test_seed_fake.py and, as a script, by the Rust conformance suite:

    python seed_workload.py DIR [--seed N] [--commits N] [--switch] [--cleanup]
"""

import argparse
import random
from datetime import date, datetime, timedelta

from mssql_cdc.fake import FakeCdcClient, FakeCdcDatabase

# qty2 is a computed column (qty * 2): NULL in every change row, kept in the table's rows, never
# captured (SQL Server CDC and the seed's model alike).
ORDERS = (
    "id INT, customer STRING, qty BIGINT, qty2 BIGINT, price DOUBLE, total DECIMAL(18,2), day DATE"
)
ORDERS_V2 = ORDERS + ", note STRING"
LINES = "order_id INT, line INT, sku STRING, amount DOUBLE"
COMPUTED = {"orders": ["qty2"]}


def captured(spec: str, table: str) -> list[str]:
    """The names of `spec`'s columns a capture serves: its computed ones left out."""
    names = [part.split(" ")[0] for part in spec.split(", ")]
    return [name for name in names if name not in COMPUTED.get(table, [])]


KEYS = {"orders": "id", "lines": ["order_id", "line"]}


class SeedWorkload:
    """Random transactions written with the seed's own FakeCdcDatabase, deterministic per seed;
    keeps the rows it expects each table to hold."""

    def __init__(self, path, seed: int):
        self.db = FakeCdcDatabase(
            str(path),
            ["orders", "lines"],
            keys=KEYS,
            columns={"orders": ORDERS, "lines": LINES},
            computed=COMPUTED,
        )
        self.rng = random.Random(seed)
        self.clock = datetime(2026, 3, 1, 8, 0, 0)
        self.rows = {"orders": {}, "lines": {}}
        self.next_id = 1
        self.with_note = False

    def _at(self) -> datetime:
        self.clock += timedelta(milliseconds=self.rng.randint(1, 90_000))
        return self.clock

    def _order(self, key: int) -> dict:
        rng = self.rng
        row = {
            "id": key,
            "customer": rng.choice(["Ada", "bob", "Chloé", "dmitri ", None]),
            "qty": rng.randint(-5, 10**12),
            "qty2": None,
            "price": round(rng.uniform(0, 1000), 3),
            "total": f"{rng.randint(-(10**6), 10**8) / 100:.2f}",
            "day": (date(2025, 1, 1) + timedelta(days=rng.randint(0, 700))).isoformat(),
        }
        row["qty2"] = row["qty"] * 2
        if self.with_note:
            row["note"] = rng.choice(["gift", "rush", None])
        return row

    def _line(self, key: tuple) -> dict:
        sku = self.rng.choice(["A-1", "b-2", "C-3"])
        return {"order_id": key[0], "line": key[1], "sku": sku, "amount": self.rng.random()}

    def _changes(self, table: str) -> list:
        rows, rng, changes = self.rows[table], self.rng, []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if not rows or kind < 0.45:
                if table == "orders":
                    key, self.next_id = self.next_id, self.next_id + 1
                    row = self._order(key)
                else:
                    key = (rng.randint(1, 40), rng.randint(1, 5))
                    if key in rows:
                        continue
                    row = self._line(key)
                rows[key] = row
                changes.append((2, row))
                continue
            key = rng.choice(sorted(rows))
            old = rows[key]
            if kind < 0.75:
                new = self._order(key) if table == "orders" else self._line(key)
                rows[key] = new
                changes += [(3, old), (4, new)]
            elif kind < 0.9 or table == "lines":
                del rows[key]
                changes.append((1, old))
            else:  # a key update: a delete and an insert, as SQL Server logs most of them
                moved, self.next_id = self.next_id, self.next_id + 1
                new = {**old, "id": moved}
                del rows[key]
                rows[moved] = new
                changes += [(1, old), (2, new)]
        return changes

    def commits(self, count: int) -> str:
        """`count` commits on random tables, with idle entries between some; the last LSN."""
        last = None
        for _ in range(count):
            if self.rng.random() < 0.15:
                self.db.idle(self._at())
            table = self.rng.choice(["orders", "lines"])
            changes = self._changes(table)
            if changes:
                last = self.db.commit(table, changes, self._at())
        return last

    def switch(self) -> str:
        """A column added to orders and a second capture instance that captures it."""
        self.with_note = True
        self.db.ddl("orders", "note", "ALTER TABLE dbo.orders ADD note nvarchar(20)")
        return self.db.add_capture_instance("orders", ORDERS_V2, at=self._at())

    def cleanup_third(self) -> None:
        """Every instance's changes of the oldest third of the timeline purged."""
        client = FakeCdcClient(self.db.path)
        timeline = client._mapping()
        low = timeline[len(timeline) // 3]["start_lsn"]
        for instance in ["orders", "lines"] + (["orders_v2"] if self.with_note else []):
            self.db.cleanup(instance, max(low, client.min_lsn(instance)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=55)
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument("--switch", action="store_true", help="then a second instance")
    parser.add_argument("--cleanup", action="store_true", help="then purge a third")
    args = parser.parse_args()
    workload = SeedWorkload(args.dir, args.seed)
    workload.commits(args.commits)
    if args.switch:
        workload.switch()
        workload.commits(args.commits // 2)
    if args.cleanup:
        workload.cleanup_third()


if __name__ == "__main__":
    main()
