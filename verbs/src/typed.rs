//! Typed reads for the front ends, so they reach the store only through the verbs: an object
//! of a known kind, a kind's objects, a kind's names, and who leads a home's store.

use boxery_api::{Resource, Selector};
use boxery_store::{ObjectRef, ObjectStoreExt};

use crate::Verbs;
use crate::error::Result;

impl Verbs {
    /// Object `name` of kind `R` (`None` when there is none).
    pub async fn get_as<R: Resource>(&self, name: &str) -> Result<Option<R>> {
        Ok(self.store().get_as(name).await?)
    }

    /// The objects of kind `R` that `selector` matches.
    pub async fn list_as<R: Resource>(&self, selector: &Selector) -> Result<Vec<R>> {
        Ok(self.store().list_as(selector).await?)
    }

    /// The names of the objects of kind `kind` (a kind's name as stored: `Vm`, `Image`, …).
    pub async fn names(&self, kind: &str) -> Result<Vec<String>> {
        let (objs, _) = self.store().list(kind, &Selector::default()).await?;
        Ok(objs.into_iter().map(|o| o.metadata.name).collect())
    }

    /// The object `r` (`None` when there is none).
    pub async fn read(&self, r: &ObjectRef) -> Result<Option<boxery_api::DynObject>> {
        Ok(self.store().get(r).await?)
    }

    /// Whether the object `r` exists.
    pub async fn exists(&self, r: &ObjectRef) -> Result<bool> {
        Ok(self.store().get(r).await?.is_some())
    }
}

/// Who leads the store of `env`'s home: `Ok(None)` when nothing does, or when the home has
/// no store yet (`boxery version` opens nothing it would create).
pub fn leader(env: &crate::Env) -> Result<Option<String>> {
    if !env.store_on_etcd()? && !boxery_home::layout::store(&env.home).exists() {
        return Ok(None);
    }
    let store = env.store()?;
    Ok(futures::executor::block_on(
        store.leader(crate::control::LOCK),
    )?)
}
