//! The versioned object store: every object of every kind in one SQLite file (WAL), with a
//! global monotonic revision (each write's `resourceVersion`), generations bumped only by spec
//! changes, optimistic concurrency (a stale writer gets `Conflict`), finalizer-aware deletes
//! with ownerReference cascade, `apply` with last-applied records, a resumable `watch` over an
//! event log with a compaction floor, and leader election rows.
//!
//! Modelled on k3s's kine: one log whose row id is the revision; watch = rows after revision N
//! plus a wake-up (in-process notify, and `PRAGMA data_version` polling for writes from other
//! processes). `docs/store.md` describes the layout and the reasoning.
//!
//! # Guarantees
//! - Every write is one short `BEGIN IMMEDIATE` transaction; `apply_all` is one transaction for
//!   a whole set (all or nothing). Several processes may open the same file at once.
//! - Every stored object passed `boxery_api::normalize` (schema + checks + defaults).
//! - Each changed object gets its own revision; revisions are committed in increasing order, so
//!   a reader that saw revision N has seen every change at or below N.
//! - A watcher sees every change after its start revision, in order, exactly once, or gets
//!   `TooOld` when compaction removed what it asked for (relist, then watch again).
//! - `list` returns the revision it read at: watching from it misses nothing.
//! - A write that changes nothing writes nothing (no new revision, no event).
//!
//! # Assumptions
//! - The file lives on a local file system (SQLite's WAL needs shared memory between the
//!   processes that open it).
//! - The [`Store`] methods are short and synchronous (microseconds to a few milliseconds,
//!   longer when another process holds the write lock): for synchronous callers. Async code
//!   uses the [`ObjectStore`] trait, whose SQLite implementation runs them on tokio's blocking
//!   pool (inline on a current-thread runtime); the watch stream reads the log the same way,
//!   so it needs no particular runtime.
//!
//! # Caveats
//! - Cascading deletes follow the owner's uid: every object naming a removed object among its
//!   ownerReferences is deleted too, even when it names other owners.
//! - Leader election compares wall clocks; see [`Store::try_lead`].

mod apply;
mod compact;
mod fields;
pub mod guard;
mod leader;
mod object_store;
pub mod rules;
/// What [`reads_from!`] names, for the crates that use it.
#[doc(hidden)]
pub mod __private {
    pub use crate::object_store::Boxed;
    pub use boxery_api::{DynObject, Selector};
}
mod schema;
mod snapshot;
/// The store schema version this build writes (`PRAGMA user_version`).
pub use schema::SCHEMA_VERSION;
/// Open an existing SQLite file as every store connection is opened: WAL (the switch tried
/// again while another connection sets up the same new file), `synchronous=NORMAL`, a busy
/// timeout. The usage ledger (`boxery_home::usage`) opens with it too.
pub use schema::connect as connect_sqlite;
mod watch;
pub mod wire;
mod write;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use boxery_api::{DynObject, Resource, Selector};
use rusqlite::{Connection, OptionalExtension};

pub use crate::fields::{APPLY_MANAGER, FieldConflict, UNNAMED_MANAGER, entry_fields};
pub use crate::leader::boot_id;
pub use crate::object_store::{
    KEEP_REVISIONS, ObjectRef, ObjectStore, ObjectStoreExt, WatchStream,
};
use crate::rules::Rules;
use crate::schema::connect;
use crate::write::Tx;

/// The kinds whose removal is remembered (their uids, in `tombstones`): the kinds a backend
/// makes things for, so that an orphan in the backend is removed only when this store knew
/// its object and deleted it.
pub const TOMBSTONED_KINDS: [&str; 2] = ["Vm", "Image"];

/// Annotation holding the manifest last applied (for `diff` and `--prune`).
pub const LAST_APPLIED: &str = "boxery.dev/last-applied";

/// The text each `key=value` requirement of `selector` needs in a stored object's JSON:
/// `"key":"value"`, as `serde_json::to_string` (the one writer of the `objects` rows) writes
/// a label. A row without it cannot match, so `list` skips it before parsing; a row with it
/// may still not match (the pair could sit elsewhere in the object), so the selector is
/// checked on the parsed labels as before. Listing one object's Events among thousands (the
/// event recorder does it on every new Event) reads the matching rows only.
fn label_needles(selector: &Selector) -> Result<Vec<String>> {
    selector
        .0
        .iter()
        .filter_map(|r| match r {
            boxery_api::selector::Requirement::Eq(k, v) => Some((k, v)),
            _ => None,
        })
        .map(|(k, v)| {
            Ok(format!(
                "{}:{}",
                serde_json::to_string(k)?,
                serde_json::to_string(v)?
            ))
        })
        .collect()
}

