//! Running a parsed command: with a context selected, on that control plane (the verbs over
//! its API) unless the command runs here ([`crate::table`]); else on this home. One function
//! per group of commands; each calls the verbs and renders their results.

use std::process::ExitCode;

use boxery_api::RunStrategy;
use boxery_hands::Voice;
use boxery_mcp::server as mcp;
use boxery_verbs::{Env, Verbs};

use crate::args::{Cli, Command};
use crate::exit::{self, CliError, CliResult};
use crate::out::{out, outln};
use crate::table::{self, Runs};
use crate::{
    changes, commands, completion, contexts, drill, explain, grants, guest, kubeconfig, manifests,
    orphans, pools, service, sync, vms, wait,
};

/// Run one command: each group of commands has a function of its own.
pub async fn dispatch(cli: Cli) -> CliResult<ExitCode> {
    let selected = cli.backend.clone();
    let env = Env::resolve(cli.home, cli.backend)?
        .with_control(std::sync::Arc::new(boxery_daemon::Embedder));
    match cli.command {
        Command::Config { cmd } => {
            contexts::config(&env.home, cmd)?;
            Ok(ExitCode::SUCCESS)
        }
        command => {
            if let Some(ctx) = boxery_remote::context::resolve(&env.home, cli.context.as_deref())?
                && table::row(&command).runs != Runs::Here
            {
                return remote_command(&env, &ctx, command).await;
            }
            dispatch_here(env, selected, command).await
        }
    }
}

/// A command on the control plane of context `ctx` (another machine's `serve --api-listen`).
async fn remote_command(
    env: &Env,
    ctx: &boxery_remote::Context,
    command: Command,
) -> CliResult<ExitCode> {
    match table::row(&command).runs {
        Runs::HomeOnly { name, why } => {
            return Err(CliError::invalid(format!(
                "`boxery {name}` {why}: it does not work through context {}; run it on the VM host (or with `--context local` here)",
                ctx.name
            )));
        }
        // completion of names reads no remote store: nothing to offer
        _ if matches!(command, Command::CompleteNames { .. }) => return Ok(ExitCode::SUCCESS),
        _ => {}
    }
    let backend = env.backend_name.clone();
    if let Command::Connect { vm } = &command {
        let code = match boxery_remote::connect::tunnel(ctx, vm).await {
            Ok(()) => 0,
            Err(e) => {
                let e = CliError::from(e);
                eprintln!(
                    "error: {}",
                    boxery_verbs::render::safe(&format!("{:#}", e.error))
                );
                e.code as i32
            }
        };
        // Leave now: tokio's stdin reader is a blocking thread the runtime would wait on, and
        // ssh (and its ControlMaster) wait for this process to end.
        std::process::exit(code);
    }
    let v = boxery_remote::verbs(ctx, backend, Voice::Cli).await?;
    match command {
        Command::Mcp { vm, .. } => {
            mcp::stdio(&v.env, vm, Some(&v)).await?;
            Ok(ExitCode::SUCCESS)
        }
        command @ (Command::Read { .. }
        | Command::Write { .. }
        | Command::File { .. }
        | Command::Jobs { .. }) => guest::command(&v, command).await,
        command => verb_command(&v, command).await,
    }
}

