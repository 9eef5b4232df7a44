//! Printing objects: tables with per-kind columns, YAML, JSON, names, JSONPath.

use std::io::Write;

use boxery_api::{DynObject, KindInfo};
use serde_json::Value;

use crate::exit::{CliError, CliResult};

/// How `get` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// The default table.
    Table,
    /// The table with more columns.
    Wide,
    /// YAML documents.
    Yaml,
    /// JSON (one object, or a List).
    Json,
    /// `kind/name` lines.
    Name,
    /// A JSONPath expression (`{.status.phase}`), per object.
    JsonPath(String),
}

impl std::str::FromStr for Format {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "" | "table" => Format::Table,
            "wide" => Format::Wide,
            "yaml" => Format::Yaml,
            "json" => Format::Json,
            "name" => Format::Name,
            _ => match s.strip_prefix("jsonpath=") {
                Some(expr) => Format::JsonPath(expr.to_string()),
                None => {
                    return Err(CliError::invalid(format!(
                        "unknown output format `{s}`: use wide, yaml, json, name or jsonpath=EXPR"
                    )));
                }
            },
        })
    }
}

/// Age of a timestamp, as kubectl prints it (`5s`, `3m`, `2h`, `4d`).
pub fn age(v: &Value) -> String {
    let Some(t) = v
        .as_str()
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
    else {
        return "<unknown>".into();
    };
    let secs = (chrono::Utc::now() - t.with_timezone(&chrono::Utc))
        .num_seconds()
        .max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "<none>".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn ptr<'a>(o: &'a Value, p: &str) -> &'a Value {
    o.pointer(p).unwrap_or(&Value::Null)
}

fn ready(o: &Value) -> String {
    let generation = ptr(o, "/metadata/generation").as_i64();
    let conds = ptr(o, "/status/conditions")
        .as_array()
        .cloned()
        .unwrap_or_default();
    conds
        .iter()
        .find(|c| c["type"] == "Ready")
        .map(|c| {
            let stale = generation.is_some() && c["observedGeneration"].as_i64() < generation;
            match (c["status"].as_str(), stale) {
                (Some("True"), false) => "True".to_string(),
                (Some(st), true) => format!("{st} (stale)"),
                (Some(st), false) => st.to_string(),
                _ => "Unknown".into(),
            }
        })
        .unwrap_or_else(|| "Unknown".into())
}

fn status_word(o: &Value) -> String {
    match ptr(o, "/status/printableStatus") {
        Value::String(s) => s.clone(),
        _ => match ptr(o, "/metadata/deletionTimestamp") {
            Value::Null => match ptr(o, "/status/phase") {
                Value::Null => "Pending".into(),
                v => s(v),
            },
            _ => "Terminating".into(),
        },
    }
}

fn source(o: &Value) -> String {
    match ptr(o, "/spec/source")
        .as_object()
        .and_then(|m| m.iter().next())
    {
        Some((k, v)) if v.is_string() => format!("{k}:{}", v.as_str().unwrap_or("")),
        Some((k, v)) => format!("{k}:{}", v.get("base").map(s).unwrap_or_default()),
        None => "<none>".into(),
    }
}

