//! The control table and the completeness verdict.
//!
//! `finalized_until` says up to when a table's copy is complete: every change committed at or
//! before it is in the table. It moves only after the data it vouches for is committed, only
//! forward (`GREATEST` semantics, as the seed's MERGE), and to the end offset's commit time
//! truncated to the granularity, so a period is final only once the stream is past its end.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use arrow::array::{Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use deltalake::datafusion::prelude::{SessionContext, col};
use deltalake::operations::merge::MergeBuilder;
use deltalake::{DeltaTable, DeltaTableError};
use mssql_cdc_proto::{CommitTime, Lsn, Offset};
use url::Url;

use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind};

/// How far the verdict truncates an end commit time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    /// Whole minutes.
    Minute,
    /// Whole hours (the seed's default).
    #[default]
    Hour,
    /// Whole days.
    Day,
}

impl FromStr for Granularity {
    type Err = WriterError;

    fn from_str(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "minute" => Ok(Granularity::Minute),
            "hour" => Ok(Granularity::Hour),
            "day" => Ok(Granularity::Day),
            other => Err(WriterError::invalid(format!(
                "granularity must be minute, hour or day, not '{other}'"
            ))),
        }
    }
}

impl Granularity {
    /// `time` truncated to the granularity.
    pub fn truncate(self, time: CommitTime) -> CommitTime {
        let unit: i64 = match self {
            Granularity::Minute => 60_000_000,
            Granularity::Hour => 3_600_000_000,
            Granularity::Day => 86_400_000_000,
        };
        CommitTime(time.0.div_euclid(unit) * unit)
    }
}

fn now() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// Moves `table_name`'s verdict to `end`'s commit time truncated to `granularity`, if that
/// is later; returns the verdict after the call (`None` when there is none yet).
pub async fn advance(
    url: &Url,
    table_name: &str,
    end: &Offset,
    granularity: Granularity,
) -> Result<Option<CommitTime>> {
    let moves = [(table_name.to_string(), *end)];
    let verdicts = advance_each(&mut None, url, &moves, granularity).await?;
    Ok(verdicts.get(table_name).copied().flatten())
}

/// [`advance`] of many tables (each once) in one MERGE; the verdict of each after it.
/// `cached` holds the control table between calls ([`tables::refreshed`]).
pub async fn advance_each(
    cached: &mut Option<DeltaTable>,
    url: &Url,
    moves: &[(String, Offset)],
    granularity: Granularity,
) -> Result<HashMap<String, Option<CommitTime>>> {
    let moving: Vec<(&str, CommitTime, &Offset)> = moves
        .iter()
        .filter_map(|(table, end)| end.commit_ts.map(|commit| (table.as_str(), commit, end)))
        .collect();
    if !moving.is_empty() {
        let updated_at = now();
        let column =
            |values: Vec<Option<String>>| -> Arc<dyn Array> { Arc::new(StringArray::from(values)) };
        let times = |values: Vec<Option<i64>>| -> Arc<dyn Array> {
            Arc::new(TimestampMicrosecondArray::from(values))
        };
        let source = control_batch(vec![
            (
                "table_name",
                column(moving.iter().map(|m| Some(m.0.to_string())).collect()),
            ),
            (
                "finalized_until",
                times(
                    moving
                        .iter()
                        .map(|m| Some(granularity.truncate(m.1).0))
                        .collect(),
                ),
            ),
            (
                "end_lsn",
                column(moving.iter().map(|m| Some(m.2.lsn.to_string())).collect()),
            ),
            (
                "end_commit_ts",
                times(moving.iter().map(|m| Some(m.1.0)).collect()),
            ),
            ("updated_at", times(vec![Some(updated_at); moving.len()])),
        ])?;
        merge_rows(cached, url, source, |merge| {
            merge
                .when_matched_update(|update| {
                    update
                        .predicate("target.finalized_until IS NULL OR source.finalized_until > target.finalized_until")
                        .update("finalized_until", "source.finalized_until")
                        .update("end_lsn", "source.end_lsn")
                        .update("end_commit_ts", "source.end_commit_ts")
                        .update("updated_at", "source.updated_at")
                })?
                .when_not_matched_insert(|insert| {
                    insert
                        .set("table_name", "source.table_name")
                        .set("finalized_until", "source.finalized_until")
                        .set("end_lsn", "source.end_lsn")
                        .set("end_commit_ts", "source.end_commit_ts")
                        .set("updated_at", "source.updated_at")
                })
        })
        .await?;
    }
    let names: Vec<&str> = moves.iter().map(|(table, _)| table.as_str()).collect();
    // After a MERGE the cached table is its result; else it is brought up to date.
    let table = match cached.take() {
        Some(table) if !moving.is_empty() => Some(table),
        Some(mut table) => {
            table.update_incremental(None).await?;
            Some(table)
        }
        None => tables::open(url).await?,
    };
    let Some(table) = table else {
        return verdicts_in(None, &names).await;
    };
    let verdicts = verdicts_in(Some(&table), &names).await;
    *cached = Some(table);
    verdicts
}

