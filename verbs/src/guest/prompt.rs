//! A coding agent in the guest, run headless on a prompt (`boxery prompt`, `vm_prompt`), or its
//! terminal session (`boxery attach`). The agents come with the `agents` layer
//! (`boxery images layers`); they reach their providers through the credential proxy with the
//! VM's token, from the variables the VM's `llm` grants push (`ANTHROPIC_BASE_URL`,
//! `OPENAI_BASE_URL` and their keys) and the agents' settings pushed with them (codex's
//! provider, opencode's: `boxery_reconcilers::guest::agents`), so no real key is ever in the
//! guest.
//!
//! Guarantees: the prompt reaches the agent as one argument, quoted for the remote shell
//! (never interpreted by it), after `--` (a prompt that starts with `-` is not an option);
//! a prompt over [`MAX_PROMPT`] bytes, or with a NUL, is refused before anything runs; an agent
//! that is not in the guest is a clear error (exit 127) that names the layer.

use std::time::Duration;

use boxery_hands::shell_quote;
use tokio_util::sync::CancellationToken;

use super::exec::{self, BashRun};
use crate::{Result, VerbError, Verbs};

/// The longest prompt passed (one argument: Linux caps one at 128 KiB).
pub const MAX_PROMPT: usize = 100 * 1024;

/// The tmux session `boxery attach` opens or rejoins.
pub const SESSION: &str = "agent";

/// A coding agent the `agents` layer installs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Agent {
    /// Claude Code (`claude -p`).
    #[default]
    Claude,
    /// OpenAI's Codex CLI (`codex exec`).
    Codex,
    /// opencode (`opencode run`).
    Opencode,
}

impl std::str::FromStr for Agent {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Agent, String> {
        match s {
            "claude" => Ok(Agent::Claude),
            "codex" => Ok(Agent::Codex),
            "opencode" => Ok(Agent::Opencode),
            _ => Err(format!(
                "no agent `{}`: claude, codex or opencode",
                boxery_api::name::shown(s)
            )),
        }
    }
}

impl Agent {
    /// The names an agent is given by.
    pub const NAMES: [&'static str; 3] = ["claude", "codex", "opencode"];

    /// Its command.
    pub fn program(self) -> &'static str {
        match self {
            Agent::Claude => "claude",
            Agent::Codex => "codex",
            Agent::Opencode => "opencode",
        }
    }

    /// Its headless form, before the prompt. The VM is the sandbox: the agents' own approval
    /// prompts and sandboxes are off (nobody is there to answer them).
    fn headless(self) -> &'static str {
        match self {
            Agent::Claude => "claude -p --dangerously-skip-permissions",
            Agent::Codex => {
                "codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox"
            }
            Agent::Opencode => "opencode run",
        }
    }

    /// Its interactive form (`attach`).
    fn interactive(self) -> &'static str {
        match self {
            Agent::Claude => "claude --dangerously-skip-permissions",
            Agent::Codex => "codex --dangerously-bypass-approvals-and-sandbox",
            Agent::Opencode => "opencode",
        }
    }
}

/// What every agent line starts with: the layer's settings, the home directory, and a clear
/// refusal when the agent is not there.
fn preamble(agent: Agent) -> String {
    let p = agent.program();
    format!(
        "[ -r /etc/profile.d/boxery-agents.sh ] && . /etc/profile.d/boxery-agents.sh; cd ~ || exit 1; \
         command -v {p} >/dev/null 2>&1 || {{ printf '%s\\n' 'boxery: {p} is not in this VM: make its image with the agents layer (an Image with spec.source.build: {{base: debian-12, layers: [agents]}}; boxery images layers)' >&2; exit 127; }}; "
    )
}

