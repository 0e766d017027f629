//! The lake's table kinds, created typed and commented, stamped with their schema version.
//!
//! Each kind keeps the seed library's contract (notes/seed-inventory.md 3.8): the columns, a
//! comment on the table and on every column we define, and the table property
//! `mssql_cdc.schema_version` = the number of migrations of its kind, so Spark users of the
//! seed library and users of this writer read each other's tables. Migrations are ordered and
//! append-only: a migration adds nullable columns; a table at an older version gets the
//! missing ones in order, a table at a newer version is written with a warning.

use std::collections::HashMap;

use arrow::record_batch::RecordBatch;
use deltalake::kernel::transaction::{CommitConflictError, CommitProperties, TransactionError};
use deltalake::kernel::{DataType, MetadataValue, StructField, Transaction};
use deltalake::parquet::basic::Compression;
use deltalake::parquet::file::properties::{WriterProperties, WriterPropertiesBuilder};
use deltalake::protocol::SaveMode;
use deltalake::{DeltaTable, DeltaTableError};
use futures::StreamExt;
use url::Url;

use crate::error::{Result, WriterError};

/// Table property holding the number of migrations a table has had.
pub const SCHEMA_VERSION_KEY: &str = "mssql_cdc.schema_version";

/// A column this writer defines.
#[derive(Clone, Debug)]
pub struct ColumnSpec {
    /// Column name.
    pub name: &'static str,
    /// Delta type.
    pub data_type: DataType,
    /// Column comment (shown by `DESCRIBE TABLE`).
    pub comment: &'static str,
    /// The migration (1-based) that added it; columns of migration 0 are there at creation.
    pub since: u32,
}

/// The kinds of table the writer owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableKind {
    /// The append-only change log.
    Bronze,
    /// One row per micro-batch and per event.
    Facts,
    /// One row per table: the completeness verdict.
    Control,
    /// `<target>_snapshot_plans`: the key values of chunked snapshots (open, plan, chunks).
    Plans,
    /// The current state of a source table, kept by `apply_changes`.
    Silver,
    /// Every version of every row of a source table (SCD type 2), kept by `apply_history`.
    History,
    /// The reconcile report: the bucket, key and chunk rows of every run.
    Reconcile,
}

fn column(
    name: &'static str,
    data_type: DataType,
    comment: &'static str,
    since: u32,
) -> ColumnSpec {
    ColumnSpec {
        name,
        data_type,
        comment,
        since,
    }
}

impl TableKind {
    /// Every kind.
    pub const ALL: [TableKind; 7] = [
        TableKind::Bronze,
        TableKind::Facts,
        TableKind::Control,
        TableKind::Plans,
        TableKind::Silver,
        TableKind::History,
        TableKind::Reconcile,
    ];

    /// The kind named `name` ([`TableKind::name`]).
    pub fn named(name: &str) -> Option<TableKind> {
        Self::ALL.into_iter().find(|kind| kind.name() == name)
    }

