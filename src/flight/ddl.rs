//! What a DDL statement of `cdc.ddl_history` changed, in words a writer's schema policy can
//! act on: a column added, dropped, renamed, or retyped (widened, narrowed or changed)
//! against the type the capture instance captured.
//! <https://learn.microsoft.com/sql/relational-databases/system-tables/cdc-ddl-history-transact-sql>

use std::cmp::Ordering;

use super::planner::type_fits;
use crate::source::CapturedColumn;
use crate::types::{Length, SqlType};
use mssql_cdc_proto::catalog::unbracket;

/// `"<what changed>: <the statement>"`; `"other DDL: ..."` for a statement that does not
/// change a column.
pub fn describe(command: &str, captured: &[CapturedColumn]) -> String {
    format!("{}: {}", classify(command, captured), command.trim())
}

fn classify(command: &str, captured: &[CapturedColumn]) -> String {
    // ASCII only, so byte offsets found in `upper` hold in `command`.
    let upper = command.to_ascii_uppercase();
    if upper.contains("SP_RENAME") {
        return "column renamed".into();
    }
    if let Some(rest) = after(command, &upper, " ALTER COLUMN ") {
        let (name, type_text) = name_and_rest(rest);
        let was = captured.iter().find(|column| column.name == name);
        let now: Option<SqlType> = first_type(type_text).and_then(|text| text.parse().ok());
        let how = match (was, now) {
            (Some(was), Some(now)) => match widening(&was.sql_type, &now) {
                Some(Ordering::Less) => format!("widened from {} to {now}", was.sql_type),
                Some(Ordering::Greater) => format!("narrowed from {} to {now}", was.sql_type),
                Some(Ordering::Equal) => format!("altered, type {now} unchanged"),
                None => format!("type changed from {} to {now}", was.sql_type),
            },
            (None, Some(now)) => format!("altered to {now} (not captured)"),
            _ => "altered".into(),
        };
        return format!("column [{name}] {how}");
    }
    if let Some(rest) = after(command, &upper, " DROP COLUMN ") {
        return format!("column [{}] dropped", name_and_rest(rest).0);
    }
    if let Some(rest) = after(command, &upper, " ADD ")
        && !rest
            .trim_start()
            .to_ascii_uppercase()
            .starts_with("CONSTRAINT")
    {
        let (name, type_text) = name_and_rest(rest);
        return match first_type(type_text) {
            Some(sql_type) => format!("column [{name}] added as {sql_type}"),
            None => format!("column [{name}] added"),
        };
    }
    "other DDL".into()
}

/// The text after the first `keyword` (matched on the upper-cased copy).
fn after<'a>(command: &'a str, upper: &str, keyword: &str) -> Option<&'a str> {
    let at = upper.find(keyword)?;
    command.get(at + keyword.len()..)
}

/// A leading identifier (`[bracketed]` with `]]` for `]`, or a bare word) and what follows.
fn name_and_rest(text: &str) -> (String, &str) {
    let text = text.trim_start();
    if let Some(quoted) = text.strip_prefix('[') {
        // An unclosed bracket: the rest is the name.
        return unbracket(quoted).unwrap_or_else(|| (quoted.replace("]]", "]"), ""));
    }
    let end = text
        .find(|c: char| c.is_whitespace() || c == ',' || c == ';')
        .unwrap_or(text.len());
    (text[..end].to_string(), &text[end..])
}

/// The type text at the start of a column definition (`decimal(9, 2) NULL` → `decimal(9,2)`).
fn first_type(text: &str) -> Option<String> {
    let text = text.trim_start();
    let mut depth = 0;
    let mut end = text.len();
    for (index, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            c if depth == 0 && (c.is_whitespace() || c == ',' || c == ';') => {
                end = index;
                break;
            }
            _ => {}
        }
    }
    let type_text: String = text[..end].chars().filter(|c| !c.is_whitespace()).collect();
    let type_text = type_text.trim_start_matches('[').replace(']', "");
    (!type_text.is_empty()).then_some(type_text)
}

