//! The `libvirt` backend: domains, a storage pool and an nwfilter of boxery's own on a
//! libvirtd, through the `virt` crate (cargo feature `libvirt`; needs `libvirt-dev`).
//!
//! # Design
//! - **Namespace.** Every domain is named `bx-<ns>-<vm>` and carries a metadata element
//!   (`https://boxery.dev/xmlns/libvirt/vm/1`) with the namespace id `<ns>` and the VM's record
//!   (owning uid, UUID, MAC, size, base, instance-id, pinned host key). `<ns>` is 8 hex digits
//!   of the state directory's path, so two control planes on one libvirtd never see each
//!   other's domains. A domain without both the prefix and the mark is never read, listed or
//!   touched. The defined domain is the VM's **commit point**.
//! - **Disks.** qcow2 files in a `dir` storage pool of ours (`boxery-<ns>`, at
//!   `BOXERY_LIBVIRT_POOL_DIR`, default `/var/lib/libvirt/images/boxery-<ns>`, reachable by
//!   the `libvirt-qemu` user). Bases `base-<id>.qcow2` (0444, with the kernel and initrd beside
//!   them), images `img-<name>.qcow2`, VM disks `vm-<name>-<gen>.qcow2`, seeds
//!   `vm-<name>-seed.iso`. Every image and every new VM disk is **one overlay on a read-only
//!   base**. Nothing ever block-commits (the trap: `blockcommit --active` without
//!   `--shallow`/`--base` rewrites the shared base).
//! - **Capture of a running VM**: an external disk-only snapshot (`--no-metadata --atomic`,
//!   `--quiesce` through the guest agent when the image has one): the guest writes a new
//!   overlay from then on, and the old one, frozen, is hard-linked as the image (copied and
//!   rebased onto the base when it is deeper than one overlay). The VM runs on a two-deep chain
//!   until its next cold start, which pulls the frozen layer's data into its overlay
//!   (`qemu-img rebase`). **Stopped VM**: a copy of its overlay.
//! - **New VM from an image, reimage**: a copy (`cp --reflink=auto`) of the image's overlay,
//!   so the VM never depends on the image.
//! - **Network**: one NIC on the libvirt network `BOXERY_LIBVIRT_NETWORK` (`default`, NAT) with
//!   the nwfilter `boxery-guest-isolation` ([`xml::isolation_filter`]). ssh goes from the host
//!   to the guest's DHCP address on that network (`VmInfo.ssh` = `192.168.122.x:22`), the only
//!   inbound connection the filter allows. No user-mode (passt/slirp) NIC: passt maps the
//!   gateway to the host's loopback, which would route around the filter.
//!
//! # Caveats
//! - Calls into libvirt block the calling thread for the length of one libvirt RPC.
//! - A running VM captured N times runs on a chain N+1 deep until its next cold start.

pub mod xml;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tracing::{info, warn};
use virt::connect::Connect;
use virt::domain::Domain;

use crate::qemu::disk::{Disks, GIB, allocated_bytes};
use crate::qemu::layout::{
    FileLock, read_json, remove_file_if_exists, remove_temps, valid_name, write_atomic, write_json,
};
use crate::qemu::process::{Accel, detect_accel};
use crate::qemu::records::{BaseRecord, ImageRecord, Manifest, VmConfig};
use crate::qemu::{config::QemuConfig, seed};
use crate::{
    Backend, BackendError, Capabilities, Identity, ImageInfo, NewVm, PowerState, Progress, Result,
    Stability, VmInfo, VmSize,
};

const BACKEND: &str = "libvirt";

// libvirt flag values (libvirt-domain.h), named here because virt 0.5 takes raw u32s
const META_ELEMENT: i32 = 2; // VIR_DOMAIN_METADATA_ELEMENT
const AFFECT_LIVE: u32 = 1; // VIR_DOMAIN_AFFECT_LIVE
const META_KEY: &str = "boxery"; // the namespace prefix of our metadata element
const SNAP_NO_METADATA: u32 = 1 << 2;
const SNAP_DISK_ONLY: u32 = 1 << 4;
const SNAP_QUIESCE: u32 = 1 << 6;
const SNAP_ATOMIC: u32 = 1 << 7;
const ADDR_SRC_LEASE: u32 = 0; // VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
const BLOCK_RESIZE_BYTES: u32 = 1;
const LIST_ALL: u32 = 0;

/// The libvirt backend's settings (environment).
#[derive(Debug, Clone)]
pub struct LibvirtConfig {
    /// Connection URI (`BOXERY_LIBVIRT_URI`, default `qemu:///system`).
    pub uri: String,
    /// The libvirt network of the guests' NIC (`BOXERY_LIBVIRT_NETWORK`, default `default`).
    pub network: String,
    /// The pool directory (`BOXERY_LIBVIRT_POOL_DIR`); `None`: `/var/lib/libvirt/images/boxery-<ns>`.
    pub pool_dir: Option<PathBuf>,
    /// Reference the isolation filter on every NIC (`BOXERY_NET_ISOLATION=off` turns it off).
    pub isolation: bool,
    /// Seconds a guest gets to power off on the ACPI button (`BOXERY_LIBVIRT_POWERDOWN_TIMEOUT`).
    pub powerdown_timeout: Duration,
    /// Domain type: `kvm` when KVM really works, else `qemu` (`BOXERY_LIBVIRT_ACCEL` =
    /// `kvm`/`tcg`/`auto`, the qemu backend's detection).
    pub kind: &'static str,
    /// Why that domain type.
    pub kind_reason: String,
    /// Tools, image builders and cache (shared with the qemu backend's settings).
    pub qemu: QemuConfig,
}

impl LibvirtConfig {
    /// Settings from the environment.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let accel = detect_accel(var("BOXERY_LIBVIRT_ACCEL").as_deref());
        LibvirtConfig {
            uri: var("BOXERY_LIBVIRT_URI").unwrap_or_else(|| "qemu:///system".into()),
            network: var("BOXERY_LIBVIRT_NETWORK").unwrap_or_else(|| "default".into()),
            pool_dir: var("BOXERY_LIBVIRT_POOL_DIR").map(PathBuf::from),
            isolation: var("BOXERY_NET_ISOLATION").as_deref() != Some("off"),
            powerdown_timeout: Duration::from_secs(
                var("BOXERY_LIBVIRT_POWERDOWN_TIMEOUT")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(60),
            ),
            kind: if accel.accel == Accel::Kvm {
                "kvm"
            } else {
                "qemu"
            },
            kind_reason: accel.reason,
            qemu: QemuConfig::from_env(),
        }
    }
}

/// The libvirt backend.
#[derive(Debug, Clone)]
pub struct LibvirtBackend {
    dir: PathBuf,
    ns: String,
    pool_dir: PathBuf,
    config: LibvirtConfig,
    disks: Disks,
}

fn lv_failed(step: impl Into<String>, e: virt::error::Error) -> BackendError {
    BackendError::failed(step, e.to_string())
}

