//! Reconcile: proves silver holds exactly the source table's rows, bucket by bucket, without
//! trusting the pipeline that built it (seed ADR 0028 "Validation" and its Amendment 2;
//! docs/reconcile.md).
//!
//! One run:
//! 1. reads silver's `applied_lsn` from the control table, then silver at **one** version;
//! 2. **tier 1**: the source counts its rows and sums its keys per slice of a fine grid on
//!    the key (`key_sums`, stamped with the `max_lsn` read before it); the writer does the
//!    same over silver on the same grid; slices are merged into buckets of about
//!    `bucket_rows`, each MATCH, IN_FLIGHT or MISMATCH ([`buckets`]);
//! 3. IN_FLIGHT: a bucket that differs and holds a key changed after the LSN both sides are
//!    compared at (`min(source_lsn, silver_lsn)`), in bronze or in the change table read over
//!    Flight up to a fresh `max_lsn` ([`in_flight`]): a lagging pipeline is not broken;
//! 4. **tier 2**: every MISMATCH bucket and a seeded sample of MATCH buckets are compared row
//!    by row: the source's rows read through a snapshot chunk, both sides hashed by the same
//!    function, keys joined null-safely and classified ([`rows`]);
//! 5. with a facts table, the newest chunked snapshot of bronze is checked ([`chunks`]);
//! 6. the report table gets the run's bucket, key and chunk rows ([`report`]); when nothing
//!    differs the control table records silver's `verified_lsn`.

mod buckets;
mod chunks;
mod in_flight;
mod report;
mod rows;

use std::collections::BTreeMap;

use deltalake::datafusion::prelude::SessionContext;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{GridUnit, KeyColumn};
use mssql_cdc_proto::protocol::{CaptureInstanceInfo, KeySumsAnswer, KeySumsBody, LsnAnswer};
use mssql_cdc_proto::{CommitTime, Lsn};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::control;
use crate::error::{Result, WriterError};
use crate::tables;
pub use buckets::{Bucket, BucketStatus};
pub use chunks::{ChunkCheck, ChunkFinding};
use in_flight::InFlight;
pub use rows::{FailureType, KeyFinding};

/// Rows a bucket holds about, by default (the seed's `bucket_rows`).
pub const DEFAULT_BUCKET_ROWS: u64 = 1_000_000;
/// The share of matching buckets compared row by row, by default (the seed's `sample`).
pub const DEFAULT_SAMPLE: f64 = 0.01;
/// Key findings a [`ReconcileResult`] lists (the report table holds them all).
pub const LISTED_FINDINGS: usize = 100;

/// What a reconcile compares.
#[derive(Clone, Debug)]
pub struct ReconcileConfig {
    /// The Flight server.
    pub server: String,
    /// The source table (`schema.table`): bronze's verdict row is under this name.
    pub table: String,
    /// Silver location (its name in the control table, as `apply` writes it).
    pub silver: String,
    /// Bronze location (changes newer than the compared LSN make a difference IN_FLIGHT).
    pub bronze: String,
    /// Control table location (silver's position in, `verified_lsn` out).
    pub control: String,
    /// Facts table location: with it, the newest chunked snapshot of bronze is checked
    /// (CHUNK_TILING, CHUNK_ROWS, CHUNK_STAMP).
    pub facts: Option<String>,
    /// The key column compared on; default the unique index CDC uses.
    pub keys: Option<Vec<String>>,
    /// Rows a bucket holds about (at least 1).
    pub bucket_rows: u64,
    /// Share of MATCH buckets compared row by row, in `[0, 1]`.
    pub sample: f64,
    /// Seed of the sample; default a random one (the result names it).
    pub seed: Option<u64>,
    /// Report table location; default none.
    pub report: Option<String>,
}

