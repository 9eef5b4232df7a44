//! `boxery service`: keep a control plane running, so leases expire, pools reset and VMs come
//! back after a host reboot without anyone running a command.
//!
//! On a host that runs systemd, `install` writes a unit that runs `boxery serve` for this home
//! (a user unit, or a system unit when run as root or with `--system`), enables and starts it.
//! The unit kills only `serve` when it stops (`KillMode=process`): VMs keep running across a
//! restart of the control plane, as they do across a crash of it. On a host without systemd it
//! says so and prints the command to run under another supervisor.

use std::path::{Path, PathBuf};
use std::process::Command as Process;

use boxery_verbs::Env;

use crate::exit::{CliError, CliResult, Code};
use crate::out::outln;

/// `service` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum ServiceCmd {
    /// Write, enable and start a systemd unit running `boxery serve` for this home (and this
    /// backend, when one was selected with --backend or BOXERY_BACKEND). Extra `serve`
    /// arguments go after `--`: `boxery service install -- --mcp-listen 127.0.0.1:7380`.
    Install {
        #[command(flatten)]
        scope: Scope,
        /// Print the unit and change nothing.
        #[arg(long)]
        print: bool,
        /// Arguments for `serve`.
        #[arg(last = true, value_name = "SERVE_ARGS")]
        serve_args: Vec<String>,
    },
    /// Stop and disable the unit and remove it. VMs keep running; nothing reconciles them
    /// until a control plane runs again.
    Uninstall {
        #[command(flatten)]
        scope: Scope,
    },
    /// Whether the unit is installed, enabled and running, and what leads the store now.
    Status {
        #[command(flatten)]
        scope: Scope,
    },
}

/// User or system unit.
#[derive(Debug, Clone, clap::Args)]
pub struct Scope {
    /// A user unit (`systemctl --user`; the default unless run as root). It starts at boot
    /// only with lingering on: `loginctl enable-linger USER`.
    #[arg(long, conflicts_with = "system")]
    user: bool,
    /// A system unit (`/etc/systemd/system`; the default as root).
    #[arg(long)]
    system: bool,
}

impl Scope {
    fn system(&self) -> bool {
        self.system || (!self.user && rustix::process::geteuid().is_root())
    }
}

/// Where the unit lives and how systemctl is called for it.
struct Unit {
    name: String,
    path: PathBuf,
    system: bool,
}

impl Unit {
    fn for_home(env: &Env, scope: &Scope) -> CliResult<Unit> {
        let system = scope.system();
        let dir = if system {
            PathBuf::from("/etc/systemd/system")
        } else {
            let config = std::env::var_os("XDG_CONFIG_HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
                .ok_or_else(|| CliError::invalid("cannot find ~/.config: set HOME"))?;
            config.join("systemd/user")
        };
        let name = unit_name(&env.home);
        Ok(Unit {
            path: dir.join(&name),
            name,
            system,
        })
    }

    fn systemctl(&self, args: &[&str]) -> Process {
        let mut c = Process::new("systemctl");
        if !self.system {
            c.arg("--user");
        }
        c.args(args);
        c
    }

    /// Run systemctl; an error says the command that failed and its words.
    fn run(&self, args: &[&str]) -> CliResult {
        let out = self.systemctl(args).output().map_err(|e| {
            CliError::new(Code::Failed, anyhow::anyhow!("cannot run systemctl: {e}"))
        })?;
        if out.status.success() {
            return Ok(());
        }
        Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!(
                "`systemctl{} {}` failed: {}",
                if self.system { "" } else { " --user" },
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ))
    }

    /// `systemctl is-enabled`/`is-active`'s one word.
    fn word(&self, query: &str) -> String {
        self.systemctl(&[query, &self.name])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .ok()
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| "unknown".into())
    }
}

/// `boxery.service` for the default home; `boxery-HASH.service` for another one (one unit per
/// home, so two homes can each have a control plane).
fn unit_name(home: &Path) -> String {
    let default = Env::resolve(None, None).ok().map(|e| e.home);
    if default.as_deref() == Some(home) {
        return "boxery.service".into();
    }
    let h = boxery_api::fnv::fnv1a(home.as_os_str().as_encoded_bytes());
    format!("boxery-{:08x}.service", h as u32)
}

/// Whether this host runs systemd (`sd_booted()`: `/run/systemd/system` exists).
fn has_systemd() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// A word of a unit's `ExecStart=`: quoted, with `\\`, `"`, `%` and `$` escaped (systemd
/// expands `%` specifiers and `$` variables there; systemd.service(5), "Command lines").
fn quoted(s: &str) -> String {
    quote_unit(s, true)
}

