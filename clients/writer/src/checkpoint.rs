//! The stream's checkpoint: each batch's planned range, claimed before it is read.
//!
//! The writer records a batch's planned range `(start, end]` before reading it, so a replay
//! after a crash reads exactly the same range and Delta's application transactions make its
//! commits idempotent. The checkpoint is a location (a directory or an object-store URL, by
//! default next to the tables) holding, as Spark's offset and commit logs do:
//!
//! - `batches/<batch id>.json`, the planned batch, **created only if absent**: two writers of
//!   one app id cannot both plan a batch, so the one that loses the claim stops before it
//!   reads or writes anything (the fence);
//! - `batches/<batch id>.<n>.json`, amendment *n* of the claim (its range moved past purged
//!   changes, with the events that recorded), also created only if absent: of two writers
//!   amending one claim only one can, and the newest amendment holds the batch's range;
//! - `commits/<batch id>.json`, written once every commit of the batch is done.
//!
//! On a local disk every file is written to a temporary name, fsynced, linked into place
//! (which fails when the name exists) and its directory fsynced, so a power loss keeps a
//! claim or loses it whole. On an object store the claim is a conditional put
//! (`PutMode::Create`). The newest [`RETAINED_BATCHES`] batches are kept. A checkpoint of an
//! older release (one `batch.json`) is taken over on open.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use deltalake::ObjectStore;
use deltalake::logstore::object_store::{self, ObjectStoreExt, PutMode, PutOptions};
use futures::TryStreamExt;
use mssql_cdc_proto::Offset;
use serde::{Deserialize, Serialize};

use crate::error::{Result, WriterError};
use crate::facts::FactsRow;

/// How many of the newest batches a checkpoint keeps.
pub const RETAINED_BATCHES: i64 = 100;

/// The last batch of a stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchRecord {
    /// The writer identity the batch belongs to.
    pub app_id: String,
    /// Batch number (the Delta txn version of its commits).
    pub batch_id: i64,
    /// Offset before the batch (exclusive).
    pub start: Offset,
    /// Offset after the batch (inclusive).
    pub end: Offset,
    /// Whether every commit of the batch (bronze, facts, control) is done.
    pub committed: bool,
    /// The event rows of a batch amended past purged changes (`data_skipped`, `data_loss`,
    /// `snapshot_abandoned`), recorded with the amendment: a replay plans the amended range,
    /// which no longer meets the purge, and writes these.
    #[serde(default)]
    pub events: Vec<FactsRow>,
    /// How many times the claim was amended: the next amendment creates number
    /// `amendment + 1`, and of two writers amending one claim only one can.
    #[serde(default)]
    pub amendment: u32,
}

/// What `batches/<id>.json` holds: the planned batch and who claimed it.
#[derive(Debug, Serialize, Deserialize)]
struct Claim {
    app_id: String,
    batch_id: i64,
    start: Offset,
    end: Offset,
    /// The claiming process (a random id per opened checkpoint).
    writer: String,
    /// When it was claimed (RFC 3339).
    claimed_at: String,
    /// [`BatchRecord::events`]; absent in claims of batches never amended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    events: Vec<FactsRow>,
}

/// A stream's checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    location: String,
    store: Store,
    writer: String,
    /// The batch this handle claimed last, and whether it committed: the newest one unless
    /// another writer claimed after it, which this handle's next claim finds. `last` answers
    /// from it without listing and reading the store on every batch.
    written: Mutex<Option<BatchRecord>>,
}

#[derive(Clone, Debug)]
enum Store {
    Local(PathBuf),
    Object(Arc<dyn ObjectStore>),
}

/// The checkpoint of `app_id`: under `root` (a path or a URL), by default under
/// `_checkpoints` beside the facts table at `facts`, on the lake's own store.
pub fn location(root: Option<&str>, facts: &str, app_id: &str) -> String {
    match root {
        Some(root) => location_in(root, app_id),
        None => location_in(&default_root(facts), app_id),
    }
}

