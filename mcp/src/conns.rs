//! The open connections of boxery's HTTP listeners (the MCP endpoint's, [`crate::server`], and
//! the Kubernetes API's, `boxery_apiserver`), oldest first, so that idle and unauthenticated
//! sockets can never keep a token holder out, and the rule both use to end a connection whose
//! request body was left unread ([`close_after_refusal`]).
//!
//! Guarantees: at most `connections` are admitted at once, and `per_peer` from one address.
//! At a cap, the oldest connection that has not shown a token ([`Proven::prove`]) is closed
//! (its [`Admitted::evict`] is cancelled) to make room, from the same address when that
//! address's cap is the one reached; when every connection has shown one, the new one is
//! refused. A connection's place is given back when its [`Slot`] is dropped.
//!
//! Caveats: on loopback every local client has the same address, so the per-peer cap
//! separates nobody there; what keeps the token holder served is that unauthenticated
//! connections make room first. An attacker that opens a whole cap of connections in the
//! moment between a client's connect and its first authenticated request can still close that
//! client's new connection (it retries).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Set on a connection once one of its requests showed a valid token: it is no longer among
/// the first to be closed when the listener is full. Handlers find it in the request's
/// extensions.
#[derive(Clone, Default, Debug)]
pub struct Proven(Arc<AtomicBool>);

