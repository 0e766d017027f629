//! What a table's stream does when the source's schema changes (`schema_change_policy`).
//!
//! `evolve` (the default): a newer capture instance's new columns join bronze and silver
//! (earlier rows read NULL), a type that fits bronze's is cast to it, a dropped column stays
//! and reads NULL; a type bronze cannot hold stops the table (`SchemaChanged`, see
//! [`crate::bronze`]). `fail`: any schema change in a batch's range (a DDL the server reports,
//! a capture-instance switch, a column bronze lacks) stops the table before anything of the
//! batch is written, naming the change and the way on.

use std::str::FromStr;

use arrow::datatypes::Schema;
use mssql_cdc_proto::protocol::{CAPTURE_INSTANCE_SWITCHED, RangeEvent, SCHEMA_CHANGE};

use crate::error::{Result, WriterError};

/// The policy of one table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchemaChangePolicy {
    /// Follow the change where no value is lost.
    #[default]
    Evolve,
    /// Stop at any change.
    Fail,
}

impl FromStr for SchemaChangePolicy {
    type Err = WriterError;

    fn from_str(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "evolve" => Ok(SchemaChangePolicy::Evolve),
            "fail" => Ok(SchemaChangePolicy::Fail),
            other => Err(WriterError::invalid(format!(
                "schema_change_policy must be evolve or fail, not '{other}'"
            ))),
        }
    }
}

/// The fix a stopped table's error names.
const WAY_ON: &str = "nothing of the batch was written; to take the change, run the table with \
                      schema_change_policy = evolve (or --schema-change-policy evolve), or \
                      re-snapshot it into a new bronze";

impl SchemaChangePolicy {
    /// Refuses, under `fail`, a batch of `table` whose range reports a schema change or
    /// brings columns `bronze` (its schema, when it exists) lacks.
    pub fn check(
        self,
        table: &str,
        events: &[RangeEvent],
        incoming: &Schema,
        bronze: Option<&deltalake::kernel::StructType>,
    ) -> Result<()> {
        if self == SchemaChangePolicy::Evolve {
            return Ok(());
        }
        if let Some(event) = events.iter().find(|event| {
            [SCHEMA_CHANGE, CAPTURE_INSTANCE_SWITCHED].contains(&event.event.as_str())
        }) {
            return Err(WriterError::SchemaChanged(format!(
                "table {table}: {} at {} ({}) and schema_change_policy is fail: {WAY_ON}",
                event.event, event.lsn, event.detail
            )));
        }
        let Some(bronze) = bronze else {
            return Ok(());
        };
        let new: Vec<String> = incoming
            .fields()
            .iter()
            .filter(|field| bronze.field(field.name()).is_none())
            .map(|field| format!("{} {}", field.name(), field.data_type()))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        Err(WriterError::SchemaChanged(format!(
            "table {table}: the source now captures {} which bronze lacks, and \
             schema_change_policy is fail: {WAY_ON}",
            new.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field};
    use deltalake::kernel::{DataType as DeltaType, StructField, StructType};
    use mssql_cdc_proto::Lsn;

    fn bronze() -> StructType {
        StructType::try_new([StructField::new("id", DeltaType::LONG, true)]).expect("schema")
    }

    #[test]
    fn fail_refuses_a_reported_change_and_a_new_column_evolve_takes_both() {
        let switch = RangeEvent {
            event: CAPTURE_INSTANCE_SWITCHED.into(),
            capture_instance: "dbo_t_v2".into(),
            lsn: Lsn::ZERO.increment(),
            commit_ts: None,
            detail: "dbo_t -> dbo_t_v2".into(),
        };
        let same = Schema::new(vec![Field::new("id", DataType::Int64, true)]);
        let wider = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("note", DataType::Utf8, true),
        ]);
        let policy: SchemaChangePolicy = "FAIL".parse().expect("policy");
        let error = policy
            .check(
                "dbo.t",
                std::slice::from_ref(&switch),
                &same,
                Some(&bronze()),
            )
            .expect_err("refused");
        assert!(error.to_string().contains("dbo_t -> dbo_t_v2"), "{error}");
        let error = policy
            .check("dbo.t", &[], &wider, Some(&bronze()))
            .expect_err("refused");
        assert!(error.to_string().contains("note Utf8"), "{error}");
        assert!(
            error.to_string().contains("evolve"),
            "names the way on: {error}"
        );
        policy
            .check("dbo.t", &[], &same, Some(&bronze()))
            .expect("no change, no stop");
        policy
            .check("dbo.t", &[], &wider, None)
            .expect("no bronze yet: it is created with every column");
        let evolve = SchemaChangePolicy::default();
        evolve
            .check("dbo.t", &[switch], &wider, Some(&bronze()))
            .expect("evolve follows");
        assert!("sometimes".parse::<SchemaChangePolicy>().is_err());
    }
}
