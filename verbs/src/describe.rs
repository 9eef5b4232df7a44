//! `describe`: one object in detail — its metadata, spec, what its controller observed, its
//! conditions, its events and (a Pool) its members — read once, for every front end to render:
//! the CLI's `boxery describe` as kubectl-style text, the `vm_describe` tool as YAML and data.
//! Every value comes from the store, which agents write: a front end makes each one safe
//! before it reaches a terminal ([`crate::render::safe`]).

use boxery_api::pool::MemberStatus;
use boxery_api::{DynObject, KindInfo, Pool, Resource};
use serde_json::{Map, Value};

use crate::{Result, VerbError, Verbs, objects, pools};

/// One object in detail, in the order it is shown.
#[derive(Debug, Clone)]
pub struct Description {
    /// The object as stored.
    pub object: DynObject,
    /// Its pool members, with who leases them (a Pool only).
    pub members: Option<Vec<MemberStatus>>,
    /// The events about it, oldest first.
    pub events: Vec<DynObject>,
}

impl Description {
    /// Its spec, when it has one.
    pub fn spec(&self) -> Option<&Value> {
        self.object.rest.get("spec")
    }

    /// Its status without its conditions and printable status (shown on their own), when
    /// there is anything else in it.
    pub fn observed(&self) -> Option<Value> {
        let mut rest: Map<String, Value> = self.object.status().as_object()?.clone();
        for k in ["conditions", "printableStatus"] {
            rest.remove(k);
        }
        (!rest.is_empty()).then_some(Value::Object(rest))
    }

    /// Its conditions, when its status has a list of them.
    pub fn conditions(&self) -> Option<&Vec<Value>> {
        self.object.status()["conditions"].as_array()
    }
}

/// Describe object `name` of kind `info`.
pub async fn describe(v: &Verbs, info: &'static KindInfo, name: &str) -> Result<Description> {
    let object = objects::get_one(v, info, name).await?;
    let members = if object.kind == Pool::INFO.kind {
        let pool: Pool = object.to_typed().map_err(VerbError::from)?;
        Some(pools::members(v, &pool).await?)
    } else {
        None
    };
    let events = objects::events(v, Some((&object.kind, name))).await?;
    Ok(Description {
        object,
        members,
        events,
    })
}
