//! What a client asks before anything else: `/version`, discovery (`/api`, `/apis`,
//! `/apis/boxery.dev/v1alpha1`, `/api/v1` for Events) and OpenAPI v3 (`/openapi/v3` and the
//! group's document, made from the same schemars schemas that validate every write, so
//! `kubectl explain` reads what the store enforces).
//!
//! Every kind is cluster-scoped: a boxery home has one namespace of names (a VM's name is its
//! host name, its directory and its ssh alias), and what would split it (who may touch what)
//! is a token's scope, not a namespace.

use std::sync::OnceLock;

use boxery_api::{Event, KINDS, KindInfo, Resource};
use serde_json::{Map, Value, json};

use crate::{GROUP, GROUP_VERSION, VERSION};

/// The verbs served for a kind.
fn verbs(k: &KindInfo) -> Vec<&'static str> {
    if k.controllers_only.is_some() {
        vec!["get", "list", "watch"]
    } else {
        vec![
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ]
    }
}

/// `/version`.
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "32",
        "gitVersion": format!("v1.32.0+boxery-{}", env!("CARGO_PKG_VERSION")),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "",
        "goVersion": "",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, match std::env::consts::ARCH { "x86_64" => "amd64", "aarch64" => "arm64", a => a }),
    })
}

/// `/api`: the core group, for Events only.
pub fn core_versions() -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
}

/// `/api/v1`: Events, read-only (what `kubectl describe` lists).
pub fn core_resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [{
            "name": Event::INFO.plural, "singularName": Event::INFO.singular, "namespaced": true,
            "kind": Event::INFO.kind, "verbs": ["get", "list"], "shortNames": Event::INFO.short_names,
        }],
    })
}

fn group() -> Value {
    json!({
        "name": GROUP,
        "versions": [{"groupVersion": GROUP_VERSION, "version": VERSION}],
        "preferredVersion": {"groupVersion": GROUP_VERSION, "version": VERSION},
    })
}

/// `/apis`: boxery's group, and `authorization.k8s.io` for `kubectl auth can-i`
/// ([`crate::access_review`]).
pub fn groups() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group(), crate::access_review::group()]})
}

/// `/apis/boxery.dev`.
pub fn group_doc() -> Value {
    let mut g = group();
    g["kind"] = json!("APIGroup");
    g["apiVersion"] = json!("v1");
    g
}

