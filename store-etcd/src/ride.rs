//! Riding out etcd's short unavailability: a member lost, a leader elected again (a second or
//! two with etcd's default timings). A call that meets it tries again for up to [`RIDE_OUT`]
//! before it fails, so users see no error while one member of three is down. Only
//! `StoreError::Unavailable` is tried again: the errors that say the cluster did not answer,
//! never a refusal.

use std::future::Future;
use std::time::{Duration, Instant};

use boxery_store::{Result, StoreError};

/// How long a call keeps trying while etcd is unavailable.
pub(crate) const RIDE_OUT: Duration = Duration::from_secs(10);

/// The first pause between tries; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_millis(800);

/// Whether `e` says etcd did not answer (worth another try).
pub(crate) fn transient(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { .. })
}

/// `f` until it answers, or is refused, or [`RIDE_OUT`] has passed.
pub(crate) async fn retry<T, F: Future<Output = Result<T>>>(mut f: impl FnMut() -> F) -> Result<T> {
    let started = Instant::now();
    let mut pause = FIRST_PAUSE;
    loop {
        match f().await {
            Err(e) if transient(&e) && started.elapsed() < RIDE_OUT => {
                tracing::debug!(error = %e, "etcd unavailable; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            r => return r,
        }
    }
}

/// [`retry`] on a thread that may block.
pub(crate) fn retry_blocking<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    let mut pause = FIRST_PAUSE;
    loop {
        match f() {
            Err(e) if transient(&e) && started.elapsed() < RIDE_OUT => {
                tracing::debug!(error = %e, "etcd unavailable; trying again");
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_PAUSE);
            }
            r => return r,
        }
    }
}
