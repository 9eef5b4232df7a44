//! Field ownership (`metadata.managedFields`), as Kubernetes' server-side apply keeps it: which
//! manager set which field, so that `apply` and `sync` change only what their manifests name,
//! remove only what they set before, and report a conflict instead of silently undoing a
//! field another manager (`stop`, `scale`, a tool, another source) set.
//!
//! The fields tracked are the user's: every leaf under the top-level fields other than
//! `status` (the `spec`), and each label and each annotation outside `boxery.dev/`. A leaf is
//! a scalar, a list (lists are atomic: boxery's lists have no merge keys) or an empty mapping.
//! Kinds only controllers write (`Event`) carry no ownership.
//!
//! - An update (any write but apply) by manager M: every leaf whose value it changed becomes
//!   M's alone; every leaf it removed leaves every manager.
//! - An apply by applier A of manifest fields F: a field of F whose value differs from the
//!   stored one while another manager owns it is a conflict (unless forced, which takes it
//!   over); the fields A owned before and F no longer names are removed unless another
//!   manager owns them too; F becomes A's Apply set. A field set to the value it already has
//!   is shared.

use std::collections::{BTreeMap, BTreeSet};

use boxery_api::{DynObject, ManagedFieldsEntry, ManagedFieldsOperation};
use serde_json::{Map, Value};

use crate::LAST_APPLIED;

/// The manager of writes that do not name one (controllers, tests, older callers).
pub const UNNAMED_MANAGER: &str = "boxery";

/// The applier `apply` uses unless told otherwise (`--field-manager`).
pub const APPLY_MANAGER: &str = "boxery-apply";

/// Annotations under this prefix are the system's: they carry no ownership, and apply keeps
/// the stored ones.
pub(crate) const SYSTEM_PREFIX: &str = "boxery.dev/";

/// A field: the keys from the object's top down (`["spec", "runStrategy"]`,
/// `["metadata", "labels", "team"]`).
pub(crate) type FieldPath = Vec<String>;

/// One field another manager owns that an apply would change.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FieldConflict {
    /// The field, dotted (`spec.runStrategy`, `metadata.labels.team`).
    pub field: String,
    /// The manager that owns it.
    pub manager: String,
    /// The value stored now (JSON), as that manager left it; `absent` when the field is not set.
    pub current: String,
    /// The value the manifest sets (JSON).
    pub applied: String,
}

/// Whether objects of `kind` carry field ownership (not the controllers-only kinds).
pub(crate) fn tracked(kind: &str) -> bool {
    boxery_api::lookup_kind(kind).is_some_and(|k| k.controllers_only.is_none())
}

/// Every tracked leaf of `obj` and its value.
pub(crate) fn leaves(obj: &DynObject) -> BTreeMap<FieldPath, Value> {
    let mut out = BTreeMap::new();
    for (k, v) in &obj.rest {
        if k != "status" {
            walk(&mut vec![k.clone()], v, &mut out);
        }
    }
    for (k, v) in &obj.metadata.labels {
        out.insert(label_path("labels", k), Value::String(v.clone()));
    }
    for (k, v) in &obj.metadata.annotations {
        if !k.starts_with(SYSTEM_PREFIX) {
            out.insert(label_path("annotations", k), Value::String(v.clone()));
        }
    }
    out
}

fn label_path(map: &str, key: &str) -> FieldPath {
    vec!["metadata".into(), map.into(), key.into()]
}

fn walk(path: &mut FieldPath, v: &Value, out: &mut BTreeMap<FieldPath, Value>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                path.push(k.clone());
                walk(path, child, out);
                path.pop();
            }
        }
        _ => {
            out.insert(path.clone(), v.clone());
        }
    }
}

/// The value at `path` in `obj` (a leaf or a mapping), if set.
pub(crate) fn get(obj: &DynObject, path: &[String]) -> Option<Value> {
    match path {
        [m, map, key] if m == "metadata" => match map.as_str() {
            "labels" => obj.metadata.labels.get(key).cloned().map(Value::String),
            "annotations" => obj
                .metadata
                .annotations
                .get(key)
                .cloned()
                .map(Value::String),
            _ => None,
        },
        [first, rest @ ..] => {
            let mut cur = obj.rest.get(first)?;
            for k in rest {
                cur = cur.as_object()?.get(k)?;
            }
            Some(cur.clone())
        }
        [] => None,
    }
}

