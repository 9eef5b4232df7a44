//! The MCP server, built from the tool table ([`crate::tools`]): `boxery mcp` over stdio, and
//! streamable HTTP at `/mcp` inside `boxery serve --mcp-listen ADDR`.
//!
//! Guarantees of the HTTP endpoint (every client is hostile until it shows the token):
//! - Every request needs `Authorization: Bearer TOKEN`, the scheme in any case (RFC 7235),
//!   compared in constant time. The token lives in `$BOXERY_HOME/mcp-token` (0600); an
//!   existing file that is not a regular file of this user readable by nobody else is refused.
//! - It listens on loopback only, unless `--mcp-allow-remote` says otherwise (and a warning
//!   says who can then reach it).
//! - An `Origin`, when present, must be one of the allowed origins (by default only the
//!   listen address itself); `Host` must be loopback or the listen address (rmcp).
//! - A request body is at most [`BODY_CAP`] (counted while reading, with or without a
//!   `Content-Length`; rmcp's own cap is raised to match), read only once the token was
//!   shown, and must arrive within [`Limits::body_read`].
//! - A connection must send each request's headers within [`Limits::header_read`] of
//!   connecting or of its previous request: idle and trickling sockets are closed.
//! - At most [`Limits::connections`] connections are open (a quarter of `ulimit -n`), and
//!   [`Limits::per_peer`] from one address. At a cap, the oldest connection that has not
//!   shown the token is closed to make room; when all have shown it, the new one is closed
//!   at once ([`crate::conns`], shared with the Kubernetes API's listener). So idle sockets
//!   cannot take the descriptors the controllers need, nor keep the token holder out.
//!
//! Caveats: on loopback every local client (and, on the qemu backend, every guest: see
//! docs/security.md) has the same address, so the per-peer cap separates nobody there; what
//! keeps the token holder served is that unauthenticated connections make room first. An
//! attacker that opens a whole cap of connections in the milliseconds between a client's
//! connect and its headers can still close that client's new connection (it retries).
//!
//! Tool arguments are bounded by the table (`tools::ARGS_CAP`, `STRING_CAP`). Each HTTP
//! session gets its own default VM; local paths are refused over HTTP.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use tokio_util::sync::CancellationToken;

use boxery_verbs::control::Started;
use boxery_verbs::{Env, Result as VerbResult, VerbError};

use crate::conns::{Acceptor, Proven};
use crate::{self as tools, Session};

/// The cap on an HTTP request body: the argument cap plus room for the envelope.
pub const BODY_CAP: usize = tools::ARGS_CAP + (64 << 10);

const INSTRUCTIONS: &str = "boxery gives you VMs as hands. Make one with vm_manage {action: new, vm: NAME, from: debian-12} (or vm_apply a manifest); it becomes this session's default VM. Then run commands with vm_bash, read and edit files with vm_read / vm_edit / vm_write, run long work with vm_jobs, copy with vm_copy, snapshot and fork with vm_manage. Errors say what to do next.";

/// The MCP face of one session.
#[derive(Debug, Clone)]
pub struct BoxeryMcp {
    session: Arc<Session>,
}

impl BoxeryMcp {
    /// A server for one session.
    pub fn new(session: Arc<Session>) -> Self {
        BoxeryMcp { session }
    }
}

/// The table's tools as MCP tools.
pub fn mcp_tools() -> Vec<Tool> {
    tools::tools()
        .iter()
        .map(|t| {
            let schema = match &t.schema {
                serde_json::Value::Object(m) => m.clone(),
                _ => Default::default(),
            };
            Tool::new(t.name, t.description, Arc::new(schema)).with_annotations(
                ToolAnnotations::new()
                    .read_only(t.read_only)
                    .destructive(t.destructive),
            )
        })
        .collect()
}

/// A tool result from a runner's result.
pub fn to_result(r: tools::ToolResult) -> CallToolResult {
    match r {
        Ok(out) => {
            let mut content = vec![ContentBlock::text(out.text)];
            if let Some(png) = out.png {
                use base64::Engine;
                let data = base64::engine::general_purpose::STANDARD.encode(png);
                content.push(ContentBlock::image(data, "image/png"));
            }
            let mut res = CallToolResult::success(content);
            res.structured_content = out.data;
            res
        }
        Err(e) => CallToolResult::error(vec![ContentBlock::text(e.chain())]),
    }
}

