//! What `check` and `init` do: the daemon answers, and this home's projects, storage pool and
//! bridge exist (made once, kept).

use hyper::Method;
use serde_json::{Value, json};

use super::*;

impl Inner {
    pub(super) async fn check(&self) -> Result<()> {
        if !self.config.invalid.is_empty() {
            return Err(BackendError::Invalid(format!(
                "the incus backend's settings do not parse: {}",
                self.config.invalid.join("; ")
            )));
        }
        let server = self.client.get("/1.0").await.map_err(|e| match e {
            ApiError::Connect { .. } => BackendError::unreachable(
                NAME,
                format!(
                    "{e}: start incusd (`systemctl start incus` on a systemd host, \
                     `scripts/incusd.sh start` elsewhere; `scripts/install-incus.sh` installs it)"
                ),
            ),
            e => BackendError::failed("ask incusd what it is", e),
        })?;
        if server["auth"] != "trusted" {
            return Err(BackendError::Invalid(format!(
                "incusd at {} does not trust this user: run boxery as root or as a member of \
                 the incus-admin group",
                self.client.socket().display()
            )));
        }
        let drivers = server["environment"]["driver"].as_str().unwrap_or("");
        if !drivers.split(" | ").any(|d| d == "lxc") {
            return Err(BackendError::Invalid(format!(
                "incusd runs no container driver (it offers `{drivers}`): boxery's incus \
                 backend runs system containers"
            )));
        }
        Ok(())
    }

    pub(super) async fn init(&self) -> Result<()> {
        self.check().await?;
        std::fs::create_dir_all(&self.state)
            .map_err(crate::io(format!("creating {}", self.state.display())))?;
        for (project, what) in [
            (&self.project, "boxery's VMs"),
            (&self.images, "boxery's images"),
        ] {
            self.ensure(
                "/1.0/projects",
                json!({
                    "name": project,
                    "description": format!("{what} (home {}, namespace {})", self.state.display(), self.ns),
                    "config": {
                        "features.images": "true",
                        "features.profiles": "true",
                        "features.storage.volumes": "true",
                        "features.networks": "false",
                    },
                }),
                &format!("make project {project}"),
            )
            .await?;
        }
        let config = match self.config.driver {
            PoolDriver::Btrfs => json!({"size": self.config.pool_size}),
            PoolDriver::Dir => {
                // Incus wants the source directory there (and empty when the pool is new)
                let dir = self.state.join("pool").join("dir");
                std::fs::create_dir_all(&dir)
                    .map_err(crate::io(format!("creating {}", dir.display())))?;
                json!({"source": dir.to_string_lossy()})
            }
        };
        let pool = json!({
            "name": self.pool,
            "driver": match self.config.driver {
                PoolDriver::Btrfs => "btrfs",
                PoolDriver::Dir => "dir",
            },
            "description": format!("boxery's disks (namespace {})", self.ns),
            "config": config,
        });
        self.ensure(
            "/1.0/storage-pools",
            pool,
            &format!(
                "make storage pool {} (btrfs needs btrfs-progs: scripts/install-incus.sh; \
                 BOXERY_INCUS_STORAGE=dir makes a directory pool instead)",
                self.pool
            ),
        )
        .await?;
        let have_net = self
            .client
            .get_opt(&format!("/1.0/networks/{}", self.network))
            .await
            .map_err(api(format!("read network {}", self.network)))?;
        let subnet = match (&have_net, self.config.subnet) {
            (Some(_), _) => None,
            (None, Some(gw)) => Some(gw),
            (None, None) => Some(free_subnet(&self.ns, &host_routes())?),
        };
        if let Some(gw) = subnet {
            self.ensure(
                "/1.0/networks",
                json!({
                    "name": self.network,
                    "type": "bridge",
                    "description": format!("boxery's guests (namespace {})", self.ns),
                    "config": {
                        // picked here: Incus's `auto` pings candidates, and on a network that
                        // answers for every address it finds none free
                        "ipv4.address": format!("{gw}/24"),
                        "ipv4.nat": "true",
                        // every isolation rule is IPv4: IPv6 would be a path around them
                        "ipv6.address": "none",
                        // no DNS records of the guests: none can look its siblings up
                        "dns.mode": "none",
                    },
                }),
                &format!("make network {}", self.network),
            )
            .await?;
        }
        let net = self
            .client
            .get(&format!("/1.0/networks/{}", self.network))
            .await
            .map_err(api(format!("read network {}", self.network)))?;
        let gw = gateway_of(&net).ok_or_else(|| {
            BackendError::Invalid(format!(
                "Incus network {} has no IPv4 address ({}): remove it (`incus network delete \
                 {}`) and boxery makes it again",
                self.network, net["config"], self.network
            ))
        })?;
        *self.gateway.lock().unwrap() = Some(gw);
        // the firewall before any guest of this home runs (after a host's restart, too)
        self.apply_firewall().await
    }