/// Where `apply_changes` stands for a silver table (control migrations 1 and 2).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Position {
    /// Highest `_start_lsn` of the change rows applied.
    pub applied_lsn: Option<String>,
    /// The snapshot silver was last rebuilt from.
    pub snapshot_lsn: Option<String>,
    /// The chunked snapshot being applied wave by wave.
    pub open_snapshot_lsn: Option<String>,
    /// The last wave of it applied.
    pub snapshot_wave: Option<i32>,
}

/// One control row as read back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ControlRow {
    /// The end offset that last moved the verdict.
    pub end: Option<Offset>,
    /// The verdict.
    pub finalized_until: Option<CommitTime>,
    /// The `apply_changes` position (silver rows).
    pub position: Position,
    /// The LSN of the last reconcile that verified silver's rows (every bucket's rows and
    /// keys), and when it ran.
    pub verified: Option<(String, CommitTime)>,
    /// The LSN of the last reconcile that compared every value of every row too and found
    /// silver equal to the source, and when it ran.
    pub values_verified: Option<(String, CommitTime)>,
    /// When the row last changed (a verdict moved, a position written).
    pub updated_at: Option<CommitTime>,
}

/// The control row of `table_name`; `None` without a control table or row.
pub async fn row(url: &Url, table_name: &str) -> Result<Option<ControlRow>> {
    let Some(table) = tables::open(url).await? else {
        return Ok(None);
    };
    // A table an older release wrote lacks the later migrations' columns until the next
    // write migrates it: read those as NULL.
    let present: Vec<String> = table
        .snapshot()?
        .schema()
        .fields()
        .map(|field| field.name().to_string())
        .collect();
    let select: Vec<String> = [
        "end_lsn",
        "end_commit_ts",
        "applied_lsn",
        "snapshot_lsn",
        "open_snapshot_lsn",
        "snapshot_wave",
        "finalized_until",
        "verified_lsn",
        "verified_at",
        "values_verified_lsn",
        "values_verified_at",
        "updated_at",
    ]
    .iter()
    .map(|name| match present.iter().any(|field| field == name) {
        true => name.to_string(),
        false => format!("NULL AS {name}"),
    })
    .collect();
    let rows = tables::query_table_text(
        &table,
        &format!(
            "SELECT {} FROM t WHERE table_name = {}",
            select.join(", "),
            tables::quote_text(table_name)
        ),
    )
    .await?;
    let Some(row) = rows.into_iter().next() else {
        return Ok(None);
    };
    let time = |text: &Option<String>| {
        text.as_deref()
            .and_then(|text| CommitTime::parse_iso(text).ok())
    };
    let end = match &row[0] {
        Some(lsn) => Some(Offset {
            lsn: lsn
                .parse()
                .map_err(|error| WriterError::Internal(format!("control end_lsn: {error}")))?,
            commit_ts: time(&row[1]),
        }),
        None => None,
    };
    Ok(Some(ControlRow {
        end,
        finalized_until: time(&row[6]),
        position: Position {
            applied_lsn: row[2].clone(),
            snapshot_lsn: row[3].clone(),
            open_snapshot_lsn: row[4].clone(),
            snapshot_wave: row[5].as_deref().and_then(|wave| wave.parse().ok()),
        },
        verified: row[7].clone().zip(time(&row[8])),
        values_verified: row[9].clone().zip(time(&row[10])),
        updated_at: time(&row[11]),
    }))
}

