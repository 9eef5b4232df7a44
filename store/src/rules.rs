//! The store's write rules, whatever keeps the objects: server fields, generations,
//! preconditions, field ownership, finalizers and the ownerReference cascade, written once over
//! [`WriteTxn`], the small transaction interface a store implements (SQLite's in
//! `crate::write`). `apply.rs` is written over it too.
//!
//! A [`WriteTxn`] is one all-or-nothing transaction that reads what it will write: what it
//! loads stays as loaded until it commits (SQLite holds its write lock; a store with optimistic
//! transactions checks at commit that nothing it read has moved, and runs the rules again when
//! something has). Each object it stores or erases gets the next revision of the store.

use boxery_api::validate::FieldError;
use boxery_api::{DynObject, ValidationError};
use serde_json::{Map, Value};

pub use crate::apply::apply_all;
use crate::{DeleteOutcome, Result, StoreError};

/// The type of a change, as the log and watchers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Removed.
    Deleted,
}

impl EventType {
    /// Its name in the log (`Added`, `Modified`, `Deleted`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "Added",
            EventType::Modified => "Modified",
            EventType::Deleted => "Deleted",
        }
    }
}

/// What a store gives the write rules: the reads and the two writes of one transaction.
pub trait WriteTxn {
    /// The current object of a key.
    fn load(&self, kind: &str, name: &str) -> Result<Option<DynObject>>;

    /// Whether a key has a current object (a store may answer it without reading the object).
    fn exists(&self, kind: &str, name: &str) -> Result<bool> {
        Ok(self.load(kind, name)?.is_some())
    }

    /// Every current object of a kind, sorted by name.
    fn load_kind(&self, kind: &str) -> Result<Vec<DynObject>>;

    /// Whether a current object has this uid.
    fn uid_exists(&self, uid: &str) -> Result<bool>;

    /// Whether this store removed an object of a [`crate::TOMBSTONED_KINDS`] kind with this
    /// uid.
    fn was_removed(&self, uid: &str) -> Result<bool>;

    /// The keys of the current objects that name `uid` among their ownerReferences, in
    /// (kind, name) order.
    fn owned_by(&self, uid: &str) -> Result<Vec<(String, String)>>;

    /// Store `obj` as the current object of its key at the next revision (set as its
    /// `resourceVersion`) and log it as `ev`; `old` is the object it replaces, if any (for the
    /// owner index). The rules checked it ([`Rules::put`]).
    fn store_object(
        &mut self,
        obj: &mut DynObject,
        ev: EventType,
        old: Option<&DynObject>,
    ) -> Result<()>;

    /// Remove the current object of `obj`'s key at the next revision (set as `obj`'s
    /// `resourceVersion`, which the Deleted event carries), drop it from the owner index, and
    /// remember its uid when its kind is one of [`crate::TOMBSTONED_KINDS`].
    fn erase_object(&mut self, obj: &mut DynObject) -> Result<()>;
}

/// The write rules, for every [`WriteTxn`].
pub trait Rules: WriteTxn {
    /// Store `obj` over `old` (none for a new object) after checking that each
    /// ownerReference it adds names a current object: one that names a uid nobody has would
    /// never be garbage-collected.
    fn put(&mut self, obj: &mut DynObject, ev: EventType, old: Option<&DynObject>) -> Result<()> {
        let old_refs = old
            .map(|o| o.metadata.owner_references.as_slice())
            .unwrap_or_default();
        for r in &obj.metadata.owner_references {
            if !old_refs.iter().any(|o| o.uid == r.uid) && !self.uid_exists(&r.uid)? {
                return Err(StoreError::OwnerGone {
                    kind: obj.kind.clone(),
                    name: obj.metadata.name.clone(),
                    owner: format!("{}/{}", r.kind, r.name),
                    uid: r.uid.clone(),
                });
            }
        }
        self.store_object(obj, ev, old)
    }

    /// Remove `obj`'s key at a new revision (the Deleted event carries the object as it was
    /// last, with that revision), then cascade to what it owned: each owned object is removed
    /// in turn, or marked while it has finalizers.
    fn remove(&mut self, mut obj: DynObject) -> Result<DynObject> {
        self.erase_object(&mut obj)?;
        let mut work = self.owned_by_uid(obj.metadata.uid.as_deref())?;
        while let Some((kind, name)) = work.pop() {
            let Some(mut child) = self.load(&kind, &name)? else {
                continue;
            };
            if !child.metadata.finalizers.is_empty() {
                self.mark_deleting(&mut child)?;
                continue;
            }
            self.erase_object(&mut child)?;
            work.extend(self.owned_by_uid(child.metadata.uid.as_deref())?);
        }
        Ok(obj)
    }

