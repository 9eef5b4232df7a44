//! What a `boxery` on another machine needs to reach this home's VMs over ssh, without any
//! other port open here and without an account on this host:
//! - `GET /boxery/v1/vms/NAME/connect` (`Upgrade: boxery-tcp`): the connection becomes a raw
//!   byte stream joined to the VM's sshd (ssh's `ProxyCommand` is `boxery connect`); the
//!   VM's address is the one its object holds, never one the caller names. A full token, or
//!   a lease token for its lease's VM; each open tunnel counts as one of the token's watches.
//! - `POST /boxery/v1/vms/NAME/authorize`: a full token's ssh public key put in the VM's
//!   `authorized_keys` (over the control plane's own ssh), and recorded in
//!   `$BOXERY_HOME/ssh/remote_keys` so every VM made from now on holds it too. The key's
//!   comment names the token; revoking the token removes its keys from that file.

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use boxery_api::{Resource as _, Vm};
use boxery_hands::ssh::SshDir;
use boxery_store::ObjectStoreExt;
use boxery_store::wire::{AuthorizeReply, AuthorizeRequest, CONNECT_PROTOCOL};
use hyper_util::rt::TokioIo;

use crate::Shared;
use crate::scope::{self, Access};
use crate::status::Failure;
use crate::tokens::{Caller, Scope};

/// How long reaching a VM's sshd may take.
const DIAL: Duration = Duration::from_secs(10);

/// `GET /boxery/v1/vms/{name}/connect`.
pub async fn connect(
    State(sh): State<Arc<Shared>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    mut req: Request,
) -> Response {
    let r = match open(&sh, &caller, &name, &mut req).await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    };
    // a shell session through the API (`boxery ssh`, `run`, `cp` of a context) starts here
    audit(&sh, &caller, "connect", &name, "ssh", &r);
    r
}

/// Record a stream opened (or refused) for `caller` to VM `name` in the actions log.
pub(crate) fn audit(
    sh: &Shared,
    caller: &Caller,
    action: &'static str,
    name: &str,
    what: &str,
    r: &Response,
) {
    sh.verbs
        .acting_for(&format!("token:{}", caller.name), "api")
        .doing(
            action,
            boxery_api::name::check_label_name(name)
                .is_ok()
                .then_some(name),
            what,
        )
        .done(format!("HTTP {}", r.status().as_u16()), None);
}

/// Whether `caller` may reach VM `name`'s shell or screen (`what`, for the refusal): a full
/// token, or a lease token for its lease's VM.
pub(crate) async fn may_reach(
    sh: &Arc<Shared>,
    caller: &Caller,
    name: &str,
    what: &str,
) -> Result<(), Failure> {
    if matches!(caller.scope, Scope::Read) {
        return Err(Failure::forbidden(format!(
            "token {} has scope read: reaching a VM's {what} needs a full token (or a lease token, for its lease's VM)",
            caller.name
        )));
    }
    scope::allow(sh, caller, Access::Write, &Vm::INFO, Some(name)).await?;
    Ok(())
}

/// Check that `req` asks for the raw byte stream (`Upgrade: boxery-tcp`; `how`: the command
/// that asks so, for the refusal) and take its upgrade.
pub(crate) fn upgrade_of(
    req: &mut Request,
    how: &str,
) -> Result<hyper::upgrade::OnUpgrade, Failure> {
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(CONNECT_PROTOCOL));
    if !wants {
        return Err(Failure::bad_request(format!(
            "this is an upgrade: send `Connection: upgrade` and `Upgrade: {CONNECT_PROTOCOL}` (`{how}` does)"
        )));
    }
    req.extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>()
        .ok_or_else(|| Failure::bad_request("this connection cannot be upgraded (HTTP/1.1 only)"))
}

/// The answer that switches a connection to the raw byte stream.
pub(crate) fn switched() -> Response {
    let mut r = StatusCode::SWITCHING_PROTOCOLS.into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    r.headers_mut()
        .insert(header::UPGRADE, HeaderValue::from_static(CONNECT_PROTOCOL));
    r
}

