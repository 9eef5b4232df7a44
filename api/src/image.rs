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
            Column::wide(
                "LAYERS",
                Cell::Computed(&["/status/buildInfo/layers"], |v| match v[0].as_array() {
                    Some(l) if !l.is_empty() =>
                        l.iter().map(columns::text).collect::<Vec<_>>().join(","),
                    _ => "<none>".into(),
                }),
            ),
            Column::wide("OWNER", Cell::Field("/metadata/ownerReferences/0/name")),
            columns::AGE,
        ],
        settled: |_| &[READY],
        force_delete: ForceDelete::BackendImage,
        immutable: &[],
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
    /// What it puts in the guest's filesystem (directories and files): what a layer added to
    /// a running VM copies in from the layered build (docs/images.md, "Layers on a running
    /// VM"). Empty for the base's layers, and for a layer that cannot be added to a running VM
    /// ([`Layer::in_place`]).
    pub files: &'static [&'static str],
    /// The layers it needs, added with it when not asked for (`browser` needs `desktop`).
    pub needs: &'static [&'static str],
}

impl Layer {
    /// Whether it can be added to a running VM by copying its files in. A layer of Debian
    /// packages and services (`docker`: users, groups, units, maintainer scripts) cannot: a VM
    /// gets it by being made from the layered image.
    pub fn in_place(&self) -> bool {
        !self.files.is_empty()
    }
}

/// The layer named `name`.
pub fn layer(name: &str) -> Option<&'static Layer> {
    LAYERS.iter().find(|l| l.name == name)
}

/// Every layer, in the order they are built.
pub const LAYERS: &[Layer] = &[
    Layer {
        name: "plumbing",
        installs: "the agent user (passwordless sudo), sshd settings, cloud-init's user, tmux, socat, qemu-guest-agent, security updates",
        in_base: true,
        files: &[],
        needs: &[],
    },
    Layer {
        name: "devtools",
        installs: "git, python3 (venv), jq, ripgrep, fd, curl, build-essential, pkg-config, unzip, xz, file",
        in_base: true,
        files: &[],
        needs: &[],
    },
    Layer {
        name: "agents",
        installs: "Node.js 22 and npm (from the npm registry), claude (Claude Code), codex (OpenAI Codex CLI), opencode; set up to reach their providers through boxery's credential proxy",
        in_base: false,
        files: &[
            "/opt/boxery",
            "/usr/local/lib/node_modules",
            "/usr/local/bin",
            "/etc/profile.d/boxery-agents.sh",
        ],
        needs: &[],
    },
    Layer {
        name: "desktop",
        installs: "a virtual X display :0 (Xvfb, 1280x800 by default, its framebuffer readable as an XWD file) with the jwm window manager, started at boot as the agent user; xdotool, xterm, x11-utils, python3-tk, x11vnc (not started); not added to a running VM (make the VM with it)",
        in_base: false,
        files: &[],
        needs: &[],
    },
    Layer {
        name: "browser",
        installs: "Chromium, which the agent drives (vm_browser, `boxery browser`) on the desktop's display, going out through boxery's egress proxy; with the desktop layer (added with it); not added to a running VM (make the VM with it)",
        in_base: false,
        files: &[],
        needs: &["desktop"],
    },
    Layer {
        name: "docker",
        installs: "Docker (Debian's docker.io: dockerd, the docker CLI, containerd, runc), started at boot, the agent user in the docker group; its daemon goes out through boxery's egress proxy; not added to a running VM (make the VM with it)",
        in_base: false,
        files: &[],
        needs: &[],
    },
    Layer {
        name: "rust",
        installs: "Rust and cargo (Debian's rustc-web and cargo-web: the toolchain Debian 12 keeps current, 1.96 with security updates); cargo goes out through boxery's egress proxy; not added to a running VM (make the VM with it)",
        in_base: false,
        files: &[],
        needs: &[],
    },
];

/// The name of the Image built from `base` with `layers` (in build order): `debian-12-agents`,
/// the name the builder gives its output too. A Vm's `spec.layers` makes (or reuses) it.
pub fn layered_image_name(base: &str, layers: &[String]) -> String {
    std::iter::once(base)
        .chain(layers.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("-")
}

/// The label on an Image a Vm's `spec.layers` made; its value is the layers joined with `.`
/// (`agents`). Such images are shared by every VM asking for
/// the same base and layers and owned by none (deleting one is safe: VMs made from it are
/// independent of it, and the next VM that asks rebuilds it from the builder's cache).
pub const LAYERED_LABEL: &str = "boxery.dev/layers";

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
        match layer(l) {
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
    // with what they need (a layer needs only layers built before it)
    let wanted = |k: &Layer| {
        layers
            .iter()
            .any(|l| l == k.name || layer(l).is_some_and(|asked| asked.needs.contains(&k.name)))
    };
    Ok(LAYERS
        .iter()
        .filter(|k| wanted(k))
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
        /// What the image's guest was built with (its `/etc/boxery/build-info`): for a build,
        /// the builder's record; for a capture, its source VM's; none for an import.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub build_info: Option<BuildInfo>,
    }
}

/// A guest's build record: `/etc/boxery/build-info` (and the builder's `NAME.build-info`
/// beside its output), `key=value` lines, parsed by [`BuildInfo::parse`]. The file can come
/// from a guest, which may write anything there: every field is bounded and checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuildInfo {
    /// When the layers were last run (`built_at`, RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built_at: Option<String>,
    /// The image the builder made (`image`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The layers run, in order (`layers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// The sha256 of the layer scripts run (`layers_hash`, docs/images.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_hash: Option<String>,
    /// The newest kernel installed (`kernel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// The builder's input hash (`input_hash`, the tiny guest's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_hash: Option<String>,
    /// When layers were last added to a running VM in place (`patched_at`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patched_at: Option<String>,
    /// Any other keys, as written.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub other: std::collections::BTreeMap<String, String>,
}

