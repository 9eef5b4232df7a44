//! The controller: one kind's reflector, the watches that map other kinds' changes to its
//! keys, periodic resync, and the runner that calls `reconcile` with the requeue and backoff
//! policy.
//!
//! ```ignore
//! Controller::<Vm>::new(store.clone())
//!     .owns::<Image>()
//!     .watches::<Lease>(|lease| vec![lease_vm_name(lease)])
//!     .resync_every(Duration::from_secs(300))
//!     .run(reconcile, default_error_policy, ctx, shutdown)
//!     .await;
//! ```
//!
//! # Guarantees
//! - Level-based: the queue holds names only, and every reconcile gets the object from the
//!   controller's cache as it is when the reconcile starts. A key whose object is gone is
//!   dropped without calling `reconcile` (cleanup belongs behind a finalizer).
//! - A reconcile sees the writes of the reconciles before it, when they write through a
//!   [`WriteThrough`](crate::WriteThrough) store this controller's [`Controller::cache`] is
//!   registered with: the cache holds a written object before the write returns.
//! - Never two reconciles of one object at once; at most `concurrency` at once overall.
//! - Every object is reconciled once at start (the first list), after each change to it, after
//!   each mapped change of a watched kind, and on every resync.
//! - The requeue policy is one `match`:
//!   - `Ok(Action::requeue(d))`: again after `d`; the key's backoff resets.
//!   - `Ok(Action::await_change())`: again on the next change or resync; backoff resets.
//!   - `Ok(Action::backoff())`: again after the key's next backoff delay (a growing poll).
//!   - `Err(e)` with `e.is_terminal()`: `error_policy` is called (to record it), then the key
//!     is not reconciled again until the object's resourceVersion changes — not by resync,
//!     not by mapped changes.
//!   - `Err(e)` otherwise: whatever `error_policy` returns; [`default_error_policy`] returns
//!     [`Action::backoff`]: base 200 ms, ×2 per failure, capped at 60 s, ±25 % jitter.
//!   - A panic in `reconcile` is logged and treated as a retryable error (backoff).
//! - On shutdown, reconciles in flight are dropped and the future returns.
//!
//! # Assumptions
//! - Writes of other processes reach the cache with the watch latency; reconcilers write with
//!   a resourceVersion precondition, so a step taken on a stale copy fails with `Conflict`
//!   and is retried on the fresh one.
//! - Reconcilers are idempotent and crash-safe (they record in-flight operations in status
//!   before side effects), so a dropped reconcile is as good as a crash.
//! - A change of the object during a reconcile re-queues it; the reconcile that follows sees
//!   the change. Writes by the reconcile itself therefore trigger one more reconcile, which
//!   should find nothing to do.
//!
//! # Caveats
//! - A requeue deadline is a lower bound under load: keys wait for a free slot.
//! - Backoff and terminal state are per key and in memory: a restart reconciles everything.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use boxery_api::{DynObject, Resource};
use boxery_metrics::{KindLabel, METRICS, ReconcileLabels, Timer};
use boxery_store::ObjectStore;
use futures::FutureExt;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::action::{Action, Next, ReconcileError};
use crate::backoff::Backoff;
use crate::reflector::{Cache, Change, reflect};
use crate::runner::{self, Request};

/// Maps a changed object of a watched kind to names of the controller's kind.
pub type Mapper = Arc<dyn Fn(&DynObject) -> Vec<String> + Send + Sync>;

/// The error policy every controller can start from: terminal errors wait for a change,
/// everything else backs off exponentially.
pub fn default_error_policy<R, E: ReconcileError, Ctx>(
    _obj: Arc<R>,
    error: &E,
    _ctx: Arc<Ctx>,
) -> Action {
    if error.is_terminal() {
        Action::await_change()
    } else {
        Action::backoff()
    }
}

pub use boxery_api::error_chain;

/// A handle that enqueues keys into a controller from outside (a timer, a backend event).
#[derive(Debug, Clone)]
pub struct Trigger {
    tx: mpsc::UnboundedSender<Request>,
}

