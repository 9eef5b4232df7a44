//! A stand-in upstream for the credential proxy's tests: a thread on 127.0.0.1:0 that records
//! each request's head and answers `{"ok":true}`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// A stand-in upstream: records each request's head and answers `{"ok":true}`.
pub struct Upstream {
    /// Its port on 127.0.0.1.
    pub port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    /// Start it (the thread lives as long as the test process).
    pub fn start() -> Upstream {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let s = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let s = s.clone();
                std::thread::spawn(move || serve_one(c, &s));
            }
        });
        Upstream { port, seen }
    }
    /// The heads of the requests received so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve_one(c: TcpStream, seen: &Mutex<Vec<String>>) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    loop {
        let mut head = String::new();
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            let end = line == "\r\n";
            head.push_str(&line);
            if end {
                break;
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        seen.lock().unwrap().push(head);
        let mut w = &c;
        let _ = w.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
        );
    }
}