    /// The kind's name in reports and logs.
    pub fn name(self) -> &'static str {
        match self {
            TableKind::Bronze => "bronze",
            TableKind::Facts => "facts",
            TableKind::Control => "control",
            TableKind::Plans => "plans",
            TableKind::Silver => "silver",
            TableKind::History => "history",
            TableKind::Reconcile => "reconcile",
        }
    }

    /// The table comment.
    pub fn comment(self) -> &'static str {
        match self {
            TableKind::Bronze => {
                "mssql_cdc bronze: append-only change log of a SQL Server table (CDC), one row per change"
            }
            TableKind::Facts => {
                "mssql_cdc facts: one row per micro-batch written to bronze and per event (snapshots, schema changes, capture instance switches, skipped changes)"
            }
            TableKind::Control => {
                "mssql_cdc control: one row per table; finalized_until is the completeness verdict"
            }
            TableKind::Plans => {
                "mssql_cdc snapshot plans: the key values of the chunked snapshots of the bronze table beside it (open, plan, chunks), one row per snapshot_open, snapshot_plan and snapshot_chunk facts row"
            }
            TableKind::Silver => {
                "mssql_cdc silver: current state of a SQL Server table, kept by apply_changes from its bronze change log; deleted rows are removed"
            }
            TableKind::History => {
                "mssql_cdc history: every version of every row of a SQL Server table (SCD type 2), kept by apply_history from its bronze change log; one row per version, __is_current on the live one"
            }
            TableKind::Reconcile => {
                "mssql_cdc reconcile report: per run, one row per key bucket compared (MATCH, IN_FLIGHT, MISMATCH), one per key found different row by row and one per failed chunk check"
            }
        }
    }

    /// The schema version this build writes (the seed library's numbering).
    pub fn schema_version(self) -> u32 {
        match self {
            TableKind::Bronze => 2,
            // 13: the seed's "key values in the plans table" (its 0.7.0 layout of them).
            TableKind::Facts => 13,
            TableKind::Control => 6,
            TableKind::Plans => 1,
            TableKind::Silver => 1,
            TableKind::History => 1,
            TableKind::Reconcile => 1,
        }
    }

    /// Columns this writer defines for the kind (bronze: only its metadata columns; the
    /// captured columns come from the source).
    pub fn columns(self) -> Vec<ColumnSpec> {
        use DataType as T;
        match self {
            TableKind::Bronze => vec![
                column(
                    "_capture_instance",
                    T::STRING,
                    "CDC capture instance the change was read from (the newer one after a switch); snapshot rows: the instance the snapshot was taken for",
                    1,
                ),
                column(
                    "_start_lsn",
                    T::STRING,
                    "commit LSN of the change as 0x + 20 hex digits (string order = commit order); snapshot rows: the LSN recorded before the read",
                    1,
                ),
                column(
                    "_seqval",
                    T::STRING,
                    "LSN of the operation inside its transaction (tie-breaker); NULL on snapshot rows",
                    1,
                ),
                column(
                    "_operation",
                    T::INTEGER,
                    "1 delete, 2 insert, 3 update before image, 4 update after image, 0 snapshot row",
                    1,
                ),
                column(
                    "_command_id",
                    T::INTEGER,
                    "statement order inside the transaction; NULL on snapshot rows",
                    1,
                ),
                column(
                    "_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time of the change in UTC",
                    1,
                ),
                column(
                    "_batch_id",
                    T::INTEGER,
                    "micro-batch that wrote the row (key of its facts row with app_id); NULL on snapshot rows",
                    1,
                ),
                column(
                    "_snapshot",
                    T::STRING,
                    "on snapshot rows the snapshot's LSN S; NULL on change rows",
                    2,
                ),
                column(
                    "_chunk",
                    T::INTEGER,
                    "chunk index of a chunked snapshot row; NULL otherwise",
                    2,
                ),
            ],
            TableKind::Facts => vec![
                column(
                    "app_id",
                    T::STRING,
                    "identity of the writer (its Delta txnAppId)",
                    0,
                ),
                column(
                    "batch_id",
                    T::LONG,
                    "micro-batch id; NULL on snapshot events",
                    0,
                ),
                column(
                    "rows",
                    T::LONG,
                    "change rows written; 0 for an empty batch and for events",
                    0,
                ),
                column(
                    "min_lsn",
                    T::STRING,
                    "smallest _start_lsn of the batch; events: the event LSN",
                    0,
                ),
                column(
                    "max_lsn",
                    T::STRING,
                    "largest _start_lsn of the batch; events: the event LSN",
                    0,
                ),
                column(
                    "min_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "earliest commit time of the batch (UTC)",
                    0,
                ),
                column(
                    "max_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "latest commit time of the batch (UTC)",
                    0,
                ),
                column("deletes", T::LONG, "rows with operation 1", 0),
                column("inserts", T::LONG, "rows with operation 2", 0),
                column(
                    "updates",
                    T::LONG,
                    "rows with operation 4 (update after images)",
                    0,
                ),
                column(
                    "started_at",
                    T::TIMESTAMP_NTZ,
                    "when the writer started the batch (UTC)",
                    0,
                ),
                column(
                    "duration_ms",
                    T::LONG,
                    "from started_at to the end of the bronze write",
                    0,
                ),
                column(
                    "source_rtt_ms",
                    T::DOUBLE,
                    "round trip of one call to the server before the read",
                    1,
                ),
                column(
                    "read_seconds",
                    T::DOUBLE,
                    "sum of the server's read seconds over the batch's streams",
                    1,
                ),
                column("read_mb", T::DOUBLE, "Arrow megabytes read (1e6 bytes)", 1),
                column(
                    "network_wait_ms",
                    T::LONG,
                    "SQL Server ASYNC_NETWORK_IO wait; NULL when the source does not report it",
                    1,
                ),
                column(
                    "retention_watermark_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time of the capture instance's min_lsn after the read",
                    2,
                ),
                column(
                    "retention_headroom_hours",
                    T::DOUBLE,
                    "hours between the retention watermark and the batch end: how far the stream is from losing changes",
                    2,
                ),
                column(
                    "event",
                    T::STRING,
                    "NULL for a micro-batch; else bootstrap, resnapshot, snapshot_open, snapshot_plan, snapshot_chunk, schema_change, capture_instance_switched, data_skipped",
                    3,
                ),
                column(
                    "lost_from_ts",
                    T::TIMESTAMP_NTZ,
                    "data_skipped/resnapshot: commit time where lost changes begin",
                    3,
                ),
                column(
                    "lost_to_ts",
                    T::TIMESTAMP_NTZ,
                    "data_skipped/resnapshot: commit time of min_lsn when the loss was found",
                    3,
                ),
                column(
                    "source_max_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time of the source's max_lsn after the read",
                    4,
                ),
                column(
                    "capture_lag_seconds",
                    T::DOUBLE,
                    "writer clock minus source_max_commit_ts: how far CDC capture is behind",
                    4,
                ),
                column(
                    "ingestion_lag_seconds",
                    T::DOUBLE,
                    "source_max_commit_ts minus end_commit_ts: how far the stream is behind CDC",
                    4,
                ),
                column(
                    "end_lsn",
                    T::STRING,
                    "end offset of the batch (last commit LSN read); events: the event LSN",
                    5,
                ),
                column(
                    "end_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time of end_lsn",
                    5,
                ),
                column(
                    "detail",
                    T::STRING,
                    "schema_change: DDL text; capture_instance_switched: old -> new; JSON payloads for snapshot and data_skipped events, a chunked snapshot's key values in the plans table beside bronze (<bronze>_snapshot_plans, each row's detail whole); micro-batch: {\"warnings\": [...]} when there are warnings",
                    6,
                ),
                column("target", T::STRING, "the bronze table written", 0),
                column(
                    "written_at",
                    T::TIMESTAMP_NTZ,
                    "when the facts row was written (after the bronze commit)",
                    0,
                ),
            ],
            TableKind::Control => vec![
                column(
                    "table_name",
                    T::STRING,
                    "the table the row is about (as passed to advance)",
                    0,
                ),
                column(
                    "finalized_until",
                    T::TIMESTAMP_NTZ,
                    "completeness verdict: every change committed at or before this UTC time is in the table; only moves forward",
                    0,
                ),
                column(
                    "end_lsn",
                    T::STRING,
                    "end LSN of the batch that last moved the verdict",
                    0,
                ),
                column(
                    "end_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time of end_lsn (the verdict is its truncation)",
                    0,
                ),
                column(
                    "updated_at",
                    T::TIMESTAMP_NTZ,
                    "when the verdict last moved",
                    0,
                ),
                column(
                    "applied_lsn",
                    T::STRING,
                    "silver: highest _start_lsn applied",
                    1,
                ),
                column(
                    "snapshot_lsn",
                    T::STRING,
                    "silver: snapshot it was last rebuilt from",
                    1,
                ),
                column(
                    "open_snapshot_lsn",
                    T::STRING,
                    "silver: chunked snapshot being applied wave by wave",
                    2,
                ),
                column(
                    "snapshot_wave",
                    T::INTEGER,
                    "silver: last wave of it applied",
                    2,
                ),
                column(
                    "verified_lsn",
                    T::STRING,
                    "silver: the LSN of the last reconcile that found no difference (both sides compared at it)",
                    5,
                ),
                column(
                    "verified_at",
                    T::TIMESTAMP_NTZ,
                    "silver: when that reconcile ran (UTC)",
                    5,
                ),
                column(
                    "values_verified_lsn",
                    T::STRING,
                    "silver: the LSN of the last reconcile that compared every value of every row and found no difference",
                    6,
                ),
                column(
                    "values_verified_at",
                    T::TIMESTAMP_NTZ,
                    "silver: when that reconcile ran (UTC)",
                    6,
                ),
            ],
            TableKind::Silver => vec![
                column(
                    "_start_lsn",
                    T::STRING,
                    "commit LSN of the row's current image (a snapshot row: its stamp)",
                    0,
                ),
                column(
                    "_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time (UTC) of the row's current image",
                    0,
                ),
            ],
            TableKind::History => vec![
                column(
                    "_start_lsn",
                    T::STRING,
                    "commit LSN of the image the version's values come from (a snapshot row: its stamp)",
                    0,
                ),
                column(
                    "_commit_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time (UTC) of that image",
                    0,
                ),
                column(
                    "__valid_from",
                    T::STRING,
                    "LSN the version starts at: the commit that made it, or the S of the snapshot that found it; NULL when the row existed before the first change or snapshot bronze holds",
                    0,
                ),
                column(
                    "__valid_from_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time (UTC) of __valid_from (at a snapshot's S: the time of its earliest stamp)",
                    0,
                ),
                column(
                    "__valid_to",
                    T::STRING,
                    "LSN the version ends at (exclusive): the commit that replaced or deleted it, or the S of the snapshot that found it different or gone; NULL while current",
                    0,
                ),
                column(
                    "__valid_to_ts",
                    T::TIMESTAMP_NTZ,
                    "commit time (UTC) of __valid_to",
                    0,
                ),
                column(
                    "__is_current",
                    T::BOOLEAN,
                    "true on the live version of a key (at most one per key), false on ended ones",
                    0,
                ),
                column(
                    "__ended_by",
                    T::STRING,
                    "what ended the version: update (a tracked column changed, or the key moved), delete, or resnapshot (a snapshot found the row different or gone: the change that did it is not in bronze); NULL while current",
                    0,
                ),
            ],
            TableKind::Reconcile => vec![
                column(
                    "run_id",
                    T::STRING,
                    "the run (UUID); every row of one call shares it",
                    0,
                ),
                column("run_at", T::TIMESTAMP_NTZ, "when the run started (UTC)", 0),
                column("silver", T::STRING, "the silver table compared", 0),
                column(
                    "silver_version",
                    T::LONG,
                    "the Delta version of silver read",
                    0,
                ),
                column(
                    "silver_lsn",
                    T::STRING,
                    "silver's applied_lsn, read from the control table before that version",
                    0,
                ),
                column(
                    "source_lsn",
                    T::STRING,
                    "max_lsn read before the source was counted (NULL on chunk rows)",
                    0,
                ),
                column(
                    "bucket_lo",
                    T::STRING,
                    "bucket rows: first key (JSON, inclusive); NULL: open below, NULL keys included",
                    0,
                ),
                column(
                    "bucket_hi",
                    T::STRING,
                    "bucket rows: first key after the bucket (JSON, exclusive); NULL: open above",
                    0,
                ),
                column(
                    "source_rows",
                    T::LONG,
                    "bucket rows: rows in the source table",
                    0,
                ),
                column(
                    "source_key_sum",
                    T::decimal(38, 0).expect("decimal(38,0) is valid"),
                    "bucket rows: sum of the source's keys (a date as its day number from 1970-01-01)",
                    0,
                ),
                column("silver_rows", T::LONG, "bucket rows: rows in silver", 0),
                column(
                    "silver_key_sum",
                    T::decimal(38, 0).expect("decimal(38,0) is valid"),
                    "bucket rows: sum of silver's keys",
                    0,
                ),
                column(
                    "status",
                    T::STRING,
                    "bucket rows: MATCH, IN_FLIGHT (differs, and the source's change table or bronze holds a change of a key in it newer than the LSN compared at) or MISMATCH",
                    0,
                ),
                column(
                    "hashed",
                    T::BOOLEAN,
                    "bucket rows: whether the bucket was compared row by row (tier 2)",
                    0,
                ),
                column(
                    "key",
                    T::STRING,
                    "key rows: the key as a JSON object (a NULL key column as null)",
                    0,
                ),
                column(
                    "failure_type",
                    T::STRING,
                    "key rows: MISSING_TARGET (in the source, not in silver), MISSING_SOURCE (in silver only), RECORD_DIFF (captured columns differ) or IN_FLIGHT (differs, with a newer change of the key in bronze or the change table)",
                    0,
                ),
                column(
                    "detail",
                    T::STRING,
                    "key rows: JSON {silver_start_lsn, columns: the captured columns that differ}",
                    0,
                ),
                column(
                    "source_key_hash_sum",
                    T::decimal(38, 0).expect("decimal(38,0) is valid"),
                    "bucket rows: sum of the hashes of the source's keys (NULL: a keyset key, or a server that does not hash them)",
                    1,
                ),
                column(
                    "silver_key_hash_sum",
                    T::decimal(38, 0).expect("decimal(38,0) is valid"),
                    "bucket rows: sum of the hashes of silver's keys (NULL when the source's are)",
                    1,
                ),
            ],
            TableKind::Plans => vec![
                column(
                    "snapshot",
                    T::STRING,
                    "S of the chunked snapshot the row belongs to (0x + 20 hex digits)",
                    0,
                ),
                column(
                    "event",
                    T::STRING,
                    "snapshot_open, snapshot_plan or snapshot_chunk: the facts row this row completes",
                    0,
                ),
                column(
                    "detail",
                    T::STRING,
                    "JSON payload whole: open {key, sql_type, min, max, rows}; plan {chunk_rows, chunk_count, chunks: [{chunk, lo, hi, rows}]}; chunk {chunk, wave, lo, hi, rows, stamp, last}",
                    0,
                ),
                column(
                    "written_at",
                    T::TIMESTAMP_NTZ,
                    "when the row was written (UTC)",
                    0,
                ),
            ],
        }
    }

    /// Delta fields of the kind's columns, all nullable, each with its comment.
    pub fn fields(self) -> Vec<StructField> {
        self.columns()
            .into_iter()
            .map(|spec| field_with_comment(spec.name, spec.data_type, spec.comment))
            .collect()
    }
}

