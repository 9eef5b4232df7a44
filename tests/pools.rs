//! Pools and leases on the fake backend: concurrent claims have one winner per member;
//! expiry, release and reboot reset members; an expired lease cannot be renewed; killing the
//! control plane during acquires, expiries and resets converges with no member leased twice
//! or stuck; a failing reset marks a member Broken; bad requests are refused or held; a
//! template change replaces free members (`ReplaceWhenFree`), leased ones after their lease,
//! and nothing under `OnCreate`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use boxery_api::lease::LeasePhase;
use boxery_api::pool::{MemberState, MemberStatus, PoolMember};
use boxery_api::{Lease, Pool};
use common::Home;

fn pool_yaml(name: &str, replicas: u32) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n  replicas: {replicas}\n  template:\n    spec:\n      source: {{image: debian-12}}\n"
    )
}

fn make_pool(home: &Home, name: &str, replicas: u32) {
    let f = home.write(&format!("{name}.yaml"), &pool_yaml(name, replicas));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as(name).unwrap()?;
        (p.status.free == replicas).then_some(())
    })
    .unwrap_or_else(|| panic!("pool {name} never had {replicas} free members"));
}

fn leases(home: &Home) -> Vec<Lease> {
    home.store().list_as(&Default::default()).unwrap()
}

/// The member records of `pool`, as rows.
fn members(home: &Home, pool: &str) -> Vec<MemberStatus> {
    home.store()
        .list_as::<PoolMember>(&Default::default())
        .unwrap()
        .iter()
        .filter(|m| m.spec.pool == pool)
        .map(MemberStatus::of)
        .collect()
}

/// The invariants: a Bound lease's VM is a Leased member carrying its uid; no VM is in two
/// Bound leases; the pool's counts match its table.
fn check(home: &Home, pool: &str) -> Result<(), String> {
    let table = members(home, pool);
    let ls = leases(home);
    let mut vms = BTreeSet::new();
    for l in ls.iter().filter(|l| l.status.phase == LeasePhase::Bound) {
        let vm = l.status.vm.clone().ok_or("bound without a vm")?;
        if !vms.insert(vm.clone()) {
            return Err(format!("{vm} is in two bound leases"));
        }
        let m = table
            .iter()
            .find(|m| m.name == vm)
            .ok_or(format!("{vm} is not a member"))?;
        if m.state != MemberState::Leased || m.lease_uid != l.metadata.uid {
            return Err(format!(
                "{vm}: member {:?} lease {:?} does not match lease {}",
                m.state, m.lease, l.metadata.name
            ));
        }
    }
    for m in &table {
        if m.state == MemberState::Leased
            && !ls
                .iter()
                .any(|l| l.metadata.uid == m.lease_uid && l.status.phase == LeasePhase::Bound)
        {
            return Err(format!("{} is Leased by no bound lease", m.name));
        }
    }
    Ok(())
}

