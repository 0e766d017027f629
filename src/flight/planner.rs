//! Planning a change range `(from, to]` of a table.
//!
//! The range is a prefix of the commit history: it reads `[increment(from), to]`, `to` at
//! most `max_lsn`. A table can have two capture instances; from the newer one's start LSN S
//! on, every commit is captured by both, so the range is cut at S exactly as the seed's
//! reader does: the older instance reads `[increment(from), S - 1]`, the newer `[S, to]`,
//! and a replay of the same range cuts at the same place. Each instance range is checked
//! against CDC retention (`from < min_lsn` is `DATA_LOSS`, never a silently short read),
//! split into tiles of change rows (merged until each holds `min_partition_rows`, a short
//! tail joining its predecessor), and reported with its events: a capture instance switch and
//! any DDL recorded inside the range.

use std::num::NonZeroU32;

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::protocol::{
    ChangesCommand, DEFAULT_MIN_PARTITION_ROWS, MAX_PARTITIONS, PlanMetadata, RangeEvent,
    RangeInfo, ServeOptions,
};
use crate::selection::{ColumnSelection, SelectionError};
use crate::source::{CaptureInstance, CdcSource, InstanceRange, TableName};
use crate::types::{OutputColumn, RESERVED_COLUMN_NAMES, SqlType};

/// A planned read: one endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRead {
    /// Capture instance read.
    pub capture_instance: String,
    /// First commit LSN (inclusive).
    pub from: Lsn,
    /// Last commit LSN (inclusive).
    pub to: Lsn,
    /// Rows counted.
    pub rows: u64,
}

/// A planned change range.
#[derive(Clone, Debug, PartialEq)]
pub struct ChangePlan {
    /// Output columns after the metadata columns.
    pub columns: Vec<OutputColumn>,
    /// One read per endpoint, in LSN order.
    pub reads: Vec<PlannedRead>,
    /// What the `FlightInfo` reports.
    pub metadata: PlanMetadata,
}

/// Whether every value of `older` fits `newer` as the lake holds them: the seed's `_fits` over
/// the Arrow (Spark) types the two are served as, so both libraries join two capture
/// instances' columns alike (tests/seed_parity.rs checks every pair against the seed's own
/// function). The same type, or a widening Delta type widening also accepts: an integer to a
/// larger one, `real` to `float`, `date` to a timestamp without zone, an integer but `bigint`
/// to `float`, an integer to a decimal with as many integer digits (`tinyint` and
/// `smallint` are both Int16, five digits), a decimal to one with as many integer and
/// fraction digits (`money` is decimal(19,4), `smallmoney` decimal(10,4)). Types served alike
/// fit both ways (`smallint` and `tinyint`, any text, `datetime` and `smalldatetime`).
pub fn type_fits(older: &SqlType, newer: &SqlType) -> bool {
    use arrow::datatypes::DataType::{
        Date32, Decimal128, Float32, Float64, Int16, Int32, Int64, Timestamp,
    };
    let (Some(old), Some(new)) = (older.arrow_type(), newer.arrow_type()) else {
        return older == newer;
    };
    if old == new {
        return true;
    }
    let rank = |t: &arrow::datatypes::DataType| match t {
        Int16 => Some(0),
        Int32 => Some(1),
        Int64 => Some(2),
        _ => None,
    };
    let digits = |t: &arrow::datatypes::DataType| match t {
        Int16 => 5,
        Int32 => 10,
        _ => 20,
    };
    match (&old, &new) {
        (a, b) if rank(a).is_some() && rank(b).is_some() => rank(a) < rank(b),
        (Float32, Float64) | (Date32, Timestamp(_, None)) | (Int16 | Int32, Float64) => true,
        (a, Decimal128(precision, scale)) if rank(a).is_some() => {
            i16::from(*precision) - i16::from(*scale) >= digits(a)
        }
        (Decimal128(p1, s1), Decimal128(p2, s2)) => {
            s2 >= s1 && i16::from(*p2) - i16::from(*s2) >= i16::from(*p1) - i16::from(*s1)
        }
        _ => false,
    }
}

