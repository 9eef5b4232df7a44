//! A request's query parameters and what it accepts: selectors, watch options, dry runs,
//! field managers, and whether it asks for a Table.

use axum::http::HeaderMap;
use boxery_api::Selector;
use serde::Deserialize;
use serde_json::Value;

use crate::status::Failure;

/// The query parameters the API reads (others are ignored, as the Kubernetes API ignores
/// parameters it does not know).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Params {
    /// `labelSelector`.
    pub label_selector: Option<String>,
    /// `fieldSelector`: `PATH=V`, `PATH==V`, `PATH!=V`, comma-separated.
    pub field_selector: Option<String>,
    /// `watch=1|true`.
    pub watch: Option<String>,
    /// `resourceVersion`.
    pub resource_version: Option<String>,
    /// `allowWatchBookmarks`.
    pub allow_watch_bookmarks: Option<String>,
    /// `timeoutSeconds` of a watch.
    pub timeout_seconds: Option<u64>,
    /// `dryRun=All`.
    pub dry_run: Option<String>,
    /// `fieldManager`.
    pub field_manager: Option<String>,
    /// `force` (apply).
    pub force: Option<String>,
    /// `includeObject` of a Table request (`None`, `Metadata`, `Object`).
    pub include_object: Option<String>,
    /// `propagationPolicy` of a delete (also in a DeleteOptions body: [`crate::options`]).
    pub propagation_policy: Option<String>,
    /// `gracePeriodSeconds` of a delete.
    pub grace_period_seconds: Option<String>,
    /// `orphanDependents` of a delete (deprecated: propagationPolicy).
    pub orphan_dependents: Option<String>,
    /// `limit` of a list: at most this many items a page ([`crate::paging`]).
    pub limit: Option<i64>,
    /// `continue`: the token of the page to list ([`crate::paging`]).
    #[serde(rename = "continue")]
    pub continue_: Option<String>,
}

fn truthy(v: &Option<String>) -> bool {
    matches!(v.as_deref(), Some("1" | "true" | "True"))
}

impl Params {
    /// Whether it is a watch.
    pub fn is_watch(&self) -> bool {
        truthy(&self.watch)
    }
    /// Whether bookmarks are wanted.
    pub fn bookmarks(&self) -> bool {
        truthy(&self.allow_watch_bookmarks)
    }
    /// Whether an apply takes fields over.
    pub fn forced(&self) -> bool {
        truthy(&self.force)
    }
    /// `dryRun=All` (any other value is refused, as the Kubernetes API does).
    pub fn dry(&self) -> Result<bool, Failure> {
        match self.dry_run.as_deref() {
            None | Some("") => Ok(false),
            Some("All") => Ok(true),
            Some(o) => Err(Failure::bad_request(format!(
                "dryRun={o}: the only dry run is All"
            ))),
        }
    }
    /// The label selector.
    pub fn labels(&self) -> Result<Selector, Failure> {
        match self.label_selector.as_deref() {
            None | Some("") => Ok(Selector::default()),
            Some(s) => s
                .parse::<Selector>()
                .map_err(|e| Failure::bad_request(format!("labelSelector: {e}"))),
        }
    }
    /// The field selector.
    pub fn fields(&self) -> Result<FieldSelector, Failure> {
        FieldSelector::parse(self.field_selector.as_deref().unwrap_or(""))
    }
}

/// A field selector: each term compares the string at a dotted path (absent is "").
#[derive(Debug, Default, Clone)]
pub struct FieldSelector(Vec<(Vec<String>, bool, String)>);

impl FieldSelector {
    /// Parse `a.b=v,c!=w`.
    pub fn parse(s: &str) -> Result<FieldSelector, Failure> {
        let mut terms = Vec::new();
        for t in s.split(',').filter(|t| !t.trim().is_empty()) {
            let (path, eq, value) = if let Some((p, v)) = t.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = t.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = t.split_once('=') {
                (p, true, v)
            } else {
                return Err(Failure::bad_request(format!(
                    "fieldSelector: `{t}` is not FIELD=VALUE or FIELD!=VALUE"
                )));
            };
            let path: Vec<String> = path.trim().split('.').map(String::from).collect();
            if path.iter().any(|p| p.is_empty()) {
                return Err(Failure::bad_request(format!(
                    "fieldSelector: `{t}` names no field"
                )));
            }
            terms.push((path, eq, value.trim().to_string()));
        }
        Ok(FieldSelector(terms))
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `obj` (as served) matches.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, want)| {
            let mut v = obj;
            for p in path {
                v = &v[p.as_str()];
            }
            let got = match v {
                Value::Null => String::new(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (got == *want) == *eq
        })
    }

    /// The name it pins (`metadata.name=X`), if any: a list then reads one object.
    pub fn name(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|(p, eq, _)| *eq && p.len() == 2 && p[0] == "metadata" && p[1] == "name")
            .map(|(_, _, v)| v.as_str())
    }
}

/// Whether the client asks for a server-side Table (`Accept: …;as=Table;…`).
pub fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn field_selectors() {
        let o = json!({"metadata": {"name": "a"}, "involvedObject": {"kind": "Vm", "name": "a"}});
        let s = FieldSelector::parse(
            "involvedObject.name=a,involvedObject.namespace=,involvedObject.kind==Vm",
        )
        .unwrap();
        assert!(s.matches(&o));
        assert!(
            !FieldSelector::parse("metadata.name!=a")
                .unwrap()
                .matches(&o)
        );
        assert_eq!(
            FieldSelector::parse("metadata.name=a").unwrap().name(),
            Some("a")
        );
        assert!(FieldSelector::parse("nonsense").is_err());
    }

    #[test]
    fn table_only_when_asked_first() {
        let mut h = HeaderMap::new();
        h.insert(
            "accept",
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
                .parse()
                .unwrap(),
        );
        assert!(wants_table(&h));
        h.insert("accept", "application/json".parse().unwrap());
        assert!(!wants_table(&h));
    }
}
