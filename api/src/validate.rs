//! Validation of every write: the kind's JSON Schema (generated from the Rust types), then the
//! checks a schema cannot express, then defaults written into the object. Every error names the
//! field path.

use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;

use serde_json::Value;

use crate::resource::{API_VERSION, DynObject, KindInfo, Resource};

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FieldError {
    /// Dotted path (`spec.resources.cpus`, `metadata.name`); empty for the whole object.
    pub path: String,
    /// What is wrong, and what to write instead.
    pub message: String,
}

impl FieldError {
    /// A field error. The message is made safe to print (control characters escaped) and cut
    /// to 1,000 characters: it may quote what a hostile caller wrote.
    pub fn new(path: impl Into<String>, message: String) -> Self {
        const MAX: usize = 1000;
        let mut message = crate::name::printable(&message);
        if message.chars().count() > MAX {
            message = message.chars().take(MAX).collect::<String>() + "…";
        }
        FieldError {
            path: crate::name::printable(&path.into()),
            message,
        }
    }
}

/// The fields of a (normalized) object that validate but that nothing acts on yet. The store
/// refuses an object that sets one, except where a stored object already had the same field
/// set (ratcheting, as Kubernetes does for tightened validation): an object stored by an older
/// boxery can still have its status written, its finalizers removed and be deleted, and is
/// refused only once a write would set such a field anew.
pub fn unimplemented(obj: &crate::DynObject) -> Vec<FieldError> {
    KINDS
        .iter()
        .find(|k| k.kind == obj.kind)
        .map(|k| (k.typed.unimplemented)(obj))
        .unwrap_or_default()
}

/// The fields of `new` fixed once the object exists ([`KindInfo::immutable`]) that differ
/// from `old`'s (set, unset or altered), each with what it is and what to do instead.
///
/// [`KindInfo::immutable`]: crate::resource::KindInfo::immutable
pub fn changed_fixed(old: &DynObject, new: &DynObject) -> Vec<FieldError> {
    let Some(kind) = KINDS.iter().find(|k| k.kind == new.kind) else {
        return Vec::new();
    };
    // a JSON pointer into the object's fields (`/spec/source`)
    fn at<'o>(o: &'o DynObject, pointer: &str) -> Option<&'o Value> {
        let path = pointer.trim_start_matches('/');
        let (top, inner) = path.split_once('/').unwrap_or((path, ""));
        let v = o.rest.get(top)?;
        if inner.is_empty() {
            Some(v)
        } else {
            v.pointer(&format!("/{inner}"))
        }
    }
    kind.immutable
        .iter()
        .filter_map(|pointer| {
            let (was, is) = (at(old, pointer), at(new, pointer));
            (was != is).then(|| {
                let path = pointer.trim_start_matches('/').replace('/', ".");
                let was = match was {
                    Some(v) => format!("it is {v}"),
                    None => "it was not set".to_string(),
                };
                FieldError::new(
                    &path,
                    format!(
                        "fixed once the {} exists ({was}): delete the {} and make it again to change it",
                        kind.kind, kind.kind
                    ),
                )
            })
        })
        .collect()
}

/// A field that validates but that nothing acts on yet: refused, so that nobody's manifest
/// asks for something boxery would silently not do. `instead` says what to do.
#[allow(dead_code)] // no field waits for its implementation today
pub(crate) fn not_implemented(path: &str, instead: &str) -> FieldError {
    FieldError::new(path, format!("not implemented yet: {instead}"))
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// An object that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub struct ValidationError {
    /// `Vm/dev1`, or what is known of it.
    pub object: String,
    /// Each problem.
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is invalid: ", self.object)?;
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

pub use crate::KINDS;

/// Find a kind by its name, plural, singular or short name (case-insensitive).
pub fn lookup_kind(name: &str) -> Option<&'static KindInfo> {
    let n = name.to_ascii_lowercase();
    KINDS.iter().find(|k| {
        k.kind.eq_ignore_ascii_case(&n)
            || k.plural == n
            || k.singular == n
            || k.short_names.iter().any(|s| *s == n)
    })
}

/// The JSON Schema of a kind, generated from its Rust type.
pub fn schema_of(kind: &str) -> Option<Value> {
    schema_ref(kind).cloned()
}

