//! `vm_bash`: [`boxery_verbs::guest::exec::bash`] with the session's VM, its result rendered
//! as a tool result; `vm_prompt`: [`boxery_verbs::guest::prompt::prompt`] the same way.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult, clamp_timeout};
use boxery_verbs::guest::{exec, prompt};

/// `vm_bash` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BashArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The shell command (run by the user's login shell, bash in boxery images; pipes, `&&` and redirections work).
    pub command: String,
    /// The working directory (default: the user's home).
    pub cwd: Option<String>,
    /// Seconds before the command's process group is killed (default 120, at most 1800).
    pub timeout_seconds: Option<u64>,
}

/// `vm_bash`.
pub async fn bash(session: Arc<Session>, a: BashArgs, ct: CancellationToken) -> ToolResult {
    let input = exec::Bash {
        vm: session.resolve_vm(a.vm).await?,
        command: a.command,
        cwd: a.cwd,
        timeout: clamp_timeout(a.timeout_seconds, 120),
    };
    let ran = exec::bash(session.verbs()?, &input, &ct).await?;
    Ok(Output::of(ran.text(), &ran))
}

/// `vm_prompt` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptArgs {
    /// The VM (default: the session's VM).
    pub vm: Option<String>,
    /// The agent in the VM: claude (default), codex or opencode.
    #[serde(default)]
    pub agent: prompt::Agent,
    /// The prompt, passed to the agent as it is (at most 100 KiB).
    pub prompt: String,
    /// Seconds before the agent and everything it started are killed (default 600, at most 1800).
    pub timeout_seconds: Option<u64>,
}

/// `vm_prompt`.
pub async fn prompt(session: Arc<Session>, a: PromptArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm).await?;
    let timeout = clamp_timeout(a.timeout_seconds, 600);
    let ran = prompt::prompt(session.verbs()?, &vm, a.agent, &a.prompt, timeout, &ct).await?;
    Ok(Output::of(ran.text(), &ran))
}
