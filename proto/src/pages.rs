//! How the binaries' HTTP pages (the `/metrics` of both, the writer's status page) accept
//! connections: within [`PAGE_CONNECTIONS_PER_PEER`] and [`PAGE_CONNECTIONS`], each closed
//! after [`PAGE_CONNECTION_LIFETIME`].
//!
//! A page answers a short request (a scrape, a poll), so a connection has no reason to
//! stay open long: one that sends its request slowly or never (slowloris), or idles on
//! keep-alive, holds its place only that long, and a peer holds few places whatever its
//! rate. A browser or scraper whose keep-alive connection was closed opens another.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::net::TcpListener;

use crate::serving::{ConnectionBounds, Counted, accepted_at_most};

/// Connections open at once from one address (an IPv6 /64) to a page.
pub const PAGE_CONNECTIONS_PER_PEER: usize = 32;
/// Connections open at once to a page from everyone.
pub const PAGE_CONNECTIONS: usize = 256;
/// Longest a page's connection stays open.
pub const PAGE_CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// TCP keepalive's first probe of a page's idle connection.
const PAGE_TCP_KEEPALIVE: Duration = Duration::from_secs(60);

type Incoming = Pin<Box<dyn Stream<Item = io::Result<Counted>> + Send>>;

/// A listener for `axum::serve` that accepts within the pages' bounds.
pub struct PageListener {
    incoming: Incoming,
    local: SocketAddr,
}

impl PageListener {
    /// Accepts on `listener`.
    pub fn new(listener: TcpListener) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let bounds = ConnectionBounds {
            per_peer: PAGE_CONNECTIONS_PER_PEER,
            total: PAGE_CONNECTIONS,
            unadmitted: None,
            lifetime: Some(PAGE_CONNECTION_LIFETIME),
        };
        Ok(PageListener {
            incoming: Box::pin(accepted_at_most(listener, PAGE_TCP_KEEPALIVE, bounds)),
            local,
        })
    }
}

impl axum::serve::Listener for PageListener {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(connection)) => {
                    // A connection reset between accept and here has no peer: skip it.
                    if let Ok(peer) = connection.peer_addr() {
                        return (connection, peer);
                    }
                }
                // Out of file descriptors and the like: wait a moment, as axum's own
                // listener does, instead of spinning.
                Some(Err(error)) => {
                    tracing::debug!(%error, "accepting a page connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                None => futures::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Installs the Prometheus recorder (histograms with `buckets`) and serves its metrics at
/// `http://address/metrics` as a page, within the pages' bounds (the exporter's own listener
/// bounds nothing). Called within a Tokio runtime; the page serves until the process ends.
pub async fn serve_metrics(address: SocketAddr, buckets: &[f64]) -> Result<(), String> {
    let failed = |error: &dyn std::fmt::Display| format!("serving metrics on {address}: {error}");
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(buckets)
        .and_then(|builder| builder.install_recorder())
        .map_err(|error| failed(&error))?;
    let listener = TcpListener::bind(address)
        .await
        .and_then(PageListener::new)
        .map_err(|error| failed(&error))?;
    // Histograms drop their old samples at upkeep, which the exporter's own listener ran and
    // an installed recorder leaves to its caller.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(handle.render())),
    );
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the metrics page stopped");
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    #[tokio::test]
    async fn a_page_answers_and_a_peer_holds_at_most_its_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "page" }));
        let listener = PageListener::new(listener).expect("listener");
        tokio::spawn(async move { axum::serve(listener, app).await });
        // Silent peers fill the peer's places; the next connection is closed unanswered.
        let mut silent = Vec::new();
        for _ in 0..PAGE_CONNECTIONS_PER_PEER {
            silent.push(TcpStream::connect(address).await.expect("connect"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut refused = TcpStream::connect(address).await.expect("connect");
        let _ = refused
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await;
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), refused.read_to_end(&mut answer))
            .await
            .expect("closed at once");
        assert!(
            read.is_err() || answer.is_empty(),
            "answered past the bound"
        );
        // One silent peer leaves: a request is answered again.
        drop(silent.pop());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut client = TcpStream::connect(address).await.expect("connect");
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("request");
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_string(&mut answer))
            .await
            .expect("answered in time")
            .expect("read");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("page"), "{answer}");
    }
}