/// A nullable field with a `comment` (stored unquoted, unlike `CreateBuilder::with_column`).
pub fn field_with_comment(name: &str, data_type: DataType, comment: &str) -> StructField {
    StructField::new(name, data_type, true).with_metadata([(
        "comment".to_string(),
        MetadataValue::String(comment.to_string()),
    )])
}

/// The URL of a table location: a local path (made absolute, created) or an object-store URL
/// whose store this build includes (`s3://`, `az://`, `gs://` are cargo features).
pub fn table_url(location: &str) -> Result<Url> {
    if let Some((scheme, _)) = location.split_once("://")
        && let Err(feature) = store_feature(scheme)
    {
        return Err(WriterError::invalid(format!(
            "'{location}': this build has no {scheme} object store; build the writer with \
             `--features {feature}`"
        )));
    }
    deltalake::ensure_table_uri(location).map_err(|error| {
        WriterError::invalid(format!("'{location}' is not a table location: {error}"))
    })
}

/// Whether this build can open a URL of `scheme`, or the cargo feature that adds its store.
fn store_feature(scheme: &str) -> std::result::Result<(), &'static str> {
    match scheme {
        "s3" | "s3a" if !cfg!(feature = "s3") => Err("s3"),
        "az" | "abfs" | "abfss" | "azure" | "adl" if !cfg!(feature = "azure") => Err("azure"),
        "gs" if !cfg!(feature = "gcs") => Err("gcs"),
        _ => Ok(()),
    }
}

