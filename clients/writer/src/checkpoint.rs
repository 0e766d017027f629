//! The stream's checkpoint: the batch in progress, recorded before it is read.
//!
//! The writer records a batch's planned range `(start, end]` before reading it, so a replay
//! after a crash reads exactly the same range and Delta's application transactions make its
//! commits idempotent. A checkpoint is one JSON file, replaced atomically.

use std::path::{Path, PathBuf};

use mssql_cdc_proto::Offset;
use serde::{Deserialize, Serialize};

use crate::error::{Result, WriterError};

/// The last batch of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
}

/// A checkpoint directory.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    path: PathBuf,
}

impl Checkpoint {
    /// The checkpoint in `dir` (created when missing).
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| WriterError::Io {
            context: format!("creating checkpoint {}", dir.display()),
            source,
        })?;
        Ok(Checkpoint {
            path: dir.join("batch.json"),
        })
    }

    /// The last batch, if any.
    pub fn last(&self) -> Result<Option<BatchRecord>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => serde_json::from_str(&text).map(Some).map_err(|error| {
                WriterError::Internal(format!("{} is corrupt: {error}", self.path.display()))
            }),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(WriterError::Io {
                context: format!("reading {}", self.path.display()),
                source,
            }),
        }
    }

    /// Records a batch (atomically: a temporary file renamed over the old one).
    pub fn record(&self, batch: &BatchRecord) -> Result<()> {
        let temporary = self.path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(batch)
            .map_err(|error| WriterError::Internal(error.to_string()))?;
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, &self.path))
            .map_err(|source| WriterError::Io {
                context: format!("writing {}", self.path.display()),
                source,
            })
    }
}
