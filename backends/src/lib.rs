//! Backends: the `Backend` trait, seed 001's contract in Rust, and its implementations.
//!
//! A backend turns idempotent requests (create this VM, capture that image) into hypervisor
//! actions. It keeps whatever state it needs on disk or in the hypervisor, never in memory
//! only: the control plane may be killed between any two calls and a new process must carry
//! on. Every VM and image a backend makes carries boxery's mark (the owning object's uid and
//! its store's identity, see [`mark`]), and
//! a backend never lists or touches anything without it.
//!
//! # The contract
//! - `list`/`images` distinguish an empty host (`Ok(vec![])`) from an unreachable one
//!   (`Err(BackendError::Unreachable)`).
//! - Images are disk-only, independent of their source (a VM made from an image keeps working
//!   after the image and its source are deleted; images can be deleted in any order) and cheap.
//! - `capture` works on a running VM and leaves it as it found it; it never leaves a partial
//!   image behind on failure.
//! - `reimage` keeps the VM's identity (MAC, endpoint, host key); it returns
//!   `BackendError::Unchanged` when it failed before touching the VM, and is retryable after
//!   an interruption between destructive steps.
//! - The recovery hooks (`cleanup_new`, `cleanup_image`, `recover_capture`) are idempotent and
//!   succeed when there is nothing to clean.

pub mod confined;
pub mod fake;
#[cfg(any(feature = "qemu", feature = "libvirt"))]
pub mod host;
pub mod identity;
#[cfg(feature = "incus")]
pub mod incus;
#[cfg(feature = "libvirt")]
pub mod libvirt;
pub mod mark;
#[cfg(feature = "qemu")]
pub mod qemu;
#[cfg(any(feature = "qemu", feature = "libvirt"))]
pub mod screen;
#[cfg(any(feature = "qemu", feature = "libvirt"))]
pub mod storage;

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use boxery_api::network::EgressPolicy;
pub use boxery_api::vm::InstanceType;
use serde::{Deserialize, Serialize};

/// Backend errors: one variant per kind of failure the reconcilers treat differently.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The hypervisor (daemon, API, state dir) cannot be reached: never read this as "empty".
    #[error("the {backend} backend is unreachable: {message}")]
    Unreachable {
        /// The backend's name.
        backend: String,
        /// What could not be reached, and why.
        message: String,
    },
    /// The VM or image does not exist.
    #[error("{what} not found in the {backend} backend")]
    NotFound {
        /// The backend's name.
        backend: String,
        /// What is missing (`VM dev1`, `image dev1@clean`).
        what: String,
    },
    /// The request can never succeed as asked (too many CPUs, a disk smaller than its image):
    /// not retried until the spec changes.
    #[error("{0}")]
    Invalid(String),
    /// The backend does not offer this.
    #[error("the {backend} backend cannot {what}")]
    Unsupported {
        /// The backend's name.
        backend: String,
        /// What it cannot do (`resize VMs`).
        what: String,
    },
    /// `reimage` failed before changing the VM at all.
    #[error("reimage failed before changing the VM: {0}")]
    Unchanged(String),
    /// A step failed; retrying may help.
    #[error("{step} failed")]
    Failed {
        /// The step that failed.
        step: String,
        /// Why: the error that made it fail (a message for causes that are only text).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Local I/O failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    /// A `Failed` error: `step` failed because of `cause`, an error (kept as the source, so
    /// its own causes stay reachable) or a message (`String`, `&str`).
    pub fn failed(
        step: impl Into<String>,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        BackendError::Failed {
            step: step.into(),
            source: cause.into(),
        }
    }
    /// A `NotFound` error of backend `backend`.
    pub fn not_found(backend: &str, what: impl Into<String>) -> Self {
        BackendError::NotFound {
            backend: backend.into(),
            what: what.into(),
        }
    }
    /// An `Unreachable` error of backend `backend`.
    pub fn unreachable(backend: &str, message: impl Into<String>) -> Self {
        BackendError::Unreachable {
            backend: backend.into(),
            message: message.into(),
        }
    }
    /// What `start` gives for a suspended VM whose saved memory cannot be restored (`why`,
    /// [`SavedMemory::stale`]): `Invalid`, saying what to do, in the words every backend uses.
    pub fn stale_memory(name: &str, why: &str) -> Self {
        BackendError::Invalid(format!(
            "the saved memory of VM {name} cannot be restored: {why}. It is kept; to boot the \
             VM cold instead (its processes are lost), stop it (`boxery stop {name}` discards \
             the memory), then start it"
        ))
    }
    /// This error and all its causes on one line (`outer: cause: root cause`): what a
    /// message for a person shows.
    pub fn chain(&self) -> String {
        error_chain(self)
    }
    /// An `Io` error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BackendError::Io {
            context: context.into(),
            source,
        }
    }
    /// Whether retrying without a spec change is pointless.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            BackendError::Invalid(_) | BackendError::Unsupported { .. }
        )
    }
}

