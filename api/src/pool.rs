//! `Pool`: a set of VMs that agents lease, and `PoolMember`: one member's record (its state
//! and the fence a lease holds on it). Types and schema only; the reconcilers are
//! `boxery_reconcilers::pool` and `boxery_reconcilers::lease`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::ConditionStatus;
use crate::meta::{Condition, LocalObjectReference};
use crate::resource::{
    ForceDelete, KindInfo, NOT_AWAITED, READY, Settled, Typed, impl_resource, resource,
};
use crate::vm::VmSpec;

/// The label on every member's Vm: its pool's name.
pub const POOL_LABEL: &str = "boxery.dev/pool";

resource!(
    /// A pool of VMs that agents lease.
    Pool, PoolSpec, PoolStatus
);
impl_resource!(
    Pool,
    KindInfo {
        kind: "Pool",
        plural: "pools",
        singular: "pool",
        short_names: &["pool"],
        dotted_names: false,
        description: "A pool of VMs (made from a template and/or adopted) that agents lease one at a time.",
        controllers_only: None,
        columns: &[
            columns::NAME,
            Column::new("REPLICAS", Cell::Field("/spec/replicas")),
            Column::new("READY", Cell::Field("/status/ready")),
            Column::new("UP-TO-DATE", Cell::Field("/status/updated")),
            Column::new("FREE", Cell::Field("/status/free")),
            Column::new("LEASED", Cell::Field("/status/leased")),
            Column::new("BROKEN", Cell::Field("/status/broken")),
            columns::AGE,
        ],
        settled: |_| {
            &[
                READY,
                Settled::Condition(crate::conditions::PROGRESSING, ConditionStatus::False),
            ]
        },
        force_delete: ForceDelete::Finalizers,
        immutable: &[],
        typed: Typed::of::<Pool>(),
    },
    normalize = normalize_pool,
    unimplemented = unimplemented
);

/// Check what the schema cannot: member names, and the template as a Vm spec (its defaults
/// written, so every member is made from the same spec).
fn normalize_pool(pool: &mut Pool) -> Result<(), Vec<crate::validate::FieldError>> {
    use crate::resource::Resource;
    let mut errs = Vec::new();
    for (i, m) in pool.spec.members.iter().enumerate() {
        if let Err(e) = crate::name::check_label_name(&m.name) {
            errs.push(crate::validate::FieldError::new(
                format!("spec.members[{i}].name"),
                e,
            ));
        }
    }
    if let Some(b) = &pool.spec.budget {
        errs.extend(crate::usage::Budget::check(b, "spec.budget"));
    }
    if let Some(b) = &pool.spec.lease.budget {
        errs.extend(crate::usage::Budget::check(b, "spec.lease.budget"));
    }
    if let Some(t) = pool.spec.template.as_mut() {
        let mut vm = crate::Vm::new("template", t.spec.clone());
        match vm.normalize() {
            Ok(()) => t.spec = vm.spec,
            Err(es) => errs.extend(es.into_iter().map(|e| {
                crate::validate::FieldError::new(format!("spec.template.{}", e.path), e.message)
            })),
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// The desired state of a pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    /// The VM every created member is made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<VmTemplate>,
    /// How many members to create from the template.
    #[serde(default)]
    #[schemars(range(max = 1000))]
    pub replicas: u32,
    /// Existing VMs adopted into the pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<LocalObjectReference>,
    /// Lease defaults.
    #[serde(default)]
    pub lease: LeaseDefaults,
    /// What a change to `template` does to members already made (`ReplaceWhenFree`, the
    /// default: free members are replaced, a few at a time; `OnCreate`: nothing).
    #[serde(default)]
    pub update_strategy: UpdateStrategy,
    /// With `ReplaceWhenFree`: at most this many members are being replaced at once (default
    /// max(1, replicas/4)), so the rest of the pool stays leasable during a template change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_unavailable: Option<u32>,
    /// What each member's clean state holds (`Disk`, the default: its disk, and a reset
    /// boots it; `Memory`: its disk and its memory, taken once it is Ready, and a lease's end
    /// resets it to that instant running, in seconds instead of a boot; needs a backend with
    /// memory snapshots: qemu). Members made before a change keep what they have until they
    /// are replaced.
    #[serde(default, skip_serializing_if = "CleanState::is_disk")]
    pub clean_state: CleanState,
    /// What all its leases together may use per UTC month (vCPU-hours, LLM tokens). Past it,
    /// every leased member is suspended until the month ends or the budget is raised
    /// (docs/pools.md, "Budgets").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::usage::PoolBudget>,
}

/// What a pool member's clean state holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum CleanState {
    /// Its disk: a reset replaces the disk and boots.
    #[default]
    Disk,
    /// Its disk and its memory: a reset comes back running from the clean instant.
    Memory,
}

impl CleanState {
    fn is_disk(&self) -> bool {
        *self == CleanState::Disk
    }
}

/// A template for member VMs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmTemplate {
    /// Labels given to every member.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// The members' spec.
    pub spec: VmSpec,
}

