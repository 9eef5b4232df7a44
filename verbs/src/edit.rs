//! A person's changes to one stored object, as kubectl makes them: `edit` (the whole object,
//! in an editor: the CLI does the editing, [`apply_edit`] writes what changed), `patch` (JSON
//! merge patch or JSON patch), `label` and `annotate`, `scale`. Each is a read-modify-write
//! with the `resourceVersion` precondition: when the object moved on, it is read again and the
//! change applied to it (a `resourceVersion` the person wrote into their change is kept as a
//! precondition, as kubectl's).
//!
//! What a person may change here is what `apply` may: `spec` (validated by the store's write
//! path), labels and annotations. The controllers' metadata (finalizers, owner references,
//! `boxery.dev/` annotations) and `status` are theirs: a change to them is refused with the
//! field named, never dropped in silence; `delete --force` is the way past a stuck finalizer.

use boxery_api::name::shown;
use boxery_api::{DynObject, KindInfo, Name};
use boxery_store::{ObjectRef, StoreError};
use serde_json::Value;

use crate::Verbs;
use crate::error::{Result, VerbError};
use crate::objects::DryRun;

/// Annotations with this prefix are the system's.
pub const SYSTEM_PREFIX: &str = "boxery.dev/";

/// How many times a change is read and applied again when the object moved on under it.
const RETRIES: usize = 10;

/// The two patch formats (`--type`). kubectl's `strategic` is taken as `merge`: boxery's
/// lists have no merge keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    /// RFC 7386: objects merge, `null` removes a field, a list is replaced whole.
    Merge,
    /// RFC 6902: a list of operations (`add`, `remove`, `replace`, `move`, `copy`, `test`).
    Json,
}

impl std::str::FromStr for PatchType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "merge" | "strategic" => Ok(PatchType::Merge),
            "json" => Ok(PatchType::Json),
            _ => Err(format!(
                "`{}` is not a patch type: use merge (strategic is taken as merge) or json",
                shown(s)
            )),
        }
    }
}

/// What a change did to one object.
#[derive(Debug, Clone)]
pub struct Changed {
    /// The object as stored now (with a dry run: as it would be stored).
    pub object: DynObject,
    /// Whether anything changed (kubectl's "patched" against "patched (no change)").
    pub changed: bool,
    /// Whether nothing was written (`--dry-run`).
    pub dry_run: bool,
}

/// The object `kind/name`, which must exist and be a kind people may change.
async fn load(v: &Verbs, info: &'static KindInfo, name: &str) -> Result<DynObject> {
    if let Some(instead) = info.controllers_only {
        return Err(VerbError::invalid(format!(
            "{} objects are written by boxery's controllers only: {instead}",
            info.kind
        )));
    }
    Name::for_kind(info, name).map_err(|e| VerbError::invalid(e.0))?;
    match v.store().get(&ObjectRef::new(info.kind, name)).await? {
        Some(o) if o.metadata.is_deleting() => Err(VerbError::conflict(format!(
            "{} {name} is being deleted",
            info.kind
        ))),
        Some(o) => Ok(o),
        None => Err(VerbError::not_found(format!(
            "{} {} not found: `boxery get {}` lists them",
            info.kind,
            shown(name),
            info.plural
        ))),
    }
}

