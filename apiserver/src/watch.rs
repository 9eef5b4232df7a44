//! `?watch=1`: a stream of `{"type", "object"}` lines from the store's watch. Without a
//! `resourceVersion` (or with `0`) the current objects come first as ADDED; from a revision
//! the store compacted away the stream is one ERROR event with a `410 Expired` Status, so the
//! client lists again. With `allowWatchBookmarks` a BOOKMARK line carries the last revision
//! every [`BOOKMARK_EVERY`]. A token holds at most [`crate::Limits::watches_per_token`]
//! watches at once, and only while it exists: every [`RECHECK_EVERY`] and at every event the
//! token is looked up again (and a lease token's lease), so a revoked token's watches end with
//! an ERROR line (401) within that period, on this watch and on the store's
//! (`/boxery/v1/store/watch`, [`crate::store_rpc::watch`]).

use std::sync::Arc;
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use boxery_api::KindInfo;
use boxery_store::WatchEvent;
use futures::StreamExt;
use serde_json::json;

use crate::query::Params;
use crate::resources::{Reply, event_line, read_list};
use crate::status::Failure;
use crate::tokens::Caller;
use crate::{GROUP_VERSION, Shared};
use axum::body::{Body, Bytes};
use boxery_store::StoreError;

/// How long a watch runs at most when the client names no `timeoutSeconds`.
pub const WATCH_MAX: Duration = Duration::from_secs(30 * 60);

/// How often a bookmark is sent when asked for.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(10);

/// How often an open watch asks again whether its token (and a lease token's lease) still
/// holds.
pub const RECHECK_EVERY: Duration = Duration::from_secs(5);

/// Why `caller`'s stream may not go on: its token was revoked (401), or a lease token's lease
/// ended (403).
pub(crate) async fn still_allowed(sh: &Shared, caller: &Caller) -> Result<(), Failure> {
    if !sh.tokens.holds(caller) {
        return Err(revoked(caller));
    }
    if matches!(caller.scope, crate::tokens::Scope::Lease(_)) {
        crate::scope::visible(sh, caller).await?;
    }
    Ok(())
}

/// The end of a revoked token's stream.
pub(crate) fn revoked(caller: &Caller) -> Failure {
    Failure::new(
        StatusCode::UNAUTHORIZED,
        "Unauthorized",
        format!(
            "token {} was revoked: its watch ends (`boxery kubeconfig` on the VM host makes a new one)",
            caller.name
        ),
    )
}

/// A watch slot of a token, given back when the watch ends.
pub(crate) struct Slot {
    sh: Arc<Shared>,
    token: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut w = self.sh.watches.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = w.get_mut(&self.token) {
            *n = n.saturating_sub(1);
        }
    }
}

pub(crate) fn slot(sh: &Arc<Shared>, caller: &Caller) -> Result<Slot, Failure> {
    let mut w = sh.watches.lock().unwrap_or_else(|e| e.into_inner());
    let n = w.entry(caller.name.clone()).or_default();
    if *n >= sh.limits.watches_per_token {
        return Err(Failure::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!(
                "token {} holds {} watches, the most one token may: end one first",
                caller.name, n
            ),
        ));
    }
    *n += 1;
    Ok(Slot {
        sh: sh.clone(),
        token: caller.name.clone(),
    })
}

