//! The egress proxy: a guest's way out to the network, on the same channel as the credential
//! proxy (docs/egress.md). A guest sends `CONNECT host:port` (a tunnel: HTTPS, ssh with a
//! `ProxyCommand`, any TCP) or an absolute-form request (`GET http://host/path`), as every
//! client does with `http_proxy`/`https_proxy`; the proxy decides by the VM's egress policy
//! (`$BOXERY_HOME/egress/<vm>`, read per connection) and connects for it.
//!
//! # Guarantees
//! - The VM is the channel's (a per-VM socket) or, on a shared listener, the one whose token
//!   came in `Proxy-Authorization` (Basic with the token as password, or Bearer); no token:
//!   407 and nothing is resolved or connected.
//! - The policy is checked on the name the guest asked for ([`Egress::allows_name`]); then
//!   the name is resolved *here* (config `proxy.egress.resolve`, then the host's resolver),
//!   every address is checked against [`forbidden`] and the host's own addresses (any range:
//!   a public address on the host's NIC too), and the connection goes to a checked
//!   address itself: a name that resolves (or re-resolves) to a private, loopback,
//!   link-local or metadata address is refused, whatever the policy (no DNS rebinding).
//! - A refusal is `403` with `x-boxery-egress: denied` and says why, in its body and in its
//!   status line's reason phrase (what a `CONNECT` client shows); an upstream that cannot be
//!   reached is `502` with `x-boxery-egress: failed`. Either way nothing was sent.
//! - `Proxy-Authorization`, `Proxy-Connection` and hop-by-hop headers never go upstream.
//! - Every connection is audited (VM, method, host, port or path, status, bytes; no headers,
//!   no bodies) when it ends.
//! - A VM has at most `connections_per_vm` connections open through it (default
//!   [`CONNECTIONS`]); more get 429.
//!
//! # Caveats
//! - Tunnels have no time limit (a long download is legitimate); they end when either side
//!   closes.
//! - Plain-HTTP requests are carried one upstream connection per request (no pooling).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_api::network::{Egress, forbidden};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::audit::Record;
use crate::forward::{Arrival, Finish, HOP, counted};
use crate::{Inner, Refusal, Served, refuse};

/// Default connections one VM may have open through the egress proxy.
pub const CONNECTIONS: usize = 256;
/// How long resolving a name may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to an upstream may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The buffer of each direction of a tunnel.
const TUNNEL_BUF: usize = 256 * 1024;
/// The response header that tells a policy refusal (`denied`) from an unreachable upstream
/// (`failed`).
pub const HEADER: &str = "x-boxery-egress";

/// How long the host's own addresses are cached.
const LOCAL_EVERY: Duration = Duration::from_secs(1);

/// The host's own addresses (every interface's), refreshed at most every [`LOCAL_EVERY`]:
/// a guest never reaches the host through the egress proxy, whatever range its addresses are
/// in (a public address on the host's NIC included).
#[derive(Debug, Default)]
pub(crate) struct Local {
    cached: std::sync::Mutex<Option<(Instant, Vec<IpAddr>)>>,
}

impl Local {
    /// Whether `ip` is one of this host's addresses. When the interfaces cannot be read, every
    /// address counts as the host's (fail closed).
    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        let mut c = self.cached.lock().expect("not poisoned");
        if c.as_ref().is_none_or(|(at, _)| at.elapsed() >= LOCAL_EVERY) {
            match if_addrs::get_if_addrs() {
                Ok(all) => *c = Some((Instant::now(), all.iter().map(|i| i.ip()).collect())),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list the host's addresses; refusing egress");
                    return true;
                }
            }
        }
        c.as_ref().is_some_and(|(_, all)| all.contains(&ip))
    }
}

/// Why `ip` is out of every guest's reach: a forbidden range, or an address of this host.
fn refused(p: &Inner, ip: IpAddr) -> Option<&'static str> {
    forbidden(ip).or_else(|| p.local.contains(ip).then_some("this host's own"))
}