/// Read `kind/name`, let `f` change a copy, and write it with the precondition; read again and
/// redo `f` when the object moved on. `f` returns an error to refuse the change. With a dry
/// run nothing is written: `Server` runs the store's write path and rolls it back, `Client`
/// stops after the checks made here.
pub async fn modify(
    v: &Verbs,
    info: &'static KindInfo,
    name: &str,
    dry: DryRun,
    verb: &str,
    f: impl Fn(&mut DynObject) -> Result<()>,
) -> Result<Changed> {
    let manager = v.manager(verb);
    let done = |object, changed| Changed {
        object,
        changed,
        dry_run: dry.is_dry(),
    };
    for _ in 0..RETRIES {
        let cur = load(v, info, name).await?;
        let mut new = cur.clone();
        f(&mut new)?;
        check_owned_fields(&cur, &new)?;
        crate::egress::check(v, &cur, &new)?;
        if same_as_stored(&cur, &new) {
            return Ok(done(cur, false));
        }
        new.metadata.resource_version = cur.metadata.resource_version.clone();
        let wrote = match dry {
            DryRun::Client => {
                let value = serde_json::to_value(&new).map_err(VerbError::failed)?;
                boxery_api::normalize(value).map_err(VerbError::invalid)?;
                return Ok(done(new, true));
            }
            DryRun::Server => v.store().update_dry_run_by(new, &manager).await,
            DryRun::None => v.store().update_by(new, &manager).await,
        };
        match wrote {
            Ok(object) => return Ok(done(object, true)),
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(invalid(e)),
        }
    }
    Err(VerbError::conflict(format!(
        "{} {name} kept changing under this command: try again",
        info.kind
    )))
}

/// Write what a person changed in an object they edited whole (`boxery edit`), as kubectl
/// does: the difference between the form they were shown (`shown`) and what they saved
/// (`edited`), as a merge patch on the object as it is now. A field they did not touch keeps
/// whatever a controller wrote meanwhile; a `resourceVersion` they changed is a precondition.
pub async fn apply_edit(
    v: &Verbs,
    info: &'static KindInfo,
    shown: &DynObject,
    edited: &Value,
    dry: DryRun,
) -> Result<Changed> {
    // What the person was shown (managedFields are not: leaving them out changes nothing).
    let before = crate::render::display_value(shown);
    if !edited.is_object() {
        return Err(VerbError::invalid("the edited document is not an object"));
    }
    for (field, what) in [("kind", "kind"), ("apiVersion", "apiVersion")] {
        if edited.get(field) != before.get(field) {
            return Err(VerbError::invalid(format!(
                "{what}: cannot be changed (it is {})",
                before[field]
            )));
        }
    }
    if edited["metadata"]["name"] != before["metadata"]["name"] {
        return Err(VerbError::invalid(format!(
            "metadata.name: cannot be changed (it is {}); to rename, create a new object and delete this one",
            before["metadata"]["name"]
        )));
    }
    let patch = merge_patch(&before, edited);
    modify(v, info, &shown.metadata.name, dry, "edit", |obj| {
        let mut doc = serde_json::to_value(&*obj).map_err(VerbError::failed)?;
        json_patch::merge(&mut doc, &patch);
        *obj = patched_object(obj, doc)?;
        Ok(())
    })
    .await
}

/// The JSON merge patch (RFC 7386) that turns `from` into `to`: changed fields, `null` for
/// removed ones, objects recursed into.
pub fn merge_patch(from: &Value, to: &Value) -> Value {
    match (from, to) {
        (Value::Object(a), Value::Object(b)) => {
            let mut out = serde_json::Map::new();
            for (k, va) in a {
                match b.get(k) {
                    None => {
                        out.insert(k.clone(), Value::Null);
                    }
                    Some(vb) if vb != va => {
                        out.insert(k.clone(), merge_patch(va, vb));
                    }
                    Some(_) => {}
                }
            }
            for (k, vb) in b {
                if !a.contains_key(k) {
                    out.insert(k.clone(), vb.clone());
                }
            }
            Value::Object(out)
        }
        _ => to.clone(),
    }
}

/// `doc` (the object after a patch) as an object, refused when it changed the kind or name or
/// carries a `resourceVersion` other than the object's (a precondition, as kubectl's).
fn patched_object(obj: &DynObject, doc: Value) -> Result<DynObject> {
    let patched: DynObject = serde_json::from_value(doc)
        .map_err(|e| VerbError::invalid(format!("the patched object is not valid: {e}")))?;
    if patched.metadata.name != obj.metadata.name || patched.kind != obj.kind {
        return Err(VerbError::invalid(
            "a patch cannot change an object's kind or name",
        ));
    }
    if let Some(rv) = &patched.metadata.resource_version
        && Some(rv) != obj.metadata.resource_version.as_ref()
    {
        return Err(VerbError::conflict(format!(
            "metadata.resourceVersion: the change is for {rv}, the object is at {} (it changed meanwhile)",
            obj.metadata.resource_version.as_deref().unwrap_or("")
        )));
    }
    Ok(patched)
}