/// The columns of a table's capture instances joined by name, older instance first; a column
/// two instances type differently takes the newer type when it holds the older's values.
pub fn union_columns(
    table: &TableName,
    instances: &[CaptureInstance],
) -> Result<Vec<OutputColumn>> {
    let mut columns: Vec<OutputColumn> = Vec::new();
    for instance in instances {
        for captured in &instance.columns {
            if RESERVED_COLUMN_NAMES
                .iter()
                .any(|reserved| reserved.eq_ignore_ascii_case(&captured.name))
            {
                return Err(Error::invalid(format!(
                    "{table}: captured column '{}' clashes with a metadata column name",
                    captured.name
                )));
            }
            if captured.sql_type.arrow_type().is_none() {
                return Err(Error::invalid(format!(
                    "{table}: column '{}' has type {}, which has no default mapping; leave it out \
                     with the 'columns' option",
                    captured.name, captured.sql_type
                )));
            }
            match columns
                .iter_mut()
                .find(|column| column.name == captured.name)
            {
                Some(existing) if type_fits(&existing.sql_type, &captured.sql_type) => {
                    existing.sql_type = captured.sql_type.clone();
                }
                Some(existing) if type_fits(&captured.sql_type, &existing.sql_type) => {}
                Some(existing) => {
                    return Err(Error::SchemaChanged(format!(
                        "capture instances of {table} capture '{}' as {} and {}, which no one type holds",
                        captured.name, existing.sql_type, captured.sql_type
                    )));
                }
                None => columns.push(OutputColumn {
                    name: captured.name.clone(),
                    sql_type: captured.sql_type.clone(),
                }),
            }
        }
    }
    Ok(columns)
}

/// Keeps the requested columns, in the requested order.
pub fn select_columns(
    table: &TableName,
    all: Vec<OutputColumn>,
    requested: Option<&[String]>,
) -> Result<Vec<OutputColumn>> {
    let selection = match requested {
        Some(names) => ColumnSelection::Only(names.to_vec()),
        None => ColumnSelection::All,
    };
    selected_columns(table, all, &selection)
}

/// The columns of `all` that `serve`'s `columns` or `except_columns` ask for.
pub fn served_columns(
    table: &TableName,
    all: Vec<OutputColumn>,
    serve: &ServeOptions,
) -> Result<Vec<OutputColumn>> {
    selected_columns(table, all, &ColumnSelection::of(serve)?)
}

fn selected_columns(
    table: &TableName,
    all: Vec<OutputColumn>,
    selection: &ColumnSelection,
) -> Result<Vec<OutputColumn>> {
    match selection.select(&all, |column| column.name.as_str()) {
        Ok(selected) => Ok(selected.into_iter().cloned().collect()),
        Err(SelectionError::Twice(name)) => {
            Err(Error::invalid(format!("column '{name}' is listed twice")))
        }
        Err(SelectionError::NotCaptured(name)) => {
            let captured: Vec<&str> = all.iter().map(|column| column.name.as_str()).collect();
            Err(Error::invalid(format!(
                "column '{name}' is not captured by any capture instance of {table} (captured: {})",
                captured.join(", ")
            )))
        }
    }
}

/// The instances of `table` a stream reads, oldest first, starting at `start_with` if given.
pub async fn stream_instances(
    source: &dyn CdcSource,
    table: &TableName,
    start_with: Option<&str>,
) -> Result<Vec<CaptureInstance>> {
    let mut instances = source.active_capture_instances(table).await?;
    if let Some(name) = start_with {
        let Some(position) = instances.iter().position(|ci| ci.name == name) else {
            // Known and not processed by the capture job yet is a passing state.
            let all = source.capture_instances(table).await?;
            return Err(if all.iter().any(|ci| ci.name == name) {
                crate::source::capture_instance_not_processed(name)
            } else {
                Error::CaptureInstanceNotFound {
                    name: name.to_string(),
                    hint: format!(" for table {table}"),
                }
            });
        };
        instances.drain(..position);
    }
    Ok(instances)
}

