//! Authentication failures, logged at INFO with their peer at most once a minute per peer
//! address ([`PeerThrottle`]), and counted (`mssql_cdc_flight_auth_failures_total`): a flood
//! of guessed tokens is a line a minute in the log, not a line a guess, and an operator still
//! sees who tries.

use std::net::SocketAddr;
use std::time::Instant;

use mssql_cdc_proto::throttle::PeerThrottle;

/// The refusals of each peer since its last logged one.
#[derive(Debug, Default)]
pub struct RefusalLog {
    throttle: PeerThrottle,
}

impl RefusalLog {
    /// Records a refusal of `peer` for `reason`; logs it unless one of the same peer was
    /// logged within a minute.
    pub fn refused(&self, peer: Option<SocketAddr>, reason: &str) {
        metrics::counter!("mssql_cdc_flight_auth_failures_total").increment(1);
        let address = peer.map(|peer| peer.ip());
        if let Some(suppressed) = self.throttle.due(address, Instant::now()) {
            tracing::info!(peer = ?address, reason, suppressed,
                "authentication refused (logged at most once a minute per peer; suppressed counts the refusals since)");
        }
    }
}
