//! The `scale` subresource of Pools (`…/pools/NAME/scale`, an `autoscaling/v1` `Scale`), as
//! the Kubernetes API serves it for workloads: `kubectl scale pool/NAME --replicas=N` and
//! autoscalers read and write `spec.replicas` through it. A write goes through the verb
//! `boxery scale` uses ([`boxery_verbs::edit::scale`]), so it is the same change, with the
//! same field manager rules. Read with a token that reads the pool; written with one that
//! writes it (a `lease:` token never does).

use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use boxery_api::DynObject;
use boxery_api::codec::MAX_OBJECT_BYTES;
use boxery_store::ObjectRef;
use boxery_verbs::objects::DryRun;
use serde_json::{Value, json};

use crate::call::Call;
use crate::resources::{Reply, json_reply, kind_of};
use crate::scope::{self, Access};
use crate::status::Failure;

/// The `Scale` of a pool: its wanted replicas, the members it has, and their selector.
pub fn scale_of(pool: &DynObject) -> Value {
    let m = &pool.metadata;
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": m.name,
            "uid": m.uid,
            "resourceVersion": m.resource_version,
            "creationTimestamp": m.creation_timestamp,
        },
        "spec": {"replicas": pool.rest["spec"]["replicas"].as_u64().unwrap_or(0)},
        "status": {
            "replicas": pool.rest["status"]["replicas"].as_u64().unwrap_or(0),
            "selector": format!("{}={}", boxery_api::pool::POOL_LABEL, m.name),
        },
    })
}

async fn pool(c: &Call, name: &str, access: Access) -> Result<DynObject, Failure> {
    let info = kind_of("pools")?;
    scope::allow(&c.sh, &c.caller, access, info, Some(name)).await?;
    c.sh.verbs
        .store()
        .get(&ObjectRef::new(info.kind, name))
        .await?
        .ok_or_else(|| Failure::not_found("pools", name))
}

/// GET `…/pools/NAME/scale`.
pub async fn get(c: Call, Path(name): Path<String>) -> Reply {
    let p = pool(&c, &name, Access::Read).await?;
    Ok(json_reply(StatusCode::OK, &scale_of(&p)))
}

/// PUT of `…/pools/NAME/scale`: only `spec.replicas` changes; a `metadata.resourceVersion`
/// is a precondition (409 when stale).
pub async fn put(c: Call, Path(name): Path<String>, body: Bytes) -> Reply {
    let cur = pool(&c, &name, Access::Write).await?;
    let want: Value = serde_json::from_slice(&body)
        .map_err(|e| Failure::bad_request(format!("the Scale is not JSON: {e}")))?;
    if want["kind"] != "Scale" {
        return Err(Failure::bad_request(format!(
            "the body's kind is {}: send an autoscaling/v1 Scale",
            want["kind"]
        )));
    }
    if let Some(rv) = want["metadata"]["resourceVersion"].as_str()
        && Some(rv) != cur.metadata.resource_version.as_deref()
    {
        return Err(Failure::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "the pool {name} changed (resourceVersion {rv} is stale, it is {}): read its scale again",
                cur.metadata.resource_version.as_deref().unwrap_or("")
            ),
        )
        .about("pools", &name));
    }
    set_replicas(c, name, &want).await
}

/// PATCH (a merge patch, what `kubectl scale` sends) of `…/pools/NAME/scale`.
pub async fn patch(c: Call, Path(name): Path<String>, body: Bytes) -> Reply {
    let cur = pool(&c, &name, Access::Write).await?;
    let ctype = c
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|t| t.to_str().ok())
        .unwrap_or("");
    if !(ctype.starts_with("application/merge-patch+json")
        || ctype.starts_with("application/strategic-merge-patch+json"))
    {
        return Err(Failure::unsupported(format!(
            "a scale is patched with application/merge-patch+json or application/strategic-merge-patch+json (`kubectl scale`), not `{}`",
            boxery_verbs::render::safe(ctype)
        )));
    }
    let patch: Value = serde_json::from_slice(&body)
        .map_err(|e| Failure::bad_request(format!("the patch is not JSON: {e}")))?;
    let mut want = scale_of(&cur);
    boxery_verbs::edit::apply_merge_bounded(&mut want, &patch, MAX_OBJECT_BYTES)
        .map_err(Failure::bad_request)?;
    set_replicas(c, name, &want).await
}

/// Set the pool's replicas to the Scale `want`'s, through the verb.
async fn set_replicas(c: Call, name: String, want: &Value) -> Reply {
    let replicas = want["spec"]["replicas"]
        .as_u64()
        .and_then(|r| u32::try_from(r).ok())
        .ok_or_else(|| {
            Failure::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                format!(
                    "spec.replicas is {}: a whole number from 0",
                    want["spec"]["replicas"]
                ),
            )
        })?;
    let dry = if c.p.dry()? {
        DryRun::Server
    } else {
        DryRun::None
    };
    let v = crate::resources::verbs_for(&c.sh, &c.caller, &c.p, &c.headers)?;
    let changed = boxery_verbs::edit::scale(&v, &name, replicas, None, dry).await?;
    Ok(json_reply(StatusCode::OK, &scale_of(&changed.object)))
}
