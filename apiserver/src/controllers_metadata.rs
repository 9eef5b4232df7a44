//! `metadata.finalizers` and `metadata.ownerReferences` of a stored object are boxery's
//! controllers' (they add and remove their own: a VM's disk, a pool's members). An apply or an
//! update through the API that would add one is refused, naming the field (422 Invalid), rather
//! than answered `serverside-applied` while the store keeps the stored list and drops the
//! addition in silence. What a manifest leaves out is not a removal: as Kubernetes' apply
//! merges these lists item by item, an applier that never set an item does not remove it by
//! not naming it, and an update keeps them as stored (docs/api.md).

use boxery_api::DynObject;
use boxery_api::validate::FieldError;
use boxery_store::StoreError;

/// Refused when `given` (an apply's manifest, an update's body) names a finalizer or an owner
/// reference `cur` (the stored object) lacks.
pub fn no_additions(cur: &DynObject, given: &DynObject) -> Result<(), StoreError> {
    let mut errors = Vec::new();
    let what = format!("{}/{}", cur.kind, cur.metadata.name);
    for f in &given.metadata.finalizers {
        if !cur.metadata.finalizers.contains(f) {
            errors.push(FieldError::new(
                "metadata.finalizers",
                format!(
                    "`{}` is not one of {what}'s finalizers, and a client cannot add one: they are boxery's controllers' (each adds and removes its own); nothing was changed",
                    boxery_api::name::shown(f)
                ),
            ));
        }
    }
    for r in &given.metadata.owner_references {
        if !cur
            .metadata
            .owner_references
            .iter()
            .any(|o| o.uid == r.uid && o.kind == r.kind && o.name == r.name)
        {
            errors.push(FieldError::new(
                "metadata.ownerReferences",
                format!(
                    "{} {} (uid {}) is not one of {what}'s owners, and a client cannot add one: owner references are set by boxery's controllers (a pool's members); nothing was changed",
                    boxery_api::name::shown(&r.kind),
                    boxery_api::name::shown(&r.name),
                    boxery_api::name::shown(&r.uid)
                ),
            ));
        }
    }
    if errors.is_empty() {
        return Ok(());
    }
    Err(StoreError::Invalid(boxery_api::ValidationError {
        object: what,
        errors,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(meta: serde_json::Value) -> DynObject {
        let mut m = json!({"name": "a"});
        m.as_object_mut()
            .unwrap()
            .extend(meta.as_object().unwrap().clone());
        serde_json::from_value(
            json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Vm", "metadata": m}),
        )
        .unwrap()
    }

    #[test]
    fn only_additions_are_refused() {
        let cur = vm(json!({"finalizers": ["boxery.dev/vm"]}));
        assert!(no_additions(&cur, &vm(json!({}))).is_ok());
        assert!(no_additions(&cur, &vm(json!({"finalizers": ["boxery.dev/vm"]}))).is_ok());
        let refused =
            |given| crate::status::Failure::from_store(&no_additions(&cur, &given).unwrap_err());
        let e = refused(vm(json!({"finalizers": ["boxery.dev/pool"]})));
        assert_eq!(e.code, 422);
        assert!(e.message.contains("metadata.finalizers"), "{}", e.message);
        let owner = json!({"ownerReferences": [{"apiVersion": "boxery.dev/v1alpha1", "kind": "Pool", "name": "p", "uid": "u"}]});
        let e = refused(vm(owner.clone()));
        assert!(
            e.message.contains("metadata.ownerReferences"),
            "{}",
            e.message
        );
        assert!(no_additions(&vm(owner.clone()), &vm(owner)).is_ok());
    }
}