/// The JSON Schema of a kind, generated once per process (generating it costs more than
/// validating an object against it: it was a tenth of `serve`'s CPU under a burst of claims).
pub fn schema_ref(kind: &str) -> Option<&'static Value> {
    static S: OnceLock<HashMap<&'static str, Value>> = OnceLock::new();
    S.get_or_init(|| {
        KINDS
            .iter()
            .map(|k| (k.kind, (k.typed.schema)().to_value()))
            .collect()
    })
    .get(kind)
}

fn validators() -> &'static HashMap<&'static str, jsonschema::Validator> {
    static V: OnceLock<HashMap<&'static str, jsonschema::Validator>> = OnceLock::new();
    V.get_or_init(|| {
        KINDS
            .iter()
            .map(|k| {
                let schema = schema_ref(k.kind).expect("every kind has a schema");
                let v = jsonschema::validator_for(schema).unwrap_or_else(|e| {
                    panic!("the generated schema of {} is invalid: {e}", k.kind)
                });
                (k.kind, v)
            })
            .collect()
    })
}

/// `/spec/resources/cpus` → `spec.resources.cpus`.
fn dotted(pointer: &str) -> String {
    pointer
        .trim_start_matches('/')
        .split('/')
        .collect::<Vec<_>>()
        .join(".")
}

pub use crate::name::{check_label_name, check_subdomain_name};

/// A schema error in words a person can act on: an unknown field with the nearest known one
/// (`cpu`: did you mean `cpus`?) and the fields there are; a value outside a set with the
/// values allowed, instead of the raw "not valid under any of the schemas listed in the
/// 'oneOf' keyword"; a wrong type as the type wanted.
fn explained(e: &jsonschema::ValidationError<'_>, root: &Value) -> String {
    use jsonschema::error::{TypeKind, ValidationErrorKind as K};
    // the schema object holding the failed keyword (its path without the keyword)
    let at = e.schema_path().as_str();
    let holder = at.rsplit_once('/').map_or("", |(h, _)| h);
    let node = root.pointer(holder).map(|n| deref(root, n));
    match e.kind() {
        K::AdditionalProperties { unexpected } => {
            let known: Vec<&str> = node
                .and_then(|n| n.get("properties"))
                .and_then(Value::as_object)
                .map(|p| p.keys().map(String::as_str).collect())
                .unwrap_or_default();
            let each: Vec<String> = unexpected
                .iter()
                .map(|u| match nearest(u, &known) {
                    Some(m) => format!(
                        "unknown field `{}`: did you mean `{m}`?",
                        crate::name::shown(u)
                    ),
                    None => format!("unknown field `{}`", crate::name::shown(u)),
                })
                .collect();
            if known.is_empty() {
                each.join("; ")
            } else {
                format!("{} (fields here: {})", each.join("; "), known.join(", "))
            }
        }
        K::OneOfNotValid { .. } | K::AnyOf { .. } | K::Enum { .. } => {
            let allowed = node.map(|n| allowed_values(root, n)).unwrap_or_default();
            let got = short(e.instance());
            if allowed.is_empty() {
                // one form or null (an optional field): what is wrong inside that form
                if let Some(msg) = node.and_then(|n| within_the_one_form(root, n, e.instance())) {
                    return msg;
                }
                // not a set of constants: what each accepted form is, in the schema's words
                let forms: Vec<String> = node
                    .into_iter()
                    .flat_map(|n| ["oneOf", "anyOf"].map(|k| n.get(k)))
                    .flatten()
                    .filter_map(Value::as_array)
                    .flatten()
                    .map(|sub| deref(root, sub))
                    .filter(|sub| sub.get("type") != Some(&Value::from("null")))
                    .filter_map(|sub| sub.get("description").and_then(Value::as_str))
                    .map(str::to_string)
                    .collect();
                return if forms.is_empty() {
                    format!("{got} is not accepted here ({e})")
                } else {
                    format!("{got} is not valid: {}", forms.join(" Or: "))
                };
            }
            let hint = match e.instance().as_str().and_then(|s| {
                let names: Vec<&str> = allowed.iter().map(String::as_str).collect();
                nearest(s, &names)
            }) {
                Some(m) => format!(": did you mean `{m}`?"),
                None => String::new(),
            };
            format!("{got} is not one of {}{hint}", allowed.join(", "))
        }
        K::Type { kind } => {
            let name = |t: &jsonschema::JsonType| match t.to_string().as_str() {
                "integer" => "an integer".to_string(),
                "number" => "a number".to_string(),
                "string" => "a string".to_string(),
                "boolean" => "true or false".to_string(),
                "object" => "a mapping (key: value)".to_string(),
                "array" => "a list".to_string(),
                other => other.to_string(),
            };
            let wanted: Vec<String> = match kind {
                TypeKind::Single(t) => vec![name(t)],
                TypeKind::Multiple(ts) => ts
                    .iter()
                    .filter(|t| t.to_string() != "null")
                    .map(|t| name(&t))
                    .collect(),
            };
            format!(
                "expected {}, got {}",
                wanted.join(" or "),
                short(e.instance())
            )
        }
        _ => e.to_string(),
    }
}

