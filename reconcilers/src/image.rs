//! The `Image` reconciler: capture a VM's disk, build the stock image, or import a file; delete
//! behind a finalizer.
//!
//! # Guarantees
//! - The intent (`status.operation`) is recorded before a capture or build starts. A reconcile
//!   that finds one at its start runs the backend's `recover_capture` (cancel jobs, restore the
//!   source VM's power state, remove the partial image) or `cleanup_image`, then retries.
//! - A capture holds the source VM's lock, so it never overlaps a start, stop or reimage.
//! - Images are immutable: once `Ready`, spec changes are ignored (and reported).

use std::sync::Arc;
use std::time::Duration;

use boxery_api::vm::{Operation, OperationType};
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, Resource, Vm, now,
};
use boxery_backends::PowerState;
use boxery_controller::{Action, ensure_finalizer, remove_finalizer};

use crate::context::Ctx;
use crate::error::ReconcileError;

/// The Image finalizer.
pub const FINALIZER: &str = boxery_api::meta::finalizers::IMAGE;

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

fn save(ctx: &Ctx, img: &Image) -> Result<Image> {
    Ok(ctx.store.update_status_as(img)?)
}

/// The one word `boxery get` shows.
pub fn printable(img: &Image) -> String {
    if img.metadata.is_deleting() {
        return "Terminating".into();
    }
    if img.status.phase == ImagePhase::Pending
        && let Some(c) = img.status.conditions.get_condition("Ready")
        && c.status == ConditionStatus::False
        && !c.reason.is_empty()
    {
        return c.reason.clone();
    }
    if img.status.phase == ImagePhase::Failed && img.status.last_failure.is_some() {
        return "ErrorBackoff".into();
    }
    format!("{:?}", img.status.phase)
}

/// Reconcile one Image.
pub async fn reconcile(img: Arc<Image>, ctx: Arc<Ctx>) -> Result<Action> {
    let Some(img) = ctx.store.get_as::<Image>(img.name())? else {
        return Ok(Action::await_change());
    };
    if let Some(wait) = crate::backoff::remaining(
        img.status.failures,
        img.status.last_failure.as_ref(),
        img.status.observed_generation,
        img.metadata.generation,
        img.metadata.deletion_timestamp,
    ) {
        return Ok(Action::requeue(wait));
    }
    let name = img.name().to_string();
    let source_vm = match &img.spec.source {
        ImageSource::Vm(v) => Some(v.clone()),
        _ => None,
    };
    let lock = source_vm.as_ref().map(|v| ctx.vm_lock(v));
    let _guard = match &lock {
        Some(l) => Some(l.lock().await),
        None => None,
    };
    let res = step(img, &ctx).await;
    if let Err(e) = &res {
        if !e.is_conflict()
            && let Ok(Some(mut cur)) = ctx.store.get_as::<Image>(&name)
        {
            let r = e.recorded();
            cur.status.failures += 1;
            cur.status.last_failure = Some(r.failure);
            if cur.status.phase != ImagePhase::Ready && !cur.metadata.is_deleting() {
                cur.status.phase = ImagePhase::Failed;
            }
            let generation = cur.metadata.generation;
            cur.status.observed_generation = generation;
            cur.status.conditions.set_condition(
                "Ready",
                ConditionStatus::False,
                r.reason,
                &r.message,
                generation,
            );
            cur.status.printable_status = Some(printable(&cur));
            let _ = ctx.store.update_status_as(&cur);
            ctx.event(&cur, EventType::Warning, "StepFailed", &r.message);
        }
        tracing::warn!(object = %format!("Image/{name}"), error = %e.chain(), "reconcile failed");
    }
    res
}

