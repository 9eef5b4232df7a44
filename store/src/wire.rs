//! The [`ObjectStore`](crate::ObjectStore) calls as data: what a remote store sends to the
//! API server (`POST /boxery/v1/store`, `GET /boxery/v1/store/watch`) and gets back. Both
//! ends use these types, so the wire form has one definition; errors travel as [`WireError`]
//! and come back as the same [`StoreError`] variant (a database or file error of the server
//! arrives as `Unavailable`, with its message).

use boxery_api::error_chain;
use std::time::Duration;

use boxery_api::{DynObject, Selector};
use serde::{Deserialize, Serialize};

use crate::{
    ApplyAction, ApplyOptions, Candidate, DeleteOutcome, FieldConflict, Leadership, ObjectRef,
    ObjectStore, StoreError, WatchEvent,
};

/// The path of the calls.
pub const CALL_PATH: &str = "/boxery/v1/store";
/// The path of the watch stream (`?kind=Vm&from=N`; no `kind` for every kind).
pub const WATCH_PATH: &str = "/boxery/v1/store/watch";

/// The path of a VM's connect endpoint: an upgrade (`Upgrade: boxery-tcp`) to a raw byte
/// stream joined to the VM's sshd.
pub fn connect_path(vm: &str) -> String {
    format!("/boxery/v1/vms/{vm}/connect")
}

/// The route of [`connect_path`], as the server matches it.
pub const CONNECT_ROUTE: &str = "/boxery/v1/vms/{name}/connect";

/// The protocol named in a connect's upgrade.
pub const CONNECT_PROTOCOL: &str = "boxery-tcp";

/// The path of a VM's screen endpoint: an upgrade (`Upgrade: boxery-tcp`) to the VM's screen
/// as an RFB (VNC) byte stream, the server's own viewer of it (`boxery desktop` through a
/// context); view only unless `control`, the server filtering what the client sends.
pub fn screen_path(vm: &str, control: bool) -> String {
    format!("/boxery/v1/vms/{vm}/screen?control={control}")
}

/// The route of [`screen_path`], as the server matches it.
pub const SCREEN_ROUTE: &str = "/boxery/v1/vms/{name}/screen";

/// The path a full token has its ssh key put in a VM's `authorized_keys` at
/// ([`AuthorizeRequest`]).
pub fn authorize_path(vm: &str) -> String {
    format!("/boxery/v1/vms/{vm}/authorize")
}

/// The route of [`authorize_path`], as the server matches it.
pub const AUTHORIZE_ROUTE: &str = "/boxery/v1/vms/{name}/authorize";

/// The ask to log a key in to a VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizeRequest {
    /// One OpenSSH public key line.
    pub public_key: String,
}

/// A key logged in to a VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizeReply {
    /// The VM's uid (a VM made again under the name is another VM).
    pub uid: String,
    /// The line the VM's `authorized_keys` holds.
    pub line: String,
}

/// One store call.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
#[allow(missing_docs)] // each variant is the ObjectStore method of the same name
pub enum Call {
    Uid,
    Get {
        kind: String,
        name: String,
    },
    List {
        kind: String,
        selector: Selector,
    },
    ListNamedPrefix {
        kind: String,
        prefix: String,
    },
    CreateBy {
        obj: DynObject,
        manager: String,
    },
    Adopt {
        obj: DynObject,
        uid: String,
    },
    UpdateBy {
        obj: DynObject,
        manager: String,
    },
    UpdateDryRunBy {
        obj: DynObject,
        manager: String,
    },
    UpdateStatus {
        obj: DynObject,
    },
    Delete {
        kind: String,
        name: String,
    },
    ApplyAll {
        objs: Vec<DynObject>,
        opts: WireApplyOptions,
    },
    Revision,
    Compact {
        keep_revisions: u64,
    },
    Compacted,
    WasRemoved {
        uid: String,
    },
    TryLead {
        lock: String,
        me: WireCandidate,
        ttl_ms: u64,
    },
    Resign {
        lock: String,
        me: WireCandidate,
    },
    Leader {
        lock: String,
    },
}

