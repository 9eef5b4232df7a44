//! boxery's credential proxy: code in a VM calls LLM providers and HTTP APIs through it with
//! its own token, and the proxy adds the real credential of a grant a person approved. It
//! runs inside `boxery serve` (`--proxy-listen`) and reads two control-plane files the
//! reconcilers keep: the token store (`boxery_home::tokens`) and the grant state
//! (`boxery_home::grants`). It never writes either, and never opens the store.
//!
//! Routes: `/llm/PROVIDER/PATH` (anthropic, openai, ollama, and any provider named in
//! `config.yaml`'s `proxy: {upstreams: …}`) and `/edge/HOST/PATH` (`http` grants on that host;
//! `github` grants on github.com and api.github.com for the granted repositories' paths).
//!
//! # Guarantees
//! - Every request's token is checked against the token file of its VM *at that moment*
//!   (constant-time compare): a token removed (VM deleted, lease ended) stops working at once.
//!   A token maps to exactly one VM.
//! - A grant is honoured only while its entry is in the VM's grant state file, read on every
//!   request, and only with the token of the owner it is bound to: a lease's grant with that
//!   lease's token, a VM's grant with the VM's own token.
//! - Every credential the client sent (`authorization`, `x-api-key`, `x-boxery-token`,
//!   `proxy-authorization`, `cookie`, …) is stripped before forwarding; the real one is added
//!   in the provider's header, marked sensitive. Values are resolved at request time and are
//!   never logged, audited, cached on disk, or echoed in an error.
//! - A refused request (no/wrong token, no grant, method or path outside the allowlist, body
//!   over the limit, WebSocket upgrade, too many in flight) never reaches the upstream: a
//!   body without a `content-length` is read up to the limit before anything is sent.
//! - Responses stream through as they arrive (SSE included): nothing buffers them.
//! - Every request, refused or not, is appended to the audit log ([`audit`]).
//! - Upstream redirects are returned to the client, never followed with a credential.
//!
//! # Assumptions
//! - The reconcilers of one control plane keep the token and grant files (`serve`, or an
//!   embedded control plane); removal before revocation is their guarantee.
//! - Whoever can connect to the listener is a VM or the owner: the token is what tells them
//!   apart. The default listener is loopback.
//!
//! # Caveats
//! - A token not yet known rescans `$BOXERY_HOME/tokens` (at most once per 250 ms unless the
//!   directory changed), so a wrong token costs a directory scan now and then.
//! - Config (`proxy:` in `config.yaml`) is read when `serve` starts.

mod admit;
pub mod audit;
pub mod channels;
pub mod dns;
pub mod egress;
mod forward;
pub mod routes;
pub mod secret;
mod token;
mod usage;

/// The accounting's cost per request, for `cargo bench -p boxery-proxy`.
#[doc(hidden)]
pub use usage::bench_per_request;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_api::config::ProxyConfig;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::audit::Audit;
use crate::secret::Secrets;
use crate::token::TokenIndex;

/// Default request body limit: 32 MiB.
pub const MAX_BODY: u64 = 32 * 1024 * 1024;
/// Default time limit of one request, response stream included: 10 minutes.
pub const TIMEOUT: Duration = Duration::from_secs(600);
/// Default number of requests one VM may have in flight.
pub const CONCURRENCY: usize = 64;
/// The default listening address of `boxery serve --proxy-listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";

/// Failures to start the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The HTTP client could not be built.
    #[error("cannot build the proxy's HTTP client")]
    Client(#[source] reqwest::Error),
    /// An upstream in the config is not an http(s) URL.
    #[error("config.yaml: proxy: `{0}` is not an http:// or https:// URL")]
    BadUpstream(String),
    /// The listener could not be bound.
    #[error("cannot listen on {addr} for the credential proxy: choose another --proxy-listen")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Serving stopped with an error.
    #[error("the credential proxy stopped")]
    Serve(#[source] std::io::Error),
}

/// The limits applied to every route.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The largest request body.
    pub max_body: u64,
    /// The longest a request may take, response included.
    pub timeout: Duration,
    /// Requests in flight per VM.
    pub concurrency: usize,
}

/// The proxy: cheap to clone, one per control plane.
#[derive(Clone, Debug)]
pub struct Proxy {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    home: PathBuf,
    config: ProxyConfig,
    limits: Limits,
    client: reqwest::Client,
    tokens: TokenIndex,
    secrets: Secrets,
    audit: Audit,
    in_flight: Mutex<HashMap<String, Arc<Semaphore>>>,
    egress_connections: usize,
    local: egress::Local,
    accounting: usage::Accounting,
}

