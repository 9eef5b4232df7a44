//! `kubectl auth can-i`: `SelfSubjectAccessReview` and `SelfSubjectRulesReview`
//! (`authorization.k8s.io/v1`), answered from the caller's token scope ([`crate::scope`]) and
//! what the API serves, by the same checks the requests themselves go through: a `yes` is a
//! request that passes them, a `no` one that does not (with the reason the request would get).
//!
//! What the answer does not cover is what boxery checks field by field after the scope (a
//! lease token may update its VM but not its `spec.source`, an agent may only tighten an
//! egress policy: `boxery_store::guard`): as with Kubernetes' RBAC and its admission, `can-i
//! update` says whether the request is let in, not whether every change in it is.

use axum::body::Bytes;
use axum::http::StatusCode;
use boxery_api::{KINDS, KindInfo};
use serde_json::{Value, json};

use crate::call::Call;
use crate::resources::{Reply, json_reply};
use crate::scope::{self, Access};
use crate::status::Failure;
use crate::tokens::{Caller, Scope};
use crate::{GROUP, Shared};

/// The group.
pub const AUTHZ_GROUP: &str = "authorization.k8s.io";
/// `authorization.k8s.io/v1`.
pub const AUTHZ_GROUP_VERSION: &str = "authorization.k8s.io/v1";

/// The verbs of the main resources.
const VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];

/// An answer: allowed, and why not.
type Answer = (bool, String);

fn no(why: impl Into<String>) -> Answer {
    (false, why.into())
}

/// The access a verb is, with whether it names one object's collection (`list`,
/// `deletecollection`: no name).
fn access_of(verb: &str) -> Option<(Access, bool)> {
    Some(match verb {
        "get" | "watch" => (Access::Read, false),
        "list" => (Access::Read, true),
        "create" => (Access::Create, true),
        "update" | "patch" => (Access::Write, false),
        "delete" => (Access::Delete, false),
        "deletecollection" => (Access::Delete, true),
        _ => return None,
    })
}

/// Whether `caller` may `verb` `resource`/`sub` of `group` (`name`: one object).
async fn resource_answer(
    sh: &Shared,
    caller: &Caller,
    group: &str,
    resource: &str,
    sub: &str,
    verb: &str,
    name: Option<&str>,
) -> Answer {
    if verb == "*" {
        let mut why = Vec::new();
        for v in VERBS {
            let (ok, w) =
                Box::pin(resource_answer(sh, caller, group, resource, sub, v, name)).await;
            if !ok {
                why.push(format!("not every verb: {v}: {w}"));
            }
        }
        return if why.is_empty() {
            (true, String::new())
        } else {
            no(why.swap_remove(0))
        };
    }
    if resource == "*" {
        // every resource served: allowed when each is
        let mut why = Vec::new();
        for k in &KINDS {
            let (ok, w) =
                Box::pin(resource_answer(sh, caller, GROUP, k.plural, "", verb, name)).await;
            if !ok {
                why.push(format!("not every resource: {}: {w}", k.plural));
            }
        }
        return if why.is_empty() {
            (true, String::new())
        } else {
            no(why.swap_remove(0))
        };
    }
    let Some((access, collection)) = access_of(verb) else {
        return no(format!("the API serves no verb `{verb}`"));
    };
    if group.is_empty() && resource == "events" && sub.is_empty() {
        // `/api/v1/events`: a list, of the Events the caller may see
        if verb != "list" {
            return no("core v1 events are served as a list only (GET /api/v1/events)");
        }
        let info = boxery_api::lookup_kind("Event").expect("the Event kind");
        return allowed(sh, caller, Access::Read, info, None).await;
    }
    let Some(info) = KINDS
        .iter()
        .find(|k| k.plural == resource && (group == GROUP || group == "*"))
    else {
        return no(format!(
            "the server does not serve {resource} in group `{group}` (it serves boxery.dev's kinds and core v1 events)"
        ));
    };
    let name = if collection { None } else { name };
    match sub {
        "" => {
            if access != Access::Read
                && let Some(instead) = info.controllers_only
            {
                return no(format!(
                    "{} objects are written by boxery's controllers only: {instead}",
                    info.kind
                ));
            }
            allowed(sh, caller, access, info, name).await
        }
        "status" if verb == "get" => allowed(sh, caller, access, info, name).await,
        "status" => no(format!(
            "the status of {} is written by boxery's controllers only",
            info.plural
        )),
        "scale" if info.kind == "Pool" && matches!(verb, "get" | "update" | "patch") => {
            allowed(sh, caller, access, info, name).await
        }
        other => no(format!(
            "{} has no subresource `{other}` served with verb {verb} (served: status (get), and scale of pools (get, update, patch))",
            info.plural
        )),
    }
}

