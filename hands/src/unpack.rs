//! Unpacking the tar stream a VM sends for `boxery cp VM:PATH …` and `vm_copy`. A compromised
//! guest writes that stream, so every member is checked before anything is made, and this
//! module makes every file itself (no `tar -x` on this host).
//!
//! # Guarantees
//! - A copy is one tree with one top: the source (a file, or a directory and what is below it).
//!   Every member lies at or below the one top-level name expected (the source's basename, or
//!   `.` for a directory named without one, like `dev1:`), as a relative path of plain
//!   components: no absolute path, no `..`, nothing beside the top.
//! - Only regular files, directories, symlinks and hard links are admitted; a device, a FIFO
//!   or any other member refuses the whole copy. A symlink's target is relative, has no `..`
//!   after a plain component and, read from where the link is, stays within the copy; a hard
//!   link names a regular file already admitted from the same archive. Nothing is written
//!   through a symlink: a member's parent must be a directory admitted before it, and a name
//!   is admitted once.
//! - [`unpack`] writes under a fresh directory it is given and nowhere else: files are made
//!   with `O_CREAT|O_EXCL` (never following a link), directories with `mkdir`, hard links
//!   only to files it made. Modes keep the permission bits only (no setuid, setgid, sticky;
//!   directories stay writable by their owner); owners are whoever runs boxery; file mtimes
//!   are kept.
//! - [`filter`] re-writes an admitted archive as a clean one under the name [`TOP`] (for a VM
//!   to VM copy: the destination guest only ever receives what this host checked).
//!
//! # Caveats
//! - Sizes are not capped: a guest can fill the destination's disk or, with one huge GNU
//!   long-name member, this process's memory. A failed copy leaves nothing behind (its
//!   staging directory is removed), a full disk aside.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use boxery_api::name::safe;

/// The name the copy's top has in a staging directory and in a [`filter`]ed archive.
pub const TOP: &str = "copy";

/// The empty file a [`filter`]ed archive ends with, beside [`TOP`], once every member passed:
/// a receiver that does not find it after unpacking must discard the copy (the stream was cut
/// short, or refused half way).
pub const DONE: &str = "done";

/// What the archive's top-level name must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Top {
    /// The source's basename: members are `NAME` and `NAME/…` (or `./NAME…`).
    Name(String),
    /// A directory sent as `tar -C DIR -cf - .`: members are `./` and `./…`.
    Dot,
}

/// What the copy turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One regular file.
    File,
    /// A directory (and what is below it).
    Dir,
}

