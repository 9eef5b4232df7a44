//! The XML boxery gives libvirt: the domain (with boxery's metadata mark), the storage pool and
//! the isolation nwfilter. Pure functions, unit-tested without a daemon.

use crate::storage::records::VmConfig;

/// The XML namespace of boxery's domain metadata.
pub const META_URI: &str = "https://boxery.dev/xmlns/libvirt/vm/1";
/// The isolation nwfilter: what a guest may reach, with the host reduced to DHCP and DNS.
/// Domains defined before the credential proxy reference it directly.
pub const FILTER: &str = "boxery-guest-isolation";
/// The nwfilter on every guest interface: [`FILTER`] plus the credential proxy's port on the
/// host ([`guest_filter`]).
pub const GUEST_FILTER: &str = "boxery-guest";

/// `s` with XML's five special characters escaped.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

/// The inverse of [`escape`].
pub fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// The metadata element: the namespace id and the VM's record as JSON.
pub fn metadata(ns: &str, cfg: &VmConfig) -> String {
    let json = serde_json::to_string(cfg).unwrap_or_default();
    format!("<vm ns=\"{}\">{}</vm>", escape(ns), escape(&json))
}

/// Parse [`metadata`] back: `(ns, record)`. Accepts the element with or without a namespace
/// prefix and either quote style (libvirt re-serialises it).
pub fn parse_metadata(xml: &str) -> Option<(String, VmConfig)> {
    let open = xml.find('<')?;
    let head_end = open + xml[open..].find('>')?;
    let head = &xml[open..head_end];
    let name = head[1..].split_whitespace().next()?;
    if name != "vm" && !name.ends_with(":vm") {
        return None;
    }
    let (at, q) = head
        .find(" ns=\"")
        .map(|i| (i + 5, '"'))
        .or_else(|| head.find(" ns='").map(|i| (i + 5, '\'')))?;
    let ns = unescape(&head[at..at + head[at..].find(q)?]);
    let body_end = xml.rfind("</")?;
    let cfg = serde_json::from_str(&unescape(&xml[head_end + 1..body_end])).ok()?;
    Some((ns, cfg))
}

/// What a domain is made of besides its record.
#[derive(Debug, Clone)]
pub struct DomainSpec<'a> {
    /// libvirt domain name (`bx-<ns>-<name>`).
    pub domain: &'a str,
    /// `kvm` or `qemu`.
    pub kind: &'a str,
    /// The namespace id.
    pub ns: &'a str,
    /// The VM's record (UUID, MAC, size: written into the XML and the metadata).
    pub cfg: &'a VmConfig,
    /// The active disk (qcow2).
    pub disk: &'a str,
    /// The seed ISO.
    pub seed: &'a str,
    /// Kernel, initrd, command line (direct kernel boot).
    pub kernel: &'a str,
    /// Initrd.
    pub initrd: &'a str,
    /// Kernel command line.
    pub cmdline: &'a str,
    /// Machine type (`q35`).
    pub machine: &'a str,
    /// Serial console log file.
    pub serial: &'a str,
    /// The libvirt network the NIC joins.
    pub network: &'a str,
    /// The network's gateway address (the host on that network), for the filter.
    pub gateway: &'a str,
    /// The credential proxy's port on the gateway, the one port of the host the guest reaches.
    pub proxy_port: u16,
    /// Reference the isolation filter.
    pub isolation: bool,
}