/// Plans the change range of `command`.
pub async fn plan_changes(source: &dyn CdcSource, command: &ChangesCommand) -> Result<ChangePlan> {
    let table: TableName = command.table.parse()?;
    let partitions = command.partitions.unwrap_or(1);
    if partitions == 0 || partitions > MAX_PARTITIONS {
        return Err(Error::invalid(format!(
            "partitions must be 1 to {MAX_PARTITIONS}, not {partitions}"
        )));
    }
    let min_partition_rows = command
        .min_partition_rows
        .unwrap_or(DEFAULT_MIN_PARTITION_ROWS)
        .max(1);
    let instances = stream_instances(source, &table, command.capture_instance.as_deref()).await?;
    let columns = served_columns(&table, union_columns(&table, &instances)?, &command.serve)?;
    let max_lsn = source.max_lsn().await?;
    let ceiling = max_lsn.unwrap_or(Lsn::ZERO);
    let to = command.to.unwrap_or(ceiling);
    if to > ceiling {
        return Err(Error::invalid(format!(
            "to {to} is past max_lsn {ceiling}: a range ends at or before the last commit CDC has processed"
        )));
    }
    if command.from > to {
        return Err(Error::invalid(format!(
            "from {} is past to {to}: a range (from, to] needs from <= to",
            command.from
        )));
    }
    let mut metadata = PlanMetadata {
        table: table.to_string(),
        from: command.from,
        to,
        to_commit_ts: source.lsn_to_time(to).await?,
        max_lsn,
        rows: 0,
        ranges: Vec::new(),
        events: Vec::new(),
    };
    let mut reads = Vec::new();
    if command.from == to {
        return Ok(ChangePlan {
            columns,
            reads,
            metadata,
        });
    }
    let mut cursor = command.from.increment();
    for (index, instance) in instances.iter().enumerate() {
        // The cut between two instances is the newer one's start_lsn. Cleanup moves it up,
        // but only past LSNs purged from both change tables (the older instance captured
        // every change the newer one did), so the cut stays where data can be read.
        let next_start = instances.get(index + 1).and_then(|next| next.start_lsn);
        if next_start.is_some_and(|start| cursor >= start) {
            continue; // the whole rest of the range is in a newer instance
        }
        let end = match next_start {
            Some(start) => to.min(start.decrement()),
            None => to,
        };
        if cursor > end {
            break;
        }
        let min_lsn = source.min_lsn(&instance.name).await?;
        if cursor < min_lsn {
            let hint = if index == 0 && instance.start_lsn.is_some_and(|start| cursor < start) {
                " (an older capture instance of the table may have held these changes before it was disabled)"
                    .to_string()
            } else {
                String::new()
            };
            return Err(Error::ChangesPurged {
                capture_instance: instance.name.clone(),
                requested: cursor,
                min_lsn,
                hint,
            });
        }
        if index > 0 && metadata.ranges.last().is_some() {
            let older = &instances[index - 1];
            let missing: Vec<&str> = columns
                .iter()
                .filter(|column| {
                    !instance
                        .columns
                        .iter()
                        .any(|captured| captured.name == column.name)
                })
                .map(|column| column.name.as_str())
                .collect();
            let mut detail = format!("{} -> {}", older.name, instance.name);
            if !missing.is_empty() {
                detail.push_str(&format!("; columns read as NULL: {}", missing.join(", ")));
            }
            metadata.events.push(RangeEvent {
                event: crate::protocol::CAPTURE_INSTANCE_SWITCHED.into(),
                capture_instance: instance.name.clone(),
                lsn: cursor,
                commit_ts: source.lsn_to_time(cursor).await?,
                detail,
            });
        }
        let range = |from| InstanceRange::new(&instance.name, from, end);
        for ddl in source.ddl_history(range(cursor.decrement())).await? {
            metadata.events.push(RangeEvent {
                event: crate::protocol::SCHEMA_CHANGE.into(),
                capture_instance: ddl.capture_instance,
                lsn: ddl.ddl_lsn,
                commit_ts: Some(ddl.ddl_time.to_millis_precision()),
                // What changed against this instance's captured columns, then the statement.
                detail: super::ddl::describe(&ddl.ddl_command, &instance.columns),
            });
        }
        let tiles = match NonZeroU32::new(partitions).filter(|n| n.get() > 1) {
            Some(tiles) => source.split_points(range(cursor), tiles).await?,
            None => vec![crate::source::Tile {
                last_lsn: end,
                rows: source
                    .split_points(range(cursor), NonZeroU32::MIN)
                    .await?
                    .iter()
                    .map(|tile| tile.rows)
                    .sum(),
            }],
        };
        let instance_reads = merge_tiles(&instance.name, cursor, end, &tiles, min_partition_rows);
        let rows: u64 = instance_reads.iter().map(|read| read.rows).sum();
        metadata.rows += rows;
        metadata.ranges.push(RangeInfo {
            capture_instance: instance.name.clone(),
            from: cursor,
            to: end,
            rows,
        });
        reads.extend(instance_reads);
        cursor = end.increment();
    }
    metadata.events.sort_by_key(|event| event.lsn);
    Ok(ChangePlan {
        columns,
        reads,
        metadata,
    })
}