impl ServerHandler for BoxeryMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("boxery", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(mcp_tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        mcp_tools().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(tool) = tools::find(&request.name) else {
            let names: Vec<&str> = tools::tools().iter().map(|t| t.name).collect();
            return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                "no tool {}: the tools are {}",
                request.name,
                names.join(", ")
            ))])
            .into());
        };
        let args = serde_json::Value::Object(request.arguments.unwrap_or_default());
        // Every call is audited: the tool, the VM it names (or the session's), how it ended.
        let vm = args["vm"]
            .as_str()
            .map(str::to_string)
            .or_else(|| self.session.default_vm());
        let audit = self.session.verbs().ok().cloned();
        let doing = audit
            .as_ref()
            .map(|v| v.doing("tool", vm.as_deref(), tool.name));
        // A tool may ask the person at the client (vm_grant's approval, when it can elicit).
        self.session.set_peer(context.peer.clone());
        // Run on its own task so a panicking runner is a tool error, not a dead server.
        let task = tokio::spawn(tool.run(self.session.clone(), args, context.ct.clone()));
        let r = match task.await {
            Ok(r) => r,
            Err(e) => Err(boxery_verbs::VerbError::failed(format!(
                "{} failed inside boxery ({e}); this is a bug: please report it",
                tool.name
            ))),
        };
        if let Some(d) = doing {
            d.ended(&r, None);
        }
        Ok(to_result(r).into())
    }
}

/// Keep the controllers running in this process while nothing else leads the store, so
/// `vm_apply` converges without a `boxery serve` (when `env` can run them: its `control`).
fn embed_controllers(env: Env) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Some(control) = env.control.clone() else {
            return;
        };
        let Ok(store) = env.store() else { return };
        let mut embedded = None;
        loop {
            if embedded.is_none() {
                match control.start_if_needed(&env, &store).await {
                    Ok(Started::Here(e)) => {
                        tracing::info!("boxery mcp: running the controllers (no serve leads)");
                        embedded = Some(e);
                    }
                    Ok(Started::Elsewhere) => {}
                    Ok(Started::Unreachable(why)) => tracing::warn!("{why}; retrying in 5 s"),
                    Err(e) => tracing::warn!(error = %e, "cannot run the controllers"),
                }
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    })
}

/// How long a ending `boxery mcp` waits for its released leases to be let go (the reset then
/// runs in the background, or in whichever control plane runs next).
const LEASE_GRACE: Duration = Duration::from_secs(5);

/// SIGINT or SIGTERM: returns the signal's number.
async fn terminated() -> i32 {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => 2,
                _ = t.recv() => 15,
            }
        }
        _ => std::future::pending().await,
    }
}

/// `boxery mcp`: serve MCP on stdin/stdout until the client goes away (stdin closes) or a
/// SIGINT/SIGTERM; either way the session's leases are released.
pub async fn stdio(
    env: &Env,
    vm: Option<String>,
    remote: Option<&boxery_verbs::Verbs>,
) -> VerbResult {
    // Another machine's control plane (a context) runs its own controllers.
    let controllers = match remote {
        Some(_) => tokio::spawn(async {}),
        None => embed_controllers(env.clone()),
    };
    let mut session = Session::new(env.clone(), vm, true);
    if let Some(v) = remote {
        session = session.with_verbs(v);
    }
    let session = Arc::new(session);
    let server = BoxeryMcp::new(session.clone());
    let signalled = terminated();
    tokio::pin!(signalled);
    let running = tokio::select! {
        r = server.serve(rmcp::transport::stdio()) => {
            r.map_err(|e| VerbError::failed(format!("MCP initialisation failed: {e}")))?
        }
        sig = &mut signalled => std::process::exit(128 + sig),
    };
    let r = tokio::select! {
        r = running.waiting() => r.map(|_| ()),
        sig = &mut signalled => {
            session.end(LEASE_GRACE).await;
            // Exit now: tokio's stdin reader is a blocking thread the runtime would wait on.
            std::process::exit(128 + sig);
        }
    };
    session.end(LEASE_GRACE).await;
    controllers.abort();
    r.map_err(|e| VerbError::failed(format!("the MCP session ended with an error: {e}")))?;
    Ok(())
}

