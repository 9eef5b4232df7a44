//! The probe plan: every probe of a drill, what it checks and what it should find, as data
//! made from the drill's targets (the listeners, a sibling VM, the stand-ins), the VM's egress
//! policy and how its backend wires the guest's network. Nothing here touches the network.

use std::net::SocketAddr;

use boxery_api::network::{Egress, EgressPolicy};
use boxery_backends::GuestNetwork;

use super::{INTERNET, INTERNET6, NETNS, UNLISTED};

/// What a probe should find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// It reaches the listener.
    Reached,
    /// The connection goes nowhere.
    Blocked,
    /// The egress proxy refuses it (403, `x-boxery-egress: denied`).
    Denied,
    /// The egress proxy lets it through its policy (anything but a policy refusal).
    Passed,
    /// No answer (a name lookup).
    NoAnswer,
    /// An answer (a name lookup).
    Answer,
    /// The credential proxy refuses it: 401.
    Unauthorized,
    /// The credential proxy accepts the token (anything but 401).
    Authorized,
}

impl Expect {
    pub(super) fn word(self) -> &'static str {
        match self {
            Expect::Reached => "reached",
            Expect::Blocked => "blocked",
            Expect::Denied => "denied",
            Expect::Passed => "passed",
            Expect::NoAnswer => "no answer",
            Expect::Answer => "answer",
            Expect::Unauthorized => "401",
            Expect::Authorized => "token ok",
        }
    }
}

/// How a guest probe is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum How {
    /// A TCP connection to host:port, sending an HTTP GET (so a listener answers).
    Direct(String, u16),
    /// An absolute-form GET through the egress proxy.
    Get(String, u16),
    /// A CONNECT through the egress proxy.
    Connect(String, u16),
    /// A name lookup in the guest.
    Lookup(String),
    /// A credential-proxy request, with the VM's token or without.
    Token(bool),
}

/// What shows a blocked probe is not a broken probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Control {
    /// The same target from the host reaches it (reads the nonce, or `SSH-`).
    Host(SocketAddr, bool),
    /// Another probe of this drill (by name) got through.
    Probe(&'static str),
    /// None needed (the probe shows a thing reached).
    None,
}

/// One guest probe: what it checks (its row's name), how it is made, what it should find, and
/// what shows a failure to get through is not a broken probe.
#[derive(Debug, Clone)]
pub(super) struct Probe {
    /// What it checks, as the table's row names it.
    pub(super) name: String,
    /// Its key, for another probe's [`Control::Probe`].
    pub(super) key: &'static str,
    /// How the guest makes it.
    pub(super) how: How,
    /// What it should find.
    pub(super) expect: Expect,
    /// Its control.
    pub(super) control: Control,
}

/// The stand-ins' listeners, bound in their namespace.
#[derive(Debug, Clone, Copy)]
pub(super) struct Standins {
    /// The LAN stand-in.
    pub(super) lan: SocketAddr,
    /// The metadata stand-in.
    pub(super) metadata: SocketAddr,
    /// The internet stand-in.
    pub(super) internet: SocketAddr,
    /// The IPv6 internet stand-in, when the host has IPv6.
    pub(super) internet6: Option<SocketAddr>,
}

/// What a drill probes: its targets, the VM's policy and how the guest reaches the host.
#[derive(Debug, Clone)]
pub(super) struct Targets {
    /// The VM's backend (for messages).
    pub(super) backend: String,
    /// How the guest reaches the host (from the backend).
    pub(super) net: GuestNetwork,
    /// The VM's egress.
    pub(super) policy: Egress,
    /// A listener on the host's loopback.
    pub(super) loopback: SocketAddr,
    /// A listener on the host's other address, `None` when it has none.
    pub(super) host: Option<SocketAddr>,
    /// Another VM: its name and ssh endpoint.
    pub(super) sibling: Option<(String, SocketAddr)>,
    /// The stand-ins, or why they could not be made.
    pub(super) standins: Result<Standins, String>,
    /// Whether the control plane answers the guest's name lookups (its backend's
    /// `GuestProxy::dns`).
    pub(super) dns: bool,
    /// The names config `proxy.egress.resolve` maps to addresses a guest may reach: answered
    /// without the host's DNS, so a lookup's answer shows the policy and nothing else.
    pub(super) resolve: Vec<String>,
}

