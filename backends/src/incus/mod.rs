//! The `incus` backend: system containers (and, where the host has KVM and vhost-vsock,
//! virtual machines) on an Incus daemon, through its REST API on the local unix socket
//! (cargo feature `incus`; needs `incus` 6.0 and `dnsmasq`, `scripts/install-incus.sh`).
//!
//! # Design
//! - **Namespace.** Everything lives in Incus objects of this home's own, named from the
//!   namespace `<ns>` (8 hex digits of the state directory's path, as the libvirt backend's):
//!   the project `boxery-<ns>` holds the VMs, the project `boxery-<ns>-images` holds the
//!   images, the storage pool `boxery-<ns>` holds their files (btrfs on a loop file Incus
//!   makes: copies and snapshots are copy-on-write; or a directory under the state directory,
//!   [`PoolDriver`]), and the bridge `bx<ns>` is their network. Every instance carries
//!   boxery's mark in `user.boxery.mark` and its boxery name in `user.boxery.name`; an
//!   instance without them is never read as ours, and nothing outside the two projects is
//!   ever listed or touched.
//! - **Names.** A VM's instance has the VM's name (Incus names are hostnames: a name with a
//!   `.` becomes `-` and a short hash of the name, [`instance_name`]).
//! - **The commit point** is the mark without `user.boxery.partial`: an instance is made with
//!   `user.boxery.partial=1`, its seed is written, then the key is removed. A partial instance
//!   is reported without its mark and removed by `cleanup_new`.
//! - **Images are stopped instances** in the images project, never started. A new VM is a
//!   copy of one (`source.type=copy` across projects), so a VM never depends on its image and
//!   images delete in any order. A stock image is the builder's container tarball
//!   (`image/build-debian.sh` with `BOXERY_GUEST_KIND=container`) imported once as an Incus
//!   image, cached by its sha256 (the Incus fingerprint), and an instance made from it.
//!   **Capture** snapshots the VM (running or not: it keeps running), copies the snapshot
//!   into a new image instance and deletes the snapshot.
//! - **Identity** is the same NoCloud seed the other backends write (`storage::seed`), put
//!   into the container's `/var/lib/cloud/seed/nocloud/` through the files API before its
//!   first start, and kept on the host (`seeds/`: what a reimage writes again). cloud-init
//!   reads it as it reads the VMs' `cidata` disk (host key, keys, hostname, machine-id,
//!   token). A new `instance-id` makes the guest redo its per-instance steps. Incus gives
//!   every copy a new MAC.
//! - **Reimage** makes the new instance first (`bx-new-<hash>`, a copy of the image with the
//!   VM's identity), then stops the VM, renames it away (`bx-old-<hash>`), renames the new
//!   one into its place, deletes the old and commits the new one, which takes the VM's MAC
//!   then (two NICs with one MAC are refused): a failure before the stop is `Unchanged`, and
//!   a retry after an interruption finishes the swap.
//! - **Size**: `limits.cpu` and `limits.memory`, changed live; the root disk's `size`, a btrfs
//!   quota (a `dir` pool enforces none: the size is recorded and reported).
//! - **Network**: one NIC on the bridge, with `security.port_isolation` (no guest reaches
//!   another on the bridge), MAC and IPv4 filtering (no spoofing), `dns.mode=none` (no records
//!   of the siblings), no IPv6; the host's firewall (the firewall module). ssh goes from the
//!   host to the guest's DHCP lease (`VmInfo.ssh` = `10.x.y.z:22`, from the bridge's leases,
//!   never from what the guest reports). The credential proxy is served on the bridge's
//!   gateway at this home's proxy port ([`PROXY_PORTS`]).
//! - **Calls** go over one unix socket, one HTTP/1 connection per request; asynchronous
//!   operations are waited on (`/1.0/operations/ID/wait`), and configuration updates carry the
//!   ETag they were read with.
//!
//! # Caveats
//! - A container shares the host's kernel: it is a weaker boundary than a VM. `boxery`
//!   says so when it makes one, and docs/security.md says what each type isolates.
//! - No suspend and no memory snapshots (Incus needs CRIU for a stateful stop).

mod client;
mod config;
mod events;
mod firewall;
mod images;
mod instances;
mod setup;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

pub use client::{ApiError, Client};
pub use config::{IncusConfig, PoolDriver};

use crate::{
    Backend, BackendError, Capabilities, GuestNetwork, GuestProxy, Identity, ImageInfo, NewVm,
    PowerState, Progress, ProxyListen, Result, Stability, Stock, VmInfo, VmSize, VmUsage,
};

/// The backend's name.
pub const NAME: &str = "incus";

/// The ports a home's credential proxy port is given from (the namespace picks one).
pub const PROXY_PORTS: std::ops::RangeInclusive<u16> = 24000..=24999;

