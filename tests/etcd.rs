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
        ("store:\n  etcd:\n    endpoints: [https://h:2379]\n", "TLS"),
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
