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
//! - **Suspend** ([`Backend::suspend`]): libvirt's managed save (memory and device state in
//!   libvirtd's save directory, the domain off, its QEMU gone); `start` restores it as saved
//!   (no flattening, no redefinition), `stop`, `reimage` and `remove` discard it, `resize`
//!   refuses until it is resumed or stopped. An image libvirt will not restore is kept and
//!   reported ([`crate::BackendError::stale_memory`]). See the memory module.
//! - **New VM from an image, reimage**: a copy (`cp --reflink=auto`) of the image's overlay,
//!   so the VM never depends on the image.
//! - **Network**: one NIC on the libvirt network `BOXERY_LIBVIRT_NETWORK` (`default`, NAT) with
//!   the nwfilter `boxery-guest` ([`xml::guest_filter`]: the isolation filter
//!   `boxery-guest-isolation`, [`xml::isolation_filter`], plus one port of the host). ssh goes
//!   from the host to the guest's DHCP address on that network (`VmInfo.ssh` =
//!   `192.168.122.x:22`), the only inbound connection the filter allows. No user-mode
//!   (passt/slirp) NIC: passt maps the gateway to the host's loopback, which would route around
//!   the filter.
//! - **Egress** (`spec.network.egress.policy`, [`Backend::set_egress`]): `Public` is the NIC
//!   on `boxery-guest` (above). `Allowlist` and `Deny` put it on `boxery-guest-confined`
//!   ([`xml::confined_filter`], a complete filter): DHCP with the host, ssh from the host and
//!   the proxy port, nothing else (no DNS, nothing NAT'd out); the guest's HTTP(S) goes through
//!   the egress proxy on that port, where the control plane applies the policy. The two
//!   filters take the same parameters, so libvirt switches a running NIC between them
//!   (`virDomainUpdateDeviceFlags`, live and in the definition). The policy lives in the
//!   domain's definition (which filter its NIC references): `create` defines the domain with
//!   it before the first boot, and every redefinition (start, resize, reimage) keeps it.
//! - **Credential proxy** ([`Backend::guest_proxy`]): the guest reaches it at the network's
//!   gateway (`192.168.122.1`) on this home's **proxy port**, the one port of the host its
//!   filter accepts (TCP out to `$GATEWAY:$PROXY_PORT` and the replies; the rest of the
//!   gateway is dropped). The control plane serves the proxy there, one listener for the
//!   home's VMs (the token names the VM). The port is `BOXERY_LIBVIRT_PROXY_PORT`, else picked
//!   once per home from [`PROXY_PORTS`] (24000–24999: a start given by the namespace, so homes
//!   sharing a host and a network start apart, then the first port free on the gateway) and
//!   kept in `<state dir>/proxy-port`. It reaches the domain as the `PROXY_PORT` parameter of
//!   its `<filterref>`, like `GATEWAY`; `guest_proxy` answers from what `init` read (the
//!   gateway, the port), `None` before.
//! - **Filters change without breaking older domains.** libvirt refuses to change a filter
//!   when a running domain that references it lacks one of its variables, and refuses to start
//!   such a domain. So the proxy's rule is in a filter of its own that only domains with
//!   `PROXY_PORT` reference, and `boxery-guest-isolation` keeps to the variables every boxery
//!   domain has had (`GATEWAY`, `DHCPSERVER`, `CTRL_IP_LEARNING`): a domain defined by an older
//!   version (its NIC on `boxery-guest-isolation` alone, no `PROXY_PORT`) keeps its network
//!   when `init` redefines the filters (only a filter without this version's mark,
//!   [`xml::filter_is_current`]: a redefinition rebuilds every running guest's rules), even
//!   while running. `init` then moves this home's running ones to `boxery-guest`
//!   live (`virDomainUpdateDeviceFlags`, their guests reach the proxy without a restart), with
//!   the guest's lease address as the filter's `IP`, and every start defines the domain
//!   afresh (without `IP`: libvirt learns it).
//!
//! - **Screen**: a VGA video device, a virtio tablet and a VNC display without a listener
//!   (`<graphics type='vnc'><listen type='none'/>`) in every domain; `virDomainScreenshot`
//!   reads it, QMP's `input-send-event` through libvirt's monitor passthrough drives it, and
//!   `virDomainOpenGraphics` watches it (the screen module). A domain gets them at its next cold
//!   start (every start defines it afresh); one resumed from a managed save keeps the devices
//!   it was saved with.
//! - **Storage** (bases, images, seeds, builds) is the storage module's ([`crate::storage`]),
//!   shared with the qemu backend; this module keeps the domain XML and the libvirt calls.
//! - **Calls into libvirt** are synchronous: they run on tokio's blocking threads, never on an
//!   async worker, over one connection opened on first use and again after it dropped.
//!
//! # Caveats
//! - A running VM captured N times runs on a chain N+1 deep until its next cold start.
//! - Two homes that pick a proxy port at the same moment, neither serving yet, get the same
//!   one only if their namespaces give the same start (1 in 1000); the second `serve` then
//!   cannot bind it: set `BOXERY_LIBVIRT_PROXY_PORT` (or remove `proxy-port`) in one of them.
//! - The filter keeps a guest from every address of the host on its network but the proxy
//!   port; an address of the host that is not private (a public address on another
//!   interface) is reached like the rest of the internet, services listening there included.
//! - Homes of an older boxery version on one host redefine the shared filters to their own
//!   version at each `init`; this version puts its own back at its next `init`.
//! - A guest switched to the confined filter before its first DHCP lease has no `IP` on its
//!   filter yet (below).
//! - The filter has no `IP` of the guest at a start (`CTRL_IP_LEARNING=any`): libvirt learns
//!   it from the guest's traffic and, until it has, applies only its layer-2 rules. The backend
//!   gives the filter the lease address live before it reports the guest reachable
//!   (`Inner::pin_address`): what is left is the guest's own boot.

