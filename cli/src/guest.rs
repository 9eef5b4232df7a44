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
        .is_home_store()
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
        .is_home_store()
        .then(|| boxery_home::activity::Ticker::start(&v.env.home, vm));
    Ok(boxery_hands::ssh_line(
        &reach,
        Some(&prompt::attach_line(agent)),
    )?)
}

/// Write a PNG to `file` (`-`: stdout, refused on a terminal).
fn save_png(file: &std::path::Path, png: &[u8]) -> CliResult {
    use std::io::Write;
    if file.as_os_str() == "-" {
        let mut o = std::io::stdout().lock();
        if std::io::IsTerminal::is_terminal(&o) {
            return Err(CliError::invalid(
                "stdout is a terminal: give a file name, or redirect (> screen.png)",
            ));
        }
        return o
            .write_all(png)
            .and_then(|()| o.flush())
            .map_err(CliError::from);
    }
    std::fs::write(file, png)
        .map_err(|e| CliError::invalid(format!("writing {}: {e}", file.display())))
}

/// `screenshot VM FILE [--console]`: the screen at its own size.
pub async fn screenshot(
    v: &Verbs,
    vm: &str,
    file: &std::path::Path,
    console: bool,
) -> CliResult<ExitCode> {
    use boxery_verbs::guest::computer;
    let ct = CancellationToken::new();
    let shot = tokio::select! {
        r = computer::screenshot(v, vm, console, false, &ct) => r?,
        _ = tokio::signal::ctrl_c() => { ct.cancel(); return Ok(ExitCode::from(130)); }
    };
    save_png(file, &shot.png)?;
    if file.as_os_str() != "-" {
        outln!(
            "{} ({}×{}, {})",
            file.display(),
            shot.width,
            shot.height,
            shot.path.describe()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The action `computer VM ACTION ARGS…` names, from its words.
pub fn computer_action(
    name: &str,
    args: &[String],
    hold: Option<String>,
    at: Option<&str>,
) -> CliResult<boxery_verbs::guest::computer::Action> {
    use boxery_verbs::guest::computer::Action;
    let action = serde_json::from_value(serde_json::Value::String(name.into())).map_err(|_| {
        CliError::invalid(format!(
            "no action `{}`: screenshot, left_click, right_click, middle_click, double_click, triple_click, mouse_move, left_click_drag, type, key, scroll, cursor_position or wait",
            boxery_api::name::shown(name)
        ))
    })?;
    let mut a = Action {
        action,
        coordinate: None,
        start_coordinate: None,
        text: hold,
        scroll_direction: None,
        scroll_amount: None,
        duration: None,
    };
    let int = |s: &str| {
        s.trim().parse::<i64>().map_err(|_| {
            CliError::invalid(format!(
                "`{}` is not a whole number of pixels",
                boxery_api::name::shown(s)
            ))
        })
    };
    let point = |x: &str, y: &str| -> CliResult<[i64; 2]> { Ok([int(x)?, int(y)?]) };
    let wrong = |usage: &str| {
        CliError::invalid(format!(
            "{name} takes {usage} (boxery computer --help lists every action)"
        ))
    };
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    if at.is_some() && name != "scroll" {
        return Err(CliError::invalid(
            "--at is for scroll: other actions take X Y",
        ));
    }
    match name {
        "screenshot" | "cursor_position" if !words.is_empty() => {
            return Err(wrong("no arguments (screenshot: -o FILE)"));
        }
        "left_click" | "right_click" | "middle_click" | "double_click" | "triple_click" => {
            match words[..] {
                [] => {}
                [x, y] => a.coordinate = Some(point(x, y)?),
                _ => return Err(wrong("X Y, or nothing (where the pointer is)")),
            }
        }
        "mouse_move" => match words[..] {
            [x, y] => a.coordinate = Some(point(x, y)?),
            _ => return Err(wrong("X Y")),
        },
        "left_click_drag" => match words[..] {
            [x0, y0, x1, y1] => {
                a.start_coordinate = Some(point(x0, y0)?);
                a.coordinate = Some(point(x1, y1)?);
            }
            _ => return Err(wrong("X0 Y0 X1 Y1")),
        },
        "type" | "key" if words.is_empty() => {
            return Err(wrong(if name == "type" { "TEXT" } else { "KEYS" }));
        }
        "type" | "key" if a.text.is_some() => {
            return Err(CliError::invalid("--hold is for clicks"));
        }
        "type" | "key" => a.text = Some(args.join(" ")),
        "scroll" => {
            let (dir, n) = match words[..] {
                [d] => (d, None),
                [d, n] => (d, Some(n)),
                _ => return Err(wrong("up|down|left|right [NOTCHES]")),
            };
            a.scroll_direction = Some(
                serde_json::from_value(serde_json::Value::String(dir.into()))
                    .map_err(|_| wrong("up|down|left|right [NOTCHES]"))?,
            );
            if let Some(n) = n {
                a.scroll_amount = Some(n.parse().map_err(|_| wrong("a whole number of notches"))?);
            }
            if let Some(at) = at {
                let Some((x, y)) = at.split_once(',') else {
                    return Err(CliError::invalid("--at takes X,Y"));
                };
                a.coordinate = Some(point(x, y)?);
            }
        }
        "wait" => match words[..] {
            [] => {}
            [d] => {
                a.duration = Some(d.parse().map_err(|_| wrong("SECONDS"))?);
            }
            _ => return Err(wrong("[SECONDS]")),
        },
        _ => {}
    }
    if a.text.is_some() && !name.ends_with("click") && name != "type" && name != "key" {
        return Err(CliError::invalid("--hold is for clicks"));
    }
    Ok(a)
}

/// `computer VM ACTION …`: one action, in the screen's own pixels.
pub async fn computer(
    v: &Verbs,
    vm: &str,
    action: &boxery_verbs::guest::computer::Action,
    output: Option<&std::path::Path>,
    console: bool,
) -> CliResult<ExitCode> {
    use boxery_verbs::guest::computer::{self, ActionName};
    let shoots = matches!(action.action, ActionName::Screenshot | ActionName::Wait);
    if action.action == ActionName::Screenshot && output.is_none() {
        return Err(CliError::invalid(
            "screenshot needs -o FILE (or `boxery screenshot VM FILE`)",
        ));
    }
    if output.is_some() && !shoots {
        return Err(CliError::invalid("-o is for screenshot and wait"));
    }
    let ct = CancellationToken::new();
    let done = tokio::select! {
        r = computer::act(v, vm, action, console, false, &ct) => r?,
        _ = tokio::signal::ctrl_c() => { ct.cancel(); return Ok(ExitCode::from(130)); }
    };
    if let (Some(file), Some(shot)) = (output, &done.shot) {
        save_png(file, &shot.png)?;
        if file.as_os_str() == "-" {
            return Ok(ExitCode::SUCCESS);
        }
    }
    outln!("{}", done.said);
    Ok(ExitCode::SUCCESS)
}

/// The browser action a command line says (`open URL`, `click SELECTOR`, …).
pub fn browser_action(
    name: &str,
    words: &[String],
    timeout: Option<u64>,
) -> CliResult<boxery_verbs::guest::browser::Browse> {
    use boxery_verbs::guest::browser::{Browse, BrowserAction as A};
    let wrong = |usage: &str| CliError::invalid(format!("usage: browser VM {name} {usage}"));
    // (the action's names are its wire names: one table, in the verbs)
    let action: A = serde_json::from_value(serde_json::Value::from(name)).map_err(|_| {
        CliError::invalid(format!(
            "no browser action `{}`: open, read, click, fill, evaluate, screenshot",
            boxery_verbs::render::safe(name)
        ))
    })?;
    let mut b = Browse {
        action,
        url: None,
        selector: None,
        text: None,
        expression: None,
        timeout_seconds: timeout,
    };
    match (action, words) {
        (A::Open, [url]) => b.url = Some(url.clone()),
        (A::Open, _) => return Err(wrong("URL")),
        (A::Read | A::Screenshot, []) => {}
        (A::Read | A::Screenshot, _) => return Err(wrong("(no arguments)")),
        (A::Click, [sel]) => b.selector = Some(sel.clone()),
        (A::Click, _) => return Err(wrong("SELECTOR")),
        (A::Fill, [sel]) => b.selector = Some(sel.clone()),
        (A::Fill, [sel, text @ ..]) => {
            b.selector = Some(sel.clone());
            b.text = Some(text.join(" "));
        }
        (A::Fill, []) => return Err(wrong("SELECTOR [TEXT]")),
        (A::Evaluate, []) => return Err(wrong("EXPRESSION")),
        (A::Evaluate, expr) => b.expression = Some(expr.join(" ")),
    }
    Ok(b)
}

/// A page's text for a terminal: lines and tabs kept, every other character a terminal would
/// act on (escapes, bidirectional controls) escaped.
fn page_text(t: &str) -> String {
    t.split('\n')
        .map(|line| {
            line.split('\t')
                .map(|p| boxery_verbs::render::safe(p).into_owned())
                .collect::<Vec<_>>()
                .join("\t")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `browser VM ACTION …`: one action; the page's text or a value on stdout, the line about
/// the page on stderr.
pub async fn browser(
    v: &Verbs,
    vm: &str,
    a: &boxery_verbs::guest::browser::Browse,
    output: Option<&std::path::Path>,
) -> CliResult<ExitCode> {
    use boxery_verbs::guest::browser::{self, BrowserAction as A};
    if a.action == A::Screenshot && output.is_none() {
        return Err(CliError::invalid("screenshot needs -o FILE (- for stdout)"));
    }
    if output.is_some() && a.action != A::Screenshot {
        return Err(CliError::invalid("-o is for screenshot"));
    }
    let ct = CancellationToken::new();
    let done = tokio::select! {
        r = browser::browse(v, vm, a, &ct) => r?,
        _ = tokio::signal::ctrl_c() => { ct.cancel(); return Ok(ExitCode::from(130)); }
    };
    let safe = |s: &str| boxery_verbs::render::safe(s).into_owned();
    eprintln!("boxery: {}", safe(&done.said()));
    if let (Some(file), Some(png)) = (output, &done.png) {
        save_png(file, png)?;
        return Ok(ExitCode::SUCCESS);
    }
    match a.action {
        A::Open | A::Read => {
            if let Some(t) = &done.text {
                // (the page's text as it is, but for escape sequences a terminal would obey)
                out!("{}", page_text(t));
                if !t.ends_with('\n') && !t.is_empty() {
                    outln!("");
                }
            }
            if done.truncated {
                eprintln!(
                    "boxery: the page's text was cut at {} bytes",
                    boxery_verbs::guest::browser::TEXT_CAP
                );
            }
            if done.error.is_some() {
                return Ok(ExitCode::from(exit::Code::Failed as u8));
            }
        }
        A::Evaluate => match (&done.value, &done.error) {
            (_, Some(_)) => return Ok(ExitCode::from(exit::Code::Failed as u8)),
            (Some(v), None) => outln!(
                "{}",
                safe(&serde_json::to_string_pretty(v).unwrap_or_default())
            ),
            (None, None) => outln!("undefined"),
        },
        _ => {}
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod browser_tests {
    use clap::Parser;

    fn parse(argv: &[&str]) -> crate::exit::CliResult<boxery_verbs::guest::browser::Browse> {
        let argv = std::iter::once("boxery").chain(argv.iter().copied());
        match crate::Cli::try_parse_from(argv).unwrap().command {
            crate::Command::Browser {
                action,
                args,
                timeout,
                ..
            } => super::browser_action(&action, &args, timeout),
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_words_are_the_actions_fields() {
        let b = parse(&["browser", "web1", "fill", "#name", "Ada", "Lovelace"]).unwrap();
        assert_eq!(b.selector.as_deref(), Some("#name"));
        assert_eq!(b.text.as_deref(), Some("Ada Lovelace"));
        let b = parse(&["browser", "web1", "fill", "#name", "--", "-x"]).unwrap();
        assert_eq!(b.text.as_deref(), Some("-x"));
        let b = parse(&["browser", "web1", "open", "http://a/", "--timeout", "9"]).unwrap();
        assert_eq!(
            (b.url.as_deref(), b.timeout_seconds),
            (Some("http://a/"), Some(9))
        );
        let b = parse(&["browser", "web1", "evaluate", "1", "+", "1"]).unwrap();
        assert_eq!(b.expression.as_deref(), Some("1 + 1"));
        for bad in [
            &["browser", "web1", "open"][..],
            &["browser", "web1", "read", "x"],
            &["browser", "web1", "click"],
            &["browser", "web1", "click", "a", "b"],
            &["browser", "web1", "scroll"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}

#[cfg(test)]
mod computer_tests {
    use clap::Parser;

    /// The command line as docs/desktop.md and `boxery computer --help` write it: options after
    /// the action's words are options, never words of the action (a text typed on the wrong
    /// screen).
    #[test]
    fn options_after_the_words_are_options() {
        let parse = |line: &str| {
            let argv = std::iter::once("boxery").chain(line.split(' '));
            match crate::Cli::try_parse_from(argv).unwrap().command {
                crate::Command::Computer {
                    action,
                    args,
                    hold,
                    at,
                    output,
                    console,
                    ..
                } => {
                    let a = super::computer_action(&action, &args, hold, at.as_deref()).unwrap();
                    (a, output, console)
                }
                _ => unreachable!(),
            }
        };
        let (a, _, console) = parse("computer desk1 type hello --console");
        assert_eq!(a.text.as_deref(), Some("hello"));
        assert!(console);
        let (a, _, _) = parse("computer desk1 scroll down 5 --at 640,400");
        assert_eq!((a.scroll_amount, a.coordinate), (Some(5), Some([640, 400])));
        let (a, out, _) = parse("computer desk1 wait 2 -o after.png");
        assert_eq!(a.duration, Some(2.0));
        assert_eq!(out.unwrap().to_str(), Some("after.png"));
        let (a, _, _) = parse("computer desk1 left_click 640 400 --hold shift");
        assert_eq!(
            (a.coordinate, a.text.as_deref()),
            (Some([640, 400]), Some("shift"))
        );
        let (a, _, _) = parse("computer desk1 type -- -x --console");
        assert_eq!(a.text.as_deref(), Some("-x --console"));
        // a negative coordinate is a number (refused later as off the screen), not an option
        let (a, _, _) = parse("computer desk1 mouse_move -5 10");
        assert_eq!(a.coordinate, Some([-5, 10]));
    }
}