impl ReconcileConfig {
    /// A config with the seed's defaults for `bucket_rows` and `sample`.
    pub fn new(server: &str, table: &str, silver: &str, bronze: &str, control: &str) -> Self {
        ReconcileConfig {
            server: server.into(),
            table: table.into(),
            silver: silver.into(),
            bronze: bronze.into(),
            control: control.into(),
            facts: None,
            keys: None,
            bucket_rows: DEFAULT_BUCKET_ROWS,
            sample: DEFAULT_SAMPLE,
            seed: None,
            report: None,
        }
    }

    fn check(&self) -> Result<()> {
        if self.bucket_rows < 1 {
            return Err(WriterError::invalid("bucket_rows must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.sample) {
            return Err(WriterError::invalid(format!(
                "sample must lie in [0, 1], not {}",
                self.sample
            )));
        }
        Ok(())
    }
}

/// What a run found (the seed's `ReconcileResult`, plus the verified LSN).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReconcileResult {
    /// The run, as in the report table.
    pub run_id: String,
    /// The source table.
    pub table: String,
    /// The silver location.
    pub silver: String,
    /// The key column compared on.
    pub key: String,
    /// Silver's Delta version read.
    pub silver_version: i64,
    /// Silver's `applied_lsn` read before that version.
    pub silver_lsn: Lsn,
    /// `max_lsn` read before the source was counted.
    pub source_lsn: Lsn,
    /// The LSN both sides are compared at: `min(source_lsn, silver_lsn)`.
    pub compared_lsn: Lsn,
    /// The change table's LSNs read for keys in flight, `(from, through]`: from where
    /// bronze's stream stood (its newest change row) to a `max_lsn` read after the source's
    /// counts and its row-by-row reads.
    pub changes_read: (Lsn, Lsn),
    /// Buckets compared.
    pub buckets: u64,
    /// Buckets whose rows and key sums match.
    #[serde(rename = "match")]
    pub matched: u64,
    /// Buckets that differ only where changes are still in flight.
    pub in_flight: u64,
    /// Buckets that differ with no change to explain it.
    pub mismatch: u64,
    /// Buckets compared row by row.
    pub hashed: u64,
    /// Key findings by failure type.
    pub failures: BTreeMap<String, u64>,
    /// Whether silver was found equal to the source at `compared_lsn` (no MISMATCH and no
    /// key failure but IN_FLIGHT); the control table's `verified_lsn` then holds it.
    pub verified: bool,
    /// The seed of the sample.
    pub seed: u64,
    /// Every bucket, in key order.
    pub bucket_list: Vec<Bucket>,
    /// The first [`LISTED_FINDINGS`] key findings.
    pub findings: Vec<KeyFinding>,
    /// Key findings in all.
    pub findings_total: u64,
    /// The chunked snapshot whose chunks were checked (with a facts table, when bronze
    /// has one).
    pub checked_snapshot: Option<Lsn>,
    /// What the chunk checks found.
    pub chunk_findings: Vec<ChunkFinding>,
}

impl ReconcileResult {
    /// Whether every bucket matched or is in flight, no key failed but in flight and every
    /// chunk check passed: the CLI's exit code 0.
    pub fn clean(&self) -> bool {
        self.mismatch == 0
            && self.chunk_findings.is_empty()
            && self
                .failures
                .iter()
                .all(|(kind, count)| *count == 0 || kind == FailureType::InFlight.name())
    }
}

/// The key a reconcile compares on: one integer or date column.
#[derive(Clone, Debug)]
pub(crate) struct GridKey {
    pub(crate) column: KeyColumn,
    pub(crate) unit: GridUnit,
    /// Whether the column is the table's unique index, alone.
    pub(crate) unique: bool,
}

impl GridKey {
    /// Whether the column is the table's one-integer unique key: its ranges are integer
    /// chunks, which the source reads by index seeks.
    pub(crate) fn is_unique_integer(&self) -> bool {
        self.unique && self.unit == GridUnit::Integer
    }

