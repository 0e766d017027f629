//! The lease store: heartbeats and table leases, kept as small objects in the lake's own
//! store (or any location the fleet names), with no coordinator service.
//!
//! - `replicas/<id>.json`, each replica's heartbeat, rewritten every round. A replica is
//!   alive while its heartbeat is younger than the lease, measured on the store's clock:
//!   against the last-modified time of the reader's own heartbeat plus the time since it
//!   wrote it, so the replicas' clocks never meet. `replicas/<id>.leaving` marks a replica
//!   draining its tables after a signal.
//! - `tables/<app id>/<epoch>.json`, a table's lease epochs, each **created only if absent**
//!   and naming its holder (or none: given back). The newest epoch holds the table; of two
//!   replicas claiming one epoch, one wins. An epoch never changes once written, so a
//!   replica reads each one once.
//!
//! A round costs one put, a list of the heartbeats, a list of the leases (a page holds 1,000
//! objects, [`KEPT_EPOCHS`] a table at most) and a get per epoch it has not seen; a claim or
//! a release one conditional put, and the deletion of an epoch [`KEPT_EPOCHS`] before (the
//! newer ones stay for replicas that listed them lately).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use deltalake::ObjectStore;
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{self, ObjectStoreExt, PutMode, PutOptions};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::share::Lease;
use crate::error::{Result, WriterError};

/// How many epochs are read at once.
const READS_AT_ONCE: usize = 16;

/// The lease store at one location.
pub struct Leases {
    store: Arc<dyn ObjectStore>,
    location: String,
    /// The holder of every epoch read so far, by its object name.
    holders: HashMap<Path, Option<String>>,
}

/// A table lease epoch's content.
#[derive(Debug, Serialize, Deserialize)]
struct Epoch {
    /// The holder's replica id; none when given back.
    holder: Option<String>,
}

/// A heartbeat's content, for people reading the store.
#[derive(Debug, Serialize, Deserialize)]
struct Heartbeat {
    replica: String,
    held: usize,
    writer: String,
}

/// The replicas' heartbeats: each id with its age on the store's clock.
pub struct Heartbeats {
    /// Seconds since each replica's heartbeat was written, by replica id.
    pub ages: BTreeMap<String, f64>,
    /// The replicas marked as leaving (stopped by a signal, draining their tables).
    pub leaving: std::collections::BTreeSet<String>,
}

/// The suffix of a replica's leaving mark, beside its heartbeat.
const LEAVING: &str = ".leaving";

impl Leases {
    /// The lease store at `location` (a path or a URL); a local directory is created.
    pub async fn open(location: &str) -> Result<Self> {
        let store: Arc<dyn ObjectStore> = match location.split_once("://") {
            Some((scheme, _)) if scheme != "file" => {
                let url = crate::tables::table_url(location)?;
                deltalake::logstore::store_for(&url, std::iter::empty::<(&str, &str)>())?
            }
            _ => {
                let path = location.strip_prefix("file://").unwrap_or(location);
                std::fs::create_dir_all(path).map_err(|source| WriterError::Io {
                    context: format!("creating the lease directory {path}"),
                    source,
                })?;
                Arc::new(object_store::local::LocalFileSystem::new_with_prefix(path)?)
            }
        };
        Ok(Leases {
            store,
            location: location.to_string(),
            holders: HashMap::new(),
        })
    }

    /// Where the store is.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Writes this replica's heartbeat.
    pub async fn beat(&self, id: &str, held: usize) -> Result<()> {
        let body = serde_json::to_vec(&Heartbeat {
            replica: id.to_string(),
            held,
            writer: env!("CARGO_PKG_VERSION").to_string(),
        })
        .map_err(|error| WriterError::Internal(error.to_string()))?;
        self.store
            .put(&heartbeat_path(id), body.into())
            .await
            .map(|_| ())
            .map_err(Into::into)
    }