/// Headers for this proxy alone, never passed on (besides [`HOP`]).
const PROXY_ONLY: &[&str] = &["proxy-authorization", "proxy-authenticate"];

/// Whether header `n` stops here: hop-by-hop, or for this proxy.
fn hop(n: &HeaderName) -> bool {
    HOP.contains(&n.as_str()) || PROXY_ONLY.contains(&n.as_str())
}

/// Whether `req` is for the egress proxy: `CONNECT`, or an absolute-form URI.
pub(crate) fn is_egress(req: &Request) -> bool {
    req.method() == Method::CONNECT || req.uri().scheme().is_some()
}

/// Where a guest reaches the credential proxy (its guest URL's host and port).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Own {
    host: String,
    port: u16,
}

impl Own {
    /// The host and port of a guest URL (`http://10.0.2.100`, `http://192.168.122.1:8431`).
    pub(crate) fn of(url: &str) -> Option<Own> {
        let uri: axum::http::Uri = url.parse().ok()?;
        Some(Own {
            host: bare(uri.host()?).to_ascii_lowercase(),
            port: uri.port_u16().unwrap_or(80),
        })
    }
}

/// Whether `req` goes through the egress proxy to the credential proxy itself: a client that
/// sends every request to `http_proxy` whatever `no_proxy` says (busybox `wget`, some SDKs).
/// The guest address is this listener's own, so it is served here, never refused as private
/// or connected to from the host.
pub(crate) fn is_own(s: &Served, req: &Request) -> bool {
    let (Some(own), Some(a)) = (&s.own, req.uri().authority()) else {
        return false;
    };
    let absolute = req.method() == Method::CONNECT || req.uri().scheme_str() == Some("http");
    absolute
        && bare(a.host()).eq_ignore_ascii_case(&own.host)
        && a.port_u16().unwrap_or(80) == own.port
}

/// An absolute-form request for this proxy, made origin-form (`GET /anthropic/v1/…`).
pub(crate) fn to_origin_form(req: &mut Request) {
    let pq = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| axum::http::uri::PathAndQuery::from_static("/"));
    *req.uri_mut() = pq.into();
}

/// `CONNECT` to this proxy's own guest address: answer 200 and serve the tunnel's requests
/// here, on the same channel (so the same VM), each admitted and audited as any other.
pub(crate) fn tunnel_to_own(s: Served, mut req: Request) -> Response {
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let Ok(conn) = upgrade.await else { return };
        let svc = hyper_util::service::TowerToHyperService::new(s.router());
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(conn, svc)
            .with_upgrades()
            .await;
    });
    StatusCode::OK.into_response()
}

/// A refusal or failure, marked so a client (the drill) can tell them apart.
fn answer(r: Refusal, mark: &'static str) -> Response {
    let status = r.status;
    let why = r.message.clone();
    let mut resp = r.into_response();
    if let Some(reason) = reason_phrase(status, &why) {
        resp.extensions_mut().insert(reason);
    }
    resp.extensions_mut().insert(Why(why));
    resp.headers_mut()
        .insert(HEADER, HeaderValue::from_static(mark));
    if status == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        resp.headers_mut().insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"boxery\""),
        );
    }
    resp
}

/// The status line's reason phrase for a refusal: its status and why (`403 Forbidden: x is not
/// in VM dev1's egress allow list …`). Many clients show only the status line of a refused
/// `CONNECT`, never the body (socat under ssh's `ProxyCommand`, Python's "Tunnel connection
/// failed" in pip): so they show why. Bytes a status line cannot hold become `?`.
fn reason_phrase(status: StatusCode, why: &str) -> Option<hyper::ext::ReasonPhrase> {
    let line: String = format!("{}: {why}", status.canonical_reason().unwrap_or("Refused"))
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .take(400)
        .collect();
    hyper::ext::ReasonPhrase::try_from(line).ok()
}

/// Why a response refused, for the audit record.
#[derive(Clone)]
struct Why(String);

