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

use boxery_api::conditions::{READY, reasons};
use boxery_api::image::{BuildInfo, layered_image_name};
use boxery_api::vm::{Operation, OperationType};
use boxery_api::{
    ConditionStatus, Conditions, EventType, Image, ImagePhase, ImageSource, Resource, Vm, now,
};
use boxery_backends::PowerState;
use boxery_controller::{Action, FinalizerEvent};

use boxery_store::ObjectStoreExt;

use crate::context::Ctx;
use crate::error::ReconcileError;
use crate::recorded::{self, Recorded};

/// The Image finalizer.
pub const FINALIZER: &str = <Image as Recorded>::FINALIZER;

type Result<T, E = ReconcileError> = std::result::Result<T, E>;

async fn save(ctx: &Ctx, img: &Image) -> Result<Image> {
    recorded::save(ctx, img).await
}

/// The one word `boxery get` shows.
pub fn printable(img: &Image) -> String {
    if img.metadata.is_deleting() {
        return "Terminating".into();
    }
    if img.status.phase == ImagePhase::Pending
        && let Some(c) = img.status.conditions.get_condition(READY)
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

/// Reconcile one Image: the shared boilerplate ([`recorded::reconcile`]: backoff, finalizer,
/// `Ready=Unknown` start, failures recorded in status) around one step, holding the source
/// VM's lock for a capture.
pub async fn reconcile(img: Arc<Image>, ctx: Arc<Ctx>) -> Result<Action> {
    let lock = match &img.spec.source {
        ImageSource::Vm(v) => Some(ctx.vm_lock(v)),
        _ => None,
    };
    recorded::reconcile(img, &ctx, lock, async |event| match event {
        FinalizerEvent::Apply(img) => step((*img).clone(), &ctx).await,
        FinalizerEvent::Cleanup(img) => finalize((*img).clone(), &ctx).await,
    })
    .await
}

/// One step: recover an interrupted operation, keep a ready image as it is, or make it
/// (once its source is there).
async fn step(img: Image, ctx: &Ctx) -> Result<Action> {
    if let Some(op) = img.status.operation.clone() {
        return recover(img, op, ctx).await;
    }
    if img.status.phase == ImagePhase::Ready {
        return immutable(img, ctx).await;
    }
    let Some(original) = source_ready(&img, ctx).await? else {
        return Ok(Action::requeue(Duration::from_secs(2)));
    };
    make(img, original, ctx).await
}

fn key(img: &Image) -> String {
    format!("Image/{}", img.name())
}

/// Deletion: undo an unfinished capture, remove the image from the backend; the finalizer
/// goes after ([`recorded::reconcile`]).
async fn finalize(mut img: Image, ctx: &Ctx) -> Result<Action> {
    let (name, obj) = (img.name().to_string(), key(&img));
    if img.status.phase != ImagePhase::Terminating {
        img.status.phase = ImagePhase::Terminating;
        img.status.printable_status = Some("Terminating".into());
        img = save(ctx, &img).await?;
    }
    if let Some(op) = &img.status.operation
        && op.type_ == OperationType::Capture
        && let ImageSource::Vm(v) = &img.spec.source
    {
        ctx.backend
            .recover_capture(v, &name, original_state(op))
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
    Ok(Action::await_change())
}

/// An operation at the start of a reconcile has no live worker: undo it, then retry from a
/// clean slate.
async fn recover(mut img: Image, op: Operation, ctx: &Ctx) -> Result<Action> {
    let (name, obj) = (img.name().to_string(), key(&img));
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
    let img = save(ctx, &img).await?;
    ctx.event(
        &img,
        EventType::Normal,
        "Recovered",
        "an interrupted capture was cleaned up and will be retried",
    )
    .await;
    Ok(Action::requeue(Duration::ZERO))
}

/// A ready image never changes: a changed spec is reported, once per generation. A build made
/// before build records were kept gets its record here.
async fn immutable(mut img: Image, ctx: &Ctx) -> Result<Action> {
    if img.status.build_info.is_none()
        && matches!(img.spec.source, ImageSource::Build(_))
        && let Some(record) = build_record(&img, ctx).await?
    {
        img.status.build_info = Some(record);
        img = save(ctx, &img).await?;
    }
    let generation = img.metadata.generation;
    if img.status.observed_generation != generation {
        img.status.observed_generation = generation;
        let img = save(ctx, &img).await?;
        ctx.event(
            &img,
            EventType::Warning,
            "Immutable",
            "images are immutable: a changed spec is ignored; create a new image instead",
        )
        .await;
    }
    Ok(Action::await_change())
}

/// Whether the source is there to make the image from: `Some(the source VM's power state)`
/// (none for builds and imports), or `None` (waiting; the reason is written in `Ready`).
async fn source_ready(img: &Image, ctx: &Ctx) -> Result<Option<Option<String>>> {
    let ImageSource::Vm(v) = &img.spec.source else {
        return Ok(Some(None));
    };
    let vm = ctx.store.get_as::<Vm>(v).await?;
    let ready = vm.as_ref().is_some_and(|vm| {
        vm.status.created_at.is_some()
            && vm.status.operation.is_none()
            && !vm.metadata.is_deleting()
    });
    if ready {
        let state = ctx
            .backend
            .get(v)
            .await
            .map_err(|e| ReconcileError::backend("get", key(img), e))?
            .map(|i| i.state);
        return Ok(Some(state.map(|s| format!("{s:?}"))));
    }
    let (reason, msg) = match &vm {
        None => (
            reasons::SOURCE_VM_NOT_FOUND,
            format!("the source VM {v} does not exist: `boxery get vms` lists VMs"),
        ),
        Some(_) => (
            reasons::SOURCE_VM_NOT_READY,
            format!("waiting for the source VM {v} to be created"),
        ),
    };
    let mut img = img.clone();
    let generation = img.metadata.generation;
    if img
        .status
        .conditions
        .set_condition(READY, ConditionStatus::False, reason, &msg, generation)
    {
        img.status.observed_generation = generation;
        img.status.printable_status = Some(printable(&img));
        save(ctx, &img).await?;
    }
    Ok(None)
}

/// Capture, build or import: the intent first, then the backend's work, then Ready (or,
/// when it failed, the partial image cleaned up and the failure returned).
async fn make(mut img: Image, original: Option<String>, ctx: &Ctx) -> Result<Action> {
    let name = img.name().to_string();
    let op_type = match img.spec.source {
        ImageSource::Vm(_) => OperationType::Capture,
        _ => OperationType::Build,
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
    img = save(ctx, &img).await?;
    let result = run(&img, ctx).await;
    // Progress lines may have written the status meanwhile: carry on from the stored object
    // (the operation recorded in it is ours: reconciles of one object never overlap).
    let Some(stored) = ctx.store.get_as::<Image>(&name).await? else {
        return Ok(Action::await_change());
    };
    img.metadata = stored.metadata;
    img.status.conditions = stored.status.conditions;
    if let Err(e) = result {
        // Never leave a partial image: clean it now; if that fails too, recovery does it later.
        let cleaned = match &img.spec.source {
            ImageSource::Vm(v) => {
                let op = img.status.operation.as_ref().expect("set above");
                ctx.backend
                    .recover_capture(v, &name, original_state(op))
                    .await
            }
            _ => ctx.backend.cleanup_image(&name).await,
        };
        if cleaned.is_ok() {
            img.status.operation = None;
            save(ctx, &img).await?;
        }
        return Err(e);
    }
    ready(img, ctx).await
}

/// The backend's part of [`make`].
async fn run(img: &Image, ctx: &Ctx) -> Result<()> {
    let (name, obj) = (img.name().to_string(), key(img));
    let uid = ctx.mark(&img.metadata);
    match &img.spec.source {
        ImageSource::Vm(v) if img.spec.memory => {
            let need = match ctx.backend.get(v).await {
                Ok(Some(info)) => info.size.memory_mib << 20,
                _ => 0,
            };
            let what = format!("a snapshot of VM {v}'s memory");
            let refused =
                crate::quota::refusal(ctx.backend.as_ref(), ctx.settings.memory_quota, &what, need)
                    .await
                    .map_err(|e| ReconcileError::backend("quota", &obj, e))?;
            if let Some(why) = refused {
                return Err(ReconcileError::backend(
                    "capture",
                    &obj,
                    boxery_backends::BackendError::failed("capture the memory", why),
                ));
            }
            ctx.backend
                .capture_memory(v, &name, &uid)
                .await
                .map_err(|e| ReconcileError::backend("capture", &obj, e))
        }
        ImageSource::Vm(v) => ctx
            .backend
            .capture(v, &name, &uid)
            .await
            .map_err(|e| ReconcileError::backend("capture", &obj, e)),
        ImageSource::Build(b) => {
            let progress = BuildProgress::start(ctx.store.clone(), name.clone());
            ctx.event(
                img,
                EventType::Normal,
                "Building",
                &if b.layers.is_empty() {
                    format!("building {}", b.base)
                } else {
                    format!("building {} with {}", b.base, b.layers.join(", "))
                },
            )
            .await;
            let built = ctx
                .backend
                .build_image(
                    boxery_backends::Stock {
                        name: &b.base,
                        layers: &b.layers,
                        image: &name,
                        uid: &uid,
                    },
                    progress.progress.clone(),
                )
                .await
                .map_err(|e| ReconcileError::backend("build", &obj, e));
            progress.finish().await;
            built
        }
        ImageSource::File(p) => {
            let path = confine_import(&ctx.import_roots(), p)
                .map_err(|e| ReconcileError::backend("import", &obj, e))?;
            ctx.backend
                .import_image(&path, &name, &uid)
                .await
                .map_err(|e| ReconcileError::backend("import", &obj, e))
        }
    }
}

/// The image is made: status Ready, with its size.
async fn ready(mut img: Image, ctx: &Ctx) -> Result<Action> {
    let name = img.name().to_string();
    let generation = img.metadata.generation;
    let info = ctx
        .backend
        .images()
        .await
        .ok()
        .and_then(|list| list.into_iter().find(|i| i.name == name));
    let size = info.as_ref().and_then(|i| i.size_bytes);
    img.status.memory_bytes = info.and_then(|i| i.memory_bytes);
    img.status.build_info = build_record(&img, ctx).await?;
    img.status.operation = None;
    img.status.phase = ImagePhase::Ready;
    img.status.created_at = Some(now());
    img.status.size_bytes = size;
    img.status.backend = Some(ctx.backend.name().to_string());
    img.status.observed_generation = generation;
    img.status.failures = 0;
    img.status.last_failure = None;
    img.status.conditions.set_condition(
        READY,
        ConditionStatus::True,
        reasons::READY,
        "the image is ready",
        generation,
    );
    img.status.printable_status = Some(printable(&img));
    let img = save(ctx, &img).await?;
    let what = match &img.spec.source {
        ImageSource::Vm(v) => format!("captured from VM {v}"),
        ImageSource::Build(b) => format!("built from {}", b.base),
        ImageSource::File(p) => format!("imported from {p}"),
    };
    ctx.event(&img, EventType::Normal, "Ready", &what).await;
    Ok(Action::await_change())
}

/// What a new image's guest was built with: a build's record from the builder's output
/// (`NAME.build-info`), a capture's from its source VM's status (the record of the image it
/// was made from, or what was read back from it after a layer was added in place); none for
/// an import. A record that does not parse is left out, with a warning event.
async fn build_record(img: &Image, ctx: &Ctx) -> Result<Option<BuildInfo>> {
    match &img.spec.source {
        ImageSource::Build(b) => {
            let Some(dir) = &ctx.settings.build_outputs else {
                return Ok(None);
            };
            let path = dir.join(format!(
                "{}.build-info",
                layered_image_name(&b.base, &b.layers)
            ));
            match read_bounded(&path) {
                Ok(Some(bytes)) => match BuildInfo::parse(&bytes) {
                    Ok(info) => Ok(Some(info)),
                    Err(why) => {
                        let msg =
                            format!("the build record {} was left out: {why}", path.display());
                        ctx.event(img, EventType::Warning, "BuildInfoRefused", &msg)
                            .await;
                        Ok(None)
                    }
                },
                Ok(None) => Ok(None),
                Err(e) => {
                    tracing::warn!(image = img.name(), error = %e, "cannot read the build record");
                    Ok(None)
                }
            }
        }
        ImageSource::Vm(v) => Ok(ctx
            .store
            .get_as::<Vm>(v)
            .await?
            .and_then(|vm| vm.status.build_info)),
        ImageSource::File(_) => Ok(None),
    }
}

/// A file's first [`boxery_api::image::BUILD_INFO_MAX_BYTES`] + 1 bytes (one more than a
/// record may have, so that a longer one is refused by its parser); `None` when it is absent.
fn read_bounded(path: &std::path::Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    f.take(boxery_api::image::BUILD_INFO_MAX_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok(Some(bytes))
}

/// Build progress: each line is logged, and (at most once a second) written into the Image's
/// `Ready` condition, where `describe`, `get` and every `--wait` on a VM using it show it.
/// The writes are made by a task of their own; [`BuildProgress::finish`] waits for the last
/// one, so none lands after the step's own status write.
struct BuildProgress {
    progress: boxery_backends::Progress,
    done: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl BuildProgress {
    fn start(store: Arc<dyn boxery_store::ObjectStore>, name: String) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let last = std::sync::Mutex::new(None::<std::time::Instant>);
        let image = name.clone();
        let progress: boxery_backends::Progress = Arc::new(move |line: &str| {
            tracing::info!(image = %image, "{line}");
            let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *last = Some(std::time::Instant::now());
            let _ = tx.send(line.trim().to_string());
        });
        let done = tokio_util::sync::CancellationToken::new();
        let stop = done.clone();
        let task = tokio::spawn(async move {
            let write = |line: String| {
                let (store, name) = (store.clone(), name.clone());
                async move {
                    if let Ok(Some(mut img)) = store.get_as::<Image>(&name).await {
                        let generation = img.metadata.generation;
                        img.status.conditions.set_condition(
                            READY,
                            ConditionStatus::False,
                            reasons::BUILDING,
                            &line,
                            generation,
                        );
                        let _ = store.update_status_as(&img).await;
                    }
                }
            };
            loop {
                tokio::select! {
                    line = rx.recv() => match line {
                        Some(line) => write(line).await,
                        None => return,
                    },
                    _ = stop.cancelled() => {
                        while let Ok(line) = rx.try_recv() {
                            write(line).await;
                        }
                        return;
                    }
                }
            }
        });
        BuildProgress {
            progress,
            done,
            task,
        }
    }

    /// Stop taking lines and wait until the last one is written.
    async fn finish(self) {
        self.done.cancel();
        let _ = self.task.await;
    }
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
    // Only images whose text names the VM are parsed: this runs on every Vm change, and a
    // pool of a thousand members has a thousand clean images.
    let needle = format!("\"vm\":{}", serde_json::to_string(name).unwrap_or_default());
    images
        .list_containing(&needle)
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
