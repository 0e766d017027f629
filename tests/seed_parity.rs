//! Parity with the seed library where both decide the same thing (issue 55): the seed's own
//! functions (`mssql-cdc-pyspark`, installed in the repository's `.venv` by scripts/test, or
//! the Python of `MSSQL_CDC_PYTHON`) called next to ours over generated inputs:
//!
//! - LSN text: the seed's `lsn.normalize` and our parser accept the same texts and write the
//!   same canonical form;
//! - LSN arithmetic: the seed's `increment_lsn`/`decrement_lsn` (its simulator's client) and
//!   ours;
//! - type widening: the seed's `_fits` over the Spark types its `_spark_type` gives two SQL
//!   Server types, and our `type_fits`, for every pair of a list of types.
//!
//! A difference fails the test unless it is listed below with its reason.

use std::io::Write;
use std::process::{Command, Stdio};

use mssql_cdc_flight::Lsn;
use mssql_cdc_flight::flight::planner::type_fits;
use mssql_cdc_flight::types::SqlType;
use serde_json::{Value, json};

/// The seed's answers for `input`, from its own code.
fn seed(input: &Value) -> Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("MSSQL_CDC_PYTHON")
        .map_or_else(|| root.join(".venv/bin/python"), Into::into);
    let script = r#"
import json, re, sys
from mssql_cdc import lsn
from mssql_cdc.client._sql import _spark_type
from mssql_cdc.fake import FakeCdcClient
from mssql_cdc.source import _fits

given = json.load(sys.stdin)

def normalized(text):
    try:
        return lsn.normalize(text)
    except ValueError:
        return None

def spark(sql):
    base, _, rest = sql.partition("(")
    numbers = [int(n) for n in re.findall(r"\d+", rest)] if base in ("decimal", "numeric") else []
    precision, scale = (numbers + [18, 0])[:2] if numbers else (0, 0)
    return _spark_type(base, precision, scale)

client = FakeCdcClient("/nonexistent")
def step(f, value):
    try:
        return str(lsn.to_int(f(lsn.from_int(int(value)))))
    except ValueError:
        return None

types = [spark(t) for t in given["types"]]
print(json.dumps({
    "normalize": [normalized(t) for t in given["lsn_texts"]],
    "increment": [step(client.increment_lsn, v) for v in given["lsn_values"]],
    "decrement": [step(client.decrement_lsn, v) for v in given["lsn_values"]],
    "fits": [[_fits(a, b) for b in types] for a in types],
}))
"#;
    let mut child = Command::new(&python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "{} cannot run ({error}): scripts/test makes .venv with the seed library \
                 (mssql-cdc-pyspark); or set MSSQL_CDC_PYTHON",
                python.display()
            )
        });
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("python");
    assert!(
        output.status.success(),
        "the seed's functions failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("json")
}

/// LSN texts: canonical, short, lower-case, unprefixed, padded, too long, not hex, empty.
fn lsn_texts() -> Vec<String> {
    let mut texts: Vec<String> = vec![
        "0x0000002A000001000011".into(),
        "0x2a000001000011".into(),
        "2A000001000011".into(),
        "0X00000000000000000001".into(),
        "  0x0000002A000001000011  ".into(),
        "0x".into(),
        "".into(),
        "0x000000000000000000001".into(),
        "0x0000002G000001000011".into(),
        "0xFFFFFFFFFFFFFFFFFFFF".into(),
        "-0x1".into(),
        "0x 1".into(),
    ];
    // Every length from 1 to 21 digits, in both cases, with and without the prefix.
    for digits in 1..=21 {
        let hex: String = "9aBc0dEf12".chars().cycle().take(digits).collect();
        texts.push(format!("0x{hex}"));
        texts.push(hex.to_uppercase());
    }
    texts
}

/// Differences kept on purpose, each with its reason: `(text, why)`.
const LSN_TEXT_DIFFERENCES: &[(&str, &str)] = &[
    (
        "",
        "the seed pads a blank text to the zero LSN; we refuse it: an offset or LSN option \
         left blank would otherwise restart a stream from the first change without a word",
    ),
    ("0x", "as the blank text: no digits is no LSN"),
];

