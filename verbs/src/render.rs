//! Printing objects: tables with per-kind columns, YAML, JSON, names, JSONPath.
//!
//! Guarantees: what is printed for a person (table cells, `-o name`, `-o jsonpath` on a
//! terminal, `describe` and `events`) goes through [`safe`], so an object an agent wrote cannot
//! send escape sequences to the terminal of whoever lists it. `-o json` and `-o yaml` are
//! machine output and stay exact (both emitters escape C0 control characters themselves;
//! tested). `-o jsonpath` piped to a program prints values as they are, for scripts.

use std::io::{IsTerminal, Write};

use boxery_api::columns::{Cell, Column, at as ptr, text as s};
pub use boxery_api::name::safe;
use boxery_api::name::shown;
use boxery_api::{DynObject, KindInfo};
use serde_json::Value;

use crate::error::{Result, VerbError};

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
    /// kubectl's `custom-columns=HEADER:JSONPATH,…`: a table of these columns.
    CustomColumns(Vec<(String, String)>),
}

impl Format {
    /// Whether it prints a table (a row per object).
    pub fn is_table(&self) -> bool {
        matches!(
            self,
            Format::Table | Format::Wide | Format::CustomColumns(_)
        )
    }
}

impl std::str::FromStr for Format {
    type Err = VerbError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "" | "table" => Format::Table,
            "wide" => Format::Wide,
            "yaml" => Format::Yaml,
            "json" => Format::Json,
            "name" => Format::Name,
            _ => match (
                s.strip_prefix("jsonpath="),
                s.strip_prefix("custom-columns="),
            ) {
                (Some(expr), _) => {
                    // checked now: an unsupported template fails before anything is printed
                    check_jsonpath(expr)?;
                    Format::JsonPath(expr.to_string())
                }
                (_, Some(spec)) => Format::CustomColumns(custom_columns(spec)?),
                _ => {
                    return Err(VerbError::invalid(format!(
                        "unknown output format `{}`: use wide, yaml, json, name, jsonpath=EXPR or custom-columns=HEADER:JSONPATH,…",
                        shown(s)
                    )));
                }
            },
        })
    }
}

/// `custom-columns=NAME:.metadata.name,CPUS:.spec.resources.cpus` (the paths with or without
/// braces, as kubectl takes them).
fn custom_columns(spec: &str) -> Result<Vec<(String, String)>> {
    let bad = || {
        VerbError::invalid(format!(
            "custom-columns=`{}`: give HEADER:JSONPATH pairs separated by commas, e.g. custom-columns=NAME:.metadata.name,CPUS:.spec.resources.cpus",
            shown(spec)
        ))
    };
    let mut out = Vec::new();
    for col in spec.split(',') {
        let (h, p) = col.split_once(':').ok_or_else(bad)?;
        if h.is_empty() || p.is_empty() {
            return Err(bad());
        }
        let path = if p.starts_with('{') {
            p.to_string()
        } else {
            format!("{{{p}}}")
        };
        // checked now: a bad path fails before anything is printed
        jsonpath(&path, &Value::Null)?;
        out.push((h.to_string(), path));
    }
    Ok(out)
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

/// The cell of [`Cell::Ready`].
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
            // Computed for an older spec, or on a boot before the host's last reboot.
            let stale = (generation.is_some() && c["observedGeneration"].as_i64() < generation)
                || ptr(o, "/status/bootId")
                    .as_str()
                    .is_some_and(|b| b != boxery_store::boot_id());
            match (c["status"].as_str(), stale) {
                (Some("True"), false) => "True".to_string(),
                (Some(st), true) => format!("{st} (stale)"),
                (Some(st), false) => st.to_string(),
                _ => "Unknown".into(),
            }
        })
        .unwrap_or_else(|| "Unknown".into())
}

/// A column's cell for one object (as [`display_value`] shows it), not yet made [`safe`].
pub fn cell(column: &Column, o: &Value) -> String {
    match column.cell {
        Cell::Field(p) => s(ptr(o, p)),
        Cell::FieldOr(p, or) => ptr(o, p).as_str().unwrap_or(or).to_string(),
        Cell::Age(p) => age(ptr(o, p)),
        Cell::Ready => ready(o),
        Cell::Computed(paths, f) => {
            let values: Vec<&Value> = paths.iter().map(|p| ptr(o, p)).collect();
            f(&values)
        }
    }
}