#[test]
fn fifty_acquires_on_ten_members() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    make_pool(&home, "p", 10);
    let children: Vec<_> = (0..50)
        .map(|i| {
            home.cmd()
                .args([
                    "lease",
                    "acquire",
                    "p",
                    "--holder",
                    &format!("h{i}"),
                    "--name",
                    &format!("l{i}"),
                ])
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    common::eventually(Duration::from_secs(60), || {
        (leases(&home)
            .iter()
            .filter(|l| l.status.phase == LeasePhase::Bound)
            .count()
            == 10)
            .then_some(())
    })
    .expect("10 bound");
    std::thread::sleep(Duration::from_secs(2));
    let ls = leases(&home);
    assert_eq!(
        ls.iter()
            .filter(|l| l.status.phase == LeasePhase::Bound)
            .count(),
        10,
        "exactly 10 bound"
    );
    assert_eq!(
        ls.iter()
            .filter(|l| l.status.phase == LeasePhase::Pending)
            .count(),
        40,
        "the rest wait"
    );
    check(&home, "p").unwrap();
    // Releasing five lets five waiting leases in, after a reset.
    let bound: Vec<String> = ls
        .iter()
        .filter(|l| l.status.phase == LeasePhase::Bound)
        .map(|l| l.metadata.name.clone())
        .take(5)
        .collect();
    for l in &bound {
        home.ok(&["lease", "release", l]);
    }
    common::eventually(Duration::from_secs(60), || {
        let ls = leases(&home);
        (ls.iter()
            .filter(|l| l.status.phase == LeasePhase::Bound)
            .count()
            == 10
            && ls.len() == 45)
            .then_some(())
    })
    .expect("five more bound after the releases");
    check(&home, "p").unwrap();
}

#[test]
fn expiry_renew_and_reboot() {
    let home = Home::new();
    // A lease second lasts 50 ms here: a 60 s lease expires in 3 s.
    let mut serve = home.serve_env(
        &[],
        &[
            ("BOXERY_LEASE_SECOND_MS", "50"),
            ("BOXERY_BOOT_ID", "boot-a"),
        ],
    );
    make_pool(&home, "e", 3);
    home.ok(&[
        "lease",
        "acquire",
        "e",
        "--ttl",
        "60s",
        "--holder",
        "me",
        "--name",
        "short",
        "--wait",
        "--timeout",
        "30s",
    ]);
    home.ok(&["lease", "renew", "short", "--holder", "me"]);
    // Someone else may not renew it.
    assert_eq!(
        home.run(&["lease", "renew", "short", "--holder", "mallory"])
            .status
            .code(),
        Some(5)
    );
    home.ok(&[
        "wait",
        "lease",
        "short",
        "--for=jsonpath={.status.phase}=Expired",
        "--timeout=30s",
    ]);
    // An expired lease cannot be renewed, and its member goes back to the pool clean.
    assert_eq!(
        home.run(&["lease", "renew", "short", "--holder", "me"])
            .status
            .code(),
        Some(5)
    );
    common::eventually(Duration::from_secs(30), || {
        let p: Pool = home.store().get_as("e").unwrap()?;
        (p.status.free == 3).then_some(())
    })
    .expect("the expired lease's member is free again");
    // A host reboot (a new boot id) voids every lease.
    home.ok(&[
        "lease",
        "acquire",
        "e",
        "--ttl",
        "8h",
        "--holder",
        "a",
        "--name",
        "r1",
        "--wait",
        "--timeout",
        "30s",
    ]);
    home.ok(&[
        "lease",
        "acquire",
        "e",
        "--ttl",
        "8h",
        "--holder",
        "b",
        "--name",
        "r2",
        "--wait",
        "--timeout",
        "30s",
    ]);
    serve.kill();
    let _serve = home.serve_env(&[], &[("BOXERY_BOOT_ID", "boot-b")]);
    for l in ["r1", "r2"] {
        home.ok(&[
            "wait",
            "lease",
            l,
            "--for=jsonpath={.status.phase}=Expired",
            "--timeout=30s",
        ]);
    }
    common::eventually(Duration::from_secs(30), || {
        let p: Pool = home.store().get_as("e").unwrap()?;
        (p.status.free == 3).then_some(())
    })
    .expect("members reset after the reboot");
}

#[test]
fn kills_during_acquire_expiry_and_reset_converge() {
    let home = Home::new();
    let envs = [("BOXERY_LEASE_SECOND_MS", "40")];
    let mut serve = home.serve_env(&[], &envs);
    make_pool(&home, "k", 4);
    let mut n = 0;
    for round in 0..25u64 {
        // A mix: acquire (some short, so they expire), release.
        for _ in 0..3 {
            n += 1;
            let ttl = if n % 3 == 0 { "60s" } else { "8h" };
            let _ = home.run(&[
                "lease",
                "acquire",
                "k",
                "--ttl",
                ttl,
                "--holder",
                "x",
                "--name",
                &format!("k{n}"),
            ]);
        }
        let ls = leases(&home);
        if let Some(l) = ls.iter().find(|l| {
            l.status.phase == LeasePhase::Bound
                && (l.metadata.name.len() + round as usize).is_multiple_of(2)
        }) {
            let _ = home.run(&["lease", "release", &l.metadata.name]);
        }
        std::thread::sleep(Duration::from_millis(50 + (round * 37) % 300));
        serve.kill();
        serve = home.serve_env(&[], &envs);
    }
    // Release everything; every member must come back Free, none stuck or leased twice.
    common::eventually(Duration::from_secs(60), || check(&home, "k").ok())
        .expect("invariants hold");
    for l in leases(&home) {
        let _ = home.run(&["lease", "release", &l.metadata.name]);
    }
    let mut last = String::new();
    let ok = common::eventually(Duration::from_secs(90), || {
        let p: Pool = home.store().get_as("k").unwrap()?;
        last = format!(
            "members {:?}; leases {:?}",
            members(&home, "k")
                .iter()
                .map(|m| (m.name.clone(), m.state, m.lease.clone(), m.message.clone()))
                .collect::<Vec<_>>(),
            leases(&home)
                .iter()
                .map(|l| (
                    l.metadata.name.clone(),
                    l.status.phase,
                    l.status.vm.clone(),
                    l.metadata.deletion_timestamp.is_some()
                ))
                .collect::<Vec<_>>()
        );
        (p.status.free == 4 && leases(&home).is_empty()).then_some(())
    });
    if ok.is_none() {
        let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let keep = std::env::temp_dir().join("boxery-kills-failed");
        let _ = std::fs::remove_dir_all(&keep);
        let _ = std::process::Command::new("cp")
            .arg("-a")
            .arg(home.path())
            .arg(&keep)
            .status();
        panic!(
            "members not all free: {last}\nserve log, last lines first:\n{}\n(home kept in {})",
            tail.join("\n"),
            keep.display()
        );
    }
}

#[test]
fn failing_reset_marks_broken_and_bad_requests() {
    let home = Home::new();
    let fake = home.fake();
    let _serve = home.serve(&[]);
    make_pool(&home, "b", 2);
    home.ok(&[
        "lease",
        "acquire",
        "b",
        "--holder",
        "me",
        "--name",
        "doomed",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let vm = leases(&home)[0].status.vm.clone().unwrap();
    // pool rm of a leased member is refused.
    let out = home.run(&["pool", "add", "b", &vm]);
    assert!(out.status.success());
    assert_eq!(home.run(&["pool", "rm", "b", &vm]).status.code(), Some(5));
    // Every reimage fails: the reset fails and the member is Broken.
    use boxery_backends::fake::{FaultAction, FaultConfig, FaultRule};
    fake.set_faults(&FaultConfig::rules([FaultRule::new(
        "reimage.swap",
        FaultAction::Fail,
    )]))
    .unwrap();
    home.ok(&["lease", "release", "doomed"]);
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("b").unwrap()?;
        (p.status.broken == 1).then_some(())
    })
    .expect("the member is Broken");
    fake.clear_faults().unwrap();
    let m = members(&home, "b")
        .into_iter()
        .find(|m| m.name == vm)
        .unwrap();
    assert!(m.message.contains("reset failed"), "{}", m.message);
    // Bad requests.
    assert_eq!(
        home.run(&["lease", "acquire", "b", "--ttl", "10s"])
            .status
            .code(),
        Some(2),
        "duration out of range"
    );
    let bad_key = home.write("bad.yaml", "apiVersion: boxery.dev/v1alpha1\nkind: Lease\nmetadata: {name: bad}\nspec: {pool: b, holderIdentity: me, publicKey: not-a-key}\n");
    let out = home.run(&["apply", "-f", bad_key.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.publicKey"));
    home.ok(&["lease", "acquire", "nope", "--name", "orphan"]);
    home.ok(&[
        "wait",
        "lease",
        "orphan",
        "--for=condition=Ready=False",
        "--timeout=30s",
    ]);
    assert!(
        home.ok(&["describe", "lease", "orphan"])
            .contains("PoolNotFound")
    );
}

fn template_pool_yaml(name: &str, replicas: u32, cpus: u32, strategy: &str) -> String {
    format!(
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n  replicas: {replicas}\n  updateStrategy: {strategy}\n  template:\n    spec:\n      source: {{image: debian-12}}\n      resources: {{cpus: {cpus}}}\n"
    )
}

fn apply_pool(home: &Home, name: &str, replicas: u32, cpus: u32, strategy: &str) {
    let f = home.write(
        &format!("{name}.yaml"),
        &template_pool_yaml(name, replicas, cpus, strategy),
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
}

/// Each member VM's uid and cpus.
fn member_vms(home: &Home, pool: &str) -> std::collections::BTreeMap<String, (String, u32)> {
    members(home, pool)
        .iter()
        .filter_map(|m| {
            let vm: boxery_api::Vm = home.store().get_as(&m.name).unwrap()?;
            Some((
                m.name.clone(),
                (
                    vm.metadata.uid.clone().unwrap_or_default(),
                    vm.spec.resources.cpus.unwrap_or_default(),
                ),
            ))
        })
        .collect()
}

#[test]
fn template_change_replaces_free_members_and_leased_ones_after_release() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    apply_pool(&home, "u", 3, 1, "ReplaceWhenFree");
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("u").unwrap()?;
        (p.status.free == 3 && p.status.updated == 3).then_some(())
    })
    .expect("3 free members, all on the current template");
    home.ok(&[
        "lease",
        "acquire",
        "u",
        "--holder",
        "me",
        "--name",
        "held",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let held: String = leases(&home)[0].status.vm.clone().unwrap();
    let before = member_vms(&home, "u");
    assert_eq!(before.len(), 3);
    assert!(before.values().all(|(_, cpus)| *cpus == 1), "{before:?}");

    // Change the template: the two free members are replaced, one at a time
    // (max(1, 3/4) = 1), and the leased one is not touched.
    apply_pool(&home, "u", 3, 2, "ReplaceWhenFree");
    let mut most_replacing = 0;
    let mut last = String::new();
    let replaced = common::eventually(Duration::from_secs(90), || {
        let p: Pool = home.store().get_as("u").unwrap()?;
        let replacing = members(&home, "u")
            .iter()
            .filter(|m| m.state == MemberState::Replacing)
            .count();
        most_replacing = most_replacing.max(replacing);
        let now = member_vms(&home, "u");
        last = format!("{:?} {now:?}", members(&home, "u"));
        let done = now.len() == 3
            && now.iter().all(|(name, (uid, cpus))| {
                if *name == held {
                    *uid == before[name].0 && *cpus == 1
                } else {
                    *uid != before[name].0 && *cpus == 2
                }
            })
            && p.status.free == 2
            && p.status.updated == 2;
        done.then_some(())
    });
    assert!(replaced.is_some(), "free members not replaced: {last}");
    assert!(most_replacing <= 1, "at most one member replaced at a time");
    // Still leased, still the same VM, a while later.
    std::thread::sleep(Duration::from_secs(2));
    let m = members(&home, "u")
        .into_iter()
        .find(|m| m.name == held)
        .unwrap();
    assert_eq!(m.state, MemberState::Leased);
    assert_eq!(member_vms(&home, "u")[&held], before[&held]);
    check(&home, "u").unwrap();
    let out = home.ok(&["get", "pool", "u"]);
    assert!(out.contains("UP-TO-DATE"), "{out}");

    // Released: the leased member is replaced instead of reset, and every member is free on
    // the new template.
    home.ok(&["lease", "release", "held", "--wait"]);
    let done = common::eventually(Duration::from_secs(90), || {
        let p: Pool = home.store().get_as("u").unwrap()?;
        let now = member_vms(&home, "u");
        last = format!("{:?} {now:?}", members(&home, "u"));
        (p.status.free == 3
            && p.status.updated == 3
            && now[&held].0 != before[&held].0
            && now.values().all(|(_, cpus)| *cpus == 2))
        .then_some(())
    });
    assert!(
        done.is_some(),
        "the released member was not replaced: {last}"
    );
    // A lease on the new template works.
    home.ok(&[
        "lease",
        "acquire",
        "u",
        "--holder",
        "me",
        "--name",
        "next",
        "--wait",
        "--timeout",
        "30s",
    ]);
    check(&home, "u").unwrap();
}

#[test]
fn on_create_replaces_nothing() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    apply_pool(&home, "o", 2, 1, "OnCreate");
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("o").unwrap()?;
        (p.status.free == 2).then_some(())
    })
    .expect("2 free members");
    let before = member_vms(&home, "o");
    apply_pool(&home, "o", 2, 2, "OnCreate");
    // The pool sees the change (it counts no member on the new template) and replaces nothing.
    common::eventually(Duration::from_secs(30), || {
        let p: Pool = home.store().get_as("o").unwrap()?;
        (p.status.observed_generation == p.metadata.generation && p.status.updated == 0)
            .then_some(())
    })
    .expect("no member on the new template");
    std::thread::sleep(Duration::from_secs(3));
    let p: Pool = home.store().get_as("o").unwrap().unwrap();
    assert_eq!(p.status.free, 2);
    assert_eq!(member_vms(&home, "o"), before, "no member replaced");
    // Only a member made after the change gets the new template.
    apply_pool(&home, "o", 3, 2, "OnCreate");
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("o").unwrap()?;
        (p.status.free == 3 && p.status.updated == 1).then_some(())
    })
    .expect("a third member, on the new template");
    let now = member_vms(&home, "o");
    assert_eq!(now["o-2"].1, 2);
    assert_eq!(now["o-0"], before["o-0"]);
    assert_eq!(now["o-1"], before["o-1"]);
}

