//! The `boxery.dev/v1alpha1` kinds over HTTP: list, get, create, update, patch (merge, JSON,
//! strategic as merge, and server-side apply), delete, deletecollection, the `status`
//! subresource (read-only) and watch, each through the verbs and the store every other front
//! end uses.

use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_api::{DynObject, KindInfo, Selector};
use boxery_store::{ApplyOptions, ObjectRef, StoreError, WatchEvent};
use boxery_verbs::edit::PatchType;
use boxery_verbs::objects::{Deleted, DryRun};
use boxery_verbs::render::{display_value, safe};
use boxery_verbs::{Verbs, Voice};
use serde_json::{Value, json};

use crate::call::Call;
use crate::paging::{Cut, Page};
use crate::query::{FieldSelector, Params, wants_table};
use crate::scope::{self, Access};
use crate::status::{Failure, success};
use crate::tokens::Caller;
use crate::{GROUP_VERSION, Shared};

/// A handler's result.
pub type Reply = Result<Response, Failure>;

/// The kind served at `plural`.
pub fn kind_of(plural: &str) -> Result<&'static KindInfo, Failure> {
    boxery_api::KINDS
        .iter()
        .find(|k| k.plural == plural)
        .ok_or_else(|| {
            Failure::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("the server could not find the requested resource ({plural})"),
            )
        })
}

/// A JSON response.
pub fn json_reply(code: StatusCode, v: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// A field manager's name as the Kubernetes API takes it: 1 to 128 printable ASCII characters.
fn manager_name(m: &str) -> bool {
    (1..=128).contains(&m.len()) && m.chars().all(|c| c.is_ascii_graphic())
}

/// The verbs a caller's writes go through, under the write rules of [`boxery_store::guard`]:
/// an agent's lease token speaks as a tool (so an egress policy may only tighten), a person's
/// token as the CLI; the field manager is the
/// request's `fieldManager` (422 when malformed), else the client's name from its User-Agent.
pub(crate) fn verbs_for(
    sh: &Shared,
    caller: &Caller,
    p: &Params,
    headers: &HeaderMap,
) -> Result<Verbs, Failure> {
    use boxery_store::guard::Writer;
    let v = match &caller.scope {
        crate::tokens::Scope::Lease(l) => sh
            .verbs
            .in_voice(Voice::Tool)
            .guarded(Writer::Lease(l.clone())),
        _ => sh.verbs.guarded(Writer::Kubernetes),
    };
    if let Some(m) = p.field_manager.as_deref()
        && !manager_name(m)
    {
        return Err(Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "fieldManager: 1 to 128 printable ASCII characters",
        ));
    }
    let manager = p
        .field_manager
        .clone()
        .or_else(|| {
            headers
                .get(header::USER_AGENT)
                .and_then(|u| u.to_str().ok())
                .and_then(|u| u.split('/').next())
                .filter(|u| manager_name(u))
                .map(String::from)
        })
        .unwrap_or_else(|| "api".to_string());
    Ok(v.as_manager(&manager))
}

/// A request body (JSON, or YAML for apply) as a value.
fn body_value(body: &Bytes) -> Result<Value, Failure> {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return Ok(v);
    }
    let text = std::str::from_utf8(body)
        .map_err(|_| Failure::bad_request("the body is not UTF-8 JSON or YAML"))?;
    boxery_api::codec::yaml_value(text)
        .map_err(|e| Failure::bad_request(format!("the body is not JSON or YAML: {e}")))
}