impl Proven {
    /// The connection showed a valid token.
    pub fn prove(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether it did.
    pub fn is_proven(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// One open connection.
struct Live {
    peer: IpAddr,
    proven: Proven,
    evict: CancellationToken,
}

/// The open connections of one listener, oldest first.
#[derive(Default)]
pub struct Conns {
    table: Mutex<(u64, BTreeMap<u64, Live>)>,
}

/// A connection's place in [`Conns`], given back when dropped.
pub struct Slot {
    conns: Arc<Conns>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self.conns.table.lock().unwrap_or_else(|e| e.into_inner());
        t.1.remove(&self.id);
    }
}

/// A connection let in.
pub struct Admitted {
    /// Its place; hold it as long as the connection.
    pub slot: Slot,
    /// Prove it when a request shows a valid token (put it in the requests' extensions).
    pub proven: Proven,
    /// Cancelled when it is closed to make room: stop serving it then.
    pub evict: CancellationToken,
}

impl Conns {
    /// Admit a connection from `peer`, within `connections` in all and `per_peer` from one
    /// address. At a cap, the oldest connection that has not shown a token (from this peer,
    /// when the peer's cap is the one reached) is closed to make room; when every connection
    /// has shown one, the new one is refused (`None`).
    pub fn admit(
        self: &Arc<Self>,
        peer: IpAddr,
        connections: usize,
        per_peer: usize,
    ) -> Option<Admitted> {
        let peer = peer.to_canonical();
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let (next, live) = &mut *t;
        let peer_full = live.values().filter(|l| l.peer == peer).count() >= per_peer;
        if peer_full || live.len() >= connections {
            let victim = live
                .iter()
                .find(|(_, l)| !l.proven.is_proven() && (!peer_full || l.peer == peer))
                .map(|(id, _)| *id)?;
            if let Some(l) = live.remove(&victim) {
                l.evict.cancel();
            }
        }
        let id = *next;
        *next += 1;
        let one = Live {
            peer,
            proven: Proven::default(),
            evict: CancellationToken::new(),
        };
        let (proven, evict) = (one.proven.clone(), one.evict.clone());
        live.insert(id, one);
        Some(Admitted {
            slot: Slot {
                conns: self.clone(),
                id,
            },
            proven,
            evict,
        })
    }

    /// How many are open.
    pub fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The accepting side of a listener: sockets taken within the cap, each admitted into
/// [`Conns`] or closed, and the connections' tasks, drained at the end.
pub struct Acceptor {
    /// For the log lines (`MCP`, `API`).
    what: &'static str,
    connections: usize,
    per_peer: usize,
    conns: Arc<Conns>,
    /// Sockets, not table entries, are what run out: a connection closed to make room holds
    /// its descriptor until its task has run, so nothing more is accepted until one permit
    /// (of the cap, plus one for the connection being decided on) is free again.
    sockets: Arc<tokio::sync::Semaphore>,
    tasks: tokio::task::JoinSet<()>,
}

/// A connection accepted and admitted.
pub struct Accepted {
    /// The socket.
    pub stream: tokio::net::TcpStream,
    /// Its place and its socket permit: hold it as long as the connection (drop the socket
    /// first).
    pub held: Held,
    /// Prove it when a request shows a valid token.
    pub proven: Proven,
    /// Cancelled when it is closed to make room.
    pub evict: CancellationToken,
}

/// A connection's place in [`Conns`] and its socket permit, given back when dropped.
pub struct Held {
    _slot: Slot,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Acceptor {
    /// An acceptor admitting `connections` in all and `per_peer` from one address.
    pub fn new(what: &'static str, connections: usize, per_peer: usize) -> Acceptor {
        Acceptor {
            what,
            connections,
            per_peer,
            conns: Arc::new(Conns::default()),
            sockets: Arc::new(tokio::sync::Semaphore::new(connections + 1)),
            tasks: tokio::task::JoinSet::new(),
        }
    }

    /// The next connection admitted from `listener` (those refused are closed here), or
    /// `None` once `shutdown` is cancelled.
    pub async fn next(
        &mut self,
        listener: &tokio::net::TcpListener,
        shutdown: &CancellationToken,
    ) -> Option<Accepted> {
        loop {
            let permit = tokio::select! {
                _ = shutdown.cancelled() => return None,
                p = self.sockets.clone().acquire_owned() => p.expect("never closed"),
            };
            let (stream, peer) = tokio::select! {
                _ = shutdown.cancelled() => return None,
                Some(_) = self.tasks.join_next(), if !self.tasks.is_empty() => continue,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // EMFILE and the like: say so and let descriptors free up.
                        tracing::warn!(error = %e, "{}: accepting a connection failed", self.what);
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                            _ = shutdown.cancelled() => return None,
                        }
                        continue;
                    }
                },
            };
            let Some(Admitted {
                slot,
                proven,
                evict,
            }) = self.conns.admit(peer.ip(), self.connections, self.per_peer)
            else {
                tracing::debug!(%peer, open = self.conns.len(), "{}: too many connections: refused", self.what);
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            return Some(Accepted {
                stream,
                held: Held {
                    _slot: slot,
                    _permit: permit,
                },
                proven,
                evict,
            });
        }
    }

    /// Run a connection's task.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Wait up to `grace` for the connections' tasks to finish (they got the stop too and
    /// finish their requests); what has not finished by then is cut.
    pub async fn drain(mut self, grace: Duration) {
        let drained = tokio::time::timeout(grace, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            self.tasks.shutdown().await;
        }
    }
}

/// A refusal of a request that came with a body (401 before the token, 403, 413, …) is
/// answered without reading that body, so the connection cannot carry another request: the
/// answer says `Connection: close`, and the client opens a new one rather than sending its
/// next request on a connection the server is closing (which it sees as "disconnected
/// without a response").
pub async fn close_after_refusal(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::header;
    let has_body = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|n| n > 0)
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    let mut r = next.run(req).await;
    if has_body && (r.status().is_client_error() || r.status().is_server_error()) {
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_a_cap_the_oldest_connection_without_the_token_makes_room() {
        let conns = Arc::new(Conns::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c1 = conns.admit(a, 3, 2).unwrap();
        let c2 = conns.admit(a, 3, 2).unwrap();
        // a is at its cap: its oldest unproven connection (1) goes.
        let c3 = conns.admit(a, 3, 2).unwrap();
        assert!(c1.evict.is_cancelled() && !c2.evict.is_cancelled());
        drop(c1); // its task ends; the slot was already given back
        assert_eq!(conns.len(), 2);
        // b fills the total; then another b finds only a's connections unproven: not its own.
        let c4 = conns.admit(b, 3, 2).unwrap();
        c4.proven.prove();
        let _c5 = conns.admit(b, 3, 2).unwrap();
        assert!(
            c2.evict.is_cancelled(),
            "the total cap closes the oldest unproven anywhere"
        );
        assert!(
            conns.admit(b, 3, 2).is_some(),
            "b's unproven one makes room for b"
        );
        assert!(!c3.evict.is_cancelled());
        // Every connection proven: refused.
        let full = Arc::new(Conns::default());
        let x = full.admit(a, 1, 1).unwrap();
        x.proven.prove();
        assert!(full.admit(a, 1, 1).is_none());
        // An IPv4-mapped address is the same peer as its IPv4 one.
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let per = Arc::new(Conns::default());
        let m = per.admit(a, 10, 1).unwrap();
        let _n = per.admit(mapped, 10, 1).unwrap();
        assert!(m.evict.is_cancelled());
    }
}
