//! The agent's browser (`vm_browser`, `boxery browser`): Chromium in the guest (the `browser`
//! layer), on the desktop's display, driven through its DevTools endpoint by the layer's
//! driver (`/usr/local/lib/boxery/browser/drive`, one action a call).
//!
//! Guarantees: an action is checked whole before anything reaches the guest (the fields it
//! takes and no other, a URL that is http, https or about:blank, no control characters in a
//! selector, bounded sizes); the request travels on ssh's stdin as JSON, never on a command
//! line; what the guest answers is parsed strictly, bounded (text at [`TEXT_CAP`], a
//! screenshot at [`PNG_CAP`] and checked to be a PNG) and never believed beyond that. The
//! browser goes out through the guest's egress proxy, so the VM's egress policy applies to it
//! like to everything else; a page the policy refuses comes back with the proxy's status (403)
//! or the browser's error. Each action is in the actions log (`browser`).
//! Caveat: the DevTools endpoint listens on the guest's loopback, so any process in the guest
//! can drive the browser too (it is the agent's VM).

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{Result, VerbError, Verbs};

/// The layer that has the browser.
pub const LAYER: &str = "browser";
/// The most page text an answer carries (the driver cuts it there too).
pub const TEXT_CAP: usize = 256 * 1024;
/// The largest screenshot accepted from the guest.
pub const PNG_CAP: usize = 16 << 20;
/// The longest a request's `text` or `expression` may be.
const INPUT_CAP: usize = 64 * 1024;
/// The longest URL or selector.
const SHORT_CAP: usize = 4096;
/// Default and longest time for an action, in seconds.
const DEFAULT_SECS: u64 = 180;
const MAX_SECS: u64 = 300;

/// The actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BrowserAction {
    /// Go to `url` and wait until it has loaded: its address, title, HTTP status and text.
    Open,
    /// The current page's address, title, status and text.
    Read,
    /// Click the element `selector` (a CSS selector) matches first, as a mouse would.
    Click,
    /// Replace the text of the field `selector` matches with `text`, as typed.
    Fill,
    /// Run JavaScript `expression` in the page; its value as JSON (a promise is awaited).
    Evaluate,
    /// A picture of the page's viewport.
    Screenshot,
}

impl BrowserAction {
    /// Its name, as the wire (serde) writes it.
    fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// One browser action.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Browse {
    /// What to do.
    pub action: BrowserAction,
    /// open: the address (http, https, or about:blank).
    #[serde(default)]
    pub url: Option<String>,
    /// click, fill: a CSS selector; the first element it matches.
    #[serde(default)]
    pub selector: Option<String>,
    /// fill: the text the field gets (empty clears it).
    #[serde(default)]
    pub text: Option<String>,
    /// evaluate: the JavaScript.
    #[serde(default)]
    pub expression: Option<String>,
    /// Seconds the action may take (default 180, at most 300; the browser's first start is
    /// part of it: 1 to 2 minutes under emulation).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// What the host waits beyond an action's time: the ssh session and the driver's start (a
/// Python process under emulation), which a busy guest slows: with a page spinning the
/// guest's one vCPU, a 30 s action was answered 56 s after it was sent in the real test.
pub const DRIVER_START: Duration = Duration::from_secs(30);

/// What the driver is sent (the request, checked).
#[derive(Debug, Serialize)]
struct Request<'a> {
    action: BrowserAction,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    selector: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expression: Option<&'a str>,
    timeout: u64,
}

/// What the driver answers.
#[derive(Debug, Deserialize)]
struct Answer {
    #[serde(default)]
    url: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    truncated: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    value: Option<serde_json::Value>,
    #[serde(default)]
    png: Option<String>,
}

/// What an action did.
#[derive(Debug, Clone, Serialize)]
pub struct Browsed {
    /// The VM.
    pub vm: String,
    /// The action.
    pub action: BrowserAction,
    /// The page's address after it.
    pub url: String,
    /// Its title.
    pub title: String,
    /// The HTTP status of the page's document, when the browser knows it (403: refused by the
    /// egress policy, as the proxy answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The page's text (open, read), at most [`TEXT_CAP`] bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Whether the text was cut.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Why a page did not load (open: the browser's error, e.g. net::ERR_NAME_NOT_RESOLVED),
    /// or the exception an expression threw (evaluate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The expression's value (evaluate), or the field's value after it was filled (fill).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// The screenshot, PNG (not serialized: front ends send it as an image).
    #[serde(skip)]
    pub png: Option<Vec<u8>>,
}

