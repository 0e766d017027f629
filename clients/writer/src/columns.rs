//! A table's column selection (`columns` or `except_columns`) checked against its capture
//! instances before a stream or a snapshot reads with it: the server serves what it is
//! asked, so what only the writer knows is checked here.
//!
//! - No key column is left out: silver merges on the unique index, chunked snapshots cut
//!   on it (or on `snapshot_keys`), reconcile compares on it.
//! - Every excluded name is captured by some instance. The server passes over a name no
//!   instance captures (so a column a later DDL dropped does not break a reader), but here a
//!   typo would copy the very column the operator meant to hide.

use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::CaptureInstanceInfo;
use mssql_cdc_proto::selection::{ColumnSelection, same_name};

use crate::error::{Result, WriterError};
use crate::stream::StreamConfig;

/// Checks `config`'s selection against the table's capture instances (nothing to check
/// when it selects every column).
pub async fn check(client: &CdcClient, config: &StreamConfig) -> Result<()> {
    if config.columns == ColumnSelection::All {
        return Ok(());
    }
    let instances: Vec<CaptureInstanceInfo> = client
        .action(
            "capture_instances",
            &serde_json::json!({"table": config.table}),
        )
        .await?;
    check_against(
        &config.table,
        &config.columns,
        config.snapshot_keys.as_deref(),
        &instances,
    )
}

/// [`check`] of `table`'s `selection` over instances already read.
pub fn check_against(
    table: &str,
    selection: &ColumnSelection,
    snapshot_keys: Option<&[String]>,
    instances: &[CaptureInstanceInfo],
) -> Result<()> {
    let flag = match selection {
        ColumnSelection::Only(_) => "columns",
        _ => "except_columns",
    };
    let keys = instances
        .iter()
        .map(|instance| (instance.name.as_str(), instance.index_columns.as_slice()))
        .chain(snapshot_keys.map(|keys| ("snapshot_keys", keys)));
    for (owner, keys) in keys {
        if let Some(key) = keys.iter().find(|key| selection.excludes(key)) {
            return Err(WriterError::invalid(format!(
                "{table}: {flag} leaves out the key column '{key}' ({owner}): silver, chunked \
                 snapshots and reconcile need every key column"
            )));
        }
    }
    if let ColumnSelection::Except(names) = selection {
        let captured = || {
            instances
                .iter()
                .flat_map(|instance| &instance.columns)
                .map(|column| column.name.as_str())
        };
        if let Some(unknown) = names
            .iter()
            .find(|name| !captured().any(|column| same_name(column, name)))
        {
            let mut all: Vec<&str> = captured().collect();
            all.dedup();
            return Err(WriterError::invalid(format!(
                "{table}: except_columns names '{unknown}', which no capture instance captures \
                 (captured: {}): a misspelt name would copy the column it meant to leave out; \
                 drop the name if a DDL removed the column",
                all.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use mssql_cdc_proto::catalog::CapturedColumn;
    use mssql_cdc_proto::types::SqlType;

    use super::*;

    fn instance(columns: &[&str], keys: &[&str]) -> CaptureInstanceInfo {
        CaptureInstanceInfo {
            name: "dbo_people".into(),
            table: "dbo.people".into(),
            start_lsn: None,
            min_lsn: None,
            create_date: mssql_cdc_proto::CommitTime(0),
            columns: columns
                .iter()
                .enumerate()
                .map(|(index, name)| CapturedColumn {
                    name: name.to_string(),
                    column_id: index as i32 + 1,
                    ordinal: index as i32 + 1,
                    sql_type: SqlType::Int,
                })
                .collect(),
            index_columns: keys.iter().map(|key| key.to_string()).collect(),
        }
    }

    fn refusal(
        selection: ColumnSelection,
        snapshot_keys: Option<&[&str]>,
        instances: &[CaptureInstanceInfo],
    ) -> String {
        let keys: Option<Vec<String>> =
            snapshot_keys.map(|keys| keys.iter().map(|key| key.to_string()).collect());
        check_against("dbo.people", &selection, keys.as_deref(), instances)
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn a_key_column_cannot_be_left_out() {
        let instances = [instance(&["id", "email", "region"], &["id"])];
        let except = ColumnSelection::Except(vec!["ID".into()]);
        assert!(refusal(except, None, &instances).contains("key column 'id'"));
        let only = ColumnSelection::Only(vec!["email".into()]);
        assert!(refusal(only, None, &instances).contains("key column 'id'"));
        let cut = ColumnSelection::Except(vec!["region".into()]);
        let message = refusal(cut, Some(&["region"]), &instances);
        assert!(message.contains("snapshot_keys"), "{message}");
        let fine = ColumnSelection::Except(vec!["Email".into()]);
        check_against("dbo.people", &fine, None, &instances).expect("email may be left out");
    }

    #[test]
    fn an_excluded_name_no_instance_captures_is_refused() {
        let instances = [
            instance(&["id", "email"], &["id"]),
            instance(&["id", "email", "phone"], &["id"]),
        ];
        let typo = ColumnSelection::Except(vec!["emial".into()]);
        let message = refusal(typo, None, &instances);
        assert!(
            message.contains("'emial'") && message.contains("phone"),
            "{message}"
        );
        let newer = ColumnSelection::Except(vec!["PHONE".into()]);
        check_against("dbo.people", &newer, None, &instances)
            .expect("captured by the newer instance");
    }
}
