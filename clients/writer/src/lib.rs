//! mssql-cdc-writer: streams SQL Server CDC from an mssql-cdc-flight server into Delta tables.
//!
//! All pipeline state lives in the lake, as in the seed library: bronze (the append-only
//! change log, idempotent appends keyed by Delta application transactions), facts (one row
//! per micro-batch and per event), and control (the `finalized_until` verdict, moved only
//! after the data). The writer talks to SQL Server only through the Flight server.

pub mod admin;
pub mod board;
pub mod bronze;
pub mod checkpoint;
pub mod columns;
pub mod compaction;
pub mod control;
pub mod data_loss;
pub mod error;
pub mod events;
pub mod facts;
pub mod features;
pub mod fleet;
pub mod keyset;
pub mod ledger;
pub mod maintenance;
pub mod masks;
pub mod metrics;
pub mod owner;
pub mod reconcile;
pub(crate) mod retry;
pub mod schema_policy;
pub mod shared_table;
pub mod sidecar;
pub mod silver;
pub mod slots;
pub mod snapshot;
pub mod status_page;
pub mod stored_file;
pub mod stream;
pub mod tables;
pub mod tail;

pub use error::{Result, WriterError};
