//! One HTTP/1.1 request over a fresh TCP connection, by hand (a test's client of `serve`'s
//! plain-HTTP listeners: the credential proxy, `/metrics`, a Prometheus).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `METHOD PATH` to `addr` with extra `headers` (each ending in `\r\n`) and `body`: the
/// status and the whole answer (head and body).
pub fn request(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut c = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        c,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer from {addr}{path}: {out:?}"));
    (status, out)
}

/// The body of an answer [`request`] returned.
pub fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}
