//! A person's changes to one stored object, as kubectl makes them: `edit` (the whole object,
//! in an editor: the CLI does the editing, [`apply_edit`] writes what changed), `patch` (JSON
//! merge patch or JSON patch), `label` and `annotate`, `scale`. Each is a read-modify-write
//! with the `resourceVersion` precondition: when the object moved on, it is read again and the
//! change applied to it (a `resourceVersion` the person wrote into their change is kept as a
//! precondition, as kubectl's).
//!
//! What a person may change here is what `apply` may: `spec` (validated by the store's write
//! path), labels and annotations. The controllers' metadata (finalizers, owner references,
//! `boxery.dev/` labels and annotations) and `status` are theirs: a change to them is refused with the
//! field named, never dropped in silence; `delete --force` is the way past a stuck finalizer.

use boxery_api::codec::MAX_OBJECT_BYTES;
use boxery_api::name::shown;
use boxery_api::{DynObject, KindInfo, Name};
use boxery_store::{ObjectRef, StoreError};
use serde_json::Value;

use crate::Verbs;
use crate::error::{Result, VerbError};
use crate::objects::DryRun;

/// Labels and annotations with this prefix are the system's (the store's one definition).
pub use boxery_store::guard::SYSTEM_PREFIX;

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
        crate::loosen::check(v, &cur, &new)?;
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
        apply_merge_bounded(&mut doc, &patch, MAX_OBJECT_BYTES).map_err(VerbError::invalid)?;
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
    if let Some(ops) = p.as_array()
        && ops.len() > MAX_PATCH_OPERATIONS
    {
        return Err(VerbError::invalid(format!(
            "the JSON patch has {} operations; a patch may have at most {MAX_PATCH_OPERATIONS}",
            ops.len()
        )));
    }
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
            Some(ops) => apply_json_patch_bounded(&mut doc, ops, MAX_OBJECT_BYTES)
                .map_err(|e| VerbError::invalid(format!("the JSON patch does not apply: {e}")))?,
            None => {
                apply_merge_bounded(&mut doc, &p, MAX_OBJECT_BYTES).map_err(VerbError::invalid)?
            }
        }
        *obj = patched_object(obj, doc)?;
        Ok(())
    })
    .await
}

/// The most operations one JSON patch may have (far above what a person or a tool writes;
/// each operation costs at most the size of what it moves, so this bounds a patch's work).
pub const MAX_PATCH_OPERATIONS: usize = 1_000;

/// The bytes a JSON patch's `copy` operations may copy, in all (as Kubernetes bounds them):
/// with the object limit and [`MAX_PATCH_OPERATIONS`], what a patch can make the server do
/// is linear in its own size.
pub const MAX_PATCH_COPIED_BYTES: usize = MAX_OBJECT_BYTES;

/// A sink that counts bytes and fails past `cap`.
struct Count {
    n: usize,
    cap: usize,
}