/// The token in `Proxy-Authorization` (Basic with the token as password, or Bearer).
fn proxy_token(h: &HeaderMap) -> Option<String> {
    crate::token::credential(h.get(header::PROXY_AUTHORIZATION)?.to_str().ok()?)
}

/// Where the guest wants to go: (host as asked, port).
fn target(req: &Request) -> Result<(String, u16), Refusal> {
    let uri = req.uri();
    if req.method() == Method::CONNECT {
        let a = uri
            .authority()
            .ok_or_else(|| refuse(StatusCode::BAD_REQUEST, "CONNECT needs host:port"))?;
        let port = a
            .port_u16()
            .ok_or_else(|| refuse(StatusCode::BAD_REQUEST, "CONNECT needs host:port"))?;
        return Ok((bare(a.host()).to_string(), port));
    }
    if uri.scheme_str() != Some("http") {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "only http:// URLs are forwarded as requests; https goes through CONNECT (https_proxy)",
        ));
    }
    let host = uri
        .host()
        .ok_or_else(|| refuse(StatusCode::BAD_REQUEST, "the URL has no host"))?;
    Ok((bare(host).to_string(), uri.port_u16().unwrap_or(80)))
}

/// A host without the brackets of an IPv6 literal.
fn bare(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Why `policy` refuses VM `vm` the name (or address literal) `host`, in words for its person;
/// `None` when it allows it.
pub(crate) fn policy_refusal(vm: &str, policy: &Egress, host: &str) -> Option<String> {
    if policy.allows_name(host) {
        return None;
    }
    Some(match policy.policy {
        boxery_api::network::EgressPolicy::Deny => format!(
            "VM {vm}'s egress policy is Deny: nothing goes out but its grants through \
             $BOXERY_PROXY (change spec.network.egress to allow {host})"
        ),
        _ if host.parse::<IpAddr>().is_ok() => format!(
            "VM {vm}'s egress policy is Allowlist, which lists names, not addresses: \
             ask for {host} by name"
        ),
        _ => format!("{host} is not in VM {vm}'s egress allow list (spec.network.egress.allow)"),
    })
}

/// Why a name's addresses are not given to a guest.
#[derive(Debug)]
pub(crate) enum Unreachable {
    /// The resolver says there is no such name.
    Unresolved,
    /// The resolver did not answer within [`RESOLVE_TIMEOUT`], or failed for now.
    Unanswered,
    /// Every address it has is out of every guest's reach: why, in words.
    Forbidden(String),
}

/// The addresses of `host` (an address literal, a name of config `proxy.egress.resolve`, or
/// one the host's resolver knows) that a guest may reach, at `port`.
pub(crate) async fn lookup(
    p: &Inner,
    host: &str,
    port: u16,
) -> Result<Vec<SocketAddr>, Unreachable> {
    let addrs: Vec<SocketAddr> = if let Ok(ip) = host.parse::<IpAddr>() {
        vec![SocketAddr::new(ip, port)]
    } else if let Some(ip) = p
        .config
        .egress
        .resolve
        .get(&host.trim_end_matches('.').to_ascii_lowercase())
    {
        vec![SocketAddr::new(*ip, port)]
    } else {
        match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
            Ok(Ok(a)) => a.collect(),
            // (getaddrinfo's EAI_AGAIN: a resolver that could not answer now)
            Ok(Err(e)) if e.to_string().contains("Temporary failure") => {
                return Err(Unreachable::Unanswered);
            }
            Ok(Err(_)) => return Err(Unreachable::Unresolved),
            Err(_) => return Err(Unreachable::Unanswered),
        }
    };
    let (ok, bad): (Vec<SocketAddr>, Vec<SocketAddr>) = addrs
        .into_iter()
        .partition(|a| refused(p, a.ip()).is_none());
    if ok.is_empty() {
        let (addr, range) = bad
            .first()
            .map(|a| {
                (
                    a.ip().to_string(),
                    refused(p, a.ip()).unwrap_or("forbidden"),
                )
            })
            .unwrap_or_default();
        return Err(Unreachable::Forbidden(format!(
            "{host} is {addr}, a {range} address: no guest reaches it through boxery"
        )));
    }
    Ok(ok)
}

