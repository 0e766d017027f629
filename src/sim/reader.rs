//! Reading the simulated database through [`CdcSource`].
//!
//! Every call reads the newest published manifest, so commits published by a workload in
//! another process are visible on the next request. A change read streams segment batches
//! from a blocking task through a bounded channel (backpressure: the task waits while the
//! consumer is slow) and re-reads `min_lsn` before every batch, so a cleanup during the read
//! removes the rows it purged, as SQL Server's change table does; the Flight layer's guard
//! after the read turns that into `DATA_LOSS`.

use crate::keys::{KeyColumn, KeyTuple, KeysetSeek};
use std::num::NonZeroU32;
use std::ops::ControlFlow;
use std::sync::Arc;

use arrow::array::AsArray;
use arrow::array::{
    Array, ArrayRef, FixedSizeBinaryArray, MutableArrayData, StringArray,
    TimestampMicrosecondArray, make_array, new_null_array,
};
use arrow::buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use arrow::compute::{CastOptions, cast_with_options, concat_batches};
use arrow::datatypes::{DataType, Decimal128Type, SchemaRef};
use arrow::record_batch::RecordBatch;

use super::SimDb;
use super::storage::{
    CaptureInstanceState, Manifest, MappingView, SEGMENT_CDC_COLUMNS, SegmentReader, lsn_at,
    start_lsns,
};
use crate::error::{Error, Result};
use crate::lsn::{LSN_LEN, Lsn};
use crate::offset::CommitTime;
use crate::source::{
    BatchStream, CaptureInstance, CdcSource, ChangeRead, DdlEntry, InstanceRange, KeyBucket,
    KeyExtent, KeyGrid, KeySums, ReadSender, SnapshotRead, TableName, Tile, TileCutter,
    TrackedTable, blocking_read, capture_instance_not_found,
};

use crate::types::{OutputColumn, output_schema};

impl SimDb {
    /// The commit time served for the visible mapping entry at `index`: its time, or with a
    /// named zone, its local time converted back by the fall-back rule ([`super::zone`]).
    fn served_time(manifest: &Manifest, mapping: &MappingView, index: u64) -> Result<CommitTime> {
        let time = match &manifest.zone {
            Some(zone) => zone.commit_time(mapping, index)?,
            None => mapping.get(index)?.end_time,
        };
        Ok(time.to_millis_precision())
    }

    async fn simulate_latency(&self) {
        let latency = self.faults().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
    }

    fn published_instance(manifest: &Manifest, name: &str) -> Result<CaptureInstanceState> {
        manifest.capture_instance(name).cloned().ok_or_else(|| {
            capture_instance_not_found(
                name,
                manifest.capture_instances.iter().map(|ci| ci.name.as_str()),
            )
        })
    }

