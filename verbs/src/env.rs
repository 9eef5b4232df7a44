//! Where boxery keeps its state, which backend it drives, and opening both.
//!
//! Everything lives under `$BOXERY_HOME` (default `$XDG_DATA_HOME/boxery`, else
//! `~/.local/share/boxery`): `store.db` (the object store), one folder per backend, and
//! `config.yaml` (`backend: NAME`). The backend is chosen by `--backend`, then
//! `BOXERY_BACKEND`, then `config.yaml`, then the default.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use boxery_api::Resource as _;
use boxery_backends::Backend;
use boxery_store::{ObjectStore, ObjectStoreExt, Store};
use boxery_store_etcd::{EtcdConfig, EtcdStore};

use crate::error::{ErrorKind, Result, VerbError};

/// The homes this process has opened a store in.
static OPENED_HOMES: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Say `line` ([`crate::notes::say`]) once per home in this process.
fn note_once(home: &Path, line: String) {
    static SAID: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    if SAID
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(home.to_path_buf())
    {
        crate::notes::say(&line);
    }
}

/// The default backend when nothing selects one: `qemu` (direct QEMU, no daemon). Its
/// `check` says what to install when QEMU is missing; `--backend fake` runs without VMs.
pub fn default_backend() -> &'static str {
    "qemu"
}

/// The resolved environment of one command.
#[derive(Debug, Clone)]
pub struct Env {
    /// `$BOXERY_HOME`.
    pub home: PathBuf,
    /// The backend's name.
    pub backend_name: String,
    /// How to run the controllers in this process while nothing leads the store (a wait's
    /// embedded mode): given by the composition root; `None` waits on the store only.
    pub control: Option<Arc<dyn crate::control::ControlPlane>>,
}

impl Env {
    /// The environment of home `home` and backend `backend_name`, with no
    /// [`control`](Env::control) (see [`Env::with_control`]).
    pub fn new(home: PathBuf, backend_name: impl Into<String>) -> Env {
        Env {
            home,
            backend_name: backend_name.into(),
            control: None,
        }
    }

    /// This environment, able to run the controllers here through `control`.
    pub fn with_control(self, control: Arc<dyn crate::control::ControlPlane>) -> Env {
        Env {
            control: Some(control),
            ..self
        }
    }

    /// Resolve from flags, environment and config.
    pub fn resolve(home: Option<PathBuf>, backend: Option<String>) -> Result<Env> {
        let home = match home {
            Some(h) => h,
            None => {
                let data = std::env::var_os("XDG_DATA_HOME")
                    .map(PathBuf::from)
                    .filter(|p| p.is_absolute())
                    .or_else(|| {
                        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share"))
                    })
                    .ok_or_else(|| {
                        VerbError::invalid("cannot find a home for boxery's state: set BOXERY_HOME")
                    })?;
                data.join("boxery")
            }
        };
        let backend_name = match backend {
            Some(b) => b,
            None => read_config_backend(&home)?.unwrap_or_else(|| default_backend().to_string()),
        };
        if !boxery_backends::BACKENDS.contains(&backend_name.as_str()) {
            return Err(VerbError::invalid(format!(
                "unknown backend `{backend_name}`: this build has {}",
                boxery_backends::BACKENDS.join(", ")
            )));
        }
        Ok(Env::new(home, backend_name))
    }

    /// Open (creating if needed) the store. A home this process already opened and that is
    /// gone now was removed under it: that is an error, not a new empty home (a long-running
    /// `mcp` or `serve` must not bring back a home that was deleted).
    ///
    /// The store is the home's SQLite file (`store.db`), or the etcd cluster `config.yaml`
    /// names (`store: {etcd: {endpoints: [HOST:PORT, …], prefix: /boxery}}`): the one place
    /// that chooses.
    pub fn store(&self) -> Result<Arc<dyn ObjectStore>> {
        let mut opened = OPENED_HOMES.lock().unwrap_or_else(|e| e.into_inner());
        if !self.home.exists() && opened.contains(&self.home) {
            return Err(VerbError::failed(format!(
                "boxery's home {} was removed while this process ran; not creating it again",
                self.home.display()
            )));
        }
        self.ensure_home()?;
        let store: Arc<dyn ObjectStore> = match read_config(&self.home)?.store.etcd {
            Some(etcd) => Arc::new(connect_etcd(&self.home, etcd.config(&self.home)?)?),
            None => Arc::new(Store::open(&boxery_home::layout::store(&self.home))?),
        };
        opened.insert(self.home.clone());
        Ok(store)
    }

    /// Whether this home's store is on etcd (`config.yaml`'s `store.etcd`), not its own file.
    pub fn store_on_etcd(&self) -> Result<bool> {
        Ok(read_config(&self.home)?.store.etcd.is_some())
    }