impl Trigger {
    /// Reconcile `name` as soon as possible. Ignored once the controller has stopped.
    pub fn enqueue(&self, name: &str) {
        let _ = self.tx.send(Request::now(name));
    }

    /// Reconcile `name` after `delay` (an earlier pending request still wins).
    pub fn enqueue_after(&self, name: &str, delay: Duration) {
        let _ = self.tx.send(Request::after(name, delay));
    }
}

struct Watch {
    kind: String,
    mapper: Mapper,
    cache: Option<Cache>,
}

/// One metadata-only watch of a kind shared by several controllers: one cache and one watch
/// stream however many controllers map its changes (each controller's own
/// [`Controller::watches_metadata`] keeps a cache and a stream of its own). Each subscriber's
/// mapper sees the object before and after every change, as with `watches_metadata`, and the
/// names it returns are queued on its controller ([`Controller::trigger`]). Run it with
/// [`SharedWatch::run`] beside the controllers.
pub struct SharedWatch {
    cache: Cache,
    subscribers: Vec<(Trigger, Mapper)>,
}

impl SharedWatch {
    /// A shared metadata-only watch of kind `O`.
    pub fn metadata<O: Resource>() -> Self {
        SharedWatch {
            cache: Cache::metadata_only(O::INFO.kind),
            subscribers: Vec::new(),
        }
    }

    /// Queue on `controller` the names `mapper` returns for each change.
    pub fn subscribe(
        mut self,
        controller: Trigger,
        mapper: impl Fn(&DynObject) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.subscribers.push((controller, Arc::new(mapper)));
        self
    }

    /// Reflect the kind and fan its changes out until `shutdown` is cancelled (or every
    /// subscriber's controller has stopped).
    pub fn run(
        self,
        store: Arc<dyn ObjectStore>,
        shutdown: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static {
        let SharedWatch { cache, subscribers } = self;
        async move {
            let backoff = Backoff {
                max: Duration::from_secs(30),
                ..Backoff::default()
            };
            let (changes_tx, mut changes) = mpsc::unbounded_channel::<Change>();
            let fan_out = async move {
                while let Some(change) = changes.recv().await {
                    let mut live = false;
                    for (trigger, mapper) in &subscribers {
                        let mut keys = BTreeSet::new();
                        for o in change.old.iter().chain(change.new.iter()) {
                            keys.extend(mapper(o));
                        }
                        for key in keys {
                            let _ = trigger.tx.send(Request::now(key));
                        }
                        live |= !trigger.tx.is_closed();
                    }
                    if !live {
                        return;
                    }
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = reflect(store, cache, changes_tx, backoff) => {}
                () = fan_out => {}
            }
        }
    }
}

/// A controller for objects of kind `R`. Build it, then [`Controller::run`] it.
pub struct Controller<R: Resource> {
    store: Arc<dyn ObjectStore>,
    cache: Cache,
    watches: Vec<Watch>,
    resync: Option<Duration>,
    concurrency: usize,
    backoff: Backoff,
    tx: mpsc::UnboundedSender<Request>,
    rx: mpsc::UnboundedReceiver<Request>,
    _kind: PhantomData<fn() -> R>,
}

impl<R: Resource> Controller<R> {
    /// A controller for `R` objects in `store`: concurrency 4, default backoff, no resync.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Controller {
            store,
            cache: Cache::new(R::INFO.kind),
            watches: Vec::new(),
            resync: None,
            concurrency: 4,
            backoff: Backoff::default(),
            tx,
            rx,
            _kind: PhantomData,
        }
    }

    /// Reconcile the owner when an object of kind `C` changes: every ownerReference of kind
    /// `R` names a key.
    pub fn owns<C: Resource>(self) -> Self {
        self.owns_kind(C::INFO.kind)
    }

