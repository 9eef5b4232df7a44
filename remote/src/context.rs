//! The contexts a home knows: `$BOXERY_HOME/contexts.yaml` (0600: it holds tokens), in
//! kubeconfig format, so the file `boxery kubeconfig` prints on a VM host is what
//! `boxery config add-context NAME -f FILE` takes, and `kubectl --kubeconfig
//! $BOXERY_HOME/contexts.yaml` reads the same servers. `current-context` is the one used when
//! neither `--context` nor `BOXERY_CONTEXT` names one; none (or `local`) means this home's own
//! store. Each context has a folder, `$BOXERY_HOME/contexts/NAME/`: what this machine keeps
//! for it (its ssh key and certificate, the VMs' ssh files, keys of leases taken from here).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use boxery_verbs::{Result, VerbError};
use serde::{Deserialize, Serialize};

/// The name that means this home's own store.
pub const LOCAL: &str = "local";

/// The file.
pub fn file(home: &Path) -> PathBuf {
    boxery_home::layout::contexts(home)
}

/// A context's folder.
pub fn dir(home: &Path, name: &str) -> PathBuf {
    boxery_home::layout::context(home, name)
}

/// A kubeconfig, as far as boxery reads and writes it.
#[derive(Debug, Clone, Default)]
pub struct Kubeconfig {
    /// `v1`.
    pub api_version: String,
    /// `Config`.
    pub kind: String,
    /// The servers.
    pub clusters: Vec<Named<Cluster>>,
    /// The credentials.
    pub users: Vec<Named<User>>,
    /// The pairs of a server and a credential.
    pub contexts: Vec<Named<ContextRef>>,
    /// The context used when none is named.
    pub current_context: Option<String>,
}

/// A named entry of a kubeconfig list (`cluster:`, `user:` or `context:`, by list).
#[derive(Debug, Clone)]
pub struct Named<T> {
    /// Its name.
    pub name: String,
    /// The entry.
    pub value: T,
}

/// A server.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Cluster {
    /// `https://HOST:PORT`.
    pub server: String,
    /// The server's CA, PEM, base64.
    #[serde(default)]
    pub certificate_authority_data: Option<String>,
}

/// A credential.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct User {
    /// The bearer token.
    #[serde(default)]
    pub token: Option<String>,
}

/// A context: a server and a credential, by name.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ContextRef {
    /// The cluster's name.
    pub cluster: String,
    /// The user's name.
    pub user: String,
}

/// One context, resolved: where, trusting what, as whom.
#[derive(Clone)]
pub struct Context {
    /// Its name.
    pub name: String,
    /// `https://HOST:PORT`.
    pub server: String,
    /// The server's CA (PEM).
    pub ca_pem: Vec<u8>,
    /// The bearer token.
    pub token: String,
    /// This machine's folder for it.
    pub home: PathBuf,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the token
        f.debug_struct("Context")
            .field("name", &self.name)
            .field("server", &self.server)
            .field("home", &self.home)
            .finish_non_exhaustive()
    }
}

/// The list entries serialize as kubeconfig writes them: `cluster:`, `user:`, `context:`.
#[derive(Serialize, Deserialize)]
struct Wire {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    clusters: Vec<WireCluster>,
    #[serde(default)]
    users: Vec<WireUser>,
    #[serde(default)]
    contexts: Vec<WireContext>,
    #[serde(
        rename = "current-context",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    current_context: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct WireCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Serialize, Deserialize)]
struct WireUser {
    name: String,
    user: User,
}

#[derive(Serialize, Deserialize)]
struct WireContext {
    name: String,
    context: ContextRef,
}