/// The columns of kind `kind` ([`boxery_api::KindInfo::columns`]), the `-o wide` ones with
/// `wide`; NAME and AGE for a kind boxery does not know.
pub fn columns(kind: &str, wide: bool) -> Vec<&'static Column> {
    boxery_api::KINDS
        .iter()
        .find(|k| k.kind == kind)
        .map_or(boxery_api::columns::DEFAULT, |k| k.columns)
        .iter()
        .filter(|c| wide || !c.wide)
        .collect()
}

/// A plain, aligned table (no borders, as kubectl prints).
pub fn table(kind: &str, objs: &[Value], wide: bool, headers: bool) -> String {
    table_with(
        kind,
        objs,
        &TableOptions {
            wide,
            headers,
            ..TableOptions::default()
        },
    )
}

/// How `get` draws a table (kubectl's flags).
#[derive(Debug, Clone, Default)]
pub struct TableOptions {
    /// `-o wide`.
    pub wide: bool,
    /// Not `--no-headers`.
    pub headers: bool,
    /// `--show-labels`: a LABELS column (`k=v,…`).
    pub show_labels: bool,
    /// `-L KEY`: a column per label key, headed by the key in capitals.
    pub label_columns: Vec<String>,
    /// `-o custom-columns=…`: these columns (header, JSONPath) instead of the kind's.
    pub custom: Option<Vec<(String, String)>>,
}

/// [`table`] with kubectl's table flags.
pub fn table_with(kind: &str, objs: &[Value], o: &TableOptions) -> String {
    aligned(rows(kind, objs, o))
}

/// The cells of [`table_with`] (the header row first, unless `--no-headers`), for a caller that
/// aligns them itself (`get -w` keeps its columns where the first rows put them).
pub fn rows(kind: &str, objs: &[Value], o: &TableOptions) -> Vec<Vec<String>> {
    if let Some(custom) = &o.custom {
        let mut rows: Vec<Vec<String>> = Vec::new();
        if o.headers {
            rows.push(custom.iter().map(|(h, _)| safe(h).into_owned()).collect());
        }
        for v in objs {
            rows.push(
                custom
                    .iter()
                    .map(|(_, p)| match jsonpath(p, v) {
                        Ok(t) if !t.is_empty() => safe(&t).into_owned(),
                        _ => "<none>".to_string(),
                    })
                    .collect(),
            );
        }
        return rows;
    }
    let cols = columns(kind, o.wide);
    let mut rows: Vec<Vec<String>> = Vec::new();
    if o.headers {
        let mut head: Vec<String> = cols.iter().map(|c| c.name.to_string()).collect();
        head.extend(
            o.label_columns
                .iter()
                .map(|k| safe(&k.to_uppercase()).into_owned()),
        );
        if o.show_labels {
            head.push("LABELS".into());
        }
        rows.push(head);
    }
    for v in objs {
        // the edge: every cell, whatever column computed it, is made safe here
        let mut row: Vec<String> = cols
            .iter()
            .map(|c| safe(&cell(c, v)).into_owned())
            .collect();
        let labels = v["metadata"]["labels"].as_object();
        for k in &o.label_columns {
            let cell = labels
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
                .unwrap_or("");
            row.push(safe(cell).into_owned());
        }
        if o.show_labels {
            let all: Vec<String> = labels
                .map(|l| {
                    l.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                        .collect()
                })
                .unwrap_or_default();
            row.push(if all.is_empty() {
                "<none>".into()
            } else {
                safe(&all.join(",")).into_owned()
            });
        }
        rows.push(row);
    }
    rows
}

