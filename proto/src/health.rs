//! gRPC health whose `Watch` streams are bounded in number and end at shutdown.
//!
//! Health answers without credentials (orchestrators' probes carry none), so anyone who
//! reaches the port may call it. `Check` is one short answer to a request of at most
//! [`MAX_REQUEST_BYTES`]; `Watch` is a stream that lasts as long as its caller keeps it
//! open, so at most [`MAX_WATCHERS_PER_PEER`] are open from one peer (an address, or an IPv6
//! /64) and [`MAX_WATCHERS`] from everyone; one more is refused with `RESOURCE_EXHAUSTED` (a
//! client falls back to `Check`, as probes use anyway). Every `Watch` ends when the server
//! begins its shutdown, which would otherwise wait for them.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

/// Most `Watch` streams open at once, from everyone.
pub const MAX_WATCHERS: usize = 256;
/// Most `Watch` streams open at once from one peer.
pub const MAX_WATCHERS_PER_PEER: usize = 8;
/// Largest health request read: a service name.
pub const MAX_REQUEST_BYTES: usize = 1024;

/// The health service with its reporter, as `tonic_health::server::health_reporter` makes
/// them, with `Watch` bounded and ended once `closing` turns true.
pub fn health_reporter(
    closing: watch::Receiver<bool>,
) -> (HealthReporter, HealthServer<BoundedHealth>) {
    let reporter = HealthReporter::new();
    let service = BoundedHealth::of(&reporter, closing);
    let server = HealthServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
    (reporter, server)
}

/// [`HealthService`] with its `Watch` streams bounded.
#[derive(Debug)]
pub struct BoundedHealth {
    inner: HealthService,
    watchers: Arc<Semaphore>,
    by_peer: Arc<Mutex<HashMap<IpAddr, usize>>>,
    closing: watch::Receiver<bool>,
}

impl BoundedHealth {
    fn of(reporter: &HealthReporter, closing: watch::Receiver<bool>) -> Self {
        BoundedHealth {
            inner: HealthService::from_health_reporter(reporter.clone()),
            watchers: Arc::new(Semaphore::new(MAX_WATCHERS)),
            by_peer: Arc::default(),
            closing,
        }
    }

    /// A place for one more `Watch` of `peer`, or the refusal.
    fn place(&self, peer: Option<IpAddr>) -> Result<WatchPlace, Status> {
        let refused = || {
            Status::resource_exhausted(format!(
                "as many health watches are open as allowed ({MAX_WATCHERS_PER_PEER} a peer, \
                 {MAX_WATCHERS} in all); use Check"
            ))
        };
        let permit = Arc::clone(&self.watchers)
            .try_acquire_owned()
            .map_err(|_| refused())?;
        let peer = peer.map(crate::serving::peer_of);
        if let Some(peer) = peer {
            let mut by_peer = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
            let count = by_peer.entry(peer).or_insert(0);
            if *count >= MAX_WATCHERS_PER_PEER {
                return Err(refused());
            }
            *count += 1;
        }
        Ok(WatchPlace {
            _permit: permit,
            peer,
            by_peer: Arc::clone(&self.by_peer),
        })
    }
}

/// A `Watch` stream's place, given back when the stream is dropped.
struct WatchPlace {
    _permit: OwnedSemaphorePermit,
    peer: Option<IpAddr>,
    by_peer: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for WatchPlace {
    fn drop(&mut self) {
        let Some(peer) = self.peer else {
            return;
        };
        let mut by_peer = self.by_peer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = by_peer.get_mut(&peer) {
            *count -= 1;
            if *count == 0 {
                by_peer.remove(&peer);
            }
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for BoundedHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let place = self.place(request.remote_addr().map(|address| address.ip()))?;
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut closing = self.closing.clone();
        let closed = async move {
            let _ = closing.wait_for(|closing| *closing).await;
        };
        let statuses = statuses.take_until(closed).map(move |status| {
            let _held = &place;
            status
        });
        Ok(Response::new(Box::pin(statuses)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch_from(peer: &str) -> Request<HealthCheckRequest> {
        let mut request = Request::new(HealthCheckRequest {
            service: String::new(),
        });
        let address: std::net::SocketAddr = peer.parse().expect("an address");
        request
            .extensions_mut()
            .insert(tonic::transport::server::TcpConnectInfo {
                local_addr: None,
                remote_addr: Some(address),
            });
        request
    }

    #[tokio::test]
    async fn watches_past_the_bounds_are_refused_a_closed_one_frees_its_place_and_shutdown_ends_them()
     {
        let reporter = HealthReporter::new();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let (closing, closed) = watch::channel(false);
        let service = BoundedHealth::of(&reporter, closed);
        let mut open = Vec::new();
        for _ in 0..MAX_WATCHERS_PER_PEER {
            let watched = service.watch(watch_from("192.0.2.1:1000")).await;
            open.push(watched.expect("within the peer's bound").into_inner());
        }
        let Err(refused) = service.watch(watch_from("192.0.2.1:1001")).await else {
            panic!("a watch past the peer's bound was let through");
        };
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        let first = open[0].next().await.expect("a status").expect("serving");
        assert_eq!(first.status, tonic_health::ServingStatus::Serving as i32);
        drop(open.pop());
        let again = service.watch(watch_from("192.0.2.1:1002")).await;
        open.push(again.expect("a place was given back").into_inner());
        // Others have places of their own, up to the total.
        let mut peer = 0u32;
        while open.len() < MAX_WATCHERS {
            let address = format!("198.51.{}.{}:1", peer / 8 / 256, peer / 8 % 256);
            peer += 1;
            let watched = service.watch(watch_from(&address)).await;
            open.push(watched.expect("within the total").into_inner());
        }
        let Err(refused) = service.watch(watch_from("203.0.113.9:1")).await else {
            panic!("a watch past the total was let through");
        };
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        let answer = service
            .check(watch_from("203.0.113.9:2"))
            .await
            .expect("check is not bounded");
        assert_eq!(
            answer.into_inner().status,
            tonic_health::ServingStatus::Serving as i32
        );
        // Shutdown ends every watch.
        closing.send(true).expect("watches listen");
        let last = open.last_mut().expect("open");
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while last.next().await.is_some() {}
        });
        assert!(ended.await.is_ok(), "a watch outlived the shutdown");
    }
}