fn unreachable(message: impl Into<String>) -> BackendError {
    BackendError::Unreachable {
        backend: BACKEND.into(),
        message: message.into(),
    }
}

fn not_found(what: impl Into<String>) -> BackendError {
    BackendError::NotFound {
        backend: BACKEND.into(),
        what: what.into(),
    }
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackendError {
    let context = context.into();
    move |source| BackendError::io(context, source)
}

fn is_code(e: &virt::error::Error, code: virt::error::ErrorNumber) -> bool {
    e.code().is(code)
}

/// 8 hex digits of FNV-1a over `s`: a stable namespace id for a state directory.
pub fn namespace_of(s: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{:08x}", (h ^ (h >> 32)) as u32)
}

/// A VM as read from its domain.
struct Dom {
    dom: Domain,
    cfg: VmConfig,
}

impl LibvirtBackend {
    /// A backend with its state in `dir` (`$BOXERY_HOME/libvirt`), settings from the environment.
    pub fn new(dir: PathBuf) -> Self {
        Self::with_config(dir, LibvirtConfig::from_env())
    }

    /// A backend with explicit settings.
    pub fn with_config(dir: PathBuf, config: LibvirtConfig) -> Self {
        // libvirt prints every error to stderr by default (`libvirt: QEMU Driver error : Domain
        // not found…` for an expected lookup miss); errors come back as values and are
        // reported by the caller, so silence the printer once for the process.
        static QUIET: std::sync::Once = std::sync::Once::new();
        QUIET.call_once(virt::error::clear_error_callback);
        let abs = std::path::absolute(&dir).unwrap_or_else(|_| dir.clone());
        let ns = namespace_of(&abs.to_string_lossy());
        let pool_dir = config
            .pool_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("/var/lib/libvirt/images/boxery-{ns}")));
        let disks = Disks::new(config.qemu.qemu_img.clone());
        LibvirtBackend {
            dir: abs,
            ns,
            pool_dir,
            config,
            disks,
        }
    }

    /// The namespace id (in domain names `bx-<ns>-<vm>` and in the metadata mark).
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// The storage pool's directory.
    pub fn pool_dir(&self) -> &Path {
        &self.pool_dir
    }

    /// Its settings.
    pub fn config(&self) -> &LibvirtConfig {
        &self.config
    }

    /// The libvirt domain name of VM `name`.
    pub fn domain_name(&self, name: &str) -> String {
        format!("bx-{}-{name}", self.ns)
    }

    /// The storage pool's name.
    pub fn pool_name(&self) -> String {
        format!("boxery-{}", self.ns)
    }

    fn conn(&self) -> Result<Connect> {
        Connect::open(Some(&self.config.uri)).map_err(|e| {
            unreachable(format!(
                "cannot connect to libvirtd at {}: {e} (start it: scripts/libvirtd.sh start, or `systemctl start libvirtd`)",
                self.config.uri
            ))
        })
    }

    fn locks(&self) -> PathBuf {
        self.dir.join("locks")
    }
    fn images_dir(&self) -> PathBuf {
        self.dir.join("images")
    }
    fn bases_dir(&self) -> PathBuf {
        self.dir.join("bases")
    }
    fn seed_work(&self, name: &str) -> PathBuf {
        self.dir.join("seeds").join(name)
    }
    fn vm_disk(&self, name: &str, generation: u64) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-{generation}.qcow2"))
    }
    fn vm_seed(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-seed.iso"))
    }
    fn vm_serial(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!("vm-{name}-serial.log"))
    }
    fn image_disk(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!("img-{name}.qcow2"))
    }
    fn image_part(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!(".img-{name}.part"))
    }

    /// `.img-<name>.copy`: a stopped VM's disk being copied for a capture.
    fn image_copy(&self, name: &str) -> PathBuf {
        self.pool_dir.join(format!(".img-{name}.copy"))
    }
    fn image_record(&self, name: &str) -> PathBuf {
        self.images_dir().join(format!("{name}.json"))
    }
    fn base_disk(&self, id: &str) -> PathBuf {
        self.pool_dir.join(format!("base-{id}.qcow2"))
    }

    fn ensure_dirs(&self) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for d in [
            self.dir.clone(),
            self.locks(),
            self.images_dir(),
            self.bases_dir(),
            self.dir.join("seeds"),
        ] {
            std::fs::create_dir_all(&d).map_err(io(format!("creating {}", d.display())))?;
        }
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod the state directory"))?;
        std::fs::create_dir_all(&self.pool_dir).map_err(io(format!(
            "creating the pool directory {}",
            self.pool_dir.display()
        )))?;
        // QEMU runs as libvirt-qemu: it must traverse the directory, not list it
        std::fs::set_permissions(&self.pool_dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod the pool directory"))
    }

    async fn lock(&self, what: &str) -> Result<FileLock> {
        self.ensure_dirs()?;
        FileLock::acquire(self.locks().join(format!("{what}.lock")))
            .await
            .map_err(io(format!("locking {what}")))
    }

    fn check_name(&self, what: &str, name: &str) -> Result<()> {
        if valid_name(name) {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "{what} name `{name}` is not valid for the libvirt backend: use 1-63 of a-z, 0-9, '-' and '.'"
            )))
        }
    }

    /// Our domain `name`, or `None` when there is none or it is not ours (never touched).
    fn lookup(&self, conn: &Connect, name: &str) -> Result<Option<Dom>> {
        let dom = match conn.lookup_domain_by_name(&self.domain_name(name)) {
            Ok(d) => d,
            Err(e) if is_code(&e, virt::error::ErrorNumber::NoDomain) => return Ok(None),
            Err(e) => {
                return Err(unreachable(format!(
                    "looking up domain {}: {e}",
                    self.domain_name(name)
                )));
            }
        };
        Ok(self.ours(dom))
    }

    /// `Some` when `dom` carries our mark for this namespace.
    fn ours(&self, dom: Domain) -> Option<Dom> {
        let meta = dom.metadata(META_ELEMENT, Some(xml::META_URI), 0).ok()?;
        let (ns, cfg) = xml::parse_metadata(&meta)?;
        // The metadata names the VM: only a valid name that is this very domain's counts (a
        // domain defined by hand with our mark must not point boxery at other paths).
        let named_here = crate::qemu::layout::valid_name(&cfg.name)
            && dom.name().is_ok_and(|d| d == self.domain_name(&cfg.name));
        (ns == self.ns && named_here).then_some(Dom { dom, cfg })
    }

    fn load_image(&self, name: &str) -> Result<Option<ImageRecord>> {
        read_json(&self.image_record(name))
            .map_err(io(format!("reading the record of image {name}")))
    }

    fn load_base(&self, id: &str) -> Result<BaseRecord> {
        read_json(&self.bases_dir().join(format!("{id}.json")))
            .map_err(io(format!("reading base {id}")))?
            .ok_or_else(|| {
                BackendError::failed(
                    "find the base",
                    format!(
                        "base {id} is not registered in {}",
                        self.bases_dir().display()
                    ),
                )
            })
    }

    fn generations(&self, name: &str) -> Result<Vec<u64>> {
        let prefix = format!("vm-{name}-");
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(&self.pool_dir) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => {
                return Err(BackendError::io(
                    format!("reading {}", self.pool_dir.display()),
                    e,
                ));
            }
        };
        for e in rd.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if let Some(g) = f
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".qcow2"))
                .and_then(|g| g.parse().ok())
            {
                out.push(g);
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    fn gateway(&self, conn: &Connect) -> Result<String> {
        let net = conn
            .lookup_network_by_name(&self.config.network)
            .map_err(|e| lv_failed(format!("find libvirt network {}", self.config.network), e))?;
        let x = net
            .xml_desc(0)
            .map_err(|e| lv_failed("read the network", e))?;
        xml::network_gateway(&x).ok_or_else(|| {
            BackendError::Invalid(format!(
                "libvirt network {} has no IPv4 address: boxery needs a NAT network with DHCP",
                self.config.network
            ))
        })
    }

    fn domain_xml(&self, conn: &Connect, cfg: &VmConfig, disk: &Path) -> Result<String> {
        let base = self.load_base(&cfg.base)?;
        let gw = self.gateway(conn)?;
        let boot = &base.boot;
        let p = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| self.pool_dir.join(p).to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        Ok(xml::domain(&xml::DomainSpec {
            domain: &self.domain_name(&cfg.name),
            kind: self.config.kind,
            ns: &self.ns,
            cfg,
            disk: &disk.to_string_lossy(),
            seed: &self.vm_seed(&cfg.name).to_string_lossy(),
            kernel: &p(&boot.kernel),
            initrd: &p(&boot.initrd),
            cmdline: boot.cmdline.as_deref().unwrap_or(""),
            machine: boot.machine.as_deref().unwrap_or("q35"),
            serial: &self.vm_serial(&cfg.name).to_string_lossy(),
            network: &self.config.network,
            gateway: &gw,
            isolation: self.config.isolation,
        }))
    }

    fn define(&self, conn: &Connect, cfg: &VmConfig, disk: &Path) -> Result<Domain> {
        let x = self.domain_xml(conn, cfg, disk)?;
        conn.define_domain_xml(&x)
            .map_err(|e| lv_failed(format!("define the domain of VM {}", cfg.name), e))
    }

    fn active_disk(&self, d: &Dom) -> Result<PathBuf> {
        let x = d
            .dom
            .xml_desc(0)
            .map_err(|e| lv_failed("read the domain XML", e))?;
        xml::vda_source(&x).map(PathBuf::from).ok_or_else(|| {
            BackendError::failed("find the disk", format!("VM {} has no vda", d.cfg.name))
        })
    }

    fn is_running(d: &Dom) -> bool {
        d.dom.is_active().unwrap_or(false)
    }

    /// Pull any frozen layers of a stopped VM into its active overlay, then drop them: the VM is
    /// one overlay deep on its base again.
    async fn flatten(&self, d: &Dom) -> Result<()> {
        let active = self.active_disk(d)?;
        let base = self.base_disk(&d.cfg.base);
        let chain = self
            .disks
            .chain(&active)
            .await
            .map_err(|e| BackendError::failed("read the disk chain", e.to_string()))?;
        if chain.len() > 2 {
            self.disks.rebase(&active, &base).await.map_err(|e| {
                BackendError::failed(
                    format!("pull the layers of VM {} into its disk", d.cfg.name),
                    e.to_string(),
                )
            })?;
        }
        self.remove_stale_generations(&d.cfg.name, &active)
    }

    fn remove_stale_generations(&self, name: &str, active: &Path) -> Result<()> {
        for g in self.generations(name)? {
            let p = self.vm_disk(name, g);
            if p != active {
                remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
            }
        }
        Ok(())
    }

    async fn boot(&self, conn: &Connect, d: &Dom) -> Result<()> {
        if Self::is_running(d) {
            return Ok(());
        }
        self.flatten(d).await?;
        // regenerate the XML (filter, accel, size) before every cold start
        let active = self.active_disk(d)?;
        self.define(conn, &d.cfg, &active)?;
        d.dom
            .create()
            .map_err(|e| lv_failed(format!("start VM {}", d.cfg.name), e))
    }

    async fn shutdown(&self, d: &Dom, graceful: bool) -> Result<()> {
        if !Self::is_running(d) {
            return Ok(());
        }
        if graceful && d.dom.shutdown().is_ok() {
            let deadline = Instant::now() + self.config.powerdown_timeout;
            while Instant::now() < deadline {
                if !Self::is_running(d) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            warn!(
                vm = d.cfg.name.as_str(),
                "no ACPI power-off in time; destroying"
            );
        }
        match d.dom.destroy() {
            Ok(()) => Ok(()),
            Err(_) if !Self::is_running(d) => Ok(()),
            Err(e) => Err(lv_failed(format!("stop VM {}", d.cfg.name), e)),
        }
    }

    /// Remove VM `name`'s domain (when ours) and every file of it.
    async fn destroy(&self, name: &str) -> Result<()> {
        let conn = self.conn()?;
        if let Some(d) = self.lookup(&conn, name)? {
            self.shutdown(&d, false).await?;
            d.dom
                .undefine()
                .or_else(|e| {
                    if is_code(&e, virt::error::ErrorNumber::NoDomain) {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| lv_failed(format!("undefine the domain of VM {name}"), e))?;
        }
        for g in self.generations(name)? {
            remove_file_if_exists(&self.vm_disk(name, g)).map_err(io("removing a VM disk"))?;
        }
        for p in [self.vm_seed(name), self.vm_serial(name)] {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        // a create killed mid-copy leaves `.vm-NAME-G.qcow2.tmp-PID` or the seed's temp
        let (prefix, seed) = (format!("vm-{name}-"), format!("vm-{name}-seed.iso"));
        remove_temps(&self.pool_dir, |f| {
            f == seed
                || f.strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(".qcow2"))
                    .is_some_and(|g| g.parse::<u64>().is_ok())
        })
        .map_err(io(format!("removing temp files of VM {name}")))?;
        let _ = std::fs::remove_dir_all(self.seed_work(name));
        self.refresh_pool(&conn);
        Ok(())
    }

    fn refresh_pool(&self, conn: &Connect) {
        if let Ok(p) = conn.lookup_storage_pool_by_name(&self.pool_name()) {
            let _ = p.refresh(0);
        }
    }

    async fn write_seed(&self, name: &str, instance_id: &str, identity: &Identity) -> Result<()> {
        seed::write_seed_iso(
            &self.config.qemu.genisoimage,
            name,
            instance_id,
            identity,
            &self.seed_work(name),
            &self.vm_seed(name),
        )
        .await
        .map_err(|e| BackendError::failed(format!("write the seed of VM {name}"), chain(&e)))
    }

    fn with_host_key(name: &str, identity: &Identity) -> Result<Identity> {
        let mut id = identity.clone();
        if id.hostname.is_empty() {
            id.hostname = name.replace('.', "-");
        }
        if id.host_key.is_none() {
            id.host_key = Some(
                crate::identity::host_key(name, &format!("{name}.boxery"))
                    .map_err(|e| BackendError::failed("make a host key", e.to_string()))?,
            );
        }
        Ok(id)
    }

    /// Copy image `image`'s overlay to `dst`, grown to `bytes`; returns the image record.
    async fn copy_image(&self, image: &str, dst: &Path, bytes: u64) -> Result<ImageRecord> {
        let rec = self
            .load_image(image)?
            .ok_or_else(|| not_found(format!("image {image}")))?;
        let src = self.image_disk(image);
        if !src.exists() {
            return Err(not_found(format!("the disk of image {image}")));
        }
        let tmp = crate::qemu::layout::temp_path(dst);
        self.disks
            .copy(&src, &tmp)
            .await
            .map_err(|e| BackendError::failed(format!("copy image {image}"), e.to_string()))?;
        set_mode(&tmp, 0o600)?;
        if bytes > rec.virtual_size {
            self.disks
                .resize(&tmp, bytes)
                .await
                .map_err(|e| BackendError::failed("grow the disk", e.to_string()))?;
        }
        std::fs::rename(&tmp, dst).map_err(io(format!("renaming {}", dst.display())))?;
        Ok(rec)
    }

    async fn create_inner(&self, conn: &Connect, vm: &NewVm) -> Result<()> {
        let crate::DiskSource::Image(image) = &vm.source;
        let disk = self.vm_disk(&vm.name, 1);
        let rec = self.copy_image(image, &disk, vm.disk_gib * GIB).await?;
        let base = self.load_base(&rec.base)?;
        if vm.memory_mib < 64 || vm.cpus == 0 {
            return Err(BackendError::Invalid(format!(
                "VM {}: at least 1 CPU and 64 MiB",
                vm.name
            )));
        }
        let (host_cpus, host_mib) = crate::qemu::process::host_capacity();
        if vm.cpus > host_cpus || vm.memory_mib > host_mib {
            return Err(BackendError::Invalid(format!(
                "VM {} asks for {} CPUs and {} MiB; this host has {host_cpus} CPUs and {host_mib} MiB",
                vm.name, vm.cpus, vm.memory_mib
            )));
        }
        let identity = Self::with_host_key(&vm.name, &vm.identity)?;
        let instance_id = format!("iid-{}", uuid::Uuid::new_v4());
        self.write_seed(&vm.name, &instance_id, &identity).await?;
        let b: [u8; 3] = rand::random();
        let cfg = VmConfig {
            name: vm.name.clone(),
            mark: vm.uid.clone(),
            uuid: uuid::Uuid::new_v4().to_string(),
            mac: format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2]),
            port: 22,
            cpus: vm.cpus,
            memory_mib: vm.memory_mib,
            disk_gib: vm.disk_gib.max(rec.virtual_size.div_ceil(GIB)),
            base: base.id.clone(),
            instance_id,
            hostname: identity.hostname.clone(),
            host_key: identity
                .host_key
                .as_ref()
                .map(|(_, p)| p.trim().to_string()),
            image: image.clone(),
            created: chrono::Utc::now(),
        };
        let dom = self.define(conn, &cfg, &disk)?;
        self.refresh_pool(conn);
        if vm.start {
            dom.create()
                .map_err(|e| lv_failed(format!("start VM {}", vm.name), e))?;
        }
        Ok(())
    }

    /// The guest's address on its network, from the DHCP lease.
    fn lease_address(d: &Dom) -> Option<String> {
        let ifs = d.dom.interface_addresses(ADDR_SRC_LEASE, 0).ok()?;
        ifs.iter()
            .filter(|i| {
                i.hwaddr
                    .as_deref()
                    .is_none_or(|h| h.eq_ignore_ascii_case(&d.cfg.mac))
            })
            .flat_map(|i| i.addrs.iter())
            .find(|a| a.typed == 0)
            .map(|a| a.addr.clone())
    }

    fn info(&self, d: &Dom) -> VmInfo {
        let running = Self::is_running(d);
        let used = self
            .generations(&d.cfg.name)
            .unwrap_or_default()
            .iter()
            .map(|g| allocated_bytes(&self.vm_disk(&d.cfg.name, *g)))
            .sum();
        VmInfo {
            name: d.cfg.name.clone(),
            mark: Some(d.cfg.mark.clone()),
            state: if running {
                PowerState::Running
            } else {
                PowerState::Stopped
            },
            size: VmSize {
                cpus: d.cfg.cpus,
                memory_mib: d.cfg.memory_mib,
                disk_gib: d.cfg.disk_gib,
            },
            ssh: running
                .then(|| Self::lease_address(d))
                .flatten()
                .map(|a| format!("{a}:22")),
            disk_used_bytes: Some(used),
        }
    }

    fn save_cfg(&self, conn: &Connect, d: &Dom, cfg: &VmConfig) -> Result<()> {
        // the persistent definition carries the record; a running domain gets the new metadata
        // live too (the rest applies at its next cold start)
        let active = self.active_disk(d)?;
        self.define(conn, cfg, &active)?;
        if Self::is_running(d) {
            d.dom
                .set_metadata(
                    META_ELEMENT,
                    Some(&xml::metadata(&self.ns, cfg)),
                    Some(META_KEY),
                    Some(xml::META_URI),
                    AFFECT_LIVE,
                )
                .map_err(|e| lv_failed(format!("update the live record of VM {}", cfg.name), e))?;
        }
        Ok(())
    }

    /// Publish `part` as image `image` (record first, then the disk's name).
    fn publish(
        &self,
        image: &str,
        uid: &str,
        base: &str,
        source: String,
        virtual_size: u64,
    ) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let part = self.image_part(image);
        std::fs::set_permissions(&part, std::fs::Permissions::from_mode(0o444))
            .map_err(io("chmod the image"))?;
        std::fs::rename(&part, self.image_disk(image)).map_err(io("publishing the image disk"))?;
        let rec = ImageRecord {
            name: image.into(),
            mark: uid.into(),
            base: base.into(),
            source,
            virtual_size,
            created: chrono::Utc::now(),
        };
        write_json(&self.image_record(image), &rec, 0o600)
            .map_err(io(format!("writing the record of image {image}")))
    }

    fn remove_image_files(&self, image: &str) -> Result<()> {
        remove_file_if_exists(&self.image_record(image)).map_err(io("removing an image record"))?;
        for p in [
            self.image_disk(image),
            self.image_part(image),
            self.image_copy(image),
        ] {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        let (record, disk) = (format!("{image}.json"), format!("img-{image}.qcow2"));
        remove_temps(&self.images_dir(), |f| f == record)
            .and_then(|()| remove_temps(&self.pool_dir, |f| f == disk))
            .map_err(io(format!("removing temp files of image {image}")))
    }

    async fn capture_inner(&self, conn: &Connect, vm: &str, image: &str, uid: &str) -> Result<()> {
        let d = self
            .lookup(conn, vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let base = self.load_base(&d.cfg.base)?;
        let base_disk = self.base_disk(&base.id);
        let active = self.active_disk(&d)?;
        let part = self.image_part(image);
        let _ = remove_file_if_exists(&part);
        let frozen = if Self::is_running(&d) {
            let next = self.generations(vm)?.last().copied().unwrap_or(0) + 1;
            let new = self.vm_disk(vm, next);
            let snap = xml::disk_snapshot(&new.to_string_lossy());
            let flags = SNAP_DISK_ONLY | SNAP_NO_METADATA | SNAP_ATOMIC;
            let quiesced = base.guest_agent
                && d.dom
                    .create_snapshot_xml(&snap, flags | SNAP_QUIESCE)
                    .is_ok();
            if !quiesced {
                d.dom
                    .create_snapshot_xml(&snap, flags)
                    .map_err(|e| lv_failed(format!("snapshot the disk of VM {vm}"), e))?;
            }
            active
        } else {
            // stopped: copy its overlay (below)
            let tmp = self.image_copy(image);
            self.disks.copy(&active, &tmp).await.map_err(|e| {
                BackendError::failed(format!("copy the disk of VM {vm}"), e.to_string())
            })?;
            std::fs::rename(&tmp, &part).map_err(io("renaming the image copy"))?;
            part.clone()
        };
        if frozen != part {
            let chain = self
                .disks
                .chain(&frozen)
                .await
                .map_err(|e| BackendError::failed("read the disk chain", e.to_string()))?;
            if chain.len() <= 2 && std::fs::hard_link(&frozen, &part).is_ok() {
                // one overlay on the base, never written again: share it
            } else {
                self.disks.copy(&frozen, &part).await.map_err(|e| {
                    BackendError::failed(format!("copy the frozen disk of VM {vm}"), e.to_string())
                })?;
            }
        }
        let chain = self
            .disks
            .chain(&part)
            .await
            .map_err(|e| BackendError::failed("read the image chain", e.to_string()))?;
        if chain.len() > 2 {
            set_mode(&part, 0o600)?;
            self.disks.rebase(&part, &base_disk).await.map_err(|e| {
                BackendError::failed("rebase the image onto its base", e.to_string())
            })?;
        }
        let size = self
            .disks
            .info(&part)
            .await
            .map(|i| i.virtual_size)
            .unwrap_or(d.cfg.disk_gib * GIB);
        self.publish(image, uid, &base.id, format!("vm:{vm}"), size)?;
        self.refresh_pool(conn);
        Ok(())
    }

    /// Register a builder's output (`OUT/<name>.json`) as a read-only base in the pool; returns
    /// its id. Idempotent.
    pub async fn register_base(&self, manifest: &Path) -> Result<String> {
        self.ensure_dirs()?;
        let m: Manifest = read_json(manifest)
            .map_err(io(format!("reading {}", manifest.display())))?
            .ok_or_else(|| {
                BackendError::Invalid(format!("{} does not exist", manifest.display()))
            })?;
        let hash = m
            .input_hash
            .clone()
            .or(m.disk_sha256.clone())
            .unwrap_or_else(|| namespace_of(&manifest.to_string_lossy()));
        crate::qemu::images::check_manifest_files(
            manifest,
            Path::new(&m.disk),
            m.kernel.as_deref().map(Path::new),
            m.initrd.as_deref().map(Path::new),
        )?;
        crate::qemu::images::check_machine(manifest, m.machine.as_deref())?;
        let id = crate::qemu::images::base_id(manifest, &m.name, &hash)?;
        let _lock = self.lock(&format!("base-{id}")).await?;
        let rec_path = self.bases_dir().join(format!("{id}.json"));
        if rec_path.exists() {
            return Ok(id);
        }
        let dir = manifest.parent().unwrap_or(Path::new("."));
        let copy = |src: &Path, dst: PathBuf| -> Result<()> {
            let tmp = crate::qemu::layout::temp_path(&dst);
            let st = std::process::Command::new("cp")
                .arg("--reflink=auto")
                .arg(src)
                .arg(&tmp)
                .status()
                .map_err(io("running cp"))?;
            if !st.success() {
                return Err(BackendError::failed(
                    "copy the base",
                    format!("cp {} failed", src.display()),
                ));
            }
            set_mode(&tmp, 0o444)?;
            std::fs::rename(&tmp, &dst).map_err(io("renaming the base"))
        };
        copy(&dir.join(&m.disk), self.base_disk(&id))?;
        let mut boot = crate::qemu::process::Boot {
            cmdline: m.cmdline.clone(),
            machine: m.machine.clone(),
            ..Default::default()
        };
        if let Some(k) = &m.kernel {
            copy(
                &dir.join(k),
                self.pool_dir.join(format!("base-{id}.vmlinuz")),
            )?;
            boot.kernel = Some(PathBuf::from(format!("base-{id}.vmlinuz")));
        }
        if let Some(i) = &m.initrd {
            copy(
                &dir.join(i),
                self.pool_dir.join(format!("base-{id}.initrd")),
            )?;
            boot.initrd = Some(PathBuf::from(format!("base-{id}.initrd")));
        }
        let size = self
            .disks
            .info(&self.base_disk(&id))
            .await
            .map(|i| i.virtual_size)
            .unwrap_or(GIB);
        let rec = BaseRecord {
            id: id.clone(),
            stock: m.name.clone(),
            boot,
            guest_agent: m.guest_agent,
            hash,
            virtual_size: size,
            created: chrono::Utc::now(),
        };
        write_json(&rec_path, &rec, 0o600).map_err(io("writing the base record"))?;
        Ok(id)
    }

    async fn image_from_base(
        &self,
        image: &str,
        uid: &str,
        base: &str,
        source: String,
    ) -> Result<()> {
        let _lock = self.lock(&format!("image-{image}")).await?;
        if let Some(rec) = self.load_image(image)? {
            return same_image(rec, uid);
        }
        let rec = self.load_base(base)?;
        let part = self.image_part(image);
        let _ = remove_file_if_exists(&part);
        self.disks
            .create_overlay(&part, &self.base_disk(base), None)
            .await
            .map_err(|e| BackendError::failed("create the image overlay", e.to_string()))?;
        self.publish(image, uid, base, source, rec.virtual_size)?;
        if let Ok(c) = self.conn() {
            self.refresh_pool(&c);
        }
        Ok(())
    }
}

fn set_mode(p: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {}", p.display())))
}

fn same_image(rec: ImageRecord, uid: &str) -> Result<()> {
    if crate::mark::Mark::same_object(&rec.mark, uid) {
        Ok(())
    } else {
        Err(BackendError::Invalid(format!(
            "an image named {} already exists in the libvirt backend for another object (uid {}): pick another name",
            rec.name, rec.mark
        )))
    }
}

#[async_trait]
impl Backend for LibvirtBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: BACKEND,
            stability: Stability::Experimental,
            platforms: &["linux-x86_64"],
            requirements: &[
                "libvirt >= 9 (libvirt-daemon-system, libvirt-clients; Debian 12: 11.3 from bookworm-backports)",
                "qemu-system-x86 >= 8, qemu-utils",
                "dnsmasq-base, iptables, ebtables (the NAT network and its nwfilter)",
                "genisoimage, openssh-client",
                "libvirt-dev and pkg-config to build",
            ],
            resize: true,
            live_capture: true,
            build_stock_image: true,
            host_key: true,
            ssh: true,
        }
    }

    async fn check(&self) -> Result<()> {
        let conn = self.conn()?;
        conn.hyp_version().map_err(|e| {
            unreachable(format!(
                "libvirtd at {} does not answer: {e}",
                self.config.uri
            ))
        })?;
        for tool in [&self.config.qemu.qemu_img, &self.config.qemu.genisoimage] {
            if std::process::Command::new(tool)
                .arg("--version")
                .output()
                .is_err()
            {
                return Err(BackendError::Invalid(format!(
                    "{} is missing: run scripts/install-deps.sh",
                    tool.display()
                )));
            }
        }
        Ok(())
    }

    /// Idempotent, and safe to run from several processes at once: this home's (a `serve`
    /// and a CLI `--wait`) take turns; the filter and network, shared with other homes, count
    /// as done when another process got there first.
    async fn init(&self) -> Result<()> {
        let _lock = self.lock("init").await?;
        let conn = self.conn()?;
        // the pool
        let pool = match conn.lookup_storage_pool_by_name(&self.pool_name()) {
            Ok(p) => p,
            Err(_) => conn
                .define_storage_pool_xml(
                    &xml::pool(&self.pool_name(), &self.pool_dir.to_string_lossy()),
                    0,
                )
                .map_err(|e| lv_failed("define the storage pool", e))?,
        };
        if !pool.is_active().unwrap_or(false)
            && let Err(e) = pool.create(0)
            && !pool.is_active().unwrap_or(false)
        {
            return Err(lv_failed("start the storage pool", e));
        }
        let _ = pool.set_autostart(true);
        // the filter (redefined with its UUID, so domains using it pick up changes)
        // defined when missing; redefining it while guests run re-instantiates every guest's
        // rules, so a changed filter is applied by `virsh nwfilter-define` on purpose
        if conn.lookup_nwfilter_by_name(xml::FILTER).is_err()
            && let Err(e) = conn.define_nwfilter_xml(&xml::isolation_filter(None))
            && conn.lookup_nwfilter_by_name(xml::FILTER).is_err()
        {
            return Err(lv_failed("define the nwfilter boxery-guest-isolation", e));
        }
        // the network
        let net = conn.lookup_network_by_name(&self.config.network).map_err(|e| {
            BackendError::Invalid(format!("libvirt network {} does not exist ({e}): define it (`virsh net-define`) or set BOXERY_LIBVIRT_NETWORK", self.config.network))
        })?;
        if !net.is_active().unwrap_or(false)
            && let Err(e) = net.create()
            && !net.is_active().unwrap_or(false)
        {
            return Err(lv_failed(
                format!("start libvirt network {}", self.config.network),
                e,
            ));
        }
        let _ = net.set_autostart(true);
        Ok(())
    }

    async fn create(&self, vm: &NewVm) -> Result<()> {
        self.check_name("VM", &vm.name)?;
        let _lock = self.lock(&format!("vm-{}", vm.name)).await?;
        let conn = self.conn()?;
        if let Some(d) = self.lookup(&conn, &vm.name)? {
            if !crate::mark::Mark::same_object(&d.cfg.mark, &vm.uid) {
                return Err(BackendError::Invalid(format!(
                    "a VM named {} already exists in the libvirt backend for another object (uid {}): pick another name",
                    vm.name, d.cfg.mark
                )));
            }
            if vm.start {
                self.boot(&conn, &d).await?;
            }
            return Ok(());
        }
        if conn
            .lookup_domain_by_name(&self.domain_name(&vm.name))
            .is_ok()
        {
            return Err(BackendError::Invalid(format!(
                "libvirt domain {} exists without boxery's mark: boxery never touches it; remove or rename it",
                self.domain_name(&vm.name)
            )));
        }
        // leftovers of a create that died
        self.destroy(&vm.name).await?;
        let res = self.create_inner(&conn, vm).await;
        if let Err(e) = &res {
            warn!(vm = vm.name.as_str(), error = %e, "create failed; removing what it made");
            if let Err(e2) = self.destroy(&vm.name).await {
                warn!(vm = vm.name.as_str(), error = %e2, "could not remove the failed create; cleanup_new retries");
            }
        }
        res
    }

    async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        if !valid_name(name) {
            return Ok(None);
        }
        let conn = self.conn()?;
        let Some(d) = self.lookup(&conn, name)? else {
            return Ok(None);
        };
        if !self.active_disk(&d).map(|p| p.exists()).unwrap_or(false) {
            return Ok(None);
        }
        Ok(Some(self.info(&d)))
    }

    async fn list(&self) -> Result<Vec<VmInfo>> {
        let conn = self.conn()?;
        let doms = conn
            .list_all_domains(LIST_ALL)
            .map_err(|e| unreachable(format!("listing domains: {e}")))?;
        let prefix = self.domain_name("");
        let mut out = Vec::new();
        for dom in doms {
            let Ok(n) = dom.name() else { continue };
            if !n.starts_with(&prefix) {
                continue; // not ours: never read further
            }
            let Some(d) = self.ours(dom) else { continue };
            if self.active_disk(&d).map(|p| p.exists()).unwrap_or(false) {
                out.push(self.info(&d));
            }
        }
        if !conn.is_alive().unwrap_or(false) {
            return Err(unreachable(
                "the connection to libvirtd dropped while listing",
            ));
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn ssh_endpoint(&self, name: &str) -> Result<Option<String>> {
        Ok(self.get(name).await?.and_then(|i| i.ssh))
    }

    async fn start(&self, name: &str) -> Result<()> {
        self.check_name("VM", name)?;
        let _lock = self.lock(&format!("vm-{name}")).await?;
        let conn = self.conn()?;
        let d = self
            .lookup(&conn, name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        self.boot(&conn, &d).await
    }

    async fn stop(&self, name: &str) -> Result<()> {
        self.check_name("VM", name)?;
        let _lock = self.lock(&format!("vm-{name}")).await?;
        let conn = self.conn()?;
        let d = self
            .lookup(&conn, name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        self.shutdown(&d, true).await
    }

    async fn remove(&self, name: &str) -> Result<()> {
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = self.lock(&format!("vm-{name}")).await?;
        self.destroy(name).await?;
        info!(vm = name, "VM removed");
        Ok(())
    }

    async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        self.check_name("VM", name)?;
        let _lock = self.lock(&format!("vm-{name}")).await?;
        let conn = self.conn()?;
        let d = self
            .lookup(&conn, name)?
            .ok_or_else(|| not_found(format!("VM {name}")))?;
        let mut cfg = d.cfg.clone();
        if size.disk_gib < cfg.disk_gib {
            return Err(BackendError::Invalid(format!(
                "disks only grow: VM {name} has {} GiB, {} GiB asked",
                cfg.disk_gib, size.disk_gib
            )));
        }
        let (host_cpus, host_mib) = crate::qemu::process::host_capacity();
        if size.cpus == 0
            || size.cpus > host_cpus
            || size.memory_mib > host_mib
            || size.memory_mib < 64
        {
            return Err(BackendError::Invalid(format!(
                "VM {name}: {} CPUs and {} MiB do not fit this host ({host_cpus} CPUs, {host_mib} MiB)",
                size.cpus, size.memory_mib
            )));
        }
        let machine = size.cpus != cfg.cpus || size.memory_mib != cfg.memory_mib;
        let grow = size.disk_gib > cfg.disk_gib;
        if !machine && !grow {
            return Ok(());
        }
        let was_running = Self::is_running(&d);
        if was_running && !machine {
            d.dom
                .block_resize("vda", size.disk_gib * GIB, BLOCK_RESIZE_BYTES)
                .map_err(|e| lv_failed(format!("grow the disk of VM {name}"), e))?;
            cfg.disk_gib = size.disk_gib;
            return self.save_cfg(&conn, &d, &cfg);
        }
        if was_running {
            self.shutdown(&d, true).await?;
        }
        let applied: Result<()> = async {
            if grow {
                self.flatten(&d).await?;
                let active = self.active_disk(&d)?;
                self.disks
                    .resize(&active, size.disk_gib * GIB)
                    .await
                    .map_err(|e| {
                        BackendError::failed(format!("grow the disk of VM {name}"), e.to_string())
                    })?;
            }
            cfg.cpus = size.cpus;
            cfg.memory_mib = size.memory_mib;
            cfg.disk_gib = size.disk_gib;
            self.save_cfg(&conn, &d, &cfg)
        }
        .await;
        if was_running {
            let d = self
                .lookup(&conn, name)?
                .ok_or_else(|| not_found(format!("VM {name}")))?;
            self.boot(&conn, &d).await?;
        }
        applied
    }

    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        self.check_name("VM", vm)?;
        self.check_name("image", image)?;
        let _vm_lock = self.lock(&format!("vm-{vm}")).await?;
        let _image_lock = self.lock(&format!("image-{image}")).await?;
        if let Some(rec) = self.load_image(image)? {
            return same_image(rec, uid);
        }
        let conn = self.conn()?;
        let t = Instant::now();
        let res = self.capture_inner(&conn, vm, image, uid).await;
        if res.is_err() {
            let _ = self.remove_image_files(image);
        } else {
            info!(vm, image, secs = t.elapsed().as_secs_f64(), "captured");
        }
        res
    }

    async fn images(&self) -> Result<Vec<ImageInfo>> {
        let dir = self.images_dir();
        let entries = std::fs::read_dir(&dir).map_err(|e| {
            unreachable(format!(
                "cannot read {}: {e} (run `boxery init`)",
                dir.display()
            ))
        })?;
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(|e| unreachable(format!("cannot read {}: {e}", dir.display())))?;
            let f = e.file_name().to_string_lossy().into_owned();
            let Some(name) = f.strip_suffix(".json") else {
                continue;
            };
            if !valid_name(name) {
                continue;
            }
            let Some(rec) = self
                .load_image(name)
                .map_err(|e| unreachable(e.to_string()))?
            else {
                continue;
            };
            let disk = self.image_disk(name);
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
        self.check_name("VM", vm)?;
        if !valid_name(image) {
            return Err(BackendError::Unchanged(format!(
                "image name `{image}` is not valid"
            )));
        }
        let _lock = self.lock(&format!("vm-{vm}")).await?;
        let conn = self
            .conn()
            .map_err(|e| BackendError::Unchanged(e.to_string()))?;
        let d = self
            .lookup(&conn, vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let rec = self
            .load_image(image)
            .map_err(|e| BackendError::Unchanged(e.to_string()))?
            .ok_or_else(|| {
                BackendError::Unchanged(format!(
                    "image {image} does not exist in the libvirt backend"
                ))
            })?;
        self.load_base(&rec.base)
            .map_err(|e| BackendError::Unchanged(e.to_string()))?;
        if !self.image_disk(image).exists() {
            return Err(BackendError::Unchanged(format!(
                "image {image} has no disk in the libvirt backend"
            )));
        }
        // from here on the VM changes; every step is redone by a retry: the domain names either
        // the old disk or the complete new one
        self.shutdown(&d, false).await?;
        let mut cfg = d.cfg.clone();
        let generation = self.generations(vm)?.last().copied().unwrap_or(0) + 1;
        let disk = self.vm_disk(vm, generation);
        self.copy_image(image, &disk, cfg.disk_gib * GIB).await?;
        let new_key = identity
            .host_key
            .as_ref()
            .map(|(_, p)| p.trim().to_string());
        if new_key.is_some() && new_key != cfg.host_key {
            cfg.instance_id = format!("iid-{}", uuid::Uuid::new_v4());
            let id = Self::with_host_key(vm, identity)?;
            self.write_seed(vm, &cfg.instance_id, &id).await?;
            cfg.host_key = new_key;
            cfg.hostname = id.hostname.clone();
        }
        cfg.base = rec.base.clone();
        cfg.image = image.into();
        cfg.disk_gib = cfg.disk_gib.max(rec.virtual_size.div_ceil(GIB));
        self.define(&conn, &cfg, &disk)?;
        self.remove_stale_generations(vm, &disk)?;
        let d = self
            .lookup(&conn, vm)?
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        d.dom
            .create()
            .map_err(|e| lv_failed(format!("start VM {vm}"), e))
    }

    async fn build_image(
        &self,
        name: &str,
        image: &str,
        uid: &str,
        progress: Progress,
    ) -> Result<()> {
        self.check_name("image", image)?;
        let script = match name {
            "debian-12" => "build-debian.sh",
            "tiny" => "build-tiny.sh",
            _ => {
                return Err(BackendError::Invalid(format!(
                    "the libvirt backend cannot build stock image `{name}`: it builds debian-12 and tiny"
                )));
            }
        };
        if let Some(rec) = self.load_image(image)? {
            return same_image(rec, uid);
        }
        let dir = self.config.qemu.image_dir.clone().ok_or_else(|| {
            BackendError::Invalid("the image builders (image/build-*.sh) were not found: set BOXERY_IMAGE_DIR to the repository's image/ directory".into())
        })?;
        let out = self.config.qemu.image_cache.clone();
        progress(&format!(
            "building {name} with {} into {}",
            dir.join(script).display(),
            out.display()
        ));
        let o = tokio::process::Command::new("bash")
            .arg(dir.join(script))
            .arg(&out)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .map_err(io(format!("running {}", dir.join(script).display())))?;
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            progress(line);
        }
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: Vec<&str> = err.lines().rev().take(15).collect();
            return Err(BackendError::failed(
                format!("build stock image {name}"),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            ));
        }
        let base = self
            .register_base(&out.join(format!("{name}.json")))
            .await?;
        progress(&format!("registered base {base}"));
        self.image_from_base(image, uid, &base, format!("build:{name}"))
            .await
    }

    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.check_name("image", image)?;
        let manifest = if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            path.with_extension("json")
        };
        if !manifest.is_file() {
            return Err(BackendError::Invalid(format!(
                "{} has no image manifest ({}): the libvirt backend imports builder outputs (docs/images.md)",
                path.display(),
                manifest.display()
            )));
        }
        let base = self.register_base(&manifest).await?;
        self.image_from_base(image, uid, &base, format!("file:{}", path.display()))
            .await
    }

    async fn cleanup_new(&self, name: &str) -> Result<()> {
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = self.lock(&format!("vm-{name}")).await?;
        self.destroy(name).await
    }

    async fn cleanup_image(&self, image: &str) -> Result<()> {
        if !valid_name(image) || !self.images_dir().exists() {
            return Ok(());
        }
        let _lock = self.lock(&format!("image-{image}")).await?;
        self.remove_image_files(image)?;
        if let Ok(c) = self.conn() {
            self.refresh_pool(&c);
        }
        Ok(())
    }

    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        if !valid_name(vm) || !valid_name(image) {
            return Ok(());
        }
        let _lock = self.lock(&format!("vm-{vm}")).await?;
        let conn = self.conn()?;
        if let Some(d) = self.lookup(&conn, vm)? {
            if Self::is_running(&d) {
                // a capture that died between freeze and thaw leaves the guest frozen
                if let Ok(s) =
                    d.dom
                        .qemu_agent_command(r#"{"execute":"guest-fsfreeze-status"}"#, 3, 0)
                    && s.contains("\"frozen\"")
                {
                    d.dom
                        .qemu_agent_command(r#"{"execute":"guest-fsfreeze-thaw"}"#, 10, 0)
                        .map_err(|e| lv_failed(format!("thaw the guest of VM {vm}"), e))?;
                }
                if original == Some(PowerState::Running)
                    && let Ok((st, _)) = d.dom.state()
                    && st.is(virt::domain::DomainState::Paused)
                {
                    d.dom
                        .resume()
                        .map_err(|e| lv_failed(format!("resume VM {vm}"), e))?;
                }
            }
            // a snapshot file libvirt never switched to
            let active = self.active_disk(&d)?;
            let active_gen = active.file_name().and_then(|f| {
                f.to_string_lossy()
                    .rsplit('-')
                    .next()
                    .and_then(|g| g.strip_suffix(".qcow2").and_then(|g| g.parse::<u64>().ok()))
            });
            if let Some(ag) = active_gen {
                for g in self.generations(vm)? {
                    if g > ag {
                        remove_file_if_exists(&self.vm_disk(vm, g))
                            .map_err(io("removing an unused snapshot overlay"))?;
                    }
                }
            }
            if !Self::is_running(&d) && original == Some(PowerState::Running) {
                self.boot(&conn, &d).await?;
            }
        }
        let _image_lock = self.lock(&format!("image-{image}")).await?;
        if self.load_image(image)?.is_none() || !self.image_disk(image).exists() {
            self.remove_image_files(image)?;
        }
        self.refresh_pool(&conn);
        Ok(())
    }

    /// The pinned key recorded when the seed was written (the seed reaches the guest through
    /// the hypervisor, which the guest cannot spoof).
    async fn host_key(&self, name: &str) -> Result<Option<String>> {
        let conn = self.conn()?;
        Ok(self.lookup(&conn, name)?.and_then(|d| d.cfg.host_key))
    }

    /// What QEMU said after the domain's last start, from libvirt's per-domain log (only when
    /// libvirtd runs on this host, as root: `/var/log/libvirt/qemu/<domain>.log`).
    async fn last_exit(&self, name: &str) -> Option<String> {
        let path = Path::new(DOMAIN_LOG_DIR).join(format!("{}.log", self.domain_name(name)));
        domain_log_last_words(&std::fs::read_to_string(path).ok()?)
    }
}

