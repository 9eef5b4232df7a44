//! What a token's scope lets it reach: `read` reads everything, `full` does everything, and
//! `lease:NAME` reaches only its lease and the VM the lease holds, while the lease is Bound.
//! Which fields a reached object's writer may change is `boxery_store::guard`'s table.

use boxery_api::{KindInfo, Lease, Resource};
use boxery_store::ObjectStoreExt;

use crate::Shared;
use crate::status::Failure;
use crate::tokens::{Caller, Scope};

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// get, list, watch.
    Read,
    /// create.
    Create,
    /// update, patch.
    Write,
    /// delete.
    Delete,
}

/// The objects a caller may see: `None` for all, else `(kind, name)` pairs.
pub async fn visible(
    sh: &Shared,
    caller: &Caller,
) -> Result<Option<Vec<(String, String)>>, Failure> {
    match &caller.scope {
        Scope::Read | Scope::Full => Ok(None),
        Scope::Lease(l) => Ok(Some(lease_objects(sh, caller, l).await?)),
    }
}

/// Whether an object is among `visible` (an Event: when what it is about is).
pub fn sees(visible: &Option<Vec<(String, String)>>, o: &boxery_api::DynObject) -> bool {
    let Some(v) = visible else {
        return true;
    };
    let (kind, name) = if o.kind == "Event" {
        let about = &o.rest["involvedObject"];
        (
            about["kind"].as_str().unwrap_or_default(),
            about["name"].as_str().unwrap_or_default(),
        )
    } else {
        (o.kind.as_str(), o.metadata.name.as_str())
    };
    v.iter().any(|(k, n)| k == kind && n == name)
}

/// The objects a caller may list of `kind`: as [`visible`], but a lease token whose lease is
/// gone lists no leases (its own is deleted: an empty list, as Kubernetes answers after a
/// delete, so `kubectl delete lease NAME` sees it gone and returns) rather than a 403.
pub async fn visible_in_list(
    sh: &Shared,
    caller: &Caller,
    kind: &str,
) -> Result<Option<Vec<(String, String)>>, Failure> {
    match &caller.scope {
        Scope::Lease(l) if kind == Lease::INFO.kind => {
            Ok(Some(lease_reach(sh, caller, l).await?.unwrap_or_default()))
        }
        _ => visible(sh, caller).await,
    }
}

/// The lease and its VM, or 403 when the lease is gone or not Bound.
async fn lease_objects(
    sh: &Shared,
    caller: &Caller,
    lease: &str,
) -> Result<Vec<(String, String)>, Failure> {
    lease_reach(sh, caller, lease)
        .await?
        .ok_or_else(|| gone(caller, lease))
}

/// The 403 of a lease token whose lease no longer exists.
fn gone(caller: &Caller, lease: &str) -> Failure {
    Failure::forbidden(format!(
        "token {} is scoped to lease {lease}, which does not exist (any more)",
        caller.name
    ))
}

/// The lease and its VM; `None` when the lease does not exist (any more), 403 when it ended.
async fn lease_reach(
    sh: &Shared,
    caller: &Caller,
    lease: &str,
) -> Result<Option<Vec<(String, String)>>, Failure> {
    let Some(l) = sh.verbs.store().get_as::<Lease>(lease).await? else {
        return Ok(None);
    };
    let phase = l.status.phase;
    if phase.ended() {
        return Err(Failure::forbidden(format!(
            "token {} is scoped to lease {lease}, which has ended ({phase:?})",
            caller.name
        )));
    }
    let mut out = vec![(Lease::INFO.kind.to_string(), lease.to_string())];
    if let Some(vm) = l.status.vm {
        out.push(("Vm".to_string(), vm));
    }
    Ok(Some(out))
}

/// Whether `caller` may do `access` to `info` (`name`: one object; `None`: the collection).
pub async fn allow(
    sh: &Shared,
    caller: &Caller,
    access: Access,
    info: &KindInfo,
    name: Option<&str>,
) -> Result<(), Failure> {
    match &caller.scope {
        Scope::Full => Ok(()),
        Scope::Read if access == Access::Read => Ok(()),
        Scope::Read => Err(Failure::forbidden(format!(
            "token {} has scope read: it may get, list and watch, not change anything (a person makes a full token with `boxery kubeconfig --scope full`)",
            caller.name
        ))),
        Scope::Lease(l) => {
            let Some(mine) = lease_reach(sh, caller, l).await? else {
                // Its own lease, deleted (released): reading it finds it gone (404, an empty
                // list), as after any delete, rather than a 403; everything else is refused.
                let own = access == Access::Read
                    && info.kind == Lease::INFO.kind
                    && name.is_none_or(|n| n == l);
                return if own { Ok(()) } else { Err(gone(caller, l)) };
            };
            let ok = match (access, name) {
                // a collection: read it, filtered to what the lease reaches
                (Access::Read, None) => {
                    info.kind == "Vm" || info.kind == "Lease" || info.kind == "Event"
                }
                (Access::Read | Access::Write, Some(n)) => {
                    mine.iter().any(|(k, m)| k == info.kind && m == n)
                }
                // its own lease: a release
                (Access::Delete, Some(n)) => info.kind == Lease::INFO.kind && n == l,
                _ => false,
            };
            if ok {
                Ok(())
            } else {
                Err(Failure::forbidden(format!(
                    "token {} is scoped to lease {l}: it reaches the lease and its VM only, creates nothing and deletes nothing but its lease (a release); what it may change on them is in docs/api.md",
                    caller.name
                )))
            }
        }
    }
}
