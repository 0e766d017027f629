//! What one call applies: the snapshots whose reads the stream has passed, the changes up
//! to the stream's end, the position they leave, and the queries of their events.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, StringArray, new_null_array};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use deltalake::datafusion::datasource::MemTable;
use deltalake::datafusion::prelude::SessionContext;

use super::super::{quote, text};
use super::snapshots::Facts;
use crate::control::Position;
use crate::error::Result;

/// The kinds of event rows, in the order the fold takes them at one position.
pub(super) const CHANGE: i64 = 0;
pub(super) const IMAGE: i64 = 1;
pub(super) const ABSENT: i64 = 2;

/// The rows of one snapshot a call applies.
#[derive(Clone, Debug, PartialEq)]
struct Unit {
    /// S.
    lsn: String,
    /// `None`: all of a full snapshot's rows; `Some`: these chunks'.
    chunks: Option<Vec<i32>>,
    /// Whether the snapshot is complete with them: the keys it lacks end at S.
    complete: bool,
    /// Where the snapshot's reads ended (a chunked one's: its last chunk's); `None`: unknown,
    /// taken as S.
    read_end: Option<String>,
    /// Where each chunk's read ended, for the chunks applied.
    chunk_ends: Vec<(i32, String)>,
}

impl Unit {
    /// The `chunks` of chunked `snapshot`, complete with them when `complete`.
    fn chunked(snapshot: &super::snapshots::Snapshot, chunks: Vec<i32>, complete: bool) -> Self {
        Unit {
            lsn: snapshot.lsn.clone(),
            read_end: snapshot
                .chunks
                .iter()
                .map(|chunk| chunk.read_end.clone())
                .max(),
            chunk_ends: snapshot
                .chunks
                .iter()
                .filter(|chunk| chunks.contains(&chunk.chunk))
                .map(|chunk| (chunk.chunk, chunk.read_end.clone()))
                .collect(),
            chunks: Some(chunks),
            complete,
        }
    }

    /// Where the read of bronze row `b` of this unit ended, as an SQL expression; `None`
    /// when unknown (the row is taken as read at S).
    fn row_end(&self) -> Option<String> {
        if self.chunks.is_none() {
            return self.read_end.as_deref().map(text);
        }
        if self.chunk_ends.is_empty() {
            return None;
        }
        let cases = self
            .chunk_ends
            .iter()
            .map(|(chunk, end)| format!("WHEN {chunk} THEN {}", text(end)))
            .collect::<Vec<_>>()
            .join(" ");
        Some(format!("CASE b._chunk {cases} END"))
    }
}

/// The snapshot rows and changes one call applies, and the position they leave.
pub(super) struct Plan {
    snapshots: Vec<Unit>,
    /// Changes are applied up to the stream's end (the facts' newest batch end).
    pub(super) changes_to: Option<String>,
    /// The position once they are.
    pub(super) position: Position,
}

impl Plan {
    pub(super) fn of(facts: &Facts, position: &Position) -> Self {
        let end = facts.end.as_deref();
        let mut new_position = position.clone();
        let mut applied = Vec::new();
        for snapshot in facts.snapshots.iter().filter(|snapshot| {
            position
                .snapshot_lsn
                .as_ref()
                .is_none_or(|done| &snapshot.lsn > done)
        }) {
            if !snapshot.chunked {
                // A full snapshot's rows are in bronze once its completion is.
                if !snapshot.complete || !snapshot.ripe(end, std::iter::empty()) {
                    break;
                }
                applied.push(Unit {
                    lsn: snapshot.lsn.clone(),
                    chunks: None,
                    complete: true,
                    read_end: snapshot.read_end.clone(),
                    chunk_ends: Vec::new(),
                });
                new_position.snapshot_lsn = Some(snapshot.lsn.clone());
                continue;
            }
            let done_wave = match &position.open_snapshot_lsn {
                Some(open) if open == &snapshot.lsn => position.snapshot_wave.unwrap_or(0),
                _ => 0,
            };
            let mut waves: Vec<i32> = snapshot
                .chunks
                .iter()
                .map(|chunk| chunk.wave)
                .filter(|wave| *wave > done_wave)
                .collect();
            waves.dedup();
            let mut chunks = Vec::new();
            let mut last_wave = done_wave;
            for wave in &waves {
                let of_wave = || snapshot.chunks.iter().filter(|chunk| chunk.wave == *wave);
                if !snapshot.ripe(end, of_wave()) {
                    break;
                }
                chunks.extend(of_wave().map(|chunk| chunk.chunk));
                last_wave = *wave;
            }
            let whole =
                snapshot.complete && last_wave == waves.last().copied().unwrap_or(done_wave);
            if !chunks.is_empty() || whole {
                applied.push(Unit::chunked(snapshot, chunks, whole));
            }
            if whole {
                new_position.snapshot_lsn = Some(snapshot.lsn.clone());
                new_position.open_snapshot_lsn = None;
                new_position.snapshot_wave = None;
            } else {
                new_position.open_snapshot_lsn = Some(snapshot.lsn.clone());
                new_position.snapshot_wave = Some(last_wave);
                break;
            }
        }
        Plan {
            snapshots: applied,
            changes_to: end.map(str::to_string),
            position: new_position,
        }
    }