async fn allowed(
    sh: &Shared,
    caller: &Caller,
    access: Access,
    info: &KindInfo,
    name: Option<&str>,
) -> Answer {
    match scope::allow(sh, caller, access, info, name).await {
        Ok(()) => (true, String::new()),
        Err(f) => no(f.message),
    }
}

/// The paths every token may GET: discovery, OpenAPI, the health checks.
fn discovery_path(path: &str) -> bool {
    let p = path.trim_end_matches('/');
    [
        "/version", "/api", "/apis", "/openapi", "/healthz", "/livez", "/readyz",
    ]
    .iter()
    .any(|d| p == *d || p.starts_with(&format!("{d}/")))
}

/// Whether `caller` may `verb` (an HTTP verb in lower case) the non-resource `path`.
async fn path_answer(sh: &Shared, caller: &Caller, path: &str, verb: &str) -> Answer {
    let full = caller.scope == Scope::Full;
    if discovery_path(path) && !path.starts_with("/apis/boxery.dev/v1alpha1/") {
        return if verb == "get" {
            (true, String::new())
        } else {
            no("discovery is read with GET")
        };
    }
    let scope_says = |ok: bool, why: &str| if ok { (true, String::new()) } else { no(why) };
    match (path, verb) {
        ("/mcp", "get" | "post" | "delete") => {
            scope_says(full, "MCP through the API needs a token of scope full")
        }
        ("/boxery/v1/store", "post") => scope_says(
            full,
            "boxery's store calls need a full token (a read token's may only read)",
        ),
        ("/boxery/v1/store/watch", "get") => scope_says(
            matches!(caller.scope, Scope::Full | Scope::Read),
            "a lease token is not a boxery context",
        ),
        ("/metrics", "get") => scope_says(
            matches!(caller.scope, Scope::Full | Scope::Read),
            "/metrics shows every VM: it needs a token of scope read or full",
        ),
        _ => {
            if let Some(vm) = path
                .strip_prefix("/boxery/v1/vms/")
                .and_then(|r| r.strip_suffix("/connect"))
                && verb == "get"
            {
                if matches!(caller.scope, Scope::Read) {
                    return no(
                        "reaching a VM's shell needs a full token (or a lease token, for its lease's VM)",
                    );
                }
                let info = boxery_api::lookup_kind("Vm").expect("the Vm kind");
                return allowed(sh, caller, Access::Write, info, Some(vm)).await;
            }
            if path.starts_with("/boxery/v1/vms/") && path.ends_with("/authorize") && verb == "post"
            {
                return scope_says(full, "authorizing a key needs a full token");
            }
            no(format!("the API serves no {verb} of {path}"))
        }
    }
}

