//! Where each of boxery's files lives under `$BOXERY_HOME`: one function per file or
//! directory, the one place a path under the home is spelled. Pure: nothing here touches the
//! disk.
//!
//! ```text
//! $BOXERY_HOME/
//!   store.db              the object store (SQLite)              store
//!   config.yaml           the owner's settings                   config
//!   tokens/<vm>           a VM's proxy token (0600)              token      (crate::tokens)
//!   grants/<vm>.json      the grants in force on a VM (0600)     grant_state (crate::grants)
//!   egress/<vm>           a VM's egress policy (0600)            egress_policy (crate::egress)
//!   audit/proxy.log       the credential proxy's audit log       audit_log
//!   audit/actions.log     commands, sessions, files, tools, API  actions_log
//!   proxy.addr            where serve's proxy listens            proxy_addr
//!   metrics.addr          where serve's /metrics listens         metrics_addr
//!   usage.db              the usage ledger (SQLite, 0600)        usage_db (crate::usage)
//!   api/                  the API's TLS files and tokens         api, api_tokens
//!   mcp-token             the MCP listener's bearer token        mcp_token
//!   ssh/                  ssh_config, pinned keys, ControlMasters ssh
//!   leases/<lease>/       the key pairs of leases held here      leases
//!   imports/              what an Image may import by default   imports
//!   <backend>/            a backend's own state                  backend
//!   contexts.yaml         the contexts of `boxery --context`     contexts
//!   contexts/<name>/      one context's files                    context
//!   sync/<source>.git     a git Source's bare mirror             sync_mirror
//!   drill.lock            one isolation drill at a time          drill_lock
//! ```

use std::path::{Path, PathBuf};

/// `store.db`: the object store.
pub fn store(home: &Path) -> PathBuf {
    home.join("store.db")
}

/// `config.yaml`: the owner's settings.
pub fn config(home: &Path) -> PathBuf {
    home.join("config.yaml")
}

/// `tokens/`: the token store ([`crate::tokens`]).
pub fn tokens(home: &Path) -> PathBuf {
    home.join("tokens")
}

/// `tokens/<vm>`: a VM's token.
pub fn token(home: &Path, vm: &str) -> PathBuf {
    tokens(home).join(vm)
}

/// `grants/`: the control plane's grant state ([`crate::grants`]; 0700, files 0600).
pub fn grants(home: &Path) -> PathBuf {
    home.join("grants")
}

/// `grants/<vm>.json`: the grants in force on a VM.
pub fn grant_state(home: &Path, vm: &str) -> PathBuf {
    grants(home).join(format!("{vm}.json"))
}

/// `egress/`: the VMs' egress policies ([`crate::egress`]).
pub fn egress(home: &Path) -> PathBuf {
    home.join("egress")
}

/// `egress/<vm>`: a VM's egress policy.
pub fn egress_policy(home: &Path, vm: &str) -> PathBuf {
    egress(home).join(vm)
}

/// `activity/`: when each VM was last used ([`crate::activity`]).
pub fn activity(home: &Path) -> PathBuf {
    home.join("activity")
}

/// `activity/<vm>`: VM `vm`'s last-use mark (its modification time).
pub fn activity_mark(home: &Path, vm: &str) -> PathBuf {
    activity(home).join(vm)
}

/// `audit/actions.log`: what people and agents did (commands, sessions, copies, files, tool
/// calls, API writes), kept by `boxery_verbs::audit`.
pub fn actions_log(home: &Path) -> PathBuf {
    home.join("audit").join("actions.log")
}

/// `audit/proxy.log`: the credential proxy's audit log.
pub fn audit_log(home: &Path) -> PathBuf {
    home.join("audit").join("proxy.log")
}

/// `proxy.addr`: where `serve`'s proxy listens (`127.0.0.1:PORT`).
pub fn proxy_addr(home: &Path) -> PathBuf {
    home.join("proxy.addr")
}

/// `metrics.addr`: where `serve --metrics-listen` listens (`127.0.0.1:PORT`).
pub fn metrics_addr(home: &Path) -> PathBuf {
    home.join("metrics.addr")
}

/// `usage.db`: the usage ledger ([`crate::usage`]).
pub fn usage_db(home: &Path) -> PathBuf {
    home.join("usage.db")
}

/// `api/`: the API server's files (its CA and certificate, its tokens).
pub fn api(home: &Path) -> PathBuf {
    home.join("api")
}

/// `api/tokens.json`: the API's bearer tokens (hashed).
pub fn api_tokens(home: &Path) -> PathBuf {
    api(home).join("tokens.json")
}

/// `mcp-token`: the bearer token of the MCP listener.
pub fn mcp_token(home: &Path) -> PathBuf {
    home.join("mcp-token")
}

/// `ssh/`: ssh_config, pinned host keys, ControlMaster sockets.
pub fn ssh(home: &Path) -> PathBuf {
    home.join("ssh")
}

/// `leases/`: the key pairs of the leases this host holds, one directory each.
pub fn leases(home: &Path) -> PathBuf {
    home.join("leases")
}

/// `imports/`: where an Image's `source.file` may always import from.
pub fn imports(home: &Path) -> PathBuf {
    home.join("imports")
}

/// `<backend>/`: where a backend keeps its state.
pub fn backend(home: &Path, backend: &str) -> PathBuf {
    home.join(backend)
}

/// `contexts.yaml`: the contexts of `boxery --context` (kubeconfig's format).
pub fn contexts(home: &Path) -> PathBuf {
    home.join("contexts.yaml")
}

/// `contexts/<name>/`: one context's files.
pub fn context(home: &Path, name: &str) -> PathBuf {
    home.join("contexts").join(name)
}

/// `sync/<source>.git`: a git Source's bare mirror.
pub fn sync_mirror(home: &Path, source: &str) -> PathBuf {
    home.join("sync").join(format!("{source}.git"))
}

/// `drill.lock`: held while an isolation drill runs.
pub fn drill_lock(home: &Path) -> PathBuf {
    home.join("drill.lock")
}
