//! LLM accounting and the grants' limits (docs/grants.md, "Limits"; docs/observability.md,
//! "Usage").
//!
//! - [`Meter`] reads the usage a provider reports in its response as the response streams
//!   past, untouched: a JSON body's `usage`, or the `usage` of the events of a stream
//!   (Anthropic's `message_start` and `message_delta`, OpenAI's last chunk of a chat
//!   completion and its Responses API's `response.completed`). Counts are cumulative in those
//!   events, so the largest seen wins.
//! - [`Accounting`] keeps each grant's counters for its limits in memory, loaded from the
//!   ledger (`boxery_home::usage`) on first use, so they hold across restarts; each ended
//!   request is added to them and to the ledger (a writer thread, off the response path).
//! - [`Accounting::admit`] refuses a request past a limit with 429 before anything is sent
//!   upstream, saying which limit and when it resets.
//!
//! # Caveats
//! - Requests in flight are counted when they end: a grant can pass its token limit by what
//!   its VM's requests in flight (at most the per-VM concurrency) use.
//! - `requestsPerMinute` is kept in memory only: a restart of `serve` starts a new minute.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use boxery_api::config::Price;
use boxery_home::grants::Entry;
use boxery_home::usage::{HOUR, Ledger, LlmUse, hour_of, next_month, now, periods};
use chrono::{TimeZone, Utc};

use crate::{Refusal, refuse};

/// The largest JSON response body read for its usage (bigger ones pass uncounted).
const JSON_MAX: usize = 16 << 20;
/// The longest line of an event stream read for its usage.
const LINE_MAX: usize = 1 << 20;

/// What a response said it used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Used {
    pub(crate) model: String,
    pub(crate) input: u64,
    pub(crate) output: u64,
}

/// Bytes per token when an answer says nothing of its usage (or ends before its last event
/// says it): a generous estimate, so that hanging up early or asking for no usage report does
/// not make calls free.
pub(crate) const BYTES_PER_TOKEN: u64 = 3;

/// Reads a response's usage as its chunks pass.
#[derive(Debug)]
pub(crate) struct Meter {
    stream: bool,
    buf: Vec<u8>,
    overflow: bool,
    used: Used,
    /// A usage report was seen, and the one that closes the answer (so the counts are whole).
    reported: bool,
    last: bool,
    /// Bytes of the request and of the answer so far, for the estimate.
    sent: u64,
    got: u64,
    /// The answer is a generation's (a message, a completion, a response): one that reports
    /// no usage is estimated. Other answers (a token count, a model list) count what they
    /// report, or nothing.
    estimate: bool,
}

impl Meter {
    /// A meter for a response with this `Content-Type`, to a request of `sent` bytes; `estimate`:
    /// see [`generates`].
    pub(crate) fn new(content_type: &str, sent: u64, estimate: bool) -> Self {
        Meter {
            stream: content_type.starts_with("text/event-stream"),
            buf: Vec::new(),
            overflow: false,
            used: Used::default(),
            reported: false,
            last: false,
            sent,
            got: 0,
            estimate,
        }
    }

