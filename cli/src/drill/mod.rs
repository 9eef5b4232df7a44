//! `boxery drill VM`: the isolation drill (docs/egress.md). Probes run live from inside the
//! VM against listeners the drill opens on the host, each "blocked" probe beside a control
//! that shows the probe itself works (the same connection from the host, or an allowed
//! target), and a table of probe, expected, result, control. Exit 0 only when every probe
//! matched and every control worked.
//!
//! # Guarantees
//! - Every listener answers with a nonce new to this run: a probe counts as having reached
//!   it only by reading that nonce, so nothing else listening can pass for it.
//! - The stand-ins for the internet (203.0.113.10, 2001:db8:77::10, documentation ranges),
//!   a LAN (10.255.77.10) and a metadata service (169.254.77.77: in 169.254/16, not the real
//!   169.254.169.254) listen in a network namespace `boxery-drill`, routed from the host over
//!   a veth pair `bxdrill0`, both made by the drill and removed after it (also
//!   one left by a killed drill); drills on one host take turns (a lock under `/run/lock`).
//!   Without the privilege to make it, those probes are skipped, which fails the drill.
//! - All guest probes run at once, each within [`PROBE_SECS`]: a drill takes seconds.
//!
//! # Parts
//! - [`plan`]: the probes as data (what each checks, how, what it should find, its control),
//!   made from the targets, the VM's egress policy and the guest's network as its backend
//!   wires it ([`boxery_backends::Backend::guest_network`]: the address the guest sees the
//!   host at, where other VMs' sshd are, whether a `Public` guest goes out directly);
//! - [`exec`]: runs a plan in the guest (one ssh session) and the controls from the host;
//! - [`standins`]: the listeners and the stand-ins' network namespace.
//!
//! What the drill reads of the store (the VM, a sibling, the way to reach the guest) it reads
//! through the verbs.

mod exec;
mod plan;
mod standins;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use boxery_api::Vm;
use boxery_hands::Voice;
use boxery_verbs::Verbs;

use plan::{Plan, Targets};
use standins::{Standins, host_address, response, serve};

/// Each probe's time limit in the guest, in seconds.
pub const PROBE_SECS: u32 = 4;
/// The host side of the stand-ins' veth pair.
pub const VETH: &str = "bxdrill0";
/// The stand-ins' network namespace.
pub const NETNS: &str = "boxery-drill";
/// The internet stand-in (TEST-NET-3: public-range, routed nowhere).
pub const INTERNET: &str = "203.0.113.10";
/// The IPv6 internet stand-in (documentation range).
pub const INTERNET6: &str = "2001:db8:77::10";
/// The host side of the veth pair.
pub const HOST_SIDE: &str = "198.51.100.1";
/// The LAN stand-in.
pub const LAN: &str = "10.255.77.10";
/// The metadata stand-in (link-local, like 169.254.169.254, which the drill leaves alone).
pub const METADATA: &str = "169.254.77.77";
/// A name nothing lists.
pub const UNLISTED: &str = "unlisted.drill.invalid";

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was probed.
    pub probe: String,
    /// What should happen.
    pub expected: String,
    /// What happened.
    pub result: String,
    /// The control's outcome.
    pub control: String,
    /// Whether the row passes.
    pub ok: bool,
}

