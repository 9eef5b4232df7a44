//! `/metrics` through `boxery serve` on the fake backend, read by the real tools: Debian's
//! `promtool check metrics` on the exposition, and a real Prometheus (started here on
//! loopback with a scrape config pointing at `serve --metrics-listen`) answering PromQL
//! queries through its HTTP API: the VM count, and a proxy request counter after requests
//! through the credential proxy to a stand-in upstream. The API listener serves the same
//! exposition to read and full tokens, never to a lease's.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::Home;
use common::upstream::Upstream;

const KEY: &str = "sk-canary-metrics-e2e-71c2";

/// One HTTP/1.1 request: the status and the body.
fn http(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let (status, answer) = common::http::request(addr, method, path, headers, body);
    (status, common::http::body(&answer).to_string())
}

/// A query string's value, percent-encoded.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The address a listener of `serve` wrote to `file` under the home.
fn addr_in(home: &Home, file: &str) -> String {
    common::eventually(Duration::from_secs(20), || {
        std::fs::read_to_string(home.path().join(file))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .unwrap_or_else(|| panic!("serve wrote {file}"))
}

/// A Prometheus of the test's own, killed (by PID) when dropped.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    /// Start it on a free loopback port, scraping `target` every second, its data in `dir`.
    fn start(dir: &Path, target: &str) -> Prometheus {
        assert!(
            Command::new("prometheus")
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success()),
            "prometheus is missing: scripts/install-deps.sh installs Debian's prometheus package"
        );
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: boxery\n    static_configs: [{{targets: ['{target}']}}]\n"
            ),
        )
        .unwrap();
        // A port the kernel had free a moment ago: Prometheus cannot listen on port 0 and say
        // which it took.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Prometheus { child, addr }
    }

    /// The first value of an instant PromQL query, once it has one.
    fn query(&self, q: &str) -> Option<f64> {
        let (status, body) = http(
            &self.addr,
            "GET",
            &format!("/api/v1/query?query={}", encode(q)),
            "",
            "",
        );
        if status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    /// Wait until `q` evaluates to `want`; the last value otherwise.
    fn wait_for(&self, q: &str, want: f64, dir: &Path) {
        let got = common::eventually(Duration::from_secs(60), || {
            std::net::TcpStream::connect(&self.addr).ok()?;
            self.query(q).filter(|v| *v == want)
        });
        assert_eq!(
            got,
            Some(want),
            "PromQL {q}: last {:?}; prometheus said:\n{}",
            std::net::TcpStream::connect(&self.addr)
                .ok()
                .and_then(|_| self.query(q)),
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_real_prometheus_scrapes_serve_and_counts_vms_and_proxy_requests() {
    let up = Upstream::start();
    let home = Home::new();
    home.write(
        "config.yaml",
        &format!(
            "grants: {{confirm: false}}\nproxy: {{upstreams: {{anthropic: 'http://127.0.0.1:{}'}}}}\n",
            up.port
        ),
    );
    for vm in ["m1", "m2", "m3"] {
        home.ok(&["new", vm, "--from", "tiny", "--wait"]);
    }
    let envs = [("METRICS_TEST_KEY", KEY)];
    let serve = home.serve_env(&["--metrics-listen", "127.0.0.1:0"], &envs);
    serve.wait_leading();
    let metrics = addr_in(&home, "metrics.addr");
    let proxy = addr_in(&home, "proxy.addr");
    let o = home
        .cmd()
        .args([
            "grant",
            "m1",
            "llm:anthropic",
            "--from-env",
            "METRICS_TEST_KEY",
            "--wait",
        ])
        .env("METRICS_TEST_KEY", KEY)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let token = std::fs::read_to_string(home.path().join("tokens/m1"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    let call = |token: &str| {
        http(
            &proxy,
            "POST",
            "/llm/anthropic/v1/messages",
            &format!("x-api-key: {token}\r\ncontent-type: application/json\r\n"),
            "{}",
        )
        .0
    };
    // The grant takes effect within a reconcile: the first 200 starts the count.
    common::eventually(Duration::from_secs(20), || {
        (call(&token) == 200).then_some(())
    })
    .expect("the granted call goes through");
    for _ in 0..2 {
        assert_eq!(call(&token), 200);
    }
    assert_eq!(call("bxt_0000"), 401);

    // The exposition: Prometheus' text format by default, which promtool checks.
    let (status, text) = http(&metrics, "GET", "/metrics", "", "");
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("boxery_vm_info{vm=\"m2\""), "{text}");
    assert!(text.contains("boxery_leader 1"), "{text}");
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (scripts/install-deps.sh installs Debian's prometheus package)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // Every metric is documented; the dashboard queries only metrics that exist.
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next())
        .collect();
    assert!(families.len() > 20, "{families:?}");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(repo.join("docs/observability.md")).unwrap();
    for f in &families {
        assert!(
            doc.contains(&format!("| `{f}` |")),
            "{f} is not in docs/observability.md's tables"
        );
    }
    let dashboard =
        std::fs::read_to_string(repo.join("manifests/monitoring/grafana-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut queried = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if let Some(name) = word.strip_prefix("boxery_") {
                    let name = format!("boxery_{}", name.trim_end_matches("_bucket"));
                    assert!(
                        families.contains(&name.as_str()),
                        "the dashboard's panel {:?} queries {name}, which /metrics does not have",
                        panel["title"]
                    );
                    queried += 1;
                }
            }
        }
    }
    assert!(queried >= 10);
    let checked = Command::new("promtool")
        .args(["check", "config", "--syntax-only"])
        .arg(repo.join("manifests/monitoring/prometheus.yml"))
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // OpenMetrics to a client that asks for it (Prometheus does).
    let (_, om) = http(
        &metrics,
        "GET",
        "/metrics",
        "accept: application/openmetrics-text;version=1.0.0\r\n",
        "",
    );
    assert!(om.trim_end().ends_with("# EOF"), "{om}");

    let data = tempfile::tempdir().unwrap();
    let prom = Prometheus::start(data.path(), &metrics);
    prom.wait_for("count(boxery_vm_info)", 3.0, data.path());
    prom.wait_for(
        "sum(boxery_vm_status_phase{phase=\"Running\"})",
        3.0,
        data.path(),
    );
    prom.wait_for(
        "sum(boxery_proxy_requests_total{vm=\"m1\",route=\"llm\",code=\"200\"})",
        3.0,
        data.path(),
    );
    prom.wait_for(
        "sum(boxery_proxy_requests_total{vm=\"\",code=\"401\"})",
        1.0,
        data.path(),
    );
    // A removed VM's series leave the exposition.
    home.ok(&["rm", "m3", "--wait"]);
    prom.wait_for("count(boxery_vm_info)", 2.0, data.path());
    // The key is in no metric.
    let (_, text) = http(&metrics, "GET", "/metrics", "", "");
    assert!(!text.contains(KEY) && !text.contains(&token));
}

#[test]
fn the_api_serves_metrics_to_read_and_full_tokens_only() {
    let api = common::api::Api::start();
    api.home.ok(&["new", "a1", "--from", "tiny", "--wait"]);
    let read = api.kubeconfig("read", "watcher");
    let (status, body) = api.request(&read, "GET", "/metrics", None);
    assert_eq!(status, 200, "{body}");
    let text = body.as_str().unwrap_or_default();
    assert!(text.contains("boxery_vm_info{vm=\"a1\""), "{text}");
    assert!(
        text.contains("# TYPE boxery_reconcile_total counter"),
        "{text}"
    );
    let (status, _) = api.request(&api.kubeconfig, "GET", "/metrics", None);
    assert_eq!(status, 200);
    // kubectl sees the same: `kubectl get --raw /metrics`.
    let raw = api.k(&["get", "--raw", "/metrics"]);
    assert!(raw.contains("boxery_leader 1"), "{raw}");
    // kubectl auth can-i agrees with the route.
    let o = api.kubectl_with(&read, &["auth", "can-i", "get", "/metrics"], &[]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "yes");
    // A lease's token sees its own VM only: not every VM's metrics.
    let lease = api.kubeconfig("lease:nobody", "holder");
    let (status, body) = api.request(&lease, "GET", "/metrics", None);
    assert_eq!(status, 403, "{body}");
    assert!(body.to_string().contains("scope read or full"), "{body}");
    let o = api.kubectl_with(&lease, &["auth", "can-i", "get", "/metrics"], &[]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.starts_with("no - /metrics shows every VM"), "{said}");
}

#[test]
fn a_remote_metrics_listener_needs_an_explicit_flag() {
    let home = Home::new();
    let o = home
        .cmd()
        .args(["serve", "--metrics-listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("is not a loopback address") && err.contains("--metrics-allow-remote"),
        "{err}"
    );
    assert!(!home.path().join("metrics.addr").exists());
}