/// The directory of the checkpoints kept next to the tables: `_checkpoints` beside the table
/// at `table_location` (a path or a URL).
fn default_root(table_location: &str) -> String {
    match table_location.trim_end_matches('/').rsplit_once('/') {
        Some((parent, _)) => format!("{parent}/_checkpoints"),
        None => "_checkpoints".to_string(),
    }
}

/// The checkpoint of `app_id` under a checkpoints directory (a path or a URL).
fn location_in(root: &str, app_id: &str) -> String {
    format!("{}/{app_id}", root.trim_end_matches('/'))
}

fn batch_name(batch_id: i64) -> String {
    // Zero-padded, so names sort as numbers.
    format!("batches/{batch_id:020}.json")
}

/// Amendment `number` of a claim, created only if absent like the claim: the newest one
/// holds the batch's range.
fn amendment_name(batch_id: i64, number: u32) -> String {
    format!("batches/{batch_id:020}.{number}.json")
}

fn commit_name(batch_id: i64) -> String {
    format!("commits/{batch_id:020}.json")
}

impl Checkpoint {
    /// The checkpoint at `location`: a local directory (created when missing) or an
    /// object-store URL of a store this build includes.
    pub async fn open(location: &str) -> Result<Self> {
        let store = match location.split_once("://") {
            Some((scheme, _)) if scheme != "file" => {
                let url = crate::tables::table_url(location)?;
                let store =
                    deltalake::logstore::store_for(&url, std::iter::empty::<(&str, &str)>())?;
                Store::Object(store)
            }
            _ => {
                let path = match location.strip_prefix("file://") {
                    Some(path) => PathBuf::from(path),
                    None => PathBuf::from(location),
                };
                for directory in ["batches", "commits"] {
                    let directory = path.join(directory);
                    std::fs::create_dir_all(&directory)
                        .map_err(|source| io_error(&directory, "creating", source))?;
                }
                Store::Local(path)
            }
        };
        Self::on(location, store).await
    }

    async fn on(location: &str, store: Store) -> Result<Self> {
        let checkpoint = Checkpoint {
            location: location.to_string(),
            store,
            writer: uuid::Uuid::new_v4().to_string(),
            written: Mutex::new(None),
        };
        checkpoint.take_over_legacy().await?;
        Ok(checkpoint)
    }

    /// The last batch, if any, and whether it committed.
    pub async fn last(&self) -> Result<Option<BatchRecord>> {
        if let Some(written) = self.written().clone() {
            return Ok(Some(written));
        }
        let Some(batch_id) = self.newest_claim().await? else {
            return Ok(None);
        };
        let (claim, amendment) = self.claim(batch_id).await?.ok_or_else(|| {
            WriterError::Internal(format!(
                "checkpoint {}: batch {batch_id} was listed but cannot be read",
                self.location
            ))
        })?;
        let committed = self.store.get(&commit_name(batch_id)).await?.is_some();
        Ok(Some(BatchRecord {
            app_id: claim.app_id,
            batch_id: claim.batch_id,
            start: claim.start,
            end: claim.end,
            committed,
            events: claim.events,
            amendment,
        }))
    }

    /// Claims a new batch before it is read. Refused when the batch id is claimed already:
    /// another writer of this app id planned it (the fence), and this one must stop.
    pub async fn claim_batch(&self, batch: &BatchRecord) -> Result<()> {
        let text = self.claim_text(batch)?;
        if self
            .store
            .create(&batch_name(batch.batch_id), &text)
            .await?
        {
            *self.written() = Some(batch.clone());
            return Ok(());
        }
        let other = self.claim(batch.batch_id).await?;
        Err(WriterError::Fenced(format!(
            "checkpoint {}: batch {} of app_id '{}' was claimed by another writer{}: two writers \
             of one app id are running. This one stopped before reading or writing anything; \
             stop the other, or give this one its own app_id and checkpoint",
            self.location,
            batch.batch_id,
            batch.app_id,
            other.map_or(String::new(), |(other, _)| format!(
                " ({} at {}, range {}..{})",
                other.writer, other.claimed_at, other.start.lsn, other.end.lsn
            )),
        )))
    }

