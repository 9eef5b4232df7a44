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