    /// A replay from nothing of what `position` says history applied: every snapshot up to
    /// its `snapshot_lsn` whole, the open one's waves up to its wave, the changes up to its
    /// `applied_lsn` ([`super::verify`]).
    pub(super) fn replaying(facts: &Facts, position: &Position) -> Self {
        let mut units = Vec::new();
        for snapshot in &facts.snapshots {
            let whole = position
                .snapshot_lsn
                .as_ref()
                .is_some_and(|done| &snapshot.lsn <= done);
            let waves = match &position.open_snapshot_lsn {
                _ if whole => i32::MAX,
                Some(open) if open == &snapshot.lsn => position.snapshot_wave.unwrap_or(0),
                _ => continue,
            };
            units.push(match snapshot.chunked {
                true => Unit::chunked(
                    snapshot,
                    snapshot
                        .chunks
                        .iter()
                        .filter(|chunk| chunk.wave <= waves)
                        .map(|chunk| chunk.chunk)
                        .collect(),
                    whole,
                ),
                false => Unit {
                    lsn: snapshot.lsn.clone(),
                    chunks: None,
                    complete: whole,
                    read_end: snapshot.read_end.clone(),
                    chunk_ends: Vec::new(),
                },
            });
        }
        Plan {
            snapshots: units,
            changes_to: position.applied_lsn.clone(),
            position: position.clone(),
        }
    }

    /// This call's events, sorted by key and order ([`super::fold`]). The keys a complete
    /// snapshot lacks are found first and registered as `markers` (their rows carry only
    /// the key).
    pub(super) async fn events(
        &self,
        context: &SessionContext,
        applied: Option<&str>,
        values: &SchemaRef,
        keys: &[String],
    ) -> Result<Vec<RecordBatch>> {
        let sql = Sql {
            keys,
            applied: text(applied.unwrap_or_default()),
        };
        let columns = |alias: &str| {
            values
                .fields()
                .iter()
                .map(|field| format!("{alias}.{}", quote(field.name())))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if let Some(end) = &self.changes_to {
            parts.push(format!(
                "SELECT {}, b._operation, b._command_id, b._seqval, b._start_lsn AS __position, \
                 {CHANGE} AS __kind FROM bronze b WHERE b._operation <> 0 AND b._start_lsn > {} \
                 AND b._start_lsn <= {}",
                columns("b"),
                sql.applied,
                text(end)
            ));
        }
        let mut earlier_images: Vec<String> = Vec::new();
        let mut markers = Vec::new();
        for unit in &self.snapshots {
            let s = &unit.lsn;
            if let Some(rows) = sql.rows_of(s, unit.chunks.as_deref()) {
                parts.push(format!(
                    "SELECT {}, b._operation, b._command_id, b._seqval, {} AS __position, \
                     {IMAGE} AS __kind FROM bronze b WHERE {rows} AND {}",
                    columns("b"),
                    text(s),
                    sql.no_change_until(s, unit.row_end(), "b")
                ));
                earlier_images.push(format!(
                    "SELECT {} FROM bronze b WHERE {rows}",
                    sql.key_list()
                ));
            }
            if unit.complete {
                for batch in context
                    .sql(&sql.lacked_keys(s, unit.read_end.as_deref(), &earlier_images))
                    .await?
                    .collect()
                    .await?
                {
                    markers.push(marker_rows(&batch, s, values, keys)?);
                }
            }
        }
        if let Some(first) = markers.first() {
            let schema = first.schema();
            if context.table_exist("markers")? {
                context.deregister_table("markers")?;
            }
            context.register_table(
                "markers",
                Arc::new(MemTable::try_new(schema, vec![markers])?),
            )?;
            parts.push("SELECT * FROM markers".into());
        }
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let sorted = format!(
            "SELECT * FROM ({}) ORDER BY {}, __position, __kind, _command_id, _seqval, _operation",
            parts.join(" UNION ALL "),
            sql.key_list()
        );
        Ok(context.sql(&sorted).await?.collect().await?)
    }
}

/// The SQL pieces of a call's events.
struct Sql<'a> {
    keys: &'a [String],
    /// The position's `applied_lsn` as an SQL literal.
    applied: String,
}

