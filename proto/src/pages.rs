//! How the binaries' HTTP pages (the `/metrics` of both, the writer's status page and its
//! probes) serve: within [`PAGE_CONNECTIONS_PER_PEER`] and [`PAGE_CONNECTIONS`], one request
//! per connection, its headers within [`PAGE_HEADER_TIMEOUT`] and the whole exchange within
//! [`PAGE_CONNECTION_LIFETIME`].
//!
//! A page answers a short request (a scrape, a poll, a probe), so a connection has no reason
//! to stay open: one that sends its request slowly or never (slowloris), or that never reads
//! its answer, holds its place only that long, and a peer holds few places whatever its rate.
//! Without keep-alive, a scraper or a browser opens a connection per request, which at a
//! page's rates costs nothing, and no response is ever cut by a connection's age while the
//! next request is already on its way.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::serving::{ConnectionBounds, accepted_at_most};

/// Connections open at once from one address (an IPv6 /64) to a page.
pub const PAGE_CONNECTIONS_PER_PEER: usize = 32;
/// Connections open at once to a page from everyone.
pub const PAGE_CONNECTIONS: usize = 256;
/// How long a connection may take to send its request's headers.
pub const PAGE_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a page's connection stays open: its request read and its answer written.
pub const PAGE_CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// TCP keepalive's first probe of a page's idle connection.
const PAGE_TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// Most bytes of a request's head held (hyper's default is about 400 KiB): room for a
/// browser's cookies, and a slow sender holds little while its headers come.
const PAGE_MAX_HEAD_BYTES: usize = 64 << 10;

/// Serves `app` on `listener` within the pages' bounds until `stop` resolves; the exchanges
/// under way then finish on their own (each within [`PAGE_CONNECTION_LIFETIME`]).
pub async fn serve_page(
    listener: TcpListener,
    app: axum::Router,
    stop: impl Future<Output = ()> + Send,
) {
    let times = (PAGE_HEADER_TIMEOUT, PAGE_CONNECTION_LIFETIME);
    serve_within(listener, app, stop, times).await;
}

/// [`serve_page`] with `(header timeout, lifetime)`.
async fn serve_within(
    listener: TcpListener,
    app: axum::Router,
    stop: impl Future<Output = ()> + Send,
    (header_timeout, lifetime): (Duration, Duration),
) {
    let bounds = ConnectionBounds {
        per_peer: PAGE_CONNECTIONS_PER_PEER,
        total: PAGE_CONNECTIONS,
        unadmitted: None,
    };
    let mut incoming = Box::pin(accepted_at_most(listener, PAGE_TCP_KEEPALIVE, bounds));
    let mut stop = std::pin::pin!(stop);
    loop {
        let connection = tokio::select! {
            () = &mut stop => return,
            connection = incoming.next() => connection,
        };
        let connection = match connection {
            Some(Ok(connection)) => connection,
            // Out of file descriptors and the like: wait a moment, as axum's own listener
            // does, instead of spinning.
            Some(Err(error)) => {
                tracing::debug!(%error, "accepting a page connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            None => return,
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(PAGE_MAX_HEAD_BYTES)
                .keep_alive(false);
            let exchange = http.serve_connection(TokioIo::new(connection), service);
            // Dropping the exchange closes the connection and gives its place back.
            if tokio::time::timeout(lifetime, exchange).await.is_err() {
                tracing::debug!("a page connection outlived its lifetime: closed");
            }
        });
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
    tokio::spawn(serve_page(listener, app, futures::future::pending()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";

    /// The answer to one request on a new connection, or what went wrong.
    async fn fetch(address: SocketAddr) -> io::Result<String> {
        let mut client = TcpStream::connect(address).await?;
        client.write_all(REQUEST).await?;
        let mut answer = String::new();
        client.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    /// Short times, so that the tests of the bounds wait little, yet long beside a loaded
    /// machine's stalls.
    const TIMES: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(4));

    async fn page() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "page" }));
        tokio::spawn(serve_within(
            listener,
            app,
            futures::future::pending(),
            TIMES,
        ));
        address
    }

    #[tokio::test]
    async fn a_page_answers_once_per_connection_and_a_peer_holds_at_most_its_places() {
        let address = page().await;
        let answer = fetch(address).await.expect("answered");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("page"), "{answer}");
        // A head larger than the pages hold is refused, not buffered.
        let mut client = TcpStream::connect(address).await.expect("connect");
        let cookie = "x".repeat(PAGE_MAX_HEAD_BYTES * 2);
        let head = format!("GET / HTTP/1.1\r\nhost: x\r\ncookie: {cookie}\r\n\r\n");
        let _ = client.write_all(head.as_bytes()).await;
        let mut refused = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut refused)).await;
        assert!(
            !refused.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&refused)
        );
        // Silent peers fill the peer's places; the next connection is closed unanswered.
        let mut silent = Vec::new();
        for _ in 0..PAGE_CONNECTIONS_PER_PEER {
            silent.push(TcpStream::connect(address).await.expect("connect"));
        }
        let refused = tokio::time::timeout(Duration::from_secs(5), fetch(address))
            .await
            .expect("closed at once");
        assert!(
            refused.as_ref().map_or(true, String::is_empty),
            "answered past the bound: {refused:?}"
        );
        // The silent ones are closed at the header timeout: a request is answered again, once
        // the server has seen them go (a loaded machine may take a moment).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            match fetch(address).await {
                Ok(answer) if answer.ends_with("page") => break,
                _ if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("not answered after the silent ones were closed: {other:?}"),
            }
        }
        let mut closed = 0;
        for mut connection in silent {
            let mut buffer = [0u8; 64];
            let read = tokio::time::timeout(Duration::from_secs(5), connection.read(&mut buffer));
            if matches!(read.await, Ok(Ok(0) | Err(_))) {
                closed += 1;
            }
        }
        assert_eq!(
            closed, PAGE_CONNECTIONS_PER_PEER,
            "every silent connection closed"
        );
    }

    #[tokio::test]
    async fn a_client_that_never_reads_its_answer_is_closed_at_the_lifetime() {
        const BIG: usize = 64 << 20;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "x".repeat(BIG) }));
        tokio::spawn(serve_within(
            listener,
            app,
            futures::future::pending(),
            TIMES,
        ));
        let mut client = TcpStream::connect(address).await.expect("connect");
        client.write_all(REQUEST).await.expect("request");
        // The answer fills the sockets' buffers and the server's write waits on a reader that
        // does not read, past the lifetime.
        tokio::time::sleep(TIMES.1 * 3).await;
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), client.read_to_end(&mut answer));
        assert!(read.await.is_ok(), "the connection was never closed");
        assert!(answer.starts_with(b"HTTP/1.1 200"), "the answer had begun");
        assert!(answer.len() < BIG, "the whole answer waited for its reader");
    }
}
