//! Running commands in a VM over OpenSSH (the generated ssh_config: pinned host key, one
//! ControlMaster per VM), with bounded output and time: [`run`], and [`bash`] (`vm_bash`).
//!
//! A `vm_bash` command runs in the remote login shell that the ssh server starts for the
//! call, with no extra process: the wrapper only exports a tag unique to the call
//! (`BOXERY_CALL=ID`, inherited by everything the command starts, orphans included; the shell
//! itself carries it in its command line) and `eval`s the command. On timeout or
//! cancellation a second ssh call finds the tagged processes (`/proc/*/environ` and
//! `/proc/*/cmdline`, through `sudo -n` when the user has it) and kills them all
//! (TERM, then KILL a second later), so nothing is left running in the guest when the call
//! returns. A process group would not do: dropbear (the `tiny` image) runs every channel's
//! shell in the connection's group, and making a new group costs an `exec` (~5 ms under TCG).
//! Caveat: a process that clears its environment (`env -i`) escapes the tag.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{OUTPUT_CAP, cancelled};
use crate::{ErrorKind, Result, VerbError, Verbs};
use boxery_api::name::safe;
use boxery_hands::{Reach, dquoted, qpath, shell_quote};

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
    r: impl AsyncRead + Unpin,
    buf: &mut Vec<u8>,
    budget: &std::sync::atomic::AtomicUsize,
) -> u64 {
    use std::sync::atomic::Ordering;
    let mut r = r;
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

/// Run `script` in the VM (by the login shell, via ssh) with optional stdin, bounded by
/// `timeout` and `cap` bytes of output (stdout and stderr together). `on_stop` runs (best
/// effort) in the guest when the call times out or is cancelled.
pub async fn run(
    ssh: &Reach,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
    on_stop: Option<&str>,
) -> Result<Ran> {
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
        VerbError::failed(format!(
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
                status.map_err(|e| VerbError::failed(format!("waiting for ssh failed: {e}")))?;
            ran.code = status.code();
            if status.code() == Some(255) && so.is_empty() {
                let msg = safe(String::from_utf8_lossy(&se).trim()).into_owned();
                if msg.starts_with("ssh:")
                    || msg.contains("Host key verification failed")
                    || msg.contains("Permission denied")
                    || msg.contains("Connection closed")
                {
                    return Err(VerbError::new(
                        ErrorKind::NotReady,
                        format!(
                            "ssh to VM {vm} failed: {msg}; vm_describe {{name: {vm}}} shows its state"
                        ),
                    ));
                }
            }
        }
        None => {
            if let Some(stop) = on_stop {
                let mut k = ssh.command();
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

/// The tag of a `vm_bash` call, in the environment of everything it starts.
pub const CALL_TAG: &str = "BOXERY_CALL";

/// The remote script of a `vm_bash` call with id `id` (letters and digits): builtins only.
pub fn bash_script(id: &str, command: &str, cwd: Option<&str>) -> String {
    let cd = match cwd {
        Some(d) => format!(
            "cd {} || {{ printf '%s\\n' \"vm_bash: cannot cd to {}\" >&2; exit 126; }}; ",
            qpath(d),
            dquoted(d)
        ),
        None => String::new(),
    };
    format!(
        "{}export {CALL_TAG}={id}; {cd}eval {}",
        boxery_hands::guest::SOURCE,
        shell_quote(command)
    )
}

/// The remote script that kills every process of a `vm_bash` call: the shell (its command
/// line holds the tag) and everything it started (their environment does). All are stopped
/// before any is signalled (so the shell cannot run its next command when a child dies
/// first), sent TERM and continued; KILL for what is left after a second; through `sudo -n` when the user has it, so commands run with
/// sudo die too. The tag is never written whole in this script, so the script does not find
/// itself; `grep` (whose arguments hold it; regex mode, as busybox's `-F` stops at the first
/// NUL) is gone before its finds are used.
pub fn kill_script(id: &str) -> String {
    format!(
        "t={CALL_TAG}; t=\"$t={id}\"; K=; sudo -n true 2>/dev/null && K='sudo -n'; \
         scan() {{ p=; for f in $($K grep -ls -e \"$t\" /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null); do f=${{f#/proc/}}; f=${{f%/*}}; [ \"$f\" != $$ ] && [ -d /proc/$f ] && p=\"$p $f\"; done; }}; \
         term() {{ $K kill -STOP $p; $K kill -TERM $p; $K kill -CONT $p; }} 2>/dev/null; \
         scan; [ -n \"$p\" ] || exit 0; term; i=0; \
         while [ $i -lt 10 ]; do scan; [ -n \"$p\" ] || exit 0; term; sleep 0.1 2>/dev/null || sleep 1; i=$((i+1)); done; \
         scan; [ -z \"$p\" ] || $K kill -KILL $p 2>/dev/null; exit 0"
    )
}

/// A command to run in a VM (`vm_bash`).
#[derive(Debug, Clone)]
pub struct Bash {
    /// The VM.
    pub vm: String,
    /// The shell command, run by the user's login shell.
    pub command: String,
    /// The working directory (default: the user's home).
    pub cwd: Option<String>,
    /// How long it may run before everything it started is killed.
    pub timeout: Duration,
}

/// What a command run by [`bash`] did.
#[derive(Debug, Clone, Serialize)]
pub struct BashRun {
    /// The VM.
    pub vm: String,
    /// Its exit code (-1: none).
    pub exit_code: i32,
    /// Its stdout (up to the cap, lossily UTF-8).
    pub stdout: String,
    /// Its stderr (up to the cap, lossily UTF-8).
    pub stderr: String,
    /// Bytes dropped over the cap.
    pub truncated_bytes: u64,
    /// How long it ran.
    pub duration_ms: u64,
}

impl BashRun {
    /// Its output as one text: stdout, then `[stderr]` and stderr, a truncation note and a
    /// non-zero exit code.
    pub fn text(&self) -> String {
        let mut text = output_text(&self.stdout, &self.stderr, self.truncated_bytes);
        if self.exit_code != 0 {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!("[exit {}]", self.exit_code));
        }
        text
    }
}

fn output_text(stdout: &str, stderr: &str, dropped: u64) -> String {
    let mut text = stdout.to_string();
    if !stderr.is_empty() {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str("[stderr]\n");
        text.push_str(stderr);
    }
    if dropped > 0 {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!(
            "[output truncated: {dropped} bytes over the 1 MiB cap were dropped; redirect to a file and vm_read parts of it]\n"
        ));
    }
    text
}

/// Run a shell command in a VM (`vm_bash`), bounded by its timeout and [`OUTPUT_CAP`]; on
/// timeout or cancellation everything it started in the guest is killed ([`kill_script`]).
pub async fn bash(v: &Verbs, a: &Bash, ct: &CancellationToken) -> Result<BashRun> {
    let doing = v.doing("bash", Some(&a.vm), a.command.clone());
    let r = bash_unrecorded(v, a, ct).await;
    match &r {
        Ok(run) => doing.done(
            format!("exit {}", run.exit_code),
            Some((run.stdout.len() + run.stderr.len()) as u64),
        ),
        Err(_) => doing.ended(&r, None),
    }
    r
}

/// [`bash`], not recorded in the audit (its caller records what it was asked).
pub(crate) async fn bash_unrecorded(
    v: &Verbs,
    a: &Bash,
    ct: &CancellationToken,
) -> Result<BashRun> {
    let ssh = v.reach(&a.vm).await?;
    let id = format!("b{}", uuid::Uuid::new_v4().simple());
    let script = bash_script(&id, &a.command, a.cwd.as_deref());
    let kill = kill_script(&id);
    let started = Instant::now();
    let r = run(&ssh, &script, None, OUTPUT_CAP, a.timeout, ct, Some(&kill)).await?;
    let took = started.elapsed();
    let text_of = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let (stdout, stderr) = (text_of(&r.stdout), text_of(&r.stderr));
    if r.cancelled {
        return Err(cancelled());
    }
    if r.timed_out {
        return Err(VerbError::new(
            ErrorKind::Timeout,
            format!(
                "the command timed out after {}s and its process group was killed; use vm_jobs for long work. Output so far:\n{}",
                a.timeout.as_secs(),
                output_text(&stdout, &stderr, r.dropped)
            ),
        ));
    }
    Ok(BashRun {
        vm: a.vm.clone(),
        exit_code: r.code.unwrap_or(-1),
        stdout,
        stderr,
        truncated_bytes: r.dropped,
        duration_ms: took.as_millis() as u64,
    })
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

    /// Live pids whose environment or command line carries a call's tag.
    fn tagged(id: &str) -> Vec<u32> {
        let want = format!("{CALL_TAG}={id}");
        let has = |b: &[u8]| b.windows(want.len()).any(|w| w == want.as_bytes());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                if stat.rsplit_once(')')?.1.trim_start().starts_with('Z') {
                    return None;
                }
                let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                (has(&env) || has(&cmd)).then_some(pid)
            })
            .collect()
    }

    /// The scripts run under a local shell the way the guest runs them (`SHELL -c SCRIPT`):
    /// output and exit code come back, and the kill script kills every process of the call —
    /// background ones and orphans included — and nothing else.
    #[test]
    fn bash_script_runs_and_kills_everything_it_started() {
        for shell in ["bash", "sh"] {
            let out = std::process::Command::new(shell)
                .args([
                    "-c",
                    &bash_script("t1", "echo hi; pwd; echo e >&2; exit 3", Some("/tmp")),
                ])
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(3), "{shell}");
            assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n/tmp\n");
            assert_eq!(String::from_utf8_lossy(&out.stderr), "e\n");
            let id = format!("t{}", uuid::Uuid::new_v4().simple());
            let mut bystander = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let mut child = std::process::Command::new(shell)
                .args([
                    "-c",
                    &bash_script(&id, "(sleep 30 &); sleep 30 & sleep 30; wait", None),
                ])
                .spawn()
                .unwrap();
            let mut n = 0;
            for _ in 0..100 {
                n = tagged(&id).len();
                if n >= 4 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(
                n >= 4,
                "{shell}: {n} tagged processes, want the shell and its sleeps"
            );
            let st = std::process::Command::new("sh")
                .args(["-c", &kill_script(&id)])
                .status()
                .unwrap();
            assert!(st.success());
            assert!(!child.wait().unwrap().success());
            let mut left = tagged(&id);
            for _ in 0..40 {
                if left.is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
                left = tagged(&id);
            }
            assert!(left.is_empty(), "{shell}: survivors {left:?}");
            assert!(
                bystander.try_wait().unwrap().is_none(),
                "the kill script killed an unrelated process"
            );
            let _ = bystander.kill();
            let _ = bystander.wait();
        }
    }
}