/// Parse a kubeconfig's text.
pub fn parse(text: &str, what: &str) -> Result<Kubeconfig> {
    let w: Wire = serde_saphyr::from_str(text)
        .map_err(|e| VerbError::invalid(format!("{what} is not a kubeconfig: {e}")))?;
    Ok(Kubeconfig {
        api_version: w.api_version,
        kind: w.kind,
        clusters: w
            .clusters
            .into_iter()
            .map(|c| Named {
                name: c.name,
                value: c.cluster,
            })
            .collect(),
        users: w
            .users
            .into_iter()
            .map(|u| Named {
                name: u.name,
                value: u.user,
            })
            .collect(),
        contexts: w
            .contexts
            .into_iter()
            .map(|c| Named {
                name: c.name,
                value: c.context,
            })
            .collect(),
        current_context: w.current_context,
    })
}

/// A kubeconfig's text.
pub fn render(k: &Kubeconfig) -> String {
    let w = Wire {
        api_version: "v1".into(),
        kind: "Config".into(),
        clusters: k
            .clusters
            .iter()
            .map(|c| WireCluster {
                name: c.name.clone(),
                cluster: c.value.clone(),
            })
            .collect(),
        users: k
            .users
            .iter()
            .map(|u| WireUser {
                name: u.name.clone(),
                user: u.value.clone(),
            })
            .collect(),
        contexts: k
            .contexts
            .iter()
            .map(|c| WireContext {
                name: c.name.clone(),
                context: c.value.clone(),
            })
            .collect(),
        current_context: k.current_context.clone(),
    };
    serde_saphyr::to_string(&w).expect("a kubeconfig serializes")
}

/// The contexts of `home` (none when it has no file).
pub fn load(home: &Path) -> Result<Kubeconfig> {
    let f = file(home);
    match std::fs::read_to_string(&f) {
        Ok(text) => parse(&text, &f.display().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Kubeconfig::default()),
        Err(e) => Err(VerbError::failed(format!(
            "cannot read {}: {e}",
            f.display()
        ))),
    }
}

/// Write the contexts of `home` (0600, whole or not at all).
pub fn save(home: &Path, k: &Kubeconfig) -> Result {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(home)
        .map_err(|e| VerbError::failed(format!("cannot create {}: {e}", home.display())))?;
    let f = file(home);
    let tmp = f.with_extension(format!("tmp{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut out| out.write_all(render(k).as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, &f));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(VerbError::failed(format!(
            "cannot write {}: {e}",
            f.display()
        )));
    }
    Ok(())
}

/// Whether `name` can name a context: a DNS label (it names a folder), and not `local`.
fn check_name(name: &str) -> Result {
    if name == LOCAL {
        return Err(VerbError::invalid(
            "`local` is this home's own store, not a context: pick another name",
        ));
    }
    boxery_api::Name::label(name).map_err(|e| {
        VerbError::invalid(format!(
            "context name {}: {}",
            boxery_api::name::shown(name),
            e.0
        ))
    })?;
    Ok(())
}

