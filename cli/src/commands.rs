//! The kubectl-style commands: apply, get, describe, delete, diff, explain, events, schema.
//! Each calls a verb (`boxery_verbs::objects`) and renders its result.

use crate::out::{out, outln};
use std::io::Write;
use std::time::Duration;

use boxery_api::{DynObject, KindInfo};
use boxery_verbs::Verbs;
use boxery_verbs::objects::{self, Deleted, DryRun};
use boxery_verbs::render::{self as output, Format};
use boxery_verbs::wait::Until;
use boxery_verbs::{LAST_APPLIED, ObjectRef};
use futures::StreamExt;
use serde_json::Value;

use crate::exit::{CliError, CliResult};
use crate::wait;

/// Resolve a kind name the user typed.
pub fn kind(name: &str) -> CliResult<&'static KindInfo> {
    Ok(objects::kind(name)?)
}

/// `get`'s kinds: one, several (`vms,images`), or `all` (the kinds people write: Vm, Image,
/// Pool, Lease, Grant, Source), as kubectl's.
pub fn kinds(spec: &str) -> CliResult<Vec<&'static KindInfo>> {
    if spec == "all" {
        return Ok(boxery_api::validate::KINDS
            .iter()
            .filter(|k| k.controllers_only.is_none())
            .collect());
    }
    let mut out: Vec<&'static KindInfo> = Vec::new();
    for k in spec.split(',') {
        let info = kind(k)?;
        if !out.iter().any(|o| o.kind == info.kind) {
            out.push(info);
        }
    }
    Ok(out)
}

/// `KIND/NAME [KIND/NAME…]` or `KIND [NAME…]`, as kubectl takes them: the kind and the names.
/// Every `KIND/NAME` names the same kind.
pub fn kind_and_names(kind_arg: &str, names: &[String]) -> CliResult<(String, Vec<String>)> {
    let Some((k, first)) = kind_arg.split_once('/') else {
        if let Some(n) = names.iter().find(|n| n.contains('/')) {
            return Err(CliError::invalid(format!(
                "`{}` after a kind: give names alone (`{} NAME`), or every object as KIND/NAME",
                boxery_api::name::shown(n),
                boxery_api::name::shown(kind_arg)
            )));
        }
        return Ok((kind_arg.to_string(), names.to_vec()));
    };
    let info = kind(k)?;
    let mut out = vec![first.to_string()];
    for n in names {
        let Some((k2, name)) = n.split_once('/') else {
            return Err(CliError::invalid(format!(
                "`{}`: after {kind_arg}, give every object as KIND/NAME",
                boxery_api::name::shown(n)
            )));
        };
        if kind(k2)?.kind != info.kind {
            return Err(CliError::invalid(format!(
                "{kind_arg} and {}: one kind per command",
                boxery_api::name::shown(n)
            )));
        }
        out.push(name.to_string());
    }
    if out.iter().any(String::is_empty) {
        return Err(CliError::invalid(format!(
            "`{}`: KIND/NAME needs a name",
            boxery_api::name::shown(kind_arg)
        )));
    }
    Ok((k.to_string(), out))
}

/// [`kind_and_names`] for commands of one object (`describe`, `wait`).
pub fn kind_and_name(kind_arg: &str, name: Option<String>) -> CliResult<(String, String)> {
    let names: Vec<String> = name.into_iter().collect();
    let (kind, mut names) = kind_and_names(kind_arg, &names)?;
    match names.len() {
        1 => Ok((kind, names.remove(0))),
        0 => Err(CliError::invalid(format!(
            "name the object: `{kind} NAME` or `{kind}/NAME`"
        ))),
        _ => Err(CliError::invalid("one object: KIND NAME or KIND/NAME")),
    }
}