/// The largest LSN's increment: the seed raises, ours stays at the largest (an 80-bit log
/// position SQL Server never reaches; `Lsn::increment` saturates instead of failing every
/// caller's arithmetic for it).
const MAX_LSN: u128 = (1 << 80) - 1;

#[test]
fn lsn_text_and_arithmetic_match_the_seeds() {
    let texts = lsn_texts();
    let values: Vec<u128> = vec![0, 1, 15, 16, 0x2A_0000_0100_0011, MAX_LSN - 1, MAX_LSN];
    // As decimal text both ways: 80-bit values pass JSON numbers' 64 bits here.
    let input = json!({
        "lsn_texts": texts,
        "lsn_values": values.iter().map(u128::to_string).collect::<Vec<_>>(),
        "types": Vec::<String>::new(),
    });
    let answers = seed(&input);
    let mut differences = Vec::new();
    for (text, theirs) in texts
        .iter()
        .zip(answers["normalize"].as_array().expect("list"))
    {
        let ours = text.parse::<Lsn>().ok().map(|lsn| lsn.to_string());
        let theirs = theirs.as_str().map(str::to_string);
        if ours != theirs && !LSN_TEXT_DIFFERENCES.iter().any(|(known, _)| known == text) {
            differences.push(format!("{text:?}: ours {ours:?}, the seed's {theirs:?}"));
        }
    }
    for (index, value) in values.iter().enumerate() {
        let lsn = Lsn::from_u128(*value).expect("an LSN");
        let pairs = [
            ("increment", lsn.increment(), &answers["increment"][index]),
            ("decrement", lsn.decrement(), &answers["decrement"][index]),
        ];
        for (what, ours, theirs) in pairs {
            let theirs: Option<u128> = theirs.as_str().map(|n| n.parse().expect("int"));
            let known = what == "increment" && *value == MAX_LSN && theirs.is_none();
            if Some(ours.to_u128()) != theirs && !known {
                differences.push(format!(
                    "{what} of {value:#x}: ours {:#x}, the seed's {theirs:?}",
                    ours.to_u128()
                ));
            }
        }
    }
    assert!(
        differences.is_empty(),
        "LSN differences:\n{}",
        differences.join("\n")
    );
}

/// The SQL Server types every pair of which is compared.
const TYPES: &[&str] = &[
    "bit",
    "tinyint",
    "smallint",
    "int",
    "bigint",
    "real",
    "float",
    "decimal(5,0)",
    "decimal(9,2)",
    "decimal(12,2)",
    "decimal(18,4)",
    "decimal(19,4)",
    "decimal(25,4)",
    "decimal(38,10)",
    "numeric(10,0)",
    "money",
    "smallmoney",
    "date",
    "datetime",
    "smalldatetime",
    "datetime2(3)",
    "datetime2(7)",
    "datetimeoffset(7)",
    "time(7)",
    "char(10)",
    "varchar(10)",
    "varchar(max)",
    "nchar(10)",
    "nvarchar(10)",
    "nvarchar(max)",
    "uniqueidentifier",
    "binary(8)",
    "varbinary(max)",
];

#[test]
fn widening_across_capture_instances_matches_the_seeds() {
    let input = json!({"lsn_texts": [], "lsn_values": [], "types": TYPES});
    let answers = seed(&input);
    let types: Vec<SqlType> = TYPES.iter().map(|t| t.parse().expect(t)).collect();
    let mut differences = Vec::new();
    for (a, older) in types.iter().enumerate() {
        for (b, newer) in types.iter().enumerate() {
            let theirs = answers["fits"][a][b].as_bool().expect("bool");
            let ours = type_fits(older, newer);
            if ours != theirs {
                differences.push(format!(
                    "{} -> {}: ours {ours}, the seed's {theirs}",
                    TYPES[a], TYPES[b]
                ));
            }
        }
    }
    assert!(
        differences.is_empty(),
        "{} of {} pairs differ:\n{}",
        differences.len(),
        TYPES.len() * TYPES.len(),
        differences.join("\n")
    );
}
