//! `spec.network` of a Vm: where its guest may connect out (docs/egress.md), and the one list
//! of address ranges no guest ever reaches through boxery's egress proxy.
//!
//! # Guarantees
//! - [`forbidden`] is the single source of the forbidden ranges: the proxy checks every
//!   resolved address with it, the drill and the docs cite it.
//! - An IPv4-mapped, NAT64 or 6to4 IPv6 address is judged by the IPv4 address it carries, so
//!   `::ffff:127.0.0.1` is loopback.
//! - [`Egress::allows_name`] matches names case-insensitively, ignoring one trailing dot; a
//!   `*.` entry matches names below it, never the name itself.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::validate::FieldError;

/// Where a VM's guest may connect out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Network {
    /// The egress policy: what the guest may reach through the control plane's egress proxy.
    /// Changeable while the VM runs; takes effect on the next connection.
    #[serde(default)]
    pub egress: Egress,
}

impl Network {
    /// Whether this is the default (so a spec can leave it out).
    pub fn is_default(&self) -> bool {
        *self == Network::default()
    }
}

/// A VM's egress policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Egress {
    /// `Public` (the default): any public address; `Allowlist`: only the names in `allow`;
    /// `Deny`: nothing but the VM's grants through the credential proxy. No policy reaches a
    /// private, loopback, link-local, shared (CGNAT), multicast or metadata address.
    #[serde(default)]
    pub policy: EgressPolicy,
    /// The names `Allowlist` lets through: exact (`github.com`) or every name below a suffix
    /// (`*.pypi.org`). Kept but unused under the other policies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

/// What a guest may reach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum EgressPolicy {
    /// The public internet: every address outside the forbidden ranges.
    #[default]
    Public,
    /// Only the names in `allow` (and the VM's grants through the credential proxy).
    Allowlist,
    /// Nothing but the VM's grants through the credential proxy.
    Deny,
}

impl EgressPolicy {
    /// The policy's name as written in a manifest.
    pub fn as_str(self) -> &'static str {
        match self {
            EgressPolicy::Public => "Public",
            EgressPolicy::Allowlist => "Allowlist",
            EgressPolicy::Deny => "Deny",
        }
    }
}

impl std::fmt::Display for EgressPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most names one allow list may hold.
pub const MAX_ALLOW: usize = 256;

impl Egress {
    /// Whether the policy lets the guest ask for `host` (a name or an address literal) before
    /// it is resolved. Every resolved address is then checked with [`forbidden`].
    pub fn allows_name(&self, host: &str) -> bool {
        match self.policy {
            EgressPolicy::Public => true,
            EgressPolicy::Deny => false,
            EgressPolicy::Allowlist => {
                let host = canonical(host);
                self.allow.iter().any(|a| match a.strip_prefix("*.") {
                    Some(suffix) => host
                        .strip_suffix(&canonical(suffix))
                        .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
                    None => canonical(a) == host,
                })
            }
        }
    }

