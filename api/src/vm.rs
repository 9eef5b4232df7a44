//! `Vm`: one virtual machine, its source, size and run strategy.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::Time;
use crate::network::Network;
use crate::quantity::Quantity;
use crate::resource::{ForceDelete, KindInfo, READY, Settled, Typed, impl_resource, resource};
use crate::validate::FieldError;

resource!(
    /// A virtual machine: where its disk comes from, how big it is, whether it runs.
    Vm, VmSpec, VmStatus
);
impl_resource!(
    Vm,
    KindInfo {
        kind: "Vm",
        plural: "vms",
        singular: "vm",
        short_names: &["vm"],
        dotted_names: false,
        description: "A virtual machine: its source image or VM, resources, run strategy and revert requests.",
        controllers_only: None,
        columns: &[
            columns::NAME,
            columns::STATUS,
            Column::new("READY", Cell::Ready),
            Column::new("CPUS", Cell::Field("/spec/resources/cpus")),
            Column::new("MEMORY", Cell::Field("/spec/resources/memory")),
            Column::new("DISK", Cell::Field("/spec/resources/disk")),
            columns::SOURCE,
            Column::wide("RUN", Cell::Field("/spec/runStrategy")),
            Column::wide("SSH", Cell::Field("/status/ssh/endpoint")),
            Column::wide("BACKEND", Cell::Field("/status/backend")),
            Column::wide(
                "EGRESS",
                Cell::FieldOr("/spec/network/egress/policy", "Public")
            ),
            Column::wide(
                "GEN",
                Cell::Computed(
                    &["/status/observedGeneration", "/metadata/generation"],
                    |v| format!("{}/{}", columns::text(v[0]), columns::text(v[1])),
                ),
            ),
            columns::AGE,
        ],
        settled: |vm| {
            if vm.spec()["runStrategy"] == "Stopped" {
                &[Settled::Phase("Stopped")]
            } else {
                &[READY]
            }
        },
        force_delete: ForceDelete::BackendVm,
        immutable: &["/spec/source", "/spec/instanceType"],
        typed: Typed::of::<Vm>(),
    },
    normalize = normalize_vm,
    unimplemented = unimplemented_vm
);

/// The default stock image, built on first use.
pub const STOCK_IMAGE: &str = "debian-12";

/// The stock images a backend can build, each created (as an Image named after it) the first
/// time a Vm uses it: `debian-12` (the real guest) and `tiny` (a small busybox+dropbear test
/// guest that boots in seconds under emulation).
pub const STOCK_IMAGES: &[&str] = &["debian-12", "tiny"];

/// The desired state of a VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmSpec {
    /// Where the VM's disk comes from. Fixed once the VM is created.
    pub source: VmSource,
    /// What kind of instance it is: `virtual-machine` (its own kernel) or `container` (a
    /// system container on the incus backend: the host's kernel, a weaker boundary;
    /// docs/security.md). Unset, the backend makes the kind it runs (`boxery backends`);
    /// set, a backend that cannot make that kind refuses the VM instead of making another.
    /// `status.instanceType` says what was made. Fixed once the VM is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_type: Option<InstanceType>,
    /// CPUs, memory and disk. Missing fields come from `shape` (default `small`).
    #[serde(default)]
    pub resources: Resources,
    /// No desktop (the default). `false` on `source: {image: debian-12}` adds the `desktop`
    /// layer (an X display, a window manager, xdotool: docs/desktop.md), and a VM with that
    /// layer is not headless; a VM made from another image has the desktop its image has.
    /// A desktop VM needs at least 1 GiB of memory.
    #[serde(default = "yes")]
    pub headless: bool,
    /// Layers on top of the stock base's own (`boxery images layers` lists them; e.g.
    /// `[agents]`), with `source: {image: debian-12}`: the VM is made from the Image built
    /// from the base with these layers (`debian-12-agents`, made or reused). A layer added to
    /// a running VM's list is copied into it in place from that build and recorded in
    /// `status.layers`; a layer cannot be removed from a VM (docs/images.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// Whether the VM should run.
    #[serde(default)]
    pub run_strategy: RunStrategy,
    /// A revert request: replace the disk with that image's, once per `requestedAt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<Restore>,
    /// Where the guest may connect out (docs/egress.md). Default: `egress: {policy: Public}`.
    #[serde(default, skip_serializing_if = "Network::is_default")]
    pub network: Network,
    /// Suspend the VM when nobody has used it for a while; the next use resumes it
    /// (docs/live-memory.md, "Auto-suspend"). Default: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<Idle>,
    /// The desktop's screen size, on a VM with a desktop (`headless: false`). Default
    /// 1280×800. Changed on a running VM, the desktop starts again at the new size (its
    /// windows close); docs/desktop.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<Display>,
}

