//! Who is asking: the token a request carries (where clients put it) and the index from
//! tokens to VMs over the token store (`boxery_home::tokens`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use axum::http::HeaderMap;

/// The token the client sent: `x-boxery-token`, `x-api-key`, `Authorization: Bearer T`, or
/// the password of `Authorization: Basic` (git's credential helpers).
pub(crate) fn token_of(h: &HeaderMap) -> Option<String> {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(t) = get("x-boxery-token").or_else(|| get("x-api-key")) {
        return Some(t.to_string());
    }
    credential(get("authorization")?)
}

/// The token in an `Authorization`-style value: `Bearer T`, or the password of `Basic`.
pub(crate) fn credential(value: &str) -> Option<String> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.trim().to_string());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        return text.split_once(':').map(|(_, p)| p.to_string());
    }
    None
}

/// Token → VM, from the token store. A hit is always confirmed against the VM's file.
#[derive(Debug)]
pub(crate) struct TokenIndex {
    home: PathBuf,
    index: Mutex<Index>,
}

#[derive(Debug, Default)]
struct Index {
    by_token: HashMap<String, String>,
    scanned: Option<Instant>,
    dir_mtime: Option<SystemTime>,
}

/// The shortest time between two rescans for unknown tokens when the directory did not change.
const RESCAN_EVERY: Duration = Duration::from_millis(250);

impl TokenIndex {
    pub(crate) fn new(home: &Path) -> Self {
        TokenIndex {
            home: home.to_path_buf(),
            index: Mutex::default(),
        }
    }

    /// The VM and owner whose live token `token` is.
    pub(crate) fn lookup(&self, token: &str) -> Option<(String, String)> {
        if token.is_empty() || token.len() > 512 {
            return None;
        }
        let known = |ix: &Self| {
            ix.index
                .lock()
                .expect("not poisoned")
                .by_token
                .get(token)
                .cloned()
        };
        let vm = match known(self) {
            Some(vm) => vm,
            None => {
                self.rescan();
                known(self)?
            }
        };
        boxery_home::tokens::matches(&self.home, &vm, token).map(|owner| (vm, owner))
    }

    fn rescan(&self) {
        let dir = boxery_home::layout::tokens(&self.home);
        let mtime = std::fs::metadata(&dir).and_then(|m| m.modified()).ok();
        {
            let ix = self.index.lock().expect("not poisoned");
            if ix.dir_mtime == mtime && ix.scanned.is_some_and(|t| t.elapsed() < RESCAN_EVERY) {
                return;
            }
        }
        let mut by_token = HashMap::new();
        for vm in boxery_home::tokens::vms(&self.home) {
            if let Some((_, t)) = boxery_home::tokens::read(&self.home, &vm) {
                by_token.insert(t, vm);
            }
        }
        let mut ix = self.index.lock().expect("not poisoned");
        *ix = Index {
            by_token,
            scanned: Some(Instant::now()),
            dir_mtime: mtime,
        };
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn finds_the_token_where_clients_put_it() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("bxt_a"));
        assert_eq!(token_of(&h).as_deref(), Some("bxt_a"));
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer bxt_b"));
        assert_eq!(token_of(&h).as_deref(), Some("bxt_b"));
        let mut h = HeaderMap::new();
        // base64("x:bxt_c")
        h.insert(
            "authorization",
            HeaderValue::from_static("Basic eDpieHRfYw=="),
        );
        assert_eq!(token_of(&h).as_deref(), Some("bxt_c"));
        assert_eq!(token_of(&HeaderMap::new()), None);
    }

    #[test]
    fn index_follows_the_token_files() {
        let d = tempfile::tempdir().unwrap();
        let ix = TokenIndex::new(d.path());
        assert_eq!(ix.lookup("bxt_1"), None);
        boxery_home::tokens::write(d.path(), "a", "uid-a", "bxt_1").unwrap();
        // A new token is found at once (the directory changed).
        assert_eq!(ix.lookup("bxt_1"), Some(("a".into(), "uid-a".into())));
        std::fs::remove_file(boxery_home::layout::token(d.path(), "a")).unwrap();
        assert_eq!(
            ix.lookup("bxt_1"),
            None,
            "a removed token is refused at once"
        );
    }
}
