//! The libvirt network, the nwfilters every guest NIC references and the credential proxy's
//! port on the network's gateway: what `init` sets up.

use super::*;

/// The ports a home's credential proxy port is picked from (below Linux's ephemeral range, so
/// an outgoing connection of the host never holds one).
pub const PROXY_PORTS: std::ops::RangeInclusive<u16> = 24000..=24999;
/// The file under the state directory that keeps the port picked for this home.
const PROXY_PORT_FILE: &str = "proxy-port";

impl Inner {
    pub(super) fn gateway(&self, conn: &Connect) -> Result<String> {
        let net = conn
            .lookup_network_by_name(&self.config.network)
            .map_err(|e| {
                BackendError::failed(format!("find libvirt network {}", self.config.network), e)
            })?;
        let x = net
            .xml_desc(0)
            .map_err(|e| BackendError::failed("read the network", e))?;
        xml::network_gateway(&x).ok_or_else(|| {
            BackendError::Invalid(format!(
                "libvirt network {} has no IPv4 address: boxery needs a NAT network with DHCP",
                self.config.network
            ))
        })
    }

    /// The network's gateway, as an address. Blocking.
    pub(super) fn gateway_ip(&self, conn: &Connect) -> Result<IpAddr> {
        let gw = self.gateway(conn)?;
        gw.parse().map_err(|_| {
            BackendError::Invalid(format!(
                "libvirt network {} has the address {gw}, not an IP address",
                self.config.network
            ))
        })
    }

    /// Where this home's guests reach the credential proxy: the network's gateway and this
    /// home's port (kept for [`Backend::guest_proxy`]). Blocking.
    pub(super) fn proxy_addr(&self, conn: &Connect) -> Result<SocketAddr> {
        let ip = self.gateway_ip(conn)?;
        let addr = SocketAddr::new(ip, self.proxy_port(ip)?);
        *self.proxy.lock().unwrap_or_else(|p| p.into_inner()) = Some(addr);
        Ok(addr)
    }

    /// This home's proxy port: the configured one, else the one kept in `proxy-port`, else one
    /// picked now ([`pick_port`]) and kept (the first of two processes picking at once wins).
    pub(super) fn proxy_port(&self, gateway: IpAddr) -> Result<u16> {
        if let Some(p) = self.config.proxy_port {
            return Ok(p);
        }
        let file = self.dir.join(PROXY_PORT_FILE);
        if let Some(p) = read_port(&file)? {
            return Ok(p);
        }
        let port = pick_port(&self.ns, |p| {
            match std::net::TcpListener::bind((gateway, p)) {
                Ok(_) => true,
                Err(e) => e.kind() != std::io::ErrorKind::AddrInUse,
            }
        });
        std::fs::create_dir_all(&self.dir)
            .map_err(io(format!("creating {}", self.dir.display())))?;
        let tmp = self
            .dir
            .join(format!(".{PROXY_PORT_FILE}.tmp-{}", std::process::id()));
        std::fs::write(&tmp, format!("{port}\n"))
            .map_err(io(format!("writing {}", tmp.display())))?;
        let linked = std::fs::hard_link(&tmp, &file);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {
                info!(
                    port,
                    "picked the credential proxy's port on the libvirt network"
                );
                Ok(port)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read_port(&file)?
                .ok_or_else(|| BackendError::io(format!("reading {}", file.display()), e)),
            Err(e) => Err(BackendError::io(format!("writing {}", file.display()), e)),
        }
    }