/// The domain XML.
pub fn domain(s: &DomainSpec<'_>) -> String {
    let cpu = if s.kind == "kvm" {
        "<cpu mode='host-passthrough'/>"
    } else {
        "<cpu mode='maximum'/>"
    };
    let filter = if s.isolation {
        filterref(s.gateway, s.proxy_port, None)
    } else {
        String::new()
    };
    let e = escape;
    format!(
        "<domain type='{kind}'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <metadata><boxery:vm xmlns:boxery='{META_URI}' ns='{ns}'>{meta}</boxery:vm></metadata>
  <memory unit='MiB'>{mem}</memory>
  <vcpu>{cpus}</vcpu>
  <os><type arch='x86_64' machine='{machine}'>hvm</type>
    <kernel>{kernel}</kernel><initrd>{initrd}</initrd><cmdline>{cmdline}</cmdline></os>
  {cpu}
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff><on_reboot>restart</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2' discard='unmap'/>
      <source file='{disk}'/><target dev='vda' bus='virtio'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='raw'/>
      <source file='{seed}'/><target dev='vdb' bus='virtio'/><readonly/></disk>
    <interface type='network'><mac address='{mac}'/><source network='{net}'/><model type='virtio'/>{filter}</interface>
    <serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <console type='file'><source path='{serial}'/><target type='serial' port='0'/></console>
    <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
    <memballoon model='none'/>
  </devices>
</domain>
",
        kind = e(s.kind),
        name = e(s.domain),
        uuid = e(&s.cfg.uuid),
        ns = e(s.ns),
        meta = e(&serde_json::to_string(s.cfg).unwrap_or_default()),
        mem = s.cfg.memory_mib,
        cpus = s.cfg.cpus,
        machine = e(s.machine),
        kernel = e(s.kernel),
        initrd = e(s.initrd),
        cmdline = e(s.cmdline),
        disk = e(s.disk),
        seed = e(s.seed),
        mac = e(&s.cfg.mac),
        net = e(s.network),
        serial = e(s.serial),
    )
}

/// The `<filterref>` of a guest's NIC: [`GUEST_FILTER`] with the gateway and the proxy port.
/// `ip`: the guest's address when it is known (a running guest's lease): libvirt then applies
/// the whole filter at once, where it otherwise leaves the guest's IPv4 unfiltered until it has
/// learned the address from the guest's traffic: the backend gives it the lease address as
/// soon as it knows it, before it reports the guest reachable (`Inner::pin_address` in mod.rs).
pub fn filterref(gateway: &str, proxy_port: u16, ip: Option<&str>) -> String {
    let ip = ip
        .map(|ip| format!("<parameter name='IP' value='{}'/>", escape(ip)))
        .unwrap_or_default();
    format!(
        "<filterref filter='{GUEST_FILTER}'><parameter name='GATEWAY' value='{gw}'/><parameter name='DHCPSERVER' value='{gw}'/><parameter name='PROXY_PORT' value='{proxy_port}'/>{ip}<parameter name='CTRL_IP_LEARNING' value='any'/></filterref>",
        gw = escape(gateway)
    )
}

/// The `<interface>` elements of a domain's XML, whole.
pub fn interfaces(xml: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(at) = rest.find("<interface ") {
        let Some(len) = rest[at..].find("</interface>") else {
            break;
        };
        let end = at + len + "</interface>".len();
        out.push(&rest[at..end]);
        rest = &rest[end..];
    }
    out
}

/// The name of the filter an `<interface>` element references, if any.
pub fn filter_of(interface: &str) -> Option<&str> {
    let at = interface.find("<filterref filter=")? + "<filterref filter=".len();
    let q = interface[at..].chars().next()?;
    let rest = &interface[at + 1..];
    Some(&rest[..rest.find(q)?])
}

/// `interface` with its `<filterref>` (self-closing or not) replaced by `filterref`.
pub fn with_filterref(interface: &str, filterref: &str) -> Option<String> {
    let start = interface.find("<filterref ")?;
    let tail = &interface[start..];
    let open_end = tail.find('>')?;
    let end = if tail[..open_end].ends_with('/') {
        open_end + 1
    } else {
        tail.find("</filterref>")? + "</filterref>".len()
    };
    Some(format!(
        "{}{filterref}{}",
        &interface[..start],
        &tail[end..]
    ))
}

