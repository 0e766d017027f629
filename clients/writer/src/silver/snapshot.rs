//! What silver reads of bronze's snapshots: the facts of the complete snapshot and of the open
//! chunked one with its chunks, and Amendment 2's range deletes of an open snapshot's new
//! chunks, on the snapshot's own single integer, date or timestamp key ([`RangeKey`]).

use deltalake::datafusion::prelude::SessionContext;
use url::Url;

use super::{ApplyConfig, quote, text};
use crate::error::{Result, WriterError};
use crate::events;
use crate::facts;
use crate::snapshot::SnapshotMode;
use crate::tables;

/// The snapshot facts of the bronze table: complete snapshots, the open chunked one, chunks.
#[derive(Debug, Default)]
pub(super) struct SnapshotFacts {
    /// Newest complete snapshot's S.
    pub(super) complete: Option<String>,
    /// The newest chunked snapshot opened after every complete one, not complete and not
    /// abandoned.
    pub(super) open: Option<String>,
    /// `(chunk, wave, stamp)` of the open snapshot's chunks.
    pub(super) chunks: Vec<(i32, i32, String)>,
}

pub(super) async fn snapshot_facts(facts: &Url, bronze: &str) -> Result<SnapshotFacts> {
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
                events::SNAPSHOT_ABANDONED,
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
    let abandoned: Vec<&Option<String>> = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_ABANDONED))
        .map(|row| &row[1])
        .collect();
    found.open = rows
        .iter()
        .filter(|row| row[0].as_deref() == Some(events::SNAPSHOT_OPEN))
        .filter(|row| !abandoned.contains(&&row[1]))
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

/// Amendment 2's range deletes of the new chunks of an open snapshot, as a query of
/// operation-1 rows in bronze's columns: each silver key inside a chunk's range `[lo, hi)`
/// that the chunk does not hold and whose image is older than the chunk's stamp L is deleted
/// at L (so a later change of the key still outranks it). Only when silver's key is the
/// snapshot's own single integer, date or timestamp key (its `snapshot_open` plans row,
/// [`RangeKey`]): other keys leave stale rows to the rebuild at completion. `None` when
/// there is nothing to delete from.
pub(super) async fn range_deletes(
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
        .find_map(|(_, open)| {
            RangeKey::of_open(crate::snapshot::seed_layout::open_extent(open), key)
        })
    else {
        return Ok(None);
    };
    let k = quote(key);
    let mut stale = Vec::new();
    for (chunk, _, stamp) in new_chunks {
        let Some(planned) = details.iter().find_map(|(event, detail)| {
            let planned = crate::snapshot::seed_layout::chunk_of(detail);
            (event == events::SNAPSHOT_CHUNK
                && planned["chunk"].as_i64() == Some(i64::from(*chunk)))
            .then_some(planned)
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
pub(super) enum RangeKey {
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