/// A desktop's screen size, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Display {
    /// Width: 640 to 7680.
    #[schemars(range(min = 640, max = 7680))]
    pub width: u32,
    /// Height: 480 to 4320.
    #[schemars(range(min = 480, max = 4320))]
    pub height: u32,
}

impl Display {
    /// The size a desktop has when `spec.display` is not set.
    pub const DEFAULT: Display = Display {
        width: 1280,
        height: 800,
    };
    /// The widths allowed.
    pub const WIDTHS: std::ops::RangeInclusive<u32> = 640..=7680;
    /// The heights allowed.
    pub const HEIGHTS: std::ops::RangeInclusive<u32> = 480..=4320;
    /// The guest's file that gives the desktop layer's display its size (`BOXERY_DISPLAY=WxH`):
    /// written by a new VM's seed, so the display starts at its size at the first boot, and by
    /// the control plane when `spec.display` changes.
    pub const FILE: &'static str = "/etc/boxery/desktop.env";
    /// The first line of a [`Display::FILE`] boxery wrote: a file without it was written by
    /// hand, and is left alone when the spec sets no size.
    pub const MARK: &'static str = "# boxery: spec.display";

    /// What boxery writes in [`Display::FILE`] for this size.
    pub fn file_text(&self) -> String {
        format!("{}\nBOXERY_DISPLAY={self}\n", Self::MARK)
    }
}

impl std::fmt::Display for Display {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}

/// When an unused VM is suspended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Idle {
    /// How long without a command, file or copy action, interactive session or proxied
    /// request before the VM is suspended: a number and a unit, `s`, `m`, `h` or `d`, or
    /// several (`10m`, `1h30m`); 10s to 30d.
    #[schemars(regex(pattern = r"^([0-9]+[smhd])+$"))]
    pub suspend_after: String,
}

/// The annotation a use writes on a VM suspended for being idle (RFC 3339, when): the write
/// wakes its controller, which resumes it.
pub const WOKEN_AT: &str = "boxery.dev/woken-at";

/// The annotation the pool controller puts on a new member of a warm pool: start from the
/// memory of the Image it names (another member's clean image) rather than boot from
/// `spec.source`. Honoured only for the clean image of a member of the VM's own pool
/// (`boxery.dev/pool`), ready, whose memory fits the VM; otherwise the VM is made from
/// `spec.source` as usual.
pub const START_FROM_MEMORY: &str = "boxery.dev/start-from-memory";

/// Shortest and longest `spec.idle.suspendAfter`.
pub const IDLE_RANGE: (u64, u64) = (10, 30 * 86_400);

impl Idle {
    /// `suspendAfter` as a duration, or why it is not one (in range).
    pub fn after(&self) -> Result<std::time::Duration, String> {
        let s = self.suspend_after.trim();
        let mut total: u64 = 0;
        let mut num = String::new();
        for c in s.chars() {
            if c.is_ascii_digit() {
                num.push(c);
                continue;
            }
            let unit = match c {
                's' => 1,
                'm' => 60,
                'h' => 3600,
                'd' => 86_400,
                _ => {
                    return Err(format!(
                        "`{s}` is not a duration: use a number and s, m, h or d (`10m`, `1h30m`)"
                    ));
                }
            };
            let n: u64 = num.parse().map_err(|_| {
                format!("`{s}` is not a duration: each unit needs a number before it (`10m`)")
            })?;
            total = total.saturating_add(n.saturating_mul(unit));
            num.clear();
        }
        if !num.is_empty() || s.is_empty() {
            return Err(format!(
                "`{s}` is not a duration: end each number with s, m, h or d (`10m`)"
            ));
        }
        let (min, max) = IDLE_RANGE;
        if total < min || total > max {
            return Err(format!("`{s}` is out of range: use 10s to 30d"));
        }
        Ok(std::time::Duration::from_secs(total))
    }
}

fn yes() -> bool {
    true
}

/// Where a VM's disk comes from: exactly one of `image`, `vm` or `base`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum VmSource {
    /// An `Image` by name (`debian-12` is built on first use).
    Image(String),
    /// Another VM's disk as it is now: a fork (captured, then cloned).
    Vm(String),
    /// A built base image (the desktop base, later).
    Base(String),
}

