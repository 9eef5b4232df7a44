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
    /// The settings above that the environment gave and that do not parse, each saying
    /// what it takes: `check` and `init` refuse to go on while there is one (rather than use
    /// a default the owner did not ask for).
    pub invalid: Vec<String>,
}

impl IncusConfig {
    /// Settings from the environment.
    pub fn from_env() -> Self {
        let mut invalid = Vec::new();
        let proxy_port = setting(
            &var,
            "BOXERY_INCUS_PROXY_PORT",
            "a port, 1-65535",
            |p: &u16| *p != 0,
            &mut invalid,
        );
        let subnet = setting(
            &var,
            "BOXERY_INCUS_SUBNET",
            "the bridge's gateway address (an a.b.c.1)",
            |_: &std::net::Ipv4Addr| true,
            &mut invalid,
        );
        let driver = setting(
            &var,
            "BOXERY_INCUS_STORAGE",
            "`btrfs` or `dir`",
            |d: &String| matches!(d.as_str(), "btrfs" | "dir"),
            &mut invalid,
        );
        let stop_timeout = setting(
            &var,
            "BOXERY_INCUS_STOP_TIMEOUT",
            "a number of seconds",
            |_: &u64| true,
            &mut invalid,
        );
        IncusConfig {
            socket: var("BOXERY_INCUS_SOCKET")
                .or_else(|| var("INCUS_SOCKET"))
                .unwrap_or_else(|| "/var/lib/incus/unix.socket".into())
                .into(),
            proxy_port,
            subnet,
            driver: match driver.as_deref() {
                Some("dir") => PoolDriver::Dir,
                _ => PoolDriver::Btrfs,
            },
            // Incus reads the size and refuses one it cannot (`init` says so)
            pool_size: var("BOXERY_INCUS_POOL_SIZE").unwrap_or_else(|| "100GiB".into()),
            stop_timeout: Duration::from_secs(stop_timeout.unwrap_or(30)),
            storage: StorageConfig::from_env(),
            invalid,
        }
    }
}

/// Environment variable `key`, when set and not blank.
fn var(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

/// Setting `key` (read with `get`: [`var`]) as a `T` that `ok` accepts; unset: `None`; set
/// to anything else: `None`, and what it takes (`takes`) said in `invalid`.
fn setting<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    key: &str,
    takes: &str,
    ok: impl Fn(&T) -> bool,
    invalid: &mut Vec<String>,
) -> Option<T> {
    let v = get(key)?;
    let parsed = v.trim().parse::<T>().ok().filter(|t| ok(t));
    if parsed.is_none() {
        invalid.push(format!("{key}={v:?}: it takes {takes}"));
    }
    parsed
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_setting_that_does_not_parse_is_said_not_defaulted() {
        let env = |k: &str| {
            match k {
                "BOXERY_INCUS_STORAGE" => Some("zfs"),
                "BOXERY_INCUS_PROXY_PORT" => Some("0"),
                "BOXERY_INCUS_STOP_TIMEOUT" => Some(" 45 "),
                _ => None,
            }
            .map(str::to_string)
        };
        let mut invalid = Vec::new();
        let is_driver = |d: &String| matches!(d.as_str(), "btrfs" | "dir");
        let driver = super::setting(
            &env,
            "BOXERY_INCUS_STORAGE",
            "`btrfs` or `dir`",
            is_driver,
            &mut invalid,
        );
        assert_eq!(driver, None);
        let port = super::setting(
            &env,
            "BOXERY_INCUS_PROXY_PORT",
            "a port, 1-65535",
            |p: &u16| *p != 0,
            &mut invalid,
        );
        assert_eq!(port, None);
        let stop = super::setting(
            &env,
            "BOXERY_INCUS_STOP_TIMEOUT",
            "seconds",
            |_: &u64| true,
            &mut invalid,
        );
        assert_eq!(stop, Some(45));
        let unset = super::setting(
            &env,
            "BOXERY_INCUS_SUBNET",
            "an address",
            |_: &std::net::Ipv4Addr| true,
            &mut invalid,
        );
        assert_eq!(unset, None);
        assert_eq!(
            invalid,
            [
                "BOXERY_INCUS_STORAGE=\"zfs\": it takes `btrfs` or `dir`",
                "BOXERY_INCUS_PROXY_PORT=\"0\": it takes a port, 1-65535"
            ]
        );
    }
}
