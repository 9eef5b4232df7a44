//! The credential proxy over real HTTP: a stand-in upstream records what reaches it; the
//! proxy reads token and grant-state files in the control plane's formats from a real home.
//! (`tests/proxy.rs` at the workspace root drives the same through `boxery serve`.)

mod support;

use std::time::Duration;

use boxery_api::grant::GrantType;
use support::{Fixture, KEY, client};

const VM_UID: &str = "vmuid-dev1";

/// dev1 with its own token and an Applied llm grant for anthropic.
async fn dev1() -> (Fixture, String) {
    let f = Fixture::start().await;
    let t = f.token("dev1", VM_UID);
    f.grant(
        "dev1",
        "dev1-llm-anthropic",
        GrantType::Llm,
        "anthropic",
        None,
        VM_UID,
        false,
    );
    (f, t)
}

/// dev2 beside dev1: its own token and its own Applied llm grant for anthropic.
fn dev2(f: &Fixture) -> String {
    let t = f.token("dev2", "vmuid-dev2");
    f.grant(
        "dev2",
        "dev2-llm-anthropic",
        GrantType::Llm,
        "anthropic",
        None,
        "vmuid-dev2",
        false,
    );
    t
}

async fn post(
    f: &Fixture,
    path: &str,
    auth: Option<(&str, &str)>,
    body: &'static str,
) -> reqwest::Response {
    let mut r = client().post(format!("{}{path}", f.proxy)).body(body);
    if let Some((h, v)) = auth {
        r = r.header(h, v);
    }
    r.send().await.unwrap()
}