/// Where `node` is `anyOf`/`oneOf` of one form and `null` (what an `Option` field's schema
/// is) and `value` is not null: the errors of `value` against that form, each with its path
/// inside it (`height: 9000 is greater than the maximum of 4320`), rather than "not valid".
fn within_the_one_form(root: &Value, node: &Value, value: &Value) -> Option<String> {
    if value.is_null() {
        return None;
    }
    let forms: Vec<&Value> = ["oneOf", "anyOf"]
        .iter()
        .filter_map(|k| node.get(*k).and_then(Value::as_array))
        .flatten()
        .filter(|sub| deref(root, sub).get("type") != Some(&Value::from("null")))
        .collect();
    let [form] = forms.as_slice() else {
        return None;
    };
    let mut schema = (*form).clone();
    let obj = schema.as_object_mut()?;
    for k in ["$defs", "definitions"] {
        if let Some(d) = root.get(k) {
            obj.insert(k.into(), d.clone());
        }
    }
    let validator = jsonschema::validator_for(&schema).ok()?;
    let said: Vec<String> = validator
        .iter_errors(value)
        .map(|e| {
            let (at, what) = (dotted(e.instance_path().as_str()), explained(&e, &schema));
            if at.is_empty() {
                what
            } else {
                format!("{at}: {what}")
            }
        })
        .collect();
    (!said.is_empty()).then(|| said.join("; "))
}

/// `node`, or what its `$ref` (`#/$defs/X`) points at.
fn deref<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    node.get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix('#'))
        .and_then(|p| root.pointer(p))
        .unwrap_or(node)
}

/// The values a `oneOf`/`anyOf`/`enum` at `node` accepts, when they are a set of constants.
fn allowed_values(root: &Value, node: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut add = |v: &Value| {
        let s = match v {
            Value::String(s) => s.clone(),
            Value::Null => return,
            other => other.to_string(),
        };
        if !out.contains(&s) {
            out.push(s);
        }
    };
    for v in node
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        add(v);
    }
    if let Some(c) = node.get("const") {
        add(c);
    }
    for key in ["oneOf", "anyOf"] {
        for sub in node
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let sub = deref(root, sub);
            for v in sub
                .get("enum")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                add(v);
            }
            if let Some(c) = sub.get("const") {
                add(c);
            }
        }
    }
    out
}

/// A value as a message shows it: short, one line, a string in backquotes.
fn short(v: &Value) -> String {
    let s = match v {
        Value::String(s) => format!("`{}`", crate::name::shown(s)),
        other => crate::name::shown(&other.to_string()).to_string(),
    };
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s.to_string()
    }
}

/// The longest word [`nearest`] looks at: names and values are short, and a long string (an
/// agent's, say) costs length × candidates to compare, for no useful suggestion.
const NEAREST_MAX: usize = 64;