/// A drill's plan: the guest probes in the table's order, and what is skipped and why.
#[derive(Debug, Clone, Default)]
pub(super) struct Plan {
    /// The guest probes.
    pub(super) probes: Vec<Probe>,
    /// What cannot be probed (a row each, which fails the drill), and why.
    pub(super) skipped: Vec<(String, String)>,
}

impl Plan {
    /// The plan for `t`.
    pub(super) fn of(t: &Targets) -> Plan {
        let mut p = Plan::default();
        p.host(t);
        p.sibling(t);
        p.lookups(t);
        match &t.standins {
            Ok(s) => p.standins(t, s),
            Err(why) => p.skip(
                "stand-ins (internet, LAN, metadata, IPv6)",
                format!("cannot make the network namespace {NETNS} (run the drill as root): {why}"),
            ),
        }
        p.credential_proxy();
        p
    }

    fn push(
        &mut self,
        name: String,
        key: &'static str,
        how: How,
        expect: Expect,
        control: Control,
    ) {
        self.probes.push(Probe {
            name,
            key,
            how,
            expect,
            control,
        });
    }

    fn skip(&mut self, what: &str, why: String) {
        self.skipped.push((what.into(), why));
    }

    /// The host's loopback (directly at the gateway, and through the egress proxy by address
    /// and by a name that resolves to it) and its other address.
    fn host(&mut self, t: &Targets) {
        let (lo, gateway) = (t.loopback, t.net.gateway.to_string());
        let host = Control::Host(lo, false);
        self.push(
            format!("host loopback {lo}, direct via {gateway}"),
            "lo-direct",
            How::Direct(gateway, lo.port()),
            Expect::Blocked,
            host.clone(),
        );
        self.push(
            format!("host loopback {lo}, through the egress proxy"),
            "lo-proxy",
            How::Get("127.0.0.1".into(), lo.port()),
            Expect::Denied,
            host.clone(),
        );
        self.push(
            format!(
                "localhost:{} (a name that resolves to loopback), proxy",
                lo.port()
            ),
            "rebind",
            How::Get("localhost".into(), lo.port()),
            Expect::Denied,
            host,
        );
        let Some(a) = t.host else {
            return self.skip("host address", "the host has no global IPv4 address".into());
        };
        let h = a.ip().to_string();
        self.push(
            format!("host address {a}, direct"),
            "host-direct",
            How::Direct(h.clone(), a.port()),
            Expect::Blocked,
            Control::Host(a, false),
        );
        self.push(
            format!("host address {a}, through the egress proxy"),
            "host-proxy",
            How::Get(h, a.port()),
            Expect::Denied,
            Control::Host(a, false),
        );
    }

    /// Another guest's sshd (directly where the guest would reach it, and through the egress
    /// proxy) and its name.
    fn sibling(&mut self, t: &Targets) {
        let Some((sname, sa)) = &t.sibling else {
            return self.skip(
                "another VM",
                format!(
                    "no other ready VM on the {} backend: start one or name it with --sibling",
                    t.backend
                ),
            );
        };
        let direct = t.net.ssh_target(*sa);
        self.push(
            format!("VM {sname}'s sshd ({sa}), direct"),
            "sib-direct",
            How::Direct(direct.ip().to_string(), direct.port()),
            Expect::Blocked,
            Control::Host(*sa, true),
        );
        self.push(
            format!("VM {sname}'s sshd ({sa}), through the egress proxy"),
            "sib-proxy",
            How::Connect(sa.ip().to_string(), sa.port()),
            Expect::Denied,
            Control::Host(*sa, true),
        );
        self.push(
            format!("name lookup of VM {sname}"),
            "sib-dns",
            How::Lookup(sname.clone()),
            Expect::NoAnswer,
            Control::Probe("dns-control"),
        );
    }

    /// Name lookups: localhost (the guest's own, which shows the lookup works), and where the
    /// control plane answers the guest's lookups, a name it answers by itself that the policy
    /// allows (an answer) and one it does not (none). Without such names (config
    /// `proxy.egress.resolve`), or on a backend whose guests use their network's own DNS,
    /// there is nothing to probe: no row, not a failure.
    fn lookups(&mut self, t: &Targets) {
        self.push(
            "name lookup of localhost (the lookup works)".into(),
            "dns-control",
            How::Lookup("localhost".into()),
            Expect::Answer,
            Control::None,
        );
        if !t.dns {
            return;
        }
        let allowed = t.resolve.iter().find(|n| t.policy.allows_name(n));
        let refused = t.resolve.iter().find(|n| !t.policy.allows_name(n));
        if let Some(n) = allowed {
            self.push(
                format!("name lookup of {n} (allowed)"),
                "dns-allowed",
                How::Lookup(n.clone()),
                Expect::Answer,
                Control::None,
            );
        }
        if let Some(n) = refused {
            self.push(
                format!("name lookup of {n} (not allowed)"),
                "dns-refused",
                How::Lookup(n.clone()),
                Expect::NoAnswer,
                Control::Probe(if allowed.is_some() {
                    "dns-allowed"
                } else {
                    "dns-control"
                }),
            );
        }
    }