/// Decide and resolve: the addresses `host` may be reached at under `policy`.
async fn admit(
    p: &Inner,
    vm: &str,
    policy: &Egress,
    host: &str,
    port: u16,
) -> Result<Vec<SocketAddr>, Response> {
    let denied = |msg: String| answer(refuse(StatusCode::FORBIDDEN, msg), "denied");
    if let Some(why) = policy_refusal(vm, policy, host) {
        return Err(denied(why));
    }
    lookup(p, host, port).await.map_err(|e| match e {
        Unreachable::Forbidden(why) => denied(why),
        Unreachable::Unresolved | Unreachable::Unanswered => answer(
            refuse(
                StatusCode::BAD_GATEWAY,
                format!("{host} could not be resolved"),
            ),
            "failed",
        ),
    })
}

async fn connect(addrs: &[SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for a in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e,
            Err(_) => last = std::io::ErrorKind::TimedOut.into(),
        }
    }
    Err(last)
}

/// Serve one egress request; a refusal or failure before any answer is audited here.
pub(crate) async fn handle(s: Served, req: Request) -> Response {
    let mut at = Arrival::new(Record {
        route: Some("egress".into()),
        ..Record::begin(req.method())
    });
    match serve(&s, req, &mut at).await {
        Ok(r) => r,
        Err(r) => {
            let why = r.extensions().get::<Why>().map(|w| w.0.clone());
            at.ended(&s.proxy.inner, r.status(), why);
            r
        }
    }
}

/// Decide, connect, and tunnel or forward. `Err`: the refusal or failure to answer with,
/// not audited yet; `Ok`: audited when it ends.
async fn serve(s: &Served, req: Request, at: &mut Arrival) -> Result<Response, Response> {
    let p = &s.proxy.inner;
    let (host, port) = target(&req).map_err(|r| answer(r, "denied"))?;
    at.rec.host = Some(format!("{host}:{port}"));
    at.rec.path = if req.method() == Method::CONNECT {
        String::new()
    } else {
        req.uri().path().to_string()
    };
    let vm = vm_of(s, req.headers()).map_err(|r| answer(r, "denied"))?;
    at.rec.vm = Some(vm.clone());
    let policy = boxery_home::egress::read(&p.home, &vm);
    let addrs = admit(p, &vm, &policy, &host, port).await?;
    let Some(permit) = p.permit(&format!("egress {vm}"), p.egress_connections) else {
        let r = refuse(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "VM {vm} already has {} connections open through the egress proxy",
                p.egress_connections
            ),
        );
        return Err(answer(r, "failed"));
    };
    let upstream = connect(&addrs).await.map_err(|e| {
        let r = refuse(
            StatusCode::BAD_GATEWAY,
            format!("{host}:{port} could not be reached: {}", e.kind()),
        );
        answer(r, "failed")
    })?;
    at.rec.status = 200;
    if req.method() == Method::CONNECT {
        let fin = at.finish(p, None, permit);
        return Ok(tunnel(req, upstream, fin));
    }
    let sent = plain(p, req, (&host, port), upstream, &mut at.rec).await?;
    let fin = at.finish(p, Some(sent.bytes_in), permit);
    Ok(sent.back.body(fin.body(sent.body)).unwrap_or_else(|_| {
        answer(
            refuse(
                StatusCode::BAD_GATEWAY,
                "the upstream's response headers are invalid",
            ),
            "failed",
        )
    }))
}