/// Check a prompt before anything runs.
pub fn check(text: &str) -> Result {
    if text.trim().is_empty() {
        return Err(VerbError::invalid(
            "give a prompt: boxery prompt VM \"TEXT\" (or - to read it from stdin)",
        ));
    }
    if text.len() > MAX_PROMPT {
        return Err(VerbError::invalid(format!(
            "the prompt is {} bytes: at most {MAX_PROMPT} (put a long brief in a file in the VM and point the agent at it)",
            text.len()
        )));
    }
    if text.contains('\0') {
        return Err(VerbError::invalid("the prompt contains a NUL byte"));
    }
    Ok(())
}

/// The remote line that runs `agent` headless on `text` (checked with [`check`]). Its stdin is
/// `/dev/null`: the agents read a piped stdin to its end as more prompt (ssh's would never end).
pub fn line(agent: Agent, text: &str) -> String {
    format!(
        "{}exec {} -- {} </dev/null",
        preamble(agent),
        agent.headless(),
        shell_quote(text)
    )
}

/// The remote line that opens (or rejoins) the agent's tmux session.
pub fn attach_line(agent: Agent) -> String {
    format!(
        "{}exec tmux new-session -A -s {SESSION} {}",
        preamble(agent),
        shell_quote(agent.interactive())
    )
}

/// `vm_prompt`: run `agent` on `text` in VM `vm`, bounded by `timeout` (everything it started
/// is killed then), its output captured.
pub async fn prompt(
    v: &Verbs,
    vm: &str,
    agent: Agent,
    text: &str,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<BashRun> {
    check(text)?;
    let input = exec::Bash {
        vm: vm.to_string(),
        command: line(agent, text),
        cwd: None,
        timeout,
    };
    let doing = v.doing(
        "prompt",
        Some(vm),
        format!("{}: {text}", format!("{agent:?}").to_lowercase()),
    );
    let r = exec::bash_unrecorded(v, &input, ct).await;
    match &r {
        Ok(run) => doing.done(format!("exit {}", run.exit_code), None),
        Err(_) => doing.ended(&r, None),
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_is_one_quoted_argument_after_the_options() {
        let l = line(Agent::Claude, "-rf $(reboot) 'x'; echo `id`");
        assert!(
            l.ends_with(r#"exec claude -p --dangerously-skip-permissions -- '-rf $(reboot) '\''x'\''; echo `id`' </dev/null"#),
            "{l}"
        );
        // run by a real shell, the agent gets exactly the text
        let probe = line(Agent::Codex, "a 'b' $c \"d\"\n e").replace(
            "exec codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --",
            "printf '%s' ",
        );
        let probe = probe.replace("command -v codex", "command -v printf");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&probe)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a 'b' $c \"d\"\n e");
    }

    /// The agents read a piped stdin as more prompt, to its end: theirs is `/dev/null`, not the
    /// ssh channel (which would hold `codex exec` until the caller closed its own stdin).
    #[test]
    fn the_agent_reads_no_stdin() {
        use std::io::Write;
        let l = line(Agent::Codex, "the prompt")
            .replace(
                "exec codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox",
                "exec sh -c 'cat; printf %s \"$2\"' sh",
            )
            .replace("command -v codex", "command -v sh");
        let mut c = std::process::Command::new("sh")
            .arg("-c")
            .arg(&l)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // (a broken pipe is the line not reading it)
        let _ = c.stdin.take().unwrap().write_all(b"from stdin\n");
        let out = c.wait_with_output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "the prompt");
    }

    #[test]
    fn a_missing_agent_says_which_layer_brings_it() {
        let l = line(Agent::Opencode, "hi")
            .replace("command -v opencode", "command -v no-such-program-x");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&l)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(127));
        assert!(String::from_utf8_lossy(&out.stderr).contains("agents layer"));
    }

    #[test]
    fn bad_prompts_are_refused_before_anything_runs() {
        for bad in ["", "  \n", "a\0b"] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
        assert!(check(&"x".repeat(MAX_PROMPT + 1)).is_err());
        assert!(check("fix the failing test").is_ok());
    }
}