/// The candidate nearest to `word` (case-insensitive edit distance at most a third of its
/// length, and at least 1 allowed), if one is that near. Words over [`NEAREST_MAX`]
/// characters get none, and candidates whose length alone puts them out of reach are not
/// compared.
pub fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    if word.len() > NEAREST_MAX * 4 {
        return None;
    }
    let w = word.to_lowercase();
    let len = w.chars().count();
    if len > NEAREST_MAX {
        return None;
    }
    let limit = (len / 3).max(1);
    candidates
        .iter()
        .filter(|c| c.chars().count().abs_diff(len) <= limit)
        .map(|c| (edit_distance(&w, &c.to_lowercase()), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Levenshtein distance between two strings, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// [`crate::Typed::normalize`] of `R`.
pub(crate) fn normalize_typed<R: Resource>(
    value: Value,
    label: &str,
) -> Result<DynObject, ValidationError> {
    let fail = |errors| ValidationError {
        object: label.to_string(),
        errors,
    };
    let mut obj: R = serde_json::from_value(value)
        .map_err(|e| fail(vec![FieldError::new("", e.to_string())]))?;
    let mut errs = Vec::new();
    let name_check = if R::INFO.dotted_names {
        check_subdomain_name(&obj.meta().name)
    } else {
        check_label_name(&obj.meta().name)
    };
    if let Err(e) = name_check {
        errs.push(FieldError::new("metadata.name", e));
    }
    let meta = obj.meta();
    for (k, v) in &meta.labels {
        if let Err(e) = crate::name::check_key(k) {
            errs.push(FieldError::new("metadata.labels", e));
        }
        if let Err(e) = crate::name::check_label_value(v) {
            errs.push(FieldError::new(format!("metadata.labels.{k}"), e));
        }
    }
    for k in meta.annotations.keys() {
        if let Err(e) = crate::name::check_key(k) {
            errs.push(FieldError::new("metadata.annotations", e));
        }
    }
    if let Err(mut e) = obj.normalize() {
        errs.append(&mut e);
    }
    if !errs.is_empty() {
        return Err(fail(errs));
    }
    DynObject::from_typed(&obj).map_err(|e| fail(vec![FieldError::new("", e.to_string())]))
}

/// Validate an object of any kind and write its defaults: checks `apiVersion` and `kind`, the
/// kind's schema (unknown fields are errors), names, ranges. Returns the object as it would be
/// stored.
pub fn normalize(value: Value) -> Result<DynObject, ValidationError> {
    let name = value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let kind_raw = value
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let label = if name.is_empty() {
        format!("{} (unnamed)", crate::name::shown(&kind_raw))
    } else {
        format!(
            "{}/{}",
            crate::name::shown(&kind_raw),
            crate::name::shown(&name)
        )
    };
    let fail = |path: &str, message: String| ValidationError {
        object: label.clone(),
        errors: vec![FieldError::new(path, message)],
    };
    if !value.is_object() {
        return Err(fail(
            "",
            "a manifest must be a mapping with apiVersion, kind, metadata and spec".into(),
        ));
    }
    match value.get("apiVersion").and_then(Value::as_str) {
        Some(API_VERSION) => {}
        Some(other) => {
            return Err(fail(
                "apiVersion",
                format!(
                    "unknown apiVersion `{}`: use `{API_VERSION}`",
                    crate::name::shown(other)
                ),
            ));
        }
        None => {
            return Err(fail(
                "apiVersion",
                format!("apiVersion is required: use `{API_VERSION}`"),
            ));
        }
    }
    let known: Vec<&str> = KINDS.iter().map(|k| k.kind).collect();
    let Some(info) = KINDS.iter().find(|k| k.kind == kind_raw) else {
        let msg = if kind_raw.is_empty() {
            format!("kind is required: one of {}", known.join(", "))
        } else {
            format!(
                "unknown kind `{}`: use one of {}",
                crate::name::shown(&kind_raw),
                known.join(", ")
            )
        };
        return Err(fail("kind", msg));
    };
    let validator = &validators()[info.kind];
    let root = schema_ref(info.kind).expect("every kind has a schema");
    let errors: Vec<FieldError> = validator
        .iter_errors(&value)
        .map(|e| FieldError::new(dotted(e.instance_path().as_str()), explained(&e, root)))
        .collect();
    if !errors.is_empty() {
        return Err(ValidationError {
            object: label,
            errors,
        });
    }
    (info.typed.normalize)(value, &label)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(spec: Value) -> Value {
        json!({"apiVersion": API_VERSION, "kind": "Vm", "metadata": {"name": "dev1"}, "spec": spec})
    }

    #[test]
    fn nearest_suggests_close_words_only() {
        assert_eq!(nearest("cpu", &["cpus", "memory", "disk"]), Some("cpus"));
        assert_eq!(
            nearest("Memroy", &["cpus", "memory", "disk"]),
            Some("memory")
        );
        assert_eq!(nearest("network", &["cpus", "memory", "disk"]), None);
        // a long word (an agent's, say) gets no suggestion, nor a candidate of a length out
        // of reach
        let long = "cpus".repeat(1 << 18);
        assert_eq!(nearest(&long, &["cpus", "memory"]), None);
        assert_eq!(nearest(&"a".repeat(NEAREST_MAX + 1), &["a"]), None);
        assert_eq!(nearest("ab", &["abcdefgh"]), None);
    }

    #[test]
    fn defaults_are_written() {
        let o = normalize(vm(json!({"source": {"image": "debian-12"}}))).unwrap();
        assert_eq!(o.spec()["resources"]["cpus"], 1);
        assert_eq!(o.spec()["resources"]["memory"], "1Gi");
        assert_eq!(o.spec()["runStrategy"], "Running");
    }

    #[test]
    fn errors_name_the_field() {
        let e = normalize(vm(
            json!({"source": {"image": "debian-12"}, "resources": {"cpus": 0}}),
        ))
        .unwrap_err();
        assert_eq!(e.errors[0].path, "spec.resources.cpus", "{e}");
        let e = normalize(vm(json!({"source": {"image": "debian-12"}, "bogus": 1}))).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = normalize(vm(
            json!({"source": {"image": "x"}, "resources": {"memory": "-1Gi"}}),
        ))
        .unwrap_err();
        assert_eq!(e.errors[0].path, "spec.resources.memory", "{e}");
        let e = normalize(vm(
            json!({"source": {"image": "x"}, "resources": {"memory": "100Ti"}}),
        ))
        .unwrap_err();
        assert_eq!(e.errors[0].path, "spec.resources.memory", "{e}");
    }

    #[test]
    fn fields_nothing_implements_are_refused_by_name() {
        // Issue 34: a desktop is the desktop layer; headless: false on the base adds it, the
        // layer makes the VM not headless, and a desktop VM needs its memory.
        let v = normalize(vm(
            json!({"source": {"image": "debian-12"}, "headless": false, "resources": {"memory": "2Gi"}}),
        ))
        .unwrap();
        assert_eq!(v.rest["spec"]["layers"], json!(["desktop"]));
        assert_eq!(unimplemented(&v), vec![]);
        let v = normalize(vm(
            json!({"source": {"image": "debian-12"}, "layers": ["agents", "desktop"], "resources": {"memory": "1Gi"}}),
        ))
        .unwrap();
        assert_eq!(v.rest["spec"]["headless"], json!(false));
        let e = normalize(vm(
            json!({"source": {"image": "debian-12"}, "headless": false, "resources": {"memory": "512Mi"}}),
        ))
        .unwrap_err();
        assert_eq!(e.errors[0].path, "spec.resources.memory", "{e}");
        assert!(e.to_string().contains("at least 1024Mi"), "{e}");
        // its screen size: on a desktop only, within what X and the tools take
        let v = normalize(vm(
            json!({"source": {"image": "debian-12"}, "headless": false, "display": {"width": 1920, "height": 1080}}),
        ))
        .unwrap();
        assert_eq!(
            v.rest["spec"]["display"],
            json!({"width": 1920, "height": 1080})
        );
        for (spec, says) in [
            (
                json!({"source": {"image": "debian-12"}, "display": {"width": 1920, "height": 1080}}),
                "only a VM with a desktop",
            ),
            (
                json!({"source": {"image": "debian-12"}, "headless": false, "display": {"width": 100, "height": 1080}}),
                "640",
            ),
            (
                json!({"source": {"image": "debian-12"}, "headless": false, "display": {"width": 1920, "height": 9000}}),
                "4320",
            ),
            (
                json!({"source": {"image": "debian-12"}, "headless": false, "display": {"width": 1920}}),
                "height",
            ),
        ] {
            let e = normalize(vm(spec.clone())).unwrap_err();
            assert!(
                e.to_string().contains("spec.display") && e.to_string().contains(says),
                "{spec}: {e}"
            );
        }
        // a VM of another image has that image's desktop: headless: false is kept as said
        let v = normalize(vm(
            json!({"source": {"image": "dev1.snap"}, "headless": false}),
        ))
        .unwrap();
        assert_eq!(v.rest["spec"].get("layers"), None);
        let pool = normalize(
            json!({"apiVersion": API_VERSION, "kind": "Pool", "metadata": {"name": "p"},
                   "spec": {"template": {"spec": {"source": {"image": "tiny"}, "headless": false}}}}),
        )
        .unwrap();
        assert_eq!(unimplemented(&pool), vec![]);
        // Their defaults, and saying them explicitly, are fine.
        let fine = |v: Value| assert_eq!(unimplemented(&normalize(v).unwrap()), vec![]);
        fine(vm(
            json!({"source": {"image": "debian-12"}, "headless": true, "layers": []}),
        ));
        // Layers on a VM are built (issue 33).
        fine(vm(
            json!({"source": {"image": "debian-12"}, "layers": ["agents"]}),
        ));
        fine(
            json!({"apiVersion": API_VERSION, "kind": "Pool", "metadata": {"name": "p"},
                         "spec": {"lease": {"defaultTtlSeconds": 1800, "maxTtlSeconds": 600}}}),
        );
        // Grants are stored (issue 13): their reconciler waits for a person's approval.
        fine(
            json!({"apiVersion": API_VERSION, "kind": "Grant", "metadata": {"name": "g"},
                   "spec": {"vm": "dev1", "type": "env", "target": "TOKEN", "valueFrom": {"env": "TOKEN"}}}),
        );
    }

    /// Issue 33: an Image's layers are checked against the layer table and put in its order;
    /// a layer every base has, a base without layers, or an unknown name is refused by name.
    #[test]
    fn image_layers_are_known_ones_in_build_order() {
        let image = |base: &str, layers: Value| {
            normalize(
                json!({"apiVersion": API_VERSION, "kind": "Image", "metadata": {"name": "i"},
                             "spec": {"source": {"build": {"base": base, "layers": layers}}}}),
            )
        };
        let ok = image("debian-12", json!(["agents", "agents"])).unwrap();
        assert_eq!(
            ok.rest["spec"]["source"]["build"]["layers"],
            json!(["agents"])
        );
        assert_eq!(unimplemented(&ok), vec![]);
        for (base, layers, says) in [
            (
                "debian-12",
                json!(["desktopp"]),
                "no layer `desktopp`: the layers are agents",
            ),
            (
                "debian-12",
                json!(["devtools"]),
                "every debian-12 has `devtools` already",
            ),
            (
                "tiny",
                json!(["agents"]),
                "only debian-12 is built with layers",
            ),
        ] {
            let e = image(base, layers).unwrap_err();
            assert!(
                e.errors
                    .iter()
                    .any(|f| f.path == "spec.source.build.layers" && f.message.contains(says)),
                "{e}"
            );
        }
    }

    /// Issue 30: a pool asking for members from a template it does not have said Ready and
    /// Healthy with none. Refused as the unimplemented fields are (ratcheted by the store).
    #[test]
    fn a_pool_needs_a_template_for_its_replicas() {
        let pool = |spec: Value| {
            unimplemented(
                &normalize(json!({"apiVersion": API_VERSION, "kind": "Pool",
                                  "metadata": {"name": "p"}, "spec": spec}))
                .unwrap(),
            )
        };
        for spec in [
            json!({"replicas": 2}),
            json!({"replicas": 1, "members": [{"name": "pet"}]}),
        ] {
            let errors = pool(spec.clone());
            assert!(
                errors.iter().any(|f| f.path == "spec.replicas"
                    && f.message.contains("add spec.template")
                    && f.message.contains("spec.members")),
                "{spec}: {errors:?}"
            );
        }
        for spec in [
            json!({}),
            json!({"replicas": 0, "members": [{"name": "pet"}]}),
            json!({"replicas": 2, "template": {"spec": {"source": {"image": "tiny"}}}}),
        ] {
            assert_eq!(pool(spec.clone()), vec![], "{spec}");
        }
    }

    #[test]
    fn grants_are_checked_by_type() {
        let grant = |spec: Value| {
            normalize(json!({"apiVersion": API_VERSION, "kind": "Grant",
                             "metadata": {"name": "g"}, "spec": spec}))
        };
        let ok = |spec: Value| grant(spec.clone()).unwrap_or_else(|e| panic!("{spec}: {e}"));
        let bad = |spec: Value, path: &str| {
            let e = grant(spec.clone()).expect_err(&spec.to_string());
            assert!(e.errors.iter().any(|f| f.path == path), "{path}: {e}");
        };
        ok(json!({"vm": "a", "type": "llm", "target": "anthropic", "valueFrom": {"env": "K"}}));
        ok(
            json!({"lease": "l", "type": "http", "target": "api.example.com:8443",
                  "header": "Authorization", "valueFrom": {"file": "/etc/token"}}),
        );
        ok(json!({"vm": "a", "type": "github", "target": "me/my.repo",
                  "valueFrom": {"command": ["gh", "auth", "token"]}}));
        ok(
            json!({"vm": "a", "type": "file", "target": "aws/credentials", "valueFrom": {"file": "/x"}}),
        );
        ok(
            json!({"vm": "a", "type": "env", "target": "NPM_TOKEN", "valueFrom": {"env": "NPM_TOKEN"}}),
        );
        // Refused: a Grant of VM a for env X from env K, changed so (a merge patch: null
        // removes), with the field its error names.
        for (path, change) in [
            (
                "spec",
                json!({"vm": null, "type": "llm", "target": "anthropic"}),
            ),
            ("spec", json!({"lease": "l", "type": "llm", "target": "x"})),
            (
                "spec.target",
                json!({"type": "llm", "target": "Anthropic/.."}),
            ),
            ("spec.header", json!({"type": "http", "target": "a.com"})),
            (
                "spec.header",
                json!({"type": "llm", "target": "x", "header": "X"}),
            ),
            (
                "spec.target",
                json!({"type": "file", "target": "../etc/passwd"}),
            ),
            (
                "spec.target",
                json!({"type": "file", "target": "/etc/passwd"}),
            ),
            (
                "spec.target",
                json!({"type": "github", "target": "noslash"}),
            ),
            ("spec.target", json!({"target": "1X"})),
            ("spec.valueFrom", json!({"valueFrom": {"env": "A=B"}})),
            ("spec.valueFrom", json!({"valueFrom": {"file": "rel"}})),
            ("spec.valueFrom", json!({"valueFrom": {"command": []}})),
            ("spec.valueFrom", json!({"valueFrom": {"value": "sekrit"}})),
        ] {
            let mut spec =
                json!({"vm": "a", "type": "env", "target": "X", "valueFrom": {"env": "K"}});
            for (k, v) in change.as_object().expect("a mapping") {
                match v {
                    Value::Null => spec.as_object_mut().expect("a mapping").remove(k),
                    v => spec
                        .as_object_mut()
                        .expect("a mapping")
                        .insert(k.clone(), v.clone()),
                };
            }
            bad(spec, path);
        }
    }

    #[test]
    fn names() {
        for bad in [
            "",
            "../x",
            "Dev1",
            "-a",
            "a-",
            &"a".repeat(64),
            "a.b",
            "a b",
        ] {
            assert!(check_label_name(bad).is_err(), "{bad}");
        }
        for good in ["a", "dev-1", &"a".repeat(63)] {
            assert!(check_label_name(good).is_ok(), "{good}");
        }
        assert!(check_subdomain_name("dev1.before-upgrade").is_ok());
        assert!(check_subdomain_name("dev1..x").is_err());
        let e = normalize(json!({"apiVersion": API_VERSION, "kind": "Vm", "metadata": {"name": "../x"}, "spec": {"source": {"image": "a"}}})).unwrap_err();
        assert_eq!(e.errors[0].path, "metadata.name");
    }

    #[test]
    fn unknown_kind_and_version() {
        let e = normalize(json!({"apiVersion": "v1", "kind": "Vm"})).unwrap_err();
        assert_eq!(e.errors[0].path, "apiVersion");
        let e = normalize(json!({"apiVersion": API_VERSION, "kind": "Pod"})).unwrap_err();
        assert!(e.to_string().contains("unknown kind `Pod`"), "{e}");
    }

    #[test]
    fn every_schema_compiles_and_rejects_unknown_fields() {
        for k in KINDS {
            let s = schema_of(k.kind).unwrap();
            assert_eq!(s["additionalProperties"], json!(false), "{}", k.kind);
        }
        assert!(lookup_kind("img").is_some_and(|k| k.kind == "Image"));
        assert!(lookup_kind("VMS").is_some_and(|k| k.kind == "Vm"));
    }
}
