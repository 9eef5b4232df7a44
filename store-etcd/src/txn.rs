//! One write transaction on etcd, as the store's write rules need it ([`WriteTxn`]).
//!
//! Optimistic, and serial like SQLite's: the transaction reads the store's revision key
//! (`P/meta/rev`) first, then every key it reads at the etcd revision of that read (one
//! snapshot); its writes are kept here, and its own reads see them. At commit, one etcd
//! transaction compares the revision key's `mod_revision` with the one read and, when it has
//! not moved, writes everything and the new revision. Every object write moves that key, so a
//! commit that succeeds is one nothing changed under; one that fails is run again from the
//! start by the caller ([`crate::EtcdStore`]), the rules and all.

use std::collections::BTreeMap;

use boxery_api::DynObject;
use boxery_store::rules::{EventType, WriteTxn};
use boxery_store::{Result, StoreError};
use etcd_client::{Compare, CompareOp, GetOptions, KvClient, Txn, TxnOp};
use tokio::runtime::Handle;

use crate::keys::{Keys, range_end};
use crate::log::Entry;
use crate::ride::{self, retry_blocking};
use crate::{etcd_error, parse_u64};

pub(crate) struct EtcdTxn {
    kv: KvClient,
    handle: Handle,
    keys: Keys,
    /// The etcd revision every read is made at.
    snapshot: i64,
    /// The revision key's `mod_revision` at the start: the commit's condition.
    rev_mod: i64,
    /// The store's revision at the start; `rev` is the last one written.
    start: u64,
    rev: u64,
    /// What the transaction wrote, by key: `None` for a deletion.
    writes: BTreeMap<String, Option<Vec<u8>>>,
}

/// Whether etcd refused a transaction for its size (`--max-txn-ops`, `--max-request-bytes`).
fn too_big(e: &StoreError) -> bool {
    let shown = crate::error_chain(e);
    shown.contains("too many operations in txn request") || shown.contains("request is too large")
}

/// What a commit did.
pub(crate) enum Commit {
    /// Written (or nothing to write).
    Done,
    /// The store moved since the transaction read it: run it again.
    Moved,
}

impl EtcdTxn {
    /// Start: read the store's revision, and fix the snapshot the reads are made at. Called on
    /// a thread that may block (not an async worker).
    pub(crate) fn begin(kv: &KvClient, handle: &Handle, keys: &Keys) -> Result<EtcdTxn> {
        let key = keys.rev();
        let r = retry_blocking(|| {
            let mut c = kv.clone();
            handle
                .block_on(c.get(key.as_str(), None))
                .map_err(etcd_error)
        })?;
        let snapshot = r.header().map_or(0, |h| h.revision());
        let (rev, rev_mod) = match r.kvs().first() {
            Some(kv) => (parse_u64(kv.value())?, kv.mod_revision()),
            None => (0, 0),
        };
        Ok(EtcdTxn {
            kv: kv.clone(),
            handle: handle.clone(),
            keys: keys.clone(),
            snapshot,
            rev_mod,
            start: rev,
            rev,
            writes: BTreeMap::new(),
        })
    }

