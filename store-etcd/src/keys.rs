//! Where a store's records live in etcd, all under its prefix (`/boxery` by default):
//!
//! | key | value |
//! |---|---|
//! | `P/meta/uid` | the store's identity |
//! | `P/meta/rev` | the store's revision (decimal): every object write compares and bumps it |
//! | `P/meta/compacted` | the compaction floor (decimal) |
//! | `P/o/KIND/NAME` | the object's JSON, its `resourceVersion` in it |
//! | `P/u/UID` | `KIND/NAME` of the current object with that uid |
//! | `P/w/OWNER_UID/KIND/NAME` | empty: the owner index (ownerReferences by uid) |
//! | `P/t/UID` | `KIND/NAME`: a removed Vm or Image (a tombstone) |
//! | `P/l/REV` | one change ([`crate::log::Entry`]), REV zero-padded to 20 digits so keys sort as revisions |
//! | `P/leader/LOCK` | the leader lock's row (JSON) |
//!
//! Kinds and names are checked names (no `/`), so no key is a prefix of another's range by
//! accident.

/// The keys of one store.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys under `prefix` (normalized: one leading `/`, no trailing one).
    pub(crate) fn new(prefix: &str) -> Keys {
        let trimmed = prefix.trim_matches('/');
        Keys {
            prefix: format!("/{trimmed}"),
        }
    }

    #[cfg(test)]
    fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn uid(&self) -> String {
        format!("{}/meta/uid", self.prefix)
    }

    pub(crate) fn rev(&self) -> String {
        format!("{}/meta/rev", self.prefix)
    }

    pub(crate) fn compacted(&self) -> String {
        format!("{}/meta/compacted", self.prefix)
    }

    pub(crate) fn object(&self, kind: &str, name: &str) -> String {
        format!("{}/o/{kind}/{name}", self.prefix)
    }

    /// The prefix of every object of a kind.
    pub(crate) fn kind(&self, kind: &str) -> String {
        format!("{}/o/{kind}/", self.prefix)
    }

    pub(crate) fn uid_index(&self, uid: &str) -> String {
        format!("{}/u/{uid}", self.prefix)
    }

    pub(crate) fn owner(&self, owner_uid: &str, kind: &str, name: &str) -> String {
        format!("{}/w/{owner_uid}/{kind}/{name}", self.prefix)
    }

    /// The prefix of the owner index entries of one owner.
    pub(crate) fn owned(&self, owner_uid: &str) -> String {
        format!("{}/w/{owner_uid}/", self.prefix)
    }

    pub(crate) fn tombstone(&self, uid: &str) -> String {
        format!("{}/t/{uid}", self.prefix)
    }

    /// The prefix of the log.
    pub(crate) fn log(&self) -> String {
        format!("{}/l/", self.prefix)
    }

    pub(crate) fn log_entry(&self, rev: u64) -> String {
        format!("{}/l/{rev:020}", self.prefix)
    }

    pub(crate) fn leader(&self, lock: &str) -> String {
        format!("{}/leader/{lock}", self.prefix)
    }
}

/// The end of the range of every key that starts with `prefix` (etcd's `range_end`).
pub(crate) fn range_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The revision a log key holds (its last path segment).
pub(crate) fn log_rev(key: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(key).ok()?;
    s.rsplit('/').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_as_revisions_and_ranges_end_after_the_prefix() {
        let k = Keys::new("boxery/");
        assert_eq!(k.prefix(), "/boxery");
        assert!(k.log_entry(9) < k.log_entry(10));
        assert_eq!(log_rev(k.log_entry(1234).as_bytes()), Some(1234));
        assert_eq!(range_end("/a/b/"), b"/a/b0".to_vec());
        assert_eq!(range_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