impl VmSource {
    /// The name it points at.
    pub fn name(&self) -> &str {
        match self {
            VmSource::Image(n) | VmSource::Vm(n) | VmSource::Base(n) => n,
        }
    }
}

/// The VM's size. Explicit fields win over `shape`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resources {
    /// A named size that fills in missing fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Shape>,
    /// Virtual CPUs (1..64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub cpus: Option<u32>,
    /// Guest memory (64Mi..256Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// Disk size (1Gi..16Ti). Disks only grow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<Quantity>,
}

/// Named sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Shape {
    /// 1 CPU, 1Gi memory, 10Gi disk.
    #[serde(rename = "small")]
    Small,
    /// 2 CPUs, 4Gi memory, 20Gi disk.
    #[serde(rename = "standard")]
    Standard,
    /// 4 CPUs, 8Gi memory, 40Gi disk.
    #[serde(rename = "large")]
    Large,
}

impl Shape {
    /// (cpus, memory, disk).
    pub fn size(self) -> (u32, Quantity, Quantity) {
        match self {
            Shape::Small => (1, Quantity::gib(1), Quantity::gib(10)),
            Shape::Standard => (2, Quantity::gib(4), Quantity::gib(20)),
            Shape::Large => (4, Quantity::gib(8), Quantity::gib(40)),
        }
    }
}

/// A size with every field known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Size {
    /// Virtual CPUs.
    pub cpus: u32,
    /// Memory.
    pub memory: Quantity,
    /// Disk.
    pub disk: Quantity,
}

impl Resources {
    /// The size with defaults filled in.
    pub fn effective(&self) -> Size {
        let (c, m, d) = self.shape.unwrap_or(Shape::Small).size();
        Size {
            cpus: self.cpus.unwrap_or(c),
            memory: self.memory.unwrap_or(m),
            disk: self.disk.unwrap_or(d),
        }
    }
}

/// What kind of instance a VM is ([`VmSpec::instance_type`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceType {
    /// A virtual machine: its own kernel, behind the hypervisor.
    VirtualMachine,
    /// A system container: its own init and users, the host's kernel.
    Container,
}

impl InstanceType {
    /// Its name in manifests (`virtual-machine`, `container`).
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceType::VirtualMachine => "virtual-machine",
            InstanceType::Container => "container",
        }
    }
}

impl fmt::Display for InstanceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a VM should run: an intent, not a bool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum RunStrategy {
    /// Keep it running; start it when it stops.
    #[default]
    Running,
    /// Keep it stopped.
    Stopped,
    /// Keep its memory and device state on disk, its hypervisor gone and the host's RAM free
    /// (docs/live-memory.md). Set back to `Running`, it resumes where it was: same processes,
    /// open files and sessions, in about a second. A VM that is stopped stays stopped (there is
    /// no memory to keep); `Stopped` discards a suspended VM's memory.
    Suspended,
}

/// A revert request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Restore {
    /// The image whose disk replaces the VM's.
    pub image: String,
    /// When it was asked for; a new time asks again. Served once.
    pub requested_at: Time,
    /// Also restore the memory the image holds (an Image with `memory: true` of this same
    /// VM): the VM comes back running where it was when the image was taken.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory: bool,
}

/// A VM's lifecycle phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum VmPhase {
    /// Not acted on yet, or waiting (for its image, its source VM).
    #[default]
    Pending,
    /// Being created.
    Creating,
    /// Running.
    Running,
    /// Stopped.
    Stopped,
    /// Its memory is on disk and its hypervisor gone (`runStrategy: Suspended`).
    Suspended,
    /// Its disk is being replaced from an image.
    Restoring,
    /// A step failed and is being retried with backoff (see conditions and events).
    Failed,
    /// Gone from the backend behind boxery's back.
    Lost,
    /// Being deleted.
    Terminating,
}

