//! The status page as one HTML document: a summary row per table, then per table its plots
//! and last batches. No script: the page reloads itself every few seconds.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};

use super::plots::table_plots;
use crate::board::{Readiness, TableBoard, TableState};

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.4em;margin:0}h2{font-size:1.15em;margin:1.5em 0 .5em}\
table{border-collapse:collapse;font-size:.9em}th,td{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}\
th{background:#f4f4f4}td.number{text-align:right;font-variant-numeric:tabular-nums}\
.state{font-weight:600}.state-running,.state-finished{color:#1a7f37}.state-retrying,.state-starting{color:#9a6700}\
.state-failed{color:#cf222e}.state-stopped,.state-elsewhere{color:#57606a}\
#readiness{font-weight:600}.ready{color:#1a7f37}.not-ready{color:#cf222e}\
.error{color:#cf222e;max-width:28em;overflow-wrap:anywhere}.plots{display:flex;flex-wrap:wrap;gap:1em}\
figure{margin:0}figcaption{font-size:.8em;color:#57606a}.meta{color:#57606a;font-size:.85em}";

/// Escapes text for HTML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            other => escaped.push(other),
        }
    }
    escaped
}

fn or_dash(value: Option<&str>) -> String {
    value.map_or_else(|| "–".to_string(), escape)
}

/// The whole page for `tables`, drawn at `now`, reloading every `refresh_seconds`.
pub fn page(
    tables: &[TableBoard],
    readiness: &Readiness,
    now: DateTime<Utc>,
    refresh_seconds: u32,
) -> String {
    let mut html = String::with_capacity(16_384 + tables.len() * 24_576);
    let _ = write!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{refresh_seconds}\">\
         <title>mssql-cdc-writer status</title><style>{STYLE}</style></head><body>\
         <header><h1>mssql-cdc-writer</h1>"
    );
    let (class, verdict) = if readiness.ready {
        ("ready", "Ready: every table streams".to_string())
    } else {
        let waiting: Vec<String> = readiness
            .waiting
            .iter()
            .map(|(table, state)| format!("{table} ({state})"))
            .collect();
        ("not-ready", format!("Not ready: {}", waiting.join(", ")))
    };
    let _ = write!(
        html,
        "<p id=\"readiness\" class=\"{class}\">{}</p><p class=\"meta\">{} tables · drawn {} UTC · \
         reloads every {refresh_seconds} s · <a href=\"status.json\">status.json</a></p></header>",
        escape(&verdict),
        tables.len(),
        now.format("%Y-%m-%d %H:%M:%S"),
    );
    summary(&mut html, tables);
    let now_minute = now.timestamp().div_euclid(60);
    for table in tables {
        detail(&mut html, table, now_minute);
    }
    html.push_str("</body></html>");
    html
}

/// One row per table.
fn summary(html: &mut String, tables: &[TableBoard]) {
    html.push_str(
        "<table id=\"tables\"><thead><tr><th>table</th><th>state</th><th>behind source</th>\
         <th>last batch</th><th>end LSN</th><th>bronze verdict</th><th>silver applied LSN</th>\
         <th>silver verdict</th><th>snapshot</th><th>reconcile</th><th>last error</th></tr></thead><tbody>",
    );
    for table in tables {
        let name = escape(&table.table);
        let state = table.state.name();
        let state_text = match &table.state {
            TableState::Retrying { attempt, retry_at } => {
                format!("retrying (attempt {attempt}, next at {retry_at})")
            }
            TableState::Elsewhere {
                holder: Some(holder),
            } => format!("elsewhere (replica {holder})"),
            other => other.name().to_string(),
        };
        let last_batch = table.batches.back().map_or_else(
            || or_dash(table.last_batch_id.map(|id| id.to_string()).as_deref()),
            |batch| {
                escape(&format!(
                    "{} ({} rows, {})",
                    batch.batch_id, batch.rows, batch.at
                ))
            },
        );
        let _ = write!(
            html,
            "<tr data-table=\"{name}\" data-state=\"{state}\"><td><a href=\"#table-{name}\">{name}</a></td>\
             <td class=\"state state-{state}\" title=\"since {}\">{}</td><td class=\"number behind\">{}</td>\
             <td>{last_batch}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"snapshot\">{}</td>\
             <td class=\"reconcile\">{}</td><td class=\"error\">{}</td></tr>",
            escape(&table.state_since),
            escape(&state_text),
            or_dash(table.behind_seconds.map(|s| format!("{s:.1} s")).as_deref()),
            or_dash(table.end_lsn.as_deref()),
            or_dash(table.bronze_verdict.as_deref()),
            or_dash(table.silver_applied_lsn.as_deref()),
            or_dash(table.silver_verdict.as_deref()),
            snapshot_cell(table),
            reconcile_cell(table),
            table.last_error.as_ref().map_or_else(
                || "–".to_string(),
                |error| format!(
                    "{}: {} <span class=\"meta\">({} failures)</span>",
                    escape(&error.at),
                    escape(&error.message),
                    table.failures
                )
            ),
        );
    }
    html.push_str("</tbody></table>");
}

fn snapshot_cell(table: &TableBoard) -> String {
    match table.snapshot_chunks {
        None => "–".into(),
        Some(_) if table.snapshot_done => "complete".into(),
        Some((done, Some(total))) => {
            format!("<progress value=\"{done}\" max=\"{total}\"></progress> {done}/{total} chunks")
        }
        Some((done, None)) => format!("{done} chunks, plan not read yet"),
    }
}

fn reconcile_cell(table: &TableBoard) -> String {
    match &table.reconcile {
        None => "–".into(),
        Some(seen) => match &seen.verified_lsn {
            Some(lsn) if seen.values_verified => {
                escape(&format!("verified at {lsn}, every value ({})", seen.at))
            }
            Some(lsn) => escape(&format!(
                "rows verified at {lsn}, values sampled ({})",
                seen.at
            )),
            None => escape(&format!(
                "{} of {} buckets differ ({}, run {})",
                seen.mismatch, seen.buckets, seen.at, seen.run_id
            )),
        },
    }
}

/// A table's plots and last batches.
fn detail(html: &mut String, table: &TableBoard, now_minute: i64) {
    let name = escape(&table.table);
    let plots = table_plots(&table.history, now_minute);
    let _ = write!(
        html,
        "<section class=\"table-detail\" id=\"table-{name}\" data-table=\"{name}\"><h2>{name}</h2><div class=\"plots\">\
         <figure class=\"plot\" data-plot=\"rows\">{}<figcaption>rows written to bronze per minute (UTC)</figcaption></figure>\
         <figure class=\"plot\" data-plot=\"behind\">{}<figcaption>most seconds the batches' ends lay behind the source's newest commit, per minute</figcaption></figure>\
         </div><table class=\"batches\"><thead><tr><th>batch</th><th>rows</th><th>seconds</th><th>end LSN</th>\
         <th>behind source</th><th>committed (UTC)</th></tr></thead><tbody>",
        plots.rows, plots.behind
    );
    for batch in table.batches.iter().rev() {
        let _ = write!(
            html,
            "<tr><td class=\"number\">{}</td><td class=\"number\">{}</td><td class=\"number\">{:.2}</td>\
             <td>{}</td><td class=\"number\">{}</td><td>{}</td></tr>",
            batch.batch_id,
            batch.rows,
            batch.seconds,
            escape(&batch.end_lsn),
            or_dash(batch.behind_seconds.map(|s| format!("{s:.1} s")).as_deref()),
            escape(&batch.at),
        );
    }
    html.push_str("</tbody></table></section>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::board::Board;

    #[test]
    fn the_page_shows_each_table_and_escapes_what_it_did_not_write() {
        let board = Board::new();
        board.enable(["dbo.orders", "dbo.<script>"]);
        board.state("dbo.orders", TableState::Running);
        board.batch(
            "dbo.orders",
            7,
            42,
            0.25,
            "00000027:00000001:0003".into(),
            Some(1.5),
        );
        board.snapshot("dbo.orders", 3, Some(10));
        board.failure("dbo.<script>", "refused: <b>no</b>");
        let now = DateTime::from_timestamp(1_800_000_000, 0).expect("time");
        let html = page(&board.tables(), &board.readiness(), now, 5);
        assert!(html.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
        assert!(html.contains("data-table=\"dbo.orders\" data-state=\"running\""));
        assert!(html.contains("7 (42 rows,"));
        assert!(html.contains("<progress value=\"3\" max=\"10\"></progress> 3/10 chunks"));
        assert!(html.contains("Not ready: dbo.&lt;script&gt; (starting)"));
        assert!(html.contains("refused: &lt;b&gt;no&lt;/b&gt;"));
        assert!(!html.contains("<script>"));
        assert!(!html.contains("<b>no"));
        assert_eq!(html.matches("<section class=\"table-detail\"").count(), 2);
        assert_eq!(html.matches("<svg").count(), 4);
    }
}
