//! The incus backend's settings, from the environment.

use std::path::PathBuf;
use std::time::Duration;

use crate::storage::StorageConfig;

/// The storage pool's driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolDriver {
    /// btrfs on a loop file Incus makes (`/var/lib/incus/disks/<pool>.img`, sparse): copies
    /// and snapshots are copy-on-write (instant), the root disk's size is a quota.
    Btrfs,
    /// A directory under the home's state: every copy and snapshot copies the whole tree, and
    /// no size is enforced.
    Dir,
}

/// The incus backend's settings (environment).
#[derive(Debug, Clone)]
pub struct IncusConfig {
    /// The Incus API's unix socket (`BOXERY_INCUS_SOCKET`, else `INCUS_SOCKET`, else
    /// `/var/lib/incus/unix.socket`).
    pub socket: PathBuf,
    /// The credential proxy's port on the network's gateway (`BOXERY_INCUS_PROXY_PORT`);
    /// `None`: one given by the home's namespace in
    /// [`PROXY_PORTS`](crate::incus::PROXY_PORTS).
    pub proxy_port: Option<u16>,
    /// The bridge's gateway address, when the network is made (`BOXERY_INCUS_SUBNET`: an
    /// `a.b.c.1`, the bridge gets its /24); `None`: a free /24 in 10.200.0.0/13.
    pub subnet: Option<std::net::Ipv4Addr>,
    /// The storage pool's driver (`BOXERY_INCUS_STORAGE`: `btrfs`, the default, or `dir`).
    pub driver: PoolDriver,
    /// The btrfs pool's loop file's size (`BOXERY_INCUS_POOL_SIZE`, default `100GiB`; the
    /// file is sparse: it takes what the guests write).
    pub pool_size: String,
    /// Seconds a container gets to shut down cleanly before it is stopped by force
    /// (`BOXERY_INCUS_STOP_TIMEOUT`, default 30).
    pub stop_timeout: Duration,
    /// The image builders (shared with the other drivers).
    pub storage: StorageConfig,
}

impl IncusConfig {
    /// Settings from the environment.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        IncusConfig {
            socket: var("BOXERY_INCUS_SOCKET")
                .or_else(|| var("INCUS_SOCKET"))
                .unwrap_or_else(|| "/var/lib/incus/unix.socket".into())
                .into(),
            proxy_port: var("BOXERY_INCUS_PROXY_PORT")
                .and_then(|v| v.trim().parse().ok())
                .filter(|p| *p != 0),
            driver: match var("BOXERY_INCUS_STORAGE").as_deref() {
                Some("dir") => PoolDriver::Dir,
                _ => PoolDriver::Btrfs,
            },
            pool_size: var("BOXERY_INCUS_POOL_SIZE").unwrap_or_else(|| "100GiB".into()),
            subnet: var("BOXERY_INCUS_SUBNET").and_then(|v| v.trim().parse().ok()),
            stop_timeout: Duration::from_secs(
                var("BOXERY_INCUS_STOP_TIMEOUT")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(30),
            ),
            storage: StorageConfig::from_env(),
        }
    }
}
