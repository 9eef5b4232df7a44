//! The libvirt backend against a real libvirtd (started by `scripts/libvirtd.sh start` when it
//! does not answer), booting the tiny guest under TCG. These tests FAIL (never skip) when
//! libvirt is missing. Every domain, volume and file they make is removed even when they fail
//! (a guard undefines the namespace's domains and deletes its pool directory).
//!
//! `cargo test -p boxery-backends --features libvirt --test libvirt`

use std::path::PathBuf;
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use boxery_backends::libvirt::{LibvirtBackend, LibvirtConfig};
use boxery_backends::{Backend, BackendError, DiskSource, NewVm, PowerState, VmSize, identity};

mod libvirt_support;
mod screen_support;
use libvirt_support::{filter_state, need_libvirtd, virsh};

/// QEMU 10.0's assertion when multi-threaded TCG races a memory-map update (upstream bug).
const KNOWN_TCG_RACE: &str = "iotlb_to_section: Assertion";

struct Env {
    tmp: tempfile::TempDir,
    backend: LibvirtBackend,
    key: PathBuf,
    public: String,
}

impl Env {
    async fn new() -> Env {
        need_libvirtd();
        let tmp = tempfile::Builder::new()
            .prefix("bxl")
            .tempdir_in("/tmp")
            .unwrap();
        let mut config = LibvirtConfig::from_env();
        config.powerdown_timeout = Duration::from_secs(20);
        let backend = LibvirtBackend::with_config(tmp.path().join("libvirt"), config);
        backend.init().await.expect("init: pool, filter, network");
        let key = tmp.path().join("id_ed25519");
        assert!(
            std::process::Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", "t", "-f"])
                .arg(&key)
                .status()
                .unwrap()
                .success()
        );
        let public = std::fs::read_to_string(key.with_extension("pub"))
            .unwrap()
            .trim()
            .to_string();
        let p: boxery_backends::Progress = Arc::new(|_l: &str| {});
        backend
            .build_image(
                boxery_backends::Stock {
                    layers: &[],
                    name: "tiny",
                    image: "tiny",
                    uid: "uid-tiny",
                },
                p,
            )
            .await
            .expect("the tiny image builds (image/build-tiny.sh)");
        Env {
            tmp,
            backend,
            key,
            public,
        }
    }

    fn vm(&self, name: &str, image: &str) -> NewVm {
        NewVm {
            name: name.into(),
            uid: format!("uid-{name}"),
            source: DiskSource::Image(image.into()),
            cpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            start: true,
            identity: identity::generate(name, std::slice::from_ref(&self.public)).unwrap(),
            egress: boxery_api::network::EgressPolicy::Public,
            memory: false,
        }
    }

    async fn known_hosts(&self, vm: &str) -> PathBuf {
        let key = self
            .backend
            .host_key(vm)
            .await
            .unwrap()
            .expect("a pinned key");
        let p = self.tmp.path().join(format!("kh-{vm}"));
        std::fs::write(&p, format!("{vm}.boxery {key}\n")).unwrap();
        p
    }

