//! The history (SCD type 2) a table should have, built from the simulator's journal, and the
//! history a lake holds, in one shape to compare.
//!
//! The model knows the truth: every commit of every key (the journal). The lake can know it
//! only where it looked: at each change bronze holds, and at each complete snapshot's S (the
//! state of every key then). So the model folds each key's true state at those points, in
//! LSN order (a commit at S before the snapshot at S): a new version where the tracked value
//! changes, an end where the row goes, `resnapshot` for what a snapshot found.

use std::collections::{BTreeMap, BTreeSet};

use arrow::array::{Array, ArrayRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use mssql_cdc_flight::sim::SimDb;
use mssql_cdc_flight::sim::values::ColumnBuilder;

use super::{Lab, query, text};

/// One journal row: a change of one key in one commit.
#[derive(Clone, Debug)]
pub struct JournalRow {
    pub lsn: String,
    pub seqval: String,
    pub operation: i32,
    pub command_id: i64,
    pub key: i64,
    pub content: u64,
}

/// The journal rows of `table`, in commit order.
pub fn journal(lab: &Lab, table: &str) -> Vec<JournalRow> {
    let text = std::fs::read_to_string(lab.journal()).unwrap_or_default();
    let mut rows: Vec<JournalRow> = text
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("json"))
        .filter(|value| value["table"] == table)
        .map(|value| JournalRow {
            lsn: value["start_lsn"].as_str().expect("lsn").to_string(),
            seqval: value["seqval"].as_str().expect("seqval").to_string(),
            operation: value["operation"].as_i64().expect("op") as i32,
            command_id: value["command_id"].as_i64().unwrap_or(0),
            key: value["key"].as_i64().expect("key"),
            content: value["content"]
                .as_str()
                .and_then(|content| content.parse().ok())
                .expect("content"),
        })
        .collect();
    rows.sort_by(|a, b| {
        (&a.lsn, a.command_id, &a.seqval, a.operation).cmp(&(
            &b.lsn,
            b.command_id,
            &b.seqval,
            b.operation,
        ))
    });
    rows
}

/// One version as the comparison sees it: `(key, valid_from, valid_to, ended_by, tracked)`.
pub type VersionRow = (i64, Option<String>, Option<String>, Option<String>, String);

/// The versions the model expects: the journal's truth folded at the points the lake looked
/// (`held`: the `(lsn, key)` of the commits bronze holds; `snapshots`: the S of every
/// complete snapshot), `tracked(key, content)` the tracked value of a row.
pub fn expected(
    journal: &[JournalRow],
    held: &BTreeSet<(String, i64)>,
    snapshots: &[String],
    tracked: &dyn Fn(i64, u64) -> String,
) -> BTreeSet<VersionRow> {
    // Each key's commits: (lsn, state after, the last operation).
    let mut commits: BTreeMap<i64, Vec<(String, Option<u64>, i32)>> = BTreeMap::new();
    for row in journal {
        let state = matches!(row.operation, 2 | 4).then_some(row.content);
        let of_key = commits.entry(row.key).or_default();
        match of_key.last_mut() {
            Some(last) if last.0 == row.lsn => *last = (row.lsn.clone(), state, row.operation),
            _ => of_key.push((row.lsn.clone(), state, row.operation)),
        }
    }
    let mut versions = BTreeSet::new();
    for (key, commits) in &commits {
        let truth_at = |lsn: &str| {
            commits
                .iter()
                .take_while(|commit| commit.0.as_str() <= lsn)
                .last()
                .and_then(|commit| commit.1)
        };
        // The points, in order: (lsn, is a snapshot, state after, ending if it goes).
        let mut points: Vec<(String, bool, Option<u64>, &str)> = commits
            .iter()
            .filter(|commit| held.contains(&(commit.0.clone(), *key)))
            .map(|commit| {
                let ending = if commit.2 == 1 { "delete" } else { "update" };
                (commit.0.clone(), false, commit.1, ending)
            })
            .collect();
        points.extend(
            snapshots
                .iter()
                .map(|s| (s.clone(), true, truth_at(s), "resnapshot")),
        );
        points.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        // (valid_from, content) of the open version.
        let mut open: Option<(Option<String>, u64)> = None;
        let mut seen = false;
        for (lsn, snapshot, state, ending) in points {
            if !seen && !snapshot {
                // A key first seen by a change that finds it there existed before bronze's
                // first change: valid from NULL.
                let before = commits
                    .iter()
                    .take_while(|commit| commit.0 < lsn)
                    .last()
                    .and_then(|commit| commit.1);
                if let Some(content) = before {
                    open = Some((None, content));
                }
            }
            seen = true;
            let ended_by = match (snapshot, state) {
                (true, _) => "resnapshot",
                (false, Some(_)) => "update",
                (false, None) => ending,
            };
            match (open.take(), state) {
                (Some((from, content)), Some(next))
                    if tracked(*key, content) == tracked(*key, next) =>
                {
                    open = Some((from, next));
                }
                (Some((from, content)), next) => {
                    versions.insert((
                        *key,
                        from,
                        Some(lsn.clone()),
                        Some(ended_by.to_string()),
                        tracked(*key, content),
                    ));
                    open = next.map(|next| (Some(lsn.clone()), next));
                }
                (None, next) => open = next.map(|next| (Some(lsn.clone()), next)),
            }
        }
        if let Some((from, content)) = open {
            versions.insert((*key, from, None, None, tracked(*key, content)));
        }
    }
    versions
}

