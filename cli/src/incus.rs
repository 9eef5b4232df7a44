//! `boxery incus VM -- ARGS…`: the escape hatch to Incus (seed 003, "What box owns"). boxery
//! owns a command only when it enforces an invariant Incus cannot see; for the rest, this hands
//! Incus the command verbatim, keeping the one rail that matters: it is aimed only at an
//! instance boxery made for this VM (its mark names the Vm's uid), in its home's project.

use std::process::ExitCode;

use boxery_backends::incus::{IncusBackend, instance_name};
use boxery_backends::mark::Mark;
use boxery_verbs::Verbs;

use crate::exit::{CliError, CliResult};

/// What can take a container off boxery's isolation stack: its NIC, its devices, its profiles,
/// its security settings, raw LXC configuration, the network itself.
fn moves_off_the_stack(args: &[String]) -> Option<&'static str> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let has = |w: &str| words.contains(&w);
    if words.first() == Some(&"network") {
        return Some("it changes a network");
    }
    if words.first() == Some(&"profile") {
        return Some("it changes a profile");
    }
    if has("device") {
        return Some("it changes the container's devices (its NIC, its disks)");
    }
    if words
        .iter()
        .any(|w| w.starts_with("security.") || w.starts_with("raw."))
    {
        return Some("it changes the container's security settings");
    }
    if words.first() == Some(&"config")
        && (has("edit") || words.iter().any(|w| w.starts_with("volatile.")))
    {
        return Some("it edits the container's whole configuration");
    }
    if words.first() == Some(&"move") || words.first() == Some(&"copy") {
        return Some("it moves or copies the container out of boxery's project");
    }
    None
}

/// `args` with the VM's name made the instance's: the word itself and `VM/PATH` (`incus file
/// pull VM/etc/hostname .`).
fn aimed(args: &[String], vm: &str, inst: &str) -> Vec<String> {
    args.iter()
        .map(|a| {
            if a == vm {
                inst.to_string()
            } else if let Some(rest) = a.strip_prefix(&format!("{vm}/")) {
                format!("{inst}/{rest}")
            } else {
                a.clone()
            }
        })
        .collect()
}

/// `boxery incus VM -- ARGS…`.
pub async fn incus_command(v: &Verbs, vm: &str, args: &[String]) -> CliResult<ExitCode> {
    let obj = boxery_verbs::vm::get_vm(v, vm).await?;
    let backend = obj.status.backend.as_deref().unwrap_or("");
    if backend != "incus" {
        return Err(CliError::invalid(format!(
            "VM {vm} runs on the {} backend: `boxery incus` hands commands to Incus for the \
             incus backend's VMs only",
            if backend.is_empty() {
                "(not yet chosen)"
            } else {
                backend
            }
        )));
    }
    let b = IncusBackend::new(boxery_backends::state_dir(&v.env.home, "incus"));
    let inst = instance_name(vm);
    let found = b
        .client()
        .get_opt(&format!("/1.0/instances/{inst}?project={}", b.project()))
        .await
        .map_err(|e| CliError::new(crate::exit::Code::Failed, anyhow::anyhow!("{e}")))?;
    let mark = found
        .as_ref()
        .and_then(|i| i["config"]["user.boxery.mark"].as_str());
    if !Mark::is_for(mark, obj.metadata.uid.as_deref()) {
        return Err(CliError::not_found(format!(
            "Incus has no instance made for VM {vm} in project {} (instance {inst}): nothing \
             to hand the command to",
            b.project()
        )));
    }
    if args.is_empty() {
        return Err(CliError::invalid(format!(
            "give Incus a command after `--`: `boxery incus {vm} -- info {vm}`"
        )));
    }
    if let Some(why) = moves_off_the_stack(args) {
        eprintln!(
            "boxery: warning: this can take VM {vm} off boxery's isolation stack ({why}); from \
             there the trust boundary is yours to keep"
        );
    }
    let status = tokio::process::Command::new("incus")
        .arg("--project")
        .arg(b.project())
        .args(aimed(args, vm, &inst))
        .env("INCUS_SOCKET", b.client().socket())
        .status()
        .await
        .map_err(|e| {
            CliError::new(
                crate::exit::Code::Failed,
                anyhow::anyhow!(
                    "could not run incus ({e}): install it with scripts/install-incus.sh"
                ),
            )
        })?;
    Ok(ExitCode::from(
        status.code().unwrap_or(1).clamp(0, 255) as u8
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn the_vms_name_becomes_the_instances() {
        assert_eq!(
            aimed(
                &s(&["file", "pull", "a.b/etc/hostname", "."]),
                "a.b",
                "a-b-0f0f0f"
            ),
            s(&["file", "pull", "a-b-0f0f0f/etc/hostname", "."])
        );
        assert_eq!(
            aimed(&s(&["info", "dev"]), "dev", "dev"),
            s(&["info", "dev"])
        );
    }

    #[test]
    fn changes_to_the_isolation_stack_are_named() {
        for cmd in [
            &["config", "device", "remove", "dev", "eth0"][..],
            &["config", "set", "dev", "security.privileged=true"],
            &[
                "config",
                "set",
                "dev",
                "raw.lxc=lxc.apparmor.profile=unconfined",
            ],
            &["profile", "edit", "default"],
            &["network", "set", "bx00", "ipv4.nat=false"],
            &["config", "edit", "dev"],
            &["move", "dev", "other"],
        ] {
            assert!(moves_off_the_stack(&s(cmd)).is_some(), "{cmd:?}");
        }
        for cmd in [
            &["info", "dev"][..],
            &["exec", "dev", "--", "ls"],
            &["config", "show", "dev"],
            &["snapshot", "list", "dev"],
        ] {
            assert!(moves_off_the_stack(&s(cmd)).is_none(), "{cmd:?}");
        }
    }
}
