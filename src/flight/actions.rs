//! The `do_action` planning calls: the one table naming them (with the descriptions
//! `list_actions` shows) and their dispatch. Bodies and answers are JSON
//! (`crate::protocol`); docs/protocol.md is the reference.

use std::num::NonZeroU32;

use arrow_flight::Action;

use super::auth::Principal;
use super::masking::MaskPolicy;
use super::{CdcFlightService, json_bytes, planner, snapshot};
use crate::error::{Error, Result};
use crate::keys::KeysetSeek;
use crate::lsn::Lsn;
use crate::offset::Offset;
use crate::protocol::{
    self, CaptureInstanceBody, CountAnswer, InitialOffsetBody, LatestOffsetBody, LsnAnswer,
    LsnBody, NthCommitBody, RangeBody, TableBody, TimeAnswer, parse_body,
};
use crate::source::{InstanceRange, KeyGrid, TableName};

/// Declares [`ActionKind`] from one table of `Variant = "name": "description"`.
macro_rules! actions {
    ($($variant:ident = $name:literal: $description:expr,)+) => {
        /// Every action `do_action` serves.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum ActionKind {
            $(
                #[doc = $description]
                $variant,
            )+
        }

        impl ActionKind {
            /// Every action, in the order `list_actions` shows them.
            pub const ALL: &[ActionKind] = &[$(ActionKind::$variant),+];

            /// The action's name on the wire (`Action.type`).
            pub fn name(self) -> &'static str {
                match self {
                    $(ActionKind::$variant => $name,)+
                }
            }

            /// What the action takes and answers, for `list_actions`.
            pub fn description(self) -> &'static str {
                match self {
                    $(ActionKind::$variant => $description,)+
                }
            }
        }
    };
}

actions! {
    MaxLsn = "max_lsn": "{} -> {\"lsn\"}: sys.fn_cdc_get_max_lsn()",
    MinLsn = "min_lsn": "{\"capture_instance\"} -> {\"lsn\"}: sys.fn_cdc_get_min_lsn(ci)",
    IncrementLsn = "increment_lsn": "{\"lsn\"} -> {\"lsn\"}: sys.fn_cdc_increment_lsn",
    DecrementLsn = "decrement_lsn": "{\"lsn\"} -> {\"lsn\"}: sys.fn_cdc_decrement_lsn",
    LsnToTime = "lsn_to_time": "{\"lsn\"} -> {\"commit_ts\"}: commit time (UTC) of the commit at lsn",
    TimeToLsn = "time_to_lsn": "{\"time\"} -> {\"lsn\"}: the last commit at or before a UTC time (sys.fn_cdc_map_time_to_lsn, largest less than or equal)",
    NthCommitAfter = "nth_commit_after": "{\"lsn\", \"n\"} -> {\"lsn\"}: the n-th commit after lsn (or the last)",
    CaptureInstances = "capture_instances": "{\"table\"} -> [capture instance]: the table's instances, oldest first",
    DdlHistory = "ddl_history": "{\"capture_instance\", \"from\", \"to\"} -> [ddl]: DDL with from < lsn <= to",
    SplitPoints = "split_points": "{\"capture_instance\", \"from\", \"to\", \"n\"} -> [{\"last_lsn\", \"rows\"}]",
    CountChanges = "count_changes": "{\"capture_instance\", \"from\", \"to\"} -> {\"rows\"}: change rows in [from, to]",
    InitialOffset = "initial_offset": "{\"table\", \"starting\"} -> offset: where a new stream starts",
    LatestOffset = "latest_offset": "{\"start\", \"max_commits\", \"upper\"} -> offset: the end of the next range",
    WaitForCommits = "wait_for_commits": "{\"after\", \"timeout_ms\"?, \"tables\"?} -> {\"lsn\", \"timed_out\", \"changed\"?}: the live tail, answers once max_lsn is past after, or with tables once one of them has changes (or at the timeout)",
    SnapshotLsn = "snapshot_lsn": "{\"table\"} -> {\"lsn\"}: the stamp a snapshot read now would get",
    KeyExtent = "key_extent": "{\"table\"} -> {\"column\", \"sql_type\", \"min\", \"max\", \"rows\"}: the key and its extent",
    KeyBuckets = "key_buckets": "{\"table\", \"lo\", \"hi\", \"width\"} -> [{\"lo\", \"hi\", \"rows\"}]: rows per key slice",
    KeySums = "key_sums": "{\"table\", \"key\"?, \"cover\"?, \"slices\"?, \"values\"?} -> {\"stamp\", \"key\", \"grid\", \"null_rows\", \"null_value_sum\"?, \"slices\": [{\"lo\", \"hi\", \"rows\", \"key_sum\", \"key_hash_sum\", \"value_sum\"?}]}: rows, key sums and (with values) value digest sums per slice of a fine grid on one integer or date column (reconcile)",
    KeyMax = "key_max": "{\"table\", \"keys\"?} -> {\"keys\", \"unique\", \"max\"}: the columns a snapshot is cut on and the largest key",
    KeyBound = "key_bound": "{\"table\", \"keys\"?, \"from\"?, \"from_inclusive\"?, \"to\"?, \"to_inclusive\"?, \"n\"} -> {\"bound\"}: the key of the (n + 1)-th row of a range, in the source's order",
}

