//! The `ObjectStore` conformance suite (store/tests/conformance/mod.rs) for [`RemoteStore`]:
//! each store is a SQLite store in a temp home behind a real `ApiServer` (TLS, a full token)
//! on loopback, served from its own runtime thread; a second handle is another client of the
//! same server, as another machine (or the child process) opens it.

#[path = "../../store/tests/common/mod.rs"]
mod common;
#[path = "../../store/tests/conformance/mod.rs"]
#[macro_use]
mod conformance;

use std::path::PathBuf;
use std::sync::Arc;

use boxery_remote::{Client, Context, RemoteStore};
use boxery_store::ObjectStore;
use boxery_verbs::{Env, Verbs, Voice};
use conformance::{Implementation, Subject};

struct Remote;

/// A running API server; stopped (and its thread joined) when dropped.
struct Server {
    _dir: tempfile::TempDir,
    stop: tokio_util::sync::CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `URL HOME UID`: what a second handle needs (the CA and token live in HOME).
fn address(url: &str, home: &std::path::Path, uid: &str) -> String {
    format!("{url} {} {uid}", home.display())
}

fn client(address: &str) -> (Client, String) {
    let mut parts = address.splitn(3, ' ');
    let (url, home, uid) = (
        parts.next().expect("url"),
        PathBuf::from(parts.next().expect("home")),
        parts.next().expect("uid").to_string(),
    );
    let ctx = Context {
        name: "conformance".into(),
        server: url.into(),
        ca_pem: std::fs::read(boxery_apiserver::tls::ca_file(&home)).expect("CA"),
        token: std::fs::read_to_string(home.join("test-token")).expect("token"),
        home: home.join("client"),
    };
    (Client::new(&ctx).expect("client"), uid)
}

impl Implementation for Remote {
    fn fresh(&self) -> Subject {
        let dir = tempfile::tempdir().expect("temp dir");
        let home = dir.path().join("home");
        std::fs::create_dir_all(&home).expect("home");
        let store = common::open(&home.join("store.db"));
        let uid = store.uid().to_string();
        let token = boxery_apiserver::tokens::mint(
            &home,
            "conformance",
            &boxery_apiserver::tokens::Scope::Full,
        )
        .expect("token");
        std::fs::write(home.join("test-token"), &token).expect("token file");
        let stop = tokio_util::sync::CancellationToken::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn({
            let (home, stop) = (home.clone(), stop.clone());
            move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let env = Env::resolve(Some(home), Some("fake".into())).expect("env");
                    let verbs = Verbs::with_store(env, Voice::Cli, Arc::new(store), true);
                    let limits = boxery_apiserver::Limits {
                        rate_per_token: 1e9,
                        burst_per_token: 1e9,
                        ..Default::default()
                    };
                    let server = boxery_apiserver::ApiServer::bind(
                        verbs,
                        "127.0.0.1:0".parse().expect("addr"),
                        limits,
                    )
                    .await
                    .expect("bind");
                    tx.send(server.local_addr()).expect("send");
                    server.run(stop).await;
                });
            }
        });
        let at = rx.recv().expect("the server started");
        let address = address(&format!("https://{at}"), &home, &uid);
        let store: Arc<dyn ObjectStore> = self.open(&address);
        Subject {
            store,
            control: self.open_control(&address),
            address,
            keep: Box::new(Server {
                _dir: dir,
                stop,
                thread: Some(thread),
            }),
        }
    }

    fn open(&self, address: &str) -> Arc<dyn ObjectStore> {
        let (client, uid) = client(address);
        Arc::new(RemoteStore::with_uid(client, uid))
    }

    /// The store behind the server, opened as its control plane does: a context's token may
    /// not write status, adopt, lead or compact (`a_context_makes_no_control_plane_call`).
    fn open_control(&self, address: &str) -> Arc<dyn ObjectStore> {
        let home = address.split(' ').nth(1).expect("home");
        Arc::new(common::open(&PathBuf::from(home).join("store.db")))
    }
}

conformance::suite!(Remote);

