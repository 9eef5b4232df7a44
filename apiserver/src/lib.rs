//! boxery's Kubernetes-compatible API (`boxery serve --api-listen ADDR`): the
//! `boxery.dev/v1alpha1` kinds served the way the Kubernetes API serves custom resources, so
//! `kubectl`, the official client libraries and GitOps tools work against a boxery home
//! unchanged. Always over TLS ([`tls`]), always with a bearer token of a named scope
//! ([`tokens`], [`scope`]); reads and writes go through the same verbs and store as the CLI
//! and the MCP tools ([`resources`], [`watch`]), and errors are Kubernetes `Status` bodies
//! ([`status`]). What is served, and what is not, is in `docs/api.md`.

pub mod access_review;
pub mod call;
pub mod connect;
pub mod controllers_metadata;
pub mod discovery;
pub mod events;
pub mod generate_name;
pub mod managed;
pub mod options;
pub mod paging;
pub mod protobuf;
pub mod query;
pub mod resources;
pub mod scale;
pub mod scope;
pub mod screen;
pub mod status;
pub mod store_rpc;
pub mod structural;
pub mod tls;
pub mod tokens;
pub mod watch;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use boxery_verbs::Verbs;
use tokio_util::sync::CancellationToken;

use crate::resources::json_reply;
use crate::status::Failure;
use crate::tokens::Tokens;

/// The API group.
pub const GROUP: &str = "boxery.dev";
/// The version served.
pub const VERSION: &str = "v1alpha1";
/// `boxery.dev/v1alpha1`.
pub const GROUP_VERSION: &str = "boxery.dev/v1alpha1";

/// The API's limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A request body's size, at most (413 over it): 3 MiB, as the Kubernetes API.
    pub body_bytes: usize,
    /// Watches one token holds at once (429 over it).
    pub watches_per_token: usize,
    /// Requests per second one token may make, on average (429 over it, with Retry-After).
    pub rate_per_token: f64,
    /// Requests one token may make in a burst above the rate.
    pub burst_per_token: f64,
    /// Connections open at once. At this cap (or `per_peer`), the oldest connection that has
    /// not shown a valid token is closed to make room (`boxery_mcp::conns`, as the MCP
    /// listener does); when every one has shown one, the new connection is closed.
    pub connections: usize,
    /// Connections open at once from one address.
    pub per_peer: usize,
    /// How long a connection may take to finish its TLS handshake and send a request's
    /// headers.
    pub header_read: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            body_bytes: 3 * 1024 * 1024,
            watches_per_token: 256,
            rate_per_token: 500.0,
            burst_per_token: 1000.0,
            connections: 512,
            per_peer: 256,
            header_read: Duration::from_secs(10),
        }
    }
}

/// How long open connections get to finish when the server stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A token's request budget (a token bucket).
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// What every handler shares.
#[derive(Debug)]
pub struct Shared {
    /// The verbs (the CLI's voice; a lease token's writes speak as a tool).
    pub verbs: Verbs,
    tokens: Tokens,
    /// The limits.
    pub limits: Limits,
    /// Open watches per token name.
    watches: Mutex<HashMap<String, usize>>,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// What `/metrics` serves (`serve` gives it; none elsewhere).
    metrics: Option<boxery_metrics::Exposition>,
}

impl Shared {
    /// The state of an API over `verbs`' home and store.
    pub fn new(verbs: Verbs, limits: Limits) -> Shared {
        Shared {
            tokens: Tokens::new(verbs.home()),
            verbs,
            limits,
            watches: Mutex::new(HashMap::new()),
            buckets: Mutex::new(HashMap::new()),
            metrics: None,
        }
    }