/// A copy that could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// A member that a copy must not hold.
    #[error("the VM sent `{member}`, {why}: nothing was copied")]
    Refused {
        /// The member's name (escaped).
        member: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// The archive holds no member at all.
    #[error("the VM sent an empty archive: nothing was copied")]
    Empty,
    /// The stream is not a readable tar archive.
    #[error("cannot read the archive the VM sent")]
    Read(#[source] io::Error),
    /// A member could not be written.
    #[error("cannot write `{member}`")]
    Write {
        /// The member's name (escaped).
        member: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// One admitted member, relative to the top (`""` is the top itself).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Member {
    Dir,
    File,
    Symlink(PathBuf),
    HardLink(PathBuf),
}

/// The checks, member by member (see the module's guarantees).
#[derive(Debug)]
struct Admit {
    top: Top,
    made: HashMap<PathBuf, Member>,
}

fn shown_path(p: &Path) -> String {
    safe(&p.to_string_lossy()).into_owned()
}

fn refuse<T>(p: &Path, why: &'static str) -> Result<T, UnpackError> {
    Err(UnpackError::Refused {
        member: shown_path(p),
        why,
    })
}

impl Admit {
    fn new(top: Top) -> Admit {
        Admit {
            top,
            made: HashMap::new(),
        }
    }

    /// The member's path relative to the top, or why it is refused.
    fn relative(&self, path: &Path) -> Result<PathBuf, UnpackError> {
        let mut parts = path.components().peekable();
        while parts.peek() == Some(&Component::CurDir) {
            parts.next();
        }
        if let Top::Name(name) = &self.top {
            match parts.next() {
                Some(Component::Normal(n)) if n == name.as_str() => {}
                _ => return refuse(path, "which is not below the one name asked for"),
            }
        }
        let mut rel = PathBuf::new();
        for c in parts {
            match c {
                Component::Normal(n) => rel.push(n),
                Component::CurDir => {}
                _ => return refuse(path, "a path that leaves the copy"),
            }
        }
        Ok(rel)
    }

    /// Check one member; returns its path relative to the top.
    fn admit(
        &mut self,
        path: &Path,
        kind: tar::EntryType,
        link: Option<&Path>,
    ) -> Result<Option<(PathBuf, Member)>, UnpackError> {
        use tar::EntryType as E;
        if kind == E::XGlobalHeader {
            return Ok(None); // metadata for the whole archive, nothing to make
        }
        let rel = self.relative(path)?;
        if self.made.contains_key(&rel) {
            return refuse(path, "a name that appears twice");
        }
        let parent_ok = match rel.parent() {
            None => true, // the top itself
            Some(p) => self.made.get(p) == Some(&Member::Dir),
        };
        if !parent_ok {
            return refuse(path, "which is not inside a directory of the copy");
        }
        let top_file = self.made.get(Path::new("")) == Some(&Member::File);
        if top_file {
            return refuse(path, "a second member after the file asked for");
        }
        let member = match kind {
            E::Directory => Member::Dir,
            E::Regular | E::Continuous | E::GNUSparse => Member::File,
            E::Symlink => {
                let Some(target) = link.filter(|t| !t.as_os_str().is_empty()) else {
                    return refuse(path, "a symlink with no target");
                };
                if !self.link_stays_inside(&rel, target) {
                    return refuse(path, "a symlink that points outside the copy");
                }
                Member::Symlink(target.to_path_buf())
            }
            E::Link => {
                let target = match link {
                    Some(t) => self.relative(t)?,
                    None => return refuse(path, "a hard link with no target"),
                };
                if self.made.get(&target) != Some(&Member::File) {
                    return refuse(
                        path,
                        "a hard link to something other than a file of the copy",
                    );
                }
                Member::HardLink(target)
            }
            _ => return refuse(path, "which is a device, a FIFO or another special file"),
        };
        if rel.as_os_str().is_empty() && matches!(member, Member::Symlink(_) | Member::HardLink(_))
        {
            return refuse(
                path,
                "a link where the file or directory asked for should be: copy what it points to",
            );
        }
        self.made.insert(rel.clone(), member.clone());
        Ok(Some((rel, member)))
    }

    /// A symlink at `rel` (below the top) pointing to `target` resolves, lexically, within
    /// the copy; `..` only at the start, so what it walks up through is the real directories
    /// its parents are (checked), never another link.
    fn link_stays_inside(&self, rel: &Path, target: &Path) -> bool {
        let mut depth = rel.components().count() as i64 - 1; // the link's directory
        let mut down = false;
        for c in target.components() {
            match c {
                Component::ParentDir if !down => depth -= 1,
                Component::Normal(_) => {
                    down = true;
                    depth += 1;
                }
                Component::CurDir => {}
                _ => return false,
            }
            if depth < 0 {
                return false;
            }
        }
        true
    }

    fn kind(&self) -> Option<Kind> {
        match self.made.get(Path::new("")) {
            Some(Member::File) => Some(Kind::File),
            Some(Member::Dir) => Some(Kind::Dir),
            _ => None,
        }
    }
}

/// `TOP/rel` (`TOP` itself for the top: `Path::join("")` would add a `/`).
fn under_top(rel: &Path) -> PathBuf {
    if rel.as_os_str().is_empty() {
        PathBuf::from(TOP)
    } else {
        Path::new(TOP).join(rel)
    }
}

fn mtime_of(h: &tar::Header) -> Option<SystemTime> {
    h.mtime()
        .ok()
        .and_then(|s| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(s)))
}

/// An entry of an archive as [`Admit`] takes it: the entry, its path, where it lands under
/// the top and what it is.
type Admitted<'a, R> = (tar::Entry<'a, R>, PathBuf, PathBuf, Member);

