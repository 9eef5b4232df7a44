//! The `Resource` trait every kind implements, the table of kinds, and `DynObject`, the
//! untyped form the store keeps.

use schemars::JsonSchema;
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};

use crate::meta::ObjectMeta;

/// The API group and version of every boxery object.
pub const API_VERSION: &str = "boxery.dev/v1alpha1";

/// What the store and the CLI know about a kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindInfo {
    /// `Vm`.
    pub kind: &'static str,
    /// `vms`.
    pub plural: &'static str,
    /// `vm`.
    pub singular: &'static str,
    /// Other names the CLI accepts (`img`).
    pub short_names: &'static [&'static str],
    /// Whether names may contain dots (DNS-1123 subdomain) rather than being DNS-1123 labels.
    pub dotted_names: bool,
    /// One line for `boxery explain` and `--help`.
    pub description: &'static str,
    /// `Some(what to write instead)` when only boxery's controllers write objects of this kind
    /// (`Event`, `PoolMember`): `apply` and `delete` refuse them, whoever asks, and say this.
    pub controllers_only: Option<&'static str>,
}

/// A typed object kind.
pub trait Resource:
    Serialize + DeserializeOwned + JsonSchema + Clone + Send + Sync + std::fmt::Debug + 'static
{
    /// The kind's facts.
    const INFO: KindInfo;
    /// The object's metadata.
    fn meta(&self) -> &ObjectMeta;
    /// The object's metadata, mutable.
    fn meta_mut(&mut self) -> &mut ObjectMeta;
    /// The object's name.
    fn name(&self) -> &str {
        &self.meta().name
    }
    /// Fill in defaults (written into the stored object) and check what a schema cannot say.
    /// Errors carry a field path.
    fn normalize(&mut self) -> Result<(), Vec<crate::validate::FieldError>> {
        Ok(())
    }
}

/// Defines a kind's struct with `apiVersion`, `kind`, `metadata`, `spec`, `status`.
macro_rules! resource {
    ($(#[$doc:meta])* $name:ident, $spec:ty, $status:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct $name {
            /// Always `boxery.dev/v1alpha1`.
            pub api_version: String,
            /// The kind's name.
            pub kind: String,
            /// Name, labels and the server's bookkeeping.
            pub metadata: $crate::meta::ObjectMeta,
            /// The desired state.
            pub spec: $spec,
            /// The observed state, written by boxery's controllers.
            #[serde(default)]
            pub status: $status,
        }

        impl $name {
            /// A new object with this name and spec, and an empty status.
            pub fn new(name: impl Into<String>, spec: $spec) -> Self {
                $name {
                    api_version: $crate::resource::API_VERSION.to_string(),
                    kind: stringify!($name).to_string(),
                    metadata: $crate::meta::ObjectMeta::named(name),
                    spec,
                    status: Default::default(),
                }
            }
        }
    };
}
pub(crate) use resource;

/// Implements `Resource` for a kind made with `resource!` (normalize given separately).
macro_rules! impl_resource {
    ($name:ident, $info:expr $(, normalize = $norm:path)?) => {
        impl $crate::resource::Resource for $name {
            const INFO: $crate::resource::KindInfo = $info;
            fn meta(&self) -> &$crate::meta::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut $crate::meta::ObjectMeta {
                &mut self.metadata
            }
            $(fn normalize(&mut self) -> Result<(), Vec<$crate::validate::FieldError>> {
                $norm(self)
            })?
        }
    };
}
pub(crate) use impl_resource;

/// An object of any kind, as the store keeps it: typed metadata, the rest as JSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DynObject {
    /// `boxery.dev/v1alpha1`.
    pub api_version: String,
    /// The kind.
    pub kind: String,
    /// Metadata.
    pub metadata: ObjectMeta,
    /// Everything else (`spec`, `status`, or an Event's fields).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl DynObject {
    /// The typed object.
    pub fn to_typed<R: Resource>(&self) -> Result<R, serde_json::Error> {
        serde_json::from_value(serde_json::to_value(self)?)
    }
    /// The untyped form of a typed object.
    pub fn from_typed<R: Resource>(obj: &R) -> Result<Self, serde_json::Error> {
        serde_json::from_value(serde_json::to_value(obj)?)
    }
    /// The `spec` (or `Value::Null`).
    pub fn spec(&self) -> &Value {
        self.rest.get("spec").unwrap_or(&Value::Null)
    }
    /// The `status` (or `Value::Null`).
    pub fn status(&self) -> &Value {
        self.rest.get("status").unwrap_or(&Value::Null)
    }
    /// `kind/name`, for messages.
    pub fn key(&self) -> String {
        format!("{}/{}", self.kind, self.metadata.name)
    }
}
