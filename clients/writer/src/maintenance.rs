//! Table maintenance: compaction, log checkpoints, log cleanup and `VACUUM`.
//!
//! Every poll of every table appends a facts row, moves a control row and (with rows) adds
//! bronze files, so without maintenance a table's file count and log grow for ever. One pass
//! over a table:
//!
//! 1. **Compaction** (bronze, facts, control, plans, reconcile report): when the table holds
//!    at least `min_files` files smaller than half its target file size, they are bin-packed
//!    ([`crate::compaction`]: a commit of `dataChange = false` removes and adds, which no
//!    other compaction of the same files can also land; readers of the change log, silver
//!    included, read bronze by `_start_lsn`, not by file, so they see no change). Silver and
//!    history are not compacted here: their copy-on-write applies fold their small files
//!    into one on every call already.
//! 2. **A log checkpoint** at the table's version, so readers and the next commit load
//!    one Parquet file instead of replaying JSON commits.
//! 3. **`VACUUM`** (full: the files of removed versions and the orphans of batches a crash
//!    aborted) of files unreferenced for longer than the retention (7 days by default, never
//!    less than the table's `delta.deletedFileRetentionDuration`), so no reader of a version
//!    younger than that loses a file: deletion vector files a remove within the retention
//!    carried are kept too, which delta-rs would delete by their age alone.
//! 4. **Log cleanup**: commit files older than the table's `delta.logRetentionDuration`
//!    (30 days by default) and behind the checkpoint are removed.
//!
//! A pass is safe next to a running writer and next to another pass: appends and a
//! compaction do not conflict, two compactions of one table never both land, a commit that
//! conflicts is retried on the table as it is then, and what a conflict leaves undone is
//! done by the next pass. In a process the pass takes each table's turn ([`crate::owner`])
//! around its log checkpoint and `VACUUM`.

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use delta_kernel::actions::deletion_vector::DeletionVectorDescriptor as KernelDescriptor;
use deltalake::DeltaTable;
use deltalake::kernel::Remove;
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{self, ObjectStoreExt};
use deltalake::operations::vacuum::{Clock, VacuumBuilder, VacuumMode};
use deltalake::table::config::TablePropertiesExt;
use serde::Serialize;
use url::Url;

use crate::compaction::{self, Bins};
use crate::error::{Result, WriterError};
use crate::tables::{self, TableKind};

/// What a pass does, the same for every table it visits.
#[derive(Clone, Debug)]
pub struct MaintenanceOptions {
    /// Compact once a table holds this many small files (smaller than half its target size).
    pub min_files: usize,
    /// Keep unreferenced files this long before `VACUUM` removes them.
    pub vacuum_retention: Duration,
    /// The clock maintenance judges age by (the wall clock; a fast one in tests).
    pub clock: Arc<dyn Clock>,
}

impl Default for MaintenanceOptions {
    fn default() -> Self {
        MaintenanceOptions {
            min_files: 16,
            vacuum_retention: DEFAULT_VACUUM_RETENTION,
            clock: Arc::new(WallClock),
        }
    }
}

/// Delta's default `delta.deletedFileRetentionDuration`: a week.
pub const DEFAULT_VACUUM_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The wall clock.
#[derive(Debug)]
pub struct WallClock;

impl Clock for WallClock {
    fn current_timestamp_millis(&self) -> i64 {
        chrono::Utc::now().timestamp_millis()
    }
}

/// What one pass did to one table.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TableMaintenance {
    /// The table's location.
    pub location: String,
    /// Its kind (`bronze`, `facts`, ...).
    pub kind: String,
    /// Data files of the table before the pass.
    pub files_before: usize,
    /// Data files after it.
    pub files_after: usize,
    /// Small files compaction folded together.
    pub compacted: u64,
    /// The version the log checkpoint was written at.
    pub checkpoint_version: Option<u64>,
    /// Log files removed by cleanup.
    pub log_files_removed: usize,
    /// Files `VACUUM` deleted.
    pub vacuumed: usize,
}