    /// Calls `visit` with the commit LSN of every retained change row in `[from, to]`, in order,
    /// until it breaks.
    fn scan_start_lsns(
        &self,
        name: &str,
        from: Lsn,
        to: Lsn,
        mut visit: impl FnMut(Lsn) -> ControlFlow<()>,
    ) -> Result<()> {
        let manifest = self.store.manifest()?;
        let state = Self::published_instance(&manifest, name)?;
        let from = from.max(state.min_lsn);
        for segment in state
            .segments
            .iter()
            .filter(|s| s.max_lsn >= from && s.min_lsn <= to)
        {
            let path = self.store.segment_path(name, &segment.file);
            let mut reader = match SegmentReader::open(&path) {
                Ok(reader) => reader,
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    continue;
                }
                Err(error) => return Err(error),
            };
            for index in reader.batches_overlapping(from, to) {
                let lsns = reader.read_start_lsns(index)?;
                let (low, high) = row_bounds(&lsns, from, to);
                for row in low..high {
                    if visit(lsn_at(&lsns, row)).is_break() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Rows `[low, high)` of a sorted LSN column that lie in `[from, to]`.
fn row_bounds(lsns: &FixedSizeBinaryArray, from: Lsn, to: Lsn) -> (usize, usize) {
    let partition = |predicate: &dyn Fn(Lsn) -> bool| {
        let (mut low, mut high) = (0, lsns.len());
        while low < high {
            let middle = low + (high - low) / 2;
            if predicate(lsn_at(lsns, middle)) {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        low
    };
    let low = partition(&|lsn| lsn < from);
    let high = partition(&|lsn| lsn <= to);
    (low, high.max(low))
}

/// An LSN column as `0x` + 20 upper-case hex digits per row.
fn hex_column(lsns: &FixedSizeBinaryArray) -> Result<ArrayRef> {
    let rows = lsns.len();
    // Filled by whole fixed-size rows (no zeroing first, no call per row's copy): this ran at
    // a tenth of the server's CPU while streaming.
    let mut values = Vec::with_capacity(rows * 22);
    // The rows of one commit share their start LSN: format it once.
    let mut last: Option<([u8; LSN_LEN], [u8; 22])> = None;
    let (stored, _) = lsns.value_data().as_chunks::<LSN_LEN>();
    for lsn in stored.iter().take(rows) {
        let formatted = match last {
            Some((previous, formatted)) if previous == *lsn => formatted,
            _ => {
                let mut formatted = [0u8; 22];
                Lsn::from_bytes(*lsn).write_hex(&mut formatted);
                last = Some((*lsn, formatted));
                formatted
            }
        };
        values.extend_from_slice(&formatted);
    }
    let offsets = OffsetBuffer::from_lengths(std::iter::repeat_n(22, rows));
    let array = StringArray::try_new(offsets, Buffer::from_vec(values), None)?;
    Ok(Arc::new(array))
}

fn constant_string(value: &str, rows: usize) -> Result<ArrayRef> {
    let offsets: Vec<i32> = (0..=rows).map(|row| (row * value.len()) as i32).collect();
    let values = value.as_bytes().repeat(rows);
    Ok(Arc::new(StringArray::try_new(
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Buffer::from_vec(values),
        None,
    )?))
}

/// Turns segment rows into the output schema.
struct OutputShaper {
    capture_instance: String,
    schema: SchemaRef,
    include_command_id: bool,
    /// For each output column: its index in the segment, or `None` (reads NULL).
    sources: Vec<Option<usize>>,
    /// With a named zone: the manifest and mapping the commit times are served from, per
    /// commit (the segments hold UTC).
    zoned: Option<(Arc<Manifest>, MappingView)>,
}

impl OutputShaper {
    fn new(
        state: &CaptureInstanceState,
        columns: &[OutputColumn],
        include_command_id: bool,
    ) -> Self {
        let sources = columns
            .iter()
            .map(|column| {
                state
                    .columns
                    .iter()
                    .position(|captured| captured.name == column.name)
                    .map(|position| SEGMENT_CDC_COLUMNS + position)
            })
            .collect();
        OutputShaper {
            capture_instance: state.name.clone(),
            schema: output_schema(columns, include_command_id),
            include_command_id,
            sources,
            zoned: None,
        }
    }

    /// The rows' commit times: as stored, or with a named zone, each commit's served time
    /// (a commit without a mapping row is an error, as the SQL Server source's is).
    fn commit_times(&self, rows: &RecordBatch, lsns: &FixedSizeBinaryArray) -> Result<ArrayRef> {
        let Some((manifest, mapping)) = &self.zoned else {
            return Ok(Arc::clone(rows.column(4)));
        };
        let mut times = Vec::with_capacity(lsns.len());
        let mut last: Option<(Lsn, i64)> = None;
        for row in 0..lsns.len() {
            let lsn = lsn_at(lsns, row);
            let time = match last {
                Some((previous, time)) if previous == lsn => time,
                _ => {
                    let index = mapping.index_of(lsn)?.ok_or_else(|| {
                        Error::Internal(format!(
                            "a change row of commit {lsn} has no row in cdc.lsn_time_mapping, \
                             so its commit time is unknown"
                        ))
                    })?;
                    SimDb::served_time(manifest, mapping, index)?.0
                }
            };
            last = Some((lsn, time));
            times.push(time);
        }
        Ok(Arc::new(TimestampMicrosecondArray::from(times)))
    }

    fn shape(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let count = rows.num_rows();
        let binary = |index: usize| {
            rows.column(index)
                .as_any()
                .downcast_ref::<FixedSizeBinaryArray>()
                .ok_or_else(|| Error::Internal("segment lsn column is not binary(10)".into()))
        };
        let mut arrays: Vec<ArrayRef> = vec![
            constant_string(&self.capture_instance, count)?,
            hex_column(binary(0)?)?,
            hex_column(binary(1)?)?,
            Arc::clone(rows.column(2)),
        ];
        if self.include_command_id {
            arrays.push(Arc::clone(rows.column(3)));
        }
        arrays.push(self.commit_times(rows, binary(0)?)?);
        let first_captured = arrays.len();
        for (position, source) in self.sources.iter().enumerate() {
            let field = self.schema.field(first_captured + position);
            let array = match source {
                Some(index) => {
                    let array = rows.column(*index);
                    if array.data_type() == field.data_type() {
                        Arc::clone(array)
                    } else {
                        cast_exactly(array, field.data_type()).map_err(|error| {
                            Error::SchemaChanged(format!(
                                "column '{}' of capture instance '{}' cannot be read as {}: \
                                 {error}; its type changed since the read was planned, plan \
                                 the range again",
                                field.name(),
                                self.capture_instance,
                                field.data_type()
                            ))
                        })?
                    }
                }
                None => new_null_array(field.data_type(), count),
            };
            arrays.push(array);
        }
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), arrays)?)
    }
}

/// A column written before or after an `ALTER COLUMN`, as the planned type: every value
/// kept exactly or an error, never rounded (a decimal scale reduction) or turned NULL (an
/// integer that overflows), as the SQL Server source's decoder refuses them.
fn cast_exactly(array: &ArrayRef, to: &DataType) -> std::result::Result<ArrayRef, String> {
    if let (DataType::Decimal128(_, from_scale), DataType::Decimal128(_, to_scale)) =
        (array.data_type(), to)
        && to_scale < from_scale
    {
        let factor = 10i128.pow(u32::from(from_scale.abs_diff(*to_scale)));
        let decimals = array.as_primitive::<Decimal128Type>();
        // The value is not said: it may be a masked column's.
        if decimals.iter().flatten().any(|value| value % factor != 0) {
            return Err(format!(
                "a value at scale {from_scale} would lose digits at scale {to_scale}"
            ));
        }
    }
    let options = CastOptions {
        safe: false,
        ..CastOptions::default()
    };
    // Arrow's cast errors quote the value: only the types are said.
    cast_with_options(array, to, &options)
        .map_err(|_| format!("a value of type {} does not fit {to}", array.data_type()))
}

/// `rows` cut from a batch of `whole_rows`, copied when they are a small part of it: a slice
/// keeps all of its batch alive until the client has it, so small batches (a stream's share
/// of the server's memory under load) would hold a segment batch each. SQL Server's reader
/// builds fresh batches too.
pub(super) fn own_rows(rows: &RecordBatch, whole_rows: usize) -> Result<RecordBatch> {
    if rows.num_rows() * 2 >= whole_rows {
        return Ok(rows.clone());
    }
    let columns = rows
        .columns()
        .iter()
        .map(|column| {
            let data = column.to_data();
            let mut copy = MutableArrayData::new(vec![&data], false, data.len());
            copy.try_extend(0, 0, data.len())?;
            Ok(make_array(copy.freeze()))
        })
        .collect::<Result<_>>()?;
    Ok(RecordBatch::try_new(rows.schema(), columns)?)
}

/// Rows gathered for the next output batch: slices of one or more segment batches (4,096
/// rows each, as the simulator writes them), so that a batch fills the read's bound as SQL
/// Server's reader fills it row by row.
#[derive(Default)]
struct Gathered {
    slices: Vec<RecordBatch>,
    rows: usize,
    /// Rows of the segment batch the first slice was cut from.
    first_whole_rows: usize,
}

impl Gathered {
    fn push(&mut self, slice: RecordBatch, whole_rows: usize) {
        if self.slices.is_empty() {
            self.first_whole_rows = whole_rows;
        }
        self.rows += slice.num_rows();
        self.slices.push(slice);
    }

    /// Whether rows are gathered whose schema differs from `rows`'.
    fn holds_other_schema(&self, rows: &RecordBatch) -> bool {
        self.slices
            .first()
            .is_some_and(|first| first.schema().fields() != rows.schema().fields())
    }

    /// The gathered rows as one batch that holds no more memory than its own rows.
    fn take(&mut self) -> Result<Option<RecordBatch>> {
        let slices = std::mem::take(&mut self.slices);
        self.rows = 0;
        match slices.as_slice() {
            [] => Ok(None),
            [one] => own_rows(one, self.first_whole_rows).map(Some),
            [first, ..] => Ok(Some(concat_batches(&first.schema(), &slices)?)),
        }
    }
}

#[async_trait::async_trait]
impl CdcSource for SimDb {
    fn describe(&self) -> String {
        format!("sim:{}", self.store.dir().display())
    }

    async fn tracked_tables(&self) -> Result<Vec<TrackedTable>> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let mut tables = Vec::new();
        for definition in &manifest.tables {
            let mut instances: Vec<CaptureInstance> = manifest
                .capture_instances
                .iter()
                .filter(|ci| ci.table == definition.table)
                .map(|ci| CaptureInstance {
                    name: ci.name.clone(),
                    table: ci.table.clone(),
                    // As SQL Server reports it: the change table's low endpoint, NULL
                    // until the capture job has processed the enable.
                    start_lsn: (!ci.awaiting_capture).then_some(ci.min_lsn),
                    create_date: ci.create_date,
                    columns: ci.columns.clone(),
                    index_columns: ci.index_columns.clone(),
                })
                .collect();
            if instances.is_empty() {
                continue;
            }
            instances.sort_by_key(|ci| (ci.create_date, ci.start_lsn));
            tables.push(TrackedTable {
                table: definition.table.clone(),
                capture_instances: instances,
            });
        }
        Ok(tables)
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>> {
        self.simulate_latency().await;
        Ok(self.store.manifest()?.max_lsn)
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Lsn> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let instance = Self::published_instance(&manifest, capture_instance)?;
        if instance.awaiting_capture {
            return Err(crate::source::capture_instance_not_processed(
                capture_instance,
            ));
        }
        Ok(instance.min_lsn)
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<CommitTime>> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let mapping = self.store.mapping(&manifest)?;
        match mapping.index_of(lsn)? {
            Some(index) => Ok(Some(Self::served_time(&manifest, &mapping, index)?)),
            None => Ok(None),
        }
    }

    async fn commit_at_or_before(&self, time: CommitTime) -> Result<Option<Lsn>> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let mapping = self.store.mapping(&manifest)?;
        // Times rise with LSNs in the simulator, but a clock that went back is searched the
        // way SQL Server's ORDER BY start_lsn DESC does: the newest entry in time.
        for index in (0..mapping.len()).rev() {
            if Self::served_time(&manifest, &mapping, index)? <= time {
                return Ok(Some(mapping.get(index)?.lsn));
            }
        }
        Ok(None)
    }

    async fn nth_commit_after(&self, lsn: Lsn, n: u64) -> Result<Option<Lsn>> {
        if n == 0 {
            return Err(Error::invalid("nth_commit_after needs n >= 1"));
        }
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let mapping = self.store.mapping(&manifest)?;
        let first = mapping.first_after(lsn)?;
        if first >= mapping.len() {
            return Ok(None);
        }
        let index = first.saturating_add(n - 1).min(mapping.len() - 1);
        Ok(Some(mapping.get(index)?.lsn))
    }

    async fn ddl_history(&self, range: InstanceRange<'_>) -> Result<Vec<DdlEntry>> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        Self::published_instance(&manifest, range.capture_instance)?;
        let mapping = self.store.mapping(&manifest)?;
        let mut entries = Vec::new();
        for entry in manifest.ddl_history.iter().filter(|entry| {
            entry.capture_instance == range.capture_instance
                && entry.ddl_lsn > range.from
                && entry.ddl_lsn <= range.to
        }) {
            let mut entry = entry.clone();
            // SQL Server's ddl_time is the local time of the DDL's commit.
            if manifest.zone.is_some()
                && let Some(index) = mapping.index_of(entry.ddl_lsn)?
            {
                entry.ddl_time = Self::served_time(&manifest, &mapping, index)?;
            }
            entries.push(entry);
        }
        Ok(entries)
    }

    async fn split_points(&self, range: InstanceRange<'_>, tiles: NonZeroU32) -> Result<Vec<Tile>> {
        self.simulate_latency().await;
        let db = self.clone();
        let name = range.capture_instance.to_string();
        let (from, to, n) = (range.from, range.to, tiles.get());
        tokio::task::spawn_blocking(move || {
            let mut total = 0u64;
            db.scan_start_lsns(&name, from, to, |_| {
                total += 1;
                ControlFlow::Continue(())
            })?;
            if total == 0 {
                return Ok(Vec::new());
            }
            let mut cutter = TileCutter::new(total, n);
            db.scan_start_lsns(&name, from, to, |lsn| {
                cutter.push(lsn);
                ControlFlow::Continue(())
            })?;
            Ok(cutter.finish())
        })
        .await
        .map_err(|error| Error::Internal(format!("split_points task failed: {error}")))?
    }

    /// One call, as SQL Server's one statement: the manifest tells which instances have a
    /// segment overlapping the range, and only those segments' LSN columns are read.
    async fn instances_with_changes(
        &self,
        instances: &[String],
        after: Lsn,
        to: Lsn,
    ) -> Result<Vec<String>> {
        self.simulate_latency().await;
        if to <= after {
            return Ok(Vec::new());
        }
        let db = self.clone();
        let instances = instances.to_vec();
        let from = after.increment();
        tokio::task::spawn_blocking(move || {
            let manifest = db.store.manifest()?;
            let mut changed = Vec::new();
            for name in instances {
                let state = Self::published_instance(&manifest, &name)?;
                let from = from.max(state.min_lsn);
                if !state
                    .segments
                    .iter()
                    .any(|segment| segment.max_lsn >= from && segment.min_lsn <= to)
                {
                    continue;
                }
                let mut found = false;
                // EXISTS: the first row answers.
                db.scan_start_lsns(&name, from, to, |_| {
                    found = true;
                    ControlFlow::Break(())
                })?;
                if found {
                    changed.push(name);
                }
            }
            Ok(changed)
        })
        .await
        .map_err(|error| Error::Internal(format!("instances_with_changes task failed: {error}")))?
    }

    async fn read_changes(&self, read: ChangeRead) -> Result<BatchStream> {
        self.simulate_latency().await;
        let manifest = self.store.manifest()?;
        let state = Self::published_instance(&manifest, &read.capture_instance)?;
        if read.from > read.to {
            return Err(Error::invalid(format!(
                "read from {} is past its end {}",
                read.from, read.to
            )));
        }
        let mut shaper = OutputShaper::new(&state, &read.columns, read.include_command_id);
        if manifest.zone.is_some() {
            shaper.zoned = Some((Arc::clone(&manifest), self.store.mapping(&manifest)?));
        }
        let db = self.clone();
        Ok(blocking_read(move |sender| {
            db.produce_changes(&state, &read, &shaper, sender)
        }))
    }

    async fn key_extent(&self, table: &TableName) -> Result<KeyExtent> {
        self.simulate_latency().await;
        self.extent(table)
    }

    async fn table_rows(&self, table: &TableName) -> Result<u64> {
        self.simulate_latency().await;
        self.row_count(table)
    }

    async fn key_buckets(&self, table: &TableName, grid: KeyGrid) -> Result<Vec<KeyBucket>> {
        self.simulate_latency().await;
        self.buckets(table, grid)
    }

    async fn key_span(&self, table: &TableName, key: &KeyColumn) -> Result<Option<(i64, i64)>> {
        self.simulate_latency().await;
        Ok(super::snapshot::span(&self.grid_values(table, key)?))
    }

    async fn key_sums(
        &self,
        table: &TableName,
        key: &KeyColumn,
        grid: KeyGrid,
        values: &[OutputColumn],
    ) -> Result<KeySums> {
        self.simulate_latency().await;
        let faults = self.faults();
        if faults.fail_value_sums && !values.is_empty() {
            return Err(Error::Internal(format!(
                "injected: the value digests of {table} failed"
            )));
        }
        let mut sums = match self.grid_rows(table, key, values)? {
            (keys, None) => KeySums::count(&grid, keys),
            (keys, Some(digests)) => KeySums::count_rows(&grid, keys.into_iter().zip(digests)),
        };
        if faults.perturb_value_sums {
            let sums_of_slices = sums.slices.iter_mut().map(|slice| &mut slice.value_sum);
            for sum in sums_of_slices.chain([&mut sums.null_value_sum]).flatten() {
                *sum += 1;
            }
        }
        Ok(sums)
    }

    async fn key_max(&self, table: &TableName, keys: &[KeyColumn]) -> Result<Option<KeyTuple>> {
        self.simulate_latency().await;
        self.keyset_max(table, keys)
    }

    async fn key_bound(&self, table: &TableName, seek: &KeysetSeek) -> Result<Option<KeyTuple>> {
        self.simulate_latency().await;
        self.keyset_bound(table, seek.columns(), seek.seek())
    }

    async fn read_snapshot(&self, read: SnapshotRead) -> Result<BatchStream> {
        self.simulate_latency().await;
        let db = self.clone();
        Ok(blocking_read(move |sender| db.snapshot_rows(&read, sender)))
    }
}

impl SimDb {
    /// Sends the rows of `read` to `sender`; returns early when the receiver is gone.
    fn produce_changes(
        &self,
        state: &CaptureInstanceState,
        read: &ChangeRead,
        shaper: &OutputShaper,
        sender: &ReadSender,
    ) -> Result<()> {
        let (mut rows_read, mut gathered) = (0u64, Gathered::default());
        let segments = state
            .segments
            .iter()
            .filter(|segment| segment.max_lsn >= read.from && segment.min_lsn <= read.to);
        for segment in segments {
            let path = self.store.segment_path(&state.name, &segment.file);
            let mut reader = match SegmentReader::open(&path) {
                Ok(reader) => reader,
                // Removed by a cleanup since the read began: its rows are purged, which the
                // min_lsn filter below and the guard after the read account for.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    continue;
                }
                Err(error) => return Err(error),
            };
            for index in reader.batches_overlapping(read.from, read.to) {
                let latency = self.faults().latency;
                if !latency.is_zero() {
                    std::thread::sleep(latency);
                }
                let batch = reader.read(index)?;
                let min_lsn =
                    Self::published_instance(self.store.manifest()?.as_ref(), &state.name)?.min_lsn;
                let lsns = start_lsns(&batch)?;
                let (low, high) = row_bounds(lsns, read.from.max(min_lsn), read.to);
                if low >= high {
                    continue;
                }
                let rows = batch.slice(low, high - low);
                // Output row width: the captured values plus two 22-byte LSN strings and the
                // other metadata columns.
                let row_width = crate::types::batch_slice_size(&rows) / rows.num_rows() + 64;
                // Segments written before and after an ALTER COLUMN differ in a column's
                // type: their rows are shaped apart.
                if gathered.holds_other_schema(&rows)
                    && !self.send_gathered(&mut gathered, shaper, sender, &mut rows_read)?
                {
                    return Ok(());
                }
                let mut offset = 0;
                while offset < rows.num_rows() {
                    let bound = read
                        .batch_rows
                        .min(read.batch_bytes.now() / row_width)
                        .max(1);
                    let length = bound
                        .saturating_sub(gathered.rows)
                        .clamp(1, rows.num_rows() - offset);
                    gathered.push(rows.slice(offset, length), batch.num_rows());
                    offset += length;
                    if gathered.rows >= bound
                        && !self.send_gathered(&mut gathered, shaper, sender, &mut rows_read)?
                    {
                        return Ok(());
                    }
                }
            }
        }
        self.send_gathered(&mut gathered, shaper, sender, &mut rows_read)?;
        Ok(())
    }

    /// Sends the gathered rows as one batch, then plays the faults injected after
    /// `rows_read` rows; `Ok(false)` when the reader has gone.
    fn send_gathered(
        &self,
        gathered: &mut Gathered,
        shaper: &OutputShaper,
        sender: &ReadSender,
        rows_read: &mut u64,
    ) -> Result<bool> {
        let Some(rows) = gathered.take()? else {
            return Ok(true);
        };
        *rows_read += rows.num_rows() as u64;
        if !sender.blocking_send(shaper.shape(&rows)?) {
            return Ok(false);
        }
        if self.take_dropped_connection(*rows_read) {
            return Err(Error::SourceUnavailable(
                "the connection to the source was dropped during the read (injected fault)".into(),
            ));
        }
        if let Some(cleanup) = self.take_cleanup_during_read(*rows_read) {
            self.cleanup(cleanup.capture_instance.as_deref(), cleanup.low_water_mark)?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_lsn_column_is_served_as_hex_row_by_row_also_when_sliced() {
        let lsns: Vec<Lsn> = [1u64, 1, 2, 0xAB_CDEF, 0xAB_CDEF]
            .into_iter()
            .map(|value| {
                let mut bytes = [0u8; LSN_LEN];
                bytes[2..].copy_from_slice(&value.to_be_bytes());
                Lsn::from_bytes(bytes)
            })
            .collect();
        let column =
            FixedSizeBinaryArray::try_from_iter(lsns.iter().map(Lsn::as_bytes)).expect("column");
        for (offset, length) in [(0, 5), (1, 3), (4, 1), (2, 0)] {
            let hex = hex_column(&column.slice(offset, length)).expect("hex");
            let expected: Vec<String> = lsns[offset..offset + length]
                .iter()
                .map(Lsn::to_hex)
                .collect();
            assert_eq!(
                hex.as_string::<i32>().iter().flatten().collect::<Vec<_>>(),
                expected
            );
        }
        assert_eq!(lsns[3].to_hex(), "0x00000000000000ABCDEF");
    }
}
