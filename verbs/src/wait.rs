//! Waiting for conditions: `wait`, and every `--wait` flag.
//!
//! A wait watches the store from the revision it read the object at, so it never misses a
//! change. When no control plane leads the store (no `boxery serve` running), the wait runs the
//! controllers in this process until its condition holds (embedded mode), so the first
//! `apply --wait` on a fresh machine works with no daemon.

use std::time::{Duration, Instant};

use boxery_api::conditions::{READY, READY_WILL_NOT_COME};
use boxery_api::{ConditionStatus, DynObject};
use futures::StreamExt;
use serde_json::Value;

use boxery_store::{ObjectRef, ObjectStore};

use crate::Verbs;
use crate::control::{Running, Started};
use crate::error::{ErrorKind, Result, VerbError};

/// The longest any wait may last (`--timeout` on `wait`, `--wait` and `jobs wait`): 7 days.
/// Longer values are refused when parsed; [`wait_all`] clamps what other callers pass.
pub const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest a tool may wait (a tool's `timeout_seconds` is clamped to this): 30 minutes.
pub const TOOL_MAX_WAIT_SECS: u64 = 1800;

/// A duration argument within `min..=max`, or a message saying the range. humantime's parser
/// alone accepts `18446744073709551615s`, which overflows the first `Instant + timeout`.
pub fn duration_in(s: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("`{s}` is not a duration ({e}): write e.g. 90s, 5m or 2h"))?;
    if d < min || d > max {
        return Err(format!(
            "{} is out of range: use {} to {}",
            humantime::format_duration(d),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

/// The value parser of every `--timeout`: 0s to [`MAX_WAIT`].
pub fn timeout_arg(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::ZERO, MAX_WAIT)
}

/// The value parser of `jobs wait --timeout`: 0s to the tools' longest wait (30 minutes),
/// which `vm_jobs` would otherwise cut it to without a word.
pub fn tool_timeout_arg(s: &str) -> Result<Duration, String> {
    duration_in(s, Duration::ZERO, Duration::from_secs(TOOL_MAX_WAIT_SECS))
}

/// What to wait for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Until {
    /// A condition of this type has this status, computed for the current generation.
    Condition(String, ConditionStatus),
    /// The object is gone.
    Deleted,
    /// A JSONPath's value equals this.
    JsonPath(String, String),
    /// A JSONPath has a value (not empty): `--for=jsonpath={.status.vm}`.
    Exists(String),
}

impl std::str::FromStr for Until {
    type Err = VerbError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "delete" {
            return Ok(Until::Deleted);
        }
        if let Some(c) = s.strip_prefix("condition=") {
            let (t, v) = c.split_once('=').unwrap_or((c, "True"));
            let st = match v.to_ascii_lowercase().as_str() {
                "true" => ConditionStatus::True,
                "false" => ConditionStatus::False,
                "unknown" => ConditionStatus::Unknown,
                _ => {
                    return Err(VerbError::invalid(format!(
                        "--for=condition={c}: the status must be True, False or Unknown"
                    )));
                }
            };
            return Ok(Until::Condition(t.to_string(), st));
        }
        if let Some(j) = s.strip_prefix("jsonpath=") {
            // As kubectl: `{.status.phase}=Stopped`, or the path alone (it has a value); the
            // braces may be left out (`.status.phase=Stopped`).
            let (path, value) = match j.strip_prefix('{') {
                Some(inner) => {
                    let end = inner.find('}').ok_or_else(|| {
                        VerbError::invalid(format!("--for=jsonpath={j}: no closing `}}`"))
                    })?;
                    let rest = &inner[end + 1..];
                    let value = match rest.strip_prefix('=') {
                        Some(v) => Some(v),
                        None if rest.is_empty() => None,
                        None => {
                            return Err(VerbError::invalid(format!(
                                "--for=jsonpath={j}: write {{.path}}=VALUE, or {{.path}} alone"
                            )));
                        }
                    };
                    (&inner[..end], value)
                }
                None => match j.split_once('=') {
                    Some((p, v)) => (p, Some(v)),
                    None => (j, None),
                },
            };
            let path = path.trim();
            if !path.starts_with('.') {
                return Err(VerbError::invalid(format!(
                    "--for=jsonpath={j}: the path starts with `.` (e.g. {{.status.phase}}=Stopped)"
                )));
            }
            let path = format!("{{{path}}}");
            return Ok(match value {
                Some(v) => Until::JsonPath(path, v.trim_matches(['\'', '"']).to_string()),
                None => Until::Exists(path),
            });
        }
        Err(VerbError::invalid(format!(
            "--for={s}: use condition=NAME[=True|False], delete, or jsonpath={{.path}}[=VALUE]"
        )))
    }
}

/// Whether a Vm was last seen on another boot of this host (its `status.bootId`).
pub fn rebooted_since(obj: &DynObject) -> bool {
    obj.kind == "Vm"
        && obj.status()["bootId"]
            .as_str()
            .is_some_and(|b| b != boxery_store::boot_id())
}

/// Whether `obj` (None = gone) satisfies `until`.
pub fn holds(until: &Until, obj: Option<&DynObject>) -> Result<bool> {
    let Some(obj) = obj else {
        return Ok(*until == Until::Deleted);
    };
    Ok(match until {
        Until::Deleted => false,
        // A Ready seen before the host rebooted is void until a control plane looks again.
        // Condition types match case-insensitively, as kubectl's do (`condition=ready`).
        Until::Condition(t, _) if t.eq_ignore_ascii_case(READY) && rebooted_since(obj) => false,
        Until::Condition(t, want) => {
            let generation = obj.metadata.generation;
            obj.status()["conditions"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    c["type"]
                        .as_str()
                        .is_some_and(|x| x.eq_ignore_ascii_case(t))
                        && c["status"].as_str() == Some(&want.to_string())
                        && (generation.is_none() || c["observedGeneration"].as_i64() >= generation)
                })
            })
        }
        Until::JsonPath(p, v) => {
            let val: Value = serde_json::to_value(obj)?;
            crate::render::jsonpath(p, &val)? == *v
        }
        Until::Exists(p) => {
            let val: Value = serde_json::to_value(obj)?;
            !crate::render::jsonpath(p, &val)?.is_empty()
        }
    })
}

