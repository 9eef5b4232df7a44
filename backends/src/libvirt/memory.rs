//! Suspend and resume: libvirt's managed save. `suspend` saves the running domain's memory
//! and device state to libvirt's save file and ends its QEMU; `start` restores it (libvirt's
//! `create` does, by itself, whenever a domain has a managed save image); `stop` removes it.
//!
//! # Guarantees
//! - libvirtd runs the save whole, also when the control plane dies part way: the domain keeps
//!   running when the save fails (libvirt resumes the guest and removes the file), else it is
//!   off with a complete image. A save libvirtd itself did not finish leaves a partial image
//!   that libvirt discards at the next start (a cold boot: there was no suspend).
//! - An image libvirt refuses to restore (damaged, saved by another QEMU) is kept and the
//!   start fails with [`BackendError::stale_memory`]: `create` is never given
//!   `VIR_DOMAIN_START_FORCE_BOOT`, the flag that would drop it.
//! - A resumed domain runs on the XML saved with its memory (disk chain, NIC filter and its
//!   parameters as they were), not on its definition: a suspended VM's disk is never
//!   flattened nor its domain redefined before the resume. An egress policy set while it was
//!   suspended is applied to the resumed NIC.
//!
//! # Caveats
//! - The image is in libvirt's format `raw` (QEMU's migration stream), or whatever
//!   `save_image_format` in libvirt's `qemu.conf` says: libvirt >= 11.2 takes a per-save
//!   format (`sparse`: QEMU's mapped-ram, as the qemu backend writes) only through
//!   `virDomainSaveParams`, which the `virt` crate (0.5) does not wrap, and this workspace
//!   forbids `unsafe` code.
//! - Where the image is and what it takes is read from libvirtd's save directory
//!   ([`SAVE_DIR`], `save_dir` in `qemu.conf`); with a libvirtd on another host, or a save
//!   directory moved there, [`crate::SavedMemory`] says 0 bytes, saved at the epoch.
//! - Measured (tiny guest, 256 MiB, TCG, 2 busy cores): suspend 2.2–2.9 s, of which ~2 s is
//!   libvirt tearing the domain down (a `virsh destroy` alone takes as long); resume 2.3–2.5 s
//!   to a running guest (a cold start's `create` 0.7 s); ssh answers ~2.4 s later: the
//!   resumed domain's new tap waits out the bridge's STP forward delay (libvirt's `default`
//!   network has `stp='on'`, which the kernel holds to at least 2 s) before it passes
//!   traffic (a network with `stp='off'`, `BOXERY_LIBVIRT_NETWORK`, should not: not measured).

use std::time::SystemTime;

use super::*;

/// Where libvirtd (system instance) keeps each domain's managed save image,
/// `<domain>.save`.
pub(super) const SAVE_DIR: &str = "/var/lib/libvirt/qemu/save";

/// VIR_DOMAIN_SAVE_RUNNING: the restore runs the guest (whatever state it was saved in).
const SAVE_RUNNING: u32 = 1 << 1;

impl Inner {
    /// Whether `d` has a managed save image (its memory, while it is off). Blocking.
    pub(super) fn has_memory(d: &Dom) -> Result<bool> {
        d.dom.has_managed_save(0).map_err(|e| {
            BackendError::failed(
                format!("ask libvirt for the saved memory of VM {}", d.cfg.name),
                e,
            )
        })
    }

    /// The saved memory of `d` as `get` reports it, `None` when it has none. Blocking.
    pub(super) fn saved_memory(&self, d: &Dom) -> Option<crate::SavedMemory> {
        if !Self::has_memory(d).unwrap_or(false) {
            return None;
        }
        let file = Path::new(SAVE_DIR).join(format!("{}.save", self.domain_name(&d.cfg.name)));
        let saved_at = std::fs::metadata(&file)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Some(crate::SavedMemory {
            bytes: allocated_bytes(&file),
            saved_at: boxery_api::Time::from(saved_at),
            stale: None,
        })
    }

    /// Remove `d`'s saved memory, if any (it is off). Blocking.
    pub(super) fn discard_memory(d: &Dom) -> Result<()> {
        if !Self::has_memory(d)? {
            return Ok(());
        }
        d.dom.managed_save_remove(0).map_err(|e| {
            BackendError::failed(format!("discard the saved memory of VM {}", d.cfg.name), e)
        })?;
        info!(vm = d.cfg.name.as_str(), "saved memory discarded");
        Ok(())
    }

    /// Suspend VM `name` (see [`Backend::suspend`]).
    pub(super) async fn suspend(self: &Arc<Self>, name: &str) -> Result<()> {
        let (_lock, d) = self.lock_domain(name).await?;
        let t = Instant::now();
        let saved = self
            .call(move |_, _| {
                if !Self::is_running(&d) {
                    if Self::has_memory(&d)? {
                        return Ok(false);
                    }
                    return Err(BackendError::Invalid(format!(
                        "VM {} is stopped: there is no memory to suspend (start it first)",
                        d.cfg.name
                    )));
                }
                d.dom.managed_save(SAVE_RUNNING).map_err(|e| {
                    BackendError::failed(format!("suspend VM {} (it keeps running)", d.cfg.name), e)
                })?;
                Ok(true)
            })
            .await?;
        if saved {
            info!(
                vm = name,
                secs = t.elapsed().as_secs_f64(),
                "suspended: memory saved, QEMU ended"
            );
        }
        Ok(())
    }

    /// Resume the suspended `d` from its saved memory (lock held): libvirt's `create`
    /// restores the image and removes it once the guest runs.
    pub(super) async fn resume(self: &Arc<Self>, d: &Dom) -> Result<()> {
        let name = d.cfg.name.clone();
        let t = Instant::now();
        let dd = d.clone();
        self.call(move |_, _| match dd.dom.create() {
            Ok(_) => Ok(()),
            // still there: libvirt refused the image and kept it
            Err(e) if Self::has_memory(&dd).unwrap_or(true) => {
                Err(BackendError::stale_memory(&dd.cfg.name, e.message()))
            }
            Err(e) => Err(BackendError::failed(format!("start VM {}", dd.cfg.name), e)),
        })
        .await?;
        info!(
            vm = name.as_str(),
            secs = t.elapsed().as_secs_f64(),
            "resumed from saved memory"
        );
        // the NIC was saved with the filter of its egress then; the definition holds the
        // policy now (set_egress while suspended changed only that)
        if self.config.isolation {
            let dd = d.clone();
            if let Err(e) = self
                .call(move |me, conn| {
                    let confined = Self::is_confined(&dd)?;
                    me.apply_egress(conn, &dd, confined)
                })
                .await
            {
                warn!(vm = name.as_str(), error = %e.chain(), "the resumed guest's NIC filter could not follow its egress policy; the next reconcile retries");
            }
        }
        // its clock stood still while it was suspended
        if self
            .storage
            .load_base(&d.cfg.base)
            .is_ok_and(|b| b.guest_agent)
        {
            let dd = d.clone();
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default();
            let set = blocking(move || {
                dd.dom
                    .set_time(now.as_secs() as i64, now.subsec_nanos() as i32, 0)
            })
            .await;
            if let Err(e) = set {
                warn!(vm = name.as_str(), error = %e, "could not set the resumed guest's clock; it may be behind");
            }
        }
        Ok(())
    }
}
