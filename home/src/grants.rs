//! The grant state: `$BOXERY_HOME/grants/<vm>.json` ([`layout::grant_state`]) lists the
//! grants in force on a VM, one [`Entry`] each: what is granted and where its value comes
//! from, never the value. The Grant reconciler (`boxery_reconcilers::grant`) keeps it; the
//! credential proxy and the guest push read it.
//!
//! # Guarantees
//! - Written whole or not at all, 0600 in a 0700 directory, flushed to disk before it is
//!   renamed into place ([`crate::private`]); a VM with no entries has no file.
//! - Entries are written sorted by name.
//! - [`read_state`] fails closed: a missing or unreadable file is no grant.
//!
//! # Caveats
//! - Writers serialise among themselves (the reconcilers' per-VM lock): a read-modify-write
//!   here ([`edit`], [`remove_entries`]) is not atomic against another writer.

use std::path::Path;

use boxery_api::grant::GrantSpec;
use serde::{Deserialize, Serialize};

use crate::layout;

/// One grant in force on a VM, as the proxy reads it: the grant's spec (what is granted and
/// where its value comes from, never the value) and what it is bound to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// The Grant's name.
    pub name: String,
    /// The Grant's uid.
    pub uid: String,
    /// The approved generation.
    pub generation: i64,
    /// The approved spec: type, target, header, `valueFrom`, and the VM or lease it names.
    #[serde(flatten)]
    pub spec: GrantSpec,
    /// The uid of the VM it is bound to.
    pub vm_uid: String,
    /// A lease's grant: the lease's uid (the proxy honours the grant only with that lease's
    /// token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_uid: Option<String>,
}

impl Entry {
    /// The uid of the token owner it is honoured for: its lease's, else its VM's.
    pub fn owner(&self) -> &str {
        self.lease_uid.as_deref().unwrap_or(&self.vm_uid)
    }
}

/// A VM's grant state file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateFile {
    /// The VM.
    pub vm: String,
    /// Its grants in force, by name.
    pub grants: Vec<Entry>,
}

/// The entries in force on `vm` (none when there is no file; an unreadable file counts as
/// none: the reconcilers rewrite it from the store).
pub fn read_state(home: &Path, vm: &str) -> Vec<Entry> {
    std::fs::read(layout::grant_state(home, vm))
        .ok()
        .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
        .map(|s| s.grants)
        .unwrap_or_default()
}

