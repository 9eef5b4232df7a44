//! `boxery sync SOURCE`: apply a directory or git repository of manifests, once or following
//! it, as one apply set recorded in a `Source` object (docs/gitops.md).
//!
//! - One sync reads the whole revision (every file of a directory, or a git commit under
//!   `--path`), validates all of it, and applies it in one transaction: a bad manifest or a
//!   field conflict applies nothing of the revision, and the Source says which file, document
//!   and field (exit 2 for a bad source). The revision applied before stays in force.
//! - `--watch` follows a directory through inotify (debounced: an editor's save, a
//!   `git checkout`, is one change) and a git repository by polling every `--interval`. A
//!   failed sync is reported and the next change or poll tries again.
//! - A sync that changes nothing writes nothing (re-applying unchanged objects is free).

use std::path::{Path, PathBuf};
use std::time::Duration;

use boxery_api::{Source, SourceSpec, SourceType};
use boxery_verbs::Verbs;
use boxery_verbs::render::safe;
use boxery_verbs::sync;

use crate::exit::{CliError, CliResult, Code};
use crate::{git, manifests, outln};

/// How long a directory must stay quiet after a change before it is read.
const QUIET: Duration = Duration::from_millis(200);
/// The longest a stream of changes delays a sync.
const MAX_DELAY: Duration = Duration::from_secs(2);

/// `sync`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct SyncArgs {
    /// A directory of manifests, or a git repository (a URL, or a path to a repository).
    /// Without it, --name names a Source already in the store.
    pub source: Option<String>,
    /// The Source's name: its apply set, and the object `boxery get sources` shows (default:
    /// the directory's or repository's name).
    #[arg(long, value_parser = crate::args::label)]
    pub name: Option<String>,
    /// Read SOURCE as a git repository or as a plain directory (default: git when it is a
    /// repository or a URL; a directory otherwise).
    #[arg(long = "type", value_enum)]
    pub type_: Option<Kind>,
    /// Git: the branch, tag or commit to apply (default: the repository's HEAD).
    #[arg(long = "ref", value_name = "REF")]
    pub git_ref: Option<String>,
    /// Git: the directory inside the repository that holds the manifests.
    #[arg(long, value_name = "SUBDIR")]
    pub path: Option<String>,
    /// Apply the current revision and exit (the default).
    #[arg(long, conflicts_with = "watch")]
    pub once: bool,
    /// Keep following the source: a directory's changes as they are saved, a repository's
    /// new commits every --interval.
    #[arg(long)]
    pub watch: bool,
    /// With --watch, how often a git repository is fetched (e.g. 30s, 5m).
    #[arg(long, default_value = "30s", value_parser = boxery_verbs::wait::timeout_arg)]
    pub interval: Duration,
    /// Never delete anything, even objects this source applied before and no longer holds.
    #[arg(long)]
    pub no_prune: bool,
    /// Take over fields other managers (boxery stop, boxery scale, another source) set to
    /// other values, instead of failing the sync with a conflict.
    #[arg(long)]
    pub force_conflicts: bool,
    /// Prune a Pool or Vm that a lease holds at once, ending the lease (Lost, ForceDeleted);
    /// without it, such an object stays until its lease ends.
    #[arg(long)]
    pub force: bool,
    /// Take objects of the same name made outside this source (by hand, by `boxery apply`,
    /// by another source) into its apply set, so that the source owns them and prunes them
    /// when their files go. Without it, such an object fails the sync (exit 5).
    #[arg(long)]
    pub adopt: bool,
}

/// `--type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// A git repository.
    Git,
    /// A directory, read as it is on disk.
    Directory,
}

/// Run `sync`.
pub async fn sync(v: &Verbs, args: SyncArgs) -> CliResult {
    let source = declare(v, &args).await?;
    let force = sync::Force {
        conflicts: args.force_conflicts,
        leases: args.force,
        adopt: args.adopt,
    };
    if !args.watch {
        return once(v, &source, force, true).await.map(drop);
    }
    match source.spec.type_ {
        SourceType::Directory => watch_directory(v, &source, force).await,
        SourceType::Git => poll(v, &source, force, args.interval).await,
    }
}

