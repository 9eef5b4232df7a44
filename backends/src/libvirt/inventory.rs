//! What the backend observes of a VM: its inventory row, and what QEMU said last.

use super::*;

impl Inner {
    /// The inventory row of `d`, `None` when its disk is gone (Lost to the reconciler).
    pub(super) fn info(&self, d: &Dom) -> Option<VmInfo> {
        if !Self::active_disk(d).map(|p| p.exists()).unwrap_or(false) {
            return None;
        }
        let running = Self::is_running(d);
        let memory = if running { None } else { self.saved_memory(d) };
        let used = self
            .generations(&d.cfg.name)
            .unwrap_or_default()
            .iter()
            .map(|g| allocated_bytes(&self.vm_disk(&d.cfg.name, *g)))
            .sum();
        Some(VmInfo {
            name: d.cfg.name.clone(),
            mark: Some(d.cfg.mark.clone()),
            state: match (running, &memory) {
                (true, _) => PowerState::Running,
                (false, Some(_)) => PowerState::Suspended,
                (false, None) => PowerState::Stopped,
            },
            size: VmSize {
                cpus: d.cfg.cpus,
                memory_mib: d.cfg.memory_mib,
                disk_gib: d.cfg.disk_gib,
            },
            ssh: running
                .then(|| Self::lease_address(d))
                .flatten()
                .filter(|a| self.pin_address(d, a))
                .map(|a| format!("{a}:22")),
            disk_used_bytes: Some(used),
            degraded: None,
            memory,
            inherited: false,
        })
    }

    /// Our domains among those libvirt lists with `flags` (a domain not named by our prefix is
    /// never read further; one named so but not marked ours is skipped). Blocking.
    fn our_domains(&self, conn: &Connect, flags: u32) -> Result<Vec<Dom>> {
        let doms = conn
            .list_all_domains(flags)
            .map_err(|e| unreachable(format!("listing domains: {e}")))?;
        let prefix = self.domain_name("");
        Ok(doms
            .into_iter()
            .filter(|d| d.name().is_ok_and(|n| n.starts_with(&prefix)))
            .filter_map(|d| self.ours(d))
            .collect())
    }

    pub(super) async fn list(self: &Arc<Self>) -> Result<Vec<VmInfo>> {
        self.call(|me, conn| {
            let mut out: Vec<VmInfo> = me
                .our_domains(conn, LIST_ALL)?
                .iter()
                .filter_map(|d| me.info(d))
                .collect();
            if !conn.is_alive().unwrap_or(false) {
                return Err(unreachable(
                    "the connection to libvirtd dropped while listing",
                ));
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(out)
        })
        .await
    }
}

impl Inner {
    /// What each of our running domains uses: libvirt's CPU time of the domain, the RSS of
    /// its QEMU (its balloon-independent `rss` memory stat), and its NICs' byte counts.
    pub(super) async fn usage(self: &Arc<Self>) -> Result<Vec<crate::VmUsage>> {
        self.call(|me, conn| {
            let mut out = Vec::new();
            for d in me.our_domains(conn, virt::sys::VIR_CONNECT_LIST_DOMAINS_ACTIVE)? {
                let Ok(info) = d.dom.info() else { continue };
                let rss_kib = d
                    .dom
                    .memory_stats(0)
                    .unwrap_or_default()
                    .iter()
                    .find(|m| m.tag == virt::sys::VIR_DOMAIN_MEMORY_STAT_RSS)
                    .map_or(0, |m| m.val);
                let (mut rx, mut tx, mut counted) = (0u64, 0u64, false);
                if let Ok(text) = Self::xml_of(&d, 0) {
                    for dev in xml::interfaces(&text)
                        .into_iter()
                        .filter_map(xml::target_of)
                    {
                        if let Ok(st) = d.dom.interface_stats(dev) {
                            rx += st.rx_bytes.max(0) as u64;
                            tx += st.tx_bytes.max(0) as u64;
                            counted = true;
                        }
                    }
                }
                out.push(crate::VmUsage {
                    name: d.cfg.name.clone(),
                    cpu_seconds: info.cpu_time as f64 / 1e9,
                    rss_bytes: rss_kib.saturating_mul(1024),
                    network_rx_bytes: counted.then_some(rx),
                    network_tx_bytes: counted.then_some(tx),
                });
            }
            Ok(out)
        })
        .await
    }
}

/// Where libvirtd (system instance) keeps each QEMU domain's log.
pub(super) const DOMAIN_LOG_DIR: &str = "/var/log/libvirt/qemu";

/// From a libvirt domain log: what QEMU printed after the last start (its command line and
/// environment excluded), else the reason libvirt recorded for the shutdown.
pub(super) fn domain_log_last_words(log: &str) -> Option<String> {
    let start = log.rfind(": starting up libvirt version")?;
    let run = &log[start..];
    // After the "starting up" line: the environment and command line, one per line, each
    // but the last ending in `\`; then what QEMU said.
    let mut lines = run.lines().skip(1);
    for l in lines.by_ref() {
        if !l.ends_with('\\') {
            break;
        }
    }
    let said = lines
        .filter(|l| !l.starts_with("char device redirected"))
        .collect::<Vec<_>>()
        .join("\n");
    crate::last_words(&said).or_else(|| {
        let reason = run
            .lines()
            .rev()
            .find_map(|l| l.split("shutting down, reason=").nth(1))?;
        Some(format!("libvirt: shut down, reason {}", reason.trim()))
    })
}

#[cfg(test)]
mod tests {
    use super::domain_log_last_words;

    const START: &str = "2026-11-30 07:25:59.948+0000: starting up libvirt version: 11.3.0, package: 11.3.0-2~bpo12+1 (Debian)\nLC_ALL=C \\\nHOME=/var/lib/libvirt/qemu/domain-26-x \\\n/usr/bin/qemu-system-x86_64 \\\n-name guest=x,debug-threads=on \\\n-msg timestamp=on\n";

    #[test]
    fn what_qemu_said_after_the_last_start() {
        let crashed = format!(
            "{START}qemu-system-x86_64: earlier run\n2026-11-30 07:25:50.000+0000: shutting down, reason=destroyed\n{START}qemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion `x' failed.\n2026-11-30 07:26:03.802+0000: shutting down, reason=crashed\n"
        );
        assert_eq!(
            domain_log_last_words(&crashed).unwrap(),
            "qemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion `x' failed."
        );
        // SIGKILL: QEMU says nothing; libvirt's reason is what there is
        let killed =
            format!("{START}2026-11-30 07:26:03.802+0000: shutting down, reason=crashed\n");
        assert_eq!(
            domain_log_last_words(&killed).unwrap(),
            "libvirt: shut down, reason crashed"
        );
        assert_eq!(domain_log_last_words("no start line"), None);
    }
}
