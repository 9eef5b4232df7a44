//! SQLite's write transaction: one `BEGIN IMMEDIATE` each, a revision per changed object, the
//! log row beside the object row, the owner index and the tombstones kept in step. The rules
//! it carries out are `crate::rules`', over the [`WriteTxn`] it implements here.

use boxery_api::DynObject;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::Result;
use crate::rules::{EventType, WriteTxn};
use crate::schema::{meta, set_meta, to_i64};

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

    fn log(&self, rev: u64, kind: &str, name: &str, ev: EventType, json: &str) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO log (rev, kind, name, type, json) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![to_i64(rev), kind, name, ev.as_str(), json])?;
        self.kinds.borrow_mut().push((kind.to_string(), rev));
        Ok(())
    }

    /// Whether `sql` (with one parameter) finds a row.
    fn any(&self, sql: &str, param: &str) -> Result<bool> {
        Ok(self
            .tx
            .prepare_cached(sql)?
            .query_row([param], |_| Ok(()))
            .optional()?
            .is_some())
    }
}

impl WriteTxn for Tx<'_> {
    fn load(&self, kind: &str, name: &str) -> Result<Option<DynObject>> {
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

    fn exists(&self, kind: &str, name: &str) -> Result<bool> {
        Ok(self
            .tx
            .prepare_cached("SELECT 1 FROM objects WHERE kind = ?1 AND name = ?2")?
            .query_row(params![kind, name], |_| Ok(()))
            .optional()?
            .is_some())
    }

    fn load_kind(&self, kind: &str) -> Result<Vec<DynObject>> {
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

    fn uid_exists(&self, uid: &str) -> Result<bool> {
        self.any("SELECT 1 FROM objects WHERE uid = ?1", uid)
    }

    fn was_removed(&self, uid: &str) -> Result<bool> {
        self.any("SELECT 1 FROM tombstones WHERE uid = ?1", uid)
    }

    fn owned_by(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let mut stmt = self
            .tx
            .prepare_cached("SELECT kind, name FROM owners WHERE owner_uid = ?1")?;
        let rows = stmt.query_map([uid], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let mut out: Vec<(String, String)> = rows.collect::<rusqlite::Result<_>>()?;
        out.sort();
        Ok(out)
    }

    fn store_object(
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

    fn erase_object(&mut self, obj: &mut DynObject) -> Result<()> {
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
        Ok(())
    }
}
