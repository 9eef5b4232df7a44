//! The host firewall of this home's guests: two nftables tables of its own (`boxery-<ns>`, in
//! the `bridge` and `inet` families), made whole at `init` and again whenever a VM's egress
//! policy changes, in one `nft -f` transaction (never a moment without them once made).
//!
//! - **Guest → host**: from the bridge, the host accepts DHCP, the credential proxy's port on
//!   the gateway and, for a guest whose policy is `Public`, DNS on the gateway; replies to
//!   what the host opened (ssh) pass; everything else to any address of the host is dropped.
//! - **Guest → elsewhere** (routed, NAT): a confined guest (`Allowlist`, `Deny`: its web goes
//!   through the egress proxy on the proxy port) sends nothing, also on a connection it opened
//!   while it was `Public`; a `Public` guest reaches everything but private, CGNAT,
//!   link-local, loopback, multicast and reserved ranges; no IPv6 at all.
//! - **Elsewhere → guest**: nothing routed through the host opens a connection to a guest
//!   (another machine of the LAN that routes the bridge's subnet here); the host's own (its
//!   ssh) are not routed.
//! - **Fail closed**: a VM whose policy is anything but exactly `Public` (unknown, missing)
//!   is confined.
//! - **Guest → guest** never reaches this: the NICs are isolated bridge ports.
//!
//! Which guest is confined is told by its NIC's host-side name (set by boxery, [`veth_name`])
//! in the bridge table's `confined` set: the bridge family sees the port a frame came in on,
//! and marks it; the inet family, which does not, reads the mark. An address would not do: a
//! guest can change its own.

use std::fmt::Write as _;

use super::*;

/// The packet mark of a confined guest's traffic.
const CONFINED_MARK: &str = "0x0b0c0001";

/// The host-side name boxery gives instance `inst`'s NIC (home `ns`): `bv` and 8 hex digits.
pub(super) fn veth_name(ns: &str, inst: &str) -> String {
    format!(
        "bv{:08x}",
        boxery_api::fnv::fnv1a(format!("{ns}/{inst}").as_bytes()) as u32
    )
}

/// The ranges a `Public` guest never reaches (RFC 1918, CGNAT, link-local, loopback, this
/// network, multicast and reserved).
const FORBIDDEN: &str = "10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10, \
                         169.254.0.0/16, 127.0.0.0/8, 0.0.0.0/8, 224.0.0.0/3";

/// The whole ruleset for home `ns` with bridge `bridge`, gateway `gw`, proxy port `port` and
/// the confined guests' NIC names `confined`, as one `nft -f` transaction that replaces what
/// was there.
pub(super) fn ruleset(
    ns: &str,
    bridge: &str,
    gw: Ipv4Addr,
    port: u16,
    confined: &[String],
) -> String {
    let table = format!("boxery-{ns}");
    let mut s = String::new();
    // declare, delete, make: one transaction that works whether the tables exist or not
    for family in ["bridge", "inet"] {
        let _ = writeln!(s, "table {family} {table}\ndelete table {family} {table}");
    }
    let elements = if confined.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = confined.iter().map(|n| format!("\"{n}\"")).collect();
        format!(" elements = {{ {} }};", names.join(", "))
    };
    let _ = writeln!(
        s,
        "table bridge {table} {{\n  \
           set confined {{ type ifname;{elements} }}\n  \
           chain guests_in {{ type filter hook prerouting priority -300; policy accept;\n    \
             iifname @confined meta mark set {CONFINED_MARK}\n  }}\n}}"
    );
    let _ = writeln!(
        s,
        "table inet {table} {{\n  \
           chain to_host {{ type filter hook input priority 0; policy accept;\n    \
             iifname != \"{bridge}\" accept\n    \
             ct state established,related accept\n    \
             udp dport 67 accept\n    \
             ip daddr {gw} tcp dport {port} accept\n    \
             meta mark != {CONFINED_MARK} ip daddr {gw} meta l4proto {{ tcp, udp }} th dport 53 accept\n    \
             counter drop\n  }}\n  \
           chain out {{ type filter hook forward priority 0; policy accept;\n    \
             oifname \"{bridge}\" ct state new counter drop\n    \
             iifname != \"{bridge}\" accept\n    \
             meta mark {CONFINED_MARK} counter drop\n    \
             ct state established,related accept\n    \
             meta nfproto ipv6 counter drop\n    \
             ip daddr {{ {FORBIDDEN} }} counter drop\n  }}\n}}"
    );
    s
}

