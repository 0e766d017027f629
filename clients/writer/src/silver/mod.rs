//! Silver: `apply_changes` keeps a current-state table in step with bronze (seed ADR 0019
//! and its amendments).
//!
//! One call:
//! 1. reads bronze's verdict (control row), the facts' snapshot rows and silver's position
//!    first, then bronze at **one** pinned version for everything after;
//! 2. finds the newest complete snapshot (a `bootstrap`/`resnapshot` facts row, or whole
//!    operation-0 rows); when it is newer than the one silver was rebuilt from (or silver
//!    has no position), **rebuilds**: the snapshot's rows and the changes after it, the
//!    latest image per key, every other key gone;
//! 3. otherwise **merges** the latest image per key of the change rows past the position,
//!    with the rows of the waves a chunked snapshot announced since the last call and every
//!    change of their keys after its S (a chunk row never outranks a later delete);
//! 4. writes the position (`applied_lsn`, `snapshot_lsn`, `open_snapshot_lsn`,
//!    `snapshot_wave`) after the data and, in the same control MERGE, moves silver's verdict
//!    to bronze's as read in step 1, held while a snapshot is open and never without a facts
//!    table.
//!
//! The latest image per key ranks by `_start_lsn DESC, _command_id DESC, _seqval DESC,
//! _operation DESC`: a rebuild asks DataFusion for `ROW_NUMBER() OVER (PARTITION BY keys ...)`
//! (streamed, its sort spills), a merge picks it by one hash pass over the changes it holds
//! in memory anyway ([`ranking`]). Operation 1
//! deletes; 3 deletes its own key (the 4 of the same key and commit outranks it); 0, 2 and 4
//! upsert. A merged image only replaces a silver row when it is at least as new as the row's
//! `_start_lsn`, so a call left behind by a crash reapplies idempotently. The merge itself is
//! a copy-on-write of the files holding a changed key ([`rewrite`]), keys matched null-safely
//! as Arrow row-format bytes. What a call reads of the snapshots, and the range deletes of an
//! open snapshot's new chunks, are in [`snapshot`].

mod deletion_vectors;
pub mod history;
mod ranking;
mod rewrite;
mod snapshot;

pub use rewrite::MergeCounts;

use std::sync::Arc;

use arrow::datatypes::DataType as ArrowType;
use arrow::record_batch::RecordBatch;
use deltalake::datafusion::execution::memory_pool::FairSpillPool;
use deltalake::datafusion::execution::runtime_env::RuntimeEnvBuilder;
use deltalake::datafusion::prelude::{DataFrame, SessionConfig, SessionContext};
use deltalake::kernel::StructField;
use mssql_cdc_proto::{CommitTime, Lsn};

use crate::control::{self, Granularity};
use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind, quote_identifier as quote, quote_text as text};
use snapshot::{range_deletes, snapshot_facts};

/// What `apply_changes` works on.
#[derive(Clone, Debug)]
pub struct ApplyConfig {
    /// The source table (`schema.table`): bronze's verdict row in the control table is
    /// under this name, as the stream advances it.
    pub table: String,
    /// Bronze location (as the stream's `target`, which names it in the facts).
    pub bronze: String,
    /// Silver location (its name in the control table).
    pub target: String,
    /// The capture instance whose rows bronze holds; a row of another is an error. `None`
    /// takes bronze's rows whatever their instance (a stream that followed a switch).
    pub capture_instance: Option<String>,
    /// Key columns (the unique index CDC uses).
    pub keys: Vec<String>,
    /// Control table location (bronze's verdict in, silver's position and verdict out).
    pub control: String,
    /// Facts table location; without it chunked snapshots are refused and the verdict held.
    pub facts: Option<String>,
    /// Truncation of silver's verdict.
    pub granularity: Granularity,
    /// Turn on deletion vectors for silver (`delta.enableDeletionVectors`): merges mark the
    /// rows they replace beside their file instead of writing it again. False leaves the
    /// table as it is: a silver that has them keeps them.
    pub deletion_vectors: bool,
}

/// What a call did.
#[derive(Clone, Debug, PartialEq)]
pub struct ApplyOutcome {
    /// Whether silver was rebuilt from a snapshot.
    pub rebuilt: bool,
    /// The position after the call.
    pub applied_lsn: Option<Lsn>,
    /// Silver's verdict after the call.
    pub finalized_until: Option<CommitTime>,
    /// Whether bronze exists (nothing happens until it does).
    pub bronze_found: bool,
}

