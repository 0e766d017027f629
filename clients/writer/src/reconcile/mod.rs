//! Reconcile: proves silver holds exactly the source table's rows, bucket by bucket, without
//! trusting the pipeline that built it (seed ADR 0028 "Validation" and its Amendment 2;
//! docs/reconcile.md).
//!
//! One run:
//! 1. reads silver's `applied_lsn` from the control table, then silver at **one** version;
//! 2. **tier 1**, on one integer or date key ([`grid`]): the source counts its rows and sums
//!    its keys per slice of a fine grid on the key (`key_sums`, stamped with the `max_lsn`
//!    read before it); the writer does the same over silver on the same grid; slices are
//!    merged into buckets of about `bucket_rows`, each MATCH, IN_FLIGHT or MISMATCH
//!    ([`buckets`]). On any other key ([`keyset`]) the source cuts the buckets and its keys
//!    are read and placed against silver's by equality;
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
mod grid;
mod in_flight;
mod key;
mod keyset;
mod report;
mod rows;

use std::collections::BTreeMap;

use deltalake::datafusion::prelude::{SessionConfig, SessionContext};
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::Bound;
use mssql_cdc_proto::protocol::CaptureInstanceInfo;
use mssql_cdc_proto::selection::ColumnSelection;
use mssql_cdc_proto::{CommitTime, Lsn};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::control;
use crate::error::{Result, WriterError};
use crate::tables;
pub use buckets::{Bucket, BucketStatus};
pub use chunks::{ChunkCheck, ChunkFinding};
use key::CompareKey;
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
    /// Whether every value is compared: on a grid key tier 1 sums a digest of every row's
    /// values on both sides (never at `sample` 1, which reads every bucket row by row); on a
    /// keyset key, whose source sends keys and no sums, tier 2 reads every bucket. Without,
    /// values are compared in the buckets tier 2 reads only. Default true.
    pub value_sums: bool,
    /// The stream's column selection: a column it leaves out is neither asked of the server
    /// nor needed for the values to be verified (unless silver still holds it). `None`
    /// (the default): the one bronze records; another than bronze's is refused.
    pub columns: Option<ColumnSelection>,
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
            value_sums: true,
            columns: None,
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
    /// The key columns compared on, joined by commas.
    pub key: String,
    /// Whether the buckets carry key sums: a grid key (one integer or date column) does; a
    /// keyset key's buckets count rows only (and bound them by the source's key tuples).
    pub key_sums: bool,
    /// Whether the buckets carry sums of the keys' hashes too: the source answered them on
    /// every slice (a server before them answers counts and sums only).
    #[serde(default)]
    pub key_hash_sums: bool,
    /// Whether the buckets carry value sums: the source digested every compared value of
    /// its rows in tier 1's scan and silver's were digested alike, so a bucket whose sums
    /// are equal had every value compared without being read row by row.
    #[serde(default)]
    pub value_sums: bool,
    /// Buckets whose value sums differed while every row compared equal row by row: the
    /// source writes some value's canonical text otherwise than the writer (docs/
    /// reconcile.md, "Value digests"). Each is a MATCH, logged as a warning naming it.
    #[serde(default)]
    pub value_sum_rereads: u64,
    /// The source's error when it was asked for value sums and could not compute them (a
    /// value it would not convert, say): the run went on without them.
    #[serde(default)]
    pub value_sums_refused: Option<String>,
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
    /// Whether silver's **rows** were verified at `compared_lsn`: no MISMATCH (every bucket's
    /// rows and key aggregates equal, every bucket read row by row equal row by row), no key
    /// failure but IN_FLIGHT, no snapshot pending; the control table's `verified_lsn` then
    /// holds it. Values were compared only in the buckets read row by row (`hashed`).
    pub verified: bool,
    /// Whether every **value** of every row was compared too (every bucket read row by row,
    /// every captured column of the newest instance in silver) and matched: silver equals
    /// the source at `compared_lsn` but the keys in flight, and the control table's
    /// `values_verified_lsn` holds it.
    #[serde(default)]
    pub values_verified: bool,
    /// Captured columns of the newest capture instance silver does not hold, so never
    /// compared (silver not yet applied past a capture-instance switch that added them).
    #[serde(default)]
    pub uncompared_columns: Vec<String>,
    /// Captured columns of the newest capture instance the stream's selection leaves out
    /// (`columns` or `except_columns`): never copied, never compared, and not needed for
    /// `values_verified`.
    #[serde(default)]
    pub excluded_columns: Vec<String>,
    /// Compared columns the server serves masked (docs/security.md): their values are
    /// compared in the masked form, row by row only (the source digests no masked value), so
    /// they are `values_verified` only when every bucket was read row by row.
    #[serde(default)]
    pub masked_columns: Vec<String>,
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
    /// The newest snapshot bronze holds rows of that silver has not been rebuilt from yet
    /// (open, or complete and not yet applied): its rows count as in flight, and nothing is
    /// verified until silver takes it in.
    #[serde(default)]
    pub pending_snapshot: Option<Lsn>,
    /// What the chunk checks found.
    pub chunk_findings: Vec<ChunkFinding>,
    /// For a history table: its versions replayed from bronze and compared with those it
    /// holds (its current versions are what the buckets compared with the source).
    #[serde(default)]
    pub history_replay: Option<crate::silver::history::Replayed>,
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

