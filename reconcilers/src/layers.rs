//! A layer added to a running VM's `spec.layers`, in place (docs/images.md, "Layers on a
//! running VM"). The guest never fetches anything: its egress may be `Deny`, and a network
//! that intercepts TLS is trusted by the build host only. What the layer installs
//! ([`boxery_api::image::Layer::files`]) is taken from the layered build the host already made
//! (the builder's disk in `BOXERY_IMAGE_CACHE`, `debian-12-agents.qcow2`), read with
//! `qemu-img convert` and `debugfs` (no mount, no root-only kernel feature), packed once per
//! build into `$BOXERY_HOME/layers/`, and unpacked in the guest as root over its ssh. Then the
//! guest's `/etc/boxery/layers` and `/etc/boxery/build-info` say what it has, and the record is
//! read back from the guest (parsed as hostile input, [`BuildInfo::parse`]).
//!
//! # Guarantees
//! - Idempotent: unpacking the same files again changes nothing, so an apply cut short is
//!   simply run again by the next reconcile.
//! - A bundle is published by a rename once it is complete; a work directory left by a crash
//!   (its lock free) is removed by the next staging.
//! - One bundle per image and layers: making one removes those of earlier builds.
//!
//! # Caveats
//! - Identical large files are carried once and unpacked as hard links of each other.
//! - A layer that changes services or the kernel would need a reboot; `agents` (files only)
//!   does not, so none is made.
//! - Files the layer removed at build time are not removed from the guest.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use boxery_api::image::{BuildInfo, ImageSource, LAYERS, layered_image_name};
use boxery_api::{Image, Vm};

use crate::context::Ctx;

/// How long copying a layer's files into a guest may take.
const PUSH_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long the small ssh steps (the record, reading it back) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// What adding layers in place did.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The guest's build record, read back after.
    pub record: BuildInfo,
    /// How long staging the bundle took (zero when it was there from an earlier VM).
    pub staged: Duration,
    /// How long copying it into the guest took.
    pub copied: Duration,
    /// The bundle's bytes.
    pub bytes: u64,
}

