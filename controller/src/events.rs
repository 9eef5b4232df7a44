//! The event recorder: writes `Event` objects about other objects, shown by `describe`.
//!
//! # Guarantees
//! - One Event per (object, type, reason, message): its name is
//!   `<object-name>.<16 hex digits of a hash of kind, type, reason and message>`, so a repeat
//!   bumps `count` and `lastTimestamp` of the same Event instead of adding one.
//! - At most [`MAX_EVENTS_PER_OBJECT`] Events per object: recording a new one deletes the
//!   oldest (by `lastTimestamp`) beyond that.
//! - Events carry an ownerReference to their object (when its uid is known), so the store's
//!   cascade removes them with it, and the labels [`INVOLVED_KIND`] and [`INVOLVED_NAME`], so
//!   they can be listed per object.
//! - [`Recorder::normal`] and [`Recorder::warning`] never fail: a recording failure is
//!   logged and forgotten. [`Recorder::record`] returns it for those who care.
//!
//! # Assumptions
//! - Events are a diagnostic, not a source of truth: losing one (a crash, a conflict lost
//!   three times in a row) is acceptable.
//!
//! # Caveats
//! - The name hash is FNV-1a, fixed here, so names stay the same across builds and restarts.
//! - Two recorders racing on one Event retry on `Conflict` a few times; past that the bump is
//!   dropped (and logged).

use boxery_api::{
    API_VERSION, DynObject, Event, EventType, InvolvedObject, ObjectMeta, OwnerReference, Resource,
};
use std::sync::Arc;

use boxery_store::{ObjectRef, ObjectStore, StoreError};

/// How many Events one object keeps.
pub const MAX_EVENTS_PER_OBJECT: usize = 20;
/// Label on every Event: the kind of the object it is about.
pub const INVOLVED_KIND: &str = "boxery.dev/involved-kind";
/// Label on every Event: the name of the object it is about.
pub const INVOLVED_NAME: &str = "boxery.dev/involved-name";

const ATTEMPTS: usize = 3;

/// Recording an event failed.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// Reading the existing Event failed.
    #[error("cannot read event {name}")]
    Read {
        /// The Event's name.
        name: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// Writing the Event failed.
    #[error("cannot write event {name}")]
    Write {
        /// The Event's name.
        name: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// A stored Event did not read as one, or a new one did not encode.
    #[error("event {name} does not convert between its stored and typed forms")]
    Convert {
        /// The Event's name.
        name: String,
        /// The conversion error.
        #[source]
        source: serde_json::Error,
    },
    /// Listing the object's Events (to drop old ones) failed.
    #[error("cannot list the events of {kind} {object}")]
    List {
        /// The involved object's kind.
        kind: String,
        /// The involved object's name.
        object: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
    /// Deleting an old Event failed.
    #[error("cannot delete old event {name}")]
    Prune {
        /// The Event's name.
        name: String,
        /// The store's error.
        #[source]
        source: Box<StoreError>,
    },
}

/// The object an event is about, from a typed object.
pub fn involved<R: Resource>(obj: &R) -> InvolvedObject {
    InvolvedObject {
        kind: R::INFO.kind.to_string(),
        name: obj.name().to_string(),
        uid: obj.meta().uid.clone(),
    }
}

/// The object an event is about, from an untyped object.
pub fn involved_dyn(obj: &DynObject) -> InvolvedObject {
    InvolvedObject {
        kind: obj.kind.clone(),
        name: obj.metadata.name.clone(),
        uid: obj.metadata.uid.clone(),
    }
}

/// FNV-1a of each part followed by a zero byte: fixed forever (names must not change between
/// builds).
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h = boxery_api::fnv::Fnv::default();
    for part in parts {
        h.part(part.as_bytes());
    }
    h.finish()
}

/// The name of the Event for this object, type, reason and message.
pub fn event_name(obj: &InvolvedObject, type_: EventType, reason: &str, message: &str) -> String {
    let type_ = match type_ {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    };
    let hash = fnv1a(&[&obj.kind, type_, reason, message]);
    format!("{}.{hash:016x}", event_name_prefix(&obj.name))
}

/// The part of an Event's name before its hash: the object's name, cut to keep the whole
/// name within 253 characters and valid (no `-` or `.` before the dot).
fn event_name_prefix(name: &str) -> &str {
    if name.len() > 253 - 17 {
        name[..253 - 17].trim_end_matches(['-', '.'])
    } else {
        name
    }
}

/// Writes Events. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Recorder {
    store: Arc<dyn ObjectStore>,
    controller: String,
    max_per_object: usize,
}

