//! Images as stopped instances of the images project: built from the container builder's
//! tarball, captured from a VM, deleted; and reimage, which swaps a VM's instance for a copy
//! of one.

use std::path::PathBuf;

use hyper::Method;
use serde_json::{Value, json};

use super::instances::{
    AUTOSTART, BXNAME, CREATED, HOST_KEY, HWADDR, INSTANCE_ID, KIND, MAC, MARK, PARTIAL, REIMAGE,
    SOURCE, cfg, complete_mark, is_named, side_name,
};
use super::*;
use crate::mark::Mark;
use crate::storage::seed;

/// The builder's manifest of a container image (`image/build-debian.sh`,
/// `BOXERY_GUEST_KIND=container`).
#[derive(Debug, serde::Deserialize)]
struct Manifest {
    kind: String,
    image: PathBuf,
    image_sha256: String,
    #[serde(default)]
    image_size: u64,
}

/// The builder's manifest at `manifest`, checked: a container image, its tarball a file beside
/// it (a manifest can come from a file someone imports), its sha256 a sha256 (it goes into an
/// API path). The manifest, the tarball's path and the fingerprint.
fn read_manifest(manifest: &Path) -> Result<(Manifest, PathBuf, String)> {
    let text = std::fs::read_to_string(manifest)
        .map_err(crate::io(format!("reading {}", manifest.display())))?;
    let m: Manifest = serde_json::from_str(&text).map_err(|e| {
        BackendError::Invalid(format!(
            "{} is not a builder's manifest: {e}",
            manifest.display()
        ))
    })?;
    if m.kind != "container" {
        return Err(BackendError::Invalid(format!(
            "{} describes a `{}` image: the incus backend runs container images \
                 (BOXERY_GUEST_KIND=container)",
            manifest.display(),
            m.kind
        )));
    }
    crate::storage::bases::check_manifest_files(manifest, &m.image, None, None)?;
    if m.image_sha256.len() != 64 || !m.image_sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(BackendError::Invalid(format!(
            "image manifest {}: `image_sha256` must be a sha256 (64 hex digits)",
            manifest.display()
        )));
    }
    let fp = m.image_sha256.to_ascii_lowercase();
    let dir = manifest.parent().unwrap_or(Path::new("."));
    let tar = dir.join(&m.image);
    Ok((m, tar, fp))
}

impl Inner {
    /// Image `image`'s instance when it is boxery's (complete or not).
    pub(super) async fn image_instance(&self, image: &str) -> Result<Option<Value>> {
        Ok(self
            .instance(&self.images, &instance_name(image))
            .await?
            .filter(|i| is_named(i, image)))
    }

    /// `Some(Ok)` when image `image` exists for object `uid`, an error when it exists for
    /// another, `None` when it must be made (a partial one is removed first).
    async fn existing_image(&self, image: &str, uid: &str) -> Option<Result<()>> {
        let cur = match self.image_instance(image).await {
            Ok(c) => c?,
            Err(e) => return Some(Err(e)),
        };
        match complete_mark(&cur) {
            Some(m) if Mark::same_object(m, uid) => Some(Ok(())),
            Some(_) => Some(Err(BackendError::Invalid(format!(
                "image {image} exists, made for another object"
            )))),
            None => self
                .delete(&self.images, &instance_name(image))
                .await
                .err()
                .map(Err),
        }
    }

