//! kubectl's verbs of change on stored objects: `edit` (in `$EDITOR`), `patch`, `label`,
//! `annotate`, `scale`. The changes themselves are the verbs' ([`boxery_verbs::edit`]); here
//! are the editor session, the argument forms and the one-line reports.

use std::path::{Path, PathBuf};

use boxery_api::KindInfo;
use boxery_api::name::shown;
use boxery_verbs::Verbs;
use boxery_verbs::edit::{self, Changed, MetaChange, MetaMap, PatchType};
use boxery_verbs::objects::DryRun;
use boxery_verbs::render::Format;

use crate::commands::{kind, kind_and_names, print_written};
use crate::exit::{CliError, CliResult, Code};

/// `--dry-run` and `-o` of the commands that write (apply, patch, label, annotate, scale).
#[derive(Debug, Clone, clap::Args)]
pub struct Written {
    /// Show what would happen and write nothing: `server` (also the bare flag) runs the
    /// store's real write path (validation, defaults, preconditions) and rolls it back;
    /// `client` computes the result here from what is stored.
    #[arg(long, value_name = "client|server", num_args = 0..=1, require_equals = true, default_missing_value = "server")]
    dry_run: Option<DryRun>,
    /// Print the written objects (as stored, or as they would be with --dry-run).
    #[arg(short, long, value_name = "FORMAT", value_parser = WRITTEN_FORMATS)]
    output: Option<String>,
}

/// The `-o` forms of the commands that write (checked before anything is written).
pub const WRITTEN_FORMATS: [&str; 3] = ["yaml", "json", "name"];

impl Written {
    /// `--dry-run` (none when not given).
    pub fn dry(&self) -> DryRun {
        self.dry_run.unwrap_or_default()
    }
    /// `-o`.
    pub fn format(&self) -> Option<Format> {
        self.output.as_deref().map(written_format)
    }
}

/// One of [`WRITTEN_FORMATS`] as a format.
pub fn written_format(s: &str) -> Format {
    match s {
        "json" => Format::Json,
        "name" => Format::Name,
        _ => Format::Yaml,
    }
}

/// The objects a command of change acts on: `KIND NAME…`, `KIND/NAME…`, `KIND -l SEL` or
/// `KIND --all`.
pub async fn targets(
    v: &Verbs,
    kind_arg: &str,
    names: &[String],
    selector: Option<&str>,
    all: bool,
) -> CliResult<(&'static KindInfo, Vec<String>)> {
    let (k, names) = kind_and_names(kind_arg, names)?;
    let info = kind(&k)?;
    match (names.is_empty(), selector, all) {
        (false, None, false) => Ok((info, names)),
        (true, Some(_), false) | (true, None, true) => {
            let sel = boxery_verbs::objects::selector(selector)?;
            let (objs, _) = boxery_verbs::objects::get(v, info, &[], &sel).await?;
            Ok((info, objs.into_iter().map(|o| o.metadata.name).collect()))
        }
        (true, None, false) => Err(CliError::invalid(format!(
            "name the objects: `{k} NAME`, `{k}/NAME`, `-l SELECTOR` or `--all`"
        ))),
        _ => Err(CliError::invalid(
            "names, -l and --all choose the objects: give one of them",
        )),
    }
}

/// `label`/`annotate KIND NAME… KEY=VALUE… KEY-…`: the changes and the names, told apart by
/// their form (a name has no `=` and does not end in `-`).
pub fn split_changes(args: &[String]) -> CliResult<(Vec<String>, Vec<MetaChange>)> {
    let mut names = Vec::new();
    let mut changes = Vec::new();
    for a in args {
        match MetaChange::parse(a) {
            Some(c) => changes.push(c),
            None if changes.is_empty() => names.push(a.clone()),
            None => {
                return Err(CliError::invalid(format!(
                    "`{}` after the changes: give names first (KIND NAME… KEY=VALUE… KEY-…)",
                    shown(a)
                )));
            }
        }
    }
    if changes.is_empty() {
        return Err(CliError::invalid(
            "name at least one change: KEY=VALUE sets it, KEY- removes it",
        ));
    }
    Ok((names, changes))
}

/// How `label`/`annotate` choose objects besides names: `-l SELECTOR` or `--all`.
#[derive(Debug, Clone, Copy)]
pub struct Selection<'a> {
    /// `-l`.
    pub selector: Option<&'a str>,
    /// `--all`.
    pub all: bool,
}

