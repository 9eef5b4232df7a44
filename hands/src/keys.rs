//! The key pairs of the leases this host holds: `$BOXERY_HOME/leases/NAME/id_ed25519`. The
//! private half never leaves this host; [`crate::Reach`] uses it to reach a leased VM as its
//! holder.

use std::path::{Path, PathBuf};

use boxery_api::lease::LeasePhase;
use boxery_api::{Lease, Name};
use boxery_backends::confined;
use boxery_store::{ObjectStore, ObjectStoreExt};

/// The directory holding the key pairs of the leases this host holds.
pub fn leases_root(home: &Path) -> PathBuf {
    boxery_home::layout::leases(home)
}

/// Where a lease's key pair lives on this host.
pub fn lease_dir(home: &Path, lease: &Name) -> PathBuf {
    confined::child(&leases_root(home), lease)
}

/// Remove the key pair made here for a lease (never anything outside
/// `$BOXERY_HOME/leases`).
pub fn forget_key(home: &Path, lease: &Name) {
    let root = leases_root(home);
    if let Err(e) = confined::remove_within(&root, &lease_dir(home, lease)) {
        tracing::warn!(lease = %lease, error = %e, "cannot remove the lease's key pair");
    }
}

/// The private key of a lease this host holds on `vm`, if any. Only the leases with a key
/// pair here are read (one store read each; none at all when this host holds no lease).
pub async fn held_key(home: &Path, store: &dyn ObjectStore, vm: &str) -> Option<PathBuf> {
    let dir = std::fs::read_dir(leases_root(home)).ok()?;
    let mut names: Vec<String> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .collect();
    names.sort();
    for n in names {
        let Ok(name) = Name::label(&n) else { continue };
        let k = lease_dir(home, &name).join("id_ed25519");
        if !k.exists() {
            continue;
        }
        let Ok(Some(l)) = store.get_as::<Lease>(&n).await else {
            continue;
        };
        if l.status.phase == LeasePhase::Bound && l.status.vm.as_deref() == Some(vm) {
            return Some(k);
        }
    }
    None
}