/// How old a table's verdict is at `now`: the seed's `finalization.freshness`, one read of
/// the control table, nothing written. Ages are `None` before the first verdict.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Freshness {
    /// The control row's name, as asked.
    pub table_name: String,
    /// The verdict (UTC).
    pub finalized_until: Option<CommitTime>,
    /// When the row last changed (UTC).
    pub updated_at: Option<CommitTime>,
    /// Seconds from the verdict, the last final instant, to `now`.
    pub age_seconds: Option<f64>,
    /// Seconds since the row last changed: large while the verdict is held (a stopped
    /// stream, a stopped capture job, an open snapshot).
    pub seconds_since_update: Option<f64>,
    /// The chunked snapshot that holds silver's verdict, if one is open.
    pub open_snapshot_lsn: Option<String>,
}

/// [`Freshness`] of `table_name` in the control table at `url`; `None` without that table or
/// row (a misspelt name, a table never streamed), which a monitor must not take for a
/// verdict not yet given.
pub async fn freshness(url: &Url, table_name: &str, now: CommitTime) -> Result<Option<Freshness>> {
    let Some(found) = row(url, table_name).await? else {
        return Ok(None);
    };
    let age = |time: Option<CommitTime>| time.map(|time| (now.0 - time.0) as f64 / 1e6);
    Ok(Some(Freshness {
        table_name: table_name.to_string(),
        finalized_until: found.finalized_until,
        updated_at: found.updated_at,
        age_seconds: age(found.finalized_until),
        seconds_since_update: age(found.updated_at),
        open_snapshot_lsn: found.position.open_snapshot_lsn,
    }))
}

/// Writes `table_name`'s position (creating its row, without a verdict, when missing).
pub async fn set_position(url: &Url, table_name: &str, position: &Position) -> Result<()> {
    record_apply(url, table_name, position, None).await
}

