//! The runner: drives a [`Scheduler`] from a channel of [`Request`]s and runs one job per ready
//! key, at most `concurrency` at once and never two for the same key.
//!
//! # Guarantees
//! - Requests already in the channel are all queued before anything is dispatched, so a burst
//!   of requests for one key becomes one run.
//! - At most one job per key is in flight; a key requested while in flight runs again after
//!   it finishes (once, however many requests came in).
//! - At most `concurrency` jobs are in flight.
//! - A job's output is its requeue: `Some(d)` schedules the key again after `d` (an earlier
//!   pending request still wins), `None` waits for the next request.
//! - On shutdown the in-flight jobs are aborted (dropped at their next `.await`).
//!
//! # Assumptions
//! - Jobs are idempotent and crash-safe, so dropping one half-way is as good as a crash.
//! - Jobs catch their own panics; a job that panics anyway is logged and not requeued.
//!
//! # Caveats
//! - The runner ends when shutdown is signalled, or when the channel is closed and no key is
//!   queued or in flight.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::scheduler::Scheduler;

/// A request to run a key's job at a deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The object name.
    pub key: String,
    /// When to run it at the earliest.
    pub at: Instant,
}

impl Request {
    /// Run `key` as soon as possible.
    pub fn now(key: impl Into<String>) -> Self {
        Request {
            key: key.into(),
            at: Instant::now(),
        }
    }

    /// Run `key` after `delay`.
    pub fn after(key: impl Into<String>, delay: Duration) -> Self {
        Request {
            key: key.into(),
            at: Instant::now() + delay,
        }
    }
}

/// Run jobs for the keys requested on `requests` until `shutdown` is cancelled (or the channel
/// closes and everything has run). `job(key)` returns the key's requeue delay, if any.
pub async fn run<F, Fut>(
    requests: mpsc::UnboundedReceiver<Request>,
    concurrency: usize,
    shutdown: CancellationToken,
    job: F,
) where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Option<Duration>> + Send + 'static,
{
    run_reporting(requests, concurrency, shutdown, job, |_| {}).await
}

/// How busy a runner is, as [`run_reporting`] reports it after each change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Keys whose time has come, waiting for a free slot.
    pub ready: usize,
    /// Jobs running.
    pub in_flight: usize,
}

