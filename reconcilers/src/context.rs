//! What every reconciler shares: the store, `$BOXERY_HOME`, the backend, the event recorder,
//! per-VM locks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use boxery_api::{EventType, Resource};
use boxery_backends::Backend;
use boxery_controller::events::Recorder;
use boxery_controller::{Cache, WriteThrough};
use boxery_store::ObjectStore;

/// Settings of the reconcilers.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How often the inventory of the backend is compared with the store.
    pub inventory_every: Duration,
    /// How often every object is reconciled again even without a change.
    pub resync_every: Duration,
    /// How many reconciles may run at once per controller.
    pub concurrency: usize,
    /// Directories an Image's `source.file` may import from, besides `$BOXERY_HOME/imports`
    /// (`importRoots` in `$BOXERY_HOME/config.yaml`).
    pub import_roots: Vec<std::path::PathBuf>,
    /// The most bytes memory files may take (`memory: {quota: …}` in config.yaml; `None`: no
    /// limit): [`crate::quota`].
    pub memory_quota: Option<u64>,
    /// Where the image builders write (`BOXERY_IMAGE_CACHE`, default
    /// `/var/cache/boxery/images`): a built image's `NAME.build-info` is read from here, and a
    /// layer added to a running VM is copied in from the layered build's disk here
    /// (docs/images.md). `None`: neither.
    pub build_outputs: Option<std::path::PathBuf>,
    /// Dollars per million tokens by model (`proxy: {prices: …}` in config.yaml): what a
    /// grant's `dollarsPerMonth` warnings count ([`crate::limits`]).
    pub prices: std::collections::BTreeMap<String, boxery_api::config::Price>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            inventory_every: Duration::from_secs(10),
            resync_every: Duration::from_secs(60),
            concurrency: 16,
            import_roots: Vec::new(),
            memory_quota: None,
            prices: Default::default(),
            build_outputs: Some(
                std::env::var_os("BOXERY_IMAGE_CACHE")
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| "/var/cache/boxery/images".into())
                    .into(),
            ),
        }
    }
}

/// How long after a failed open the usage ledger is tried again.
pub const LEDGER_RETRY: Duration = Duration::from_secs(30);

/// Shared state of the reconcilers.
pub struct Ctx {
    /// The store, written through to the controllers' caches (see [`Ctx::read_own_writes`]).
    pub store: Arc<dyn ObjectStore>,
    /// `$BOXERY_HOME`: the ssh files, the token store and the default import root live here.
    pub home: PathBuf,
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// Writes Events.
    pub recorder: Recorder,
    /// This control plane's identity, recorded in `status.operation.holder`.
    pub holder: String,
    /// Settings.
    pub settings: Settings,
    /// The ssh files, when the backend's VMs run sshd.
    pub ssh: Option<crate::ssh::SshDir>,
    /// What was pushed to each guest ([`crate::guest`]).
    pub(crate) guest: crate::guest::Pushed,
    /// When each desktop VM's display was last asked about ([`crate::display`]).
    pub(crate) display: crate::display::Asked,
    writes: Arc<WriteThrough>,
    pool_caches: std::sync::OnceLock<crate::pool::Caches>,
    observed: std::sync::OnceLock<crate::metrics::Observed>,
    /// The usage ledger once opened, or when opening it last failed.
    ledger: Mutex<Option<Result<Arc<boxery_home::usage::Ledger>, std::time::Instant>>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    reported: Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("backend", &self.backend)
            .field("holder", &self.holder)
            .finish()
    }
}

