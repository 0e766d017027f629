//! The operations of a schedule, drawn at random from a seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::common::ColumnSelection;

/// The tables of the model: dbo.orders takes most commits, dbo.customers few, and
/// dbo.accounts some; its snapshots are cut on its composite, case-insensitive unique index
/// (region, code), keyset bounds instead of integer ranges, and its full snapshots read in
/// two keyset partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum Table {
    Busy,
    Quiet,
    Keyed,
}

impl Table {
    pub(crate) const ALL: [Table; 3] = [Table::Busy, Table::Quiet, Table::Keyed];

    pub(crate) fn source(self) -> &'static str {
        match self {
            Table::Busy => "dbo.orders",
            Table::Quiet => "dbo.customers",
            Table::Keyed => "dbo.accounts",
        }
    }

    /// The app id, and the name in bronze_<name>, silver_<name>, checkpoint_<name>.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Table::Busy => "orders",
            Table::Quiet => "customers",
            Table::Keyed => "accounts",
        }
    }

    /// The key silver and history merge on, an integer the checks compare rows by
    /// (dbo.accounts' `id`; its snapshots are cut on the unique index instead).
    pub(crate) fn key(self) -> &'static str {
        match self {
            Table::Busy => "order_id",
            Table::Quiet => "customer_id",
            Table::Keyed => "id",
        }
    }

    /// Source read streams of its full snapshots (`partitions`): dbo.accounts' cut into two
    /// keyset ranges of its unique index.
    pub(crate) fn partitions(self) -> u32 {
        match self {
            Table::Busy | Table::Quiet => 1,
            Table::Keyed => 2,
        }
    }

    /// The captured columns its stream leaves out (`except_columns`): the quiet table's
    /// e-mail never leaves the server, so no table of the lake may hold it.
    pub(crate) fn except_columns(self) -> &'static [&'static str] {
        match self {
            Table::Busy => &[],
            Table::Quiet => &["email"],
            Table::Keyed => &[],
        }
    }

    /// The columns the world's servers serve masked (their masks file), and how: the busy
    /// table's note hashed and its discount rate nulled, the quiet table's external id cut to
    /// 8 characters. No table of the lake may hold their clear values.
    pub(crate) fn masked_columns(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Table::Busy => &[("note", "hash"), ("discount_rate", "null")],
            Table::Quiet => &[("external_id", "truncate(8)")],
            Table::Keyed => &[],
        }
    }

    /// A column an operator leaves out of its stream and takes back in (`Op::Reselect`):
    /// once it was, silver's copy of it is unchecked (stale until a re-snapshot).
    pub(crate) fn toggled_column(self) -> &'static str {
        match self {
            Table::Busy => "quantity",
            Table::Quiet => "segment",
            Table::Keyed => "balance",
        }
    }

    /// Its stream's column selection, with its toggled column left out too when `narrowed`.
    pub(crate) fn selection(self, narrowed: bool) -> ColumnSelection {
        let mut names: Vec<String> = self
            .except_columns()
            .iter()
            .map(|name| name.to_string())
            .collect();
        if narrowed {
            names.push(self.toggled_column().into());
        }
        match names.is_empty() {
            true => ColumnSelection::All,
            false => ColumnSelection::Except(names),
        }
    }

    /// The column whose changes open a version of its history (`track_history_columns`):
    /// the quiet table's is a bit, so half its updates change the current version in place.
    pub(crate) fn tracked_history_column(self) -> &'static str {
        match self {
            Table::Busy => "customer_id",
            Table::Quiet => "is_active",
            Table::Keyed => "note",
        }
    }

    /// A text column no row holds NULL in: where another engine changes a value.
    pub(crate) fn text_column(self) -> &'static str {
        match self {
            Table::Busy => "status",
            Table::Quiet => "name",
            Table::Keyed => "code",
        }
    }
}

/// The tables a maintenance pass visits.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) enum Maintained {
    Bronze(Table),
    Silver(Table),
    History(Table),
    Facts,
    Control,
}

