//! Label selectors, as `kubectl -l` writes them: `team=web,tier!=db,gpu,!spot,env in (a,b)`.

use std::collections::BTreeMap;
use std::str::FromStr;

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Requirement {
    /// `key=value` or `key==value`.
    Eq(String, String),
    /// `key!=value` (also true when the key is absent).
    NotEq(String, String),
    /// `key in (a,b)`.
    In(String, Vec<String>),
    /// `key notin (a,b)`.
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    NotExists(String),
}

/// A conjunction of requirements; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Selector(pub Vec<Requirement>);

/// A selector that does not parse; holds the input as [`shown`](crate::name::shown): escaped
/// and cut, so the message is safe to print whatever was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid label selector `{0}`: write key=value, key!=value, key, !key, `key in (a,b)` or `key notin (a,b)`, joined by commas"
)]
pub struct SelectorError(pub String);

impl Selector {
    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => labels.get(k) == Some(v),
            Requirement::NotEq(k, v) => labels.get(k) != Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|l| vs.contains(l)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|l| !vs.contains(l)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
        })
    }

    /// Whether it has no requirements.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn split_top(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

impl FromStr for Selector {
    type Err = SelectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || SelectorError(crate::name::shown(s));
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Selector(reqs));
        }
        for part in split_top(s) {
            let p = part.trim();
            let set = |rest: &str| -> Option<Vec<String>> {
                let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
                Some(
                    inner
                        .split(',')
                        .map(|v| v.trim().to_string())
                        .filter(|v| !v.is_empty())
                        .collect(),
                )
            };
            let req = if let Some((k, rest)) = p.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set(rest).ok_or_else(err)?)
            } else if let Some((k, rest)) = p.split_once(" in ") {
                Requirement::In(k.trim().into(), set(rest).ok_or_else(err)?)
            } else if let Some((k, v)) = p.split_once("!=") {
                Requirement::NotEq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Requirement::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = p.strip_prefix('!') {
                Requirement::NotExists(k.trim().into())
            } else {
                Requirement::Exists(p.into())
            };
            let key = match &req {
                Requirement::Eq(k, _)
                | Requirement::NotEq(k, _)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _)
                | Requirement::Exists(k)
                | Requirement::NotExists(k) => k,
            };
            if !valid_key(key) {
                return Err(err());
            }
            reqs.push(req);
        }
        Ok(Selector(reqs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matches() {
        let l = labels(&[("team", "web"), ("tier", "fe")]);
        for (sel, want) in [
            ("", true),
            ("team=web", true),
            ("team==web", true),
            ("team=db", false),
            ("team!=db", true),
            ("gpu", false),
            ("!gpu", true),
            ("tier in (fe, be)", true),
            ("tier notin (fe)", false),
            ("team=web,tier in (be)", false),
        ] {
            assert_eq!(sel.parse::<Selector>().unwrap().matches(&l), want, "{sel}");
        }
        assert!("a in b".parse::<Selector>().is_err());
        assert!("=x".parse::<Selector>().is_err());
        let e = "a=b,\u{1b}]0;pwned\u{7}".parse::<Selector>().unwrap_err();
        assert!(e.to_string().contains("`a=b,\\u{1b}]0;pwned\\u{7}`"), "{e}");
    }
}
