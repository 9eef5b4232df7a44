//! Fixtures shared by the store's integration tests: real SQLite files in temp dirs, object
//! builders, a table dump, and child processes that are cleaned up even when a test fails.

#![allow(dead_code)] // each test file uses its own subset

use std::path::Path;
use std::process::{Child, Command};

use boxery_api::{API_VERSION, DynObject, OwnerReference};
use boxery_store::{Store, StoreOptions};
use serde_json::{Value, json};

/// A store in a fresh temp dir (kept alive by the returned guard), without auto-compaction.
pub fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("store.db"));
    (dir, store)
}

/// Open `path` without auto-compaction.
pub fn open(path: &Path) -> Store {
    Store::open_with(
        path,
        StoreOptions {
            auto_compact: None,
            ..Default::default()
        },
    )
    .expect("open store")
}

fn obj(v: Value) -> DynObject {
    serde_json::from_value(v).expect("fixture parses")
}

/// A Vm made from the stock image.
pub fn vm(name: &str) -> DynObject {
    obj(
        json!({"apiVersion": API_VERSION, "kind": "Vm", "metadata": {"name": name},
               "spec": {"source": {"image": "debian-12"}}}),
    )
}

/// An Image captured from a VM.
pub fn image(name: &str) -> DynObject {
    obj(
        json!({"apiVersion": API_VERSION, "kind": "Image", "metadata": {"name": name},
               "spec": {"source": {"vm": "dev1"}}}),
    )
}

/// Builder-style changes to a fixture.
pub trait Fixture: Sized {
    /// With this label.
    fn label(self, k: &str, v: &str) -> Self;
    /// With this finalizer.
    fn finalizer(self, f: &str) -> Self;
    /// Owned by `owner` (which must carry a uid).
    fn owned_by(self, owner: &DynObject) -> Self;
    /// With `spec.resources.cpus` set.
    fn cpus(self, n: u32) -> Self;
}

impl Fixture for DynObject {
    fn label(mut self, k: &str, v: &str) -> Self {
        self.metadata.labels.insert(k.into(), v.into());
        self
    }
    fn finalizer(mut self, f: &str) -> Self {
        self.metadata.finalizers.push(f.into());
        self
    }
    fn owned_by(mut self, owner: &DynObject) -> Self {
        self.metadata.owner_references.push(OwnerReference {
            api_version: API_VERSION.into(),
            kind: owner.kind.clone(),
            name: owner.metadata.name.clone(),
            uid: owner.metadata.uid.clone().expect("owner has a uid"),
            controller: Some(true),
        });
        self
    }
    fn cpus(mut self, n: u32) -> Self {
        let spec = self
            .rest
            .get_mut("spec")
            .and_then(Value::as_object_mut)
            .expect("spec");
        let res = spec.entry("resources").or_insert_with(|| json!({}));
        res["cpus"] = json!(n);
        self
    }
}

/// Every row of every table, in a stable order: a byte-for-byte picture of the store.
pub fn dump(path: &Path) -> String {
    let conn = rusqlite::Connection::open(path).expect("open for dump");
    let mut out = String::new();
    for q in [
        "SELECT key || '=' || value FROM meta ORDER BY key",
        "SELECT kind || '/' || name || ' ' || uid || ' ' || rev || ' ' || json FROM objects ORDER BY kind, name",
        "SELECT owner_uid || ' ' || kind || '/' || name FROM owners ORDER BY 1",
        "SELECT rev || ' ' || type || ' ' || kind || '/' || name || ' ' || json FROM log ORDER BY rev",
    ] {
        let mut stmt = conn.prepare(q).expect("dump query");
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .expect("dump rows");
        for r in rows {
            out.push_str(&r.expect("dump row"));
            out.push('\n');
        }
        out.push_str("--\n");
    }
    out
}

/// A child process killed and reaped when dropped (also when the test panics).
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Spawn `cmd`.
    pub fn spawn(cmd: &mut Command) -> ChildGuard {
        ChildGuard(cmd.spawn().expect("spawn child"))
    }
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
    /// Kill it and wait until it is reaped.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}
