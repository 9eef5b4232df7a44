//! Image storage shared by the VM drivers (qemu, libvirt): bases, image overlays and their
//! records, VM seeds, the image builders, and the file primitives under all of them. A driver
//! says where its files live ([`Places`]) and keeps only what is its own: processes and QMP
//! (qemu), domain XML and libvirt calls (libvirt).
//!
//! # Model
//! - A **base** is a builder's output registered once per input hash: a read-only qcow2 disk
//!   (with the kernel and initrd beside it for direct kernel boot) and its record. A base is
//!   never replaced or deleted automatically.
//! - An **image** is one qcow2 overlay on a base (0444), with its record `images/<name>.json`,
//!   the image's **commit point**: a disk without a record is a partial image.
//! - A **VM's disk** starts as a copy of (or a link to) an image's overlay, so it is one overlay
//!   on the same base and never depends on the image ([`Storage::copy_image`]).
//! - A VM's **seed** (NoCloud ISO, [`seed`]) carries its identity.
//!
//! # Guarantees
//! - Every file is written under a temporary name and renamed into place ([`files`]); an image
//!   exists once its record does, a base once its record does (qemu: once its directory does).
//! - Every change to an image or base holds its flock (`locks/image-<name>.lock`,
//!   `locks/base-<id>.lock`), which excludes other processes too.
//! - Nothing here ever commits into a backing file: bases are only read.
//!
//! # Caveats
//! - File I/O on small files (records, locks' files) is synchronous inside async functions;
//!   copies of disks run as child processes (`cp`, `qemu-img`) awaited without blocking.

pub(crate) mod bases;
pub(crate) mod build;
pub mod disk;
pub(crate) mod files;
pub(crate) mod images;
pub mod records;
pub mod seed;

use std::path::{Path, PathBuf};

use crate::{BackendError, Result};
use disk::Disks;
use files::FileLock;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The tools and builder settings image storage needs (environment).
///
/// | variable | default | what |
/// |---|---|---|
/// | `BOXERY_QEMU_IMG` | `qemu-img` | the disk tool |
/// | `BOXERY_IMAGE_DIR` | found | the repository's `image/` (builders), see [`find_image_dir`] |
/// | `BOXERY_IMAGE_CACHE` | `/var/cache/boxery/images` | where the builders write |
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// `qemu-img`.
    pub qemu_img: PathBuf,
    /// `genisoimage` (seed ISOs).
    pub genisoimage: PathBuf,
    /// The image builders' directory (`image/` of the repository), when found.
    pub image_dir: Option<PathBuf>,
    /// Where the builders write their output.
    pub image_cache: PathBuf,
}

impl StorageConfig {
    /// Settings from the environment (see the type's docs).
    pub fn from_env() -> Self {
        StorageConfig {
            qemu_img: env("BOXERY_QEMU_IMG")
                .unwrap_or_else(|| "qemu-img".into())
                .into(),
            genisoimage: "genisoimage".into(),
            image_dir: find_image_dir(),
            image_cache: env("BOXERY_IMAGE_CACHE")
                .unwrap_or_else(|| "/var/cache/boxery/images".into())
                .into(),
        }
    }
}

/// The repository's `image/` directory: `BOXERY_IMAGE_DIR`, else the first `image/` holding
/// `build-tiny.sh` beside the running binary or in one of its parent directories (a cargo
/// build runs from `target/<profile>/`), else the source tree this crate was built from.
pub fn find_image_dir() -> Option<PathBuf> {
    if let Some(d) = env("BOXERY_IMAGE_DIR") {
        return Some(PathBuf::from(d));
    }
    let has = |d: &Path| d.join("build-tiny.sh").is_file();
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1) {
            for cand in [dir.join("image"), dir.join("share/boxery/image")] {
                if has(&cand) {
                    return Some(cand);
                }
            }
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../image");
    has(&src).then(|| src.canonicalize().unwrap_or(src))
}

/// Where a driver keeps its images and bases.
#[derive(Debug, Clone)]
pub(crate) struct Places {
    /// The driver's state directory: `images/` (image records), `locks/`, build logs.
    pub state: PathBuf,
    /// The directory of image disks.
    pub image_disks: PathBuf,
    /// An image's disk file name (`<name>.qcow2`, `img-<name>.qcow2`).
    pub image_file: fn(&str) -> String,
    /// The file an image is made in before it is published.
    pub image_part_file: fn(&str) -> String,
    /// A second staging file (a copy on its way to becoming the part file), if the driver
    /// makes one.
    pub image_copy_file: Option<fn(&str) -> String>,
    /// Where bases live.
    pub bases: BasePlaces,
}

