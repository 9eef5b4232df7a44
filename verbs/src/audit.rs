//! The audit of what people and agents did (docs/observability.md, "Audit"):
//! `$BOXERY_HOME/audit/actions.log`, one JSON line per action, appended by whichever process
//! acts on this home (a command, `boxery mcp`, `serve`'s API) through a
//! [`boxery_home::journal::Journal`] (rotated at 64 MiB or 30 days, [`KEEP`] old files kept).
//!
//! Recorded: commands run in a VM (`run`, `vm_bash`, jobs, `prompt`), shell sessions (`ssh`,
//! and the API's `connect`) with their end, copies and file reads, writes and edits (paths
//! and byte counts, never contents), every MCP tool call, and every write through the API.
//! Each line says who (`user:NAME`, `mcp:NAME`, `token:NAME`), through what (`cli`, `mcp`,
//! `api`), what (the command text as given, the paths, the tool, the object), on which VM,
//! when, how it ended and how long it took. A grant's value is never part of any of these.
//!
//! # Guarantees
//! - A line is one JSON object: nothing an agent or a guest controls (a command, a path, a
//!   name) can break a line or forge one ([`boxery_home::journal`]).
//! - Recording never fails an action: a log that cannot be written is said in the log.
//!
//! # Caveats
//! - Only actions on this home's own VMs are recorded here; a command on another machine's
//!   control plane (a context) is recorded there, by its API (`connect`, its writes).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Verbs, Voice};

/// The size at which the actions log is rotated: 64 MiB.
pub const MAX_BYTES: u64 = 64 * 1024 * 1024;
/// The age at which it is rotated: 30 days.
pub const MAX_AGE: Duration = Duration::from_secs(30 * 86400);
/// Rotated files kept: with [`MAX_BYTES`], 640 MiB of history at most.
pub const KEEP: u32 = 9;
/// The longest `what` kept whole; a longer one is cut, with its length and a hash of it all, so
/// that a flood of huge commands cannot push the history out quickly.
pub const WHAT_MAX: usize = 4096;

/// One action, as a line of the log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Action {
    /// When it ended (RFC 3339, UTC, milliseconds).
    pub time: String,
    /// Who: `user:NAME` (a person at the CLI), `mcp:NAME` (an agent's MCP session, run by
    /// that user), `token:NAME` (an API token).
    pub who: String,
    /// Through what: `cli`, `mcp` or `api`.
    pub via: String,
    /// What kind of action: `run`, `bash`, `job`, `prompt`, `ssh`, `ssh-end`, `connect`,
    /// `cp`, `read`, `write`, `edit`, `tool`, or an API write (`create`, `update`, `patch`,
    /// `delete`, `post`).
    pub action: String,
    /// The VM it acted on, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// What: the command as given, the paths, the tool's name, the API path.
    pub what: String,
    /// How it ended: `exit N`, `ok`, `HTTP 201`, or `error: …`.
    pub result: String,
    /// Bytes moved (a copy, a file), when it moved any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Milliseconds it took.
    pub ms: u64,
}

/// The journal of each home this process acts on.
fn journal(home: &Path) -> Arc<boxery_home::journal::Journal> {
    static JOURNALS: OnceLock<Mutex<HashMap<PathBuf, Arc<boxery_home::journal::Journal>>>> =
        OnceLock::new();
    let mut all = JOURNALS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    all.entry(home.to_path_buf())
        .or_insert_with(|| {
            Arc::new(boxery_home::journal::Journal::keeping(
                boxery_home::layout::actions_log(home),
                MAX_BYTES,
                MAX_AGE,
                KEEP,
            ))
        })
        .clone()
}

/// An action under way: recorded by [`Doing::done`] with its result and duration.
#[derive(Debug)]
pub struct Doing<'a> {
    v: &'a Verbs,
    action: &'static str,
    vm: Option<String>,
    what: String,
    started: Instant,
}

/// The actions that may run long or be cut short (a command, a session): their start is a
/// line of its own (`result: started`), so a kill before they end still leaves their trace.
const STARTED: &[&str] = &["run", "bash", "prompt", "job"];