/// Bronze's metadata columns that silver does not keep.
const CHANGE_ONLY_COLUMNS: [&str; 7] = [
    "_capture_instance",
    "_seqval",
    "_operation",
    "_command_id",
    "_batch_id",
    "_snapshot",
    "_chunk",
];

/// Runs `apply_changes` once.
pub async fn apply_changes(config: &ApplyConfig) -> Result<ApplyOutcome> {
    // A commit silver moved under (another engine's OPTIMIZE) is refused; the call reads
    // again and applies on the new version.
    let outcome = tables::retry_conflicts(|| apply_once(config)).await;
    let outcome = outcome.map_err(|error| match &error {
        // DataFusion names its own setting; the writer's is the variable.
        WriterError::Query(query) if query.to_string().contains("Resources exhausted") => {
            WriterError::invalid(format!(
                "apply_changes into {}: the ranking ran out of its query memory; set {} above \
                 {} MiB (no row was written): {error}",
                config.target,
                QUERY_MEMORY_VARIABLE,
                query_memory_mib().unwrap_or(QUERY_MEMORY_MIB)
            ))
        }
        _ => error,
    })?;
    crate::metrics::finalized_until(&config.table, "silver", outcome.finalized_until);
    crate::metrics::silver_applied(&config.table, outcome.applied_lsn);
    Ok(outcome)
}

