//! `ssh-agent` grants: the owner's ssh-agent, forwarded into a VM while a person's approval of
//! the grant stands (docs/grants.md, "ssh-agent forwarding").
//!
//! Two parts, both in the control plane (`boxery serve`, or a command running the controllers
//! embedded):
//! - **A filtering agent** per VM: a unix socket of this process,
//!   `$BOXERY_HOME/agent/<hash of the VM's name>` (directory 0700, socket 0600), speaking the
//!   ssh-agent protocol (draft-miller-ssh-agent). It answers two requests and refuses every
//!   other one (`SSH_AGENT_FAILURE`): *list keys* (the keys the VM's grants allow, as the
//!   owner's agent lists them) and *sign* (with one of those keys, passed to the owner's agent
//!   as it came). Adding, removing or locking keys, extensions (`session-bind@openssh.com`
//!   included) and everything else never reach the owner's agent. It reads the VM's grant
//!   state (`$BOXERY_HOME/grants/<vm>.json`) on every request, so a grant's revocation holds
//!   from the moment its entry leaves the file, before the forward is torn down.
//! - **The forward**: `ssh -R /run/boxery/agent.<nonce>.sock:<that socket>` on a connection of
//!   its own (never the VM's shared ControlMaster, which would keep it), with the pinned host
//!   key; its session links `/run/boxery/ssh-agent.sock` (the `SSH_AUTH_SOCK` the guest push
//!   exports, [`GUEST_SOCK`]) to the new socket and removes older ones. [`keep`] holds one per
//!   ready VM with an `ssh-agent` grant in force for its token's owner, and ends it (ssh killed,
//!   every open agent connection closed, the guest's sockets removed) within [`EVERY`] of the
//!   grant leaving the state file, the VM leaving `Ready`, or a new boot.
//!
//! # Guarantees
//! - No grant in force, no agent: the filter lists nothing and signs nothing for a VM whose
//!   state has no `ssh-agent` entry for its token's owner (a lease's grants while leased, the
//!   VM's own otherwise), and no forward runs.
//! - Only the keys a grant names (or all, for `all`), and only keys the owner's agent lists: a
//!   sign request for any other key is refused without reaching the agent.
//! - At most [`IN_FLIGHT`] requests of one VM reach the owner's agent at once; a message larger
//!   than OpenSSH's limit (256 KiB) closes the connection.
//! - In the guest, the socket is sshd's, created as the login user (`agent`) in `/run/boxery`
//!   (0700, that user's) with sshd's `StreamLocalBindMask` (0177 by default): that user, and
//!   root, reach it.
//!
//! # Caveats
//! - While the grant is in force, code in the VM can have the agent sign anything with the
//!   allowed keys (log in where those keys are accepted and its egress policy reaches, push,
//!   sign commits): that is what the grant gives. It can never read a private key. An agent
//!   key added with `ssh-add -c` asks the owner (on the owner's display) before each signature.
//! - The filter does not bind sessions (`session-bind@openssh.com`): keys added with
//!   destination constraints (`ssh-add -h`) are not restricted by them through this forward.
//!   Give VMs a dedicated agent holding only their keys.
//! - The guest's sshd must be OpenSSH (stream-local forwarding): dropbear guests (`tiny`) get
//!   no forward (the start fails and is retried every [`RETRY`], with a warning).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use boxery_api::Vm;
use boxery_api::grant::GrantType;
use boxery_controller::{Cache, CancellationToken};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::context::Ctx;

/// Where the guest's `SSH_AUTH_SOCK` points (a link to the live forward's socket).
pub const GUEST_SOCK: &str = boxery_api::grant::AGENT_GUEST_SOCK;
/// How often the forwards are compared with the grants in force.
pub const EVERY: Duration = Duration::from_secs(2);
/// How long a failed start waits before it is tried again.
pub const RETRY: Duration = Duration::from_secs(5);
/// The longest a forward's start may take (an ssh handshake and one shell line).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest the owner's agent may take to list its keys.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a signature may take (a key added with `ssh-add -c` waits for the owner).
const SIGN_TIMEOUT: Duration = Duration::from_secs(120);
/// The largest agent message (OpenSSH's `AGENT_MAX_LEN`).
const MAX_MESSAGE: usize = 256 * 1024;
/// Requests of one VM's guest answered at once (the others wait their turn).
const IN_FLIGHT: usize = 8;
/// The most connections a VM has open to its filtering agent at once.
const CONNECTIONS: usize = 32;
/// What the forward's session prints once the guest's socket is linked.
const READY: &str = "boxery-agent-ready";

