//! Fault injection for the fake backend, configured from outside the process.
//!
//! The configuration comes from two places, both read on every step:
//! - `faults.json` in the fake's state dir (write it atomically: temp file + rename;
//!   [`super::FakeBackend::set_faults`] does), and
//! - the environment variable `BOXERY_FAKE_FAULTS` (read once, when the backend is made).
//!
//! When both are present their rules are concatenated (environment first) and the larger
//! `latencyMs` applies. See `docs/backends.md` for the format.
//!
//! # Guarantees
//! - Call counters live in `fault-counters.json`, updated under an exclusive lock on
//!   `fault-counters.lock`, so they survive a killed process and are shared by every process
//!   using the dir. They reset whenever the effective configuration changes (its content, or
//!   the mtime of `faults.json`, so rewriting the same file also resets them).
//! - Only steps named by some rule are counted; the others cost one small file read.
//! - An invalid configuration (bad JSON, unknown field, unknown step) fails every step with a
//!   message naming the problem, rather than silently injecting nothing.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{BackendError, Result};

/// The environment variable holding a fault configuration (the same JSON as `faults.json`).
pub const FAULTS_ENV: &str = "BOXERY_FAKE_FAULTS";
/// The fault configuration file in the fake's state dir.
pub const FAULTS_FILE: &str = "faults.json";
/// The persistent call counters.
pub const COUNTERS_FILE: &str = "fault-counters.json";
const COUNTERS_LOCK: &str = "fault-counters.lock";

/// Every step a rule may name. A rule names exactly one step: `create` is the entry of the
/// `create` operation (before anything, validation included), not a wildcard for `create.*`.
pub const STEPS: &[&str] = &[
    "check",
    "init",
    "create",
    "create.begin",
    "create.disk",
    "create.commit",
    "create.done",
    "get",
    "list",
    "ssh_endpoint",
    "usage",
    "start",
    "stop",
    "repair",
    "suspend",
    "resize",
    "remove",
    "remove.done",
    "capture",
    "capture.begin",
    "capture.copy",
    "capture.commit",
    "capture.done",
    "images",
    "remove_image",
    "remove_image.done",
    "reimage",
    "reimage.stage",
    "reimage.swap",
    "reimage.done",
    "build",
    "build.commit",
    "build.done",
    "import",
    "import.commit",
    "import.done",
    "cleanup_new",
    "cleanup_image",
    "recover_capture",
];

/// A fault configuration: what `faults.json` and `BOXERY_FAKE_FAULTS` hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultConfig {
    /// Milliseconds to sleep before every step.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub latency_ms: u64,
    /// The rules, tried in order; the first that matches a call fires.
    #[serde(default)]
    pub rules: Vec<FaultRule>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One rule: at `step`, on some of its calls, do `action`.
///
/// Calls of a step are counted from 1 since the configuration last changed. The rule fires
/// on calls `nth ..= nth + times - 1`: with neither field on every call, with only `nth` on
/// that one call, with only `times` on the first `times` calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultRule {
    /// The step (one of [`STEPS`]).
    pub step: String,
    /// The first call it fires on (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nth: Option<u64>,
    /// How many calls it fires on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u64>,
    /// What happens.
    pub action: FaultAction,
    /// For `sleep`: how long, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ms: Option<u64>,
}

/// What a firing rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultAction {
    /// Return `BackendError::Failed` (in `reimage` before the swap: `BackendError::Unchanged`).
    Fail,
    /// Return `BackendError::Unreachable`.
    Unreachable,
    /// Never return (the test kills the process or drops the future).
    Hang,
    /// `std::process::exit(137)` right there: a crash inside the step.
    Exit,
    /// Sleep `ms` milliseconds, then carry on.
    Sleep,
}

impl FaultRule {
    /// A rule firing `action` on every call of `step`.
    pub fn new(step: impl Into<String>, action: FaultAction) -> Self {
        FaultRule {
            step: step.into(),
            nth: None,
            times: None,
            action,
            ms: None,
        }
    }
    /// Fire only from the `n`-th call (and, without `times`, only on it).
    pub fn nth(mut self, n: u64) -> Self {
        self.nth = Some(n);
        self
    }
    /// Fire on `n` calls.
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }
    /// The sleep length for [`FaultAction::Sleep`].
    pub fn ms(mut self, ms: u64) -> Self {
        self.ms = Some(ms);
        self
    }

    /// Whether the rule fires on call `call` (1-based) of its step.
    pub fn fires_on(&self, call: u64) -> bool {
        let first = self.nth.unwrap_or(1);
        match (self.nth, self.times) {
            (None, None) => true,
            (Some(_), None) => call == first,
            (_, Some(times)) => call >= first && call - first < times,
        }
    }
}