    /// Check the allow list: each entry a DNS name or `*.` and a DNS name, at most
    /// [`MAX_ALLOW`], no duplicates. `path`: where the spec sits (`spec.network.egress`).
    pub fn check(&self, path: &str) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if self.allow.len() > MAX_ALLOW {
            errs.push(FieldError::new(
                format!("{path}.allow"),
                format!(
                    "{} names is too many: at most {MAX_ALLOW}",
                    self.allow.len()
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, a) in self.allow.iter().enumerate() {
            let at = format!("{path}.allow[{i}]");
            if let Err(why) = check_pattern(a) {
                errs.push(FieldError::new(at, why));
            } else if !seen.insert(canonical(a)) {
                errs.push(FieldError::new(
                    at,
                    format!("`{}` is listed twice", crate::name::shown(a)),
                ));
            }
        }
        errs
    }
}

impl Egress {
    /// How `self` lets more through than `old`, in words (`policy Deny → Public`, `allow
    /// adds github.com`), or `None` when it lets through nothing `old` did not.
    pub fn looser_than(&self, old: &Egress) -> Option<String> {
        let rank = |p: EgressPolicy| match p {
            EgressPolicy::Deny => 0,
            EgressPolicy::Allowlist => 1,
            EgressPolicy::Public => 2,
        };
        if rank(self.policy) > rank(old.policy) {
            return Some(format!("policy {} → {}", old.policy, self.policy));
        }
        if self.policy != EgressPolicy::Allowlist || old.policy != EgressPolicy::Allowlist {
            return None;
        }
        // Every name the new list lets through must be one the old list did: an exact name
        // covered by an old entry; a suffix only by the same or a wider old suffix.
        let added: Vec<&str> = self
            .allow
            .iter()
            .filter(|a| match a.strip_prefix("*.") {
                Some(suffix) => !old.allow.iter().any(|o| {
                    o.strip_prefix("*.").is_some_and(|os| {
                        let (s, os) = (canonical(suffix), canonical(os));
                        s == os || s.ends_with(&format!(".{os}"))
                    })
                }),
                None => !old.allows_name(a),
            })
            .map(String::as_str)
            .collect();
        (!added.is_empty()).then(|| format!("allow adds {}", added.join(", ")))
    }
}

/// A name lower-cased, without one trailing dot.
fn canonical(s: &str) -> String {
    s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase()
}

/// An allow-list entry: a DNS name (`github.com`) or `*.` and one (`*.pypi.org`).
fn check_pattern(a: &str) -> Result<(), String> {
    let shown = crate::name::shown(a);
    let name = a.strip_prefix("*.").unwrap_or(a);
    if name.parse::<IpAddr>().is_ok() {
        return Err(format!(
            "`{shown}` is an address: list names (`github.com`, `*.pypi.org`); the policy \
             matches the name the guest asks for"
        ));
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return Err(format!(
            "`{shown}` is not a DNS name: use `github.com` or `*.pypi.org`"
        ));
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "`{shown}` is not a DNS name (a label is 1-63 letters, digits, `-` or `_`, \
                 not starting or ending with `-`; a wildcard is only a leading `*.`): use \
                 `github.com` or `*.pypi.org`"
            ));
        }
    }
    if !name.contains('.') && a.starts_with("*.") {
        return Err(format!(
            "`{shown}` would allow a whole top-level domain: name a domain (`*.pypi.org`)"
        ));
    }
    Ok(())
}

