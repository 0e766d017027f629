//! Identifiers and literals inlined into T-SQL.
//!
//! Values always travel as bound parameters (`@P1`, ...). Names cannot: T-SQL takes no
//! parameter for a table, column or change table name. Every such name is checked here
//! (a `sysname`: 1 to 128 characters, no control characters) and written bracket-quoted
//! with `]` doubled, which is what `QUOTENAME` does, so no name can end the identifier early
//! whatever it holds: quotes, semicolons, `--`, Unicode. Time zone names, the one text
//! inlined as a literal, are checked against the seed's pattern and written as `N'...'` with
//! quotes doubled.

use crate::error::{Error, Result};
use crate::source::TableName;

/// The longest `sysname`.
const MAX_NAME_CHARS: usize = 128;

/// Checks that `name` can be a SQL Server identifier of the given kind ("column", ...).
pub fn validate(kind: &str, name: &str) -> Result<()> {
    let chars = name.chars().count();
    if chars == 0 {
        return Err(Error::invalid(format!("{kind} name is empty")));
    }
    if chars > MAX_NAME_CHARS {
        return Err(Error::invalid(format!(
            "{kind} name '{name}' is {chars} characters long; SQL Server names have at most \
             {MAX_NAME_CHARS}"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{kind} name {name:?} holds a control character"
        )));
    }
    Ok(())
}

/// `[name]`, with `]` doubled, after [`validate`].
pub fn quote(kind: &str, name: &str) -> Result<String> {
    validate(kind, name)?;
    Ok(mssql_cdc_proto::catalog::bracket_quote(name))
}

/// `[schema].[table]`.
pub fn quote_table(table: &TableName) -> Result<String> {
    Ok(format!(
        "{}.{}",
        quote("schema", &table.schema)?,
        quote("table", &table.name)?
    ))
}

/// The change table of a capture instance: `cdc.[<ci>_CT]`.
///
/// Capture instance names are at most 100 characters (`sys.sp_cdc_enable_table`), so the
/// change table's name always fits a `sysname`.
pub fn change_table(capture_instance: &str) -> Result<String> {
    if capture_instance.chars().count() > 100 {
        return Err(Error::invalid(format!(
            "capture instance name '{capture_instance}' is longer than SQL Server's 100 characters"
        )));
    }
    Ok(format!(
        "cdc.{}",
        quote("capture instance", &format!("{capture_instance}_CT"))?
    ))
}

/// A Windows time zone name as an `N'...'` literal (`AT TIME ZONE` takes no parameter in
/// computed columns of a view, and the seed inlines it too). Names are letters, digits,
/// blanks and `._+-/()`, as `sys.time_zone_info` lists them.
pub fn time_zone_literal(zone: &str) -> Result<String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || " ._+-/()".contains(c);
    if zone.is_empty() || zone.len() > 128 || !zone.chars().all(allowed) {
        return Err(Error::invalid(format!(
            "time zone {zone:?} is not a Windows time zone name such as 'UTC' or \
             'E. South America Standard Time'"
        )));
    }
    Ok(format!("N'{}'", zone.replace('\'', "''")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_hostile_names_so_they_stay_one_identifier() {
        assert_eq!(quote("column", "id").expect("plain"), "[id]");
        assert_eq!(quote("column", "a]b").expect("bracket"), "[a]]b]");
        assert_eq!(
            quote("column", "x]; DROP TABLE t; --").expect("injection"),
            "[x]]; DROP TABLE t; --]"
        );
        assert_eq!(quote("column", "it's").expect("quote"), "[it's]");
        assert_eq!(quote("column", "Größe €").expect("unicode"), "[Größe €]");
        assert_eq!(quote("column", "[id]").expect("brackets"), "[[id]]]");
    }

    #[test]
    fn refuses_names_sql_server_cannot_hold() {
        assert!(quote("column", "").is_err());
        assert!(quote("column", "a\nb").is_err());
        assert!(quote("column", "a\0b").is_err());
        let long = "x".repeat(129);
        let error = quote("column", &long).expect_err("too long");
        assert!(error.to_string().contains("at most 128"), "{error}");
        assert!(
            quote("column", &"é".repeat(128)).is_ok(),
            "128 characters, not bytes"
        );
    }

    #[test]
    fn change_tables_are_quoted_and_bounded() {
        assert_eq!(
            change_table("dbo_orders").expect("ok"),
            "cdc.[dbo_orders_CT]"
        );
        assert_eq!(change_table("a]b").expect("ok"), "cdc.[a]]b_CT]");
        assert!(change_table(&"c".repeat(101)).is_err());
        let table = TableName::new("sales", "order;lines");
        assert_eq!(quote_table(&table).expect("ok"), "[sales].[order;lines]");
    }

    #[test]
    fn time_zone_names_are_checked_before_inlining() {
        assert_eq!(
            time_zone_literal("E. South America Standard Time").expect("ok"),
            "N'E. South America Standard Time'"
        );
        assert_eq!(time_zone_literal("UTC").expect("ok"), "N'UTC'");
        assert!(time_zone_literal("UTC'; DROP TABLE t; --").is_err());
        assert!(time_zone_literal("").is_err());
        assert!(time_zone_literal("Zone\u{e9}").is_err());
    }
}
