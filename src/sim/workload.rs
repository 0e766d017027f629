//! A seeded OLTP workload for the simulated database.
//!
//! Each tick is either an idle `lsn_time_mapping` entry or a transaction of 1 to
//! `max_statements` statements; each statement inserts, updates, deletes or re-keys 1 to
//! `max_rows_per_statement` rows of a random table, drawn with the weights of [`Mix`]. The
//! same seed on the same database gives the same keys, values and LSNs. With a rate the ticks
//! are paced in real time and published at least every `publish_interval`, so a server
//! reading the directory sees the commits as they happen.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;

use super::{KeyUpdateStyle, SimWriter};
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::source::TableName;

/// Relative weights of the kinds of work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mix {
    /// Insert statements.
    pub insert: f64,
    /// Update statements.
    pub update: f64,
    /// Delete statements.
    pub delete: f64,
    /// Primary-key updates.
    pub key_update: f64,
    /// Idle ticks (an idle mapping entry instead of a transaction).
    pub idle: f64,
}

impl Default for Mix {
    fn default() -> Self {
        Mix {
            insert: 0.45,
            update: 0.35,
            delete: 0.12,
            key_update: 0.03,
            idle: 0.05,
        }
    }
}

impl FromStr for Mix {
    type Err = Error;

    /// Parses `insert=0.5,update=0.35,delete=0.15` (missing kinds weigh 0).
    fn from_str(text: &str) -> Result<Self> {
        let mut mix = Mix {
            insert: 0.0,
            update: 0.0,
            delete: 0.0,
            key_update: 0.0,
            idle: 0.0,
        };
        for part in text
            .split(',')
            .map(str::trim)
            .filter(|part| !part.is_empty())
        {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| Error::invalid(format!("mix entry '{part}' must be kind=weight")))?;
            let weight: f64 = value
                .trim()
                .parse()
                .ok()
                .filter(|weight: &f64| weight.is_finite() && *weight >= 0.0)
                .ok_or_else(|| {
                    Error::invalid(format!("mix weight '{value}' must be a number >= 0"))
                })?;
            match name.trim() {
                "insert" => mix.insert = weight,
                "update" => mix.update = weight,
                "delete" => mix.delete = weight,
                "key_update" => mix.key_update = weight,
                "idle" => mix.idle = weight,
                other => {
                    return Err(Error::invalid(format!(
                        "unknown mix kind '{other}' (use insert, update, delete, key_update, idle)"
                    )));
                }
            }
        }
        if mix.insert + mix.update + mix.delete + mix.key_update + mix.idle <= 0.0 {
            return Err(Error::invalid("the mix needs at least one positive weight"));
        }
        Ok(mix)
    }
}

/// What a workload run does.
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    /// Ticks (transactions and idle entries) to run; `None` runs until `duration` or stop.
    pub commits: Option<u64>,
    /// Wall-clock limit.
    pub duration: Option<Duration>,
    /// Ticks per second; `None` runs as fast as possible.
    pub rate: Option<f64>,
    /// Kinds of work and their weights.
    pub mix: Mix,
    /// Statements per transaction, at most.
    pub max_statements: u32,
    /// Rows per statement, at most.
    pub max_rows_per_statement: u32,
    /// Tables to work on (empty: all).
    pub tables: Vec<TableName>,
    /// Longest time between two publishes of a paced run.
    pub publish_interval: Duration,
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            commits: Some(1_000),
            duration: None,
            rate: None,
            mix: Mix::default(),
            max_statements: 4,
            max_rows_per_statement: 3,
            tables: Vec::new(),
            publish_interval: Duration::from_millis(500),
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadReport {
    /// Transactions committed.
    pub transactions: u64,
    /// Idle entries written.
    pub idle: u64,
    /// Change rows written (per table, not per capture instance).
    pub rows: u64,
    /// First LSN written.
    pub first_lsn: Option<Lsn>,
    /// Last LSN written.
    pub last_lsn: Option<Lsn>,
}

enum Work {
    Insert,
    Update,
    Delete,
    KeyUpdate,
}