fn field_conflicts_message(object: &str, applier: &str, conflicts: &[FieldConflict]) -> String {
    let n = conflicts.len();
    let fields: Vec<String> = conflicts
        .iter()
        .map(|c| {
            format!(
                "{} ({} set {}, the manifest sets {})",
                c.field, c.manager, c.current, c.applied
            )
        })
        .collect();
    format!(
        "{object}: apply by {applier} would change {n} field{} another manager set: {}; leave {} out of the manifest to keep {} as {} set it, or force the apply to take {} over (--force-conflicts)",
        if n == 1 { "" } else { "s" },
        fields.join(", "),
        if n == 1 { "it" } else { "them" },
        if n == 1 { "it" } else { "them" },
        if n == 1 {
            "that manager"
        } else {
            "those managers"
        },
        if n == 1 { "it" } else { "them" },
    )
}

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist.
    #[error("{kind} {name} not found: `boxery get {plural}` lists them")]
    NotFound {
        /// The kind asked for.
        kind: String,
        /// The name asked for.
        name: String,
        /// The kind's plural, for the hint.
        plural: String,
    },
    /// `create` of a name that exists.
    #[error("{kind} {name} already exists: use `boxery apply` to change it, or pick another name")]
    AlreadyExists {
        /// The kind.
        kind: String,
        /// The name taken.
        name: String,
    },
    /// Optimistic concurrency: the object changed since the caller read it.
    #[error(
        "{kind} {name} was changed by someone else (resourceVersion {expected} is stale; it is now {actual}): read it again and retry"
    )]
    Conflict {
        /// The kind.
        kind: String,
        /// The name.
        name: String,
        /// The resourceVersion the caller had.
        expected: String,
        /// The resourceVersion stored.
        actual: String,
    },
    /// The object failed validation.
    #[error(transparent)]
    Invalid(#[from] boxery_api::ValidationError),
    /// `apply` of an object that is being deleted.
    #[error(
        "{kind} {name} is being deleted (its finalizers are still running): wait until it is gone, then apply again"
    )]
    BeingDeleted {
        /// The kind.
        kind: String,
        /// The name.
        name: String,
    },
    /// An object names an owner (by uid) that does not exist: it would never be cleaned up.
    #[error(
        "{kind} {name} names owner {owner} (uid {uid}), which no longer exists: re-read the owner and write its current uid, or drop the reference"
    )]
    OwnerGone {
        /// The kind of the object written.
        kind: String,
        /// Its name.
        name: String,
        /// The owner's `kind/name` as the reference gives it.
        owner: String,
        /// The owner's uid as the reference gives it.
        uid: String,
    },
    /// An apply would change fields another manager set (`stop`, `scale`, another source):
    /// nothing was applied.
    #[error("{}", field_conflicts_message(object, applier, conflicts))]
    FieldConflicts {
        /// `Vm/dev1`.
        object: String,
        /// The applier (`boxery-apply`, `boxery-sync.NAME`).
        applier: String,
        /// Each field, with the manager that set it and both values.
        conflicts: Vec<FieldConflict>,
    },
    /// The writer may not make this write ([`guard`]): the message says who may.
    #[error("{why}")]
    Forbidden {
        /// Who may do it instead.
        why: String,
    },
    /// A watch asked for revisions that were compacted away.
    #[error(
        "revision {requested} is too old (history starts after {floor}): list again and watch from the list's revision"
    )]
    TooOld {
        /// The revision the watch would resume after.
        requested: u64,
        /// The compaction floor: history starts after it.
        floor: u64,
    },
    /// The store cannot serve the call now (a remote store unreachable, a runtime shutting
    /// down); retrying may help.
    #[error("the store is unavailable: {why}")]
    Unavailable {
        /// Why.
        why: String,
    },
    /// The database under the store (SQLite, etcd) failed.
    #[error("the store's database failed")]
    Db(#[source] DbError),
    /// JSON (de)serialization failed.
    #[error("a stored object could not be read")]
    Json(#[from] serde_json::Error),
    /// Opening the store failed (its directory, or its background threads).
    #[error("cannot open the store at {path}")]
    Open {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening the store's database failed.
    #[error("cannot open the store's database at {path}: check the path and its permissions")]
    OpenDb {
        /// The file (or the database's address).
        path: String,
        /// The cause.
        #[source]
        source: DbError,
    },
    /// The file is not a boxery store: empty, truncated, corrupted, or another program's.
    #[error(
        "{path} is not a boxery store ({why}). boxery reads and writes nothing until this is settled: restore the store from a backup, or move the file away (`mv {path} {path}.broken`) to start a new, empty store. The VMs and images boxery made stay in the backend either way; a new store lists them with `boxery orphans` and never deletes them by itself"
    )]
    NotAStore {
        /// The file.
        path: String,
        /// What is wrong with it.
        why: String,
    },
    /// The file was written by a newer boxery.
    #[error(
        "the store at {path} has schema version {found}, newer than this boxery understands ({supported}): upgrade boxery"
    )]
    SchemaTooNew {
        /// The file.
        path: String,
        /// Its `user_version`.
        found: i64,
        /// The newest version this build reads.
        supported: i64,
    },
}

/// The error of the database under the store, as that database gave it: SQLite's, etcd's.
/// Kept opaque so that nothing above the store depends on which database it is; the store
/// itself reads it back with [`DbError::get`].
pub struct DbError(Box<dyn std::error::Error + Send + Sync + 'static>);

impl DbError {
    /// The database's own error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> DbError {
        DbError(Box::new(e))
    }

    /// The database's error, when it is an `E`.
    pub fn get<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for DbError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> StoreError {
        StoreError::Db(DbError::new(e))
    }
}

impl StoreError {
    /// SQLite's error code, when SQLite failed (opening its file, or a statement).
    pub(crate) fn sqlite_code(&self) -> Option<rusqlite::ErrorCode> {
        let source = match self {
            StoreError::Db(e) | StoreError::OpenDb { source: e, .. } => e,
            _ => return None,
        };
        match source.get::<rusqlite::Error>()? {
            rusqlite::Error::SqliteFailure(f, _) => Some(f.code),
            _ => None,
        }
    }

