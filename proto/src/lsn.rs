//! Log sequence numbers.
//!
//! SQL Server addresses every log record with a 10-byte LSN: the virtual log file sequence
//! (4 bytes), the log block offset (4 bytes) and the slot in the block (2 bytes), all
//! big-endian. CDC stamps every change row with the LSN of its transaction's commit
//! (`__$start_lsn`) and of the operation inside it (`__$seqval`), so byte order is commit order.
//!
//! On every boundary of this project (Flight commands, tickets, offsets, Delta columns) an LSN
//! travels as `0x` followed by 20 upper-case hex digits, so that string order equals commit
//! order. Parsing accepts an optional `0x` (either case) and left-pads shorter hex strings,
//! as `CONVERT(binary(10), ?, 1)` does for the seed library.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Number of bytes in an LSN.
pub const LSN_LEN: usize = 10;

/// A 10-byte SQL Server log sequence number, ordered by its bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn([u8; LSN_LEN]);

/// Why a text or byte string is not an LSN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LsnParseError {
    /// The text was empty (or only `0x`).
    #[error("empty lsn: expected '0x' followed by up to 20 hex digits")]
    Empty,
    /// More than 20 hex digits.
    #[error("lsn '{0}' has more than 20 hex digits")]
    TooLong(String),
    /// A character that is not a hex digit.
    #[error("lsn '{0}' is not hex: expected '0x' followed by up to 20 hex digits")]
    NotHex(String),
    /// A byte string of the wrong length.
    #[error("an lsn has 10 bytes, not {0}")]
    WrongLength(usize),
}

impl Lsn {
    /// The zero LSN (`0x00000000000000000000`), below every real LSN.
    pub const ZERO: Lsn = Lsn([0; LSN_LEN]);
    /// The largest representable LSN.
    pub const MAX: Lsn = Lsn([0xFF; LSN_LEN]);

    /// An LSN from its 10 bytes.
    pub const fn from_bytes(bytes: [u8; LSN_LEN]) -> Self {
        Lsn(bytes)
    }

    /// An LSN from a byte slice of exactly 10 bytes.
    pub fn try_from_slice(bytes: &[u8]) -> Result<Self, LsnParseError> {
        let array: [u8; LSN_LEN] = bytes
            .try_into()
            .map_err(|_| LsnParseError::WrongLength(bytes.len()))?;
        Ok(Lsn(array))
    }

    /// The 10 bytes, big-endian.
    pub const fn as_bytes(&self) -> &[u8; LSN_LEN] {
        &self.0
    }

    /// The LSN as an unsigned 80-bit integer.
    pub fn to_u128(self) -> u128 {
        let mut wide = [0u8; 16];
        wide[16 - LSN_LEN..].copy_from_slice(&self.0);
        u128::from_be_bytes(wide)
    }

    /// The LSN of an unsigned integer; `None` when it needs more than 80 bits.
    pub fn from_u128(value: u128) -> Option<Self> {
        if value >> (LSN_LEN * 8) != 0 {
            return None;
        }
        let wide = value.to_be_bytes();
        let mut bytes = [0u8; LSN_LEN];
        bytes.copy_from_slice(&wide[16 - LSN_LEN..]);
        Some(Lsn(bytes))
    }

    /// The next LSN (what `sys.fn_cdc_increment_lsn` returns); saturates at [`Lsn::MAX`].
    pub fn increment(self) -> Self {
        Lsn::from_u128(self.to_u128() + 1).unwrap_or(Lsn::MAX)
    }

    /// The previous LSN (what `sys.fn_cdc_decrement_lsn` returns); saturates at [`Lsn::ZERO`].
    pub fn decrement(self) -> Self {
        Lsn::from_u128(self.to_u128().saturating_sub(1)).unwrap_or(Lsn::ZERO)
    }

    /// Whether this is the zero LSN.
    pub fn is_zero(&self) -> bool {
        *self == Lsn::ZERO
    }

    /// Writes the wire form (`0x` + 20 upper-case hex digits) into a 22-byte buffer.
    pub fn write_hex(&self, out: &mut [u8; 22]) {
        const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
        out[0] = b'0';
        out[1] = b'x';
        for (index, byte) in self.0.iter().enumerate() {
            out[2 + 2 * index] = DIGITS[usize::from(byte >> 4)];
            out[3 + 2 * index] = DIGITS[usize::from(byte & 0x0F)];
        }
    }

    /// The wire form: `0x` followed by 20 upper-case hex digits.
    pub fn to_hex(&self) -> String {
        let mut out = [0u8; 22];
        self.write_hex(&mut out);
        out.iter().map(|&b| char::from(b)).collect()
    }
}

