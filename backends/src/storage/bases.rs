//! Bases: a builder's output (`OUT/<name>.json`, docs/images.md) registered once per input
//! hash as a read-only disk with its kernel and initrd, and the record that says how it boots.

use std::path::{Path, PathBuf};
use std::time::Instant;

use tracing::info;

use super::files::{self, remove_dir_if_exists, valid_name, write_json};
use super::records::{BaseRecord, Boot, Manifest};
use super::{BasePlaces, Storage};
use crate::{BackendError, Result, io};

impl Storage {
    /// Base `id`'s record (`Failed` when it is not registered).
    pub fn load_base(&self, id: &str) -> Result<BaseRecord> {
        let path = self.places.bases.record(id);
        files::read_json(&path)
            .map_err(io(format!("reading base {id}")))?
            .ok_or_else(|| {
                BackendError::failed(
                    "find the base",
                    format!(
                        "base {id} is not registered ({} is missing)",
                        path.display()
                    ),
                )
            })
    }

    /// How base `base` boots, its kernel and initrd resolved to full paths.
    pub fn base_boot(&self, base: &BaseRecord) -> Boot {
        base.boot_in(&self.places.bases.dir(&base.id))
    }

    /// Register a builder's output (`manifest`: `OUT/<name>.json`) as a read-only base;
    /// returns its id. Idempotent: a base with the same content is registered once. The files
    /// are staged beside their final place and published with the record last.
    pub async fn register_base(&self, manifest_path: &Path) -> Result<String> {
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
                let digest = boxery_api::fnv::fnv1a(&text);
                format!("{digest:016x}")
            });
        let id = base_id(manifest_path, &m.name, &hash)?;
        let key = id.clone();
        self.register_once(&key, |tmp| async move {
            let places = &self.places.bases;
            let [disk_name, kernel_name, initrd_name] = places.file_names(&id);
            let disk = tmp.join(&disk_name);
            self.stage_disk(manifest_path, &src_dir.join(&m.disk), &m.format, &disk)
                .await?;
            let mut boot = Boot {
                kernel: None,
                initrd: None,
                cmdline: m.cmdline.clone(),
                machine: m.machine.clone(),
                acpi_shutdown: m.acpi_powerdown,
            };
            for (field, src, name) in [
                (&mut boot.kernel, &m.kernel, kernel_name),
                (&mut boot.initrd, &m.initrd, initrd_name),
            ] {
                if let Some(src) = src {
                    let from = src_dir.join(src);
                    let to = tmp.join(&name);
                    self.disks
                        .copy(&from, &to)
                        .await
                        .map_err(|e| BackendError::failed("copy the built boot files", e))?;
                    files::make_read_only(&to).map_err(io("chmod"))?;
                    *field = Some(PathBuf::from(name));
                }
            }
            let virtual_size = self
                .disks
                .info(&disk)
                .await
                .map_err(|e| BackendError::failed("inspect the base", e))?
                .virtual_size;
            files::make_read_only(&disk).map_err(io("chmod the base"))?;
            let rec = BaseRecord {
                id: id.clone(),
                stock: m.name.clone(),
                boot,
                guest_agent: m.guest_agent,
                hash: hash.clone(),
                virtual_size,
                created: boxery_api::now(),
                cloud_image: false,
            };
            Ok(rec)
        })
        .await?;
        Ok(key)
    }

    /// Put the built disk `src` at `dst` as a standalone qcow2: copied when it is one,
    /// flattened when it has a backing file beside it, converted otherwise.
    async fn stage_disk(
        &self,
        manifest_path: &Path,
        src: &Path,
        format: &str,
        dst: &Path,
    ) -> Result<()> {
        if format != "qcow2" {
            return self
                .disks
                .convert(src, dst)
                .await
                .map_err(|e| BackendError::failed("convert the built disk", e));
        }
        let info = self
            .disks
            .info(src)
            .await
            .map_err(|e| BackendError::failed("inspect the built disk", e))?;
        let Some(b) = info.backing() else {
            return self
                .disks
                .copy(src, dst)
                .await
                .map_err(|e| BackendError::failed("copy the built disk", e));
        };
        // Flattening pulls the backing file's bytes in: only one beside the disk.
        let src_dir = src.parent().unwrap_or(Path::new("."));
        let inside = src_dir
            .join(&b)
            .canonicalize()
            .ok()
            .zip(src_dir.canonicalize().ok());
        if inside.is_none_or(|(b, d)| b.parent() != Some(d.as_path())) {
            return Err(BackendError::Invalid(format!(
                "image manifest {}: the disk's backing file is not beside it; import a standalone disk",
                manifest_path.display()
            )));
        }
        self.disks
            .convert(src, dst)
            .await
            .map_err(|e| BackendError::failed("flatten the built disk", e))
    }

    /// Register a distribution's cloud image `path` (a qcow2 or raw disk with its own
    /// bootloader, cloud-init and sshd; no builder manifest) as a read-only base, once per
    /// content (its id is `cloud-<sha256>`). It boots through the firmware, and its seed makes
    /// the `agent` user (docs/images.md, "Bring your own image"). The file is untrusted: its
    /// format is read once and then named to `qemu-img` (never probed again), and a disk
    /// that points at other files (a backing file, a qcow2 data file) or has no boot sector
    /// is refused before anything is copied.
    pub async fn register_cloud_image(&self, path: &Path) -> Result<String> {
        let shown = path.display();
        let info = self
            .disks
            .info(path)
            .await
            .map_err(|e| BackendError::Invalid(format!("{shown} is not a disk image: {e}")))?;
        let format = info.format.as_str();
        if !matches!(format, "qcow2" | "raw") {
            return Err(BackendError::Invalid(format!(
                "{shown} is a {format} disk: import a qcow2 or raw cloud image (`qemu-img convert -O qcow2` makes one)"
            )));
        }
        if info.backing().is_some() || info.data_file().is_some() {
            return Err(BackendError::Invalid(format!(
                "{shown} reads other files (a backing file or a data file): import a standalone disk (`qemu-img convert -O qcow2 {shown} standalone.qcow2`)"
            )));
        }
        if info.virtual_size < MIN_CLOUD_DISK || info.virtual_size > MAX_CLOUD_DISK {
            return Err(BackendError::Invalid(format!(
                "{shown} is a {} MiB disk: a cloud image is 64 MiB to 2 TiB",
                info.virtual_size >> 20
            )));
        }
        let sector = self
            .disks
            .first_sector(path, format)
            .await
            .map_err(|e| BackendError::failed("read the disk's boot sector", e))?;
        if !has_boot_signature(&sector) {
            return Err(BackendError::Invalid(format!(
                "{shown} has no boot sector and no image manifest beside it: boxery imports a distribution's cloud image (a disk with its own bootloader, cloud-init and sshd) as it is, or a builder's output with its manifest (docs/images.md, \"Bring your own image\")"
            )));
        }
        let hash = sha256_file(path).await?;
        let id = format!("cloud-{}", &hash[..12]);
        let key = id.clone();
        self.register_once(&key, |tmp| async move {
            let places = &self.places.bases;
            let [disk_name, _, _] = places.file_names(&id);
            let disk = tmp.join(&disk_name);
            self.disks
                .convert_from(path, format, &disk)
                .await
                .map_err(|e| BackendError::failed("copy the cloud image", e))?;
            files::make_read_only(&disk).map_err(io("chmod the base"))?;
            let rec = BaseRecord {
                id: id.clone(),
                stock: "cloud".into(),
                boot: Boot {
                    kernel: None,
                    initrd: None,
                    cmdline: None,
                    machine: None,
                    acpi_shutdown: true,
                },
                guest_agent: false,
                hash: hash.clone(),
                virtual_size: info.virtual_size,
                created: boxery_api::now(),
                cloud_image: true,
            };
            Ok(rec)
        })
        .await?;
        Ok(key)
    }

    /// Register base `id` once: unless its record exists (checked again under the base's
    /// lock), `stage` fills a staging directory and returns the record, which is published
    /// last; a failed stage leaves nothing behind.
    async fn register_once<F, Fut>(&self, id: &str, stage: F) -> Result<()>
    where
        F: FnOnce(PathBuf) -> Fut,
        Fut: std::future::Future<Output = Result<BaseRecord>>,
    {
        let places = &self.places.bases;
        if places.record(id).exists() {
            return Ok(());
        }
        let _lock = self.lock(&format!("base-{id}")).await?;
        if places.record(id).exists() {
            return Ok(());
        }
        let t = Instant::now();
        let tmp = places.staging(id);
        let _ = remove_dir_if_exists(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
        let result = match stage(tmp.clone()).await {
            Ok(rec) => self.publish_base(id, &tmp, &rec),
            Err(e) => Err(e),
        };
        if result.is_err() {
            let _ = remove_dir_if_exists(&tmp);
        }
        result?;
        info!(
            base = id,
            secs = t.elapsed().as_secs_f64(),
            "registered a base"
        );
        Ok(())
    }

    /// Publish the staged base `tmp` with its record last (the commit point).
    fn publish_base(&self, id: &str, tmp: &Path, rec: &BaseRecord) -> Result<()> {
        match &self.places.bases {
            BasePlaces::Dirs(dir) => {
                write_json(&tmp.join("base.json"), rec, 0o444)
                    .map_err(io("writing the base record"))?;
                let dst = dir.join(id);
                std::fs::rename(tmp, &dst).map_err(io(format!("publishing base {id}")))?;
                files::sync_dir(&dst).map_err(io("fsync"))
            }
            BasePlaces::Flat { files, records } => {
                for e in std::fs::read_dir(tmp).map_err(io(format!("listing {}", tmp.display())))? {
                    let e = e.map_err(io(format!("listing {}", tmp.display())))?;
                    std::fs::rename(e.path(), files.join(e.file_name()))
                        .map_err(io(format!("publishing base {id}")))?;
                }
                remove_dir_if_exists(tmp).map_err(io(format!("removing {}", tmp.display())))?;
                std::fs::create_dir_all(records)
                    .map_err(io(format!("creating {}", records.display())))?;
                write_json(&records.join(format!("{id}.json")), rec, 0o444)
                    .map_err(io("writing the base record"))
            }
        }
    }
}

/// The smallest and largest cloud image boxery imports.
const MIN_CLOUD_DISK: u64 = 64 << 20;
const MAX_CLOUD_DISK: u64 = 2 << 40;

/// Whether a first sector ends in the boot signature `55 AA` (an MBR, or GPT's protective
/// MBR): what a disk the firmware can boot starts with.
fn has_boot_signature(sector: &[u8]) -> bool {
    sector.len() >= 512 && sector[510] == 0x55 && sector[511] == 0xAA
}

/// The hex sha256 of a file's bytes (read on a blocking thread).
async fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut f = std::fs::File::open(&p)?;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = std::io::Read::read(&mut f, &mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok::<_, std::io::Error>(
            h.finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
        )
    })
    .await
    .map_err(|e| BackendError::failed("hash the cloud image", e))?
    .map_err(io(format!("reading {}", path.display())))
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