    fn not_found(kind: &str, name: &str) -> StoreError {
        let plural = boxery_api::lookup_kind(kind)
            .map(|k| k.plural.to_string())
            .unwrap_or_else(|| kind.to_ascii_lowercase());
        StoreError::NotFound {
            kind: kind.to_string(),
            name: name.to_string(),
            plural,
        }
    }
}

/// `Invalid` unless `name` is a valid name for objects of `kind` (and `kind` is a kind).
pub fn check_name(kind: &str, name: &str) -> Result<()> {
    let invalid = |message: String| {
        StoreError::Invalid(boxery_api::ValidationError {
            object: format!(
                "{}/{}",
                boxery_api::name::shown(kind),
                boxery_api::name::shown(name)
            ),
            errors: vec![boxery_api::validate::FieldError::new(
                "metadata.name",
                message,
            )],
        })
    };
    let info = boxery_api::KINDS
        .iter()
        .find(|k| k.kind == kind)
        .ok_or_else(|| invalid(format!("unknown kind `{}`", boxery_api::name::shown(kind))))?;
    boxery_api::Name::for_kind(info, name).map_err(|e| invalid(e.0))?;
    Ok(())
}

/// Result alias.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A change seen by a watcher.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent {
    /// Created.
    Added(DynObject),
    /// Changed (including deletionTimestamp being set).
    Modified(DynObject),
    /// Removed (the object as it was last, with the deletion's revision as resourceVersion).
    Deleted(DynObject),
}

impl WatchEvent {
    /// The object the event carries.
    pub fn object(&self) -> &DynObject {
        match self {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o,
        }
    }
}

/// What `delete` did.
#[derive(Debug, Clone, PartialEq)]
pub enum DeleteOutcome {
    /// Finalizers remain: `deletionTimestamp` is set (or already was).
    Marked(DynObject),
    /// The object is gone.
    Removed(DynObject),
}

/// What `apply` did to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyAction {
    /// It did not exist and was created.
    Created,
    /// It existed and its manifest changed it.
    Configured,
    /// It existed and nothing changed (nothing was written).
    Unchanged,
    /// It was not in the set, matched the prune selector and carried a last-applied record:
    /// deleted (or marked for deletion while finalizers remain).
    Pruned,
}

/// Options for `apply_all`.
#[derive(Debug, Clone, Default)]
pub struct ApplyOptions {
    /// Validate and compute the outcome, write nothing.
    pub dry_run: bool,
    /// Delete objects that match this selector, carry a last-applied record, and are not in the set.
    pub prune: Option<Selector>,
    /// Prune among every kind people write, not only the kinds in the set (an apply set,
    /// whose source may have dropped a kind entirely).
    pub prune_all_kinds: bool,
    /// The applier whose fields these manifests set ([`APPLY_MANAGER`] when `None`).
    pub field_manager: Option<String>,
    /// Take over fields another manager set to other values instead of refusing the apply
    /// with `FieldConflicts`.
    pub force_conflicts: bool,
}

impl ApplyOptions {
    /// The applier's name.
    pub fn manager(&self) -> &str {
        self.field_manager.as_deref().unwrap_or(APPLY_MANAGER)
    }
}

/// Who is trying to lead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Unique per running instance (e.g. `hostname-pid-random`); the holder's name.
    pub id: String,
    /// The candidate's process id, checked for liveness by candidates on the same boot.
    pub pid: u32,
    /// The machine's boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
}

impl Candidate {
    /// This process as a candidate: its pid and this machine's boot id.
    pub fn current(id: impl Into<String>) -> Candidate {
        Candidate {
            id: id.into(),
            pid: std::process::id(),
            boot_id: leader::boot_id(),
        }
    }
}

/// The outcome of a leader-election attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// The caller holds the lock until the TTL runs out (renew before).
    Leader {
        /// Grows by one whenever the holder changes: fences a former leader's writes.
        epoch: u64,
    },
    /// Someone else holds it.
    Follower {
        /// The holder's candidate id.
        holder: String,
        /// How long until its lease expires unless renewed.
        expires_in: Duration,
    },
}

/// Background compaction of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoCompact {
    /// How many of the newest revisions stay in the log.
    pub keep_revisions: u64,
    /// How often to compact (the first run is one period after opening).
    pub every: Duration,
}

/// How a store is opened.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Background compaction (`None`: only [`Store::compact`] trims the log).
    pub auto_compact: Option<AutoCompact>,
    /// How long a write waits for another writer's lock before failing.
    pub busy_timeout: Duration,
    /// How often the change poller looks for writes by other processes.
    pub poll_interval: Duration,
}

impl Default for StoreOptions {
    /// Keep the newest 10,000 revisions, compacting every minute; wait up to 5 s for the write
    /// lock; poll for other processes' writes every 5 ms.
    fn default() -> Self {
        StoreOptions {
            auto_compact: Some(AutoCompact {
                keep_revisions: KEEP_REVISIONS,
                every: Duration::from_secs(60),
            }),
            busy_timeout: Duration::from_secs(5),
            poll_interval: Duration::from_millis(5),
        }
    }
}

/// Readers kept open for reuse.
const MAX_IDLE_READERS: usize = 8;

/// Readers kept open through a quiet spell (see [`Inner::release_memory`]).
const IDLE_READERS_KEPT: usize = 1;

/// How often the upkeep thread releases the connections' idle memory.
pub(crate) const RELEASE_EVERY: Duration = Duration::from_secs(10);