    /// Define (or update) the three nwfilters: the isolation filter, then the guest filter that
    /// references it, then the confined filter (complete on its own). A filter already at this
    /// version ([`xml::filter_is_current`]) is left alone: redefining a filter makes libvirt
    /// rebuild the rules of every running guest on the host that uses it, and each guest's IPv4
    /// is unfiltered until libvirt has learnt its address again (a second or two), so a
    /// redefinition on every `init` (every command of every home) kept reopening that window. A
    /// filter that exists and cannot be changed (libvirt refuses a change it cannot apply to
    /// every running guest) stays as it is, with a warning.
    pub(super) fn define_filters(&self, conn: &Connect) -> Result<()> {
        for name in [xml::FILTER, xml::GUEST_FILTER, xml::CONFINED_FILTER] {
            let defined = conn.lookup_nwfilter_by_name(name).ok();
            if defined
                .as_ref()
                .and_then(|f| f.xml_desc(0).ok())
                .is_some_and(|x| xml::filter_is_current(name, &x))
            {
                continue;
            }
            let uuid = defined.and_then(|f| f.uuid_string().ok());
            let def = match name {
                xml::FILTER => xml::isolation_filter(uuid.as_deref()),
                xml::GUEST_FILTER => xml::guest_filter(uuid.as_deref()),
                _ => xml::confined_filter(uuid.as_deref()),
            };
            match conn.define_nwfilter_xml(&def) {
                Ok(_) => {}
                // another home defined it at the same moment
                Err(_) if uuid.is_none() && conn.lookup_nwfilter_by_name(name).is_ok() => {}
                Err(e) if uuid.is_none() => {
                    return Err(BackendError::failed(
                        format!("define the nwfilter {name}"),
                        e,
                    ));
                }
                Err(e) => warn!(
                    filter = name,
                    error = %e,
                    "could not update the nwfilter; the one defined stays"
                ),
            }
        }
        Ok(())
    }

    /// Give this home's running domains whose NIC references an older filter (the isolation
    /// filter alone, from before the proxy) or another proxy port the current filter, live: their
    /// guests reach the proxy without a restart. A confined NIC stays confined (only its port
    /// changes); one on the isolation filter alone gets the guest filter (the set_egress of
    /// the VM's next reconcile confines it if its policy says so). A failure is a warning; the
    /// next start defines the domain afresh anyway.
    pub(super) fn update_running_filters(&self, conn: &Connect, proxy: SocketAddr) -> Result<()> {
        if !self.config.isolation {
            return Ok(());
        }
        let doms = conn
            .list_all_domains(LIST_ALL)
            .map_err(|e| unreachable(format!("listing domains: {e}")))?;
        let prefix = self.domain_name("");
        let port_param = format!("<parameter name='PROXY_PORT' value='{}'/>", proxy.port());
        for dom in doms {
            if !dom.name().is_ok_and(|n| n.starts_with(&prefix)) {
                continue; // not ours: never read further
            }
            let Some(d) = self.ours(dom) else { continue };
            if !Self::is_running(&d) {
                continue; // its next start defines it afresh
            }
            let Ok(live) = d.dom.xml_desc(0) else {
                continue;
            };
            let stale: Vec<&str> = xml::interfaces(&live)
                .into_iter()
                .filter(|nic| match xml::filter_of(nic) {
                    Some(xml::FILTER) => true,
                    Some(f) if xml::is_guest_filter(f) => !nic.contains(&port_param),
                    _ => false,
                })
                .collect();
            if stale.is_empty() {
                continue;
            }
            // with the guest's address given, libvirt applies the whole filter at once; without
            // it, it would leave the guest's IPv4 unfiltered until it learned the address again
            // from the guest's next packet: no lease known, no live change (the next start)
            let Some(lease) = Self::lease_address(&d) else {
                info!(
                    vm = d.cfg.name.as_str(),
                    "the guest's NIC filter is older, and it has no lease: the current one applies at its next start"
                );
                continue;
            };
            for nic in stale {
                let confined = xml::filter_of(nic) == Some(xml::CONFINED_FILTER);
                let want = xml::filterref(
                    confined,
                    &proxy.ip().to_string(),
                    proxy.port(),
                    Some(&lease),
                );
                let Some(new) = xml::with_filterref(nic, &want) else {
                    continue;
                };
                match d.dom.update_device_flags(&new, AFFECT_LIVE) {
                    Ok(()) => info!(vm = d.cfg.name.as_str(), "the guest's NIC filter updated"),
                    Err(e) => warn!(
                        vm = d.cfg.name.as_str(),
                        error = %e,
                        "could not update the guest's NIC filter; it applies at its next start"
                    ),
                }
            }
        }
        Ok(())
    }

