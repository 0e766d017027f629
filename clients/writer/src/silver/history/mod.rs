//! History: `apply_history` keeps every version of every row of a source table (SCD type 2)
//! in step with bronze, beside silver's current state.
//!
//! One row per version of a key: the captured columns, `_start_lsn` and `_commit_ts` of the
//! image the values come from, `__valid_from` and `__valid_to` (LSN, and their commit times
//! `__valid_from_ts`, `__valid_to_ts`), `__is_current` and `__ended_by`. Which columns open a
//! new version is the caller's (`track_history_columns` or `track_history_except_columns`,
//! as Databricks' AUTO CDC): a change of another column updates the current version in place.
//!
//! One call:
//! 1. reads bronze's verdict (control), then the facts (how far the stream has read, every
//!    snapshot with where its reads ended: [`snapshots`]), then history's position, then
//!    bronze at **one** pinned version;
//! 2. takes the changes past the position up to the stream's end, and the rows of every
//!    snapshot not yet applied whose reads the stream has passed (waves of an open chunked
//!    one in order), in order: a snapshot's row of a key only when the key has no change
//!    between S and the end of the row's read, and, when a snapshot is complete, the keys it
//!    lacks;
//! 3. and 4., in one pass over history's files ([`write`]): folds each touched key's events
//!    onto its current row where that file holds it ([`fold`]: a commit is one event,
//!    Microsoft's order `_start_lsn`, `_command_id`, `_seqval`, `_operation` inside it),
//!    writes the file again with that row replaced by the key's versions when they changed,
//!    folds the keys no file holds current into a new file, and commits once: ended versions
//!    are never written again;
//! 5. writes the position (`applied_lsn`, `snapshot_lsn`, `open_snapshot_lsn`,
//!    `snapshot_wave`) in history's control row after the data and moves its verdict to
//!    bronze's, held while a snapshot is still to be applied.
//!
//! A call that crashed before step 5 leaves the position behind: the next one folds the same
//! events again onto what step 4 wrote, skipping each event at or before what history already
//! shows of its key, so it lands on the same rows. [`replay`] folds a history again from
//! nothing and compares (reconcile runs it).

mod fold;
mod plan;
mod snapshots;
mod verify;
mod versions;
mod write;

pub use verify::{Replayed, replay};
pub use write::WriteCounts;

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use deltalake::datafusion::prelude::SessionContext;
use deltalake::kernel::StructField;
use mssql_cdc_proto::{CommitTime, Lsn};

use super::{CHANGE_ONLY_COLUMNS, collect_text, query_context, register_bronze, text};
use crate::control::{self, Granularity};
use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind};
use plan::Plan;
use versions::Events;

/// Which column changes open a new version.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tracked {
    /// Every captured column.
    #[default]
    All,
    /// Only these (`track_history_columns`).
    Only(Vec<String>),
    /// Every captured column but these (`track_history_except_columns`).
    Except(Vec<String>),
}

impl Tracked {
    /// From the two lists a user gives (at most one of them).
    pub fn of(only: Vec<String>, except: Vec<String>) -> Result<Self> {
        match (only.is_empty(), except.is_empty()) {
            (true, true) => Ok(Tracked::All),
            (false, true) => Ok(Tracked::Only(only)),
            (true, false) => Ok(Tracked::Except(except)),
            (false, false) => Err(WriterError::invalid(
                "give track_history_columns or track_history_except_columns, not both",
            )),
        }
    }
}

/// What `apply_history` works on.
#[derive(Clone, Debug)]
pub struct HistoryConfig {
    /// The source table (`schema.table`): bronze's verdict row in the control table.
    pub table: String,
    /// Bronze location (as the stream's `target`, which names it in the facts).
    pub bronze: String,
    /// History location (its name in the control table).
    pub target: String,
    /// The capture instance whose rows bronze holds; `None` takes every instance's.
    pub capture_instance: Option<String>,
    /// Key columns (the unique index CDC uses).
    pub keys: Vec<String>,
    /// Control table location.
    pub control: String,
    /// Facts table location: where the stream has read to and the snapshots.
    pub facts: String,
    /// Truncation of history's verdict.
    pub granularity: Granularity,
    /// Which column changes open a new version.
    pub tracked: Tracked,
}

