//! mssql-cdc-flight: SQL Server change data capture served as Apache Arrow Flight streams.
//!
//! The server reads offset-addressed LSN ranges of CDC change tables and serves them as Arrow
//! record batches over Flight, together with the planning calls a change stream needs
//! (offsets, capture instances, split points). It keeps no pipeline state: every request
//! carries what it needs, and tickets are self-contained and signed, so any replica holding
//! the ticket key serves any ticket.
//!
//! - [`lsn`] and [`offset`]: LSNs and stream positions in their wire forms.
//! - [`source`]: the [`source::CdcSource`] seam; [`sim`] is the embedded simulated database.
//! - [`flight`]: the Flight service, its commands, actions and tickets.
//! - [`client`]: a Rust client of the service.

pub mod chunking;
pub mod client;
pub mod error;
pub mod flight;
pub mod keys;
pub mod lsn;
pub mod mssql;
pub mod offset;
pub mod sim;
pub mod source;
pub mod types;

pub use error::{Error, Result};

/// Installs the ring rustls crypto provider for the process, for library callers that open
/// TLS connections without [`init_process`] (two providers are compiled into the dependency
/// tree, and rustls refuses to pick one). Installed already is fine.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Process setup shared by the project's binaries: installs the ring rustls crypto provider
/// (two providers are compiled into the dependency tree, and rustls refuses to pick one) and
/// logs to stderr with `RUST_LOG`, or `default_filter` when it is unset.
pub fn init_process(default_filter: &str) {
    install_crypto_provider();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
pub use lsn::Lsn;
pub use offset::{CommitTime, Offset};
