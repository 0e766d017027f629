//! How the binaries' gRPC servers (the Flight service, the writer's admin service) accept
//! connections.

use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// The connections `listener` accepts, each with `TCP_NODELAY` and TCP keepalive (first probe
/// after `keepalive` idle).
///
/// tonic's `Server::tcp_nodelay` and `Server::tcp_keepalive` apply only to a listener tonic
/// binds itself, never to an incoming stream such as a listener the caller bound (to report
/// the port it got for `:0`). Served from a plain `TcpListenerStream`, the accepted sockets
/// kept Nagle's algorithm on: the small frames that end a response then waited for the
/// client's delayed ACK, about 40 ms on Linux, on every call.
pub fn accepted(listener: TcpListener, keepalive: Duration) -> TcpIncoming {
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(keepalive))
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let mut incoming = accepted(listener, Duration::from_secs(60));
        let client = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        let served = incoming
            .next()
            .await
            .expect("a connection")
            .expect("accepted");
        assert!(
            served.nodelay().expect("TCP_NODELAY"),
            "Nagle's algorithm is off"
        );
        drop(client);
    }
}
