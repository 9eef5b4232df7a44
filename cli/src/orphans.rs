//! `boxery orphans`: the orphan verbs (`boxery_verbs::orphans`), rendered.

use crate::out::outln;
use boxery_verbs::{Verbs, orphans};

use crate::exit::CliResult;

/// `orphans` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum OrphansCmd {
    /// List them (the default).
    Ls,
    /// Write an object for an orphan again, with the uid it was made for, so boxery manages it
    /// as before (a Vm keeps its disk; an Image becomes usable as a source again).
    Adopt {
        /// `vm` or `image`.
        kind: String,
        /// Its name in the backend.
        #[arg(value_parser = crate::args::any_name)]
        name: String,
    },
    /// Remove an orphan from the backend for good (its disk or image is deleted). Refused for
    /// what boxery did not make, and for what an object of this store owns.
    Delete {
        /// `vm` or `image`.
        kind: String,
        /// Its name in the backend.
        #[arg(value_parser = crate::args::any_name)]
        name: String,
        /// Say yes: deleting a VM's disk cannot be undone.
        #[arg(long)]
        yes: bool,
    },
}

/// `orphans …`.
pub async fn orphans(v: &Verbs, cmd: Option<OrphansCmd>) -> CliResult {
    match cmd.unwrap_or(OrphansCmd::Ls) {
        OrphansCmd::Ls => {
            let all = orphans::list(v).await?;
            if all.is_empty() {
                eprintln!("No orphans: every VM and image in the backend has its object.");
                return Ok(());
            }
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header(["KIND", "NAME", "VERDICT", "REASON"]);
            for o in &all {
                t.add_row([
                    o.kind.to_string(),
                    boxery_api::name::shown(&o.name),
                    o.verdict.to_string(),
                    o.reason.clone(),
                ]);
            }
            outln!("{}", t.trim_fmt());
        }
        OrphansCmd::Delete { kind, name, yes } => {
            orphans::delete(v, &kind, &name, yes).await?;
            let kind = orphans::which_kind(&kind)?;
            outln!(
                "{}/{name} removed from the backend",
                kind.to_ascii_lowercase()
            );
        }
        OrphansCmd::Adopt { kind, name } => {
            orphans::adopt(v, &kind, &name).await?;
            let kind = orphans::which_kind(&kind)?;
            outln!(
                "{}/{name} adopted: boxery manages it again (`boxery describe {} {name}`)",
                kind.to_ascii_lowercase(),
                kind.to_ascii_lowercase()
            );
        }
    }
    Ok(())
}