/// Opens a table, or `None` when there is none at the location yet.
pub async fn open(url: &Url) -> Result<Option<DeltaTable>> {
    // A location without a log is no table: say so without asking delta-rs, whose kernel
    // logs a failed log-segment load at ERROR for every such probe.
    if !has_log(url).await? {
        return Ok(None);
    }
    let table = DeltaTable::try_from_url(url.clone()).await?;
    Ok(table.version().is_some().then_some(table))
}

/// Whether a Delta log is at `url`: a `_delta_log` directory on a local disk, any object
/// under `_delta_log/` on an object store (one listing call).
async fn has_log(url: &Url) -> Result<bool> {
    if let Ok(path) = url.to_file_path() {
        return Ok(path.join("_delta_log").is_dir());
    }
    let store = deltalake::DeltaTableBuilder::from_url(url.clone())?
        .build()?
        .log_store();
    let mut listing = store.object_store(None).list(Some(store.log_path()));
    Ok(listing.next().await.transpose()?.is_some())
}

/// The table's `mssql_cdc.schema_version` (0 when unset).
pub fn schema_version(table: &DeltaTable) -> Result<u32> {
    let properties = &table.snapshot()?.table_config().unknown_properties;
    Ok(properties
        .get(SCHEMA_VERSION_KEY)
        .and_then(|value| value.parse().ok())
        .unwrap_or(0))
}

