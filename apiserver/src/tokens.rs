//! The API's bearer tokens: `$BOXERY_HOME/api/tokens.json` (0600), one entry per token with
//! its name, [`Scope`] and the SHA-256 of its secret (never the secret: `boxery kubeconfig`
//! prints it once). The file is read again whenever it changes, so a revoked token stops
//! working on its next request.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a token may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Read every object: get, list, watch.
    Read,
    /// Everything the API serves.
    Full,
    /// The objects of one lease: the Lease itself and the VM it holds (read, change, run
    /// commands in it), and their events; nothing else.
    Lease(String),
}

impl Scope {
    /// `read`, `full` or `lease:NAME`.
    pub fn parse(s: &str) -> Result<Scope, String> {
        match s {
            "read" => Ok(Scope::Read),
            "full" => Ok(Scope::Full),
            _ => match s.strip_prefix("lease:") {
                Some(name) => boxery_api::Name::for_kind(
                    &<boxery_api::Lease as boxery_api::Resource>::INFO,
                    name,
                )
                .map(|_| Scope::Lease(name.to_string()))
                .map_err(|e| format!("lease:{name}: {}", e.0)),
                None => Err(format!(
                    "`{s}` is not a scope: use read, full or lease:NAME"
                )),
            },
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Read => f.write_str("read"),
            Scope::Full => f.write_str("full"),
            Scope::Lease(l) => write!(f, "lease:{l}"),
        }
    }
}

/// One token as the file keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// Its name (`boxery kubeconfig --name`), unique.
    pub name: String,
    /// `read`, `full` or `lease:NAME`.
    pub scope: String,
    /// Hex SHA-256 of the secret.
    pub sha256: String,
    /// RFC 3339.
    pub created: String,
}

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's name.
    pub name: String,
    /// What it may do.
    pub scope: Scope,
    /// The SHA-256 of its secret: which token it is ([`Tokens::holds`]), even when one of
    /// the same name is made after this one was revoked.
    hash: String,
}

/// Where the tokens file is.
pub fn file(home: &Path) -> PathBuf {
    boxery_home::layout::api_tokens(home)
}

fn hash(secret: &str) -> String {
    let d = Sha256::digest(secret.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Read the entries (none when the file does not exist).
pub fn read(home: &Path) -> std::io::Result<Vec<Entry>> {
    match std::fs::read(file(home)) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is not a token list: {e}", file(home).display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn write(home: &Path, entries: &[Entry]) -> std::io::Result<()> {
    let path = file(home);
    let dir = path.parent().expect("tokens.json has a parent");
    boxery_home::private::dir(dir)?;
    let text = serde_json::to_vec_pretty(entries).map_err(std::io::Error::other)?;
    boxery_home::private::write(&path, &text, true)
}

/// Make a token named `name` (unique) with `scope`; the secret is returned, never kept.
pub fn mint(home: &Path, name: &str, scope: &Scope) -> std::io::Result<String> {
    let _lock = FileLock::take(home)?;
    let mut entries = read(home)?;
    if entries.iter().any(|e| e.name == name) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "a token named {name} exists: pick another --name, or revoke it first (boxery kubeconfig --revoke {name})"
            ),
        ));
    }
    let mut raw = [0u8; 32];
    rand::fill(&mut raw);
    let secret = format!(
        "bxa_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    );
    entries.push(Entry {
        name: name.to_string(),
        scope: scope.to_string(),
        sha256: hash(&secret),
        created: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    });
    write(home, &entries)?;
    Ok(secret)
}

/// Remove the token named `name`, and the ssh keys it logged in to VMs from the keys every
/// new VM gets; whether it existed.
pub fn revoke(home: &Path, name: &str) -> std::io::Result<bool> {
    let _lock = FileLock::take(home)?;
    let mut entries = read(home)?;
    let before = entries.len();
    entries.retain(|e| e.name != name);
    if entries.len() == before {
        return Ok(false);
    }
    write(home, &entries)?;
    boxery_hands::ssh::SshDir::new(home)
        .remove_remote_keys(&key_comment(name))
        .map_err(std::io::Error::other)?;
    Ok(true)
}

/// The comment of the ssh keys token `name` logs in to VMs (`boxery connect`).
pub fn key_comment(name: &str) -> String {
    format!("boxery-api:{name}")
}