/// Writes `table_name`'s position and, when `verdict` is given, moves its verdict forward to
/// that end offset truncated to the granularity, in **one** MERGE.
pub async fn record_apply(
    url: &Url,
    table_name: &str,
    position: &Position,
    verdict: Option<(&Offset, Granularity)>,
) -> Result<()> {
    let (candidate, end_lsn, end_commit) = match verdict {
        Some((end, granularity)) => (
            end.commit_ts.map(|time| granularity.truncate(time).0),
            end.commit_ts.map(|_| end.lsn.to_string()),
            end.commit_ts.map(|time| time.0),
        ),
        None => (None, None, None),
    };
    let source = control_batch(vec![
        ("table_name", text(Some(table_name))),
        ("finalized_until", time(candidate)),
        ("end_lsn", text(end_lsn.as_deref())),
        ("end_commit_ts", time(end_commit)),
        ("updated_at", time(Some(now()))),
        ("applied_lsn", text(position.applied_lsn.as_deref())),
        ("snapshot_lsn", text(position.snapshot_lsn.as_deref())),
        (
            "open_snapshot_lsn",
            text(position.open_snapshot_lsn.as_deref()),
        ),
        (
            "snapshot_wave",
            Arc::new(arrow::array::Int32Array::from(vec![position.snapshot_wave])),
        ),
    ])?;
    // The verdict only moves forward: a NULL or older candidate keeps the row's.
    let moves = "source.finalized_until IS NOT NULL AND (target.finalized_until IS NULL OR \
                 source.finalized_until > target.finalized_until)";
    let keep_or_move =
        |column: &str| format!("CASE WHEN {moves} THEN source.{column} ELSE target.{column} END");
    merge_row(url, source, |merge| {
        merge
            .when_matched_update(|update| {
                update
                    .update("applied_lsn", "source.applied_lsn")
                    .update("snapshot_lsn", "source.snapshot_lsn")
                    .update("open_snapshot_lsn", "source.open_snapshot_lsn")
                    .update("snapshot_wave", "source.snapshot_wave")
                    .update("updated_at", "source.updated_at")
                    .update("finalized_until", keep_or_move("finalized_until"))
                    .update("end_lsn", keep_or_move("end_lsn"))
                    .update("end_commit_ts", keep_or_move("end_commit_ts"))
            })?
            .when_not_matched_insert(|insert| {
                insert
                    .set("table_name", "source.table_name")
                    .set("updated_at", "source.updated_at")
                    .set("applied_lsn", "source.applied_lsn")
                    .set("snapshot_lsn", "source.snapshot_lsn")
                    .set("open_snapshot_lsn", "source.open_snapshot_lsn")
                    .set("snapshot_wave", "source.snapshot_wave")
                    .set("finalized_until", "source.finalized_until")
                    .set("end_lsn", "source.end_lsn")
                    .set("end_commit_ts", "source.end_commit_ts")
            })
    })
    .await
}

/// One control row of the named `values`, every other column NULL (a MERGE sets only the
/// columns its clauses name).
/// Control rows of the given columns (all of one length); the others NULL.
fn control_batch(values: Vec<(&str, Arc<dyn Array>)>) -> Result<RecordBatch> {
    let schema = crate::facts::arrow_schema(TableKind::Control);
    let rows = values.first().map_or(1, |(_, column)| column.len());
    let mut values = values;
    let columns = schema
        .fields()
        .iter()
        .map(
            |field| match values.iter().position(|(name, _)| name == field.name()) {
                Some(index) => values.swap_remove(index).1,
                None => arrow::array::new_null_array(field.data_type(), rows),
            },
        )
        .collect();
    if let Some((name, _)) = values.first() {
        return Err(WriterError::Internal(format!(
            "the control table has no column '{name}'"
        )));
    }
    Ok(RecordBatch::try_new(schema, columns)?)
}

fn text(value: Option<&str>) -> Arc<dyn Array> {
    Arc::new(StringArray::from(vec![value]))
}

fn time(micros: Option<i64>) -> Arc<dyn Array> {
    Arc::new(TimestampMicrosecondArray::from(vec![micros]))
}

/// Records that a reconcile of silver `table_name` verified its rows at `lsn` (its
/// `verified_lsn` and `verified_at`) and, with `values`, every value too
/// (`values_verified_lsn` and `_at`); creates the row when missing. A run that compared
/// rows only leaves the last values verification as it was; an LSN older than the one
/// recorded (a slower run that started earlier) leaves the newer one.
pub async fn record_verified(url: &Url, table_name: &str, lsn: Lsn, values: bool) -> Result<()> {
    let (lsn, at) = (lsn.to_string(), now());
    let mut columns = vec![
        ("table_name", text(Some(table_name))),
        ("updated_at", time(Some(at))),
        ("verified_lsn", text(Some(&lsn))),
        ("verified_at", time(Some(at))),
    ];
    if values {
        columns.push(("values_verified_lsn", text(Some(&lsn))));
        columns.push(("values_verified_at", time(Some(at))));
    }
    let source = control_batch(columns)?;
    // Two reconciles can finish out of order: the one that compared at the older LSN must
    // not take the newer proof back; one at the same LSN (a quiet table) says when it was
    // proven last. (LSNs are fixed-width hex text: their order is the text's.)
    let newer = |lsn: &str, column: &str| {
        format!(
            "CASE WHEN target.{lsn} IS NULL OR source.{lsn} >= target.{lsn} \
             THEN source.{column} ELSE target.{column} END"
        )
    };
    merge_row(url, source, |merge| {
        merge
            .when_matched_update(|update| {
                let update = update
                    .update("verified_lsn", newer("verified_lsn", "verified_lsn"))
                    .update("verified_at", newer("verified_lsn", "verified_at"));
                match values {
                    true => update
                        .update(
                            "values_verified_lsn",
                            newer("values_verified_lsn", "values_verified_lsn"),
                        )
                        .update(
                            "values_verified_at",
                            newer("values_verified_lsn", "values_verified_at"),
                        ),
                    false => update,
                }
            })?
            .when_not_matched_insert(|insert| {
                let insert = insert
                    .set("table_name", "source.table_name")
                    .set("updated_at", "source.updated_at")
                    .set("verified_lsn", "source.verified_lsn")
                    .set("verified_at", "source.verified_at");
                match values {
                    true => insert
                        .set("values_verified_lsn", "source.values_verified_lsn")
                        .set("values_verified_at", "source.values_verified_at"),
                    false => insert,
                }
            })
    })
    .await
}

