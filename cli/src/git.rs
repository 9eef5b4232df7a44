//! Reading a git repository's manifests at one commit with the `git` CLI: a bare mirror under
//! `$BOXERY_HOME/sync/NAME.git`, fetched on every sync, the ref resolved there, and the blobs
//! under a path read through one `git cat-file --batch` (no checkout, no work tree, no file
//! written outside the mirror).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use boxery_api::codec::MAX_FILE_BYTES;

use crate::exit::{CliError, CliResult, Code};
use crate::manifests::{MAX_TOTAL_BYTES, is_manifest_path};

/// A `git` command as the user runs git (their config, credential helpers and ssh keys), but
/// never waiting on a person: no terminal prompt for a password, ssh in batch mode (a key
/// that needs a passphrase fails instead of hanging), only the ordinary transports, and no
/// repository picked up from the environment.
fn git(dir: Option<&Path>) -> Command {
    let mut c = Command::new("git");
    if let Some(d) = dir {
        c.arg("-C").arg(d);
    }
    c.env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_PROTOCOL_FROM_USER", "0")
        .env("GIT_ALLOW_PROTOCOL", "file:git:http:https:ssh")
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .stdin(Stdio::null());
    if std::env::var_os("GIT_SSH_COMMAND").is_none() {
        c.env("GIT_SSH_COMMAND", "ssh -o BatchMode=yes");
    }
    c
}

/// Run `c`; its stdout, or an error with git's own words.
fn run(mut c: Command, what: &str) -> CliResult<Vec<u8>> {
    let out = c.output().map_err(|e| {
        CliError::new(
            Code::Failed,
            anyhow::anyhow!("cannot run git ({e}): install git (apt-get install git)"),
        )
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!("{what}: {}", boxery_verbs::render::safe(err.trim())),
        ));
    }
    Ok(out.stdout)
}

/// The mirror of source `name`.
pub fn mirror(home: &Path, name: &str) -> PathBuf {
    boxery_home::layout::sync_mirror(home, name)
}