async fn reason(r: reqwest::Response) -> (u16, String) {
    let s = r.status().as_u16();
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    (
        s,
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

#[tokio::test]
async fn a_granted_request_reaches_the_upstream_with_the_real_key_and_without_the_token() {
    let (f, t) = dev1().await;
    let r = client()
        .post(format!("{}/llm/anthropic/v1/messages?beta=true", f.proxy))
        .header("x-api-key", &t)
        .header("anthropic-version", "2023-06-01")
        .header("cookie", "c=1")
        .body(r#"{"model":"m","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), r#"{"ok":true}"#);
    let seen = f.upstream.seen();
    assert_eq!(seen.len(), 1);
    let s = &seen[0];
    assert_eq!(
        (s.method.as_str(), s.uri.as_str()),
        ("POST", "/v1/messages?beta=true")
    );
    assert_eq!(s.headers["x-api-key"], KEY);
    assert_eq!(s.headers["anthropic-version"], "2023-06-01");
    assert_eq!(&s.body[..], br#"{"model":"m","messages":[]}"#);
    assert!(!s.headers.contains_key("cookie"));
    let all = format!("{:?}", s.headers);
    assert!(!all.contains(&t), "the token never leaves the proxy: {all}");

    // OpenAI-style: Bearer in, Bearer out.
    f.grant(
        "dev1",
        "dev1-llm-openai",
        GrantType::Llm,
        "openai",
        None,
        VM_UID,
        false,
    );
    let r = post(
        &f,
        "/llm/openai/v1/chat/completions",
        Some(("authorization", &format!("Bearer {t}"))),
        "{}",
    )
    .await;
    assert_eq!(r.status(), 200);
    let s = f.upstream.seen().pop().unwrap();
    assert_eq!(s.headers["authorization"], format!("Bearer {KEY}"));
    assert!(!format!("{:?}", s.headers).contains(&t));

    // Audited, without the key or the token.
    let audit = f.audit();
    assert_eq!(audit.lines().count(), 2, "{audit}");
    let first: serde_json::Value = serde_json::from_str(audit.lines().next().unwrap()).unwrap();
    assert_eq!(first["vm"], "dev1");
    assert_eq!(first["grant"], "dev1-llm-anthropic");
    assert_eq!(first["status"], 200);
    assert_eq!(first["path"], "/v1/messages");
    assert_eq!(first["bytes_out"], 11);
    assert!(!audit.contains(KEY) && !audit.contains(&t) && !audit.contains("beta=true"));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(boxery_home::layout::audit_log(f.home()))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn refused_requests_never_reach_the_upstream() {
    let (f, t) = dev1().await;
    let other = f.token("dev2", "vmuid-dev2");
    f.grant(
        "dev2",
        "dev2-llm-openai",
        GrantType::Llm,
        "openai",
        None,
        "vmuid-dev2",
        false,
    );
    // A lease's token on a pool member, its grant bound to the lease.
    let lt = f.token("pool-0", "lease-uid-1");
    f.grant(
        "pool-0",
        "l1-llm-anthropic",
        GrantType::Llm,
        "anthropic",
        None,
        "lease-uid-1",
        true,
    );
    let ok = post(
        &f,
        "/llm/anthropic/v1/messages",
        Some(("x-api-key", &lt)),
        "{}",
    )
    .await;
    assert_eq!(ok.status(), 200, "the lease's token works while it holds");
    let before = f.upstream.count();

    let cases: Vec<(&str, u16, reqwest::RequestBuilder, &str)> = vec![
        (
            "no token",
            401,
            client().post(format!("{}/llm/anthropic/v1/messages", f.proxy)),
            "no or wrong token",
        ),
        (
            "wrong token",
            401,
            client()
                .post(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", "bxt_wrong"),
            "no or wrong token",
        ),
        (
            "a prefix of the token",
            401,
            client()
                .post(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &t[..t.len() - 1]),
            "no or wrong token",
        ),
        // dev2's token is good, but dev2 holds no anthropic grant (dev1's grant is not dev2's).
        (
            "another VM's token",
            403,
            client()
                .post(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &other),
            "no llm grant for anthropic on VM dev2",
        ),
        (
            "a provider with no grant",
            403,
            client()
                .post(format!("{}/llm/openai/v1/chat/completions", f.proxy))
                .bearer_auth(&t),
            "no llm grant for openai on VM dev1: boxery grant dev1 llm:openai",
        ),
        (
            "an unknown provider",
            404,
            client()
                .post(format!("{}/llm/mistral/v1/chat/completions", f.proxy))
                .bearer_auth(&t),
            "no LLM provider mistral",
        ),
        (
            "a path outside the allowlist",
            403,
            client()
                .post(format!("{}/llm/anthropic/v1/files", f.proxy))
                .header("x-api-key", &t),
            "not an allowed path",
        ),
        (
            "an encoded slash",
            404,
            client()
                .post(format!("{}/llm/anthropic/v1/messages%2Ffiles", f.proxy))
                .header("x-api-key", &t),
            "segments",
        ),
        (
            "a method outside the allowlist",
            405,
            client()
                .delete(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &t),
            "DELETE is not allowed",
        ),
        (
            "a WebSocket upgrade",
            403,
            client()
                .get(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &t)
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            "upgrades are refused",
        ),
        (
            "a body over the limit (declared)",
            413,
            client()
                .post(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &t)
                .body(vec![b'x'; 2048]),
            "larger than the proxy's limit",
        ),
        (
            "a body over the limit (chunked)",
            413,
            client()
                .post(format!("{}/llm/anthropic/v1/messages", f.proxy))
                .header("x-api-key", &t)
                .body(reqwest::Body::wrap_stream(futures::stream::iter(
                    (0..8).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 256])),
                ))),
            "larger than the proxy's limit",
        ),
        (
            "no route",
            404,
            client()
                .get(format!("{}/v1/messages", f.proxy))
                .header("x-api-key", &t),
            "no such route",
        ),
        (
            "an edge host with no grant",
            403,
            client()
                .get(format!("{}/edge/api.example.com/x", f.proxy))
                .header("x-boxery-token", &t),
            "no http grant for api.example.com on VM dev1",
        ),
    ];
    // The body limit of this fixture is the default (32 MiB): use a small one for the two
    // body cases through a second proxy.
    let small = Fixture::start_with(|c| c.limits.max_body_bytes = Some(1024)).await;
    let st = small.token("dev1", VM_UID);
    small.grant(
        "dev1",
        "dev1-llm-anthropic",
        GrantType::Llm,
        "anthropic",
        None,
        VM_UID,
        false,
    );
    for (what, status, req, says) in cases {
        let req = if what.starts_with("a body over") {
            // Same request, to the small proxy.
            let r = req.build().unwrap();
            let url = r.url().as_str().replace(&f.proxy, &small.proxy);
            let body = r.body().and_then(|b| b.as_bytes()).map(|b| b.to_vec());
            let mut nb = client().post(url).header("x-api-key", &st);
            nb = match body {
                Some(b) => nb.body(b),
                None => nb.body(reqwest::Body::wrap_stream(futures::stream::iter(
                    (0..8).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 256])),
                ))),
            };
            nb
        } else {
            req
        };
        let (s, msg) = reason(req.send().await.unwrap()).await;
        assert_eq!(s, status, "{what}: {msg}");
        assert!(msg.contains(says), "{what}: {msg}");
        assert!(
            !msg.contains(KEY) && !msg.contains(&t),
            "{what}: no secret echoed: {msg}"
        );
    }
    assert_eq!(f.upstream.count(), before, "the upstream saw none of them");
    assert_eq!(small.upstream.count(), 0);

    // A revoked grant: its entry leaves the state file; the next request is refused.
    f.revoke("dev1", "dev1-llm-anthropic");
    let (s, msg) = reason(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &t)),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, msg.contains("no llm grant for anthropic on VM dev1")),
        (403, true),
        "{msg}"
    );
    // A released lease: its token file goes (the lease reconciler revokes it before the reset).
    boxery_home::tokens::revoke(f.home(), "pool-0", "lease-uid-1").unwrap();
    let (s, _) = reason(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &lt)),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(s, 401, "a released lease's token is dead");
    // The next holder's token does not inherit the old lease's grant.
    let next = f.token("pool-0", "lease-uid-2");
    let (s, _) = reason(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &next)),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(s, 403, "a lease's grant is only for that lease's token");
    // The VM's own token: a VM deleted (token removed) is refused.
    std::fs::remove_file(boxery_home::layout::token(f.home(), "dev2")).unwrap();
    let (s, _) = reason(
        post(
            &f,
            "/llm/openai/v1/chat/completions",
            Some(("authorization", &format!("Bearer {other}"))),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(s, 401);
    assert_eq!(f.upstream.count(), before);

    let audit = f.audit();
    assert!(audit.lines().count() >= 16, "{audit}");
    assert!(!audit.contains(KEY) && !audit.contains(&t) && !audit.contains(&lt));
    for l in audit.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(
            v["status"].as_u64().is_some() && v["method"].is_string(),
            "{l}"
        );
    }
}

