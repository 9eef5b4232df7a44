//! Capture: the live hand-off (guest-agent freeze, snapshot, the frozen overlay published as
//! the image, a stream back to one overlay) or, for a stopped VM, a copy. With memory: the
//! guest is paused instead of frozen, its memory saved beside the disk snapshot (both from
//! that instant, `memory::save_image_memory`), then it runs on. Publishing and the rest of
//! image storage are the storage module's.

use super::*;

impl Inner {
    pub(super) async fn capture_inner(
        self: &Arc<Self>,
        vm: &str,
        image: &str,
        uid: &str,
        memory: bool,
    ) -> Result<()> {
        let cfg = self
            .load_vm(vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let part = self.storage.image_part(image);
        let t = Instant::now();
        if self.pid(vm).is_some() {
            // the disk must be one overlay on the base (the overlay becomes the image): wait
            // for a stream under way (a previous capture's, a new VM's), start one if needed
            let deadline = Instant::now() + STREAM_WAIT;
            let (mut q, node, files) = loop {
                self.wait_jobs(vm, deadline.saturating_duration_since(Instant::now()))
                    .await?;
                self.settle(vm).await?;
                let mut q = self.qmp(vm).await?;
                let (node, files) = self.live_chain(&mut q, vm).await?;
                if files.len() <= 2 {
                    break (q, node, files);
                }
                if Instant::now() >= deadline {
                    return Err(BackendError::failed(
                        format!("capture VM {vm}"),
                        format!(
                            "its disk is still {} layers deep after {STREAM_WAIT:?}",
                            files.len() - 1
                        ),
                    ));
                }
            };
            let generation = self.active_generation(vm)?.unwrap_or(0);
            let active = PathBuf::from(&files[0]);
            if active != self.layout.vm_disk(vm, generation) {
                return Err(BackendError::failed(
                    format!("capture VM {vm}"),
                    format!(
                        "QEMU writes {} but the newest disk is generation {generation}: run recovery",
                        active.display()
                    ),
                ));
            }
            let next_gen = self.max_generation(vm)? + 1;
            let next = self.layout.vm_disk(vm, next_gen);
            // with memory the guest is paused (one instant for disk and memory): no freeze
            let paused = memory
                && q.stop()
                    .await
                    .map_err(|e| BackendError::failed(format!("pause VM {vm}"), e))
                    .is_ok();
            if memory && !paused {
                return Err(BackendError::failed(
                    format!("capture the memory of VM {vm}"),
                    "QEMU did not pause the guest",
                ));
            }
            let frozen = !memory && self.freeze(&mut q, vm).await;
            let snap = q
                .blockdev_snapshot_sync(&node, &next, &format!("ov{next_gen}"))
                .await;
            if frozen {
                self.thaw(vm).await;
            }
            if let Err(e) = snap {
                if paused {
                    let _ = q.cont().await;
                }
                let _ = remove_file_if_exists(&next);
                return Err(BackendError::failed(
                    format!("snapshot the disk of VM {vm}"),
                    e,
                ));
            }
            let saved = if paused {
                let pid = self.pid(vm).unwrap_or_default();
                let saved = self.save_image_memory(&mut q, &cfg, pid, image).await;
                // the guest runs on, whatever became of its memory's copy
                q.cont()
                    .await
                    .map_err(|e| BackendError::failed(format!("resume VM {vm}"), e))?;
                saved.map(Some)
            } else {
                Ok(None)
            };
            let t_snap = t.elapsed();
            drop(q);
            if let Err(e) = saved {
                // the VM keeps its new overlay, streamed back to one as after any capture
                let mut q = self.qmp(vm).await?;
                let _ = q
                    .block_stream(STREAM_JOB, &format!("ov{next_gen}"), BASE_NODE)
                    .await;
                drop(q);
                self.settle_later(vm.to_string());
                return Err(e);
            }
            // the old overlay is frozen and one deep on the base: it becomes the image
            let _ = remove_file_if_exists(&part);
            std::fs::hard_link(&active, &part)
                .map_err(io(format!("linking {} as image {image}", active.display())))?;
            self.storage
                .publish(image, uid, &cfg.base, &format!("vm:{vm}"))
                .await?;
            let mut q = self.qmp(vm).await?;
            q.block_stream(STREAM_JOB, &format!("ov{next_gen}"), BASE_NODE)
                .await
                .map_err(|e| {
                    BackendError::failed(format!("stream the disk of VM {vm} after capture"), e)
                })?;
            drop(q);
            info!(
                vm,
                image,
                frozen,
                memory_bytes = saved.ok().flatten(),
                snapshot_secs = t_snap.as_secs_f64(),
                secs = t.elapsed().as_secs_f64(),
                "captured a running VM"
            );
            self.settle_later(vm.to_string());
            if memory {
                // the VM runs on meanwhile; the image is ready once this is done
                self.share_image_memory(&cfg, image).await;
            }
        } else if memory {
            return Err(BackendError::Invalid(format!(
                "VM {vm} is not running: its memory can be captured only while it runs (a snapshot without memory takes its disk)"
            )));
        } else {
            self.settle(vm).await?;
            let generation = self
                .active_generation(vm)?
                .ok_or_else(|| not_found(format!("the disk of VM {vm}")))?;
            let _ = remove_file_if_exists(&part);
            self.disks()
                .copy(&self.layout.vm_disk(vm, generation), &part)
                .await
                .map_err(|e| BackendError::failed(format!("copy the disk of VM {vm}"), e))?;
            self.storage
                .publish(image, uid, &cfg.base, &format!("vm:{vm}"))
                .await?;
            info!(
                vm,
                image,
                secs = t.elapsed().as_secs_f64(),
                "captured a stopped VM"
            );
        }
        Ok(())
    }

    /// Freeze the guest's filesystems through qemu-guest-agent when it runs; `true` if frozen.
    pub(super) async fn freeze(&self, q: &mut Qmp, vm: &str) -> bool {
        let agent = q
            .query_chardev()
            .await
            .map(|c| c.iter().any(|c| c.label == "qga0" && c.frontend_open))
            .unwrap_or(false);
        if !agent {
            return false;
        }
        match Qga::connect(&self.layout.vm_qga(vm), Duration::from_secs(3)).await {
            Ok(mut g) => match g.fsfreeze_freeze().await {
                Ok(n) => {
                    debug!(vm, filesystems = n, "guest filesystems frozen");
                    true
                }
                Err(e) => {
                    warn!(vm, error = %error_chain(&e), "guest fsfreeze failed; capturing crash-consistent");
                    let _ = g.fsfreeze_thaw().await;
                    false
                }
            },
            Err(e) => {
                warn!(vm, error = %error_chain(&e), "the guest agent did not answer; capturing crash-consistent");
                false
            }
        }
    }

    pub(super) async fn thaw(&self, vm: &str) {
        for _ in 0..3 {
            if let Ok(mut g) = Qga::connect(&self.layout.vm_qga(vm), Duration::from_secs(5)).await
                && g.fsfreeze_thaw().await.is_ok()
            {
                return;
            }
        }
        warn!(
            vm,
            "could not thaw the guest's filesystems; recover_capture retries"
        );
    }
}