/// The most bytes of a build-info file read.
pub const BUILD_INFO_MAX_BYTES: usize = 4096;
/// The most keys a build-info file may have.
pub const BUILD_INFO_MAX_KEYS: usize = 32;
/// The longest value in a build-info file, in characters.
pub const BUILD_INFO_MAX_VALUE: usize = 256;

impl BuildInfo {
    /// Parse a build-info file. Refused whole (with the reason) when it is longer than
    /// [`BUILD_INFO_MAX_BYTES`], not UTF-8, has a line that is not `key=value`, a key that is
    /// not `[a-z][a-z0-9_]*` (up to 64), a repeated key, a control character or a value longer
    /// than [`BUILD_INFO_MAX_VALUE`], more than [`BUILD_INFO_MAX_KEYS`] keys, a layer that is
    /// not a layer name, a `layers_hash` that is not hex, or a `built_at`/`patched_at` that is
    /// not a time. Empty values count as absent.
    pub fn parse(bytes: &[u8]) -> Result<BuildInfo, String> {
        if bytes.len() > BUILD_INFO_MAX_BYTES {
            return Err(format!(
                "it is {} bytes long (at most {BUILD_INFO_MAX_BYTES})",
                bytes.len()
            ));
        }
        let text = std::str::from_utf8(bytes).map_err(|_| "it is not UTF-8".to_string())?;
        let mut info = BuildInfo::default();
        let mut seen = std::collections::BTreeSet::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            if line.trim().is_empty() {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(format!("line {n} is not key=value"));
            };
            let key_ok = key.len() <= 64
                && key.starts_with(|c: char| c.is_ascii_lowercase())
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !key_ok {
                return Err(format!(
                    "line {n}: the key is not a name ([a-z][a-z0-9_]*, up to 64)"
                ));
            }
            if value.chars().any(char::is_control) {
                return Err(format!("line {n} ({key}) has a control character"));
            }
            if value.chars().count() > BUILD_INFO_MAX_VALUE {
                return Err(format!(
                    "line {n} ({key}) is longer than {BUILD_INFO_MAX_VALUE} characters"
                ));
            }
            if !seen.insert(key) {
                return Err(format!("line {n}: {key} is given twice"));
            }
            if seen.len() > BUILD_INFO_MAX_KEYS {
                return Err(format!("it has more than {BUILD_INFO_MAX_KEYS} keys"));
            }
            let value = value.trim();
            if value.is_empty() {
                continue;
            }
            let time = |v: &str| {
                chrono::DateTime::parse_from_rfc3339(v)
                    .map(|_| v.to_string())
                    .map_err(|_| format!("line {n}: {key} is not an RFC 3339 time"))
            };
            match key {
                "built_at" => info.built_at = Some(time(value)?),
                "patched_at" => info.patched_at = Some(time(value)?),
                "layers" => {
                    for l in value.split_whitespace() {
                        let ok = l.len() <= 32
                            && l.chars()
                                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
                        if !ok {
                            return Err(format!(
                                "line {n}: layers has a word that is not a layer name"
                            ));
                        }
                        info.layers.push(l.to_string());
                    }
                }
                "layers_hash" | "input_hash" => {
                    if value.len() > 128 || !value.chars().all(|c| c.is_ascii_hexdigit()) {
                        return Err(format!("line {n}: {key} is not a hex digest"));
                    }
                    let v = Some(value.to_ascii_lowercase());
                    if key == "layers_hash" {
                        info.layers_hash = v;
                    } else {
                        info.input_hash = v;
                    }
                }
                "image" => info.image = Some(value.to_string()),
                "kernel" => info.kernel = Some(value.to_string()),
                _ => {
                    info.other.insert(key.to_string(), value.to_string());
                }
            }
        }
        Ok(info)
    }

    /// The file's text again (`key=value` lines, the known keys first): what an in-place
    /// layer writes back into the guest.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut put = |k: &str, v: &str| {
            out.push_str(k);
            out.push('=');
            out.push_str(v);
            out.push('\n');
        };
        for (k, v) in [("built_at", &self.built_at), ("image", &self.image)] {
            if let Some(v) = v {
                put(k, v);
            }
        }
        put("layers", &self.layers.join(" "));
        for (k, v) in [
            ("layers_hash", &self.layers_hash),
            ("kernel", &self.kernel),
            ("input_hash", &self.input_hash),
            ("patched_at", &self.patched_at),
        ] {
            if let Some(v) = v {
                put(k, v);
            }
        }
        for (k, v) in &self.other {
            put(k, v);
        }
        out
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

