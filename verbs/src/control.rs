//! The controllers as the verbs see them: whether a control plane leads this home's store, and
//! a way, given by the composition root (`boxery-daemon`), to run them in this process.
//!
//! The verbs never start controllers themselves: a wait that finds nothing leading the store
//! asks the [`ControlPlane`] in its [`Env`](crate::Env) to run them here (embedded mode), and
//! without one it watches the store only.

use std::sync::Arc;

use boxery_store::ObjectStore;

use crate::env::Env;
use crate::error::Result;

/// The store lock the controllers lead under.
pub const LOCK: &str = "boxery-controllers";

/// What to say after a write that does not wait, when nothing leads the store: the change is
/// stored, and nothing will act on it until a control plane runs. `None` while one leads.
pub async fn unreconciled_note(v: &crate::Verbs) -> Result<Option<String>> {
    if v.store().leader(LOCK).await?.is_some() {
        return Ok(None);
    }
    Ok(Some(match v.voice {
        boxery_hands::Voice::Cli => "boxery: stored, but nothing reconciles this home now (no \
            `boxery serve` runs): start one with `boxery serve` (or keep one running with \
            `boxery service install`), or add --wait to run the controllers in this command"
            .to_string(),
        boxery_hands::Voice::Tool => "note: stored, but nothing reconciles this home now (no \
            control plane runs): call again with wait: true, or ask the user to run \
            `boxery serve` (or `boxery service install`)"
            .to_string(),
    }))
}

/// A way to run the controllers in this process while nothing else leads the store.
#[async_trait::async_trait]
pub trait ControlPlane: Send + Sync + std::fmt::Debug {
    /// Start the controllers of `env`'s home here if nothing leads `store`.
    async fn start_if_needed(&self, env: &Env, store: &Arc<dyn ObjectStore>) -> Result<Started>;
}

/// Controllers running in this process, until stopped.
#[async_trait::async_trait]
pub trait Running: Send {
    /// Stop the controllers and give up leadership.
    async fn stop(self: Box<Self>);
}

/// What [`ControlPlane::start_if_needed`] found.
pub enum Started {
    /// The controllers run in this process until [`Running::stop`].
    Here(Box<dyn Running>),
    /// Another process (`serve`) leads the store.
    Elsewhere,
    /// Nothing led, but the backend does not answer: its VMs were marked
    /// `BackendReachable=False` and no controller runs here (the message says why).
    Unreachable(String),
}
