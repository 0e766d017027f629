//! A fleet: sidecar replicas sharing one configuration, each table run by one replica at a
//! time through a lease in the lake's own store (docs/writer.md, "A fleet of writers").
//!
//! Every `lease / 4` a replica reads the others' heartbeats and the tables' leases
//! ([`leases`]), claims, keeps or gives back tables ([`share`]), and writes its heartbeat
//! once all of that went through. A replica whose heartbeat is older than the lease is dead
//! and its tables free; one that completed no round for three quarters of the lease stops
//! its tables itself (a watchdog), before another can take them. The lease spreads the work; it does not guard the data: a replica that stalls past
//! its lease and wakes still meets the checkpoint's claim and bronze's transaction (the
//! fence), which stop it before it writes a batch another replica wrote.
//!
//! A table given back is stopped first (after its batch or wave in flight) and its release
//! written after, so the next holder starts on a table nobody runs; a replica stopped by a
//! signal marks itself leaving and gives back all of its tables that way.

pub mod leases;
pub mod ownership;
pub mod share;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::watch;

use crate::board::{TableState, board};
use crate::error::{Result, WriterError};
use leases::Leases;
use ownership::Ownership;
use share::{View, moves};

/// The `[fleet]` section of a sidecar file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// This replica's name, unique in the fleet (letters, digits, `.`, `_`, `-`; at most
    /// 63): by default the `HOSTNAME` variable (a pod's name).
    #[serde(default)]
    pub replica: Option<String>,
    /// Where the leases are kept (a path or a URL): by default `_fleet` beside the facts
    /// table, on the lake's store.
    #[serde(default)]
    pub leases: Option<String>,
    /// Seconds a replica's heartbeat holds its tables (default 20): a replica killed is
    /// replaced within about this plus a quarter of it.
    #[serde(default = "default_lease_seconds")]
    pub lease_seconds: f64,
    /// How many tables a replica gives back a round when the shares move (default 4).
    #[serde(default = "default_release_per_round")]
    pub release_per_round: usize,
}

fn default_lease_seconds() -> f64 {
    20.0
}

fn default_release_per_round() -> usize {
    4
}

impl FleetConfig {
    /// Checks the section (a name left to `HOSTNAME` is checked when the replica starts,
    /// [`Self::name`]).
    pub fn check(&self) -> Result<()> {
        if !(self.lease_seconds.is_finite() && (1.0..=3600.0).contains(&self.lease_seconds)) {
            return Err(WriterError::invalid(
                "fleet.lease_seconds must be 1 to 3600 seconds",
            ));
        }
        if self.release_per_round == 0 {
            return Err(WriterError::invalid(
                "fleet.release_per_round must be at least 1",
            ));
        }
        match self.replica {
            Some(_) => self.name().map(|_| ()),
            None => Ok(()),
        }
    }

    /// The replica's name, from the file or `HOSTNAME`.
    pub fn name(&self) -> Result<String> {
        let name = match &self.replica {
            Some(name) => name.clone(),
            None => std::env::var("HOSTNAME").map_err(|_| {
                WriterError::invalid(
                    "fleet.replica is not set and neither is HOSTNAME: name this replica",
                )
            })?,
        };
        let valid = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !valid {
            return Err(WriterError::invalid(format!(
                "fleet replica name '{name}' must be 1 to 63 letters, digits, '.', '_' or '-'"
            )));
        }
        Ok(name)
    }

    /// The lease store's location.
    pub fn location(&self, facts: &str) -> String {
        match &self.leases {
            Some(location) => location.clone(),
            None => match facts.trim_end_matches('/').rsplit_once('/') {
                Some((parent, _)) => format!("{parent}/_fleet"),
                None => "_fleet".to_string(),
            },
        }
    }
}

/// This process's id in the fleet: its name and when it started (`<name>@<incarnation>`),
/// so a restarted replica is told from the one before and takes its tables at once.
fn replica_id(name: &str) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    format!("{name}@{millis:013}{:04x}", rand::random::<u16>())
}

/// The fresh heartbeats' replicas, each name's newest incarnation only.
fn alive(ages: &BTreeMap<String, f64>, lease: f64) -> BTreeSet<String> {
    let mut newest: BTreeMap<&str, &str> = Default::default();
    for (id, age) in ages {
        if *age > lease {
            continue;
        }
        let name = id.split_once('@').map_or(id.as_str(), |(name, _)| name);
        // Incarnations sort by start time.
        if newest.get(name).is_none_or(|seen| *seen < id.as_str()) {
            newest.insert(name, id);
        }
    }
    newest.into_values().map(str::to_string).collect()
}