const SSH_AGENT_FAILURE: u8 = 5;
const SSH_AGENTC_REQUEST_IDENTITIES: u8 = 11;
const SSH_AGENT_IDENTITIES_ANSWER: u8 = 12;
const SSH_AGENTC_SIGN_REQUEST: u8 = 13;

/// One agent a VM may use: its socket here, and the keys allowed (`None`: all it holds).
#[derive(Debug, Clone, PartialEq)]
pub struct Upstream {
    /// The owner's agent socket.
    pub socket: PathBuf,
    /// Fingerprints (`SHA256:…`), or all.
    pub keys: Option<Vec<String>>,
}

impl Upstream {
    fn allows(&self, blob: &[u8]) -> bool {
        match &self.keys {
            None => true,
            Some(fps) => {
                let fp = fingerprint(blob);
                fps.contains(&fp)
            }
        }
    }
}

/// The agents `vm`'s grants in force let it use now: the `ssh-agent` entries of its state for
/// its token's owner whose socket checks out ([`boxery_home::values::agent_socket`]).
pub fn upstreams(home: &Path, vm: &str) -> Vec<Upstream> {
    let Some((owner, _)) = boxery_home::tokens::read(home, vm) else {
        return Vec::new();
    };
    boxery_home::grants::read_state(home, vm)
        .into_iter()
        .filter(|e| e.spec.type_ == GrantType::SshAgent && e.owner() == owner)
        .filter_map(|e| {
            let socket = boxery_home::values::agent_socket(&e.spec.value_from, home).ok()?;
            let keys = boxery_api::grant::agent_keys(&e.spec.target).ok()?;
            Some(Upstream { socket, keys })
        })
        .collect()
}

