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
//! - The state is tied to what can restore it: the QEMU version and the exact command line
//!   (machine, devices, disk chain). A state that no longer matches is kept and reported
//!   ([`crate::SavedMemory::stale`]); only `stop` discards it.
//! - A resume on a host with less available memory than the state holds, or a suspend on a
//!   disk without room for it, fails before anything changes.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::*;

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
}

/// How long a migration to or from a file may take per GiB of guest memory (TCG on two busy
/// cores writes well over 100 MiB/s), on top of a fixed minute.
const MIGRATION_PER_GIB: Duration = Duration::from_secs(60);

fn migration_timeout(memory_mib: u64) -> Duration {
    Duration::from_secs(60) + MIGRATION_PER_GIB * (memory_mib.div_ceil(1024) as u32)
}

/// The capabilities both sides of a file migration set (they must match).
const CAPS: &[(&str, bool)] = &[("mapped-ram", true), ("multifd", true)];

fn file_uri(path: &Path) -> String {
    format!("file:{}", path.display())
}

impl Inner {
    pub(super) fn load_memory(&self, name: &str) -> Result<Option<MemoryRecord>> {
        crate::storage::files::read_json(&self.layout.vm_memory_record(name))
            .map_err(io(format!("reading the saved memory record of VM {name}")))
    }

    fn save_memory(&self, name: &str, rec: &MemoryRecord) -> Result<()> {
        crate::storage::files::write_json(&self.layout.vm_memory_record(name), rec, 0o600)
            .map_err(io(format!("writing the saved memory record of VM {name}")))
    }

