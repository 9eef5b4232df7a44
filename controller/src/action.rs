//! What a reconcile asks for next: [`Action`], and the error trait [`ReconcileError`].

use std::time::Duration;

/// What the runtime should do with a key after a reconcile.
///
/// Reconcile returns data: the whole requeue policy is one `match` in the controller on
/// `Result<Action, E>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Action(pub(crate) Next);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    Requeue(Duration),
    AwaitChange,
    Backoff,
}

impl Action {
    /// Reconcile the object again after `after` (sooner if it changes). Waiting for something
    /// outside the store (a VM booting) is a bounded requeue, not an error.
    pub fn requeue(after: Duration) -> Action {
        Action(Next::Requeue(after))
    }

    /// Do nothing until the object (or something mapped to it) changes, or a resync.
    pub fn await_change() -> Action {
        Action(Next::AwaitChange)
    }

    /// Requeue after the key's next exponential-backoff delay (base 200 ms, ×2, capped at
    /// 60 s, ±25 % jitter by default). The default error policy returns this. Returned from a
    /// successful reconcile it is a growing poll that does not reset the key's backoff.
    pub fn backoff() -> Action {
        Action(Next::Backoff)
    }

    /// The fixed delay asked for, if this is [`Action::requeue`].
    pub fn requeue_after(&self) -> Option<Duration> {
        match self.0 {
            Next::Requeue(d) => Some(d),
            _ => None,
        }
    }

    /// Whether this is [`Action::await_change`].
    pub fn is_await_change(&self) -> bool {
        self.0 == Next::AwaitChange
    }

    /// Whether this is [`Action::backoff`].
    pub fn is_backoff(&self) -> bool {
        self.0 == Next::Backoff
    }
}

/// The error type a reconciler returns.
///
/// A terminal error (bad input that only a change to the object can fix) is never retried:
/// the key waits for the next change or resync. Everything else backs off and retries.
pub trait ReconcileError: std::error::Error + Send + Sync + 'static {
    /// Whether retrying cannot help until the object changes. Default: `false`.
    fn is_terminal(&self) -> bool {
        false
    }
}

impl ReconcileError for std::convert::Infallible {}
