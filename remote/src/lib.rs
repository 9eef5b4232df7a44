//! boxery on another machine than its VMs: a laptop's `boxery --context NAME …` and
//! `boxery mcp --context NAME` working on a VM host's `boxery serve --api-listen`.
//!
//! - [`context`]: the contexts this home knows (`$BOXERY_HOME/contexts.yaml`, in kubeconfig
//!   format: a server, its CA, a token), which one is current, and each one's own folder;
//! - [`client`]: HTTPS to a context's API, trusting its CA only;
//! - [`store`]: [`RemoteStore`], the [`ObjectStore`](boxery_store::ObjectStore) over the API's
//!   store calls: the verbs run here, on the VM host's store, with its validation;
//! - [`connect`]: the ssh way to the VM host's VMs: `boxery connect VM` carries one ssh
//!   connection through the API (ssh's `ProxyCommand`), and short-lived certificates the VM
//!   host's control plane signs log this machine's key in; host keys stay pinned.

pub mod client;
pub mod connect;
pub mod context;
pub mod store;

use std::sync::Arc;

pub use crate::client::Client;
pub use crate::context::Context;
pub use crate::store::RemoteStore;

/// The verbs on the control plane `ctx` names: its store over the API, this machine's
/// folder for the context as their home, and the way to its VMs.
pub async fn verbs(
    ctx: &Context,
    backend: String,
    voice: boxery_verbs::Voice,
) -> boxery_verbs::Result<boxery_verbs::Verbs> {
    let client = Client::new(ctx)?;
    let store = RemoteStore::connect(client.clone()).await?;
    let env = boxery_verbs::Env::new(ctx.home.clone(), backend);
    let hands = connect::Hands::new(client, ctx);
    Ok(boxery_verbs::Verbs::remote(
        env,
        voice,
        Arc::new(store),
        Arc::new(hands),
    ))
}
