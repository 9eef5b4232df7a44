//! VMs as Incus instances: make, read, power, resize, remove, usage; the keys boxery writes
//! on its instances and the seed it puts in them.

use hyper::Method;
use serde_json::{Map, Value, json};

use super::*;
use crate::mark::Mark;
use crate::storage::seed;
use boxery_api::network::EgressPolicy;

/// boxery's mark (`<object uid>@<store uid>`).
pub(super) const MARK: &str = "user.boxery.mark";
/// The boxery name of the VM or image the instance is.
pub(super) const BXNAME: &str = "user.boxery.name";
/// Present while the instance is being made: it is not yet the VM (or image) it will be.
pub(super) const PARTIAL: &str = "user.boxery.partial";
/// `vm` or `image`.
pub(super) const KIND: &str = "user.boxery.kind";
/// The pinned public host key.
pub(super) const HOST_KEY: &str = "user.boxery.host-key";
/// The seed's instance-id.
pub(super) const INSTANCE_ID: &str = "user.boxery.instance-id";
/// The disk size asked for, in GiB.
pub(super) const DISK: &str = "user.boxery.disk-gib";
/// The image a VM was made from, or what an image was made from.
pub(super) const SOURCE: &str = "user.boxery.source";
/// When an image was made (RFC 3339).
pub(super) const CREATED: &str = "user.boxery.created";
/// The VM's egress policy (`Public`, `Allowlist`, `Deny`): what the firewall confines.
pub(super) const EGRESS: &str = "user.boxery.egress";
/// On the new instance of a reimage until it has taken the VM's place.
pub(super) const REIMAGE: &str = "user.boxery.reimage";
/// On the new instance of a reimage: the VM's MAC address, which becomes the instance's own
/// (`volatile.eth0.hwaddr`) when it commits, once the old instance is gone. Made beside the
/// VM with the VM's MAC, its NIC was refused ("MAC address already defined on another NIC",
/// incusd skipping the device's add).
pub(super) const MAC: &str = "user.boxery.mac";
/// Whether incusd starts an instance at its own start: `false` on everything boxery makes
/// (at the host's boot incusd would start a guest before boxery's `init` made its firewall).
pub(super) const AUTOSTART: &str = "boot.autostart";
/// Where Incus keeps the MAC address of an instance's `eth0`.
pub(super) const HWADDR: &str = "volatile.eth0.hwaddr";

/// How long a firewall made or seen whole is taken as it is on a reconcile step (a start
/// always looks).
const FIREWALL_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// Where cloud-init's NoCloud datasource reads a seed from a directory.
const SEED_DIR: &str = "/var/lib/cloud/seed/nocloud";

/// A configuration value of an instance.
pub(super) fn cfg<'a>(inst: &'a Value, key: &str) -> Option<&'a str> {
    inst["config"][key].as_str()
}

/// Whether instance `inst` is boxery's `name` (its name key says so, and it is at the
/// instance name `name` gets: a reimage's side instances are not).
pub(super) fn is_named(inst: &Value, name: &str) -> bool {
    cfg(inst, BXNAME) == Some(name) && inst["name"].as_str() == Some(&instance_name(name))
}

/// Its mark when it is complete.
pub(super) fn complete_mark(inst: &Value) -> Option<&str> {
    if cfg(inst, PARTIAL).is_some() {
        return None;
    }
    cfg(inst, MARK).filter(|m| !m.is_empty())
}

/// The name of a side instance (`bx-new-…`, `bx-old-…`) of a reimage of instance `inst`.
pub(super) fn side_name(what: &str, inst: &str) -> String {
    format!(
        "bx-{what}-{:08x}",
        boxery_api::fnv::fnv1a(inst.as_bytes()) as u32
    )
}

/// `256MiB` → 256; `1GiB` → 1024; a bare number is bytes.
fn parse_mib(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "MiB" | "MB" => n,
        "GiB" | "GB" => n * 1024,
        "KiB" | "kB" => n / 1024,
        "" | "B" => n / (1024 * 1024),
        _ => return None,
    })
}