async fn step(mut img: Image, ctx: &Ctx) -> Result<Action> {
    let name = img.name().to_string();
    let obj = format!("Image/{name}");
    let generation = img.metadata.generation;

    if img.metadata.is_deleting() {
        if !img.metadata.has_finalizer(FINALIZER) {
            return Ok(Action::await_change());
        }
        if img.status.phase != ImagePhase::Terminating {
            img.status.phase = ImagePhase::Terminating;
            img.status.printable_status = Some("Terminating".into());
            img = save(ctx, &img)?;
        }
        if let Some(op) = &img.status.operation
            && op.type_ == OperationType::Capture
            && let ImageSource::Vm(v) = &img.spec.source
        {
            let orig = original_state(op);
            ctx.backend
                .recover_capture(v, &name, orig)
                .await
                .map_err(|e| ReconcileError::backend("recover_capture", &obj, e))?;
        }
        ctx.backend
            .remove_image(&name)
            .await
            .map_err(|e| ReconcileError::backend("remove_image", &obj, e))?;
        ctx.backend
            .cleanup_image(&name)
            .await
            .map_err(|e| ReconcileError::backend("cleanup_image", &obj, e))?;
        remove_finalizer(&ctx.store, &img, FINALIZER)?;
        return Ok(Action::await_change());
    }
    if ensure_finalizer(&ctx.store, &img, FINALIZER)? {
        return Ok(Action::requeue(Duration::ZERO));
    }
    if img.status.conditions.get_condition("Ready").is_none() {
        img.status.conditions.set_condition(
            "Ready",
            ConditionStatus::Unknown,
            "Reconciling",
            "",
            generation,
        );
        img.status.printable_status = Some(printable(&img));
        img = save(ctx, &img)?;
    }

    if let Some(op) = img.status.operation.clone() {
        // No live worker owns it: recover, then retry from a clean slate.
        match (&img.spec.source, op.type_) {
            (ImageSource::Vm(v), OperationType::Capture) => {
                ctx.backend
                    .recover_capture(v, &name, original_state(&op))
                    .await
                    .map_err(|e| ReconcileError::backend("recover_capture", &obj, e))?;
            }
            _ => {
                ctx.backend
                    .cleanup_image(&name)
                    .await
                    .map_err(|e| ReconcileError::backend("cleanup_image", &obj, e))?;
            }
        }
        img.status.operation = None;
        img.status.phase = ImagePhase::Pending;
        let img = save(ctx, &img)?;
        ctx.event(
            &img,
            EventType::Normal,
            "Recovered",
            "an interrupted capture was cleaned up and will be retried",
        );
        return Ok(Action::requeue(Duration::ZERO));
    }

    if img.status.phase == ImagePhase::Ready {
        if img.status.observed_generation != generation {
            img.status.observed_generation = generation;
            let img = save(ctx, &img)?;
            ctx.event(
                &img,
                EventType::Warning,
                "Immutable",
                "images are immutable: a changed spec is ignored; create a new image instead",
            );
        }
        return Ok(Action::await_change());
    }

    let uid = ctx.mark(&img.metadata);
    let (op_type, original) = match &img.spec.source {
        ImageSource::Vm(v) => {
            let vm = ctx.store.get_as::<Vm>(v)?;
            let ready = vm.as_ref().is_some_and(|vm| {
                vm.status.created_at.is_some()
                    && vm.status.operation.is_none()
                    && !vm.metadata.is_deleting()
            });
            if !ready {
                let msg = match &vm {
                    None => format!("the source VM {v} does not exist: `boxery get vms` lists VMs"),
                    Some(_) => format!("waiting for the source VM {v} to be created"),
                };
                let reason = if vm.is_none() {
                    "SourceVmNotFound"
                } else {
                    "SourceVmNotReady"
                };
                if img.status.conditions.set_condition(
                    "Ready",
                    ConditionStatus::False,
                    reason,
                    &msg,
                    generation,
                ) {
                    img.status.observed_generation = generation;
                    img.status.printable_status = Some(printable(&img));
                    save(ctx, &img)?;
                }
                return Ok(Action::requeue(Duration::from_secs(2)));
            }
            let state = ctx
                .backend
                .get(v)
                .await
                .map_err(|e| ReconcileError::backend("get", &obj, e))?
                .map(|i| i.state);
            (OperationType::Capture, state.map(|s| format!("{s:?}")))
        }
        _ => (OperationType::Build, None),
    };
    img.status.operation = Some(Operation {
        type_: op_type,
        image: Some(name.clone()),
        original_state: original,
        started_at: now(),
        holder: ctx.holder.clone(),
    });
    img.status.phase = ImagePhase::Capturing;
    img.status.printable_status = Some(if op_type == OperationType::Build {
        "Building".into()
    } else {
        "Capturing".into()
    });
    img = save(ctx, &img)?;

    let result = match &img.spec.source {
        ImageSource::Vm(v) => ctx
            .backend
            .capture(v, &name, &uid)
            .await
            .map_err(|e| ReconcileError::backend("capture", &obj, e)),
        ImageSource::Build(b) => {
            let progress = build_progress(ctx.store.clone(), name.clone());
            ctx.event(
                &img,
                EventType::Normal,
                "Building",
                &format!("building {} with layers [{}]", b.base, b.layers.join(", ")),
            );
            ctx.backend
                .build_image(&b.base, &name, &uid, progress)
                .await
                .map_err(|e| ReconcileError::backend("build", &obj, e))
        }
        ImageSource::File(p) => match confine_import(&ctx.import_roots(), p) {
            Ok(path) => ctx
                .backend
                .import_image(&path, &name, &uid)
                .await
                .map_err(|e| ReconcileError::backend("import", &obj, e)),
            Err(e) => Err(ReconcileError::backend("import", &obj, e)),
        },
    };
    // Progress lines may have written the status meanwhile: carry on from the stored object
    // (the operation recorded in it is ours: reconciles of one object never overlap).
    let Some(stored) = ctx.store.get_as::<Image>(&name)? else {
        return Ok(Action::await_change());
    };
    img.metadata = stored.metadata;
    img.status.conditions = stored.status.conditions;
    if let Err(e) = result {
        // Never leave a partial image: clean it now; if that fails too, recovery does it later.
        let cleaned = match &img.spec.source {
            ImageSource::Vm(v) => {
                ctx.backend
                    .recover_capture(
                        v,
                        &name,
                        original_state(img.status.operation.as_ref().expect("set above")),
                    )
                    .await
            }
            _ => ctx.backend.cleanup_image(&name).await,
        };
        if cleaned.is_ok() {
            img.status.operation = None;
            save(ctx, &img)?;
        }
        return Err(e);
    }
    let size = ctx
        .backend
        .images()
        .await
        .ok()
        .and_then(|list| list.into_iter().find(|i| i.name == name))
        .and_then(|i| i.size_bytes);
    img.status.operation = None;
    img.status.phase = ImagePhase::Ready;
    img.status.created_at = Some(now());
    img.status.size_bytes = size;
    img.status.backend = Some(ctx.backend.name().to_string());
    img.status.observed_generation = generation;
    img.status.failures = 0;
    img.status.last_failure = None;
    img.status.conditions.set_condition(
        "Ready",
        ConditionStatus::True,
        "Ready",
        "the image is ready",
        generation,
    );
    img.status.printable_status = Some(printable(&img));
    let img = save(ctx, &img)?;
    let what = match &img.spec.source {
        ImageSource::Vm(v) => format!("captured from VM {v}"),
        ImageSource::Build(b) => format!("built from {}", b.base),
        ImageSource::File(p) => format!("imported from {p}"),
    };
    ctx.event(&img, EventType::Normal, "Ready", &what);
    Ok(Action::await_change())
}