/// The versions a history table holds, `tracked` the text of its tracked columns joined by
/// `|`; an error where a key has two current versions, a version is there twice, its
/// `__is_current` disagrees with its end, or its times are missing where its LSNs are.
pub async fn held(
    location: &str,
    key: &str,
    tracked: &[&str],
) -> Result<BTreeSet<VersionRow>, String> {
    let columns = tracked
        .iter()
        .map(|column| format!("CAST({column} AS VARCHAR)"))
        .collect::<Vec<_>>()
        .join(", ");
    let batches = query(
        location,
        &format!(
            "SELECT CAST({key} AS BIGINT), __valid_from, __valid_to, __ended_by, __is_current, \
             CAST(__valid_from_ts AS VARCHAR), CAST(__valid_to_ts AS VARCHAR), {columns} FROM t"
        ),
    )
    .await;
    let mut versions = BTreeSet::new();
    let mut current = BTreeSet::new();
    type Span = (Option<String>, Option<String>);
    let mut intervals: BTreeMap<i64, Vec<Span>> = BTreeMap::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            let key: i64 = text(batch, 0, row)
                .and_then(|key| key.parse().ok())
                .ok_or("a version without a key")?;
            let (from, to, ended) = (
                text(batch, 1, row),
                text(batch, 2, row),
                text(batch, 3, row),
            );
            let is_current = text(batch, 4, row) == Some("true".into());
            if is_current != (to.is_none() && ended.is_none()) {
                return Err(format!(
                    "{location}: key {key} is_current {is_current}, ended {to:?} by {ended:?}"
                ));
            }
            if is_current && !current.insert(key) {
                return Err(format!("{location}: key {key} has two current versions"));
            }
            let (from_ts, to_ts) = (text(batch, 5, row), text(batch, 6, row));
            if from_ts.is_none() != from.is_none() || to_ts.is_none() != to.is_none() {
                return Err(format!(
                    "{location}: key {key} from {from:?} to {to:?} lacks a commit time"
                ));
            }
            if let (Some(from), Some(to)) = (&from, &to)
                && (from >= to || from_ts > to_ts)
            {
                return Err(format!(
                    "{location}: key {key} valid from {from} ({from_ts:?}) to {to} ({to_ts:?})"
                ));
            }
            intervals
                .entry(key)
                .or_default()
                .push((from.clone(), to.clone()));
            let values = (7..batch.num_columns())
                .map(|column| text(batch, column, row).unwrap_or_else(|| "NULL".into()))
                .collect::<Vec<_>>()
                .join("|");
            let version = (key, from, to, ended, values);
            if !versions.insert(version.clone()) {
                return Err(format!("{location}: a version twice: {version:?}"));
            }
        }
    }
    // A key's versions follow each other: each starts at or after the one before ended.
    for (key, mut spans) in intervals {
        spans.sort();
        for pair in spans.windows(2) {
            let (ended, next) = (&pair[0].1, &pair[1].0);
            if ended.is_none() || next < ended {
                return Err(format!(
                    "{location}: key {key} has overlapping versions {pair:?}"
                ));
            }
        }
    }
    Ok(versions)
}