    /// Make `$BOXERY_HOME` private to its owner: created 0700 (whatever the umask), and an
    /// existing one of this user with access for others tightened to 0700 (with a note).
    /// Whoever can write the home controls every VM and reads every key in it, so a home of
    /// another user that others may write is refused (exit 2); one that is merely another
    /// user's gets a warning. Its parents are created as usual.
    pub fn ensure_home(&self) -> Result {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let home = &self.home;
        let shown = home.display();
        let private = std::fs::Permissions::from_mode(0o700);
        let meta = match std::fs::metadata(home) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(parent) = home.parent().filter(|p| !p.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        VerbError::caused(
                            ErrorKind::Failed,
                            format!(
                                "cannot create {}, the parent of boxery's home",
                                parent.display()
                            ),
                            e,
                        )
                    })?;
                }
                match std::fs::DirBuilder::new().mode(0o700).create(home) {
                    Ok(()) => {
                        std::fs::set_permissions(home, private).map_err(|e| {
                            VerbError::caused(
                                ErrorKind::Failed,
                                format!("cannot make boxery's home {shown} private"),
                                e,
                            )
                        })?;
                        return Ok(());
                    }
                    // Made by another process in between: check it as an existing one.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        std::fs::metadata(home).map_err(|e| {
                            VerbError::caused(
                                ErrorKind::Failed,
                                format!("cannot read boxery's home {shown}"),
                                e,
                            )
                        })?
                    }
                    Err(e) => {
                        return Err(VerbError::caused(
                            ErrorKind::Failed,
                            format!("cannot create boxery's home {shown}"),
                            e,
                        ));
                    }
                }
            }
            Err(e) => {
                return Err(VerbError::caused(
                    ErrorKind::Failed,
                    format!("cannot read boxery's home {shown}"),
                    e,
                ));
            }
        };
        if !meta.is_dir() {
            return Err(VerbError::invalid(format!(
                "boxery's home {shown} is not a directory: set BOXERY_HOME to a directory"
            )));
        }
        let mode = meta.permissions().mode() & 0o7777;
        let me = rustix::process::getuid().as_raw();
        if meta.uid() == me {
            if mode & 0o077 != 0 {
                match std::fs::set_permissions(home, private) {
                    Ok(()) => note_once(
                        home,
                        format!(
                            "boxery: made its home {shown} private (mode {mode:04o} -> 0700): it holds the store, keys and tokens"
                        ),
                    ),
                    Err(e) => note_once(
                        home,
                        format!(
                            "boxery: warning: other users may read or write its home {shown} (mode {mode:04o}) and it cannot be changed ({e}): `chmod 700 {shown}`"
                        ),
                    ),
                }
            }
        } else if mode & 0o022 != 0 {
            return Err(VerbError::invalid(format!(
                "boxery's home {shown} belongs to uid {} and others may write it (mode {mode:04o}): whoever can write it controls every VM. Use a home of your own (BOXERY_HOME), or have its owner `chmod 700 {shown}`",
                meta.uid()
            )));
        } else {
            note_once(
                home,
                format!(
                    "boxery: warning: its home {shown} belongs to uid {}, not to you (uid {me}): that user controls every VM in it",
                    meta.uid()
                ),
            );
        }
        Ok(())
    }

    /// The backend.
    pub fn backend(&self) -> Result<Arc<dyn Backend>> {
        boxery_backends::by_name(&self.backend_name, &self.home).map_err(VerbError::invalid)
    }

    /// An error when `kind` `name`'s status says it lives on another backend than the one
    /// selected: one home drives one backend.
    fn elsewhere(&self, kind: &str, name: &str, on: &Option<String>) -> Option<VerbError> {
        let selected = self.backend_name.as_str();
        on.as_deref().filter(|b| *b != selected).map(|b| {
            VerbError::invalid(format!(
                "{kind} {name} in {} lives on the `{b}` backend, not `{selected}`: one home \
                 drives one backend. Use another BOXERY_HOME for `{selected}`, or select \
                 `{b}` again (--backend, BOXERY_BACKEND or config.yaml)",
                self.home.display()
            ))
        })
    }

    /// The backend VM `vm` lives on: the selected one, unless its status names another.
    pub fn backend_of(&self, vm: &boxery_api::Vm) -> Result<Arc<dyn Backend>> {
        match self.elsewhere("Vm", vm.name(), &vm.status.backend) {
            Some(e) => Err(e),
            None => self.backend(),
        }
    }

    /// The backend, once the store's VMs and images are known to live on it. One home drives
    /// one backend: controllers on another would find every VM missing and mark it `Lost`.
    pub async fn backend_for(&self, store: &dyn ObjectStore) -> Result<Arc<dyn Backend>> {
        let all = boxery_api::Selector::default();
        for vm in store.list_as::<boxery_api::Vm>(&all).await? {
            if let Some(e) = self.elsewhere("Vm", vm.name(), &vm.status.backend) {
                return Err(e);
            }
        }
        for img in store.list_as::<boxery_api::Image>(&all).await? {
            if let Some(e) = self.elsewhere("Image", img.name(), &img.status.backend) {
                return Err(e);
            }
        }
        self.backend()
    }
}

