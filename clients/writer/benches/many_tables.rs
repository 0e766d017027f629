//! Many tables: one sidecar process streaming `BENCH_TABLES` tables (default 1,000) of which
//! `BENCH_BUSY` (default 10) are busy, with the shared live tail and with the 5 s poll, in
//! one run.
//!
//! For each mode: a simulated database with that many copies of `dbo.orders` served in this
//! process on 127.0.0.1, and the writer binary (`mssql-cdc-writer run --config`) as a child
//! process, so its CPU time and peak RSS are its own. After every table's first batch, a
//! committer inserts one row per commit into the busy tables in turn at
//! `BENCH_MANY_RATE` commits/s (default 100) for `BENCH_MANY_SECONDS` (default 60); once
//! bronze holds every commit the sidecar idles for `BENCH_IDLE_SECONDS` (default 20). The
//! figures: the source calls per second the server made while busy and while idle (by call),
//! the sidecar's CPU seconds (and per busy-table batch: a busy table in either mode reads
//! again as soon as a batch ends, so the CPU goes to as many batches as it can) and peak RSS,
//! the commits to the shared facts and control tables, and how long the busy tables took to
//! catch up after the last commit. Verdicts are hourly;
//! `BENCH_GRANULARITY=minute` makes the window cross a verdict period, where every table
//! writes the batch that moves its verdict.
//!
//! `cargo bench -p mssql-cdc-writer --bench many_tables`. The ratios printed last are the
//! shared tail's source calls per second over the poll's, busy and idle.
//!
//! With `BENCH_FLEET=3` (replicas) a third mode runs the same tables on a fleet of that many
//! sidecar processes sharing them by lease (`[fleet]`, `BENCH_LEASE_SECONDS`, default 20,
//! the shared tail), measured as the others, its CPU and RSS summed over the replicas; then
//! one replica is killed (SIGKILL), one row is committed to each of its tables, and the run
//! prints how long until the others held its leases and until every one of its tables had
//! streamed that row.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{env_number, source_calls, start_server};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use mssql_cdc_flight::CommitTime;
use mssql_cdc_flight::sim::{Clock, SimDb, TableSpec, sample};
use mssql_cdc_writer::checkpoint::{self, Checkpoint};
use mssql_cdc_writer::tables;

/// What one mode measured.
struct Report {
    warm_up_seconds: f64,
    busy_calls: BTreeMap<String, f64>,
    idle_calls: BTreeMap<String, f64>,
    cpu_seconds: f64,
    peak_rss_mib: f64,
    facts_commits: i64,
    /// Bronze commits of the busy tables in the busy window: the batches the CPU went to.
    busy_batches: i64,
    control_commits: i64,
    catch_up_seconds: f64,
    commits: u64,
    /// How long the committer took: more than the rate asks when the database is slower.
    commit_seconds: f64,
    /// In a fleet: the killed replica's tables, and the seconds until the others held them
    /// and until each had streamed a row committed after the kill.
    takeover: Option<(usize, f64, f64)>,
}

/// How the tables run: one sidecar (shared tail or polling) or a fleet of replicas.
#[derive(Clone, Copy)]
struct Mode {
    live_tail: bool,
    /// Sidecar processes sharing the tables by lease; 1: one sidecar without `[fleet]`.
    replicas: usize,
    lease_seconds: u64,
}

