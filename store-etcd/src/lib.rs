//! boxery's object store on etcd, for a fleet of hosts: the same `ObjectStore` as the SQLite
//! store, its write rules (`boxery_store::rules`) run over etcd transactions.
//!
//! # How it keeps the store's promises
//! - **Revisions.** The store keeps its own revision (`P/meta/rev`), one per changed object as
//!   in SQLite, in each object's `resourceVersion`. Every object write is one etcd transaction
//!   conditioned on that key's `mod_revision` ([`txn`]): writers are serial, as SQLite's
//!   `BEGIN IMMEDIATE` makes them, and a writer that lost the race runs its rules again on
//!   what won. (etcd's own revision counts transactions, not objects: an `apply_all` of three
//!   objects is one etcd revision and three store revisions, each watchable and resumable.)
//! - **Watch** reads the log (`P/l/REV`, written in the same transaction as the objects), then
//!   follows it with etcd's watch; revisions are dense, so a gap is compaction and is `TooOld`
//!   ([`watch`]).
//! - **Reads** are etcd's linearizable reads; `list` reads the kind and the revision in one
//!   etcd transaction.
//! - **Leader locks** are keys taken by compare-and-swap, with a wall-clock expiry ([`leader`]).
//!
//! # Limits
//! - etcd refuses a transaction of more than `--max-txn-ops` operations (128 unless set): a
//!   changed object takes two to five. A large `apply_all` or a cascade over many objects
//!   needs the server started with a higher limit (docs/scale-out.md).
//! - Compaction removes old log entries (`compact`); etcd's own history is compacted by the
//!   server (`--auto-compaction-retention`).
//! - Every call runs on the store's own runtime (one worker thread), so the store works from
//!   any runtime or none.

mod keys;
mod leader;
mod log;
mod ride;
mod txn;
mod watch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use boxery_api::{DynObject, Selector};
use boxery_store::rules::{Rules, apply_all};
use boxery_store::{
    ApplyAction, ApplyOptions, Candidate, DbError, DeleteOutcome, Leadership, ObjectRef,
    ObjectStore, Result, StoreError, WatchStream,
};
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use tokio::runtime::{Handle, Runtime};

use crate::keys::{Keys, range_end};
use crate::txn::{Commit, EtcdTxn};

/// How long a write keeps running again when other writers keep winning the race.
const CONTENDED_FOR: Duration = Duration::from_secs(30);

/// Where a store lives: etcd's endpoints, the store's prefix, and how to reach them over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `http://host:port` of each member (`https://` with [`EtcdConfig::tls`]).
    pub endpoints: Vec<String>,
    /// The prefix of every key of the store (`/boxery`).
    pub prefix: String,
    /// TLS to the members: the CA that signed their certificates, and this client's own
    /// certificate where the cluster asks for one (`--client-cert-auth`).
    pub tls: Option<EtcdTls>,
}

/// TLS settings, as PEM text.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s) the members' certificates must chain to.
    pub ca: String,
    /// This client's certificate and private key.
    pub identity: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the private key
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl EtcdConfig {
    /// `etcd://HOST:PORT[,HOST:PORT…][/PREFIX]`: the form [`EtcdStore::address`] gives.
    pub fn parse(address: &str) -> Result<EtcdConfig> {
        let bad = |why: &str| StoreError::Unavailable {
            why: format!(
                "{address:?} is not an etcd store's address ({why}): write etcd://HOST:PORT[,HOST:PORT…][/PREFIX]"
            ),
        };
        let rest = address
            .strip_prefix("etcd://")
            .ok_or_else(|| bad("it does not start with etcd://"))?;
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, "boxery"));
        let endpoints: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("http://{h}"))
            .collect();
        if endpoints.is_empty() {
            return Err(bad("no member"));
        }
        Ok(EtcdConfig {
            endpoints,
            prefix: format!("/{}", prefix.trim_matches('/')),
            tls: None,
        })
    }

    /// The address [`EtcdConfig::parse`] reads back (the TLS settings are not in it).
    pub fn address(&self) -> String {
        let hosts: Vec<&str> = self
            .endpoints
            .iter()
            .map(|e| {
                e.trim_start_matches("http://")
                    .trim_start_matches("https://")
            })
            .collect();
        format!("etcd://{}{}", hosts.join(","), self.prefix)
    }
}