/// Why `obj` will not satisfy `until` unless someone changes it: its current `Ready=False`
/// has a reason of [`READY_WILL_NOT_COME`] (a guest whose console says it will not answer).
/// Such a wait ends at once with that message, not when its timeout runs out.
pub fn will_not_come(until: &Until, obj: Option<&DynObject>) -> Option<String> {
    let Until::Condition(t, ConditionStatus::True) = until else {
        return None;
    };
    let obj = obj?;
    if !t.eq_ignore_ascii_case(READY) {
        return None;
    }
    let generation = obj.metadata.generation;
    let c = obj.status()["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == READY)?;
    let current = generation.is_none() || c["observedGeneration"].as_i64() >= generation;
    let reason = c["reason"].as_str()?;
    (current && c["status"] == "False" && READY_WILL_NOT_COME.contains(&reason)).then(|| {
        format!(
            "{} {} will not become Ready ({reason}): {}",
            obj.kind,
            obj.metadata.name,
            c["message"].as_str().unwrap_or("")
        )
    })
}

/// An object's status word (`printableStatus`, else `phase`, else Pending) and its `Ready`
/// condition, if it has one.
fn standing(o: &DynObject) -> (&str, Option<&Value>) {
    let st = o.status();
    let word = st["printableStatus"]
        .as_str()
        .or(st["phase"].as_str())
        .unwrap_or("Pending");
    let ready = st["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"));
    (word, ready)
}

/// A short description of where an object stands, for timeouts.
pub fn describe_state(obj: Option<&DynObject>) -> String {
    let Some(o) = obj else {
        return "it does not exist".into();
    };
    let (word, ready) = standing(o);
    let ready = ready
        .map(|c| {
            format!(
                "; Ready={} ({}): {}",
                c["status"].as_str().unwrap_or("?"),
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            )
        })
        .unwrap_or_default();
    format!("it is {word}{ready}")
}