/// The most bytes of `mcp-token` read (a token is 64 characters).
const TOKEN_FILE_CAP: u64 = 4096;

/// Read or create the bearer token in `$BOXERY_HOME/mcp-token` (0600). An existing file must
/// be a regular file of this user that nobody else can read: one that others could read may
/// have leaked, so it is refused (exit 2) with what to do, never used or silently fixed.
pub fn token(env: &Env) -> VerbResult<String> {
    use std::io::{Read, Write};
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let path = boxery_home::layout::mcp_token(&env.home);
    let shown = path.display();
    match std::fs::symlink_metadata(&path) {
        Ok(m) => {
            let me = rustix::process::getuid().as_raw();
            if !m.file_type().is_file() {
                return Err(VerbError::invalid(format!(
                    "{shown} is not a regular file (a symlink, directory or device): delete it and boxery makes a new token"
                )));
            }
            if m.uid() != me {
                return Err(VerbError::invalid(format!(
                    "{shown} belongs to uid {}, not to you (uid {me}): whoever owns it knows the token. Delete it and boxery makes a new one",
                    m.uid()
                )));
            }
            let mode = m.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(VerbError::invalid(format!(
                    "{shown} has mode {mode:04o}: other users may have read the token. Delete it to have a new one made (`rm {shown}`), or, if nobody else can have read it, `chmod 600 {shown}`"
                )));
            }
            let mut text = String::new();
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(&path)
                .and_then(|f| f.take(TOKEN_FILE_CAP).read_to_string(&mut text))
                .map_err(|e| VerbError::failed(format!("cannot read {shown}: {e}")))?;
            let t = text.trim();
            if t.len() >= 32 && t.bytes().all(|b| b.is_ascii_graphic()) {
                return Ok(t.to_string());
            }
            // Too short or not a token: replaced below.
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(VerbError::failed(format!("cannot read {shown}: {e}"))),
    }
    env.ensure_home()?;
    let t = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(t.as_bytes())?;
    f.write_all(b"\n")?;
    std::fs::rename(&tmp, &path)?;
    Ok(t)
}

#[derive(Clone)]
struct Gate {
    token: Arc<String>,
    origins: Arc<Vec<String>>,
    body_read: Duration,
}

/// A refusal made before the request's body was read: the connection is closed after it
/// (hyper cannot reuse a connection whose request body is left unread), and the response says
/// so, or a client that sends its next request on it meets a closed socket instead of an
/// answer (seen: "Server disconnected without sending a response" after a 401).
fn refuse(code: StatusCode, msg: &str) -> Response {
    (
        code,
        [(axum::http::header::CONNECTION, "close")],
        format!("{msg}\n"),
    )
        .into_response()
}

fn body_too_large() -> Response {
    refuse(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!(
            "request body too large: at most {} MiB + {} KiB",
            tools::ARGS_CAP >> 20,
            (BODY_CAP - tools::ARGS_CAP) >> 10
        ),
    )
}

/// `a == b` in time that depends on their lengths only (for secrets).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The credentials of an `Authorization: Bearer TOKEN` header. The scheme is
/// case-insensitive (RFC 7235 §2.1): `bearer`, `BEARER` and `Bearer` are one.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
}

async fn gate(State(g): State<Gate>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .unwrap_or("");
    if !same(auth.as_bytes(), g.token.as_bytes()) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token: send Authorization: Bearer $(cat $BOXERY_HOME/mcp-token)",
        );
    }
    // This connection has shown the token: it is no longer the first to be closed when the
    // listener is full.
    if let Some(p) = req.extensions().get::<Proven>() {
        p.prove();
    }
    if let Some(o) = headers.get("origin") {
        let o = o.to_str().unwrap_or("");
        if !g.origins.iter().any(|a| a == o) {
            return refuse(StatusCode::FORBIDDEN, "origin not allowed");
        }
    }
    let too_big = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > BODY_CAP as u64);
    if too_big {
        return body_too_large();
    }
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(g.body_read, axum::body::to_bytes(body, BODY_CAP)).await
    {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => return body_too_large(),
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "the request body did not arrive within {}",
                    humantime::format_duration(g.body_read)
                ),
            );
        }
    };
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// The limits of the HTTP listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a connection may take to send a request's headers, counted from when it
    /// connects or finished its previous request: idle connections are closed after it.
    pub header_read: Duration,
    /// How long an authenticated request's body may take to arrive (408 after).
    pub body_read: Duration,
    /// Connections open at once, in all.
    pub connections: usize,
    /// Connections open at once from one peer address.
    pub per_peer: usize,
}