/// The body of a create, update or apply, checked: its kind and name must be the path's;
/// `status` is the controllers' and dropped (as is `managedFields`, the server's); a
/// `metadata.namespace` is refused, as `boxery apply` refuses it.
fn body_in(info: &KindInfo, name: Option<&str>, mut v: Value) -> Result<Value, Failure> {
    let Some(m) = v.as_object_mut() else {
        return Err(Failure::bad_request("the body is not an object"));
    };
    m.remove("status");
    if m.get("kind").and_then(Value::as_str) != Some(info.kind) {
        return Err(Failure::bad_request(format!(
            "the body's kind is {}, the path's {}",
            m.get("kind").cloned().unwrap_or(Value::Null),
            info.kind
        )));
    }
    if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
        // a name given wins over a prefix (create names from one first: generate_name)
        meta.remove("generateName");
        if meta.contains_key("namespace") {
            let e = boxery_api::ValidationError {
                object: format!("{}/{}", info.kind, meta.get("name").and_then(Value::as_str).unwrap_or("")),
                errors: vec![boxery_api::validate::FieldError::new(
                    "metadata.namespace",
                    "boxery's kinds are cluster-scoped (a home has one set of names): remove metadata.namespace".into(),
                )],
            };
            return Err(Failure::from_store(&StoreError::Invalid(e)));
        }
    }
    if let Some(n) = name
        && v["metadata"]["name"].as_str() != Some(n)
    {
        return Err(Failure::bad_request(format!(
            "the body's metadata.name is {}, the path's {n}",
            v["metadata"]["name"]
        )));
    }
    Ok(v)
}

/// The object of a create or update, checked and with its defaults.
fn object_in(info: &KindInfo, name: Option<&str>, v: Value) -> Result<DynObject, Failure> {
    let v = body_in(info, name, v)?;
    boxery_api::normalize(v).map_err(|e| Failure::from_store(&StoreError::Invalid(e)))
}

/// The manifest of a server-side apply: checked (with its defaults, as [`object_in`]) but
/// given as sent, as `boxery apply` gives the store its manifests, so the applier owns the
/// fields it names and not the defaults it left out (a `runStrategy` `boxery stop` set, a
/// `replicas` `boxery scale` set).
fn manifest_in(info: &KindInfo, name: &str, v: Value) -> Result<DynObject, Failure> {
    let raw = body_in(info, Some(name), v)?;
    let checked = boxery_api::normalize(raw.clone())
        .map_err(|e| Failure::from_store(&StoreError::Invalid(e)))?;
    let mut given: DynObject = serde_json::from_value(raw)
        .map_err(|e| Failure::bad_request(format!("the manifest: {e}")))?;
    given.api_version.clone_from(&checked.api_version);
    given.kind.clone_from(&checked.kind);
    given.metadata.name.clone_from(&checked.metadata.name);
    Ok(given)
}

fn writable(info: &KindInfo) -> Result<(), Failure> {
    match info.controllers_only {
        Some(instead) => Err(Failure::method_not_allowed(format!(
            "{} objects are written by boxery's controllers only: {instead}",
            info.kind
        ))),
        None => Ok(()),
    }
}

/// An object as served, as a value (for selectors and Table cells).
fn served(o: &DynObject) -> Value {
    display_value(o)
}

/// An object as served, as JSON text: written straight from the object, with its
/// `managedFields` as Kubernetes serves them ([`crate::managed::complete`]; kubectl hides them
/// unless asked, `--show-managed-fields`).
fn served_bytes(o: &mut DynObject, out: &mut Vec<u8>) {
    crate::managed::complete(&mut o.metadata.managed_fields);
    serde_json::to_writer(&mut *out, &*o).expect("an object serializes");
}

/// A JSON response of bytes already written.
pub(crate) fn bytes_reply(code: StatusCode, body: Vec<u8>) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// One object's response.
fn object_reply(code: StatusCode, mut o: DynObject) -> Response {
    let mut b = Vec::with_capacity(2048);
    served_bytes(&mut o, &mut b);
    bytes_reply(code, b)
}

/// A list's `metadata`: its revision, and the next page's token when more remain.
fn list_meta(cut: &Cut) -> Value {
    let mut m = json!({"resourceVersion": cut.rv.to_string()});
    if let Some(c) = &cut.cont {
        m["continue"] = json!(c);
        m["remainingItemCount"] = json!(cut.remaining);
    }
    m
}

/// A `KindList` response, written object by object.
fn list_reply(info: &KindInfo, cut: &mut Cut) -> Response {
    let mut b = Vec::with_capacity(cut.items.len() * 2048 + 128);
    b.extend_from_slice(
        format!(
            r#"{{"apiVersion":"{GROUP_VERSION}","kind":"{}List","metadata":{},"items":["#,
            info.kind,
            list_meta(cut)
        )
        .as_bytes(),
    );
    for (i, o) in cut.items.iter_mut().enumerate() {
        if i > 0 {
            b.push(b',');
        }
        served_bytes(o, &mut b);
    }
    b.extend_from_slice(b"]}");
    bytes_reply(StatusCode::OK, b)
}