/// `patch`: apply `patch` (JSON or YAML text) to `kind/name`.
pub async fn patch(
    v: &Verbs,
    info: &'static KindInfo,
    name: &str,
    ty: PatchType,
    patch: &str,
    dry: DryRun,
) -> Result<Changed> {
    let p: Value = boxery_api::codec::yaml_value(patch)
        .map_err(|e| VerbError::invalid(format!("the patch is not JSON or YAML: {e}")))?;
    let ops: Option<json_patch::Patch> = match ty {
        PatchType::Json => Some(serde_json::from_value(p.clone()).map_err(|e| {
            VerbError::invalid(format!(
                "a JSON patch is a list of operations such as [{{\"op\": \"replace\", \"path\": \"/spec/cpus\", \"value\": 2}}]: {e}"
            ))
        })?),
        PatchType::Merge if !p.is_object() => {
            return Err(VerbError::invalid(
                "a merge patch is an object such as {\"spec\": {\"cpus\": 2}}",
            ));
        }
        PatchType::Merge => None,
    };
    modify(v, info, name, dry, "patch", |obj| {
        let mut doc = serde_json::to_value(&*obj).map_err(VerbError::failed)?;
        match &ops {
            Some(ops) => json_patch::patch(&mut doc, ops)
                .map_err(|e| VerbError::invalid(format!("the JSON patch does not apply: {e}")))?,
            None => json_patch::merge(&mut doc, &p),
        }
        *obj = patched_object(obj, doc)?;
        Ok(())
    })
    .await
}

/// Which map `label`/`annotate` change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaMap {
    /// `metadata.labels`.
    Labels,
    /// `metadata.annotations`.
    Annotations,
}

/// One change of `label`/`annotate`: `KEY=VALUE` sets, `KEY-` removes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaChange {
    /// Set KEY to VALUE.
    Set(String, String),
    /// Remove KEY.
    Remove(String),
}

impl MetaChange {
    /// `KEY=VALUE` or `KEY-`; `None` for anything else (a name).
    pub fn parse(arg: &str) -> Option<MetaChange> {
        if let Some((k, val)) = arg.split_once('=') {
            return Some(MetaChange::Set(k.to_string(), val.to_string()));
        }
        arg.strip_suffix('-')
            .filter(|k| !k.is_empty())
            .map(|k| MetaChange::Remove(k.to_string()))
    }

    fn key(&self) -> &str {
        match self {
            MetaChange::Set(k, _) | MetaChange::Remove(k) => k,
        }
    }
}

/// `label`/`annotate` on one object: without `overwrite`, a key that already has another value
/// is refused (as kubectl). Keys of the system (`boxery.dev/`) are refused.
pub async fn set_meta(
    v: &Verbs,
    info: &'static KindInfo,
    name: &str,
    map: MetaMap,
    changes: &[MetaChange],
    overwrite: bool,
    dry: DryRun,
) -> Result<Changed> {
    if changes.is_empty() {
        return Err(VerbError::invalid(
            "name at least one change: KEY=VALUE sets it, KEY- removes it",
        ));
    }
    for c in changes {
        if c.key().starts_with(SYSTEM_PREFIX) {
            return Err(VerbError::invalid(format!(
                "{}: keys under {SYSTEM_PREFIX} are boxery's own",
                shown(c.key())
            )));
        }
    }
    let what = match map {
        MetaMap::Labels => "label",
        MetaMap::Annotations => "annotation",
    };
    modify(v, info, name, dry, what, |obj| {
        let m = match map {
            MetaMap::Labels => &mut obj.metadata.labels,
            MetaMap::Annotations => &mut obj.metadata.annotations,
        };
        for c in changes {
            match c {
                MetaChange::Set(k, val) => {
                    if let Some(old) = m.get(k)
                        && old != val
                        && !overwrite
                    {
                        return Err(VerbError::conflict(format!(
                            "{what} `{}` already has a value ({}): --overwrite replaces it",
                            shown(k),
                            shown(old)
                        )));
                    }
                    m.insert(k.clone(), val.clone());
                }
                MetaChange::Remove(k) => {
                    m.remove(k);
                }
            }
        }
        Ok(())
    })
    .await
}