/// `label` and `annotate`.
pub async fn set_meta(
    v: &Verbs,
    map: MetaMap,
    kind_arg: &str,
    args: &[String],
    overwrite: bool,
    sel: Selection<'_>,
    w: &Written,
) -> CliResult {
    let (names, changes) = split_changes(args)?;
    let (info, names) = targets(v, kind_arg, &names, sel.selector, sel.all).await?;
    let (done, same) = match map {
        MetaMap::Labels => ("labeled", "not labeled"),
        MetaMap::Annotations => ("annotated", "not annotated"),
    };
    let mut out = Vec::new();
    for n in &names {
        match edit::set_meta(v, info, n, map, &changes, overwrite, w.dry()).await {
            Ok(c) => out.push(c),
            Err(e) => return done_then(report(info, &out, w.format().as_ref(), done, same), e),
        }
    }
    report(info, &out, w.format().as_ref(), done, same)
}

/// `patch`'s patch: its type and where it is.
#[derive(Debug, Clone)]
pub struct PatchArgs {
    /// `--type`.
    pub ty: PatchType,
    /// `-p`.
    pub patch: Option<String>,
    /// `--patch-file`.
    pub patch_file: Option<PathBuf>,
}

/// `patch KIND NAME --type merge|json -p PATCH` (or `--patch-file FILE`).
pub async fn patch(
    v: &Verbs,
    kind_arg: &str,
    name: Option<String>,
    p: PatchArgs,
    w: &Written,
) -> CliResult {
    let (k, name) = crate::commands::kind_and_name(kind_arg, name)?;
    let info = kind(&k)?;
    let text = match (p.patch, p.patch_file) {
        (Some(p), None) => p,
        (None, Some(f)) => std::fs::read_to_string(&f)
            .map_err(|e| CliError::invalid(format!("cannot read {}: {e}", f.display())))?,
        _ => {
            return Err(CliError::invalid(
                "give the patch: -p PATCH or --patch-file FILE",
            ));
        }
    };
    let c = edit::patch(v, info, &name, p.ty, &text, w.dry()).await?;
    report(
        info,
        &[c],
        w.format().as_ref(),
        "patched",
        "patched (no change)",
    )
}

/// `scale pool NAME --replicas N [--current-replicas M]`: `to` is (N, M).
pub async fn scale(
    v: &Verbs,
    kind_arg: &str,
    names: &[String],
    to: (u32, Option<u32>),
    w: &Written,
) -> CliResult {
    let (k, names) = kind_and_names(kind_arg, names)?;
    let info = kind(&k)?;
    if info.kind != "Pool" {
        return Err(CliError::invalid(format!(
            "{} objects cannot be scaled: only a pool has replicas (`boxery scale pool NAME --replicas N`)",
            info.kind
        )));
    }
    if names.is_empty() {
        return Err(CliError::invalid(
            "name the pool: `scale pool NAME --replicas N`",
        ));
    }
    let mut out = Vec::new();
    for n in &names {
        match edit::scale(v, n, to.0, to.1, w.dry()).await {
            Ok(c) => out.push(c),
            Err(e) => {
                let said = report(
                    info,
                    &out,
                    w.format().as_ref(),
                    "scaled",
                    "scaled (no change)",
                );
                return done_then(said, e);
            }
        }
    }
    report(
        info,
        &out,
        w.format().as_ref(),
        "scaled",
        "scaled (no change)",
    )
}

/// A command over several objects that failed on one: what it changed before is said first
/// (those writes stand), then the error.
fn done_then(said: CliResult, e: boxery_verbs::VerbError) -> CliResult {
    said?;
    Err(e.into())
}

/// Print what the changes did: `vm/dev1 labeled` (`… (dry run)`), or the objects with `-o`.
fn report(
    info: &KindInfo,
    changed: &[Changed],
    format: Option<&Format>,
    done: &str,
    same: &str,
) -> CliResult {
    let lines: Vec<String> = changed
        .iter()
        .map(|c| {
            let word = if c.changed { done } else { same };
            let dry = if c.dry_run { " (dry run)" } else { "" };
            format!("{}/{} {word}{dry}", info.singular, c.object.metadata.name)
        })
        .collect();
    let objects: Vec<_> = changed.iter().map(|c| c.object.clone()).collect();
    print_written(&lines, &objects, format)
}

