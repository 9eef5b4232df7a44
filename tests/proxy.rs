//! The credential proxy through `boxery serve` on the fake backend (the guest side is a later
//! phase): real store, real reconcilers, real HTTP. A stand-in upstream (a thread on
//! 127.0.0.1:0) records what reaches it. Covers: a VM's own token minted at creation and
//! revoked on `rm`, a grant approved through the CLI reaching the upstream with the real key,
//! revocation, and a SIGKILL of `serve` with grants applied (after the restart the routes
//! match the store; a revoked grant stays revoked). The real key is in no log or audit line.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Home;
use common::upstream::Upstream;

const KEY: &str = "sk-canary-proxy-e2e-9d41";

/// POST `path` to the proxy at `addr` with `x-api-key: token`; the status code.
fn post(addr: &str, path: &str, token: &str) -> u16 {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {token}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    )
    .unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {out:?}"))
}

fn token_of(home: &Home, vm: &str) -> Option<String> {
    std::fs::read_to_string(home.path().join("tokens").join(vm))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).map(str::to_string))
}

/// The proxy's address from `proxy.addr`, once it is not `stale` (a killed serve's).
fn proxy_addr(home: &Home, stale: Option<&str>) -> String {
    common::eventually(Duration::from_secs(20), || {
        std::fs::read_to_string(home.path().join("proxy.addr"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty() && Some(s.as_str()) != stale)
    })
    .expect("serve writes proxy.addr")
}

fn status_is(addr: &str, path: &str, token: &str, want: u16) {
    let got = common::eventually(Duration::from_secs(20), || {
        let s = post(addr, path, token);
        (s == want).then_some(s)
    });
    assert_eq!(
        got,
        Some(want),
        "{path}: want {want}, last {}",
        post(addr, path, token)
    );
}

#[test]
fn serve_proxies_granted_llm_calls_and_survives_a_crash() {
    let up = Upstream::start();
    let home = Home::new();
    home.write(
        "config.yaml",
        &format!(
            "grants: {{confirm: false}}\nproxy: {{upstreams: {{anthropic: 'http://127.0.0.1:{p}', openai: 'http://127.0.0.1:{p}'}}}}\n",
            p = up.port
        ),
    );
    home.ok(&["new", "dev1", "--from", "tiny", "--wait"]);
    home.ok(&["new", "dev2", "--from", "tiny", "--wait"]);
    // Each VM outside a pool has its own token from creation (0600).
    let t1 = token_of(&home, "dev1").expect("dev1 has a token");
    let t2 = token_of(&home, "dev2").expect("dev2 has a token");
    assert_ne!(t1, t2);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(home.path().join("tokens/dev1"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let envs = [("GRANT_TEST_KEY", KEY)];
    let mut serve = home.serve_env(&[], &envs);
    serve.wait_leading();
    let addr = proxy_addr(&home, None);
    let msgs = "/llm/anthropic/v1/messages";
    let chat = "/llm/openai/v1/chat/completions";
    // No grant yet.
    assert_eq!(post(&addr, msgs, &t1), 403);
    for p in ["llm:anthropic", "llm:openai"] {
        // The approver checks that the value is readable in its own environment too.
        let o = home
            .cmd()
            .args(["grant", "dev1", p, "--from-env", "GRANT_TEST_KEY", "--wait"])
            .env("GRANT_TEST_KEY", KEY)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    status_is(&addr, msgs, &t1, 200);
    status_is(&addr, chat, &t1, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[0].contains(&format!("x-api-key: {KEY}")),
        "{}",
        seen[0]
    );
    assert!(
        seen[1].contains(&format!("authorization: Bearer {KEY}")),
        "{}",
        seen[1]
    );
    assert!(
        !seen.iter().any(|h| h.contains(&t1)),
        "the token never reaches the upstream"
    );
    // Another VM's token does not carry dev1's grants; a wrong token is refused.
    assert_eq!(post(&addr, msgs, &t2), 403);
    assert_eq!(post(&addr, msgs, "bxt_0000"), 401);
    // Revoke openai; then SIGKILL serve with anthropic applied.
    let name = home
        .ok(&["grant", "ls"])
        .lines()
        .find(|l| l.contains("openai"))
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap();
    home.ok(&["grant", "revoke", &name]);
    status_is(&addr, chat, &t1, 403);
    serve.kill();
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "nothing answers while serve is down"
    );
    let serve = home.serve_env(&[], &envs);
    serve.wait_leading();
    // The killed serve could not remove its proxy.addr: the new one replaces it.
    let addr = proxy_addr(&home, Some(&addr));
    let n = up.seen().len();
    status_is(&addr, msgs, &t1, 200);
    assert_eq!(post(&addr, chat, &t1), 403, "a revoked grant stays revoked");
    assert_eq!(up.seen().len(), n + 1);
    // rm revokes the VM's token.
    home.ok(&["rm", "dev1", "--wait"]);
    assert!(token_of(&home, "dev1").is_none());
    assert_eq!(post(&addr, msgs, &t1), 401);

    // The real key is in no log or audit line; every request was audited.
    let audit = std::fs::read_to_string(home.path().join("audit/proxy.log")).unwrap();
    assert!(audit.lines().count() >= 9, "{audit}");
    assert!(!audit.contains(KEY) && !audit.contains(&t1));
    let log = std::fs::read_to_string(&serve.log).unwrap();
    assert!(!log.contains(KEY), "the serve log holds the key");
}
