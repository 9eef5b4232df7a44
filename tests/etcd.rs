//! boxery with its store on etcd (`config.yaml`: `store: {etcd: …}`), against a real
//! three-member cluster on loopback ports that the test starts and stops
//! (store-etcd/tests/cluster): the CLI applies, the controllers reconcile (in the command, on
//! the fake backend), another home with the same config sees the same objects, a lost member
//! is not seen by users, and a cluster that is down is a clear error.

#[path = "../store-etcd/tests/cluster/mod.rs"]
mod cluster;
mod common;

use std::time::Duration;

use common::Home;

const VM: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: NAME}\nspec: {source: {image: tiny}}\n";

fn on_etcd(cluster: &cluster::Cluster, prefix: &str) -> Home {
    let home = Home::new();
    let endpoints: Vec<String> = cluster.hosts().split(',').map(String::from).collect();
    home.write(
        "config.yaml",
        &format!(
            "store:\n  etcd:\n    endpoints: [{}]\n    prefix: {prefix}\n",
            endpoints.join(", ")
        ),
    );
    home
}

fn apply(home: &Home, name: &str) {
    let f = home.write(&format!("{name}.yaml"), &VM.replace("NAME", name));
    home.ok(&[
        "apply",
        "-f",
        f.to_str().unwrap(),
        "--wait",
        "--timeout",
        "90s",
    ]);
}

#[test]
fn a_home_on_etcd_reconciles_shares_its_objects_and_outlives_a_member() {
    let mut cluster = cluster::Cluster::start(3);
    let home = on_etcd(&cluster, "/boxery-e2e");
    apply(&home, "dev1");
    let vms = home.ok(&["get", "vms"]);
    assert!(
        vms.contains("dev1") && vms.contains("Running"),
        "the Vm reconciled over etcd: {vms}"
    );
    assert!(
        !home.path().join("store.db").exists(),
        "nothing went to the home's own SQLite file"
    );

    // another host's boxery, configured the same, sees the same store
    let other = on_etcd(&cluster, "/boxery-e2e");
    assert!(other.ok(&["get", "vms"]).contains("dev1"));
    // and one under another prefix sees another store
    let apart = on_etcd(&cluster, "/boxery-other");
    let none = apart.run(&["get", "vms"]);
    assert!(none.status.success());
    assert!(!String::from_utf8_lossy(&none.stdout).contains("dev1"));

    // one member lost: no error seen
    cluster.kill(2);
    assert!(home.ok(&["get", "vm", "dev1"]).contains("dev1"));
    apply(&home, "dev2");
    cluster.restart(2);
    cluster.wait_healthy(Duration::from_secs(60));
    home.ok(&["delete", "vm", "dev1", "--wait", "--timeout", "90s"]);
    let vms = other.ok(&["get", "vms"]);
    assert!(!vms.contains("dev1") && vms.contains("dev2"), "{vms}");

    // every member down: a clear error, and nothing lost when they come back
    for i in 0..3 {
        cluster.kill(i);
    }
    let o = home.run(&["get", "vms"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("etcd"), "says it is etcd: {err}");
    for i in 0..3 {
        cluster.restart(i);
    }
    cluster.wait_healthy(Duration::from_secs(60));
    let vms = home.ok(&["get", "vms"]);
    assert!(vms.contains("dev2") && !vms.contains("dev1"), "{vms}");
}

#[test]
fn a_bad_store_setting_is_refused_with_what_to_write() {
    let home = Home::new();
    for (config, says) in [
        ("store:\n  etcd:\n    endpoints: []\n", "endpoints is empty"),
        (
            "store:\n  etcd:\n    endpoints: [https://h:2379]\n",
            "store.etcd.tls.ca",
        ),
        ("store:\n  etcd:\n    endpoints: [justahost]\n", "HOST:PORT"),
        (
            "store:\n  etcd:\n    endpoints: [h:1]\n    prefix: /\n",
            "prefix",
        ),
        ("store:\n  sqlite: {}\n", "sqlite"),
    ] {
        home.write("config.yaml", config);
        let o = home.run(&["get", "vms"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{config}");
        assert!(err.contains(says), "{config}: {err}");
    }
}

const POOL: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 20\n  template:\n    spec:\n      source: {image: debian-12}\n";

/// Each lease's phase and VM, read through the CLI (the home's store is on etcd).
fn leases(home: &Home) -> Vec<(String, String, Option<String>)> {
    let all: serde_json::Value =
        serde_json::from_str(&home.ok(&["get", "leases", "-o", "json"])).unwrap();
    all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["metadata"]["name"].as_str().unwrap().to_string(),
                l["status"]["phase"].as_str().unwrap_or("").to_string(),
                l["status"]["vm"].as_str().map(String::from),
            )
        })
        .collect()
}

/// The leases Bound, each with its own VM (panics on a VM in two), and how many wait (one not
/// reconciled yet, without a phase, waits too; a released lease finishing is neither).
fn bound_and_waiting(home: &Home) -> (std::collections::BTreeMap<String, String>, usize) {
    let mut bound = std::collections::BTreeMap::new();
    let mut waiting = 0;
    for (name, phase, vm) in leases(home) {
        match phase.as_str() {
            "Bound" => {
                let vm = vm.unwrap_or_else(|| panic!("lease {name} is Bound without a VM"));
                if let Some(other) = bound.insert(vm.clone(), name.clone()) {
                    let show = |kind: &str, n: &str| {
                        String::from_utf8_lossy(&home.run(&["get", kind, n, "-o", "yaml"]).stdout)
                            .into_owned()
                    };
                    panic!(
                        "{vm} is held by two leases: {other} and {name}\n{}\n{}\n{}",
                        show("lease", &other),
                        show("lease", &name),
                        show("poolmember", &vm)
                    );
                }
            }
            "Pending" | "" => waiting += 1,
            "Released" => {}
            other => panic!("lease {name} is {other}"),
        }
    }
    (bound, waiting)
}

