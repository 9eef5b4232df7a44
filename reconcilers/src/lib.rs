//! boxery's reconcilers: one per kind (`Vm`, `Image`, `Pool`, `Lease`, `Grant`), the inventory resync, and `run`, which
//! starts them all on one store and backend (used by `boxery serve` and by the CLI's embedded
//! mode).

pub mod adopt;
pub mod agent_forward;
pub mod backoff;
pub mod boot;
pub mod budget;
pub mod context;
pub mod display;
pub mod error;
pub mod grant;
pub mod guest;
pub mod image;
pub mod inventory;
pub mod layers;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod pool;
pub mod quota;
pub mod recorded;
pub mod runtime;
/// The harness of the reconcilers' decision tests (a store in memory, the fake backend).
#[doc(hidden)]
pub mod testing;
pub use boxery_hands::ssh;
pub mod vm;

pub use context::{Ctx, Settings};
pub use error::ReconcileError;