/// Whether `s` is a URL or scp-like address rather than a local path.
fn is_remote(s: &str) -> bool {
    s.contains("://") || (s.contains(':') && !s.starts_with('/') && !s.starts_with('.'))
}

/// The Source the arguments name: made or checked from SOURCE, or read from the store.
async fn declare(v: &Verbs, args: &SyncArgs) -> CliResult<Source> {
    let Some(given) = &args.source else {
        let Some(name) = &args.name else {
            return Err(CliError::invalid(
                "give a directory or git repository to sync, or --name of a Source in the store (`boxery get sources` lists them)",
            ));
        };
        return match v.get_as::<Source>(name).await? {
            Some(s) => Ok(s),
            None => Err(CliError::not_found(format!(
                "source {name} not found: `boxery get sources` lists them; `boxery sync DIR|REPO --name {name}` makes it"
            ))),
        };
    };
    let (url, is_git) = if is_remote(given) {
        (given.clone(), true)
    } else {
        let p =
            std::fs::canonicalize(given).map_err(|e| CliError::invalid(format!("{given}: {e}")))?;
        let repo =
            p.join(".git").exists() || (p.join("HEAD").is_file() && p.join("objects").is_dir());
        if !p.is_dir() {
            return Err(CliError::invalid(format!(
                "{given}: not a directory: give a directory of manifests or a git repository"
            )));
        }
        (p.display().to_string(), repo)
    };
    let type_ = match args.type_ {
        Some(Kind::Git) => SourceType::Git,
        Some(Kind::Directory) if is_remote(given) => {
            return Err(CliError::invalid(format!(
                "{given} is a URL: --type directory reads a local directory"
            )));
        }
        Some(Kind::Directory) => SourceType::Directory,
        None if is_git => SourceType::Git,
        None => SourceType::Directory,
    };
    if type_ == SourceType::Directory && (args.git_ref.is_some() || args.path.is_some()) {
        return Err(CliError::invalid(
            "--ref and --path read a git repository: give one, or drop them for a directory",
        ));
    }
    let name = match &args.name {
        Some(n) => n.clone(),
        None => default_name(&url)?,
    };
    let spec = SourceSpec {
        type_,
        url,
        git_ref: args.git_ref.clone(),
        path: args.path.clone(),
        prune: !args.no_prune,
    };
    Ok(sync::declare(v, &name, spec).await?)
}

/// A Source name from a URL or path: its last component, without `.git`, as a DNS label.
fn default_name(url: &str) -> CliResult<String> {
    let last = url
        .trim_end_matches('/')
        .rsplit(['/', ':'])
        .next()
        .unwrap_or("")
        .trim_end_matches(".git");
    let mut name: String = last
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .collect();
    name = name.trim_matches('-').chars().take(63).collect();
    let name = name.trim_matches('-').to_string();
    boxery_api::Name::label(&name).map_err(|_| {
        CliError::invalid(format!(
            "cannot make a source name from {url}: give one with --name"
        ))
    })?;
    Ok(name)
}

/// What one sync found to apply.
struct Revision {
    id: String,
    sources: Vec<(String, Vec<u8>)>,
}

/// Read the source's current revision.
fn read(v: &Verbs, s: &Source) -> CliResult<Revision> {
    match s.spec.type_ {
        SourceType::Directory => {
            let p = Path::new(&s.spec.url);
            let meta = std::fs::metadata(p)
                .map_err(|e| CliError::invalid(format!("{}: {e}", s.spec.url)))?;
            let sources = manifests::read_directory(p, &meta, true)?;
            let mut h = boxery_api::fnv::Fnv::default();
            for (name, bytes) in &sources {
                h.part(name.as_bytes()).part(bytes);
            }
            Ok(Revision {
                id: format!("{:016x}", h.finish()),
                sources,
            })
        }
        SourceType::Git => {
            let m = git::fetch(
                v.home(),
                &s.metadata.name,
                &s.spec.url,
                s.spec.git_ref.is_none(),
            )?;
            let commit = git::resolve(&m, s.spec.git_ref.as_deref())?;
            let sources = git::read(&m, &commit, s.spec.path.as_deref())?;
            Ok(Revision {
                id: commit,
                sources,
            })
        }
    }
}