impl Inner {
    /// One of `cap` permits under `key` (a VM's requests, its egress connections), if free.
    fn permit(&self, key: &str, cap: usize) -> Option<OwnedSemaphorePermit> {
        self.in_flight
            .lock()
            .expect("not poisoned")
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(cap)))
            .clone()
            .try_acquire_owned()
            .ok()
    }
}

impl Proxy {
    /// A proxy for the control plane at `home` with the `proxy:` section of its config.
    pub fn new(home: &Path, config: ProxyConfig) -> Result<Self, ProxyError> {
        for url in config.upstreams.values().chain(config.hosts.values()) {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ProxyError::BadUpstream(url.clone()));
            }
        }
        let limits = Limits {
            max_body: config.limits.max_body_bytes.unwrap_or(MAX_BODY),
            timeout: config
                .limits
                .timeout_seconds
                .map(Duration::from_secs)
                .unwrap_or(TIMEOUT),
            concurrency: config
                .limits
                .concurrency_per_vm
                .unwrap_or(CONCURRENCY)
                .max(1),
        };
        let client = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(ProxyError::Client)?;
        Ok(Proxy {
            inner: Arc::new(Inner {
                home: home.to_path_buf(),
                limits,
                client,
                tokens: TokenIndex::new(home),
                secrets: Secrets::new(home),
                audit: Audit::new(home),
                in_flight: Mutex::default(),
                egress_connections: config
                    .egress
                    .connections_per_vm
                    .unwrap_or(egress::CONNECTIONS)
                    .max(1),
                local: egress::Local::default(),
                accounting: usage::Accounting::new(home, config.prices.clone()),
                config,
            }),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.inner.limits
    }

    /// The router for a listener. `channel`: the one VM a listener belongs to (a per-VM
    /// socket, e.g. a qemu `guestfwd`): a token of any other VM is then refused. `None`: a
    /// shared listener, where the token alone says which VM.
    pub fn router(&self, channel: Option<String>) -> axum::Router {
        self.router_seen_at(channel, None)
    }

    /// [`Proxy::router`] for a listener the guest reaches at `url` (its
    /// [`GuestProxy`](boxery_backends::GuestProxy) URL): a request the guest sends to that
    /// address through the egress proxy (a client that ignores `no_proxy`) is served by the
    /// credential proxy, as if sent to it directly.
    pub fn router_seen_at(&self, channel: Option<String>, url: Option<&str>) -> axum::Router {
        Served {
            proxy: self.clone(),
            channel: channel.map(Arc::from),
            own: url.and_then(egress::Own::of).map(Arc::new),
        }
        .router()
    }

    /// Bind `addr` (TCP).
    pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ProxyError> {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ProxyError::Bind { addr, source })
    }

    /// Serve the shared router on `listener` until `stop`.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<(), ProxyError> {
        use axum::serve::ListenerExt;
        // No Nagle delay on small writes: an SSE event goes out when it arrives.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, self.router(None))
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .map_err(ProxyError::Serve)
    }
}

/// `$BOXERY_HOME/proxy.addr`: where `serve`'s proxy listens (`127.0.0.1:PORT`).
pub fn addr_file(home: &Path) -> PathBuf {
    boxery_home::layout::proxy_addr(home)
}

#[derive(Clone)]
struct Served {
    proxy: Proxy,
    channel: Option<Arc<str>>,
    /// Where the guest reaches this listener, when known.
    own: Option<Arc<egress::Own>>,
}

impl Served {
    fn router(self) -> axum::Router {
        axum::Router::new()
            .fallback(forward::handle)
            .with_state(self)
    }
}

/// A refusal: a status and a reason for the JSON body (never a secret).
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
    /// Seconds the caller should wait (`Retry-After`), for a limit.
    retry_after: Option<u64>,
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
        retry_after: None,
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        // A limit reads as the providers' own rate-limit error, which the agents' clients
        // show and back off from.
        let kind = if self.status == StatusCode::TOO_MANY_REQUESTS {
            "rate_limit_error"
        } else {
            "boxery_proxy"
        };
        let body = serde_json::json!({
            "type": "error",
            "error": {"type": kind, "status": self.status.as_u16(), "message": self.message},
        });
        let mut r = Response::new(Body::from(body.to_string()));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Remove a socket left at `path` (anything else there stays, and binding fails on it).
pub(crate) fn clear_socket(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        std::fs::remove_file(path)?;
    }
    Ok(())
}