impl Call {
    /// Whether the call only reads (what a read-only token may make).
    pub fn reads_only(&self) -> bool {
        matches!(
            self,
            Call::Uid
                | Call::Get { .. }
                | Call::List { .. }
                | Call::ListNamedPrefix { .. }
                | Call::Revision
                | Call::Compacted
                | Call::WasRemoved { .. }
                | Call::Leader { .. }
        )
    }

    /// The one object a call names, as (kind, name), when it names one (for the audit of a
    /// write: no copy of the object is made).
    pub fn target(&self) -> Option<(&str, &str)> {
        match self {
            Call::Get { kind, name } | Call::Delete { kind, name } => Some((kind, name)),
            Call::CreateBy { obj, .. }
            | Call::Adopt { obj, .. }
            | Call::UpdateBy { obj, .. }
            | Call::UpdateDryRunBy { obj, .. }
            | Call::UpdateStatus { obj } => Some((&obj.kind, &obj.metadata.name)),
            _ => None,
        }
    }

    /// The method's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Call::Uid => "uid",
            Call::Get { .. } => "get",
            Call::List { .. } => "list",
            Call::ListNamedPrefix { .. } => "list",
            Call::CreateBy { .. } => "create",
            Call::Adopt { .. } => "adopt",
            Call::UpdateBy { .. } => "update",
            Call::UpdateDryRunBy { .. } => "update (dry run)",
            Call::UpdateStatus { .. } => "update status",
            Call::Delete { .. } => "delete",
            Call::ApplyAll { .. } => "apply",
            Call::Revision => "revision",
            Call::Compact { .. } => "compact",
            Call::Compacted => "compacted",
            Call::WasRemoved { .. } => "was_removed",
            Call::TryLead { .. } => "try_lead",
            Call::Resign { .. } => "resign",
            Call::Leader { .. } => "leader",
        }
    }
}

/// [`ApplyOptions`] on the wire.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(missing_docs)] // the fields of ApplyOptions
pub struct WireApplyOptions {
    pub dry_run: bool,
    pub prune: Option<Selector>,
    pub prune_all_kinds: bool,
    pub field_manager: Option<String>,
    pub force_conflicts: bool,
}

impl From<&ApplyOptions> for WireApplyOptions {
    fn from(o: &ApplyOptions) -> Self {
        WireApplyOptions {
            dry_run: o.dry_run,
            prune: o.prune.clone(),
            prune_all_kinds: o.prune_all_kinds,
            field_manager: o.field_manager.clone(),
            force_conflicts: o.force_conflicts,
        }
    }
}

impl From<WireApplyOptions> for ApplyOptions {
    fn from(o: WireApplyOptions) -> Self {
        ApplyOptions {
            dry_run: o.dry_run,
            prune: o.prune,
            prune_all_kinds: o.prune_all_kinds,
            field_manager: o.field_manager,
            force_conflicts: o.force_conflicts,
        }
    }
}

/// [`Candidate`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(missing_docs)] // the fields of Candidate
pub struct WireCandidate {
    pub id: String,
    pub pid: u32,
    pub boot_id: String,
}

impl From<&Candidate> for WireCandidate {
    fn from(c: &Candidate) -> Self {
        WireCandidate {
            id: c.id.clone(),
            pid: c.pid,
            boot_id: c.boot_id.clone(),
        }
    }
}

impl From<WireCandidate> for Candidate {
    fn from(c: WireCandidate) -> Self {
        Candidate {
            id: c.id,
            pid: c.pid,
            boot_id: c.boot_id,
        }
    }
}

/// [`DeleteOutcome`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(missing_docs)]
pub enum WireDeleteOutcome {
    Marked(DynObject),
    Removed(DynObject),
}

