//! Copies of files and directories, streamed as tar: local ⇄ VM and VM ⇄ VM (`vm_copy`,
//! `boxery cp`). The hands do the copying ([`boxery_hands::cp`]); this finds the way to each
//! VM first (the ssh check, a context's tunnel) and runs the copy off the async workers.

use boxery_hands::Place;

use crate::{Result, VerbError, Verbs};

/// Copy `src` to `dst`, each `VM:PATH` or a local path (`local:PATH` to say so).
pub async fn copy(v: &Verbs, src: &str, dst: &str) -> Result {
    let vm = [Place::parse(src), Place::parse(dst)]
        .into_iter()
        .find_map(|p| match p {
            Place::Vm(vm, _) => Some(vm),
            _ => None,
        });
    let doing = v.doing("cp", vm.as_deref(), format!("{src} {dst}"));
    let r = copy_unrecorded(v, src, dst).await;
    doing.ended(&r, None);
    r
}

async fn copy_unrecorded(v: &Verbs, src: &str, dst: &str) -> Result {
    let mut ways = Vec::new();
    for p in [Place::parse(src), Place::parse(dst)] {
        if let Place::Vm(vm, _) = p {
            ways.push(v.reach(&vm).await?);
        }
    }
    let (src, dst) = (src.to_string(), dst.to_string());
    tokio::task::spawn_blocking(move || {
        // the ways were found above, in the order cp asks for them
        let mut ways = ways.into_iter();
        boxery_hands::cp(
            |_| {
                ways.next().ok_or_else(|| {
                    boxery_hands::HandsError::Invalid("name a VM on one side".into())
                })
            },
            &src,
            &dst,
        )
    })
    .await
    .map_err(|e| VerbError::failed(format!("the copy task failed: {e}")))?
    .map_err(VerbError::from)
}
