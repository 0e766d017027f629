//! Which of the sidecar's tables this process runs now, and the hand-over between the fleet
//! round that decides it and the table's tasks that obey it.
//!
//! Every table has two flags: `held` (the fleet's decision: run it) and `running` (its tasks
//! run). A table's tasks start when it is held and are stopped, after their batch or wave in
//! flight, once it is not; the fleet gives a lease back only once `running` is false. Without
//! a fleet every table is held for good.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

/// The tables of one process and whether each is held and running.
pub struct Ownership {
    tables: BTreeMap<String, Flags>,
}

struct Flags {
    /// The source table, as the status board names it.
    table: String,
    held: watch::Sender<bool>,
    running: watch::Sender<bool>,
}

impl Ownership {
    /// The tables of `entries` (app id, source table), each held when `held`.
    pub fn new<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>, held: bool) -> Arc<Self> {
        Arc::new(Ownership {
            tables: entries
                .into_iter()
                .map(|(app_id, table)| {
                    (
                        app_id.to_string(),
                        Flags {
                            table: table.to_string(),
                            held: watch::channel(held).0,
                            running: watch::channel(false).0,
                        },
                    )
                })
                .collect(),
        })
    }

    /// The app ids, in order.
    pub fn app_ids(&self) -> Vec<String> {
        self.tables.keys().cloned().collect()
    }

    /// The source table of `app_id`.
    pub fn table(&self, app_id: &str) -> Option<&str> {
        self.tables.get(app_id).map(|flags| flags.table.as_str())
    }

    /// Whether `app_id` is held.
    pub fn holds(&self, app_id: &str) -> bool {
        self.tables
            .get(app_id)
            .is_some_and(|flags| *flags.held.borrow())
    }

    /// Whether this process keeps the tables every entry shares (facts, control, the
    /// reconcile report): the holder of the first app id, so one replica of a fleet
    /// maintains them.
    pub fn holds_shared(&self) -> bool {
        self.tables
            .keys()
            .next()
            .is_some_and(|first| self.holds(first))
    }

    /// The held app ids.
    pub fn held(&self) -> Vec<String> {
        self.tables
            .iter()
            .filter(|(_, flags)| *flags.held.borrow())
            .map(|(app_id, _)| app_id.clone())
            .collect()
    }

    /// Holds `app_id`, or lets it go; whether that changed anything.
    pub fn set_held(&self, app_id: &str, held: bool) -> bool {
        self.tables.get(app_id).is_some_and(|flags| {
            flags
                .held
                .send_if_modified(|now| std::mem::replace(now, held) != held)
        })
    }

    /// Whether `app_id`'s tasks run.
    pub fn running(&self, app_id: &str) -> bool {
        self.tables
            .get(app_id)
            .is_some_and(|flags| *flags.running.borrow())
    }

    /// Whether any table's tasks run.
    pub fn any_running(&self) -> bool {
        self.tables.values().any(|flags| *flags.running.borrow())
    }

    /// Waits until no table's tasks run.
    pub async fn all_stopped(&self) {
        for flags in self.tables.values() {
            let mut running = flags.running.subscribe();
            let _ = running.wait_for(|running| !*running).await;
        }
    }

    /// Runs `app_id`'s tasks (`run`, given a stop that turns true when the table is let go
    /// or `stop` turns true, spawned as a task of its own) each time the table is held, until
    /// `stop`. A run that panics counts as ended, so its lease can be given back.
    pub async fn while_held<F, R>(
        self: Arc<Self>,
        app_id: String,
        stop: watch::Receiver<bool>,
        run: R,
    ) where
        R: Fn(watch::Receiver<bool>) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        let Some(flags) = self.tables.get(&app_id) else {
            return;
        };
        loop {
            let mut held = flags.held.subscribe();
            let mut stopping = stop.clone();
            tokio::select! {
                _ = held.wait_for(|held| *held) => {}
                _ = stopping.wait_for(|stopped| *stopped) => return,
            }
            if *stop.borrow() {
                return;
            }
            let (table_stop, table_stopped) = watch::channel(false);
            flags.running.send_replace(true);
            let mut tasks = tokio::spawn(run(table_stopped));
            let ended = tokio::select! {
                ended = &mut tasks => Some(ended),
                _ = held.wait_for(|held| !*held) => None,
                _ = stopping.wait_for(|stopped| *stopped) => None,
            };
            let ended = match ended {
                Some(ended) => ended,
                None => {
                    // The tasks end on their stop, after their work in flight.
                    let _ = table_stop.send(true);
                    tasks.await
                }
            };
            if let Err(error) = ended {
                tracing::error!(app_id, %error, "the table's tasks ended abnormally; started again in a second");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            flags.running.send_replace(false);
            if *stop.borrow() {
                return;
            }
        }
    }
}
