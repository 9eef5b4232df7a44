//! `boxery incus VM -- ARGS…`: the escape hatch to Incus (seed 003, "What box owns"). boxery
//! owns a command only when it enforces an invariant Incus cannot see; for the rest, this hands
//! Incus the command verbatim, keeping the one rail that matters: it is aimed only at an
//! instance boxery made for this VM (its mark names the Vm's uid), in its home's project.

use std::process::ExitCode;

use boxery_backends::incus::{IncusBackend, instance_name};
use boxery_backends::mark::Mark;
use boxery_verbs::Verbs;

use crate::exit::{CliError, CliResult};

/// The words before the first `--` (what incus parses; after it, the command `exec` runs).
fn incus_words(args: &[String]) -> &[String] {
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    &args[..end]
}

/// The subcommand: the first word that is not a flag.
fn subcommand(args: &[String]) -> Option<&str> {
    incus_words(args)
        .iter()
        .map(String::as_str)
        .find(|w| !w.starts_with('-'))
}

/// Why `args` is not a command about one instance of boxery's project, when it is not: another
/// remote or project, the server's own settings, objects that are not this VM's.
fn refused(args: &[String], vm: &str) -> Option<String> {
    let words = incus_words(args);
    for w in words {
        let flag = w.split('=').next().unwrap_or(w);
        if matches!(
            flag,
            "--project" | "--target-project" | "--target" | "--all-projects"
        ) {
            return Some(format!("`{flag}` aims it at another project or server"));
        }
        if !w.starts_with('-') && !w.contains('=') && w.contains(':') {
            return Some(format!(
                "`{w}` names another remote (boxery hands commands to the local incusd only)"
            ));
        }
    }
    let sub = subcommand(args)?;
    if matches!(
        sub,
        "query"
            | "project"
            | "storage"
            | "admin"
            | "remote"
            | "cluster"
            | "network"
            | "profile"
            | "image"
            | "operation"
            | "warning"
            | "alias"
    ) {
        return Some(format!(
            "`incus {sub}` is not about VM {vm}'s instance: use incus itself for that"
        ));
    }
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    if sub == "config"
        && words
            .iter()
            .any(|w| *w == "trust" || w.starts_with("core."))
    {
        return Some("it changes the server's own settings: use incus itself for that".into());
    }
    None
}

/// What can take a container off boxery's isolation stack or out of its hands: its NIC, its
/// devices, its security settings, raw LXC configuration, boxery's own keys, the instance's
/// name or its files carried elsewhere.
fn moves_off_the_stack(args: &[String]) -> Option<&'static str> {
    let words: Vec<&str> = incus_words(args).iter().map(String::as_str).collect();
    let sub = subcommand(args).unwrap_or("");
    let has = |w: &str| words.contains(&w);
    if has("device") {
        return Some("it changes the container's devices (its NIC, its disks)");
    }
    if words
        .iter()
        .any(|w| w.starts_with("security.") || w.starts_with("raw."))
    {
        return Some("it changes the container's security settings");
    }
    if words.iter().any(|w| {
        w.starts_with("user.boxery.") || w.starts_with("boot.") || w.starts_with("volatile.")
    }) {
        return Some(
            "it changes what boxery keeps on the container (its mark, policy, identity, boot)",
        );
    }
    match sub {
        "config" if has("edit") => Some("it edits the container's whole configuration"),
        "move" | "copy" => Some("it moves or copies the container out of boxery's hands"),
        "rename" | "delete" | "rebuild" => Some(
            "it renames, deletes or rebuilds the container under boxery (boxery repairs what it can)",
        ),
        "publish" | "export" => Some(
            "it carries the container's files (its seed: host key and token) out of boxery's project",
        ),
        _ => None,
    }
}

