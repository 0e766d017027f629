//! A table's column selection (`columns` or `except_columns`): recorded on its bronze table,
//! resolved by every reader before it reads, and checked against the capture instances.
//!
//! **Recorded on bronze.** The table property [`PROPERTY`] holds the selection bronze was
//! written under (`{"except_columns": [...]}` or `{"columns": [...]}`; absent: every
//! column). The stream owns it ([`Role::Stream`]): a stream given a selection records it
//! when it differs (a metadata commit, logged). Every other reader ([`Role::Reader`]:
//! snapshots, backfill, seed, reconcile) given none follows bronze's, and one given another
//! is refused, so a command run by hand without the flags cannot copy a column the stream
//! leaves out. The first writer of a new bronze records its selection in the create commit.
//!
//! **Checked against the capture instances**, since the server serves what it is asked:
//!
//! - No key column is left out: silver merges on the unique index, chunked snapshots cut on
//!   it (or on `snapshot_keys`), reconcile compares on it (or on its `keys`).
//! - Every excluded name is captured by some instance. The server passes over a name no
//!   instance captures (so a column a later DDL dropped does not break a reader), but here a
//!   typo would copy the very column the operator meant to hide.

use std::collections::HashMap;

use deltalake::DeltaTable;
use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::protocol::CaptureInstanceInfo;
use mssql_cdc_proto::selection::{ColumnSelection, same_name};

use crate::error::{Result, WriterError};
use crate::tables;

/// The bronze table property recording the selection its rows were written under.
pub const PROPERTY: &str = "mssql_cdc.columns";

/// Who resolves a selection: the table's stream may change bronze's, a reader may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The table's stream: records a selection it is given that bronze does not hold yet.
    Stream,
    /// Snapshots, backfill, seed, reconcile: follow bronze's, refuse another.
    Reader,
}

/// What a reader of a table reads with.
pub struct Resolved {
    /// The selection every plan asks for.
    pub selection: ColumnSelection,
    /// Bronze, when it exists.
    pub bronze: Option<DeltaTable>,
    /// For a stream given a selection bronze does not record: the one bronze records now,
    /// which [`record`] replaces.
    pub replaces: Option<ColumnSelection>,
    /// The form the server serves this writer each column of `selection` in.
    pub masks: crate::masks::Forms,
}

/// The selection bronze records; `None` when it records none (every column).
pub fn recorded(bronze: &DeltaTable) -> Result<Option<ColumnSelection>> {
    let snapshot = bronze.snapshot()?;
    let Some(text) = snapshot.metadata().configuration().get(PROPERTY) else {
        return Ok(None);
    };
    ColumnSelection::from_json(text).map(Some).map_err(|error| {
        WriterError::invalid(format!("bronze's {PROPERTY} is not a selection: {error}"))
    })
}

/// The table properties a new bronze of `selection` is created with.
pub fn creation_properties(selection: &ColumnSelection) -> HashMap<String, String> {
    selection
        .to_json()
        .map(|json| HashMap::from([(PROPERTY.to_string(), json)]))
        .unwrap_or_default()
}

/// Refuses to write into `bronze` when it records another selection than `selection`: one
/// recorded since this run resolved its own (the stream changed it meanwhile).
pub fn check_recorded(
    bronze: &DeltaTable,
    selection: &ColumnSelection,
    target: &str,
) -> Result<()> {
    let recorded = recorded(bronze)?.unwrap_or_default();
    match recorded.same_as(selection) {
        true => Ok(()),
        false => Err(WriterError::invalid(format!(
            "bronze {target} now records {recorded}, this run read with {selection}: its stream \
             changed the column selection meanwhile; run again to follow it"
        ))),
    }
}