/// Sort objects by the value of a kubectl-style JSONPath (`{.metadata.creationTimestamp}`, or
/// `.spec.resources.cpus`), numbers as numbers, as `kubectl get --sort-by` does.
pub fn sort_by(objs: &mut [DynObject], path: &str) -> Result {
    let path = if path.starts_with('{') {
        path.to_string()
    } else {
        format!("{{{path}}}")
    };
    let mut keyed: Vec<(String, DynObject)> = Vec::with_capacity(objs.len());
    for o in objs.iter() {
        let v = serde_json::to_value(o)?;
        keyed.push((jsonpath(&path, &v)?, o.clone()));
    }
    keyed.sort_by(
        |(a, _), (b, _)| match (a.parse::<f64>(), b.parse::<f64>()) {
            (Ok(x), Ok(y)) => x.total_cmp(&y),
            _ => a.cmp(b),
        },
    );
    for (slot, (_, o)) in objs.iter_mut().zip(keyed) {
        *slot = o;
    }
    Ok(())
}

/// Rows of cells as a plain table: columns padded to their widest cell, three spaces apart,
/// no trailing blanks (as kubectl prints).
pub fn aligned(rows: Vec<Vec<String>>) -> String {
    aligned_to(rows, &mut Vec::new())
}

/// [`aligned`], with columns at least `widths` wide; `widths` grows to what these rows need
/// (a watch passes the same `widths` for every row it prints, so its columns stay put).
pub fn aligned_to(rows: Vec<Vec<String>>, widths: &mut Vec<usize>) -> String {
    let cols = rows.first().map_or(0, Vec::len);
    if widths.len() < cols {
        widths.resize(cols, 0);
    }
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
/// Values are exact (for `wait --for=jsonpath` and scripts).
pub fn jsonpath(expr: &str, obj: &Value) -> Result<String> {
    jsonpath_with(expr, obj, false)
}

/// [`jsonpath`], with the values (not the expression's literals) made [`safe`] when `escape`.
fn jsonpath_with(expr: &str, obj: &Value, escape: bool) -> Result<String> {
    let template = Template::parse(expr)?;
    let mut out = String::new();
    template.eval(obj, escape, &mut out);
    Ok(out)
}

/// Check a kubectl JSONPath template without evaluating it: what `-o jsonpath=` does before
/// anything is printed, so an unsupported template fails (exit 2) and never prints half.
pub fn check_jsonpath(expr: &str) -> Result {
    Template::parse(expr).map(|_| ())
}

/// A kubectl JSONPath template (`kubectl get -o jsonpath=…`, as kubectl's
/// `k8s.io/client-go/util/jsonpath` reads it): text, `{PATH}`, `{"literal"}` (with `\n`, `\t`,
/// `\r`, `\\`, `\"`), and `{range PATH}…{end}` (nested too), whose paths inside are relative
/// to each item (`{.metadata.name}`, `{@.metadata.name}`; `{$.…}` is the root). Paths are
/// RFC 9535 (serde_json_path) with kubectl's spellings: `$` optional, filters
/// `[?(@.a=="b")]`, field names with `-` or `/` (`.metadata.labels.app-name`), `\.` for a dot
/// in a name (`.metadata.labels.boxery\.dev/pool`). Anything else is an error naming it
/// (never a partial or garbled output).
#[derive(Debug, Clone)]
struct Template(Vec<Piece>);

#[derive(Debug, Clone)]
enum Piece {
    /// Printed as it is (text outside braces, or a quoted literal).
    Text(String),
    /// Every value of the path, joined by spaces; from the root or from the current item.
    Path(Query),
    /// The body once per value of the path.
    Range(Query, Vec<Piece>),
}

#[derive(Debug, Clone)]
struct Query {
    from_root: bool,
    path: serde_json_path::JsonPath,
}

/// How deep `{range}`s may nest.
const MAX_RANGE_DEPTH: usize = 16;

impl Template {
    fn parse(expr: &str) -> Result<Template> {
        let bad = |what: String| {
            VerbError::invalid(format!(
                "jsonpath `{}`: {what} (supported: text, {{PATH}}, {{\"literal\"}} with \\n \\t, {{range PATH}}…{{end}}, filters [?(@.a==\"b\")])",
                shown(expr)
            ))
        };
        // The pieces of each open `{range}` (the outermost first), and their paths.
        let mut stack: Vec<(Option<Query>, Vec<Piece>)> = vec![(None, Vec::new())];
        let mut rest = expr;
        while !rest.is_empty() {
            let Some(i) = rest.find('{') else {
                push_text(&mut stack, rest);
                break;
            };
            push_text(&mut stack, &rest[..i]);
            let end = closing_brace(&rest[i + 1..]).ok_or_else(|| bad("an unclosed `{`".into()))?;
            let inner = rest[i + 1..i + 1 + end].trim();
            rest = &rest[i + 1 + end + 1..];
            let word = inner
                .split(|c: char| c.is_whitespace())
                .next()
                .unwrap_or_default();
            if inner.is_empty() {
                return Err(bad("an empty `{}`".into()));
            } else if inner.starts_with('"') || inner.starts_with('\'') {
                let lit = unquote(inner).map_err(bad)?;
                push_text(&mut stack, &lit);
            } else if inner == "end" {
                if stack.len() == 1 {
                    return Err(bad("`{end}` without a `{range …}`".into()));
                }
                let (q, body) = stack.pop().expect("an open range");
                let q = q.expect("a range has a path");
                stack
                    .last_mut()
                    .expect("the top")
                    .1
                    .push(Piece::Range(q, body));
            } else if word == "range" {
                let path = inner["range".len()..].trim();
                if path.is_empty() {
                    return Err(bad("`{range}` needs a path, e.g. {range .items[*]}".into()));
                }
                if stack.len() > MAX_RANGE_DEPTH {
                    return Err(bad(format!(
                        "more than {MAX_RANGE_DEPTH} nested `{{range}}`s"
                    )));
                }
                stack.push((Some(query(path).map_err(bad)?), Vec::new()));
            } else if word.len() < inner.len()
                && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                // `{if …}`, `{else}`-like words: not kubectl's template language.
                return Err(bad(format!("`{{{}…}}` is not supported", shown(word))));
            } else {
                let q = query(inner).map_err(bad)?;
                stack.last_mut().expect("the top").1.push(Piece::Path(q));
            }
        }
        if stack.len() > 1 {
            return Err(bad("a `{range …}` without its `{end}`".into()));
        }
        Ok(Template(stack.pop().expect("the top").1))
    }

    fn eval(&self, root: &Value, escape: bool, out: &mut String) {
        eval(&self.0, root, root, escape, out);
    }
}

