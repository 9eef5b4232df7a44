//! The protobuf bodies kubectl sends for Kubernetes' own kinds: `kubectl auth can-i` posts its
//! `SelfSubjectAccessReview` as `application/vnd.kubernetes.protobuf` (client-go's default for
//! built-in types). Only what [`crate::access_review`] reads is decoded, into the JSON shape
//! of the same object; the answer goes back as JSON, which the client also accepts.
//!
//! The envelope is `k8s\0` and a `runtime.Unknown` (`typeMeta` = 1, `raw` = 2); in `raw`, a
//! review's `spec` is field 2; a `SelfSubjectAccessReviewSpec` has `resourceAttributes` = 1
//! (`namespace` 1, `verb` 2, `group` 3, `version` 4, `resource` 5, `subresource` 6, `name`
//! 7) and `nonResourceAttributes` = 2 (`path` 1, `verb` 2); a `SelfSubjectRulesReviewSpec`,
//! `namespace` = 1 (k8s.io/api/authorization/v1/generated.proto).

use serde_json::{Map, Value};

/// The magic that starts a Kubernetes protobuf body.
pub const MAGIC: &[u8] = b"k8s\0";

fn varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// The length-delimited fields of a message, by number (others are skipped); `None` when it
/// is not a well-formed message.
fn fields(mut b: &[u8]) -> Option<Vec<(u64, &[u8])>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let skip = match key & 7 {
            0 => {
                varint(&mut b)?;
                0
            }
            1 => 8,
            5 => 4,
            2 => {
                let len = usize::try_from(varint(&mut b)?).ok()?;
                let (v, rest) = (b.get(..len)?, b.get(len..)?);
                out.push((key >> 3, v));
                b = rest;
                0
            }
            _ => return None,
        };
        b = b.get(skip..)?;
    }
    Some(out)
}

fn field(b: &[u8], number: u64) -> Option<&[u8]> {
    fields(b)?
        .into_iter()
        .filter(|(n, _)| *n == number)
        .map(|(_, v)| v)
        .next_back()
}

/// A message of strings, by field number and JSON name.
fn strings(b: &[u8], names: &[(u64, &str)]) -> Option<Value> {
    let mut m = Map::new();
    for (n, v) in fields(b)? {
        if let Some((_, name)) = names.iter().find(|(k, _)| *k == n) {
            let s = std::str::from_utf8(v).ok()?;
            m.insert((*name).into(), Value::String(s.into()));
        }
    }
    Some(Value::Object(m))
}

/// A `SelfSubjectAccessReview` or `SelfSubjectRulesReview` (`kind`) in protobuf, as JSON
/// (`kind` and `spec`); `None` when the body is not one.
pub fn review(body: &[u8], kind: &str) -> Option<Value> {
    let unknown = body.strip_prefix(MAGIC)?;
    let raw = field(unknown, 2)?;
    fields(raw)?;
    let spec_bytes = field(raw, 2).unwrap_or_default();
    let mut spec = Map::new();
    match kind {
        "SelfSubjectAccessReview" => {
            if let Some(r) = field(spec_bytes, 1) {
                let names = [
                    (1, "namespace"),
                    (2, "verb"),
                    (3, "group"),
                    (4, "version"),
                    (5, "resource"),
                    (6, "subresource"),
                    (7, "name"),
                ];
                spec.insert("resourceAttributes".into(), strings(r, &names)?);
            }
            if let Some(r) = field(spec_bytes, 2) {
                spec.insert(
                    "nonResourceAttributes".into(),
                    strings(r, &[(1, "path"), (2, "verb")])?,
                );
            }
        }
        _ => {
            if let Value::Object(m) = strings(spec_bytes, &[(1, "namespace")])? {
                spec = m;
            }
        }
    }
    Some(serde_json::json!({"kind": kind, "spec": spec}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ld(number: u8, bytes: &[u8]) -> Vec<u8> {
        let mut v = vec![number << 3 | 2, bytes.len() as u8];
        v.extend_from_slice(bytes);
        v
    }

    #[test]
    fn an_access_review_is_read() {
        let attrs = [
            ld(2, b"create"),
            ld(3, b"boxery.dev"),
            ld(5, b"vms"),
            ld(1, b"default"),
        ]
        .concat();
        let spec = ld(1, &attrs);
        let raw = [ld(1, &[]), ld(2, &spec)].concat();
        let type_meta = [
            ld(1, b"authorization.k8s.io/v1"),
            ld(2, b"SelfSubjectAccessReview"),
        ]
        .concat();
        let body = [MAGIC.to_vec(), ld(1, &type_meta), ld(2, &raw)].concat();
        let v = review(&body, "SelfSubjectAccessReview").unwrap();
        let r = &v["spec"]["resourceAttributes"];
        assert_eq!(
            (
                r["verb"].as_str(),
                r["group"].as_str(),
                r["resource"].as_str()
            ),
            (Some("create"), Some("boxery.dev"), Some("vms"))
        );
        assert!(review(b"{}", "SelfSubjectAccessReview").is_none());
        assert!(review(b"k8s\0\x12\x05ab", "SelfSubjectAccessReview").is_none());
    }
}
