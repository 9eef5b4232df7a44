//! GitOps benchmarks (store only: nothing here needs a backend):
//! - first `boxery sync REPO --once` of a git repository of N Vm manifests (default 1,000, one
//!   file each, in 10 directories), end to end: process start, git fetch into the mirror, one
//!   `git cat-file --batch`, validation, one apply transaction;
//! - a no-op re-sync of the same commit, and the store writes it made (must be 0);
//! - `sync --watch` on a directory of the same N files: one file saved → its object changed
//!   in the store, p50/p99 over 20 saves (the debounce waits 200 ms of quiet first);
//! - the limit, measured in the same run: the store's own `apply_all` of the same N objects
//!   in one transaction into an empty store, and its single-object write rate.
//!
//! `cargo bench -p boxery --bench gitops`. `BOXERY_BENCH_OBJECTS=N` (default 1000).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use boxery_api::Vm;
use boxery_store::{ApplyOptions, Store};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_boxery")
}

fn vm_yaml(name: &str, cpus: u32) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: {name}\n  labels: {{team: bench}}\nspec:\n  source: {{image: debian-12}}\n  resources: {{cpus: {cpus}}}\n"
    )
}

fn git(dir: &Path, args: &[&str]) {
    let ok = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@example.invalid",
        ])
        .args(args)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "git {args:?}");
}

fn write_objects(dir: &Path, n: usize) {
    for i in 0..n {
        let sub = dir.join(format!("group-{}", i % 10));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(format!("v{i}.yaml")), vm_yaml(&format!("v{i}"), 1)).unwrap();
    }
}

fn boxery(home: &Path, args: &[&str]) -> Duration {
    let t = Instant::now();
    let o = Command::new(bin())
        .args(args)
        .env("BOXERY_HOME", home)
        .env("BOXERY_BACKEND", "fake")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "boxery {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    t.elapsed()
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    let n: usize = std::env::var("BOXERY_BENCH_OBJECTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let tmp = tempfile::tempdir().unwrap();

    // The limit: the store applying the same objects in one transaction, and one by one.
    let raw = Store::open(&tmp.path().join("raw.db")).unwrap();
    let objs: Vec<_> = (0..n)
        .map(|i| {
            let y = vm_yaml(&format!("v{i}"), 1);
            boxery_api::codec::parse_manifests("bench", y.as_bytes())
                .unwrap()
                .remove(0)
                .given
        })
        .collect();
    let t = Instant::now();
    raw.apply_all(objs.clone(), &ApplyOptions::default())
        .unwrap();
    let raw_apply = t.elapsed();
    let t = Instant::now();
    raw.apply_all(objs, &ApplyOptions::default()).unwrap();
    let raw_noop = t.elapsed();
    let single = Store::open(&tmp.path().join("single.db")).unwrap();
    let t = Instant::now();
    for i in 0..200 {
        let y = vm_yaml(&format!("s{i}"), 1);
        let o = boxery_api::codec::parse_manifests("bench", y.as_bytes())
            .unwrap()
            .remove(0)
            .object;
        single.create(o).unwrap();
    }
    let writes_per_s = 200.0 / t.elapsed().as_secs_f64();

    // A git repository of n manifests.
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "--quiet", "--initial-branch=main"]);
    write_objects(&repo, n);
    git(&repo, &["add", "--all"]);
    git(&repo, &["commit", "--quiet", "-m", "objects"]);
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let repo_s = repo.to_str().unwrap();
    let first = boxery(&home, &["sync", repo_s, "--name", "bench", "--once"]);
    let store = Store::open(&home.join("store.db")).unwrap();
    assert_eq!(store.list_as::<Vm>(&Default::default()).unwrap().len(), n);
    let before = store.revision().unwrap();
    let noop = boxery(&home, &["sync", "--name", "bench", "--once"]);
    let writes = store.revision().unwrap() - before;
    // The CLI's own floor: a command that reads one object.
    let floor = boxery(&home, &["get", "source", "bench", "-o", "name"]);

    // --watch on a directory of n files: save one, time until the store has it.
    let dir = tmp.path().join("dir");
    write_objects(&dir, n);
    let whome = tmp.path().join("whome");
    std::fs::create_dir_all(&whome).unwrap();
    let _w = Child(
        Command::new(bin())
            .args(["sync", dir.to_str().unwrap(), "--name", "desk", "--watch"])
            .env("BOXERY_HOME", &whome)
            .env("BOXERY_BACKEND", "fake")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let wstore = Store::open(&whome.join("store.db")).unwrap();
    let cpus = |name: &str| -> Option<u32> {
        wstore
            .get_as::<Vm>(name)
            .ok()
            .flatten()
            .and_then(|v| v.spec.resources.cpus)
    };
    let t = Instant::now();
    while cpus(&format!("v{}", n - 1)).is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the watch never applied"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut lat = Vec::new();
    for round in 0..20u32 {
        let i = (round as usize * 37) % n;
        let name = format!("v{i}");
        let want = 2 + round % 3;
        let path = dir
            .join(format!("group-{}", i % 10))
            .join(format!("{name}.yaml"));
        // An editor's save: a new file renamed over the old one.
        let tmp_file = path.with_extension("yaml.tmp~");
        std::fs::write(&tmp_file, vm_yaml(&name, want)).unwrap();
        let t = Instant::now();
        std::fs::rename(&tmp_file, &path).unwrap();
        while cpus(&name) != Some(want) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{name} never changed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        lat.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }

    println!("gitops, {n} Vm manifests (one file each):");
    println!(
        "  limit: store apply_all of {n} objects in one transaction: {} (no-op again: {}); single writes: {writes_per_s:.0}/s",
        ms(raw_apply),
        ms(raw_noop)
    );
    println!(
        "  first sync (git, end to end): {} = {:.1}x the store's apply of the same objects (target <= 5 s)",
        ms(first),
        first.as_secs_f64() / raw_apply.as_secs_f64()
    );
    println!(
        "  no-op re-sync: {} with {writes} store writes (target <= 1 s, 0 writes); a one-object `boxery get`: {}",
        ms(noop),
        ms(floor)
    );
    println!(
        "  --watch, file saved -> applied: p50 {} p99 {} over {} saves (target p50 <= 1 s; 200 ms of it is the debounce)",
        ms(pct(&mut lat.clone(), 0.5)),
        ms(pct(&mut lat, 0.99)),
        20
    );
}
