//! Port forwards between this machine and a VM (`boxery forward`): the way to the VM is found
//! once (the ssh check, or a context's tunnel; an idle-suspended VM is woken), then each pair
//! is bound (to the guest: a local listener) or started (from the guest: `ssh -R`), all
//! before anything is said to be forwarded. The hands carry the bytes
//! ([`boxery_hands::forward`]).

use std::net::IpAddr;

use boxery_hands::forward::{Local, Ports, Reverse, Say};

use crate::{Result, VerbError, Verbs};

/// One forward, set up.
#[derive(Debug)]
pub enum Forward {
    /// A local port to the guest's.
    ToGuest(Local, u16),
    /// The guest's port to one here.
    FromGuest(Reverse, Ports),
}

/// Forwards between this machine and VM `vm`, bound and started; [`hold`] carries them.
#[derive(Debug)]
pub struct Forwards {
    reach: boxery_hands::Reach,
    /// Each pair, in the order given.
    pub pairs: Vec<Forward>,
}

impl Forwards {
    /// One line per pair for the person who asked: which address to open where.
    pub fn lines(&self, address: IpAddr) -> Vec<String> {
        let vm = self.reach.vm();
        self.pairs
            .iter()
            .map(|f| match f {
                Forward::ToGuest(l, remote) => {
                    format!("forwarding {} -> {vm}:{remote}", l.addr())
                }
                Forward::FromGuest(_, p) => format!(
                    "forwarding {vm}:127.0.0.1:{} -> {}",
                    p.remote,
                    std::net::SocketAddr::new(address, p.local)
                ),
            })
            .collect()
    }
}

/// Parse every pair (all before any is bound), find the way to `vm`, and bind or start each.
pub async fn open(
    v: &Verbs,
    vm: &str,
    pairs: &[String],
    reverse: bool,
    address: IpAddr,
) -> Result<Forwards> {
    let ports = pairs
        .iter()
        .map(|p| Ports::parse(p))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(dup) = ports.iter().enumerate().find_map(|(i, p)| {
        ports[..i]
            .iter()
            .any(|q| {
                (p.local != 0 && q.local == p.local && !reverse)
                    || (reverse && q.remote == p.remote)
            })
            .then_some(p)
    }) {
        return Err(VerbError::invalid(format!(
            "port {} is given twice",
            if reverse { dup.remote } else { dup.local }
        )));
    }
    let reach = v.reach(vm).await?;
    let mut out = Vec::new();
    for p in ports {
        out.push(if reverse {
            Forward::FromGuest(Reverse::start(&reach, address, p).await?, p)
        } else {
            Forward::ToGuest(Local::bind(address, p).await?, p.remote)
        });
    }
    Ok(Forwards { reach, pairs: out })
}

/// Carry every forward until one from the guest ends (its connection dropped) or the future
/// is dropped; local forwards run until then. `say` gets one line per failed connection.
pub async fn hold(f: Forwards, say: Say) -> Result {
    let mut tasks = tokio::task::JoinSet::new();
    let vm = f.reach.vm().to_string();
    for pair in f.pairs {
        let (reach, say, vm) = (f.reach.clone(), say.clone(), vm.clone());
        match pair {
            Forward::ToGuest(l, _) => {
                tasks.spawn(async move { l.serve(reach, say).await.map_err(|e| e.to_string()) });
            }
            Forward::FromGuest(r, p) => {
                tasks.spawn(async move {
                    Err(format!(
                        "the forward from port {} in {vm}: {}",
                        p.remote,
                        r.wait().await
                    ))
                });
            }
        }
    }
    match tasks.join_next().await {
        Some(Ok(Err(why))) => Err(VerbError::failed(why)),
        Some(Err(e)) => Err(VerbError::failed(format!("a forward failed: {e}"))),
        Some(Ok(Ok(()))) | None => Ok(()),
    }
}
