//! watch: resume, kind filter, order, live changes, TooOld after compaction, and use without
//! a tokio runtime.

mod common;

use std::time::Duration;

use boxery_store::{StoreError, WatchEvent};
use common::{Fixture, image, store, vm};
use futures::StreamExt;

type Item = boxery_store::Result<(u64, WatchEvent)>;

async fn next(w: &mut futures::stream::BoxStream<'static, Item>) -> Item {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("a watch event within 5 s")
        .expect("stream open")
}

fn summary(item: &(u64, WatchEvent)) -> (u64, &'static str, String) {
    let (rev, ev) = item;
    let ty = match ev {
        WatchEvent::Added(_) => "Added",
        WatchEvent::Modified(_) => "Modified",
        WatchEvent::Deleted(_) => "Deleted",
    };
    (*rev, ty, ev.object().metadata.name.clone())
}

#[tokio::test]
async fn resumes_from_a_revision_filters_by_kind_and_keeps_order() {
    let (_d, s) = store();
    let a = s.create(vm("a")).unwrap(); // 1
    s.create(image("img")).unwrap(); // 2
    s.update(a.label("x", "y")).unwrap(); // 3
    s.delete("Vm", "a").unwrap(); // 4

    let mut w = s.watch(Some("Vm"), 0);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(summary(&next(&mut w).await.unwrap()));
    }
    assert_eq!(
        got,
        [
            (1, "Added", "a".into()),
            (3, "Modified", "a".into()),
            (4, "Deleted", "a".into())
        ]
    );

    let mut all = s.watch(None, 2);
    let first = next(&mut all).await.unwrap();
    assert_eq!(summary(&first), (3, "Modified", "a".into()));
    let WatchEvent::Deleted(gone) = next(&mut all).await.unwrap().1 else {
        panic!("want Deleted")
    };
    assert_eq!(
        gone.metadata.resource_version.as_deref(),
        Some("4"),
        "Deleted carries the deletion's revision"
    );
    assert_eq!(
        gone.metadata.labels["x"], "y",
        "and the object as it was last"
    );

    // Live: new changes arrive on both streams, other kinds filtered out.
    s.create(image("img2")).unwrap(); // 5
    s.create(vm("b")).unwrap(); // 6
    assert_eq!(
        summary(&next(&mut w).await.unwrap()),
        (6, "Added", "b".into())
    );
    assert_eq!(
        summary(&next(&mut all).await.unwrap()),
        (5, "Added", "img2".into())
    );
    assert_eq!(
        summary(&next(&mut all).await.unwrap()),
        (6, "Added", "b".into())
    );
    // Nothing more.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), w.next())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn list_then_watch_from_the_list_revision_misses_nothing() {
    let (_d, s) = store();
    for i in 0..700 {
        s.create(vm(&format!("v{i}"))).unwrap();
    }
    let (objs, rev) = s.list("Vm", &Default::default()).unwrap();
    assert_eq!((objs.len(), rev), (700, 700));
    let mut w = s.watch(Some("Vm"), 0);
    // More than one batch of history, in order.
    for want in 1..=700u64 {
        assert_eq!(next(&mut w).await.unwrap().0, want);
    }
    let mut from_list = s.watch(Some("Vm"), rev);
    s.create(vm("late")).unwrap();
    assert_eq!(
        summary(&next(&mut from_list).await.unwrap()),
        (701, "Added", "late".into())
    );
}

#[tokio::test]
async fn too_old_after_compaction() {
    let (_d, s) = store();
    for i in 0..2500 {
        s.create(image(&format!("i{i}"))).unwrap();
    }
    let mut lagging = s.watch(None, 10);
    assert_eq!(next(&mut lagging).await.unwrap().0, 11);
    assert_eq!(s.compact(100).unwrap(), 2400, "three batches");
    assert_eq!(s.compacted().unwrap(), 2400);
    assert_eq!(s.compact(100).unwrap(), 0, "nothing left to do");

    let mut w = s.watch(None, 5);
    match next(&mut w).await {
        Err(StoreError::TooOld {
            requested: 5,
            floor: 2400,
        }) => {}
        other => panic!("want TooOld, got {other:?}"),
    }
    assert!(w.next().await.is_none(), "TooOld ends the stream");
    assert!(w.next().await.is_none(), "and stays ended");
    // The lagging watcher has 500 rows buffered at most, then learns it is too old.
    let mut last = 11;
    let err = loop {
        match next(&mut lagging).await {
            Ok((rev, _)) => {
                assert_eq!(rev, last + 1);
                last = rev;
            }
            Err(e) => break e,
        }
    };
    assert!(matches!(err, StoreError::TooOld { .. }), "{err}");
    assert!(err.to_string().contains("list again"), "{err}");

    // From the floor: fine. Objects are untouched by compaction.
    let mut ok = s.watch(None, 2400);
    assert_eq!(next(&mut ok).await.unwrap().0, 2401);
    assert_eq!(s.list("Image", &Default::default()).unwrap().0.len(), 2500);

    // A kind-filtered watcher that saw nothing of its kind is not made too old by churn of
    // other kinds.
    let mut vms = s.watch(Some("Vm"), s.revision().unwrap());
    let waiting = tokio::spawn(async move { next(&mut vms).await.map(|(r, _)| r) });
    tokio::time::sleep(Duration::from_millis(30)).await;
    for i in 0..300 {
        s.create(image(&format!("j{i}"))).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    s.compact(10).unwrap();
    let v = s.create(vm("after")).unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), v.metadata.rv());
}

#[test]
fn works_without_a_tokio_runtime() {
    let (_d, s) = store();
    let mut w = s.watch(Some("Vm"), 0);
    let writer = s.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        writer.create(vm("late")).unwrap();
    });
    let (rev, ev) = futures::executor::block_on(w.next()).unwrap().unwrap();
    assert_eq!((rev, ev.object().metadata.name.as_str()), (1, "late"));
    t.join().unwrap();
}
