//! The server clock: turning `cdc.lsn_time_mapping.tran_end_time` (server local time) into UTC.
//!
//! SQL Server records commit times in its own local time. The seed's `sourceTimeZone` option
//! names that zone; `auto` asks the server: SQL Server 2022 and Azure SQL know their Windows
//! zone (`CURRENT_TIMEZONE_ID()`), older servers only their current UTC offset, which is wrong
//! across a daylight-saving change (a warning says so each time it is read).
//!
//! With a named zone, `AT TIME ZONE` reads an ambiguous local time (the repeated hour of a
//! fall-back) as the earlier, daylight offset. A commit made after the clock went back would
//! then get a UTC time an hour early, before commits with lower LSNs. The rule kept from the
//! seed: inside a repeated hour, a commit that follows a "drop" (a commit whose time is more
//! than a minute below the commit just before it in LSN order) within three hours takes the
//! standard offset instead, so commit-time order stays LSN order.
//!
//! Each expression ends `AS datetime2(3)`: commit times carry milliseconds, as in the seed.

use std::fmt;

use crate::error::{Error, Result};
use crate::mssql::ident;

/// How the server's clock relates to UTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerClock {
    /// The server runs on UTC.
    Utc,
    /// A named Windows time zone (`sys.time_zone_info`).
    Zone(String),
    /// A fixed offset in minutes east of UTC, as read from an older server.
    Offset(i32),
}

/// The `sourceTimeZone` setting: ask the server, or a given zone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClockSetting {
    /// Detect: the named zone where the server can name it, else its current offset.
    Auto,
    /// The server clock is this zone (or `UTC`).
    Fixed(ServerClock),
}

impl std::str::FromStr for ClockSetting {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let trimmed = text.trim();
        if trimmed.eq_ignore_ascii_case("auto") || trimmed.is_empty() {
            return Ok(ClockSetting::Auto);
        }
        if trimmed.eq_ignore_ascii_case("utc") {
            return Ok(ClockSetting::Fixed(ServerClock::Utc));
        }
        ident::time_zone_literal(trimmed)?;
        Ok(ClockSetting::Fixed(ServerClock::Zone(trimmed.to_string())))
    }
}

impl fmt::Display for ServerClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerClock::Utc => f.write_str("UTC"),
            ServerClock::Zone(zone) => f.write_str(zone),
            ServerClock::Offset(minutes) => {
                let sign = if *minutes < 0 { '-' } else { '+' };
                let magnitude = minutes.unsigned_abs();
                write!(f, "UTC{sign}{:02}:{:02}", magnitude / 60, magnitude % 60)
            }
        }
    }
}

/// Whether the server can name its zone: SQL Server 2022 (major version 16) and later, Azure
/// SQL Database (engine edition 5) and Managed Instance (8).
/// <https://learn.microsoft.com/sql/t-sql/functions/serverproperty-transact-sql>
pub fn named_zone_capability_sql() -> &'static str {
    "SELECT CASE WHEN CAST(SERVERPROPERTY('ProductMajorVersion') AS int) >= 16 \
     OR CAST(SERVERPROPERTY('EngineEdition') AS int) IN (5, 8) THEN 1 ELSE 0 END AS named_zone"
}

/// The server's Windows time zone.
/// <https://learn.microsoft.com/sql/t-sql/functions/current-timezone-id-transact-sql>
pub fn zone_sql() -> &'static str {
    "SELECT CURRENT_TIMEZONE_ID() AS zone"
}

/// The server clock's current offset in minutes east of UTC.
/// <https://learn.microsoft.com/sql/t-sql/functions/datepart-transact-sql>
pub fn offset_sql() -> &'static str {
    "SELECT DATEPART(TZOFFSET, SYSDATETIMEOFFSET()) AS offset_minutes"
}

impl ServerClock {
    /// The UTC `datetime2(3)` of the local time `time`, the commit time of the commit whose
    /// row in `cdc.lsn_time_mapping` has the alias `mapping` (for the fall-back rule).
    pub fn utc_expression(&self, time: &str, mapping: &str) -> Result<String> {
        Ok(match self {
            ServerClock::Utc => format!("CAST({time} AS datetime2(3))"),
            ServerClock::Offset(minutes) => {
                format!(
                    "CAST(DATEADD(minute, {}, {time}) AS datetime2(3))",
                    -minutes
                )
            }
            ServerClock::Zone(zone) => {
                let zone = ident::time_zone_literal(zone)?;
                let daylight = format!(
                    "CAST(({time} AT TIME ZONE {zone}) AT TIME ZONE 'UTC' AS datetime2(3))"
                );
                let later_offset =
                    format!("DATEPART(TZOFFSET, DATEADD(hour, 3, {time}) AT TIME ZONE {zone})");
                let standard =
                    format!("CAST(DATEADD(minute, -{later_offset}, {time}) AS datetime2(3))");
                // A drop: a commit r at or before this one (in LSN order, within three hours)
                // whose time is more than a minute below the commit just before r.
                let drop_before = format!(
                    "EXISTS (SELECT 1 FROM cdc.lsn_time_mapping r \
                     WHERE r.start_lsn <= {mapping}.start_lsn \
                     AND r.tran_end_time > DATEADD(hour, -3, {time}) \
                     AND r.tran_end_time <= DATEADD(hour, 3, {time}) \
                     AND r.tran_end_time < DATEADD(minute, -1, (SELECT TOP (1) q.tran_end_time \
                     FROM cdc.lsn_time_mapping q WHERE q.start_lsn < r.start_lsn \
                     ORDER BY q.start_lsn DESC)))"
                );
                format!(
                    "CASE WHEN DATEPART(TZOFFSET, {time} AT TIME ZONE {zone}) <> {later_offset} \
                     AND {drop_before} THEN {standard} ELSE {daylight} END"
                )
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_like_the_seed_option() {
        assert_eq!(
            "auto".parse::<ClockSetting>().expect("ok"),
            ClockSetting::Auto
        );
        assert_eq!(
            "utc".parse::<ClockSetting>().expect("ok"),
            ClockSetting::Fixed(ServerClock::Utc)
        );
        assert_eq!(
            "E. South America Standard Time"
                .parse::<ClockSetting>()
                .expect("ok"),
            ClockSetting::Fixed(ServerClock::Zone("E. South America Standard Time".into()))
        );
        assert!("Pacific'; --".parse::<ClockSetting>().is_err());
    }

    #[test]
    fn offsets_print_as_utc_plus_minus() {
        assert_eq!(ServerClock::Offset(-180).to_string(), "UTC-03:00");
        assert_eq!(ServerClock::Offset(330).to_string(), "UTC+05:30");
    }

    #[test]
    fn fixed_clocks_are_one_dateadd() {
        assert_eq!(
            ServerClock::Utc
                .utc_expression("m.tran_end_time", "m")
                .expect("ok"),
            "CAST(m.tran_end_time AS datetime2(3))"
        );
        assert_eq!(
            ServerClock::Offset(-180)
                .utc_expression("m.tran_end_time", "m")
                .expect("ok"),
            "CAST(DATEADD(minute, 180, m.tran_end_time) AS datetime2(3))"
        );
    }
}
