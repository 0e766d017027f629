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
//! The latest image per key is ranked by DataFusion: `ROW_NUMBER() OVER (PARTITION BY keys
//! ORDER BY _start_lsn DESC, _command_id DESC, _seqval DESC, _operation DESC)`. Operation 1
//! deletes; 3 deletes its own key (the 4 of the same key and commit outranks it); 0, 2 and 4
//! upsert. A merged image only replaces a silver row when it is at least as new as the row's
//! `_start_lsn`, so a call left behind by a crash reapplies idempotently. The merge itself is
//! a copy-on-write of the files holding a changed key ([`rewrite`]), keys matched null-safely
//! as Arrow row-format bytes.

mod rewrite;

pub use rewrite::MergeCounts;

use std::sync::Arc;

use arrow::datatypes::DataType as ArrowType;
use arrow::record_batch::RecordBatch;
use deltalake::datafusion::execution::memory_pool::FairSpillPool;
use deltalake::datafusion::execution::runtime_env::RuntimeEnvBuilder;
use deltalake::datafusion::prelude::{DataFrame, SessionConfig, SessionContext};
use deltalake::kernel::StructField;
use mssql_cdc_proto::{CommitTime, Lsn};
use url::Url;

use crate::control::{self, Granularity};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts;
use crate::snapshot::SnapshotMode;
use crate::tables::{self, TableKind};

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

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn text(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The snapshot facts of the bronze table: complete snapshots, the open chunked one, chunks.
#[derive(Debug, Default)]
struct SnapshotFacts {
    /// Newest complete snapshot's S.
    complete: Option<String>,
    /// The newest chunked snapshot opened after every complete one, not complete.
    open: Option<String>,
    /// `(chunk, wave, stamp)` of the open snapshot's chunks.
    chunks: Vec<(i32, i32, String)>,
}

async fn snapshot_facts(facts: &Url, bronze: &str) -> Result<SnapshotFacts> {
    let rows = tables::query_text(
        facts,
        &format!(
            "SELECT event, min_lsn, detail FROM t WHERE target = {} AND event IN ({})",
            text(bronze),
            events::sql_list(&[
                events::SNAPSHOT_OPEN,
                events::SNAPSHOT_CHUNK,
                events::BOOTSTRAP,
                events::RESNAPSHOT,
            ])
        ),
    )
    .await?;
    let detail =
        |row: &Vec<Option<String>>| -> serde_json::Value { facts::detail_of(row[2].as_deref()) };
    let mut found = SnapshotFacts {
        complete: rows
            .iter()
            .filter(|row| {
                row[0]
                    .as_deref()
                    .is_some_and(|event| events::SNAPSHOT_COMPLETIONS.contains(&event))
            })
            .filter_map(|row| row[1].clone())
            .max(),
        ..SnapshotFacts::default()
    };
    found.open = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_OPEN))
        .filter(|row| SnapshotMode::of_detail(&detail(row)) == SnapshotMode::Chunked)
        .filter_map(|row| row[1].clone())
        .filter(|open| found.complete.as_ref().is_none_or(|done| open > done))
        .max();
    if let Some(open) = &found.open {
        found.chunks = rows
            .iter()
            .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_CHUNK))
            .filter_map(|row| {
                let detail = detail(row);
                (detail["snapshot"].as_str() == Some(open.as_str())).then(|| {
                    (
                        detail["chunk"].as_i64().unwrap_or(-1) as i32,
                        detail["wave"].as_i64().unwrap_or(0) as i32,
                        row[1].clone().unwrap_or_default(),
                    )
                })
            })
            .collect();
    }
    Ok(found)
}

