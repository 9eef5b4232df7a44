//! Incus's lifecycle events for the inventory ([`crate::Backend::changes`]): a websocket on
//! `/1.0/events?type=lifecycle&project=P` over the daemon's unix socket, followed for as long
//! as anyone holds the receiver. Each event about an instance of the project (made, started,
//! stopped, deleted, renamed, by boxery or by `incus` at a terminal) moves the counter.
//!
//! # Guarantees
//! - A feed that cannot connect, or is cut (incusd restarted, its socket gone), is connected
//!   again after 1 s, doubling to 30 s; each time it is back the counter moves, since what
//!   happened while it was cut was not seen.
//! - The task ends once no receiver is left.
//! - Only `lifecycle` events whose action starts with `instance-` count; anything else,
//!   malformed JSON included, is ignored.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;

/// The first wait before connecting again; doubled up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait before connecting again.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Start following the events of `project` on the daemon at `socket` (within a Tokio
/// runtime); the counter's receiver.
pub(super) fn follow(socket: PathBuf, project: String) -> watch::Receiver<u64> {
    let (tx, rx) = watch::channel(0u64);
    tokio::spawn(run(socket, project, tx));
    rx
}

async fn run(socket: PathBuf, project: String, tx: watch::Sender<u64>) {
    let mut wait = RETRY_MIN;
    let mut said = false;
    loop {
        let connected = tokio::select! {
            _ = tx.closed() => return,
            c = connect(&socket, &project) => c,
        };
        match connected {
            Ok(mut ws) => {
                if said {
                    tracing::info!(socket = %socket.display(), "following incusd's events again");
                }
                (wait, said) = (RETRY_MIN, false);
                tx.send_modify(|n| *n += 1);
                loop {
                    let msg = tokio::select! {
                        _ = tx.closed() => return,
                        msg = ws.next() => msg,
                    };
                    match msg {
                        Some(Ok(Message::Text(text))) => {
                            if instance_change(text.as_str()) {
                                tx.send_modify(|n| *n += 1);
                            }
                        }
                        Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                        Some(Ok(_)) => {} // pings are answered by the library as it reads
                    }
                }
            }
            Err(e) => {
                if !said {
                    tracing::warn!(socket = %socket.display(), error = %e,
                        "cannot follow incusd's events; the inventory's periodic passes go on, retrying");
                    said = true;
                }
            }
        }
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(RETRY_MAX);
    }
}

type Events = tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>;

async fn connect(socket: &Path, project: &str) -> Result<Events, String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| e.to_string())?;
    let url = format!(
        "ws://incus/1.0/events?type=lifecycle&project={}",
        super::client::encode(project)
    );
    let handshake = tokio_tungstenite::client_async(url, stream);
    match tokio::time::timeout(Duration::from_secs(30), handshake).await {
        Ok(Ok((ws, _))) => Ok(ws),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer to the websocket handshake in 30 s".into()),
    }
}

/// Whether `text` is a lifecycle event about an instance.
fn instance_change(text: &str) -> bool {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return false;
    };
    v["type"] == "lifecycle"
        && v["metadata"]["action"]
            .as_str()
            .is_some_and(|a| a.starts_with("instance-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_instance_lifecycle_events_count() {
        let ev = |t: &str, action: &str| {
            format!(
                r#"{{"type":"{t}","timestamp":"2026-12-07T20:00:00Z","metadata":{{"action":"{action}","source":"/1.0/instances/u1?project=boxery-1","context":{{}}}},"project":"boxery-1"}}"#
            )
        };
        assert!(instance_change(&ev("lifecycle", "instance-deleted")));
        assert!(instance_change(&ev("lifecycle", "instance-stopped")));
        assert!(instance_change(&ev("lifecycle", "instance-started")));
        assert!(!instance_change(&ev("lifecycle", "image-created")));
        assert!(!instance_change(&ev("lifecycle", "network-updated")));
        assert!(!instance_change(&ev("logging", "instance-deleted")));
        assert!(!instance_change("not json"));
        assert!(!instance_change(
            r#"{"type":"lifecycle","metadata":{"action":7}}"#
        ));
    }
}
