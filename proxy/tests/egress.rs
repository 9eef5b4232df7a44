//! The egress proxy over real HTTP, on the shared listener (the token in
//! `Proxy-Authorization`): what it refuses, and that a refusal reaches no one. What it lets
//! through is drilled live from a guest (`boxery drill`, `tests/real_vms.rs`): a listener at a
//! public, non-local address needs a network namespace.

mod support;

use boxery_api::network::{Egress, EgressPolicy};
use support::Fixture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Send `req` raw to the proxy; the response as text.
async fn raw(f: &Fixture, req: String) -> String {
    let addr = f.proxy.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn get(target: &str, token: Option<&str>) -> String {
    let auth = token
        .map(|t| format!("Proxy-Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let host = target
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap();
    format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")
}

fn connect(hostport: &str, token: &str) -> String {
    format!(
        "CONNECT {hostport} HTTP/1.1\r\nHost: {hostport}\r\nProxy-Authorization: Basic {}\r\nConnection: close\r\n\r\n",
        {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(format!("boxery:{token}"))
        }
    )
}

fn status(resp: &str) -> u16 {
    resp.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn policy(f: &Fixture, vm: &str, p: EgressPolicy, allow: &[&str]) {
    boxery_home::egress::write(
        f.home(),
        vm,
        &Egress {
            policy: p,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        },
    )
    .unwrap();
}

#[tokio::test]
async fn no_token_no_egress_and_nothing_resolved() {
    let f = Fixture::start().await;
    let r = raw(&f, get("http://example.invalid/", None)).await;
    assert_eq!(status(&r), 407, "{r}");
    assert!(r.contains("proxy-authenticate: Basic"), "{r}");
    let r = raw(&f, get("http://example.invalid/", Some("bxt_wrong"))).await;
    assert_eq!(status(&r), 407, "{r}");
}

#[tokio::test]
async fn every_policy_refuses_the_host_private_ranges_and_rebinding_names() {
    let f = Fixture::start_with(|c| {
        c.egress
            .resolve
            .insert("rebind.example".into(), "10.1.2.3".parse().unwrap());
        c.egress
            .resolve
            .insert("meta.example".into(), "169.254.169.254".parse().unwrap());
    })
    .await;
    let t = f.token("dev1", "uid1");
    let up = f.upstream.addr;
    for p in [EgressPolicy::Public, EgressPolicy::Allowlist] {
        policy(
            &f,
            "dev1",
            p,
            &["rebind.example", "meta.example", "localhost"],
        );
        for target in [
            format!("http://{up}/"),
            format!("http://localhost:{}/", up.port()),
            "http://rebind.example/".to_string(),
            "http://meta.example/latest/".to_string(),
            "http://[::1]:9/".to_string(),
            "http://10.0.2.2:22/".to_string(),
        ] {
            let r = raw(&f, get(&target, Some(&t))).await;
            assert_eq!(status(&r), 403, "{p:?} {target}: {r}");
            assert!(r.contains("x-boxery-egress: denied"), "{r}");
        }
        let r = raw(&f, connect(&format!("127.0.0.1:{}", up.port()), &t)).await;
        assert_eq!(status(&r), 403, "{p:?} CONNECT: {r}");
    }
    policy(&f, "dev1", EgressPolicy::Public, &[]);
    let r = raw(&f, get("http://rebind.example/", Some(&t))).await;
    assert!(
        r.contains("rebind.example is 10.1.2.3, a private (10.0.0.0/8) address"),
        "{r}"
    );
    let r = raw(&f, get(&format!("http://{up}/"), Some(&t))).await;
    assert!(r.contains("loopback (127.0.0.0/8)"), "{r}");
    assert!(
        f.upstream.seen().is_empty(),
        "a refused request reached the upstream"
    );
}

#[tokio::test]
async fn the_policy_is_read_on_every_connection() {
    let f = Fixture::start().await;
    let t = f.token("dev1", "uid1");
    // No policy written (a VM the reconciler has not seen): denied.
    let r = raw(&f, get("http://unlisted.invalid/", Some(&t))).await;
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("Deny"), "{r}");
    policy(&f, "dev1", EgressPolicy::Allowlist, &["*.pypi.org"]);
    let r = raw(&f, get("http://unlisted.invalid/", Some(&t))).await;
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("not in VM dev1's egress allow list"), "{r}");
    let r = raw(&f, get("http://203.0.113.10/", Some(&t))).await;
    assert!(r.contains("lists names, not addresses"), "{r}");
    // Listed: the policy passes it; the name does not resolve here (502, not 403).
    let r = raw(&f, get("http://files.pypi.org.invalid/", Some(&t))).await;
    assert_eq!(status(&r), 403, "a suffix is matched whole: {r}");
    let r = raw(&f, connect("pypi.invalid:443", &t)).await;
    assert_eq!(status(&r), 403, "{r}");
    // The status line says why: a CONNECT client (socat for ssh, pip) shows only that line.
    assert!(
        r.starts_with(
            "HTTP/1.1 403 Forbidden: pypi.invalid is not in VM dev1's egress allow list (spec.network.egress.allow)\r\n"
        ),
        "{r}"
    );
    policy(&f, "dev1", EgressPolicy::Public, &[]);
    let r = raw(&f, get("http://unlisted.invalid/", Some(&t))).await;
    assert_eq!(status(&r), 502, "Public passes the name: {r}");
    assert!(r.contains("x-boxery-egress: failed"), "{r}");
    policy(&f, "dev1", EgressPolicy::Deny, &[]);
    let r = raw(&f, connect("example.com:443", &t)).await;
    assert_eq!(status(&r), 403, "{r}");
    // Audited, never with the token.
    let audit = std::fs::read_to_string(boxery_home::layout::audit_log(f.home())).unwrap();
    assert!(audit.contains("\"route\":\"egress\""), "{audit}");
    assert!(audit.contains("unlisted.invalid:80"), "{audit}");
    assert!(!audit.contains(&t), "the token is in the audit log");
}

#[tokio::test]
async fn a_channel_is_its_vm_whatever_token_comes() {
    // A per-VM channel (qemu's socket) names the VM: dev2's policy never applies on dev1's.
    let f = Fixture::start().await;
    let _t1 = f.token("dev1", "uid1");
    let t2 = f.token("dev2", "uid2");
    policy(&f, "dev1", EgressPolicy::Deny, &[]);
    policy(&f, "dev2", EgressPolicy::Public, &[]);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("proxy.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let router = f.server.router(Some("dev1".into()));
    tokio::spawn(async move { axum::serve(l, router).await });
    let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    s.write_all(get("http://unlisted.invalid/", Some(&t2)).as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let r = String::from_utf8_lossy(&out);
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("VM dev1's egress policy is Deny"), "{r}");
}