impl Browsed {
    /// One line saying what happened.
    pub fn said(&self) -> String {
        let at = |s: &Browsed| match s.status {
            Some(code) => format!("{} (HTTP {code})", s.url),
            None => s.url.clone(),
        };
        match (&self.error, self.action) {
            (Some(e), BrowserAction::Evaluate) => format!("the expression threw: {e}"),
            (Some(e), _) => format!("{} did not load: {e}", self.url),
            (None, BrowserAction::Open | BrowserAction::Read) => {
                format!("{}: “{}”", at(self), self.title)
            }
            (None, BrowserAction::Click) => format!("clicked; now at {}", at(self)),
            (None, BrowserAction::Fill) => format!("filled; on {}", at(self)),
            (None, BrowserAction::Evaluate) => format!("evaluated on {}", at(self)),
            (None, BrowserAction::Screenshot) => format!("a screenshot of {}", at(self)),
        }
    }
}

/// Control characters (but newline and tab) in `s`, as the first one found.
fn control(s: &str) -> Option<char> {
    s.chars()
        .find(|c| c.is_control() && *c != '\n' && *c != '\t')
}

impl Browse {
    /// The request for the driver, or why not: every field checked before anything is sent.
    fn check(&self) -> Result<Request<'_>> {
        use BrowserAction as A;
        let bad = |why: String| {
            Err(VerbError::invalid(format!(
                "{}: {why} (nothing was sent)",
                self.action.name()
            )))
        };
        let takes: &[&str] = match self.action {
            A::Open => &["url"],
            A::Read | A::Screenshot => &[],
            A::Click => &["selector"],
            A::Fill => &["selector", "text"],
            A::Evaluate => &["expression"],
        };
        for (field, given) in [
            ("url", self.url.is_some()),
            ("selector", self.selector.is_some()),
            ("text", self.text.is_some()),
            ("expression", self.expression.is_some()),
        ] {
            if given && !takes.contains(&field) {
                return bad(format!("it takes no `{field}`"));
            }
            if !given && takes.contains(&field) && field != "text" {
                return bad(format!("it needs `{field}`"));
            }
        }
        if let Some(Err(why)) = self.url.as_deref().map(check_url) {
            return bad(why);
        }
        if let Some(Err(why)) = self
            .selector
            .as_deref()
            .map(|s| boxery_api::name::check_text(s, SHORT_CAP))
        {
            return bad(format!("the selector: {why}"));
        }
        for (field, v) in [("text", &self.text), ("expression", &self.expression)] {
            if let Some(v) = v {
                if v.len() > INPUT_CAP {
                    return bad(format!("`{field}` is over {INPUT_CAP} bytes"));
                }
                if let Some(c) = control(v) {
                    return bad(format!(
                        "`{field}` holds a control character (U+{:04X})",
                        c as u32
                    ));
                }
            }
        }
        if self.action == A::Evaluate
            && self
                .expression
                .as_deref()
                .is_some_and(|e| e.trim().is_empty())
        {
            return bad("the expression is empty".into());
        }
        let timeout = self.timeout_seconds.unwrap_or(DEFAULT_SECS);
        if !(1..=MAX_SECS).contains(&timeout) {
            return bad(format!(
                "timeout_seconds must be 1 to {MAX_SECS}, not {timeout}"
            ));
        }
        Ok(Request {
            action: self.action,
            url: self.url.as_deref(),
            selector: self.selector.as_deref(),
            text: match self.action {
                A::Fill => Some(self.text.as_deref().unwrap_or("")),
                _ => None,
            },
            expression: self.expression.as_deref(),
            timeout,
        })
    }
}

/// An address the browser may be sent to: http or https with a host, or `about:blank`; no
/// whitespace or control characters; at most [`SHORT_CAP`] bytes. (Where it may go is the
/// egress policy's to say, in the proxy.)
fn check_url(u: &str) -> std::result::Result<(), String> {
    if u.len() > SHORT_CAP {
        return Err(format!("the url is over {SHORT_CAP} bytes"));
    }
    if u.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("the url holds whitespace or a control character".into());
    }
    if u == "about:blank" {
        return Ok(());
    }
    let scheme = u.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    let rest = matches!(scheme.as_deref(), Some("http" | "https"))
        .then(|| u.split_once("://").map_or("", |(_, r)| r))
        .ok_or_else(|| {
            format!(
                "`{}` is not an http or https address (or about:blank)",
                boxery_api::name::shown(u)
            )
        })?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if host.is_empty() || host.starts_with(':') {
        return Err(format!("`{}` has no host", boxery_api::name::shown(u)));
    }
    Ok(())
}

