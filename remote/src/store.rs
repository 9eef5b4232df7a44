//! [`RemoteStore`]: the [`ObjectStore`] of a VM host's `boxery serve`, over its API's store
//! calls ([`boxery_store::wire`]). It keeps every promise of the trait (the conformance suite
//! runs against it, `remote/tests/conformance_remote.rs`): the server's store keeps them, and
//! this side only carries the calls and their errors (the same [`StoreError`] variants).

use std::collections::VecDeque;

use async_trait::async_trait;
use boxery_api::{DynObject, Selector};
use boxery_store::wire::{
    CALL_PATH, Call, WATCH_PATH, WatchLine, WireApplyAction, WireDeleteOutcome, WireError,
    WireLeadership,
};
use boxery_store::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, Leadership, ObjectRef, ObjectStore,
    Result, StoreError, WatchStream,
};
use futures::StreamExt;
use serde::de::DeserializeOwned;

use crate::client::Client;

/// The store of a control plane on another machine.
#[derive(Debug, Clone)]
pub struct RemoteStore {
    client: Client,
    uid: String,
}

impl RemoteStore {
    /// Reach the store behind `client` (one call: its identity, which also checks the token).
    pub async fn connect(client: Client) -> Result<RemoteStore> {
        let mut s = RemoteStore {
            client,
            uid: String::new(),
        };
        s.uid = s.call(Call::Uid).await?;
        Ok(s)
    }

    /// The store behind `client` whose identity is known already (from an earlier
    /// [`RemoteStore::connect`]): no call made.
    pub fn with_uid(client: Client, uid: String) -> RemoteStore {
        RemoteStore { client, uid }
    }

    /// Make one call.
    async fn call<T: DeserializeOwned>(&self, call: Call) -> Result<T> {
        let r = self
            .client
            .request(reqwest::Method::POST, CALL_PATH)
            .json(&call)
            .send()
            .await
            .map_err(|e| self.client.unreachable(&e))?;
        let code = r.status();
        if code.is_success() {
            let bytes = r.bytes().await.map_err(|e| self.client.unreachable(&e))?;
            return serde_json::from_slice(&bytes).map_err(|e| StoreError::Unavailable {
                why: format!("the answer to {} is not what this boxery reads ({e}): are both ends the same version?", call.name()),
            });
        }
        let is_json = r
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
        // a 403 is the store's own (`Forbidden`: who may write what) when it carries a store
        // error, the token's scope's (a Kubernetes Status) otherwise
        if is_json && code.as_u16() != 401 && code.as_u16() != 429 {
            let bytes = r.bytes().await.map_err(|e| self.client.unreachable(&e))?;
            #[derive(serde::Deserialize)]
            struct Wrapped {
                error: WireError,
            }
            if let Ok(w) = serde_json::from_slice::<Wrapped>(&bytes) {
                return Err(w.error.into());
            }
            // a Kubernetes Status says what it is in its message
            let status: Option<String> = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v["message"].as_str().map(String::from));
            let message = status
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned())
                .chars()
                .take(300)
                .collect::<String>();
            return Err(StoreError::Unavailable {
                why: format!(
                    "the API of context {} answered {}: {}",
                    self.client.name,
                    code.as_u16(),
                    boxery_verbs::render::safe(&message)
                ),
            });
        }
        Err(self.client.refused(r).await)
    }
}

