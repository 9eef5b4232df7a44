//! The fake backend: VMs and images as directories, with fault injection at every step.
//!
//! It is real code, not a mock: its state lives on disk under its dir
//! (`$BOXERY_HOME/fake/`), so it survives a killed control plane, and several processes may
//! use one dir. It is the workhorse of boxery's crash and race tests; `docs/backends.md`
//! documents the layout, the fault format and the journal for test authors.
//!
//! # Layout
//! ```text
//! vms/<name>/vm.json        the VM record (VmRecord), written last: the commit point
//! vms/<name>/disk           the VM's disk contents (tests write into it: write_disk)
//! vms/<name>/mark           the uid, written first (so a partial create knows its owner)
//! vms/<name>/disk.new       a reimage's staged disk; reimage.json names its image
//! images/<name>/image.json  the image record (ImageRecord)
//! images/<name>/disk        the image's disk contents
//! staging/images/<name>/    an image being captured/built, renamed into images/ at commit
//! trash/<uuid>/             a removed VM or image being deleted (swept on every removal)
//! journal.log               one JSON line per completed operation (JournalEntry)
//! faults.json               fault configuration (FaultConfig), optional
//! fault-counters.json       persistent call counters of the fault rules
//! ```
//!
//! # Guarantees
//! - A VM is complete exactly when `vm.json` exists; an image exactly when it is in
//!   `images/<name>/` with its `image.json`. `get`, `list` and `images` show only complete
//!   ones; partial ones are found by the recovery hooks (`cleanup_new`, `cleanup_image`,
//!   `recover_capture`) and by [`FakeBackend::leftovers`].
//! - Every record is written with temp file + rename; removals rename into `trash/` first,
//!   so a VM or image disappears atomically.
//! - Disks are independent copies: images and VMs never share or reference files.
//! - `create`, `capture` and `build_image` are idempotent for the same uid (a complete VM or
//!   image with the same mark is success, and is not journaled again); a different mark under
//!   the same name is `BackendError::Failed`.
//! - `reimage` stages the new disk as `disk.new` (+ `reimage.json`) before touching the VM;
//!   a retry after an interruption resumes from what it finds, even if the image is gone.
//!
//! # Assumptions
//! - One operation at a time per VM or image name (the reconcile runtime guarantees it);
//!   operations on different names may run at once, in one process or several.
//!
//! # Caveats
//! - File I/O is synchronous inside the async methods: the files are tiny.
//! - Nothing is fsynced: the fake guards against killed processes, not power loss.
//! - Captures are live and never change the source's power state, so `recover_capture` has
//!   no source state to restore and ignores `original`.

mod faults;
mod fsutil;
mod journal;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use faults::{
    COUNTERS_FILE, FAULTS_ENV, FAULTS_FILE, FaultAction, FaultConfig, FaultRule, STEPS,
};
pub use journal::{JOURNAL_FILE, JournalEntry, JournalOp};

use crate::{
    Backend, BackendError, Capabilities, DiskSource, Identity, ImageInfo, NewVm, PowerState,
    Progress, Result, Stability, Stock, VmInfo, VmSize,
};
use faults::{Decision, Faults};
use fsutil::{
    copy_atomic, exists, mkdirs, read_json, remove_file, remove_tree, write_atomic, write_json,
};

const BACKEND: &str = "fake";
/// Stock images the fake can build.
pub const STOCK_IMAGES: &[&str] = boxery_api::vm::STOCK_IMAGES;
/// The disk size (GiB) recorded for a stock image: VMs made from it need at least this.
pub const STOCK_DISK_GIB: u64 = 1;
/// Most CPUs a fake VM may have.
pub const MAX_CPUS: u32 = 64;
/// Most memory (MiB) a fake VM may have: 1 TiB.
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Largest disk (GiB) a fake VM may have: 64 TiB.
pub const MAX_DISK_GIB: u64 = 1 << 16;

const VM_JSON: &str = "vm.json";
const IMAGE_JSON: &str = "image.json";
const DISK: &str = "disk";
const DISK_NEW: &str = "disk.new";
const REIMAGE_JSON: &str = "reimage.json";
const MARK: &str = "mark";

/// A fake VM's record: `vms/<name>/vm.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// The VM's name.
    pub name: String,
    /// The uid it was made for; `None` for something boxery did not make.
    pub mark: Option<String>,
    /// Running or stopped.
    pub state: PowerState,
    /// Its configured size.
    pub size: VmSize,
    /// The image it was created from.
    pub source: Option<String>,
    /// The identity it was given (replaced by `reimage`'s).
    pub identity: Identity,
    /// Its MAC address: hypervisor-side identity, kept across reimages.
    pub mac: String,
    /// When it was created.
    pub created: boxery_api::Time,
    /// The image its disk was last replaced with by `reimage`.
    #[serde(default)]
    pub reimaged_from: Option<String>,
    /// Why the running VM is degraded ([`FakeBackend::degrade`]); `repair` and `stop` clear it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
    /// The memory `suspend` saved (a quarter of its size, as a guest that touched that much);
    /// `start` and `stop` drop it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::SavedMemory>,
}

