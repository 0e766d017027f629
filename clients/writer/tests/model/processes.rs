//! The operations run as other processes: the writer binary aborted at a crash point, and
//! the sidecar over both tables, stopped or killed.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use mssql_cdc_flight::Lsn;
use mssql_cdc_writer::data_loss::OnDataLoss;
use mssql_cdc_writer::snapshot;
use mssql_cdc_writer::stream::CRASH_AT_VARIABLE;

use crate::WRITER;
use crate::ops::Table;
use crate::snapshots::chunk_rows;
use crate::world::{Failure, World};

impl World {
    pub(crate) async fn crash(&self, table: Table, point: &str) -> Result<(), Failure> {
        let config = self.config(table);
        let mut command = Command::new(WRITER);
        command
            .args(["run", "--server", &self.lab.url, "--table", table.source()])
            .args(["--target", &config.target, "--facts", &config.facts])
            .args(["--control", config.control.as_deref().expect("control")])
            .args([
                "--app-id",
                &config.app_id,
                "--checkpoint",
                &config.checkpoint,
            ])
            .args(["--max-commits", "40", "--available-now"])
            .args(match config.on_data_loss {
                OnDataLoss::Resnapshot => ["--on-data-loss", "resnapshot"],
                OnDataLoss::Fail => ["--on-data-loss", "fail"],
            })
            .env(CRASH_AT_VARIABLE, point)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if !config.fail_on_data_loss {
            command.arg("--skip-data-loss");
        }
        // Said every time, also when it is every column (`--except-columns=`).
        let except = self.selection(table).names().join(",");
        command.arg(format!("--except-columns={except}"));
        if let Some(days) = config.resnapshot_interval_days {
            command.args(["--resnapshot-interval-days", &days.to_string()]);
        }
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .expect("task")
            .expect("writer");
        let stderr = String::from_utf8_lossy(&output.stderr);
        // Aborted at the point, or ended without reaching it (nothing new), or stopped by a
        // purge under fail: anything else is a failure.
        if output.status.success() || stderr.contains(CRASH_AT_VARIABLE) {
            return Ok(());
        }
        if stderr.contains("DATA_LOSS") || stderr.contains("purged") {
            return self.stopped_by_purge(table, &stderr);
        }
        Err(format!(
            "the writer run to crash at {point} failed: {stderr}"
        ))
    }