impl Recorder {
    /// A recorder writing as `reporting_controller` (`vm-controller`).
    pub fn new(store: Arc<dyn ObjectStore>, reporting_controller: impl Into<String>) -> Self {
        Recorder {
            store,
            controller: reporting_controller.into(),
            max_per_object: MAX_EVENTS_PER_OBJECT,
        }
    }

    /// Keep at most `n` Events per object (at least 1) instead of [`MAX_EVENTS_PER_OBJECT`].
    pub fn with_limit(mut self, n: usize) -> Self {
        self.max_per_object = n.max(1);
        self
    }

    /// Record a routine event about `obj`; failures are logged.
    pub async fn normal<R: Resource>(&self, obj: &R, reason: &str, message: &str) {
        self.publish(&involved(obj), EventType::Normal, reason, message)
            .await;
    }

    /// Record an event a person may need to act on; failures are logged.
    pub async fn warning<R: Resource>(&self, obj: &R, reason: &str, message: &str) {
        self.publish(&involved(obj), EventType::Warning, reason, message)
            .await;
    }

    /// Record an event about any object; failures are logged.
    pub async fn publish(
        &self,
        obj: &InvolvedObject,
        type_: EventType,
        reason: &str,
        message: &str,
    ) {
        if let Err(e) = self.record(obj, type_, reason, message).await {
            tracing::warn!(
                kind = obj.kind,
                name = obj.name,
                reason,
                error = %crate::controller::error_chain(&e),
                "recording an event failed"
            );
        }
    }