/// A fake image's record: `images/<name>/image.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// The image's name.
    pub name: String,
    /// The uid it was made for; `None` for something boxery did not make.
    pub mark: Option<String>,
    /// When it was made.
    pub created: boxery_api::Time,
    /// The VM it was captured from.
    #[serde(default)]
    pub source_vm: Option<String>,
    /// The stock image it was built as.
    #[serde(default)]
    pub stock: Option<String>,
    /// The disk size (GiB) of its source: VMs made from it need at least this.
    pub disk_gib: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct ReimageMarker {
    image: String,
}

/// The fake backend. Cheap to make; every call reads its state from disk.
#[derive(Debug)]
pub struct FakeBackend {
    dir: PathBuf,
    faults: Faults,
}

impl FakeBackend {
    /// A fake backend keeping its state in `dir` (made on first use). Reads the fault
    /// configuration in `BOXERY_FAKE_FAULTS` now; an invalid one fails every call.
    pub fn new(dir: PathBuf) -> Self {
        FakeBackend {
            faults: Faults::new(dir.clone()),
            dir,
        }
    }

    /// Its state dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn vm_dir(&self, name: &str) -> PathBuf {
        self.dir.join("vms").join(name)
    }
    fn image_dir(&self, name: &str) -> PathBuf {
        self.dir.join("images").join(name)
    }
    fn staging_dir(&self, image: &str) -> PathBuf {
        self.dir.join("staging").join("images").join(image)
    }
    fn trash_dir(&self) -> PathBuf {
        self.dir.join("trash")
    }

    /// Run fault injection for `step`.
    async fn step(&self, step: &str) -> Result<()> {
        match self.faults.check(step).await? {
            Decision::Proceed => Ok(()),
            Decision::Fire {
                action,
                rule,
                call,
                ms,
            } => {
                let why = format!("injected fault (rule {rule}, call {call} of step `{step}`)");
                match action {
                    FaultAction::Fail => Err(BackendError::failed(step, why)),
                    FaultAction::Unreachable => Err(BackendError::Unreachable {
                        backend: BACKEND.into(),
                        message: why,
                    }),
                    FaultAction::Hang => {
                        tracing::warn!(step, rule, call, "fake backend: injected hang");
                        let never: std::convert::Infallible = std::future::pending().await;
                        match never {}
                    }
                    FaultAction::Exit => {
                        eprintln!("boxery fake backend: {why}: exiting with status 137");
                        std::process::exit(137)
                    }
                    FaultAction::Sleep => {
                        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                        Ok(())
                    }
                }
            }
        }
    }

    fn record(
        &self,
        op: JournalOp,
        name: &str,
        uid: Option<&str>,
        source: Option<&str>,
    ) -> Result<()> {
        mkdirs(&self.dir)?;
        journal::append(
            &self.dir.join(JOURNAL_FILE),
            &JournalEntry::new(op, name, uid, source),
        )
    }

    /// The record of a complete VM (marked or not); `None` when absent or partial.
    pub fn vm_record(&self, name: &str) -> Result<Option<VmRecord>> {
        check_name("VM", name)?;
        read_json(&self.vm_dir(name).join(VM_JSON))
    }

    /// The record of a complete image (marked or not); `None` when absent or partial.
    pub fn image_record(&self, name: &str) -> Result<Option<ImageRecord>> {
        check_name("image", name)?;
        read_json(&self.image_dir(name).join(IMAGE_JSON))
    }

    fn require_vm(&self, name: &str) -> Result<VmRecord> {
        self.vm_record(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))
    }

    fn write_vm(&self, rec: &VmRecord) -> Result<()> {
        write_json(&self.vm_dir(&rec.name).join(VM_JSON), rec)
    }

    /// Fault point `step`, then VM `name`'s record changed by `change`: written and journalled
    /// as `op` only when `change` says it changed something (a power change is idempotent).
    async fn change_vm(
        &self,
        step: &str,
        op: JournalOp,
        name: &str,
        change: impl FnOnce(&mut VmRecord) -> bool,
    ) -> Result<()> {
        self.step(step).await?;
        let mut rec = self.require_vm(name)?;
        if change(&mut rec) {
            self.write_vm(&rec)?;
            self.record(op, name, rec.mark.as_deref(), None)?;
        }
        Ok(())
    }

    fn vm_info(&self, rec: VmRecord) -> VmInfo {
        let used = std::fs::metadata(self.vm_dir(&rec.name).join(DISK))
            .ok()
            .map(|m| m.len());
        VmInfo {
            ssh: (rec.state == PowerState::Running).then(|| endpoint(&rec.name)),
            name: rec.name,
            mark: rec.mark,
            state: rec.state,
            size: rec.size,
            disk_used_bytes: used,
            degraded: rec.degraded.filter(|_| rec.state == PowerState::Running),
            memory: rec.memory.filter(|_| rec.state == PowerState::Suspended),
            inherited: false,
        }
    }

    /// Move `path` into the trash and delete it there; returns whether it existed.
    fn discard(&self, path: &Path) -> Result<bool> {
        if !exists(path) {
            return Ok(false);
        }
        let trash = self.trash_dir();
        mkdirs(&trash)?;
        let target = trash.join(uuid::Uuid::new_v4().simple().to_string());
        match std::fs::rename(path, &target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => {
                return Err(BackendError::io(
                    format!("cannot move {} to {}", path.display(), target.display()),
                    e,
                ));
            }
        }
        // It is gone from the namespace now; a failure here (another process sweeping the
        // same entry) leaves trash that the next sweep deletes.
        if let Err(e) = remove_tree(&target) {
            tracing::debug!(error = %e, "fake backend: trash entry left for the next sweep");
        }
        self.sweep_trash();
        Ok(true)
    }

    /// Delete what killed processes left in the trash (best effort: others may sweep too).
    fn sweep_trash(&self) {
        if let Ok(entries) = std::fs::read_dir(self.trash_dir()) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// The uid a VM dir belongs to, complete or partial.
    fn vm_dir_mark(&self, name: &str) -> Option<String> {
        let dir = self.vm_dir(name);
        if let Ok(Some(rec)) = read_json::<VmRecord>(&dir.join(VM_JSON)) {
            return rec.mark;
        }
        std::fs::read_to_string(dir.join(MARK))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Rename a finished staging dir to `images/<image>`.
    fn publish(&self, staging: &Path, image: &str) -> Result<()> {
        let target = self.image_dir(image);
        mkdirs(&self.dir.join("images"))?;
        if exists(&target) {
            if exists(&target.join(IMAGE_JSON)) {
                return Err(BackendError::failed(
                    "publish image",
                    format!("image {image} appeared while it was being made; remove it and retry"),
                ));
            }
            self.discard(&target)?;
        }
        std::fs::rename(staging, &target).map_err(|e| {
            BackendError::io(
                format!(
                    "cannot rename {} to {}",
                    staging.display(),
                    target.display()
                ),
                e,
            )
        })
    }

    /// Check that no complete image `image` exists, or that it has mark `uid` (then `true`:
    /// the work is already done).
    fn image_done(&self, image: &str, uid: &str, step: &str) -> Result<bool> {
        match self.image_record(image)? {
            None => Ok(false),
            Some(rec)
                if rec
                    .mark
                    .as_deref()
                    .is_some_and(|m| crate::mark::Mark::same_object(m, uid)) =>
            {
                Ok(true)
            }
            Some(rec) => Err(BackendError::failed(
                step,
                format!(
                    "image {image} already exists with mark {}, not {uid}: remove it first",
                    rec.mark.as_deref().unwrap_or("(none)")
                ),
            )),
        }
    }

    /// List the complete records under `kind/` (`vms` or `images`).
    fn scan<T: serde::de::DeserializeOwned>(&self, kind: &str, file: &str) -> Result<Vec<T>> {
        let dir = self.dir.join(kind);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(BackendError::Unreachable {
                    backend: BACKEND.into(),
                    message: format!("cannot read {}: {e}", dir.display()),
                });
            }
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| BackendError::Unreachable {
                backend: BACKEND.into(),
                message: format!("cannot read {}: {e}", dir.display()),
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                // A writer killed mid-write left its temp file: the inventory's pass is the
                // ordinary path that clears it.
                fsutil::sweep_dead_temps(&entry.path());
                names.push(name);
            }
        }
        names.sort();
        let mut out = Vec::new();
        for name in names {
            if let Some(rec) = read_json(&dir.join(&name).join(file))? {
                out.push(rec);
            }
        }
        Ok(out)
    }

    // ----- helpers for tests -----

    /// Write `faults.json` (atomically) and reset the call counters.
    pub fn set_faults(&self, config: &FaultConfig) -> Result<()> {
        self.faults.set(config)
    }

    /// Remove `faults.json` and reset the call counters (rules from `BOXERY_FAKE_FAULTS` stay).
    pub fn clear_faults(&self) -> Result<()> {
        self.faults.clear()
    }

    /// How many times each step named by a rule was reached since the configuration changed.
    pub fn fault_counts(&self) -> Result<BTreeMap<String, u64>> {
        self.faults.counts()
    }

    /// Every journal entry, oldest first.
    pub fn journal(&self) -> Result<Vec<JournalEntry>> {
        journal::read(&self.dir.join(JOURNAL_FILE))
    }

    /// Overwrite a VM's disk contents (a guest write). The VM may be partial.
    pub fn write_disk(&self, vm: &str, bytes: &[u8]) -> Result<()> {
        check_name("VM", vm)?;
        let dir = self.vm_dir(vm);
        if !exists(&dir) {
            return Err(not_found(format!("VM {vm}")));
        }
        write_atomic(&dir.join(DISK), bytes)
    }

    /// A VM's disk contents.
    pub fn read_disk(&self, vm: &str) -> Result<Vec<u8>> {
        check_name("VM", vm)?;
        read_file(&self.vm_dir(vm).join(DISK), || {
            not_found(format!("disk of VM {vm}"))
        })
    }

    /// A complete image's disk contents.
    pub fn read_image_disk(&self, image: &str) -> Result<Vec<u8>> {
        check_name("image", image)?;
        read_file(&self.image_dir(image).join(DISK), || {
            not_found(format!("disk of image {image}"))
        })
    }

    /// Add a complete VM without `create` (no faults, no journal): `mark: None` is something
    /// boxery did not make, `Some(uid)` a marked orphan. Its disk holds `"<name>\n"`.
    pub fn add_vm(&self, name: &str, mark: Option<&str>, state: PowerState) -> Result<()> {
        check_name("VM", name)?;
        let dir = self.vm_dir(name);
        mkdirs(&dir)?;
        write_atomic(&dir.join(DISK), format!("{name}\n").as_bytes())?;
        self.write_vm(&VmRecord {
            name: name.into(),
            mark: mark.map(str::to_string),
            state,
            size: VmSize {
                cpus: 1,
                memory_mib: 1024,
                disk_gib: STOCK_DISK_GIB,
            },
            source: None,
            identity: Identity {
                hostname: name.into(),
                ..Identity::default()
            },
            mac: new_mac(),
            created: boxery_api::now(),
            reimaged_from: None,
            degraded: None,
            memory: None,
        })
    }

    /// Say the running VM `name` is degraded (`why`), as a qemu VM whose network helper died
    /// is (no faults, no journal): `get` reports it until `repair` (or `stop`).
    pub fn degrade(&self, name: &str, why: &str) -> Result<()> {
        let mut rec = self.require_vm(name)?;
        rec.degraded = Some(why.into());
        self.write_vm(&rec)
    }

    /// Make the suspended VM `name`'s saved memory stale (`why`), as a qemu VM's is once QEMU
    /// was upgraded (no faults, no journal): `start` refuses it until `stop` discards it.
    pub fn stale_memory(&self, name: &str, why: &str) -> Result<()> {
        let mut rec = self.require_vm(name)?;
        let Some(m) = rec.memory.as_mut() else {
            return Err(BackendError::Invalid(format!("VM {name} is not suspended")));
        };
        m.stale = Some(why.into());
        self.write_vm(&rec)
    }

    /// Add a complete image without capturing (no faults, no journal); its disk holds
    /// `"<name>\n"`.
    pub fn add_image(&self, name: &str, mark: Option<&str>) -> Result<()> {
        check_name("image", name)?;
        let staging = self.stage_image(name, mark, None)?;
        self.publish(&staging, name)
    }

    /// Stage image `image` afresh (marked `mark`; `stock`: the stock image it is built as),
    /// its disk holding `"<stock or image>\n"`: the staging directory, for [`Self::publish`].
    fn stage_image(&self, image: &str, mark: Option<&str>, stock: Option<&str>) -> Result<PathBuf> {
        let staging = self.staging_dir(image);
        remove_tree(&staging)?;
        mkdirs(&staging)?;
        let disk = format!("{}\n", stock.unwrap_or(image));
        write_atomic(&staging.join(DISK), disk.as_bytes())?;
        write_json(
            &staging.join(IMAGE_JSON),
            &ImageRecord {
                name: image.into(),
                mark: mark.map(str::to_string),
                created: boxery_api::now(),
                source_vm: None,
                stock: stock.map(str::to_string),
                disk_gib: STOCK_DISK_GIB,
            },
        )?;
        Ok(staging)
    }

    /// Leave what a create killed after its disk copy leaves: a VM dir with a mark and a
    /// disk but no `vm.json`.
    pub fn add_partial_vm(&self, name: &str, uid: &str) -> Result<()> {
        check_name("VM", name)?;
        let dir = self.vm_dir(name);
        mkdirs(&dir)?;
        write_atomic(&dir.join(MARK), uid.as_bytes())?;
        write_atomic(&dir.join(DISK), b"partial\n")
    }

    /// Leave what a capture killed before its commit leaves: a staging dir with a disk.
    pub fn add_partial_image(&self, name: &str) -> Result<()> {
        check_name("image", name)?;
        let staging = self.staging_dir(name);
        mkdirs(&staging)?;
        write_atomic(&staging.join(DISK), b"partial\n")
    }

    /// Everything that is not part of a complete VM or image: partial VM dirs, staging dirs,
    /// partial image dirs, staged reimage disks, trash, temp files. Paths relative to the dir,
    /// sorted. Empty after every crash has been recovered.
    pub fn leftovers(&self) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        let list = |p: &Path| -> Vec<PathBuf> {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .map(|it| it.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            v.sort();
            v
        };
        for vm in list(&self.dir.join("vms")) {
            if !exists(&vm.join(VM_JSON)) {
                out.push(vm);
                continue;
            }
            for f in list(&vm) {
                let n = f
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if n.starts_with('.') || n == DISK_NEW || n == REIMAGE_JSON {
                    out.push(f);
                }
            }
        }
        for image in list(&self.dir.join("images")) {
            if !exists(&image.join(IMAGE_JSON)) {
                out.push(image);
            }
        }
        out.extend(list(&self.dir.join("staging").join("images")));
        out.extend(list(&self.trash_dir()));
        Ok(out
            .into_iter()
            .map(|p| {
                p.strip_prefix(&self.dir)
                    .map(Path::to_path_buf)
                    .unwrap_or(p)
            })
            .collect())
    }
}

