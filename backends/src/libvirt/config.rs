//! The libvirt backend's settings, from the environment.

use std::path::PathBuf;
use std::time::Duration;

use crate::host::{Accel, detect_accel};
use crate::storage::StorageConfig;

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
    /// The credential proxy's port on the network's gateway (`BOXERY_LIBVIRT_PROXY_PORT`);
    /// `None`: one picked for this home from [`PROXY_PORTS`](super::PROXY_PORTS) and kept in
    /// `proxy-port`.
    pub proxy_port: Option<u16>,
    /// Domain type: `kvm` when KVM really works, else `qemu` (`BOXERY_LIBVIRT_ACCEL` =
    /// `kvm`/`tcg`/`auto`, the same detection as the qemu backend's).
    pub kind: &'static str,
    /// Why that domain type.
    pub kind_reason: String,
    /// `qemu-img`, `genisoimage`, the image builders (shared with the other drivers).
    pub storage: StorageConfig,
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
            proxy_port: var("BOXERY_LIBVIRT_PROXY_PORT")
                .and_then(|v| v.trim().parse().ok())
                .filter(|p| *p != 0),
            kind: if accel.accel == Accel::Kvm {
                "kvm"
            } else {
                "qemu"
            },
            kind_reason: accel.reason,
            storage: StorageConfig::from_env(),
        }
    }
}