impl Ctx {
    /// The directories an Image may import a file from: `$BOXERY_HOME/imports` and the
    /// owner's `importRoots`.
    pub fn import_roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![boxery_home::layout::imports(&self.home)];
        roots.extend(self.settings.import_roots.iter().cloned());
        roots
    }

    /// Whether `key` is reported for the first time by this process (then it is remembered).
    pub fn first_report(&self, key: &str) -> bool {
        self.reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string())
    }

    /// boxery's mark for what the backend makes for the object with `meta`: its uid and this
    /// store's identity.
    pub fn mark(&self, meta: &boxery_api::ObjectMeta) -> String {
        boxery_backends::mark::mark(meta.uid.as_deref().unwrap_or_default(), self.store.uid())
    }

    /// A context over `store`, for the home directory `home`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        home: PathBuf,
        backend: Arc<dyn Backend>,
        holder: String,
        settings: Settings,
    ) -> Self {
        let writes = Arc::new(WriteThrough::new(store));
        let store: Arc<dyn ObjectStore> = writes.clone();
        let recorder = Recorder::new(store.clone(), "boxery-controller");
        let ssh = backend
            .capabilities()
            .ssh
            .then(|| crate::ssh::SshDir::new(&home));
        Ctx {
            store,
            home,
            writes,
            backend,
            recorder,
            holder,
            settings,
            ssh,
            guest: Default::default(),
            pool_caches: std::sync::OnceLock::new(),
            observed: std::sync::OnceLock::new(),
            ledger: Mutex::new(None),
            locks: Mutex::new(HashMap::new()),
            reported: Mutex::new(Default::default()),
            display: Default::default(),
        }
    }

    /// The lock that serialises every backend action on one VM across reconcilers (a capture
    /// by the Image reconciler never overlaps a start, stop or reimage by the Vm reconciler).
    pub fn vm_lock(&self, vm: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(vm.to_string()).or_default().clone()
    }

    /// Make every write through [`Ctx::store`] go into `cache` before it returns, so that the
    /// controller reconciling from `cache` reads its own writes.
    pub fn read_own_writes(&self, cache: Cache) {
        self.writes.register(cache);
    }

    /// Give the pool and lease reconcilers the caches they read (once; `runtime::run` does).
    pub fn keep_pool_caches(&self, caches: crate::pool::Caches) {
        let _ = self.pool_caches.set(caches);
    }

    /// Let `/metrics` read what the controllers run on this context observe (once, before
    /// [`crate::runtime::run`]; `serve` does).
    pub fn keep_observed(&self, observed: crate::metrics::Observed) {
        let _ = self.observed.set(observed);
    }

    /// This home's usage ledger, opened on first use; `None` while it cannot be (said each
    /// time it is tried, at most every [`LEDGER_RETRY`]: a failure is not kept for the life of
    /// the process).
    pub fn ledger(&self) -> Option<Arc<boxery_home::usage::Ledger>> {
        let mut slot = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            Some(Ok(l)) => return Some(l.clone()),
            Some(Err(failed)) if failed.elapsed() < LEDGER_RETRY => return None,
            _ => {}
        }
        match boxery_home::usage::Ledger::open(&self.home) {
            Ok(l) => {
                let l = Arc::new(l);
                *slot = Some(Ok(l.clone()));
                Some(l)
            }
            Err(e) => {
                tracing::error!(error = %e, retry_in_s = LEDGER_RETRY.as_secs(), "the usage ledger cannot be opened: use is not recorded, nor budgets judged, until it can");
                *slot = Some(Err(std::time::Instant::now()));
                None
            }
        }
    }

    /// What `/metrics` reads, when `serve` asked for it.
    pub fn observed(&self) -> Option<&crate::metrics::Observed> {
        self.observed.get()
    }

    /// The caches of member records and leases, when the runtime keeps them.
    pub fn pool_caches(&self) -> Option<&crate::pool::Caches> {
        self.pool_caches.get()
    }

    /// Record an event about `obj`.
    pub async fn event<R: Resource>(&self, obj: &R, type_: EventType, reason: &str, message: &str) {
        self.recorder
            .publish(
                &boxery_controller::events::involved(obj),
                type_,
                reason,
                message,
            )
            .await;
    }
}
