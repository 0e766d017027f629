//! The invariants every step keeps, checked against the simulator's journal.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::process::Command;

use mssql_cdc_flight::Lsn;
use mssql_cdc_writer::checkpoint::{BatchRecord, Checkpoint};
use mssql_cdc_writer::control;
use mssql_cdc_writer::tables;

use crate::common::python;
use crate::common::{self, Lab, Rows};
use crate::ops::Table;
use crate::world::{Failure, World};

impl World {
    /// The invariants every step keeps.
    pub(crate) async fn check(&self) -> Result<(), Failure> {
        for table in Table::ALL {
            self.check_bronze(table).await?;
            self.check_verdict(table).await?;
            self.check_left_out(table).await?;
        }
        self.check_guard_stops().await?;
        self.check_facts().await
    }

    /// No table of the lake holds a column the table's stream leaves out, nor the clear value
    /// of a column the server masks: not bronze (stream, snapshots, healing re-snapshots,
    /// crashed runs, the sidecar), not silver, not history.
    pub(crate) async fn check_left_out(&self, table: Table) -> Result<(), Failure> {
        for kind in ["bronze", "silver", "history"] {
            let location = self.lab.lake(&format!("{kind}_{}", table.name()));
            let url = tables::table_url(&location).expect("url");
            let Some(delta) = tables::open(&url).await.expect("open") else {
                continue;
            };
            let schema = delta.snapshot().expect("snapshot").schema();
            if let Some(field) = schema.fields().find(|field| {
                table
                    .except_columns()
                    .iter()
                    .any(|name| field.name().eq_ignore_ascii_case(name))
            }) {
                return Err(format!(
                    "{kind} of {} holds the column {}, which its stream leaves out",
                    table.source(),
                    field.name()
                ));
            }
            self.check_masked(table, kind, &location).await?;
        }
        Ok(())
    }

