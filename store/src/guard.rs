//! Who may write what: the one check between the store and every writer that is not the
//! control plane itself or a person at the VM host.
//!
//! The controllers and the owner's own `boxery` on the VM host write the store as it is (they
//! can open `store.db` anyway). Everyone else writes through a [`Guarded`] store, which knows
//! who it speaks for ([`Writer`]) and applies one table of rules before the call reaches the
//! store:
//!
//! | field | who writes it |
//! |---|---|
//! | `status` of every kind | the controllers; a Grant's (its approval) a person at the VM host's terminal; a Source's whoever runs `boxery sync` (a remote one too) |
//! | `metadata.labels`/`annotations` under `boxery.dev/` | boxery's own code (controllers, the verbs of a `boxery`, local or through a context); never a Kubernetes client |
//! | PoolMember and Event objects | the controllers only |
//! | a uid (adopting an orphan), leadership, compaction | the VM host only |
//! | a lease's VM, through a `lease:` token | its spec but `source`, `layers`, `headless`; a restore only from that VM's own images (its snapshots and its pool's clean image) |
//! | a Lease, through its own `lease:` token | only `spec.renewTime` (set to the server's clock: a renewal) and its deletion (a release) |
//!
//! # Guarantees
//! - No [`Writer`] makes a status write but a Source's by a [`Writer::Remote`]; `create` drops
//!   the status it is sent (as the Kubernetes API does for kinds with a status subresource),
//!   `adopt` is refused, `update` keeps the stored status (the store's own rule).
//! - Every refusal is [`StoreError::Forbidden`], whose message says who may do it instead.
//! - Reads pass through unchanged: what a writer may *see* is its surface's business
//!   (`apiserver::scope`).
//!
//! # Caveats
//! - A lease's rules are checked against the object stored when the call arrives; a change
//!   made by someone else between that read and the write is caught by the store's
//!   `resourceVersion` precondition only when the caller sent one.

use std::time::Duration;

use async_trait::async_trait;
use boxery_api::DynObject;
use serde_json::Value;

use crate::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, Leadership, ObjectRef, ObjectStore,
    Result, StoreError,
};

/// The prefix of the labels and annotations that are boxery's own.
pub const SYSTEM_PREFIX: &str = crate::fields::SYSTEM_PREFIX;

/// Who a [`Guarded`] store writes for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writer {
    /// A `full` API token through the store calls: a `boxery` on another machine running its
    /// verbs (`--context`).
    Remote,
    /// A `full` API token through the Kubernetes API (kubectl, client libraries).
    Kubernetes,
    /// A `lease:NAME` API token through the Kubernetes API: its lease and that lease's VM.
    Lease(String),
}

impl Writer {
    /// How the caller is named in refusals.
    fn who(&self) -> String {
        match self {
            Writer::Remote => "an API token (a boxery context)".into(),
            Writer::Kubernetes => "an API token".into(),
            Writer::Lease(l) => format!("lease {l}'s token"),
        }
    }

    /// Whether its writes may touch `boxery.dev/` labels and annotations: boxery's own verbs
    /// (run through a context) may, a Kubernetes client never.
    fn writes_system_metadata(&self) -> bool {
        matches!(self, Writer::Remote)
    }
}

/// Who writes the status of `kind`, in a refusal's words.
fn status_author(kind: &str) -> &'static str {
    match kind {
        "Grant" => {
            "a grant's approval is a person's decision at the VM host's terminal (`boxery grant approve NAME` there), never an API call's"
        }
        "Source" => "a Source's status is written by `boxery sync`",
        _ => "status is written by boxery's controllers, from what the backend observes",
    }
}

/// Whether `w` may write the status of `kind`.
fn may_write_status(w: &Writer, kind: &str) -> bool {
    kind == "Source" && *w == Writer::Remote
}

fn forbidden(why: impl Into<String>) -> StoreError {
    StoreError::Forbidden { why: why.into() }
}

/// The kind as stored (`vm` in a manifest is `Vm`).
fn kind_of(kind: &str) -> &str {
    boxery_api::lookup_kind(kind).map_or(kind, |k| k.kind)
}

