//! Suspend and resume: a VM's memory and device state saved to a file, QEMU gone, and loaded
//! back into a new QEMU that continues where the old one stopped (docs/live-memory.md).
//!
//! # How
//! - **Suspend**: the guest is paused, QEMU migrates to `file:.memory.state.part` with
//!   `mapped-ram` (each page at a fixed offset: the file is sparse, only touched pages take
//!   disk) and `multifd` (parallel writers), the file is synced and renamed to `memory.state`,
//!   then `memory.json` is written: the commit point. Then QEMU quits.
//! - **Resume**: a QEMU with the VM's command line and `-incoming defer` loads the file
//!   (`migrate-incoming`), then `cont`; the state files are removed once the guest runs
//!   again (from then on they describe the past). The guest's clock is set by its agent when
//!   it has one.
//!
//! # Guarantees
//! - A kill of the control plane or of QEMU at any step leaves either the running VM (the
//!   state is partial or absent) or a complete state (`memory.json` written), never both
//!   running: [`Inner::memory_repair`], run by `repair` and before every suspend and resume,
//!   finishes or rolls back. A QEMU that outlives a killed control plane finishes its
//!   migration by itself; QEMU remembers how it went (`query-migrate`), so it is committed or
//!   rolled back from that.
//! - The state is tied to what can restore it: the QEMU version and the command line
//!   (machine, devices; the block graph aside, [`tie`]). A state that no longer matches is
//!   kept and reported ([`crate::SavedMemory::stale`]); only `stop` discards it.
//! - A VM's state (`vms/NAME/memory.*`) and an image's (`image-memory/NAME.*`) are the same
//!   three files ([`StateFiles`]), written by one save ([`Inner::save_state`]).
//! - A resume on a host with less available memory than the state holds, or a suspend on a
//!   disk without room for it, fails before anything changes.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::*;
use process::had_screen;