/// [`run`], calling `report` with the runner's [`Load`] whenever it may have changed.
pub async fn run_reporting<F, Fut>(
    mut requests: mpsc::UnboundedReceiver<Request>,
    concurrency: usize,
    shutdown: CancellationToken,
    mut job: F,
    mut report: impl FnMut(Load),
) where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Option<Duration>> + Send + 'static,
{
    let concurrency = concurrency.max(1);
    let mut queue = Scheduler::new();
    let mut tasks: JoinSet<Option<Duration>> = JoinSet::new();
    let mut keys = HashMap::new();
    let mut open = true;
    loop {
        let now = Instant::now();
        while tasks.len() < concurrency {
            let Some(key) = queue.pop_ready(now) else {
                break;
            };
            let handle = tasks.spawn(job(key.clone()));
            keys.insert(handle.id(), key);
        }
        report(Load {
            ready: queue.ready(now),
            in_flight: tasks.len(),
        });
        if !open && tasks.is_empty() && queue.queued() == 0 {
            break;
        }
        let wake = if tasks.len() < concurrency {
            queue.next_deadline()
        } else {
            None
        };
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            req = requests.recv(), if open => match req {
                Some(r) => {
                    queue.schedule(&r.key, r.at);
                    while let Ok(r) = requests.try_recv() {
                        queue.schedule(&r.key, r.at);
                    }
                }
                None => open = false,
            },
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let (id, requeue) = match done {
                    Ok((id, requeue)) => (id, requeue),
                    Err(e) => {
                        tracing::error!(error = %e, "a reconcile task failed");
                        (e.id(), None)
                    }
                };
                if let Some(key) = keys.remove(&id) {
                    queue.finish(&key);
                    if let Some(d) = requeue {
                        queue.schedule(&key, Instant::now() + d);
                    }
                }
            }
            _ = sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    report(Load {
        ready: 0,
        in_flight: 0,
    });
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn start() -> (
        mpsc::UnboundedSender<Request>,
        mpsc::UnboundedReceiver<Request>,
    ) {
        mpsc::unbounded_channel()
    }

    #[tokio::test(start_paused = true)]
    async fn ten_requests_of_one_key_run_once() {
        let (tx, rx) = start();
        for _ in 0..10 {
            tx.send(Request::now("a")).unwrap();
        }
        drop(tx);
        let runs = Arc::new(Mutex::new(Vec::new()));
        let r = runs.clone();
        run(rx, 4, CancellationToken::new(), move |k| {
            r.lock().unwrap().push(k);
            async { None }
        })
        .await;
        assert_eq!(*runs.lock().unwrap(), ["a"]);
    }

    #[tokio::test(start_paused = true)]
    async fn earliest_deadline_wins() {
        let (tx, rx) = start();
        let t0 = Instant::now();
        tx.send(Request::after("a", Duration::from_secs(10)))
            .unwrap();
        tx.send(Request::after("a", Duration::from_secs(1)))
            .unwrap();
        tx.send(Request::after("a", Duration::from_secs(5)))
            .unwrap();
        drop(tx);
        let runs = Arc::new(Mutex::new(Vec::new()));
        let r = runs.clone();
        run(rx, 1, CancellationToken::new(), move |_| {
            r.lock().unwrap().push(t0.elapsed());
            async { None }
        })
        .await;
        assert_eq!(*runs.lock().unwrap(), [Duration::from_secs(1)]);
    }

    #[tokio::test(start_paused = true)]
    async fn requeue_after_runs_again_at_the_delay() {
        let (tx, rx) = start();
        tx.send(Request::now("a")).unwrap();
        drop(tx);
        let t0 = Instant::now();
        let runs = Arc::new(Mutex::new(Vec::new()));
        let r = runs.clone();
        run(rx, 1, CancellationToken::new(), move |_| {
            let mut r = r.lock().unwrap();
            r.push(t0.elapsed().as_secs());
            let again = (r.len() < 4).then_some(Duration::from_secs(5));
            async move { again }
        })
        .await;
        assert_eq!(*runs.lock().unwrap(), [0, 5, 10, 15]);
    }

    #[derive(Default)]
    struct Tally {
        now: HashMap<String, usize>,
        max_per_key: usize,
        global: usize,
        max_global: usize,
        runs: HashMap<String, usize>,
    }

    #[tokio::test(start_paused = true)]
    async fn one_in_flight_per_key_and_a_global_limit() {
        let (tx, rx) = start();
        for k in ["a", "b", "c", "d", "e"] {
            tx.send(Request::now(k)).unwrap();
        }
        let tally = Arc::new(Mutex::new(Tally::default()));
        let shutdown = CancellationToken::new();
        let t = tally.clone();
        let job = move |key: String| {
            let t = t.clone();
            let tx = tx.clone();
            async move {
                {
                    let mut t = t.lock().unwrap();
                    let n = t.now.entry(key.clone()).or_default();
                    *n += 1;
                    let n = *n;
                    t.max_per_key = t.max_per_key.max(n);
                    t.global += 1;
                    t.max_global = t.max_global.max(t.global);
                    *t.runs.entry(key.clone()).or_default() += 1;
                    // Requests for a key while it is in flight: many of them, one more run.
                    if key == "a" && t.runs["a"] == 1 {
                        for _ in 0..5 {
                            tx.send(Request::now("a")).unwrap();
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut t = t.lock().unwrap();
                *t.now.get_mut(&key).unwrap() -= 1;
                t.global -= 1;
                None
            }
        };
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            stop.cancel();
        });
        run(rx, 2, shutdown, job).await;
        let t = tally.lock().unwrap();
        assert_eq!(t.max_per_key, 1);
        assert_eq!(t.max_global, 2);
        assert_eq!(t.runs["a"], 2);
        for k in ["b", "c", "d", "e"] {
            assert_eq!(t.runs[k], 1, "{k}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_drops_jobs_in_flight() {
        let (tx, rx) = start();
        tx.send(Request::now("a")).unwrap();
        let finished = Arc::new(Mutex::new(false));
        let f = finished.clone();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.cancel();
        });
        run(rx, 1, shutdown, move |_| {
            let f = f.clone();
            async move {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                *f.lock().unwrap() = true;
                None
            }
        })
        .await;
        assert!(!*finished.lock().unwrap());
        drop(tx);
    }
}