/// Runs `apply_changes` once.
pub async fn apply_changes(config: &ApplyConfig) -> Result<ApplyOutcome> {
    apply_once(config).await.map_err(|error| match &error {
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
    })
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
    context.register_table("bronze", bronze.table_provider().await?)?;
    let schema = bronze.snapshot()?.schema();
    for key in &config.keys {
        if schema.field(key).is_none() {
            return Err(WriterError::invalid(format!(
                "key column '{key}' is not a column of bronze {}",
                config.bronze
            )));
        }
    }
    if let Some(instance) = &config.capture_instance {
        let others = collect_text(
            &context,
            &format!(
                "SELECT DISTINCT _capture_instance FROM bronze WHERE _capture_instance <> {} LIMIT 1",
                text(instance)
            ),
        )
        .await?;
        if let Some(other) = others.first().and_then(|row| row[0].clone()) {
            return Err(WriterError::invalid(format!(
                "bronze {} holds rows of capture instance '{other}', not only '{instance}': \
                 one silver table follows one bronze table of one capture instance",
                config.bronze
            )));
        }
    }

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
    let rank = |source: &str| {
        format!(
            "SELECT {ranked_columns} FROM (SELECT {ranked_columns}, ROW_NUMBER() OVER \
             (PARTITION BY {key_list} ORDER BY _start_lsn DESC, _command_id DESC NULLS LAST, \
             _seqval DESC NULLS LAST, _operation DESC) AS _rank FROM ({source})) WHERE _rank = 1"
        )
    };
    let table = tables::ensure(
        &silver_url,
        TableKind::Silver,
        silver_fields.clone(),
        "silver",
    )
    .await?;
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
                rank(&source)
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
        let latest = context.sql(&rank(&source)).await?.collect().await?;
        let ranked = started.elapsed();
        let counts = rewrite::merge(&table, latest, &config.keys).await?;
        tracing::debug!(target = %config.target, ?counts, ?ranked, merged = ?started.elapsed() - ranked,
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

/// Amendment 2's range deletes of the new chunks of an open snapshot, as a query of
/// operation-1 rows in bronze's columns: each silver key inside a chunk's range `[lo, hi)`
/// that the chunk does not hold and whose image is older than the chunk's stamp L is deleted
/// at L (so a later change of the key still outranks it). Only when silver's key is the
/// snapshot's own single integer, date or timestamp key (its `snapshot_open` plans row,
/// [`RangeKey`]): other keys leave stale rows to the rebuild at completion. `None` when
/// there is nothing to delete from.
async fn range_deletes(
    context: &SessionContext,
    config: &ApplyConfig,
    bronze_schema: &deltalake::kernel::StructType,
    silver_url: &Url,
    open: &str,
    new_chunks: &[&(i32, i32, String)],
) -> Result<Option<String>> {
    let [key] = config.keys.as_slice() else {
        return Ok(None);
    };
    let plans_url = tables::table_url(&crate::snapshot::plans_location(&config.bronze))?;
    if tables::open(&plans_url).await?.is_none() {
        return Ok(None);
    }
    let Some(silver) = tables::open(silver_url).await? else {
        return Ok(None); // a silver table still to be created holds no stale key
    };
    let rows = tables::query_text(
        &plans_url,
        &format!(
            "SELECT event, detail FROM t WHERE snapshot = {} AND event IN ({})",
            text(open),
            events::sql_list(&[events::SNAPSHOT_OPEN, events::SNAPSHOT_CHUNK])
        ),
    )
    .await?;
    let details: Vec<(String, serde_json::Value)> = rows
        .into_iter()
        .filter_map(|row| {
            Some((
                row[0].clone()?,
                serde_json::from_str(row[1].as_deref()?).ok()?,
            ))
        })
        .collect();
    let Some(kind) = details
        .iter()
        .filter(|(event, _)| event == events::SNAPSHOT_OPEN)
        .find_map(|(_, open)| RangeKey::of_open(open, key))
    else {
        return Ok(None);
    };
    let k = quote(key);
    let mut stale = Vec::new();
    for (chunk, _, stamp) in new_chunks {
        let Some((_, planned)) = details.iter().find(|(event, detail)| {
            event == events::SNAPSHOT_CHUNK && detail["chunk"].as_i64() == Some(i64::from(*chunk))
        }) else {
            continue;
        };
        let mut range = vec![format!("s.{k} IS NOT NULL")];
        if !planned["lo"].is_null() {
            range.push(kind.condition(&k, &planned["lo"], true)?);
        }
        if !planned["hi"].is_null() {
            range.push(kind.condition(&k, &planned["hi"], false)?);
        }
        stale.push(format!(
            "SELECT s.{k} AS __key, {stamp} AS __stamp FROM silver s WHERE {} \
             AND s._start_lsn < {stamp} AND NOT EXISTS (SELECT 1 FROM bronze c WHERE \
             c._operation = 0 AND c._snapshot = {open} AND c._chunk = {chunk} AND c.{k} = s.{k})",
            range.join(" AND "),
            stamp = text(stamp),
            open = text(open),
        ));
    }
    if stale.is_empty() {
        return Ok(None);
    }
    if context.table_exist("silver")? {
        context.deregister_table("silver")?;
    }
    context.register_table("silver", silver.table_provider().await?)?;
    // One bronze row per stale key lends its columns; the metadata says "deleted at L".
    let columns = bronze_schema
        .fields()
        .map(|field| match field.name().as_str() {
            "_operation" => "CAST(1 AS INT) AS \"_operation\"".to_string(),
            "_start_lsn" => "__stamp AS \"_start_lsn\"".to_string(),
            "_seqval" => "CAST(NULL AS VARCHAR) AS \"_seqval\"".to_string(),
            "_command_id" => "CAST(NULL AS INT) AS \"_command_id\"".to_string(),
            name => quote(name),
        })
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Some(format!(
        "SELECT {columns} FROM (SELECT b.*, d.__stamp, ROW_NUMBER() OVER (PARTITION BY b.{k} \
         ORDER BY b._start_lsn) AS __n FROM bronze b JOIN ({}) d ON b.{k} = d.__key) \
         WHERE __n = 1",
        stale.join(" UNION ALL ")
    )))
}

/// The snapshot's own key when range deletes apply to it (Amendment 2): one column of an
/// integer, date or timestamp type, which DataFusion orders as SQL Server does. Strings
/// (ordered by collation there, by bytes here) and composite keys get none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RangeKey {
    /// An integer key: integer bounds (BIGINT's maximum is an open last chunk).
    Integer,
    /// A `date` key: bounds `YYYY-MM-DD`.
    Date,
    /// A `datetime2` or `smalldatetime` key: bounds as ISO text, maybe finer than the
    /// microseconds silver holds.
    Timestamp,
    /// A `datetime` key: bounds as ISO text in milliseconds, the value in 1/300 s ticks.
    DateTime,
}