/// The selection `table`'s reader reads with, given the one it was `asked` for (`None`:
/// follow bronze's) and the key columns it needs besides the unique index (`keys`, named by
/// what needs them),
/// checked against the table's capture instances. A stream records a new one on bronze.
pub async fn resolve(
    client: &CdcClient,
    (table, target): (&str, &str),
    asked: Option<&ColumnSelection>,
    keys: Option<(&str, &[String])>,
    role: Role,
) -> Result<Resolved> {
    let bronze = tables::open(&tables::table_url(target)?).await?;
    let recorded = bronze.as_ref().map(recorded).transpose()?.flatten();
    let holds = recorded.clone().unwrap_or_default();
    let (selection, change) = match asked {
        None => (holds.clone(), false),
        Some(asked) if asked.same_as(&holds) || bronze.is_none() => (asked.clone(), false),
        Some(asked) if role == Role::Stream => (asked.clone(), true),
        Some(asked) => {
            return Err(WriterError::invalid(format!(
                "{table}: bronze {target} records {holds}, and this command asks for {asked}: \
                 leave the column flags out to follow bronze, or change the selection in the \
                 table's stream (run or the sidecar file)"
            )));
        }
    };
    let instances: Vec<CaptureInstanceInfo> = client
        .action("capture_instances", &serde_json::json!({ "table": table }))
        .await?;
    check_against(table, &selection, keys, &instances)?;
    Ok(Resolved {
        masks: crate::masks::served_of(&instances, &selection),
        selection,
        replaces: (change && bronze.is_some()).then_some(holds),
        bronze,
    })
}

/// Records the stream's `resolved` selection on bronze when it replaces another (a metadata
/// commit, so a bronze append in flight from before it fails its commit and reads again).
pub async fn record(table: &str, target: &str, mut resolved: Resolved) -> Result<()> {
    if let Some(bronze) = &resolved.bronze
        && crate::masks::record(bronze, &resolved.masks, table, target).await?
    {
        resolved.bronze = tables::open(bronze.table_url()).await?;
    }
    let (Some(from), Some(bronze)) = (resolved.replaces, resolved.bronze) else {
        return Ok(());
    };
    let json = resolved.selection.to_json().unwrap_or_else(|| "{}".into());
    bronze
        .set_tbl_properties()
        .with_properties(HashMap::from([(PROPERTY.to_string(), json)]))
        .with_raise_if_not_exists(false)
        .await?;
    tracing::warn!(%table, %target, %from, to = %resolved.selection,
        "the column selection changed: rows from now on hold the new columns");
    Ok(())
}

/// Checks `table`'s `selection` over its capture instances: no key column of an instance or
/// of `keys` left out or served masked, every excluded name captured.
pub fn check_against(
    table: &str,
    selection: &ColumnSelection,
    keys: Option<(&str, &[String])>,
    instances: &[CaptureInstanceInfo],
) -> Result<()> {
    let flag = match selection {
        ColumnSelection::Only(_) => "columns",
        _ => "except_columns",
    };
    let keys = instances
        .iter()
        .map(|instance| (instance.name.as_str(), instance.index_columns.as_slice()))
        .chain(keys);
    for (owner, keys) in keys {
        if let Some(key) = keys.iter().find(|key| selection.excludes(key)) {
            return Err(WriterError::invalid(format!(
                "{table}: {flag} leaves out the key column '{key}' ({owner}): silver, chunked \
                 snapshots and reconcile need every key column"
            )));
        }
        // A key the server masks for this writer: truncated or nulled keys merge rows in
        // silver, and the server refuses to cut or seek on a masked column anyway.
        let masked = |key: &&String| {
            instances.iter().find_map(|instance| {
                instance
                    .masks
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(key))
                    .map(|(_, mask)| mask.clone())
            })
        };
        if let Some((key, mask)) = keys
            .iter()
            .find_map(|key| masked(&key).map(|mask| (key, mask)))
        {
            return Err(WriterError::invalid(format!(
                "{table}: the key column '{key}' ({owner}) is served to this writer masked \
                 ({mask}, the server's masks file): a masked column cannot key silver, chunked \
                 snapshots or reconcile; name an unmasked key"
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
            all.sort_unstable();
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
            masks: Default::default(),
        }
    }

    fn refusal(
        selection: ColumnSelection,
        snapshot_keys: Option<&[&str]>,
        instances: &[CaptureInstanceInfo],
    ) -> String {
        let keys: Vec<String> = snapshot_keys
            .unwrap_or_default()
            .iter()
            .map(|key| key.to_string())
            .collect();
        let named = Some(("snapshot_keys", keys.as_slice()));
        check_against("dbo.people", &selection, named, instances)
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
