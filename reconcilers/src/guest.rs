//! What a guest holds of the control plane, pushed over ssh into tmpfs (`/run/boxery`, see
//! [`boxery_hands::guest`]): the credential proxy's address as the guest reaches it
//! ([`Backend::guest_proxy`](boxery_backends::Backend::guest_proxy)), the VM's current token,
//! the provider variables of its `llm` grants (`ANTHROPIC_BASE_URL`/`ANTHROPIC_API_KEY`, …:
//! the key variables hold the token, never a key), git settings for its `github` grants, npm's
//! for an `http` grant on the npm registry, the values of its `env` grants and the files of its
//! `file` grants, and the coding agents' settings for the `llm` grants ([`agents`]); and, once,
//! `/etc/profile.d/boxery-env.sh` so login shells read it (beside the image's own `boxery.sh`,
//! which it leaves alone).
//!
//! # Guarantees
//! - Pushed on every change of what the guest should hold: the token (a VM made, a lease
//!   bound), the grants in force for the token's owner (approved, revoked, spec changed), and
//!   each new boot (the `Ready` condition turning true: start, revert, reset, reboot). Checked
//!   every [`EVERY`]; the lease reconciler also pushes before a lease is `Bound`, and the
//!   grant reconciler before a grant is `Applied`.
//! - Pushes to one VM are serialised in this process, each planned after the previous one
//!   ended, so a push never lands after one planned later than it.
//! - A push replaces the whole set: an `env`/`file` grant revoked is gone from the guest at
//!   the next push, and every boot starts empty (tmpfs). Nothing is written to the guest's
//!   disk but files that hold no value (the profile hook, the system proxy settings, codex's
//!   provider at the proxy), so no value is ever in an image.
//! - Values travel on ssh's stdin (base64 in a here-document), never on a command line, and
//!   are never logged or kept on the host; the guest files are 0400 in a 0700 directory of
//!   the login user.
//! - Only the grants of the token's owner are pushed: a lease's grants while it holds the VM,
//!   the VM's own grants otherwise.
//!
//! # Caveats
//! - A value is read when it is pushed. A value that changes on the host later reaches a
//!   running guest at its next boot or when the grant's spec changes.
//! - A value that cannot be read is left out (the grant reconciler reports it as
//!   `ValueUnavailable`) and the push is tried again after [`RETRY`].
//! - A reboot from inside the guest that boxery does not see (no `Ready` change) leaves
//!   `/run/boxery` empty until the next change or boot boxery sees.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use boxery_api::conditions::READY;
use boxery_api::grant::GrantType;
use boxery_api::vm::Display;
use boxery_api::{ConditionStatus, Conditions, Vm};
use boxery_controller::{Cache, CancellationToken};
use boxery_hands::shell_quote;
use futures::StreamExt;

use crate::context::Ctx;
use boxery_home::grants::Entry;

/// How often every VM's guest state is compared with what it should hold.
pub const EVERY: Duration = Duration::from_secs(2);
/// How long a failed push waits before it is tried again.
pub const RETRY: Duration = Duration::from_secs(20);
/// The longest one push may take.
pub const PUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// Pushes at once.
const CONCURRENCY: usize = 8;
/// The npm registry: an `http` grant on it makes npm use the proxy.
const NPM_REGISTRY: &str = "registry.npmjs.org";

/// What the guest of one VM should hold, as references (no value): its revision names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The proxy's base URL as the guest reaches it.
    pub url: String,
    /// Whether the guest's channel names the VM (qemu's per-VM socket): its egress proxy
    /// URL then carries no token. On a shared listener (libvirt's bridge) the token is the
    /// proxy password.
    pub channel: bool,
    /// The VM's token.
    pub token: String,
    /// The grants in force for the token's owner, by name.
    pub grants: Vec<Entry>,
    /// The VM.
    pub vm: String,
    /// Its egress policy, for the agents' context file.
    pub egress: boxery_api::network::Egress,
    /// For a VM with a desktop: the screen size its spec sets (`spec.display`), `None` when
    /// it sets none (then a size boxery wrote before is taken back, one set by hand is kept).
    pub display: Option<Option<Display>>,
    /// Where the guest's resolver should send name lookups, when the control plane answers
    /// them ([`dns_script`]).
    pub dns: Option<std::net::Ipv4Addr>,
}

impl Plan {
    /// What `vm`'s guest should hold now: `None` when it has no token (a free pool member, a
    /// VM being removed) or no way to the proxy.
    pub fn of(ctx: &Ctx, v: &Vm) -> Option<Plan> {
        let vm = v.metadata.name.as_str();
        let g = ctx.backend.guest_proxy(vm)?;
        let (url, channel, dns) = (
            g.url,
            matches!(g.listen, boxery_backends::ProxyListen::Unix(_)),
            g.dns.map(|d| d.addr),
        );
        let (owner, token) = boxery_home::tokens::read(&ctx.home, vm)?;
        let grants = boxery_home::grants::read_state(&ctx.home, vm)
            .into_iter()
            .filter(|e| e.owner() == owner)
            .collect();
        Some(Plan {
            url,
            channel,
            token,
            grants,
            vm: vm.to_string(),
            egress: boxery_home::egress::read(&ctx.home, vm),
            display: (!v.spec.headless).then_some(v.spec.display),
            dns,
        })
    }

    /// The revision of this plan on the boot `boot` (a hash; the same in every build).
    pub fn rev(&self, boot: &str) -> String {
        let mut h = boxery_api::fnv::Fnv::default();
        h.part(boot.as_bytes())
            .part(self.url.as_bytes())
            .part(if self.channel { b"c" } else { b"s" })
            .part(self.token.as_bytes())
            .part(self.vm.as_bytes())
            .part(self.egress.policy.as_str().as_bytes());
        for a in &self.egress.allow {
            h.part(a.as_bytes());
        }
        match self.display {
            Some(Some(d)) => h.part(d.to_string().as_bytes()),
            Some(None) => h.part(b"display unset"),
            None => &mut h,
        };
        if let Some(dns) = self.dns {
            h.part(dns.to_string().as_bytes());
        }
        for e in &self.grants {
            h.part(e.name.as_bytes())
                .part(e.uid.as_bytes())
                .part(e.generation.to_string().as_bytes());
        }
        format!("{:016x}", h.finish())
    }
}

/// The guest files of a plan, values read.
#[derive(Debug, Default)]
pub struct Files {
    /// `/run/boxery/env`.
    pub env: String,
    /// `/run/boxery/npmrc`, when npm goes through the proxy.
    pub npmrc: Option<String>,
    /// `/run/boxery/AGENTS.md`: what a coding agent in the guest is told of where it is
    /// ([`context`]).
    pub context: String,
    /// `/run/boxery/ssh_config`: ssh to other hosts through the egress proxy ([`ssh_config`]).
    pub ssh_config: String,
    /// `file` grants: (target, bytes).
    pub files: Vec<(String, Vec<u8>)>,
    /// Grants left out: (grant, why).
    pub unavailable: Vec<(String, String)>,
    /// The egress proxy URL for system tools (apt, sudo), when it holds no token and may be
    /// written to the guest's disk (a per-VM channel).
    pub system_proxy: Option<String>,
    /// codex's system-wide settings ([`CODEX_CONFIG`]), with an `llm:openai` grant
    /// ([`agents`]).
    pub codex: Option<String>,
    /// The Docker daemon's proxy settings, a systemd drop-in ([`docker_dropin`]): written
    /// where the guest runs Docker.
    pub docker: String,
    /// The proxies Docker's client gives containers and builds ([`docker_client_proxies`],
    /// JSON): put in the login user's `~/.docker/config.json` where the guest has Docker.
    pub docker_client: String,
    /// For a VM with a desktop, the screen size its spec sets (`WIDTHxHEIGHT`), if any
    /// ([`display_script`]).
    pub display: Option<Option<Display>>,
    /// The guest's DNS server, when the control plane answers its lookups ([`dns_script`]).
    pub dns: Option<std::net::Ipv4Addr>,
}

/// Where the Docker daemon's proxy drop-in goes: on the disk when its proxy URL holds no token
/// (a per-VM channel), else on tmpfs (`/run`, gone at reboot and written again at boot).
const DOCKER_DROPIN: &str = "docker.service.d/90-boxery-proxy.conf";

/// The Docker daemon's proxy settings (docs/egress.md, "Developer traffic"): `dockerd` pulls
/// images itself and reads only its own environment, not a login shell's.
fn docker_dropin(egress: &str, no_proxy: &str) -> String {
    format!(
        "# boxery (docs/egress.md): the Docker daemon's way out is the control plane's egress proxy\n\
         [Service]\n\
         Environment=\"HTTP_PROXY={egress}\" \"HTTPS_PROXY={egress}\" \"NO_PROXY={no_proxy}\"\n"
    )
}