    /// Moves the range of a claimed batch not yet committed from `claimed` (as this writer
    /// read or wrote it) to `batch`'s (a skip past purged changes), recorded before anything
    /// of it is read: amendment `claimed.amendment + 1`, created only if absent. Refused
    /// (fenced) when it exists: another writer of this app id amended the claim since this
    /// one read it (two writers replaying one batch each met the purge), and only one range
    /// may stand for the batch.
    pub async fn amend(&self, claimed: &BatchRecord, batch: &BatchRecord) -> Result<()> {
        let mut amended = batch.clone();
        amended.amendment = claimed.amendment + 1;
        let name = amendment_name(batch.batch_id, amended.amendment);
        if !self
            .store
            .create(&name, &self.claim_text(&amended)?)
            .await?
        {
            return Err(WriterError::Fenced(format!(
                "checkpoint {}: batch {} of app_id '{}' was amended by another writer while \
                 this one replanned it from {}..{}: two writers of one app id are running. \
                 This one stopped before reading or writing anything; stop the other",
                self.location, batch.batch_id, batch.app_id, claimed.start.lsn, claimed.end.lsn,
            )));
        }
        *self.written() = Some(amended);
        Ok(())
    }

    /// Marks a batch committed, and forgets batches older than the retained ones.
    pub async fn commit(&self, batch_id: i64) -> Result<()> {
        let text = serde_json::to_vec(&serde_json::json!({
            "batch_id": batch_id,
            "writer": self.writer,
            "committed_at": chrono::Utc::now().to_rfc3339(),
        }))
        .map_err(|error| WriterError::Internal(error.to_string()))?;
        // A replay of a batch already marked (by this writer or one that crashed) is fine.
        self.store.create(&commit_name(batch_id), &text).await?;
        if let Some(written) = self
            .written()
            .as_mut()
            .filter(|written| written.batch_id == batch_id)
        {
            written.committed = true;
        }
        let forgotten = batch_id - RETAINED_BATCHES;
        if forgotten >= 0 {
            self.store.delete(&commit_name(forgotten)).await?;
            let mut number = 1;
            while self
                .store
                .get(&amendment_name(forgotten, number))
                .await?
                .is_some()
            {
                self.store
                    .delete(&amendment_name(forgotten, number))
                    .await?;
                number += 1;
            }
            self.store.delete(&batch_name(forgotten)).await?;
        }
        Ok(())
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Option<BatchRecord>> {
        self.written.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claim_text(&self, batch: &BatchRecord) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(&Claim {
            app_id: batch.app_id.clone(),
            batch_id: batch.batch_id,
            start: batch.start,
            end: batch.end,
            writer: self.writer.clone(),
            claimed_at: chrono::Utc::now().to_rfc3339(),
            events: batch.events.clone(),
        })
        .map_err(|error| WriterError::Internal(error.to_string()))
    }

    /// The claim of `batch_id` as its newest amendment left it, and that amendment's number
    /// (0: never amended).
    async fn claim(&self, batch_id: i64) -> Result<Option<(Claim, u32)>> {
        let Some(mut claim) = self.read_claim(&batch_name(batch_id)).await? else {
            return Ok(None);
        };
        let mut amendment = 0;
        while let Some(amended) = self
            .read_claim(&amendment_name(batch_id, amendment + 1))
            .await?
        {
            claim = amended;
            amendment += 1;
        }
        Ok(Some((claim, amendment)))
    }

    async fn read_claim(&self, name: &str) -> Result<Option<Claim>> {
        let Some(bytes) = self.store.get(name).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|error| {
            WriterError::Internal(format!(
                "checkpoint {}: {name} is corrupt: {error}",
                self.location
            ))
        })
    }

