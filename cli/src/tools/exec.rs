//! Running commands in a VM over OpenSSH (the generated ssh_config: pinned host key, one
//! ControlMaster per VM), with bounded output and time, and `vm_bash`.
//!
//! A `vm_bash` command runs in the remote login shell that sshd starts for the call, with no
//! extra process on the common path: sshd makes that shell a session and process-group
//! leader, so the shell and everything it starts form one group. The wrapper's first stderr
//! line names the group (`boxery-pgid N`; [`run`] strips it). On timeout or cancellation a
//! second ssh call kills that whole group (TERM, then KILL a second later), so nothing is left
//! running in the guest when the call returns. If the shell is not a group leader (an sshd
//! that does not `setsid`), the wrapper first `exec`s `setsid`, which makes it one in place.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{OUTPUT_CAP, Output, Session, ToolError, ToolResult, clamp_timeout};
use crate::hands::{Reach, shell_quote};

/// A path for the remote shell: `~` and `~/…` expand to the home, the rest is quoted.
pub fn qpath(p: &str) -> String {
    if p == "~" {
        "\"$HOME\"".into()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("\"$HOME\"/{}", shell_quote(rest))
    } else {
        shell_quote(p)
    }
}

/// What a remote command did.
#[derive(Debug, Default)]
pub struct Ran {
    /// Its stdout (up to the cap).
    pub stdout: Vec<u8>,
    /// Its stderr (up to the cap).
    pub stderr: Vec<u8>,
    /// Bytes dropped over the cap.
    pub dropped: u64,
    /// Its exit code (`None`: killed, timed out or cancelled).
    pub code: Option<i32>,
    /// It ran out of time.
    pub timed_out: bool,
    /// The caller cancelled it.
    pub cancelled: bool,
}

/// The first stderr line of a [`bash_script`]: the process group to kill.
const PGID_MARK: &[u8] = b"boxery-pgid ";

/// Reading a stderr that may start with a [`PGID_MARK`] line.
#[derive(Debug, Default)]
struct ErrHead {
    /// Bytes of the first line read so far.
    head: Vec<u8>,
    /// The first line was handled (or there is none to look for).
    done: bool,
    /// The group it named.
    pgid: Option<u32>,
}

impl ErrHead {
    /// Take `data`; returns what belongs to the command's stderr.
    fn take<'a>(&mut self, data: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        if self.done {
            return data.into();
        }
        self.head.extend_from_slice(data);
        if let Some(nl) = self.head.iter().position(|b| *b == b'\n') {
            self.done = true;
            let line = &self.head[..nl];
            if let Some(n) = line.strip_prefix(PGID_MARK) {
                self.pgid = std::str::from_utf8(n)
                    .ok()
                    .and_then(|n| n.trim().parse().ok());
                return self.head[nl + 1..].to_vec().into();
            }
            return std::mem::take(&mut self.head).into();
        }
        let could_be = PGID_MARK.starts_with(&self.head[..self.head.len().min(PGID_MARK.len())]);
        if !could_be || self.head.len() > 64 {
            self.done = true;
            return std::mem::take(&mut self.head).into();
        }
        Vec::new().into()
    }
}

async fn drain(
    r: &mut (impl AsyncRead + Unpin),
    buf: &mut Vec<u8>,
    budget: &std::sync::atomic::AtomicUsize,
    mut head: Option<&mut ErrHead>,
    until_pgid: bool,
) -> u64 {
    use std::sync::atomic::Ordering;
    let mut dropped = 0u64;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        if until_pgid && head.as_ref().is_none_or(|h| h.done) {
            return dropped;
        }
        let n = match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return dropped,
            Ok(n) => n,
        };
        let data = match head.as_deref_mut() {
            Some(h) => h.take(&chunk[..n]),
            None => (&chunk[..n]).into(),
        };
        let n = data.len();
        let left = budget.load(Ordering::Relaxed);
        let take = n.min(left);
        budget.fetch_sub(take, Ordering::Relaxed);
        buf.extend_from_slice(&data[..take]);
        dropped += (n - take) as u64;
    }
}