#[async_trait]
impl Backend for FakeBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: BACKEND,
            stability: Stability::TestOnly,
            platforms: &["any"],
            requirements: &[],
            resize: true,
            live_capture: true,
            suspend: true,
            memory_snapshots: false,
            build_stock_image: true,
            host_key: false,
            ssh: false,
            // it measures nothing (`usage` lists its running VMs with zero use)
            usage: false,
            screen: false,
            instance_types: &[crate::InstanceType::VirtualMachine],
        }
    }

    async fn check(&self) -> Result<()> {
        self.step("check").await
    }

    async fn init(&self) -> Result<()> {
        self.step("init").await?;
        for sub in ["vms", "images", "staging/images", "trash"] {
            mkdirs(&self.dir.join(sub))?;
        }
        self.sweep_trash();
        Ok(())
    }

    async fn create(&self, vm: &NewVm) -> Result<()> {
        self.step("create").await?;
        check_name("VM", &vm.name)?;
        if vm.memory {
            return Err(BackendError::Unsupported {
                backend: "fake".into(),
                what: "start a VM from memory".into(),
            });
        }
        check_size(
            &vm.name,
            VmSize {
                cpus: vm.cpus,
                memory_mib: vm.memory_mib,
                disk_gib: vm.disk_gib,
            },
        )?;
        if let Some(rec) = self.vm_record(&vm.name)? {
            if rec
                .mark
                .as_deref()
                .is_some_and(|m| crate::mark::Mark::same_object(m, &vm.uid))
            {
                return Ok(());
            }
            return Err(BackendError::failed(
                "create",
                format!(
                    "VM {} already exists with mark {}, not {}: remove it first",
                    vm.name,
                    rec.mark.as_deref().unwrap_or("(none)"),
                    vm.uid
                ),
            ));
        }
        let DiskSource::Image(image) = &vm.source;
        check_name("image", image)?;
        let source = self
            .image_record(image)?
            .ok_or_else(|| not_found(format!("image {image}")))?;
        if vm.disk_gib < source.disk_gib {
            return Err(BackendError::Invalid(format!(
                "VM {} asks for a {} GiB disk, smaller than its image {image} ({} GiB): ask for at least {} GiB",
                vm.name, vm.disk_gib, source.disk_gib, source.disk_gib
            )));
        }

        self.step("create.begin").await?;
        let dir = self.vm_dir(&vm.name);
        // A partial dir is an earlier attempt's: start over.
        self.discard(&dir)?;
        mkdirs(&dir)?;
        write_atomic(&dir.join(MARK), vm.uid.as_bytes())?;

        self.step("create.disk").await?;
        copy_atomic(&self.image_dir(image).join(DISK), &dir.join(DISK))?;

        self.step("create.commit").await?;
        self.write_vm(&VmRecord {
            name: vm.name.clone(),
            mark: Some(vm.uid.clone()),
            state: if vm.start {
                PowerState::Running
            } else {
                PowerState::Stopped
            },
            size: VmSize {
                cpus: vm.cpus,
                memory_mib: vm.memory_mib,
                disk_gib: vm.disk_gib,
            },
            source: Some(image.clone()),
            identity: vm.identity.clone(),
            mac: new_mac(),
            created: boxery_api::now(),
            reimaged_from: None,
            degraded: None,
            memory: None,
        })?;
        self.record(JournalOp::Create, &vm.name, Some(&vm.uid), Some(image))?;
        self.step("create.done").await
    }

    async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        self.step("get").await?;
        Ok(self
            .vm_record(name)?
            .filter(|r| r.mark.is_some())
            .map(|r| self.vm_info(r)))
    }

    async fn list(&self) -> Result<Vec<VmInfo>> {
        self.step("list").await?;
        Ok(self
            .scan::<VmRecord>("vms", VM_JSON)?
            .into_iter()
            .map(|r| self.vm_info(r))
            .collect())
    }

    /// Each running VM, using nothing of the host (it has no process, so it measures nothing:
    /// [`Capabilities::usage`] is false). The usage sampler still charges each its size over
    /// time, as on every backend, so budgets can be tested on it.
    async fn usage(&self) -> Result<Vec<crate::VmUsage>> {
        self.step("usage").await?;
        Ok(self
            .scan::<VmRecord>("vms", VM_JSON)?
            .into_iter()
            .filter(|r| r.state == PowerState::Running)
            .map(|r| crate::VmUsage {
                name: r.name,
                cpu_seconds: 0.0,
                rss_bytes: 0,
                network_rx_bytes: None,
                network_tx_bytes: None,
            })
            .collect())
    }

    async fn ssh_endpoint(&self, name: &str) -> Result<Option<String>> {
        self.step("ssh_endpoint").await?;
        let rec = self.require_vm(name)?;
        Ok((rec.state == PowerState::Running).then(|| endpoint(name)))
    }

    async fn start(&self, name: &str) -> Result<()> {
        if let Some(why) = self
            .vm_record(name)?
            .and_then(|r| r.memory)
            .and_then(|m| m.stale)
        {
            return Err(BackendError::stale_memory(name, &why));
        }
        self.change_vm("start", JournalOp::Start, name, |rec| {
            rec.memory = None;
            std::mem::replace(&mut rec.state, PowerState::Running) != PowerState::Running
        })
        .await
    }

    async fn suspend(&self, name: &str) -> Result<()> {
        if self.require_vm(name)?.state == PowerState::Stopped {
            return Err(BackendError::Invalid(format!(
                "VM {name} is stopped: there is no memory to suspend"
            )));
        }
        self.change_vm("suspend", JournalOp::Suspend, name, |rec| {
            if rec.state == PowerState::Suspended {
                return false;
            }
            rec.state = PowerState::Suspended;
            rec.degraded = None;
            rec.memory = Some(crate::SavedMemory {
                bytes: rec.size.memory_mib * 1024 * 1024 / 4,
                saved_at: boxery_api::now(),
                stale: None,
            });
            true
        })
        .await
    }

    async fn repair(&self, name: &str) -> Result<()> {
        self.change_vm("repair", JournalOp::Repair, name, |rec| {
            rec.degraded.take().is_some()
        })
        .await
    }

    async fn stop(&self, name: &str) -> Result<()> {
        self.change_vm("stop", JournalOp::Stop, name, |rec| {
            if rec.state == PowerState::Stopped {
                return false;
            }
            rec.state = PowerState::Stopped;
            rec.degraded = None;
            rec.memory = None;
            true
        })
        .await
    }

    async fn remove(&self, name: &str) -> Result<()> {
        self.step("remove").await?;
        check_name("VM", name)?;
        let mark = self.vm_dir_mark(name);
        if self.discard(&self.vm_dir(name))? {
            self.record(JournalOp::Remove, name, mark.as_deref(), None)?;
        }
        self.step("remove.done").await
    }

    async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        self.step("resize").await?;
        let mut rec = self.require_vm(name)?;
        check_size(name, size)?;
        if rec.state == PowerState::Suspended && size != rec.size {
            return Err(BackendError::Invalid(format!(
                "VM {name} is suspended: its saved memory holds its size; resume it first (or stop it, which discards the memory)"
            )));
        }
        if size.disk_gib < rec.size.disk_gib {
            return Err(BackendError::Invalid(format!(
                "cannot shrink the disk of VM {name} from {} GiB to {} GiB: disks only grow",
                rec.size.disk_gib, size.disk_gib
            )));
        }
        if rec.size != size {
            rec.size = size;
            self.write_vm(&rec)?;
            self.record(JournalOp::Resize, name, rec.mark.as_deref(), None)?;
        }
        Ok(())
    }

    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        self.step("capture").await?;
        check_name("image", image)?;
        let source = self.require_vm(vm)?;
        if self.image_done(image, uid, "capture")? {
            return Ok(());
        }

        self.step("capture.begin").await?;
        let staging = self.staging_dir(image);
        remove_tree(&staging)?;
        mkdirs(&staging)?;

        self.step("capture.copy").await?;
        copy_atomic(&self.vm_dir(vm).join(DISK), &staging.join(DISK))?;
        write_json(
            &staging.join(IMAGE_JSON),
            &ImageRecord {
                name: image.into(),
                mark: Some(uid.into()),
                created: boxery_api::now(),
                source_vm: Some(vm.into()),
                stock: None,
                disk_gib: source.size.disk_gib,
            },
        )?;

        self.step("capture.commit").await?;
        self.publish(&staging, image)?;
        self.record(JournalOp::Capture, image, Some(uid), Some(vm))?;
        self.step("capture.done").await
    }

    async fn images(&self) -> Result<Vec<ImageInfo>> {
        self.step("images").await?;
        Ok(self
            .scan::<ImageRecord>("images", IMAGE_JSON)?
            .into_iter()
            .map(|r| ImageInfo {
                size_bytes: std::fs::metadata(self.image_dir(&r.name).join(DISK))
                    .ok()
                    .map(|m| m.len()),
                name: r.name,
                mark: r.mark,
                created: Some(r.created),
                memory_bytes: None,
            })
            .collect())
    }

    async fn remove_image(&self, image: &str) -> Result<()> {
        self.step("remove_image").await?;
        check_name("image", image)?;
        let mark = self.image_record(image).ok().flatten().and_then(|r| r.mark);
        if self.discard(&self.image_dir(image))? {
            self.record(JournalOp::RemoveImage, image, mark.as_deref(), None)?;
        }
        self.step("remove_image.done").await
    }

    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        // Until the swap, a failure leaves the VM as it was: `Unchanged`.
        let unchanged = |e: BackendError| match e {
            e @ BackendError::Failed { .. } => BackendError::Unchanged(e.chain()),
            BackendError::Io { context, source } => {
                BackendError::Unchanged(format!("{context}: {source}"))
            }
            other => other,
        };
        self.step("reimage").await.map_err(unchanged)?;
        check_name("image", image)?;
        let mut rec = self.require_vm(vm)?;
        let dir = self.vm_dir(vm);
        let marker: Option<ReimageMarker> =
            read_json(&dir.join(REIMAGE_JSON)).map_err(unchanged)?;
        let resuming = marker.is_some_and(|m| m.image == image);
        if !resuming {
            // A stale marker (an abandoned reimage to another image) goes first.
            remove_file(&dir.join(REIMAGE_JSON)).map_err(unchanged)?;
            remove_file(&dir.join(DISK_NEW)).map_err(unchanged)?;
            let source = self
                .image_record(image)
                .map_err(unchanged)?
                .ok_or_else(|| {
                    BackendError::Unchanged(format!("image {image} not found in the fake backend"))
                })?;
            if rec.size.disk_gib < source.disk_gib {
                return Err(BackendError::Unchanged(format!(
                    "image {image} needs a {} GiB disk and VM {vm} has {} GiB: resize it first",
                    source.disk_gib, rec.size.disk_gib
                )));
            }
            self.step("reimage.stage").await.map_err(unchanged)?;
            copy_atomic(&self.image_dir(image).join(DISK), &dir.join(DISK_NEW))
                .map_err(unchanged)?;
            write_json(
                &dir.join(REIMAGE_JSON),
                &ReimageMarker {
                    image: image.into(),
                },
            )
            .map_err(unchanged)?;
        }

        self.step("reimage.swap").await?;
        // With the marker in place, a missing disk.new means the swap already happened.
        let staged = dir.join(DISK_NEW);
        if exists(&staged) {
            std::fs::rename(&staged, dir.join(DISK))
                .map_err(|e| BackendError::io(format!("cannot swap in {}", staged.display()), e))?;
        }
        rec.state = PowerState::Running;
        rec.memory = None;
        rec.identity = identity.clone();
        rec.reimaged_from = Some(image.into());
        self.write_vm(&rec)?;
        remove_file(&dir.join(REIMAGE_JSON))?;
        self.record(JournalOp::Reimage, vm, rec.mark.as_deref(), Some(image))?;
        self.step("reimage.done").await
    }

    async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        let Stock {
            name,
            layers,
            image,
            uid,
        } = stock;
        self.step("build").await?;
        check_name("image", image)?;
        if !STOCK_IMAGES.contains(&name) {
            return Err(BackendError::Invalid(format!(
                "unknown stock image `{name}`: the fake backend builds {}",
                STOCK_IMAGES.join(", ")
            )));
        }
        // no guest: the layers are only said (their names were checked when the Image was
        // written)
        let with = if layers.is_empty() {
            String::new()
        } else {
            format!(" with {}", layers.join(", "))
        };
        progress(&format!("building {name}{with} as image {image} (fake)"));
        if self.image_done(image, uid, "build")? {
            progress(&format!("image {image} is already built"));
            return Ok(());
        }
        let staging = self.stage_image(image, Some(uid), Some(name))?;
        self.step("build.commit").await?;
        self.publish(&staging, image)?;
        self.record(JournalOp::Build, image, Some(uid), Some(name))?;
        progress(&format!("built image {image}"));
        self.step("build.done").await
    }

    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.step("import").await?;
        check_name("image", image)?;
        let len = match std::fs::metadata(path) {
            Ok(m) if m.is_file() => m.len(),
            _ => {
                return Err(BackendError::Invalid(format!(
                    "cannot import {}: not a readable file",
                    path.display()
                )));
            }
        };
        if self.image_done(image, uid, "import")? {
            return Ok(());
        }
        let staging = self.staging_dir(image);
        remove_tree(&staging)?;
        mkdirs(&staging)?;
        copy_atomic(path, &staging.join(DISK))?;
        write_json(
            &staging.join(IMAGE_JSON),
            &ImageRecord {
                name: image.into(),
                mark: Some(uid.into()),
                created: boxery_api::now(),
                source_vm: None,
                stock: None,
                disk_gib: len.div_ceil(1 << 30).max(1),
            },
        )?;
        self.step("import.commit").await?;
        self.publish(&staging, image)?;
        let file = path.display().to_string();
        self.record(JournalOp::Import, image, Some(uid), Some(&file))?;
        self.step("import.done").await
    }

    /// Removes the VM dir only when it has no `vm.json`: a complete VM is left alone
    /// (`remove` deletes it).
    async fn cleanup_new(&self, name: &str) -> Result<()> {
        self.step("cleanup_new").await?;
        check_name("VM", name)?;
        let dir = self.vm_dir(name);
        if exists(&dir.join(VM_JSON)) {
            tracing::debug!(
                vm = name,
                "fake cleanup_new: the VM is complete, leaving it"
            );
            return Ok(());
        }
        let mark = self.vm_dir_mark(name);
        if self.discard(&dir)? {
            self.record(JournalOp::CleanupNew, name, mark.as_deref(), None)?;
        }
        Ok(())
    }

    async fn cleanup_image(&self, image: &str) -> Result<()> {
        self.step("cleanup_image").await?;
        check_name("image", image)?;
        let staging = self.staging_dir(image);
        let mark = self
            .image_record(image)
            .ok()
            .flatten()
            .or_else(|| {
                read_json::<ImageRecord>(&staging.join(IMAGE_JSON))
                    .ok()
                    .flatten()
            })
            .and_then(|r| r.mark);
        let staged = self.discard(&staging)?;
        let published = self.discard(&self.image_dir(image))?;
        if staged || published {
            self.record(JournalOp::CleanupImage, image, mark.as_deref(), None)?;
        }
        Ok(())
    }

    /// Removes the capture's staging dir and an `images/<image>` dir without `image.json`;
    /// a complete image is left (the capture finished; `cleanup_image` deletes it).
    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        self.step("recover_capture").await?;
        check_name("VM", vm)?;
        check_name("image", image)?;
        let _ = original; // captures never change the source's state
        let staging = self.staging_dir(image);
        let mark = read_json::<ImageRecord>(&staging.join(IMAGE_JSON))
            .ok()
            .flatten()
            .and_then(|r| r.mark);
        let mut removed = self.discard(&staging)?;
        let published = self.image_dir(image);
        if exists(&published) && !exists(&published.join(IMAGE_JSON)) {
            removed |= self.discard(&published)?;
        }
        if removed {
            self.record(JournalOp::RecoverCapture, image, mark.as_deref(), Some(vm))?;
        }
        Ok(())
    }
}