fn push_text(stack: &mut [(Option<Query>, Vec<Piece>)], text: &str) {
    if text.is_empty() {
        return;
    }
    let body = &mut stack.last_mut().expect("the top").1;
    if let Some(Piece::Text(t)) = body.last_mut() {
        t.push_str(text);
    } else {
        body.push(Piece::Text(text.to_string()));
    }
}

/// Where the `}` that closes an action is in `text` (after its `{`): the first one outside
/// quotes (a filter's string may hold a `}`).
fn closing_brace(text: &str) -> Option<usize> {
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match quote {
            Some(_) if escaped => escaped = false,
            Some(_) if c == '\\' => escaped = true,
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '}' => return Some(i),
            None => {}
        }
    }
    None
}

/// A quoted literal, `"…"` or `'…'`, with its escapes.
fn unquote(inner: &str) -> std::result::Result<String, String> {
    let q = inner.chars().next().unwrap_or('"');
    let body = inner
        .strip_prefix(q)
        .and_then(|b| b.strip_suffix(q))
        .filter(|_| inner.len() >= 2)
        .ok_or_else(|| format!("the literal `{}` is not closed", shown(inner)))?;
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c == q {
            return Err(format!(
                "the literal `{}` holds an unescaped {q}",
                shown(inner)
            ));
        }
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('\\') => out.push('\\'),
            Some(c @ ('"' | '\'')) => out.push(c),
            Some(c) => {
                return Err(format!(
                    "the escape `\\{}` in a literal is not supported (\\n \\t \\r \\\\ \\\" are)",
                    shown(&c.to_string())
                ));
            }
            None => return Err(format!("the literal `{}` ends in `\\`", shown(inner))),
        }
    }
    Ok(out)
}

