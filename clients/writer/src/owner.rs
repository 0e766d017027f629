//! The one committer of each Delta table in a process.
//!
//! Many actors of one process commit to the same table: a stream's bronze appends and its
//! auto-compaction, the ledger's and backfills' facts appends, silver's merges, reconcile's
//! report, a maintenance pass. Each takes its table's turn ([`turn`]) around the commit it
//! makes, so within a process commits to one table happen one at a time, in the order they
//! asked. What a commit read before it (the files a compaction packs, the rows a merge
//! replaces) is checked at the commit itself, as across processes.
//!
//! Across processes the turn does not reach: there the commits themselves are checked.
//! Appends carry their application transaction (a second writer of one app id conflicts),
//! rewrites commit only on the version they read ([`crate::tables::rewrite_commit`]), and
//! a compaction commits only where no commit since its read removed one of its files or
//! compacted ([`crate::compaction`]). docs/design-notes.md, "Who commits to which table",
//! lists the owners.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;
use url::Url;

/// A table's turn at committing, held until dropped.
pub type Turn = OwnedMutexGuard<()>;

/// The turns of the tables committed to in this process, by location: an entry lives while
/// a committer holds or waits for it.
static TURNS: LazyLock<Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(Default::default);

/// The key of a table's location: its URL without a trailing slash, so `file:///lake/t` and
/// `file:///lake/t/` are one table.
pub(crate) fn key(url: &Url) -> String {
    url.as_str().trim_end_matches('/').to_string()
}

/// Waits for, and takes, the turn of the table at `url`.
pub async fn turn(url: &Url) -> Turn {
    let lock = {
        let mut turns = TURNS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = key(url);
        match turns.get(&key).and_then(Weak::upgrade) {
            Some(lock) => lock,
            None => {
                turns.retain(|_, lock| lock.strong_count() > 0);
                let lock = Arc::new(tokio::sync::Mutex::new(()));
                turns.insert(key, Arc::downgrade(&lock));
                lock
            }
        }
    };
    lock.lock_owned().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_table_gives_one_turn_at_a_time_and_other_tables_their_own() {
        let table = Url::parse("file:///lake/bronze").expect("url");
        let same = Url::parse("file:///lake/bronze/").expect("url");
        let other = Url::parse("file:///lake/facts").expect("url");
        let held = turn(&table).await;
        // Another table's turn is free while this one is held.
        let _other = turn(&other).await;
        let waiting = tokio::spawn(async move { turn(&same).await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished(),
            "the same table (trailing slash) waits its turn"
        );
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the turn passes on once released")
            .expect("task");
    }
}