impl Sql<'_> {
    fn key_list(&self) -> String {
        self.keys
            .iter()
            .map(|key| quote(key))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn key_match(&self, a: &str, b: &str) -> String {
        self.keys
            .iter()
            .map(|key| format!("{a}.{k} IS NOT DISTINCT FROM {b}.{k}", k = quote(key)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// Bronze row `b` is a row of the snapshot at `s`.
    fn of_snapshot(&self, s: &str) -> String {
        format!(
            "b._operation = 0 AND COALESCE(b._snapshot, b._start_lsn) = {}",
            text(s)
        )
    }

    /// The condition on bronze row `b` of the snapshot at `s`'s rows to apply; `None` for no
    /// chunk.
    fn rows_of(&self, s: &str, chunks: Option<&[i32]>) -> Option<String> {
        let snapshot = self.of_snapshot(s);
        match chunks {
            None => Some(format!("{snapshot} AND b._chunk IS NULL")),
            Some([]) => None,
            Some(chunks) => Some(format!(
                "{snapshot} AND b._chunk IN ({})",
                chunks
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// Row `alias`'s key has no change between S and where the read of its row ended
    /// (`until`, an SQL expression): a row read then was the key's state at S. A key with
    /// one takes its state at S from that change's before-image instead (exact: every change
    /// up to the read's end is in bronze once the snapshot is applied); later changes'
    /// before-images agree with the row. The window is fixed once the snapshot is, so a
    /// replay from nothing decides as the calls did. `until` unknown: the row is the state.
    fn no_change_until(&self, s: &str, until: Option<String>, alias: &str) -> String {
        match until {
            None => "TRUE".into(),
            Some(until) => format!(
                "NOT EXISTS (SELECT 1 FROM bronze c WHERE c._operation <> 0 AND c._start_lsn > {} \
                 AND c._start_lsn <= {until} AND {})",
                text(s),
                self.key_match("c", alias)
            ),
        }
    }

    /// The keys the fold may hold open at S (history's current ones, those of this call's
    /// events before S) that the complete snapshot at S lacks and no change after it
    /// explains.
    fn lacked_keys(&self, s: &str, read_end: Option<&str>, earlier_images: &[String]) -> String {
        let key_list = self.key_list();
        let mut candidates = vec![
            format!("SELECT {key_list} FROM history WHERE __is_current"),
            format!(
                "SELECT {key_list} FROM bronze WHERE _operation <> 0 AND _start_lsn > {} \
                 AND _start_lsn < {}",
                self.applied,
                text(s)
            ),
        ];
        candidates.extend(earlier_images.iter().cloned());
        format!(
            "SELECT DISTINCT {key_list} FROM ({}) k WHERE NOT EXISTS (SELECT 1 FROM bronze b \
             WHERE {} AND {}) AND {}",
            candidates.join(" UNION ALL "),
            self.of_snapshot(s),
            self.key_match("b", "k"),
            self.no_change_until(s, read_end.map(text), "k"),
        )
    }
}

/// Event rows saying the snapshot at `s` lacks the keys of `keys_batch`: the key columns,
/// every other column NULL.
fn marker_rows(
    keys_batch: &RecordBatch,
    s: &str,
    values: &SchemaRef,
    keys: &[String],
) -> Result<RecordBatch> {
    let rows = keys_batch.num_rows();
    let mut fields: Vec<Field> = Vec::new();
    let mut columns: Vec<ArrayRef> = Vec::new();
    for field in values.fields() {
        let column = match keys.iter().position(|key| key == field.name()) {
            Some(index) => cast(keys_batch.column(index), field.data_type())?,
            None => new_null_array(field.data_type(), rows),
        };
        fields.push(field.as_ref().clone().with_nullable(true));
        columns.push(column);
    }
    for (name, data_type) in [
        ("_operation", DataType::Int32),
        ("_command_id", DataType::Int32),
        ("_seqval", DataType::Utf8),
    ] {
        fields.push(Field::new(name, data_type.clone(), true));
        columns.push(new_null_array(&data_type, rows));
    }
    fields.push(Field::new("__position", DataType::Utf8, true));
    columns.push(Arc::new(StringArray::from(vec![s; rows])));
    fields.push(Field::new("__kind", DataType::Int64, true));
    columns.push(Arc::new(Int64Array::from(vec![ABSENT; rows])));
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::silver::history::snapshots::{Chunk, Snapshot};

    fn snapshot(lsn: &str, chunks: &[(i32, i32, &str)], complete: bool) -> Snapshot {
        Snapshot {
            lsn: lsn.into(),
            chunked: !chunks.is_empty(),
            complete,
            read_end: None,
            chunks: chunks
                .iter()
                .map(|(chunk, wave, end)| Chunk {
                    chunk: *chunk,
                    wave: *wave,
                    read_end: end.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_plan_applies_snapshots_in_order_and_the_waves_the_stream_has_passed() {
        let facts = Facts {
            end: Some("0x25".into()),
            snapshots: vec![
                snapshot("0x10", &[], true),
                snapshot(
                    "0x20",
                    &[(0, 1, "0x22"), (1, 1, "0x23"), (2, 2, "0x26")],
                    false,
                ),
            ],
            ..Facts::default()
        };
        let plan = Plan::of(&facts, &Position::default());
        let units: Vec<_> = plan
            .snapshots
            .iter()
            .map(|unit| (unit.lsn.as_str(), unit.chunks.clone(), unit.complete))
            .collect();
        assert_eq!(
            units,
            [("0x10", None, true), ("0x20", Some(vec![0, 1]), false)]
        );
        assert_eq!(plan.snapshots[1].read_end.as_deref(), Some("0x26"));
        assert_eq!(
            plan.snapshots[1].row_end().as_deref(),
            Some("CASE b._chunk WHEN 0 THEN '0x22' WHEN 1 THEN '0x23' END")
        );
        assert_eq!(plan.position.snapshot_lsn.as_deref(), Some("0x10"));
        assert_eq!(plan.position.open_snapshot_lsn.as_deref(), Some("0x20"));
        assert_eq!(plan.position.snapshot_wave, Some(1));
        assert_eq!(plan.changes_to.as_deref(), Some("0x25"));
        // Once complete and passed: the last wave, and the keys it lacks.
        let facts = Facts {
            end: Some("0x30".into()),
            snapshots: vec![
                snapshot("0x10", &[], true),
                snapshot(
                    "0x20",
                    &[(0, 1, "0x22"), (1, 1, "0x23"), (2, 2, "0x26")],
                    true,
                ),
            ],
            ..Facts::default()
        };
        let plan = Plan::of(&facts, &plan.position);
        assert_eq!(
            plan.snapshots,
            [Unit {
                lsn: "0x20".into(),
                chunks: Some(vec![2]),
                complete: true,
                read_end: Some("0x26".into()),
                chunk_ends: vec![(2, "0x26".into())],
            }]
        );
        assert_eq!(plan.position.snapshot_lsn.as_deref(), Some("0x20"));
        assert_eq!(plan.position.open_snapshot_lsn, None);
        // A full snapshot whose read the stream has not passed waits, and so do later ones.
        let mut waiting = snapshot("0x40", &[], true);
        waiting.read_end = Some("0x45".into());
        let facts = Facts {
            end: Some("0x44".into()),
            snapshots: vec![waiting, snapshot("0x50", &[], true)],
            ..Facts::default()
        };
        let plan = Plan::of(&facts, &Position::default());
        assert!(plan.snapshots.is_empty());
        assert_eq!(plan.position, Position::default());
        // A full snapshot still being read (open, no completion) waits too.
        let facts = Facts {
            end: Some("0x99".into()),
            snapshots: vec![snapshot("0x60", &[], false)],
            ..Facts::default()
        };
        assert!(Plan::of(&facts, &Position::default()).snapshots.is_empty());
    }
}
