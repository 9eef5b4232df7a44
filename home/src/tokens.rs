//! The token store: `$BOXERY_HOME/tokens/<vm>` ([`layout::token`]) holds `<owner uid> <token>` (0600, directory
//! 0700, written atomically). The owner is the lease whose holder has the VM (a pool member
//! while leased) or the VM itself (a VM outside any pool: minted when it is created, or when
//! it first lacks one, and removed when it is deleted). A pool member has no token file while
//! it is free. The credential proxy (`boxery-proxy`) accepts a token only if it is the one in
//! its VM's file at the moment of the request, and honours a grant only for the owner the
//! grant is bound to (a lease's grant with that lease's token; a VM's grant with the VM's).
//!
//! # Guarantees
//! - [`matches()`] compares in constant time and reads the file on every call: a removed or
//!   replaced token stops working at once.
//! - [`revoke`] removes the file only when it is still the given owner's, so a late revoke of
//!   an old lease never removes the next holder's token.

use std::path::Path;

use crate::layout;

/// `vm`'s token file: (owner uid, token), or `None` when it has none (or it is unreadable).
pub fn read(home: &Path, vm: &str) -> Option<(String, String)> {
    let text = std::fs::read_to_string(layout::token(home, vm)).ok()?;
    let mut words = text.split_whitespace();
    let (owner, token) = (words.next()?, words.next()?);
    Some((owner.to_string(), token.to_string()))
}

/// The owner of `vm`'s token when `token` is that token (constant-time compare).
pub fn matches(home: &Path, vm: &str, token: &str) -> Option<String> {
    use subtle::ConstantTimeEq;
    let (owner, live) = read(home, vm)?;
    bool::from(live.as_bytes().ct_eq(token.as_bytes())).then_some(owner)
}

/// Write `vm`'s token for `owner` (replacing any other), atomically, 0600. Not fsynced: a
/// token outlives a crash of `serve` in the page cache, and one lost with the host's power is
/// void anyway (every lease from before a reboot is void and its token removed).
pub fn write(home: &Path, vm: &str, owner: &str, token: &str) -> std::io::Result<()> {
    crate::private::write(
        &layout::token(home, vm),
        format!("{owner} {token}\n").as_bytes(),
        false,
    )
}

/// Remove `vm`'s token if `owner` owns it. Returns whether a token was removed.
pub fn revoke(home: &Path, vm: &str, owner: &str) -> std::io::Result<bool> {
    match read(home, vm) {
        Some((o, _)) if o == owner => crate::private::remove(&layout::token(home, vm)),
        _ => Ok(false),
    }
}

/// Every VM with a token file (names only; temp files skipped).
pub fn vms(home: &Path) -> Vec<String> {
    std::fs::read_dir(layout::tokens(home))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| !n.starts_with('.') && !n.ends_with(".tmp"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_match_revoke() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path();
        assert_eq!(matches(h, "a", "t1"), None);
        write(h, "a", "uid-1", "t1").unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(layout::token(h, "a"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(matches(h, "a", "t1").as_deref(), Some("uid-1"));
        assert_eq!(matches(h, "a", "t2"), None);
        assert_eq!(matches(h, "a", "t"), None);
        assert_eq!(matches(h, "a", ""), None);
        assert!(
            !revoke(h, "a", "uid-2").unwrap(),
            "another owner's revoke is a no-op"
        );
        assert_eq!(vms(h), vec!["a".to_string()]);
        assert!(revoke(h, "a", "uid-1").unwrap());
        assert_eq!(matches(h, "a", "t1"), None);
        assert!(vms(h).is_empty());
    }
}
