//! The seed's verbs, as sugar that writes specs: `new`, `snap`, `revert`, `fork`, `start`,
//! `stop`, `resize`, `rm`. Each ends where `apply` would, and `--wait` waits on a condition.

use std::time::Duration;

use boxery_api::image::ImageSpec;
use boxery_api::vm::{Resources, Restore, VmSpec};
use boxery_api::{
    ConditionStatus, Image, ImageSource, OwnerReference, Quantity, RunStrategy, Vm, VmSource, now,
};
use boxery_store::{Store, StoreError};

use crate::env::Env;
use crate::exit::{CliError, CliResult};
use crate::wait::{self, Until};

/// Size flags shared by `new`, `fork` and `resize`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SizeArgs {
    /// Virtual CPUs (1..64).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// Memory, e.g. 512Mi, 4Gi.
    #[arg(long)]
    pub memory: Option<Quantity>,
    /// Disk size, e.g. 20Gi (disks only grow).
    #[arg(long)]
    pub disk: Option<Quantity>,
}

fn ready() -> Until {
    Until::Condition("Ready".into(), ConditionStatus::True)
}

fn vm_or_not_found(store: &Store, name: &str) -> CliResult<Vm> {
    store.get_as::<Vm>(name)?.ok_or_else(|| {
        let names: Vec<String> = store
            .list_as::<Vm>(&Default::default())
            .unwrap_or_default()
            .into_iter()
            .map(|v| v.metadata.name)
            .take(20)
            .collect();
        CliError::not_found(format!(
            "VM {name} not found: {}",
            if names.is_empty() {
                "there are no VMs (`boxery new NAME` makes one)".to_string()
            } else {
                format!("known VMs: {}", names.join(", "))
            }
        ))
    })
}

