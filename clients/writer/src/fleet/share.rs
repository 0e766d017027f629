//! Which tables a replica claims, keeps and gives back in one round: a pure function of what
//! the lease store showed, so every rule here is tested without a store.
//!
//! Tables spread within one of even (`total / alive`, rounded down or up): a replica below
//! the even share claims free tables, one above gives back a few per round (so tables move
//! back gradually when a replica joins), and a table's rendezvous ranking (the highest hash
//! of table and replica name wins) makes replicas prefer different free tables and give back
//! the tables another prefers, so two replicas rarely race for one claim.

use std::collections::{BTreeMap, BTreeSet};

/// A table's lease as the store shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The newest epoch (0: never leased).
    pub epoch: u64,
    /// Its holder's replica id; `None` when given back or never leased.
    pub holder: Option<String>,
}

/// What one replica saw in one round.
#[derive(Clone, Debug)]
pub struct View {
    /// This replica's id.
    pub me: String,
    /// The replica ids whose heartbeat is fresh, this one included: their leases hold.
    pub alive: BTreeSet<String>,
    /// Those of them the tables are shared among (a live replica that claims nothing is
    /// left out), this one included.
    pub sharing: BTreeSet<String>,
    /// Every table of the shared configuration (by app id) and its lease.
    pub leases: BTreeMap<String, Lease>,
}

/// What this replica does in the round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Moves {
    /// The tables it holds now (its own leases).
    pub held: BTreeSet<String>,
    /// Free tables to claim, with the epoch each claim creates.
    pub claim: Vec<(String, u64)>,
    /// Held tables to give back, with the epoch each release creates.
    pub release: Vec<(String, u64)>,
}

/// The round's moves; at most `release_per_round` tables are given back.
pub fn moves(view: &View, release_per_round: usize) -> Moves {
    let sharing = view.sharing.len().max(1);
    // The tables of live replicas left out of the sharing stay theirs, outside the shares.
    let kept = view
        .leases
        .values()
        .filter_map(|lease| lease.holder.as_deref())
        .filter(|holder| view.alive.contains(*holder) && !view.sharing.contains(*holder))
        .count();
    let total = view.leases.len() - kept;
    let (low, high) = (total / sharing, total.div_ceil(sharing));
    let mut counts: BTreeMap<&str, usize> =
        view.sharing.iter().map(|id| (id.as_str(), 0)).collect();
    let mut held = BTreeSet::new();
    let mut free = Vec::new();
    for (table, lease) in &view.leases {
        match lease.holder.as_deref() {
            Some(holder) if view.alive.contains(holder) => {
                if let Some(count) = counts.get_mut(holder) {
                    *count += 1;
                }
                if holder == view.me {
                    held.insert(table.clone());
                }
            }
            _ => free.push((table, lease.epoch)),
        }
    }
    let starved = |except: &str| {
        counts
            .iter()
            .any(|(id, count)| *id != except && *count < low)
    };
    let mine = held.len();
    let mut moves = Moves {
        held,
        ..Moves::default()
    };
    // Claim up to the low share, or up to the high one while no other replica is below low
    // (it needs the free tables more).
    let wanted = if mine < low {
        low - mine
    } else if mine < high && !starved(&view.me) {
        high - mine
    } else {
        0
    };
    free.sort_by_key(|(table, _)| std::cmp::Reverse(preference(view, table)));
    moves.claim = free
        .into_iter()
        .take(wanted)
        .map(|(table, epoch)| (table.clone(), epoch + 1))
        .collect();
    // Give back above high, or above low while another replica is below low.
    let surplus = if mine > high {
        mine - high
    } else if mine > low && starved(&view.me) {
        mine - low
    } else {
        0
    };
    if surplus > 0 {
        let mut given: Vec<&String> = moves.held.iter().collect();
        given.sort_by_key(|table| preference(view, table));
        moves.release = given
            .into_iter()
            .take(surplus.min(release_per_round))
            .map(|table| (table.clone(), view.leases[table].epoch + 1))
            .collect();
    }
    moves
}

/// How much this replica prefers `table`: first whether its rendezvous score beats every
/// other live replica's, then the score itself.
fn preference(view: &View, table: &str) -> (bool, u64) {
    let mine = score(table, &view.me);
    let first = view
        .sharing
        .iter()
        .filter(|id| **id != view.me)
        .all(|id| score(table, id) < mine);
    (first, mine)
}