/// `scale`: set a Pool's `spec.replicas` (the path a person or an autoscaler takes). With
/// `current`, only if the pool is at that many now (kubectl's `--current-replicas`).
pub async fn scale(
    v: &Verbs,
    pool: &str,
    replicas: u32,
    current: Option<u32>,
    dry: DryRun,
) -> Result<Changed> {
    let info = crate::objects::kind("pool")?;
    modify(v, info, pool, dry, "scale", |obj| {
        let spec = obj
            .rest
            .entry("spec")
            .or_insert_with(|| Value::Object(Default::default()));
        let now = spec.get("replicas").and_then(Value::as_u64).unwrap_or(0);
        if let Some(want) = current
            && now != u64::from(want)
        {
            return Err(VerbError::conflict(format!(
                "pool {pool} has {now} replicas, not {want} (--current-replicas)"
            )));
        }
        spec["replicas"] = Value::from(replicas);
        Ok(())
    })
    .await
}

/// Whether `new` would write nothing over `cur`.
fn same_as_stored(cur: &DynObject, new: &DynObject) -> bool {
    let strip = |o: &DynObject| {
        let mut o = o.clone();
        o.metadata.resource_version = None;
        o.rest.remove("status");
        o
    };
    strip(cur) == strip(new)
}

/// Refuse a change of what is not a person's to change here, naming the field.
fn check_owned_fields(cur: &DynObject, new: &DynObject) -> Result<()> {
    let (a, b) = (&cur.metadata, &new.metadata);
    let refuse = |field: &str, why: &str| {
        Err(VerbError::invalid(format!(
            "{field} cannot be changed here: {why}"
        )))
    };
    if a.uid != b.uid && b.uid.is_some() {
        return refuse("metadata.uid", "it is set by the store");
    }
    if a.generation != b.generation && b.generation.is_some() {
        return refuse("metadata.generation", "it is set by the store");
    }
    if a.creation_timestamp != b.creation_timestamp && b.creation_timestamp.is_some() {
        return refuse("metadata.creationTimestamp", "it is set by the store");
    }
    if a.finalizers != b.finalizers {
        return refuse(
            "metadata.finalizers",
            "they are the controllers' (a delete stuck on a broken backend: `boxery delete --force`)",
        );
    }
    if a.owner_references != b.owner_references {
        return refuse("metadata.ownerReferences", "they are the controllers'");
    }
    if a.managed_fields != b.managed_fields {
        return refuse(
            "metadata.managedFields",
            "the store records who set which field (`boxery describe` lists them)",
        );
    }
    let system = |m: &std::collections::BTreeMap<String, String>| {
        m.iter()
            .filter(|(k, _)| k.starts_with(SYSTEM_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    if system(&a.annotations) != system(&b.annotations) {
        return refuse(
            "metadata.annotations",
            "keys under boxery.dev/ are boxery's own",
        );
    }
    let status = |o: &DynObject| o.rest.get("status").cloned();
    if status(new).is_some() && status(cur) != status(new) {
        return refuse(
            "status",
            "it is written by the controllers (and a grant's approval by `boxery grant approve`)",
        );
    }
    Ok(())
}

/// A change the store refuses as invalid is invalid input.
fn invalid(e: StoreError) -> VerbError {
    // Kept whole: a front end may name each field (the API's 422 causes).
    e.into()
}
