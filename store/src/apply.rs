//! `apply_all`: a set of manifests in one transaction, all or nothing, with last-applied
//! records, prune and dry run.

use std::collections::{BTreeSet, HashSet};

use boxery_api::validate::FieldError;
use boxery_api::{DynObject, ValidationError};
use serde_json::Value;

use crate::fields::{self, SYSTEM_PREFIX};
use crate::rules::{EventType, Rules, WriteTxn};
use crate::{ApplyAction, ApplyOptions, DeleteOutcome, LAST_APPLIED, Result, StoreError};

/// The manifest as recorded in `LAST_APPLIED`: as given, without status, the server's
/// metadata fields, or the record itself.
pub(crate) fn last_applied(obj: &DynObject) -> Result<Value> {
    let mut v = serde_json::to_value(obj)?;
    if let Some(o) = v.as_object_mut() {
        o.remove("status");
        if let Some(Value::Object(m)) = o.get_mut("metadata") {
            for k in [
                "uid",
                "resourceVersion",
                "generation",
                "creationTimestamp",
                "deletionTimestamp",
                "managedFields",
            ] {
                m.remove(k);
            }
            let empty = match m.get_mut("annotations") {
                Some(Value::Object(a)) => {
                    a.remove(LAST_APPLIED);
                    a.is_empty()
                }
                _ => false,
            };
            if empty {
                m.remove("annotations");
            }
        }
    }
    Ok(v)
}

/// Apply every object of the set inside `tx`, then prune. Returns what happened to each
/// object, in the order given, then the pruned ones.
pub fn apply_all<T: WriteTxn + ?Sized>(
    tx: &mut T,
    objs: Vec<DynObject>,
    opts: &ApplyOptions,
) -> Result<Vec<(ApplyAction, DynObject)>> {
    let mut seen = HashSet::new();
    for o in &objs {
        // The kind as stored (`vm` in a manifest is `Vm`), so that prune never takes an
        // object of the set for one that left it.
        let kind = boxery_api::lookup_kind(&o.kind).map_or(o.kind.as_str(), |k| k.kind);
        if !seen.insert((kind.to_string(), o.metadata.name.clone())) {
            return Err(StoreError::Invalid(ValidationError {
                object: o.key(),
                errors: vec![FieldError::new(
                    "metadata.name",
                    format!(
                        "{} appears more than once in the set being applied: keep one of them",
                        o.key()
                    ),
                )],
            }));
        }
    }
    for o in &objs {
        let invalid = |path: &str, message: String| {
            StoreError::Invalid(ValidationError {
                object: o.key(),
                errors: vec![FieldError::new(path, message)],
            })
        };
        if let Some(instead) = boxery_api::validate::KINDS
            .iter()
            .find(|k| k.kind == o.kind)
            .and_then(|k| k.controllers_only)
        {
            return Err(invalid(
                "kind",
                format!(
                    "{} objects are written by boxery's controllers only: {instead}",
                    o.kind
                ),
            ));
        }
        if let Some(f) = o
            .metadata
            .finalizers
            .iter()
            .find(|f| !boxery_api::meta::finalizers::ALL.contains(&f.as_str()))
        {
            return Err(invalid(
                "metadata.finalizers",
                format!(
                    "`{}` is not one of boxery's finalizers ({}): nothing would ever remove it, so the object could never be deleted; drop it",
                    boxery_api::name::shown(f),
                    boxery_api::meta::finalizers::ALL.join(", ")
                ),
            ));
        }
    }
    if opts.prune.as_ref().is_some_and(|s| s.is_empty()) {
        return Err(StoreError::Invalid(ValidationError {
            object: "apply --prune".into(),
            errors: vec![FieldError::new(
                "selector",
                "--prune needs a non-empty label selector (-l team=web): an empty one would prune every object an apply ever made".into(),
            )],
        }));
    }
    let mut kinds: BTreeSet<String> = seen.iter().map(|(kind, _)| kind.clone()).collect();
    if opts.prune_all_kinds {
        kinds.extend(
            boxery_api::validate::KINDS
                .iter()
                .filter(|k| k.controllers_only.is_none())
                .map(|k| k.kind.to_string()),
        );
    }
    let mut out = Vec::with_capacity(objs.len());
    for obj in objs {
        out.push(apply_one(tx, obj, opts)?);
    }
    if let Some(selector) = &opts.prune {
        for kind in &kinds {
            for obj in tx.load_kind(kind)? {
                if seen.contains(&(obj.kind.clone(), obj.metadata.name.clone()))
                    || obj.metadata.is_deleting()
                    || !obj.metadata.annotations.contains_key(LAST_APPLIED)
                    || !selector.matches(&obj.metadata.labels)
                {
                    continue;
                }
                let pruned = match tx.delete(&obj.kind, &obj.metadata.name)? {
                    DeleteOutcome::Marked(o) | DeleteOutcome::Removed(o) => o,
                };
                out.push((ApplyAction::Pruned, pruned));
            }
        }
    }
    Ok(out)
}