/// `apply -f|-k`. With prune, an object of the same name outside the pruned set is refused
/// unless `adopt` ([`objects::outsiders`]).
#[allow(clippy::too_many_arguments)]
pub async fn apply(
    v: &Verbs,
    manifests: Vec<boxery_api::codec::Manifest>,
    dry: DryRun,
    output: Option<Format>,
    mut opts: boxery_verbs::ApplyOptions,
    adopt: bool,
    wait_for: Option<Duration>,
) -> CliResult {
    let objs: Vec<DynObject> = manifests.into_iter().map(|m| m.given).collect();
    if let (Some(set), false) = (opts.prune.clone(), adopt) {
        // what prune deletes later is what this set holds: never take in what others made
        let outsiders = objects::outsiders(v, &objs, &set, &opts).await?;
        objects::refuse_outsiders(
            "apply --prune",
            "the set this --prune -l selects (objects an apply made, matching -l)",
            &outsiders,
            "--adopt",
        )?;
    }
    let (lines, objects, waits) = if dry == DryRun::Client {
        client_dry_run(v, objs, &opts).await?
    } else {
        opts.dry_run = dry == DryRun::Server;
        let applied = objects::apply(v, objs, opts).await?;
        let objects = applied
            .results
            .iter()
            .filter(|(a, _)| *a != boxery_verbs::ApplyAction::Pruned)
            .map(|(_, o)| o.clone())
            .collect();
        (applied.lines(), objects, applied.waits)
    };
    print_written(&lines, &objects, output.as_ref())?;
    if let (Some(timeout), DryRun::None) = (wait_for, dry) {
        for (until, targets) in &waits {
            wait::all(v, targets, until, timeout).await?;
        }
    }
    Ok(())
}

/// The singular name of a kind (`Vm` → `vm`).
fn singular(kind: &str) -> &str {
    boxery_api::lookup_kind(kind).map_or(kind, |k| k.singular)
}

/// Objects of any kinds as YAML or JSON: one object alone, several as a `kind: List`.
/// What a command that writes prints: one line per object (`vm/dev1 created`), or with `-o`
/// the objects as stored (or as they would be, with a dry run) as yaml, json or their names.
pub fn print_written(
    lines: &[String],
    objects: &[DynObject],
    output: Option<&Format>,
) -> CliResult {
    match output {
        None => {
            for line in lines {
                outln!("{line}");
            }
        }
        Some(Format::Name) => {
            for o in objects {
                outln!("{}/{}", singular(&o.kind), o.metadata.name);
            }
        }
        Some(f @ (Format::Yaml | Format::Json)) => print_objects(objects, f)?,
        Some(_) => return Err(CliError::invalid("-o takes yaml, json or name here")),
    }
    Ok(())
}

fn print_objects(objects: &[DynObject], f: &Format) -> CliResult {
    let values: Vec<Value> = objects.iter().map(output::display_value).collect();
    let v = match values.len() {
        1 => values[0].clone(),
        _ => {
            serde_json::json!({"apiVersion": boxery_api::API_VERSION, "kind": "List", "items": values})
        }
    };
    match f {
        Format::Json => outln!(
            "{}",
            serde_json::to_string_pretty(&v)
                .map_err(|e| CliError::new(crate::exit::Code::Failed, e))?
        ),
        _ => out!("{}", output::to_yaml(&v)?),
    }
    Ok(())
}

