//! `boxery desktop VM`: a VM's desktop live in a person's browser. A small web server on this
//! machine's loopback serves noVNC (Debian's `novnc`, [`NOVNC`]) and carries each of its
//! websockets to one VNC session in the guest ([`boxery_verbs::guest::desktop`]: `x11vnc
//! -inetd` over the VM's pinned ssh connection, so no VNC port is open anywhere).
//!
//! Who may look: the printed link holds a one-time token. Its first use (a GET) answers a page
//! that sends the browser on to the viewer under a session path, `/s/SECRET/`, that only this
//! browser learns; the token is then spent, and every request (a page, a script, the
//! websocket) must be under that path. No cookie: a cookie for 127.0.0.1 would go to every
//! other server on 127.0.0.1 too. A request naming another host than `127.0.0.1:PORT` or
//! `localhost:PORT` is refused (a page of another site cannot reach the server through DNS
//! rebinding), and so is a websocket from another origin. `--open` hands the browser a private
//! file that leads to the link, so the token is never on a command line. Without
//! `--control` the guest's x11vnc drops keys and the pointer (`-viewonly`).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_verbs::Verbs;
use boxery_verbs::guest::desktop::Viewer;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::exit::{CliError, CliResult};
use crate::out::outln;

/// Where Debian's `novnc` package puts the viewer's page and scripts.
pub const NOVNC: &str = "/usr/share/novnc";
/// Viewers at once (each is an x11vnc in the guest).
const MAX_VIEWERS: usize = 4;
/// The largest file served (noVNC's largest is about 100 KiB).
const MAX_FILE: u64 = 4 << 20;

/// One `boxery desktop` session.
struct Desk {
    viewer: Viewer,
    web: PathBuf,
    port: u16,
    /// The link's token, until its first use.
    link: Mutex<Option<String>>,
    /// The session path's secret (`/s/SECRET/…`), which only the link's browser learns.
    session: String,
    viewers: Arc<tokio::sync::Semaphore>,
}

