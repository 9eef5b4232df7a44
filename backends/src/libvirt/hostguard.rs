//! The host guard: guests on the network's bridge reach no address of the host but the
//! gateway's (where the nwfilter then lets through DHCP, DNS and the proxy's port). The
//! nwfilter drops private, link-local and loopback destinations and the gateway's other
//! ports, but a host's address in a public range (its NIC's) would be reached by plain
//! routing: this rule closes that, for every address the host has now or later
//! (`-m addrtype --dst-type LOCAL`), in an iptables chain of boxery's own
//! (`BOXERY_GUEST_HOST`, first in `INPUT`).
//!
//! # Guarantees
//! - Idempotent: each rule is checked (`-C`) before it is added, never flushed, so homes
//!   sharing the bridge and repeated `init`s leave one copy and no gap.
//! - Found by `boxery drill` (a guest reached the host's 192.0.2.2 under `Public`); tested by
//!   it on every run (`tests/real_vms.rs` `libvirt::egress_drill_for_each_policy`).
//!
//! # Caveats
//! - Rules live in the kernel: after a host reboot they return with the first `init`
//!   (every boxery command and `serve` runs one before touching a guest).

use std::process::Command;

use crate::{BackendError, Result};

/// boxery's INPUT chain.
pub const CHAIN: &str = "BOXERY_GUEST_HOST";

fn iptables(args: &[&str]) -> Result<bool> {
    let out = Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .map_err(|e| {
            BackendError::Invalid(format!(
                "cannot run iptables ({e}): the libvirt backend needs it to keep guests off the \
                 host's addresses; run scripts/install-libvirt.sh"
            ))
        })?;
    Ok(out.status.success())
}

/// Keep guests on `bridge` off every host address but `gateway`.
pub fn ensure(bridge: &str, gateway: &str) -> Result<()> {
    let rule = [
        "-i",
        bridge,
        "!",
        "-d",
        gateway,
        "-m",
        "addrtype",
        "--dst-type",
        "LOCAL",
        "-j",
        "DROP",
    ];
    // The chain (an error when it exists already).
    let _ = iptables(&["-N", CHAIN])?;
    let mut check = vec!["-C", CHAIN];
    check.extend(rule);
    if !iptables(&check)? {
        let mut add = vec!["-A", CHAIN];
        add.extend(rule);
        if !iptables(&add)? {
            return Err(BackendError::Invalid(format!(
                "iptables refused the host guard ({}): guests could reach the host's addresses",
                add.join(" ")
            )));
        }
    }
    if !iptables(&["-C", "INPUT", "-j", CHAIN])? && !iptables(&["-I", "INPUT", "1", "-j", CHAIN])? {
        return Err(BackendError::Invalid(format!(
            "iptables refused `-I INPUT 1 -j {CHAIN}`: guests could reach the host's addresses"
        )));
    }
    Ok(())
}