/// The rendezvous score of `table` on the replica `id`, from its name only (the part before
/// `@`), so a restarted replica prefers the tables it had.
fn score(table: &str, id: &str) -> u64 {
    let name = id.split_once('@').map_or(id, |(name, _)| name);
    // XXH3 of a fixed seed, so every release of the writer ranks alike.
    let mut key = Vec::with_capacity(table.len() + name.len() + 1);
    key.extend_from_slice(table.as_bytes());
    key.push(0);
    key.extend_from_slice(name.as_bytes());
    twox_hash::XxHash3_128::oneshot(&key) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(me: &str, alive: &[&str], leases: &[(&str, u64, Option<&str>)]) -> View {
        View {
            me: me.to_string(),
            alive: alive.iter().map(|id| id.to_string()).collect(),
            sharing: alive.iter().map(|id| id.to_string()).collect(),
            leases: leases
                .iter()
                .map(|(table, epoch, holder)| {
                    (
                        table.to_string(),
                        Lease {
                            epoch: *epoch,
                            holder: holder.map(str::to_string),
                        },
                    )
                })
                .collect(),
        }
    }

    fn view_of(me: &str, alive: &[&str], leases: &BTreeMap<String, Lease>) -> View {
        View {
            me: me.to_string(),
            alive: alive.iter().map(|id| id.to_string()).collect(),
            sharing: alive.iter().map(|id| id.to_string()).collect(),
            leases: leases.clone(),
        }
    }

    /// Runs rounds of every live replica in turn, each seeing the others' moves, until
    /// nothing moves; the holders by table.
    fn settle(alive: &[&str], leases: &mut BTreeMap<String, Lease>) -> usize {
        for round in 0..100 {
            let mut moved = false;
            for me in alive {
                let moves = moves(&view_of(me, alive, leases), 2);
                for (table, epoch) in moves.claim {
                    leases.insert(
                        table,
                        Lease {
                            epoch,
                            holder: Some(me.to_string()),
                        },
                    );
                    moved = true;
                }
                for (table, epoch) in moves.release {
                    leases.insert(
                        table,
                        Lease {
                            epoch,
                            holder: None,
                        },
                    );
                    moved = true;
                }
            }
            if !moved {
                return round;
            }
        }
        panic!("the shares never settled: {leases:?}");
    }

    /// `tables` tables `t0`, `t1`, ... no replica ever leased.
    fn never_leased(tables: usize) -> BTreeMap<String, Lease> {
        (0..tables)
            .map(|n| {
                let lease = Lease {
                    epoch: 0,
                    holder: None,
                };
                (format!("t{n}"), lease)
            })
            .collect()
    }

    fn counts(leases: &BTreeMap<String, Lease>) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for lease in leases.values() {
            *counts
                .entry(lease.holder.clone().unwrap_or_default())
                .or_default() += 1;
        }
        counts
    }

    #[test]
    fn free_tables_spread_evenly_and_every_table_is_held() {
        let mut leases = never_leased(10);
        settle(&["a@1", "b@1", "c@1"], &mut leases);
        let counts = counts(&leases);
        assert_eq!(counts.get(""), None, "every table is held: {counts:?}");
        let mut shares: Vec<usize> = counts.values().copied().collect();
        shares.sort_unstable();
        assert_eq!(shares, vec![3, 3, 4], "{counts:?}");
    }

    #[test]
    fn a_dead_replicas_tables_are_claimed_and_a_joining_one_gets_its_share_gradually() {
        let mut leases = never_leased(12);
        settle(&["a@1", "b@1", "c@1"], &mut leases);
        // c dies: a and b take its tables over.
        settle(&["a@1", "b@1"], &mut leases);
        let counts_after_death = counts(&leases);
        assert_eq!(
            counts_after_death.get("a@1"),
            Some(&6),
            "{counts_after_death:?}"
        );
        assert_eq!(
            counts_after_death.get("b@1"),
            Some(&6),
            "{counts_after_death:?}"
        );
        // c comes back as a new incarnation: two tables a round move to it.
        let first = moves(&view_of("a@1", &["a@1", "b@1", "c@2"], &leases), 1);
        assert_eq!(first.release.len(), 1, "one table a round: {first:?}");
        settle(&["a@1", "b@1", "c@2"], &mut leases);
        let counts = counts(&leases);
        assert_eq!(counts.get("c@2"), Some(&4), "{counts:?}");
        assert_eq!(counts.get("a@1"), Some(&4), "{counts:?}");
    }

    #[test]
    fn a_claim_creates_the_next_epoch_and_a_live_holders_table_is_left_alone() {
        let seen = view(
            "a@1",
            &["a@1", "b@1"],
            &[
                ("t1", 4, Some("b@1")),
                ("t2", 7, Some("gone@1")),
                ("t3", 2, None),
                ("t4", 0, None),
            ],
        );
        let moves = moves(&seen, 1);
        assert!(moves.held.is_empty());
        assert_eq!(moves.claim.len(), 2, "up to the even share: {moves:?}");
        for (table, epoch) in &moves.claim {
            let before = seen.leases[table].epoch;
            assert_ne!(table, "t1", "a live replica's table");
            assert_eq!(*epoch, before + 1);
        }
        assert!(moves.release.is_empty());
    }

    #[test]
    fn replicas_prefer_different_free_tables() {
        let tables: Vec<(String, u64, Option<&str>)> =
            (0..40).map(|n| (format!("t{n}"), 0, None)).collect();
        let tables: Vec<(&str, u64, Option<&str>)> = tables
            .iter()
            .map(|(t, e, h)| (t.as_str(), *e, *h))
            .collect();
        let alive = ["a@1", "b@1"];
        let a = moves(&view("a@1", &alive, &tables), 1);
        let b = moves(&view("b@1", &alive, &tables), 1);
        let a: BTreeSet<_> = a.claim.into_iter().map(|(t, _)| t).collect();
        let b: BTreeSet<_> = b.claim.into_iter().map(|(t, _)| t).collect();
        assert_eq!(a.len(), 20);
        // Each claims the tables it wins first: they meet only where one won more than
        // its share.
        let wins = (0..40)
            .filter(|n| score(&format!("t{n}"), "a") > score(&format!("t{n}"), "b"))
            .count();
        let overlap = a.intersection(&b).count();
        assert!(
            overlap <= wins.abs_diff(20),
            "{overlap} tables claimed by both, a winning {wins} of 40"
        );
    }
}