/// `$BOXERY_HOME/config.yaml`: the owner's settings.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// The backend (`--backend` and `BOXERY_BACKEND` win).
    pub backend: Option<String>,
    /// Directories an Image's `source.file` may import from, besides `$BOXERY_HOME/imports`.
    /// Absolute paths.
    #[serde(default)]
    pub import_roots: Vec<PathBuf>,
    /// Grants (`grants: {confirm: false}` turns off the typed `yes` of `grant approve|deny`).
    #[serde(default)]
    pub grants: GrantsConfig,
    /// The credential proxy (`proxy: {upstreams: {NAME: URL}, hosts: {HOST: URL}, limits: …}`).
    #[serde(default)]
    pub proxy: boxery_api::config::ProxyConfig,
    /// Memory files (`memory: {quota: 20Gi}`: the most the saved memory of suspended VMs and
    /// memory images may take together; docs/live-memory.md).
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Where the objects live (`store: {etcd: …}`; docs/scale-out.md). Absent: the home's
    /// SQLite file.
    #[serde(default)]
    pub store: StoreConfig,
}

/// `memory:` in `config.yaml`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryConfig {
    /// The most bytes memory files may take (`20Gi`); none: no limit.
    #[serde(default)]
    pub quota: Option<boxery_api::Quantity>,
}

/// `grants:` in `config.yaml`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GrantsConfig {
    /// Whether `boxery grant approve|deny` (and the `grant` sugar) ask for a typed `yes` on
    /// the terminal (default true). Only the owner's config turns it off: no flag, no
    /// environment variable.
    #[serde(default = "yes")]
    pub confirm: bool,
}

impl Default for GrantsConfig {
    fn default() -> Self {
        GrantsConfig { confirm: true }
    }
}

fn yes() -> bool {
    true
}

/// Connect to the store on etcd (from a thread of its own: callers may be inside a runtime).
fn connect_etcd(home: &Path, config: EtcdConfig) -> Result<EtcdStore> {
    let shown = config.endpoints.join(", ");
    let tls_flags = if config.tls.is_some() {
        " --cacert CA --cert CERT --key KEY (the files of store.etcd.tls)"
    } else {
        ""
    };
    // A member that wants what this client does not offer closes the connection: say what
    // to set, as the transport's error cannot.
    let ask = match &config.tls {
        None => {
            " A cluster that speaks TLS closes a plain connection: then set store.etcd.tls (docs/scale-out.md)."
        }
        Some(t) if t.identity.is_none() => {
            " A cluster started with --client-cert-auth closes a connection without a client certificate: then set store.etcd.tls.cert and key."
        }
        Some(_) => "",
    };
    let c = config.clone();
    std::thread::spawn(move || futures::executor::block_on(EtcdStore::connect(&c)))
        .join()
        .map_err(|_| VerbError::failed("connecting to etcd failed"))?
        .map_err(|e| {
            VerbError::failed(format!(
                "cannot reach the store on etcd at {shown} ({}: store.etcd): {}. Is the cluster up? `etcdctl --endpoints {}{tls_flags} endpoint health` tells.{ask}",
                boxery_home::layout::config(home).display(),
                crate::error::chain(&e),
                config.endpoints.join(",")
            ))
        })
}

/// `store:` in `config.yaml`: where the objects live. Absent: the home's SQLite file.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StoreConfig {
    /// An etcd cluster (`etcd: {endpoints: [10.0.0.1:2379, …], prefix: /boxery}`).
    #[serde(default)]
    pub etcd: Option<EtcdSection>,
}

/// `store.etcd:` in `config.yaml`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EtcdSection {
    /// Each member's client address: `HOST:PORT` or `http://HOST:PORT`.
    pub endpoints: Vec<String>,
    /// The prefix of every key the store writes (default `/boxery`): several control planes
    /// may share a cluster under different prefixes.
    #[serde(default)]
    pub prefix: Option<String>,
    /// TLS to the members (`tls: {ca: PATH, cert: PATH, key: PATH}`; paths relative to the
    /// home): the endpoints are then `https://`.
    #[serde(default)]
    pub tls: Option<EtcdTlsSection>,
}

