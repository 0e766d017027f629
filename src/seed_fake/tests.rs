//! The seed-fake source over hand-written files: the edges a workload of the seed's code
//! rarely writes (a line being appended, a value JSON has not, a NULL key, keys one under the
//! collation, an instance without columns).

use std::num::NonZeroU32;

use arrow::array::{Array, Int32Array};
use futures::StreamExt;

use super::SeedFake;
use crate::error::Result;
use crate::keys::{KeyColumn, KeySeek, KeysetSeek};
use crate::lsn::Lsn;
use crate::source::{
    BatchBytes, CdcSource, ChangeRead, InstanceRange, KeyRange, SnapshotPiece, SnapshotRead,
    TableName,
};
use crate::types::{OutputColumn, SqlType};

/// A database of one table `t` (`id INT` key, `v DOUBLE`, instance `t`) with commits at
/// 0x10 and 0x20, and `extra` files on top.
fn database(extra: &[(&str, &str)]) -> (tempfile::TempDir, SeedFake) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = vec![
        ("min_lsn.json", r#"{"t": "0x00000000000000000010"}"#),
        (
            "instances.json",
            r#"{"t": {"table": "t", "created": null, "columns": [["id", "INT"], ["v", "DOUBLE"]]}}"#,
        ),
        ("keys.json", r#"{"t": "id"}"#),
        (
            "lsn_time_mapping.jsonl",
            "{\"start_lsn\": \"0x00000000000000000010\", \"tran_end_time\": \"2026-03-01T08:00:00.000\"}\n\
             {\"start_lsn\": \"0x00000000000000000020\", \"tran_end_time\": \"2026-03-01T08:00:01.000\"}\n",
        ),
    ];
    files.extend_from_slice(extra);
    std::fs::create_dir_all(dir.path().join("changes")).expect("changes");
    std::fs::create_dir_all(dir.path().join("tables")).expect("tables");
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("write");
    }
    let source = SeedFake::open(dir.path()).expect("open");
    (dir, source)
}

fn lsn(text: &str) -> Lsn {
    text.parse().expect("lsn")
}

fn column(name: &str, sql_type: SqlType) -> OutputColumn {
    OutputColumn {
        name: name.into(),
        sql_type,
    }
}

fn table() -> TableName {
    TableName::new("dbo", "t")
}

/// A change row of `t` at `lsn` inserting `id` with `v` (JSON text).
fn insert(lsn: &str, id: i32, v: &str) -> String {
    format!(
        "{{\"start_lsn\": \"{lsn}\", \"seqval\": \"{lsn}\", \"command_id\": 1, \"operation\": 2, \
         \"row\": {{\"id\": {id}, \"v\": {v}}}}}\n"
    )
}

async fn changes(source: &SeedFake, columns: Vec<OutputColumn>) -> Result<Vec<i32>> {
    let read = ChangeRead {
        capture_instance: "t".into(),
        from: lsn("0x10"),
        to: lsn("0x30"),
        columns,
        include_command_id: true,
        batch_rows: 100,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_changes(read).await?;
    let mut ids = Vec::new();
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let id = batch.column_by_name("id").expect("id");
        let id = id.as_any().downcast_ref::<Int32Array>().expect("int");
        ids.extend(id.iter().map(|value| value.unwrap_or(-1)));
    }
    Ok(ids)
}

async fn snapshot(
    source: &SeedFake,
    columns: Vec<OutputColumn>,
    pieces: Vec<SnapshotPiece>,
) -> Result<Vec<(Option<i32>, Option<i32>)>> {
    let read = SnapshotRead {
        table: table(),
        capture_instance: "t".into(),
        columns,
        pieces,
        keys: Vec::new(),
        include_command_id: false,
        stamp: lsn("0x20"),
        stamp_time: None,
        batch_rows: 100,
        batch_bytes: BatchBytes::fixed(1 << 20),
    };
    let mut stream = source.read_snapshot(read).await?;
    let mut rows = Vec::new();
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let id = batch.column_by_name("id").expect("id");
        let id = id.as_any().downcast_ref::<Int32Array>().expect("int");
        let chunk = batch.column_by_name("_chunk").expect("_chunk");
        let chunk = chunk.as_any().downcast_ref::<Int32Array>().expect("chunk");
        rows.extend((0..batch.num_rows()).map(|row| {
            (
                chunk.is_valid(row).then(|| chunk.value(row)),
                id.is_valid(row).then(|| id.value(row)),
            )
        }));
    }
    Ok(rows)
}

fn piece(chunk: i32, lo: Option<i64>, hi: Option<i64>) -> SnapshotPiece {
    SnapshotPiece {
        chunk: Some(chunk),
        range: KeyRange { lo, hi },
        keyset: None,
    }
}

#[tokio::test]
async fn a_line_being_appended_and_rows_past_max_lsn_wait_for_their_commit() {
    let lines = [
        insert("0x00000000000000000010", 1, "0.5"),
        insert("0x00000000000000000020", 2, "1.5"),
        // A commit still being written: its rows are there, its mapping entry is not.
        insert("0x00000000000000000030", 3, "2.5"),
        // A line without its newline yet.
        "{\"start_lsn\": \"0x00000000000000000030\", \"seq".to_string(),
    ]
    .concat();
    let (_dir, source) = database(&[("changes/t.jsonl", &lines)]);
    let columns = vec![column("id", SqlType::Int)];
    assert_eq!(changes(&source, columns).await.expect("read"), [1, 2]);
    let tiles = source
        .split_points(
            InstanceRange::new("t", lsn("0x10"), lsn("0x30")),
            NonZeroU32::MIN,
        )
        .await
        .expect("tiles");
    assert_eq!(tiles.iter().map(|tile| tile.rows).sum::<u64>(), 2);
}

