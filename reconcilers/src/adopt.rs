//! A VM started from another VM's memory (a fork with memory, a VM made from a memory image,
//! a warm pool's member) continues that VM's processes with that VM's identity. Before it
//! is `Ready`, its guest is given its own over ssh: hostname, machine-id, ssh host key (then
//! pinned), MAC address and token file. The kernel's random pool was reseeded already, by the
//! VM's generation id, when the memory was loaded (docs/live-memory.md, "New VMs from memory,
//! and fork").
//!
//! # Guarantees
//! - The VM is not `Ready` (and so not handed to a lease, and no command of a caller waiting
//!   for it runs) until its guest holds its own identity: its status pins the new host key
//!   from birth, which the guest does not answer with until then.
//! - Idempotent: a step cut short (the control plane killed, the ssh connection dropped by the
//!   MAC change) is run again whole until the backend records it done
//!   ([`Backend::identity_taken`](boxery_backends::Backend::identity_taken)).
//! - Values travel on ssh's stdin, base64 in the script, never on a command line; every
//!   value that is not base64 in the script (hostname, machine-id, MAC) is checked first.
//!
//! # Caveats
//! - Between the memory's load and the end of this step (about a second on the tiny guest,
//!   8-14 s on an emulated Debian, most of it the network's pause after the MAC change) the
//!   guest runs with its source's hostname, machine-id and host key; nothing outside can
//!   reach it meanwhile but boxery, which pins the source's key for this step only.
//! - What applications keep in memory (their own keys, sessions, caches) is the source's.

use std::time::Duration;

use base64::Engine;
use boxery_backends::Inherited;

use crate::context::Ctx;

/// The longest the step may take.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Why an inherited identity cannot be turned into a script.
fn check(inh: &Inherited) -> Result<(), String> {
    let id = &inh.identity;
    // the hostname is the VM's name: a DNS label
    if let Err(e) = boxery_api::Name::label(&id.hostname) {
        return Err(format!("hostname `{}`: {e}", id.hostname));
    }
    if id.machine_id.len() != 32 || !id.machine_id.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err("the machine-id is not 32 hex digits".into());
    }
    if let Some(mac) = &inh.mac {
        let parts: Vec<&str> = mac.split(':').collect();
        if parts.len() != 6
            || !parts
                .iter()
                .all(|p| p.len() == 2 && p.bytes().all(|c| c.is_ascii_hexdigit()))
        {
            return Err(format!("`{mac}` is not a MAC address"));
        }
    }
    if id.host_key.is_none() {
        return Err("it has no host key".into());
    }
    Ok(())
}