    /// The LAN, metadata and internet stand-ins, and names through the policy.
    fn standins(&mut self, t: &Targets, s: &Standins) {
        for (what, a) in [("LAN stand-in", s.lan), ("metadata stand-in", s.metadata)] {
            let ip = a.ip().to_string();
            self.push(
                format!("{what} {a}, direct"),
                "private-direct",
                How::Direct(ip.clone(), a.port()),
                Expect::Blocked,
                Control::Host(a, false),
            );
            self.push(
                format!("{what} {a}, through the egress proxy"),
                "private-proxy",
                How::Get(ip, a.port()),
                Expect::Denied,
                Control::Host(a, false),
            );
        }
        let net = s.internet;
        let public = t.policy.policy == EgressPolicy::Public;
        let via = if public {
            Expect::Reached
        } else {
            Expect::Denied
        };
        self.push(
            format!("internet stand-in {net}, direct (raw TCP)"),
            "net-direct",
            How::Direct(INTERNET.into(), net.port()),
            if t.net.direct_public && public {
                Expect::Reached
            } else {
                Expect::Blocked
            },
            Control::Host(net, false),
        );
        self.push(
            format!("internet stand-in {net}, GET through the egress proxy"),
            "net-get",
            How::Get(INTERNET.into(), net.port()),
            via,
            Control::Host(net, false),
        );
        self.push(
            format!("internet stand-in {net}, CONNECT through the egress proxy"),
            "net-connect",
            How::Connect(INTERNET.into(), net.port()),
            via,
            Control::Host(net, false),
        );
        match s.internet6 {
            Some(net6) => self.push(
                format!("IPv6 internet stand-in {net6}, direct"),
                "v6-direct",
                How::Direct(INTERNET6.into(), net6.port()),
                Expect::Blocked,
                Control::Host(net6, false),
            ),
            None => self.skip("IPv6", "the host has IPv6 off".into()),
        }
        self.names(t, net);
    }

    /// Names through the policy: a listed one (under `Allowlist`) and one nothing lists.
    fn names(&mut self, t: &Targets, net: SocketAddr) {
        let allowlist = t.policy.policy == EgressPolicy::Allowlist;
        if allowlist {
            let allowed = t.policy.allow.first().map(|a| match a.strip_prefix("*.") {
                Some(s) => format!("drill.{s}"),
                None => a.clone(),
            });
            match allowed {
                Some(name) => self.push(
                    format!("{name} (listed), through the egress proxy"),
                    "name-allowed",
                    How::Get(name, net.port()),
                    Expect::Passed,
                    Control::None,
                ),
                None => self.skip("a listed name", "the allow list is empty".into()),
            }
        }
        self.push(
            format!("{UNLISTED} (not listed), through the egress proxy"),
            "name-unlisted",
            How::Get(UNLISTED.into(), net.port()),
            if t.policy.policy == EgressPolicy::Public {
                Expect::Passed
            } else {
                Expect::Denied
            },
            if allowlist {
                Control::Probe("name-allowed")
            } else {
                Control::Host(net, false)
            },
        );
    }

    /// The credential proxy, without a token and with the VM's.
    fn credential_proxy(&mut self) {
        self.push(
            "credential proxy without a token".into(),
            "token-none",
            How::Token(false),
            Expect::Unauthorized,
            Control::Probe("token-ok"),
        );
        self.push(
            "credential proxy with the VM's token".into(),
            "token-ok",
            How::Token(true),
            Expect::Authorized,
            Control::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(net: GuestNetwork, policy: EgressPolicy) -> Targets {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        Targets {
            backend: "test".into(),
            net,
            policy: Egress {
                policy,
                ..Default::default()
            },
            loopback: a("127.0.0.1:4001"),
            host: None,
            sibling: Some(("e2".into(), a("127.0.0.1:2222"))),
            standins: Ok(Standins {
                lan: a("10.255.77.10:4002"),
                metadata: a("169.254.77.77:4003"),
                internet: a("203.0.113.10:4004"),
                internet6: None,
            }),
            dns: true,
            resolve: vec!["internet.drill.test".into(), "unlisted.drill.test".into()],
        }
    }

    fn probe<'p>(p: &'p Plan, key: &str) -> &'p Probe {
        p.probes.iter().find(|p| p.key == key).unwrap()
    }