/// MERGEs the one-row `source` into the control table on `table_name` with the clauses
/// `clauses` adds, creating the table when missing; a commit the table moved under
/// (another table's row, a compaction) is retried.
async fn merge_row(
    url: &Url,
    source: RecordBatch,
    clauses: impl Fn(MergeBuilder) -> std::result::Result<MergeBuilder, DeltaTableError>,
) -> Result<()> {
    merge_rows(&mut None, url, source, clauses).await
}

/// [`merge_row`] of `source`'s rows (one per table), on the control table `cached` holds
/// between calls ([`tables::refreshed`]).
async fn merge_rows(
    cached: &mut Option<DeltaTable>,
    url: &Url,
    source: RecordBatch,
    clauses: impl Fn(MergeBuilder) -> std::result::Result<MergeBuilder, DeltaTableError>,
) -> Result<()> {
    let slot = tokio::sync::Mutex::new(cached.take());
    let merged = tables::retry_conflicts(|| async {
        let mut cached = slot.lock().await;
        let _turn = crate::owner::turn(url).await;
        let table = tables::refreshed(&mut cached, url, TableKind::Control, "control").await?;
        let frame = SessionContext::new().read_batch(source.clone())?;
        let merge = table
            .merge(frame, col("target.table_name").eq(col("source.table_name")))
            .with_source_alias("source")
            .with_target_alias("target")
            .with_commit_properties(tables::rewrite_commit());
        let (table, _) = clauses(merge)?.await?;
        *cached = Some(table);
        Ok(())
    })
    .await;
    *cached = slot.into_inner();
    merged
}

/// The verdict of `table_name` (`None` without a control table or row).
pub async fn finalized_until(url: &Url, table_name: &str) -> Result<Option<CommitTime>> {
    let table = tables::open(url).await?;
    Ok(verdicts_in(table.as_ref(), &[table_name])
        .await?
        .get(table_name)
        .copied()
        .flatten())
}