/// `u` with the password of any `user:password@` replaced (for the actions log).
fn without_password(u: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme, rest)) = u.split_once("://") else {
        return u.into();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rsplit_once('@') {
        Some((who, host)) if who.contains(':') => {
            let user = who.split_once(':').map_or(who, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}{}", &rest[end..]).into()
        }
        _ => u.into(),
    }
}

/// Do `a` in VM `vm`'s browser.
pub async fn browse(v: &Verbs, vm: &str, a: &Browse, ct: &CancellationToken) -> Result<Browsed> {
    let req = a.check()?;
    let obj = crate::vm::get_vm(v, vm).await?;
    if !super::has_layer(&obj, LAYER) {
        return Err(VerbError::invalid(format!(
            "VM {vm} has no browser: make it with `layers: [browser]` (docs/desktop.md, \"The agent's browser\")"
        )));
    }
    let timeout = Duration::from_secs(req.timeout);
    let body = serde_json::to_vec(&req)?;
    let what = match a.action {
        BrowserAction::Open => format!("open {}", without_password(req.url.unwrap_or_default())),
        BrowserAction::Click | BrowserAction::Fill => {
            format!("{} {}", a.action.name(), req.selector.unwrap_or_default())
        }
        other => other.name().to_string(),
    };
    let doing = v.doing("browser", Some(vm), what);
    // (the driver keeps to the call's time from its start; the host waits longer by the
    // margin it takes to start.) The call's tag is in the driver's command line only, not in
    // its environment: a call cancelled or out of time ends its driver
    // ([`super::exec::kill_script`]), never the browser or the relay the driver started.
    let id = format!("w{}", uuid::Uuid::new_v4().simple());
    let r = super::helper_stopped(
        v,
        vm,
        &driver_line(&id),
        Some(body),
        PNG_CAP * 2 + TEXT_CAP * 8,
        timeout + DRIVER_START,
        ct,
        Some(&super::exec::kill_script(&id)),
    )
    .await
    .and_then(|out| read_answer(vm, a.action, &out));
    match &r {
        Ok(b) => doing.done(b.said(), None),
        Err(_) => doing.ended(&r, None),
    }
    r
}

/// The guest's line for one driver call tagged `id`: the tag is an argument, in the
/// driver's command line alone (the browser and relay it starts do not inherit it).
fn driver_line(id: &str) -> String {
    format!(
        "exec /usr/local/lib/boxery/browser/drive {}={id}",
        super::exec::CALL_TAG
    )
}

