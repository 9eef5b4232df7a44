//! `explain KIND[.field…] [--recursive]`, as kubectl's: the field's type in kubectl's words
//! (`<string>`, `<integer>`, `<Object>`, `<[]Object>`, `<map[string]string>`), its whole
//! description, the values an enum takes, and the fields below it (every level with
//! `--recursive`). Read from the kinds' JSON Schemas (schemars), following `$ref`, the
//! `anyOf [T, null]` of optional fields, list items, and the variants of a `oneOf` (a Vm's
//! `source` is `image` or `vm`: both are fields of it).

use serde_json::Value;

use boxery_api::name::shown;

use crate::commands::kind;
use crate::exit::{CliError, CliResult};
use crate::out::out;

/// How deep `--recursive` goes (the schemas are not recursive, but a bound costs nothing).
const MAX_DEPTH: usize = 12;

/// `explain PATH [--recursive]`.
pub fn explain(path: &str, recursive: bool) -> CliResult {
    let mut parts = path.split('.');
    let info = kind(parts.next().unwrap_or(""))?;
    let root = boxery_api::validate::schema_of(info.kind).expect("every kind has a schema");
    let mut node = root.clone();
    let mut walked = vec![info.kind.to_string()];
    for p in parts {
        let fields = fields_of(&root, &node);
        let Some((_, next)) = fields.iter().find(|(k, _)| k == p) else {
            let names: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
            let hint = boxery_api::validate::nearest(p, &names)
                .map(|m| format!(": did you mean `{m}`?"))
                .unwrap_or_default();
            return Err(CliError::not_found(format!(
                "{} has no field `{}`{hint}{}",
                walked.join("."),
                shown(p),
                if names.is_empty() {
                    String::new()
                } else {
                    format!(" (its fields: {})", names.join(", "))
                }
            )));
        };
        node = next.clone();
        walked.push(p.to_string());
    }
    let mut out = format!(
        "KIND:     {}\nVERSION:  {}\n\nFIELD:    {} <{}>\n\nDESCRIPTION:\n",
        info.kind,
        boxery_api::API_VERSION,
        walked.join("."),
        type_name(&root, &node)
    );
    let desc = description(&root, &node).unwrap_or_else(|| info.description.to_string());
    push_text(&mut out, &desc, 5);
    let values = values_of(&root, &node);
    if !values.is_empty() {
        out.push_str("\nVALUES:\n");
        for v in &values {
            push_text(&mut out, v, 3);
        }
    }
    let fields = fields_of(&root, &node);
    if !fields.is_empty() {
        let required = required_of(&root, &node);
        out.push_str("\nFIELDS:\n");
        if recursive {
            tree(&root, &fields, &required, 1, &mut out);
        } else {
            for (k, v) in &fields {
                let req = if required.contains(k) {
                    " -required-"
                } else {
                    ""
                };
                out.push_str(&format!("   {k}\t<{}>{req}\n", type_name(&root, v)));
                if let Some(d) = description(&root, v) {
                    push_text(&mut out, &d, 5);
                }
                out.push('\n');
            }
        }
    }
    out!("{out}");
    Ok(())
}

/// `--recursive`: names and types, every level, indented.
fn tree(
    root: &Value,
    fields: &[(String, Value)],
    required: &[String],
    depth: usize,
    out: &mut String,
) {
    for (k, v) in fields {
        let req = if required.contains(k) {
            " -required-"
        } else {
            ""
        };
        let pad = "  ".repeat(depth);
        out.push_str(&format!("{pad} {k}\t<{}>{req}\n", type_name(root, v)));
        let below = fields_of(root, v);
        if !below.is_empty() && depth < MAX_DEPTH {
            tree(root, &below, &required_of(root, v), depth + 1, out);
        }
    }
}

/// Text, every line indented by `pad` (descriptions are never cut).
fn push_text(out: &mut String, text: &str, pad: usize) {
    for l in text.lines() {
        out.push_str(&format!("{}{l}\n", " ".repeat(pad)));
    }
}

/// `node` with `$ref`, `allOf [X]` and an optional field's `anyOf/oneOf [X, null]` followed.
fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    let mut cur = node;
    for _ in 0..16 {
        let next = if let Some(r) = cur.get("$ref").and_then(Value::as_str) {
            r.strip_prefix('#').and_then(|p| root.pointer(p))
        } else if let Some([one]) = cur
            .get("allOf")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
        {
            Some(one)
        } else {
            ["anyOf", "oneOf"].iter().find_map(|k| {
                let alts = cur.get(*k)?.as_array()?;
                let real: Vec<&Value> = alts.iter().filter(|a| !is_null(a)).collect();
                (alts.len() == 2 && real.len() == 1).then(|| real[0])
            })
        };
        match next {
            Some(n) => cur = n,
            None => break,
        }
    }
    cur
}

fn is_null(v: &Value) -> bool {
    v.get("type") == Some(&Value::from("null"))
}

/// The node's type without `null` (an optional field's `["integer", "null"]` is an integer).
fn json_type(node: &Value) -> Option<String> {
    match node.get("type")? {
        Value::String(t) => Some(t.clone()),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .map(str::to_string),
        _ => None,
    }
}

