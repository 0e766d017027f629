//! The sample database: the seed lab's `dbo.customers` and `dbo.orders`, plus a wide table
//! for benchmarks.

use super::TableSpec;
use crate::source::TableName;

fn spec(table: &str, key: &str, columns: &[(&str, &str, bool)]) -> TableSpec {
    TableSpec {
        table: table.parse().expect("sample table names are valid"),
        columns: columns
            .iter()
            .map(|(name, sql_type, nullable)| (name.to_string(), sql_type.to_string(), *nullable))
            .collect(),
        key: key.to_string(),
        index: None,
        key_derived: Vec::new(),
    }
}

/// `dbo.customers`: an int key and text, decimal, date-time, bit and GUID columns.
pub fn customers() -> TableSpec {
    spec(
        "dbo.customers",
        "customer_id",
        &[
            ("customer_id", "int", false),
            ("name", "nvarchar(100)", false),
            ("email", "nvarchar(200)", true),
            ("balance", "decimal(12,2)", false),
            ("segment", "tinyint", false),
            ("created_at", "datetime2(7)", false),
            ("last_login", "datetime", true),
            ("is_active", "bit", false),
            ("external_id", "uniqueidentifier", false),
        ],
    )
}

/// `dbo.orders`: a bigint key and money, smallint, varchar, nvarchar(max), date, float and
/// datetimeoffset columns (ten columns: the benchmarks' narrow row).
pub fn orders() -> TableSpec {
    spec(
        "dbo.orders",
        "order_id",
        &[
            ("order_id", "bigint", false),
            ("customer_id", "int", false),
            ("amount", "money", false),
            ("quantity", "smallint", false),
            ("status", "varchar(20)", false),
            ("note", "nvarchar(max)", true),
            ("ordered_at", "datetime2(3)", false),
            ("shipped_on", "date", true),
            ("discount_rate", "float", true),
            ("placed_at", "datetimeoffset(7)", false),
        ],
    )
}

/// The two sample tables.
pub fn sample_tables() -> Vec<TableSpec> {
    vec![customers(), orders()]
}

/// `dbo.types`: an int key and one NULL-able column of each type the simulator serves (every
/// canonical text of reconcile's value digests, docs/reconcile.md).
pub fn types() -> TableSpec {
    spec(
        "dbo.types",
        "id",
        &[
            ("id", "int", false),
            ("c_bit", "bit", true),
            ("c_tinyint", "tinyint", true),
            ("c_smallint", "smallint", true),
            ("c_bigint", "bigint", true),
            ("c_real", "real", true),
            ("c_float", "float", true),
            ("c_decimal", "decimal(38,10)", true),
            ("c_money", "money", true),
            ("c_smallmoney", "smallmoney", true),
            ("c_date", "date", true),
            ("c_datetime", "datetime", true),
            ("c_smalldatetime", "smalldatetime", true),
            ("c_datetime2", "datetime2(7)", true),
            ("c_datetimeoffset", "datetimeoffset(7)", true),
            ("c_time", "time(7)", true),
            ("c_char", "char(10)", true),
            ("c_varchar", "varchar(50)", true),
            ("c_nchar", "nchar(10)", true),
            ("c_nvarchar", "nvarchar(100)", true),
            ("c_nvarchar_max", "nvarchar(max)", true),
            ("c_uniqueidentifier", "uniqueidentifier", true),
            ("c_binary", "binary(8)", true),
            ("c_varbinary", "varbinary(16)", true),
        ],
    )
}

/// A table with `columns` columns (the key included) cycling through the sample types: the
/// benchmarks' wide row.
pub fn wide_table(table: TableName, columns: usize) -> TableSpec {
    const TYPES: [(&str, bool); 10] = [
        ("int", false),
        ("nvarchar(50)", true),
        ("decimal(18,4)", false),
        ("datetime2(7)", false),
        ("bit", false),
        ("bigint", true),
        ("varchar(30)", false),
        ("float", true),
        ("date", false),
        ("uniqueidentifier", false),
    ];
    let mut specs = vec![("id".to_string(), "bigint".to_string(), false)];
    for index in 1..columns.max(1) {
        let (sql_type, nullable) = TYPES[index % TYPES.len()];
        specs.push((format!("c{index:02}"), sql_type.to_string(), nullable));
    }
    TableSpec {
        table,
        columns: specs,
        key: "id".to_string(),
        index: None,
        key_derived: Vec::new(),
    }
}

/// `dbo.accounts`: a composite unique index `(region, code)` whose leading column repeats in
/// mixed case (`'north'`, `'North'`, `'NORTH '` are one value under the case-insensitive
/// collation the simulator models) and a text `code`; the row key `id` is not indexed.
pub fn accounts() -> TableSpec {
    TableSpec {
        index: Some(vec!["region".into(), "code".into()]),
        key_derived: vec!["region".into(), "code".into(), "opened".into()],
        ..spec(
            "dbo.accounts",
            "id",
            &[
                ("id", "int", false),
                ("region", "varchar(20)", false),
                ("code", "nvarchar(40)", false),
                ("opened", "datetime2(7)", false),
                ("balance", "decimal(18,2)", true),
                ("note", "nvarchar(100)", true),
            ],
        )
    }
}

/// `dbo.events`: a heap (no unique index) with a repeated, case-mixed `source` column that
/// is NULL now and then, and a repeated `kind` int: snapshots are cut on `snapshot_keys`.
pub fn events() -> TableSpec {
    TableSpec {
        index: Some(Vec::new()),
        key_derived: vec!["source".into(), "kind".into()],
        ..spec(
            "dbo.events",
            "id",
            &[
                ("id", "bigint", false),
                ("source", "varchar(30)", true),
                ("kind", "int", true),
                ("payload", "nvarchar(200)", true),
                ("flag", "bit", false),
            ],
        )
    }
}

/// `dbo.readings`: a unique `datetime2(7)` key `taken_at` growing with the row id (one
/// second and three microseconds apart), as a creation time is: keyset plans on a
/// date-time key, and silver's range deletes with the microsecond rule.
pub fn readings() -> TableSpec {
    TableSpec {
        index: Some(vec!["taken_at".into()]),
        key_derived: vec!["taken_at".into()],
        ..spec(
            "dbo.readings",
            "id",
            &[
                ("id", "bigint", false),
                ("taken_at", "datetime2(7)", false),
                ("station", "varchar(10)", true),
                ("value", "float", true),
            ],
        )
    }
}