mod capture;
mod config;
mod conn;
mod disks;
mod egress;
mod hostguard;
mod inventory;
mod lifecycle;
mod memory;
mod network;
mod screen;
pub mod xml;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use boxery_api::network::EgressPolicy;
use tracing::{info, warn};
use virt::connect::Connect;
use virt::domain::Domain;

use crate::storage::disk::{GIB, allocated_bytes};
use crate::storage::files::{FileLock, remove_file_if_exists, remove_temps, valid_name};
use crate::storage::records::{BaseRecord, VmConfig};
use crate::storage::{BasePlaces, Places, Storage, seed};
use crate::{
    Backend, BackendError, Capabilities, GuestNetwork, GuestProxy, Identity, ImageInfo, NewVm,
    PowerState, Progress, ProxyListen, Result, Stability, Stock, VmInfo, VmSize, io,
};
pub use config::LibvirtConfig;
use conn::blocking;
use egress::unconfinable;
use inventory::{DOMAIN_LOG_DIR, domain_log_last_words};
pub use network::PROXY_PORTS;

const BACKEND: &str = "libvirt";

// libvirt flag values (libvirt-domain.h), named here because virt 0.5 takes raw u32s
const META_ELEMENT: i32 = 2; // VIR_DOMAIN_METADATA_ELEMENT
const AFFECT_LIVE: u32 = 1; // VIR_DOMAIN_AFFECT_LIVE
const AFFECT_CONFIG: u32 = 2; // VIR_DOMAIN_AFFECT_CONFIG
const XML_INACTIVE: u32 = 2; // VIR_DOMAIN_XML_INACTIVE
const META_KEY: &str = "boxery"; // the namespace prefix of our metadata element
const SNAP_NO_METADATA: u32 = 1 << 2;
const SNAP_DISK_ONLY: u32 = 1 << 4;
const SNAP_QUIESCE: u32 = 1 << 6;
const SNAP_ATOMIC: u32 = 1 << 7;
const ADDR_SRC_LEASE: u32 = 0; // VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
const BLOCK_RESIZE_BYTES: u32 = 1;
const LIST_ALL: u32 = 0;
const UNDEFINE_MANAGED_SAVE: u32 = 1; // VIR_DOMAIN_UNDEFINE_MANAGED_SAVE

/// The libvirt backend.
#[derive(Debug, Clone)]
pub struct LibvirtBackend {
    inner: Arc<Inner>,
}

/// The backend's state, shared with the blocking threads its libvirt calls run on.
#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    ns: String,
    pool_dir: PathBuf,
    config: LibvirtConfig,
    /// Bases, images and seeds: `bases/`, `images/` here, disks in the pool.
    storage: Storage,
    /// One connection for every call, opened on first use and again after it dropped.
    conn: Mutex<Option<Connect>>,
    /// Where the guests reach the credential proxy (gateway, port), known once `init` or a
    /// domain definition has read the network.
    proxy: Mutex<Option<SocketAddr>>,
    /// The running domains whose NIC filter holds their guest's address (`IP`), by name: the
    /// domain's id (one per start) and that address. See `Inner::pin_address`.
    pinned: Mutex<std::collections::HashMap<String, (u32, String)>>,
    /// The size each VM's screen showed at its last screendump, by domain id (the screen
    /// module).
    screens: crate::screen::Sizes,
}