    async fn newest_claim(&self) -> Result<Option<i64>> {
        let names = self.store.list("batches").await?;
        Ok(names
            .iter()
            .filter_map(|name| name.strip_suffix(".json")?.parse::<i64>().ok())
            .max())
    }

    /// Takes over the single `batch.json` of an older release's local checkpoint.
    async fn take_over_legacy(&self) -> Result<()> {
        let Store::Local(path) = &self.store else {
            return Ok(());
        };
        let legacy = path.join("batch.json");
        let text = match std::fs::read_to_string(&legacy) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(io_error(&legacy, "reading", source)),
        };
        let batch: BatchRecord = serde_json::from_str(&text).map_err(|error| {
            WriterError::Internal(format!("{} is corrupt: {error}", legacy.display()))
        })?;
        if self.newest_claim().await?.is_none() {
            self.store
                .create(&batch_name(batch.batch_id), &self.claim_text(&batch)?)
                .await?;
            if batch.committed {
                self.commit(batch.batch_id).await?;
            }
        }
        std::fs::remove_file(&legacy).map_err(|source| io_error(&legacy, "removing", source))?;
        tracing::info!(checkpoint = %self.location, batch = batch.batch_id,
            "took over the checkpoint of an older release (batch.json)");
        Ok(())
    }
}

fn io_error(path: &Path, doing: &str, source: std::io::Error) -> WriterError {
    WriterError::Io {
        context: format!("{doing} {}", path.display()),
        source,
    }
}

impl Store {
    async fn get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self {
            Store::Local(root) => match std::fs::read(root.join(name)) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(io_error(&root.join(name), "reading", source)),
            },
            Store::Object(store) => match store.get(&name.into()).await {
                Ok(result) => Ok(Some(result.bytes().await?.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(error) => Err(error.into()),
            },
        }
    }

    /// Writes `name` unless it exists; false when it did.
    async fn create(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        match self {
            Store::Local(root) => {
                let path = root.join(name);
                let temporary = write_synced_temporary(&path, bytes)?;
                // A hard link fails when the name exists: an atomic create-if-absent.
                let linked = std::fs::hard_link(&temporary, &path);
                let _ = std::fs::remove_file(&temporary);
                match linked {
                    Ok(()) => sync_directory(&path).map(|()| true),
                    Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                    Err(source) => Err(io_error(&path, "creating", source)),
                }
            }
            Store::Object(store) => {
                let options = PutOptions::from(PutMode::Create);
                match store
                    .put_opts(&name.into(), bytes.to_vec().into(), options)
                    .await
                {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
                    Err(object_store::Error::NotImplemented { .. }) => Err(WriterError::invalid(
                        "the checkpoint's object store cannot put if absent, which fences a \
                         second writer: enable its conditional put (on S3, \
                         AWS_CONDITIONAL_PUT=etag) or keep the checkpoint on a local disk",
                    )),
                    Err(error) => Err(error.into()),
                }
            }
        }
    }

    async fn delete(&self, name: &str) -> Result<()> {
        match self {
            Store::Local(root) => match std::fs::remove_file(root.join(name)) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    Err(io_error(&root.join(name), "removing", error))
                }
                _ => Ok(()),
            },
            Store::Object(store) => match store.delete(&name.into()).await {
                Err(error) if !matches!(error, object_store::Error::NotFound { .. }) => {
                    Err(error.into())
                }
                _ => Ok(()),
            },
        }
    }

    /// The file names directly under `directory`.
    async fn list(&self, directory: &str) -> Result<Vec<String>> {
        match self {
            Store::Local(root) => {
                let path = root.join(directory);
                let entries = match std::fs::read_dir(&path) {
                    Ok(entries) => entries,
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                        return Ok(Vec::new());
                    }
                    Err(source) => return Err(io_error(&path, "listing", source)),
                };
                entries
                    .map(|entry| {
                        entry
                            .map(|entry| entry.file_name().to_string_lossy().into_owned())
                            .map_err(|source| io_error(&path, "listing", source))
                    })
                    .collect()
            }
            Store::Object(store) => {
                let prefix = object_store::path::Path::from(directory);
                let objects: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
                Ok(objects
                    .into_iter()
                    .filter_map(|object| object.location.filename().map(str::to_string))
                    .collect())
            }
        }
    }
}