    pub(super) async fn teardown(&self) -> Result<()> {
        for project in [&self.project, &self.images] {
            let exists = self
                .client
                .get_opt(&format!("/1.0/projects/{project}"))
                .await
                .map_err(api(format!("read project {project}")))?;
            if exists.is_none() {
                continue;
            }
            for inst in self.instances(project).await? {
                if let Some(name) = inst["name"].as_str() {
                    self.delete(project, name).await?;
                }
            }
            let images = self
                .client
                .get(&format!("/1.0/images?project={project}"))
                .await
                .map_err(api(format!("list the images of project {project}")))?;
            for url in images.as_array().into_iter().flatten() {
                if let Some(url) = url.as_str() {
                    self.gone(Method::DELETE, &format!("{url}?project={project}"))
                        .await?;
                }
            }
            self.gone(Method::DELETE, &format!("/1.0/projects/{project}"))
                .await?;
        }
        // each of the rest is tried even when one before failed; the network once more after
        // a pause: incusd lists the host's interfaces to find the bridge's, and one that goes
        // meanwhile (another VM's tap) fails the delete ("Device … does not exist")
        let net = format!("/1.0/networks/{}", self.network);
        let mut first = self.gone(Method::DELETE, &net).await.err();
        if first.is_some() {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            first = self.gone(Method::DELETE, &net).await.err();
        }
        let pool = self
            .gone(Method::DELETE, &format!("/1.0/storage-pools/{}", self.pool))
            .await
            .err();
        let tables = firewall::nft(&firewall::teardown(&self.ns)).await.err();
        *self.gateway.lock().unwrap() = None;
        match first.or(pool).or(tables) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The bridge's gateway as incusd has it (kept for `guest_proxy`); `None` when the
    /// network is not there (no `init` yet).
    pub(super) async fn read_gateway(&self) -> Result<Option<Ipv4Addr>> {
        let net = self
            .client
            .get_opt(&format!("/1.0/networks/{}", self.network))
            .await
            .map_err(api(format!("read network {}", self.network)))?;
        let gw = net.as_ref().and_then(gateway_of);
        if gw.is_some() {
            *self.gateway.lock().unwrap() = gw;
        }
        Ok(gw)
    }

    /// `METHOD path` where a 404 is success (it is gone either way).
    async fn gone(&self, method: Method, path: &str) -> Result<()> {
        match self.client.call(method, path, Value::Null).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(api(format!("delete {path}"))(e)),
        }
    }

    /// `POST collection` with `body`, where an object of that name already there is kept:
    /// made by someone else in between too (two `init`s at once: Incus answers the loser with
    /// a 500 about a database constraint, not a 409), which a second look tells.
    async fn ensure(&self, collection: &str, body: Value, step: &str) -> Result<()> {
        let name = body["name"].as_str().unwrap_or_default().to_string();
        match self.client.call(Method::POST, collection, body).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_conflict() => Ok(()),
            Err(e @ ApiError::Connect { .. }) => Err(api(step)(e)),
            Err(e) => {
                let there = self
                    .client
                    .get_opt(&format!("{collection}/{name}"))
                    .await
                    .map_err(api(step))?;
                if there.is_some() {
                    Ok(())
                } else {
                    Err(api(step)(e))
                }
            }
        }
    }
}