/// Runs a workload and publishes everything it wrote. `stop` ends it early (Ctrl-C).
pub fn run(
    writer: &mut SimWriter,
    spec: &WorkloadSpec,
    stop: &AtomicBool,
) -> Result<WorkloadReport> {
    if spec.max_statements == 0 || spec.max_rows_per_statement == 0 {
        return Err(Error::invalid(
            "max statements and rows per statement must be at least 1",
        ));
    }
    if spec
        .rate
        .is_some_and(|rate| !(rate.is_finite() && rate > 0.0))
    {
        return Err(Error::invalid(
            "the rate must be a positive number of commits per second",
        ));
    }
    let tables = if spec.tables.is_empty() {
        writer.tables()
    } else {
        spec.tables.clone()
    };
    if tables.is_empty() {
        return Err(Error::invalid("the database has no tables"));
    }
    let started = Instant::now();
    let mut last_publish = Instant::now();
    let mut last_progress = Instant::now();
    let mut report = WorkloadReport::default();
    let mut tick = 0u64;
    let statement_weight =
        spec.mix.insert + spec.mix.update + spec.mix.delete + spec.mix.key_update;
    loop {
        if spec.commits.is_some_and(|commits| tick >= commits)
            || spec
                .duration
                .is_some_and(|duration| started.elapsed() >= duration)
            || stop.load(Ordering::Relaxed)
        {
            break;
        }
        if let Some(rate) = spec.rate {
            let due = started + Duration::from_secs_f64(tick as f64 / rate);
            let now = Instant::now();
            if due > now {
                if last_publish.elapsed() >= spec.publish_interval {
                    writer.publish()?;
                    last_publish = Instant::now();
                }
                std::thread::sleep(due - now);
            }
        }
        tick += 1;
        let idle = statement_weight <= 0.0
            || writer.rng().random::<f64>() * (statement_weight + spec.mix.idle)
                >= statement_weight;
        let lsn = if idle {
            report.idle += 1;
            Some(writer.idle())
        } else {
            transaction(writer, spec, &tables, statement_weight, &mut report)?
        };
        if let Some(lsn) = lsn {
            report.first_lsn.get_or_insert(lsn);
            report.last_lsn = Some(lsn);
        }
        if spec.rate.is_some() && last_publish.elapsed() >= spec.publish_interval {
            writer.publish()?;
            last_publish = Instant::now();
        }
        if last_progress.elapsed() >= Duration::from_secs(5) {
            tracing::info!(ticks = tick, rows = report.rows, "workload progress");
            last_progress = Instant::now();
        }
    }
    writer.publish()?;
    Ok(report)
}

fn transaction(
    writer: &mut SimWriter,
    spec: &WorkloadSpec,
    tables: &[TableName],
    statement_weight: f64,
    report: &mut WorkloadReport,
) -> Result<Option<Lsn>> {
    let statements = writer.rng().random_range(1..=spec.max_statements);
    let mut plan = Vec::new();
    for _ in 0..statements {
        let table = tables[writer.rng().random_range(0..tables.len())].clone();
        let rows = writer.rng().random_range(1..=spec.max_rows_per_statement) as usize;
        let mut draw = writer.rng().random::<f64>() * statement_weight;
        let mut work = Work::KeyUpdate;
        for (weight, kind) in [
            (spec.mix.insert, Work::Insert),
            (spec.mix.update, Work::Update),
            (spec.mix.delete, Work::Delete),
        ] {
            if draw < weight {
                work = kind;
                break;
            }
            draw -= weight;
        }
        let in_place = writer.rng().random_range(0..4) == 0;
        plan.push((table, rows, work, in_place));
    }
    let mut tx = writer.begin();
    for (table, rows, work, in_place) in plan {
        let existing = tx.random_keys(&table, rows)?;
        match work {
            Work::Update if !existing.is_empty() => {
                tx.update(&table, &existing)?;
            }
            Work::Delete if !existing.is_empty() => {
                tx.delete(&table, &existing)?;
            }
            Work::KeyUpdate if !existing.is_empty() => {
                let new_key = tx.next_key(&table);
                let style = if in_place {
                    KeyUpdateStyle::InPlace
                } else {
                    KeyUpdateStyle::DeleteInsert
                };
                tx.update_key(&table, existing[0], new_key, style)?;
            }
            // Inserts, and any statement on an empty table.
            _ => {
                tx.insert(&table, rows)?;
            }
        }
    }
    report.rows += tx.change_count() as u64;
    let lsn = tx.commit()?;
    if lsn.is_some() {
        report.transactions += 1;
    }
    Ok(lsn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_parses_and_refuses_unknown_kinds() {
        let mix: Mix = "insert=0.5, update=0.5".parse().expect("mix");
        assert_eq!(mix.insert, 0.5);
        assert_eq!(mix.delete, 0.0);
        assert!("insert=x".parse::<Mix>().is_err());
        assert!("upsert=1".parse::<Mix>().is_err());
        assert!("insert=0".parse::<Mix>().is_err());
        assert!("insert".parse::<Mix>().is_err());
    }
}
