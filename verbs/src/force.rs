//! `delete --force`: what is left of an object whose controller cannot finish deleting it,
//! dropped once the backend confirms the thing it stood for is gone.

use boxery_api::ForceDelete;
use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::error::{Result, VerbError};

/// `delete --force`: drop boxery's finalizer once the backend confirms the VM or image is gone
/// (removing it first when the backend can): what the kind's controller would have undone,
/// [`KindInfo::force_delete`](boxery_api::KindInfo::force_delete).
pub async fn force_delete(v: &crate::Verbs, kind: &str, name: &str) -> Result {
    // A lease never outlives its VM silently: it ends first, with an event.
    for l in crate::pools::end_leases_for(v, kind, name).await? {
        crate::notes::say(&format!(
            "lease/{l} ended: its {} was deleted with --force",
            kind.to_ascii_lowercase()
        ));
    }
    let store = v.home_store()?;
    let backend = v.env.backend_for(&**store).await?;
    let key = ObjectRef::new(kind, name);
    let uid = store.get(&key).await?.and_then(|o| o.metadata.uid);
    let undo = boxery_api::KINDS
        .iter()
        .find(|k| k.kind == kind)
        .map_or(ForceDelete::Finalizers, |k| k.force_delete);
    match undo {
        ForceDelete::BackendVm => {
            // Only what was made for this object: a VM of this name with another object's
            // mark is not removed (and the object is not dropped while it stands).
            let mine = match backend.get(name).await {
                Ok(Some(info)) => {
                    info.mark.is_none()
                        || boxery_backends::mark::Mark::is_for(info.mark.as_deref(), uid.as_deref())
                }
                _ => true,
            };
            if !mine {
                return Err(VerbError::failed(format!(
                    "the backend's VM {name} was made for another object than this Vm: nothing was removed or dropped; `boxery orphans` shows it"
                )));
            }
            // Out of force first, as the Vm finalizer does: its grants' entries, then its token.
            if let Some(uid) = uid.as_deref() {
                boxery_home::grants::remove_entries(&v.env.home, name, |e| e.vm_uid == uid)
                    .and_then(|()| boxery_home::tokens::revoke(&v.env.home, name, uid).map(drop))
                    .map_err(|e| {
                        VerbError::failed(format!(
                            "cannot revoke VM {name}'s grants and token ({e}); nothing was dropped"
                        ))
                    })?;
            }
            if let Err(e) = backend.remove(name).await {
                tracing::warn!(error = %e.chain(), "remove failed");
            }
            match backend.get(name).await {
                Ok(None) => {}
                Ok(Some(_)) => {
                    return Err(VerbError::failed(format!(
                        "the backend still has VM {name}; fix the backend and try again (nothing was dropped)"
                    )));
                }
                Err(e) => {
                    return Err(VerbError::failed(format!(
                        "cannot confirm VM {name} is gone ({}); nothing was dropped",
                        e.chain()
                    )));
                }
            }
            let _ = backend.cleanup_new(name).await;
        }
        ForceDelete::BackendImage => {
            if let Err(e) = backend.remove_image(name).await {
                tracing::warn!(error = %e.chain(), "remove_image failed");
            }
            match backend.images().await {
                Ok(list) if !list.iter().any(|i| i.name == name) => {}
                Ok(_) => {
                    return Err(VerbError::failed(format!(
                        "the backend still has image {name}; nothing was dropped"
                    )));
                }
                Err(e) => {
                    return Err(VerbError::failed(format!(
                        "cannot confirm image {name} is gone ({}); nothing was dropped",
                        e.chain()
                    )));
                }
            }
        }
        ForceDelete::GrantState => {
            // Revoked first: its entry leaves the grant state before the object goes.
            if let Some(g) = store.get_as::<boxery_api::Grant>(name).await?
                && let Some(uid) = g.metadata.uid.as_deref()
            {
                for vm in g.status.vm.iter().chain(g.spec.vm.iter()) {
                    boxery_home::grants::remove_entries(&v.env.home, vm, |e| e.uid == uid)
                        .map_err(|e| {
                            VerbError::failed(format!(
                                "cannot revoke grant {name} from the grant state ({e}); nothing was dropped"
                            ))
                        })?;
                }
            }
        }
        ForceDelete::Finalizers => {}
    }
    // Every finalizer goes, boxery's and any other (a finalizer nothing removes would keep
    // the object forever); the ones boxery does not own are named.
    for _ in 0..10 {
        let Some(mut obj) = store.get(&key).await? else {
            return Ok(());
        };
        let foreign: Vec<String> = obj
            .metadata
            .finalizers
            .iter()
            .filter(|f| !boxery_api::meta::finalizers::ALL.contains(&f.as_str()))
            .map(|f| boxery_api::name::shown(f))
            .collect();
        obj.metadata.finalizers.clear();
        match store.update(obj).await {
            Ok(_) | Err(boxery_store::StoreError::NotFound { .. }) => {
                if !foreign.is_empty() {
                    crate::notes::say(&format!(
                        "{kind}/{name}: dropped finalizers boxery does not own: {}",
                        foreign.join(", ")
                    ));
                }
                if store.get(&key).await?.is_some() {
                    return Err(VerbError::failed(format!(
                        "{kind} {name} is still in the store after its finalizers were dropped: nothing else was changed; `boxery describe {} {name}` shows it",
                        kind.to_ascii_lowercase()
                    )));
                }
                return Ok(());
            }
            Err(boxery_store::StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(VerbError::conflict(format!(
        "{kind} {name} kept changing; try again"
    )))
}
