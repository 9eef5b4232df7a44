//! boxery's credential proxy: code in a VM calls LLM providers and HTTP APIs through it with
//! its own token, and the proxy adds the real credential of a grant a person approved. It
//! runs inside `boxery serve` (`--proxy-listen`) and reads two control-plane files the
//! reconcilers keep: the token store (`boxery_reconcilers::tokens`) and the grant state
//! (`boxery_reconcilers::grant`). It never writes either, and never opens the store.
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

pub mod audit;
pub mod channels;
pub mod egress;
pub mod routes;
pub mod secret;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_api::config::ProxyConfig;
use boxery_api::grant::GrantType;
use boxery_reconcilers::grant::Entry;
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::audit::{Audit, Record};
use crate::routes::{KeyHeader, Route};
use crate::secret::Secrets;

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
        axum::Router::new().fallback(handle).with_state(Served {
            proxy: self.clone(),
            channel: channel.map(Arc::from),
        })
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
    home.join("proxy.addr")
}

#[derive(Clone)]
struct Served {
    proxy: Proxy,
    channel: Option<Arc<str>>,
}

/// A refusal: a status and a reason for the JSON body (never a secret).
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "type": "error",
            "error": {"type": "boxery_proxy", "status": self.status.as_u16(), "message": self.message},
        });
        let mut r = Response::new(Body::from(body.to_string()));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// Headers never forwarded: credentials the client sent, and hop-by-hop headers.
const STRIPPED: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "x-boxery-token",
    "cookie",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

/// Response headers not passed back (hop-by-hop).
const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The token the client sent: `x-boxery-token`, `x-api-key`, `Authorization: Bearer T`, or
/// the password of `Authorization: Basic` (git's credential helpers).
fn token_of(h: &HeaderMap) -> Option<String> {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(t) = get("x-boxery-token").or_else(|| get("x-api-key")) {
        return Some(t.to_string());
    }
    credential(get("authorization")?)
}

/// The token in an `Authorization`-style value: `Bearer T`, or the password of `Basic`.
fn credential(value: &str) -> Option<String> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.trim().to_string());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        return text.split_once(':').map(|(_, p)| p.to_string());
    }
    None
}

/// What a request will do once admitted.
struct Plan {
    vm: String,
    grants: String,
    url: String,
    inject: Vec<(HeaderName, HeaderValue)>,
}