/// The header of the file `edit` opens.
const HEADER: &str = "\
# Edit the object below and save to apply it; quit without saving (or empty the file) to
# change nothing. Lines beginning with '#' are ignored. `status` and the controllers'
# metadata (finalizers, ownerReferences, boxery.dev/ annotations) cannot be changed here.
# If what you save is refused, this file opens again with the reason.
#
";

/// `edit KIND NAME`: the object as YAML in `$KUBE_EDITOR`, `$EDITOR` or `vi`; what was changed
/// is applied on save; a refused change reopens the file with the reason, and saving the same
/// refused text again stops (the file is kept).
pub async fn edit(
    v: &Verbs,
    kind_arg: &str,
    name: Option<String>,
    format: Option<&Format>,
) -> CliResult {
    let (k, name) = crate::commands::kind_and_name(kind_arg, name)?;
    let info = kind(&k)?;
    let shown_obj = boxery_verbs::objects::get_one(v, info, &name).await?;
    // As `get -o yaml` shows it: managedFields left out, as kubectl's edit does.
    let yaml = boxery_verbs::render::to_yaml(&boxery_verbs::render::display_value(&shown_obj))?;
    let dir = tempfile::Builder::new()
        .prefix("boxery-edit-")
        .tempdir()
        .map_err(|e| CliError::new(Code::Failed, anyhow::anyhow!("a temporary file: {e}")))?;
    let file = dir.path().join(format!("{}-{}.yaml", info.singular, name));
    let mut text = format!("{HEADER}{yaml}");
    let mut last_refused: Option<String> = None;
    loop {
        std::fs::write(&file, &text)
            .map_err(|e| CliError::new(Code::Failed, anyhow::anyhow!("{}: {e}", file.display())))?;
        run_editor(&file)?;
        let saved = std::fs::read_to_string(&file)
            .map_err(|e| CliError::new(Code::Failed, anyhow::anyhow!("{}: {e}", file.display())))?;
        let body = uncommented(&saved);
        if body.trim().is_empty() {
            eprintln!("Edit cancelled: the file was emptied; nothing changed.");
            return Ok(());
        }
        if body == uncommented(&yaml) {
            eprintln!("Edit cancelled: no changes made.");
            return Ok(());
        }
        if last_refused.as_deref() == Some(body.as_str()) {
            let keep = std::env::temp_dir().join(format!(
                "boxery-edit-{}-{}-{}.yaml",
                info.singular,
                name,
                std::process::id()
            ));
            let kept = std::fs::write(&keep, &saved).is_ok();
            return Err(CliError::invalid(format!(
                "edit cancelled: the same refused change was saved again{}",
                if kept {
                    format!("; your text is kept in {}", keep.display())
                } else {
                    String::new()
                }
            )));
        }
        let refused = match boxery_api::codec::yaml_value(&body) {
            Err(e) => format!("the file is not valid YAML: {e}"),
            Ok(edited) => {
                match edit::apply_edit(v, info, &shown_obj, &edited, DryRun::None).await {
                    Ok(c) => return report(info, &[c], format, "edited", "edited (no change)"),
                    Err(e) if e.kind() == boxery_verbs::ErrorKind::NotFound => return Err(e.into()),
                    Err(e) => e.chain(),
                }
            }
        };
        eprintln!("error: {}", boxery_verbs::render::safe(&refused));
        let reason: String = refused
            .lines()
            .map(|l| format!("# {l}\n"))
            .collect::<String>();
        text = format!("{HEADER}# The change was refused:\n{reason}#\n{body}");
        last_refused = Some(body);
    }
}

/// The text without its comment lines (those starting with `#`).
fn uncommented(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Run the user's editor on `file` and wait for it: `$KUBE_EDITOR`, else `$EDITOR`, else `vi`,
/// through `sh` so that an editor with arguments (`code --wait`) works.
fn run_editor(file: &Path) -> CliResult {
    let editor = ["KUBE_EDITOR", "EDITOR"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|e| !e.trim().is_empty()))
        .unwrap_or_else(|| "vi".to_string());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(file)
        .status()
        .map_err(|e| {
            CliError::new(
                Code::Failed,
                anyhow::anyhow!("cannot run the editor `{editor}`: {e}"),
            )
        })?;
    if !status.success() {
        return Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!(
                "the editor `{editor}` exited with {status}: nothing changed (set EDITOR or KUBE_EDITOR to choose another)"
            ),
        ));
    }
    Ok(())
}