    /// [`WriteTxn::owned_by`], reversed (the cascade pops from the end, so it handles them
    /// in (kind, name) order); none for no uid.
    fn owned_by_uid(&self, uid: Option<&str>) -> Result<Vec<(String, String)>> {
        let Some(uid) = uid else {
            return Ok(Vec::new());
        };
        let mut out = self.owned_by(uid)?;
        out.reverse();
        Ok(out)
    }

    /// Set `deletionTimestamp` (if unset) and log the change.
    fn mark_deleting(&mut self, obj: &mut DynObject) -> Result<()> {
        if obj.metadata.deletion_timestamp.is_none() {
            let old = obj.clone();
            obj.metadata.deletion_timestamp = Some(boxery_api::now());
            self.put(obj, EventType::Modified, Some(&old))?;
        }
        Ok(())
    }

    /// Delete a key, finalizers respected: mark it while finalizers remain, otherwise remove
    /// it and cascade.
    fn delete(&mut self, kind: &str, name: &str) -> Result<DeleteOutcome> {
        let Some(mut obj) = self.load(kind, name)? else {
            return Err(StoreError::not_found(kind, name));
        };
        if obj.metadata.finalizers.is_empty() {
            Ok(DeleteOutcome::Removed(self.remove(obj)?))
        } else {
            self.mark_deleting(&mut obj)?;
            Ok(DeleteOutcome::Marked(obj))
        }
    }

    /// Create a new object: server fields set, Added logged, its fields owned by `manager`.
    /// `obj` must be normalized.
    fn create(&mut self, mut obj: DynObject, manager: &str) -> Result<DynObject> {
        crate::fields::record_update(None, &mut obj, manager);
        self.insert(obj)
    }

    /// Create `obj` with the managedFields it carries. `obj` must be normalized.
    fn insert(&mut self, obj: DynObject) -> Result<DynObject> {
        let uid = uuid::Uuid::new_v4().to_string();
        self.insert_with_uid(obj, uid)
    }

    /// Create `obj` with `uid`: `AlreadyExists` when its name is taken.
    fn insert_with_uid(&mut self, mut obj: DynObject, uid: String) -> Result<DynObject> {
        refuse_unimplemented(None, &obj)?;
        if self.exists(&obj.kind, &obj.metadata.name)? {
            return Err(StoreError::AlreadyExists {
                kind: obj.kind,
                name: obj.metadata.name,
            });
        }
        let m = &mut obj.metadata;
        m.uid = Some(uid);
        m.generation = Some(1);
        m.creation_timestamp = Some(boxery_api::now());
        m.deletion_timestamp = None;
        self.put(&mut obj, EventType::Added, None)?;
        Ok(obj)
    }

    /// Create an object with a uid it had before (an orphan in the backend adopted again):
    /// refused when an object has that uid, or when this store removed its object.
    fn adopt(&mut self, obj: DynObject, uid: &str) -> Result<DynObject> {
        refuse_unimplemented(None, &obj)?;
        if self.uid_exists(uid)? || self.was_removed(uid)? {
            return Err(invalid(
                &obj,
                "metadata.uid",
                format!(
                    "uid {uid} belongs to an object this store has or removed: it cannot be adopted"
                ),
            ));
        }
        self.insert_with_uid(obj, uid.to_string())
    }

    /// Replace the user-owned parts of an object (everything but `status` and the server's
    /// metadata), recording what `manager` changed. `obj` must be normalized.
    fn update(&mut self, obj: DynObject, manager: &str) -> Result<DynObject> {
        let cur = self.load_for_write(&obj)?;
        if cur.metadata.is_deleting() {
            let added: Vec<&String> = obj
                .metadata
                .finalizers
                .iter()
                .filter(|f| !cur.metadata.has_finalizer(f))
                .collect();
            if !added.is_empty() {
                return Err(invalid(
                    &cur,
                    "metadata.finalizers",
                    format!(
                        "cannot add finalizer `{}` to an object being deleted: finalizers may only be removed now",
                        added[0]
                    ),
                ));
            }
        }
        let mut new = cur.clone();
        let spec_changed = replace_spec(&mut new.rest, &obj.rest);
        if spec_changed {
            refuse_spec_change(&cur, &new)?;
        }
        let m = &mut new.metadata;
        m.labels = obj.metadata.labels;
        m.annotations = obj.metadata.annotations;
        m.finalizers = obj.metadata.finalizers;
        m.owner_references = obj.metadata.owner_references;
        if spec_changed {
            m.generation = Some(cur.metadata.generation.unwrap_or(0) + 1);
        }
        crate::fields::record_update(Some(&cur), &mut new, manager);
        self.finish_update(cur, new)
    }

