//! `Event`: something that happened to an object, shown by `describe` and `events`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::columns::{self, Cell, Column};
use crate::meta::{ObjectMeta, Time};
use crate::resource::{ForceDelete, KindInfo, NOT_AWAITED, Resource, Typed};

/// Something that happened to an object. Repeats of the same reason and message on the same
/// object bump `count` instead of adding a new Event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Event {
    /// Always `boxery.dev/v1alpha1`.
    pub api_version: String,
    /// `Event`.
    pub kind: String,
    /// Name (`<object>.<hash>`) and bookkeeping.
    pub metadata: ObjectMeta,
    /// What it is about.
    pub involved_object: InvolvedObject,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: EventType,
    /// One CamelCase word.
    pub reason: String,
    /// A sentence for a person.
    pub message: String,
    /// How many times it happened.
    #[serde(default = "one")]
    pub count: u32,
    /// When it first happened.
    pub first_timestamp: Time,
    /// When it last happened.
    pub last_timestamp: Time,
    /// Which controller reported it.
    #[serde(default)]
    pub reporting_controller: String,
}

fn one() -> u32 {
    1
}

/// The object an event is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InvolvedObject {
    /// Its kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Event severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum EventType {
    /// Routine.
    Normal,
    /// Something a person may need to act on.
    Warning,
}

impl Resource for Event {
    const INFO: KindInfo = KindInfo {
        kind: "Event",
        plural: "events",
        singular: "event",
        short_names: &["ev"],
        dotted_names: true,
        description: "Something that happened to an object (shown by `describe` and `events`).",
        controllers_only: Some("apply Vm, Image, Pool, Lease or Grant objects"),
        columns: &[
            Column::new("LAST SEEN", Cell::Age("/lastTimestamp")),
            Column::new("TYPE", Cell::Field("/type")),
            Column::new("REASON", Cell::Field("/reason")),
            Column::new(
                "OBJECT",
                Cell::Computed(&["/involvedObject/kind", "/involvedObject/name"], |v| {
                    let kind = columns::text(v[0]).to_lowercase();
                    format!("{kind}/{}", columns::text(v[1]))
                }),
            ),
            Column::new("COUNT", Cell::Field("/count")),
            Column::new("MESSAGE", Cell::Field("/message")),
        ],
        settled: NOT_AWAITED,
        force_delete: ForceDelete::Finalizers,
        immutable: &[],
        typed: Typed::of::<Event>(),
    };
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