/// Maintains the table of `kind` at `location`; `None` when there is no table there yet.
pub async fn maintain(
    location: &str,
    kind: TableKind,
    options: &MaintenanceOptions,
) -> Result<Option<TableMaintenance>> {
    let url = tables::table_url(location)?;
    let Some(table) = tables::open(&url).await? else {
        return Ok(None);
    };
    crate::features::check(&table, kind, location)?;
    let mut report = TableMaintenance {
        location: location.to_string(),
        kind: kind.name().to_string(),
        files_before: table.snapshot()?.log_data().num_files(),
        ..TableMaintenance::default()
    };
    if !matches!(kind, TableKind::Silver | TableKind::History) {
        report.compacted = compact(&url, options.min_files).await?;
    }
    // The table compaction committed to, else the one loaded.
    let table = if report.compacted > 0 {
        reload(&url).await?
    } else {
        table
    };
    // The log checkpoint and VACUUM's commits in the table's turn: this process's writers
    // of it wait, and those of other processes meet VACUUM's commits as appends.
    let turn = crate::owner::turn(&url).await;
    let version = table.version().unwrap_or(0);
    deltalake::checkpoints::create_checkpoint(&table, None).await?;
    report.checkpoint_version = Some(version);
    let (table, vacuumed) = vacuum(table, options).await?;
    report.vacuumed = vacuumed;
    drop(turn);
    // Last: the log cleanup removes the files a snapshot loaded before it was listed from.
    let log_retention = table.snapshot()?.table_config().log_retention_duration();
    let cutoff = options.clock.current_timestamp_millis() - log_retention.as_millis() as i64;
    report.log_files_removed = deltalake::checkpoints::cleanup_expired_logs_for(
        version,
        table.log_store().as_ref(),
        cutoff,
        None,
    )
    .await?;
    report.files_after = table.snapshot()?.log_data().num_files();
    Ok(Some(report))
}

async fn reload(url: &Url) -> Result<DeltaTable> {
    tables::open(url)
        .await?
        .ok_or_else(|| WriterError::Internal(format!("the table at {url} disappeared")))
}

/// Bin-packs the table's small files when there are `min_files` of them; the files folded.
async fn compact(url: &Url, min_files: usize) -> Result<u64> {
    tables::retry_conflicts(|| async {
        let table = reload(url).await?;
        let target = table.snapshot()?.table_config().target_file_size();
        let bins = Bins {
            small_below: target.get() / 2,
            target,
            min_files,
        };
        compaction::compact(&table, bins).await
    })
    .await
}

/// How many small files an appended-to ledger table (facts, plans, reconcile report) holds
/// before the writer that appended compacts it ([`auto_compact`]).
pub const AUTO_COMPACT_FILES: usize = 32;

/// The file size [`auto_compact`] bin-packs to. Small, so a pass rewrites at most this much
/// next to the small files: files past it stay until a maintenance pass packs them to the
/// table's own target size.
pub const AUTO_COMPACT_TARGET: u64 = 8 << 20;

/// Auto compaction: bin-packs `table`'s small files (under half of [`AUTO_COMPACT_TARGET`])
/// once there are [`AUTO_COMPACT_FILES`] of them; the table after it and the files folded.
///
/// delta-rs (1.1) keeps the list of every live file of a loaded table and rebuilds it on
/// every update, its own commits included, so a commit costs time in proportion to the
/// table's files: a one-row facts append took 682 ms at 2,000 files (`benches/
/// facts_appends.rs`; docs/writer.md, "Small files compacted as they are appended"). A
/// table of one small file per commit would slow every writer of it between maintenance
/// passes; compacting every [`AUTO_COMPACT_FILES`] small files keeps the list short. The
/// compaction ([`crate::compaction`]) commits with `dataChange = false`, which concurrent
/// appends do not conflict with.
pub async fn auto_compact(table: DeltaTable) -> Result<(DeltaTable, u64)> {
    let bins = Bins {
        small_below: AUTO_COMPACT_TARGET / 2,
        target: NonZeroU64::new(AUTO_COMPACT_TARGET).expect("a nonzero target"),
        min_files: AUTO_COMPACT_FILES,
    };
    if compaction::small_files(&table, bins)? < AUTO_COMPACT_FILES {
        return Ok((table, 0));
    }
    let folded = compaction::compact(&table, bins).await?;
    let mut table = table;
    if folded > 0 {
        table.update_incremental(None).await?;
    }
    Ok((table, folded))
}

