//! `boxery usage`: the usage report (`boxery_verbs::usage`), as a table, JSON or CSV.

use std::time::Duration;

use boxery_verbs::Verbs;
use boxery_verbs::usage::{self, UsageLine};

use crate::exit::{CliError, CliResult};
use crate::out::outln;

/// `usage`'s output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageOutput {
    /// A table.
    Table,
    /// A JSON list of lines.
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// `boxery usage`.
pub fn usage(v: &Verbs, by: &str, since: Duration, output: UsageOutput) -> CliResult {
    let grouped = usage::by(by).map_err(CliError::invalid)?;
    let lines = usage::report(v, grouped, since)?;
    let head = by.to_ascii_uppercase();
    match output {
        UsageOutput::Json => {
            outln!(
                "{}",
                serde_json::to_string_pretty(&lines)
                    .map_err(|e| CliError::invalid(e.to_string()))?
            );
        }
        UsageOutput::Csv => {
            outln!(
                "{by},requests,input_tokens,output_tokens,dollars,vcpu_hours,gib_hours,cpu_seconds"
            );
            for l in &lines {
                outln!(
                    "{},{},{},{},{},{:.4},{:.4},{:.1}",
                    csv(&l.line.name),
                    l.line.requests,
                    l.line.input_tokens,
                    l.line.output_tokens,
                    l.dollars.map(|d| format!("{d:.4}")).unwrap_or_default(),
                    l.line.vcpu_hours,
                    l.line.gib_hours,
                    l.line.cpu_seconds
                );
            }
        }
        UsageOutput::Table => {
            if lines.is_empty() {
                eprintln!(
                    "No use recorded since {} ago (`serve` records LLM calls through its proxy and the running VMs' compute).",
                    humantime::format_duration(since)
                );
                return Ok(());
            }
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header([
                head.as_str(),
                "REQUESTS",
                "INPUT TOKENS",
                "OUTPUT TOKENS",
                "DOLLARS",
                "VCPU-HOURS",
                "GIB-HOURS",
                "CPU SECONDS",
            ]);
            for l in &lines {
                t.add_row(row(l));
            }
            outln!("{}", t.trim_fmt());
            let unpriced: std::collections::BTreeSet<&String> =
                lines.iter().flat_map(|l| &l.unpriced).collect();
            if !unpriced.is_empty() {
                eprintln!(
                    "note: no price for {}: counted at the dearest configured price, as a grant's dollarsPerMonth counts them; add them under proxy: prices: in config.yaml (dollars per million tokens)",
                    unpriced.into_iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    Ok(())
}

fn row(l: &UsageLine) -> [String; 8] {
    [
        boxery_api::name::shown(&l.line.name),
        l.line.requests.to_string(),
        l.line.input_tokens.to_string(),
        l.line.output_tokens.to_string(),
        l.dollars.map_or("-".into(), |d| format!("{d:.2}")),
        format!("{:.2}", l.line.vcpu_hours),
        format!("{:.2}", l.line.gib_hours),
        format!("{:.1}", l.line.cpu_seconds),
    ]
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}
