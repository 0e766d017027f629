use super::*;
use crate::silver::history::snapshots::Snapshot;

/// Rows as `(tracked, other, _start_lsn)`, row `i` at `At { batch: 0, row: i }`.
struct Table(Vec<(&'static str, &'static str, &'static str)>);

impl Rows for Table {
    fn tracked_equal(&self, a: At, b: At) -> bool {
        self.0[a.row].0 == self.0[b.row].0
    }
    fn equal(&self, a: At, b: At) -> bool {
        self.0[a.row].0 == self.0[b.row].0 && self.0[a.row].1 == self.0[b.row].1
    }
    fn lsn(&self, at: At) -> Option<String> {
        Some(self.0[at.row].2.to_string())
    }
}

fn at(row: usize) -> At {
    At { batch: 0, row }
}

fn point(lsn: &str) -> Point {
    Point {
        lsn: lsn.into(),
        ts: Some(i64::from_str_radix(&lsn[2..], 16).expect("hex")),
    }
}

fn commit(lsn: &str, first: (i32, usize), last: (i32, usize)) -> Event {
    Event::Commit {
        at: point(lsn),
        first: (first.0, at(first.1)),
        last: (last.0, at(last.1)),
    }
}

fn facts(snapshots: &[&str]) -> Facts {
    Facts {
        points: snapshots.iter().map(|lsn| lsn.to_string()).collect(),
        snapshots: snapshots
            .iter()
            .map(|lsn| Snapshot {
                lsn: lsn.to_string(),
                chunked: false,
                complete: true,
                read_end: None,
                chunks: Vec::new(),
            })
            .collect(),
        ..Facts::default()
    }
}

fn time(lsn: &str) -> Option<i64> {
    point(lsn).ts
}

/// A version as `(row, from, to, ended_by)`.
type Summary<'a> = (usize, Option<&'a str>, Option<&'a str>, Option<&'a str>);

fn summary(versions: &[Version]) -> Vec<Summary<'_>> {
    versions
        .iter()
        .map(|v| {
            (
                v.values.row,
                v.valid_from.as_deref(),
                v.valid_to.as_deref(),
                v.ended_by.map(Ending::as_str),
            )
        })
        .collect()
}

#[test]
fn an_insert_updates_and_a_delete_make_versions_by_the_tracked_column() {
    // rows: insert a/x, update to a/y (untracked), update to b/y, delete (before-image b/y)
    let rows = Table(vec![
        ("a", "x", "0x02"),
        ("a", "x", "0x03"),
        ("a", "y", "0x03"),
        ("a", "y", "0x04"),
        ("b", "y", "0x04"),
        ("b", "y", "0x05"),
    ]);
    let events = [
        commit("0x02", (2, 0), (2, 0)),
        commit("0x03", (3, 1), (4, 2)),
        commit("0x04", (3, 3), (4, 4)),
        commit("0x05", (1, 5), (1, 5)),
    ];
    let versions =
        fold_key(KeyState::default(), &events, &rows, &facts(&[]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (2, Some("0x02"), Some("0x04"), Some("update")),
            (4, Some("0x04"), Some("0x05"), Some("delete")),
        ]
    );
    assert_eq!(versions[1].valid_from_ts, Some(4));
}

#[test]
fn a_commit_that_updates_a_row_twice_opens_one_version() {
    let rows = Table(vec![
        ("a", "x", "0x02"),
        ("b", "x", "0x03"),
        ("c", "x", "0x03"),
    ]);
    let state = KeyState {
        current: Some(Version::opened(at(0), Some(&point("0x02")))),
        last_end: None,
    };
    // 3(a) 4(b) 3(b) 4(c) in one commit: first before-image a, last after-image c
    let events = [commit("0x03", (3, 0), (4, 2))];
    let versions = fold_key(state, &events, &rows, &facts(&[]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (0, Some("0x02"), Some("0x03"), Some("update")),
            (2, Some("0x03"), None, None)
        ]
    );
}

#[test]
fn a_before_image_places_a_missing_change_at_the_snapshot_the_stream_restarted_from() {
    // history holds a (since 0x02, seen at 0x02); bronze lacks the change to b; the
    // re-snapshot at 0x10 restarted the stream; the change at 0x12 has before-image b.
    let rows = Table(vec![
        ("a", "x", "0x02"),
        ("b", "x", "0x12"),
        ("c", "x", "0x12"),
    ]);
    let state = KeyState {
        current: Some(Version::opened(at(0), Some(&point("0x02")))),
        last_end: None,
    };
    let events = [commit("0x12", (3, 1), (4, 2))];
    let versions =
        fold_key(state, &events, &rows, &facts(&["0x01", "0x10"]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (0, Some("0x02"), Some("0x10"), Some("resnapshot")),
            (1, Some("0x10"), Some("0x12"), Some("update")),
            (2, Some("0x12"), None, None),
        ]
    );
    // Without a snapshot after what history saw, the commit applies from its own image.
    let state = KeyState {
        current: Some(Version::opened(at(0), Some(&point("0x02")))),
        last_end: None,
    };
    let versions = fold_key(state, &events, &rows, &facts(&["0x01"]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (0, Some("0x02"), Some("0x12"), Some("update")),
            (2, Some("0x12"), None, None),
        ]
    );
}

