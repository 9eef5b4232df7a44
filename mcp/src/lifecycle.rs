//! Lifecycle tools: they call the verbs (`boxery_verbs`: the same functions as `boxery apply`,
//! `new`, `snap`…, validated exactly as `boxery apply` validates) and wait, bounded, on the
//! plan a verb returns; a wait that runs out returns where the object stands.
//!
//! Waits run through `boxery_verbs::wait::bounded`, which runs the controllers in-process when
//! nothing leads the store (and `boxery mcp` runs them for its whole life in that case).

use std::sync::Arc;
use std::time::Duration;

use boxery_api::{Name, Quantity, Resource, RunStrategy, Vm};
use boxery_store::{ObjectRef, ObjectStoreExt};
use boxery_verbs::objects::{self, Deleted};
use boxery_verbs::render;
use boxery_verbs::vm::{self as verbs_vm, Plan, Size};
use boxery_verbs::wait::{self, Until};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{Output, Session, ToolResult, clamp_timeout};
use boxery_verbs::VerbError;

fn kind_of(name: Option<&str>) -> Result<&'static boxery_api::KindInfo, VerbError> {
    objects::kind(name.unwrap_or("vm"))
}

/// Wait (bounded); `Ok(None)` when it held, `Ok(Some(state))` when the time ran out.
pub(super) async fn bounded_wait(
    session: &Session,
    targets: &[ObjectRef],
    until: &Until,
    timeout: Duration,
    ct: &CancellationToken,
) -> Result<Option<String>, VerbError> {
    wait::bounded(session.verbs()?, targets, until, timeout, ct.cancelled()).await
}

/// Where an object stands, as [`wait::describe_state`], never claiming more than its status
/// shows: a status written for an older generation (`status.observedGeneration` behind
/// `metadata.generation`: the controllers have not acted on the latest spec yet) says so, and
/// a Grant whose current spec no person approved says it is NOT in force, whatever its
/// (older) phase says (issue 30, class 5: `vm_patch` of an approved grant answered "Applied").
pub(crate) fn describe_now(o: &boxery_api::DynObject) -> String {
    let mut text = wait::describe_state(Some(o));
    let generation = o.metadata.generation;
    let observed = o.status()["observedGeneration"].as_i64();
    if let (Some(g), Some(seen)) = (generation, observed)
        && seen < g
    {
        text.push_str(&format!(
            " (that status is from generation {seen}: the controllers have not acted on generation {g}, the current spec, yet)"
        ));
    }
    if o.kind == boxery_api::Grant::INFO.kind
        && let Ok(grant) = o.to_typed::<boxery_api::Grant>()
    {
        let st = o.status();
        if !grant.status.approved_for(generation) {
            let name = &o.metadata.name;
            let was = st["approvedGeneration"]
                .as_i64()
                .map(|a| {
                    format!(
                        "the approval of generation {a} does not hold for generation {}: ",
                        generation.unwrap_or_default()
                    )
                })
                .unwrap_or_default();
            text.push_str(&format!(
                "; grant/{name} is NOT in force: {was}a person must approve it (`boxery grant approve {name}` in a terminal on the control plane's host; no tool can approve)"
            ));
        }
    }
    text
}