    /// Remove the saved state (record first: without it the rest is partial).
    pub(super) fn discard_memory(&self, name: &str) -> Result<()> {
        for p in [
            self.layout.vm_memory_record(name),
            self.layout.vm_memory(name),
            self.layout.vm_memory_part(name),
        ] {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        Ok(())
    }

    /// The saved memory as `get` reports it (`None` unless a complete state exists).
    pub(super) fn saved_memory(&self, name: &str) -> Result<Option<crate::SavedMemory>> {
        let Some(rec) = self.load_memory(name)? else {
            return Ok(None);
        };
        let stale = rec.stale.clone().or_else(|| {
            let now = self.qemu_version().ok()?;
            (now != rec.qemu_version).then(|| version_changed(&rec.qemu_version, &now))
        });
        Ok(Some(crate::SavedMemory {
            bytes: rec.bytes,
            saved_at: rec.saved_at,
            stale,
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
        let part = self.layout.vm_memory_part(name);
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
        let args = process::launched_args(pid).map(tie).ok_or_else(|| {
            BackendError::failed(
                format!("suspend VM {name}"),
                "its QEMU exited as the suspend began",
            )
        })?;
        let qemu_version = self.qemu_version()?;
        remove_file_if_exists(&part).map_err(io(format!("removing {}", part.display())))?;
        let step = || format!("save the memory of VM {name}");
        let mut q = self.qmp(name).await?;
        let was_running = q
            .query_status()
            .await
            .map_err(|e| BackendError::failed(step(), e))?
            .running;
        // paused first: one pass over memory, no pages dirtied behind it
        let saved: Result<()> = async {
            q.stop().await?;
            q.migrate_set_capabilities(CAPS).await?;
            q.migrate_set_parameters(json!({"multifd-channels": 2, "max-bandwidth": 64u64 << 30}))
                .await?;
            q.migrate(&file_uri(&part)).await?;
            Ok(())
        }
        .await
        .map_err(|e: qmp::QmpError| BackendError::failed(step(), e));
        let outcome = match saved {
            Ok(()) => {
                self.wait_migration(&mut q, name, migration_timeout(cfg.memory_mib))
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            // the guest goes on as it was; nothing of the attempt stays
            if was_running {
                let _ = q.cont().await;
            }
            drop(q);
            let _ = remove_file_if_exists(&part);
            return Err(e);
        }
        drop(q);
        self.commit_memory(name, args, qemu_version, cfg.memory_mib)?;
        self.end_suspended(name, pid).await?;
        info!(
            vm = name,
            secs = t.elapsed().as_secs_f64(),
            "suspended: memory saved, QEMU ended"
        );
        Ok(())
    }

    /// Save the paused guest of VM `cfg` (its QEMU `pid`, QMP `q`) as image `image`'s memory:
    /// `image-memory/.NAME.state.part`, synced, renamed, then `image-memory/NAME.json`
    /// (written before the image's own record, the image's commit point). The caller pauses
    /// the guest before and lets it run after; nothing of a failed attempt stays.
    pub(super) async fn save_image_memory(
        &self,
        q: &mut Qmp,
        cfg: &VmConfig,
        pid: i32,
        image: &str,
    ) -> Result<u64> {
        let vm = &cfg.name;
        let part = self.layout.image_memory_part(image);
        let state = self.layout.image_memory(image);
        let step = || format!("save the memory of VM {vm} into image {image}");
        let args = process::launched_args(pid)
            .map(tie)
            .ok_or_else(|| BackendError::failed(step(), "its QEMU exited"))?;
        let qemu_version = self.qemu_version()?;
        remove_file_if_exists(&part).map_err(io(format!("removing {}", part.display())))?;
        let started: Result<(), qmp::QmpError> = async {
            q.migrate_set_capabilities(CAPS).await?;
            q.migrate_set_parameters(json!({"multifd-channels": 2, "max-bandwidth": 64u64 << 30}))
                .await?;
            q.migrate(&file_uri(&part)).await
        }
        .await;
        let saved = match started {
            Ok(()) => {
                self.wait_migration(q, vm, migration_timeout(cfg.memory_mib))
                    .await
            }
            Err(e) => Err(BackendError::failed(step(), e)),
        };
        let committed = saved.and_then(|()| {
            std::fs::File::open(&part)
                .and_then(|f| f.sync_all())
                .map_err(io(format!("syncing {}", part.display())))?;
            std::fs::rename(&part, &state).map_err(io(format!(
                "moving {} to {}",
                part.display(),
                state.display()
            )))?;
            let bytes = allocated_bytes(&state);
            crate::storage::files::write_json(
                &self.layout.image_memory_record(image),
                &MemoryRecord {
                    saved_at: boxery_api::now(),
                    bytes,
                    qemu_version,
                    args,
                    memory_mib: cfg.memory_mib,
                    stale: None,
                    host_key: cfg.host_key.clone(),
                },
                0o600,
            )
            .map_err(io(format!("writing the memory record of image {image}")))?;
            Ok(bytes)
        });
        if committed.is_err() {
            let _ = self.remove_image_memory(image);
        }
        committed
    }

    /// Remove the memory an image carries (record first), and a partial one.
    pub(super) fn remove_image_memory(&self, image: &str) -> Result<()> {
        for p in [
            self.layout.image_memory_record(image),
            self.layout.image_memory(image),
            self.layout.image_memory_part(image),
        ] {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        Ok(())
    }

    /// The memory record of image `image`, if it carries memory.
    pub(super) fn image_memory(&self, image: &str) -> Result<Option<MemoryRecord>> {
        crate::storage::files::read_json(&self.layout.image_memory_record(image))
            .map_err(io(format!("reading the memory record of image {image}")))
    }

    /// Why image `image`'s memory cannot become VM `cfg`'s (with `base`, the image's): it
    /// carries none, another VM saved it, or another QEMU. `None`: it can.
    pub(super) fn image_memory_refusal(
        &self,
        cfg: &VmConfig,
        base: &BaseRecord,
        image: &str,
    ) -> Result<Option<String>> {
        let Some(rec) = self.image_memory(image)? else {
            return Ok(Some(format!(
                "image {image} carries no memory (it was taken without it): revert without memory"
            )));
        };
        let version = self.qemu_version()?;
        if version != rec.qemu_version {
            return Ok(Some(format!(
                "image {image}'s memory {}: revert without memory",
                version_changed(&rec.qemu_version, &version)
            )));
        }
        // the block graph is not part of the tie: any chain stands in for it
        let chain = [self.layout.vm_disk(&cfg.name, 1), self.base_disk(&base.id)];
        let spec = self.launch_spec(cfg, base, &chain);
        let args = tie(process::command_line(&spec)
            .iter()
            .map(|a| a.to_string_lossy().into_owned()));
        if args != rec.args {
            return Ok(Some(format!(
                "image {image}'s memory was saved from another VM (or under another QEMU command line): its memory can only return to the VM it was taken from; revert without memory"
            )));
        }
        Ok(None)
    }

    /// Make image `image`'s memory the saved memory of VM `vm` (a hard link: the image's
    /// file is only read by a resume), record last; the next boot resumes from it.
    pub(super) fn install_image_memory(&self, vm: &str, image: &str) -> Result<()> {
        let rec = self
            .image_memory(image)?
            .ok_or_else(|| not_found(format!("the memory of image {image}")))?;
        self.discard_memory(vm)?;
        let from = self.layout.image_memory(image);
        let to = self.layout.vm_memory(vm);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(io(format!(
                "copying {} to {}",
                from.display(),
                to.display()
            )))?;
        }
        self.save_memory(vm, &rec)
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

    /// The part file is complete: sync it, move it in place, write the record (the commit).
    fn commit_memory(
        &self,
        name: &str,
        args: Vec<String>,
        qemu_version: String,
        memory_mib: u64,
    ) -> Result<()> {
        let part = self.layout.vm_memory_part(name);
        let state = self.layout.vm_memory(name);
        std::fs::File::open(&part)
            .and_then(|f| f.sync_all())
            .map_err(io(format!("syncing {}", part.display())))?;
        std::fs::rename(&part, &state).map_err(io(format!(
            "moving {} to {}",
            part.display(),
            state.display()
        )))?;
        self.save_memory(
            name,
            &MemoryRecord {
                saved_at: boxery_api::now(),
                bytes: allocated_bytes(&state),
                qemu_version,
                args,
                memory_mib,
                stale: None,
                host_key: None,
            },
        )?;
        crate::storage::files::sync_dir(&state).map_err(io("fsync"))
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
            let args = process::launched_args(pid).map(tie).unwrap_or_default();
            self.commit_memory(name, args, self.qemu_version()?, cfg.memory_mib)?;
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

    /// Resume the suspended VM `cfg` from its saved memory (lock held).
    pub(super) async fn resume(self: &Arc<Self>, cfg: &VmConfig, rec: MemoryRecord) -> Result<()> {
        let name = &cfg.name;
        let stale = |why: String| -> Result<()> {
            let mut rec = rec.clone();
            rec.stale = Some(why.clone());
            self.save_memory(name, &rec)?;
            Err(BackendError::stale_memory(name, &why))
        };
        if let Some(why) = &rec.stale {
            return Err(BackendError::stale_memory(name, why));
        }
        let version = self.qemu_version()?;
        if version != rec.qemu_version {
            return stale(version_changed(&rec.qemu_version, &version));
        }
        if let Some(avail) = available_memory()
            && avail < rec.bytes
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
        let base = self.load_base(&cfg.base)?;
        let chain = self.offline_chain(cfg).await?;
        let mut spec = self.launch_spec(cfg, &base, &chain);
        let args = tie(process::command_line(&spec)
            .iter()
            .map(|a| a.to_string_lossy().into_owned()));
        if args != rec.args {
            let first = args
                .iter()
                .zip(&rec.args)
                .find(|(a, b)| a != b)
                .map(|(a, b)| format!("`{b}` is now `{a}`"))
                .unwrap_or_else(|| "arguments were added or removed".into());
            return stale(format!(
                "it was saved under another QEMU command line ({first}): boxery or the VM's configuration changed since"
            ));
        }
        self.claim_port(name, cfg.port)?;
        self.wait_port(name, cfg.port).await?;
        spec.incoming = true;
        let t = Instant::now();
        if let Some(bin) = &self.config.net {
            let _ = remove_file_if_exists(&spec.pidfile);
            super::net::start(bin, &self.net_spec(name, cfg.port), Duration::from_secs(10))
                .await
                .map_err(|e| BackendError::failed(format!("start the network of VM {name}"), e))?;
        }
        let launched = process::launch(
            &self.config.qemu,
            &spec,
            &self.layout.vm_log(name),
            self.config.start_timeout,
        )
        .await;
        let pid = match launched {
            Ok(pid) => pid,
            Err(e) => {
                self.stop_net(name).await;
                return Err(BackendError::failed(format!("start VM {name}"), e));
            }
        };
        let step = || format!("load the saved memory of VM {name}");
        let loaded: Result<()> = async {
            let mut q = self.qmp(name).await?;
            q.migrate_set_capabilities(CAPS)
                .await
                .map_err(|e| BackendError::failed(step(), e))?;
            q.migrate_set_parameters(json!({"multifd-channels": 2}))
                .await
                .map_err(|e| BackendError::failed(step(), e))?;
            q.migrate_incoming(&file_uri(&self.layout.vm_memory(name)))
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
            // the state stays as it was; the half-made QEMU goes
            if self.pid(name).is_some() {
                let _ = process::terminate(pid, &self.vm_dir(name), Duration::from_secs(5)).await;
            }
            self.stop_net(name).await;
            self.clear_runtime_files(name);
            return Err(e);
        }
        // from here the guest runs: the state describes the past
        self.discard_memory(name)?;
        info!(
            vm = name.as_str(),
            pid,
            secs = t.elapsed().as_secs_f64(),
            "resumed from saved memory"
        );
        if base.guest_agent {
            // in the background: the guest runs already, its agent answers within a second
            let (inner, vm) = (Arc::clone(self), name.clone());
            tokio::spawn(async move { inner.sync_clock(&vm).await });
        }
        if chain.len() > 2 {
            let mut q = self.qmp(name).await?;
            q.block_stream(STREAM_JOB, &spec.disk_node, BASE_NODE)
                .await
                .map_err(|e| BackendError::failed(format!("stream the disk of VM {name}"), e))?;
            drop(q);
            self.settle_later(name.clone());
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

    /// Wait (bounded) until the VM's ssh port is free: a QEMU that has just exited may still
    /// be releasing it.
    pub(super) async fn wait_port(&self, name: &str, port: u16) -> Result<()> {
        let mut tries = 0;
        while !process::port_free(port) && tries < 20 {
            tries += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if process::port_free(port) {
            return Ok(());
        }
        Err(BackendError::failed(
            format!("start VM {name}"),
            format!(
                "its ssh port 127.0.0.1:{port} is taken by another process (not a boxery VM): free it (`ss -ltnp sport = :{port}`) and retry"
            ),
        ))
    }
}

/// The part of a QEMU command line a saved state is tied to: all of it but the disk's block
/// graph (`-blockdev`, and which node a disk device is attached to). Devices are matched by
/// their ids across a migration, and the chain under the disk changes while the VM runs (a
/// stream pulls a layer into the overlay) without changing what the guest sees.
fn tie(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "-blockdev" {
            it.next();
            continue;
        }
        let kept: Vec<&str> = a.split(',').filter(|p| !p.starts_with("drive=")).collect();
        out.push(kept.join(","));
    }
    out
}

fn version_changed(then: &str, now: &str) -> String {
    format!("it was saved by {then} and this host runs {now}")
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
