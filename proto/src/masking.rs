//! How the server masks a column it serves (docs/security.md, "Masking at the source").
//!
//! Masks are the server's configuration, never a client's request: a caller without a grant
//! to read a table in clear gets its masked columns in the masked form, and no serve option
//! asks for the clear one. A masked column's Arrow field says how it was masked
//! ([`MASK_METADATA_KEY`]), beside the SQL type it is served as.

use std::fmt;
use std::str::FromStr;

use crate::types::{Length, SqlType};

/// The field metadata key naming a served column's mask (`hash`, `truncate(4)`, `null`).
pub const MASK_METADATA_KEY: &str = "mssql_cdc.mask";

/// Characters of a hashed value: the HMAC-SHA256 in lower-case hex.
pub const HASH_CHARS: u32 = 64;

/// The type a hashed column is served as, whatever its own.
pub const HASH_TYPE: SqlType = SqlType::Char(Length::Limited(HASH_CHARS));

/// How a column is served masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mask {
    /// A keyed HMAC-SHA256 of the value's canonical text, in lower-case hex: equal values
    /// hash equal under one key, in every table, so joins on the hash still work; NULL stays
    /// NULL.
    Hash,
    /// The first `n` characters of a text (or bytes of a binary value).
    Truncate(u32),
    /// NULL in every row.
    Null,
}

impl fmt::Display for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mask::Hash => f.write_str("hash"),
            Mask::Truncate(n) => write!(f, "truncate({n})"),
            Mask::Null => f.write_str("null"),
        }
    }
}

impl FromStr for Mask {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim().to_ascii_lowercase();
        let truncate = text
            .strip_prefix("truncate(")
            .and_then(|rest| rest.strip_suffix(')'));
        match (text.as_str(), truncate) {
            ("hash", _) => Ok(Mask::Hash),
            ("null", _) => Ok(Mask::Null),
            (_, Some(n)) => match n.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(Mask::Truncate(n)),
                _ => Err(format!(
                    "'{text}': truncate keeps a positive number of characters, e.g. truncate(4)"
                )),
            },
            _ => Err(format!(
                "'{text}' is not a mask: use \"hash\", \"truncate(n)\" or \"null\""
            )),
        }
    }
}

impl Mask {
    /// The SQL type a column of `source` type is served as under this mask; an error when the
    /// mask does not apply to it (a truncated number).
    pub fn served_type(&self, source: &SqlType) -> Result<SqlType, String> {
        match self {
            Mask::Hash => Ok(HASH_TYPE),
            Mask::Null => Ok(source.clone()),
            Mask::Truncate(_) => match source.arrow_type() {
                Some(arrow::datatypes::DataType::Utf8 | arrow::datatypes::DataType::Binary) => {
                    Ok(source.clone())
                }
                _ => Err(format!(
                    "truncate applies to text and binary columns, not {source}: hash or null it"
                )),
            },
        }
    }

    /// The mask of a served field, from its metadata; `None` for a clear column.
    pub fn of_field(field: &arrow::datatypes::Field) -> Option<Result<Mask, String>> {
        field
            .metadata()
            .get(MASK_METADATA_KEY)
            .map(|text| text.parse())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_read_back_what_they_write() {
        for mask in [Mask::Hash, Mask::Truncate(4), Mask::Null] {
            assert_eq!(mask.to_string().parse::<Mask>(), Ok(mask));
        }
        assert_eq!(" Truncate( 2 ) ".parse::<Mask>(), Ok(Mask::Truncate(2)));
        for bad in [
            "",
            "truncate(0)",
            "truncate(-1)",
            "truncate",
            "sha1",
            "hash(4)",
        ] {
            assert!(bad.parse::<Mask>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_hash_is_text_and_a_truncated_number_is_refused() {
        assert_eq!(
            Mask::Hash.served_type(&SqlType::Int),
            Ok(SqlType::Char(Length::Limited(64)))
        );
        assert_eq!(Mask::Null.served_type(&SqlType::Int), Ok(SqlType::Int));
        let text = SqlType::NVarChar(Length::Max);
        assert_eq!(Mask::Truncate(3).served_type(&text), Ok(text.clone()));
        assert!(Mask::Truncate(3).served_type(&SqlType::Int).is_err());
    }
}
