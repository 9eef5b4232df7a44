//! `Image`: an immutable, disk-only copy of a VM's disk, a built base, or an imported file.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::Time;
use crate::quantity::Quantity;
use crate::resource::{ForceDelete, KindInfo, READY, Typed, impl_resource, resource};
use crate::validate::FieldError;
use crate::vm::Operation;

resource!(
    /// A disk image: a snapshot of a VM, a built base, or an imported file.
    Image, ImageSpec, ImageStatus
);
impl_resource!(
    Image,
    KindInfo {
        kind: "Image",
        plural: "images",
        singular: "image",
        short_names: &["img"],
        dotted_names: true,
        description: "A disk-only, independent image: a snapshot of a VM (`source.vm`), a built base (`source.build`) or an imported file (`source.file`).",
        controllers_only: None,
        columns: &[
            columns::NAME,
            columns::STATUS,
            columns::SOURCE,
            Column::new(
                "SIZE",
                Cell::Computed(&["/status/sizeBytes"], |v| match v[0].as_u64() {
                    Some(b) => Quantity::from_bytes(b.div_ceil(1 << 20) << 20).to_string(),
                    None => "<none>".into(),
                }),
            ),
            Column::wide("BACKEND", Cell::Field("/status/backend")),
            Column::wide("OWNER", Cell::Field("/metadata/ownerReferences/0/name")),
            columns::AGE,
        ],
        settled: |_| &[READY],
        force_delete: ForceDelete::BackendImage,
        typed: Typed::of::<Image>(),
    },
    normalize = normalize_image
);

/// The label on an Image made for a fork with memory (`boxery fork --with-memory`), naming
/// its source VM (`spec.source.vm`). The Vm controller deletes it once every VM made from it
/// exists.
pub const MEMORY_FORK_LABEL: &str = "boxery.dev/memory-fork-of";

/// The desired state of an image. Images are immutable: the source is read once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageSpec {
    /// Where the image's disk comes from.
    pub source: ImageSource,
    /// With `source: {vm}`: capture the running VM's memory and device state too, at the
    /// same instant as its disk (the guest pauses for the copy), so a revert with memory
    /// (`spec.restore.memory` on that VM) brings it back running where it was, processes
    /// intact (docs/live-memory.md). Refused, not retried, when the VM is not running or its
    /// backend cannot. Default `false`: the disk only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory: bool,
}

/// Where an image comes from: exactly one of `vm`, `build` or `file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum ImageSource {
    /// A snapshot of this VM's disk as it is now (works while the VM runs).
    Vm(String),
    /// Built from Debian's packages with these layers.
    Build(BuildSpec),
    /// Imported from a qcow2 file on the control plane's host.
    File(String),
}

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuildSpec {
    /// The distribution to start from (`debian-12`).
    pub base: String,
    /// Layers to build in on top of the base's own (`boxery images layers` lists them; e.g.
    /// `[agents]`): the image is built once per base and set of layers, and shared by every
    /// Image that asks for the same (`debian-12` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
}

/// A guest layer: a script under `image/layers/` run as root at build time, one source of
/// truth for what `spec.source.build.layers` accepts and what `boxery images layers` prints.
#[derive(Debug, Clone, Copy)]
pub struct Layer {
    /// Its name.
    pub name: &'static str,
    /// What it installs.
    pub installs: &'static str,
    /// Whether every `debian-12` has it already (it cannot be asked for).
    pub in_base: bool,
}

/// Every layer, in the order they are built.
pub const LAYERS: &[Layer] = &[
    Layer {
        name: "plumbing",
        installs: "the agent user (passwordless sudo), sshd settings, cloud-init's user, tmux, socat, qemu-guest-agent, security updates",
        in_base: true,
    },
    Layer {
        name: "devtools",
        installs: "git, python3 (venv), jq, ripgrep, fd, curl, build-essential, pkg-config, unzip, xz, file",
        in_base: true,
    },
    Layer {
        name: "agents",
        installs: "Node.js 22 and npm (from the npm registry), claude (Claude Code), codex (OpenAI Codex CLI), opencode; set up to reach their providers through boxery's credential proxy",
        in_base: false,
    },
];