/// Decide: route, token, grant, allowlists. Fills `rec` as it learns.
async fn admit(s: &Served, req: &Parts, rec: &mut Record) -> Result<Plan, Refusal> {
    let p = &s.proxy.inner;
    let route = routes::parse(req.uri.path()).map_err(|m| refuse(StatusCode::NOT_FOUND, m))?;
    let h = &req.headers;
    let upgrade = h.contains_key(header::UPGRADE)
        || h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.to_ascii_lowercase().contains("upgrade"))
        });
    if upgrade {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "WebSocket and other upgrades are refused by the boxery proxy: use plain HTTP or SSE",
        ));
    }
    let Some((vm, owner)) = token_of(h).and_then(|t| p.tokens.lookup(&t)) else {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "no or wrong token: send the VM's boxery token (BOXERY_TOKEN) as x-api-key, Authorization: Bearer or x-boxery-token",
        ));
    };
    if let Some(ch) = &s.channel
        && **ch != *vm
    {
        return Err(refuse(
            StatusCode::UNAUTHORIZED,
            "no or wrong token for this channel",
        ));
    }
    rec.vm = Some(vm.clone());
    // The grants in force for this token's owner.
    let entries: Vec<Entry> = boxery_reconcilers::grant::read_state(&p.home, &vm)
        .into_iter()
        .filter(|e| e.lease_uid.as_deref().unwrap_or(&e.vm_uid) == owner)
        .collect();
    let method = &req.method;
    match route {
        Route::Llm { provider, rest } => {
            rec.route = Some("llm".into());
            rec.path = rest.clone();
            let Some(prov) = routes::provider(&provider, &p.config.upstreams) else {
                let mut known: Vec<&str> = routes::DEFAULTS.iter().map(|(n, _)| *n).collect();
                known.extend(p.config.upstreams.keys().map(String::as_str));
                known.sort();
                known.dedup();
                return Err(refuse(
                    StatusCode::NOT_FOUND,
                    format!(
                        "no LLM provider {provider}: the proxy knows {} (more under proxy: upstreams: in config.yaml)",
                        known.join(", ")
                    ),
                ));
            };
            rec.host = Some(host_of(&prov.upstream));
            let Some(grant) = entries
                .iter()
                .find(|e| e.type_ == GrantType::Llm && e.target == provider)
            else {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    format!(
                        "no llm grant for {provider} on VM {vm}: boxery grant {vm} llm:{provider} --from-env VARIABLE (or --from-file, --from-command), approved by a person"
                    ),
                ));
            };
            rec.grant = Some(grant.name.clone());
            if !routes::llm_method(method) {
                return Err(refuse(
                    StatusCode::METHOD_NOT_ALLOWED,
                    format!("{method} is not allowed on /llm/{provider}: GET and POST are"),
                ));
            }
            let path_only = rest.as_str();
            if !prov.paths.iter().any(|x| routes::under(path_only, x)) {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    format!(
                        "{path_only} is not an allowed path of /llm/{provider}: allowed are {}",
                        prov.paths.join(", ")
                    ),
                ));
            }
            let value = p.secrets.resolve(&grant.value_from).await.map_err(|why| {
                refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("grant {}: {why}", grant.name),
                )
            })?;
            let inject = match prov.key {
                KeyHeader::XApiKey => (HeaderName::from_static("x-api-key"), value),
                KeyHeader::Bearer => (header::AUTHORIZATION, bearer(&value)?),
            };
            Ok(Plan {
                vm,
                grants: grant.name.clone(),
                url: format!("{}{}", prov.upstream, with_query(&rest, req)),
                inject: vec![inject],
            })
        }
        Route::Edge { host, rest } => {
            rec.route = Some("edge".into());
            rec.host = Some(host.clone());
            rec.path = rest.clone();
            if !routes::edge_method(method) {
                return Err(refuse(
                    StatusCode::METHOD_NOT_ALLOWED,
                    format!("{method} is not allowed on /edge/"),
                ));
            }
            let http: Vec<&Entry> = entries
                .iter()
                .filter(|e| e.type_ == GrantType::Http && e.target.eq_ignore_ascii_case(&host))
                .collect();
            let github_here = routes::GITHUB_HOSTS.contains(&host.as_str());
            let gh_all: Vec<&Entry> = entries
                .iter()
                .filter(|e| e.type_ == GrantType::Github && github_here)
                .collect();
            let gh: Vec<&Entry> = gh_all
                .iter()
                .copied()
                .filter(|e| routes::github_path(&host, &rest, &e.target))
                .collect();
            if http.is_empty() && gh.is_empty() {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    if gh_all.is_empty() {
                        format!(
                            "no http grant for {host} on VM {vm}: boxery grant {vm} http:{host} --header NAME --from-env VARIABLE, approved by a person"
                        )
                    } else {
                        format!(
                            "{rest} on {host} is outside the repositories granted to VM {vm} ({})",
                            gh_all
                                .iter()
                                .map(|e| e.target.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    },
                ));
            }
            let mut inject = Vec::new();
            let mut names = Vec::new();
            for e in &http {
                let Some(name) = e
                    .header
                    .as_deref()
                    .and_then(|n| HeaderName::try_from(n).ok())
                else {
                    continue;
                };
                let v = p.secrets.resolve(&e.value_from).await.map_err(|why| {
                    refuse(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("grant {}: {why}", e.name),
                    )
                })?;
                inject.push((name, v));
                names.push(e.name.clone());
            }
            if let Some(e) = gh.first() {
                let v = p.secrets.resolve(&e.value_from).await.map_err(|why| {
                    refuse(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("grant {}: {why}", e.name),
                    )
                })?;
                let auth = if host == "github.com" {
                    use base64::Engine;
                    let raw = format!("x-access-token:{}", v.to_str().unwrap_or_default());
                    secret::header(&format!(
                        "Basic {}",
                        base64::engine::general_purpose::STANDARD.encode(raw)
                    ))
                    .map_err(|why| {
                        refuse(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("grant {}: {why}", e.name),
                        )
                    })?
                } else {
                    bearer(&v)?
                };
                inject.retain(|(n, _)| *n != header::AUTHORIZATION);
                inject.push((header::AUTHORIZATION, auth));
                names.push(e.name.clone());
            }
            let base = p
                .config
                .hosts
                .get(&host)
                .map(|u| u.trim_end_matches('/').to_string())
                .unwrap_or_else(|| format!("https://{host}"));
            rec.grant = Some(names.join(","));
            Ok(Plan {
                vm,
                grants: names.join(","),
                url: format!("{base}{}", with_query(&rest, req)),
                inject,
            })
        }
    }
}