#[async_trait]
impl ObjectStore for RemoteStore {
    fn uid(&self) -> &str {
        &self.uid
    }
    async fn get(&self, key: &ObjectRef) -> Result<Option<DynObject>> {
        self.call(Call::Get {
            kind: key.kind.clone(),
            name: key.name.clone(),
        })
        .await
    }
    async fn list(&self, kind: &str, selector: &Selector) -> Result<(Vec<DynObject>, u64)> {
        self.call(Call::List {
            kind: kind.into(),
            selector: selector.clone(),
        })
        .await
    }
    async fn list_named_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<DynObject>> {
        self.call(Call::ListNamedPrefix {
            kind: kind.into(),
            prefix: prefix.into(),
        })
        .await
    }
    async fn create_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.call(Call::CreateBy {
            obj,
            manager: manager.into(),
        })
        .await
    }
    async fn adopt(&self, obj: DynObject, uid: &str) -> Result<DynObject> {
        self.call(Call::Adopt {
            obj,
            uid: uid.into(),
        })
        .await
    }
    async fn update_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.call(Call::UpdateBy {
            obj,
            manager: manager.into(),
        })
        .await
    }
    async fn update_dry_run_by(&self, obj: DynObject, manager: &str) -> Result<DynObject> {
        self.call(Call::UpdateDryRunBy {
            obj,
            manager: manager.into(),
        })
        .await
    }
    async fn update_status(&self, obj: DynObject) -> Result<DynObject> {
        self.call(Call::UpdateStatus { obj }).await
    }
    async fn delete(&self, key: &ObjectRef) -> Result<DeleteOutcome> {
        let d: WireDeleteOutcome = self
            .call(Call::Delete {
                kind: key.kind.clone(),
                name: key.name.clone(),
            })
            .await?;
        Ok(d.into())
    }
    async fn apply_all(
        &self,
        objs: Vec<DynObject>,
        opts: &ApplyOptions,
    ) -> Result<Vec<(ApplyAction, DynObject)>> {
        let done: Vec<(WireApplyAction, DynObject)> = self
            .call(Call::ApplyAll {
                objs,
                opts: opts.into(),
            })
            .await?;
        Ok(done.into_iter().map(|(a, o)| (a.into(), o)).collect())
    }
    async fn revision(&self) -> Result<u64> {
        self.call(Call::Revision).await
    }
    fn watch(&self, kind: Option<&str>, from: u64) -> WatchStream {
        let mut req = self
            .client
            .request(reqwest::Method::GET, WATCH_PATH)
            .query(&[("from", from.to_string())]);
        if let Some(k) = kind {
            req = req.query(&[("kind", k)]);
        }
        let client = self.client.clone();
        // opened on the first poll; then its body, cut into lines
        enum State {
            Start(reqwest::RequestBuilder, Client),
            Reading(
                futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
                Vec<u8>,
                VecDeque<Vec<u8>>,
                Client,
            ),
            Done,
        }
        futures::stream::unfold(State::Start(req, client), |state| async move {
            let (mut body, mut buf, mut lines, client) = match state {
                State::Done => return None,
                State::Start(req, client) => match req.send().await {
                    Ok(r) if r.status().is_success() => {
                        (r.bytes_stream().boxed(), Vec::new(), VecDeque::new(), client)
                    }
                    Ok(r) if r.status().as_u16() == 410 => {
                        // a stream refused before it started carries its error as JSON
                        let e = r.json::<serde_json::Value>().await.ok().and_then(|v| {
                            serde_json::from_value::<WireError>(v["error"].clone()).ok()
                        });
                        let e = e.map(StoreError::from).unwrap_or(StoreError::Unavailable {
                            why: "the watch was refused (410)".into(),
                        });
                        return Some((Err(e), State::Done));
                    }
                    Ok(r) => return Some((Err(client.refused(r).await), State::Done)),
                    Err(e) => return Some((Err(client.unreachable(&e)), State::Done)),
                },
                State::Reading(body, buf, lines, client) => (body, buf, lines, client),
            };
            loop {
                if let Some(line) = lines.pop_front() {
                    let item = serde_json::from_slice::<WatchLine>(&line)
                        .map_err(|e| StoreError::Unavailable {
                            why: format!("the server sent a watch line this boxery cannot read: {e}"),
                        })
                        .and_then(WatchLine::into_item);
                    let next = if item.is_err() {
                        State::Done
                    } else {
                        State::Reading(body, buf, lines, client)
                    };
                    return Some((item, next));
                }
                match body.next().await {
                    Some(Ok(chunk)) => {
                        buf.extend_from_slice(&chunk);
                        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = buf.drain(..=i).collect();
                            if line.len() > 1 {
                                lines.push_back(line);
                            }
                        }
                    }
                    Some(Err(e)) => return Some((Err(client.unreachable(&e)), State::Done)),
                    None => {
                        let e = StoreError::Unavailable {
                            why: format!(
                                "the watch from context {} at {} ended (the server stopped or the connection was lost): list again and watch from its revision",
                                client.name, client.server
                            ),
                        };
                        return Some((Err(e), State::Done));
                    }
                }
            }
        })
        // polled again after its end (a caller checking it stays ended): still the end
        .fuse()
        .boxed()
    }
    async fn compact(&self, keep_revisions: u64) -> Result<u64> {
        self.call(Call::Compact { keep_revisions }).await
    }
    async fn compacted(&self) -> Result<u64> {
        self.call(Call::Compacted).await
    }
    async fn was_removed(&self, uid: &str) -> Result<bool> {
        self.call(Call::WasRemoved { uid: uid.into() }).await
    }
    async fn try_lead(
        &self,
        lock: &str,
        me: &Candidate,
        ttl: std::time::Duration,
    ) -> Result<Leadership> {
        let l: WireLeadership = self
            .call(Call::TryLead {
                lock: lock.into(),
                me: me.into(),
                ttl_ms: ttl.as_millis().min(u64::MAX as u128) as u64,
            })
            .await?;
        Ok(l.into())
    }
    async fn resign(&self, lock: &str, me: &Candidate) -> Result<()> {
        self.call(Call::Resign {
            lock: lock.into(),
            me: me.into(),
        })
        .await
    }
    async fn leader(&self, lock: &str) -> Result<Option<String>> {
        self.call(Call::Leader { lock: lock.into() }).await
    }
}