/// A key's fingerprint as `ssh-add -l` prints it: `SHA256:` and the unpadded base64 of the
/// SHA-256 of its public key blob.
pub fn fingerprint(blob: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(blob);
    format!(
        "SHA256:{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The host socket of `vm`'s filtering agent: short, as socket paths must be: 32 hex digits
/// of the SHA-256 of the name (no two VMs' names meet there, where a 64-bit FNV hash's
/// collisions are cheap to find).
pub fn host_socket(home: &Path, vm: &str) -> PathBuf {
    use sha2::Digest;
    let h: String = sha2::Sha256::digest(vm.as_bytes())[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    home.join("agent").join(h)
}

// --- the wire: `u32 length, byte type, body` messages, strings as `u32 length, bytes` ---

async fn read_message<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_MESSAGE {
        return Err(std::io::Error::other(format!(
            "an agent message of {len} bytes"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

async fn write_message<W: AsyncWriteExt + Unpin>(w: &mut W, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    w.write_all(&out).await?;
    w.flush().await
}

/// Read one string at `*at` of `b`.
fn string<'a>(b: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = u32::from_be_bytes(b.get(*at..*at + 4)?.try_into().ok()?) as usize;
    let s = b.get(*at + 4..(*at + 4).checked_add(len)?)?;
    *at += 4 + len;
    Some(s)
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// The keys (blob, comment) of an `SSH_AGENT_IDENTITIES_ANSWER`; `None` if it is not one.
pub fn parse_identities(body: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if body.first() != Some(&SSH_AGENT_IDENTITIES_ANSWER) {
        return None;
    }
    let n = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    let mut at = 5;
    let mut keys = Vec::new();
    for _ in 0..n {
        let blob = string(body, &mut at)?.to_vec();
        let comment = string(body, &mut at)?.to_vec();
        keys.push((blob, comment));
    }
    (at == body.len()).then_some(keys)
}

/// An `SSH_AGENT_IDENTITIES_ANSWER` listing `keys`.
pub fn identities_answer(keys: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![SSH_AGENT_IDENTITIES_ANSWER];
    out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
    for (blob, comment) in keys {
        put_string(&mut out, blob);
        put_string(&mut out, comment);
    }
    out
}

/// One request to the agent at `socket`, answered within `within`.
async fn ask(socket: &Path, request: &[u8], within: Duration) -> Result<Vec<u8>, String> {
    tokio::time::timeout(within, async {
        let mut s = UnixStream::connect(socket)
            .await
            .map_err(|e| format!("cannot reach the agent at {}: {e}", socket.display()))?;
        // the socket was checked when the grant was read; what answers must still be our own
        // user's (a path swapped since, under a directory someone else owns, is refused)
        let me = rustix::process::geteuid().as_raw();
        match s.peer_cred() {
            Ok(c) if c.uid() == me => {}
            Ok(c) => {
                return Err(format!(
                    "the agent at {} runs as uid {}, not as the control plane's user",
                    socket.display(),
                    c.uid()
                ));
            }
            Err(e) => return Err(format!("the agent at {}: {e}", socket.display())),
        }
        write_message(&mut s, request)
            .await
            .map_err(|e| e.to_string())?;
        read_message(&mut s)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "the agent closed the connection".to_string())
    })
    .await
    .map_err(|_| {
        format!(
            "the agent at {} took longer than {within:?}",
            socket.display()
        )
    })?
}

/// The keys `up`'s agent holds that `up` allows.
async fn allowed_keys(up: &Upstream) -> Vec<(Vec<u8>, Vec<u8>)> {
    let Ok(answer) = ask(&up.socket, &[SSH_AGENTC_REQUEST_IDENTITIES], LIST_TIMEOUT).await else {
        return Vec::new();
    };
    parse_identities(&answer)
        .unwrap_or_default()
        .into_iter()
        .filter(|(blob, _)| up.allows(blob))
        .collect()
}

/// The answer to one request from the guest, given the agents `ups` it may use now.
pub async fn answer(ups: &[Upstream], request: &[u8]) -> Vec<u8> {
    match request.first() {
        Some(&SSH_AGENTC_REQUEST_IDENTITIES) => {
            let mut keys: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
            for up in ups {
                for k in allowed_keys(up).await {
                    if !keys.iter().any(|(b, _)| *b == k.0) {
                        keys.push(k);
                    }
                }
            }
            identities_answer(&keys)
        }
        Some(&SSH_AGENTC_SIGN_REQUEST) => {
            let mut at = 1;
            let Some(blob) = string(request, &mut at) else {
                return vec![SSH_AGENT_FAILURE];
            };
            for up in ups.iter().filter(|u| u.allows(blob)) {
                // only a key this agent lists: never one it would find some other way
                if allowed_keys(up).await.iter().any(|(b, _)| b == blob) {
                    return ask(&up.socket, request, SIGN_TIMEOUT)
                        .await
                        .unwrap_or_else(|_| vec![SSH_AGENT_FAILURE]);
                }
            }
            vec![SSH_AGENT_FAILURE]
        }
        _ => vec![SSH_AGENT_FAILURE],
    }
}

/// Serve one guest connection: each request answered with the grants in force at that moment,
/// at most [`IN_FLIGHT`] of the VM's at once (a guest cannot flood the owner's agent).
async fn serve_connection(
    home: PathBuf,
    vm: String,
    mut conn: UnixStream,
    in_flight: Arc<tokio::sync::Semaphore>,
) {
    while let Ok(Some(request)) = read_message(&mut conn).await {
        let Ok(_permit) = in_flight.acquire().await else {
            return;
        };
        let ups = upstreams(&home, &vm);
        let reply = answer(&ups, &request).await;
        if write_message(&mut conn, &reply).await.is_err() {
            return;
        }
    }
}

/// Accept guest connections on `listener` until dropped (dropping it closes them all), at
/// most [`CONNECTIONS`] open at once: more are closed as they come (each holds a task and up
/// to [`MAX_MESSAGE`] bytes in this process, which serves every VM).
async fn accept(listener: UnixListener, home: PathBuf, vm: String) {
    let mut conns = tokio::task::JoinSet::new();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let open = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS));
    loop {
        tokio::select! {
            a = listener.accept() => match a {
                Ok((conn, _)) => {
                    let Ok(slot) = open.clone().try_acquire_owned() else {
                        drop(conn);
                        continue;
                    };
                    let f = serve_connection(home.clone(), vm.clone(), conn, in_flight.clone());
                    conns.spawn(async move {
                        f.await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    tracing::warn!(vm = %vm, error = %e, "the agent filter's socket failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Listen on `socket` (0600 in a 0700 directory, a stale one replaced) for `vm`.
pub fn listen(
    home: &Path,
    vm: &str,
    socket: &Path,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = socket.parent().expect("a socket in a directory");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    Ok(tokio::spawn(accept(
        listener,
        home.to_path_buf(),
        vm.to_string(),
    )))
}

/// One VM's forward: the filter's listener and the `ssh -R` holding the guest's side.
struct Forward {
    boot: String,
    ssh: tokio::process::Child,
    filter: tokio::task::JoinHandle<()>,
    socket: PathBuf,
}

impl Drop for Forward {
    fn drop(&mut self) {
        // the listener and every open agent connection; ssh is killed on drop
        self.filter.abort();
        let _ = self.ssh.start_kill();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A name no other forward to this guest used.
fn nonce() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = boxery_api::fnv::Fnv::default();
    h.part(&t.to_le_bytes())
        .part(&seq.to_le_bytes())
        .part(&std::process::id().to_le_bytes());
    format!("{:016x}", h.finish())
}

/// The forward's remote session: link [`GUEST_SOCK`] to `remote` (sshd's socket for this
/// forward), remove older forwards' sockets, say so, and hold until ssh's stdin closes.
fn session_script(remote: &str) -> String {
    format!(
        "set -eu; d=/run/boxery; s={remote}; test -S \"$s\"; \
         ln -sfn \"$s\" \"$d/.ssh-agent.sock.new\"; mv -fT \"$d/.ssh-agent.sock.new\" {GUEST_SOCK}; \
         for o in \"$d\"/agent.*.sock; do [ \"$o\" = \"$s\" ] || rm -f \"$o\"; done; \
         echo {READY}; exec cat >/dev/null"
    )
}

/// Start `v`'s forward: its filter, then `ssh -R`, up once the guest's link is in place.
async fn start(ctx: &Ctx, v: &Vm, boot: &str) -> Result<Forward, String> {
    let vm = v.metadata.name.as_str();
    let ssh = ctx.ssh.as_ref().ok_or("no ssh to guests here")?;
    let target = crate::ssh::Target::of(v).ok_or("no ssh endpoint")?;
    ssh.write(&target).map_err(|e| e.to_string())?;
    let socket = host_socket(&ctx.home, vm);
    if socket.as_os_str().as_encoded_bytes().contains(&b':') {
        return Err(format!(
            "the agent socket's path {} holds a `:`, which ssh -R cannot take",
            socket.display()
        ));
    }
    let filter = listen(&ctx.home, vm, &socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    let remote = format!("/run/boxery/agent.{}.sock", nonce());
    let spawned = ssh
        .command(vm)
        .args(["-S", "none", "-o", "ControlMaster=no", "-T"])
        .args(["-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes"])
        .arg("-R")
        .arg(format!("{remote}:{}", socket.display()))
        .args(["--", &session_script(&remote)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match spawned {
        Ok(c) => c,
        Err(e) => {
            filter.abort();
            let _ = std::fs::remove_file(&socket);
            return Err(format!("cannot run ssh: {e}"));
        }
    };
    // From here on, an early return drops the forward: ssh killed, filter closed.
    let mut fwd = Forward {
        boot: boot.to_string(),
        ssh: child,
        filter,
        socket,
    };
    let out = fwd.ssh.stdout.take().expect("piped");
    let mut lines = BufReader::new(out).lines();
    let ready = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
    if matches!(&ready, Ok(Ok(Some(l))) if l.trim() == READY) {
        // What the guest's side writes from now on is read and dropped: a full pipe never
        // stalls the connection the forward rides on.
        let err = fwd.ssh.stderr.take();
        tokio::spawn(async move {
            let mut out = lines.into_inner();
            let (mut sink_a, mut sink_b) = (tokio::io::sink(), tokio::io::sink());
            let drain_err = async {
                if let Some(mut e) = err {
                    let _ = tokio::io::copy(&mut e, &mut sink_b).await;
                }
            };
            let _ = tokio::join!(tokio::io::copy(&mut out, &mut sink_a), drain_err);
        });
        return Ok(fwd);
    }
    let _ = fwd.ssh.start_kill();
    let mut stderr = String::new();
    if let Some(mut e) = fwd.ssh.stderr.take() {
        let _ = tokio::time::timeout(Duration::from_secs(5), e.read_to_string(&mut stderr)).await;
    }
    let why = stderr.lines().last().unwrap_or("").trim().to_string();
    Err(match ready {
        Err(_) => format!("the forward did not start within {START_TIMEOUT:?}"),
        _ if why.is_empty() => "the forward did not start".to_string(),
        _ => format!("the forward did not start: {why}"),
    })
}

/// Remove the guest's agent sockets (best effort, bounded): after a forward ended for good.
async fn clean_guest(ctx: &Ctx, vm: &str) {
    let Some(ssh) = &ctx.ssh else { return };
    let script =
        format!("rm -f {GUEST_SOCK} /run/boxery/agent.*.sock /run/boxery/.ssh-agent.sock.new\n");
    if let Err(e) =
        crate::guest::run_script(ssh, vm, &[], "sh -s", &script, Duration::from_secs(10)).await
    {
        tracing::debug!(vm, error = %e, "removing the guest's agent sockets failed");
    }
}

/// Keep one forward per ready VM whose token's owner holds an `ssh-agent` grant in force, and
/// none for any other VM, until `shutdown` (when every forward ends).
pub async fn keep(ctx: Arc<Ctx>, vms: Cache, shutdown: CancellationToken) {
    if ctx.ssh.is_none() {
        return shutdown.cancelled().await;
    }
    let mut running: HashMap<String, Forward> = HashMap::new();
    let mut failed: HashMap<String, Instant> = HashMap::new();
    loop {
        let all: HashMap<String, Vm> = vms
            .list_as::<Vm>()
            .into_iter()
            .filter(|v| !v.metadata.is_deleting())
            .map(|v| (v.metadata.name.clone(), v))
            .collect();
        // What each VM should have: a forward on this boot, or none.
        let want: HashMap<&str, String> = all
            .iter()
            .filter_map(|(name, v)| {
                let boot = crate::guest::boot_of(v)?;
                (!upstreams(&ctx.home, name).is_empty()).then_some((name.as_str(), boot))
            })
            .collect();
        // Ends first: a revoked grant never waits for another VM's start.
        let mut ended = Vec::new();
        for (name, f) in running.iter_mut() {
            let alive = matches!(f.ssh.try_wait(), Ok(None));
            if !alive || want.get(name.as_str()) != Some(&f.boot) {
                ended.push((name.clone(), alive));
            }
        }
        for (name, alive) in ended {
            running.remove(&name);
            if want.contains_key(name.as_str()) {
                if !alive {
                    tracing::warn!(vm = %name, "the ssh-agent forward ended; starting it again");
                }
                continue;
            }
            tracing::info!(vm = %name, "ssh-agent forward ended: no ssh-agent grant in force");
            if all.contains_key(&name) {
                clean_guest(&ctx, &name).await;
            }
        }
        failed.retain(|name, at| want.contains_key(name.as_str()) && at.elapsed() < RETRY);
        let starts: Vec<(&Vm, String)> = want
            .iter()
            .filter(|(name, _)| !running.contains_key(**name) && !failed.contains_key(**name))
            .map(|(name, boot)| (&all[*name], boot.clone()))
            .collect();
        let results = futures::future::join_all(
            starts
                .iter()
                .map(|(v, boot)| async { (v.metadata.name.clone(), start(&ctx, v, boot).await) }),
        )
        .await;
        for (name, r) in results {
            match r {
                Ok(f) => {
                    tracing::info!(vm = %name, "ssh-agent forward up");
                    running.insert(name, f);
                }
                Err(e) => {
                    tracing::warn!(vm = %name, error = %e, "the ssh-agent forward failed; retrying");
                    failed.insert(name, Instant::now());
                }
            }
        }
        // a pass, then EVERY (a slow start delays the next pass, never overlaps it)
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use boxery_api::grant::{GrantSpec, ValueFrom};
    use boxery_home::grants::Entry;

    /// `ssh-keygen`'s arguments for a new key without a passphrase, up to its comment.
    const KEYGEN: [&str; 6] = ["-q", "-t", "ed25519", "-N", "", "-C"];

    /// An `ssh-agent -D` this test started, killed (by its pid) when dropped.
    struct Agent(std::process::Child);
    impl Drop for Agent {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn run(cmd: &str, args: &[&str], sock: &Path) -> (bool, String) {
        let out = std::process::Command::new(cmd)
            .args(args)
            .env("SSH_AUTH_SOCK", sock)
            .env_remove("SSH_ASKPASS")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{cmd} (openssh-client) must be installed: {e}"));
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    async fn run_async(cmd: &str, args: &[&str], sock: &Path) -> (bool, String) {
        let (cmd, sock) = (cmd.to_string(), sock.to_path_buf());
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&cmd, &args, &sock)
        })
        .await
        .unwrap()
    }

    fn key(dir: &Path, name: &str) -> (PathBuf, String) {
        let k = dir.join(name);
        let args = [&KEYGEN[..], &[name, "-f", k.to_str().unwrap()]].concat();
        let (ok, out) = run("ssh-keygen", &args, dir);
        assert!(ok, "{out}");
        let (ok, out) = run("ssh-keygen", &["-lf", &format!("{}.pub", k.display())], dir);
        assert!(ok, "{out}");
        let fp = out.split_whitespace().nth(1).unwrap().to_string();
        (k, fp)
    }

    fn entry(target: &str, socket: &Path, lease_uid: Option<&str>) -> Entry {
        Entry {
            name: format!("dev1-ssh-agent-{}", target.len()),
            uid: format!("uid-{target}"),
            generation: 1,
            spec: GrantSpec {
                limits: None,
                vm: Some("dev1".into()),
                lease: None,
                type_: GrantType::SshAgent,
                target: target.into(),
                header: None,
                value_from: ValueFrom::File(socket.display().to_string()),
            },
            vm_uid: "vm-uid".into(),
            lease_uid: lease_uid.map(str::to_string),
        }
    }

    /// The keys the filter lists on one connection, asked twice on that connection with the
    /// grant state changed between: an open connection follows the grants too.
    async fn list_on(conn: &mut UnixStream) -> Option<usize> {
        write_message(conn, &[SSH_AGENTC_REQUEST_IDENTITIES])
            .await
            .ok()?;
        let answer = read_message(conn).await.ok()??;
        Some(parse_identities(&answer)?.len())
    }

    #[tokio::test]
    async fn the_filter_lists_and_signs_only_granted_keys_and_follows_revocation() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("h");
        std::fs::create_dir(&home).unwrap();
        let owner_sock = dir.path().join("owner.sock");
        let agent = Agent(
            std::process::Command::new("ssh-agent")
                .arg("-D")
                .arg("-a")
                .arg(&owner_sock)
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("ssh-agent (openssh-client) must be installed"),
        );
        for _ in 0..100 {
            if owner_sock.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let (k1, fp1) = key(dir.path(), "k1");
        let (k2, fp2) = key(dir.path(), "k2");
        let (k3, _) = key(dir.path(), "k3");
        for k in [&k1, &k2] {
            let (ok, out) = run("ssh-add", &[k.to_str().unwrap()], &owner_sock);
            assert!(ok, "{out}");
            // only the agent holds them (ssh-keygen -Y sign would use a private file beside)
            std::fs::remove_file(k).unwrap();
        }
        // No token, no grant: the filter lists nothing.
        let filter_sock = host_socket(&home, "dev1");
        let filter = listen(&home, "dev1", &filter_sock).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&filter_sock)
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
            let dir_mode = std::fs::metadata(filter_sock.parent().unwrap())
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(dir_mode & 0o777, 0o700);
        }
        let (ok, out) = run_async("ssh-add", &["-l"], &filter_sock).await;
        assert!(!ok && out.contains("no identities"), "{out}");
        boxery_home::tokens::write(&home, "dev1", "vm-uid", &format!("bxt_{}", "0".repeat(64)))
            .unwrap();
        // A lease's grant while the VM's own token is in use: not this owner's.
        boxery_home::grants::write_state(&home, "dev1", vec![entry("all", &owner_sock, Some("l"))])
            .unwrap();
        let (ok, out) = run_async("ssh-add", &["-l"], &filter_sock).await;
        assert!(!ok && out.contains("no identities"), "{out}");

        // One key granted: exactly that one is listed, and only it signs.
        boxery_home::grants::write_state(&home, "dev1", vec![entry(&fp1, &owner_sock, None)])
            .unwrap();
        let (ok, out) = run_async("ssh-add", &["-l"], &filter_sock).await;
        assert!(ok, "{out}");
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(out.contains(&fp1) && !out.contains(&fp2), "{out}");
        let data = dir.path().join("data");
        std::fs::write(&data, b"to sign").unwrap();
        let sign = |k: &Path| {
            vec![
                "-Y".to_string(),
                "sign".into(),
                "-n".into(),
                "file".into(),
                "-f".into(),
                format!("{}.pub", k.display()),
                data.display().to_string(),
            ]
        };
        let args = sign(&k1);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, out) = run_async("ssh-keygen", &a, &filter_sock).await;
        assert!(ok, "k1 signs through the filter: {out}");
        let _ = std::fs::remove_file(dir.path().join("data.sig"));
        let args = sign(&k2);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, out) = run_async("ssh-keygen", &a, &filter_sock).await;
        assert!(!ok, "k2 is not granted, yet it signed: {out}");
        // ssh-keygen gives up when the key is not listed, so ask the filter to sign with k2
        // directly (the owner's agent holds it): refused; the same request for k1 is signed
        let raw_sign = |k: &Path| {
            let line = std::fs::read_to_string(format!("{}.pub", k.display())).unwrap();
            let blob = base64::engine::general_purpose::STANDARD
                .decode(line.split_whitespace().nth(1).unwrap())
                .unwrap();
            let mut req = vec![SSH_AGENTC_SIGN_REQUEST];
            put_string(&mut req, &blob);
            put_string(&mut req, b"data to sign");
            req.extend_from_slice(&0u32.to_be_bytes());
            req
        };
        let mut conn = UnixStream::connect(&filter_sock).await.unwrap();
        write_message(&mut conn, &raw_sign(&k2)).await.unwrap();
        let reply = read_message(&mut conn).await.unwrap().unwrap();
        assert_eq!(
            reply,
            vec![SSH_AGENT_FAILURE],
            "k2 signed through the filter"
        );
        write_message(&mut conn, &raw_sign(&k1)).await.unwrap();
        let reply = read_message(&mut conn).await.unwrap().unwrap();
        assert_eq!(
            reply.first(),
            Some(&14),
            "k1 did not sign (SSH_AGENT_SIGN_RESPONSE)"
        );
        drop(conn);
        // The guest cannot change the owner's agent: remove, add, lock are refused.
        for args in [
            vec!["-D"],
            vec!["-d", k1.to_str().unwrap()],
            vec![k3.to_str().unwrap()],
        ] {
            let (ok, out) = run_async("ssh-add", &args, &filter_sock).await;
            assert!(!ok, "ssh-add {args:?} went through: {out}");
        }
        let (ok, out) = run("ssh-add", &["-l"], &owner_sock);
        assert!(
            ok && out.lines().count() == 2,
            "the owner's agent changed: {out}"
        );

        // All keys; then revoked while a connection is open: that connection lists nothing.
        boxery_home::grants::write_state(&home, "dev1", vec![entry("all", &owner_sock, None)])
            .unwrap();
        let mut conn = UnixStream::connect(&filter_sock).await.unwrap();
        assert_eq!(list_on(&mut conn).await, Some(2));
        boxery_home::grants::write_state(&home, "dev1", vec![]).unwrap();
        assert_eq!(list_on(&mut conn).await, Some(0));
        // The forward torn down: the open connection is closed, new ones are refused.
        filter.abort();
        let _ = filter.await;
        assert_eq!(list_on(&mut conn).await, None);
        drop(agent);
    }

    #[tokio::test]
    async fn the_guest_gets_ssh_auth_sock_once_with_its_agent_grants_and_not_without() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("agent.sock");
        let mut plan = crate::guest::Plan {
            url: "http://10.0.2.100".into(),
            channel: true,
            token: "bxt_t".into(),
            grants: vec![],
            vm: "dev1".into(),
            egress: Default::default(),
            display: None,
            dns: None,
        };
        let export = format!("export SSH_AUTH_SOCK={GUEST_SOCK}\n");
        let f = crate::guest::files(&plan, dir.path()).await;
        assert!(!f.env.contains("SSH_AUTH_SOCK"), "{}", f.env);
        // two grants (all keys of one agent, one key of it): one variable, the same socket
        plan.grants = vec![
            entry("all", &sock, None),
            entry(&format!("SHA256:{}", "A".repeat(43)), &sock, None),
        ];
        let f = crate::guest::files(&plan, dir.path()).await;
        assert_eq!(f.env.matches("SSH_AUTH_SOCK=").count(), 1, "{}", f.env);
        assert!(f.env.contains(&export), "{}", f.env);
        assert!(f.unavailable.is_empty());
        // the agent is told what it holds: a socket to sign with, no key
        assert!(
            f.context.contains("`ssh-agent:all`") && f.context.contains("$SSH_AUTH_SOCK"),
            "{}",
            f.context
        );
    }

    #[test]
    fn fingerprints_are_as_ssh_keygen_prints_them() {
        let dir = tempfile::tempdir().unwrap();
        let (k, fp) = key(dir.path(), "k");
        let line = std::fs::read_to_string(format!("{}.pub", k.display())).unwrap();
        let b64 = line.split_whitespace().nth(1).unwrap();
        let blob = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(fingerprint(&blob), fp);
    }

    #[test]
    fn identities_answers_read_back_and_garbage_is_not_one() {
        let keys = vec![(b"blob1".to_vec(), b"c1".to_vec()), (vec![], vec![])];
        assert_eq!(parse_identities(&identities_answer(&keys)), Some(keys));
        assert_eq!(parse_identities(&[SSH_AGENT_FAILURE]), None);
        let mut short = identities_answer(&[(b"blob".to_vec(), b"c".to_vec())]);
        short.pop();
        assert_eq!(parse_identities(&short), None);
        // a count larger than the keys that follow
        assert_eq!(parse_identities(&[12, 0, 0, 0, 9]), None);
    }

    #[tokio::test]
    async fn requests_other_than_list_and_sign_are_refused_without_an_agent() {
        // an upstream that would see any request passed on: it must see no connection
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let ups = vec![Upstream { socket, keys: None }];
        // add, remove, remove all, lock, unlock, add constrained, extension, empty
        for req in [
            vec![17u8],
            vec![18],
            vec![19],
            vec![22],
            vec![23],
            vec![25],
            vec![27],
            vec![],
        ] {
            assert_eq!(answer(&ups, &req).await, vec![SSH_AGENT_FAILURE], "{req:?}");
        }
        // a sign request with a cut blob
        assert_eq!(
            answer(&ups, &[13, 0, 0, 1, 0]).await,
            vec![SSH_AGENT_FAILURE]
        );
        let asked = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(asked.is_err(), "the upstream agent was asked");
    }
}
