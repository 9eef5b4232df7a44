//! The `qemu` backend: one daemonized QEMU per VM, qcow2 disks, QMP, no daemon of our own.
//!
//! # Design
//! - **Processes.** Each VM is its own `qemu-system-x86_64 -daemonize` that outlives the control
//!   plane. Its pidfile and QMP socket live in the VM's directory, so a restarted control plane
//!   finds it again; a dead process is a stopped VM. KVM when it really works, TCG otherwise
//!   ([`process::detect_accel`]).
//! - **Disks.** Every VM disk and every image is one qcow2 overlay on a shared, read-only base
//!   (`base/<id>/disk.qcow2`), never on another VM or image. A VM's active overlay is its
//!   highest `disk-<gen>.qcow2`.
//! - **Capture of a running VM** (hand-off): guest filesystems frozen when the guest runs
//!   qemu-guest-agent, QMP `blockdev-snapshot-sync` puts a new overlay `disk-<generation+1>` on top,
//!   the old overlay (now frozen, one deep on the base) is hard-linked as the image, and a
//!   `block-stream` with `base-node` = the base pulls its data into the new overlay in the
//!   background so the VM is one deep again. The VM keeps its own name for the frozen layer
//!   until the stream is done, so the image can be deleted at any time.
//! - **Capture of a stopped VM**: a copy of its overlay (`cp --reflink=auto`).
//! - **New VM from an image, reimage**: a copy of the image's overlay (same base, same header).
//! - **Network**: QEMU user networking, sshd forwarded from one loopback port kept for the VM's
//!   life.
//!
//! # Guarantees
//! - A VM exists once `vms/<name>/config.json` exists; an image once `images/<name>.json`
//!   does. Everything before is partial and removed by `cleanup_new`/`cleanup_image`.
//! - Only processes whose command line names the VM's own directory are signalled; only files
//!   under the state directory are touched.
//! - Every mutating operation on a VM holds its lock (`locks/vm-<name>.lock`, flock), so
//!   operations from two objects (an Image capturing a Vm being stopped) or two processes
//!   never interleave.
//! - Block jobs always name their base node.
//!
//! # Caveats
//! - A guest without qemu-guest-agent is captured crash-consistent (no freeze).
//! - A second capture waits until the first one's stream has finished.

pub mod config;
pub mod disk;
pub mod layout;
pub mod process;
pub mod qmp;
pub mod records;
pub mod seed;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tracing::{debug, info, warn};

use crate::{
    Backend, BackendError, Capabilities, Identity, ImageInfo, NewVm, PowerState, Progress, Result,
    Stability, VmInfo, VmSize,
};
use config::QemuConfig;
use disk::{Disks, GIB, allocated_bytes};
use layout::{
    FileLock, Layout, remove_dir_if_exists, remove_file_if_exists, valid_name, write_json,
};
use process::{BASE_NODE, DISK_DEVICE, LaunchSpec};
use qmp::{Qga, Qmp};
use records::{BaseRecord, ImageRecord, Manifest, VmConfig};

const BACKEND: &str = "qemu";
const QMP_TIMEOUT: Duration = Duration::from_secs(30);
const STREAM_JOB: &str = "bx-stream";
/// How long a capture waits for the previous capture's stream.
const STREAM_WAIT: Duration = Duration::from_secs(600);

/// The error and all its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn failed(step: impl Into<String>, e: impl std::error::Error) -> BackendError {
    BackendError::failed(step, error_chain(&e))
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackendError {
    let context = context.into();
    move |source| BackendError::io(context, source)
}

fn not_found(what: impl Into<String>) -> BackendError {
    BackendError::NotFound {
        backend: BACKEND.into(),
        what: what.into(),
    }
}

fn unreachable(message: impl Into<String>) -> BackendError {
    BackendError::Unreachable {
        backend: BACKEND.into(),
        message: message.into(),
    }
}

fn random_mac() -> String {
    let b: [u8; 3] = rand::random();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2])
}

/// A new instance-id (`iid-<uuid>`, docs/images.md): new per identity, kept for the VM's life.
fn new_instance_id() -> String {
    format!("iid-{}", uuid::Uuid::new_v4())
}

/// The generation of a `disk-<gen>.qcow2` file name (a VM's own overlay).
fn disk_generation(file: &str) -> Option<u64> {
    file.strip_prefix("disk-")?
        .strip_suffix(".qcow2")?
        .parse()
        .ok()
}

/// The generation of a `layer-<gen>.qcow2` file name: an image's overlay hard-linked into the
/// VM (shared with the image, so never written) until a stream has pulled it up.
fn layer_generation(file: &str) -> Option<u64> {
    file.strip_prefix("layer-")?
        .strip_suffix(".qcow2")?
        .parse()
        .ok()
}

