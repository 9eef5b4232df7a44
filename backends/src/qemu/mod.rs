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
//! - **Screen**: a standard VGA (its text mode is what a guest without a graphics driver
//!   shows), the machine's PS/2 keyboard and a virtio tablet, after every other device; no
//!   window, no listener. Read with QMP `screendump`, driven with `input-send-event`
//!   (`screen`).
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

mod capture;
mod chain;
pub mod config;
pub mod layout;
mod lifecycle;
mod memory;
pub mod net;
pub mod process;
pub mod qmp;
mod screen;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tracing::{debug, info, warn};

use crate::storage::disk::{Disks, GIB, allocated_bytes};
use crate::storage::files::{FileLock, remove_dir_if_exists, remove_file_if_exists, valid_name};
use crate::storage::records::{BaseRecord, VmConfig};
use crate::storage::{BasePlaces, Places, Storage, seed};
use crate::{
    Backend, BackendError, Capabilities, Identity, ImageInfo, NewVm, PowerState, Progress, Result,
    Stability, Stock, VmInfo, VmSize, error_chain, io,
};
use chain::disk_generation;
use config::QemuConfig;
use layout::Layout;
use process::{BASE_NODE, DISK_DEVICE, LaunchSpec};
use qmp::{Qga, Qmp};

const BACKEND: &str = "qemu";
const QMP_TIMEOUT: Duration = Duration::from_secs(30);
const STREAM_JOB: &str = "bx-stream";
/// How long a capture waits for the previous capture's stream.
const STREAM_WAIT: Duration = Duration::from_secs(600);

fn not_found(what: impl Into<String>) -> BackendError {
    BackendError::not_found(BACKEND, what)
}

fn unreachable(message: impl Into<String>) -> BackendError {
    BackendError::unreachable(BACKEND, message)
}

