//! Writes: one `BEGIN IMMEDIATE` transaction each, a revision per changed object, the log row
//! beside the object row, the owner index kept in step, and the finalizer-aware delete with
//! its ownerReference cascade.

use boxery_api::validate::FieldError;
use boxery_api::{DynObject, ValidationError};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde_json::{Map, Value};

use crate::schema::{meta, set_meta, to_i64};
use crate::{DeleteOutcome, Result, StoreError};

/// The type of a log row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "Added",
            EventType::Modified => "Modified",
            EventType::Deleted => "Deleted",
        }
    }
}

/// One write transaction: the revision counter read at `BEGIN`, bumped per changed object and
/// written back at commit.
pub(crate) struct Tx<'c> {
    tx: rusqlite::Transaction<'c>,
    start: u64,
    rev: u64,
    /// The kind of each revision written, in order (for [`crate::watch::KindRevs`]).
    kinds: std::cell::RefCell<Vec<(String, u64)>>,
}

/// What a committed transaction wrote: the revision it started from, its last revision, and
/// the kind of each revision it wrote.
pub(crate) struct Committed {
    pub(crate) start: u64,
    pub(crate) rev: u64,
    pub(crate) kinds: Vec<(String, u64)>,
}

impl<'c> Tx<'c> {
    /// `BEGIN IMMEDIATE`: take the write lock now (waiting up to the busy timeout), so the
    /// revision read here cannot be raced by another writer.
    pub(crate) fn begin(conn: &'c mut Connection) -> Result<Tx<'c>> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let rev = meta(&tx, "revision")?;
        Ok(Tx {
            tx,
            start: rev,
            rev,
            kinds: Default::default(),
        })
    }

    /// Commit; returns what was written (`rev` unchanged from `start` when nothing was).
    pub(crate) fn commit(self) -> Result<Committed> {
        if self.rev != self.start {
            set_meta(&self.tx, "revision", self.rev)?;
        }
        self.tx.commit()?;
        Ok(Committed {
            start: self.start,
            rev: self.rev,
            kinds: self.kinds.into_inner(),
        })
    }

    /// Roll back (for dry runs).
    pub(crate) fn rollback(self) -> Result<()> {
        self.tx.rollback()?;
        Ok(())
    }

    /// The current object of a key.
    pub(crate) fn load(&self, kind: &str, name: &str) -> Result<Option<DynObject>> {
        let json: Option<String> = self
            .tx
            .prepare_cached("SELECT json FROM objects WHERE kind = ?1 AND name = ?2")?
            .query_row(params![kind, name], |r| r.get(0))
            .optional()?;
        Ok(match json {
            Some(j) => Some(serde_json::from_str(&j)?),
            None => None,
        })
    }

    /// Every current object of a kind, by name.
    pub(crate) fn load_kind(&self, kind: &str) -> Result<Vec<DynObject>> {
        let mut stmt = self
            .tx
            .prepare_cached("SELECT json FROM objects WHERE kind = ?1")?;
        let rows = stmt.query_map([kind], |r| r.get::<_, String>(0))?;
        let mut out: Vec<DynObject> = Vec::new();
        for j in rows {
            out.push(serde_json::from_str(&j?)?);
        }
        // Sorted here, not by an `ORDER BY` (see `Store::list`).
        out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(out)
    }

    /// Write `obj` as the current object of its key at a new revision and log it. `old` is the
    /// object it replaces (to keep the owner index in step).
    pub(crate) fn put(
        &mut self,
        obj: &mut DynObject,
        ev: EventType,
        old: Option<&DynObject>,
    ) -> Result<()> {
        self.rev += 1;
        let rev = self.rev;
        obj.metadata.resource_version = Some(rev.to_string());
        let json = serde_json::to_string(&obj)?;
        let uid = obj.metadata.uid.as_deref().unwrap_or_default();
        self.tx
            .prepare_cached(
                "INSERT INTO objects (kind, name, uid, rev, json) VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (kind, name) DO UPDATE SET uid = excluded.uid, rev = excluded.rev, json = excluded.json",
            )?
            .execute(params![obj.kind, obj.metadata.name, uid, to_i64(rev), json])?;
        self.log(rev, &obj.kind, &obj.metadata.name, ev, &json)?;
        let old_refs = old
            .map(|o| o.metadata.owner_references.as_slice())
            .unwrap_or_default();
        if old_refs != obj.metadata.owner_references.as_slice() {
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
            if !old_refs.is_empty() {
                self.tx
                    .prepare_cached("DELETE FROM owners WHERE kind = ?1 AND name = ?2")?
                    .execute(params![obj.kind, obj.metadata.name])?;
            }
            let mut ins = self.tx.prepare_cached(
                "INSERT OR IGNORE INTO owners (owner_uid, kind, name) VALUES (?1, ?2, ?3)",
            )?;
            for r in &obj.metadata.owner_references {
                ins.execute(params![r.uid, obj.kind, obj.metadata.name])?;
            }
        }
        Ok(())
    }

    fn uid_exists(&self, uid: &str) -> Result<bool> {
        Ok(self
            .tx
            .prepare_cached("SELECT 1 FROM objects WHERE uid = ?1")?
            .query_row([uid], |_| Ok(()))
            .optional()?
            .is_some())
    }