/// Lease defaults for a pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseDefaults {
    /// A lease's duration when it names none (60..28800). Not implemented yet: only the
    /// default, 1800, is accepted (a lease lasts its own `leaseDurationSeconds`).
    #[schemars(range(min = 60, max = 28800))]
    pub default_ttl_seconds: u32,
    /// The longest lease allowed (60..28800).
    #[schemars(range(min = 60, max = 28800))]
    pub max_ttl_seconds: u32,
    /// The budget of each lease: a lease's own `spec.budget` can lower it, never raise it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::usage::LeaseBudget>,
}

impl Default for LeaseDefaults {
    fn default() -> Self {
        LeaseDefaults {
            default_ttl_seconds: 1800,
            max_ttl_seconds: 28800,
            budget: None,
        }
    }
}

/// When template changes reach members made before them. Adopted members (`members`) are
/// never replaced: they were not made from the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum UpdateStrategy {
    /// A member made from an older template is replaced while it is free: it leaves the free
    /// set (`Replacing`), its VM and clean image are deleted, and it is made again from the
    /// current template, clean-imaged and freed. At most max(1, replicas/4) members are
    /// replaced at a time. A leased member is never touched: it is replaced when its lease
    /// ends (instead of being reset).
    #[default]
    ReplaceWhenFree,
    /// Never replace members: a template change reaches only members made after it.
    OnCreate,
}

/// The observed state of a pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolStatus {
    /// The generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Members in all.
    #[serde(default)]
    pub replicas: u32,
    /// Members ready.
    #[serde(default)]
    pub ready: u32,
    /// Members free to lease.
    #[serde(default)]
    pub free: u32,
    /// Members leased.
    #[serde(default)]
    pub leased: u32,
    /// Members being reset.
    #[serde(default)]
    pub resetting: u32,
    /// Members broken.
    #[serde(default)]
    pub broken: u32,
    /// Members made from the current template (adopted members are not counted).
    #[serde(default)]
    pub updated: u32,
    /// Members leaving the pool (scaled down, the pool deleted): their VMs are being deleted.
    #[serde(default)]
    pub removing: u32,
    /// Bumped whenever a member leaves (lease fencing).
    #[serde(default)]
    pub epoch: u64,
    /// What its leases used this UTC month.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::Usage>,
    /// Observations (`Ready`, `Progressing`, `Degraded`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The member table of pools stored before per-member records: moved into one
    /// `PoolMember` per member by the first reconcile of this version, then empty. Members
    /// are `PoolMember` objects now (`boxery get poolmembers -l boxery.dev/pool=NAME`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<MemberStatus>,
}

/// Where a pool member stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum MemberState {
    /// Being created, or its clean image being captured.
    #[default]
    Pending,
    /// Clean and free to lease.
    Free,
    /// Claimed by a lease; its key and token are being installed.
    Acquiring,
    /// Held by a lease.
    Leased,
    /// Being reset to its clean image after a lease ended.
    Resetting,
    /// Excluded from claims (a reset failed, or it is gone): remove and re-add it to repair.
    Broken,
    /// Made from an older template: being deleted and made again from the current one
    /// (`updateStrategy: ReplaceWhenFree`), then clean-imaged and freed.
    Replacing,
    /// Leaving the pool (scaled down, the pool or the VM deleted): a template member's VM and
    /// clean image are being deleted; an adopted member's VM is left, unlabelled.
    Removing,
}