/// Copy layers `added` into running VM `vm` from the layered build `image` (Ready, a build of
/// the VM's base with every layer the VM is to have).
pub async fn apply(
    ctx: &Ctx,
    ssh: &crate::ssh::SshDir,
    vm: &Vm,
    image: &Image,
    added: &[String],
) -> Result<Applied, String> {
    let ImageSource::Build(b) = &image.spec.source else {
        return Err(format!("image {} is not a build", image.metadata.name));
    };
    let outputs = ctx.settings.build_outputs.as_deref().ok_or(
        "the control plane has no image builders' outputs (BOXERY_IMAGE_CACHE) to copy the layer from",
    )?;
    let built = layered_image_name(&b.base, &b.layers);
    let record = image.status.build_info.clone().unwrap_or_default();
    let t = std::time::Instant::now();
    let bundle = stage(ctx, outputs, &built, added, &record).await?;
    let staged = t.elapsed();
    let bytes = std::fs::metadata(&bundle).map(|m| m.len()).unwrap_or(0);
    let target = crate::ssh::Target::of(vm).ok_or("the VM has no ssh endpoint")?;
    ssh.write(&target).map_err(|e| e.to_string())?;
    let name = vm.metadata.name.as_str();
    let t = std::time::Instant::now();
    push(ssh, name, &bundle).await?;
    let copied = t.elapsed();
    // what the guest now has, said where boxery-provision says it
    let mut info = record;
    if info.layers.is_empty() {
        info.layers = ["plumbing", "devtools"]
            .iter()
            .map(|s| s.to_string())
            .chain(b.layers.iter().cloned())
            .collect();
    }
    info.patched_at = Some(boxery_api::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    let script = format!(
        "set -e\nmkdir -p /etc/boxery\ncat > /etc/boxery/build-info.tmp <<'BOXERY_EOF'\n{}BOXERY_EOF\nmv /etc/boxery/build-info.tmp /etc/boxery/build-info\necho '{}' > /etc/boxery/layers\n",
        info.render(),
        info.layers.join(" ")
    );
    crate::guest::run_script(ssh, name, &[], "sudo -n sh -s", &script, STEP_TIMEOUT)
        .await
        .map_err(|e| format!("recording the layers in the guest: {e}"))?;
    Ok(Applied {
        record: read_back(ssh, name).await?,
        staged,
        copied,
        bytes,
    })
}

/// The files of layers `added` from the builder's disk `OUT/<built>.qcow2`, packed as
/// `$BOXERY_HOME/layers/<built>.<layers>.<record hash>.tar` (made once per build).
async fn stage(
    ctx: &Ctx,
    outputs: &Path,
    built: &str,
    added: &[String],
    record: &BuildInfo,
) -> Result<PathBuf, String> {
    let files: Vec<&str> = LAYERS
        .iter()
        .filter(|l| added.iter().any(|a| a == l.name))
        .flat_map(|l| l.files.iter().copied())
        .collect();
    if files.is_empty() {
        return Err(format!(
            "layer {} lists no files to copy in",
            added.join(", ")
        ));
    }
    let disk = outputs.join(format!("{built}.qcow2"));
    let Some(meta) = std::fs::metadata(&disk).ok().filter(|m| m.is_file()) else {
        return Err(format!(
            "the layered build {} is missing: the image was made, but its builder's output is gone (delete image {built} so that it is built again)",
            disk.display()
        ));
    };
    // the bundle is of this build: its record, and the disk's size and time (a rebuild with
    // no record, or the same record, is still another bundle)
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let key = boxery_api::fnv::fnv1a(
        format!("{}\n{}\n{modified}", record.render(), meta.len()).as_bytes(),
    );
    let dir = ctx.home.join("layers");
    let bundle = dir.join(format!("{built}.{}.{key:016x}.tar", added.join("-")));
    if bundle.is_file() {
        return Ok(bundle);
    }
    // a work directory of its own: two VMs adding the same layer at once stage side by side
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let stale = dir.clone();
    let _ = tokio::task::spawn_blocking(move || remove_stale_work(&stale)).await;
    let work = tempfile::Builder::new()
        .prefix(&format!(".work-{built}-{}-", std::process::id()))
        .tempdir_in(&dir)
        .map_err(|e| format!("creating a work directory in {}: {e}", dir.display()))?;
    // held while this staging runs: what tells it from one a crash left
    let _held = hold(work.path())
        .map_err(|e| format!("locking the work directory {}: {e}", work.path().display()))?;
    let made = async {
        let work = work.path();
        let root = work.join("root");
        std::fs::create_dir_all(&root).map_err(|e| format!("creating {}: {e}", root.display()))?;
        let raw = work.join("disk.raw");
        run(tokio::process::Command::new(
            std::env::var_os("BOXERY_QEMU_IMG").unwrap_or_else(|| "qemu-img".into()),
        )
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&disk)
        .arg(&raw))
        .await?;
        for f in &files {
            let rel = f.trim_start_matches('/');
            let parent = root.join(Path::new(rel).parent().unwrap_or(Path::new("")));
            std::fs::create_dir_all(&parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
            // rdump keeps modes and symlinks; run in the destination so that no host
            // path goes into debugfs's request line
            run(tokio::process::Command::new("debugfs")
                .arg("-R")
                .arg(format!("rdump {f} ."))
                .arg(&raw)
                .current_dir(&parent))
            .await?;
            if std::fs::symlink_metadata(root.join(rel)).is_err() {
                return Err(format!(
                    "{f} is not in the layered build {} (debugfs could not copy it out)",
                    disk.display()
                ));
            }
        }
        let _ = std::fs::remove_file(&raw);
        let dedup = root.clone();
        let saved = tokio::task::spawn_blocking(move || link_duplicates(&dedup))
            .await
            .map_err(|e| format!("linking duplicates: {e}"))?
            .map_err(|e| format!("linking duplicates in {}: {e}", root.display()))?;
        tracing::info!(
            image = built,
            saved_mib = saved >> 20,
            "identical files in the layer bundle stored once"
        );
        let part = work.join("bundle.tar");
        // owned by root in the guest, whoever the control plane runs as here (rdump gives
        // the files to the user that ran it)
        run(tokio::process::Command::new("tar")
            .args(["--owner=0", "--group=0", "--numeric-owner"])
            .arg("-C")
            .arg(&root)
            .arg("-cf")
            .arg(&part)
            .args(files.iter().map(|f| f.trim_start_matches('/'))))
        .await?;
        std::fs::rename(&part, &bundle).map_err(|e| format!("publishing the bundle: {e}"))
    }
    .await;
    drop(work);
    made?;
    prune_older(&dir, &bundle);
    Ok(bundle)
}

/// The lock a running staging holds on its work directory (`lock` in it, `flock`): it goes
/// with the process, whatever ends it.
fn hold(work: &Path) -> std::io::Result<std::fs::File> {
    let f = std::fs::File::create(work.join("lock"))?;
    f.try_lock().map_err(std::io::Error::other)?;
    Ok(f)
}

/// Whether the staging in `work` (named `.work-<built>-<pid>-<random>`) is over: its lock can
/// be taken (its process ended, or a new leader took over from it), or, for a directory made
/// just before its lock (or by an older boxery without one), another process made it.
fn staging_over(work: &Path, name: &str) -> bool {
    match std::fs::File::open(work.join("lock")) {
        // a lock taken here is let go when `f` is dropped
        Ok(f) => f.try_lock().is_ok(),
        Err(_) => {
            let pid = name
                .strip_prefix(".work-")
                .and_then(|rest| rest.rsplit('-').nth(1));
            pid != Some(std::process::id().to_string().as_str())
        }
    }
}

/// Remove the work directories under `dir` whose staging is over ([`staging_over`]): what a
/// crash or a kill left mid-staging (a raw disk of several GiB each). A running staging, of
/// this process or of a control plane that led the home before this one, holds its lock.
fn remove_stale_work(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name();
        let Some(n) = n.to_str() else { continue };
        if n.starts_with(".work-") && staging_over(&e.path(), n) {
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => tracing::info!(dir = n, "a layer staging left by an earlier run removed"),
                Err(err) => tracing::warn!(
                    dir = n,
                    "cannot remove a layer staging left by an earlier run: {err}"
                ),
            }
        }
    }
}