    pub(super) async fn images(&self) -> Result<Vec<ImageInfo>> {
        let mut out: Vec<ImageInfo> = self
            .instances(&self.images)
            .await?
            .iter()
            .map(|i| ImageInfo {
                name: cfg(i, BXNAME)
                    .or(i["name"].as_str())
                    .unwrap_or_default()
                    .to_string(),
                mark: complete_mark(i).map(str::to_string),
                created: cfg(i, CREATED).and_then(|c| c.parse().ok()),
                size_bytes: i["state"]["disk"]["root"]["usage"]
                    .as_u64()
                    .filter(|u| *u > 0),
                memory_bytes: None,
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub(super) async fn remove_image(&self, image: &str) -> Result<()> {
        if self.image_instance(image).await?.is_some() {
            self.delete(&self.images, &instance_name(image)).await?;
        }
        Ok(())
    }

    pub(super) async fn cleanup_image(&self, image: &str) -> Result<()> {
        self.remove_image(image).await
    }

    /// The snapshot a capture of image `image` takes of its VM.
    fn capture_snapshot(image: &str) -> String {
        format!("bx-capture-{}", instance_name(image))
    }

    async fn delete_snapshot(&self, inst: &str, snap: &str) -> Result<()> {
        match self
            .client
            .call(
                Method::DELETE,
                &format!(
                    "/1.0/instances/{inst}/snapshots/{snap}?project={}",
                    self.project
                ),
                Value::Null,
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(api(format!("delete snapshot {inst}/{snap}"))(e)),
        }
    }

    pub(super) async fn capture(&self, vm: &str, image: &str, uid: &str) -> Result<()> {
        check_name("image", image)?;
        if let Some(done) = self.existing_image(image, uid).await {
            return done;
        }
        self.vm_instance(vm)
            .await?
            .filter(|i| complete_mark(i).is_some())
            .ok_or_else(|| BackendError::not_found(NAME, format!("VM {vm}")))?;
        let inst = instance_name(vm);
        let snap = Self::capture_snapshot(image);
        self.delete_snapshot(&inst, &snap).await?;
        // a snapshot of a running container copies its files as they are (no pause)
        self.client
            .call(
                Method::POST,
                &format!("/1.0/instances/{inst}/snapshots?project={}", self.project),
                json!({"name": snap, "stateful": false}),
            )
            .await
            .map_err(api(format!("snapshot VM {vm}")))?;
        let made = self
            .client
            .call(
                Method::POST,
                &format!("/1.0/instances?project={}", self.images),
                json!({
                    "name": instance_name(image),
                    "source": {
                        "type": "copy",
                        "source": format!("{inst}/{snap}"),
                        "project": self.project,
                        "instance_only": true,
                    },
                    "profiles": [],
                    "config": {
                        MARK: uid,
                        BXNAME: image,
                        PARTIAL: "1",
                        KIND: "image",
                        AUTOSTART: "false",
                        SOURCE: format!("vm:{vm}"),
                        CREATED: boxery_api::now().to_rfc3339(),
                    },
                }),
            )
            .await
            .map_err(api(format!("copy VM {vm} into image {image}")));
        let dropped = self.delete_snapshot(&inst, &snap).await;
        made?;
        dropped?;
        self.commit(&self.images, &instance_name(image)).await
    }

    pub(super) async fn recover_capture(
        &self,
        vm: &str,
        image: &str,
        original: Option<PowerState>,
    ) -> Result<()> {
        // a capture never changes its VM's power: there is nothing of it to restore
        let _ = original;
        if self.vm_instance(vm).await?.is_some() {
            self.delete_snapshot(&instance_name(vm), &Self::capture_snapshot(image))
                .await?;
        }
        if let Some(img) = self.image_instance(image).await?
            && complete_mark(&img).is_none()
        {
            self.delete(&self.images, &instance_name(image)).await?;
        }
        Ok(())
    }

    pub(super) async fn build_image(&self, stock: Stock<'_>, progress: Progress) -> Result<()> {
        let Stock {
            name,
            layers,
            image,
            uid,
        } = stock;
        check_name("image", image)?;
        // `tiny` is the small guest of the VM backends (a kernel and busybox, quick to boot
        // under emulation); a container needs no kernel and starts in a second, so the small
        // guest here is the debian-12 container itself
        if name != "debian-12" && name != "tiny" {
            return Err(BackendError::Invalid(format!(
                "the incus backend cannot build stock image `{name}`: it builds debian-12 (as \
                 a system container; `tiny` is the same image here)"
            )));
        }
        let name = "debian-12";
        if let Some(done) = self.existing_image(image, uid).await {
            return done;
        }
        let storage = &self.config.storage;
        let dir = storage.image_dir.clone().ok_or_else(|| {
            BackendError::Invalid(
                "the image builders (image/build-*.sh) were not found: set BOXERY_IMAGE_DIR to \
                 the repository's image/ directory"
                    .into(),
            )
        })?;
        let script = dir.join("build-debian.sh");
        let out = storage.image_cache.clone();
        progress(&format!(
            "building {name} (a system container) with {} into {}/container",
            script.display(),
            out.display()
        ));
        std::fs::create_dir_all(&self.state).map_err(crate::io("creating the state directory"))?;
        let log = self.state.join(format!(".build-{image}.log"));
        crate::storage::build::run_builder(
            &script,
            &out,
            layers,
            &[("BOXERY_GUEST_KIND", "container")],
            &log,
            &progress,
        )
        .await
        .map_err(|why| BackendError::failed(format!("build stock image {name}"), why))?;
        let built = std::iter::once(name)
            .chain(layers.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("-");
        let manifest = out.join("container").join(format!("{built}.json"));
        self.image_from_manifest(&manifest, image, uid, &format!("build:{built}"), &progress)
            .await
    }

    pub(super) async fn import_image(&self, path: &Path, image: &str, uid: &str) -> Result<()> {
        check_name("image", image)?;
        if let Some(done) = self.existing_image(image, uid).await {
            return done;
        }
        let manifest = if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            path.with_extension("json")
        };
        if !manifest.is_file() {
            return Err(BackendError::Invalid(format!(
                "the incus backend imports the container images boxery's builder makes (a \
                 manifest beside the tarball; {} has none): `BOXERY_GUEST_KIND=container \
                 image/build-debian.sh OUT` makes one",
                path.display()
            )));
        }
        let progress: Progress = Arc::new(|_l: &str| {});
        self.image_from_manifest(
            &manifest,
            image,
            uid,
            &format!("file:{}", path.display()),
            &progress,
        )
        .await
    }

    /// Make image `image` (marked `uid`) from the container tarball that `manifest`
    /// describes: the tarball is imported as an Incus image once (its sha256 is its
    /// fingerprint: a second build finds it), then an instance is made of it.
    async fn image_from_manifest(
        &self,
        manifest: &Path,
        image: &str,
        uid: &str,
        source: &str,
        progress: &Progress,
    ) -> Result<()> {
        let (m, tar, fp) = read_manifest(manifest)?;
        let have = self
            .client
            .get_opt(&format!("/1.0/images/{fp}?project={}", self.images))
            .await
            .map_err(api("look the image up in incusd"))?;
        if have.is_none() {
            progress(&format!(
                "importing {} ({} MiB) into incusd",
                tar.display(),
                m.image_size / (1 << 20)
            ));
            let got = self
                .client
                .upload(
                    &format!("/1.0/images?project={}", self.images),
                    &tar,
                    &[("x-incus-public", "0".into())],
                )
                .await
                .map_err(api(format!("import {} into incusd", tar.display())))?;
            if got["fingerprint"].as_str() != Some(fp.as_str()) {
                return Err(BackendError::failed(
                    format!("import {}", tar.display()),
                    format!(
                        "incusd gave it fingerprint {}, the manifest says {fp}: the tarball \
                         changed after it was built; build it again",
                        got["fingerprint"]
                    ),
                ));
            }
        } else {
            progress(&format!("incusd has the image already ({})", &fp[..12]));
        }
        progress(&format!("making image {image} of it"));
        self.client
            .call(
                Method::POST,
                &format!("/1.0/instances?project={}", self.images),
                json!({
                    "name": instance_name(image),
                    "type": "container",
                    "source": {"type": "image", "fingerprint": fp},
                    "profiles": [],
                    "config": {
                        MARK: uid,
                        BXNAME: image,
                        PARTIAL: "1",
                        KIND: "image",
                        AUTOSTART: "false",
                        SOURCE: source,
                        CREATED: boxery_api::now().to_rfc3339(),
                    },
                    "devices": {"root": {"type": "disk", "path": "/", "pool": self.pool}},
                }),
            )
            .await
            .map_err(api(format!("make image {image}")))?;
        self.commit(&self.images, &instance_name(image)).await
    }

    /// Finish a reimage of VM `vm` that was interrupted after its instance was renamed away
    /// (its new instance then waits under its side name): the new one takes its place, is
    /// committed, and the old one goes. Whether it changed anything.
    async fn finish_swap(&self, vm: &str) -> Result<bool> {
        let inst = instance_name(vm);
        let new = side_name("new", &inst);
        let old = side_name("old", &inst);
        let mut changed = false;
        let here = self.instance(&self.project, &inst).await?;
        let waiting = self
            .instance(&self.project, &new)
            .await?
            .filter(|i| cfg(i, BXNAME) == Some(vm) && cfg(i, PARTIAL).is_none());
        if here.is_none() && waiting.is_some() {
            self.rename(&new, &inst).await?;
            changed = true;
        }
        if let Some(i) = self.instance(&self.project, &inst).await?
            && cfg(&i, BXNAME) == Some(vm)
        {
            // the old instance first: the commit gives the new one its MAC
            if self.delete_side(&old, vm).await? {
                changed = true;
            }
            if cfg(&i, REIMAGE).is_some() {
                self.commit(&self.project, &inst).await?;
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Delete side instance `side` of VM `vm`'s reimage when it is there and is that VM's;
    /// whether it was there.
    async fn delete_side(&self, side: &str, vm: &str) -> Result<bool> {
        match self.instance(&self.project, side).await? {
            None => Ok(false),
            Some(i) if cfg(&i, BXNAME) == Some(vm) => {
                self.delete(&self.project, side).await?;
                Ok(true)
            }
            Some(_) => Err(BackendError::Invalid(format!(
                "the Incus instance {side} in project {} is not VM {vm}'s: rename or remove it",
                self.project
            ))),
        }
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.client
            .call(
                Method::POST,
                &self.path(&self.project, from, ""),
                json!({"name": to}),
            )
            .await
            .map(|_| ())
            .map_err(api(format!("rename instance {from} to {to}")))
    }

    pub(super) async fn reimage(&self, vm: &str, image: &str, identity: &Identity) -> Result<()> {
        // an interrupted swap is finished first: the VM has changed then, and no later error
        // of this call is `Unchanged`
        let touched = self.finish_swap(vm).await?;
        let inst = instance_name(vm);
        let cur = self
            .vm_instance(vm)
            .await?
            .filter(|i| complete_mark(i).is_some())
            .ok_or_else(|| BackendError::not_found(NAME, format!("VM {vm}")))?;
        let unchanged = |e: BackendError| {
            if touched {
                e
            } else {
                BackendError::Unchanged(e.chain())
            }
        };
        let img = self
            .image_instance(image)
            .await
            .map_err(unchanged)?
            .filter(|i| complete_mark(i).is_some())
            .ok_or_else(|| unchanged(BackendError::not_found(NAME, format!("image {image}"))))?;
        // the identity: the VM's own seed, unless the caller gives a new host key
        let new_key = identity
            .host_key
            .as_ref()
            .map(|(_, p)| p.trim().to_string());
        let (user, meta, public, instance_id) =
            if new_key.is_none() || new_key.as_deref() == cfg(&cur, HOST_KEY) {
                // the host's copy, never the guest's (which the guest may have changed)
                let Some((user, meta)) = self.kept_seed(vm).map_err(unchanged)? else {
                    return Err(unchanged(BackendError::Invalid(format!(
                        "VM {vm}'s seed is not on the host ({}); give it a new identity",
                        self.seed_dir(vm).display()
                    ))));
                };
                (
                    user,
                    meta,
                    cfg(&cur, HOST_KEY).unwrap_or_default().to_string(),
                    cfg(&cur, INSTANCE_ID).unwrap_or_default().to_string(),
                )
            } else {
                let id = seed::complete_identity(vm, identity).map_err(unchanged)?;
                let iid = seed::new_instance_id();
                let user = seed::user_data(vm, &id, seed::Guest::Boxery)
                    .map_err(|e| unchanged(BackendError::Invalid(e.to_string())))?;
                let meta = seed::meta_data(&iid, &id.hostname);
                (user, meta, new_key.unwrap_or_default(), iid)
            };
        // 1. the new instance beside the VM: the image's files, the VM's identity and MAC
        let new = side_name("new", &inst);
        self.delete_side(&new, vm).await.map_err(unchanged)?;
        let mut config = serde_json::Map::new();
        for (k, v) in cur["config"].as_object().into_iter().flatten() {
            if k.starts_with("user.") || k.starts_with("limits.") || k.starts_with("security.") {
                config.insert(k.clone(), v.clone());
            }
        }
        // the VM's MAC, taken when the old instance is gone (`MAC`)
        if let Some(mac) = cfg(&cur, HWADDR) {
            config.insert(MAC.into(), mac.into());
        }
        config.insert(PARTIAL.into(), "1".into());
        config.insert(REIMAGE.into(), "1".into());
        config.insert(HOST_KEY.into(), public.into());
        config.insert(INSTANCE_ID.into(), instance_id.into());
        config.insert(SOURCE.into(), image.into());
        config.insert(AUTOSTART.into(), "false".into());
        let made = async {
            self.client
                .call(
                    Method::POST,
                    &format!("/1.0/instances?project={}", self.project),
                    json!({
                        "name": new,
                        "type": "container",
                        "source": {
                            "type": "copy",
                            "source": img["name"],
                            "project": self.images,
                            "instance_only": true,
                        },
                        "profiles": [],
                        "config": config,
                        "devices": cur["devices"],
                    }),
                )
                .await
                .map_err(api(format!(
                    "make VM {vm}'s new instance from image {image}"
                )))?;
            self.write_seed(&self.project, &new, &user, &meta).await?;
            self.update(&self.project, &new, |c, _| {
                c.remove(PARTIAL);
                Ok(())
            })
            .await
        }
        .await;
        if let Err(e) = made {
            let _ = self.delete(&self.project, &new).await;
            return Err(unchanged(e));
        }
        // 2. the swap: from here a retry finishes it (finish_swap)
        let old = side_name("old", &inst);
        self.delete_side(&old, vm).await?;
        self.stop_now(&inst).await?;
        self.rename(&inst, &old).await?;
        self.rename(&new, &inst).await?;
        // the host's copy of the seed follows the identity the VM now has
        self.keep_seed(vm, &user, &meta)?;
        // the old instance goes before the new one takes its MAC (commit)
        self.delete(&self.project, &old).await?;
        self.commit(&self.project, &inst).await?;
        self.start(vm).await
    }

    /// Stop VM instance `inst` by force (its disk is being replaced); stopped already is fine.
    async fn stop_now(&self, inst: &str) -> Result<()> {
        match self
            .set_state(inst, json!({"action": "stop", "force": true}))
            .await
        {
            Ok(()) => Ok(()),
            Err(BackendError::Failed { source, .. })
                if source.to_string().contains("already stopped") =>
            {
                Ok(())
            }
            Err(e) => {
                let cur = self.instance(&self.project, inst).await?;
                if cur.is_some_and(|c| c["status"] == "Stopped") {
                    Ok(())
                } else {
                    Err(e)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_manifest_names_a_file_beside_it_and_a_real_sha256() {
        let dir = tempfile::tempdir().unwrap();
        let write = |image: &str, sha: &str| {
            let p = dir.path().join("m.json");
            std::fs::write(
                &p,
                serde_json::json!({"kind": "container", "image": image, "image_sha256": sha})
                    .to_string(),
            )
            .unwrap();
            p
        };
        let good = "a".repeat(64);
        let (_, tar, fp) = super::read_manifest(&write("d.tar", &good)).unwrap();
        assert_eq!(tar, dir.path().join("d.tar"));
        assert_eq!(fp, good);
        for (image, sha) in [
            ("../../etc/shadow", good.as_str()),
            ("/etc/shadow", good.as_str()),
            ("d.tar", "x?project=default"),
            ("d.tar", &"g".repeat(64)),
        ] {
            assert!(
                matches!(
                    super::read_manifest(&write(image, sha)),
                    Err(crate::BackendError::Invalid(_))
                ),
                "{image} {sha}"
            );
        }
    }
}