/// `/apis/boxery.dev/v1alpha1`.
pub fn resources() -> Value {
    let mut list = Vec::new();
    for k in &KINDS {
        list.push(json!({
            "name": k.plural,
            "singularName": k.singular,
            "namespaced": false,
            "kind": k.kind,
            "verbs": verbs(k),
            "shortNames": k.short_names,
            "categories": ["boxery"],
        }));
        list.push(json!({
            "name": format!("{}/status", k.plural),
            "singularName": "",
            "namespaced": false,
            "kind": k.kind,
            "verbs": ["get"],
        }));
        if k.kind == "Pool" {
            // kubectl scale finds the subresource here (crate::scale)
            list.push(json!({
                "name": "pools/scale",
                "singularName": "",
                "namespaced": false,
                "group": "autoscaling",
                "version": "v1",
                "kind": "Scale",
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": list})
}

/// The OpenAPI name of a schema: `dev.boxery.v1alpha1.NAME`.
fn component(name: &str) -> String {
    format!("dev.boxery.{VERSION}.{name}")
}

/// Turn a schemars (JSON Schema 2020-12) schema into OpenAPI 3.0's dialect, which kubectl
/// reads: every `#/$defs/X` points at `#/components/schemas/dev.boxery.v1alpha1.X`; a
/// `type` list with `null` becomes the type and `nullable`; an `anyOf`/`oneOf` alternative of
/// `null` becomes `nullable`; `const` becomes a one-value `enum`; a `$ref` with siblings is
/// wrapped in `allOf` (OpenAPI 3.0 ignores a `$ref`'s siblings).
fn rewrite_refs(v: &mut Value) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get_mut("$ref")
                && let Some(name) = r.strip_prefix("#/$defs/")
            {
                *r = format!("#/components/schemas/{}", component(name));
            }
            m.remove("$schema");
            if let Some(Value::Array(types)) = m.get("type").cloned() {
                let real: Vec<Value> = types.iter().filter(|t| *t != "null").cloned().collect();
                if real.len() < types.len() {
                    m.insert("nullable".into(), Value::Bool(true));
                }
                match real.as_slice() {
                    [one] => {
                        m.insert("type".into(), one.clone());
                    }
                    _ => {
                        m.remove("type");
                    }
                }
            }
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(alts)) = m.get(key).cloned() {
                    let real: Vec<Value> = alts
                        .iter()
                        .filter(|a| a.get("type") != Some(&Value::String("null".into())))
                        .cloned()
                        .collect();
                    if real.len() < alts.len() {
                        m.insert("nullable".into(), Value::Bool(true));
                        if let [one] = real.as_slice() {
                            m.remove(key);
                            m.insert("allOf".into(), Value::Array(vec![one.clone()]));
                        } else {
                            m.insert(key.into(), Value::Array(real));
                        }
                    }
                }
            }
            if let Some(c) = m.remove("const") {
                m.insert("enum".into(), Value::Array(vec![c]));
            }
            if m.contains_key("$ref") && m.len() > 1 {
                let r = m.remove("$ref").expect("present");
                m.insert("allOf".into(), json!([{"$ref": r}]));
            }
            for (_, x) in m.iter_mut() {
                rewrite_refs(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(rewrite_refs),
        _ => {}
    }
}

fn query(name: &str, ty: &str, what: &str) -> Value {
    json!({"name": name, "in": "query", "description": what, "schema": {"type": ty}, "uniqueItems": true})
}

/// The group's OpenAPI v3 document, made once.
pub fn openapi_group() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut schemas = Map::new();
        let mut paths = Map::new();
        for k in &KINDS {
            let mut root = boxery_api::validate::schema_of(k.kind).expect("every kind has a schema");
            if let Some(defs) = root.as_object_mut().and_then(|m| m.remove("$defs"))
                && let Value::Object(defs) = defs
            {
                for (name, mut d) in defs {
                    rewrite_refs(&mut d);
                    crate::structural::make_structural(&mut d);
                    schemas.insert(component(&name), d);
                }
            }
            rewrite_refs(&mut root);
            crate::structural::make_structural(&mut root);
            let gvk = json!([{"group": GROUP, "version": VERSION, "kind": k.kind}]);
            root["x-kubernetes-group-version-kind"] = gvk.clone();
            schemas.insert(component(k.kind), root);
            let list_name = format!("{}List", k.kind);
            schemas.insert(
                component(&list_name),
                json!({
                    "type": "object",
                    "description": format!("A list of {}.", k.plural),
                    "required": ["items"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "items": {"type": "array", "items": {"$ref": format!("#/components/schemas/{}", component(k.kind))}},
                    },
                    "x-kubernetes-group-version-kind": [{"group": GROUP, "version": VERSION, "kind": list_name}],
                }),
            );
            let one = json!({"$ref": format!("#/components/schemas/{}", component(k.kind))});
            let ok = |schema: &Value| {
                json!({"200": {"description": "OK", "content": {"application/json": {"schema": schema}}}})
            };
            let ext = json!({"group": GROUP, "version": VERSION, "kind": k.kind});
            let writes = [
                query("dryRun", "string", "All: validate and compute the result, write nothing"),
                query("fieldManager", "string", "who makes the change (managedFields)"),
                query("fieldValidation", "string", "Strict, always: an unknown field is refused (422)"),
            ];
            let mut item = json!({
                "get": {"operationId": format!("read{}", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "get", "responses": ok(&one)},
                "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}],
            });
            let mut coll = json!({
                "get": {
                    "operationId": format!("list{}", k.kind),
                    "x-kubernetes-group-version-kind": ext,
                    "x-kubernetes-action": "list",
                    "parameters": [
                        query("labelSelector", "string", "label selector"),
                        query("fieldSelector", "string", "field selector (metadata.name=NAME)"),
                        query("watch", "boolean", "watch for changes"),
                        query("resourceVersion", "string", "list or watch from this revision"),
                        query("allowWatchBookmarks", "boolean", "send BOOKMARK events"),
                        query("timeoutSeconds", "integer", "end a watch after this long"),
                    ],
                    "responses": ok(&json!({"$ref": format!("#/components/schemas/{}", component(&list_name))})),
                },
            });
            if k.controllers_only.is_none() {
                let body = json!({"required": true, "content": {"application/json": {"schema": one}}});
                item["put"] = json!({"operationId": format!("replace{}", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "put", "parameters": writes, "requestBody": body, "responses": ok(&one)});
                item["patch"] = json!({
                    "operationId": format!("patch{}", k.kind),
                    "x-kubernetes-group-version-kind": ext,
                    "x-kubernetes-action": "patch",
                    "parameters": [writes[0].clone(), writes[1].clone(), writes[2].clone(), query("force", "boolean", "apply: take over fields other managers set")],
                    "requestBody": {"required": true, "content": {
                        "application/merge-patch+json": {"schema": {"type": "object"}},
                        "application/json-patch+json": {"schema": {"type": "array"}},
                        "application/strategic-merge-patch+json": {"schema": {"type": "object"}},
                        "application/apply-patch+yaml": {"schema": {"type": "object"}},
                    }},
                    "responses": ok(&one),
                });
                item["delete"] = json!({"operationId": format!("delete{}", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "delete", "parameters": [writes[0].clone()], "responses": ok(&json!({"type": "object"}))});
                coll["post"] = json!({"operationId": format!("create{}", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "post", "parameters": writes, "requestBody": body, "responses": ok(&one)});
                coll["delete"] = json!({"operationId": format!("deletecollection{}", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "deletecollection", "parameters": [query("labelSelector", "string", "label selector")], "responses": ok(&json!({"type": "object"}))});
            }
            paths.insert(format!("/apis/{GROUP_VERSION}/{}", k.plural), coll);
            paths.insert(format!("/apis/{GROUP_VERSION}/{}/{{name}}", k.plural), item);
            paths.insert(
                format!("/apis/{GROUP_VERSION}/{}/{{name}}/status", k.plural),
                json!({
                    "get": {"operationId": format!("read{}Status", k.kind), "x-kubernetes-group-version-kind": ext, "x-kubernetes-action": "get", "responses": ok(&one)},
                    "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}],
                }),
            );
        }
        crate::structural::inline_enums(&mut schemas);
        json!({
            "openapi": "3.0.0",
            "info": {"title": "boxery", "version": VERSION},
            "paths": paths,
            "components": {"schemas": schemas},
        })
    })
}

/// A short hash of the group's document (`?hash=`), so clients may cache it.
pub fn openapi_hash() -> &'static str {
    static H: OnceLock<String> = OnceLock::new();
    H.get_or_init(|| {
        use sha2::Digest;
        let d = sha2::Sha256::digest(openapi_group().to_string().as_bytes());
        d.iter().take(16).map(|b| format!("{b:02X}")).collect()
    })
}

/// The media type of OpenAPI v2 in protobuf as served: kubectl asks for
/// `application/com.github.proto-openapi.spec.v2@v1.0+protobuf`, but an `@` is not allowed in
/// a `Content-Type` (client-go parses it and fails: "mime: unexpected content after media
/// subtype"), so the answer says `.v1.0`, as kube-openapi's does.
pub const OPENAPI_V2_PROTOBUF: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

/// `/openapi/v2`: a Swagger 2.0 document with no definitions. kubectl reads it only to check
/// what OpenAPI v3 cannot route, a `kind: List` (`kubectl get -o yaml | kubectl apply -f -`):
/// with no definitions it leaves the items to the server, which validates each with the
/// schemas of `/openapi/v3` (strictly, always). As JSON, or as the protobuf (gnostic's
/// `openapi_v2.Document`: `swagger` = 1, `info` = 2 with `title` = 1, `version` = 2) kubectl
/// asks for.
pub fn openapi_v2(protobuf: bool) -> (&'static str, Vec<u8>) {
    let (title, version) = ("boxery", VERSION);
    if !protobuf {
        let doc = json!({"swagger": "2.0", "info": {"title": title, "version": version}, "paths": {}, "definitions": {}});
        return ("application/json", doc.to_string().into_bytes());
    }
    fn field(out: &mut Vec<u8>, number: u8, bytes: &[u8]) {
        out.push(number << 3 | 2); // length-delimited
        out.push(u8::try_from(bytes.len()).expect("short fields only"));
        out.extend_from_slice(bytes);
    }
    let mut info = Vec::new();
    field(&mut info, 1, title.as_bytes());
    field(&mut info, 2, version.as_bytes());
    let mut doc = Vec::new();
    field(&mut doc, 1, b"2.0");
    field(&mut doc, 2, &info);
    (OPENAPI_V2_PROTOBUF, doc)
}

/// `/openapi/v3`: where each group-version's document is.
pub fn openapi_root() -> Value {
    json!({
        "paths": {
            format!("apis/{GROUP_VERSION}"): {
                "serverRelativeURL": format!("/openapi/v3/apis/{GROUP_VERSION}?hash={}", openapi_hash()),
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_v2_protobuf_is_a_swagger_document() {
        let (ty, b) = openapi_v2(true);
        assert_eq!(ty, OPENAPI_V2_PROTOBUF);
        // swagger = "2.0", then info { title = "boxery", version = "v1alpha1" }
        let mut want = vec![0x0a, 3];
        want.extend_from_slice(b"2.0");
        want.extend_from_slice(&[0x12, 18, 0x0a, 6]);
        want.extend_from_slice(b"boxery");
        want.extend_from_slice(&[0x12, 8]);
        want.extend_from_slice(b"v1alpha1");
        assert_eq!(b, want);
        let (_, j) = openapi_v2(false);
        let v: Value = serde_json::from_slice(&j).unwrap();
        assert_eq!(v["swagger"], "2.0");
    }

    #[test]
    fn every_ref_points_into_components() {
        let doc = openapi_group();
        let text = doc.to_string();
        assert!(!text.contains("#/$defs/"), "a $defs ref is left");
        assert!(
            !text.contains(r#""type":["#),
            "a type list is left (OpenAPI 3.0 has one type)"
        );
        assert!(!text.contains(r#""const":"#), "a const is left");
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        out.push(r.clone());
                    }
                    m.values().for_each(|x| refs(x, out));
                }
                Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(doc, &mut all);
        for r in all {
            let name = r.strip_prefix("#/components/schemas/").unwrap();
            assert!(schemas.contains_key(name), "{r} is not a component");
        }
        for k in &KINDS {
            let s = &schemas[&component(k.kind)];
            assert_eq!(s["x-kubernetes-group-version-kind"][0]["kind"], k.kind);
        }
    }
}