pub use boxery_api::error_chain;

/// A closure for `map_err` turning an I/O error into [`BackendError::Io`] with `context`.
#[cfg_attr(not(any(feature = "qemu", feature = "libvirt")), allow(dead_code))]
pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackendError {
    let context = context.into();
    move |source| BackendError::io(context, source)
}

/// Result alias.
pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// The identity a new VM (or a VM made from an image) gets: never reused from its source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The guest's hostname (the VM's name).
    pub hostname: String,
    /// A fresh machine-id (32 hex).
    pub machine_id: String,
    /// The ssh host key pair generated on the host: (private OpenSSH PEM, public line).
    pub host_key: Option<(String, String)>,
    /// Public keys for `authorized_keys` (replaced, not appended).
    pub authorized_keys: Vec<String>,
    /// The per-VM proxy token written into the guest.
    pub proxy_token: Option<String>,
    /// The size the desktop layer's display starts at (`spec.display` of a VM with a
    /// desktop), written as [`boxery_api::vm::Display::FILE`] before the display first starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<boxery_api::vm::Display>,
}

/// Where a new VM's disk comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DiskSource {
    /// A backend image by name.
    Image(String),
}

/// A request to create a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewVm {
    /// The VM's name (the object's name).
    pub name: String,
    /// boxery's mark on everything made for it ([`mark::mark`]: the owning object's uid and
    /// its store's identity); compared whole, or with [`mark::Mark::same_object`].
    pub uid: String,
    /// Where the disk comes from.
    pub source: DiskSource,
    /// Virtual CPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Disk size in GiB.
    pub disk_gib: u64,
    /// Boot it once created.
    pub start: bool,
    /// Its identity.
    pub identity: Identity,
    /// Its egress policy (`spec.network.egress.policy`), in force from its first boot where the
    /// backend enforces it on the VM's network ([`Backend::set_egress`]).
    #[serde(default)]
    pub egress: EgressPolicy,
    /// Start from the memory the image carries ([`Backend::capture_memory`] of another VM)
    /// instead of booting: the guest continues from the image's instant and runs with that
    /// VM's identity until it takes its own ([`Backend::inherited`]). Only when
    /// [`Backend::memory_start_refusal`] said it can; `Invalid` otherwise, before anything
    /// is made.
    #[serde(default)]
    pub memory: bool,
}

/// A VM started from another VM's memory ([`NewVm::memory`]) runs with that VM's identity
/// (hostname, machine-id, host key, MAC, token file) until its guest is given its own over
/// ssh; then [`Backend::identity_taken`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inherited {
    /// The public host key the guest answers with until then (the source VM's).
    pub answers_with: String,
    /// The identity it takes: the one its seed holds for a later cold boot.
    pub identity: Identity,
    /// Its own MAC address, where the backend gave it one (the source's is in the memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// Whether a VM runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PowerState {
    /// Running.
    Running,
    /// Stopped.
    Stopped,
    /// Suspended: its memory and device state are on disk ([`VmInfo::memory`]), no hypervisor
    /// process runs. [`Backend::start`] resumes it; [`Backend::stop`] discards the memory.
    Suspended,
}