    /// Every heartbeat's age on the store's clock: now is `id`'s own heartbeat's time plus
    /// `since_own` (how long ago this process wrote it). Heartbeats older than
    /// `forget_after` seconds are deleted. `None` when `id`'s heartbeat is not listed.
    pub async fn heartbeats(
        &self,
        id: &str,
        since_own: std::time::Duration,
        forget_after: f64,
    ) -> Result<Option<Heartbeats>> {
        let listed: Vec<_> = self
            .store
            .list(Some(&Path::from("replicas")))
            .try_collect()
            .await?;
        let mut written = BTreeMap::new();
        let mut leaving = std::collections::BTreeSet::new();
        for meta in listed {
            let Some(file) = meta.location.filename() else {
                continue;
            };
            if let Some(replica) = file.strip_suffix(".json") {
                written.insert(replica.to_string(), SystemTime::from(meta.last_modified));
            } else if let Some(replica) = file.strip_suffix(LEAVING) {
                leaving.insert(replica.to_string());
            }
        }
        let Some(own) = written.get(id).copied() else {
            return Ok(None);
        };
        let now = own + since_own;
        let mut ages = BTreeMap::new();
        for (replica, at) in written {
            let age = now.duration_since(at).map_or(0.0, |age| age.as_secs_f64());
            if age > forget_after {
                // Best effort: another round or replica deletes it otherwise.
                let _ = self.forget(&replica).await;
            } else {
                ages.insert(replica, age);
            }
        }
        leaving.retain(|replica| ages.contains_key(replica));
        Ok(Some(Heartbeats { ages, leaving }))
    }

    /// Marks `id` as leaving: the others share the tables without it while it drains the
    /// ones it still holds.
    pub async fn leaving(&self, id: &str) -> Result<()> {
        self.store
            .put(&marker_path(id), Vec::new().into())
            .await
            .map(|_| ())
            .map_err(Into::into)
    }

