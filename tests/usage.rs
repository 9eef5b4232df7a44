//! LLM use through `boxery serve`'s credential proxy, counted and limited (issue 36,
//! docs/grants.md "Limits", docs/observability.md "Usage"), on the fake backend with a
//! stand-in upstream that reports known usage, whole (JSON) and streamed (Anthropic's event
//! stream): `boxery usage` shows the exact sums and dollars; a grant's `tokensPerDay` refuses
//! the request after the one that used it up with 429, which the upstream never sees; a
//! SIGKILL and restart of `serve` keeps the count; `requestsPerMinute` refuses the request
//! past it with a `Retry-After`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::Home;

const KEY: &str = "sk-canary-usage-e2e-3f0a";

/// A stand-in Anthropic: a whole answer uses 3 input and 4 output tokens; a streamed one
/// (`"stream":true`) 7 and 11, in `message_start` and `message_delta`. Counts requests.
struct Upstream {
    port: u16,
    hits: Arc<AtomicUsize>,
    /// The head of the last request.
    last: Arc<std::sync::Mutex<String>>,
}

impl Upstream {
    fn start() -> Upstream {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let hits: Arc<AtomicUsize> = Arc::default();
        let last: Arc<std::sync::Mutex<String>> = Arc::default();
        let (h, l2) = (hits.clone(), last.clone());
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let (h, l2) = (h.clone(), l2.clone());
                std::thread::spawn(move || answer(c, &h, &l2));
            }
        });
        Upstream { port, hits, last }
    }
    fn last_head(&self) -> String {
        self.last.lock().unwrap().clone()
    }
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn answer(c: TcpStream, hits: &AtomicUsize, last: &std::sync::Mutex<String>) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut len = 0usize;
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        head.push_str(&line.to_ascii_lowercase());
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    *last.lock().unwrap() = head;
    hits.fetch_add(1, Ordering::SeqCst);
    let (ct, out) = if String::from_utf8_lossy(&body).contains("\"stream\":true") {
        (
            "text/event-stream",
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-test\",\"usage\":{\"input_tokens\":7,\"output_tokens\":1}}}\n\n\
             event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n\
             event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":11}}\n\n\
             event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
                .to_string(),
        )
    } else {
        (
            "application/json",
            r#"{"model":"claude-test","content":[],"usage":{"input_tokens":3,"output_tokens":4}}"#
                .to_string(),
        )
    };
    let mut w = &c;
    let _ = write!(
        w,
        "HTTP/1.1 200 OK\r\ncontent-type: {ct}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{out}",
        out.len()
    );
}

/// POST a Messages call with the VM's token: the status and the whole answer.
fn call(proxy: &str, token: &str, streamed: bool) -> (u16, String) {
    let body = if streamed {
        r#"{"model":"claude-test","stream":true}"#
    } else {
        r#"{"model":"claude-test"}"#
    };
    common::http::request(
        proxy,
        "POST",
        "/llm/anthropic/v1/messages",
        &format!(
            "x-api-key: {token}\r\ncontent-type: application/json\r\naccept-encoding: gzip, br\r\n"
        ),
        body,
    )
}

fn addr(home: &Home, file: &str, stale: Option<&str>) -> String {
    common::eventually(Duration::from_secs(20), || {
        std::fs::read_to_string(home.path().join(file))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty() && Some(s.as_str()) != stale)
    })
    .unwrap_or_else(|| panic!("serve wrote {file}"))
}

fn token(home: &Home, vm: &str) -> String {
    std::fs::read_to_string(home.path().join("tokens").join(vm))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string()
}