fn bearer(v: &HeaderValue) -> Result<HeaderValue, Refusal> {
    secret::header(&format!("Bearer {}", v.to_str().unwrap_or_default()))
        .map_err(|why| refuse(StatusCode::SERVICE_UNAVAILABLE, why))
}

fn with_query(rest: &str, req: &Parts) -> String {
    match req.uri.query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_string(),
    }
}

fn host_of(url: &str) -> String {
    url.split_once("://")
        .map(|(_, r)| r.split('/').next().unwrap_or(r))
        .unwrap_or(url)
        .to_string()
}

/// Every request: admit, limit, forward, stream back, audit.
async fn handle(State(s): State<Served>, req: Request) -> Response {
    if egress::is_egress(&req) {
        return egress::handle(s, req).await;
    }
    let started = Instant::now();
    let p = s.proxy.inner.clone();
    let mut rec = Record {
        time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        ..Default::default()
    };
    let done = |mut rec: Record, r: Refusal| {
        rec.status = r.status.as_u16();
        rec.ms = started.elapsed().as_millis() as u64;
        rec.reason = Some(r.message.clone());
        p.audit.write(&rec);
        r.into_response()
    };
    let (parts, body) = req.into_parts();
    let plan = match admit(&s, &parts, &mut rec).await {
        Ok(plan) => plan,
        Err(r) => return done(rec, r),
    };
    let Some(permit) = p.permit(&plan.vm, p.limits.concurrency) else {
        let r = refuse(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "VM {} already has {} requests in flight through the proxy",
                plan.vm, p.limits.concurrency
            ),
        );
        return done(rec, r);
    };
    let max = p.limits.max_body;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_big = || {
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the proxy's limit of {max} bytes"),
        )
    };
    let (body, bytes_in) = match declared {
        Some(n) if n > max => return done(rec, too_big()),
        // The length is declared (and hyper holds the client to it): stream it.
        Some(n) => (reqwest::Body::wrap_stream(body.into_data_stream()), n),
        // No length: read it up to the limit first, so an oversized body reaches no one.
        None => {
            match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, max as usize))
                .await
            {
                Ok(c) => {
                    let b: Bytes = c.to_bytes();
                    let n = b.len() as u64;
                    (reqwest::Body::from(b), n)
                }
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    return done(rec, too_big());
                }
                Err(_) => {
                    return done(
                        rec,
                        refuse(
                            StatusCode::BAD_REQUEST,
                            "the request body could not be read",
                        ),
                    );
                }
            }
        }
    };
    rec.bytes_in = bytes_in;
    let mut headers = HeaderMap::new();
    for (n, v) in &parts.headers {
        if !STRIPPED.contains(&n.as_str()) {
            headers.append(n.clone(), v.clone());
        }
    }
    for (n, v) in plan.inject {
        headers.insert(n, v);
    }
    let sent = p
        .client
        .request(parts.method.clone(), &plan.url)
        .headers(headers)
        .body(body)
        .timeout(p.limits.timeout)
        .send()
        .await;
    let up = match sent {
        Ok(up) => up,
        Err(e) => {
            let (status, what) = if e.is_timeout() {
                (StatusCode::GATEWAY_TIMEOUT, "did not answer in time")
            } else {
                (StatusCode::BAD_GATEWAY, "could not be reached")
            };
            let host = rec.host.clone().unwrap_or_default();
            tracing::warn!(vm = %plan.vm, grant = %plan.grants, host = %host, error = %e.without_url(), "proxy upstream failed");
            return done(rec, refuse(status, format!("the upstream {host} {what}")));
        }
    };
    let status = up.status();
    let mut resp = Response::builder().status(status);
    for (n, v) in up.headers() {
        if !HOP.contains(&n.as_str()) {
            resp = resp.header(n, v);
        }
    }
    rec.status = status.as_u16();
    // The audit record is written when the response stream ends (or the client goes away).
    let guard = Finish {
        audit: p.clone(),
        rec,
        started,
        bytes: Arc::new(AtomicU64::new(0)),
        bytes_in: None,
        _permit: permit,
    };
    let counter = guard.bytes.clone();
    let stream = up.bytes_stream().map(move |chunk| {
        let _held = &guard;
        if let Ok(b) = &chunk {
            counter.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        chunk
    });
    resp.body(Body::from_stream(stream)).unwrap_or_else(|_| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "the upstream's response headers are invalid",
        )
        .into_response()
    })
}