/// Run `script` in the VM (by the login shell, via ssh) with optional stdin, bounded by
/// `timeout` and `cap` bytes of output (stdout and stderr together). With `kill_group`, the
/// script is a [`bash_script`]: its first stderr line names its process group, which is
/// killed (best effort) when the call times out or is cancelled.
pub(crate) async fn run(
    ssh: &Reach,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
    kill_group: bool,
) -> Result<Ran, ToolError> {
    let vm = ssh.vm();
    let mut c = ssh.command();
    c.args(["-T", "-o", "BatchMode=yes", "--", script])
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = c.spawn().map_err(|e| {
        ToolError::Failed(format!(
            "cannot run ssh (is openssh-client installed?): {e}"
        ))
    })?;
    let writer = match (stdin, child.stdin.take()) {
        (Some(data), Some(mut w)) => Some(tokio::spawn(async move {
            let r = w.write_all(&data).await;
            drop(w);
            r
        })),
        _ => None,
    };
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let budget = std::sync::atomic::AtomicUsize::new(cap);
    let mut ran = Ran::default();
    let (mut so, mut se) = (Vec::new(), Vec::new());
    let mut head = ErrHead {
        done: !kill_group,
        ..Default::default()
    };
    let io = async {
        let (a, b) = tokio::join!(
            drain(&mut out, &mut so, &budget, None, false),
            drain(&mut err, &mut se, &budget, Some(&mut head), false)
        );
        let status = child.wait().await;
        (a + b, status)
    };
    let outcome = tokio::select! {
        r = io => Some(r),
        _ = tokio::time::sleep(timeout) => { ran.timed_out = true; None }
        _ = ct.cancelled() => { ran.cancelled = true; None }
    };
    match outcome {
        Some((dropped, status)) => {
            ran.dropped = dropped;
            let status =
                status.map_err(|e| ToolError::Failed(format!("waiting for ssh failed: {e}")))?;
            ran.code = status.code();
            if status.code() == Some(255) && so.is_empty() {
                let msg = String::from_utf8_lossy(&se).trim().to_string();
                if msg.starts_with("ssh:")
                    || msg.contains("Host key verification failed")
                    || msg.contains("Permission denied")
                    || msg.contains("Connection closed")
                {
                    return Err(ToolError::NotReady(format!(
                        "ssh to VM {vm} failed: {msg}; vm_describe {{name: {vm}}} shows its state"
                    )));
                }
            }
        }
        None if kill_group => {
            if head.pgid.is_none() && !head.done {
                // Stopped before the group's name arrived: it is the first line, so wait for it.
                let _ = tokio::time::timeout(
                    Duration::from_secs(3),
                    drain(&mut err, &mut se, &budget, Some(&mut head), true),
                )
                .await;
            }
            if let Some(pgid) = head.pgid {
                let mut k = ssh.command();
                k.args(["-T", "-o", "BatchMode=yes", "--", &kill_script(pgid)])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .kill_on_drop(true);
                if let Ok(k) = k.spawn() {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(10), k.wait_with_output()).await;
                }
            }
        }
        None => {}
    }
    if let Some(w) = writer {
        w.abort();
    }
    ran.stdout = so;
    ran.stderr = se;
    Ok(ran)
}

