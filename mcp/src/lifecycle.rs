//! Lifecycle tools: they write specs into the store (validated exactly as `boxery apply` does)
//! and wait, bounded, on conditions; a wait that runs out returns where the object stands.
//!
//! Waits run through `crate::wait::wait_all`, which runs the controllers in-process when
//! nothing leads the store (and `boxery mcp` runs them for its whole life in that case).

use std::sync::Arc;
use std::time::Duration;

use boxery_api::image::ImageSpec;
use boxery_api::vm::{Resources, Restore, VmSpec};
use boxery_api::{
    ConditionStatus, DynObject, Image, ImageSource, Name, OwnerReference, Quantity, RunStrategy,
    Selector, Vm, VmSource, lookup_kind, now,
};
use boxery_store::{ApplyAction, ApplyOptions, DeleteOutcome, Store, StoreError};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolError, ToolResult, clamp_timeout};
use crate::output;
use crate::wait::{self, Until};

fn kind_of(name: Option<&str>) -> Result<&'static boxery_api::KindInfo, ToolError> {
    Ok(crate::commands::kind(name.unwrap_or("vm"))?)
}

fn ready() -> Until {
    Until::Condition("Ready".into(), ConditionStatus::True)
}

fn stopped() -> Until {
    Until::JsonPath("{.status.phase}".into(), "Stopped".into())
}