    /// A key value in grid units as JSON: an integer, or a date's `YYYY-MM-DD`.
    pub(crate) fn json(&self, units: Option<i64>) -> serde_json::Value {
        match (units, self.unit) {
            (None, _) => serde_json::Value::Null,
            (Some(value), GridUnit::Integer) => value.into(),
            (Some(days), GridUnit::Days) => date_text(days).into(),
        }
    }
}

/// Day `days` from 1970-01-01 as `YYYY-MM-DD`.
pub(crate) fn date_text(days: i64) -> String {
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).expect("the epoch is a date");
    epoch
        .checked_add_signed(chrono::TimeDelta::days(days))
        .map(|date| date.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| days.to_string())
}

/// Runs one reconcile.
pub async fn reconcile(config: &ReconcileConfig) -> Result<ReconcileResult> {
    config.check()?;
    let run_at = CommitTime(chrono::Utc::now().timestamp_micros());
    let run_id = uuid::Uuid::new_v4().to_string();
    let client = crate::stream::connect_server(&config.server).await?;
    let instance = newest_instance(&client, &config.table).await?;
    let key = grid_key(config, &instance)?;

    // 1. Silver's position first, then silver at one version.
    let control_url = tables::table_url(&config.control)?;
    let control_row = control::row(&control_url, &config.silver).await?;
    let silver_lsn: Lsn = control_row
        .as_ref()
        .and_then(|row| row.position.applied_lsn.as_deref())
        .ok_or_else(|| {
            WriterError::invalid(format!(
                "silver {} has no position in the control table {}: run apply_changes first",
                config.silver, config.control
            ))
        })?
        .parse()
        .map_err(|error| WriterError::Internal(format!("silver applied_lsn: {error}")))?;
    let silver_url = tables::table_url(&config.silver)?;
    let silver_table = tables::open(&silver_url).await?.ok_or_else(|| {
        WriterError::invalid(format!("there is no silver table at {}", config.silver))
    })?;
    let silver_version = silver_table.version().unwrap_or(0) as i64;
    let context = SessionContext::new();
    context.register_table("silver", silver_table.table_provider().await?)?;

    // 2. Tier 1: silver's keys, then the source's sums on a grid covering both.
    let started = std::time::Instant::now();
    let silver_keys = buckets::silver_units(&context, &key).await?;
    tracing::debug!(
        seconds = started.elapsed().as_secs_f64(),
        "reconcile: silver's keys read"
    );
    let cover = buckets::span(&silver_keys);
    let answer: KeySumsAnswer = client
        .action(
            "key_sums",
            &KeySumsBody {
                table: config.table.clone(),
                key: Some(key.column.name.clone()),
                cover: cover.map(|(lo, hi)| [lo, hi]),
                slices: None,
            },
        )
        .await?;
    let source_lsn = answer.stamp;
    let grid = answer
        .grid
        .map(|grid| grid.grid())
        .transpose()
        .map_err(|error| WriterError::Internal(format!("key_sums answered a bad grid: {error}")))?;
    let silver_sums = buckets::silver_sums(grid.as_ref(), &silver_keys);
    drop(silver_keys);
    let mut bucket_list = buckets::merge(&answer.sums, &silver_sums, config.bucket_rows);

    // 3. What is still in flight after the compared LSN.
    let compared_lsn = source_lsn.min(silver_lsn);
    let fresh: LsnAnswer = client.action("max_lsn", &serde_json::json!({})).await?;
    let bronze_end = control::row(&control_url, &config.table)
        .await?
        .and_then(|row| row.end)
        .map(|end| end.lsn);
    let mut in_flight = InFlight::read(
        &client,
        config,
        &key,
        compared_lsn,
        bronze_end,
        fresh.lsn.unwrap_or(source_lsn),
    )
    .await?;
    buckets::classify(&mut bucket_list, &in_flight);
    tracing::debug!(
        seconds = started.elapsed().as_secs_f64(),
        buckets = bucket_list.len(),
        "reconcile: tier 1 done (counts, key sums and the keys in flight)"
    );

    // 4. Tier 2 on every MISMATCH bucket and a sample of the MATCH ones.
    let seed = config.seed.unwrap_or_else(rand::random);
    let mut sampler = rand::rngs::StdRng::seed_from_u64(seed);
    let columns = rows::compared_columns(&instance, &context).await?;
    let mut findings = Vec::new();
    for bucket in &mut bucket_list {
        bucket.hashed = match bucket.status {
            BucketStatus::Mismatch => true,
            BucketStatus::Match => sampler.random::<f64>() < config.sample,
            BucketStatus::InFlight => false,
        };
    }
    let to_hash = bucket_list.iter().filter(|bucket| bucket.hashed).count();
    for (done, bucket) in bucket_list
        .iter()
        .filter(|bucket| bucket.hashed)
        .enumerate()
    {
        let found = rows::compare_bucket(
            &client,
            config,
            &context,
            &key,
            &columns,
            bucket,
            &mut in_flight,
        )
        .await?;
        tracing::info!(
            table = %config.table,
            bucket = done + 1,
            of = to_hash,
            rows = bucket.source.rows.max(bucket.silver.rows),
            differ = found.len(),
            "reconcile: bucket compared row by row"
        );
        findings.extend(found);
    }

    // 5. The chunk checks of bronze's newest chunked snapshot.
    let (checked_snapshot, chunk_findings) = match &config.facts {
        Some(facts) => match chunks::check(facts, &config.bronze).await? {
            Some((snapshot, found)) => (Some(snapshot), found),
            None => (None, Vec::new()),
        },
        None => (None, Vec::new()),
    };

    let mut failures = BTreeMap::new();
    for kind in FailureType::ALL {
        failures.insert(kind.name().to_string(), 0);
    }
    for check in ChunkCheck::ALL {
        failures.insert(check.name().to_string(), 0);
    }
    for finding in &findings {
        *failures
            .entry(finding.failure_type.name().to_string())
            .or_default() += 1;
    }
    for finding in &chunk_findings {
        *failures
            .entry(finding.check.name().to_string())
            .or_default() += 1;
    }
    let count =
        |status: BucketStatus| bucket_list.iter().filter(|b| b.status == status).count() as u64;
    let mut result = ReconcileResult {
        run_id,
        table: config.table.clone(),
        silver: config.silver.clone(),
        key: key.column.name.clone(),
        silver_version,
        silver_lsn,
        source_lsn,
        compared_lsn,
        changes_read: in_flight.window(),
        buckets: bucket_list.len() as u64,
        matched: count(BucketStatus::Match),
        in_flight: count(BucketStatus::InFlight),
        mismatch: count(BucketStatus::Mismatch),
        hashed: bucket_list.iter().filter(|bucket| bucket.hashed).count() as u64,
        failures,
        verified: false,
        seed,
        bucket_list,
        findings: Vec::new(),
        findings_total: findings.len() as u64,
        checked_snapshot,
        chunk_findings,
    };
    result.verified = result.clean();

    // 6. The report, then the verified LSN.
    if let Some(location) = &config.report {
        report::write(location, &result, &key, &findings, run_at).await?;
    }
    if result.verified {
        control::record_verified(&control_url, &config.silver, compared_lsn).await?;
    }
    result.findings = findings.into_iter().take(LISTED_FINDINGS).collect();
    tracing::info!(
        table = %config.table,
        silver = %config.silver,
        buckets = result.buckets,
        mismatch = result.mismatch,
        in_flight = result.in_flight,
        verified = result.verified,
        "reconcile done"
    );
    Ok(result)
}

