//! What etcd's limits do to the store: a write larger than one etcd transaction may hold is
//! refused whole, saying which server setting to raise.

mod cluster;
#[path = "../../store/tests/common/mod.rs"]
mod common;

use boxery_store::{ApplyOptions, ObjectStore, StoreError};
use boxery_store_etcd::{EtcdConfig, EtcdStore};

#[tokio::test(flavor = "multi_thread")]
async fn a_write_past_max_txn_ops_is_refused_whole_and_says_what_to_raise() {
    let cluster = cluster::Cluster::start_with(1, 16);
    let store = EtcdStore::connect(
        &EtcdConfig::parse(&format!("etcd://{}/limits", cluster.hosts())).unwrap(),
    )
    .await
    .unwrap();
    let at = store.revision().await.unwrap();
    let set: Vec<_> = (0..10).map(|i| common::vm(&format!("v{i}"))).collect();
    let err = store
        .apply_all(set, &ApplyOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Db(_)), "{err:?}");
    let shown = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(shown.contains("--max-txn-ops"), "{shown}");
    assert_eq!(store.revision().await.unwrap(), at, "nothing written");
    let (vms, _) = store.list("Vm", &Default::default()).await.unwrap();
    assert!(vms.is_empty());
    // one object fits
    store.create(common::vm("one")).await.unwrap();
}