/// The newest snapshot bronze holds rows of (a full one's or chunks) that is newer than the
/// one silver was rebuilt from. (Every snapshot row is stamped at or after its S, so
/// `_start_lsn` prunes the files of older ones.)
async fn pending_snapshot(
    config: &ReconcileConfig,
    rebuilt_from: Option<Lsn>,
) -> Result<Option<Lsn>> {
    let url = tables::table_url(&config.bronze)?;
    if tables::open(&url).await?.is_none() {
        return Ok(None);
    }
    let rows = tables::query_text(
        &url,
        &format!(
            "SELECT MAX(COALESCE(_snapshot, _start_lsn)) FROM t WHERE _operation = 0 \
             AND _start_lsn > '{rebuilt}' AND COALESCE(_snapshot, _start_lsn) > '{rebuilt}'",
            rebuilt = rebuilt_from.map(|lsn| lsn.to_string()).unwrap_or_default()
        ),
    )
    .await?;
    rows.first()
        .and_then(|row| row[0].as_deref())
        .map(|text| {
            text.parse::<Lsn>().map_err(|error| {
                WriterError::Internal(format!("bronze holds a bad _snapshot '{text}': {error}"))
            })
        })
        .transpose()
}

/// The end of the newest stream batch into `config.bronze` the facts table records (its row
/// is written after bronze's commit, so bronze holds every change up to it); `None` without
/// a facts table or row.
async fn last_batch_end(config: &ReconcileConfig) -> Result<Option<Lsn>> {
    let Some(facts) = &config.facts else {
        return Ok(None);
    };
    let rows = tables::query_text(
        &tables::table_url(facts)?,
        &format!(
            "SELECT max(end_lsn) FROM t WHERE event IS NULL AND target = {}",
            tables::quote_text(&config.bronze)
        ),
    )
    .await?;
    rows.first()
        .and_then(|row| row.first().cloned().flatten())
        .map(|lsn| {
            lsn.parse::<Lsn>().map_err(|error| {
                WriterError::Internal(format!("facts hold a bad end_lsn '{lsn}': {error}"))
            })
        })
        .transpose()
}

/// Day `days` from 1970-01-01 as `YYYY-MM-DD`.
pub(crate) fn date_text(days: i64) -> String {
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).expect("the epoch is a date");
    epoch
        .checked_add_signed(chrono::TimeDelta::days(days))
        .map(|date| date.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| days.to_string())
}

/// What the tiers found, on either kind of key.
struct Compared {
    /// `max_lsn` read before the source was counted.
    source_lsn: Lsn,
    buckets: Vec<Bucket>,
    findings: Vec<KeyFinding>,
    /// The change table's LSNs read for keys in flight.
    changes_read: (Lsn, Lsn),
    /// Whether the source hashed its keys ([`ReconcileResult::key_hash_sums`]).
    key_hash_sums: bool,
    /// Whether both sides' value digests were summed ([`ReconcileResult::value_sums`]).
    value_sums: bool,
    /// [`ReconcileResult::value_sum_rereads`].
    value_sum_rereads: u64,
    /// [`ReconcileResult::value_sums_refused`].
    value_sums_refused: Option<String>,
}

/// Where silver and bronze stand, read before the comparison.
pub(super) struct Positions {
    /// Silver's `applied_lsn`.
    silver: Lsn,
    /// The snapshot silver was last rebuilt from (its rows are applied).
    rebuilt_from: Option<Lsn>,
    /// How far bronze's stream read: the change table holds what is in flight after it.
    bronze_end: Option<Lsn>,
}

/// The seeded choice of MATCH buckets compared row by row.
struct Sample {
    share: f64,
    seed: u64,
    random: rand::rngs::StdRng,
}

