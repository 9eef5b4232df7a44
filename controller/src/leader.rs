//! Leader election: one active controller set per store.
//!
//! ```ignore
//! let elector = LeaderElector::new(store.clone(), "controllers", this_process(), Duration::from_secs(15));
//! let leader = elector.acquire().await?;         // stands by until it leads
//! run_controllers(leader.token()).await;         // the token is cancelled if leadership is lost
//! if leader.is_lost() { std::process::exit(1) }  // never act on a lost lease
//! ```
//!
//! # Guarantees
//! - [`LeaderElector::acquire`] returns only once the store granted this candidate the lock;
//!   it asks every `ttl / 3` (sooner when the holder's lease is about to expire), so a
//!   standby takes over within `ttl + ttl / 3` of the holder's last renewal, or at once when
//!   the holder resigned or its process on this host is gone.
//! - While leading, the lock is renewed every `ttl / 3`, on a thread of its own with its own
//!   single-threaded tokio runtime, so busy async workers (a backend's slow blocking calls)
//!   cannot let it lapse. The [`Leader::token`] is cancelled
//!   (and [`Leader::is_lost`] turns true) when a renewal finds another holder or a new epoch,
//!   or when renewals have failed for `2 × ttl / 3` — before the lease can expire and another
//!   candidate can take it.
//! - [`Leader::resign`] releases the lock so a standby takes over without waiting for expiry.
//!   Dropping a [`Leader`] stops renewing (the lease then expires) and cancels its token.
//!
//! # Assumptions
//! - Hosts sharing a store have clocks that agree to well within `ttl / 3` (the store compares
//!   wall clocks); in practice the store is on one host.
//! - Whoever holds the token stops acting promptly when it is cancelled (controllers drop
//!   their in-flight reconciles).
//!
//! # Caveats
//! - Leadership is a lease, not a lock held by the kernel: a process paused for longer than
//!   `ttl` (SIGSTOP, a suspended laptop) may act once after waking before its renewal notices.
//!   Reconcilers keep such a late step safe with resourceVersion preconditions.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub use boxery_store::Candidate;
use boxery_store::{Leadership, ObjectStore, StoreError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A leader-election call failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Asking the store for the lock failed.
    #[error("cannot ask the store for the leader lock {lock}")]
    Acquire {
        /// The lock's name.
        lock: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// Giving up the lock failed (it will expire after its ttl).
    #[error("cannot resign the leader lock {lock}")]
    Resign {
        /// The lock's name.
        lock: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// A store call could not run (the blocking task was cancelled or panicked).
    #[error("the leader-election call on lock {lock} did not finish")]
    Task {
        /// The lock's name.
        lock: String,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// This process as a candidate: a fresh uuid, its pid, and the host's boot id (so the store
/// can tell that a holder on this host has died).
pub fn this_process() -> Candidate {
    Candidate {
        id: uuid::Uuid::new_v4().to_string(),
        pid: std::process::id(),
        boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    }
}

/// Competes for one leader lock in the store.
#[derive(Debug, Clone)]
pub struct LeaderElector {
    store: Arc<dyn ObjectStore>,
    lock: String,
    candidate: Candidate,
    ttl: Duration,
}

impl LeaderElector {
    /// An elector for `lock` as `candidate` (usually [`this_process`]), with leases of `ttl`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        lock: impl Into<String>,
        candidate: Candidate,
        ttl: Duration,
    ) -> Self {
        LeaderElector {
            store,
            lock: lock.into(),
            candidate,
            ttl: ttl.max(Duration::from_millis(30)),
        }
    }

    /// Who this elector competes as.
    pub fn candidate(&self) -> &Candidate {
        &self.candidate
    }

    /// The lease length.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn try_lead(&self) -> Result<Leadership, LeaderError> {
        self.store
            .try_lead(&self.lock, &self.candidate, self.ttl)
            .await
            .map_err(|source| LeaderError::Acquire {
                lock: self.lock.clone(),
                source: Box::new(source),
            })
    }

    /// Wait until this candidate leads, then keep renewing in the background. Store errors
    /// while waiting are logged and retried; one that persists for a whole `ttl` is returned.
    /// Cancel-safe: dropping the future gives up.
    pub async fn acquire(&self) -> Result<Leader, LeaderError> {
        let period = self.ttl / 3;
        let mut announced = false;
        let mut failing_since: Option<Instant> = None;
        loop {
            let wait = match self.try_lead().await {
                Ok(Leadership::Leader { epoch }) => {
                    tracing::info!(lock = self.lock, id = self.candidate.id, epoch, "leading");
                    return Ok(self.lead(epoch));
                }
                Ok(Leadership::Follower { holder, expires_in }) => {
                    failing_since = None;
                    if !announced {
                        tracing::info!(
                            lock = self.lock,
                            holder,
                            ?expires_in,
                            "standing by: another process leads"
                        );
                        announced = true;
                    }
                    period.min(expires_in + Duration::from_millis(10))
                }
                Err(e) => {
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.ttl {
                        return Err(e);
                    }
                    tracing::warn!(
                        lock = self.lock,
                        error = %crate::controller::error_chain(&e),
                        "cannot ask for the leader lock; retrying"
                    );
                    period
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    fn lead(&self, epoch: u64) -> Leader {
        let token = CancellationToken::new();
        let lost = Arc::new(AtomicBool::new(false));
        let me = self.clone();
        let (t, l) = (token.clone(), lost.clone());
        // Renewals run on a thread of their own, with a runtime of their own: a runtime whose
        // workers are all busy (a backend making slow blocking calls) must not let the lease
        // lapse while this process is alive and well.
        let renewal = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|rt| {
                std::thread::Builder::new()
                    .name(format!("lease-{}", self.lock))
                    .spawn(move || renew(&rt, &me, epoch, &t, &l))
            })
            .map(Some)
            .unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot start the lease renewal thread");
                lost.store(true, Ordering::SeqCst);
                token.cancel();
                None
            });
        Leader {
            elector: self.clone(),
            epoch,
            token,
            lost,
            renewal,
        }
    }
}

/// Renew `epoch` of the lock every `ttl / 3` until `token` is cancelled; when leadership is
/// lost, mark `lost` and cancel `token`.
fn renew(
    rt: &tokio::runtime::Runtime,
    me: &LeaderElector,
    epoch: u64,
    token: &CancellationToken,
    lost: &AtomicBool,
) {
    let period = me.ttl / 3;
    let give_up = me.ttl * 2 / 3;
    let mut last_ok = std::time::Instant::now();
    let mut wait = period;
    loop {
        // Sleep in short steps so a resignation is not held up.
        let until = std::time::Instant::now() + wait;
        while std::time::Instant::now() < until {
            if token.is_cancelled() {
                return;
            }
            std::thread::sleep(
                until
                    .saturating_duration_since(std::time::Instant::now())
                    .min(RENEWAL_STEP),
            );
        }
        if token.is_cancelled() {
            return;
        }
        match rt.block_on(me.store.try_lead(&me.lock, &me.candidate, me.ttl)) {
            Ok(Leadership::Leader { epoch: e }) if e == epoch => {
                last_ok = std::time::Instant::now();
                wait = period;
            }
            Ok(Leadership::Leader { epoch: e }) => {
                tracing::error!(
                    lock = me.lock,
                    epoch,
                    new_epoch = e,
                    "leadership was lost in between: stopping"
                );
                break;
            }
            Ok(Leadership::Follower { holder, .. }) => {
                tracing::error!(
                    lock = me.lock,
                    holder,
                    "leadership was lost to another process: stopping"
                );
                break;
            }
            Err(error) => {
                if last_ok.elapsed() + period / 3 >= give_up {
                    tracing::error!(
                        lock = me.lock,
                        error = %crate::controller::error_chain(&error),
                        "cannot renew leadership in time: stopping"
                    );
                    break;
                }
                tracing::warn!(
                    lock = me.lock,
                    error = %crate::controller::error_chain(&error),
                    "renewing leadership failed; retrying"
                );
                wait = period / 3;
            }
        }
    }
    lost.store(true, Ordering::SeqCst);
    token.cancel();
}

/// How often a sleeping renewal thread looks for a resignation.
const RENEWAL_STEP: Duration = Duration::from_millis(20);

/// Another name for [`Leader`].
pub type Leading = Leader;

/// Leadership held. Renewed in the background until resigned, dropped or lost.
#[derive(Debug)]
pub struct Leader {
    elector: LeaderElector,
    epoch: u64,
    token: CancellationToken,
    lost: Arc<AtomicBool>,
    renewal: Option<std::thread::JoinHandle<()>>,
}

impl Leader {
    /// The lock's epoch: it grows with every change of holder (a fencing number).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Who leads.
    pub fn candidate(&self) -> &Candidate {
        &self.elector.candidate
    }

    /// A token cancelled when leadership ends (lost, resigned or dropped): run the
    /// controllers on it (or on a child of it). Cancelling it yourself stops the renewals too
    /// (the lease then expires).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Whether leadership was lost (rather than given up).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Wait until leadership is lost (or the token is cancelled).
    pub async fn lost(&self) {
        self.token.cancelled().await;
    }

    /// Stop renewing and release the lock, so a standby takes over at once.
    pub async fn resign(mut self) -> Result<(), LeaderError> {
        self.token.cancel();
        let renewal = self.renewal.take();
        let e = self.elector.clone();
        let lock = e.lock.clone();
        // The renewal thread ends first: a renewal after the resignation would take the
        // lock again.
        if let Some(r) = renewal {
            tokio::task::spawn_blocking(move || r.join())
                .await
                .map_err(|source| LeaderError::Task {
                    lock: lock.clone(),
                    source,
                })?
                .ok();
        }
        e.store
            .resign(&e.lock, &e.candidate)
            .await
            .map_err(|source| LeaderError::Resign {
                lock,
                source: Box::new(source),
            })
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        // The renewal thread sees this within RENEWAL_STEP (or after a renewal in flight).
        self.token.cancel();
    }
}