/// Serve a watch.
pub async fn serve(
    sh: Arc<Shared>,
    caller: Caller,
    info: &'static KindInfo,
    p: Params,
    table: bool,
    include: Option<String>,
) -> Reply {
    let labels = p.labels()?;
    let fields = p.fields()?;
    let slot = slot(&sh, &caller)?;
    // `0` is Kubernetes' "from any point": the current objects, then their changes. But a
    // list of a store never written yet answers revision 0 too, and a client resuming from it
    // must see every change since: while nothing is compacted, `0` replays the whole history
    // (which ends in the current objects, so it is a valid "any" as well).
    let floor = sh.verbs.store().compacted().await?;
    let (initial, from) = match p.resource_version.as_deref() {
        Some("0") if floor == 0 => (Vec::new(), 0),
        None | Some("") | Some("0") => {
            let (objs, rev) = read_list(&sh, &caller, info, &labels, &fields).await?;
            (objs, rev)
        }
        Some(rv) => {
            let from: u64 = rv.parse().map_err(|_| {
                Failure::bad_request(format!("resourceVersion `{rv}` is not a revision"))
            })?;
            (Vec::new(), from)
        }
    };
    let mut visible = crate::scope::visible(&sh, &caller).await?;
    // A token watches while it exists, and a lease's token sees its objects while the lease
    // holds them: asked again at every event and every RECHECK_EVERY, so its watch ends (401)
    // when the token is revoked, (403) when the lease ends.
    let leased = matches!(caller.scope, crate::tokens::Scope::Lease(_));
    let timeout = p
        .timeout_seconds
        .map(Duration::from_secs)
        .unwrap_or(WATCH_MAX)
        .min(WATCH_MAX);
    let bookmarks = p.bookmarks();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let kind = info.kind;
    let mut stream = store_watch(&sh, kind, from);
    let forbidden = |f: Failure| format!("{}\n", json!({"type": "ERROR", "object": f.body()}));
    tokio::spawn(async move {
        let _slot = slot;
        let rv_now = from.to_string();
        let table_rv = |rv: &str| table.then(|| rv.to_string());
        if from < floor {
            let f = Failure::new(
                StatusCode::GONE,
                "Expired",
                format!("too old resource version: {from} ({floor})"),
            );
            let line = format!("{}\n", json!({"type": "ERROR", "object": f.body()}));
            let _ = tx.send(line.into()).await;
            return;
        }
        for o in initial {
            let line = event_line(
                kind,
                WatchEvent::Added(o),
                table_rv(&rv_now).as_deref(),
                include.as_deref(),
            );
            if tx.send(line).await.is_err() {
                return;
            }
        }
        let mut last = from;
        let mut tick = tokio::time::interval(BOOKMARK_EVERY);
        tick.reset();
        let mut recheck = tokio::time::interval(RECHECK_EVERY);
        recheck.reset();
        let end = tokio::time::sleep(timeout);
        tokio::pin!(end);
        loop {
            tokio::select! {
                () = tx.closed() => return,
                () = &mut end => break,
                _ = recheck.tick() => {
                    if let Err(f) = still_allowed(&sh, &caller).await {
                        let _ = tx.send(forbidden(f).into()).await;
                        return;
                    }
                }
                _ = tick.tick(), if bookmarks => {
                    let b = json!({"type": "BOOKMARK", "object": {
                        "kind": kind, "apiVersion": GROUP_VERSION,
                        "metadata": {"resourceVersion": last.to_string()},
                    }});
                    if tx.send(format!("{b}\n").into()).await.is_err() {
                        return;
                    }
                }
                ev = stream.next() => match ev {
                    None => break,
                    Some(Err(e)) => {
                        let f = if too_old(&e) {
                            Failure::new(StatusCode::GONE, "Expired", e.to_string())
                        } else {
                            Failure::from_store(&e)
                        };
                        let line = format!("{}\n", json!({"type": "ERROR", "object": f.body()}));
                        let _ = tx.send(line.into()).await;
                        return;
                    }
                    Some(Ok((rev, ev))) => {
                        last = rev;
                        if !sh.tokens.holds(&caller) {
                            let _ = tx.send(forbidden(revoked(&caller)).into()).await;
                            return;
                        }
                        if leased {
                            match crate::scope::visible(&sh, &caller).await {
                                Ok(v) => visible = v,
                                Err(f) => {
                                    let _ = tx.send(forbidden(f).into()).await;
                                    return;
                                }
                            }
                        }
                        let o = ev.object();
                        if !labels.matches(&o.metadata.labels)
                            || !(fields.is_empty() || fields.matches(&boxery_verbs::render::display_value(o)))
                            || !crate::scope::sees(&visible, o)
                        {
                            continue;
                        }
                        let line = event_line(kind, ev, table_rv(&rev.to_string()).as_deref(), include.as_deref());
                        if tx.send(line).await.is_err() {
                            return;
                        }
                    }
                },
            }
        }
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        line_body(rx),
    )
        .into_response())
}

/// A body of lines from a channel.
fn line_body(rx: tokio::sync::mpsc::Receiver<Bytes>) -> Body {
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    }))
}

/// Whether a store watch stream's error is "too old".
fn too_old(e: &StoreError) -> bool {
    matches!(e, StoreError::TooOld { .. })
}

/// The store's watch of `kind` from `from`, as a stream.
fn store_watch(sh: &Shared, kind: &str, from: u64) -> boxery_store::WatchStream {
    sh.verbs.store().watch(Some(kind), from).boxed()
}
