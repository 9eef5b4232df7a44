//! The XML boxery gives libvirt: the domain (with boxery's metadata mark), the storage pool and
//! the nwfilters. Pure functions, unit-tested without a daemon.

use crate::storage::records::VmConfig;

/// The XML namespace of boxery's domain metadata.
pub const META_URI: &str = "https://boxery.dev/xmlns/libvirt/vm/1";
/// The isolation nwfilter: what a guest may reach, with the host reduced to DHCP and DNS.
/// Domains defined before the credential proxy reference it directly.
pub const FILTER: &str = "boxery-guest-isolation";
/// The nwfilter on the interface of a guest whose egress policy is `Public`: [`FILTER`] plus
/// the credential proxy's port on the host ([`guest_filter`]).
pub const GUEST_FILTER: &str = "boxery-guest";
/// The nwfilter on the interface of a guest whose egress policy is `Allowlist` or `Deny`: DHCP
/// with the host, ssh from the host and the credential proxy's port, nothing else
/// ([`confined_filter`]).
pub const CONFINED_FILTER: &str = "boxery-guest-confined";

/// The filter a guest's interface references: [`CONFINED_FILTER`] when its egress is confined
/// (`Allowlist`, `Deny`), else [`GUEST_FILTER`].
pub fn guest_filter_name(confined: bool) -> &'static str {
    if confined {
        CONFINED_FILTER
    } else {
        GUEST_FILTER
    }
}

/// Whether `name` is one of the two filters this version puts on a guest's interface (both
/// take the same parameters, so libvirt accepts a live switch between them).
pub fn is_guest_filter(name: &str) -> bool {
    name == GUEST_FILTER || name == CONFINED_FILTER
}

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
    /// Kernel, initrd, command line (direct kernel boot); an empty kernel: the firmware
    /// boots the disk (a cloud image).
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
    /// Reference a filter at all (`BOXERY_NET_ISOLATION`).
    pub isolation: bool,
    /// Reference [`CONFINED_FILTER`] rather than [`GUEST_FILTER`] (egress `Allowlist`, `Deny`).
    pub confined: bool,
}

/// The domain XML.
pub fn domain(s: &DomainSpec<'_>) -> String {
    let cpu = if s.kind == "kvm" {
        "<cpu mode='host-passthrough'/>"
    } else {
        "<cpu mode='maximum'/>"
    };
    let filter = if s.isolation {
        filterref(s.confined, s.gateway, s.proxy_port, None)
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
    {boot}</os>
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
    <input type='tablet' bus='virtio'/>
    <video><model type='vga'/></video>
    <graphics type='vnc' sharePolicy='ignore'><listen type='none'/></graphics>
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
        boot = if s.kernel.is_empty() {
            // a cloud image: the firmware boots the disk's own bootloader
            "<boot dev='hd'/>".to_string()
        } else {
            format!(
                "<kernel>{}</kernel><initrd>{}</initrd><cmdline>{}</cmdline>",
                e(s.kernel),
                e(s.initrd),
                e(s.cmdline)
            )
        },
        disk = e(s.disk),
        seed = e(s.seed),
        mac = e(&s.cfg.mac),
        net = e(s.network),
        serial = e(s.serial),
    )
}

/// Whether a domain's XML (live or defined, either quote style) has the screen [`domain`]
/// gives it: a VGA video device and a virtio tablet. A domain started from a definition
/// older than that has none until it is started again.
pub fn has_screen(xml: &str) -> bool {
    // the opening tags named `tag`, up to their `>`
    let heads = |tag: &'static str| {
        xml.split(tag)
            .skip(1)
            .map(|rest| &rest[..rest.find('>').unwrap_or(rest.len())])
    };
    let vga = xml.split("<video>").skip(1).any(|video| {
        let video = &video[..video.find("</video>").unwrap_or(video.len())];
        video
            .split("<model ")
            .skip(1)
            .any(|m| attr(&m[..m.find('>').unwrap_or(m.len())], "type").as_deref() == Some("vga"))
    });
    let tablet = heads("<input ").any(|h| {
        attr(h, "type").as_deref() == Some("tablet") && attr(h, "bus").as_deref() == Some("virtio")
    });
    vga && tablet
}