/// Refused for kinds only the controllers write.
fn writable_kind(w: &Writer, kind: &str) -> Result<()> {
    match boxery_api::lookup_kind(kind).and_then(|k| k.controllers_only) {
        Some(instead) => Err(forbidden(format!(
            "{} cannot write {} objects: they are boxery's controllers' ({instead})",
            w.who(),
            kind_of(kind)
        ))),
        None => Ok(()),
    }
}

/// The `boxery.dev/` entries of a label or annotation map.
fn system(m: &std::collections::BTreeMap<String, String>) -> Vec<(&String, &String)> {
    m.iter()
        .filter(|(k, _)| k.starts_with(SYSTEM_PREFIX))
        .collect()
}

/// Refused when `new`'s `boxery.dev/` labels or annotations differ from `cur`'s (absent for a
/// new object), for a writer that may not touch them. `partial`: `new` is an apply's manifest,
/// which the store merges into `cur`: only the keys it names are compared.
fn system_metadata_kept(
    w: &Writer,
    cur: Option<&DynObject>,
    new: &DynObject,
    partial: bool,
) -> Result<()> {
    if w.writes_system_metadata() {
        return Ok(());
    }
    let empty = Default::default();
    for (what, now, given) in [
        (
            "labels",
            cur.map_or(&empty, |c| &c.metadata.labels),
            &new.metadata.labels,
        ),
        (
            "annotations",
            cur.map_or(&empty, |c| &c.metadata.annotations),
            &new.metadata.annotations,
        ),
    ] {
        let changed = if partial {
            // a manifest merged into the stored object: what it names must be as stored
            system(given)
                .into_iter()
                .any(|(k, v)| now.get(k) != Some(v))
        } else {
            system(now) != system(given)
        };
        if changed {
            return Err(forbidden(format!(
                "{} cannot set, change or remove metadata.{what} under {SYSTEM_PREFIX} on {}/{}: they are boxery's own",
                w.who(),
                new.kind,
                new.metadata.name
            )));
        }
    }
    Ok(())
}

/// A store that writes for a [`Writer`], under the rules of the module documentation.
#[derive(Debug)]
pub struct Guarded<S: ?Sized> {
    inner: std::sync::Arc<S>,
    writer: Writer,
}

impl<S: ObjectStore + ?Sized> Guarded<S> {
    /// `inner`, written through for `writer`.
    pub fn new(inner: std::sync::Arc<S>, writer: Writer) -> Self {
        Guarded { inner, writer }
    }

    /// Who it writes for.
    pub fn writer(&self) -> &Writer {
        &self.writer
    }

