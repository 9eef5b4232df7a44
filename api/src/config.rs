//! Sections of the owner's `$BOXERY_HOME/config.yaml` that more than one crate reads. The
//! file itself is read by `boxery_verbs::env::read_config`; the credential proxy gets its
//! section from there.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `proxy:` in `config.yaml`: where the credential proxy sends each route, and its limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyConfig {
    /// LLM providers by name: base URLs (`anthropic: http://127.0.0.1:8080`). Overrides the
    /// defaults for `anthropic`, `openai`, `ollama`; any other name adds an OpenAI-compatible
    /// provider at `/llm/NAME`.
    #[serde(default)]
    pub upstreams: BTreeMap<String, String>,
    /// Where `/edge/HOST/…` goes for a host (`github.com: http://127.0.0.1:9000`): a self-hosted
    /// mirror or a test server. Default: `https://HOST`.
    #[serde(default)]
    pub hosts: BTreeMap<String, String>,
    /// Limits applied to every route (defaults in the proxy's docs).
    #[serde(default)]
    pub limits: ProxyLimits,
    /// The egress proxy (docs/egress.md).
    #[serde(default)]
    pub egress: EgressConfig,
    /// Dollars per million tokens by model, as the provider names it
    /// (`claude-sonnet-4-5: {input: 3, output: 15}`): what `boxery usage` shows in dollars
    /// and a grant's `dollarsPerMonth` counts.
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
}

/// A model's price, dollars per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Per million input tokens.
    pub input: f64,
    /// Per million output tokens.
    pub output: f64,
}

/// The price of `model` in `prices`: its own, else that of the configured name it is a dated
/// version of (`gpt-5` prices `gpt-5-2025-08-07`, `claude-sonnet-4-5` prices
/// `claude-sonnet-4-5-20250929`: providers answer with dated names), never that of a name it
/// merely starts with (`gpt-5` does not price `gpt-5-pro`).
pub fn price_for(prices: &BTreeMap<String, Price>, model: &str) -> Option<Price> {
    if let Some(p) = prices.get(model) {
        return Some(*p);
    }
    prices
        .iter()
        .filter(|(name, _)| {
            !name.is_empty()
                && model.strip_prefix(name.as_str()).is_some_and(|rest| {
                    rest.strip_prefix('-')
                        .is_some_and(|d| d.starts_with(|c: char| c.is_ascii_digit()))
                })
        })
        .max_by_key(|(name, _)| name.len())
        .map(|(_, p)| *p)
}

/// The dearest of `prices` (each side's highest): what a model with no price of its own costs
/// under a grant's `dollarsPerMonth`, so that an unpriced model cannot spend for nothing.
pub fn dearest(prices: &BTreeMap<String, Price>) -> Option<Price> {
    prices.values().copied().reduce(|a, b| Price {
        input: a.input.max(b.input),
        output: a.output.max(b.output),
    })
}

/// What a grant spent: the dollars of tokens by model (`(model, input, output)`) at `prices`
/// ([`price_for`]), a model with no price counted at the [`dearest`] (nothing when no price is
/// configured at all).
pub fn spent<'a>(
    prices: &BTreeMap<String, Price>,
    used: impl IntoIterator<Item = (&'a str, u64, u64)>,
) -> f64 {
    let fallback = dearest(prices);
    used.into_iter()
        .filter_map(|(m, i, o)| Some(price_for(prices, m).or(fallback)?.of(i, o)))
        .sum()
}

impl Price {
    /// The dollars of `input` and `output` tokens.
    pub fn of(self, input: u64, output: u64) -> f64 {
        (input as f64 * self.input + output as f64 * self.output) / 1e6
    }
}

/// `proxy: {egress: …}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EgressConfig {
    /// Names the egress proxy answers itself, before DNS (`mirror.internal.example:
    /// 203.0.113.10`), like `/etc/hosts` for guests' connections. Each address is still
    /// checked against the forbidden ranges.
    #[serde(default)]
    pub resolve: BTreeMap<String, std::net::IpAddr>,
    /// Connections (tunnels and requests) one VM may have open through the egress proxy at
    /// once (default 256).
    #[serde(default)]
    pub connections_per_vm: Option<usize>,
}

/// `proxy: {limits: …}`. Unset fields take the proxy's defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyLimits {
    /// The largest request body, in bytes.
    #[serde(default)]
    pub max_body_bytes: Option<u64>,
    /// The longest a request may take, response stream included, in seconds.
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    /// How many requests one VM may have in flight at once.
    #[serde(default)]
    pub concurrency_per_vm: Option<usize>,
}

#[cfg(test)]
mod price_tests {
    use super::*;

    #[test]
    fn dated_model_names_take_their_family_price_and_unpriced_ones_the_dearest() {
        let p: BTreeMap<String, Price> = [
            (
                "gpt-5".to_string(),
                Price {
                    input: 1.25,
                    output: 10.0,
                },
            ),
            (
                "gpt-5-mini".to_string(),
                Price {
                    input: 0.25,
                    output: 2.0,
                },
            ),
            (
                "claude-sonnet-4-5".to_string(),
                Price {
                    input: 3.0,
                    output: 15.0,
                },
            ),
        ]
        .into();
        assert_eq!(price_for(&p, "gpt-5-2025-08-07").unwrap().input, 1.25);
        assert_eq!(price_for(&p, "gpt-5-mini-2025-08-07").unwrap().input, 0.25);
        assert!(price_for(&p, "o3").is_none());
        assert!(
            price_for(&p, "gpt-5-pro").is_none(),
            "a variant is not a version"
        );
        assert_eq!(
            price_for(&p, "claude-sonnet-4-5-20250929").unwrap().output,
            15.0
        );
        // a million in and out of an unpriced model, at the dearest of each side
        assert_eq!(spent(&p, [("o3", 1_000_000, 1_000_000)]), 3.0 + 15.0);
        assert_eq!(spent(&BTreeMap::new(), [("o3", 1_000_000, 0)]), 0.0);
    }
}