/// Writes `bytes` to a fresh temporary file beside `path`, flushed to the disk.
fn write_synced_temporary(path: &Path, bytes: &[u8]) -> Result<PathBuf> {
    let temporary = path.with_extension(format!("{}.tmp", uuid::Uuid::new_v4().simple()));
    let mut file = std::fs::File::create(&temporary)
        .map_err(|source| io_error(&temporary, "creating", source))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|source| io_error(&temporary, "writing", source))?;
    Ok(temporary)
}

/// Flushes the directory entry of `path`, so a new name survives a power loss.
fn sync_directory(path: &Path) -> Result<()> {
    let directory = path.parent().unwrap_or(Path::new("."));
    std::fs::File::open(directory)
        .and_then(|directory| directory.sync_all())
        .map_err(|source| io_error(directory, "syncing", source))
}

#[cfg(test)]
mod tests {
    use mssql_cdc_proto::Lsn;

    use super::*;

    fn batch(batch_id: i64, end: u64) -> BatchRecord {
        BatchRecord {
            app_id: "orders".into(),
            batch_id,
            start: Offset::new(Lsn::from_u128(u128::from(end) - 1).expect("lsn"), None),
            end: Offset::new(Lsn::from_u128(u128::from(end)).expect("lsn"), None),
            committed: false,
            events: Vec::new(),
            amendment: 0,
        }
    }

    /// A checkpoint opened on a local directory, and one on an object store (object_store's
    /// own local file system store, whose conditional put is the one S3 and Azure offer).
    struct Place {
        _dir: tempfile::TempDir,
        location: String,
        object: bool,
    }

    impl Place {
        async fn open(&self) -> Checkpoint {
            if self.object {
                let store = object_store::local::LocalFileSystem::new_with_prefix(&self.location)
                    .expect("store");
                Checkpoint::on(&self.location, Store::Object(Arc::new(store)))
                    .await
                    .expect("open")
            } else {
                Checkpoint::open(&self.location).await.expect("open")
            }
        }
    }

    fn places() -> Vec<Place> {
        [false, true]
            .into_iter()
            .map(|object| {
                let dir = tempfile::tempdir().expect("dir");
                Place {
                    location: dir.path().display().to_string(),
                    _dir: dir,
                    object,
                }
            })
            .collect()
    }