/// Runs this replica's rounds until `stop`, then gives its tables back as their tasks end,
/// renewing its heartbeat meanwhile.
pub async fn run(
    config: FleetConfig,
    facts: String,
    ownership: Arc<Ownership>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let name = config.name()?;
    let id = replica_id(&name);
    let location = config.location(&facts);
    if location.contains("://")
        && !location.starts_with("file://")
        && config.lease_seconds < MIN_OBJECT_STORE_LEASE_SECONDS
    {
        return Err(WriterError::invalid(format!(
            "fleet.lease_seconds must be at least {MIN_OBJECT_STORE_LEASE_SECONDS} on an object \
             store, whose modification times may be whole seconds"
        )));
    }
    let mut leases = Leases::open(&location).await?;
    let lease = Duration::from_secs_f64(config.lease_seconds);
    let round = lease / 4;
    tracing::info!(replica = %id, leases = %leases.location(), lease_seconds = config.lease_seconds,
        tables = ownership.app_ids().len(), "joined the fleet");
    let (renewals, renewed) = watch::channel(None);
    let watchdog = tokio::spawn(watchdog(
        id.clone(),
        Arc::clone(&ownership),
        renewed,
        lease * 3 / 4,
    ));
    let mut fleet = Round {
        id,
        lease,
        release_per_round: config.release_per_round,
        ownership,
        releasing: BTreeSet::new(),
        renewals,
        beaten: None,
        stalled: BTreeMap::new(),
    };
    loop {
        // A failed round is tried again within a second, before the watchdog's deadline.
        let pause = if fleet.timed(&mut leases, false).await {
            round
        } else {
            round.min(Duration::from_secs(1))
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|stopped| *stopped) => break,
        }
    }
    // Every table stops now (the sidecar's stop reached them). Marked as leaving, this
    // replica is shared without while its heartbeat still holds the tables draining; each is
    // given back once its tasks ended.
    if let Err(error) = leases.leaving(&fleet.id).await {
        tracing::warn!(replica = %fleet.id, %error, "could not mark this replica as leaving");
    }
    loop {
        let draining = fleet.ownership.any_running();
        let done = fleet.timed(&mut leases, true).await;
        if done && !draining {
            break;
        }
        if !done && !draining && fleet.ownership.held().is_empty() && fleet.releasing.is_empty() {
            break;
        }
        tokio::time::sleep(round.min(Duration::from_secs(1))).await;
    }
    watchdog.abort();
    if let Err(error) = leases.forget(&fleet.id).await {
        tracing::warn!(replica = %fleet.id, %error, "could not delete this replica's heartbeat; it expires");
    }
    tracing::info!(replica = %fleet.id, "left the fleet, its leases given back");
    Ok(())
}

/// Stops every table of `ownership` (their leases stay until they expire or are claimed
/// back), counted and logged with `why`.
fn let_go_of_everything(ownership: &Ownership, replica: &str, why: &str) {
    let stopped = ownership
        .held()
        .iter()
        .filter(|app_id| ownership.set_held(app_id, false))
        .count();
    if stopped > 0 {
        metrics::counter!("mssql_cdc_writer_fleet_lost_total").increment(stopped as u64);
        tracing::warn!(replica, tables = stopped, why, "stopping every table");
    }
}

/// The shortest lease on an object store: S3 and Azure keep modification times in whole
/// seconds, so a heartbeat may read up to a second older than it is.
const MIN_OBJECT_STORE_LEASE_SECONDS: f64 = 10.0;