/// Wait (bounded); `Ok(None)` when it held, `Ok(Some(state))` when the time ran out.
pub(super) async fn bounded_wait(
    session: &Session,
    targets: &[(String, String)],
    until: &Until,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<Option<String>, ToolError> {
    if targets.is_empty() {
        return Ok(None);
    }
    let w = wait::wait_all(&session.env, targets, until, timeout, true);
    let r = tokio::select! {
        r = w => r,
        _ = ct.cancelled() => return Err(ToolError::Cancelled),
    };
    match r {
        Ok(()) => Ok(None),
        Err(e) if e.code == crate::exit::Code::Timeout => Ok(Some(format!("{:#}", e.error))),
        Err(e) => Err(e.into()),
    }
}

/// One line per object: `kind/name STATUS (Ready=…: message)`.
fn state_lines(
    store: &Store,
    targets: &[(String, String)],
) -> Result<(String, Vec<Value>), ToolError> {
    let mut text = String::new();
    let mut data = Vec::new();
    for (k, n) in targets {
        let o = store.get(k, n)?;
        text.push_str(&format!(
            "{}/{n}: {}\n",
            k.to_lowercase(),
            match &o {
                Some(o) => wait::describe_state(Some(o)),
                None => "deleted".into(),
            }
        ));
        data.push(match &o {
            Some(o) => json!({"kind": k, "name": n, "status": o.status()}),
            None => json!({"kind": k, "name": n, "deleted": true}),
        });
    }
    Ok((text, data))
}

/// Finish a spec-writing call: wait, then report the state either way.
async fn finish(
    session: &Session,
    mut text: String,
    targets: Vec<(String, String)>,
    until: Until,
    wait_for: Option<Duration>,
    ct: &CancellationToken,
) -> ToolResult {
    let mut converged = true;
    if let Some(t) = wait_for
        && let Some(why) = bounded_wait(session, &targets, &until, t, ct).await?
    {
        converged = false;
        text.push_str(&format!(
            "not there yet ({why}); it keeps converging: vm_wait or vm_get to follow it\n"
        ));
    }
    let store = session.store()?;
    let (state, data) = state_lines(&store, &targets)?;
    text.push_str(&state);
    Ok(Output::with_data(
        text,
        json!({"converged": converged, "objects": data}),
    ))
}

/// `vm_apply` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyArgs {
    /// One or more YAML documents (separated by `---`) or a JSON object.
    pub manifest: String,
    /// Validate and show what would change; write nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Wait until Vms and Images are Ready (default true).
    #[serde(default)]
    pub wait: Option<bool>,
    /// How long to wait (default 600 s, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// `vm_apply`.
pub async fn apply(session: Arc<Session>, a: ApplyArgs, ct: CancellationToken) -> ToolResult {
    let manifests = boxery_api::codec::parse_manifests("manifest", a.manifest.as_bytes())
        .map_err(|e| ToolError::Invalid(format!("{e}")))?;
    if manifests.is_empty() {
        return Err(ToolError::Invalid("the manifest holds no documents".into()));
    }
    let store = session.store()?;
    let objs: Vec<DynObject> = manifests.iter().map(|m| m.object.clone()).collect();
    let results = store
        .apply_all(
            objs,
            &ApplyOptions {
                dry_run: a.dry_run,
                prune: None,
            },
        )
        .map_err(|e| match e {
            StoreError::Invalid(v) => ToolError::Invalid(format!("{v}")),
            e => e.into(),
        })?;
    let mut text = String::new();
    let mut ready_t = Vec::new();
    let mut stopped_t = Vec::new();
    let mut vms = Vec::new();
    for (action, obj) in &results {
        let word = match action {
            ApplyAction::Created => "created",
            ApplyAction::Configured => "configured",
            ApplyAction::Unchanged => "unchanged",
            ApplyAction::Pruned => "pruned",
        };
        let singular = lookup_kind(&obj.kind)
            .map(|k| k.singular)
            .unwrap_or("object");
        text.push_str(&format!(
            "{singular}/{} {word}{}\n",
            obj.metadata.name,
            if a.dry_run { " (dry run)" } else { "" }
        ));
        if obj.kind == "Vm" {
            vms.push(obj.metadata.name.clone());
        }
        if matches!(obj.kind.as_str(), "Vm" | "Image") {
            let t = (obj.kind.clone(), obj.metadata.name.clone());
            if obj.spec()["runStrategy"] == "Stopped" {
                stopped_t.push(t);
            } else {
                ready_t.push(t);
            }
        }
    }
    if a.dry_run {
        return Ok(Output::with_data(text, json!({"dry_run": true})));
    }
    if let [one] = vms.as_slice() {
        session.set_default_vm(Some(one.clone()));
        text.push_str(&format!("(VM {one} is this session's default VM now)\n"));
    }
    let wait_for = a
        .wait
        .unwrap_or(true)
        .then(|| clamp_timeout(a.timeout_seconds, 600));
    if let Some(t) = wait_for
        && let Some(why) = bounded_wait(&session, &stopped_t, &stopped(), t, &ct).await?
    {
        text.push_str(&format!("not stopped yet: {why}\n"));
    }
    let mut all = ready_t.clone();
    all.extend(stopped_t);
    let converged = match wait_for {
        Some(t) => match bounded_wait(&session, &ready_t, &ready(), t, &ct).await? {
            None => true,
            Some(why) => {
                text.push_str(&format!(
                    "not there yet ({why}); it keeps converging: vm_wait or vm_get to follow it\n"
                ));
                false
            }
        },
        None => false,
    };
    let (state, data) = state_lines(&store, &all)?;
    text.push_str(&state);
    Ok(Output::with_data(
        text,
        json!({"objects": data, "converged": converged}),
    ))
}

/// `vm_get` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetArgs {
    /// The kind: vm (default), image, pool, lease, grant, event.
    #[serde(default)]
    pub kind: Option<String>,
    /// One name (all when absent).
    #[serde(default)]
    pub name: Option<String>,
    /// A label selector (team=web,tier!=db).
    #[serde(default)]
    pub selector: Option<String>,
}

/// `vm_get`.
pub async fn get(session: Arc<Session>, a: GetArgs, _ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let store = session.store()?;
    let sel: Selector = a
        .selector
        .as_deref()
        .unwrap_or("")
        .parse()
        .map_err(|e| ToolError::Invalid(format!("bad selector: {e}")))?;
    if let Some(n) = &a.name {
        let o = store.get(info.kind, n)?.ok_or_else(|| {
            if info.kind == "Vm" {
                session.unknown_vm(n)
            } else {
                ToolError::NotFound(format!(
                    "{} {n} not found: vm_get {{kind: {}}} lists them",
                    info.kind, info.plural
                ))
            }
        })?;
        let v = output::display_value(&o);
        return Ok(Output::with_data(output::to_yaml(&v)?, v));
    }
    let (objs, _) = store.list(info.kind, &sel)?;
    let vals: Vec<Value> = objs.iter().map(output::display_value).collect();
    let text = if vals.is_empty() {
        format!("no {}\n", info.plural)
    } else {
        output::table(info.kind, &vals, true, true)
    };
    Ok(Output::with_data(text, json!({ "items": vals })))
}