    /// Replace only `status`. `obj` must be normalized.
    fn update_status(&mut self, obj: DynObject) -> Result<DynObject> {
        let cur = self.load_for_write(&obj)?;
        let mut new = cur.clone();
        match obj.rest.get("status") {
            Some(s) => {
                new.rest.insert("status".into(), s.clone());
            }
            None if !cur.rest.contains_key("status") => {
                return Err(invalid(
                    &cur,
                    "status",
                    format!(
                        "{} objects have no status: use update to change them",
                        cur.kind
                    ),
                ));
            }
            None => {
                new.rest.remove("status");
            }
        }
        self.finish_update(cur, new)
    }

    /// The stored object `obj` updates, with the resourceVersion precondition checked.
    fn load_for_write(&self, obj: &DynObject) -> Result<DynObject> {
        let Some(cur) = self.load(&obj.kind, &obj.metadata.name)? else {
            return Err(StoreError::not_found(&obj.kind, &obj.metadata.name));
        };
        if let Some(expected) = &obj.metadata.resource_version {
            let actual = cur.metadata.resource_version.clone().unwrap_or_default();
            if *expected != actual {
                return Err(StoreError::Conflict {
                    kind: cur.kind,
                    name: cur.metadata.name,
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        Ok(cur)
    }

    /// Write `new` over `cur` unless nothing changed; remove it when it is being deleted and
    /// no finalizer remains.
    fn finish_update(&mut self, cur: DynObject, mut new: DynObject) -> Result<DynObject> {
        if new.metadata.is_deleting() && new.metadata.finalizers.is_empty() {
            return self.remove(new);
        }
        if new == cur {
            return Ok(cur);
        }
        self.put(&mut new, EventType::Modified, Some(&cur))?;
        Ok(new)
    }
}

impl<T: WriteTxn + ?Sized> Rules for T {}

/// Replace every top-level field but `status` (the spec, or an Event's fields) in `dst` with
/// `src`'s. Returns whether anything changed.
pub(crate) fn replace_spec(dst: &mut Map<String, Value>, src: &Map<String, Value>) -> bool {
    let before: Vec<(String, Value)> = dst
        .iter()
        .filter(|(k, _)| k.as_str() != "status")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    dst.retain(|k, _| k == "status");
    for (k, v) in src {
        if k != "status" {
            dst.insert(k.clone(), v.clone());
        }
    }
    let after = dst.iter().filter(|(k, _)| k.as_str() != "status");
    !before.iter().map(|(k, v)| (k, v)).eq(after)
}

/// Refuse an update of `cur`'s spec to `new`'s that changes a field fixed once the object
/// exists ([`boxery_api::validate::changed_fixed`]) or sets one nothing implements yet.
pub(crate) fn refuse_spec_change(cur: &DynObject, new: &DynObject) -> Result<()> {
    let errors = boxery_api::validate::changed_fixed(cur, new);
    if !errors.is_empty() {
        return Err(StoreError::Invalid(ValidationError {
            object: new.key(),
            errors,
        }));
    }
    refuse_unimplemented(Some(cur), new)
}

/// Refuse `new` when it sets a field nothing implements yet
/// ([`boxery_api::validate::unimplemented`]) that `old` (the stored object, if any) did not
/// already set the same way: an object from an older boxery keeps working until a write would
/// set such a field anew.
pub(crate) fn refuse_unimplemented(old: Option<&DynObject>, new: &DynObject) -> Result<()> {
    let before = old
        .map(boxery_api::validate::unimplemented)
        .unwrap_or_default();
    let errors: Vec<_> = boxery_api::validate::unimplemented(new)
        .into_iter()
        .filter(|e| !before.contains(e))
        .collect();
    if errors.is_empty() {
        return Ok(());
    }
    Err(StoreError::Invalid(ValidationError {
        object: new.key(),
        errors,
    }))
}

/// An `Invalid` error about one field of `obj`.
pub(crate) fn invalid(obj: &DynObject, path: &str, message: String) -> StoreError {
    StoreError::Invalid(ValidationError {
        object: obj.key(),
        errors: vec![FieldError::new(path, message)],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn replace_spec_keeps_status_and_reports_changes() {
        let mut dst = map(json!({"spec": {"a": 1}, "status": {"phase": "Running"}}));
        assert!(!replace_spec(
            &mut dst,
            &map(json!({"spec": {"a": 1}, "status": {"phase": "Failed"}}))
        ));
        assert_eq!(dst["status"]["phase"], "Running");
        assert!(replace_spec(&mut dst, &map(json!({"spec": {"a": 2}}))));
        assert_eq!(
            dst,
            map(json!({"spec": {"a": 2}, "status": {"phase": "Running"}}))
        );
        // Event-like objects: every field but status is the "spec".
        let mut ev = map(json!({"reason": "A", "count": 1}));
        assert!(replace_spec(
            &mut ev,
            &map(json!({"reason": "A", "count": 2}))
        ));
        assert!(
            replace_spec(&mut ev, &map(json!({"reason": "A"}))),
            "a removed field is a change"
        );
    }
}
