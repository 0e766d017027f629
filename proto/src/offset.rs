//! Stream offsets and commit times.
//!
//! An offset is the position of a change stream: `lsn` is the last *processed* commit LSN and
//! `commit_ts` its commit time in UTC with milliseconds, serialised exactly as the seed
//! library's checkpoint does: `{"lsn": "0x0000002A000001F00003", "commit_ts":
//! "2026-09-28T14:03:12.117"}`. The commit time is kept even when a batch read no rows,
//! because the end of a range can be an idle CDC entry; that is what lets the completeness
//! verdict advance on quiet tables. An unknown commit time is the empty string.

use std::fmt;

use chrono::{DateTime, NaiveDateTime};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::lsn::Lsn;

/// A commit time: microseconds since the Unix epoch, UTC.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct CommitTime(pub i64);

/// Why a text is not a commit time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("commit time '{0}' is not an ISO-8601 UTC time such as 2026-09-28T14:03:12.117")]
pub struct CommitTimeParseError(pub String);

impl CommitTime {
    /// Microseconds since the Unix epoch.
    pub fn micros(self) -> i64 {
        self.0
    }

    /// The time truncated to milliseconds, as `tran_end_time` is (`datetime2(3)` in the seed).
    pub fn to_millis_precision(self) -> Self {
        CommitTime(self.0.div_euclid(1000) * 1000)
    }

    /// ISO-8601 without a zone, with exactly three fractional digits.
    pub fn to_iso_millis(self) -> String {
        match DateTime::from_timestamp_micros(self.0) {
            Some(time) => time.naive_utc().format("%Y-%m-%dT%H:%M:%S%.3f").to_string(),
            None => String::new(),
        }
    }

    /// Parses ISO-8601 (`T` or space, optional fraction, optional `Z` or `+00:00`).
    pub fn parse_iso(text: &str) -> Result<Self, CommitTimeParseError> {
        let trimmed = text.trim();
        if let Ok(aware) = DateTime::parse_from_rfc3339(trimmed) {
            return Ok(CommitTime(aware.timestamp_micros()));
        }
        let naive = trimmed.strip_suffix('Z').unwrap_or(trimmed);
        for format in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"] {
            if let Ok(time) = NaiveDateTime::parse_from_str(naive, format) {
                return Ok(CommitTime(time.and_utc().timestamp_micros()));
            }
        }
        Err(CommitTimeParseError(text.to_string()))
    }
}

impl Serialize for CommitTime {
    /// ISO-8601 UTC without a zone: three fractional digits when the time is a whole
    /// millisecond (every commit time), six otherwise.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.0 % 1000 == 0 {
            serializer.serialize_str(&self.to_iso_millis())
        } else {
            let text = DateTime::from_timestamp_micros(self.0)
                .map(|time| time.naive_utc().format("%Y-%m-%dT%H:%M:%S%.6f").to_string())
                .unwrap_or_default();
            serializer.serialize_str(&text)
        }
    }
}

impl<'de> Deserialize<'de> for CommitTime {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        CommitTime::parse_iso(&text).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for CommitTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_iso_millis())
    }
}

impl fmt::Debug for CommitTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommitTime({})", self.to_iso_millis())
    }
}

/// A stream position: the last processed commit and its commit time.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Offset {
    /// The last processed commit LSN.
    pub lsn: Lsn,
    /// Its commit time (UTC, milliseconds); `None` serialises as `""`.
    #[serde(
        serialize_with = "serialize_commit_ts",
        deserialize_with = "deserialize_commit_ts"
    )]
    pub commit_ts: Option<CommitTime>,
}

impl Offset {
    /// An offset at `lsn` with its commit time.
    pub fn new(lsn: Lsn, commit_ts: Option<CommitTime>) -> Self {
        Offset { lsn, commit_ts }
    }

    /// The offset as its JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an offset always serialises")
    }
}

fn serialize_commit_ts<S: Serializer>(
    value: &Option<CommitTime>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(time) => serializer.serialize_str(&time.to_iso_millis()),
        None => serializer.serialize_str(""),
    }
}

fn deserialize_commit_ts<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<CommitTime>, D::Error> {
    let text = Option::<String>::deserialize(deserializer)?.unwrap_or_default();
    if text.is_empty() {
        return Ok(None);
    }
    CommitTime::parse_iso(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn serialises_exactly_as_the_seed_offset() {
        let offset = Offset::new(
            "0x0000002A000001F00003".parse().expect("lsn"),
            Some(CommitTime::parse_iso("2026-09-28T14:03:12.117").expect("time")),
        );
        assert_eq!(
            offset.to_json(),
            r#"{"lsn":"0x0000002A000001F00003","commit_ts":"2026-09-28T14:03:12.117"}"#
        );
        let parsed: Offset = serde_json::from_str(
            r#"{"lsn": "0x0000002A000001F00003", "commit_ts": "2026-09-28T14:03:12.117"}"#,
        )
        .expect("parses");
        assert_eq!(parsed, offset);
    }

    #[test]
    fn whole_seconds_keep_three_digits_and_unknown_is_empty() {
        let time = CommitTime::parse_iso("2026-01-01T00:00:00").expect("time");
        assert_eq!(time.to_iso_millis(), "2026-01-01T00:00:00.000");
        let unknown = Offset::new(Lsn::ZERO, None);
        assert_eq!(
            unknown.to_json(),
            r#"{"lsn":"0x00000000000000000000","commit_ts":""}"#
        );
        let back: Offset = serde_json::from_str(&unknown.to_json()).expect("parses");
        assert_eq!(back, unknown);
    }

    #[test]
    fn accepts_zoned_and_spaced_forms_and_refuses_garbage() {
        let utc = CommitTime::parse_iso("2026-09-28T14:03:12.117Z").expect("z");
        let spaced = CommitTime::parse_iso("2026-09-28 14:03:12.117").expect("space");
        let offset = CommitTime::parse_iso("2026-09-28T16:03:12.117+02:00").expect("offset");
        assert_eq!(utc, spaced);
        assert_eq!(utc, offset);
        assert!(CommitTime::parse_iso("yesterday").is_err());
        assert!(serde_json::from_str::<Offset>(r#"{"lsn":"0x01","commit_ts":"soon"}"#).is_err());
    }

    proptest! {
        #[test]
        fn millisecond_times_round_trip(millis in 0i64..253_402_300_799_000) {
            let time = CommitTime(millis * 1000);
            prop_assert_eq!(CommitTime::parse_iso(&time.to_iso_millis()).expect("parses"), time);
        }
    }
}
