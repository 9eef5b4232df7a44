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
        virsh(&["undefine", &d]);
    }
    let pool = backend.pool_name();
    virsh(&["pool-destroy", &pool]);
    virsh(&["pool-undefine", &pool]);
    let _ = std::fs::remove_dir_all(backend.pool_dir());
}
