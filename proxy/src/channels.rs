//! Serving the proxy where each guest reaches it ([`Backend::guest_proxy`]): a unix socket of
//! its own per VM (qemu: slirp's `guestfwd` runs `socat` to it for each guest connection), or
//! a TCP address on the guests' network shared by a backend's VMs (libvirt: the bridge).
//!
//! # Guarantees
//! - A VM has its channel while it has a token (`$BOXERY_HOME/tokens/<vm>`), and none
//!   otherwise: a free pool member, a deleted VM. Checked every [`EVERY`]; a token's removal
//!   already refuses every request at once (the token is read per request), the channel's
//!   removal follows.
//! - A per-VM socket serves [`Proxy::router`] with that VM as its channel: another VM's token
//!   is refused there. It is created 0600 (QEMU runs as this user) and removed with the
//!   channel, and when [`keep`] stops.
//! - A TCP address that cannot be bound is retried every pass and reported once until it is.
//!
//! # Caveats
//! - Connections already open on a removed channel finish; each of their requests is still
//!   checked against the token file.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::sync::Arc;
use std::time::Duration;

use boxery_backends::{Backend, ProxyListen};
use tokio_util::sync::CancellationToken;

use crate::Proxy;

/// How often the channels are compared with the token store.
pub const EVERY: Duration = Duration::from_millis(500);

/// One channel being served.
struct Served {
    stop: CancellationToken,
}

/// Keep a channel for every VM with a token until `stop`.
pub async fn keep(proxy: Proxy, backend: Arc<dyn Backend>, stop: CancellationToken) {
    let home = proxy.inner.home.clone();
    let mut served: HashMap<ProxyListen, Served> = HashMap::new();
    let mut failed: HashSet<ProxyListen> = HashSet::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        // What should be served: each VM with a token, at the place its backend names.
        let mut want: HashMap<ProxyListen, (Option<String>, String)> = HashMap::new();
        for vm in boxery_home::tokens::vms(&home) {
            if let Some(g) = backend.guest_proxy(&vm) {
                let channel = matches!(g.listen, ProxyListen::Unix(_)).then_some(vm);
                want.insert(g.listen, (channel, g.url));
            }
        }
        served.retain(|listen, s| {
            let keep = want.contains_key(listen);
            if !keep {
                s.stop.cancel();
                remove_socket(listen);
            }
            keep
        });
        failed.retain(|l| want.contains_key(l));
        for (listen, (channel, url)) in want {
            if served.contains_key(&listen) {
                continue;
            }
            match start(&proxy, &listen, channel, &url, stop.child_token()).await {
                Ok(s) => {
                    if failed.remove(&listen) {
                        tracing::info!(channel = ?listen, "credential proxy channel serving");
                    }
                    served.insert(listen, s);
                }
                // A VM whose directory is not made yet: next pass.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    if failed.insert(listen.clone()) {
                        tracing::warn!(channel = ?listen, error = %e,
                            "cannot serve the credential proxy where guests reach it; retrying");
                    }
                }
            }
        }
    }
    for (listen, s) in served {
        s.stop.cancel();
        remove_socket(&listen);
    }
}

/// Remove a channel's socket file (only a socket: never anything else at that path).
fn remove_socket(listen: &ProxyListen) {
    if let ProxyListen::Unix(path) = listen
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
    {
        let _ = std::fs::remove_file(path);
    }
}

async fn start(
    proxy: &Proxy,
    listen: &ProxyListen,
    channel: Option<String>,
    url: &str,
    stop: CancellationToken,
) -> std::io::Result<Served> {
    let router = proxy.router_seen_at(channel, Some(url));
    let done = stop.clone();
    match listen {
        ProxyListen::Unix(path) => {
            // The VM's directory exists once the backend made the VM; a token can come first.
            if !path.parent().is_some_and(|d| d.is_dir()) {
                return Err(std::io::ErrorKind::NotFound.into());
            }
            remove_socket(listen);
            let listener = tokio::net::UnixListener::bind(path)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            tokio::spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(done.cancelled_owned())
                    .await;
            });
        }
        ProxyListen::Tcp(addr) => {
            use axum::serve::ListenerExt;
            let listener = tokio::net::TcpListener::bind(addr).await?.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            tokio::spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(done.cancelled_owned())
                    .await;
            });
        }
    }
    Ok(Served { stop })
}
