//! Pool and lease verbs: add a VM to a pool or take it out, acquire, renew and release leases
//! (the key pair of a lease is made on this host: [`boxery_hands::keys`]), and keep a lease
//! alive ([`LeaseKeeper`]).

use std::time::Duration;

use boxery_api::lease::{LeasePhase, LeaseSpec};
use boxery_api::meta::LocalObjectReference;
use boxery_api::pool::{MemberState, MemberStatus, PoolMember, PoolSpec};
use boxery_api::{Lease, Name, Pool};
use boxery_hands::keys::{forget_key, lease_dir, leases_root};
use boxery_store::{ObjectRef, ObjectStore, ObjectStoreExt, StoreError};
use std::sync::Arc;

use crate::error::{Result, VerbError};
use crate::{Verbs, Voice};

/// The default holder name: `$USER@hostname`.
pub fn default_holder() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "someone".into());
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{user}@{host}")
}

async fn edit_pool(v: &Verbs, name: &str, create: bool, f: impl Fn(&mut Pool) -> Result) -> Result {
    for _ in 0..10 {
        let (mut pool, exists) = match v.store().get_as::<Pool>(name).await? {
            Some(p) => (p, true),
            None if create => (
                Pool::new(
                    name,
                    PoolSpec {
                        template: None,
                        replicas: 0,
                        members: vec![],
                        lease: Default::default(),
                        update_strategy: Default::default(),
                        max_unavailable: None,
                        clean_state: Default::default(),
                        budget: None,
                    },
                ),
                false,
            ),
            None => {
                return Err(VerbError::not_found(format!(
                    "pool {name} not found: `boxery pool ls` lists pools"
                )));
            }
        };
        f(&mut pool)?;
        let r = if exists {
            v.store()
                .update_as_by(&pool, &v.manager("pool"))
                .await
                .map(drop)
        } else {
            v.store()
                .create_as_by(&pool, &v.manager("pool"))
                .await
                .map(drop)
        };
        match r {
            Ok(()) => return Ok(()),
            Err(StoreError::Conflict { .. }) | Err(StoreError::AlreadyExists { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(VerbError::conflict(format!(
        "pool {name} kept changing: try again"
    )))
}

/// `pool add POOL VM`: adopt an existing VM into a pool (made if missing).
pub async fn add(v: &Verbs, pool: &str, vm: &str) -> Result {
    let Some(member) = v.store().get_as::<boxery_api::Vm>(vm).await? else {
        return Err(VerbError::not_found(format!(
            "VM {vm} not found: `boxery get vms` lists them"
        )));
    };
    // A VM is in one pool at a time: two pools would lease it to two holders.
    let label = boxery_api::pool::POOL_LABEL;
    let mut elsewhere = member
        .metadata
        .labels
        .get(label)
        .filter(|p| **p != pool)
        .cloned();
    if elsewhere.is_none() {
        elsewhere = v
            .store()
            .list_as::<Pool>(&Default::default())
            .await
            .unwrap_or_default()
            .into_iter()
            .find(|p| {
                p.metadata.name != pool
                    && boxery_reconcilers::pool::wanted(p)
                        .iter()
                        .any(|(n, _)| *n == vm)
            })
            .map(|p| p.metadata.name);
    }
    if let Some(other) = elsewhere {
        return Err(VerbError::conflict(format!(
            "VM {vm} belongs to pool {other}: a VM is in one pool at a time (`boxery pool rm {other} {vm}` first)"
        )));
    }
    edit_pool(v, pool, true, |p| {
        if !p.spec.members.iter().any(|m| m.name == vm) {
            p.spec
                .members
                .push(LocalObjectReference { name: vm.into() });
        }
        Ok(())
    })
    .await
}

/// Pool `pool`'s members, by name: one row per `PoolMember` record, plus the rows of a member
/// table stored before records that the pool's controller has not moved yet. What `pool ls`
/// and `describe pool` (CLI and MCP) show.
pub async fn members(v: &Verbs, pool: &Pool) -> Result<Vec<MemberStatus>> {
    let selector = format!("{}={}", boxery_api::pool::POOL_LABEL, pool.metadata.name)
        .parse()
        .map_err(|_| VerbError::invalid("a pool name that is not a label value"))?;
    let mut out: Vec<MemberStatus> = v
        .store()
        .list_as::<PoolMember>(&selector)
        .await?
        .iter()
        .filter(|m| m.spec.pool == pool.metadata.name)
        .map(MemberStatus::of)
        .chain(pool.status.members.iter().cloned())
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `pool rm POOL VM`: take an adopted VM out of a pool (refused while it is leased).
pub async fn remove(v: &Verbs, pool: &str, vm: &str) -> Result {
    let held = v
        .store()
        .get_as::<PoolMember>(vm)
        .await?
        .filter(|m| {
            m.spec.pool == pool
                && matches!(m.status.state, MemberState::Acquiring | MemberState::Leased)
        })
        .and_then(|m| m.status.lease);
    edit_pool(v, pool, false, |p| {
        if let Some(lease) = &held {
            return Err(VerbError::conflict(format!(
                "{vm} is leased by {lease}: it leaves the pool only when free (`boxery lease release {lease}`)"
            )));
        }
        if !p.spec.members.iter().any(|m| m.name == vm) {
            return Err(VerbError::not_found(format!(
                "{vm} is not an adopted member of pool {pool} (members made from the template go with `replicas`)"
            )));
        }
        p.spec.members.retain(|m| m.name != vm);
        Ok(())
    })
    .await
}

/// The pool `pool`, which must exist (a tool acquires only from a pool that does).
pub async fn require_pool(v: &Verbs, pool: &str) -> Result {
    if v.store().get_as::<Pool>(pool).await?.is_some() {
        return Ok(());
    }
    let names: Vec<String> = v
        .store()
        .list_as::<Pool>(&Default::default())
        .await?
        .into_iter()
        .map(|p| p.metadata.name)
        .collect();
    Err(VerbError::not_found(match (v.voice, names.is_empty()) {
        (Voice::Tool, true) => format!(
            "pool {pool} not found: there are no pools (vm_apply a Pool makes one; docs/pools.md)"
        ),
        (Voice::Cli, true) => format!("pool {pool} not found: `boxery pool ls` lists pools"),
        (_, false) => format!("pool {pool} not found; known pools: {}", names.join(", ")),
    }))
}

/// A lease written by [`acquire`] (not yet bound: wait for `status.phase` Bound).
#[derive(Debug, Clone)]
pub struct Acquired {
    /// The lease's name.
    pub name: String,
    /// Who holds it.
    pub holder: String,
    /// The private key made for it on this host (`$BOXERY_HOME/leases/NAME/id_ed25519`).
    pub key: std::path::PathBuf,
    /// How long it lasts unless renewed (the one asked for, else the pool's default).
    pub ttl: Duration,
}

/// `lease acquire`'s input.
#[derive(Debug, Clone)]
pub struct AcquireInput {
    /// The pool.
    pub pool: Name,
    /// How long until it expires unless renewed (60 s to 8 h); `None`: the pool's
    /// `spec.lease.defaultTtlSeconds` (30 minutes unless the pool says otherwise).
    pub ttl: Option<Duration>,
    /// Who holds it (default `$USER@hostname`).
    pub holder: Option<String>,
    /// The lease's name (default: generated from the pool's).
    pub name: Option<Name>,
    /// Its budget (it can lower the pool's `spec.lease.budget`, not raise it).
    pub budget: Option<boxery_api::usage::LeaseBudget>,
}

/// `lease acquire`: make an ed25519 key pair on this host (the private key never leaves it)
/// and write a Lease on the pool with its public half. Returns at once; the lease binds when
/// the lease controller finds a free member (wait for `{.status.phase}` Bound).
pub async fn acquire(v: &Verbs, input: AcquireInput) -> Result<Acquired> {
    // Everything is checked before anything is made.
    let pool = Name::label(&input.pool).map_err(|e| VerbError::invalid(format!("pool: {e}")))?;
    let ttl = match input.ttl {
        Some(t) => t,
        None => Duration::from_secs(u64::from(match v.store().get_as::<Pool>(&pool).await? {
            // A default above the pool's ceiling is cut to it.
            Some(p) => p
                .spec
                .lease
                .default_ttl_seconds
                .min(p.spec.lease.max_ttl_seconds),
            None => boxery_api::pool::LeaseDefaults::default().default_ttl_seconds,
        })),
    };
    let secs = ttl.as_secs();
    if !(60..=28800).contains(&secs) {
        return Err(VerbError::invalid(format!(
            "the lease duration {} is out of range: use 60s to 8h",
            humantime::format_duration(ttl)
        )));
    }
    let holder = input.holder.unwrap_or_else(default_holder);
    boxery_api::name::check_text(&holder, 128)
        .map_err(|e| VerbError::invalid(format!("holder: {e}")))?;
    let name = match input.name {
        Some(n) => Name::label(&n).map_err(|e| VerbError::invalid(format!("lease name: {e}")))?,
        None => {
            let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
            // A pool name near the limit leaves no room for the suffix: cut it.
            let stem: String = pool.chars().take(63 - 9).collect();
            Name::label(&format!("{}-{suffix}", stem.trim_end_matches('-')))
                .map_err(|e| VerbError::invalid(format!("lease name: {e}")))?
        }
    };
    if v.store().get_as::<Lease>(&name).await?.is_some() {
        return Err(StoreError::AlreadyExists {
            kind: "Lease".into(),
            name: name.to_string(),
        }
        .into());
    }
    let home = v.home();
    let dir = lease_dir(home, &name);
    // A key pair left by an acquire that died before writing its Lease is stale.
    forget_key(home, &name);
    std::fs::create_dir_all(leases_root(home))?;
    std::fs::create_dir(&dir)?;
    let key = dir.join("id_ed25519");
    let out = tokio::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C"])
        .arg(format!("boxery-lease-{name}"))
        .arg("-f")
        .arg(&key)
        .output()
        .await
        .map_err(|e| VerbError::failed(format!("cannot run ssh-keygen: {e}")))?;
    if !out.status.success() {
        return Err(VerbError::failed(format!(
            "ssh-keygen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let public = std::fs::read_to_string(dir.join("id_ed25519.pub"))?
        .trim()
        .to_string();
    let spec = LeaseSpec {
        pool: pool.to_string(),
        holder_identity: holder.clone(),
        lease_duration_seconds: secs as u32,
        renew_time: None,
        public_key: public,
        budget: input.budget,
    };
    if let Err(e) = v
        .store()
        .create_as_by(&Lease::new(&name, spec), &v.manager("lease"))
        .await
    {
        if !matches!(e, StoreError::AlreadyExists { .. }) {
            forget_key(home, &name);
        }
        return Err(e.into());
    }
    Ok(Acquired {
        name: name.into_string(),
        holder,
        key,
        ttl,
    })
}

/// Keep lease `name` alive (renewed every third of `ttl`) until the keeper is dropped, which
/// releases it.
pub fn keep(v: &Verbs, name: &str, ttl: Duration) -> Result<LeaseKeeper> {
    Ok(LeaseKeeper::start(v.store_arc(), name, ttl))
}

/// Keeps a lease alive while its owner runs: renews at a third of its duration, releases
/// (deletes) it when dropped.
pub struct LeaseKeeper {
    store: Arc<dyn ObjectStore>,
    name: String,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseKeeper {
    /// Start renewing `name` every `duration / 3` (needs a tokio runtime).
    pub fn start(store: Arc<dyn ObjectStore>, name: &str, duration: Duration) -> Self {
        let (s, n) = (store.clone(), name.to_string());
        let task = tokio::spawn(async move {
            let every = (duration / 3).max(Duration::from_secs(1));
            loop {
                tokio::time::sleep(every).await;
                match set_renew_time(&*s, &n).await {
                    Ok(_) => {}
                    // Released from elsewhere (`boxery lease release`): nothing left to keep.
                    Err(StoreError::NotFound { .. }) => return,
                    Err(e) => tracing::warn!(lease = %n, error = %e, "renewing the lease failed"),
                }
            }
        });
        LeaseKeeper {
            store,
            name: name.to_string(),
            task,
        }
    }

    /// Stop renewing and release the lease.
    pub fn release(self) {
        // Drop does it.
    }
}

impl Drop for LeaseKeeper {
    /// The release is waited for (not left to a task a closing runtime might never run): a
    /// session that ends gives its VM back at once.
    fn drop(&mut self) {
        self.task.abort();
        let key = ObjectRef::of::<Lease>(self.name.as_str());
        let _ = futures::executor::block_on(self.store.delete(&key));
    }
}

/// Set `spec.renewTime` to now, re-reading on a conflict.
async fn set_renew_time(store: &dyn ObjectStore, name: &str) -> Result<Lease, StoreError> {
    loop {
        let Some(mut l) = store.get_as::<Lease>(name).await? else {
            return Err(StoreError::NotFound {
                kind: "Lease".into(),
                name: name.into(),
                plural: "leases".into(),
            });
        };
        l.spec.renew_time = Some(boxery_api::now());
        match store.update_as(&l).await {
            Err(StoreError::Conflict { .. }) => continue,
            other => return other,
        }
    }
}

/// `lease renew`: refused for someone else's lease (`holder`, default `$USER@hostname`) and
/// for one that expired.
pub async fn renew(v: &Verbs, name: &str, holder: Option<String>) -> Result<Lease> {
    let l: Lease = v.store().get_as(name).await?.ok_or_else(|| {
        VerbError::not_found(format!("lease {name} not found: `boxery lease ls`"))
    })?;
    let me = holder.unwrap_or_else(default_holder);
    if l.spec.holder_identity != me {
        return Err(VerbError::conflict(format!(
            "lease {name} is held by {}, not {me}: only its holder renews it",
            l.spec.holder_identity
        )));
    }
    if l.status.phase.ended() {
        let why = match l.status.phase {
            LeasePhase::Lost => "was lost (its VM is gone)",
            _ => "has expired",
        };
        return Err(VerbError::conflict(format!(
            "lease {name} {why} and cannot be renewed: release it and acquire a new one"
        )));
    }
    Ok(set_renew_time(v.store(), name).await?)
}

/// `lease release`: delete the Lease (its VM is reset and goes back to the pool) and the key
/// pair made for it here.
pub async fn release(v: &Verbs, name: &Name) -> Result {
    match v
        .store()
        .delete(&ObjectRef::of::<Lease>(name.to_string()))
        .await
    {
        Ok(_) => {
            forget_key(v.home(), name);
            Ok(())
        }
        Err(StoreError::NotFound { .. }) => Err(VerbError::not_found(format!(
            "lease {name} not found: `boxery lease ls` lists leases"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// `delete --force` of a Vm or a Pool: first end every lease holding that VM (or a member of
/// that pool), each `Lost` with reason `ForceDeleted` and a Warning event, its token revoked
/// and its member moved on ([`boxery_reconcilers::lease::end_now`]). Returns the leases
/// ended. Other kinds: nothing.
pub async fn end_leases_for(v: &Verbs, kind: &str, name: &str) -> Result<Vec<String>> {
    if kind != "Vm" && kind != "Pool" {
        return Ok(Vec::new());
    }
    let leases = v.store().list_as::<Lease>(&Default::default()).await?;
    let recorder = boxery_controller::Recorder::new(v.store_arc(), "boxery");
    let mut ended = Vec::new();
    for l in leases {
        let hit = if kind == "Vm" {
            l.status.vm.as_deref() == Some(name)
        } else {
            l.spec.pool == name
        };
        if !hit || l.status.phase.ended() || l.status.vm.is_none() {
            continue;
        }
        let msg = format!(
            "{} {name} was deleted with --force: the lease ended and holds nothing",
            kind.to_ascii_lowercase()
        );
        if boxery_reconcilers::lease::end_now(
            v.store(),
            v.home(),
            &recorder,
            &l.metadata.name,
            LeasePhase::Lost,
            boxery_api::conditions::reasons::FORCE_DELETED,
            &msg,
        )
        .await
        .map_err(|e| {
            VerbError::failed(format!("ending lease {}: {}", l.metadata.name, e.chain()))
        })? {
            ended.push(l.metadata.name);
        }
    }
    Ok(ended)
}

/// Forget the key pair made here for a lease a session let go (the keeper released it).
pub fn forget(v: &Verbs, name: &str) {
    if let Ok(n) = Name::label(name) {
        forget_key(v.home(), &n);
    }
}