#[test]
fn a_key_first_seen_by_a_before_image_is_valid_from_the_snapshot_before_it_or_null() {
    let rows = Table(vec![("a", "x", "0x12")]);
    let events = [commit("0x12", (1, 0), (1, 0))];
    let versions = fold_key(
        KeyState::default(),
        &events,
        &rows,
        &facts(&["0x10"]),
        &time,
    )
    .expect("versions");
    assert_eq!(
        summary(&versions),
        [(0, Some("0x10"), Some("0x12"), Some("delete"))]
    );
    let versions =
        fold_key(KeyState::default(), &events, &rows, &facts(&[]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [(0, None, Some("0x12"), Some("delete"))]
    );
    // A key whose last version ended, seen again by a before-image without a snapshot
    // between: the change applies from its own image (here: nothing to end).
    let state = KeyState {
        current: None,
        last_end: Some("0x05".into()),
    };
    assert_eq!(
        fold_key(state, &events, &rows, &facts(&["0x01"]), &time),
        None
    );
}

#[test]
fn a_snapshot_row_updates_in_place_ends_or_opens_and_an_absence_ends() {
    let rows = Table(vec![
        ("a", "x", "0x02"),
        ("a", "y", "0x10"),
        ("a", "y", "0x20"),
        ("b", "y", "0x30"),
    ]);
    let state = || KeyState {
        current: Some(Version::opened(at(0), Some(&point("0x02")))),
        last_end: None,
    };
    let image = |lsn: &str, row: usize| Event::Image {
        snapshot: point(lsn),
        row: at(row),
    };
    let none = facts(&[]);
    // Equal in every column: nothing to write.
    assert_eq!(
        fold_key(state(), &[image("0x01", 0)], &rows, &none, &time),
        None
    );
    let versions = fold_key(
        state(),
        &[image("0x10", 1), image("0x20", 2), image("0x30", 3)],
        &rows,
        &none,
        &time,
    )
    .expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (1, Some("0x02"), Some("0x30"), Some("resnapshot")),
            (3, Some("0x30"), None, None),
        ]
    );
    let versions = fold_key(
        state(),
        &[Event::Absent {
            snapshot: point("0x10"),
        }],
        &rows,
        &none,
        &time,
    )
    .expect("versions");
    assert_eq!(
        summary(&versions),
        [(0, Some("0x02"), Some("0x10"), Some("resnapshot"))]
    );
}

#[test]
fn an_update_that_moves_the_row_to_another_key_ends_the_old_key_as_an_update() {
    let rows = Table(vec![("a", "x", "0x02"), ("a", "x", "0x05")]);
    let state = KeyState {
        current: Some(Version::opened(at(0), Some(&point("0x02")))),
        last_end: None,
    };
    let versions = fold_key(
        state,
        &[commit("0x05", (3, 1), (3, 1))],
        &rows,
        &facts(&[]),
        &time,
    )
    .expect("versions");
    assert_eq!(
        summary(&versions),
        [(0, Some("0x02"), Some("0x05"), Some("update"))]
    );
}

#[test]
fn events_history_already_shows_are_not_applied_again() {
    // A call replayed after a crash: history holds what it wrote (a version ended at 0x04,
    // the current one from 0x04); its events come again.
    let rows = Table(vec![
        ("a", "x", "0x02"),
        ("a", "x", "0x04"),
        ("b", "x", "0x04"),
        ("b", "x", "0x06"),
        ("c", "x", "0x06"),
    ]);
    let state = KeyState {
        current: Some(Version::opened(at(2), Some(&point("0x04")))),
        last_end: Some("0x04".into()),
    };
    let replayed = [commit("0x04", (3, 1), (4, 2))];
    assert_eq!(
        fold_key(state.clone(), &replayed, &rows, &facts(&[]), &time),
        None
    );
    // With a newer commit among them, only that one applies.
    let events = [
        commit("0x04", (3, 1), (4, 2)),
        commit("0x06", (3, 3), (4, 4)),
    ];
    let versions = fold_key(state, &events, &rows, &facts(&[]), &time).expect("versions");
    assert_eq!(
        summary(&versions),
        [
            (2, Some("0x04"), Some("0x06"), Some("update")),
            (4, Some("0x06"), None, None)
        ]
    );
}