/// After a write that changed an object's spec: wait (at most `within`) until its controller
/// has acted on the new generation (`status.observedGeneration`), and return the object as it
/// is then. Objects without an observed generation, or that nothing reconciles, are returned
/// as they are once the time is up.
async fn after_reaction(
    session: &Session,
    o: boxery_api::DynObject,
    within: Duration,
) -> Result<boxery_api::DynObject, VerbError> {
    let Some(g) = o.metadata.generation else {
        return Ok(o);
    };
    let store = session.verbs()?.store();
    let key = ObjectRef::new(&o.kind, o.metadata.name.clone());
    let deadline = tokio::time::Instant::now() + within;
    let mut last = o;
    loop {
        if last.status()["observedGeneration"]
            .as_i64()
            .is_some_and(|seen| seen >= g)
            || last.metadata.generation != Some(g)
        {
            return Ok(last);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(last);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        match store.get(&key).await? {
            Some(o) => last = o,
            None => return Ok(last),
        }
    }
}

/// One line per object: `kind/name STATUS (Ready=…: message)`.
async fn state_lines(
    session: &Session,
    targets: &[ObjectRef],
) -> Result<(String, Vec<Value>), VerbError> {
    let store = session.verbs()?.store();
    let mut text = String::new();
    let mut data = Vec::new();
    for t in targets {
        let (k, n) = (&t.kind, &t.name);
        let o = store.get(t).await?;
        text.push_str(&format!(
            "{}/{n}: {}\n",
            k.to_lowercase(),
            match &o {
                Some(o) => describe_now(o),
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

/// A line saying nothing reconciles the store, when nothing does (else empty): a write that
/// did not wait stays Pending until a control plane runs.
async fn unreconciled(session: &Session) -> Result<String, VerbError> {
    let note = boxery_verbs::control::unreconciled_note(session.verbs()?).await?;
    Ok(note.map(|n| format!("{n}\n")).unwrap_or_default())
}

/// Finish a spec-writing call: wait for the plan's last step (the earlier ones first, each
/// saying when it did not hold), then report the state either way.
async fn finish(
    session: &Session,
    mut text: String,
    plan: Plan,
    wait_for: Option<Duration>,
    ct: &CancellationToken,
) -> ToolResult {
    let mut converged = true;
    if let Some(t) = wait_for
        && let Some((last, before)) = plan.steps.split_last()
    {
        for until in before {
            if let Some(why) = bounded_wait(session, &plan.targets, until, t, ct).await? {
                text.push_str(&format!("not reverted yet: {why}\n"));
            }
        }
        if let Some(why) = bounded_wait(session, &plan.targets, last, t, ct).await? {
            converged = false;
            text.push_str(&format!(
                "not there yet ({why}); it keeps converging: vm_wait or vm_get to follow it\n"
            ));
        }
    }
    if wait_for.is_none() {
        text.push_str(&unreconciled(session).await?);
    }
    let (state, data) = state_lines(session, &plan.targets).await?;
    text.push_str(&state);
    Ok(Output::with_data(
        text,
        json!({"converged": converged, "objects": data}),
    ))
}

/// Whether and how long a tool that writes waits for the result (flattened into its
/// arguments).
#[derive(Debug, Deserialize, JsonSchema)]
pub struct Waiting {
    /// Wait for the result: what was applied settled, a VM verb done, deleted objects gone
    /// (default true).
    pub wait: Option<bool>,
    /// How long to wait (default 600 s, vm_delete 120 s; at most 1800).
    pub timeout_seconds: Option<u64>,
}

impl Waiting {
    /// How long to wait (`default` seconds unless given), or `None` when not waiting.
    fn bound(&self, default: u64) -> Option<Duration> {
        let t = clamp_timeout(self.timeout_seconds, default);
        self.wait.unwrap_or(true).then_some(t)
    }
}

/// `vm_apply` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ApplyArgs {
    /// One or more YAML documents (separated by `---`) or a JSON object.
    pub manifest: String,
    /// Validate and show what would change; write nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Take over fields another manager (a person's `boxery stop`, another source) set to
    /// other values, instead of failing with a conflict that names them.
    #[serde(default)]
    pub force_conflicts: bool,
    /// Whether and how long to wait until what was applied settled.
    #[serde(flatten)]
    pub waiting: Waiting,
}

/// `vm_get` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetArgs {
    /// The kind: vm (default), image, pool, lease, grant, source, event.
    pub kind: Option<String>,
    /// One name (all when absent).
    pub name: Option<String>,
    /// A label selector (team=web,tier!=db).
    pub selector: Option<String>,
}

/// One object: `vm_describe`'s arguments, and the first of `vm_patch`'s and `vm_wait`'s
/// (unknown fields are refused by the tool table, which serde cannot do for a flattened
/// struct).
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DescribeArgs {
    /// The kind (default vm).
    pub kind: Option<String>,
    /// The name (default: the session's VM).
    pub name: Option<String>,
}

impl DescribeArgs {
    /// The kind, and the name (a Vm's: default the session's VM).
    async fn resolve(
        self,
        session: &Session,
    ) -> Result<(&'static boxery_api::KindInfo, String), VerbError> {
        let info = kind_of(self.kind.as_deref())?;
        let name = match self.name {
            Some(n) => n,
            None if info.kind == "Vm" => session.resolve_vm(None).await?,
            None => return Err(VerbError::invalid("give the object's `name`")),
        };
        Ok((info, name))
    }
}

/// `vm_patch` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PatchArgs {
    /// The object: vm (default), image, pool, lease or grant, and its name.
    #[serde(flatten)]
    pub object: DescribeArgs,
    /// The change, as JSON or YAML. A merge patch (the default type) is an object holding
    /// only what changes, `null` removing a field: {"metadata": {"labels": {"team": "web"}}},
    /// {"spec": {"replicas": 3}}, {"spec": {"resources": {"cpus": 2}}}. A JSON patch (type
    /// json) is a list of operations: [{"op": "replace", "path": "/spec/replicas", "value": 3}].
    pub patch: String,
    /// merge (default) or json.
    #[serde(rename = "type")]
    pub patch_type: Option<String>,
    /// Validate through the real write path and return the result; write nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// `vm_delete` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct DeleteArgs {
    /// The kind (default vm).
    pub kind: Option<String>,
    /// The names.
    pub names: Vec<String>,
    /// Whether and how long to wait until they are gone.
    #[serde(flatten)]
    pub waiting: Waiting,
}

/// `vm_wait` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct WaitArgs {
    /// The object.
    #[serde(flatten)]
    pub object: DescribeArgs,
    /// condition=Ready (default), condition=Ready=False, delete, or jsonpath={.status.phase}=Stopped.
    #[serde(rename = "for")]
    pub until: Option<String>,
    /// How long to wait (default 300 s, at most 1800).
    pub timeout_seconds: Option<u64>,
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
    /// Stop the VM (a suspended VM's saved memory is discarded).
    Stop,
    /// Suspend the running VM: its memory to disk, its hypervisor ended; resume brings the
    /// same processes back in about a second.
    Suspend,
    /// Resume a suspended VM from its saved memory (same as start).
    Resume,
    /// Change CPUs, memory or disk.
    Resize,
    /// Delete the VM (and the images it owns).
    Rm,
}

/// `vm_manage` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ManageArgs {
    /// new, snap, revert, fork, start, stop, suspend, resume, resize or rm.
    pub action: Action,
    /// The VM (for new: the new VM's name; default: the session's VM).
    pub vm: Option<String>,
    /// new: the image to make it from (default debian-12; `tiny` boots in seconds).
    pub from: Option<String>,
    /// snap/revert: the snapshot's label (image VM.LABEL).
    pub label: Option<String>,
    /// snap/revert/fork: with the VM's memory (snap: of the running VM, the guest pauses for
    /// the copy; revert: of such a snapshot, the VM comes back running where it was; fork:
    /// the new VMs continue from this instant of the running VM, each with its own identity).
    pub with_memory: Option<bool>,
    /// fork: the new VMs' names.
    #[serde(default)]
    pub names: Vec<String>,
    /// new/fork/resize: virtual CPUs.
    pub cpus: Option<u32>,
    /// new/fork/resize: memory, e.g. 512Mi, 4Gi.
    pub memory: Option<String>,
    /// new/fork/resize: disk size, e.g. 20Gi (disks only grow).
    pub disk: Option<String>,
    /// Whether and how long to wait for the result.
    #[serde(flatten)]
    pub waiting: Waiting,
}

/// `vm_use` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UseArgs {
    /// The VM to make this session's default (absent: show the current default).
    pub vm: Option<String>,
}

