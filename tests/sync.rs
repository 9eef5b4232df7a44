//! GitOps: `boxery sync` against real git repositories the tests make (`git init`, commits),
//! and directories; field ownership between sync, people's verbs and `apply`.
//!
//! - a repository is followed: created, scaled, pruned (never a hand-made object), a bad
//!   commit applies nothing and names its file, a revert applies again; `--ref` and `--path`;
//! - a field `boxery stop` set stays stopped under sync; a manifest that sets it conflicts,
//!   `--force-conflicts` wins; a pool scaled by `boxery scale` is not fought over;
//! - leased pool members survive a scale-down from git until their lease ends;
//! - `sync --watch` applies an editor-style save once;
//! - a SIGKILLed `sync --watch` leaves all of a revision or none; the next run converges.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use boxery_api::lease::LeasePhase;
use boxery_api::{Lease, Pool, Source, SourcePhase, Vm};
use common::{Home, vm_yaml};

/// A git repository made by the test.
struct Repo {
    dir: PathBuf,
}

impl Repo {
    fn new(home: &Home) -> Repo {
        let dir = home.path().join("repo");
        std::fs::create_dir_all(&dir).unwrap();
        let r = Repo { dir };
        r.git(&["init", "--quiet", "--initial-branch=main"]);
        r
    }