/// Defines the status of a kind `reconcilers::recorded` reconciles (Vm, Image): its phase
/// (the first group of fields), then what every such status has (`printableStatus`,
/// `observedGeneration`, `conditions`, `backend`), its own fields (the second group), and the
/// failure record (`failures`, `lastFailure`).
macro_rules! recorded_status {
    (
        $(#[$attr:meta])*
        pub struct $name:ident { $($phase:tt)* } then { $($own:tt)* }
    ) => {
        $(#[$attr])*
        pub struct $name {
            $($phase)*
            /// One word for `boxery get`: the phase, or what stands in its way.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub printable_status: Option<String>,
            /// The generation the controller last acted on.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub observed_generation: Option<i64>,
            /// Observations: `Ready` and the others this status's description names.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            pub conditions: Vec<crate::meta::Condition>,
            /// The backend that holds it.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub backend: Option<String>,
            $($own)*
            /// Consecutive failures of the current step (reset on success).
            #[serde(default, skip_serializing_if = "crate::vm::is_zero")]
            pub failures: u32,
            /// The last failure, for `describe`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub last_failure: Option<crate::vm::Failure>,
        }
    };
}
pub(crate) use recorded_status;

pub(crate) fn is_zero(n: &u32) -> bool {
    *n == 0
}

recorded_status! {
    /// The observed state of a VM. Its conditions: `Ready`, `Created`, `ImageAvailable`,
    /// `Lost`, `BackendReachable`, ….
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct VmStatus {
        /// Lifecycle phase.
        #[serde(default)]
        pub phase: VmPhase,
    } then {
        /// How the VM is accelerated (`Kvm`, or `Tcg` with the reason KVM is not used), as the
        /// backend said when it created the VM.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub acceleration: Option<String>,
        /// What kind of instance the backend made (`spec.instanceType`, or the backend's own
        /// kind when that is unset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub instance_type: Option<InstanceType>,
        /// The image the VM's disk was made from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub source_image: Option<String>,
        /// When the VM was created in the backend.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub created_at: Option<Time>,
        /// The size the backend has now.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub size: Option<Size>,
        /// The host's boot id when the control plane last saw the VM: a `Ready` from another boot
        /// (the host rebooted since) is void until a control plane looks again.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub boot_id: Option<String>,
        /// How to reach the VM's sshd.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub ssh: Option<SshStatus>,
        /// The side effect under way, recorded before it starts.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub operation: Option<Operation>,
        /// The last revert served (its `requestedAt`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_restore: Option<Restore>,
        /// The memory saved while the VM is suspended: when and how much.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub memory: Option<SavedMemory>,
        /// The layers the VM has on top of its base's own: those it was made with, and those
        /// added in place since (`spec.layers`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub layers: Vec<String>,
        /// What the guest was built with: its source image's record at creation, read back
        /// from the guest's `/etc/boxery/build-info` after a layer is added in place.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub build_info: Option<crate::image::BuildInfo>,
        /// When the controller suspended the VM because nobody had used it for
        /// `spec.idle.suspendAfter`; its next use resumes it. Cleared once it runs again.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub idle_suspended_at: Option<Time>,
        /// What the VM used since it was made (whoever held it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub usage: Option<crate::usage::Usage>,
    }
}

/// A suspended VM's saved memory and device state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SavedMemory {
    /// When it was saved.
    pub saved_at: Time,
    /// Bytes it takes on the host's disk.
    pub bytes: u64,
}

/// How to reach a VM's sshd.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SshStatus {
    /// `HOST:PORT` as this host reaches it, while the VM runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The pinned host key (`ssh-ed25519 AAAA…`), generated on the host when the VM got its
    /// identity: every ssh to the VM checks it (no trust on first use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_key: Option<String>,
}

/// A side effect recorded before it starts, so that a crash leaves a trail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Operation {
    /// What is being done.
    #[serde(rename = "type")]
    pub type_: OperationType,
    /// The image involved (create from, reimage from, capture into).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The source VM's state before a capture (`Running`/`Stopped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_state: Option<String>,
    /// When it started.
    pub started_at: Time,
    /// The control plane that started it.
    pub holder: String,
}

/// Kinds of recorded side effects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OperationType {
    /// Creating the VM in the backend.
    Create,
    /// Replacing its disk from an image.
    Reimage,
    /// Copying a VM's disk into an image.
    Capture,
    /// Building an image.
    Build,
}

/// A failed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Failure {
    /// The step (`create`, `start`, …).
    pub step: String,
    /// What went wrong.
    pub message: String,
    /// When.
    pub at: Time,
    /// Whether retrying cannot help until the spec changes (the request is invalid).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub terminal: bool,
}

/// Largest sizes accepted at all (the backend checks the host's real limits).
pub const MAX_CPUS: u32 = 64;
/// Smallest guest memory.
pub const MIN_MEMORY: Quantity = Quantity::mib(64);
/// Largest guest memory.
pub const MAX_MEMORY: Quantity = Quantity::gib(256);
/// Smallest disk.
pub const MIN_DISK: Quantity = Quantity::gib(1);
/// Largest disk.
pub const MAX_DISK: Quantity = Quantity::gib(16 * 1024);

