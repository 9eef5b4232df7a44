//! Running every reconciler on one store and backend: the Vm, Image, Pool, Lease and Grant
//! controllers, the grant state rebuild, the inventory resync, the usage sampler and history
//! compaction, on one [`Manager`]. Used by `boxery serve` and the CLI's embedded mode: the
//! same set wherever the controllers run.

use std::sync::Arc;
use std::time::Duration;

use boxery_api::pool::PoolMember;
use boxery_api::{Grant, Image, Lease, Pool, Resource, Vm};
use boxery_controller::{
    Cache, CancellationToken, Controller, Manager, SharedWatch, default_error_policy,
};

use crate::context::Ctx;
use crate::{agent_forward, budget, grant, guest, image, inventory, lease, metrics, pool, vm};

/// A controller for `R` on `ctx`'s store whose reconciles read their own writes, with the
/// settings every boxery controller shares.
fn controller<R: Resource>(ctx: &Ctx) -> Controller<R> {
    let ctl = Controller::<R>::new(ctx.store.clone())
        .resync_every(ctx.settings.resync_every)
        .concurrency(ctx.settings.concurrency);
    ctx.read_own_writes(ctl.cache());
    ctl
}

/// Run until `shutdown` is cancelled (or until one of the loops stops on its own, which stops
/// the others).
pub async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let vm_ctl = controller::<Vm>(&ctx);
    let image_ctl = controller::<Image>(&ctx);
    let pool_ctl = controller::<Pool>(&ctx);
    let lease_ctl = controller::<Lease>(&ctx);
    let grant_ctl = controller::<Grant>(&ctx);
    let (grants_a, grants_b) = (grant_ctl.cache(), grant_ctl.cache());
    let guest_vms = vm_ctl.cache();
    let agent_vms = vm_ctl.cache();
    // One full cache per kind (its controller's); the watches keep metadata only.
    let caches = inventory::Caches {
        vms: vm_ctl.cache(),
        images: image_ctl.cache(),
    };
    let (vm_cache, image_cache, lease_cache) =
        (vm_ctl.cache(), image_ctl.cache(), lease_ctl.cache());
    // Every pool member's record, for the pool and lease reconcilers (claims read it).
    let members = Cache::new(PoolMember::INFO.kind);
    ctx.read_own_writes(members.clone());
    ctx.keep_pool_caches(pool::Caches {
        members: members.clone(),
        leases: lease_ctl.cache(),
    });
    let follow = pool::follow_members(
        ctx.store.clone(),
        members.clone(),
        pool_ctl.trigger(),
        lease_ctl.trigger(),
        lease_ctl.cache(),
        shutdown.clone(),
    );

    // Four controllers map Vm changes: one metadata watch of Vms for all of them.
    let vm_metadata = SharedWatch::metadata::<Vm>()
        .subscribe(image_ctl.trigger(), move |o| {
            image::images_for_vm(&image_cache, o)
        })
        .subscribe(pool_ctl.trigger(), pool::pool_of_vm)
        .subscribe(lease_ctl.trigger(), move |v| {
            lease::lease_of_vm(&members, v)
        })
        .subscribe(grant_ctl.trigger(), move |v| {
            grant::grants_of_vm(&grants_a, v)
        });

    let mut m = Manager::new(shutdown);
    let token = m.token();
    // The usage sampler runs wherever the controllers do (a `serve`, or a command's embedded
    // controllers): budgets are judged from what it records. `/metrics` reads its samples
    // where a `serve` exposes them; elsewhere it keeps none.
    let samples = ctx.observed().map(|observed| {
        let samples = Arc::default();
        observed.attach(metrics::Attached {
            vms: vm_ctl.cache(),
            images: image_ctl.cache(),
            pools: pool_ctl.cache(),
            leases: lease_ctl.cache(),
            grants: grant_ctl.cache(),
            samples: Arc::clone(&samples),
        });
        samples
    });
    m.add(
        "samples",
        metrics::sample(
            ctx.clone(),
            vm_ctl.cache(),
            lease_ctl.cache(),
            samples,
            token.clone(),
        ),
    );
    m.add(
        "vm-metadata",
        vm_metadata.run(ctx.store.clone(), token.clone()),
    );
    m.add(
        "vm",
        vm_ctl
            .watches_metadata::<Image>(move |o| vm::vms_for_image(&vm_cache, o))
            .watches::<Lease>(budget::vm_of_lease)
            .run(
                vm::reconcile,
                default_error_policy,
                ctx.clone(),
                token.clone(),
            ),
    );
    m.add(
        "image",
        image_ctl.run(
            image::reconcile,
            default_error_policy,
            ctx.clone(),
            token.clone(),
        ),
    );
    m.add(
        "pool",
        pool_ctl.watches::<Lease>(pool::pool_of_ending_lease).run(
            pool::reconcile,
            default_error_policy,
            ctx.clone(),
            token.clone(),
        ),
    );
    m.add(
        "lease",
        lease_ctl
            .watches_metadata::<Pool>(move |p| lease::leases_for_pool(&lease_cache, p))
            .run(
                lease::reconcile,
                default_error_policy,
                ctx.clone(),
                token.clone(),
            ),
    );
    m.add(
        "grant",
        grant_ctl
            .watches_metadata::<Lease>(move |l| grant::grants_of_lease(&grants_b, l))
            .run(
                grant::reconcile,
                default_error_policy,
                ctx.clone(),
                token.clone(),
            ),
    );
    m.add("grant-state", grant::keep_state(ctx.clone(), token.clone()));
    m.add("guest", guest::keep(ctx.clone(), guest_vms, token.clone()));
    m.add(
        "agent-forward",
        agent_forward::keep(ctx.clone(), agent_vms, token.clone()),
    );
    m.add("poolmembers", follow);
    m.add(
        "inventory",
        inventory::run(ctx.clone(), caches, token.clone().cancelled_owned()),
    );
    m.add("compaction", compact(ctx.clone(), token));
    if let Err(e) = m.run().await {
        tracing::error!(error = %boxery_controller::error_chain(&e), "the controllers stopped");
    }
    if let Some(observed) = ctx.observed() {
        observed.detach();
    }
}

/// Trim the store's history every minute.
async fn compact(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {
                if let Err(e) = ctx.store.compact(boxery_store::KEEP_REVISIONS).await {
                    tracing::warn!(error = %e, "history compaction failed");
                }
            }
        }
    }
}