#[cfg(test)]
mod build_info_tests {
    use super::*;

    const DEBIAN: &str = "built_at=2026-12-05T19:27:08Z\nimage=debian-12-agents\nlayers=plumbing devtools agents\nlayers_hash=92915ac4c1be9e2d53f219988ffce54232da6d3cdade80578e9e726c0a07a838\nkernel=6.1.0-57-cloud-amd64\n";

    #[test]
    fn the_builders_records_parse_and_render_back() {
        let i = BuildInfo::parse(DEBIAN.as_bytes()).unwrap();
        assert_eq!(i.image.as_deref(), Some("debian-12-agents"));
        assert_eq!(i.layers, ["plumbing", "devtools", "agents"]);
        assert_eq!(i.kernel.as_deref(), Some("6.1.0-57-cloud-amd64"));
        assert_eq!(i.render(), DEBIAN);
        assert_eq!(BuildInfo::parse(i.render().as_bytes()).unwrap(), i);
        // tiny's: empty layers, an input hash; an unknown key is kept
        let t = BuildInfo::parse(b"built_at=2026-12-05T04:39:58Z\nimage=tiny\nlayers=\nlayers_hash=\nkernel=6.1\ninput_hash=ABCDEF\n\nchrome=131.0\n").unwrap();
        assert!(t.layers.is_empty() && t.layers_hash.is_none());
        assert_eq!(t.input_hash.as_deref(), Some("abcdef"));
        assert_eq!(t.other.get("chrome").map(String::as_str), Some("131.0"));
    }

    #[test]
    fn a_hostile_file_is_refused_whole() {
        let long = format!("kernel={}\n", "x".repeat(BUILD_INFO_MAX_VALUE + 1));
        let many: String = (0..=BUILD_INFO_MAX_KEYS)
            .map(|i| format!("k{i}=v\n"))
            .collect();
        let huge = "a=b\n".repeat(BUILD_INFO_MAX_BYTES);
        for (bad, why) in [
            (&b"kernel=6.1\x1b[31m\n"[..], "control character"),
            (b"kernel=a\rb\n", "control character"),
            (b"Kernel=6.1\n", "not a name"),
            (b"ker nel=6.1\n", "not a name"),
            (b"=6.1\n", "not a name"),
            (b"just text\n", "not key=value"),
            (b"kernel=1\nkernel=2\n", "twice"),
            (b"layers=agents ../etc\n", "layer name"),
            (b"layers_hash=zz\n", "hex"),
            (b"built_at=yesterday\n", "RFC 3339"),
            (b"kernel=\xff\n", "UTF-8"),
            (long.as_bytes(), "longer than"),
            (many.as_bytes(), "more than"),
            (huge.as_bytes(), "bytes long"),
        ] {
            let e = BuildInfo::parse(bad).unwrap_err();
            assert!(e.contains(why), "{:?}: {e}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_layered_image_is_named_as_the_builder_names_its_output() {
        assert_eq!(
            layered_image_name("debian-12", &["agents".to_string()]),
            "debian-12-agents"
        );
        assert_eq!(layered_image_name("debian-12", &[]), "debian-12");
    }
}

#[cfg(test)]
mod layer_tests {
    use super::*;

    /// The table and the builder's scripts name the same layers: each has its
    /// `image/layers/NAME.sh`, and each script there (but the runner and what the layers
    /// share) is in the table.
    #[test]
    fn every_layer_has_its_script_and_every_script_its_layer() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../image/layers");
        let mut scripts: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter_map(|n| n.strip_suffix(".sh").map(str::to_string))
            .filter(|n| n != "provision" && n != "lib")
            .collect();
        scripts.sort();
        let mut table: Vec<String> = LAYERS.iter().map(|l| l.name.to_string()).collect();
        table.sort();
        assert_eq!(scripts, table);
    }

    #[test]
    fn a_layer_brings_what_it_needs_built_before_it() {
        for (i, l) in LAYERS.iter().enumerate() {
            for n in l.needs {
                let at = LAYERS.iter().position(|k| k.name == *n);
                assert!(at.is_some_and(|at| at < i), "{} needs {n}", l.name);
            }
        }
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            normalize_layers("debian-12", &v(&["browser"])).unwrap(),
            v(&["desktop", "browser"])
        );
        assert_eq!(
            normalize_layers("debian-12", &v(&["browser", "agents", "desktop"])).unwrap(),
            v(&["agents", "desktop", "browser"])
        );
    }
}