/// Build progress: each line is logged, and (at most once a second) written into the Image's
/// `Ready` condition, where `describe`, `get` and every `--wait` on a VM using it show it.
fn build_progress(store: boxery_store::Store, name: String) -> boxery_backends::Progress {
    let last = std::sync::Mutex::new(None::<std::time::Instant>);
    Arc::new(move |line: &str| {
        tracing::info!(image = %name, "{line}");
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        *last = Some(std::time::Instant::now());
        if let Ok(Some(mut img)) = store.get_as::<Image>(&name) {
            let generation = img.metadata.generation;
            img.status.conditions.set_condition(
                "Ready",
                ConditionStatus::False,
                "Building",
                line.trim(),
                generation,
            );
            let _ = store.update_status_as(&img);
        }
    })
}

fn original_state(op: &Operation) -> Option<PowerState> {
    match op.original_state.as_deref() {
        Some("Running") => Some(PowerState::Running),
        Some("Stopped") => Some(PowerState::Stopped),
        _ => None,
    }
}

/// Map a Vm change to the images waiting to capture it. Reads the Image cache.
pub fn images_for_vm(images: &boxery_controller::Cache, vm: &boxery_api::DynObject) -> Vec<String> {
    let name = vm.metadata.name.as_str();
    images
        .list()
        .iter()
        .filter(|i| {
            i.status()["phase"] != "Ready" && i.spec()["source"]["vm"].as_str() == Some(name)
        })
        .map(|i| i.metadata.name.clone())
        .collect()
}