/// A `dir` storage pool at `path`.
pub fn pool(name: &str, path: &str) -> String {
    format!(
        "<pool type='dir'><name>{}</name><target><path>{}</path><permissions><mode>0711</mode></permissions></target></pool>",
        escape(name),
        escape(path)
    )
}

/// An external disk-only snapshot of `vda` into `file` (the seed is left alone).
pub fn disk_snapshot(file: &str) -> String {
    format!(
        "<domainsnapshot><disks><disk name='vda' snapshot='external'><driver type='qcow2'/><source file='{}'/></disk><disk name='vdb' snapshot='no'/></disks></domainsnapshot>",
        escape(file)
    )
}

/// The isolation filter (seed 000's `boxery-guest-isolation`): no MAC, IP or ARP spoofing (the
/// guest's address is learned by DHCP snooping), DHCP and DNS only with the host (`$GATEWAY`),
/// ssh into the guest only from the host, everything else to the host's address on the network
/// dropped (whatever that address is), private, shared, link-local, loopback and multicast
/// destinations dropped (the host, other guests, the LAN, metadata services), the rest of the
/// internet allowed with connection tracking, IPv6 and every other layer-2 protocol dropped.
/// It uses only the variables every boxery domain has passed since the first version
/// (`GATEWAY`, `DHCPSERVER`, `CTRL_IP_LEARNING`): libvirt refuses a filter change that a
/// running domain lacks a variable for, so a new variable goes in [`guest_filter`].
/// `uuid` keeps the filter's identity when it is redefined.
pub fn isolation_filter(uuid: Option<&str>) -> String {
    let uuid = uuid
        .map(|u| format!("<uuid>{}</uuid>", escape(u)))
        .unwrap_or_default();
    let private = [
        ("10.0.0.0", 8),
        ("172.16.0.0", 12),
        ("192.168.0.0", 16),
        ("100.64.0.0", 10),
        ("169.254.0.0", 16),
        ("127.0.0.0", 8),
        ("224.0.0.0", 3),
        ("0.0.0.0", 8),
    ];
    let drops: String = private
        .iter()
        .map(|(a, m)| {
            format!(
                "  <rule action='drop' direction='out' priority='200'><all dstipaddr='{a}' dstipmask='{m}'/></rule>\n"
            )
        })
        .collect();
    format!(
        "<filter name='{FILTER}' chain='root'>{uuid}
  <filterref filter='no-mac-spoofing'/>
  <filterref filter='no-ip-spoofing'/>
  <filterref filter='no-arp-spoofing'/>
  <rule action='accept' direction='inout' priority='-500'><mac protocolid='arp'/></rule>
  <rule action='accept' direction='inout' priority='-500'><mac protocolid='ipv4'/></rule>
  <rule action='drop' direction='inout' priority='-400'/>
  <rule action='accept' direction='out' priority='100'><udp srcipaddr='0.0.0.0' dstipaddr='255.255.255.255' srcportstart='68' dstportstart='67' statematch='false'/></rule>
  <rule action='accept' direction='out' priority='100'><udp dstipaddr='$GATEWAY' srcportstart='68' dstportstart='67' statematch='false'/></rule>
  <rule action='accept' direction='in' priority='100'><udp srcipaddr='$GATEWAY' srcportstart='67' dstportstart='68' statematch='false'/></rule>
  <rule action='accept' direction='out' priority='110'><udp dstipaddr='$GATEWAY' dstportstart='53'/></rule>
  <rule action='accept' direction='out' priority='110'><tcp dstipaddr='$GATEWAY' dstportstart='53'/></rule>
  <rule action='accept' direction='in' priority='120'><tcp srcipaddr='$GATEWAY' dstportstart='22'/></rule>
  <rule action='drop' direction='out' priority='190'><all dstipaddr='$GATEWAY'/></rule>
{drops}  <rule action='accept' direction='out' priority='300'><all/></rule>
  <rule action='drop' direction='inout' priority='400'><all/></rule>
</filter>
"
    )
}

