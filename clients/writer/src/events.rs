//! The name of every event the writer records, in one place: facts rows (`event` column) and
//! plans rows of snapshots. A rerun finds its way by these names, so they never change; the
//! stream also copies the server's range events (`capture_instance_switched`,
//! `schema_change`) into facts under the server's names.

/// A snapshot's S recorded before any row is read (facts and plans).
pub const SNAPSHOT_OPEN: &str = "snapshot_open";
/// A chunked snapshot's plan: its chunks and their count (facts and plans).
pub const SNAPSHOT_PLAN: &str = "snapshot_plan";
/// One chunk: recorded in plans before its wave is read, in facts once its rows are in bronze.
pub const SNAPSHOT_CHUNK: &str = "snapshot_chunk";
/// An operator paused the open chunked snapshot (plans).
pub const SNAPSHOT_PAUSE: &str = "snapshot_pause";
/// An operator resumed it (plans).
pub const SNAPSHOT_RESUME: &str = "snapshot_resume";
/// A table's first snapshot is complete (facts): silver may be built from it.
pub const BOOTSTRAP: &str = "bootstrap";
/// A re-snapshot (generation 1 and later) is complete (facts).
pub const RESNAPSHOT: &str = "resnapshot";
/// Purged changes skipped on purpose (`--skip-data-loss`): the range is named (facts).
pub const DATA_SKIPPED: &str = "data_skipped";
/// Purged changes healed by a re-snapshot (`on_data_loss = resnapshot`): the lost range and
/// the snapshot's S (facts).
pub const DATA_LOSS: &str = "data_loss";

/// Columns bronze took from a newer capture instance (facts, `schema_change_policy =
/// evolve`): the batch's rows carry them, earlier rows read NULL.
pub const COLUMNS_ADDED: &str = "columns_added";
/// An open chunked snapshot given up (facts): changes after its S were skipped
/// (`data_skipped`), so its rebuild would miss them; it is never read or applied again.
pub const SNAPSHOT_ABANDONED: &str = "snapshot_abandoned";

/// The events that complete a snapshot.
pub const SNAPSHOT_COMPLETIONS: [&str; 2] = [BOOTSTRAP, RESNAPSHOT];

/// The completion event of a snapshot: [`RESNAPSHOT`] for a re-snapshot, else [`BOOTSTRAP`].
pub fn completion(resnapshot: bool) -> &'static str {
    if resnapshot { RESNAPSHOT } else { BOOTSTRAP }
}

/// `'a', 'b'`: the events as the list of an SQL `IN (...)`.
pub fn sql_list(events: &[&str]) -> String {
    events
        .iter()
        .map(|event| format!("'{event}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_sql_list_quotes_each_event() {
        assert_eq!(
            sql_list(&[SNAPSHOT_OPEN, BOOTSTRAP]),
            "'snapshot_open', 'bootstrap'"
        );
        assert_eq!(completion(true), "resnapshot");
        assert_eq!(completion(false), "bootstrap");
    }
}