/// The script (for `sh -s`, as the login user, root through `sudo -n` where needed) that gives
/// the guest the identity `inh` holds. Works on Debian (OpenSSH, which reads its host keys
/// per connection) and the tiny guest (dropbear, restarted by init with the new key).
pub fn script(inh: &Inherited) -> Result<String, String> {
    check(inh)?;
    let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
    let id = &inh.identity;
    let (private, public) = id.host_key.as_ref().ok_or("it has no host key")?;
    let token = id.proxy_token.as_deref().map(|t| b64(t.as_bytes()));
    let mut s = String::from(
        "set -e\n\
         b() { printf '%s' \"$1\" | base64 -d; }\n\
         S=; [ \"$(id -u)\" = 0 ] || S='sudo -n'\n",
    );
    // hostname
    s.push_str(&format!(
        "h={h}\n\
         $S hostname \"$h\"\n\
         printf '%s\\n' \"$h\" | $S tee /etc/hostname >/dev/null\n\
         if grep -q '^127\\.0\\.1\\.1' /etc/hosts 2>/dev/null; then $S sed -i \"s/^127\\.0\\.1\\.1[[:space:]].*/127.0.1.1 $h/\" /etc/hosts; fi\n",
        h = id.hostname
    ));
    // machine-id (the tiny guest keeps its own copy on its disk)
    s.push_str(&format!(
        "m={m}\n\
         printf '%s\\n' \"$m\" | $S tee /etc/machine-id >/dev/null\n\
         if [ -d /home/.boxery-guest ]; then printf '%s\\n' \"$m\" | $S tee /home/.boxery-guest/machine-id >/dev/null; fi\n\
         if [ -f /var/lib/dbus/machine-id ] && [ ! -L /var/lib/dbus/machine-id ]; then printf '%s\\n' \"$m\" | $S tee /var/lib/dbus/machine-id >/dev/null; fi\n",
        m = id.machine_id.to_ascii_lowercase()
    ));
    // ssh host key: OpenSSH reads it for each new connection (it re-executes itself for
    // each); dropbear is started again (busybox init respawns it; open sessions are its
    // children and stay)
    s.push_str(&format!(
        "k=/etc/ssh/boxery_host_ed25519_key\n\
         $S mkdir -p /etc/ssh\n\
         b {private} | $S tee \"$k.new\" >/dev/null\n\
         $S chmod 600 \"$k.new\"\n\
         $S mv \"$k.new\" \"$k\"\n\
         b {public} | $S tee \"$k.pub\" >/dev/null\n\
         if [ -f /run/dropbear.pid ] && command -v dropbearconvert >/dev/null 2>&1; then\n\
         \x20 $S dropbearconvert openssh dropbear \"$k\" /etc/dropbear/boxery_ed25519.new >/dev/null 2>&1\n\
         \x20 $S mv /etc/dropbear/boxery_ed25519.new /etc/dropbear/boxery_ed25519\n\
         \x20 echo /etc/dropbear/boxery_ed25519 | $S tee /run/boxery/hostkey >/dev/null\n\
         \x20 $S kill \"$(cat /run/dropbear.pid)\"\n\
         fi\n",
        private = b64(private.as_bytes()),
        public = b64(format!("{}\n", public.trim()).as_bytes()),
    ));
    // the token file the seed writes (the live one is pushed to /run/boxery once Ready)
    // (in the login user's home: the script may run as root through sudo)
    s.push_str(
        "if [ -n \"$SUDO_USER\" ]; then u=$SUDO_USER; bx=$(awk -F: -v u=\"$u\" '$1 == u { print $6 }' /etc/passwd)/.boxery\n\
         else u=$(id -u); bx=$HOME/.boxery; fi\n",
    );
    match token {
        Some(t) => s.push_str(&format!(
            "mkdir -p \"$bx\"\n\
             chmod 700 \"$bx\"\n\
             (umask 077; b {t} > \"$bx/token.new\")\n\
             chown \"$u:\" \"$bx\" \"$bx/token.new\" 2>/dev/null || true\n\
             mv \"$bx/token.new\" \"$bx/token\"\n"
        )),
        None => s.push_str("rm -f \"$bx/token\"\n"),
    }
    // MAC last: the change may drop this connection (the step is then run again, and finds
    // it done); a gratuitous ARP tells the VM's network the new address at once
    if let Some(mac) = &inh.mac {
        s.push_str(&format!(
            "a={mac}\n\
             d=$(ip route show default 2>/dev/null | awk '{{for (i = 1; i < NF; i++) if ($i == \"dev\") {{ print $(i+1); exit }}}}')\n\
             [ -n \"$d\" ] || d=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)\n\
             if [ -n \"$d\" ] && [ \"$(cat /sys/class/net/$d/address)\" != \"$a\" ]; then\n\
             \x20 echo 1 | $S tee /proc/sys/net/ipv4/conf/$d/arp_notify >/dev/null 2>&1 || true\n\
             \x20 $S ip link set dev \"$d\" address \"$a\"\n\
             fi\n",
            mac = mac.to_ascii_lowercase()
        ));
    }
    Ok(s)
}

/// Give running VM `vm` (at ssh `endpoint`) its own identity when it still runs with the one
/// it inherited from another VM's memory; `Ok` when it holds its own (or never inherited).
/// The error says why not, for the `Ready` condition; the next reconcile tries again.
pub async fn take(ctx: &Ctx, vm: &str, endpoint: &str) -> Result<(), String> {
    let inh = ctx.backend.inherited(vm).await.map_err(|e| e.chain())?;
    let Some(inh) = inh else { return Ok(()) };
    if let Some(ssh) = &ctx.ssh {
        let script = script(&inh)?;
        let t = std::time::Instant::now();
        let ran = run_with_key(
            ssh,
            vm,
            endpoint,
            &inh.answers_with,
            "sudo -n sh -s",
            &script,
        )
        .await;
        let ran = match ran {
            // the guest answers with its new key already: a step that ran whole before a
            // crash kept it from being recorded; done if the guest holds its own identity
            Err(e) if e.contains("Host key verification failed") => {
                let new = inh
                    .identity
                    .host_key
                    .as_ref()
                    .map(|(_, p)| p.as_str())
                    .unwrap_or("");
                run_with_key(ssh, vm, endpoint, new, "sh -s", &holds(&inh)?)
                    .await
                    .map_err(|c| format!("{e}; with its new key: {c}"))
            }
            r => r,
        };
        let secs = t.elapsed().as_secs_f64();
        if let Err(e) = &ran {
            tracing::info!(
                vm,
                secs,
                error = e.as_str(),
                "the identity step failed; it is run again"
            );
        }
        ran.map_err(|e| format!("giving the guest its own identity: {e}"))?;
        tracing::info!(vm, secs, "the identity script ran");
    }
    ctx.backend
        .identity_taken(vm)
        .await
        .map_err(|e| e.chain())?;
    tracing::info!(vm, "the guest took its own identity");
    Ok(())
}