/// What every clone of an [`EtcdStore`] shares.
pub(crate) struct Inner {
    client: Client,
    keys: Keys,
    uid: String,
    address: String,
    handle: Handle,
    /// Held by a write from its first read to its commit: this process's writers take turns
    /// instead of racing each other on the revision key (each lost race is a whole transaction
    /// run again; 8 writers racing got a third of one writer's rate). Other processes still
    /// race, and the compare-and-swap still decides.
    writing: std::sync::Mutex<()>,
    /// The store's own runtime, shut down with the last handle.
    _runtime: OwnRuntime,
}

/// A runtime shut down when dropped, without waiting for its tasks, from a thread of its own:
/// the last handle may go in any context, an async one, or one of this runtime's own threads
/// (a watch ending, a write whose caller went away), where a runtime may not be dropped.
struct OwnRuntime(Option<Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("boxery-etcd-stop".into())
                .spawn(move || rt.shutdown_background());
        }
    }
}

impl Inner {
    /// Run the call `f` makes on the store's runtime, again while etcd is unavailable
    /// ([`ride`]).
    async fn run<T: Send + 'static, F>(
        &self,
        f: impl Fn() -> F + Send + Sync + 'static,
    ) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>> + Send,
    {
        let call = async move { ride::retry(&f).await };
        self.handle.spawn(call).await.map_err(joined)?
    }

    async fn get_u64(&self, key: String) -> Result<u64> {
        let kv = self.client.kv_client();
        self.run(move || {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move {
                let r = kv.get(key, None).await.map_err(etcd_error)?;
                match r.kvs().first() {
                    Some(kv) => parse_u64(kv.value()),
                    None => Ok(0),
                }
            }
        })
        .await
    }

    pub(crate) async fn compacted_now(&self) -> Result<u64> {
        self.get_u64(self.keys.compacted()).await
    }
}