/// Where libvirtd (system instance) keeps each QEMU domain's log.
const DOMAIN_LOG_DIR: &str = "/var/log/libvirt/qemu";

/// From a libvirt domain log: what QEMU printed after the last start (its command line and
/// environment excluded), else the reason libvirt recorded for the shutdown.
fn domain_log_last_words(log: &str) -> Option<String> {
    let start = log.rfind(": starting up libvirt version")?;
    let run = &log[start..];
    // After the "starting up" line: the environment and command line, one per line, each
    // but the last ending in `\`; then what QEMU said.
    let mut lines = run.lines().skip(1);
    for l in lines.by_ref() {
        if !l.ends_with('\\') {
            break;
        }
    }
    let said = lines
        .filter(|l| !l.starts_with("char device redirected"))
        .collect::<Vec<_>>()
        .join("\n");
    crate::last_words(&said).or_else(|| {
        let reason = run
            .lines()
            .rev()
            .find_map(|l| l.split("shutting down, reason=").nth(1))?;
        Some(format!("libvirt: shut down, reason {}", reason.trim()))
    })
}

/// Write `data` to `path` atomically (re-exported for the tests' fixtures).
pub fn write_file(path: &Path, data: &[u8]) -> std::io::Result<()> {
    write_atomic(path, data, 0o600)
}