fn apply_one<T: WriteTxn + ?Sized>(
    tx: &mut T,
    obj: DynObject,
    opts: &ApplyOptions,
) -> Result<(ApplyAction, DynObject)> {
    let applier = opts.manager();
    let mut manifest = last_applied(&obj)?;
    let record = manifest.to_string();
    if let Some(m) = manifest.get_mut("metadata").and_then(Value::as_object_mut) {
        let ann = m
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(a) = ann.as_object_mut() {
            a.insert(LAST_APPLIED.into(), Value::String(record.clone()));
        }
    }
    let desired = boxery_api::normalize(manifest.clone())?;
    let given: DynObject = serde_json::from_value(manifest)?;
    let Some(cur) = tx.load(&desired.kind, &desired.metadata.name)? else {
        let mut created = desired;
        fields::own_applied(&mut created, &given, applier);
        return Ok((ApplyAction::Created, tx.insert(created)?));
    };
    if cur.metadata.is_deleting() {
        return Err(StoreError::BeingDeleted {
            kind: cur.kind,
            name: cur.metadata.name,
        });
    }
    let merged = fields::merge(&cur, &given, &desired, applier, opts.force_conflicts);
    if !merged.conflicts.is_empty() {
        return Err(StoreError::FieldConflicts {
            object: cur.key(),
            applier: applier.to_string(),
            conflicts: merged.conflicts,
        });
    }
    let mut new = merged.object;
    // The system's annotations are not owned by anyone: the manifest's are set as given.
    for (k, v) in &desired.metadata.annotations {
        if k.starts_with(SYSTEM_PREFIX) {
            new.metadata.annotations.insert(k.clone(), v.clone());
        }
    }
    new.metadata.annotations.insert(LAST_APPLIED.into(), record);
    let mut new = boxery_api::normalize(serde_json::to_value(&new)?)?;
    let spec_changed = !same_spec(&cur, &new);
    if spec_changed {
        crate::rules::refuse_spec_change(&cur, &new)?;
        new.metadata.generation = Some(cur.metadata.generation.unwrap_or(0) + 1);
    }
    if new == cur {
        return Ok((ApplyAction::Unchanged, cur));
    }
    tx.put(&mut new, EventType::Modified, Some(&cur))?;
    Ok((ApplyAction::Configured, new))
}

/// Whether two objects have the same fields other than metadata and status.
fn same_spec(a: &DynObject, b: &DynObject) -> bool {
    fn spec(o: &DynObject) -> impl Iterator<Item = (&String, &Value)> {
        o.rest.iter().filter(|(k, _)| k.as_str() != "status")
    }
    spec(a).eq(spec(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn last_applied_drops_status_server_fields_and_itself() {
        let obj: DynObject = serde_json::from_value(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
            "metadata": {"name": "a", "uid": "u", "resourceVersion": "3", "generation": 2,
                         "creationTimestamp": "2026-11-30T10:00:00Z", "labels": {"x": "y"},
                         "annotations": {LAST_APPLIED: "{}"}},
            "spec": {"source": {"image": "debian-12"}},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        assert_eq!(
            last_applied(&obj).unwrap(),
            json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
                   "metadata": {"name": "a", "labels": {"x": "y"}},
                   "spec": {"source": {"image": "debian-12"}}})
        );
    }
}