fn normalize_vm(vm: &mut Vm) -> Result<(), Vec<FieldError>> {
    let mut errs = Vec::new();
    let r = &vm.spec.resources;
    if let Some(m) = r.memory
        && (m < MIN_MEMORY || m > MAX_MEMORY)
    {
        errs.push(FieldError::new(
            "spec.resources.memory",
            format!("{m} is out of range: use 64Mi to 256Gi"),
        ));
    }
    if let Some(d) = r.disk
        && (d < MIN_DISK || d > MAX_DISK)
    {
        errs.push(FieldError::new(
            "spec.resources.disk",
            format!("{d} is out of range: use 1Gi to 16Ti"),
        ));
    }
    if let Some(c) = r.cpus
        && (c == 0 || c > MAX_CPUS)
    {
        errs.push(FieldError::new(
            "spec.resources.cpus",
            format!("{c} is out of range: use 1 to {MAX_CPUS}"),
        ));
    }
    if let Some(idle) = &vm.spec.idle
        && let Err(why) = idle.after()
    {
        errs.push(FieldError::new("spec.idle.suspendAfter", why));
    }
    let src = vm.spec.source.name().to_string();
    let path = match vm.spec.source {
        VmSource::Image(_) => "spec.source.image",
        VmSource::Vm(_) => "spec.source.vm",
        VmSource::Base(_) => "spec.source.base",
    };
    let ok = match vm.spec.source {
        VmSource::Vm(_) => crate::validate::check_label_name(&src),
        _ => crate::validate::check_subdomain_name(&src),
    };
    if let Err(e) = ok {
        errs.push(FieldError::new(path, e));
    }
    if matches!(&vm.spec.source, VmSource::Vm(n) if *n == vm.metadata.name) {
        errs.push(FieldError::new(
            path,
            "a VM cannot be forked from itself".into(),
        ));
    }
    if let Some(r) = &vm.spec.restore
        && let Err(e) = crate::validate::check_subdomain_name(&r.image)
    {
        errs.push(FieldError::new("spec.restore.image", e));
    }
    errs.extend(vm.spec.network.egress.check("spec.network.egress"));
    desktop_is_a_layer(&mut vm.spec);
    if let Err(e) = normalize_spec_layers(&mut vm.spec) {
        errs.push(e);
    }
    // (a layer that needs the desktop, added with it)
    desktop_is_a_layer(&mut vm.spec);
    // Defaults are written into the object, so an upgrade never changes a stored VM's size.
    let eff = vm.spec.resources.effective();
    if vm.spec.layers.iter().any(|l| l == DESKTOP) && eff.memory.as_mib() < DESKTOP_MIN_MIB {
        errs.push(FieldError::new(
            "spec.resources.memory",
            format!(
                "a desktop VM needs at least {DESKTOP_MIN_MIB}Mi of memory (its X server, window manager and apps), not {}: set spec.resources.memory: 1Gi or more (or shape: medium)",
                eff.memory
            ),
        ));
    }
    if let Some(d) = vm.spec.display {
        if vm.spec.headless {
            errs.push(FieldError::new(
                "spec.display",
                "only a VM with a desktop has a display: set headless: false, or remove spec.display".into(),
            ));
        }
        if !Display::WIDTHS.contains(&d.width) || !Display::HEIGHTS.contains(&d.height) {
            errs.push(FieldError::new(
                "spec.display",
                format!(
                    "{d} is outside {}x{} to {}x{}: set a width of {}–{} and a height of {}–{} (the schema says the same)",
                    Display::WIDTHS.start(),
                    Display::HEIGHTS.start(),
                    Display::WIDTHS.end(),
                    Display::HEIGHTS.end(),
                    Display::WIDTHS.start(),
                    Display::WIDTHS.end(),
                    Display::HEIGHTS.start(),
                    Display::HEIGHTS.end(),
                ),
            ));
        }
    }
    vm.spec.resources.cpus = Some(eff.cpus);
    vm.spec.resources.memory = Some(eff.memory);
    vm.spec.resources.disk = Some(eff.disk);
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// The layer that gives a VM a desktop.
pub const DESKTOP: &str = "desktop";
/// The least memory a desktop VM is made with, in MiB.
pub const DESKTOP_MIN_MIB: u64 = 1024;

/// `headless: false` on the layered base is the desktop layer, and the desktop layer makes a
/// VM not headless: one fact, written both ways.
fn desktop_is_a_layer(spec: &mut VmSpec) {
    let on_base = matches!(&spec.source, VmSource::Image(n) | VmSource::Base(n) if n == crate::image::LAYERED_BASE);
    if !spec.headless && on_base && !spec.layers.iter().any(|l| l == DESKTOP) {
        spec.layers.push(DESKTOP.into());
    }
    if spec.layers.iter().any(|l| l == DESKTOP) {
        spec.headless = false;
    }
}

/// Check `spec.layers` and put them in build order ([`crate::image::normalize_layers`]): they
/// are built on the stock base, so the source must be it.
fn normalize_spec_layers(spec: &mut VmSpec) -> Result<(), FieldError> {
    if spec.layers.is_empty() {
        return Ok(());
    }
    let base = crate::image::LAYERED_BASE;
    match &spec.source {
        VmSource::Image(n) | VmSource::Base(n) if n == base => {}
        other => {
            return Err(FieldError::new(
                "spec.layers",
                format!(
                    "layers are built on {base}: set spec.source to {{image: {base}}} (a VM made from `{}` has that image's layers, and layers cannot be added to it)",
                    crate::name::shown(other.name())
                ),
            ));
        }
    }
    spec.layers = crate::image::normalize_layers(base, &spec.layers)
        .map_err(|e| FieldError::new("spec.layers", e))?;
    Ok(())
}

/// The fields of a Vm that validate but that nothing acts on yet.
fn unimplemented_vm(vm: &Vm) -> Vec<FieldError> {
    unimplemented(&vm.spec, "spec.")
}

/// The fields of a Vm spec that validate but that nothing acts on yet (`prefix` is where the
/// spec sits: `spec.` in a Vm, `spec.template.spec.` in a Pool): none today.
pub(crate) fn unimplemented(spec: &VmSpec, prefix: &str) -> Vec<FieldError> {
    let _ = (spec, prefix);
    Vec::new()
}

#[cfg(test)]
mod idle_tests {
    use super::Idle;
    use std::time::Duration;

    fn after(s: &str) -> Result<Duration, String> {
        Idle {
            suspend_after: s.into(),
        }
        .after()
    }

    #[test]
    fn suspend_after_reads_units_and_sums_them_in_range() {
        assert_eq!(after("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(after("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(after("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(after("30d"), Ok(Duration::from_secs(30 * 86_400)));
        for bad in [
            "",
            "10",
            "m",
            "5s",
            "31d",
            "10x",
            "1.5h",
            "-1m",
            "99999999999999999999d",
        ] {
            let e = after(bad).unwrap_err();
            assert!(e.contains("duration") || e.contains("range"), "{bad}: {e}");
        }
    }
}

#[cfg(test)]
mod layers_tests {
    use super::*;

    fn vm(source: serde_json::Value, layers: serde_json::Value) -> Vm {
        serde_json::from_value(serde_json::json!({
            "apiVersion": crate::API_VERSION, "kind": "Vm", "metadata": {"name": "a"},
            "spec": {"source": source, "layers": layers},
        }))
        .unwrap()
    }

    #[test]
    fn layers_are_checked_and_put_in_build_order_on_the_stock_base_only() {
        let mut v = vm(
            serde_json::json!({"image": "debian-12"}),
            serde_json::json!(["agents", "agents"]),
        );
        normalize_vm(&mut v).unwrap();
        assert_eq!(v.spec.layers, ["agents"]);
        assert!(unimplemented_vm(&v).is_empty(), "layers are implemented");
        let msg = |v: &mut Vm| {
            let e = normalize_vm(v).unwrap_err();
            format!("{}: {}", e[0].path, e[0].message)
        };
        let e = msg(&mut vm(
            serde_json::json!({"image": "debian-12"}),
            serde_json::json!(["gpu"]),
        ));
        assert!(
            e.starts_with("spec.layers: no layer `gpu`") && e.contains("agents"),
            "{e}"
        );
        let e = msg(&mut vm(
            serde_json::json!({"image": "debian-12"}),
            serde_json::json!(["devtools"]),
        ));
        assert!(e.contains("already"), "{e}");
        for src in [
            serde_json::json!({"image": "tiny"}),
            serde_json::json!({"vm": "b"}),
            serde_json::json!({"image": "snap1"}),
        ] {
            let e = msg(&mut vm(src, serde_json::json!(["agents"])));
            assert!(
                e.starts_with("spec.layers: layers are built on debian-12: set spec.source to {image: debian-12}"),
                "{e}"
            );
        }
    }
}