/// A printer column: its header and how to compute a cell.
pub type Column = (&'static str, fn(&Value) -> String);

/// Column headers and cells for a kind.
pub fn columns(kind: &str, wide: bool) -> Vec<Column> {
    let mut cols: Vec<Column> = vec![("NAME", |o| s(ptr(o, "/metadata/name")))];
    match kind {
        "Vm" => {
            cols.push(("STATUS", status_word));
            cols.push(("READY", ready));
            cols.push(("CPUS", |o| s(ptr(o, "/spec/resources/cpus"))));
            cols.push(("MEMORY", |o| s(ptr(o, "/spec/resources/memory"))));
            cols.push(("DISK", |o| s(ptr(o, "/spec/resources/disk"))));
            cols.push(("SOURCE", source));
            if wide {
                cols.push(("RUN", |o| s(ptr(o, "/spec/runStrategy"))));
                cols.push(("SSH", |o| s(ptr(o, "/status/ssh/endpoint"))));
                cols.push(("BACKEND", |o| s(ptr(o, "/status/backend"))));
                cols.push(("GEN", |o| {
                    format!(
                        "{}/{}",
                        s(ptr(o, "/status/observedGeneration")),
                        s(ptr(o, "/metadata/generation"))
                    )
                }));
            }
        }
        "Image" => {
            cols.push(("STATUS", status_word));
            cols.push(("SOURCE", source));
            cols.push(("SIZE", |o| match ptr(o, "/status/sizeBytes").as_u64() {
                Some(b) => boxery_api::Quantity::from_bytes(b.div_ceil(1 << 20) << 20).to_string(),
                None => "<none>".into(),
            }));
            if wide {
                cols.push(("BACKEND", |o| s(ptr(o, "/status/backend"))));
                cols.push(("OWNER", |o| s(ptr(o, "/metadata/ownerReferences/0/name"))));
            }
        }
        "Pool" => {
            cols.push(("REPLICAS", |o| s(ptr(o, "/spec/replicas"))));
            cols.push(("READY", |o| s(ptr(o, "/status/ready"))));
            cols.push(("FREE", |o| s(ptr(o, "/status/free"))));
            cols.push(("LEASED", |o| s(ptr(o, "/status/leased"))));
            cols.push(("BROKEN", |o| s(ptr(o, "/status/broken"))));
        }
        "Lease" => {
            cols.push(("POOL", |o| s(ptr(o, "/spec/pool"))));
            cols.push(("HOLDER", |o| s(ptr(o, "/spec/holderIdentity"))));
            cols.push(("STATUS", |o| s(ptr(o, "/status/phase"))));
            cols.push(("VM", |o| s(ptr(o, "/status/vm"))));
            cols.push(("EXPIRES", |o| s(ptr(o, "/status/expireTime"))));
        }
        "Grant" => {
            cols.push(("TYPE", |o| s(ptr(o, "/spec/type"))));
            cols.push(("TARGET", |o| s(ptr(o, "/spec/target"))));
            cols.push(("VM", |o| s(ptr(o, "/spec/vm"))));
            cols.push(("STATUS", |o| s(ptr(o, "/status/phase"))));
        }
        "Event" => {
            cols = vec![
                ("LAST SEEN", |o| age(ptr(o, "/lastTimestamp"))),
                ("TYPE", |o| s(ptr(o, "/type"))),
                ("REASON", |o| s(ptr(o, "/reason"))),
                ("OBJECT", |o| {
                    format!(
                        "{}/{}",
                        s(ptr(o, "/involvedObject/kind")).to_lowercase(),
                        s(ptr(o, "/involvedObject/name"))
                    )
                }),
                ("COUNT", |o| s(ptr(o, "/count"))),
                ("MESSAGE", |o| s(ptr(o, "/message"))),
            ];
            return cols;
        }
        _ => {}
    }
    cols.push(("AGE", |o| age(ptr(o, "/metadata/creationTimestamp"))));
    cols
}

/// A plain, aligned table (no borders, as kubectl prints).
pub fn table(kind: &str, objs: &[Value], wide: bool, headers: bool) -> String {
    let cols = columns(kind, wide);
    let mut rows: Vec<Vec<String>> = Vec::new();
    if headers {
        rows.push(cols.iter().map(|(h, _)| h.to_string()).collect());
    }
    for o in objs {
        rows.push(cols.iter().map(|(_, f)| f(o)).collect());
    }
    let mut widths = vec![0; cols.len()];
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let last = r.len() - 1;
        for (i, c) in r.iter().enumerate() {
            if i == last {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}   ", w = widths[i]));
            }
        }
        let trimmed = out.trim_end().len();
        out.truncate(trimmed);
        out.push('\n');
    }
    out
}

