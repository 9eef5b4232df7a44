//! What a Vm, a Lease or a Pool used (`status.usage`), and the budgets a Lease and a Pool set
//! on it (docs/pools.md, "Budgets"). Types and their checks only: the controllers fill the
//! usage from the usage ledger and enforce the budgets.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::meta::{Condition, ConditionStatus, Time};
use crate::validate::FieldError;

/// What an object used, from the usage ledger: compute while its VMs ran, LLM requests through
/// the credential proxy. Refreshed by its controller about once a minute (a budget's own
/// checks are more often).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Usage {
    /// Counted from this hour on (a Vm: the hour it was made; a Lease: its whole life; a Pool:
    /// the start of this UTC month, the period of its budget).
    pub since: Time,
    /// When this was read from the ledger.
    pub update_time: Time,
    /// vCPUs × hours the VMs ran.
    #[serde(default)]
    pub vcpu_hours: f64,
    /// GiB of memory × hours the VMs ran.
    #[serde(default)]
    pub gib_hours: f64,
    /// CPU seconds the VMs' hypervisors used.
    #[serde(default)]
    pub cpu_seconds: f64,
    /// LLM requests and tokens, per provider.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub llm: Vec<LlmUsage>,
}

impl Usage {
    /// Input and output tokens, all providers.
    pub fn tokens(&self) -> u64 {
        self.llm
            .iter()
            .map(|l| l.input_tokens + l.output_tokens)
            .sum()
    }

    /// Whether `other` says the same, but for when it was read (and rounding below what a
    /// person reads: a thousandth of a vCPU-hour, a tenth of a CPU second).
    pub fn same_as(&self, other: &Usage) -> bool {
        let near = |a: f64, b: f64, by: f64| (a - b).abs() < by;
        self.since == other.since
            && near(self.vcpu_hours, other.vcpu_hours, 0.001)
            && near(self.gib_hours, other.gib_hours, 0.001)
            && near(self.cpu_seconds, other.cpu_seconds, 0.1)
            && self.llm == other.llm
    }
}

/// The `BudgetExhausted=True` condition among `conds` (a Vm held for a budget, a Lease or a
/// Pool past one), if there is one.
pub fn exhausted(conds: &[Condition]) -> Option<&Condition> {
    conds.iter().find(|c| {
        c.type_ == crate::conditions::BUDGET_EXHAUSTED && c.status == ConditionStatus::True
    })
}

/// LLM use through one provider.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LlmUsage {
    /// The provider (`anthropic`, `openai`, …).
    pub provider: String,
    /// Requests.
    #[serde(default)]
    pub requests: u64,
    /// Input tokens (cache reads and writes included).
    #[serde(default)]
    pub input_tokens: u64,
    /// Output tokens.
    #[serde(default)]
    pub output_tokens: u64,
}

/// A lease's budget, over its whole life: past it, its VM is suspended (stopped where the
/// backend keeps no memory) until the budget is raised or the lease ends.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseBudget {
    /// vCPU-hours its VM may run (vCPUs × hours running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub vcpu_hours: Option<f64>,
    /// LLM input and output tokens its VM may use through the proxy, all grants together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens: Option<u64>,
}

/// A pool's budget per UTC month, over what all its leases use: past it, every leased member
/// is suspended (stopped where the backend keeps no memory) until the budget is raised or
/// the month ends.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolBudget {
    /// vCPU-hours its leased members may run this month.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub vcpu_hours_per_month: Option<f64>,
    /// LLM tokens its leases may use this month.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_month: Option<u64>,
}

/// A budget's one limit, as the controllers check it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    /// Its field's name (`vcpuHours`, `tokens`, `vcpuHoursPerMonth`, `tokensPerMonth`).
    pub field: &'static str,
    /// The limit.
    pub max: f64,
    /// What was used against it.
    pub used: f64,
}

impl Limit {
    /// The share used (1.0 and more: reached).
    pub fn share(&self) -> f64 {
        if self.max <= 0.0 {
            1.0
        } else {
            self.used / self.max
        }
    }

