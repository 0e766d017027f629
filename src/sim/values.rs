//! Deterministic column values of simulated rows.
//!
//! A simulated row is a key and a 64-bit *content* number; every other column's value is a
//! pure function of `(content, column_id)`. So the database stores only `(key, content)`
//! pairs for its current rows, an update is a new content number, a before-image is the old
//! one, and a test can recompute any value it expects without a second copy of the data.
//! Values cover each type's shape: NULLs in nullable columns (one in eight), non-ASCII text,
//! sub-second times at the declared precision, decimals at full precision.

use arrow::datatypes::DataType;

use super::storage::{ColumnDef, KeyDerived, content_generation};
pub use crate::column_builder::ColumnBuilder;
use crate::types::{Length, SqlType};

/// SplitMix64: a fast, well-mixed 64-bit hash step.
pub fn mix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

fn column_hash(content: u64, column_id: i32) -> u64 {
    mix(content ^ (u64::from(column_id as u32)).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

const WORDS: [&str; 16] = [
    "alpha", "bravo", "Zoë", "delta", "écho", "foxtrot", "golf", "hôtel", "india", "juliett",
    "kilo", "lima", "Müller", "november", "oscar", "東京",
];

/// 2020-01-01T00:00:00 in microseconds since the Unix epoch.
const BASE_MICROS: i64 = 1_577_836_800_000_000;
const TEN_YEARS_MICROS: u64 = 10 * 365 * 86_400 * 1_000_000;

impl ColumnBuilder {
    /// A builder for values of `sql_type`, as the simulator serves it (types without an
    /// Arrow type of their own as text).
    pub fn for_sql_type(sql_type: &SqlType, capacity: usize) -> Self {
        let data_type = sql_type.arrow_type().unwrap_or(DataType::Utf8);
        ColumnBuilder::new(&data_type, capacity).expect("simulated SQL types have builders")
    }

    /// Appends the value column `column` has in a row with this key and content.
    pub fn append_generated(&mut self, column: &ColumnDef, is_key: bool, key: i64, content: u64) {
        if column
            .added_in
            .is_some_and(|added| content_generation(content) < added)
        {
            return self.append_null();
        }
        match column.from_key {
            Some(derived) => self.append_key_derived(column, derived, key),
            None => self.append_content(column, is_key, key, content),
        }
    }

    /// A value derived from the row key: stable under updates, so a snapshot cut on it never
    /// sees a row move between chunks.
    fn append_key_derived(&mut self, column: &ColumnDef, derived: KeyDerived, key: i64) {
        let hash = column_hash(mix(key as u64), column.column_id);
        match (derived, &mut *self) {
            (KeyDerived::Repeated, _) if column.nullable && hash.is_multiple_of(8) => {
                self.append_null()
            }
            (KeyDerived::Repeated, ColumnBuilder::Utf8(builder)) if column.sql_type.is_text() => {
                builder.append_value(cased(REGIONS[repeated_index(hash)], hash >> 16, true))
            }
            (KeyDerived::Repeated, _) => {
                self.append_content(column, true, key, repeated_index(hash) as u64)
            }
            (KeyDerived::Unique, ColumnBuilder::Utf8(builder)) if column.sql_type.is_text() => {
                let word = REGIONS[(hash % REGIONS.len() as u64) as usize];
                builder.append_value(format!("{}{key:010}", cased(word, hash >> 16, false)))
            }
            (KeyDerived::Unique, ColumnBuilder::Date32(builder)) => {
                builder.append_value(18_262 + key as i32)
            }
            (KeyDerived::Unique, ColumnBuilder::Timestamp(builder)) => builder.append_value(
                truncate_micros(&column.sql_type, BASE_MICROS + key * 1_000_003),
            ),
            (KeyDerived::Unique, _) => self.append_content(column, true, key, mix(key as u64)),
        }
    }

    fn append_content(&mut self, column: &ColumnDef, is_key: bool, key: i64, content: u64) {
        let hash = column_hash(content, column.column_id);
        if column.nullable && !is_key && mix(hash).is_multiple_of(8) {
            self.append_null();
            return;
        }
        match self {
            ColumnBuilder::Boolean(builder) => builder.append_value(hash & 1 == 1),
            ColumnBuilder::Int16(builder) => builder.append_value(match column.sql_type {
                SqlType::TinyInt => (hash % 256) as i16,
                _ if is_key => key as i16,
                _ => hash as i16,
            }),
            ColumnBuilder::Int32(builder) => builder.append_value(if is_key {
                key as i32
            } else {
                (hash >> 33) as i32
            }),
            ColumnBuilder::Int64(builder) => {
                builder.append_value(if is_key { key } else { (hash >> 1) as i64 })
            }
            ColumnBuilder::Float32(builder) => {
                builder.append_value((hash % 1_000_000) as f32 / 100.0)
            }
            ColumnBuilder::Float64(builder) => {
                builder.append_value((hash % 1_000_000_000) as f64 / 1000.0)
            }
            ColumnBuilder::Decimal(builder, _) => {
                let precision = match column.sql_type {
                    SqlType::Decimal { precision, .. } => precision,
                    SqlType::Money => 19,
                    _ => 10,
                };
                let digits = u32::from(precision).min(18);
                let modulus = 10u64.pow(digits);
                let magnitude = i128::from(hash % modulus);
                let signed = if hash >> 63 == 1 {
                    -magnitude
                } else {
                    magnitude
                };
                builder.append_value(signed);
            }
            ColumnBuilder::Date32(builder) => builder.append_value(18_262 + (hash % 3_650) as i32),
            ColumnBuilder::Timestamp(builder) => {
                builder.append_value(timestamp_value(&column.sql_type, hash))
            }
            ColumnBuilder::Utf8(builder) => {
                builder.append_value(text_value(&column.sql_type, key, hash))
            }
            ColumnBuilder::Binary(builder) => {
                builder.append_value(binary_value(&column.sql_type, hash))
            }
        }
    }
}

/// Values of repeated key-derived text: one of them holds about half the rows.
const REGIONS: [&str; 8] = [
    "north", "south", "east", "west", "central", "harbour", "uplands", "coast",
];

/// Which of [`REGIONS`] (or of 24 values of another type) a repeated value takes.
fn repeated_index(hash: u64) -> usize {
    if hash & 1 == 0 {
        0
    } else {
        (hash >> 8) as usize % REGIONS.len()
    }
}

/// A case variant of an ASCII word (and, for repeated values, one with a trailing space):
/// all equal under a case-insensitive collation, ordered apart by bytes.
fn cased(word: &str, hash: u64, trailing_space: bool) -> String {
    match hash % if trailing_space { 4 } else { 3 } {
        0 => word.to_string(),
        1 => word[..1].to_uppercase() + &word[1..],
        2 => word.to_uppercase(),
        _ => format!("{word} "),
    }
}

/// Truncates microseconds to a date-time type's precision.
fn truncate_micros(sql_type: &SqlType, micros: i64) -> i64 {
    match sql_type {
        SqlType::SmallDateTime => micros.div_euclid(60_000_000) * 60_000_000,
        SqlType::DateTime => micros.div_euclid(1_000) * 1_000,
        SqlType::DateTime2 { precision } | SqlType::DateTimeOffset { precision }
            if *precision < 6 =>
        {
            let unit = 10i64.pow(6 - u32::from(*precision));
            micros.div_euclid(unit) * unit
        }
        _ => micros,
    }
}

fn timestamp_value(sql_type: &SqlType, hash: u64) -> i64 {
    let micros = BASE_MICROS + (hash % TEN_YEARS_MICROS) as i64;
    let seconds = micros.div_euclid(1_000_000) * 1_000_000;
    match sql_type {
        SqlType::SmallDateTime => micros.div_euclid(60_000_000) * 60_000_000,
        // datetime keeps 1/300 s ticks, rounded to microseconds as the decoder does.
        SqlType::DateTime => seconds + (((hash >> 40) % 300) as i64 * 1_000_000 + 150) / 300,
        SqlType::DateTime2 { precision } | SqlType::DateTimeOffset { precision }
            if *precision < 6 =>
        {
            let unit = 10i64.pow(6 - u32::from(*precision));
            micros.div_euclid(unit) * unit
        }
        _ => micros,
    }
}

fn text_value(sql_type: &SqlType, key: i64, hash: u64) -> String {
    match sql_type {
        SqlType::UniqueIdentifier => {
            let high = hash;
            let low = mix(hash);
            format!(
                "{:08X}-{:04X}-{:04X}-{:04X}-{:012X}",
                high >> 32,
                (high >> 16) & 0xFFFF,
                high & 0xFFFF,
                low >> 48,
                low & 0xFFFF_FFFF_FFFF
            )
        }
        SqlType::Time { precision } => {
            crate::types::time_text(hash % (86_400 * 10_000_000), *precision)
        }
        SqlType::Xml => format!("<row key=\"{key}\" value=\"{}\"/>", hash % 100_000),
        _ => {
            let word = WORDS[(hash % WORDS.len() as u64) as usize];
            let mut text = format!("{word} {}", (hash >> 8) % 1_000_000);
            let limit = match sql_type {
                SqlType::Char(Length::Limited(n))
                | SqlType::VarChar(Length::Limited(n))
                | SqlType::NChar(Length::Limited(n))
                | SqlType::NVarChar(Length::Limited(n)) => *n as usize,
                _ => {
                    // (max) and text types: a longer value, up to about 400 characters.
                    let repeats = (hash >> 56) as usize % 16;
                    for _ in 0..repeats {
                        text.push_str(" lorem ipsum dolor");
                    }
                    usize::MAX
                }
            };
            if text.chars().count() > limit {
                text = text.chars().take(limit).collect();
            }
            if matches!(sql_type, SqlType::Char(_) | SqlType::NChar(_)) {
                let padding = limit.saturating_sub(text.chars().count());
                text.extend(std::iter::repeat_n(' ', padding));
            }
            text
        }
    }
}

fn binary_value(sql_type: &SqlType, hash: u64) -> Vec<u8> {
    let length = match sql_type {
        SqlType::Binary(Length::Limited(n)) => *n as usize,
        SqlType::VarBinary(Length::Limited(n)) => (1 + (hash % 32) as usize).min(*n as usize),
        SqlType::RowVersion => 8,
        _ => 16 + (hash % 48) as usize,
    };
    let mut bytes = Vec::with_capacity(length);
    let mut state = hash;
    while bytes.len() < length {
        state = mix(state);
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(length);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, StringArray, TimestampMicrosecondArray};

    fn column(sql_type: &str, nullable: bool) -> ColumnDef {
        ColumnDef {
            from_key: None,
            added_in: None,
            name: "c".into(),
            column_id: 3,
            sql_type: sql_type.parse().expect("type"),
            nullable,
        }
    }

    #[test]
    fn values_are_a_function_of_content_and_respect_declared_sizes() {
        let def = column("nvarchar(8)", false);
        let mut first = ColumnBuilder::for_sql_type(&def.sql_type, 4);
        let mut second = ColumnBuilder::for_sql_type(&def.sql_type, 4);
        for content in 0..100u64 {
            first.append_generated(&def, false, 1, content);
            second.append_generated(&def, false, 1, content);
        }
        let (a, b) = (first.finish(), second.finish());
        assert_eq!(&a, &b);
        let strings = a.as_any().downcast_ref::<StringArray>().expect("utf8");
        assert!(strings.iter().flatten().all(|s| s.chars().count() <= 8));
    }

    #[test]
    fn nullable_columns_get_some_nulls_and_keys_never() {
        let def = column("int", true);
        let mut builder = ColumnBuilder::for_sql_type(&def.sql_type, 1000);
        for content in 0..1000u64 {
            builder.append_generated(&def, false, 7, content);
        }
        let nulls = builder.finish().null_count();
        assert!((50..250).contains(&nulls), "{nulls} nulls in 1000");
        let mut keys = ColumnBuilder::for_sql_type(&def.sql_type, 1000);
        for content in 0..1000u64 {
            keys.append_generated(&def, true, 7, content);
        }
        assert_eq!(keys.finish().null_count(), 0);
    }

    #[test]
    fn times_honour_their_precision() {
        let def = column("datetime2(3)", false);
        let mut builder = ColumnBuilder::for_sql_type(&def.sql_type, 100);
        for content in 0..100u64 {
            builder.append_generated(&def, false, 0, content);
        }
        let array = builder.finish();
        let times = array
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .expect("timestamps");
        assert!(times.values().iter().all(|micros| micros % 1000 == 0));
        let time = text_value(&SqlType::Time { precision: 3 }, 0, 123_456_789_012);
        assert_eq!(time.len(), "00:00:00.0000000".len());
        assert!(time.ends_with("0000"), "{time}");
        let guid = text_value(&SqlType::UniqueIdentifier, 0, 42);
        assert_eq!(guid.len(), 36);
        assert_eq!(guid, guid.to_uppercase());
    }
}
