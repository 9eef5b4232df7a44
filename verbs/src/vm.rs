//! The VM verbs, as writes of specs: `new`, `snap`, `revert`, `fork`, `start`, `stop`,
//! `resize` (`rm` is [`crate::objects::delete`]). Each writes what `apply` would and returns a
//! [`Plan`]: the objects to wait on and the conditions that say the write took effect, which
//! the CLI waits on with `--wait` and the tools with a bound.

use boxery_api::image::ImageSpec;
use boxery_api::vm::{Resources, Restore, VmSpec};
use boxery_api::{
    ConditionStatus, Image, ImageSource, OwnerReference, Quantity, Resource as _, RunStrategy, Vm,
    VmSource, now,
};
use boxery_store::{ObjectRef, ObjectStoreExt, StoreError};

use crate::error::{Result, VerbError};
use crate::wait::Until;
use crate::{Verbs, Voice};

/// A VM's size: each part given replaces the base's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Size {
    /// Virtual CPUs.
    pub cpus: Option<u32>,
    /// Memory.
    pub memory: Option<Quantity>,
    /// Disk size (disks only grow).
    pub disk: Option<Quantity>,
}

impl Size {
    /// Nothing given.
    pub fn is_empty(&self) -> bool {
        self.cpus.is_none() && self.memory.is_none() && self.disk.is_none()
    }

    /// `base` with the parts given here.
    pub fn over(&self, base: Resources) -> Resources {
        Resources {
            shape: base.shape,
            cpus: self.cpus.or(base.cpus),
            memory: self.memory.or(base.memory),
            disk: self.disk.or(base.disk),
        }
    }
}

/// What a verb wrote is done when every target meets each step, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The objects written.
    pub targets: Vec<ObjectRef>,
    /// The conditions, in order.
    pub steps: Vec<Until>,
}

impl Plan {
    fn vms(names: &[String], steps: Vec<Until>) -> Plan {
        Plan {
            targets: names
                .iter()
                .map(|n| ObjectRef::of::<Vm>(n.clone()))
                .collect(),
            steps,
        }
    }
}

/// `condition=Ready`.
pub fn ready() -> Until {
    Until::Condition("Ready".into(), ConditionStatus::True)
}

/// `jsonpath={.status.phase}=Stopped`.
pub fn stopped() -> Until {
    Until::JsonPath("{.status.phase}".into(), "Stopped".into())
}

/// The image name for `VM LABEL` (a label with a dot is a full image name).
pub fn image_name(vm: &str, label: &str) -> String {
    if label.contains('.') {
        label.to_string()
    } else {
        format!("{vm}.{label}")
    }
}

/// The Vm `name`, which must exist.
pub async fn get_vm(v: &Verbs, name: &str) -> Result<Vm> {
    match v.store().get_as::<Vm>(name).await? {
        Some(vm) => Ok(vm),
        None => Err(v.vm_not_found(name).await),
    }
}

