//! A chunked snapshot's plans rows in the seed's layout (`mssql_cdc.payloads`, `events.py`):
//! the seed's readers take each row's `detail` as the payload whole, so its keys are the
//! seed's, with what only this writer reads nested under a key of its own.
//!
//! | row | the seed's keys | ours, nested |
//! |---|---|---|
//! | `snapshot_open` | the facts payload, `keys` (names), `plan` (`{kind: "int", lo, hi, rows}` or `{kind: "keyset", max}`) | `extent`: the key's extent or the keyset with its types |
//! | `snapshot_plan` | `snapshot`, `kind`, `keys`, `chunk_rows`, `chunk_count`, `chunks` (`[lo, hi]` pairs) | `planned`: each chunk with its rows |
//! | `snapshot_chunk` | `snapshot`, `chunk`, `wave`, `lo`, `hi`, `last` | `planned`: the chunk as read |
//!
//! A bound in the seed's keys is its JSON: a scalar for one key column, a list for several.
//! Ours keep our typed tuples, so a one-column keyset bound is never mistaken for an
//! integer plan's. Rows an earlier release wrote hold ours flat; the readers here take both.

use mssql_cdc_proto::keys::{Bound, KeyValue};
use serde_json::{Value, json};

use super::PlannedChunk;

/// Where a `snapshot_open` row nests our extent.
const EXTENT: &str = "extent";
/// Where `snapshot_plan` and `snapshot_chunk` rows nest our chunks.
const PLANNED: &str = "planned";

/// A key value in the seed's JSON.
fn seed_value(value: &KeyValue) -> Value {
    match value {
        KeyValue::Null => Value::Null,
        KeyValue::Int(int) => json!(int),
        KeyValue::Text(text) => json!(text),
    }
}

/// A chunk bound in the seed's JSON: a scalar for one key column, a list for several,
/// `null` for an open end.
pub(super) fn seed_bound(bound: Option<&Bound>) -> Value {
    match bound {
        None => Value::Null,
        Some(Bound::Int(int)) => json!(int),
        Some(Bound::Keys(tuple)) if tuple.len() == 1 => seed_value(&tuple[0]),
        Some(Bound::Keys(tuple)) => Value::Array(tuple.iter().map(seed_value).collect()),
    }
}

