//! qcow2 files through `qemu-img` (JSON output where it has one) and `cp`.
//!
//! Every disk and image is one qcow2 overlay on a read-only base. Nothing here ever commits
//! into a backing file: the only chain operations are `rebase` onto a *named* base and
//! copies of whole overlays.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tokio::process::Command;

/// A failed disk operation.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The tool could not be run.
    #[error("could not run {tool}: install qemu-utils (qemu-img) and coreutils")]
    Spawn {
        /// `qemu-img` or `cp`.
        tool: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The tool ran and failed.
    #[error("{op} {path} failed: {stderr}")]
    Failed {
        /// What was done (`qemu-img create`).
        op: String,
        /// The file.
        path: PathBuf,
        /// Its stderr.
        stderr: String,
    },
    /// `qemu-img info` printed something that is not the JSON we expect.
    #[error("could not parse `qemu-img info` of {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// What `qemu-img info` says about one file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DiskInfo {
    /// The guest-visible size in bytes.
    pub virtual_size: u64,
    /// Bytes allocated on the host.
    #[serde(default)]
    pub actual_size: Option<u64>,
    /// `qcow2`, `raw`, …
    pub format: String,
    /// The backing file as written in the header.
    #[serde(default)]
    pub backing_filename: Option<String>,
    /// The backing file, resolved to a full path.
    #[serde(default)]
    pub full_backing_filename: Option<String>,
    /// The format's own fields (qcow2: `{"type": "qcow2", "data": {"data-file": …}}`).
    #[serde(default)]
    pub format_specific: Option<serde_json::Value>,
}

impl DiskInfo {
    /// The external data file a qcow2 header names (its clusters live in that file), if any.
    pub fn data_file(&self) -> Option<&str> {
        self.format_specific.as_ref()?["data"]["data-file"].as_str()
    }

    /// The backing file's path (resolved), if any.
    pub fn backing(&self) -> Option<PathBuf> {
        self.full_backing_filename
            .as_ref()
            .or(self.backing_filename.as_ref())
            .map(PathBuf::from)
    }
}

/// `qemu-img` and `cp`, run as child processes.
#[derive(Debug, Clone)]
pub struct Disks {
    qemu_img: PathBuf,
}

impl Disks {
    /// Use this `qemu-img`.
    pub fn new(qemu_img: PathBuf) -> Self {
        Disks { qemu_img }
    }