/// What a wait tells its caller while it runs. The verbs never print: the front end says
/// each of these where its reader looks.
pub trait Progress: Sync {
    /// `target` satisfies the condition now.
    fn met(&self, _target: &ObjectRef) {}
    /// Where a pending object stands changed (`kind/name STATUS: message`).
    fn state(&self, _line: &str) {}
    /// Something about the wait itself (the controllers taken over, an unreachable backend).
    fn note(&self, line: &str);
}

/// A wait that reports nothing but its notes, and those to the log (`tracing`): what the
/// tools wait with (their stdout may be the MCP transport).
#[derive(Debug, Clone, Copy)]
pub struct Quiet;
impl Progress for Quiet {
    fn note(&self, line: &str) {
        tracing::info!("{line}");
    }
}

/// Wait until every target satisfies `until`, or `timeout` (at most [`MAX_WAIT`]: a longer
/// one is cut to it) passes (a `Timeout` error saying where each pending object stands).
/// Runs the controllers in-process whenever nothing else leads the store: at the start, and
/// later if the control plane that led goes away (a `serve` that exited), so a wait never
/// outlives its controllers.
pub async fn wait_all(
    v: &Verbs,
    targets: &[ObjectRef],
    until: &Until,
    timeout: Duration,
    progress: &dyn Progress,
) -> Result {
    let timeout = timeout.min(MAX_WAIT);
    let mut said_unreachable = false;
    let mut embedded = lead_if_needed(v, &mut said_unreachable, false, progress).await?;
    let wait = wait_inner(v.store(), targets, until, timeout, progress);
    tokio::pin!(wait);
    let mut check = tokio::time::interval(TAKE_OVER_CHECK);
    check.tick().await;
    let result = loop {
        tokio::select! {
            r = &mut wait => break r,
            _ = check.tick(), if embedded.is_none() => {
                match lead_if_needed(v, &mut said_unreachable, true, progress).await {
                    Ok(e) => embedded = e,
                    Err(e) => break Err(e),
                }
            }
        }
    };
    if let Some(e) = embedded {
        e.stop().await;
    }
    result
}

/// A wait with a bound that is an answer, not a failure: `Ok(None)` when `until` held,
/// `Ok(Some(where they stand))` when the time ran out; a `Cancelled` error when `cancel`
/// fires first. What the tools wait with.
pub async fn bounded(
    v: &Verbs,
    targets: &[ObjectRef],
    until: &Until,
    timeout: Duration,
    cancel: impl std::future::Future<Output = ()>,
) -> Result<Option<String>> {
    if targets.is_empty() {
        return Ok(None);
    }
    let w = wait_all(v, targets, until, timeout, &Quiet);
    let r = tokio::select! {
        r = w => r,
        _ = cancel => return Err(VerbError::new(ErrorKind::Cancelled, "cancelled")),
    };
    match r {
        Ok(()) => Ok(None),
        Err(e) if e.kind() == ErrorKind::Timeout => Ok(Some(e.chain())),
        Err(e) => Err(e),
    }
}

/// How often a wait that does not lead checks that something does.
const TAKE_OVER_CHECK: Duration = Duration::from_secs(3);

/// The controllers of this process, if nothing else leads (saying so when it is a take-over);
/// an unreachable backend is said once and waited on. Verbs over a store this process did not
/// open wait on the store only.
async fn lead_if_needed(
    v: &Verbs,
    said_unreachable: &mut bool,
    taking_over: bool,
    progress: &dyn Progress,
) -> Result<Option<Box<dyn Running>>> {
    let (Ok(store), Some(control)) = (v.home_store(), v.env.control.as_ref()) else {
        return Ok(None);
    };
    Ok(match control.start_if_needed(&v.env, store).await? {
        Started::Here(e) => {
            if taking_over {
                progress.note(
                    "boxery: no control plane leads the store any more; running the controllers here",
                );
            }
            Some(e)
        }
        Started::Elsewhere => None,
        Started::Unreachable(why) => {
            // Keep waiting: the condition may be the unreachable one, or a `serve` may lead.
            if !*said_unreachable {
                progress.note(&format!("boxery: {why}; waiting on the store only"));
                *said_unreachable = true;
            }
            None
        }
    })
}

