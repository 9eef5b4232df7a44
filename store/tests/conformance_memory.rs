//! The `ObjectStore` conformance suite (tests/conformance/mod.rs) for the store in memory
//! (`Store::open_in_memory`). Nothing else can open such a store, so a "second handle" is a
//! clone of the first (the same connection), and the cross-process check is not made.

mod common;
#[macro_use]
mod conformance;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use boxery_store::{ObjectStore, Store};
use conformance::{Implementation, Subject};

/// The stores this test made, by their names.
#[derive(Default)]
struct Memory {
    stores: Mutex<HashMap<String, Store>>,
}

impl Implementation for Memory {
    fn fresh(&self) -> Subject {
        let store = Store::open_in_memory().expect("a store in memory");
        let address = store.path().display().to_string();
        self.stores
            .lock()
            .unwrap()
            .insert(address.clone(), store.clone());
        let store: Arc<dyn ObjectStore> = Arc::new(store);
        Subject {
            control: store.clone(),
            store,
            address,
            keep: Box::new(()),
        }
    }

    fn open(&self, address: &str) -> Arc<dyn ObjectStore> {
        let store = self.stores.lock().unwrap()[address].clone();
        Arc::new(store)
    }
}

conformance::suite!(Memory::default(), in_one_process);