/// Remove home `ns`'s tables (when the home's network goes).
pub(super) fn teardown(ns: &str) -> String {
    let table = format!("boxery-{ns}");
    let mut s = String::new();
    for family in ["bridge", "inet"] {
        let _ = writeln!(s, "table {family} {table}\ndelete table {family} {table}");
    }
    s
}

/// Run `nft -f -` with `script`.
pub(super) async fn nft(script: &str) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            BackendError::Invalid(format!(
                "cannot run nft ({e}): the incus backend's firewall needs nftables \
                 (scripts/install-incus.sh)"
            ))
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(crate::io("writing the firewall rules to nft"))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(crate::io("running nft"))?;
    if !out.status.success() {
        return Err(BackendError::failed(
            "set the guests' firewall (nft)",
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(())
}

impl Inner {
    /// Make the firewall match the VMs' policies now (every instance's `user.boxery.egress`).
    /// One process at a time (a lock file in the state directory): a ruleset made from
    /// policies read before another process changed one would undo its change.
    pub(super) async fn apply_firewall(&self) -> Result<()> {
        let gw = (*self.gateway.lock().unwrap()).ok_or_else(|| {
            BackendError::failed("set the guests' firewall", "init has not read the network")
        })?;
        let _held = crate::storage::files::FileLock::acquire(self.state.join("firewall.lock"))
            .await
            .map_err(crate::io("locking the firewall"))?;
        let mut confined: Vec<String> = self
            .instances(&self.project)
            .await?
            .iter()
            // fail closed: only a VM known to be Public goes unconfined
            .filter(|i| instances::cfg(i, instances::EGRESS) != Some("Public"))
            .filter_map(|i| i["name"].as_str())
            .map(|inst| veth_name(&self.ns, inst))
            .collect();
        confined.sort();
        let made = nft(&ruleset(
            &self.ns,
            &self.network,
            gw,
            self.proxy_port(),
            &confined,
        ))
        .await;
        *self.firewall_seen.lock().unwrap() = made.is_ok().then(std::time::Instant::now);
        made
    }

    /// Whether this home's tables are in the kernel now (a host restart, an `nft flush
    /// ruleset` by a firewall service's reload, removes them).
    pub(super) async fn firewall_present(&self) -> Result<bool> {
        let out = tokio::process::Command::new("nft")
            .args(["list", "tables"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(crate::io("running nft"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let table = format!("boxery-{}", self.ns);
        let has = |family: &str| {
            text.lines()
                .any(|l| l.trim() == format!("table {family} {table}"))
        };
        Ok(out.status.success() && has("bridge") && has("inet"))
    }

    /// Make the firewall whole again when it is gone (see [`Inner::firewall_present`]), its
    /// last change failed, or this process has not made it yet. A firewall made or seen whole
    /// less than `max_age` ago is taken as it is: a booting VM is reconciled every 100 ms, and
    /// each would otherwise run `nft`.
    pub(super) async fn ensure_firewall(&self, max_age: std::time::Duration) -> Result<()> {
        let seen = *self.firewall_seen.lock().unwrap();
        if let Some(at) = seen {
            if at.elapsed() < max_age {
                return Ok(());
            }
            if self.firewall_present().await? {
                *self.firewall_seen.lock().unwrap() = Some(std::time::Instant::now());
                return Ok(());
            }
            tracing::warn!(
                namespace = %self.ns,
                "the guests' firewall tables were gone (a host restart, a ruleset flush): made again"
            );
        }
        self.apply_firewall().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_confines_the_named_nics_and_replaces_itself() {
        let r = ruleset(
            "0a1b2c3d",
            "bx0a1b2c3d",
            Ipv4Addr::new(10, 1, 2, 1),
            24001,
            &["bv00000001".into()],
        );
        assert!(r.starts_with("table bridge boxery-0a1b2c3d\ndelete table bridge"));
        assert!(r.contains("elements = { \"bv00000001\" }"));
        assert!(r.contains("ip daddr 10.1.2.1 tcp dport 24001 accept"));
        let none = ruleset("0a1b2c3d", "bx0a1b2c3d", Ipv4Addr::new(10, 1, 2, 1), 1, &[]);
        assert!(none.contains("set confined { type ifname; }"));
        assert_eq!(veth_name("a", "b"), veth_name("a", "b"));
        assert_ne!(veth_name("a", "b"), veth_name("c", "b"));
        assert_eq!(veth_name("a", "b").len(), 10);
    }
}