/// A handle on a store in etcd. Cheap to clone.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("address", &self.inner.address)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connect to the store `config` names, making it (its identity, revision 0) when its
    /// prefix holds none yet.
    pub async fn connect(config: &EtcdConfig) -> Result<EtcdStore> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("boxery-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Unavailable {
                why: format!("cannot start the etcd store's runtime: {e}"),
            })?;
        let handle = runtime.handle().clone();
        // dropped safely on every path, an error's included
        let runtime = OwnRuntime(Some(runtime));
        let keys = Keys::new(&config.prefix);
        let endpoints = config.endpoints.clone();
        let tls = config.tls.clone();
        let k = keys.clone();
        let (client, uid) = handle
            .spawn(async move {
                let mut options = etcd_client::ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(10));
                if let Some(tls) = tls {
                    let mut t = etcd_client::TlsOptions::new()
                        .ca_certificate(etcd_client::Certificate::from_pem(tls.ca));
                    if let Some((cert, key)) = tls.identity {
                        t = t.identity(etcd_client::Identity::from_pem(cert, key));
                    }
                    options = options.with_tls(t);
                }
                let client = Client::connect(&endpoints, Some(options))
                    .await
                    .map_err(|e| StoreError::OpenDb {
                        path: endpoints.join(","),
                        source: DbError::new(e),
                    })?;
                let made = uuid::Uuid::new_v4().to_string();
                let uid = ride::retry(|| {
                    let (mut client, k, made) = (client.clone(), k.clone(), made.clone());
                    async move {
                        client
                            .txn(
                                Txn::new()
                                    .when([Compare::version(k.uid(), CompareOp::Equal, 0)])
                                    .and_then([
                                        TxnOp::put(k.uid(), made, None),
                                        TxnOp::put(k.rev(), "0", None),
                                        TxnOp::put(k.compacted(), "0", None),
                                    ]),
                            )
                            .await
                            .map_err(etcd_error)?;
                        let r = client.get(k.uid(), None).await.map_err(etcd_error)?;
                        r.kvs()
                            .first()
                            .and_then(|kv| kv.value_str().ok())
                            .map(str::to_string)
                            .ok_or_else(|| {
                                db_failure("the store's identity vanished as it was made".into())
                            })
                    }
                })
                .await?;
                Ok::<_, StoreError>((client, uid))
            })
            .await
            .map_err(|e| StoreError::Unavailable {
                why: format!("connecting to etcd: {e}"),
            })??;
        Ok(EtcdStore {
            inner: Arc::new(Inner {
                client,
                address: config.address(),
                keys,
                uid,
                handle,
                writing: std::sync::Mutex::new(()),
                _runtime: runtime,
            }),
        })
    }

    /// Its address (`etcd://…/PREFIX`), for another process to connect.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// Run the write rules `f` in one transaction, again while other writers win the race;
    /// committed unless `dry_run`.
    async fn write<T: Send + 'static>(
        &self,
        dry_run: bool,
        f: impl Fn(&mut EtcdTxn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = self.inner.clone();
        let handle = inner.handle.clone();
        let work = handle.spawn_blocking(move || {
            let kv = inner.client.kv_client();
            let _turn = inner.writing.lock().unwrap_or_else(|e| e.into_inner());
            let started = Instant::now();
            loop {
                let mut tx = EtcdTxn::begin(&kv, &inner.handle, &inner.keys)?;
                let out = f(&mut tx)?;
                if dry_run {
                    return Ok(out);
                }
                match tx.commit()? {
                    Commit::Done => return Ok(out),
                    Commit::Moved if started.elapsed() < CONTENDED_FOR => {}
                    Commit::Moved => {
                        return Err(StoreError::Unavailable {
                            why: format!(
                                "other writers kept changing the store for {}s: try again",
                                CONTENDED_FOR.as_secs()
                            ),
                        });
                    }
                }
            }
        });
        work.await.map_err(joined)?
    }

    /// An object as every write takes it: validated and defaulted.
    fn normalized(obj: DynObject) -> Result<DynObject> {
        Ok(boxery_api::normalize(serde_json::to_value(&obj)?)?)
    }
}

/// A task of the store's runtime that did not finish: its panic goes on in the caller; a
/// runtime shutting down is `Unavailable`.
fn joined(e: tokio::task::JoinError) -> StoreError {
    if e.is_panic() {
        std::panic::resume_unwind(e.into_panic())
    }
    StoreError::Unavailable {
        why: "the etcd store is shutting down".into(),
    }
}

/// An etcd error as the store's: `Unavailable` when etcd could not be reached (retrying may
/// help), else the database's error.
pub(crate) fn etcd_error(e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    match &e {
        E::TransportError(_) | E::IoError(_) => StoreError::Unavailable {
            why: format!("etcd cannot be reached: {}", error_chain(&e)),
        },
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
            ) =>
        {
            StoreError::Unavailable {
                why: format!("etcd cannot be reached: {}", s.message()),
            }
        }
        _ => StoreError::Db(DbError::new(e)),
    }
}

/// An error and its causes, `: `-separated.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// A failure of the database that no retry mends (a record that is not what the store writes,
/// a transaction etcd refuses).
pub(crate) fn db_failure(why: String) -> StoreError {
    StoreError::Db(DbError::new(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        why,
    )))
}

/// A decimal number the store wrote.
pub(crate) fn parse_u64(v: &[u8]) -> Result<u64> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            db_failure(format!(
                "the store holds {:?} where a number belongs: is another program writing under its prefix?",
                String::from_utf8_lossy(v)
            ))
        })
}

#[async_trait]
impl ObjectStore for EtcdStore {
    fn uid(&self) -> &str {
        &self.inner.uid
    }

    async fn get(&self, key: &ObjectRef) -> Result<Option<DynObject>> {
        if boxery_store::check_name(&key.kind, &key.name).is_err() {
            return Ok(None);
        }
        let k = self.inner.keys.object(&key.kind, &key.name);
        let kv = self.inner.client.kv_client();
        self.inner
            .run(move || {
                let (mut kv, k) = (kv.clone(), k.clone());
                async move {
                    let r = kv.get(k, None).await.map_err(etcd_error)?;
                    match r.kvs().first() {
                        Some(kv) => Ok(Some(serde_json::from_slice(kv.value())?)),
                        None => Ok(None),
                    }
                }
            })
            .await
    }