async fn wait_inner(
    store: &dyn ObjectStore,
    targets: &[ObjectRef],
    until: &Until,
    timeout: Duration,
    progress: &dyn Progress,
) -> Result {
    // Never `Instant + timeout` unchecked: a huge timeout would panic.
    let deadline = Instant::now()
        .checked_add(timeout.min(MAX_WAIT))
        .ok_or_else(|| VerbError::invalid("the timeout is too long"))?;
    let from = store.revision().await?;
    let mut pending: Vec<ObjectRef> = Vec::new();
    for t in targets {
        let obj = store.get(t).await?;
        if obj.is_none() && *until != Until::Deleted {
            return Err(VerbError::not_found(format!(
                "{} {} not found",
                t.kind, t.name
            )));
        }
        if holds(until, obj.as_ref())? {
            progress.met(t);
        } else if let Some(why) = will_not_come(until, obj.as_ref()) {
            return Err(VerbError::failed(why));
        } else {
            pending.push(t.clone());
        }
    }
    if pending.is_empty() {
        return Ok(());
    }
    let mut watch = store.watch(None, from);
    let mut shown: std::collections::HashMap<String, String> = Default::default();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let next = tokio::time::timeout(left, watch.next()).await;
        match next {
            Err(_) => {
                let mut lines = Vec::new();
                for t in &pending {
                    let obj = store.get(t).await?;
                    // What the path holds now, so the message never reads as met.
                    let now = match (until, obj.as_ref()) {
                        (Until::JsonPath(p, _) | Until::Exists(p), Some(o)) => {
                            let val: Value = serde_json::to_value(o)?;
                            let got = crate::render::jsonpath(p, &val).unwrap_or_default();
                            format!("{p} is {got:?}; ")
                        }
                        _ => String::new(),
                    };
                    lines.push(format!(
                        "{} {}: {now}{}",
                        t.kind,
                        t.name,
                        describe_state(obj.as_ref())
                    ));
                }
                return Err(VerbError::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {} waiting for {}: {}",
                        humantime::format_duration(timeout),
                        describe_until(until),
                        lines.join("; ")
                    ),
                ));
            }
            Ok(None) => return Err(VerbError::failed("the store's watch ended")),
            Ok(Some(Err(boxery_store::StoreError::TooOld { .. }))) => {
                // Compacted under us: re-check everything, then watch from now.
                watch = store.watch(None, store.revision().await?);
                recheck(store, &mut pending, until, progress).await?;
            }
            Ok(Some(Err(e))) => return Err(e.into()),
            Ok(Some(Ok((_, ev)))) => {
                let obj = match &ev {
                    boxery_store::WatchEvent::Added(o)
                    | boxery_store::WatchEvent::Modified(o)
                    | boxery_store::WatchEvent::Deleted(o) => o,
                };
                if pending
                    .iter()
                    .any(|t| t.kind == obj.kind && t.name == obj.metadata.name)
                {
                    if let Some(line) = changed(&mut shown, obj) {
                        progress.state(&line);
                    }
                    recheck(store, &mut pending, until, progress).await?;
                }
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
    }
}

/// Where an object stands, when that changed since it was last said (progress for long
/// waits).
fn changed(
    shown: &mut std::collections::HashMap<String, String>,
    obj: &DynObject,
) -> Option<String> {
    let (word, ready) = standing(obj);
    let msg = ready
        .and_then(|c| c["message"].as_str())
        .filter(|m| !m.is_empty())
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    let line = format!(
        "{}/{} {word}{msg}",
        obj.kind.to_lowercase(),
        obj.metadata.name
    );
    let key = format!("{}/{}", obj.kind, obj.metadata.name);
    if shown.get(&key) == Some(&line) {
        return None;
    }
    shown.insert(key, line.clone());
    Some(line)
}