/// Claims through a `serve` whose store is on etcd while etcd loses its leader (issue 35):
/// 500 `boxery lease acquire`s on a pool of 20, 20 at a time; etcd's leader is killed after
/// the first 140 and started again after 340. No acquire fails, exactly 20 leases are Bound,
/// each on a member of its own, the other 480 wait; releasing 10 binds 10 more.
#[test]
fn claims_go_on_while_etcd_loses_its_leader() {
    let mut cluster = cluster::Cluster::start(3);
    let home = on_etcd(&cluster, "/boxery-claims");
    let serve = home.serve(&[]);
    serve.wait_leading();
    let f = home.write("p.yaml", POOL);
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    home.ok(&[
        "wait",
        "pool",
        "p",
        "--for=condition=Ready",
        "--timeout=120s",
    ]);
    let t = std::time::Instant::now();
    let mut killed = None;
    for batch in 0..25 {
        if batch == 7 {
            let l = cluster.leader().expect("etcd has a leader");
            cluster.kill(l);
            killed = Some(l);
        }
        if batch == 17 {
            cluster.restart(killed.expect("a member was killed"));
        }
        let children: Vec<_> = (0..20)
            .map(|j| {
                let i = batch * 20 + j;
                home.cmd()
                    .args(["lease", "acquire", "p", "--holder", &format!("h{i}")])
                    .args(["--name", &format!("l{i}")])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let o = c.wait_with_output().unwrap();
            assert!(
                o.status.success(),
                "an acquire failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    eprintln!(
        "500 acquires written in {:.1} s, etcd's leader (member {killed:?}) killed for 200 of them",
        t.elapsed().as_secs_f64()
    );
    cluster.wait_healthy(Duration::from_secs(60));
    common::eventually(Duration::from_secs(60), || {
        (bound_and_waiting(&home).0.len() == 20).then_some(())
    })
    .expect("20 leases bound");
    std::thread::sleep(Duration::from_secs(2));
    let (bound, waiting) = bound_and_waiting(&home);
    assert_eq!((bound.len(), waiting), (20, 480));
    for name in bound.values().take(10) {
        home.ok(&["lease", "release", name]);
    }
    common::eventually(Duration::from_secs(90), || {
        let (b, w) = bound_and_waiting(&home);
        (b.len() == 20 && w == 470).then_some(())
    })
    .expect("ten more bound after ten releases");
}

/// A cluster whose clients must speak TLS and show a certificate (`--client-cert-auth`):
/// reached with `store.etcd.tls`; refused, with what to set, without it or with a CA that did
/// not sign the members' certificates.
#[test]
fn a_home_reaches_etcd_over_tls_and_a_stranger_is_refused() {
    let cluster = cluster::Cluster::start_tls(3);
    let tls = cluster.tls().expect("TLS files");
    let endpoints = cluster.hosts().replace(',', ", ");
    let config = |ca: &std::path::Path, client: bool| {
        let mut c = format!(
            "store:\n  etcd:\n    endpoints: [{endpoints}]\n    prefix: /boxery-tls\n    tls:\n      ca: {}\n",
            ca.display()
        );
        if client {
            c.push_str(&format!(
                "      cert: {}\n      key: {}\n",
                tls.cert.display(),
                tls.key.display()
            ));
        }
        c
    };
    let home = Home::new();
    home.write("config.yaml", &config(&tls.ca, true));
    apply(&home, "dev1");
    assert!(home.ok(&["get", "vms"]).contains("dev1"));

    let refused = |config: String, says: &[&str]| {
        let other = Home::new();
        other.write("config.yaml", &config);
        let o = other.run(&["get", "vms"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{config}: {err}");
        eprintln!("refused: {err}");
        for s in says {
            assert!(err.contains(s), "{config}: {s:?} not in {err}");
        }
    };
    // no TLS at all: the members answer nothing a plain client understands
    refused(
        format!("store:\n  etcd:\n    endpoints: [{endpoints}]\n    prefix: /boxery-tls\n"),
        &["cannot reach the store on etcd", "set store.etcd.tls"],
    );
    // the CA is right but no client certificate is shown
    refused(
        config(&tls.ca, false),
        &[
            "cannot reach the store on etcd",
            "store.etcd.tls.cert and key",
        ],
    );
    // another CA, which did not sign the members' certificates: a certificate error
    let stranger = tempfile::tempdir().unwrap();
    let other = cluster::make_tls(stranger.path());
    refused(
        config(&other.ca, true),
        &[
            "cannot reach the store on etcd",
            // (rustls names the issuer's name matching but not its key `BadSignature`)
            "invalid peer certificate",
            "--cacert",
        ],
    );
    // https endpoints without a CA, and half a client identity, say what to write
    refused(
        "store:\n  etcd:\n    endpoints: [https://127.0.0.1:1]\n".into(),
        &["store.etcd.tls.ca"],
    );
    refused(
        format!(
            "store:\n  etcd:\n    endpoints: [{endpoints}]\n    tls:\n      ca: {}\n      cert: {}\n",
            tls.ca.display(),
            tls.cert.display()
        ),
        &["cert and key go together"],
    );
    refused(
        "store:\n  etcd:\n    endpoints: [127.0.0.1:1]\n    tls:\n      ca: /nonexistent/ca.pem\n"
            .into(),
        &["store.etcd.tls.ca", "/nonexistent/ca.pem"],
    );
}