/// The `incus` backend.
#[derive(Debug, Clone)]
pub struct IncusBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: PathBuf,
    config: IncusConfig,
    client: Client,
    ns: String,
    /// The project of the VMs.
    project: String,
    /// The project of the images.
    images: String,
    /// The storage pool.
    pool: String,
    /// The bridge.
    network: String,
    /// The bridge's address, read at `init`.
    gateway: Mutex<Option<Ipv4Addr>>,
    /// When this process last made the firewall or saw it whole; `None`: not yet, or its
    /// last change failed (the tables may not hold the VMs' policies). `ensure_firewall`
    /// makes it again then.
    firewall_seen: Mutex<Option<std::time::Instant>>,
    /// Bytes each VM instance's files take on the pool, by instance: when measured, and what.
    /// (`None`: being measured for the first time).
    disk: Mutex<std::collections::HashMap<String, (std::time::Instant, Option<u64>)>>,
    /// The events feed ([`events`]), started at the first [`Backend::changes`].
    changes: std::sync::OnceLock<tokio::sync::watch::Receiver<u64>>,
}

/// The Incus instance name of boxery VM or image `name`: the name itself when Incus takes it
/// (a hostname label: a-z first, then a-z 0-9 -, at most 63), else every other character as
/// `-`, an `x` in front of a leading digit, and 6 hex digits of a hash of the name. Whatever
/// `name` holds, the result is only `[a-z0-9-]`: it goes into API paths and file names as is.
pub fn instance_name(name: &str) -> String {
    let label = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    let letter_first = name.starts_with(|c: char| c.is_ascii_lowercase());
    if letter_first && name.len() <= 63 && name.chars().all(label) {
        return name.to_string();
    }
    let h = boxery_api::fnv::fnv1a(name.as_bytes());
    let lead = if letter_first { "" } else { "x" };
    let flat: String = name
        .chars()
        .map(|c| if label(c) { c } else { '-' })
        .take(55)
        .collect();
    format!("{lead}{}-{:06x}", flat.trim_end_matches('-'), h & 0xff_ffff)
}

/// Whether `name` can name a VM or image of this backend: boxery's name rules
/// ([`crate::storage::files::valid_name`]), and not `bx-…` (the names of a reimage's side
/// instances). `Invalid` saying so otherwise.
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    if !crate::storage::files::valid_name(name) {
        return Err(BackendError::Invalid(format!(
            "`{name}` cannot name an Incus {what}: 1-63 of a-z 0-9 - ., starting and ending \
             with a letter or digit"
        )));
    }
    if name.starts_with("bx-") {
        return Err(BackendError::Invalid(format!(
            "`{name}` cannot name an Incus {what}: names starting `bx-` are the backend's own"
        )));
    }
    Ok(())
}

/// The error for an Incus call `step` that failed: `Unreachable` when the daemon cannot be
/// reached, `Failed` otherwise.
fn api(step: impl Into<String>) -> impl FnOnce(ApiError) -> BackendError {
    let step = step.into();
    move |e| match e {
        ApiError::Connect { .. } => BackendError::unreachable(NAME, e.to_string()),
        e => BackendError::failed(step, e),
    }
}

impl IncusBackend {
    /// A backend with its state under `state` and settings from the environment.
    pub fn new(state: impl Into<PathBuf>) -> Self {
        Self::with_config(state, IncusConfig::from_env())
    }

    /// A backend with its state under `state` and the given settings.
    pub fn with_config(state: impl Into<PathBuf>, config: IncusConfig) -> Self {
        let state = state.into();
        let abs = std::path::absolute(&state).unwrap_or_else(|_| state.clone());
        let ns = crate::namespace_of(&abs.to_string_lossy());
        IncusBackend {
            inner: Arc::new(Inner {
                client: Client::new(config.socket.clone()),
                project: format!("boxery-{ns}"),
                images: format!("boxery-{ns}-images"),
                pool: format!("boxery-{ns}"),
                network: format!("bx{ns}"),
                ns,
                state,
                config,
                gateway: Mutex::new(None),
                firewall_seen: Mutex::new(None),
                disk: Mutex::new(Default::default()),
                changes: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The namespace id (8 hex digits).
    pub fn namespace(&self) -> &str {
        &self.inner.ns
    }
    /// The project holding the VMs.
    pub fn project(&self) -> &str {
        &self.inner.project
    }
    /// The project holding the images.
    pub fn image_project(&self) -> &str {
        &self.inner.images
    }
    /// The storage pool.
    pub fn pool(&self) -> &str {
        &self.inner.pool
    }
    /// The bridge network.
    pub fn network(&self) -> &str {
        &self.inner.network
    }
    /// The API client.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }
    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.inner.state
    }

    /// Remove everything this home made in incusd and on the host: its instances (VMs and
    /// images), the Incus images it imported, its projects, network, storage pool and firewall
    /// tables. For tests, and for a home that is being removed. Idempotent.
    pub async fn teardown(&self) -> Result<()> {
        self.inner.teardown().await
    }
}

impl Inner {
    /// This home's credential proxy port.
    fn proxy_port(&self) -> u16 {
        self.config.proxy_port.unwrap_or_else(|| {
            let span = u32::from(PROXY_PORTS.end() - PROXY_PORTS.start()) + 1;
            let n = u32::from_str_radix(&self.ns, 16).unwrap_or(0);
            PROXY_PORTS.start() + (n % span) as u16
        })
    }
}

#[async_trait]
impl Backend for IncusBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: NAME,
            stability: Stability::Experimental,
            platforms: &["linux-x86_64"],
            requirements: &[
                "incus >= 6.0 (Debian 12: from bookworm-backports) with lxcfs, incusd running",
                "dnsmasq-base",
                "nftables",
            ],
            resize: true,
            live_capture: true,
            suspend: false,
            memory_snapshots: false,
            build_stock_image: true,
            host_key: true,
            ssh: true,
            usage: true,
            screen: false,
            instance_types: &[crate::InstanceType::Container],
        }
    }