/// A value of a unit's `Environment=`: quoted, with `\\`, `"` and `%` escaped. `$` stays as it
/// is: `Environment=` expands specifiers but not variables (systemd.exec(5)), so `$$` there
/// would be two dollars in the value.
fn quoted_env(s: &str) -> String {
    quote_unit(s, false)
}

fn quote_unit(s: &str, exec: bool) -> String {
    let mut q = String::from("\"");
    for c in s.chars() {
        match c {
            '\\' | '"' => {
                q.push('\\');
                q.push(c);
            }
            '%' => q.push_str("%%"),
            '$' if exec => q.push_str("$$"),
            _ => q.push(c),
        }
    }
    q.push('"');
    q
}

/// Free text in a unit (`Description=`): specifiers escaped (`%` → `%%`), nothing else
/// interpreted there.
fn unit_text_value(s: &str) -> String {
    s.replace('%', "%%")
}

/// Refuse a value that cannot be written into a unit file: a unit is line-based, so a newline
/// (or a carriage return) would end the setting and start another one (`ExecStartPre=…` from a
/// home path); other control characters are refused with them, as they have no place in a
/// path or an argument and would reach a terminal through `systemctl status`.
fn check_unit_value(what: &str, s: &str) -> CliResult {
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(CliError::invalid(format!(
            "cannot write a systemd unit: {what} `{}` holds {} (a unit file is line-based; \
             nothing was written): use a {what} without control characters",
            boxery_verbs::render::safe(s),
            match c {
                '\n' => "a newline".to_string(),
                '\r' => "a carriage return".to_string(),
                c => format!("the control character U+{:04X}", u32::from(c)),
            }
        )));
    }
    Ok(())
}

/// The command that runs this home's control plane, for a person or another supervisor.
fn command_line(exe: &Path, env: &Env, backend: Option<&str>, serve_args: &[String]) -> String {
    let sh = |s: &str| {
        if !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "/._-:=,@".contains(c))
        {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', r"'\''"))
        }
    };
    let mut line = format!("BOXERY_HOME={}", sh(&env.home.to_string_lossy()));
    if let Some(b) = backend {
        line.push_str(&format!(" BOXERY_BACKEND={}", sh(b)));
    }
    line.push_str(&format!(" {} serve", sh(&exe.to_string_lossy())));
    for a in serve_args {
        line.push(' ');
        line.push_str(&sh(a));
    }
    line
}

/// The unit's text; refused when a value holds a newline or another control character.
fn unit_text(
    exe: &Path,
    env: &Env,
    backend: Option<&str>,
    serve_args: &[String],
    system: bool,
) -> CliResult<String> {
    let home = env.home.to_str().ok_or_else(|| {
        CliError::invalid(format!(
            "cannot write a systemd unit: the home path {} is not UTF-8",
            boxery_verbs::render::safe(&env.home.to_string_lossy())
        ))
    })?;
    check_unit_value("home path", home)?;
    check_unit_value("boxery path", &exe.to_string_lossy())?;
    if let Some(b) = backend {
        check_unit_value("backend", b)?;
    }
    for a in serve_args {
        check_unit_value("serve argument", a)?;
    }
    let mut exec = quoted(&exe.to_string_lossy());
    exec.push_str(" serve");
    for a in serve_args {
        exec.push(' ');
        exec.push_str(&quoted(a));
    }
    let mut envs = format!(
        "Environment={}\n",
        quoted_env(&format!("BOXERY_HOME={home}"))
    );
    if let Some(b) = backend {
        envs.push_str(&format!(
            "Environment={}\n",
            quoted_env(&format!("BOXERY_BACKEND={b}"))
        ));
    }
    Ok(format!(
        "# Written by `boxery service install`; `boxery service uninstall` removes it.\n\
         [Unit]\n\
         Description=boxery control plane for {home}\n\
         After=network-online.target libvirtd.service\n\
         Wants=network-online.target\n\
         \n\
         [Service]\n\
         Type=simple\n\
         {envs}\
         ExecStart={exec}\n\
         Restart=always\n\
         RestartSec=2\n\
         # Stopping the control plane leaves the VMs running, as a crash of it does.\n\
         KillMode=process\n\
         \n\
         [Install]\n\
         WantedBy={target}\n",
        home = unit_text_value(home),
        target = if system {
            "multi-user.target"
        } else {
            "default.target"
        },
    ))
}

/// Check the `serve` arguments parse, so a bad one fails now rather than in a restart loop.
fn check_serve_args(serve_args: &[String]) -> CliResult {
    use clap::Parser as _;
    let argv = ["boxery", "serve"]
        .into_iter()
        .map(String::from)
        .chain(serve_args.iter().cloned());
    crate::Cli::try_parse_from(argv).map(drop).map_err(|e| {
        let first = e.to_string();
        let first = first
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("error: ");
        CliError::invalid(format!(
            "serve arguments: {first} (see `boxery serve --help`)"
        ))
    })
}