/// The page cache of each reader, in KiB (the writer keeps `schema::connect`'s 512). Up to
/// eight readers stay open; their reads are an object by key, the recent rows of the log, or a
/// whole kind (more than any cache of this size holds), all served from the OS page cache
/// when not from this one. 128 KiB each keeps about 3 MiB off an idle `serve`
/// (docs/benchmarks.md, issue 12).
const READER_CACHE_KIB: i64 = 128;

/// What every clone of a [`Store`] shares.
pub(crate) struct Inner {
    path: PathBuf,
    uid: String,
    busy_timeout: Duration,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    /// The newest revision known to this process (wakes watchers).
    pub(crate) revisions: tokio::sync::watch::Sender<watch::Published>,
    /// The newest revision of each kind, known for every revision up to a point: lets a
    /// watcher of one kind skip reading the log when only other kinds changed.
    pub(crate) kind_revs: Arc<Mutex<watch::KindRevs>>,
    /// How often the poller looks for other processes' commits.
    poll_interval: Duration,
    /// The poller, started by the first watch (a command that only reads or writes needs
    /// none); dropped with the last handle, which stops it.
    poller: std::sync::OnceLock<mpsc::Sender<()>>,
    /// Dropped with the last handle: stops the upkeep thread.
    _stop_upkeep: mpsc::Sender<()>,
    /// A store in memory ([`Store::open_in_memory`]): the writer's connection is the only
    /// one, and serves the reads too.
    in_memory: bool,
}

/// The store files open in this process (device, inode), and the stores that have them.
type OpenFiles = Vec<((u64, u64), std::sync::Weak<Inner>)>;
static OPEN_FILES: Mutex<OpenFiles> = Mutex::new(Vec::new());

/// A file's identity, from `stat` (no descriptor opened).
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a transaction rolled it back (rusqlite's Transaction drops with a
    // rollback); the connection is usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// A store's shared state around its writer connection, at the revision `writer` reads;
    /// with the receiver that tells the upkeep thread the last handle went.
    fn new(
        path: PathBuf,
        writer: Connection,
        options: &StoreOptions,
        in_memory: bool,
    ) -> Result<(Arc<Inner>, mpsc::Receiver<()>)> {
        let open_db = |source| StoreError::OpenDb {
            path: path.display().to_string(),
            source: DbError::new(source),
        };
        let rev = schema::meta(&writer, "revision").map_err(open_db)?;
        let uid = schema::identity(&writer).map_err(open_db)?;
        let (revisions, _) = tokio::sync::watch::channel(watch::Published::now(rev));
        let kind_revs = Arc::new(Mutex::new(watch::KindRevs::new(rev)));
        let (stop_upkeep, upkeep_rx) = mpsc::channel();
        let inner = Arc::new(Inner {
            path,
            uid,
            busy_timeout: options.busy_timeout,
            poll_interval: options.poll_interval,
            writer: Mutex::new(writer),
            readers: Mutex::new(Vec::new()),
            revisions,
            kind_revs,
            poller: std::sync::OnceLock::new(),
            _stop_upkeep: stop_upkeep,
            in_memory,
        });
        Ok((inner, upkeep_rx))
    }

    /// Run `f` on an idle reader connection (opening one if none is idle); in memory, on the
    /// one connection, when no write holds it.
    pub(crate) fn with_reader<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
        if self.in_memory {
            let mut conn = lock(&self.writer);
            let out = f(&mut conn);
            if !conn.is_autocommit() {
                // A failed read left its transaction open: end it (the one connection stays).
                let _ = conn.execute_batch("ROLLBACK");
            }
            return out;
        }
        let idle = lock(&self.readers).pop();
        let mut conn = match idle {
            Some(c) => c,
            None => {
                let c = connect(&self.path, self.busy_timeout)?;
                c.pragma_update(None, "cache_size", -READER_CACHE_KIB)?;
                c
            }
        };
        let out = f(&mut conn);
        if !conn.is_autocommit() {
            // A failed read left its transaction open: do not reuse the connection.
            return out;
        }
        let mut idle = lock(&self.readers);
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
        out
    }

    /// Start the poller if it is not running: from now on, other processes' commits wake
    /// this process's watchers (and their kinds are recorded in `kind_revs`).
    pub(crate) fn start_poller(&self) {
        if self.in_memory {
            // Only this store's own writes reach its memory, and they wake watchers.
            return;
        }
        self.poller.get_or_init(|| {
            let (stop, rx) = mpsc::channel();
            if let Err(e) = watch::spawn_poller(
                self.path.clone(),
                self.busy_timeout,
                self.poll_interval,
                self.revisions.clone(),
                self.kind_revs.clone(),
                rx,
            ) {
                tracing::error!(error = %e, "cannot start the store's change poller; writes from other processes will not wake watchers");
            }
            stop
        });
    }

    /// Give back what the connections hold beyond their open state: idle readers past
    /// [`IDLE_READERS_KEPT`] are closed, and the page caches of the rest and of the writer (when
    /// no write is under way) are emptied (`PRAGMA shrink_memory`). The upkeep thread calls it
    /// every [`RELEASE_EVERY`]; a read after it is served from the OS page cache.
    pub(crate) fn release_memory(&self) {
        let closed: Vec<Connection> = {
            let mut idle = lock(&self.readers);
            let extra = idle.len().saturating_sub(IDLE_READERS_KEPT);
            idle.drain(..extra).collect()
        };
        drop(closed);
        for c in lock(&self.readers).iter() {
            let _ = c.execute_batch("PRAGMA shrink_memory");
        }
        if let Ok(w) = self.writer.try_lock() {
            let _ = w.execute_batch("PRAGMA shrink_memory");
        }
    }

    /// Run `f` in one write transaction; commit when it succeeds (roll back when it fails or
    /// when `dry_run`), then wake watchers.
    fn write<T>(&self, dry_run: bool, f: impl FnOnce(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        let mut conn = lock(&self.writer);
        let mut tx = Tx::begin(&mut conn)?;
        let out = f(&mut tx)?;
        if dry_run {
            tx.rollback()?;
        } else {
            let done = tx.commit()?;
            // Recorded before the writer lock is let go and before watchers wake, so a watcher
            // woken by any later revision finds this one's kinds (see `watch::KindRevs`).
            lock(&self.kind_revs).wrote(done.start, done.rev, &done.kinds);
            watch::publish(&self.revisions, done.rev);
        }
        Ok(out)
    }
}