/// `vm_describe` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DescribeArgs {
    /// The kind (default vm).
    #[serde(default)]
    pub kind: Option<String>,
    /// The name (default: the session's VM).
    #[serde(default)]
    pub name: Option<String>,
}

/// `vm_describe`.
pub async fn describe(
    session: Arc<Session>,
    a: DescribeArgs,
    _ct: CancellationToken,
) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let name = match a.name {
        Some(n) => n,
        None if info.kind == "Vm" => session.resolve_vm(None)?,
        None => return Err(ToolError::Invalid("give the object's `name`".into())),
    };
    let store = session.store()?;
    let o = store.get(info.kind, &name)?.ok_or_else(|| {
        if info.kind == "Vm" {
            session.unknown_vm(&name)
        } else {
            ToolError::NotFound(format!("{} {name} not found", info.kind))
        }
    })?;
    let mut v = output::display_value(&o);
    let events: Vec<Value> = crate::commands::events_for(&store, info.kind, &name)?
        .iter()
        .rev()
        .take(20)
        .map(|e| {
            json!({
                "type": e.rest["type"], "reason": e.rest["reason"], "message": e.rest["message"],
                "count": e.rest["count"], "lastTimestamp": e.rest["lastTimestamp"],
            })
        })
        .collect();
    v["events"] = Value::Array(events);
    Ok(Output::with_data(
        format!(
            "{}\n{}",
            wait::describe_state(Some(&o)),
            output::to_yaml(&v)?
        ),
        v,
    ))
}

/// `vm_delete` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteArgs {
    /// The kind (default vm).
    #[serde(default)]
    pub kind: Option<String>,
    /// The names.
    pub names: Vec<String>,
    /// Wait until they are gone (default true).
    #[serde(default)]
    pub wait: Option<bool>,
    /// How long to wait (default 120 s).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

async fn delete_objects(
    session: &Session,
    kind: &'static boxery_api::KindInfo,
    names: &[String],
    wait_for: Option<Duration>,
    ct: &CancellationToken,
) -> ToolResult {
    if names.is_empty() {
        return Err(ToolError::Invalid(
            "name at least one object to delete".into(),
        ));
    }
    // Every name first: one bad name deletes none of the others.
    for n in names {
        Name::for_kind(kind, n).map_err(|e| ToolError::Invalid(format!("names: {e}")))?;
    }
    let store = session.store()?;
    let mut text = String::new();
    let mut targets = Vec::new();
    for n in names {
        let r = store.delete(kind.kind, n).map_err(|e| match e {
            StoreError::NotFound { .. } if kind.kind == "Vm" => session.unknown_vm(n),
            e => e.into(),
        })?;
        match r {
            DeleteOutcome::Removed(_) => text.push_str(&format!("{}/{n} deleted\n", kind.singular)),
            DeleteOutcome::Marked(_) => {
                text.push_str(&format!("{}/{n} deleting\n", kind.singular));
                targets.push((kind.kind.to_string(), n.clone()));
            }
        }
        if session.default_vm().as_deref() == Some(n) && kind.kind == "Vm" {
            session.set_default_vm(None);
        }
    }
    finish(session, text, targets, Until::Deleted, wait_for, ct).await
}

/// `vm_delete`.
pub async fn delete(session: Arc<Session>, a: DeleteArgs, ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let wait_for = a
        .wait
        .unwrap_or(true)
        .then(|| clamp_timeout(a.timeout_seconds, 120));
    delete_objects(&session, info, &a.names, wait_for, &ct).await
}

/// `vm_wait` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitArgs {
    /// The kind (default vm).
    #[serde(default)]
    pub kind: Option<String>,
    /// The name (default: the session's VM).
    #[serde(default)]
    pub name: Option<String>,
    /// condition=Ready (default), condition=Ready=False, delete, or jsonpath={.status.phase}=Stopped.
    #[serde(default, rename = "for")]
    pub until: Option<String>,
    /// How long to wait (default 300 s, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

