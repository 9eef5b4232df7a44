//! `GET /boxery/v1/vms/NAME/screen?control=BOOL` (`Upgrade: boxery-tcp`): a VM's screen as an
//! RFB (VNC) byte stream, for `boxery desktop` on another machine through a context.
//!
//! - The viewer is made here, on the VM's host ([`boxery_verbs::guest::desktop::open`]: a
//!   desktop's `x11vnc -inetd` over the VM's ssh, `-viewonly` unless `control`; any other VM's
//!   console from its backend). A view-only console's client messages go through
//!   [`boxery_verbs::guest::rfb::ViewOnly`] here: what the caller sends is never trusted to be
//!   view only.
//! - Who may: as the connect endpoint (a full token, or a lease token for its lease's VM).
//!   Each open stream counts as one of the token's watches; each is in the actions log.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Shared;
use crate::connect::{may_reach, switched, upgrade_of};
use crate::status::Failure;
use crate::tokens::Caller;

/// `GET /boxery/v1/vms/{name}/screen`.
pub async fn screen(
    State(sh): State<Arc<Shared>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    mut req: Request,
) -> Response {
    let asked = control_of(req.uri().query());
    let control = asked.as_ref().is_ok_and(|c| *c);
    let r = match asked {
        Ok(control) => open(&sh, &caller, &name, control, &mut req).await,
        Err(f) => Err(f),
    };
    let r = r.unwrap_or_else(IntoResponse::into_response);
    let what = if control { "control" } else { "view" };
    crate::connect::audit(&sh, &caller, "screen", &name, what, &r);
    r
}

/// `control=true|false`, and nothing else.
fn control_of(query: Option<&str>) -> Result<bool, Failure> {
    match query.unwrap_or("") {
        "" | "control=false" => Ok(false),
        "control=true" => Ok(true),
        _ => Err(Failure::bad_request(
            "the screen's only parameter is control=true or control=false",
        )),
    }
}

async fn open(
    sh: &Arc<Shared>,
    caller: &Caller,
    name: &str,
    control: bool,
    req: &mut Request,
) -> Result<Response, Failure> {
    may_reach(sh, caller, name, "screen").await?;
    let on = upgrade_of(req, "boxery desktop VM")?;
    // the token's stream limit before any work for it
    let slot = crate::watch::slot(sh, caller)?;
    let viewer = boxery_verbs::guest::desktop::open(&sh.verbs, name, control).await?;
    let mut session = viewer.connect().await?;
    // a desktop's guest session says why it failed on its stderr: read (never left to fill
    // its pipe) and logged
    if let Some(mut why) = session.why.take() {
        let vm = name.to_string();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = (&mut why).take(4096).read_to_end(&mut buf).await;
            let said = String::from_utf8_lossy(&buf);
            if !said.trim().is_empty() {
                tracing::info!(vm = %vm, said = %boxery_verbs::render::safe(said.trim()), "screen: the guest's session said");
            }
            // the rest, unread, would fill the pipe
            let _ = tokio::io::copy(&mut why, &mut tokio::io::sink()).await;
        });
    }
    let vm = name.to_string();
    tokio::spawn(async move {
        let _slot = slot;
        let up = match on.await {
            Ok(up) => up,
            Err(e) => {
                tracing::debug!(vm = %vm, error = %e, "screen: the upgrade failed");
                session.end().await;
                return;
            }
        };
        let (mut from_client, mut to_client) = tokio::io::split(TokioIo::new(up));
        let (to, from, filter) = (&mut session.to, &mut session.from, &mut session.filter);
        let up = async {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match from_client.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let passed = match boxery_verbs::guest::rfb::pass(filter, &buf[..n]) {
                    Ok(passed) => passed,
                    Err(why) => {
                        tracing::info!(vm = %vm, why = %why, "screen: a view-only viewer was disconnected");
                        return;
                    }
                };
                if to.write_all(&passed).await.is_err() {
                    return;
                }
            }
        };
        let down = async {
            let _ = tokio::io::copy(from, &mut to_client).await;
            let _ = to_client.shutdown().await;
        };
        tokio::select! {
            _ = up => {}
            _ = down => {}
        }
        session.end().await;
    });
    Ok(switched())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_is_the_only_parameter() {
        assert!(!control_of(None).unwrap());
        assert!(!control_of(Some("control=false")).unwrap());
        assert!(control_of(Some("control=true")).unwrap());
        for q in ["control=1", "control=true&x=1", "x=1", "control"] {
            assert!(control_of(Some(q)).is_err(), "{q}");
        }
    }
}