    async fn list(&self, kind: &str, selector: &Selector) -> Result<(Vec<DynObject>, u64)> {
        let prefix = self.inner.keys.kind(kind);
        let rev = self.inner.keys.rev();
        let selector = selector.clone();
        let kv = self.inner.client.kv_client();
        self.inner
            .run(move || {
                let (mut kv, rev, prefix, selector) =
                    (kv.clone(), rev.clone(), prefix.clone(), selector.clone());
                async move {
                    // the kind and the revision at one etcd revision
                    let r = kv
                        .txn(Txn::new().and_then([
                            TxnOp::get(rev, None),
                            TxnOp::get(
                                prefix.as_str(),
                                Some(GetOptions::new().with_range(range_end(&prefix))),
                            ),
                        ]))
                        .await
                        .map_err(etcd_error)?;
                    let mut at = 0;
                    let mut out = Vec::new();
                    for (i, op) in r.op_responses().into_iter().enumerate() {
                        let TxnOpResponse::Get(g) = op else { continue };
                        if i == 0 {
                            if let Some(kv) = g.kvs().first() {
                                at = parse_u64(kv.value())?;
                            }
                            continue;
                        }
                        for kv in g.kvs() {
                            let obj: DynObject = serde_json::from_slice(kv.value())?;
                            if selector.matches(&obj.metadata.labels) {
                                out.push(obj);
                            }
                        }
                    }
                    Ok((out, at))
                }
            })
            .await
    }

    async fn list_named_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<DynObject>> {
        let start = format!("{}{prefix}", self.inner.keys.kind(kind));
        let kv = self.inner.client.kv_client();
        self.inner
            .run(move || {
                let (mut kv, start) = (kv.clone(), start.clone());
                async move {
                    let r = kv
                        .get(
                            start.as_str(),
                            Some(GetOptions::new().with_range(range_end(&start))),
                        )
                        .await
                        .map_err(etcd_error)?;
                    r.kvs()
                        .iter()
                        .map(|kv| Ok(serde_json::from_slice(kv.value())?))
                        .collect()
                }
            })
            .await
    }

