//! The owner's quota on memory files (`memory: {quota: 20Gi}` in `$BOXERY_HOME/config.yaml`):
//! the saved memory of suspended VMs and the memory images carry, counted together on the
//! backend's own figures. A suspend or a memory snapshot that could take the total past the
//! quota is refused before anything is written, saying what takes the room; the VM runs on.
//! A memory file is removed with its Image or Vm (or, for a VM, when it runs again).
//!
//! # Caveats
//! - A save is counted at its worst case, the VM's whole memory (a sparse state holds only the
//!   pages the guest touched): near the quota, a save that would have fitted is refused.
//! - Two saves decided at the same instant are each checked against what is on disk then.

use boxery_backends::Backend;

/// Why saving `need` more bytes of memory files would break `quota` (bytes), or `None`.
/// Counts what the backend reports: suspended VMs' saved memory and images' memory.
pub async fn refusal(
    backend: &dyn Backend,
    quota: Option<u64>,
    what: &str,
    need: u64,
) -> Result<Option<String>, boxery_backends::BackendError> {
    let Some(quota) = quota else { return Ok(None) };
    let vms: u64 = backend
        .list()
        .await?
        .iter()
        .filter_map(|v| v.memory.as_ref().map(|m| m.bytes))
        .sum();
    let images: u64 = backend
        .images()
        .await?
        .iter()
        .filter_map(|i| i.memory_bytes)
        .sum();
    let used = vms + images;
    if used.saturating_add(need) <= quota {
        return Ok(None);
    }
    let mib = |b: u64| b.div_ceil(1 << 20);
    Ok(Some(format!(
        "{what} needs up to {} MiB of memory files and the quota (memory.quota in config.yaml) is {} MiB, of which {} MiB are taken ({} MiB by suspended VMs, {} MiB by memory images): delete memory images (`boxery get images`), stop suspended VMs, or raise the quota",
        mib(need),
        mib(quota),
        mib(used),
        mib(vms),
        mib(images)
    )))
}
