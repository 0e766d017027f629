//! Which columns bronze holds masked, as the server served them (docs/security.md, "Masking
//! at the source").
//!
//! The server decides what it masks; the writer copies what it is served. So that the lake
//! never mixes a column's masked and clear forms unseen (a replica started without
//! `--masks`, a writer token given a clear grant), bronze records the masks it was created
//! or last streamed under in the table property [`PROPERTY`], and every append checks the
//! schema it was served against it ([`check`]). The table's stream records a column newly
//! masked (the older rows keep their clear values: a re-snapshot and a vacuum remove them);
//! a column served clearer than bronze records is refused until an operator removes the
//! property, saying the change is meant.

use std::collections::{BTreeMap, HashMap};

use arrow::datatypes::Schema;
use deltalake::DeltaTable;
use mssql_cdc_proto::masking::MASK_METADATA_KEY;
use mssql_cdc_proto::protocol::CaptureInstanceInfo;
use mssql_cdc_proto::selection::ColumnSelection;

use crate::error::{Result, WriterError};

/// The bronze table property holding `{column: mask}` of the columns served masked.
pub const PROPERTY: &str = "mssql_cdc.masks";

/// Column → mask.
pub type Masks = BTreeMap<String, String>;

/// The masks a served schema carries (field metadata).
pub fn served_by(schema: &Schema) -> Masks {
    schema
        .fields()
        .iter()
        .filter_map(|field| {
            let mask = field.metadata().get(MASK_METADATA_KEY)?;
            Some((field.name().clone(), mask.clone()))
        })
        .collect()
}