/// `desktop VM [--control] [--open] [--port N]`: serve the desktop until interrupted.
pub async fn desktop(
    v: &Verbs,
    vm: &str,
    control: bool,
    open: bool,
    port: u16,
) -> CliResult<ExitCode> {
    let web = PathBuf::from(NOVNC);
    if !web.join("vnc.html").is_file() {
        return Err(CliError::invalid(format!(
            "noVNC is not installed ({NOVNC}/vnc.html): `sudo apt-get install novnc` (or scripts/install-deps.sh)"
        )));
    }
    let viewer = boxery_verbs::guest::desktop::open(v, vm, control).await?;
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| CliError::invalid(format!("cannot listen on 127.0.0.1:{port}: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| CliError::invalid(format!("the listening socket: {e}")))?
        .port();
    let token = secret();
    let desk = Arc::new(Desk {
        viewer,
        web,
        port,
        link: Mutex::new(Some(token.clone())),
        session: secret(),
        viewers: Arc::new(tokio::sync::Semaphore::new(MAX_VIEWERS)),
    });
    let url = format!("http://127.0.0.1:{port}/?token={token}");
    outln!("{url}");
    eprintln!(
        "boxery: serving {vm}'s {}, {}, on 127.0.0.1:{port} until interrupted (Ctrl-C); the link works once, in one browser",
        if desk.viewer.console() {
            "console (the hypervisor's screen: the VM has no desktop)"
        } else {
            screen_word(&desk.viewer)
        },
        if control {
            "with control (keys and the pointer reach it)"
        } else {
            "view only (--control to drive it)"
        }
    );
    // (kept until the server ends: the browser may read it late)
    let _page = match open {
        true => open_browser(&url),
        false => None,
    };
    let _session = v
        .is_home_store()
        .then(|| boxery_home::activity::Ticker::start(&v.env.home, vm));
    let app = axum::Router::new().fallback(serve).with_state(desk);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| CliError::new(crate::exit::Code::Failed, e))?;
    Ok(ExitCode::SUCCESS)
}

/// 32 random bytes, hex.
fn secret() -> String {
    boxery_backends::identity::random_hex(32)
}

/// `a == b` in time that depends on their lengths only.
fn same(a: &str, b: &str) -> bool {
    boxery_mcp::server::same(a.as_bytes(), b.as_bytes())
}

/// A page that sends its browser to `url` (the link, or the viewer): the token or the session
/// path never on a command line or in a Referer.
fn onward_page(url: &str) -> String {
    // (a JSON string, with `<` escaped: nothing in it can end the script element)
    let json = serde_json::Value::from(url)
        .to_string()
        .replace('<', "\\u003c");
    format!(
        "<!doctype html>\n<meta charset=\"utf-8\">\n<meta name=\"referrer\" content=\"no-referrer\">\n<title>boxery desktop</title>\n<script>location.replace({json});</script>\n<noscript>This page needs JavaScript (noVNC does).</noscript>\n"
    )
}

/// Open `url` in the person's browser (`$BROWSER`, else `xdg-open`) through a private file
/// (0600, removed when the returned handle drops) that leads to it, or say how.
fn open_browser(url: &str) -> Option<tempfile::NamedTempFile> {
    use std::io::Write;
    let page = tempfile::Builder::new()
        .prefix("boxery-desktop-")
        .suffix(".html")
        .tempfile()
        .and_then(|mut f| f.write_all(onward_page(url).as_bytes()).map(|()| f));
    let page = match page {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "boxery: could not write the page that opens the link ({e}): open the link yourself"
            );
            return None;
        }
    };
    let browser = std::env::var("BROWSER").unwrap_or_else(|_| "xdg-open".into());
    let started = std::process::Command::new(&browser)
        .arg(page.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    match started {
        // (waited for on a thread of its own: no zombie)
        Ok(mut child) => drop(std::thread::spawn(move || child.wait())),
        Err(e) => eprintln!("boxery: could not start {browser} ({e}): open the link yourself"),
    }
    Some(page)
}

fn refuse(code: StatusCode, why: &str) -> Response {
    let mut r = (code, format!("{why}\n")).into_response();
    secure(r.headers_mut());
    r
}

/// Headers on every answer: nothing cached, no sniffing, no framing by another page, no
/// referrer.
fn secure(h: &mut HeaderMap) {
    for (k, v) in [
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
    ] {
        h.insert(k, HeaderValue::from_static(v));
    }
}

impl Desk {
    /// Whether header `name` names this server: `127.0.0.1:PORT` or `localhost:PORT`, after
    /// `prefix` (`http://` for an Origin).
    fn names_us(&self, h: &HeaderMap, name: header::HeaderName, prefix: &str) -> bool {
        let port = self.port;
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix(prefix))
            .is_some_and(|v| v == format!("127.0.0.1:{port}") || v == format!("localhost:{port}"))
    }

    /// Whether the request names this server (its Host).
    fn ours(&self, h: &HeaderMap) -> bool {
        self.names_us(h, header::HOST, "")
    }

    /// Whether a websocket comes from this server's own page (its Origin).
    fn same_origin(&self, h: &HeaderMap) -> bool {
        self.names_us(h, header::ORIGIN, "http://")
    }

    /// The viewer's address, with this session's options.
    fn viewer_page(&self) -> String {
        let s = &self.session;
        format!(
            "/s/{s}/vnc.html?autoconnect=1&resize=scale&reconnect=1&reconnect_delay=2000&path=s/{s}/websockify&view_only={}",
            u8::from(!self.viewer.control())
        )
    }

    /// The link's use: the token spent, on to the viewer.
    fn redeem(&self, token: &str) -> Response {
        let fresh = {
            let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
            match link.as_deref() {
                Some(t) if same(t, token) => {
                    *link = None;
                    true
                }
                _ => false,
            }
        };
        if !fresh {
            return refuse(
                StatusCode::FORBIDDEN,
                "this link is not valid, or was used already: run `boxery desktop` again for a new one",
            );
        }
        let mut r = (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            onward_page(&self.viewer_page()),
        )
            .into_response();
        secure(r.headers_mut());
        r
    }
}