/// The base that layers can be built on.
pub const LAYERED_BASE: &str = "debian-12";

/// The layers that can be asked for, for messages.
fn askable() -> String {
    LAYERS
        .iter()
        .filter(|l| !l.in_base)
        .map(|l| l.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Check `layers` (for base `base`) and put them in build order without repeats: the one order a
/// set of layers is built and cached in.
pub fn normalize_layers(base: &str, layers: &[String]) -> Result<Vec<String>, String> {
    if layers.is_empty() {
        return Ok(Vec::new());
    }
    if base != LAYERED_BASE {
        return Err(format!(
            "only {LAYERED_BASE} is built with layers (`{base}` has none): use base {LAYERED_BASE}"
        ));
    }
    for l in layers {
        match LAYERS.iter().find(|k| k.name == l) {
            None => {
                return Err(format!(
                    "no layer `{}`: the layers are {} (`boxery images layers`)",
                    crate::name::shown(l),
                    askable()
                ));
            }
            Some(k) if k.in_base => {
                return Err(format!(
                    "every {LAYERED_BASE} has `{l}` already: remove it (the layers to ask for: {})",
                    askable()
                ));
            }
            Some(_) => {}
        }
    }
    Ok(LAYERS
        .iter()
        .filter(|k| layers.iter().any(|l| l == k.name))
        .map(|k| k.name.to_string())
        .collect())
}

/// An image's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum ImagePhase {
    /// Waiting for its source.
    #[default]
    Pending,
    /// Being captured or built.
    Capturing,
    /// Ready to use.
    Ready,
    /// A step failed and is being retried with backoff.
    Failed,
    /// Gone from the backend behind boxery's back.
    Lost,
    /// Being deleted.
    Terminating,
}

crate::vm::recorded_status! {
    /// The observed state of an image. Its conditions: `Ready`, `SourceAvailable`, ….
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ImageStatus {
        /// Phase.
        #[serde(default)]
        pub phase: ImagePhase,
    } then {
        /// When it became ready.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub created_at: Option<Time>,
        /// Bytes it takes on the host (its own data, not a shared base).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub size_bytes: Option<u64>,
        /// Bytes its saved memory takes on the host (`spec.memory`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub memory_bytes: Option<u64>,
        /// The side effect under way.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub operation: Option<Operation>,
    }
}

fn normalize_image(img: &mut Image) -> Result<(), Vec<FieldError>> {
    let mut errs = Vec::new();
    match &mut img.spec.source {
        ImageSource::Vm(v) => {
            if let Err(e) = crate::validate::check_label_name(v) {
                errs.push(FieldError::new("spec.source.vm", e));
            }
        }
        ImageSource::Build(b) => {
            match normalize_layers(&b.base, &b.layers) {
                Ok(l) => b.layers = l,
                Err(e) => errs.push(FieldError::new("spec.source.build.layers", e)),
            }
            if !crate::vm::STOCK_IMAGES.contains(&b.base.as_str()) {
                errs.push(FieldError::new(
                    "spec.source.build.base",
                    format!(
                        "`{}` cannot be built: use one of {}",
                        b.base,
                        crate::vm::STOCK_IMAGES.join(", ")
                    ),
                ));
            }
        }
        ImageSource::File(p) => {
            if !p.starts_with('/') {
                errs.push(FieldError::new(
                    "spec.source.file",
                    "give an absolute path".to_string(),
                ));
            }
        }
    }
    if img.spec.memory && !matches!(img.spec.source, ImageSource::Vm(_)) {
        errs.push(FieldError::new(
            "spec.memory",
            "only an image of a running VM (`source: {vm: NAME}`) can carry memory".to_string(),
        ));
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}