/// Opens the table of `kind` at `url`, creating it with `fields` (its full schema) when
/// missing, or migrating it when it is older. A create that loses a race to another writer
/// takes the winner's table: it commits version 0 without retries, as delta-rs retries a
/// create that finds version 0 taken by committing its protocol and metadata again as
/// version 1, a metadata change that fails the winner's next commit.
pub async fn ensure(
    url: &Url,
    kind: TableKind,
    fields: Vec<StructField>,
    name: &str,
) -> Result<DeltaTable> {
    ensure_with(url, kind, fields, name, HashMap::new()).await
}

/// [`ensure`], a table it creates holding the table `properties` too (bronze's column
/// selection: in the create commit, so no reader sees the table without it).
pub async fn ensure_with(
    url: &Url,
    kind: TableKind,
    fields: Vec<StructField>,
    name: &str,
    properties: HashMap<String, String>,
) -> Result<DeltaTable> {
    if let Some(table) = open(url).await? {
        crate::features::check(&table, kind, url.as_str())?;
        return migrate(table, kind).await;
    }
    // An unloaded handle: loading a location without a log only logs a kernel error.
    let table = deltalake::DeltaTableBuilder::from_url(url.clone())?.build()?;
    let created = table
        .create()
        .with_table_name(name)
        .with_comment(kind.comment())
        .with_columns(fields)
        .with_configuration(
            properties
                .into_iter()
                .map(|(key, value)| (key, Some(value)))
                .chain([(
                    SCHEMA_VERSION_KEY.to_string(),
                    Some(kind.schema_version().to_string()),
                )]),
        )
        .with_raise_if_key_not_exists(false)
        .with_save_mode(SaveMode::ErrorIfExists)
        .with_commit_properties(CommitProperties::default().with_max_retries(0))
        .await;
    match created {
        Ok(table) => {
            tracing::info!(%url, ?kind, "table created");
            Ok(table)
        }
        // However delta-rs words it ("already exists" before the commit, no commit attempts
        // left at it), a table there now is another writer's: use theirs.
        Err(error) => match open(url).await? {
            Some(table) => {
                tracing::debug!(%url, %error, "another writer created the table first");
                crate::features::check(&table, kind, url.as_str())?;
                migrate(table, kind).await
            }
            None => Err(error.into()),
        },
    }
}