impl std::io::Write for Count {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.n = self.n.saturating_add(b.len());
        if self.n > self.cap {
            return Err(std::io::Error::other("over the cap"));
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The length of `v` as compact JSON, or `None` when it is over `cap` (found without
/// writing more than `cap` bytes anywhere).
pub(crate) fn json_len_upto<T: serde::Serialize + ?Sized>(v: &T, cap: usize) -> Option<usize> {
    let mut c = Count { n: 0, cap };
    serde_json::to_writer(&mut c, v).ok().map(|()| c.n)
}

/// The length of `v` as compact JSON.
fn json_len<T: serde::Serialize + ?Sized>(v: &T) -> usize {
    json_len_upto(v, usize::MAX).unwrap_or(usize::MAX)
}

/// Why one JSON patch operation failed (the wording of the `json_patch` crate's errors).
const INVALID_PATH: &str = "path is invalid";
const INVALID_FROM: &str = "\"from\" path is invalid";

/// Take the value at `path` out of `doc`: it and the bytes its place took besides the value
/// (key, colon, comma).
fn take(doc: &mut Value, path: &json_patch::jsonptr::Pointer) -> Result<(Value, usize), String> {
    let (parent, last) = path.split_back().ok_or(INVALID_PATH)?;
    match doc.pointer_mut(parent.as_str()).ok_or(INVALID_PATH)? {
        Value::Object(m) => {
            let key = last.decoded();
            let v = m.remove(key.as_ref()).ok_or(INVALID_PATH)?;
            Ok((v, json_len(key.as_ref()) + 1 + usize::from(!m.is_empty())))
        }
        Value::Array(a) => {
            let i = last
                .to_index()
                .ok()
                .and_then(|i| i.for_len(a.len()).ok())
                .ok_or(INVALID_PATH)?;
            let v = a.remove(i);
            Ok((v, usize::from(!a.is_empty())))
        }
        _ => Err(INVALID_PATH.into()),
    }
}

/// Put `value` at `path` in `doc` (RFC 6902 `add`), when the document's size after it is
/// within `limit`; `size`: the document's size now, less `vlen`'s worth when the value's own
/// bytes are already counted (a move). Returns the size after.
fn put(
    doc: &mut Value,
    path: &json_patch::jsonptr::Pointer,
    value: Value,
    size: usize,
    vlen: usize,
    limit: usize,
) -> Result<usize, String> {
    let over = |n: usize| {
        format!(
            "the object would grow to {} KiB or more; an object may be at most {} KiB",
            n >> 10,
            limit >> 10
        )
    };
    let Some((parent, last)) = path.split_back() else {
        // the whole document replaced
        let n = json_len_upto(&value, limit).ok_or_else(|| over(limit + 1))?;
        *doc = value;
        return Ok(n);
    };
    match doc.pointer_mut(parent.as_str()).ok_or(INVALID_PATH)? {
        Value::Object(m) => {
            let key = last.decoded().into_owned();
            let n = match m.get(&key) {
                Some(old) => (size + vlen).saturating_sub(json_len(old)),
                None => size + vlen + json_len(&key) + 1 + usize::from(!m.is_empty()),
            };
            if n > limit {
                return Err(over(n));
            }
            m.insert(key, value);
            Ok(n)
        }
        Value::Array(a) => {
            let i = last
                .to_index()
                .ok()
                .and_then(|i| i.for_len_incl(a.len()).ok())
                .ok_or(INVALID_PATH)?;
            let n = size + vlen + usize::from(!a.is_empty());
            if n > limit {
                return Err(over(n));
            }
            a.insert(i, value);
            Ok(n)
        }
        _ => Err(INVALID_PATH.into()),
    }
}

/// Apply a JSON patch (RFC 6902) to `doc`, refusing it as soon as an operation would make the
/// document larger than `limit` bytes of compact JSON, before that operation is applied: the
/// size is kept exactly as the operations go (each costs the size of what it adds or takes,
/// never of the whole document), so a patch that doubles the document with `copy` is refused
/// at the first copy past the limit, not after memory ran out. At most
/// [`MAX_PATCH_OPERATIONS`] operations and [`MAX_PATCH_COPIED_BYTES`] copied. On an error
/// `doc` is left half-patched: callers discard it.
pub fn apply_json_patch_bounded(
    doc: &mut Value,
    ops: &[json_patch::PatchOperation],
    limit: usize,
) -> std::result::Result<(), String> {
    apply_tracked(doc, ops, limit).map(drop)
}

/// [`apply_json_patch_bounded`], returning the size it kept (the document's compact JSON
/// length after the patch).
fn apply_tracked(
    doc: &mut Value,
    ops: &[json_patch::PatchOperation],
    limit: usize,
) -> std::result::Result<usize, String> {
    use json_patch::PatchOperation as Op;
    if ops.len() > MAX_PATCH_OPERATIONS {
        return Err(format!(
            "{} operations; a patch may have at most {MAX_PATCH_OPERATIONS}",
            ops.len()
        ));
    }
    let mut size = json_len_upto(doc, limit).ok_or_else(|| {
        format!(
            "the object is already over {} KiB, the most an object may be",
            limit >> 10
        )
    })?;
    let mut copied = 0usize;
    for (i, op) in ops.iter().enumerate() {
        let failed =
            |why: String| format!("operation '/{i}' failed at path '{}': {why}", op.path());
        size = match op {
            Op::Add(o) => {
                let vlen = json_len(&o.value);
                put(doc, &o.path, o.value.clone(), size, vlen, limit)
            }
            Op::Remove(o) => take(doc, &o.path).map(|(v, place)| size - place - json_len(&v)),
            Op::Replace(o) => match doc.pointer_mut(o.path.as_str()) {
                None => Err(INVALID_PATH.to_string()),
                Some(target) => {
                    let n = (size + json_len(&o.value)).saturating_sub(json_len(&*target));
                    if n > limit {
                        Err(format!(
                            "the object would grow to {} KiB; an object may be at most {} KiB",
                            n >> 10,
                            limit >> 10
                        ))
                    } else {
                        *target = o.value.clone();
                        Ok(n)
                    }
                }
            },
            Op::Move(o) => {
                if o.path.starts_with(&o.from) && o.path.len() != o.from.len() {
                    Err("cannot move the value inside itself".to_string())
                } else {
                    match take(doc, &o.from) {
                        Err(_) => Err(INVALID_FROM.to_string()),
                        // the value's own bytes stay counted in `size`: only its place changes
                        Ok((v, place)) => put(doc, &o.path, v, size - place, 0, limit),
                    }
                }
            }
            Op::Copy(o) => match doc.pointer(o.from.as_str()) {
                None => Err(INVALID_FROM.to_string()),
                Some(src) => {
                    let room = limit.min(MAX_PATCH_COPIED_BYTES - copied);
                    match json_len_upto(src, room) {
                        None => Err(format!(
                            "it copies more than {} KiB (the object may be at most {} KiB, and a patch may copy at most {} KiB in all)",
                            room >> 10,
                            limit >> 10,
                            MAX_PATCH_COPIED_BYTES >> 10
                        )),
                        Some(vlen) => {
                            copied += vlen;
                            let v = src.clone();
                            put(doc, &o.path, v, size, vlen, limit)
                        }
                    }
                }
            },
            Op::Test(o) => match doc.pointer(o.path.as_str()) {
                None => Err(INVALID_PATH.to_string()),
                Some(v) if *v == o.value => Ok(size),
                Some(_) => Err("value did not match".to_string()),
            },
        }
        .map_err(failed)?;
    }
    Ok(size)
}

/// Apply a JSON merge patch (RFC 7386) to `doc` within `limit` bytes. A merge patch puts each
/// of its values in at most once, so the result is at most the document and the patch
/// together: a patch larger than the limit is refused before it is applied, and the result
/// is measured after.
pub fn apply_merge_bounded(
    doc: &mut Value,
    patch: &Value,
    limit: usize,
) -> std::result::Result<(), String> {
    if json_len_upto(patch, limit).is_none() {
        return Err(format!(
            "the merge patch is over {} KiB, the most an object may be",
            limit >> 10
        ));
    }
    json_patch::merge(doc, patch);
    if json_len_upto(doc, limit).is_none() {
        return Err(format!(
            "the patched object is over {} KiB; an object may be at most {} KiB",
            limit >> 10,
            limit >> 10
        ));
    }
    Ok(())
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

/// Refuse `new` when its labels or annotations under `boxery.dev/` differ from `cur`'s (none
/// when it is new): they are boxery's own (a pool's membership, an apply set, a wake-up, a
/// start from memory), on every write a caller makes. The apply record (`last-applied`) is
/// the apply's own and is left to it.
pub(crate) fn same_system_labels(cur: Option<&DynObject>, new: &DynObject) -> Result<()> {
    fn system(m: Option<&std::collections::BTreeMap<String, String>>) -> Vec<(&String, &String)> {
        m.map(|m| {
            m.iter()
                .filter(|(k, _)| {
                    k.starts_with(SYSTEM_PREFIX) && k.as_str() != boxery_store::LAST_APPLIED
                })
                .collect()
        })
        .unwrap_or_default()
    }
    fn labels(o: Option<&DynObject>) -> Vec<(&String, &String)> {
        system(o.map(|o| &o.metadata.labels))
    }
    fn annotations(o: Option<&DynObject>) -> Vec<(&String, &String)> {
        system(o.map(|o| &o.metadata.annotations))
    }
    if labels(cur) != labels(Some(new)) {
        return Err(VerbError::forbidden(
            "metadata.labels cannot be changed here: keys under boxery.dev/ are boxery's own (a pool's membership, an apply set)",
        ));
    }
    if annotations(cur) != annotations(Some(new)) {
        return Err(VerbError::forbidden(
            "metadata.annotations cannot be changed here: keys under boxery.dev/ are boxery's own (a wake-up, a start from memory)",
        ));
    }
    Ok(())
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
    same_system_labels(Some(cur), new)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ops(v: Value) -> json_patch::Patch {
        serde_json::from_value(v).unwrap()
    }

    /// The reported attack: `copy` of a subtree into itself doubles the document at each
    /// operation. It is refused at the first operation past the limit, before that copy is
    /// made: the document never grows past the limit.
    #[test]
    fn a_self_copying_patch_is_refused_before_it_outgrows_the_limit() {
        let mut doc = json!({"kind": "Vm", "spec": {"x": "a".repeat(64)}});
        let p: Vec<Value> = (0..64)
            .map(|i| json!({"op": "copy", "from": "/spec", "path": format!("/spec/y{i}")}))
            .collect();
        let p = ops(Value::Array(p));
        let t = std::time::Instant::now();
        let e = apply_json_patch_bounded(&mut doc, &p, MAX_OBJECT_BYTES).unwrap_err();
        assert!(e.contains("at most 1024 KiB"), "{e}");
        assert!(json_len(&doc) <= MAX_OBJECT_BYTES);
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        // and with `add` of a copy made elsewhere, and `move` in circles: the same bound
        let mut doc = json!({"a": "b".repeat(1000)});
        let p: Vec<Value> = (0..1000)
            .map(|i| json!({"op": "add", "path": format!("/k{i}"), "value": "c".repeat(2000)}))
            .collect();
        let e = apply_json_patch_bounded(&mut doc, &ops(Value::Array(p)), MAX_OBJECT_BYTES)
            .unwrap_err();
        assert!(e.contains("at most 1024 KiB"), "{e}");
    }

    #[test]
    fn operations_and_copies_are_bounded() {
        let mut doc = json!({"a": 1});
        let p: Vec<Value> = (0..=MAX_PATCH_OPERATIONS)
            .map(|_| json!({"op": "test", "path": "/a", "value": 1}))
            .collect();
        let e = apply_json_patch_bounded(&mut doc, &ops(Value::Array(p)), MAX_OBJECT_BYTES)
            .unwrap_err();
        assert!(e.contains("at most 1000"), "{e}");
        // copy then remove, again and again: the document stays small, the copying does not
        let mut doc = json!({"a": "x".repeat(100 << 10)});
        let mut p = Vec::new();
        for _ in 0..20 {
            p.push(json!({"op": "copy", "from": "/a", "path": "/b"}));
            p.push(json!({"op": "remove", "path": "/b"}));
        }
        let e = apply_json_patch_bounded(&mut doc, &ops(Value::Array(p)), MAX_OBJECT_BYTES)
            .unwrap_err();
        assert!(e.contains("operation '/20'"), "{e}");
        assert!(e.contains("copy at most 1024 KiB in all"), "{e}");
    }

    /// The size kept as the operations go is the document's exact size, and the result and
    /// the errors are the `json_patch` crate's, over many operations of every kind on
    /// objects and arrays (a fixed pseudo-random sequence: a failure is reproducible).
    #[test]
    fn the_kept_size_is_exact_and_the_result_is_rfc_6902s() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let paths = [
            "",
            "/a",
            "/b",
            "/a/x",
            "/a/y",
            "/l",
            "/l/0",
            "/l/1",
            "/l/-",
            "/l/5",
            "/a/x/0",
            "/q~1r",
            "/a/\u{e9}\"",
            "/l/0/z",
        ];
        let values = [
            json!(1),
            json!("s"),
            json!({"x": [1, 2], "y": null}),
            json!([]),
            json!({}),
            json!([{"z": "w"}]),
        ];
        let kinds = ["add", "remove", "replace", "move", "copy", "test"];
        let (mut agreed, mut failed) = (0, 0);
        for _ in 0..3000 {
            let mut doc = json!({"a": {"x": [0]}, "l": [1, {"z": 2}], "q/r": true});
            let n = 1 + next(6) as usize;
            let p: Vec<Value> = (0..n)
                .map(|_| {
                    let mut op = json!({
                        "op": kinds[next(kinds.len() as u64) as usize],
                        "path": paths[next(paths.len() as u64) as usize],
                        "from": paths[next(paths.len() as u64) as usize],
                    });
                    op["value"] = values[next(values.len() as u64) as usize].clone();
                    op
                })
                .collect();
            let p = ops(Value::Array(p));
            let mut theirs = doc.clone();
            let want = json_patch::patch_unsafe(&mut theirs, &p);
            let got = apply_tracked(&mut doc, &p, MAX_OBJECT_BYTES);
            match (want, got) {
                (Ok(()), Ok(size)) => {
                    assert_eq!(doc, theirs, "{p:?}");
                    assert_eq!(size, serde_json::to_vec(&doc).unwrap().len(), "{p:?}");
                    agreed += 1;
                }
                (Err(w), Err(g)) => {
                    assert_eq!(w.to_string(), g, "{p:?}");
                    failed += 1;
                }
                (w, g) => panic!("{p:?}: json_patch {w:?}, bounded {g:?}"),
            }
        }
        assert!(
            agreed > 300 && failed > 300,
            "{agreed} applied, {failed} failed"
        );
    }

    #[test]
    fn a_merge_patch_is_bounded_too() {
        let mut doc = json!({"spec": {}});
        let big = json!({"spec": {"x": "y".repeat(MAX_OBJECT_BYTES)}});
        assert!(apply_merge_bounded(&mut doc, &big, MAX_OBJECT_BYTES).is_err());
        let half = json!({"a": "y".repeat(MAX_OBJECT_BYTES / 2 + 10)});
        apply_merge_bounded(&mut doc, &half, MAX_OBJECT_BYTES).unwrap();
        let other = json!({"b": "y".repeat(MAX_OBJECT_BYTES / 2 + 10)});
        let e = apply_merge_bounded(&mut doc, &other, MAX_OBJECT_BYTES).unwrap_err();
        assert!(e.contains("at most 1024 KiB"), "{e}");
    }
}