impl ActionKind {
    /// The action called `name`; an unknown name is refused with the known ones.
    pub fn named(name: &str) -> Result<Self> {
        ActionKind::ALL
            .iter()
            .copied()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = ActionKind::ALL.iter().map(|kind| kind.name()).collect();
                Error::invalid(format!(
                    "unknown action '{name}' (known: {})",
                    known.join(", ")
                ))
            })
    }
}

impl CdcFlightService {
    /// `NOT_FOUND` unless `principal` may read the table of `capture_instance`: an instance
    /// of a table it may not read is answered as one that does not exist, and a missing one
    /// without the source's hint of similar names (they may be other tables'), unless the
    /// principal reads every table, so the answer never tells which names exist elsewhere.
    async fn check_instance(&self, principal: &Principal, capture_instance: &str) -> Result<()> {
        let hidden = || Error::CaptureInstanceNotFound {
            name: capture_instance.to_string(),
            hint: String::new(),
        };
        match self.source.capture_instance(capture_instance).await {
            Ok(instance) if principal.may_read(&instance.table) => Ok(()),
            Ok(_) => Err(hidden()),
            Err(Error::CaptureInstanceNotFound { .. }) if !principal.reads_every_table() => {
                Err(hidden())
            }
            // A catalog that could not be read names the instance and column at fault, which
            // may be another table's: the log has them, a caller who may not read every
            // table gets none.
            Err(error) if !principal.reads_every_table() && !error.is_transient() => {
                tracing::warn!(%error, principal = %principal.name,
                    "reading the CDC catalog for a capture-instance action failed");
                Err(Error::SourceUnavailable(
                    "the source's CDC catalog could not be read (the server's log has the \
                     cause)"
                        .into(),
                ))
            }
            Err(error) => Err(error),
        }
    }

    /// A range action's body, parsed and checked: `from <= to`, and `PERMISSION_DENIED`
    /// unless `principal` may read the table of its capture instance.
    async fn range_body(
        &self,
        principal: &Principal,
        name: &str,
        body: &[u8],
    ) -> Result<RangeBody> {
        let body: RangeBody = parse_body(name, body)?;
        if body.from > body.to {
            return Err(Error::invalid(format!(
                "from {} is past to {}",
                body.from, body.to
            )));
        }
        self.check_instance(principal, &body.capture_instance)
            .await?;
        Ok(body)
    }

    /// How long a `wait_for_commits` call waits: its `timeout_ms` (default
    /// [`protocol::DEFAULT_WAIT_MS`], at most [`protocol::MAX_WAIT_MS`]), ending a second
    /// before the server's call deadline so the answer always arrives.
    fn wait_timeout(&self, timeout_ms: Option<u64>) -> Result<std::time::Duration> {
        let asked = timeout_ms.unwrap_or(protocol::DEFAULT_WAIT_MS);
        if asked > protocol::MAX_WAIT_MS {
            return Err(Error::invalid(format!(
                "wait_for_commits waits at most {} ms, not {asked}",
                protocol::MAX_WAIT_MS
            )));
        }
        let deadline = self
            .limits
            .call_timeout
            .saturating_sub(std::time::Duration::from_secs(1));
        Ok(std::time::Duration::from_millis(asked).min(deadline))
    }

