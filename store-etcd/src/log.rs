//! One change as the log keeps it (`P/l/REV`): its type and the object.

use boxery_api::DynObject;
use boxery_store::WatchEvent;
use boxery_store::rules::EventType;

/// A log entry.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Entry {
    #[serde(rename = "type")]
    kind: String,
    object: DynObject,
}

impl Entry {
    pub(crate) fn new(ev: EventType, obj: &DynObject) -> Entry {
        Entry {
            kind: ev.as_str().to_string(),
            object: obj.clone(),
        }
    }

    /// The object's kind.
    pub(crate) fn object_kind(&self) -> &str {
        &self.object.kind
    }

    /// The change as a watcher sees it.
    pub(crate) fn event(self) -> boxery_store::Result<WatchEvent> {
        Ok(match self.kind.as_str() {
            "Added" => WatchEvent::Added(self.object),
            "Modified" => WatchEvent::Modified(self.object),
            "Deleted" => WatchEvent::Deleted(self.object),
            other => {
                return Err(crate::db_failure(format!(
                    "the store's log holds a change of unknown type {other:?}"
                )));
            }
        })
    }
}