/// The IPv4 networks the host routes (`/proc/net/route`): (address, prefix length).
fn host_routes() -> Vec<(Ipv4Addr, u32)> {
    std::fs::read_to_string("/proc/net/route")
        .map(|t| parse_routes(&t))
        .unwrap_or_default()
}

/// The networks of a `/proc/net/route` text, the default route left out (it overlaps every
/// subnet, which is not what makes one taken).
fn parse_routes(text: &str) -> Vec<(Ipv4Addr, u32)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let dest = u32::from_str_radix(f.get(1)?, 16).ok()?;
            let mask = u32::from_str_radix(f.get(7)?, 16).ok()?;
            // the kernel prints the address's bytes as a number in the host's byte order
            let dest = Ipv4Addr::from(dest.to_ne_bytes());
            let len = mask.count_ones();
            (len > 0).then_some((dest, len))
        })
        .collect()
}

/// A gateway address for this home's bridge: the `.1` of a /24 in 10.200.0.0/13 that no route
/// of the host overlaps, starting at one the namespace gives (homes on one host start apart).
fn free_subnet(ns: &str, routes: &[(Ipv4Addr, u32)]) -> Result<Ipv4Addr> {
    const BASE: u32 = 10 << 24 | 200 << 16;
    const COUNT: u32 = 2048;
    let start = u32::from_str_radix(ns, 16).unwrap_or(0) % COUNT;
    let overlaps = |net: u32| {
        routes.iter().any(|(a, len)| {
            let len = (*len).min(24);
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            (u32::from(*a) & mask) == (net & mask)
        })
    };
    (0..COUNT)
        .map(|i| BASE + ((start + i) % COUNT) * 256)
        .find(|net| !overlaps(*net))
        .map(|net| Ipv4Addr::from(net + 1))
        .ok_or_else(|| {
            BackendError::Invalid(
                "no /24 in 10.200.0.0/13 is free of the host's routes: set \
                 BOXERY_INCUS_SUBNET to the bridge's gateway address (an a.b.c.1)"
                    .into(),
            )
        })
}

/// The gateway address of a network as Incus shows it (`config."ipv4.address"` =
/// `10.1.2.1/24`).
pub(super) fn gateway_of(net: &Value) -> Option<Ipv4Addr> {
    net["config"]["ipv4.address"]
        .as_str()?
        .split('/')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_gateway_is_the_bridges_ipv4_address() {
        let net = serde_json::json!({"config": {"ipv4.address": "10.77.3.1/24"}});
        assert_eq!(
            super::gateway_of(&net),
            Some(std::net::Ipv4Addr::new(10, 77, 3, 1))
        );
        assert_eq!(super::gateway_of(&serde_json::json!({"config": {}})), None);
    }

    #[test]
    fn routes_are_read_as_the_kernel_prints_them_without_the_default() {
        // this machine's table: a default route, the guests' bridge, the uplink
        let text = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                    eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                    bxtry\t0007E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                    eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(
            super::parse_routes(text),
            [
                (std::net::Ipv4Addr::new(10, 231, 7, 0), 24),
                (std::net::Ipv4Addr::new(192, 0, 2, 0), 24)
            ]
        );
    }

    #[test]
    fn a_subnet_no_route_overlaps() {
        use std::net::Ipv4Addr;
        let gw = super::free_subnet("00000000", &[]).unwrap();
        assert_eq!(gw, Ipv4Addr::new(10, 200, 0, 1));
        // taken: the /24 itself, then a /16 over the next ones
        let routes = [
            (Ipv4Addr::new(10, 200, 0, 0), 24),
            (Ipv4Addr::new(10, 200, 1, 0), 24),
        ];
        assert_eq!(
            super::free_subnet("00000000", &routes).unwrap(),
            Ipv4Addr::new(10, 200, 2, 1)
        );
        let wide = [(Ipv4Addr::new(10, 200, 0, 0), 16)];
        assert_eq!(
            super::free_subnet("00000000", &wide).unwrap(),
            Ipv4Addr::new(10, 201, 0, 1)
        );
    }
}