/// Run the drill against `vm` (and a sibling): the table's rows.
pub async fn run(v: &Verbs, vm: &str, sibling: Option<&str>) -> Result<Vec<Row>> {
    let target = boxery_verbs::vm::get_vm(v, vm).await?;
    let backend = target.status.backend.clone().unwrap_or_default();
    let reach = v.reach(vm).await?;
    let hypervisor = boxery_backends::by_name(&backend, v.home())?;
    let net = hypervisor
        .guest_network(vm)
        .await?
        .with_context(|| format!("VM {vm}'s guest has no network on the {backend} backend"))?;
    let dns = hypervisor.guest_proxy(vm).is_some_and(|g| g.dns.is_some());
    // (a name mapped to an address no guest reaches has no answer whatever the policy)
    let resolve = boxery_verbs::env::read_config(v.home())?
        .proxy
        .egress
        .resolve
        .into_iter()
        .filter(|(_, ip)| boxery_api::network::forbidden(*ip).is_none())
        .map(|(name, _)| name)
        .collect();
    let sibling = sibling_of(v, &target, sibling).await?;
    // The guest side: where it reaches the proxy (waited for, bounded, before the host-wide
    // lock is taken).
    let proxy = home_proxy_url(&reach, vm)?;
    let _lock = take_turns(v.home())?;
    let nonce = boxery_backends::identity::proxy_token();
    let nonce = nonce.trim_start_matches("bxt_")[..16].to_string();
    let reply = response(&nonce);
    let listen = |a: SocketAddr| -> Result<SocketAddr> {
        let l = TcpListener::bind(a).with_context(|| format!("cannot listen on {a}"))?;
        let at = l.local_addr()?;
        serve(l, reply.clone());
        Ok(at)
    };
    let made = Standins::make();
    let targets = Targets {
        backend,
        net,
        policy: target.spec.network.egress.clone(),
        loopback: listen("127.0.0.1:0".parse()?)?,
        host: host_address()
            .map(|h| listen(SocketAddr::new(h, 0)))
            .transpose()?,
        sibling,
        standins: match &made {
            Ok(s) => Ok(bind_standins(s, &reply)?),
            Err(why) => Err(why.clone()),
        },
        dns,
        resolve,
    };
    let rows = exec::execute(&reach, vm, &Plan::of(&targets), &proxy, &nonce)?;
    drop(made);
    Ok(rows)
}

/// Drills on one host take turns (the stand-ins are host-wide): the lock, held until dropped.
fn take_turns(home: &Path) -> Result<std::fs::File> {
    std::fs::create_dir_all("/run/lock").ok();
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(p)
    };
    let lock = open(Path::new("/run/lock/boxery-drill.lock"))
        .or_else(|_| open(&boxery_home::layout::drill_lock(home)))
        .context("cannot open the drill's lock")?;
    lock.lock().context("cannot take the drill's lock")?;
    Ok(lock)
}

/// The sibling VM to probe and its ssh endpoint: `named` unless it is `target`, else the first
/// other ready VM on the same backend; `None` when there is none.
async fn sibling_of(
    v: &Verbs,
    target: &Vm,
    named: Option<&str>,
) -> Result<Option<(String, SocketAddr)>> {
    let info = boxery_verbs::objects::kind("Vm")?;
    let sel = boxery_verbs::objects::selector(None)?;
    let (objs, _) = boxery_verbs::objects::get(v, info, &[], &sel).await?;
    let mut vms = Vec::new();
    for o in objs {
        vms.push(o.to_typed::<Vm>()?);
    }
    let vm = target.metadata.name.as_str();
    let sib = vms.into_iter().find(|s| match named {
        Some(n) => s.metadata.name == n && n != vm,
        None => {
            s.metadata.name != vm
                && s.status.backend == target.status.backend
                && boxery_hands::not_ready(s, Voice::Cli).is_none()
        }
    });
    let Some((sname, endpoint)) = sib.as_ref().and_then(|s| {
        boxery_hands::ssh::Target::of(s).map(|t| (s.metadata.name.clone(), t.endpoint))
    }) else {
        return Ok(None);
    };
    let sa = endpoint
        .parse()
        .with_context(|| format!("VM {sname}'s ssh endpoint {endpoint}"))?;
    Ok(Some((sname, sa)))
}

/// The stand-ins' listeners, bound in their namespace and served with `reply`.
fn bind_standins(d: &Standins, reply: &[u8]) -> Result<plan::Standins> {
    let mut want = vec![
        SocketAddr::new(LAN.parse()?, 0),
        SocketAddr::new(METADATA.parse()?, 0),
        SocketAddr::new(INTERNET.parse()?, 0),
    ];
    if d.v6 {
        want.push(SocketAddr::new(INTERNET6.parse()?, 0));
    }
    let mut bound = Vec::new();
    for l in d.bind(want)? {
        bound.push(l.local_addr()?);
        serve(l, reply.to_vec());
    }
    Ok(plan::Standins {
        lan: bound[0],
        metadata: bound[1],
        internet: bound[2],
        internet6: bound.get(3).copied(),
    })
}

/// How long a drill waits for the guest's settings (`BOXERY_PROXY`, pushed by the control
/// plane a few seconds after the VM is ready): a drill right after `apply --wait` waits
/// instead of failing (issue 30, class 6).
const SETTINGS_WAIT: Duration = Duration::from_secs(90);