/// Remove the bundles of earlier builds of the same image and layers as `bundle` (its name
/// but for the key): that build's disk is gone, replaced by the one `bundle` was made from,
/// so nothing would use them again, and each is as large as the layer (about 1 GiB for
/// `agents`). A push still reading one keeps its open file.
fn prune_older(dir: &Path, bundle: &Path) {
    let Some(name) = bundle.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    // `<built>.<layers>.<key:016x>.tar`: the same up to the key
    let Some(stem) = name
        .strip_suffix(".tar")
        .and_then(|n| n.rsplit_once('.'))
        .map(|(stem, _)| format!("{stem}."))
    else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name();
        let Some(n) = n.to_str() else { continue };
        let key = n.strip_prefix(&stem).and_then(|k| k.strip_suffix(".tar"));
        if n != name
            && key.is_some_and(|k| k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            match std::fs::remove_file(e.path()) {
                Ok(()) => tracing::info!(bundle = n, "an earlier build's layer bundle removed"),
                Err(err) => tracing::warn!(
                    bundle = n,
                    "cannot remove an earlier build's layer bundle: {err}"
                ),
            }
        }
    }
}

/// Make identical regular files of 1 MiB or more under `root` (same bytes, mode and owner)
/// hard links of the first of them, so that the bundle carries each once: the agents' npm
/// packages ship the same native program two or three times (`claude` and `claude.exe`,
/// opencode's baseline build). In the guest they are then one file with several names.
/// Returns the bytes saved.
fn link_duplicates(root: &Path) -> std::io::Result<u64> {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    let mut by_size: BTreeMap<(u64, u32, u32, u32), Vec<PathBuf>> = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                dirs.push(e.path());
            } else if t.is_file() {
                let m = e.metadata()?;
                if m.len() >= 1 << 20 && m.nlink() == 1 {
                    by_size
                        .entry((m.len(), m.mode(), m.uid(), m.gid()))
                        .or_default()
                        .push(e.path());
                }
            }
        }
    }
    let mut saved = 0;
    for ((size, ..), mut paths) in by_size {
        paths.sort();
        let mut kept: Vec<PathBuf> = Vec::new();
        for p in paths {
            let mut twin = None;
            for k in &kept {
                if same_bytes(k, &p)? {
                    twin = Some(k.clone());
                    break;
                }
            }
            match twin {
                Some(k) => {
                    std::fs::remove_file(&p)?;
                    std::fs::hard_link(&k, &p)?;
                    saved += size;
                }
                None => kept.push(p),
            }
        }
    }
    Ok(saved)
}

/// Whether two files of the same length hold the same bytes.
fn same_bytes(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let (mut a, mut b) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = a.read(&mut x)?;
        if n == 0 {
            return Ok(true);
        }
        b.read_exact(&mut y[..n])?;
        if x[..n] != y[..n] {
            return Ok(false);
        }
    }
}

/// Run a host command; its stderr's tail is the error.
async fn run(cmd: &mut tokio::process::Command) -> Result<(), String> {
    let what = format!("{:?}", cmd.as_std().get_program());
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(5).collect();
    Err(format!(
        "{what} failed ({}): {}",
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join("; ")
    ))
}