impl Limits {
    /// 5 s for headers, 30 s for a body; the connection caps scale with this process's file
    /// limit (a quarter of `ulimit -n`, 8 to 256 in all, half of that per peer), so the
    /// listener can never take the descriptors the controllers need.
    pub fn for_this_process() -> Limits {
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1024);
        let connections = (nofile / 4).clamp(8, 256) as usize;
        Limits {
            header_read: Duration::from_secs(5),
            body_read: Duration::from_secs(30),
            connections,
            per_peer: connections / 2,
        }
    }
}

/// How long open connections get to finish when the server stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Whether `ip` is this machine's loopback (IPv4-mapped addresses included).
fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Serve `app` on `listener` over HTTP/1.1 until `shutdown`, within `limits`: every
/// connection is closed when its headers take longer than `header_read` (idle ones too),
/// and connections over the caps are closed at once (or make room by closing the oldest
/// connection that has not shown the token).
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tower::Layer as _;
    let mut acceptor = Acceptor::new("MCP", limits.connections, limits.per_peer);
    while let Some(a) = acceptor.next(&listener, &shutdown).await {
        let service = TowerToHyperService::new(axum::Extension(a.proven).layer(app.clone()));
        let (stream, evict, stop) = (a.stream, a.evict, shutdown.clone());
        let held = a.held;
        acceptor.spawn(async move {
            // Dropped in reverse: the socket first, then its place and its permit.
            let _held = held;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_read);
            let conn = http.serve_connection(TokioIo::new(stream), service);
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
    // Open connections got the stop too and finish their requests; what has not finished
    // within the grace is cut.
    drop(listener);
    acceptor.drain(SHUTDOWN_GRACE).await;
}

/// The MCP endpoint, bound and checked, not serving yet.
pub struct HttpServer {
    listener: tokio::net::TcpListener,
    local: SocketAddr,
    token: String,
    origins: Vec<String>,
    env: Env,
}

impl HttpServer {
    /// Check the address and the token file and bind `addr`. A non-loopback address is refused
    /// (exit 2) unless `allow_remote`; with it, a warning says who can reach the endpoint.
    pub async fn bind(
        env: &Env,
        addr: SocketAddr,
        origins: Vec<String>,
        allow_remote: bool,
    ) -> VerbResult<HttpServer> {
        if !is_loopback(addr.ip()) {
            if !allow_remote {
                return Err(VerbError::invalid(format!(
                    "--mcp-listen {addr} is not a loopback address: /mcp would be reachable from other machines and from the VMs' networks, with the bearer token as its only protection. Listen on 127.0.0.1:{} and reach it through an SSH tunnel or `tailscale serve`, or add --mcp-allow-remote to accept that",
                    addr.port()
                )));
            }
            eprintln!(
                "boxery serve: WARNING: MCP listens on {addr}, which other machines and the VMs' networks may reach; the bearer token in {} is its only protection (no TLS: it crosses the network in clear text)",
                boxery_home::layout::mcp_token(&env.home).display()
            );
        }
        let token = token(env)?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| VerbError::failed(format!("cannot listen on {addr} for MCP: {e}")))?;
        let local = listener.local_addr()?;
        Ok(HttpServer {
            listener,
            local,
            token,
            origins,
            env: env.clone(),
        })
    }

    /// Serve streamable HTTP MCP at `http://ADDR/mcp` until `shutdown`, within
    /// [`Limits::for_this_process`]; then release the leases of the sessions still open.
    pub async fn run(self, shutdown: CancellationToken) -> VerbResult {
        self.run_within(Limits::for_this_process(), shutdown).await
    }

    async fn run_within(self, limits: Limits, shutdown: CancellationToken) -> VerbResult {
        let local = self.local;
        let mut allowed = vec![
            format!("http://{local}"),
            format!("http://localhost:{}", local.port()),
        ];
        allowed.extend(self.origins);
        let hosts = if local.ip().is_loopback() {
            None
        } else {
            Some(vec![local.ip().to_string(), local.to_string()])
        };
        let mcp = McpService::new(&self.env, hosts, &shutdown);
        let g = Gate {
            token: Arc::new(self.token),
            origins: Arc::new(allowed),
            body_read: limits.body_read,
        };
        let app = mcp
            .router()
            .layer(axum::middleware::from_fn_with_state(g, gate))
            .layer(axum::middleware::from_fn(crate::conns::close_after_refusal));
        eprintln!(
            "boxery serve: MCP at http://{local}/mcp (bearer token in {})",
            boxery_home::layout::mcp_token(&self.env.home).display()
        );
        serve_connections(self.listener, app, limits, shutdown).await;
        mcp.release_leases();
        Ok(())
    }
}