    /// The next chunk of the body.
    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        self.got += chunk.len() as u64;
        if self.overflow {
            return;
        }
        if !self.stream {
            if self.buf.len() + chunk.len() > JSON_MAX {
                self.overflow = true;
                self.buf = Vec::new();
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(at) = rest.iter().position(|b| *b == b'\n') {
            self.buf.extend_from_slice(&rest[..at]);
            let line = std::mem::take(&mut self.buf);
            self.line(&line);
            rest = &rest[at + 1..];
        }
        if self.buf.len() + rest.len() > LINE_MAX {
            // one enormous line: skip to its end
            self.buf.clear();
        } else {
            self.buf.extend_from_slice(rest);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(data) = line.strip_prefix(b"data:")
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(data.trim_ascii_start())
        {
            self.absorb(&v);
        }
    }

    /// The usage seen, when the body has ended. An answer that reported none is estimated
    /// from its bytes and the request's ([`BYTES_PER_TOKEN`]); a stream that ended before its
    /// closing report counts at least its bytes as output.
    pub(crate) fn finish(mut self) -> Used {
        if self.stream {
            let rest = std::mem::take(&mut self.buf);
            self.line(&rest);
        } else if !self.overflow
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&self.buf)
        {
            self.absorb(&v);
            self.last = self.reported;
        }
        if !self.estimate {
            return self.used;
        }
        if !self.reported {
            self.used.input = self.sent.div_ceil(BYTES_PER_TOKEN);
        }
        if !self.last {
            self.used.output = self.used.output.max(self.got.div_ceil(BYTES_PER_TOKEN));
        }
        self.used
    }

    /// Take what one JSON document (a body, an event) says: its model and usage, at the top
    /// or under `message` (Anthropic's `message_start`) or `response` (OpenAI's Responses
    /// API events).
    fn absorb(&mut self, v: &serde_json::Value) {
        // The events whose usage is the answer's whole: Anthropic's `message_delta`, the
        // Responses API's `response.completed`, a chat completion's chunk with usage.
        let closing = matches!(
            v["type"].as_str(),
            Some(
                "message_delta"
                    | "message_stop"
                    | "response.completed"
                    | "response.incomplete"
                    | "response.failed"
            )
        ) || (v.get("choices").is_some() && v["usage"].is_object());
        if closing && (v["usage"].is_object() || v["response"]["usage"].is_object()) {
            self.last = true;
        }
        for at in [v, &v["message"], &v["response"]] {
            if let Some(m) = at["model"].as_str()
                && self.used.model.is_empty()
            {
                self.used.model = m.chars().take(128).collect();
            }
            let u = &at["usage"];
            if !u.is_object() {
                continue;
            }
            let n = |k: &str| u[k].as_u64().unwrap_or(0);
            // Anthropic counts cache reads and writes apart from `input_tokens`; OpenAI's
            // `input_tokens` (`prompt_tokens`) already hold its cached ones.
            let input = n("input_tokens")
                + n("prompt_tokens")
                + n("cache_creation_input_tokens")
                + n("cache_read_input_tokens");
            let output = n("output_tokens") + n("completion_tokens");
            self.reported = true;
            self.used.input = self.used.input.max(input);
            self.used.output = self.used.output.max(output);
        }
    }
}

/// Whether an LLM path makes a generation whose answer should report its usage (estimated
/// when it does not): the Messages, Chat Completions, Completions and Responses APIs. A token
/// count (`/v1/messages/count_tokens`, `/v1/responses/input_tokens`) or any other path is
/// charged only what its answer reports.
pub(crate) fn generates(rest: &str) -> bool {
    let path = rest.split('?').next().unwrap_or(rest).trim_end_matches('/');
    matches!(
        path,
        "/v1/messages" | "/v1/chat/completions" | "/v1/completions" | "/v1/responses"
    )
}

/// Who a metered request charges.
#[derive(Debug, Clone)]
pub(crate) struct Charge {
    pub(crate) vm: String,
    pub(crate) owner: String,
    pub(crate) grant_uid: String,
    pub(crate) grant: String,
    pub(crate) provider: String,
    /// The grant has limits: its counters are kept.
    pub(crate) limited: bool,
    /// The path makes a generation ([`generates`]).
    pub(crate) generates: bool,
}

/// How long a grant's counters are trusted before they are read from the ledger again.
const RELOAD_EVERY: Duration = Duration::from_secs(30);

/// A grant's counters for its limits.
#[derive(Debug, Default)]
struct Counters {
    /// The first hour of the UTC day and month they count.
    day: i64,
    month: i64,
    /// When they were read from the ledger.
    loaded: Option<Instant>,
    tokens_today: u64,
    /// model → (input, output) this month.
    month_by_model: HashMap<String, (u64, u64)>,
    /// Requests admitted in the last minute.
    minute: VecDeque<Instant>,
}

/// The accounting of one proxy.
#[derive(Debug)]
pub(crate) struct Accounting {
    ledger: Option<Arc<Ledger>>,
    prices: BTreeMap<String, Price>,
    counters: Mutex<HashMap<String, Counters>>,
    writer: Option<std::sync::mpsc::Sender<LlmUse>>,
}

impl Accounting {
    /// Accounting into `home`'s ledger (none, logged, when it cannot be opened: requests are
    /// then neither recorded nor limited by tokens or dollars, and `boxery usage` says so).
    pub(crate) fn new(home: &std::path::Path, prices: BTreeMap<String, Price>) -> Self {
        let ledger = match Ledger::open(home) {
            Ok(l) => Some(Arc::new(l)),
            Err(e) => {
                tracing::error!(error = %e, "the usage ledger cannot be opened: LLM use is not recorded and token limits are not enforced");
                None
            }
        };
        let writer = ledger.clone().map(|l| {
            let (tx, rx) = std::sync::mpsc::channel::<LlmUse>();
            let spawned = std::thread::Builder::new()
                .name("boxery-usage".into())
                .spawn(move || {
                    while let Ok(first) = rx.recv() {
                        let mut batch = vec![first];
                        batch.extend(rx.try_iter());
                        if let Err(e) = l.add_llm(&batch) {
                            tracing::error!(error = %e, rows = batch.len(), "recording LLM use failed");
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start the usage writer");
            }
            tx
        });
        Accounting {
            ledger,
            prices,
            counters: Mutex::default(),
            writer,
        }
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, HashMap<String, Counters>> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `grant`'s counters, current: (re)loaded from the ledger when they are not this day's
    /// and month's, or older than [`RELOAD_EVERY`] (another process, an embedded control
    /// plane, may have counted since). The ledger is read without the counters' lock held.
    fn refresh(&self, grant: &str, unix: i64) {
        let (day, month) = periods(unix);
        let due = {
            let all = self.counters();
            all.get(grant).is_none_or(|c| {
                c.day != day
                    || c.month != month
                    || c.loaded.is_none_or(|t| t.elapsed() >= RELOAD_EVERY)
            })
        };
        if !due {
            return;
        }
        let read = self.ledger.as_ref().map(|l| {
            Ok::<_, std::io::Error>((l.grant_use(grant, day)?, l.grant_use(grant, month)?))
        });
        let mut all = self.counters();
        let c = all.entry(grant.to_string()).or_default();
        if c.day != day || c.month != month {
            // a new period starts from nothing, whatever the ledger says or fails to
            c.tokens_today = if c.day == day { c.tokens_today } else { 0 };
            if c.month != month {
                c.month_by_model.clear();
            }
        }
        c.day = day;
        c.month = month;
        c.loaded = Some(Instant::now());
        match read {
            Some(Ok((d, m))) => {
                c.tokens_today = d.tokens();
                c.month_by_model = m
                    .by_model
                    .into_iter()
                    .map(|(model, i, o)| (model, (i, o)))
                    .collect();
            }
            Some(Err(e)) => tracing::error!(error = %e, grant, "reading a grant's use failed"),
            // no ledger: what this process counted is all there is
            None => {}
        }
    }

    /// Dollars of `by_model` at the configured prices ([`boxery_api::config::spent`]).
    fn dollars(&self, by_model: &HashMap<String, (u64, u64)>) -> f64 {
        boxery_api::config::spent(
            &self.prices,
            by_model.iter().map(|(m, (i, o))| (m.as_str(), *i, *o)),
        )
    }

    /// Admit a request under `grant`'s limits (counting it in the minute), or refuse it with
    /// 429: which limit, how much is used, when it resets.
    pub(crate) fn admit(&self, grant: &Entry) -> Result<(), Refusal> {
        let Some(limits) = &grant.spec.limits else {
            return Ok(());
        };
        let unix = now();
        self.refresh(&grant.uid, unix);
        let mut all = self.counters();
        let c = all.entry(grant.uid.clone()).or_default();
        let name = &grant.name;
        let over = |what: String, reset: chrono::DateTime<Utc>| {
            let wait = (reset.timestamp() - unix).max(1) as u64;
            let mut r = refuse(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "{what}; it resets at {} (boxery grant {name} on the control plane: a person may raise spec.limits)",
                    reset.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                ),
            );
            r.retry_after = Some(wait);
            r
        };
        if let Some(max) = limits.tokens_per_day
            && c.tokens_today >= max
        {
            let reset = Utc
                .timestamp_opt((c.day + 24) * HOUR, 0)
                .single()
                .unwrap_or_default();
            return Err(over(
                format!(
                    "grant {name} has used its tokensPerDay limit: {} of {max} tokens today (UTC)",
                    c.tokens_today
                ),
                reset,
            ));
        }
        if let Some(max) = limits.dollars_per_month {
            let spent = self.dollars(&c.month_by_model);
            if spent >= max {
                return Err(over(
                    format!(
                        "grant {name} has used its dollarsPerMonth limit: ${spent:.2} of ${max:.2} this month (UTC)"
                    ),
                    next_month(c.month),
                ));
            }
        }
        if let Some(max) = limits.requests_per_minute {
            let t = Instant::now();
            while c
                .minute
                .front()
                .is_some_and(|f| t.duration_since(*f) >= Duration::from_secs(60))
            {
                c.minute.pop_front();
            }
            if c.minute.len() >= max as usize {
                let wait = c.minute.front().map_or(60, |f| {
                    60u64.saturating_sub(t.duration_since(*f).as_secs()).max(1)
                });
                let mut r = refuse(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "grant {name} has made its requestsPerMinute limit of {max} requests in the last minute: retry in {wait} s"
                    ),
                );
                r.retry_after = Some(wait);
                return Err(r);
            }
            c.minute.push_back(t);
        }
        Ok(())
    }

    /// Count a request that ended, with what its response said it used.
    pub(crate) fn record(&self, charge: &Charge, used: Used) {
        let unix = now();
        // Counters are kept for the limits only: a grant without limits is written, not kept.
        if charge.limited {
            self.refresh(&charge.grant_uid, unix);
            let mut all = self.counters();
            let c = all.entry(charge.grant_uid.clone()).or_default();
            c.tokens_today += used.input + used.output;
            let m = c.month_by_model.entry(used.model.clone()).or_default();
            m.0 += used.input;
            m.1 += used.output;
        }
        if let Some(w) = &self.writer {
            let _ = w.send(LlmUse {
                hour: hour_of(unix),
                vm: charge.vm.clone(),
                owner: charge.owner.clone(),
                grant_uid: charge.grant_uid.clone(),
                grant: charge.grant.clone(),
                provider: charge.provider.clone(),
                model: used.model,
                requests: 1,
                input: used.input,
                output: used.output,
            });
        }
    }
}

/// The accounting work one LLM request costs on its path, for the proxy's benchmark: the
/// limits check, reading a typical answer's usage as it streams past in two chunks, and the
/// count (into `home`'s ledger, by the writer thread). The mean time per request over `n`.
#[doc(hidden)]
pub fn bench_per_request(home: &std::path::Path, n: u32) -> Duration {
    let acct = Accounting::new(home, BTreeMap::new());
    let grant = Entry {
        name: "b-llm-anthropic".into(),
        uid: "bench-grant".into(),
        generation: 1,
        spec: boxery_api::grant::GrantSpec {
            vm: Some("b".into()),
            lease: None,
            type_: boxery_api::grant::GrantType::Llm,
            target: "anthropic".into(),
            header: None,
            value_from: boxery_api::grant::ValueFrom::Env("K".into()),
            limits: Some(boxery_api::grant::GrantLimits {
                tokens_per_day: Some(u64::MAX),
                requests_per_minute: Some(100_000),
                dollars_per_month: None,
            }),
        },
        vm_uid: "vm-b".into(),
        lease_uid: None,
    };
    let charge = Charge {
        vm: "b".into(),
        owner: "vm-b".into(),
        grant_uid: grant.uid.clone(),
        grant: grant.name.clone(),
        provider: "anthropic".into(),
        limited: true,
        generates: true,
    };
    let answer = format!(
        r#"{{"id":"msg_1","type":"message","role":"assistant","model":"claude-bench","content":[{{"type":"text","text":"{}"}}],"stop_reason":"end_turn","usage":{{"input_tokens":812,"output_tokens":96}}}}"#,
        "x".repeat(600)
    );
    let (a, b) = answer.as_bytes().split_at(answer.len() / 2);
    let t = Instant::now();
    for _ in 0..n {
        if acct.admit(&grant).is_err() {
            break;
        }
        let mut m = Meter::new("application/json", 900, true);
        m.feed(a);
        m.feed(b);
        acct.record(&charge, m.finish());
    }
    t.elapsed() / n.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metered(content_type: &str, chunks: &[&str]) -> Used {
        let mut m = Meter::new(content_type, 0, true);
        for c in chunks {
            m.feed(c.as_bytes());
        }
        m.finish()
    }

    #[test]
    fn usage_is_read_from_bodies_and_streams_of_each_api() {
        // Anthropic Messages, whole, with cache tokens.
        let u = metered(
            "application/json",
            &[
                r#"{"model":"claude-x","usage":{"input_tokens":10,"cache_read_input_tokens":5,"#,
                r#""output_tokens":7}}"#,
            ],
        );
        assert_eq!((u.model.as_str(), u.input, u.output), ("claude-x", 15, 7));
        // Anthropic streamed, split mid-line: message_start's input, message_delta's output.
        let u = metered(
            "text/event-stream",
            &[
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-x\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\nevent: content_block_delta\nda",
                "ta: {\"type\":\"content_block_delta\"}\n\nevent: message_delta\r\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":42}}\r\n\r\n",
            ],
        );
        assert_eq!((u.model.as_str(), u.input, u.output), ("claude-x", 25, 42));
        // OpenAI chat, whole and streamed (usage in the last chunk).
        let u = metered(
            "application/json",
            &[
                r#"{"model":"gpt-y","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
            ],
        );
        assert_eq!((u.input, u.output), (3, 4));
        let u = metered(
            "text/event-stream; charset=utf-8",
            &[
                "data: {\"model\":\"gpt-y\",\"choices\":[]}\n\n",
                "data: {\"model\":\"gpt-y\",\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n",
            ],
        );
        assert_eq!((u.model.as_str(), u.input, u.output), ("gpt-y", 8, 9));
        // OpenAI Responses streamed: response.completed.
        let u = metered(
            "text/event-stream",
            &[
                "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"model\":\"gpt-z\",\"usage\":{\"input_tokens\":11,\"output_tokens\":12}}}",
            ],
        );
        assert_eq!((u.model.as_str(), u.input, u.output), ("gpt-z", 11, 12));
        // No usage, broken JSON: estimated from the bytes, never free.
        let u = metered("application/json", &["{\"usage\":"]);
        assert_eq!((u.input, u.output), (0, 3));
    }

