//! mssql-cdc-flight: SQL Server change data capture served as Apache Arrow Flight streams.
//!
//! The server reads offset-addressed LSN ranges of CDC change tables and serves them as Arrow
//! record batches over Flight, together with the planning calls a change stream needs
//! (offsets, capture instances, split points). It keeps no pipeline state: every request
//! carries what it needs, and tickets are self-contained and signed, so any replica holding
//! the ticket key serves any ticket.
//!
//! - [`source`]: the [`source::CdcSource`] seam; [`mssql`] reads SQL Server (feature `mssql`,
//!   on by default) and [`sim`] is the embedded simulated database.
//! - [`flight`]: the Flight service: planning, the stream producer, tickets.
//! - The wire contract (LSNs, offsets, the JSON protocol, the client, the error vocabulary)
//!   lives in the `mssql-cdc-proto` crate; its modules are re-exported here so the server
//!   names them as `crate::lsn`, `crate::protocol`, and so on.

pub mod column_builder;
pub mod flight;
#[cfg(feature = "mssql")]
pub mod mssql;
pub mod seed_fake;
pub mod sim;
pub mod source;

pub use mssql_cdc_proto::{
    Error, Lsn, Result, catalog, chunking, client, digest, error, install_crypto_provider, keys,
    lsn, masking, offset, protocol, selection, status, types,
};
pub use offset::{CommitTime, Offset};

/// Process setup shared by the project's binaries: installs the ring rustls crypto provider
/// (two providers are compiled into the dependency tree, and rustls refuses to pick one) and
/// logs to stderr with `RUST_LOG`, or `default_filter` when it is unset, as text or JSON
/// lines ([`mssql_cdc_proto::logging`]).
pub fn init_process(default_filter: &str) {
    install_crypto_provider();
    mssql_cdc_proto::logging::init(default_filter);
}
