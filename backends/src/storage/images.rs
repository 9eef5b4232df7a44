//! Images: records, the inventory, publishing a finished overlay, removal, and the copies a
//! VM's disk starts from.

use std::future::Future;
use std::path::Path;

use super::Storage;
use super::files::{self, remove_file_if_exists, write_json};
use super::records::ImageRecord;
use crate::{BackendError, ImageInfo, Result, io};

impl Storage {
    /// Image `name`'s record, `None` when it has none (absent or partial).
    pub fn load_image(&self, name: &str) -> Result<Option<ImageRecord>> {
        files::read_json(&self.image_record(name))
            .map_err(io(format!("reading the record of image {name}")))
    }

    /// Image `name` complete (record and disk), else `NotFound`.
    pub fn usable_image(&self, name: &str) -> Result<ImageRecord> {
        let rec = self
            .load_image(name)?
            .ok_or_else(|| self.not_found(format!("image {name}")))?;
        if !self.image_disk(name).exists() {
            return Err(self.not_found(format!("image {name} (its disk is missing)")));
        }
        Ok(rec)
    }

    /// An existing image is success for the same object and `Invalid` for another.
    pub fn same_image(&self, rec: ImageRecord, uid: &str) -> Result<()> {
        if crate::mark::Mark::same_object(&rec.mark, uid) {
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "image {} already exists in the {} backend for another object (uid {}): pick another name",
                rec.name, self.backend, rec.mark
            )))
        }
    }

    /// Make image `image` for `uid` with `make`, which leaves a finished overlay at
    /// [`Storage::image_part`] and publishes it ([`Storage::publish`]). Under the image's
    /// lock; an image already there is `same_image`; a failure removes what `make` left.
    pub async fn new_image<F>(&self, image: &str, uid: &str, make: F) -> Result<()>
    where
        F: Future<Output = Result<()>>,
    {
        let _lock = self.lock(&format!("image-{image}")).await?;
        if let Some(rec) = self.load_image(image)? {
            return self.same_image(rec, uid);
        }
        let res = make.await;
        if res.is_err() {
            let _ = self.remove_image_files(image);
        }
        res
    }

    /// Every complete image (record and disk). `Unreachable` when the records cannot be read:
    /// never an empty list for a directory that is not there.
    pub fn images(&self) -> Result<Vec<ImageInfo>> {
        let dir = self.records();
        let entries = std::fs::read_dir(&dir).map_err(|e| {
            self.unreachable(format!(
                "cannot read {}: {e} (run `boxery init`)",
                dir.display()
            ))
        })?;
        let mut out = Vec::new();
        for e in entries {
            let e =
                e.map_err(|e| self.unreachable(format!("cannot read {}: {e}", dir.display())))?;
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json") else {
                continue;
            };
            if !files::valid_name(name) {
                continue;
            }
            let Some(rec) = self
                .load_image(name)
                .map_err(|e| self.unreachable(e.chain()))?
            else {
                continue;
            };
            let disk = self.image_disk(name);
            if !disk.exists() {
                continue;
            }
            out.push(ImageInfo {
                name: rec.name,
                mark: Some(rec.mark),
                created: Some(rec.created),
                size_bytes: Some(super::disk::allocated_bytes(&disk)),
                memory_bytes: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Turn the finished part file into image `image`: read-only, renamed into place, then
    /// its record (the commit point). The image lock is held.
    pub async fn publish(&self, image: &str, uid: &str, base: &str, source: &str) -> Result<()> {
        let part = self.image_part(image);
        let info = self
            .disks
            .info(&part)
            .await
            .map_err(|e| BackendError::failed(format!("inspect image {image}"), e))?;
        files::make_read_only(&part).map_err(io(format!("chmod {}", part.display())))?;
        std::fs::rename(&part, self.image_disk(image))
            .map_err(io(format!("renaming {}", part.display())))?;
        let rec = ImageRecord {
            name: image.into(),
            mark: uid.into(),
            base: base.into(),
            source: source.into(),
            virtual_size: info.virtual_size,
            created: boxery_api::now(),
        };
        write_json(&self.image_record(image), &rec, 0o644)
            .map_err(io(format!("writing the record of image {image}")))
    }

    /// Remove image `image`'s record (first: it leaves the inventory), disk, staging files and
    /// the temp files of a killed writer. Idempotent; the image lock is held.
    pub fn remove_image_files(&self, image: &str) -> Result<()> {
        remove_file_if_exists(&self.image_record(image))
            .map_err(io(format!("removing the record of image {image}")))?;
        remove_file_if_exists(&self.image_disk(image))
            .map_err(io(format!("removing the disk of image {image}")))?;
        for p in [Some(self.image_part(image)), self.image_copy(image)]
            .into_iter()
            .flatten()
        {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        let record = format!("{image}.json");
        let disk = (self.places.image_file)(image);
        files::remove_temps(&self.records(), |f| f == record)
            .and_then(|()| files::remove_temps(&self.places.image_disks, |f| f == disk))
            .map_err(io(format!("removing temp files of image {image}")))
    }

    /// Make image `image` (marked `uid`) an empty overlay on base `base`. Idempotent.
    pub async fn image_from_base(
        &self,
        image: &str,
        uid: &str,
        base: &str,
        source: &str,
    ) -> Result<()> {
        self.new_image(image, uid, async {
            self.load_base(base)?;
            let part = self.image_part(image);
            let _ = remove_file_if_exists(&part);
            self.disks
                .create_overlay(&part, &self.base_disk(base), None)
                .await
                .map_err(|e| BackendError::failed(format!("make image {image}"), e))?;
            self.publish(image, uid, base, source).await
        })
        .await
    }

    /// Copy image `image`'s overlay to `dst` (same base, so its header is already right;
    /// `cp --reflink=auto`), 0600, grown to `min_bytes` when smaller; returns its virtual
    /// size. Written under a temporary name: `dst` appears complete or not at all.
    pub async fn copy_image(&self, image: &str, dst: &Path, min_bytes: u64) -> Result<u64> {
        let src = self.image_disk(image);
        let tmp = files::temp_path(dst);
        let _ = remove_file_if_exists(&tmp);
        let res = async {
            self.disks
                .copy(&src, &tmp)
                .await
                .map_err(|e| BackendError::failed(format!("copy image {image}"), e))?;
            files::set_mode(&tmp, 0o600).map_err(io(format!("chmod {}", tmp.display())))?;
            let info = self.disks.info(&tmp).await.map_err(|e| {
                BackendError::failed(format!("inspect the copy of image {image}"), e)
            })?;
            let mut size = info.virtual_size;
            if size < min_bytes {
                self.disks.resize(&tmp, min_bytes).await.map_err(|e| {
                    BackendError::failed(format!("grow the disk made from image {image}"), e)
                })?;
                size = min_bytes;
            }
            std::fs::rename(&tmp, dst).map_err(io(format!("renaming {}", tmp.display())))?;
            Ok(size)
        }
        .await;
        if res.is_err() {
            let _ = remove_file_if_exists(&tmp);
        }
        res
    }
}
