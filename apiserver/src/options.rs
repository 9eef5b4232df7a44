//! A delete's options, read from wherever the Kubernetes API takes them: the query
//! (`dryRun`, `propagationPolicy`, `gracePeriodSeconds`, `orphanDependents`) and a
//! `DeleteOptions` body (those, and `preconditions`), which kubectl and the client libraries
//! send. Both are read: an option set in both must say the same thing (400 otherwise), a dry
//! run asked for in either is a dry run. An option or value boxery does not carry out is
//! refused with a 422 that says what is served, never ignored:
//!
//! - `dryRun`: `All` only (as Kubernetes).
//! - `propagationPolicy`: `Background` (kubectl's default) and `Foreground`. boxery's delete
//!   always cascades through its finalizers: an object stays, with its `deletionTimestamp`,
//!   until what it owns is gone (a Pool's members, a VM's disk), then leaves. That is
//!   Foreground's promise and Background's outcome. `Orphan` (and `orphanDependents: true`)
//!   is refused: nothing can be left behind.
//! - `gracePeriodSeconds`: `0` and `1` (`kubectl delete --force`, `--now`): boxery removes a
//!   VM without a graceful guest shutdown, so a longer grace would not be given.
//! - `preconditions`: `uid` and `resourceVersion`, checked against the object (409 Conflict
//!   when either differs).

use axum::body::Bytes;
use axum::http::StatusCode;
use boxery_api::DynObject;
use serde_json::{Map, Value};

use crate::query::Params;
use crate::status::Failure;

/// What a delete was asked to do, with both sources read and checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteOpts {
    /// Write nothing (`dryRun: [All]`).
    pub dry: bool,
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
}

/// The `DeleteOptions` fields the body may carry.
const FIELDS: [&str; 8] = [
    "kind",
    "apiVersion",
    "dryRun",
    "preconditions",
    "propagationPolicy",
    "gracePeriodSeconds",
    "orphanDependents",
    "ignoreStoreReadErrorWithClusterBreakingPotential",
];

fn invalid(message: impl Into<String>) -> Failure {
    Failure::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
}

/// One option as the query and the body give it: the same in both, or either alone.
fn one<T: PartialEq + std::fmt::Debug>(
    name: &str,
    query: Option<T>,
    body: Option<T>,
) -> Result<Option<T>, Failure> {
    match (query, body) {
        (Some(q), Some(b)) if q != b => Err(Failure::bad_request(format!(
            "{name} is {q:?} in the query and {b:?} in the DeleteOptions body: give it once"
        ))),
        (q, b) => Ok(b.or(q)),
    }
}

fn query_bool(name: &str, v: &Option<String>) -> Result<Option<bool>, Failure> {
    match v.as_deref() {
        None | Some("") => Ok(None),
        Some("true" | "1" | "True") => Ok(Some(true)),
        Some("false" | "0" | "False") => Ok(Some(false)),
        Some(o) => Err(Failure::bad_request(format!(
            "{name}={o}: give true or false"
        ))),
    }
}

/// The body's `DeleteOptions`, as an object (an empty body is none).
fn body_options(body: &Bytes) -> Result<Map<String, Value>, Failure> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        Failure::bad_request(format!("the DELETE body is not a JSON DeleteOptions: {e}"))
    })?;
    let Value::Object(m) = v else {
        return Err(Failure::bad_request(
            "the DELETE body is not a DeleteOptions object",
        ));
    };
    if let Some(k) = m.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(Failure::bad_request(format!(
            "DeleteOptions: unknown field `{}`; the fields are {}",
            boxery_verbs::render::safe(k),
            FIELDS.join(", ")
        )));
    }
    match m.get("kind") {
        None | Some(Value::Null) => {}
        Some(Value::String(k)) if k == "DeleteOptions" => {}
        Some(other) => {
            return Err(Failure::bad_request(format!(
                "the DELETE body's kind is {other}: send a DeleteOptions"
            )));
        }
    }
    Ok(m)
}

/// A string field of the body (`null` is absent).
fn text<'a>(m: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, Failure> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(Failure::bad_request(format!(
            "DeleteOptions.{key} is {other}: a string"
        ))),
    }
}