/// Whether an Image's `Ready` holds for its current generation.
pub fn is_ready(img: &Image) -> bool {
    img.status.phase == ImagePhase::Ready
}

/// The kind's name, for wiring.
pub const KIND: &str = Image::INFO.kind;

/// Where an Image may import a file from: only inside the owner's import roots, reached
/// through no symlink that leads out, and said without telling whether a file outside exists
/// (an agent that writes an Image must not read or probe the host's files).
pub fn confine_import(
    roots: &[std::path::PathBuf],
    p: &str,
) -> Result<std::path::PathBuf, boxery_backends::BackendError> {
    use std::path::{Component, Path};
    let shown: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    let refuse = || {
        boxery_backends::BackendError::Invalid(format!(
            "{} is not inside an import root ({}): put the file (and its .json manifest) under one, or add a directory to `importRoots` in $BOXERY_HOME/config.yaml",
            boxery_api::name::shown(p),
            shown.join(", ")
        ))
    };
    let path = Path::new(p);
    if !path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(refuse());
    }
    // Lexically first: nothing outside the roots is ever looked at.
    if !roots.iter().any(|r| path.starts_with(r)) {
        return Err(refuse());
    }
    let canon_roots: Vec<_> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    let inside = |q: &Path| {
        q.canonicalize()
            .ok()
            .filter(|c| canon_roots.iter().any(|r| c.starts_with(r)))
    };
    let Some(canon) = inside(path) else {
        return Err(if path.exists() {
            refuse()
        } else {
            boxery_backends::BackendError::Invalid(format!(
                "{} does not exist in the import root",
                boxery_api::name::shown(p)
            ))
        });
    };
    // The builder's manifest beside it is read too: it must not lead out either.
    let manifest = if canon.extension().is_some_and(|e| e == "json") {
        canon.clone()
    } else {
        canon.with_extension("json")
    };
    if manifest.exists() && inside(&manifest).is_none() {
        return Err(refuse());
    }
    Ok(canon)
}

#[cfg(test)]
mod import_tests {
    use super::confine_import;

    #[test]
    fn imports_stay_inside_their_roots_and_probe_nothing_outside() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("imports");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("ok.qcow2"), "x").unwrap();
        std::fs::write(root.join("ok.json"), "{}").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", root.join("shadow.qcow2")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("etc")).unwrap();
        std::fs::write(root.join("evil.qcow2"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("evil.json")).unwrap();
        let roots = vec![root.clone()];
        let ok = confine_import(&roots, root.join("ok.qcow2").to_str().unwrap()).unwrap();
        assert_eq!(ok, root.canonicalize().unwrap().join("ok.qcow2"));
        // Outside, a missing file outside, and an existing one: the same words, nothing probed.
        let a = confine_import(&roots, "/etc/shadow")
            .unwrap_err()
            .to_string();
        let b = confine_import(&roots, "/etc/no-such-file")
            .unwrap_err()
            .to_string();
        assert_eq!(
            a.replace("/etc/shadow", "P"),
            b.replace("/etc/no-such-file", "P")
        );
        for bad in [
            root.join("shadow.qcow2"),
            root.join("etc/passwd"),
            root.join("../imports/../../etc/passwd"),
            root.join("evil.qcow2"),
        ] {
            let e = confine_import(&roots, bad.to_str().unwrap()).unwrap_err();
            assert!(e.to_string().contains("not inside an import root"), "{e}");
        }
        assert!(confine_import(&roots, "relative/x.qcow2").is_err());
        let e = confine_import(&roots, root.join("missing.qcow2").to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }
}
