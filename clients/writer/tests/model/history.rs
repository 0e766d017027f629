//! History (SCD type 2) in the model: applied with silver, its invariants checked after
//! every apply and sidecar run, and, once every snapshot it knows is in, compared with the
//! versions the journal gives at the points bronze saw (common/history.rs).

use mssql_cdc_writer::control;
use mssql_cdc_writer::silver::history::{self, HistoryConfig, Tracked};
use mssql_cdc_writer::tables;

use crate::common::history as model;
use crate::ops::Table;
use crate::world::{Failure, World};

impl World {
    /// History of `table`, tracking its [`Table::tracked_history_column`].
    pub(crate) fn history_config(&self, table: Table) -> HistoryConfig {
        HistoryConfig {
            table: table.source().into(),
            bronze: self.lab.lake(&format!("bronze_{}", table.name())),
            target: self.history_location(table),
            capture_instance: None,
            keys: vec![table.key().into()],
            control: self.lab.lake("control"),
            facts: self.lab.lake("facts"),
            granularity: control::Granularity::Minute,
            tracked: Tracked::Only(vec![table.tracked_history_column().into()]),
        }
    }

    fn history_location(&self, table: Table) -> String {
        self.lab.lake(&format!("history_{}", table.name()))
    }

    /// Applies the history of `table` and checks it.
    pub(crate) async fn apply_history(&self, table: Table) -> Result<(), Failure> {
        let outcome = history::apply_history(&self.history_config(table))
            .await
            .map_err(|error| format!("apply_history {}: {error}", table.source()))?;
        self.check_history(table, outcome.waiting_snapshot.is_none())
            .await?;
        self.check_history_verdict(table, outcome.finalized_until.map(|time| time.micros()))
            .await
    }

    /// What history's last verdict covered is still what it holds as of then; the new
    /// verdict's cover is kept for the next check.
    async fn check_history_verdict(
        &self,
        table: Table,
        verdict: Option<i64>,
    ) -> Result<(), Failure> {
        let location = self.history_location(table);
        let tracked = [table.tracked_history_column()];
        let previous = self.known().history_verdicts.get(&table).cloned();
        if let Some((at, covered)) = previous {
            let now = model::as_of(&location, table.key(), &tracked, at).await;
            if now != covered {
                let changed: Vec<_> = covered.symmetric_difference(&now).take(4).collect();
                return Err(format!(
                    "history of {} changed before its verdict ({at} µs): {changed:?}",
                    table.source()
                ));
            }
        }
        if let Some(verdict) = verdict {
            let covered = model::as_of(&location, table.key(), &tracked, verdict).await;
            self.known()
                .history_verdicts
                .insert(table, (verdict, covered));
        }
        Ok(())
    }

    /// History's invariants; with `settled` (every snapshot the facts record applied), its
    /// versions as the journal gives them at the points bronze saw, up to history's position.
    pub(crate) async fn check_history(&self, table: Table, settled: bool) -> Result<(), Failure> {
        let location = self.history_location(table);
        let url = tables::table_url(&location).expect("url");
        if tables::open(&url).await.expect("open").is_none() {
            return Ok(());
        }
        let tracked = [table.tracked_history_column()];
        let held = model::held(&location, table.key(), &tracked).await?;
        if !settled || self.known().history_inexact.contains(&table) {
            return Ok(());
        }
        let control_url = tables::table_url(&self.lab.lake("control")).expect("url");
        let position = control::row(&control_url, &location)
            .await
            .map_err(|error| format!("control: {error}"))?
            .unwrap_or_default()
            .position;
        let bronze = self.lab.lake(&format!("bronze_{}", table.name()));
        let applied = position.applied_lsn.unwrap_or_default();
        let commits = model::held_commits(&bronze, table.key())
            .await
            .into_iter()
            .filter(|(lsn, _)| *lsn <= applied)
            .collect();
        let snapshot_lsn = position.snapshot_lsn.unwrap_or_default();
        let snapshots: Vec<String> = model::complete_snapshots(&self.lab, &bronze)
            .await
            .into_iter()
            .filter(|s| *s <= snapshot_lsn)
            .collect();
        let expected = model::expected(
            &model::journal(&self.lab, table.source()),
            &commits,
            &snapshots,
            &|key, content| model::generated(&self.lab.db, table.source(), &tracked, key, content),
        );
        match model::differences(&expected, &held) {
            Some(differences) => Err(format!(
                "history of {} after an apply with every snapshot in: {differences}",
                table.source()
            )),
            None => Ok(()),
        }
    }
}
