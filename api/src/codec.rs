//! Reading manifests: YAML (one or many `---`-separated documents) or JSON, each document
//! validated on its own; errors name the source, the document's index and the field path.
//!
//! # Guarantees
//! - Never panics, whatever the bytes (property-tested in `api/tests/properties.rs`).
//! - Bounded work: a file above [`MAX_FILE_BYTES`] is refused before parsing; YAML has explicit
//!   budgets for nesting ([`MAX_DEPTH`]), nodes, documents, alias replays
//!   ([`MAX_ALIAS_REPLAYED_EVENTS`]) and expanded scalar bytes ([`MAX_SCALAR_BYTES`]), so an
//!   alias bomb is refused in milliseconds; JSON stops at 128 levels of nesting.
//! - Every error names the source and is safe to print: control and other unprintable
//!   characters in the source name, paths and messages are escaped.

use std::fmt;

use serde_json::Value;

use crate::name::printable;
use crate::resource::DynObject;
use crate::validate::{FieldError, normalize};

/// The largest manifest file accepted.
pub const MAX_FILE_BYTES: usize = 8 << 20;
/// The largest single object accepted (as stored JSON).
pub const MAX_OBJECT_BYTES: usize = 1 << 20;
/// The most events YAML aliases (`*a`) may replay in one file. Manifests that share a block
/// through an anchor replay a few hundred; an alias bomb ("billion laughs") wants billions.
pub const MAX_ALIAS_REPLAYED_EVENTS: usize = 20_000;
/// The most scalar bytes one file may expand to, aliases included.
pub const MAX_SCALAR_BYTES: usize = 2 * MAX_FILE_BYTES;
/// The deepest nesting of mappings and sequences a YAML document may have (JSON stops at 128).
pub const MAX_DEPTH: usize = 64;

/// The YAML parser's budgets, set here rather than left to serde-saphyr's defaults (which
/// allow a million replayed alias events and 64 MiB of scalars): far above what a manifest
/// needs, low enough that a hostile file is refused in milliseconds and a few MiB.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: MAX_DEPTH,
            max_documents: 1_024,
            max_nodes: 250_000,
            max_total_scalar_bytes: MAX_SCALAR_BYTES,
            max_aliases: 10_000,
            max_anchors: 10_000,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: MAX_ALIAS_REPLAYED_EVENTS,
        },
    }
}

/// One YAML (or JSON) document as a value, under the same budgets as a manifest: for any other
/// YAML an agent or a person hands boxery (a patch, an edited object).
pub fn yaml_value(text: &str) -> Result<Value, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(text, yaml_options())
}

/// A manifest that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ManifestError {
    /// Where it came from (a path, `-` for stdin, `<inline>`).
    pub source_name: String,
    /// The document's index in the file (0-based), when known.
    pub document: Option<usize>,
    /// The problems.
    pub errors: Vec<FieldError>,
    /// The object, when known (`Vm/dev1`).
    pub object: Option<String>,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", printable(&self.source_name))?;
        if let Some(d) = self.document {
            write!(f, ", document {d}")?;
        }
        if let Some(o) = &self.object {
            write!(f, " ({o})")?;
        }
        f.write_str(": ")?;
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// One parsed, validated object and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The source's name.
    pub source_name: String,
    /// Index of the document within the source.
    pub document: usize,
    /// The object, validated and with defaults.
    pub object: DynObject,
    /// The object as written, without defaults (its apiVersion, kind and name as in
    /// `object`): what an applier sets and owns, so that a field the manifest leaves out is
    /// not taken from whoever set it (`apply`, field ownership).
    pub given: DynObject,
}

fn err(source: &str, document: Option<usize>, message: String) -> ManifestError {
    ManifestError {
        source_name: source.to_string(),
        document,
        errors: vec![FieldError::new("", printable(&message))],
        object: None,
    }
}

/// A field error safe to print: paths and messages quote the manifest's own keys and values,
/// which may hold escapes, DEL or C1 controls (JSON escapes only U+0000 to U+001F).
fn printable_error(e: FieldError) -> FieldError {
    FieldError::new(printable(&e.path), printable(&e.message))
}

