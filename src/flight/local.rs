//! The Flight service on a free loopback port of this process, for the demos, the
//! benchmarks and the tests.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::ServiceOptions;
use super::ticket::TicketSigner;
use crate::error::{Error, Result};
use crate::source::CdcSource;

/// A running in-process server; dropping it stops it without waiting.
pub struct LocalServer {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<()>>>,
}

impl LocalServer {
    /// Serves `source` on a free port of 127.0.0.1, plaintext, signing tickets with `signer`.
    pub async fn start(source: Arc<dyn CdcSource>, signer: TicketSigner) -> Result<Self> {
        Self::start_with(source, ServiceOptions::new(signer)).await
    }

    /// Serves `source` on a free port of 127.0.0.1, plaintext, with `options`.
    pub async fn start_with(source: Arc<dyn CdcSource>, options: ServiceOptions) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|error| Error::io("binding a loopback port", error))?;
        let address = listener
            .local_addr()
            .map_err(|error| Error::io("reading the bound address", error))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(super::serve(listener, source, options, None, async {
            let _ = stopped.await;
        }));
        Ok(LocalServer {
            url: format!("http://{address}"),
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops the server and waits for the calls in flight; returns how serving ended.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|error| Error::Internal(format!("server task: {error}")))?,
            None => Ok(()),
        }
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