/// Serialises writers of the tokens file (two `kubeconfig` runs at once).
struct FileLock {
    _held: std::fs::File,
}

impl FileLock {
    fn take(home: &Path) -> std::io::Result<FileLock> {
        let dir = boxery_home::layout::api(home);
        boxery_home::private::dir(&dir)?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("tokens.lock"))?;
        f.lock()?;
        Ok(FileLock { _held: f })
    }
}

/// The tokens as the server checks them: read again when the file changes (every write is a
/// new file renamed into place, so its inode changes even within one clock tick).
#[derive(Debug)]
pub struct Tokens {
    home: PathBuf,
    cache: Mutex<(Option<Stamp>, Vec<Entry>)>,
}

/// A file's inode, modification time and size: when any changes, it is read again.
type Stamp = (u64, SystemTime, u64);

impl Tokens {
    /// The tokens of `home`.
    pub fn new(home: &Path) -> Tokens {
        Tokens {
            home: home.to_path_buf(),
            cache: Mutex::new((None, Vec::new())),
        }
    }

    /// Who presents `secret`, if anyone. A file that cannot be read admits no one.
    pub fn check(&self, secret: &str) -> Option<Caller> {
        let h = hash(secret);
        self.with_entries(|entries| {
            let e = entries.iter().find(|e| e.sha256 == h)?;
            Some(Caller {
                name: e.name.clone(),
                scope: Scope::parse(&e.scope).ok()?,
                hash: h.clone(),
            })
        })
    }

    /// Whether `caller`'s token still exists, with the same scope: what a stream that
    /// outlives its request (a watch) asks again, so that revoking a token ends it.
    pub fn holds(&self, caller: &Caller) -> bool {
        self.with_entries(|entries| {
            entries
                .iter()
                .any(|e| {
                    e.sha256 == caller.hash
                        && e.name == caller.name
                        && Scope::parse(&e.scope).is_ok_and(|s| s == caller.scope)
                })
                .then_some(())
        })
        .is_some()
    }

    /// `f` of the entries as the file holds them now (read again when it changed); `None`
    /// when the file cannot be read.
    fn with_entries<T>(&self, f: impl FnOnce(&[Entry]) -> Option<T>) -> Option<T> {
        let stamp = std::fs::metadata(file(&self.home)).ok().and_then(|m| {
            use std::os::unix::fs::MetadataExt;
            Some((m.ino(), m.modified().ok()?, m.len()))
        });
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if c.0 != stamp || stamp.is_none() {
            match read(&self.home) {
                Ok(entries) => *c = (stamp, entries),
                Err(e) => {
                    tracing::warn!(error = %e, "API tokens unreadable: every request is refused");
                    *c = (None, Vec::new());
                    return None;
                }
            }
        }
        f(&c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_tokens_are_checked_and_revoked() {
        let d = tempfile::tempdir().unwrap();
        let t = Tokens::new(d.path());
        let s = mint(d.path(), "ro", &Scope::Read).unwrap();
        assert!(s.starts_with("bxa_"));
        assert_eq!(t.check(&s).unwrap().scope, Scope::Read);
        assert_eq!(t.check("bxa_nope"), None);
        let text = std::fs::read_to_string(file(d.path())).unwrap();
        assert!(!text.contains(&s), "the secret is never kept");
        assert!(mint(d.path(), "ro", &Scope::Full).is_err());
        let l = mint(d.path(), "l1", &Scope::Lease("a".into())).unwrap();
        assert_eq!(t.check(&l).unwrap().scope, Scope::Lease("a".into()));
        let ro = t.check(&s).unwrap();
        assert!(t.holds(&ro));
        assert!(revoke(d.path(), "ro").unwrap());
        assert_eq!(t.check(&s), None);
        assert!(!t.holds(&ro), "a revoked token is not held");
        assert!(!revoke(d.path(), "ro").unwrap());
        mint(d.path(), "ro", &Scope::Read).unwrap();
        assert!(!t.holds(&ro), "nor when another of its name is made");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(file(d.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn scopes_parse() {
        assert_eq!(Scope::parse("read").unwrap(), Scope::Read);
        assert_eq!(Scope::parse("lease:l-1").unwrap().to_string(), "lease:l-1");
        assert!(Scope::parse("admin").is_err());
        assert!(Scope::parse("lease:../x").is_err());
    }
}
