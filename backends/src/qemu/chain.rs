//! A VM's disk chain: its overlay generations, image layers linked in, and the streams that
//! bring it back to one overlay on its base.
//!
//! Guarantees: the active overlay is the highest `disk-<gen>`; `layer-<gen>` files (images
//! hard-linked in) are only ever opened read-only and never become active; every stream names
//! the base node, and nothing ever commits into a backing file.

use super::*;

/// The generation of a `disk-<gen>.qcow2` file name (a VM's own overlay).
pub(super) fn disk_generation(file: &str) -> Option<u64> {
    file.strip_prefix("disk-")?
        .strip_suffix(".qcow2")?
        .parse()
        .ok()
}

/// The generation of a `layer-<gen>.qcow2` file name: an image's overlay hard-linked into the
/// VM (shared with the image, so never written) until a stream has pulled it up.
pub(super) fn layer_generation(file: &str) -> Option<u64> {
    file.strip_prefix("layer-")?
        .strip_suffix(".qcow2")?
        .parse()
        .ok()
}

/// The QEMU node name of a disk file: `disk-N` → `ovN`, `layer-N` → `lyN`.
pub(super) fn node_name(path: &Path, fallback: usize) -> String {
    let f = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    match (disk_generation(&f), layer_generation(&f)) {
        (Some(g), _) => format!("ov{g}"),
        (_, Some(g)) => format!("ly{g}"),
        _ => format!("layer{fallback}"),
    }
}

impl Inner {
    /// The VM's disk generations present, highest first.
    pub(super) fn generations(&self, name: &str) -> Result<Vec<u64>> {
        let dir = self.vm_dir(name);
        let mut gens: Vec<u64> = std::fs::read_dir(&dir)
            .map_err(io(format!("listing {}", dir.display())))?
            .filter_map(|e| e.ok())
            .filter_map(|e| disk_generation(&e.file_name().to_string_lossy()))
            .collect();
        gens.sort_unstable_by(|a, b| b.cmp(a));
        Ok(gens)
    }

    /// The active overlay's generation: the highest `disk-N` (a newer overlay is only ever
    /// made on top of, or in place of, the older ones; `layer-N` files are never active).
    pub(super) fn active_generation(&self, name: &str) -> Result<Option<u64>> {
        Ok(self.generations(name)?.first().copied())
    }

