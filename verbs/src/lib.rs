//! boxery's verbs: what every front end does, once, with typed inputs and results. The CLI
//! renders them as text or `-o json|yaml`, the MCP tools as tool results; `sync` and an HTTP
//! API are the next callers. A verb reads and writes objects through
//! [`ObjectStore`](boxery_store::ObjectStore), never prints, and fails with a [`VerbError`]
//! whose [`ErrorKind`] the front end maps (to an exit code, to a tool error).
//!
//! - [`objects`]: get, list, apply (with prune), diff, delete, watch, events; [`describe`]:
//!   one object in detail (spec, status, conditions, members, events), for every front end;
//! - [`edit`]: a person's changes to one object: edit, patch, label, annotate, scale;
//! - [`vm`]: new, snap, revert, fork, start, stop, resize (rm is [`objects::delete`]);
//! - [`pools`]: pool add/rm, lease acquire/renew/release and the [`pools::LeaseKeeper`];
//! - [`grants`]: request, list and revoke grants, and a person's approve/deny;
//! - [`guest`]: what is done inside a VM: run a command, read, write and edit files,
//!   background jobs, copies local ⇄ VM and VM ⇄ VM;
//! - [`wait`]: wait for a condition (bounded or not), running the controllers in this
//!   process while nothing else leads the store (embedded mode, through the
//!   [`control::ControlPlane`] the composition root puts in [`Env`]);
//! - [`control`]: whether a control plane leads the store, and the embedded mode's trait;
//!   [`notes`]: where the verbs' notes for a person go (they never print);
//! - [`env`]: where the state lives and which backend runs VMs; [`render`]: the text forms
//!   of objects both front ends print (tables, YAML, JSONPath, [`render::safe`]).
//!
//! Messages name what the reader can run next, in the [`Voice`] of the front end: `boxery …`
//! commands or `vm_*` tools.

pub mod audit;
pub mod control;
pub mod describe;
pub mod edit;
pub mod egress;
pub mod env;
pub mod error;
pub mod force;
pub mod grants;
pub mod guest;
pub mod loosen;
pub mod notes;
pub mod objects;
pub mod orphans;
pub mod pools;
pub mod render;
pub mod sync;
pub mod typed;
pub mod usage;
pub mod vm;
pub mod wait;

use std::path::Path;
use std::sync::Arc;

pub use boxery_hands::Voice;
use boxery_store::{ObjectStore, ObjectStoreExt};

pub use crate::env::Env;
pub use crate::error::{ErrorKind, Result, VerbError};
/// The store's vocabulary the front ends name (they reach the store through the verbs only).
pub use boxery_store::{
    APPLY_MANAGER, ApplyAction, ApplyOptions, LAST_APPLIED, ObjectRef, SCHEMA_VERSION, entry_fields,
};

/// What the verbs work on: the store, the home and backend, and the voice messages speak in.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Verbs {
    /// Where the state lives and which backend runs VMs.
    pub env: Env,
    /// Who reads the messages.
    pub voice: Voice,
    store: Arc<dyn ObjectStore>,
    /// This home's own store, when `store` is it (opened by this process, its VMs made by
    /// this host's backend and reached by its hands), not a context's. Unguarded: what the
    /// controllers this process runs write with ([`Verbs::guarded`] guards `store` only).
    home_store: Option<Arc<dyn ObjectStore>>,
    /// The field manager every write is recorded as, when the caller names one (the API's
    /// `fieldManager`); else [`Verbs::manager`] names it by voice and verb.
    manager: Option<String>,
    /// The control plane on another machine whose store `store` is, when it is one: how its
    /// VMs are reached.
    remote: Option<Arc<dyn Remote>>,
    /// Who acts, as the audit names them, when the front end says ([`Verbs::acting_for`]);
    /// else the OS user in the voice's words ([`Verbs::actor`]).
    actor: Option<String>,
    /// Through what, when the front end says (`api`); else by voice.
    via: Option<&'static str>,
}

/// A control plane on another machine (a context), as the verbs need it beyond its store:
/// the way to its VMs.
#[async_trait::async_trait]
pub trait Remote: Send + Sync + std::fmt::Debug {
    /// How ssh reaches VM `vm` of it from this machine: a proxy command through its API, with
    /// this machine's key in the VM's `authorized_keys` (put there on first use).
    async fn via(&self, vm: &boxery_api::Vm) -> Result<boxery_hands::ssh::Via>;
    /// VM `vm`'s screen as an RFB (VNC) byte stream through its API: the viewer its host
    /// makes (view only unless `control`, what this side sends filtered there).
    async fn screen(&self, vm: &str, control: bool) -> Result<Box<dyn Duplex>>;
    /// Its name, for messages (`context NAME (https://…)`).
    fn describe(&self) -> String;
}

/// A byte stream both ways.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}

impl Verbs {
    /// The verbs over the store in `env`'s home (opened, created if needed).
    pub fn open(env: Env, voice: Voice) -> Result<Verbs> {
        let store = env.store()?;
        Ok(Verbs::with_store(env, voice, store, true))
    }

    /// The verbs over any store; `home_store` when it is the store of `env`'s home (the verbs
    /// that run the controllers or reach VMs with this host's hands need it to be).
    pub fn with_store(
        env: Env,
        voice: Voice,
        store: Arc<dyn ObjectStore>,
        home_store: bool,
    ) -> Verbs {
        Verbs {
            env,
            voice,
            home_store: home_store.then(|| store.clone()),
            store,
            manager: None,
            remote: None,
            actor: None,
            via: None,
        }
    }

