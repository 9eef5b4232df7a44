//! boxery's control plane in one process, the composition root of its parts: [`serve`] (wait
//! to lead the store, then run the controllers, the credential proxy, the MCP and
//! Kubernetes API listeners and `/metrics`) and [`Embedder`], the verbs'
//! [`ControlPlane`](boxery_verbs::control::ControlPlane): a command's `--wait`, or `boxery mcp`,
//! runs the controllers in its own process while nothing else leads the store.
//!
//! The verbs know the controllers only through that trait; this crate is where the
//! controllers, the reconcilers' context, the backend and the listeners are put together.

mod embedded;
pub mod malloc;
mod metrics;
mod serve;

pub use embedded::{Embedder, context};
pub use serve::{
    INVENTORY_EVERY, LEASE, McpListen, MetricsListen, Options, ProxyListen, inventory_every_arg,
    lease_arg, proxy_listen_arg, serve,
};