impl RangeKey {
    /// The kind of `key` in a `snapshot_open` plans row, when it is the snapshot's own key.
    fn of_open(open: &serde_json::Value, key: &str) -> Option<Self> {
        use mssql_cdc_proto::types::SqlType;
        let parse = |text: &serde_json::Value| text.as_str()?.parse::<SqlType>().ok();
        // An integer plan records the key's extent.
        if open["column"].as_str() == Some(key) {
            return parse(&open["sql_type"])
                .filter(SqlType::is_integer)
                .map(|_| RangeKey::Integer);
        }
        let keys = open["keys"].as_array()?;
        if open["kind"] != "keyset" || open["unique"] != true || keys.len() != 1 {
            return None;
        }
        if keys[0]["name"].as_str() != Some(key) {
            return None;
        }
        match parse(&keys[0]["sql_type"])? {
            SqlType::Date => Some(RangeKey::Date),
            SqlType::DateTime2 { .. } | SqlType::SmallDateTime => Some(RangeKey::Timestamp),
            SqlType::DateTime => Some(RangeKey::DateTime),
            _ => None,
        }
    }

    /// `s.k >= lo` (`lower`) or `s.k < hi` for a recorded bound, narrowed so that only keys
    /// certainly inside the chunk's range are deleted: silver holds date-times in
    /// microseconds, so a key in the microsecond of a bound finer than that (datetime2(7))
    /// could lie on either side of it in SQL Server and is left to the rebuild (the
    /// microsecond rule); a `datetime` bound in milliseconds keeps a millisecond's margin.
    fn condition(self, k: &str, bound: &serde_json::Value, lower: bool) -> Result<String> {
        let op = if lower { ">=" } else { "<" };
        let value = match bound {
            serde_json::Value::Array(values) if values.len() == 1 => &values[0],
            other => other,
        };
        let refused = || WriterError::Internal(format!("a range bound {bound} of a {self:?} key"));
        Ok(match self {
            RangeKey::Integer => format!("s.{k} {op} {}", value.as_i64().ok_or_else(refused)?),
            RangeKey::Date => format!(
                "s.{k} {op} CAST({} AS DATE)",
                text(value.as_str().ok_or_else(refused)?)
            ),
            RangeKey::Timestamp | RangeKey::DateTime => {
                let parsed = chrono::NaiveDateTime::parse_from_str(
                    value.as_str().ok_or_else(refused)?,
                    "%Y-%m-%dT%H:%M:%S%.f",
                )
                .map_err(|_| refused())?;
                let nanos = parsed.and_utc().timestamp_nanos_opt().ok_or_else(refused)?;
                let (floor, finer) = (nanos.div_euclid(1_000), nanos.rem_euclid(1_000) != 0);
                let micros = match (self, lower) {
                    (RangeKey::DateTime, true) => floor + 1_000,
                    (RangeKey::DateTime, false) => floor - 1_000,
                    // The first whole microsecond at or above lo; the hi's own microsecond
                    // is excluded by `<` on its floor.
                    (_, true) => floor + i64::from(finer),
                    (_, false) => floor,
                };
                let literal = chrono::DateTime::from_timestamp_micros(micros)
                    .ok_or_else(refused)?
                    .naive_utc()
                    .format("%Y-%m-%dT%H:%M:%S%.6f");
                format!("s.{k} {op} CAST('{literal}' AS TIMESTAMP)")
            }
        })
    }
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::RangeKey;

