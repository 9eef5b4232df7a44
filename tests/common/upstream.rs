//! A stand-in upstream for the credential proxy's tests: a thread on 127.0.0.1:0 that records
//! each request's head and answers `{"ok":true}`; a request that asks for a stream
//! (`"stream":true`, what Claude Code sends) gets a Messages API event stream whose text is
//! [`ANSWER`].

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// The text of a streamed answer.
pub const ANSWER: &str = "hi from the stand-in upstream";

/// A stand-in upstream: records each request's head and answers `{"ok":true}` (or, to a
/// streamed request, a Messages API stream of [`ANSWER`]).
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
        let streamed = String::from_utf8_lossy(&body)
            .replace(' ', "")
            .contains("\"stream\":true");
        if streamed {
            let body = messages_stream(ANSWER);
            let _ = w.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            continue;
        }
        let _ = w.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
        );
    }
}

/// A Messages API event stream of one text block, as Anthropic's API sends it.
fn messages_stream(text: &str) -> String {
    let message = serde_json::json!({"id": "msg_standin", "type": "message", "role": "assistant",
        "model": "claude-standin", "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 1}});
    let events = [
        (
            "message_start",
            serde_json::json!({"type": "message_start", "message": message}),
        ),
        (
            "content_block_start",
            serde_json::json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            serde_json::json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}),
        ),
        (
            "content_block_stop",
            serde_json::json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            serde_json::json!({"type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 5}}),
        ),
        ("message_stop", serde_json::json!({"type": "message_stop"})),
    ];
    events
        .iter()
        .map(|(e, d)| format!("event: {e}\ndata: {d}\n\n"))
        .collect()
}