/// The driver's answer, checked.
fn read_answer(vm: &str, action: BrowserAction, out: &[u8]) -> Result<Browsed> {
    let strange = |why: String| VerbError::failed(format!("VM {vm}'s browser answered {why}"));
    let a: Answer = serde_json::from_slice(out).map_err(|e| strange(format!("no JSON: {e}")))?;
    let png = match a.png {
        None => None,
        Some(b64) => {
            use base64::Engine;
            let png = base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| strange(format!("a screenshot that is not base64: {e}")))?;
            if png.len() > PNG_CAP {
                return Err(strange(format!(
                    "a screenshot of {} MiB, over the {} MiB cap (a smaller spec.display)",
                    png.len() >> 20,
                    PNG_CAP >> 20
                )));
            }
            if !png.starts_with(b"\x89PNG\r\n\x1a\n") {
                return Err(strange("a screenshot that is not a PNG".into()));
            }
            Some(png)
        }
    };
    if action == BrowserAction::Screenshot && png.is_none() {
        return Err(strange("no screenshot".into()));
    }
    let cut = |s: String, cap: usize| -> (String, bool) {
        match s.len() <= cap {
            true => (s, false),
            false => (s[..s.floor_char_boundary(cap)].to_string(), true),
        }
    };
    let (text, truncated) = match a.text {
        Some(t) => {
            let (t, cut) = cut(t, TEXT_CAP);
            (Some(t), cut || a.truncated)
        }
        None => (None, false),
    };
    let value = match a.value {
        Some(v) if crate::edit::json_len_upto(&v, TEXT_CAP).is_none() => {
            return Err(VerbError::failed(format!(
                "the expression ran, but its value is over {TEXT_CAP} bytes as JSON: return less (a slice, a count)"
            )));
        }
        v => v,
    };
    Ok(Browsed {
        vm: vm.to_string(),
        action,
        url: cut(a.url, SHORT_CAP).0,
        title: cut(a.title, 1024).0,
        status: a.status,
        text,
        truncated,
        error: a.error.map(|e| cut(e, 4096).0),
        value,
        png,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: serde_json::Value) -> Browse {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn bad_actions_are_refused_before_anything_is_sent() {
        for (a, says) in [
            (serde_json::json!({"action": "open"}), "needs `url`"),
            (
                serde_json::json!({"action": "open", "url": "file:///etc/passwd"}),
                "not an http",
            ),
            (
                serde_json::json!({"action": "open", "url": "javascript:alert(1)"}),
                "not an http",
            ),
            (
                serde_json::json!({"action": "open", "url": "http://"}),
                "no host",
            ),
            (
                serde_json::json!({"action": "open", "url": "http://a b"}),
                "whitespace",
            ),
            (
                serde_json::json!({"action": "read", "url": "http://a"}),
                "takes no `url`",
            ),
            (serde_json::json!({"action": "click"}), "needs `selector`"),
            (
                serde_json::json!({"action": "click", "selector": "a\u{1b}[2J"}),
                "control characters",
            ),
            (
                serde_json::json!({"action": "click", "selector": "  "}),
                "1 to",
            ),
            (
                serde_json::json!({"action": "fill", "selector": "#a", "text": "x\u{7}"}),
                "U+0007",
            ),
            (
                serde_json::json!({"action": "evaluate", "expression": " "}),
                "empty",
            ),
            (
                serde_json::json!({"action": "read", "timeout_seconds": 0}),
                "1 to 300",
            ),
            (
                serde_json::json!({"action": "screenshot", "text": "x"}),
                "takes no `text`",
            ),
        ] {
            let e = b(a.clone()).check().map(|_| ()).unwrap_err();
            let s = e.to_string();
            assert!(
                s.contains(says) && s.contains("nothing was sent"),
                "{a}: {s}"
            );
            assert_eq!(e.kind(), crate::ErrorKind::Invalid);
        }
        let ok = b(serde_json::json!({"action": "fill", "selector": "#name"}));
        let r = ok.check().unwrap();
        assert_eq!(r.text, Some(""), "fill without text clears the field");
        assert_eq!(
            without_password("https://ada:secret@example.com/a?b"),
            "https://ada:***@example.com/a?b"
        );
        assert_eq!(without_password("http://a/b@c:d"), "http://a/b@c:d");
        for u in [
            "https://example.com/a?b#c",
            "http://127.0.0.1:8000/",
            "about:blank",
            "HTTPS://A/",
        ] {
            assert!(check_url(u).is_ok(), "{u}");
        }
        assert!(
            serde_json::from_value::<Browse>(serde_json::json!({"action": "read", "bogus": 1}))
                .is_err()
        );
    }

    #[test]
    fn a_hostile_answer_is_an_error_or_bounded() {
        use base64::Engine;
        let enc = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        assert!(read_answer("v", BrowserAction::Read, b"not json").is_err());
        let not_png = format!(r#"{{"url": "u", "png": "{}"}}"#, enc(b"GIF89a"));
        assert!(read_answer("v", BrowserAction::Screenshot, not_png.as_bytes()).is_err());
        assert!(read_answer("v", BrowserAction::Screenshot, br#"{"url": "u"}"#).is_err());
        let big = serde_json::json!({"url": "u", "text": "é".repeat(TEXT_CAP)}).to_string();
        let r = read_answer("v", BrowserAction::Read, big.as_bytes()).unwrap();
        assert!(r.truncated && r.text.unwrap().len() <= TEXT_CAP);
        let png = format!(
            r#"{{"url": "u", "status": 200, "png": "{}"}}"#,
            enc(b"\x89PNG\r\n\x1a\nrest")
        );
        let r = read_answer("v", BrowserAction::Screenshot, png.as_bytes()).unwrap();
        assert_eq!(r.status, Some(200));
        assert!(r.png.is_some());
    }

    #[test]
    fn a_call_is_tagged_in_the_drivers_command_line_only() {
        let line = driver_line("w1");
        assert_eq!(
            line,
            "exec /usr/local/lib/boxery/browser/drive BOXERY_CALL=w1"
        );
    }
}
