//! Running every reconciler on one store and backend: the Vm and Image controllers, the
//! inventory resync and history compaction. Used by `boxery serve` and the CLI's embedded mode.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::{Image, Lease, Pool, Vm};
use boxery_controller::{CancellationToken, Controller, default_error_policy};

use crate::context::Ctx;
use crate::{image, inventory, lease, pool, vm};

impl boxery_controller::ReconcileError for crate::error::ReconcileError {
    fn is_terminal(&self) -> bool {
        crate::error::ReconcileError::is_terminal(self)
    }
}

/// How many store revisions of history to keep for watchers.
pub const KEEP_REVISIONS: u64 = 20_000;

/// Run until `shutdown` is cancelled.
pub async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let store = ctx.store.clone();
    let vm_ctl = Controller::<Vm>::new(store.clone());
    let image_ctl = Controller::<Image>::new(store.clone());
    // One full cache per kind (its controller's); the watches keep metadata only.
    let caches = inventory::Caches {
        vms: vm_ctl.cache(),
        images: image_ctl.cache(),
    };
    let vm_cache = caches.vms.clone();
    let vms = vm_ctl
        .watches_metadata::<Image>(move |o| vm::vms_for_image(&vm_cache, o))
        .resync_every(ctx.settings.resync_every)
        .concurrency(ctx.settings.concurrency)
        .run(
            vm::reconcile,
            default_error_policy,
            ctx.clone(),
            shutdown.clone(),
        );
    let image_cache = caches.images.clone();
    let images = image_ctl
        .watches_metadata::<Vm>(move |o| image::images_for_vm(&image_cache, o))
        .resync_every(ctx.settings.resync_every)
        .concurrency(ctx.settings.concurrency)
        .run(
            image::reconcile,
            default_error_policy,
            ctx.clone(),
            shutdown.clone(),
        );
    let pool_ctl = Controller::<Pool>::new(store.clone());
    let lease_ctl = Controller::<Lease>::new(store.clone());
    let lease_cache = lease_ctl.cache();
    let pools = pool_ctl
        .watches_metadata::<Vm>(pool::pool_of_vm)
        .watches::<Lease>(pool::pool_of_ending_lease)
        .resync_every(ctx.settings.resync_every)
        .concurrency(ctx.settings.concurrency)
        .run(
            pool::reconcile,
            default_error_policy,
            ctx.clone(),
            shutdown.clone(),
        );
    let leases = lease_ctl
        .watches_metadata::<Pool>(move |p| lease::leases_for_pool(&lease_cache, p))
        .resync_every(ctx.settings.resync_every)
        .concurrency(ctx.settings.concurrency)
        .run(
            lease::reconcile,
            default_error_policy,
            ctx.clone(),
            shutdown.clone(),
        );
    let inv = inventory::run(ctx.clone(), caches, shutdown.clone().cancelled_owned());
    let compact = {
        let (store, shutdown) = (store.clone(), shutdown.clone());
        async move {
            let mut tick = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {
                        let s = store.clone();
                        match tokio::task::spawn_blocking(move || s.compact(KEEP_REVISIONS)).await {
                            Ok(Err(e)) => tracing::warn!(error = %e, "history compaction failed"),
                            Err(e) => tracing::warn!(error = %e, "history compaction panicked"),
                            Ok(Ok(_)) => {}
                        }
                    }
                }
            }
        }
    };
    tokio::join!(vms, images, pools, leases, inv, compact);
}
