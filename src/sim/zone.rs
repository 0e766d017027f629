//! A named time zone for the simulated database's clock.
//!
//! SQL Server records `cdc.lsn_time_mapping.tran_end_time` in the server's local time, so in
//! a zone with daylight saving the hour after a fall-back repeats and commit times read
//! back in local time go backwards. The SQL Server source converts each commit's local time
//! to UTC with `AT TIME ZONE` and the seed's fall-back rule ([`crate::mssql::clock`]); a
//! simulated database with a zone serves its commit times through the same rule, computed
//! here once per commit, so the conformance suite checks the rule across a fall-back hour.
//!
//! The simulator stores true UTC instants; the local time SQL Server would have recorded is
//! derived from them, and what is served is that local time converted back by the rule.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::offset::CommitTime;
use crate::sim::storage::MappingView;

const MICROS_PER_MINUTE: i64 = 60_000_000;
const MICROS_PER_HOUR: i64 = 60 * MICROS_PER_MINUTE;

/// How far around a commit the fall-back rule looks for a drop of the clock (the seed's
/// `_SHIFT_HOURS`).
const SHIFT: i64 = 3 * MICROS_PER_HOUR;

/// A change of a zone's offset from UTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetChange {
    /// The UTC instant from which `offset_minutes` applies.
    pub at: CommitTime,
    /// Minutes east of UTC from then on.
    pub offset_minutes: i32,
}

/// A Windows time zone as the simulator models it: an offset and its changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimZone {
    /// The zone's Windows name, as `CURRENT_TIMEZONE_ID()` reports it.
    pub name: String,
    /// Minutes east of UTC before the first change.
    pub initial_offset_minutes: i32,
    /// The offset's changes, in time order.
    pub changes: Vec<OffsetChange>,
}

impl SimZone {
    /// The offset in minutes at the UTC instant `utc` (microseconds).
    fn offset_at(&self, utc: i64) -> i32 {
        self.changes
            .iter()
            .take_while(|change| change.at.0 <= utc)
            .last()
            .map_or(self.initial_offset_minutes, |change| change.offset_minutes)
    }

    /// The local wall-clock time SQL Server records for a commit at the UTC instant `utc`.
    pub fn local(&self, utc: CommitTime) -> CommitTime {
        CommitTime(utc.0 + i64::from(self.offset_at(utc.0)) * MICROS_PER_MINUTE)
    }

    /// The offset `local AT TIME ZONE` gives a local time: the one valid offset; in the
    /// repeated hour after a fall-back, the earlier instant's (the offset before the
    /// change); in the hour skipped by a spring-forward, the offset before the change too.
    /// <https://learn.microsoft.com/sql/t-sql/queries/at-time-zone-transact-sql>
    fn offset_of_local(&self, local: i64) -> i32 {
        let mut offsets: Vec<i32> = std::iter::once(self.initial_offset_minutes)
            .chain(self.changes.iter().map(|change| change.offset_minutes))
            .collect();
        offsets.sort_unstable();
        offsets.dedup();
        // The earliest instant is the one with the largest offset.
        let valid = offsets.iter().rev().find(|offset| {
            self.offset_at(local - i64::from(**offset) * MICROS_PER_MINUTE) == **offset
        });
        match valid {
            Some(offset) => *offset,
            // A skipped local time: the offset in effect just before the change it fell in.
            None => {
                let widest = offsets
                    .last()
                    .copied()
                    .unwrap_or(self.initial_offset_minutes);
                self.offset_at(local - i64::from(widest) * MICROS_PER_MINUTE)
            }
        }
    }

    /// The largest change of the offset, in microseconds.
    fn largest_change(&self) -> i64 {
        let mut previous = self.initial_offset_minutes;
        let mut largest = 0i64;
        for change in &self.changes {
            largest = largest.max(i64::from((change.offset_minutes - previous).abs()));
            previous = change.offset_minutes;
        }
        largest * MICROS_PER_MINUTE
    }

