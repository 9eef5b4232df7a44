//! The store's own calls over the API (`POST /boxery/v1/store`, `GET /boxery/v1/store/watch`):
//! what a `boxery` on another machine uses as its store when a context points here
//! (`boxery --context NAME …`, the `boxery-remote` crate). Every
//! [`ObjectStore`](boxery_store::ObjectStore) method, with the wire form of
//! [`boxery_store::wire`]; the verbs then run in the caller's process, on this home's store,
//! with its validation. A full token makes every call, under the write rules of
//! [`boxery_store::guard`] ([`Writer::Remote`]); a read token the calls that only read; a
//! lease token is refused (its reach is the Kubernetes resources and `connect`).

use std::sync::Arc;

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_store::StoreError;
use boxery_store::guard::{Guarded, Writer};
use boxery_store::wire::{self, Call, WatchLine, WireError};
use futures::StreamExt;
use serde::Deserialize;

use crate::Shared;
use crate::status::Failure;
use crate::tokens::{Caller, Scope};

/// Whether `caller` may make a call that reads only (`reads`) or writes.
fn allowed(caller: &Caller, reads: bool) -> Result<(), Failure> {
    match &caller.scope {
        Scope::Full => Ok(()),
        Scope::Read if reads => Ok(()),
        Scope::Read => Err(Failure::forbidden(format!(
            "token {} has scope read: this context may read, not change anything (a person makes a full token with `boxery kubeconfig --scope full` on the VM host)",
            caller.name
        ))),
        Scope::Lease(l) => Err(Failure::forbidden(format!(
            "token {} is scoped to lease {l}: it reaches its lease and VM through the Kubernetes API (kubectl) and `boxery connect`, not as a boxery context; a context needs a read or full token",
            caller.name
        ))),
    }
}

/// The HTTP status of a store error sent back.
fn code(e: &StoreError) -> StatusCode {
    match e {
        StoreError::NotFound { .. } => StatusCode::NOT_FOUND,
        StoreError::AlreadyExists { .. }
        | StoreError::Conflict { .. }
        | StoreError::BeingDeleted { .. }
        | StoreError::FieldConflicts { .. } => StatusCode::CONFLICT,
        StoreError::Invalid(_) | StoreError::OwnerGone { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        StoreError::TooOld { .. } => StatusCode::GONE,
        StoreError::Forbidden { .. } => StatusCode::FORBIDDEN,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// `POST /boxery/v1/store`: one call.
pub async fn call(
    State(sh): State<Arc<Shared>>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Response {
    let call: Call = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return Failure::bad_request(format!("not a store call: {e}")).into_response(),
    };
    if let Err(f) = allowed(&caller, call.reads_only()) {
        return f.into_response();
    }
    // every write passes the one table of who may write what (`boxery_store::guard`): a token,
    // which an agent may hold, never writes status (a grant's approval above all), adopts,
    // leads or compacts
    let store = Guarded::new(sh.verbs.store_arc(), Writer::Remote);
    // a write is audited (a context's `boxery` on another machine writing here)
    let audit = (!call.reads_only()).then(|| {
        sh.verbs
            .acting_for(&format!("token:{}", caller.name), "api")
    });
    let doing = audit.as_ref().map(|v| {
        // the op and the object it names: `update Vm/dev1` (the VM only when its name is one)
        let (kind, name) = call.target().unwrap_or(("", ""));
        let vm = (kind == "Vm" && boxery_api::name::check_label_name(name).is_ok()).then_some(name);
        v.doing("store", vm, format!("{} {kind}/{name}", call.name()))
    });
    let r = wire::dispatch(&store, call).await;
    if let Some(d) = doing {
        d.done(
            match &r {
                Ok(_) => "ok".to_string(),
                Err(e) => format!("error: {e}"),
            },
            None,
        );
    }
    match r {
        Ok(v) => crate::resources::json_reply(StatusCode::OK, &v),
        Err(e) => crate::resources::json_reply(
            code(&e),
            &serde_json::json!({"error": WireError::from(&e)}),
        ),
    }
}

/// The query of a store watch.
#[derive(Debug, Deserialize)]
pub struct WatchQuery {
    /// One kind, or every kind when absent.
    kind: Option<String>,
    /// The revision to watch after.
    from: u64,
}

/// `GET /boxery/v1/store/watch?kind=K&from=N`: every change after N, one JSON line each
/// ([`WatchLine`]), until the client leaves; an error is the last line.
pub async fn watch(
    State(sh): State<Arc<Shared>>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<WatchQuery>,
) -> Response {
    if let Err(f) = allowed(&caller, true) {
        return f.into_response();
    }
    let slot = match crate::watch::slot(&sh, &caller) {
        Ok(s) => s,
        Err(f) => return f.into_response(),
    };
    let stream = sh.verbs.store().watch(q.kind.as_deref(), q.from);
    let mut recheck = tokio::time::interval(crate::watch::RECHECK_EVERY);
    recheck.reset();
    // the line of each item; the stream ends after the first error, and with an error line
    // once the token is revoked (looked up again at every event and every RECHECK_EVERY)
    let state = (stream, Some(slot), recheck);
    let lines = futures::stream::unfold(state, move |(mut stream, slot, mut recheck)| {
        let (sh, caller) = (sh.clone(), caller.clone());
        async move {
            slot.as_ref()?;
            let revoked = || StoreError::Unavailable {
                why: crate::watch::revoked(&caller).message,
            };
            let item = loop {
                tokio::select! {
                    ev = stream.next() => match ev? {
                        Ok(_) if !sh.tokens.holds(&caller) => break Err(revoked()),
                        ev => break ev,
                    },
                    _ = recheck.tick() => if !sh.tokens.holds(&caller) {
                        break Err(revoked());
                    },
                }
            };
            let (line, slot) = match item {
                Ok((rev, ev)) => (WatchLine::event(rev, ev), slot),
                Err(e) => (WatchLine::error(&e), None),
            };
            let mut text = serde_json::to_vec(&line).unwrap_or_default();
            text.push(b'\n');
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(text)),
                (stream, slot, recheck),
            ))
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response()
}
