//! The work queue: object keys with deadlines, deduplicated, earliest deadline wins, and at
//! most one key in flight at a time. Pure data, no tasks or clocks: the [`runner`](crate::runner)
//! drives it.
//!
//! # Guarantees
//! - A key is queued at most once: scheduling a queued key keeps the earlier deadline.
//! - A key that is in flight is never handed out again until [`Scheduler::finish`]; a key
//!   scheduled while in flight stays queued and is handed out after it finishes.
//! - Keys are handed out in deadline order (ties by key).
//!
//! # Assumptions
//! - Deadlines are [`tokio::time::Instant`]s, so tests can pause and advance time.

use std::collections::{BTreeSet, HashMap, HashSet};

use tokio::time::Instant;

/// Keys waiting for a deadline, and the keys in flight.
#[derive(Debug, Default)]
pub struct Scheduler {
    deadlines: HashMap<String, Instant>,
    order: BTreeSet<(Instant, String)>,
    in_flight: HashSet<String>,
}

impl Scheduler {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queue `key` to run at `at`; if it is already queued, the earlier deadline wins. Returns
    /// whether the queue changed.
    pub fn schedule(&mut self, key: &str, at: Instant) -> bool {
        if let Some(old) = self.deadlines.get(key) {
            if *old <= at {
                return false;
            }
            self.order.remove(&(*old, key.to_string()));
        }
        self.deadlines.insert(key.to_string(), at);
        self.order.insert((at, key.to_string()));
        true
    }

    /// The key with the earliest deadline at or before `now` that is not in flight; it leaves
    /// the queue and is marked in flight.
    pub fn pop_ready(&mut self, now: Instant) -> Option<String> {
        let found = self
            .order
            .iter()
            .take_while(|(at, _)| *at <= now)
            .find(|(_, key)| !self.in_flight.contains(key))
            .cloned()?;
        self.order.remove(&found);
        self.deadlines.remove(&found.1);
        self.in_flight.insert(found.1.clone());
        Some(found.1)
    }

    /// The earliest deadline of a queued key that is not in flight.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.order
            .iter()
            .find(|(_, key)| !self.in_flight.contains(key))
            .map(|(at, _)| *at)
    }

    /// Mark `key` as no longer in flight.
    pub fn finish(&mut self, key: &str) {
        self.in_flight.remove(key);
    }

    /// The deadline of a queued key.
    pub fn deadline(&self, key: &str) -> Option<Instant> {
        self.deadlines.get(key).copied()
    }

    /// Whether `key` is in flight.
    pub fn is_in_flight(&self, key: &str) -> bool {
        self.in_flight.contains(key)
    }

    /// How many keys are in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// How many queued keys' time has come at `now` and are not in flight: waiting for a
    /// free slot (a runner's backlog).
    pub fn ready(&self, now: Instant) -> usize {
        self.order
            .iter()
            .take_while(|(at, _)| *at <= now)
            .filter(|(_, key)| !self.in_flight.contains(key))
            .count()
    }

    /// How many keys are queued (in flight or not).
    pub fn queued(&self) -> usize {
        self.order.len()
    }

    /// Whether nothing is queued and nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.order.is_empty() && self.in_flight.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn dedups_and_earliest_deadline_wins() {
        let mut s = Scheduler::new();
        let t0 = Instant::now();
        assert!(s.schedule("a", t0 + Duration::from_secs(10)));
        assert!(s.schedule("a", t0 + Duration::from_secs(1)));
        assert!(!s.schedule("a", t0 + Duration::from_secs(5)));
        assert_eq!(s.queued(), 1);
        assert_eq!(s.deadline("a"), Some(t0 + Duration::from_secs(1)));
        assert_eq!(s.pop_ready(t0), None);
        assert_eq!(
            s.pop_ready(t0 + Duration::from_secs(1)).as_deref(),
            Some("a")
        );
        assert_eq!(s.pop_ready(t0 + Duration::from_secs(100)), None);
    }

    #[test]
    fn in_flight_keys_wait_and_others_pass() {
        let mut s = Scheduler::new();
        let t0 = Instant::now();
        s.schedule("a", t0);
        assert_eq!(s.pop_ready(t0).as_deref(), Some("a"));
        s.schedule("a", t0);
        s.schedule("b", t0 + Duration::from_millis(1));
        let later = t0 + Duration::from_secs(1);
        assert_eq!(s.next_deadline(), Some(t0 + Duration::from_millis(1)));
        assert_eq!(s.pop_ready(later).as_deref(), Some("b"));
        assert_eq!(s.pop_ready(later), None, "a is in flight");
        assert_eq!(s.next_deadline(), None);
        s.finish("a");
        assert_eq!(s.next_deadline(), Some(t0));
        assert_eq!(s.pop_ready(later).as_deref(), Some("a"));
        s.finish("a");
        s.finish("b");
        assert!(s.is_idle());
    }

    #[test]
    fn ready_keys_come_out_in_deadline_order() {
        let mut s = Scheduler::new();
        let t0 = Instant::now();
        for (i, k) in ["c", "a", "b"].iter().enumerate() {
            s.schedule(k, t0 + Duration::from_millis(10 - i as u64));
        }
        let now = t0 + Duration::from_secs(1);
        let order: Vec<_> = std::iter::from_fn(|| s.pop_ready(now)).collect();
        assert_eq!(order, ["b", "a", "c"]);
    }
}