/// Add (or replace) context `name` from a kubeconfig's text (`boxery kubeconfig` on the VM
/// host prints one): its current context, or its only one. Returns the server.
pub fn add(home: &Path, name: &str, text: &str, what: &str) -> Result<String> {
    check_name(name)?;
    let given = parse(text, what)?;
    let pick = match &given.current_context {
        Some(c) => given.contexts.iter().find(|x| &x.name == c),
        None if given.contexts.len() == 1 => given.contexts.first(),
        None => None,
    }
    .ok_or_else(|| {
        VerbError::invalid(format!(
            "{what} has {} contexts and no current-context: give a file with one (`boxery kubeconfig` prints one)",
            given.contexts.len()
        ))
    })?;
    let cluster = given
        .clusters
        .iter()
        .find(|c| c.name == pick.value.cluster)
        .ok_or_else(|| {
            VerbError::invalid(format!(
                "{what}: context {} names cluster {}, which it does not hold",
                pick.name, pick.value.cluster
            ))
        })?;
    let user = given
        .users
        .iter()
        .find(|u| u.name == pick.value.user)
        .ok_or_else(|| {
            VerbError::invalid(format!(
                "{what}: context {} names user {}, which it does not hold",
                pick.name, pick.value.user
            ))
        })?;
    if !cluster.value.server.starts_with("https://") {
        return Err(VerbError::invalid(format!(
            "{what}: the server {} is not https://: boxery's API is always TLS",
            cluster.value.server
        )));
    }
    if cluster.value.certificate_authority_data.is_none() {
        return Err(VerbError::invalid(format!(
            "{what}: no certificate-authority-data: boxery trusts a context's own CA only (`boxery kubeconfig` puts it inline)"
        )));
    }
    if user.value.token.as_deref().is_none_or(str::is_empty) {
        return Err(VerbError::invalid(format!(
            "{what}: user {} has no token (`boxery kubeconfig` on the VM host makes one)",
            user.name
        )));
    }
    let mut k = load(home)?;
    k.clusters.retain(|c| c.name != name);
    k.users.retain(|u| u.name != name);
    k.contexts.retain(|c| c.name != name);
    k.clusters.push(Named {
        name: name.into(),
        value: cluster.value.clone(),
    });
    k.users.push(Named {
        name: name.into(),
        value: user.value.clone(),
    });
    k.contexts.push(Named {
        name: name.into(),
        value: ContextRef {
            cluster: name.into(),
            user: name.into(),
        },
    });
    save(home, &k)?;
    Ok(cluster.value.server.clone())
}

/// Make `name` the current context (`local`: this home's own store).
pub fn use_context(home: &Path, name: &str) -> Result {
    let mut k = load(home)?;
    if name == LOCAL {
        k.current_context = None;
    } else {
        if !k.contexts.iter().any(|c| c.name == name) {
            return Err(unknown(&k, name));
        }
        k.current_context = Some(name.into());
    }
    save(home, &k)
}

/// Remove context `name` and its folder.
pub fn remove(home: &Path, name: &str) -> Result {
    let mut k = load(home)?;
    if !k.contexts.iter().any(|c| c.name == name) {
        return Err(unknown(&k, name));
    }
    check_name(name)?;
    k.clusters.retain(|c| c.name != name);
    k.users.retain(|u| u.name != name);
    k.contexts.retain(|c| c.name != name);
    if k.current_context.as_deref() == Some(name) {
        k.current_context = None;
    }
    save(home, &k)?;
    let d = dir(home, name);
    if d.exists() {
        std::fs::remove_dir_all(&d)
            .map_err(|e| VerbError::failed(format!("cannot remove {}: {e}", d.display())))?;
    }
    Ok(())
}

fn unknown(k: &Kubeconfig, name: &str) -> VerbError {
    let names: Vec<&str> = k.contexts.iter().map(|c| c.name.as_str()).collect();
    VerbError::not_found(format!(
        "no context {}: {} (`boxery config add-context NAME -f KUBECONFIG` adds one)",
        boxery_api::name::shown(name),
        if names.is_empty() {
            "this home has none".to_string()
        } else {
            format!("known: {}, and {LOCAL}", names.join(", "))
        }
    ))
}