/// What a call did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistoryOutcome {
    /// Whether bronze exists (nothing happens until it does).
    pub bronze_found: bool,
    /// The position after the call: the newest change applied.
    pub applied_lsn: Option<Lsn>,
    /// The newest snapshot applied whole.
    pub snapshot_lsn: Option<Lsn>,
    /// A snapshot whose rows wait for the stream to pass the end of their reads.
    pub waiting_snapshot: Option<Lsn>,
    /// Keys whose versions changed.
    pub keys_changed: usize,
    /// Version rows written (current rows replaced and new versions).
    pub versions_written: usize,
    /// History's verdict after the call.
    pub finalized_until: Option<CommitTime>,
}

/// History's own columns after the captured ones, `_start_lsn` and `_commit_ts`.
pub const VERSION_COLUMNS: [&str; 6] = [
    "__valid_from",
    "__valid_from_ts",
    "__valid_to",
    "__valid_to_ts",
    "__is_current",
    "__ended_by",
];

/// Runs `apply_history` once.
pub async fn apply_history(config: &HistoryConfig) -> Result<HistoryOutcome> {
    let outcome = tables::retry_conflicts(|| apply_once(config)).await?;
    crate::metrics::finalized_until(&config.table, "history", outcome.finalized_until);
    Ok(outcome)
}

async fn apply_once(config: &HistoryConfig) -> Result<HistoryOutcome> {
    let control_url = tables::table_url(&config.control)?;
    let bronze_url = tables::table_url(&config.bronze)?;
    let history_url = tables::table_url(&config.target)?;
    // 1. The verdict, then the facts (the stream records a batch's facts before its verdict),
    //    then history's position, then bronze pinned.
    let bronze_verdict = control::row(&control_url, &config.table)
        .await?
        .and_then(|row| row.end);
    let facts =
        Arc::new(snapshots::read(&tables::table_url(&config.facts)?, &config.bronze).await?);
    let history_row = control::row(&control_url, &config.target)
        .await?
        .unwrap_or_default();
    let position = history_row.position.clone();
    let lsn_of = |lsn: &Option<String>| lsn.as_deref().and_then(|lsn| lsn.parse().ok());
    let Some(bronze) = tables::open(&bronze_url).await? else {
        return Ok(HistoryOutcome {
            applied_lsn: lsn_of(&position.applied_lsn),
            ..HistoryOutcome::default()
        });
    };
    let context = query_context()?;
    let schema = register_bronze(
        &context,
        &bronze,
        &config.keys,
        config.capture_instance.as_deref(),
        &config.bronze,
        &config.target,
    )
    .await?;
    let fields = history_fields(&schema);
    let value_names: Vec<String> = fields
        .iter()
        .map(|field| field.name().to_string())
        .filter(|name| !VERSION_COLUMNS.contains(&name.as_str()))
        .collect();
    let tracked = tracked_columns(&config.tracked, &value_names, &config.keys)?;
    let table = tables::ensure_with(
        &history_url,
        TableKind::History,
        fields.clone(),
        "history",
        HashMap::from([(TRACKED_PROPERTY.to_string(), tracked_text(&config.tracked))]),
    )
    .await?;
    let table = check_tracked(table, &config.tracked, &config.target).await?;
    let (table, _) = tables::add_missing_columns(table, &fields, &config.target).await?;
    context.register_table("history", table.table_provider().await?)?;

    // 2. What this call applies, and its events in order.
    let history_schema: SchemaRef = table.snapshot()?.snapshot().arrow_schema();
    let values_schema = values_of(&history_schema)?;
    let plan = Plan::of(&facts, &position);
    let started = std::time::Instant::now();
    let events = plan
        .events(
            &context,
            position.applied_lsn.as_deref(),
            &values_schema,
            &config.keys,
        )
        .await?;
    let mut outcome = HistoryOutcome {
        bronze_found: true,
        ..HistoryOutcome::default()
    };
    if events.iter().any(|batch| batch.num_rows() > 0) {
        // 3. The fold, 4. the write, in one pass over history's files.
        let times = snapshot_times(&context, &facts).await?;
        let events = Events::new(
            events,
            history_schema.clone(),
            values_schema.clone(),
            &config.keys,
            &tracked,
            &times,
        )?;
        let counts = write::apply(
            &table,
            Arc::new(events),
            Arc::clone(&facts),
            Arc::new(times),
        )
        .await?;
        outcome.keys_changed = counts.keys_changed;
        outcome.versions_written = counts.versions_written;
        tracing::debug!(target = %config.target, ?counts, elapsed = ?started.elapsed(),
            "history written");
    }
    // 5. The position after the data, then the verdict.
    let mut new_position = plan.position.clone();
    if let Some(high) = plan.changes_to.as_ref() {
        let applied = collect_text(
            &context,
            &format!(
                "SELECT MAX(_start_lsn) FROM bronze WHERE _operation <> 0 AND _start_lsn > {} \
                 AND _start_lsn <= {}",
                text(position.applied_lsn.as_deref().unwrap_or_default()),
                text(high)
            ),
        )
        .await?;
        if let Some(applied) = applied.first().and_then(|row| row[0].clone()) {
            new_position.applied_lsn = Some(applied);
        }
    }
    let waiting = facts
        .snapshots
        .iter()
        .find(|snapshot| {
            new_position
                .snapshot_lsn
                .as_ref()
                .is_none_or(|applied| &snapshot.lsn > applied)
        })
        .map(|snapshot| snapshot.lsn.clone());
    let verdict = match (&bronze_verdict, &waiting) {
        (Some(end), None) => Some((end, config.granularity)),
        _ => None,
    };
    control::record_apply(&control_url, &config.target, &new_position, verdict).await?;
    let candidate =
        verdict.and_then(|(end, granularity)| end.commit_ts.map(|t| granularity.truncate(t)));
    outcome.finalized_until = history_row.finalized_until.max(candidate);
    outcome.applied_lsn = lsn_of(&new_position.applied_lsn);
    outcome.snapshot_lsn = lsn_of(&new_position.snapshot_lsn);
    outcome.waiting_snapshot = lsn_of(&waiting);
    Ok(outcome)
}

