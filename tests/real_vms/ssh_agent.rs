//! ssh-agent forwarding with approval (issue 33, docs/grants.md "ssh-agent grants"), on a real
//! Debian guest (OpenSSH's sshd: the `tiny` guest's dropbear forwards no unix sockets).
//!
//! A host ssh-agent the test starts (`ssh-agent -D -a SOCK`, killed by its PID on drop) holds
//! two keys the test makes. Without a grant, `boxery ssh -A` is refused saying how to ask for
//! one and the guest has no agent. After a person approves an `ssh-agent` grant naming one of
//! the keys, the guest lists exactly that key, signs with it and not with the other, cannot
//! change the owner's agent, and only its login user reaches the socket. After the grant is
//! revoked, a connection the guest held open is closed, the guest has no agent again within
//! a bounded time, and no forward is left on the host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Kind, RealHome, common};

/// How soon after `grant revoke` returns the guest must have lost the agent: the forward's
/// check runs every 2 s (reconcilers' `agent_forward::EVERY`), the grant's finalizer first.
const REVOKED_WITHIN: Duration = Duration::from_secs(10);

/// An `ssh-agent -D` this test started; killed by its PID on drop.
struct HostAgent {
    child: Child,
    sock: PathBuf,
}

impl HostAgent {
    fn start(dir: &Path) -> HostAgent {
        let sock = dir.join("agent.sock");
        let child = Command::new("ssh-agent")
            .arg("-D")
            .arg("-a")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("ssh-agent (openssh-client) is installed on the host");
        let up = common::eventually(Duration::from_secs(10), || sock.exists().then_some(()));
        assert!(
            up.is_some(),
            "ssh-agent made no socket at {}",
            sock.display()
        );
        HostAgent { child, sock }
    }
    /// `PROGRAM ARGS` with this agent as `SSH_AUTH_SOCK`: (success, stdout and stderr).
    fn with(&self, program: &str, args: &[&str]) -> (bool, String) {
        let o = Command::new(program)
            .args(args)
            .env("SSH_AUTH_SOCK", &self.sock)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{program} is installed on the host: {e}"));
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        (o.status.success(), text)
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh ed25519 key put in `agent` (its private file removed: only the agent holds it);
/// its fingerprint.
fn agent_key(agent: &HostAgent, dir: &Path, name: &str) -> String {
    let k = dir.join(name);
    let new_key = ["-q", "-t", "ed25519", "-N", "", "-C"];
    let args = [&new_key[..], &[name, "-f", k.to_str().unwrap()]].concat();
    let (ok, out) = agent.with("ssh-keygen", &args);
    assert!(ok, "{out}");
    let (ok, out) = agent.with("ssh-add", &[k.to_str().unwrap()]);
    assert!(ok, "{out}");
    std::fs::remove_file(&k).unwrap();
    let (ok, out) = agent.with("ssh-keygen", &["-lf", &format!("{}.pub", k.display())]);
    assert!(ok, "{out}");
    out.split_whitespace().nth(1).unwrap().to_string()
}

/// The host's `ssh` processes holding a forward to a guest's agent socket.
fn forwards_on_host() -> Vec<String> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.starts_with("ssh ") && c.contains("/run/boxery/agent."))
        .collect()
}

/// In the guest: connect to the agent, list its keys (print how many), wait for `/tmp/go`,
/// list again on the same connection (print how many, or `closed`).
const HELD: &str = r#"
import os, socket, struct, sys, time
def ask(s):
    s.sendall(struct.pack(">IB", 1, 11))
    head = s.recv(4)
    if len(head) < 4:
        return "closed"
    n = struct.unpack(">I", head)[0]
    body = b""
    while len(body) < n:
        c = s.recv(n - len(body))
        if not c:
            return "closed"
        body += c
    return str(struct.unpack(">I", body[1:5])[0]) if body[0] == 12 else "failure"
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["SSH_AUTH_SOCK"])
print(ask(s), flush=True)
while not os.path.exists("/tmp/go"):
    time.sleep(0.2)
try:
    print(ask(s), flush=True)
except OSError:
    print("closed", flush=True)
"#;

