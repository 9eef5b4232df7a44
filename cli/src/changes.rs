//! kubectl's verbs of change on stored objects: `edit` (in `$EDITOR`), `patch`, `label`,
//! `annotate`, `scale`. The changes themselves are the verbs' ([`boxery_verbs::edit`]); here
//! are the editor session, the argument forms and the one-line reports.

use crate::out::outln;
use std::path::{Path, PathBuf};

use boxery_api::KindInfo;
use boxery_api::name::shown;
use boxery_verbs::Verbs;
use boxery_verbs::edit::{self, Changed, MetaChange, MetaMap, PatchType};
use serde_json::Value;

use crate::commands::{kind, kind_and_names};
use crate::exit::{CliError, CliResult, Code};

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

/// `label` and `annotate`.
pub async fn set_meta(
    v: &Verbs,
    map: MetaMap,
    kind_arg: &str,
    args: &[String],
    overwrite: bool,
    selector: Option<&str>,
    all: bool,
) -> CliResult {
    let (names, changes) = split_changes(args)?;
    let (info, names) = targets(v, kind_arg, &names, selector, all).await?;
    let (done, same) = match map {
        MetaMap::Labels => ("labeled", "not labeled"),
        MetaMap::Annotations => ("annotated", "not annotated"),
    };
    for n in &names {
        let c = edit::set_meta(v, info, n, map, &changes, overwrite).await?;
        report(info, n, &c, done, same)?;
    }
    Ok(())
}

/// `patch KIND NAME --type merge|json -p PATCH` (or `--patch-file FILE`).
pub async fn patch(
    v: &Verbs,
    kind_arg: &str,
    name: Option<String>,
    ty: PatchType,
    patch: Option<String>,
    patch_file: Option<PathBuf>,
) -> CliResult {
    let (k, name) = crate::commands::kind_and_name(kind_arg, name)?;
    let info = kind(&k)?;
    let text = match (patch, patch_file) {
        (Some(p), None) => p,
        (None, Some(f)) => std::fs::read_to_string(&f)
            .map_err(|e| CliError::invalid(format!("cannot read {}: {e}", f.display())))?,
        _ => {
            return Err(CliError::invalid(
                "give the patch: -p PATCH or --patch-file FILE",
            ));
        }
    };
    let c = edit::patch(v, info, &name, ty, &text).await?;
    report(info, &name, &c, "patched", "patched (no change)")
}

/// `scale pool NAME --replicas N`.
pub async fn scale(
    v: &Verbs,
    kind_arg: &str,
    names: &[String],
    replicas: u32,
    current: Option<u32>,
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
    for n in &names {
        let c = edit::scale(v, n, replicas, current).await?;
        report(info, n, &c, "scaled", "scaled (no change)")?;
    }
    Ok(())
}

fn report(info: &KindInfo, name: &str, c: &Changed, done: &str, same: &str) -> CliResult {
    let word = if c.changed { done } else { same };
    outln!("{}/{name} {word}", info.singular);
    Ok(())
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
pub async fn edit(v: &Verbs, kind_arg: &str, name: Option<String>) -> CliResult {
    let (k, name) = crate::commands::kind_and_name(kind_arg, name)?;
    let info = kind(&k)?;
    let shown_obj = boxery_verbs::objects::get_one(v, info, &name).await?;
    let yaml = boxery_verbs::render::to_yaml(
        &serde_json::to_value(&shown_obj).map_err(|e| CliError::new(Code::Failed, e))?,
    )?;
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
        let refused = match serde_saphyr::from_str::<Value>(&body) {
            Err(e) => format!("the file is not valid YAML: {e}"),
            Ok(edited) => match edit::apply_edit(v, info, &shown_obj, &edited).await {
                Ok(c) => return report(info, &name, &c, "edited", "edited (no change)"),
                Err(e) if e.kind() == boxery_verbs::ErrorKind::NotFound => return Err(e.into()),
                Err(e) => e.chain(),
            },
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
