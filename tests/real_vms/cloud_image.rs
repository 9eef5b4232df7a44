//! Bring your own image (docs/images.md): a distribution's cloud image, made offline by
//! image/build-cloud.sh (its own bootloader, cloud-init with Debian's settings, OpenSSH, no
//! `agent` user and nothing else of boxery's), imported from a file, boots with boxery's seed:
//! the VM's user, keys, pinned host key, hostname and token. The same image with cloud-init
//! disabled is refused clearly while it boots, not after a wait runs out; a file that is no
//! bootable disk is refused at import.

use std::path::PathBuf;
use std::time::Instant;

use super::{Kind, RealHome, repo};

/// Where the image builders write (as `serve` reads it).
fn image_cache() -> PathBuf {
    std::env::var_os("BOXERY_IMAGE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/boxery/images"))
}

/// image/build-cloud.sh into the image cache (cached by its inputs).
fn build_cloud_images() -> (PathBuf, PathBuf) {
    let out = image_cache();
    let started = Instant::now();
    let o = std::process::Command::new("bash")
        .arg(repo().join("image/build-cloud.sh"))
        .arg(&out)
        .output()
        .expect("run image/build-cloud.sh");
    assert!(
        o.status.success(),
        "image/build-cloud.sh failed (it needs root, debootstrap, sfdisk and extlinux: scripts/install-deps.sh):\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!(
        "image/build-cloud.sh: {:?}\n{}",
        started.elapsed(),
        String::from_utf8_lossy(&o.stdout)
    );
    (
        out.join("cloud-debian-12.qcow2"),
        out.join("cloud-debian-12-no-cloud-init.qcow2"),
    )
}

fn image_yaml(name: &str, file: &std::path::Path) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Image\nmetadata: {{name: {name}}}\n\
         spec: {{source: {{file: '{}'}}}}\n",
        file.display()
    )
}

fn vm_yaml(name: &str, image: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: {name}}}\n\
         spec: {{source: {{image: {image}}}, resources: {{cpus: 1, memory: 1Gi}}}}\n"
    )
}

/// `boxery apply -f FILE --wait --timeout TIMEOUT`, for a caller that expects it to fail.
fn apply_waiting(h: &RealHome, file: &std::path::Path, timeout: &str) -> std::process::Output {
    h.cmd(&[
        "apply",
        "-f",
        file.to_str().unwrap(),
        "--wait",
        "--timeout",
        timeout,
    ])
}

pub(super) fn cloud_image(kind: Kind) {
    let (good, bad) = build_cloud_images();
    let h = RealHome::new(kind);
    let junk = tempfile::tempdir().unwrap();
    h.home.write(
        "config.yaml",
        &format!(
            "importRoots: ['{}', '{}']\n",
            image_cache().display(),
            junk.path().display()
        ),
    );
    let mut serve = h.serve();
    serve.wait_leading();

    // a file that is no bootable disk is refused at import, saying what boxery imports
    let blank = junk.path().join("blank.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&blank)
        .arg("256M")
        .status()
        .unwrap();
    assert!(st.success());
    let f = h.home.write("blank.yaml", &image_yaml("blank", &blank));
    let o = apply_waiting(&h, &f, "60s");
    assert!(!o.status.success(), "a blank disk was imported");
    let said = h.ok(&["describe", "image", "blank"]);
    assert!(said.contains("has no boot sector"), "{said}");
    h.ok(&["delete", "image", "blank", "--wait", "--timeout", "1m"]);

    // the cloud image: imported once, then every VM made from it is boxery's
    let started = Instant::now();
    let f = h.home.write("byo.yaml", &image_yaml("byo", &good));
    h.apply_file(&f, "10m");
    let imported = started.elapsed();
    let started = Instant::now();
    let f = h.home.write("byo2.yaml", &image_yaml("byo2", &good));
    h.apply_file(&f, "5m");
    let again = started.elapsed();
    eprintln!("cloud image imported in {imported:?}; the same file again in {again:?}");

    let started = Instant::now();
    let f = h.home.write("c1.yaml", &vm_yaml("c1", "byo"));
    h.apply_file(&f, "15m");
    eprintln!("a VM from the cloud image Ready in {:?}", started.elapsed());
    // the guest push reaches it (the context file an agent reads, the proxy's variables):
    // nothing of it is in the image
    let pushed = h.run(
        "c1",
        "for i in $(seq 120); do [ -s /run/boxery/AGENTS.md ] && break; sleep 1; done; \
         head -3 /run/boxery/AGENTS.md; . /run/boxery/env; [ -n \"$BOXERY_TOKEN\" ] && echo token-ok",
    );
    assert!(
        pushed.contains("c1") && pushed.contains("token-ok"),
        "{pushed}"
    );
    let who = h.run(
        "c1",
        "id -un; hostname; sudo -n true && echo sudo-ok; id debian 2>/dev/null || echo no-debian-user",
    );
    for want in ["agent", "c1", "sudo-ok", "no-debian-user"] {
        assert!(
            who.lines().any(|l| l.trim() == want),
            "{want} missing: {who}"
        );
    }

    // the same image without cloud-init: refused while it boots, saying why
    let f = h.home.write("nci.yaml", &image_yaml("nci", &bad));
    h.apply_file(&f, "10m");
    let f = h.home.write("c2.yaml", &vm_yaml("c2", "nci"));
    let started = Instant::now();
    let o = apply_waiting(&h, &f, "6m");
    // the wait ends on the diagnosis (exit 1), not on its timeout (exit 4), whose message
    // would quote the same condition
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Vm c2 will not become Ready (GuestNotAnswering)")
            && err.contains("cloud-init never ran"),
        "{err}"
    );
    let said = h.ok(&["describe", "vm", "c2"]);
    assert!(
        said.contains("cloud-init never ran") && said.contains("GuestNotAnswering"),
        "{said}"
    );
    eprintln!(
        "the image without cloud-init: the wait ended after {:?}",
        started.elapsed()
    );

    h.ok(&["rm", "c1", "c2", "--wait", "--timeout", "5m"]);
    h.ok(&[
        "delete",
        "image",
        "byo",
        "byo2",
        "nci",
        "--wait",
        "--timeout",
        "2m",
    ]);
    serve.kill();
}