/// Whether `table` is a history: it records what it tracks, or holds every version column.
pub fn is_history(table: &deltalake::DeltaTable) -> Result<bool> {
    let snapshot = table.snapshot()?;
    let schema = snapshot.schema();
    Ok(snapshot
        .metadata()
        .configuration()
        .contains_key(TRACKED_PROPERTY)
        || VERSION_COLUMNS
            .iter()
            .all(|column| schema.field(column).is_some()))
}

/// The table property a history records its [`Tracked`] in: a version means one thing for
/// the table's life.
pub const TRACKED_PROPERTY: &str = "mssql_cdc.history.tracked";

fn tracked_text(tracked: &Tracked) -> String {
    serde_json::to_string(tracked).unwrap_or_default()
}

/// What the history at `target` tracks, as its table property records it (`None` when it
/// records nothing).
pub fn recorded_tracked(table: &deltalake::DeltaTable) -> Result<Option<Tracked>> {
    let snapshot = table.snapshot()?;
    let Some(text) = snapshot.metadata().configuration().get(TRACKED_PROPERTY) else {
        return Ok(None);
    };
    serde_json::from_str(text).map(Some).map_err(|error| {
        WriterError::invalid(format!(
            "history's {TRACKED_PROPERTY} is unreadable: {error}"
        ))
    })
}

/// Refuses a call that tracks otherwise than the history records; records it on a history
/// that records nothing.
async fn check_tracked(
    table: deltalake::DeltaTable,
    tracked: &Tracked,
    target: &str,
) -> Result<deltalake::DeltaTable> {
    match recorded_tracked(&table)? {
        Some(recorded) if &recorded == tracked => Ok(table),
        Some(recorded) => Err(WriterError::invalid(format!(
            "history {target} tracks {} but this call asks for {}: a history's versions mean \
             one thing for its life; apply into a new history table to track otherwise",
            tracked_text(&recorded),
            tracked_text(tracked)
        ))),
        None => Ok(table
            .set_tbl_properties()
            .with_properties(HashMap::from([(
                TRACKED_PROPERTY.to_string(),
                tracked_text(tracked),
            )]))
            .with_raise_if_not_exists(false)
            .await?),
    }
}

