//! `boxery orphans`: the VMs and images the backend has that no object of this store owns,
//! why each is left alone, and the two ways to settle one (adopt it as an object again, or
//! delete it from the backend). The inventory pass never deletes such a thing by itself unless
//! this store remembers removing its object (see `reconcilers/src/inventory.rs`).

use boxery_api::{Conditions, Image, ImagePhase, Name, Vm};
use boxery_backends::mark::Mark;
use boxery_reconcilers::inventory::{Verdict, orphan_verdict};
use boxery_store::ObjectRef;

use crate::Verbs;
use crate::error::{Result, VerbError};

/// One orphan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Orphan {
    /// `Vm` or `Image`.
    pub kind: &'static str,
    /// Its name in the backend.
    pub name: String,
    /// Its mark, when it carries one.
    pub mark: Option<String>,
    /// `Quarantined` (left alone), `Removable` (the next inventory pass removes it) or
    /// `Foreign` (boxery did not make it).
    pub verdict: &'static str,
    /// Why.
    pub reason: String,
}

/// Every VM and image of the backend without an owning object here.
pub async fn list(v: &Verbs) -> Result<Vec<Orphan>> {
    let store = v.home_store()?;
    let backend = v.env.backend_for(&**store).await?;
    let ctx = std::sync::Arc::new(boxery_reconcilers::Ctx::new(
        store.clone(),
        v.env.home.clone(),
        backend.clone(),
        "boxery-orphans".to_string(),
        Default::default(),
    ));
    let vms = backend
        .list()
        .await
        .map_err(|e| VerbError::failed(e.chain()))?;
    let images = backend
        .images()
        .await
        .map_err(|e| VerbError::failed(e.chain()))?;
    let mut out = Vec::new();
    let mut push = |kind, name: &str, mark: Option<String>, v: Verdict| {
        let (verdict, reason) = match v {
            Verdict::Owned => return,
            Verdict::Removable => (
                "Removable",
                "this store removed its object; the next inventory pass removes it".to_string(),
            ),
            Verdict::Quarantined(why) => ("Quarantined", why),
            Verdict::Foreign => (
                "Foreign",
                "boxery did not make it (no mark): never touched".to_string(),
            ),
        };
        out.push(Orphan {
            kind,
            name: name.to_string(),
            mark,
            verdict,
            reason,
        });
    };
    let things = vms
        .into_iter()
        .map(|i| ("Vm", i.name, i.mark))
        .chain(images.into_iter().map(|i| ("Image", i.name, i.mark)));
    for (kind, name, mark) in things {
        let cur = store.get(&ObjectRef::new(kind, name.clone())).await?;
        let v = orphan_verdict(&ctx, mark.as_deref(), cur.as_ref().map(|o| &o.metadata))
            .await
            .map_err(|e| VerbError::failed(e.chain()))?;
        push(kind, &name, mark, v);
    }
    Ok(out)
}

/// The kind an orphan command names: `Vm` or `Image`.
pub fn which_kind(kind: &str) -> Result<&'static str> {
    match boxery_api::lookup_kind(kind).map(|k| k.kind) {
        Some("Vm") => Ok("Vm"),
        Some("Image") => Ok("Image"),
        _ => Err(VerbError::invalid(format!(
            "`{}`: orphans are VMs or images: say `vm` or `image`",
            boxery_api::name::shown(kind)
        ))),
    }
}

async fn find(v: &Verbs, kind: &str, name: &str) -> Result<Orphan> {
    list(v)
        .await?
        .into_iter()
        .find(|o| o.kind == kind && o.name == name)
        .ok_or_else(|| {
            VerbError::not_found(format!(
                "no orphan {} {name}: `boxery orphans` lists them",
                kind.to_ascii_lowercase()
            ))
        })
}

/// `orphans delete KIND NAME --yes`: remove an orphan from the backend for good. Refused for
/// what boxery did not make, for what an object of this store owns, and without `yes`.
pub async fn delete(v: &Verbs, kind: &str, name: &str, yes: bool) -> Result {
    let kind = which_kind(kind)?;
    let o = find(v, kind, name).await?;
    if o.verdict == "Foreign" {
        return Err(VerbError::invalid(format!(
            "{kind} {name} was not made by boxery (it carries no mark): boxery never removes it; use the hypervisor's own tools"
        )));
    }
    if !yes {
        return Err(VerbError::invalid(format!(
            "deleting {kind} {name} from the backend cannot be undone ({}): add --yes, or `boxery orphans adopt {} {name}` to keep it",
            o.reason,
            kind.to_ascii_lowercase()
        )));
    }
    let backend = v.env.backend_for(v.store()).await?;
    let r = if kind == "Vm" {
        match backend.remove(name).await {
            Ok(()) => backend.cleanup_new(name).await,
            Err(e) => Err(e),
        }
    } else {
        backend.remove_image(name).await
    };
    r.map_err(|e| VerbError::failed(e.chain()))
}