/// The filter on every guest NIC ([`GUEST_FILTER`]): the isolation filter, plus TCP from the
/// guest to the credential proxy on the host (`$GATEWAY:$PROXY_PORT`) and its replies, accepted
/// before the isolation filter's drops (libvirt orders the rules of a filter and the filters it
/// references by priority). `uuid` keeps the filter's identity when it is redefined.
pub fn guest_filter(uuid: Option<&str>) -> String {
    let uuid = uuid
        .map(|u| format!("<uuid>{}</uuid>", escape(u)))
        .unwrap_or_default();
    format!(
        "<filter name='{GUEST_FILTER}' chain='root'>{uuid}
  <filterref filter='{FILTER}'/>
  <rule action='accept' direction='out' priority='110'><tcp dstipaddr='$GATEWAY' dstportstart='$PROXY_PORT'/></rule>
</filter>
"
    )
}

/// Whether filter `name` as libvirt holds it (`xml`, its dump) is this version's: it has the
/// rule this version added last. **A change to either filter changes its mark here**, or hosts
/// that have the filter keep the old one.
pub fn filter_is_current(name: &str, xml: &str) -> bool {
    match name {
        // the explicit drop of the rest of the host's address
        FILTER => xml.contains("priority='190'"),
        // the credential proxy's port
        GUEST_FILTER => xml.contains("$PROXY_PORT"),
        _ => false,
    }
}

/// The first `<ip address='…'` of a network's XML (its gateway on the bridge).
pub fn network_gateway(xml: &str) -> Option<String> {
    let at = xml.find("<ip ")?;
    let rest = &xml[at..];
    let a = rest
        .find("address='")
        .map(|i| (i + 9, '\''))
        .or_else(|| rest.find("address=\"").map(|i| (i + 9, '"')))?;
    let end = a.0 + rest[a.0..].find(a.1)?;
    Some(rest[a.0..end].to_string())
}

/// The `<source file='…'/>` of disk `vda` in a domain's XML: the disk's own source, not the
/// sources of its `<backingStore>` (a running domain lists its whole chain).
pub fn vda_source(xml: &str) -> Option<String> {
    let at = xml.find("<target dev='vda'")?;
    let disk_start = xml[..at].rfind("<disk ")?;
    let disk = &xml[disk_start..at];
    let s = disk.find("<source file='")? + 14;
    let end = s + disk[s..].find('\'')?;
    Some(unescape(&disk[s..end]))
}

#[cfg(test)]
mod tests {

    #[test]
    fn this_versions_filters_are_current_and_older_ones_are_not() {
        assert!(filter_is_current(FILTER, &isolation_filter(Some("u"))));
        assert!(filter_is_current(GUEST_FILTER, &guest_filter(None)));
        let old = isolation_filter(None).replace(
            "<rule action='drop' direction='out' priority='190'><all dstipaddr='$GATEWAY'/></rule>",
            "",
        );
        assert!(!filter_is_current(FILTER, &old));
        assert!(!filter_is_current("other", &guest_filter(None)));
    }

    use super::*;

    fn cfg() -> VmConfig {
        VmConfig {
            name: "dev1".into(),
            mark: "uid-1".into(),
            uuid: "6f0b6a8e-6c3e-4a53-9f53-0b1a1c3d2e4f".into(),
            mac: "52:54:00:01:02:03".into(),
            port: 0,
            cpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            base: "tiny-abc".into(),
            instance_id: "iid-1".into(),
            hostname: "dev1".into(),
            host_key: Some("ssh-ed25519 AAAA <x>&'\"".into()),
            image: "img".into(),
            created: chrono::Utc::now(),
        }
    }

