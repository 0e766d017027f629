//! gRPC health whose `Watch` streams are bounded in number.
//!
//! Health answers without credentials (orchestrators' probes carry none), so anyone who
//! reaches the port may call it. `Check` is one short answer; `Watch` is a stream that lasts
//! as long as its caller keeps it open, so without a bound a peer could hold any number of
//! them. At most [`MAX_WATCHERS`] are open at once; one more is refused with
//! `RESOURCE_EXHAUSTED` (a client falls back to `Check`, as probes use anyway).

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

/// Most `Watch` streams open at once, from everyone.
pub const MAX_WATCHERS: usize = 256;

/// The health service with its reporter, as `tonic_health::server::health_reporter` makes
/// them, with `Watch` bounded.
pub fn health_reporter() -> (HealthReporter, HealthServer<BoundedHealth>) {
    let reporter = HealthReporter::new();
    let service = BoundedHealth::of(&reporter);
    (reporter, HealthServer::new(service))
}

/// [`HealthService`] with at most [`MAX_WATCHERS`] `Watch` streams open.
#[derive(Debug)]
pub struct BoundedHealth {
    inner: HealthService,
    watchers: Arc<Semaphore>,
}

impl BoundedHealth {
    fn of(reporter: &HealthReporter) -> Self {
        BoundedHealth {
            inner: HealthService::from_health_reporter(reporter.clone()),
            watchers: Arc::new(Semaphore::new(MAX_WATCHERS)),
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
        let permit = Arc::clone(&self.watchers)
            .try_acquire_owned()
            .map_err(|_| {
                Status::resource_exhausted(format!(
                    "{MAX_WATCHERS} health watches are open already; use Check"
                ))
            })?;
        let statuses = self.inner.watch(request).await?.into_inner();
        // The place is given back when the stream is dropped (its caller went away).
        let statuses = statuses.map(move |status| {
            let _held = &permit;
            status
        });
        Ok(Response::new(Box::pin(statuses)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn watches_past_the_bound_are_refused_and_a_closed_one_frees_its_place() {
        let reporter = HealthReporter::new();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let service = BoundedHealth::of(&reporter);
        let watch = || {
            service.watch(Request::new(HealthCheckRequest {
                service: String::new(),
            }))
        };
        let mut open = Vec::new();
        for _ in 0..MAX_WATCHERS {
            open.push(watch().await.expect("within the bound").into_inner());
        }
        let Err(refused) = watch().await else {
            panic!("one watch past the bound was let through");
        };
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        let first = open[0].next().await.expect("a status").expect("serving");
        assert_eq!(first.status, tonic_health::ServingStatus::Serving as i32);
        drop(open.pop());
        watch().await.expect("a place was given back");
        let answer = service
            .check(Request::new(HealthCheckRequest {
                service: String::new(),
            }))
            .await
            .expect("check is not bounded");
        assert_eq!(
            answer.into_inner().status,
            tonic_health::ServingStatus::Serving as i32
        );
    }
}