/// The history as it stood at `micros` (a verdict's time): the versions valid from then or
/// before, an end after it read as none. What a verdict covers never changes afterwards.
pub async fn as_of(
    location: &str,
    key: &str,
    tracked: &[&str],
    micros: i64,
) -> BTreeSet<VersionRow> {
    let columns = tracked
        .iter()
        .map(|column| format!("CAST({column} AS VARCHAR)"))
        .collect::<Vec<_>>()
        .join(" || '|' || ");
    let ended = format!("CAST(__valid_to_ts AS BIGINT) <= {micros}");
    let batches = query(
        location,
        &format!(
            "SELECT CAST({key} AS BIGINT), __valid_from, CASE WHEN {ended} THEN __valid_to END, \
             CASE WHEN {ended} THEN __ended_by END, {columns} FROM t \
             WHERE __valid_from_ts IS NULL OR CAST(__valid_from_ts AS BIGINT) <= {micros}"
        ),
    )
    .await;
    let mut versions = BTreeSet::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            versions.insert((
                text(batch, 0, row)
                    .and_then(|key| key.parse().ok())
                    .unwrap_or_default(),
                text(batch, 1, row),
                text(batch, 2, row),
                text(batch, 3, row),
                text(batch, 4, row).unwrap_or_else(|| "NULL".into()),
            ));
        }
    }
    versions
}

/// Where a history differs from the model's versions (its first few), if it does.
pub fn differences(expected: &BTreeSet<VersionRow>, held: &BTreeSet<VersionRow>) -> Option<String> {
    let missing: Vec<_> = expected.difference(held).take(3).collect();
    let extra: Vec<_> = held.difference(expected).take(3).collect();
    (!missing.is_empty() || !extra.is_empty()).then(|| {
        format!(
            "{} of {} versions as the journal says; missing {missing:?}; not in the journal \
             {extra:?}",
            expected.intersection(held).count(),
            expected.len()
        )
    })
}

/// The `(lsn, key)` of every change row of bronze at `location`.
pub async fn held_commits(location: &str, key: &str) -> BTreeSet<(String, i64)> {
    let batches = query(
        location,
        &format!("SELECT _start_lsn, CAST({key} AS BIGINT) FROM t WHERE _operation <> 0"),
    )
    .await;
    let mut held = BTreeSet::new();
    for batch in &batches {
        for row in 0..batch.num_rows() {
            held.insert((
                text(batch, 0, row).expect("lsn"),
                text(batch, 1, row).expect("key").parse().expect("integer"),
            ));
        }
    }
    held
}

/// The S of every complete snapshot of bronze `bronze` the facts record.
pub async fn complete_snapshots(lab: &Lab, bronze: &str) -> Vec<String> {
    let batches = query(
        &lab.lake("facts"),
        &format!(
            "SELECT DISTINCT min_lsn FROM t WHERE target = '{bronze}' AND event IN \
             ('bootstrap', 'resnapshot') ORDER BY min_lsn"
        ),
    )
    .await;
    batches
        .iter()
        .flat_map(|batch| (0..batch.num_rows()).map(|row| text(batch, 0, row).expect("lsn")))
        .collect()
}

/// The text of `columns` of the row `(key, content)` of `table`, joined by `|`, as the
/// simulator generates it.
pub fn generated(db: &SimDb, table: &str, columns: &[&str], key: i64, content: u64) -> String {
    let manifest = db.manifest().expect("manifest");
    let definition = manifest
        .tables
        .iter()
        .find(|definition| definition.table.to_string() == table)
        .expect("table");
    columns
        .iter()
        .map(|name| {
            let column = definition.column(name).expect("column");
            let mut builder = ColumnBuilder::for_sql_type(&column.sql_type, 1);
            builder.append_generated(column, *name == definition.key, key, content);
            let array: ArrayRef = builder.finish();
            if array.is_null(0) {
                return "NULL".to_string();
            }
            let cast =
                arrow::compute::cast(&array, &arrow::datatypes::DataType::Utf8).expect("cast");
            ArrayFormatter::try_new(cast.as_ref(), &FormatOptions::default())
                .expect("formatter")
                .value(0)
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("|")
}