/// Removes files unreferenced for longer than the retention (and the orphans of aborted
/// writes as old); the table after its commits and the number removed.
async fn vacuum(table: DeltaTable, options: &MaintenanceOptions) -> Result<(DeltaTable, usize)> {
    let retention = chrono::Duration::from_std(options.vacuum_retention)
        .map_err(|error| WriterError::invalid(format!("vacuum retention: {error}")))?;
    let table_minimum = table
        .snapshot()?
        .table_config()
        .deleted_file_retention_duration();
    if options.vacuum_retention < table_minimum {
        return Err(WriterError::invalid(format!(
            "a vacuum retention of {:.1} hours is shorter than the table's \
             delta.deletedFileRetentionDuration ({:.1} hours): readers of older versions \
             would lose files",
            options.vacuum_retention.as_secs_f64() / 3600.0,
            table_minimum.as_secs_f64() / 3600.0
        )));
    }
    let vacuum = |table: DeltaTable| {
        table
            .vacuum()
            .with_retention_period(retention)
            .with_mode(VacuumMode::Full)
            .with_clock(Arc::clone(&options.clock))
    };
    // delta-rs judges a deletion vector file no version references now by its age alone: a
    // vector written long ago and replaced yesterday went, while the versions before
    // yesterday (time travel, a reader pinned to one) still read it. Those are kept here.
    // Only a table with the deletionVectors feature holds such files, so only its pass
    // lists the table twice (a dry run first).
    if crate::features::has_writer_feature(&table, "deletionVectors")? {
        let cutoff = options.clock.current_timestamp_millis() - retention.num_milliseconds();
        if let Some(deleted) = vacuum_keeping_vectors(&table, vacuum(table.clone()), cutoff).await?
        {
            return Ok((table, deleted));
        }
    }
    let (table, metrics) = vacuum(table).await?;
    Ok((table, metrics.files_deleted.len()))
}

/// The VACUUM `planned` would do to `table`, but keeping the deletion vector files a remove
/// committed at or after `cutoff` (milliseconds) carried: `None` when it deletes none of
/// them (the ordinary VACUUM is right), else the files deleted.
async fn vacuum_keeping_vectors(
    table: &DeltaTable,
    planned: VacuumBuilder,
    cutoff: i64,
) -> Result<Option<usize>> {
    let (_, planned) = planned.with_dry_run(true).await?;
    let vectors: Vec<&String> = planned
        .files_deleted
        .iter()
        .filter(|path| path.ends_with(".bin"))
        .collect();
    if vectors.is_empty() {
        return Ok(None);
    }
    let still_read = vectors_removed_since(table, cutoff).await?;
    if !vectors.iter().any(|path| still_read.contains(*path)) {
        return Ok(None);
    }
    let store = table.log_store().object_store(None);
    let mut deleted = 0;
    for path in planned
        .files_deleted
        .iter()
        .filter(|path| !still_read.contains(*path))
    {
        match store.delete(&Path::from(path.as_str())).await {
            Ok(()) => deleted += 1,
            Err(object_store::Error::NotFound { .. }) => {}
            Err(error) => return Err(WriterError::Internal(format!("VACUUM: {error}"))),
        }
    }
    Ok(Some(deleted))
}

/// The deletion vector files (paths from the table's root) that remove actions committed
/// at or after `since` (milliseconds) carried: versions younger than that read them. The
/// commits are read newest first, back to the first one older than `since`.
async fn vectors_removed_since(table: &DeltaTable, since: i64) -> Result<HashSet<String>> {
    let root = table.table_url().as_str().trim_end_matches('/').to_string() + "/";
    let store = table.log_store();
    let mut kept = HashSet::new();
    let mut version = table.version().unwrap_or(0);
    loop {
        let Some(bytes) = store.read_commit_entry(version).await? else {
            break;
        };
        let mut older = false;
        for line in bytes.split(|byte| *byte == b'\n') {
            let Ok(action) = serde_json::from_slice::<serde_json::Value>(line) else {
                continue;
            };
            if let Some(timestamp) = action["commitInfo"]["timestamp"].as_i64() {
                older = timestamp < since;
            }
            if action["remove"]["deletionVector"].is_null() {
                continue;
            }
            let remove: Remove = serde_json::from_value(action["remove"].clone())
                .map_err(|error| WriterError::Internal(format!("a remove action: {error}")))?;
            let Some(descriptor) = remove.deletion_vector else {
                continue;
            };
            let kernel = |error: delta_kernel::Error| {
                WriterError::Internal(format!("a deletion vector descriptor: {error}"))
            };
            let descriptor = KernelDescriptor::try_from(descriptor).map_err(kernel)?;
            if let Some(url) = descriptor
                .absolute_path(table.table_url())
                .map_err(kernel)?
                && let Some(relative) = url.as_str().strip_prefix(&root)
            {
                kept.insert(relative.to_string());
            }
        }
        if older || version == 0 {
            break;
        }
        version -= 1;
    }
    Ok(kept)
}
