//! How the binaries are asked to stop: Ctrl-C or SIGTERM (what `docker stop` and Kubernetes
//! send). Both finish the work in flight (the server its calls, the writer its batch) and
//! exit cleanly, so a stop is never a crash.

/// Resolves at the first Ctrl-C or SIGTERM.
pub async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {},
        () = terminate => {},
    }
}