    /// The commit time served for the visible mapping entry at `index`: its local time
    /// converted to UTC by the seed's rule, exactly as [`crate::mssql::clock`] writes it in
    /// T-SQL. A commit whose local time is in or before a fall-back's repeated hour takes
    /// `AT TIME ZONE`'s offset, unless the clock dropped (a commit at or before it, within
    /// three hours of its time, more than a minute earlier than the commit before that one):
    /// then it takes the offset three hours later, so commit-time order stays LSN order.
    pub fn commit_time(&self, mapping: &MappingView, index: u64) -> Result<CommitTime> {
        let local = |index: u64| -> Result<i64> { Ok(self.local(mapping.get(index)?.end_time).0) };
        let time = local(index)?;
        let now = self.offset_of_local(time);
        let later = self.offset_of_local(time + SHIFT);
        let offset = if now != later && self.dropped_before(&local, index, time)? {
            later
        } else {
            now
        };
        Ok(CommitTime(time - i64::from(offset) * MICROS_PER_MINUTE))
    }

    /// Whether a commit `r` at or before `index` with a local time in `(time - 3 h, time + 3 h]`
    /// came more than a minute earlier than the commit before it (the T-SQL's `EXISTS`).
    fn dropped_before(
        &self,
        local: &impl Fn(u64) -> Result<i64>,
        index: u64,
        time: i64,
    ) -> Result<bool> {
        // Local times rise with LSNs except at a change, by at most its size: below this
        // no earlier commit can still be inside the window.
        let floor = time - SHIFT - self.largest_change();
        let mut r = index;
        let mut r_time = time;
        while r > 0 {
            let previous = local(r - 1)?;
            if r_time > time - SHIFT
                && r_time <= time + SHIFT
                && r_time < previous - MICROS_PER_MINUTE
            {
                return Ok(true);
            }
            if previous <= floor {
                break;
            }
            r -= 1;
            r_time = previous;
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zone at UTC-3 that falls back to UTC-4 at 05:00 UTC (02:00 local becomes 01:00).
    fn fall_back() -> SimZone {
        SimZone {
            name: "Test Standard Time".into(),
            initial_offset_minutes: -180,
            changes: vec![OffsetChange {
                at: CommitTime(5 * MICROS_PER_HOUR),
                offset_minutes: -240,
            }],
        }
    }

    #[test]
    fn local_times_repeat_an_hour_after_a_fall_back() {
        let zone = fall_back();
        let before = zone.local(CommitTime(5 * MICROS_PER_HOUR - MICROS_PER_MINUTE));
        let after = zone.local(CommitTime(5 * MICROS_PER_HOUR));
        assert_eq!(before.0, 2 * MICROS_PER_HOUR - MICROS_PER_MINUTE);
        assert_eq!(after.0, MICROS_PER_HOUR);
    }

    #[test]
    fn at_time_zone_takes_the_offset_before_the_change_in_the_repeated_hour() {
        let zone = fall_back();
        assert_eq!(
            zone.offset_of_local(MICROS_PER_HOUR + 30 * MICROS_PER_MINUTE),
            -180
        );
        assert_eq!(
            zone.offset_of_local(2 * MICROS_PER_HOUR + MICROS_PER_MINUTE),
            -240
        );
        assert_eq!(zone.offset_of_local(0), -180);
    }

    #[test]
    fn a_spring_forward_gap_takes_the_offset_before_it() {
        let zone = SimZone {
            name: "Test Standard Time".into(),
            initial_offset_minutes: -240,
            changes: vec![OffsetChange {
                at: CommitTime(6 * MICROS_PER_HOUR),
                offset_minutes: -180,
            }],
        };
        // 02:00 local jumps to 03:00: 02:30 does not exist and reads at -04:00.
        assert_eq!(
            zone.offset_of_local(2 * MICROS_PER_HOUR + 30 * MICROS_PER_MINUTE),
            -240
        );
        assert_eq!(
            zone.offset_of_local(3 * MICROS_PER_HOUR + 30 * MICROS_PER_MINUTE),
            -180
        );
    }
}