/// The state shared by the backend and its background tasks.
#[derive(Debug)]
struct Inner {
    layout: Layout,
    config: QemuConfig,
    /// Bases, images and seeds: `base/<id>/`, `images/<name>.{qcow2,json}`.
    storage: Storage,
    /// Set once the host tools were found (checked again until they are).
    tools_ok: std::sync::OnceLock<()>,
    /// The size each VM's screen showed at its last screendump (super::screen).
    screens: crate::screen::Sizes,
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
        let layout = Layout::new(dir);
        let places = Places {
            state: layout.root().to_path_buf(),
            image_disks: layout.images(),
            image_file: |name| format!("{name}.qcow2"),
            image_part_file: |name| format!(".{name}.qcow2.part"),
            image_copy_file: None,
            bases: BasePlaces::Dirs(layout.bases()),
        };
        let storage = Storage::new(BACKEND, places, config.storage.clone());
        QemuBackend {
            inner: Arc::new(Inner {
                layout,
                config,
                storage,
                tools_ok: std::sync::OnceLock::new(),
                screens: Default::default(),
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
    pub fn accel(&self) -> &crate::host::AccelChoice {
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
        self.inner.ensure_layout()?;
        self.inner.storage.register_base(manifest).await
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
            let jobs = q.query_block_jobs().await.map_err(|e| {
                BackendError::failed(format!("query the block jobs of VM {name}"), e)
            })?;
            if jobs.is_empty() {
                return Ok(());
            }
        }
    }

    /// `reimage`, and with `memory` the image's memory installed as the VM's saved memory
    /// before it boots (so it resumes from it).
    async fn reimage_with(
        &self,
        vm: &str,
        image: &str,
        identity: &Identity,
        memory: bool,
    ) -> Result<()> {
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
        let unchanged = |e: BackendError| BackendError::Unchanged(e.chain());
        let rec = inner
            .storage
            .load_image(image)
            .map_err(unchanged)?
            .ok_or_else(|| {
                BackendError::Unchanged(format!("image {image} does not exist in the qemu backend"))
            })?;
        let base = inner.load_base(&rec.base).map_err(unchanged)?;
        if memory {
            let mut after = cfg.clone();
            after.base = rec.base.clone();
            if let Some(why) = inner
                .image_memory_refusal(&after, &base, image)
                .map_err(unchanged)?
            {
                return Err(BackendError::Unchanged(why));
            }
        }
        if !inner.storage.image_disk(image).exists() {
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
        crate::storage::files::sync_dir(&keep[0]).map_err(io("fsync"))?;
        inner.remove_unused(vm, &keep)?;
        let saved_memory = match memory {
            true => Some(
                inner
                    .image_state(image)
                    .read()?
                    .ok_or_else(|| not_found(format!("the memory of image {image}")))?,
            ),
            false => None,
        };
        if let Some(saved) = &saved_memory {
            // the guest resumes with the identity it had at the snapshot (its host key is in
            // its memory and on the image's disk): pin that one, write no new seed
            if let Some(key) = &saved.host_key {
                cfg.host_key = Some(key.clone());
            }
        } else if let Some(id) = seed::reseed(vm, &mut cfg, identity)? {
            // the identity stays: a new seed only when the caller passes a different host key
            let (work, iso) = inner.seed_files(vm);
            inner
                .storage
                .write_seed(vm, &cfg.instance_id, &id, &rec.base, &work, &iso)
                .await?;
        }
        cfg.base = rec.base.clone();
        cfg.image = image.into();
        cfg.disk_gib = cfg.disk_gib.max(bytes.div_ceil(GIB));
        inner.write_known_hosts(&cfg)?;
        inner.save_vm(&cfg)?;
        if let Some(saved) = &saved_memory {
            // the boot below resumes from it
            inner.install_image_memory(vm, image, saved)?;
        }
        inner.boot(&cfg).await?;
        info!(
            vm,
            image,
            memory,
            secs = t.elapsed().as_secs_f64(),
            "reimaged"
        );
        Ok(())
    }
}

impl Inner {
    fn vm_dir(&self, name: &str) -> PathBuf {
        self.layout.vm_dir(name)
    }

    fn disks(&self) -> &Disks {
        self.storage.disks()
    }

    fn check_name(&self, what: &str, name: &str) -> Result<()> {
        self.storage.check_name(what, name)
    }

    fn ensure_layout(&self) -> Result<()> {
        self.layout.ensure().map_err(io(format!(
            "creating the state directory {}",
            self.layout.root().display()
        )))
    }

    /// VM `name`'s lock, held, and its configuration (`NotFound` when it has none).
    async fn locked(&self, name: &str) -> Result<(FileLock, VmConfig)> {
        self.check_name("VM", name)?;
        let lock = self.lock_vm(name).await?;
        let cfg = self
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        Ok((lock, cfg))
    }

    async fn lock_vm(&self, name: &str) -> Result<FileLock> {
        self.ensure_layout()?;
        self.storage.lock(&format!("vm-{name}")).await
    }

    async fn lock_image(&self, name: &str) -> Result<FileLock> {
        self.ensure_layout()?;
        self.storage.lock(&format!("image-{name}")).await
    }

    fn load_vm(&self, name: &str) -> Result<Option<VmConfig>> {
        crate::storage::files::read_json(&self.layout.vm_config(name))
            .map_err(io(format!("reading the config of VM {name}")))
    }

    fn save_vm(&self, cfg: &VmConfig) -> Result<()> {
        crate::storage::files::write_json(&self.layout.vm_config(&cfg.name), cfg, 0o600)
            .map_err(io(format!("writing the config of VM {}", cfg.name)))
    }

    fn load_base(&self, id: &str) -> Result<BaseRecord> {
        self.storage.load_base(id)
    }

    fn base_disk(&self, id: &str) -> PathBuf {
        self.storage.base_disk(id)
    }

    fn pid(&self, name: &str) -> Option<i32> {
        process::running_pid(&self.layout.vm_pidfile(name), &self.vm_dir(name))
    }

    async fn qmp(&self, name: &str) -> Result<Qmp> {
        Qmp::connect(&self.layout.vm_qmp(name), QMP_TIMEOUT)
            .await
            .map_err(|e| BackendError::failed(format!("talk to the QEMU of VM {name}"), e))
    }
}

#[async_trait]
impl Backend for QemuBackend {
    fn guest_proxy(&self, name: &str) -> Option<crate::GuestProxy> {
        self.inner.check_name("VM", name).ok()?;
        Some(crate::GuestProxy {
            url: format!(
                "http://{}",
                process::GUEST_PROXY_ADDR.trim_end_matches(":80")
            ),
            listen: crate::ProxyListen::Unix(self.inner.layout.vm_proxy(name)),
            dns: Some(crate::GuestDns {
                listen: self.inner.layout.vm_dns(name),
                listen_tcp: Some(self.inner.layout.vm_dns_tcp(name)),
                addr: process::GUEST_DNS,
            }),
        })
    }

    /// slirp's gateway; ssh endpoints are forwarded host loopback ports; no direct way out.
    async fn guest_network(&self, name: &str) -> Result<Option<crate::GuestNetwork>> {
        Ok(self
            .inner
            .check_name("VM", name)
            .ok()
            .map(|()| crate::GuestNetwork {
                gateway: process::GUEST_GATEWAY.into(),
                ssh_on_host_loopback: true,
                direct_public: false,
            }))
    }

    async fn usage(&self) -> Result<Vec<crate::VmUsage>> {
        let inner = &self.inner;
        let Ok(entries) = std::fs::read_dir(inner.layout.vms()) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !valid_name(&name) {
                continue;
            }
            let Some((cpu_seconds, rss_bytes)) =
                inner.pid(&name).and_then(crate::host::process_usage)
            else {
                continue;
            };
            let net = net::read_counts(&inner.layout.vm_net_stats(&name));
            out.push(crate::VmUsage {
                name,
                cpu_seconds,
                rss_bytes,
                network_rx_bytes: net.map(|n| n.0),
                network_tx_bytes: net.map(|n| n.1),
            });
        }
        Ok(out)
    }

    fn accelerator(&self) -> Option<String> {
        let a = self.accel();
        Some(format!("{:?}: {}", a.accel, a.reason))
    }

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
                "socat",
            ],
            resize: true,
            live_capture: true,
            suspend: true,
            memory_snapshots: true,
            build_stock_image: true,
            host_key: true,
            ssh: true,
            usage: true,
            screen: true,
            instance_types: &[crate::InstanceType::VirtualMachine],
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
        )))?;
        self.inner.end_cut_conversions().await;
        Ok(())
    }

    async fn create(&self, vm: &NewVm) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", &vm.name)?;
        crate::host::check_size(vm.cpus, vm.memory_mib)?;
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
            if !crate::mark::Mark::same_object(&cfg.mark, &vm.uid) {
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
        let pid = inner.pid(name);
        let running = pid.is_some();
        let memory = if running {
            None
        } else {
            inner
                .saved_memory(name)
                .map_err(|e| unreachable(error_chain(&e)))?
        };
        Ok(Some(VmInfo {
            degraded: pid.and_then(|p| {
                inner
                    .memory_in_flight(name)
                    .or_else(|| inner.net_down(name, p))
            }),
            name: cfg.name.clone(),
            mark: Some(cfg.mark.clone()),
            state: match (running, &memory) {
                (true, _) => PowerState::Running,
                (false, Some(_)) => PowerState::Suspended,
                (false, None) => PowerState::Stopped,
            },
            memory,
            inherited: inner.layout.vm_inherited(name).exists(),
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

    async fn start(&self, name: &str) -> Result<()> {
        let (_lock, cfg) = self.inner.locked(name).await?;
        self.inner.boot(&cfg).await
    }

    async fn repair(&self, name: &str) -> Result<()> {
        let (_lock, cfg) = self.inner.locked(name).await?;
        self.inner.memory_repair(name).await?;
        self.inner.restart_net(&cfg).await
    }

    async fn suspend(&self, name: &str) -> Result<()> {
        let (_lock, _cfg) = self.inner.locked(name).await?;
        self.inner.suspend(name).await
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
        crate::host::check_size(size.cpus, size.memory_mib)?;
        let _lock = inner.lock_vm(name).await?;
        let mut cfg = inner
            .load_vm(name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        let Some(change) = cfg.resize_to(size)? else {
            return Ok(());
        };
        if inner.pid(name).is_none() && inner.load_memory(name)?.is_some() {
            return Err(BackendError::Invalid(format!(
                "VM {name} is suspended: its saved memory holds its size; resume it first (or stop it, which discards the memory)"
            )));
        }
        let (machine_change, grow) = (change.machine, change.grow);
        let was_running = inner.pid(name).is_some();
        if was_running && !machine_change {
            // disk only: grow it live, the guest sees a capacity change
            let mut q = inner.qmp(name).await?;
            let (node, _) = inner.live_chain(&mut q, name).await?;
            q.block_resize(&node, size.disk_gib * GIB)
                .await
                .map_err(|e| BackendError::failed(format!("grow the disk of VM {name}"), e))?;
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
                    .disks()
                    .resize(&inner.layout.vm_disk(name, generation), size.disk_gib * GIB)
                    .await
                    .map_err(|e| BackendError::failed(format!("grow the disk of VM {name}"), e))?;
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
        inner.ensure_layout()?;
        inner
            .storage
            .new_image(image, uid, inner.capture_inner(vm, image, uid, false))
            .await
    }

    async fn capture_memory(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", vm)?;
        inner.check_name("image", image)?;
        let _vm_lock = inner.lock_vm(vm).await?;
        inner.ensure_layout()?;
        inner.memory_repair(vm).await?;
        if inner.pid(vm).is_none() {
            return Err(BackendError::Invalid(format!(
                "VM {vm} is not running: its memory can be captured only while it runs (a snapshot without memory takes its disk)"
            )));
        }
        let made = inner
            .storage
            .new_image(image, uid, inner.capture_inner(vm, image, uid, true))
            .await;
        if made.is_err() && inner.storage.load_image(image)?.is_none() {
            inner.image_state(image).remove()?;
        }
        made
    }

    async fn reimage_memory(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        self.reimage_with(vm, image, identity, true).await
    }

    async fn memory_start_refusal(
        &self,
        image: &str,
        cpus: u32,
        memory_mib: u64,
    ) -> Result<Option<String>> {
        if !valid_name(image) {
            return Err(BackendError::Invalid(format!(
                "image name `{image}` is not valid"
            )));
        }
        self.inner.memory_fits(image, cpus, memory_mib)
    }

    async fn inherited(&self, vm: &str) -> Result<Option<crate::Inherited>> {
        if !valid_name(vm) {
            return Ok(None);
        }
        self.inner.inherited(vm)
    }

    async fn identity_taken(&self, vm: &str) -> Result<()> {
        let inner = &self.inner;
        inner.check_name("VM", vm)?;
        let _lock = inner.lock_vm(vm).await?;
        inner.forget_inherited(vm)
    }

    async fn console(&self, vm: &str) -> Result<Option<String>> {
        crate::storage::files::console(&self.inner.layout.vm_serial(vm))
            .map_err(|e| BackendError::failed(format!("read the console of VM {vm}"), e))
    }

    async fn images(&self) -> Result<Vec<ImageInfo>> {
        let mut images = self.inner.storage.images()?;
        for i in &mut images {
            i.memory_bytes = self
                .inner
                .image_state(&i.name)
                .read()
                .ok()
                .flatten()
                .map(|m| m.bytes);
        }
        Ok(images)
    }

    async fn remove_image(&self, image: &str) -> Result<()> {
        self.cleanup_image(image).await
    }

    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        self.reimage_with(vm, image, identity, false).await
    }

    async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        self.inner.ensure_layout()?;
        self.inner.storage.build_image(stock, progress).await
    }

    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.inner.ensure_layout()?;
        self.inner.storage.import_image(path, image, uid).await
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
        inner.storage.remove_image_files(image)?;
        inner.image_state(image).remove()
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
                    .map_err(|e| BackendError::failed(format!("thaw the guest of VM {vm}"), e))?;
            }
            // our capture starts no job other than the stream, which is left to finish
            let jobs = q
                .query_block_jobs()
                .await
                .map_err(|e| BackendError::failed(format!("query the block jobs of VM {vm}"), e))?;
            for j in jobs.iter().filter(|j| j.kind != "stream") {
                q.block_job_cancel(&j.device, true).await.map_err(|e| {
                    BackendError::failed(format!("cancel block job {}", j.device), e)
                })?;
            }
            // paused by a capture (with memory: also `postmigrate` once its copy was made)
            if original == Some(PowerState::Running)
                && let Ok(st) = q.query_status().await
                && (st.status == "paused" || st.status == "postmigrate")
            {
                q.cont()
                    .await
                    .map_err(|e| BackendError::failed(format!("resume VM {vm}"), e))?;
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
        if inner.storage.load_image(image)?.is_none() {
            inner.storage.remove_image_files(image)?;
            inner.image_state(image).remove()?;
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
            .map_err(|e| BackendError::failed(format!("reach the guest agent of VM {name}"), e))?;
        match g.read_file("/etc/ssh/boxery_host_ed25519_key.pub").await {
            Ok(s) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
            Err(qmp::QmpError::Command { .. }) => Ok(None),
            Err(e) => Err(BackendError::failed(
                format!("read the host key of VM {name}"),
                e,
            )),
        }
    }

    /// QMP's `screendump` (PNG) into a file of the VM's directory, read back and removed.
    async fn screendump(&self, name: &str) -> Result<crate::Screen> {
        self.inner.screendump(name).await
    }

    /// QMP's `input-send-event`; a pointer position is scaled by the size the VM's last
    /// screendump showed (one is taken first when this process has none of this run).
    async fn send_input(&self, name: &str, events: &[crate::InputEvent]) -> Result<()> {
        self.inner.send_input(name, events).await
    }

    /// QEMU's VNC server on the VM's own socket (`vms/NAME/vnc.sock`).
    async fn console_vnc(&self, name: &str) -> Result<tokio::net::UnixStream> {
        self.inner.console_vnc(name).await
    }

    /// The last line of `qemu-run.log` (QEMU's stderr since its last start).
    async fn last_exit(&self, name: &str) -> Option<String> {
        if self.inner.pid(name).is_some() {
            return None;
        }
        let log = std::fs::read_to_string(self.inner.layout.vm_run_log(name)).ok()?;
        crate::last_words(&log)
    }
}