/// The streamable HTTP MCP service at `/mcp`, without a gate: `serve --mcp-listen` puts its
/// token gate in front, the API (`serve --api-listen`) its own tokens.
#[derive(Clone)]
pub struct McpService {
    router: axum::Router,
    sessions: Arc<std::sync::Mutex<Vec<std::sync::Weak<Session>>>>,
}

impl McpService {
    /// The service for `env`'s home. `hosts`: the Host names rmcp accepts beside the loopback
    /// ones (`Some(vec![])`: any, for a listener whose clients authenticate anyway).
    pub fn new(env: &Env, hosts: Option<Vec<String>>, shutdown: &CancellationToken) -> McpService {
        use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
        use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
        let mut cfg = StreamableHttpServerConfig::default();
        cfg.cancellation_token = shutdown.child_token();
        // rmcp's own cap (4 MiB by default) must not undercut ours: the gate enforces it.
        cfg.max_request_body_bytes = BODY_CAP;
        match hosts {
            None => {}
            Some(h) if h.is_empty() => cfg.allowed_hosts.clear(),
            Some(h) => cfg.allowed_hosts.extend(h),
        }
        let env2 = env.clone();
        // Sessions end (and release their leases) when the client deletes them, when they
        // idle out (rmcp's keep-alive), or when the server shuts down ([`Self::release_leases`]).
        let sessions: Arc<std::sync::Mutex<Vec<std::sync::Weak<Session>>>> = Default::default();
        let sessions2 = sessions.clone();
        let service = StreamableHttpService::new(
            move || {
                let s = Arc::new(Session::new(env2.clone(), None, false));
                let mut all = sessions2.lock().expect("poisoned");
                all.retain(|w| w.strong_count() > 0);
                all.push(Arc::downgrade(&s));
                Ok(BoxeryMcp::new(s))
            },
            Arc::new(LocalSessionManager::default()),
            cfg,
        );
        McpService {
            router: axum::Router::new().nest_service("/mcp", service),
            sessions,
        }
    }

    /// The router serving `/mcp`.
    pub fn router(&self) -> axum::Router {
        self.router.clone()
    }