/// Evaluate a kubectl-style JSONPath (`{.status.phase}`, `{.metadata.name}{"\n"}`) on one object.
pub fn jsonpath(expr: &str, obj: &Value) -> CliResult<String> {
    let mut out = String::new();
    let mut rest = expr;
    while !rest.is_empty() {
        match rest.find('{') {
            None => {
                out.push_str(rest);
                break;
            }
            Some(i) => {
                out.push_str(&rest[..i]);
                let end = rest[i..].find('}').ok_or_else(|| {
                    CliError::invalid(format!("unclosed `{{` in jsonpath `{expr}`"))
                })?;
                let inner = rest[i + 1..i + end].trim();
                rest = &rest[i + end + 1..];
                if let Some(lit) = inner.strip_prefix('"').and_then(|l| l.strip_suffix('"')) {
                    out.push_str(&lit.replace("\\n", "\n").replace("\\t", "\t"));
                    continue;
                }
                let path = format!(
                    "${}",
                    if inner.starts_with('.') || inner.starts_with('[') {
                        inner.to_string()
                    } else {
                        format!(".{inner}")
                    }
                );
                let p = serde_json_path::JsonPath::parse(&path)
                    .map_err(|e| CliError::invalid(format!("invalid jsonpath `{inner}`: {e}")))?;
                let vals: Vec<String> = p
                    .query(obj)
                    .all()
                    .into_iter()
                    .map(|v| match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .collect();
                out.push_str(&vals.join(" "));
            }
        }
    }
    Ok(out)
}

/// The object as shown to users: keys in a stable order (apiVersion, kind, metadata, spec, status, rest).
pub fn display_value(o: &DynObject) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("apiVersion".into(), Value::String(o.api_version.clone()));
    m.insert("kind".into(), Value::String(o.kind.clone()));
    m.insert(
        "metadata".into(),
        serde_json::to_value(&o.metadata).unwrap_or(Value::Null),
    );
    for k in ["spec", "status"] {
        if let Some(v) = o.rest.get(k) {
            m.insert(k.into(), v.clone());
        }
    }
    for (k, v) in &o.rest {
        if k != "spec" && k != "status" {
            m.insert(k.clone(), v.clone());
        }
    }
    Value::Object(m)
}

/// YAML text of a value.
pub fn to_yaml(v: &Value) -> CliResult<String> {
    serde_saphyr::to_string(v).map_err(|e| CliError::failed(format!("cannot print YAML: {e}")))
}

/// Print objects of one kind in a format.
pub fn print(
    info: &KindInfo,
    objs: &[DynObject],
    format: &Format,
    out: &mut impl Write,
) -> CliResult {
    let values: Vec<Value> = objs.iter().map(display_value).collect();
    match format {
        Format::Table | Format::Wide => {
            if values.is_empty() {
                eprintln!("No {} found.", info.plural);
            } else {
                write!(
                    out,
                    "{}",
                    table(info.kind, &values, *format == Format::Wide, true)
                )?;
            }
        }
        Format::Yaml => {
            for (i, v) in values.iter().enumerate() {
                if i > 0 {
                    writeln!(out, "---")?;
                }
                write!(out, "{}", to_yaml(v)?)?;
            }
        }
        Format::Json => {
            let v = if values.len() == 1 {
                values[0].clone()
            } else {
                serde_json::json!({"apiVersion": boxery_api::API_VERSION, "kind": "List", "items": values})
            };
            writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        }
        Format::Name => {
            for v in &values {
                writeln!(out, "{}/{}", info.singular, s(ptr(v, "/metadata/name")))?;
            }
        }
        Format::JsonPath(expr) => {
            for v in &values {
                write!(out, "{}", jsonpath(expr, v)?)?;
            }
            if !expr.contains("\\n") {
                writeln!(out)?;
            }
        }
    }
    Ok(())
}
