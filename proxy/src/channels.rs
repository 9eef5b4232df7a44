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
//! - A VM's own channel also answers its guest's name lookups where its backend says where
//!   ([`GuestProxy::dns`], [`crate::dns`]); that socket lives and goes with the channel.
//! - A TCP address that cannot be bound is retried every pass and reported once until it is.
//!
//! # Caveats
//! - Connections already open on a removed channel finish; each of their requests is still
//!   checked against the token file.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use boxery_backends::{Backend, GuestProxy, ProxyListen};
use tokio_util::sync::CancellationToken;

use crate::Proxy;

/// How often the channels are compared with the token store.
pub const EVERY: Duration = Duration::from_millis(500);

/// One channel being served.
struct Served {
    stop: CancellationToken,
    /// Its VM's name-lookup sockets ([`crate::dns`]), when it has them.
    dns: Vec<PathBuf>,
}

impl Served {
    /// Stop serving and remove the sockets.
    fn end(self, listen: &ProxyListen) {
        self.stop.cancel();
        remove_socket(listen);
        for dns in &self.dns {
            remove_socket_file(dns);
        }
    }
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
        let mut want: HashMap<ProxyListen, GuestProxy> = HashMap::new();
        let mut channels: HashMap<ProxyListen, String> = HashMap::new();
        for vm in boxery_home::tokens::vms(&home) {
            if let Some(g) = backend.guest_proxy(&vm) {
                if matches!(g.listen, ProxyListen::Unix(_)) {
                    channels.insert(g.listen.clone(), vm);
                }
                want.insert(g.listen.clone(), g);
            }
        }
        for listen in served.keys().cloned().collect::<Vec<_>>() {
            if !want.contains_key(&listen)
                && let Some(s) = served.remove(&listen)
            {
                s.end(&listen);
            }
        }
        failed.retain(|l| want.contains_key(l));
        for (listen, g) in want {
            if served.contains_key(&listen) {
                continue;
            }
            let channel = channels.remove(&listen);
            match start(&proxy, &g, channel, stop.child_token()).await {
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
        s.end(&listen);
    }
}

/// Remove a channel's socket file.
fn remove_socket(listen: &ProxyListen) {
    if let ProxyListen::Unix(path) = listen {
        remove_socket_file(path);
    }
}

/// Remove the socket at `path` (only a socket: never anything else there).
fn remove_socket_file(path: &Path) {
    let _ = crate::clear_socket(path);
}

/// Serve `g` (its VM's name lookups too, on a VM's own channel) until `stop`.
async fn start(
    proxy: &Proxy,
    g: &GuestProxy,
    channel: Option<String>,
    stop: CancellationToken,
) -> std::io::Result<Served> {
    let listen = &g.listen;
    let dns = match (&channel, &g.dns) {
        (Some(vm), Some(d)) => Some((vm.clone(), d)),
        _ => None,
    };
    let router = proxy.router_seen_at(channel, Some(&g.url));
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
            if let Some((vm, d)) = &dns
                && let Err(e) = crate::dns::start(
                    proxy,
                    vm,
                    &d.listen,
                    d.listen_tcp.as_deref(),
                    stop.child_token(),
                )
            {
                // the proxy serves; lookups are retried with the channel
                stop.cancel();
                remove_socket(listen);
                return Err(e);
            }
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
    Ok(Served {
        stop,
        dns: dns
            .map(|(_, d)| {
                std::iter::once(d.listen.clone())
                    .chain(d.listen_tcp.clone())
                    .collect()
            })
            .unwrap_or_default(),
    })
}
