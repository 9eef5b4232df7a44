//! `boxery forward` (issue 33) against the limit it is built on: a bare `ssh -L` over the same
//! ControlMaster (`ssh -F $BOXERY_HOME/ssh/config`), both forwarding to busybox httpd on the
//! guest's loopback, measured interleaved in one run so the machine's drift hits both alike:
//!
//! - connection setup: a new TCP connection, `GET` of a 1-byte file, read to the end;
//! - throughput: `GET` of a 16 MiB file.
//!
//! qemu backend, the `tiny` guest (1 vCPU, 256 MiB) under TCG. `cargo bench -p boxery --bench
//! forward` (release); `BOXERY_BENCH_PAIRS=N` (default 50 connections, N/10 downloads).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/realvm.rs"]
mod realvm;
use realvm::{Kid, bench_pairs, ms, pct, serving};

fn forwarder(mut c: Command, port: u16) -> Kid {
    let kid = Kid(c
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "nothing listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    kid
}

/// `GET /path` on 127.0.0.1:port over a new connection; the body's length.
fn get(port: u16, path: &str) -> usize {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    assert!(status.contains(" 200 "), "{path} via {port}: {status}");
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        if l == "\r\n" || l.is_empty() {
            break;
        }
    }
    let mut body = Vec::new();
    r.read_to_end(&mut body).unwrap();
    body.len()
}

fn pairs(n: usize, ours: u16, theirs: u16, f: impl Fn(u16)) -> (Vec<Duration>, Vec<Duration>) {
    let time = |p: u16| {
        let t = Instant::now();
        f(p);
        t.elapsed()
    };
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..n {
        if i % 2 == 0 {
            a.push(time(ours));
            b.push(time(theirs));
        } else {
            b.push(time(theirs));
            a.push(time(ours));
        }
    }
    (a, b)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn main() {
    let n = bench_pairs(50);
    // (the directory and `serve` live to the end)
    let (_dir, h, _serve) = serving();
    let vm = h.write(
        "vm.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: f0}\n\
         spec:\n  source: {image: tiny}\n  resources: {cpus: 1, memory: 256Mi, disk: 2Gi}\n",
    );
    h.apply_wait(&vm, "10m");
    h.ok(&[
        "run",
        "f0",
        "--",
        "mkdir -p /tmp/www && printf x > /tmp/www/one && \
         head -c 16777216 /dev/urandom > /tmp/www/blob && \
         (setsid busybox httpd -f -p 127.0.0.1:8080 -h /tmp/www </dev/null >/dev/null 2>&1 &); true",
    ]);
    let (ours, theirs) = (free_port(), free_port());
    let _fwd = forwarder(
        {
            let mut c = h.cmd(&["forward", "f0", &format!("{ours}:8080")]);
            c.stdin(Stdio::null());
            c
        },
        ours,
    );
    let _ssh = forwarder(
        {
            let mut c = Command::new("ssh");
            c.arg("-F").arg(h.0.join("ssh/config")).args([
                "-N",
                "-L",
                &format!("127.0.0.1:{theirs}:127.0.0.1:8080"),
                "f0.boxery",
            ]);
            c
        },
        theirs,
    );
    // warm both paths
    get(ours, "/one");
    get(theirs, "/one");
    let (mut a, mut b) = pairs(n, ours, theirs, |p| {
        assert_eq!(get(p, "/one"), 1);
    });
    let downloads = (n / 10).max(2);
    let (mut da, mut db) = pairs(downloads, ours, theirs, |p| {
        assert_eq!(get(p, "/blob"), 16 << 20);
    });
    let mibs = |d: Duration| 16.0 / d.as_secs_f64();
    println!(
        "real VM, qemu backend, tiny guest (1 vCPU, 256 MiB) under TCG, 2 cores; busybox httpd on the guest's loopback"
    );
    println!(
        "| measure | `boxery forward` p50 / p99 | bare `ssh -L`, same ControlMaster, p50 / p99 | ratio p50 | target |"
    );
    println!("|---|---|---|---|---|");
    let (a50, a99, b50, b99) = (
        pct(&mut a, 0.5),
        pct(&mut a, 0.99),
        pct(&mut b, 0.5),
        pct(&mut b, 0.99),
    );
    println!(
        "| new connection + `GET` 1 byte ({n} pairs) | {} / {} | {} / {} | {:.2}× | ≤ 1.2× |",
        ms(a50),
        ms(a99),
        ms(b50),
        ms(b99),
        a50.as_secs_f64() / b50.as_secs_f64()
    );
    let (da50, db50) = (pct(&mut da, 0.5), pct(&mut db, 0.5));
    println!(
        "| `GET` 16 MiB ({downloads} pairs), median | {:.1} MiB/s ({}) | {:.1} MiB/s ({}) | {:.2}× | ≥ 0.8× |",
        mibs(da50),
        ms(da50),
        mibs(db50),
        ms(db50),
        mibs(da50) / mibs(db50)
    );
    h.ok(&["delete", "vm", "f0", "--wait", "--timeout", "5m"]);
}