/// `lease acquire` without `--ttl` asks for the pool's `spec.lease.defaultTtlSeconds` (cut to
/// its `maxTtlSeconds`); `--ttl` wins.
#[test]
fn a_lease_without_ttl_lasts_the_pools_default() {
    let home = Home::new();
    let pool = |name: &str, default: u32, max: u32| {
        format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n  replicas: 0\n  lease: {{defaultTtlSeconds: {default}, maxTtlSeconds: {max}}}\n"
        )
    };
    let f = home.write(
        "pools.yaml",
        &format!(
            "{}---\n{}",
            pool("short", 600, 28800),
            pool("capped", 3600, 900)
        ),
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let duration = |lease: &str| -> u32 {
        let l: Lease = home.store().get_as(lease).unwrap().unwrap();
        l.spec.lease_duration_seconds
    };
    home.ok(&["lease", "acquire", "short", "--name", "a"]);
    assert_eq!(duration("a"), 600, "the pool's default");
    home.ok(&["lease", "acquire", "short", "--name", "b", "--ttl", "5m"]);
    assert_eq!(duration("b"), 300, "--ttl wins");
    home.ok(&["lease", "acquire", "capped", "--name", "c"]);
    assert_eq!(
        duration("c"),
        900,
        "a default above the ceiling is cut to it"
    );
    home.ok(&["lease", "acquire", "nosuchpool", "--name", "d"]);
    assert_eq!(duration("d"), 1800, "no pool: 30 minutes");
}