#[tokio::test]
async fn sse_streams_without_buffering() {
    let (f, t) = dev1().await;
    let mut r = client()
        .post(format!("{}/llm/anthropic/v1/messages/stream", f.proxy))
        .header("x-api-key", &t)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    // The upstream holds the rest of its response until told; the first event must be here.
    let first = tokio::time::timeout(Duration::from_secs(5), r.chunk())
        .await
        .expect("the first event arrives while the upstream is still responding")
        .unwrap()
        .unwrap();
    assert!(first.starts_with(b"event: first"), "{first:?}");
    f.upstream.finish();
    let mut rest = Vec::new();
    while let Some(c) = r.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    assert!(rest.starts_with(b"event: last"));
    // Audited when the stream ended, with its bytes.
    let audit = support::eventually_line(&f, "\"status\":200").await;
    let v: serde_json::Value = serde_json::from_str(&audit).unwrap();
    assert_eq!(
        v["bytes_out"].as_u64(),
        Some((first.len() + rest.len()) as u64)
    );
}

#[tokio::test]
async fn edge_and_github_grants_inject_only_for_their_host_and_repositories() {
    let (f, t) = dev1().await;
    f.grant(
        "dev1",
        "dev1-http-example",
        GrantType::Http,
        "api.example.com",
        Some("X-Example-Key"),
        VM_UID,
        false,
    );
    f.grant(
        "dev1",
        "dev1-github-me-repo",
        GrantType::Github,
        "me/repo",
        None,
        VM_UID,
        false,
    );
    // The http grant's header, for its host only.
    let r = client()
        .get(format!("{}/edge/api.example.com/v2/things?x=1", f.proxy))
        .header("x-boxery-token", &t)
        .header("authorization", "Bearer guest-supplied")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let s = f.upstream.seen().pop().unwrap();
    assert_eq!(s.uri, "/v2/things?x=1");
    assert_eq!(s.headers["x-example-key"], KEY);
    assert!(
        !s.headers.contains_key("authorization"),
        "the client's credentials are stripped"
    );
    assert!(!s.headers.contains_key("x-boxery-token"));
    let (code, _) = reason(
        client()
            .get(format!("{}/edge/other.example.com/v2", f.proxy))
            .header("x-boxery-token", &t)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(code, 403);
    // git over HTTP with the token as the Basic password (a credential helper), the granted repo.
    let r = client()
        .get(format!(
            "{}/edge/github.com/me/repo.git/info/refs?service=git-upload-pack",
            f.proxy
        ))
        .basic_auth("x", Some(&t))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let s = f.upstream.seen().pop().unwrap();
    use base64::Engine;
    let want = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{KEY}"))
    );
    assert_eq!(s.headers["authorization"], want);
    // The API, for that repository only.
    let r = client()
        .get(format!(
            "{}/edge/api.github.com/repos/me/repo/pulls",
            f.proxy
        ))
        .bearer_auth(&t)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        f.upstream.seen().pop().unwrap().headers["authorization"],
        format!("Bearer {KEY}")
    );
    let n = f.upstream.count();
    for path in [
        "/edge/github.com/me/other.git/info/refs",
        "/edge/api.github.com/user",
        "/edge/api.github.com/repos/someone/repo",
    ] {
        let (code, msg) = reason(
            client()
                .get(format!("{}{path}", f.proxy))
                .bearer_auth(&t)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(code, 403, "{path}: {msg}");
        assert!(msg.contains("outside the repositories granted"), "{msg}");
    }
    let (code, _) = reason(
        client()
            .request(
                reqwest::Method::TRACE,
                format!("{}/edge/api.example.com/x", f.proxy),
            )
            .header("x-boxery-token", &t)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(code, 405);
    assert_eq!(f.upstream.count(), n);
    assert!(!f.audit().contains(KEY));
}

#[tokio::test]
async fn concurrency_is_limited_per_vm() {
    let f = Fixture::start_with(|c| c.limits.concurrency_per_vm = Some(1)).await;
    let t = f.token("dev1", VM_UID);
    f.grant(
        "dev1",
        "dev1-llm-anthropic",
        GrantType::Llm,
        "anthropic",
        None,
        VM_UID,
        false,
    );
    let t2 = dev2(&f);
    // One stream held open.
    let mut held = post(
        &f,
        "/llm/anthropic/v1/messages/stream",
        Some(("x-api-key", &t)),
        "{}",
    )
    .await;
    assert_eq!(held.status(), 200);
    held.chunk().await.unwrap();
    let (code, msg) = reason(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &t)),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(code, 429, "{msg}");
    // Another VM is not held up.
    assert_eq!(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &t2)),
            "{}"
        )
        .await
        .status(),
        200
    );
    f.upstream.finish();
    while held.chunk().await.unwrap().is_some() {}
    drop(held);
    let ok = support::eventually(|| async {
        (post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &t)),
            "{}",
        )
        .await
        .status()
            == 200)
            .then_some(())
    })
    .await;
    assert!(ok.is_some(), "the permit comes back when the stream ends");
}

