//! A Delta table that many tasks of one process read: the facts table, which every stream of
//! a sidecar reads as it starts (its checkpoint's last batch, its snapshots' rows) and the
//! snapshot watcher reads every poll.
//!
//! Loading a table replays its log: the last checkpoint, which lists every data file, and the
//! commits after it. The shared facts table gains a commit with nearly every batch of every
//! table, so with a thousand tables starting, each load replayed a longer log than the one
//! before it and the start grew with the square of the tables (docs/writer.md, "Many
//! tables"). A [`SharedTable`] keeps the last load instead and brings it up to date with the
//! commits since, which reads only those; one reader at a time updates it, and the readers
//! waiting behind it find it current.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use deltalake::DeltaTable;
use url::Url;

use crate::error::Result;
use crate::tables;

/// One table's last load, shared by its readers.
pub struct SharedTable {
    url: Url,
    table: tokio::sync::Mutex<Option<DeltaTable>>,
}

/// The shared tables alive in this process, by location: a handle lives as long as a reader
/// holds it, so a table nobody reads any more is loaded afresh by its next reader.
static LIVE: LazyLock<Mutex<HashMap<Url, Weak<SharedTable>>>> = LazyLock::new(Default::default);

impl SharedTable {
    /// The handle of the table at `url`: the one other readers in this process hold, or a
    /// new one.
    pub fn of(url: &Url) -> Arc<SharedTable> {
        let mut live = LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(shared) = live.get(url).and_then(Weak::upgrade) {
            return shared;
        }
        live.retain(|_, handle| handle.strong_count() > 0);
        let shared = Arc::new(SharedTable {
            url: url.clone(),
            table: tokio::sync::Mutex::new(None),
        });
        live.insert(url.clone(), Arc::downgrade(&shared));
        shared
    }

    /// Its location.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The table with every commit made before this call, or `None` when there is none at
    /// the location yet.
    pub async fn latest(&self) -> Result<Option<DeltaTable>> {
        let mut cached = self.table.lock().await;
        if let Some(table) = cached.as_mut() {
            match table.update_incremental(None).await {
                Ok(()) => return Ok(Some(table.clone())),
                // A log it cannot follow (cleaned up past the version held): load it anew.
                Err(error) => {
                    tracing::debug!(url = %self.url, %error, "loading the shared table anew");
                    *cached = None;
                }
            }
        }
        let table = tables::open(&self.url).await?;
        cached.clone_from(&table);
        Ok(table)
    }

    /// [`tables::append_once_each`] from the last load brought up to date, leaving the table
    /// as the append committed it for the next reader: a stream without the sidecar's ledger
    /// (an available-now run) otherwise loaded the facts table anew for every batch, replaying
    /// up to a checkpoint interval of commits each time.
    pub async fn append_once_each(
        &self,
        kind: tables::TableKind,
        name: &str,
        batches: Vec<(String, i64, arrow::record_batch::RecordBatch)>,
    ) -> Result<Vec<bool>> {
        // A failed append leaves nothing cached, so the next reader loads the table anew.
        let mut cached = self.table.lock().await;
        tables::append_once_each(&mut cached, &self.url, kind, name, batches).await
    }

    /// [`tables::query_text`] over [`SharedTable::latest`].
    pub async fn query_text(&self, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
        match self.latest().await? {
            Some(table) => tables::query_table_text(&table, sql).await,
            None => Ok(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::{self, FactsRow};
    use crate::tables::TableKind;

    async fn append(url: &Url, app_id: &str, batch_id: i64) {
        let row = FactsRow {
            app_id: Some(app_id.to_string()),
            batch_id: Some(batch_id),
            ..FactsRow::default()
        };
        let rows = facts::to_batch(&[row]).expect("batch");
        let written = tables::append_once(url, TableKind::Facts, "facts", app_id, batch_id, rows)
            .await
            .expect("append");
        assert!(written);
    }

    #[tokio::test]
    async fn readers_share_one_handle_that_follows_every_commit() {
        let dir = tempfile::tempdir().expect("dir");
        let url = tables::table_url(dir.path().join("facts").to_str().expect("path")).expect("url");
        let first = SharedTable::of(&url);
        assert!(Arc::ptr_eq(&first, &SharedTable::of(&url)));
        assert!(
            first.latest().await.expect("latest").is_none(),
            "no table yet"
        );

        append(&url, "a", 0).await;
        // The table's creation (version 0) and the append.
        let loaded = first.latest().await.expect("latest").expect("a table");
        assert_eq!(loaded.version(), Some(1));
        // Commits another writer makes after the load are read on the next call.
        append(&url, "b", 0).await;
        append(&url, "a", 1).await;
        let updated = first.latest().await.expect("latest").expect("a table");
        assert_eq!(updated.version(), Some(3));
        let rows = first
            .query_text("SELECT app_id, batch_id FROM t ORDER BY app_id, batch_id")
            .await
            .expect("query");
        let rows: Vec<(String, String)> = rows
            .into_iter()
            .map(|row| (row[0].clone().expect("app"), row[1].clone().expect("batch")))
            .collect();
        let expected = [("a", "0"), ("a", "1"), ("b", "0")]
            .map(|(app, batch)| (app.to_string(), batch.to_string()));
        assert_eq!(rows, expected);

        // Once no reader holds it, the next reader loads the table anew.
        let weak = Arc::downgrade(&first);
        drop(first);
        assert!(weak.upgrade().is_none());
        let again = SharedTable::of(&url);
        assert_eq!(
            again
                .latest()
                .await
                .expect("latest")
                .expect("a table")
                .version(),
            Some(3)
        );
    }
}
