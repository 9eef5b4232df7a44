//! `boxery orphans`: the VMs and images the backend has that no object of this store owns,
//! why each is left alone, and the two ways to settle one (adopt it as an object again, or
//! delete it from the backend). The inventory pass never deletes such a thing by itself unless
//! this store remembers removing its object (see `reconcilers/src/inventory.rs`).

use boxery_api::{Conditions, Image, ImagePhase, Name, Vm};
use boxery_backends::mark::Mark;
use boxery_reconcilers::inventory::{Verdict, orphan_verdict};
use boxery_store::Store;

use crate::exit::{CliError, CliResult};
use boxery_verbs::Env;

/// `orphans` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum OrphansCmd {
    /// List them (the default).
    Ls,
    /// Write an object for an orphan again, with the uid it was made for, so boxery manages it
    /// as before (a Vm keeps its disk; an Image becomes usable as a source again).
    Adopt {
        /// `vm` or `image`.
        kind: String,
        /// Its name in the backend.
        #[arg(value_parser = crate::args::any_name)]
        name: String,
    },
    /// Remove an orphan from the backend for good (its disk or image is deleted). Refused for
    /// what boxery did not make, and for what an object of this store owns.
    Delete {
        /// `vm` or `image`.
        kind: String,
        /// Its name in the backend.
        #[arg(value_parser = crate::args::any_name)]
        name: String,
        /// Say yes: deleting a VM's disk cannot be undone.
        #[arg(long)]
        yes: bool,
    },
}

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
pub async fn list(env: &Env, store: &Store) -> CliResult<Vec<Orphan>> {
    let backend = env.backend_for(store).await?;
    let ctx = boxery_verbs::runtime::context(
        store,
        backend.clone(),
        Default::default(),
        "boxery-orphans",
    );
    let vms = backend.list().await.map_err(CliError::failed)?;
    let images = backend.images().await.map_err(CliError::failed)?;
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
        let cur = store.get(kind, &name)?;
        let v = orphan_verdict(&ctx, mark.as_deref(), cur.as_ref().map(|o| &o.metadata))
            .map_err(|e| CliError::failed(e.chain()))?;
        push(kind, &name, mark, v);
    }
    Ok(out)
}

fn which_kind(kind: &str) -> CliResult<&'static str> {
    match boxery_api::lookup_kind(kind).map(|k| k.kind) {
        Some("Vm") => Ok("Vm"),
        Some("Image") => Ok("Image"),
        _ => Err(CliError::invalid(format!(
            "`{}`: orphans are VMs or images: say `vm` or `image`",
            boxery_api::name::shown(kind)
        ))),
    }
}

async fn find(env: &Env, store: &Store, kind: &str, name: &str) -> CliResult<Orphan> {
    list(env, store)
        .await?
        .into_iter()
        .find(|o| o.kind == kind && o.name == name)
        .ok_or_else(|| {
            CliError::not_found(format!(
                "no orphan {} {name}: `boxery orphans` lists them",
                kind.to_ascii_lowercase()
            ))
        })
}

/// `orphans …`.
pub async fn orphans(env: &Env, cmd: Option<OrphansCmd>) -> CliResult {
    let store = env.store()?;
    match cmd.unwrap_or(OrphansCmd::Ls) {
        OrphansCmd::Ls => {
            let all = list(env, &store).await?;
            if all.is_empty() {
                eprintln!("No orphans: every VM and image in the backend has its object.");
                return Ok(());
            }
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header(["KIND", "NAME", "VERDICT", "REASON"]);
            for o in &all {
                t.add_row([
                    o.kind.to_string(),
                    boxery_api::name::shown(&o.name),
                    o.verdict.to_string(),
                    o.reason.clone(),
                ]);
            }
            println!("{}", t.trim_fmt());
        }
        OrphansCmd::Delete { kind, name, yes } => {
            let kind = which_kind(&kind)?;
            let o = find(env, &store, kind, &name).await?;
            if o.verdict == "Foreign" {
                return Err(CliError::invalid(format!(
                    "{kind} {name} was not made by boxery (it carries no mark): boxery never removes it; use the hypervisor's own tools"
                )));
            }
            if !yes {
                return Err(CliError::invalid(format!(
                    "deleting {kind} {name} from the backend cannot be undone ({}): add --yes, or `boxery orphans adopt {} {name}` to keep it",
                    o.reason,
                    kind.to_ascii_lowercase()
                )));
            }
            let backend = env.backend_for(&store).await?;
            let r = if kind == "Vm" {
                match backend.remove(&name).await {
                    Ok(()) => backend.cleanup_new(&name).await,
                    Err(e) => Err(e),
                }
            } else {
                backend.remove_image(&name).await
            };
            r.map_err(CliError::failed)?;
            println!(
                "{}/{name} removed from the backend",
                kind.to_ascii_lowercase()
            );
        }
        OrphansCmd::Adopt { kind, name } => {
            let kind = which_kind(&kind)?;
            let o = find(env, &store, kind, &name).await?;
            let uid = match (o.verdict, o.mark.as_deref()) {
                ("Quarantined", Some(m)) => Mark::parse(m).object.to_string(),
                _ => {
                    return Err(CliError::invalid(format!(
                        "{kind} {name} cannot be adopted: {}",
                        o.reason
                    )));
                }
            };
            adopt(env, &store, kind, &name, &uid).await?;
            println!(
                "{}/{name} adopted: boxery manages it again (`boxery describe {} {name}`)",
                kind.to_ascii_lowercase(),
                kind.to_ascii_lowercase()
            );
        }
    }
    Ok(())
}

/// Write the object of an orphan again, with its old uid and a status saying it exists.
async fn adopt(env: &Env, store: &Store, kind: &str, name: &str, uid: &str) -> CliResult {
    let backend = env.backend_for(store).await?;
    let name = Name::for_kind(boxery_api::lookup_kind(kind).expect("Vm or Image"), name)
        .map_err(|e| CliError::invalid(e.0))?;
    let obj = if kind == "Vm" {
        let info = backend
            .get(&name)
            .await
            .map_err(CliError::failed)?
            .ok_or_else(|| CliError::not_found(format!("VM {name} left the backend")))?;
        let running = info.state == boxery_backends::PowerState::Running;
        let mut vm = Vm::new(
            name.as_str(),
            boxery_api::vm::VmSpec {
                source: boxery_api::VmSource::Image(ADOPTED.into()),
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
                run_strategy: if running {
                    boxery_api::RunStrategy::Running
                } else {
                    boxery_api::RunStrategy::Stopped
                },
                restore: None,
            },
        );
        vm.status.created_at = Some(boxery_api::now());
        vm.status.backend = Some(backend.name().to_string());
        vm.status.source_image = Some(ADOPTED.into());
        vm.status.phase = if running {
            boxery_api::VmPhase::Running
        } else {
            boxery_api::VmPhase::Stopped
        };
        boxery_api::DynObject::from_typed(&vm).map_err(CliError::failed)?
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
                return Err(CliError::invalid(format!(
                    "image {name} cannot be adopted: its name says neither its VM (VM.LABEL) nor a stock image; `boxery orphans delete image {name} --yes` removes it"
                )));
            }
        };
        let mut img = Image::new(name.as_str(), boxery_api::image::ImageSpec { source });
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
        boxery_api::DynObject::from_typed(&img).map_err(CliError::failed)?
    };
    store.adopt(obj, uid)?;
    Ok(())
}

/// The source recorded for an adopted VM: where its disk came from is not known.
const ADOPTED: &str = "adopted";
