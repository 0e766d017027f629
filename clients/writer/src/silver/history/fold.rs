//! The fold: one key's versions from what history holds of it and its events in order.
//!
//! A commit is one event however many change rows of the key it holds (a row updated twice
//! in one transaction opens one version, not two): its first row says what the key was
//! before it (operations 1 and 3 carry the before-image, an insert says it was absent), its
//! last row what it is after. Then:
//!
//! 1. **A before-image that disagrees** with the version history holds (in a tracked
//!    column, or the row's presence) means bronze lacks a change: the version is ended, and
//!    the before-image's opened, at the S of the newest snapshot between what history last
//!    saw of the key and the commit (`resnapshot`: the stream restarted there). Without such
//!    a snapshot the commit applies from its own image. A key history never saw whose first
//!    change carries a before-image existed before bronze's first change: its version is
//!    valid from NULL.
//! 2. **The after-image** updates the current version in place when its tracked columns are
//!    the same (a column outside them changed), else ends it (`update`) and opens one at the
//!    commit; a delete ends it (`delete`), and so does an update that moved the row to
//!    another key (`update`).
//! 3. **A snapshot's row** (applied only when the key has no change between S and the end of
//!    the row's read) does what an after-image does, at S, ending with `resnapshot`; a complete
//!    snapshot that lacks a key ends its current version at S (`resnapshot`).
//!
//! An event at or before the newest LSN history already shows of the key (its current
//! version's start or image, its last end) is skipped: a call replayed after a crash between
//! its write and its position finds its own work there.

use super::snapshots::Facts;

/// What ended a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// A tracked column changed, or the row moved to another key.
    Update,
    /// The row was deleted.
    Delete,
    /// A snapshot found the row different or gone: the change is not in bronze.
    Resnapshot,
}

impl Ending {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Ending::Update => "update",
            Ending::Delete => "delete",
            Ending::Resnapshot => "resnapshot",
        }
    }
}

/// A row of the fold's value batches (history's columns of a state row or an event row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct At {
    pub(super) batch: usize,
    pub(super) row: usize,
}

/// A version of a key: where its values are and its interval.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Version {
    pub(super) values: At,
    pub(super) valid_from: Option<String>,
    pub(super) valid_from_ts: Option<i64>,
    pub(super) valid_to: Option<String>,
    pub(super) valid_to_ts: Option<i64>,
    pub(super) ended_by: Option<Ending>,
}

impl Version {
    fn opened(values: At, at: Option<&Point>) -> Self {
        Version {
            values,
            valid_from: at.map(|point| point.lsn.clone()),
            valid_from_ts: at.and_then(|point| point.ts),
            valid_to: None,
            valid_to_ts: None,
            ended_by: None,
        }
    }
}

/// An LSN and its commit time.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Point {
    pub(super) lsn: String,
    pub(super) ts: Option<i64>,
}

/// One event of a key, in the order the fold takes them.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Event {
    /// The key's change rows of one commit: the operation and row of the first and the last.
    Commit {
        at: Point,
        first: (i32, At),
        last: (i32, At),
    },
    /// The key's row in the snapshot at S.
    Image { snapshot: Point, row: At },
    /// The complete snapshot at S has no row of the key.
    Absent { snapshot: Point },
}

impl Event {
    /// The LSN the event is at.
    fn position(&self) -> &str {
        match self {
            Event::Commit { at, .. } => &at.lsn,
            Event::Image { snapshot, .. } | Event::Absent { snapshot } => &snapshot.lsn,
        }
    }
}

/// What history holds of a key before the call.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct KeyState {
    /// Its current version, which the call may end or update.
    pub(super) current: Option<Version>,
    /// The end of its newest ended version.
    pub(super) last_end: Option<String>,
}

/// How the fold compares and reads rows.
pub(super) trait Rows {
    /// Whether the tracked columns of `a` and `b` are equal.
    fn tracked_equal(&self, a: At, b: At) -> bool;
    /// Whether every column history keeps of `a` and `b` (but `_start_lsn`, `_commit_ts`)
    /// is equal.
    fn equal(&self, a: At, b: At) -> bool;
    /// The row's `_start_lsn`.
    fn lsn(&self, at: At) -> Option<String>;
}