/// The newest capture instance of `table` the capture job has processed.
async fn newest_instance(client: &CdcClient, table: &str) -> Result<CaptureInstanceInfo> {
    let instances: Vec<CaptureInstanceInfo> = client
        .action("capture_instances", &serde_json::json!({ "table": table }))
        .await?;
    instances
        .into_iter()
        .rev()
        .find(|instance| instance.start_lsn.is_some())
        .ok_or_else(|| {
            WriterError::invalid(format!(
                "{table} has no capture instance the capture job has processed"
            ))
        })
}

/// The one integer or date column a reconcile compares on.
fn grid_key(config: &ReconcileConfig, instance: &CaptureInstanceInfo) -> Result<GridKey> {
    let names = match &config.keys {
        Some(keys) => keys.clone(),
        None => instance.index_columns.clone(),
    };
    if names.is_empty() {
        return Err(WriterError::invalid(format!(
            "{} has no unique index CDC could name: pass the key column to compare on (keys)",
            config.table
        )));
    }
    let [name] = names.as_slice() else {
        return Err(WriterError::invalid(format!(
            "reconcile compares on one integer or date column; the key of {} is ({}): name one \
             such column in keys (composite and text keys are not compared yet, \
             docs/reconcile.md)",
            config.table,
            names.join(", ")
        )));
    };
    let column = instance
        .columns
        .iter()
        .find(|column| &column.name == name)
        .ok_or_else(|| {
            WriterError::invalid(format!(
                "key column '{name}' is not a captured column of {} (capture instance {})",
                config.table, instance.name
            ))
        })?;
    let column = KeyColumn {
        name: column.name.clone(),
        sql_type: column.sql_type.clone(),
    };
    let unit = column.grid_unit().ok_or_else(|| {
        WriterError::invalid(format!(
            "reconcile compares on one integer or date column; '{}' of {} is {} (text keys \
             are not compared yet, docs/reconcile.md)",
            column.name, config.table, column.sql_type
        ))
    })?;
    let unique = instance.index_columns.as_slice() == std::slice::from_ref(&column.name);
    Ok(GridKey {
        column,
        unit,
        unique,
    })
}