/// One sync: read, validate, apply, record. Prints what changed (every time when `loud`, else
/// only when something changed or failed). Returns the revision applied.
async fn once(v: &Verbs, s: &Source, force: sync::Force, loud: bool) -> CliResult<String> {
    let name = &s.metadata.name;
    let rev = match read(v, s) {
        Ok(r) => r,
        Err(e) => {
            sync::record_failure(v, name, None, &format!("{:#}", e.error)).await?;
            return Err(e);
        }
    };
    let manifests = match manifests::parse_sources(&rev.sources) {
        Ok(m) => m,
        Err(e) => {
            sync::record_failure(v, name, Some(&rev.id), &format!("{:#}", e.error)).await?;
            return Err(CliError::new(
                Code::Invalid,
                anyhow::anyhow!(
                    "source {name}, revision {}: nothing applied: {:#}",
                    sync::short(&rev.id),
                    e.error
                ),
            ));
        }
    };
    let objs = manifests.into_iter().map(|m| m.given).collect();
    let synced = sync::apply_revision(v, s, &rev.id, objs, force)
        .await
        .map_err(|e| {
            let e: CliError = e.into();
            CliError::new(
                e.code,
                anyhow::anyhow!(
                    "source {name}, revision {}: nothing applied: {:#}",
                    sync::short(&rev.id),
                    e.error
                ),
            )
        })?;
    let changes = synced.changes();
    if loud || !changes.is_empty() {
        for line in &changes {
            outln!("{line}");
        }
        outln!(
            "source {name}: revision {} applied ({} objects, {} changed)",
            sync::short(&rev.id),
            synced.applied.results.len(),
            changes.len()
        );
    }
    Ok(rev.id)
}

/// Print a failed sync in a watch loop and go on.
fn report(e: &CliError) {
    eprintln!("boxery: {}", safe(&format!("{:#}", e.error)));
}

/// Until SIGINT or SIGTERM.
async fn stopped() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// `--watch` of a git repository: fetch and apply every `interval`.
async fn poll(v: &Verbs, s: &Source, force: sync::Force, interval: Duration) -> CliResult {
    let mut last: Option<String> = None;
    let stop = stopped();
    tokio::pin!(stop);
    loop {
        let loud = last.is_none();
        match once(v, s, force, loud).await {
            Ok(rev) => last = Some(rev),
            Err(e) => report(&e),
        }
        tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// `--watch` of a directory: apply now, then after each burst of changes.
async fn watch_directory(v: &Verbs, s: &Source, force: sync::Force) -> CliResult {
    use notify::Watcher;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if let Ok(ev) = ev
            && relevant(&ev)
        {
            let _ = tx.send(());
        }
    })
    .map_err(|e| {
        CliError::new(
            Code::Failed,
            anyhow::anyhow!("cannot watch {}: {e}", s.spec.url),
        )
    })?;
    let dir = PathBuf::from(&s.spec.url);
    watcher
        .watch(&dir, notify::RecursiveMode::Recursive)
        .map_err(|e| {
            CliError::new(
                Code::Failed,
                anyhow::anyhow!("cannot watch {}: {e}", s.spec.url),
            )
        })?;
    let stop = stopped();
    tokio::pin!(stop);
    if let Err(e) = once(v, s, force, true).await {
        report(&e);
    }
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            got = rx.recv() => if got.is_none() { return Ok(()) },
        }
        // Debounce: wait for QUIET without a change (at most MAX_DELAY in all).
        let deadline = tokio::time::Instant::now() + MAX_DELAY;
        loop {
            let wait = QUIET.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            match tokio::time::timeout(wait, rx.recv()).await {
                Ok(Some(())) if tokio::time::Instant::now() < deadline => continue,
                _ => break,
            }
        }
        if let Err(e) = once(v, s, force, true).await {
            report(&e);
        }
    }
}

/// Whether a change can change what the directory holds (not an access, not a hidden file
/// such as an editor's swap file).
fn relevant(ev: &notify::Event) -> bool {
    !matches!(ev.kind, notify::EventKind::Access(_))
        && ev.paths.iter().any(|p| {
            !p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.') || n.ends_with('~') || n.ends_with(".swp"))
        })
}