/// The guest's IPv4 address: its NIC's DHCP lease on the bridge (by the MAC Incus gave the NIC),
/// as the host's dnsmasq handed it out; never what the guest says of itself (the instance
/// state's addresses are read from inside the guest).
fn address(inst: &Value, leases: &[Value]) -> Option<String> {
    let mac = cfg(inst, HWADDR)?;
    leases
        .iter()
        .filter(|l| {
            l["hwaddr"]
                .as_str()
                .is_some_and(|h| h.eq_ignore_ascii_case(mac))
        })
        .filter_map(|l| l["address"].as_str())
        .find(|a| a.parse::<std::net::Ipv4Addr>().is_ok())
        .map(str::to_string)
}

/// A VM as boxery sees its instance (`leases`: the bridge's DHCP leases).
fn info(inst: &Value, leases: &[Value]) -> VmInfo {
    let running = matches!(inst["status"].as_str(), Some("Running" | "Frozen"));
    VmInfo {
        name: cfg(inst, BXNAME)
            .or(inst["name"].as_str())
            .unwrap_or_default()
            .to_string(),
        mark: complete_mark(inst).map(str::to_string),
        state: if running {
            PowerState::Running
        } else {
            PowerState::Stopped
        },
        size: VmSize {
            cpus: cfg(inst, "limits.cpu")
                .and_then(|c| c.parse().ok())
                .unwrap_or(1),
            memory_mib: cfg(inst, "limits.memory").and_then(parse_mib).unwrap_or(0),
            disk_gib: cfg(inst, DISK).and_then(|d| d.parse().ok()).unwrap_or(0),
        },
        ssh: running
            .then(|| address(inst, leases))
            .flatten()
            .map(|a| format!("{a}:22")),
        disk_used_bytes: inst["state"]["disk"]["root"]["usage"]
            .as_u64()
            .filter(|u| *u > 0),
        degraded: None,
        memory: None,
        inherited: false,
    }
}

