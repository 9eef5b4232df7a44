//! The qemu backend's settings, from the environment.
//!
//! | variable | default | what |
//! |---|---|---|
//! | `BOXERY_QEMU_BINARY` | `qemu-system-x86_64` | the emulator |
//! | `BOXERY_QEMU_IMG` | `qemu-img` | the disk tool |
//! | `BOXERY_QEMU_ACCEL` | `auto` | `kvm`, `tcg` or `auto` (KVM only when it really works) |
//! | `BOXERY_QEMU_PORTS` | `22000-22999` | loopback ports for the VMs' sshd |
//! | `BOXERY_QEMU_POWERDOWN_TIMEOUT` | `60` | seconds a guest gets to power off before `quit` |
//! | `BOXERY_QEMU_TB_SIZE` | `64` | TCG translation cache in MiB (`default`: QEMU's) |
//! | `BOXERY_NET` | `boxery-net` beside the running program, else `off` | the VM's network outside QEMU (one helper per VM; no process per guest connection to the proxy); `off`: QEMU's own slirp with `guestfwd` and the relay |
//! | `BOXERY_RELAY` | `boxery-relay` beside the running program, else socat | carries each guest connection to the control plane's proxy (`guestfwd`); `socat` forces socat |
//! | `BOXERY_SOCAT` | `socat` | the socat used when there is no relay |
//! | `BOXERY_QEMU_SANDBOX` | on | `off` drops QEMU's seccomp sandbox (`-sandbox on,…`) |
//! | `BOXERY_IMAGE_DIR`, `BOXERY_IMAGE_CACHE` | | image storage's ([`StorageConfig`]) |

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use crate::host::{AccelChoice, detect_accel};
use crate::storage::StorageConfig;

/// The qemu backend's settings.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// The emulator.
    pub qemu: PathBuf,
    /// The accelerator and why.
    pub accel: AccelChoice,
    /// Loopback ports for sshd forwards.
    pub ports: RangeInclusive<u16>,
    /// How long a guest gets to power off on the ACPI button.
    pub powerdown_timeout: Duration,
    /// How long QEMU gets to start (daemonize).
    pub start_timeout: Duration,
    /// TCG translation cache size in MiB.
    pub tcg_tb_size_mib: Option<u32>,
    /// Confine each QEMU with its seccomp sandbox.
    pub sandbox: bool,
    /// `socat`, run by QEMU for each guest connection to the control plane's proxy when there
    /// is no [`QemuConfig::relay`].
    pub socat: PathBuf,
    /// `boxery-relay`, run instead of `socat` (it starts in a third of the time): the one
    /// beside the running program, or `BOXERY_RELAY`. `None`: socat.
    pub relay: Option<PathBuf>,
    /// `boxery-net`, which runs each VM's network outside QEMU: the one beside the running
    /// program, or `BOXERY_NET`. `None` (`BOXERY_NET=off`, or none built): QEMU's own slirp,
    /// with the proxy's channel spawned per connection ([`QemuConfig::relay`]).
    pub net: Option<PathBuf>,
    /// `qemu-img`, `genisoimage`, the image builders (shared with the other drivers).
    pub storage: StorageConfig,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Parse `A-B` into a port range.
pub fn parse_ports(s: &str) -> Option<RangeInclusive<u16>> {
    let (a, b) = s.split_once('-')?;
    let (a, b): (u16, u16) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a > 0 && a <= b).then_some(a..=b)
}

impl QemuConfig {
    /// Settings from the environment (see the module docs).
    pub fn from_env() -> Self {
        QemuConfig {
            qemu: env("BOXERY_QEMU_BINARY")
                .unwrap_or_else(|| "qemu-system-x86_64".into())
                .into(),
            accel: detect_accel(env("BOXERY_QEMU_ACCEL").as_deref()),
            ports: env("BOXERY_QEMU_PORTS")
                .and_then(|s| parse_ports(&s))
                .unwrap_or(22000..=22999),
            powerdown_timeout: Duration::from_secs(
                env("BOXERY_QEMU_POWERDOWN_TIMEOUT")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(60),
            ),
            start_timeout: Duration::from_secs(30),
            tcg_tb_size_mib: match env("BOXERY_QEMU_TB_SIZE").as_deref() {
                Some("default") => None,
                Some(s) => s.parse().ok(),
                None => Some(64),
            },
            sandbox: env("BOXERY_QEMU_SANDBOX").as_deref() != Some("off"),
            socat: env("BOXERY_SOCAT").unwrap_or_else(|| "socat".into()).into(),
            relay: match env("BOXERY_RELAY").as_deref() {
                Some("socat") => None,
                Some(path) => Some(path.into()),
                None => std::env::current_exe()
                    .ok()
                    .map(|e| e.with_file_name("boxery-relay"))
                    .filter(|r| r.is_file()),
            },
            net: match env("BOXERY_NET").as_deref() {
                Some("off") => None,
                Some(path) => Some(path.into()),
                None => std::env::current_exe()
                    .ok()
                    .map(|e| e.with_file_name("boxery-net"))
                    .filter(|n| n.is_file()),
            },
            storage: StorageConfig::from_env(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports() {
        assert_eq!(parse_ports("22000-22999"), Some(22000..=22999));
        assert_eq!(parse_ports("5-5"), Some(5..=5));
        assert_eq!(parse_ports("9-5"), None);
        assert_eq!(parse_ports("x"), None);
    }
}