/// `args` with the VM's name made the instance's: the word itself and `VM/PATH` (`incus file
/// pull VM/etc/hostname .`).
fn aimed(args: &[String], vm: &str, inst: &str) -> Vec<String> {
    let end = incus_words(args).len();
    args.iter()
        .enumerate()
        .map(|(i, a)| {
            if i >= end {
                // the command `exec` runs in the guest: as written
                a.clone()
            } else if a == vm {
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
    if let Some(why) = refused(args, vm) {
        return Err(CliError::invalid(format!("not handed to Incus: {why}")));
    }
    // no other instance of the project: every instance named is this VM's
    let listed = b
        .client()
        .get(&format!(
            "/1.0/instances?project={}&recursion=1",
            b.project()
        ))
        .await
        .map_err(|e| CliError::new(crate::exit::Code::Failed, anyhow::anyhow!("{e}")))?;
    for other in listed.as_array().into_iter().flatten() {
        let Some(name) = other["name"].as_str().filter(|n| *n != inst) else {
            continue;
        };
        if incus_words(args)
            .iter()
            .any(|w| w == name || w.starts_with(&format!("{name}/")))
        {
            let whose = match other["config"]["user.boxery.name"].as_str() {
                Some(vm2) => format!("VM {vm2}'s (`boxery incus {vm2} -- …` for that one)"),
                None => "no VM's".into(),
            };
            return Err(CliError::invalid(format!(
                "not handed to Incus: it names instance {name}, which is {whose}"
            )));
        }
    }
    if let Some(why) = moves_off_the_stack(args) {
        eprintln!(
            "boxery: warning: this can take VM {vm} off boxery's isolation stack ({why}); from \
             there the trust boundary is yours to keep"
        );
    }
    // a client configuration of its own, empty: no remote but the local daemon, whatever the
    // user's own configuration names as its default
    let conf = tempfile::tempdir()
        .and_then(|d| {
            // written, so the client neither greets a first run nor reads the user's remotes
            std::fs::write(
                d.path().join("config.yml"),
                "default-remote: local\nremotes:\n  local:\n    addr: unix://\n    public: false\n",
            )?;
            Ok(d)
        })
        .map_err(|e| CliError::new(crate::exit::Code::Failed, anyhow::anyhow!("{e}")))?;
    let status = tokio::process::Command::new("incus")
        .arg("--project")
        .arg(b.project())
        .args(aimed(args, vm, &inst))
        .env("INCUS_SOCKET", b.client().socket())
        .env("INCUS_CONF", conf.path())
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

    #[test]
    fn the_guests_command_after_the_separator_is_left_as_written() {
        assert_eq!(
            aimed(
                &s(&["exec", "a.b", "--", "echo", "a.b"]),
                "a.b",
                "a-b-0f0f0f"
            ),
            s(&["exec", "a-b-0f0f0f", "--", "echo", "a.b"])
        );
    }

    #[test]
    fn more_ways_off_the_stack_are_named() {
        for cmd in [
            &["config", "set", "dev", "user.boxery.egress=Public"][..],
            &["config", "unset", "dev", "boot.autostart"],
            &["rename", "dev", "dev2"],
            &["publish", "dev"],
            &["--debug", "delete", "dev"],
        ] {
            assert!(moves_off_the_stack(&s(cmd)).is_some(), "{cmd:?}");
        }
    }

    #[test]
    fn commands_about_anything_but_this_instance_are_refused() {
        for cmd in [
            &["--project", "default", "delete", "x"][..],
            &["copy", "dev", "x", "--target-project=default"],
            &["exec", "prod:dev", "--", "true"],
            &["query", "/1.0/instances"],
            &["project", "list"],
            &["config", "trust", "list"],
            &["config", "set", "core.https_address=:8443"],
            &["network", "set", "bx00", "ipv4.nat=false"],
            &["profile", "edit", "default"],
        ] {
            assert!(refused(&s(cmd), "dev").is_some(), "{cmd:?}");
        }
        for cmd in [
            &["info", "dev"][..],
            &["exec", "dev", "--", "sh", "-c", "echo a:b --project x"],
            &["config", "set", "dev", "limits.cpu=2"],
        ] {
            assert!(refused(&s(cmd), "dev").is_none(), "{cmd:?}");
        }
    }
}
