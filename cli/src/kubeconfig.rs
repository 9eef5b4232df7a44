//! `boxery kubeconfig`: mint a token of a scope for the API (`serve --api-listen`) and print a
//! kubeconfig that kubectl and the Kubernetes client libraries use as is; `--list` and
//! `--revoke NAME` manage the tokens. docs/api.md.

use std::path::Path;

use base64::Engine as _;
use boxery_apiserver::tokens::{self, Scope};
use serde_json::json;

use crate::exit::{CliError, CliResult, Code};

/// `kubeconfig`'s arguments.
#[derive(Debug, clap::Args)]
pub struct KubeconfigArgs {
    /// What the token may do: `read` (get, list, watch), `full` (everything), or
    /// `lease:NAME` (the lease and the VM it holds, while it is Bound).
    #[arg(long, default_value = "full", value_parser = Scope::parse)]
    pub scope: Scope,
    /// The token's name (unique; `--revoke NAME` ends it). Default: the scope and the time.
    #[arg(long)]
    pub name: Option<String>,
    /// The API's URL as the client reaches it (default: https:// and the address `serve
    /// --api-listen` took, from $BOXERY_HOME/api/addr).
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// List the tokens (name, scope, created) instead.
    #[arg(long, conflicts_with_all = ["revoke", "name", "server"])]
    pub list: bool,
    /// End the token NAME: its next request gets 401.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["name", "server"])]
    pub revoke: Option<String>,
}

fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::new(Code::Failed, anyhow::anyhow!("{e}"))
}

/// Run `kubeconfig`.
pub fn run(home: &Path, a: KubeconfigArgs) -> CliResult<String> {
    if a.list {
        let head = vec!["NAME".into(), "SCOPE".into(), "CREATED".into()];
        let rows = tokens::read(home)
            .map_err(failed)?
            .into_iter()
            .map(|e| vec![e.name, e.scope, e.created]);
        return Ok(boxery_verbs::render::aligned(
            std::iter::once(head).chain(rows).collect(),
        ));
    }
    if let Some(name) = a.revoke {
        return match tokens::revoke(home, &name).map_err(failed)? {
            true => Ok(format!("token {name} revoked\n")),
            false => Err(CliError::new(
                Code::NotFound,
                anyhow::anyhow!("no token named {name}: `boxery kubeconfig --list` lists them"),
            )),
        };
    }
    let server = match a.server {
        Some(s) => s,
        None => {
            let file = boxery_apiserver::tls::dir(home).join("addr");
            let addr = std::fs::read_to_string(&file).map_err(|_| {
                CliError::invalid(format!(
                    "no API is being served for this home ({} is missing): start `boxery serve --api-listen 127.0.0.1:6443`, or give --server https://HOST:PORT",
                    file.display()
                ))
            })?;
            let addr: std::net::SocketAddr = addr.trim().parse().map_err(|_| {
                CliError::invalid(format!(
                    "{} does not hold an address: give --server https://HOST:PORT",
                    file.display()
                ))
            })?;
            if addr.ip().is_unspecified() {
                // Listening everywhere: this host reaches it on loopback; another machine
                // needs the host's name, which only the person knows.
                eprintln!(
                    "the API listens on every address ({addr}): this kubeconfig uses 127.0.0.1; for another machine, run again with --server https://HOST:{}",
                    addr.port()
                );
                format!("https://127.0.0.1:{}", addr.port())
            } else {
                format!("https://{addr}")
            }
        }
    };
    boxery_apiserver::tls::ensure_ca(home).map_err(failed)?;
    let ca = std::fs::read(boxery_apiserver::tls::ca_file(home)).map_err(failed)?;
    let name = a.name.unwrap_or_else(|| {
        format!(
            "{}-{}",
            a.scope.to_string().replace(':', "-"),
            chrono::Utc::now().format("%Y%m%d%H%M%S")
        )
    });
    if name.is_empty()
        || name.len() > 63
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
    {
        return Err(CliError::invalid(format!(
            "--name {name}: use letters, digits, `-`, `.` and `_`, at most 63"
        )));
    }
    let secret = tokens::mint(home, &name, &a.scope).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => CliError::invalid(e.to_string()),
        _ => failed(e),
    })?;
    let host = boxery_apiserver::tls::hostname().unwrap_or_else(|| "host".into());
    let cluster = format!("boxery-{host}");
    let user = format!("{cluster}-{name}");
    let cfg = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {
            "server": server,
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca),
        }}],
        "users": [{"name": user, "user": {"token": secret}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
        "preferences": {},
    });
    boxery_verbs::render::to_yaml(&cfg).map_err(|e| failed(e.to_string()))
}
