//! mssql-cdc-proto: the wire contract of mssql-cdc-flight, shared by the server and every Rust
//! client.
//!
//! It knows nothing of SQL Server, the simulator, Delta or DataFusion: only what crosses the
//! network and the vocabulary both sides speak.
//!
//! - [`lsn`] and [`offset`]: LSNs (`0x` + 20 hex digits) and stream positions in their wire forms.
//! - [`protocol`]: the JSON descriptor commands, action bodies and answers, and the completion
//!   marker every stream ends with; [`selection`]: which captured columns a reader asks for.
//! - [`ticket`] and [`admin`]: the protobuf messages (and the admin gRPC service), generated from
//!   the `.proto` files of this crate.
//! - [`catalog`], [`keys`] and [`types`]: tables, capture instances, key columns and bounds, SQL
//!   types and the output schema the answers and streams are made of.
//! - [`chunking`]: cutting an integer key into chunks from counted slices (server and writer).
//! - [`digest`]: reconcile's value digests, one hash of every served value of a row.
//! - [`error`] and [`status`]: the protocol's errors and their one mapping to gRPC codes.
//! - [`client`]: the Rust Flight client, which never hands out a stream that lacks its marker.
//! - [`logging`]: how the binaries log (text, or JSON lines with `MSSQL_CDC_LOG_FORMAT=json`).
//! - [`serving`]: how the binaries' gRPC servers accept connections (no Nagle delay).
//! - [`signals`]: how the binaries are asked to stop (Ctrl-C or SIGTERM).

pub mod admin;
pub mod catalog;
pub mod chunking;
pub mod client;
pub mod digest;
pub mod error;
pub mod health;
pub mod keys;
pub mod logging;
pub mod lsn;
pub mod masking;
pub mod offset;
pub mod pages;
pub mod protocol;
pub mod secrets;
pub mod selection;
pub mod serving;
pub mod signals;
pub mod status;
pub mod throttle;
pub mod ticket;
pub mod types;

pub use error::{Error, Result};
pub use lsn::Lsn;
pub use offset::{CommitTime, Offset};

/// Installs the ring rustls crypto provider for the process, for callers that open TLS
/// connections (two providers are compiled into the dependency trees of our binaries, and
/// rustls refuses to pick one). Installed already is fine.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