/// Unpack `bundle` in VM `vm`'s `/` as root.
async fn push(ssh: &crate::ssh::SshDir, vm: &str, bundle: &Path) -> Result<(), String> {
    let file =
        std::fs::File::open(bundle).map_err(|e| format!("opening {}: {e}", bundle.display()))?;
    let child = ssh
        .command(vm)
        .args(["-T", "-o", "BatchMode=yes", "--", "sudo -n tar -xpf - -C /"])
        .stdin(Stdio::from(file))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run ssh: {e}"))?;
    let out = tokio::time::timeout(PUSH_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| format!("copying the layer in took longer than {PUSH_TIMEOUT:?}"))?
        .map_err(|e| format!("ssh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "unpacking the layer in the guest failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The guest's `/etc/boxery/build-info`, at most one byte more than a record may have.
async fn read_back(ssh: &crate::ssh::SshDir, vm: &str) -> Result<BuildInfo, String> {
    let limit = boxery_api::image::BUILD_INFO_MAX_BYTES + 1;
    let out = ssh
        .command(vm)
        .args(["-T", "-o", "BatchMode=yes", "--"])
        .arg(format!("head -c {limit} /etc/boxery/build-info"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(STEP_TIMEOUT, out)
        .await
        .map_err(|_| "reading the guest's build record took too long".to_string())?
        .map_err(|e| format!("ssh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "reading /etc/boxery/build-info in the guest failed ({})",
            out.status
        ));
    }
    let bytes = &out.stdout[..out.stdout.len().min(limit)];
    BuildInfo::parse(bytes).map_err(|why| format!("the guest's /etc/boxery/build-info: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Only the same image's and layers' bundles of other builds go; other layers, other
    /// images, work directories and files of other shapes stay.
    #[test]
    fn a_new_bundle_removes_the_earlier_builds_of_its_kind_only() {
        let d = tempfile::tempdir().unwrap();
        let names = [
            "debian-12-agents.agents.00000000000000aa.tar",
            "debian-12-agents.agents.00000000000000bb.tar",
            "debian-12-agents-docker.agents.00000000000000aa.tar",
            "debian-12-agents.agents-x.00000000000000aa.tar",
            "debian-12-agents.agents.notakey.tar",
            ".work-debian-12-agents-abc",
        ];
        for n in names {
            std::fs::write(d.path().join(n), b"x").unwrap();
        }
        prune_older(d.path(), &d.path().join(names[1]));
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want: Vec<String> = names[1..].iter().map(|n| n.to_string()).collect();
        want.sort();
        assert_eq!(left, want);
    }

    /// A staging whose lock is free goes, whichever process made it; one whose lock is held
    /// stays, whichever process made it (a running staging, or an earlier leader's); one
    /// without a lock goes unless this process made it (it is about to take its lock).
    #[test]
    fn stagings_left_by_an_earlier_run_are_removed() {
        let d = tempfile::tempdir().unwrap();
        let pid = std::process::id();
        let ours = format!(".work-debian-12-agents-{pid}-Ab12");
        let theirs = ".work-debian-12-agents-1-Xy34";
        let held = ".work-debian-12-agents-1-Held";
        let ours_crashed = format!(".work-debian-12-agents-{pid}-Ol56");
        for n in [ours.as_str(), theirs, held, ours_crashed.as_str()] {
            std::fs::create_dir_all(d.path().join(n).join("root")).unwrap();
            std::fs::write(d.path().join(n).join("disk.raw"), b"x").unwrap();
        }
        let _running = hold(&d.path().join(held)).unwrap();
        // a crash left its lock file behind, not the lock
        drop(hold(&d.path().join(theirs)).unwrap());
        drop(hold(&d.path().join(&ours_crashed)).unwrap());
        std::fs::write(
            d.path()
                .join("debian-12-agents.agents.00000000000000aa.tar"),
            b"x",
        )
        .unwrap();
        remove_stale_work(d.path());
        assert!(d.path().join(&ours).is_dir(), "about to be locked");
        assert!(d.path().join(held).is_dir(), "running");
        assert!(!d.path().join(theirs).exists());
        assert!(!d.path().join(&ours_crashed).exists(), "a pid used again");
        assert!(
            d.path()
                .join("debian-12-agents.agents.00000000000000aa.tar")
                .is_file()
        );
    }

    #[test]
    fn identical_large_files_become_one_and_others_stay_apart() {
        let d = tempfile::tempdir().unwrap();
        let big = vec![7u8; 3 << 20];
        let mut other = big.clone();
        *other.last_mut().unwrap() = 8;
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        for (p, bytes) in [
            ("a/claude", &big),
            ("a/b/claude.exe", &big),
            ("z", &big),
            ("a/near", &other),
        ] {
            std::fs::write(d.path().join(p), bytes).unwrap();
        }
        std::fs::write(d.path().join("small1"), b"x").unwrap();
        std::fs::write(d.path().join("small2"), b"x").unwrap();
        assert_eq!(link_duplicates(d.path()).unwrap(), 2 * (3 << 20));
        let ino = |p: &str| std::fs::metadata(d.path().join(p)).unwrap().ino();
        assert_eq!(ino("a/claude"), ino("a/b/claude.exe"));
        assert_eq!(ino("a/claude"), ino("z"));
        assert_ne!(ino("a/claude"), ino("a/near"), "one byte differs");
        assert_ne!(ino("small1"), ino("small2"), "small files are left alone");
        assert_eq!(std::fs::read(d.path().join("z")).unwrap(), big);
        assert_eq!(link_duplicates(d.path()).unwrap(), 0, "once");
    }
}