/// A path as kubectl writes it, made RFC 9535 (`$` first; `@` for the current item; field
/// names that are not plain identifiers, or hold `\.`, bracketed).
fn query(text: &str) -> std::result::Result<Query, String> {
    let (from_root, rest) = if let Some(r) = text.strip_prefix('$') {
        (true, r)
    } else if let Some(r) = text.strip_prefix('@') {
        (false, r)
    } else {
        (false, text)
    };
    let mut path = String::from("$");
    if !(rest.is_empty() || rest.starts_with('.') || rest.starts_with('[')) {
        path.push('.');
    }
    let chars: Vec<char> = rest.chars().collect();
    let mut i = 0;
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        if let Some(q) = quote {
            path.push(c);
            if c == '\\' && i + 1 < chars.len() {
                path.push(chars[i + 1]);
                i += 1;
            } else if c == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match c {
            '"' | '\'' if depth > 0 => {
                quote = Some(c);
                path.push(c);
                i += 1;
            }
            '[' | '(' => {
                depth += 1;
                path.push(c);
                i += 1;
            }
            ']' | ')' => {
                depth = depth.saturating_sub(1);
                path.push(c);
                i += 1;
            }
            '.' if depth == 0 => {
                let mut dots = ".";
                i += 1;
                if chars.get(i) == Some(&'.') {
                    dots = "..";
                    i += 1;
                }
                let mut name = String::new();
                while i < chars.len() && chars[i] != '.' && chars[i] != '[' {
                    if chars[i] == '\\' && chars.get(i + 1) == Some(&'.') {
                        name.push('.');
                        i += 2;
                    } else {
                        name.push(chars[i]);
                        i += 1;
                    }
                }
                path.push_str(dots);
                let plain = name == "*"
                    || name
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_alphabetic() || c == '_')
                        && name.chars().all(|c| c.is_alphanumeric() || c == '_');
                if name.is_empty() || plain {
                    path.push_str(&name);
                } else {
                    if dots == "." {
                        path.pop();
                    }
                    path.push_str(&format!(
                        "[{}]",
                        serde_json::to_string(&name).unwrap_or_default()
                    ));
                }
            }
            _ => {
                path.push(c);
                i += 1;
            }
        }
    }
    let parsed = serde_json_path::JsonPath::parse(&path).map_err(|e| {
        format!(
            "the path `{}` is not supported: {}",
            shown(text),
            safe(&e.to_string())
        )
    })?;
    Ok(Query {
        from_root,
        path: parsed,
    })
}

fn eval(pieces: &[Piece], root: &Value, current: &Value, escape: bool, out: &mut String) {
    let show = |v: &Value| {
        let text = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if escape {
            safe(&text).into_owned()
        } else {
            text
        }
    };
    for p in pieces {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Path(q) => {
                let on = if q.from_root { root } else { current };
                let vals: Vec<String> = q.path.query(on).all().into_iter().map(show).collect();
                out.push_str(&vals.join(" "));
            }
            Piece::Range(q, body) => {
                let on = if q.from_root { root } else { current };
                for v in q.path.query(on).all() {
                    eval(body, root, v, escape, out);
                }
            }
        }
    }
}

/// The object as shown to users: keys in a stable order (apiVersion, kind, metadata, spec, status, rest).
pub fn display_value(o: &DynObject) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("apiVersion".into(), Value::String(o.api_version.clone()));
    m.insert("kind".into(), Value::String(o.kind.clone()));
    // managedFields are bookkeeping, hidden as kubectl hides them; `describe` lists them.
    let mut meta = serde_json::to_value(&o.metadata).unwrap_or(Value::Null);
    if let Some(meta) = meta.as_object_mut() {
        meta.remove("managedFields");
    }
    m.insert("metadata".into(), meta);
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
pub fn to_yaml(v: &Value) -> Result<String> {
    serde_saphyr::to_string(v).map_err(|e| VerbError::failed(format!("cannot print YAML: {e}")))
}

/// What [`print`] did besides writing: a table of no objects writes nothing and has a note
/// for the reader (`No vms found.`), which the CLI prints to stderr, as kubectl does. Verbs
/// never print.
#[must_use = "a table of no rows has a note for the reader: print `Printed::note`"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Printed {
    /// The objects were written.
    Written,
    /// A table of none: nothing was written, and this says so.
    NoneFound(String),
}