/// How a table's stream meets changes a cleanup purged before it read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum OnLoss {
    /// Stop with `DataLoss` (`on_data_loss = fail`); the operator then sets skip.
    Fail,
    /// Skip to `min_lsn` with a `data_skipped` row (`fail_on_data_loss = false`).
    Skip,
    /// Open a chunked re-snapshot and resume at its S (`on_data_loss = resnapshot`).
    Resnapshot,
}

/// A DBA's change to a source table's schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum SchemaChange {
    /// `ALTER TABLE ADD extra decimal(9,2) NULL`, then a second capture instance capturing
    /// every column (the switch); a table that has two instances already is left alone.
    AddColumnAndSwitch,
    /// `ALTER COLUMN` of a text column to a wider type (propagated to the change table).
    WidenText,
}

/// Where a crash is injected (the stream's crash points).
pub(crate) const CRASH_POINTS: [&str; 4] =
    ["after_plan", "after_bronze", "after_facts", "after_control"];

/// One operation of a schedule.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Op {
    /// Workload commits to one table (`seed` makes them).
    Commit {
        table: Table,
        commits: u64,
        seed: u64,
    },
    /// A stream of one table: available-now, or continuous until it holds every change
    /// committed before it started (on the server's live tail or polling).
    Stream {
        table: Table,
        continuous: bool,
        live_tail: bool,
        max_commits: Option<u64>,
    },
    /// A maintenance pass over one table of the lake, in this process, and with `beside` a
    /// second pass at once in another process (`mssql-cdc-writer maintain`).
    Maintain { target: Maintained, beside: bool },
    /// Cleanup purges every change up to the source's `max_lsn`; each table's next stream
    /// meets it as `on_loss` says, in the order of [`Table::ALL`] (a schedule written before
    /// a table joined the model leaves that table's policy as it was).
    Purge { on_loss: Vec<OnLoss> },
    /// An operator's re-snapshot of `table` (`snapshot open --resnapshot`): a full one read
    /// at once, or a chunked one opened for backfills to read.
    Snapshot { table: Table, chunked: bool },
    /// Up to `waves` waves of the open chunked snapshot of `table` (small chunks).
    Backfill { table: Table, waves: u32 },
    /// A DBA changes the schema of `table`.
    Schema { table: Table, change: SchemaChange },
    /// An operator pauses (or resumes) the open chunked snapshot of `table`.
    Pause { table: Table, paused: bool },
    /// Silver and history of `table` applied (after an available-now stream).
    Apply {
        table: Table,
        deletion_vectors: bool,
    },
    /// Silver of `table` reconciled with the source, silver first corrupted by another
    /// engine when `corrupt`: a row deleted, or with `value` one value changed (which only
    /// the value sums of tier 1 find: a run after a corruption reads no bucket row by row
    /// unless tier 1 finds it different). `value` without `corrupt` turns the value sums
    /// off (`--value-sums false`), no bucket read row by row unless tier 1 finds it
    /// different: silver's rows may be verified then, never its values.
    Reconcile {
        table: Table,
        corrupt: bool,
        #[serde(default)]
        value: bool,
    },
    /// Two available-now streams of one app id at once: one may be fenced, nothing doubles.
    SecondWriter { table: Table },
    /// The writer binary streaming `table` available-now, aborted at a crash point.
    Crash { table: Table, point: usize },
    /// The sidecar (`run --config`, continuous) over every table for `tenths` tenths of a
    /// second: their streams, backfills, silver applies (`deletion_vectors` or not) and
    /// maintenance; then stopped by SIGTERM, or killed (SIGKILL) when `kill`. With
    /// `replicas` above 1, a fleet of that many processes sharing the tables by lease, the
    /// holder of the first table stopped (or killed) half-way and its tables taken over by
    /// the others.
    Sidecar {
        tenths: u64,
        kill: bool,
        deletion_vectors: bool,
        #[serde(default)]
        replicas: u8,
    },
    /// The Flight server restarts after `tenths` tenths of a second: every connection in
    /// flight is cut, new ones are refused for `down` tenths, then a new server serves (with
    /// a new ticket key when `rekey`: tickets signed before are refused).
    Restart {
        tenths: u64,
        down: u64,
        #[serde(default)]
        rekey: bool,
    },
    /// An operator changes the column selection of `table`'s stream: its toggled column
    /// left out too (`narrow`) or taken back in. Streams record it on bronze when they next
    /// start; snapshots and backfills follow bronze.
    Reselect { table: Table, narrow: bool },
    /// Two operations at once.
    Together(Box<Op>, Box<Op>),
}

