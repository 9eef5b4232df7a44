//! Exponential backoff with jitter, for failed reconciles and failed watches.
//!
//! # Guarantees
//! - `delay(n)` is `base × factor^n`, capped at `max`, then moved by a uniform jitter of
//!   ±`jitter` (a fraction) and capped at `max` again: never more than `max`, never less than
//!   `base × (1 − jitter)`.
//!
//! # Caveats
//! - The attempt count is kept by the caller (per key in the controller); this type is only
//!   the policy.

use std::time::Duration;

use rand::RngExt;

/// An exponential backoff policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The first delay.
    pub base: Duration,
    /// The growth per attempt.
    pub factor: f64,
    /// The largest delay.
    pub max: Duration,
    /// The jitter, a fraction of the delay (0.25 = ±25 %).
    pub jitter: f64,
}

impl Default for Backoff {
    /// 200 ms, ×2, at most 60 s, ±25 %.
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(200),
            factor: 2.0,
            max: Duration::from_secs(60),
            jitter: 0.25,
        }
    }
}

impl Backoff {
    /// The delay before retry number `attempt` (0 for the first retry), without jitter.
    pub fn nominal(&self, attempt: u32) -> Duration {
        let exp = self.factor.max(1.0).powi(attempt.min(64) as i32);
        let secs = (self.base.as_secs_f64() * exp).min(self.max.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }

    /// The delay before retry number `attempt`, with jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        let nominal = self.nominal(attempt).as_secs_f64();
        let j = self.jitter.clamp(0.0, 1.0);
        let u = if j > 0.0 {
            rand::rng().random_range(-j..=j)
        } else {
            0.0
        };
        Duration::from_secs_f64((nominal * (1.0 + u)).min(self.max.as_secs_f64()).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_caps_and_jitters_within_bounds() {
        let b = Backoff::default();
        assert_eq!(b.nominal(0), Duration::from_millis(200));
        assert_eq!(b.nominal(1), Duration::from_millis(400));
        assert_eq!(b.nominal(3), Duration::from_millis(1600));
        assert_eq!(b.nominal(20), Duration::from_secs(60));
        assert_eq!(b.nominal(u32::MAX), Duration::from_secs(60));
        for attempt in 0..12 {
            for _ in 0..50 {
                let d = b.delay(attempt).as_secs_f64();
                let n = b.nominal(attempt).as_secs_f64();
                assert!(
                    d >= n * 0.75 - 1e-9 && d <= (n * 1.25).min(60.0) + 1e-9,
                    "{attempt}: {d} vs {n}"
                );
            }
        }
    }

    #[test]
    fn no_jitter_is_exact() {
        let b = Backoff {
            jitter: 0.0,
            ..Backoff::default()
        };
        assert_eq!(b.delay(2), Duration::from_millis(800));
    }
}