    /// `wait_for_commits` with `tables`: waits on the shared watcher, and each time
    /// `max_lsn` moves checks the tables' capture instances for change rows in the new
    /// range, in one source call; answers once one has some, or at the timeout with the LSN
    /// the tables were checked through.
    async fn wait_for_tables(
        &self,
        principal: &Principal,
        after: Lsn,
        tables: &[String],
        timeout: std::time::Duration,
    ) -> Result<protocol::WaitForCommitsAnswer> {
        if tables.is_empty() || tables.len() > protocol::MAX_WAIT_TABLES {
            return Err(Error::invalid(format!(
                "wait_for_commits waits on 1 to {} tables, not {}",
                protocol::MAX_WAIT_TABLES,
                tables.len()
            )));
        }
        let mut names = Vec::with_capacity(tables.len());
        for table in tables {
            names.push(Self::granted(principal, table)?);
        }
        // Every instance of every table, the pending ones too: a commit shows in each
        // instance that captures it. Resolved once per call, with one catalog read. A table
        // CDC does not track (yet) has no changes: it is not an error, so one such table
        // among many does not stop the wait of the others (its own reads report it).
        // The wait takes no place in the principal's share; its source reads do, each its own.
        let share = || self.share.wait(principal.bounded_name(), None);
        let tracked = {
            let _permit = share().await?;
            self.source.tracked_tables().await?
        };
        let mut instances: Vec<(String, usize)> = Vec::new();
        for (position, name) in names.iter().enumerate() {
            if let Some(found) = tracked.iter().find(|tracked| &tracked.table == name) {
                instances.extend(
                    found
                        .capture_instances
                        .iter()
                        .map(|instance| (instance.name.clone(), position)),
                );
            }
        }
        let instance_names: Vec<String> = instances.iter().map(|(name, _)| name.clone()).collect();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut checked = after;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let outcome = self.commits.wait_after(checked, left).await;
            let Some(lsn) = outcome.max_lsn.filter(|lsn| *lsn > checked) else {
                return Ok(protocol::WaitForCommitsAnswer {
                    lsn: Some(checked),
                    timed_out: true,
                    changed: Some(Vec::new()),
                });
            };
            let found = if instance_names.is_empty() {
                Vec::new()
            } else {
                let _permit = share().await?;
                self.source
                    .instances_with_changes(&instance_names, checked, lsn)
                    .await?
            };
            checked = lsn;
            if !found.is_empty() {
                let mut positions: Vec<usize> = instances
                    .iter()
                    .filter(|(name, _)| found.contains(name))
                    .map(|(_, position)| *position)
                    .collect();
                positions.sort_unstable();
                positions.dedup();
                return Ok(protocol::WaitForCommitsAnswer {
                    lsn: Some(lsn),
                    timed_out: false,
                    changed: Some(positions.into_iter().map(|at| tables[at].clone()).collect()),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(protocol::WaitForCommitsAnswer {
                    lsn: Some(lsn),
                    timed_out: true,
                    changed: Some(Vec::new()),
                });
            }
        }
    }

    /// `Masked` when `principal` gets a key column of `table` masked: key calls answer key
    /// values (bounds, maxima) or count rows between bounds a client picks.
    fn refuse_masked_keys<'a>(
        &self,
        principal: &Principal,
        table: &TableName,
        keys: impl IntoIterator<Item = &'a str>,
    ) -> Result<()> {
        self.masks
            .refuse_masked(principal, table, keys, "seek or count on it")
    }

    /// [`Self::refuse_masked_keys`] of the unique index CDC uses, asked before the source
    /// is (the catalog read only when the masks file masks the table).
    async fn refuse_masked_index(&self, principal: &Principal, table: &TableName) -> Result<()> {
        if !self.masks.masks_table(table) {
            return Ok(());
        }
        self.masks_fit(table).await?;
        let (keys, _) = snapshot::table_keys(self.source.as_ref(), table, None).await?;
        self.refuse_masked_keys(principal, table, keys.iter().map(|key| &*key.name))
    }

    /// `table` parsed, and `PERMISSION_DENIED` unless `principal` may read it.
    fn granted(principal: &Principal, table: &str) -> Result<TableName> {
        let table: TableName = table.parse()?;
        principal.check(&table)?;
        Ok(table)
    }