/// A suspended VM's saved memory, as the backend holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedMemory {
    /// Bytes it takes on the host's disk.
    pub bytes: u64,
    /// When it was saved.
    pub saved_at: boxery_api::Time,
    /// Why it can no longer be restored (written by another hypervisor version, for another
    /// machine or command line), in one sentence; `None` when it can. It is kept either way:
    /// only [`Backend::stop`] discards it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale: Option<String>,
}

/// A size as the backend applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSize {
    /// Virtual CPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Disk in GiB.
    pub disk_gib: u64,
}

/// One VM as the backend sees it (inventory row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// Name.
    pub name: String,
    /// boxery's mark ([`mark::Mark`]); `None` when it carries none.
    pub mark: Option<String>,
    /// Running or stopped.
    pub state: PowerState,
    /// Its configured size.
    pub size: VmSize,
    /// `HOST:PORT` of its sshd when running and reachable.
    pub ssh: Option<String>,
    /// Bytes its own disk takes (a shared base not counted), when known.
    pub disk_used_bytes: Option<u64>,
    /// Running, but a part the backend runs beside the hypervisor is down (qemu: the VM's
    /// `boxery-net`, so the guest has no network): why, in one sentence. [`Backend::repair`]
    /// brings it back. `None` when nothing is down (and always for a stopped VM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
    /// Its saved memory while it is [`PowerState::Suspended`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<SavedMemory>,
    /// Started from another VM's memory and not yet given its own identity
    /// ([`Backend::inherited`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inherited: bool,
}

/// One image as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Name.
    pub name: String,
    /// boxery's mark ([`mark::Mark`]); `None` when it carries none.
    pub mark: Option<String>,
    /// When it was made.
    pub created: Option<boxery_api::Time>,
    /// Bytes it takes on the host.
    pub size_bytes: Option<u64>,
    /// Bytes of the memory it carries ([`Backend::capture_memory`]); `None`: a disk only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

/// How ready a backend is for use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stability {
    /// Meets every line of "what stable means for a backend".
    Stable,
    /// Works; some lines are missing.
    Experimental,
    /// Tests only.
    TestOnly,
}

/// What a backend offers: declared once, read by the reconcilers, the CLI and the docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// The backend's name.
    pub name: &'static str,
    /// Stability.
    pub stability: Stability,
    /// Platforms it runs on (`linux-x86_64`).
    pub platforms: &'static [&'static str],
    /// What it needs installed.
    pub requirements: &'static [&'static str],
    /// Can resize CPUs/memory/disk.
    pub resize: bool,
    /// Can capture a running VM.
    pub live_capture: bool,
    /// Can suspend a running VM to disk and resume it with its processes
    /// ([`Backend::suspend`]).
    pub suspend: bool,
    /// Can capture a running VM's memory with its disk and revert the VM to both
    /// ([`Backend::capture_memory`], [`Backend::reimage_memory`]).
    pub memory_snapshots: bool,
    /// Can build the stock image.
    pub build_stock_image: bool,
    /// Can read a guest's host key through the hypervisor.
    pub host_key: bool,
    /// Its VMs run a real sshd at the endpoint it reports (readiness is then checked over
    /// ssh, with the pinned host key; the fake backend's VMs have no sshd).
    pub ssh: bool,
    /// Can tell what each running VM uses of the host ([`Backend::usage`]).
    pub usage: bool,
    /// Its VMs have a screen the hypervisor draws and takes input for, with nothing in the
    /// guest ([`Backend::screendump`], [`Backend::send_input`]): the console of a headless VM,
    /// a guest stuck at boot.
    pub screen: bool,
    /// The kinds of instance it makes (`spec.instanceType`), the one it makes when none is
    /// asked for first. Asked for another, the VM is refused before anything is made.
    pub instance_types: &'static [InstanceType],
}