    #[test]
    fn metadata_round_trips() {
        let c = cfg();
        let (ns, back) = parse_metadata(&metadata("ab12", &c)).unwrap();
        assert_eq!(ns, "ab12");
        assert_eq!(back.host_key, c.host_key);
        assert_eq!(back.mark, "uid-1");
        // as libvirt returns it: the namespace prefix on the element
        let x = format!(
            "<boxery:vm xmlns:boxery=\"{META_URI}\" ns=\"ab12\">{}</boxery:vm>",
            escape(&serde_json::to_string(&c).unwrap())
        );
        assert_eq!(parse_metadata(&x).unwrap().1.name, "dev1");
        let y = format!(
            "<vm xmlns=\"{META_URI}\" ns='ab12'>{}</vm>",
            escape(&serde_json::to_string(&c).unwrap())
        );
        assert_eq!(parse_metadata(&y).unwrap().0, "ab12");
        assert!(parse_metadata("<other/>").is_none());
    }

    #[test]
    fn domain_xml_has_identity_filter_and_seed() {
        let c = cfg();
        let x = domain(&DomainSpec {
            domain: "bx-ab12-dev1",
            kind: "qemu",
            ns: "ab12",
            cfg: &c,
            disk: "/p/vm-dev1-1.qcow2",
            seed: "/p/vm-dev1-seed.iso",
            kernel: "/p/k",
            initrd: "/p/i",
            cmdline: "console=ttyS0",
            machine: "q35",
            serial: "/s.log",
            network: "default",
            gateway: "192.168.122.1",
            proxy_port: 24123,
            isolation: true,
        });
        assert!(x.contains("<domain type='qemu'>"));
        assert!(x.contains("<mac address='52:54:00:01:02:03'/>"));
        assert!(x.contains(&format!("<filterref filter='{GUEST_FILTER}'>")));
        assert!(x.contains("<parameter name='GATEWAY' value='192.168.122.1'/>"));
        assert!(x.contains("<parameter name='PROXY_PORT' value='24123'/>"));
        assert_eq!(interfaces(&x).len(), 1);
        assert_eq!(filter_of(interfaces(&x)[0]), Some(GUEST_FILTER));
        assert!(x.contains("<readonly/>"));
        assert!(x.contains("discard='unmap'"));
        assert_eq!(vda_source(&x).as_deref(), Some("/p/vm-dev1-1.qcow2"));
        let live = "<disk type='file' device='disk'><source file='/p/vm-2.qcow2'/><backingStore type='file'><source file='/p/vm-1.qcow2'/><backingStore type='file'><source file='/p/base.qcow2'/></backingStore></backingStore><target dev='vda' bus='virtio'/></disk>";
        assert_eq!(vda_source(live).as_deref(), Some("/p/vm-2.qcow2"));
        assert!(!x.contains("<x>"), "metadata is escaped");
    }

    #[test]
    fn gateway_of_a_network() {
        let n = "<network><name>default</name><ip address='192.168.122.1' netmask='255.255.255.0'/></network>";
        assert_eq!(network_gateway(n).as_deref(), Some("192.168.122.1"));
    }

    #[test]
    fn filter_drops_private_ranges_and_keeps_uuid() {
        let f = isolation_filter(Some("u-1"));
        assert!(f.contains("<uuid>u-1</uuid>"));
        for r in ["10.0.0.0", "172.16.0.0", "192.168.0.0", "169.254.0.0"] {
            assert!(f.contains(&format!("dstipaddr='{r}'")));
        }
        assert!(f.contains("no-arp-spoofing"));
    }

    /// The priority of the first rule of `f` that contains `what`.
    fn priority(f: &str, what: &str) -> i32 {
        let line = f.lines().find(|l| l.contains(what)).unwrap_or_else(|| {
            panic!("no rule with {what} in {f}");
        });
        let at = line.find("priority='").unwrap() + 10;
        line[at..at + line[at..].find('\'').unwrap()]
            .parse()
            .unwrap()
    }

