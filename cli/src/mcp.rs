//! The MCP server, built from the tool table (`crate::tools`): `boxery mcp` over stdio, and
//! streamable HTTP at `/mcp` inside `boxery serve --mcp-listen ADDR`.
//!
//! Over HTTP every request needs `Authorization: Bearer TOKEN` (the token is generated into
//! `$BOXERY_HOME/mcp-token`, mode 0600), an `Origin`, when present, must be one of the allowed
//! origins (by default only the listen address itself), and request bodies are capped at
//! [`BODY_CAP`]. Tool arguments are bounded by the table (`tools::ARGS_CAP`, `STRING_CAP`).
//! Each HTTP session gets its own default VM; local paths are refused over HTTP.

use std::net::SocketAddr;
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

use crate::env::Env;
use crate::exit::{CliError, CliResult};
use crate::runtime::Started;
use crate::tools::{self, Session};

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
            let mut res = CallToolResult::success(vec![ContentBlock::text(out.text)]);
            res.structured_content = out.data;
            res
        }
        Err(e) => CallToolResult::error(vec![ContentBlock::text(e.to_string())]),
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
        // Run on its own task so a panicking runner is a tool error, not a dead server.
        let task = tokio::spawn(tool.run(self.session.clone(), args, context.ct.clone()));
        let r = match task.await {
            Ok(r) => r,
            Err(e) => Err(tools::ToolError::Failed(format!(
                "{} failed inside boxery ({e}); this is a bug: please report it",
                tool.name
            ))),
        };
        Ok(to_result(r).into())
    }
}

/// Keep the controllers running in this process while nothing else leads the store, so
/// `vm_apply` converges without a `boxery serve`.
fn embed_controllers(env: Env) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Ok(store) = env.store() else { return };
        let mut embedded = None;
        loop {
            if embedded.is_none() {
                match crate::runtime::Embedded::start_if_needed(&env, &store).await {
                    Ok(Started::Here(e)) => {
                        tracing::info!("boxery mcp: running the controllers (no serve leads)");
                        embedded = Some(e);
                    }
                    Ok(Started::Elsewhere) => {}
                    Ok(Started::Unreachable(why)) => tracing::warn!("{why}; retrying in 5 s"),
                    Err(e) => tracing::warn!(error = %e.error, "cannot run the controllers"),
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
pub async fn stdio(env: &Env, vm: Option<String>) -> CliResult {
    let controllers = embed_controllers(env.clone());
    let session = Arc::new(Session::new(env.clone(), vm, true));
    let server = BoxeryMcp::new(session.clone());
    let signalled = terminated();
    tokio::pin!(signalled);
    let running = tokio::select! {
        r = server.serve(rmcp::transport::stdio()) => {
            r.map_err(|e| CliError::failed(format!("MCP initialisation failed: {e}")))?
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
    r.map_err(|e| CliError::failed(format!("the MCP session ended with an error: {e}")))?;
    Ok(())
}

/// Read or create the bearer token in `$BOXERY_HOME/mcp-token` (0600).
pub fn token(env: &Env) -> CliResult<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = env.home.join("mcp-token");
    if let Ok(t) = std::fs::read_to_string(&path)
        && t.trim().len() >= 32
    {
        return Ok(t.trim().to_string());
    }
    std::fs::create_dir_all(&env.home)?;
    let t = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(t.as_bytes())?;
    f.write_all(b"\n")?;
    std::fs::rename(&tmp, &path)?;
    Ok(t)
}

#[derive(Clone)]
struct Gate {
    token: Arc<String>,
    origins: Arc<Vec<String>>,
}

fn refuse(code: StatusCode, msg: &str) -> Response {
    (code, format!("{msg}\n")).into_response()
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn gate(State(g): State<Gate>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same(auth.trim().as_bytes(), g.token.as_bytes()) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token: send Authorization: Bearer $(cat $BOXERY_HOME/mcp-token)",
        );
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
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n > BODY_CAP);
    if too_big {
        return refuse(StatusCode::PAYLOAD_TOO_LARGE, "request body too large");
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, BODY_CAP).await {
        Ok(b) => b,
        Err(_) => return refuse(StatusCode::PAYLOAD_TOO_LARGE, "request body too large"),
    };
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// Serve streamable HTTP MCP at `http://ADDR/mcp` until `shutdown`; `origins` are extra
/// allowed browser origins.
pub async fn http(
    env: &Env,
    addr: SocketAddr,
    origins: Vec<String>,
    shutdown: CancellationToken,
) -> CliResult {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
    let token = token(env)?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::failed(format!("cannot listen on {addr} for MCP: {e}")))?;
    let local = listener.local_addr()?;
    let mut allowed = vec![
        format!("http://{local}"),
        format!("http://localhost:{}", local.port()),
    ];
    allowed.extend(origins);
    let mut cfg = StreamableHttpServerConfig::default();
    cfg.cancellation_token = shutdown.child_token();
    if !local.ip().is_loopback() {
        cfg.allowed_hosts.push(local.ip().to_string());
        cfg.allowed_hosts.push(local.to_string());
    }
    let env2 = env.clone();
    // Sessions end (and release their leases) when the client deletes them, when they idle
    // out (rmcp's keep-alive), or when the server shuts down (below).
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
    let g = Gate {
        token: Arc::new(token),
        origins: Arc::new(allowed),
    };
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(g, gate));
    eprintln!(
        "boxery serve: MCP at http://{local}/mcp (bearer token in {})",
        env.home.join("mcp-token").display()
    );
    let r = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(|e| CliError::failed(format!("the MCP HTTP server failed: {e}")));
    let live: Vec<Arc<Session>> = sessions
        .lock()
        .expect("poisoned")
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    for s in live {
        s.release_leases();
    }
    r
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
        let env = Env {
            home: d.path().to_path_buf(),
            backend_name: "fake".into(),
        };
        let a = token(&env).unwrap();
        assert_eq!(a, token(&env).unwrap());
        let mode = std::fs::metadata(d.path().join("mcp-token"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn every_tool_has_annotations() {
        for t in mcp_tools() {
            assert!(t.annotations.is_some(), "{}", t.name);
        }
    }
}