/// The masks the newest of `instances` says this caller is served, of the columns
/// `selection` keeps.
pub fn served_of(instances: &[CaptureInstanceInfo], selection: &ColumnSelection) -> Masks {
    instances
        .last()
        .map(|newest| {
            newest
                .masks
                .iter()
                .filter(|(name, _)| !selection.excludes(name))
                .filter(|(name, _)| match selection {
                    ColumnSelection::Only(names) => names.contains(name),
                    _ => true,
                })
                .map(|(name, mask)| (name.clone(), mask.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// The masks bronze records (none when it records none).
pub fn recorded(bronze: &DeltaTable) -> Result<Masks> {
    let snapshot = bronze.snapshot()?;
    let Some(text) = snapshot.metadata().configuration().get(PROPERTY) else {
        return Ok(Masks::new());
    };
    serde_json::from_str(text).map_err(|error| {
        WriterError::invalid(format!(
            "bronze's {PROPERTY} is not a map of masks: {error}"
        ))
    })
}

/// The table properties of a new bronze first served `schema`.
pub fn creation_properties(schema: &Schema) -> HashMap<String, String> {
    let masks = served_by(schema);
    match masks.is_empty() {
        true => HashMap::new(),
        false => HashMap::from([(PROPERTY.to_string(), json(&masks))]),
    }
}

fn json(masks: &Masks) -> String {
    serde_json::to_string(masks).expect("a map of strings")
}

fn form(mask: Option<&String>) -> String {
    mask.map_or_else(|| "in clear".to_string(), |mask| format!("masked ({mask})"))
}

/// Refuses rows served as `schema` into `bronze` when a column of theirs is served in
/// another form than bronze records: the lake would hold both forms of it.
pub fn check(bronze: &DeltaTable, schema: &Schema, target: &str) -> Result<()> {
    let recorded = recorded(bronze)?;
    let served = served_by(schema);
    for field in schema.fields() {
        let name = field.name();
        let (was, is) = (recorded.get(name), served.get(name));
        if was != is {
            return Err(WriterError::invalid(format!(
                "bronze {target} records {name} {}, and the server now serves it {}: the \
                 lake would hold both forms. A column newly masked is recorded when the \
                 table's stream starts again; one served clearer (a replica without --masks, \
                 a clear grant given to this writer) is refused until the property \
                 {PROPERTY} is removed from bronze, saying it is meant",
                form(was),
                form(is)
            )));
        }
    }
    Ok(())
}

/// Records on `bronze` the masks its stream is now `served` when a column is newly masked;
/// refuses a column served clearer than bronze records (see [`check`]).
/// Returns whether it wrote the property.
pub async fn record(
    bronze: &DeltaTable,
    served: &Masks,
    table: &str,
    target: &str,
) -> Result<bool> {
    let recorded = recorded(bronze)?;
    if &recorded == served {
        return Ok(false);
    }
    if let Some((name, mask)) = recorded
        .iter()
        .find(|(name, mask)| served.get(*name) != Some(mask))
    {
        return Err(WriterError::invalid(format!(
            "{table}: bronze {target} records {name} masked ({mask}), and the server now serves \
             it {} to this writer: refused, so no clear value joins the lake unseen (a replica \
             without --masks, or a clear grant given to this writer?). If it is meant, remove \
             the table property {PROPERTY} from bronze",
            form(served.get(name))
        )));
    }
    bronze
        .clone()
        .set_tbl_properties()
        .with_properties(HashMap::from([(PROPERTY.to_string(), json(served))]))
        .with_raise_if_not_exists(false)
        .await?;
    tracing::warn!(%table, %target, masks = %json(served),
        "the server masks more columns than bronze recorded: rows from now on hold them masked; \
         older rows keep their clear values until a re-snapshot and a vacuum");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::{DataType, Field};

    use super::*;

    fn schema(masks: &[(&str, &str)]) -> Schema {
        let field = |name: &str| {
            let field = Field::new(name, DataType::Utf8, true);
            match masks.iter().find(|(masked, _)| *masked == name) {
                Some((_, mask)) => field.with_metadata(HashMap::from([(
                    MASK_METADATA_KEY.to_string(),
                    mask.to_string(),
                )])),
                None => field,
            }
        };
        Schema::new(vec![field("id"), field("email"), field("note")])
    }

    async fn bronze(properties: HashMap<String, String>) -> (tempfile::TempDir, DeltaTable) {
        let dir = tempfile::tempdir().expect("temp");
        let location = dir.path().join("bronze").display().to_string();
        let fields = crate::bronze::fields(&schema(&[])).expect("fields");
        let table = crate::tables::ensure_with(
            &crate::tables::table_url(&location).expect("url"),
            crate::tables::TableKind::Bronze,
            fields,
            "bronze",
            properties,
        )
        .await
        .expect("bronze");
        (dir, table)
    }

    #[tokio::test]
    async fn bronze_holds_one_form_of_each_column() {
        let masked = schema(&[("email", "hash")]);
        let (_dir, table) = bronze(creation_properties(&masked)).await;
        check(&table, &masked, "b").expect("as created");
        let error = check(&table, &schema(&[]), "b").expect_err("served clear");
        assert!(error.to_string().contains("in clear"), "{error}");
        let error = check(&table, &schema(&[("email", "null")]), "b").expect_err("another mask");
        assert!(error.to_string().contains("masked (null)"), "{error}");
        // A newly masked column is recorded by the stream; a clearer one is refused.
        let stricter = Masks::from([
            ("email".into(), "hash".into()),
            ("note".into(), "null".into()),
        ]);
        record(&table, &stricter, "dbo.t", "b")
            .await
            .expect("recorded");
        let table = crate::tables::open(table.table_url())
            .await
            .expect("open")
            .expect("exists");
        assert_eq!(recorded(&table).expect("recorded"), stricter);
        check(&table, &schema(&[("email", "hash"), ("note", "null")]), "b").expect("new form");
        let clearer = Masks::from([("note".into(), "null".into())]);
        let error = record(&table, &clearer, "dbo.t", "b")
            .await
            .expect_err("clearer");
        assert!(error.to_string().contains("email masked (hash)"), "{error}");
        // A table created clear records nothing, and takes clear rows.
        let (_dir, clear) = bronze(creation_properties(&schema(&[]))).await;
        check(&clear, &schema(&[]), "b").expect("clear");
    }
}