/// The type in kubectl's words.
fn type_name(root: &Value, node: &Value) -> String {
    let r = resolve(root, node);
    if !values_of(root, node).is_empty() {
        return "string".into();
    }
    match json_type(r).as_deref() {
        Some("array") => {
            let item = r.get("items").map_or_else(
                || "Object".into(),
                |i| {
                    let t = type_name(root, i);
                    if t == "Object" { t } else { t.to_lowercase() }
                },
            );
            format!("[]{item}")
        }
        Some("object") | None => match r.get("additionalProperties") {
            Some(ap) if ap.is_object() && !fields_present(root, r) => {
                format!("map[string]{}", type_name(root, ap))
            }
            _ => "Object".into(),
        },
        Some(t) => t.to_string(),
    }
}

fn fields_present(root: &Value, node: &Value) -> bool {
    !fields_of(root, node).is_empty()
}

/// The fields below `node`: its properties (of its list items, for a list), and those of each
/// variant of a `oneOf`/`anyOf` (in order, once each).
fn fields_of(root: &Value, node: &Value) -> Vec<(String, Value)> {
    let mut r = resolve(root, node);
    if json_type(r).as_deref() == Some("array")
        && let Some(items) = r.get("items")
    {
        r = resolve(root, items);
    }
    let mut out: Vec<(String, Value)> = Vec::new();
    let mut add = |m: &serde_json::Map<String, Value>| {
        for (k, v) in m {
            if !out.iter().any(|(n, _)| n == k) {
                out.push((k.clone(), v.clone()));
            }
        }
    };
    if let Some(m) = r.get("properties").and_then(Value::as_object) {
        add(m);
    }
    for key in ["oneOf", "anyOf"] {
        for alt in r.get(key).and_then(Value::as_array).into_iter().flatten() {
            let alt = resolve(root, alt);
            if let Some(m) = alt.get("properties").and_then(Value::as_object) {
                // a variant's one field, without a description of its own, is described by
                // the variant (`source.image`: "An `Image` by name …")
                let mut m = m.clone();
                if let Some(d) = alt.get("description")
                    && m.len() == 1
                {
                    for v in m.values_mut() {
                        if v.get("description").is_none()
                            && let Some(o) = v.as_object_mut()
                        {
                            o.insert("description".into(), d.clone());
                        }
                    }
                }
                add(&m);
            }
        }
    }
    out
}

/// The fields `node` requires.
fn required_of(root: &Value, node: &Value) -> Vec<String> {
    let r = resolve(root, node);
    r.get("required")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The field's own description, else its type's.
fn description(root: &Value, node: &Value) -> Option<String> {
    node.get("description")
        .or_else(|| resolve(root, node).get("description"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// An enum's values, each with its description when it has one (`Running: …`).
fn values_of(root: &Value, node: &Value) -> Vec<String> {
    let r = resolve(root, node);
    let mut out: Vec<String> = r
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect();
    let alts: Vec<&Value> = ["oneOf", "anyOf"]
        .iter()
        .filter_map(|k| r.get(*k).and_then(Value::as_array))
        .flatten()
        .map(|a| resolve(root, a))
        .collect();
    let all_constants = !alts.is_empty()
        && alts
            .iter()
            .all(|a| a.get("const").is_some() || a.get("enum").is_some() || is_null(a));
    if all_constants {
        for alt in alts {
            let d = alt.get("description").and_then(Value::as_str).unwrap_or("");
            let consts = alt.get("const").into_iter().chain(
                alt.get("enum")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten(),
            );
            for c in consts.filter_map(Value::as_str) {
                out.push(if d.is_empty() {
                    c.to_string()
                } else {
                    format!("{c}: {d}")
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn types_read_as_kubectl_writes_them() {
        let root = json!({"$defs": {
            "Cond": {"type": "object", "properties": {"type": {"type": "string"}}},
            "Mode": {"oneOf": [{"const": "A"}, {"const": "B", "description": "bee"}]}
        }});
        let t = |v: Value| type_name(&root, &v);
        assert_eq!(t(json!({"type": ["integer", "null"]})), "integer");
        assert_eq!(
            t(json!({"type": "array", "items": {"$ref": "#/$defs/Cond"}})),
            "[]Object"
        );
        assert_eq!(
            t(json!({"type": "array", "items": {"type": "string"}})),
            "[]string"
        );
        assert_eq!(
            t(json!({"type": "object", "additionalProperties": {"type": "string"}})),
            "map[string]string"
        );
        assert_eq!(
            t(json!({"anyOf": [{"$ref": "#/$defs/Cond"}, {"type": "null"}]})),
            "Object"
        );
        assert_eq!(t(json!({"$ref": "#/$defs/Mode"})), "string");
        assert_eq!(
            values_of(&root, &json!({"$ref": "#/$defs/Mode"})),
            ["A", "B: bee"]
        );
        let cond = json!({"type": "array", "items": {"$ref": "#/$defs/Cond"}});
        assert_eq!(
            fields_of(&root, &cond)[0].0,
            "type",
            "a list's fields are its items'"
        );
    }
}