/// The credential proxy's base URL as the guest sees it, read from the guest's own env; waits
/// (at most [`SETTINGS_WAIT`], saying so on stderr) until the control plane has pushed it.
fn home_proxy_url(reach: &boxery_hands::Reach, vm: &str) -> Result<String> {
    let mut last_ssh_error = String::new();
    let mut next_note = Duration::from_secs(15);
    let read = |last_ssh_error: &mut String| -> Result<Option<String>> {
        let out = reach
            .std_command()
            .args([
                "-T",
                "--",
                &format!(
                    "{}printf '%s' \"${{BOXERY_PROXY:-}}\"",
                    boxery_hands::guest::SOURCE
                ),
            ])
            .stdin(Stdio::null())
            .output()
            .context("cannot run ssh")?;
        if !out.status.success() {
            *last_ssh_error = String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
                .to_string();
        }
        let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Ok((!url.is_empty()).then_some(url))
    };
    let found = poll_until(
        SETTINGS_WAIT,
        Duration::from_secs(1),
        || read(&mut last_ssh_error),
        |waited| {
            if waited.is_zero() {
                eprintln!(
                    "drill: waiting for VM {vm}'s guest settings (BOXERY_PROXY) from the control plane (at most {} s)…",
                    SETTINGS_WAIT.as_secs()
                );
            } else if waited >= next_note {
                eprintln!(
                    "drill: still waiting for VM {vm}'s guest settings ({} s)",
                    waited.as_secs()
                );
                next_note += Duration::from_secs(15);
            }
        },
    )?;
    match found {
        Some(url) => Ok(url),
        None => bail!(
            "VM {vm}'s guest still has no BOXERY_PROXY after {} s: the control plane pushes it once \
             the VM is ready; is a control plane running (`boxery service status`)?{}",
            SETTINGS_WAIT.as_secs(),
            if last_ssh_error.is_empty() {
                String::new()
            } else {
                format!(
                    " (last ssh error: {})",
                    boxery_verbs::render::safe(&last_ssh_error)
                )
            }
        ),
    }
}

/// Call `probe` until it gives a value or `timeout` has passed (then `Ok(None)`), every
/// `every`; `waiting` is told how long it has waited before each pause (zero the first
/// time). A probe's error ends the wait at once.
fn poll_until<T>(
    timeout: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
    mut waiting: impl FnMut(Duration),
) -> Result<Option<T>> {
    let start = std::time::Instant::now();
    let mut first = true;
    loop {
        if let Some(v) = probe()? {
            return Ok(Some(v));
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Ok(None);
        }
        waiting(if first { Duration::ZERO } else { waited });
        first = false;
        std::thread::sleep(every.min(timeout - waited));
    }
}

#[cfg(test)]
mod wait_tests {
    use super::*;

    /// A drill right after `apply --wait` waits for the guest's settings that come a little
    /// later, saying so once at the start, rather than failing at the first look; it gives up
    /// (None) only after its bound, and a probe's error ends it at once (issue 30, class 6).
    #[test]
    fn the_settings_wait_polls_until_they_come_bounded() {
        let mut calls = 0;
        let mut notes = Vec::new();
        let got = poll_until(
            Duration::from_secs(5),
            Duration::from_millis(10),
            || {
                calls += 1;
                Ok((calls == 4).then(|| "http://10.0.2.2:7391".to_string()))
            },
            |w| notes.push(w),
        )
        .unwrap();
        assert_eq!(got.as_deref(), Some("http://10.0.2.2:7391"));
        assert_eq!(calls, 4);
        assert_eq!(notes.len(), 3);
        assert!(notes[0].is_zero() && !notes[1].is_zero(), "{notes:?}");

        let start = std::time::Instant::now();
        let none: Option<String> = poll_until(
            Duration::from_millis(200),
            Duration::from_millis(20),
            || Ok(None),
            |_| {},
        )
        .unwrap();
        assert!(none.is_none());
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(2),
            "{took:?}"
        );

        let mut n = 0;
        let e = poll_until::<String>(
            Duration::from_secs(5),
            Duration::from_millis(10),
            || {
                n += 1;
                bail!("cannot run ssh")
            },
            |_| {},
        );
        assert!(e.is_err() && n == 1);
    }
}
