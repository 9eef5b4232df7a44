//! Warnings before a grant's limits are reached (docs/grants.md, "A grant's limits"): at each
//! reconcile of an `Applied` `llm` grant with limits (on a change, and at every resync), its
//! use this UTC day and month is read from the usage ledger; past 80 % of `tokensPerDay` or
//! `dollarsPerMonth` a Warning event says so (`LimitNear`), and at 100 % another says the proxy
//! now refuses its requests and when that ends (`LimitReached`). Each is said once per grant,
//! limit and period by this control plane (a restart may say it once more).

use boxery_api::Grant;
use boxery_api::grant::GrantLimits;
use boxery_home::usage::{HOUR, next_month, now, periods};

use crate::context::Ctx;

/// The share of a limit past which a warning is given.
pub const NEAR: f64 = 0.8;

/// Say what `g` has used of its limits, when it is near or at one.
pub(crate) async fn warn(ctx: &Ctx, g: &Grant) {
    let (Some(limits), Some(uid)) = (&g.spec.limits, g.metadata.uid.as_deref()) else {
        return;
    };
    let Some(ledger) = ctx.ledger() else { return };
    let (day, month) = periods(now());
    let uid = uid.to_string();
    let used = tokio::task::spawn_blocking(move || {
        Ok::<_, std::io::Error>((ledger.grant_use(&uid, day)?, ledger.grant_use(&uid, month)?))
    })
    .await;
    let Ok(Ok((today, this_month))) = used else {
        return;
    };
    let dollars = boxery_api::config::spent(
        &ctx.settings.prices,
        this_month
            .by_model
            .iter()
            .map(|(m, i, o)| (m.as_str(), *i, *o)),
    );
    for (limit, used, max, period, resets) in checks(limits, today.tokens(), dollars, day, month) {
        let name = g.metadata.name.as_str();
        let share = used / max;
        let (reason, level, message) = if share >= 1.0 {
            (
                "LimitReached",
                "reached",
                format!(
                    "grant {name} has used its {limit} limit ({}) {period}: the proxy refuses its requests with 429 until {resets}",
                    shown(limit, max)
                ),
            )
        } else if share >= NEAR {
            (
                "LimitNear",
                "near",
                format!(
                    "grant {name} has used over {:.0} % of its {limit} limit ({}) {period}; at the limit the proxy refuses its requests until {resets}",
                    NEAR * 100.0,
                    shown(limit, max)
                ),
            )
        } else {
            continue;
        };
        let key = format!(
            "limit:{}:{limit}:{period}:{level}",
            g.metadata.uid.as_deref().unwrap_or(name)
        );
        if ctx.first_report(&key) {
            ctx.recorder.warning(g, reason, &message).await;
        }
    }
}

/// A limit's value as the events say it.
fn shown(limit: &str, max: f64) -> String {
    if limit == "dollarsPerMonth" {
        format!("${max:.2}")
    } else {
        format!("{max:.0} tokens")
    }
}

/// Each limit with a period: its name, the use so far, the limit, the period's words and when
/// it ends.
fn checks(
    l: &GrantLimits,
    tokens_today: u64,
    dollars: f64,
    day: i64,
    month: i64,
) -> Vec<(&'static str, f64, f64, String, String)> {
    let at = |hour: i64| {
        chrono::DateTime::from_timestamp(hour * HOUR, 0)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    };
    let mut out = Vec::new();
    if let Some(max) = l.tokens_per_day {
        out.push((
            "tokensPerDay",
            tokens_today as f64,
            max as f64,
            format!("on {} (UTC)", &at(day)[..10]),
            at(day + 24),
        ));
    }
    if let Some(max) = l.dollars_per_month.filter(|m| *m > 0.0) {
        out.push((
            "dollarsPerMonth",
            dollars,
            max,
            format!("in {} (UTC)", &at(month)[..7]),
            next_month(month).to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_periods_are_named_and_end_when_they_reset() {
        let l = GrantLimits {
            tokens_per_day: Some(100),
            requests_per_minute: Some(5),
            dollars_per_month: Some(10.0),
        };
        // 2026-12-06T05:00Z's day and month
        let (day, month) = periods(1_796_533_200);
        let c = checks(&l, 85, 3.0, day, month);
        assert_eq!(c.len(), 2, "requestsPerMinute has no period to warn of");
        assert_eq!(c[0].3, "on 2026-12-06 (UTC)");
        assert_eq!(c[0].4, "2026-12-07T00:00:00Z");
        assert_eq!(c[1].3, "in 2026-12 (UTC)");
        assert_eq!(c[1].4, "2027-01-01T00:00:00Z");
    }
}
