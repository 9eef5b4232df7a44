//! The VMs' files in the pool (disks by generation, seeds, serial logs), the state
//! directories and locks, and the pool itself.

use super::*;

impl Inner {
    pub(super) fn pool_name(&self) -> String {
        format!("boxery-{}", self.ns)
    }

    pub(super) fn seed_work(&self, name: &str) -> PathBuf {
        self.dir.join("seeds").join(name)
    }
    pub(super) fn vm_disk(&self, name: &str, generation: u64) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-{generation}.qcow2"))
    }
    pub(super) fn vm_seed(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-seed.iso"))
    }
    pub(super) fn vm_serial(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-serial.log"))
    }

    pub(super) fn ensure_dirs(&self) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for d in [
            self.dir.clone(),
            self.storage.locks(),
            self.storage.records(),
            self.dir.join("bases"),
            self.dir.join("seeds"),
        ] {
            std::fs::create_dir_all(&d).map_err(io(format!("creating {}", d.display())))?;
        }
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod the state directory"))?;
        std::fs::create_dir_all(&self.pool_dir).map_err(io(format!(
            "creating the pool directory {}",
            self.pool_dir.display()
        )))?;
        // QEMU runs as libvirt-qemu: it must traverse the directory, not list it
        std::fs::set_permissions(&self.pool_dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod the pool directory"))
    }

    pub(super) async fn lock(&self, what: &str) -> Result<FileLock> {
        self.ensure_dirs()?;
        self.storage.lock(what).await
    }

    pub(super) fn generations(&self, name: &str) -> Result<Vec<u64>> {
        let prefix = format!("vm-{name}-");
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(&self.pool_dir) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => {
                return Err(BackendError::io(
                    format!("reading {}", self.pool_dir.display()),
                    e,
                ));
            }
        };
        for e in rd.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if let Some(g) = f
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".qcow2"))
                .and_then(|g| g.parse().ok())
            {
                out.push(g);
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    pub(super) fn next_generation(&self, name: &str) -> Result<u64> {
        Ok(self.generations(name)?.last().copied().unwrap_or(0) + 1)
    }

    pub(super) fn remove_stale_generations(&self, name: &str, active: &Path) -> Result<()> {
        for g in self.generations(name)? {
            let p = self.vm_disk(name, g);
            if p != active {
                remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
            }
        }
        Ok(())
    }

    /// Pull any frozen layers of a stopped VM into its active overlay, then drop them: the VM is
    /// one overlay deep on its base again.
    pub(super) async fn flatten(self: &Arc<Self>, d: &Dom) -> Result<PathBuf> {
        let dd = d.clone();
        let active = blocking(move || Self::active_disk(&dd)).await?;
        let base = self.storage.base_disk(&d.cfg.base);
        let disks = self.storage.disks();
        let chain = disks
            .chain(&active)
            .await
            .map_err(|e| BackendError::failed("read the disk chain", e))?;
        if chain.len() > 2 {
            disks.rebase(&active, &base).await.map_err(|e| {
                BackendError::failed(
                    format!("pull the layers of VM {} into its disk", d.cfg.name),
                    e,
                )
            })?;
        }
        self.remove_stale_generations(&d.cfg.name, &active)?;
        Ok(active)
    }

    /// Tell libvirt the pool's files changed (best effort).
    pub(super) async fn refresh_pool(self: &Arc<Self>) {
        let _ = self
            .call(|me, conn| {
                if let Ok(p) = conn.lookup_storage_pool_by_name(&me.pool_name()) {
                    let _ = p.refresh(0);
                }
                Ok(())
            })
            .await;
    }

    /// This home's storage pool, defined, started and autostarted. Blocking.
    pub(super) fn ensure_pool(&self, conn: &Connect) -> Result<()> {
        let pool = match conn.lookup_storage_pool_by_name(&self.pool_name()) {
            Ok(p) => p,
            Err(_) => conn
                .define_storage_pool_xml(
                    &xml::pool(&self.pool_name(), &self.pool_dir.to_string_lossy()),
                    0,
                )
                .map_err(|e| BackendError::failed("define the storage pool", e))?,
        };
        if !pool.is_active().unwrap_or(false)
            && let Err(e) = pool.create(0)
            && !pool.is_active().unwrap_or(false)
        {
            return Err(BackendError::failed("start the storage pool", e));
        }
        let _ = pool.set_autostart(true);
        Ok(())
    }
}