    /// Answers one action of `principal`: its JSON body in, its JSON answer out. An action
    /// naming a table or a capture instance is checked against the principal's tables; the
    /// database-wide LSN functions are open to every principal.
    pub(super) async fn action(
        &self,
        principal: &Principal,
        action: &Action,
    ) -> Result<bytes::Bytes> {
        let kind = ActionKind::named(&action.r#type)?;
        let name = kind.name();
        let body = action.body.as_ref();
        let source = self.source.as_ref();
        Ok(match kind {
            ActionKind::MaxLsn => {
                parse_body::<serde_json::Map<String, serde_json::Value>>(name, body).and_then(
                    |map| {
                        map.is_empty()
                            .then_some(())
                            .ok_or_else(|| Error::invalid("max_lsn takes no fields"))
                    },
                )?;
                json_bytes(&LsnAnswer {
                    lsn: source.max_lsn().await?,
                })
            }
            ActionKind::MinLsn => {
                let body: CaptureInstanceBody = parse_body(name, body)?;
                self.check_instance(principal, &body.capture_instance)
                    .await?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.min_lsn(&body.capture_instance).await?),
                })
            }
            ActionKind::IncrementLsn => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.increment_lsn(body.lsn).await?),
                })
            }
            ActionKind::DecrementLsn => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.decrement_lsn(body.lsn).await?),
                })
            }
            ActionKind::LsnToTime => {
                let body: LsnBody = parse_body(name, body)?;
                json_bytes(&TimeAnswer {
                    commit_ts: source.lsn_to_time(body.lsn).await?,
                })
            }
            ActionKind::TimeToLsn => {
                let body: protocol::TimeBody = parse_body(name, body)?;
                json_bytes(&LsnAnswer {
                    lsn: source.commit_at_or_before(body.time).await?,
                })
            }
            ActionKind::NthCommitAfter => {
                let body: NthCommitBody = parse_body(name, body)?;
                if body.n == 0 {
                    return Err(Error::invalid("nth_commit_after needs n >= 1"));
                }
                json_bytes(&LsnAnswer {
                    lsn: source.nth_commit_after(body.lsn, body.n).await?,
                })
            }
            ActionKind::CaptureInstances => {
                let body: TableBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                let mut infos = Vec::new();
                for instance in source.capture_instances(&table).await? {
                    infos.push(self.instance_info(principal, instance).await?);
                }
                json_bytes(&infos)
            }
            ActionKind::DdlHistory => {
                let body = self.range_body(principal, name, body).await?;
                json_bytes(&source.ddl_history(range_of(&body)).await?)
            }
            ActionKind::SplitPoints => {
                let body = self.range_body(principal, name, body).await?;
                let n = body
                    .n
                    .ok_or_else(|| Error::invalid("split_points needs n"))?;
                let tiles = NonZeroU32::new(n)
                    .filter(|n| n.get() <= protocol::MAX_PARTITIONS)
                    .ok_or_else(|| {
                        Error::invalid(format!("n must be 1 to {}", protocol::MAX_PARTITIONS))
                    })?;
                json_bytes(&source.split_points(range_of(&body), tiles).await?)
            }
            ActionKind::SnapshotLsn => {
                let body: TableBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                json_bytes(&LsnAnswer {
                    lsn: Some(source.snapshot_lsn(&table).await?),
                })
            }
            ActionKind::KeyExtent => {
                let body: TableBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                self.refuse_masked_index(principal, &table).await?;
                json_bytes(&source.key_extent(&table).await?)
            }
            ActionKind::KeyBuckets => {
                let body: protocol::KeyBucketsBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                self.refuse_masked_index(principal, &table).await?;
                let grid = KeyGrid::new(body.lo, body.hi, body.width)?;
                if grid.slices() > 100_000 {
                    return Err(Error::invalid(
                        "key_buckets answers at most 100,000 slices: widen the slices",
                    ));
                }
                json_bytes(&source.key_buckets(&table, grid).await?)
            }
            ActionKind::KeySums => {
                let body: protocol::KeySumsBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                self.masks_fit(&table).await?;
                json_bytes(&key_sums(source, (&self.masks, principal), &table, &body).await?)
            }
            ActionKind::KeyMax => {
                let body: protocol::KeyMaxBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                self.masks_fit(&table).await?;
                let (keys, unique) =
                    snapshot::table_keys(source, &table, body.keys.as_deref()).await?;
                self.refuse_masked_keys(principal, &table, keys.iter().map(|key| &*key.name))?;
                let max = source.key_max(&table, &keys).await?;
                json_bytes(&protocol::KeyMaxAnswer { keys, unique, max })
            }
            ActionKind::KeyBound => {
                let body: protocol::KeyBoundBody = parse_body(name, body)?;
                let table = Self::granted(principal, &body.table)?;
                self.masks_fit(&table).await?;
                self.limits.check_seek_rows(body.seek.n)?;
                let (keys, _) = snapshot::table_keys(source, &table, body.keys.as_deref()).await?;
                self.refuse_masked_keys(principal, &table, keys.iter().map(|key| &*key.name))?;
                let seek = KeysetSeek::new(keys, body.seek)?;
                json_bytes(&protocol::KeyBoundAnswer {
                    bound: source.key_bound(&table, &seek).await?,
                })
            }
            ActionKind::WaitForCommits => {
                let body: protocol::WaitForCommitsBody = parse_body(name, body)?;
                let timeout = self.wait_timeout(body.timeout_ms)?;
                if let Some(tables) = &body.tables {
                    return Ok(json_bytes(
                        &self
                            .wait_for_tables(principal, body.after, tables, timeout)
                            .await?,
                    ));
                }
                let outcome = self.commits.wait_after(body.after, timeout).await;
                json_bytes(&protocol::WaitForCommitsAnswer {
                    lsn: outcome.max_lsn,
                    timed_out: outcome.timed_out,
                    changed: None,
                })
            }
            ActionKind::CountChanges => {
                let body = self.range_body(principal, name, body).await?;
                let tiles = source
                    .split_points(range_of(&body), NonZeroU32::MIN)
                    .await?;
                json_bytes(&CountAnswer {
                    rows: tiles.iter().map(|tile| tile.rows).sum(),
                })
            }
            ActionKind::InitialOffset => {
                let body: InitialOffsetBody = parse_body(name, body)?;
                Self::granted(principal, &body.table)?;
                json_bytes(&self.initial_offset(&body).await?)
            }
            ActionKind::LatestOffset => {
                let body: LatestOffsetBody = parse_body(name, body)?;
                json_bytes(&self.latest_offset(&body).await?)
            }
        })
    }

    async fn offset_at(&self, lsn: Lsn) -> Result<Offset> {
        Ok(Offset::new(lsn, self.source.lsn_to_time(lsn).await?))
    }

    /// Where a new stream starts: `earliest` is just before the oldest instance's `min_lsn`
    /// (so the first range starts at it); `latest` is `max_lsn`, or just before a newer
    /// instance's start LSN the database has not reached yet.
    async fn initial_offset(&self, body: &InitialOffsetBody) -> Result<Offset> {
        let table: TableName = body.table.parse()?;
        let instances = self.source.active_capture_instances(&table).await?;
        match body.starting.as_deref().unwrap_or("earliest") {
            "earliest" => {
                let oldest = instances.first().ok_or_else(|| Error::TableNotFound {
                    table: table.to_string(),
                })?;
                let min_lsn = self.source.min_lsn(&oldest.name).await?;
                self.offset_at(min_lsn.decrement()).await
            }
            "latest" => {
                let mut lsn = self.source.max_lsn().await?.unwrap_or(Lsn::ZERO);
                for start in instances.iter().filter_map(|instance| instance.start_lsn) {
                    if start > lsn {
                        lsn = start.decrement();
                    }
                }
                self.offset_at(lsn).await
            }
            explicit => {
                let lsn: Lsn = explicit.parse().map_err(|error| {
                    Error::invalid(format!(
                        "starting must be earliest, latest or an LSN: {error}"
                    ))
                })?;
                self.offset_at(lsn).await
            }
        }
    }

    /// The end of the next range: `max_lsn` (or `upper`), capped at `max_commits` commits
    /// after `start`; `start` itself when nothing is newer.
    async fn latest_offset(&self, body: &LatestOffsetBody) -> Result<Offset> {
        if body.max_commits == Some(0) {
            return Err(Error::invalid(
                "max_commits must be at least 1; omit it to read up to max_lsn",
            ));
        }
        let max_lsn = self.source.max_lsn().await?.unwrap_or(Lsn::ZERO);
        let mut upper = body.upper.map_or(max_lsn, |upper| upper.min(max_lsn));
        if let Some(start) = &body.start {
            if upper <= start.lsn {
                return Ok(*start);
            }
            if let Some(n) = body.max_commits
                && let Some(nth) = self.source.nth_commit_after(start.lsn, n).await?
            {
                upper = upper.min(nth);
            }
        }
        self.offset_at(upper).await
    }
}