impl Capabilities {
    /// The kind of instance a VM that asks for `asked` (or for none) is made as here, or why
    /// this backend will not make it.
    pub fn instance_type(&self, asked: Option<InstanceType>) -> Result<InstanceType, String> {
        let made = &self.instance_types;
        match asked {
            None => made
                .first()
                .copied()
                .ok_or_else(|| format!("the {} backend makes no kind of instance", self.name)),
            Some(t) if made.contains(&t) => Ok(t),
            Some(t) => Err(format!(
                "spec.instanceType is {t}, and the {} backend makes {} only{}",
                self.name,
                made.iter()
                    .map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join(" and "),
                match t {
                    InstanceType::VirtualMachine => {
                        ": use the qemu or libvirt backend for a virtual machine (BOXERY_BACKEND, or `backend:` in config.yaml)"
                    }
                    InstanceType::Container => {
                        ": system containers are the incus backend's (docs/backends.md); leave instanceType out for this backend's virtual machines"
                    }
                }
            )),
        }
    }
}

/// A VM's screen as its hypervisor draws it ([`Backend::screendump`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Screen {
    /// The picture, PNG-encoded.
    pub png: Vec<u8>,
    /// Its width in pixels.
    pub width: u32,
    /// Its height in pixels.
    pub height: u32,
}

/// A pointer button ([`InputEvent::Button`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PointerButton {
    /// The left button.
    Left,
    /// The middle button.
    Middle,
    /// The right button.
    Right,
    /// The wheel turned up (one notch per press).
    WheelUp,
    /// The wheel turned down.
    WheelDown,
    /// The wheel tilted left.
    WheelLeft,
    /// The wheel tilted right.
    WheelRight,
}

/// One input event for a VM's hypervisor devices ([`Backend::send_input`]): a keyboard and
/// an absolute pointer (a tablet), as QMP's `input-send-event` takes them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputEvent {
    /// A key pressed (`down`) or released, by QEMU's key name (`qcode`: `a`, `ret`, `shift`,
    /// `ctrl`, `f1`, …). Callers check it against their own table; the backend passes it on.
    Key {
        /// QEMU's name of the key.
        qcode: String,
        /// Pressed (`true`) or released.
        down: bool,
    },
    /// The pointer moved to (`x`, `y`), in pixels of the screen [`Backend::screendump`] shows
    /// (the last one it showed: a position is a pixel of a picture the caller saw); a
    /// position outside it is `Invalid`.
    Move {
        /// Pixels from the left.
        x: u32,
        /// Pixels from the top.
        y: u32,
    },
    /// A pointer button pressed (`down`) or released.
    Button {
        /// Which.
        button: PointerButton,
        /// Pressed (`true`) or released.
        down: bool,
    },
}

/// What one running VM uses of the host, sampled now ([`Backend::usage`]): counters since
/// its hypervisor started, and its memory now.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct VmUsage {
    /// The VM.
    pub name: String,
    /// CPU seconds its hypervisor process used (user and system, every vCPU and thread).
    pub cpu_seconds: f64,
    /// Host memory its hypervisor process holds now (resident set).
    pub rss_bytes: u64,
    /// Bytes the guest received on its network, when the backend counts them.
    pub network_rx_bytes: Option<u64>,
    /// Bytes the guest sent on its network, when the backend counts them.
    pub network_tx_bytes: Option<u64>,
}

/// How a guest reaches the host on its network, as its backend wires it: what the isolation
/// drill (`boxery drill`) probes against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestNetwork {
    /// The address the guest sees the host at, its gateway (qemu's user network: `10.0.2.2`;
    /// libvirt: the network's gateway, where the credential proxy listens).
    pub gateway: std::net::IpAddr,
    /// Whether VMs' ssh endpoints (`VmInfo.ssh`) are ports of the host's loopback forwarded
    /// into their guests (qemu), which another guest would try at [`Self::gateway`]; else
    /// they are the guests' own addresses on a network they share (libvirt).
    pub ssh_on_host_loopback: bool,
    /// Whether a guest whose egress policy is `Public` reaches the internet directly (raw
    /// TCP, libvirt's NAT), not only through the egress proxy (qemu).
    pub direct_public: bool,
}