    /// [`Controller::owns`] by kind name.
    pub fn owns_kind(self, kind: &str) -> Self {
        let owner_kind = R::INFO.kind;
        self.watches_kind(kind, move |o: &DynObject| {
            o.metadata
                .owner_references
                .iter()
                .filter(|r| r.kind == owner_kind)
                .map(|r| r.name.clone())
                .collect()
        })
    }

    /// Reconcile the names `mapper` returns when an object of kind `O` changes. The mapper is
    /// called with the object before and after the change (either may be missing), and the
    /// union of the names is queued.
    pub fn watches<O: Resource>(
        self,
        mapper: impl Fn(&DynObject) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.watches_kind(O::INFO.kind, mapper)
    }

    /// [`Controller::watches`] by kind name.
    pub fn watches_kind(
        mut self,
        kind: &str,
        mapper: impl Fn(&DynObject) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.watches.push(Watch {
            kind: kind.to_string(),
            mapper: Arc::new(mapper),
            cache: None,
        });
        self
    }

    /// [`Controller::watches`] with a metadata-only cache ([`Cache::metadata_only`]): the
    /// mapper sees each object's metadata (name, labels, ownerReferences, …) but not its
    /// annotations, `spec` or `status`. A control plane then holds one full copy of each object (in the
    /// cache of the controller whose kind it is) however many controllers watch its kind.
    pub fn watches_metadata<O: Resource>(
        mut self,
        mapper: impl Fn(&DynObject) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.watches.push(Watch {
            kind: O::INFO.kind.to_string(),
            mapper: Arc::new(mapper),
            cache: Some(Cache::metadata_only(O::INFO.kind)),
        });
        self
    }

    /// Queue every cached object every `every` (a periodic check of the world outside the
    /// store: backends, clocks).
    pub fn resync_every(mut self, every: Duration) -> Self {
        self.resync = Some(every);
        self
    }

    /// At most `n` reconciles at once (at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The backoff policy for failed reconciles.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The cache of `R` objects the controller's reflector keeps and reconciles from (for
    /// mappers of watched kinds that need to look at primary objects, e.g. by label, and to
    /// register with a [`WriteThrough`](crate::WriteThrough) store).
    pub fn cache(&self) -> Cache {
        self.cache.clone()
    }

    /// A handle to enqueue keys from outside.
    pub fn trigger(&self) -> Trigger {
        Trigger {
            tx: self.tx.clone(),
        }
    }

