//! boxery's controller runtime, on the model of kube-runtime: a [`reflector`] keeps an
//! in-memory cache of a kind from the store's watch; a [`scheduler`] queues object names
//! (deduplicated, earliest deadline wins); a [`runner`] calls `reconcile` with at most one
//! call in flight per name and a global concurrency limit; the [`controller`] ties them
//! together with the requeue and [`backoff`] policy ([`Action`]). Beside it: the
//! [`finalizer`] helpers, the [`events`] recorder and [`leader`] election, a [`manager`] that
//! runs several controllers on one shutdown token, and [`write_through`], which lets a
//! controller's reconciles read their own writes from its cache. Everything reads and writes
//! through [`boxery_store::ObjectStore`].
//!
//! See `docs/controller.md` for the picture and the guarantees.

pub mod action;
pub mod backoff;
pub mod controller;
pub mod events;
pub mod finalizer;
pub mod leader;
pub mod manager;
pub mod reflector;
pub mod runner;
pub mod scheduler;
pub mod write_through;

pub use action::{Action, ReconcileError};
pub use backoff::Backoff;
pub use controller::{Controller, Mapper, SharedWatch, Trigger, default_error_policy, error_chain};
pub use events::Recorder;
pub use finalizer::{FinalizerEvent, ensure_finalizer, finalizer, remove_finalizer};
pub use leader::{Leader, LeaderElector};
pub use manager::Manager;
pub use reflector::{Cache, Change};
pub use tokio_util::sync::CancellationToken;
pub use write_through::WriteThrough;
