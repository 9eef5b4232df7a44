//! List paging, as the Kubernetes API pages: `limit=N` gives at most N items and, when more
//! remain, `metadata.continue`, an opaque token the next request sends back as `continue`
//! (with the same selectors); `kubectl get --chunk-size`, the client libraries' `limit` and
//! `_continue`, and reflectors page this way.
//!
//! # What a paged list guarantees
//! - Items come in name order; each name at most once over the pages; an object that exists
//!   from the first page to the last is on exactly one page.
//! - Every page carries the first page's `resourceVersion`, and a later page is the list as
//!   it was at that revision whenever the store can still read it there
//!   (`ObjectStore::list_at`: the SQLite store reads each changed object's version from its
//!   history): the pages are one snapshot, as on the Kubernetes API.
//! - When it cannot (an object changed since, and its version at that revision was compacted
//!   away while it stayed unchanged; a store that keeps no history), the page is read at the
//!   current revision: an object created, changed or deleted while the client paged may then
//!   be missing or shown as it is now. It still carries the first page's revision, so a watch
//!   from it misses nothing (it may replay a change a page already showed, which clients take
//!   as an update).
//! - A token whose revision the store compacted away is a `410 Expired` Status, as in
//!   Kubernetes: list again from the start. A token that is not one of ours (or another
//!   kind's) is a 400.

use axum::http::StatusCode;
use base64::Engine as _;
use boxery_api::{DynObject, KindInfo};
use serde::{Deserialize, Serialize};

use crate::Shared;
use crate::query::Params;
use crate::status::Failure;

/// What a continue token holds (base64url of this JSON: opaque to clients, as Kubernetes'
/// are, and checked when it comes back).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Token {
    /// The format.
    v: u8,
    /// The kind's plural it lists.
    k: String,
    /// The first page's revision.
    rv: u64,
    /// The last name served: the next page starts after it.
    s: String,
}

fn encode(t: &Token) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(t).expect("a token serializes"))
}

fn decode(text: &str) -> Option<Token> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text.trim_end_matches('='))
        .ok()?;
    let t: Token = serde_json::from_slice(&raw).ok()?;
    (t.v == 1).then_some(t)
}

/// One list request's page: where it starts, how many it takes, the revision it reports.
#[derive(Debug)]
pub struct Page {
    plural: &'static str,
    limit: Option<usize>,
    after: Option<String>,
    rv: Option<u64>,
}

/// One page of items, and what the list's metadata says of the rest.
#[derive(Debug)]
pub struct Cut {
    /// The items of this page.
    pub items: Vec<DynObject>,
    /// The revision to report.
    pub rv: u64,
    /// The token of the next page, when more remain.
    pub cont: Option<String>,
    /// How many remain after this page.
    pub remaining: usize,
}

impl Page {
    /// The page a request asks for: its `limit` (none or ≤ 0: everything) and `continue`,
    /// checked (400 for a token that is not one of this kind's, or with a `resourceVersion`
    /// beside it; 410 Expired for a compacted one).
    pub async fn of(sh: &Shared, info: &'static KindInfo, p: &Params) -> Result<Page, Failure> {
        let limit = p.limit.filter(|l| *l > 0).map(|l| l as usize);
        let mut page = Page {
            plural: info.plural,
            limit,
            after: None,
            rv: None,
        };
        let Some(text) = p.continue_.as_deref().filter(|c| !c.is_empty()) else {
            return Ok(page);
        };
        if p.resource_version.as_deref().is_some_and(|r| !r.is_empty()) {
            return Err(Failure::bad_request(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let t = decode(text)
            .filter(|t| t.k == info.plural)
            .ok_or_else(|| {
                Failure::bad_request(format!(
                    "continue key is not valid: not a continue token of a list of {} (send back the metadata.continue of the previous page)",
                    info.plural
                ))
            })?;
        let floor = sh.verbs.store().compacted().await?;
        if t.rv < floor {
            return Err(Failure::new(
                StatusCode::GONE,
                "Expired",
                format!(
                    "The provided continue parameter is too old to display a consistent list result: its resourceVersion {} is compacted (history starts after {floor}). Start a new list without the continue parameter.",
                    t.rv
                ),
            ));
        }
        page.after = Some(t.s);
        page.rv = Some(t.rv);
        Ok(page)
    }

    /// The revision a later page is read at: the first page's.
    pub fn at(&self) -> Option<u64> {
        self.rv
    }

    /// The last name the previous page served: this page's objects come after it.
    pub fn after(&self) -> Option<&str> {
        self.after.as_deref()
    }

    /// This page of `objs` (sorted by name, as the store lists them, and already past
    /// [`Page::after`]: `read_list_at` drops the earlier ones before it matches fields), read
    /// at `rev`.
    pub fn cut(&self, mut objs: Vec<DynObject>, rev: u64) -> Cut {
        let rv = self.rv.unwrap_or(rev);
        let Some(limit) = self.limit.filter(|l| *l < objs.len()) else {
            return Cut {
                items: objs,
                rv,
                cont: None,
                remaining: 0,
            };
        };
        let remaining = objs.len() - limit;
        objs.truncate(limit);
        let last = objs
            .last()
            .map(|o| o.metadata.name.clone())
            .unwrap_or_default();
        Cut {
            items: objs,
            rv,
            cont: Some(encode(&Token {
                v: 1,
                k: self.plural.to_string(),
                rv,
                s: last,
            })),
            remaining,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str) -> DynObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Image", "metadata": {"name": name},
        }))
        .unwrap()
    }

    #[test]
    fn pages_follow_one_another_and_tokens_are_checked() {
        let all: Vec<DynObject> = ["a", "b", "c", "d", "e"].into_iter().map(obj).collect();
        // what the list reads for a page: the names after the previous page's last
        let rest = |p: &Page| -> Vec<DynObject> {
            all.iter()
                .filter(|o| p.after().is_none_or(|a| o.metadata.name.as_str() > a))
                .cloned()
                .collect()
        };
        let first = Page {
            plural: "images",
            limit: Some(2),
            after: None,
            rv: None,
        };
        let c = first.cut(rest(&first), 7);
        assert_eq!(c.items.len(), 2);
        assert_eq!(c.remaining, 3);
        let t = decode(c.cont.as_deref().unwrap()).unwrap();
        assert_eq!((t.rv, t.s.as_str(), t.k.as_str()), (7, "b", "images"));
        let next = Page {
            plural: "images",
            limit: Some(2),
            after: Some(t.s),
            rv: Some(t.rv),
        };
        // read later: the revision reported is the first page's
        let c = next.cut(rest(&next), 9);
        let names: Vec<&str> = c.items.iter().map(|o| o.metadata.name.as_str()).collect();
        assert_eq!((names, c.rv, c.remaining), (vec!["c", "d"], 7, 1));
        let last = Page {
            plural: "images",
            limit: Some(2),
            after: Some("d".into()),
            rv: Some(7),
        };
        let c = last.cut(rest(&last), 9);
        assert_eq!((c.items.len(), c.cont, c.remaining), (1, None, 0));
        assert!(decode("nonsense").is_none());
        assert!(decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b"{}")).is_none());
    }
}