    #[tokio::test]
    async fn a_batch_is_claimed_once_and_a_second_claim_is_fenced() {
        for place in places() {
            let first = place.open().await;
            let second = place.open().await;
            assert_eq!(first.last().await.expect("last"), None);
            first.claim_batch(&batch(0, 10)).await.expect("claimed");
            let error = second.claim_batch(&batch(0, 20)).await.expect_err("fenced");
            assert!(matches!(error, WriterError::Fenced(_)), "{error}");
            assert!(error.to_string().contains("another writer"), "{error}");
            let last = first.last().await.expect("last").expect("a batch");
            assert_eq!(
                last,
                batch(0, 10),
                "the winner's range (object store: {})",
                place.object
            );
            first.commit(0).await.expect("commit");
            second.commit(0).await.expect("a second mark is no error");
            assert!(
                second
                    .last()
                    .await
                    .expect("last")
                    .expect("a batch")
                    .committed
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_writers_racing_for_one_batch_exactly_one_wins() {
        for place in places() {
            let place = Arc::new(place);
            let mut racers = Vec::new();
            for end in 0..8u64 {
                let place = place.clone();
                racers.push(tokio::spawn(async move {
                    let checkpoint = place.open().await;
                    checkpoint.claim_batch(&batch(5, 100 + end)).await.is_ok()
                }));
            }
            let mut winners = 0;
            for racer in racers {
                winners += usize::from(racer.await.expect("joined"));
            }
            assert_eq!(winners, 1, "object store: {}", place.object);
        }
    }

    #[tokio::test]
    async fn the_newest_batches_are_kept_and_amends_move_a_claimed_range() {
        for place in places() {
            let checkpoint = place.open().await;
            for batch_id in 0..RETAINED_BATCHES + 5 {
                checkpoint
                    .claim_batch(&batch(batch_id, 10 + batch_id as u64))
                    .await
                    .expect("claim");
                checkpoint.commit(batch_id).await.expect("commit");
            }
            let listed = checkpoint.store.list("batches").await.expect("list");
            assert_eq!(
                listed.len() as i64,
                RETAINED_BATCHES,
                "object store: {}",
                place.object
            );
            let next = RETAINED_BATCHES + 5;
            checkpoint
                .claim_batch(&batch(next, 500))
                .await
                .expect("claim");
            checkpoint
                .amend(&batch(next, 500), &batch(next, 700))
                .await
                .expect("amend");
            // A second writer that read the claim before that amendment cannot amend it too.
            let other = place.open().await;
            let refused = other.amend(&batch(next, 500), &batch(next, 600)).await;
            assert!(
                matches!(refused, Err(WriterError::Fenced(_))),
                "a second amendment of the claim as it was: {refused:?}"
            );
            // What this handle wrote, and what another reads from the store, agree.
            for reader in [&checkpoint, &place.open().await] {
                let last = reader.last().await.expect("last").expect("a batch");
                assert_eq!((last.end, last.committed), (batch(next, 700).end, false));
            }
            checkpoint.commit(next).await.expect("commit");
            for reader in [&checkpoint, &place.open().await] {
                assert!(
                    reader
                        .last()
                        .await
                        .expect("last")
                        .expect("a batch")
                        .committed
                );
            }
        }
    }

    #[test]
    fn checkpoints_are_kept_beside_the_tables_by_default() {
        assert_eq!(default_root("/lake/facts"), "/lake/_checkpoints");
        assert_eq!(
            default_root("s3://bucket/lake/facts/"),
            "s3://bucket/lake/_checkpoints"
        );
        assert_eq!(default_root("facts"), "_checkpoints");
        assert_eq!(
            location_in("s3://bucket/lake/_checkpoints/", "orders"),
            "s3://bucket/lake/_checkpoints/orders"
        );
        assert_eq!(
            location(None, "/lake/facts", "orders"),
            "/lake/_checkpoints/orders"
        );
        assert_eq!(
            location(Some("/state/"), "/lake/facts", "orders"),
            "/state/orders"
        );
    }

    #[tokio::test]
    async fn an_older_releases_batch_json_is_taken_over() {
        let dir = tempfile::tempdir().expect("dir");
        let mut legacy = batch(7, 70);
        legacy.committed = true;
        std::fs::write(
            dir.path().join("batch.json"),
            serde_json::to_vec(&legacy).expect("json"),
        )
        .expect("write");
        let location = dir.path().display().to_string();
        let checkpoint = Checkpoint::open(&location).await.expect("open");
        assert_eq!(checkpoint.last().await.expect("last"), Some(legacy));
        assert!(!dir.path().join("batch.json").exists());
        let error = checkpoint
            .claim_batch(&batch(7, 80))
            .await
            .expect_err("claimed");
        assert!(matches!(error, WriterError::Fenced(_)), "{error}");
    }
}