impl FaultConfig {
    /// A configuration with these rules.
    pub fn rules(rules: impl IntoIterator<Item = FaultRule>) -> Self {
        FaultConfig {
            latency_ms: 0,
            rules: rules.into_iter().collect(),
        }
    }

    /// Parse and validate JSON.
    pub fn parse(json: &str) -> Result<Self, String> {
        let config: FaultConfig = serde_json::from_str(json).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    /// Check every rule names a known step and makes sense.
    pub fn validate(&self) -> Result<(), String> {
        for (i, rule) in self.rules.iter().enumerate() {
            if !STEPS.contains(&rule.step.as_str()) {
                return Err(format!(
                    "rule {i}: unknown step `{}`; steps are: {}",
                    rule.step,
                    STEPS.join(", ")
                ));
            }
            if rule.nth == Some(0) {
                return Err(format!("rule {i}: `nth` counts calls from 1"));
            }
            if rule.action == FaultAction::Sleep && rule.ms.is_none() {
                return Err(format!("rule {i}: action `sleep` needs `ms`"));
            }
            if rule.action != FaultAction::Sleep && rule.ms.is_some() {
                return Err(format!("rule {i}: `ms` is only for action `sleep`"));
            }
        }
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.latency_ms == 0 && self.rules.is_empty()
    }
}

/// What a step should do, decided by [`Faults::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Carry on.
    Proceed,
    /// A rule fired: the action, the rule's index and the call number.
    Fire {
        action: FaultAction,
        rule: usize,
        call: u64,
        ms: u64,
    },
}

/// The fault injector of one fake backend.
#[derive(Debug)]
pub(crate) struct Faults {
    dir: PathBuf,
    env: Result<Option<FaultConfig>, String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Counters {
    config: String,
    counts: BTreeMap<String, u64>,
}

impl Faults {
    /// The injector for state dir `dir`, with the environment's configuration.
    pub(crate) fn new(dir: PathBuf) -> Self {
        let env = match std::env::var(FAULTS_ENV) {
            Ok(json) if !json.trim().is_empty() => FaultConfig::parse(&json).map(Some),
            _ => Ok(None),
        };
        Faults { dir, env }
    }

    /// The effective configuration and its identity (changes reset the counters).
    fn load(&self) -> Result<(FaultConfig, String), String> {
        let env = match &self.env {
            Ok(c) => c.clone(),
            Err(e) => {
                return Err(format!(
                    "{FAULTS_ENV} is not a valid fault configuration: {e}"
                ));
            }
        };
        let path = self.dir.join(FAULTS_FILE);
        let file = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let mtime = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let config = FaultConfig::parse(&text).map_err(|e| {
                    format!("{} is not a valid fault configuration: {e}", path.display())
                })?;
                Some((config, mtime))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let mut effective = env.unwrap_or_default();
        let mut mtime = 0;
        if let Some((config, t)) = file {
            effective.latency_ms = effective.latency_ms.max(config.latency_ms);
            effective.rules.extend(config.rules);
            mtime = t;
        }
        let identity = if effective.is_empty() {
            String::new()
        } else {
            format!(
                "{}@{mtime}",
                serde_json::to_string(&effective).unwrap_or_default()
            )
        };
        Ok((effective, identity))
    }

    /// Sleep the latency, count the call if a rule names `step`, and decide.
    pub(crate) async fn check(&self, step: &str) -> Result<Decision> {
        debug_assert!(STEPS.contains(&step), "step `{step}` missing from STEPS");
        let (config, identity) = self.load().map_err(|e| BackendError::failed(step, e))?;
        if config.is_empty() {
            return Ok(Decision::Proceed);
        }
        if config.latency_ms > 0 {
            tokio::time::sleep(Duration::from_millis(config.latency_ms)).await;
        }
        if !config.rules.iter().any(|r| r.step == step) {
            return Ok(Decision::Proceed);
        }
        let call = self.bump(step, &identity)?;
        for (i, rule) in config.rules.iter().enumerate() {
            if rule.step == step && rule.fires_on(call) {
                return Ok(Decision::Fire {
                    action: rule.action,
                    rule: i,
                    call,
                    ms: rule.ms.unwrap_or(0),
                });
            }
        }
        Ok(Decision::Proceed)
    }

    /// Increment `step`'s counter under the lock; returns the new count.
    fn bump(&self, step: &str, identity: &str) -> Result<u64> {
        self.with_counters(|counters| {
            if counters.config != identity {
                *counters = Counters {
                    config: identity.to_string(),
                    counts: BTreeMap::new(),
                };
            }
            let n = counters.counts.entry(step.to_string()).or_insert(0);
            *n += 1;
            *n
        })
    }