/// Defines a struct of where a pool member stands, as a `PoolMember`'s status and a row of
/// the old member table both hold it: the first group of fields (its state), the lease fence
/// (`generation`, `lease`, `leaseUid`), the second group, then `template`, `resetRequestedAt`
/// and `message`.
macro_rules! member_state {
    (
        $(#[$attr:meta])*
        pub struct $name:ident { $($state:tt)* } then { $($own:tt)* }
    ) => {
        $(#[$attr])*
        pub struct $name {
            $($state)*
            /// Bumped on every state change: the fence a lease holds.
            #[serde(default)]
            pub generation: u64,
            /// The lease holding it (name).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub lease: Option<String>,
            /// The lease holding it (uid): a new lease with the same name is not the holder.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub lease_uid: Option<String>,
            $($own)*
            /// The template it was made from (a hash; template members only). Rows of the old
            /// member table written before boxery recorded it have none, which is taken as the
            /// template current when first seen.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub template: Option<String>,
            /// When its current reset was asked for (the Vm's `spec.restore.requestedAt`).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub reset_requested_at: Option<crate::meta::Time>,
            /// Why it is Broken, Pending or Removing.
            #[serde(default, skip_serializing_if = "String::is_empty")]
            pub message: String,
        }
    };
}

member_state! {
    /// One row of a pool's member table as stored before per-member records (`status.members`
    /// of an older Pool): read once, to make its `PoolMember`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct MemberStatus {
        /// The member Vm.
        pub name: String,
        /// Its state.
        pub state: MemberState,
    } then {
        /// Whether the pool made it from its template (else it was adopted).
        #[serde(default)]
        pub created: bool,
    }
}

/// The fields of a Pool spec that validate but that nothing acts on yet (its template's
/// included).
pub(crate) fn unimplemented(pool: &Pool) -> Vec<crate::validate::FieldError> {
    let mut errs = Vec::new();
    if let Some(t) = &pool.spec.template {
        errs.extend(crate::vm::unimplemented(&t.spec, "spec.template.spec."));
    }
    if let Some(e) = replicas_without_template(&pool.spec) {
        errs.push(e);
    }
    errs
}

/// `replicas` above 0 and no `template`: nothing could ever make those members (an adopted VM in
/// `members` is not one of them), so the pool would say `Ready` with none. Refused here, with
/// the unimplemented fields, so that a pool stored before this check can still have its status
/// written and be deleted (and scaled to 0), while no write makes one anew.
fn replicas_without_template(spec: &PoolSpec) -> Option<crate::validate::FieldError> {
    (spec.replicas > 0 && spec.template.is_none()).then(|| {
        crate::validate::FieldError::new(
            "spec.replicas",
            format!(
                "{} replicas are members made from spec.template, and this pool has no template: add spec.template (the VM each member is made from), or set replicas to 0 and name existing VMs in spec.members",
                spec.replicas
            ),
        )
    })
}

resource!(
    /// One member of a pool: where it stands and which lease holds it. One small object per
    /// member, so that a claim and a fence check read and write one member, never the pool.
    PoolMember, PoolMemberSpec, PoolMemberStatus
);
impl_resource!(
    PoolMember,
    KindInfo {
        kind: "PoolMember",
        plural: "poolmembers",
        singular: "poolmember",
        short_names: &["member", "pm"],
        dotted_names: false,
        description: "One member of a pool (named after its VM): its state and the lease holding it. Written by boxery's pool and lease controllers: read it, do not write it.",
        controllers_only: Some(
            "change the Pool (spec.replicas, spec.members) or its Leases; `boxery pool rm POOL VM` takes a VM out of its pool",
        ),
        columns: columns::DEFAULT,
        settled: NOT_AWAITED,
        force_delete: ForceDelete::Finalizers,
        immutable: &[],
        typed: Typed::of::<PoolMember>(),
    },
    normalize = normalize_member
);

fn normalize_member(m: &mut PoolMember) -> Result<(), Vec<crate::validate::FieldError>> {
    match crate::name::check_label_name(&m.spec.pool) {
        Ok(()) => Ok(()),
        Err(e) => Err(vec![crate::validate::FieldError::new("spec.pool", e)]),
    }
}

/// What a member is: the pool it belongs to and how it joined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolMemberSpec {
    /// The pool.
    pub pool: String,
    /// Whether the pool made its VM from its template (else the VM was adopted).
    #[serde(default)]
    pub created: bool,
}

member_state! {
    /// Where a member stands. Every change is one `update_status` of this object with a
    /// resourceVersion precondition: of a claim, a reset, a replacement and a removal racing
    /// on one member exactly one lands.
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct PoolMemberStatus {
        /// Its state.
        #[serde(default)]
        pub state: MemberState,
    } then {}
}

impl MemberStatus {
    /// This row as a member's status.
    pub fn record(&self) -> PoolMemberStatus {
        PoolMemberStatus {
            state: self.state,
            generation: self.generation,
            lease: self.lease.clone(),
            lease_uid: self.lease_uid.clone(),
            template: self.template.clone(),
            reset_requested_at: self.reset_requested_at,
            message: self.message.clone(),
        }
    }

    /// The row of a member record.
    pub fn of(m: &PoolMember) -> MemberStatus {
        let s = &m.status;
        MemberStatus {
            name: m.metadata.name.clone(),
            state: s.state,
            generation: s.generation,
            lease: s.lease.clone(),
            lease_uid: s.lease_uid.clone(),
            created: m.spec.created,
            template: s.template.clone(),
            reset_requested_at: s.reset_requested_at,
            message: s.message.clone(),
        }
    }
}