fn main() -> anyhow::Result<()> {
    let tables = env_number("BENCH_TABLES", 1_000) as usize;
    let busy = (env_number("BENCH_BUSY", 10) as usize).min(tables);
    let rate = env_number("BENCH_MANY_RATE", 100) as f64;
    let seconds = env_number("BENCH_MANY_SECONDS", 60);
    let idle = env_number("BENCH_IDLE_SECONDS", 20);
    let granularity = std::env::var("BENCH_GRANULARITY").unwrap_or_else(|_| "hour".to_string());
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    println!(
        "{tables} tables, {busy} busy at {rate} commits/s for {seconds} s, then {idle} s idle; \
         {granularity} verdicts"
    );
    let fleet = env_number("BENCH_FLEET", 1) as usize;
    let lease_seconds = env_number("BENCH_LEASE_SECONDS", 20);
    let mut modes = vec![
        (
            "shared tail".to_string(),
            Mode {
                live_tail: true,
                replicas: 1,
                lease_seconds,
            },
        ),
        (
            "poll 5 s".to_string(),
            Mode {
                live_tail: false,
                replicas: 1,
                lease_seconds,
            },
        ),
    ];
    if fleet > 1 {
        modes.push((
            format!("fleet of {fleet}"),
            Mode {
                live_tail: true,
                replicas: fleet,
                lease_seconds,
            },
        ));
    }
    let mut totals = Vec::new();
    for (name, mode) in modes {
        let sizes = Sizes {
            tables,
            busy,
            rate,
            seconds,
            idle,
            granularity: granularity.clone(),
        };
        let report = runtime.block_on(measure(mode, &sizes, &metrics))?;
        println!(
            "{name:>11}: first batch of every table in {:.1} s; {} commits in {:.1} s, caught up \
             {:.2} s after the last; sidecar CPU {:.1} s in the busy window for {} busy-table \
             batches ({:.0} ms a batch), peak RSS {:.0} MiB; facts commits {}, control commits {}",
            report.warm_up_seconds,
            report.commits,
            report.commit_seconds,
            report.catch_up_seconds,
            report.cpu_seconds,
            report.busy_batches,
            report.cpu_seconds * 1000.0 / report.busy_batches.max(1) as f64,
            report.peak_rss_mib,
            report.facts_commits,
            report.control_commits,
        );
        println!(
            "{name:>11}: source calls/s busy {:.2} ({}); idle {:.2} ({})",
            total(&report.busy_calls),
            by_call(&report.busy_calls),
            total(&report.idle_calls),
            by_call(&report.idle_calls),
        );
        if let Some((tables, held, streamed)) = report.takeover {
            println!(
                "{name:>11}: a replica killed: its {tables} tables held by the others after \
                 {held:.1} s, each streaming a row committed after the kill within {streamed:.1} s \
                 (lease {lease_seconds} s)"
            );
        }
        totals.push((
            total(&report.busy_calls),
            total(&report.idle_calls),
            report.warm_up_seconds,
        ));
    }
    println!(
        "source calls/s shared tail / poll: busy {:.3}, idle {:.3}",
        totals[0].0 / totals[1].0,
        totals[0].1 / totals[1].1.max(f64::MIN_POSITIVE)
    );
    if let Some(fleet) = totals.get(2) {
        println!(
            "fleet / one sidecar (shared tail): first batch of every table {:.3}, source calls/s \
             busy {:.3}, idle {:.3}",
            fleet.2 / totals[0].2,
            fleet.0 / totals[0].0,
            fleet.1 / totals[0].1.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}

fn total(calls: &BTreeMap<String, f64>) -> f64 {
    calls.values().sum()
}

fn by_call(calls: &BTreeMap<String, f64>) -> String {
    if calls.is_empty() {
        return "none".into();
    }
    calls
        .iter()
        .map(|(call, per_second)| format!("{call} {per_second:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `dbo.orders`' shape under the name `dbo.t<n>`.
fn table_spec(n: usize) -> TableSpec {
    TableSpec {
        table: format!("dbo.t{n:04}").parse().expect("table name"),
        ..sample::orders()
    }
}

/// The run's sizes, from the environment.
struct Sizes {
    tables: usize,
    busy: usize,
    rate: f64,
    seconds: u64,
    idle: u64,
    granularity: String,
}

async fn measure(mode: Mode, sizes: &Sizes, metrics: &PrometheusHandle) -> anyhow::Result<Report> {
    let Sizes {
        tables,
        busy,
        rate,
        seconds,
        idle,
        ..
    } = *sizes;
    let dir = tempfile::tempdir()?;
    let specs: Vec<TableSpec> = (0..tables).map(table_spec).collect();
    let db = SimDb::create(
        &dir.path().join("db"),
        &specs,
        CommitTime(chrono::Utc::now().timestamp_micros() - 60_000_000),
    )?;
    let mut writer = db.writer(Clock::Wall, 7)?;
    let mut seed = writer.begin();
    for spec in &specs[..busy] {
        seed.insert(&spec.table, 10)?;
    }
    seed.commit()?;
    writer.publish()?;
    let server = start_server(&db).await?;
    let config = sidecar_file(dir.path(), &server.url, &specs, mode, &sizes.granularity)?;
    let mut sidecar = Sidecars::start(&config, dir.path(), mode.replicas)?;

    // Every table's first batch.
    let started = Instant::now();
    let checkpoints = dir.path().join("checkpoints");
    while !every_table_started(&checkpoints, tables).await? {
        sidecar.check()?;
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(1_800),
            "the tables did not all start within 30 minutes"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let warm_up_seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;

    let facts = tables::table_url(&lake(dir.path(), "facts"))?;
    let control = tables::table_url(&lake(dir.path(), "control"))?;
    let (facts_before, control_before) = (version(&facts).await?, version(&control).await?);
    let bronze_before = busy_bronze_versions(dir.path(), busy).await?;
    let calls_before = source_calls(metrics);
    let cpu_before = sidecar.cpu_seconds()?;
    let window = Instant::now();
    let total = (rate * seconds as f64) as u64;
    let busy_tables: Vec<_> = specs[..busy]
        .iter()
        .map(|spec| spec.table.clone())
        .collect();
    let committer = std::thread::spawn(move || -> anyhow::Result<()> {
        let started = Instant::now();
        for tick in 0..total {
            let due = started + Duration::from_secs_f64(tick as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let mut tx = writer.begin();
            tx.insert(&busy_tables[tick as usize % busy_tables.len()], 1)?;
            tx.commit()?;
            writer.publish()?;
        }
        Ok(())
    });
    while !committer.is_finished() {
        sidecar.check()?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    committer.join().expect("committer")?;
    let committed = Instant::now();
    let commit_seconds = window.elapsed().as_secs_f64();
    let expected: Vec<u64> = (0..busy)
        .map(|n| 10 + total / busy as u64 + u64::from((n as u64) < total % busy as u64))
        .collect();
    while !busy_tables_caught_up(dir.path(), &expected).await? {
        sidecar.check()?;
        anyhow::ensure!(
            committed.elapsed() < Duration::from_secs(120),
            "the busy tables did not catch up within 2 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let catch_up_seconds = committed.elapsed().as_secs_f64();
    let window_seconds = window.elapsed().as_secs_f64();
    let cpu_seconds = sidecar.cpu_seconds()? - cpu_before;
    let calls_busy = source_calls(metrics);
    let (facts_after, control_after) = (version(&facts).await?, version(&control).await?);
    let busy_batches = busy_bronze_versions(dir.path(), busy).await? - bronze_before;

    tokio::time::sleep(Duration::from_secs(idle)).await;
    let calls_idle = source_calls(metrics);
    let peak_rss_mib = sidecar.peak_rss_mib()?;
    let takeover = if mode.replicas > 1 {
        Some(kill_one(dir.path(), &specs, &mut sidecar, &mut writer_after(&db)?).await?)
    } else {
        None
    };
    sidecar.stop();
    server.stop().await?;
    Ok(Report {
        warm_up_seconds,
        busy_calls: per_second(&calls_before, &calls_busy, window_seconds),
        idle_calls: per_second(&calls_busy, &calls_idle, idle as f64),
        cpu_seconds,
        peak_rss_mib,
        facts_commits: facts_after - facts_before,
        busy_batches,
        control_commits: control_after - control_before,
        catch_up_seconds,
        commits: total,
        commit_seconds,
        takeover,
    })
}

/// A writer of the database after the committer's (which moved into its thread).
fn writer_after(db: &SimDb) -> anyhow::Result<mssql_cdc_flight::sim::SimWriter> {
    Ok(db.writer(Clock::Wall, 8)?)
}

/// Kills the first replica of the fleet, commits one row to each of its tables, and waits
/// until the others hold them and each streamed its row: its tables, and the seconds to
/// both.
async fn kill_one(
    base: &Path,
    specs: &[TableSpec],
    fleet: &mut Sidecars,
    writer: &mut mssql_cdc_flight::sim::SimWriter,
) -> anyhow::Result<(usize, f64, f64)> {
    let app_ids: Vec<String> = (0..specs.len()).map(|n| format!("t{n:04}")).collect();
    let leases = base.join("leases").display().to_string();
    let mut store = mssql_cdc_writer::fleet::leases::Leases::open(&leases).await?;
    let holders = store.holders(&app_ids).await?;
    let orphans: Vec<usize> = (0..specs.len())
        .filter(|n| {
            holders[&app_ids[*n]]
                .as_deref()
                .is_some_and(|holder| holder.starts_with("r0@"))
        })
        .collect();
    let checkpoints = base.join("checkpoints").display().to_string();
    let mut batches_before = Vec::new();
    for n in &orphans {
        let location = checkpoint::location(Some(&checkpoints), "", &app_ids[*n]);
        let last = Checkpoint::open(&location).await?.last().await?;
        batches_before.push(last.map_or(-1, |batch| batch.batch_id));
    }
    let killed = Instant::now();
    fleet.kill_first();
    let mut tx = writer.begin();
    for n in &orphans {
        tx.insert(&specs[*n].table, 1)?;
    }
    tx.commit()?;
    writer.publish()?;
    let mut held = None;
    loop {
        fleet.check()?;
        anyhow::ensure!(
            killed.elapsed() < Duration::from_secs(600),
            "the killed replica's tables were not all streamed again within 10 minutes"
        );
        if held.is_none() {
            let seen = store.leases(&app_ids).await?;
            let all_held = orphans.iter().all(|n| {
                seen.get(&app_ids[*n]).is_some_and(|lease| {
                    lease
                        .holder
                        .as_deref()
                        .is_some_and(|holder| !holder.starts_with("r0@"))
                })
            });
            if all_held {
                held = Some(killed.elapsed().as_secs_f64());
            }
        }
        if held.is_some() {
            let mut streamed = true;
            for (n, before) in orphans.iter().zip(&batches_before) {
                let location = checkpoint::location(Some(&checkpoints), "", &app_ids[*n]);
                let last = Checkpoint::open(&location).await?.last().await?;
                if !last.is_some_and(|batch| batch.committed && batch.batch_id > *before) {
                    streamed = false;
                    break;
                }
            }
            if streamed {
                let streamed = killed.elapsed().as_secs_f64();
                return Ok((orphans.len(), held.unwrap_or(streamed), streamed));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn lake(base: &Path, name: &str) -> String {
    base.join("lake").join(name).display().to_string()
}

/// The sidecar file of every table (the 5 s poll, no maintenance).
fn sidecar_file(
    base: &Path,
    url: &str,
    specs: &[TableSpec],
    mode: Mode,
    granularity: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let mut text = format!(
        "server = \"{url}\"\nfacts = \"{}\"\ncontrol = \"{}\"\ncheckpoints = \"{}\"\n\
         granularity = \"{granularity}\"\npoll_seconds = 5.0\nlive_tail = {}\n\
         maintenance_minutes = 0.0\n",
        lake(base, "facts"),
        lake(base, "control"),
        base.join("checkpoints").display(),
        mode.live_tail,
    );
    if mode.replicas > 1 {
        text.push_str(&format!(
            "\n[fleet]\nleases = \"{}\"\nlease_seconds = {}.0\n",
            base.join("leases").display(),
            mode.lease_seconds
        ));
    }
    for (n, spec) in specs.iter().enumerate() {
        text.push_str(&format!(
            "\n[[tables]]\ntable = \"{}\"\ntarget = \"{}\"\napp_id = \"t{n:04}\"\n",
            spec.table,
            lake(base, &format!("bronze_t{n:04}")),
        ));
    }
    let path = base.join("sidecar.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Whether every table's checkpoint holds a committed batch.
async fn every_table_started(checkpoints: &Path, tables: usize) -> anyhow::Result<bool> {
    let root = checkpoints.display().to_string();
    for n in 0..tables {
        let location = checkpoint::location(Some(&root), "", &format!("t{n:04}"));
        let last = Checkpoint::open(&location).await?.last().await?;
        if !last.is_some_and(|batch| batch.committed) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether each busy table's bronze holds its `expected` rows.
async fn busy_tables_caught_up(base: &Path, expected: &[u64]) -> anyhow::Result<bool> {
    for (n, rows) in expected.iter().enumerate() {
        let url = tables::table_url(&lake(base, &format!("bronze_t{n:04}")))?;
        let count = tables::query_text(&url, "SELECT COUNT(*) FROM t").await?;
        let held: u64 = count
            .first()
            .and_then(|row| row.first().cloned().flatten())
            .and_then(|text| text.parse().ok())
            .unwrap_or(0);
        if held < *rows {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The sum of the busy tables' bronze versions.
async fn busy_bronze_versions(base: &Path, busy: usize) -> anyhow::Result<i64> {
    let mut sum = 0;
    for n in 0..busy {
        sum += version(&tables::table_url(&lake(base, &format!("bronze_t{n:04}")))?).await?;
    }
    Ok(sum)
}

/// A Delta table's version (-1 when it does not exist).
async fn version(url: &url::Url) -> anyhow::Result<i64> {
    Ok(tables::open(url)
        .await?
        .and_then(|table| table.version())
        .map_or(-1, |version| version as i64))
}

/// The sidecar processes: one, or the replicas of a fleet (`r0`, `r1`, ...).
struct Sidecars {
    replicas: Vec<Sidecar>,
}

impl Sidecars {
    fn start(config: &Path, base: &Path, replicas: usize) -> anyhow::Result<Self> {
        let replicas = (0..replicas)
            .map(|n| {
                Sidecar::start(
                    config,
                    &base.join(format!("sidecar-r{n}.log")),
                    &format!("r{n}"),
                )
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Sidecars { replicas })
    }

    /// Fails when a replica has exited (but the one killed).
    fn check(&mut self) -> anyhow::Result<()> {
        self.replicas.iter_mut().try_for_each(Sidecar::check)
    }

    /// CPU seconds of every replica so far.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        self.replicas.iter().map(Sidecar::cpu_seconds).sum()
    }

    /// The replicas' peak resident sets, summed.
    fn peak_rss_mib(&self) -> anyhow::Result<f64> {
        self.replicas.iter().map(Sidecar::peak_rss_mib).sum()
    }

    /// Kills the first replica (SIGKILL): its tables are left to the others.
    fn kill_first(&mut self) {
        self.replicas.remove(0).stop();
    }

    fn stop(self) {
        self.replicas.into_iter().for_each(Sidecar::stop);
    }
}

/// One sidecar process.
struct Sidecar {
    child: Child,
}

impl Sidecar {
    fn start(config: &Path, log: &Path, name: &str) -> anyhow::Result<Self> {
        let log = std::fs::File::create(log)?;
        let child = Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .env("HOSTNAME", name)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        Ok(Sidecar { child })
    }

    /// Fails when the sidecar has exited.
    fn check(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("the sidecar exited: {status}");
        }
        Ok(())
    }

    /// User and system CPU seconds so far (`/proc/<pid>/stat`, fields 14 and 15).
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        let after_name = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest)
            .unwrap_or_default();
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        let per_second = 100.0; // USER_HZ on Linux
        Ok(ticks as f64 / per_second)
    }

    /// Peak resident set (`VmHWM`), in MiB.
    fn peak_rss_mib(&self) -> anyhow::Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kib: f64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
        Ok(kib / 1024.0)
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The calls between two counts, per second of `seconds`.
fn per_second(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    seconds: f64,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(call, count)| {
            let calls = count - before.get(call).copied().unwrap_or(0.0);
            (calls > 0.0).then(|| (call.clone(), calls / seconds))
        })
        .collect()
}