/// The Table of `objs` as JSON text: the columns `boxery get` prints (the `-o wide` ones at
/// priority 1), written row by row (a Table of 1,000 Vms is what `kubectl get vms` asks for).
pub fn table_bytes(kind: &str, objs: &[Value], rv: &str, include: Option<&str>) -> Vec<u8> {
    table_page(kind, objs, json!({"resourceVersion": rv}), include)
}

/// [`table_bytes`] with the list's `metadata` (a page's carries its `continue`).
fn table_page(kind: &str, objs: &[Value], meta: Value, include: Option<&str>) -> Vec<u8> {
    let wide = boxery_verbs::render::columns(kind, true);
    let defs: Vec<Value> = wide
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "type": "string",
                "format": if c.name == "NAME" { "name" } else { "" },
                "description": "",
                "priority": u8::from(c.wide),
            })
        })
        .collect();
    let mut b = Vec::with_capacity(objs.len() * 512 + 1024);
    let head = json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": defs,
    })
    .to_string();
    b.extend_from_slice(&head.as_bytes()[..head.len() - 1]);
    b.extend_from_slice(br#","rows":["#);
    let mut cells: Vec<String> = Vec::with_capacity(wide.len());
    for (i, o) in objs.iter().enumerate() {
        if i > 0 {
            b.push(b',');
        }
        cells.clear();
        cells.extend(wide.iter().map(|column| {
            let c = boxery_verbs::render::cell(column, o);
            match safe(&c) {
                std::borrow::Cow::Borrowed(_) => c,
                std::borrow::Cow::Owned(s) => s,
            }
        }));
        b.extend_from_slice(br#"{"cells":"#);
        serde_json::to_writer(&mut b, &cells).expect("strings serialize");
        b.extend_from_slice(br#","object":"#);
        match include {
            Some("None") => b.extend_from_slice(b"null"),
            Some("Object") => serde_json::to_writer(&mut b, o).expect("a value serializes"),
            _ => {
                b.extend_from_slice(
                    br#"{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":"#,
                );
                serde_json::to_writer(&mut b, &o["metadata"]).expect("a value serializes");
                b.push(b'}');
            }
        }
        b.push(b'}');
    }
    b.extend_from_slice(b"]}");
    b
}

/// GET of a collection: a list, a Table, or a watch.
pub async fn list(c: Call, Path(plural): Path<String>) -> Reply {
    let (sh, caller, p, include, headers) = (c.sh, c.caller, c.p, c.include, c.headers);
    let info = kind_of(&plural)?;
    scope::allow(&sh, &caller, Access::Read, info, None).await?;
    if p.is_watch() {
        not_ahead(&sh, &p).await?;
        return crate::watch::serve(sh, caller, info, p, wants_table(&headers), include).await;
    }
    let page = Page::of(&sh, info, &p).await?;
    not_ahead(&sh, &p).await?;
    let (labels, fields) = (p.labels()?, p.fields()?);
    let (objs, rev) = read_list_at(
        &sh,
        &caller,
        info,
        &labels,
        &fields,
        page.at(),
        page.after(),
    )
    .await?;
    let mut cut = page.cut(objs, rev);
    if wants_table(&headers) {
        let values: Vec<Value> = cut.items.iter().map(served).collect();
        let t = table_page(info.kind, &values, list_meta(&cut), include.as_deref());
        return Ok(bytes_reply(StatusCode::OK, t));
    }
    Ok(list_reply(info, &mut cut))
}

/// How long a list or watch from a revision the store has not reached waits for it, as the
/// Kubernetes API's watch cache does (`resourceVersionTooHighRetrySeconds`).
pub const AHEAD_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// A list or watch from a `resourceVersion` ahead of the store's: wait up to [`AHEAD_WAIT`]
/// for the store to reach it, then answer as the Kubernetes API does, 504 `Timeout` "Too large
/// resource version" with a `ResourceVersionTooLarge` cause and `retryAfterSeconds`, rather
/// than a watch that waits, silent, for a revision that may never come.
async fn not_ahead(sh: &Shared, p: &Params) -> Result<(), Failure> {
    let Some(want) = p
        .resource_version
        .as_deref()
        .and_then(|rv| rv.parse::<u64>().ok())
    else {
        return Ok(());
    };
    let store = sh.verbs.store();
    let now = store.revision().await?;
    if want <= now {
        return Ok(());
    }
    let mut events = store.watch(None, now);
    let reached = tokio::time::timeout(AHEAD_WAIT, async {
        use futures::StreamExt;
        while let Some(ev) = events.next().await {
            match ev {
                Ok((rev, _)) if rev >= want => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    })
    .await;
    if reached == Ok(true) {
        return Ok(());
    }
    let now = store.revision().await.unwrap_or(now);
    let mut f = Failure::new(
        StatusCode::GATEWAY_TIMEOUT,
        "Timeout",
        format!(
            "Too large resource version: {want}, current: {now}: the store has not reached that revision (list again, or watch from the list's resourceVersion)"
        ),
    );
    f.details = Some(json!({
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1,
    }));
    Err(f)
}

/// The objects of a kind a caller may see, matching the selectors, and the revision read at.
pub async fn read_list(
    sh: &Shared,
    caller: &Caller,
    info: &'static KindInfo,
    labels: &Selector,
    fields: &FieldSelector,
) -> Result<(Vec<DynObject>, u64), Failure> {
    read_list_at(sh, caller, info, labels, fields, None, None).await
}

/// [`read_list`] as it was at revision `at` when the store can still read it there (a paged
/// list's later pages: [`crate::paging`]), else as it is now; only names after `after` (the
/// last one a previous page served).
pub async fn read_list_at(
    sh: &Shared,
    caller: &Caller,
    info: &'static KindInfo,
    labels: &Selector,
    fields: &FieldSelector,
    at: Option<u64>,
    after: Option<&str>,
) -> Result<(Vec<DynObject>, u64), Failure> {
    let store = sh.verbs.store();
    let past = match at {
        Some(r) => store.list_at(info.kind, labels, r).await?.map(|o| (o, r)),
        None => None,
    };
    let (mut objs, rev) = match (past, fields.name()) {
        (Some(p), _) => p,
        (None, Some(n)) => {
            let rev = store.revision().await?;
            let one = store.get(&ObjectRef::new(info.kind, n)).await?;
            (
                one.into_iter()
                    .filter(|o| labels.matches(&o.metadata.labels))
                    .collect(),
                rev,
            )
        }
        (None, None) => store.list(info.kind, labels).await?,
    };
    let visible = scope::visible_in_list(sh, caller, info.kind).await?;
    // names a previous page served first: cheap, and before the served form is made
    objs.retain(|o| {
        after.is_none_or(|a| o.metadata.name.as_str() > a)
            && scope::sees(&visible, o)
            && (fields.is_empty() || fields.matches(&served(o)))
    });
    Ok((objs, rev))
}

/// GET of one object (and of its `status`).
pub async fn get(c: Call, Path((plural, name)): Path<(String, String)>) -> Reply {
    let (sh, caller, include, headers) = (c.sh, c.caller, c.include, c.headers);
    let info = kind_of(&plural)?;
    scope::allow(&sh, &caller, Access::Read, info, Some(&name)).await?;
    let o = sh
        .verbs
        .store()
        .get(&ObjectRef::new(info.kind, &name))
        .await?
        .ok_or_else(|| Failure::not_found(info.plural, &name))?;
    if wants_table(&headers) {
        let rv = o.metadata.resource_version.clone().unwrap_or_default();
        let t = table_bytes(info.kind, &[served(&o)], &rv, include.as_deref());
        return Ok(bytes_reply(StatusCode::OK, t));
    }
    Ok(object_reply(StatusCode::OK, o))
}

/// GET of `…/NAME/status`.
pub async fn get_status(
    c: Call,
    Path((plural, name, sub)): Path<(String, String, String)>,
) -> Reply {
    if sub != "status" {
        return Err(no_subresource(&plural, &sub));
    }
    get(c, Path((plural, name))).await
}

/// The 404 of a subresource that is not served: it says which are, not that the object is
/// missing.
fn no_subresource(plural: &str, sub: &str) -> Failure {
    Failure::new(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!(
            "the server could not find the requested resource: {plural} has no subresource `{}` (served: status, and scale of pools)",
            safe(sub)
        ),
    )
}

/// PUT or PATCH of `…/NAME/status`: refused, whoever asks.
pub async fn write_status(Path((plural, name, sub)): Path<(String, String, String)>) -> Reply {
    if sub != "status" {
        return Err(no_subresource(&plural, &sub));
    }
    Err(Failure::method_not_allowed(format!(
        "the status of {plural}/{name} is written by boxery's controllers only (a Grant is approved by a person at a terminal: `boxery grant approve NAME`)"
    ))
    .about(&plural, &name))
}

/// POST to a collection: create; a body without a name and with `metadata.generateName` is
/// named from it ([`crate::generate_name`]).
pub async fn create(c: Call, Path(plural): Path<String>, body: Bytes) -> Reply {
    let (sh, caller, p, headers) = (c.sh, c.caller, c.p, c.headers);
    let info = kind_of(&plural)?;
    writable(info)?;
    let mut value = body_value(&body)?;
    let prefix = crate::generate_name::prefix_of(&mut value);
    let mut attempt = 0;
    loop {
        attempt += 1;
        if let Some(prefix) = &prefix
            && let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut)
        {
            meta.insert(
                "name".into(),
                Value::String(crate::generate_name::make(info, prefix)?),
            );
        }
        let obj = object_in(info, None, value.clone())?;
        scope::allow(&sh, &caller, Access::Create, info, Some(&obj.metadata.name)).await?;
        let v = verbs_for(&sh, &caller, &p, &headers)?;
        match create_one(&v, obj, p.dry()?).await {
            Err(StoreError::AlreadyExists { .. })
                if prefix.is_some() && attempt < crate::generate_name::ATTEMPTS =>
            {
                continue;
            }
            Err(e) => return Err(Failure::from_store(&e)),
            Ok(made) => return Ok(object_reply(StatusCode::CREATED, made)),
        }
    }
}

/// Create `obj` (or say what a create would make, `dry`).
async fn create_one(v: &Verbs, obj: DynObject, dry: bool) -> Result<DynObject, StoreError> {
    if !dry {
        return v.store().create_by(obj, &v.manager("create")).await;
    }
    // apply would update a taken name: say what create would
    if v.store().get(&ObjectRef::to(&obj)).await?.is_some() {
        return Err(StoreError::AlreadyExists {
            kind: obj.kind.clone(),
            name: obj.metadata.name.clone(),
        });
    }
    let opts = ApplyOptions {
        dry_run: true,
        field_manager: Some(v.manager("create")),
        ..ApplyOptions::default()
    };
    v.store()
        .apply_all(vec![obj], &opts)
        .await?
        .into_iter()
        .next()
        .map(|(_, o)| o)
        .ok_or_else(|| StoreError::Unavailable {
            why: "the dry run made nothing".into(),
        })
}

/// PUT of one object: its labels, annotations and spec (the rest is the store's and the
/// controllers'), with its `resourceVersion` as a precondition when it carries one.
pub async fn replace(c: Call, Path((plural, name)): Path<(String, String)>, body: Bytes) -> Reply {
    let (sh, caller, p, headers) = (c.sh, c.caller, c.p, c.headers);
    let info = kind_of(&plural)?;
    writable(info)?;
    scope::allow(&sh, &caller, Access::Write, info, Some(&name)).await?;
    let new = object_in(info, Some(&name), body_value(&body)?)?;
    let v = verbs_for(&sh, &caller, &p, &headers)?;
    let dry = if p.dry()? {
        DryRun::Server
    } else {
        DryRun::None
    };
    let changed = boxery_verbs::edit::modify(&v, info, &name, dry, "update", |cur| {
        // checked against the object this write replaces, read once by `modify`
        crate::controllers_metadata::no_additions(cur, &new)
            .map_err(boxery_verbs::VerbError::Store)?;
        if let Some(rv) = &new.metadata.resource_version
            && Some(rv) != cur.metadata.resource_version.as_ref()
        {
            return Err(boxery_verbs::VerbError::Store(StoreError::Conflict {
                kind: cur.kind.clone(),
                name: cur.metadata.name.clone(),
                expected: rv.clone(),
                actual: cur.metadata.resource_version.clone().unwrap_or_default(),
            }));
        }
        cur.metadata.labels = new.metadata.labels.clone();
        // boxery's own annotations stay as they are; the rest are the caller's
        let system: Vec<(String, String)> = cur
            .metadata
            .annotations
            .iter()
            .filter(|(k, _)| k.starts_with(boxery_verbs::edit::SYSTEM_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        cur.metadata.annotations = new
            .metadata
            .annotations
            .iter()
            .filter(|(k, _)| !k.starts_with(boxery_verbs::edit::SYSTEM_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(system)
            .collect();
        // `new` has no status (object_in drops it): the stored one stays
        let status = cur.rest.remove("status");
        cur.rest = new.rest.clone();
        if let Some(s) = status {
            cur.rest.insert("status".into(), s);
        }
        Ok(())
    })
    .await?;
    Ok(object_reply(StatusCode::OK, changed.object))
}

/// PATCH of one object.
pub async fn patch(c: Call, Path((plural, name)): Path<(String, String)>, body: Bytes) -> Reply {
    let (sh, caller, p, headers) = (c.sh, c.caller, c.p, c.headers);
    let info = kind_of(&plural)?;
    writable(info)?;
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let v = verbs_for(&sh, &caller, &p, &headers)?;
    let dry = p.dry()?;
    if ctype == "application/apply-patch+yaml" || ctype == "application/apply-patch+json" {
        if p.field_manager.as_deref().unwrap_or("").is_empty() {
            return Err(Failure::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "fieldManager is required for apply requests",
            ));
        }
        let obj = manifest_in(info, &name, body_value(&body)?)?;
        let stored = v.store().get(&ObjectRef::to(&obj)).await?;
        if let Some(cur) = &stored {
            crate::controllers_metadata::no_additions(cur, &obj)?;
        }
        let exists = stored.is_some();
        let access = if exists {
            Access::Write
        } else {
            Access::Create
        };
        scope::allow(&sh, &caller, access, info, Some(&name)).await?;
        let applied = boxery_verbs::objects::apply(
            &v,
            vec![obj],
            ApplyOptions {
                dry_run: dry,
                field_manager: Some(v.manager("apply")),
                force_conflicts: p.forced(),
                ..ApplyOptions::default()
            },
        )
        .await?;
        let o = applied
            .results
            .into_iter()
            .next()
            .map(|(_, o)| o)
            .ok_or_else(|| Failure::bad_request("nothing to apply"))?;
        let code = if exists {
            StatusCode::OK
        } else {
            StatusCode::CREATED
        };
        return Ok(object_reply(code, o));
    }
    let ty = match ctype.as_str() {
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
            PatchType::Merge
        }
        "application/json-patch+json" => PatchType::Json,
        other => {
            return Err(Failure::unsupported(format!(
                "the patch's Content-Type `{other}` is not one of application/merge-patch+json, application/strategic-merge-patch+json (applied as a merge patch), application/json-patch+json, application/apply-patch+yaml"
            )));
        }
    };
    if p.force.is_some() {
        // as the Kubernetes API: force takes fields over in an apply, and means nothing else
        return Err(Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "force is for server-side apply only (Content-Type application/apply-patch+yaml, kubectl apply --server-side --force-conflicts): drop it from this patch",
        ));
    }
    scope::allow(&sh, &caller, Access::Write, info, Some(&name)).await?;
    let text = without_status(ty, &body)?;
    let dry = if dry { DryRun::Server } else { DryRun::None };
    let changed = boxery_verbs::edit::patch(&v, info, &name, ty, &text, dry).await?;
    Ok(object_reply(StatusCode::OK, changed.object))
}

/// The patch without what it says of `status`: as with the Kubernetes API's status
/// subresource, the main resource ignores status changes (`kubectl edit` sends the status it
/// was shown, changed or not), and the status is the controllers' alone.
fn without_status(ty: PatchType, body: &Bytes) -> Result<String, Failure> {
    let mut p = body_value(body)?;
    match (ty, &mut p) {
        (PatchType::Merge, Value::Object(m)) => {
            m.remove("status");
        }
        (PatchType::Json, Value::Array(ops)) => ops.retain(|op| {
            let path = op["path"].as_str().unwrap_or("");
            let from = op["from"].as_str().unwrap_or("");
            !(path == "/status"
                || path.starts_with("/status/")
                || from == "/status"
                || from.starts_with("/status/"))
        }),
        _ => {}
    }
    Ok(p.to_string())
}

/// DELETE of one object: gone (a success Status), or marked while its finalizers run (the
/// object, with its deletionTimestamp). Its options come from the query and the
/// `DeleteOptions` body ([`crate::options`]): a dry run writes nothing, stale preconditions
/// are a 409.
pub async fn delete(c: Call, Path((plural, name)): Path<(String, String)>, body: Bytes) -> Reply {
    let (sh, caller, p, headers) = (c.sh, c.caller, c.p, c.headers);
    let info = kind_of(&plural)?;
    writable(info)?;
    scope::allow(&sh, &caller, Access::Delete, info, Some(&name)).await?;
    let opts = crate::options::delete_options(&p, &body)?;
    let v = verbs_for(&sh, &caller, &p, &headers)?;
    let key = ObjectRef::new(info.kind, &name);
    let Some(before) = v.store().get(&key).await? else {
        return Err(Failure::not_found(info.plural, &name));
    };
    opts.check(&before, info.plural)?;
    if opts.dry {
        return Ok(object_reply(StatusCode::OK, before));
    }
    match boxery_verbs::objects::delete(&v, info, std::slice::from_ref(&name))
        .await?
        .pop()
    {
        Some(Deleted::Deleting(_)) => match v.store().get(&key).await? {
            Some(o) => Ok(object_reply(StatusCode::OK, o)),
            None => Ok(json_reply(
                StatusCode::OK,
                &success(info.plural, &name, before.metadata.uid.as_deref()),
            )),
        },
        _ => Ok(json_reply(
            StatusCode::OK,
            &success(info.plural, &name, before.metadata.uid.as_deref()),
        )),
    }
}

/// DELETE of a collection: every object matching the selectors, with the options of
/// [`delete`] (preconditions name one object: refused here).
pub async fn delete_collection(c: Call, Path(plural): Path<String>, body: Bytes) -> Reply {
    let (sh, caller, p, headers) = (c.sh, c.caller, c.p, c.headers);
    let info = kind_of(&plural)?;
    writable(info)?;
    scope::allow(&sh, &caller, Access::Delete, info, None).await?;
    let opts = crate::options::delete_options(&p, &body)?;
    if opts.has_preconditions() {
        return Err(Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "preconditions name one object (its uid, its resourceVersion): delete it by name",
        ));
    }
    let dry = opts.dry;
    let (objs, rev) = read_list(&sh, &caller, info, &p.labels()?, &p.fields()?).await?;
    let v = verbs_for(&sh, &caller, &p, &headers)?;
    let names: Vec<String> = objs.iter().map(|o| o.metadata.name.clone()).collect();
    if !names.is_empty() && !dry {
        boxery_verbs::objects::delete(&v, info, &names).await?;
    }
    let values: Vec<Value> = objs.iter().map(served).collect();
    Ok(json_reply(
        StatusCode::OK,
        &json!({
            "apiVersion": GROUP_VERSION,
            "kind": format!("{}List", info.kind),
            "metadata": {"resourceVersion": rev.to_string()},
            "items": values,
        }),
    ))
}

/// One watch event's line; `table_of`: as a one-row Table at this revision.
pub fn event_line(
    kind: &str,
    ev: WatchEvent,
    table_of: Option<&str>,
    include: Option<&str>,
) -> Bytes {
    let (ty, mut o) = match ev {
        WatchEvent::Added(o) => ("ADDED", o),
        WatchEvent::Modified(o) => ("MODIFIED", o),
        WatchEvent::Deleted(o) => ("DELETED", o),
    };
    let mut b = Vec::with_capacity(2048);
    b.extend_from_slice(format!(r#"{{"type":"{ty}","object":"#).as_bytes());
    match table_of {
        Some(rv) => b.extend(table_bytes(kind, &[served(&o)], rv, include)),
        None => served_bytes(&mut o, &mut b),
    }
    b.extend_from_slice(b"}\n");
    Bytes::from(b)
}