fn grant(home: &Home, args: &[&str]) {
    let o = home
        .cmd()
        .arg("grant")
        .args(args)
        .args(["--from-env", "USAGE_TEST_KEY", "--wait"])
        .env("USAGE_TEST_KEY", KEY)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `boxery usage -o json --by BY`: the line named `name`.
fn usage_of(home: &Home, by: &str, name: &str) -> serde_json::Value {
    let out = home.ok(&["usage", "--by", by, "-o", "json"]);
    let all: serde_json::Value = serde_json::from_str(&out).unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no line {name} in {out}"))
}

#[test]
fn llm_use_is_counted_priced_and_limited_across_a_restart() {
    let up = Upstream::start();
    let home = Home::new();
    // A dollar per token, so dollars equal tokens.
    home.write(
        "config.yaml",
        &format!(
            "grants: {{confirm: false}}\nproxy:\n  upstreams: {{anthropic: 'http://127.0.0.1:{}'}}\n  prices: {{claude-test: {{input: 1000000, output: 1000000}}}}\n",
            up.port
        ),
    );
    home.ok(&["new", "u1", "--from", "tiny", "--wait"]);
    home.ok(&["new", "u2", "--from", "tiny", "--wait"]);
    let envs = [("USAGE_TEST_KEY", KEY)];
    let mut serve = home.serve_env(&[], &envs);
    serve.wait_leading();
    let proxy = addr(&home, "proxy.addr", None);
    grant(&home, &["u1", "llm:anthropic", "--tokens-per-day", "40"]);
    // The approval shows the limit.
    let described = home.ok(&["get", "grant", "u1-llm-anthropic", "-o", "yaml"]);
    assert!(described.contains("tokensPerDay: 40"), "{described}");
    let t1 = token(&home, "u1");
    common::eventually(Duration::from_secs(20), || {
        (call(&proxy, &t1, false).0 == 200).then_some(())
    })
    .expect("the grant takes effect");
    // Asked uncompressed, whatever the client accepts: the usage is read as it passes.
    assert!(
        up.last_head().contains("accept-encoding: identity\r\n"),
        "{}",
        up.last_head()
    );
    // A batch is not metered: a grant with limits refuses it, unsent.
    let before = up.hits();
    let (s, out) = common::http::request(
        &proxy,
        "POST",
        "/llm/anthropic/v1/messages/batches",
        &format!("x-api-key: {t1}\r\ncontent-type: application/json\r\n"),
        "{}",
    );
    assert_eq!(s, 403, "{out}");
    assert!(out.contains("batch requests are not metered"), "{out}");
    assert_eq!(up.hits(), before);
    // 7 (the call above) + 7 + 18 + 7 = 39 tokens: under 40.
    assert_eq!(call(&proxy, &t1, false).0, 200);
    let (s, out) = call(&proxy, &t1, true);
    assert_eq!(s, 200);
    assert!(
        out.contains("message_delta"),
        "the stream passes whole: {out}"
    );
    assert_eq!(call(&proxy, &t1, false).0, 200);
    // 39 of 40: past 80 %, the grant warns (looked at on its next reconcile: a label poke).
    let events_say = |reason: &str| {
        common::eventually(Duration::from_secs(20), || {
            let e = home.ok(&["events", "grant", "u1-llm-anthropic"]);
            e.contains(reason).then_some(e)
        })
        .unwrap_or_else(|| {
            panic!(
                "no {reason} event: {}",
                home.ok(&["events", "grant", "u1-llm-anthropic"])
            )
        })
    };
    common::eventually(Duration::from_secs(10), || {
        let l = usage_of(&home, "grant", "u1-llm-anthropic");
        (l["requests"] == 4).then_some(())
    })
    .expect("four requests recorded");
    home.ok(&[
        "label",
        "grant",
        "u1-llm-anthropic",
        "poke=1",
        "--overwrite",
    ]);
    let near = events_say("LimitNear");
    assert!(
        near.contains("over 80 % of its tokensPerDay limit (40 tokens)"),
        "{near}"
    );
    // 39 < 40: one more goes through and uses it up (46); the one after is refused, unsent.
    assert_eq!(call(&proxy, &t1, false).0, 200);
    let sent = up.hits();
    assert_eq!(sent, 5);
    let (s, refused) = call(&proxy, &t1, false);
    assert_eq!(s, 429, "{refused}");
    assert!(
        refused.contains("tokensPerDay")
            && refused.contains("46 of 40")
            && refused.contains("rate_limit_error"),
        "{refused}"
    );
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: "),
        "{refused}"
    );
    assert_eq!(up.hits(), sent, "the upstream never sees a refused request");
    home.ok(&[
        "label",
        "grant",
        "u1-llm-anthropic",
        "poke=2",
        "--overwrite",
    ]);
    let reached = events_say("LimitReached");
    assert!(
        reached.contains("refuses its requests with 429 until"),
        "{reached}"
    );

    // The exact sums: 4 whole answers (3 + 4 each) and one stream (7 + 11).
    let line = common::eventually(Duration::from_secs(10), || {
        let l = usage_of(&home, "vm", "u1");
        (l["requests"] == 5).then_some(l)
    })
    .expect("five requests recorded");
    assert_eq!(line["inputTokens"], 3 * 4 + 7);
    assert_eq!(line["outputTokens"], 4 * 4 + 11);
    assert_eq!(line["dollars"], 46.0);
    let by_grant = usage_of(&home, "grant", "u1-llm-anthropic");
    assert_eq!(by_grant["requests"], 5);
    let csv = home.ok(&["usage", "-o", "csv"]);
    assert!(
        csv.lines().any(|l| l.starts_with("u1,5,19,27,46.0000,")),
        "{csv}"
    );
    let table = home.ok(&["usage"]);
    assert!(
        table.contains("INPUT TOKENS") && table.contains("u1"),
        "{table}"
    );
    // What docs/observability.md and docs/grants.md show (`--no-capture`).
    eprintln!(
        "--- boxery usage:\n{table}\n--- the 429:\n{}",
        common::http::body(&refused)
    );

    // SIGKILL serve; after a restart the day's count holds: still refused, still unsent.
    serve.kill();
    let mut serve = home.serve_env(&[], &envs);
    serve.wait_leading();
    let proxy = addr(&home, "proxy.addr", Some(&proxy));
    let (s, again) = common::eventually(Duration::from_secs(20), || {
        let r = call(&proxy, &t1, false);
        (r.0 != 403).then_some(r)
    })
    .expect("the grant is in force again");
    assert_eq!(s, 429, "{again}");
    assert_eq!(up.hits(), sent);

    // requestsPerMinute: two go through, the third waits.
    grant(
        &home,
        &["u2", "llm:anthropic", "--requests-per-minute", "2"],
    );
    let t2 = token(&home, "u2");
    common::eventually(Duration::from_secs(20), || {
        (call(&proxy, &t2, false).0 == 200).then_some(())
    })
    .expect("u2's grant takes effect");
    assert_eq!(call(&proxy, &t2, false).0, 200);
    let (s, out) = call(&proxy, &t2, false);
    assert_eq!(s, 429, "{out}");
    assert!(out.contains("requestsPerMinute"), "{out}");
    serve.kill();
}

#[test]
fn limits_are_for_llm_grants_and_need_a_number() {
    let home = Home::new();
    home.ok(&["new", "u1", "--from", "tiny", "--wait"]);
    let o = home
        .cmd()
        .args([
            "grant",
            "u1",
            "env:FOO",
            "--from-env",
            "HOME",
            "--tokens-per-day",
            "10",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("only llm grants have limits"), "{err}");
    let o = home
        .cmd()
        .args([
            "grant",
            "u1",
            "llm:anthropic",
            "--from-env",
            "HOME",
            "--tokens-per-day",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // No ledger yet: an empty report, said on stderr.
    let o = home.run(&["usage"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("No use recorded"));
}
