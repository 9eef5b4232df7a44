//! Kubernetes-style object metadata, owner references and conditions.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A point in time, RFC 3339 in UTC (`2026-11-30T10:00:00Z`).
pub type Time = DateTime<Utc>;

/// Now, truncated to milliseconds so that it round-trips through JSON unchanged.
pub fn now() -> Time {
    let t = Utc::now();
    let s = t.to_rfc3339_opts(SecondsFormat::Millis, true);
    DateTime::parse_from_rfc3339(&s)
        .map(|d| d.with_timezone(&Utc))
        .unwrap_or(t)
}

/// Metadata every object carries. The server sets `uid`, `resourceVersion`, `generation`,
/// `creationTimestamp` and `deletionTimestamp`; users set the rest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ObjectMeta {
    /// The object's name, unique within its kind. Vm, Pool, Lease and Grant names are DNS-1123
    /// labels (lowercase letters, digits and `-`, at most 63); Image and Event names may also
    /// contain dots.
    #[serde(default)]
    pub name: String,
    /// Set by the server when the object is created; never reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The store's revision at this object's last write (opaque to clients; compare for
    /// equality only). An update that carries one is refused if the object has moved on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    /// Bumped by the server on every change of `spec` (never of `status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// When the server created the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// Set when deletion was requested while finalizers remained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<Time>,
    /// Free-form labels, matched by label selectors (`-l team=web`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Free-form annotations; `boxery.dev/…` keys are the system's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Controllers that must finish cleaning up before the object is removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalizers: Vec<String>,
    /// Objects this one belongs to; deleting an owner deletes what it owns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_references: Vec<OwnerReference>,
    /// Which manager set which fields (`apply`, `sync`, `stop`, a tool, ...), as Kubernetes
    /// records them: kept by the store, never written by clients. `apply` removes only the
    /// fields its own manager set before and reports a conflict when it would change a field
    /// another manager set (docs/gitops.md, Field ownership).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub managed_fields: Vec<ManagedFieldsEntry>,
}

/// The fields one manager set, by one kind of operation (Kubernetes' `ManagedFieldsEntry`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ManagedFieldsEntry {
    /// Who set them: `boxery-apply`, `boxery-sync.SOURCE`, `boxery-stop`, `mcp-patch`, ...
    pub manager: String,
    /// `Apply` (a manifest applied: the fields it names) or `Update` (a change: the fields it
    /// changed).
    pub operation: ManagedFieldsOperation,
    /// The API version of the fields (`boxery.dev/v1alpha1`).
    #[serde(default)]
    pub api_version: String,
    /// When this entry last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Time>,
    /// `FieldsV1`.
    #[serde(default)]
    pub fields_type: String,
    /// The fields, as Kubernetes' FieldsV1 tree: `{"f:spec": {"f:runStrategy": {}}}`.
    #[serde(default)]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub fields_v1: serde_json::Value,
}

/// The operation of a [`ManagedFieldsEntry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ManagedFieldsOperation {
    /// A manifest applied (`boxery apply`, `boxery sync`).
    Apply,
    /// Any other write (`stop`, `patch`, a tool, a controller).
    Update,
}

impl ObjectMeta {
    /// Metadata with just a name.
    pub fn named(name: impl Into<String>) -> Self {
        ObjectMeta {
            name: name.into(),
            ..Default::default()
        }
    }