/// `vm_wait`.
pub async fn wait(session: Arc<Session>, a: WaitArgs, ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let name = match a.name {
        Some(n) => n,
        None => session.resolve_vm(None)?,
    };
    let until: Until = a.until.as_deref().unwrap_or("condition=Ready").parse()?;
    let store = session.store()?;
    if until != Until::Deleted && store.get(info.kind, &name)?.is_none() {
        return Err(if info.kind == "Vm" {
            session.unknown_vm(&name)
        } else {
            ToolError::NotFound(format!("{} {name} not found", info.kind))
        });
    }
    let t = clamp_timeout(a.timeout_seconds, 300);
    let targets = vec![(info.kind.to_string(), name)];
    match bounded_wait(&session, &targets, &until, t, &ct).await? {
        None => {
            let (state, data) = state_lines(&store, &targets)?;
            Ok(Output::with_data(
                format!("condition met\n{state}"),
                json!({"met": true, "objects": data}),
            ))
        }
        Some(why) => Err(ToolError::Timeout(format!(
            "{why}; call vm_wait again to keep waiting, or vm_describe to see why"
        ))),
    }
}

/// A `vm_manage` verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Make a VM from an image (`from`, default debian-12).
    New,
    /// Snapshot the VM's disk into the image VM.LABEL (works while it runs).
    Snap,
    /// Replace the VM's disk with its snapshot VM.LABEL.
    Revert,
    /// Make new VMs (`names`) from this VM's disk as it is now.
    Fork,
    /// Start the VM.
    Start,
    /// Stop the VM.
    Stop,
    /// Change CPUs, memory or disk.
    Resize,
    /// Delete the VM (and the images it owns).
    Rm,
}

/// `vm_manage` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ManageArgs {
    /// new, snap, revert, fork, start, stop, resize or rm.
    pub action: Action,
    /// The VM (for new: the new VM's name; default: the session's VM).
    #[serde(default)]
    pub vm: Option<String>,
    /// new: the image to make it from (default debian-12; `tiny` boots in seconds).
    #[serde(default)]
    pub from: Option<String>,
    /// snap/revert: the snapshot's label (image VM.LABEL).
    #[serde(default)]
    pub label: Option<String>,
    /// fork: the new VMs' names.
    #[serde(default)]
    pub names: Vec<String>,
    /// new/fork/resize: virtual CPUs.
    #[serde(default)]
    pub cpus: Option<u32>,
    /// new/fork/resize: memory, e.g. 512Mi, 4Gi.
    #[serde(default)]
    pub memory: Option<String>,
    /// new/fork/resize: disk size, e.g. 20Gi (disks only grow).
    #[serde(default)]
    pub disk: Option<String>,
    /// Wait for the result (default true).
    #[serde(default)]
    pub wait: Option<bool>,
    /// How long to wait (default 600 s, at most 1800).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

fn quantity(s: &Option<String>, what: &str) -> Result<Option<Quantity>, ToolError> {
    s.as_deref()
        .map(|q| {
            q.parse::<Quantity>()
                .map_err(|e| ToolError::Invalid(format!("{what} `{q}`: {e} (e.g. 512Mi, 4Gi)")))
        })
        .transpose()
}

fn resources(a: &ManageArgs, base: Resources) -> Result<Resources, ToolError> {
    Ok(Resources {
        shape: base.shape,
        cpus: a.cpus.or(base.cpus),
        memory: quantity(&a.memory, "memory")?.or(base.memory),
        disk: quantity(&a.disk, "disk")?.or(base.disk),
    })
}

fn edit_vm(session: &Session, name: &str, f: impl Fn(&mut Vm)) -> Result<Vm, ToolError> {
    let store = session.store()?;
    for _ in 0..10 {
        let mut vm: Vm = store
            .get_as(name)?
            .ok_or_else(|| session.unknown_vm(name))?;
        if vm.metadata.is_deleting() {
            return Err(ToolError::Conflict(format!("VM {name} is being deleted")));
        }
        f(&mut vm);
        match store.update_as(&vm) {
            Ok(v) => return Ok(v),
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::Invalid(v)) => return Err(ToolError::Invalid(format!("{v}"))),
            Err(e) => return Err(e.into()),
        }
    }
    Err(ToolError::Conflict(format!(
        "VM {name} kept changing under this call: try again"
    )))
}