async fn serve(State(d): State<Arc<Desk>>, req: Request) -> Response {
    let (mut parts, _) = req.into_parts();
    if !d.ours(&parts.headers) {
        return refuse(
            StatusCode::FORBIDDEN,
            "this server answers only to 127.0.0.1 and localhost at its own port",
        );
    }
    let head = parts.method == Method::HEAD;
    if parts.method != Method::GET && !head {
        return refuse(StatusCode::METHOD_NOT_ALLOWED, "only GET");
    }
    let path = parts.uri.path().to_string();
    if path == "/" {
        let token = parts
            .uri
            .query()
            .into_iter()
            .flat_map(|q| q.split('&'))
            .find_map(|kv| kv.strip_prefix("token="));
        return match token {
            // (a link previewer's HEAD does not spend it)
            Some(_) if head => refuse(StatusCode::METHOD_NOT_ALLOWED, "open the link in a browser"),
            Some(token) => d.redeem(token),
            None => refuse(
                StatusCode::FORBIDDEN,
                "open the link `boxery desktop` printed (it works once, in one browser)",
            ),
        };
    }
    let inside = path
        .strip_prefix("/s/")
        .and_then(|rest| rest.split_once('/'))
        .filter(|(secret, _)| same(secret, &d.session));
    let Some((_, rest)) = inside else {
        return refuse(
            StatusCode::FORBIDDEN,
            "open the link `boxery desktop` printed (it works once, in one browser)",
        );
    };
    if rest == "websockify" {
        if !d.same_origin(&parts.headers) {
            return refuse(StatusCode::FORBIDDEN, "a websocket from another page");
        }
        let Ok(permit) = d.viewers.clone().try_acquire_owned() else {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many viewers of this desktop at once",
            );
        };
        return match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
            // (a viewer's RFB messages are small; a clipboard past this is refused)
            Ok(ws) => ws
                .max_message_size(MAX_MESSAGE)
                .on_upgrade(move |socket| async move {
                    bridge(socket, &d).await;
                    drop(permit);
                }),
            Err(e) => e.into_response(),
        };
    }
    file(&d.web, rest).await
}

/// A file of noVNC's (`rel`, relative to `web`): each part of the path plain (letters, digits,
/// `.`, `-`, `_`, not starting with a dot), a regular file, of a type it has.
async fn file(web: &Path, rel: &str) -> Response {
    let rel = if rel.is_empty() { "vnc.html" } else { rel };
    let plain = rel.split('/').all(|p| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    });
    let ext = rel.rsplit_once('.').map_or("", |(_, e)| e);
    let kind = match ext {
        "html" => "text/html; charset=utf-8",
        "js" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "json" => "application/json",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "ttf" => "font/ttf",
        "mp3" => "audio/mpeg",
        "oga" => "audio/ogg",
        _ => "",
    };
    let full = web.join(rel);
    let ok = plain
        && !kind.is_empty()
        && tokio::fs::metadata(&full)
            .await
            .is_ok_and(|m| m.is_file() && m.len() <= MAX_FILE);
    let body = match ok {
        true => tokio::fs::read(&full).await.ok(),
        false => None,
    };
    let Some(body) = body else {
        return refuse(StatusCode::NOT_FOUND, "not found");
    };
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    secure(r.headers_mut());
    r
}

/// The largest websocket message a viewer may send (a page's RFB messages are bytes; its
/// clipboard text, which a view-only viewer's filter reads through, is the large one).
const MAX_MESSAGE: usize = 1 << 20;

