//! The `ObjectStore` conformance suite (store/tests/conformance/mod.rs) for [`EtcdStore`],
//! against a real three-member etcd cluster on loopback ports that the test starts and stops
//! ([`cluster::Cluster`]). Each store is a prefix of its own on that cluster; a second handle
//! (and the cross-process check's child) connects to it again from its address.

#[path = "../../store/tests/common/mod.rs"]
mod common;
#[path = "../../store/tests/conformance/mod.rs"]
#[macro_use]
mod conformance;
mod cluster;

use std::sync::{Arc, Mutex, Weak};

use boxery_store::ObjectStore;
use boxery_store_etcd::{EtcdConfig, EtcdStore};
use cluster::Cluster;
use conformance::{Implementation, Subject};

/// The cluster this test process started, while a store of it is in use.
static CLUSTER: Mutex<Weak<Cluster>> = Mutex::new(Weak::new());

struct Etcd;

impl Etcd {
    fn cluster() -> Arc<Cluster> {
        let mut c = CLUSTER.lock().unwrap();
        if let Some(running) = c.upgrade() {
            return running;
        }
        let new = Arc::new(Cluster::start(3));
        *c = Arc::downgrade(&new);
        new
    }
}

/// Connect from a thread of its own: `open` is called inside the tests' runtimes.
fn connect(address: &str) -> EtcdStore {
    let config = EtcdConfig::parse(address).expect("an etcd address");
    std::thread::spawn(move || futures::executor::block_on(EtcdStore::connect(&config)))
        .join()
        .expect("connect thread")
        .expect("connect to etcd")
}

impl Implementation for Etcd {
    fn fresh(&self) -> Subject {
        let cluster = Etcd::cluster();
        let address = format!(
            "etcd://{}/boxery-test/{}",
            cluster.hosts(),
            uuid::Uuid::new_v4().simple()
        );
        let store: Arc<dyn ObjectStore> = Arc::new(connect(&address));
        Subject {
            control: store.clone(),
            store,
            address,
            keep: Box::new(cluster),
        }
    }

    fn open(&self, address: &str) -> Arc<dyn ObjectStore> {
        Arc::new(connect(address))
    }
}

conformance::suite!(Etcd);