async fn recheck(
    store: &dyn ObjectStore,
    pending: &mut Vec<ObjectRef>,
    until: &Until,
    progress: &dyn Progress,
) -> Result {
    let mut still = Vec::new();
    for t in pending.drain(..) {
        let obj = store.get(&t).await?;
        if holds(until, obj.as_ref())? {
            progress.met(&t);
        } else if let Some(why) = will_not_come(until, obj.as_ref()) {
            return Err(VerbError::failed(why));
        } else {
            still.push(t);
        }
    }
    *pending = still;
    Ok(())
}

fn describe_until(u: &Until) -> String {
    match u {
        Until::Deleted => "deletion".into(),
        Until::Condition(t, s) => format!("condition {t}={s}"),
        Until::JsonPath(p, v) => format!("{p} to be {v:?}"),
        Until::Exists(p) => format!("{p} to have a value"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guest whose console says it will not answer ends a wait for Ready at once; the same
    /// reason on an older generation, or any other reason, does not.
    #[test]
    fn a_ready_that_will_not_come_ends_the_wait() {
        let vm = |reason: &str, observed: i64| -> DynObject {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
                "metadata": {"name": "c2", "generation": 2},
                "spec": {},
                "status": {"conditions": [{"type": "Ready", "status": "False",
                    "reason": reason, "message": "cloud-init never ran",
                    "observedGeneration": observed}]}
            }))
            .unwrap()
        };
        let ready: Until = "condition=Ready".parse().unwrap();
        let why = will_not_come(&ready, Some(&vm("GuestNotAnswering", 2))).unwrap();
        assert!(
            why.contains("Vm c2 will not become Ready") && why.contains("cloud-init never ran"),
            "{why}"
        );
        assert_eq!(
            will_not_come(&ready, Some(&vm("GuestNotAnswering", 1))),
            None
        );
        assert_eq!(will_not_come(&ready, Some(&vm("Booting", 2))), None);
        assert_eq!(
            will_not_come(&Until::Deleted, Some(&vm("GuestNotAnswering", 2))),
            None
        );
        let not_ready: Until = "condition=Ready=false".parse().unwrap();
        assert_eq!(
            will_not_come(&not_ready, Some(&vm("GuestNotAnswering", 2))),
            None
        );
    }

    #[test]
    fn for_parses_as_kubectl_does() {
        let j = |p: &str, v: &str| Until::JsonPath(p.into(), v.into());
        let parse = |s: &str| s.parse::<Until>();
        assert_eq!(
            parse("jsonpath={.status.phase}=Stopped").unwrap(),
            j("{.status.phase}", "Stopped")
        );
        assert_eq!(
            parse("jsonpath=.status.phase=Stopped").unwrap(),
            j("{.status.phase}", "Stopped")
        );
        assert_eq!(
            parse("jsonpath={.status.phase}='Stopped'").unwrap(),
            j("{.status.phase}", "Stopped")
        );
        assert_eq!(
            parse("jsonpath={.status.vm}").unwrap(),
            Until::Exists("{.status.vm}".into())
        );
        assert_eq!(
            parse("jsonpath=.status.vm").unwrap(),
            Until::Exists("{.status.vm}".into())
        );
        assert!(parse("jsonpath={.status.phase").is_err());
        assert!(parse("jsonpath={.status.phase}x").is_err());
        assert!(parse("jsonpath=status=1").is_err());
        assert_eq!(
            parse("condition=ready").unwrap(),
            Until::Condition("ready".into(), ConditionStatus::True)
        );
    }

    #[test]
    fn timeouts_are_bounded_when_parsed() {
        assert_eq!(timeout_arg("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(timeout_arg("0s"), Ok(Duration::ZERO));
        assert_eq!(timeout_arg("7days"), Ok(MAX_WAIT));
        for bad in ["18446744073709551615s", "8days", "1000000000y"] {
            let e = timeout_arg(bad).unwrap_err();
            assert!(e.contains("out of range: use 0s to 7days"), "{bad}: {e}");
        }
        assert!(timeout_arg("soon").unwrap_err().contains("not a duration"));
        assert_eq!(tool_timeout_arg("30m"), Ok(Duration::from_secs(1800)));
        assert!(
            tool_timeout_arg("31m")
                .unwrap_err()
                .contains("use 0s to 30m")
        );
    }
}