/// Stops every table once no round completed for `within` (three quarters of the lease)
/// since its heartbeat began, whatever the rounds wait on: the others take the tables over
/// once the heartbeat is a lease old. A later round claims them again (if nobody took them
/// meanwhile). When the rounds end for good (their task is gone), it stops every table.
async fn watchdog(
    id: String,
    ownership: Arc<Ownership>,
    mut renewed: watch::Receiver<Option<Instant>>,
    within: Duration,
) {
    let let_go = |why: &str| let_go_of_everything(&ownership, &id, why);
    loop {
        let deadline = renewed.borrow_and_update().map(|began| began + within);
        let changed = match deadline {
            Some(deadline) => tokio::select! {
                _ = tokio::time::sleep_until(deadline.into()) => None,
                changed = renewed.changed() => Some(changed),
            },
            None => Some(renewed.changed().await),
        };
        match changed {
            Some(Ok(())) => {}
            Some(Err(_)) => return let_go("the fleet's rounds ended"),
            None => {
                let_go(
                    "no round completed for most of a lease: another replica may take the tables",
                );
                if renewed.changed().await.is_err() {
                    return let_go("the fleet's rounds ended");
                }
            }
        }
    }
}

/// One replica's state between rounds.
struct Round {
    id: String,
    lease: Duration,
    release_per_round: usize,
    ownership: Arc<Ownership>,
    /// Tables let go whose release is written once their tasks ended.
    releasing: BTreeSet<String>,
    /// When each complete round's heartbeat began, for the watchdog.
    renewals: watch::Sender<Option<Instant>>,
    /// When this process last wrote its heartbeat (the end of its last complete round, so
    /// a replica that can write but not list or claim stops holding its tables for the
    /// others), once written.
    beaten: Option<Instant>,
    /// Replicas below the even share, with the count they had and since when, while free
    /// tables wait: one that claims none for two leases is left out of the share, so the
    /// others take the tables it does not.
    stalled: BTreeMap<String, (usize, Instant)>,
}

impl Round {
    /// A round within half a lease, logged and counted when it fails; whether it completed.
    /// `leaving` claims nothing and gives back every table whose tasks ended.
    async fn timed(&mut self, leases: &mut Leases, leaving: bool) -> bool {
        let limit = self.lease / 2;
        let done = match tokio::time::timeout(limit, self.round(leases, leaving)).await {
            Ok(done) => done,
            Err(_) => Err(WriterError::Internal(format!(
                "the lease store did not answer within {limit:?}"
            ))),
        };
        if let Err(error) = &done {
            metrics::counter!("mssql_cdc_writer_fleet_round_failures_total").increment(1);
            tracing::warn!(replica = %self.id, %error, "fleet round failed; tried again in a second");
        }
        done.is_ok()
    }

    /// Writes this replica's heartbeat.
    async fn beat(&mut self, leases: &Leases) -> Result<()> {
        leases.beat(&self.id, self.ownership.held().len()).await?;
        self.beaten = Some(Instant::now());
        Ok(())
    }