#[tokio::test]
async fn a_value_that_cannot_be_read_is_a_503_naming_the_grant() {
    let (f, t) = dev1().await;
    std::fs::remove_file(f.key_file()).unwrap();
    let (code, msg) = reason(
        post(
            &f,
            "/llm/anthropic/v1/messages",
            Some(("x-api-key", &t)),
            "{}",
        )
        .await,
    )
    .await;
    assert_eq!(code, 503);
    assert!(
        msg.contains("grant dev1-llm-anthropic") && msg.contains("cannot read"),
        "{msg}"
    );
    assert_eq!(f.upstream.count(), 0);
}

/// A per-VM channel (what a qemu guest's `guestfwd` reaches) serves its own VM only: another
/// VM's token, valid and with a grant of its own, is refused there and reaches no upstream.
#[tokio::test]
async fn a_channel_serves_its_own_vm_only() {
    let (f, t1) = dev1().await;
    let t2 = dev2(&f);
    let channel = format!("http://{}", serve_channel(&f, |_| None).await);
    let call = |t: &str| {
        client()
            .post(format!("{channel}/llm/anthropic/v1/messages"))
            .header("x-api-key", t)
            .body("{}")
            .send()
    };
    assert_eq!(call(&t1).await.unwrap().status(), 200);
    let before = f.upstream.count();
    let (status, why) = reason(call(&t2).await.unwrap()).await;
    assert_eq!(status, 401, "{why}");
    assert!(why.contains("channel"), "{why}");
    assert_eq!(f.upstream.count(), before, "the upstream saw nothing");
    // On the shared listener dev2's token carries dev2's grant.
    let r = post(
        &f,
        "/llm/anthropic/v1/messages",
        Some(("x-api-key", &t2)),
        "{}",
    )
    .await;
    assert_eq!(r.status(), 200);
}