/// A review's body: JSON, or the protobuf kubectl sends ([`crate::protobuf`]).
fn body_of(body: &Bytes, kind: &str) -> Result<Value, Failure> {
    if body.starts_with(crate::protobuf::MAGIC) {
        return crate::protobuf::review(body, kind)
            .ok_or_else(|| Failure::bad_request(format!("the {kind}: not a protobuf {kind}")));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Failure::bad_request(format!("the {kind}: {e}")))?;
    if v["kind"] != kind && !v["kind"].is_null() {
        return Err(Failure::bad_request(format!(
            "the body's kind is {}, not {kind}",
            v["kind"]
        )));
    }
    Ok(v)
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`.
pub async fn access_review(c: Call, body: Bytes) -> Reply {
    let v = body_of(&body, "SelfSubjectAccessReview")?;
    let spec = &v["spec"];
    let s = |x: &Value| x.as_str().unwrap_or("").to_string();
    let (ok, reason) = if let Some(r) = spec.get("resourceAttributes").filter(|r| r.is_object()) {
        let name = s(&r["name"]);
        resource_answer(
            &c.sh,
            &c.caller,
            &s(&r["group"]),
            &s(&r["resource"]),
            &s(&r["subresource"]),
            &s(&r["verb"]).to_ascii_lowercase(),
            (!name.is_empty()).then_some(name.as_str()),
        )
        .await
    } else if let Some(n) = spec.get("nonResourceAttributes").filter(|r| r.is_object()) {
        path_answer(
            &c.sh,
            &c.caller,
            &s(&n["path"]),
            &s(&n["verb"]).to_ascii_lowercase(),
        )
        .await
    } else {
        return Err(Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "spec: exactly one of resourceAttributes, nonResourceAttributes is required",
        ));
    };
    let mut status = json!({"allowed": ok});
    if !ok {
        status["reason"] = json!(reason);
    }
    Ok(json_reply(
        StatusCode::CREATED,
        &json!({
            "apiVersion": AUTHZ_GROUP_VERSION,
            "kind": "SelfSubjectAccessReview",
            "metadata": {"creationTimestamp": null},
            "spec": spec,
            "status": status,
        }),
    ))
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectrulesreviews` (`kubectl auth can-i
/// --list`): every resource and verb the token may use, from the same answers as
/// [`access_review`]; a lease token's rules name its lease and its VM.
pub async fn rules_review(c: Call, body: Bytes) -> Reply {
    let v = body_of(&body, "SelfSubjectRulesReview")?;
    let (sh, caller) = (&c.sh, &c.caller);
    let mut resources: Vec<(&str, String)> = vec![("", "events".to_string())];
    for k in &KINDS {
        resources.push((GROUP, k.plural.to_string()));
        resources.push((GROUP, format!("{}/status", k.plural)));
    }
    resources.push((GROUP, "pools/scale".to_string()));
    let named: Vec<(String, String)> = match &caller.scope {
        Scope::Lease(_) => scope::visible(sh, caller)
            .await
            .ok()
            .flatten()
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let mut rules = Vec::new();
    for (group, res) in &resources {
        let (plural, sub) = res.split_once('/').unwrap_or((res.as_str(), ""));
        let mut verbs = Vec::new();
        for verb in VERBS {
            if resource_answer(sh, caller, group, plural, sub, verb, None)
                .await
                .0
            {
                verbs.push(verb);
            }
        }
        if !verbs.is_empty() {
            rules.push(json!({"verbs": verbs, "apiGroups": [group], "resources": [res]}));
        }
        let kind = KINDS.iter().find(|k| k.plural == plural).map(|k| k.kind);
        for (_, name) in named
            .iter()
            .filter(|(k, _)| Some(k.as_str()) == kind && !group.is_empty())
        {
            let mut only = Vec::new();
            for verb in VERBS {
                if !verbs.contains(&verb)
                    && resource_answer(sh, caller, group, plural, sub, verb, Some(name))
                        .await
                        .0
                {
                    only.push(verb);
                }
            }
            if !only.is_empty() {
                rules.push(json!({"verbs": only, "apiGroups": [group], "resources": [res], "resourceNames": [name]}));
            }
        }
    }
    let mut paths = vec![
        json!({"verbs": ["get"], "nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*", "/version", "/version/", "/healthz", "/livez", "/readyz"]}),
    ];
    match &caller.scope {
        Scope::Full => {
            paths.push(json!({"verbs": ["get", "post", "delete"], "nonResourceURLs": ["/mcp"]}));
            paths.push(json!({"verbs": ["post"], "nonResourceURLs": ["/boxery/v1/store", "/boxery/v1/vms/*/authorize"]}));
            paths.push(json!({"verbs": ["get"], "nonResourceURLs": ["/boxery/v1/store/watch", "/boxery/v1/vms/*/connect", "/metrics"]}));
        }
        Scope::Read => {
            paths.push(json!({"verbs": ["get"], "nonResourceURLs": ["/boxery/v1/store/watch", "/metrics"]}));
        }
        Scope::Lease(_) => {
            if let Some((_, vm)) = named.iter().find(|(k, _)| k == "Vm") {
                paths.push(json!({"verbs": ["get"], "nonResourceURLs": [format!("/boxery/v1/vms/{vm}/connect")]}));
            }
        }
    }
    let mut status =
        json!({"resourceRules": rules, "nonResourceRules": paths, "incomplete": false});
    if caller.scope == Scope::Read {
        // its store calls are allowed by what they do, which no rule can say
        status["incomplete"] = json!(true);
        status["evaluationError"] =
            json!("a read token may also POST /boxery/v1/store for calls that only read");
    }
    Ok(json_reply(
        StatusCode::CREATED,
        &json!({
            "apiVersion": AUTHZ_GROUP_VERSION,
            "kind": "SelfSubjectRulesReview",
            "metadata": {"creationTimestamp": null},
            "spec": v.get("spec").cloned().unwrap_or(json!({})),
            "status": status,
        }),
    ))
}

/// `/apis/authorization.k8s.io/v1`.
pub fn resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": AUTHZ_GROUP_VERSION,
        "resources": [
            {"name": "selfsubjectaccessreviews", "singularName": "selfsubjectaccessreview", "namespaced": false, "kind": "SelfSubjectAccessReview", "verbs": ["create"]},
            {"name": "selfsubjectrulesreviews", "singularName": "selfsubjectrulesreview", "namespaced": false, "kind": "SelfSubjectRulesReview", "verbs": ["create"]},
        ],
    })
}

/// The group as `/apis` lists it.
pub fn group() -> Value {
    json!({
        "name": AUTHZ_GROUP,
        "versions": [{"groupVersion": AUTHZ_GROUP_VERSION, "version": "v1"}],
        "preferredVersion": {"groupVersion": AUTHZ_GROUP_VERSION, "version": "v1"},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_paths() {
        assert!(discovery_path("/apis"));
        assert!(discovery_path("/openapi/v3"));
        assert!(discovery_path("/version/"));
        assert!(!discovery_path("/mcp"));
        assert!(!discovery_path("/apisx"));
    }
}