/// The proxies Docker's client gives the containers it makes and the builds it runs
/// (`~/.docker/config.json`'s `proxies.default`, docs/egress.md, "Developer traffic"): the
/// daemon's drop-in covers its own pulls, not what runs inside a container.
fn docker_client_proxies(egress: &str, no_proxy: &str) -> String {
    serde_json::json!({"httpProxy": egress, "httpsProxy": egress, "noProxy": no_proxy}).to_string()
}

/// The part of [`script`] that puts `proxies` ([`docker_client_proxies`], JSON) in the login
/// user's `~/.docker/config.json` where the guest has Docker's client: merged into what the
/// file holds (a `docker login`'s credentials stay), written 0600 through a temporary file,
/// and not written again when it holds them already. A file that is not a JSON object is
/// left alone, and that is said. The proxies (on libvirt, the URL holds the VM's token) go on
/// python's stdin, never its command line, which every guest user can read.
fn docker_client_script(proxies: &str) -> String {
    const MERGE: &str = "import json, os, sys
p, want = sys.argv[1], json.load(sys.stdin)
try:
    c = json.load(open(p))
except FileNotFoundError:
    c = {}
except ValueError:
    c = None
if not isinstance(c, dict) or not isinstance(c.get(\"proxies\", {}), dict):
    sys.exit(\"boxery: \" + p + \" is not what Docker writes: its proxies are left as they are\")
if c.get(\"proxies\", {}).get(\"default\") == want:
    sys.exit(0)
c.setdefault(\"proxies\", {})[\"default\"] = want
os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
t = p + \".new\"
with os.fdopen(os.open(t, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), \"w\") as f:
    json.dump(c, f, indent=1)
os.replace(t, p)
";
    format!(
        "if command -v docker >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then \
         printf '%s' {} | base64 -d | python3 -c {} \"$HOME/.docker/config.json\" || true; fi\n",
        shell_quote(&base64::engine::general_purpose::STANDARD.encode(proxies)),
        shell_quote(MERGE)
    )
}

/// The guest's egress proxy URL for `plan` (docs/egress.md): the credential proxy's address,
/// with the VM's token as the proxy password on a shared listener.
pub fn egress_url(plan: &Plan) -> String {
    let (host, port) = proxy_host_port(plan);
    if plan.channel {
        // Port 80 spelled out: some clients want one in a proxy URL.
        format!("http://{host}:{port}")
    } else {
        format!("http://boxery:{}@{}", plan.token, proxy_hostport(plan))
    }
}

/// `plan.url` without its scheme and trailing slash: `HOST[:PORT]`.
fn proxy_hostport(plan: &Plan) -> &str {
    plan.url.trim_start_matches("http://").trim_end_matches('/')
}

/// The credential proxy's host and port in `plan.url` (port 80 when it names none).
fn proxy_host_port(plan: &Plan) -> (&str, &str) {
    let hostport = proxy_hostport(plan);
    hostport.rsplit_once(':').unwrap_or((hostport, "80"))
}

/// The base URL of provider `p`'s API through the credential proxy at `url`, with the `/v1`
/// OpenAI's clients and opencode's Anthropic client want (Claude Code's has none).
fn provider_v1(url: &str, p: &str) -> String {
    format!("{url}/llm/{p}/v1")
}

/// The guest files for `plan`, reading the values of its `env` and `file` grants.
pub async fn files(plan: &Plan, home: &Path) -> Files {
    let (url, token) = (&plan.url, &plan.token);
    let mut out = Files {
        display: plan.display,
        dns: plan.dns,
        ..Files::default()
    };
    let mut env = format!(
        "# Written by boxery's control plane (docs/grants.md): the credential proxy, this VM's\n\
         # token, and what its grants give. Replaced at every change; gone at reboot.\n\
         export BOXERY_PROXY={} BOXERY_TOKEN={}\n",
        shell_quote(url),
        shell_quote(token)
    );
    // The egress proxy: the guest's only way out on qemu, the policy's way on libvirt.
    let egress = egress_url(plan);
    let host = proxy_host_port(plan).0;
    let no_proxy = format!("{host},localhost,127.0.0.1,::1");
    out.docker = docker_dropin(&egress, &no_proxy);
    out.docker_client = docker_client_proxies(&egress, &no_proxy);
    env.push_str(&format!(
        "# egress (docs/egress.md): everything goes through the control plane's egress proxy
         export http_proxy={e} https_proxy={e} HTTP_PROXY={e} HTTPS_PROXY={e} \
           no_proxy={n} NO_PROXY={n}
",
        e = shell_quote(&egress),
        n = shell_quote(&no_proxy),
    ));
    if plan.channel {
        out.system_proxy = Some(egress);
    }
    let mut git: Vec<(String, String)> = Vec::new();
    let mut agent_sock = false;
    for e in &plan.grants {
        let comment = format!("# {}:{} (grant {})\n", e.spec.type_, e.spec.target, e.name);
        match e.spec.type_ {
            GrantType::Llm => {
                let (base, key) = match e.spec.target.as_str() {
                    "anthropic" => (format!("{url}/llm/anthropic"), "ANTHROPIC"),
                    "openai" => (provider_v1(url, "openai"), "OPENAI"),
                    // Ollama's and other providers' clients take a base URL argument:
                    // $BOXERY_PROXY/llm/NAME (docs/grants.md).
                    _ => continue,
                };
                env.push_str(&comment);
                env.push_str(&format!(
                    "export {key}_BASE_URL={} {key}_API_KEY={}\n",
                    shell_quote(&base),
                    shell_quote(token)
                ));
            }
            GrantType::Github => {
                if git.is_empty() {
                    git.push((
                        format!("url.{url}/edge/github.com/.insteadOf"),
                        "https://github.com/".into(),
                    ));
                    git.push((
                        format!("http.{url}/edge/.extraHeader"),
                        format!("x-boxery-token: {token}"),
                    ));
                }
            }
            GrantType::Http if e.spec.target == NPM_REGISTRY => {
                let host = url
                    .trim_start_matches("http://")
                    .trim_start_matches("https://");
                out.npmrc = Some(format!(
                    "registry={url}/edge/{NPM_REGISTRY}/\n//{host}/edge/{NPM_REGISTRY}/:_authToken=${{BOXERY_TOKEN}}\n"
                ));
                env.push_str(&comment);
                env.push_str("export NPM_CONFIG_USERCONFIG=/run/boxery/npmrc\n");
            }
            GrantType::Http => {}
            GrantType::Env => {
                match boxery_home::values::read_text(&e.spec.value_from, home).await {
                    Ok(v) => {
                        env.push_str(&comment);
                        env.push_str(&format!("export {}={}\n", e.spec.target, shell_quote(&v)));
                    }
                    Err(why) => out.unavailable.push((e.name.clone(), why)),
                }
            }
            GrantType::File => match boxery_home::values::read(&e.spec.value_from, home).await {
                Ok(v) => out.files.push((e.spec.target.clone(), v)),
                Err(why) => out.unavailable.push((e.name.clone(), why)),
            },
            // the socket the control plane forwards (crate::agent_forward); one for all
            GrantType::SshAgent if !agent_sock => {
                agent_sock = true;
                env.push_str(&format!(
                    "{comment}export SSH_AUTH_SOCK={}\n",
                    crate::agent_forward::GUEST_SOCK
                ));
            }
            GrantType::SshAgent => {}
        }
    }
    if !git.is_empty() {
        env.push_str(
            "# github grants: git clone https://github.com/OWNER/REPO goes through the proxy\n",
        );
        env.push_str(&format!("export GIT_CONFIG_COUNT={}", git.len()));
        for (i, (k, v)) in git.iter().enumerate() {
            env.push_str(&format!(
                " GIT_CONFIG_KEY_{i}={} GIT_CONFIG_VALUE_{i}={}",
                shell_quote(k),
                shell_quote(v)
            ));
        }
        env.push('\n');
    }
    let agents = agents(plan);
    env.push_str(&agents.env);
    out.codex = agents.codex;
    out.env = env;
    out.context = context(plan);
    out.ssh_config = ssh_config(plan);
    out
}

/// The guest's ssh client settings (`/run/boxery/ssh_config`, included from
/// `/etc/ssh/ssh_config.d/90-boxery.conf` where the guest has OpenSSH's client and socat):
/// `ssh git@github.com` and `git clone git@github.com:…` go through the egress proxy's
/// `CONNECT`, so the VM's policy decides them like any other connection. On a shared listener
/// the proxy password is the VM's token (hence tmpfs, like `env`). A host seen for the first
/// time is accepted and recorded in `~/.ssh/known_hosts` (`StrictHostKeyChecking accept-new`:
/// an agent has no one to answer ssh's question, so it would otherwise fail with "Host key
/// verification failed"); a host whose key changed is still refused. A user's own
/// `~/.ssh/config` is read first and wins.
pub fn ssh_config(plan: &Plan) -> String {
    let (host, port) = proxy_host_port(plan);
    let auth = if plan.channel {
        String::new()
    } else {
        format!(",proxyauth=boxery:{}", plan.token)
    };
    format!(
        "# Written by boxery's control plane (docs/egress.md): ssh to other hosts goes through the\n\
         # egress proxy, so this VM's egress policy decides it. Replaced at every change.\n\
         Host * !localhost !127.0.0.1 !::1\n  \
         ProxyCommand socat - PROXY:{host}:%h:%p,proxyport={port}{auth}\n  \
         StrictHostKeyChecking accept-new\n"
    )
}

/// What the coding agents of the `agents` layer need, beyond `ANTHROPIC_*` and `OPENAI_*`, to
/// reach their providers through the credential proxy with the VM's token (docs/agents.md).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Agents {
    /// Lines for `/run/boxery/env`: opencode's providers (`OPENCODE_CONFIG_CONTENT`).
    pub env: String,
    /// codex's settings ([`CODEX_CONFIG`]), with an `llm:openai` grant.
    pub codex: Option<String>,
}

/// Where codex reads system-wide settings: the user's `~/.codex/config.toml` overrides them.
pub const CODEX_CONFIG: &str = "/etc/codex/config.toml";
/// How the files boxery writes outside tmpfs begin: one that does not is the user's.
const WRITTEN: &str = "# Written by boxery's control plane";

/// The agents' settings for `plan`'s `llm` grants (no value: the keys stay in the
/// `*_API_KEY` variables, which hold the VM's token).
/// - Claude Code reads `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` as they are.
/// - codex 0.171 ignores `OPENAI_BASE_URL` and wants a login for its built-in `openai`
///   provider: [`CODEX_CONFIG`] names a provider at the proxy, keyed by `$OPENAI_API_KEY`,
///   over plain HTTP (the proxy refuses WebSocket upgrades, which codex tries first).
/// - opencode's Anthropic client wants the base URL with `/v1` (claude's has none): its
///   providers are given in `OPENCODE_CONFIG_CONTENT`, only the granted ones enabled, and its
///   model catalog is the one it ships with (the catalog's host is not a provider).
pub fn agents(plan: &Plan) -> Agents {
    let url = &plan.url;
    let granted = |p: &str| {
        plan.grants
            .iter()
            .any(|e| e.spec.type_ == GrantType::Llm && e.spec.target == p)
    };
    let mut providers = serde_json::Map::new();
    for p in ["anthropic", "openai"].into_iter().filter(|p| granted(p)) {
        providers.insert(
            p.to_string(),
            serde_json::json!({"options": {"baseURL": provider_v1(url, p)}}),
        );
    }
    let mut out = Agents::default();
    if providers.is_empty() {
        return out;
    }
    let opencode = serde_json::json!({
        "$schema": "https://opencode.ai/config.json",
        "enabled_providers": providers.keys().collect::<Vec<_>>(),
        "provider": providers,
        "autoupdate": false,
        "share": "disabled",
    });
    out.env = format!(
        "# opencode: the granted providers through the proxy (docs/agents.md)\n\
         export OPENCODE_CONFIG_CONTENT={} OPENCODE_DISABLE_MODELS_FETCH=1\n",
        shell_quote(&opencode.to_string())
    );
    if granted("openai") {
        // A JSON string is a TOML basic string.
        let base = serde_json::Value::from(provider_v1(url, "openai"));
        out.codex = Some(format!(
            "{WRITTEN} (docs/agents.md): codex reaches OpenAI\n\
             # through the credential proxy with this VM's token ($OPENAI_API_KEY). Your own\n\
             # ~/.codex/config.toml overrides it. Removed when the VM's llm:openai grant goes.\n\
             model_provider = \"boxery\"\n\
             check_for_update_on_startup = false\n\n\
             [model_providers.boxery]\n\
             name = \"OpenAI through boxery's credential proxy\"\n\
             base_url = {base}\n\
             env_key = \"OPENAI_API_KEY\"\n\
             wire_api = \"responses\"\n\
             # the proxy refuses WebSocket upgrades: HTTP with server-sent events\n\
             supports_websockets = false\n\n\
             [analytics]\n\
             enabled = false\n"
        ));
    }
    out
}

/// The part of [`script`] that keeps `path` (codex's settings) in step: `codex` written when it
/// differs, and removed when there is none; a file there that boxery did not write is left
/// alone. World-readable (it holds no value) in a world-readable directory, whatever the
/// push's umask.
fn codex_script(codex: Option<&str>, path: &str) -> String {
    let c = shell_quote(path);
    // boxery's file is the one whose first line says so (docs/agents.md)
    let ours = format!(
        "head -n 1 \"$c\" 2>/dev/null | grep -qs {}",
        shell_quote(&format!("^{WRITTEN}"))
    );
    match codex {
        Some(text) => format!(
            "c={c}\n\
             if {{ [ ! -e \"$c\" ] || {ours}; }} && [ \"$(cat \"$c\" 2>/dev/null)\" != \"$(printf '%s' {t})\" ]; then \
             sudo -n install -d -m 0755 \"$(dirname \"$c\")\" && printf '%s' {t} | sudo -n tee \"$c\" >/dev/null && sudo -n chmod 0644 \"$c\"; fi\n",
            t = shell_quote(text)
        ),
        None => format!("c={c}\nif {ours}; then sudo -n rm -f \"$c\"; fi\n"),
    }
}

/// Where an agent in the guest finds [`context`]: links to `/run/boxery/AGENTS.md` in the
/// login user's home, made once where no file of that name is (a file the user wrote is left
/// alone). Claude Code reads `CLAUDE.md` up from its directory, Codex `~/.codex/AGENTS.md`,
/// opencode `~/.config/opencode/AGENTS.md`, and others `AGENTS.md`.
pub const CONTEXT_LINKS: &[&str] = &[
    "AGENTS.md",
    "CLAUDE.md",
    ".codex/AGENTS.md",
    ".config/opencode/AGENTS.md",
];

/// What a coding agent in the VM is told of where it is (`/run/boxery/AGENTS.md`): the VM, what
/// its egress policy lets it reach, the grants it holds (never a value), and how to ask for
/// more. Rewritten with every push, so it follows the policy and the grants.
pub fn context(plan: &Plan) -> String {
    use boxery_api::network::EgressPolicy;
    let vm = &plan.vm;
    let network = match plan.egress.policy {
        EgressPolicy::Public => {
            "Outbound connections go through boxery's egress proxy (already set: \
             `http_proxy`, `https_proxy`, apt, git, pip and npm use it). Public internet hosts are \
             reachable; private networks, this VM's host and cloud metadata services are not."
                .to_string()
        }
        EgressPolicy::Allowlist => format!(
            "Outbound connections go through boxery's egress proxy (already set: `http_proxy`, \
             `https_proxy`), and only to these hosts: {}. Anything else is refused with a 403 \
             that says so.",
            if plan.egress.allow.is_empty() {
                "none".to_string()
            } else {
                plan.egress
                    .allow
                    .iter()
                    .map(|a| format!("`{}`", boxery_api::name::shown(a)))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ),
        EgressPolicy::Deny => "There is no outbound network: only boxery's credential proxy \
             (`$BOXERY_PROXY`) for the grants below."
            .to_string(),
    };
    let mut grants = String::new();
    for e in &plan.grants {
        let what = match e.spec.type_ {
            GrantType::Llm => match e.spec.target.as_str() {
                "anthropic" => "Claude models: `$ANTHROPIC_BASE_URL`, with `$ANTHROPIC_API_KEY` (claude and opencode use them)".to_string(),
                "openai" => "OpenAI models: `$OPENAI_BASE_URL`, with `$OPENAI_API_KEY` (codex and opencode use them)".to_string(),
                other => format!("the `{}` provider at `$BOXERY_PROXY/llm/{}`", boxery_api::name::shown(other), boxery_api::name::shown(other)),
            },
            GrantType::Github => format!("GitHub `{}`: `git clone https://github.com/…` goes through the proxy", boxery_api::name::shown(&e.spec.target)),
            GrantType::Http => format!("HTTP to `{}` through `$BOXERY_PROXY/edge/…`", boxery_api::name::shown(&e.spec.target)),
            GrantType::Env => format!("the variable `${}`", boxery_api::name::shown(&e.spec.target)),
            GrantType::File => format!("the file `/run/boxery/files/{}`", boxery_api::name::shown(&e.spec.target)),
            GrantType::SshAgent => "your person's ssh-agent at `$SSH_AUTH_SOCK` (ssh and git over ssh use it): you can sign with its keys, not read them".to_string(),
        };
        grants.push_str(&format!(
            "- `{}:{}`: {what}\n",
            e.spec.type_,
            boxery_api::name::shown(&e.spec.target)
        ));
    }
    if grants.is_empty() {
        grants.push_str("- none\n");
    }
    let lookups = match (plan.dns, plan.egress.policy) {
        (Some(_), _) => "name lookups answer for the hosts the policy allows and nothing else; ",
        (None, EgressPolicy::Public) => "",
        (None, _) => "name lookups (DNS) get no answer; ",
    };
    format!(
        "# Where you are\n\n\
         You are working in `{vm}`, a virtual machine that boxery gives coding agents as their hands. \
         It is yours: install what you need (`sudo` needs no password), run servers, experiment. \
         Nothing you do here reaches the machine of the person you work for, except through boxery.\n\n\
         ## Network\n\n{network} Anything that does not go through the proxy fails: HTTP(S) clients use it by \
         themselves (`http_proxy`, `https_proxy`), and so do `ssh` and git over ssh (`git@host:…`) to \
         hosts the policy allows (the guest's ssh config), and Docker's daemon (`docker pull`) where the guest has Docker; {lookups}other raw TCP or UDP does not work.\n\n\
         ## Credentials\n\n\
         This VM holds no real keys. Its grants, used through boxery's credential proxy, which adds \
         the real credential on the way out (the `*_API_KEY` variables hold this VM's boxery token):\n\n{grants}\n\
         ## Asking for more\n\n\
         Ask the person you work for. They give this VM a credential with `boxery grant {vm} TYPE:TARGET \
         --from-env NAME` (a person approves it), and widen its network in the VM's \
         `spec.network.egress`. Do not look for keys elsewhere: there are none in this VM.\n\n\
         (Written by boxery's control plane; it changes with this VM's grants and egress policy.)\n"
    )
}

/// The hook login shells run (static: no value).
const PROFILE_HOOK: &str = "# boxery: the credential proxy's address, this VM's token and its grants, pushed by the\n\
# control plane to tmpfs (docs/grants.md).\n\
if [ -r /run/boxery/env ]; then . /run/boxery/env; fi\n";

/// The remote script (for `sh -s`, on stdin) that installs `f` as revision `rev`.
pub fn script(f: &Files, rev: &str) -> String {
    let mut s = String::from(
        "set -eu\numask 077\nd=/run/boxery\n\
         if [ ! -d \"$d\" ] || [ ! -w \"$d\" ] || [ ! -O \"$d\" ]; then sudo -n install -d -m 0700 -o \"$(id -u)\" -g \"$(id -g)\" \"$d\"; fi\n\
         chmod 0700 \"$d\"\n",
    );
    s.push_str(&tree(f, rev));
    s.push_str(&format!(
        "if ! grep -qs 'boxery/env' /etc/profile.d/boxery-env.sh; then sudo -n mkdir -p /etc/profile.d; printf '%s' {} | sudo -n tee /etc/profile.d/boxery-env.sh >/dev/null; sudo -n chmod 0644 /etc/profile.d/boxery-env.sh; fi\n\
         if ! grep -qs 'profile\\.d' /etc/profile; then printf '%s\\n' 'for f in /etc/profile.d/*.sh; do [ -r \"$f\" ] && . \"$f\"; done' | sudo -n tee -a /etc/profile >/dev/null; fi\n",
        shell_quote(PROFILE_HOOK)
    ));
    // ssh through the egress proxy: a static line including the tmpfs file (no token on disk)
    s.push_str(
        "c=/etc/ssh/ssh_config.d/90-boxery.conf\n\
         if [ -d /etc/ssh/ssh_config.d ] && command -v socat >/dev/null && ! grep -qs 'boxery/ssh_config' \"$c\"; then printf '%s\\n' '# boxery (docs/egress.md): ssh to other hosts goes through the egress proxy' 'Include /run/boxery/ssh_config' | sudo -n tee \"$c\" >/dev/null; sudo -n chmod 0644 \"$c\"; fi\n",
    );
    for link in CONTEXT_LINKS {
        s.push_str(&format!(
            "l=\"$HOME\"/{l}; if [ ! -e \"$l\" ] && [ ! -L \"$l\" ]; then mkdir -p \"$(dirname \"$l\")\" && ln -s \"$d/AGENTS.md\" \"$l\"; fi\n",
            l = shell_quote(link)
        ));
    }
    s.push_str(&codex_script(f.codex.as_deref(), CODEX_CONFIG));
    // Docker's daemon, where the guest has one: its drop-in, and a restart when it changed (at
    // a VM's first boot; on tmpfs, at every boot), so that the VM is ready with it in force. A
    // daemon that fails to restart is the guest's own trouble: said, and the rest goes on.
    let units = if f.system_proxy.is_some() {
        "/etc/systemd/system"
    } else {
        "/run/systemd/system"
    };
    // (in base64: on a shared listener it holds the VM's token)
    s.push_str(&format!(
        "k={units}/{DOCKER_DROPIN}\n\
         if [ -d /run/systemd/system ] && {{ [ -e /lib/systemd/system/docker.service ] || [ -e /usr/lib/systemd/system/docker.service ] || [ -e /etc/systemd/system/docker.service ]; }}; then \
         c=$(printf '%s' {c} | base64 -d); \
         if [ \"$(sudo -n cat \"$k\" 2>/dev/null)\" != \"$c\" ]; then \
         sudo -n install -d -m 0755 \"$(dirname \"$k\")\" && printf '%s\\n' \"$c\" | sudo -n tee \"$k.new\" >/dev/null && sudo -n chmod 0600 \"$k.new\" && sudo -n mv \"$k.new\" \"$k\" && sudo -n systemctl daemon-reload && {{ sudo -n systemctl try-restart docker.service || echo 'boxery: dockerd did not restart with the proxy settings (journalctl -u docker)' >&2; }}; fi; fi\n",
        c = base64::engine::general_purpose::STANDARD.encode(&f.docker)
    ));
    s.push_str(&docker_client_script(&f.docker_client));
    if let Some(size) = &f.display {
        s.push_str(&display_script(size.as_ref()));
    }
    if let Some(dns) = f.dns {
        s.push_str(&dns_script(dns));
    }
    if let Some(proxy) = &f.system_proxy {
        // apt and sudo do not read the login shell's variables: static files (no token).
        let apt = format!(
            "// boxery (docs/egress.md): the guest's way out is the control plane's egress proxy\n\
             Acquire::http::Proxy \"{proxy}\";\nAcquire::https::Proxy \"{proxy}\";\n"
        );
        let sudoers = "# boxery (docs/egress.md): sudo keeps the egress proxy variables\n\
             Defaults env_keep += \"http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY\"\n";
        s.push_str(&format!(
            "a=/etc/apt/apt.conf.d/90boxery-proxy\n\
             if [ -d /etc/apt/apt.conf.d ] && [ \"$(cat \"$a\" 2>/dev/null)\" != \"$(printf '%s' {apt})\" ]; then printf '%s' {apt} | sudo -n tee \"$a\" >/dev/null; fi\n\
             u=/etc/sudoers.d/boxery-proxy\n\
             if [ -d /etc/sudoers.d ] && command -v visudo >/dev/null && ! sudo -n test -f \"$u\"; then printf '%s' {su} | sudo -n tee \"$u.new\" >/dev/null && sudo -n chmod 0440 \"$u.new\" && if sudo -n visudo -cqf \"$u.new\"; then sudo -n mv \"$u.new\" \"$u\"; else sudo -n rm -f \"$u.new\"; fi; fi\n",
            apt = shell_quote(&apt),
            su = shell_quote(sudoers),
        ));
    }
    s
}

/// The part of [`script`] that points the guest's resolver at `dns` (readable by all: resolved
/// runs as its own user; the script's umask is 077), where the control plane
/// answers name lookups by the VM's egress policy (docs/egress.md, "Name lookups"): a
/// systemd-resolved drop-in on tmpfs (written at every boot; the image is not changed, so it
/// boots elsewhere unaffected), resolved restarted when it changed; without resolved, a
/// `nameserver` line in an `/etc/resolv.conf` that has none (busybox's, as DHCP left it).
fn dns_script(dns: std::net::Ipv4Addr) -> String {
    let conf = format!(
        "# boxery (docs/egress.md): name lookups go to the control plane, which answers by the VM's egress policy\n\
         [Resolve]\nDNS={dns}\n"
    );
    format!(
        "r=/run/systemd/resolved.conf.d/90-boxery-dns.conf\n\
         if [ -d /run/systemd/resolve ]; then \
         if [ \"$(cat \"$r\" 2>/dev/null)\" != \"$(printf '%s' {c})\" ]; then \
         sudo -n install -d -m 0755 \"$(dirname \"$r\")\" && printf '%s' {c} | sudo -n tee \"$r.new\" >/dev/null && sudo -n chmod 0644 \"$r.new\" && sudo -n mv \"$r.new\" \"$r\" && \
         {{ sudo -n systemctl try-restart systemd-resolved.service || echo 'boxery: systemd-resolved did not restart (journalctl -u systemd-resolved)' >&2; }} || echo 'boxery: cannot point systemd-resolved at the name server' >&2; fi; \
         elif [ -f /etc/resolv.conf ] && [ ! -L /etc/resolv.conf ] && ! grep -qs '^nameserver' /etc/resolv.conf; then \
         {{ printf 'nameserver %s\\n' {dns} | sudo -n tee -a /etc/resolv.conf >/dev/null || echo 'boxery: cannot add the name server to /etc/resolv.conf' >&2; }}; fi\n",
        c = shell_quote(&conf),
    )
}

/// The part of [`script`] that gives the desktop (the desktop layer's `boxery-desktop`
/// service) the screen size `size` (checked by the API) in [`Display::FILE`] (no value: on the
/// disk), as [`Display::file_text`] (what a new VM's seed writes too); with no size, takes
/// back a file boxery wrote (a size set by hand stays). The display starts again only when the
/// size it runs at changes, so a push that changes nothing (every boot) restarts nothing.
fn display_script(size: Option<&Display>) -> String {
    let default = Display::DEFAULT;
    let restart = "{ sudo -n systemctl try-restart boxery-desktop.service || echo 'boxery: the desktop did not start again (journalctl -u boxery-desktop)' >&2; }";
    let change = match size {
        Some(size) => format!(
            "if [ \"$cur\" != {q} ] || ! grep -qs {mark} \"$e\"; then \
             sudo -n install -d -m 0755 \"$(dirname \"$e\")\" && printf '%s' {text} | sudo -n tee \"$e.new\" >/dev/null && sudo -n chmod 0644 \"$e.new\" && sudo -n mv \"$e.new\" \"$e\" && \
             if [ \"$cur\" != {q} ]; then {restart}; fi; fi",
            q = shell_quote(&size.to_string()),
            mark = shell_quote(Display::MARK),
            text = shell_quote(&size.file_text()),
        ),
        None => format!(
            "if grep -qs {mark} \"$e\"; then sudo -n rm -f \"$e\" && if [ \"$cur\" != {default} ]; then {restart}; fi; fi",
            mark = shell_quote(Display::MARK),
        ),
    };
    format!(
        "e={}\n\
         if [ -e /etc/systemd/system/boxery-desktop.service ]; then \
         cur=$(sed -n 's/^BOXERY_DISPLAY=//p' \"$e\" 2>/dev/null | tail -n 1); cur=${{cur:-{default}}}; \
         {change}; fi\n",
        shell_quote(Display::FILE)
    )
}

/// The part of [`script`] that installs `f` under `$d` (set, existing, the caller's), each
/// file replaced atomically, so a reader in the guest sees the old revision or the new one,
/// never a missing file: `env` and `npmrc` are renamed over, and `files` is a symlink to one
/// of two trees (`.files.a`, `.files.b`), the new one filled beside the live one and the
/// link renamed over (the shape of a Kubernetes ConfigMap volume's `..data`). `AGENTS.md` is
/// put in place last: an agent (or a script) that finds it finds the environment it describes
/// already there.
fn tree(f: &Files, rev: &str) -> String {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let mut s = String::from(
        "n=\"$d/.new\"\nrm -rf \"$n\"\nmkdir -p \"$n\"\n\
         if [ \"$(readlink \"$d/files\" 2>/dev/null || true)\" = .files.a ]; then g=.files.b; else g=.files.a; fi\n\
         rm -rf \"${d:?}/$g\"\nmkdir -p \"$d/$g\"\n",
    );
    let mut put = |dest: &str, path: &str, bytes: &[u8]| {
        if let Some((dir, _)) = path.rsplit_once('/') {
            s.push_str(&format!("mkdir -p \"{dest}\"/{}\n", shell_quote(dir)));
        }
        s.push_str(&format!(
            "base64 -d > \"{dest}\"/{} <<'BOXERY_B64'\n{}\nBOXERY_B64\nchmod 0400 \"{dest}\"/{}\n",
            shell_quote(path),
            b64(bytes),
            shell_quote(path)
        ));
    };
    put("$n", "env", f.env.as_bytes());
    put("$n", "AGENTS.md", f.context.as_bytes());
    put("$n", "ssh_config", f.ssh_config.as_bytes());
    if let Some(npmrc) = &f.npmrc {
        put("$n", "npmrc", npmrc.as_bytes());
    }
    for (target, bytes) in &f.files {
        put("$d/$g", target, bytes);
    }
    s.push_str(&format!(
        // A `files` left a real directory by an older boxery is moved aside once (the only
        // swap that is not atomic); `mv -T` renames the new link over the old one.
        "ln -s \"$g\" \"$n/files\"\n\
         if [ -d \"$d/files\" ] && [ ! -L \"$d/files\" ]; then rm -rf \"$d/files.old\"; mv \"$d/files\" \"$d/files.old\"; fi\n\
         mv -fT \"$n/files\" \"$d/files\"\n\
         if [ -e \"$n/npmrc\" ]; then mv -f \"$n/npmrc\" \"$d/npmrc\"; else rm -f \"$d/npmrc\"; fi\n\
         mv -f \"$n/ssh_config\" \"$d/ssh_config\"\n\
         mv -f \"$n/env\" \"$d/env\"\n\
         mv -f \"$n/AGENTS.md\" \"$d/AGENTS.md\"\n\
         for o in .files.a .files.b; do [ \"$o\" = \"$g\" ] || rm -rf \"${{d:?}}/$o\"; done\n\
         rm -rf \"$d/files.old\" \"$n\"\nprintf '%s\\n' {rev} > \"$d/rev\"\n"
    ));
    s
}

/// The revisions pushed to each VM's guest (in this process), and when a push last failed.
#[derive(Debug, Default)]
pub struct Pushed {
    revs: Mutex<HashMap<String, Result<String, Instant>>>,
}

impl Pushed {
    fn due(&self, vm: &str, rev: &str) -> bool {
        match self.revs.lock().unwrap_or_else(|e| e.into_inner()).get(vm) {
            Some(Ok(r)) => r != rev,
            Some(Err(at)) => at.elapsed() >= RETRY,
            None => true,
        }
    }
    fn set(&self, vm: &str, r: Result<String, Instant>) {
        self.revs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(vm.to_string(), r);
    }
    fn keep_only(&self, vms: &std::collections::HashSet<String>) {
        self.revs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| vms.contains(k));
    }
}

/// What names one boot of a ready VM: when `Ready` last turned true, and where its sshd is.
/// `None` when it is not ready (nothing can be pushed).
pub fn boot_of(v: &Vm) -> Option<String> {
    let ready = v.status.conditions.get_condition(READY)?;
    if ready.status != ConditionStatus::True {
        return None;
    }
    let endpoint = crate::ssh::Target::of(v)?.endpoint;
    let at = ready
        .last_transition_time
        .map(|t| t.to_rfc3339())
        .unwrap_or_default();
    Some(format!("{at} {endpoint}"))
}

/// Push what `v`'s guest should hold if it has changed since the last push. `Ok(false)`:
/// nothing to do.
pub async fn sync(ctx: &Ctx, v: &Vm) -> Result<bool, String> {
    let name = v.metadata.name.as_str();
    let (Some(ssh), Some(boot)) = (&ctx.ssh, boot_of(v)) else {
        return Ok(false);
    };
    // One push per VM at a time, each planned after the last one ended: otherwise a push
    // planned before a grant changed (the guest loop's) could land after the one planned
    // after it (the grant reconciler's), putting back what a revoke took away, or taking
    // away what a grant marked Applied had just pushed.
    let lock = ctx.vm_lock(&format!("guest-push:{name}"));
    let _one = lock.lock().await;
    let Some(plan) = Plan::of(ctx, v) else {
        return Ok(false);
    };
    let rev = plan.rev(&boot);
    if !ctx.guest.due(name, &rev) {
        return Ok(false);
    }
    let files = files(&plan, &ctx.home).await;
    let r = push(ssh, v, &files, &rev).await;
    match &r {
        Ok(()) if files.unavailable.is_empty() => ctx.guest.set(name, Ok(rev)),
        Ok(()) => {
            for (grant, why) in &files.unavailable {
                tracing::warn!(
                    vm = name,
                    grant,
                    why,
                    "a grant's value was left out of the guest"
                );
            }
            ctx.guest.set(name, Err(Instant::now()));
        }
        Err(e) => {
            tracing::warn!(vm = name, error = %e, "pushing the guest's grants failed; retrying");
            ctx.guest.set(name, Err(Instant::now()));
        }
    }
    r.map(|()| true)
}

/// Run the push script on `v` over ssh.
async fn push(ssh: &crate::ssh::SshDir, v: &Vm, files: &Files, rev: &str) -> Result<(), String> {
    let target = crate::ssh::Target::of(v).ok_or("no ssh endpoint")?;
    ssh.write(&target).map_err(|e| e.to_string())?;
    run_script(
        ssh,
        &v.metadata.name,
        &[],
        "sh -s",
        &script(files, rev),
        PUSH_TIMEOUT,
    )
    .await
    .map_err(|e| format!("the guest's push script: {e}"))
}

/// Run `script` on VM `vm` with `shell` (`sh -s` as its login user, `sudo -n sh -s` as root:
/// the script travels on ssh's stdin, never on a command line), with the ssh options `opts`,
/// within `timeout`. The error holds the script's stderr, which names paths and commands,
/// never values.
pub(crate) async fn run_script(
    ssh: &crate::ssh::SshDir,
    vm: &str,
    opts: &[&str],
    shell: &str,
    script: &str,
    timeout: Duration,
) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let mut child = ssh
        .command(vm)
        .args(["-T", "-o", "BatchMode=yes"])
        .args(opts)
        .args(["--", shell])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run ssh: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let write = async move {
        stdin.write_all(script.as_bytes()).await?;
        stdin.shutdown().await
    };
    let (w, out) = tokio::time::timeout(timeout, async {
        tokio::join!(write, child.wait_with_output())
    })
    .await
    .map_err(|_| format!("ssh took longer than {timeout:?}"))?;
    let out = out.map_err(|e| format!("ssh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    w.map_err(|e| format!("writing to ssh: {e}"))
}

/// Keep every ready VM's guest in step until `shutdown`.
pub async fn keep(ctx: Arc<Ctx>, vms: Cache, shutdown: CancellationToken) {
    if ctx.ssh.is_none() {
        // No guests to reach (the fake backend): nothing to keep, until shutdown.
        return shutdown.cancelled().await;
    }
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let all: Vec<Vm> = vms
            .list_as::<Vm>()
            .into_iter()
            .filter(|v| !v.metadata.is_deleting())
            .collect();
        ctx.guest
            .keep_only(&all.iter().map(|v| v.metadata.name.clone()).collect());
        futures::stream::iter(all)
            .for_each_concurrent(CONCURRENCY, |v| {
                let ctx = ctx.clone();
                async move {
                    let _ = sync(&ctx, &v).await;
                }
            })
            .await;
    }
}

/// Running a part of the push script against a root of a test's own.
#[cfg(test)]
mod shimmed {
    /// Run `script` with `/run` and `/etc` moved under `root`, under the push script's umask,
    /// with sudo and systemctl as shims; what systemctl was asked.
    pub(super) fn run(root: &std::path::Path, script: &str) -> String {
        let r = root.display();
        let script = script
            .replace("/run/", &format!("{r}/run/"))
            .replace("/etc/", &format!("{r}/etc/"));
        let log = root.join("systemctl.log");
        let shims = format!(
            "sudo() {{ shift; \"$@\"; }}\nsystemctl() {{ echo \"$*\" >> {}; }}\n",
            log.display()
        );
        let o = std::process::Command::new("sh")
            .args(["-euc", &format!("umask 077\n{shims}{script}")])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        said
    }
}

#[cfg(test)]
mod docker_client_tests {
    use super::{docker_client_proxies, docker_client_script};

    /// The Docker client part run with `home` as `$HOME` and a `docker` on the PATH or not.
    fn run(home: &std::path::Path, docker: bool) -> std::process::Output {
        let bin = home.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let shim = bin.join("docker");
        if docker {
            std::fs::write(&shim, "#!/bin/sh\n").unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
        } else {
            let _ = std::fs::remove_file(&shim);
        }
        let proxies =
            docker_client_proxies("http://boxery:bxt_1@10.0.2.100:80", "10.0.2.100,localhost");
        std::process::Command::new("sh")
            .args(["-euc", &docker_client_script(&proxies)])
            .env("HOME", home)
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .output()
            .unwrap()
    }

    #[test]
    fn containers_get_the_proxy_and_a_logins_credentials_stay() {
        let home = tempfile::tempdir().unwrap();
        let cfg = home.path().join(".docker/config.json");
        // no Docker: nothing written
        assert!(run(home.path(), false).status.success());
        assert!(!cfg.exists());
        // Docker: the proxies, 0600
        assert!(run(home.path(), true).status.success());
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        assert_eq!(
            c["proxies"]["default"]["httpsProxy"],
            "http://boxery:bxt_1@10.0.2.100:80"
        );
        assert_eq!(c["proxies"]["default"]["noProxy"], "10.0.2.100,localhost");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&cfg).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // a docker login's credentials, and proxies of other daemons, stay
        std::fs::write(
            &cfg,
            r#"{"auths": {"registry.test": {"auth": "eDp5"}}, "proxies": {"tcp://other:2376": {"httpProxy": "http://x"}}}"#,
        )
        .unwrap();
        assert!(run(home.path(), true).status.success());
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        assert_eq!(c["auths"]["registry.test"]["auth"], "eDp5");
        assert_eq!(c["proxies"]["tcp://other:2376"]["httpProxy"], "http://x");
        assert_eq!(
            c["proxies"]["default"]["httpProxy"],
            "http://boxery:bxt_1@10.0.2.100:80"
        );
        // unchanged: not written again
        let before = std::fs::metadata(&cfg).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(run(home.path(), true).status.success());
        assert_eq!(std::fs::metadata(&cfg).unwrap().modified().unwrap(), before);
        // not Docker's (not an object, not JSON): left alone, said, and the push goes on
        for other in ["[1]", "{not json"] {
            std::fs::write(&cfg, other).unwrap();
            let o = run(home.path(), true);
            assert!(o.status.success());
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("left as they are") && !err.contains("Traceback"),
                "{err}"
            );
            assert_eq!(std::fs::read_to_string(&cfg).unwrap(), other);
        }
        // the token is never on a command line: printf is the shell's own, and python reads
        // the proxies on its stdin (its arguments: the program and the file)
        let script = docker_client_script(&docker_client_proxies("http://boxery:bxt_1@h:80", ""));
        assert!(
            script.contains("| base64 -d | python3 -c ")
                && script.ends_with("\"$HOME/.docker/config.json\" || true; fi\n"),
            "{script}"
        );
    }
}

#[cfg(test)]
mod display_tests {
    use super::display_script;

    /// The display part run against `root` ([`super::shimmed::run`]), for a size `WxH`.
    fn run(root: &std::path::Path, size: Option<&str>) -> String {
        let size = size.map(|s| {
            let (w, h) = s.split_once('x').unwrap();
            boxery_api::vm::Display {
                width: w.parse().unwrap(),
                height: h.parse().unwrap(),
            }
        });
        super::shimmed::run(root, &display_script(size.as_ref()))
    }

    #[test]
    fn the_size_is_written_marked_and_restarts_only_on_a_change() {
        let root = tempfile::tempdir().unwrap();
        let env = root.path().join("etc/boxery/desktop.env");
        // no desktop: nothing
        assert_eq!(run(root.path(), Some("1024x768")), "");
        assert!(!env.exists());
        std::fs::create_dir_all(root.path().join("etc/systemd/system")).unwrap();
        std::fs::write(
            root.path()
                .join("etc/systemd/system/boxery-desktop.service"),
            "",
        )
        .unwrap();
        // nothing set, no file: nothing
        assert_eq!(run(root.path(), None), "");
        // a size: written, restarted; again: nothing
        assert!(run(root.path(), Some("1024x768")).contains("try-restart"));
        let f = std::fs::read_to_string(&env).unwrap();
        assert!(
            f.starts_with("# boxery: spec.display") && f.contains("BOXERY_DISPLAY=1024x768"),
            "{f}"
        );
        assert_eq!(run(root.path(), Some("1024x768")), "");
        // the spec's size removed: the file taken back, the default restored
        assert!(run(root.path(), None).contains("try-restart"));
        assert!(!env.exists());
        // a size set by hand: kept when the spec sets none
        std::fs::write(&env, "BOXERY_DISPLAY=1920x1080\n").unwrap();
        assert_eq!(run(root.path(), None), "");
        assert!(env.exists());
        // the spec's size over a hand's file of the same size: marked, no restart
        assert_eq!(run(root.path(), Some("1920x1080")), "");
        assert!(
            std::fs::read_to_string(&env)
                .unwrap()
                .starts_with("# boxery")
        );
        // what a new VM's seed wrote (the display's size at its first start): the first push
        // of the same size neither rewrites it nor restarts the display
        let d = boxery_api::vm::Display {
            width: 800,
            height: 600,
        };
        std::fs::write(&env, d.file_text()).unwrap();
        assert_eq!(run(root.path(), Some("800x600")), "");
        assert_eq!(std::fs::read_to_string(&env).unwrap(), d.file_text());
    }
}

#[cfg(test)]
mod dns_tests {
    use super::dns_script;

    /// The name-lookup part run against `root` ([`super::shimmed::run`]).
    fn run(root: &std::path::Path) -> String {
        super::shimmed::run(root, &dns_script(std::net::Ipv4Addr::new(10, 0, 2, 3)))
    }

    #[test]
    fn resolved_is_pointed_at_the_control_plane_once_per_boot() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("run/systemd/resolve")).unwrap();
        assert!(run(root.path()).contains("try-restart systemd-resolved.service"));
        let conf = root
            .path()
            .join("run/systemd/resolved.conf.d/90-boxery-dns.conf");
        let f = std::fs::read_to_string(&conf).unwrap();
        assert!(f.contains("[Resolve]\nDNS=10.0.2.3\n"), "{f}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&conf).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644, "resolved (its own user) reads it");
        // pushed again (the same boot): nothing restarted
        assert_eq!(run(root.path()), "");
        assert!(
            !root.path().join("etc/resolv.conf").exists(),
            "resolved's guest: no resolv.conf"
        );
    }

    #[test]
    fn a_resolv_conf_without_a_name_server_gets_one_and_one_with_its_own_is_left() {
        let root = tempfile::tempdir().unwrap();
        let rc = root.path().join("etc/resolv.conf");
        std::fs::create_dir_all(rc.parent().unwrap()).unwrap();
        std::fs::write(&rc, "").unwrap();
        assert_eq!(run(root.path()), "");
        assert_eq!(
            std::fs::read_to_string(&rc).unwrap(),
            "nameserver 10.0.2.3\n"
        );
        run(root.path());
        assert_eq!(
            std::fs::read_to_string(&rc).unwrap(),
            "nameserver 10.0.2.3\n",
            "once"
        );
        std::fs::write(&rc, "nameserver 192.0.2.53\n").unwrap();
        run(root.path());
        assert_eq!(
            std::fs::read_to_string(&rc).unwrap(),
            "nameserver 192.0.2.53\n"
        );
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_agents_file_is_put_in_place_after_what_it_describes() {
        let f = Files {
            env: "export A=1\n".into(),
            context: "# Where you are\n".into(),
            ssh_config: String::new(),
            npmrc: Some("x".into()),
            ..Files::default()
        };
        let s = tree(&f, "r1");
        let at = |what: &str| s.find(what).unwrap_or_else(|| panic!("no {what} in {s}"));
        let agents = at("mv -f \"$n/AGENTS.md\"");
        for before in [
            "mv -f \"$n/env\"",
            "mv -f \"$n/ssh_config\"",
            "mv -fT \"$n/files\"",
            "mv -f \"$n/npmrc\"",
        ] {
            assert!(at(before) < agents, "{before} after AGENTS.md:\n{s}");
        }
    }

    use super::*;
    use boxery_api::grant::ValueFrom;

    fn entry(name: &str, type_: GrantType, target: &str, value_from: ValueFrom) -> Entry {
        Entry {
            name: name.into(),
            uid: format!("uid-{name}"),
            generation: 1,
            spec: boxery_api::grant::GrantSpec {
                limits: None,
                vm: Some("dev1".into()),
                lease: None,
                type_,
                target: target.into(),
                header: None,
                value_from,
            },
            vm_uid: "vm-uid".into(),
            lease_uid: None,
        }
    }

    /// `sh` sourcing `env`, then printing each of `vars` on its own line.
    fn sourced(env: &str, vars: &[&str]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("env");
        std::fs::write(&f, env).unwrap();
        let print: Vec<String> = vars
            .iter()
            .map(|v| format!("printf '%s\\n' \"${v}\""))
            .collect();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(". {}; {}", f.display(), print.join("; ")))
            .env_clear()
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[tokio::test]
    async fn the_env_file_gives_the_proxy_the_token_and_the_grants_and_quotes_values() {
        let home = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(outside.path(), b"line1\nline2 'q' $(x)\n").unwrap();
        // A hostile value: quotes, command substitution, a newline: it stays one literal value.
        let hostile = "a'b\"c$(touch /tmp/boxery-pwned)`id`\nx";
        let plan = Plan {
            url: "http://10.0.2.100".into(),
            channel: true,
            token: "bxt_abc".into(),
            vm: "dev1".into(),
            egress: Default::default(),
            display: None,
            dns: None,
            grants: vec![
                entry(
                    "g-llm",
                    GrantType::Llm,
                    "anthropic",
                    ValueFrom::Env("UNUSED".into()),
                ),
                entry(
                    "g-oai",
                    GrantType::Llm,
                    "openai",
                    ValueFrom::Env("UNUSED".into()),
                ),
                entry(
                    "g-gh",
                    GrantType::Github,
                    "me/repo",
                    ValueFrom::Env("UNUSED".into()),
                ),
                entry(
                    "g-env",
                    GrantType::Env,
                    "APP_SECRET",
                    ValueFrom::Command(vec!["printf".into(), "%s".into(), hostile.into()]),
                ),
                entry(
                    "g-missing",
                    GrantType::Env,
                    "NOPE",
                    ValueFrom::Env("BOXERY_GUEST_TEST_UNSET".into()),
                ),
                entry(
                    "g-file",
                    GrantType::File,
                    "cfg/app.conf",
                    ValueFrom::File(outside.path().display().to_string()),
                ),
            ],
        };
        let f = files(&plan, home.path()).await;
        let got = sourced(
            &f.env,
            &[
                "BOXERY_PROXY",
                "BOXERY_TOKEN",
                "ANTHROPIC_BASE_URL",
                "ANTHROPIC_API_KEY",
                "OPENAI_BASE_URL",
                "OPENAI_API_KEY",
                "GIT_CONFIG_COUNT",
                "GIT_CONFIG_KEY_0",
                "GIT_CONFIG_VALUE_0",
                "GIT_CONFIG_KEY_1",
                "GIT_CONFIG_VALUE_1",
                "APP_SECRET",
            ],
        );
        let want = [
            "http://10.0.2.100",
            "bxt_abc",
            "http://10.0.2.100/llm/anthropic",
            "bxt_abc",
            "http://10.0.2.100/llm/openai/v1",
            "bxt_abc",
            "2",
            "url.http://10.0.2.100/edge/github.com/.insteadOf",
            "https://github.com/",
            "http.http://10.0.2.100/edge/.extraHeader",
            "x-boxery-token: bxt_abc",
            hostile,
        ]
        .join("\n")
            + "\n";
        assert_eq!(got, want);
        assert!(!std::path::Path::new("/tmp/boxery-pwned").exists());
        assert_eq!(
            f.files,
            vec![(
                "cfg/app.conf".to_string(),
                b"line1\nline2 'q' $(x)\n".to_vec()
            )]
        );
        assert_eq!(f.unavailable.len(), 1);
        assert_eq!(f.unavailable[0].0, "g-missing");
        assert!(!f.unavailable[0].1.contains(hostile));
        // Egress goes through the proxy: a per-VM channel needs no token in the proxy URL, so
        // apt and sudo get it too (static files).
        assert!(
            f.env
                .contains("http_proxy=http://10.0.2.100:80 https_proxy=http://10.0.2.100:80")
                && f.env
                    .contains("no_proxy=10.0.2.100,localhost,127.0.0.1,::1"),
            "{}",
            f.env
        );
        assert_eq!(f.system_proxy.as_deref(), Some("http://10.0.2.100:80"));
        // Docker's daemon reads only its unit's environment
        assert!(
            f.docker.contains(
                "Environment=\"HTTP_PROXY=http://10.0.2.100:80\" \"HTTPS_PROXY=http://10.0.2.100:80\" \"NO_PROXY=10.0.2.100,localhost,127.0.0.1,::1\"\n"
            ),
            "{}",
            f.docker
        );
        let sh = script(&f, "1");
        assert!(
            sh.contains("k=/etc/systemd/system/docker.service.d/90-boxery-proxy.conf"),
            "on the disk: no token in it"
        );
        let shared = Plan {
            url: "http://192.168.122.1:8099".into(),
            channel: false,
            ..plan.clone()
        };
        assert_eq!(
            egress_url(&shared),
            "http://boxery:bxt_abc@192.168.122.1:8099"
        );
        // ssh goes through the egress proxy: on a channel without a password, on a shared
        // listener with the token as one
        assert!(
            f.ssh_config
                .contains("ProxyCommand socat - PROXY:10.0.2.100:%h:%p,proxyport=80\n")
                && f.ssh_config.contains("StrictHostKeyChecking accept-new\n"),
            "{}",
            f.ssh_config
        );
        assert!(
            ssh_config(&shared)
                .contains("PROXY:192.168.122.1:%h:%p,proxyport=8099,proxyauth=boxery:bxt_abc\n"),
            "{}",
            ssh_config(&shared)
        );
        // The script carries values in base64 only: no value in clear text.
        let s = script(&f, "r1");
        assert!(s.contains("Acquire::http::Proxy"), "{s}");
        assert!(!s.contains("bxt_abc") && !s.contains("touch /tmp"), "{s}");
        // On a shared listener Docker's proxy URL holds the token: tmpfs, and base64 here
        let on_shared = files(&shared, home.path()).await;
        assert!(on_shared.docker.contains("bxt_abc"), "{}", on_shared.docker);
        let s = script(&on_shared, "r1");
        assert!(
            s.contains("k=/run/systemd/system/docker.service.d/90-boxery-proxy.conf"),
            "{s}"
        );
        assert!(!s.contains("bxt_abc"), "{s}");
    }

    /// Re-installing the guest's files never leaves a reader without one: a reader looping
    /// over the env file and a file grant while the tree is installed again and again (as a
    /// restarted control plane does) always reads a whole value. And the tree installs over
    /// the shape an older boxery left (`files` a real directory).
    #[test]
    fn a_push_replaces_every_file_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("boxery");
        std::fs::create_dir_all(d.join("files/app")).unwrap();
        std::fs::write(d.join("files/app/app.conf"), "old\n").unwrap();
        std::fs::write(d.join("files/app/stale"), "x").unwrap();
        let files = |v: &str| Files {
            env: format!("export A={v}\n"),
            npmrc: Some(format!("//r/:_authToken={v}\n")),
            files: vec![("app/app.conf".into(), format!("{v}\n").into_bytes())],
            ..Files::default()
        };
        let install = |f: &Files, rev: &str| {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "set -eu\numask 077\nd='{}'\n{}",
                    d.display(),
                    tree(f, rev)
                ))
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        install(&files("v0"), "r0");
        let read = |p: &str| std::fs::read_to_string(d.join(p)).unwrap();
        assert_eq!(read("files/app/app.conf"), "v0\n");
        assert!(!d.join("files/app/stale").exists() && !d.join("files.old").exists());
        assert_eq!(read("rev"), "r0\n");
        // A reader in a thread while the installs run.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (d, stop) = (d.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reads = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for p in ["files/app/app.conf", "env", "npmrc"] {
                        let v = std::fs::read_to_string(d.join(p))
                            .unwrap_or_else(|e| panic!("{p} was missing during a push: {e}"));
                        assert!(v.ends_with('\n'), "{p} read part-written: {v:?}");
                    }
                    reads += 1;
                }
                reads
            })
        };
        for i in 1..=40 {
            install(&files(&format!("v{i}")), &format!("r{i}"));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let reads = reader.join().expect("the reader always found every file");
        assert!(
            reads > 40,
            "the reader ran alongside the pushes ({reads} rounds)"
        );
        assert_eq!(read("files/app/app.conf"), "v40\n");
        assert_eq!(read("env"), "export A=v40\n");
        // One tree live, the other gone; no npmrc once npm no longer goes through the proxy.
        let trees: Vec<_> = [".files.a", ".files.b"]
            .into_iter()
            .filter(|t| d.join(t).exists())
            .collect();
        assert_eq!(trees.len(), 1, "{trees:?}");
        install(
            &Files {
                npmrc: None,
                ..files("v41")
            },
            "r41",
        );
        assert!(!d.join("npmrc").exists());
        assert!(!d.join(".new").exists());
    }

    #[tokio::test]
    async fn the_agents_settings_follow_the_llm_grants_and_hold_no_value() {
        let home = tempfile::tempdir().unwrap();
        let llm = |target: &str| entry(target, GrantType::Llm, target, ValueFrom::Env("K".into()));
        let plan = |grants: Vec<Entry>| Plan {
            url: "http://10.0.2.100".into(),
            channel: true,
            token: "bxt_abc".into(),
            vm: "dev1".into(),
            egress: Default::default(),
            display: None,
            dns: None,
            grants,
        };
        // no llm grant: nothing for the agents
        let none = plan(vec![entry(
            "e",
            GrantType::Env,
            "A",
            ValueFrom::Env("A".into()),
        )]);
        assert_eq!(agents(&none), Agents::default());
        let opencode = |f: &Files| -> serde_json::Value {
            let v = sourced(
                &f.env,
                &["OPENCODE_CONFIG_CONTENT", "OPENCODE_DISABLE_MODELS_FETCH"],
            );
            let (json, fetch) = v.trim_end().rsplit_once('\n').unwrap();
            assert_eq!(fetch, "1");
            assert!(!json.contains("bxt_abc"), "{json}");
            serde_json::from_str(json).unwrap()
        };
        // one provider: opencode has it alone, at the proxy with the `/v1` its Anthropic client
        // wants (claude's has none); codex only with OpenAI
        for (p, codex) in [("openai", true), ("anthropic", false)] {
            let f = files(&plan(vec![llm(p)]), home.path()).await;
            let oc = opencode(&f);
            assert_eq!(oc["enabled_providers"], serde_json::json!([p]));
            assert_eq!(
                oc["provider"][p]["options"]["baseURL"],
                format!("http://10.0.2.100/llm/{p}/v1").as_str()
            );
            assert_eq!(oc["autoupdate"], false);
            assert_eq!(f.codex.is_some(), codex, "{p}");
        }
        // on a shared listener the egress URL carries the token: the agents' settings still
        // hold none
        let mut shared = plan(vec![llm("openai"), llm("anthropic")]);
        shared.channel = false;
        assert!(egress_url(&shared).contains("bxt_abc"));
        let a = agents(&shared);
        assert!(!a.env.contains("bxt_abc"), "{}", a.env);
        assert!(!a.codex.unwrap().contains("bxt_abc"));
        let codex = agents(&plan(vec![llm("openai")])).codex.unwrap();
        for line in [
            "model_provider = \"boxery\"",
            "[model_providers.boxery]",
            "base_url = \"http://10.0.2.100/llm/openai/v1\"",
            "env_key = \"OPENAI_API_KEY\"",
            "wire_api = \"responses\"",
            "supports_websockets = false",
            "check_for_update_on_startup = false",
        ] {
            assert!(codex.lines().any(|l| l == line), "{line:?} in {codex}");
        }
        assert!(
            codex.starts_with(WRITTEN) && !codex.contains("bxt_abc"),
            "{codex}"
        );
        // both, and a provider the agents do not know
        let f = files(
            &plan(vec![llm("anthropic"), llm("openai"), llm("ollama")]),
            home.path(),
        )
        .await;
        assert_eq!(
            opencode(&f)["enabled_providers"],
            serde_json::json!(["anthropic", "openai"])
        );
        assert!(f.codex.is_some());
    }

    /// codex's settings file is written when it differs, removed when the grant goes, and a
    /// file of the user's at that path is left alone; readable by everyone under the push's
    /// `umask 077`. (`sudo` is a stand-in that runs its command.)
    #[test]
    fn codex_settings_are_kept_in_step_and_a_users_own_left_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::fs::write(
            bin.join("sudo"),
            "#!/bin/sh\n[ \"$1\" = -n ] && shift\nexec \"$@\"\n",
        )
        .unwrap();
        std::fs::set_permissions(bin.join("sudo"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("etc/codex/config.toml");
        let run = |codex: Option<&str>| {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "set -eu\numask 077\n{}",
                    codex_script(codex, path.to_str().unwrap())
                ))
                .env(
                    "PATH",
                    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
                )
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        let of = |url: &str| {
            let plan = Plan {
                url: url.into(),
                channel: false,
                token: "bxt_abc".into(),
                vm: "dev1".into(),
                egress: Default::default(),
                display: None,
                dns: None,
                grants: vec![entry(
                    "o",
                    GrantType::Llm,
                    "openai",
                    ValueFrom::Env("K".into()),
                )],
            };
            agents(&plan).codex.unwrap()
        };
        let read = || std::fs::read_to_string(&path).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        run(Some(&of("http://10.0.2.100")));
        assert_eq!(read(), of("http://10.0.2.100"));
        assert_eq!((mode(&path), mode(path.parent().unwrap())), (0o644, 0o755));
        run(Some(&of("http://192.168.122.1:8099")));
        assert!(read().contains("base_url = \"http://192.168.122.1:8099/llm/openai/v1\""));
        run(None);
        assert!(!path.exists());
        // the user's own file
        std::fs::write(&path, "model = \"o3\"\n").unwrap();
        run(Some(&of("http://10.0.2.100")));
        run(None);
        assert_eq!(read(), "model = \"o3\"\n");
    }

    #[test]
    fn a_revision_changes_with_the_token_the_grants_and_the_boot() {
        let plan = Plan {
            url: "http://10.0.2.100".into(),
            channel: true,
            token: "bxt_1".into(),
            vm: "dev1".into(),
            egress: Default::default(),
            display: None,
            dns: None,
            grants: vec![entry("g", GrantType::Env, "A", ValueFrom::Env("A".into()))],
        };
        let r = plan.rev("boot1");
        assert_eq!(r, plan.rev("boot1"));
        assert_ne!(r, plan.rev("boot2"));
        let mut other = plan.clone();
        other.token = "bxt_2".into();
        assert_ne!(r, other.rev("boot1"));
        let mut other = plan.clone();
        other.grants[0].generation = 2;
        assert_ne!(r, other.rev("boot1"));
        let mut other = plan;
        other.grants.clear();
        assert_ne!(r, other.rev("boot1"));
    }
}