    /// The verbs over the store of a control plane on another machine: `home` holds only what
    /// this machine keeps for it (its ssh files, the keys of leases taken from here).
    pub fn remote(
        env: Env,
        voice: Voice,
        store: Arc<dyn ObjectStore>,
        remote: Arc<dyn Remote>,
    ) -> Verbs {
        Verbs {
            remote: Some(remote),
            ..Verbs::with_store(env, voice, store, false)
        }
    }

    /// The control plane on another machine these verbs work on, if they do.
    pub fn remote_plane(&self) -> Option<&Arc<dyn Remote>> {
        self.remote.as_ref()
    }

    /// Check that VM `vm` can be reached over ssh and write its ssh files: how to reach it.
    /// In this home, with the key of a lease this host holds on it; on another machine's
    /// control plane, through its API ([`Remote::via`]).
    /// A use of the VM: marked in this home ([`boxery_home::activity`]); a VM its controller
    /// suspended for being idle is woken first and reached once it answers. Only a VM that
    /// cannot be reached costs the extra read that tells.
    pub async fn reach(&self, vm: &str) -> Result<boxery_hands::Reach> {
        let reach = match self.reach_now(vm).await {
            Err(e) if crate::vm::wake_if_sleeping(self, vm).await? => {
                tracing::debug!(vm, error = %e.chain(), "woken to be reached");
                self.reach_now(vm).await?
            }
            r => r?,
        };
        if self.home_store.is_some() {
            let _ = boxery_home::activity::touch(&self.env.home, vm);
        }
        Ok(reach)
    }

    /// [`Verbs::reach`] as the VM is now.
    async fn reach_now(&self, vm: &str) -> Result<boxery_hands::Reach> {
        if let Some(store) = &self.home_store {
            let (v, key) =
                boxery_hands::reach_read(&self.env.home, &**store, vm, self.voice).await?;
            // writes the ssh files: off the async workers
            let (ssh, voice) = (boxery_hands::ssh::SshDir::new(&self.env.home), self.voice);
            return tokio::task::spawn_blocking(move || {
                boxery_hands::reach_vm(ssh, &v, key, voice)
            })
            .await
            .map_err(|e| VerbError::failed(format!("the ssh check failed: {e}")))?
            .map_err(VerbError::from);
        }
        let Some(remote) = &self.remote else {
            return Err(VerbError::failed(
                "reaching a VM needs boxery's own store on this host, or a context",
            ));
        };
        let Some(v) = self.store.get_as::<boxery_api::Vm>(vm).await? else {
            return Err(self.vm_not_found(vm).await);
        };
        if let Some(e) = boxery_hands::not_ready_remote(&v, self.voice) {
            return Err(e.into());
        }
        let via = remote.via(&v).await?;
        let ssh = boxery_hands::ssh::SshDir::via(&self.env.home, via);
        let voice = self.voice;
        tokio::task::spawn_blocking(move || boxery_hands::reach_vm(ssh, &v, None, voice))
            .await
            .map_err(|e| VerbError::failed(format!("the ssh check failed: {e}")))?
            .map_err(VerbError::from)
    }

    /// The same verbs, recording every write as field manager `name`.
    pub fn as_manager(&self, name: &str) -> Verbs {
        Verbs {
            manager: Some(name.to_string()),
            ..self.clone()
        }
    }

    /// The same verbs, writing for `writer` ([`boxery_store::guard`]): what an API token's
    /// requests run as.
    pub fn guarded(&self, writer: boxery_store::guard::Writer) -> Verbs {
        Verbs {
            store: Arc::new(boxery_store::guard::Guarded::new(
                self.store.clone(),
                writer,
            )),
            ..self.clone()
        }
    }

    /// The same verbs, speaking in another voice.
    pub fn in_voice(&self, voice: Voice) -> Verbs {
        Verbs {
            voice,
            ..self.clone()
        }
    }

    /// The field manager of a write `verb` makes (`metadata.managedFields`): `boxery-stop`
    /// from the CLI, `mcp-stop` from an agent's tool call, so that `apply` and `sync` can tell
    /// a person's or an agent's change from their own.
    pub fn manager(&self, verb: &str) -> String {
        if let Some(m) = &self.manager {
            return m.clone();
        }
        match self.voice {
            Voice::Cli => format!("boxery-{verb}"),
            Voice::Tool => format!("mcp-{verb}"),
        }
    }

    /// The store.
    pub fn store(&self) -> &dyn ObjectStore {
        &*self.store
    }

    /// The store, shared.
    pub fn store_arc(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }

    /// The store, when it is this home's own: what the verbs that run the controllers or
    /// this host's backend need.
    pub fn home_store(&self) -> Result<&Arc<dyn ObjectStore>> {
        self.home_store.as_ref().ok_or_else(|| {
            VerbError::failed(
                "this needs boxery's own store on this host, which this process did not open",
            )
        })
    }

    /// Whether the store is this home's own, not a context's.
    pub fn is_home_store(&self) -> bool {
        self.home_store.is_some()
    }

    /// `$BOXERY_HOME`.
    pub fn home(&self) -> &Path {
        &self.env.home
    }

    /// The message for a VM that does not exist, listing the ones that do.
    pub async fn vm_not_found(&self, vm: &str) -> VerbError {
        let names: Vec<String> = self
            .store
            .list("Vm", &Default::default())
            .await
            .map(|(objs, _)| objs.into_iter().map(|o| o.metadata.name).collect())
            .unwrap_or_default();
        boxery_hands::vm_not_found(vm, &names, self.voice).into()
    }
}