/// The context a command works on: `named` (`--context`, `BOXERY_CONTEXT`), else the
/// current one; `None` for this home's own store.
pub fn resolve(home: &Path, named: Option<&str>) -> Result<Option<Context>> {
    let k = load(home)?;
    let name = match named.filter(|n| !n.is_empty()) {
        Some(n) => n.to_string(),
        None => match &k.current_context {
            Some(c) => c.clone(),
            None => return Ok(None),
        },
    };
    if name == LOCAL {
        return Ok(None);
    }
    // the name goes into ssh's ProxyCommand and a folder: a hand-edited file is checked too
    check_name(&name)?;
    let c = k
        .contexts
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| unknown(&k, &name))?;
    let broken = |what: &str| {
        VerbError::invalid(format!(
            "context {name} in {} names {what}, which the file does not hold: add it again (`boxery config add-context {name} -f KUBECONFIG`)",
            file(home).display()
        ))
    };
    let cluster = k
        .clusters
        .iter()
        .find(|x| x.name == c.value.cluster)
        .ok_or_else(|| broken("a cluster"))?;
    let user = k
        .users
        .iter()
        .find(|x| x.name == c.value.user)
        .ok_or_else(|| broken("a user"))?;
    let ca = cluster
        .value
        .certificate_authority_data
        .as_deref()
        .ok_or_else(|| broken("a CA"))?;
    let ca_pem = base64::engine::general_purpose::STANDARD
        .decode(ca.trim())
        .map_err(|_| broken("a CA that is not base64"))?;
    let token = user.value.token.clone().ok_or_else(|| broken("a token"))?;
    check_name(&name)?;
    Ok(Some(Context {
        home: dir(home, &name),
        name,
        server: cluster.value.server.trim_end_matches('/').to_string(),
        ca_pem,
        token,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: boxery\n  cluster:\n    server: https://127.0.0.1:7443\n    certificate-authority-data: UEVN\nusers:\n- name: me\n  user:\n    token: secret\ncontexts:\n- name: boxery\n  context:\n    cluster: boxery\n    user: me\ncurrent-context: boxery\n";

    #[test]
    fn a_kubeconfig_becomes_a_context_and_the_current_one_is_used() {
        let home = tempfile::tempdir().unwrap();
        assert!(resolve(home.path(), None).unwrap().is_none());
        let server = add(home.path(), "vmhost", KUBECONFIG, "the file").unwrap();
        assert_eq!(server, "https://127.0.0.1:7443");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(file(home.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // named: used; not current yet
        let c = resolve(home.path(), Some("vmhost")).unwrap().unwrap();
        assert_eq!(
            (c.token.as_str(), c.ca_pem.as_slice()),
            ("secret", &b"PEM"[..])
        );
        assert!(!format!("{c:?}").contains("secret"));
        assert!(resolve(home.path(), None).unwrap().is_none());
        use_context(home.path(), "vmhost").unwrap();
        assert_eq!(resolve(home.path(), None).unwrap().unwrap().name, "vmhost");
        assert!(resolve(home.path(), Some(LOCAL)).unwrap().is_none());
        // kubectl reads the same file
        let again = parse(&std::fs::read_to_string(file(home.path())).unwrap(), "x").unwrap();
        assert_eq!(again.current_context.as_deref(), Some("vmhost"));
        let e = resolve(home.path(), Some("other")).unwrap_err().to_string();
        assert!(e.contains("known: vmhost, and local"), "{e}");
        // a name edited into the file by hand that no command would take (it reaches ssh's
        // ProxyCommand) is refused when used
        let text = std::fs::read_to_string(file(home.path())).unwrap();
        std::fs::write(file(home.path()), text.replace("vmhost", "vm;touch x")).unwrap();
        let e = resolve(home.path(), None).unwrap_err().to_string();
        assert!(e.contains("vm;touch x"), "{e}");
        std::fs::write(file(home.path()), text).unwrap();
        remove(home.path(), "vmhost").unwrap();
        assert!(resolve(home.path(), None).unwrap().is_none());
    }

    #[test]
    fn a_context_needs_tls_a_ca_and_a_token() {
        let home = tempfile::tempdir().unwrap();
        let plain = KUBECONFIG.replace("https://", "http://");
        assert!(
            add(home.path(), "a", &plain, "f")
                .unwrap_err()
                .to_string()
                .contains("always TLS")
        );
        let no_ca = KUBECONFIG.replace("    certificate-authority-data: UEVN\n", "");
        assert!(add(home.path(), "a", &no_ca, "f").is_err());
        let no_token = KUBECONFIG.replace("    token: secret\n", "    username: x\n");
        assert!(
            add(home.path(), "a", &no_token, "f")
                .unwrap_err()
                .to_string()
                .contains("no token")
        );
        assert!(add(home.path(), "local", KUBECONFIG, "f").is_err());
        assert!(add(home.path(), "../x", KUBECONFIG, "f").is_err());
    }
}