/// `connect` finds the same identity the server's store has, and a token that is not the
/// home's is refused with the API's reason.
#[tokio::test(flavor = "multi_thread")]
async fn connect_checks_the_token_and_reads_the_identity() {
    let sub = Remote.fresh();
    let (c, uid) = client(&sub.address);
    let s = RemoteStore::connect(c).await.expect("connect");
    assert_eq!(s.uid(), uid);
    let mut parts = sub.address.splitn(3, ' ');
    let (url, home) = (parts.next().unwrap(), PathBuf::from(parts.next().unwrap()));
    let ctx = Context {
        name: "stranger".into(),
        server: url.into(),
        ca_pem: std::fs::read(boxery_apiserver::tls::ca_file(&home)).unwrap(),
        token: "not-a-token".into(),
        home: home.join("client"),
    };
    let e = RemoteStore::connect(Client::new(&ctx).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("401") && e.contains("stranger"), "{e}");
}

/// A context (a full token through the store calls) makes none of the control plane's calls:
/// no status write of any kind (a Grant's is its approval, at the VM host's terminal), no
/// adoption, leadership or compaction, no PoolMember or Event; each is `Forbidden` (403)
/// saying who does it, and writes nothing. A create keeps no status it is sent. The control:
/// the same store's own handle makes each of them.
#[tokio::test(flavor = "multi_thread")]
async fn a_context_makes_no_control_plane_call() {
    use boxery_store::{Candidate, StoreError};
    let sub = Remote.fresh();
    let obj = |kind: &str, name: &str, status: serde_json::Value| {
        let mut o = common::vm(name);
        o.kind = kind.into();
        if !status.is_null() {
            o.rest.insert("status".into(), status);
        }
        o
    };
    let s = &sub.store;
    let vm = s
        .create(obj("Vm", "v1", serde_json::json!({"phase": "Running"})))
        .await
        .unwrap();
    assert_ne!(
        vm.rest["status"]["phase"], "Running",
        "a create keeps no status it is sent"
    );
    let grant = serde_json::from_value::<boxery_api::DynObject>(serde_json::json!({
        "apiVersion": "boxery.dev/v1alpha1", "kind": "Grant", "metadata": {"name": "g1"},
        "spec": {"vm": "v1", "type": "env", "env": {"name": "K", "valueFrom": {"command": ["id"]}}},
        "status": {"phase": "Applied", "approvedBy": "root", "approvedGeneration": 1}
    }))
    .unwrap();
    if let Ok(g) = s.create(grant).await {
        assert_eq!(g.rest["status"].get("approvedBy"), None, "{g:?}");
    }
    let at = s.list("Vm", &Default::default()).await.unwrap().1;
    let forbidden = |what: &str, r: Result<(), StoreError>| match r {
        Err(StoreError::Forbidden { why }) => why,
        other => panic!("{what}: want Forbidden, got {other:?}"),
    };
    let me = Candidate::current("intruder");
    let ttl = std::time::Duration::from_secs(60);
    let why = forbidden(
        "grant status",
        s.update_status(obj(
            "Grant",
            "g1",
            serde_json::json!({"phase": "Applied", "approvedBy": "x"}),
        ))
        .await
        .map(drop),
    );
    assert!(
        why.contains("terminal") && why.contains("boxery grant approve"),
        "{why}"
    );
    let mut running = vm.clone();
    running
        .rest
        .insert("status".into(), serde_json::json!({"phase": "Running"}));
    forbidden(
        "vm status",
        s.update_status(running.clone()).await.map(drop),
    );
    forbidden(
        "adopt",
        s.adopt(
            obj("Vm", "v2", serde_json::Value::Null),
            "1b8a3c1e-5d6f-4a7b-9c8d-1e2f3a4b5c6d",
        )
        .await
        .map(drop),
    );
    forbidden("compact", s.compact(0).await.map(drop));
    forbidden(
        "lead",
        s.try_lead("boxery-controllers", &me, ttl).await.map(drop),
    );
    forbidden("resign", s.resign("boxery-controllers", &me).await);
    forbidden(
        "pool member",
        s.create(obj("PoolMember", "m", serde_json::Value::Null))
            .await
            .map(drop),
    );
    assert_eq!(
        s.list("Vm", &Default::default()).await.unwrap().1,
        at,
        "nothing was written"
    );
    // the control: the store's own handle makes them
    let c = &sub.control;
    c.update_status(running).await.unwrap();
    assert!(matches!(
        c.try_lead("boxery-controllers", &me, ttl).await.unwrap(),
        boxery_store::Leadership::Leader { .. }
    ));
}
