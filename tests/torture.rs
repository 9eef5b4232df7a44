//! Crash-recovery torture: a real `boxery serve` on the fake backend is SIGKILLed at random
//! moments (seeded) while a mix of create / snapshot / fork / revert / stop / start / delete is
//! driven through the CLI, and sometimes while a backend step hangs on an injected fault. After
//! the last restart everything must converge: every object matches its spec (or is gone), no
//! backend VM or image exists without its object, nothing was lost, nothing created twice.
//!
//! `BOXERY_TORTURE_SEED=N` reruns one seed; `BOXERY_TORTURE_KILLS=N` sets kills per seed.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use boxery_backends::fake::{FaultAction, FaultConfig, FaultRule};
use common::{Home, invariants};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

mod model {
    #[derive(Debug, Clone, Default)]
    pub struct Vm {
        pub snaps: Vec<String>,
    }
}

const HANG_STEPS: &[&str] = &[
    "create.begin",
    "create.disk",
    "create.commit",
    "capture.begin",
    "capture.copy",
    "capture.commit",
    "reimage.stage",
    "reimage.swap",
    "remove",
    "start",
    "stop",
    "remove_image",
    "cleanup_new",
];

fn kills() -> usize {
    std::env::var("BOXERY_TORTURE_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(70)
}

fn torture(seed: u64) {
    let seed = std::env::var("BOXERY_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    eprintln!("torture seed {seed}, {} kills", kills());
    let home = Home::new();
    let fake = home.fake();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut vms: BTreeMap<String, model::Vm> = BTreeMap::new();
    let mut next = 0u32;
    let mut serve = home.serve(&[]);
    let mut hangs = 0;
    for kill in 0..kills() {
        for _ in 0..rng.random_range(1..=4) {
            let names: Vec<String> = vms.keys().cloned().collect();
            let pick = |rng: &mut StdRng| names[rng.random_range(0..names.len())].clone();
            let roll = rng.random_range(0..100);
            if names.is_empty() || (roll < 25 && names.len() < 8) {
                next += 1;
                let n = format!("vm{next}");
                home.ok(&["new", &n]);
                vms.insert(n, model::Vm::default());
            } else if roll < 40 {
                let v = pick(&mut rng);
                next += 1;
                let label = format!("s{next}");
                if home.run(&["snap", &v, &label]).status.success() {
                    vms.get_mut(&v).unwrap().snaps.push(label);
                }
            } else if roll < 50 && names.len() < 8 {
                let v = pick(&mut rng);
                next += 1;
                let n = format!("vm{next}");
                home.ok(&["fork", &v, &n]);
                vms.insert(n, model::Vm::default());
            } else if roll < 62 {
                let v = pick(&mut rng);
                let snaps = vms[&v].snaps.clone();
                if let Some(l) = snaps.last() {
                    home.ok(&["revert", &v, l]);
                }
            } else if roll < 72 {
                let v = pick(&mut rng);
                home.ok(&["stop", &v]);
            } else if roll < 84 {
                let v = pick(&mut rng);
                home.ok(&["start", &v]);
            } else if roll < 94 {
                let v = pick(&mut rng);
                // A fork whose source is deleted before its capture would wait forever: only
                // delete VMs no pending fork depends on (the CLI would refuse nothing here).
                let forks_pending = home
                    .store()
                    .list_as::<boxery_api::Vm>(&Default::default())
                    .unwrap()
                    .iter()
                    .any(|f| {
                        f.status.created_at.is_none()
                            && matches!(&f.spec.source, boxery_api::VmSource::Vm(s) if *s == v)
                    });
                if !forks_pending {
                    home.ok(&["rm", &v]);
                    vms.remove(&v);
                }
            } else {
                let v = pick(&mut rng);
                let snaps = vms[&v].snaps.clone();
                if snaps.len() > 1 {
                    let img = format!("{v}.{}", snaps[0]);
                    home.ok(&["delete", "image", &img]);
                    vms.get_mut(&v).unwrap().snaps.remove(0);
                }
            }
        }
        // Sometimes make the next call of a backend step hang, so the kill lands inside it.
        if rng.random_bool(0.35) {
            let step = HANG_STEPS[rng.random_range(0..HANG_STEPS.len())];
            fake.set_faults(&FaultConfig::rules([FaultRule::new(
                step,
                FaultAction::Hang,
            )
            .nth(1)]))
                .unwrap();
            hangs += 1;
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..350)));
        assert!(
            serve.alive(),
            "serve died on its own before kill {kill}: see {}",
            serve.log.display()
        );
        serve.kill();
        fake.clear_faults().unwrap();
        serve = home.serve(&[]);
    }
    eprintln!(
        "{} kills ({hangs} with a hung backend step), {} VMs live; converging",
        kills(),
        vms.len()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut last = Vec::new();
    let ok = common::eventually(Duration::from_secs(120), || {
        last = rt.block_on(invariants::problems(&home));
        last.is_empty().then_some(())
    });
    assert!(
        ok.is_some(),
        "seed {seed}: did not converge within 120 s:\n{}\nserve log: {}",
        last.join("\n"),
        std::fs::read_to_string(&serve.log)
            .unwrap_or_default()
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Nothing was lost: every VM the driver made and did not delete is still there.
    let store = home.store();
    for n in vms.keys() {
        assert!(
            store.get("Vm", n).unwrap().is_some(),
            "seed {seed}: vm {n} was lost"
        );
    }
    let live: Vec<String> = store
        .list_as::<boxery_api::Vm>(&Default::default())
        .unwrap()
        .into_iter()
        .map(|v| v.metadata.name)
        .collect();
    assert_eq!(
        live,
        vms.keys().cloned().collect::<Vec<_>>(),
        "seed {seed}: the store's VMs differ from what was asked"
    );
    assert!(serve.alive(), "serve died during convergence");
}

#[test]
fn torture_seed_1() {
    torture(1);
}

#[test]
fn torture_seed_2() {
    torture(2);
}

#[test]
fn torture_seed_3() {
    torture(3);
}
