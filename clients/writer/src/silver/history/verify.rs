//! History against bronze: what its position says it applied, replayed from nothing in one
//! fold, compared row by row with what it holds.
//!
//! Every version's interval, ending and values follow from bronze's rows and the facts
//! alone, so the calls that built the history (in whatever order the stream and the
//! snapshots' reads let them, replayed after crashes) must land where one call from nothing
//! does. A difference means a call lost, doubled or misplaced a version, or another engine
//! wrote the table. Reconcile runs it for a history table (docs/reconcile.md); it costs a
//! fold of all of bronze's rows in memory, and a read of the whole history.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::row::{RowConverter, SortField};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use deltalake::datafusion::datasource::MemTable;

use super::plan::Plan;
use super::versions::Events;
use super::{HistoryConfig, recorded_tracked, snapshot_times, snapshots, values_of};
use crate::control;
use crate::error::{Result, WriterError};
use crate::silver::{query_context, register_bronze, rewrite};
use crate::tables;

/// What a replay found.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Replayed {
    /// Version rows the history holds.
    pub versions: u64,
    /// Rows held but not replayed, and replayed but not held.
    pub differences: u64,
    /// The first few, as `held`/`replayed` with the key and `__valid_from`.
    pub first: Vec<String>,
}

/// Replays the history of `config` (tracking as it records) and compares.
pub async fn replay(config: &HistoryConfig) -> Result<Replayed> {
    let control_url = tables::table_url(&config.control)?;
    let position = control::row(&control_url, &config.target)
        .await?
        .map(|row| row.position)
        .ok_or_else(|| {
            WriterError::invalid(format!(
                "history {} has no position in {}: run apply_history first",
                config.target, config.control
            ))
        })?;
    let facts = snapshots::read(&tables::table_url(&config.facts)?, &config.bronze).await?;
    let missing = |what: &str, location: &str| {
        WriterError::invalid(format!("there is no {what} table at {location}"))
    };
    let bronze = tables::open(&tables::table_url(&config.bronze)?)
        .await?
        .ok_or_else(|| missing("bronze", &config.bronze))?;
    let history = tables::open(&tables::table_url(&config.target)?)
        .await?
        .ok_or_else(|| missing("history", &config.target))?;
    let tracked = recorded_tracked(&history)?.unwrap_or_else(|| config.tracked.clone());
    let context = query_context()?;
    register_bronze(
        &context,
        &bronze,
        &config.keys,
        config.capture_instance.as_deref(),
        &config.bronze,
        &config.target,
    )
    .await?;
    let history_schema = history.snapshot()?.snapshot().arrow_schema();
    // The replay starts from nothing: an empty history.
    context.register_table(
        "history",
        Arc::new(MemTable::try_new(history_schema.clone(), vec![vec![]])?),
    )?;
    let values_schema = values_of(&history_schema)?;
    let value_names: Vec<String> = values_schema
        .fields()
        .iter()
        .map(|field| field.name().to_string())
        .collect();
    let tracked = super::tracked_columns(&tracked, &value_names, &config.keys)?;
    let plan = Plan::replaying(&facts, &position);
    let events = plan
        .events(&context, None, &values_schema, &config.keys)
        .await?;
    let times = snapshot_times(&context, &facts).await?;
    let events = Events::new(
        events,
        history_schema.clone(),
        values_schema,
        &config.keys,
        &tracked,
        &times,
    )?;
    let (replayed, _) =
        events.fold_from_nothing(&facts, &times, &HashMap::new(), &HashSet::new())?;
    context.register_table("held", history.table_provider().await?)?;
    let held: Vec<RecordBatch> = context
        .sql("SELECT * FROM held")
        .await?
        .collect()
        .await?
        .iter()
        .map(|batch| rewrite::conform(batch, &history_schema))
        .collect::<Result<_>>()?;
    compare(&held, &replayed, &config.keys)
}

/// The rows of `held` and `replayed` (in history's schema) that the other lacks.
fn compare(held: &[RecordBatch], replayed: &RecordBatch, keys: &[String]) -> Result<Replayed> {
    let schema = replayed.schema();
    let converter = RowConverter::new(
        schema
            .fields()
            .iter()
            .map(|field| SortField::new(field.data_type().clone()))
            .collect(),
    )?;
    // Row bytes → (count held − count replayed, where to describe it: batch and row).
    type Balance = (i64, (usize, usize));
    let mut balance: HashMap<Box<[u8]>, Balance> = HashMap::new();
    let mut sources: Vec<&RecordBatch> = held.iter().collect();
    sources.push(replayed);
    let mut versions = 0u64;
    for (index, batch) in sources.iter().enumerate() {
        let side = if index + 1 == sources.len() { -1 } else { 1 };
        if side == 1 {
            versions += batch.num_rows() as u64;
        }
        let rows = converter.convert_columns(batch.columns())?;
        for row in 0..batch.num_rows() {
            let entry = balance
                .entry(Box::from(rows.row(row).as_ref()))
                .or_insert((0, (index, row)));
            entry.0 += side;
        }
    }
    let describe = |(batch, row): (usize, usize), count: i64| -> String {
        let batch = sources[batch];
        let text = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|column| {
                    ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())
                        .ok()
                        .map(|formatter| formatter.value(row).to_string())
                })
                .unwrap_or_default()
        };
        let key = keys
            .iter()
            .map(|key| text(key))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "{} key ({key}) from {} to {} ({})",
            if count > 0 {
                "held, not replayed:"
            } else {
                "replayed, not held:"
            },
            text("__valid_from"),
            text("__valid_to"),
            text("__ended_by")
        )
    };
    let mut found = Replayed {
        versions,
        ..Replayed::default()
    };
    let mut unequal: Vec<&Balance> = balance.values().filter(|(count, _)| *count != 0).collect();
    unequal.sort_by_key(|(_, at)| *at);
    for (count, at) in unequal {
        found.differences += count.unsigned_abs();
        if found.first.len() < 5 {
            found.first.push(describe(*at, *count));
        }
    }
    Ok(found)
}
