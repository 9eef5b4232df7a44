//! `Lease`: one agent's expiring claim on a pool member. Types and schema only.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::{Condition, Time};
use crate::resource::{ForceDelete, KindInfo, Settled, Typed, impl_resource, resource};

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
        controllers_only: None,
        columns: &[
            columns::NAME,
            Column::new("POOL", Cell::Field("/spec/pool")),
            Column::new("HOLDER", Cell::Field("/spec/holderIdentity")),
            Column::new("STATUS", Cell::Field("/status/phase")),
            Column::new("VM", Cell::Field("/status/vm")),
            Column::new("EXPIRES", Cell::Field("/status/expireTime")),
            columns::AGE,
        ],
        settled: |_| &[Settled::Phase("Bound")],
        force_delete: ForceDelete::Finalizers,
        immutable: &[],
        typed: Typed::of::<Lease>(),
    },
    normalize = normalize_lease
);

/// Check what the schema cannot: names and the public key's form.
fn normalize_lease(lease: &mut Lease) -> Result<(), Vec<crate::validate::FieldError>> {
    let mut errs = Vec::new();
    if let Err(e) = crate::validate::check_label_name(&lease.spec.pool) {
        errs.push(crate::validate::FieldError::new("spec.pool", e));
    }
    if let Err(e) = crate::name::check_text(&lease.spec.holder_identity, 128) {
        errs.push(crate::validate::FieldError::new("spec.holderIdentity", e));
    }
    if let Err(e) = check_public_key(&lease.spec.public_key) {
        errs.push(crate::validate::FieldError::new("spec.publicKey", e));
    }
    if let Some(b) = &lease.spec.budget {
        errs.extend(crate::usage::Budget::check(b, "spec.budget"));
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// Whether `key` is one OpenSSH public key line (`ssh-ed25519 AAAA… [comment]`).
pub fn check_public_key(key: &str) -> Result<(), String> {
    let bad = || {
        "not an ssh public key: give one line like `ssh-ed25519 AAAA… comment` (the private key never enters the store)".to_string()
    };
    if key.chars().any(char::is_control) || key.len() > 16 * 1024 {
        return Err(bad());
    }
    let mut parts = key.split_whitespace();
    let (Some(kind), Some(data)) = (parts.next(), parts.next()) else {
        return Err(bad());
    };
    let known = [
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
    ];
    let b64 = data.len() >= 16
        && data
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=');
    if !known.contains(&kind) || !b64 {
        return Err(bad());
    }
    Ok(())
}

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
    /// What the lease may use over its life (vCPU-hours, LLM tokens); its pool's
    /// `spec.lease.budget` when unset. Past it, its VM is suspended (docs/pools.md, "Budgets").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::usage::LeaseBudget>,
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
    /// Ended because its VM is gone (deleted, with `--force`, or with its pool): the lease
    /// holds nothing. Release it and acquire a new one.
    Lost,
}

impl LeasePhase {
    /// Whether the lease has ended (it holds no member and cannot be renewed).
    pub fn ended(self) -> bool {
        matches!(
            self,
            LeasePhase::Expired | LeasePhase::Released | LeasePhase::Lost
        )
    }
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
    /// The member's generation when this lease claimed it (the fence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member_generation: Option<u64>,
    /// The pool's epoch when this lease claimed it (the fence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_epoch: Option<u64>,
    /// The host's boot id when bound: after a reboot every lease is void.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The last renewal served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewed: Option<Time>,
    /// What its VM used while it held it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::Usage>,
    /// Observations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
