//! What "converged" means, checked against the store and the fake backend's own files.

use std::collections::{BTreeMap, BTreeSet};

use boxery_api::{Image, ImagePhase, RunStrategy, Vm};
use boxery_backends::fake::{FakeBackend, JournalOp};
use boxery_backends::{Backend, PowerState};

/// Every problem found; empty when the world matches the store.
pub async fn problems(home: &super::Home) -> Vec<String> {
    let store = home.store();
    let fake: FakeBackend = home.fake();
    let mut out = Vec::new();
    let vms: Vec<Vm> = store.list_as(&Default::default()).unwrap();
    let images: Vec<Image> = store.list_as(&Default::default()).unwrap();
    let bvms = match fake.list().await {
        Ok(v) => v,
        Err(e) => return vec![format!("backend list failed: {e}")],
    };
    let bimgs = fake.images().await.unwrap();
    let bvm: BTreeMap<&str, _> = bvms.iter().map(|v| (v.name.as_str(), v)).collect();
    let bimg: BTreeMap<&str, _> = bimgs.iter().map(|v| (v.name.as_str(), v)).collect();
    for vm in &vms {
        let n = vm.metadata.name.as_str();
        if vm.metadata.is_deleting() {
            out.push(format!("vm {n} is still being deleted"));
            continue;
        }
        let st = &vm.status;
        if st.created_at.is_none() || st.operation.is_some() {
            out.push(format!(
                "vm {n} not created (phase {:?}, op {:?}, failure {:?})",
                st.phase, st.operation, st.last_failure
            ));
            continue;
        }
        if st.observed_generation != vm.metadata.generation {
            out.push(format!(
                "vm {n} observedGeneration {:?} != generation {:?}",
                st.observed_generation, vm.metadata.generation
            ));
        }
        if let Some(r) = &vm.spec.restore
            && st.last_restore.as_ref().map(|l| l.requested_at) != Some(r.requested_at)
        {
            out.push(format!("vm {n} revert to {} not served", r.image));
        }
        match bvm.get(n) {
            None => out.push(format!("vm {n} missing from the backend")),
            Some(b) => {
                if b.mark != mark_of(&store, &vm.metadata) {
                    out.push(format!(
                        "vm {n} backend mark {:?} != uid {:?}",
                        b.mark, vm.metadata.uid
                    ));
                }
                let want = match vm.spec.run_strategy {
                    RunStrategy::Running => PowerState::Running,
                    RunStrategy::Stopped => PowerState::Stopped,
                    RunStrategy::Suspended => PowerState::Suspended,
                };
                if b.state != want {
                    out.push(format!(
                        "vm {n} is {:?} in the backend, spec wants {want:?}",
                        b.state
                    ));
                }
                let phase_ok = matches!(
                    (want, st.phase),
                    (PowerState::Running, boxery_api::VmPhase::Running)
                        | (PowerState::Stopped, boxery_api::VmPhase::Stopped)
                        | (PowerState::Suspended, boxery_api::VmPhase::Suspended)
                );
                if !phase_ok {
                    out.push(format!(
                        "vm {n} status phase {:?} does not match {want:?}",
                        st.phase
                    ));
                }
            }
        }
    }
    for img in &images {
        let n = img.metadata.name.as_str();
        if img.metadata.is_deleting() {
            out.push(format!("image {n} is still being deleted"));
            continue;
        }
        if img.status.phase != ImagePhase::Ready {
            // A fork's capture of a source that is gone can legitimately wait; everything else must be Ready.
            out.push(format!(
                "image {n} is {:?} ({:?})",
                img.status.phase, img.status.last_failure
            ));
            continue;
        }
        match bimg.get(n) {
            None => out.push(format!("image {n} missing from the backend")),
            Some(b) if b.mark != mark_of(&store, &img.metadata) => out.push(format!(
                "image {n} backend mark {:?} != uid {:?}",
                b.mark, img.metadata.uid
            )),
            _ => {}
        }
    }
    let vm_names: BTreeSet<&str> = vms.iter().map(|v| v.metadata.name.as_str()).collect();
    let img_names: BTreeSet<&str> = images.iter().map(|v| v.metadata.name.as_str()).collect();
    for b in &bvms {
        if !vm_names.contains(b.name.as_str()) {
            out.push(format!(
                "backend vm {} (mark {:?}) has no object",
                b.name, b.mark
            ));
        }
    }
    for b in &bimgs {
        if !img_names.contains(b.name.as_str()) {
            out.push(format!(
                "backend image {} (mark {:?}) has no object",
                b.name, b.mark
            ));
        }
    }
    match fake.leftovers() {
        Ok(l) if !l.is_empty() => out.push(format!("partial files left in the backend: {l:?}")),
        Ok(_) => {}
        Err(e) => out.push(format!("leftovers: {e}")),
    }
    // No VM was created twice: one completed create per uid.
    let mut creates: BTreeMap<String, usize> = BTreeMap::new();
    for e in fake.journal().unwrap() {
        if e.op == JournalOp::Create {
            *creates
                .entry(e.uid.clone().unwrap_or_default())
                .or_default() += 1;
        }
    }
    for (uid, n) in creates {
        if n > 1 {
            out.push(format!("uid {uid} was created {n} times"));
        }
    }
    out
}

/// The mark boxery puts on what it makes for an object of `store`.
fn mark_of(store: &boxery_store::Store, meta: &boxery_api::ObjectMeta) -> Option<String> {
    meta.uid
        .as_deref()
        .map(|u| boxery_backends::mark::mark(u, store.uid()))
}