/// `memory.json`: what a saved state is and what can restore it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct MemoryRecord {
    /// When it was saved.
    pub saved_at: boxery_api::Time,
    /// Bytes the state file takes on disk.
    pub bytes: u64,
    /// `qemu-system-x86_64 --version`'s first line when it was saved.
    pub qemu_version: String,
    /// The arguments of the QEMU it was saved from that a restore must repeat ([`tie`]).
    pub args: Vec<String>,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Why it cannot be restored, once a resume found out (kept for `get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale: Option<String>,
    /// The VM's pinned host key when it was saved (the guest holds that one): an image's
    /// memory restored by a revert is pinned to it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_key: Option<String>,
    /// [`Self::args`] with what is the saved VM's own (its name, directory, uuid, MAC, port)
    /// replaced by placeholders ([`portable`]): what another VM started from this memory must
    /// repeat. Empty in a record written before boxery could start VMs from memory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub portable: Vec<String>,
    /// Virtual CPUs (0 in a record written before it was kept).
    #[serde(default)]
    pub cpus: u32,
    /// The shared form ([`Inner::share_image_memory`]): the guest's RAM in a raw file and the
    /// device state beside it, instead of one `mapped-ram` state. A VM starts from it by
    /// mapping the RAM file privately and loading the device state alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_ram: bool,
}

/// `args`, tied arguments of VM `cfg`'s QEMU ([`tie`]), with the VM's own values (its
/// directory, name, uuid, MAC, ssh port) replaced by placeholders: equal for two VMs of the
/// same image, size and QEMU, so one's memory can start the other.
fn portable(args: &[String], cfg: &VmConfig, dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    let port = format!("127.0.0.1:{}-", cfg.port);
    let name = format!("guest={},", cfg.name);
    args.iter()
        .map(|a| {
            a.replace(&dir, "{dir}")
                .replace(&name, "guest={name},")
                .replace(&cfg.uuid, "{uuid}")
                .replace(&cfg.mac, "{mac}")
                .replace(&port, "127.0.0.1:{port}-")
        })
        .collect()
}

/// Where a conversion loads a memory image's RAM before it goes to disk: a file in
/// `/dev/shm` when that and the host's memory have room for `bytes`, else `fallback` itself.
/// Removed when dropped.
struct Staged {
    path: PathBuf,
}

impl Staged {
    fn new(fallback: &Path, bytes: u64) -> Staged {
        let shm = Path::new("/dev/shm");
        let room = free_bytes(shm)
            .unwrap_or(0)
            .min(available_memory().unwrap_or(0));
        let path = if shm.is_dir() && room > bytes.saturating_add(256 << 20) {
            shm.join(format!(
                "boxery-{}-{:016x}.ram",
                std::process::id(),
                rand::random::<u64>()
            ))
        } else {
            fallback.to_path_buf()
        };
        Staged { path }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.path.starts_with("/dev/shm") {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// How long a migration to or from a file may take per GiB of guest memory (TCG on two busy
/// cores writes well over 100 MiB/s), on top of a fixed minute.
const MIGRATION_PER_GIB: Duration = Duration::from_secs(60);

fn migration_timeout(memory_mib: u64) -> Duration {
    Duration::from_secs(60) + MIGRATION_PER_GIB * (memory_mib.div_ceil(1024) as u32)
}

/// The capabilities both sides of a file migration set (they must match).
const CAPS: &[(&str, bool)] = &[("mapped-ram", true), ("multifd", true)];

/// The capabilities of a migration of the device state alone, the RAM being in a file both
/// sides map (the shared form).
const DEVICE_CAPS: &[(&str, bool)] = &[
    ("mapped-ram", false),
    ("multifd", false),
    ("x-ignore-shared", true),
];

fn file_uri(path: &Path) -> String {
    format!("file:{}", path.display())
}

/// A saved state's files: the part QEMU writes, the state once whole, and the record written
/// last (the commit point: without it the others are partial).
pub(super) struct StateFiles {
    part: PathBuf,
    state: PathBuf,
    record: PathBuf,
    /// The shared form's RAM and device state ([`MemoryRecord::shared_ram`]).
    ram: PathBuf,
    dev: PathBuf,
}

impl StateFiles {
    /// The record, when the state is complete.
    pub(super) fn read(&self) -> Result<Option<MemoryRecord>> {
        crate::storage::files::read_json(&self.record)
            .map_err(io(format!("reading {}", self.record.display())))
    }

    fn write(&self, rec: &MemoryRecord) -> Result<()> {
        crate::storage::files::write_json(&self.record, rec, 0o600)
            .map_err(io(format!("writing {}", self.record.display())))
    }

    /// Remove them all (the record first).
    pub(super) fn remove(&self) -> Result<()> {
        for p in [&self.record, &self.state, &self.part, &self.ram, &self.dev] {
            remove_file_if_exists(p).map_err(io(format!("removing {}", p.display())))?;
        }
        Ok(())
    }

    /// The part is whole: sync it, move it in place, write `rec` with its size (the commit).
    fn commit(&self, mut rec: MemoryRecord) -> Result<MemoryRecord> {
        std::fs::File::open(&self.part)
            .and_then(|f| f.sync_all())
            .map_err(io(format!("syncing {}", self.part.display())))?;
        std::fs::rename(&self.part, &self.state).map_err(io(format!(
            "moving {} to {}",
            self.part.display(),
            self.state.display()
        )))?;
        rec.bytes = allocated_bytes(&self.state);
        self.write(&rec)?;
        crate::storage::files::sync_dir(&self.state).map_err(io("fsync"))?;
        Ok(rec)
    }
}

/// The arguments of launch spec `spec` a saved state is tied to ([`tie`]).
fn tied_args(spec: &LaunchSpec) -> Vec<String> {
    tie(process::command_line(spec)
        .iter()
        .map(|a| a.to_string_lossy().into_owned()))
}

impl Inner {
    /// VM `name`'s saved state: `vms/NAME/{.memory.state.part, memory.state, memory.json}`.
    pub(super) fn vm_state(&self, name: &str) -> StateFiles {
        StateFiles {
            part: self.layout.vm_memory_part(name),
            state: self.layout.vm_memory(name),
            record: self.layout.vm_memory_record(name),
            ram: self.layout.vm_memory_ram(name),
            dev: self.layout.vm_memory_dev(name),
        }
    }

    /// The memory image `image` carries: `image-memory/{.NAME.state.part, NAME.state,
    /// NAME.json}`.
    pub(super) fn image_state(&self, image: &str) -> StateFiles {
        StateFiles {
            part: self.layout.image_memory_part(image),
            state: self.layout.image_memory(image),
            record: self.layout.image_memory_record(image),
            ram: self.layout.image_memory_ram(image),
            dev: self.layout.image_memory_dev(image),
        }
    }

    pub(super) fn load_memory(&self, name: &str) -> Result<Option<MemoryRecord>> {
        self.vm_state(name).read()
    }

    /// Remove the VM's saved state.
    pub(super) fn discard_memory(&self, name: &str) -> Result<()> {
        self.vm_state(name).remove()
    }

    /// Why `rec` cannot be restored here: a reason found before, another QEMU version, or
    /// (given the `args` a restore would run with) another command line. `None`: it can.
    fn why_stale(&self, rec: &MemoryRecord, args: Option<&[String]>) -> Result<Option<String>> {
        if let Some(why) = &rec.stale {
            return Ok(Some(why.clone()));
        }
        let version = self.qemu_version()?;
        if version != rec.qemu_version {
            return Ok(Some(format!(
                "it was saved by {} and this host runs {version}",
                rec.qemu_version
            )));
        }
        let Some(args) = args.filter(|a| *a != rec.args.as_slice()) else {
            return Ok(None);
        };
        Ok(Some(format!(
            "it was saved under another QEMU command line ({})",
            args_change(&rec.args, args)
        )))
    }

    /// The saved memory as `get` reports it (`None` unless a complete state exists).
    pub(super) fn saved_memory(&self, name: &str) -> Result<Option<crate::SavedMemory>> {
        let Some(rec) = self.load_memory(name)? else {
            return Ok(None);
        };
        Ok(Some(crate::SavedMemory {
            bytes: rec.bytes,
            saved_at: rec.saved_at,
            stale: self.why_stale(&rec, None).ok().flatten(),
        }))
    }

    /// Why a running VM is half way through a suspend or resume (its QEMU runs beside a
    /// state file): `repair` settles it.
    pub(super) fn memory_in_flight(&self, name: &str) -> Option<String> {
        let part = self.layout.vm_memory_part(name).exists();
        let done = self.layout.vm_memory_record(name).exists();
        (part || done).then(|| {
            "a suspend or resume was interrupted (its QEMU runs beside a saved state): repair finishes or rolls it back".into()
        })
    }

    /// The first line of `qemu --version`, cached per binary modification time (an upgrade
    /// of QEMU under a running control plane is seen).
    pub(super) fn qemu_version(&self) -> Result<String> {
        static CACHE: std::sync::Mutex<Option<(PathBuf, Option<SystemTime>, String)>> =
            std::sync::Mutex::new(None);
        let bin = which(&self.config.qemu);
        let mtime = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
        if let Some((b, m, v)) = CACHE.lock().unwrap_or_else(|p| p.into_inner()).as_ref()
            && *b == bin
            && *m == mtime
            && mtime.is_some()
        {
            return Ok(v.clone());
        }
        let out = std::process::Command::new(&bin)
            .arg("--version")
            .output()
            .map_err(io(format!("running {} --version", bin.display())))?;
        let v = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        *CACHE.lock().unwrap_or_else(|p| p.into_inner()) = Some((bin, mtime, v.clone()));
        Ok(v)
    }

    /// What a state saved from QEMU `pid` of VM `cfg` is tied to (its size is the commit's).
    fn record_of(&self, cfg: &VmConfig, pid: i32) -> Result<MemoryRecord> {
        let args = process::launched_args(pid).map(tie).ok_or_else(|| {
            BackendError::failed(
                format!("save the memory of VM {}", cfg.name),
                "its QEMU exited",
            )
        })?;
        Ok(MemoryRecord {
            saved_at: boxery_api::now(),
            bytes: 0,
            qemu_version: self.qemu_version()?,
            portable: portable(&args, cfg, &self.vm_dir(&cfg.name)),
            args,
            memory_mib: cfg.memory_mib,
            stale: None,
            host_key: cfg.host_key.clone(),
            cpus: cfg.cpus,
            shared_ram: false,
        })
    }

    /// Save the paused guest of VM `cfg` (its QEMU `pid`, QMP `q`) into `files` and commit
    /// it. Nothing of a failed attempt stays; the guest stays paused either way (the caller
    /// lets it run, or ends its QEMU).
    async fn save_state(
        &self,
        q: &mut Qmp,
        cfg: &VmConfig,
        pid: i32,
        files: &StateFiles,
    ) -> Result<MemoryRecord> {
        let name = &cfg.name;
        let rec = self.record_of(cfg, pid)?;
        files.remove()?;
        let started: Result<(), qmp::QmpError> = async {
            q.migrate_set_capabilities(CAPS).await?;
            q.migrate_set_parameters(json!({"multifd-channels": 2, "max-bandwidth": 64u64 << 30}))
                .await?;
            q.migrate(&file_uri(&files.part)).await
        }
        .await;
        let saved = match started {
            Ok(()) => {
                self.wait_migration(q, name, migration_timeout(cfg.memory_mib))
                    .await
            }
            Err(e) => Err(BackendError::failed(
                format!("save the memory of VM {name}"),
                e,
            )),
        };
        let committed = saved.and_then(|()| files.commit(rec));
        if committed.is_err() {
            let _ = files.remove();
        }
        committed
    }

    /// Suspend the running VM `name` (lock held).
    pub(super) async fn suspend(&self, name: &str) -> Result<()> {
        self.memory_repair(name).await?;
        let Some(pid) = self.pid(name) else {
            if self.load_memory(name)?.is_some() {
                return Ok(());
            }
            return Err(BackendError::Invalid(format!(
                "VM {name} is stopped: there is no memory to suspend (start it first)"
            )));
        };
        let cfg = self
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        let t = Instant::now();
        // a capture's stream must not run under the migration
        self.wait_jobs(name, STREAM_WAIT).await?;
        let room = free_bytes(&self.vm_dir(name));
        let need = cfg.memory_mib * 1024 * 1024 + 64 * 1024 * 1024;
        if let Some(room) = room
            && room < need
        {
            return Err(BackendError::failed(
                format!("suspend VM {name}"),
                format!(
                    "its memory needs up to {} MiB on {} and only {} MiB are free: free some space (the VM keeps running)",
                    need >> 20,
                    self.vm_dir(name).display(),
                    room >> 20
                ),
            ));
        }
        let mut q = self.qmp(name).await?;
        let step = || format!("save the memory of VM {name}");
        let was_running = q
            .query_status()
            .await
            .map_err(|e| BackendError::failed(step(), e))?
            .running;
        // paused first: one pass over memory, no pages dirtied behind it
        q.stop()
            .await
            .map_err(|e| BackendError::failed(step(), e))?;
        if let Err(e) = self
            .save_state(&mut q, &cfg, pid, &self.vm_state(name))
            .await
        {
            // the guest goes on as it was
            if was_running {
                let _ = q.cont().await;
            }
            return Err(e);
        }
        drop(q);
        self.end_suspended(name, pid).await?;
        info!(
            vm = name,
            secs = t.elapsed().as_secs_f64(),
            "suspended: memory saved, QEMU ended"
        );
        Ok(())
    }

    /// Save the paused guest of VM `cfg` (its QEMU `pid`) as image `image`'s memory, before
    /// the image's own record (its commit point) is written; returns its size.
    pub(super) async fn save_image_memory(
        &self,
        q: &mut Qmp,
        cfg: &VmConfig,
        pid: i32,
        image: &str,
    ) -> Result<u64> {
        let rec = self
            .save_state(q, cfg, pid, &self.image_state(image))
            .await?;
        Ok(rec.bytes)
    }

    /// Why image `image`'s memory cannot become VM `cfg`'s (with `base`, the image's): it
    /// carries none, another VM saved it, or another QEMU. `None`: it can.
    pub(super) fn image_memory_refusal(
        &self,
        cfg: &VmConfig,
        base: &BaseRecord,
        image: &str,
    ) -> Result<Option<String>> {
        let Some(rec) = self.image_state(image).read()? else {
            return Ok(Some(format!(
                "image {image} carries no memory (it was taken without it): revert without memory"
            )));
        };
        // the block graph is not part of the tie: any chain stands in for it
        let args = self.own_tied_args(cfg, base, had_screen(&rec.args));
        Ok(self.why_stale(&rec, Some(&args))?.map(|why| {
            format!(
                "image {image}'s memory cannot return to VM {}: {why} (memory returns only to the VM it was taken from, under the same QEMU); revert without memory",
                cfg.name
            )
        }))
    }

    /// Why image `image`'s memory cannot start a new VM of `cpus` and `memory_mib`, from
    /// what its record says (the command line is compared when the VM is made:
    /// [`Self::memory_to_start`]). `None`: it can.
    pub(super) fn memory_fits(
        &self,
        image: &str,
        cpus: u32,
        memory_mib: u64,
    ) -> Result<Option<String>> {
        match self.image_state(image).read()? {
            None => Ok(Some(format!("image {image} carries no memory"))),
            Some(rec) => self.fit_refusal(&rec, image, cpus, memory_mib),
        }
    }

    /// Why `rec`, image `image`'s memory, cannot start a new VM of `cpus` and `memory_mib`:
    /// written before boxery kept what that needs, saved by another QEMU, another size.
    fn fit_refusal(
        &self,
        rec: &MemoryRecord,
        image: &str,
        cpus: u32,
        memory_mib: u64,
    ) -> Result<Option<String>> {
        if rec.portable.is_empty() || rec.cpus == 0 || rec.host_key.is_none() {
            return Ok(Some(format!(
                "image {image}'s memory was taken before boxery could start other VMs from it: take it again (`boxery snap VM NAME --memory`)"
            )));
        }
        if let Some(why) = self.why_stale(rec, None)? {
            return Ok(Some(format!(
                "image {image}'s memory cannot be loaded: {why}"
            )));
        }
        if (rec.cpus, rec.memory_mib) != (cpus, memory_mib) {
            return Ok(Some(format!(
                "image {image}'s memory was taken from a VM of {} CPUs and {} MiB, and this VM asks for {cpus} and {memory_mib} MiB: give it that size to start it from the memory",
                rec.cpus, rec.memory_mib
            )));
        }
        Ok(None)
    }

    /// Image `image`'s memory as the saved memory of the new VM `cfg` (its disk made from the
    /// image, `base` the image's base), tied to the VM's own command line: the checks of
    /// [`Self::memory_fits`], and the command line a start would run compared without what is
    /// each VM's own ([`portable`]). `Invalid`, saying why, when it cannot start the VM.
    pub(super) fn memory_to_start(
        &self,
        cfg: &VmConfig,
        base: &BaseRecord,
        image: &str,
    ) -> Result<MemoryRecord> {
        let refused = |why: String| BackendError::Invalid(why);
        let mut rec = self
            .image_state(image)
            .read()?
            .ok_or_else(|| refused(format!("image {image} carries no memory")))?;
        if let Some(why) = self.fit_refusal(&rec, image, cfg.cpus, cfg.memory_mib)? {
            return Err(refused(why));
        }
        let own = self.own_tied_args(cfg, base, had_screen(&rec.portable));
        let theirs = MemoryRecord {
            args: std::mem::take(&mut rec.portable),
            ..rec.clone()
        };
        if let Some(why) =
            self.why_stale(&theirs, Some(&portable(&own, cfg, &self.vm_dir(&cfg.name))))?
        {
            return Err(refused(format!(
                "image {image}'s memory cannot start VM {}: {why}",
                cfg.name
            )));
        }
        rec.portable = theirs.args;
        rec.args = own;
        Ok(rec)
    }

    /// The arguments VM `cfg`'s QEMU is tied to ([`tie`]; the block graph is not part of it,
    /// so any chain stands in for it), with a screen or without ([`had_screen`]).
    pub(super) fn own_tied_args(
        &self,
        cfg: &VmConfig,
        base: &BaseRecord,
        screen: bool,
    ) -> Vec<String> {
        let chain = [self.layout.vm_disk(&cfg.name, 1), self.base_disk(&base.id)];
        let mut spec = self.launch_spec(cfg, base, &chain);
        spec.screen = screen;
        tied_args(&spec)
    }

    /// What VM `name` must still take to be itself (it started from another VM's memory).
    pub(super) fn inherited(&self, name: &str) -> Result<Option<crate::Inherited>> {
        let path = self.layout.vm_inherited(name);
        crate::storage::files::read_json(&path).map_err(io(format!("reading {}", path.display())))
    }

    /// VM `name` holds its own identity (or boots cold, and its seed gives it): nothing is
    /// inherited any more.
    pub(super) fn forget_inherited(&self, name: &str) -> Result<()> {
        let path = self.layout.vm_inherited(name);
        remove_file_if_exists(&path).map_err(io(format!("removing {}", path.display())))
    }

    /// Make image `image`'s memory, `rec` (its record, or [`Self::memory_to_start`]'s for a
    /// new VM), the saved memory of VM `vm`: hard links (the image's files are only read by a
    /// resume), record last; the next boot resumes from it.
    pub(super) fn install_image_memory(
        &self,
        vm: &str,
        image: &str,
        rec: &MemoryRecord,
    ) -> Result<()> {
        self.discard_memory(vm)?;
        let (from, to) = (self.image_state(image), self.vm_state(vm));
        let pairs = if rec.shared_ram {
            vec![(&from.ram, &to.ram), (&from.dev, &to.dev)]
        } else {
            vec![(&from.state, &to.state)]
        };
        for (from, to) in pairs {
            if std::fs::hard_link(from, to).is_err() {
                std::fs::copy(from, to).map_err(io(format!(
                    "copying {} to {}",
                    from.display(),
                    to.display()
                )))?;
            }
        }
        to.write(rec)
    }

    /// Turn image `image`'s memory (a `mapped-ram` state of VM `cfg`) into its shared form: a
    /// QEMU that never runs the guest (`-S`) loads the state into a RAM file it writes through
    /// to, then saves the device state alone beside it (`x-ignore-shared`). VMs started from
    /// the image then map that file privately: each holds only the pages it writes, and a
    /// fork's children share the rest. The state stays whole in its first form until the
    /// shared one is committed (the record rewritten); a conversion that fails leaves it so
    /// (the image works, its VMs load their memory) and says why in the log.
    pub(super) async fn share_image_memory(self: &Arc<Self>, cfg: &VmConfig, image: &str) {
        let t = Instant::now();
        match self.share_inner(cfg, image).await {
            Ok(()) => info!(
                image,
                secs = t.elapsed().as_secs_f64(),
                "memory image in shared form"
            ),
            Err(e) => warn!(
                image,
                error = %e.chain(),
                "the memory image stays in its first form (its VMs load it whole)"
            ),
        }
        let _ = std::fs::remove_dir_all(self.layout.image_memory_scratch(image));
    }

    /// Conversions a killed control plane left (`image-memory/.NAME.convert/`: its QEMU,
    /// paused for good, and its files; a `/dev/shm` staging file whose control plane is gone):
    /// ended and removed. The image keeps its first form. Each waits for the image's lock, so
    /// a conversion under way is not touched.
    pub(super) async fn end_cut_conversions(&self) {
        let dir = self.layout.image_memories();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(image) = file
                .strip_prefix('.')
                .and_then(|f| f.strip_suffix(".convert"))
                .filter(|i| valid_name(i))
            else {
                continue;
            };
            let Ok(_lock) = self.lock_image(image).await else {
                continue;
            };
            let scratch = e.path();
            if let Some(pid) = process::running_pid(&scratch.join("qemu.pid"), &scratch) {
                let _ = process::terminate(pid, &scratch, Duration::from_secs(5)).await;
            }
            let _ = std::fs::remove_dir_all(&scratch);
            warn!(
                image,
                "ended a conversion of its memory that a stop cut short"
            );
        }
        let Ok(shm) = std::fs::read_dir("/dev/shm") else {
            return;
        };
        for e in shm.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            let owner = file
                .strip_prefix("boxery-")
                .and_then(|f| f.split('-').next())
                .and_then(|p| p.parse::<i32>().ok());
            if file.ends_with(".ram") && owner.is_some_and(|p| !process::is_alive(p)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    async fn share_inner(self: &Arc<Self>, cfg: &VmConfig, image: &str) -> Result<()> {
        let files = self.image_state(image);
        let Some(mut rec) = files.read()? else {
            return Ok(());
        };
        if rec.shared_ram {
            return Ok(());
        }
        let scratch = self.layout.image_memory_scratch(image);
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).map_err(io(format!("creating {}", scratch.display())))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o700))
                .map_err(io(format!("chmod {}", scratch.display())))?;
        }
        let base = self.load_base(&cfg.base)?;
        // the devices the state holds, its own sockets and files: nothing of the running VM's
        let disk = scratch.join("disk.qcow2");
        let base_disk = self.base_disk(&base.id);
        self.disks()
            .create_overlay(&disk, &base_disk, None)
            .await
            .map_err(|e| BackendError::failed("make a scratch disk", e))?;
        let mut spec = self.launch_spec(cfg, &base, &[disk, base_disk]);
        spec.screen = had_screen(&rec.args);
        spec.dir = scratch.clone();
        spec.qmp = scratch.join("qmp.sock");
        spec.qga = scratch.join("qga.sock");
        spec.serial = scratch.join("serial.log");
        spec.run_log = scratch.join("qemu-run.log");
        spec.pidfile = scratch.join("qemu.pid");
        spec.proxy = scratch.join("proxy.sock");
        // the VM's kind of network (its state is in the saved state), reaching nothing: a
        // stream netdev to a socket nobody serves, or QEMU's slirp on a port of its own
        if spec.net.is_some() {
            spec.net = Some(scratch.join("net.sock"));
        } else {
            spec.port = 0;
        }
        spec.incoming = true;
        spec.frozen = true;
        let (ram, dev) = (scratch.join("ram"), scratch.join("dev"));
        // loaded in memory (tmpfs: a page written into a file on disk costs a block
        // allocation each), then copied to the disk in runs
        let staged = Staged::new(&ram, cfg.memory_mib << 20);
        spec.ram = Some(process::RamFile::Shared(staged.path.clone()));
        let pid = process::launch(
            &self.config.qemu,
            &spec,
            &scratch.join("qemu.log"),
            self.config.start_timeout,
        )
        .await
        .map_err(|e| BackendError::failed("start QEMU to convert it", e))?;
        let step = |what: &str| format!("{what} the memory of image {image}");
        let converted: Result<()> = async {
            let timeout = migration_timeout(cfg.memory_mib);
            let mut q = Qmp::connect(&spec.qmp, Duration::from_secs(10))
                .await
                .map_err(|e| BackendError::failed(step("load"), e))?;
            q.migrate_set_capabilities(CAPS)
                .await
                .map_err(|e| BackendError::failed(step("load"), e))?;
            q.migrate_set_parameters(json!({"multifd-channels": 2}))
                .await
                .map_err(|e| BackendError::failed(step("load"), e))?;
            q.migrate_incoming(&file_uri(&files.state))
                .await
                .map_err(|e| BackendError::failed(step("load"), e))?;
            self.wait_incoming(&mut q, &cfg.name, pid, timeout).await?;
            q.migrate_set_capabilities(DEVICE_CAPS)
                .await
                .map_err(|e| BackendError::failed(step("save"), e))?;
            q.migrate(&file_uri(&dev))
                .await
                .map_err(|e| BackendError::failed(step("save"), e))?;
            self.wait_migration(&mut q, &cfg.name, timeout).await?;
            let _ = q.quit().await;
            Ok(())
        }
        .await;
        let _ = process::terminate(pid, &scratch, Duration::from_secs(5)).await;
        converted.map_err(|e| {
            BackendError::failed(
                step("convert"),
                format!(
                    "{}; QEMU said: {}",
                    e.chain(),
                    process::tail(&spec.run_log, 6)
                ),
            )
        })?;
        if staged.path != ram {
            crate::storage::files::copy_sparse(&staged.path, &ram).map_err(io(format!(
                "copying {} to {}",
                staged.path.display(),
                ram.display()
            )))?;
        }
        drop(staged);
        for f in [&ram, &dev] {
            std::fs::File::open(f)
                .and_then(|f| f.sync_all())
                .map_err(io(format!("syncing {}", f.display())))?;
        }
        for (from, to) in [(&ram, &files.ram), (&dev, &files.dev)] {
            std::fs::rename(from, to).map_err(io(format!(
                "moving {} to {}",
                from.display(),
                to.display()
            )))?;
        }
        rec.shared_ram = true;
        rec.bytes = allocated_bytes(&files.ram) + allocated_bytes(&files.dev);
        // the commit: from here on the shared form is the image's memory
        files.write(&rec)?;
        crate::storage::files::sync_dir(&files.record).map_err(io("fsync"))?;
        remove_file_if_exists(&files.state)
            .map_err(io(format!("removing {}", files.state.display())))
    }

    /// Wait until QEMU's migration ends: `Ok` when it completed.
    async fn wait_migration(&self, q: &mut Qmp, name: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let m = q.query_migrate().await.map_err(|e| {
                BackendError::failed(format!("query the memory save of VM {name}"), e)
            })?;
            match m.status.as_deref() {
                Some("completed") => return Ok(()),
                _ if m.in_progress() => {}
                other => {
                    return Err(BackendError::failed(
                        format!("move the memory of VM {name}"),
                        format!(
                            "QEMU's migration ended {}: {}",
                            other.unwrap_or("without a status"),
                            m.error_desc.as_deref().unwrap_or("no reason given")
                        ),
                    ));
                }
            }
            if Instant::now() >= deadline {
                let _ = q.execute("migrate_cancel", None).await;
                return Err(BackendError::failed(
                    format!("move the memory of VM {name}"),
                    format!("it did not finish within {timeout:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The state is committed: end the paused QEMU `pid` and what runs beside it.
    async fn end_suspended(&self, name: &str, pid: i32) -> Result<()> {
        if let Ok(Ok(mut q)) = tokio::time::timeout(Duration::from_secs(5), self.qmp(name)).await {
            let _ = q.quit().await;
        }
        if !process::wait_gone(pid, Duration::from_secs(10)).await {
            process::terminate(pid, &self.vm_dir(name), Duration::from_secs(5))
                .await
                .map_err(|e| BackendError::failed(format!("end the QEMU of VM {name}"), e))?;
        }
        self.stop_net(name).await;
        self.clear_runtime_files(name);
        Ok(())
    }

    /// Finish or roll back an interrupted suspend or resume of VM `name` (lock held);
    /// nothing to do when none was.
    pub(super) async fn memory_repair(&self, name: &str) -> Result<()> {
        let Some(pid) = self.pid(name) else {
            // no QEMU: a part file is a suspend that died with its QEMU (the VM is stopped)
            let part = self.layout.vm_memory_part(name);
            return remove_file_if_exists(&part)
                .map_err(io(format!("removing {}", part.display())));
        };
        if self.memory_in_flight(name).is_none() {
            return Ok(());
        }
        let mut q = self.qmp(name).await?;
        let status = q
            .query_status()
            .await
            .map_err(|e| BackendError::failed(format!("query the state of VM {name}"), e))?;
        if self.load_memory(name)?.is_some() {
            drop(q);
            if status.running {
                // a resume got as far as `cont`: the guest has moved on from the state
                warn!(
                    vm = name,
                    "a resumed VM's saved memory was left behind; removing it"
                );
                return self.discard_memory(name);
            }
            // a suspend that committed, or a resume that had not let the guest run yet: the
            // state is whole, the paused QEMU goes
            warn!(
                vm = name,
                "an interrupted suspend or resume left a paused QEMU beside the saved memory; ending it"
            );
            return self.end_suspended(name, pid).await;
        }
        // a suspend was under way when its control plane died; QEMU carried on alone
        let cfg = self
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        let mut m = q
            .query_migrate()
            .await
            .map_err(|e| BackendError::failed(format!("query the memory save of VM {name}"), e))?;
        if m.in_progress() {
            let ended = self
                .wait_migration(&mut q, name, migration_timeout(cfg.memory_mib))
                .await;
            m.status = Some(if ended.is_ok() { "completed" } else { "failed" }.into());
        }
        if m.status.as_deref() == Some("completed") && !status.running {
            drop(q);
            self.vm_state(name).commit(self.record_of(&cfg, pid)?)?;
            warn!(
                vm = name,
                "finished a suspend its control plane left half way"
            );
            return self.end_suspended(name, pid).await;
        }
        if !status.running {
            q.cont()
                .await
                .map_err(|e| BackendError::failed(format!("resume VM {name}"), e))?;
        }
        warn!(
            vm = name,
            "rolled back a suspend its control plane left half way"
        );
        let part = self.layout.vm_memory_part(name);
        remove_file_if_exists(&part).map_err(io(format!("removing {}", part.display())))
    }

    /// Whether the saved state `rec` of VM `cfg` can be loaded by a QEMU launched as `spec`:
    /// a stale one is recorded as such (kept, reported by `get`) and refused; so is a load
    /// the host has not the memory for (retried: the state is kept).
    pub(super) fn check_restorable(
        &self,
        cfg: &VmConfig,
        rec: &MemoryRecord,
        spec: &LaunchSpec,
    ) -> Result<()> {
        let name = &cfg.name;
        if let Some(why) = self.why_stale(rec, Some(&tied_args(spec)))? {
            if rec.stale.is_none() {
                let mut rec = rec.clone();
                rec.stale = Some(why.clone());
                self.vm_state(name).write(&rec)?;
            }
            return Err(BackendError::stale_memory(name, &why));
        }
        if let Some(avail) = available_memory()
            && avail < rec.bytes
            && !rec.shared_ram
        {
            return Err(BackendError::failed(
                format!("resume VM {name}"),
                format!(
                    "the host has {} MiB of memory available and the VM's saved memory holds {} MiB: free memory and it is resumed (the saved memory is kept)",
                    avail >> 20,
                    rec.bytes >> 20
                ),
            ));
        }
        Ok(())
    }

    /// Load VM `cfg`'s saved state into its new QEMU `pid` (launched with `-incoming defer`)
    /// and let the guest run; the state is removed then (it describes the past). On failure
    /// the half-made QEMU goes and the state stays. `guest_agent`: set its clock after.
    pub(super) async fn load_saved(
        self: &Arc<Self>,
        cfg: &VmConfig,
        rec: &MemoryRecord,
        pid: i32,
        guest_agent: bool,
    ) -> Result<()> {
        let name = &cfg.name;
        let step = || format!("load the saved memory of VM {name}");
        let loaded: Result<()> = async {
            let mut q = self.qmp(name).await?;
            let files = self.vm_state(name);
            let from = if rec.shared_ram {
                // the RAM is mapped from its file already: the device state alone
                q.migrate_set_capabilities(DEVICE_CAPS)
                    .await
                    .map_err(|e| BackendError::failed(step(), e))?;
                files.dev
            } else {
                q.migrate_set_capabilities(CAPS)
                    .await
                    .map_err(|e| BackendError::failed(step(), e))?;
                q.migrate_set_parameters(json!({"multifd-channels": 2}))
                    .await
                    .map_err(|e| BackendError::failed(step(), e))?;
                files.state
            };
            q.migrate_incoming(&file_uri(&from))
                .await
                .map_err(|e| BackendError::failed(step(), e))?;
            self.wait_incoming(&mut q, name, pid, migration_timeout(cfg.memory_mib))
                .await?;
            q.cont()
                .await
                .map_err(|e| BackendError::failed(format!("resume VM {name}"), e))
        }
        .await;
        if let Err(e) = loaded {
            if self.pid(name).is_some() {
                let _ = process::terminate(pid, &self.vm_dir(name), Duration::from_secs(5)).await;
            }
            self.stop_net(name).await;
            self.clear_runtime_files(name);
            return Err(e);
        }
        self.discard_memory(name)?;
        if guest_agent {
            // in the background: the guest runs already, its agent answers within a second
            let (inner, vm) = (Arc::clone(self), name.clone());
            tokio::spawn(async move { inner.sync_clock(&vm).await });
        }
        Ok(())
    }

    /// Wait until an incoming migration has loaded: QEMU leaves `inmigrate` (paused,
    /// `postmigrate`/`paused`), or exits when the load fails.
    async fn wait_incoming(
        &self,
        q: &mut Qmp,
        name: &str,
        pid: i32,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let step = || format!("load the saved memory of VM {name}");
        loop {
            let m = match q.query_migrate().await {
                Ok(m) => m,
                Err(e) => {
                    // QEMU exits when the load fails; its log says why
                    if process::wait_gone(pid, Duration::from_secs(3)).await {
                        let log = process::tail(&self.layout.vm_run_log(name), 4);
                        return Err(BackendError::failed(
                            step(),
                            format!(
                                "QEMU exited while loading it (the state file may be damaged): {log}"
                            ),
                        ));
                    }
                    return Err(BackendError::failed(step(), e));
                }
            };
            match m.status.as_deref() {
                Some("completed") => return Ok(()),
                Some("failed" | "cancelled") => {
                    return Err(BackendError::failed(
                        step(),
                        m.error_desc.unwrap_or_else(|| "QEMU gave no reason".into()),
                    ));
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(BackendError::failed(
                    step(),
                    format!("it did not finish within {timeout:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Set the guest's clock to the host's after a resume (it stood still while suspended),
    /// through its agent; a guest without one resyncs on its own (NTP) or stays behind.
    async fn sync_clock(&self, name: &str) {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        match Qga::connect(&self.layout.vm_qga(name), Duration::from_secs(5)).await {
            Ok(mut g) => {
                if let Err(e) = g.set_time(nanos).await {
                    warn!(vm = name, error = %e, "could not set the resumed guest's clock");
                }
            }
            Err(e) => {
                warn!(vm = name, error = %e, "the resumed guest's agent did not answer; its clock may be behind")
            }
        }
    }
}

/// The part of a QEMU command line a saved state is tied to: all of it but the disk's block
/// graph (`-blockdev`, and which node a disk device is attached to) and the VNC server
/// (`-vnc`). Devices are matched by their ids across a migration, and the chain under the disk
/// changes while the VM runs (a stream pulls a layer into the overlay) without changing what
/// the guest sees; a VNC server is the host's, not the machine's.
fn tie(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        // (a state saved before VMs had a VNC server restores under one, and back)
        if a == "-blockdev" || a == "-vnc" {
            it.next();
            continue;
        }
        let kept: Vec<&str> = a.split(',').filter(|p| !p.starts_with("drive=")).collect();
        out.push(kept.join(","));
    }
    out
}

/// What changed from command line `then` to `now`, in words: each option with its value
/// (`-device VGA`) added or dropped, or the one that changed (`` `-m 256` is now `-m 512` ``).
fn args_change(then: &[String], now: &[String]) -> String {
    /// The arguments as options, each with its value when it has one.
    fn options(args: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        let mut it = args.iter().peekable();
        while let Some(a) = it.next() {
            match it.peek() {
                Some(v) if a.starts_with('-') && !v.starts_with('-') => {
                    out.push(format!("{a} {v}"));
                    it.next();
                }
                _ => out.push(a.clone()),
            }
        }
        out
    }
    /// The options of `a` that `b` lacks (as many times as `a` has them more).
    fn missing(a: &[String], b: &[String]) -> Vec<String> {
        let mut b = b.to_vec();
        a.iter()
            .filter(|o| match b.iter().position(|x| x == *o) {
                Some(i) => {
                    b.swap_remove(i);
                    false
                }
                None => true,
            })
            .cloned()
            .collect()
    }
    fn listed(options: &[String]) -> String {
        let mut words: Vec<String> = options.iter().take(3).map(|o| format!("`{o}`")).collect();
        if options.len() > 3 {
            words.push(format!("{} more", options.len() - 3));
        }
        words.join(", ")
    }
    let (then, now) = (options(then), options(now));
    let (added, dropped) = (missing(&now, &then), missing(&then, &now));
    match (added.as_slice(), dropped.as_slice()) {
        ([], []) => "the same arguments in another order".into(),
        ([new], [old]) => format!("`{old}` is now `{new}`"),
        (added, []) => format!("added since: {}", listed(added)),
        ([], dropped) => format!("dropped since: {}", listed(dropped)),
        (added, dropped) => format!(
            "added since: {}; dropped: {}",
            listed(added),
            listed(dropped)
        ),
    }
}

/// `bin` as found on `PATH` when it has no `/`.
fn which(bin: &Path) -> PathBuf {
    if bin.components().count() > 1 {
        return bin.to_path_buf();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
        .unwrap_or_else(|| bin.to_path_buf())
}

/// Bytes free for an unprivileged writer on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The host's `MemAvailable`, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state saved before VMs had screens (its command line without the screen's devices)
    /// is restored by a QEMU without them: what a restore is checked against is the command
    /// line of a spec without the screen (the boot's `spec.screen = had_screen(&rec.args)` is
    /// not under test here: it needs a state saved by a QEMU from before screens).
    #[test]
    fn a_spec_follows_a_saved_states_screen() {
        let now = words("-m 512 -device virtio-rng-pci -device VGA -device virtio-tablet-pci");
        let before = words("-m 512 -device virtio-rng-pci");
        assert!(had_screen(&now));
        assert!(!had_screen(&before));
        assert!(!had_screen(&words("-device VGA")), "both devices, in order");
        let mut spec = crate::qemu::process::tests::spec();
        let with: Vec<String> = tied_args(&spec);
        spec.screen = had_screen(&before);
        let without = tied_args(&spec);
        assert!(had_screen(&with) && !had_screen(&without));
        assert_eq!(with.len(), without.len() + process::SCREEN_DEVICES.len());
    }

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    /// The VNC server is not part of the machine: a state saved by a QEMU without one (before
    /// boxery gave VMs one) is restored by a QEMU with it, and the other way round.
    #[test]
    fn a_saved_state_is_not_tied_to_the_vnc_server() {
        let spec = crate::qemu::process::tests::spec();
        let full: Vec<String> = process::command_line(&spec)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(full.iter().any(|a| a == "-vnc"), "{full:?}");
        let tied = tied_args(&spec);
        assert!(
            tied.iter().all(|a| a != "-vnc" && !a.starts_with("unix:")),
            "{tied:?}"
        );
        // the same command line without the VNC server ties to the same
        let mut without = full.clone();
        let at = without.iter().position(|a| a == "-vnc").unwrap();
        without.drain(at..at + 2);
        assert_eq!(tie(without), tied);
    }

    #[test]
    fn a_changed_command_line_is_told_by_its_options() {
        // a state saved before VMs had a screen, restored by a QEMU that gives them one
        let then = words("-name guest=a -nodefaults -display none -device virtio-rng-pci");
        let now = words(
            "-name guest=a -nodefaults -display none -device virtio-rng-pci -device VGA -device virtio-tablet-pci",
        );
        assert_eq!(
            args_change(&then, &now),
            "added since: `-device VGA`, `-device virtio-tablet-pci`"
        );
        assert_eq!(
            args_change(&now, &then),
            "dropped since: `-device VGA`, `-device virtio-tablet-pci`"
        );
        assert_eq!(
            args_change(&words("-m 256 -smp 1"), &words("-m 512 -smp 1")),
            "`-m 256` is now `-m 512`"
        );
        assert_eq!(
            args_change(&words("-m 256 -smp 1"), &words("-smp 1 -m 256")),
            "the same arguments in another order"
        );
        assert_eq!(
            args_change(&words("-a 1 -b 2"), &words("-c 3 -d 4 -e 5 -f 6")),
            "added since: `-c 3`, `-d 4`, `-e 5`, 1 more; dropped: `-a 1`, `-b 2`"
        );
        // flags without values stay alone
        assert_eq!(
            args_change(&words("-S -m 1"), &words("-m 1")),
            "dropped since: `-S`"
        );
    }
}