/// Whether a domain's XML (live or defined, either quote style) has the console [`domain`]
/// gives it: a VNC display without a listener (`<graphics type='vnc'>`, reached only through
/// `virDomainOpenGraphics`). A domain started from a definition older than that has none
/// until it is started again. Its `sharePolicy='ignore'` lets every viewer in beside the
/// others, whatever it asks: `force-shared` turns away a client asking for exclusive access
/// (a `--control` viewer passes that through), and the default lets such a client turn the
/// others away.
pub fn has_console(xml: &str) -> bool {
    xml.split("<graphics ")
        .skip(1)
        .any(|g| attr(&g[..g.find('>').unwrap_or(g.len())], "type").as_deref() == Some("vnc"))
}

/// The `<filterref>` of a guest's NIC: [`CONFINED_FILTER`] when `confined`, else
/// [`GUEST_FILTER`], with the gateway and the proxy port (the same parameters for both).
/// `ip`: the guest's address when it is known (a running guest's lease): libvirt then applies
/// the whole filter at once, where it otherwise leaves the guest's IPv4 unfiltered until it has
/// learned the address from the guest's traffic: the backend gives it the lease address as
/// soon as it knows it, before it reports the guest reachable (`Inner::pin_address` in mod.rs).
pub fn filterref(confined: bool, gateway: &str, proxy_port: u16, ip: Option<&str>) -> String {
    let ip = ip
        .map(|ip| format!("<parameter name='IP' value='{}'/>", escape(ip)))
        .unwrap_or_default();
    let filter = guest_filter_name(confined);
    format!(
        "<filterref filter='{filter}'><parameter name='GATEWAY' value='{gw}'/><parameter name='DHCPSERVER' value='{gw}'/><parameter name='PROXY_PORT' value='{proxy_port}'/>{ip}<parameter name='CTRL_IP_LEARNING' value='any'/></filterref>",
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

/// The host device an `<interface>` element of a running domain is attached by
/// (`<target dev='vnet3'/>`), if any.
pub fn target_of(interface: &str) -> Option<&str> {
    let at = interface.find("<target dev=")? + "<target dev=".len();
    let q = interface[at..].chars().next()?;
    let rest = &interface[at + 1..];
    Some(&rest[..rest.find(q)?])
}

/// The name of the filter an `<interface>` element references, if any.
pub fn filter_of(interface: &str) -> Option<&str> {
    let at = interface.find("<filterref filter=")? + "<filterref filter=".len();
    let q = interface[at..].chars().next()?;
    let rest = &interface[at + 1..];
    Some(&rest[..rest.find(q)?])
}

/// The value of the filter parameter `name` of an `<interface>` element (`GATEWAY`, `IP`), as
/// libvirt shows it (either quote style).
pub fn filter_param(interface: &str, name: &str) -> Option<String> {
    let start = interface.find("<filterref ")?;
    let tail = &interface[start..];
    let body = &tail[..tail.find("</filterref>").unwrap_or(tail.len())];
    body.split("<parameter ").skip(1).find_map(|p| {
        let p = &p[..p.find('>')?];
        if attr(p, "name")? != name {
            return None;
        }
        attr(p, "value").map(|v| unescape(&v))
    })
}

/// The value of attribute `name` in the element text `elem` (either quote style), raw.
fn attr(elem: &str, name: &str) -> Option<String> {
    let mut rest = elem;
    loop {
        let at = rest.find(name)?;
        let before = rest[..at].chars().next_back();
        let after = &rest[at + name.len()..];
        if before.is_none_or(char::is_whitespace)
            && let Some(v) = after.strip_prefix('=')
            && let Some(q) = v.chars().next().filter(|c| *c == '\'' || *c == '"')
        {
            let v = &v[1..];
            return Some(v[..v.find(q)?].to_string());
        }
        rest = after;
    }
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

/// `interface` with its `<filterref>` replaced by `filterref`, or `filterref` added as its
/// last child when it has none.
pub fn set_filterref(interface: &str, filterref: &str) -> Option<String> {
    if interface.contains("<filterref ") {
        return with_filterref(interface, filterref);
    }
    let end = interface.rfind("</interface>")?;
    Some(format!(
        "{}{filterref}{}",
        &interface[..end],
        &interface[end..]
    ))
}

/// `interface`, a guest's NIC, moved to the filter of its egress (`confined`,
/// [`guest_filter_name`]), its other parameters kept: its `GATEWAY` and `PROXY_PORT` (`gateway`
/// and `proxy_port` when it has none: a NIC of an older version, or none at all), its `IP`,
/// else `ip` (the guest's lease, when known: libvirt then applies the new filter whole at once).
pub fn with_guest_filter(
    interface: &str,
    confined: bool,
    gateway: &str,
    proxy_port: u16,
    ip: Option<&str>,
) -> Option<String> {
    let gw = filter_param(interface, "GATEWAY").unwrap_or_else(|| gateway.to_string());
    let port = filter_param(interface, "PROXY_PORT")
        .and_then(|p| p.parse().ok())
        .unwrap_or(proxy_port);
    let ip = filter_param(interface, "IP").or_else(|| ip.map(str::to_string));
    set_filterref(interface, &filterref(confined, &gw, port, ip.as_deref()))
}

/// The `<interface>` elements of domain XML `xml` that are not on the filter of a VM's egress
/// (`confined`: its policy is `Allowlist` or `Deny`), which `set_egress` moves: when confined,
/// every NIC not on [`CONFINED_FILTER`] (also one on an older filter, or on none); else those
/// on [`CONFINED_FILTER`] (a NIC on an older filter is `init`'s to update, and the next start's).
pub fn egress_mismatches(xml: &str, confined: bool) -> Vec<&str> {
    interfaces(xml)
        .into_iter()
        .filter(|nic| (filter_of(nic) == Some(CONFINED_FILTER)) != confined)
        .collect()
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

/// The rules both complete filters start with: no MAC, IP or ARP spoofing, ARP and IPv4 only
/// at layer 2, DHCP with the host (`$GATEWAY`).
const GUARDS: &str = "  <filterref filter='no-mac-spoofing'/>
  <filterref filter='no-ip-spoofing'/>
  <filterref filter='no-arp-spoofing'/>
  <rule action='accept' direction='inout' priority='-500'><mac protocolid='arp'/></rule>
  <rule action='accept' direction='inout' priority='-500'><mac protocolid='ipv4'/></rule>
  <rule action='drop' direction='inout' priority='-400'/>
  <rule action='accept' direction='out' priority='100'><udp srcipaddr='0.0.0.0' dstipaddr='255.255.255.255' srcportstart='68' dstportstart='67' statematch='false'/></rule>
  <rule action='accept' direction='out' priority='100'><udp dstipaddr='$GATEWAY' srcportstart='68' dstportstart='67' statematch='false'/></rule>
  <rule action='accept' direction='in' priority='100'><udp srcipaddr='$GATEWAY' srcportstart='67' dstportstart='68' statematch='false'/></rule>
";

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
    let rules = format!(
        "{GUARDS}  <rule action='accept' direction='out' priority='110'><udp dstipaddr='$GATEWAY' dstportstart='53'/></rule>
  <rule action='accept' direction='out' priority='110'><tcp dstipaddr='$GATEWAY' dstportstart='53'/></rule>
  <rule action='accept' direction='in' priority='120'><tcp srcipaddr='$GATEWAY' dstportstart='22'/></rule>
  <rule action='drop' direction='out' priority='190'><all dstipaddr='$GATEWAY'/></rule>
{drops}  <rule action='accept' direction='out' priority='300'><all/></rule>
  <rule action='drop' direction='inout' priority='400'><all/></rule>
"
    );
    nwfilter(FILTER, uuid, &rules)
}

/// The filter on every guest NIC ([`GUEST_FILTER`]): the isolation filter, plus TCP from the
/// guest to the credential proxy on the host (`$GATEWAY:$PROXY_PORT`) and its replies, accepted
/// before the isolation filter's drops (libvirt orders the rules of a filter and the filters it
/// references by priority). `uuid` keeps the filter's identity when it is redefined.
pub fn guest_filter(uuid: Option<&str>) -> String {
    let rules = format!(
        "  <filterref filter='{FILTER}'/>
  <rule action='accept' direction='out' priority='110'><tcp dstipaddr='$GATEWAY' dstportstart='$PROXY_PORT'/></rule>
"
    );
    nwfilter(GUEST_FILTER, uuid, &rules)
}

/// The filter on the NIC of a guest whose egress is confined ([`CONFINED_FILTER`]; policy
/// `Allowlist` or `Deny`, where its HTTP(S) goes through the egress proxy on the credential
/// proxy's port): a complete filter, not the isolation filter's rules with exceptions. The same
/// anti-spoofing and layer-2 rules (ARP and IPv4 only, so no IPv6); DHCP with the host
/// (`$GATEWAY`); TCP from the guest to the credential proxy on the host
/// (`$GATEWAY:$PROXY_PORT`) and ssh into the guest from the host, with their replies
/// (connection tracking); everything else dropped: no DNS (so the guest cannot ask dnsmasq for
/// other guests' names), nothing NAT'd out, nothing of the LAN or of other guests. It takes the
/// same parameters as [`GUEST_FILTER`], so libvirt accepts a live switch between the two
/// (`Backend::set_egress`). `uuid` keeps the filter's identity when it is redefined.
pub fn confined_filter(uuid: Option<&str>) -> String {
    let rules = format!(
        "{GUARDS}  <rule action='accept' direction='out' priority='110'><tcp dstipaddr='$GATEWAY' dstportstart='$PROXY_PORT'/></rule>
  <rule action='accept' direction='in' priority='120'><tcp srcipaddr='$GATEWAY' dstportstart='22'/></rule>
  <rule action='drop' direction='inout' priority='400'><all/></rule>
"
    );
    nwfilter(CONFINED_FILTER, uuid, &rules)
}

/// The nwfilter `name` of `rules` (lines, each ending in a newline), with `uuid` (a filter's
/// identity, kept when it is redefined).
fn nwfilter(name: &str, uuid: Option<&str>, rules: &str) -> String {
    let uuid = uuid
        .map(|u| format!("<uuid>{}</uuid>", escape(u)))
        .unwrap_or_default();
    format!("<filter name='{name}' chain='root'>{uuid}\n{rules}</filter>\n")
}

/// Whether filter `name` as libvirt holds it (`xml`, its dump) is this version's: it has the
/// rule this version added last. **A change to any of the filters changes its mark here**, or
/// hosts that have the filter keep the old one.
pub fn filter_is_current(name: &str, xml: &str) -> bool {
    match name {
        // the explicit drop of the rest of the host's address
        FILTER => xml.contains("priority='190'"),
        // the credential proxy's port
        GUEST_FILTER => xml.contains("$PROXY_PORT"),
        // its first version: the proxy's port and ssh from the host, without the isolation
        // filter (a complete filter of its own)
        CONFINED_FILTER => {
            xml.contains("$PROXY_PORT")
                && xml.contains("dstportstart='22'")
                && !xml.contains(&format!("filter='{FILTER}'"))
        }
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

/// The bridge of a network's XML (`<bridge name='virbr0' …/>`).
pub fn network_bridge(xml: &str) -> Option<String> {
    let at = xml.find("<bridge ")?;
    let rest = &xml[at..xml[at..].find('>').map_or(xml.len(), |e| at + e)];
    let a = rest
        .find("name='")
        .map(|i| (i + 6, '\''))
        .or_else(|| rest.find("name=\"").map(|i| (i + 6, '"')))?;
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
        assert!(filter_is_current(
            CONFINED_FILTER,
            &confined_filter(Some("u"))
        ));
        assert!(
            !filter_is_current(CONFINED_FILTER, &guest_filter(None)),
            "the guest filter is not the confined one"
        );
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
        let spec = DomainSpec {
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
            confined: false,
        };
        let x = domain(&spec);
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
        assert!(x.contains(
            "<kernel>/p/k</kernel><initrd>/p/i</initrd><cmdline>console=ttyS0</cmdline>"
        ));
        assert!(!x.contains("<boot dev="));
        // a screen: VGA (text mode) and a virtio tablet, and a VNC display with no listener
        // (no port, no socket: reached through libvirt only)
        assert!(has_screen(&x) && has_console(&x), "{x}");
        assert!(
            x.contains("<input type='tablet' bus='virtio'/>\n    <video><model type='vga'/></video>\n    <graphics type='vnc' sharePolicy='ignore'><listen type='none'/></graphics>\n  </devices>"),
            "{x}"
        );
        assert_eq!(x.matches("<graphics").count(), 1, "{x}");
        // a cloud image: no kernel, the firmware boots the disk
        let y = domain(&DomainSpec {
            kernel: "",
            initrd: "",
            cmdline: "",
            ..spec
        });
        assert!(
            y.contains("<boot dev='hd'/></os>") && !y.contains("<kernel>"),
            "{y}"
        );
    }

    #[test]
    fn a_screen_as_libvirt_shows_it_live() {
        let live = r#"<domain type="qemu" id="3"><devices>
    <input type="tablet" bus="virtio">
      <alias name="input0"/>
      <address type="pci" domain="0x0000" bus="0x06" slot="0x00" function="0x0"/>
    </input>
    <input type="mouse" bus="ps2"><alias name="input1"/></input>
    <input type="keyboard" bus="ps2"><alias name="input2"/></input>
    <video>
      <model type="vga" vram="16384" heads="1" primary="yes"/>
      <alias name="video0"/>
    </video>
  </devices></domain>"#;
        assert!(has_screen(live));
        assert!(has_screen(&live.replace('"', "'")));
        // started before domains had a screen: libvirt's own PS/2 devices only
        let old = "<domain><devices><input type='mouse' bus='ps2'/><input type='keyboard' bus='ps2'/></devices></domain>";
        assert!(!has_screen(old));
        assert!(!has_screen(
            &live.replace("type=\"vga\"", "type=\"virtio\"")
        ));
        assert!(!has_screen(&live.replace("bus=\"virtio\"", "bus=\"usb\"")));
        // the console as libvirt shows it live, and a domain started before it had one
        let vnc = r#"<devices><graphics type="vnc" port="-1" autoport="yes">
      <listen type="none"/>
    </graphics></devices>"#;
        assert!(has_console(vnc) && has_console(&vnc.replace('"', "'")));
        assert!(!has_console(live));
        assert!(!has_console(&vnc.replace("\"vnc\"", "\"spice\"")));
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
    fn a_networks_bridge() {
        let x = "<network><name>default</name><forward mode='nat'/><bridge name='virbr0' stp='on' delay='0'/><ip address='192.168.122.1' netmask='255.255.255.0'/></network>";
        assert_eq!(network_bridge(x).as_deref(), Some("virbr0"));
        assert_eq!(
            network_bridge("<network><bridge stp='on'/></network>"),
            None
        );
        assert_eq!(network_bridge("<network/>"), None);
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
            &filterref(false, "192.168.122.1", 24001, Some("192.168.122.7")),
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

    /// The `$VARIABLES` filter `f` uses, sorted, once each.
    fn variables(f: &str) -> Vec<&str> {
        let mut vars: Vec<&str> = f
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
        vars
    }

    #[test]
    fn the_confined_filter_reaches_the_host_on_dhcp_and_the_proxy_port_only() {
        let f = confined_filter(Some("u-3"));
        assert!(f.contains("<uuid>u-3</uuid>"));
        assert!(f.starts_with(&format!("<filter name='{CONFINED_FILTER}' chain='root'>")));
        for spoof in ["no-mac-spoofing", "no-ip-spoofing", "no-arp-spoofing"] {
            assert!(
                f.contains(&format!("<filterref filter='{spoof}'/>")),
                "{spoof}"
            );
        }
        assert!(
            !f.contains(&format!("<filterref filter='{FILTER}'/>")),
            "a complete filter: the isolation filter's accept-all would let everything out"
        );
        // layer 2: ARP and IPv4, nothing else (no IPv6)
        assert!(f.contains(
            "<rule action='accept' direction='inout' priority='-500'><mac protocolid='arp'/></rule>"
        ));
        assert!(f.contains("<rule action='accept' direction='inout' priority='-500'><mac protocolid='ipv4'/></rule>"));
        assert!(f.contains("<rule action='drop' direction='inout' priority='-400'/>"));
        // the accepts: DHCP (3 rules), the proxy's port out, ssh in from the host
        let accepts: Vec<&str> = f
            .lines()
            .filter(|l| l.contains("action='accept'") && !l.contains("<mac "))
            .collect();
        assert_eq!(accepts.len(), 5, "{accepts:#?}");
        assert_eq!(
            accepts
                .iter()
                .filter(|l| l.contains("dstportstart='67'") || l.contains("dstportstart='68'"))
                .count(),
            3
        );
        let proxy = "<tcp dstipaddr='$GATEWAY' dstportstart='$PROXY_PORT'/>";
        assert!(f.contains(&format!(
            "<rule action='accept' direction='out' priority='110'>{proxy}</rule>"
        )));
        assert!(f.contains(
            "<rule action='accept' direction='in' priority='120'><tcp srcipaddr='$GATEWAY' dstportstart='22'/></rule>"
        ));
        assert!(!f.contains("dstportstart='53'"), "no DNS");
        assert!(f.ends_with(
            "<rule action='drop' direction='inout' priority='400'><all/></rule>\n</filter>\n"
        ));
        let last = priority(&f, "<all/></rule>");
        assert_eq!(last, 400, "everything else dropped, last");
        assert!(
            !f.contains("action='accept' direction='out' priority='300'"),
            "no accept-all"
        );
        assert!(priority(&f, proxy) < last);
        assert!(
            !accepts
                .iter()
                .any(|l| l.contains("<tcp") && l.contains("statematch")),
            "replies of the proxy's and ssh's connections come back (connection tracking)"
        );
    }

    /// libvirt accepts a live switch between two filters only when the domain has a value for
    /// every variable of the new one: the confined filter needs no variable the guest filter
    /// does not.
    #[test]
    fn the_confined_filter_needs_the_guest_filters_variables_only() {
        let guest = format!("{}{}", guest_filter(None), isolation_filter(None));
        let confined = confined_filter(None);
        assert_eq!(variables(&confined), ["GATEWAY", "PROXY_PORT"]);
        for v in variables(&confined) {
            assert!(variables(&guest).contains(&v), "{v}");
        }
        // and the filterref gives the same parameters to both
        let names = |r: &str| -> Vec<String> {
            r.split("<parameter name='")
                .skip(1)
                .map(|p| p[..p.find('\'').unwrap()].to_string())
                .collect()
        };
        let (a, b) = (
            filterref(false, "192.168.122.1", 24001, Some("192.168.122.7")),
            filterref(true, "192.168.122.1", 24001, Some("192.168.122.7")),
        );
        assert_eq!(names(&a), names(&b));
        assert_eq!(
            filter_of(&format!("<interface>{a}</interface>")),
            Some(GUEST_FILTER)
        );
        assert_eq!(
            filter_of(&format!("<interface>{b}</interface>")),
            Some(CONFINED_FILTER)
        );
        assert!(is_guest_filter(GUEST_FILTER) && is_guest_filter(CONFINED_FILTER));
        assert!(!is_guest_filter(FILTER) && !is_guest_filter("other"));
    }

    #[test]
    fn a_confined_domain_references_the_confined_filter() {
        let c = cfg();
        let spec = |confined| DomainSpec {
            domain: "bx-ab12-dev1",
            kind: "qemu",
            ns: "ab12",
            cfg: &c,
            disk: "/p/d.qcow2",
            seed: "/p/s.iso",
            kernel: "/p/k",
            initrd: "/p/i",
            cmdline: "",
            machine: "q35",
            serial: "/s.log",
            network: "default",
            gateway: "192.168.122.1",
            proxy_port: 24123,
            isolation: true,
            confined,
        };
        let x = domain(&spec(true));
        assert_eq!(filter_of(interfaces(&x)[0]), Some(CONFINED_FILTER));
        assert!(x.contains("<parameter name='PROXY_PORT' value='24123'/>"));
        assert_eq!(
            filter_of(interfaces(&domain(&spec(false)))[0]),
            Some(GUEST_FILTER)
        );
        let open = domain(&DomainSpec {
            isolation: false,
            ..spec(true)
        });
        assert_eq!(
            filter_of(interfaces(&open)[0]),
            None,
            "isolation off: no filter"
        );
    }

    #[test]
    fn a_nic_moves_between_the_guest_filters_with_its_parameters() {
        // as libvirt shows a running guest's NIC, its address pinned
        let live = "<interface type='network'>
      <mac address='52:54:00:01:02:03'/>
      <source network='default' portid='x' bridge='virbr0'/>
      <target dev='vnet3'/>
      <filterref filter='boxery-guest'>
        <parameter name='CTRL_IP_LEARNING' value='any'/>
        <parameter name='DHCPSERVER' value='192.168.122.1'/>
        <parameter name='GATEWAY' value='192.168.122.1'/>
        <parameter name='IP' value='192.168.122.7'/>
        <parameter name='PROXY_PORT' value='24001'/>
      </filterref>
      <alias name='net0'/>
    </interface>";
        assert_eq!(filter_param(live, "IP").as_deref(), Some("192.168.122.7"));
        assert_eq!(filter_param(live, "PROXY_PORT").as_deref(), Some("24001"));
        assert_eq!(filter_param(live, "NOPE"), None);
        assert_eq!(
            filter_param(
                "<interface><filterref filter=\"f\"><parameter value=\"1.2.3.4\" name=\"IP\"/></filterref></interface>",
                "IP"
            )
            .as_deref(),
            Some("1.2.3.4"),
            "either quote style, any order"
        );
        // the home's values and the lease are only the fallbacks: the NIC's own are kept
        let confined =
            with_guest_filter(live, true, "10.9.9.9", 24999, Some("192.168.122.99")).unwrap();
        assert_eq!(filter_of(&confined), Some(CONFINED_FILTER));
        for kept in [
            "<parameter name='GATEWAY' value='192.168.122.1'/>",
            "<parameter name='DHCPSERVER' value='192.168.122.1'/>",
            "<parameter name='PROXY_PORT' value='24001'/>",
            "<parameter name='IP' value='192.168.122.7'/>",
            "<parameter name='CTRL_IP_LEARNING' value='any'/>",
            "<target dev='vnet3'/>",
            "<alias name='net0'/>",
        ] {
            assert!(confined.contains(kept), "{kept} kept: {confined}");
        }
        let public = with_guest_filter(&confined, false, "10.9.9.9", 24999, None).unwrap();
        assert_eq!(filter_of(&public), Some(GUEST_FILTER));
        assert!(public.contains("<parameter name='IP' value='192.168.122.7'/>"));
        // a NIC of an older version (no PROXY_PORT, no IP): the home's port and the lease
        let old = "<interface type='network'><mac address='52:54:00:01:02:03'/><filterref filter='boxery-guest-isolation'><parameter name='GATEWAY' value='192.168.122.1'/></filterref></interface>";
        let moved = with_guest_filter(old, true, "10.9.9.9", 24999, Some("192.168.122.8")).unwrap();
        assert_eq!(filter_of(&moved), Some(CONFINED_FILTER));
        assert!(moved.contains("<parameter name='GATEWAY' value='192.168.122.1'/>"));
        assert!(moved.contains("<parameter name='PROXY_PORT' value='24999'/>"));
        assert!(moved.contains("<parameter name='IP' value='192.168.122.8'/>"));
        // a NIC without a filter gets one
        let bare = "<interface type='network'><mac address='52:54:00:01:02:03'/></interface>";
        let added = with_guest_filter(bare, true, "192.168.122.1", 24000, None).unwrap();
        assert_eq!(filter_of(&added), Some(CONFINED_FILTER));
        assert!(added.starts_with("<interface type='network'><mac address='52:54:00:01:02:03'/><filterref filter='boxery-guest-confined'>"));
        assert!(added.ends_with("</filterref></interface>"));
        assert!(
            !added.contains("name='IP'"),
            "no address known, none made up"
        );
    }

    #[test]
    fn the_nics_set_egress_moves() {
        let dom = |f: &str| {
            format!(
                "<domain><devices><interface type='network'><mac address='52:54:00:01:02:03'/>{f}</interface></devices></domain>"
            )
        };
        let on = |name: &str| dom(&format!("<filterref filter='{name}'/>"));
        for (x, confined, moved) in [
            (on(GUEST_FILTER), true, 1),
            (on(GUEST_FILTER), false, 0),
            (on(CONFINED_FILTER), true, 0),
            (on(CONFINED_FILTER), false, 1),
            (on(FILTER), true, 1),
            (on(FILTER), false, 0),
            (dom(""), true, 1),
            (dom(""), false, 0),
        ] {
            assert_eq!(
                egress_mismatches(&x, confined).len(),
                moved,
                "confined {confined}: {x}"
            );
        }
    }
}
