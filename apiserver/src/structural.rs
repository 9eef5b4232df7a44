//! The OpenAPI schemas served, made structural as Kubernetes requires of a CRD's (and as
//! `kubectl explain` needs to walk them): schemars writes a Rust enum as `oneOf` alternatives
//! (`{"oneOf": [{"properties": {"image": …}}, {"properties": {"url": …}}]}` for `source`, one
//! `{"const": "small"}` each for `shape`), which `kubectl explain vm.spec.source.image` cannot
//! enter. Here, from the same schemars schema (the one that validates every write), each such
//! node is rewritten:
//!
//! - alternatives that are all strings of fixed values: `type: string` and one `enum` of every
//!   value; each value's description joins the node's;
//! - alternatives that are objects: `type: object` with every alternative's `properties` at
//!   the top (an externally tagged variant's description goes to its property), and `oneOf`
//!   kept for validation only, as `required` lists (the structural rule); the description says
//!   which properties exclude each other, and a string value an enum also takes.
//!
//! Anything else is left as it is. Validation never reads this document: the store validates
//! with the schemars schema itself.

use serde_json::{Map, Value, json};

/// Make `v` (a schema, or a document of schemas) structural, bottom up.
pub fn make_structural(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (_, x) in m.iter_mut() {
                make_structural(x);
            }
            for key in ["oneOf", "anyOf"] {
                if let Some(Value::Array(alts)) = m.get(key)
                    && let Some(merged) = merge(alts)
                {
                    m.remove(key);
                    apply(m, merged);
                    break;
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(make_structural),
        _ => {}
    }
}

/// Put every enum of strings where it is used: a field that points at an enum component
/// (`{"allOf": [{"$ref": "…/RunStrategy"}]}`) gets its `type` and `enum` inline, as the
/// Kubernetes API's own schemas have them, which `kubectl explain` lists under `ENUM`.
pub fn inline_enums(schemas: &mut Map<String, Value>) {
    let enums: Map<String, Value> = schemas
        .iter()
        .filter(|(_, s)| s.get("type").is_some_and(|t| t == "string") && s.get("enum").is_some())
        .map(|(k, s)| (format!("#/components/schemas/{k}"), s.clone()))
        .collect();
    fn walk(v: &mut Value, enums: &Map<String, Value>) {
        match v {
            Value::Object(m) => {
                let target = match m.get("allOf").or_else(|| m.get("$ref")) {
                    Some(Value::Array(a)) if a.len() == 1 => {
                        a[0].get("$ref").and_then(Value::as_str)
                    }
                    Some(Value::String(r)) => Some(r.as_str()),
                    _ => None,
                };
                if let Some(e) = target.and_then(|r| enums.get(r)) {
                    m.remove("allOf");
                    m.remove("$ref");
                    for key in ["type", "enum"] {
                        m.insert(key.into(), e[key].clone());
                    }
                    if let Some(d) = e.get("description").and_then(Value::as_str) {
                        let own = m.get("description").and_then(Value::as_str).unwrap_or("");
                        let text = if own.is_empty() {
                            d.to_string()
                        } else {
                            format!("{own}\n\n{d}")
                        };
                        m.insert("description".into(), Value::String(text));
                    }
                }
                m.values_mut().for_each(|x| walk(x, enums));
            }
            Value::Array(a) => a.iter_mut().for_each(|x| walk(x, enums)),
            _ => {}
        }
    }
    for (_, s) in schemas.iter_mut() {
        walk(s, &enums);
    }
}

/// What a node's alternatives become.
struct Merged {
    ty: &'static str,
    values: Vec<Value>,
    properties: Map<String, Value>,
    required: Vec<Value>,
    notes: Vec<String>,
}

fn string_values(alt: &Value) -> Option<Vec<Value>> {
    let is_string = alt.get("type").is_none_or(|t| t == "string");
    let values = alt.get("enum")?.as_array()?;
    (is_string && values.iter().all(Value::is_string) && alt.get("properties").is_none())
        .then(|| values.clone())
}

fn merge(alts: &[Value]) -> Option<Merged> {
    if alts.is_empty() {
        return None;
    }
    let mut out = Merged {
        ty: "string",
        values: Vec::new(),
        properties: Map::new(),
        required: Vec::new(),
        notes: Vec::new(),
    };
    let mut objects = 0;
    for alt in alts {
        let about = alt.get("description").and_then(Value::as_str);
        if let Some(values) = string_values(alt) {
            if let Some(d) = about {
                let names: Vec<&str> = values.iter().filter_map(Value::as_str).collect();
                out.notes.push(format!("{}: {d}", names.join(", ")));
            }
            out.values.extend(values);
            continue;
        }
        let props = alt.get("properties").and_then(Value::as_object)?;
        if alt.get("type").is_some_and(|t| t != "object") {
            return None;
        }
        objects += 1;
        for (k, p) in props {
            let mut p = p.clone();
            // an externally tagged variant: its description is its one property's
            if props.len() == 1
                && let Some(d) = about
                && let Some(pm) = p.as_object_mut()
            {
                let own = pm.get("description").and_then(Value::as_str).unwrap_or("");
                let text = if own.is_empty() || own == d {
                    d.to_string()
                } else {
                    format!("{d}\n\n{own}")
                };
                pm.insert("description".into(), Value::String(text));
            }
            out.properties.entry(k.clone()).or_insert(p);
        }
        if let Some(r) = alt.get("required").and_then(Value::as_array)
            && !r.is_empty()
        {
            out.required.push(json!({"required": r}));
        }
    }
    if objects > 0 {
        out.ty = "object";
        let names: Vec<&str> = out.properties.keys().map(String::as_str).collect();
        if out.required.len() > 1 {
            out.notes
                .insert(0, format!("Exactly one of: {}.", names.join(", ")));
        }
        if !out.values.is_empty() {
            let vals: Vec<String> = out.values.iter().map(|v| v.to_string()).collect();
            out.notes.push(format!(
                "Or a string instead of an object: {}.",
                vals.join(", ")
            ));
        }
    }
    Some(out)
}

fn apply(m: &mut Map<String, Value>, merged: Merged) {
    m.insert("type".into(), Value::String(merged.ty.into()));
    if merged.ty == "string" {
        m.insert("enum".into(), Value::Array(merged.values));
    } else {
        m.remove("additionalProperties");
        m.insert("properties".into(), Value::Object(merged.properties));
        if merged.required.len() > 1 {
            m.insert("oneOf".into(), Value::Array(merged.required));
        } else if let Some(one) = merged.required.into_iter().next() {
            m.insert("required".into(), one["required"].clone());
        }
        if !merged.values.is_empty() {
            // a string too: not structural as one type, so kept as Kubernetes keeps such
            // fields (int-or-string is the only other one it has)
            m.insert(
                "x-kubernetes-preserve-unknown-fields".into(),
                Value::Bool(true),
            );
        }
    }
    if !merged.notes.is_empty() {
        let own = m.get("description").and_then(Value::as_str).unwrap_or("");
        let notes = merged.notes.join("\n");
        let text = if own.is_empty() {
            notes
        } else {
            format!("{own}\n\n{notes}")
        };
        m.insert("description".into(), Value::String(text));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_and_variants_become_structural() {
        let mut s = json!({
            "description": "Where the disk comes from.",
            "oneOf": [
                {"type": "object", "description": "An image.", "properties": {"image": {"type": "string"}}, "required": ["image"], "additionalProperties": false},
                {"type": "object", "description": "A pool.", "properties": {"pool": {"type": "string"}}, "required": ["pool"], "additionalProperties": false},
            ],
        });
        make_structural(&mut s);
        assert_eq!(s["type"], "object");
        assert_eq!(s["properties"]["image"]["description"], "An image.");
        assert_eq!(
            s["oneOf"],
            json!([{"required": ["image"]}, {"required": ["pool"]}])
        );
        assert!(
            s["description"]
                .as_str()
                .unwrap()
                .contains("Exactly one of: image, pool.")
        );
        let mut e = json!({"properties": {"shape": {"oneOf": [
            {"type": "string", "enum": ["small"], "description": "1 CPU"},
            {"type": "string", "enum": ["large"]},
        ]}}});
        make_structural(&mut e);
        assert_eq!(
            e["properties"]["shape"],
            json!({"type": "string", "enum": ["small", "large"], "description": "small: 1 CPU"})
        );
        // what cannot be merged stays
        let mut r = json!({"oneOf": [{"$ref": "#/x"}, {"$ref": "#/y"}]});
        make_structural(&mut r);
        assert!(r.get("oneOf").is_some());
    }
}
