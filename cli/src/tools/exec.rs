//! Running commands in a VM over OpenSSH (the generated ssh_config: pinned host key, one
//! ControlMaster per VM), with bounded output and time, and `vm_bash`.
//!
//! A `vm_bash` command runs under `setsid` in the guest, so it leads its own process group;
//! its pid is kept in `~/.boxery/run/ID` while it runs. On timeout or cancellation a second
//! ssh call kills that whole group (TERM, then KILL a second later), so nothing is left
//! running in the guest when the call returns.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_reconcilers::ssh::SshDir;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{OUTPUT_CAP, Output, Session, ToolError, ToolResult, clamp_timeout};
use crate::hands::shell_quote;

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

async fn drain(
    mut r: impl AsyncRead + Unpin,
    buf: &mut Vec<u8>,
    budget: &std::sync::atomic::AtomicUsize,
) -> u64 {
    use std::sync::atomic::Ordering;
    let mut dropped = 0u64;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return dropped,
            Ok(n) => n,
        };
        let left = budget.load(Ordering::Relaxed);
        let take = n.min(left);
        budget.fetch_sub(take, Ordering::Relaxed);
        buf.extend_from_slice(&chunk[..take]);
        dropped += (n - take) as u64;
    }
}

/// Run `script` in the VM (by `sh -c`, via ssh) with optional stdin, bounded by `timeout`
/// and `cap` bytes of output (stdout and stderr together). `on_stop` runs (best effort) in the
/// guest when the call times out or is cancelled.
#[allow(clippy::too_many_arguments)] // one call site per shape; a struct would only rename them
pub async fn run(
    ssh: &SshDir,
    vm: &str,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
    on_stop: Option<&str>,
) -> Result<Ran, ToolError> {
    let mut c = ssh.command(vm);
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
    let out = child.stdout.take().expect("piped");
    let err = child.stderr.take().expect("piped");
    let budget = std::sync::atomic::AtomicUsize::new(cap);
    let mut ran = Ran::default();
    let (mut so, mut se) = (Vec::new(), Vec::new());
    let io = async {
        let (a, b) = tokio::join!(drain(out, &mut so, &budget), drain(err, &mut se, &budget));
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
        None => {
            if let Some(stop) = on_stop {
                let mut k = ssh.command(vm);
                k.args(["-T", "-o", "BatchMode=yes", "--", stop])
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
    let r = run(&ssh, vm, script, stdin, cap, timeout, ct, None).await?;
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
    /// The shell command (run by `sh -c`; pipes, `&&` and redirections work).
    pub command: String,
    /// The working directory (default: the user's home).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Seconds before the command's process group is killed (default 120, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// The remote script of a `vm_bash` call with id `id`.
pub fn bash_script(id: &str, command: &str, cwd: Option<&str>) -> String {
    let cd = match cwd {
        Some(d) => format!(
            "cd {} || {{ echo \"vm_bash: cannot cd to {}\" >&2; exit 126; }}; ",
            qpath(d),
            d.replace(['"', '\\', '$', '`'], "_")
        ),
        None => "cd \"$HOME\"; ".into(),
    };
    format!(
        "r=\"$HOME/.boxery/run\"; mkdir -p \"$r\"; {cd}setsid sh -c 'echo $$ > \"$1\"; exec sh -c \"$2\"' vm_bash \"$r/{id}\" {} </dev/null & p=$!; wait $p; c=$?; rm -f \"$r/{id}\"; exit $c",
        shell_quote(command)
    )
}

/// The remote script that kills a `vm_bash` call's process group.
pub fn kill_script(pidfile: &str) -> String {
    format!(
        "f={pidfile}; p=$(cat \"$f\" 2>/dev/null) || exit 0; kill -TERM -$p 2>/dev/null; i=0; while kill -0 -$p 2>/dev/null && [ $i -lt 10 ]; do sleep 0.1 2>/dev/null || sleep 1; i=$((i+1)); done; kill -KILL -$p 2>/dev/null; rm -f \"$f\"; exit 0"
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
    let id = format!("b{}", uuid::Uuid::new_v4().simple());
    let script = bash_script(&id, &a.command, a.cwd.as_deref());
    let kill = kill_script(&format!("\"$HOME/.boxery/run/{id}\""));
    let started = Instant::now();
    let r = run(
        &ssh,
        &vm,
        &script,
        None,
        OUTPUT_CAP,
        timeout,
        &ct,
        Some(&kill),
    )
    .await?;
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

    /// The scripts run under a local sh the way the guest runs them: the command leads its own
    /// process group, the exit code comes back, and the kill script kills the whole group.
    #[test]
    fn bash_script_runs_and_kills_its_group() {
        let home = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("sh")
            .env("HOME", home.path())
            .args(["-c", &bash_script("t1", "echo hi; exit 3", Some("/tmp"))])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
        let mut child = std::process::Command::new("sh")
            .env("HOME", home.path())
            .args(["-c", &bash_script("t2", "sleep 30 & sleep 30; wait", None)])
            .spawn()
            .unwrap();
        let pidfile = home.path().join(".boxery/run/t2");
        for _ in 0..100 {
            if pidfile.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let pgid = std::fs::read_to_string(&pidfile).unwrap();
        let st = std::process::Command::new("sh")
            .env("HOME", home.path())
            .args(["-c", &kill_script("\"$HOME/.boxery/run/t2\"")])
            .status()
            .unwrap();
        assert!(st.success());
        let code = child.wait().unwrap();
        assert!(!code.success());
        assert!(
            !crate::tools::group_alive(pgid.trim().parse().unwrap()),
            "the process group survived"
        );
    }
}