impl Printed {
    /// The note for the reader, if there is one.
    pub fn note(&self) -> Option<&str> {
        match self {
            Printed::Written => None,
            Printed::NoneFound(note) => Some(note),
        }
    }
}

/// Print objects of one kind in a format, to stdout or anything else (`-o jsonpath` escapes
/// values when stdout is a terminal): each object on its own (`-o jsonpath` applies to each;
/// `-o json` of several is a List).
pub fn print(
    info: &KindInfo,
    objs: &[DynObject],
    format: &Format,
    out: &mut impl Write,
) -> Result<Printed> {
    print_for(info, objs, format, out, std::io::stdout().is_terminal())
}

/// Print the answer to a list query (`get vms`, `get vm a b`) as kubectl does: `-o json` and
/// `-o yaml` are one `kind: List` (however many items; `apply -f` takes it back), and
/// `-o jsonpath` applies to that List (`{.items[*].metadata.name}`). Tables and names as
/// [`print`].
pub fn print_list(
    info: &KindInfo,
    objs: &[DynObject],
    format: &Format,
    out: &mut impl Write,
) -> Result<Printed> {
    let list = || {
        let items: Vec<Value> = objs.iter().map(display_value).collect();
        serde_json::json!({"apiVersion": boxery_api::API_VERSION, "kind": "List", "items": items})
    };
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&list())?)?,
        Format::Yaml => write!(out, "{}", to_yaml(&list())?)?,
        Format::JsonPath(expr) => {
            let terminal = std::io::stdout().is_terminal();
            write!(out, "{}", jsonpath_with(expr, &list(), terminal)?)?;
            if !expr.contains("\\n") {
                writeln!(out)?;
            }
        }
        _ => return print(info, objs, format, out),
    }
    Ok(Printed::Written)
}

/// [`print`], saying whether a person reads `out` (`terminal`): then `-o jsonpath` values are
/// escaped with [`safe`] (the expression's own literals, `{"\n"}`, are kept).
pub fn print_for(
    info: &KindInfo,
    objs: &[DynObject],
    format: &Format,
    out: &mut impl Write,
    terminal: bool,
) -> Result<Printed> {
    let values: Vec<Value> = objs.iter().map(display_value).collect();
    match format {
        Format::CustomColumns(c) => {
            let o = TableOptions {
                headers: true,
                custom: Some(c.clone()),
                ..TableOptions::default()
            };
            if values.is_empty() {
                return Ok(none_found(info));
            }
            write!(out, "{}", table_with(info.kind, &values, &o))?;
        }
        Format::Table | Format::Wide => {
            if values.is_empty() {
                return Ok(none_found(info));
            }
            write!(
                out,
                "{}",
                table(info.kind, &values, *format == Format::Wide, true)
            )?;
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
                writeln!(
                    out,
                    "{}/{}",
                    info.singular,
                    safe(&s(ptr(v, "/metadata/name")))
                )?;
            }
        }
        Format::JsonPath(expr) => {
            for v in &values {
                write!(out, "{}", jsonpath_with(expr, v, terminal)?)?;
            }
            if !expr.contains("\\n") {
                writeln!(out)?;
            }
        }
    }
    Ok(Printed::Written)
}