    /// The guest's view of the host comes from its backend: a user network (qemu) is probed
    /// at its gateway, with other VMs' sshd behind it and no direct way out; a NAT'd network
    /// (libvirt) reaches the internet directly under `Public`, and other VMs at their own
    /// addresses.
    #[test]
    fn the_plan_follows_the_guest_network() {
        let user = GuestNetwork {
            gateway: "10.0.2.2".parse().unwrap(),
            ssh_on_host_loopback: true,
            direct_public: false,
        };
        let p = Plan::of(&targets(user, EgressPolicy::Public));
        assert_eq!(
            probe(&p, "lo-direct").how,
            How::Direct("10.0.2.2".into(), 4001)
        );
        assert_eq!(
            probe(&p, "sib-direct").how,
            How::Direct("10.0.2.2".into(), 2222)
        );
        assert_eq!(probe(&p, "net-direct").expect, Expect::Blocked);
        assert_eq!(probe(&p, "net-get").expect, Expect::Reached);
        assert_eq!(probe(&p, "name-unlisted").expect, Expect::Passed);
        let nat = GuestNetwork {
            gateway: "192.168.122.1".parse().unwrap(),
            ssh_on_host_loopback: false,
            direct_public: true,
        };
        let p = Plan::of(&targets(nat, EgressPolicy::Public));
        assert_eq!(
            probe(&p, "sib-direct").how,
            How::Direct("127.0.0.1".into(), 2222)
        );
        assert_eq!(probe(&p, "net-direct").expect, Expect::Reached);
        let p = Plan::of(&targets(nat, EgressPolicy::Deny));
        assert_eq!(probe(&p, "net-direct").expect, Expect::Blocked);
        assert_eq!(probe(&p, "net-connect").expect, Expect::Denied);
        assert_eq!(probe(&p, "name-unlisted").expect, Expect::Denied);
        // what cannot be probed is a row that fails the drill
        let skipped: Vec<&str> = p.skipped.iter().map(|(w, _)| w.as_str()).collect();
        assert_eq!(skipped, ["host address", "IPv6"]);
    }

    /// Name lookups are probed with names the control plane answers by itself, by the policy:
    /// one allowed (an answer), one not (none, with the allowed one as its control).
    #[test]
    fn lookups_follow_the_policy() {
        let user = GuestNetwork {
            gateway: "10.0.2.2".parse().unwrap(),
            ssh_on_host_loopback: true,
            direct_public: false,
        };
        let mut t = targets(user, EgressPolicy::Allowlist);
        t.policy.allow = vec!["internet.drill.test".into()];
        let p = Plan::of(&t);
        let allowed = probe(&p, "dns-allowed");
        assert_eq!(allowed.how, How::Lookup("internet.drill.test".into()));
        assert_eq!(allowed.expect, Expect::Answer);
        let refused = probe(&p, "dns-refused");
        assert_eq!(refused.how, How::Lookup("unlisted.drill.test".into()));
        assert_eq!(refused.expect, Expect::NoAnswer);
        assert_eq!(refused.control, Control::Probe("dns-allowed"));
        // Deny: nothing answers; the guest's own lookup is the control
        let p = Plan::of(&targets(user, EgressPolicy::Deny));
        assert!(p.probes.iter().all(|p| p.key != "dns-allowed"));
        assert_eq!(
            probe(&p, "dns-refused").control,
            Control::Probe("dns-control")
        );
        // Public: every such name is allowed
        let p = Plan::of(&targets(user, EgressPolicy::Public));
        assert_eq!(probe(&p, "dns-allowed").expect, Expect::Answer);
        assert!(p.probes.iter().all(|p| p.key != "dns-refused"));
        // a backend whose guests use their own network's DNS: not probed
        let mut t = targets(user, EgressPolicy::Public);
        t.dns = false;
        let p = Plan::of(&t);
        assert!(
            p.probes
                .iter()
                .all(|p| !p.key.starts_with("dns-") || p.key == "dns-control")
        );
    }
}