    /// The limit and its use, as people read them (`0.012 of 0.010 vCPU-hours`).
    pub fn shown(&self) -> String {
        if self.field.starts_with("tokens") {
            format!("{:.0} of {:.0} tokens", self.used, self.max)
        } else {
            format!("{:.3} of {:.3} vCPU-hours", self.used, self.max)
        }
    }
}

/// A budget's limits as (field, limit) pairs, tokens as numbers: the one list its checks,
/// its limits and its comparisons read. A field naming tokens is counted in tokens, any other
/// in vCPU-hours.
pub type Fields = [(&'static str, Option<f64>); 2];

/// Each limit of `fields` that is set, with what `u` used of it.
fn limits_of(fields: Fields, u: &Usage) -> Vec<Limit> {
    fields
        .into_iter()
        .filter_map(|(field, max)| {
            let used = if field.starts_with("tokens") {
                u.tokens() as f64
            } else {
                u.vcpu_hours
            };
            Some(Limit {
                field,
                max: max?,
                used,
            })
        })
        .collect()
}

/// How `new` lets more be used than `old` (a limit raised or removed), when it does; `None`
/// is no budget (no limit at all).
fn looser_of(new: Option<Fields>, old: Option<Fields>) -> Option<String> {
    let old = old?;
    let new = new.unwrap_or(old.map(|(f, _)| (f, None)));
    let how: Vec<String> = old
        .iter()
        .zip(new.iter())
        .filter_map(|((field, was), (_, now))| match (was, now) {
            (Some(was), None) => Some(format!("{field} {was} removed")),
            (Some(was), Some(now)) if now > was => Some(format!("{field} {was} → {now}")),
            _ => None,
        })
        .collect();
    (!how.is_empty()).then(|| how.join(", "))
}

/// A Lease's or a Pool's budget: its limits, checked, judged and compared the same way.
pub trait Budget: Sized {
    /// Its limits as (field, limit) pairs.
    fn fields(&self) -> Fields;

    /// Each limit set, with what `u` used of it (a pool's: this month's).
    fn limits(&self, u: &Usage) -> Vec<Limit> {
        limits_of(self.fields(), u)
    }

    /// Check what the schema cannot (finite hours), under `at`.
    fn check(&self, at: &str) -> Vec<FieldError> {
        check_of(self.fields(), at)
    }

    /// How `new` allows more than `old` (a limit raised or removed), when it does.
    fn looser(new: Option<&Self>, old: Option<&Self>) -> Option<String> {
        looser_of(new.map(Self::fields), old.map(Self::fields))
    }
}

/// Check what the schema cannot (finite hours), under `at`.
fn check_of(fields: Fields, at: &str) -> Vec<FieldError> {
    fields
        .into_iter()
        .filter(|(field, _)| !field.starts_with("tokens"))
        .filter_map(|(field, v)| match v {
            Some(h) if !h.is_finite() || !(0.0..=1e9).contains(&h) => Some(FieldError::new(
                format!("{at}.{field}"),
                format!("{h} is not a number of hours from 0 to 1e9"),
            )),
            _ => None,
        })
        .collect()
}

impl LeaseBudget {
    /// A lease's budget in force: each limit the tighter of the lease's own and its pool's
    /// `spec.lease.budget` (a holder can lower what the pool allows, never raise it).
    pub fn tighter(lease: Option<&LeaseBudget>, pool: Option<&LeaseBudget>) -> Option<LeaseBudget> {
        fn min<T: PartialOrd + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(if b < a { b } else { a }),
                (a, b) => a.or(b),
            }
        }
        let b = LeaseBudget {
            vcpu_hours: min(
                lease.and_then(|l| l.vcpu_hours),
                pool.and_then(|p| p.vcpu_hours),
            ),
            tokens: min(lease.and_then(|l| l.tokens), pool.and_then(|p| p.tokens)),
        };
        (b.vcpu_hours.is_some() || b.tokens.is_some()).then_some(b)
    }
}

impl Budget for LeaseBudget {
    fn fields(&self) -> Fields {
        [
            ("vcpuHours", self.vcpu_hours),
            ("tokens", self.tokens.map(|t| t as f64)),
        ]
    }
}