    async fn check(&self) -> Result<()> {
        self.inner.check().await
    }
    async fn init(&self) -> Result<()> {
        self.inner.init().await
    }
    async fn create(&self, vm: &NewVm) -> Result<()> {
        self.inner.create(vm).await
    }
    async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        let mut info = self.inner.get(name).await?;
        if let Some(i) = info.as_mut() {
            Inner::disk_used(&self.inner, std::slice::from_mut(i));
        }
        Ok(info)
    }
    async fn list(&self) -> Result<Vec<VmInfo>> {
        let mut infos = self.inner.list().await?;
        Inner::disk_used(&self.inner, &mut infos);
        Ok(infos)
    }
    /// Incus's lifecycle events of the VMs' project ([`events`]).
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        tokio::runtime::Handle::try_current().ok()?;
        let rx = self.inner.changes.get_or_init(|| {
            events::follow(self.inner.config.socket.clone(), self.inner.project.clone())
        });
        Some(rx.clone())
    }
    async fn start(&self, name: &str) -> Result<()> {
        self.inner.start(name).await
    }
    async fn stop(&self, name: &str) -> Result<()> {
        self.inner.stop(name).await
    }
    async fn remove(&self, name: &str) -> Result<()> {
        self.inner.remove(name).await
    }
    async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        self.inner.resize(name, size).await
    }
    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        self.inner.capture(vm, image, uid).await
    }
    async fn images(&self) -> Result<Vec<ImageInfo>> {
        self.inner.images().await
    }
    async fn remove_image(&self, image: &str) -> Result<()> {
        self.inner.remove_image(image).await
    }
    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        self.inner.reimage(vm, image, identity).await
    }
    async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        self.inner.build_image(stock, progress).await
    }
    async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.inner.import_image(path, image, uid).await
    }
    async fn cleanup_new(&self, name: &str) -> Result<()> {
        self.inner.cleanup_new(name).await
    }
    async fn cleanup_image(&self, image: &str) -> Result<()> {
        self.inner.cleanup_image(image).await
    }
    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        self.inner.recover_capture(vm, image, original).await
    }
    async fn set_egress(
        &self,
        name: &str,
        policy: boxery_api::network::EgressPolicy,
    ) -> Result<()> {
        self.inner.set_egress(name, policy).await
    }
    fn guest_proxy(&self, name: &str) -> Option<GuestProxy> {
        let _ = name;
        let gw = (*self.inner.gateway.lock().unwrap())?;
        let port = self.inner.proxy_port();
        Some(GuestProxy {
            url: format!("http://{gw}:{port}"),
            listen: ProxyListen::Tcp(std::net::SocketAddr::new(gw.into(), port)),
            dns: None,
        })
    }
    async fn guest_network(&self, name: &str) -> Result<Option<GuestNetwork>> {
        let _ = name;
        let cached = *self.inner.gateway.lock().unwrap();
        let gw = match cached {
            Some(gw) => gw,
            // a process that did not `init` (`boxery drill`): the network as incusd has it
            None => match self.inner.read_gateway().await? {
                Some(gw) => gw,
                None => return Ok(None),
            },
        };
        Ok(Some(GuestNetwork {
            gateway: gw.into(),
            ssh_on_host_loopback: false,
            direct_public: true,
        }))
    }
    fn accelerator(&self) -> Option<String> {
        // shown in the VM's status and its Created event: the user is told what they got
        Some(
            "a system container: it shares the host's kernel, a weaker boundary than a VM \
             (docs/security.md)"
                .into(),
        )
    }
    async fn host_key(&self, name: &str) -> Result<Option<String>> {
        self.inner.host_key(name).await
    }
    async fn usage(&self) -> Result<Vec<VmUsage>> {
        self.inner.usage().await
    }
}