/// A command on this home's own store (no context).
async fn dispatch_here(
    env: Env,
    selected: Option<String>,
    command: Command,
) -> CliResult<ExitCode> {
    match command {
        Command::Config { .. } => unreachable!("handled in dispatch"),
        _ if table::row(&command).runs == Runs::ContextOnly => {
            return Err(CliError::invalid(
                "`boxery connect` carries ssh to a VM of another machine's control plane: name a context (`--context NAME`; `boxery config get-contexts` lists them)",
            ));
        }
        Command::Service { cmd } => service::service(&env, selected.as_deref(), cmd).await?,
        Command::Backends => out!("{}", commands::backends_table(&env.home)),
        Command::Images(crate::args::ImagesCmd::Layers) => out!("{}", commands::layers_table()),
        Command::ApiResources => out!("{}", commands::api_resources()),
        Command::Version => commands::version(&env)?,
        Command::Completion { shell } => {
            use clap::CommandFactory;
            out!("{}", completion::script(shell, &mut Cli::command()));
        }
        Command::CompleteNames { kind } => completion::names(env, &kind).await?,
        Command::Exec { args } => {
            let vm = args.first().map_or("VM", String::as_str);
            return Err(CliError::invalid(format!(
                "boxery has no `exec`: `boxery run {vm} -- CMD` runs a command in a VM, `boxery ssh {vm}` opens a shell"
            )));
        }
        Command::Explain { path, recursive } => explain::explain(&path, recursive)?,
        Command::Schema { kind } => commands::schema(kind.as_deref())?,
        Command::Serve {
            inventory_every,
            lease,
            mcp_listen,
            mcp_allow_origin,
            mcp_allow_remote,
            proxy_listen,
            api_listen,
            metrics_listen,
            metrics_allow_remote,
        } => {
            let metrics_listen = metrics_listen.map(|addr| boxery_daemon::MetricsListen {
                addr,
                allow_remote: metrics_allow_remote,
            });
            let mcp_listen = mcp_listen.map(|addr| boxery_daemon::McpListen {
                addr,
                origins: mcp_allow_origin,
                allow_remote: mcp_allow_remote,
            });
            let options = boxery_daemon::Options {
                inventory_every,
                lease,
                mcp_listen,
                proxy_listen,
                api_listen,
                metrics_listen,
            };
            boxery_daemon::serve(&env, options).await?
        }
        Command::Kubeconfig(args) => out!("{}", kubeconfig::run(&env.home, args)?),
        Command::Mcp {
            tools_markdown: true,
            ..
        } => out!("{}", boxery_mcp::markdown()),
        Command::Mcp { vm, .. } => mcp::stdio(&env, vm, None).await?,
        command @ (Command::Read { .. }
        | Command::Write { .. }
        | Command::File { .. }
        | Command::Jobs { .. }) => {
            let v = Verbs::open(env, Voice::Cli)?;
            return guest::command(&v, command).await;
        }
        command => {
            let v = Verbs::open(env, Voice::Cli)?;
            return verb_command(&v, command).await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The commands that call the verbs (and the hands) on the store.
async fn verb_command(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    // A write that waits may run the controllers here, which needs the home's backend: check
    // it before writing, so a refusal leaves the store as it was (not a spec changed with
    // nothing to reconcile it).
    let row = table::row(&command);
    let waits = row.wait.map(|w| w.wait);
    if waits == Some(true) {
        boxery_verbs::objects::check_backend(v).await?;
    }
    // A write that does not wait, with nothing reconciling: say why it will stay Pending.
    let note = waits == Some(false) && !row.deletes;
    let code = verb_command_inner(v, command).await?;
    if note && let Some(line) = boxery_verbs::control::unreconciled_note(v).await? {
        eprintln!("{line}");
    }
    Ok(code)
}

async fn verb_command_inner(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        command @ (Command::Apply { .. }
        | Command::Get { .. }
        | Command::Describe { .. }
        | Command::Delete { .. }
        | Command::Diff { .. }
        | Command::Wait { .. }
        | Command::Events { .. }) => return object_command(v, command).await,
        Command::Edit { kind, name, output } => {
            let format = output.as_deref().map(changes::written_format);
            changes::edit(v, &kind, name, format.as_ref()).await?
        }
        Command::Patch {
            kind,
            name,
            patch_type,
            patch,
            patch_file,
            written,
        } => {
            let p = changes::PatchArgs {
                ty: patch_type,
                patch,
                patch_file,
            };
            changes::patch(v, &kind, name, p, &written).await?
        }
        command @ (Command::Label { .. } | Command::Annotate { .. }) => {
            use boxery_verbs::edit::MetaMap;
            let (map, a) = match command {
                Command::Label { args } => (MetaMap::Labels, args),
                Command::Annotate { args } => (MetaMap::Annotations, args),
                _ => unreachable!("matched above"),
            };
            let sel = changes::Selection {
                selector: a.selector.as_deref(),
                all: a.all,
            };
            changes::set_meta(v, map, &a.kind, &a.args, a.overwrite, sel, &a.written).await?
        }
        Command::Scale {
            kind,
            names,
            replicas,
            current_replicas,
            written,
        } => {
            let to = (replicas, current_replicas);
            changes::scale(v, &kind, &names, to, &written).await?
        }
        Command::Pool(cmd) => pools::pool(v, cmd).await?,
        Command::Lease(cmd) => pools::lease(v, cmd).await?,
        Command::Grant(a) => return grants::grant(v, a).await,
        Command::Orphans { cmd } => orphans::orphans(v, cmd).await?,
        Command::Usage { by, since, output } => crate::usage::usage(v, &by, since, output)?,
        Command::Audit {
            vm,
            holder,
            since,
            output,
        } => crate::audit::audit(v, vm, holder, since, output)?,
        Command::Top { watch, json } => crate::top::top(v, watch, json).await?,
        Command::Sync(args) => sync::sync(v, args).await?,
        Command::Ssh { vm, agent, cmd } => {
            if agent {
                boxery_verbs::grants::agent_grants(v, &vm).await?;
            }
            let reach = v.reach(&vm).await?;
            if agent {
                grants::agent_forward_up(&reach)?;
            }
            // a session is a use for as long as it lasts (spec.idle)
            let _session = v
                .is_home_store()
                .then(|| boxery_home::activity::Ticker::start(&v.env.home, &vm));
            let what = boxery_hands::line_of(&cmd);
            v.doing("ssh", Some(&vm), what.clone())
                .done("started", None);
            let doing = v.doing("ssh-end", Some(&vm), what);
            let code = boxery_hands::ssh_code(&reach, &cmd);
            match &code {
                Ok(c) => doing.done(format!("exit {c}"), None),
                Err(e) => doing.done(format!("error: {e}"), None),
            }
            return Ok(std::process::ExitCode::from(code?));
        }
        Command::Forward {
            vm,
            ports,
            reverse,
            address,
        } => return guest::forward(v, &vm, &ports, reverse, address).await,
        Command::Prompt { vm, agent, text } => return guest::prompt(v, &vm, &agent, &text).await,
        Command::Attach { vm, agent } => return guest::attach(v, &vm, &agent).await,
        Command::Browser {
            vm,
            action,
            args,
            output,
            timeout,
        } => {
            let a = guest::browser_action(&action, &args, timeout)?;
            return guest::browser(v, &vm, &a, output.as_deref()).await;
        }
        Command::Desktop {
            vm,
            control,
            open,
            port,
        } => return crate::desktop::desktop(v, &vm, control, open, port).await,
        Command::Screenshot { vm, file, console } => {
            return guest::screenshot(v, &vm, &file, console).await;
        }
        Command::Computer {
            vm,
            action,
            args,
            hold,
            at,
            output,
            console,
        } => {
            let action = guest::computer_action(&action, &args, hold, at.as_deref())?;
            return guest::computer(v, &vm, &action, output.as_deref(), console).await;
        }
        Command::Run { vm, cmd } => {
            let doing = v.doing("run", Some(&vm), boxery_hands::line_of(&cmd));
            let code = match v.reach(&vm).await {
                Ok(reach) => boxery_hands::run_code(&reach, &cmd).map_err(CliError::from),
                Err(e) => Err(e.into()),
            };
            match &code {
                Ok(c) => doing.done(format!("exit {c}"), None),
                Err(e) => doing.done(format!("error: {:#}", e.error), None),
            }
            return Ok(std::process::ExitCode::from(code?));
        }
        Command::Drill { vm, sibling } => return drill_command(v, &vm, sibling.as_deref()).await,
        Command::Incus { vm, args } => return crate::incus::incus_command(v, &vm, &args).await,
        Command::Cp { src, dst } => return guest::cp(v, &src, &dst).await,
        command => vm_command(v, command).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `drill VM`: the table, and exit 0 only when every probe matched.
async fn drill_command(v: &Verbs, vm: &str, sibling: Option<&str>) -> CliResult<ExitCode> {
    let started = std::time::Instant::now();
    let rows = drill::run(v, vm, sibling).await?;
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(["", "PROBE", "EXPECTED", "RESULT", "CONTROL"]);
    for r in &rows {
        t.add_row([
            if r.ok { "ok" } else { "FAIL" }.to_string(),
            r.probe.clone(),
            r.expected.clone(),
            r.result.clone(),
            r.control.clone(),
        ]);
    }
    outln!("{}", t.trim_fmt());
    let failed = rows.iter().filter(|r| !r.ok).count();
    let secs = started.elapsed().as_secs_f64();
    if failed == 0 {
        outln!(
            "drill of VM {vm}: all {} probes matched ({secs:.1} s)",
            rows.len()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "boxery: drill of VM {vm}: {failed} of {} rows did not match ({secs:.1} s)",
            rows.len()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// apply, get, describe, delete, diff, wait, events.
async fn object_command(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        Command::Apply {
            sources,
            written,
            ownership,
            prune,
            selector,
            adopt,
            wait,
        } => {
            let prune = if prune { selector.as_deref() } else { None };
            let prune = prune
                .map(|p| boxery_verbs::objects::selector(Some(p)))
                .transpose()?;
            let (dry, output) = (written.dry(), written.format());
            let manifests = manifests::read_sources(&sources.files, &sources.kustomize)?;
            let opts = ownership.options(prune);
            commands::apply(v, manifests, dry, output, opts, adopt, wait.wait_for()).await?;
        }
        Command::Get {
            kind,
            names,
            output,
            selector,
            watch,
            watch_only,
            table,
        } => {
            let format = output.parse()?;
            let opts = commands::GetOptions {
                headers: !table.no_headers,
                show_labels: table.show_labels,
                label_columns: table.label_columns,
                sort_by: table.sort_by,
                watch_only,
            };
            let (kind, names) = commands::kind_and_names(&kind, &names)?;
            let kinds = commands::kinds(&kind)?;
            if kinds.len() == 1 {
                let kind = kinds[0].plural;
                commands::get(v, kind, &names, format, selector.as_deref(), watch, &opts).await?;
            } else {
                commands::get_kinds(v, &kinds, &names, format, selector.as_deref(), watch, &opts)
                    .await?;
            }
        }
        Command::Describe {
            kind,
            names,
            selector,
        } => {
            let all = names.is_empty() && selector.is_none() && !kind.contains('/');
            let (info, names) =
                changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
            if names.is_empty() {
                eprintln!("No {} found.", info.plural);
            }
            for (i, n) in names.iter().enumerate() {
                if i > 0 {
                    outln!("");
                }
                commands::describe(v, info.singular, n).await?;
            }
        }
        Command::Delete {
            kind,
            names,
            files,
            kustomize,
            selector,
            all,
            ignore_not_found,
            force,
            wait,
        } => {
            let how = commands::DeleteOptions {
                wait_for: wait.wait_for(),
                force,
                ignore_not_found,
            };
            if !files.is_empty() || !kustomize.is_empty() {
                let manifests = manifests::read_sources(&files, &kustomize)?;
                commands::delete_manifests(v, &manifests, &how).await?
            } else {
                let Some(kind) = kind else {
                    return Err(CliError::invalid(
                        "what to delete: KIND NAME, KIND/NAME, KIND -l SELECTOR, KIND --all, or -f FILE",
                    ));
                };
                let (info, names) =
                    changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
                commands::delete(v, info.singular, &names, &how).await?
            }
        }
        Command::Diff {
            sources,
            ownership,
            prune,
            selector,
        } => {
            let manifests = manifests::read_sources(&sources.files, &sources.kustomize)?;
            let prune = if prune { selector.as_deref() } else { None };
            let prune = prune
                .map(|p| boxery_verbs::objects::selector(Some(p)))
                .transpose()?;
            return match commands::diff(v, manifests, ownership.options(prune)).await {
                Ok(true) => Ok(ExitCode::from(1)),
                Ok(false) => Ok(ExitCode::SUCCESS),
                Err(e) if e.code == exit::Code::Failed => {
                    Err(CliError::new(exit::Code::Invalid, e.error))
                }
                Err(e) => Err(e),
            };
        }
        Command::Wait {
            kind,
            names,
            selector,
            all,
            until,
            timeout,
        } => {
            let until = until.parse()?;
            let (info, names) =
                changes::targets(v, &kind, &names, selector.as_deref(), all).await?;
            if names.is_empty() {
                return Err(CliError::not_found(format!(
                    "no {} to wait for",
                    info.plural
                )));
            }
            let targets: Vec<_> = names
                .into_iter()
                .map(|n| boxery_verbs::ObjectRef::new(info.kind, n))
                .collect();
            wait::all(v, &targets, &until, timeout).await?;
        }
        Command::Events { kind, name } => {
            commands::events(v, kind.as_deref(), name.as_deref()).await?
        }
        _ => unreachable!("object_command is called for object commands only"),
    }
    Ok(ExitCode::SUCCESS)
}

/// new, snap, revert, fork, start, stop, resize, rm.
async fn vm_command(v: &Verbs, command: Command) -> CliResult {
    match command {
        Command::New {
            name,
            from,
            fork,
            size,
            stopped,
            wait,
        } => vms::new(v, &name, from, fork, &size, stopped, wait.wait_for()).await,
        Command::Snap {
            vm,
            label,
            memory,
            wait,
        } => vms::snap(v, &vm, &label, memory, wait.wait_for()).await,
        Command::Revert {
            vm,
            label,
            memory,
            wait,
        } => vms::revert(v, &vm, &label, memory, wait.wait_for()).await,
        Command::Fork {
            src,
            names,
            size,
            with_memory,
            wait,
        } => vms::fork(v, &src, &names, &size, with_memory, wait.wait_for()).await,
        Command::Start { names, wait } => {
            vms::power(v, &names, RunStrategy::Running, wait.wait_for()).await
        }
        Command::Stop { names, wait } => {
            vms::power(v, &names, RunStrategy::Stopped, wait.wait_for()).await
        }
        Command::Suspend { names, wait } => {
            vms::power(v, &names, RunStrategy::Suspended, wait.wait_for()).await
        }
        Command::Resume { names, wait } => {
            vms::power(v, &names, RunStrategy::Running, wait.wait_for()).await
        }
        Command::Resize { name, size, wait } => vms::resize(v, &name, &size, wait.wait_for()).await,
        Command::Rm { names, force, wait } => {
            let how = commands::DeleteOptions {
                wait_for: wait.wait_for(),
                force,
                ignore_not_found: false,
            };
            commands::delete(v, "vm", &names, &how).await
        }
        _ => unreachable!("vm_command is called for VM commands only"),
    }
}