impl Sample {
    fn new(share: f64, seed: u64) -> Self {
        Sample {
            share,
            seed,
            random: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// Marks every MISMATCH and IN_FLIGHT bucket and each MATCH bucket with probability
    /// `share` as hashed. An IN_FLIGHT bucket of a grid key holds a changed key, which says
    /// nothing of its other rows: compared row by row, each key that differs is IN_FLIGHT
    /// only when it changed (a row silver lost beside a key in flight is a MISMATCH finding,
    /// and no LSN is verified). A keyset key's IN_FLIGHT bucket differs only by changed keys
    /// already; comparing it again finds the same.
    fn choose(&mut self, buckets: &mut [Bucket]) {
        for bucket in buckets {
            bucket.hashed = match bucket.status {
                BucketStatus::Mismatch | BucketStatus::InFlight => true,
                BucketStatus::Match => self.random.random::<f64>() < self.share,
            };
        }
    }
}

/// Logs a bucket compared row by row (`done` of `of` so far).
fn log_bucket(
    config: &ReconcileConfig,
    (done, of): (usize, usize),
    bucket: &Bucket,
    differ: usize,
) {
    tracing::info!(
        table = %config.table,
        bucket = done + 1,
        of,
        rows = bucket.source.rows.max(bucket.silver.rows),
        differ,
        "reconcile: bucket compared row by row"
    );
}

/// The ticket of a `kind` ("snapshot", "change") endpoint a plan listed.
fn ticket<'a>(
    endpoint: &'a arrow_flight::FlightEndpoint,
    kind: &str,
) -> Result<&'a arrow_flight::Ticket> {
    endpoint
        .ticket
        .as_ref()
        .ok_or_else(|| WriterError::Internal(format!("a {kind} endpoint without a ticket")))
}