    /// Run until `shutdown` is cancelled: reflect, map, resync, and call `reconcile` for each
    /// queued key with the object as cached now. See the module docs for the requeue policy.
    pub fn run<F, Fut, E, P, Ctx>(
        self,
        reconcile: F,
        error_policy: P,
        ctx: Arc<Ctx>,
        shutdown: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static
    where
        F: Fn(Arc<R>, Arc<Ctx>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
        P: Fn(Arc<R>, &E, Arc<Ctx>) -> Action + Send + Sync + 'static,
        Ctx: Send + Sync + 'static,
    {
        let Controller {
            store,
            cache,
            watches,
            resync,
            concurrency,
            backoff,
            tx,
            rx,
            ..
        } = self;
        async move {
            let watch_backoff = Backoff {
                max: Duration::from_secs(30),
                ..Backoff::default()
            };
            let mut background = JoinSet::new();

            // The primary kind: every change queues its own name.
            spawn_reflector(
                &mut background,
                &store,
                cache.clone(),
                watch_backoff,
                tx.clone(),
                |c: &Change| vec![c.name().to_string()],
            );
            // Watched kinds: the mapper names the keys, for the object before and after.
            for w in watches {
                let mapper = w.mapper;
                spawn_reflector(
                    &mut background,
                    &store,
                    w.cache.unwrap_or_else(|| Cache::new(&w.kind)),
                    watch_backoff,
                    tx.clone(),
                    move |c: &Change| {
                        let mut keys = BTreeSet::new();
                        for o in c.old.iter().chain(c.new.iter()) {
                            keys.extend(mapper(o));
                        }
                        keys.into_iter().collect()
                    },
                );
            }
            if let Some(every) = resync {
                let (cache, tx) = (cache.clone(), tx.clone());
                background.spawn(async move {
                    let mut tick =
                        tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        for name in cache.names() {
                            let _ = tx.send(Request::now(name));
                        }
                    }
                });
            }
            drop(tx);

            let shared = Arc::new(Shared {
                cache,
                reconcile,
                error_policy,
                ctx,
                backoff,
                keys: Mutex::default(),
                _kind: PhantomData::<fn() -> R>,
            });
            let kind = KindLabel {
                kind: R::INFO.kind.to_string(),
            };
            let instruments = &METRICS.controllers;
            let (depth, in_flight) = (
                instruments.queue_depth.get_or_create_owned(&kind),
                instruments.in_flight.get_or_create_owned(&kind),
            );
            runner::run_reporting(
                rx,
                concurrency,
                shutdown,
                move |key| {
                    let shared = shared.clone();
                    let span = tracing::info_span!("reconcile", kind = R::INFO.kind, name = %key);
                    async move { shared.reconcile_key(key).await }.instrument(span)
                },
                |load| {
                    depth.set(load.ready as i64);
                    in_flight.set(load.in_flight as i64);
                },
            )
            .await;
            background.abort_all();
            while background.join_next().await.is_some() {}
        }
    }
}

fn spawn_reflector(
    background: &mut JoinSet<()>,
    store: &Arc<dyn ObjectStore>,
    cache: Cache,
    backoff: Backoff,
    tx: mpsc::UnboundedSender<Request>,
    keys: impl Fn(&Change) -> Vec<String> + Send + 'static,
) {
    let (changes_tx, mut changes) = mpsc::unbounded_channel();
    background.spawn(reflect(store.clone(), cache, changes_tx, backoff));
    background.spawn(async move {
        while let Some(change) = changes.recv().await {
            for key in keys(&change) {
                if tx.send(Request::now(key)).is_err() {
                    return;
                }
            }
        }
    });
}

/// What the controller remembers per key between reconciles.
#[derive(Debug, Default, Clone, Copy)]
struct KeyState {
    /// Failures since the last success.
    failures: u32,
    /// The resourceVersion at which a terminal error happened.
    terminal_at: Option<u64>,
}

struct Shared<R, F, P, Ctx> {
    cache: Cache,
    reconcile: F,
    error_policy: P,
    ctx: Arc<Ctx>,
    backoff: Backoff,
    keys: Mutex<HashMap<String, KeyState>>,
    _kind: PhantomData<fn() -> R>,
}

impl<R, F, Fut, E, P, Ctx> Shared<R, F, P, Ctx>
where
    R: Resource,
    F: Fn(Arc<R>, Arc<Ctx>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
    E: ReconcileError,
    P: Fn(Arc<R>, &E, Arc<Ctx>) -> Action + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
{
    fn with_key<T>(&self, key: &str, f: impl FnOnce(&mut KeyState) -> T) -> T {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(keys.entry(key.to_string()).or_default());
        if keys
            .get(key)
            .is_some_and(|s| s.failures == 0 && s.terminal_at.is_none())
        {
            keys.remove(key);
        }
        out
    }

    fn next_backoff(&self, key: &str) -> Duration {
        let failures = self.with_key(key, |s| {
            s.failures = s.failures.saturating_add(1);
            s.failures
        });
        self.backoff.delay(failures - 1)
    }

    /// One reconcile of `key`; returns its requeue delay.
    async fn reconcile_key(&self, key: String) -> Option<Duration> {
        let kind = R::INFO.kind;
        // A trigger may come before the first list: wait for it rather than call the key gone.
        self.cache.wait_ready().await;
        // Parsed straight from the cached text into the kind's type.
        let Some((rv, typed)) = self.cache.get_as::<R>(&key) else {
            tracing::debug!("gone; nothing to reconcile");
            self.with_key(&key, |s| *s = KeyState::default());
            return None;
        };
        tracing::debug!(resource_version = rv, "reconciling");
        if self.with_key(&key, |s| s.terminal_at == Some(rv)) {
            tracing::debug!("failed terminally at this resourceVersion; waiting for a change");
            return None;
        }
        self.with_key(&key, |s| s.terminal_at = None);
        let obj: Arc<R> = match typed {
            Ok(o) => Arc::new(o),
            Err(e) => {
                tracing::error!(error = %e, "the stored object does not read as a {kind}; waiting for a change");
                self.with_key(&key, |s| s.terminal_at = Some(rv));
                return None;
            }
        };
        let outcome = {
            let instruments = &METRICS.controllers;
            let label = KindLabel {
                kind: kind.to_string(),
            };
            let histogram = instruments.reconcile_duration.get_or_create_owned(&label);
            let _timed = Timer::start(&histogram);
            let outcome = AssertUnwindSafe((self.reconcile)(obj.clone(), self.ctx.clone()))
                .catch_unwind()
                .await;
            let result = match &outcome {
                Ok(Ok(_)) => "success",
                Ok(Err(_)) => "error",
                Err(_) => "panic",
            };
            instruments
                .reconciles
                .get_or_create(&ReconcileLabels {
                    kind: label.kind,
                    result,
                })
                .inc();
            outcome
        };
        match outcome {
            Ok(Ok(action)) => match action.0 {
                Next::Requeue(d) => {
                    self.with_key(&key, |s| s.failures = 0);
                    Some(d)
                }
                Next::AwaitChange => {
                    self.with_key(&key, |s| s.failures = 0);
                    None
                }
                Next::Backoff => Some(self.next_backoff(&key)),
            },
            Ok(Err(e)) => {
                let action = (self.error_policy)(obj, &e, self.ctx.clone());
                if e.is_terminal() {
                    tracing::warn!(error = %error_chain(&e), "reconcile failed terminally; waiting for a change");
                    self.with_key(&key, |s| s.terminal_at = Some(rv));
                    return None;
                }
                let next = match action.0 {
                    Next::Requeue(d) => Some(d),
                    Next::AwaitChange => None,
                    Next::Backoff => Some(self.next_backoff(&key)),
                };
                tracing::warn!(error = %error_chain(&e), retry_in = ?next, "reconcile failed");
                next
            }
            Err(_) => {
                let next = self.next_backoff(&key);
                tracing::error!(retry_in = ?next, "reconcile panicked");
                Some(next)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use boxery_api::{OwnerReference, Vm};
    use tokio::time::Instant;

    use super::*;
    use crate::reflector::tests::{FakeSource, obj};

    #[derive(Debug, thiserror::Error)]
    #[error("failed on purpose (terminal: {0})")]
    struct Oops(bool);

    impl ReconcileError for Oops {
        fn is_terminal(&self) -> bool {
            self.0
        }
    }

    type Script = dyn Fn(&str, usize) -> Result<Action, Oops> + Send + Sync;

    /// What a test's reconciler saw: (name, seconds since start as f64).
    struct Ctx {
        t0: Instant,
        runs: Mutex<Vec<(String, f64)>>,
        script: Box<Script>,
    }

    impl Ctx {
        fn runs_of(&self, name: &str) -> Vec<f64> {
            self.runs
                .lock()
                .unwrap()
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, t)| *t)
                .collect()
        }
    }

    async fn reconcile(vm: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action, Oops> {
        let name = vm.metadata.name.clone();
        let n = {
            let mut runs = ctx.runs.lock().unwrap();
            runs.push((name.clone(), ctx.t0.elapsed().as_secs_f64()));
            runs.iter().filter(|(r, _)| *r == name).count()
        };
        (ctx.script)(&name, n)
    }

    fn start(
        ctl: Controller<Vm>,
        script: impl Fn(&str, usize) -> Result<Action, Oops> + Send + Sync + 'static,
    ) -> (Arc<Ctx>, CancellationToken) {
        let ctx = Arc::new(Ctx {
            t0: Instant::now(),
            runs: Mutex::default(),
            script: Box::new(script),
        });
        let shutdown = CancellationToken::new();
        tokio::spawn(ctl.run(
            reconcile,
            default_error_policy,
            ctx.clone(),
            shutdown.clone(),
        ));
        (ctx, shutdown)
    }

    async fn sleep(secs: f64) {
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    }

    fn no_jitter() -> Backoff {
        Backoff {
            jitter: 0.0,
            ..Backoff::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requeue_after_and_await_change() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "b"));
        let ctl = Controller::<Vm>::new(Arc::new(src.clone()));
        let (ctx, stop) = start(ctl, |name, _| {
            Ok(if name == "a" {
                Action::requeue(Duration::from_secs(5))
            } else {
                Action::await_change()
            })
        });
        sleep(12.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 5.0, 10.0]);
        assert_eq!(ctx.runs_of("b"), [0.0]);
        src.put(obj("Vm", "b"));
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("b"), [0.0, 12.0]);
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_grows_and_resets_on_success() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        let ctl = Controller::<Vm>::new(Arc::new(src.clone())).backoff(no_jitter());
        // Fails four times, succeeds, then fails once more (after a change) and succeeds.
        let (ctx, stop) = start(ctl, |_, n| {
            if n <= 4 || n == 6 {
                Err(Oops(false))
            } else {
                Ok(Action::await_change())
            }
        });
        sleep(10.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 0.2, 0.6, 1.4, 3.0]);
        src.put(obj("Vm", "a"));
        sleep(10.0).await;
        let runs = ctx.runs_of("a");
        assert_eq!(runs.len(), 7, "{runs:?}");
        assert!(
            (runs[6] - runs[5] - 0.2).abs() < 1e-6,
            "backoff reset after success: {runs:?}"
        );
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn terminal_errors_wait_for_a_change_of_the_object() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Image", "i"));
        let ctl = Controller::<Vm>::new(Arc::new(src.clone()))
            .resync_every(Duration::from_secs(5))
            .watches::<boxery_api::Image>(|_| vec!["a".into()]);
        let trigger = ctl.trigger();
        let (ctx, stop) = start(ctl, |_, _| Err(Oops(true)));
        sleep(30.0).await;
        trigger.enqueue("a");
        src.put(obj("Image", "i"));
        sleep(1.0).await;
        assert_eq!(
            ctx.runs_of("a"),
            [0.0],
            "resync, triggers and mapped changes do not retry"
        );
        src.put(obj("Vm", "a"));
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 31.0]);
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn owned_children_queue_their_owner() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "b"));
        let ctl = Controller::<Vm>::new(Arc::new(src.clone())).owns::<boxery_api::Image>();
        let (ctx, stop) = start(ctl, |_, _| Ok(Action::await_change()));
        sleep(1.0).await;
        let mut child = obj("Image", "snap");
        let owner = |name: &str, kind: &str| OwnerReference {
            api_version: boxery_api::API_VERSION.into(),
            kind: kind.into(),
            name: name.into(),
            uid: "u".into(),
            controller: Some(true),
        };
        child.metadata.owner_references = vec![owner("a", "Vm"), owner("p", "Pool")];
        src.put(child.clone());
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 1.0]);
        // Moving the child to another owner queues both, the old and the new.
        child.metadata.owner_references = vec![owner("b", "Vm")];
        src.put(child);
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 1.0, 2.0]);
        assert_eq!(ctx.runs_of("b"), [0.0, 2.0]);
        src.delete("Image", "snap");
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("b"), [0.0, 2.0, 3.0]);
        assert!(
            ctx.runs_of("p").is_empty(),
            "other owner kinds are not ours"
        );
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn watched_kinds_are_mapped_and_triggers_enqueue() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "b"));
        // Images name the VM they are for in a label.
        let ctl =
            Controller::<Vm>::new(Arc::new(src.clone())).watches::<boxery_api::Image>(|img| {
                img.metadata
                    .labels
                    .get("for")
                    .cloned()
                    .into_iter()
                    .collect()
            });
        let trigger = ctl.trigger();
        let (ctx, stop) = start(ctl, |_, _| Ok(Action::await_change()));
        sleep(1.0).await;
        let mut img = obj("Image", "i");
        img.metadata.labels.insert("for".into(), "b".into());
        src.put(img);
        sleep(1.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0]);
        assert_eq!(ctx.runs_of("b"), [0.0, 1.0]);
        trigger.enqueue_after("a", Duration::from_secs(3));
        trigger.enqueue("unknown");
        sleep(5.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 5.0]);
        assert!(ctx.runs_of("unknown").is_empty(), "no object, no reconcile");
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_watch_maps_each_change_for_every_subscriber() {
        let src = FakeSource::new();
        for n in ["a", "b", "c"] {
            src.put(obj("Vm", n));
        }
        let store: Arc<dyn ObjectStore> = Arc::new(src.clone());
        // Two controllers of Vms, one shared watch of Images: an Image labelled `for: X`
        // queues X on the first, and `also: Y` queues Y on the second.
        let one = Controller::<Vm>::new(store.clone());
        let two = Controller::<Vm>::new(store.clone());
        let label = |k: &'static str| {
            move |img: &DynObject| img.metadata.labels.get(k).cloned().into_iter().collect()
        };
        let shared = SharedWatch::metadata::<boxery_api::Image>()
            .subscribe(one.trigger(), label("for"))
            .subscribe(two.trigger(), label("also"));
        let (ctx1, stop1) = start(one, |_, _| Ok(Action::await_change()));
        let (ctx2, stop2) = start(two, |_, _| Ok(Action::await_change()));
        let stop = CancellationToken::new();
        tokio::spawn(shared.run(store, stop.clone()));
        sleep(1.0).await;
        let mut img = obj("Image", "i");
        img.metadata.labels.insert("for".into(), "b".into());
        img.metadata.labels.insert("also".into(), "c".into());
        src.put(img.clone());
        sleep(1.0).await;
        assert_eq!(ctx1.runs_of("b"), [0.0, 1.0]);
        assert_eq!(ctx1.runs_of("c"), [0.0]);
        assert_eq!(ctx2.runs_of("c"), [0.0, 1.0]);
        assert_eq!(ctx2.runs_of("b"), [0.0]);
        // A change away from a name queues the old one too (the object before the change).
        img.metadata.labels.insert("for".into(), "a".into());
        src.put(img);
        sleep(1.0).await;
        assert_eq!(ctx1.runs_of("a"), [0.0, 2.0]);
        assert_eq!(ctx1.runs_of("b"), [0.0, 1.0, 2.0]);
        stop.cancel();
        stop1.cancel();
        stop2.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn resync_queues_every_object() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "b"));
        let ctl =
            Controller::<Vm>::new(Arc::new(src.clone())).resync_every(Duration::from_secs(10));
        let (ctx, stop) = start(ctl, |_, _| Ok(Action::await_change()));
        sleep(35.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0, 10.0, 20.0, 30.0]);
        assert_eq!(ctx.runs_of("b"), [0.0, 10.0, 20.0, 30.0]);
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn deleted_objects_are_not_reconciled_and_panics_back_off() {
        let src = FakeSource::new();
        src.put(obj("Vm", "a"));
        src.put(obj("Vm", "p"));
        let ctl = Controller::<Vm>::new(Arc::new(src.clone())).backoff(no_jitter());
        let (ctx, stop) = start(ctl, |name, n| {
            if name == "p" && n == 1 {
                panic!("on purpose");
            }
            Ok(Action::requeue(Duration::from_secs(1)))
        });
        sleep(0.5).await;
        src.delete("Vm", "a");
        sleep(5.0).await;
        assert_eq!(ctx.runs_of("a"), [0.0]);
        assert_eq!(ctx.runs_of("p")[..3], [0.0, 0.2, 1.2]);
        stop.cancel();
    }
}