/// Read `entry` and pass it through `admit`: `None` for a member it skips.
fn admitted<'a, R: Read>(
    entry: io::Result<tar::Entry<'a, R>>,
    admit: &mut Admit,
) -> Result<Option<Admitted<'a, R>>, UnpackError> {
    let entry = entry.map_err(UnpackError::Read)?;
    let path = entry.path().map_err(UnpackError::Read)?.into_owned();
    let link = entry
        .link_name()
        .map_err(UnpackError::Read)?
        .map(|l| l.into_owned());
    let kind = entry.header().entry_type();
    let admitted = admit.admit(&path, kind, link.as_deref())?;
    Ok(admitted.map(|(rel, member)| (entry, path, rel, member)))
}

/// Read the archive the VM sends on `r`, check every member, and make the copy at
/// `staging/`[`TOP`]; `staging` is an empty directory this process just made. Returns what the
/// copy is; on error, what was made stays in `staging` for its owner to remove.
pub fn unpack(r: impl Read, top: Top, staging: &Path) -> Result<Kind, UnpackError> {
    let at = |rel: &Path| staging.join(under_top(rel));
    let mut admit = Admit::new(top);
    let mut archive = tar::Archive::new(r);
    for entry in archive.entries().map_err(UnpackError::Read)? {
        let Some((mut entry, path, rel, member)) = admitted(entry, &mut admit)? else {
            continue;
        };
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        let dst = at(&rel);
        let wrote = |e: io::Error| UnpackError::Write {
            member: shown_path(&path),
            source: e,
        };
        match member {
            Member::Dir => std::fs::DirBuilder::new()
                .mode(mode | 0o700)
                .create(&dst)
                .map_err(wrote)?,
            Member::File => {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(mode)
                    .open(&dst)
                    .map_err(wrote)?;
                io::copy(&mut entry, &mut f).map_err(UnpackError::Read)?;
                if let Some(t) = mtime_of(entry.header()) {
                    f.set_modified(t).map_err(wrote)?;
                }
            }
            Member::Symlink(target) => {
                std::os::unix::fs::symlink(&target, &dst).map_err(wrote)?;
            }
            Member::HardLink(to) => std::fs::hard_link(at(&to), &dst).map_err(wrote)?,
        }
    }
    admit.kind().ok_or(UnpackError::Empty)
}

