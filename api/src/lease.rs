//! `Lease`: one agent's expiring claim on a pool member. Types and schema only.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::meta::{Condition, Time};
use crate::resource::{KindInfo, impl_resource, resource};

resource!(
    /// An agent's expiring claim on one member of a pool (after coordination.k8s.io Lease).
    Lease, LeaseSpec, LeaseStatus
);
impl_resource!(
    Lease,
    KindInfo {
        kind: "Lease",
        plural: "leases",
        singular: "lease",
        short_names: &["lease"],
        dotted_names: false,
        description: "An expiring claim on one free member of a pool; deleting it releases the VM, which is then reset.",
    }
);

/// The desired state of a lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseSpec {
    /// The pool to lease from.
    pub pool: String,
    /// Who holds it (a caller-chosen label).
    pub holder_identity: String,
    /// How long the lease lasts after each renewal (60..28800).
    #[serde(default = "default_duration")]
    #[schemars(range(min = 60, max = 28800))]
    pub lease_duration_seconds: u32,
    /// When the holder last renewed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<Time>,
    /// The holder's ssh public key (the private key never enters the store).
    pub public_key: String,
}

fn default_duration() -> u32 {
    1800
}

/// A lease's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum LeasePhase {
    /// Waiting for a free member.
    #[default]
    Pending,
    /// Holding a member.
    Bound,
    /// Ran out without renewal.
    Expired,
    /// Released by its holder.
    Released,
}

/// The observed state of a lease.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseStatus {
    /// Phase.
    #[serde(default)]
    pub phase: LeasePhase,
    /// The generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The leased VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// When it was bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<Time>,
    /// When it expires unless renewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_time: Option<Time>,
    /// How many times the lease changed hands.
    #[serde(default)]
    pub lease_transitions: u32,
    /// Observations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
