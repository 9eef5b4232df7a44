//! `boxery config …`: the contexts of this home (`$BOXERY_HOME/contexts.yaml`, kubeconfig
//! format), so every command works on a VM host's control plane from another machine:
//! `boxery --context NAME …`, `BOXERY_CONTEXT=NAME`, or `boxery config use-context NAME`.

use std::path::Path;

use boxery_remote::context::{self, LOCAL};
use clap::Subcommand;

use boxery_verbs::render::safe;

use crate::out::outln;

use crate::exit::{CliError, CliResult};

/// `boxery config …`.
#[derive(Debug, Subcommand)]
pub enum ConfigCmd {
    /// Add (or replace) a context from a kubeconfig `boxery kubeconfig --scope full` printed
    /// on the VM host (`-f -` reads stdin).
    AddContext {
        /// The context's name (a DNS label; not `local`).
        name: String,
        /// The kubeconfig file.
        #[arg(short = 'f', long = "kubeconfig", value_name = "FILE")]
        file: String,
        /// Make it the current context too.
        #[arg(long = "use")]
        make_current: bool,
    },
    /// Make a context the one commands use (`local`: this home's own store).
    UseContext {
        /// The context, or `local`.
        name: String,
    },
    /// List the contexts; `*` marks the current one.
    GetContexts,
    /// Print the current context's name (`local` when none).
    CurrentContext,
    /// Remove a context and what this machine kept for it.
    DeleteContext {
        /// The context.
        name: String,
    },
}

/// Run a `config` command on `home`'s contexts.
pub fn config(home: &Path, cmd: ConfigCmd) -> CliResult {
    match cmd {
        ConfigCmd::AddContext {
            name,
            file,
            make_current,
        } => {
            let (text, what) = if file == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                    .map_err(|e| CliError::invalid(format!("stdin: {e}")))?;
                (s, "stdin".to_string())
            } else {
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| CliError::invalid(format!("cannot read {file}: {e}")))?;
                (text, file.clone())
            };
            let server = context::add(home, &name, &text, &what)?;
            if make_current {
                context::use_context(home, &name)?;
            }
            // The server is the kubeconfig's text, the name the command line's: both reach the
            // terminal only through `safe` (a hostile file's escapes are shown, not run).
            let (name, server) = (safe(&name), safe(&server));
            eprintln!(
                "context {name} added: {server}{}",
                if make_current {
                    " (current)".to_string()
                } else {
                    format!(
                        "; use it with `boxery --context {name} …` or `boxery config use-context {name}`"
                    )
                }
            );
        }
        ConfigCmd::UseContext { name } => {
            context::use_context(home, &name)?;
            eprintln!("current context: {}", safe(&name));
        }
        ConfigCmd::GetContexts => {
            let k = context::load(home)?;
            let current = k.current_context.clone();
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header(["CURRENT", "NAME", "SERVER"]);
            let mark = |n: &str| {
                if current.as_deref() == Some(n) {
                    "*"
                } else {
                    ""
                }
            };
            t.add_row([
                if current.is_none() { "*" } else { "" },
                LOCAL,
                &format!("this home ({})", safe(&home.display().to_string())),
            ]);
            for c in &k.contexts {
                let server = k
                    .clusters
                    .iter()
                    .find(|x| x.name == c.value.cluster)
                    .map(|x| x.value.server.as_str())
                    .unwrap_or("?");
                // contexts.yaml is a file anyone may have edited: names and servers are shown
                // through `safe`, as every string from a file or a server.
                t.add_row([
                    mark(&c.name).to_string(),
                    safe(&c.name).into_owned(),
                    safe(server).into_owned(),
                ]);
            }
            outln!("{}", t.trim_fmt());
        }
        ConfigCmd::CurrentContext => {
            let k = context::load(home)?;
            outln!("{}", safe(k.current_context.as_deref().unwrap_or(LOCAL)));
        }
        ConfigCmd::DeleteContext { name } => {
            context::remove(home, &name)?;
            eprintln!("context {} deleted", safe(&name));
        }
    }
    Ok(())
}