/// How long a disk usage measured by `du` is reported before it is measured again.
const DISK_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl Inner {
    /// Fill in what `infos`' files take on the pool where incusd does not report it (a `dir`
    /// pool keeps no accounting): from a `du` of each instance's directory, made in the
    /// background at most once a minute per VM, so that a listing never waits for one. A VM
    /// never measured yet reports nothing (the first listing starts its measure).
    pub(super) fn disk_used(this: &Arc<Inner>, infos: &mut [VmInfo]) {
        // only a `dir` pool leaves it to boxery (btrfs quotas are counted by incusd)
        if this.config.driver != PoolDriver::Dir {
            return;
        }
        let now = std::time::Instant::now();
        let mut stale = Vec::new();
        {
            let cache = this.disk.lock().unwrap();
            for i in infos.iter_mut().filter(|i| i.disk_used_bytes.is_none()) {
                let inst = instance_name(&i.name);
                match cache.get(&inst) {
                    Some((at, bytes)) => {
                        i.disk_used_bytes = *bytes;
                        if now.duration_since(*at) > DISK_EVERY {
                            stale.push(inst);
                        }
                    }
                    None => stale.push(inst),
                }
            }
        }
        if stale.is_empty() {
            return;
        }
        {
            // measured once at a time: mark them measured now, so concurrent listings do not
            // start another `du` of the same tree
            let mut cache = this.disk.lock().unwrap();
            for inst in &stale {
                let old = cache.get(inst).and_then(|(_, b)| *b);
                cache.insert(inst.clone(), (now, old));
            }
        }
        let this = this.clone();
        tokio::spawn(async move {
            for inst in stale {
                let dir = this
                    .state
                    .join("pool/dir/containers")
                    .join(format!("{}_{inst}", this.project));
                let out = tokio::process::Command::new("du")
                    .args(["-s", "-x", "-B1"])
                    .arg(&dir)
                    .stdin(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true)
                    .output()
                    .await;
                let bytes = out.ok().and_then(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .split_whitespace()
                        .next()?
                        .parse::<u64>()
                        .ok()
                });
                // not measurable (gone, not yet made): asked again at the next listing
                let mut cache = this.disk.lock().unwrap();
                match bytes {
                    Some(b) => {
                        cache.insert(inst, (std::time::Instant::now(), Some(b)));
                    }
                    None => {
                        cache.remove(&inst);
                    }
                }
            }
        });
    }

    /// `/1.0/instances/INST?project=PROJECT` (with `more` appended to the query).
    pub(super) fn path(&self, project: &str, inst: &str, more: &str) -> String {
        format!("/1.0/instances/{inst}?project={project}{more}")
    }

    /// Instance `inst` of `project`, in full (state included); `None` when there is none.
    pub(super) async fn instance(&self, project: &str, inst: &str) -> Result<Option<Value>> {
        self.client
            .get_opt(&self.path(project, inst, "&recursion=1"))
            .await
            .map_err(api(format!("read instance {inst}")))
    }

    /// Every instance of `project`, in full.
    pub(super) async fn instances(&self, project: &str) -> Result<Vec<Value>> {
        let v = self
            .client
            .get(&format!("/1.0/instances?project={project}&recursion=2"))
            .await
            .map_err(api(format!("list the instances of project {project}")))?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    /// VM `name`'s instance when it is boxery's (complete or not).
    pub(super) async fn vm_instance(&self, name: &str) -> Result<Option<Value>> {
        let inst = instance_name(name);
        Ok(self
            .instance(&self.project, &inst)
            .await?
            .filter(|i| is_named(i, name)))
    }

    /// VM `name`'s instance, complete: `NotFound` otherwise.
    async fn complete_vm(&self, name: &str) -> Result<Value> {
        self.vm_instance(name)
            .await?
            .filter(|i| complete_mark(i).is_some())
            .ok_or_else(|| BackendError::not_found(NAME, format!("VM {name}")))
    }

    /// Change instance `inst`'s configuration and devices with `f`, sent back with the ETag
    /// it was read with (read again and redone when it changed in between).
    pub(super) async fn update(
        &self,
        project: &str,
        inst: &str,
        f: impl Fn(&mut Map<String, Value>, &mut Map<String, Value>) -> Result<()>,
    ) -> Result<()> {
        let path = self.path(project, inst, "");
        for _ in 0..5 {
            let (mut v, etag) = self
                .client
                .get_etag(&path)
                .await
                .map_err(api(format!("read instance {inst}")))?;
            let mut config = v["config"].as_object().cloned().unwrap_or_default();
            let mut devices = v["devices"].as_object().cloned().unwrap_or_default();
            f(&mut config, &mut devices)?;
            v["config"] = Value::Object(config);
            v["devices"] = Value::Object(devices);
            let put = json!({
                "architecture": v["architecture"],
                "config": v["config"],
                "devices": v["devices"],
                "ephemeral": v["ephemeral"],
                "profiles": v["profiles"],
                "stateful": v["stateful"],
                "description": v["description"],
            });
            match self.client.put_if_match(&path, put, etag.as_deref()).await {
                Ok(_) => return Ok(()),
                Err(ApiError::Changed) => continue,
                Err(e) => return Err(api(format!("update instance {inst}"))(e)),
            }
        }
        Err(BackendError::failed(
            format!("update instance {inst}"),
            "it kept changing while boxery updated it",
        ))
    }

    /// Take `PARTIAL` off instance `inst`: it is now what it was made to be.
    pub(super) async fn commit(&self, project: &str, inst: &str) -> Result<()> {
        self.update(project, inst, |c, _| {
            c.remove(PARTIAL);
            c.remove(REIMAGE);
            if let Some(mac) = c.remove(MAC) {
                c.insert(HWADDR.into(), mac);
            }
            Ok(())
        })
        .await
    }

    /// Delete instance `inst` of `project`, stopping it first; gone already is fine, also
    /// when it went while this ran (another process deleting it at the same moment: Incus
    /// then answers the loser with a 500 about a finished operation, not a 404).
    pub(super) async fn delete(&self, project: &str, inst: &str) -> Result<()> {
        let stopped = self
            .client
            .call(
                Method::PUT,
                &format!("/1.0/instances/{inst}/state?project={project}"),
                json!({"action": "stop", "force": true}),
            )
            .await;
        if let Err(e) = stopped {
            match self.instance(project, inst).await? {
                None => return Ok(()),
                Some(i) if i["status"] == "Stopped" => {}
                Some(_) => return Err(api(format!("stop instance {inst}"))(e)),
            }
        }
        match self
            .client
            .call(Method::DELETE, &self.path(project, inst, ""), Value::Null)
            .await
        {
            Ok(_) => Ok(()),
            Err(e @ ApiError::Connect { .. }) => Err(api(format!("delete instance {inst}"))(e)),
            Err(e) => match self.instance(project, inst).await? {
                None => Ok(()),
                Some(_) => Err(api(format!("delete instance {inst}"))(e)),
            },
        }
    }

    /// The root disk of `disk_gib` GiB on the pool: its size a quota where the pool enforces
    /// one (btrfs), else left out (a `dir` pool refuses none, but enforces none either).
    pub(super) fn root_disk(&self, disk_gib: u64) -> Value {
        let mut root = json!({"type": "disk", "path": "/", "pool": self.pool});
        if self.config.driver == PoolDriver::Btrfs {
            root["size"] = format!("{disk_gib}GiB").into();
        }
        root
    }

    /// The devices of VM instance `inst`: its root disk on the pool, its NIC on the bridge
    /// (under the host-side name the firewall knows it by).
    pub(super) fn devices(&self, inst: &str, disk_gib: u64) -> Value {
        json!({
            "root": self.root_disk(disk_gib),
            "eth0": {
                "type": "nic",
                "name": "eth0",
                "network": self.network,
                // no guest reaches another on the bridge (a bridge port flag: guest → guest
                // frames never leave the bridge, where no L3 rule would see them)
                "security.port_isolation": "true",
                // no frame from another MAC, no packet from another IPv4 address than the one
                // the host's DHCP gave it, no ARP claiming one (the NIC's address is then a
                // static allocation of the bridge's dnsmasq)
                "security.mac_filtering": "true",
                "security.ipv4_filtering": "true",
                "host_name": firewall::veth_name(&self.ns, inst),
            },
        })
    }

    /// Put the seed (`user-data`, `meta-data`) into instance `inst` of `project`, where
    /// cloud-init's NoCloud datasource reads it at the next boot. Root's only (it holds the
    /// host's private key and the token).
    pub(super) async fn write_seed(
        &self,
        project: &str,
        inst: &str,
        user: &str,
        meta: &str,
    ) -> Result<()> {
        let step = || api(format!("write the seed of instance {inst}"));
        for (dir, mode) in [
            ("/var/lib/cloud", 0o755),
            ("/var/lib/cloud/seed", 0o755),
            (SEED_DIR, 0o700),
        ] {
            self.client
                .mkdir(project, inst, dir, mode)
                .await
                .map_err(step())?;
        }
        for (file, data) in [("meta-data", meta), ("user-data", user)] {
            self.client
                .push_file(
                    project,
                    inst,
                    &format!("{SEED_DIR}/{file}"),
                    data.as_bytes(),
                    0o600,
                )
                .await
                .map_err(step())?;
        }
        Ok(())
    }

    pub(super) async fn create(&self, vm: &NewVm) -> Result<()> {
        check_name("VM", &vm.name)?;
        if vm.memory {
            return Err(BackendError::Invalid(
                "the incus backend cannot start a VM from memory".into(),
            ));
        }
        if vm.cpus == 0 || vm.memory_mib < 64 {
            return Err(BackendError::Invalid(format!(
                "VM {} needs at least 1 CPU and 64 MiB (asked: {} CPUs, {} MiB)",
                vm.name, vm.cpus, vm.memory_mib
            )));
        }
        let crate::DiskSource::Image(image) = &vm.source;
        let img = self.image_instance(image).await?;
        let Some(img) = img.filter(|i| complete_mark(i).is_some()) else {
            return Err(BackendError::not_found(NAME, format!("image {image}")));
        };
        let inst = instance_name(&vm.name);
        if let Some(cur) = self.instance(&self.project, &inst).await? {
            if cfg(&cur, BXNAME) != Some(vm.name.as_str()) {
                return Err(BackendError::Invalid(format!(
                    "the Incus instance {inst} in project {} is not VM {}: rename one of them",
                    self.project, vm.name
                )));
            }
            match complete_mark(&cur) {
                None => self.delete(&self.project, &inst).await?,
                Some(m) if Mark::same_object(m, &vm.uid) => {
                    if vm.start {
                        self.start(&vm.name).await?;
                    }
                    return Ok(());
                }
                Some(_) => {
                    return Err(BackendError::Invalid(format!(
                        "VM {} exists, made for another object",
                        vm.name
                    )));
                }
            }
        }
        let identity = seed::complete_identity(&vm.name, &vm.identity)?;
        let instance_id = seed::new_instance_id();
        let user = seed::user_data(&vm.name, &identity, seed::Guest::Boxery)
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
        let meta = seed::meta_data(&instance_id, &identity.hostname);
        let public = identity
            .host_key
            .as_ref()
            .map(|(_, p)| p.trim().to_string())
            .unwrap_or_default();
        let body = json!({
            "name": inst,
            "type": "container",
            "source": {
                "type": "copy",
                "source": img["name"],
                "project": self.images,
                "instance_only": true,
            },
            "profiles": [],
            "config": {
                MARK: vm.uid,
                BXNAME: vm.name,
                PARTIAL: "1",
                KIND: "vm",
                HOST_KEY: public,
                INSTANCE_ID: instance_id,
                DISK: vm.disk_gib.to_string(),
                SOURCE: image,
                EGRESS: vm.egress.as_str(),
                CREATED: boxery_api::now().to_rfc3339(),
                "limits.cpu": vm.cpus.to_string(),
                "limits.memory": format!("{}MiB", vm.memory_mib),
                "security.privileged": "false",
                "security.nesting": "false",
                // incusd never starts it on its own (at the host's boot, before `init` has
                // made the firewall)
                AUTOSTART: "false",
            },
            "devices": self.devices(&inst, vm.disk_gib),
        });
        self.client
            .call(
                Method::POST,
                &format!("/1.0/instances?project={}", self.project),
                body,
            )
            .await
            .map_err(api(format!("make instance {inst} from image {image}")))?;
        self.keep_seed(&vm.name, &user, &meta)?;
        self.write_seed(&self.project, &inst, &user, &meta).await?;
        // the firewall made from the instances as they are now (this one's policy in them),
        // before the commit: a VM is never complete without its confinement in force
        self.apply_firewall().await?;
        self.commit(&self.project, &inst).await?;
        if vm.start {
            self.start(&vm.name).await?;
        }
        Ok(())
    }

    /// The DHCP leases of the bridge, of the VMs' project's instances (Incus lists the leases
    /// of the project asked for).
    async fn leases(&self) -> Result<Vec<Value>> {
        let v = self
            .client
            .get_opt(&format!(
                "/1.0/networks/{}/leases?project={}",
                self.network, self.project
            ))
            .await
            .map_err(api(format!("read the leases of network {}", self.network)))?;
        Ok(v.and_then(|v| v.as_array().cloned()).unwrap_or_default())
    }

    pub(super) async fn get(&self, name: &str) -> Result<Option<VmInfo>> {
        let Some(inst) = self
            .vm_instance(name)
            .await?
            .filter(|i| complete_mark(i).is_some())
        else {
            return Ok(None);
        };
        let leases = if inst["status"] == "Running" {
            self.leases().await?
        } else {
            Vec::new()
        };
        Ok(Some(info(&inst, &leases)))
    }

    pub(super) async fn list(&self) -> Result<Vec<VmInfo>> {
        let leases = self.leases().await?;
        let mut out: Vec<VmInfo> = self
            .instances(&self.project)
            .await?
            .iter()
            // a VM is at the instance name its boxery name gives; a reimage's side instances
            // (its name at another instance) are not VMs of their own; an instance without
            // the key is listed, unmarked
            .filter(|i| cfg(i, BXNAME).is_none_or(|n| is_named(i, n)))
            .map(|i| info(i, &leases))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Send instance `inst` a state change.
    pub(super) async fn set_state(&self, inst: &str, body: Value) -> Result<()> {
        self.client
            .call(
                Method::PUT,
                &format!("/1.0/instances/{inst}/state?project={}", self.project),
                body.clone(),
            )
            .await
            .map(|_| ())
            .map_err(api(format!("{} instance {inst}", body["action"])))
    }

    pub(super) async fn start(&self, name: &str) -> Result<()> {
        let cur = self.complete_vm(name).await?;
        let inst = instance_name(name);
        if cur["status"] != "Running" {
            // never a guest running without its firewall: looked at now, whatever was seen
            self.ensure_firewall(std::time::Duration::ZERO).await?;
        }
        match cur["status"].as_str() {
            Some("Running") => Ok(()),
            Some("Frozen") => self.set_state(&inst, json!({"action": "unfreeze"})).await,
            _ => self.set_state(&inst, json!({"action": "start"})).await,
        }
    }

    pub(super) async fn stop(&self, name: &str) -> Result<()> {
        let cur = self.complete_vm(name).await?;
        if cur["status"] == "Stopped" {
            return Ok(());
        }
        let inst = instance_name(name);
        let clean = self
            .set_state(
                &inst,
                json!({
                    "action": "stop",
                    "timeout": self.config.stop_timeout.as_secs(),
                    "force": false,
                }),
            )
            .await;
        if clean.is_err() {
            tracing::warn!(
                vm = name,
                "the container did not shut down in time; stopping it by force"
            );
            self.set_state(&inst, json!({"action": "stop", "force": true}))
                .await?;
        }
        Ok(())
    }

    pub(super) async fn remove(&self, name: &str) -> Result<()> {
        if self.vm_instance(name).await?.is_some() {
            self.delete(&self.project, &instance_name(name)).await?;
        }
        self.remove_sides(name).await?;
        crate::storage::files::remove_dir_if_exists(&self.seed_dir(name))
            .map_err(crate::io(format!("removing VM {name}'s seed")))
    }

    /// Where VM `name`'s seed is kept on the host (0700; the files 0600): what a reimage
    /// that keeps its identity writes again, never read back from the guest's disk, which
    /// the guest may have changed.
    pub(super) fn seed_dir(&self, name: &str) -> std::path::PathBuf {
        self.state.join("seeds").join(instance_name(name))
    }

    /// Keep VM `name`'s seed on the host ([`Inner::seed_dir`]).
    pub(super) fn keep_seed(&self, name: &str, user: &str, meta: &str) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.seed_dir(name);
        let io = |what: &str| crate::io(format!("keeping VM {name}'s seed ({what})"));
        std::fs::create_dir_all(&dir).map_err(io("its directory"))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("its directory"))?;
        crate::storage::files::write_atomic(&dir.join("user-data"), user.as_bytes(), 0o600)
            .map_err(io("user-data"))?;
        crate::storage::files::write_atomic(&dir.join("meta-data"), meta.as_bytes(), 0o600)
            .map_err(io("meta-data"))
    }

    /// VM `name`'s seed as the host keeps it; `None` when it is not there.
    pub(super) fn kept_seed(&self, name: &str) -> Result<Option<(String, String)>> {
        let dir = self.seed_dir(name);
        let read = |f: &str| match std::fs::read_to_string(dir.join(f)) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BackendError::io(format!("reading VM {name}'s seed"), e)),
        };
        Ok(match (read("user-data")?, read("meta-data")?) {
            (Some(u), Some(m)) => Some((u, m)),
            _ => None,
        })
    }

    /// Delete what an interrupted reimage of VM `name` left beside it.
    pub(super) async fn remove_sides(&self, name: &str) -> Result<()> {
        let inst = instance_name(name);
        for what in ["new", "old"] {
            let side = side_name(what, &inst);
            if let Some(s) = self.instance(&self.project, &side).await?
                && cfg(&s, BXNAME) == Some(name)
            {
                self.delete(&self.project, &side).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn cleanup_new(&self, name: &str) -> Result<()> {
        if let Some(cur) = self.vm_instance(name).await?
            && complete_mark(&cur).is_none()
        {
            self.delete(&self.project, &instance_name(name)).await?;
        }
        Ok(())
    }

    pub(super) async fn resize(&self, name: &str, size: VmSize) -> Result<()> {
        let cur = info(&self.complete_vm(name).await?, &[]);
        if size.cpus == 0 || size.memory_mib < 64 {
            return Err(BackendError::Invalid(format!(
                "VM {name} needs at least 1 CPU and 64 MiB (asked: {} CPUs, {} MiB)",
                size.cpus, size.memory_mib
            )));
        }
        if size.disk_gib < cur.size.disk_gib {
            return Err(BackendError::Invalid(format!(
                "VM {name}'s disk is {} GiB: disks only grow (asked: {} GiB)",
                cur.size.disk_gib, size.disk_gib
            )));
        }
        if size == cur.size {
            return Ok(());
        }
        // limits apply live to a running container, a btrfs quota too
        let root = self.root_disk(size.disk_gib);
        self.update(&self.project, &instance_name(name), |c, d| {
            c.insert("limits.cpu".into(), size.cpus.to_string().into());
            c.insert(
                "limits.memory".into(),
                format!("{}MiB", size.memory_mib).into(),
            );
            c.insert(DISK.into(), size.disk_gib.to_string().into());
            d.insert("root".into(), root.clone());
            Ok(())
        })
        .await
    }

    pub(super) async fn set_egress(&self, name: &str, policy: EgressPolicy) -> Result<()> {
        let cur = self.complete_vm(name).await?;
        if cfg(&cur, EGRESS) == Some(policy.as_str()) {
            // cheap when in force; made again when the tables went or a change failed
            return self.ensure_firewall(FIREWALL_RECHECK).await;
        }
        self.update(&self.project, &instance_name(name), |c, _| {
            c.insert(EGRESS.into(), policy.as_str().into());
            Ok(())
        })
        .await?;
        self.apply_firewall().await
    }

    pub(super) async fn host_key(&self, name: &str) -> Result<Option<String>> {
        Ok(self
            .vm_instance(name)
            .await?
            .and_then(|i| cfg(&i, HOST_KEY).map(str::to_string))
            .filter(|k| !k.is_empty()))
    }

    pub(super) async fn usage(&self) -> Result<Vec<VmUsage>> {
        Ok(self
            .instances(&self.project)
            .await?
            .iter()
            .filter(|i| i["status"] == "Running" && complete_mark(i).is_some())
            .filter(|i| cfg(i, BXNAME).is_some_and(|n| is_named(i, n)))
            .map(|i| {
                let s = &i["state"];
                let net = &s["network"]["eth0"]["counters"];
                VmUsage {
                    name: cfg(i, BXNAME).unwrap_or_default().to_string(),
                    cpu_seconds: s["cpu"]["usage"].as_u64().unwrap_or(0) as f64 / 1e9,
                    rss_bytes: s["memory"]["usage"].as_u64().unwrap_or(0),
                    network_rx_bytes: net["bytes_received"].as_u64(),
                    network_tx_bytes: net["bytes_sent"].as_u64(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_as_incus_writes_them() {
        assert_eq!(parse_mib("256MiB"), Some(256));
        assert_eq!(parse_mib("2GiB"), Some(2048));
        assert_eq!(parse_mib("268435456"), Some(256));
        assert_eq!(parse_mib("lots"), None);
    }

    #[test]
    fn names_incus_refuses_get_a_name_of_their_own() {
        assert_eq!(instance_name("dev1"), "dev1");
        let dotted = instance_name("a.b");
        assert!(dotted.starts_with("a-b-") && dotted.len() == 10, "{dotted}");
        assert_ne!(instance_name("a.b"), instance_name("a-b"));
        let long = instance_name(&format!("{}.x", "a".repeat(61)));
        assert!(long.len() <= 63, "{long}");
    }

    #[test]
    fn the_address_is_the_hosts_lease_for_the_nics_mac_never_the_guests_word() {
        let inst = json!({
            "config": {"volatile.eth0.hwaddr": "10:66:6a:00:00:01"},
            "state": {"network": {"eth0": {"addresses": [
                {"family": "inet", "scope": "global", "address": "10.200.0.99"}
            ]}}},
        });
        let leases = [
            json!({"hwaddr": "10:66:6a:00:00:02", "address": "10.200.0.7"}),
            json!({"hwaddr": "10:66:6A:00:00:01", "address": "10.200.0.8"}),
        ];
        assert_eq!(address(&inst, &leases).as_deref(), Some("10.200.0.8"));
        assert_eq!(address(&inst, &leases[..1]), None);
    }

    #[test]
    fn names_of_the_backends_own_are_refused() {
        assert!(check_name("VM", "dev1").is_ok());
        assert!(matches!(
            check_name("VM", "bx-new-0a0b0c0d"),
            Err(BackendError::Invalid(_))
        ));
        assert!(matches!(
            check_name("VM", "-a"),
            Err(BackendError::Invalid(_))
        ));
        assert!(instance_name("1abc").starts_with("x1abc-"));
        // nothing but a-z 0-9 - reaches an API path or a file name, whatever the name holds
        for hostile in [
            "x?project=default",
            "a/../../etc",
            "A.B",
            "x y",
            &"a".repeat(80),
        ] {
            let inst = instance_name(hostile);
            assert!(
                inst.len() <= 63
                    && inst
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{hostile:?} → {inst:?}"
            );
        }
    }

    #[test]
    fn a_partial_instance_has_no_mark() {
        let done = json!({"name": "a", "config": {MARK: "u@s", BXNAME: "a"}});
        let partial = json!({"name": "a", "config": {MARK: "u@s", BXNAME: "a", PARTIAL: "1"}});
        assert_eq!(complete_mark(&done), Some("u@s"));
        assert_eq!(complete_mark(&partial), None);
        assert!(is_named(&done, "a"));
        let side = json!({"name": side_name("new", "a"), "config": {BXNAME: "a"}});
        assert!(!is_named(&side, "a"));
    }
}
