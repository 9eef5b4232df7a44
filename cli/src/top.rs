//! `boxery top`: what each running VM uses of the host now (`boxery_verbs::usage::top`),
//! once or every few seconds.

use std::time::Duration;

use boxery_verbs::Verbs;
use boxery_verbs::usage::{self, TopRow};

use crate::exit::{CliError, CliResult};
use crate::out::outln;

/// `boxery top`.
pub async fn top(v: &Verbs, watch: bool, json: bool) -> CliResult {
    loop {
        let rows = usage::top(v, Duration::from_secs(1)).await?;
        if json {
            outln!(
                "{}",
                serde_json::to_string(&rows).map_err(|e| CliError::invalid(e.to_string()))?
            );
        } else if rows.is_empty() {
            eprintln!("No VM is running.");
        } else {
            let mut t = comfy_table::Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header([
                "NAME",
                "CPU(cores)",
                "CPUS",
                "MEMORY(host)",
                "MEMORY(guest)",
                "NET IN/s",
                "NET OUT/s",
            ]);
            for r in &rows {
                t.add_row(row(r));
            }
            outln!("{}", t.trim_fmt());
        }
        if !watch {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        if !json {
            outln!("");
        }
    }
}

fn row(r: &TopRow) -> [String; 7] {
    let rate = |b: Option<f64>| b.map_or("-".into(), |b| bytes(b as u64));
    [
        boxery_api::name::shown(&r.vm),
        format!("{:.2}", r.cpu_cores),
        r.cpus.to_string(),
        bytes(r.rss_bytes),
        bytes(r.memory_bytes),
        rate(r.rx_per_second),
        rate(r.tx_per_second),
    ]
}

/// `1.5Gi`, `300Mi`, `12Ki`, `7`.
fn bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)];
    for (u, n) in UNITS {
        if b >= n {
            let v = b as f64 / n as f64;
            return if v >= 10.0 {
                format!("{v:.0}{u}")
            } else {
                format!("{v:.1}{u}")
            };
        }
    }
    b.to_string()
}
