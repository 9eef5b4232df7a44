//! `vm_lease`: take a VM from a warm pool for this session, as `boxery lease …` does (the same
//! verbs: `boxery_verbs::pools`).
//!
//! Guarantees: a lease acquired through a session is renewed by it (a
//! [`LeaseKeeper`](boxery_verbs::pools::LeaseKeeper), at a third of its duration) and
//! released when the session ends — stdin closes (`boxery mcp`), the HTTP session is deleted
//! or times out, the server shuts down, or it gets SIGINT/SIGTERM. The leased VM becomes the
//! session's default VM, and the tools reach it with the lease's key.
//! Caveats: SIGKILL releases nothing; such a lease expires after its duration.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::lease::LeasePhase;
use boxery_api::{Lease, Name};
use boxery_store::{ObjectRef, ObjectStoreExt};
use boxery_verbs::pools::{self, LeaseKeeper};
use boxery_verbs::wait::Until;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::lifecycle::bounded_wait;
use super::{Output, Session, ToolResult, clamp_timeout};
use boxery_verbs::VerbError;

/// A `vm_lease` verb (each is a `boxery lease` subcommand).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LeaseAction {
    /// Lease a free VM of `pool`; it becomes this session's default VM, is renewed while the
    /// session lives and released when it ends.
    Acquire,
    /// Renew a lease now (this session renews its own leases by itself).
    Renew,
    /// Release a lease: its VM is reset to its clean image and goes back to the pool.
    Release,
    /// List leases.
    List,
}

/// `vm_lease` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseArgs {
    /// acquire, renew, release or list.
    pub action: LeaseAction,
    /// The pool (acquire).
    pub pool: Option<String>,
    /// The lease (renew, release; default: this session's only lease).
    pub lease: Option<String>,
    /// How long the lease lasts unless renewed, in seconds (acquire; 60..28800; default: the
    /// pool's spec.lease.defaultTtlSeconds, 1800 unless the pool sets it).
    pub ttl_seconds: Option<u64>,
    /// Who holds it (acquire, renew; default $USER@hostname).
    pub holder: Option<String>,
    /// How long to wait for a free member (acquire) or for the release (default 300 s).
    pub timeout_seconds: Option<u64>,
}

/// A lease a session keeps alive.
pub(crate) struct Kept {
    pub(crate) holder: String,
    keeper: LeaseKeeper,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("holder", &self.holder)
            .finish()
    }
}

impl Kept {
    /// Stop renewing and release (delete) the lease.
    pub(crate) fn release(self) {
        self.keeper.release();
    }
}

/// The lease a renew or release names: one this session holds. A session never renews or
/// releases another session's (or a person's) lease: `boxery lease release` does that.
fn which_lease(session: &Session, lease: Option<String>) -> Result<String, VerbError> {
    let held = session.held_leases();
    if let Some(l) = lease.filter(|l| !l.is_empty()) {
        let name = Name::label(&l).map_err(|e| VerbError::invalid(format!("lease: {e}")))?;
        if !held.iter().any(|h| *h == *name) {
            return Err(VerbError::invalid(format!(
                "lease {name} is not held by this session: a session renews and releases only the leases it acquired (its holder can run `boxery lease release {name}`)"
            )));
        }
        return Ok(name.into_string());
    }
    match held.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(VerbError::invalid(
            "which lease? name it with `lease` (vm_lease {action: list} lists them)",
        )),
        many => Err(VerbError::invalid(format!(
            "which lease? this session holds {}",
            many.join(", ")
        ))),
    }
}

