//! The backoff of kinds that record their failures in status, so it holds across restarts and
//! across the status writes that record a failure (each of which is a change that wakes the
//! controller at once). It is the controller's [`Backoff`] policy (the one the runtime applies
//! in memory to everything else), without jitter, counted from `status.failures`.
//!
//! After `failures` consecutive failures, the next try waits `200 ms × 2^(failures−1)`, at most
//! 60 s. A changed spec (generation ahead of the observed one) or a deletion requested after
//! the failure skips the wait: the user asked for something new.

use std::time::Duration;

use boxery_api::Time;
use boxery_api::vm::Failure;
use boxery_controller::Backoff;

/// The policy: the controller's default, without jitter (the wait is computed again from
/// status on every wake-up, so it must come out the same each time).
const POLICY: Backoff = Backoff {
    base: Duration::from_millis(200),
    factor: 2.0,
    max: Duration::from_secs(60),
    jitter: 0.0,
};

/// The first retry's delay.
pub const BASE: Duration = POLICY.base;
/// The longest delay.
pub const MAX: Duration = POLICY.max;

/// The delay after `failures` consecutive failures.
pub fn delay(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    POLICY.nominal(failures - 1)
}

/// How long to wait before trying again, or `None` to go ahead now.
pub fn remaining(
    failures: u32,
    last: Option<&Failure>,
    observed: Option<i64>,
    generation: Option<i64>,
    deletion: Option<Time>,
) -> Option<Duration> {
    let last = last?;
    if failures == 0 || observed != generation || deletion.is_some_and(|d| d > last.at) {
        return None;
    }
    // A request that cannot succeed as asked is tried again only after the longest delay (the
    // host may have changed), or at once when the spec changes.
    let wait = if last.terminal { MAX } else { delay(failures) };
    let until = last.at + chrono::Duration::from_std(wait).ok()?;
    let left = until - boxery_api::now();
    left.to_std().ok().filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_caps() {
        assert_eq!(delay(1), Duration::from_millis(200));
        assert_eq!(delay(3), Duration::from_millis(800));
        assert_eq!(delay(40), MAX);
    }

    #[test]
    fn is_the_controllers_policy() {
        let runtime = Backoff::default();
        assert_eq!(
            (POLICY.base, POLICY.factor, POLICY.max),
            (runtime.base, runtime.factor, runtime.max)
        );
    }

    #[test]
    fn skipped_on_change() {
        let f = Failure {
            step: "create".into(),
            message: "x".into(),
            at: boxery_api::now(),
            terminal: false,
        };
        assert!(remaining(3, Some(&f), Some(1), Some(1), None).is_some());
        assert!(
            remaining(3, Some(&f), Some(1), Some(2), None).is_none(),
            "a new spec retries at once"
        );
        assert!(remaining(0, Some(&f), Some(1), Some(1), None).is_none());
    }
}
