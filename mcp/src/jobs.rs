//! `vm_jobs`: [`boxery_verbs::guest::jobs`] with the session's VM, one action per call,
//! rendered as tool results.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult, clamp_timeout};
use boxery_verbs::VerbError;
use boxery_verbs::guest::jobs;

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobAction {
    /// Start `command` in the background; returns the job's id.
    Start,
    /// List the VM's jobs.
    List,
    /// A job's output (`offset` bytes on, or the last `tail_bytes`).
    Logs,
    /// Wait (bounded by `timeout_seconds`) until the job ends; returns its exit code.
    Wait,
    /// Kill the job's process group (TERM, then KILL).
    Kill,
}

/// `vm_jobs` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobsArgs {
    /// start, list, logs, wait or kill.
    pub action: JobAction,
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The job (logs, wait, kill).
    pub id: Option<String>,
    /// The command (start), run by `sh -c`.
    pub command: Option<String>,
    /// Working directory (start; default: the home).
    pub cwd: Option<String>,
    /// How long `wait` waits (default 60 s, at most 1800).
    pub timeout_seconds: Option<u64>,
    /// logs: the byte offset to read from (from a previous `next_offset`).
    pub offset: Option<u64>,
    /// logs: without `offset`, how many bytes from the end (default 64 KiB).
    pub tail_bytes: Option<u64>,
}

/// `vm_jobs`.
pub async fn jobs(session: Arc<Session>, a: JobsArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let v = session.verbs()?;
    let id = || {
        a.id.clone().filter(|i| !i.is_empty()).ok_or_else(|| {
            VerbError::invalid("give the job's `id` (vm_jobs {action: list} shows them)")
        })
    };
    match a.action {
        JobAction::Start => {
            let command = a.command.as_deref().unwrap_or_default();
            let s = jobs::start(v, &vm, command, a.cwd.as_deref(), &ct).await?;
            let (id, pid) = (&s.id, &s.pgid);
            Ok(Output::with_data(
                format!(
                    "started job {id} in {vm} (process group {pid}); vm_jobs {{action: wait, id: {id}}} waits for it, logs shows its output"
                ),
                json!({"vm": vm, "id": id, "pgid": pid.parse::<i64>().ok()}),
            ))
        }
        JobAction::List => {
            let l = jobs::list(v, &vm, &ct).await?;
            Ok(Output::of(l.table(), &l))
        }
        JobAction::Logs => {
            let tail = a.tail_bytes.unwrap_or(64 << 10);
            let l = jobs::logs(v, &vm, &id()?, a.offset, tail, &ct).await?;
            let note = if l.from > 0 && a.offset.is_none() {
                format!(
                    "[output from byte {} of {}; earlier bytes: offset 0]\n",
                    l.from, l.size
                )
            } else {
                String::new()
            };
            Ok(Output::of(format!("{note}{}", l.output), &l))
        }
        JobAction::Wait | JobAction::Kill => {
            let id = id()?;
            let e = if a.action == JobAction::Wait {
                jobs::wait(v, &vm, &id, clamp_timeout(a.timeout_seconds, 60), &ct).await?
            } else {
                jobs::kill(v, &vm, &id, &ct).await?
            };
            Ok(Output::with_data(
                e.text(),
                json!({"vm": vm, "id": id, "state": e.state, "exit_code": e.exit_code, "output_bytes": e.output_bytes}),
            ))
        }
    }
}