    async fn endpoint(&self, vm: &str, timeout: Duration) -> String {
        let t = Instant::now();
        loop {
            if let Some(e) = self.backend.ssh_endpoint(vm).await.unwrap() {
                return e;
            }
            assert!(
                t.elapsed() < timeout,
                "VM {vm} got no DHCP lease in {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn ssh(&self, vm: &str, cmd: &str) -> Output {
        let ep = self.endpoint(vm, Duration::from_secs(120)).await;
        let (host, port) = ep.rsplit_once(':').unwrap();
        let kh = self.known_hosts(vm).await;
        tokio::process::Command::new("ssh")
            .args([
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=3",
                "-o",
                "LogLevel=ERROR",
            ])
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", kh.display()))
            .arg("-o")
            .arg(format!("HostKeyAlias={vm}.boxery"))
            .arg("-i")
            .arg(&self.key)
            .arg("-p")
            .arg(port)
            .arg(format!("agent@{host}"))
            .arg(cmd)
            .output()
            .await
            .unwrap()
    }

    /// Run `cmd` once ssh answers (up to 120 s); its stdout.
    ///
    /// A domain that QEMU took down with TCG's multi-thread race (an upstream QEMU 10.0 bug,
    /// seen on 2-vCPU boots: docs/backends.md, "Known QEMU faults") is started again once, with
    /// a note; any other crash fails with QEMU's log.
    async fn run(&self, vm: &str, cmd: &str) -> String {
        let t = Instant::now();
        let mut restarted = false;
        loop {
            let o = self.ssh(vm, cmd).await;
            if o.status.success() {
                return String::from_utf8_lossy(&o.stdout).trim().to_string();
            }
            if let Some(log) = self.crashed(vm) {
                if !restarted && log.contains(KNOWN_TCG_RACE) {
                    eprintln!(
                        "note: QEMU of {vm} crashed with the known TCG race; starting it again"
                    );
                    restarted = true;
                    self.backend.start(vm).await.unwrap();
                    continue;
                }
                panic!("the domain of {vm} crashed: QEMU's log ends:\n{log}");
            }
            if t.elapsed() > Duration::from_secs(120) {
                let serial = std::fs::read_to_string(
                    self.backend.pool_dir().join(format!("vm-{vm}-serial.log")),
                )
                .unwrap_or_default();
                let tail: Vec<&str> = serial.lines().rev().take(12).collect();
                let leases =
                    String::from_utf8_lossy(&virsh(&["net-dhcp-leases", "default"]).stdout)
                        .to_string();
                panic!(
                    "ssh {vm} `{cmd}` failed: {}\nserial (last lines, newest first): {tail:#?}\nleases: {leases}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// If `vm`'s domain is shut off because QEMU crashed: the tail of QEMU's log.
    fn crashed(&self, vm: &str) -> Option<String> {
        let dom = self.backend.domain_name(vm);
        let state = virsh(&["domstate", "--reason", &dom]);
        if !String::from_utf8_lossy(&state.stdout).contains("crashed") {
            return None;
        }
        let log =
            std::fs::read_to_string(format!("/var/log/libvirt/qemu/{dom}.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        Some(tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
    }

    fn domains(&self) -> Vec<String> {
        libvirt_support::domains(&self.backend)
    }

    fn pool_files(&self, pat: &str) -> Vec<String> {
        std::fs::read_dir(self.backend.pool_dir())
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|f| f.contains(pat))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Env {
    /// Remove every domain of this namespace and the pool (also when the test failed).
    fn drop(&mut self) {
        libvirt_support::clean(&self.backend);
    }
}

/// create → ssh with the pinned key → capture (running) → change → reimage (data back, same
/// identity) → fork ×2 from the image (new identities) → delete image and source: forks still
/// boot → capture of a stopped VM → resize → remove all: nothing left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_capture_reimage_fork_resize_remove() {
    let env = Env::new().await;
    let b = &env.backend;
    b.create(&env.vm("a", "tiny")).await.unwrap();
    let info = b.get("a").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    assert_eq!(info.mark.as_deref(), Some("uid-a"));
    let dom = env.domains();
    assert_eq!(dom, vec![b.domain_name("a")]);
    let xml = String::from_utf8_lossy(&virsh(&["dumpxml", &b.domain_name("a")]).stdout).to_string();
    assert!(
        xml.contains("<domain type='qemu'") || xml.contains("<domain type='kvm'"),
        "{xml}"
    );
    if std::env::var("BOXERY_NET_ISOLATION").as_deref() != Ok("off") {
        assert!(
            xml.contains("filter='boxery-guest'"),
            "the filter is on the NIC"
        );
    }
    assert_eq!(env.run("a", "hostname").await, "a");
    env.run("a", "echo one > /home/agent/f && sync").await;
    let mac_a = xml.split("<mac address='").nth(1).unwrap()[..17].to_string();
    let uuid_a = String::from_utf8_lossy(&virsh(&["domuuid", &b.domain_name("a")]).stdout)
        .trim()
        .to_string();
    let ep_a = env.endpoint("a", Duration::from_secs(5)).await;

    // live capture
    let t = Instant::now();
    b.capture("a", "img1", "uid-img1").await.unwrap();
    eprintln!("capture of a running VM: {:?}", t.elapsed());
    assert!(b.images().await.unwrap().iter().any(|i| i.name == "img1"));
    let img = b.pool_dir().join("img-img1.qcow2");
    let info = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain"])
        .arg(&img)
        .output()
        .unwrap();
    let chain = String::from_utf8_lossy(&info.stdout);
    assert_eq!(
        chain.matches("image: ").count(),
        2,
        "the image is one overlay on the base: {chain}"
    );
    env.run("a", "echo two > /home/agent/f && sync").await;
    assert_eq!(env.run("a", "cat /home/agent/f").await, "two");

    // reimage: data back, identity kept
    let id = identity::generate("a", std::slice::from_ref(&env.public)).unwrap();
    let mut same = id.clone();
    same.host_key = None; // keep the pinned key: same identity
    b.reimage("a", "img1", &same).await.unwrap();
    assert_eq!(env.run("a", "cat /home/agent/f").await, "one");
    let xml2 =
        String::from_utf8_lossy(&virsh(&["dumpxml", &b.domain_name("a")]).stdout).to_string();
    assert!(xml2.contains(&mac_a), "MAC kept");
    assert_eq!(
        String::from_utf8_lossy(&virsh(&["domuuid", &b.domain_name("a")]).stdout).trim(),
        uuid_a,
        "UUID kept"
    );
    assert_eq!(
        env.endpoint("a", Duration::from_secs(60)).await,
        ep_a,
        "endpoint kept (DHCP lease by MAC)"
    );
    assert!(matches!(
        b.reimage("a", "nope", &same).await,
        Err(BackendError::Unchanged(_))
    ));

    // two forks
    let (v1, v2) = (env.vm("f1", "img1"), env.vm("f2", "img1"));
    b.create(&v1).await.unwrap();
    b.create(&v2).await.unwrap();
    assert_eq!(
        env.run("f1", "cat /home/agent/f; hostname").await,
        "one\nf1"
    );
    assert_eq!(env.run("f2", "hostname").await, "f2");
    let k1 = b.host_key("f1").await.unwrap();
    assert_ne!(k1, b.host_key("f2").await.unwrap(), "new host key per fork");
    assert_ne!(
        env.endpoint("f1", Duration::from_secs(5)).await,
        env.endpoint("f2", Duration::from_secs(5)).await
    );

    // independence: delete the image and its source; a fork still stops and starts
    b.remove_image("img1").await.unwrap();
    b.remove("a").await.unwrap();
    b.stop("f1").await.unwrap();
    assert_eq!(
        b.get("f1").await.unwrap().unwrap().state,
        PowerState::Stopped
    );
    b.start("f1").await.unwrap();
    assert_eq!(env.run("f1", "cat /home/agent/f").await, "one");

    // capture a stopped VM, and a VM from that
    b.stop("f2").await.unwrap();
    b.capture("f2", "img2", "uid-img2").await.unwrap();
    b.create(&env.vm("g", "img2")).await.unwrap();
    assert_eq!(env.run("g", "cat /home/agent/f").await, "one");

    // resize stopped and running
    b.resize(
        "f2",
        VmSize {
            cpus: 2,
            memory_mib: 320,
            disk_gib: 2,
        },
    )
    .await
    .unwrap();
    b.start("f2").await.unwrap();
    assert_eq!(env.run("f2", "nproc").await, "2");
    b.resize(
        "g",
        VmSize {
            cpus: 1,
            memory_mib: 256,
            disk_gib: 2,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        b.get("g").await.unwrap().unwrap().state,
        PowerState::Running,
        "running before, running after"
    );
    assert!(matches!(
        b.resize(
            "g",
            VmSize {
                cpus: 1,
                memory_mib: 256,
                disk_gib: 1
            }
        )
        .await,
        Err(BackendError::Invalid(_))
    ));

    for n in ["f1", "f2", "g"] {
        b.remove(n).await.unwrap();
    }
    b.remove_image("img2").await.unwrap();
    assert!(b.list().await.unwrap().is_empty());
    assert!(env.domains().is_empty(), "no domain left");
    assert!(
        env.pool_files("vm-").is_empty(),
        "no VM volume left: {:?}",
        env.pool_files("vm-")
    );
    assert_eq!(
        env.pool_files("img-"),
        vec!["img-tiny.qcow2".to_string()],
        "no image volume left but the stock image's"
    );
}

/// `init` run at the same moment by two processes of one home (a `serve` and a CLI `--wait`):
/// both succeed (they take turns; one finds the pool defined and started by the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_from_two_places_at_once() {
    need_libvirtd();
    let tmp = tempfile::Builder::new()
        .prefix("bxl")
        .tempdir_in("/tmp")
        .unwrap();
    let dir = tmp.path().join("libvirt");
    let inits: Vec<_> = (0..2)
        .map(|_| {
            let dir = dir.clone();
            tokio::spawn(async move {
                LibvirtBackend::with_config(dir, LibvirtConfig::from_env())
                    .init()
                    .await
            })
        })
        .collect();
    let mut results = Vec::new();
    for i in inits {
        results.push(i.await.unwrap());
    }
    let b = LibvirtBackend::with_config(dir, LibvirtConfig::from_env());
    let active =
        String::from_utf8_lossy(&virsh(&["pool-info", &b.pool_name()]).stdout).contains("running");
    virsh(&["pool-destroy", &b.pool_name()]);
    virsh(&["pool-undefine", &b.pool_name()]);
    let _ = std::fs::remove_dir_all(b.pool_dir());
    for r in results {
        r.expect("init succeeds while another runs");
    }
    assert!(active, "the pool was started");
}

/// The recovery hooks, each twice, on the states a killed create or capture leaves; a domain
/// that is not ours is never listed or touched; libvirtd unreachable mid-run is an error, not
/// an empty host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_foreign_domains_and_unreachable() {
    let env = Env::new().await;
    let b = &env.backend;

    // a domain with our prefix but no mark, and one outside the prefix: never ours
    let foreign = b.domain_name("intruder");
    let other = format!("notboxery-{}", b.namespace());
    for (n, f) in [(&foreign, "x1"), (&other, "x2")] {
        let x = format!(
            "<domain type='qemu'><name>{n}</name><memory unit='MiB'>64</memory><os><type arch='x86_64' machine='q35'>hvm</type></os><devices><disk type='file' device='disk'><source file='/nonexistent/{f}.qcow2'/><target dev='vda' bus='virtio'/></disk></devices></domain>"
        );
        let p = env.tmp.path().join(format!("{f}.xml"));
        std::fs::write(&p, x).unwrap();
        assert!(virsh(&["define", p.to_str().unwrap()]).status.success());
    }
    let cleanup_foreign = scopeguard(vec![foreign.clone(), other.clone()]);
    assert!(
        b.list().await.unwrap().is_empty(),
        "foreign domains are not listed"
    );
    assert!(b.get("intruder").await.unwrap().is_none());
    b.remove("intruder").await.unwrap();
    b.cleanup_new("intruder").await.unwrap();
    assert!(matches!(
        b.create(&env.vm("intruder", "tiny")).await,
        Err(BackendError::Invalid(_))
    ));
    assert!(
        virsh(&["dominfo", &foreign]).status.success(),
        "the foreign domain is untouched"
    );
    assert!(virsh(&["dominfo", &other]).status.success());

    // a create killed after its disk and seed, before the domain: cleanup_new twice
    std::fs::write(b.pool_dir().join("vm-half-1.qcow2"), b"partial").unwrap();
    std::fs::write(b.pool_dir().join("vm-half-seed.iso"), b"partial").unwrap();
    assert!(b.get("half").await.unwrap().is_none());
    b.cleanup_new("half").await.unwrap();
    b.cleanup_new("half").await.unwrap();
    assert!(env.pool_files("vm-half").is_empty());

    // a capture killed after the snapshot, before publishing: recover twice, VM intact
    b.create(&env.vm("c", "tiny")).await.unwrap();
    env.run("c", "echo keep > /home/agent/k && sync").await;
    let snap = b.pool_dir().join("vm-c-2.qcow2");
    let x = format!(
        "<domainsnapshot><disks><disk name='vda' snapshot='external'><source file='{}'/></disk><disk name='vdb' snapshot='no'/></disks></domainsnapshot>",
        snap.display()
    );
    let sp = env.tmp.path().join("snap.xml");
    std::fs::write(&sp, x).unwrap();
    let o = virsh(&[
        "snapshot-create",
        &b.domain_name("c"),
        sp.to_str().unwrap(),
        "--disk-only",
        "--no-metadata",
        "--atomic",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(b.pool_dir().join(".img-cap.part"), b"partial").unwrap();
    std::fs::write(b.pool_dir().join("vm-c-9.qcow2"), b"never switched to").unwrap();
    b.recover_capture("c", "cap", Some(PowerState::Running))
        .await
        .unwrap();
    b.recover_capture("c", "cap", Some(PowerState::Running))
        .await
        .unwrap();
    assert!(env.pool_files("img-cap").is_empty(), "no partial image");
    assert!(
        env.pool_files("vm-c-9").is_empty(),
        "the overlay libvirt never used is gone"
    );
    assert_eq!(
        b.get("c").await.unwrap().unwrap().state,
        PowerState::Running
    );
    assert_eq!(env.run("c", "cat /home/agent/k").await, "keep");
    // the VM is two deep now; a cold start flattens it, and a capture still works
    b.stop("c").await.unwrap();
    b.start("c").await.unwrap();
    assert_eq!(env.run("c", "cat /home/agent/k").await, "keep");
    b.capture("c", "cap", "uid-cap").await.unwrap();
    b.cleanup_image("cap").await.unwrap();
    b.cleanup_image("cap").await.unwrap();
    assert!(b.images().await.unwrap().iter().all(|i| i.name != "cap"));

    // a VM that died with its capture (was running): started again
    assert!(virsh(&["destroy", &b.domain_name("c")]).status.success());
    b.recover_capture("c", "cap2", Some(PowerState::Running))
        .await
        .unwrap();
    assert_eq!(
        b.get("c").await.unwrap().unwrap().state,
        PowerState::Running
    );

    // libvirtd unreachable (a URI whose socket is gone): errors, never an empty host, and
    // nothing deleted
    let mut cfg = LibvirtConfig::from_env();
    cfg.uri = format!(
        "qemu+unix:///system?socket={}/gone.sock",
        env.tmp.path().display()
    );
    let blind = LibvirtBackend::with_config(env.tmp.path().join("libvirt"), cfg);
    assert!(matches!(
        blind.list().await,
        Err(BackendError::Unreachable { .. })
    ));
    assert!(matches!(
        blind.get("c").await,
        Err(BackendError::Unreachable { .. })
    ));
    assert!(
        blind.remove("c").await.is_err(),
        "remove without libvirtd fails, deletes nothing"
    );
    assert_eq!(
        b.get("c").await.unwrap().unwrap().state,
        PowerState::Running,
        "c untouched"
    );
    assert!(!env.pool_files("vm-c-").is_empty());

    b.remove("c").await.unwrap();
    assert!(
        env.domains().iter().all(|d| d == &foreign),
        "only the foreign domain is left"
    );
    drop(cleanup_foreign);
}

/// The isolation filter, live: a guest cannot reach the host (beyond DHCP/DNS), another guest
/// or a private address; the host still reaches its sshd; a guest that changes its MAC, sends
/// from an address not its own, claims another guest's address in ARP, or speaks IPv6 gets
/// nothing through. Every probe runs the same way on two control VMs defined without the
/// filter (same namespace, `isolation: false`), which get through: the probe works, so
/// "dropped" from a filtered guest is the filter's doing.
/// Not verified here (see docs/backends.md, "The libvirt backend"): that 10/8 or 169.254/16 would answer
/// without the filter (nothing listens there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_filter_holds() {
    let env = Env::new().await;
    let b = &env.backend;
    let mut open_cfg = LibvirtConfig::from_env();
    open_cfg.isolation = false;
    open_cfg.powerdown_timeout = Duration::from_secs(20);
    let open = LibvirtBackend::with_config(env.tmp.path().join("libvirt"), open_cfg);
    assert_eq!(
        open.namespace(),
        b.namespace(),
        "the control VM is in the test's namespace"
    );
    let (v1, v2) = (env.vm("i1", "tiny"), env.vm("i2", "tiny"));
    b.create(&v1).await.unwrap();
    b.create(&v2).await.unwrap();
    open.create(&env.vm("o1", "tiny")).await.unwrap();
    open.create(&env.vm("o2", "tiny")).await.unwrap();
    let xml = |n: &str| {
        String::from_utf8_lossy(&virsh(&["dumpxml", &b.domain_name(n)]).stdout).to_string()
    };
    assert!(xml("i1").contains("filter='boxery-guest'"));
    assert!(xml("i2").contains("filter='boxery-guest'"));
    assert!(
        !xml("o1").contains("boxery-guest"),
        "the control has no filter"
    );
    let ip_of = |ep: String| ep.rsplit_once(':').unwrap().0.to_string();
    let ip1 = ip_of(env.endpoint("i1", Duration::from_secs(120)).await);
    let ip2 = ip_of(env.endpoint("i2", Duration::from_secs(120)).await);
    let gw = "192.168.122.1";
    assert_eq!(
        env.run("i1", "hostname").await,
        "i1",
        "the host reaches the guest's sshd through the filter"
    );
    assert_eq!(env.run("i2", "hostname").await, "i2");
    let probe = |ip: &str| {
        format!("if ping -c 2 -W 2 {ip} >/dev/null 2>&1; then echo open; else echo dropped; fi")
    };
    // the control: the same probe, unfiltered, is answered by the host
    assert_eq!(
        env.run("o1", &probe(gw)).await,
        "open",
        "control: an unfiltered guest's ping reaches the host (the probe works)"
    );
    assert_eq!(env.run("i1", &probe(gw)).await, "dropped", "guest → host");
    assert_eq!(
        env.run("i1", &probe(&ip2)).await,
        "dropped",
        "guest → another guest"
    );
    assert_eq!(
        env.run("o1", &probe(&ip1)).await,
        "dropped",
        "unfiltered guest → filtered guest (inbound side)"
    );
    assert_eq!(
        env.run("i1", &probe("10.0.0.1")).await,
        "dropped",
        "guest → a private address"
    );
    assert_eq!(
        env.run("i1", &probe("169.254.169.254")).await,
        "dropped",
        "guest → metadata address"
    );
    assert_eq!(
        env.run(
            "i1",
            "nslookup localhost 192.168.122.1 >/dev/null 2>&1 && echo dns || echo nodns"
        )
        .await,
        "dns",
        "DNS to the host works through the filter"
    );
    // IP spoofing: DNS to the host (allowed from the guest's own address) sent from a second
    // address on the NIC (the route to the host says `src SPOOF`), then undone.
    let from_spoofed = |spoof: &str| {
        format!(
            "sudo ip addr add {spoof}/32 dev eth0 2>/dev/null; sudo ip route replace {gw}/32 dev eth0 src {spoof}; \
             if timeout 8 nslookup localhost {gw} >/dev/null 2>&1; then r=dns; else r=nodns; fi; \
             sudo ip route del {gw}/32 dev eth0; sudo ip addr del {spoof}/32 dev eth0; echo $r"
        )
    };
    assert_eq!(
        env.run("o1", &from_spoofed(&free_address())).await,
        "dns",
        "control: DNS from a second address works without the filter"
    );
    assert_eq!(
        env.run("i1", &from_spoofed(&free_address())).await,
        "nodns",
        "IP spoofing: a packet from an address not the guest's own is dropped"
    );

    // MAC spoofing: the NIC takes another MAC, tells the host (ARP), asks it for DNS, and
    // goes back to its own MAC (and tells the host again, so ssh finds it).
    let with_mac = |vm_mac: &str, spoof: &str| {
        format!(
            "sudo ip link set eth0 address {spoof}; arping -c 1 -w 2 -I eth0 {gw} >/dev/null 2>&1; \
             if timeout 8 nslookup localhost {gw} >/dev/null 2>&1; then r=dns; else r=nodns; fi; \
             sudo ip link set eth0 address {vm_mac}; arping -c 2 -w 3 -I eth0 {gw} >/dev/null 2>&1; echo $r"
        )
    };
    let mac_of = async |vm: &str| env.run(vm, "cat /sys/class/net/eth0/address").await;
    let (mac_i1, mac_o1) = (mac_of("i1").await, mac_of("o1").await);
    assert_eq!(
        env.run("o1", &with_mac(&mac_o1, "52:54:00:6b:6b:01")).await,
        "dns",
        "control: a changed MAC gets through without the filter"
    );
    assert_eq!(
        env.run("i1", &with_mac(&mac_i1, "52:54:00:6b:6b:02")).await,
        "nodns",
        "MAC spoofing: frames from another MAC are dropped"
    );

    // ARP spoofing: an ARP request to the host that claims another address for this NIC
    // (sender IP = CLAIM). Without the filter the host learns CLAIM → this MAC.
    let bridge = String::from_utf8_lossy(&virsh(&["net-info", "default"]).stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Bridge:").map(|b| b.trim().to_string()))
        .expect("the default network has a bridge");
    let host_neigh = |ip: &str| {
        let o = std::process::Command::new("ip")
            .args(["neigh", "show", "to", ip, "dev", &bridge])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).to_lowercase()
    };
    let claim = |ip: &str| {
        format!(
            "sudo ip addr add {ip}/32 dev eth0 2>/dev/null; arping -c 2 -w 3 -I eth0 -s {ip} {gw} >/dev/null 2>&1; \
             sudo ip addr del {ip}/32 dev eth0; echo done"
        )
    };
    let claimed = free_address();
    env.run("o1", &claim(&claimed)).await;
    assert!(
        host_neigh(&claimed).contains(&mac_o1),
        "control: the host learns a claimed address without the filter: {}",
        host_neigh(&claimed)
    );
    env.run("i1", &claim(&ip2)).await;
    let free = free_address();
    env.run("i1", &claim(&free)).await;
    assert!(
        !host_neigh(&ip2).contains(&mac_i1) && !host_neigh(&free).contains(&mac_i1),
        "ARP spoofing: the host never maps another address to i1's MAC ({mac_i1}; i2 {ip2}): {} / {}\nthe filter in force:\n{}",
        host_neigh(&ip2),
        host_neigh(&free),
        filter_state(&b.domain_name("i1"))
    );
    assert_eq!(
        env.run("i2", "hostname").await,
        "i2",
        "i2 is still reached at its own address"
    );

    // IPv6: link-local pings between guests.
    let ll = async |vm: &str| {
        env.run(
            vm,
            "ip -6 addr show dev eth0 scope link | awk '/inet6/{sub(\"/.*\",\"\",$2); print $2; exit}'",
        )
        .await
    };
    let (ll_i1, ll_o2) = (ll("i1").await, ll("o2").await);
    assert!(
        ll_i1.starts_with("fe80:") && ll_o2.starts_with("fe80:"),
        "guests have IPv6 link-local addresses: {ll_i1:?} {ll_o2:?}"
    );
    let ping6 = |ip: &str| {
        format!(
            "if ping6 -c 2 -W 2 -I eth0 {ip} >/dev/null 2>&1; then echo open; else echo dropped; fi"
        )
    };
    assert_eq!(
        env.run("o1", &ping6(&ll_o2)).await,
        "open",
        "control: IPv6 between two unfiltered guests works"
    );
    assert_eq!(
        env.run("i1", &ping6(&ll_o2)).await,
        "dropped",
        "IPv6 out of a filtered guest is dropped"
    );
    assert_eq!(
        env.run("o2", &ping6(&ll_i1)).await,
        "dropped",
        "IPv6 into a filtered guest is dropped"
    );

    for n in ["i1", "i2", "o1", "o2"] {
        b.remove(n).await.unwrap();
    }
    assert!(env.domains().is_empty(), "no domain left");
}

/// A TCP listener of the test's own on the host, answering every connection with a small
/// HTTP response naming it; counts connections; closed when dropped (also on a failure).
struct Listener {
    addr: std::net::SocketAddr,
    hits: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    async fn bind(addr: std::net::SocketAddr, body: &'static str) -> Listener {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 2048];
                    let _ = s.read(&mut buf).await;
                    let r = format!(
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(r.as_bytes()).await;
                });
            }
        });
        Listener { addr, hits, task }
    }
    fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Puts this version's isolation filter back on the host when dropped (a test that installed
/// an older one and failed must not leave it to the tests after it).
struct RestoreFilters(String);

impl Drop for RestoreFilters {
    fn drop(&mut self) {
        let f = std::env::temp_dir().join(format!("boxery-filter-{}.xml", std::process::id()));
        let xml = boxery_backends::libvirt::xml::isolation_filter(Some(&self.0));
        if std::fs::write(&f, xml).is_ok() {
            let _ = virsh(&["nwfilter-define", f.to_str().unwrap_or_default()]);
            let _ = std::fs::remove_file(&f);
        }
    }
}

/// An address of the default network that no guest holds now (no DHCP lease, no neighbour
/// entry on the host), for the spoofing probes: a fixed one collided with another test's guest
/// in CI (dnsmasq spreads its leases over the whole range), and a control probe from it got
/// no answer. Picked from the top of the range at the moment of use, never the same twice in
/// one process.
fn free_address() -> String {
    use std::sync::atomic::{AtomicU8, Ordering};
    static NEXT: AtomicU8 = AtomicU8::new(250);
    let leases =
        String::from_utf8_lossy(&virsh(&["net-dhcp-leases", "default"]).stdout).to_string();
    let neigh = std::process::Command::new("ip")
        .args(["neigh", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    loop {
        let n = NEXT.fetch_sub(1, Ordering::SeqCst);
        assert!(n > 100, "no free address left in 192.168.122.101-250");
        let ip = format!("192.168.122.{n}");
        let used = |text: &str| {
            text.split(|c: char| c.is_whitespace() || c == '/')
                .any(|w| w == ip)
        };
        if !used(&leases) && !used(&neigh) {
            return ip;
        }
    }
}

/// The guest side of the credential proxy: `guest_proxy` names the network's gateway and this
/// home's port; from inside a filtered guest a listener there answers, while a listener on
/// another port of the gateway gets no connection. A domain running with the filter of an
/// older version (the isolation filter alone, no `PROXY_PORT`) keeps working while the filters
/// change, and gets the current filter live from `init`; one defined that way starts (the
/// start defines it afresh). One guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_reaches_the_proxy_port_only() {
    use boxery_backends::libvirt::{PROXY_PORTS, xml};
    use boxery_backends::{GuestProxy, ProxyListen};
    let env = Env::new().await;
    let b = &env.backend;
    let gp = b.guest_proxy("p1").expect("a guest proxy once init ran");
    let ProxyListen::Tcp(addr) = gp.listen else {
        panic!("a TCP listener: {gp:?}")
    };
    assert_eq!(
        gp,
        GuestProxy {
            url: format!("http://{addr}"),
            listen: ProxyListen::Tcp(addr),
            dns: None,
        }
    );
    let net = String::from_utf8_lossy(&virsh(&["net-dumpxml", "default"]).stdout).to_string();
    assert_eq!(
        Some(addr.ip().to_string()),
        xml::network_gateway(&net),
        "the gateway"
    );
    if std::env::var("BOXERY_LIBVIRT_PROXY_PORT").is_err() {
        assert!(PROXY_PORTS.contains(&addr.port()), "{addr}");
        let kept = std::fs::read_to_string(env.tmp.path().join("libvirt/proxy-port")).unwrap();
        assert_eq!(kept.trim(), addr.port().to_string(), "the port is kept");
    }
    // the same home again (another process): the same port
    let again =
        LibvirtBackend::with_config(env.tmp.path().join("libvirt"), LibvirtConfig::from_env());
    again.init().await.unwrap();
    assert_eq!(again.guest_proxy("p1"), Some(gp.clone()));

    let proxy = Listener::bind(addr, "proxy\n").await;
    let other = Listener::bind(std::net::SocketAddr::new(addr.ip(), 0), "other\n").await;
    // the listeners answer (from the host)
    for l in [&proxy, &other] {
        let mut s = std::net::TcpStream::connect(l.addr).unwrap();
        std::io::Write::write_all(&mut s, b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut r = String::new();
        std::io::Read::read_to_string(&mut s, &mut r).unwrap();
        assert!(r.starts_with("HTTP/1.0 200"), "{r}");
    }
    let before = other.hits();

    b.create(&env.vm("p1", "tiny")).await.unwrap();
    let dom = b.domain_name("p1");
    let dumpxml = |flags: &[&str]| {
        let mut a = vec!["dumpxml", dom.as_str()];
        a.extend_from_slice(flags);
        String::from_utf8_lossy(&virsh(&a).stdout).to_string()
    };
    let port_param = format!("<parameter name='PROXY_PORT' value='{}'/>", addr.port());
    let x = dumpxml(&[]);
    assert_eq!(
        xml::filter_of(xml::interfaces(&x)[0]),
        Some(xml::GUEST_FILTER),
        "{x}"
    );
    assert!(x.contains(&port_param), "{x}");

    let fetch = |port: u16, tries: u32| fetch(addr.ip(), port, tries);
    assert_eq!(
        env.run("p1", &fetch(addr.port(), 10)).await,
        "proxy",
        "the guest reaches the proxy port"
    );
    let got = env.run("p1", &fetch(other.addr.port(), 1)).await;
    assert_eq!(
        got,
        "dropped",
        "another port of the gateway is dropped; the filter in force:\n{}",
        filter_state(&dom)
    );
    assert_eq!(other.hits(), before, "the other listener saw no connection");

    // The host before this version: the isolation filter without its gateway rule, and a
    // domain started then, whose NIC references the isolation filter alone (no PROXY_PORT).
    let gw_rule =
        "<rule action='drop' direction='out' priority='190'><all dstipaddr='$GATEWAY'/></rule>";
    let filter_xml =
        || String::from_utf8_lossy(&virsh(&["nwfilter-dumpxml", xml::FILTER]).stdout).to_string();
    let uuid = filter_xml()
        .split("<uuid>")
        .nth(1)
        .and_then(|u| u.split("</uuid>").next())
        .expect("the filter has a uuid")
        .to_string();
    let old_filter = xml::isolation_filter(Some(&uuid)).replace(gw_rule, "");
    let f = env.tmp.path().join("old-filter.xml");
    std::fs::write(&f, &old_filter).unwrap();
    let o = virsh(&["nwfilter-define", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // whatever happens from here, the host gets the current filters back
    let _restore = RestoreFilters(uuid.clone());
    assert!(!filter_xml().contains("priority='190'"));
    let old_ref = format!(
        "<filterref filter='{}'><parameter name='GATEWAY' value='{gw}'/><parameter name='DHCPSERVER' value='{gw}'/><parameter name='CTRL_IP_LEARNING' value='any'/></filterref>",
        xml::FILTER,
        gw = addr.ip()
    );
    let old_nic = |x: &str| xml::with_filterref(xml::interfaces(x)[0], &old_ref).unwrap();
    let f = env.tmp.path().join("old-nic.xml");
    std::fs::write(&f, old_nic(&dumpxml(&[]))).unwrap();
    let o = virsh(&["update-device", &dom, f.to_str().unwrap(), "--live"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        xml::filter_of(xml::interfaces(&dumpxml(&[]))[0]),
        Some(xml::FILTER)
    );
    // (libvirt re-learns the guest's address after the change: its IPv4 is unfiltered until
    // the guest's next packet, a second or two; the old version's start had the same moment)
    assert_eq!(env.run("p1", "hostname").await, "p1");
    let t = Instant::now();
    while env.run("p1", &fetch(addr.port(), 1)).await != "dropped" {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the old filter: no proxy (still reached after 60 s)"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let proxy_hits = proxy.hits();

    // Another home's init (this version) changes the filters while that domain runs: libvirt
    // accepts (the isolation filter needs no variable the old domain lacks); the domain, not
    // that home's, keeps its filter and its network.
    let tmp2 = tempfile::Builder::new()
        .prefix("bxl")
        .tempdir_in("/tmp")
        .unwrap();
    let home2 = Cleanup(LibvirtBackend::with_config(
        tmp2.path().join("libvirt"),
        LibvirtConfig::from_env(),
    ));
    home2.0.init().await.expect("another home's init");
    assert!(filter_xml().contains("priority='190'"), "{}", filter_xml());
    assert_eq!(
        xml::filter_of(xml::interfaces(&dumpxml(&[]))[0]),
        Some(xml::FILTER),
        "another home leaves the domain alone"
    );
    drop(home2);
    assert_eq!(
        env.run("p1", "hostname").await,
        "p1",
        "the old domain keeps its network"
    );
    assert_eq!(env.run("p1", &fetch(addr.port(), 1)).await, "dropped");
    assert_eq!(proxy.hits(), proxy_hits, "the proxy saw nothing of it");

    // This home's init gives its running domain the current filter, live, with the guest's
    // address: in force at once (another port of the gateway dropped on the first try).
    b.init().await.unwrap();
    let x = dumpxml(&[]);
    assert_eq!(
        xml::filter_of(xml::interfaces(&x)[0]),
        Some(xml::GUEST_FILTER)
    );
    assert!(x.contains(&port_param), "{x}");
    let ep = env.endpoint("p1", Duration::from_secs(10)).await;
    let guest_ip = ep.rsplit_once(':').unwrap().0;
    assert!(
        x.contains(&format!("<parameter name='IP' value='{guest_ip}'/>")),
        "{x}"
    );
    assert_eq!(env.run("p1", &fetch(other.addr.port(), 1)).await, "dropped");
    assert_eq!(other.hits(), before, "the other listener saw no connection");
    assert_eq!(
        env.run("p1", &fetch(addr.port(), 10)).await,
        "proxy",
        "reached after init, without a restart"
    );

    // Stopped with a definition of the older version: the start defines it afresh.
    b.stop("p1").await.unwrap();
    let f = env.tmp.path().join("old-domain.xml");
    let inactive = dumpxml(&["--inactive"]);
    let nic = xml::interfaces(&inactive)[0].to_string();
    std::fs::write(&f, inactive.replace(&nic, &old_nic(&inactive))).unwrap();
    let o = virsh(&["define", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!dumpxml(&["--inactive"]).contains("PROXY_PORT"));
    b.start("p1").await.unwrap();
    assert!(dumpxml(&[]).contains(&port_param));
    assert_eq!(env.run("p1", &fetch(addr.port(), 10)).await, "proxy");
    assert_eq!(env.run("p1", &fetch(other.addr.port(), 1)).await, "dropped");
    assert_eq!(other.hits(), before, "the other listener saw no connection");

    b.remove("p1").await.unwrap();
    assert!(env.domains().is_empty(), "no domain left");
}

/// A guest's command for an HTTP request to `ip:port` (busybox `nc`; the tiny guest's busybox
/// `wget` crashes), tried up to `tries` times 2 s apart: prints the listener's answer (its last
/// line), or `dropped`.
fn fetch(ip: std::net::IpAddr, port: u16, tries: u32) -> String {
    format!(
        "i=0; while :; do r=$(printf 'GET / HTTP/1.0\\r\\n\\r\\n' | timeout 8 nc -w 5 {ip} {port} 2>/dev/null | tail -n 1); \
         if [ -n \"$r\" ]; then echo \"$r\"; break; fi; \
         i=$((i+1)); [ $i -ge {tries} ] && {{ echo dropped; break; }}; sleep 2; done"
    )
}

/// Egress `Allowlist`/`Deny` on libvirt, live: `set_egress` moves a running guest's NIC to the
/// confined filter, without a restart. Under it the guest's DNS to the host goes unanswered
/// (answered under `Public` just before: the probe works) while the proxy port (the host's own
/// listener here) still answers and another port of the host does not; ssh from the host keeps
/// working. The NIC keeps its parameters (the guest's pinned address among them), the change
/// is in the definition too (a stop and start keep it confined), a second call changes
/// nothing, and moved back to `Public` the guest has DNS again. One guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_egress_confines_a_running_guest_and_lets_it_go() {
    use boxery_api::network::EgressPolicy;
    use boxery_backends::ProxyListen;
    use boxery_backends::libvirt::xml;
    let env = Env::new().await;
    let b = &env.backend;
    let ProxyListen::Tcp(addr) = b
        .guest_proxy("e1")
        .expect("a guest proxy after init")
        .listen
    else {
        panic!("a TCP proxy listener")
    };
    let proxy = Listener::bind(addr, "proxy\n").await;
    let other = Listener::bind(std::net::SocketAddr::new(addr.ip(), 0), "other\n").await;
    b.create(&env.vm("e1", "tiny")).await.unwrap();
    let dom = b.domain_name("e1");
    let dumpxml = |flags: &[&str]| {
        let mut a = vec!["dumpxml", dom.as_str()];
        a.extend_from_slice(flags);
        String::from_utf8_lossy(&virsh(&a).stdout).to_string()
    };
    let filter = |flags: &[&str]| {
        let x = dumpxml(flags);
        xml::filter_of(xml::interfaces(&x)[0]).map(str::to_string)
    };
    let (live, defined) = (&[][..], &["--inactive"][..]);
    assert_eq!(filter(live).as_deref(), Some(xml::GUEST_FILTER));
    // a VM created confined is defined so, before its first boot
    b.create(&NewVm {
        egress: EgressPolicy::Deny,
        memory: false,
        start: false,
        ..env.vm("e2", "tiny")
    })
    .await
    .unwrap();
    let x = String::from_utf8_lossy(&virsh(&["dumpxml", &b.domain_name("e2")]).stdout).to_string();
    assert_eq!(
        xml::filter_of(xml::interfaces(&x)[0]),
        Some(xml::CONFINED_FILTER),
        "{x}"
    );
    b.remove("e2").await.unwrap();
    let gw = addr.ip();
    let dns = format!(
        "if timeout 8 nslookup localhost {gw} >/dev/null 2>&1; then echo dns; else echo nodns; fi"
    );
    // Public: the control
    assert_eq!(
        env.run("e1", &dns).await,
        "dns",
        "control: DNS to the host under Public"
    );
    assert_eq!(env.run("e1", &fetch(gw, addr.port(), 10)).await, "proxy");
    let ep = env.endpoint("e1", Duration::from_secs(10)).await;
    let ip_param = format!(
        "<parameter name='IP' value='{}'/>",
        ep.rsplit_once(':').unwrap().0
    );
    assert!(dumpxml(live).contains(&ip_param), "the address is pinned");

    // Deny, live
    let other_before = other.hits();
    b.set_egress("e1", EgressPolicy::Deny).await.unwrap();
    assert_eq!(filter(live).as_deref(), Some(xml::CONFINED_FILTER), "live");
    assert_eq!(
        filter(defined).as_deref(),
        Some(xml::CONFINED_FILTER),
        "in the definition"
    );
    let x = dumpxml(live);
    for kept in [
        ip_param.clone(),
        format!("<parameter name='PROXY_PORT' value='{}'/>", addr.port()),
        format!("<parameter name='GATEWAY' value='{gw}'/>"),
    ] {
        assert!(x.contains(&kept), "{kept} kept: {x}");
    }
    let before = dumpxml(live);
    b.set_egress("e1", EgressPolicy::Allowlist).await.unwrap();
    assert_eq!(
        dumpxml(live),
        before,
        "Allowlist is confined too: nothing to change"
    );
    assert_eq!(
        env.run("e1", &dns).await,
        "nodns",
        "confined: no DNS to the host; the filter in force:\n{}",
        filter_state(&dom)
    );
    assert_eq!(
        env.run("e1", &fetch(gw, addr.port(), 10)).await,
        "proxy",
        "confined: the proxy port answers"
    );
    assert_eq!(
        env.run("e1", &fetch(gw, other.addr.port(), 1)).await,
        "dropped",
        "confined: another port of the host is dropped"
    );
    assert_eq!(
        other.hits(),
        other_before,
        "the other listener saw no connection"
    );

    // a stop and a start (the domain defined afresh) keep it confined
    b.stop("e1").await.unwrap();
    b.start("e1").await.unwrap();
    assert_eq!(
        filter(live).as_deref(),
        Some(xml::CONFINED_FILTER),
        "after a restart"
    );
    assert_eq!(env.run("e1", &dns).await, "nodns", "after a restart");
    assert_eq!(env.run("e1", &fetch(gw, addr.port(), 10)).await, "proxy");

    // Public again, live
    b.set_egress("e1", EgressPolicy::Public).await.unwrap();
    assert_eq!(filter(live).as_deref(), Some(xml::GUEST_FILTER));
    assert_eq!(filter(defined).as_deref(), Some(xml::GUEST_FILTER));
    assert_eq!(env.run("e1", &dns).await, "dns", "Public: DNS again");
    assert_eq!(env.run("e1", &fetch(gw, addr.port(), 10)).await, "proxy");
    assert!(
        proxy.hits() >= 4,
        "the proxy listener saw the guest's requests"
    );

    b.remove("e1").await.unwrap();
    assert!(env.domains().is_empty(), "no domain left");
}

/// The PIDs of the QEMU processes running domain `dom` (its `-name guest=DOM,…`).
fn qemu_of(dom: &str) -> Vec<u32> {
    let want = format!("guest={dom},");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a.starts_with(want.as_bytes())))
        })
        .collect()
}

/// Suspend (libvirt's managed save) and resume: a counter the guest runs survives with its
/// boot (same `boot_id`); while suspended the VM is `Suspended` with its saved memory, no QEMU
/// runs for it, a resize is refused and an egress change waits for the resume; an image
/// libvirt cannot restore (truncated) is refused and kept; `stop` discards the memory (the
/// next start boots cold) and `remove` takes it along. Prints the times measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_keeps_processes_and_frees_qemu() {
    use boxery_api::network::EgressPolicy;
    use boxery_backends::libvirt::xml;
    let env = Env::new().await;
    let b = &env.backend;
    b.create(&env.vm("m", "tiny")).await.unwrap();
    let dom = b.domain_name("m");
    let image = PathBuf::from(format!("/var/lib/libvirt/qemu/save/{dom}.save"));
    let boot_id = env.run("m", "cat /proc/sys/kernel/random/boot_id").await;
    let pid = env
        .run(
            "m",
            "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > $HOME/count; sleep 0.1; done' \
             </dev/null >/dev/null 2>&1 & echo $!; sleep 1",
        )
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let count = || env.run("m", "cat $HOME/count");
    let before: u64 = count().await.parse().unwrap();
    assert!(before > 0);
    assert!(b.capabilities().suspend);

    let t = Instant::now();
    b.suspend("m").await.unwrap();
    let suspend = t.elapsed();
    eprintln!("suspend: {suspend:?}");
    let info = b.get("m").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Suspended);
    assert_eq!(info.ssh, None);
    let mem = info
        .memory
        .expect("a suspended VM reports its saved memory");
    assert!(mem.bytes > 1 << 20, "the image holds the guest's memory");
    assert_eq!(mem.stale, None);
    assert!(image.exists(), "libvirt's managed save image");
    eprintln!("saved memory: {} MiB on disk", mem.bytes >> 20);
    assert_eq!(
        b.list().await.unwrap()[0].state,
        PowerState::Suspended,
        "list says so too"
    );
    assert!(qemu_of(&dom).is_empty(), "no QEMU runs while suspended");
    // suspending again is a no-op; a resize waits for the resume
    b.suspend("m").await.unwrap();
    let err = b
        .resize(
            "m",
            VmSize {
                cpus: 1,
                memory_mib: 320,
                disk_gib: 1,
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BackendError::Invalid(m) if m.contains("resume it first")),
        "{err}"
    );

    // an image libvirt cannot restore: refused, kept, nothing runs
    let whole = std::fs::read(&image).unwrap();
    std::fs::write(&image, &whole[..whole.len() / 2]).unwrap();
    let err = b.start("m").await.unwrap_err();
    eprintln!("truncated image: {}", err.chain());
    assert!(
        matches!(&err, BackendError::Invalid(m) if m.contains("boxery stop m")),
        "{err}"
    );
    assert!(qemu_of(&dom).is_empty(), "no half-made QEMU is left");
    assert_eq!(
        b.get("m").await.unwrap().unwrap().state,
        PowerState::Suspended
    );
    assert!(image.exists(), "the image is kept");
    std::fs::write(&image, &whole).unwrap();

    let t = Instant::now();
    b.start("m").await.unwrap();
    let resume = t.elapsed();
    eprintln!("resume (QEMU running the guest): {resume:?}");
    let info = b.get("m").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Running);
    assert_eq!(info.memory, None);
    assert!(!image.exists(), "the image is gone once the guest runs on");
    assert_eq!(
        env.run("m", "cat /proc/sys/kernel/random/boot_id").await,
        boot_id,
        "the same boot, not a new one"
    );
    eprintln!("resume to ssh: {:?}", t.elapsed());
    assert_eq!(
        env.run("m", &format!("kill -0 {pid} && echo alive")).await,
        "alive",
        "the counter started before the suspend still runs"
    );
    let after: u64 = count().await.parse().unwrap();
    assert!(
        after >= before,
        "the counter went on from {before}: {after}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        count().await.parse::<u64>().unwrap() > after,
        "and keeps counting"
    );
    let t = Instant::now();
    env.run("m", "true").await;
    eprintln!("(one ssh command on the running guest: {:?})", t.elapsed());

    // an egress policy set while suspended is in the definition only until the resume
    if std::env::var("BOXERY_NET_ISOLATION").as_deref() != Ok("off") {
        b.suspend("m").await.unwrap();
        b.set_egress("m", EgressPolicy::Deny).await.unwrap();
        b.start("m").await.unwrap();
        let live = String::from_utf8_lossy(&virsh(&["dumpxml", &dom]).stdout).to_string();
        assert_eq!(
            xml::filter_of(xml::interfaces(&live)[0]),
            Some(xml::CONFINED_FILTER),
            "the resumed NIC follows the policy set while suspended"
        );
        b.set_egress("m", EgressPolicy::Public).await.unwrap();
        assert_eq!(
            env.run("m", &format!("kill -0 {pid} && echo alive")).await,
            "alive"
        );
    }

    // stop discards the memory; a stopped VM has none to suspend; the start is cold
    b.suspend("m").await.unwrap();
    b.stop("m").await.unwrap();
    let info = b.get("m").await.unwrap().unwrap();
    assert_eq!(info.state, PowerState::Stopped);
    assert_eq!(info.memory, None);
    assert!(!image.exists());
    let err = b.suspend("m").await.unwrap_err();
    assert!(matches!(err, BackendError::Invalid(_)), "{err}");
    let t = Instant::now();
    b.start("m").await.unwrap();
    let cold = t.elapsed();
    assert_ne!(
        env.run("m", "cat /proc/sys/kernel/random/boot_id").await,
        boot_id,
        "a cold boot"
    );
    eprintln!(
        "cold start (QEMU running the guest): {cold:?}; to ssh: {:?}",
        t.elapsed()
    );

    // remove takes a suspended VM's memory along
    b.suspend("m").await.unwrap();
    assert!(image.exists());
    b.remove("m").await.unwrap();
    assert!(!image.exists(), "the image went with the domain");
    assert!(env.domains().is_empty(), "no domain left");
    assert!(qemu_of(&dom).is_empty());
    eprintln!(
        "measured: suspend {:.2} s, resume {:.2} s (a cold start {:.2} s)",
        suspend.as_secs_f64(),
        resume.as_secs_f64(),
        cold.as_secs_f64()
    );
}

/// Every domain and the pool of a home made in a test, removed when dropped.
struct Cleanup(LibvirtBackend);
impl Drop for Cleanup {
    fn drop(&mut self) {
        libvirt_support::clean(&self.0);
    }
}

struct Guard(Vec<String>);
impl Drop for Guard {
    fn drop(&mut self) {
        for d in &self.0 {
            virsh(&["destroy", d]);
            virsh(&["undefine", d]);
        }
    }
}
fn scopeguard(d: Vec<String>) -> Guard {
    Guard(d)
}

/// An RFB client's handshake on `s` (version 3.8, no authentication, a shared session): the
/// screen's size the server announces.
async fn rfb_size(mut s: tokio::net::UnixStream) -> (u32, u32) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut version = [0u8; 12];
        s.read_exact(&mut version).await?;
        assert_eq!(&version, b"RFB 003.008\n");
        s.write_all(&version).await?;
        let n = s.read_u8().await?;
        let mut types = vec![0u8; usize::from(n)];
        s.read_exact(&mut types).await?;
        assert!(types.contains(&1), "no authentication offered: {types:?}");
        s.write_all(&[1]).await?;
        assert_eq!(s.read_u32().await?, 0, "the security result");
        s.write_all(&[1]).await?;
        let (w, h) = (s.read_u16().await?, s.read_u16().await?);
        std::io::Result::Ok((u32::from(w), u32::from(h)))
    };
    tokio::time::timeout(Duration::from_secs(30), io)
        .await
        .expect("the VNC server answers within 30 s")
        .unwrap()
}

/// The host path (a VM's screen) on libvirt: the domain has a VGA, a virtio tablet and a VNC
/// display without a listener; a running VM's screendump (`virDomainScreenshot`) is a PNG of the
/// size it reports, showing the console's text; keys typed (QMP through libvirt's monitor
/// passthrough) reach the guest's console, none lost in a long batch, and change the screen;
/// pointer events inside the screen are taken (a backend that has not seen it takes a
/// screendump first), one outside it and an unknown key are `Invalid`; its console over VNC
/// (`virDomainOpenGraphics`) greets a viewer with the screen's size; a stopped VM has no
/// screen nor console (`Invalid`).
///
/// The tiny guest runs no getty: the test puts a reader on tty1 over ssh
/// ([`screen_support::CONSOLE_READER`]), whose line discipline echoes what is typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn screen_shows_the_console_and_takes_keys_and_a_pointer() {
    use boxery_backends::{InputEvent, PointerButton};
    use screen_support::{CONSOLE_READER, colours, differing, keys};
    let env = Env::new().await;
    let b = &env.backend;
    b.create(&env.vm("s1", "tiny")).await.unwrap();
    let dom = b.domain_name("s1");
    let xml = String::from_utf8_lossy(&virsh(&["dumpxml", &dom]).stdout).to_string();
    assert!(
        boxery_backends::libvirt::xml::has_screen(&xml),
        "a VGA and a virtio tablet: {xml}"
    );
    assert!(
        boxery_backends::libvirt::xml::has_console(&xml)
            && !xml.contains("port=\"5")
            && !xml.contains("socket="),
        "a VNC display without a listener: {xml}"
    );
    assert_eq!(env.run("s1", CONSOLE_READER).await, "reading");

    let before = b.screendump("s1").await.unwrap();
    eprintln!(
        "screen: {}x{}, {} bytes of PNG, {} colours",
        before.width,
        before.height,
        before.png.len(),
        colours(&before)
    );
    assert!(colours(&before) > 1, "the console shows text");
    b.send_input("s1", &keys("abc\n")).await.unwrap();
    let typed = |want: String| {
        let env = &env;
        async move {
            let t = Instant::now();
            loop {
                let got = env.run("s1", "cat /tmp/typed").await;
                if got == want || t.elapsed() > Duration::from_secs(30) {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    assert_eq!(
        typed("abc".into()).await,
        "abc",
        "the keys reached the console"
    );
    let after = b.screendump("s1").await.unwrap();
    let changed = differing(&before, &after);
    eprintln!("typing `abc⏎` changed {changed} pixels");
    assert!(
        changed > 30,
        "the echo shows on the screen: {changed} pixels"
    );

    let long = "x".repeat(150);
    b.send_input("s1", &keys(&format!("{long}\n")))
        .await
        .unwrap();
    let want = format!("abc\n{long}");
    assert_eq!(
        typed(want.clone()).await,
        want,
        "every key of a long batch arrived"
    );

    let (w, h) = (after.width, after.height);
    // the console over VNC, from libvirt's socket pair: a viewer's handshake, and the
    // server's screen is the screendump's size
    let (vw, vh) = rfb_size(b.console_vnc("s1").await.unwrap()).await;
    eprintln!("console over VNC: {vw}x{vh}");
    assert_eq!((vw, vh), (w, h));
    let fresh = LibvirtBackend::with_config(env.tmp.path().join("libvirt"), b.config().clone());
    let button = |button, down| InputEvent::Button { button, down };
    let pointer = [
        InputEvent::Move { x: 0, y: 0 },
        InputEvent::Move { x: w - 1, y: h - 1 },
        button(PointerButton::Left, true),
        button(PointerButton::Left, false),
        button(PointerButton::WheelUp, true),
        button(PointerButton::WheelUp, false),
        button(PointerButton::WheelDown, true),
        button(PointerButton::WheelDown, false),
    ];
    fresh.send_input("s1", &pointer).await.unwrap();
    b.send_input("s1", &pointer).await.unwrap();
    for backend in [b, &fresh] {
        let e = backend
            .send_input("s1", &[InputEvent::Move { x: 0, y: h }])
            .await
            .unwrap_err();
        assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    }
    let e = b
        .send_input(
            "s1",
            &[InputEvent::Key {
                qcode: "nosuchkey".into(),
                down: true,
            }],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("nosuchkey")),
        "{e}"
    );

    b.stop("s1").await.unwrap();
    let e = b.screendump("s1").await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("stopped")),
        "{e}"
    );
    let e = b.send_input("s1", &keys("a")).await.unwrap_err();
    assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    let e = b.console_vnc("s1").await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Invalid(m) if m.contains("stopped")),
        "{e}"
    );
    let e = b.screendump("nope").await.unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
    b.remove("s1").await.unwrap();
    assert!(env.domains().is_empty());
}