    /// Take one request from `token`'s budget; `Err(seconds to wait)` when it is spent.
    fn spend(&self, token: &str) -> Result<(), u64> {
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let (rate, burst) = (self.limits.rate_per_token, self.limits.burst_per_token);
        let e = b.entry(token.to_string()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        e.tokens = (e.tokens + now.duration_since(e.at).as_secs_f64() * rate).min(burst);
        e.at = now;
        if e.tokens >= 1.0 {
            e.tokens -= 1.0;
            Ok(())
        } else {
            Err(((1.0 - e.tokens) / rate).ceil().max(1.0) as u64)
        }
    }
}

/// Check the bearer token, the scope's existence and the token's rate; put the [`tokens::Caller`]
/// in the request.
async fn authenticate(State(sh): State<Arc<Shared>>, mut req: Request, next: Next) -> Response {
    let secret = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(boxery_mcp::server::bearer)
        .map(String::from);
    let caller = secret.as_deref().and_then(|s| sh.tokens.check(s));
    if caller.is_some()
        && let Some(p) = req.extensions().get::<boxery_mcp::conns::Proven>()
    {
        // this connection is a token holder's: not among the first closed when full
        p.prove();
    }
    let Some(caller) = caller else {
        let why = if secret.is_some() {
            "Unauthorized: the bearer token is not one of this home's (revoked, or from another home); `boxery kubeconfig` on the VM host makes one"
        } else {
            "Unauthorized: send a bearer token (`boxery kubeconfig` on the VM host prints a kubeconfig with one)"
        };
        return Failure::new(StatusCode::UNAUTHORIZED, "Unauthorized", why).into_response();
    };
    if let Err(wait) = sh.spend(&caller.name) {
        let mut r = Failure::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!(
                "token {} made more than {} requests a second: retry in {wait} s",
                caller.name, sh.limits.rate_per_token
            ),
        )
        .into_response();
        r.headers_mut().insert(
            header::RETRY_AFTER,
            wait.to_string().parse().expect("digits"),
        );
        return r;
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// Every write through the API (a method other than GET, HEAD and OPTIONS), audited when its
/// answer is made: who (its token), the method and path, the status. A request to `/mcp` is
/// a line too (`mcp`: the token behind the session; the MCP server records each tool call), and
/// the store calls are audited per write by `store_rpc`.
async fn audit_writes(State(sh): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let writes = !matches!(
        method,
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    ) && path != boxery_store::wire::CALL_PATH;
    let caller = req.extensions().get::<tokens::Caller>().cloned();
    let started = Instant::now();
    let r = next.run(req).await;
    if writes && let Some(c) = caller {
        let action = match method.as_str() {
            _ if path == "/mcp" => "mcp",
            "POST" => "create",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" => "delete",
            other => other,
        };
        // the VM a path names (`…/vms/NAME…`), when it is a VM name
        let vm = path
            .split_once("/vms/")
            .and_then(|(_, rest)| rest.split('/').next())
            .filter(|n| boxery_api::name::check_label_name(n).is_ok())
            .map(str::to_string);
        sh.verbs
            .acting_for(&format!("token:{}", c.name), "api")
            .record(boxery_verbs::audit::Action {
                action: action.to_ascii_lowercase(),
                vm,
                what: path,
                result: format!("HTTP {}", r.status().as_u16()),
                ms: started.elapsed().as_millis() as u64,
                ..Default::default()
            });
    }
    r
}

/// `/mcp` through the API: a full token only (an MCP session can do everything the tools
/// can; read-only and lease-scoped sessions are not built), and never from a browser page
/// (a request with an `Origin`).
async fn mcp_gate(req: Request, next: Next) -> Response {
    let full = req
        .extensions()
        .get::<tokens::Caller>()
        .is_some_and(|c| c.scope == tokens::Scope::Full);
    if !full {
        return Failure::forbidden(
            "MCP through the API needs a token of scope full (`boxery kubeconfig --scope full`); read-only and lease-scoped MCP sessions are not served",
        )
        .into_response();
    }
    if req.headers().contains_key(header::ORIGIN) {
        return Failure::forbidden(
            "MCP through the API is not served to browser pages (a request with an Origin)",
        )
        .into_response();
    }
    next.run(req).await
}

/// `/metrics` (docs/observability.md): to a token of scope read or full (a lease's token
/// sees its own VM only, and the exposition is every VM's).
async fn metrics(
    State(sh): State<Arc<Shared>>,
    axum::Extension(caller): axum::Extension<tokens::Caller>,
    headers: axum::http::HeaderMap,
) -> Response {
    if matches!(caller.scope, tokens::Scope::Lease(_)) {
        return Failure::forbidden(
            "/metrics shows every VM: it needs a token of scope read or full (`boxery kubeconfig --scope read`)",
        )
        .into_response();
    }
    let Some(e) = sh.metrics.clone() else {
        return Failure::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "this API serves no metrics (only `boxery serve --api-listen` does)",
        )
        .into_response();
    };
    let accept = headers.get(header::ACCEPT).and_then(|h| h.to_str().ok());
    let (content_type, body) = e.respond(accept).await;
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// The API's routes; `mcp`: the MCP service to serve at `/mcp` behind the same tokens.
pub fn router(sh: Arc<Shared>, mcp: Option<Router>) -> Router {
    let gv = format!("/apis/{GROUP_VERSION}");
    let mcp = mcp.unwrap_or_default().layer(middleware::from_fn(mcp_gate));
    let authed = Router::new()
        .route(
            "/version",
            get(|| async { json_reply(StatusCode::OK, &discovery::version()) }),
        )
        // the discovery paths answer with a trailing slash too, as Kubernetes' do (the
        // Python client's VersionApi asks for `/version/`)
        .route(
            "/version/",
            get(|| async { json_reply(StatusCode::OK, &discovery::version()) }),
        )
        .route(
            "/api/",
            get(|| async { json_reply(StatusCode::OK, &discovery::core_versions()) }),
        )
        .route(
            "/apis/",
            get(|| async { json_reply(StatusCode::OK, &discovery::groups()) }),
        )
        .route(
            "/api",
            get(|| async { json_reply(StatusCode::OK, &discovery::core_versions()) }),
        )
        .route(
            "/api/v1",
            get(|| async { json_reply(StatusCode::OK, &discovery::core_resources()) }),
        )
        .route("/api/v1/events", get(events::list))
        .route("/api/v1/namespaces/{ns}/events", get(events::list))
        .route(
            "/apis",
            get(|| async { json_reply(StatusCode::OK, &discovery::groups()) }),
        )
        .route(
            &format!("/apis/{}", access_review::AUTHZ_GROUP),
            get(|| async {
                let mut g = access_review::group();
                g["kind"] = serde_json::json!("APIGroup");
                g["apiVersion"] = serde_json::json!("v1");
                json_reply(StatusCode::OK, &g)
            }),
        )
        .route(
            &format!("/apis/{}", access_review::AUTHZ_GROUP_VERSION),
            get(|| async { json_reply(StatusCode::OK, &access_review::resources()) }),
        )
        .route(
            &format!(
                "/apis/{}/selfsubjectaccessreviews",
                access_review::AUTHZ_GROUP_VERSION
            ),
            axum::routing::post(access_review::access_review),
        )
        .route(
            &format!(
                "/apis/{}/selfsubjectrulesreviews",
                access_review::AUTHZ_GROUP_VERSION
            ),
            axum::routing::post(access_review::rules_review),
        )
        .route(
            &format!("/apis/{GROUP}"),
            get(|| async { json_reply(StatusCode::OK, &discovery::group_doc()) }),
        )
        .route(
            &gv,
            get(|| async { json_reply(StatusCode::OK, &discovery::resources()) }),
        )
        .route(
            "/openapi/v2",
            get(|headers: axum::http::HeaderMap| async move {
                let protobuf = headers
                    .get(header::ACCEPT)
                    .and_then(|a| a.to_str().ok())
                    .is_some_and(|a| a.contains("protobuf"));
                let (ty, body) = discovery::openapi_v2(protobuf);
                (StatusCode::OK, [(header::CONTENT_TYPE, ty)], body)
            }),
        )
        .route(
            "/openapi/v3",
            get(|| async { json_reply(StatusCode::OK, &discovery::openapi_root()) }),
        )
        .route(
            &format!("/openapi/v3/apis/{GROUP_VERSION}"),
            get(|| async { json_reply(StatusCode::OK, discovery::openapi_group()) }),
        )
        .route(
            &format!("{gv}/{{plural}}"),
            get(resources::list)
                .post(resources::create)
                .delete(resources::delete_collection),
        )
        .route(
            &format!("{gv}/{{plural}}/{{name}}"),
            get(resources::get)
                .put(resources::replace)
                .patch(resources::patch)
                .delete(resources::delete),
        )
        .route(
            &format!("{gv}/pools/{{name}}/scale"),
            get(scale::get).put(scale::put).patch(scale::patch),
        )
        .route(
            &format!("{gv}/{{plural}}/{{name}}/{{sub}}"),
            get(resources::get_status)
                .put(resources::write_status)
                .patch(resources::write_status)
                .post(resources::write_status)
                .delete(resources::write_status),
        )
        .route(
            boxery_store::wire::CALL_PATH,
            axum::routing::post(store_rpc::call),
        )
        .route("/metrics", get(metrics))
        .route(boxery_store::wire::WATCH_PATH, get(store_rpc::watch))
        .route(boxery_store::wire::CONNECT_ROUTE, get(connect::connect))
        .route(boxery_store::wire::SCREEN_ROUTE, get(screen::screen))
        .route(
            boxery_store::wire::AUTHORIZE_ROUTE,
            axum::routing::post(connect::authorize),
        )
        .fallback(|| async {
            Failure::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        })
        .layer(DefaultBodyLimit::max(sh.limits.body_bytes))
        .with_state(sh.clone())
        .merge(mcp)
        .layer(middleware::from_fn_with_state(sh.clone(), audit_writes))
        .layer(middleware::from_fn_with_state(sh, authenticate))
        .layer(middleware::from_fn(boxery_mcp::conns::close_after_refusal));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .merge(authed)
}

/// The API, bound and with its certificate, not serving yet.
pub struct ApiServer {
    listener: tokio::net::TcpListener,
    local: SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
}

impl ApiServer {
    /// Bind `addr` and make (or load) the certificate for it.
    pub async fn bind(
        verbs: Verbs,
        addr: SocketAddr,
        limits: Limits,
    ) -> std::io::Result<ApiServer> {
        let home = verbs.home().to_path_buf();
        let tls = tokio::task::spawn_blocking(move || tls::server_identity(&home, addr))
            .await
            .map_err(std::io::Error::other)??;
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {addr} for the API: {e}"),
            )
        })?;
        let local = listener.local_addr()?;
        Ok(ApiServer {
            listener,
            local,
            tls,
            shared: Arc::new(Shared::new(verbs, limits)),
        })
    }

    /// Serve `exposition` at `/metrics` too.
    pub fn with_metrics(mut self, exposition: boxery_metrics::Exposition) -> Self {
        Arc::get_mut(&mut self.shared)
            .expect("a bound ApiServer's state is its own until it runs")
            .metrics = Some(exposition);
        self
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Serve until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        use hyper_util::rt::{TokioIo, TokioTimer};
        use hyper_util::service::TowerToHyperService;
        use tower::Layer as _;
        let mcp = boxery_mcp::server::McpService::new(
            &self.shared.verbs.env,
            Some(Vec::new()),
            &shutdown,
        );
        let app = router(self.shared.clone(), Some(mcp.router()));
        let tls_acceptor = tokio_rustls::TlsAcceptor::from(self.tls);
        let limits = self.shared.limits;
        let mut acceptor =
            boxery_mcp::conns::Acceptor::new("API", limits.connections, limits.per_peer);
        while let Some(a) = acceptor.next(&self.listener, &shutdown).await {
            let tls_acceptor = tls_acceptor.clone();
            let service = TowerToHyperService::new(axum::Extension(a.proven).layer(app.clone()));
            let (stream, evict, stop) = (a.stream, a.evict, shutdown.clone());
            let held = a.held;
            acceptor.spawn(async move {
                // Dropped in reverse: the socket first, then its place and its permit.
                let _held = held;
                let handshake =
                    tokio::time::timeout(limits.header_read, tls_acceptor.accept(stream));
                let tls = tokio::select! {
                    r = handshake => match r {
                        Ok(Ok(s)) => s,
                        _ => return,
                    },
                    _ = evict.cancelled() => return,
                };
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(TokioTimer::new())
                    .header_read_timeout(limits.header_read);
                let conn = http
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades();
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = evict.cancelled() => {}
                    _ = stop.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(SHUTDOWN_GRACE, conn).await;
                    }
                }
            });
        }
        // Open connections got the stop too and finish their requests (watches end); what has
        // not finished within the grace is cut.
        drop(self.listener);
        acceptor.drain(SHUTDOWN_GRACE).await;
        mcp.release_leases();
    }
}
