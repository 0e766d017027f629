//! How the binaries are asked to stop: Ctrl-C or SIGTERM (what `docker stop` and Kubernetes
//! send). Both finish the work in flight (the server its calls, the writer its batch) and
//! exit cleanly, so a stop is never a crash.

use std::future::Future;

/// Catches Ctrl-C and SIGTERM from this call on (registered now, not when the future is
/// first polled: a stop that arrives while a spawned waiter has yet to run is caught too,
/// instead of ending the process as the default handling would) and resolves at the first.
/// Call it within a Tokio runtime.
pub fn shutdown() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt()).ok();
        let terminate = signal(SignalKind::terminate()).ok();
        async fn received(signal: Option<Signal>) {
            match signal {
                Some(mut signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        async move {
            tokio::select! {
                () = received(interrupt) => {},
                () = received(terminate) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