impl GuestNetwork {
    /// Where a guest connects to reach the ssh endpoint `ssh` of another VM directly.
    pub fn ssh_target(&self, ssh: std::net::SocketAddr) -> std::net::SocketAddr {
        if self.ssh_on_host_loopback {
            std::net::SocketAddr::new(self.gateway, ssh.port())
        } else {
            ssh
        }
    }
}

/// How a VM's guest reaches the control plane's credential proxy (docs/grants.md, "The guest
/// side"): the address the guest uses, and where the control plane must serve the proxy for
/// it. The guest reaches nothing else of the host through it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestProxy {
    /// The proxy's base URL as the guest sees it (`http://10.0.2.100`), without a trailing `/`.
    pub url: String,
    /// Where the control plane serves the proxy for this guest.
    pub listen: ProxyListen,
    /// Where the control plane answers this guest's name lookups; `None`: the guest's
    /// lookups get no answer from boxery (libvirt: its network's own DNS, or none when
    /// confined).
    pub dns: Option<GuestDns>,
}

/// A guest's name lookups answered by the control plane (docs/egress.md, "Name lookups").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestDns {
    /// The unix datagram socket the VM's network helper sends them to (`boxery_net::dns`),
    /// where the control plane answers.
    pub listen: PathBuf,
    /// The unix stream socket the helper connects the guest's lookups over TCP to, where
    /// the control plane answers them; `None`: not carried.
    pub listen_tcp: Option<PathBuf>,
    /// The DNS server's address as the guest uses it (the guest is told it at each boot).
    pub addr: std::net::Ipv4Addr,
}

/// Where the control plane serves the credential proxy for a guest.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ProxyListen {
    /// A unix socket that carries this one VM's connections (qemu's `guestfwd`): the channel
    /// names the VM, and a token of any other VM is refused on it.
    Unix(PathBuf),
    /// A TCP address on the guests' network, shared by the backend's VMs (libvirt's bridge
    /// address): the token alone names the VM.
    Tcp(std::net::SocketAddr),
}

/// Progress reports for long work (image builds).
pub type Progress = Arc<dyn Fn(&str) + Send + Sync>;

/// A stock image to build ([`Backend::build_image`]): which one, as which image, for which
/// object (named, not three strings in a row).
#[derive(Debug, Clone, Copy)]
pub struct Stock<'a> {
    /// The stock image (`debian-12`, `tiny`).
    pub name: &'a str,
    /// Layers on top of the stock image's own, checked and in build order
    /// ([`boxery_api::image::normalize_layers`]).
    pub layers: &'a [String],
    /// The image to make of it.
    pub image: &'a str,
    /// The uid of the Image object it is made for (its mark).
    pub uid: &'a str,
}

