//! Bronze rows: the stream's batches with bronze's own columns, and the check that bronze can
//! hold the types the source delivers now.
//!
//! After a capture-instance switch a captured column may arrive with another type. A type
//! that fits bronze's (the widenings Delta's type widening and the seed's `_fits` accept:
//! tinyint < smallint < int < bigint, small integers and float to double, date to
//! timestamp_ntz, integers to a decimal with enough integer digits, decimals keeping their
//! integer digits and scale) is cast to bronze's type before the append. Anything else stops
//! the stream with an error naming the column: delta-rs cannot change a column's type, so the
//! owner widens bronze (or starts a new one) before the stream goes on.
//!
//! The append streams: each reader's batches are encoded into Parquet files as they arrive
//! ([`FileWriter`], delta-rs' `DeltaWriter`), so reading and encoding overlap and a batch is
//! never held in memory whole; [`commit`] then adds every file in one Delta commit carrying
//! the application transaction. Files of a batch that never commits (a crash, an incomplete
//! stream) are orphans no snapshot references; `VACUUM` removes them.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, new_null_array};
use arrow::datatypes::{DataType as ArrowType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use deltalake::datafile::writer::{DeltaWriter, WriterConfig};
use deltalake::kernel::engine::arrow_conversion::{TryFromArrow, TryIntoArrow};
use deltalake::kernel::transaction::{
    CommitBuilder, CommitConflictError, CommitProperties, TransactionError,
};
use deltalake::kernel::{
    Action, Add, DataType, MetadataValue, PrimitiveType, StructField, StructType, Transaction,
};
use deltalake::operations::write::WriterStatsConfig;
use deltalake::protocol::{DeltaOperation, SaveMode};
use deltalake::table::config::TablePropertiesExt;
use deltalake::{DeltaTable, DeltaTableError};
use mssql_cdc_proto::selection::ColumnSelection;

use crate::error::{Result, WriterError};
use crate::tables::TableKind;

/// The bronze columns of a stream batch: `_batch_id`, `_snapshot`, `_chunk` appended.
pub fn stream_rows(batch: &RecordBatch, batch_id: i64) -> Result<RecordBatch> {
    let rows = batch.num_rows();
    let (mut fields, mut columns) = parts(batch);
    let batch_id =
        i32::try_from(batch_id).map_err(|_| WriterError::Internal("batch id past INT".into()))?;
    fields.push(Field::new("_batch_id", ArrowType::Int32, true));
    columns.push(Arc::new(Int32Array::from(vec![batch_id; rows])));
    fields.push(Field::new("_snapshot", ArrowType::Utf8, true));
    columns.push(new_null_array(&ArrowType::Utf8, rows));
    fields.push(Field::new("_chunk", ArrowType::Int32, true));
    columns.push(new_null_array(&ArrowType::Int32, rows));
    assemble(fields, columns)
}

/// A batch's fields and columns, to add, move or cast columns.
fn parts(batch: &RecordBatch) -> (Vec<Field>, Vec<ArrayRef>) {
    let fields = batch
        .schema()
        .fields()
        .iter()
        .map(|field| field.as_ref().clone())
        .collect();
    (fields, batch.columns().to_vec())
}

/// The batch of `fields` and `columns`.
fn assemble(fields: Vec<Field>, columns: Vec<ArrayRef>) -> Result<RecordBatch> {
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// The bronze columns of a snapshot batch (the stream's columns plus `_chunk`): `_batch_id`
/// NULL and `_snapshot` = S inserted before `_chunk`.
pub fn snapshot_rows(batch: &RecordBatch, snapshot: &str) -> Result<RecordBatch> {
    let rows = batch.num_rows();
    let schema = batch.schema();
    let chunk_index = schema
        .index_of("_chunk")
        .map_err(|_| WriterError::Internal("a snapshot batch without _chunk".into()))?;
    let (mut fields, mut columns) = parts(batch);
    let chunk_field = fields.remove(chunk_index);
    let chunk = columns.remove(chunk_index);
    fields.push(Field::new("_batch_id", ArrowType::Int32, true));
    columns.push(new_null_array(&ArrowType::Int32, rows));
    fields.push(Field::new("_snapshot", ArrowType::Utf8, true));
    columns.push(Arc::new(arrow::array::StringArray::from(vec![
        snapshot;
        rows
    ])));
    fields.push(chunk_field.with_nullable(true));
    columns.push(chunk);
    assemble(fields, columns)
}

/// Which rows a bronze append writes: a stream batch's or a snapshot's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BronzeRows {
    /// Change rows of the micro-batch with this id.
    Stream(i64),
    /// Rows of the snapshot with this S.
    Snapshot(String),
}

impl BronzeRows {
    /// `batch` (as the server streams it) with bronze's columns.
    pub fn convert(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        match self {
            BronzeRows::Stream(batch_id) => stream_rows(batch, *batch_id),
            BronzeRows::Snapshot(snapshot) => snapshot_rows(batch, snapshot),
        }
    }
}

/// The table properties of a new bronze whose rows are read with `selection` and served as
/// `served`: the column selection and the masks it records.
pub fn creation_properties(
    selection: &ColumnSelection,
    served: &Schema,
) -> HashMap<String, String> {
    crate::columns::creation_properties(selection)
        .into_iter()
        .chain(crate::masks::creation_properties(served))
        .collect()
}

/// Delta fields for a bronze schema, with the writer's comments on the metadata columns.
pub fn fields(schema: &Schema) -> Result<Vec<StructField>> {
    let comments: HashMap<&str, &str> = TableKind::Bronze
        .columns()
        .into_iter()
        .map(|spec| (spec.name, spec.comment))
        .collect();
    schema
        .fields()
        .iter()
        .map(|field| {
            let converted = StructField::try_from_arrow(field.as_ref())?;
            Ok(match comments.get(field.name().as_str()) {
                Some(comment) => converted.with_metadata([(
                    "comment".to_string(),
                    MetadataValue::String((*comment).to_string()),
                )]),
                None => converted,
            })
        })
        .collect()
}

/// Bronze, ready to take one batch's files: its schema holds every column the batch brings.
pub struct Appender {
    table: DeltaTable,
    schema: StructType,
    target: String,
    rows: BronzeRows,
    target_file_size: std::num::NonZeroU64,
    stats: WriterStatsConfig,
    added: Vec<String>,
    /// The column selection its rows were read with, checked against bronze's record on
    /// every table state the commit starts from ([`Appender::reading`]).
    selection: Option<ColumnSelection>,
    /// The schema its rows were served in: their masks are checked against bronze's record
    /// when prepared and on every table state the commit starts from.
    served: Arc<Schema>,
}

impl Appender {
    /// Adds to `table` the columns of `incoming` (the schema the server streams) it lacks
    /// (the schema merge after a capture-instance switch), checking now that bronze can hold
    /// the types of the columns it has.
    pub async fn prepare(
        table: DeltaTable,
        incoming: &Schema,
        target: &str,
        rows: BronzeRows,
    ) -> Result<Self> {
        crate::masks::check(&table, incoming, target)?;
        let served = Arc::new(incoming.clone());
        let incoming = rows.convert(&RecordBatch::new_empty(Arc::clone(&served)))?;
        let existing = table.snapshot()?.schema();
        conform(&existing, target, vec![incoming.clone()])?;
        let (table, added) =
            crate::tables::add_missing_columns(table, &fields(&incoming.schema())?, target).await?;
        let table = match added.is_empty() {
            true => table,
            false => crate::masks::record_added(table, &served, &added).await?,
        };
        let snapshot = table.snapshot()?;
        Ok(Appender {
            schema: snapshot.schema().as_ref().clone(),
            target_file_size: snapshot.table_config().target_file_size(),
            stats: WriterStatsConfig::from_config(snapshot.snapshot().table_configuration()),
            table,
            target: target.to_string(),
            rows,
            added,
            selection: None,
            served,
        })
    }

    /// The appender of rows read with `selection`: refused now, and at its commit, when
    /// bronze records another one (its stream changed the selection since the rows were
    /// read, so they may hold a column now left out).
    pub fn reading(mut self, selection: ColumnSelection) -> Result<Self> {
        crate::columns::check_recorded(&self.table, &selection, &self.target)?;
        self.selection = Some(selection);
        Ok(self)
    }

    /// The columns [`Appender::prepare`] added to bronze (a newer capture instance's).
    pub fn added_columns(&self) -> &[String] {
        &self.added
    }

    /// A writer of Parquet files for one reader's batches (of one endpoint or several).
    pub fn file_writer(self: &Arc<Self>) -> FileWriter {
        FileWriter {
            appender: Arc::clone(self),
            writer: None,
            schema: None,
        }
    }

    /// Adds `files` to bronze in one commit with the application transaction
    /// `(app_id, version)` and `user_metadata` (the seed's JSON for the commit).
    ///
    /// The commit reads the snapshot the appender was prepared on: delta-rs' conflict check
    /// refuses it when a commit since carried the same app id, another writer's (fenced).
    /// For a snapshot's rows, a commit of an earlier wave is this writer's own (the previous
    /// wave, committed while this one was read): the commit is made again on the table as it
    /// is now, unless bronze holds `version` already (fenced).
    pub async fn commit(
        &self,
        files: Vec<Add>,
        app_id: &str,
        version: i64,
        user_metadata: String,
    ) -> Result<()> {
        let actions: Vec<Action> = files.into_iter().map(Action::Add).collect();
        // The fence on the snapshot the commit starts from: delta-rs checks the application
        // transaction only against the commits after it, so a batch another writer landed
        // before it (while this one added columns, or loaded the table again) is seen here.
        if crate::tables::holds_transaction(&self.table, app_id, version).await? {
            return Err(self.fenced(app_id, version));
        }
        let mut latest: Option<DeltaTable> = None;
        for _ in 0..OWN_COMMITS_MET {
            let base = latest.as_ref().unwrap_or(&self.table);
            if let Some(selection) = &self.selection {
                crate::columns::check_recorded(base, selection, &self.target)?;
            }
            crate::masks::check(base, &self.served, &self.target)?;
            let properties = CommitProperties::default()
                .with_application_transaction(Transaction::new(app_id, version))
                .with_metadata([(
                    "userMetadata".to_string(),
                    serde_json::Value::String(user_metadata.clone()),
                )]);
            let _turn = crate::owner::turn(self.table.table_url()).await;
            let committed = CommitBuilder::from(properties)
                .with_actions(actions.clone())
                .build(
                    Some(base.snapshot()?),
                    base.log_store(),
                    DeltaOperation::Write {
                        mode: SaveMode::Append,
                        partition_by: None,
                        predicate: None,
                    },
                )
                .await;
            match committed {
                Ok(_) => return Ok(()),
                Err(DeltaTableError::Transaction {
                    source:
                        TransactionError::CommitConflict(CommitConflictError::ConcurrentTransaction),
                }) => {
                    let table = crate::tables::open(self.table.table_url())
                        .await?
                        .ok_or_else(|| {
                            WriterError::Internal(format!("bronze {} disappeared", self.target))
                        })?;
                    // A stream's batch ids are fenced by the checkpoint's claims, and a batch
                    // without rows commits nothing to bronze: an earlier batch id landing
                    // since is another writer's (its own checkpoint), never this one's.
                    let own_earlier_wave = matches!(self.rows, BronzeRows::Snapshot(_));
                    if !own_earlier_wave
                        || crate::tables::holds_transaction(&table, app_id, version).await?
                    {
                        return Err(self.fenced(app_id, version));
                    }
                    latest = Some(table);
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(self.fenced(app_id, version))
    }

    fn fenced(&self, app_id: &str, version: i64) -> WriterError {
        WriterError::Fenced(format!(
            "bronze {}: another writer committed a batch of app_id '{app_id}' while this one \
             wrote batch {version}: two writers of one app id are running. This one \
             stopped without committing; stop the other",
            self.table.table_url()
        ))
    }
}

/// How many of its own earlier commits (of the same app id, older versions) a bronze commit
/// meets before it gives up: a snapshot has one wave in flight beside the one committing.
const OWN_COMMITS_MET: usize = 4;

/// The userMetadata key of a stream commit holding the batch's whole facts row.
pub const FACTS_KEY: &str = "facts";
/// The userMetadata key of a stream commit holding the batch's event rows.
pub const EVENTS_KEY: &str = "events";

/// What a stream commit recorded of its batch: the facts row and event rows to write.
#[derive(Debug)]
pub struct CommittedBatch {
    /// The batch's facts row.
    pub facts: crate::facts::FactsRow,
    /// Its event rows (`capture_instance_switched`, `schema_change`, `data_skipped`).
    pub events: Vec<crate::facts::FactsRow>,
}

/// The facts of stream batch `batch_id` of `app_id` when `bronze` holds it: read from the
/// userMetadata of its commit, the newest first (a replayed batch is among the last commits).
pub async fn committed_batch(
    bronze: &DeltaTable,
    app_id: &str,
    batch_id: i64,
) -> Result<Option<CommittedBatch>> {
    use futures::StreamExt;
    if !crate::tables::holds_transaction(bronze, app_id, batch_id).await? {
        return Ok(None);
    }
    let mut history = bronze.history(None);
    while let Some(info) = history.next().await {
        let Some(text) = info?.user_metadata else {
            continue;
        };
        let Ok(metadata) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        if metadata["app_id"].as_str() != Some(app_id)
            || metadata["batch_id"].as_i64() != Some(batch_id)
        {
            continue;
        }
        fn field<T: serde::de::DeserializeOwned>(
            metadata: &serde_json::Value,
            key: &str,
        ) -> Result<T> {
            serde_json::from_value(metadata[key].clone()).map_err(|error| {
                WriterError::Internal(format!(
                    "bronze's commit of batch {} of '{}' has no readable '{key}' in its \
                     userMetadata: {error}",
                    metadata["batch_id"], metadata["app_id"]
                ))
            })
        }
        return Ok(Some(CommittedBatch {
            facts: field(&metadata, FACTS_KEY)?,
            events: field(&metadata, EVENTS_KEY)?,
        }));
    }
    Err(WriterError::Internal(format!(
        "bronze holds batch {batch_id} of '{app_id}' but no commit in its log names it; the \
         replay cannot write its facts without it"
    )))
}

/// Encodes one reader's stream batches into bronze Parquet files as they arrive.
pub struct FileWriter {
    appender: Arc<Appender>,
    writer: Option<DeltaWriter>,
    schema: Option<SchemaRef>,
}

impl FileWriter {
    /// Writes one stream batch (bronze's columns added, types cast to bronze's).
    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let appender = &self.appender;
        let rows = appender.rows.convert(batch)?;
        let rows = conform(&appender.schema, &appender.target, vec![rows])?
            .pop()
            .ok_or_else(|| WriterError::Internal("conform dropped the batch".into()))?;
        if self
            .schema
            .as_ref()
            .is_some_and(|schema| schema != &rows.schema())
        {
            return Err(WriterError::Internal(format!(
                "an endpoint of bronze {} changed its schema mid-stream",
                appender.target
            )));
        }
        let writer = self.writer.get_or_insert_with(|| {
            let config = WriterConfig::new(
                rows.schema(),
                Vec::new(),
                Some(crate::tables::file_properties().build()),
                Some(appender.target_file_size),
                None,
                appender.stats.num_indexed_cols,
                appender.stats.stats_columns.clone(),
            );
            DeltaWriter::new(appender.table.log_store().object_store(None), config)
        });
        self.schema.get_or_insert_with(|| rows.schema());
        writer.write(&rows).await?;
        Ok(())
    }

    /// Flushes the last file; the files written, for [`Appender::commit`].
    pub async fn close(self) -> Result<Vec<Add>> {
        match self.writer {
            Some(writer) => Ok(writer.close().await?),
            None => Ok(Vec::new()),
        }
    }

    /// Abandons the files (the stream was incomplete): nothing of them is committed.
    pub async fn abort(self) {
        if let Some(writer) = self.writer
            && let Err(error) = writer.abort().await
        {
            tracing::warn!(%error, "aborting an uncommitted bronze file failed (vacuum removes it)");
        }
    }
}

/// Casts the columns of `batches` whose type differs from bronze's but fits it to bronze's
/// type; a column whose type bronze cannot hold is an error naming it. Columns bronze lacks
/// are left as they are (the append adds them by schema merge).
pub fn conform(
    bronze: &StructType,
    target: &str,
    batches: Vec<RecordBatch>,
) -> Result<Vec<RecordBatch>> {
    let Some(first) = batches.first() else {
        return Ok(batches);
    };
    let mut casts: Vec<(usize, ArrowType)> = Vec::new();
    for (index, field) in first.schema().fields().iter().enumerate() {
        let Some(existing) = bronze.field(field.name()) else {
            continue;
        };
        let incoming = DataType::try_from_arrow(field.data_type())?;
        if &incoming == existing.data_type() {
            continue;
        }
        if !fits(&incoming, existing.data_type()) {
            return Err(WriterError::SchemaChanged(format!(
                "bronze {target} holds column '{}' as {}, and the source now delivers {}, which \
                 it cannot hold. delta-rs cannot change a column's type, and a table with \
                 Delta's type widening enabled is one this writer refuses to write: stream into \
                 a new bronze target (a new app_id and checkpoint, bootstrapped by a snapshot), \
                 then point silver at it",
                field.name(),
                existing.data_type(),
                incoming,
            )));
        }
        casts.push((index, existing.data_type().try_into_arrow()?));
    }
    if casts.is_empty() {
        return Ok(batches);
    }
    batches
        .into_iter()
        .map(|batch| {
            let (mut fields, mut columns) = parts(&batch);
            for (index, to) in &casts {
                columns[*index] = arrow::compute::cast(&columns[*index], to)?;
                fields[*index] = fields[*index].clone().with_data_type(to.clone());
            }
            assemble(fields, columns)
        })
        .collect()
}

/// Whether values of `incoming` fit a column of type `existing` without loss (the widenings
/// of Delta's type widening, as the seed's `_fits`).
pub fn fits(incoming: &DataType, existing: &DataType) -> bool {
    use PrimitiveType as P;
    let (DataType::Primitive(from), DataType::Primitive(to)) = (incoming, existing) else {
        return incoming == existing;
    };
    let integer_rank = |t: &P| match t {
        P::Byte => Some(1),
        P::Short => Some(2),
        P::Integer => Some(3),
        P::Long => Some(4),
        _ => None,
    };
    let integer_digits = |t: &P| match t {
        P::Byte | P::Short => Some(5),
        P::Integer => Some(10),
        P::Long => Some(20),
        _ => None,
    };
    if from == to {
        return true;
    }
    match (from, to) {
        (a, b) if integer_rank(a).is_some() && integer_rank(b).is_some() => {
            integer_rank(a) <= integer_rank(b)
        }
        (P::Byte | P::Short | P::Integer | P::Float, P::Double) => true,
        (P::Date, P::TimestampNtz) => true,
        (a, P::Decimal(decimal)) if integer_digits(a).is_some() => integer_digits(a)
            .is_some_and(|digits| decimal.precision() - decimal.scale() >= digits as u8),
        (P::Decimal(a), P::Decimal(b)) => {
            b.scale() >= a.scale() && b.precision() - b.scale() >= a.precision() - a.scale()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bronze in `dir` for snapshot rows of one captured `column` (text for `email`, a
    /// bigint otherwise): its URL, location, the served schema and the table.
    async fn snapshot_bronze(
        dir: &tempfile::TempDir,
        column: &str,
    ) -> (url::Url, String, Schema, DeltaTable) {
        let location = dir.path().join("bronze").display().to_string();
        let url = crate::tables::table_url(&location).expect("url");
        let kind = match column {
            "email" => ArrowType::Utf8,
            _ => ArrowType::Int64,
        };
        let schema = Schema::new(vec![
            Field::new("_start_lsn", ArrowType::Utf8, true),
            Field::new(column, kind, true),
            Field::new("_chunk", ArrowType::Int32, true),
        ]);
        let empty = RecordBatch::new_empty(Arc::new(schema.clone()));
        let rows = BronzeRows::Snapshot("1".into());
        let fields = fields(&rows.convert(&empty).expect("rows").schema()).expect("fields");
        let table = crate::tables::ensure(&url, TableKind::Bronze, fields, "bronze")
            .await
            .expect("bronze");
        (url, location, schema, table)
    }

    /// An appender of snapshot rows of S = 1 into `table`.
    async fn wave_appender(table: &DeltaTable, schema: &Schema, location: &str) -> Appender {
        Appender::prepare(
            table.clone(),
            schema,
            location,
            BronzeRows::Snapshot("1".into()),
        )
        .await
        .expect("appender")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_read_before_the_column_selection_changed_is_not_committed_after_it() {
        let dir = tempfile::tempdir().expect("temp");
        let (url, location, schema, table) = snapshot_bronze(&dir, "email").await;
        let appender = || async {
            wave_appender(&table, &schema, &location)
                .await
                .reading(ColumnSelection::All)
                .expect("bronze records every column")
        };
        // Waves 0 and 1 read with every column; wave 0 lands, then the stream leaves `email`
        // out. Wave 1's commit meets its own wave 0 first (a rebase it makes), then the
        // change: it must not land.
        let (wave_0, wave_1) = (appender().await, appender().await);
        wave_0
            .commit(Vec::new(), "snap", 0, "{}".into())
            .await
            .expect("wave 0");
        let latest = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        latest
            .set_tbl_properties()
            .with_properties(HashMap::from([(
                crate::columns::PROPERTY.to_string(),
                r#"{"except_columns": ["email"]}"#.to_string(),
            )]))
            .with_raise_if_not_exists(false)
            .await
            .expect("the selection changed");
        let refused = wave_1.commit(Vec::new(), "snap", 1, "{}".into()).await;
        assert!(refused.is_err(), "{refused:?}");
        let latest = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        let landed = crate::tables::transaction(&latest, "snap")
            .await
            .expect("txn");
        assert_eq!(landed, Some(0), "wave 1 did not land");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_meeting_its_own_earlier_wave_lands_and_a_second_writer_is_fenced() {
        let dir = tempfile::tempdir().expect("temp");
        let (url, location, schema, table) = snapshot_bronze(&dir, "id").await;
        let appender = || wave_appender(&table, &schema, &location);
        // Wave 1 read (its appender prepared) before wave 0 committed: before the fix its
        // commit was refused as a second writer's.
        let (wave_0, wave_1, stale) = (appender().await, appender().await, appender().await);
        wave_0
            .commit(Vec::new(), "snap", 0, "{}".into())
            .await
            .expect("wave 0");
        wave_1
            .commit(Vec::new(), "snap", 1, "{}".into())
            .await
            .expect("wave 1 lands after its own wave 0");
        let fenced = stale.commit(Vec::new(), "snap", 1, "{}".into()).await;
        assert!(
            matches!(fenced, Err(WriterError::Fenced(_))),
            "a second commit of version 1 is another writer's: {fenced:?}"
        );
        let latest = crate::tables::open(&url)
            .await
            .expect("open")
            .expect("table");
        assert_eq!(
            crate::tables::transaction(&latest, "snap")
                .await
                .expect("txn"),
            Some(1)
        );
        // A stream's batches are fenced by its checkpoint: an earlier batch of its app id
        // landing since the read is another writer's, with a checkpoint of its own.
        let stream_schema = Schema::new(schema.fields()[..2].to_vec());
        let stream_appender = |batch: i64| {
            let (table, schema) = (latest.clone(), stream_schema.clone());
            let location = location.clone();
            async move {
                Appender::prepare(table, &schema, &location, BronzeRows::Stream(batch))
                    .await
                    .expect("appender")
            }
        };
        let (batch_0, batch_1) = (stream_appender(0).await, stream_appender(1).await);
        batch_0
            .commit(Vec::new(), "orders", 0, "{}".into())
            .await
            .expect("batch 0");
        let fenced = batch_1.commit(Vec::new(), "orders", 1, "{}".into()).await;
        assert!(
            matches!(fenced, Err(WriterError::Fenced(_))),
            "another writer's batch 0 landed since batch 1 was read: {fenced:?}"
        );
    }

    fn decimal(precision: u8, scale: u8) -> DataType {
        DataType::decimal(precision, scale).expect("decimal")
    }

    #[test]
    fn widenings_fit_and_narrowings_do_not() {
        assert!(fits(&DataType::INTEGER, &DataType::LONG));
        assert!(fits(&DataType::BYTE, &DataType::SHORT));
        assert!(!fits(&DataType::LONG, &DataType::INTEGER));
        assert!(fits(&DataType::INTEGER, &DataType::DOUBLE));
        assert!(!fits(&DataType::LONG, &DataType::DOUBLE));
        assert!(fits(&DataType::FLOAT, &DataType::DOUBLE));
        assert!(fits(&DataType::DATE, &DataType::TIMESTAMP_NTZ));
        assert!(!fits(&DataType::TIMESTAMP, &DataType::DATE));
        assert!(fits(&DataType::INTEGER, &decimal(12, 2)));
        assert!(!fits(&DataType::INTEGER, &decimal(11, 2)));
        assert!(fits(&decimal(10, 2), &decimal(12, 3)));
        assert!(!fits(&decimal(10, 2), &decimal(10, 3)));
        assert!(!fits(&DataType::STRING, &DataType::LONG));
        assert!(!fits(&DataType::LONG, &DataType::STRING));
    }

    #[test]
    fn conform_casts_what_fits_and_names_what_does_not() {
        let bronze = StructType::try_new([
            StructField::new("id", DataType::LONG, true),
            StructField::new("name", DataType::LONG, true),
        ])
        .expect("schema");
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", ArrowType::Int32, true),
                Field::new("extra", ArrowType::Int32, true),
            ])),
            vec![
                Arc::new(Int32Array::from(vec![1, 2])),
                Arc::new(Int32Array::from(vec![3, 4])),
            ],
        )
        .expect("batch");
        let conformed = conform(&bronze, "t", vec![batch]).expect("fits");
        assert_eq!(conformed[0].column(0).data_type(), &ArrowType::Int64);
        assert_eq!(conformed[0].column(1).data_type(), &ArrowType::Int32);

        let strings = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("name", ArrowType::Utf8, true)])),
            vec![Arc::new(arrow::array::StringArray::from(vec!["a"]))],
        )
        .expect("batch");
        let error = conform(&bronze, "/lake/b", vec![strings])
            .expect_err("a string does not fit a long")
            .to_string();
        assert!(error.contains("'name'"), "{error}");
        assert!(error.contains("a new bronze target"), "{error}");
    }
}
