//! The stock images (`tiny`, `debian-12`) from the image builders (`image/build-*.sh`), and
//! imports of a builder's output: each registers a base and makes the image an empty overlay
//! on it.

use std::path::Path;

use super::Storage;
use super::files::{remove_file_if_exists, tail};
use crate::{BackendError, Progress, Result, Stock, io};

/// Which builder script makes stock image `name`.
fn builder_script(name: &str) -> Option<&'static str> {
    match name {
        "debian-12" => Some("build-debian.sh"),
        "tiny" => Some("build-tiny.sh"),
        _ => None,
    }
}

impl Storage {
    /// Build stock image `stock.name` as image `stock.image` marked `stock.uid`: run its builder into
    /// `BOXERY_IMAGE_CACHE`, forwarding every line it prints as it prints it, register the
    /// output as a base (once per input hash) and make the image an overlay on it.
    pub async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        let Stock {
            name,
            layers,
            image,
            uid,
        } = stock;
        self.check_name("image", image)?;
        let script = builder_script(name).ok_or_else(|| {
            BackendError::Invalid(format!(
                "the {} backend cannot build stock image `{name}`: it builds debian-12 and tiny",
                self.backend
            ))
        })?;
        if let Some(rec) = self.load_image(image)? {
            return self.same_image(rec, uid);
        }
        let dir = self.config.image_dir.clone().ok_or_else(|| {
            BackendError::Invalid(
                "the image builders (image/build-*.sh) were not found: set BOXERY_IMAGE_DIR to the repository's image/ directory".into(),
            )
        })?;
        let script_path = dir.join(script);
        if !script_path.is_file() {
            return Err(BackendError::Invalid(format!(
                "{} does not exist: set BOXERY_IMAGE_DIR",
                script_path.display()
            )));
        }
        let out = self.config.image_cache.clone();
        progress(&format!(
            "building {name} with {} into {}",
            script_path.display(),
            out.display()
        ));
        let state = &self.places.state;
        std::fs::create_dir_all(state).map_err(io("creating the state directory"))?;
        let stderr_path = state.join(format!(".build-{image}.log"));
        // the builder names a layered output NAME-LAYER…, beside the plain one
        let built = std::iter::once(name)
            .chain(layers.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("-");
        run_builder(&script_path, &out, layers, &[], &stderr_path, &progress)
            .await
            .map_err(|why| BackendError::failed(format!("build stock image {name}"), why))?;
        let base = self
            .register_base(&out.join(format!("{built}.json")))
            .await?;
        progress(&format!("registered base {base}"));
        self.image_from_base(image, uid, &base, &format!("build:{built}"))
            .await
    }

    /// Import a disk file as image `image`: a builder's output (`path` is its manifest, or a
    /// disk with the manifest beside it, which says how the disk boots), or else a
    /// distribution's cloud image ([`Storage::register_cloud_image`]).
    pub async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        self.check_name("image", image)?;
        let manifest = if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            path.with_extension("json")
        };
        // No manifest: a distribution's cloud image, imported as it is.
        let base = if manifest.is_file() {
            self.register_base(&manifest).await?
        } else {
            self.register_cloud_image(path).await?
        };
        self.image_from_base(image, uid, &base, &format!("file:{}", path.display()))
            .await
    }
}

/// Run image builder `script` into `out` with `layers` (and `env`), its stderr in `log`,
/// forwarding every line it prints to `progress` as it prints it. `Err`: why it failed, with
/// the end of its log. The builder is stopped (TERM to its process group) when this is
/// dropped.
pub(crate) async fn run_builder(
    script: &Path,
    out: &Path,
    layers: &[String],
    env: &[(&str, &str)],
    log: &Path,
    progress: &Progress,
) -> std::result::Result<(), String> {
    let stderr =
        std::fs::File::create(log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let mut child = tokio::process::Command::new("bash")
        .arg(script)
        .arg(out)
        .env("BOXERY_EXTRA_LAYERS", layers.join(" "))
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        // a group of its own, ended with TERM when this build is dropped (below)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    let mut group = TermOnDrop(child.id());
    if let Some(stdout) = child.stdout.take() {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            progress(&line);
        }
    }
    let status = child
        .wait()
        .await
        .map_err(|e| format!("waiting for {}: {e}", script.display()))?;
    group.0 = None;
    if !status.success() {
        return Err(format!(
            "{} exited with {status}: {}",
            script.display(),
            tail(log, 15)
        ));
    }
    let _ = remove_file_if_exists(log);
    Ok(())
}

/// A builder's process group, sent TERM when the build is dropped (`serve` stopping, the
/// Image deleted mid-build): every process in it stops, and the builder's trap unmounts what
/// its chroot mounted and removes its work directory. A KILL (what `kill_on_drop` sends)
/// would leave both. Nothing is sent once the builder has exited (its group is gone).
struct TermOnDrop(Option<u32>);

impl Drop for TermOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self
            .0
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::TERM);
        }
    }
}