/// Within a family: `Less` when every value of `was` fits `now` (widened), `Greater` when
/// some may not (narrowed), `Equal` for the same type; `None` across families.
fn widening(was: &SqlType, now: &SqlType) -> Option<Ordering> {
    use SqlType::*;
    if was == now {
        return Some(Ordering::Equal);
    }
    let length = |length: &Length| match length {
        Length::Limited(n) => u64::from(*n),
        Length::Max => u64::MAX,
    };
    // Numbers: the planner's own rule of which values fit (integer ranks, decimal digits).
    let fits = |fits: bool| {
        Some(if fits {
            Ordering::Less
        } else {
            Ordering::Greater
        })
    };
    match (was, now) {
        // SQL Server's ranks: `smallint` to `tinyint` narrows, although the lake holds both
        // as Int16 (`type_fits`).
        (a, b) if a.is_integer() && b.is_integer() => fits(integer_rank(a) <= integer_rank(b)),
        (Real | Float, Real | Float) | (Decimal { .. }, Decimal { .. }) => {
            fits(type_fits(was, now))
        }
        (DateTime2 { precision: a }, DateTime2 { precision: b })
        | (Time { precision: a }, Time { precision: b })
        | (DateTimeOffset { precision: a }, DateTimeOffset { precision: b }) => Some(a.cmp(b)),
        // Text and bytes: the planner's rule ignores lengths (Arrow holds any), a source does not.
        (VarChar(a), VarChar(b))
        | (NVarChar(a), NVarChar(b))
        | (Char(a), Char(b))
        | (NChar(a), NChar(b))
        | (Binary(a), Binary(b))
        | (VarBinary(a), VarBinary(b))
        | (Char(a), VarChar(b))
        | (NChar(a), NVarChar(b))
        | (VarChar(a), NVarChar(b))
        | (Binary(a), VarBinary(b)) => fits(length(a) <= length(b)),
        _ => None,
    }
}

/// An integer type's rank among SQL Server's four.
fn integer_rank(sql_type: &SqlType) -> u8 {
    match sql_type {
        SqlType::TinyInt => 1,
        SqlType::SmallInt => 2,
        SqlType::Int => 3,
        _ => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn captured() -> Vec<CapturedColumn> {
        let column = |name: &str, sql_type: &str| CapturedColumn {
            name: name.into(),
            column_id: 1,
            ordinal: 1,
            sql_type: sql_type.parse().expect("type"),
        };
        vec![
            column("amount", "decimal(18,4)"),
            column("status", "varchar(20)"),
            column("qty", "int"),
            column("order]id", "bigint"),
        ]
    }

    #[test]
    fn each_statement_says_what_it_changed() {
        let said = |command: &str| classify(command, &captured());
        assert_eq!(
            said("ALTER TABLE [dbo].[orders] ADD [discount] decimal(9, 2) NULL"),
            "column [discount] added as decimal(9,2)"
        );
        assert_eq!(
            said("alter table dbo.orders drop column status"),
            "column [status] dropped"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN [amount] decimal(20,4) NOT NULL"),
            "column [amount] widened from decimal(18,4) to decimal(20,4)"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN amount decimal(18,2)"),
            "column [amount] narrowed from decimal(18,4) to decimal(18,2)"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN [status] varchar(10)"),
            "column [status] narrowed from varchar(20) to varchar(10)"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN [status] nvarchar(max)"),
            "column [status] widened from varchar(20) to nvarchar(max)"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN qty bigint"),
            "column [qty] widened from int to bigint"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ALTER COLUMN [order]]id] int"),
            "column [order]id] narrowed from bigint to int"
        );
        assert_eq!(
            said("ALTER TABLE dbo.straße ALTER COLUMN qty varchar(10)"),
            "column [qty] type changed from int to varchar(10)"
        );
        assert_eq!(
            said("EXEC sp_rename 'dbo.orders.qty', 'quantity', 'COLUMN'"),
            "column renamed"
        );
        assert_eq!(
            said("ALTER TABLE dbo.orders ADD CONSTRAINT ck CHECK (qty > 0)"),
            "other DDL"
        );
        assert_eq!(
            said("CREATE INDEX ix_orders_status ON dbo.orders (status)"),
            "other DDL"
        );
        assert_eq!(
            describe("CREATE INDEX ix ON dbo.orders (status) ", &captured()),
            "other DDL: CREATE INDEX ix ON dbo.orders (status)"
        );
    }
}