/// The operation's kind, for the coverage count.
pub(crate) fn kind(op: &Op) -> String {
    match op {
        Op::Commit { table, .. } => format!("commit {}", table.name()),
        Op::Stream {
            continuous,
            max_commits,
            live_tail,
            ..
        } => format!(
            "stream {}{}{}",
            if *continuous {
                "continuous"
            } else {
                "available-now"
            },
            if *continuous && *live_tail {
                " live-tail"
            } else {
                ""
            },
            if max_commits.is_some() {
                " max_commits"
            } else {
                ""
            }
        ),
        Op::Maintain { target, beside } => format!(
            "maintain {}{}",
            match target {
                Maintained::Bronze(_) => "bronze",
                Maintained::Silver(_) => "silver",
                Maintained::History(_) => "history",
                Maintained::Facts => "facts",
                Maintained::Control => "control",
            },
            if *beside {
                " beside another process"
            } else {
                ""
            }
        ),
        Op::Purge { on_loss } => {
            let policies: Vec<String> =
                on_loss.iter().map(|policy| format!("{policy:?}")).collect();
            format!("purge ({})", policies.join(", "))
        }
        Op::Snapshot { chunked, .. } => format!(
            "snapshot open {}",
            if *chunked { "chunked" } else { "full" }
        ),
        Op::Backfill { .. } => "backfill".into(),
        Op::Schema { change, .. } => format!("schema {change:?}"),
        Op::Pause { paused, .. } => (if *paused { "pause" } else { "resume" }).into(),
        Op::Apply {
            deletion_vectors, ..
        } => format!(
            "apply {}",
            if *deletion_vectors {
                "deletion vectors"
            } else {
                "copy-on-write"
            }
        ),
        Op::Reconcile { corrupt, value, .. } => format!(
            "reconcile{}",
            match (corrupt, value) {
                (false, false) => "",
                (false, true) => " without value sums",
                (true, false) => " after a row deleted",
                (true, true) => " after a value changed",
            }
        ),
        Op::SecondWriter { .. } => "second writer".into(),
        Op::Crash { point, .. } => format!("crash {}", CRASH_POINTS[*point]),
        Op::Sidecar { kill, replicas, .. } => format!(
            "{} {}",
            if *replicas > 1 {
                format!("fleet of {replicas}")
            } else {
                "sidecar".to_string()
            },
            if *kill { "killed" } else { "stopped" }
        ),
        Op::Restart { rekey, .. } => format!(
            "server restart{}",
            if *rekey { " with a new ticket key" } else { "" }
        ),
        Op::Reselect { narrow, .. } => format!(
            "column selection {}",
            if *narrow { "narrowed" } else { "widened" }
        ),
        Op::Together(..) => "together".into(),
    }
}