impl Budget for PoolBudget {
    fn fields(&self) -> Fields {
        [
            ("vcpuHoursPerMonth", self.vcpu_hours_per_month),
            ("tokensPerMonth", self.tokens_per_month.map(|t| t as f64)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_say_their_use_and_only_finite_hours_pass() {
        let u = Usage {
            vcpu_hours: 0.012,
            llm: vec![LlmUsage {
                provider: "anthropic".into(),
                requests: 2,
                input_tokens: 300,
                output_tokens: 50,
            }],
            ..Usage::default()
        };
        let b = LeaseBudget {
            vcpu_hours: Some(0.01),
            tokens: Some(1000),
        };
        let l = b.limits(&u);
        assert_eq!(l.len(), 2);
        assert!(l[0].share() >= 1.0);
        assert_eq!(l[0].shown(), "0.012 of 0.010 vCPU-hours");
        assert_eq!(l[1].shown(), "350 of 1000 tokens");
        assert!(l[1].share() < 0.8);
        assert!(b.check("spec.budget").is_empty());
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let b = LeaseBudget {
                vcpu_hours: Some(bad),
                tokens: None,
            };
            assert_eq!(b.check("spec.budget").len(), 1, "{bad}");
        }
        let p = PoolBudget {
            vcpu_hours_per_month: Some(f64::NAN),
            tokens_per_month: Some(5),
        };
        assert_eq!(
            p.check("spec.budget")[0].path,
            "spec.budget.vcpuHoursPerMonth"
        );
        assert_eq!(p.limits(&u)[1].field, "tokensPerMonth");
    }

    #[test]
    fn a_lease_lowers_its_pools_budget_and_cannot_raise_it() {
        let b = |v, t| LeaseBudget {
            vcpu_hours: v,
            tokens: t,
        };
        let pool = b(Some(1.0), Some(1000));
        assert_eq!(
            LeaseBudget::tighter(Some(&b(Some(5.0), Some(10))), Some(&pool)),
            Some(b(Some(1.0), Some(10)))
        );
        assert_eq!(
            LeaseBudget::tighter(Some(&b(None, None)), Some(&pool)),
            Some(pool.clone())
        );
        assert_eq!(
            LeaseBudget::tighter(Some(&b(Some(0.5), None)), None),
            Some(b(Some(0.5), None))
        );
        assert_eq!(LeaseBudget::tighter(None, None), None);
    }

    #[test]
    fn a_budget_raised_or_removed_is_looser_and_a_lower_one_is_not() {
        let b = |v, t| LeaseBudget {
            vcpu_hours: v,
            tokens: t,
        };
        let old = b(Some(1.0), Some(100));
        assert_eq!(
            LeaseBudget::looser(Some(&b(Some(0.5), Some(100))), Some(&old)),
            None
        );
        assert_eq!(
            LeaseBudget::looser(Some(&b(Some(2.0), None)), Some(&old)).as_deref(),
            Some("vcpuHours 1 → 2, tokens 100 removed")
        );
        assert_eq!(
            LeaseBudget::looser(None, Some(&old)).as_deref(),
            Some("vcpuHours 1 removed, tokens 100 removed")
        );
        assert_eq!(
            LeaseBudget::looser(Some(&old), None),
            None,
            "a first budget"
        );
        assert_eq!(LeaseBudget::looser(None, None), None);
        let p = |v| PoolBudget {
            vcpu_hours_per_month: v,
            tokens_per_month: None,
        };
        assert_eq!(
            PoolBudget::looser(Some(&p(Some(11.0))), Some(&p(Some(10.0)))).as_deref(),
            Some("vcpuHoursPerMonth 10 → 11")
        );
    }

    #[test]
    fn usage_differs_only_by_what_a_person_reads() {
        let a = Usage {
            vcpu_hours: 1.0,
            ..Usage::default()
        };
        let b = Usage {
            vcpu_hours: 1.0004,
            update_time: crate::meta::Time::from(std::time::SystemTime::now()),
            ..Usage::default()
        };
        assert!(a.same_as(&b));
        let c = Usage {
            vcpu_hours: 1.002,
            ..Usage::default()
        };
        assert!(!a.same_as(&c));
    }
}
