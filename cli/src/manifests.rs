//! Reading manifests from files, directories (recursively) and stdin, all or nothing.
//!
//! Guarantees:
//! - No source is read past [`MAX_FILE_BYTES`] + 1 bytes, and one apply reads at most
//!   [`MAX_TOTAL_BYTES`] in all: `-f /dev/zero` and `yes | boxery apply -f -` fail at once
//!   (exit 2) instead of filling memory.
//! - A directory walk reads only regular files and directories. FIFOs, sockets and devices
//!   are skipped with a note on stderr (a FIFO named `x.yaml` would block the walk forever).
//!   Every directory is read at most once, whatever the symlinks: a link back to `..` or to a
//!   directory already read is skipped with a note, so loops cannot make the walk endless or
//!   exponential; a walk that meets more than [`MAX_WALK_ENTRIES`] entries (a link to `/`)
//!   is refused.
//! - A file in a directory that holds no document (only comments, blank lines, `---`) is
//!   skipped with a note; named on its own with `-f` it is an error, as an empty file is.
//! - A path named with `-f` that is not a regular file (`/dev/stdin`, a FIFO, a device) is
//!   read like stdin, bounded. A FIFO is opened without waiting for a writer: with none, it
//!   reads as empty and is refused as such, instead of hanging.
//!
//! Caveats: a writer that keeps a FIFO (or stdin) open without writing blocks the read, as
//! for any command reading stdin.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use boxery_api::codec::{MAX_FILE_BYTES, MAX_OBJECT_BYTES, Manifest, parse_manifests_all};

use crate::exit::{CliError, CliResult};

/// The most one apply reads from all its sources together.
pub const MAX_TOTAL_BYTES: usize = 64 << 20;

/// The most directory entries one walk looks at (a symlink to `/` must not walk the machine).
pub const MAX_WALK_ENTRIES: usize = 100_000;

fn is_manifest(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

fn too_large(name: &str) -> CliError {
    CliError::invalid(format!(
        "{name}: too large: a manifest file may hold at most {} MiB (and one object at most {} MiB); split it into several files",
        MAX_FILE_BYTES >> 20,
        MAX_OBJECT_BYTES >> 20
    ))
}

/// Read at most [`MAX_FILE_BYTES`] from `r`: one byte more is an error, and nothing past it
/// is read.
fn read_bounded(mut r: impl Read, name: &str) -> CliResult<Vec<u8>> {
    let mut buf = Vec::new();
    (&mut r)
        .take(MAX_FILE_BYTES as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| CliError::invalid(format!("cannot read {name}: {e}")))?;
    if buf.len() > MAX_FILE_BYTES {
        return Err(too_large(name));
    }
    Ok(buf)
}

/// Open `p` for reading without blocking on a FIFO that has no writer (`O_NONBLOCK` on the
/// open only; reads then block as usual), refusing symlinks when `nofollow`.
fn open_no_wait(p: &Path, nofollow: bool) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let mut flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    if nofollow {
        flags |= OFlags::NOFOLLOW;
    }
    let fd = rustix::fs::open(p, flags, Mode::empty())?;
    rustix::fs::fcntl_setfl(&fd, OFlags::empty())?;
    Ok(File::from(fd))
}

/// Whether a YAML text holds no document: only blank lines, comments and `---`/`...` markers.
fn holds_no_document(bytes: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return false;
    };
    text.lines().all(|l| {
        let t = l.trim();
        t.is_empty()
            || t.starts_with('#')
            || t == "..."
            || (l.starts_with("---") && {
                let rest = l[3..].trim();
                rest.is_empty() || rest.starts_with('#')
            })
    })
}

