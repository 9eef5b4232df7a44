//! The condition types and reasons boxery's controllers write, named once. Clients (the CLI,
//! MCP tools, `wait --for=condition=…`) match on these strings; they are part of the API.

/// Whether the object is usable: a Vm answers (over ssh where the backend runs sshd), an
/// Image can be used, a Pool has a free member, a Lease holds a member.
pub const READY: &str = "Ready";
/// A Vm the backend no longer has.
pub const LOST: &str = "Lost";
/// Whether a Vm not created yet has its source image.
pub const IMAGE_AVAILABLE: &str = "ImageAvailable";
/// `False` on every Vm while the backend does not answer.
pub const BACKEND_REACHABLE: &str = "BackendReachable";
/// A Vm's last revert (`spec.restore`).
pub const REVERTED: &str = "Reverted";
/// A Vm's last resize, when it was refused.
pub const RESIZED: &str = "Resized";
/// A Lease's renewal, when it was refused.
pub const RENEWED: &str = "Renewed";
/// A Pool with members still being made.
pub const PROGRESSING: &str = "Progressing";
/// A Pool with members whose VMs cannot join.
pub const MEMBERS_BLOCKED: &str = "MembersBlocked";
/// A Pool with broken members.
pub const DEGRADED: &str = "Degraded";
/// Whether a Vm has the layers of its `spec.layers` (`False` while a layer is being built or
/// added in place, or when one was removed from the list: a layer cannot be removed).
pub const LAYERS_APPLIED: &str = "LayersApplied";
/// Whether a suspended Vm's saved memory can be restored (`False`, reason `StaleMemory`,
/// when it no longer matches what can restore it; present only while suspended).
pub const MEMORY_RESTORABLE: &str = "MemoryRestorable";
/// Whether a Vm with a desktop (`headless: false`) has a display that answers: present only
/// while it is Ready (`True` reason `DisplayAnswers`, `False` reason `DisplayDown`).
pub const DISPLAY_READY: &str = "DisplayReady";
/// Whether a budget is used up (a Lease's or its Pool's, on the Lease, the Pool and the leased
/// Vm, which is then held suspended or stopped): `True` with reason `LeaseBudget` or
/// `PoolBudget` and what was used, `False` once it is not.
pub const BUDGET_EXHAUSTED: &str = "BudgetExhausted";

/// The reasons of a `Ready=False` that stays until someone changes the object: a wait for
/// `Ready` ends on one of them with its message, rather than when its timeout runs out.
pub const READY_WILL_NOT_COME: &[&str] = &[reasons::GUEST_NOT_ANSWERING];

