//! The guest commands — `file read|write|edit`, `jobs …` and `cp` — over the verbs' guest
//! actions (`boxery_verbs::guest`, the calls the `vm_read`, `vm_write`, `vm_edit`, `vm_jobs`
//! and `vm_copy` tools make), their results rendered for the terminal.

use std::process::ExitCode;

use boxery_verbs::Verbs;
use boxery_verbs::guest::{copy, files, jobs};
use tokio_util::sync::CancellationToken;

use crate::exit::{self, CliError, CliResult};
use crate::out::{out, outln};
use crate::{Command, FileCmd, FileRead, FileWrite, JobsCmd};

/// file read|write|edit, jobs.
pub async fn command(v: &Verbs, command: Command) -> CliResult<ExitCode> {
    match command {
        Command::Jobs { action } => jobs_cmd(v, action).await,
        Command::Read { args } => file_cmd(v, FileCmd::Read(args)).await,
        Command::Write { args } => file_cmd(v, FileCmd::Write(args)).await,
        Command::File { cmd } => file_cmd(v, cmd).await,
        _ => unreachable!("guest::command is called for guest commands only"),
    }
}

/// `file read|write|edit`.
async fn file_cmd(v: &Verbs, cmd: FileCmd) -> CliResult<ExitCode> {
    let ct = CancellationToken::new();
    match cmd {
        FileCmd::Read(FileRead {
            vm,
            path,
            offset,
            limit,
        }) => {
            let input = files::ReadFile {
                vm,
                path,
                from: offset.unwrap_or(1),
                limit: limit.unwrap_or(2000),
            };
            let f = files::read(v, &input, &ct).await?;
            eprintln!("{}", f.header());
            out!("{}", f.content);
        }
        FileCmd::Write(FileWrite { vm, path, version }) => {
            let mut content = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut content)
                .map_err(|e| CliError::invalid(format!("stdin is not UTF-8 text: {e}")))?;
            let input = files::WriteFile {
                vm,
                path,
                content,
                version,
            };
            outln!("{}", files::write(v, input, &ct).await?.summary());
        }
        FileCmd::Edit {
            vm,
            path,
            old,
            new,
            count,
            version,
        } => {
            let input = files::EditFile {
                vm,
                path,
                old,
                new,
                count: count.unwrap_or(1),
                base: version,
            };
            outln!("{}", files::edit(v, input, &ct).await?.summary());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `jobs …`; `jobs wait` exits with the job's code.
async fn jobs_cmd(v: &Verbs, action: JobsCmd) -> CliResult<ExitCode> {
    let ct = CancellationToken::new();
    match action {
        JobsCmd::Start { vm, cwd, cmd } => {
            let line = boxery_hands::line_of(&cmd);
            let started = jobs::start(v, &vm, &line, cwd.as_deref(), &ct).await?;
            outln!("{}", started.id);
        }
        JobsCmd::List { vm } => out!("{}", jobs::list(v, &vm, &ct).await?.table()),
        JobsCmd::Logs { vm, id, offset } => {
            let logs = jobs::logs(v, &vm, &id, offset, 64 << 10, &ct).await?;
            out!("{}", logs.output);
        }
        JobsCmd::Wait { vm, id, timeout } => {
            let timeout = boxery_verbs::guest::clamp_timeout(Some(timeout.as_secs()), 60);
            let e = jobs::wait(v, &vm, &id, timeout, &ct).await?;
            eprintln!("{}", e.text().lines().next().unwrap_or(""));
            return Ok(match (e.state.as_str(), e.exit_code) {
                ("exited", Some(c)) => ExitCode::from(c.clamp(0, 255) as u8),
                ("running", _) => ExitCode::from(exit::Code::Timeout as u8),
                _ => ExitCode::from(1),
            });
        }
        JobsCmd::Kill { vm, id } => out!("{}", jobs::kill(v, &vm, &id, &ct).await?.text()),
    }
    Ok(ExitCode::SUCCESS)
}

/// `cp`: local ⇄ VM and VM ⇄ VM.
pub async fn cp(v: &Verbs, src: &str, dst: &str) -> CliResult<ExitCode> {
    copy::copy(v, src, dst).await?;
    Ok(ExitCode::SUCCESS)
}

/// `forward VM [LOCAL:]REMOTE…`: bind or start every pair, say where each is, and carry them
/// until interrupted (or a reverse forward's connection ends). The session is a use of the VM
/// for as long as it lasts (spec.idle).
pub async fn forward(
    v: &Verbs,
    vm: &str,
    pairs: &[String],
    reverse: bool,
    address: std::net::IpAddr,
) -> CliResult<ExitCode> {
    use boxery_verbs::guest::forward;
    let f = forward::open(v, vm, pairs, reverse, address).await?;
    for line in f.lines(address) {
        outln!("{line}");
    }
    eprintln!("boxery: forwarding until interrupted (Ctrl-C)");
    let _session = v
        .local()
        .is_ok()
        .then(|| boxery_home::activity::Ticker::start(&v.env.home, vm));
    let say: boxery_hands::forward::Say = std::sync::Arc::new(|line| eprintln!("{line}"));
    tokio::select! {
        r = forward::hold(f, say) => r?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// `prompt VM [--agent A] TEXT…`: the agent headless on the prompt, streamed; its exit code.
pub async fn prompt(v: &Verbs, vm: &str, agent: &str, text: &[String]) -> CliResult<ExitCode> {
    use boxery_verbs::guest::prompt;
    let agent: prompt::Agent = agent.parse().map_err(CliError::invalid)?;
    let text = if text == ["-"] {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| CliError::invalid(format!("reading the prompt from stdin: {e}")))?;
        s
    } else {
        text.join(" ")
    };
    prompt::check(&text)?;
    let reach = v.reach(vm).await?;
    let line = prompt::line(agent, &text);
    Ok(boxery_hands::run(&reach, &[line])?)
}

/// `attach VM [--agent A]`: the agent's tmux session, made or rejoined, on this terminal.
pub async fn attach(v: &Verbs, vm: &str, agent: &str) -> CliResult<ExitCode> {
    use boxery_verbs::guest::prompt;
    let agent: prompt::Agent = agent.parse().map_err(CliError::invalid)?;
    if !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        return Err(CliError::invalid(
            "attach needs a terminal: run it in one (for a headless run: boxery prompt VM TEXT)",
        ));
    }
    let reach = v.reach(vm).await?;
    let _session = v
        .local()
        .is_ok()
        .then(|| boxery_home::activity::Ticker::start(&v.env.home, vm));
    Ok(boxery_hands::ssh_line(
        &reach,
        Some(&prompt::attach_line(agent)),
    )?)
}
