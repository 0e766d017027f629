//! The SQL Server source: the [`crate::source::CdcSource`] calls in T-SQL over tiberius 0.13.
//!
//! - [`config`]: the connection (`mssql://` URL or ADO.NET string), TLS and read options;
//! - [`sql`]: every statement sent, one function each, golden-tested;
//! - [`ident`]: validation and bracket-quoting of names inlined into T-SQL;
//! - [`clock`]: the server's time zone and commit times in UTC;
//! - [`decode`]: catalog types to Arrow, and TDS values into Arrow builders;
//! - [`pool`]: pooled connections with a dirty flag, and retries of transient errors;
//! - [`source`]: [`SqlServerSource`] itself.
//!
//! docs/sqlserver.md has the setup, the permissions and the integration test steps.

pub mod clock;
pub mod config;
pub mod decode;
pub mod ident;
pub mod pool;
pub mod source;
pub mod sql;

pub use config::SqlServerConfig;
pub use source::SqlServerSource;