/// Which document (0-based) a 1-based line falls in, counting `---` separators before it.
fn document_at_line(text: &str, line: usize) -> usize {
    let mut doc = 0;
    let mut seen_content = false;
    for (i, l) in text.lines().enumerate() {
        if i + 1 >= line {
            break;
        }
        if l.starts_with("---") {
            if seen_content {
                doc += 1;
            }
            seen_content = true;
        } else if !l.trim().is_empty() && !l.trim_start().starts_with('#') {
            seen_content = true;
        }
    }
    doc
}

/// Parse a source's bytes into raw JSON documents (no validation). Empty documents are skipped.
pub fn parse_documents(source: &str, bytes: &[u8]) -> Result<Vec<(usize, Value)>, ManifestError> {
    if bytes.len() > MAX_FILE_BYTES {
        return Err(err(
            source,
            None,
            format!(
                "{:.1} MiB is too large: a manifest file may hold at most {} MiB (and one object at most {} MiB)",
                bytes.len() as f64 / (1u64 << 20) as f64,
                MAX_FILE_BYTES >> 20,
                MAX_OBJECT_BYTES >> 20
            ),
        ));
    }
    let text = std::str::from_utf8(bytes)
        .ok()
        .filter(|t| !t.contains('\0'))
        .ok_or_else(|| {
            err(
                source,
                None,
                "not a text file: give a YAML or JSON manifest".into(),
            )
        })?;
    if text.trim().is_empty() {
        return Err(err(
            source,
            None,
            "the file is empty: it holds no objects to apply".into(),
        ));
    }
    let trimmed = text.trim_start();
    let docs: Vec<Value> = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(items)) => items,
            Ok(v) => vec![v],
            Err(e) => {
                return Err(err(
                    source,
                    None,
                    format!(
                        "invalid JSON at line {}, column {}: {e}",
                        e.line(),
                        e.column()
                    ),
                ));
            }
        }
    } else {
        serde_saphyr::from_multiple_with_options::<Value>(text, yaml_options()).map_err(|e| {
            let doc = e
                .location()
                .map(|l| document_at_line(text, l.line() as usize));
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("").to_string();
            err(source, doc, format!("invalid YAML: {first}"))
        })?
    };
    // A `kind: List` (what `get -o yaml|json` prints for a list, as kubectl's) stands for its
    // items, each keeping the List's document number.
    let out: Vec<(usize, Value)> = docs
        .into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_null())
        .flat_map(|(i, v)| match v {
            Value::Object(mut m)
                if m.get("kind").and_then(Value::as_str) == Some("List")
                    && m.get("items").is_some_and(Value::is_array) =>
            {
                let Some(Value::Array(items)) = m.remove("items") else {
                    unreachable!("checked above")
                };
                items.into_iter().map(|item| (i, item)).collect::<Vec<_>>()
            }
            v => vec![(i, v)],
        })
        .collect();
    if out.is_empty() {
        return Err(err(
            source,
            None,
            "the file holds no objects (only empty documents)".into(),
        ));
    }
    Ok(out)
}

/// Parse and validate every document of a source. The first bad document fails the whole
/// source, so callers can apply all or nothing.
pub fn parse_manifests(source: &str, bytes: &[u8]) -> Result<Vec<Manifest>, ManifestError> {
    let (ok, mut errors) = parse_manifests_all(source, bytes);
    match errors.is_empty() {
        true => Ok(ok),
        false => Err(errors.remove(0)),
    }
}