/// Adds to `table` the `fields` it lacks, nullable (rows written before read NULL): bronze
/// and silver take the columns a newer capture instance brings. `name` says which table in
/// the log line. Returns the table and the names of the columns added.
pub async fn add_missing_columns(
    table: DeltaTable,
    fields: &[StructField],
    name: &str,
) -> Result<(DeltaTable, Vec<String>)> {
    // Another writer may add the same columns at once (a stream and its replay in another
    // process after a capture-instance switch, or a backfill wave): a schema change that
    // meets another's reads the table again and adds what is still missing, if anything.
    // (The commit after it checks its fence on the table returned, the one it starts from.)
    let mut table = table;
    let mut attempt = 1;
    loop {
        let existing = table.snapshot()?.schema();
        let missing: Vec<StructField> = fields
            .iter()
            .filter(|field| existing.field(field.name()).is_none())
            .map(|field| StructField {
                nullable: true,
                ..field.clone()
            })
            .collect();
        if missing.is_empty() {
            return Ok((table, Vec::new()));
        }
        let names: Vec<String> = missing.iter().map(|f| f.name().to_string()).collect();
        match table.clone().add_columns().with_fields(missing).await {
            Ok(changed) => {
                tracing::info!(table = name, columns = ?names,
                    "new captured columns added; earlier rows read NULL");
                return Ok((changed, names));
            }
            Err(DeltaTableError::Transaction {
                source: TransactionError::CommitConflict(CommitConflictError::MetadataChanged),
            }) if attempt < SCHEMA_CHANGE_ATTEMPTS => {
                table.update_incremental(None).await?;
                attempt += 1;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// How many times a schema change meets another writer's before it gives up.
const SCHEMA_CHANGE_ATTEMPTS: u32 = 10;

/// The version of the newest application transaction of `app_id` in `table`, if any.
pub async fn transaction(table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
    Ok(table
        .snapshot()?
        .transaction_version(table.log_store().as_ref(), app_id)
        .await?)
}

/// Whether `table` holds the application transaction `(app_id, version)` (or a later one).
pub async fn holds_transaction(table: &DeltaTable, app_id: &str, version: i64) -> Result<bool> {
    let held = transaction(table, app_id).await?;
    Ok(held.is_some_and(|held| held >= version))
}

/// Appends `batch` to the table of `kind` at `url` (created when missing) in one commit with
/// the application transaction `(app_id, version)`, unless the table holds it already
/// (delta-rs does not skip a repeated one itself). Returns whether it wrote.
pub async fn append_once(
    url: &Url,
    kind: TableKind,
    name: &str,
    app_id: &str,
    version: i64,
    batch: RecordBatch,
) -> Result<bool> {
    let batches = vec![(app_id.to_string(), version, batch)];
    let written = append_once_each(&mut None, url, kind, name, batches).await?;
    Ok(written.first().copied().unwrap_or(false))
}

/// The table of `kind` at `url`: `cached` (the table as a last commit left it) brought up to
/// date with the commits since, which reads only those, or loaded (and created when
/// missing) when there is none.
pub async fn refreshed(
    cached: &mut Option<DeltaTable>,
    url: &Url,
    kind: TableKind,
    name: &str,
) -> Result<DeltaTable> {
    match cached.take() {
        Some(mut table) => {
            table.update_incremental(None).await?;
            Ok(table)
        }
        None => ensure(url, kind, kind.fields(), name).await,
    }
}

/// [`append_once`] of many batches, each with its own application transaction (distinct
/// app ids), in one commit: those the table holds already are left out. Returns, for each,
/// whether it wrote. `cached` holds the table between calls ([`refreshed`]). After the
/// append the table's small files are compacted once there are enough of them
/// ([`crate::maintenance::auto_compact`]).
pub async fn append_once_each(
    cached: &mut Option<DeltaTable>,
    url: &Url,
    kind: TableKind,
    name: &str,
    batches: Vec<(String, i64, RecordBatch)>,
) -> Result<Vec<bool>> {
    // The retried commit borrows the cache through a lock: a retry starts from what the
    // failed attempt left (nothing after a conflict, so the table is loaded again).
    let slot = tokio::sync::Mutex::new(cached.take());
    let outcome = retry_conflicts(|| async {
        let mut cached = slot.lock().await;
        let _turn = crate::owner::turn(url).await;
        let table = refreshed(&mut cached, url, kind, name).await?;
        let mut written = Vec::with_capacity(batches.len());
        let mut rows = Vec::new();
        let mut transactions = Vec::new();
        for (app_id, version, batch) in &batches {
            let held = holds_transaction(&table, app_id, *version).await?;
            written.push(!held);
            if !held {
                rows.push(batch.clone());
                transactions.push(Transaction::new(app_id, *version));
            }
        }
        if transactions.is_empty() {
            *cached = Some(table);
            return Ok(written);
        }
        let table = table
            .write(rows)
            .with_save_mode(SaveMode::Append)
            .with_commit_properties(
                CommitProperties::default().with_application_transactions(transactions),
            )
            .await?;
        *cached = Some(table);
        Ok(written)
    })
    .await;
    *cached = slot.into_inner();
    if outcome.is_ok()
        && let Some(table) = cached.take()
    {
        *cached = compacted(table, name).await;
    }
    outcome
}

/// `table` after [`crate::maintenance::auto_compact`]; `None` (load it again) when that
/// failed, which leaves the table's rows as they were: a concurrent compaction of the same
/// files (a maintenance pass, another writer) wins, and the next append or batch tries
/// again.
pub async fn compacted(table: DeltaTable, name: &str) -> Option<DeltaTable> {
    match crate::maintenance::auto_compact(table).await {
        Ok((table, folded)) => {
            if folded > 0 {
                tracing::debug!(table = name, folded, "small files compacted");
            }
            Some(table)
        }
        Err(error) => {
            tracing::info!(
                table = name,
                %error,
                "auto compaction failed; the next append or batch tries again"
            );
            None
        }
    }
}

/// The most rows a row group of a data file holds. A writer holds the row group it is
/// encoding in memory, and a reader fetches a whole row group's column chunks before it
/// decodes them: parquet-rs' default of 1 Mi rows made that about 100 MiB a writer for
/// silver's rows (docs/silver.md). 128 Ki rows is near DuckDB's row groups (122,880 rows);
/// a 100 MiB file then has about ten, and their statistics prune finer.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

/// The most bytes (encoded, as the writer estimates them) a row group holds: the bound for
/// wide rows, where [`ROW_GROUP_ROWS`] rows would be hundreds of MiB.
pub const ROW_GROUP_BYTES: usize = 64 << 20;

/// The most bytes a column chunk's dictionary holds before its writer falls back to plain
/// pages. parquet-rs' 1 MiB held all 128 Ki values of a unique key or timestamp: dictionary
/// pages plus indices, which made silver's files 14% larger than plain pages did (128 KiB:
/// under 2%, docs/silver.md). Columns of few values (a status) keep their dictionary.
pub const DICTIONARY_BYTES: usize = 128 << 10;

/// The Parquet settings of the data files the writer writes into bronze and silver: Snappy
/// (delta-rs' default), row groups bounded by [`ROW_GROUP_ROWS`] and [`ROW_GROUP_BYTES`],
/// dictionaries by [`DICTIONARY_BYTES`].
pub fn file_properties() -> WriterPropertiesBuilder {
    WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_max_row_group_bytes(Some(ROW_GROUP_BYTES))
        .set_dictionary_page_size_limit(DICTIONARY_BYTES)
}

/// Commit properties of a commit that rewrites files it read: it fails whenever the table
/// moved since the read, and [`retry_conflicts`] does the work again on the new version.
/// delta-rs's conflict check lets a rewrite commit after a concurrent OPTIMIZE (it ignores
/// removes with `dataChange = false`, and an overwrite does not check added files at all);
/// the compacted file would then still hold the rows the rewrite replaced.
pub fn rewrite_commit() -> CommitProperties {
    CommitProperties::default().with_max_retries(0)
}

/// Runs `commit` again, on a freshly loaded table, while it fails because a concurrent
/// commit conflicts with it (open-source Delta MERGEs conflict even on other rows; an
/// append conflicts with a concurrent metadata change), for about a minute.
pub async fn retry_conflicts<T, F, Fut>(mut commit: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 0u64;
    loop {
        match commit().await {
            Err(WriterError::Delta(
                DeltaTableError::Transaction { .. } | DeltaTableError::CommitValidation { .. },
            )) if attempt < 30 => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100 * attempt.min(20))).await;
            }
            outcome => return outcome,
        }
    }
}

/// `name` as an identifier of a [`query_text`] query: double-quoted, a `"` doubled.
pub fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `names` as a query's column list: each quoted ([`quote_identifier`]), joined by commas.
pub fn quote_columns(names: &[String]) -> String {
    names
        .iter()
        .map(|name| quote_identifier(name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `value` as a string literal of a [`query_text`] query: single-quoted, a `'` doubled.
pub fn quote_text(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// Runs `sql` over the table at `url` (registered as `t`) and returns every value as text
/// (`None` for NULL); no rows when there is no table.
pub async fn query_text(url: &Url, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
    match open(url).await? {
        Some(table) => query_table_text(&table, sql).await,
        None => Ok(Vec::new()),
    }
}

/// [`query_text`] over a table already opened.
pub async fn query_table_text(table: &DeltaTable, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
    let context = deltalake::datafusion::prelude::SessionContext::new();
    context.register_table("t", table.table_provider().await?)?;
    let mut rows = Vec::new();
    for batch in context.sql(sql).await?.collect().await? {
        let columns: Vec<arrow::array::StringArray> = batch
            .columns()
            .iter()
            .map(|column| {
                let text = arrow::compute::cast(column, &arrow::datatypes::DataType::Utf8)?;
                text.as_any()
                    .downcast_ref::<arrow::array::StringArray>()
                    .cloned()
                    .ok_or_else(|| WriterError::Internal("cast to text".into()))
            })
            .collect::<Result<_>>()?;
        for row in 0..batch.num_rows() {
            rows.push(
                columns
                    .iter()
                    .map(|column| {
                        arrow::array::Array::is_valid(column, row)
                            .then(|| column.value(row).to_string())
                    })
                    .collect(),
            );
        }
    }
    Ok(rows)
}

/// Adds the columns of the migrations a table has not had, in order, and stamps the version.
async fn migrate(table: DeltaTable, kind: TableKind) -> Result<DeltaTable> {
    let version = schema_version(&table)?;
    let current = kind.schema_version();
    if version > current {
        tracing::warn!(
            ?kind,
            version,
            current,
            "table was migrated by a newer release; writing it anyway"
        );
        return Ok(table);
    }
    if version == current {
        return Ok(table);
    }
    let existing: Vec<String> = table
        .snapshot()?
        .schema()
        .fields()
        .map(|field| field.name().to_string())
        .collect();
    let missing: Vec<StructField> = kind
        .columns()
        .into_iter()
        .filter(|spec| !existing.iter().any(|name| name == spec.name))
        .map(|spec| field_with_comment(spec.name, spec.data_type, spec.comment))
        .collect();
    let mut table = table;
    if !missing.is_empty() {
        table = table.add_columns().with_fields(missing).await?;
    }
    let properties = HashMap::from([(SCHEMA_VERSION_KEY.to_string(), current.to_string())]);
    table = table
        .set_tbl_properties()
        .with_properties(properties)
        .with_raise_if_not_exists(false)
        .await?;
    tracing::info!(?kind, from = version, to = current, "table migrated");
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_stamps_the_number_of_its_last_migration() {
        // A version below a column's migration leaves tables of that version without it:
        // `migrate` sees them current.
        for kind in TableKind::ALL {
            let last = kind
                .columns()
                .iter()
                .map(|spec| spec.since)
                .max()
                .unwrap_or(0);
            assert!(
                kind.schema_version() >= last,
                "{kind:?}: version {} below migration {last}",
                kind.schema_version()
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_creating_one_table_at_once_leave_its_one_create_commit() {
        for round in 0..100 {
            let dir = tempfile::tempdir().expect("temp");
            let url = Url::from_directory_path(dir.path()).expect("url");
            let start = std::sync::Arc::new(tokio::sync::Barrier::new(2));
            let creates = (0..2).map(|_| {
                let (url, start) = (url.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    ensure(&url, TableKind::Facts, TableKind::Facts.fields(), "facts").await
                })
            });
            for created in futures::future::join_all(creates).await {
                created.expect("join").expect("both writers get the table");
            }
            let table = open(&url).await.expect("open").expect("a table");
            assert_eq!(
                table.version(),
                Some(0),
                "round {round}: a metadata commit after the create fails the winner's next commit"
            );
        }
    }

    #[test]
    fn every_kind_is_found_by_its_name() {
        for kind in TableKind::ALL {
            assert_eq!(TableKind::named(kind.name()), Some(kind));
        }
        assert_eq!(TableKind::named("gold"), None);
    }

    #[test]
    fn object_store_urls_without_their_feature_name_the_feature() {
        for (location, feature, enabled) in [
            ("s3://bucket/lake/bronze", "s3", cfg!(feature = "s3")),
            (
                "az://container/lake/bronze",
                "azure",
                cfg!(feature = "azure"),
            ),
            (
                "abfss://container@account.dfs.core.windows.net/bronze",
                "azure",
                cfg!(feature = "azure"),
            ),
            ("gs://bucket/lake/bronze", "gcs", cfg!(feature = "gcs")),
        ] {
            match table_url(location) {
                Ok(url) => assert!(enabled, "{location} accepted without its store: {url}"),
                Err(error) => {
                    assert!(!enabled, "{location}: {error}");
                    assert!(
                        error.to_string().contains(&format!("--features {feature}")),
                        "{error}"
                    );
                }
            }
        }
        let local = tempfile::tempdir().expect("temp");
        let url = table_url(&local.path().join("bronze").display().to_string()).expect("local");
        assert_eq!(url.scheme(), "file");
    }
}