/// `what`, cut to at most [`WHAT_MAX`] bytes (on a character boundary) with its whole length
/// and a SHA-256 of it when longer.
fn bounded(what: String) -> String {
    if what.len() <= WHAT_MAX {
        return what;
    }
    // room for the note, so that the whole stays within WHAT_MAX (and bounding it again
    // changes nothing)
    let mut cut = WHAT_MAX - 80;
    while !what.is_char_boundary(cut) {
        cut -= 1;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(what.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}… [{} bytes in all, sha256 {hex}…]",
        &what[..cut],
        what.len()
    )
}

impl Verbs {
    /// Start recording `action` on `vm` (`what`: the command as given, the paths, …); a
    /// command or a session is recorded as started at once.
    pub fn doing(
        &self,
        action: &'static str,
        vm: Option<&str>,
        what: impl Into<String>,
    ) -> Doing<'_> {
        let d = Doing {
            v: self,
            action,
            vm: vm.map(str::to_string),
            what: bounded(what.into()),
            started: Instant::now(),
        };
        if STARTED.contains(&action) {
            self.record(Action {
                action: action.into(),
                vm: d.vm.clone(),
                what: d.what.clone(),
                result: "started".into(),
                ..Action::default()
            });
        }
        d
    }

    /// Who acts through these verbs, as the audit names them.
    pub fn actor(&self) -> String {
        if let Some(a) = &self.actor {
            return a.clone();
        }
        let user = crate::grants::os_user();
        match self.voice {
            Voice::Cli => format!("user:{user}"),
            Voice::Tool => format!("mcp:{user}"),
        }
    }

    /// The same verbs, acting for `actor` (`token:NAME`) through `via` (`api`).
    pub fn acting_for(&self, actor: &str, via: &'static str) -> Verbs {
        Verbs {
            actor: Some(actor.to_string()),
            via: Some(via),
            ..self.clone()
        }
    }

    fn via(&self) -> &'static str {
        self.via.unwrap_or(match self.voice {
            Voice::Cli => "cli",
            Voice::Tool => "mcp",
        })
    }

    /// Record a finished action (only for this home's own VMs: a context's control plane
    /// records its own).
    pub fn record(&self, mut a: Action) {
        if self.home_store.is_none() {
            return;
        }
        if a.who.is_empty() {
            a.who = self.actor();
        }
        if a.via.is_empty() {
            a.via = self.via().to_string();
        }
        if a.time.is_empty() {
            a.time = now();
        }
        a.what = bounded(std::mem::take(&mut a.what));
        a.result = bounded(std::mem::take(&mut a.result));
        journal(&self.env.home).append(&a);
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Doing<'_> {
    /// Record it, ended with `result` (`exit 0`, `ok`, `error: …`) having moved `bytes`.
    pub fn done(self, result: impl Into<String>, bytes: Option<u64>) {
        self.v.record(Action {
            action: self.action.into(),
            vm: self.vm,
            what: self.what,
            result: result.into(),
            bytes,
            ms: self.started.elapsed().as_millis() as u64,
            ..Action::default()
        });
    }

    /// Record it with the outcome of `r`: `ok`, or the error.
    pub fn ended<T>(self, r: &crate::Result<T>, bytes: Option<u64>) {
        let result = match r {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("error: {}", e.chain()),
        };
        self.done(result, bytes);
    }
}

/// What `boxery audit` shows.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only actions on this VM.
    pub vm: Option<String>,
    /// Only actions by someone whose `who` is this, or ends in `:` and this.
    pub who: Option<String>,
    /// Only actions that ended after this time.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
}

/// The actions of `home` that pass `f`, oldest first (the rotated file's, then the current's);
/// lines that do not read as actions are skipped.
pub fn read(home: &Path, f: &Filter) -> Vec<Action> {
    journal(home)
        .lines()
        .iter()
        .filter_map(|l| serde_json::from_str::<Action>(l).ok())
        .filter(|a| f.vm.as_ref().is_none_or(|vm| a.vm.as_ref() == Some(vm)))
        .filter(|a| {
            f.who
                .as_ref()
                .is_none_or(|w| a.who == *w || a.who.split_once(':').is_some_and(|(_, n)| n == w))
        })
        .filter(|a| {
            f.since
                .is_none_or(|s| chrono::DateTime::parse_from_rfc3339(&a.time).is_ok_and(|t| t >= s))
        })
        .collect()
}