/// A handle on the store. Cheap to clone (every clone shares the connections and the
/// background threads, which stop when the last clone is dropped).
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Open (or create) the store at `path` with [`StoreOptions::default`]. Creates missing
    /// parent directories. Needs no async runtime.
    pub fn open(path: &Path) -> Result<Store> {
        Store::open_with(path, StoreOptions::default())
    }

    /// Open (or create) the store at `path`.
    pub fn open_with(path: &Path, options: StoreOptions) -> Result<Store> {
        let open_err = |source| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(open_err)?;
        }
        // Held until this store is registered (below): no other open in this process is
        // between its check and its own registration.
        let mut open_here = lock(&OPEN_FILES);
        schema::create_new(path)?;
        let id = file_id(path);
        open_here.retain(|(_, w)| w.strong_count() > 0);
        // A file a store in this process has open was probed when that store opened it.
        // (`probe` reads through SQLite only: a descriptor of its own, once closed, would
        // drop the locks this process's connections hold on the file; see `probe`.)
        if !id.is_some_and(|id| open_here.iter().any(|(i, _)| *i == id)) {
            schema::probe(path)?;
        }
        // The store is its owner's alone (SQLite gives its -wal and -shm the same mode).
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(path)
                && m.permissions().mode() & 0o077 != 0
            {
                let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
            }
        }
        let not_a_db = |e: StoreError| match e {
            StoreError::OpenDb { .. }
                if e.sqlite_code() == Some(rusqlite::ErrorCode::NotADatabase) =>
            {
                StoreError::NotAStore {
                    path: path.display().to_string(),
                    why: "the file is not an SQLite database: it is corrupted or was replaced"
                        .into(),
                }
            }
            StoreError::OpenDb { .. }
                if e.sqlite_code() == Some(rusqlite::ErrorCode::DatabaseCorrupt) =>
            {
                StoreError::NotAStore {
                    path: path.display().to_string(),
                    why: "the database is corrupted (truncated or partly overwritten)".into(),
                }
            }
            e => e,
        };
        let mut writer = connect(path, options.busy_timeout).map_err(not_a_db)?;
        schema::init(&mut writer, path, options.busy_timeout).map_err(not_a_db)?;
        let (inner, upkeep_rx) = Inner::new(path.to_path_buf(), writer, &options, false)?;
        compact::spawn_upkeep(
            path.to_path_buf(),
            options.busy_timeout,
            options.auto_compact.clone(),
            Arc::downgrade(&inner),
            upkeep_rx,
        )
        .map_err(open_err)?;
        if let Some(id) = id {
            open_here.push((id, Arc::downgrade(&inner)));
        }
        Ok(Store { inner })
    }

    /// A new, empty store in memory, for tests (a reconciler's decisions, a verb's checks):
    /// the same store as a file's (the same SQL, so the same revisions, generations, field
    /// ownership, finalizers, cascade, watch and leader rows) on one private SQLite
    /// connection, which serves reads as well as writes, one call at a time.
    ///
    /// Unlike a file's: nothing else can open it ([`Store::path`] is a name, `memory:<uuid>`,
    /// not a file; a second handle is a clone); no background thread (no poller: no other
    /// process writes; no upkeep: no WAL, and the log is compacted only by
    /// [`Store::compact`]). It is gone with its last handle.
    pub fn open_in_memory() -> Result<Store> {
        let path = PathBuf::from(format!("memory:{}", uuid::Uuid::new_v4().simple()));
        let writer = schema::memory().map_err(|source| StoreError::OpenDb {
            path: path.display().to_string(),
            source: DbError::new(source),
        })?;
        let options = StoreOptions {
            auto_compact: None,
            ..Default::default()
        };
        let (inner, _no_upkeep) = Inner::new(path, writer, &options, true)?;
        Ok(Store { inner })
    }

    /// The file this store keeps (for a store in memory, its name).
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The store's identity: a uid made with the file and never changed. Backends record it
    /// in the mark of everything made for this store's objects.
    pub fn uid(&self) -> &str {
        &self.inner.uid
    }

    /// Whether this store removed an object (a Vm or an Image) with this uid. `false` for a
    /// uid it never knew, and for one removed after the point a restored backup was taken.
    pub fn was_removed(&self, uid: &str) -> Result<bool> {
        self.inner.with_reader(|c| {
            Ok(c.prepare_cached("SELECT 1 FROM tombstones WHERE uid = ?1")?
                .query_row([uid], |_| Ok(()))
                .optional()?
                .is_some())
        })
    }

    /// Create an object: validated and defaulted, then `uid`, `generation` 1,
    /// `creationTimestamp` and `resourceVersion` set by the server (`deletionTimestamp` and any
    /// given `resourceVersion` dropped). Metadata, spec and status are kept as given.
    /// `AlreadyExists` when the name is taken; `OwnerGone` when an ownerReference names a uid
    /// no current object has (the object would never be garbage-collected).
    pub fn create(&self, obj: DynObject) -> Result<DynObject> {
        self.create_by(obj, UNNAMED_MANAGER)
    }

    /// [`Store::create`] by a named field manager, which owns the fields it set.
    pub fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let obj = boxery_api::normalize(serde_json::to_value(&obj)?)?;
        self.inner.write(false, |tx| tx.create(obj, manager))
    }

    /// Create an object again with the uid it was made with (`boxery orphans adopt`: a VM or
    /// image in the backend whose object this store lacks). Validated as `create`; refused when
    /// a current object has the uid, or this store removed the object that had it.
    pub fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject> {
        let obj = boxery_api::normalize(serde_json::to_value(&obj)?)?;
        self.inner.write(false, |tx| tx.adopt(obj, uid))
    }

    /// The current object of a key (`None` for a name no object can have, such as `../x`).
    pub fn get(&self, kind: &str, name: &str) -> Result<Option<DynObject>> {
        if check_name(kind, name).is_err() {
            return Ok(None);
        }
        self.inner.with_reader(|c| {
            let json: Option<String> = c
                .prepare_cached("SELECT json FROM objects WHERE kind = ?1 AND name = ?2")?
                .query_row([kind, name], |r| r.get(0))
                .optional()?;
            Ok(match json {
                Some(j) => Some(serde_json::from_str(&j)?),
                None => None,
            })
        })
    }

    /// The objects of a kind whose labels match `selector`, sorted by name, and the revision
    /// they were read at (one read transaction: watching from it misses nothing).
    pub fn list(&self, kind: &str, selector: &Selector) -> Result<(Vec<DynObject>, u64)> {
        self.inner.with_reader(|c| {
            let tx = c.transaction()?;
            let rev = schema::meta(&tx, "revision")?;
            let mut out = Vec::new();
            {
                // Rows that cannot match are skipped before they are parsed: a `key=value`
                // requirement needs its pair in the row's text (see `label_needles`).
                let needles = label_needles(selector)?;
                let mut sql = String::from("SELECT json FROM objects WHERE kind = ?1");
                for i in 0..needles.len() {
                    sql.push_str(&format!(" AND instr(json, ?{}) > 0", i + 2));
                }
                // Sorted below, not by an `ORDER BY`: with one, SQLite re-prepared the
                // statement on every run with other parameters (the watch module says more).
                let mut stmt = tx.prepare_cached(&sql)?;
                let params: Vec<&dyn rusqlite::ToSql> =
                    std::iter::once(&kind as &dyn rusqlite::ToSql)
                        .chain(needles.iter().map(|n| n as &dyn rusqlite::ToSql))
                        .collect();
                let mut rows = stmt.query(params.as_slice())?;
                while let Some(r) = rows.next()? {
                    let obj: DynObject = serde_json::from_str(
                        r.get_ref(0)?.as_str().map_err(rusqlite::Error::from)?,
                    )?;
                    if selector.matches(&obj.metadata.labels) {
                        out.push(obj);
                    }
                }
            }
            tx.commit()?;
            out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            Ok((out, rev))
        })
    }

    /// The objects of a kind whose names start with `prefix`, sorted by name: a range of the
    /// primary key, so its cost follows what it returns, not the size of the kind (the Events
    /// of one object, whose names start with the object's name and a dot).
    pub fn list_named_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<DynObject>> {
        // Every name that starts with `prefix` sorts at or after it and before `prefix`
        // followed by the largest character (SQLite compares the UTF-8 bytes).
        let upper = format!("{prefix}\u{10FFFF}");
        self.inner.with_reader(|c| {
            let mut stmt = c.prepare_cached(
                // Sorted below, not by an `ORDER BY` (see `list`).
                "SELECT json FROM objects WHERE kind = ?1 AND name >= ?2 AND name < ?3",
            )?;
            let mut rows = stmt.query(rusqlite::params![kind, prefix, upper])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let obj: DynObject =
                    serde_json::from_str(r.get_ref(0)?.as_str().map_err(rusqlite::Error::from)?)?;
                if obj.metadata.name.starts_with(prefix) {
                    out.push(obj);
                }
            }
            out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            Ok(out)
        })
    }

    /// Replace an object's spec and its labels, annotations, finalizers and ownerReferences.
    /// The stored status, uid, creationTimestamp and deletionTimestamp are kept; `generation`
    /// grows when the spec changed. A `resourceVersion` in `obj` is a precondition (`Conflict`
    /// when the object moved on); without one the update is unconditional. Finalizers may not
    /// be added to an object being deleted. When the object is being deleted and no finalizer
    /// remains, it is removed (and what it owns is deleted): the removed object is returned.
    /// An update that changes nothing writes nothing and returns the stored object. A new
    /// ownerReference must name a current object's uid (`OwnerGone` otherwise).
    pub fn update(&self, obj: DynObject) -> Result<DynObject> {
        self.update_by(obj, UNNAMED_MANAGER)
    }

    /// [`Store::update`] by a named field manager: the fields it changes become its own
    /// (`metadata.managedFields`; docs/gitops.md, Field ownership).
    pub fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let obj = boxery_api::normalize(serde_json::to_value(&obj)?)?;
        self.inner.write(false, |tx| tx.update(obj, manager))
    }

    /// [`Store::update`] inside a transaction that is rolled back: the object as the update
    /// would store it (validated, defaulted, preconditions checked), nothing written.
    pub fn update_dry_run(&self, obj: DynObject) -> Result<DynObject> {
        self.update_dry_run_by(obj, UNNAMED_MANAGER)
    }

    /// [`Store::update_dry_run`] by a named field manager.
    pub fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let obj = boxery_api::normalize(serde_json::to_value(&obj)?)?;
        self.inner.write(true, |tx| tx.update(obj, manager))
    }

    /// Replace only `status` (with the same `resourceVersion` precondition as `update`);
    /// never bumps `generation`. Kinds without a status (`Event`) are refused as `Invalid`.
    pub fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        let obj = boxery_api::normalize(serde_json::to_value(&obj)?)?;
        self.inner.write(false, |tx| tx.update_status(obj))
    }

    /// Delete an object: while finalizers remain, set `deletionTimestamp` (once) and return
    /// `Marked`; otherwise remove it and return `Removed`. Removal cascades to every object
    /// whose ownerReferences name the removed object's uid, recursively, finalizers respected.
    /// A name no object can have is `Invalid`.
    pub fn delete(&self, kind: &str, name: &str) -> Result<DeleteOutcome> {
        check_name(kind, name)?;
        self.inner.write(false, |tx| tx.delete(kind, name))
    }

    /// Apply a set of manifests in one transaction, all or nothing. Absent objects are created
    /// with a [`LAST_APPLIED`] record (their status dropped); present ones get the manifest's
    /// spec, labels and annotations (system `boxery.dev/` annotations kept), keeping status,
    /// finalizers, ownerReferences and server fields; unchanged ones are not written. Objects
    /// being deleted are refused (`BeingDeleted`), as are two objects with the same kind and
    /// name (`Invalid`). With `prune`, objects of the kinds in the set that match the
    /// selector, carry a last-applied record and are not in the set are deleted. With
    /// `dry_run`, everything happens inside the transaction, which is then rolled back.
    pub fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        self.inner
            .write(opts.dry_run, |tx| apply::apply_all(tx, objs, opts))
    }

    /// The store's current revision (the last one written).
    pub fn revision(&self) -> Result<u64> {
        self.inner.with_reader(|c| Ok(schema::meta(c, "revision")?))
    }

    /// Every change after revision `from` (of one kind, or of all), in order, then each new
    /// change as it is committed, by this process or another. When `from` is below the
    /// compaction floor, the first and only item is `Err(TooOld)`: list again and watch from
    /// the list's revision. Any error ends the stream; resume from the last revision seen.
    /// The stream needs no particular runtime (it waits on a `tokio::sync::watch`).
    pub fn watch(
        &self,
        kind: Option<&str>,
        from: u64,
    ) -> futures::stream::BoxStream<'static, Result<(u64, WatchEvent)>> {
        self.inner.start_poller();
        watch::stream(self.inner.clone(), kind.map(str::to_string), from)
    }

    /// Delete log rows older than the newest `keep_revisions` revisions, in batches of a
    /// thousand rows, each its own short write transaction (writers wait at most one batch),
    /// raising the compaction floor as it goes. Returns the rows deleted.
    pub fn compact(&self, keep_revisions: u64) -> Result<u64> {
        let mut total = 0;
        loop {
            let (n, done) = compact::compact_batch(&mut lock(&self.inner.writer), keep_revisions)?;
            total += n;
            if done {
                return Ok(total);
            }
        }
    }

    /// The compaction floor: the log holds every change after it.
    pub fn compacted(&self) -> Result<u64> {
        self.inner
            .with_reader(|c| Ok(schema::meta(c, "compacted")?))
    }

    /// Try to take or renew the leader lock `lock` for `ttl`. Succeeds when nobody holds it,
    /// the lease expired (wall clock), `me` holds it, or the holder ran on this boot and its
    /// process is gone (or its pid was reused). Renew well within `ttl`.
    pub fn try_lead(&self, lock_name: &str, me: &Candidate, ttl: Duration) -> Result<Leadership> {
        leader::try_lead(&mut lock(&self.inner.writer), lock_name, me, ttl)
    }

    /// Who holds the lock now (`None`: it is free for the taking).
    pub fn leader(&self, lock_name: &str) -> Result<Option<String>> {
        self.inner.with_reader(|c| leader::holder(c, lock_name))
    }

    /// Give up the lock if `me` holds it (others may take it at once).
    pub fn resign(&self, lock_name: &str, me: &Candidate) -> Result<()> {
        leader::resign(&mut lock(&self.inner.writer), lock_name, me)
    }

    /// [`Store::get`], typed.
    pub fn get_as<R: Resource>(&self, name: &str) -> Result<Option<R>> {
        match self.get(R::INFO.kind, name)? {
            Some(o) => Ok(Some(o.to_typed()?)),
            None => Ok(None),
        }
    }

    /// [`Store::list`], typed (without the revision).
    pub fn list_as<R: Resource>(&self, selector: &Selector) -> Result<Vec<R>> {
        let (objs, _) = self.list(R::INFO.kind, selector)?;
        objs.iter()
            .map(|o| o.to_typed().map_err(StoreError::from))
            .collect()
    }

    /// [`Store::create`], typed.
    pub fn create_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self.create(DynObject::from_typed(obj)?)?.to_typed()?)
    }

    /// [`Store::update`], typed.
    pub fn update_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self.update(DynObject::from_typed(obj)?)?.to_typed()?)
    }

    /// [`Store::update_status`], typed.
    pub fn update_status_as<R: Resource>(&self, obj: &R) -> Result<R> {
        Ok(self
            .update_status(DynObject::from_typed(obj)?)?
            .to_typed()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(name: &str) -> DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": boxery_api::API_VERSION, "kind": "Vm", "metadata": {"name": name},
            "spec": {"source": {"image": "debian-12"}}
        }))
        .unwrap()
    }

    /// The store threads of this process (Linux keeps at most 15 bytes of a thread name).
    fn store_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|c| c.starts_with("boxery-poll") || c.starts_with("boxery-upkeep"))
            .count()
    }

    /// A store in memory is its own: two never share an object, it touches no file and
    /// starts no thread, and a watch of it is woken by its writes (no poller).
    #[tokio::test]
    async fn stores_in_memory_are_separate_and_start_no_threads() {
        use futures::StreamExt;
        let before = store_threads();
        let (a, b) = (
            Store::open_in_memory().unwrap(),
            Store::open_in_memory().unwrap(),
        );
        assert_ne!(a.uid(), b.uid());
        assert_ne!(a.path(), b.path());
        assert!(!a.path().exists(), "no file: {}", a.path().display());
        let mut w = a.watch(Some("Vm"), 0);
        let made = a.create(vm("x")).unwrap();
        assert_eq!(b.get("Vm", "x").unwrap(), None);
        let (rev, seen) = tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!((rev, seen), (made.metadata.rv(), WatchEvent::Added(made)));
        assert_eq!(store_threads(), before);
    }

    #[test]
    fn released_memory_keeps_one_idle_reader_and_reads_go_on() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(&d.path().join("s.db")).unwrap();
        s.create(vm("a")).unwrap();
        // Reads at once leave several idle readers behind.
        std::thread::scope(|t| {
            for _ in 0..6 {
                t.spawn(|| {
                    for _ in 0..50 {
                        s.get("Vm", "a").unwrap().unwrap();
                    }
                });
            }
        });
        s.inner.release_memory();
        assert!(lock(&s.inner.readers).len() <= IDLE_READERS_KEPT);
        assert_eq!(s.get("Vm", "a").unwrap().unwrap().metadata.name, "a");
        s.create(vm("b")).unwrap();
        assert_eq!(s.list("Vm", &Selector::default()).unwrap().0.len(), 2);
    }

    #[test]
    fn background_threads_compact_and_stop_with_the_last_handle() {
        let d = tempfile::tempdir().unwrap();
        let before = store_threads();
        let opts = StoreOptions {
            auto_compact: Some(AutoCompact {
                keep_revisions: 10,
                every: Duration::from_millis(100),
            }),
            ..Default::default()
        };
        let s = Store::open_with(&d.path().join("s.db"), opts).unwrap();
        // The poller starts with the first watch.
        drop(s.watch(None, 0));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        // A new thread names itself once it runs.
        while store_threads() < before + 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "a poller and an upkeep thread start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        for i in 0..50 {
            s.create(vm(&format!("v{i}"))).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while s.compacted().unwrap() < 40 {
            assert!(std::time::Instant::now() < deadline, "auto-compaction ran");
            std::thread::sleep(Duration::from_millis(20));
        }
        let w = s.watch(None, 45);
        let clone = s.clone();
        drop(s);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            store_threads(),
            before + 2,
            "a clone and a watch keep the store open"
        );
        drop((clone, w));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store_threads() > before {
            assert!(
                std::time::Instant::now() < deadline,
                "threads stop with the last handle"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn list_by_label_skips_rows_without_the_pair_and_checks_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(&d.path().join("s.db")).unwrap();
        let with = |name: &str, labels: serde_json::Value, annotations: serde_json::Value| {
            let mut o = vm(name);
            o.metadata.labels = serde_json::from_value(labels).unwrap();
            o.metadata.annotations = serde_json::from_value(annotations).unwrap();
            s.create(o).unwrap();
        };
        with(
            "a",
            serde_json::json!({"app": "x", "t": "v.1"}),
            serde_json::json!({}),
        );
        with("b", serde_json::json!({"app": "y"}), serde_json::json!({}));
        // The pair's text is in the object, but not among its labels.
        with("c", serde_json::json!({}), serde_json::json!({"app": "x"}));
        with("d", serde_json::json!({"app": "x"}), serde_json::json!({}));
        let names = |sel: &str| -> Vec<String> {
            let sel: Selector = sel.parse().unwrap();
            s.list("Vm", &sel)
                .unwrap()
                .0
                .into_iter()
                .map(|o| o.metadata.name)
                .collect()
        };
        assert_eq!(names("app=x"), ["a", "d"]);
        assert_eq!(names("app=x,t=v.1"), ["a"]);
        assert_eq!(names("app!=x"), ["b", "c"]);
        assert_eq!(names("app in (y)"), ["b"]);
        assert_eq!(names(""), ["a", "b", "c", "d"]);
    }
}
