//! Parity with the seed library's facts metrics (issue 55): the seed rounds them with
//! Python's `round(value, digits)` (`mssql_cdc/sink.py`: lags to 3 decimals, round trips to
//! 1, megabytes to 6, headroom to 2); ours must write the same numbers. Python's own `round`
//! (`MSSQL_CDC_PYTHON`, else the repository's `.venv`) is called next to ours over exact
//! ties, their neighbours and random values of every magnitude.

use std::io::Write;
use std::process::{Command, Stdio};

use mssql_cdc_writer::facts;

#[test]
fn facts_metrics_round_as_the_seeds_python_rounds_them() {
    let mut values: Vec<f64> = Vec::new();
    for digits in 0..=6 {
        let scale = 10f64.powi(digits);
        for k in -40..40 {
            let tie = (f64::from(k) + 0.5) / scale;
            values.extend([tie, tie.next_up(), tie.next_down()]);
        }
    }
    // Random magnitudes from 1e-9 to 1e9 (a fixed xorshift: the same values every run).
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..2000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mantissa = (state >> 11) as f64 / (1u64 << 53) as f64;
        let exponent = (state % 19) as i32 - 9;
        values.push(mantissa * 10f64.powi(exponent));
    }
    let cases: Vec<(String, usize)> = values
        .iter()
        .flat_map(|value| [1usize, 2, 3, 6].map(|digits| (format!("{value:?}"), digits)))
        .collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("MSSQL_CDC_PYTHON")
        .map_or_else(|| root.join("../../.venv/bin/python"), Into::into);
    let mut child = Command::new(&python)
        .args([
            "-c",
            "import json, sys\n\
             cases = json.load(sys.stdin)\n\
             print(json.dumps([repr(round(float(v), d)) for v, d in cases]))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "{} cannot run ({error}); set MSSQL_CDC_PYTHON",
                python.display()
            )
        });
    let input = serde_json::to_string(&cases).expect("json");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("python");
    assert!(output.status.success(), "python's round failed");
    let theirs: Vec<String> = serde_json::from_slice(&output.stdout).expect("json");
    let differences: Vec<String> = cases
        .iter()
        .zip(&theirs)
        .filter_map(|((value, digits), theirs)| {
            let ours = facts::round(value.parse().expect("f64"), *digits);
            let same = theirs.parse::<f64>().is_ok_and(|theirs| theirs == ours);
            (!same).then(|| format!("round({value}, {digits}): ours {ours:?}, Python's {theirs}"))
        })
        .collect();
    assert!(
        differences.is_empty(),
        "{} of {} differ:\n{}",
        differences.len(),
        cases.len(),
        differences[..differences.len().min(20)].join("\n")
    );
}
