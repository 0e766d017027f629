//! How the binaries' gRPC servers (the Flight service, the writer's admin service) accept
//! connections.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// What [`accepted_at_most`] allows.
#[derive(Clone, Debug)]
pub struct ConnectionBounds {
    /// Connections open at once from one peer: an IPv4 address, or an IPv6 /64 (one host
    /// is usually given a whole /64, so its addresses count as one peer).
    pub per_peer: usize,
    /// Connections open at once from everyone.
    pub total: usize,
    /// With authentication: the bounds on connections none of whose calls was admitted yet.
    pub unadmitted: Option<Unadmitted>,
}

/// The bounds on connections that have not presented valid credentials yet.
#[derive(Clone, Debug)]
pub struct Unadmitted {
    /// How long a connection may stay open before one of its calls is admitted
    /// ([`Admissions::admit`]); then it is closed.
    pub within: Duration,
    /// Such connections open at once from one peer: one more is closed as it is accepted,
    /// so a peer without credentials holds few places whatever its rate.
    pub per_peer: usize,
    /// Where the interceptor marks connections admitted.
    pub admissions: Admissions,
}

/// [`accepted`], within `bounds`: one more connection than a peer or everyone may have is
/// closed as soon as it is accepted (before TLS or HTTP/2 begin), and logged at most once a
/// minute per address. A peer that opens connections without bound holds no more than
/// `per_peer` sockets, buffers and TLS handshakes of the server's; and with
/// `bounds.unadmitted`, a connection that never presents valid credentials keeps its place
/// only that long.
pub fn accepted_at_most(
    listener: TcpListener,
    keepalive: Duration,
    bounds: ConnectionBounds,
) -> impl Stream<Item = std::io::Result<Counted>> {
    let open = Arc::new(Mutex::new(Open::default()));
    let refusals = Arc::new(crate::throttle::PeerThrottle::default());
    accepted(listener, keepalive).filter_map(move |connection| {
        let (open, refusals, bounds) = (Arc::clone(&open), Arc::clone(&refusals), bounds.clone());
        async move {
            let stream = match connection {
                Ok(stream) => stream,
                Err(error) => return Some(Err(error)),
            };
            let Ok(peer) = stream.peer_addr() else {
                return Some(Ok(Counted::untracked(stream)));
            };
            let taken = Slot::take(&open, peer_of(peer.ip()), &bounds).and_then(|slot| {
                let pending = match &bounds.unadmitted {
                    Some(unadmitted) => Some(Pending::new(unadmitted, peer)?),
                    None => None,
                };
                Ok((slot, pending))
            });
            match taken {
                Ok((slot, pending)) => Some(Ok(Counted {
                    stream,
                    _slot: Some(slot),
                    pending,
                })),
                Err(full) => {
                    if let Some(suppressed) =
                        refusals.due(Some(peer.ip()), std::time::Instant::now())
                    {
                        tracing::info!(peer = %peer.ip(), full, suppressed,
                            "connection refused: as many open as allowed (logged at most once a minute per peer)");
                    }
                    None
                }
            }
        }
    })
}

/// The peer a connection counts against: its IPv4 address (also when written as IPv6), or
/// the /64 of its IPv6 address.
pub fn peer_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let network = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(std::net::Ipv6Addr::from(network))
            }
        },
    }
}

/// The connections open now, per peer and in all.
#[derive(Debug, Default)]
struct Open {
    by_peer: HashMap<IpAddr, usize>,
    total: usize,
}

/// A peer's place among the open connections, given back when its connection closes.
#[derive(Debug)]
struct Slot {
    open: Arc<Mutex<Open>>,
    peer: IpAddr,
}

impl Slot {
    /// A place for one more connection of `peer`, or which bound is full.
    fn take(
        open: &Arc<Mutex<Open>>,
        peer: IpAddr,
        bounds: &ConnectionBounds,
    ) -> Result<Slot, &'static str> {
        let mut counts = open.lock().unwrap_or_else(|e| e.into_inner());
        if counts.total >= bounds.total {
            return Err("the server's total");
        }
        let count = counts.by_peer.entry(peer).or_insert(0);
        if *count >= bounds.per_peer {
            return Err("the peer's");
        }
        *count += 1;
        counts.total += 1;
        Ok(Slot {
            open: Arc::clone(open),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.open.lock().unwrap_or_else(|e| e.into_inner());
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.by_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.by_peer.remove(&self.peer);
            }
        }
    }
}

/// The connections still waiting for an admitted call, by their peer's socket address
/// (unique among open connections), and how many each peer has: the authentication
/// interceptor marks a connection admitted as it admits one of its calls.
#[derive(Clone, Debug, Default)]
pub struct Admissions {
    waiting: Arc<Mutex<Waiting>>,
}

#[derive(Debug, Default)]
struct Waiting {
    by_address: HashMap<SocketAddr, Arc<AtomicBool>>,
    by_peer: HashMap<IpAddr, usize>,
}

impl Waiting {
    fn leave(&mut self, address: SocketAddr) {
        let peer = peer_of(address.ip());
        if let Some(count) = self.by_peer.get_mut(&peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.by_peer.remove(&peer);
            }
        }
    }
}