    #[test]
    fn answers_that_hide_their_usage_are_estimated_from_their_bytes() {
        // Anthropic, the guest gone before message_delta: at least the bytes it got.
        let head = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-x\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
        let body = format!(
            "{head}event: content_block_delta\ndata: {{\"delta\":{{\"text\":\"{}\"}}}}\n\n",
            "y".repeat(3000)
        );
        let mut m = Meter::new("text/event-stream", 600, true);
        m.feed(body.as_bytes());
        let u = m.finish();
        assert_eq!(u.input, 25, "the reported input holds");
        assert!(u.output >= 1000, "{u:?}");
        // An OpenAI chat stream without `include_usage`: estimated both ways.
        let mut m = Meter::new("text/event-stream", 3000, true);
        m.feed(b"data: {\"object\":\"chat.completion.chunk\",\"model\":\"gpt-y\",\"choices\":[{\"delta\":{\"content\":\"hello there\"}}]}\n\ndata: [DONE]\n\n");
        let u = m.finish();
        assert_eq!(u.input, 1000);
        assert!(u.output > 30, "{u:?}");
        // A token count reports no usage, and is not a generation: nothing is charged.
        assert!(generates("/v1/messages") && generates("/v1/responses?x=1"));
        assert!(
            !generates("/v1/messages/count_tokens") && !generates("/v1/responses/input_tokens")
        );
        let mut m = Meter::new("application/json", 600_000, false);
        m.feed(br#"{"input_tokens":150000}"#);
        assert_eq!(m.finish(), Used::default());
    }

    #[test]
    fn periods_are_utc_days_and_months() {
        // 2026-12-06T05:30:00Z
        let t = Utc
            .with_ymd_and_hms(2026, 12, 6, 5, 30, 0)
            .unwrap()
            .timestamp();
        let (day, month) = periods(t);
        assert_eq!(
            day * HOUR,
            Utc.with_ymd_and_hms(2026, 12, 6, 0, 0, 0)
                .unwrap()
                .timestamp()
        );
        assert_eq!(
            month * HOUR,
            Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0)
                .unwrap()
                .timestamp()
        );
        assert_eq!(
            next_month(month),
            Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap()
        );
    }
}
