//! The `Resource` trait every kind implements, `KindInfo` (what is known about a kind), and
//! `DynObject`, the untyped form the store keeps.

use schemars::{JsonSchema, Schema};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};

use crate::columns::Column;
use crate::conditions;
use crate::meta::{ConditionStatus, ObjectMeta};
use crate::validate::{FieldError, ValidationError};

/// The API group and version of every boxery object.
pub const API_VERSION: &str = "boxery.dev/v1alpha1";

/// Everything boxery knows about a kind, in one place: each kind's file defines its
/// `KindInfo` (as `Resource::INFO`) and the registry in `lib.rs` lists it once; the store,
/// the verbs, the front ends and the API read it from [`KINDS`](crate::KINDS).
#[derive(Debug, Clone, Copy)]
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
    /// The columns of `boxery get` and of the API's Table output, in order
    /// ([`columns::DEFAULT`](crate::columns::DEFAULT): NAME and AGE).
    pub columns: &'static [Column],
    /// What `apply --wait` waits for on an object of this kind, in turn (none: it is not
    /// waited for).
    pub settled: fn(&DynObject) -> &'static [Settled],
    /// What `delete --force` must see gone outside the store before it drops the object's
    /// finalizers.
    pub force_delete: ForceDelete,
    /// The fields fixed once the object exists, as JSON pointers (`/spec/source`): an update
    /// that changes one (sets, unsets or alters it) is refused, saying so.
    pub immutable: &'static [&'static str],
    /// The functions of its Rust type: `Typed::of::<ITS TYPE>()`.
    pub typed: Typed,
}

/// Kinds are the same kind when they have the same name.
impl PartialEq for KindInfo {
    fn eq(&self, other: &KindInfo) -> bool {
        self.kind == other.kind
    }
}

impl Eq for KindInfo {}

/// A condition `apply --wait` waits for (the verbs' `Until`, as a kind states it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// A condition of this type has this status, computed for the object's generation.
    Condition(&'static str, ConditionStatus),
    /// `status.phase` is this.
    Phase(&'static str),
    /// Its controller has seen the object's generation (`status.observedGeneration`).
    Observed,
}

/// The `settled` of a kind that `apply --wait` does not wait for.
pub const NOT_AWAITED: fn(&DynObject) -> &'static [Settled] = |_| &[];

/// `Ready=True`: what most kinds settle at.
pub const READY: Settled = Settled::Condition(conditions::READY, ConditionStatus::True);

/// What `delete --force` undoes outside the store before dropping an object's finalizers
/// (its controller's cleanup, when the controller cannot run it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForceDelete {
    /// Nothing: the finalizers are dropped.
    Finalizers,
    /// The backend's VM of the same name (only one made for this object), after the VM's
    /// grants and token are revoked; dropped only once the backend confirms it is gone.
    BackendVm,
    /// The backend's image of the same name; dropped only once the backend confirms it is
    /// gone.
    BackendImage,
    /// Its entries in the grant state (the grant is revoked first).
    GrantState,
}

/// The functions of a kind's Rust type, for code that has only its name.
#[derive(Debug, Clone, Copy)]
pub struct Typed {
    /// Its JSON Schema, generated from the type.
    pub schema: fn() -> Schema,
    /// Read an object of this kind (that passed its schema), check its name, labels,
    /// annotations and what [`Resource::normalize`] checks, and write its defaults;
    /// `label` names it in errors.
    pub normalize: fn(Value, &str) -> Result<DynObject, ValidationError>,
    /// The fields it sets that nothing implements yet ([`Resource::unimplemented`]).
    pub unimplemented: fn(&DynObject) -> Vec<FieldError>,
}

impl Typed {
    /// The functions of `R`.
    pub const fn of<R: Resource>() -> Typed {
        Typed {
            schema: schema_of::<R>,
            normalize: crate::validate::normalize_typed::<R>,
            unimplemented: unimplemented_of::<R>,
        }
    }
}

fn schema_of<R: Resource>() -> Schema {
    schemars::schema_for!(R)
}

fn unimplemented_of<R: Resource>(obj: &DynObject) -> Vec<FieldError> {
    obj.to_typed::<R>()
        .map(|o| o.unimplemented())
        .unwrap_or_default()
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
    /// The fields it sets that validate but that nothing acts on yet
    /// ([`crate::validate::unimplemented`]).
    fn unimplemented(&self) -> Vec<FieldError> {
        Vec::new()
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
    ($name:ident, $info:expr $(, normalize = $norm:path)? $(, unimplemented = $unimpl:path)?) => {
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
            $(fn unimplemented(&self) -> Vec<$crate::validate::FieldError> {
                $unimpl(self)
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::Value;

    use crate::KINDS;
    use crate::validate::{lookup_kind, schema_ref};

    /// Whether the JSON pointer `segments` leads somewhere in the schema `node` (of `root`):
    /// through `properties`, `items` (a number), `additionalProperties`, `$ref`s and any
    /// branch of `anyOf`/`oneOf`/`allOf`.
    fn leads(root: &Value, node: &Value, segments: &[&str]) -> bool {
        let node = match node.get("$ref").and_then(Value::as_str) {
            Some(r) => root
                .pointer(r.trim_start_matches('#'))
                .expect("a $ref resolves"),
            None => node,
        };
        let Some((first, rest)) = segments.split_first() else {
            return true;
        };
        let branches = ["anyOf", "oneOf", "allOf"]
            .iter()
            .filter_map(|k| node.get(k).and_then(Value::as_array))
            .flatten();
        node.get("properties")
            .and_then(|p| p.get(*first))
            .is_some_and(|p| leads(root, p, rest))
            || (first.parse::<usize>().is_ok()
                && node.get("items").is_some_and(|i| leads(root, i, rest)))
            || node
                .get("additionalProperties")
                .is_some_and(|a| a.is_object() && leads(root, a, rest))
            || branches.into_iter().any(|b| leads(root, b, segments))
    }

    /// The registry is complete: every kind has its schema (titled with its type), its names
    /// find it and no other kind, and every printer column reads fields its schema has.
    #[test]
    fn the_registry_is_complete() {
        let mut names = HashSet::new();
        for k in KINDS {
            let schema = schema_ref(k.kind).unwrap_or_else(|| panic!("{}: no schema", k.kind));
            assert_eq!(
                schema["title"], k.kind,
                "{}: the schema of another type",
                k.kind
            );
            for name in [k.kind.to_ascii_lowercase().as_str(), k.plural, k.singular]
                .into_iter()
                .chain(k.short_names.iter().copied())
            {
                // a kind may repeat its own name as a short name (`vm`), never another's
                if names.insert(name.to_string()) || lookup_kind(name) == Some(&k) {
                    assert_eq!(lookup_kind(name).map(|f| f.kind), Some(k.kind), "{name}");
                } else {
                    panic!("{}: `{name}` names another kind too", k.kind);
                }
            }
            assert!(!k.columns.is_empty(), "{}: no columns", k.kind);
            let mut headers = HashSet::new();
            for c in k.columns {
                assert!(headers.insert(c.name), "{}: two {} columns", k.kind, c.name);
                for path in c.cell.paths() {
                    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
                    assert!(
                        path.starts_with('/') && leads(schema, schema, &segments),
                        "{}: column {} reads {path}, which its schema does not have",
                        k.kind,
                        c.name
                    );
                }
            }
        }
    }
}