/// Run `script` with `shell` on VM `vm` at `endpoint`, pinning `host_key` for this one
/// connection (no ControlMaster; a connection the MAC change cuts is given up within seconds).
async fn run_with_key(
    ssh: &crate::ssh::SshDir,
    vm: &str,
    endpoint: &str,
    host_key: &str,
    shell: &str,
    script: &str,
) -> Result<(), String> {
    let target = crate::ssh::Target {
        name: vm.to_string(),
        endpoint: endpoint.to_string(),
        host_key: host_key.trim().to_string(),
    };
    ssh.write(&target).map_err(|e| e.to_string())?;
    let opts = [
        "-o",
        "ControlPath=none",
        "-o",
        "ServerAliveInterval=1",
        "-o",
        "ServerAliveCountMax=3",
    ];
    let ran = crate::guest::run_script(ssh, vm, &opts, shell, script, TIMEOUT).await;
    // the files pinning this key go; the probe writes those of the key in status
    ssh.close(vm).await;
    ran
}

/// The script that succeeds when the guest holds the identity `inh` gives it (its hostname
/// and, where it has one, its MAC); the values checked as for [`script`].
fn holds(inh: &Inherited) -> Result<String, String> {
    check(inh)?;
    let mut s = format!("[ \"$(hostname)\" = {} ]\n", inh.identity.hostname);
    if let Some(mac) = &inh.mac {
        s.push_str(&format!(
            "grep -qix {} /sys/class/net/*/address\n",
            mac.to_ascii_lowercase()
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use boxery_backends::Identity;

    fn inherited() -> Inherited {
        Inherited {
            answers_with: "ssh-ed25519 AAAA parent".into(),
            identity: Identity {
                hostname: "child-1".into(),
                machine_id: "0123456789abcdef0123456789abcdef".into(),
                host_key: Some((
                    "-----BEGIN-----\n$(reboot)\n".into(),
                    "ssh-ed25519 AAAB c".into(),
                )),
                authorized_keys: vec![],
                proxy_token: Some("bxt_'; rm -rf /".into()),
                display: None,
            },
            mac: Some("52:54:00:AB:cd:01".into()),
        }
    }

    #[test]
    fn values_travel_as_base64_or_checked_words() {
        let s = script(&inherited()).unwrap();
        assert!(s.contains("h=child-1\n"));
        assert!(s.contains("a=52:54:00:ab:cd:01\n"));
        assert!(!s.contains("$(reboot)"), "the key is base64 in the script");
        assert!(!s.contains("rm -rf"), "the token is base64 in the script");
        assert!(s.contains("umask 077"));
    }

    #[test]
    fn hostile_words_are_refused() {
        let bad = |f: fn(&mut Inherited)| {
            let mut i = inherited();
            f(&mut i);
            script(&i).unwrap_err()
        };
        assert!(bad(|i| i.identity.hostname = "a;reboot".into()).contains("hostname"));
        assert!(bad(|i| i.identity.hostname = "-x".into()).contains("hostname"));
        assert!(bad(|i| i.identity.machine_id = "$(id)".into()).contains("machine-id"));
        assert!(bad(|i| i.mac = Some("52:54:00:12:34:5$".into())).contains("MAC"));
        assert!(bad(|i| i.identity.host_key = None).contains("host key"));
    }

    #[test]
    fn no_token_removes_the_inherited_one() {
        let mut i = inherited();
        i.identity.proxy_token = None;
        assert!(script(&i).unwrap().contains("rm -f \"$bx/token\""));
    }
}