impl From<DeleteOutcome> for WireDeleteOutcome {
    fn from(d: DeleteOutcome) -> Self {
        match d {
            DeleteOutcome::Marked(o) => WireDeleteOutcome::Marked(o),
            DeleteOutcome::Removed(o) => WireDeleteOutcome::Removed(o),
        }
    }
}

impl From<WireDeleteOutcome> for DeleteOutcome {
    fn from(d: WireDeleteOutcome) -> Self {
        match d {
            WireDeleteOutcome::Marked(o) => DeleteOutcome::Marked(o),
            WireDeleteOutcome::Removed(o) => DeleteOutcome::Removed(o),
        }
    }
}

/// [`ApplyAction`] on the wire.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum WireApplyAction {
    Created,
    Configured,
    Unchanged,
    Pruned,
}

impl From<ApplyAction> for WireApplyAction {
    fn from(a: ApplyAction) -> Self {
        match a {
            ApplyAction::Created => WireApplyAction::Created,
            ApplyAction::Configured => WireApplyAction::Configured,
            ApplyAction::Unchanged => WireApplyAction::Unchanged,
            ApplyAction::Pruned => WireApplyAction::Pruned,
        }
    }
}

impl From<WireApplyAction> for ApplyAction {
    fn from(a: WireApplyAction) -> Self {
        match a {
            WireApplyAction::Created => ApplyAction::Created,
            WireApplyAction::Configured => ApplyAction::Configured,
            WireApplyAction::Unchanged => ApplyAction::Unchanged,
            WireApplyAction::Pruned => ApplyAction::Pruned,
        }
    }
}

/// [`Leadership`] on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(missing_docs)]
pub enum WireLeadership {
    Leader { epoch: u64 },
    Follower { holder: String, expires_in_ms: u64 },
}

impl From<Leadership> for WireLeadership {
    fn from(l: Leadership) -> Self {
        match l {
            Leadership::Leader { epoch } => WireLeadership::Leader { epoch },
            Leadership::Follower { holder, expires_in } => WireLeadership::Follower {
                holder,
                expires_in_ms: expires_in.as_millis().min(u64::MAX as u128) as u64,
            },
        }
    }
}

impl From<WireLeadership> for Leadership {
    fn from(l: WireLeadership) -> Self {
        match l {
            WireLeadership::Leader { epoch } => Leadership::Leader { epoch },
            WireLeadership::Follower {
                holder,
                expires_in_ms,
            } => Leadership::Follower {
                holder,
                expires_in: Duration::from_millis(expires_in_ms),
            },
        }
    }
}

/// One line of the watch stream: an event at its revision, or the error that ends it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchLine {
    /// The revision of the change (absent on an error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rev: Option<u64>,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    pub ty: Option<String>,
    /// The object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<DynObject>,
    /// Why the stream ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<WireError>,
}

impl WatchLine {
    /// The line of one change.
    pub fn event(rev: u64, ev: WatchEvent) -> WatchLine {
        let (ty, o) = match ev {
            WatchEvent::Added(o) => ("ADDED", o),
            WatchEvent::Modified(o) => ("MODIFIED", o),
            WatchEvent::Deleted(o) => ("DELETED", o),
        };
        WatchLine {
            rev: Some(rev),
            ty: Some(ty.into()),
            object: Some(o),
            error: None,
        }
    }

    /// The line of the error that ends the stream.
    pub fn error(e: &StoreError) -> WatchLine {
        WatchLine {
            rev: None,
            ty: None,
            object: None,
            error: Some(WireError::from(e)),
        }
    }

    /// Back to what a watch stream yields.
    pub fn into_item(self) -> crate::Result<(u64, WatchEvent)> {
        if let Some(e) = self.error {
            return Err(e.into());
        }
        let bad = |why: &str| StoreError::Unavailable {
            why: format!("the server sent a watch line that is not one: {why}"),
        };
        let rev = self.rev.ok_or_else(|| bad("no revision"))?;
        let o = self.object.ok_or_else(|| bad("no object"))?;
        let ev = match self.ty.as_deref() {
            Some("ADDED") => WatchEvent::Added(o),
            Some("MODIFIED") => WatchEvent::Modified(o),
            Some("DELETED") => WatchEvent::Deleted(o),
            _ => return Err(bad("unknown type")),
        };
        Ok((rev, ev))
    }
}