/// `vm_lease`.
pub async fn lease(session: Arc<Session>, a: LeaseArgs, ct: CancellationToken) -> ToolResult {
    let timeout = clamp_timeout(a.timeout_seconds, 300);
    match a.action {
        LeaseAction::Acquire => acquire(&session, a, timeout, &ct).await,
        LeaseAction::Renew => {
            let name = which_lease(&session, a.lease)?;
            let holder = a.holder.or_else(|| session.holder_of(&name));
            let l = pools::renew(session.verbs()?, &name, holder).await?;
            let until = l.status.expire_time.map(|t| t.to_string());
            Ok(Output::with_data(
                format!("lease/{name} renewed"),
                json!({"lease": name, "vm": l.status.vm, "renew_time": l.spec.renew_time.map(|t| t.to_string()), "expire_time": until}),
            ))
        }
        LeaseAction::Release => {
            let name = which_lease(&session, a.lease)?;
            let vm = session
                .verbs()?
                .store()
                .get_as::<Lease>(&name)
                .await?
                .and_then(|l| l.status.vm);
            session.let_go(&name);
            if vm.is_some() && session.default_vm() == vm {
                session.set_default_vm(None);
            }
            let target = [ObjectRef::new("Lease", name.clone())];
            let state = bounded_wait(&session, &target, &Until::Deleted, timeout, &ct).await?;
            let vm_text = vm
                .as_deref()
                .map(|v| {
                    format!(": {v} is being reset to its clean image and goes back to the pool")
                })
                .unwrap_or_default();
            let text = match state {
                None => format!("lease/{name} released{vm_text}"),
                Some(s) => format!("lease/{name} is being released{vm_text} ({s})"),
            };
            Ok(Output::with_data(text, json!({"lease": name, "vm": vm})))
        }
        LeaseAction::List => {
            let store = session.verbs()?.store();
            let (objs, _) = store.list("Lease", &Default::default()).await?;
            let mut text = super::table("lease", &objs, "no leases\n")?;
            let held = session.held_leases();
            if !held.is_empty() {
                text.push_str(&format!("held by this session: {}\n", held.join(", ")));
            }
            let leases: Vec<_> = store
                .list_as::<Lease>(&Default::default())
                .await?
                .into_iter()
                .map(|l| {
                    json!({
                        "lease": l.metadata.name,
                        "pool": l.spec.pool,
                        "holder": l.spec.holder_identity,
                        "phase": format!("{:?}", l.status.phase),
                        "vm": l.status.vm,
                        "held_by_this_session": held.contains(&l.metadata.name),
                        "bound": l.status.phase == LeasePhase::Bound,
                    })
                })
                .collect();
            Ok(Output::with_data(text, json!({"leases": leases})))
        }
    }
}

/// `vm_lease {action: acquire}`: write a lease, keep it, wait (bounded) until it binds.
async fn acquire(
    session: &Session,
    a: LeaseArgs,
    timeout: std::time::Duration,
    ct: &CancellationToken,
) -> ToolResult {
    let v = session.verbs()?;
    let pool = a.pool.filter(|p| !p.is_empty()).ok_or_else(|| {
        VerbError::invalid("acquire needs `pool` (vm_get {kind: pool} lists pools)")
    })?;
    let pool = Name::label(&pool).map_err(|e| VerbError::invalid(format!("pool: {e}")))?;
    pools::require_pool(v, &pool).await?;
    let input = pools::AcquireInput {
        pool: pool.clone(),
        ttl: a.ttl_seconds.map(Duration::from_secs),
        holder: a.holder,
        name: None,
        budget: None,
    };
    let got = pools::acquire(v, input).await?;
    let name = got.name.clone();
    let ttl = got.ttl;
    // Kept from the start: a session that ends while waiting releases it too.
    session.keep(
        &name,
        Kept {
            holder: got.holder.clone(),
            keeper: pools::keep(v, &name, ttl)?,
        },
    );
    let target = [ObjectRef::new("Lease", name.clone())];
    let bound = Until::JsonPath("{.status.phase}".into(), "Bound".into());
    let waited = bounded_wait(session, &target, &bound, timeout, ct).await;
    let state = match waited {
        Ok(None) => None,
        Ok(Some(state)) => Some(state),
        Err(e) => {
            session.let_go(&name);
            return Err(e);
        }
    };
    if let Some(state) = state {
        session.let_go(&name);
        return Err(VerbError::new(
            boxery_verbs::ErrorKind::Timeout,
            format!(
                "no member of pool {pool} was free within {}s, so lease {name} was released again ({state}); try later, or vm_describe {{kind: pool, name: {pool}}} to see its members",
                timeout.as_secs()
            ),
        ));
    }
    let l: Lease =
        v.store().get_as(&name).await?.ok_or_else(|| {
            VerbError::failed(format!("lease {name} vanished right after binding"))
        })?;
    let vm = l.status.vm.clone().unwrap_or_default();
    session.set_default_vm(Some(vm.clone()));
    let until = l.status.expire_time.map(|t| t.to_string());
    Ok(Output::with_data(
        format!(
            "lease/{name} bound: {vm} (pool {pool}) until {}; it is now this session's default VM. This session renews it every {}s and releases it when the session ends (vm_lease {{action: release}} releases it now: the VM is reset).",
            until.clone().unwrap_or_default(),
            (ttl / 3).as_secs().max(1)
        ),
        json!({
            "lease": name,
            "vm": vm,
            "pool": pool,
            "holder": got.holder,
            "expire_time": until,
            "key": got.key,
        }),
    ))
}