    async fn run(
        &self,
        tool: &Path,
        op: &str,
        path: &Path,
        args: &[&std::ffi::OsStr],
    ) -> Result<Vec<u8>, DiskError> {
        let out = Command::new(tool)
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|source| DiskError::Spawn {
                tool: tool.display().to_string(),
                source,
            })?;
        if !out.status.success() {
            return Err(DiskError::Failed {
                op: op.into(),
                path: path.to_path_buf(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(out.stdout)
    }

    /// `qemu-img info` (with `-U`: the file may be open in a running QEMU).
    pub async fn info(&self, path: &Path) -> Result<DiskInfo, DiskError> {
        let out = self
            .run(
                &self.qemu_img,
                "qemu-img info",
                path,
                &[
                    "info".as_ref(),
                    "--output=json".as_ref(),
                    "-U".as_ref(),
                    path.as_os_str(),
                ],
            )
            .await?;
        serde_json::from_slice(&out).map_err(|source| DiskError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The files of `path`'s backing chain, top (`path`) first, base last, as the headers say.
    pub async fn chain(&self, path: &Path) -> Result<Vec<PathBuf>, DiskError> {
        #[derive(Deserialize)]
        struct Entry {
            filename: String,
        }
        let out = self
            .run(
                &self.qemu_img,
                "qemu-img info --backing-chain",
                path,
                &[
                    "info".as_ref(),
                    "--backing-chain".as_ref(),
                    "--output=json".as_ref(),
                    "-U".as_ref(),
                    path.as_os_str(),
                ],
            )
            .await?;
        let entries: Vec<Entry> =
            serde_json::from_slice(&out).map_err(|source| DiskError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(entries
            .into_iter()
            .map(|e| PathBuf::from(e.filename))
            .collect())
    }

    /// Create a qcow2 overlay at `path` on `backing` (a qcow2). With `size`, the overlay is
    /// that big and `backing` is not opened (it may be open for writing in a running QEMU);
    /// without, it takes the backing file's size.
    pub async fn create_overlay(
        &self,
        path: &Path,
        backing: &Path,
        size: Option<u64>,
    ) -> Result<(), DiskError> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "create".into(),
            "-q".into(),
            "-f".into(),
            "qcow2".into(),
            "-F".into(),
            "qcow2".into(),
            "-b".into(),
        ];
        args.push(backing.as_os_str().to_owned());
        if size.is_some() {
            args.push("-u".into());
        }
        args.push(path.as_os_str().to_owned());
        if let Some(s) = size {
            args.push(s.to_string().into());
        }
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        self.run(&self.qemu_img, "qemu-img create", path, &args)
            .await
            .map(drop)
    }

    /// Grow `path` to `bytes` (offline only).
    pub async fn resize(&self, path: &Path, bytes: u64) -> Result<(), DiskError> {
        let size = bytes.to_string();
        self.run(
            &self.qemu_img,
            "qemu-img resize",
            path,
            &[
                "resize".as_ref(),
                "-q".as_ref(),
                "-f".as_ref(),
                "qcow2".as_ref(),
                path.as_os_str(),
                size.as_ref(),
            ],
        )
        .await
        .map(drop)
    }

    /// Pull everything between `path` and `base` into `path` and make `base` its backing file
    /// (a safe rebase: the guest sees the same data). Offline only.
    pub async fn rebase(&self, path: &Path, base: &Path) -> Result<(), DiskError> {
        self.rebase_with(path, base, "qemu-img rebase", "-q").await
    }

    /// Point `path`'s header at `base` without copying data (`rebase -u`): only correct when
    /// `base` holds the same data as the old backing file.
    pub async fn rebase_unsafe(&self, path: &Path, base: &Path) -> Result<(), DiskError> {
        self.rebase_with(path, base, "qemu-img rebase -u", "-u")
            .await
    }

    /// `qemu-img rebase MODE` of qcow2 `path` onto qcow2 `base` (`what` names it in errors).
    async fn rebase_with(
        &self,
        path: &Path,
        base: &Path,
        what: &str,
        mode: &str,
    ) -> Result<(), DiskError> {
        self.run(
            &self.qemu_img,
            what,
            path,
            &[
                "rebase".as_ref(),
                mode.as_ref(),
                "-f".as_ref(),
                "qcow2".as_ref(),
                "-F".as_ref(),
                "qcow2".as_ref(),
                "-b".as_ref(),
                base.as_os_str(),
                path.as_os_str(),
            ],
        )
        .await
        .map(drop)
    }

    /// Convert any image `src` into a standalone qcow2 `dst` (no backing file).
    pub async fn convert(&self, src: &Path, dst: &Path) -> Result<(), DiskError> {
        self.convert_as(src, None, dst).await
    }

    /// Convert `src`, read as `format` (never probed: a raw disk whose bytes look like a
    /// qcow2 header must not be read as one), into a standalone qcow2 `dst`.
    pub async fn convert_from(
        &self,
        src: &Path,
        format: &str,
        dst: &Path,
    ) -> Result<(), DiskError> {
        self.convert_as(src, Some(format), dst).await
    }

    async fn convert_as(
        &self,
        src: &Path,
        format: Option<&str>,
        dst: &Path,
    ) -> Result<(), DiskError> {
        use std::ffi::OsStr;
        let mut args: Vec<&OsStr> = vec![OsStr::new("convert"), OsStr::new("-q")];
        if let Some(f) = format {
            args.extend([OsStr::new("-f"), OsStr::new(f)]);
        }
        args.extend([
            OsStr::new("-O"),
            OsStr::new("qcow2"),
            src.as_os_str(),
            dst.as_os_str(),
        ]);
        self.run(&self.qemu_img, "qemu-img convert", src, &args)
            .await
            .map(drop)
    }

    /// The first 512 bytes of the guest's view of `src`, read as `format`.
    pub async fn first_sector(&self, src: &Path, format: &str) -> Result<Vec<u8>, DiskError> {
        let tmp = tempfile::NamedTempFile::new().map_err(|e| DiskError::Failed {
            op: "qemu-img dd".into(),
            path: src.to_path_buf(),
            stderr: e.to_string(),
        })?;
        let of = format!("of={}", tmp.path().display());
        let ifile = format!("if={}", src.display());
        self.run(
            &self.qemu_img,
            "qemu-img dd",
            src,
            &[
                "dd".as_ref(),
                "-f".as_ref(),
                format.as_ref(),
                "-O".as_ref(),
                "raw".as_ref(),
                "bs=512".as_ref(),
                "count=1".as_ref(),
                ifile.as_ref(),
                of.as_ref(),
            ],
        )
        .await?;
        std::fs::read(tmp.path()).map_err(|e| DiskError::Failed {
            op: "qemu-img dd".into(),
            path: src.to_path_buf(),
            stderr: e.to_string(),
        })
    }

    /// Copy a file, sharing blocks where the filesystem can (`cp --reflink=auto`) and keeping
    /// holes: on XFS/btrfs instant, elsewhere a copy of the allocated data only.
    pub async fn copy(&self, src: &Path, dst: &Path) -> Result<(), DiskError> {
        self.run(
            Path::new("cp"),
            "cp",
            src,
            &[
                "--reflink=auto".as_ref(),
                "--sparse=always".as_ref(),
                src.as_os_str(),
                dst.as_os_str(),
            ],
        )
        .await
        .map(drop)
    }
}

/// Bytes a file takes on the host (allocated blocks), 0 when it is missing.
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// One GiB.
pub const GIB: u64 = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    fn have_qemu_img() -> bool {
        std::process::Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    #[tokio::test]
    async fn overlay_chain_and_rebase() {
        if !have_qemu_img() {
            panic!("qemu-img is missing: run scripts/install-deps.sh");
        }
        let d = tempfile::tempdir().unwrap();
        let disks = Disks::new("qemu-img".into());
        let base = d.path().join("base.qcow2");
        let out = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&base)
            .arg("64M")
            .output()
            .unwrap();
        assert!(out.status.success());
        let mid = d.path().join("mid.qcow2");
        let top = d.path().join("top.qcow2");
        disks.create_overlay(&mid, &base, None).await.unwrap();
        disks
            .create_overlay(&top, &mid, Some(128 << 20))
            .await
            .unwrap();
        let info = disks.info(&top).await.unwrap();
        assert_eq!(info.virtual_size, 128 << 20);
        assert_eq!(info.format, "qcow2");
        assert_eq!(info.backing(), Some(mid.clone()));
        assert_eq!(
            disks.chain(&top).await.unwrap(),
            vec![top.clone(), mid.clone(), base.clone()]
        );
        disks.rebase(&top, &base).await.unwrap();
        assert_eq!(
            disks.info(&top).await.unwrap().backing(),
            Some(base.clone())
        );
        disks.resize(&top, 256 << 20).await.unwrap();
        assert_eq!(disks.info(&top).await.unwrap().virtual_size, 256 << 20);
        let copy = d.path().join("copy.qcow2");
        disks.copy(&top, &copy).await.unwrap();
        assert_eq!(disks.info(&copy).await.unwrap().backing(), Some(base));
        let err = disks
            .info(&d.path().join("missing.qcow2"))
            .await
            .unwrap_err();
        assert!(matches!(err, DiskError::Failed { .. }), "{err}");
    }
}