    /// The stored object `obj` replaces, or `NotFound`.
    async fn current(&self, obj: &DynObject) -> Result<DynObject> {
        let key = ObjectRef::new(kind_of(&obj.kind), obj.metadata.name.clone());
        self.inner
            .get(&key)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: key.kind.clone(),
                name: key.name.clone(),
                plural: boxery_api::lookup_kind(&key.kind)
                    .map_or(key.kind.to_lowercase(), |k| k.plural.to_string()),
            })
    }

    /// The checks of an update (and of an apply's manifest, `partial`), with what a lease's
    /// renewal sets.
    async fn check_update(&self, new: &mut DynObject, partial: bool) -> Result<()> {
        writable_kind(&self.writer, &new.kind)?;
        let cur = match self.current(new).await {
            Ok(c) => Some(c),
            Err(StoreError::NotFound { .. }) if partial => None,
            Err(e) => return Err(e),
        };
        system_metadata_kept(&self.writer, cur.as_ref(), new, partial)?;
        if let Writer::Lease(lease) = &self.writer {
            let Some(cur) = cur else {
                return Err(forbidden(format!(
                    "lease {lease}'s token creates nothing: it reaches its lease and its VM"
                )));
            };
            self.lease_may_change(lease, &cur, new, partial).await?;
        }
        Ok(())
    }

    /// What a lease token may change on its lease or its lease's VM (`apiserver::scope` let
    /// the call reach only those two objects).
    async fn lease_may_change(
        &self,
        lease: &str,
        cur: &DynObject,
        new: &mut DynObject,
        partial: bool,
    ) -> Result<()> {
        let spec_of = |o: &DynObject| o.rest.get("spec").cloned().unwrap_or(Value::Null);
        let (was, mut now) = (spec_of(cur), spec_of(new));
        // an apply's manifest names only what it sets: compare those fields
        let field = |spec: &Value, k: &str| spec.get(k).cloned();
        let named = |k: &str| !partial || now.get(k).is_some();
        match kind_of(&new.kind) {
            "Lease" => {
                let mut same = true;
                if let (Some(a), Some(b)) = (was.as_object(), now.as_object()) {
                    for k in a.keys().chain(b.keys()) {
                        if k != "renewTime" && named(k) && a.get(k) != b.get(k) {
                            same = false;
                        }
                    }
                }
                if !same {
                    return Err(forbidden(format!(
                        "lease {lease}'s token may only renew its lease (a change of spec.renewTime) or release it (delete): its pool, holder, key and duration are set when it is acquired"
                    )));
                }
                if field(&was, "renewTime") != field(&now, "renewTime") && named("renewTime") {
                    // a renewal is now, by the server's clock: never a time the holder picks
                    now["renewTime"] = serde_json::to_value(boxery_api::now())?;
                    new.rest.insert("spec".into(), now);
                }
                Ok(())
            }
            "Vm" => {
                for k in ["source", "layers", "headless"] {
                    if named(k) && field(&was, k) != field(&now, k) {
                        return Err(forbidden(format!(
                            "lease {lease}'s token cannot change spec.{k} of VM {}: a pool's member keeps its template's",
                            new.metadata.name
                        )));
                    }
                }
                let restore = field(&now, "restore");
                if named("restore")
                    && restore != field(&was, "restore")
                    && let Some(image) = restore
                        .as_ref()
                        .and_then(|r| r.get("image"))
                        .and_then(Value::as_str)
                {
                    self.own_image(lease, &new.metadata.name, image).await?;
                }
                Ok(())
            }
            other => Err(forbidden(format!(
                "lease {lease}'s token cannot write {other} objects"
            ))),
        }
    }

    /// Refused unless Image `image` was made from VM `vm` (its snapshots, its pool's clean
    /// image): a lease never reimages its VM from someone else's disk.
    async fn own_image(&self, lease: &str, vm: &str, image: &str) -> Result<()> {
        let img = self.inner.get(&ObjectRef::new("Image", image)).await?;
        let from = img
            .as_ref()
            .and_then(|i| i.rest.get("spec"))
            .and_then(|s| s.pointer("/source/vm"))
            .and_then(Value::as_str);
        if from == Some(vm) {
            return Ok(());
        }
        Err(forbidden(format!(
            "lease {lease}'s token restores VM {vm} only from that VM's own images (its snapshots and its pool's clean image {vm}.boxery-clean); image {} is not one",
            boxery_api::name::shown(image)
        )))
    }

    /// Refused to every guarded writer: the VM host's business.
    fn host_only(&self, what: &str) -> StoreError {
        forbidden(format!(
            "{} cannot {what}: only the control plane on the VM host does",
            self.writer.who()
        ))
    }
}

#[async_trait]
impl<S: ObjectStore + ?Sized> ObjectStore for Guarded<S> {
    crate::reads_from!(inner);

    async fn create_by(&self, mut obj: DynObject, manager: &str) -> Result<DynObject> {
        writable_kind(&self.writer, &obj.kind)?;
        if let Writer::Lease(l) = &self.writer {
            return Err(forbidden(format!(
                "lease {l}'s token creates nothing: it reaches its lease and its VM"
            )));
        }
        system_metadata_kept(&self.writer, None, &obj, false)?;
        // as the Kubernetes API does for a kind with a status subresource: the controllers
        // write status, from what they observe
        obj.rest.remove("status");
        self.inner.create_by(obj, manager).await
    }

    async fn adopt(&self, _obj: DynObject, _uid: &str) -> Result<DynObject> {
        Err(self
            .host_only("adopt an orphan (`boxery orphans adopt` on the VM host reads its backend)"))
    }

    async fn update_by(&self, mut obj: DynObject, manager: &str) -> Result<DynObject> {
        self.check_update(&mut obj, false).await?;
        self.inner.update_by(obj, manager).await
    }