/// The error and all its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::domain_log_last_words;

    const START: &str = "2026-11-30 07:25:59.948+0000: starting up libvirt version: 11.3.0, package: 11.3.0-2~bpo12+1 (Debian)\nLC_ALL=C \\\nHOME=/var/lib/libvirt/qemu/domain-26-x \\\n/usr/bin/qemu-system-x86_64 \\\n-name guest=x,debug-threads=on \\\n-msg timestamp=on\n";

    #[test]
    fn what_qemu_said_after_the_last_start() {
        let crashed = format!(
            "{START}qemu-system-x86_64: earlier run\n2026-11-30 07:25:50.000+0000: shutting down, reason=destroyed\n{START}qemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion `x' failed.\n2026-11-30 07:26:03.802+0000: shutting down, reason=crashed\n"
        );
        assert_eq!(
            domain_log_last_words(&crashed).unwrap(),
            "qemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion `x' failed."
        );
        // SIGKILL: QEMU says nothing; libvirt's reason is what there is
        let killed =
            format!("{START}2026-11-30 07:26:03.802+0000: shutting down, reason=crashed\n");
        assert_eq!(
            domain_log_last_words(&killed).unwrap(),
            "libvirt: shut down, reason crashed"
        );
        assert_eq!(domain_log_last_words("no start line"), None);
    }
}
