//! A kind's objects as they were at an earlier revision, read back from the history: what a
//! paged list's later pages need to show the first page's revision (the Kubernetes API's
//! `continue`). The store keeps one version of each object and, in `log`, every change after
//! the compaction floor with the object as it was written; so the version at revision `r` of
//! an object changed after `r` is its last change at or before `r`, when that change is still
//! in the log. When it is not (compacted away while the object stayed unchanged), the past
//! cannot be read and the answer is `None`.

use std::collections::{BTreeMap, BTreeSet};

use boxery_api::{DynObject, Selector};

use crate::schema::{meta, to_i64};
use crate::{Result, Store, StoreError};

impl Store {
    /// The objects of `kind` whose labels match `selector` as they were at revision `rev`,
    /// sorted by name; `None` when the history no longer tells (see the module), `TooOld`
    /// when `rev` is below the compaction floor. Read in one transaction.
    pub fn list_at(
        &self,
        kind: &str,
        selector: &Selector,
        rev: u64,
    ) -> Result<Option<Vec<DynObject>>> {
        self.inner.with_reader(|c| {
            let tx = c.transaction()?;
            let (now, floor) = (meta(&tx, "revision")?, meta(&tx, "compacted")?);
            if rev < floor {
                return Err(StoreError::TooOld {
                    requested: rev,
                    floor,
                });
            }
            if rev > now {
                return Ok(None);
            }
            let parse = |json: &str| serde_json::from_str::<DynObject>(json);
            let mut at: BTreeMap<String, DynObject> = BTreeMap::new();
            {
                let mut stmt =
                    tx.prepare_cached("SELECT rev, json FROM objects WHERE kind = ?1")?;
                let mut rows = stmt.query([kind])?;
                while let Some(r) = rows.next()? {
                    if r.get::<_, i64>(0)? <= to_i64(rev) {
                        let o = parse(r.get_ref(1)?.as_str().map_err(rusqlite::Error::from)?)?;
                        at.insert(o.metadata.name.clone(), o);
                    }
                }
            }
            // what changed after `rev`, and how each first changed then
            let mut first_after: BTreeMap<String, String> = BTreeMap::new();
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT name, type FROM log WHERE kind = ?1 AND rev > ?2 ORDER BY rev",
                )?;
                let mut rows = stmt.query(rusqlite::params![kind, to_i64(rev)])?;
                while let Some(r) = rows.next()? {
                    first_after
                        .entry(r.get(0)?)
                        .or_insert_with(|| r.get(1).unwrap_or_default());
                }
            }
            // their last change at or before `rev`, where the log still holds it
            let mut seen: BTreeSet<String> = BTreeSet::new();
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT name, type, json FROM log WHERE kind = ?1 AND rev > ?2 AND rev <= ?3 ORDER BY rev DESC",
                )?;
                let mut rows =
                    stmt.query(rusqlite::params![kind, to_i64(floor), to_i64(rev)])?;
                while let Some(r) = rows.next()? {
                    let name: String = r.get(0)?;
                    if !first_after.contains_key(&name) || !seen.insert(name.clone()) {
                        continue;
                    }
                    if r.get::<_, String>(1)? != "Deleted" {
                        let o = parse(r.get_ref(2)?.as_str().map_err(rusqlite::Error::from)?)?;
                        at.insert(name, o);
                    }
                }
            }
            for (name, how) in &first_after {
                // made after `rev`: it was not there; else its version at `rev` is compacted
                if !seen.contains(name) && how != "Added" {
                    return Ok(None);
                }
            }
            tx.commit()?;
            Ok(Some(
                at.into_values()
                    .filter(|o| selector.matches(&o.metadata.labels))
                    .collect(),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(name: &str) -> DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": boxery_api::API_VERSION, "kind": "Image", "metadata": {"name": name},
            "spec": {"source": {"vm": "dev1"}}
        }))
        .unwrap()
    }

    fn names(objs: &[DynObject]) -> Vec<(&str, Option<&str>)> {
        objs.iter()
            .map(|o| {
                (
                    o.metadata.name.as_str(),
                    o.metadata.resource_version.as_deref(),
                )
            })
            .collect()
    }

    #[test]
    fn the_past_is_read_while_the_log_holds_it() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(&d.path().join("s.db")).unwrap();
        for n in ["a", "b", "c"] {
            s.create(image(n)).unwrap();
        }
        // e: made and removed before r, made again after
        s.create(image("e")).unwrap();
        s.delete("Image", "e").unwrap();
        if let Some(mut e) = s.get("Image", "e").unwrap() {
            e.metadata.finalizers.clear();
            s.update(e).unwrap();
        }
        assert!(s.get("Image", "e").unwrap().is_none());
        let all = Selector::default();
        let (before, r) = s.list("Image", &all).unwrap();
        let mut b = s.get("Image", "b").unwrap().unwrap();
        b.metadata.labels.insert("x".into(), "y".into());
        s.update(b).unwrap();
        s.delete("Image", "c").unwrap();
        s.create(image("d")).unwrap();
        s.create(image("e")).unwrap();
        let at = s
            .list_at("Image", &all, r)
            .unwrap()
            .expect("the log holds it");
        assert_eq!(names(&at), names(&before));
        s.compact(0).unwrap();
        assert!(matches!(
            s.list_at("Image", &all, r),
            Err(StoreError::TooOld { .. })
        ));
        // an object unchanged since before the floor, then changed: its past is unknown
        let (_, r2) = s.list("Image", &all).unwrap();
        let mut a = s.get("Image", "a").unwrap().unwrap();
        a.metadata.labels.insert("x".into(), "z".into());
        s.update(a).unwrap();
        assert_eq!(s.list_at("Image", &all, r2).unwrap(), None);
    }
}