/// Runs one reconcile.
pub async fn reconcile(config: &ReconcileConfig) -> Result<ReconcileResult> {
    config.check()?;
    let run_at = CommitTime(chrono::Utc::now().timestamp_micros());
    let run_id = uuid::Uuid::new_v4().to_string();
    let client = crate::stream::connect_server(&config.server).await?;
    let instance = newest_instance(&client, &config.table).await?;
    let key_columns = key::key_columns(config, &instance)?;

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
    // Silver's strings read as Utf8, the type the server sends: tier 2 then row-encodes and
    // hashes both sides' strings as they arrive, instead of casting the source's to views.
    let context = SessionContext::new_with_config(SessionConfig::new().set_bool(
        "datafusion.execution.parquet.schema_force_view_types",
        false,
    ));
    let provider = silver_table
        .table_provider()
        .with_session(std::sync::Arc::new(context.state()))
        .await?;
    // A history table (SCD type 2) is compared by its current versions, and replayed from
    // bronze ([`crate::silver::history::replay`]).
    let history = crate::silver::history::is_history(&silver_table)?;
    if history {
        context.register_table("versions", provider)?;
        let columns = silver_table
            .snapshot()?
            .schema()
            .fields()
            .map(|field| field.name().to_string())
            .filter(|name| !crate::silver::history::VERSION_COLUMNS.contains(&name.as_str()))
            .map(|name| tables::quote_identifier(&name))
            .collect::<Vec<_>>()
            .join(", ");
        let current = context
            .sql(&format!(
                "SELECT {columns} FROM versions WHERE __is_current"
            ))
            .await?
            .into_view();
        context.register_table("silver", current)?;
    } else {
        context.register_table("silver", provider)?;
    }
    let key = key_columns.in_silver(&context).await?;
    let columns = crate::columns::resolve(
        &client,
        (&config.table, &config.bronze),
        config.columns.as_ref(),
        config.keys.as_deref().map(|keys| ("reconcile keys", keys)),
        crate::columns::Role::Reader,
    )
    .await?;
    if columns.bronze.is_none() {
        return Err(WriterError::invalid(format!(
            "there is no bronze table at {}: reconcile reads the column selection and the \
             stream's position from it",
            config.bronze
        )));
    }
    let columns = columns.selection;
    let hashing = rows::Hashing::new(&key, &instance, &columns, &context).await?;
    // Where bronze's stream stood: the change table is read for keys in flight from there.
    // The control row's end moves only with the verdict (a batch in the same period skips
    // its MERGE), so the facts' newest batch of this bronze says it better: a quiet table's
    // control end can lag past the change table's cleanup while its stream is caught up.
    let control_end = control::row(&control_url, &config.table)
        .await?
        .and_then(|row| row.end)
        .map(|end| end.lsn);
    let bronze_end = control_end.max(last_batch_end(config).await?);

    // 2-4. Tier 1, the keys in flight, tier 2.
    let seed = config.seed.unwrap_or_else(rand::random);
    // A keyset key's source sends keys, never value sums: its values are compared by reading
    // every bucket row by row, which costs little beside tier 1's read of every key.
    let share = match (&key, config.value_sums) {
        (CompareKey::Keyset(_), true) => 1.0,
        _ => config.sample,
    };
    let mut sample = Sample::new(share, seed);
    let rebuilt_from = control_row
        .as_ref()
        .and_then(|row| row.position.snapshot_lsn.as_deref())
        .map(str::parse::<Lsn>)
        .transpose()
        .map_err(|error| WriterError::Internal(format!("silver snapshot_lsn: {error}")))?;
    let positions = Positions {
        silver: silver_lsn,
        rebuilt_from,
        bronze_end,
    };
    let Compared {
        source_lsn,
        buckets: bucket_list,
        findings,
        changes_read,
        key_hash_sums,
        value_sums,
        value_sum_rereads,
        value_sums_refused,
    } = match &key {
        CompareKey::Grid(grid) => {
            let on = (&hashing, grid);
            grid::compare(&client, config, &context, on, &positions, &mut sample).await?
        }
        CompareKey::Keyset(keyset) => {
            let on = (&hashing, keyset);
            keyset::compare(&client, config, &context, on, &positions, &mut sample).await?
        }
    };
    // After the comparison read bronze for the keys in flight: a snapshot landing since is
    // then seen here (bronze's snapshot rows only grow), never excused there unseen.
    let pending_snapshot = pending_snapshot(config, rebuilt_from).await?;
    let compared_lsn = source_lsn.min(silver_lsn);

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
        key: key.label(),
        key_sums: matches!(key, CompareKey::Grid(_)),
        key_hash_sums,
        value_sums,
        value_sum_rereads,
        value_sums_refused,
        silver_version,
        silver_lsn,
        source_lsn,
        compared_lsn,
        changes_read,
        buckets: bucket_list.len() as u64,
        matched: count(BucketStatus::Match),
        in_flight: count(BucketStatus::InFlight),
        mismatch: count(BucketStatus::Mismatch),
        hashed: bucket_list.iter().filter(|bucket| bucket.hashed).count() as u64,
        failures,
        verified: false,
        values_verified: false,
        uncompared_columns: hashing.uncompared.clone(),
        excluded_columns: hashing.excluded.clone(),
        masked_columns: hashing.masked.clone(),
        seed: sample.seed,
        bucket_list,
        findings: Vec::new(),
        findings_total: findings.len() as u64,
        checked_snapshot,
        chunk_findings,
        pending_snapshot,
        history_replay: None,
    };
    if history {
        result.history_replay =
            Some(replay_history(config, key_columns_names(config, &instance)).await?);
    }
    // A snapshot silver has not taken in excuses the keys of its rows as in flight: lag, not
    // loss, so no MISMATCH; but silver is then not known equal to the source, whatever those
    // keys hold, and no LSN is verified. A history is verified only when its replay from
    // bronze lands on every version it holds.
    result.verified = result.clean()
        && pending_snapshot.is_none()
        && result
            .history_replay
            .as_ref()
            .is_none_or(|replayed| replayed.differences == 0);
    // Every value was compared: by equal value sums in tier 1 (which cover no masked
    // column), or row by row in tier 2.
    result.values_verified = result.verified
        && ((result.value_sums && result.masked_columns.is_empty())
            || result.hashed == result.buckets)
        && result.uncompared_columns.is_empty();

    // 6. The report, then the verified LSN.
    if let Some(location) = &config.report {
        report::write(location, &result, &key, &findings, run_at).await?;
    }
    if result.verified {
        control::record_verified(
            &control_url,
            &config.silver,
            compared_lsn,
            result.values_verified,
        )
        .await?;
    }
    result.findings = findings.into_iter().take(LISTED_FINDINGS).collect();
    tracing::info!(
        table = %config.table,
        silver = %config.silver,
        buckets = result.buckets,
        mismatch = result.mismatch,
        in_flight = result.in_flight,
        verified = result.verified,
        values_verified = result.values_verified,
        "reconcile done"
    );
    Ok(result)
}

/// The key columns a history of `config`'s table was applied with: `keys`, or the unique
/// index CDC uses.
fn key_columns_names(config: &ReconcileConfig, instance: &CaptureInstanceInfo) -> Vec<String> {
    config
        .keys
        .clone()
        .unwrap_or_else(|| instance.index_columns.clone())
}