fn unreachable(message: impl Into<String>) -> BackendError {
    BackendError::unreachable(BACKEND, message)
}

fn not_found(what: impl Into<String>) -> BackendError {
    BackendError::not_found(BACKEND, what)
}

fn is_code(e: &virt::error::Error, code: virt::error::ErrorNumber) -> bool {
    e.code().is(code)
}

pub use crate::namespace_of;

/// A VM as read from its domain.
#[derive(Clone)]
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
        let places = Places {
            state: abs.clone(),
            image_disks: pool_dir.clone(),
            image_file: |name| format!("img-{name}.qcow2"),
            image_part_file: |name| format!(".img-{name}.part"),
            image_copy_file: Some(|name| format!(".img-{name}.copy")),
            bases: BasePlaces::Flat {
                files: pool_dir.clone(),
                records: abs.join("bases"),
            },
        };
        let storage = Storage::new(BACKEND, places, config.storage.clone());
        LibvirtBackend {
            inner: Arc::new(Inner {
                dir: abs,
                ns,
                pool_dir,
                config,
                storage,
                conn: Mutex::new(None),
                proxy: Mutex::new(None),
                pinned: Mutex::new(Default::default()),
                screens: Default::default(),
            }),
        }
    }

    /// The namespace id (in domain names `bx-<ns>-<vm>` and in the metadata mark).
    pub fn namespace(&self) -> &str {
        &self.inner.ns
    }

    /// The storage pool's directory.
    pub fn pool_dir(&self) -> &Path {
        &self.inner.pool_dir
    }

    /// Its settings.
    pub fn config(&self) -> &LibvirtConfig {
        &self.inner.config
    }

    /// The libvirt domain name of VM `name`.
    pub fn domain_name(&self, name: &str) -> String {
        self.inner.domain_name(name)
    }

    /// The storage pool's name.
    pub fn pool_name(&self) -> String {
        self.inner.pool_name()
    }

    /// Register a builder's output (`OUT/<name>.json`) as a read-only base in the pool; returns
    /// its id. Idempotent.
    pub async fn register_base(&self, manifest: &Path) -> Result<String> {
        self.inner.ensure_dirs()?;
        self.inner.storage.register_base(manifest).await
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
            suspend: true,
            memory_snapshots: false,
            build_stock_image: true,
            host_key: true,
            ssh: true,
            usage: true,
            screen: true,
            instance_types: &[crate::InstanceType::VirtualMachine],
        }
    }

    async fn check(&self) -> Result<()> {
        self.inner.check().await
    }

    /// Idempotent, and safe to run from several processes at once: this home's (a `serve`
    /// and a CLI `--wait`) take turns; the filter and network, shared with other homes, count
    /// as done when another process got there first.
    async fn init(&self) -> Result<()> {
        self.inner.init().await
    }

    async fn create(&self, vm: &NewVm) -> Result<()> {
        if vm.memory {
            return Err(BackendError::Unsupported {
                backend: "libvirt".into(),
                what: "start a VM from another VM's memory".into(),
            });
        }
        self.inner.create(vm).await
    }

    async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        if !valid_name(name) {
            return Ok(None);
        }
        let name = name.to_string();
        self.inner
            .call(move |me, conn| Ok(me.lookup(conn, &name)?.and_then(|d| me.info(&d))))
            .await
    }

    async fn list(&self) -> Result<Vec<VmInfo>> {
        self.inner.list().await
    }

    async fn usage(&self) -> Result<Vec<crate::VmUsage>> {
        self.inner.usage().await
    }

    async fn start(&self, name: &str) -> Result<()> {
        let (_lock, d) = self.inner.lock_domain(name).await?;
        self.inner.boot(&d).await
    }

    /// Discards a suspended VM's saved memory.
    async fn stop(&self, name: &str) -> Result<()> {
        let (_lock, d) = self.inner.lock_domain(name).await?;
        self.inner.shutdown(&d, true).await
    }

    /// libvirt's managed save (`virDomainManagedSave`): see the memory module.
    async fn suspend(&self, name: &str) -> Result<()> {
        self.inner.suspend(name).await
    }

    async fn remove(&self, name: &str) -> Result<()> {
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = self.inner.lock(&format!("vm-{name}")).await?;
        self.inner.destroy(name).await?;
        info!(vm = name, "VM removed");
        Ok(())
    }

    async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        self.inner.resize(name, size).await
    }

    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        self.inner.capture(vm, image, uid).await
    }

    async fn console(&self, vm: &str) -> Result<Option<String>> {
        crate::storage::files::console(&self.inner.vm_serial(vm))
            .map_err(|e| BackendError::failed(format!("read the console of VM {vm}"), e))
    }

    async fn images(&self) -> Result<Vec<ImageInfo>> {
        self.inner.storage.images()
    }

    async fn remove_image(&self, image: &str) -> Result<()> {
        self.cleanup_image(image).await
    }

    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        self.inner.reimage(vm, image, identity).await
    }

    async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        self.inner.ensure_dirs()?;
        self.inner.storage.build_image(stock, progress).await?;
        self.inner.refresh_pool().await;
        Ok(())
    }

    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.inner.ensure_dirs()?;
        self.inner.storage.import_image(path, image, uid).await?;
        self.inner.refresh_pool().await;
        Ok(())
    }

    async fn cleanup_new(&self, name: &str) -> Result<()> {
        if !valid_name(name) {
            return Ok(());
        }
        let _lock = self.inner.lock(&format!("vm-{name}")).await?;
        self.inner.destroy(name).await
    }

    async fn cleanup_image(&self, image: &str) -> Result<()> {
        let inner = &self.inner;
        if !valid_name(image) || !inner.storage.records().exists() {
            return Ok(());
        }
        let _lock = inner.lock(&format!("image-{image}")).await?;
        inner.storage.remove_image_files(image)?;
        inner.refresh_pool().await;
        Ok(())
    }

    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        self.inner.recover_capture(vm, image, original).await
    }

    /// Moves the VM's NIC between the guest filter (`Public`) and the confined filter
    /// (`Allowlist`, `Deny`: DHCP, ssh from the host and the proxy's port only), live when it
    /// runs and in its definition, so a restart keeps it. Takes no lock and changes nothing
    /// when the NIC is already on the right filter (every reconcile). `Unsupported` for
    /// `Allowlist` and `Deny` with isolation off (`BOXERY_NET_ISOLATION=off`: no filter).
    async fn set_egress(&self, name: &str, policy: EgressPolicy) -> Result<()> {
        self.inner.set_egress(name, policy).await
    }

    /// The pinned key recorded when the seed was written (the seed reaches the guest through
    /// the hypervisor, which the guest cannot spoof).
    async fn host_key(&self, name: &str) -> Result<Option<String>> {
        let name = name.to_string();
        self.inner
            .call(move |me, conn| Ok(me.lookup(conn, &name)?.and_then(|d| d.cfg.host_key)))
            .await
    }

    /// What QEMU said after the domain's last start, from libvirt's per-domain log (only when
    /// libvirtd runs on this host, as root: `/var/log/libvirt/qemu/<domain>.log`).
    async fn last_exit(&self, name: &str) -> Option<String> {
        let path = Path::new(DOMAIN_LOG_DIR).join(format!("{}.log", self.domain_name(name)));
        domain_log_last_words(&std::fs::read_to_string(path).ok()?)
    }

    /// The network's gateway; ssh endpoints are the guests' addresses on it; a `Public`
    /// guest is NAT'd out directly.
    async fn guest_network(&self, name: &str) -> Result<Option<GuestNetwork>> {
        if !valid_name(name) {
            return Ok(None);
        }
        let gateway = self.inner.call(|me, conn| me.gateway_ip(conn)).await?;
        Ok(Some(GuestNetwork {
            gateway,
            ssh_on_host_loopback: false,
            direct_public: true,
        }))
    }

    /// `virDomainScreenshot` (no `<graphics>` needed), as PNG.
    async fn screendump(&self, name: &str) -> Result<crate::Screen> {
        self.inner.screendump(name).await
    }

    /// QMP's `input-send-event` through libvirt's monitor passthrough; a pointer position is
    /// scaled by the size the VM's last screendump showed (one is taken first when this
    /// process has none of this run of the domain).
    async fn send_input(&self, name: &str, events: &[crate::InputEvent]) -> Result<()> {
        self.inner.send_input(name, events).await
    }

    async fn console_vnc(&self, name: &str) -> Result<tokio::net::UnixStream> {
        self.inner.console_vnc(name).await
    }

    /// The network's gateway and this home's port, one listener for every VM of the home
    /// (the nwfilter lets each guest reach that one port of the host). `None` until `init` (or
    /// a domain definition) has read the network.
    fn guest_proxy(&self, name: &str) -> Option<GuestProxy> {
        if !valid_name(name) {
            return None;
        }
        let addr = (*self.inner.proxy.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some(GuestProxy {
            url: format!("http://{addr}"),
            listen: ProxyListen::Tcp(addr),
            dns: None,
        })
    }
}