/// The columns of `history` a version's values are in: all but [`VERSION_COLUMNS`].
fn values_of(history: &SchemaRef) -> Result<SchemaRef> {
    let values: Vec<usize> = history
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, field)| !VERSION_COLUMNS.contains(&field.name().as_str()))
        .map(|(index, _)| index)
        .collect();
    Ok(Arc::new(history.project(&values)?))
}

/// History's fields: bronze's captured columns, `_start_lsn` and `_commit_ts` (bronze's
/// order), then [`VERSION_COLUMNS`], commented.
fn history_fields(bronze: &deltalake::kernel::StructType) -> Vec<StructField> {
    let specs = TableKind::History.columns();
    let comment = |name: &str| {
        specs
            .iter()
            .find(|spec| spec.name == name)
            .map(|spec| spec.comment)
    };
    bronze
        .fields()
        .filter(|field| !CHANGE_ONLY_COLUMNS.contains(&field.name().as_str()))
        .map(|field| match comment(field.name()) {
            Some(comment) => {
                tables::field_with_comment(field.name(), field.data_type().clone(), comment)
            }
            None => StructField::new(field.name(), field.data_type().clone(), true),
        })
        .chain(
            specs
                .iter()
                .filter(|spec| VERSION_COLUMNS.contains(&spec.name))
                .map(|spec| {
                    tables::field_with_comment(spec.name, spec.data_type.clone(), spec.comment)
                }),
        )
        .collect()
}

/// The columns whose changes open a version: captured columns of history, the keys left
/// out (a key change is another key).
fn tracked_columns(tracked: &Tracked, values: &[String], keys: &[String]) -> Result<Vec<String>> {
    let captured: Vec<&String> = values
        .iter()
        .filter(|name| !matches!(name.as_str(), "_start_lsn" | "_commit_ts"))
        .collect();
    let named: &[String] = match tracked {
        Tracked::All => &[],
        Tracked::Only(names) | Tracked::Except(names) => names,
    };
    if let Some(unknown) = named.iter().find(|name| !captured.contains(name)) {
        return Err(WriterError::invalid(format!(
            "history tracks column '{unknown}', which bronze does not hold (its captured \
             columns: {})",
            captured
                .iter()
                .map(|name| name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let columns: Vec<String> = captured
        .into_iter()
        .filter(|name| !keys.contains(name))
        .filter(|name| match tracked {
            Tracked::All => true,
            Tracked::Only(names) => names.contains(name),
            Tracked::Except(names) => !names.contains(name),
        })
        .cloned()
        .collect();
    if columns.is_empty() {
        return Err(WriterError::invalid(
            "history tracks no column but the key: name at least one other column (or leave \
             both track lists empty to track them all)",
        ));
    }
    Ok(columns)
}

/// The commit time of each snapshot's S, where the fold may place a version boundary: as
/// its open recorded it; in lakes written before opens recorded it, the earliest
/// `_commit_ts` of its rows (its first stamp's, at or after S).
async fn snapshot_times(
    context: &SessionContext,
    facts: &snapshots::Facts,
) -> Result<HashMap<String, i64>> {
    let mut times = facts.times.clone();
    if facts.points.iter().all(|s| times.contains_key(s)) {
        return Ok(times);
    }
    let rows = collect_text(
        context,
        "SELECT COALESCE(_snapshot, _start_lsn), CAST(MIN(_commit_ts) AS BIGINT) FROM bronze \
         WHERE _operation = 0 GROUP BY COALESCE(_snapshot, _start_lsn)",
    )
    .await?;
    for row in rows {
        if let (Some(s), Some(Ok(time))) = (row[0].clone(), row[1].as_deref().map(str::parse)) {
            times.entry(s).or_insert(time);
        }
    }
    Ok(times)
}
