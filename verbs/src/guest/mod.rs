//! Guest actions: what an agent or a person does inside a VM, over the hands' ssh — run a
//! command ([`exec`]), read, write and edit files ([`files`]), background jobs ([`jobs`]) and
//! copies local ⇄ VM and VM ⇄ VM ([`copy`]), port forwards ([`forward`]), a coding agent run on a prompt ([`prompt`]), the screen
//! ([`computer`]), a VM's screen as a VNC stream ([`desktop`], a watcher's filter in [`rfb`]) and the agent's browser ([`browser`]). Each is a typed function over [`Verbs`] with a
//! typed input and result and [`VerbError`] as its error; the MCP tools (`vm_bash`,
//! `vm_read`, …) and the CLI (`boxery file …`, `jobs`, `cp`) are thin adapters that choose the
//! VM, call one and render its result.
//!
//! Guarantees: every call is bounded in time (`timeout`, at most [`MAX_WAIT_SECS`]) and in
//! what it returns ([`OUTPUT_CAP`]); a cancelled call stops what it started in the guest; what
//! a guest prints is checked before it is believed (versions, numbers) and made safe before
//! it is shown. Assumptions: the VM runs sshd and a POSIX shell (bash in boxery images,
//! busybox in `tiny`). Caveats: a guest's messages (a helper script's stderr) are shown as
//! the guest wrote them, escaped; a compromised guest can lie about its own files.

pub mod browser;
pub mod computer;
pub mod copy;
pub mod desktop;
pub mod exec;
pub mod files;
pub mod forward;
pub mod jobs;
pub mod prompt;
pub mod rfb;

use std::time::Duration;

use crate::{ErrorKind, Result, VerbError, Verbs};
use boxery_api::name::safe;
use tokio_util::sync::CancellationToken;

pub use exec::{Bash, BashRun, Ran};

/// The cap on text a guest action returns (command output, file contents, job logs): 1 MiB.
pub const OUTPUT_CAP: usize = 1 << 20;
/// The longest a guest action may wait (timeouts are clamped to this): 30 minutes.
pub const MAX_WAIT_SECS: u64 = crate::wait::TOOL_MAX_WAIT_SECS;

/// A caller's timeout in seconds (`default` when not given), clamped to 1 s ..
/// [`MAX_WAIT_SECS`].
pub fn clamp_timeout(secs: Option<u64>, default: u64) -> Duration {
    Duration::from_secs(secs.unwrap_or(default).clamp(1, MAX_WAIT_SECS))
}

/// Run a short helper script in VM `vm` whose failure is an error: returns its stdout. Exit
/// code 3 means "not found", 4 "invalid", 5 "conflict"; stderr is the message (control
/// characters escaped: the guest writes it).
pub async fn helper(
    v: &Verbs,
    vm: &str,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<Vec<u8>> {
    helper_stopped(v, vm, script, stdin, cap, timeout, ct, None).await
}

/// [`helper`], with `on_stop` run in the guest when the call times out or is cancelled (what
/// kills what the script started: [`exec::kill_script`]).
#[allow(clippy::too_many_arguments)]
pub async fn helper_stopped(
    v: &Verbs,
    vm: &str,
    script: &str,
    stdin: Option<Vec<u8>>,
    cap: usize,
    timeout: Duration,
    ct: &CancellationToken,
    on_stop: Option<&str>,
) -> Result<Vec<u8>> {
    let ssh = v.reach(vm).await?;
    let r = exec::run(&ssh, script, stdin, cap, timeout, ct, on_stop).await?;
    if r.cancelled {
        return Err(cancelled());
    }
    if r.timed_out {
        return Err(VerbError::new(
            ErrorKind::Timeout,
            format!("VM {vm} did not answer within {}s", timeout.as_secs()),
        ));
    }
    if r.dropped > 0 {
        return Err(VerbError::invalid(format!(
            "the result is over the {cap} byte cap: ask for less (a line range, a tail)"
        )));
    }
    let msg = safe(String::from_utf8_lossy(&r.stderr).trim()).into_owned();
    match r.code {
        Some(0) => Ok(r.stdout),
        Some(3) => Err(VerbError::not_found(msg)),
        Some(4) => Err(VerbError::invalid(msg)),
        Some(5) => Err(VerbError::conflict(msg)),
        c => Err(VerbError::failed(format!(
            "in VM {vm}: {} (exit {c:?})",
            if msg.is_empty() {
                "the helper failed"
            } else {
                &msg
            }
        ))),
    }
}

/// Whether VM `obj` has layer `layer`: in its spec, what it was made with or given in place,
/// or its image's build record (a VM made from a snapshot of a layered VM).
pub fn has_layer(obj: &boxery_api::Vm, layer: &str) -> bool {
    let has = |l: &[String]| l.iter().any(|l| l == layer);
    has(&obj.status.layers)
        || has(&obj.spec.layers)
        || obj
            .status
            .build_info
            .as_ref()
            .is_some_and(|b| has(&b.layers))
}

/// The caller cancelled the call.
pub(crate) fn cancelled() -> VerbError {
    VerbError::new(ErrorKind::Cancelled, "cancelled")
}

/// Whether a process group has live (non-zombie) members, polling for up to 2 s.
#[cfg(test)]
pub(crate) fn group_alive(pgid: u32) -> bool {
    for _ in 0..40 {
        let live = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .any(|st| {
                let rest = st.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
                let f: Vec<&str> = rest.split_whitespace().collect();
                f.len() > 3 && f[0] != "Z" && f[2] == pgid.to_string()
            });
        if !live {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    true
}
