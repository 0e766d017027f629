//! The ledger: many streams' facts rows and verdict moves, sent at once, land in fewer
//! commits than streams, each batch exactly once under its own transaction, and each verdict
//! only forward.

use std::sync::Arc;

use mssql_cdc_flight::{CommitTime, Lsn, Offset};
use mssql_cdc_writer::control::{self, Granularity};
use mssql_cdc_writer::facts::{self, FactsRow};
use mssql_cdc_writer::ledger::Ledger;
use mssql_cdc_writer::tables;

const STREAMS: usize = 40;

fn facts_rows(app: usize, batch_id: i64) -> arrow::record_batch::RecordBatch {
    facts::to_batch(&[FactsRow {
        app_id: Some(format!("t{app}")),
        batch_id: Some(batch_id),
        rows: Some(app as i64),
        ..FactsRow::default()
    }])
    .expect("facts rows")
}

/// The end offset of a batch committed at `hour`:30 on 2026-09-28 (LSN `hour`).
fn end_at(hour: i64) -> Offset {
    let time = CommitTime::parse_iso("2026-09-28T00:30:00.000").expect("time");
    Offset::new(
        Lsn::from_u128(hour as u128 + 1).expect("lsn"),
        Some(CommitTime(time.0 + hour * 3_600_000_000)),
    )
}

async fn version(url: &url::Url) -> u64 {
    tables::open(url)
        .await
        .expect("open")
        .and_then(|table| table.version())
        .expect("a table")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_streams_facts_rows_land_once_each_in_fewer_commits() {
    let dir = tempfile::tempdir().expect("temp");
    let facts_url =
        tables::table_url(&dir.path().join("facts").display().to_string()).expect("url");
    let ledger = Ledger::start(facts_url.clone(), None, Granularity::Hour);
    // The table exists first, so the streams' commits are what is counted.
    assert!(
        ledger
            .append_facts("setup#facts", 0, facts_rows(999, 0))
            .await
            .expect("setup")
    );
    let before = version(&facts_url).await;
    let appends: Vec<_> = (0..STREAMS)
        .map(|app| {
            let ledger = Arc::clone(&ledger);
            tokio::spawn(async move {
                ledger
                    .append_facts(&format!("t{app}#facts"), 7, facts_rows(app, 7))
                    .await
            })
        })
        .collect();
    for append in appends {
        assert!(append.await.expect("task").expect("append"), "written");
    }
    let commits = version(&facts_url).await - before;
    assert!(
        (1..STREAMS as u64).contains(&commits),
        "{STREAMS} streams' facts took {commits} commits"
    );
    let table = tables::open(&facts_url)
        .await
        .expect("open")
        .expect("table");
    for app in 0..STREAMS {
        assert!(
            tables::holds_transaction(&table, &format!("t{app}#facts"), 7)
                .await
                .expect("txn"),
            "t{app}'s transaction"
        );
    }
    // A replayed batch is not written again, alone or beside a new one.
    let again = ledger.append_facts("t3#facts", 7, facts_rows(3, 7));
    let next = ledger.append_facts("t4#facts", 8, facts_rows(4, 8));
    let (again, next) = tokio::join!(again, next);
    assert!(!again.expect("replay"), "a held transaction is not written");
    assert!(next.expect("next"));
    // A batch another writer committed after the ledger's last commit is seen as held: the
    // ledger's table catches up with the log before it writes.
    assert!(
        tables::append_once(
            &facts_url,
            tables::TableKind::Facts,
            "facts",
            "outside#facts",
            1,
            facts_rows(77, 1),
        )
        .await
        .expect("outside")
    );
    assert!(
        !ledger
            .append_facts("outside#facts", 1, facts_rows(77, 1))
            .await
            .expect("after the outside commit"),
        "the ledger wrote a batch another writer had committed"
    );
    let counted = tables::query_text(
        &facts_url,
        "SELECT app_id, batch_id, COUNT(*) FROM t GROUP BY app_id, batch_id HAVING COUNT(*) > 1",
    )
    .await
    .expect("query");
    assert!(counted.is_empty(), "rows written twice: {counted:?}");
    let rows = tables::query_text(&facts_url, "SELECT COUNT(*) FROM t")
        .await
        .expect("count");
    assert_eq!(rows[0][0].as_deref(), Some(&*(STREAMS + 3).to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tables_verdicts_move_together_and_only_forward() {
    let dir = tempfile::tempdir().expect("temp");
    let facts_url =
        tables::table_url(&dir.path().join("facts").display().to_string()).expect("url");
    let control_url =
        tables::table_url(&dir.path().join("control").display().to_string()).expect("url");
    let ledger = Ledger::start(facts_url, Some(control_url.clone()), Granularity::Hour);
    assert_eq!(
        ledger.advance("dbo.setup", end_at(0)).await.expect("setup"),
        Some(CommitTime::parse_iso("2026-09-28T00:00:00.000").expect("time"))
    );
    let before = version(&control_url).await;
    let moves: Vec<_> = (0..STREAMS)
        .map(|table| {
            let ledger = Arc::clone(&ledger);
            tokio::spawn(async move {
                ledger
                    .advance(&format!("dbo.t{table}"), end_at(table as i64 % 5 + 1))
                    .await
            })
        })
        .collect();
    for (table, moved) in moves.into_iter().enumerate() {
        let verdict = moved.await.expect("task").expect("advance");
        let hour = table as i64 % 5 + 1;
        assert_eq!(
            verdict,
            Some(CommitTime(
                CommitTime::parse_iso("2026-09-28T00:00:00.000")
                    .expect("time")
                    .0
                    + hour * 3_600_000_000
            )),
            "dbo.t{table}"
        );
    }
    let commits = version(&control_url).await - before;
    assert!(
        (1..STREAMS as u64).contains(&commits),
        "{STREAMS} verdicts took {commits} MERGEs"
    );
    // An older end does not move a verdict back.
    let back = ledger.advance("dbo.t4", end_at(0)).await.expect("advance");
    assert_eq!(
        back,
        control::finalized_until(&control_url, "dbo.t4")
            .await
            .expect("verdict")
    );
    assert_eq!(
        back,
        Some(CommitTime::parse_iso("2026-09-28T05:00:00.000").expect("time"))
    );
}