    /// Set up what the backend needs on libvirtd (see [`Backend::init`]): the pool, the
    /// filters, the network (with the host guard), the proxy's address, running guests moved
    /// to the current filter.
    pub(super) async fn init(self: &Arc<Self>) -> Result<()> {
        let _lock = self.lock("init").await?;
        self.call(|me, conn| {
            me.ensure_pool(conn)?;
            // the filters, defined when missing and updated when changed (libvirt
            // compares: an unchanged definition touches no guest)
            me.define_filters(conn)?;
            me.ensure_network(conn)?;
            // the credential proxy's address, for guest_proxy; running guests of an
            // older filter get the current one
            let proxy = me.proxy_addr(conn)?;
            me.update_running_filters(conn, proxy)
        })
        .await
    }

    /// The libvirt network, started (and autostarted), and with isolation on, the host guard
    /// on its bridge. Blocking.
    fn ensure_network(&self, conn: &Connect) -> Result<()> {
        let net = conn.lookup_network_by_name(&self.config.network).map_err(|e| {
            BackendError::Invalid(format!("libvirt network {} does not exist ({e}): define it (`virsh net-define`) or set BOXERY_LIBVIRT_NETWORK", self.config.network))
        })?;
        if !net.is_active().unwrap_or(false)
            && let Err(e) = net.create()
            && !net.is_active().unwrap_or(false)
        {
            return Err(BackendError::failed(
                format!("start libvirt network {}", self.config.network),
                e,
            ));
        }
        let _ = net.set_autostart(true);
        // no host address but the gateway's, whatever its range (hostguard.rs)
        if self.config.isolation {
            let x = net
                .xml_desc(0)
                .map_err(|e| BackendError::failed("read the network", e))?;
            if let (Some(bridge), Some(gw)) = (xml::network_bridge(&x), xml::network_gateway(&x)) {
                hostguard::ensure(&bridge, &gw)?;
            }
        }
        Ok(())
    }
}

/// The port kept in `file`, `None` when there is none yet.
fn read_port(file: &Path) -> Result<Option<u16>> {
    match std::fs::read_to_string(file) {
        Ok(s) => match s.trim().parse::<u16>() {
            Ok(p) if p != 0 => Ok(Some(p)),
            _ => Err(BackendError::Invalid(format!(
                "{} holds no port ({:?}): remove it (a port is picked again) or set BOXERY_LIBVIRT_PROXY_PORT",
                file.display(),
                s.trim()
            ))),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(BackendError::io(format!("reading {}", file.display()), e)),
    }
}

/// A port of [`PROXY_PORTS`] for namespace `ns`: the first that `free` accepts, starting at a
/// place given by the namespace (homes sharing a host start apart), else that first place.
fn pick_port(ns: &str, free: impl Fn(u16) -> bool) -> u16 {
    let (lo, hi) = (*PROXY_PORTS.start(), *PROXY_PORTS.end());
    let n = u32::from(hi - lo) + 1;
    let start = u32::from_str_radix(ns, 16).unwrap_or(0) % n;
    let at = |i: u32| lo + ((start + i) % n) as u16;
    (0..n).map(at).find(|p| free(*p)).unwrap_or(at(0))
}

#[cfg(test)]
mod tests {
    use super::{PROXY_PORTS, pick_port, read_port};

    #[test]
    fn a_proxy_port_per_home() {
        let a = pick_port("0000002a", |_| true);
        assert_eq!(a, PROXY_PORTS.start() + 42);
        assert_ne!(a, pick_port("0000002b", |_| true), "homes start apart");
        // taken ports are skipped, the range wraps, and with none free the first place stays
        assert_eq!(pick_port("0000002a", |p| p > a + 1), a + 2);
        assert_eq!(
            pick_port("000003e7", |p| p != *PROXY_PORTS.end()),
            *PROXY_PORTS.start()
        );
        assert_eq!(pick_port("0000002a", |_| false), a);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("proxy-port");
        assert_eq!(read_port(&f).unwrap(), None);
        std::fs::write(&f, "24007\n").unwrap();
        assert_eq!(read_port(&f).unwrap(), Some(24007));
        std::fs::write(&f, "x").unwrap();
        assert!(read_port(&f).is_err());
    }
}