/// Carry one websocket to a VNC session in the guest until either ends; when the guest side
/// ends before sending anything, say why (ssh's stderr).
async fn bridge(socket: WebSocket, d: &Desk) {
    let vm = d.viewer.vm();
    let what = screen_word(&d.viewer);
    let mut session = match d.viewer.connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("boxery: a viewer could not reach {vm}'s {what}: {e}");
            return;
        }
    };
    let why = session.why.take().map(|mut stderr| {
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(4096).read_to_end(&mut buf).await;
            buf
        })
    });
    let (mut tx, mut rx) = socket.split();
    let (to, from, filter) = (&mut session.to, &mut session.from, &mut session.filter);
    let mut refused: Option<String> = None;
    let up = async {
        while let Some(Ok(m)) = rx.next().await {
            let b = match m {
                Message::Binary(b) => b,
                Message::Close(_) => break,
                _ => continue,
            };
            let b = match boxery_verbs::guest::rfb::pass(filter, &b) {
                Ok(passed) => passed,
                Err(why) => {
                    refused = Some(why);
                    break;
                }
            };
            if to.write_all(&b).await.is_err() {
                break;
            }
        }
    };
    let mut sent = false;
    let down = async {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !sent {
                        sent = true;
                        eprintln!("boxery: a viewer connected");
                    }
                    let bytes = axum::body::Bytes::copy_from_slice(&buf[..n]);
                    if tx.send(Message::Binary(bytes)).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = tx.send(Message::Close(None)).await;
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
    session.end().await;
    if let Some(why) = refused {
        eprintln!("boxery: a view-only viewer was disconnected: {why}");
    } else if sent {
        eprintln!("boxery: a viewer left");
    } else {
        let why = match why {
            Some(w) => w.await.unwrap_or_default(),
            None => Vec::new(),
        };
        let why = String::from_utf8_lossy(&why);
        eprintln!(
            "boxery: a viewer could not reach {vm}'s {what}: {}",
            match boxery_verbs::render::safe(why.trim()) {
                w if w.is_empty() => "the stream ended".into(),
                w => w,
            }
        );
    }
}

/// What a viewer watches, in words.
fn screen_word(v: &boxery_verbs::guest::desktop::Viewer) -> &'static str {
    if v.console() { "console" } else { "desktop" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_and_compared_whole() {
        let (a, b) = (secret(), secret());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(same(&a, &a.clone()));
        assert!(!same(&a, &b));
        assert!(!same(&a, &a[..63]));
        assert!(!same("", &a));
    }

    #[tokio::test]
    async fn only_plain_paths_of_known_types_are_served() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("vnc.html"), "<html>").unwrap();
        std::fs::create_dir(dir.path().join("app")).unwrap();
        std::fs::write(dir.path().join("app/ui.js"), "x").unwrap();
        std::fs::write(dir.path().join("secret.key"), "k").unwrap();
        std::fs::write(dir.path().join(".hidden.js"), "h").unwrap();
        for (p, code) in [
            ("", StatusCode::OK),
            ("vnc.html", StatusCode::OK),
            ("app/ui.js", StatusCode::OK),
            ("secret.key", StatusCode::NOT_FOUND),
            (".hidden.js", StatusCode::NOT_FOUND),
            ("app/../vnc.html", StatusCode::NOT_FOUND),
            ("app//ui.js", StatusCode::NOT_FOUND),
            ("/etc/passwd", StatusCode::NOT_FOUND),
            ("app", StatusCode::NOT_FOUND),
            ("%2e%2e/etc/passwd", StatusCode::NOT_FOUND),
        ] {
            assert_eq!(file(dir.path(), p).await.status(), code, "{p}");
        }
        let r = file(dir.path(), "app/ui.js").await;
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "text/javascript; charset=utf-8"
        );
        assert_eq!(r.headers()[header::X_FRAME_OPTIONS], "DENY");
    }

    #[test]
    fn the_onward_page_quotes_its_address() {
        let p = onward_page("/s/x/vnc.html?a=1&b=</script><script>alert(1)");
        assert!(!p.contains("</script><script>alert"), "{p}");
        assert!(p.contains("location.replace("));
    }
}