/// Read-modify-write a Vm with the resourceVersion precondition, retrying on conflicts; the
/// fields changed become `verb`'s ([`Verbs::manager`]).
pub async fn edit_vm(v: &Verbs, name: &str, verb: &str, f: impl Fn(&mut Vm)) -> Result<Vm> {
    let manager = v.manager(verb);
    for _ in 0..10 {
        let mut vm = get_vm(v, name).await?;
        if vm.metadata.is_deleting() {
            return Err(VerbError::conflict(format!("VM {name} is being deleted")));
        }
        f(&mut vm);
        match v.store().update_as_by(&vm, &manager).await {
            Ok(vm) => return Ok(vm),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(VerbError::conflict(match v.voice {
        Voice::Cli => format!("VM {name} kept changing under this command: try again"),
        Voice::Tool => format!("VM {name} kept changing under this call: try again"),
    }))
}

/// Create an object as `verb`; one that exists already is said in the front end's words.
async fn create<R: boxery_api::Resource>(
    v: &Verbs,
    obj: &R,
    verb: &str,
    exists: impl FnOnce() -> VerbError,
) -> Result {
    match v.store().create_as_by(obj, &v.manager(verb)).await {
        Ok(_) => Ok(()),
        Err(StoreError::AlreadyExists { .. }) => Err(exists()),
        Err(e) => Err(e.into()),
    }
}

/// `create` for a VM: the store's own words on the CLI, "pick another name" for a tool.
async fn create_vm(v: &Verbs, vm: &Vm, verb: &str) -> Result {
    create(v, vm, verb, || vm_exists(v, vm.name())).await
}

/// VM `name` exists already: the store's own words on the CLI, "pick another name" for a
/// tool.
fn vm_exists(v: &Verbs, name: &str) -> VerbError {
    match v.voice {
        Voice::Cli => StoreError::AlreadyExists {
            kind: "Vm".into(),
            name: name.to_string(),
        }
        .into(),
        Voice::Tool => VerbError::conflict(format!("VM {name} already exists: pick another name")),
    }
}

/// `new`'s input.
#[derive(Debug, Clone, Default)]
pub struct NewVm {
    /// The new VM's name.
    pub name: String,
    /// Make it from this image (default: the stock image).
    pub from: Option<String>,
    /// Make it from this VM's disk as it is now.
    pub fork: Option<String>,
    /// Its size (defaults for what is not given).
    pub size: Size,
    /// Create it stopped.
    pub stopped: bool,
}

/// `new NAME [--from IMAGE | --fork VM]`: write a Vm.
pub async fn new(v: &Verbs, input: NewVm) -> Result<Plan> {
    let source = match (input.from, input.fork) {
        (Some(_), Some(_)) => {
            return Err(VerbError::invalid(
                "give --from IMAGE or --fork VM, not both",
            ));
        }
        (_, Some(vm)) => {
            get_vm(v, &vm).await?;
            VmSource::Vm(vm)
        }
        (Some(img), None) => VmSource::Image(img),
        (None, None) => VmSource::Image(boxery_api::vm::STOCK_IMAGE.into()),
    };
    let spec = VmSpec {
        source,
        instance_type: None,
        resources: input.size.over(Resources::default()),
        headless: true,
        layers: vec![],
        run_strategy: if input.stopped {
            RunStrategy::Stopped
        } else {
            RunStrategy::Running
        },
        restore: None,
        network: Default::default(),
        idle: None,
        display: None,
    };
    create_vm(v, &Vm::new(&input.name, spec), "new").await?;
    let until = if input.stopped { stopped() } else { ready() };
    Ok(Plan::vms(&[input.name], vec![until]))
}

/// `snap VM LABEL [--memory]`: an Image of the VM's disk (`VM.LABEL`; with `memory`, of its
/// memory too: the VM must run), owned by the VM (it goes with it). Returns the image's name.
pub async fn snap(v: &Verbs, vm: &str, label: &str, memory: bool) -> Result<(String, Plan)> {
    let owner = get_vm(v, vm).await?;
    if memory && owner.status.phase != boxery_api::VmPhase::Running {
        return Err(VerbError::invalid(format!(
            "VM {vm} is {:?}: its memory can be captured only while it runs (resume or start it, or snapshot its disk without memory)",
            owner.status.phase
        )));
    }
    if memory {
        can_snapshot_memory(v, &owner)?;
    }
    let name = image_name(vm, label);
    let mut img = snapshot_of(&owner, &name, memory);
    img.metadata
        .labels
        .insert("boxery.dev/vm".into(), vm.into());
    create(v, &img, "snap", || match v.voice {
        Voice::Cli => VerbError::invalid(format!(
            "image {name} already exists: pick another label, or `boxery delete image {name}` first"
        )),
        Voice::Tool => {
            VerbError::conflict(format!("image {name} already exists: pick another name"))
        }
    })
    .await?;
    let plan = Plan {
        targets: vec![ObjectRef::of::<Image>(name.clone())],
        steps: vec![ready()],
    };
    Ok((name, plan))
}

/// `revert VM LABEL [--memory]`: set `spec.restore` to the image `VM.LABEL` (with `memory`:
/// its memory too, so the VM comes back running where it was). The plan waits for the
/// restore to be served, then for Ready. Returns the image's name.
pub async fn revert(v: &Verbs, vm: &str, label: &str, memory: bool) -> Result<(String, Plan)> {
    let image = image_name(vm, label);
    let Some(img) = v.store().get_as::<Image>(&image).await? else {
        return Err(VerbError::not_found(match v.voice {
            Voice::Cli => format!("image {image} not found: `boxery get images` lists them"),
            Voice::Tool => {
                format!("image {image} not found: vm_get {{kind: image}} lists snapshots")
            }
        }));
    };
    if memory && !img.spec.memory {
        return Err(VerbError::invalid(match v.voice {
            Voice::Cli => format!(
                "image {image} carries no memory (it was taken without --memory): revert without --memory"
            ),
            Voice::Tool => format!(
                "image {image} carries no memory (it was taken without memory): revert without memory"
            ),
        }));
    }
    let at = now();
    edit_vm(v, vm, "revert", |vm| {
        vm.spec.restore = Some(Restore {
            image: image.clone(),
            requested_at: at,
            memory,
        });
    })
    .await?;
    let served = Until::JsonPath(
        "{.status.lastRestore.requestedAt}".into(),
        at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
    );
    Ok((image, Plan::vms(&[vm.to_string()], vec![served, ready()])))
}

/// `fork SRC NEW…`: new VMs whose source is SRC's disk as it is now, with SRC's size (or
/// `size`), layers, egress policy and labels.
pub async fn fork(
    v: &Verbs,
    src: &str,
    names: &[String],
    size: &Size,
    memory: bool,
) -> Result<Plan> {
    let s = get_vm(v, src).await?;
    if names.is_empty() {
        return Err(VerbError::invalid(match v.voice {
            Voice::Cli => "name at least one new VM",
            Voice::Tool => "give the new VMs' `names`",
        }));
    }
    if memory {
        // refused before the fork's image is made: a child that cannot be made would leave
        // it behind (the controller deletes it once every child exists)
        for n in names {
            if v.store().get_as::<Vm>(n).await?.is_some() {
                return Err(vm_exists(v, n));
            }
        }
    }
    let source = if memory {
        VmSource::Image(memory_fork_image(v, &s, size).await?)
    } else {
        VmSource::Vm(src.into())
    };
    for n in names {
        let spec = VmSpec {
            source: source.clone(),
            // the kind the source asked for (a fork is what its source is)
            instance_type: s.spec.instance_type,
            resources: size.over(s.spec.resources.clone()),
            headless: s.spec.headless,
            layers: s.spec.layers.clone(),
            run_strategy: RunStrategy::Running,
            restore: None,
            // A fork of a confined VM is as confined (docs/egress.md).
            network: s.spec.network.clone(),
            idle: s.spec.idle.clone(),
            display: s.spec.display,
        };
        let mut vm = Vm::new(n, spec);
        // its labels, but not boxery's own (a pool's membership, an apply set): a fork of a
        // pool member is no member of that pool
        vm.metadata.labels = s
            .metadata
            .labels
            .iter()
            .filter(|(k, _)| !k.starts_with(crate::edit::SYSTEM_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        create_vm(v, &vm, "fork").await?;
    }
    Ok(Plan::vms(names, vec![ready()]))
}

/// Refused up front when the backend running VM `vm` cannot snapshot memory (so cannot fork
/// with it): the Image would fail and whatever waits on it with it.
fn can_snapshot_memory(v: &Verbs, vm: &Vm) -> Result<()> {
    let Some(backend) = vm.status.backend.as_deref() else {
        return Ok(());
    };
    // the backend's capabilities (one source of truth); nothing is opened
    let Ok(b) = boxery_backends::by_name(backend, &v.env.home) else {
        return Ok(());
    };
    if b.capabilities().memory_snapshots {
        return Ok(());
    }
    Err(VerbError::invalid(format!(
        "VM {} runs on the {backend} backend, which cannot snapshot or fork a VM's memory (`boxery backends` lists what each backend offers): leave out the memory option to take its disk only",
        vm.name()
    )))
}

/// Image `name` of VM `vm`'s disk (and memory, with `memory`), owned by the VM: deleted with
/// it.
fn snapshot_of(vm: &Vm, name: &str, memory: bool) -> Image {
    let mut img = Image::new(
        name,
        ImageSpec {
            source: ImageSource::Vm(vm.name().into()),
            memory,
        },
    );
    img.metadata.owner_references.push(OwnerReference {
        api_version: boxery_api::API_VERSION.into(),
        kind: "Vm".into(),
        name: vm.name().into(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(false),
    });
    img
}

/// A fork with memory: one image of VM `s` with its memory (`SRC.fork-MILLIS`, labelled
/// [`boxery_api::image::MEMORY_FORK_LABEL`], owned by `s`), from which every child starts at
/// the same instant; the Vm controller deletes it once every child exists.
async fn memory_fork_image(v: &Verbs, s: &Vm, size: &Size) -> Result<String> {
    let src = s.name();
    if size.cpus.is_some() || size.memory.is_some() {
        return Err(VerbError::invalid(
            "a fork with memory has its source's CPUs and memory (the memory holds them): drop the size options, or fork without memory",
        ));
    }
    can_snapshot_memory(v, s)?;
    if s.status.phase != boxery_api::VmPhase::Running {
        return Err(VerbError::invalid(format!(
            "VM {src} is {:?}: a fork with memory needs it running (resume or start it, or fork its disk without memory)",
            s.status.phase
        )));
    }
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let name = format!("{src}.fork-{millis}");
    let mut img = snapshot_of(s, &name, true);
    img.metadata
        .labels
        .insert(boxery_api::image::MEMORY_FORK_LABEL.into(), src.into());
    create(v, &img, "fork", || {
        VerbError::conflict(format!("image {name} already exists: fork again"))
    })
    .await?;
    Ok(name)
}

pub use boxery_api::vm::WOKEN_AT;

/// How long a use waits for a VM suspended while idle to be resumed and answer.
pub const WAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(180);

/// Whether VM `vm` was suspended by its controller for being idle and not woken since.
pub fn sleeps(vm: &Vm) -> bool {
    vm.status.phase == boxery_api::VmPhase::Suspended
        && vm.spec.run_strategy == RunStrategy::Running
        && vm.status.idle_suspended_at.is_some()
}

/// When VM `name` sleeps ([`sleeps`]): wake it and wait (bounded) until it answers again,
/// saying so; `Ok(true)` then. `Ok(false)` for a VM that does not sleep, or does not exist.
pub async fn wake_if_sleeping(v: &Verbs, name: &str) -> Result<bool> {
    let Some(vm) = v.store().get_as::<Vm>(name).await? else {
        return Ok(false);
    };
    if !sleeps(&vm) {
        return Ok(false);
    }
    crate::notes::say(&format!(
        "boxery: vm/{name} was suspended while idle; resuming it (about a second)"
    ));
    wake(v, name).await?;
    crate::wait::wait_all(
        v,
        &[ObjectRef::of::<Vm>(name.to_string())],
        &ready(),
        WAKE_TIMEOUT,
        &crate::wait::Quiet,
    )
    .await?;
    Ok(true)
}

/// Wake VM `name`'s controller ([`WOKEN_AT`]): a store write it sees at once.
async fn wake(v: &Verbs, name: &str) -> Result<()> {
    let at = now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    edit_vm(v, name, "wake", |vm| {
        vm.metadata.annotations.insert(WOKEN_AT.into(), at.clone());
    })
    .await
    .map(drop)
}

/// What `power(run)` is doing, in one word for its first line (`vm/NAME starting`).
pub fn power_word(run: RunStrategy) -> &'static str {
    match run {
        RunStrategy::Running => "starting",
        RunStrategy::Stopped => "stopping",
        RunStrategy::Suspended => "suspending",
    }
}

/// `jsonpath={.status.phase}=Suspended`.
pub fn suspended() -> Until {
    Until::JsonPath("{.status.phase}".into(), "Suspended".into())
}

/// `start` / `stop` / `suspend` / `resume` (= `start`): set `runStrategy`. A stopped VM
/// cannot be suspended (it has no memory to keep): refused before anything changes.
pub async fn power(v: &Verbs, names: &[String], run: RunStrategy) -> Result<Plan> {
    let verb = match run {
        RunStrategy::Running => "start",
        RunStrategy::Stopped => "stop",
        RunStrategy::Suspended => "suspend",
    };
    if run == RunStrategy::Suspended {
        for n in names {
            let vm = get_vm(v, n).await?;
            if vm.status.phase == boxery_api::VmPhase::Stopped
                && vm.spec.run_strategy == RunStrategy::Stopped
            {
                return Err(VerbError::invalid(format!(
                    "VM {n} is stopped: there is no memory to suspend (start it first)"
                )));
            }
        }
    }
    for n in names {
        let vm = edit_vm(v, n, verb, |vm| vm.spec.run_strategy = run).await?;
        // `resume` of a VM suspended while idle: runStrategy was Running already
        if run == RunStrategy::Running && sleeps(&vm) {
            if v.is_home_store() {
                let _ = boxery_home::activity::touch(&v.env.home, n);
            }
            wake(v, n).await?;
        }
    }
    let until = match run {
        RunStrategy::Running => ready(),
        RunStrategy::Stopped => stopped(),
        RunStrategy::Suspended => suspended(),
    };
    Ok(Plan::vms(names, vec![until]))
}

/// `resize VM`: change CPUs, memory or disk; the plan waits until the controller observed
/// the new generation.
pub async fn resize(v: &Verbs, name: &str, size: &Size) -> Result<Plan> {
    if size.is_empty() {
        return Err(VerbError::invalid(match v.voice {
            Voice::Cli => "give --cpus, --memory and/or --disk",
            Voice::Tool => "give cpus, memory and/or disk",
        }));
    }
    let vm = edit_vm(v, name, "resize", |vm| {
        vm.spec.resources = size.over(vm.spec.resources.clone());
    })
    .await?;
    let generation = vm.metadata.generation.unwrap_or(0);
    let until = Until::JsonPath(
        "{.status.observedGeneration}".into(),
        generation.to_string(),
    );
    Ok(Plan::vms(&[name.to_string()], vec![until]))
}
