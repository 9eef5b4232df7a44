//! The credential proxy's overhead against calling the stand-in upstream directly, in the
//! same run (docs/benchmarks.md, "Credential proxy (issue 13)"):
//! - added latency per request (p50, p99) over keep-alive connections, sequential, and the
//!   part of it the LLM accounting takes (limits, usage read from the answer, the count);
//! - added time to the first streamed byte (an SSE response whose rest the upstream holds);
//! - 500 concurrent streams held open through the proxy: the proxy's RSS growth per stream.
//!
//! The proxy runs in a child process (this binary, re-run with `--proxy-child`) so its RSS is
//! its own. `cargo bench -p boxery-proxy` (`BOXERY_BENCH_N` sets the number of requests).

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::BufRead;
use std::time::{Duration, Instant};

use boxery_api::grant::GrantType;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if let Some(i) = args.iter().position(|a| a == "--proxy-child") {
        rt.block_on(child(&args[i + 1], &args[i + 2]));
        return;
    }
    rt.block_on(bench());
}

/// The proxy alone: home dir, upstream URL; prints its address, serves until stdin closes.
async fn child(home: &str, upstream: &str) {
    let mut cfg = boxery_api::config::ProxyConfig::default();
    cfg.upstreams.insert("anthropic".into(), upstream.into());
    cfg.limits.concurrency_per_vm = Some(10_000);
    let proxy = boxery_proxy::Proxy::new(std::path::Path::new(home), cfg).unwrap();
    let l = boxery_proxy::Proxy::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    println!("{}", l.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    std::thread::spawn(move || {
        let mut buf = String::new();
        let _ = std::io::stdin().read_line(&mut buf);
        s.cancel();
    });
    proxy.serve(l, stop).await.unwrap();
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

async fn bench() {
    let n: usize = std::env::var("BOXERY_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let stop = tokio_util::sync::CancellationToken::new();
    let up = support::Upstream::start(stop.clone()).await;
    let home = tempfile::Builder::new()
        .prefix("boxery-proxy-bench-")
        .tempdir()
        .unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let key = secrets.path().join("key");
    std::fs::write(&key, "sk-bench").unwrap();
    let token = "bxt_bench_0123456789abcdef";
    boxery_home::tokens::write(home.path(), "dev1", "vmuid", token).unwrap();
    let state = boxery_home::grants::StateFile {
        vm: "dev1".into(),
        grants: vec![boxery_home::grants::Entry {
            name: "dev1-llm-anthropic".into(),
            uid: "g".into(),
            generation: 1,
            spec: boxery_api::grant::GrantSpec {
                limits: None,
                vm: Some("dev1".into()),
                lease: None,
                type_: GrantType::Llm,
                target: "anthropic".into(),
                header: None,
                value_from: boxery_api::grant::ValueFrom::File(key.display().to_string()),
            },
            vm_uid: "vmuid".into(),
            lease_uid: None,
        }],
    };
    std::fs::create_dir_all(boxery_home::layout::grants(home.path())).unwrap();
    std::fs::write(
        boxery_home::layout::grant_state(home.path(), "dev1"),
        serde_json::to_vec(&state).unwrap(),
    )
    .unwrap();

    let mut proxy = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--proxy-child",
            &home.path().display().to_string(),
            &up.url(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = proxy.id();
    let mut line = String::new();
    std::io::BufReader::new(proxy.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let via = format!("http://{}/llm/anthropic", line.trim());
    let direct = up.url();
    let client = support::client();
    println!("credential proxy benchmark: {n} sequential requests per path, keep-alive");

    // Latency, interleaved so both paths see the same machine.
    let (mut d, mut p) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n + 100 {
        for (base, out) in [(&direct, &mut d), (&via, &mut p)] {
            let t = Instant::now();
            let r = client
                .post(format!("{base}/v1/messages"))
                .header("x-api-key", token)
                .body(r#"{"model":"m","max_tokens":1,"messages":[]}"#)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            if i >= 100 {
                out.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let (d50, d99, p50, p99) = (
        pct(&mut d, 0.5),
        pct(&mut d, 0.99),
        pct(&mut p, 0.5),
        pct(&mut p, 0.99),
    );
    println!(
        "request  direct p50 {d50:.3} ms p99 {d99:.3} ms | proxy p50 {p50:.3} ms p99 {p99:.3} ms | added p50 {:.3} ms p99 {:.3} ms",
        p50 - d50,
        p99 - d99
    );
    // The accounting on each LLM request's path (limits check, the answer's usage read as it
    // passes, the count), in this process, against the proxy's added latency just measured.
    let ledger = tempfile::tempdir().unwrap();
    let acct = boxery_proxy::bench_per_request(ledger.path(), 20_000).as_secs_f64() * 1e3;
    let added = p50 - d50;
    println!(
        "accounting  {acct:.4} ms per request = {:.1} % of the proxy's added p50 without it ({:.3} ms)",
        100.0 * acct / (added - acct),
        added - acct
    );

    // Time to the first streamed byte.
    let m = (n / 10).max(50);
    let conns = || up.connections.load(std::sync::atomic::Ordering::Relaxed);
    let c0 = conns();
    let (mut d, mut p) = (Vec::new(), Vec::new());
    for i in 0..m + 10 {
        for (base, out) in [(&direct, &mut d), (&via, &mut p)] {
            let t = Instant::now();
            let mut r = client
                .post(format!("{base}/v1/messages/stream"))
                .header("x-api-key", token)
                .body("{}")
                .send()
                .await
                .unwrap();
            r.chunk().await.unwrap().unwrap();
            if i >= 10 {
                out.push(t.elapsed().as_secs_f64() * 1e3);
            }
            up.finish();
            while r.chunk().await.unwrap().is_some() {}
        }
    }
    let (d50, d99, p50, p99) = (
        pct(&mut d, 0.5),
        pct(&mut d, 0.99),
        pct(&mut p, 0.5),
        pct(&mut p, 0.99),
    );
    println!(
        "first byte  upstream connections opened during {} stream pairs: {}",
        m + 10,
        conns() - c0
    );
    println!(
        "first byte  direct p50 {d50:.3} ms p99 {d99:.3} ms | proxy p50 {p50:.3} ms p99 {p99:.3} ms | added p50 {:.3} ms p99 {:.3} ms",
        p50 - d50,
        p99 - d99
    );

    // 500 streams held at once through the proxy.
    let streams = 500;
    let before = rss_kib(pid);
    let t = Instant::now();
    let mut held = Vec::new();
    for _ in 0..streams {
        // One connection per stream, as 500 clients would have.
        let c = reqwest::Client::builder().no_proxy().build().unwrap();
        let via = via.clone();
        held.push(tokio::spawn(async move {
            let mut r = c
                .post(format!("{via}/v1/messages/stream"))
                .header("x-api-key", token)
                .body("{}")
                .send()
                .await
                .unwrap();
            r.chunk().await.unwrap().unwrap();
            (c, r)
        }));
    }
    let mut open = Vec::new();
    for h in held {
        open.push(h.await.unwrap());
    }
    let opened = t.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = rss_kib(pid);
    println!(
        "streams  {streams} held open through the proxy in {:.0} ms: proxy RSS {before} KiB -> {during} KiB, {:.1} KiB per stream",
        opened.as_secs_f64() * 1e3,
        (during.saturating_sub(before)) as f64 / streams as f64
    );
    drop(open);
    drop(proxy.stdin.take());
    let _ = proxy.wait();
    stop.cancel();
}