    /// The sidecar over both tables, as a deployment runs it, for `tenths` tenths of a
    /// second; then what it did is learned from the lake (snapshots completed, silver
    /// rebuilt), and a snapshot an operator paused must have read no wave.
    pub(crate) async fn sidecar(
        &self,
        tenths: u64,
        kill: bool,
        deletion_vectors: bool,
        replicas: u8,
    ) -> Result<(), Failure> {
        let mut text = format!(
            "server = \"{}\"\nfacts = \"{}\"\ncontrol = \"{}\"\ncheckpoints = \"{}\"\n\
             granularity = \"minute\"\npoll_seconds = 0.2\nmaintenance_minutes = 0.02\n",
            self.lab.url,
            self.lab.lake("facts"),
            self.lab.lake("control"),
            self.checkpoints()
        );
        let mut before = BTreeMap::new();
        for table in Table::ALL {
            let config = self.config(table);
            text.push_str(&format!(
                "\n[[tables]]\ntable = \"{}\"\ntarget = \"{}\"\napp_id = \"{}\"\n\
                 max_commits = 50\nfail_on_data_loss = {}\non_data_loss = \"{}\"\n{}\
                 except_columns = {:?}\n\
                 chunk_rows = {}\npartitions = {}\nsilver = \"{}\"\nkeys = [\"{}\"]\n\
                 silver_deletion_vectors = {deletion_vectors}\napply_seconds = 0.5\n\
                 history = \"{}\"\ntrack_history_columns = [\"{}\"]\n",
                table.source(),
                config.target,
                config.app_id,
                config.fail_on_data_loss,
                match config.on_data_loss {
                    OnDataLoss::Resnapshot => "resnapshot",
                    OnDataLoss::Fail => "fail",
                },
                config
                    .resnapshot_interval_days
                    .map(|days| format!("resnapshot_interval_days = {days:?}\n"))
                    .unwrap_or_default(),
                self.selection(table).names(),
                chunk_rows(table),
                table.partitions(),
                self.lab.lake(&format!("silver_{}", table.name())),
                table.key(),
                self.lab.lake(&format!("history_{}", table.name())),
                table.tracked_history_column(),
            ));
            let state = snapshot::state(&config)
                .await
                .map_err(|error| format!("snapshot state of {}: {error}", table.source()))?;
            let paused = self.known().paused.get(&table).copied();
            before.insert(table, (state.status, paused));
        }
        let fleet = replicas > 1;
        let leases = self.lab.dir.path().join("leases").display().to_string();
        if fleet {
            text.push_str(&format!(
                "\n[fleet]\nleases = \"{leases}\"\nlease_seconds = {FLEET_LEASE_SECONDS:?}\n"
            ));
        }
        let path = self.lab.dir.path().join("sidecar.toml");
        std::fs::write(&path, text).map_err(|error| format!("sidecar file: {error}"))?;
        let mut running = Vec::new();
        for replica in 0..replicas.max(1) {
            let name = format!("r{replica}");
            let log = self.lab.dir.path().join(format!("sidecar-{name}.log"));
            let child = Command::new(WRITER)
                .args(["run", "--config"])
                .arg(&path)
                .env("RUST_LOG", "error")
                .env("HOSTNAME", &name)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).map_err(|error| error.to_string())?)
                .spawn()
                .map_err(|error| format!("sidecar: {error}"))?;
            running.push((name, child, log));
        }
        if fleet {
            tokio::time::sleep(Duration::from_millis(50 * tenths)).await;
            if let Err(failure) = self.hand_over(&leases, &mut running, kill).await {
                // No replica outlives a failed step.
                for (_, mut child, _) in running {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(failure);
            }
            tokio::time::sleep(Duration::from_millis(50 * tenths)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(100 * tenths)).await;
        }
        // Signalled together, so the others do not take over a stopping replica's tables.
        for (_, child, _) in &mut running {
            signal(child, kill);
        }
        for (_, child, log) in running {
            stop(child, kill, &log).await?;
        }
        for table in Table::ALL {
            let (status, paused) = &before[&table];
            self.learn_after_sidecar(table, status, *paused).await?;
        }
        Ok(())
    }

    /// Half-way through a fleet's run: the holder of the first table held is stopped (or
    /// killed), and the others must take its tables over within a few leases.
    async fn hand_over(
        &self,
        leases: &str,
        running: &mut Vec<(String, std::process::Child, std::path::PathBuf)>,
        kill: bool,
    ) -> Result<(), Failure> {
        let app_ids: Vec<String> = Table::ALL
            .iter()
            .map(|table| self.config(*table).app_id)
            .collect();
        let holders = lease_holders(leases, &app_ids).await?;
        let Some(victim) = holders.values().flatten().next().cloned() else {
            return Ok(());
        };
        let name = victim
            .split_once('@')
            .map_or(victim.as_str(), |(name, _)| name);
        let Some(at) = running.iter().position(|(running, ..)| running == name) else {
            return Err(format!(
                "the lease holder {victim} is no replica this run started"
            ));
        };
        let (_, child, log) = running.remove(at);
        let orphans: Vec<&String> = holders
            .iter()
            .filter(|(_, holder)| holder.as_deref() == Some(victim.as_str()))
            .map(|(app_id, _)| app_id)
            .collect();
        stop(child, kill, &log).await?;
        let began = std::time::Instant::now();
        let limit = Duration::from_secs_f64(FLEET_LEASE_SECONDS * 10.0);
        loop {
            let now = lease_holders(leases, &app_ids).await?;
            if orphans.iter().all(|app_id| {
                now[*app_id]
                    .as_deref()
                    .is_some_and(|holder| !holder.starts_with(&format!("{name}@")))
            }) {
                break;
            }
            if began.elapsed() > limit {
                return Err(format!(
                    "the tables {orphans:?} of the fleet replica {name}, {}, were not taken \
                     over within {limit:?}: {now:?}",
                    if kill { "killed" } else { "stopped" }
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        *self
            .known()
            .covered
            .entry(format!(
                "tables taken over from a {} fleet replica",
                if kill { "killed" } else { "stopped" }
            ))
            .or_default() += orphans.len() as u64;
        Ok(())
    }

    /// What the sidecar did to `table`: a snapshot it completed, a silver it applied or
    /// rebuilt (its control row's position says from which snapshot).
    async fn learn_after_sidecar(
        &self,
        table: Table,
        before: &mssql_cdc_writer::snapshot::BackfillStatus,
        paused_before: Option<Lsn>,
    ) -> Result<(), Failure> {
        let state = snapshot::state(&self.config(table))
            .await
            .map_err(|error| format!("snapshot state of {}: {error}", table.source()))?;
        // Paused before the sidecar started and still: a pause that landed while it ran may
        // let the waves before it through.
        let paused = self.known().paused.get(&table).copied();
        if let Some(snapshot) = state.status.snapshot
            && paused == Some(snapshot)
            && paused_before == Some(snapshot)
            && before.snapshot == Some(snapshot)
            && state.status.chunks_done > before.chunks_done
        {
            return Err(format!(
                "the sidecar read waves of snapshot {snapshot} of {}, which an operator paused \
                 ({} chunks done, {} before)",
                table.source(),
                state.status.chunks_done,
                before.chunks_done
            ));
        }
        if state.status.done
            && let Some(done) = state.status.snapshot
        {
            self.completed(table, done);
        }
        self.observe_silver(table).await?;
        // A sidecar stopped or killed mid-apply leaves history's invariants whole.
        self.check_history(table, false).await
    }
}

/// The lease of a fleet replica in the model: short, so a schedule's few seconds see a
/// killed one taken over.
const FLEET_LEASE_SECONDS: f64 = 1.0;

/// The holder of each of `app_ids`' leases in the fleet's store at `leases`.
async fn lease_holders(
    leases: &str,
    app_ids: &[String],
) -> Result<BTreeMap<String, Option<String>>, Failure> {
    let mut store = mssql_cdc_writer::fleet::leases::Leases::open(leases)
        .await
        .map_err(|error| format!("the fleet's leases: {error}"))?;
    store
        .holders(app_ids)
        .await
        .map_err(|error| format!("the fleet's leases: {error}"))
}

/// Stops a sidecar process by SIGTERM (it finishes the batch, wave or apply in flight: 120 s
/// at most) or kills it (SIGKILL) when `kill`.
async fn stop(
    mut child: std::process::Child,
    kill: bool,
    log: &std::path::Path,
) -> Result<(), Failure> {
    signal(&mut child, kill);
    let pid = child.id();
    let waited = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::task::spawn_blocking(move || child.wait()),
    )
    .await;
    let status = match waited {
        Ok(joined) => joined
            .expect("task")
            .map_err(|error| format!("sidecar: {error}"))?,
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            return Err(format!(
                "the sidecar did not stop within 120 s of SIGTERM: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
    };
    if !kill && !status.success() {
        return Err(format!(
            "the sidecar stopped by SIGTERM exited with {status}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        ));
    }
    Ok(())
}

/// Sends SIGTERM to a sidecar process, or SIGKILL when `kill`.
fn signal(child: &mut std::process::Child, kill: bool) {
    if kill {
        let _ = child.kill();
    } else {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
}
