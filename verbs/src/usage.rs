//! `boxery usage`: what VMs, leases, holders, pools and grants used, from this home's usage
//! ledger (`boxery_home::usage`), priced at the owner's `proxy: {prices: …}`.

use boxery_home::usage::{By, Ledger, hour_of, now};

use crate::{Result, VerbError, Verbs};

/// One line of the report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageLine {
    /// The group's use.
    #[serde(flatten)]
    pub line: boxery_home::usage::Line,
    /// Dollars at the configured prices; `None` when no model it used has a price.
    pub dollars: Option<f64>,
    /// Models it used that have no price.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unpriced: Vec<String>,
}

/// What `by` names, parsed: `vm`, `lease`, `holder`, `grant`, `pool`.
pub fn by(s: &str) -> std::result::Result<By, String> {
    Ok(match s {
        "vm" => By::Vm,
        "lease" => By::Lease,
        "holder" => By::Holder,
        "grant" => By::Grant,
        "pool" => By::Pool,
        _ => return Err(format!("`{s}` is not vm, lease, holder, grant or pool")),
    })
}

/// The use of the last `since` (from the start of the hour it began in), grouped `by`.
pub fn report(v: &Verbs, by: By, since: std::time::Duration) -> Result<Vec<UsageLine>> {
    let Some(ledger) = Ledger::open_existing(v.home()).map_err(VerbError::failed)? else {
        return Ok(Vec::new());
    };
    let prices = crate::env::read_config(v.home())?.proxy.prices;
    let from = hour_of(now() - since.as_secs().min(i64::MAX as u64 / 2) as i64);
    let lines = ledger.report(by, from).map_err(VerbError::failed)?;
    Ok(lines
        .into_iter()
        .map(|line| {
            let mut dollars = None;
            let mut unpriced = Vec::new();
            for (model, i, o) in &line.by_model {
                match prices.get(model) {
                    Some(p) => *dollars.get_or_insert(0.0) += p.of(*i, *o),
                    None if i + o > 0 => unpriced.push(if model.is_empty() {
                        "(no model named)".to_string()
                    } else {
                        model.clone()
                    }),
                    None => {}
                }
            }
            unpriced.sort();
            unpriced.dedup();
            UsageLine {
                line,
                dollars,
                unpriced,
            }
        })
        .collect())
}