impl Admissions {
    /// Marks the connection of `peer` admitted: it is no longer closed at its deadline, and
    /// no longer counts among its peer's unadmitted connections.
    pub fn admit(&self, peer: SocketAddr) {
        let mut waiting = self.lock();
        let admitted = waiting
            .by_address
            .get(&peer)
            .is_some_and(|admitted| !admitted.swap(true, Ordering::Relaxed));
        if admitted {
            waiting.leave(peer);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection's wait for its first admitted call.
#[derive(Debug)]
struct Pending {
    admissions: Admissions,
    peer: SocketAddr,
    admitted: Arc<AtomicBool>,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl Pending {
    /// The wait of a connection from `peer`, or which bound is full.
    fn new(unadmitted: &Unadmitted, peer: SocketAddr) -> Result<Self, &'static str> {
        let admitted = Arc::new(AtomicBool::new(false));
        {
            let mut waiting = unadmitted.admissions.lock();
            let count = waiting.by_peer.entry(peer_of(peer.ip())).or_insert(0);
            if *count >= unadmitted.per_peer {
                return Err("the peer's unauthenticated");
            }
            *count += 1;
            waiting.by_address.insert(peer, Arc::clone(&admitted));
        }
        Ok(Pending {
            admissions: unadmitted.admissions.clone(),
            peer,
            admitted,
            deadline: Box::pin(tokio::time::sleep(unadmitted.within)),
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut waiting = self.admissions.lock();
        // The address may be another connection's by now (reused after a reset): only this
        // connection's own entry is removed.
        if waiting
            .by_address
            .get(&self.peer)
            .is_some_and(|entry| Arc::ptr_eq(entry, &self.admitted))
        {
            waiting.by_address.remove(&self.peer);
        }
        if !self.admitted.load(Ordering::Relaxed) {
            waiting.leave(self.peer);
        }
    }
}

/// An accepted connection holding its peer's [`Slot`] until it is dropped.
#[derive(Debug)]
pub struct Counted {
    stream: TcpStream,
    _slot: Option<Slot>,
    pending: Option<Pending>,
}

impl Counted {
    fn untracked(stream: TcpStream) -> Self {
        Counted {
            stream,
            _slot: None,
            pending: None,
        }
    }

    /// Whether the connection's time to present valid credentials ran out: it then reads
    /// an error, and the server closes it. Polled with every read, so the deadline wakes
    /// the connection's task.
    fn unadmitted_too_long(&mut self, context: &mut Context<'_>) -> bool {
        let Some(pending) = &mut self.pending else {
            return false;
        };
        if pending.admitted.load(Ordering::Relaxed) {
            self.pending = None;
            return false;
        }
        pending.deadline.as_mut().poll(context).is_ready()
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
        if self.unadmitted_too_long(context) {
            tracing::debug!(peer = ?self.pending.as_ref().map(|pending| pending.peer),
                "connection closed: no call presented valid credentials in time");
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no call presented valid credentials in time",
            )));
        }
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
        let bounds = ConnectionBounds {
            per_peer: 2,
            total: 100,
            unadmitted: None,
        };
        let mut incoming = Box::pin(accepted_at_most(listener, Duration::from_secs(60), bounds));
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

    #[tokio::test]
    async fn the_total_bound_holds_across_peers_and_ipv6_peers_count_by_their_64() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let bounds = ConnectionBounds {
            per_peer: 10,
            total: 1,
            unadmitted: None,
        };
        let mut incoming = Box::pin(accepted_at_most(listener, Duration::from_secs(60), bounds));
        let _first = TcpStream::connect(address).await.expect("connect");
        let _second = TcpStream::connect(address).await.expect("connect");
        let _served = incoming.next().await.expect("one").expect("accepted");
        let waited = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(waited.is_err(), "past the total, a connection was served");
        let v6 = |text: &str| peer_of(text.parse().expect("an address"));
        assert_eq!(v6("2001:db8:1:2:aaaa::1"), v6("2001:db8:1:2:bbbb::2"));
        assert_ne!(v6("2001:db8:1:2::1"), v6("2001:db8:1:3::1"));
        assert_eq!(
            v6("::ffff:192.0.2.7"),
            v6("192.0.2.7"),
            "IPv4 written as IPv6"
        );
    }

    #[tokio::test]
    async fn a_connection_without_an_admitted_call_is_closed_at_its_deadline() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let admissions = Admissions::default();
        let bounds = ConnectionBounds {
            per_peer: 10,
            total: 10,
            unadmitted: Some(Unadmitted {
                within: Duration::from_millis(200),
                per_peer: 2,
                admissions: admissions.clone(),
            }),
        };
        let mut incoming = Box::pin(accepted_at_most(listener, Duration::from_secs(60), bounds));
        let idle_client = TcpStream::connect(address).await.expect("connect");
        let mut idle = incoming.next().await.expect("one").expect("accepted");
        let admitted_client = TcpStream::connect(address).await.expect("connect");
        let mut admitted = incoming.next().await.expect("two").expect("accepted");
        admissions.admit(admitted_client.local_addr().expect("its address"));
        let mut buffer = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buffer))
            .await
            .expect("the deadline ends the wait");
        assert_eq!(
            read.expect_err("closed").kind(),
            std::io::ErrorKind::TimedOut
        );
        let waited =
            tokio::time::timeout(Duration::from_millis(500), admitted.read(&mut buffer)).await;
        assert!(
            waited.is_err(),
            "an admitted connection stays open and idle"
        );
        // The closed one left its peer's count: two unadmitted connections are accepted again
        // (the admitted one does not count), and a third waits unserved.
        drop(idle);
        let _more = [
            TcpStream::connect(address).await.expect("connect"),
            TcpStream::connect(address).await.expect("connect"),
            TcpStream::connect(address).await.expect("connect"),
        ];
        let _third = incoming.next().await.expect("three").expect("accepted");
        let _fourth = incoming.next().await.expect("four").expect("accepted");
        let waited = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(
            waited.is_err(),
            "past the unauthenticated bound, a connection was served"
        );
        drop((idle_client, admitted_client));
    }
}