/// Write `vm`'s entries (sorted by name), atomically and 0600; no entries: no file.
pub fn write_state(home: &Path, vm: &str, mut entries: Vec<Entry>) -> std::io::Result<()> {
    let file = layout::grant_state(home, vm);
    if entries.is_empty() {
        return crate::private::remove(&file).map(drop);
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let state = StateFile {
        vm: vm.to_string(),
        grants: entries,
    };
    let bytes = serde_json::to_vec_pretty(&state).map_err(std::io::Error::other)?;
    crate::private::write(&file, &bytes, true)
}

/// Change `vm`'s entries with `f`; writes only when they changed (or a file that should
/// exist does not). Returns whether it wrote. The caller serialises writers.
pub fn edit(home: &Path, vm: &str, f: impl FnOnce(&mut Vec<Entry>)) -> std::io::Result<bool> {
    let mut before = read_state(home, vm);
    let mut after = before.clone();
    f(&mut after);
    after.sort_by(|a, b| a.name.cmp(&b.name));
    before.sort_by(|a, b| a.name.cmp(&b.name));
    if after == before && (layout::grant_state(home, vm).exists() || after.is_empty()) {
        return Ok(false);
    }
    write_state(home, vm, after)?;
    Ok(true)
}

/// Remove the entries `drop` picks from `vm`'s state file (outside the controllers: `delete
/// --force` of a Grant, a lease ended at once). Best effort against a concurrent control
/// plane, which rebuilds the file from the store.
pub fn remove_entries(home: &Path, vm: &str, drop: impl Fn(&Entry) -> bool) -> std::io::Result<()> {
    edit(home, vm, |es| es.retain(|e| !drop(e))).map(|_| ())
}

#[cfg(test)]
mod tests {
    use boxery_api::grant::{GrantType, ValueFrom};

    use super::*;

    fn entry(name: &str, lease_uid: Option<&str>) -> Entry {
        Entry {
            name: name.into(),
            uid: format!("uid-{name}"),
            generation: 1,
            spec: GrantSpec {
                limits: None,
                vm: lease_uid.is_none().then(|| "dev1".into()),
                lease: lease_uid.map(|_| "l1".into()),
                type_: GrantType::Llm,
                target: "anthropic".into(),
                header: None,
                value_from: ValueFrom::Env("KEY".into()),
            },
            vm_uid: "vm-uid".into(),
            lease_uid: lease_uid.map(str::to_string),
        }
    }

    #[test]
    fn entries_are_written_sorted_private_and_only_when_they_change() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path();
        assert!(read_state(h, "dev1").is_empty());
        assert!(
            edit(h, "dev1", |es| es
                .extend([entry("b", None), entry("a", Some("l-uid"))]))
            .unwrap()
        );
        use std::os::unix::fs::PermissionsExt;
        let file = layout::grant_state(h, "dev1");
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let names: Vec<String> = read_state(h, "dev1").into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(
            !edit(h, "dev1", |es| es.reverse()).unwrap(),
            "the same entries: no write"
        );
        assert_eq!(read_state(h, "dev1")[0].owner(), "l-uid");
        assert_eq!(read_state(h, "dev1")[1].owner(), "vm-uid");
        remove_entries(h, "dev1", |e| e.lease_uid.is_some()).unwrap();
        assert_eq!(read_state(h, "dev1"), [entry("b", None)]);
        remove_entries(h, "dev1", |_| true).unwrap();
        assert!(!file.exists(), "no entries: no file");
        std::fs::create_dir_all(layout::grants(h)).unwrap();
        std::fs::write(&file, b"{garbage").unwrap();
        assert!(
            read_state(h, "dev1").is_empty(),
            "an unreadable file is no grant"
        );
    }

    /// A file written before the entry carried the whole spec (no `vm`; `lease` the lease's
    /// name beside `leaseUid`) reads as the same grants: the proxy honours them until the
    /// reconcilers next rewrite it.
    #[test]
    fn a_file_from_before_the_spec_was_flattened_still_reads() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path();
        std::fs::create_dir_all(layout::grants(h)).unwrap();
        let old = r#"{"vm": "dev1", "grants": [
            {"name": "a", "uid": "uid-a", "generation": 1, "type": "llm",
             "target": "anthropic", "valueFrom": {"env": "KEY"}, "vmUid": "vm-uid",
             "lease": "l1", "leaseUid": "l-uid"},
            {"name": "b", "uid": "uid-b", "generation": 1, "type": "llm",
             "target": "anthropic", "valueFrom": {"env": "KEY"}, "vmUid": "vm-uid"}
        ]}"#;
        std::fs::write(layout::grant_state(h, "dev1"), old).unwrap();
        let mut b = entry("b", None);
        b.spec.vm = None;
        assert_eq!(read_state(h, "dev1"), [entry("a", Some("l-uid")), b]);
    }

    #[test]
    fn the_file_keeps_its_fields() {
        let text = serde_json::to_value(StateFile {
            vm: "dev1".into(),
            grants: vec![entry("a", Some("l-uid"))],
        })
        .unwrap();
        let e = &text["grants"][0];
        for field in [
            "name",
            "uid",
            "generation",
            "type",
            "target",
            "valueFrom",
            "vmUid",
            "lease",
            "leaseUid",
        ] {
            assert!(e.get(field).is_some(), "{field} in {e}");
        }
    }
}