/// Set the field at `path` in `obj` to `value`, making the mappings above it as needed.
pub(crate) fn set(obj: &mut DynObject, path: &[String], value: Value) {
    match path {
        [m, map, key] if m == "metadata" => {
            let text = match value {
                Value::String(s) => s,
                other => other.to_string(),
            };
            match map.as_str() {
                "labels" => {
                    obj.metadata.labels.insert(key.clone(), text);
                }
                "annotations" => {
                    obj.metadata.annotations.insert(key.clone(), text);
                }
                _ => {}
            }
        }
        [first, rest @ ..] => {
            let mut cur = obj
                .rest
                .entry(first.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            for k in rest {
                if !cur.is_object() {
                    *cur = Value::Object(Map::new());
                }
                cur = cur
                    .as_object_mut()
                    .expect("made a mapping above")
                    .entry(k.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
            }
            *cur = value;
        }
        [] => {}
    }
}

/// Remove the field at `path` from `obj`, and the mappings above it that it leaves empty
/// (below the top-level field, which stays).
pub(crate) fn remove(obj: &mut DynObject, path: &[String]) {
    match path {
        [m, map, key] if m == "metadata" => match map.as_str() {
            "labels" => {
                obj.metadata.labels.remove(key);
            }
            "annotations" => {
                obj.metadata.annotations.remove(key);
            }
            _ => {}
        },
        [first] => {
            obj.rest.remove(first);
        }
        [first, rest @ ..] => {
            if let Some(Value::Object(m)) = obj.rest.get_mut(first) {
                remove_in(m, rest);
            }
        }
        [] => {}
    }
}

/// Remove `path` under `m`; returns whether `m` is now empty.
fn remove_in(m: &mut Map<String, Value>, path: &[String]) -> bool {
    match path {
        [] => {}
        [last] => {
            m.remove(last);
        }
        [first, rest @ ..] => {
            let empty = match m.get_mut(first) {
                Some(Value::Object(child)) => remove_in(child, rest),
                _ => false,
            };
            if empty {
                m.remove(first);
            }
        }
    }
    m.is_empty()
}

/// `spec.runStrategy`, `metadata.labels.team`.
/// A key that holds a dot or a slash (`boxery.dev/applyset`) is bracketed, so the path reads
/// one way: `metadata.labels[boxery.dev/applyset]`.
pub(crate) fn dotted(path: &[String]) -> String {
    let mut out = String::new();
    for (i, k) in path.iter().enumerate() {
        if k.contains(['.', '/', '[', ']']) {
            out.push_str(&format!("[{k}]"));
        } else {
            if i > 0 {
                out.push('.');
            }
            out.push_str(k);
        }
    }
    out
}

/// The fields of a managedFields entry, dotted (`spec.runStrategy`), for people to read.
pub fn entry_fields(entry: &ManagedFieldsEntry) -> Vec<String> {
    from_fields_v1(&entry.fields_v1)
        .iter()
        .map(|p| dotted(p))
        .collect()
}

/// Whether two fields overlap: the same, or one inside the other.
fn overlaps(a: &[String], b: &[String]) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// The set of fields of a FieldsV1 tree (`{"f:spec": {"f:runStrategy": {}}}`); keys other
/// than `f:` ones (Kubernetes' `k:`, `v:`, `.`) are not boxery's and are skipped.
pub(crate) fn from_fields_v1(v: &Value) -> BTreeSet<FieldPath> {
    fn go(v: &Value, path: &mut FieldPath, out: &mut BTreeSet<FieldPath>) {
        let Some(m) = v.as_object() else { return };
        let children: Vec<_> = m
            .iter()
            .filter_map(|(k, c)| k.strip_prefix("f:").map(|k| (k, c)))
            .collect();
        if children.is_empty() {
            if !path.is_empty() {
                out.insert(path.clone());
            }
            return;
        }
        for (k, c) in children {
            path.push(k.to_string());
            go(c, path, out);
            path.pop();
        }
    }
    let mut out = BTreeSet::new();
    go(v, &mut Vec::new(), &mut out);
    out
}

/// The FieldsV1 tree of a set of fields.
pub(crate) fn to_fields_v1(set: &BTreeSet<FieldPath>) -> Value {
    let mut root = Map::new();
    for path in set {
        let mut cur = &mut root;
        for k in path {
            cur = cur
                .entry(format!("f:{k}"))
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
                .expect("only mappings are inserted");
        }
    }
    Value::Object(root)
}

/// The managed-fields entries of an object, decoded.
struct Owners {
    entries: Vec<(ManagedFieldsEntry, BTreeSet<FieldPath>)>,
}

impl Owners {
    fn of(obj: &DynObject) -> Owners {
        Owners {
            entries: obj
                .metadata
                .managed_fields
                .iter()
                .map(|e| (e.clone(), from_fields_v1(&e.fields_v1)))
                .collect(),
        }
    }

    fn position(&self, manager: &str, op: ManagedFieldsOperation) -> Option<usize> {
        self.entries
            .iter()
            .position(|(e, _)| e.manager == manager && e.operation == op)
    }

    /// Give `manager`'s `op` entry exactly `set` (made when absent, dropped when empty).
    fn put(&mut self, manager: &str, op: ManagedFieldsOperation, set: BTreeSet<FieldPath>) {
        match self.position(manager, op) {
            Some(i) => self.entries[i].1 = set,
            None if !set.is_empty() => self.entries.push((
                ManagedFieldsEntry {
                    manager: manager.to_string(),
                    operation: op,
                    api_version: boxery_api::API_VERSION.to_string(),
                    time: None,
                    fields_type: "FieldsV1".into(),
                    fields_v1: Value::Null,
                },
                set,
            )),
            None => {}
        }
    }

    /// Write back into `obj`: entries whose set changed get a new FieldsV1 and time; empty
    /// ones are dropped; untouched ones stay byte for byte (a no-op apply writes nothing).
    fn store(self, obj: &mut DynObject) {
        obj.metadata.managed_fields = self
            .entries
            .into_iter()
            .filter(|(_, set)| !set.is_empty())
            .map(|(mut e, set)| {
                if from_fields_v1(&e.fields_v1) != set {
                    e.fields_v1 = to_fields_v1(&set);
                    e.time = Some(boxery_api::now());
                }
                e
            })
            .collect();
    }
}

/// Record an update by `manager` that turned `old` (`None`: a create) into `new`: the leaves it
/// changed become its own, the ones it removed leave every manager. `new`'s own
/// `managedFields` are ignored (clients do not write them).
pub(crate) fn record_update(old: Option<&DynObject>, new: &mut DynObject, manager: &str) {
    new.metadata.managed_fields = old
        .map(|o| o.metadata.managed_fields.clone())
        .unwrap_or_default();
    if !tracked(&new.kind) {
        new.metadata.managed_fields.clear();
        return;
    }
    let before = old.map(leaves).unwrap_or_default();
    let after = leaves(new);
    let changed: Vec<&FieldPath> = after
        .iter()
        .filter(|(p, v)| before.get(*p) != Some(v))
        .map(|(p, _)| p)
        .collect();
    let removed: Vec<&FieldPath> = before.keys().filter(|p| !after.contains_key(*p)).collect();
    if changed.is_empty() && removed.is_empty() {
        return;
    }
    let mut owners = Owners::of(new);
    for (_, set) in &mut owners.entries {
        set.retain(|q| {
            !changed.iter().any(|p| overlaps(p, q)) && !removed.iter().any(|p| overlaps(p, q))
        });
    }
    let op = ManagedFieldsOperation::Update;
    let mut mine = owners
        .position(manager, op)
        .map(|i| owners.entries[i].1.clone())
        .unwrap_or_default();
    mine.extend(changed.into_iter().cloned());
    owners.put(manager, op, mine);
    owners.store(new);
}

/// The outcome of merging a manifest into a stored object.
pub(crate) struct Merged {
    /// The object with the manifest's fields set and the applier's dropped ones removed (not
    /// normalized yet: defaults for removed fields come back when it is).
    pub(crate) object: DynObject,
    /// The conflicts found (empty when forced or none).
    pub(crate) conflicts: Vec<FieldConflict>,
}

/// Server-side apply of `manifest` (as given, before defaults) over `cur` by `applier`;
/// `desired` is the normalized manifest, whose values are set (so that a value the schema
/// canonicalizes compares equal). With `force`, conflicting fields are taken from their
/// managers.
pub(crate) fn merge(
    cur: &DynObject,
    manifest: &DynObject,
    desired: &DynObject,
    applier: &str,
    force: bool,
) -> Merged {
    let applied: BTreeMap<FieldPath, Value> = leaves(manifest)
        .into_iter()
        .map(|(p, raw)| {
            let v = get(desired, &p).unwrap_or(raw);
            (p, v)
        })
        .collect();
    let mut owners = Owners::of(cur);
    let op = ManagedFieldsOperation::Apply;
    let before: BTreeSet<FieldPath> = match owners.position(applier, op) {
        Some(i) => owners.entries[i].1.clone(),
        // An object applied before boxery kept ownership: what the last apply named was the
        // applier's, as kubectl takes over a client-side apply's fields.
        None if !owners
            .entries
            .iter()
            .any(|(e, _)| e.operation == ManagedFieldsOperation::Apply) =>
        {
            last_applied_fields(cur)
        }
        None => BTreeSet::new(),
    };
    let others = |owners: &Owners, p: &[String]| -> Vec<String> {
        owners
            .entries
            .iter()
            .filter(|(e, set)| {
                !(e.manager == applier && e.operation == op) && set.iter().any(|q| overlaps(p, q))
            })
            .map(|(e, _)| e.manager.clone())
            .collect()
    };
    let mut conflicts = Vec::new();
    let mut taken: Vec<FieldPath> = Vec::new();
    for (p, want) in &applied {
        let live = get(cur, p);
        if live.as_ref() == Some(want) {
            continue;
        }
        let managers = others(&owners, p);
        if managers.is_empty() {
            continue;
        }
        taken.push(p.clone());
        if !force {
            for manager in managers {
                conflicts.push(FieldConflict {
                    field: dotted(p),
                    manager,
                    current: live
                        .as_ref()
                        .map(Value::to_string)
                        .unwrap_or_else(|| "absent".into()),
                    applied: want.to_string(),
                });
            }
        }
    }
    let mut object = cur.clone();
    for p in &taken {
        for (e, set) in &mut owners.entries {
            if !(e.manager == applier && e.operation == op) {
                set.retain(|q| !overlaps(p, q));
            }
        }
    }
    for p in before.iter().filter(|p| !applied.contains_key(*p)) {
        if others(&owners, p).is_empty() {
            remove(&mut object, p);
        }
    }
    for (p, v) in &applied {
        set(&mut object, p, v.clone());
    }
    owners.put(applier, op, applied.into_keys().collect());
    owners.store(&mut object);
    Merged { object, conflicts }
}

/// Give a newly created object's fields to `applier` as its Apply set: the fields `manifest`
/// (as given, before defaults) names.
pub(crate) fn own_applied(obj: &mut DynObject, manifest: &DynObject, applier: &str) {
    obj.metadata.managed_fields.clear();
    if !tracked(&obj.kind) {
        return;
    }
    let mut owners = Owners::of(obj);
    owners.put(
        applier,
        ManagedFieldsOperation::Apply,
        leaves(manifest).into_keys().collect(),
    );
    owners.store(obj);
}

/// The fields of the manifest recorded by the last apply, if any.
fn last_applied_fields(cur: &DynObject) -> BTreeSet<FieldPath> {
    cur.metadata
        .annotations
        .get(LAST_APPLIED)
        .and_then(|s| serde_json::from_str::<DynObject>(s).ok())
        .map(|m| leaves(&m).into_keys().collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> DynObject {
        serde_json::from_value(v).unwrap()
    }

    fn vm(spec: Value) -> DynObject {
        obj(json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
                   "metadata": {"name": "a"}, "spec": spec}))
    }

    fn owned(o: &DynObject, manager: &str) -> Vec<String> {
        o.metadata
            .managed_fields
            .iter()
            .filter(|e| e.manager == manager)
            .flat_map(|e| from_fields_v1(&e.fields_v1))
            .map(|p| dotted(&p))
            .collect()
    }

    #[test]
    fn dotted_paths_bracket_keys_with_dots() {
        let p = |v: &[&str]| dotted(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(p(&["spec", "runStrategy"]), "spec.runStrategy");
        assert_eq!(
            p(&["metadata", "labels", "boxery.dev/applyset"]),
            "metadata.labels[boxery.dev/applyset]"
        );
    }

    #[test]
    fn fields_v1_round_trips() {
        let set: BTreeSet<FieldPath> = [
            vec!["spec".to_string(), "a".into()],
            vec!["spec".into(), "b".into(), "c".into()],
            vec!["metadata".into(), "labels".into(), "x.io/y".into()],
        ]
        .into();
        let v = to_fields_v1(&set);
        assert_eq!(v["f:spec"]["f:b"]["f:c"], json!({}));
        assert_eq!(from_fields_v1(&v), set);
    }

    #[test]
    fn an_update_owns_what_it_changed_and_takes_it_from_others() {
        let mut a = vm(json!({"cpus": 1, "runStrategy": "Running"}));
        record_update(None, &mut a, "maker");
        assert_eq!(owned(&a, "maker"), ["spec.cpus", "spec.runStrategy"]);
        let mut b = vm(json!({"cpus": 1, "runStrategy": "Stopped"}));
        record_update(Some(&a), &mut b, "boxery-stop");
        assert_eq!(owned(&b, "maker"), ["spec.cpus"]);
        assert_eq!(owned(&b, "boxery-stop"), ["spec.runStrategy"]);
        let mut c = b.clone();
        record_update(Some(&b), &mut c, "noop");
        assert_eq!(c.metadata.managed_fields, b.metadata.managed_fields);
    }

    #[test]
    fn apply_removes_only_its_own_fields_and_reports_conflicts() {
        let m1 = vm(json!({"cpus": 1, "memory": "1Gi"}));
        let mut cur = m1.clone();
        record_update(None, &mut cur, "nobody");
        cur.metadata.managed_fields.clear();
        let first = merge(&cur, &m1, &m1, "git", false);
        assert!(first.conflicts.is_empty());
        let mut stopped = first.object.clone();
        stopped
            .rest
            .get_mut("spec")
            .unwrap()
            .as_object_mut()
            .unwrap()
            .insert("runStrategy".into(), json!("Stopped"));
        record_update(Some(&first.object), &mut stopped, "boxery-stop");
        // The manifest drops memory: removed; runStrategy (stop's) is kept.
        let m2 = vm(json!({"cpus": 1}));
        let second = merge(&stopped, &m2, &m2, "git", false);
        assert!(second.conflicts.is_empty());
        assert_eq!(
            second.object.rest["spec"],
            json!({"cpus": 1, "runStrategy": "Stopped"})
        );
        // Setting runStrategy against stop's value: a conflict naming stop.
        let m3 = vm(json!({"cpus": 1, "runStrategy": "Running"}));
        let third = merge(&second.object, &m3, &m3, "git", false);
        assert_eq!(third.conflicts.len(), 1);
        assert_eq!(third.conflicts[0].manager, "boxery-stop");
        assert_eq!(third.conflicts[0].field, "spec.runStrategy");
        let forced = merge(&second.object, &m3, &m3, "git", true);
        assert!(forced.conflicts.is_empty());
        assert_eq!(owned(&forced.object, "boxery-stop"), Vec::<String>::new());
        assert_eq!(
            owned(&forced.object, "git"),
            ["spec.cpus", "spec.runStrategy"]
        );
        // The same value is shared, not a conflict.
        let m4 = vm(json!({"cpus": 1, "runStrategy": "Stopped"}));
        let shared = merge(&second.object, &m4, &m4, "other", false);
        assert!(shared.conflicts.is_empty());
        assert_eq!(owned(&shared.object, "boxery-stop"), ["spec.runStrategy"]);
    }
}
