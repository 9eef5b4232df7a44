//! boxery's API: the object kinds (`Vm`, `Image`, `Pool`, `PoolMember`, `Lease`, `Grant`,
//! `Source`, `Event`: [`KINDS`]), their Kubernetes-style metadata, JSON Schemas generated from
//! the Rust types, validation of every write, label selectors, printer columns, and the
//! YAML/JSON codec for manifests. No I/O lives here.

pub mod codec;
pub mod columns;
pub mod conditions;
pub mod config;
pub mod event;
pub mod fnv;
pub mod grant;
pub mod image;
pub mod lease;
pub mod meta;
pub mod name;
pub mod network;
pub mod pool;
pub mod quantity;
pub mod resource;
pub mod selector;
pub mod source;
pub mod usage;
pub mod validate;
pub mod vm;

/// `KINDS` from the kinds' types, in order.
macro_rules! registry {
    ($($kind:path),+ $(,)?) => {
        /// Every kind, in the order `boxery get` lists them: the registry of kinds. Each
        /// kind's file (`src/KIND.rs`) defines its type and its [`KindInfo`]
        /// (`Resource::INFO`); everything else reads the kind from here (docs/architecture.md,
        /// "Adding a kind").
        pub const KINDS: [KindInfo; [$(stringify!($kind)),+].len()] =
            [$(<$kind as Resource>::INFO),+];
    };
}

registry![
    vm::Vm,
    image::Image,
    pool::Pool,
    pool::PoolMember,
    lease::Lease,
    grant::Grant,
    source::Source,
    event::Event
];

pub use event::{Event, EventType, InvolvedObject};
pub use grant::Grant;
pub use image::{Image, ImagePhase, ImageSource};
pub use lease::Lease;
pub use meta::{
    Condition, ConditionStatus, Conditions, ManagedFieldsEntry, ManagedFieldsOperation, ObjectMeta,
    OwnerReference, Time, now,
};
pub use name::{InvalidName, Name};
pub use pool::{Pool, PoolMember};
pub use quantity::Quantity;
pub use resource::{API_VERSION, DynObject, ForceDelete, KindInfo, Resource, Settled, Typed};
pub use selector::Selector;
pub use source::{Source, SourcePhase, SourceSpec, SourceStatus, SourceType};
pub use validate::{ValidationError, lookup_kind, normalize};
pub use vm::{RunStrategy, Vm, VmPhase, VmSource};

/// An error and all its causes on one line, `outer: cause: root cause`: the one renderer of
/// error chains (errors keep their causes as `source()`, never in their message, so printing
/// only `Display` loses them).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