/// Read the archive on `r`, check every member, and write the admitted ones to `w` as a new
/// archive whose top is [`TOP`] (`TOP`, `TOP/…`), followed by [`DONE`] when all passed.
/// Returns what the copy is.
pub fn filter(r: impl Read, top: Top, w: impl Write) -> Result<Kind, UnpackError> {
    let mut admit = Admit::new(top);
    let mut archive = tar::Archive::new(r);
    let mut out = tar::Builder::new(w);
    let written = |e: io::Error| UnpackError::Write {
        member: "the archive for the destination".into(),
        source: e,
    };
    for entry in archive.entries().map_err(UnpackError::Read)? {
        let Some((mut entry, _, rel, member)) = admitted(entry, &mut admit)? else {
            continue;
        };
        let name = under_top(&rel);
        let mut h = tar::Header::new_gnu();
        h.set_mode(entry.header().mode().unwrap_or(0o644) & 0o777);
        h.set_mtime(entry.header().mtime().unwrap_or(0));
        match member {
            Member::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                out.append_data(&mut h, &name, io::empty())
                    .map_err(written)?;
            }
            Member::File => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(entry.size());
                out.append_data(&mut h, &name, &mut entry)
                    .map_err(written)?;
            }
            Member::Symlink(target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                out.append_link(&mut h, &name, &target).map_err(written)?;
            }
            Member::HardLink(to) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                out.append_link(&mut h, &name, under_top(&to))
                    .map_err(written)?;
            }
        }
    }
    let kind = admit.kind().ok_or(UnpackError::Empty)?;
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o600);
    h.set_size(0);
    out.append_data(&mut h, DONE, io::empty())
        .map_err(written)?;
    out.into_inner()
        .map_err(written)?
        .flush()
        .map_err(written)?;
    Ok(kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::tree;
    use std::process::Command;

    /// A tar archive made by GNU tar (`tar -C dir -cf - ARGS…`).
    fn gnu_tar(dir: &Path, args: &[&str]) -> Vec<u8> {
        let o = Command::new("tar")
            .arg("-C")
            .arg(dir)
            .arg("-cf")
            .arg("-")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        o.stdout
    }

    /// One member of a hand-made archive: path, type, link target, content.
    type Raw<'a> = (&'a str, tar::EntryType, &'a str, &'a str);

    /// A member written `KIND PATH [LINK or DATA]` (see `hostile_archives_are_refused`).
    fn member(m: &str) -> Raw<'_> {
        use tar::EntryType as E;
        let mut w = m.splitn(3, ' ');
        let (k, path, rest) = (w.next().unwrap(), w.next().unwrap(), w.next().unwrap_or(""));
        let kind = match k {
            "f" => E::Regular,
            "d" => E::Directory,
            "s" => E::Symlink,
            "h" => E::Link,
            "c" => E::Char,
            "p" => E::Fifo,
            _ => panic!("no member kind {k}"),
        };
        match k {
            "s" | "h" => (path, kind, rest, ""),
            _ => (path, kind, "", rest),
        }
    }

    /// A hand-made archive.
    fn archive(members: &[Raw]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o755);
            h.set_size(data.len() as u64);
            // set_path refuses `..`: write the name bytes directly, as a hostile tar would
            let name = &mut h.as_old_mut().name;
            name[..path.len()].copy_from_slice(path.as_bytes());
            if !link.is_empty() {
                h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_cksum();
            b.append(&h, data.as_bytes()).unwrap();
        }
        b.into_inner().unwrap()
    }

    /// A real GNU tar archive of a directory (nested dirs, a relative link inside, a hard
    /// link, an executable) is unpacked whole, and byte for byte.
    #[test]
    fn unpacks_real_tar_archives() {
        let src = tempfile::tempdir().unwrap();
        let p = src.path().join("proj");
        std::fs::create_dir_all(p.join("src/bin")).unwrap();
        std::fs::write(p.join("src/main.rs"), "fn main() {}\n").unwrap();
        std::fs::write(p.join("src/bin/run"), "#!/bin/sh\n").unwrap();
        Command::new("chmod")
            .args(["4755"])
            .arg(p.join("src/bin/run"))
            .status()
            .unwrap();
        std::os::unix::fs::symlink("../main.rs", p.join("src/bin/main")).unwrap();
        std::os::unix::fs::symlink("src", p.join("s")).unwrap();
        std::fs::hard_link(p.join("src/main.rs"), p.join("again.rs")).unwrap();
        let long = "n".repeat(150); // a GNU long-name member
        std::fs::write(p.join("src").join(&long), "long").unwrap();
        let tar = gnu_tar(src.path(), &["./proj"]);
        let out = tempfile::tempdir().unwrap();
        let kind = unpack(&tar[..], Top::Name("proj".into()), out.path()).unwrap();
        assert_eq!(kind, Kind::Dir);
        let copy = out.path().join(TOP);
        assert_eq!(
            tree(&copy),
            [
                "again.rs",
                "s -> src",
                "src/",
                "src/bin/",
                "src/bin/main -> ../main.rs",
                "src/bin/run",
                "src/main.rs",
                &format!("src/{long}"),
            ]
        );
        assert_eq!(
            std::fs::read_to_string(copy.join("src").join(&long)).unwrap(),
            "long"
        );
        assert_eq!(
            std::fs::read_to_string(copy.join("s/bin/main")).unwrap(),
            "fn main() {}\n"
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(copy.join("src/bin/run"))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o7000, 0, "setuid kept: {mode:o}");
        assert_eq!(mode & 0o100, 0o100, "the executable bit was lost: {mode:o}");

        // `tar -C DIR -cf - .` (a directory named without a basename)
        let tar = gnu_tar(&p, &["."]);
        let out = tempfile::tempdir().unwrap();
        assert_eq!(unpack(&tar[..], Top::Dot, out.path()).unwrap(), Kind::Dir);
        assert!(out.path().join("copy/src/bin/run").is_file());

        // one file
        let tar = gnu_tar(&p.join("src"), &["./main.rs"]);
        let out = tempfile::tempdir().unwrap();
        assert_eq!(
            unpack(&tar[..], Top::Name("main.rs".into()), out.path()).unwrap(),
            Kind::File
        );
        assert_eq!(
            std::fs::read_to_string(out.path().join(TOP)).unwrap(),
            "fn main() {}\n"
        );
    }

    /// What a compromised guest would send instead of `report.txt`: each is refused, and
    /// nothing lands outside the staging directory.
    #[test]
    fn hostile_archives_are_refused() {
        // One case a line, `WHAT: MEMBERS`; a member is `KIND PATH [LINK or DATA]`: f a file
        // (and its data), d a directory, s a symlink, h a hard link, c a device, p a fifo.
        const CASES: &str = "another name: f .bashrc pwned
            a second top: f report.txt ok, f .bashrc pwned
            a directory claimed, holding dotfiles, and a sibling: d report.txt/, f report.txt/.bashrc pwned, f x/../.bashrc pwned
            dot-dot: f report.txt/../../.bashrc pwned
            absolute: f /tmp/pwned pwned
            absolute symlink then a write through it: d report.txt/, s report.txt/l /tmp, f report.txt/l/pwned pwned
            relative symlink out: d report.txt/, s report.txt/l ../..
            dot-dot after a name: d report.txt/, s report.txt/l a/../../x
            write through an inside symlink: d report.txt/, d report.txt/d/, s report.txt/l d, f report.txt/l/f x
            the same name twice (file over symlink): d report.txt/, s report.txt/l ., f report.txt/l x
            a hard link to a host file: d report.txt/, h report.txt/h /etc/passwd
            a hard link to a directory: d report.txt/, h report.txt/h report.txt
            a device: c report.txt
            a fifo: p report.txt
            the top a symlink: s report.txt /
            a child before its directory: f report.txt/a/b x
            nothing: ";
        let cases = CASES.lines().map(|l| {
            let (what, members) = l.trim().split_once(':').expect("WHAT: MEMBERS");
            (
                what,
                members
                    .trim()
                    .split(", ")
                    .filter(|m| !m.is_empty())
                    .map(member)
                    .collect::<Vec<_>>(),
            )
        });
        for (what, members) in cases {
            let base = tempfile::tempdir().unwrap();
            let staging = base.path().join("staging");
            std::fs::create_dir(&staging).unwrap();
            let tar = archive(&members);
            let r = unpack(&tar[..], Top::Name("report.txt".into()), &staging);
            assert!(r.is_err(), "{what}: admitted ({r:?})");
            let f = filter(&tar[..], Top::Name("report.txt".into()), Vec::new());
            assert!(f.is_err(), "{what}: the filter passed it");
            assert_eq!(
                tree(base.path())
                    .iter()
                    .filter(|p| !p.starts_with("staging"))
                    .count(),
                0,
                "{what}: wrote outside the staging directory: {:?}",
                tree(base.path())
            );
            assert!(!Path::new("/tmp/pwned").exists());
        }
    }

    /// The filtered archive unpacks (by GNU tar, as a destination guest does) to the same
    /// tree, under `copy/`; a name starting with `-` is a member, not an option.
    #[test]
    fn filter_rewrites_under_one_top() {
        let src = tempfile::tempdir().unwrap();
        let p = src.path().join("-rf");
        std::fs::create_dir_all(p.join("d")).unwrap();
        std::fs::write(p.join("d/f"), "x").unwrap();
        std::os::unix::fs::symlink("d/f", p.join("l")).unwrap();
        let tar = gnu_tar(src.path(), &["./-rf"]);
        let mut clean = Vec::new();
        assert_eq!(
            filter(&tar[..], Top::Name("-rf".into()), &mut clean).unwrap(),
            Kind::Dir
        );
        let out = tempfile::tempdir().unwrap();
        let mut t = Command::new("tar")
            .arg("-C")
            .arg(out.path())
            .args(["-xf", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        t.stdin.take().unwrap().write_all(&clean).unwrap();
        assert!(t.wait().unwrap().success());
        assert_eq!(
            tree(out.path()),
            ["copy/", "copy/d/", "copy/d/f", "copy/l -> d/f", "done"]
        );
    }
}