/// The source call's range of a range body.
fn range_of(body: &RangeBody) -> InstanceRange<'_> {
    InstanceRange::new(&body.capture_instance, body.from, body.to)
}

/// `key_sums`: `max_lsn` read first (the stamp), then the column's extent, then one scan
/// counting every row on a grid covering the extent and the body's `cover`.
async fn key_sums(
    source: &dyn crate::source::CdcSource,
    (masks, principal): (&MaskPolicy, &Principal),
    table: &TableName,
    body: &protocol::KeySumsBody,
) -> Result<protocol::KeySumsAnswer> {
    let names = body.key.clone().map(|key| vec![key]);
    let (keys, _) = snapshot::table_keys(source, table, names.as_deref()).await?;
    masks.refuse_masked(
        principal,
        table,
        keys.iter().map(|key| key.name.as_str()),
        "count on it",
    )?;
    // The source digests values in clear: a digest of a masked column would compare clear
    // values with the masked ones a reader holds, and test guesses at the clear ones.
    masks.refuse_masked(
        principal,
        table,
        body.values.iter().flatten().map(String::as_str),
        "digest its values at the source",
    )?;
    let [key] = keys.as_slice() else {
        return Err(Error::invalid(format!(
            "key_sums counts on one column; the unique index of {table} has {} ({}): name one \
             integer or date column in key",
            keys.len(),
            keys.iter()
                .map(|key| key.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    key.require_grid_unit()?;
    let slices = body.slices.unwrap_or(protocol::MAX_KEY_SUM_SLICES);
    if slices == 0 || slices > protocol::MAX_KEY_SUM_SLICES {
        return Err(Error::invalid(format!(
            "slices must be between 1 and {}",
            protocol::MAX_KEY_SUM_SLICES
        )));
    }
    if let Some([lo, hi]) = body.cover
        && lo > hi
    {
        return Err(Error::invalid(format!(
            "cover [{lo}, {hi}] ends before it starts"
        )));
    }
    let values = match body.values.as_deref() {
        None | Some([]) => Vec::new(),
        Some(names) if names.len() > protocol::MAX_DIGEST_COLUMNS => {
            return Err(Error::invalid(format!(
                "values names {} columns; at most {} are digested",
                names.len(),
                protocol::MAX_DIGEST_COLUMNS
            )));
        }
        Some(names) => {
            let instances = source.active_capture_instances(table).await?;
            let captured = planner::union_columns(table, &instances)?;
            planner::select_columns(table, captured, Some(names))?
        }
    };
    let stamp = source.max_lsn().await?.unwrap_or(Lsn::ZERO);
    let span = source.key_span(table, key).await?;
    let extent = match (span, body.cover) {
        (Some((lo, hi)), Some([cover_lo, cover_hi])) => Some((lo.min(cover_lo), hi.max(cover_hi))),
        (Some(span), None) => Some(span),
        (None, Some([lo, hi])) => Some((lo, hi)),
        (None, None) => None,
    };
    let grid = extent
        .map(|(lo, hi)| KeyGrid::covering(lo, hi, slices))
        .transpose()?;
    let sums = match grid {
        Some(grid) => source.key_sums(table, key, grid, &values).await?,
        // No key anywhere: only NULL keys (or no rows) to count, on any grid.
        None => {
            let any = KeyGrid::new(0, 0, 1)?;
            source.key_sums(table, key, any, &values).await?
        }
    };
    Ok(protocol::KeySumsAnswer {
        stamp,
        key: key.clone(),
        grid: grid.map(Into::into),
        sums,
    })
}