impl FromStr for Lsn {
    type Err = LsnParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        let digits = trimmed
            .strip_prefix("0x")
            .or_else(|| trimmed.strip_prefix("0X"))
            .unwrap_or(trimmed);
        if digits.is_empty() {
            return Err(LsnParseError::Empty);
        }
        if digits.len() > 2 * LSN_LEN {
            return Err(LsnParseError::TooLong(text.to_string()));
        }
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LsnParseError::NotHex(text.to_string()));
        }
        // Left-padded with zeros on the stack: parsed once per row of bronze and silver
        // reads, so no allocation.
        let mut padded = [b'0'; 2 * LSN_LEN];
        padded[2 * LSN_LEN - digits.len()..].copy_from_slice(digits.as_bytes());
        let mut bytes = [0u8; LSN_LEN];
        hex::decode_to_slice(padded, &mut bytes)
            .map_err(|_| LsnParseError::NotHex(text.to_string()))?;
        Ok(Lsn(bytes))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lsn({})", self.to_hex())
    }
}

impl Serialize for Lsn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_wire_form_and_prints_it_back() {
        let lsn: Lsn = "0x0000002A000001F00003".parse().expect("valid lsn");
        assert_eq!(lsn.to_hex(), "0x0000002A000001F00003");
        assert_eq!(lsn.as_bytes()[3], 0x2A);
    }

    #[test]
    fn accepts_missing_prefix_lower_case_and_short_forms() {
        let lsn: Lsn = "2a000001f00003".parse().expect("valid lsn");
        assert_eq!(lsn.to_hex(), "0x0000002A000001F00003");
        assert_eq!("0X1".parse::<Lsn>().expect("valid"), Lsn::ZERO.increment());
    }

    #[test]
    fn refuses_what_is_not_an_lsn() {
        assert_eq!("".parse::<Lsn>(), Err(LsnParseError::Empty));
        assert_eq!("0x".parse::<Lsn>(), Err(LsnParseError::Empty));
        assert!(matches!(
            "0x12G4".parse::<Lsn>(),
            Err(LsnParseError::NotHex(_))
        ));
        assert!(matches!(
            "0x000000000000000000001".parse::<Lsn>(),
            Err(LsnParseError::TooLong(_))
        ));
        assert!(matches!("-1".parse::<Lsn>(), Err(LsnParseError::NotHex(_))));
        assert_eq!(
            Lsn::try_from_slice(&[1, 2]),
            Err(LsnParseError::WrongLength(2))
        );
    }

    #[test]
    fn increment_carries_across_bytes_and_saturates() {
        let lsn: Lsn = "0x0000000100000000FFFF".parse().expect("valid");
        assert_eq!(lsn.increment().to_hex(), "0x00000001000000010000");
        assert_eq!(lsn.increment().decrement(), lsn);
        assert_eq!(Lsn::MAX.increment(), Lsn::MAX);
        assert_eq!(Lsn::ZERO.decrement(), Lsn::ZERO);
    }

    #[test]
    fn serde_uses_the_wire_form() {
        let lsn: Lsn = "0x0000002A000001F00003".parse().expect("valid");
        let json = serde_json::to_string(&lsn).expect("serializes");
        assert_eq!(json, "\"0x0000002A000001F00003\"");
        assert_eq!(serde_json::from_str::<Lsn>(&json).expect("parses"), lsn);
        assert!(serde_json::from_str::<Lsn>("\"nope\"").is_err());
    }

    fn any_lsn() -> impl Strategy<Value = Lsn> {
        any::<[u8; LSN_LEN]>().prop_map(Lsn::from_bytes)
    }

    proptest! {
        #[test]
        fn hex_round_trips(lsn in any_lsn()) {
            prop_assert_eq!(lsn.to_hex().parse::<Lsn>().expect("round trip"), lsn);
            prop_assert_eq!(lsn.to_hex().to_lowercase().parse::<Lsn>().expect("lower"), lsn);
        }

        #[test]
        fn string_order_is_byte_order(a in any_lsn(), b in any_lsn()) {
            prop_assert_eq!(a.cmp(&b), a.to_hex().cmp(&b.to_hex()));
            prop_assert_eq!(a.cmp(&b), a.to_u128().cmp(&b.to_u128()));
        }

        #[test]
        fn increment_and_decrement_are_inverse(lsn in any_lsn()) {
            prop_assume!(lsn != Lsn::MAX && lsn != Lsn::ZERO);
            prop_assert!(lsn.increment() > lsn);
            prop_assert!(lsn.decrement() < lsn);
            prop_assert_eq!(lsn.increment().decrement(), lsn);
            prop_assert_eq!(lsn.decrement().increment(), lsn);
        }

        #[test]
        fn short_forms_left_pad(value in 0u64..u64::MAX) {
            let lsn: Lsn = format!("{value:x}").parse().expect("short form");
            prop_assert_eq!(lsn.to_u128(), u128::from(value));
        }
    }
}
