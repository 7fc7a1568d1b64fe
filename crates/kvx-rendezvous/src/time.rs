//! The crate's notion of time: a point on the driver's clock, in nanoseconds since an epoch the
//! driver chooses. The crate never reads a clock; every operation that needs the time takes it
//! as an argument, so tests drive a virtual clock.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time: nanoseconds since the driver's epoch (for example the moment the driver
/// started, measured with `std::time::Instant`).
///
/// Arithmetic saturates: adding a huge lease to a late timestamp gives [`Timestamp::MAX`]
/// ("never"), and subtracting a later timestamp gives [`Duration::ZERO`].
///
/// ```
/// use std::time::Duration;
/// use kvx_rendezvous::Timestamp;
///
/// let t = Timestamp::from_millis(1_500);
/// assert_eq!(t + Duration::from_millis(500), Timestamp::from_secs(2));
/// assert_eq!(Timestamp::from_secs(2) - t, Duration::from_millis(500));
/// assert_eq!(t - Timestamp::from_secs(2), Duration::ZERO);
/// assert_eq!(Timestamp::MAX + Duration::from_secs(1), Timestamp::MAX);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The driver's epoch.
    pub const ZERO: Self = Self(0);
    /// The far future; a deadline that never arrives.
    pub const MAX: Self = Self(u64::MAX);

    /// A timestamp `nanos` nanoseconds after the epoch.
    #[must_use]
    pub const fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }

    /// A timestamp `millis` milliseconds after the epoch (saturating).
    #[must_use]
    pub const fn from_millis(millis: u64) -> Self {
        Self(millis.saturating_mul(1_000_000))
    }

    /// A timestamp `secs` seconds after the epoch (saturating).
    #[must_use]
    pub const fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(1_000_000_000))
    }

    /// Nanoseconds since the epoch.
    #[must_use]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Self {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(nanos))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    #[must_use]
    pub const fn saturating_duration_since(self, earlier: Self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Self;

    fn add(self, rhs: Duration) -> Self {
        self.saturating_add(rhs)
    }
}

impl Sub for Timestamp {
    type Output = Duration;

    fn sub(self, rhs: Self) -> Duration {
        self.saturating_duration_since(rhs)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::MAX {
            return f.write_str("never");
        }
        let secs = self.0 / 1_000_000_000;
        let nanos = self.0 % 1_000_000_000;
        write!(f, "{secs}.{nanos:09}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturating_arithmetic() {
        let near_end = Timestamp::from_nanos(u64::MAX - 5);
        assert_eq!(near_end + Duration::from_nanos(10), Timestamp::MAX);
        assert_eq!(
            Timestamp::ZERO + Duration::from_secs(u64::MAX),
            Timestamp::MAX
        );
        assert_eq!(Timestamp::from_secs(u64::MAX), Timestamp::MAX);
        assert_eq!(
            Timestamp::from_millis(3).saturating_duration_since(Timestamp::from_millis(1)),
            Duration::from_millis(2)
        );
    }

    #[test]
    fn display() {
        assert_eq!(Timestamp::from_millis(1_500).to_string(), "1.500000000s");
        assert_eq!(Timestamp::MAX.to_string(), "never");
    }
}
