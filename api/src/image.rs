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
    normalize = normalize_image,
    unimplemented = unimplemented
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
    /// Guest layers to apply, in order. Not implemented yet: a non-empty list is refused (a
    /// stock image is built with its own layers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
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
    match &img.spec.source {
        ImageSource::Vm(v) => {
            if let Err(e) = crate::validate::check_label_name(v) {
                errs.push(FieldError::new("spec.source.vm", e));
            }
        }
        ImageSource::Build(b) => {
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

/// The fields of an Image spec that validate but that nothing acts on yet.
pub(crate) fn unimplemented(img: &Image) -> Vec<crate::validate::FieldError> {
    match &img.spec.source {
        ImageSource::Build(b) if !b.layers.is_empty() => vec![crate::validate::not_implemented(
            "spec.source.build.layers",
            "a stock image is built with its own layers (plumbing and devtools in debian-12); remove the field",
        )],
        _ => Vec::new(),
    }
}