/// Replays the history at `config.silver` from bronze and the facts.
async fn replay_history(
    config: &ReconcileConfig,
    keys: Vec<String>,
) -> Result<crate::silver::history::Replayed> {
    let facts = config.facts.clone().ok_or_else(|| {
        WriterError::invalid(format!(
            "{} is a history table: reconcile replays it from bronze and needs the facts table",
            config.silver
        ))
    })?;
    crate::silver::history::replay(&crate::silver::history::HistoryConfig {
        table: config.table.clone(),
        bronze: config.bronze.clone(),
        target: config.silver.clone(),
        capture_instance: None,
        keys,
        control: config.control.clone(),
        facts,
        granularity: control::Granularity::Minute,
        tracked: crate::silver::history::Tracked::All,
    })
    .await
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
    let bound = |bound: &Option<Bound>| match bound {
        None => "open".to_string(),
        Some(Bound::Int(units)) => units.to_string(),
        Some(Bound::Keys(tuple)) => serde_json::to_string(tuple).unwrap_or_default(),
    };
    for bucket in &result.bucket_list {
        if bucket.status == BucketStatus::Match && !bucket.hashed {
            continue;
        }
        let side = |side: &buckets::Side| match (result.key_sums, result.key_hash_sums) {
            (true, true) if result.value_sums => format!(
                "{} rows (key sum {}, key hash sum {}, value sum {})",
                side.rows, side.key_sum, side.key_hash_sum, side.value_sum
            ),
            (true, true) => format!(
                "{} rows (key sum {}, key hash sum {})",
                side.rows, side.key_sum, side.key_hash_sum
            ),
            (true, false) => format!("{} rows (key sum {})", side.rows, side.key_sum),
            (false, _) => format!("{} rows", side.rows),
        };
        let _ = writeln!(
            text,
            "  bucket [{}, {}) {:<9} source {}, silver {}{}",
            bound(&bucket.lo),
            bound(&bucket.hi),
            bucket.status.name(),
            side(&bucket.source),
            side(&bucket.silver),
            if bucket.hashed { ", hashed" } else { "" }
        );
    }
    if let Some(error) = &result.value_sums_refused {
        let _ = writeln!(
            text,
            "  the source could not sum its rows' value digests ({error}): values compared \
             only in the buckets read row by row"
        );
    }
    if !result.masked_columns.is_empty() {
        let _ = writeln!(
            text,
            "  columns the server serves masked, compared in their masked form row by row \
             only (no value sums): {}",
            result.masked_columns.join(", ")
        );
    }
    if result.value_sum_rereads > 0 {
        let _ = writeln!(
            text,
            "  {} buckets' value sums differed but every row compared equal: the source \
             encodes a value otherwise than the writer (a re-read, not a difference)",
            result.value_sum_rereads
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
        match (result.verified, result.values_verified) {
            (true, true) => format!(
                "verified: silver equals the source at {}, every value of every row compared{}{}",
                result.compared_lsn,
                in_flight_note(result.in_flight),
                match result.excluded_columns.is_empty() {
                    true => String::new(),
                    false => format!(
                        " (columns the stream leaves out: {})",
                        result.excluded_columns.join(", ")
                    ),
                }
            ),
            (true, false) if !result.uncompared_columns.is_empty() => format!(
                "rows verified at {}: every bucket's rows and keys match{}; values not all \
                 compared: silver lacks the captured columns {} (apply past the switch)",
                result.compared_lsn,
                in_flight_note(result.in_flight),
                result.uncompared_columns.join(", ")
            ),
            (true, false) => format!(
                "rows verified at {}: every bucket's rows and keys match{}; values compared in {} \
                 of {} buckets only (--sample 1 compares every value)",
                result.compared_lsn,
                in_flight_note(result.in_flight),
                result.hashed,
                result.buckets
            ),
            (false, _) => match result.pending_snapshot {
                Some(snapshot) if result.clean() => format!(
                    "not verified: silver has not taken snapshot {snapshot} in yet (apply after \
                     it completes)"
                ),
                _ => "not verified".to_string(),
            },
        }
    );
    text
}

/// What a verdict adds for buckets that differ only by changes after the compared LSN.
fn in_flight_note(in_flight: u64) -> String {
    match in_flight {
        0 => String::new(),
        in_flight => format!(" ({in_flight} buckets differ only by changes after it, in flight)"),
    }
}