fn vm_exists(home: &Home, name: &str) -> bool {
    home.store()
        .get_as::<boxery_api::Vm>(name)
        .unwrap()
        .is_some()
}

fn lease_phase(home: &Home, name: &str) -> LeasePhase {
    let l: Lease = home.store().get_as(name).unwrap().unwrap();
    l.status.phase
}

fn events_of(home: &Home, kind: &str, name: &str) -> String {
    home.ok(&["describe", kind, name])
}

/// Pruning a Pool whose file was removed (`apply -f DIR --prune -l …`) with one member leased:
/// the free member goes at once, the leased one (and the Pool) stay until the lease ends, and
/// the lease stays Bound on a VM that exists. Then everything goes, leaving no member record.
#[test]
fn pruning_a_pool_waits_for_its_leases() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    let dir = home.path().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    let labelled = |name: &str, replicas: u32| {
        format!(
            "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}, labels: {{app: t}}}}\nspec:\n  replicas: {replicas}\n  template:\n    spec:\n      source: {{image: debian-12}}\n"
        )
    };
    std::fs::write(dir.join("pr.yaml"), labelled("pr", 2)).unwrap();
    std::fs::write(dir.join("keep.yaml"), labelled("keep", 0)).unwrap();
    let d = dir.to_str().unwrap();
    home.ok(&["apply", "-f", d, "--prune", "-l", "app=t"]);
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("pr").unwrap()?;
        (p.status.free == 2).then_some(())
    })
    .expect("2 free members");
    home.ok(&[
        "lease",
        "acquire",
        "pr",
        "--holder",
        "me",
        "--name",
        "held",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let held: String = leases(&home)[0].status.vm.clone().unwrap();
    let free = if held == "pr-0" { "pr-1" } else { "pr-0" };

    std::fs::remove_file(dir.join("pr.yaml")).unwrap();
    home.ok(&["apply", "-f", d, "--prune", "-l", "app=t"]);
    common::eventually(Duration::from_secs(30), || {
        (!vm_exists(&home, free)).then_some(())
    })
    .expect("the free member's VM is deleted");
    std::thread::sleep(Duration::from_secs(3));
    assert!(vm_exists(&home, &held), "the leased member's VM must stay");
    assert!(
        home.fake().vm_record(&held).unwrap().is_some(),
        "the leased VM is still in the backend"
    );
    assert_eq!(lease_phase(&home, "held"), LeasePhase::Bound);
    let p: Pool = home.store().get_as("pr").unwrap().expect("the pool waits");
    assert!(p.metadata.is_deleting());
    check(&home, "pr").unwrap();
    let described = events_of(&home, "pool", "pr");
    assert!(described.contains("MemberRemov"), "the removal is told");
    // `describe pool` lists the members from their records: the held one, and who holds it.
    let row = described
        .lines()
        .find(|l| l.trim_start().starts_with(held.as_str()))
        .unwrap_or_else(|| panic!("no member row for {held}: {described}"));
    assert!(
        row.contains("Leased") && row.contains("held"),
        "the member row names its state and lease: {row}"
    );

    // The lease ends: the member, its VM and the pool go; nothing is left behind.
    home.ok(&["lease", "release", "held", "--wait"]);
    common::eventually(Duration::from_secs(60), || {
        (home.store().get_as::<Pool>("pr").unwrap().is_none()
            && !vm_exists(&home, &held)
            && members(&home, "pr").is_empty())
        .then_some(())
    })
    .expect("the pool, its member and its VM are gone after the release");
    assert!(home.store().get_as::<Pool>("keep").unwrap().is_some());
}

/// A leased VM deleted on its own waits for its lease; `--force` ends the lease first (Lost,
/// with an event); a VM that vanishes without either makes its lease Lost, never Bound.
#[test]
fn a_lease_never_outlives_its_vm() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    make_pool(&home, "g", 3);
    for l in ["a", "b"] {
        home.ok(&[
            "lease",
            "acquire",
            "g",
            "--holder",
            "me",
            "--name",
            l,
            "--wait",
            "--timeout",
            "30s",
        ]);
    }
    let vm_of = |l: &str| -> String {
        let l: Lease = home.store().get_as(l).unwrap().unwrap();
        l.status.vm.unwrap()
    };
    let (va, vb) = (vm_of("a"), vm_of("b"));

    // Deleting a leased VM waits for the lease.
    home.ok(&["delete", "vm", &va]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        vm_exists(&home, &va),
        "a leased VM stays until its lease ends"
    );
    assert_eq!(lease_phase(&home, "a"), LeasePhase::Bound);
    assert!(events_of(&home, "vm", &va).contains("WaitingForLease"));
    home.ok(&["lease", "release", "a"]);
    common::eventually(Duration::from_secs(30), || {
        let vm: Option<boxery_api::Vm> = home.store().get_as(&va).unwrap();
        // Gone, then made again from the template (a new uid) as a free member.
        vm.is_none_or(|v| !v.metadata.is_deleting()).then_some(())
    })
    .expect("the VM goes once its lease is released");

    // --force ends the lease first, with an event.
    let out = home.run(&["delete", "vm", &vb, "--force"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(lease_phase(&home, "b"), LeasePhase::Lost);
    assert!(events_of(&home, "lease", "b").contains("ForceDeleted"));
    assert_eq!(
        home.run(&["lease", "renew", "b", "--holder", "me"])
            .status
            .code(),
        Some(5),
        "a lost lease cannot be renewed"
    );

    // A VM that vanishes from the store without either (its finalizer dropped by hand): the
    // lease controller makes its lease Lost.
    home.ok(&[
        "lease",
        "acquire",
        "g",
        "--holder",
        "me",
        "--name",
        "c",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let vc = vm_of("c");
    let store = home.store();
    let mut v = store.get("Vm", &vc).unwrap().unwrap();
    v.metadata.finalizers.clear();
    store.update(v).unwrap();
    store.delete("Vm", &vc).unwrap();
    home.ok(&[
        "wait",
        "lease",
        "c",
        "--for=jsonpath={.status.phase}=Lost",
        "--timeout=30s",
    ]);
    assert!(events_of(&home, "lease", "c").contains("VmLost"));
    // Released, the lost leases leave no member held: the invariants hold and the members
    // that still have their VMs are free again. (The VM dropped by hand above left its
    // backend VM behind, which inventory handles; that member's healing is not this test's.)
    for l in ["b", "c"] {
        home.ok(&["lease", "release", l]);
    }
    let mut last = String::new();
    let healed = common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("g").unwrap()?;
        let table = members(&home, "g");
        last = format!("{table:?}");
        (p.status.free >= 2
            && table
                .iter()
                .all(|m| m.state == MemberState::Free || m.name == vc)
            && table.iter().all(|m| m.lease.is_none())
            && check(&home, "g").is_ok())
        .then_some(())
    });
    assert!(healed.is_some(), "members free again: {last}");
}

/// Scaling a pool down removes its free members' VMs (with events); the leased member stays
/// until its lease ends, then goes too; scaling up makes fresh members and leaves no VM of
/// the pool outside it.
#[test]
fn scale_down_removes_free_members_and_leased_ones_after_their_lease() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    make_pool(&home, "s", 3);
    home.ok(&[
        "lease",
        "acquire",
        "s",
        "--holder",
        "me",
        "--name",
        "keep",
        "--wait",
        "--timeout",
        "30s",
    ]);
    let held: String = leases(&home)[0].status.vm.clone().unwrap();
    let f = home.write("s.yaml", &pool_yaml("s", 0));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let others: Vec<String> = ["s-0", "s-1", "s-2"]
        .iter()
        .map(|s| s.to_string())
        .filter(|n| *n != held)
        .collect();
    // The VMs go first; each record goes at the pool's next pass after its VM (a Removing
    // record may outlive its VM for a moment).
    let mut last = String::new();
    common::eventually(Duration::from_secs(30), || {
        last = format!("{:?}", members(&home, "s"));
        (others.iter().all(|n| !vm_exists(&home, n))
            && members(&home, "s").len() == 1
            && check(&home, "s").is_ok())
        .then_some(())
    })
    .unwrap_or_else(|| panic!("the free members' VMs and records are deleted: {last}"));
    let p: Pool = home.store().get_as("s").unwrap().unwrap();
    assert!(vm_exists(&home, &held));
    assert_eq!(lease_phase(&home, "keep"), LeasePhase::Bound);
    check(&home, "s").unwrap();
    let ev = events_of(&home, "pool", "s");
    assert!(ev.contains("MemberRemoved"), "{ev}");
    assert_eq!(p.status.leased, 1);

    home.ok(&["lease", "release", "keep", "--wait"]);
    common::eventually(Duration::from_secs(30), || {
        (!vm_exists(&home, &held) && members(&home, "s").is_empty()).then_some(())
    })
    .expect("the leased member goes when its lease ends");

    // Scale up again: fresh members, and every VM labelled with the pool is a member.
    let f = home.write("s.yaml", &pool_yaml("s", 2));
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    common::eventually(Duration::from_secs(60), || {
        let p: Pool = home.store().get_as("s").unwrap()?;
        (p.status.free == 2).then_some(())
    })
    .expect("2 free members");
    let labelled: Vec<String> = home
        .store()
        .list_as::<boxery_api::Vm>(&"boxery.dev/pool=s".parse().unwrap())
        .unwrap()
        .into_iter()
        .map(|v| v.metadata.name)
        .collect();
    assert_eq!(labelled, ["s-0", "s-1"]);
    let owned = home
        .store()
        .list_as::<boxery_api::Vm>(&Default::default())
        .unwrap()
        .into_iter()
        .filter(|v| v.metadata.owner_references.iter().any(|o| o.kind == "Pool"))
        .count();
    assert_eq!(owned, 2, "no VM of the pool left outside it");
}

/// A pool stored before per-member records (its member table in `status.members`) is moved
/// to records by the first reconcile: a lease bound before the upgrade stays bound on the
/// same member, the free member stays free, and both keep working.
#[test]
fn a_member_table_from_before_moves_to_records() {
    let home = Home::new();
    let mut serve = home.serve(&[]);
    make_pool(&home, "old", 2);
    home.ok(&[
        "lease",
        "acquire",
        "old",
        "--holder",
        "me",
        "--name",
        "kept",
        "--wait",
        "--timeout",
        "30s",
    ]);
    serve.kill();
    // Rewrite the store as an older boxery left it: the table in the pool, no records.
    let store = home.store();
    let before = members(&home, "old");
    assert_eq!(before.len(), 2);
    let mut p: Pool = store.get_as("old").unwrap().unwrap();
    p.status.members = before.clone();
    store.update_status_as(&p).unwrap();
    for m in &before {
        store.delete("PoolMember", &m.name).unwrap();
    }
    assert!(members(&home, "old").is_empty());

    let _serve = home.serve(&[]);
    common::eventually(Duration::from_secs(30), || {
        let p: Pool = home.store().get_as("old").unwrap()?;
        (p.status.members.is_empty() && members(&home, "old").len() == 2).then_some(())
    })
    .expect("the table is moved to records");
    let after = members(&home, "old");
    let held = after
        .iter()
        .find(|m| m.lease.as_deref() == Some("kept"))
        .unwrap();
    let was = before.iter().find(|m| m.name == held.name).unwrap();
    assert_eq!(held.state, MemberState::Leased);
    assert_eq!(held.generation, was.generation, "the fence is kept");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(lease_phase(&home, "kept"), LeasePhase::Bound);
    check(&home, "old").unwrap();
    // Both members work after the move.
    home.ok(&[
        "lease",
        "acquire",
        "old",
        "--holder",
        "me",
        "--name",
        "new",
        "--wait",
        "--timeout",
        "30s",
    ]);
    check(&home, "old").unwrap();
    home.ok(&["lease", "release", "kept", "--wait"]);
    common::eventually(Duration::from_secs(30), || {
        let p: Pool = home.store().get_as("old").unwrap()?;
        (p.status.free == 1 && p.status.leased == 1).then_some(())
    })
    .expect("the released member is free again");
}

/// Issue 30: a Pool asking for `replicas` with no template to make them from was accepted
/// and said Ready and Healthy with no member. It is refused wherever it would be written
/// (apply, scale), saying what to add; a pool of adopted members only (replicas 0) is fine.
#[test]
fn a_pool_without_a_template_cannot_ask_for_replicas() {
    let home = Home::new();
    let f = home.write(
        "p.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: p}\nspec:\n  replicas: 2\n",
    );
    let o = home.run(&["apply", "-f", f.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("spec.replicas") && err.contains("add spec.template"),
        "{err}"
    );
    assert!(home.store().get_as::<Pool>("p").unwrap().is_none());
    // Adopted members only, then scaled: refused the same way; the pool stays as it was.
    home.ok(&["new", "pet"]);
    let f = home.write(
        "q.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: q}\nspec:\n  members: [{name: pet}]\n",
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    let o = home.run(&["scale", "pool", "q", "--replicas", "2"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("add spec.template"), "{err}");
    let q: Pool = home.store().get_as("q").unwrap().unwrap();
    assert_eq!(q.spec.replicas, 0);
}

/// `pool ls` prints the pool's counts and its members: a claim shows in the counts within a
/// couple of seconds, as in the member list (issue 30, class 1: the counts lagged a minute).
#[test]
fn pool_counts_follow_a_claim_within_seconds() {
    let home = Home::new();
    let _serve = home.serve(&[]);
    make_pool(&home, "p", 1);
    home.ok(&["lease", "acquire", "p", "--holder", "h", "--name", "l1"]);
    let start = std::time::Instant::now();
    let seen = common::eventually(Duration::from_secs(5), || {
        let ls = home.ok(&["pool", "ls"]);
        (ls.contains("1 members, 0 free, 1 leased") && ls.contains("Leased")).then_some(ls)
    });
    let ls = home.ok(&["pool", "ls"]);
    assert!(
        seen.is_some(),
        "the counts never followed the claim within 5 s: {ls}"
    );
    eprintln!("counts right after {:?}", start.elapsed());
    // Released: the member is reset and free again, and the counts say so.
    home.ok(&["lease", "release", "l1"]);
    common::eventually(Duration::from_secs(10), || {
        let ls = home.ok(&["pool", "ls"]);
        (ls.contains("1 members, 1 free, 0 leased") && ls.contains("Free")).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the counts never followed the release: {}",
            home.ok(&["pool", "ls"])
        )
    });
}

/// Budgets are judged wherever the controllers run. With no `serve`, a `wait` runs them in
/// its own process, the usage sampler with them, and a lease past its budget turns
/// `BudgetExhausted` there. (CI once waited 5 minutes for it: a `serve` that lost the lead to
/// such a wait left nothing sampling, as a wait's controllers had no sampler.)
#[test]
fn a_wait_without_serve_judges_a_lease_budget() {
    let home = Home::new();
    // 0.001 vCPU-hours is 3.6 vCPU-seconds: one 10 s sample of a 2-CPU VM is past it.
    let f = home.write(
        "bp.yaml",
        "apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {name: bp}\nspec:\n  replicas: 1\n  lease:\n    defaultTtlSeconds: 1800\n    maxTtlSeconds: 3600\n    budget: {vcpuHours: 0.001}\n  template:\n    spec:\n      source: {image: debian-12}\n      resources: {cpus: 2}\n",
    );
    home.ok(&["apply", "-f", f.to_str().unwrap()]);
    home.ok(&[
        "lease",
        "acquire",
        "bp",
        "--holder",
        "agent-1",
        "--name",
        "lb",
        "--wait",
        "--timeout",
        "60s",
    ]);
    let t = std::time::Instant::now();
    home.ok(&[
        "wait",
        "lease",
        "lb",
        "--for=condition=BudgetExhausted",
        "--timeout=60s",
    ]);
    eprintln!(
        "BudgetExhausted {:.1} s into the wait that ran the controllers",
        t.elapsed().as_secs_f64()
    );
    let l: Lease = home.store().get_as("lb").unwrap().unwrap();
    let used = l.status.usage.as_ref().map(|u| u.vcpu_hours);
    assert!(used.is_some_and(|u| u >= 0.001), "{:?}", l.status);
}