/// The verdict of each of `table_names` in the control table `table`, in one read (`None`
/// without a control table or row).
async fn verdicts_in(
    table: Option<&DeltaTable>,
    table_names: &[&str],
) -> Result<HashMap<String, Option<CommitTime>>> {
    let mut verdicts: HashMap<String, Option<CommitTime>> = table_names
        .iter()
        .map(|name| (name.to_string(), None))
        .collect();
    let Some(table) = table else {
        return Ok(verdicts);
    };
    let context = SessionContext::new();
    let provider = table.table_provider().await?;
    context.register_table("control", provider)?;
    let names: Vec<deltalake::datafusion::prelude::Expr> = table_names
        .iter()
        .map(|name| deltalake::datafusion::prelude::lit(*name))
        .collect();
    let batches = context
        .table("control")
        .await?
        .filter(col("table_name").in_list(names, false))?
        .select_columns(&["table_name", "finalized_until"])?
        .collect()
        .await?;
    for batch in batches {
        let names = arrow::compute::cast(batch.column(0), &arrow::datatypes::DataType::Utf8)?;
        let names = names
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| WriterError::Internal("table_name is not text".into()))?;
        let column = arrow::compute::cast(
            batch.column(1),
            &arrow::datatypes::DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, None),
        )?;
        let times = column
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .ok_or_else(|| WriterError::Internal("finalized_until is not a timestamp".into()))?;
        for row in 0..batch.num_rows() {
            if names.is_null(row) || times.is_null(row) {
                continue;
            }
            let verdict = verdicts.entry(names.value(row).to_string()).or_default();
            *verdict = (*verdict).max(Some(CommitTime(times.value(row))));
        }
    }
    Ok(verdicts)
}

/// Whether the period ending at `period_end` is complete for `table_name`.
pub async fn is_final(url: &Url, table_name: &str, period_end: CommitTime) -> Result<bool> {
    Ok(finalized_until(url, table_name)
        .await?
        .is_some_and(|verdict| period_end <= verdict))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_follows_the_granularity() {
        let time = CommitTime::parse_iso("2026-09-28T14:03:12.117").expect("time");
        assert_eq!(
            Granularity::Hour.truncate(time).to_iso_millis(),
            "2026-09-28T14:00:00.000"
        );
        assert_eq!(
            Granularity::Minute.truncate(time).to_iso_millis(),
            "2026-09-28T14:03:00.000"
        );
        assert_eq!(
            Granularity::Day.truncate(time).to_iso_millis(),
            "2026-09-28T00:00:00.000"
        );
        assert!("weekly".parse::<Granularity>().is_err());
        assert_eq!(
            "HOUR".parse::<Granularity>().expect("case"),
            Granularity::Hour
        );
    }

    /// Two reconciles finishing out of order: the older LSN takes nothing back, and a
    /// values verification older than the rows one still records what it proved.
    #[tokio::test]
    async fn a_verification_older_than_the_recorded_one_takes_nothing_back() {
        let dir = tempfile::tempdir().expect("dir");
        let url = tables::table_url(dir.path().to_str().expect("path")).expect("url");
        let lsn = |n: u64| Lsn::from_u128(u128::from(n) << 32).expect("an LSN");
        let read = |url: Url| async move { row(&url, "dbo.t").await.expect("row").expect("a row") };
        let lsns = |row: ControlRow| {
            let lsn = |pair: Option<(String, CommitTime)>| pair.map(|(lsn, _)| lsn);
            (lsn(row.verified), lsn(row.values_verified))
        };
        record_verified(&url, "dbo.t", lsn(20), false)
            .await
            .expect("rows at 20");
        record_verified(&url, "dbo.t", lsn(10), true)
            .await
            .expect("values at 10");
        assert_eq!(
            lsns(read(url.clone()).await),
            (Some(lsn(20).to_string()), Some(lsn(10).to_string()))
        );
        record_verified(&url, "dbo.t", lsn(30), true)
            .await
            .expect("values at 30");
        record_verified(&url, "dbo.t", lsn(25), true)
            .await
            .expect("values at 25");
        assert_eq!(
            lsns(read(url.clone()).await),
            (Some(lsn(30).to_string()), Some(lsn(30).to_string()))
        );
        // Proven again at the same LSN (a quiet table): the times move.
        let at = |row: ControlRow| {
            (
                row.verified.expect("rows").1,
                row.values_verified.expect("values").1,
            )
        };
        let before = at(read(url.clone()).await);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        record_verified(&url, "dbo.t", lsn(30), true)
            .await
            .expect("again at 30");
        let after = at(read(url).await);
        assert!(
            after.0 > before.0 && after.1 > before.1,
            "{before:?} then {after:?}"
        );
    }
}