/// Bring the mirror of `url` up to date (made on first use): every branch and tag, and the
/// repository's HEAD when `head` (no `--ref` given: a repository whose HEAD names no branch
/// yet can still be read at a branch or tag).
pub fn fetch(home: &Path, name: &str, url: &str, head: bool) -> CliResult<PathBuf> {
    let m = mirror(home, name);
    if !m.join("HEAD").exists() {
        std::fs::create_dir_all(&m)
            .map_err(|e| CliError::new(Code::Failed, anyhow::anyhow!("{}: {e}", m.display())))?;
        let mut c = git(None);
        c.args(["init", "--quiet", "--bare"]).arg(&m);
        run(c, "git init")?;
    }
    let mut c = git(Some(&m));
    c.args(["fetch", "--quiet", "--prune", "--force", "--no-tags", "--"])
        .arg(url)
        .args(["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]);
    if head {
        c.arg("+HEAD:refs/remote-head");
    }
    run(c, &format!("cannot fetch {url}"))?;
    Ok(m)
}

/// The commit `git_ref` names in the mirror (a branch, a tag, a commit; the repository's HEAD
/// when `None`).
pub fn resolve(mirror: &Path, git_ref: Option<&str>) -> CliResult<String> {
    let r = git_ref.unwrap_or("refs/remote-head");
    if r.starts_with('-') {
        return Err(CliError::invalid(format!(
            "--ref {r}: not a branch, tag or commit"
        )));
    }
    let mut c = git(Some(mirror));
    c.args(["rev-parse", "--verify", "--quiet", "--end-of-options"])
        .arg(format!("{r}^{{commit}}"));
    let out = run(c, "git rev-parse").map_err(|_| {
        CliError::invalid(format!(
            "--ref {}: no such branch, tag or commit in the repository",
            git_ref.unwrap_or("HEAD")
        ))
    })?;
    Ok(String::from_utf8_lossy(&out).trim().to_string())
}

/// The manifest files (`.yaml`, `.yml`, `.json`, no hidden path component) under `path` at
/// `commit`, with their bytes, named by their path in the repository.
pub fn read(mirror: &Path, commit: &str, path: Option<&str>) -> CliResult<Vec<(String, Vec<u8>)>> {
    let mut c = git(Some(mirror));
    c.args(["ls-tree", "-r", "-l", "-z", "--full-tree", commit, "--"]);
    if let Some(p) = path {
        c.arg(p.trim_end_matches('/'));
    }
    let listing = run(c, "git ls-tree")?;
    let mut wanted: Vec<(String, String)> = Vec::new();
    let mut total = 0usize;
    for entry in listing.split(|b| *b == 0).filter(|e| !e.is_empty()) {
        let entry = String::from_utf8_lossy(entry);
        let Some((meta, name)) = entry.split_once('\t') else {
            continue;
        };
        let fields: Vec<&str> = meta.split_whitespace().collect();
        // mode type object size: regular files only (no symlinks, no submodules)
        let [mode, "blob", object, size] = fields[..] else {
            continue;
        };
        if !(mode == "100644" || mode == "100755") || !is_manifest_path(name) {
            continue;
        }
        let size: usize = size.parse().unwrap_or(usize::MAX);
        if size > MAX_FILE_BYTES {
            return Err(CliError::invalid(format!(
                "{name}: too large: a manifest file may hold at most {} MiB",
                MAX_FILE_BYTES >> 20
            )));
        }
        total += size;
        if total > MAX_TOTAL_BYTES {
            return Err(CliError::invalid(format!(
                "the manifests may hold at most {} MiB in all",
                MAX_TOTAL_BYTES >> 20
            )));
        }
        wanted.push((name.to_string(), object.to_string()));
    }
    if wanted.is_empty() {
        return Err(CliError::invalid(format!(
            "commit {} holds no .yaml, .yml or .json files{}",
            boxery_verbs::sync::short(commit),
            path.map(|p| format!(" under {p}")).unwrap_or_default()
        )));
    }
    cat(mirror, wanted)
}

/// Read blobs through one `git cat-file --batch`.
fn cat(mirror: &Path, wanted: Vec<(String, String)>) -> CliResult<Vec<(String, Vec<u8>)>> {
    let failed =
        |e: std::io::Error| CliError::new(Code::Failed, anyhow::anyhow!("git cat-file: {e}"));
    let mut c = git(Some(mirror));
    c.args(["cat-file", "--batch"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = c.spawn().map_err(failed)?;
    let mut stdin = child.stdin.take().expect("piped");
    let objects: Vec<String> = wanted.iter().map(|(_, o)| o.clone()).collect();
    // Written from another thread: git answers as it reads, and a full pipe either way must
    // not stop both.
    let writer = std::thread::spawn(move || {
        for o in objects {
            if writeln!(stdin, "{o}").is_err() {
                break;
            }
        }
    });
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let mut files = Vec::with_capacity(wanted.len());
    for (name, object) in wanted {
        let mut header = String::new();
        out.read_line(&mut header).map_err(failed)?;
        let parts: Vec<&str> = header.split_whitespace().collect();
        let size = match parts[..] {
            [o, "blob", size] if o == object => size.parse::<usize>().unwrap_or(0),
            _ => {
                return Err(CliError::new(
                    Code::Failed,
                    anyhow::anyhow!(
                        "git cat-file: unexpected answer for {name}: {}",
                        header.trim()
                    ),
                ));
            }
        };
        let mut bytes = vec![0; size];
        out.read_exact(&mut bytes).map_err(failed)?;
        let mut nl = [0u8; 1];
        out.read_exact(&mut nl).map_err(failed)?;
        files.push((name, bytes));
    }
    let _ = writer.join();
    let _ = child.wait();
    Ok(files)
}