    /// Reads the heartbeats, leases and moves; writes the heartbeat once all went through.
    async fn round(&mut self, leases: &mut Leases, leaving: bool) -> Result<()> {
        let began = Instant::now();
        let lease = self.lease.as_secs_f64();
        let forget_after = lease * 10.0;
        let mut heartbeats = match self.beaten {
            Some(beaten) => {
                leases
                    .heartbeats(&self.id, beaten.elapsed(), forget_after)
                    .await?
            }
            None => None,
        };
        // The first round, or one after this replica's heartbeat was forgotten (cut off for
        // ten leases): write one to measure the others against.
        if heartbeats.is_none() {
            self.beat(leases).await?;
            let beaten = self.beaten.map_or(Duration::ZERO, |at| at.elapsed());
            heartbeats = leases.heartbeats(&self.id, beaten, forget_after).await?;
        }
        let Some(heartbeats) = heartbeats else {
            return Err(WriterError::Internal(
                "this replica's heartbeat is not listed right after it was written".into(),
            ));
        };
        let alive = alive(&heartbeats.ages, lease);
        if !alive.contains(&self.id) {
            tracing::warn!(replica = %self.id, "a newer process runs under this replica's name: this one holds no table (name each replica apart)");
            let_go_of_everything(
                &self.ownership,
                &self.id,
                "a newer process runs under this replica's name",
            );
            return Ok(());
        }
        let tables = self.ownership.app_ids();
        let seen = leases.leases(&tables).await?;
        let sharing = self.sharing(&alive, &heartbeats.leaving, &seen);
        let view = View {
            me: self.id.clone(),
            alive: alive.clone(),
            sharing,
            leases: seen.clone(),
        };
        let mut moves = moves(&view, self.release_per_round);
        if leaving {
            moves.claim.clear();
            moves.release = moves
                .held
                .iter()
                .map(|app_id| (app_id.clone(), seen[app_id].epoch + 1))
                .collect();
        }
        // Held by lease but not here (the watchdog stopped it): claimed again by a newer
        // epoch, so of this replica and another that saw it dead, only one runs it.
        let mut claims = moves.claim.clone();
        for app_id in &moves.held {
            let releasing = self.releasing.contains(app_id)
                || moves.release.iter().any(|(table, _)| table == app_id);
            if !releasing && !self.ownership.holds(app_id) {
                claims.push((app_id.clone(), seen[app_id].epoch + 1));
            }
        }
        // Past most of a lease since the heartbeat, the others may count this replica dead:
        // it claims nothing before its next one.
        if self
            .beaten
            .is_none_or(|beaten| beaten.elapsed() > self.lease * 3 / 4)
        {
            claims.clear();
        }
        for (app_id, lease) in &seen {
            let mine = lease.holder.as_deref() == Some(self.id.as_str());
            if !mine && self.ownership.set_held(app_id, false) {
                metrics::counter!("mssql_cdc_writer_fleet_lost_total").increment(1);
                tracing::warn!(replica = %self.id, app_id, holder = ?lease.holder,
                    "lost its lease: stopping the table");
            }
        }
        for (app_id, _) in &moves.release {
            if self.releasing.insert(app_id.clone()) {
                self.ownership.set_held(app_id, false);
            }
        }
        // Give back what was let go and has stopped, where the lease is still this
        // replica's (one another took meanwhile is not this replica's to give).
        let id = self.id.clone();
        self.releasing.retain(|app_id| {
            seen.get(app_id)
                .is_none_or(|lease| lease.holder.as_deref() == Some(id.as_str()))
        });
        let given: Vec<(String, u64)> = self
            .releasing
            .iter()
            .filter(|app_id| !self.ownership.running(app_id))
            .filter_map(|app_id| Some((app_id.clone(), seen.get(app_id)?.epoch + 1)))
            .collect();
        let mut failed = None;
        let created = leases.create_all(&given, None).await;
        for ((app_id, _), result) in given.iter().zip(created) {
            // Not created: another epoch came first (the next round sees whose).
            match result {
                Ok(true) => {
                    metrics::counter!("mssql_cdc_writer_fleet_releases_total").increment(1);
                    tracing::info!(replica = %self.id, app_id, "gave its lease back");
                    self.releasing.remove(app_id);
                }
                Ok(false) => {}
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        let created = leases.create_all(&claims, Some(&self.id)).await;
        for ((app_id, epoch), result) in claims.iter().zip(created) {
            match result {
                Ok(true) => {
                    metrics::counter!("mssql_cdc_writer_fleet_claims_total").increment(1);
                    tracing::info!(replica = %self.id, app_id, epoch, holder_before = ?seen[app_id].holder,
                        "claimed the table");
                    self.ownership.set_held(app_id, true);
                }
                Ok(false) => {}
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if let Some(error) = failed {
            return Err(error);
        }
        self.beat(leases).await?;
        self.renewals.send_replace(Some(began));
        self.show(&alive, &seen);
        Ok(())
    }

    /// The live replicas the tables are shared among: all but those leaving (draining
    /// after a signal) and those that stayed below the even share for two leases since
    /// tables waited (they claim nothing: one of another fleet on this store, or one of an
    /// older file during a rolling change), until they claim.
    fn sharing(
        &mut self,
        alive: &BTreeSet<String>,
        leaving: &BTreeSet<String>,
        seen: &BTreeMap<String, share::Lease>,
    ) -> BTreeSet<String> {
        let mut counts: BTreeMap<&str, usize> = alive.iter().map(|id| (id.as_str(), 0)).collect();
        let mut free = false;
        for lease in seen.values() {
            match lease
                .holder
                .as_deref()
                .filter(|holder| alive.contains(*holder))
            {
                Some(holder) => *counts.entry(holder).or_default() += 1,
                None => free = true,
            }
        }
        let low = seen.len() / alive.len().max(1);
        let now = Instant::now();
        self.stalled.retain(|id, _| alive.contains(id));
        for (id, count) in &counts {
            match self.stalled.get(*id) {
                // Claimed since, or at its share: sharing.
                Some((before, _)) if *count > *before || *count >= low => {
                    self.stalled.remove(*id);
                }
                Some(_) => {}
                // Below its share while tables wait: watched from now on.
                None if free && *count < low => {
                    self.stalled.insert(id.to_string(), (*count, now));
                }
                None => {}
            }
        }
        alive
            .iter()
            .filter(|id| {
                **id == self.id
                    || (!leaving.contains(*id)
                        && self
                            .stalled
                            .get(*id)
                            .is_none_or(|(_, since)| now - *since < self.lease * 2))
            })
            .cloned()
            .collect()
    }

    /// The gauges and the status board after a round.
    fn show(&self, alive: &BTreeSet<String>, seen: &BTreeMap<String, share::Lease>) {
        let held = self.ownership.held();
        metrics::gauge!("mssql_cdc_writer_fleet_tables_held").set(held.len() as f64);
        metrics::gauge!("mssql_cdc_writer_fleet_replicas").set(alive.len() as f64);
        let mut unheld = 0;
        for (app_id, lease) in seen {
            let holder = lease.holder.clone().filter(|holder| alive.contains(holder));
            unheld += usize::from(holder.is_none());
            // A table of this replica's lease the watchdog stopped shows as stopped.
            let own = lease.holder.as_deref() == Some(self.id.as_str());
            if own || self.ownership.holds(app_id) || self.ownership.running(app_id) {
                continue;
            }
            if let Some(table) = self.ownership.table(app_id) {
                board().state(table, TableState::Elsewhere { holder });
            }
        }
        metrics::gauge!("mssql_cdc_writer_fleet_tables_unheld").set(unheld as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_names_newest_fresh_incarnation_is_the_one_alive() {
        let ages = [
            ("a@00000000010000001".to_string(), 1.0),
            ("a@00000000020000001".to_string(), 2.0),
            ("b@00000000010000001".to_string(), 25.0),
            ("c@00000000010000001".to_string(), 3.0),
        ]
        .into_iter()
        .collect();
        let alive = alive(&ages, 20.0);
        let alive: Vec<&str> = alive.iter().map(String::as_str).collect();
        assert_eq!(alive, vec!["a@00000000020000001", "c@00000000010000001"]);
    }

    /// What a test replica is: its tables, its stop and its rounds' task.
    type Replica = (
        Arc<Ownership>,
        watch::Sender<bool>,
        tokio::task::JoinHandle<Result<()>>,
    );

    /// A replica of `tables` on the lease store in `dir`, with a one-second lease.
    fn replica(dir: &std::path::Path, name: &str, tables: &[String]) -> Replica {
        replica_with_lease(dir, name, tables, 1.0)
    }

    /// A replica of `tables` on the lease store in `dir`, with a lease of `seconds`.
    fn replica_with_lease(
        dir: &std::path::Path,
        name: &str,
        tables: &[String],
        seconds: f64,
    ) -> Replica {
        let ownership = Ownership::new(tables.iter().map(|t| (t.as_str(), t.as_str())), false);
        let (stop, stopped) = watch::channel(false);
        let config = FleetConfig {
            replica: Some(name.into()),
            leases: Some(dir.display().to_string()),
            lease_seconds: seconds,
            release_per_round: 1,
        };
        let task = tokio::spawn(run(
            config,
            "unused".into(),
            Arc::clone(&ownership),
            stopped,
        ));
        (ownership, stop, task)
    }

    /// Waits (up to 20 s) until `done` holds; how long that took.
    async fn until(what: &str, done: impl Fn() -> bool) -> Duration {
        let began = Instant::now();
        while !done() {
            assert!(began.elapsed() < Duration::from_secs(20), "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        began.elapsed()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_share_the_tables_hand_them_over_when_one_leaves_or_dies_and_when_one_joins() {
        let dir = tempfile::tempdir().expect("temp");
        let tables: Vec<String> = (0..6).map(|n| format!("t{n}")).collect();
        let (a, stop_a, task_a) = replica(dir.path(), "a", &tables);
        let (b, _stop_b, _task_b) = replica(dir.path(), "b", &tables);
        let split = |a: &Ownership, b: &Ownership| {
            let (a, b) = (a.held(), b.held());
            a.len() + b.len() == 6 && a.iter().all(|table| !b.contains(table))
        };
        until("two replicas split six tables", || {
            split(&a, &b) && a.held().len() == 3
        })
        .await;
        // A replica stopped gives its leases back: the other holds all at once.
        stop_a.send_replace(true);
        task_a.await.expect("task").expect("run");
        let handed = until("b holds every table after a left", || b.held().len() == 6).await;
        assert!(handed < Duration::from_secs(2), "took {handed:?}");
        // A replica that joins gets its share, one table a round.
        let (c, _stop_c, task_c) = replica(dir.path(), "c", &tables);
        until("c gets three tables", || {
            split(&b, &c) && c.held().len() == 3
        })
        .await;
        // A replica that dies (no release) is taken over once its lease expired.
        task_c.abort();
        let _ = task_c.await;
        let taken = until("b takes c's tables over", || b.held().len() == 6).await;
        assert!(
            taken > Duration::from_millis(500) && taken < Duration::from_secs(4),
            "taken over after {taken:?}, the lease being 1 s"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_cut_off_from_its_lease_store_stops_its_tables_before_the_lease_ends() {
        let dir = tempfile::tempdir().expect("temp");
        let store = dir.path().join("leases");
        let tables: Vec<String> = vec!["t0".into(), "t1".into()];
        let (a, _stop, _task) = replica(&store, "a", &tables);
        until("a holds both tables", || a.held().len() == 2).await;
        // The store goes away: no heartbeat can be written.
        let moved = dir.path().join("gone");
        std::fs::rename(&store, &moved).expect("rename");
        std::fs::write(&store, b"not a directory").expect("block");
        let stopped = until("a stops its tables", || a.held().is_empty()).await;
        assert!(
            stopped < Duration::from_secs(1),
            "stopped after {stopped:?}: the others take over after the 1 s lease"
        );
        // Back: it holds them again (nobody took them).
        std::fs::remove_file(&store).expect("unblock");
        std::fs::rename(&moved, &store).expect("rename back");
        until("a holds both again", || a.held().len() == 2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_replica_that_claims_nothing_leaves_its_share_to_the_others() {
        let dir = tempfile::tempdir().expect("temp");
        let tables: Vec<String> = (0..6).map(|n| format!("t{n}")).collect();
        // A replica whose heartbeat lands but that never claims (its rounds fail after it).
        let stuck = Leases::open(&dir.path().display().to_string())
            .await
            .expect("leases");
        let beating = tokio::spawn(async move {
            loop {
                stuck.beat("stuck@1", 0).await.expect("beat");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        let (a, _stop, _task) = replica(dir.path(), "a", &tables);
        until("a holds its even share", || a.held().len() == 3).await;
        let all = until("a holds every table", || a.held().len() == 6).await;
        assert!(
            all > Duration::from_millis(1_500),
            "the other was left out after two leases, not at once: {all:?}"
        );
        // And stays left out: the tables do not flap back to it.
        let steady = Instant::now();
        while steady.elapsed() < Duration::from_secs(4) {
            assert_eq!(
                a.held().len(),
                6,
                "a table went back to a replica that claims none"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        beating.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_stopped_hands_its_tables_over_in_a_round_not_a_lease() {
        let dir = tempfile::tempdir().expect("temp");
        let tables: Vec<String> = (0..4).map(|n| format!("t{n}")).collect();
        // An 8 s lease: rounds every 2 s.
        let (a, stop_a, task_a) = replica_with_lease(dir.path(), "a", &tables, 8.0);
        let (b, _stop_b, _task_b) = replica_with_lease(dir.path(), "b", &tables, 8.0);
        until("two replicas split four tables", || {
            a.held().len() == 2 && b.held().len() == 2
        })
        .await;
        stop_a.send_replace(true);
        let handed = until("b holds every table after a stopped", || {
            b.held().len() == 4
        })
        .await;
        assert!(
            handed < Duration::from_secs(6),
            "handed over after {handed:?}, the lease being 8 s"
        );
        task_a.await.expect("task").expect("run");
    }

    #[test]
    fn the_section_is_checked() {
        let config = |replica: &str, lease: f64| FleetConfig {
            replica: Some(replica.into()),
            leases: None,
            lease_seconds: lease,
            release_per_round: 4,
        };
        assert!(config("writer-0", 20.0).check().is_ok());
        assert!(config("writer@0", 20.0).check().is_err());
        assert!(config("", 20.0).check().is_err());
        assert!(config("writer-0", 0.1).check().is_err());
        assert_eq!(
            config("w", 20.0).location("s3://bucket/lake/facts"),
            "s3://bucket/lake/_fleet"
        );
    }
}