fn create<R: boxery_api::Resource>(store: &Store, obj: &R, what: &str) -> Result<(), ToolError> {
    store.create_as(obj).map(|_| ()).map_err(|e| match e {
        StoreError::AlreadyExists { .. } => {
            ToolError::Conflict(format!("{what} already exists: pick another name"))
        }
        StoreError::Invalid(v) => ToolError::Invalid(format!("{v}")),
        e => e.into(),
    })
}

/// `vm_manage`.
/// Every name `vm_manage` was given, checked before it does anything (so a fork with one bad
/// name makes none of the others).
fn check_names(a: &ManageArgs) -> Result<(), ToolError> {
    let bad = |field: &str, e: boxery_api::InvalidName| ToolError::Invalid(format!("{field}: {e}"));
    let given = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if let Some(v) = given(&a.vm) {
        Name::label(&v).map_err(|e| bad("vm", e))?;
    }
    if let Some(f) = given(&a.from) {
        Name::new(&f).map_err(|e| bad("from", e))?;
    }
    if let Some(l) = given(&a.label) {
        match a.action {
            Action::Snap => Name::label(&l).map(drop),
            _ => Name::new(&l).map(drop),
        }
        .map_err(|e| bad("label", e))?;
    }
    for n in &a.names {
        Name::label(n).map_err(|e| bad("names", e))?;
    }
    Ok(())
}

