//! The `ObjectStore` conformance suite (tests/conformance/mod.rs) for the SQLite store: each
//! store a file in a temp dir; a second handle is `Store::open` of the same path.

mod common;
#[macro_use]
mod conformance;

use std::sync::Arc;

use boxery_store::ObjectStore;
use conformance::{Implementation, Subject};

struct Sqlite;

impl Implementation for Sqlite {
    fn fresh(&self) -> Subject {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store.db");
        let store: Arc<dyn ObjectStore> = Arc::new(common::open(&path));
        Subject {
            control: store.clone(),
            store,
            address: path.display().to_string(),
            keep: Box::new(dir),
        }
    }

    fn open(&self, address: &str) -> Arc<dyn ObjectStore> {
        Arc::new(common::open(std::path::Path::new(address)))
    }
}

conformance::suite!(Sqlite);
