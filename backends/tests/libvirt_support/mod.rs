//! Shared by the libvirt tests and the contract suite: a libvirtd (started by
//! `scripts/libvirtd.sh start` when it does not answer; the tests FAIL, never skip, when
//! libvirt is missing), `virsh`, and the clean-up every test runs even when it fails.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

use boxery_backends::libvirt::LibvirtBackend;

/// The daemon the tests use.
pub const URI: &str = "qemu:///system";

/// The repository.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `virsh -q -c URI ARGS…`.
pub fn virsh(args: &[&str]) -> Output {
    std::process::Command::new("virsh")
        .arg("-q")
        .arg("-c")
        .arg(URI)
        .args(args)
        .output()
        .expect("virsh is installed (scripts/install-libvirt.sh)")
}

/// Start libvirtd (by scripts/libvirtd.sh) unless it answers; fail with the reason otherwise.
pub fn need_libvirtd() {
    let have = std::process::Command::new("sh")
        .arg("-c")
        .arg("command -v libvirtd virsh")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have,
        "libvirtd/virsh are not installed: run scripts/install-libvirt.sh (these tests need a real libvirtd)"
    );
    let out = std::process::Command::new("bash")
        .arg(repo().join("scripts/libvirtd.sh"))
        .arg("start")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/libvirtd.sh start failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every domain of `backend`'s namespace (defined or running).
pub fn domains(backend: &LibvirtBackend) -> Vec<String> {
    let prefix = backend.domain_name("");
    String::from_utf8_lossy(&virsh(&["list", "--all", "--name"]).stdout)
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with(&prefix))
        .map(String::from)
        .collect()
}

/// Remove every domain of `backend`'s namespace and its pool (for a `Drop`: also when the
/// test failed).
pub fn clean(backend: &LibvirtBackend) {
    for d in domains(backend) {
        virsh(&["destroy", &d]);
        virsh(&["undefine", "--managed-save", &d]);
    }
    let pool = backend.pool_name();
    virsh(&["pool-destroy", &pool]);
    virsh(&["pool-undefine", &pool]);
    let _ = std::fs::remove_dir_all(backend.pool_dir());
}

/// What the host's firewall holds for a domain's NICs (its `vnetN` chains in ebtables and
/// iptables, as libvirt's nwfilter instantiated them) and the tail of libvirtd's log: for the
/// message of an isolation assertion that failed, so a failure in CI says which rules were in
/// force (the whole filter, or only the layer-2 rules of an address not learned yet).
pub fn filter_state(domain: &str) -> String {
    let nics = String::from_utf8_lossy(&virsh(&["domiflist", domain]).stdout).to_string();
    let vnets: Vec<String> = nics
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("vnet"))
        .map(str::to_string)
        .collect();
    let run = |cmd: &str| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_else(|e| format!("({cmd}: {e})"))
    };
    let mut out = format!("NICs of {domain}: {vnets:?}\n");
    for v in &vnets {
        out += &run(&format!(
            "ebtables -t nat -L 2>/dev/null | grep -A3 -- '{v}'; iptables-save 2>/dev/null | grep -- '{v}' | head -40"
        ));
    }
    let log =
        std::env::var("BOXERY_LIBVIRTD_RUN").unwrap_or_else(|_| "/run/boxery-libvirtd".into());
    out += &run(&format!("tail -n 5 {log}/libvirtd.log 2>/dev/null"));
    out
}