/// `vm_apply`.
pub async fn apply(session: Arc<Session>, a: ApplyArgs, ct: CancellationToken) -> ToolResult {
    let manifests = boxery_api::codec::parse_manifests("manifest", a.manifest.as_bytes())
        .map_err(|e| VerbError::invalid(format!("{e}")))?;
    let objs: Vec<_> = manifests.into_iter().map(|m| m.given).collect();
    if objs.iter().any(|o| o.kind == boxery_api::Source::INFO.kind) {
        return Err(VerbError::invalid(SOURCES_ARE_PEOPLES));
    }
    let opts = boxery_store::ApplyOptions {
        dry_run: a.dry_run,
        force_conflicts: a.force_conflicts,
        ..Default::default()
    };
    let applied = objects::apply(session.verbs()?, objs, opts).await?;
    let mut text: String = applied.lines().iter().map(|l| format!("{l}\n")).collect();
    if a.dry_run {
        return Ok(Output::with_data(text, json!({"dry_run": true})));
    }
    let vms: Vec<&str> = applied
        .results
        .iter()
        .filter(|(_, o)| o.kind == "Vm")
        .map(|(_, o)| o.metadata.name.as_str())
        .collect();
    if let [one] = vms.as_slice() {
        session.set_default_vm(Some(one.to_string()));
        text.push_str(&format!("(VM {one} is this session's default VM now)\n"));
    }
    let wait_for = a.waiting.bound(600);
    let all = applied.waited_on();
    let converged = match wait_for {
        Some(t) => {
            // One bound for every step: a step that runs out leaves less for the next.
            let deadline = std::time::Instant::now() + t;
            let mut converged = true;
            for (until, targets) in &applied.waits {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if let Some(why) = bounded_wait(&session, targets, until, left, &ct).await? {
                    text.push_str(&format!(
                        "not there yet ({why}); it keeps converging: vm_wait or vm_get to follow it\n"
                    ));
                    converged = false;
                }
            }
            converged
        }
        None => {
            if !a.dry_run {
                text.push_str(&unreconciled(&session).await?);
            }
            false
        }
    };
    let (state, data) = state_lines(&session, &all).await?;
    text.push_str(&state);
    Ok(Output::with_data(
        text,
        json!({"objects": data, "converged": converged}),
    ))
}

