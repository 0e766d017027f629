//! What the writer's benchmarks share: sizes from the environment and the server in process.

use std::sync::Arc;

use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::SimDb;

/// A number from the environment variable `name`, or `default`.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// The Flight server serving `db` on 127.0.0.1 in this process.
pub async fn start_server(db: &SimDb) -> anyhow::Result<LocalServer> {
    Ok(LocalServer::start(Arc::new(db.clone()), TicketSigner::random()?).await?)
}