/// A VM's fake ssh endpoint.
fn endpoint(name: &str) -> String {
    format!("fake:{name}")
}

fn not_found(what: String) -> BackendError {
    BackendError::NotFound {
        backend: BACKEND.into(),
        what,
    }
}

fn new_mac() -> String {
    let b: [u8; 3] = rand::random();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2])
}

fn read_file(path: &Path, missing: impl FnOnce() -> BackendError) -> Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(missing()),
        Err(e) => Err(BackendError::io(
            format!("cannot read {}", path.display()),
            e,
        )),
    }
}

/// Names become directory names: refuse what could escape or hide.
fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty()
        || name.starts_with('.')
        || name.contains(['/', '\\', '\0'])
        || name.len() > 255
    {
        return Err(BackendError::Invalid(format!(
            "{what} name `{name}` is not usable by the fake backend: use 1 to 255 characters, \
             no `/`, not starting with `.`"
        )));
    }
    Ok(())
}

fn check_size(vm: &str, size: VmSize) -> Result<()> {
    if size.cpus == 0 || size.cpus > MAX_CPUS {
        return Err(BackendError::Invalid(format!(
            "VM {vm} asks for {} CPUs: the fake backend allows 1 to {MAX_CPUS}",
            size.cpus
        )));
    }
    if size.memory_mib == 0 || size.memory_mib > MAX_MEMORY_MIB {
        return Err(BackendError::Invalid(format!(
            "VM {vm} asks for {} MiB of memory: the fake backend allows 1 to {MAX_MEMORY_MIB}",
            size.memory_mib
        )));
    }
    if size.disk_gib == 0 || size.disk_gib > MAX_DISK_GIB {
        return Err(BackendError::Invalid(format!(
            "VM {vm} asks for a {} GiB disk: the fake backend allows 1 to {MAX_DISK_GIB}",
            size.disk_gib
        )));
    }
    Ok(())
}