/// Turns tiles into reads of at least `min_rows` each covering `[from, to]` exactly: tiles
/// are merged in order, a short tail joins the read before it, and the last read ends at
/// `to` so the reads together cover the whole range (idle commits included).
fn merge_tiles(
    capture_instance: &str,
    from: Lsn,
    to: Lsn,
    tiles: &[crate::source::Tile],
    min_rows: u64,
) -> Vec<PlannedRead> {
    let mut reads: Vec<PlannedRead> = Vec::new();
    let mut start = from;
    let mut rows = 0;
    for tile in tiles {
        rows += tile.rows;
        if rows >= min_rows && tile.last_lsn < to {
            reads.push(PlannedRead {
                capture_instance: capture_instance.to_string(),
                from: start,
                to: tile.last_lsn,
                rows,
            });
            start = tile.last_lsn.increment();
            rows = 0;
        }
    }
    // A short tail, or only idle commits after the last tile, joins the read before it.
    if rows < min_rows
        && let Some(last) = reads.last_mut()
    {
        last.to = to;
        last.rows += rows;
        return reads;
    }
    reads.push(PlannedRead {
        capture_instance: capture_instance.to_string(),
        from: start,
        to,
        rows,
    });
    reads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Tile;

    fn lsn(value: u128) -> Lsn {
        Lsn::from_u128(value).expect("small")
    }

    #[test]
    fn tiles_merge_to_the_minimum_and_cover_the_range() {
        let tiles: Vec<Tile> = (1..=10)
            .map(|i| Tile {
                last_lsn: lsn(i * 10),
                rows: 30,
            })
            .collect();
        let reads = merge_tiles("ci", lsn(1), lsn(105), &tiles, 100);
        let bounds: Vec<(u128, u128, u64)> = reads
            .iter()
            .map(|read| (read.from.to_u128(), read.to.to_u128(), read.rows))
            .collect();
        // 4 tiles make 120 rows; the last 2 tiles (60 rows) join the previous read.
        assert_eq!(bounds, vec![(1, 40, 120), (41, 105, 180)]);
    }

    #[test]
    fn idle_commits_after_the_last_tile_join_the_last_read() {
        let tiles = [
            Tile {
                last_lsn: lsn(10),
                rows: 200,
            },
            Tile {
                last_lsn: lsn(20),
                rows: 200,
            },
        ];
        let reads = merge_tiles("ci", lsn(1), lsn(30), &tiles, 100);
        let bounds: Vec<(u128, u128)> = reads
            .iter()
            .map(|read| (read.from.to_u128(), read.to.to_u128()))
            .collect();
        assert_eq!(bounds, vec![(1, 10), (11, 30)]);
    }

    #[test]
    fn an_empty_or_small_range_is_one_read() {
        assert_eq!(merge_tiles("ci", lsn(1), lsn(9), &[], 100).len(), 1);
        let reads = merge_tiles(
            "ci",
            lsn(1),
            lsn(9),
            &[Tile {
                last_lsn: lsn(5),
                rows: 3,
            }],
            100,
        );
        assert_eq!(reads.len(), 1);
        assert_eq!((reads[0].to, reads[0].rows), (lsn(9), 3));
    }

    #[test]
    fn widening_follows_the_seed() {
        assert!(type_fits(&SqlType::Int, &SqlType::BigInt));
        assert!(!type_fits(&SqlType::BigInt, &SqlType::Int));
        assert!(type_fits(
            &SqlType::Int,
            &SqlType::Decimal {
                precision: 12,
                scale: 2
            }
        ));
        assert!(!type_fits(
            &SqlType::Int,
            &SqlType::Decimal {
                precision: 9,
                scale: 2
            }
        ));
        assert!(type_fits(
            &SqlType::Decimal {
                precision: 9,
                scale: 2
            },
            &SqlType::Decimal {
                precision: 12,
                scale: 3
            }
        ));
        assert!(!type_fits(&SqlType::Date, &SqlType::Int));
        // The lake holds both as Int16, money as decimal(19,4), both times as timestamps.
        assert!(type_fits(&SqlType::SmallInt, &SqlType::TinyInt));
        assert!(type_fits(&SqlType::Int, &SqlType::Money));
        assert!(type_fits(&SqlType::Date, &SqlType::SmallDateTime));
        assert!(!type_fits(&SqlType::BigInt, &SqlType::Float));
    }
}