#[tokio::test]
async fn a_row_the_timeline_passed_without_its_mapping_entry_is_an_error_not_dropped() {
    let lines = [
        insert("0x00000000000000000010", 1, "0.5"),
        insert("0x00000000000000000018", 2, "1.5"),
        insert("0x00000000000000000020", 3, "2.5"),
    ]
    .concat();
    let (_dir, source) = database(&[("changes/t.jsonl", &lines)]);
    let error = changes(&source, vec![column("id", SqlType::Int)])
        .await
        .expect_err("a row out of order");
    assert!(
        error.to_string().contains("no lsn_time_mapping entry"),
        "{error}"
    );
}

#[tokio::test]
async fn a_value_json_has_not_fails_its_column_not_the_file() {
    // Python's json.dumps writes float('nan') as a bare NaN.
    let lines = [
        insert("0x00000000000000000010", 1, "NaN"),
        insert("0x00000000000000000020", 2, "-Infinity"),
    ]
    .concat();
    let rows = r#"{"[1]": {"id": 1, "v": NaN, "note": "NaN inside a string stays"}}"#;
    let (_dir, source) = database(&[("changes/t.jsonl", &lines), ("tables/t.json", rows)]);
    assert_eq!(
        changes(&source, vec![column("id", SqlType::Int)])
            .await
            .expect("id alone"),
        [1, 2]
    );
    let error = changes(&source, vec![column("v", SqlType::Float)])
        .await
        .expect_err("NaN is no float of SQL Server's");
    assert!(error.to_string().contains("column 'v'"), "{error}");
    assert!(
        !error.to_string().contains(&*_dir.path().to_string_lossy()),
        "{error}"
    );
    let whole = vec![piece(0, None, None)];
    let read = snapshot(&source, vec![column("id", SqlType::Int)], whole.clone()).await;
    assert_eq!(read.expect("id alone"), [(Some(0), Some(1))]);
    assert!(
        snapshot(&source, vec![column("v", SqlType::Float)], whole)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_null_integer_key_is_read_by_the_piece_open_below() {
    let rows = r#"{"[null]": {"id": null, "v": 0.5}, "[1]": {"id": 1, "v": 1.5}, "[5]": {"id": 5, "v": 2.5}}"#;
    let (_dir, source) = database(&[("tables/t.json", rows)]);
    let pieces = vec![piece(0, None, Some(3)), piece(1, Some(3), None)];
    let read = snapshot(&source, vec![column("id", SqlType::Int)], pieces).await;
    assert_eq!(
        read.expect("snapshot"),
        [(Some(0), None), (Some(0), Some(1)), (Some(1), Some(5))]
    );
}

#[tokio::test]
async fn keys_one_value_under_the_collation_are_refused_on_a_unique_key() {
    let instances = r#"{"t": {"table": "t", "created": null, "columns": [["code", "STRING"], ["v", "DOUBLE"]]}}"#;
    let rows = r#"{"[\"a\"]": {"code": "a", "v": 1}, "[\"A \"]": {"code": "A ", "v": 2}}"#;
    let (_dir, source) = database(&[
        ("instances.json", instances),
        ("keys.json", r#"{"t": "code"}"#),
        ("tables/t.json", rows),
    ]);
    let keys = vec![KeyColumn {
        name: "code".into(),
        sql_type: "nvarchar(max)".parse().expect("type"),
    }];
    let seek = KeysetSeek::new(
        keys.clone(),
        KeySeek {
            from: None,
            from_inclusive: true,
            to: None,
            to_inclusive: false,
            n: 0,
        },
    )
    .expect("seek");
    let error = source
        .key_bound(&table(), &seek)
        .await
        .expect_err("colliding keys");
    assert!(error.to_string().contains("collation"), "{error}");
    assert!(source.key_max(&table(), &keys).await.is_err());
}

#[tokio::test]
async fn a_table_described_incompletely_is_left_out_and_its_calls_say_why() {
    let instances = r#"{"t": {"table": "t", "created": null, "columns": [["id", "INT"], ["v", "DOUBLE"]]},
                        "u": {"table": "u", "created": null, "columns": null}}"#;
    let (_dir, source) = database(&[
        ("instances.json", instances),
        (
            "min_lsn.json",
            r#"{"t": "0x00000000000000000010", "u": "0x00000000000000000010"}"#,
        ),
    ]);
    let tables = source
        .tracked_tables()
        .await
        .expect("the others stay readable");
    let names: Vec<String> = tables
        .iter()
        .map(|tracked| tracked.table.to_string())
        .collect();
    assert_eq!(names, ["dbo.t"]);
    let error = source
        .capture_instances(&TableName::new("dbo", "u"))
        .await
        .expect_err("u has no captured columns");
    assert!(
        error.to_string().contains("declares no captured columns"),
        "{error}"
    );
}

#[tokio::test]
async fn a_snapshot_is_stamped_below_the_last_commit_whose_rows_may_still_be_written() {
    let (_dir, source) = database(&[]);
    assert_eq!(source.max_lsn().await.expect("max"), Some(lsn("0x20")));
    assert_eq!(
        source.snapshot_lsn(&table()).await.expect("stamp"),
        lsn("0x1F")
    );
}