/// `store.etcd.tls:` in `config.yaml`: PEM files.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EtcdTlsSection {
    /// The CA certificate that signed the members' certificates (etcd's `--trusted-ca-file`
    /// on their side).
    pub ca: PathBuf,
    /// This client's certificate, for a cluster started with `--client-cert-auth`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Its private key.
    #[serde(default)]
    pub key: Option<PathBuf>,
}

impl EtcdTlsSection {
    /// The PEM texts, each file read (relative to `home`).
    fn read(&self, home: &Path) -> Result<boxery_store_etcd::EtcdTls> {
        let read = |what: &str, p: &Path| {
            let path = home.join(p);
            std::fs::read_to_string(&path).map_err(|e| {
                VerbError::invalid(format!(
                    "config.yaml: store.etcd.tls.{what}: cannot read {}: {e}",
                    path.display()
                ))
            })
        };
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((read("cert", c)?, read("key", k)?)),
            (None, None) => None,
            _ => {
                return Err(VerbError::invalid(
                    "config.yaml: store.etcd.tls: cert and key go together (this client's certificate and its private key): give both or neither",
                ));
            }
        };
        Ok(boxery_store_etcd::EtcdTls {
            ca: read("ca", &self.ca)?,
            identity,
        })
    }
}

impl EtcdSection {
    /// The store's address as the etcd store takes it (TLS files read relative to `home`).
    pub fn config(&self, home: &Path) -> Result<EtcdConfig> {
        if self.endpoints.is_empty() {
            return Err(VerbError::invalid(
                "config.yaml: store.etcd.endpoints is empty: list each member's HOST:PORT",
            ));
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoints = Vec::new();
        for e in &self.endpoints {
            let host = match e.split_once("://") {
                Some((s, host)) if s == scheme => host,
                Some(("https", _)) => {
                    return Err(VerbError::invalid(format!(
                        "config.yaml: store.etcd.endpoints: {e} is TLS: give the CA that signed the members' certificates in store.etcd.tls.ca (and cert and key where the cluster asks for a client certificate)"
                    )));
                }
                Some(("http", _)) => {
                    return Err(VerbError::invalid(format!(
                        "config.yaml: store.etcd.endpoints: {e} is plain http while store.etcd.tls is set: write HOST:PORT or https://HOST:PORT"
                    )));
                }
                Some(_) => {
                    return Err(VerbError::invalid(format!(
                        "config.yaml: store.etcd.endpoints: {e:?} is not HOST:PORT"
                    )));
                }
                None => e.as_str(),
            };
            if host.is_empty() || host.contains('/') || !host.contains(':') {
                return Err(VerbError::invalid(format!(
                    "config.yaml: store.etcd.endpoints: {e:?} is not HOST:PORT"
                )));
            }
            endpoints.push(format!("{scheme}://{host}"));
        }
        let tls = self.tls.as_ref().map(|t| t.read(home)).transpose()?;
        let prefix = self
            .prefix
            .as_deref()
            .unwrap_or("/boxery")
            .trim_matches('/');
        if prefix.is_empty() {
            return Err(VerbError::invalid(
                "config.yaml: store.etcd.prefix may not be empty or `/`: the store's keys need a prefix of their own",
            ));
        }
        Ok(EtcdConfig {
            endpoints,
            prefix: format!("/{prefix}"),
            tls,
        })
    }
}

/// Read `config.yaml` (all defaults when there is none).
pub fn read_config(home: &Path) -> Result<Config> {
    let path = boxery_home::layout::config(home);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
        Err(e) => {
            return Err(VerbError::failed(format!(
                "cannot read {}: {e}",
                path.display()
            )));
        }
    };
    let cfg: Config = serde_saphyr::from_str(&text)
        .map_err(|e| VerbError::invalid(format!("{}: {e}", path.display())))?;
    if let Some(r) = cfg.import_roots.iter().find(|r| !r.is_absolute()) {
        return Err(VerbError::invalid(format!(
            "{}: importRoots: `{}` is not an absolute path",
            path.display(),
            r.display()
        )));
    }
    Ok(cfg)
}

fn read_config_backend(home: &Path) -> Result<Option<String>> {
    Ok(read_config(home)?.backend)
}

#[cfg(test)]
mod tests {
    use super::Env;

    #[test]
    fn a_home_removed_under_the_process_is_not_created_again() {
        let dir = tempfile::tempdir().unwrap();
        let env = Env::new(dir.path().join("home"), "fake");
        drop(env.store().expect("a new home is created"));
        drop(env.store().expect("and opened again"));
        std::fs::remove_dir_all(&env.home).unwrap();
        let err = env.store().expect_err("removed under this process");
        assert!(err.to_string().contains("was removed"), "{err:?}");
        assert!(!env.home.exists(), "not created again");
    }
}