/// The result as text: a summary line, one line per bucket that did not match or was
/// hashed, then the listed key findings.
pub fn render(result: &ReconcileResult) -> String {
    use std::fmt::Write;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{} -> {}: {} buckets on {}, {} match, {} in flight, {} mismatch, {} hashed; compared at {} (silver {} at version {}, source {})",
        result.table,
        result.silver,
        result.buckets,
        result.key,
        result.matched,
        result.in_flight,
        result.mismatch,
        result.hashed,
        result.compared_lsn,
        result.silver_lsn,
        result.silver_version,
        result.source_lsn,
    );
    let bound = |units: Option<i64>| units.map_or("open".to_string(), |units| units.to_string());
    for bucket in &result.bucket_list {
        if bucket.status == BucketStatus::Match && !bucket.hashed {
            continue;
        }
        let _ = writeln!(
            text,
            "  bucket [{}, {}) {:<9} source {} rows (key sum {}), silver {} rows (key sum {}){}",
            bound(bucket.lo),
            bound(bucket.hi),
            bucket.status.name(),
            bucket.source.rows,
            bucket.source.key_sum,
            bucket.silver.rows,
            bucket.silver.key_sum,
            if bucket.hashed { ", hashed" } else { "" }
        );
    }
    for finding in &result.findings {
        let _ = writeln!(
            text,
            "  key {} {}{}",
            finding.key,
            finding.failure_type.name(),
            match finding.columns.is_empty() {
                true => String::new(),
                false => format!(" ({})", finding.columns.join(", ")),
            }
        );
    }
    for finding in &result.chunk_findings {
        let _ = writeln!(
            text,
            "  snapshot {} {}: {}",
            finding.snapshot,
            finding.check.name(),
            finding.finding
        );
    }
    if result.findings_total > result.findings.len() as u64 {
        let _ = writeln!(
            text,
            "  ... {} more key findings in the report table",
            result.findings_total - result.findings.len() as u64
        );
    }
    let _ = writeln!(
        text,
        "{}",
        match (result.verified, result.in_flight) {
            (true, 0) => format!(
                "verified: silver equals the source at {}",
                result.compared_lsn
            ),
            (true, in_flight) => format!(
                "verified at {}: {in_flight} buckets differ only by changes after it (in flight)",
                result.compared_lsn
            ),
            (false, _) => "not verified".to_string(),
        }
    );
    text
}
