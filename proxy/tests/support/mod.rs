//! A stand-in upstream that records what reaches it, and a proxy on a real home dir with
//! token and grant-state files written in the control plane's formats. Shared by the tests
//! and the benchmark.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use boxery_api::grant::{GrantSpec, GrantType, ValueFrom};
use boxery_home::grants::{Entry, StateFile};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// The stand-in upstream: `/…/stream` answers SSE (one event at once, the rest after
/// [`Upstream::finish`]); every other path answers `{"ok":true}` after reading the body.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub release: Arc<Notify>,
    /// Connections accepted so far.
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Upstream {
    pub async fn start(stop: CancellationToken) -> Upstream {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = Upstream {
            addr: l.local_addr().unwrap(),
            seen: Arc::default(),
            release: Arc::new(Notify::new()),
            connections: Arc::default(),
        };
        let app = axum::Router::new().fallback(record).with_state(up.clone());
        let n = up.connections.clone();
        use axum::serve::ListenerExt;
        let l = l.tap_io(move |tcp| {
            let _ = tcp.set_nodelay(true);
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        tokio::spawn(async move {
            axum::serve(l, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .unwrap()
        });
        up
    }
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    /// Let a held stream finish.
    pub fn finish(&self) {
        self.release.notify_one();
    }
}

async fn record(State(up): State<Upstream>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    up.seen.lock().unwrap().push(Seen {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        headers: parts.headers.clone(),
        body,
    });
    if parts.uri.path().ends_with("/stream") {
        let release = up.release.clone();
        let events = async_stream(release);
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(events))
            .unwrap();
    }
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from("{\"ok\":true}"))
        .unwrap()
}

fn async_stream(
    release: Arc<Notify>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures::stream::unfold(0u8, move |step| {
        let release = release.clone();
        async move {
            match step {
                0 => Some((Ok(Bytes::from_static(b"event: first\ndata: {}\n\n")), 1)),
                1 => {
                    release.notified().await;
                    Some((Ok(Bytes::from_static(b"event: last\ndata: {}\n\n")), 2))
                }
                _ => None,
            }
        }
    })
}

/// A control plane's home with a proxy serving it.
pub struct Fixture {
    pub home: tempfile::TempDir,
    pub secrets: tempfile::TempDir,
    pub upstream: Upstream,
    pub proxy: String,
    /// The proxy itself (for more listeners: a per-VM channel).
    pub server: boxery_proxy::Proxy,
    pub stop: CancellationToken,
}

pub const KEY: &str = "sk-real-key-5b1e-never-in-a-log";

impl Fixture {
    /// Start an upstream and a proxy whose providers and edge hosts all point at it.
    pub async fn start() -> Fixture {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(f: impl FnOnce(&mut boxery_api::config::ProxyConfig)) -> Fixture {
        let stop = CancellationToken::new();
        let upstream = Upstream::start(stop.clone()).await;
        let home = tempfile::Builder::new()
            .prefix("boxery-proxy-")
            .tempdir()
            .unwrap();
        let secrets = tempfile::tempdir().unwrap();
        std::fs::write(secrets.path().join("key"), format!("{KEY}\n")).unwrap();
        let mut cfg = boxery_api::config::ProxyConfig::default();
        for p in ["anthropic", "openai", "ollama"] {
            cfg.upstreams.insert(p.into(), upstream.url());
        }
        for h in ["api.example.com", "github.com", "api.github.com"] {
            cfg.hosts.insert(h.into(), upstream.url());
        }
        f(&mut cfg);
        let proxy = boxery_proxy::Proxy::new(home.path(), cfg).unwrap();
        let l = boxery_proxy::Proxy::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = l.local_addr().unwrap();
        let server = proxy.clone();
        tokio::spawn(proxy.serve(l, stop.clone()));
        Fixture {
            home,
            secrets,
            upstream,
            proxy: format!("http://{addr}"),
            server,
            stop,
        }
    }

    pub fn home(&self) -> &Path {
        self.home.path()
    }

    pub fn key_file(&self) -> PathBuf {
        self.secrets.path().join("key")
    }

    /// Give `vm` a token owned by `owner`; returns it.
    pub fn token(&self, vm: &str, owner: &str) -> String {
        let t = format!("bxt_{vm}_{owner}_{}", uuid_ish());
        boxery_home::tokens::write(self.home(), vm, owner, &t).unwrap();
        t
    }

    /// Put grant `name` in force on `vm` (bound to `owner`: the VM's uid, or a lease's).
    #[allow(clippy::too_many_arguments)]
    pub fn grant(
        &self,
        vm: &str,
        name: &str,
        type_: GrantType,
        target: &str,
        header: Option<&str>,
        owner: &str,
        lease: bool,
    ) {
        let mut state = self.state(vm);
        state.grants.retain(|e| e.name != name);
        state.grants.push(Entry {
            name: name.into(),
            uid: format!("uid-{name}"),
            generation: 1,
            spec: GrantSpec {
                limits: None,
                vm: (!lease).then(|| vm.to_string()),
                lease: lease.then(|| "l1".to_string()),
                type_,
                target: target.into(),
                header: header.map(str::to_string),
                value_from: ValueFrom::File(self.key_file().display().to_string()),
            },
            vm_uid: if lease {
                format!("vmuid-{vm}")
            } else {
                owner.into()
            },
            lease_uid: lease.then(|| owner.to_string()),
        });
        self.write_state(vm, &state);
    }

    /// Take grant `name` out of force.
    pub fn revoke(&self, vm: &str, name: &str) {
        let mut state = self.state(vm);
        state.grants.retain(|e| e.name != name);
        self.write_state(vm, &state);
    }

    fn state(&self, vm: &str) -> StateFile {
        std::fs::read(boxery_home::layout::grant_state(self.home(), vm))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(StateFile {
                vm: vm.into(),
                grants: vec![],
            })
    }

    fn write_state(&self, vm: &str, s: &StateFile) {
        std::fs::create_dir_all(boxery_home::layout::grants(self.home())).unwrap();
        std::fs::write(
            boxery_home::layout::grant_state(self.home(), vm),
            serde_json::to_vec(s).unwrap(),
        )
        .unwrap();
    }

    /// The audit log's text.
    pub fn audit(&self) -> String {
        std::fs::read_to_string(boxery_home::layout::audit_log(self.home())).unwrap_or_default()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn uuid_ish() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:x}{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A client that never goes through a system proxy.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Poll `f` (every 20 ms, up to 10 s) until it returns Some.
pub async fn eventually<T, F: std::future::Future<Output = Option<T>>>(
    mut f: impl FnMut() -> F,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last audit line containing `needle`, once there is one.
pub async fn eventually_line(f: &Fixture, needle: &str) -> String {
    eventually(|| async {
        f.audit()
            .lines()
            .rev()
            .find(|l| l.contains(needle))
            .map(str::to_string)
    })
    .await
    .unwrap_or_else(|| panic!("no audit line with {needle}: {}", f.audit()))
}