    /// Write what the transaction wrote, if the store has not moved.
    pub(crate) fn commit(mut self) -> Result<Commit> {
        if self.writes.is_empty() {
            return Ok(Commit::Done);
        }
        let first = self.keys.log_entry(self.start + 1);
        let ours = self.writes_of(&first);
        let mut ops: Vec<TxnOp> = std::mem::take(&mut self.writes)
            .into_iter()
            .map(|(k, v)| match v {
                Some(v) => TxnOp::put(k, v, None),
                None => TxnOp::delete(k, None),
            })
            .collect();
        ops.push(TxnOp::put(self.keys.rev(), self.rev.to_string(), None));
        let when = if self.rev_mod == 0 {
            Compare::version(self.keys.rev(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(self.keys.rev(), CompareOp::Equal, self.rev_mod)
        };
        let mut c = self.kv.clone();
        match self
            .handle
            .block_on(c.txn(Txn::new().when([when.clone()]).and_then(ops)))
            .map_err(etcd_error)
        {
            Ok(r) if r.succeeded() => Ok(Commit::Done),
            Ok(_) => Ok(Commit::Moved),
            Err(e) if too_big(&e) => Err(crate::db_failure(format!(
                "this write changes more than one etcd transaction may hold ({}): start the etcd members with a higher --max-txn-ops (and --max-request-bytes), docs/scale-out.md, or apply fewer objects at once",
                crate::error_chain(&e)
            ))),
            // etcd did not say: the transaction may still be applied
            Err(e) if ride::transient(&e) => self.settle(when, &first, ours),
            Err(e) => Err(e),
        }
    }

    /// What this transaction writes at `key`.
    fn writes_of(&self, key: &str) -> Option<Vec<u8>> {
        self.writes.get(key).cloned().flatten()
    }

    /// Whether a commit etcd did not answer was applied. First a fence: a write of the
    /// revision key as it is, on the same condition, so the unanswered one can no longer be
    /// applied after this looks. The fence applied: the commit was not (run again). The fence
    /// refused: something was applied; it was this commit when its first log entry is ours.
    fn settle(&self, when: Compare, first: &str, ours: Option<Vec<u8>>) -> Result<Commit> {
        let fence = TxnOp::put(self.keys.rev(), self.start.to_string(), None);
        let r = retry_blocking(|| {
            let mut c = self.kv.clone();
            self.handle
                .block_on(c.txn(Txn::new().when([when.clone()]).and_then([fence.clone()])))
                .map_err(etcd_error)
        })?;
        if r.succeeded() {
            return Ok(Commit::Moved);
        }
        let found = retry_blocking(|| {
            let mut c = self.kv.clone();
            self.handle.block_on(c.get(first, None)).map_err(etcd_error)
        })?;
        let applied = found.kvs().first().map(|kv| kv.value().to_vec());
        Ok(if applied.is_some() && applied == ours {
            Commit::Done
        } else {
            Commit::Moved
        })
    }

    /// A key's value: this transaction's write of it, else the snapshot's.
    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if let Some(w) = self.writes.get(key) {
            return Ok(w.clone());
        }
        let r = retry_blocking(|| {
            let mut c = self.kv.clone();
            self.handle
                .block_on(c.get(key, Some(GetOptions::new().with_revision(self.snapshot))))
                .map_err(etcd_error)
        })?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Every key under `prefix` and its value, in key order: the snapshot's, with this
    /// transaction's writes over them.
    fn read_prefix(&self, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>> {
        let r = retry_blocking(|| {
            let mut c = self.kv.clone();
            self.handle
                .block_on(
                    c.get(
                        prefix,
                        Some(
                            GetOptions::new()
                                .with_range(range_end(prefix))
                                .with_revision(self.snapshot),
                        ),
                    ),
                )
                .map_err(etcd_error)
        })?;
        let mut out: BTreeMap<String, Vec<u8>> = r
            .kvs()
            .iter()
            .filter_map(|kv| Some((kv.key_str().ok()?.to_string(), kv.value().to_vec())))
            .collect();
        for (k, v) in self
            .writes
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
        {
            match v {
                Some(v) => out.insert(k.clone(), v.clone()),
                None => out.remove(k),
            };
        }
        Ok(out)
    }

    fn put(&mut self, key: String, value: impl Into<Vec<u8>>) {
        self.writes.insert(key, Some(value.into()));
    }

    fn delete(&mut self, key: String) {
        self.writes.insert(key, None);
    }

    /// Log change `rev`: `obj` (as it is now, or last, for a deletion) as `ev`.
    fn log(&mut self, rev: u64, ev: EventType, obj: &DynObject) -> Result<()> {
        let entry = Entry::new(ev, obj);
        let json = serde_json::to_vec(&entry)?;
        self.put(self.keys.log_entry(rev), json);
        Ok(())
    }
}

impl WriteTxn for EtcdTxn {
    fn load(&self, kind: &str, name: &str) -> Result<Option<DynObject>> {
        match self.read(&self.keys.object(kind, name))? {
            Some(v) => Ok(Some(serde_json::from_slice(&v)?)),
            None => Ok(None),
        }
    }

    fn load_kind(&self, kind: &str) -> Result<Vec<DynObject>> {
        // in key order, which is name order
        self.read_prefix(&self.keys.kind(kind))?
            .values()
            .map(|v| Ok(serde_json::from_slice(v)?))
            .collect()
    }

    fn uid_exists(&self, uid: &str) -> Result<bool> {
        Ok(self.read(&self.keys.uid_index(uid))?.is_some())
    }

    fn was_removed(&self, uid: &str) -> Result<bool> {
        Ok(self.read(&self.keys.tombstone(uid))?.is_some())
    }

    fn owned_by(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let prefix = self.keys.owned(uid);
        Ok(self
            .read_prefix(&prefix)?
            .keys()
            .filter_map(|k| {
                let (kind, name) = k.strip_prefix(&prefix)?.split_once('/')?;
                Some((kind.to_string(), name.to_string()))
            })
            .collect())
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
        let json = serde_json::to_vec(&obj)?;
        let (kind, name) = (obj.kind.clone(), obj.metadata.name.clone());
        self.put(self.keys.object(&kind, &name), json);
        self.log(rev, ev, obj)?;
        let uid = obj.metadata.uid.clone().unwrap_or_default();
        if old.and_then(|o| o.metadata.uid.as_deref()) != Some(uid.as_str()) {
            self.put(self.keys.uid_index(&uid), format!("{kind}/{name}"));
        }
        let old_refs = old
            .map(|o| o.metadata.owner_references.as_slice())
            .unwrap_or_default();
        if old_refs != obj.metadata.owner_references.as_slice() {
            for r in old_refs {
                self.delete(self.keys.owner(&r.uid, &kind, &name));
            }
            for r in &obj.metadata.owner_references {
                self.put(self.keys.owner(&r.uid, &kind, &name), Vec::new());
            }
        }
        Ok(())
    }

    fn erase_object(&mut self, obj: &mut DynObject) -> Result<()> {
        self.rev += 1;
        let rev = self.rev;
        obj.metadata.resource_version = Some(rev.to_string());
        let (kind, name) = (obj.kind.clone(), obj.metadata.name.clone());
        self.delete(self.keys.object(&kind, &name));
        for r in &obj.metadata.owner_references {
            self.delete(self.keys.owner(&r.uid, &kind, &name));
        }
        self.log(rev, EventType::Deleted, obj)?;
        if let Some(uid) = obj.metadata.uid.clone() {
            self.delete(self.keys.uid_index(&uid));
            if boxery_store::TOMBSTONED_KINDS.contains(&kind.as_str()) {
                self.put(self.keys.tombstone(&uid), format!("{kind}/{name}"));
            }
        }
        Ok(())
    }
}
