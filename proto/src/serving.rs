//! How the binaries' gRPC servers (the Flight service, the writer's admin service) accept
//! connections.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

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

/// [`accepted`], with at most `per_peer` connections open at once from one address: one
/// more is closed as soon as it is accepted (before TLS or HTTP/2 begin), and logged at most
/// once a minute per address. A peer that opens connections without bound holds no more
/// than `per_peer` sockets, buffers and TLS handshakes of the server's.
pub fn accepted_at_most(
    listener: TcpListener,
    keepalive: Duration,
    per_peer: usize,
) -> impl Stream<Item = std::io::Result<Counted>> {
    let open = Arc::new(Mutex::new(HashMap::<IpAddr, usize>::new()));
    let refusals = Arc::new(crate::throttle::PeerThrottle::default());
    accepted(listener, keepalive).filter_map(move |connection| {
        let (open, refusals) = (Arc::clone(&open), Arc::clone(&refusals));
        async move {
            let stream = match connection {
                Ok(stream) => stream,
                Err(error) => return Some(Err(error)),
            };
            let Ok(peer) = stream.peer_addr().map(|peer| peer.ip()) else {
                return Some(Ok(Counted::untracked(stream)));
            };
            match Slot::take(&open, peer, per_peer) {
                Some(slot) => Some(Ok(Counted {
                    stream,
                    _slot: Some(slot),
                })),
                None => {
                    if let Some(suppressed) = refusals.due(Some(peer), std::time::Instant::now()) {
                        tracing::info!(%peer, per_peer, suppressed,
                            "connection refused: the peer has as many open as allowed (logged at most once a minute per peer)");
                    }
                    None
                }
            }
        }
    })
}

/// A peer's place among the open connections, given back when its connection closes.
#[derive(Debug)]
struct Slot {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    peer: IpAddr,
}

impl Slot {
    fn take(open: &Arc<Mutex<HashMap<IpAddr, usize>>>, peer: IpAddr, limit: usize) -> Option<Slot> {
        let mut counts = open.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(peer).or_insert(0);
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(Slot {
            open: Arc::clone(open),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// An accepted connection holding its peer's [`Slot`] until it is dropped.
#[derive(Debug)]
pub struct Counted {
    stream: TcpStream,
    _slot: Option<Slot>,
}

impl Counted {
    fn untracked(stream: TcpStream) -> Self {
        Counted {
            stream,
            _slot: None,
        }
    }
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(context, buffer)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(context, bytes)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(context, buffers)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(context)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(context)
    }
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

    #[tokio::test]
    async fn a_peer_gets_at_most_its_connections_and_a_closed_one_frees_its_place() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let mut incoming = Box::pin(accepted_at_most(listener, Duration::from_secs(60), 2));
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(address).await.expect("connect"));
        }
        let first = incoming.next().await.expect("one").expect("accepted");
        let _second = incoming.next().await.expect("two").expect("accepted");
        // The third was closed unserved: the stream waits for the next connection instead.
        let waited = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(waited.is_err(), "a third connection of the peer was served");
        drop(first);
        let _fourth = TcpStream::connect(address).await.expect("connect");
        let served = tokio::time::timeout(Duration::from_secs(5), incoming.next())
            .await
            .expect("served after one closed")
            .expect("a connection")
            .expect("accepted");
        assert!(served.connect_info().remote_addr().is_some());
    }
}