/// [`parse_manifests`], going on past a bad document: the good ones, and an error for each bad
/// one (or one for the whole source when it is not YAML at all), so that a person fixing a
/// directory sees every problem at once.
pub fn parse_manifests_all(source: &str, bytes: &[u8]) -> (Vec<Manifest>, Vec<ManifestError>) {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let documents = match parse_documents(source, bytes) {
        Ok(d) => d,
        Err(e) => return (out, vec![e]),
    };
    for (index, value) in documents {
        let size = serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0);
        if size > MAX_OBJECT_BYTES {
            errors.push(err(
                source,
                Some(index),
                format!(
                    "the object is {} KiB; an object may be at most {} KiB",
                    size >> 10,
                    MAX_OBJECT_BYTES >> 10
                ),
            ));
            continue;
        }
        let raw = value.clone();
        let object = match normalize(value) {
            Ok(o) => o,
            Err(e) => {
                errors.push(ManifestError {
                    source_name: source.to_string(),
                    document: Some(index),
                    object: Some(printable(&e.object)),
                    errors: e.errors.into_iter().map(printable_error).collect(),
                });
                continue;
            }
        };
        // A manifest is what someone asks for now: a field nothing implements is refused here,
        // with the file's name (the store refuses it too, but lets objects stored before keep it).
        let unimplemented = crate::validate::unimplemented(&object);
        if !unimplemented.is_empty() {
            errors.push(ManifestError {
                source_name: source.to_string(),
                document: Some(index),
                object: Some(printable(&object.key())),
                errors: unimplemented.into_iter().map(printable_error).collect(),
            });
            continue;
        }
        let given = match serde_json::from_value::<DynObject>(raw) {
            Ok(mut g) => {
                g.api_version.clone_from(&object.api_version);
                g.kind.clone_from(&object.kind);
                g.metadata.name.clone_from(&object.metadata.name);
                g
            }
            Err(_) => object.clone(),
        };
        out.push(Manifest {
            source_name: source.to_string(),
            document: index,
            object,
            given,
        });
    }
    (out, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_values_have_the_manifests_budgets() {
        assert_eq!(yaml_value("spec: {cpus: 2}").unwrap()["spec"]["cpus"], 2);
        // an alias bomb (a patch from an agent, say) is refused, not expanded: 100,000 replayed
        // events, within serde-saphyr's defaults (a million) but over the manifests' budget
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..5 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        assert!(yaml_value(&bomb).is_err());
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(yaml_value(&deep).is_err());
    }

    const VM: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: a}\nspec: {source: {image: debian-12}}\n";

    #[test]
    fn multi_document() {
        let two = format!("{VM}---\n{}", VM.replace("name: a", "name: b"));
        let m = parse_manifests("x.yaml", two.as_bytes()).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].object.metadata.name, "b");
        assert_eq!(m[1].document, 1);
    }

    #[test]
    fn errors_name_document_and_field() {
        let bad = format!(
            "{VM}---\n{}",
            VM.replace("image: debian-12", "image: debian-12, bogus: 1")
        );
        let e = parse_manifests("x.yaml", bad.as_bytes()).unwrap_err();
        assert_eq!(e.document, Some(1), "{e}");
        assert!(e.to_string().contains("x.yaml, document 1"), "{e}");
        // A List stands for its items (what `get -o yaml` prints for a list).
        let list = b"apiVersion: boxery.dev/v1alpha1\nkind: List\nitems:\n- {kind: Vm, metadata: {name: a}}\n- {kind: Vm, metadata: {name: b}}\n";
        let docs = parse_documents("l.yaml", list).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1].1["metadata"]["name"], "b");
        let e = parse_manifests("y.yaml", b"a: [1, 2\nb: c").unwrap_err();
        assert!(e.to_string().starts_with("y.yaml"), "{e}");
        assert!(
            parse_manifests("z", b"\x00\x01\xff")
                .unwrap_err()
                .to_string()
                .contains("not a text file")
        );
        assert!(
            parse_manifests("z", b"  \n")
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        let big = vec![b'a'; 10 << 20];
        assert!(
            parse_manifests("z", &big)
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
    }

    #[test]
    fn json_input() {
        let j = r#"{"apiVersion":"boxery.dev/v1alpha1","kind":"Vm","metadata":{"name":"a"},"spec":{"source":{"image":"debian-12"}}}"#;
        assert_eq!(parse_manifests("j.json", j.as_bytes()).unwrap().len(), 1);
    }
}