/// A client that sends everything to `http_proxy`, ignoring `no_proxy` (busybox `wget`, some
/// SDKs), asks the egress proxy for the credential proxy's own guest address: it is served
/// here as if sent directly (absolute-form, and through a `CONNECT` tunnel), never refused as
/// a private address, and still only for the channel's VM.
#[tokio::test]
async fn a_client_that_ignores_no_proxy_reaches_the_credential_proxy() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (f, t1) = dev1().await;
    let t2 = dev2(&f);
    // the listener's own address stands for the guest's (10.0.2.100 under qemu)
    let addr = serve_channel(&f, |a| Some(format!("http://{a}"))).await;
    let channel = format!("http://{addr}");
    let via_proxy = |t: &str| proxied(&channel, t);
    let before = f.upstream.count();
    let r = via_proxy(&t1)
        .post(format!("{channel}/llm/anthropic/v1/messages"))
        .header("x-api-key", &t1)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    assert_eq!(f.upstream.count(), before + 1, "the upstream saw it");
    // another VM's token is refused on dev1's channel, this way too
    let (status, why) = reason(
        via_proxy(&t2)
            .post(format!("{channel}/llm/anthropic/v1/messages"))
            .header("x-api-key", &t2)
            .body("{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 401, "{why}");
    // CONNECT to the proxy's own address: the tunnel's requests are served here
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "CONNECT {addr} HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         POST /llm/anthropic/v1/messages HTTP/1.1\r\nHost: {addr}\r\nx-api-key: {t1}\r\n\
         content-length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let out = String::from_utf8_lossy(&out);
    let statuses: Vec<&str> = out.lines().filter(|l| l.starts_with("HTTP/1.1 ")).collect();
    assert_eq!(statuses.len(), 2, "{out}");
    assert!(statuses.iter().all(|l| l.contains(" 200")), "{out}");
    assert_eq!(
        f.upstream.count(),
        before + 2,
        "the upstream saw the tunnel's request"
    );
    // a listener that does not know its guest address still refuses the address (the
    // egress proxy never connects to a private address for a guest)
    let plain = format!("http://{}", serve_channel(&f, |_| None).await);
    let r = proxied(&plain, &t1)
        .post(format!("{plain}/llm/anthropic/v1/messages"))
        .header("x-api-key", &t1)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(f.upstream.count(), before + 2);
}

/// Serve dev1's channel on a loopback port until the fixture stops; `seen_at` names the guest
/// address the listener is told, from its own address (`None`: none, as `Proxy::router` serves).
async fn serve_channel(
    f: &Fixture,
    seen_at: impl FnOnce(std::net::SocketAddr) -> Option<String>,
) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let router = f
        .server
        .router_seen_at(Some("dev1".into()), seen_at(addr).as_deref());
    let stop = f.stop.clone();
    tokio::spawn(async move {
        axum::serve(l, router)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });
    addr
}

/// A client that sends everything to `proxy` (as `http_proxy`, ignoring `no_proxy`), with
/// `token` as the proxy password.
fn proxied(proxy: &str, token: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(
            reqwest::Proxy::all(proxy)
                .unwrap()
                .basic_auth("boxery", token),
        )
        .build()
        .unwrap()
}