    /// Deletes `id`'s heartbeat and leaving mark.
    pub async fn forget(&self, id: &str) -> Result<()> {
        for path in [heartbeat_path(id), marker_path(id)] {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }

    /// The newest lease of every table in `tables` (app ids); a table without one has
    /// epoch 0 and no holder. A table whose newest epoch moved on between the listing and
    /// its read is left out (the next round sees it).
    pub async fn leases(&mut self, tables: &[String]) -> Result<BTreeMap<String, Lease>> {
        let by_part: HashMap<String, &String> = tables
            .iter()
            .map(|table| (table_part(table), table))
            .collect();
        let listed: Vec<_> = self
            .store
            .list(Some(&Path::from("tables")))
            .try_collect()
            .await?;
        let mut newest: HashMap<&String, (u64, Path)> = HashMap::new();
        for meta in listed {
            let parts: Vec<_> = meta.location.parts().collect();
            let [_, table, epoch] = parts.as_slice() else {
                continue;
            };
            let (Some(table), Some(epoch)) = (
                by_part.get(table.as_ref()),
                epoch
                    .as_ref()
                    .strip_suffix(".json")
                    .and_then(|epoch| epoch.parse::<u64>().ok()),
            ) else {
                continue;
            };
            if newest.get(table).is_none_or(|(seen, _)| *seen < epoch) {
                newest.insert(table, (epoch, meta.location.clone()));
            }
        }
        let unread: Vec<Path> = newest
            .values()
            .map(|(_, path)| path.clone())
            .filter(|path| !self.holders.contains_key(path))
            .collect();
        let store = &self.store;
        let mut reads = futures::stream::iter(unread)
            .map(|path| async move {
                let read = match store.get(&path).await {
                    Ok(got) => got.bytes().await,
                    Err(error) => Err(error),
                };
                (path, read)
            })
            .buffer_unordered(READS_AT_ONCE);
        // Each epoch is kept as it is read, so a round cut short keeps what it read.
        let mut read = Vec::new();
        let mut unknown = std::collections::HashSet::new();
        while let Some((path, got)) = reads.next().await {
            match got {
                Ok(bytes) => match serde_json::from_slice::<Epoch>(&bytes) {
                    Ok(epoch) => read.push((path, epoch.holder)),
                    Err(error) => {
                        // Nobody holds what nobody can read: the next claim writes a newer
                        // epoch over it.
                        tracing::warn!(lease = %path, %error, "a lease epoch does not parse: the table counts as free");
                        read.push((path, None));
                    }
                },
                // Moved on since the listing (the epoch before a newer one is deleted):
                // the next round reads the newer one.
                Err(object_store::Error::NotFound { .. }) => {
                    unknown.insert(path);
                }
                Err(error) => {
                    self.holders.extend(read);
                    return Err(error.into());
                }
            }
        }
        drop(reads);
        // Only the newest epochs are worth remembering.
        let current: std::collections::HashSet<&Path> =
            newest.values().map(|(_, path)| path).collect();
        self.holders.retain(|path, _| current.contains(path));
        self.holders.extend(read);
        Ok(tables
            .iter()
            .filter_map(|table| {
                let lease = match newest.get(table) {
                    Some((_, path)) if unknown.contains(path) => return None,
                    Some((epoch, path)) => Lease {
                        epoch: *epoch,
                        holder: self.holders.get(path).cloned().flatten(),
                    },
                    None => Lease {
                        epoch: 0,
                        holder: None,
                    },
                };
                Some((table.clone(), lease))
            })
            .collect())
    }

    /// The holder of every table in `tables` (none: free), read again until no table's
    /// lease moved on between listing and read ([`Self::leases`]).
    pub async fn holders(&mut self, tables: &[String]) -> Result<BTreeMap<String, Option<String>>> {
        loop {
            let seen = self.leases(tables).await?;
            if seen.len() == tables.len() {
                return Ok(seen
                    .into_iter()
                    .map(|(table, lease)| (table, lease.holder))
                    .collect());
            }
        }
    }

    /// Creates the epochs `epochs` (table, epoch) of the tables' leases naming `holder`
    /// (none: given back), a few at once, each unless it exists; whether each call created
    /// its epoch.
    pub async fn create_all(
        &self,
        epochs: &[(String, u64)],
        holder: Option<&str>,
    ) -> Vec<Result<bool>> {
        // Futures that own what they use, made before the stream: a stream holding a
        // closure over borrowed values is not `Send` for every lifetime.
        let creates: Vec<_> = epochs
            .iter()
            .map(|(table, epoch)| {
                create(
                    Arc::clone(&self.store),
                    table.clone(),
                    *epoch,
                    holder.map(str::to_string),
                )
            })
            .collect();
        futures::stream::iter(creates)
            .buffered(CREATES_AT_ONCE)
            .collect()
            .await
    }
}

/// The newest epochs of a table kept: a replica whose listing is a round or two old still
/// finds the epoch it would claim taken, instead of creating one deleted since.
const KEPT_EPOCHS: u64 = 4;

/// How many lease epochs are created at once.
const CREATES_AT_ONCE: usize = 16;

/// Creates epoch `epoch` of `table`'s lease naming `holder` unless it exists; whether this
/// call created it. The newest [`KEPT_EPOCHS`] stay, for replicas that listed them lately.
async fn create(
    store: Arc<dyn ObjectStore>,
    table: String,
    epoch: u64,
    holder: Option<String>,
) -> Result<bool> {
    let path = epoch_path(&table, epoch);
    let body = serde_json::to_vec(&Epoch { holder })
        .map_err(|error| WriterError::Internal(error.to_string()))?;
    match store
        .put_opts(&path, body.into(), PutOptions::from(PutMode::Create))
        .await
    {
        Ok(_) => {
            if epoch > KEPT_EPOCHS {
                let _ = store.delete(&epoch_path(&table, epoch - KEPT_EPOCHS)).await;
            }
            Ok(true)
        }
        Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
        Err(object_store::Error::NotImplemented { .. }) => Err(WriterError::invalid(
            "the fleet's lease store cannot put if absent: enable its conditional put \
             (on S3, AWS_CONDITIONAL_PUT=etag) or name another with `fleet.leases`",
        )),
        Err(error) => Err(error.into()),
    }
}

fn heartbeat_path(id: &str) -> Path {
    Path::from_iter(["replicas".to_string(), format!("{id}.json")])
}

fn marker_path(id: &str) -> Path {
    Path::from_iter(["replicas".to_string(), format!("{id}{LEAVING}")])
}

/// A table's directory name: its app id as one path segment (characters a store refuses
/// are percent-encoded).
fn table_part(table: &str) -> String {
    object_store::path::PathPart::from(table)
        .as_ref()
        .to_string()
}

fn epoch_path(table: &str, epoch: u64) -> Path {
    // Zero-padded, so names sort as numbers for a person listing them.
    Path::from_iter([
        "tables".to_string(),
        table.to_string(),
        format!("{epoch:020}.json"),
    ])
}
