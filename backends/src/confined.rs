//! Filesystem operations on boxery's own trees (under `$BOXERY_HOME`) that cannot leave them.
//!
//! # Guarantees
//! - [`child`] joins a validated [`Name`]: one plain component, never `..`, `/` or absolute.
//! - [`remove_within`] removes only a path strictly inside `root`, reached without following
//!   a symlink: a path with `..`, an absolute path elsewhere, or one whose parent directories
//!   include a symlink is refused; a symlink at the path itself is removed, never followed.
//!   A directory tree is removed without following the symlinks inside it.
//!
//! # Caveats
//! - `root` itself may be a symlink (a home the owner moved); only what lies below it is
//!   checked.

use std::io::{Error, ErrorKind};
use std::path::{Component, Path, PathBuf};

use boxery_api::Name;

/// `root/name`.
pub fn child(root: &Path, name: &Name) -> PathBuf {
    root.join(name.as_path())
}

fn refuse(root: &Path, path: &Path, why: &str) -> Error {
    Error::new(
        ErrorKind::PermissionDenied,
        format!(
            "refusing to remove {}: {why} (only what lies inside {} is boxery's to remove)",
            path.display(),
            root.display()
        ),
    )
}

/// Remove the file, symlink or directory tree at `path`, which must lie strictly inside
/// `root` (see the module's guarantees). `Ok(false)` when it is already gone.
pub fn remove_within(root: &Path, path: &Path) -> std::io::Result<bool> {
    let rel = path
        .strip_prefix(root)
        .map_err(|_| refuse(root, path, "it is not inside"))?;
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(p) => Ok(p),
            _ => Err(refuse(root, path, "its path leaves the tree")),
        })
        .collect::<Result<_, _>>()?;
    let Some((_, parents)) = parts.split_last() else {
        return Err(refuse(root, path, "it is the tree itself"));
    };
    let mut cur = root.to_path_buf();
    for p in parents {
        cur.push(p);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refuse(root, path, "a directory on its way is a symlink"));
            }
            Ok(m) if !m.is_dir() => return Ok(false),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let r = if meta.is_dir() {
        // std's remove_dir_all does not follow symlinks inside the tree.
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_inside_its_tree() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("home/leases");
        let outside = d.path().join("precious");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(outside.join("sub")).unwrap();
        std::fs::write(outside.join("sub/file"), "keep").unwrap();

        // `..`, absolute paths and the root itself are refused.
        for p in [
            root.join(".."),
            root.join("../precious"),
            outside.clone(),
            root.clone(),
            PathBuf::from("/"),
        ] {
            assert!(remove_within(&root, &p).is_err(), "{}", p.display());
        }
        // A symlink at the path is removed itself; its target stays.
        std::os::unix::fs::symlink(&outside, root.join("l1")).unwrap();
        assert!(remove_within(&root, &root.join("l1")).unwrap());
        assert!(!root.join("l1").exists());
        // A symlinked directory on the way is refused.
        std::os::unix::fs::symlink(&outside, root.join("l2")).unwrap();
        assert!(remove_within(&root, &root.join("l2/sub")).is_err());
        // A tree with a symlink inside is removed without following it.
        std::fs::create_dir_all(root.join("k1")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("k1/out")).unwrap();
        assert!(remove_within(&root, &root.join("k1")).unwrap());
        assert!(!remove_within(&root, &root.join("k1")).unwrap());
        assert_eq!(
            std::fs::read_to_string(outside.join("sub/file")).unwrap(),
            "keep"
        );
        let n = Name::label("k2").unwrap();
        assert_eq!(child(&root, &n), root.join("k2"));
    }
}
