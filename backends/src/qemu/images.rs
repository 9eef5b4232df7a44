//! Images: capture (live hand-off or copy), the guest-agent freeze, publishing, removal, and
//! bases registered from the image builders.

use super::*;

impl Inner {
    pub(super) async fn capture_inner(
        self: &Arc<Self>,
        vm: &str,
        image: &str,
        uid: &str,
    ) -> Result<()> {
        let cfg = self
            .load_vm(vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let dst = self.layout.image_disk(image);
        let part = self.layout.images().join(format!(".{image}.qcow2.part"));
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
                    return Err(failed_msg(
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
                return Err(failed_msg(
                    format!("capture VM {vm}"),
                    format!(
                        "QEMU writes {} but the newest disk is generation {generation}: run recovery",
                        active.display()
                    ),
                ));
            }
            let next_gen = self.max_generation(vm)? + 1;
            let next = self.layout.vm_disk(vm, next_gen);
            let frozen = self.freeze(&mut q, vm).await;
            let snap = q
                .blockdev_snapshot_sync(&node, &next, &format!("ov{next_gen}"))
                .await;
            if frozen {
                self.thaw(vm).await;
            }
            if let Err(e) = snap {
                let _ = remove_file_if_exists(&next);
                return Err(failed(format!("snapshot the disk of VM {vm}"), e));
            }
            let t_snap = t.elapsed();
            drop(q);
            // the old overlay is frozen and one deep on the base: it becomes the image
            let _ = remove_file_if_exists(&part);
            std::fs::hard_link(&active, &part)
                .map_err(io(format!("linking {} as image {image}", active.display())))?;
            self.publish_image(image, uid, &cfg.base, &format!("vm:{vm}"), &part, &dst)
                .await?;
            let mut q = self.qmp(vm).await?;
            q.block_stream(STREAM_JOB, &format!("ov{next_gen}"), BASE_NODE)
                .await
                .map_err(|e| failed(format!("stream the disk of VM {vm} after capture"), e))?;
            drop(q);
            info!(
                vm,
                image,
                frozen,
                snapshot_secs = t_snap.as_secs_f64(),
                secs = t.elapsed().as_secs_f64(),
                "captured a running VM"
            );
            self.settle_later(vm.to_string());
        } else {
            self.settle(vm).await?;
            let generation = self
                .active_generation(vm)?
                .ok_or_else(|| not_found(format!("the disk of VM {vm}")))?;
            let _ = remove_file_if_exists(&part);
            self.disks
                .copy(&self.layout.vm_disk(vm, generation), &part)
                .await
                .map_err(|e| failed(format!("copy the disk of VM {vm}"), e))?;
            self.publish_image(image, uid, &cfg.base, &format!("vm:{vm}"), &part, &dst)
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

    /// Turn the finished file `part` into image `image`: read-only, renamed into place, then
    /// its record (the commit point).
    pub(super) async fn publish_image(
        &self,
        image: &str,
        uid: &str,
        base: &str,
        source: &str,
        part: &Path,
        dst: &Path,
    ) -> Result<()> {
        let info = self
            .disks
            .info(part)
            .await
            .map_err(|e| failed(format!("inspect image {image}"), e))?;
        layout::make_read_only(part).map_err(io(format!("chmod {}", part.display())))?;
        std::fs::rename(part, dst).map_err(io(format!("renaming {}", part.display())))?;
        let rec = ImageRecord {
            name: image.into(),
            mark: uid.into(),
            base: base.into(),
            source: source.into(),
            virtual_size: info.virtual_size,
            created: boxery_api::now(),
        };
        write_json(&self.layout.image_record(image), &rec, 0o644)
            .map_err(io(format!("writing the record of image {image}")))
    }

    /// Remove image `image`'s record, disk and partial files (image lock held).
    pub(super) fn remove_image_files(&self, image: &str) -> Result<()> {
        remove_file_if_exists(&self.layout.image_record(image))
            .map_err(io(format!("removing the record of image {image}")))?;
        remove_file_if_exists(&self.layout.image_disk(image))
            .map_err(io(format!("removing the disk of image {image}")))?;
        let part = self.layout.images().join(format!(".{image}.qcow2.part"));
        remove_file_if_exists(&part).map_err(io(format!("removing {}", part.display())))?;
        let (record, disk) = (format!("{image}.json"), format!("{image}.qcow2"));
        layout::remove_temps(&self.layout.images(), |f| f == record || f == disk)
            .map_err(io(format!("removing temp files of image {image}")))?;
        Ok(())
    }

    pub(super) async fn register_base(&self, manifest_path: &Path) -> Result<String> {
        let text = std::fs::read(manifest_path).map_err(io(format!(
            "reading image manifest {}",
            manifest_path.display()
        )))?;
        let m: Manifest = serde_json::from_slice(&text).map_err(|e| {
            BackendError::Invalid(format!(
                "{} is not an image manifest: {e}",
                manifest_path.display()
            ))
        })?;
        let src_dir = manifest_path.parent().unwrap_or(Path::new("."));
        check_manifest_files(
            manifest_path,
            &m.disk,
            m.kernel.as_deref(),
            m.initrd.as_deref(),
        )?;
        check_machine(manifest_path, m.machine.as_deref())?;
        let hash = m
            .input_hash
            .clone()
            .or(m.disk_sha256.clone())
            .unwrap_or_else(|| {
                // no hash: the manifest's own bytes identify the build
                let digest: u64 = text.iter().fold(0xcbf29ce484222325, |h, b| {
                    (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
                });
                format!("{digest:016x}")
            });
        let id = base_id(manifest_path, &m.name, &hash)?;
        self.layout
            .ensure()
            .map_err(io("creating the state directory"))?;
        if self.layout.base_record(&id).exists() {
            return Ok(id);
        }
        let _lock = FileLock::acquire(self.layout.locks().join(format!("base-{id}.lock")))
            .await
            .map_err(io(format!("locking base {id}")))?;
        if self.layout.base_record(&id).exists() {
            return Ok(id);
        }
        let t = Instant::now();
        let tmp = self
            .layout
            .bases()
            .join(format!(".{id}.tmp-{}", std::process::id()));
        let _ = remove_dir_if_exists(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
        let result = async {
            let disk = tmp.join("disk.qcow2");
            let src_disk = src_dir.join(&m.disk);
            if m.format == "qcow2" {
                let info = self
                    .disks
                    .info(&src_disk)
                    .await
                    .map_err(|e| failed("inspect the built disk", e))?;
                if let Some(b) = info.backing() {
                    // Flattening pulls the backing file's bytes in: only one beside the disk.
                    let inside = src_dir.join(&b).canonicalize().ok().zip(src_dir.canonicalize().ok());
                    if inside.is_none_or(|(b, d)| b.parent() != Some(d.as_path())) {
                        return Err(BackendError::Invalid(format!(
                            "image manifest {}: the disk's backing file is not beside it; import a standalone disk",
                            manifest_path.display()
                        )));
                    }
                    self.disks
                        .convert(&src_disk, &disk)
                        .await
                        .map_err(|e| failed("flatten the built disk", e))?;
                } else {
                    self.disks
                        .copy(&src_disk, &disk)
                        .await
                        .map_err(|e| failed("copy the built disk", e))?;
                }
            } else {
                self.disks
                    .convert(&src_disk, &disk)
                    .await
                    .map_err(|e| failed("convert the built disk", e))?;
            }
            let mut boot = process::Boot {
                kernel: None,
                initrd: None,
                cmdline: m.cmdline.clone(),
                machine: m.machine.clone(),
                acpi_shutdown: m.acpi_powerdown,
            };
            for (field, src, name) in [
                (&mut boot.kernel, &m.kernel, "vmlinuz"),
                (&mut boot.initrd, &m.initrd, "initrd.img"),
            ] {
                if let Some(src) = src {
                    let from = src_dir.join(src);
                    std::fs::copy(&from, tmp.join(name))
                        .map_err(io(format!("copying {}", from.display())))?;
                    layout::make_read_only(&tmp.join(name)).map_err(io("chmod"))?;
                    *field = Some(PathBuf::from(name));
                }
            }
            let virtual_size = self
                .disks
                .info(&disk)
                .await
                .map_err(|e| failed("inspect the base", e))?
                .virtual_size;
            layout::make_read_only(&disk).map_err(io("chmod the base"))?;
            let rec = BaseRecord {
                id: id.clone(),
                stock: m.name.clone(),
                boot,
                guest_agent: m.guest_agent,
                hash: hash.clone(),
                virtual_size,
                created: boxery_api::now(),
            };
            write_json(&tmp.join("base.json"), &rec, 0o444)
                .map_err(io("writing the base record"))?;
            std::fs::rename(&tmp, self.layout.base_dir(&id))
                .map_err(io(format!("publishing base {id}")))?;
            layout::sync_dir(&self.layout.base_dir(&id)).map_err(io("fsync"))
        }
        .await;
        if result.is_err() {
            let _ = remove_dir_if_exists(&tmp);
        }
        result?;
        info!(
            base = id.as_str(),
            secs = t.elapsed().as_secs_f64(),
            "registered a base"
        );
        Ok(id)
    }

    /// Make image `image` (marked `uid`) an empty overlay on base `base`. Idempotent.
    pub(super) async fn image_from_base(
        &self,
        image: &str,
        uid: &str,
        base: &str,
        source: &str,
    ) -> Result<()> {
        let _lock = self.lock_image(image).await?;
        if let Some(rec) = self.load_image(image)? {
            return self.same_image(rec, uid);
        }
        let part = self.layout.images().join(format!(".{image}.qcow2.part"));
        let _ = remove_file_if_exists(&part);
        self.disks
            .create_overlay(&part, &self.base_disk(base), None)
            .await
            .map_err(|e| failed(format!("make image {image}"), e))?;
        self.publish_image(
            image,
            uid,
            base,
            source,
            &part,
            &self.layout.image_disk(image),
        )
        .await
    }

    pub(super) fn same_image(&self, rec: ImageRecord, uid: &str) -> Result<()> {
        if crate::mark::Mark::same_object(&rec.mark, uid) {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "image {} already exists in the qemu backend for another object (uid {}): pick another name",
                rec.name, rec.mark
            )))
        }
    }
}

/// The id of the base a builder manifest registers: `<name>-<12 of its hash>`, a valid name.
pub(crate) fn base_id(manifest_path: &Path, name: &str, hash: &str) -> Result<String> {
    let short: String = hash
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    let id = format!("{name}-{short}");
    if !valid_name(&id) {
        return Err(BackendError::Invalid(format!(
            "image manifest {} names an invalid image `{}`",
            manifest_path.display(),
            boxery_api::name::shown(name)
        )));
    }
    Ok(id)
}

/// A manifest's `machine` becomes part of QEMU's `-machine` argument: a machine type name only
/// (no `,` that would add options).
pub(crate) fn check_machine(manifest_path: &Path, machine: Option<&str>) -> Result<()> {
    match machine {
        Some(m)
            if m.is_empty()
                || m.len() > 64
                || !m
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')) =>
        {
            Err(BackendError::Invalid(format!(
                "image manifest {}: `machine` must be a machine type such as `q35` or `pc-q35-7.2`",
                manifest_path.display()
            )))
        }
        _ => Ok(()),
    }
}

/// The files a builder manifest names lie beside it: each a plain file name, never a path
/// elsewhere on the host.
pub(crate) fn check_manifest_files(
    manifest_path: &Path,
    disk: &Path,
    kernel: Option<&Path>,
    initrd: Option<&Path>,
) -> Result<()> {
    for (field, f) in [("disk", Some(disk)), ("kernel", kernel), ("initrd", initrd)] {
        if let Some(f) = f
            && !is_plain_file_name(f)
        {
            return Err(BackendError::Invalid(format!(
                "image manifest {}: `{field}` must name a file beside the manifest, not a path",
                manifest_path.display()
            )));
        }
    }
    Ok(())
}

/// Whether `f` is one plain file name (no directory, no `..`, not absolute).
fn is_plain_file_name(f: &Path) -> bool {
    let mut c = f.components();
    matches!(
        (c.next(), c.next()),
        (Some(std::path::Component::Normal(_)), None)
    )
}
