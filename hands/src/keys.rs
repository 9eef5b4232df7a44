//! The key pairs of the leases this host holds: `$BOXERY_HOME/leases/NAME/id_ed25519`. The
//! private half never leaves this host; [`crate::Reach`] uses it to reach a leased VM as its
//! holder.

use std::path::{Path, PathBuf};

use boxery_api::lease::LeasePhase;
use boxery_api::{Lease, Name};
use boxery_backends::confined;
use boxery_store::Store;

/// The directory holding the key pairs of the leases this host holds.
pub fn leases_root(home: &Path) -> PathBuf {
    home.join("leases")
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

/// The private key of a lease this host holds on `vm`, if any.
pub fn held_key(home: &Path, store: &Store, vm: &str) -> Option<PathBuf> {
    let leases = store.list_as::<Lease>(&Default::default()).ok()?;
    leases
        .iter()
        .filter(|l| l.status.phase == LeasePhase::Bound && l.status.vm.as_deref() == Some(vm))
        .find_map(|l| {
            let name = Name::label(&l.metadata.name).ok()?;
            let k = lease_dir(home, &name).join("id_ed25519");
            k.exists().then_some(k)
        })
}