/// `apply --dry-run=client`: what apply would do to each object, told from what is stored
/// (read only); the manifests were checked when read. With prune, the objects it would delete.
async fn client_dry_run(
    v: &Verbs,
    objs: Vec<DynObject>,
    opts: &boxery_verbs::ApplyOptions,
) -> CliResult<(Vec<String>, Vec<DynObject>, Vec<(Until, Vec<ObjectRef>)>)> {
    let mut lines = Vec::new();
    // As given (without defaults) for the prune check below; compared with defaults, as stored.
    let given = objs.clone();
    let objs = objs
        .into_iter()
        .map(|o| {
            let value = serde_json::to_value(&o)
                .map_err(|e| CliError::new(crate::exit::Code::Failed, e))?;
            boxery_api::normalize(value).map_err(CliError::invalid)
        })
        .collect::<CliResult<Vec<DynObject>>>()?;
    for o in &objs {
        let live = v.read(&ObjectRef::to(o)).await?;
        let word = match &live {
            None => "created",
            Some(l) if strip_for_diff(l) == strip_for_diff(o) => "unchanged",
            Some(_) => "configured",
        };
        lines.push(format!(
            "{}/{} {word} (dry run)",
            singular(&o.kind),
            o.metadata.name
        ));
    }
    if opts.prune.is_some() {
        // the store's own prune rule, in a rolled-back transaction
        let d = objects::diff(v, given, opts.clone()).await?;
        for o in d.pruned {
            lines.push(format!(
                "{}/{} pruned (dry run)",
                singular(&o.kind),
                o.metadata.name
            ));
        }
    }
    Ok((lines, objs, Vec::new()))
}

fn strip_for_diff(o: &DynObject) -> Value {
    let mut v = output::display_value(o);
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "uid",
            "managedFields",
        ] {
            m.remove(k);
        }
        if let Some(a) = m.get_mut("annotations").and_then(Value::as_object_mut) {
            a.remove(LAST_APPLIED);
            if a.is_empty() {
                m.remove("annotations");
            }
        }
    }
    if let Some(m) = v.as_object_mut() {
        m.remove("status");
    }
    v
}

/// `diff -f|-k [--prune -l SEL]`: what `apply` would change, and with `prune` what it would
/// delete (each shown going from live to nothing). Returns whether anything differs.
pub async fn diff(
    v: &Verbs,
    manifests: Vec<boxery_api::codec::Manifest>,
    opts: boxery_verbs::ApplyOptions,
) -> CliResult<bool> {
    let objs: Vec<DynObject> = manifests.into_iter().map(|m| m.given).collect();
    let d = objects::diff(v, objs, opts).await?;
    let mut differs = false;
    let mut out = std::io::stdout().lock();
    let gone = d.pruned.iter().map(|l| (Some(l), None, "pruned"));
    let applied = d
        .changed
        .iter()
        .map(|(l, a)| (l.as_ref(), Some(a), "applied"));
    for (live, after, side) in applied.chain(gone) {
        let text = |o: Option<&DynObject>| -> CliResult<String> {
            Ok(match o {
                Some(o) => output::to_yaml(&strip_for_diff(o))?,
                None => String::new(),
            })
        };
        let (before_text, after_text) = (text(live)?, text(after)?);
        if before_text == after_text {
            continue;
        }
        differs = true;
        let o = after.or(live).expect("one side is an object");
        let label = format!("{}/{}", o.kind.to_lowercase(), o.metadata.name);
        let d = similar::TextDiff::from_lines(&before_text, &after_text);
        write!(
            out,
            "{}",
            d.unified_diff()
                .header(&format!("live/{label}"), &format!("{side}/{label}"))
        )?;
    }
    Ok(differs)
}