/// `vm_get`.
pub async fn get(session: Arc<Session>, a: GetArgs, _ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let v = session.verbs()?;
    let sel = objects::selector(a.selector.as_deref())
        .map_err(|e| VerbError::invalid(format!("bad selector: {e}")))?;
    if let Some(n) = &a.name {
        let (objs, _) = objects::get(v, info, std::slice::from_ref(n), &Default::default()).await?;
        let value = objs.first().map(render::display_value).unwrap_or_default();
        return Ok(Output::with_data(render::to_yaml(&value)?, value));
    }
    let (objs, _) = objects::get(v, info, &[], &sel).await?;
    let vals: Vec<Value> = objs.iter().map(render::display_value).collect();
    let text = if vals.is_empty() {
        format!("no {}\n", info.plural)
    } else {
        render::table(info.kind, &vals, true, true)
    };
    Ok(Output::with_data(text, json!({ "items": vals })))
}

/// `vm_describe`.
pub async fn describe(
    session: Arc<Session>,
    a: DescribeArgs,
    _ct: CancellationToken,
) -> ToolResult {
    let (info, name) = a.resolve(&session).await?;
    let d = boxery_verbs::describe::describe(session.verbs()?, info, &name).await?;
    let mut value = render::display_value(&d.object);
    let events = d.events.iter().rev().take(20).map(|e| {
        json!({
            "type": e.rest["type"], "reason": e.rest["reason"], "message": e.rest["message"],
            "count": e.rest["count"], "lastTimestamp": e.rest["lastTimestamp"],
        })
    });
    value["events"] = Value::Array(events.collect());
    if let Some(members) = &d.members {
        value["members"] = serde_json::to_value(members).map_err(VerbError::from)?;
    }
    let o = &d.object;
    Ok(Output::with_data(
        format!("{}\n{}", describe_now(o), render::to_yaml(&value)?),
        value,
    ))
}

/// Why a tool never writes a `Source`.
const SOURCES_ARE_PEOPLES: &str = "Source objects say which repositories a person's `boxery sync` follows and prunes from: only a person writes them (`boxery sync` in a terminal); apply the objects themselves instead";

/// `vm_patch`: the verbs' `patch` (CLI `patch`, `label`, `annotate`, `scale`), which refuses
/// changes to status and the controllers' metadata and retries on a concurrent write.
pub async fn patch(session: Arc<Session>, a: PatchArgs, _ct: CancellationToken) -> ToolResult {
    if kind_of(a.object.kind.as_deref())?.kind == boxery_api::Source::INFO.kind {
        return Err(VerbError::invalid(SOURCES_ARE_PEOPLES));
    }
    let (info, name) = a.object.resolve(&session).await?;
    let ty = match a.patch_type.as_deref() {
        None => boxery_verbs::edit::PatchType::Merge,
        Some(t) => t.parse().map_err(VerbError::invalid)?,
    };
    let dry = if a.dry_run {
        objects::DryRun::Server
    } else {
        objects::DryRun::None
    };
    let v = session.verbs()?;
    let c = boxery_verbs::edit::patch(v, info, &name, ty, &a.patch, dry).await?;
    let word = match (c.changed, c.dry_run) {
        (false, _) => "patched (no change)",
        (true, false) => "patched",
        (true, true) => "patched (dry run: nothing written)",
    };
    let mut text = format!("{}/{name} {word}\n", info.singular);
    let object = if c.changed && !c.dry_run {
        // The state is read after the controller's reaction to the new generation (bounded),
        // not from the status written for the old one.
        let gen_before = c.object.metadata.generation;
        let now = after_reaction(&session, c.object, Duration::from_secs(5)).await?;
        text.push_str(&describe_now(&now));
        if gen_before != now.metadata.generation {
            text.push_str("\n(changed again meanwhile: vm_get shows the latest)");
        }
        text.push_str(
            "\n(the controllers converge on the change: vm_wait or vm_get to follow it)\n",
        );
        text.push_str(&unreconciled(&session).await?);
        now
    } else {
        c.object
    };
    let value = render::display_value(&object);
    text.push_str(&render::to_yaml(&value)?);
    Ok(Output::with_data(text, value))
}

