//! The ssh way to a VM host's VMs from this machine. ssh runs `boxery --context NAME connect
//! VM` as its `ProxyCommand`: [`tunnel`] opens `GET /boxery/v1/vms/VM/connect` on the API,
//! upgraded to a raw byte stream the server joins to the VM's sshd, and carries stdin and
//! stdout over it. The login is this machine's own key (`contexts/NAME/ssh/id_ed25519`),
//! which the VM host's control plane puts in the VM's `authorized_keys` when a full token asks
//! (`POST /boxery/v1/vms/NAME/authorize`, once per VM: [`Hands::via`] remembers it in
//! `contexts/NAME/ssh/authorized/`). The host key is the pinned one of the VM's object, read
//! over the API's TLS, as on the VM host. A VM's console for `boxery desktop` comes the same
//! way, upgraded on `GET /boxery/v1/vms/VM/screen` ([`boxery_verbs::Remote::screen`]).

use std::path::PathBuf;

use boxery_hands::ssh::{SshDir, Via};
use boxery_store::wire::{
    AuthorizeReply, AuthorizeRequest, CONNECT_PROTOCOL, authorize_path, connect_path, screen_path,
};
use boxery_verbs::{Result, VerbError};
use tokio::io::AsyncWriteExt;

use crate::client::Client;
use crate::context::Context;

/// Carry stdin and stdout to VM `vm`'s sshd through the API of `ctx` until either side
/// ends. `vm` may be given as ssh's host alias (`NAME.boxery`).
pub async fn tunnel(ctx: &Context, vm: &str) -> Result {
    let vm = vm.strip_suffix(".boxery").unwrap_or(vm);
    boxery_api::Name::label(vm)
        .map_err(|e| VerbError::invalid(format!("{}: {}", boxery_api::name::shown(vm), e.0)))?;
    let client = Client::new(ctx)?;
    let upgraded = upgrade(&client, &connect_path(vm)).await?;
    let (mut from_vm, mut to_vm) = tokio::io::split(upgraded);
    let up = async {
        let mut stdin = tokio::io::stdin();
        let r = tokio::io::copy(&mut stdin, &mut to_vm).await;
        // ssh closed its end: say so to the VM's sshd
        let _ = to_vm.shutdown().await;
        r
    };
    let down = async {
        let mut stdout = tokio::io::stdout();
        let r = tokio::io::copy(&mut from_vm, &mut stdout).await;
        let _ = stdout.flush().await;
        r
    };
    // done when the VM's side ends (ssh then exits); stdin ending first only half-closes
    tokio::pin!(up);
    let mut up_done = false;
    tokio::pin!(down);
    loop {
        tokio::select! {
            r = &mut up, if !up_done => {
                up_done = true;
                if let Err(e) = r {
                    return Err(VerbError::failed(format!("the tunnel to {vm}: {e}")));
                }
            }
            r = &mut down => {
                return r.map(|_| ()).map_err(|e| VerbError::failed(format!("the tunnel from {vm}: {e}")));
            }
        }
    }
}

/// `GET path` on the API, upgraded to a raw byte stream (`Upgrade: boxery-tcp`).
async fn upgrade(client: &Client, path: &str) -> Result<reqwest::Upgraded> {
    let r = client
        .request(reqwest::Method::GET, path)
        .header(reqwest::header::CONNECTION, "upgrade")
        .header(reqwest::header::UPGRADE, CONNECT_PROTOCOL)
        .send()
        .await
        .map_err(|e| VerbError::from(client.unreachable(&e)))?;
    if r.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
        return Err(client.vm_error(r).await);
    }
    r.upgrade()
        .await
        .map_err(|e| VerbError::from(client.unreachable(&e)))
}

/// How this machine reaches a context's VMs (the verbs' [`boxery_verbs::Remote`]).
#[derive(Debug)]
pub struct Hands {
    client: Client,
    ctx: Context,
    /// The `boxery` binary ssh runs as its proxy command.
    exe: PathBuf,
}

