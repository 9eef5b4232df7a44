//! boxery's Events as core `v1` Events (`/api/v1/events`, `/api/v1/namespaces/NS/events`),
//! which is where `kubectl describe` looks for them (with a field selector on
//! `involvedObject`). Read-only: the controllers write them.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::GROUP_VERSION;
use crate::call::Call;
use crate::query::{FieldSelector, wants_table};
use crate::resources::{Reply, bytes_reply, json_reply, read_list, table_bytes};
use crate::scope::{self, Access};
use crate::status::Failure;

/// The namespace events appear in (every boxery kind is cluster-scoped; Kubernetes keeps such
/// objects' events in `default`).
pub const NAMESPACE: &str = "default";

/// A boxery Event (as served) as a core Event.
pub fn core(e: &Value) -> Value {
    let mut c = e.clone();
    c["apiVersion"] = json!("v1");
    c["kind"] = json!("Event");
    c["metadata"]["namespace"] = json!(NAMESPACE);
    c["involvedObject"]["apiVersion"] = json!(GROUP_VERSION);
    let component = e["reportingController"]
        .as_str()
        .unwrap_or("boxery")
        .to_string();
    c["source"] = json!({"component": component});
    c["reportingComponent"] = json!(component);
    c
}

/// GET `/api/v1/events` and `/api/v1/namespaces/NS/events`.
pub async fn list(c: Call) -> Reply {
    let (sh, caller, p, include, headers) = (c.sh, c.caller, c.p, c.include, c.headers);
    let info = boxery_api::lookup_kind("Event").expect("Event is a kind");
    scope::allow(&sh, &caller, Access::Read, info, None).await?;
    if p.is_watch() {
        return Err(Failure::method_not_allowed(
            "watching core Events is not served: watch events.boxery.dev instead (kubectl get events.boxery.dev -w)",
        ));
    }
    let fields: FieldSelector = p.fields()?;
    let (objs, rev) =
        read_list(&sh, &caller, info, &p.labels()?, &FieldSelector::default()).await?;
    let mut items: Vec<Value> = objs
        .iter()
        .map(|o| core(&boxery_verbs::render::display_value(o)))
        .filter(|c| fields.matches(c))
        .collect();
    items.sort_by(|a, b| {
        a["lastTimestamp"]
            .as_str()
            .cmp(&b["lastTimestamp"].as_str())
    });
    let rv = rev.to_string();
    if wants_table(&headers) {
        let t = table_bytes("Event", &items, &rv, include.as_deref());
        return Ok(bytes_reply(StatusCode::OK, t));
    }
    Ok(json_reply(
        StatusCode::OK,
        &json!({"apiVersion": "v1", "kind": "EventList", "metadata": {"resourceVersion": rv}, "items": items}),
    ))
}
