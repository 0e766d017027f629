//! What the writer's benchmarks share: sizes from the environment and the server in process.

use std::sync::Arc;

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
pub struct Server {
    /// Its URL.
    pub url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<mssql_cdc_flight::Result<()>>,
}

impl Server {
    /// Starts serving `db` on a free loopback port.
    pub async fn start(db: &SimDb) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(mssql_cdc_flight::flight::serve(
            listener,
            Arc::new(db.clone()),
            TicketSigner::random()?,
            None,
            async {
                let _ = stopped.await;
            },
        ));
        Ok(Server { url, stop, task })
    }

    /// Stops the server and waits for it.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await??;
        Ok(())
    }
}