/// The identity of a directory, to read each one once.
fn dir_id(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

/// What a directory walk found.
#[derive(Debug, Default)]
struct Walk {
    /// Manifest files, in order (depth first, sorted by name).
    files: Vec<PathBuf>,
    /// What was skipped and why, for stderr.
    notes: Vec<String>,
}

/// Collect the manifest files under `root`: regular files named `*.yaml`, `*.yml`, `*.json`,
/// depth first in name order, skipping hidden entries; every directory is read once.
fn walk(root: &Path, root_meta: &std::fs::Metadata) -> CliResult<Walk> {
    let mut out = Walk::default();
    let mut seen: HashSet<(u64, u64)> = HashSet::from([dir_id(root_meta)]);
    // An explicit stack: a deep tree cannot overflow ours.
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    let mut looked = 0usize;
    while let Some(dir) = stack.pop() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| {
                CliError::invalid(format!("cannot read directory {}: {e}", dir.display()))
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        looked += entries.len();
        if looked > MAX_WALK_ENTRIES {
            return Err(CliError::invalid(format!(
                "{}: more than {MAX_WALK_ENTRIES} entries under it (through its subdirectories and symlinks): name the files or a smaller directory",
                root.display()
            )));
        }
        let mut subdirs = Vec::new();
        for p in entries {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with('.') {
                continue;
            }
            // Follows symlinks: a link to a file or directory counts as what it points to.
            let meta = match std::fs::metadata(&p) {
                Ok(m) => m,
                Err(e) => {
                    if is_manifest(&p) {
                        out.notes
                            .push(format!("skipping {}: cannot read it ({e})", p.display()));
                    }
                    continue;
                }
            };
            if meta.is_dir() {
                if seen.insert(dir_id(&meta)) {
                    subdirs.push(p);
                } else {
                    out.notes.push(format!(
                        "skipping {}: that directory was already read (a symlink loop or a second link to it)",
                        p.display()
                    ));
                }
            } else if is_manifest(&p) && KUSTOMIZATION.contains(&name) {
                out.notes.push(format!(
                    "skipping {}: a kustomization; `-k {}` builds it (with kubectl kustomize)",
                    p.display(),
                    dir.display()
                ));
            } else if is_manifest(&p) {
                if meta.is_file() {
                    out.files.push(p);
                } else {
                    out.notes.push(format!(
                        "skipping {}: not a regular file (a FIFO, socket or device)",
                        p.display()
                    ));
                }
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(out)
}

/// The names of a kustomization file (kustomize's own list).
const KUSTOMIZATION: &[&str] = &["kustomization.yaml", "kustomization.yml", "Kustomization"];

/// `-k DIR`: the manifests a kustomization builds, by `kubectl kustomize DIR` (kustomize's
/// own semantics, from the kubectl every Kubernetes user has), read as one source.
pub fn kustomize(dir: &str) -> CliResult<Vec<Manifest>> {
    // a directory named like a flag (`-x`) is a directory to kubectl too
    let path = if dir.starts_with('-') {
        format!("./{dir}")
    } else {
        dir.to_string()
    };
    let o = std::process::Command::new("kubectl")
        .args(["kustomize", &path])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            CliError::invalid(format!(
                "-k {dir}: builds the kustomization with `kubectl kustomize`, and kubectl cannot be run ({e}): install kubectl, or build it elsewhere and pipe it in (`kustomize build {dir} | boxery apply -f -`)"
            ))
        })?;
    if !o.status.success() {
        return Err(CliError::invalid(format!(
            "-k {dir}: kubectl kustomize failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    if o.stdout.len() > MAX_FILE_BYTES {
        return Err(too_large(&format!("kustomize {dir}")));
    }
    let (ok, errors) = parse_manifests_all(&format!("kustomize {dir}"), &o.stdout);
    refuse_all(errors)?;
    Ok(ok)
}

/// Every refused document, each on a line of its own (`error: FILE, document N (…): …`), and
/// one error that says how many: a person fixing a directory sees every problem at once.
fn refuse_all(mut errors: Vec<boxery_api::codec::ManifestError>) -> CliResult {
    match errors.len() {
        0 => Ok(()),
        1 => Err(CliError::invalid(errors.remove(0))),
        n => {
            for e in &errors {
                eprintln!("error: {}", boxery_verbs::render::safe(&e.to_string()));
            }
            Err(CliError::invalid(format!(
                "{n} documents are invalid (each is shown above); nothing was done"
            )))
        }
    }
}

/// Every manifest file under the directory `p` (see [`walk`]) and its bytes, files that hold
/// no document skipped (with a note); names relative to `p` when `relative`. A directory with
/// no file holding an object is an error.
pub fn read_directory(
    p: &Path,
    meta: &std::fs::Metadata,
    relative: bool,
) -> CliResult<Vec<(String, Vec<u8>)>> {
    let found = walk(p, meta)?;
    for n in &found.notes {
        eprintln!("boxery: {n}");
    }
    let mut sources = Vec::new();
    for file in found.files {
        let name = match file.strip_prefix(p) {
            Ok(rel) if relative => rel.display().to_string(),
            _ => file.display().to_string(),
        };
        // No symlink is followed here that the walk did not check; a file replaced by a FIFO
        // in between does not block.
        let bytes = open_no_wait(&file, false)
            .map_err(|e| CliError::invalid(format!("cannot read {name}: {e}")))
            .and_then(|f| read_bounded(f, &name))?;
        if holds_no_document(&bytes) {
            eprintln!("boxery: skipping {name}: it holds no document");
            continue;
        }
        sources.push((name, bytes));
    }
    if sources.is_empty() {
        return Err(CliError::invalid(format!(
            "{}: the directory holds no .yaml, .yml or .json files with objects in them",
            p.display()
        )));
    }
    Ok(sources)
}

/// Parse and validate named sources (a name, its bytes) all or nothing: every bad document is
/// reported (file, document, field), and two objects of one kind and name are refused.
pub fn parse_sources(sources: &[(String, Vec<u8>)]) -> CliResult<Vec<Manifest>> {
    let total: usize = sources.iter().map(|(_, b)| b.len()).sum();
    if total > MAX_TOTAL_BYTES {
        return Err(CliError::invalid(format!(
            "the manifests may hold at most {} MiB in all; these hold {} MiB",
            MAX_TOTAL_BYTES >> 20,
            total >> 20
        )));
    }
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (name, bytes) in sources {
        if bytes.len() > MAX_FILE_BYTES {
            return Err(too_large(name));
        }
        let (ok, errs) = parse_manifests_all(name, bytes);
        out.extend(ok);
        errors.extend(errs);
    }
    refuse_all(errors)?;
    check_unique(&out)?;
    Ok(out)
}

/// Whether a path names a manifest file (`.yaml`, `.yml`, `.json`) with no hidden component.
pub fn is_manifest_path(path: &str) -> bool {
    is_manifest(Path::new(path)) && !path.split('/').any(|c| c.starts_with('.'))
}

/// `-f` sources and `-k` kustomizations together, refused when one object is named twice.
pub fn read_sources(files: &[String], kustomizations: &[String]) -> CliResult<Vec<Manifest>> {
    if kustomizations.is_empty() {
        return read_all(files);
    }
    let mut out = if files.is_empty() {
        Vec::new()
    } else {
        read_all(files)?
    };
    for k in kustomizations {
        out.extend(kustomize(k)?);
    }
    check_unique(&out)?;
    Ok(out)
}

/// Read and validate every manifest named by `-f` arguments. Any bad document fails the whole
/// read before anything is written. Two objects of one kind and name are refused.
pub fn read_all(files: &[String]) -> CliResult<Vec<Manifest>> {
    read_all_from(files, &mut std::io::stdin().lock())
}

/// [`read_all`], with `-` read from `stdin`.
fn read_all_from(files: &[String], stdin: &mut dyn Read) -> CliResult<Vec<Manifest>> {
    if files.is_empty() {
        return Err(CliError::invalid(
            "give at least one -f FILE, -f DIR or -f -",
        ));
    }
    let mut out: Vec<Manifest> = Vec::new();
    let mut errors = Vec::new();
    let mut total = 0usize;
    let mut count = |name: &str, bytes: &[u8]| -> CliResult {
        total += bytes.len();
        if total > MAX_TOTAL_BYTES {
            return Err(CliError::invalid(format!(
                "{name}: the manifests of one apply may hold at most {} MiB in all: apply them in several runs",
                MAX_TOTAL_BYTES >> 20
            )));
        }
        Ok(())
    };
    for f in files {
        let sources: Vec<(String, Vec<u8>)> = if f == "-" {
            let bytes = read_bounded(&mut *stdin, "<stdin>")?;
            count("<stdin>", &bytes)?;
            vec![("<stdin>".to_string(), bytes)]
        } else {
            let p = Path::new(f);
            let meta = std::fs::metadata(p)
                .map_err(|e| CliError::invalid(format!("cannot read {f}: {e}")))?;
            if meta.is_dir() {
                let sources = read_directory(p, &meta, false)?;
                for (name, bytes) in &sources {
                    count(name, bytes)?;
                }
                sources
            } else {
                let bytes = open_no_wait(p, false)
                    .map_err(|e| CliError::invalid(format!("cannot read {f}: {e}")))
                    .and_then(|file| read_bounded(file, f))?;
                count(f, &bytes)?;
                vec![(f.clone(), bytes)]
            }
        };
        for (name, bytes) in sources {
            let (ok, errs) = parse_manifests_all(&name, &bytes);
            out.extend(ok);
            errors.extend(errs);
        }
    }
    refuse_all(errors)?;
    check_unique(&out)?;
    Ok(out)
}

/// Refuse two manifests of one object.
fn check_unique(out: &[Manifest]) -> CliResult {
    for (i, a) in out.iter().enumerate() {
        if let Some(b) = out[..i].iter().find(|b| {
            b.object.kind == a.object.kind && b.object.metadata.name == a.object.metadata.name
        }) {
            return Err(CliError::invalid(format!(
                "{}, document {}: {} {} is also defined in {}, document {}: one apply may name an object only once",
                a.source_name,
                a.document,
                a.object.kind,
                a.object.metadata.name,
                b.source_name,
                b.document
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VM: &str = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {name: NAME}\nspec: {source: {image: debian-12}}\n";

    fn vm(name: &str) -> String {
        VM.replace("NAME", name)
    }

    fn s(p: &Path) -> String {
        p.to_str().unwrap().to_string()
    }

    /// A reader that never ends, counting what was taken from it.
    struct Endless(u64);
    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(b'y');
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
    }

    #[test]
    fn endless_stdin_is_refused_after_the_limit() {
        let mut r = Endless(0);
        let e = read_all_from(&["-".into()], &mut r).unwrap_err();
        assert_eq!(e.code, crate::exit::Code::Invalid);
        assert!(e.error.to_string().contains("at most 8 MiB"), "{e:?}");
        assert_eq!(r.0, (MAX_FILE_BYTES + 1) as u64, "read no more than needed");
    }

    #[test]
    fn only_comments_are_no_document() {
        assert!(holds_no_document(b"# a\n\n---\n  # b\n--- # c\n...\n"));
        assert!(holds_no_document(b""));
        assert!(!holds_no_document(b"# a\nkind: Vm\n"));
        assert!(!holds_no_document(b"--- {}\n"));
        assert!(!holds_no_document(&[0xff, 0]));
    }

    #[test]
    fn a_directory_skips_comment_only_files_and_reads_each_directory_once() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("m");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("a.yaml"), vm("a")).unwrap();
        std::fs::write(root.join("notes.yaml"), "# nothing yet\n---\n").unwrap();
        std::fs::write(root.join("sub/b.yml"), vm("b")).unwrap();
        // Loops: to the root, to the parent, to itself, and a second link to sub.
        std::os::unix::fs::symlink("..", root.join("sub/up")).unwrap();
        std::os::unix::fs::symlink("..", root.join("parent")).unwrap();
        std::os::unix::fs::symlink(".", root.join("sub/self")).unwrap();
        std::os::unix::fs::symlink("sub", root.join("sub2")).unwrap();
        let meta = std::fs::metadata(&root).unwrap();
        let w = walk(&root, &meta).unwrap();
        // `parent` leads out to d, whose `m` is the root: read once, found nothing new.
        assert_eq!(
            w.files,
            vec![
                root.join("a.yaml"),
                root.join("notes.yaml"),
                root.join("sub/b.yml")
            ]
        );
        assert!(w.notes.iter().any(|n| n.contains("sub2")), "{:?}", w.notes);
        assert!(
            w.notes.iter().any(|n| n.contains("sub/up")),
            "{:?}",
            w.notes
        );
        let m = read_all_from(&[s(&root)], &mut std::io::empty()).unwrap();
        let names: Vec<&str> = m.iter().map(|m| m.object.metadata.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn a_named_file_of_only_comments_is_still_an_error() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("c.yaml");
        std::fs::write(&f, "# nothing\n").unwrap();
        let e = read_all_from(&[s(&f)], &mut std::io::empty()).unwrap_err();
        assert_eq!(e.code, crate::exit::Code::Invalid);
    }

    #[test]
    fn the_total_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        // Nine files of 7.5 MiB: each under the file limit, together over the total.
        let mut doc = vm("x").into_bytes();
        doc.extend(b"# ");
        doc.resize((MAX_FILE_BYTES / 16) * 15, b'x');
        doc.push(b'\n');
        let mut args = Vec::new();
        for i in 0..(MAX_TOTAL_BYTES / doc.len() + 1) {
            let f = d.path().join(format!("f{i}.yaml"));
            std::fs::write(&f, &doc).unwrap();
            args.push(s(&f));
        }
        let e = read_all_from(&args, &mut std::io::empty()).unwrap_err();
        assert!(e.error.to_string().contains("in all"), "{e:?}");
    }
}