/// kubectl's note for a table of no objects of a kind.
pub fn none_found(info: &KindInfo) -> Printed {
    Printed::NoneFound(format!("No {} found.", info.plural))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What an agent can write into objects, and what a terminal must never get from boxery.
    const HOSTILE: &str = "a\u{1b}]52;c;cm0gLXJmIH4K\u{7}\u{1b}[2J\u{9b}31m\u{7f}\u{202e}b\nc";

    fn raw_controls(text: &str) -> Vec<char> {
        text.chars()
            .filter(|c| boxery_api::name::unsafe_char(*c) && *c != '\n')
            .collect()
    }

    fn obj(v: Value) -> DynObject {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn safe_escapes_control_characters_and_keeps_unicode() {
        assert_eq!(
            safe(HOSTILE),
            "a\\u{1b}]52;c;cm0gLXJmIH4K\\u{7}\\u{1b}[2J\\u{9b}31m\\u{7f}\\u{202e}b\\nc"
        );
        assert_eq!(safe("tab\there\r\0"), "tab\\there\\r\\u{0}");
        assert!(matches!(
            safe("plain été 日本 🦀"),
            std::borrow::Cow::Borrowed(_)
        ));
        for c in (0u32..0x20).chain(0x7f..0xa0).filter_map(char::from_u32) {
            assert!(raw_controls(&safe(&c.to_string())).is_empty(), "{c:?}");
            assert!(!safe(&c.to_string()).contains('\n'));
        }
    }

    #[test]
    fn table_cells_are_safe_and_one_line() {
        let lease = display_value(&obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease",
            "metadata": {"name": "l1"},
            "spec": {"pool": "p", "holderIdentity": HOSTILE},
            "status": {"phase": HOSTILE, "vm": "v"},
        })));
        let event = json!({
            "type": "Normal", "reason": HOSTILE, "message": HOSTILE, "count": 1,
            "involvedObject": {"kind": "Vm", "name": HOSTILE},
        });
        let image = display_value(&obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "i", "ownerReferences": [{"apiVersion": "x", "kind": "Vm", "name": HOSTILE, "uid": "u"}]},
            "spec": {"source": {"file": HOSTILE}},
        })));
        for (kind, v) in [("Lease", lease), ("Event", event), ("Image", image)] {
            let t = table(kind, &[v], true, true);
            assert!(raw_controls(&t).is_empty(), "{kind}: {t:?}");
            assert_eq!(t.lines().count(), 2, "{kind}: a newline made a row: {t}");
            assert!(t.contains("\\u{1b}]52"), "{kind}: {t}");
        }
    }

    /// A table of nothing writes nothing and returns kubectl's note for the front end to
    /// show (the CLI: on stderr); verbs never print.
    #[test]
    fn an_empty_table_is_a_note_not_output() {
        let info = boxery_api::lookup_kind("lease").unwrap();
        for format in [
            Format::Table,
            Format::Wide,
            "custom-columns=N:.metadata.name".parse().unwrap(),
        ] {
            let mut out = Vec::new();
            let printed = print_for(info, &[], &format, &mut out, false).unwrap();
            assert_eq!(printed.note(), Some("No leases found."), "{format:?}");
            assert!(out.is_empty(), "{format:?}");
        }
        let mut out = Vec::new();
        let printed = print_for(info, &[], &Format::Yaml, &mut out, false).unwrap();
        assert_eq!(printed, Printed::Written);
    }

    #[test]
    fn jsonpath_values_are_escaped_only_for_a_terminal() {
        let info = boxery_api::lookup_kind("lease").unwrap();
        let o = obj(json!({
            "apiVersion": "boxery.dev/v1alpha1", "kind": "Lease",
            "metadata": {"name": "l1", "annotations": {"a": HOSTILE}},
            "spec": {"pool": "p", "holderIdentity": "h"},
        }));
        let f = Format::JsonPath("{.metadata.annotations.a}{\"\\n\"}".into());
        let mut piped = Vec::new();
        let _ = print_for(info, std::slice::from_ref(&o), &f, &mut piped, false).unwrap();
        assert_eq!(String::from_utf8(piped).unwrap(), format!("{HOSTILE}\n"));
        let mut tty = Vec::new();
        let _ = print_for(info, std::slice::from_ref(&o), &f, &mut tty, true).unwrap();
        let tty = String::from_utf8(tty).unwrap();
        assert_eq!(
            tty,
            format!("{}\n", safe(HOSTILE)),
            "the literal newline is kept"
        );
        // `wait --for=jsonpath` compares exact values
        assert_eq!(
            jsonpath("{.metadata.annotations.a}", &display_value(&o)).unwrap(),
            HOSTILE
        );
    }

    /// `-o json` and `-o yaml` stay exact and round-trip. serde_json escapes C0 controls (not
    /// DEL or C1: `\u{9b}` is written raw); serde-saphyr escapes all of them (`\e`, `\x9B`).
    #[test]
    fn json_and_yaml_escape_c0_controls() {
        let v = json!({"a": HOSTILE, "b": "x\u{1b}y", "c": "\u{9b}1m\u{7f}"});
        let j = serde_json::to_string_pretty(&v).unwrap();
        assert!(!j.contains('\u{1b}') && !j.contains('\u{7}'), "{j:?}");
        assert_eq!(serde_json::from_str::<Value>(&j).unwrap(), v);
        let y = to_yaml(&v).unwrap();
        assert!(raw_controls(&y).iter().all(|c| *c == '\u{202e}'), "{y:?}");
        assert_eq!(serde_saphyr::from_str::<Value>(&y).unwrap(), v);
    }

    #[test]
    fn errors_do_not_echo_raw_input() {
        let e = "table\u{1b}[2J".parse::<Format>().unwrap_err();
        assert!(!e.chain().contains('\u{1b}'));
        let e = jsonpath("{.a\u{1b}[2J", &json!({})).unwrap_err();
        assert!(!e.chain().contains('\u{1b}'));
    }

    /// kubectl's template language (issue 30, class 2): `{range}…{end}` was read as a path
    /// and printed nothing useful, with exit 0.
    #[test]
    fn jsonpath_templates_as_kubectl() {
        let list = json!({"kind": "List", "items": [
            {"metadata": {"name": "a", "labels": {"boxery.dev/pool": "p", "app-name": "x"}},
             "status": {"phase": "Running", "ips": ["10.0.0.1", "10.0.0.2"]}},
            {"metadata": {"name": "b", "labels": {}}, "status": {"phase": "Stopped", "ips": []}},
        ]});
        let j = |e: &str| jsonpath(e, &list);
        assert_eq!(
            j("{range .items[*]}{.metadata.name}{\"\\n\"}{end}").unwrap(),
            "a\nb\n"
        );
        assert_eq!(
            j("{range .items[*]}{@.metadata.name}{'\\t'}{.status.phase}{\"\\n\"}{end}").unwrap(),
            "a\tRunning\nb\tStopped\n"
        );
        // Nested ranges, the root from inside one, text between actions.
        assert_eq!(
            j("{range .items[*]}{.metadata.name}:{range .status.ips[*]} {@}{end};{end}{$.kind}")
                .unwrap(),
            "a: 10.0.0.1 10.0.0.2;b:;List"
        );
        assert_eq!(
            j("{.items[?(@.status.phase==\"Running\")].metadata.name}").unwrap(),
            "a"
        );
        assert_eq!(
            j("{.items[?(@.status.phase=='Stopped')].metadata.name}").unwrap(),
            "b"
        );
        assert_eq!(
            j("{.items[0].metadata.labels.boxery\\.dev/pool}").unwrap(),
            "p"
        );
        assert_eq!(j("{.items[0].metadata.labels.app-name}").unwrap(), "x");
        assert_eq!(j("{.items[*].metadata.name}").unwrap(), "a b");
        assert_eq!(j("{items[1].metadata.name}").unwrap(), "b");
        assert_eq!(j("{ .items[*].status.ips[0] }").unwrap(), "10.0.0.1");
        assert_eq!(j("{\"}\"}{.kind}").unwrap(), "}List");
        // Anything else is an error that says what, never output.
        for (bad, says) in [
            ("{range .items[*]}{.metadata.name}", "without its `{end}`"),
            ("{.metadata.name}{end}", "`{end}` without"),
            ("{range}{end}", "needs a path"),
            ("{range .items[*]", "unclosed"),
            ("{}", "empty"),
            ("{if .a}x{end}", "`{if…}` is not supported"),
            ("{\"\\x\"}", "escape `\\x`"),
            ("{\"a}", "unclosed"),
            ("{\"a\"b}", "not closed"),
            ("{.items[?(@.a=~\"x\")]}", "not supported"),
        ] {
            let e = j(bad).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::Invalid, "{bad}");
            assert!(e.chain().contains(says), "{bad}: {}", e.chain());
        }
        // Checked when the format is read: nothing is printed first.
        assert!(
            "jsonpath={range .items[*]}{.metadata.name}"
                .parse::<Format>()
                .is_err()
        );
    }
}