    fn git(&self, args: &[&str]) -> String {
        let o = Command::new("git")
            .arg("-C")
            .arg(&self.dir)
            .args([
                "-c",
                "user.name=test",
                "-c",
                "user.email=test@example.invalid",
            ])
            .args(args)
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .output()
            .expect("git (install git)");
        assert!(
            o.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    fn write(&self, name: &str, text: &str) {
        let p = self.dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn remove(&self, name: &str) {
        std::fs::remove_file(self.dir.join(name)).unwrap();
    }

    /// Commit everything; returns the commit.
    fn commit(&self, message: &str) -> String {
        self.git(&["add", "--all"]);
        self.git(&["commit", "--quiet", "--allow-empty", "-m", message]);
        self.git(&["rev-parse", "HEAD"])
    }

    fn url(&self) -> &str {
        self.dir.to_str().unwrap()
    }
}

fn pool_yaml(name: &str, replicas: Option<u32>) -> String {
    let replicas = replicas
        .map(|r| format!("  replicas: {r}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n{replicas}  template:\n    spec:\n      source: {{image: debian-12}}\n"
    )
}

fn source(home: &Home, name: &str) -> Source {
    home.store()
        .get_as(name)
        .unwrap()
        .expect("the Source exists")
}

fn vm(home: &Home, name: &str) -> Option<Vm> {
    home.store().get_as(name).unwrap()
}

fn replicas(home: &Home, pool: &str) -> u32 {
    let p: Pool = home.store().get_as(pool).unwrap().unwrap();
    p.spec.replicas
}

/// Wait until pool `pool` has `n` free members.
fn wait_free(home: &Home, pool: &str, n: u32, within: Duration) {
    common::eventually(within, || {
        let p: Pool = home.store().get_as(pool).unwrap()?;
        (p.status.free == n).then_some(())
    })
    .unwrap_or_else(|| panic!("pool {pool} never had {n} free members"));
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_repository_is_followed_and_prunes_only_what_it_applied() {
    let home = Home::new();
    let repo = Repo::new(&home);
    repo.write("lab/pool.yaml", &pool_yaml("agents", Some(3)));
    repo.write("lab/web.yaml", &vm_yaml("web"));
    repo.write("README.md", "not a manifest\n");
    let first = repo.commit("a pool and a vm");
    // A Vm made by hand beside them, and one applied by hand with the same label a source
    // would give (prune still leaves it: it is not this source's).
    let hand = home.write("hand.yaml", &vm_yaml("hand"));
    home.ok(&["apply", "-f", hand.to_str().unwrap()]);

    let out = home.ok(&[
        "sync",
        repo.url(),
        "--once",
        "--name",
        "lab",
        "--path",
        "lab",
    ]);
    assert!(
        out.contains("pool/agents created") && out.contains("vm/web created"),
        "{out}"
    );
    assert!(
        out.contains(&format!("revision {} applied", &first[..12])),
        "{out}"
    );
    let s = source(&home, "lab");
    assert_eq!(s.status.phase, SourcePhase::Synced);
    assert_eq!(s.status.revision.as_deref(), Some(first.as_str()));
    assert_eq!(s.status.objects, 2);
    let web = vm(&home, "web").unwrap();
    assert_eq!(web.metadata.labels["boxery.dev/applyset"], "lab");
    // `get sources` shows it; `describe` has the event.
    let table = home.ok(&["get", "sources"]);
    assert!(
        table.contains("lab") && table.contains("Synced") && table.contains(&first[..12]),
        "{table}"
    );
    let desc = home.ok(&["describe", "source", "lab"]);
    assert!(desc.contains("Synced"), "{desc}");

    // The same revision again: nothing to do, nothing written.
    let rev = home.store().revision().unwrap();
    let out = home.ok(&["sync", "--name", "lab", "--once"]);
    assert!(out.contains("0 changed"), "{out}");
    assert_eq!(
        home.store().revision().unwrap(),
        rev,
        "a no-op sync writes nothing"
    );

    // Scale down, drop the vm's file: scaled and pruned; the hand-made Vm stays.
    repo.write("lab/pool.yaml", &pool_yaml("agents", Some(1)));
    repo.remove("lab/web.yaml");
    let second = repo.commit("smaller, no web");
    let out = home.ok(&["sync", "--name", "lab"]);
    assert!(
        out.contains("pool/agents configured") && out.contains("vm/web pruned"),
        "{out}"
    );
    assert_eq!(replicas(&home, "agents"), 1);
    assert!(vm(&home, "web").is_none());
    assert!(
        vm(&home, "hand").is_some(),
        "a hand-made Vm is never pruned"
    );

    // A commit with one bad manifest (and a good one): exit 2, nothing of it applied, the
    // error names the file, the document and the field; the last good revision stays.
    repo.write("lab/pool.yaml", &pool_yaml("agents", Some(2)));
    repo.write(
        "lab/more.yaml",
        &format!(
            "{}---\n{}  resources: {{cpus: 999}}\n",
            vm_yaml("ok1"),
            vm_yaml("bad1")
        ),
    );
    let bad = repo.commit("a bad manifest");
    let o = home.run(&["sync", "--name", "lab"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("lab/more.yaml")
            && err.contains("document 1")
            && err.contains("spec.resources.cpus"),
        "{err}"
    );
    assert_eq!(
        replicas(&home, "agents"),
        1,
        "nothing of the bad commit applied"
    );
    assert!(vm(&home, "ok1").is_none());
    let s = source(&home, "lab");
    assert_eq!(s.status.phase, SourcePhase::Failed);
    assert_eq!(s.status.revision.as_deref(), Some(second.as_str()));
    assert_eq!(
        s.status.last_attempted_revision.as_deref(),
        Some(bad.as_str())
    );
    assert!(s.status.error.as_deref().unwrap().contains("lab/more.yaml"));
    let events = home.ok(&["events", "source", "lab"]);
    assert!(events.contains("SyncFailed"), "{events}");

    // Revert it: applies.
    repo.git(&["revert", "--no-edit", "HEAD"]);
    let out = home.ok(&["sync", "--name", "lab"]);
    assert!(
        out.contains("unchanged") || out.contains("0 changed"),
        "{out}"
    );
    let s = source(&home, "lab");
    assert_eq!(s.status.phase, SourcePhase::Synced);
    assert!(s.status.error.is_none());

    // --ref: an older commit (a tag) brings the vm back; a name no repository has is refused.
    repo.git(&["tag", "v1", &first]);
    home.ok(&[
        "sync",
        repo.url(),
        "--name",
        "lab",
        "--path",
        "lab",
        "--ref",
        "v1",
    ]);
    assert!(vm(&home, "web").is_some());
    assert_eq!(replicas(&home, "agents"), 3);
    let o = home.run(&[
        "sync",
        repo.url(),
        "--name",
        "lab",
        "--path",
        "lab",
        "--ref",
        "nope",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("nope"), "{}", stderr(&o));

    // Another source under the same name is refused, and says how to go on.
    let other = home.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("x.yaml"), vm_yaml("x")).unwrap();
    let o = home.run(&["sync", other.to_str().unwrap(), "--name", "lab"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(stderr(&o).contains("--name"), "{}", stderr(&o));
}

/// The repro of issue 30: a hand-made VM of the same name as a committed manifest is never
/// taken in (and so never pruned) unless `--adopt` says so; nor is another source's object.
#[test]
fn sync_never_takes_in_what_it_did_not_make() {
    let home = Home::new();
    let repo = Repo::new(&home);
    home.ok(&["new", "handmade"]);
    let before = vm(&home, "handmade").unwrap();
    repo.write("handmade.yaml", &vm_yaml("handmade"));
    repo.write("web.yaml", &vm_yaml("web"));
    let commit = repo.commit("a manifest named like the hand-made VM");
    let o = home.run(&["sync", repo.url(), "--name", "lab"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("vm/handmade (made by hand)")
            && err.contains("boxery.dev/applyset=lab")
            && err.contains("boxery sync --name lab --adopt")
            && err.contains("nothing applied"),
        "{err}"
    );
    // Nothing of the revision was applied, the VM is as it was, and the Source says why.
    assert!(
        vm(&home, "web").is_none(),
        "nothing of the revision applied"
    );
    let after = vm(&home, "handmade").unwrap();
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    assert!(!after.metadata.labels.contains_key("boxery.dev/applyset"));
    let s = source(&home, "lab");
    assert_eq!(s.status.phase, SourcePhase::Failed);
    assert_eq!(
        s.status.last_attempted_revision.as_deref(),
        Some(commit.as_str())
    );
    assert!(
        s.status.error.as_deref().unwrap().contains("vm/handmade"),
        "{:?}",
        s.status.error
    );
    let events = home.ok(&["events", "source", "lab"]);
    assert!(
        events.contains("SyncFailed") && events.contains("vm/handmade"),
        "{events}"
    );

    // The file goes: the sync applies, and the hand-made VM stays.
    repo.remove("handmade.yaml");
    repo.commit("no handmade");
    let out = home.ok(&["sync", "--name", "lab"]);
    assert!(!out.contains("handmade"), "{out}");
    assert!(vm(&home, "handmade").is_some(), "never pruned");

    // Another source's object is refused the same way, naming that source.
    let other = home.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("web.yaml"), vm_yaml("web")).unwrap();
    let o = home.run(&["sync", other.to_str().unwrap(), "--name", "other"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("vm/web (applied by source lab)"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        vm(&home, "web").unwrap().metadata.labels["boxery.dev/applyset"],
        "lab"
    );

    // Adopted on purpose: the source owns it now, and prunes it when its file goes.
    repo.write("handmade.yaml", &vm_yaml("handmade"));
    repo.commit("adopt handmade");
    let out = home.ok(&["sync", "--name", "lab", "--adopt"]);
    assert!(out.contains("vm/handmade configured"), "{out}");
    assert_eq!(
        vm(&home, "handmade").unwrap().metadata.labels["boxery.dev/applyset"],
        "lab"
    );
    repo.remove("handmade.yaml");
    repo.commit("drop handmade");
    let out = home.ok(&["sync", "--name", "lab"]);
    assert!(out.contains("vm/handmade pruned"), "{out}");
}

/// `apply --prune -l` has the same rule: an object outside the pruned set (made by hand) is
/// refused unless `--adopt`, so a later apply never prunes what no apply made.
#[test]
fn apply_prune_never_takes_in_what_it_did_not_make() {
    let home = Home::new();
    home.ok(&["new", "handmade"]);
    let labelled = |n: &str| {
        vm_yaml(n).replacen(
            &format!("name: {n}"),
            &format!("name: {n}\n  labels: {{team: web}}"),
            1,
        )
    };
    let set = home.write(
        "set.yaml",
        &format!("{}---\n{}", labelled("web1"), labelled("handmade")),
    );
    let set = set.to_str().unwrap();
    let o = home.run(&["apply", "-f", set, "--prune", "-l", "team=web"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("vm/handmade (made by hand)") && stderr(&o).contains("--adopt"),
        "{}",
        stderr(&o)
    );
    assert!(vm(&home, "web1").is_none(), "nothing applied");
    assert!(
        !vm(&home, "handmade")
            .unwrap()
            .metadata
            .labels
            .contains_key("team")
    );
    // The dry runs say the same.
    for dry in ["--dry-run=server", "--dry-run=client"] {
        let o = home.run(&["apply", "-f", set, "--prune", "-l", "team=web", dry]);
        assert_eq!(o.status.code(), Some(5), "{dry}: {}", stderr(&o));
    }
    // Without --prune nothing is pruned later, so plain apply is unchanged; with --adopt it
    // is taken in, and pruned when it leaves the set.
    let out = home.ok(&["apply", "-f", set, "--prune", "-l", "team=web", "--adopt"]);
    assert!(out.contains("vm/handmade configured"), "{out}");
    let only = home.write("only.yaml", &labelled("web1"));
    let out = home.ok(&[
        "apply",
        "-f",
        only.to_str().unwrap(),
        "--prune",
        "-l",
        "team=web",
    ]);
    assert!(out.contains("vm/handmade pruned"), "{out}");
}

#[test]
fn fields_set_by_people_are_theirs_until_forced() {
    let home = Home::new();
    let repo = Repo::new(&home);
    repo.write("web.yaml", &vm_yaml("web"));
    repo.write("pool.yaml", &pool_yaml("auto", None));
    repo.commit("a vm without runStrategy, a pool without replicas");
    home.ok(&["sync", repo.url(), "--name", "site"]);

    // A person stops the VM, labels it, scales the pool: sync leaves all of it.
    home.ok(&["stop", "web"]);
    home.ok(&["label", "vm", "web", "owner=me"]);
    home.ok(&["scale", "pool", "auto", "--replicas", "2"]);
    let out = home.ok(&["sync", "--name", "site"]);
    assert!(out.contains("0 changed"), "{out}");
    let web = vm(&home, "web").unwrap();
    assert_eq!(web.spec.run_strategy, boxery_api::RunStrategy::Stopped);
    assert_eq!(web.metadata.labels["owner"], "me");
    assert_eq!(
        replicas(&home, "auto"),
        2,
        "the scaler's replicas are not fought over"
    );
    let desc = home.ok(&["describe", "vm", "web"]);
    assert!(
        desc.contains("boxery-stop (Update") && desc.contains("boxery-sync.site (Apply"),
        "{desc}"
    );

    // The manifest sets runStrategy: a conflict naming the stop, nothing applied.
    repo.write(
        "web.yaml",
        &format!("{}  runStrategy: Running\n", vm_yaml("web")),
    );
    repo.commit("run it");
    let o = home.run(&["sync", "--name", "site"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("spec.runStrategy")
            && err.contains("boxery-stop")
            && err.contains("boxery-sync.site"),
        "{err}"
    );
    assert!(err.contains("--force-conflicts"), "{err}");
    assert_eq!(
        vm(&home, "web").unwrap().spec.run_strategy,
        boxery_api::RunStrategy::Stopped
    );
    assert_eq!(source(&home, "site").status.phase, SourcePhase::Failed);
    // `diff` says the same before anything is written.
    let f = repo.dir.join("web.yaml");
    let o = home.run(&[
        "diff",
        "-f",
        f.to_str().unwrap(),
        "--field-manager",
        "boxery-sync.site",
    ]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    // Forced: the source's value wins and the field is the source's now.
    home.ok(&["sync", "--name", "site", "--force-conflicts"]);
    let web = vm(&home, "web").unwrap();
    assert_eq!(web.spec.run_strategy, boxery_api::RunStrategy::Running);
    let desc = home.ok(&["describe", "vm", "web"]);
    assert!(!desc.contains("boxery-stop (Update"), "{desc}");

    // `apply` is an applier of its own: it conflicts with the source the same way.
    let stopped = home.write(
        "web-stopped.yaml",
        &format!("{}  runStrategy: Stopped\n", vm_yaml("web")),
    );
    let o = home.run(&["apply", "-f", stopped.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(stderr(&o).contains("boxery-sync.site"), "{}", stderr(&o));
}

#[test]
fn leased_members_survive_a_scale_down_from_git() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    let repo = Repo::new(&home);
    repo.write("pool.yaml", &pool_yaml("g", Some(3)));
    repo.commit("three");
    home.ok(&["sync", repo.url(), "--name", "fleet"]);
    wait_free(&home, "g", 3, Duration::from_secs(60));
    home.ok(&[
        "lease",
        "acquire",
        "g",
        "--holder",
        "me",
        "--name",
        "keep",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let leases: Vec<Lease> = home.store().list_as(&Default::default()).unwrap();
    let held = leases[0].status.vm.clone().unwrap();

    repo.write("pool.yaml", &pool_yaml("g", Some(0)));
    repo.commit("none");
    home.ok(&["sync", "--name", "fleet"]);
    let others: Vec<String> = ["g-0", "g-1", "g-2"]
        .iter()
        .map(|s| s.to_string())
        .filter(|n| *n != held)
        .collect();
    common::eventually(Duration::from_secs(30), || {
        others.iter().all(|n| vm(&home, n).is_none()).then_some(())
    })
    .expect("the free members go");
    assert!(vm(&home, &held).is_some(), "the leased member stays");
    let l: Lease = home.store().get_as("keep").unwrap().unwrap();
    assert_eq!(l.status.phase, LeasePhase::Bound);

    // Pruning the pool from git waits for the lease too.
    repo.remove("pool.yaml");
    repo.write("other.yaml", &vm_yaml("other"));
    repo.commit("no pool");
    let out = home.ok(&["sync", "--name", "fleet"]);
    assert!(out.contains("pool/g pruned"), "{out}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        vm(&home, &held).is_some(),
        "a pruned pool's leased member stays"
    );
    assert!(
        home.store().get_as::<Pool>("g").unwrap().is_some(),
        "the pool waits"
    );

    home.ok(&["lease", "release", "keep", "--wait"]);
    common::eventually(Duration::from_secs(30), || {
        (vm(&home, &held).is_none() && home.store().get_as::<Pool>("g").unwrap().is_none())
            .then_some(())
    })
    .expect("after the release, the member and the pool go");
}

/// Lines of a child's stdout, as they come.
fn lines(child: &mut std::process::Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// A `sync --watch` child, killed by PID on drop.
struct Watching(std::process::Child);

impl Drop for Watching {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn watch(home: &Home, dir: &Path) -> Watching {
    Watching(
        home.cmd()
            .args(["sync", dir.to_str().unwrap(), "--watch", "--name", "desk"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Wait for a line with "applied"; returns the lines up to it.
fn until_applied(rx: &mpsc::Receiver<String>, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while let Ok(l) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let done = l.contains(" applied (");
        got.push(l);
        if done {
            return got;
        }
    }
    panic!("no sync applied within {within:?}: {got:?}");
}

#[test]
fn watch_applies_an_editor_style_save_once() {
    let home = Home::new();
    let dir = home.path().join("desk");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("web.yaml"), vm_yaml("web")).unwrap();
    let mut w = watch(&home, &dir);
    let rx = lines(&mut w.0);
    let first = until_applied(&rx, Duration::from_secs(30));
    assert!(
        first.iter().any(|l| l.contains("vm/web created")),
        "{first:?}"
    );

    // An editor's save: a backup, a new file written beside the old one, renamed over it.
    std::fs::write(dir.join("web.yaml~"), vm_yaml("web")).unwrap();
    let tmp = dir.join(".web.yaml.swp");
    std::fs::write(
        &tmp,
        format!("{}  resources: {{cpus: 2}}\n", vm_yaml("web")),
    )
    .unwrap();
    std::fs::rename(&tmp, dir.join("web.yaml")).unwrap();
    std::fs::remove_file(dir.join("web.yaml~")).unwrap();
    let second = until_applied(&rx, Duration::from_secs(10));
    assert!(
        second.iter().any(|l| l.contains("vm/web configured")),
        "{second:?}"
    );
    assert_eq!(vm(&home, "web").unwrap().spec.resources.cpus, Some(2));
    // Once: no other sync follows the save.
    let more: Vec<String> = rx
        .recv_timeout(Duration::from_secs(3))
        .into_iter()
        .collect();
    assert!(more.is_empty(), "one save, one sync: {more:?}");
    assert_eq!(vm(&home, "web").unwrap().metadata.generation, Some(2));

    // A bad save applies nothing and is said; the next good one applies.
    std::fs::write(dir.join("web.yaml"), "kind: Vm\nmetadata: {name: web}\n").unwrap();
    common::eventually(Duration::from_secs(10), || {
        (source(&home, "desk").status.phase == SourcePhase::Failed).then_some(())
    })
    .expect("the bad save is recorded");
    assert_eq!(vm(&home, "web").unwrap().spec.resources.cpus, Some(2));
    std::fs::write(dir.join("web.yaml"), vm_yaml("web")).unwrap();
    let third = until_applied(&rx, Duration::from_secs(10));
    assert!(
        third.iter().any(|l| l.contains("vm/web configured")),
        "{third:?}"
    );
}

#[test]
fn a_killed_watch_leaves_all_of_a_revision_or_none() {
    let home = Home::new();
    let dir = home.path().join("desk");
    std::fs::create_dir_all(&dir).unwrap();
    let n = 300;
    let mut all = String::new();
    for i in 0..n {
        all.push_str(&vm_yaml(&format!("v{i}")));
        all.push_str("---\n");
    }
    std::fs::write(dir.join("many.yaml"), &all).unwrap();
    let count = |home: &Home| -> usize {
        home.store()
            .list_as::<Vm>(&Default::default())
            .unwrap()
            .len()
    };
    // Kill it at several points of its first sync: each time all of it or none is stored.
    for delay_ms in [50, 150, 400] {
        let mut w = watch(&home, &dir);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = w.0.kill();
        let _ = w.0.wait();
        let c = count(&home);
        assert!(
            c == 0 || c == n,
            "after a kill at {delay_ms} ms: {c} of {n} objects"
        );
    }
    let out = home.ok(&["sync", "--name", "desk", "--once"]);
    assert!(out.contains(&format!("({n} objects")), "{out}");
    assert_eq!(count(&home), n);
    for v in home.store().list_as::<Vm>(&Default::default()).unwrap() {
        assert_eq!(
            v.metadata.generation,
            Some(1),
            "{} applied twice",
            v.metadata.name
        );
    }
    assert_eq!(source(&home, "desk").status.phase, SourcePhase::Synced);
}

#[test]
fn the_example_repository_syncs_and_rolls() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    let repo = Repo::new(&home);
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/gitops-example");
    for f in ["images/golden.yaml", "pools/agents.yaml", "README.md"] {
        repo.write(f, &std::fs::read_to_string(example.join(f)).unwrap());
    }
    repo.commit("the example");
    let out = home.ok(&["sync", repo.url(), "--name", "example"]);
    assert!(
        out.contains("pool/agents created") && out.contains("image/golden.v1 created"),
        "{out}"
    );
    wait_free(&home, "agents", 3, Duration::from_secs(90));

    // A template change in git rolls the pool, at most maxUnavailable (1) member at a time.
    let pool = std::fs::read_to_string(example.join("pools/agents.yaml"))
        .unwrap()
        .replace("cpus: 1, memory: 256Mi", "cpus: 2, memory: 256Mi");
    repo.write("pools/agents.yaml", &pool);
    repo.commit("bigger agents");
    home.ok(&["sync", "--name", "example"]);
    let mut most = 0;
    common::eventually(Duration::from_secs(120), || {
        let p: Pool = home.store().get_as("agents").unwrap()?;
        let replacing = home
            .store()
            .list_as::<boxery_api::PoolMember>(&Default::default())
            .unwrap()
            .iter()
            .filter(|m| m.status.state == boxery_api::pool::MemberState::Replacing)
            .count();
        most = most.max(replacing);
        let seen = p.status.observed_generation >= p.metadata.generation;
        let made = ["agents-0", "agents-1", "agents-2"]
            .iter()
            .all(|n| vm(&home, n).is_some_and(|v| v.spec.resources.cpus == Some(2)));
        (seen && made && p.status.updated == 3 && p.status.free == 3).then_some(())
    })
    .expect("every member is made from the new template");
    assert!(
        most <= 1,
        "{most} members were replaced at once; maxUnavailable is 1"
    );
    for n in ["agents-0", "agents-1", "agents-2"] {
        assert_eq!(vm(&home, n).unwrap().spec.resources.cpus, Some(2), "{n}");
    }
}