/// Why no guest may reach `ip` (the range's name), or `None` for a public address.
pub fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// The forbidden IPv4 ranges, with their names (docs/egress.md lists these).
pub const FORBIDDEN_V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this network (0.0.0.0/8)"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private (10.0.0.0/8)"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared/CGNAT (100.64.0.0/10)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback (127.0.0.0/8)"),
    (
        Ipv4Addr::new(169, 254, 0, 0),
        16,
        "link-local/metadata (169.254.0.0/16)",
    ),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private (172.16.0.0/12)"),
    (
        Ipv4Addr::new(192, 0, 0, 0),
        24,
        "IETF protocol (192.0.0.0/24)",
    ),
    (
        Ipv4Addr::new(192, 168, 0, 0),
        16,
        "private (192.168.0.0/16)",
    ),
    (
        Ipv4Addr::new(198, 18, 0, 0),
        15,
        "benchmarking (198.18.0.0/15)",
    ),
    (
        Ipv4Addr::new(224, 0, 0, 0),
        3,
        "multicast/reserved (224.0.0.0/3)",
    ),
];

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let n = u32::from(ip);
    FORBIDDEN_V4.iter().find_map(|(net, len, why)| {
        let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
        (n & mask == u32::from(*net) & mask).then_some(*why)
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    // NAT64 (64:ff9b::/96) and 6to4 (2002::/16) carry an IPv4 address: judge that one.
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        let v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
        return forbidden_v4(v4);
    }
    if s[0] == 0x2002 {
        let v4 = Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8);
        return forbidden_v4(v4);
    }
    if ip.is_unspecified() {
        Some("unspecified (::)")
    } else if ip.is_loopback() {
        Some("loopback (::1)")
    } else if s[0] & 0xfe00 == 0xfc00 {
        Some("unique local (fc00::/7)")
    } else if s[0] & 0xffc0 == 0xfe80 {
        Some("link-local (fe80::/10)")
    } else if s[0] & 0xffc0 == 0xfec0 {
        Some("site-local (fec0::/10)")
    } else if s[0] & 0xff00 == 0xff00 {
        Some("multicast (ff00::/8)")
    } else if s[0] == 0 && s[1..6] == [0, 0, 0, 0, 0] {
        // ::/96 (IPv4-compatible, deprecated) and the rest of ::/80
        Some("IPv4-compatible (::/96)")
    } else if s[0] == 0x100 && s[1..4] == [0, 0, 0] {
        Some("discard (100::/64)")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egress(policy: EgressPolicy, allow: &[&str]) -> Egress {
        Egress {
            policy,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn names_match_exactly_or_below_a_suffix() {
        let e = egress(EgressPolicy::Allowlist, &["github.com", "*.pypi.org"]);
        assert!(e.allows_name("github.com"));
        assert!(e.allows_name("GitHub.com."));
        assert!(!e.allows_name("api.github.com"));
        assert!(!e.allows_name("evilgithub.com"));
        assert!(e.allows_name("files.pypi.org"));
        assert!(e.allows_name("a.b.pypi.org"));
        assert!(!e.allows_name("pypi.org"));
        assert!(!e.allows_name("xpypi.org"));
        assert!(!e.allows_name(".pypi.org"));
        assert!(!e.allows_name("203.0.113.10"));
        assert!(egress(EgressPolicy::Public, &[]).allows_name("anything.example"));
        assert!(!egress(EgressPolicy::Deny, &["github.com"]).allows_name("github.com"));
    }

    #[test]
    fn looser_is_more_policy_or_more_names() {
        use EgressPolicy::*;
        let e = |p, a: &[&str]| egress(p, a);
        assert_eq!(
            e(Public, &[]).looser_than(&e(Deny, &[])).unwrap(),
            "policy Deny → Public"
        );
        assert!(
            e(Allowlist, &["a.com"])
                .looser_than(&e(Deny, &[]))
                .is_some()
        );
        assert!(e(Deny, &[]).looser_than(&e(Public, &[])).is_none());
        assert!(
            e(Allowlist, &["a.com"])
                .looser_than(&e(Public, &[]))
                .is_none()
        );
        let old = e(Allowlist, &["a.com", "*.pypi.org"]);
        assert!(e(Allowlist, &["a.com"]).looser_than(&old).is_none());
        assert!(
            e(Allowlist, &["files.pypi.org", "*.x.pypi.org"])
                .looser_than(&old)
                .is_none()
        );
        assert_eq!(
            e(Allowlist, &["b.com", "*.org"]).looser_than(&old).unwrap(),
            "allow adds b.com, *.org"
        );
        assert!(e(Allowlist, &["*.a.com"]).looser_than(&old).is_some());
        // Deny keeps its list, unused: what it would allow later does not count now.
        assert!(e(Deny, &["z.com"]).looser_than(&old).is_none());
    }

    #[test]
    fn allow_lists_take_names_only() {
        let e = egress(
            EgressPolicy::Allowlist,
            &[
                "github.com",
                "*.pypi.org",
                "10.0.0.1",
                "*",
                "*.com",
                "a..b",
                "-x.com",
                "x y.com",
                "GitHub.com",
                "*.*.x.com",
            ],
        );
        let errs = e.check("spec.network.egress");
        let at: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            at,
            [2, 3, 4, 5, 6, 7, 8, 9]
                .iter()
                .map(|i| format!("spec.network.egress.allow[{i}]"))
                .collect::<Vec<_>>()
        );
        assert!(
            errs[0].message.contains("is an address"),
            "{}",
            errs[0].message
        );
        assert!(errs[2].message.contains("top-level"), "{}", errs[2].message);
        assert!(errs[6].message.contains("twice"), "{}", errs[6].message);
    }

    #[test]
    fn the_forbidden_ranges_are_the_documented_ones() {
        let no = [
            "0.1.2.3",
            "10.1.2.3",
            "100.64.0.1",
            "100.127.255.255",
            "127.0.0.1",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.122.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
            "2002:c0a8:0101::1",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::10.0.0.1",
        ];
        for a in no {
            assert!(
                forbidden(a.parse().unwrap()).is_some(),
                "{a} should be forbidden"
            );
        }
        let yes = [
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "203.0.113.10",
            "223.255.255.255",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
            "64:ff9b::101:101",
            "2001:db8::10",
        ];
        for a in yes {
            assert_eq!(forbidden(a.parse().unwrap()), None, "{a} should be public");
        }
    }
}