impl Hands {
    /// The hands of context `ctx`.
    pub fn new(client: Client, ctx: &Context) -> Hands {
        Hands {
            client,
            ctx: ctx.clone(),
            exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("boxery")),
        }
    }

    /// The ssh dir of the context (its key made on first use).
    fn ssh(&self) -> SshDir {
        SshDir::new(&self.ctx.home)
    }

    /// Where what the VM host said when it logged this machine's key in to VM `vm` is kept.
    fn authorized_file(&self, vm: &str) -> PathBuf {
        self.ssh()
            .dir()
            .join("authorized")
            .join(format!("{vm}.json"))
    }

    /// Log this machine's key in to `vm` unless the VM host did so for this VM (same uid, same
    /// key) already.
    async fn authorize(&self, vm: &boxery_api::Vm) -> Result {
        let ssh = self.ssh();
        let home = self.ctx.home.clone();
        let public = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&home)?;
            ssh.public_key().map_err(std::io::Error::other)
        })
        .await
        .map_err(|e| VerbError::failed(format!("making this machine's ssh key: {e}")))?
        .map_err(|e| VerbError::failed(format!("cannot make this machine's ssh key: {e}")))?;
        let name = vm.metadata.name.as_str();
        // the VM host's answer names a file here: only a name a Vm can have
        boxery_store::check_name("Vm", name).map_err(VerbError::from)?;
        let uid = vm.metadata.uid.clone().unwrap_or_default();
        let file = self.authorized_file(name);
        let body = public
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let done = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice::<AuthorizeReply>(&b).ok())
            .is_some_and(|r| r.uid == uid && r.line.split_whitespace().nth(1) == Some(&body));
        if done {
            return Ok(());
        }
        let r = self
            .client
            .request(reqwest::Method::POST, &authorize_path(name))
            .json(&AuthorizeRequest { public_key: public })
            .send()
            .await
            .map_err(|e| VerbError::from(self.client.unreachable(&e)))?;
        if !r.status().is_success() {
            return Err(self.client.vm_error(r).await);
        }
        let reply: AuthorizeReply = r.json().await.map_err(|e| {
            VerbError::failed(format!(
                "the answer of context {} to authorize is not one: {e}",
                self.ctx.name
            ))
        })?;
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| VerbError::failed(format!("cannot create {}: {e}", dir.display())))?;
        }
        write_private(&file, &serde_json::to_vec(&reply).expect("serializes"))
    }

    /// ssh's `ProxyCommand` for this context: this binary, this home, `connect %n`.
    fn proxy_command(&self) -> String {
        let home = self
            .ctx
            .home
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.to_path_buf())
            .unwrap_or_default();
        let q = |p: &std::path::Path| boxery_hands::shell_quote(&p.display().to_string());
        // ssh expands `%` tokens in the command: a literal one is `%%`
        format!(
            "{} --home {} --context {} connect %n",
            q(&self.exe),
            q(&home),
            self.ctx.name
        )
        .replace('%', "%%")
        .replace("%%n", "%n")
    }
}

/// Write a file 0600, whole or not at all.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> Result {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let r = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(VerbError::failed(format!(
            "cannot write {}: {e}",
            path.display()
        )));
    }
    Ok(())
}

#[async_trait::async_trait]
impl boxery_verbs::Remote for Hands {
    async fn via(&self, vm: &boxery_api::Vm) -> Result<Via> {
        self.authorize(vm).await?;
        Ok(Via {
            proxy_command: self.proxy_command(),
        })
    }

    async fn screen(&self, vm: &str, control: bool) -> Result<Box<dyn boxery_verbs::Duplex>> {
        boxery_api::Name::label(vm)
            .map_err(|e| VerbError::invalid(format!("{}: {}", boxery_api::name::shown(vm), e.0)))?;
        Ok(Box::new(
            upgrade(&self.client, &screen_path(vm, control)).await?,
        ))
    }

    fn describe(&self) -> String {
        format!("context {} ({})", self.ctx.name, self.ctx.server)
    }
}