/// Condition reasons.
pub mod reasons {
    /// `Ready=Unknown` on an object's first visit.
    pub const RECONCILING: &str = "Reconciling";
    /// A step failed and is retried after a backoff.
    pub const STEP_FAILED: &str = "StepFailed";
    /// A step failed in a way only a change of the object can fix (retried after 60 s).
    pub const INVALID_REQUEST: &str = "InvalidRequest";
    /// A Vm runs but does not answer yet.
    pub const BOOTING: &str = "Booting";
    /// Running, and its console says it will not answer (no cloud-init, no seed read, a
    /// kernel panic): a wait for Ready ends on it ([`READY_WILL_NOT_COME`]).
    pub const GUEST_NOT_ANSWERING: &str = "GuestNotAnswering";
    /// A Vm answers over ssh with its pinned key.
    pub const SSH_REACHABLE: &str = "SshReachable";
    /// A Vm runs (backends without sshd).
    pub const RUNNING: &str = "Running";
    /// A Vm is stopped as asked.
    pub const STOPPED: &str = "Stopped";
    /// A Vm is suspended as asked: its memory is on disk.
    pub const SUSPENDED: &str = "Suspended";
    /// A suspended Vm's saved memory can be restored.
    pub const MEMORY_SAVED: &str = "MemorySaved";
    /// A suspended Vm's saved memory no longer matches what can restore it.
    pub const STALE_MEMORY: &str = "StaleMemory";
    /// A Vm meant to run stopped on its own; it is started again.
    pub const EXITED: &str = "Exited";
    /// `Ready=False`: running, but a part the backend runs beside it is down (qemu: its
    /// network helper); being repaired.
    pub const DEGRADED: &str = "Degraded";
    /// The object is gone from the backend (`Ready`).
    pub const LOST: &str = "Lost";
    /// The object is gone from the backend (`Lost`).
    pub const NOT_IN_BACKEND: &str = "NotInBackend";
    /// The backend does not answer.
    pub const BACKEND_UNREACHABLE: &str = "BackendUnreachable";
    /// The backend has a VM of this name that was not made for this object.
    pub const NAME_TAKEN: &str = "NameTaken";
    /// A desktop's display `:0` answers (`DisplayReady`).
    pub const DISPLAY_ANSWERS: &str = "DisplayAnswers";
    /// A desktop's display does not answer; systemd starts it again (`DisplayReady`).
    pub const DISPLAY_DOWN: &str = "DisplayDown";
    /// A disk shrink was refused.
    pub const DISK_SHRINK_REFUSED: &str = "DiskShrinkRefused";
    /// The source image is ready.
    pub const IMAGE_READY: &str = "ImageReady";
    /// The image is not ready yet.
    pub const IMAGE_NOT_READY: &str = "ImageNotReady";
    /// The image does not exist (or is being deleted).
    pub const IMAGE_NOT_FOUND: &str = "ImageNotFound";
    /// Forks that fork from each other.
    pub const FORK_CYCLE: &str = "ForkCycle";
    /// A fork's or capture's source VM does not exist.
    pub const SOURCE_VM_NOT_FOUND: &str = "SourceVmNotFound";
    /// A capture's source VM is not created yet.
    pub const SOURCE_VM_NOT_READY: &str = "SourceVmNotReady";
    /// A Vm has every layer of its `spec.layers`.
    pub const LAYERS_APPLIED: &str = "LayersApplied";
    /// A layer is being added to a running Vm in place.
    pub const APPLYING_LAYERS: &str = "ApplyingLayers";
    /// The layered image a layer added in place is copied from is not ready yet.
    pub const LAYERED_IMAGE_NOT_READY: &str = "LayeredImageNotReady";
    /// `BudgetExhausted`: the lease's own budget (or its pool's `spec.lease.budget`).
    pub const LEASE_BUDGET: &str = "LeaseBudget";
    /// `BudgetExhausted`: the pool's monthly budget.
    pub const POOL_BUDGET: &str = "PoolBudget";
    /// `BudgetExhausted=False`: within its budgets.
    pub const WITHIN_BUDGET: &str = "WithinBudget";
    /// A layer was taken out of a Vm's `spec.layers`: it cannot be removed from the guest.
    pub const LAYER_REMOVAL_REFUSED: &str = "LayerRemovalRefused";
    /// A layer that cannot be added to a running VM (`docker`: packages and services) was put
    /// in its `spec.layers`: the VM must be made with it.
    pub const LAYER_NOT_IN_PLACE: &str = "LayerNotAddableInPlace";
    /// An image is being built (the message is the build's last progress line).
    pub const BUILDING: &str = "Building";
    /// An image is ready.
    pub const READY: &str = "Ready";
    /// A revert is done.
    pub const REVERTED: &str = "Reverted";
    /// An orphan was adopted (`boxery orphans adopt`).
    pub const ADOPTED: &str = "Adopted";
    /// A pool has free members.
    pub const MEMBERS_FREE: &str = "MembersFree";
    /// A pool has no free member.
    pub const NO_FREE_MEMBER: &str = "NoFreeMember";
    /// A pool has members being made.
    pub const MEMBERS_PENDING: &str = "MembersPending";
    /// A pool is replacing members made from an older template.
    pub const MEMBERS_REPLACING: &str = "MembersReplacing";
    /// A pool has members leaving (scaled down, or the pool being deleted).
    pub const MEMBERS_REMOVING: &str = "MembersRemoving";
    /// A pool has no member being made.
    pub const SETTLED: &str = "Settled";
    /// No member's VM is in the way.
    pub const NO_CONFLICT: &str = "NoConflict";
    /// A pool has broken members.
    pub const MEMBERS_BROKEN: &str = "MembersBroken";
    /// A pool has no broken member.
    pub const HEALTHY: &str = "Healthy";
    /// A lease holds a member.
    pub const BOUND: &str = "Bound";
    /// A lease's pool does not exist.
    pub const POOL_NOT_FOUND: &str = "PoolNotFound";
    /// A lease asks for more than its pool allows.
    pub const DURATION_TOO_LONG: &str = "DurationTooLong";
    /// A lease ran out.
    pub const LEASE_EXPIRED: &str = "LeaseExpired";
    /// A lease was released (deleted): its VM goes back to its pool.
    pub const RELEASED: &str = "Released";
    /// The host rebooted: every lease is void.
    pub const HOST_REBOOTED: &str = "HostRebooted";
    /// An expired lease cannot be renewed.
    pub const RENEW_REFUSED: &str = "RenewRefused";
    /// A lease's VM is gone (or its member left the pool): the lease ended (`Lost`).
    pub const VM_LOST: &str = "VmLost";
    /// A lease was ended because its VM or pool was deleted with `--force`.
    pub const FORCE_DELETED: &str = "ForceDeleted";
    /// A lease is waiting for a pool whose member table is being moved to `PoolMember`s.
    pub const POOL_UPGRADING: &str = "PoolUpgrading";
    /// A grant waits for a person's approval of its current generation.
    pub const PENDING_APPROVAL: &str = "PendingApproval";
    /// A grant is approved and in force.
    pub const APPLIED: &str = "Applied";
    /// A person refused a grant.
    pub const DENIED: &str = "Denied";
    /// A grant's VM was deleted (or replaced by another VM of its name).
    pub const VM_GONE: &str = "VmGone";
    /// A grant's VM does not exist (and never did while the grant was watching).
    pub const VM_NOT_FOUND: &str = "VmNotFound";
    /// A grant's lease ended or was deleted.
    pub const LEASE_ENDED: &str = "LeaseEnded";
    /// A VM's grant on a pool member: a member uses only its leases' grants.
    pub const POOL_MEMBER: &str = "PoolMember";
    /// A lease's grant waits for its lease to hold a VM.
    pub const LEASE_NOT_BOUND: &str = "LeaseNotBound";
    /// An approved grant whose value the control plane cannot read (variable unset, file
    /// unreadable, program missing): it is not applied until it can.
    pub const VALUE_UNAVAILABLE: &str = "ValueUnavailable";
}