    /// The masked columns of `table` hold only their masked forms in `kind` at `location`:
    /// hashes (64 lower-case hex digits), values cut to the mask's length, or NULL.
    async fn check_masked(&self, table: Table, kind: &str, location: &str) -> Result<(), Failure> {
        for (column, mask) in table.masked_columns() {
            let values = common::query(
                location,
                &format!("SELECT {column} FROM t WHERE {column} IS NOT NULL"),
            )
            .await;
            let held = values.iter().flat_map(|batch| {
                // Delta hands strings out as views: cast to read them one way.
                let texts =
                    arrow::compute::cast(batch.column(0), &arrow::datatypes::DataType::Utf8)
                        .expect("a column cast to text");
                let texts = arrow::array::AsArray::as_string::<i32>(&texts);
                texts
                    .iter()
                    .flatten()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            });
            let masked = |value: &str| match *mask {
                "hash" => {
                    value.len() == 64
                        && value
                            .bytes()
                            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                }
                "null" => false,
                _ => value.chars().count() <= 8,
            };
            for value in held {
                if !masked(&value) {
                    return Err(format!(
                        "{kind} of {} holds {value:?} in {column}, which the server serves \
                         {mask}: a clear value reached the lake",
                        table.source()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every stop by the anti-loop guard met a new purge: the table's stream healed one
    /// before (a `data_loss` row), at an S below the purge it stopped at. A stop at the purge
    /// a heal already passed (the stream resumed before its S) would pass for the guard and
    /// be "fixed" by a second generation for one purge.
    pub(crate) async fn check_guard_stops(&self) -> Result<(), Failure> {
        let stops = std::mem::take(&mut self.known().guard_stops);
        for (table, purged_through) in stops {
            let newest = self.heals(table).await.into_iter().map(|(_, s)| s).max();
            let Some(newest) = newest else {
                return Err(format!(
                    "the anti-loop guard stopped the stream of {} although it had healed no \
                     purge before",
                    table.source()
                ));
            };
            if purged_through.is_none_or(|through| through <= newest) {
                return Err(format!(
                    "the anti-loop guard stopped the stream of {} at a purge (through \
                     {purged_through:?}) its last heal, at S {newest}, had passed",
                    table.source()
                ));
            }
        }
        Ok(())
    }

    pub(crate) async fn check_bronze(&self, table: Table) -> Result<(), Failure> {
        let held = bronze_rows(&self.lab, table).await;
        let journal: BTreeSet<_> = self.journal(table).into_iter().collect();
        let mut seen = BTreeSet::new();
        for row in &held {
            if !seen.insert(row) {
                return Err(format!("bronze of {} holds {row:?} twice", table.source()));
            }
            if !journal.contains(row) {
                return Err(format!(
                    "bronze of {} holds {row:?}, which was never committed",
                    table.source()
                ));
            }
        }
        self.check_snapshot_rows(table).await?;
        let Some(through) = self.committed_through(table).await else {
            return Ok(());
        };
        let excused = self.excused(table).await;
        if let Some(missing) = journal.iter().find(|row| {
            row.0.parse::<Lsn>().is_ok_and(|lsn| lsn <= through)
                && !seen.contains(row)
                && !excused.covers(row)
        }) {
            return Err(format!(
                "bronze of {} lacks {missing:?}, through its checkpoint's last committed batch \
                 (end {through})",
                table.source()
            ));
        }
        Ok(())
    }

    /// No snapshot row twice: a snapshot holds each key once (its chunks are disjoint
    /// ranges of the key the model's tables are cut on).
    pub(crate) async fn check_snapshot_rows(&self, table: Table) -> Result<(), Failure> {
        let location = self.lab.lake(&format!("bronze_{}", table.name()));
        let url = tables::table_url(&location).expect("url");
        if tables::open(&url).await.ok().flatten().is_none() {
            return Ok(());
        }
        let doubled = tables::query_text(
            &url,
            &format!(
                "SELECT COALESCE(_snapshot, _start_lsn), {key}, count(*) FROM t \
                 WHERE _operation = 0 GROUP BY 1, 2 HAVING count(*) > 1 LIMIT 3",
                key = table.key()
            ),
        )
        .await
        .map_err(|error| format!("bronze of {}: {error}", table.source()))?;
        if let Some(row) = doubled.first() {
            return Err(format!(
                "bronze of {} holds snapshot {:?} key {:?} {:?} times",
                table.source(),
                row[0],
                row[1],
                row[2]
            ));
        }
        Ok(())
    }

    /// Whether a purge passed where the lake shows the stream: the end of its last committed
    /// batch (reconcile reads the change table from there, and a purge past it is its
    /// DATA_LOSS).
    pub(crate) async fn behind_purge(&self, table: Table) -> bool {
        let cut = self.known().purged_through;
        // A batch amended past a purge and left open (a crash before its facts row) has its
        // claim start at the heal's S or at min_lsn already, but the lake still shows the
        // stream where it stood before the purge.
        let amended_open = self
            .last_batch(table)
            .await
            .is_some_and(|last| !last.committed && !last.events.is_empty());
        match (cut, self.committed_through(table).await) {
            (Some(_), _) if amended_open => true,
            (Some(cut), Some(through)) => through < cut,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The last batch the checkpoint of `table` records, committed or left open.
    pub(crate) async fn last_batch(&self, table: Table) -> Option<BatchRecord> {
        Checkpoint::open(&self.config(table).checkpoint)
            .await
            .expect("checkpoint")
            .last()
            .await
            .expect("last")
    }

    /// The end of the checkpoint's last committed batch.
    pub(crate) async fn committed_through(&self, table: Table) -> Option<Lsn> {
        let last = self.last_batch(table).await?;
        if last.committed {
            Some(last.end.lsn)
        } else {
            Some(last.start.lsn)
        }
    }

    pub(crate) async fn check_verdict(&self, table: Table) -> Result<(), Failure> {
        let url = tables::table_url(&self.lab.lake("control")).expect("url");
        let Some(verdict) = control::finalized_until(&url, table.source())
            .await
            .map_err(|error| format!("control: {error}"))?
        else {
            return Ok(());
        };
        let Some(last) = self.last_batch(table).await else {
            return Err(format!("a verdict for {} before any batch", table.source()));
        };
        let end = if last.committed { last.end } else { last.start };
        // The verdict says every change up to it is in bronze: it cannot pass the commit
        // time of the end of what is committed.
        if end.commit_ts.is_some_and(|ts| verdict > ts) {
            return Err(format!(
                "the verdict of {} ({verdict:?}) is past its last committed batch's end ({:?})",
                table.source(),
                end.commit_ts
            ));
        }
        Ok(())
    }

    pub(crate) async fn check_facts(&self) -> Result<(), Failure> {
        let url = tables::table_url(&self.lab.lake("facts")).expect("url");
        let rows = tables::query_text(
            &url,
            "SELECT app_id, batch_id, count(*) FROM t WHERE event IS NULL AND batch_id IS NOT NULL \
             GROUP BY app_id, batch_id ORDER BY app_id, batch_id",
        )
        .await
        .map_err(|error| format!("facts: {error}"))?;
        let mut ids: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for row in rows {
            let app = row[0].clone().unwrap_or_default();
            let id: i64 = row[1].as_deref().unwrap_or("-1").parse().unwrap_or(-1);
            if row[2].as_deref() != Some("1") {
                return Err(format!(
                    "facts hold batch {id} of {app} {} times",
                    row[2].as_deref().unwrap_or("?")
                ));
            }
            ids.entry(app).or_default().push(id);
        }
        for (app, ids) in &ids {
            if ids.iter().copied().ne(0..ids.len() as i64) {
                return Err(format!("facts batch ids of {app} are not 0..: {ids:?}"));
            }
        }
        for table in Table::ALL {
            if let Some(last) = self.last_batch(table).await
                && last.committed
            {
                let held = ids.get(table.name()).map_or(0, Vec::len) as i64;
                if held <= last.batch_id {
                    return Err(format!(
                        "the checkpoint of {} committed batch {} but facts hold {held} batches",
                        table.name(),
                        last.batch_id
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every table of the lake read by the Python `deltalake` package: the same row count
    /// as delta-rs reads.
    pub(crate) async fn check_python_reads(&self) -> Result<(), Failure> {
        let python = python();
        let lake = self.lab.dir.path().join("lake");
        let mut expected = BTreeMap::new();
        for entry in std::fs::read_dir(&lake).map_err(|error| format!("lake: {error}"))? {
            let path = entry.map_err(|error| error.to_string())?.path();
            let location = path.display().to_string();
            let url = tables::table_url(&location).expect("url");
            if tables::open(&url).await.ok().flatten().is_none() {
                continue;
            }
            let count = tables::query_text(&url, "SELECT count(*) FROM t")
                .await
                .map_err(|error| format!("{location}: {error}"))?;
            expected.insert(location, count[0][0].clone().unwrap_or_default());
        }
        // The package's pyarrow path refuses deletion vectors; its DataFusion path reads
        // every table.
        let script = "import sys\n\
            from deltalake import DeltaTable, QueryBuilder\n\
            for path in sys.argv[1:]:\n\
            \x20   query = QueryBuilder().register('t', DeltaTable(path))\n\
            \x20   count = query.execute('SELECT count(*) AS n FROM t').read_all()\n\
            \x20   print(path, count.column(0)[0].as_py())\n";
        let output = Command::new(&python)
            .arg("-c")
            .arg(script)
            .args(expected.keys())
            .output()
            .map_err(|error| format!("{}: {error}", python.display()))?;
        if !output.status.success() {
            return Err(format!(
                "the Python deltalake package could not read the lake: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let text = String::from_utf8_lossy(&output.stdout);
        for line in text.lines() {
            let (path, count) = line.rsplit_once(' ').unwrap_or((line, ""));
            if expected.get(path).map(String::as_str) != Some(count) {
                return Err(format!(
                    "the Python deltalake package reads {count} rows in {path}, delta-rs {:?}",
                    expected.get(path)
                ));
            }
        }
        Ok(())
    }
}

/// A journal or bronze row: `(start_lsn, seqval, operation, key)`.
pub(crate) type Change = (String, String, i32, i64);

/// Bronze's change rows of `table` (none when there is no bronze yet).
pub(crate) async fn bronze_rows(lab: &Lab, table: Table) -> Vec<Change> {
    let location = lab.lake(&format!("bronze_{}", table.name()));
    let sql = format!(
        "SELECT _start_lsn, _seqval, _operation, CAST({} AS BIGINT) FROM t WHERE _operation <> 0",
        table.key()
    );
    common::change_rows(&location, &sql)
        .await
        .unwrap_or_default()
}

/// The first keys where two row sets differ.
pub(crate) fn difference(left: &Rows, right: &Rows) -> String {
    let mut text = String::new();
    let keys: BTreeSet<_> = left.keys().chain(right.keys()).collect();
    for key in keys
        .into_iter()
        .filter(|key| left.get(key) != right.get(key))
        .take(3)
    {
        let _ = write!(
            text,
            "key {key}: silver {:?}, source {:?}; ",
            left.get(key),
            right.get(key)
        );
    }
    text
}