/// Where bases live.
#[derive(Debug, Clone)]
pub(crate) enum BasePlaces {
    /// One directory per base, `<dir>/<id>/` (`disk.qcow2`, `vmlinuz`, `initrd.img`,
    /// `base.json`), renamed into place whole: a base exists completely or not at all.
    Dirs(PathBuf),
    /// Flat files `<files>/base-<id>.{qcow2,vmlinuz,initrd}` (beside the VM disks, e.g. in a
    /// storage pool) and records `<records>/<id>.json`, written last: the commit point.
    /// Used by the libvirt driver only.
    #[cfg_attr(not(feature = "libvirt"), allow(dead_code))]
    Flat {
        /// The directory of the files.
        files: PathBuf,
        /// The directory of the records.
        records: PathBuf,
    },
}

impl BasePlaces {
    /// Base `id`'s record.
    pub fn record(&self, id: &str) -> PathBuf {
        match self {
            BasePlaces::Dirs(d) => d.join(id).join("base.json"),
            BasePlaces::Flat { records, .. } => records.join(format!("{id}.json")),
        }
    }
    /// The directory its files are in (where a record's relative kernel/initrd resolve).
    pub fn dir(&self, id: &str) -> PathBuf {
        match self {
            BasePlaces::Dirs(d) => d.join(id),
            BasePlaces::Flat { files, .. } => files.clone(),
        }
    }
    /// The names of its disk, kernel and initrd inside [`BasePlaces::dir`].
    pub fn file_names(&self, id: &str) -> [String; 3] {
        match self {
            BasePlaces::Dirs(_) => ["disk.qcow2".into(), "vmlinuz".into(), "initrd.img".into()],
            BasePlaces::Flat { .. } => [
                format!("base-{id}.qcow2"),
                format!("base-{id}.vmlinuz"),
                format!("base-{id}.initrd"),
            ],
        }
    }
    /// Its disk.
    pub fn disk(&self, id: &str) -> PathBuf {
        let [disk, ..] = self.file_names(id);
        self.dir(id).join(disk)
    }
    /// Where a base is staged before it is published (same filesystem).
    fn staging(&self, id: &str) -> PathBuf {
        let root = match self {
            BasePlaces::Dirs(d) => d,
            BasePlaces::Flat { files, .. } => files,
        };
        root.join(format!(".{id}.tmp-{}", std::process::id()))
    }
}

/// A driver's image storage.
#[derive(Debug, Clone)]
pub(crate) struct Storage {
    backend: &'static str,
    places: Places,
    disks: Disks,
    config: StorageConfig,
}

impl Storage {
    /// Storage of backend `backend` at `places`.
    pub fn new(backend: &'static str, places: Places, config: StorageConfig) -> Self {
        let disks = Disks::new(config.qemu_img.clone());
        Storage {
            backend,
            places,
            disks,
            config,
        }
    }
    /// `qemu-img` and `cp`.
    pub fn disks(&self) -> &Disks {
        &self.disks
    }
    /// `images/`: the image records.
    pub fn records(&self) -> PathBuf {
        self.places.state.join("images")
    }
    /// `locks/`.
    pub fn locks(&self) -> PathBuf {
        self.places.state.join("locks")
    }
    /// Image `name`'s record.
    pub fn image_record(&self, name: &str) -> PathBuf {
        self.records().join(format!("{name}.json"))
    }
    /// Image `name`'s disk.
    pub fn image_disk(&self, name: &str) -> PathBuf {
        self.places.image_disks.join((self.places.image_file)(name))
    }
    /// The file image `name` is made in.
    pub fn image_part(&self, name: &str) -> PathBuf {
        self.places
            .image_disks
            .join((self.places.image_part_file)(name))
    }
    /// The copy on its way to becoming the part file, for drivers that make one.
    pub fn image_copy(&self, name: &str) -> Option<PathBuf> {
        self.places
            .image_copy_file
            .map(|f| self.places.image_disks.join(f(name)))
    }
    /// Base `id`'s disk.
    pub fn base_disk(&self, id: &str) -> PathBuf {
        self.places.bases.disk(id)
    }

    /// `Invalid` unless `name` is a valid VM or image name.
    pub fn check_name(&self, what: &str, name: &str) -> Result<()> {
        if files::valid_name(name) {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "{what} name `{name}` is not valid for the {} backend: use 1-63 of a-z, 0-9, '-' and '.'",
                self.backend
            )))
        }
    }

    /// Take lock `locks/<what>.lock` (`vm-<name>`, `image-<name>`, `base-<id>`), making the
    /// directory when missing.
    pub async fn lock(&self, what: &str) -> Result<FileLock> {
        let dir = self.locks();
        std::fs::create_dir_all(&dir).map_err(crate::io(format!("creating {}", dir.display())))?;
        FileLock::acquire(dir.join(format!("{what}.lock")))
            .await
            .map_err(crate::io(format!("locking {what}")))
    }

    fn not_found(&self, what: impl Into<String>) -> BackendError {
        BackendError::not_found(self.backend, what)
    }
    fn unreachable(&self, message: impl Into<String>) -> BackendError {
        BackendError::unreachable(self.backend, message)
    }
}