    /// Release the leases of the sessions still open (the server is stopping).
    pub fn release_leases(&self) {
        let live: Vec<Arc<Session>> = self
            .sessions
            .lock()
            .expect("poisoned")
            .iter()
            .filter_map(|w| w.upgrade())
            .collect();
        for s in live {
            s.release_leases();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_in_constant_time_and_exactly() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
        assert!(!same(b"", b"a"));
    }

    #[test]
    fn token_file_is_private_and_stable() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let env = Env::new(d.path().to_path_buf(), "fake");
        let a = token(&env).unwrap();
        assert_eq!(a, token(&env).unwrap());
        let mode = std::fs::metadata(d.path().join("mcp-token"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER \t abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearerabc"), None);
        assert_eq!(bearer("abc"), None);
    }

    fn home() -> (tempfile::TempDir, Env) {
        let d = tempfile::tempdir().unwrap();
        let env = Env::new(d.path().to_path_buf(), "fake");
        (d, env)
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let (d, env) = home();
        let t = token(&env).unwrap();
        let path = d.path().join("mcp-token");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = token(&env).unwrap_err();
        assert_eq!(e.kind(), boxery_verbs::ErrorKind::Invalid);
        let msg = e.to_string();
        assert!(
            msg.contains("mode 0644") && msg.contains("chmod 600"),
            "{msg}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(token(&env).unwrap(), t, "the same token once private again");
        // A symlink is not followed, even to a private file.
        std::fs::rename(&path, d.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &path).unwrap();
        let e = token(&env).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e:?}");
    }

    fn limits(connections: usize, per_peer: usize) -> Limits {
        Limits {
            header_read: Duration::from_millis(300),
            body_read: Duration::from_millis(300),
            connections,
            per_peer,
        }
    }

    /// A minimal HTTP/1.1 exchange: the response's status code.
    fn status_of(stream: &mut std::net::TcpStream, request: &[u8]) -> Option<u16> {
        use std::io::{Read, Write};
        stream.write_all(request).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !got.windows(2).any(|w| w == b"\r\n") {
            let n = stream.read(&mut buf).ok()?;
            if n == 0 {
                return None;
            }
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got)
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// Whether the server closes `stream` within `within` (reads give EOF or a reset).
    fn closed_within(stream: &mut std::net::TcpStream, within: Duration) -> bool {
        use std::io::Read;
        let deadline = std::time::Instant::now() + within;
        let mut buf = [0u8; 1024];
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            stream.set_read_timeout(Some(left)).unwrap();
            match stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return true,
            }
        }
    }

    fn initialize(addr: SocketAddr, auth: &str) -> Vec<u8> {
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
        format!(
            "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_and_slow_connections_are_closed_and_clients_still_served() {
        let (_d, env) = home();
        let server = HttpServer::bind(&env, "127.0.0.1:0".parse().unwrap(), vec![], false)
            .await
            .unwrap();
        let addr = server.local;
        let token = server.token.clone();
        let stop = CancellationToken::new();
        let run = tokio::spawn(server.run_within(limits(4, 4), stop.clone()));
        let check = tokio::task::spawn_blocking(move || {
            // More idle connections than the caps allow.
            let mut idle: Vec<std::net::TcpStream> = (0..12)
                .map(|_| std::net::TcpStream::connect(addr).unwrap())
                .collect();
            // A slow client: headers a byte at a time, never finished.
            let mut slow = std::net::TcpStream::connect(addr).unwrap();
            // The token holder is served meanwhile, with either spelling of the scheme.
            for scheme in ["Bearer", "bearer"] {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                assert_eq!(
                    status_of(&mut c, &initialize(addr, &format!("{scheme} {token}"))),
                    Some(200),
                    "{scheme}"
                );
            }
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            assert_eq!(
                status_of(&mut c, &initialize(addr, "Bearer wrong")),
                Some(401)
            );
            // Without the token, a body that never finishes arriving is not waited for.
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            let head =
                format!("POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 1000000\r\n\r\n{{");
            assert_eq!(status_of(&mut c, head.as_bytes()), Some(401));
            assert!(
                closed_within(&mut c, Duration::from_secs(3)),
                "a refused request's slow body held the connection"
            );
            // With it, a body that does not arrive in time gets 408.
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            let head = format!(
                "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n{{"
            );
            assert_eq!(status_of(&mut c, head.as_bytes()), Some(408));
            {
                use std::io::Write;
                slow.write_all(b"POST /mcp HTTP/1.1\r\nHost: x\r\n")
                    .unwrap();
                let t0 = std::time::Instant::now();
                let mut closed = false;
                while t0.elapsed() < Duration::from_secs(5) {
                    if slow.write_all(b"X").is_err() {
                        closed = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                assert!(closed || closed_within(&mut slow, Duration::from_secs(1)));
            }
            for s in idle.iter_mut() {
                assert!(
                    closed_within(s, Duration::from_secs(5)),
                    "an idle socket stayed open"
                );
            }
        });
        let r = check.await;
        stop.cancel();
        run.await.unwrap().unwrap();
        r.unwrap();
    }

    #[test]
    fn every_tool_has_annotations() {
        for t in mcp_tools() {
            assert!(t.annotations.is_some(), "{}", t.name);
        }
    }
}