async fn delete_objects(
    session: &Session,
    kind: &'static boxery_api::KindInfo,
    names: &[String],
    wait_for: Option<Duration>,
    ct: &CancellationToken,
) -> ToolResult {
    let done = objects::delete(session.verbs()?, kind, names).await?;
    let mut text = String::new();
    let mut targets = Vec::new();
    for d in done {
        let n = match d {
            Deleted::Removed(n) => {
                text.push_str(&format!("{}/{n} deleted\n", kind.singular));
                n
            }
            Deleted::Deleting(n) => {
                text.push_str(&format!("{}/{n} deleting\n", kind.singular));
                targets.push(ObjectRef::new(kind.kind, n.clone()));
                n
            }
        };
        if session.default_vm().as_deref() == Some(n.as_str()) && kind.kind == "Vm" {
            session.set_default_vm(None);
        }
    }
    let plan = Plan {
        targets,
        steps: vec![Until::Deleted],
    };
    finish(session, text, plan, wait_for, ct).await
}

/// `vm_delete`.
pub async fn delete(session: Arc<Session>, a: DeleteArgs, ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.kind.as_deref())?;
    let wait_for = a.waiting.bound(120);
    delete_objects(&session, info, &a.names, wait_for, &ct).await
}

/// `vm_wait`.
pub async fn wait(session: Arc<Session>, a: WaitArgs, ct: CancellationToken) -> ToolResult {
    let info = kind_of(a.object.kind.as_deref())?;
    let name = match a.object.name {
        Some(n) => n,
        None => session.resolve_vm(None).await?,
    };
    let until: Until = a.until.as_deref().unwrap_or("condition=Ready").parse()?;
    if until != Until::Deleted {
        objects::get_one(session.verbs()?, info, &name).await?;
    }
    let t = clamp_timeout(a.timeout_seconds, 300);
    let targets = vec![ObjectRef::new(info.kind, name)];
    match bounded_wait(&session, &targets, &until, t, &ct).await? {
        None => {
            let (state, data) = state_lines(&session, &targets).await?;
            Ok(Output::with_data(
                format!("condition met\n{state}"),
                json!({"met": true, "objects": data}),
            ))
        }
        Some(why) => Err(VerbError::new(
            boxery_verbs::ErrorKind::Timeout,
            format!("{why}; call vm_wait again to keep waiting, or vm_describe to see why"),
        )),
    }
}

fn quantity(s: &Option<String>, what: &str) -> Result<Option<Quantity>, VerbError> {
    s.as_deref()
        .map(|q| {
            q.parse::<Quantity>()
                .map_err(|e| VerbError::invalid(format!("{what} `{q}`: {e} (e.g. 512Mi, 4Gi)")))
        })
        .transpose()
}

fn size(a: &ManageArgs) -> Result<Size, VerbError> {
    Ok(Size {
        cpus: a.cpus,
        memory: quantity(&a.memory, "memory")?,
        disk: quantity(&a.disk, "disk")?,
    })
}

/// Every name `vm_manage` was given, checked before it does anything (so a fork with one bad
/// name makes none of the others).
fn check_names(a: &ManageArgs) -> Result<(), VerbError> {
    let bad = |field: &str, e: boxery_api::InvalidName| VerbError::invalid(format!("{field}: {e}"));
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
    if a.with_memory.is_some() && !matches!(a.action, Action::Snap | Action::Revert | Action::Fork)
    {
        return Err(VerbError::invalid(
            "with_memory: only snap, revert and fork take it (suspend keeps a VM's memory on its own)",
        ));
    }
    Ok(())
}

