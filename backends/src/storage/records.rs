//! What the drivers record: a VM's record (qemu: `vms/<name>/config.json`, its commit point;
//! libvirt: the domain's metadata), an image's record (both: `images/<name>.json`, the image's
//! commit point), a base's record, and the image builders' manifest they read.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How a guest boots: direct kernel boot (kernel, initrd, command line) or, without a
/// kernel, the disk's own bootloader.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Boot {
    /// The kernel (absolute path), for direct kernel boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// The initrd (absolute path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// The kernel command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// The machine type (`q35` unless the image says otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<String>,
    /// Whether the guest powers off on the ACPI power button (default yes).
    #[serde(default = "yes")]
    pub acpi_shutdown: bool,
}

/// `vms/<name>/config.json`: written last when a VM is made; a VM directory without it is an
/// incomplete create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    /// The VM's name.
    pub name: String,
    /// boxery's mark: the uid of the object it was made for.
    pub mark: String,
    /// SMBIOS UUID (kept for the VM's life).
    pub uuid: String,
    /// MAC address (kept for the VM's life).
    pub mac: String,
    /// The loopback port forwarded to the guest's sshd (kept for the VM's life).
    pub port: u16,
    /// vCPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Disk in GiB.
    pub disk_gib: u64,
    /// The base its disk is one overlay on (`base/<id>`).
    pub base: String,
    /// The seed's current instance-id (new for every seed written).
    pub instance_id: String,
    /// The guest's hostname.
    pub hostname: String,
    /// The pinned host key's public half (`ssh-ed25519 AAAA…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_key: Option<String>,
    /// The image it was made (or last reimaged) from.
    pub image: String,
    /// When it was made.
    pub created: boxery_api::Time,
}

/// What a resize changes (see [`VmConfig::resize_to`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResizeChange {
    /// CPUs or memory change: the machine is restarted.
    pub machine: bool,
    /// The disk grows.
    pub grow: bool,
}

impl VmConfig {
    /// What resizing this VM to `size` changes; `None` when nothing does. A disk only grows
    /// (`Invalid` otherwise: retrying cannot help).
    pub(crate) fn resize_to(&self, size: crate::VmSize) -> crate::Result<Option<ResizeChange>> {
        if size.disk_gib < self.disk_gib {
            return Err(crate::BackendError::Invalid(format!(
                "disks only grow: VM {} has {} GiB, {} GiB asked",
                self.name, self.disk_gib, size.disk_gib
            )));
        }
        let change = ResizeChange {
            machine: size.cpus != self.cpus || size.memory_mib != self.memory_mib,
            grow: size.disk_gib > self.disk_gib,
        };
        Ok((change.machine || change.grow).then_some(change))
    }
}

/// `images/<name>.json`: the image's commit point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// The image's name.
    pub name: String,
    /// boxery's mark.
    pub mark: String,
    /// The base its disk is one overlay on.
    pub base: String,
    /// Where it came from (`vm:dev1`, `build:tiny`, `file:/path`).
    pub source: String,
    /// The guest-visible disk size in bytes.
    pub virtual_size: u64,
    /// When it was made.
    pub created: boxery_api::Time,
}

/// `base/<id>/base.json`: a registered stock base (read-only, shared by overlays).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseRecord {
    /// Its id (`tiny-6e3586b9bb00`).
    pub id: String,
    /// The stock image's name (`tiny`, `debian-12`).
    pub stock: String,
    /// How it boots; kernel and initrd are file names inside the base's directory.
    pub boot: Boot,
    /// Whether the guest runs qemu-guest-agent.
    #[serde(default)]
    pub guest_agent: bool,
    /// The builder's input hash, or the disk's sha256.
    pub hash: String,
    /// The disk's virtual size in bytes.
    pub virtual_size: u64,
    /// When it was registered.
    pub created: boxery_api::Time,
    /// A distribution's cloud image imported as it is (no builder manifest): it boots with
    /// its own bootloader, and its seed makes the `agent` user (docs/images.md, "Bring your
    /// own image").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cloud_image: bool,
}

impl BaseRecord {
    /// Its boot with kernel and initrd resolved inside `dir`.
    pub fn boot_in(&self, dir: &Path) -> Boot {
        let mut b = self.boot.clone();
        b.kernel = b.kernel.map(|k| dir.join(k));
        b.initrd = b.initrd.map(|i| dir.join(i));
        b
    }
}

/// An image builder's manifest (`OUT/<name>.json`, docs/images.md); unknown fields ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    /// The image's name.
    pub name: String,
    /// The disk's format (`qcow2`).
    #[serde(default = "qcow2")]
    pub format: String,
    /// The disk file (relative to the manifest).
    pub disk: PathBuf,
    /// The kernel (relative), for direct kernel boot.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// The initrd (relative).
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// The kernel command line.
    #[serde(default)]
    pub cmdline: Option<String>,
    /// The machine type.
    #[serde(default)]
    pub machine: Option<String>,
    /// Whether the guest runs qemu-guest-agent.
    #[serde(default)]
    pub guest_agent: bool,
    /// Whether it powers off on the ACPI power button.
    #[serde(default = "yes")]
    pub acpi_powerdown: bool,
    /// The builder's input hash.
    #[serde(default)]
    pub input_hash: Option<String>,
    /// The disk's sha256.
    #[serde(default)]
    pub disk_sha256: Option<String>,
}

fn qcow2() -> String {
    "qcow2".into()
}
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tiny_manifest() {
        let m: Manifest = serde_json::from_str(
            r#"{"name": "tiny", "format": "qcow2", "disk": "tiny.qcow2", "kernel": "tiny.vmlinuz",
                "initrd": "tiny.initrd", "cmdline": "console=ttyS0", "guest_agent": false,
                "acpi_powerdown": true, "input_hash": "6e35", "cpus": 1}"#,
        )
        .unwrap();
        assert_eq!(m.name, "tiny");
        assert_eq!(m.kernel.as_deref(), Some(Path::new("tiny.vmlinuz")));
        assert!(m.acpi_powerdown);
    }
}