/// Read-modify-write a Vm with the resourceVersion precondition, retrying on conflicts.
fn edit_vm(store: &Store, name: &str, f: impl Fn(&mut Vm) -> CliResult) -> CliResult<Vm> {
    for _ in 0..10 {
        let mut vm = vm_or_not_found(store, name)?;
        if vm.metadata.is_deleting() {
            return Err(crate::commands::conflict(format!(
                "VM {name} is being deleted"
            )));
        }
        f(&mut vm)?;
        match store.update_as(&vm) {
            Ok(v) => return Ok(v),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(crate::commands::conflict(format!(
        "VM {name} kept changing under this command: try again"
    )))
}

async fn maybe_wait(
    env: &Env,
    targets: Vec<(String, String)>,
    until: Until,
    wait_for: Option<Duration>,
) -> CliResult {
    match wait_for {
        Some(t) => wait::wait_all(env, &targets, &until, t, false).await,
        None => Ok(()),
    }
}

fn resources(size: &SizeArgs, base: Resources) -> Resources {
    Resources {
        shape: base.shape,
        cpus: size.cpus.or(base.cpus),
        memory: size.memory.or(base.memory),
        disk: size.disk.or(base.disk),
    }
}

/// `new NAME [--from IMAGE | --fork VM]`.
pub async fn new(
    env: &Env,
    name: &str,
    from: Option<String>,
    fork: Option<String>,
    size: &SizeArgs,
    stopped: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let store = env.store()?;
    let source = match (from, fork) {
        (Some(_), Some(_)) => {
            return Err(CliError::invalid(
                "give --from IMAGE or --fork VM, not both",
            ));
        }
        (_, Some(vm)) => {
            vm_or_not_found(&store, &vm)?;
            VmSource::Vm(vm)
        }
        (Some(img), None) => VmSource::Image(img),
        (None, None) => VmSource::Image(boxery_api::vm::STOCK_IMAGE.into()),
    };
    let spec = VmSpec {
        source,
        resources: resources(size, Resources::default()),
        headless: true,
        layers: vec![],
        run_strategy: if stopped {
            RunStrategy::Stopped
        } else {
            RunStrategy::Running
        },
        restore: None,
    };
    store.create_as(&Vm::new(name, spec))?;
    println!("vm/{name} created");
    let until = if stopped {
        Until::JsonPath("{.status.phase}".into(), "Stopped".into())
    } else {
        ready()
    };
    maybe_wait(env, vec![("Vm".into(), name.into())], until, wait_for).await
}

/// The image name for `VM LABEL`.
pub fn image_name(vm: &str, label: &str) -> String {
    if label.contains('.') {
        label.to_string()
    } else {
        format!("{vm}.{label}")
    }
}

/// `snap VM LABEL`: an Image of the VM's disk, owned by the VM.
pub async fn snap(env: &Env, vm: &str, label: &str, wait_for: Option<Duration>) -> CliResult {
    let store = env.store()?;
    let v = vm_or_not_found(&store, vm)?;
    let name = image_name(vm, label);
    let mut img = Image::new(
        &name,
        ImageSpec {
            source: ImageSource::Vm(vm.into()),
        },
    );
    img.metadata
        .labels
        .insert("boxery.dev/vm".into(), vm.into());
    img.metadata.owner_references.push(OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: "Vm".into(),
        name: vm.into(),
        uid: v.metadata.uid.clone().unwrap_or_default(),
        controller: Some(false),
    });
    store.create_as(&img).map_err(|e| match e {
        StoreError::AlreadyExists { .. } => CliError::invalid(format!(
            "image {name} already exists: pick another label, or `boxery delete image {name}` first"
        )),
        e => e.into(),
    })?;
    println!("image/{name} created");
    maybe_wait(env, vec![("Image".into(), name)], ready(), wait_for).await
}

/// `revert VM LABEL`: set `spec.restore`.
pub async fn revert(env: &Env, vm: &str, label: &str, wait_for: Option<Duration>) -> CliResult {
    let store = env.store()?;
    let image = image_name(vm, label);
    if store.get_as::<Image>(&image)?.is_none() {
        return Err(CliError::not_found(format!(
            "image {image} not found: `boxery get images` lists them"
        )));
    }
    let at = now();
    let v = edit_vm(&store, vm, |v| {
        v.spec.restore = Some(Restore {
            image: image.clone(),
            requested_at: at,
        });
        Ok(())
    })?;
    println!("vm/{vm} reverting to {image}");
    let generation = v.metadata.generation;
    let _ = generation;
    maybe_wait(
        env,
        vec![("Vm".into(), vm.into())],
        Until::JsonPath(
            "{.status.lastRestore.requestedAt}".into(),
            at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
        ),
        wait_for,
    )
    .await?;
    if wait_for.is_some() {
        maybe_wait(env, vec![("Vm".into(), vm.into())], ready(), wait_for).await?;
    }
    Ok(())
}

/// `fork SRC NEW…`: new VMs whose source is SRC's disk as it is now.
pub async fn fork(
    env: &Env,
    src: &str,
    names: &[String],
    size: &SizeArgs,
    wait_for: Option<Duration>,
) -> CliResult {
    let store = env.store()?;
    let s = vm_or_not_found(&store, src)?;
    if names.is_empty() {
        return Err(CliError::invalid("name at least one new VM"));
    }
    for n in names {
        let spec = VmSpec {
            source: VmSource::Vm(src.into()),
            resources: resources(size, s.spec.resources.clone()),
            headless: s.spec.headless,
            layers: s.spec.layers.clone(),
            run_strategy: RunStrategy::Running,
            restore: None,
        };
        let mut vm = Vm::new(n, spec);
        vm.metadata.labels = s.metadata.labels.clone();
        store.create_as(&vm)?;
        println!("vm/{n} created (fork of {src})");
    }
    maybe_wait(
        env,
        names
            .iter()
            .map(|n| ("Vm".to_string(), n.clone()))
            .collect(),
        ready(),
        wait_for,
    )
    .await
}

/// `start` / `stop`.
pub async fn power(
    env: &Env,
    names: &[String],
    run: RunStrategy,
    wait_for: Option<Duration>,
) -> CliResult {
    let store = env.store()?;
    for n in names {
        edit_vm(&store, n, |v| {
            v.spec.run_strategy = run;
            Ok(())
        })?;
        println!(
            "vm/{n} {}",
            if run == RunStrategy::Running {
                "starting"
            } else {
                "stopping"
            }
        );
    }
    let until = match run {
        RunStrategy::Running => ready(),
        RunStrategy::Stopped => Until::JsonPath("{.status.phase}".into(), "Stopped".into()),
    };
    maybe_wait(
        env,
        names
            .iter()
            .map(|n| ("Vm".to_string(), n.clone()))
            .collect(),
        until,
        wait_for,
    )
    .await
}

/// `resize VM`.
pub async fn resize(
    env: &Env,
    name: &str,
    size: &SizeArgs,
    wait_for: Option<Duration>,
) -> CliResult {
    if size.cpus.is_none() && size.memory.is_none() && size.disk.is_none() {
        return Err(CliError::invalid("give --cpus, --memory and/or --disk"));
    }
    let store = env.store()?;
    let v = edit_vm(&store, name, |v| {
        v.spec.resources = resources(size, v.spec.resources.clone());
        Ok(())
    })?;
    println!("vm/{name} resizing");
    let generation = v.metadata.generation.unwrap_or(0);
    maybe_wait(
        env,
        vec![("Vm".into(), name.into())],
        Until::JsonPath(
            "{.status.observedGeneration}".into(),
            generation.to_string(),
        ),
        wait_for,
    )
    .await
}