async fn apply_once(config: &ApplyConfig) -> Result<ApplyOutcome> {
    let call_started = std::time::Instant::now();
    if config.keys.is_empty() {
        return Err(WriterError::invalid(format!(
            "apply_changes into {} needs key columns: the capture instance has no unique index \
             CDC could name, so pass the columns that identify a row",
            config.target
        )));
    }
    let control_url = tables::table_url(&config.control)?;
    let bronze_url = tables::table_url(&config.bronze)?;
    let silver_url = tables::table_url(&config.target)?;
    // 1. The verdict and the facts first, then bronze pinned.
    let bronze_verdict = control::row(&control_url, &config.table)
        .await?
        .and_then(|row| row.end);
    let facts = match &config.facts {
        Some(location) => {
            Some(snapshot_facts(&tables::table_url(location)?, &config.bronze).await?)
        }
        None => None,
    };
    let silver_row = control::row(&control_url, &config.target)
        .await?
        .unwrap_or_default();
    let position = silver_row.position.clone();
    let Some(bronze) = tables::open(&bronze_url).await? else {
        return Ok(ApplyOutcome {
            rebuilt: false,
            applied_lsn: position.applied_lsn.and_then(|lsn| lsn.parse().ok()),
            finalized_until: None,
            bronze_found: false,
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

    // 2. The newest complete snapshot: the facts' completion rows or whole operation-0 rows
    //    (Amendment 3: only those past the snapshot silver was rebuilt from).
    let since = position.snapshot_lsn.clone().unwrap_or_default();
    let whole = collect_text(
        &context,
        &format!(
            "SELECT MAX(COALESCE(_snapshot, _start_lsn)) FROM bronze WHERE _operation = 0 \
             AND _chunk IS NULL AND _start_lsn > {}",
            text(&since)
        ),
    )
    .await?;
    let mut newest = whole.first().and_then(|row| row[0].clone());
    if let Some(facts) = &facts {
        newest = newest.max(facts.complete.clone());
    } else {
        let chunked = collect_text(
            &context,
            "SELECT COUNT(*) FROM bronze WHERE _operation = 0 AND _chunk IS NOT NULL",
        )
        .await?;
        if chunked.first().and_then(|row| row[0].as_deref()) != Some("0") {
            return Err(WriterError::invalid(format!(
                "bronze {} holds chunked snapshot rows: apply_changes needs the facts table to \
                 know which chunks are in and when the snapshot is complete",
                config.bronze
            )));
        }
    }
    let needs_rebuild = match (&newest, &position.snapshot_lsn) {
        (Some(newest), Some(rebuilt)) => newest > rebuilt,
        (Some(_), None) => true,
        // No snapshot: the changes alone (a stream from the earliest offset) are merged
        // (the first call writes them whole, below).
        (None, _) => false,
    };
    let open = facts.as_ref().and_then(|facts| facts.open.clone());
    let silver_fields = silver_fields(&schema)?;
    let key_list = config
        .keys
        .iter()
        .map(|key| quote(key))
        .collect::<Vec<_>>()
        .join(", ");
    // Only silver's columns and the operation go through the ranking's sort (bronze's other
    // metadata would widen every sorted row for nothing).
    let ranked_columns = silver_fields
        .iter()
        .map(|field| quote(field.name()))
        .chain(["_operation".to_string()])
        .collect::<Vec<_>>()
        .join(", ");
    let table = tables::ensure(
        &silver_url,
        TableKind::Silver,
        silver_fields.clone(),
        "silver",
    )
    .await?;
    let table = if config.deletion_vectors {
        deletion_vectors::turn_on(table, &config.target).await?
    } else {
        table
    };
    // Bronze's new captured columns (a newer capture instance's) join silver; keys no later
    // change touches read NULL there, as they do in bronze.
    let (table, _) = tables::add_missing_columns(table, &silver_fields, &config.target).await?;
    let mut new_position = position.clone();
    let rebuilt;
    tracing::debug!(target = %config.target, needs_rebuild, elapsed = ?call_started.elapsed(),
        "silver's position, bronze's verdict and the newest snapshot read");
    // A first call without a snapshot (a stream from the earliest offset) writes every key:
    // silver is written whole, streamed like a rebuild, not merged from memory.
    let first_load = newest.is_none() && position.applied_lsn.is_none();
    if needs_rebuild || first_load {
        // 3a. Rebuild: the snapshot's rows and the changes after it (no snapshot: every
        //     change); every other key goes.
        let source = match &newest {
            Some(snapshot) => format!(
                "SELECT * FROM bronze WHERE (_operation = 0 AND COALESCE(_snapshot, _start_lsn) = {s}) \
                 OR (_operation <> 0 AND _start_lsn > {s})",
                s = text(snapshot)
            ),
            None => "SELECT * FROM bronze WHERE _operation <> 0".to_string(),
        };
        // Written in key order, so each file holds a range of keys and a later merge
        // rewrites only the files whose ranges its changes fall in.
        let latest = context
            .sql(&format!(
                "SELECT * FROM ({}) WHERE _operation IN (0, 2, 4) ORDER BY {key_list}",
                ranking::window(&source, &ranked_columns, &config.keys)
            ))
            .await?;
        let frame = project_silver(latest, &silver_fields)?;
        let started = std::time::Instant::now();
        let rows = rewrite::overwrite(&table, frame.execute_stream().await?).await?;
        tracing::debug!(target = %config.target, rows, elapsed = ?started.elapsed(), "silver rebuilt");
        let high = collect_text(
            &context,
            &format!("SELECT MAX(_start_lsn) FROM ({source}) WHERE _operation <> 0"),
        )
        .await?;
        new_position.applied_lsn = high
            .first()
            .and_then(|row| row[0].clone())
            .max(newest.clone())
            .or(position.applied_lsn.clone());
        new_position.snapshot_lsn = newest.clone();
        rebuilt = needs_rebuild;
    } else {
        // 3b. Merge the changes past the position, with the new waves of an open snapshot.
        let applied = position.applied_lsn.clone().unwrap_or_default();
        let mut parts = vec![format!(
            "SELECT * FROM bronze WHERE _operation <> 0 AND _start_lsn > {}",
            text(&applied)
        )];
        if let (Some(open), Some(facts)) = (&open, &facts) {
            let since_wave = match &position.open_snapshot_lsn {
                Some(applied_open) if applied_open == open => position.snapshot_wave.unwrap_or(0),
                _ => 0,
            };
            let new_chunks: Vec<&(i32, i32, String)> = facts
                .chunks
                .iter()
                .filter(|(_, wave, _)| *wave > since_wave)
                .collect();
            if !new_chunks.is_empty() {
                let ids = new_chunks
                    .iter()
                    .map(|(chunk, ..)| chunk.to_string())
                    .collect::<Vec<_>>()
                    .join(", ");
                let first_stamp = new_chunks
                    .iter()
                    .map(|(_, _, stamp)| stamp.clone())
                    .min()
                    .unwrap_or_default();
                let chunk_rows = format!(
                    "SELECT * FROM bronze WHERE _operation = 0 AND _snapshot = {} AND _chunk IN ({ids}) \
                     AND _start_lsn >= {}",
                    text(open),
                    text(&first_stamp)
                );
                let key_match = config
                    .keys
                    .iter()
                    .map(|key| format!("c.{k} IS NOT DISTINCT FROM b.{k}", k = quote(key)))
                    .collect::<Vec<_>>()
                    .join(" AND ");
                // Every change of the new chunks' keys after the first new stamp ranks
                // with them (an older change ranks below every new chunk row anyway).
                parts.push(chunk_rows.clone());
                parts.push(format!(
                    "SELECT b.* FROM bronze b WHERE b._operation <> 0 AND b._start_lsn > {} \
                     AND EXISTS (SELECT 1 FROM ({chunk_rows}) c WHERE {key_match})",
                    text(&first_stamp)
                ));
                if let Some(deletes) =
                    range_deletes(&context, config, &schema, &silver_url, open, &new_chunks).await?
                {
                    parts.push(deletes);
                }
                new_position.snapshot_wave = new_chunks.iter().map(|(_, wave, _)| *wave).max();
                new_position.open_snapshot_lsn = Some(open.clone());
            }
        }
        // The parts of an open snapshot's waves overlap (a change is both past the position
        // and after a chunk's stamp): DISTINCT then, and only then (it hashes every column).
        let source = match parts.as_slice() {
            [changes] => changes.clone(),
            _ => format!("SELECT DISTINCT * FROM ({})", parts.join(" UNION ALL ")),
        };
        // Silver's columns and `_operation`, one row per key.
        let started = std::time::Instant::now();
        let budget = query_memory_mib()? << 20;
        let (latest, ranking) =
            ranking::latest(&context, &source, &ranked_columns, &config.keys, budget).await?;
        let ranked = started.elapsed();
        let counts = rewrite::merge(&table, latest, &config.keys).await?;
        tracing::debug!(target = %config.target, ?counts, ?ranking, ?ranked, merged = ?started.elapsed() - ranked,
            "silver merged");
        let high = collect_text(
            &context,
            &format!(
                "SELECT MAX(_start_lsn) FROM bronze WHERE _operation <> 0 AND _start_lsn > {}",
                text(&applied)
            ),
        )
        .await?;
        if let Some(high) = high.first().and_then(|row| row[0].clone()) {
            new_position.applied_lsn = Some(high);
        }
        rebuilt = false;
    }
    if open.is_none() {
        new_position.open_snapshot_lsn = None;
        new_position.snapshot_wave = None;
    }
    // 4. The position after the data, then the verdict.
    let verdict = match (&bronze_verdict, &facts, &open) {
        (Some(end), Some(_), None) => Some((end, config.granularity)),
        _ => None,
    };
    control::record_apply(&control_url, &config.target, &new_position, verdict).await?;
    let candidate =
        verdict.and_then(|(end, granularity)| end.commit_ts.map(|t| granularity.truncate(t)));
    let finalized_until = silver_row.finalized_until.max(candidate);
    tracing::debug!(target = %config.target, rebuilt, elapsed = ?call_started.elapsed(), "apply_changes done");
    Ok(ApplyOutcome {
        rebuilt,
        applied_lsn: new_position
            .applied_lsn
            .as_deref()
            .and_then(|lsn| lsn.parse().ok()),
        finalized_until,
        bronze_found: true,
    })
}

/// Registers `table` (bronze at `bronze`) as `bronze` in `context` and returns its schema;
/// refuses it when it lacks a key column, or holds rows of another capture instance than
/// `instance`, for `target`.
async fn register_bronze(
    context: &SessionContext,
    table: &deltalake::DeltaTable,
    keys: &[String],
    instance: Option<&str>,
    bronze: &str,
    target: &str,
) -> Result<Arc<deltalake::kernel::StructType>> {
    context.register_table("bronze", table.table_provider().await?)?;
    let schema = table.snapshot()?.schema();
    if keys.is_empty() {
        return Err(WriterError::invalid(format!(
            "{target} needs key columns: the capture instance has no unique index CDC could \
             name, so pass the columns that identify a row"
        )));
    }
    for key in keys {
        if schema.field(key).is_none() {
            return Err(WriterError::invalid(format!(
                "key column '{key}' is not a column of bronze {bronze}"
            )));
        }
    }
    if let Some(instance) = instance {
        let others = collect_text(
            context,
            &format!(
                "SELECT DISTINCT _capture_instance FROM bronze WHERE _capture_instance <> {} LIMIT 1",
                text(instance)
            ),
        )
        .await?;
        if let Some(other) = others.first().and_then(|row| row[0].clone()) {
            return Err(WriterError::invalid(format!(
                "bronze {bronze} holds rows of capture instance '{other}', not only '{instance}': \
                 {target} follows one bronze table of one capture instance"
            )));
        }
    }
    Ok(schema)
}

/// DataFusion's memory for one call's queries, in MiB, unless `QUERY_MEMORY_VARIABLE` says
/// otherwise. Past it the ranking's sort spills to disk; its merge of the spilled runs still
/// needs room (10,000,000 rows rebuild in 1 GiB, not in 512 MiB).
const QUERY_MEMORY_MIB: usize = 1024;

/// Overrides [`QUERY_MEMORY_MIB`] (a smaller writer host, or a larger one that should not
/// spill).
pub const QUERY_MEMORY_VARIABLE: &str = "MSSQL_CDC_WRITER_QUERY_MEMORY_MIB";

fn query_memory_mib() -> Result<usize> {
    Ok(match std::env::var(QUERY_MEMORY_VARIABLE) {
        Ok(value) => value
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|mib| *mib > 0)
            .ok_or_else(|| {
                WriterError::invalid(format!(
                    "{QUERY_MEMORY_VARIABLE}={value}: expected a positive number of MiB"
                ))
            })?,
        Err(_) => QUERY_MEMORY_MIB,
    })
}

fn query_context() -> Result<SessionContext> {
    let mib = query_memory_mib()?;
    // Fair, not greedy: a hash aggregate (the DISTINCT of an open snapshot's parts) must
    // not take the memory the ranking's sort needs to spill.
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_pool(Arc::new(FairSpillPool::new(mib << 20)))
        .build_arc()?;
    Ok(SessionContext::new_with_config_rt(
        SessionConfig::new(),
        runtime,
    ))
}

/// Silver's fields: bronze's captured columns, `_start_lsn` and `_commit_ts`, commented.
fn silver_fields(bronze: &deltalake::kernel::StructType) -> Result<Vec<StructField>> {
    let comments: std::collections::HashMap<&str, &str> = TableKind::Silver
        .columns()
        .into_iter()
        .map(|spec| (spec.name, spec.comment))
        .collect();
    Ok(bronze
        .fields()
        .filter(|field| !CHANGE_ONLY_COLUMNS.contains(&field.name().as_str()))
        .map(|field| match comments.get(field.name().as_str()) {
            Some(comment) => {
                tables::field_with_comment(field.name(), field.data_type().clone(), comment)
            }
            None => StructField::new(field.name(), field.data_type().clone(), true),
        })
        .collect())
}

/// The silver columns of a ranked frame, cast to silver's types.
fn project_silver(frame: DataFrame, fields: &[StructField]) -> Result<DataFrame> {
    let names: Vec<&str> = fields.iter().map(|field| field.name().as_str()).collect();
    Ok(frame.select_columns(&names)?)
}

/// Runs a query and returns its values as text.
async fn collect_text(context: &SessionContext, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
    let mut rows = Vec::new();
    for batch in context.sql(sql).await?.collect().await? {
        rows.extend(text_rows(&batch)?);
    }
    Ok(rows)
}

fn text_rows(batch: &RecordBatch) -> Result<Vec<Vec<Option<String>>>> {
    let columns: Vec<arrow::array::StringArray> = batch
        .columns()
        .iter()
        .map(|column| {
            let cast = arrow::compute::cast(column, &ArrowType::Utf8)?;
            cast.as_any()
                .downcast_ref::<arrow::array::StringArray>()
                .cloned()
                .ok_or_else(|| WriterError::Internal("cast to text".into()))
        })
        .collect::<Result<_>>()?;
    Ok((0..batch.num_rows())
        .map(|row| {
            columns
                .iter()
                .map(|column| {
                    arrow::array::Array::is_valid(column, row)
                        .then(|| column.value(row).to_string())
                })
                .collect()
        })
        .collect())
}