    async fn update_dry_run_by(&self, mut obj: DynObject, manager: &str) -> Result<DynObject> {
        self.check_update(&mut obj, false).await?;
        self.inner.update_dry_run_by(obj, manager).await
    }

    async fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        let kind = kind_of(&obj.kind);
        if !may_write_status(&self.writer, kind) {
            return Err(forbidden(format!(
                "{} cannot write the status of {kind} {}: {}",
                self.writer.who(),
                obj.metadata.name,
                status_author(kind)
            )));
        }
        self.inner.update_status(obj).await
    }

    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome> {
        writable_kind(&self.writer, &key.kind)?;
        if let Writer::Lease(l) = &self.writer
            && !(kind_of(&key.kind) == "Lease" && key.name == *l)
        {
            return Err(forbidden(format!(
                "lease {l}'s token deletes nothing but its own lease (a release)"
            )));
        }
        self.inner.delete(key).await
    }

    async fn apply_all(
        &self,
        mut objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        if opts.prune.is_some() && matches!(self.writer, Writer::Lease(_)) {
            return Err(forbidden(
                "a lease token cannot prune: it deletes nothing but its own lease",
            ));
        }
        for o in &mut objs {
            // an apply never writes status (the store drops a manifest's)
            self.check_update(o, true).await?;
        }
        self.inner.apply_all(objs, opts).await
    }

    async fn compact(&self, _keep_revisions: u64) -> Result<u64> {
        Err(self.host_only("compact the store's history"))
    }

    async fn try_lead(&self, _lock: &str, _me: &Candidate, _ttl: Duration) -> Result<Leadership> {
        Err(self.host_only("take the controllers' leadership"))
    }

    async fn resign(&self, _lock: &str, _me: &Candidate) -> Result<()> {
        Err(self.host_only("give up the controllers' leadership"))
    }
}

#[cfg(test)]
mod tests {
    //! The table of who may write what: writer × kind × field, against a real store.

    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::Store;

    fn obj(v: Value) -> DynObject {
        serde_json::from_value(v).unwrap()
    }