    #[test]
    fn range_deletes_apply_to_the_snapshots_own_integer_date_or_timestamp_key() {
        let extent = json!({"column": "id", "sql_type": "bigint", "min": 1, "max": 9});
        assert_eq!(RangeKey::of_open(&extent, "id"), Some(RangeKey::Integer));
        assert_eq!(RangeKey::of_open(&extent, "other"), None);
        let keyset = |keys: serde_json::Value, unique: bool| json!({"kind": "keyset", "keys": keys, "unique": unique, "max": null});
        let taken = json!([{"name": "taken_at", "sql_type": "datetime2(7)"}]);
        assert_eq!(
            RangeKey::of_open(&keyset(taken.clone(), true), "taken_at"),
            Some(RangeKey::Timestamp)
        );
        assert_eq!(
            RangeKey::of_open(&keyset(taken, false), "taken_at"),
            None,
            "columns that repeat are no silver key"
        );
        let day = json!([{"name": "day", "sql_type": "date"}]);
        assert_eq!(
            RangeKey::of_open(&keyset(day, true), "day"),
            Some(RangeKey::Date)
        );
        let text = json!([{"name": "code", "sql_type": "nvarchar(40)"}]);
        assert_eq!(
            RangeKey::of_open(&keyset(text, true), "code"),
            None,
            "strings: collation"
        );
        let composite = json!([
            {"name": "region", "sql_type": "varchar(20)"},
            {"name": "id", "sql_type": "int"}
        ]);
        assert_eq!(RangeKey::of_open(&keyset(composite, true), "id"), None);
    }

    #[test]
    fn a_key_in_a_bounds_microsecond_is_left_to_the_rebuild() {
        let k = "\"taken_at\"";
        let condition = |kind: RangeKey, bound: serde_json::Value, lower: bool| {
            kind.condition(k, &bound, lower).expect("condition")
        };
        // datetime2(7): 100 ns below the microsecond boundary.
        let fine = json!(["2026-01-01T00:00:00.1234567"]);
        assert_eq!(
            condition(RangeKey::Timestamp, fine.clone(), true),
            "s.\"taken_at\" >= CAST('2026-01-01T00:00:00.123457' AS TIMESTAMP)"
        );
        assert_eq!(
            condition(RangeKey::Timestamp, fine, false),
            "s.\"taken_at\" < CAST('2026-01-01T00:00:00.123456' AS TIMESTAMP)"
        );
        // On a whole microsecond nothing is narrowed.
        let whole = json!(["2026-01-01T00:00:00.123456"]);
        assert_eq!(
            condition(RangeKey::Timestamp, whole.clone(), true),
            "s.\"taken_at\" >= CAST('2026-01-01T00:00:00.123456' AS TIMESTAMP)"
        );
        assert_eq!(
            condition(RangeKey::Timestamp, whole, false),
            "s.\"taken_at\" < CAST('2026-01-01T00:00:00.123456' AS TIMESTAMP)"
        );
        // datetime: milliseconds of 1/300 s ticks, a millisecond's margin each side.
        let millis = json!(["2026-01-01T00:00:00.007"]);
        assert_eq!(
            condition(RangeKey::DateTime, millis.clone(), true),
            "s.\"taken_at\" >= CAST('2026-01-01T00:00:00.008000' AS TIMESTAMP)"
        );
        assert_eq!(
            condition(RangeKey::DateTime, millis, false),
            "s.\"taken_at\" < CAST('2026-01-01T00:00:00.006000' AS TIMESTAMP)"
        );
        assert_eq!(
            condition(RangeKey::Date, json!(["2026-03-01"]), false),
            "s.\"taken_at\" < CAST('2026-03-01' AS DATE)"
        );
        assert_eq!(
            condition(RangeKey::Integer, json!(9_223_372_036_854_775_807i64), true),
            "s.\"taken_at\" >= 9223372036854775807"
        );
        assert!(
            RangeKey::Timestamp
                .condition(k, &json!(["not a time"]), true)
                .is_err()
        );
    }
}