    /// Every disk file of the VM: its overlays and the image layers linked into it.
    pub(super) fn disk_files(&self, name: &str) -> Result<Vec<PathBuf>> {
        let dir = self.vm_dir(name);
        Ok(std::fs::read_dir(&dir)
            .map_err(io(format!("listing {}", dir.display())))?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let f = e.file_name().to_string_lossy().into_owned();
                disk_generation(&f).is_some() || layer_generation(&f).is_some()
            })
            .map(|e| e.path())
            .collect())
    }

    /// The highest generation of any disk file (the next file takes the one after).
    pub(super) fn max_generation(&self, name: &str) -> Result<u64> {
        Ok(self
            .disk_files(name)?
            .iter()
            .filter_map(|p| {
                let f = p.file_name()?.to_string_lossy().into_owned();
                disk_generation(&f).or(layer_generation(&f))
            })
            .max()
            .unwrap_or(0))
    }

    /// Remove every disk file of the VM not in `keep`.
    pub(super) fn remove_unused(&self, name: &str, keep: &[PathBuf]) -> Result<()> {
        for p in self.disk_files(name)? {
            if !keep.contains(&p) {
                debug!(vm = name, file = %p.display(), "removing an unused disk file");
                remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
            }
        }
        Ok(())
    }

    /// The stopped VM's disk chain from its headers: top (the highest `disk-N`) first, the base
    /// last. Fails when the chain does not end at the VM's base.
    pub(super) async fn offline_chain(&self, cfg: &VmConfig) -> Result<Vec<PathBuf>> {
        let name = &cfg.name;
        let top = self.active_generation(name)?.ok_or_else(|| {
            BackendError::failed(
                "find the disk",
                format!("VM {name} has no disk in {}", self.vm_dir(name).display()),
            )
        })?;
        let top = self.layout.vm_disk(name, top);
        let chain =
            self.disks().chain(&top).await.map_err(|e| {
                BackendError::failed(format!("read the disk chain of VM {name}"), e)
            })?;
        let base = self.base_disk(&cfg.base);
        if chain.last() != Some(&base) {
            return Err(BackendError::failed(
                format!("read the disk chain of VM {name}"),
                format!(
                    "it ends at {:?}, not at its base {}",
                    chain.last(),
                    base.display()
                ),
            ));
        }
        Ok(chain)
    }

    /// The active node and the chain (file names, top first) of the VM's disk, from QEMU.
    pub(super) async fn live_chain(
        &self,
        q: &mut Qmp,
        name: &str,
    ) -> Result<(String, Vec<String>)> {
        let blocks = q
            .query_block()
            .await
            .map_err(|e| BackendError::failed(format!("query the disks of VM {name}"), e))?;
        let disk = blocks
            .into_iter()
            .find(|b| {
                b.qdev == DISK_DEVICE
                    || b.qdev.contains(&format!("/{DISK_DEVICE}/"))
                    || b.qdev.ends_with(DISK_DEVICE)
            })
            .and_then(|b| b.inserted)
            .ok_or_else(|| {
                BackendError::failed(
                    "query the disks",
                    format!("VM {name} has no disk {DISK_DEVICE} in QEMU"),
                )
            })?;
        Ok((disk.node_name, disk.image.files()))
    }

    /// Wait (bounded) until QEMU runs no block job for the VM.
    pub(super) async fn wait_jobs(&self, name: &str, timeout: Duration) -> Result<()> {
        if self.pid(name).is_none() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let mut q = self.qmp(name).await?;
            let jobs = q.query_block_jobs().await.map_err(|e| {
                BackendError::failed(format!("query the block jobs of VM {name}"), e)
            })?;
            if jobs.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(BackendError::failed(
                    "wait for block jobs",
                    format!(
                        "VM {name} still runs block job {} after {timeout:?}",
                        jobs[0].device
                    ),
                ));
            }
            drop(q);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Bring the VM's disk back to one overlay on its base and drop generations nothing uses.
    /// Running: start a stream (base named) when the chain is deeper, or remove the unused
    /// files once it is not and no job runs. Stopped: a safe `qemu-img rebase` onto the base.
    /// Idempotent; the caller holds the VM's lock.
    pub(super) async fn settle(&self, name: &str) -> Result<()> {
        let Some(cfg) = self.load_vm(name)? else {
            return Ok(());
        };
        let base = self.base_disk(&cfg.base);
        let keep: PathBuf;
        if self.pid(name).is_some() {
            let mut q = self.qmp(name).await?;
            let jobs = q.query_block_jobs().await.map_err(|e| {
                BackendError::failed(format!("query the block jobs of VM {name}"), e)
            })?;
            if !jobs.is_empty() {
                return Ok(());
            }
            let (node, files) = self.live_chain(&mut q, name).await?;
            if files.len() > 2 {
                info!(
                    vm = name,
                    depth = files.len() - 1,
                    "streaming the disk back to one overlay on its base"
                );
                q.block_stream(STREAM_JOB, &node, BASE_NODE)
                    .await
                    .map_err(|e| {
                        BackendError::failed(format!("stream the disk of VM {name}"), e)
                    })?;
                return Ok(());
            }
            keep = PathBuf::from(&files[0]);
        } else {
            if self.active_generation(name)?.is_none() {
                return Ok(());
            }
            let chain = self.offline_chain(&cfg).await?;
            let active = chain[0].clone();
            if chain.len() > 2 {
                let t = Instant::now();
                self.disks().rebase(&active, &base).await.map_err(|e| {
                    BackendError::failed(format!("pull the disk of VM {name} onto its base"), e)
                })?;
                info!(
                    vm = name,
                    secs = t.elapsed().as_secs_f64(),
                    "rebased the disk onto its base"
                );
            }
            keep = active;
        }
        self.remove_unused(name, &[keep])
    }

    /// After a capture: wait for the stream in the background and drop the frozen layer.
    pub(super) fn settle_later(self: &Arc<Self>, name: String) {
        let inner = Arc::clone(self);
        tokio::spawn(async move {
            let deadline = Instant::now() + STREAM_WAIT;
            while Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Ok(_lock) = inner.lock_vm(&name).await else {
                    return;
                };
                if inner.pid(&name).is_none() {
                    return;
                }
                let Ok(mut q) = inner.qmp(&name).await else {
                    return;
                };
                match q.query_block_jobs().await {
                    Ok(jobs) if jobs.is_empty() => {
                        drop(q);
                        if let Err(e) = inner.settle(&name).await {
                            warn!(vm = %name, error = %e, "settling the disk after a capture failed; the next operation retries");
                        }
                        return;
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
    }

    /// Give VM `name` a disk from image `image` as generation `generation`: the image's
    /// overlay hard-linked in as `layer-<gen>` (read-only to QEMU, so the image is never
    /// written) under a new empty overlay `disk-<gen+1>` of `bytes`; the first boot streams the
    /// layer up so the disk is one overlay on the base again. The link keeps the data alive
    /// when the image is deleted. Where a hard link is impossible, a copy of the overlay.
    /// Returns the disk's virtual size.
    pub(super) async fn attach_image(
        &self,
        name: &str,
        image: &str,
        generation: u64,
        bytes: u64,
    ) -> Result<u64> {
        let src = self.storage.image_disk(image);
        let layer = self.vm_dir(name).join(format!("layer-{generation}.qcow2"));
        let top = self.layout.vm_disk(name, generation + 1);
        let _ = remove_file_if_exists(&layer);
        let _ = remove_file_if_exists(&top);
        match std::fs::hard_link(&src, &layer) {
            Ok(()) => {
                let size = self
                    .disks()
                    .info(&layer)
                    .await
                    .map_err(|e| BackendError::failed(format!("inspect image {image}"), e))?
                    .virtual_size;
                let size = size.max(bytes);
                self.disks()
                    .create_overlay(&top, &layer, Some(size))
                    .await
                    .map_err(|e| BackendError::failed(format!("make the disk of VM {name}"), e))?;
                Ok(size)
            }
            Err(e) => {
                debug!(vm = name, image, error = %e, "cannot hard-link the image; copying it");
                let disk = self.layout.vm_disk(name, generation);
                self.storage.copy_image(image, &disk, bytes).await
            }
        }
    }
}
