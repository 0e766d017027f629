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

/// Each column a reader is served now → its mask, `None` in clear.
pub type Forms = BTreeMap<String, Option<String>>;

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

/// The form the newest of `instances` says this caller is served each column `selection`
/// keeps in.
pub fn served_of(instances: &[CaptureInstanceInfo], selection: &ColumnSelection) -> Forms {
    instances
        .last()
        .map(|newest| {
            newest
                .columns
                .iter()
                .map(|column| &column.name)
                .filter(|name| !selection.excludes(name))
                .map(|name| (name.clone(), newest.masks.get(name).cloned()))
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

/// Refuses rows served as `schema` into `bronze` when a column bronze holds is served in
/// another form than bronze records: the lake would hold both forms of it. (A column bronze
/// does not hold yet holds no row in any form: [`record_added`] records it as it is added.)
pub fn check(bronze: &DeltaTable, schema: &Schema, target: &str) -> Result<()> {
    let recorded = recorded(bronze)?;
    let served = served_by(schema);
    let holds = bronze.snapshot()?.schema();
    for field in schema.fields() {
        let name = field.name();
        if holds.field(name).is_none() {
            continue;
        }
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

/// Records on `bronze` the masks of the columns its stream is now `served` when one is
/// newly masked; refuses a column served clearer than, or otherwise than, bronze records
/// (see [`check`]). A recorded column not served now (dropped by a DDL, left out by the
/// selection) keeps its record. Returns whether it wrote the property.
pub async fn record(
    bronze: &DeltaTable,
    served: &Forms,
    table: &str,
    target: &str,
) -> Result<bool> {
    let recorded = recorded(bronze)?;
    if let Some((name, mask)) = recorded.iter().find(|(name, mask)| {
        served
            .get(*name)
            .is_some_and(|now| now.as_ref() != Some(*mask))
    }) {
        return Err(WriterError::invalid(format!(
            "{table}: bronze {target} records {name} masked ({mask}), and the server now serves \
             it {} to this writer: refused, so no clear value joins the lake unseen (a replica \
             without --masks, or a clear grant given to this writer?). If it is meant, remove \
             the table property {PROPERTY} from bronze",
            form(served.get(name).and_then(Option::as_ref))
        )));
    }
    let mut merged = recorded.clone();
    merged.extend(
        served
            .iter()
            .filter_map(|(name, mask)| Some((name.clone(), mask.clone()?))),
    );
    if merged == recorded {
        return Ok(false);
    }
    write(bronze, &merged).await?;
    tracing::warn!(%table, %target, masks = %json(&merged),
        "the server masks more columns than bronze recorded: rows from now on hold them masked; \
         older rows keep their clear values until a re-snapshot and a vacuum");
    Ok(true)
}

/// Records the masks of `served` columns bronze did not hold before `added` them (a newer
/// capture instance's): no row holds them in any form yet. Returns bronze as it is then.
pub async fn record_added(
    bronze: DeltaTable,
    served: &Schema,
    added: &[String],
) -> Result<DeltaTable> {
    let recorded = recorded(&bronze)?;
    let mut merged = recorded.clone();
    merged.extend(
        served_by(served)
            .into_iter()
            .filter(|(name, _)| added.contains(name)),
    );
    if merged == recorded {
        return Ok(bronze);
    }
    write(&bronze, &merged).await?;
    crate::tables::open(bronze.table_url())
        .await?
        .ok_or_else(|| WriterError::Internal("bronze disappeared after its masks".into()))
}

async fn write(bronze: &DeltaTable, masks: &Masks) -> Result<()> {
    bronze
        .clone()
        .set_tbl_properties()
        .with_properties(HashMap::from([(PROPERTY.to_string(), json(masks))]))
        .with_raise_if_not_exists(false)
        .await?;
    Ok(())
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
        let served = |forms: &[(&str, Option<&str>)]| -> Forms {
            forms
                .iter()
                .map(|(name, mask)| (name.to_string(), mask.map(str::to_string)))
                .collect()
        };
        let stricter = served(&[
            ("id", None),
            ("email", Some("hash")),
            ("note", Some("null")),
        ]);
        assert!(
            record(&table, &stricter, "dbo.t", "b")
                .await
                .expect("recorded")
        );
        let table = crate::tables::open(table.table_url())
            .await
            .expect("open")
            .expect("exists");
        let both = Masks::from([
            ("email".into(), "hash".into()),
            ("note".into(), "null".into()),
        ]);
        assert_eq!(recorded(&table).expect("recorded"), both);
        check(&table, &schema(&[("email", "hash"), ("note", "null")]), "b").expect("new form");
        let clearer = served(&[("id", None), ("email", None), ("note", Some("null"))]);
        let error = record(&table, &clearer, "dbo.t", "b")
            .await
            .expect_err("clearer");
        assert!(error.to_string().contains("email masked (hash)"), "{error}");
        // A masked column no longer served (dropped, or left out) keeps its record.
        let dropped = served(&[("id", None), ("note", Some("null"))]);
        assert!(
            !record(&table, &dropped, "dbo.t", "b")
                .await
                .expect("dropped")
        );
        // A table created clear records nothing, and takes clear rows.
        let (_dir, clear) = bronze(creation_properties(&schema(&[]))).await;
        check(&clear, &schema(&[]), "b").expect("clear");
    }
}