pub fn ssh_agent_forwarded_with_approval() {
    let h = RealHome::new(Kind::Qemu);
    h.home.write("config.yaml", "grants: {confirm: false}\n");
    let outside = tempfile::tempdir().unwrap();
    let agent = HostAgent::start(outside.path());
    let fp1 = agent_key(&agent, outside.path(), "granted");
    let fp2 = agent_key(&agent, outside.path(), "other");
    let serve = h.serve();
    serve.wait_leading();
    let f = h.home.write(
        "vm.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: sa1}\n\
         spec:\n  source: {image: debian-12}\n  resources: {cpus: 1, memory: 1Gi, disk: 10Gi}\n",
    );
    h.apply_file(&f, "20m");

    // No grant: `ssh -A` is refused, saying how to ask; the guest has no agent.
    let o = h.cmd(&["ssh", "-A", "sa1", "--", "true"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "ssh -A without a grant: {o:?}");
    assert!(
        err.contains("boxery grant sa1 ssh-agent:all"),
        "the refusal says how to ask: {err}"
    );
    assert_eq!(
        h.run("sa1", "ssh-add -l >/dev/null 2>&1; echo $?"),
        "2",
        "no agent in the guest without a grant"
    );
    assert!(forwards_on_host().is_empty(), "{:?}", forwards_on_host());

    // A person approves one key of the agent (the socket: this shell's SSH_AUTH_SOCK).
    let o = h.shell(&format!(
        "SSH_AUTH_SOCK={} \"$BOXERY\" grant sa1 ssh-agent:{fp1} --name sa1-agent --wait",
        agent.sock.display()
    ));
    assert!(o.status.success(), "grant: {o:?}");
    let approved = Instant::now();
    let listed = common::eventually(Duration::from_secs(60), || {
        let o = h.cmd(&["ssh", "-A", "sa1", "--", "ssh-add", "-l"]);
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
    })
    .unwrap_or_else(|| {
        panic!(
            "the guest never listed the granted key: {:?}\n{}",
            h.cmd(&["ssh", "-A", "sa1", "--", "ssh-add -l; ls -la /run/boxery"]),
            h.state_report()
        )
    });
    eprintln!(
        "ssh-agent: the granted key listed in the guest {:?} after `grant --wait` returned",
        approved.elapsed()
    );
    let one_run = Instant::now();
    h.run("sa1", "true");
    eprintln!(
        "ssh-agent: one `boxery run sa1 true` (for scale): {:?}",
        one_run.elapsed()
    );
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.contains(&fp1) && !listed.contains(&fp2), "{listed}");
    // Plain `run` (the agent's own commands) has it too, from the pushed environment.
    assert_eq!(
        h.run("sa1", "echo \"$SSH_AUTH_SOCK\""),
        "/run/boxery/ssh-agent.sock"
    );
    // It signs with the granted key; the other key, named by its public half, does not.
    let (ok, pub2) = agent.with("ssh-add", &["-L"]);
    assert!(ok);
    let pub2 = pub2
        .lines()
        .find(|l| l.ends_with(" other"))
        .unwrap()
        .to_string();
    let signed = h.run(
        "sa1",
        &format!(
            "cd /tmp && echo data > d && ssh-add -L > k1.pub && printf '%s\\n' '{pub2}' > k2.pub && \
             {{ ssh-keygen -q -Y sign -n file -f k1.pub d >/dev/null 2>&1 && echo k1-signed; }}; \
             {{ ssh-keygen -q -Y sign -n file -f k2.pub d >/dev/null 2>&1 && echo k2-signed || echo k2-refused; }}"
        ),
    );
    assert_eq!(signed, "k1-signed\nk2-refused");
    // The guest cannot change the owner's agent.
    assert_eq!(
        h.run("sa1", "ssh-add -D >/dev/null 2>&1; echo $?"),
        "1",
        "removing every key went through"
    );
    let (ok, all) = agent.with("ssh-add", &["-l"]);
    assert!(ok && all.lines().count() == 2, "{all}");
    // Only the login user reaches the socket.
    assert_eq!(
        h.run(
            "sa1",
            "stat -L -c '%U %a' /run/boxery/ssh-agent.sock; stat -c '%U %a' /run/boxery"
        ),
        "agent 600\nagent 700"
    );
    assert_eq!(
        h.run(
            "sa1",
            "sudo -n -u nobody env SSH_AUTH_SOCK=/run/boxery/ssh-agent.sock ssh-add -l >/dev/null 2>&1; echo $?"
        ),
        "2",
        "another user of the guest reached the agent"
    );
    assert_eq!(forwards_on_host().len(), 1, "{:?}", forwards_on_host());

    // A connection held open across the revocation.
    let held_py = h.home.write("held.py", HELD);
    h.ok(&["cp", held_py.to_str().unwrap(), "sa1:/tmp/held.py"]);
    h.run(
        "sa1",
        "rm -f /tmp/go /tmp/held.out; nohup python3 /tmp/held.py > /tmp/held.out 2>&1 < /dev/null & \
         for i in $(seq 50); do [ -s /tmp/held.out ] && break; sleep 0.2; done; cat /tmp/held.out",
    );

    // Revoked: gone from the guest within a bounded time, the held connection closed.
    h.ok(&["grant", "revoke", "sa1-agent"]);
    let revoked = Instant::now();
    // the host's side first (polled every 50 ms): the forward's ssh gone
    let cleared = common::eventually(REVOKED_WITHIN, || {
        forwards_on_host().is_empty().then(|| revoked.elapsed())
    });
    assert!(
        cleared.is_some(),
        "left on the host: {:?}",
        forwards_on_host()
    );
    eprintln!(
        "ssh-agent: the host's forward gone {:?} after `grant revoke` returned",
        cleared.unwrap()
    );
    let gone = common::eventually(REVOKED_WITHIN, || {
        (h.run("sa1", "ssh-add -l >/dev/null 2>&1; echo $?") != "0").then_some(())
    });
    assert!(
        gone.is_some(),
        "the guest still lists the key {REVOKED_WITHIN:?} after the revocation"
    );
    eprintln!(
        "ssh-agent: gone from the guest {:?} after `grant revoke` returned",
        revoked.elapsed()
    );
    let held = h.run(
        "sa1",
        "touch /tmp/go; for i in $(seq 50); do [ $(wc -l < /tmp/held.out) -ge 2 ] && break; sleep 0.2; done; cat /tmp/held.out",
    );
    let lines: Vec<&str> = held.lines().collect();
    assert_eq!(lines.first(), Some(&"1"), "before: {held}");
    assert!(
        matches!(lines.get(1), Some(&"closed") | Some(&"0")),
        "the connection held open across the revocation still lists keys: {held}"
    );
    let o = h.cmd(&["ssh", "-A", "sa1", "--", "true"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "ssh -A after the revocation: {o:?}"
    );
    assert!(
        h.run("sa1", "ls /run/boxery/ | grep -c agent || true") == "0",
        "the guest's agent sockets are removed"
    );

    h.ok(&["rm", "sa1", "--wait", "--timeout", "5m"]);
    drop(serve);
    drop(agent);
}
