//! Capture of a VM into an image (an external disk-only snapshot of a running one, a copy of
//! a stopped one's overlay) and recovery from a capture that died.

use super::*;

impl Inner {
    /// Capture VM `vm` as image `image` marked `uid` (see [`Backend::capture`]).
    pub(super) async fn capture(self: &Arc<Self>, vm: &str, image: &str, uid: &str) -> Result<()> {
        self.storage.check_name("VM", vm)?;
        self.storage.check_name("image", image)?;
        let _vm_lock = self.lock(&format!("vm-{vm}")).await?;
        let t = Instant::now();
        let publish = async {
            let base = self.capture_part(vm, image).await?;
            self.storage
                .publish(image, uid, &base, &format!("vm:{vm}"))
                .await?;
            self.refresh_pool().await;
            Ok(())
        };
        self.storage.new_image(image, uid, publish).await?;
        info!(vm, image, secs = t.elapsed().as_secs_f64(), "captured");
        Ok(())
    }

    /// Capture VM `vm` into the image's part file, one overlay on its base (image lock held):
    /// the base's id.
    async fn capture_part(self: &Arc<Self>, vm: &str, image: &str) -> Result<String> {
        let n = vm.to_string();
        let d = self.call(move |me, conn| me.require(conn, &n)).await?;
        let base = self.storage.load_base(&d.cfg.base)?;
        let base_disk = self.storage.base_disk(&base.id);
        let part = self.storage.image_part(image);
        let _ = remove_file_if_exists(&part);
        let disks = self.storage.disks();
        let (running, active) = {
            let dd = d.clone();
            blocking(move || {
                Ok::<_, BackendError>((Self::is_running(&dd), Self::active_disk(&dd)?))
            })
            .await?
        };
        let frozen = if running {
            let new = self.vm_disk(vm, self.next_generation(vm)?);
            let snap = xml::disk_snapshot(&new.to_string_lossy());
            let agent = base.guest_agent;
            let dd = d.clone();
            blocking(move || {
                let flags = SNAP_DISK_ONLY | SNAP_NO_METADATA | SNAP_ATOMIC;
                let quiesced = agent
                    && dd
                        .dom
                        .create_snapshot_xml(&snap, flags | SNAP_QUIESCE)
                        .is_ok();
                if !quiesced {
                    dd.dom.create_snapshot_xml(&snap, flags).map_err(|e| {
                        BackendError::failed(format!("snapshot the disk of VM {}", dd.cfg.name), e)
                    })?;
                }
                Ok::<_, BackendError>(())
            })
            .await?;
            active
        } else {
            // stopped: copy its overlay (below)
            let tmp = self
                .storage
                .image_copy(image)
                .expect("the libvirt backend stages copies");
            disks
                .copy(&active, &tmp)
                .await
                .map_err(|e| BackendError::failed(format!("copy the disk of VM {vm}"), e))?;
            std::fs::rename(&tmp, &part).map_err(io("renaming the image copy"))?;
            part.clone()
        };
        if frozen != part {
            let chain = disks
                .chain(&frozen)
                .await
                .map_err(|e| BackendError::failed("read the disk chain", e))?;
            if chain.len() <= 2 && std::fs::hard_link(&frozen, &part).is_ok() {
                // one overlay on the base, never written again: share it
            } else {
                disks.copy(&frozen, &part).await.map_err(|e| {
                    BackendError::failed(format!("copy the frozen disk of VM {vm}"), e)
                })?;
            }
        }
        let chain = disks
            .chain(&part)
            .await
            .map_err(|e| BackendError::failed("read the image chain", e))?;
        if chain.len() > 2 {
            crate::storage::files::set_mode(&part, 0o600)
                .map_err(io(format!("chmod {}", part.display())))?;
            disks
                .rebase(&part, &base_disk)
                .await
                .map_err(|e| BackendError::failed("rebase the image onto its base", e))?;
        }
        Ok(base.id)
    }

    pub(super) async fn recover_capture(
        self: &Arc<Self>,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        if !valid_name(vm) || !valid_name(image) {
            return Ok(());
        }
        let _lock = self.lock(&format!("vm-{vm}")).await?;
        let n = vm.to_string();
        let found = self
            .call(move |me, conn| {
                let Some(d) = me.lookup(conn, &n)? else {
                    return Ok(None);
                };
                if Inner::is_running(&d) {
                    // a capture that died between freeze and thaw leaves the guest frozen
                    if let Ok(s) =
                        d.dom
                            .qemu_agent_command(r#"{"execute":"guest-fsfreeze-status"}"#, 3, 0)
                        && s.contains("\"frozen\"")
                    {
                        d.dom
                            .qemu_agent_command(r#"{"execute":"guest-fsfreeze-thaw"}"#, 10, 0)
                            .map_err(|e| {
                                BackendError::failed(format!("thaw the guest of VM {n}"), e)
                            })?;
                    }
                    if original == Some(PowerState::Running)
                        && let Ok((st, _)) = d.dom.state()
                        && st.is(virt::domain::DomainState::Paused)
                    {
                        d.dom
                            .resume()
                            .map_err(|e| BackendError::failed(format!("resume VM {n}"), e))?;
                    }
                }
                // a snapshot file libvirt never switched to
                let active = Inner::active_disk(&d)?;
                let active_gen = active.file_name().and_then(|f| {
                    f.to_string_lossy()
                        .rsplit('-')
                        .next()
                        .and_then(|g| g.strip_suffix(".qcow2").and_then(|g| g.parse::<u64>().ok()))
                });
                if let Some(ag) = active_gen {
                    for g in me.generations(&n)? {
                        if g > ag {
                            remove_file_if_exists(&me.vm_disk(&n, g))
                                .map_err(io("removing an unused snapshot overlay"))?;
                        }
                    }
                }
                let running = Inner::is_running(&d);
                Ok(Some((d, running)))
            })
            .await?;
        if let Some((d, running)) = found
            && !running
            && original == Some(PowerState::Running)
        {
            self.boot(&d).await?;
        }
        let _image_lock = self.lock(&format!("image-{image}")).await?;
        if self.storage.load_image(image)?.is_none() || !self.storage.image_disk(image).exists() {
            self.storage.remove_image_files(image)?;
        }
        self.refresh_pool().await;
        Ok(())
    }
}