/// Writes a forwarded request's audit record when its response stream is dropped, and holds
/// its VM's concurrency permit until then.
struct Finish {
    audit: Arc<Inner>,
    rec: Record,
    started: Instant,
    bytes: Arc<AtomicU64>,
    /// Request body bytes, when they are counted as they stream (the egress proxy's).
    bytes_in: Option<Arc<AtomicU64>>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.rec.bytes_out = self.bytes.load(Ordering::Relaxed);
        if let Some(b) = &self.bytes_in {
            self.rec.bytes_in = b.load(Ordering::Relaxed);
        }
        self.rec.ms = self.started.elapsed().as_millis() as u64;
        self.audit.audit.write(&self.rec);
    }
}

/// Token → VM, from the token store. A hit is always confirmed against the VM's file.
#[derive(Debug)]
struct TokenIndex {
    home: PathBuf,
    index: Mutex<Index>,
}

#[derive(Debug, Default)]
struct Index {
    by_token: HashMap<String, String>,
    scanned: Option<Instant>,
    dir_mtime: Option<SystemTime>,
}

/// The shortest time between two rescans for unknown tokens when the directory did not change.
const RESCAN_EVERY: Duration = Duration::from_millis(250);

impl TokenIndex {
    fn new(home: &Path) -> Self {
        TokenIndex {
            home: home.to_path_buf(),
            index: Mutex::default(),
        }
    }

    /// The VM and owner whose live token `token` is.
    fn lookup(&self, token: &str) -> Option<(String, String)> {
        if token.is_empty() || token.len() > 512 {
            return None;
        }
        let known = self
            .index
            .lock()
            .expect("not poisoned")
            .by_token
            .get(token)
            .cloned();
        let vm = match known {
            Some(vm) => vm,
            None => {
                self.rescan();
                self.index
                    .lock()
                    .expect("not poisoned")
                    .by_token
                    .get(token)
                    .cloned()?
            }
        };
        boxery_reconcilers::tokens::matches(&self.home, &vm, token).map(|owner| (vm, owner))
    }

    fn rescan(&self) {
        let dir = boxery_reconcilers::tokens::dir(&self.home);
        let mtime = std::fs::metadata(&dir).and_then(|m| m.modified()).ok();
        {
            let ix = self.index.lock().expect("not poisoned");
            if ix.dir_mtime == mtime && ix.scanned.is_some_and(|t| t.elapsed() < RESCAN_EVERY) {
                return;
            }
        }
        let mut by_token = HashMap::new();
        for vm in boxery_reconcilers::tokens::vms(&self.home) {
            if let Some((_, t)) = boxery_reconcilers::tokens::read(&self.home, &vm) {
                by_token.insert(t, vm);
            }
        }
        let mut ix = self.index.lock().expect("not poisoned");
        *ix = Index {
            by_token,
            scanned: Some(Instant::now()),
            dir_mtime: mtime,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_token_where_clients_put_it() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("bxt_a"));
        assert_eq!(token_of(&h).as_deref(), Some("bxt_a"));
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer bxt_b"));
        assert_eq!(token_of(&h).as_deref(), Some("bxt_b"));
        let mut h = HeaderMap::new();
        // base64("x:bxt_c")
        h.insert(
            "authorization",
            HeaderValue::from_static("Basic eDpieHRfYw=="),
        );
        assert_eq!(token_of(&h).as_deref(), Some("bxt_c"));
        assert_eq!(token_of(&HeaderMap::new()), None);
    }

    #[test]
    fn index_follows_the_token_files() {
        let d = tempfile::tempdir().unwrap();
        let ix = TokenIndex::new(d.path());
        assert_eq!(ix.lookup("bxt_1"), None);
        boxery_reconcilers::tokens::write(d.path(), "a", "uid-a", "bxt_1").unwrap();
        // A new token is found at once (the directory changed).
        assert_eq!(ix.lookup("bxt_1"), Some(("a".into(), "uid-a".into())));
        std::fs::remove_file(boxery_reconcilers::tokens::file(d.path(), "a")).unwrap();
        assert_eq!(
            ix.lookup("bxt_1"),
            None,
            "a removed token is refused at once"
        );
    }
}