    async fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let (obj, manager) = (Self::normalized(obj)?, manager.to_string());
        self.write(false, move |tx| tx.create(obj.clone(), &manager))
            .await
    }

    async fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject> {
        let (obj, uid) = (Self::normalized(obj)?, uid.to_string());
        self.write(false, move |tx| tx.adopt(obj.clone(), &uid))
            .await
    }

    async fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let (obj, manager) = (Self::normalized(obj)?, manager.to_string());
        self.write(false, move |tx| tx.update(obj.clone(), &manager))
            .await
    }

    async fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let (obj, manager) = (Self::normalized(obj)?, manager.to_string());
        self.write(true, move |tx| tx.update(obj.clone(), &manager))
            .await
    }

    async fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        let obj = Self::normalized(obj)?;
        self.write(false, move |tx| tx.update_status(obj.clone()))
            .await
    }

    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome> {
        boxery_store::check_name(&key.kind, &key.name)?;
        let (kind, name) = (key.kind.clone(), key.name.clone());
        self.write(false, move |tx| tx.delete(&kind, &name)).await
    }

    async fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        let opts = opts.clone();
        self.write(opts.dry_run, move |tx| apply_all(tx, objs.clone(), &opts))
            .await
    }

    async fn revision(&self) -> Result<u64> {
        self.inner.get_u64(self.inner.keys.rev()).await
    }

    fn watch(&self, kind: Option<&str>, from: u64) -> WatchStream {
        watch::stream(self.inner.clone(), kind.map(str::to_string), from)
    }

    async fn compact(&self, keep_revisions: u64) -> Result<u64> {
        let keys = self.inner.keys.clone();
        let kv = self.inner.client.kv_client();
        self.inner
            .run(move || {
                let (mut kv, keys) = (kv.clone(), keys.clone());
                async move {
                    loop {
                        let r = kv
                            .txn(Txn::new().and_then([
                                TxnOp::get(keys.rev(), None),
                                TxnOp::get(keys.compacted(), None),
                            ]))
                            .await
                            .map_err(etcd_error)?;
                        let mut vals = [(0u64, 0i64); 2];
                        for (i, op) in r.op_responses().into_iter().enumerate().take(2) {
                            if let TxnOpResponse::Get(g) = op
                                && let Some(kv) = g.kvs().first()
                            {
                                vals[i] = (parse_u64(kv.value())?, kv.mod_revision());
                            }
                        }
                        let [(rev, _), (floor, floor_mod)] = vals;
                        let new_floor = rev.saturating_sub(keep_revisions);
                        if new_floor <= floor {
                            return Ok(0);
                        }
                        // the floor first (one transaction): a watcher that finds an entry gone
                        // finds the floor that says why
                        let r = kv
                            .txn(
                                Txn::new()
                                    .when([Compare::mod_revision(
                                        keys.compacted(),
                                        CompareOp::Equal,
                                        floor_mod,
                                    )])
                                    .and_then([
                                        TxnOp::put(keys.compacted(), new_floor.to_string(), None),
                                        TxnOp::delete(
                                            keys.log_entry(floor + 1),
                                            Some(
                                                etcd_client::DeleteOptions::new()
                                                    .with_range(keys.log_entry(new_floor + 1)),
                                            ),
                                        ),
                                    ]),
                            )
                            .await
                            .map_err(etcd_error)?;
                        if !r.succeeded() {
                            // another compaction moved the floor: look again
                            continue;
                        }
                        let deleted = r
                            .op_responses()
                            .into_iter()
                            .find_map(|op| match op {
                                TxnOpResponse::Delete(d) => Some(d.deleted()),
                                _ => None,
                            })
                            .unwrap_or(0);
                        return Ok(deleted.max(0) as u64);
                    }
                }
            })
            .await
    }

    async fn compacted(&self) -> Result<u64> {
        self.inner.compacted_now().await
    }

    async fn was_removed(&self, uid: &str) -> Result<bool> {
        let k = self.inner.keys.tombstone(uid);
        let kv = self.inner.client.kv_client();
        self.inner
            .run(move || {
                let (mut kv, k) = (kv.clone(), k.clone());
                async move {
                    let r = kv.get(k, None).await.map_err(etcd_error)?;
                    Ok(!r.kvs().is_empty())
                }
            })
            .await
    }

    async fn try_lead(&self, lock: &str, me: &Candidate, ttl: Duration) -> Result<Leadership> {
        let (kv, key) = (self.inner.client.kv_client(), self.inner.keys.leader(lock));
        let me = me.clone();
        self.inner
            .run(move || leader::try_lead(kv.clone(), key.clone(), me.clone(), ttl))
            .await
    }

    async fn resign(&self, lock: &str, me: &Candidate) -> Result<()> {
        let (kv, key) = (self.inner.client.kv_client(), self.inner.keys.leader(lock));
        let me = me.clone();
        self.inner
            .run(move || leader::resign(kv.clone(), key.clone(), me.clone()))
            .await
    }

    async fn leader(&self, lock: &str) -> Result<Option<String>> {
        let (kv, key) = (self.inner.client.kv_client(), self.inner.keys.leader(lock));
        self.inner
            .run(move || leader::holder(kv.clone(), key.clone()))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_reads_back_as_written() {
        let c = EtcdConfig::parse("etcd://127.0.0.1:2379,127.0.0.1:2381/boxery/test").unwrap();
        assert_eq!(
            c.endpoints,
            ["http://127.0.0.1:2379", "http://127.0.0.1:2381"]
        );
        assert_eq!(c.prefix, "/boxery/test");
        assert_eq!(EtcdConfig::parse(&c.address()).unwrap(), c);
        assert_eq!(EtcdConfig::parse("etcd://h:1").unwrap().prefix, "/boxery");
        for bad in ["http://h:1", "etcd://", "etcd:///x"] {
            assert!(EtcdConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