/// A delete's options from the query `p` and the request's `body`.
pub fn delete_options(p: &Params, body: &Bytes) -> Result<DeleteOpts, Failure> {
    let m = body_options(body)?;
    // dryRun: `All`, from the query or the body's list
    let mut dry = p.dry()?;
    match m.get("dryRun") {
        None | Some(Value::Null) => {}
        Some(Value::Array(values)) => {
            for v in values {
                match v.as_str() {
                    Some("All") => dry = true,
                    _ => {
                        return Err(invalid(format!(
                            "DeleteOptions.dryRun: {v} is not supported: the only dry run is All"
                        )));
                    }
                }
            }
        }
        Some(other) => {
            return Err(Failure::bad_request(format!(
                "DeleteOptions.dryRun is {other}: a list ([\"All\"])"
            )));
        }
    }
    // propagationPolicy and orphanDependents (its deprecated form)
    let policy = one(
        "propagationPolicy",
        p.propagation_policy.as_deref().filter(|s| !s.is_empty()),
        text(&m, "propagationPolicy")?,
    )?;
    let orphan = one(
        "orphanDependents",
        query_bool("orphanDependents", &p.orphan_dependents)?,
        match m.get("orphanDependents") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => {
                return Err(Failure::bad_request(format!(
                    "DeleteOptions.orphanDependents is {other}: true or false"
                )));
            }
        },
    )?;
    if policy.is_some() && orphan.is_some() {
        return Err(invalid(
            "propagationPolicy and orphanDependents cannot both be set: give propagationPolicy",
        ));
    }
    match policy {
        None | Some("Background" | "Foreground") => {}
        Some("Orphan") => {
            return Err(invalid(
                "propagationPolicy Orphan is not supported: boxery cannot orphan what an object owns (a Pool's members, a VM's disk are removed with it, the object staying until they are gone); use Background (the default) or Foreground",
            ));
        }
        Some(other) => {
            return Err(invalid(format!(
                "propagationPolicy `{}` is not supported: Background (the default) or Foreground",
                boxery_verbs::render::safe(other)
            )));
        }
    }
    if orphan == Some(true) {
        return Err(invalid(
            "orphanDependents: true is not supported: boxery cannot orphan what an object owns; use propagationPolicy Background (the default) or Foreground",
        ));
    }
    // gracePeriodSeconds
    let query_grace = match p.grace_period_seconds.as_deref() {
        None | Some("") => None,
        Some(s) => Some(s.parse::<i64>().map_err(|_| {
            Failure::bad_request(format!("gracePeriodSeconds={s}: a whole number of seconds"))
        })?),
    };
    let body_grace = match m.get("gracePeriodSeconds") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| {
            Failure::bad_request(format!(
                "DeleteOptions.gracePeriodSeconds is {v}: a whole number of seconds"
            ))
        })?),
    };
    if let Some(g) = one("gracePeriodSeconds", query_grace, body_grace)?
        && !(0..=1).contains(&g)
    {
        return Err(invalid(format!(
            "gracePeriodSeconds {g} is not supported: boxery removes a VM without a graceful guest shutdown, so only 0 or 1 (kubectl delete --force, --now) is honest; stop the VM first (`boxery stop NAME`, spec.runStrategy: Stopped) for a clean shutdown"
        )));
    }
    match m.get("ignoreStoreReadErrorWithClusterBreakingPotential") {
        None | Some(Value::Null | Value::Bool(false)) => {}
        Some(_) => {
            return Err(invalid(
                "ignoreStoreReadErrorWithClusterBreakingPotential is not supported: an object boxery cannot read is removed with `boxery delete --force` on the VM host",
            ));
        }
    }
    // preconditions
    let (mut uid, mut resource_version) = (None, None);
    match m.get("preconditions") {
        None | Some(Value::Null) => {}
        Some(Value::Object(pre)) => {
            if let Some(k) = pre.keys().find(|k| *k != "uid" && *k != "resourceVersion") {
                return Err(Failure::bad_request(format!(
                    "DeleteOptions.preconditions: unknown field `{}`; the fields are uid, resourceVersion",
                    boxery_verbs::render::safe(k)
                )));
            }
            uid = text(pre, "uid")?.map(String::from);
            resource_version = text(pre, "resourceVersion")?.map(String::from);
        }
        Some(other) => {
            return Err(Failure::bad_request(format!(
                "DeleteOptions.preconditions is {other}: an object with uid and resourceVersion"
            )));
        }
    }
    Ok(DeleteOpts {
        dry,
        uid,
        resource_version,
    })
}

impl DeleteOpts {
    /// Whether it names preconditions.
    pub fn has_preconditions(&self) -> bool {
        self.uid.is_some() || self.resource_version.is_some()
    }