async fn open(
    sh: &Arc<Shared>,
    caller: &Caller,
    name: &str,
    req: &mut Request,
) -> Result<Response, Failure> {
    may_reach(sh, caller, name, "shell").await?;
    let on = upgrade_of(req, "boxery connect VM")?;
    // the token's stream limit before any work for it
    let slot = crate::watch::slot(sh, caller)?;
    let vm = vm_named(sh, name).await?;
    if let Some(e) = boxery_hands::not_ready(&vm, boxery_hands::Voice::Cli) {
        return Err(Failure::new(
            StatusCode::CONFLICT,
            "Conflict",
            e.to_string(),
        ));
    }
    let endpoint = observed_endpoint(sh, &vm).await?;
    let tcp = tokio::time::timeout(DIAL, tokio::net::TcpStream::connect(endpoint))
        .await
        .map_err(|_| unavailable(name, "its sshd did not answer within 10 s"))?
        .map_err(|e| unavailable(name, &e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    let (vm_name, token) = (name.to_string(), caller.name.clone());
    tokio::spawn(async move {
        let _slot = slot;
        let mut tcp = tcp;
        match on.await {
            Ok(up) => {
                let mut up = TokioIo::new(up);
                let r = tokio::io::copy_bidirectional(&mut up, &mut tcp).await;
                tracing::debug!(vm = %vm_name, token = %token, result = ?r, "connect ended");
            }
            Err(e) => tracing::debug!(vm = %vm_name, error = %e, "connect: the upgrade failed"),
        }
    });
    Ok(switched())
}

/// Where VM `vm`'s sshd is, as its backend observes it now: never an address the caller
/// names, nor one read from the object alone (a status is the controllers', but the tunnel
/// does not rest on that: it dials only what the backend reports for the VM made for this
/// object, and only when the object agrees).
async fn observed_endpoint(sh: &Shared, vm: &Vm) -> Result<std::net::SocketAddr, Failure> {
    let name = vm.metadata.name.as_str();
    let none = |why: &str| {
        Failure::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("VM {name} {why}: `boxery describe vm {name}` shows its state"),
        )
    };
    let backend = sh
        .verbs
        .env
        .backend()
        .map_err(|e| unavailable(name, &e.chain()))?;
    let info = backend
        .get(name)
        .await
        .map_err(|e| unavailable(name, &e.to_string()))?
        .filter(|i| {
            boxery_backends::mark::Mark::is_for(i.mark.as_deref(), vm.metadata.uid.as_deref())
        })
        .ok_or_else(|| none("is not in its backend"))?;
    let seen = info
        .ssh
        .as_deref()
        .and_then(|e| e.parse::<std::net::SocketAddr>().ok())
        .ok_or_else(|| none("has no ssh endpoint in its backend (is it running?)"))?;
    let recorded = vm.status.ssh.as_ref().and_then(|s| s.endpoint.as_deref());
    if recorded != info.ssh.as_deref() {
        return Err(none(
            "is not where its object says (its controller has not caught up yet): try again in a moment",
        ));
    }
    Ok(seen)
}

/// The Vm object `name`, or 404.
async fn vm_named(sh: &Shared, name: &str) -> Result<Vm, Failure> {
    sh.verbs
        .store()
        .get_as::<Vm>(name)
        .await?
        .ok_or_else(|| Failure::not_found(Vm::INFO.plural, name))
}

fn unavailable(vm: &str, why: &str) -> Failure {
    Failure::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        format!("cannot reach VM {vm}'s sshd: {why}"),
    )
}

/// `POST /boxery/v1/vms/{name}/authorize`.
pub async fn authorize(
    State(sh): State<Arc<Shared>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    match put_key(&sh, &caller, &name, &body).await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    }
}

async fn put_key(
    sh: &Arc<Shared>,
    caller: &Caller,
    name: &str,
    body: &[u8],
) -> Result<Response, Failure> {
    if caller.scope != Scope::Full {
        return Err(Failure::forbidden(format!(
            "token {} is not of scope full: only a full token logs a key in to any VM (a lease's holder logs in with the lease's own key)",
            caller.name
        )));
    }
    let ask: AuthorizeRequest = serde_json::from_slice(body)
        .map_err(|e| Failure::bad_request(format!("not an authorize request: {e}")))?;
    let key = ask.public_key.trim().to_string();
    boxery_api::lease::check_public_key(&key)
        .map_err(|e| Failure::bad_request(format!("publicKey: {e}")))?;
    let vm = vm_named(sh, name).await?;
    // every VM made from now on holds it (seeds, lease resets); this one gets it now
    let ssh = SshDir::new(sh.verbs.home());
    let comment = crate::tokens::key_comment(&caller.name);
    let line = ssh
        .add_remote_key(&key, &comment)
        .map_err(|e| internal(format!("recording the key failed: {e}")))?;
    let reach = sh
        .verbs
        .reach(name)
        .await
        .map_err(|e| Failure::new(StatusCode::CONFLICT, "Conflict", e.to_string()))?;
    let q = boxery_hands::shell_quote(&line);
    let script = format!(
        "umask 077; mkdir -p ~/.ssh && touch ~/.ssh/authorized_keys && {{ grep -qxF {q} ~/.ssh/authorized_keys || printf '%s\\n' {q} >> ~/.ssh/authorized_keys; }}"
    );
    let mut c = reach.std_command();
    c.args(["-T", "-o", "BatchMode=yes", "--", &script])
        .stdin(std::process::Stdio::null());
    let out = tokio::task::spawn_blocking(move || c.output())
        .await
        .map_err(|e| internal(e.to_string()))?
        .map_err(|e| internal(format!("cannot run ssh: {e}")))?;
    if !out.status.success() {
        return Err(unavailable(
            name,
            &format!(
                "putting the key in its authorized_keys failed: {}",
                boxery_verbs::render::safe(String::from_utf8_lossy(&out.stderr).trim())
            ),
        ));
    }
    let reply = AuthorizeReply {
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        line,
    };
    Ok(crate::resources::json_reply(
        StatusCode::OK,
        &serde_json::to_value(reply).expect("serializes"),
    ))
}

fn internal(message: String) -> Failure {
    Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message)
}