/// The VM asking: the channel's, or (on a shared listener) the one whose token came in
/// `Proxy-Authorization`.
fn vm_of(s: &Served, h: &HeaderMap) -> Result<String, Refusal> {
    if let Some(ch) = &s.channel {
        return Ok(ch.to_string());
    }
    match proxy_token(h).and_then(|t| s.proxy.inner.tokens.lookup(&t)) {
        Some((vm, _)) => Ok(vm),
        None => Err(refuse(
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "no or wrong token: send the VM's boxery token as the proxy password \
             (http://boxery:$BOXERY_TOKEN@HOST:PORT)",
        )),
    }
}

/// `CONNECT`: answer 200 now and, once the client's connection is handed over, copy both
/// ways until either side closes; `fin` audits it then.
fn tunnel(mut req: Request, upstream: TcpStream, fin: Finish) -> Response {
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let (mut up, mut fin) = (upstream, fin);
        match upgrade.await {
            Ok(io) => {
                let mut io = TokioIo::new(io);
                // Large buffers: tokio's default (8 KiB) halves a bulk download's rate.
                let copied = tokio::io::copy_bidirectional_with_sizes(
                    &mut io, &mut up, TUNNEL_BUF, TUNNEL_BUF,
                )
                .await;
                if let Ok((sent, got)) = copied {
                    fin.rec.bytes_in = sent;
                    fin.bytes.store(got, Ordering::Relaxed);
                }
            }
            Err(_) => fin.rec.reason = Some("the client went away before the tunnel".into()),
        }
    });
    Response::new(Body::empty())
}

/// A plain-HTTP request's answer from upstream, before its body is streamed back.
struct Sent {
    /// The response, its headers copied but for [`HOP`].
    back: axum::http::response::Builder,
    body: http_body_util::BodyDataStream<hyper::body::Incoming>,
    /// The request body's bytes, counted as they stream.
    bytes_in: Arc<AtomicU64>,
}

/// A plain-HTTP request: sent upstream in origin form, on its own connection. Sets `rec`'s
/// status to the upstream's.
async fn plain(
    p: &Inner,
    req: Request,
    (host, port): (&str, u16),
    upstream: TcpStream,
    rec: &mut Record,
) -> Result<Sent, Response> {
    let (parts, body) = req.into_parts();
    let bytes_in = Arc::new(AtomicU64::new(0));
    let body = Body::from_stream(counted(body.into_data_stream(), bytes_in.clone()));
    let Ok(out) = origin_request(&parts, host, body) else {
        return Err(answer(
            refuse(StatusCode::BAD_REQUEST, "the request is malformed"),
            "denied",
        ));
    };
    let sent = async {
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await?;
        tokio::spawn(conn);
        sender.send_request(out).await
    };
    let resp = match tokio::time::timeout(p.limits.timeout, sent).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) | Err(_) => {
            let r = refuse(
                StatusCode::BAD_GATEWAY,
                format!("{host}:{port} did not answer the request"),
            );
            return Err(answer(r, "failed"));
        }
    };
    let (rparts, rbody) = resp.into_parts();
    let mut back = Response::builder().status(rparts.status);
    for (n, v) in &rparts.headers {
        if !hop(n) {
            back = back.header(n, v);
        }
    }
    rec.status = rparts.status.as_u16();
    Ok(Sent {
        back,
        body: http_body_util::BodyExt::into_data_stream(rbody),
        bytes_in,
    })
}

/// The request in origin form for `host` (from what was checked, never the URL's userinfo),
/// without hop-by-hop or proxy headers.
fn origin_request(
    parts: &axum::http::request::Parts,
    host: &str,
    body: Body,
) -> axum::http::Result<axum::http::Request<Body>> {
    let authority = match (host.contains(':'), parts.uri.port_u16()) {
        (true, Some(p)) => format!("[{host}]:{p}"),
        (true, None) => format!("[{host}]"),
        (false, Some(p)) => format!("{host}:{p}"),
        (false, None) => host.to_string(),
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let mut out = axum::http::Request::builder()
        .method(parts.method.clone())
        .uri(path);
    for (n, v) in &parts.headers {
        if !hop(n) && *n != header::HOST {
            out = out.header(n, v);
        }
    }
    out.header(header::HOST, authority).body(body)
}