    /// Check the preconditions against `obj` as stored: 409 Conflict, in the Kubernetes API's
    /// words, when one differs.
    pub fn check(&self, obj: &DynObject, plural: &str) -> Result<(), Failure> {
        let conflict = |what: &str, want: &str, have: Option<&str>| {
            Failure::new(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Precondition failed: {what} in precondition: {}, {what} in object meta: {}; the object changed: read it again",
                    boxery_verbs::render::safe(want),
                    have.unwrap_or("")
                ),
            )
            .about(plural, &obj.metadata.name)
        };
        if let Some(u) = &self.uid
            && Some(u.as_str()) != obj.metadata.uid.as_deref()
        {
            return Err(conflict("UID", u, obj.metadata.uid.as_deref()));
        }
        if let Some(rv) = &self.resource_version
            && Some(rv.as_str()) != obj.metadata.resource_version.as_deref()
        {
            return Err(conflict(
                "ResourceVersion",
                rv,
                obj.metadata.resource_version.as_deref(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(query: &str, body: &str) -> Result<DeleteOpts, Failure> {
        let uri: axum::http::Uri = format!("/x?{query}").parse().unwrap();
        let axum::extract::Query(p) = axum::extract::Query::<Params>::try_from_uri(&uri).unwrap();
        delete_options(&p, &Bytes::from(body.to_string()))
    }

    #[test]
    fn the_body_and_the_query_are_both_read() {
        assert!(!opts("", "").unwrap().dry);
        assert!(opts("dryRun=All", "").unwrap().dry);
        // what kubectl --dry-run=server sends
        let kubectl = r#"{"kind":"DeleteOptions","apiVersion":"v1","propagationPolicy":"Background","dryRun":["All"]}"#;
        assert!(opts("", kubectl).unwrap().dry);
        let pre = opts(
            "",
            r#"{"preconditions":{"uid":"u1","resourceVersion":"7"}}"#,
        )
        .unwrap();
        assert_eq!(
            (pre.uid.as_deref(), pre.resource_version.as_deref()),
            (Some("u1"), Some("7"))
        );
        assert!(!opts("propagationPolicy=Foreground", "{}").unwrap().dry);
        assert!(opts("gracePeriodSeconds=0", r#"{"gracePeriodSeconds":0}"#).is_ok());
    }

    /// `opts(query, body)` is refused with `code` and a message that `says`.
    fn refused(query: &str, body: &str, code: u16, says: &str) {
        let f = opts(query, body).expect_err(&format!("{query} {body} was accepted"));
        assert_eq!(f.code.as_u16(), code, "{query} {body}: {}", f.message);
        assert!(f.message.contains(says), "{query} {body}: {}", f.message);
    }

    #[test]
    fn what_is_not_carried_out_is_refused() {
        // An option refused wherever it comes from: (name, as a query, as JSON, the status
        // as a query, as a body, what the message says).
        for (name, value, json, query_code, body_code, says) in [
            (
                "dryRun",
                "Some",
                r#"["Some"]"#,
                400,
                422,
                "the only dry run is All",
            ),
            (
                "propagationPolicy",
                "Orphan",
                r#""Orphan""#,
                422,
                422,
                "cannot orphan",
            ),
            (
                "orphanDependents",
                "true",
                "true",
                422,
                422,
                "cannot orphan",
            ),
            ("gracePeriodSeconds", "30", "30", 422, 422, "only 0 or 1"),
        ] {
            refused(&format!("{name}={value}"), "", query_code, says);
            refused("", &format!(r#"{{"{name}":{json}}}"#), body_code, says);
        }
        refused("propagationPolicy=Sideways", "", 422, "Background");
        refused("gracePeriodSeconds=-5", "", 422, "only 0 or 1");
        let body_only = [
            (
                r#"{"ignoreStoreReadErrorWithClusterBreakingPotential":true}"#,
                422,
                "not supported",
            ),
            (r#"{"preconditions":{"name":"x"}}"#, 400, "unknown field"),
            (r#"{"bogus":1}"#, 400, "unknown field `bogus`"),
            (r#"{"kind":"Vm"}"#, 400, "send a DeleteOptions"),
            ("not json", 400, "not a JSON DeleteOptions"),
            (
                r#"{"propagationPolicy":"Background","orphanDependents":false}"#,
                422,
                "cannot both be set",
            ),
        ];
        for (body, code, says) in body_only {
            refused("", body, code, says);
        }
        // Given in both places, differently.
        for (query, body) in [
            (
                "propagationPolicy=Background",
                r#"{"propagationPolicy":"Foreground"}"#,
            ),
            ("gracePeriodSeconds=0", r#"{"gracePeriodSeconds":1}"#),
        ] {
            refused(query, body, 400, "give it once");
        }
    }

    #[test]
    fn preconditions_are_checked() {
        let obj: DynObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Vm",
            "metadata": {"name": "a", "uid": "u1", "resourceVersion": "7"},
        }))
        .unwrap();
        let with = |uid: Option<&str>, rv: Option<&str>| DeleteOpts {
            dry: false,
            uid: uid.map(String::from),
            resource_version: rv.map(String::from),
        };
        assert!(with(Some("u1"), Some("7")).check(&obj, "vms").is_ok());
        assert!(with(None, None).check(&obj, "vms").is_ok());
        let f = with(Some("u2"), None).check(&obj, "vms").unwrap_err();
        assert_eq!(f.code, StatusCode::CONFLICT);
        assert!(
            f.message.contains("UID in precondition: u2"),
            "{}",
            f.message
        );
        let f = with(None, Some("6")).check(&obj, "vms").unwrap_err();
        assert!(
            f.message.contains("ResourceVersion in precondition: 6"),
            "{}",
            f.message
        );
    }
}