/// Run a `service` subcommand. `backend` is the backend selected by flag or environment (the
/// unit pins it); `None` leaves the choice to `config.yaml`.
pub async fn service(env: &Env, backend: Option<&str>, cmd: ServiceCmd) -> CliResult {
    match cmd {
        ServiceCmd::Install {
            scope,
            print,
            serve_args,
        } => install(env, backend, &scope, print, &serve_args),
        ServiceCmd::Uninstall { scope } => uninstall(env, &scope),
        ServiceCmd::Status { scope } => status(env, &scope).await,
    }
}

fn install(
    env: &Env,
    backend: Option<&str>,
    scope: &Scope,
    print: bool,
    serve_args: &[String],
) -> CliResult {
    check_serve_args(serve_args)?;
    let exe = std::env::current_exe()
        .map_err(|e| CliError::new(Code::Failed, anyhow::anyhow!("cannot find boxery: {e}")))?;
    let unit = Unit::for_home(env, scope)?;
    let text = unit_text(&exe, env, backend, serve_args, unit.system)?;
    if print {
        crate::out::out!("{text}");
        return Ok(());
    }
    if !has_systemd() {
        outln!("{}", command_line(&exe, env, backend, serve_args));
        return Err(CliError::new(
            Code::Failed,
            anyhow::anyhow!(
                "this host does not run systemd (/run/systemd/system is missing): nothing was \
                 installed. Run the command above (printed on stdout) under your supervisor, \
                 restarted when it exits; `boxery service install --print` shows the systemd \
                 unit it would have written"
            ),
        ));
    }
    if let Some(dir) = unit.path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = unit
        .path
        .with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &text)?;
    std::fs::rename(&tmp, &unit.path)?;
    unit.run(&["daemon-reload"])?;
    unit.run(&["enable", "--now", &unit.name])?;
    outln!(
        "{} installed and started ({})",
        unit.name,
        unit.path.display()
    );
    if !unit.system {
        let user = std::env::var("USER").unwrap_or_default();
        let linger = Process::new("loginctl")
            .args(["show-user", &user, "-p", "Linger", "--value"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "yes")
            .unwrap_or(false);
        if !linger {
            eprintln!(
                "boxery: a user unit runs while you are logged in; to start it at boot: \
                 `loginctl enable-linger {user}` (or install it with --system as root)"
            );
        }
    }
    Ok(())
}

fn uninstall(env: &Env, scope: &Scope) -> CliResult {
    let unit = Unit::for_home(env, scope)?;
    if !unit.path.exists() {
        return Err(CliError::not_found(format!(
            "no unit for this home at {} (`boxery service status` says what runs)",
            unit.path.display()
        )));
    }
    if has_systemd() {
        unit.run(&["disable", "--now", &unit.name])?;
    }
    std::fs::remove_file(&unit.path)?;
    if has_systemd() {
        unit.run(&["daemon-reload"])?;
    }
    outln!(
        "{} removed; the VMs keep running, and nothing reconciles them until a control plane \
         runs again (`boxery serve`)",
        unit.name
    );
    Ok(())
}

async fn status(env: &Env, scope: &Scope) -> CliResult {
    let unit = Unit::for_home(env, scope)?;
    let installed = unit.path.exists();
    outln!(
        "unit:          {} ({})",
        unit.name,
        if installed {
            unit.path.display().to_string()
        } else {
            "not installed".into()
        }
    );
    if !has_systemd() {
        outln!("systemd:       not running on this host");
    } else if installed {
        outln!("enabled:       {}", unit.word("is-enabled"));
        outln!("active:        {}", unit.word("is-active"));
    }
    let leader = boxery_verbs::typed::leader(env)?;
    outln!(
        "control plane: {}",
        match leader {
            // The holder is text from the store's file: shown through the sanitiser.
            Some(h) => format!(
                "running ({} leads the store)",
                boxery_verbs::render::safe(&h)
            ),
            None => "none: nothing reconciles this home (`boxery serve`)".into(),
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_values_are_quoted_against_specifiers_and_variables() {
        assert_eq!(quoted(r#"a "b" %h $X \"#), r#""a \"b\" %%h $$X \\""#);
        assert_eq!(quoted_env(r#"a "b" %h $X \"#), r#""a \"b\" %%h $X \\""#);
        assert!(check_unit_value("home path", "/a b/%h/$x/\u{e9}").is_ok());
        for bad in [
            "/a\nExecStartPre=/bin/sh",
            "/a\rb",
            "/a\u{1b}[2J",
            "/a\u{7f}",
            "/a\u{85}",
        ] {
            assert!(check_unit_value("home path", bad).is_err(), "{bad:?}");
        }
    }
}
