//! The egress state: `$BOXERY_HOME/egress/<vm>` ([`layout::egress_policy`]) holds the VM's `spec.network.egress` as JSON
//! (0600, directory 0700, written atomically), kept by the Vm reconciler and read by the
//! egress proxy (`boxery-proxy`) on every connection, so a policy change takes effect on the
//! guest's next connection, without a reboot.
//!
//! # Guarantees
//! - Written before the VM is created or started, and whenever the spec changes; removed
//!   when the VM is deleted, with its token.
//! - [`read`] fails closed: a VM with no file, or an unreadable one, has `Deny`.

use std::path::Path;

use boxery_api::network::{Egress, EgressPolicy};

use crate::layout;

/// `vm`'s egress policy as last written; `Deny` when there is none (fail closed).
pub fn read(home: &Path, vm: &str) -> Egress {
    std::fs::read(layout::egress_policy(home, vm))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Egress {
            policy: EgressPolicy::Deny,
            allow: Vec::new(),
        })
}

/// Write `vm`'s policy if it differs from the file. Returns whether it wrote.
pub fn write(home: &Path, vm: &str, egress: &Egress) -> std::io::Result<bool> {
    let text = serde_json::to_vec(egress).map_err(std::io::Error::other)?;
    if std::fs::read(layout::egress_policy(home, vm)).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    crate::private::write(&layout::egress_policy(home, vm), &text, false)?;
    Ok(true)
}

/// Remove `vm`'s policy (a later connection is denied).
pub fn remove(home: &Path, vm: &str) -> std::io::Result<()> {
    crate::private::remove(&layout::egress_policy(home, vm)).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_without_a_policy_is_denied_and_writes_happen_only_on_change() {
        let home = tempfile::tempdir().unwrap();
        assert_eq!(read(home.path(), "a").policy, EgressPolicy::Deny);
        let e = Egress {
            policy: EgressPolicy::Allowlist,
            allow: vec!["github.com".into()],
        };
        assert!(write(home.path(), "a", &e).unwrap());
        assert!(!write(home.path(), "a", &e).unwrap());
        assert_eq!(read(home.path(), "a"), e);
        std::fs::write(layout::egress_policy(home.path(), "a"), b"{garbage").unwrap();
        assert_eq!(read(home.path(), "a").policy, EgressPolicy::Deny);
        remove(home.path(), "a").unwrap();
        remove(home.path(), "a").unwrap();
        assert_eq!(read(home.path(), "a").policy, EgressPolicy::Deny);
    }
}