/// A [`StoreError`] on the wire: the variants a caller acts on keep their fields; the
/// server's own failures (database, files) arrive as `Unavailable` with their message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "camelCase")]
#[allow(missing_docs)] // the fields of the StoreError variant of the same name
pub enum WireError {
    NotFound {
        kind: String,
        name: String,
        plural: String,
    },
    AlreadyExists {
        kind: String,
        name: String,
    },
    Conflict {
        kind: String,
        name: String,
        expected: String,
        actual: String,
    },
    Invalid(boxery_api::ValidationError),
    BeingDeleted {
        kind: String,
        name: String,
    },
    OwnerGone {
        kind: String,
        name: String,
        owner: String,
        uid: String,
    },
    FieldConflicts {
        object: String,
        applier: String,
        conflicts: Vec<FieldConflict>,
    },
    TooOld {
        requested: u64,
        floor: u64,
    },
    Unavailable {
        why: String,
    },
    Forbidden {
        why: String,
    },
}

impl From<&StoreError> for WireError {
    fn from(e: &StoreError) -> Self {
        match e.clone_known() {
            Some(w) => w,
            None => WireError::Unavailable {
                why: error_chain(e),
            },
        }
    }
}

impl StoreError {
    /// The wire form of the variants callers act on; `None` for the server's own failures.
    fn clone_known(&self) -> Option<WireError> {
        Some(match self {
            StoreError::NotFound { kind, name, plural } => WireError::NotFound {
                kind: kind.clone(),
                name: name.clone(),
                plural: plural.clone(),
            },
            StoreError::AlreadyExists { kind, name } => WireError::AlreadyExists {
                kind: kind.clone(),
                name: name.clone(),
            },
            StoreError::Conflict {
                kind,
                name,
                expected,
                actual,
            } => WireError::Conflict {
                kind: kind.clone(),
                name: name.clone(),
                expected: expected.clone(),
                actual: actual.clone(),
            },
            StoreError::Invalid(v) => WireError::Invalid(v.clone()),
            StoreError::BeingDeleted { kind, name } => WireError::BeingDeleted {
                kind: kind.clone(),
                name: name.clone(),
            },
            StoreError::OwnerGone {
                kind,
                name,
                owner,
                uid,
            } => WireError::OwnerGone {
                kind: kind.clone(),
                name: name.clone(),
                owner: owner.clone(),
                uid: uid.clone(),
            },
            StoreError::FieldConflicts {
                object,
                applier,
                conflicts,
            } => WireError::FieldConflicts {
                object: object.clone(),
                applier: applier.clone(),
                conflicts: conflicts.clone(),
            },
            StoreError::TooOld { requested, floor } => WireError::TooOld {
                requested: *requested,
                floor: *floor,
            },
            StoreError::Unavailable { why } => WireError::Unavailable { why: why.clone() },
            StoreError::Forbidden { why } => WireError::Forbidden { why: why.clone() },
            _ => return None,
        })
    }
}

impl From<WireError> for StoreError {
    fn from(w: WireError) -> Self {
        match w {
            WireError::NotFound { kind, name, plural } => {
                StoreError::NotFound { kind, name, plural }
            }
            WireError::AlreadyExists { kind, name } => StoreError::AlreadyExists { kind, name },
            WireError::Conflict {
                kind,
                name,
                expected,
                actual,
            } => StoreError::Conflict {
                kind,
                name,
                expected,
                actual,
            },
            WireError::Invalid(v) => StoreError::Invalid(v),
            WireError::BeingDeleted { kind, name } => StoreError::BeingDeleted { kind, name },
            WireError::OwnerGone {
                kind,
                name,
                owner,
                uid,
            } => StoreError::OwnerGone {
                kind,
                name,
                owner,
                uid,
            },
            WireError::FieldConflicts {
                object,
                applier,
                conflicts,
            } => StoreError::FieldConflicts {
                object,
                applier,
                conflicts,
            },
            WireError::TooOld { requested, floor } => StoreError::TooOld { requested, floor },
            WireError::Unavailable { why } => StoreError::Unavailable { why },
            WireError::Forbidden { why } => StoreError::Forbidden { why },
        }
    }
}