/// `orphans adopt KIND NAME`: write the object of a quarantined orphan again, with the uid
/// it was made for, so boxery manages it as before.
pub async fn adopt(v: &Verbs, kind: &str, name: &str) -> Result {
    let kind = which_kind(kind)?;
    let o = find(v, kind, name).await?;
    let uid = match (o.verdict, o.mark.as_deref()) {
        ("Quarantined", Some(m)) => Mark::parse(m).object.to_string(),
        _ => {
            return Err(VerbError::invalid(format!(
                "{kind} {name} cannot be adopted: {}",
                o.reason
            )));
        }
    };
    write_again(v, kind, name, &uid).await
}

/// Write the object of an orphan again, with its old uid and a status saying it exists.
async fn write_again(v: &Verbs, kind: &str, name: &str, uid: &str) -> Result {
    let backend = v.env.backend_for(v.store()).await?;
    let name = Name::for_kind(boxery_api::lookup_kind(kind).expect("Vm or Image"), name)
        .map_err(|e| VerbError::invalid(e.0))?;
    let obj = if kind == "Vm" {
        use boxery_backends::PowerState as Power;
        let info = backend
            .get(&name)
            .await
            .map_err(|e| VerbError::failed(e.chain()))?
            .ok_or_else(|| VerbError::not_found(format!("VM {name} left the backend")))?;
        let mut vm = Vm::new(
            name.as_str(),
            boxery_api::vm::VmSpec {
                source: boxery_api::VmSource::Image(ADOPTED.into()),
                instance_type: None,
                resources: boxery_api::vm::Resources {
                    shape: None,
                    cpus: Some(info.size.cpus),
                    memory: Some(boxery_api::Quantity::from_bytes(
                        info.size.memory_mib.saturating_mul(1 << 20),
                    )),
                    disk: Some(boxery_api::Quantity::from_bytes(
                        info.size.disk_gib.saturating_mul(1 << 30),
                    )),
                },
                headless: true,
                layers: vec![],
                // a suspended orphan stays suspended: `Stopped` would discard its memory
                run_strategy: match info.state {
                    Power::Running => boxery_api::RunStrategy::Running,
                    Power::Suspended => boxery_api::RunStrategy::Suspended,
                    Power::Stopped => boxery_api::RunStrategy::Stopped,
                },
                restore: None,
                network: Default::default(),
                idle: None,
                display: None,
            },
        );
        vm.status.created_at = Some(boxery_api::now());
        vm.status.backend = Some(backend.name().to_string());
        vm.status.source_image = Some(ADOPTED.into());
        vm.status.phase = match info.state {
            Power::Running => boxery_api::VmPhase::Running,
            Power::Suspended => boxery_api::VmPhase::Suspended,
            Power::Stopped => boxery_api::VmPhase::Stopped,
        };
        boxery_api::DynObject::from_typed(&vm).map_err(VerbError::failed)?
    } else {
        // Where an image came from is not recorded in the backend: a snapshot's name says its
        // VM (`VM.LABEL`), a stock image's name is its base.
        let source = match name.split_once('.') {
            Some((vm, _)) => boxery_api::ImageSource::Vm(vm.to_string()),
            None if boxery_api::vm::STOCK_IMAGES.contains(&name.as_str()) => {
                boxery_api::ImageSource::Build(boxery_api::image::BuildSpec {
                    base: name.to_string(),
                    layers: vec![],
                })
            }
            None => {
                return Err(VerbError::invalid(format!(
                    "image {name} cannot be adopted: its name says neither its VM (VM.LABEL) nor a stock image; `boxery orphans delete image {name} --yes` removes it"
                )));
            }
        };
        let mut img = Image::new(
            name.as_str(),
            boxery_api::image::ImageSpec {
                source,
                memory: false,
            },
        );
        img.status.phase = ImagePhase::Ready;
        img.status.observed_generation = Some(1);
        img.status.backend = Some(backend.name().to_string());
        img.status.conditions.set_condition(
            "Ready",
            boxery_api::ConditionStatus::True,
            "Adopted",
            "adopted from the backend with `boxery orphans adopt`",
            Some(1),
        );
        boxery_api::DynObject::from_typed(&img).map_err(VerbError::failed)?
    };
    v.store().adopt(obj, uid).await?;
    Ok(())
}

/// The source recorded for an adopted VM: where its disk came from is not known.
const ADOPTED: &str = "adopted";