    #[test]
    fn the_host_is_reached_only_on_dhcp_dns_and_the_proxy_port() {
        let iso = isolation_filter(None);
        // everything to the gateway is dropped, after DHCP, DNS and the proxy's accepts and
        // before the accept-all (also when the gateway is not a private address)
        let drop_gw = priority(&iso, "<all dstipaddr='$GATEWAY'/>");
        assert!(iso.contains(
            "<rule action='drop' direction='out' priority='190'><all dstipaddr='$GATEWAY'/>"
        ));
        assert!(drop_gw < priority(&iso, "<all/></rule>"));
        assert!(priority(&iso, "dstportstart='53'") < drop_gw);
        assert!(priority(&iso, "dstportstart='67'") < drop_gw);
        let guest = guest_filter(Some("u-2"));
        assert!(guest.contains("<uuid>u-2</uuid>"));
        assert!(guest.contains(&format!("<filterref filter='{FILTER}'/>")));
        let proxy = "<tcp dstipaddr='$GATEWAY' dstportstart='$PROXY_PORT'/>";
        assert!(guest.contains(proxy));
        assert!(
            priority(&guest, proxy) < drop_gw,
            "accepted before the drop"
        );
        assert!(priority(&guest, proxy) < priority(&iso, "dstipaddr='192.168.0.0'"));
        assert!(
            !guest.contains("statematch"),
            "replies come back (connection tracking)"
        );
    }

    /// libvirt refuses to change a filter that a running domain has no value for: the filter
    /// older domains reference uses only the variables they were defined with.
    #[test]
    fn the_isolation_filter_needs_no_new_variable() {
        let iso = isolation_filter(None);
        let mut vars: Vec<&str> = iso
            .split('$')
            .skip(1)
            .map(|v| {
                &v[..v
                    .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .unwrap()]
            })
            .collect();
        vars.sort_unstable();
        vars.dedup();
        assert_eq!(vars, ["GATEWAY"]);
    }

    #[test]
    fn filterref_of_a_live_interface_is_replaced() {
        // as libvirt shows a running domain's NIC, defined by an older boxery
        let live = "<domain><devices><disk/>
    <interface type='network'>
      <mac address='52:54:00:01:02:03'/>
      <source network='default' portid='x' bridge='virbr0'/>
      <target dev='vnet3'/>
      <model type='virtio'/>
      <filterref filter='boxery-guest-isolation'>
        <parameter name='CTRL_IP_LEARNING' value='any'/>
        <parameter name='DHCPSERVER' value='192.168.122.1'/>
        <parameter name='GATEWAY' value='192.168.122.1'/>
      </filterref>
      <alias name='net0'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </interface>
    <interface type='network'><mac address='52:54:00:09:09:09'/><filterref filter='other'/></interface>
  </devices></domain>";
        let ifs = interfaces(live);
        assert_eq!(ifs.len(), 2);
        assert_eq!(filter_of(ifs[0]), Some(FILTER));
        assert_eq!(filter_of(ifs[1]), Some("other"));
        let new = with_filterref(
            ifs[0],
            &filterref("192.168.122.1", 24001, Some("192.168.122.7")),
        )
        .unwrap();
        assert!(new.contains("<parameter name='IP' value='192.168.122.7'/>"));
        assert_eq!(filter_of(&new), Some(GUEST_FILTER));
        assert!(new.contains("<parameter name='PROXY_PORT' value='24001'/>"));
        for kept in [
            "<target dev='vnet3'/>",
            "<alias name='net0'/>",
            "slot='0x00'",
            "portid='x'",
        ] {
            assert!(new.contains(kept), "{kept} kept: {new}");
        }
        assert!(!new.contains("boxery-guest-isolation"));
        let short = with_filterref(ifs[1], "<filterref filter='b'/>").unwrap();
        assert_eq!(
            short,
            "<interface type='network'><mac address='52:54:00:09:09:09'/><filterref filter='b'/></interface>"
        );
        assert_eq!(with_filterref("<interface></interface>", "x"), None);
        assert_eq!(filter_of("<interface></interface>"), None);
    }
}
