//! Events of network peers (refused logins, refused connections) logged at most once a
//! minute per peer (an address, or an IPv6 /64), with how many went unlogged since: a flood
//! is a line a minute, and the memory it can take is bounded.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often one peer's events are logged at most.
pub const LOG_INTERVAL: Duration = Duration::from_secs(60);
/// Peers remembered at once: past it, peers without an event within the interval are forgotten,
/// and a new peer while it is still full is counted but not logged (the memory a flood
/// from many addresses can take is bounded).
const REMEMBERED_PEERS: usize = 4096;

/// The events of each peer since its last logged one.
#[derive(Debug, Default)]
pub struct PeerThrottle {
    peers: Mutex<HashMap<Option<IpAddr>, Peer>>,
}

#[derive(Debug)]
struct Peer {
    logged_at: Instant,
    unlogged: u64,
}

impl PeerThrottle {
    /// Whether an event of `address` at `now` is logged, with how many of its events went
    /// unlogged since the last logged one.
    pub fn due(&self, address: Option<IpAddr>, now: Instant) -> Option<u64> {
        // One host is usually given a whole IPv6 /64: its addresses are one peer.
        let address = address.map(crate::serving::peer_of);
        let mut peers = self
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !peers.contains_key(&address) && peers.len() >= REMEMBERED_PEERS {
            peers.retain(|_, peer| now.duration_since(peer.logged_at) < LOG_INTERVAL);
            if peers.len() >= REMEMBERED_PEERS {
                return None;
            }
        }
        match peers.get_mut(&address) {
            Some(peer) if now.duration_since(peer.logged_at) < LOG_INTERVAL => {
                peer.unlogged += 1;
                None
            }
            Some(peer) => {
                let suppressed = peer.unlogged;
                *peer = Peer {
                    logged_at: now,
                    unlogged: 0,
                };
                Some(suppressed)
            }
            None => {
                peers.insert(
                    address,
                    Peer {
                        logged_at: now,
                        unlogged: 0,
                    },
                );
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_is_logged_once_a_minute_with_what_it_tried_since() {
        let log = PeerThrottle::default();
        let start = Instant::now();
        let (one, two) = (
            Some(IpAddr::from([10, 0, 0, 1])),
            Some(IpAddr::from([10, 0, 0, 2])),
        );
        assert_eq!(log.due(one, start), Some(0));
        for second in 1..=30 {
            assert_eq!(log.due(one, start + Duration::from_secs(second)), None);
        }
        // Another peer is logged on its own.
        assert_eq!(log.due(two, start + Duration::from_secs(5)), Some(0));
        assert_eq!(log.due(one, start + LOG_INTERVAL), Some(30));
        assert_eq!(
            log.due(one, start + LOG_INTERVAL + Duration::from_secs(1)),
            None
        );
    }

    #[test]
    fn the_addresses_of_one_ipv6_64_are_one_peer() {
        let log = PeerThrottle::default();
        let start = Instant::now();
        let address = |text: &str| Some(text.parse::<IpAddr>().expect("an address"));
        assert_eq!(log.due(address("2001:db8:0:1::1"), start), Some(0));
        assert_eq!(log.due(address("2001:db8:0:1:ffff::2"), start), None);
        assert_eq!(log.due(address("2001:db8:0:2::1"), start), Some(0));
    }

    #[test]
    fn a_flood_from_many_addresses_takes_bounded_memory() {
        let log = PeerThrottle::default();
        let start = Instant::now();
        for n in 0..(REMEMBERED_PEERS as u32 + 100) {
            let address = Some(IpAddr::from(n.to_be_bytes()));
            let logged = log.due(address, start).is_some();
            assert_eq!(logged, (n as usize) < REMEMBERED_PEERS, "{n}");
        }
        assert_eq!(log.peers.lock().expect("lock").len(), REMEMBERED_PEERS);
        // A minute on, the old peers are forgotten to make room.
        let later = start + LOG_INTERVAL;
        assert_eq!(log.due(Some(IpAddr::from([192, 0, 2, 1])), later), Some(0));
        assert_eq!(log.peers.lock().expect("lock").len(), 1);
    }
}
