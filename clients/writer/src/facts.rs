//! Facts rows: one per micro-batch, plus its event rows, written in one commit.

use std::sync::Arc;

use arrow::array::{Array, Int32Array, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType as ArrowType, Field, Schema, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use deltalake::kernel::DataType;
use serde::{Deserialize, Serialize};

use crate::error::{Result, WriterError};
use crate::tables::TableKind;

/// One facts row; `None` is NULL. Times are microseconds since the epoch, UTC.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)] // the fields are the facts columns, documented by their comments
pub struct FactsRow {
    pub app_id: Option<String>,
    pub batch_id: Option<i64>,
    pub rows: Option<i64>,
    pub min_lsn: Option<String>,
    pub max_lsn: Option<String>,
    pub min_commit_ts: Option<i64>,
    pub max_commit_ts: Option<i64>,
    pub deletes: Option<i64>,
    pub inserts: Option<i64>,
    pub updates: Option<i64>,
    pub started_at: Option<i64>,
    pub duration_ms: Option<i64>,
    pub source_rtt_ms: Option<f64>,
    pub read_seconds: Option<f64>,
    pub read_mb: Option<f64>,
    pub network_wait_ms: Option<i64>,
    pub retention_watermark_ts: Option<i64>,
    pub retention_headroom_hours: Option<f64>,
    pub event: Option<String>,
    pub lost_from_ts: Option<i64>,
    pub lost_to_ts: Option<i64>,
    pub source_max_commit_ts: Option<i64>,
    pub capture_lag_seconds: Option<f64>,
    pub ingestion_lag_seconds: Option<f64>,
    pub end_lsn: Option<String>,
    pub end_commit_ts: Option<i64>,
    pub detail: Option<String>,
    pub target: Option<String>,
    pub written_at: Option<i64>,
}

/// A facts or plans row's `detail` JSON; a missing or unreadable detail reads as empty (every
/// field absent), as rows written before a field existed do.
pub fn detail_of(text: Option<&str>) -> serde_json::Value {
    serde_json::from_str(text.unwrap_or("{}")).unwrap_or_default()
}

/// The Arrow type a Delta primitive of the writer's tables is written as.
pub fn arrow_type(data_type: &DataType) -> ArrowType {
    match data_type {
        t if *t == DataType::LONG => ArrowType::Int64,
        t if *t == DataType::INTEGER => ArrowType::Int32,
        t if *t == DataType::DOUBLE => ArrowType::Float64,
        t if *t == DataType::TIMESTAMP_NTZ => ArrowType::Timestamp(TimeUnit::Microsecond, None),
        t if *t == DataType::BOOLEAN => ArrowType::Boolean,
        DataType::Primitive(deltalake::kernel::PrimitiveType::Decimal(decimal)) => {
            ArrowType::Decimal128(decimal.precision(), decimal.scale() as i8)
        }
        _ => ArrowType::Utf8,
    }
}

/// The Arrow schema of a writer-defined table kind.
pub fn arrow_schema(kind: TableKind) -> SchemaRef {
    Arc::new(Schema::new(
        kind.columns()
            .iter()
            .map(|spec| Field::new(spec.name, arrow_type(&spec.data_type), true))
            .collect::<Vec<_>>(),
    ))
}

/// `value` rounded to `digits` decimals as Python's `round(value, digits)` rounds the seed's
/// facts metrics: the nearest decimal of the float's exact value, ties to even (Rust's
/// formatting rounds so), where `(value * 10^d).round() / 10^d` rounds ties away from zero
/// and twice (tests/seed_parity.rs compares it with Python's own).
pub fn round(value: f64, digits: usize) -> f64 {
    if !value.is_finite() {
        return value;
    }
    format!("{value:.digits$}").parse().unwrap_or(value)
}

/// Facts rows as one batch in the facts table's column order: each field fills the column
/// of its name (strict: a field without a column is an error).
pub fn to_batch(rows: &[FactsRow]) -> Result<RecordBatch> {
    let schema = arrow_schema(TableKind::Facts);
    let mut decoder = arrow::json::ReaderBuilder::new(schema.clone())
        .with_strict_mode(true)
        .build_decoder()?;
    // An event row changes no row: its counts are 0, as the seed's `event_row` and
    // `write_event` write them, where its writer left them unset.
    let rows: Vec<FactsRow> = rows
        .iter()
        .map(|row| {
            let mut row = row.clone();
            if row.event.is_some() {
                for count in [&mut row.deletes, &mut row.inserts, &mut row.updates] {
                    count.get_or_insert(0);
                }
            }
            row
        })
        .collect();
    decoder.serialize(&rows)?;
    Ok(decoder
        .flush()?
        .unwrap_or_else(|| RecordBatch::new_empty(schema)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_facts_row_fills_all_29_columns_in_order() {
        let row = FactsRow {
            app_id: Some("app".into()),
            batch_id: Some(3),
            rows: Some(10),
            ..FactsRow::default()
        };
        let batch = to_batch(&[row]).expect("batch");
        assert_eq!(batch.num_columns(), 29);
        assert_eq!(batch.schema().field(0).name(), "app_id");
        assert_eq!(batch.schema().field(28).name(), "written_at");
        assert_eq!(
            batch.column(3).null_count(),
            1,
            "min_lsn unknown stays NULL"
        );
        assert!(to_batch(&[]).expect("empty").num_rows() == 0);
    }

    #[test]
    fn an_event_row_counts_no_change_and_a_batch_row_keeps_what_it_counted() {
        use arrow::array::{Array, AsArray};
        use arrow::datatypes::Int64Type;
        let event = FactsRow {
            event: Some("snapshot_open".into()),
            ..FactsRow::default()
        };
        let batch_row = FactsRow {
            batch_id: Some(1),
            ..FactsRow::default()
        };
        let batch = to_batch(&[event, batch_row]).expect("batch");
        for name in ["deletes", "inserts", "updates"] {
            let counts = batch
                .column_by_name(name)
                .expect(name)
                .as_primitive::<Int64Type>();
            assert_eq!(counts.value(0), 0, "{name} of an event row");
            assert!(
                counts.is_null(1),
                "{name} of a batch row left unset stays NULL"
            );
        }
    }

    #[test]
    fn every_field_fills_its_own_column() {
        let text = |name: &str| Some(name.to_string());
        let row = FactsRow {
            app_id: text("app"),
            batch_id: Some(1),
            rows: Some(2),
            min_lsn: text("min"),
            max_lsn: text("max"),
            min_commit_ts: Some(3),
            max_commit_ts: Some(4),
            deletes: Some(5),
            inserts: Some(6),
            updates: Some(7),
            started_at: Some(8),
            duration_ms: Some(9),
            source_rtt_ms: Some(10.5),
            read_seconds: Some(11.5),
            read_mb: Some(12.5),
            network_wait_ms: Some(13),
            retention_watermark_ts: Some(14),
            retention_headroom_hours: Some(15.5),
            event: text("event"),
            lost_from_ts: Some(16),
            lost_to_ts: Some(17),
            source_max_commit_ts: Some(18),
            capture_lag_seconds: Some(19.5),
            ingestion_lag_seconds: Some(20.5),
            end_lsn: text("end"),
            end_commit_ts: Some(21),
            detail: text("{}"),
            target: text("target"),
            written_at: Some(22),
        };
        let batch = to_batch(&[row]).expect("batch");
        let shown = arrow::util::pretty::pretty_format_batches(std::slice::from_ref(&batch))
            .expect("format")
            .to_string();
        for column in batch.columns() {
            assert_eq!(column.null_count(), 0, "{shown}");
        }
        let value = |name: &str| {
            let column = batch.column_by_name(name).expect(name);
            arrow::util::display::array_value_to_string(column, 0).expect("value")
        };
        assert_eq!(value("end_lsn"), "end");
        assert_eq!(value("network_wait_ms"), "13");
        assert_eq!(value("read_mb"), "12.5");
        assert_eq!(value("written_at"), "1970-01-01T00:00:00.000022");
    }
}

/// The facts of a batch's rows, gathered as they stream by: count, LSN and commit-time
/// extents, operation counts. Readers in parallel each keep one and [`Totals::merge`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    rows: i64,
    deletes: i64,
    inserts: i64,
    updates: i64,
    min_lsn: Option<String>,
    max_lsn: Option<String>,
    min_commit_ts: Option<i64>,
    max_commit_ts: Option<i64>,
}

impl Totals {
    /// Counts one stream batch (`_start_lsn`, `_operation`, `_commit_ts`).
    pub fn add(&mut self, batch: &RecordBatch) -> Result<()> {
        fn column<'a, T: 'static>(batch: &'a RecordBatch, name: &str) -> Result<&'a T> {
            batch
                .column_by_name(name)
                .and_then(|column| column.as_any().downcast_ref::<T>())
                .ok_or_else(|| WriterError::Internal(format!("stream batch without {name}")))
        }
        let lsns: &StringArray = column(batch, "_start_lsn")?;
        let operations: &Int32Array = column(batch, "_operation")?;
        let times: &TimestampMicrosecondArray = column(batch, "_commit_ts")?;
        // LSN strings are fixed-width hex: string order is LSN order.
        let (mut low, mut high): (Option<&str>, Option<&str>) = (None, None);
        for lsn in lsns.iter().flatten() {
            low = Some(low.map_or(lsn, |low| low.min(lsn)));
            high = Some(high.map_or(lsn, |high| high.max(lsn)));
        }
        if let Some(low) = low
            && self.min_lsn.as_deref().is_none_or(|min| low < min)
        {
            self.min_lsn = Some(low.to_string());
        }
        if let Some(high) = high
            && self.max_lsn.as_deref().is_none_or(|max| high > max)
        {
            self.max_lsn = Some(high.to_string());
        }
        if let Some(low) = arrow::compute::min(times) {
            self.min_commit_ts = Some(self.min_commit_ts.map_or(low, |min| min.min(low)));
        }
        if let Some(high) = arrow::compute::max(times) {
            self.max_commit_ts = Some(self.max_commit_ts.map_or(high, |max| max.max(high)));
        }
        for operation in operations.values() {
            match operation {
                1 => self.deletes += 1,
                2 => self.inserts += 1,
                4 => self.updates += 1,
                _ => {}
            }
        }
        self.rows += batch.num_rows() as i64;
        Ok(())
    }

    /// Folds another endpoint's totals in.
    pub fn merge(&mut self, other: Totals) {
        self.rows += other.rows;
        self.deletes += other.deletes;
        self.inserts += other.inserts;
        self.updates += other.updates;
        self.min_lsn = [self.min_lsn.take(), other.min_lsn]
            .into_iter()
            .flatten()
            .min();
        self.max_lsn = [self.max_lsn.take(), other.max_lsn]
            .into_iter()
            .flatten()
            .max();
        self.min_commit_ts = [self.min_commit_ts, other.min_commit_ts]
            .into_iter()
            .flatten()
            .min();
        self.max_commit_ts = [self.max_commit_ts, other.max_commit_ts]
            .into_iter()
            .flatten()
            .max();
    }

    /// Rows counted.
    pub fn rows(&self) -> i64 {
        self.rows
    }

    /// A facts row carrying these totals.
    pub fn to_row(&self) -> FactsRow {
        FactsRow {
            rows: Some(self.rows),
            deletes: Some(self.deletes),
            inserts: Some(self.inserts),
            updates: Some(self.updates),
            min_lsn: self.min_lsn.clone(),
            max_lsn: self.max_lsn.clone(),
            min_commit_ts: self.min_commit_ts,
            max_commit_ts: self.max_commit_ts,
            ..FactsRow::default()
        }
    }
}