    /// Run `f` on the counters under the exclusive lock and save them.
    fn with_counters<T>(&self, f: impl FnOnce(&mut Counters) -> T) -> Result<T> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| BackendError::io(format!("cannot create {}", self.dir.display()), e))?;
        let lock_path = self.dir.join(COUNTERS_LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| BackendError::io(format!("cannot open {}", lock_path.display()), e))?;
        lock.lock()
            .map_err(|e| BackendError::io(format!("cannot lock {}", lock_path.display()), e))?;
        let path = self.dir.join(COUNTERS_FILE);
        let mut counters = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Err(e) if e.kind() == ErrorKind::NotFound => Counters::default(),
            Err(e) => {
                return Err(BackendError::io(
                    format!("cannot read {}", path.display()),
                    e,
                ));
            }
        };
        let out = f(&mut counters);
        let bytes = serde_json::to_vec(&counters).expect("counters serialize");
        super::fsutil::write_atomic(&path, &bytes)?;
        drop::<File>(lock);
        Ok(out)
    }

    /// Forget every count.
    pub(crate) fn reset(&self) -> Result<()> {
        self.with_counters(|c| *c = Counters::default())
    }

    /// The current counts (of steps some rule names), as of the current configuration.
    pub(crate) fn counts(&self) -> Result<BTreeMap<String, u64>> {
        let identity = self.load().map(|(_, id)| id).unwrap_or_default();
        let path = self.dir.join(COUNTERS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => {
                let c: Counters = serde_json::from_slice(&bytes).unwrap_or_default();
                Ok(if c.config == identity {
                    c.counts
                } else {
                    BTreeMap::new()
                })
            }
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(BackendError::io(
                format!("cannot read {}", path.display()),
                e,
            )),
        }
    }

    /// Write `faults.json` atomically and reset the counters.
    pub(crate) fn set(&self, config: &FaultConfig) -> Result<()> {
        config.validate().map_err(BackendError::Invalid)?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| BackendError::io(format!("cannot create {}", self.dir.display()), e))?;
        let bytes = serde_json::to_vec_pretty(config).expect("fault config serializes");
        super::fsutil::write_atomic(&self.dir.join(FAULTS_FILE), &bytes)?;
        self.reset()
    }

    /// Remove `faults.json` and reset the counters (the environment's rules stay).
    pub(crate) fn clear(&self) -> Result<()> {
        let path = self.dir.join(FAULTS_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                return Err(BackendError::io(
                    format!("cannot remove {}", path.display()),
                    e,
                ));
            }
        }
        self.reset()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows() {
        let always = FaultRule::new("create", FaultAction::Fail);
        assert!((1..10).all(|c| always.fires_on(c)));
        let third = FaultRule::new("create", FaultAction::Fail).nth(3);
        assert_eq!(
            (1..6).filter(|c| third.fires_on(*c)).collect::<Vec<_>>(),
            vec![3]
        );
        let first_two = FaultRule::new("create", FaultAction::Fail).times(2);
        assert_eq!(
            (1..6)
                .filter(|c| first_two.fires_on(*c))
                .collect::<Vec<_>>(),
            vec![1, 2]
        );
        let window = FaultRule::new("create", FaultAction::Fail).nth(3).times(2);
        assert_eq!(
            (1..8).filter(|c| window.fires_on(*c)).collect::<Vec<_>>(),
            vec![3, 4]
        );
    }

    #[test]
    fn parses_the_documented_format() {
        let c = FaultConfig::parse(
            r#"{"latencyMs": 5, "rules": [{"step": "create", "nth": 3, "action": "fail"},
                {"step": "capture.copy", "nth": 1, "action": "hang"},
                {"step": "start", "times": 2, "action": "fail"},
                {"step": "list", "action": "unreachable"},
                {"step": "create.commit", "action": "exit"},
                {"step": "get", "action": "sleep", "ms": 10}]}"#,
        )
        .unwrap();
        assert_eq!(c.latency_ms, 5);
        assert_eq!(c.rules.len(), 6);
        assert_eq!(
            c.rules[1],
            FaultRule::new("capture.copy", FaultAction::Hang).nth(1)
        );
    }

    #[test]
    fn rejects_typos() {
        assert!(
            FaultConfig::parse(r#"{"rules": [{"step": "create.copy", "action": "fail"}]}"#)
                .unwrap_err()
                .contains("unknown step `create.copy`")
        );
        assert!(
            FaultConfig::parse(r#"{"rules": [{"step": "create", "nht": 1, "action": "fail"}]}"#)
                .is_err()
        );
        assert!(
            FaultConfig::parse(r#"{"rules": [{"step": "create", "action": "explode"}]}"#).is_err()
        );
        assert!(
            FaultConfig::parse(r#"{"rules": [{"step": "create", "action": "sleep"}]}"#).is_err()
        );
        assert!(
            FaultConfig::parse(r#"{"rules": [{"step": "create", "nth": 0, "action": "fail"}]}"#)
                .is_err()
        );
    }
}