    /// Record an event about any object: create it, or bump its count; then drop the oldest
    /// beyond the limit. Returns the Event as stored.
    pub async fn record(
        &self,
        obj: &InvolvedObject,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<Event, EventsError> {
        let name = event_name(obj, type_, reason, message);
        let mut last_conflict = None;
        for _ in 0..ATTEMPTS {
            let existing = self
                .store
                .get(&ObjectRef::of::<Event>(&name))
                .await
                .map_err(|source| EventsError::Read {
                    name: name.clone(),
                    source: Box::new(source),
                })?;
            let convert = |source| EventsError::Convert {
                name: name.clone(),
                source,
            };
            let result = match existing {
                Some(found) => {
                    let mut ev: Event = found.to_typed().map_err(convert)?;
                    ev.count = ev.count.saturating_add(1);
                    ev.last_timestamp = boxery_api::now();
                    self.store
                        .update(DynObject::from_typed(&ev).map_err(convert)?)
                        .await
                }
                None => {
                    let ev = self.new_event(obj, &name, type_, reason, message);
                    let created = self
                        .store
                        .create(DynObject::from_typed(&ev).map_err(convert)?)
                        .await;
                    if created.is_ok()
                        && let Err(e) = self.prune(obj).await
                    {
                        tracing::warn!(error = %crate::controller::error_chain(&e), "dropping old events failed");
                    }
                    created
                }
            };
            match result {
                Ok(stored) => return stored.to_typed().map_err(convert),
                // Someone else wrote or removed it meanwhile: read again.
                Err(
                    e @ (StoreError::Conflict { .. }
                    | StoreError::AlreadyExists { .. }
                    | StoreError::NotFound { .. }),
                ) => {
                    last_conflict = Some(e);
                }
                Err(source) => {
                    return Err(EventsError::Write {
                        name,
                        source: Box::new(source),
                    });
                }
            }
        }
        let source = last_conflict.unwrap_or_else(|| StoreError::AlreadyExists {
            kind: "Event".into(),
            name: name.clone(),
        });
        Err(EventsError::Write {
            name,
            source: Box::new(source),
        })
    }

    fn new_event(
        &self,
        obj: &InvolvedObject,
        name: &str,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Event {
        let now = boxery_api::now();
        let mut metadata = ObjectMeta::named(name);
        metadata
            .labels
            .insert(INVOLVED_KIND.into(), obj.kind.clone());
        metadata
            .labels
            .insert(INVOLVED_NAME.into(), obj.name.clone());
        if let Some(uid) = &obj.uid {
            metadata.owner_references.push(OwnerReference {
                api_version: API_VERSION.into(),
                kind: obj.kind.clone(),
                name: obj.name.clone(),
                uid: uid.clone(),
                controller: None,
            });
        }
        Event {
            api_version: API_VERSION.into(),
            kind: Event::INFO.kind.into(),
            metadata,
            involved_object: obj.clone(),
            type_,
            reason: reason.into(),
            message: message.into(),
            count: 1,
            first_timestamp: now,
            last_timestamp: now,
            reporting_controller: self.controller.clone(),
        }
    }

    /// The Events about `obj`, oldest first.
    pub async fn events_of(&self, obj: &InvolvedObject) -> Result<Vec<Event>, EventsError> {
        // An Event's name is its object's name (cut as in `event_name`), a dot and a hash: a
        // range of names, read at a cost that follows the object's own events, not every
        // Event in the store (each new Event prunes its object's old ones).
        let found = self
            .store
            .list_named_prefix(
                Event::INFO.kind,
                &format!("{}.", event_name_prefix(&obj.name)),
            )
            .await
            .map_err(|source| EventsError::List {
                kind: obj.kind.clone(),
                object: obj.name.clone(),
                source: Box::new(source),
            })?;
        let mut events: Vec<Event> = found
            .into_iter()
            .filter_map(|d| d.to_typed::<Event>().ok())
            .filter(|e| e.involved_object.kind == obj.kind && e.involved_object.name == obj.name)
            .collect();
        events.sort_by(|a, b| {
            (a.last_timestamp, &a.metadata.name).cmp(&(b.last_timestamp, &b.metadata.name))
        });
        Ok(events)
    }

    async fn prune(&self, obj: &InvolvedObject) -> Result<(), EventsError> {
        let events = self.events_of(obj).await?;
        let excess = events.len().saturating_sub(self.max_per_object);
        for ev in &events[..excess] {
            match self
                .store
                .delete(&ObjectRef::of::<Event>(&ev.metadata.name))
                .await
            {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(source) => {
                    return Err(EventsError::Prune {
                        name: ev.metadata.name.clone(),
                        source: Box::new(source),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable_and_valid() {
        let o = InvolvedObject {
            kind: "Vm".into(),
            name: "dev1".into(),
            uid: None,
        };
        let a = event_name(&o, EventType::Normal, "Started", "VM started");
        assert_eq!(
            a,
            event_name(&o, EventType::Normal, "Started", "VM started")
        );
        assert_ne!(
            a,
            event_name(&o, EventType::Warning, "Started", "VM started")
        );
        assert_ne!(
            a,
            event_name(&o, EventType::Normal, "Started", "VM started again")
        );
        assert!(a.starts_with("dev1.") && a.len() == 5 + 16, "{a}");
        boxery_api::validate::check_subdomain_name(&a).unwrap();
        assert_eq!(fnv1a(&[""]), 0xaf63bd4c8601b7df, "FNV-1a of one zero byte");
        let long = InvolvedObject {
            kind: "Image".into(),
            name: vec!["a".repeat(60); 4].join("."),
            uid: None,
        };
        let n = event_name(&long, EventType::Normal, "R", "m");
        assert!(n.len() <= 253);
        boxery_api::validate::check_subdomain_name(&n).unwrap();
    }
}