/// Run a short helper script whose failure is a tool error: returns stdout. Exit code 3 means
/// "not found", 4 "invalid", 5 "conflict"; stderr is the message.
pub async fn helper(
    session: &Session,
    vm: &str,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<Vec<u8>, ToolError> {
    let ssh = session.ssh_to(vm)?;
    let r = run(&ssh, script, stdin, cap, timeout, ct, false).await?;
    if r.cancelled {
        return Err(ToolError::Cancelled);
    }
    if r.timed_out {
        return Err(ToolError::Timeout(format!(
            "VM {vm} did not answer within {}s",
            timeout.as_secs()
        )));
    }
    if r.dropped > 0 {
        return Err(ToolError::Invalid(format!(
            "the result is over the {} byte cap: ask for less (a line range, a tail)",
            cap
        )));
    }
    let msg = String::from_utf8_lossy(&r.stderr).trim().to_string();
    match r.code {
        Some(0) => Ok(r.stdout),
        Some(3) => Err(ToolError::NotFound(msg)),
        Some(4) => Err(ToolError::Invalid(msg)),
        Some(5) => Err(ToolError::Conflict(msg)),
        c => Err(ToolError::Failed(format!(
            "in VM {vm}: {} (exit {c:?})",
            if msg.is_empty() {
                "the helper failed"
            } else {
                &msg
            }
        ))),
    }
}

/// `vm_bash` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BashArgs {
    /// The VM (default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// The shell command (run by the user's login shell, bash in boxery images; pipes, `&&` and redirections work).
    pub command: String,
    /// The working directory (default: the user's home).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Seconds before the command's process group is killed (default 120, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// The remote script of a `vm_bash` call: name the process group on stderr (builtins only),
/// make sure the shell leads its own group (sshd's does; otherwise `setsid` makes it so, in
/// place), then run the command in that shell.
pub fn bash_script(command: &str, cwd: Option<&str>) -> String {
    let cd = match cwd {
        Some(d) => format!(
            "cd {} || {{ echo \"vm_bash: cannot cd to {}\" >&2; exit 126; }}; ",
            qpath(d),
            d.replace(['"', '\\', '$', '`'], "_")
        ),
        None => String::new(),
    };
    let q = shell_quote(command);
    // After the check: a group made by `setsid` exists only once it ran.
    const MARK: &str = "printf \"boxery-pgid %s\\n\" $$ >&2";
    format!(
        "{cd}read -r s </proc/$$/stat && s=${{s##*') '}} && set -- $s && [ \"$3\" != $$ ] && exec setsid \"${{BASH:-sh}}\" -c '{MARK}; c=$1; set --; eval \"$c\"' sh {q}; {MARK}; set --; eval {q}"
    )
}

/// The remote script that kills a `vm_bash` call's process group.
pub fn kill_script(pgid: u32) -> String {
    format!(
        "p={pgid}; kill -TERM -$p 2>/dev/null || exit 0; i=0; while kill -0 -$p 2>/dev/null && [ $i -lt 10 ]; do sleep 0.1 2>/dev/null || sleep 1; i=$((i+1)); done; kill -KILL -$p 2>/dev/null; exit 0"
    )
}

fn text_of(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `vm_bash`.
pub async fn bash(session: Arc<Session>, a: BashArgs, ct: CancellationToken) -> ToolResult {
    let vm = session.resolve_vm(a.vm)?;
    let timeout = clamp_timeout(a.timeout_seconds, 120);
    let ssh = session.ssh_to(&vm)?;
    let script = bash_script(&a.command, a.cwd.as_deref());
    let started = Instant::now();
    let r = run(&ssh, &script, None, OUTPUT_CAP, timeout, &ct, true).await?;
    let took = started.elapsed();
    let stdout = text_of(&r.stdout);
    let stderr = text_of(&r.stderr);
    let mut text = stdout.clone();
    if !stderr.is_empty() {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str("[stderr]\n");
        text.push_str(&stderr);
    }
    if r.dropped > 0 {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!(
            "[output truncated: {} bytes over the 1 MiB cap were dropped; redirect to a file and vm_read parts of it]\n",
            r.dropped
        ));
    }
    if r.cancelled {
        return Err(ToolError::Cancelled);
    }
    if r.timed_out {
        return Err(ToolError::Timeout(format!(
            "the command timed out after {}s and its process group was killed; use vm_jobs for long work. Output so far:\n{text}",
            timeout.as_secs()
        )));
    }
    let code = r.code.unwrap_or(-1);
    if code != 0 {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!("[exit {code}]"));
    }
    Ok(Output::with_data(
        text,
        json!({
            "vm": vm,
            "exit_code": code,
            "stdout": stdout,
            "stderr": stderr,
            "truncated_bytes": r.dropped,
            "duration_ms": took.as_millis() as u64,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(qpath("~"), "\"$HOME\"");
        assert_eq!(qpath("~/a b"), "\"$HOME\"/'a b'");
        assert_eq!(qpath("/etc/x"), "/etc/x");
    }

    /// Split a [`bash_script`]'s stderr the way [`run`] does: the group, and the rest.
    fn split_err(err: &[u8]) -> (Option<u32>, Vec<u8>) {
        let mut h = ErrHead::default();
        let mut rest = Vec::new();
        // Byte by byte: the mark may arrive in pieces.
        for b in err {
            rest.extend_from_slice(&h.take(std::slice::from_ref(b)));
        }
        (h.pgid, rest)
    }

    #[test]
    fn stderr_head_is_parsed_in_pieces_and_other_text_kept() {
        assert_eq!(
            split_err(b"boxery-pgid 42\nwarn\n"),
            (Some(42), b"warn\n".to_vec())
        );
        assert_eq!(split_err(b"boxery-x\n"), (None, b"boxery-x\n".to_vec()));
        assert_eq!(split_err(b"oops\n"), (None, b"oops\n".to_vec()));
    }

    /// Run a script as sshd would: `SHELL -c SCRIPT`, the shell leading its own session and
    /// group (`lead`), or not (then the script must make itself one).
    fn spawn(shell: &str, script: &str, lead: bool) -> std::process::Child {
        let mut c = if lead {
            let mut c = std::process::Command::new("setsid");
            c.arg(shell);
            c
        } else {
            std::process::Command::new(shell)
        };
        c.args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The scripts run under a local shell the way the guest runs them: the command's group is
    /// named on stderr, the exit code and output come back, and the kill script kills the
    /// whole group — whether or not the shell already led its group.
    #[test]
    fn bash_script_runs_and_kills_its_group() {
        use std::io::{BufRead, BufReader};
        for shell in ["bash", "sh"] {
            for lead in [true, false] {
                let out = spawn(
                    shell,
                    &bash_script("echo hi; pwd; echo e >&2; exit 3", Some("/tmp")),
                    lead,
                )
                .wait_with_output()
                .unwrap();
                assert_eq!(out.status.code(), Some(3), "{shell} {lead}");
                assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n/tmp\n");
                let (pgid, rest) = split_err(&out.stderr);
                assert!(
                    pgid.is_some(),
                    "{shell} {lead}: {:?}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert_eq!(rest, b"e\n");
                let mut child = spawn(shell, &bash_script("sleep 30 & sleep 30; wait", None), lead);
                let mut first = String::new();
                BufReader::new(child.stderr.take().unwrap())
                    .read_line(&mut first)
                    .unwrap();
                let pgid: u32 = first
                    .trim()
                    .strip_prefix("boxery-pgid ")
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_ne!(pgid, nix_pgrp(), "the command shares the test's group");
                let st = std::process::Command::new("sh")
                    .args(["-c", &kill_script(pgid)])
                    .status()
                    .unwrap();
                assert!(st.success());
                let code = child.wait().unwrap();
                assert!(!code.success());
                assert!(
                    !crate::tools::group_alive(pgid),
                    "{shell} {lead}: the process group survived"
                );
            }
        }
    }

    /// This process's group.
    fn nix_pgrp() -> u32 {
        let st = std::fs::read_to_string("/proc/self/stat").unwrap();
        let rest = st.rsplit_once(')').unwrap().1;
        rest.split_whitespace().nth(2).unwrap().parse().unwrap()
    }
}