/// Make `call` on `store`: its result as JSON (what [`Call`]'s sender reads back).
pub async fn dispatch(store: &dyn ObjectStore, call: Call) -> crate::Result<serde_json::Value> {
    use serde_json::to_value as v;
    Ok(match call {
        Call::Uid => v(store.uid())?,
        Call::Get { kind, name } => v(store.get(&ObjectRef::new(kind, name)).await?)?,
        Call::List { kind, selector } => v(store.list(&kind, &selector).await?)?,
        Call::ListNamedPrefix { kind, prefix } => {
            v(store.list_named_prefix(&kind, &prefix).await?)?
        }
        Call::CreateBy { obj, manager } => v(store.create_by(obj, &manager).await?)?,
        Call::Adopt { obj, uid } => v(store.adopt(obj, &uid).await?)?,
        Call::UpdateBy { obj, manager } => v(store.update_by(obj, &manager).await?)?,
        Call::UpdateDryRunBy { obj, manager } => v(store.update_dry_run_by(obj, &manager).await?)?,
        Call::UpdateStatus { obj } => v(store.update_status(obj).await?)?,
        Call::Delete { kind, name } => v(WireDeleteOutcome::from(
            store.delete(&ObjectRef::new(kind, name)).await?,
        ))?,
        Call::ApplyAll { objs, opts } => {
            let done = store.apply_all(objs, &opts.into()).await?;
            let done: Vec<(WireApplyAction, DynObject)> =
                done.into_iter().map(|(a, o)| (a.into(), o)).collect();
            v(done)?
        }
        Call::Revision => v(store.revision().await?)?,
        Call::Compact { keep_revisions } => v(store.compact(keep_revisions).await?)?,
        Call::Compacted => v(store.compacted().await?)?,
        Call::WasRemoved { uid } => v(store.was_removed(&uid).await?)?,
        Call::TryLead { lock, me, ttl_ms } => v(WireLeadership::from(
            store
                .try_lead(&lock, &me.into(), Duration::from_millis(ttl_ms))
                .await?,
        ))?,
        Call::Resign { lock, me } => v(store.resign(&lock, &me.into()).await?)?,
        Call::Leader { lock } => v(store.leader(&lock).await?)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_callers_act_on_come_back_as_the_same_variant() {
        let e = StoreError::TooOld {
            requested: 3,
            floor: 9,
        };
        let w: WireError =
            serde_json::from_str(&serde_json::to_string(&WireError::from(&e)).expect("serializes"))
                .expect("parses");
        assert!(matches!(
            StoreError::from(w),
            StoreError::TooOld {
                requested: 3,
                floor: 9
            }
        ));
        let db = StoreError::from(rusqlite::Error::InvalidQuery);
        match StoreError::from(WireError::from(&db)) {
            StoreError::Unavailable { why } => assert!(why.contains("database"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_call_names_its_op() {
        let c = Call::Get {
            kind: "Vm".into(),
            name: "a".into(),
        };
        let text = serde_json::to_string(&c).expect("serializes");
        assert_eq!(text, r#"{"op":"get","kind":"Vm","name":"a"}"#);
        assert!(c.reads_only());
        assert!(!Call::Compact { keep_revisions: 1 }.reads_only());
        assert_eq!(c.target(), Some(("Vm", "a")));
        assert_eq!(Call::Compact { keep_revisions: 1 }.target(), None);
    }
}
