//! `boxery audit`: the actions log (`boxery_verbs::audit`), as a table or JSON lines.

use std::time::Duration;

use boxery_verbs::Verbs;
use boxery_verbs::audit::{self, Filter};
use boxery_verbs::render::safe;

use crate::exit::{CliError, CliResult};
use crate::out::outln;

/// `audit`'s output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuditOutput {
    /// A table (terminal escapes in commands and paths shown, not acted on).
    Table,
    /// One JSON object per line, as the log holds them.
    Json,
}

/// `boxery audit`.
pub fn audit(
    v: &Verbs,
    vm: Option<String>,
    holder: Option<String>,
    since: Option<Duration>,
    output: AuditOutput,
) -> CliResult {
    let since = since
        .map(|d| chrono::Duration::from_std(d).map_err(|e| CliError::invalid(e.to_string())))
        .transpose()?
        .map(|d| chrono::Utc::now() - d);
    let actions = audit::read(
        &v.env.home,
        &Filter {
            vm,
            who: holder,
            since,
        },
    );
    match output {
        AuditOutput::Json => {
            for a in &actions {
                outln!(
                    "{}",
                    serde_json::to_string(a).map_err(|e| CliError::invalid(e.to_string()))?
                );
            }
        }
        AuditOutput::Table => {
            if actions.is_empty() {
                eprintln!("No actions recorded (for that filter).");
                return Ok(());
            }
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header(["TIME", "WHO", "VIA", "ACTION", "VM", "WHAT", "RESULT", "MS"]);
            for a in &actions {
                t.add_row([
                    a.time.clone(),
                    safe(&a.who).into_owned(),
                    a.via.clone(),
                    a.action.clone(),
                    a.vm.as_deref().map(safe).unwrap_or_default().into_owned(),
                    safe(&a.what).into_owned(),
                    safe(&a.result).into_owned(),
                    a.ms.to_string(),
                ]);
            }
            outln!("{}", t.trim_fmt());
        }
    }
    Ok(())
}