/// The QEMU node name of a disk file: `disk-N` → `ovN`, `layer-N` → `lyN`.
fn node_name(path: &Path, fallback: usize) -> String {
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

/// The state shared by the backend and its background tasks.
#[derive(Debug)]
struct Inner {
    layout: Layout,
    config: QemuConfig,
    disks: Disks,
    /// Set once the host tools were found (checked again until they are).
    tools_ok: std::sync::OnceLock<()>,
}

/// The qemu backend.
#[derive(Debug, Clone)]
pub struct QemuBackend {
    inner: Arc<Inner>,
}

impl QemuBackend {
    /// A backend with its state in `dir` (`$BOXERY_HOME/qemu`), settings from the environment.
    pub fn new(dir: PathBuf) -> Self {
        Self::with_config(dir, QemuConfig::from_env())
    }

    /// A backend with explicit settings.
    pub fn with_config(dir: PathBuf, config: QemuConfig) -> Self {
        let disks = Disks::new(config.qemu_img.clone());
        QemuBackend {
            inner: Arc::new(Inner {
                layout: Layout::new(dir),
                config,
                disks,
                tools_ok: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Its state directory layout.
    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// Its settings.
    pub fn config(&self) -> &QemuConfig {
        &self.inner.config
    }

    /// The accelerator VMs run with, and why, in words fit for a status or an event
    /// ("TCG (emulation, slow): the host's KVM is kvm_pvm, …").
    pub fn accel(&self) -> &process::AccelChoice {
        &self.inner.config.accel
    }

    /// The PID of VM `name`'s QEMU, when it runs.
    pub fn pid(&self, name: &str) -> Option<i32> {
        self.inner.pid(name)
    }

    /// The pinned known_hosts line of VM `name` (`[127.0.0.1]:PORT ssh-ed25519 AAAA…`).
    pub fn known_hosts(&self, name: &str) -> Result<Option<String>> {
        match std::fs::read_to_string(self.inner.layout.vm_known_hosts(name)) {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BackendError::io(
                format!("reading the known_hosts of VM {name}"),
                e,
            )),
        }
    }

    /// Register a builder's output (`manifest`: `OUT/<name>.json`) as a read-only base;
    /// returns its id. Idempotent: a base with the same content is registered once.
    pub async fn register_base(&self, manifest: &Path) -> Result<String> {
        self.inner.register_base(manifest).await
    }

    /// Wait until VM `name` has no block job running (a capture's stream), then settle its
    /// disk chain. Used by tests and benchmarks; operations do this themselves.
    pub async fn wait_settled(&self, name: &str, timeout: Duration) -> Result<()> {
        let _lock = self.inner.lock_vm(name).await?;
        let deadline = Instant::now() + timeout;
        loop {
            self.inner
                .wait_jobs(name, deadline.saturating_duration_since(Instant::now()))
                .await?;
            self.inner.settle(name).await?;
            // settle starts a stream when the chain was deeper; wait for that one too
            if self.inner.pid(name).is_none() {
                return Ok(());
            }
            let mut q = self.inner.qmp(name).await?;
            let jobs = q
                .query_block_jobs()
                .await
                .map_err(|e| failed(format!("query the block jobs of VM {name}"), e))?;
            if jobs.is_empty() {
                return Ok(());
            }
        }
    }
}

impl Inner {
    fn vm_dir(&self, name: &str) -> PathBuf {
        self.layout.vm_dir(name)
    }

    fn check_name(&self, what: &str, name: &str) -> Result<()> {
        if valid_name(name) {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "{what} name `{name}` is not valid for the qemu backend: use 1-63 of a-z, 0-9, '-' and '.'"
            )))
        }
    }

    async fn lock_vm(&self, name: &str) -> Result<FileLock> {
        self.layout.ensure().map_err(io(format!(
            "creating the state directory {}",
            self.layout.root().display()
        )))?;
        FileLock::acquire(self.layout.vm_lock(name))
            .await
            .map_err(io(format!("locking VM {name}")))
    }

    async fn lock_image(&self, name: &str) -> Result<FileLock> {
        self.layout.ensure().map_err(io(format!(
            "creating the state directory {}",
            self.layout.root().display()
        )))?;
        FileLock::acquire(self.layout.image_lock(name))
            .await
            .map_err(io(format!("locking image {name}")))
    }

    fn load_vm(&self, name: &str) -> Result<Option<VmConfig>> {
        layout::read_json(&self.layout.vm_config(name))
            .map_err(io(format!("reading the config of VM {name}")))
    }

    fn save_vm(&self, cfg: &VmConfig) -> Result<()> {
        write_json(&self.layout.vm_config(&cfg.name), cfg, 0o600)
            .map_err(io(format!("writing the config of VM {}", cfg.name)))
    }

    fn load_image(&self, name: &str) -> Result<Option<ImageRecord>> {
        layout::read_json(&self.layout.image_record(name))
            .map_err(io(format!("reading the record of image {name}")))
    }

    fn load_base(&self, id: &str) -> Result<BaseRecord> {
        layout::read_json(&self.layout.base_record(id))
            .map_err(io(format!("reading base {id}")))?
            .ok_or_else(|| {
                failed_msg(
                    "find the base",
                    format!(
                        "base {id} is missing from {}",
                        self.layout.bases().display()
                    ),
                )
            })
    }

    fn base_disk(&self, id: &str) -> PathBuf {
        self.layout.base_dir(id).join("disk.qcow2")
    }

    fn pid(&self, name: &str) -> Option<i32> {
        process::running_pid(&self.layout.vm_pidfile(name), &self.vm_dir(name))
    }

    /// The VM's disk generations present, highest first.
    fn generations(&self, name: &str) -> Result<Vec<u64>> {
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
    fn active_generation(&self, name: &str) -> Result<Option<u64>> {
        Ok(self.generations(name)?.first().copied())
    }

    /// Every disk file of the VM: its overlays and the image layers linked into it.
    fn disk_files(&self, name: &str) -> Result<Vec<PathBuf>> {
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
    fn max_generation(&self, name: &str) -> Result<u64> {
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
    fn remove_unused(&self, name: &str, keep: &[PathBuf]) -> Result<()> {
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
    async fn offline_chain(&self, cfg: &VmConfig) -> Result<Vec<PathBuf>> {
        let name = &cfg.name;
        let top = self.active_generation(name)?.ok_or_else(|| {
            failed_msg(
                "find the disk",
                format!("VM {name} has no disk in {}", self.vm_dir(name).display()),
            )
        })?;
        let top = self.layout.vm_disk(name, top);
        let chain = self
            .disks
            .chain(&top)
            .await
            .map_err(|e| failed(format!("read the disk chain of VM {name}"), e))?;
        let base = self.base_disk(&cfg.base);
        if chain.last() != Some(&base) {
            return Err(failed_msg(
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

    async fn qmp(&self, name: &str) -> Result<Qmp> {
        Qmp::connect(&self.layout.vm_qmp(name), QMP_TIMEOUT)
            .await
            .map_err(|e| failed(format!("talk to the QEMU of VM {name}"), e))
    }

    /// The active node and the chain (file names, top first) of the VM's disk, from QEMU.
    async fn live_chain(&self, q: &mut Qmp, name: &str) -> Result<(String, Vec<String>)> {
        let blocks = q
            .query_block()
            .await
            .map_err(|e| failed(format!("query the disks of VM {name}"), e))?;
        let disk = blocks
            .into_iter()
            .find(|b| {
                b.qdev == DISK_DEVICE
                    || b.qdev.contains(&format!("/{DISK_DEVICE}/"))
                    || b.qdev.ends_with(DISK_DEVICE)
            })
            .and_then(|b| b.inserted)
            .ok_or_else(|| {
                failed_msg(
                    "query the disks",
                    format!("VM {name} has no disk {DISK_DEVICE} in QEMU"),
                )
            })?;
        Ok((disk.node_name, disk.image.files()))
    }

    /// Wait (bounded) until QEMU runs no block job for the VM.
    async fn wait_jobs(&self, name: &str, timeout: Duration) -> Result<()> {
        if self.pid(name).is_none() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let mut q = self.qmp(name).await?;
            let jobs = q
                .query_block_jobs()
                .await
                .map_err(|e| failed(format!("query the block jobs of VM {name}"), e))?;
            if jobs.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(failed_msg(
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
    async fn settle(&self, name: &str) -> Result<()> {
        let Some(cfg) = self.load_vm(name)? else {
            return Ok(());
        };
        let base = self.base_disk(&cfg.base);
        let keep: PathBuf;
        if self.pid(name).is_some() {
            let mut q = self.qmp(name).await?;
            let jobs = q
                .query_block_jobs()
                .await
                .map_err(|e| failed(format!("query the block jobs of VM {name}"), e))?;
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
                    .map_err(|e| failed(format!("stream the disk of VM {name}"), e))?;
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
                self.disks
                    .rebase(&active, &base)
                    .await
                    .map_err(|e| failed(format!("pull the disk of VM {name} onto its base"), e))?;
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
    fn settle_later(self: &Arc<Self>, name: String) {
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

    /// The command line's inputs; `chain` is the disk chain, top first, base last.
    fn launch_spec(&self, cfg: &VmConfig, base: &BaseRecord, chain: &[PathBuf]) -> LaunchSpec {
        let name = &cfg.name;
        let top = chain[0].clone();
        let backing = chain[1..chain.len() - 1]
            .iter()
            .rev()
            .enumerate()
            .map(|(i, p)| (p.clone(), node_name(p, i)))
            .collect();
        LaunchSpec {
            name: name.clone(),
            dir: self.vm_dir(name),
            uuid: cfg.uuid.clone(),
            mac: cfg.mac.clone(),
            port: cfg.port,
            cpus: cfg.cpus,
            memory_mib: cfg.memory_mib,
            base: self.base_disk(&cfg.base),
            backing,
            disk_node: node_name(&top, 0),
            disk: top,
            seed: self.layout.vm_seed(name),
            qmp: self.layout.vm_qmp(name),
            qga: self.layout.vm_qga(name),
            serial: self.layout.vm_serial(name),
            pidfile: self.layout.vm_pidfile(name),
            boot: base.boot_in(&self.layout.base_dir(&base.id)),
            accel: self.config.accel.accel,
            tcg_tb_size_mib: self.config.tcg_tb_size_mib,
            sandbox: self.config.sandbox,
        }
    }

    /// Boot a stopped VM (lock held). Errors a person must fix are `Invalid`. A disk still
    /// more than one overlay deep (a linked image layer, a stream cut short) boots as it is and
    /// is streamed back to one overlay on its base in the background.
    async fn boot(self: &Arc<Self>, cfg: &VmConfig) -> Result<()> {
        let name = &cfg.name;
        if self.pid(name).is_some() {
            return Ok(());
        }
        let base = self.load_base(&cfg.base)?;
        let chain = self.offline_chain(cfg).await?;
        self.remove_unused(name, &chain)?;
        self.claim_port(name, cfg.port)?;
        // a QEMU that has just exited may still be releasing it
        let mut tries = 0;
        while !process::port_free(cfg.port) && tries < 20 {
            tries += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !process::port_free(cfg.port) {
            return Err(failed_msg(
                format!("start VM {name}"),
                format!(
                    "its ssh port 127.0.0.1:{} is taken by another process (not a boxery VM): free it (`ss -ltnp sport = :{}`) and retry",
                    cfg.port, cfg.port
                ),
            ));
        }
        let spec = self.launch_spec(cfg, &base, &chain);
        let t = Instant::now();
        let pid = process::launch(
            &self.config.qemu,
            &spec,
            &self.layout.vm_log(name),
            self.config.start_timeout,
        )
        .await
        .map_err(|e| match e {
            process::ProcessError::Missing { .. } | process::ProcessError::Start { .. } => {
                BackendError::Invalid(format!(
                    "{} ({})",
                    error_chain(&e),
                    self.config.accel.reason
                ))
            }
            e => failed(format!("start VM {name}"), e),
        })?;
        info!(vm = name.as_str(), pid, port = cfg.port, accel = %self.config.accel.accel, depth = chain.len() - 1, secs = t.elapsed().as_secs_f64(), "QEMU started");
        if chain.len() > 2 {
            let mut q = self.qmp(name).await?;
            q.block_stream(STREAM_JOB, &spec.disk_node, BASE_NODE)
                .await
                .map_err(|e| failed(format!("stream the disk of VM {name}"), e))?;
            drop(q);
            self.settle_later(name.clone());
        }
        Ok(())
    }

    /// Power a running VM off (lock held): ACPI button when the guest handles it, then `quit`,
    /// then signals.
    async fn shutdown(&self, name: &str, graceful: bool) -> Result<()> {
        let dir = self.vm_dir(name);
        let Some(pid) = self.pid(name) else {
            self.clear_runtime_files(name);
            return Ok(());
        };
        let acpi = match self.load_vm(name)? {
            Some(cfg) => self
                .load_base(&cfg.base)
                .map(|b| b.boot.acpi_shutdown)
                .unwrap_or(true),
            None => false,
        };
        if graceful
            && acpi
            && let Ok(mut q) = self.qmp(name).await
            && q.system_powerdown().await.is_ok()
        {
            drop(q);
            if process::wait_gone(pid, self.config.powerdown_timeout).await {
                self.clear_runtime_files(name);
                return Ok(());
            }
            warn!(vm = name, timeout = ?self.config.powerdown_timeout, "the guest did not power off on the ACPI button; quitting QEMU");
        }
        if let Ok(Ok(mut q)) = tokio::time::timeout(Duration::from_secs(5), self.qmp(name)).await {
            let _ = q.quit().await;
            drop(q);
            if process::wait_gone(pid, Duration::from_secs(10)).await {
                self.clear_runtime_files(name);
                return Ok(());
            }
        }
        process::terminate(pid, &dir, Duration::from_secs(5))
            .await
            .map_err(|e| failed(format!("stop VM {name}"), e))?;
        self.clear_runtime_files(name);
        Ok(())
    }

    fn clear_runtime_files(&self, name: &str) {
        for p in [
            self.layout.vm_pidfile(name),
            self.layout.vm_qmp(name),
            self.layout.vm_qga(name),
        ] {
            let _ = remove_file_if_exists(&p);
        }
    }

    /// Reserve a free loopback port for VM `name` (`ports/<port>` made with O_EXCL).
    fn reserve_port(&self, name: &str) -> Result<u16> {
        let range = self.config.ports.clone();
        let len = u32::from(*range.end() - *range.start()) + 1;
        let offset = rand::random::<u32>() % len;
        for i in 0..len {
            let port = *range.start() + ((offset + i) % len) as u16;
            let path = self.layout.port(port);
            if path.exists() || !process::port_free(port) {
                continue;
            }
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(name.as_bytes())
                        .map_err(io(format!("reserving port {port}")))?;
                    return Ok(port);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(BackendError::io(format!("reserving port {port}"), e)),
            }
        }
        Err(failed_msg(
            "reserve an ssh port",
            format!(
                "no free loopback port in {}-{} (BOXERY_QEMU_PORTS)",
                range.start(),
                range.end()
            ),
        ))
    }

    /// Make sure `ports/<port>` names VM `name` (recreated when missing).
    fn claim_port(&self, name: &str, port: u16) -> Result<()> {
        let path = self.layout.port(port);
        match std::fs::read_to_string(&path) {
            Ok(owner) if owner.trim() == name => Ok(()),
            Ok(owner) => Err(failed_msg(
                format!("start VM {name}"),
                format!(
                    "its port {port} is reserved for VM {} in {}",
                    owner.trim(),
                    path.display()
                ),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                layout::write_atomic(&path, name.as_bytes(), 0o644)
                    .map_err(io(format!("reserving port {port}")))
            }
            Err(e) => Err(BackendError::io(format!("reading {}", path.display()), e)),
        }
    }

    /// Release every port reserved for VM `name`.
    fn release_ports(&self, name: &str) -> Result<()> {
        let dir = self.layout.ports();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(BackendError::io(format!("listing {}", dir.display()), e)),
        };
        for e in entries.flatten() {
            if std::fs::read_to_string(e.path()).is_ok_and(|o| o.trim() == name) {
                remove_file_if_exists(&e.path())
                    .map_err(io(format!("releasing {}", e.path().display())))?;
            }
        }
        Ok(())
    }

    /// Remove VM `name` entirely: its QEMU (when ours), its directory, its port (lock held).
    async fn destroy(&self, name: &str) -> Result<()> {
        if self.pid(name).is_some() {
            self.shutdown(name, false).await?;
        }
        remove_dir_if_exists(&self.vm_dir(name))
            .map_err(io(format!("removing {}", self.vm_dir(name).display())))?;
        self.release_ports(name)
    }

    fn check_size(&self, cpus: u32, memory_mib: u64) -> Result<()> {
        let (host_cpus, host_mem) = process::host_capacity();
        if cpus == 0 || cpus > host_cpus {
            return Err(BackendError::Invalid(format!(
                "{cpus} CPUs asked, but this host has {host_cpus}: ask for 1 to {host_cpus}"
            )));
        }
        if memory_mib < 64 || (host_mem > 0 && memory_mib > host_mem) {
            return Err(BackendError::Invalid(format!(
                "{memory_mib} MiB of memory asked, but this host has {host_mem} MiB: ask for 64 MiB to {host_mem} MiB"
            )));
        }
        Ok(())
    }

    fn check_tools(&self) -> Result<()> {
        if self.tools_ok.get().is_some() {
            return Ok(());
        }
        let runs = |bin: &Path, arg: &str| {
            std::process::Command::new(bin)
                .arg(arg)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let mut missing = Vec::new();
        if !runs(&self.config.qemu, "--version") {
            missing.push(format!(
                "{} (package qemu-system-x86, from bookworm-backports on Debian 12)",
                self.config.qemu.display()
            ));
        }
        if !runs(&self.config.qemu_img, "--version") {
            missing.push(format!(
                "{} (package qemu-utils)",
                self.config.qemu_img.display()
            ));
        }
        if !runs(&self.config.genisoimage, "-version") {
            missing.push("genisoimage (package genisoimage)".into());
        }
        if !runs(Path::new("ssh-keygen"), "-?") && !Path::new("/usr/bin/ssh-keygen").exists() {
            missing.push("ssh-keygen (package openssh-client)".into());
        }
        if missing.is_empty() {
            let _ = self.tools_ok.set(());
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "the qemu backend needs {}: run scripts/install-deps.sh",
                missing.join(", ")
            )))
        }
    }

    async fn write_seed(&self, name: &str, instance_id: &str, identity: &Identity) -> Result<()> {
        let mut identity = identity.clone();
        if identity.hostname.is_empty() {
            identity.hostname = name.to_string();
        }
        let work = self.vm_dir(name).join("seed");
        seed::write_seed_iso(
            &self.config.genisoimage,
            name,
            instance_id,
            &identity,
            &work,
            &self.layout.vm_seed(name),
        )
        .await
        .map_err(|e| match e {
            seed::SeedError::Identity { .. } => BackendError::Invalid(error_chain(&e)),
            e => failed(format!("write the seed of VM {name}"), e),
        })
    }

    fn write_known_hosts(&self, cfg: &VmConfig) -> Result<()> {
        let path = self.layout.vm_known_hosts(&cfg.name);
        match &cfg.host_key {
            Some(key) => {
                // two lines, one key: for `-p PORT agent@127.0.0.1` and for `HostKeyAlias NAME.boxery`
                let by_port =
                    crate::identity::known_hosts_line(&format!("[127.0.0.1]:{}", cfg.port), key);
                let by_alias =
                    crate::identity::known_hosts_line(&format!("{}.boxery", cfg.name), key);
                layout::write_atomic(&path, format!("{by_port}\n{by_alias}\n").as_bytes(), 0o644)
                    .map_err(io(format!("writing {}", path.display())))
            }
            None => {
                remove_file_if_exists(&path).map_err(io(format!("removing {}", path.display())))
            }
        }
    }

    /// Copy image `image`'s overlay to `dst` (same base, so the header is already right),
    /// grown to `min_bytes` when smaller.
    async fn copy_image(&self, image: &str, dst: &Path, min_bytes: u64) -> Result<u64> {
        use std::os::unix::fs::PermissionsExt;
        let src = self.layout.image_disk(image);
        let _ = remove_file_if_exists(dst);
        self.disks
            .copy(&src, dst)
            .await
            .map_err(|e| failed(format!("copy image {image}"), e))?;
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(0o600))
            .map_err(io(format!("chmod {}", dst.display())))?;
        let info = self
            .disks
            .info(dst)
            .await
            .map_err(|e| failed(format!("inspect the copy of image {image}"), e))?;
        if info.virtual_size < min_bytes {
            self.disks
                .resize(dst, min_bytes)
                .await
                .map_err(|e| failed(format!("grow the disk made from image {image}"), e))?;
            return Ok(min_bytes);
        }
        Ok(info.virtual_size)
    }

    /// Give VM `name` a disk from image `image` as generation `generation`: the image's
    /// overlay hard-linked in as `layer-<gen>` (read-only to QEMU, so the image is never
    /// written) under a new empty overlay `disk-<gen+1>` of `bytes`; the first boot streams the
    /// layer up so the disk is one overlay on the base again. The link keeps the data alive
    /// when the image is deleted. Where a hard link is impossible, a copy of the overlay.
    /// Returns the disk's virtual size.
    async fn attach_image(
        &self,
        name: &str,
        image: &str,
        generation: u64,
        bytes: u64,
    ) -> Result<u64> {
        let src = self.layout.image_disk(image);
        let layer = self.vm_dir(name).join(format!("layer-{generation}.qcow2"));
        let top = self.layout.vm_disk(name, generation + 1);
        let _ = remove_file_if_exists(&layer);
        let _ = remove_file_if_exists(&top);
        match std::fs::hard_link(&src, &layer) {
            Ok(()) => {
                let size = self
                    .disks
                    .info(&layer)
                    .await
                    .map_err(|e| failed(format!("inspect image {image}"), e))?
                    .virtual_size;
                let size = size.max(bytes);
                self.disks
                    .create_overlay(&top, &layer, Some(size))
                    .await
                    .map_err(|e| failed(format!("make the disk of VM {name}"), e))?;
                Ok(size)
            }
            Err(e) => {
                debug!(vm = name, image, error = %e, "cannot hard-link the image; copying it");
                let part = self
                    .vm_dir(name)
                    .join(format!(".disk-{generation}.qcow2.part"));
                let size = self.copy_image(image, &part, bytes).await?;
                let disk = self.layout.vm_disk(name, generation);
                std::fs::rename(&part, &disk)
                    .map_err(io(format!("renaming {}", part.display())))?;
                Ok(size)
            }
        }
    }

    async fn create_inner(self: &Arc<Self>, vm: &NewVm) -> Result<()> {
        let name = vm.name.as_str();
        let crate::DiskSource::Image(image) = &vm.source;
        let rec = self
            .load_image(image)?
            .ok_or_else(|| not_found(format!("image {image}")))?;
        if !self.layout.image_disk(image).exists() {
            return Err(not_found(format!("image {image} (its disk is missing)")));
        }
        let base = self.load_base(&rec.base)?;
        let want = vm.disk_gib.saturating_mul(GIB);
        if want < rec.virtual_size {
            return Err(BackendError::Invalid(format!(
                "a {} GiB disk is smaller than image {image} ({:.1} GiB): ask for at least {} GiB",
                vm.disk_gib,
                rec.virtual_size as f64 / GIB as f64,
                rec.virtual_size.div_ceil(GIB)
            )));
        }

        let dir = self.vm_dir(name);
        let t = Instant::now();
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io(format!("chmod {}", dir.display())))?;
        }
        let port = self.reserve_port(name)?;
        self.attach_image(name, image, 1, want).await?;
        // a request without a host key still gets one: every VM is pinned
        let mut identity = vm.identity.clone();
        if identity.host_key.is_none() {
            identity.host_key = Some(crate::identity::host_key(name, &format!("{name}.boxery"))?);
        }
        let instance_id = new_instance_id();
        self.write_seed(name, &instance_id, &identity).await?;
        let cfg = VmConfig {
            name: name.into(),
            mark: vm.uid.clone(),
            uuid: uuid::Uuid::new_v4().to_string(),
            mac: random_mac(),
            port,
            cpus: vm.cpus,
            memory_mib: vm.memory_mib,
            disk_gib: vm.disk_gib,
            base: base.id.clone(),
            instance_id,
            hostname: if identity.hostname.is_empty() {
                name.into()
            } else {
                identity.hostname.clone()
            },
            host_key: identity
                .host_key
                .as_ref()
                .map(|(_, public)| public.trim().to_string()),
            image: image.clone(),
            created: boxery_api::now(),
        };
        self.write_known_hosts(&cfg)?;
        self.save_vm(&cfg)?;
        info!(
            vm = name,
            image = image.as_str(),
            port,
            secs = t.elapsed().as_secs_f64(),
            "VM created"
        );
        if vm.start {
            self.boot(&cfg).await?;
        }
        Ok(())
    }

    async fn capture_inner(self: &Arc<Self>, vm: &str, image: &str, uid: &str) -> Result<()> {
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
    async fn freeze(&self, q: &mut Qmp, vm: &str) -> bool {
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

    async fn thaw(&self, vm: &str) {
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
    async fn publish_image(
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
    fn remove_image_files(&self, image: &str) -> Result<()> {
        remove_file_if_exists(&self.layout.image_record(image))
            .map_err(io(format!("removing the record of image {image}")))?;
        remove_file_if_exists(&self.layout.image_disk(image))
            .map_err(io(format!("removing the disk of image {image}")))?;
        let prefix = format!(".{image}.");
        if let Ok(entries) = std::fs::read_dir(self.layout.images()) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    remove_file_if_exists(&e.path())
                        .map_err(io(format!("removing {}", e.path().display())))?;
                }
            }
        }
        Ok(())
    }

    async fn register_base(&self, manifest_path: &Path) -> Result<String> {
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
        let short: String = hash
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(12)
            .collect();
        let id = format!("{}-{short}", m.name);
        if !valid_name(&id) {
            return Err(BackendError::Invalid(format!(
                "image manifest {} names an invalid image `{}`",
                manifest_path.display(),
                m.name
            )));
        }
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
                if info.backing().is_some() {
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
    async fn image_from_base(
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

    fn same_image(&self, rec: ImageRecord, uid: &str) -> Result<()> {
        if rec.mark == uid {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "image {} already exists in the qemu backend for another object (uid {}): pick another name",
                rec.name, rec.mark
            )))
        }
    }
}

fn failed_msg(step: impl Into<String>, message: impl Into<String>) -> BackendError {
    BackendError::failed(step, message)
}

/// Which builder script makes stock image `name`.
fn builder_script(name: &str) -> Option<&'static str> {
    match name {
        "debian-12" => Some("build-debian.sh"),
        "tiny" => Some("build-tiny.sh"),
        _ => None,
    }
}

#[async_trait]
impl Backend for QemuBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: BACKEND,
            stability: Stability::Experimental,
            platforms: &["linux-x86_64"],
            requirements: &[
                "qemu-system-x86 >= 8 (Debian 12: from bookworm-backports)",
                "qemu-utils",
                "genisoimage",
                "openssh-client",
            ],
            resize: true,
            live_capture: true,
            build_stock_image: true,
            host_key: true,
            ssh: true,
        }
    }

    async fn check(&self) -> Result<()> {
        self.inner.check_tools()
    }

    async fn init(&self) -> Result<()> {
        let root = self.inner.layout.root();
        if root.to_string_lossy().contains(',') {
            return Err(BackendError::Invalid(format!(
                "the qemu state directory {} contains a comma, which QEMU options cannot carry: move BOXERY_HOME",
                root.display()
            )));
        }
        self.inner.layout.ensure().map_err(io(format!(
            "creating the state directory {}",
            root.display()
        )))
    }

    async fn create(&self, vm: &NewVm) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", &vm.name)?;
        inner.check_size(vm.cpus, vm.memory_mib)?;
        let sock = inner.layout.vm_qmp(&vm.name);
        if sock.as_os_str().len() > layout::MAX_SOCKET_PATH {
            return Err(BackendError::Invalid(format!(
                "the QMP socket path {} is longer than {} bytes: use a shorter BOXERY_HOME or VM name",
                sock.display(),
                layout::MAX_SOCKET_PATH
            )));
        }
        if vm.start {
            inner.check_tools()?;
        }
        let _lock = inner.lock_vm(&vm.name).await?;
        if let Some(cfg) = inner.load_vm(&vm.name)? {
            if cfg.mark != vm.uid {
                return Err(BackendError::Invalid(format!(
                    "a VM named {} already exists in the qemu backend for another object (uid {}): pick another name",
                    vm.name, cfg.mark
                )));
            }
            if vm.start {
                inner.boot(&cfg).await?;
            }
            return Ok(());
        }
        // a directory without a config is a create that died: start over
        inner.destroy(&vm.name).await?;
        let res = inner.create_inner(vm).await;
        if let Err(e) = &res {
            warn!(vm = vm.name.as_str(), error = %e, "create failed; removing what it made");
            if let Err(e2) = inner.destroy(&vm.name).await {
                warn!(vm = vm.name.as_str(), error = %e2, "could not remove the failed create; cleanup_new retries");
            }
        }
        res
    }

    async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        let inner = &self.inner;
        if !valid_name(name) {
            return Ok(None);
        }
        let root = inner.layout.vms();
        if let Err(e) = std::fs::metadata(&root) {
            if e.kind() == std::io::ErrorKind::NotFound && !inner.layout.root().exists() {
                return Ok(None);
            }
            return Err(unreachable(format!("cannot read {}: {e}", root.display())));
        }
        let cfg = match inner.load_vm(name) {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(None),
            Err(e) => return Err(unreachable(error_chain(&e))),
        };
        let gens = inner
            .generations(name)
            .map_err(|e| unreachable(error_chain(&e)))?;
        if gens.is_empty() {
            // its disk is gone: it is Lost to the reconciler
            return Ok(None);
        }
        let running = inner.pid(name).is_some();
        Ok(Some(VmInfo {
            name: cfg.name.clone(),
            mark: Some(cfg.mark.clone()),
            state: if running {
                PowerState::Running
            } else {
                PowerState::Stopped
            },
            size: VmSize {
                cpus: cfg.cpus,
                memory_mib: cfg.memory_mib,
                disk_gib: cfg.disk_gib,
            },
            ssh: running.then(|| format!("127.0.0.1:{}", cfg.port)),
            disk_used_bytes: Some(
                gens.iter()
                    .map(|g| allocated_bytes(&inner.layout.vm_disk(name, *g)))
                    .sum(),
            ),
        }))
    }

    async fn list(&self) -> Result<Vec<VmInfo>> {
        let dir = self.inner.layout.vms();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && !self.inner.layout.root().exists() =>
            {
                return Err(unreachable(format!(
                    "its state directory {} does not exist: run `boxery init` (or check that BOXERY_HOME is mounted)",
                    self.inner.layout.root().display()
                )));
            }
            Err(e) => return Err(unreachable(format!("cannot read {}: {e}", dir.display()))),
        };
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(|e| unreachable(format!("cannot read {}: {e}", dir.display())))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !valid_name(&name) {
                continue;
            }
            if let Some(info) = self.get(&name).await? {
                out.push(info);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn ssh_endpoint(&self, name: &str) -> Result<Option<String>> {
        Ok(self.get(name).await?.and_then(|i| i.ssh))
    }

    async fn start(&self, name: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", name)?;
        let _lock = inner.lock_vm(name).await?;
        let cfg = inner
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        inner.boot(&cfg).await
    }

    async fn stop(&self, name: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", name)?;
        let _lock = inner.lock_vm(name).await?;
        if inner.load_vm(name)?.is_none() {
            return Err(not_found(format!("VM {name}")));
        }
        inner.shutdown(name, true).await
    }

    async fn remove(&self, name: &str) -> Result<()> {
        let inner = &self.inner;
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = inner.lock_vm(name).await?;
        inner.destroy(name).await?;
        info!(vm = name, "VM removed");
        Ok(())
    }

    async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", name)?;
        inner.check_size(size.cpus, size.memory_mib)?;
        let _lock = inner.lock_vm(name).await?;
        let mut cfg = inner
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        if size.disk_gib < cfg.disk_gib {
            return Err(BackendError::Invalid(format!(
                "disks only grow: VM {name} has {} GiB, {} GiB asked",
                cfg.disk_gib, size.disk_gib
            )));
        }
        let machine_change = size.cpus != cfg.cpus || size.memory_mib != cfg.memory_mib;
        let grow = size.disk_gib > cfg.disk_gib;
        if !machine_change && !grow {
            return Ok(());
        }
        let was_running = inner.pid(name).is_some();
        if was_running && !machine_change {
            // disk only: grow it live, the guest sees a capacity change
            let mut q = inner.qmp(name).await?;
            let (node, _) = inner.live_chain(&mut q, name).await?;
            q.block_resize(&node, size.disk_gib * GIB)
                .await
                .map_err(|e| failed(format!("grow the disk of VM {name}"), e))?;
            cfg.disk_gib = size.disk_gib;
            return inner.save_vm(&cfg);
        }
        if was_running {
            inner.shutdown(name, true).await?;
        }
        let applied: Result<()> = async {
            if grow {
                inner.settle(name).await?;
                let generation = inner
                    .active_generation(name)?
                    .ok_or_else(|| not_found(format!("the disk of VM {name}")))?;
                inner
                    .disks
                    .resize(&inner.layout.vm_disk(name, generation), size.disk_gib * GIB)
                    .await
                    .map_err(|e| failed(format!("grow the disk of VM {name}"), e))?;
            }
            cfg.cpus = size.cpus;
            cfg.memory_mib = size.memory_mib;
            cfg.disk_gib = size.disk_gib;
            inner.save_vm(&cfg)
        }
        .await;
        if was_running {
            // running before: running after, with the old size if applying failed
            let cfg = inner
                .load_vm(name)?
                .ok_or_else(|| not_found(format!("VM {name}")))?;
            inner.boot(&cfg).await?;
        }
        applied
    }

    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", vm)?;
        inner.check_name("image", image)?;
        let _vm_lock = inner.lock_vm(vm).await?;
        let _image_lock = inner.lock_image(image).await?;
        if let Some(rec) = inner.load_image(image)? {
            return inner.same_image(rec, uid);
        }
        let res = inner.capture_inner(vm, image, uid).await;
        if res.is_err() {
            let _ = inner.remove_image_files(image);
        }
        res
    }

    async fn images(&self) -> Result<Vec<ImageInfo>> {
        let dir = self.inner.layout.images();
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| unreachable(format!("cannot read {}: {e}", dir.display())))?;
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(|e| unreachable(format!("cannot read {}: {e}", dir.display())))?;
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json") else {
                continue;
            };
            if !valid_name(name) {
                continue;
            }
            let Some(rec) = self
                .inner
                .load_image(name)
                .map_err(|e| unreachable(error_chain(&e)))?
            else {
                continue;
            };
            let disk = self.inner.layout.image_disk(name);
            if !disk.exists() {
                continue;
            }
            out.push(ImageInfo {
                name: rec.name,
                mark: Some(rec.mark),
                created: Some(rec.created),
                size_bytes: Some(allocated_bytes(&disk)),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn remove_image(&self, image: &str) -> Result<()> {
        self.cleanup_image(image).await
    }

    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", vm)?;
        if !valid_name(image) {
            return Err(BackendError::Unchanged(format!(
                "image name `{image}` is not valid"
            )));
        }
        let _lock = inner.lock_vm(vm).await?;
        let mut cfg = inner
            .load_vm(vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let unchanged = |e: BackendError| BackendError::Unchanged(e.to_string());
        let rec = inner.load_image(image).map_err(unchanged)?.ok_or_else(|| {
            BackendError::Unchanged(format!("image {image} does not exist in the qemu backend"))
        })?;
        inner.load_base(&rec.base).map_err(unchanged)?;
        if !inner.layout.image_disk(image).exists() {
            return Err(BackendError::Unchanged(format!(
                "image {image} has no disk in the qemu backend"
            )));
        }
        let t = Instant::now();
        // from here on the VM changes; a retry redoes every step: the highest `disk-N` is
        // always either the old disk or the complete new one
        inner.shutdown(vm, false).await?;
        let generation = inner.max_generation(vm)? + 1;
        let bytes = inner
            .attach_image(vm, image, generation, cfg.disk_gib * GIB)
            .await?;
        let top = inner
            .active_generation(vm)?
            .map(|g| inner.layout.vm_disk(vm, g));
        let mut keep = vec![inner.vm_dir(vm).join(format!("layer-{generation}.qcow2"))];
        keep.extend(top);
        layout::sync_dir(&keep[0]).map_err(io("fsync"))?;
        inner.remove_unused(vm, &keep)?;
        // the identity stays: a new seed only when the caller passes a different host key (a
        // new identity, so a new instance-id); otherwise the seed the VM has
        let new_key = identity
            .host_key
            .as_ref()
            .map(|(_, p)| p.trim().to_string());
        if new_key.is_some() && new_key != cfg.host_key {
            cfg.instance_id = new_instance_id();
            inner.write_seed(vm, &cfg.instance_id, identity).await?;
            cfg.host_key = identity
                .host_key
                .as_ref()
                .map(|(_, p)| p.trim().to_string());
            if !identity.hostname.is_empty() {
                cfg.hostname = identity.hostname.clone();
            }
        }
        cfg.base = rec.base.clone();
        cfg.image = image.into();
        cfg.disk_gib = cfg.disk_gib.max(bytes.div_ceil(GIB));
        inner.write_known_hosts(&cfg)?;
        inner.save_vm(&cfg)?;
        inner.boot(&cfg).await?;
        info!(vm, image, secs = t.elapsed().as_secs_f64(), "reimaged");
        Ok(())
    }

    async fn build_image(
        &self,
        name: &str,
        image: &str,
        uid: &str,
        progress: Progress,
    ) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("image", image)?;
        let script = builder_script(name).ok_or_else(|| {
            BackendError::Invalid(format!(
                "the qemu backend cannot build stock image `{name}`: it builds debian-12 and tiny"
            ))
        })?;
        if let Some(rec) = inner.load_image(image)? {
            return inner.same_image(rec, uid);
        }
        let dir = inner.config.image_dir.clone().ok_or_else(|| {
            BackendError::Invalid(
                "the image builders (image/build-*.sh) were not found: set BOXERY_IMAGE_DIR to the repository's image/ directory".into(),
            )
        })?;
        let script_path = dir.join(script);
        if !script_path.is_file() {
            return Err(BackendError::Invalid(format!(
                "{} does not exist: set BOXERY_IMAGE_DIR",
                script_path.display()
            )));
        }
        let out = inner.config.image_cache.clone();
        progress(&format!(
            "building {name} with {} into {}",
            script_path.display(),
            out.display()
        ));
        let stderr_path = inner.layout.root().join(format!(".build-{image}.log"));
        inner
            .layout
            .ensure()
            .map_err(io("creating the state directory"))?;
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(io(format!("creating {}", stderr_path.display())))?;
        let mut child = tokio::process::Command::new("bash")
            .arg(&script_path)
            .arg(&out)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("running {}", script_path.display())))?;
        if let Some(stdout) = child.stdout.take() {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                progress(&line);
            }
        }
        let status = child
            .wait()
            .await
            .map_err(io(format!("waiting for {}", script_path.display())))?;
        if !status.success() {
            let tail = process::tail(&stderr_path, 15);
            return Err(failed_msg(
                format!("build stock image {name}"),
                format!("{} exited with {status}: {tail}", script_path.display()),
            ));
        }
        let _ = remove_file_if_exists(&stderr_path);
        let base = inner
            .register_base(&out.join(format!("{name}.json")))
            .await?;
        progress(&format!("registered base {base}"));
        inner
            .image_from_base(image, uid, &base, &format!("build:{name}"))
            .await
    }

    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("image", image)?;
        let manifest = if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            path.with_extension("json")
        };
        if !manifest.is_file() {
            return Err(BackendError::Invalid(format!(
                "{} has no image manifest ({}): the qemu backend imports builder outputs (docs/images.md), which say how the disk boots",
                path.display(),
                manifest.display()
            )));
        }
        let base = inner.register_base(&manifest).await?;
        inner
            .image_from_base(image, uid, &base, &format!("file:{}", path.display()))
            .await
    }

    async fn cleanup_new(&self, name: &str) -> Result<()> {
        let inner = &self.inner;
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = inner.lock_vm(name).await?;
        inner.destroy(name).await
    }

    async fn cleanup_image(&self, image: &str) -> Result<()> {
        let inner = &self.inner;
        if !valid_name(image) {
            return Ok(());
        }
        if !inner.layout.images().exists() {
            return Ok(());
        }
        let _lock = inner.lock_image(image).await?;
        inner.remove_image_files(image)
    }

    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        let inner = &self.inner;
        if !valid_name(vm) || !valid_name(image) {
            return Ok(());
        }
        let _lock = inner.lock_vm(vm).await?;
        if inner.load_vm(vm)?.is_some() && inner.pid(vm).is_some() {
            // a capture that died between freeze and thaw leaves the guest frozen
            let mut q = inner.qmp(vm).await?;
            let agent = q
                .query_chardev()
                .await
                .map(|c| c.iter().any(|c| c.label == "qga0" && c.frontend_open))
                .unwrap_or(false);
            if agent
                && let Ok(mut g) =
                    Qga::connect(&inner.layout.vm_qga(vm), Duration::from_secs(3)).await
                && g.fsfreeze_status().await.ok() == Some(qmp::FreezeStatus::Frozen)
            {
                g.fsfreeze_thaw()
                    .await
                    .map_err(|e| failed(format!("thaw the guest of VM {vm}"), e))?;
            }
            // our capture starts no job other than the stream, which is left to finish
            let jobs = q
                .query_block_jobs()
                .await
                .map_err(|e| failed(format!("query the block jobs of VM {vm}"), e))?;
            for j in jobs.iter().filter(|j| j.kind != "stream") {
                q.block_job_cancel(&j.device, true)
                    .await
                    .map_err(|e| failed(format!("cancel block job {}", j.device), e))?;
            }
            if original == Some(PowerState::Running)
                && let Ok(st) = q.query_status().await
                && st.status == "paused"
            {
                q.cont()
                    .await
                    .map_err(|e| failed(format!("resume VM {vm}"), e))?;
            }
            drop(q);
            // a snapshot QEMU never switched to is an empty file above the active layer
            if let Ok((_, files)) = inner.live_chain(&mut inner.qmp(vm).await?, vm).await {
                let active = PathBuf::from(&files[0]);
                for g in inner.generations(vm)? {
                    let p = inner.layout.vm_disk(vm, g);
                    if let Some(ag) = active
                        .file_name()
                        .and_then(|f| disk_generation(&f.to_string_lossy()))
                        && g > ag
                    {
                        remove_file_if_exists(&p)
                            .map_err(io(format!("removing {}", p.display())))?;
                    }
                }
            }
            inner.settle(vm).await?;
        } else if original == Some(PowerState::Running) && inner.load_vm(vm)?.is_some() {
            // the VM died with the capture: bring it back as it was
            let cfg = inner
                .load_vm(vm)?
                .ok_or_else(|| not_found(format!("VM {vm}")))?;
            inner.boot(&cfg).await?;
        }
        let _image_lock = inner.lock_image(image).await?;
        if inner.load_image(image)?.is_none() {
            inner.remove_image_files(image)?;
        }
        Ok(())
    }

    /// The pinned key recorded when the seed was written (the seed reaches the guest through
    /// the hypervisor, which the guest cannot spoof); for a VM without a record, the key the
    /// guest agent reads from the guest's disk.
    async fn host_key(&self, name: &str) -> Result<Option<String>> {
        let inner = &self.inner;
        if let Some(cfg) = inner.load_vm(name)?
            && let Some(key) = cfg.host_key
        {
            return Ok(Some(key));
        }
        if inner.pid(name).is_none() {
            return Ok(None);
        }
        let _lock = inner.lock_vm(name).await?;
        let mut q = inner.qmp(name).await?;
        let agent = q
            .query_chardev()
            .await
            .map(|c| c.iter().any(|c| c.label == "qga0" && c.frontend_open))
            .unwrap_or(false);
        drop(q);
        if !agent {
            return Ok(None);
        }
        let mut g = Qga::connect(&inner.layout.vm_qga(name), Duration::from_secs(5))
            .await
            .map_err(|e| failed(format!("reach the guest agent of VM {name}"), e))?;
        match g.read_file("/etc/ssh/boxery_host_ed25519_key.pub").await {
            Ok(s) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
            Err(qmp::QmpError::Command { .. }) => Ok(None),
            Err(e) => Err(failed(format!("read the host key of VM {name}"), e)),
        }
    }
}
