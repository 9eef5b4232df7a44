//! A stand-in upstream for the credential proxy's tests: a thread on 127.0.0.1:0 that records
//! each request's head and answers `{"ok":true}`; a request that asks for a stream
//! (`"stream":true`, what the agents send) gets, by its path, the event stream of the API it
//! called, whose text is [`ANSWER`]: OpenAI's Responses API (`…/responses`: codex, opencode
//! with OpenAI), its Chat Completions (`…/chat/completions`), or Anthropic's Messages API
//! (anything else: Claude Code, opencode with Anthropic).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// The text of a streamed answer.
pub const ANSWER: &str = "hi from the stand-in upstream";

/// A stand-in upstream: records each request's head and answers `{"ok":true}` (or, to a
/// streamed request, a stream of [`ANSWER`] in its API's shape).
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
        seen.lock().unwrap().push(head.clone());
        let mut w = &c;
        let streamed = String::from_utf8_lossy(&body)
            .replace(' ', "")
            .contains("\"stream\":true");
        if streamed {
            let path = head.split(' ').nth(1).unwrap_or_default();
            let path = path.split('?').next().unwrap_or_default();
            let body = if path.ends_with("/responses") {
                responses_stream(ANSWER)
            } else if path.ends_with("/chat/completions") {
                chat_stream(ANSWER)
            } else {
                messages_stream(ANSWER)
            };
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

/// Server-sent events, each named.
fn sse(events: &[(&str, serde_json::Value)]) -> String {
    events
        .iter()
        .map(|(e, d)| format!("event: {e}\ndata: {d}\n\n"))
        .collect()
}

/// A Responses API event stream of one message, as OpenAI's API sends it (what codex reads:
/// the output item and `response.completed` with its usage).
fn responses_stream(text: &str) -> String {
    use serde_json::json;
    let (id, item) = ("resp_standin", "msg_standin");
    let response = |status: &str, output: serde_json::Value| {
        json!({"id": id, "object": "response", "created_at": 0, "status": status,
            "model": "gpt-standin", "output": output,
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 15}})
    };
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    let done = json!({"id": item, "type": "message", "status": "completed",
        "role": "assistant", "content": [part]});
    let at = json!({"item_id": item, "output_index": 0, "content_index": 0});
    let with = |mut v: serde_json::Value, extra: serde_json::Value| {
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        v
    };
    sse(&[
        (
            "response.created",
            json!({"type": "response.created", "response": response("in_progress", json!([]))}),
        ),
        (
            "response.output_item.added",
            json!({"type": "response.output_item.added", "output_index": 0,
                "item": {"id": item, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}}),
        ),
        (
            "response.content_part.added",
            with(
                at.clone(),
                json!({"type": "response.content_part.added",
                    "part": {"type": "output_text", "text": "", "annotations": []}}),
            ),
        ),
        (
            "response.output_text.delta",
            with(
                at.clone(),
                json!({"type": "response.output_text.delta", "delta": text}),
            ),
        ),
        (
            "response.output_text.done",
            with(
                at.clone(),
                json!({"type": "response.output_text.done", "text": text}),
            ),
        ),
        (
            "response.content_part.done",
            with(
                at,
                json!({"type": "response.content_part.done", "part": part}),
            ),
        ),
        (
            "response.output_item.done",
            json!({"type": "response.output_item.done", "output_index": 0, "item": done}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed", "response": response("completed", json!([done]))}),
        ),
    ])
}

/// A Chat Completions stream of one message (OpenAI-compatible clients).
fn chat_stream(text: &str) -> String {
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        serde_json::json!({"id": "chatcmpl-standin", "object": "chat.completion.chunk",
            "created": 0, "model": "gpt-standin",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    format!(
        "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
        chunk(
            serde_json::json!({"role": "assistant", "content": text}),
            serde_json::Value::Null
        ),
        chunk(serde_json::json!({}), serde_json::json!("stop"))
    )
}

/// A Messages API event stream of one text block, as Anthropic's API sends it.
fn messages_stream(text: &str) -> String {
    let message = serde_json::json!({"id": "msg_standin", "type": "message", "role": "assistant",
        "model": "claude-standin", "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 1}});
    sse(&[
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
    ])
}