pub async fn manage(session: Arc<Session>, a: ManageArgs, ct: CancellationToken) -> ToolResult {
    check_names(&a)?;
    let wait_for = a
        .wait
        .unwrap_or(true)
        .then(|| clamp_timeout(a.timeout_seconds, 600));
    let store = session.store()?;
    let vm_t = |n: &str| vec![("Vm".to_string(), n.to_string())];
    match a.action {
        Action::New => {
            let name =
                a.vm.clone()
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| ToolError::Invalid("give the new VM's name in `vm`".into()))?;
            let spec = VmSpec {
                source: VmSource::Image(
                    a.from
                        .clone()
                        .unwrap_or_else(|| boxery_api::vm::STOCK_IMAGE.into()),
                ),
                resources: resources(&a, Resources::default())?,
                headless: true,
                layers: vec![],
                run_strategy: RunStrategy::Running,
                restore: None,
            };
            create(&store, &Vm::new(&name, spec), &format!("VM {name}"))?;
            session.set_default_vm(Some(name.clone()));
            finish(
                &session,
                format!("vm/{name} created (now this session's default VM)\n"),
                vm_t(&name),
                ready(),
                wait_for,
                &ct,
            )
            .await
        }
        Action::Snap | Action::Revert => {
            let vm = session.resolve_vm(a.vm.clone())?;
            let label = a
                .label
                .clone()
                .filter(|l| !l.is_empty())
                .ok_or_else(|| ToolError::Invalid("give the snapshot's `label`".into()))?;
            let image = crate::sugar::image_name(&vm, &label);
            if a.action == Action::Snap {
                let v: Vm = store.get_as(&vm)?.ok_or_else(|| session.unknown_vm(&vm))?;
                let mut img = Image::new(
                    &image,
                    ImageSpec {
                        source: ImageSource::Vm(vm.clone()),
                    },
                );
                img.metadata
                    .labels
                    .insert("boxery.dev/vm".into(), vm.clone());
                img.metadata.owner_references.push(OwnerReference {
                    api_version: boxery_api::API_VERSION.into(),
                    kind: "Vm".into(),
                    name: vm.clone(),
                    uid: v.metadata.uid.clone().unwrap_or_default(),
                    controller: Some(false),
                });
                create(&store, &img, &format!("image {image}"))?;
                finish(
                    &session,
                    format!("image/{image} created\n"),
                    vec![("Image".into(), image)],
                    ready(),
                    wait_for,
                    &ct,
                )
                .await
            } else {
                if store.get_as::<Image>(&image)?.is_none() {
                    return Err(ToolError::NotFound(format!(
                        "image {image} not found: vm_get {{kind: image}} lists snapshots"
                    )));
                }
                let at = now();
                edit_vm(&session, &vm, |v| {
                    v.spec.restore = Some(Restore {
                        image: image.clone(),
                        requested_at: at,
                    });
                })?;
                let mut text = format!("vm/{vm} reverting to {image}\n");
                if let Some(t) = wait_for {
                    let until = Until::JsonPath(
                        "{.status.lastRestore.requestedAt}".into(),
                        at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
                    );
                    if let Some(why) = bounded_wait(&session, &vm_t(&vm), &until, t, &ct).await? {
                        text.push_str(&format!("not reverted yet: {why}\n"));
                    }
                }
                finish(&session, text, vm_t(&vm), ready(), wait_for, &ct).await
            }
        }
        Action::Fork => {
            let src = session.resolve_vm(a.vm.clone())?;
            let s: Vm = store
                .get_as(&src)?
                .ok_or_else(|| session.unknown_vm(&src))?;
            if a.names.is_empty() {
                return Err(ToolError::Invalid("give the new VMs' `names`".into()));
            }
            let mut text = String::new();
            for n in &a.names {
                let spec = VmSpec {
                    source: VmSource::Vm(src.clone()),
                    resources: resources(&a, s.spec.resources.clone())?,
                    headless: s.spec.headless,
                    layers: s.spec.layers.clone(),
                    run_strategy: RunStrategy::Running,
                    restore: None,
                };
                let mut vm = Vm::new(n, spec);
                vm.metadata.labels = s.metadata.labels.clone();
                create(&store, &vm, &format!("VM {n}"))?;
                text.push_str(&format!("vm/{n} created (fork of {src})\n"));
            }
            let targets = a
                .names
                .iter()
                .map(|n| ("Vm".to_string(), n.clone()))
                .collect();
            finish(&session, text, targets, ready(), wait_for, &ct).await
        }
        Action::Start | Action::Stop => {
            let vm = session.resolve_vm(a.vm.clone())?;
            let run = if a.action == Action::Start {
                RunStrategy::Running
            } else {
                RunStrategy::Stopped
            };
            edit_vm(&session, &vm, |v| v.spec.run_strategy = run)?;
            let (word, until) = if run == RunStrategy::Running {
                ("starting", ready())
            } else {
                ("stopping", stopped())
            };
            finish(
                &session,
                format!("vm/{vm} {word}\n"),
                vm_t(&vm),
                until,
                wait_for,
                &ct,
            )
            .await
        }
        Action::Resize => {
            let vm = session.resolve_vm(a.vm.clone())?;
            if a.cpus.is_none() && a.memory.is_none() && a.disk.is_none() {
                return Err(ToolError::Invalid("give cpus, memory and/or disk".into()));
            }
            let r = {
                let cur: Vm = store.get_as(&vm)?.ok_or_else(|| session.unknown_vm(&vm))?;
                resources(&a, cur.spec.resources)?
            };
            let v = edit_vm(&session, &vm, |v| v.spec.resources = r.clone())?;
            let generation = v.metadata.generation.unwrap_or(0);
            finish(
                &session,
                format!("vm/{vm} resizing\n"),
                vm_t(&vm),
                Until::JsonPath(
                    "{.status.observedGeneration}".into(),
                    generation.to_string(),
                ),
                wait_for,
                &ct,
            )
            .await
        }
        Action::Rm => {
            let vm = session.resolve_vm(a.vm.clone())?;
            let info = kind_of(Some("vm"))?;
            delete_objects(&session, info, &[vm], wait_for, &ct).await
        }
    }
}

/// `vm_use` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UseArgs {
    /// The VM to make this session's default (absent: show the current default).
    #[serde(default)]
    pub vm: Option<String>,
}

/// `vm_use`.
pub async fn use_vm(session: Arc<Session>, a: UseArgs, _ct: CancellationToken) -> ToolResult {
    if let Some(vm) = a.vm.filter(|v| !v.is_empty()) {
        let store = session.store()?;
        if store.get_as::<Vm>(&vm)?.is_none() {
            return Err(session.unknown_vm(&vm));
        }
        session.set_default_vm(Some(vm.clone()));
        return Ok(Output::with_data(
            format!("default VM: {vm}"),
            json!({"vm": vm}),
        ));
    }
    Ok(match session.default_vm() {
        Some(vm) => Output::with_data(format!("default VM: {vm}"), json!({"vm": vm})),
        None => Output::with_data(
            "no default VM: vm_use {vm: NAME} sets one (vm_get lists VMs)",
            json!({"vm": null}),
        ),
    })
}