/// The key's versions from its current one on, when the events changed anything (the
/// current version, if any, is replaced by them).
pub(super) fn fold_key(
    state: KeyState,
    events: &[Event],
    rows: &impl Rows,
    facts: &Facts,
    snapshot_time: &impl Fn(&str) -> Option<i64>,
) -> Option<Vec<Version>> {
    let mut fold = Fold {
        last_seen: match &state.current {
            Some(current) => current.valid_from.clone().max(rows.lsn(current.values)),
            None => state.last_end.clone(),
        },
        seen_before: state.current.is_some() || state.last_end.is_some(),
        versions: state.current.into_iter().collect(),
        open: false,
        changed: false,
        rows,
    };
    fold.open = !fold.versions.is_empty();
    // What history already reflects (a call replayed after a crash) is not applied again.
    let reflected = fold.last_seen.clone();
    for event in events {
        if reflected
            .as_deref()
            .is_some_and(|seen| event.position() <= seen)
        {
            continue;
        }
        match event {
            Event::Commit { at, first, last } => {
                // 1. The before-image against the version history holds.
                let before = matches!(first.0, 1 | 3).then_some(first.1);
                if !fold.agrees(before) {
                    match facts.snapshot_between(fold.last_seen.as_deref(), &at.lsn) {
                        Some(snapshot) => {
                            let snapshot = Point {
                                lsn: snapshot.to_string(),
                                ts: snapshot_time(snapshot),
                            };
                            fold.end(&snapshot, Ending::Resnapshot);
                            if let Some(before) = before {
                                fold.open(before, Some(&snapshot));
                            }
                        }
                        None if !fold.seen_before && !fold.open => {
                            if let Some(before) = before {
                                fold.open(before, None);
                            }
                        }
                        None => {}
                    }
                }
                // 2. The after-image.
                match last.0 {
                    2 | 4 => fold.image(last.1, at, Ending::Update),
                    1 => fold.end(at, Ending::Delete),
                    _ => fold.end(at, Ending::Update),
                }
                fold.saw(&at.lsn);
            }
            Event::Image { snapshot, row } => {
                fold.image(*row, snapshot, Ending::Resnapshot);
                fold.saw(&snapshot.lsn);
            }
            Event::Absent { snapshot } => {
                fold.end(snapshot, Ending::Resnapshot);
                fold.saw(&snapshot.lsn);
            }
        }
    }
    fold.changed.then_some(fold.versions)
}

struct Fold<'a, R: Rows> {
    versions: Vec<Version>,
    /// Whether the last version is current.
    open: bool,
    /// The newest LSN of the key history knows (an image, an end).
    last_seen: Option<String>,
    /// Whether history held any version of the key before the call.
    seen_before: bool,
    changed: bool,
    rows: &'a R,
}

impl<R: Rows> Fold<'_, R> {
    fn current(&self) -> Option<&Version> {
        self.versions.last().filter(|_| self.open)
    }

    /// Whether `before` (`None`: the key was absent) is what history holds.
    fn agrees(&self, before: Option<At>) -> bool {
        match (self.current(), before) {
            (None, None) => true,
            (Some(current), Some(before)) => self.rows.tracked_equal(current.values, before),
            _ => false,
        }
    }

    fn open(&mut self, values: At, at: Option<&Point>) {
        self.versions.push(Version::opened(values, at));
        self.open = true;
        self.changed = true;
    }

    fn end(&mut self, at: &Point, ending: Ending) {
        if !self.open {
            return;
        }
        if let Some(current) = self.versions.last_mut() {
            current.valid_to = Some(at.lsn.clone());
            current.valid_to_ts = at.ts;
            current.ended_by = Some(ending);
        }
        self.open = false;
        self.changed = true;
    }

    /// The key's row is `values` at `at`: the current version is updated in place when its
    /// tracked columns are the same, else ended (`ending`) and `values` opened.
    fn image(&mut self, values: At, at: &Point, ending: Ending) {
        match self.current() {
            Some(current) if self.rows.tracked_equal(current.values, values) => {
                if !self.rows.equal(current.values, values) {
                    if let Some(current) = self.versions.last_mut() {
                        current.values = values;
                    }
                    self.changed = true;
                }
            }
            Some(_) => {
                self.end(at, ending);
                self.open(values, Some(at));
            }
            None => self.open(values, Some(at)),
        }
    }

    fn saw(&mut self, lsn: &str) {
        if self.last_seen.as_deref().is_none_or(|seen| seen < lsn) {
            self.last_seen = Some(lsn.to_string());
        }
    }
}

#[cfg(test)]
mod tests;