/// A hypervisor backend.
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// What it offers.
    fn capabilities(&self) -> Capabilities;
    /// The backend's name.
    fn name(&self) -> &'static str {
        self.capabilities().name
    }
    /// Verify dependencies; the error says what to install.
    async fn check(&self) -> Result<()>;
    /// One-time host setup (state dirs, pools). Idempotent.
    async fn init(&self) -> Result<()>;
    /// Create (and boot, if asked) a VM. When it fails, `cleanup_new` removes what it left.
    async fn create(&self, vm: &NewVm) -> Result<()>;
    /// One VM, or `None` when it does not exist (only complete, marked VMs).
    async fn get(&self, name: &str) -> Result<Option<VmInfo>>;
    /// Every VM in boxery's namespace (marked or not; never another tool's).
    async fn list(&self) -> Result<Vec<VmInfo>>;
    /// The hypervisor's own word that its VMs changed (made, started, stopped, deleted: by
    /// boxery or anyone), so the inventory looks at once rather than at its next pass. The
    /// counter moves at each change; a feed that was cut and is back moves it too (what
    /// happened meanwhile was not seen). `None` (the default): no such feed, the inventory's
    /// periodic passes only. Called from within the runtime, once per inventory loop.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// Where the VM's sshd is, now (by default: what [`Backend::get`] reports).
    async fn ssh_endpoint(&self, name: &str) -> Result<Option<String>> {
        Ok(self.get(name).await?.and_then(|i| i.ssh))
    }
    /// Boot a stopped VM, or resume a suspended one from its saved memory (no-op when
    /// running). A suspended VM whose memory is stale ([`SavedMemory::stale`]) is not booted:
    /// `Invalid`, saying that `stop` discards it.
    async fn start(&self, name: &str) -> Result<()>;
    /// Stop a running VM; discard a suspended VM's saved memory (no-op when stopped).
    async fn stop(&self, name: &str) -> Result<()>;
    /// Save a running VM's memory and device state to disk and end its hypervisor process
    /// (no-op when suspended; `Invalid` when stopped: there is no memory to save). Either
    /// the VM keeps running or the saved state is complete, also when the control plane or
    /// the hypervisor is killed part way; [`Backend::repair`] finishes or rolls back an
    /// interrupted suspend or resume ([`VmInfo::degraded`] says so).
    async fn suspend(&self, name: &str) -> Result<()> {
        let _ = name;
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "suspend VMs".into(),
        })
    }
    /// Remove a VM (not its images). Succeeds when already gone.
    async fn remove(&self, name: &str) -> Result<()>;
    /// Apply a new size; leaves the VM running if it was, stopped if it was. Disks only grow.
    async fn resize(&self, name: &str, size: VmSize) -> Result<()>;
    /// Copy a VM's disk into a new image `image` marked with `uid`.
    async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()>;
    /// [`Backend::capture`] of a running VM, its memory and device state with it, both from
    /// one instant (the guest is paused for the copy and runs on after). `Invalid` when the
    /// VM is not running. Never leaves a partial image, and leaves the VM running.
    async fn capture_memory(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        let _ = (vm, image, uid);
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "capture a VM's memory".into(),
        })
    }
    /// [`Backend::reimage`] with an image from [`Backend::capture_memory`] of this same VM: the
    /// VM ends running from the image's memory, where it was when the image was taken.
    /// `Unchanged` when the image carries no memory or its memory is another VM's (or no
    /// longer loadable here), before anything changes.
    async fn reimage_memory(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        let _ = (vm, image, identity);
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "restore a VM's memory from an image".into(),
        })
    }
    /// Why a new VM of `cpus` and `memory_mib` cannot start from the memory image `image`
    /// carries ([`NewVm::memory`]): it carries none, it was taken at another size or under
    /// another hypervisor, or the backend cannot. `None`: it can.
    async fn memory_start_refusal(
        &self,
        image: &str,
        cpus: u32,
        memory_mib: u64,
    ) -> Result<Option<String>> {
        let _ = (image, cpus, memory_mib);
        Ok(Some(format!(
            "the {} backend cannot start a VM from memory",
            self.name()
        )))
    }
    /// What VM `vm`, started from another VM's memory, must take to be itself, while it has
    /// not ([`VmInfo::inherited`]). `None` for every other VM.
    async fn inherited(&self, vm: &str) -> Result<Option<Inherited>> {
        let _ = vm;
        Ok(None)
    }
    /// VM `vm`'s guest now holds its own identity ([`Backend::inherited`]). Idempotent.
    async fn identity_taken(&self, vm: &str) -> Result<()> {
        let _ = vm;
        Ok(())
    }
    /// What VM `vm`'s serial console printed since it last started (at most
    /// 1 MiB: its beginning and its end), to say why a guest
    /// does not answer. Guest-written text: for matching, never for showing whole. `None`
    /// where the backend keeps no console.
    async fn console(&self, vm: &str) -> Result<Option<String>> {
        let _ = vm;
        Ok(None)
    }
    /// Every image in boxery's namespace.
    async fn images(&self) -> Result<Vec<ImageInfo>>;
    /// Delete an image; VMs made from it keep working. Succeeds when already gone.
    async fn remove_image(&self, image: &str) -> Result<()>;
    /// Replace a VM's disk with a copy of `image`, keeping its identity; ends running.
    async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()>;
    /// Build stock image `stock.name` (`debian-12`) as image `stock.image` marked `stock.uid`.
    async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()>;
    /// Import a disk file as image `image`.
    async fn import_image(&self, path: &std::path::Path, image: &str, uid: &str) -> Result<()> {
        let _ = (path, image, uid);
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "import image files".into(),
        })
    }
    /// Remove an incomplete VM and its partial files. Idempotent.
    async fn cleanup_new(&self, name: &str) -> Result<()>;
    /// Remove a complete or partial image. Idempotent.
    async fn cleanup_image(&self, image: &str) -> Result<()>;
    /// Cancel a dead capture's jobs, restore the source VM to `original` and remove the partial
    /// image. Never removes the source VM. Idempotent.
    async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()>;
    /// Make VM `name`'s network enforcement match `policy`, live, without a reboot, and so that
    /// it holds across restarts; a no-op when it already does. Backends that enforce egress on
    /// the control plane (qemu: its proxy; the fake backend: no guest) do nothing. Called by
    /// the reconciler on every step of an existing VM, so it must be cheap when nothing
    /// changes. `Unsupported` when the backend cannot enforce `policy` as configured.
    async fn set_egress(&self, name: &str, policy: EgressPolicy) -> Result<()> {
        let _ = (name, policy);
        Ok(())
    }
    /// Bring back what [`VmInfo::degraded`] reported down on the running VM `name` (qemu:
    /// start its `boxery-net` again; QEMU reconnects to it), without restarting the guest. A
    /// no-op when nothing is down or the VM is not running. Called by the reconciler on a step
    /// that finds the VM degraded.
    async fn repair(&self, name: &str) -> Result<()> {
        let _ = name;
        Ok(())
    }
    /// How `name`'s guest reaches the credential proxy; `None` when it cannot (the fake
    /// backend's VMs have no guest).
    fn guest_proxy(&self, name: &str) -> Option<GuestProxy> {
        let _ = name;
        None
    }
    /// How `name`'s guest reaches the host on its network; `None` when it has none (the fake
    /// backend's VMs have no guest).
    async fn guest_network(&self, name: &str) -> Result<Option<GuestNetwork>> {
        let _ = name;
        Ok(None)
    }
    /// How VMs are accelerated, in one sentence for status and events ("TCG (emulation,
    /// slow): …" or "KVM"), where the backend knows.
    fn accelerator(&self) -> Option<String> {
        None
    }
    /// The guest's host key read through the hypervisor, where the backend can.
    async fn host_key(&self, name: &str) -> Result<Option<String>> {
        let _ = name;
        Ok(None)
    }
    /// What a stopped VM's hypervisor said last, where the backend keeps it (QEMU's own log:
    /// an assertion that aborted it, the signal that ended it), for the event that reports a
    /// VM which stopped on its own. Read before the VM is started again.
    async fn last_exit(&self, name: &str) -> Option<String> {
        let _ = name;
        None
    }
    /// What each running VM uses of the host now (its hypervisor's CPU time and memory, its
    /// network bytes); empty where the backend cannot tell ([`Capabilities::usage`]). Reads
    /// the host's process table and counters only: cheap enough to sample every few seconds.
    async fn usage(&self) -> Result<Vec<VmUsage>> {
        Ok(Vec::new())
    }
    /// The running VM `name`'s screen as its hypervisor draws it (its text console, or
    /// whatever the guest draws on its virtual display), where the backend has one
    /// ([`Capabilities::screen`]); `Unsupported` otherwise, `Invalid` when the VM is not
    /// running.
    async fn screendump(&self, name: &str) -> Result<Screen> {
        let _ = name;
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "show a VM's screen".into(),
        })
    }
    /// Send `events` to the running VM `name`'s keyboard and tablet, in order, as one batch
    /// where the hypervisor allows ([`Capabilities::screen`]); `Unsupported` otherwise,
    /// `Invalid` when the VM is not running, and for a batch that cannot be sent: a position
    /// off the screen (before any of it is sent), a key name the hypervisor does not know
    /// (the error says how many events before it were sent). A long batch may be paced
    /// (QEMU: a few keys at a time, for the guest's keyboard to keep up), so it takes time in
    /// proportion to its keys.
    async fn send_input(&self, name: &str, events: &[InputEvent]) -> Result<()> {
        let _ = (name, events);
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "send input to a VM's screen".into(),
        })
    }
    /// A VNC (RFB) connection to the running VM `name`'s screen, served by its hypervisor on
    /// the host where the backend has one ([`Capabilities::screen`]): nothing in the guest
    /// (a headless VM's console, a guest stuck at boot). `Unsupported` otherwise, `Invalid`
    /// when the VM is not running or its hypervisor serves none. Every key and pointer event
    /// a client sends reaches the VM: a caller that must only watch filters them.
    async fn console_vnc(&self, name: &str) -> Result<tokio::net::UnixStream> {
        let _ = name;
        Err(BackendError::Unsupported {
            backend: self.name().into(),
            what: "watch a VM's console".into(),
        })
    }
}