/// A random operation; `alone` ones (purges, reconciles, crashes) are never paired.
pub(crate) fn random_op(rng: &mut StdRng, pairable: bool) -> Op {
    let table = match rng.random_range(0..5) {
        0..2 => Table::Busy,
        2..4 => Table::Quiet,
        _ => Table::Keyed,
    };
    let roll = rng.random_range(0..126);
    match roll {
        0..22 => {
            let commits = match table {
                Table::Busy => rng.random_range(20..200),
                Table::Quiet => rng.random_range(1..6),
                Table::Keyed => rng.random_range(5..60),
            };
            Op::Commit {
                table,
                commits,
                seed: rng.random(),
            }
        }
        22..44 => Op::Stream {
            table,
            continuous: rng.random_bool(0.4),
            live_tail: rng.random_bool(0.5),
            max_commits: rng.random_bool(0.5).then(|| rng.random_range(5..60)),
        },
        44..55 => Op::Maintain {
            target: match rng.random_range(0..10) {
                0..5 => Maintained::Bronze(table),
                5 => Maintained::Silver(table),
                6 => Maintained::History(table),
                7..9 => Maintained::Facts,
                _ => Maintained::Control,
            },
            beside: rng.random_bool(0.5),
        },
        55..64 => Op::Apply {
            table,
            deletion_vectors: rng.random_bool(0.5),
        },
        64..68 => Op::Snapshot {
            table,
            chunked: rng.random_bool(0.7),
        },
        68..76 => Op::Backfill {
            table,
            waves: rng.random_range(1..5),
        },
        76..78 => Op::Pause {
            table,
            paused: rng.random_bool(0.5),
        },
        112..114 => Op::Schema {
            table,
            change: if rng.random_bool(0.5) {
                SchemaChange::AddColumnAndSwitch
            } else {
                SchemaChange::WidenText
            },
        },
        114..120 => Op::Sidecar {
            tenths: rng.random_range(10..60),
            kill: rng.random_bool(0.5),
            deletion_vectors: rng.random_bool(0.5),
            replicas: if rng.random_bool(0.4) {
                rng.random_range(2..=3)
            } else {
                1
            },
        },
        120..126 => Op::Restart {
            tenths: if pairable { rng.random_range(0..30) } else { 0 },
            down: rng.random_range(0..15),
            rekey: rng.random_bool(0.5),
        },
        78..86 if !pairable => Op::Reconcile {
            table,
            corrupt: rng.random_bool(0.4),
            value: rng.random_bool(0.5),
        },
        86..90 if !pairable => {
            let mut draw = || match rng.random_range(0..10) {
                0..3 => OnLoss::Fail,
                3..6 => OnLoss::Skip,
                _ => OnLoss::Resnapshot,
            };
            Op::Purge {
                on_loss: Table::ALL.iter().map(|_| draw()).collect(),
            }
        }
        90..95 if !pairable => Op::SecondWriter { table },
        106..108 if !pairable => Op::Reselect {
            table,
            narrow: rng.random_bool(0.6),
        },
        95..100 if !pairable => Op::Crash {
            table,
            point: rng.random_range(0..CRASH_POINTS.len()),
        },
        100..106 if !pairable => {
            // Two streams of one table at once are a second writer (its own operation); the
            // sidecar owns the streams, backfills and applies of its tables.
            let first = random_op(rng, true);
            let mut second = random_op(rng, true);
            while (streamed(&first).is_some() && streamed(&first) == streamed(&second))
                || !beside_each_other(&first, &second)
            {
                second = random_op(rng, true);
            }
            Op::Together(Box::new(first), Box::new(second))
        }
        _ => Op::Stream {
            table,
            continuous: false,
            live_tail: false,
            max_commits: None,
        },
    }
}

/// Whether `first` and `second` may run at once: beside the sidecar only what an operator or
/// a DBA does next to a running deployment (commits, DDL, maintenance, snapshot opens,
/// pauses).
fn beside_each_other(first: &Op, second: &Op) -> bool {
    let beside_sidecar = |op: &Op| {
        matches!(
            op,
            Op::Commit { .. }
                | Op::Schema { .. }
                | Op::Maintain { .. }
                | Op::Snapshot { .. }
                | Op::Pause { .. }
                | Op::Restart { .. }
        )
    };
    match (first, second) {
        (Op::Sidecar { .. }, other) | (other, Op::Sidecar { .. }) => beside_sidecar(other),
        _ => true,
    }
}

/// The table `op` streams (an apply streams first), if any.
pub(crate) fn streamed(op: &Op) -> Option<Table> {
    match op {
        Op::Stream { table, .. } | Op::Apply { table, .. } => Some(*table),
        _ => None,
    }
}

/// The schedule of `seed`: `steps` operations.
pub(crate) fn schedule(seed: u64, steps: usize) -> Vec<Op> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..steps).map(|_| random_op(&mut rng, false)).collect()
}