    fn vm(name: &str, labels: Value) -> DynObject {
        obj(json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
            "metadata": {"name": name, "labels": labels},
            "spec": {"source": {"image": "tiny"}, "resources": {"cpus": 1}}}))
    }

    fn grant(name: &str) -> DynObject {
        obj(json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Grant",
            "metadata": {"name": name},
            "spec": {"vm": "a", "type": "env", "target": "X", "valueFrom": {"command": ["id"]}},
            "status": {"phase": "Applied", "approvedBy": "root", "approvedGeneration": 1}}))
    }

    fn lease(name: &str) -> DynObject {
        obj(json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Lease",
            "metadata": {"name": name},
            "spec": {"pool": "p", "holderIdentity": "alice", "leaseDurationSeconds": 600,
                     "publicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIO4xKVp2PnpcVp3iDyM9OUxaI3wD/3oXfDqJm+Ww1Cpm a"}}))
    }

    fn image(name: &str, from_vm: &str) -> DynObject {
        obj(json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": name}, "spec": {"source": {"vm": from_vm}}}))
    }

    /// A store holding VMs `a` (labelled as a Source's) and `b`, Lease `l1` (whose VM is `a`),
    /// Grant `g`, a PoolMember `a`, Source `s`, and images of `a` and of `b`.
    async fn fixture() -> (tempfile::TempDir, Arc<Store>) {
        let d = tempfile::tempdir().unwrap();
        let s = Arc::new(Store::open(&d.path().join("s.db")).unwrap());
        s.create(vm("a", json!({"boxery.dev/applyset": "s", "team": "x"})))
            .unwrap();
        s.create(vm("b", json!({}))).unwrap();
        s.create(lease("l1")).unwrap();
        s.create(grant("g")).unwrap();
        s.create(image("a.snap", "a")).unwrap();
        s.create(image("b.snap", "b")).unwrap();
        s.create(obj(
            json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "Source",
            "metadata": {"name": "s"}, "spec": {"url": "/tmp/x"}}),
        ))
        .unwrap();
        s.create(obj(
            json!({"apiVersion": "boxery.dev/v1alpha1", "kind": "PoolMember",
            "metadata": {"name": "a"}, "spec": {"pool": "p", "created": true}}),
        ))
        .unwrap();
        (d, s)
    }

    fn guarded(s: &Arc<Store>, w: Writer) -> Guarded<Store> {
        Guarded::new(s.clone(), w)
    }

    fn all_writers() -> [Writer; 3] {
        [
            Writer::Remote,
            Writer::Kubernetes,
            Writer::Lease("l1".into()),
        ]
    }

    fn forbidden<T: std::fmt::Debug>(r: Result<T>, why: &str) {
        match r {
            Err(StoreError::Forbidden { .. }) => {}
            other => panic!("{why}: expected Forbidden, got {other:?}"),
        }
    }

    async fn current(s: &Store, kind: &str, name: &str) -> DynObject {
        ObjectStore::get(s, &ObjectRef::new(kind, name))
            .await
            .unwrap()
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn no_token_writes_status_and_a_created_grant_is_never_approved() {
        let (_d, s) = fixture().await;
        for w in [Writer::Remote, Writer::Kubernetes] {
            // a create keeps nothing of the status it is sent
            let name = format!("g-{}", w.who().len());
            let made = guarded(&s, w.clone()).create_by(grant(&name), "x").await;
            let made = made.unwrap_or_else(|e| panic!("{w:?}: {e}"));
            let status = made.rest.get("status").cloned().unwrap_or_default();
            assert_eq!(status.get("approvedBy"), None, "{w:?}: {status}");
            assert_eq!(status.get("approvedGeneration"), None, "{w:?}: {status}");
            // adopting with a uid (and a status) is the VM host's
            let mut v = vm("c", json!({}));
            v.rest.insert("status".into(), json!({"phase": "Running"}));
            forbidden(guarded(&s, w.clone()).adopt(v, "u-1").await, "adopt");
        }
        // a status write of every kind, by every writer: refused (a Source's by a context's
        // sync aside); the Vm's ssh endpoint and the Grant's approval above all
        for w in all_writers() {
            for (kind, name, status) in [
                ("Vm", "a", json!({"ssh": {"endpoint": "127.0.0.1:1"}})),
                (
                    "Grant",
                    "g",
                    json!({"approvedBy": "root", "approvedGeneration": 1}),
                ),
                ("Lease", "l1", json!({"phase": "Bound", "vm": "b"})),
                ("Image", "a.snap", json!({"phase": "Ready"})),
                ("PoolMember", "a", json!({"state": "Free"})),
                ("Source", "s", json!({"revision": "x"})),
            ] {
                let mut o = current(&s, kind, name).await;
                o.rest.insert("status".into(), status);
                let r = guarded(&s, w.clone()).update_status(o).await;
                if kind == "Source" && w == Writer::Remote {
                    r.unwrap_or_else(|e| panic!("a context's sync records its Source: {e}"));
                } else {
                    forbidden(r, &format!("{w:?} status of {kind}"));
                }
            }
        }
        let g = current(&s, "Grant", "g").await;
        assert_eq!(g.rest["status"].get("approvedBy"), Some(&json!("root")));
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_controllers_kinds_the_host_calls_and_system_metadata() {
        let (_d, s) = fixture().await;
        for w in all_writers() {
            let member = current(&s, "PoolMember", "a").await;
            forbidden(
                guarded(&s, w.clone()).update_by(member, "x").await,
                "PoolMember update",
            );
            forbidden(
                guarded(&s, w.clone())
                    .delete(&ObjectRef::new("PoolMember", "a"))
                    .await,
                "PoolMember delete",
            );
            let g = guarded(&s, w.clone());
            forbidden(g.compact(1).await, "compact");
            let me = crate::Candidate::current("intruder");
            forbidden(
                g.try_lead("controllers", &me, Duration::from_secs(5)).await,
                "try_lead",
            );
            forbidden(g.resign("controllers", &me).await, "resign");
        }
        // boxery.dev/ labels: boxery's own verbs through a context may; a Kubernetes client
        // may neither remove, change nor add one, and keeps every other label its own
        for (w, may) in [(Writer::Remote, true), (Writer::Kubernetes, false)] {
            let mut a = current(&s, "Vm", "a").await;
            a.metadata.labels.remove("boxery.dev/applyset");
            let r = guarded(&s, w.clone()).update_dry_run_by(a, "x").await;
            assert_eq!(r.is_ok(), may, "{w:?} removing a system label: {r:?}");
            let mut c = vm("new-one", json!({"boxery.dev/pool": "p"}));
            c.metadata.name = format!("n{}", may as u8);
            let r = guarded(&s, w.clone()).create_by(c, "x").await;
            assert_eq!(r.is_ok(), may, "{w:?} creating with a system label: {r:?}");
            let mut a = current(&s, "Vm", "a").await;
            a.metadata.labels.insert("team".into(), "y".into());
            guarded(&s, w.clone())
                .update_dry_run_by(a, "x")
                .await
                .unwrap_or_else(|e| panic!("{w:?} own label: {e}"));
        }
        // an apply's manifest: what it names under boxery.dev/ must be as stored
        let k = guarded(&s, Writer::Kubernetes);
        let opts = ApplyOptions {
            dry_run: true,
            force_conflicts: true,
            ..Default::default()
        };
        let other = vm("a", json!({"boxery.dev/applyset": "other"}));
        forbidden(k.apply_all(vec![other], &opts).await, "apply changing");
        let same = vm("a", json!({"boxery.dev/applyset": "s"}));
        k.apply_all(vec![same], &opts).await.unwrap();
        let none = vm("a", json!({"team": "z"}));
        k.apply_all(vec![none], &opts).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_lease_token_renews_or_releases_its_lease_and_restores_only_its_vms_images() {
        let (_d, s) = fixture().await;
        let l = guarded(&s, Writer::Lease("l1".into()));
        // its Lease: nothing but a renewal, at the server's time
        for (field, value) in [
            ("holderIdentity", json!("mallory")),
            ("leaseDurationSeconds", json!(28800)),
            ("pool", json!("other")),
            ("publicKey", json!("ssh-ed25519 AAAA b")),
        ] {
            let mut o = current(&s, "Lease", "l1").await;
            o.rest.get_mut("spec").unwrap()[field] = value;
            forbidden(l.update_by(o, "x").await, field);
        }
        let mut o = current(&s, "Lease", "l1").await;
        o.rest.get_mut("spec").unwrap()["renewTime"] = json!("2999-01-01T00:00:00Z");
        let renewed = l.update_by(o, "x").await.unwrap();
        let at = renewed.rest["spec"]["renewTime"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(at.starts_with("20") && !at.starts_with("2999"), "{at}");
        // its VM: not its source; restores only from that VM's own images
        let mut a = current(&s, "Vm", "a").await;
        a.rest.get_mut("spec").unwrap()["source"] = json!({"image": "b.snap"});
        forbidden(l.update_dry_run_by(a, "x").await, "source");
        let restore = |image: &str| json!({"image": image, "requestedAt": "2026-12-04T00:00:00Z"});
        let mut a = current(&s, "Vm", "a").await;
        a.rest.get_mut("spec").unwrap()["restore"] = restore("b.snap");
        forbidden(l.update_dry_run_by(a, "x").await, "restore from b's image");
        let mut a = current(&s, "Vm", "a").await;
        a.rest.get_mut("spec").unwrap()["restore"] = restore("a.snap");
        a.rest.get_mut("spec").unwrap()["resources"] = json!({"cpus": 2});
        l.update_dry_run_by(a, "x").await.unwrap();
        // the same through an apply's manifest
        let mut m = vm("a", json!({}));
        m.rest.get_mut("spec").unwrap()["restore"] = restore("b.snap");
        let dry = ApplyOptions {
            dry_run: true,
            ..Default::default()
        };
        forbidden(l.apply_all(vec![m], &dry).await, "apply restore");
        // creates nothing, deletes nothing but its own lease
        forbidden(l.create_by(vm("c", json!({})), "x").await, "create");
        forbidden(l.delete(&ObjectRef::new("Vm", "a")).await, "delete vm");
        forbidden(l.delete(&ObjectRef::new("Lease", "l2")).await, "delete l2");
        l.delete(&ObjectRef::new("Lease", "l1")).await.unwrap();
    }
}