/// The last line of a hypervisor log worth showing: not blank, not libvirt's own
/// `… shutting down, reason=…` bookkeeping; at most 300 characters.
#[cfg_attr(not(any(feature = "qemu", feature = "libvirt")), allow(dead_code))]
pub(crate) fn last_words(log: &str) -> Option<String> {
    let line = log
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.contains(": shutting down, reason="))?;
    Some(line.chars().take(300).collect())
}

/// 8 hex digits of FNV-1a over `s`: a stable namespace id for a state directory (the libvirt
/// and incus backends name what they make on a shared daemon with it).
pub fn namespace_of(s: &str) -> String {
    let h = boxery_api::fnv::fnv1a(s.as_bytes());
    format!("{:08x}", (h ^ (h >> 32)) as u32)
}

/// Where a backend keeps its state: `$BOXERY_HOME/<backend>/`.
pub fn state_dir(home: &std::path::Path, backend: &str) -> PathBuf {
    boxery_home::layout::backend(home, backend)
}

/// Names of the backends this build has.
pub const BACKENDS: &[&str] = &[
    "fake",
    #[cfg(feature = "qemu")]
    "qemu",
    #[cfg(feature = "libvirt")]
    "libvirt",
    #[cfg(feature = "incus")]
    "incus",
];

/// Make a backend by name, its state under `home`.
pub fn by_name(name: &str, home: &std::path::Path) -> Result<Arc<dyn Backend>> {
    match name {
        "fake" => Ok(Arc::new(fake::FakeBackend::new(state_dir(home, "fake")))),
        #[cfg(feature = "qemu")]
        "qemu" => Ok(Arc::new(qemu::QemuBackend::new(state_dir(home, "qemu")))),
        #[cfg(feature = "libvirt")]
        "libvirt" => Ok(Arc::new(libvirt::LibvirtBackend::new(state_dir(
            home, "libvirt",
        )))),
        #[cfg(feature = "incus")]
        "incus" => Ok(Arc::new(incus::IncusBackend::new(state_dir(home, "incus")))),
        other => Err(BackendError::Invalid(format!(
            "unknown backend `{other}`: use one of {}",
            BACKENDS.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn last_words_skip_blank_lines_and_libvirt_bookkeeping() {
        assert_eq!(
            super::last_words("a\nqemu: terminating on signal 15\n\n").as_deref(),
            Some("qemu: terminating on signal 15")
        );
        assert_eq!(
            super::last_words(
                "qemu: boom\n2026-11-30 07:26:03.802+0000: shutting down, reason=crashed\n"
            )
            .as_deref(),
            Some("qemu: boom")
        );
        assert_eq!(super::last_words("\n  \n"), None);
        assert_eq!(super::last_words(&"x".repeat(400)).unwrap().len(), 300);
    }
}