/// The key column names and the seed's `plan` of our extent (an integer key's
/// `{column, sql_type, min, max, rows}` or a keyset `{kind: "keyset", keys, unique, max}`):
/// an integer key of an empty table is the seed's one whole-table chunk.
pub(super) fn seed_extent(extent: &Value) -> (Vec<String>, Value) {
    if extent["kind"] == "keyset" {
        let names = extent["keys"]
            .as_array()
            .map(|keys| {
                keys.iter()
                    .filter_map(|key| key["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let max = match &extent["max"] {
            Value::Array(values) if values.len() == 1 => values[0].clone(),
            other => other.clone(),
        };
        return (names, json!({"kind": "keyset", "max": max}));
    }
    let names = vec![extent["column"].as_str().unwrap_or_default().to_string()];
    if extent["min"].is_null() || extent["max"].is_null() {
        return (names, json!({"kind": "keyset", "max": null}));
    }
    let plan =
        json!({"kind": "int", "lo": extent["min"], "hi": extent["max"], "rows": extent["rows"]});
    (names, plan)
}

/// The `snapshot_open` plans row: the facts row's payload whole with the seed's `keys` and
/// `plan`, our `extent`, and the column selection the waves read.
pub(super) fn open_row(facts_payload: &Value, extent: Value, selection: &[(&str, Value)]) -> Value {
    let (keys, plan) = seed_extent(&extent);
    let mut row = facts_payload.clone();
    row["keys"] = json!(keys);
    row["plan"] = plan;
    row[EXTENT] = extent;
    for (name, value) in selection {
        if !value.is_null() {
            row[*name] = value.clone();
        }
    }
    row
}

/// The `snapshot_plan` plans row.
pub(super) fn plan_row(
    snapshot: impl std::fmt::Display,
    kind: &str,
    keys: &[String],
    chunk_rows: u64,
    chunks: &[PlannedChunk],
) -> Value {
    let pairs: Vec<Value> = chunks
        .iter()
        .map(|chunk| json!([seed_bound(chunk.lo.as_ref()), seed_bound(chunk.hi.as_ref())]))
        .collect();
    json!({"snapshot": snapshot.to_string(), "kind": kind, "keys": keys, "chunk_rows": chunk_rows,
        "chunk_count": chunks.len(), "chunks": pairs, PLANNED: chunks})
}

/// The `snapshot_chunk` plans row of `chunk`, recorded before `wave` reads it.
pub(super) fn chunk_row(
    snapshot: impl std::fmt::Display,
    wave: i64,
    chunk: &PlannedChunk,
    last: bool,
) -> Value {
    json!({"snapshot": snapshot.to_string(), "chunk": chunk.chunk, "wave": wave,
        "lo": seed_bound(chunk.lo.as_ref()), "hi": seed_bound(chunk.hi.as_ref()), "last": last,
        PLANNED: chunk})
}

/// Our extent of a `snapshot_open` plans row, of either layout.
pub(crate) fn open_extent(open: &Value) -> &Value {
    match open.get(EXTENT) {
        Some(extent) if extent.is_object() => extent,
        _ => open,
    }
}

/// Our chunks of a `snapshot_plan` plans row, of either layout.
pub(crate) fn plan_chunks(plan: &Value) -> &Value {
    match plan.get(PLANNED) {
        Some(planned) if planned.is_array() => planned,
        _ => &plan["chunks"],
    }
}

/// Our chunk of a `snapshot_chunk` plans row, of either layout.
pub(crate) fn chunk_of(row: &Value) -> &Value {
    match row.get(PLANNED) {
        Some(planned) if planned.is_object() => planned,
        _ => row,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(number: i32, lo: Option<Bound>, hi: Option<Bound>) -> PlannedChunk {
        PlannedChunk {
            chunk: number,
            lo,
            hi,
            rows: 7,
        }
    }

    #[test]
    fn bounds_take_the_seeds_json_and_ours_stay_typed() {
        let text = |value: &str| KeyValue::Text(value.into());
        assert_eq!(seed_bound(None), Value::Null);
        assert_eq!(seed_bound(Some(&Bound::Int(5))), json!(5));
        // One column: a scalar, as the seed's `_json_key` writes it.
        assert_eq!(
            seed_bound(Some(&Bound::Keys(vec![KeyValue::Int(5)]))),
            json!(5)
        );
        assert_eq!(
            seed_bound(Some(&Bound::Keys(vec![text("2024-01-02")]))),
            json!("2024-01-02")
        );
        assert_eq!(
            seed_bound(Some(&Bound::Keys(vec![text("North"), KeyValue::Null]))),
            json!(["North", null])
        );
        // A one-column integer keyset bound reads back as a keyset bound, not an integer plan's.
        let keyset = chunk(1, Some(Bound::Keys(vec![KeyValue::Int(5)])), None);
        let row = chunk_row("0x01", 2, &keyset, true);
        assert_eq!(row["lo"], json!(5));
        let back: PlannedChunk = serde_json::from_value(chunk_of(&row).clone()).expect("ours");
        assert_eq!(back, keyset);
        assert_eq!(row["wave"], json!(2));
        assert_eq!(row["last"], json!(true));
    }

    #[test]
    fn an_integer_extent_is_the_seeds_int_plan_and_an_empty_one_its_whole_table() {
        let extent = json!({"column": "id", "sql_type": "int", "min": 1, "max": 90, "rows": 80});
        let open = open_row(
            &json!({"mode": "chunked", "kind": "bootstrap", "generation": 0}),
            extent.clone(),
            &[
                ("columns", Value::Null),
                ("except_columns", json!(["note"])),
            ],
        );
        assert_eq!(open["kind"], "bootstrap", "the facts payload stays whole");
        assert_eq!(open["keys"], json!(["id"]));
        assert_eq!(
            open["plan"],
            json!({"kind": "int", "lo": 1, "hi": 90, "rows": 80})
        );
        assert_eq!(open_extent(&open), &extent);
        assert_eq!(open["except_columns"], json!(["note"]));
        assert!(open.get("columns").is_none());
        let empty = json!({"column": "id", "sql_type": "int", "min": null, "max": null, "rows": 0});
        assert_eq!(
            seed_extent(&empty).1,
            json!({"kind": "keyset", "max": null})
        );
        let keyset = json!({"kind": "keyset", "unique": true, "max": ["b", 2],
            "keys": [{"name": "region", "sql_type": "nvarchar(10)"}, {"name": "n", "sql_type": "int"}]});
        assert_eq!(
            seed_extent(&keyset),
            (
                vec!["region".into(), "n".into()],
                json!({"kind": "keyset", "max": ["b", 2]})
            )
        );
    }

    #[test]
    fn a_plan_row_holds_the_seeds_pairs_and_our_chunks_and_old_rows_still_read() {
        let chunks = vec![
            chunk(0, None, Some(Bound::Int(10))),
            chunk(1, Some(Bound::Int(10)), None),
        ];
        let row = plan_row("0x01", "int", &["id".into()], 100, &chunks);
        assert_eq!(row["chunks"], json!([[null, 10], [10, null]]));
        assert_eq!(row["chunk_count"], json!(2));
        let back: Vec<PlannedChunk> =
            serde_json::from_value(plan_chunks(&row).clone()).expect("ours");
        assert_eq!(back, chunks);
        // An earlier release's rows: ours flat.
        let old = json!({"chunk_rows": 100, "chunk_count": 2, "chunks": chunks});
        let back: Vec<PlannedChunk> =
            serde_json::from_value(plan_chunks(&old).clone()).expect("old");
        assert_eq!(back, chunks);
        let old_open = json!({"column": "id", "sql_type": "int", "min": 1, "max": 2, "rows": 2});
        assert_eq!(open_extent(&old_open), &old_open);
        let old_chunk = json!({"chunk": 1, "lo": 10, "hi": null, "rows": 7, "wave": 0});
        assert_eq!(chunk_of(&old_chunk), &old_chunk);
    }
}