    fn log(&self, rev: u64, kind: &str, name: &str, ev: EventType, json: &str) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO log (rev, kind, name, type, json) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![to_i64(rev), kind, name, ev.as_str(), json])?;
        self.kinds.borrow_mut().push((kind.to_string(), rev));
        Ok(())
    }

    /// Remove the current object of `obj`'s key at a new revision (the Deleted event carries
    /// the object as it was last, with that revision), then cascade to what it owned.
    pub(crate) fn remove(&mut self, mut obj: DynObject) -> Result<DynObject> {
        let removed = self.remove_one(&mut obj)?;
        let mut work = self.owned_by(removed.as_deref())?;
        while let Some((kind, name)) = work.pop() {
            let Some(mut child) = self.load(&kind, &name)? else {
                continue;
            };
            if !child.metadata.finalizers.is_empty() {
                self.mark_deleting(&mut child)?;
                continue;
            }
            let uid = self.remove_one(&mut child)?;
            work.extend(self.owned_by(uid.as_deref())?);
        }
        Ok(obj)
    }

    /// Remove one object without cascading; returns its uid.
    fn remove_one(&mut self, obj: &mut DynObject) -> Result<Option<String>> {
        self.rev += 1;
        let rev = self.rev;
        obj.metadata.resource_version = Some(rev.to_string());
        let json = serde_json::to_string(&obj)?;
        self.tx
            .prepare_cached("DELETE FROM objects WHERE kind = ?1 AND name = ?2")?
            .execute(params![obj.kind, obj.metadata.name])?;
        if !obj.metadata.owner_references.is_empty() {
            self.tx
                .prepare_cached("DELETE FROM owners WHERE kind = ?1 AND name = ?2")?
                .execute(params![obj.kind, obj.metadata.name])?;
        }
        self.log(
            rev,
            &obj.kind,
            &obj.metadata.name,
            EventType::Deleted,
            &json,
        )?;
        if let Some(uid) = obj.metadata.uid.as_deref()
            && crate::TOMBSTONED_KINDS.contains(&obj.kind.as_str())
        {
            self.tx
                .prepare_cached(
                    "INSERT OR REPLACE INTO tombstones (uid, kind, name, rev) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![uid, obj.kind, obj.metadata.name, to_i64(rev)])?;
        }
        Ok(obj.metadata.uid.clone())
    }

    /// The keys of the objects that name `uid` among their ownerReferences.
    fn owned_by(&self, uid: Option<&str>) -> Result<Vec<(String, String)>> {
        let Some(uid) = uid else {
            return Ok(Vec::new());
        };
        let mut stmt = self
            .tx
            .prepare_cached("SELECT kind, name FROM owners WHERE owner_uid = ?1")?;
        let rows = stmt.query_map([uid], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let mut out: Vec<(String, String)> = rows.collect::<rusqlite::Result<_>>()?;
        // Popped from the end: handle them in (kind, name) order.
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
    pub(crate) fn delete(&mut self, kind: &str, name: &str) -> Result<DeleteOutcome> {
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
    pub(crate) fn create(&mut self, mut obj: DynObject, manager: &str) -> Result<DynObject> {
        crate::fields::record_update(None, &mut obj, manager);
        self.insert(obj)
    }

    /// Create `obj` with the managedFields it carries. `obj` must be normalized.
    pub(crate) fn insert(&mut self, mut obj: DynObject) -> Result<DynObject> {
        refuse_unimplemented(None, &obj)?;
        if self.exists(&obj.kind, &obj.metadata.name)? {
            return Err(StoreError::AlreadyExists {
                kind: obj.kind,
                name: obj.metadata.name,
            });
        }
        let m = &mut obj.metadata;
        m.uid = Some(uuid::Uuid::new_v4().to_string());
        m.generation = Some(1);
        m.creation_timestamp = Some(boxery_api::now());
        m.deletion_timestamp = None;
        self.put(&mut obj, EventType::Added, None)?;
        Ok(obj)
    }

    /// Create an object with a uid it had before (an orphan in the backend adopted again):
    /// refused when an object has that uid, or when this store removed its object.
    pub(crate) fn adopt(&mut self, mut obj: DynObject, uid: &str) -> Result<DynObject> {
        refuse_unimplemented(None, &obj)?;
        let taken = self.uid_exists(uid)?
            || self
                .tx
                .prepare_cached("SELECT 1 FROM tombstones WHERE uid = ?1")?
                .query_row([uid], |_| Ok(()))
                .optional()?
                .is_some();
        if taken {
            return Err(invalid(
                &obj,
                "metadata.uid",
                format!(
                    "uid {uid} belongs to an object this store has or removed: it cannot be adopted"
                ),
            ));
        }
        if self.exists(&obj.kind, &obj.metadata.name)? {
            return Err(StoreError::AlreadyExists {
                kind: obj.kind,
                name: obj.metadata.name,
            });
        }
        let m = &mut obj.metadata;
        m.uid = Some(uid.to_string());
        m.generation = Some(1);
        m.creation_timestamp = Some(boxery_api::now());
        m.deletion_timestamp = None;
        self.put(&mut obj, EventType::Added, None)?;
        Ok(obj)
    }

    fn exists(&self, kind: &str, name: &str) -> Result<bool> {
        Ok(self
            .tx
            .prepare_cached("SELECT 1 FROM objects WHERE kind = ?1 AND name = ?2")?
            .query_row(params![kind, name], |_| Ok(()))
            .optional()?
            .is_some())
    }

    /// Replace the user-owned parts of an object (everything but `status` and the server's
    /// metadata), recording what `manager` changed. `obj` must be normalized.
    pub(crate) fn update(&mut self, obj: DynObject, manager: &str) -> Result<DynObject> {
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
    pub(crate) fn update_status(&mut self, obj: DynObject) -> Result<DynObject> {
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
    pub(crate) fn finish_update(
        &mut self,
        cur: DynObject,
        mut new: DynObject,
    ) -> Result<DynObject> {
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