    /// The resourceVersion as a number (0 when unset or unparsable).
    pub fn rv(&self) -> u64 {
        self.resource_version
            .as_deref()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// Whether deletion has been requested.
    pub fn is_deleting(&self) -> bool {
        self.deletion_timestamp.is_some()
    }

    /// Whether `finalizer` is present.
    pub fn has_finalizer(&self, finalizer: &str) -> bool {
        self.finalizers.iter().any(|f| f == finalizer)
    }
}

/// The finalizers boxery's controllers set and remove: the only ones a manifest may carry
/// (any other would make its object undeletable, since nothing would ever remove it).
pub mod finalizers {
    /// A Vm's: its VM is removed from the backend.
    pub const VM: &str = "boxery.dev/vm";
    /// An Image's: its image is removed from the backend.
    pub const IMAGE: &str = "boxery.dev/image";
    /// A Lease's: its member is handed back to the pool and reset.
    pub const LEASE: &str = "boxery.dev/lease";
    /// A Pool's: its members leave first (leased ones when their lease ends).
    pub const POOL: &str = "boxery.dev/pool";
    /// A Grant's: it is revoked (its entry leaves the control plane's grant state) first.
    pub const GRANT: &str = "boxery.dev/grant";
    /// All of them.
    pub const ALL: [&str; 5] = [VM, IMAGE, LEASE, POOL, GRANT];
}

/// A reference from an owned object to its owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OwnerReference {
    /// `boxery.dev/v1alpha1`.
    pub api_version: String,
    /// The owner's kind.
    pub kind: String,
    /// The owner's name.
    pub name: String,
    /// The owner's uid: a new object with the same name is not the owner.
    pub uid: String,
    /// Whether the owner is the managing controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<bool>,
}

/// The status of a condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Not known yet.
    #[default]
    Unknown,
}

impl std::fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        })
    }
}

/// One observation about an object, as Kubernetes API conventions describe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Condition {
    /// What the condition is about (`Ready`, `ImageAvailable`, `Lost`, …).
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// One CamelCase word saying why.
    #[serde(default)]
    pub reason: String,
    /// A sentence for a person, saying what to do when something is wrong.
    #[serde(default)]
    pub message: String,
    /// When `status` last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// The object's generation this condition was computed for: a condition older than
    /// `metadata.generation` is stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Helpers on a list of conditions.
pub trait Conditions {
    /// The conditions.
    fn condition_list(&self) -> &[Condition];

    /// The conditions, to change.
    fn condition_list_mut(&mut self) -> &mut Vec<Condition>;

    /// The condition of that type.
    fn get_condition(&self, type_: &str) -> Option<&Condition> {
        self.condition_list().iter().find(|c| c.type_ == type_)
    }

    /// Set a condition; `lastTransitionTime` changes only when `status` does. Returns whether
    /// anything changed.
    fn set_condition(
        &mut self,
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        generation: Option<i64>,
    ) -> bool {
        let all = self.condition_list_mut();
        if let Some(c) = all.iter_mut().find(|c| c.type_ == type_) {
            let changed = c.status != status
                || c.reason != reason
                || c.message != message
                || c.observed_generation != generation;
            if c.status != status {
                c.last_transition_time = Some(now());
            }
            c.status = status;
            c.reason = reason.to_string();
            c.message = message.to_string();
            c.observed_generation = generation;
            changed
        } else {
            all.push(Condition {
                type_: type_.to_string(),
                status,
                reason: reason.to_string(),
                message: message.to_string(),
                last_transition_time: Some(now()),
                observed_generation: generation,
            });
            true
        }
    }

    /// Remove a condition; returns whether it was there.
    fn remove_condition(&mut self, type_: &str) -> bool {
        let all = self.condition_list_mut();
        let before = all.len();
        all.retain(|c| c.type_ != type_);
        before != all.len()
    }

    /// Whether the condition is `True` and was computed for `generation` (a stale one does
    /// not count).
    fn is_true_for(&self, type_: &str, generation: Option<i64>) -> bool {
        self.get_condition(type_).is_some_and(|c| {
            c.status == ConditionStatus::True
                && (generation.is_none() || c.observed_generation >= generation)
        })
    }
}

impl Conditions for Vec<Condition> {
    fn condition_list(&self) -> &[Condition] {
        self
    }

    fn condition_list_mut(&mut self) -> &mut Vec<Condition> {
        self
    }
}

/// A reference to another object by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalObjectReference {
    /// The object's name.
    pub name: String,
}