/// `vm_manage`: one verb per action.
pub async fn manage(session: Arc<Session>, a: ManageArgs, ct: CancellationToken) -> ToolResult {
    check_names(&a)?;
    let wait_for = a.waiting.bound(600);
    let (text, plan) = match a.action {
        Action::New => manage_new(&session, &a).await?,
        Action::Snap => manage_snap(&session, &a).await?,
        Action::Revert => manage_revert(&session, &a).await?,
        Action::Fork => manage_fork(&session, &a).await?,
        Action::Start => manage_power(&session, &a, RunStrategy::Running).await?,
        Action::Stop => manage_power(&session, &a, RunStrategy::Stopped).await?,
        Action::Suspend => manage_power(&session, &a, RunStrategy::Suspended).await?,
        Action::Resume => manage_power(&session, &a, RunStrategy::Running).await?,
        Action::Resize => manage_resize(&session, &a).await?,
        Action::Rm => {
            let vm = session.resolve_vm(a.vm.clone()).await?;
            return delete_objects(&session, kind_of(Some("vm"))?, &[vm], wait_for, &ct).await;
        }
    };
    finish(&session, text, plan, wait_for, &ct).await
}

async fn manage_new(session: &Session, a: &ManageArgs) -> Result<(String, Plan), VerbError> {
    let name =
        a.vm.clone()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| VerbError::invalid("give the new VM's name in `vm`"))?;
    let input = verbs_vm::NewVm {
        name: name.clone(),
        from: a.from.clone(),
        size: size(a)?,
        ..Default::default()
    };
    let plan = verbs_vm::new(session.verbs()?, input).await?;
    session.set_default_vm(Some(name.clone()));
    Ok((
        format!("vm/{name} created (now this session's default VM)\n"),
        plan,
    ))
}

fn label_of(a: &ManageArgs) -> Result<String, VerbError> {
    a.label
        .clone()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| VerbError::invalid("give the snapshot's `label`"))
}

async fn manage_snap(session: &Session, a: &ManageArgs) -> Result<(String, Plan), VerbError> {
    let vm = session.resolve_vm(a.vm.clone()).await?;
    let label = label_of(a)?;
    let memory = a.with_memory.unwrap_or(false);
    let (image, plan) = verbs_vm::snap(session.verbs()?, &vm, &label, memory).await?;
    Ok((format!("image/{image} created\n"), plan))
}

async fn manage_revert(session: &Session, a: &ManageArgs) -> Result<(String, Plan), VerbError> {
    let vm = session.resolve_vm(a.vm.clone()).await?;
    let label = label_of(a)?;
    let memory = a.with_memory.unwrap_or(false);
    let (image, plan) = verbs_vm::revert(session.verbs()?, &vm, &label, memory).await?;
    Ok((format!("vm/{vm} reverting to {image}\n"), plan))
}

async fn manage_fork(session: &Session, a: &ManageArgs) -> Result<(String, Plan), VerbError> {
    let src = session.resolve_vm(a.vm.clone()).await?;
    let memory = a.with_memory.unwrap_or(false);
    let plan = verbs_vm::fork(session.verbs()?, &src, &a.names, &size(a)?, memory).await?;
    let how = if memory { " with its memory" } else { "" };
    let text = a
        .names
        .iter()
        .map(|n| format!("vm/{n} created (fork of {src}{how})\n"))
        .collect();
    Ok((text, plan))
}

async fn manage_power(
    session: &Session,
    a: &ManageArgs,
    run: RunStrategy,
) -> Result<(String, Plan), VerbError> {
    let vm = session.resolve_vm(a.vm.clone()).await?;
    let plan = verbs_vm::power(session.verbs()?, std::slice::from_ref(&vm), run).await?;
    Ok((format!("vm/{vm} {}\n", verbs_vm::power_word(run)), plan))
}

async fn manage_resize(session: &Session, a: &ManageArgs) -> Result<(String, Plan), VerbError> {
    let vm = session.resolve_vm(a.vm.clone()).await?;
    let plan = verbs_vm::resize(session.verbs()?, &vm, &size(a)?).await?;
    Ok((format!("vm/{vm} resizing\n"), plan))
}

/// `vm_use`.
pub async fn use_vm(session: Arc<Session>, a: UseArgs, _ct: CancellationToken) -> ToolResult {
    if let Some(vm) = a.vm.filter(|v| !v.is_empty()) {
        if session.verbs()?.store().get_as::<Vm>(&vm).await?.is_none() {
            return Err(session.unknown_vm(&vm).await);
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