/// `get` of several kinds (`vms,images`, `all`): a table per kind with objects (names as
/// `kind/name`, as kubectl shows them), or one List of them all (`-o json|yaml|jsonpath`).
pub async fn get_kinds(
    v: &Verbs,
    kinds: &[&'static KindInfo],
    names: &[String],
    format: Format,
    sel: Option<&str>,
    watch: bool,
    opts: &GetOptions,
) -> CliResult {
    if !names.is_empty() || watch {
        return Err(CliError::invalid(
            "names and --watch take one kind: `boxery get KIND NAME…` or `get KIND/NAME`",
        ));
    }
    let sel = objects::selector(sel)?;
    let mut all = Vec::new();
    let mut out = std::io::stdout().lock();
    let mut first = true;
    for info in kinds {
        let (mut objs, _) = objects::get(v, info, &[], &sel).await?;
        if let Some(path) = &opts.sort_by {
            output::sort_by(&mut objs, path)?;
        }
        match &format {
            f if f.is_table() && !objs.is_empty() => {
                let mut values: Vec<Value> = objs.iter().map(output::display_value).collect();
                for val in &mut values {
                    let name = val["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    val["metadata"]["name"] = Value::String(format!("{}/{name}", info.singular));
                }
                if !first {
                    writeln!(out)?;
                }
                first = false;
                let t = opts.table(&format);
                write!(out, "{}", output::table_with(info.kind, &values, &t))?;
            }
            Format::Name => {
                noted(output::print(info, &objs, &format, &mut out)?);
            }
            _ => all.extend(objs),
        }
    }
    match &format {
        f if f.is_table() && first => eprintln!("No resources found."),
        f if f.is_table() => {}
        Format::Name => {}
        _ => {
            noted(output::print_list(kinds[0], &all, &format, &mut out)?);
        }
    }
    out.flush()?;
    Ok(())
}

/// `get`'s table and order flags (kubectl's).
#[derive(Debug, Clone, Default)]
pub struct GetOptions {
    /// Not `--no-headers`.
    pub headers: bool,
    /// `--show-labels`.
    pub show_labels: bool,
    /// `-L KEY`.
    pub label_columns: Vec<String>,
    /// `--sort-by JSONPATH`.
    pub sort_by: Option<String>,
    /// `--watch-only`: changes only, not the objects as they are first.
    pub watch_only: bool,
}

impl GetOptions {
    /// The table these flags draw in `format` (`-o wide`, `-o custom-columns=…`).
    fn table(&self, format: &Format) -> output::TableOptions {
        output::TableOptions {
            wide: *format == Format::Wide,
            headers: self.headers,
            show_labels: self.show_labels,
            label_columns: self.label_columns.clone(),
            custom: match format {
                Format::CustomColumns(c) => Some(c.clone()),
                _ => None,
            },
        }
    }
}

/// `get`. With `watch`: then every change, as kubectl's `-w`: a table row per change whose
/// row differs from the one last printed for that object (a status write that changes no
/// column prints nothing), in columns kept where the first rows put them (they only widen);
/// YAML documents separated by `---`; `--watch-only` skips the objects as they are first.
pub async fn get(
    v: &Verbs,
    kind_name: &str,
    names: &[String],
    format: Format,
    sel: Option<&str>,
    watch: bool,
    opts: &GetOptions,
) -> CliResult {
    let info = kind(kind_name)?;
    if opts.watch_only && !watch {
        return Err(CliError::invalid("--watch-only goes with -w (--watch)"));
    }
    let sel = objects::selector(sel)?;
    let (mut objs, rev) = objects::get(v, info, names, &sel).await?;
    if let Some(path) = &opts.sort_by {
        output::sort_by(&mut objs, path)?;
    }
    let table = opts.table(&format);
    let mut widths: Vec<usize> = Vec::new();
    let mut last_row: std::collections::HashMap<String, Vec<String>> = Default::default();
    let mut printed = false;
    let mut out = std::io::stdout().lock();
    if format.is_table() {
        let values: Vec<Value> = objs.iter().map(output::display_value).collect();
        let mut rows = output::rows(info.kind, &values, &table);
        let header = table.headers.then(|| rows.remove(0));
        for (o, r) in objs.iter().zip(&rows) {
            last_row.insert(o.metadata.name.clone(), r.clone());
        }
        let shown: Vec<Vec<String>> = if opts.watch_only { Vec::new() } else { rows };
        if !shown.is_empty() || (watch && header.is_some()) {
            let all: Vec<Vec<String>> = header.into_iter().chain(shown).collect();
            write!(out, "{}", output::aligned_to(all, &mut widths))?;
        } else if objs.is_empty() && !watch {
            eprintln!("No {} found.", info.plural);
        }
    } else if opts.watch_only {
        // nothing until the first change
    } else if names.len() == 1 || watch {
        // A watch prints objects one by one (YAML documents separated by `---`), as kubectl's.
        noted(output::print(info, &objs, &format, &mut out)?);
        printed = !objs.is_empty();
    } else {
        noted(output::print_list(info, &objs, &format, &mut out)?);
    }
    out.flush()?;
    drop(out);
    if !watch {
        return Ok(());
    }
    let mut changes = objects::watch(v, info, names, &sel, rev);
    while let Some(change) = changes.next().await {
        let (obj, deleted) = change?;
        let mut out = std::io::stdout().lock();
        if format.is_table() {
            let mut v = output::display_value(&obj);
            if deleted {
                v["status"]["printableStatus"] = Value::String("Deleted".into());
            }
            let mut t = table.clone();
            t.headers = false;
            let row = output::rows(info.kind, &[v], &t).remove(0);
            let name = obj.metadata.name.clone();
            if last_row.get(&name) == Some(&row) && !deleted {
                continue;
            }
            write!(
                out,
                "{}",
                output::aligned_to(vec![row.clone()], &mut widths)
            )?;
            if deleted {
                last_row.remove(&name);
            } else {
                last_row.insert(name, row);
            }
        } else {
            if printed && format == Format::Yaml {
                writeln!(out, "---")?;
            }
            noted(output::print(
                info,
                std::slice::from_ref(&obj),
                &format,
                &mut out,
            )?);
            printed = true;
        }
        out.flush()?;
    }
    Ok(())
}

/// `describe`: [`boxery_verbs::describe`] as text. Every value shown comes from the store,
/// which agents write: each goes through [`output::safe`] (in `indent_table` for the tables),
/// so no control character reaches the terminal.
pub async fn describe(verbs: &Verbs, kind_name: &str, name: &str) -> CliResult {
    use output::safe;
    let d = boxery_verbs::describe::describe(verbs, kind(kind_name)?, name).await?;
    let obj = &d.object;
    let v = output::display_value(obj);
    let mut out = String::new();
    let m = &obj.metadata;
    out.push_str(&format!(
        "Name:         {}\nKind:         {}\n",
        safe(&m.name),
        safe(&obj.kind)
    ));
    if !m.labels.is_empty() {
        out.push_str(&format!(
            "Labels:       {}\n",
            safe(
                &m.labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        ));
    }
    out.push_str(&format!(
        "UID:          {}\n",
        safe(m.uid.as_deref().unwrap_or(""))
    ));
    out.push_str(&format!(
        "Created:      {} ({} ago)\n",
        safe(v["metadata"]["creationTimestamp"].as_str().unwrap_or("")),
        output::age(&v["metadata"]["creationTimestamp"])
    ));
    out.push_str(&format!(
        "Generation:   {} (observed {})\n",
        m.generation.unwrap_or(0),
        obj.status()["observedGeneration"]
            .as_i64()
            .map(|g| g.to_string())
            .unwrap_or_else(|| "never".into())
    ));
    if let Some(d) = &m.deletion_timestamp {
        out.push_str(&format!(
            "Deleting:     since {} (finalizers: {})\n",
            safe(&d.to_string()),
            safe(&m.finalizers.join(", "))
        ));
    }
    for o in &m.owner_references {
        out.push_str(&format!(
            "Owned by:     {}/{}\n",
            safe(&o.kind.to_lowercase()),
            safe(&o.name)
        ));
    }
    if !m.managed_fields.is_empty() {
        out.push_str("Managed fields:\n");
        for e in &m.managed_fields {
            let fields = boxery_verbs::entry_fields(e);
            out.push_str(&format!(
                "  {} ({:?}{}): {}\n",
                safe(&e.manager),
                e.operation,
                e.time
                    .map(|t| format!(", {}", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
                    .unwrap_or_default(),
                safe(&fields.join(", "))
            ));
        }
    }
    if let Some(st) = obj.status()["printableStatus"].as_str() {
        out.push_str(&format!("Status:       {}\n", safe(st)));
    }
    for (title, value) in [("Spec", d.spec().cloned()), ("Observed", d.observed())] {
        if let Some(value) = value {
            out.push_str(&format!("{title}:\n"));
            for line in output::to_yaml(&value)?.lines() {
                out.push_str(&format!("  {}\n", safe(line)));
            }
        }
    }
    let text = |v: &Value| v.as_str().unwrap_or("").to_string();
    if let Some(conds) = d.conditions() {
        out.push_str("Conditions:\n");
        let rows: Vec<Vec<String>> = conds
            .iter()
            .map(|c| {
                vec![
                    text(&c["type"]),
                    text(&c["status"]),
                    text(&c["reason"]),
                    output::age(&c["lastTransitionTime"]),
                    text(&c["message"]),
                ]
            })
            .collect();
        out.push_str(&indent_table(
            &["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
            &rows,
        ));
    }
    if let Some(members) = &d.members {
        let rows = members.iter().map(|m| {
            vec![
                m.name.clone(),
                format!("{:?}", m.state),
                m.generation.to_string(),
                m.lease.clone().unwrap_or_default(),
                m.message.clone(),
            ]
        });
        let headers = ["VM", "STATE", "GENERATION", "LEASE", "MESSAGE"];
        section(&mut out, "Members", &headers, rows.collect());
    }
    let rows = d.events.iter().map(|e| {
        vec![
            text(&e.rest["type"]),
            text(&e.rest["reason"]),
            output::age(&e.rest["lastTimestamp"]),
            e.rest["count"].to_string(),
            text(&e.rest["message"]),
        ]
    });
    let headers = ["TYPE", "REASON", "AGE", "COUNT", "MESSAGE"];
    section(&mut out, "Events", &headers, rows.collect());
    out!("{out}");
    Ok(())
}

/// A titled table of `describe` (`Title:` and the table), or `Title:  <none>`.
fn section(out: &mut String, title: &str, headers: &[&str], rows: Vec<Vec<String>>) {
    if rows.is_empty() {
        out.push_str(&format!("{:<14}<none>\n", format!("{title}:")));
    } else {
        out.push_str(&format!("{title}:\n"));
        out.push_str(&indent_table(headers, &rows));
    }
}

/// Rows under headers, indented, aligned; every cell made [`output::safe`] first.
fn indent_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| output::safe(c).into_owned()).collect())
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<String>| {
        let mut l = String::from("  ");
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}   ", w = widths[i]));
            }
        }
        l.trim_end().to_string() + "\n"
    };
    out.push_str(&line(headers.iter().map(|h| h.to_string()).collect()));
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// `grant ls`, `lease ls`: every object of a kind as `get`'s table; `if_none` (to stderr)
/// instead of an empty one, when given.
pub async fn ls(v: &Verbs, kind_name: &str, if_none: Option<&str>) -> CliResult {
    let info = kind(kind_name)?;
    let (objs, _) = objects::get(v, info, &[], &Default::default()).await?;
    match if_none {
        Some(none) if objs.is_empty() => eprintln!("{none}"),
        _ => {
            noted(output::print(
                info,
                &objs,
                &Format::Table,
                &mut std::io::stdout().lock(),
            )?);
        }
    }
    Ok(())
}

/// `events [KIND NAME]`.
pub async fn events(v: &Verbs, kind_name: Option<&str>, name: Option<&str>) -> CliResult {
    let evs = match (kind_name, name) {
        (Some(k), Some(n)) => objects::events(v, Some((kind(k)?.kind, n))).await?,
        (Some(_), None) => return Err(CliError::invalid("give both KIND and NAME, or neither")),
        _ => objects::events(v, None).await?,
    };
    let info = kind("Event")?;
    noted(output::print(
        info,
        &evs,
        &Format::Table,
        &mut std::io::stdout().lock(),
    )?);
    Ok(())
}

/// How `delete` deletes.
#[derive(Debug, Clone)]
pub struct DeleteOptions {
    /// Wait (this long at most) until the objects are gone.
    pub wait_for: Option<Duration>,
    /// `--force`: see `delete --help`.
    pub force: bool,
    /// `--ignore-not-found`: a missing object is skipped in silence.
    pub ignore_not_found: bool,
}

/// `delete` (and `rm`).
pub async fn delete(
    v: &Verbs,
    kind_name: &str,
    names: &[String],
    how: &DeleteOptions,
) -> CliResult {
    let info = kind(kind_name)?;
    let mut names = names.to_vec();
    if how.ignore_not_found {
        let mut present = Vec::new();
        for n in names {
            boxery_api::Name::for_kind(info, &n).map_err(|e| CliError::invalid(e.0))?;
            if v.exists(&ObjectRef::new(info.kind, &n)).await? {
                present.push(n);
            }
        }
        names = present;
        if names.is_empty() {
            return Ok(());
        }
    }
    if names.is_empty() {
        eprintln!("No {} found.", info.plural);
        return Ok(());
    }
    if how.force {
        // before anything is marked: --force acts on the backend at once
        for n in &names {
            boxery_api::Name::for_kind(info, n).map_err(|e| CliError::invalid(e.0))?;
        }
        objects::check_backend(v).await?;
    }
    let mut targets = Vec::new();
    for d in objects::delete(v, info, &names).await? {
        match d {
            Deleted::Removed(n) => outln!("{}/{n} deleted", info.singular),
            Deleted::Deleting(n) => {
                outln!("{}/{n} deleting", info.singular);
                targets.push(ObjectRef::new(info.kind, n));
            }
        }
    }
    if how.force {
        for t in &targets {
            boxery_verbs::force::force_delete(v, &t.kind, &t.name).await?;
            outln!("{}/{} deleted (forced)", info.singular, t.name);
        }
        return Ok(());
    }
    if let Some(t) = how.wait_for {
        wait::quiet(v, &targets, &Until::Deleted, t).await?;
        for t in &targets {
            outln!("{}/{} deleted", info.singular, t.name);
        }
    }
    Ok(())
}

/// `delete -f|-k`: the objects the manifests name, kind by kind in the manifests' order. A
/// missing one is reported and the others are still deleted (exit 3), unless
/// `--ignore-not-found`.
pub async fn delete_manifests(
    v: &Verbs,
    manifests: &[boxery_api::codec::Manifest],
    how: &DeleteOptions,
) -> CliResult {
    let mut missing = Vec::new();
    let mut by_kind: Vec<(&str, Vec<String>)> = Vec::new();
    for m in manifests {
        let o = &m.object;
        if !v.exists(&ObjectRef::to(o)).await? {
            missing.push(format!("{}/{}", singular(&o.kind), o.metadata.name));
            continue;
        }
        match by_kind.iter_mut().find(|(k, _)| *k == o.kind) {
            Some((_, names)) => names.push(o.metadata.name.clone()),
            None => by_kind.push((o.kind.as_str(), vec![o.metadata.name.clone()])),
        }
    }
    for (k, names) in &by_kind {
        delete(v, k, names, how).await?;
    }
    if !missing.is_empty() && !how.ignore_not_found {
        return Err(CliError::not_found(format!(
            "not found: {} (--ignore-not-found skips them)",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// `schema [KIND]`: the JSON Schema(s).
pub fn schema(kind_name: Option<&str>) -> CliResult {
    match kind_name {
        Some(k) => {
            let info = kind(k)?;
            outln!(
                "{}",
                serde_json::to_string_pretty(
                    &boxery_api::validate::schema_of(info.kind).expect("schema")
                )?
            );
        }
        None => {
            let all: serde_json::Map<String, Value> = boxery_api::KINDS
                .iter()
                .map(|k| {
                    (
                        k.kind.to_string(),
                        boxery_api::validate::schema_of(k.kind).expect("schema"),
                    )
                })
                .collect();
            outln!("{}", serde_json::to_string_pretty(&Value::Object(all))?);
        }
    }
    Ok(())
}

/// `api-resources`: every kind, as `kubectl api-resources` lists them.
pub fn api_resources() -> String {
    let mut rows = vec![
        [
            "NAME",
            "SHORTNAMES",
            "APIVERSION",
            "NAMESPACED",
            "KIND",
            "VERBS",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for k in boxery_api::validate::KINDS {
        let verbs = if k.controllers_only.is_some() {
            "get,list,watch,describe"
        } else {
            "apply,delete,describe,diff,get,list,wait,watch"
        };
        rows.push(vec![
            k.plural.to_string(),
            k.short_names.join(","),
            boxery_api::API_VERSION.to_string(),
            "false".into(),
            k.kind.to_string(),
            verbs.into(),
        ]);
    }
    boxery_verbs::render::aligned(rows)
}

/// Say a print's note for the reader (`No vms found.`) on stderr, as kubectl does.
fn noted(printed: output::Printed) {
    if let Some(note) = printed.note() {
        eprintln!("{note}");
    }
}

/// `version`: this build, the store's schema, the backend, and who leads the store.
pub fn version(env: &boxery_verbs::env::Env) -> CliResult {
    let store = boxery_home::layout::store(&env.home);
    let leader = if store.exists() {
        match boxery_verbs::typed::leader(env)? {
            Some(h) => format!("{} (leading the store)", boxery_verbs::render::safe(&h)),
            None => "none leading (commands run the controllers themselves)".into(),
        }
    } else {
        "none (no store yet)".into()
    };
    let backend = boxery_backends::by_name(&env.backend_name, &env.home)
        .map(|b| format!("{} ({:?})", env.backend_name, b.capabilities().stability))
        .unwrap_or_else(|_| env.backend_name.clone());
    out!(
        "Client Version: {}\nStore Schema:   {} ({})\nBackend:        {backend}\nControl Plane:  {leader}\n",
        env!("CARGO_PKG_VERSION"),
        boxery_verbs::SCHEMA_VERSION,
        store.display()
    );
    Ok(())
}

/// `images layers`: the layer table ([`boxery_api::image::LAYERS`]).
pub fn layers_table() -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(["LAYER", "IN", "INSTALLS"]);
    for l in boxery_api::image::LAYERS {
        t.add_row([
            l.name.to_string(),
            if l.in_base {
                format!("every {}", boxery_api::image::LAYERED_BASE)
            } else {
                "spec.source.build.layers".to_string()
            },
            l.installs.to_string(),
        ]);
    }
    format!("{}\n", t.trim_fmt())
}

/// The backend support table, from each backend's own `capabilities()` (the one source of
/// truth; docs/backends.md holds a copy a test keeps equal).
pub fn backends_table(home: &std::path::Path) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut out = String::from(
        "| backend | stability | platforms | requires | instance types | resize | live capture | suspend/resume | memory snapshots, forks with memory | builds stock images | host key | sshd in guests | usage samples | console screen |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for name in boxery_backends::BACKENDS {
        let Ok(b) = boxery_backends::by_name(name, home) else {
            continue;
        };
        let c = b.capabilities();
        out.push_str(&format!(
            "| `{}` | {:?} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            c.name,
            c.stability,
            c.platforms.join(", "),
            if c.requirements.is_empty() {
                "—".to_string()
            } else {
                c.requirements.join(", ")
            },
            c.instance_types
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", "),
            yes(c.resize),
            yes(c.live_capture),
            yes(c.suspend),
            yes(c.memory_snapshots),
            yes(c.build_stock_image),
            yes(c.host_key),
            yes(c.ssh),
            yes(c.usage),
            yes(c.screen)
        ));
    }
    out
}
