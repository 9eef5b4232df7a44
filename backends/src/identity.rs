//! A VM's identity, generated on the host (seed 001, "Identity").
//!
//! Every new VM, and every VM made from an image, gets a fresh identity: its hostname, a
//! random machine-id, an ed25519 ssh host key pair made here with `ssh-keygen` (the guest's
//! sshd presents only that key, and boxery pins its public half: no trust on first use) and a
//! random per-VM proxy token. The backend writes it into the guest's seed; the control plane
//! records the public half of the host key.
//!
//! Guarantees: nothing is reused between two calls; the private key never touches disk
//! outside a private temporary directory that is removed before `generate` returns.

use std::path::Path;
use std::process::Command;

use rand::Rng;

use crate::{BackendError, Identity};

/// Why an identity could not be made.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The temporary directory for the key pair could not be made or read.
    #[error("could not prepare a temporary directory for the host key of {name}")]
    TempDir {
        /// The VM.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `ssh-keygen` could not be run (not installed?).
    #[error("could not run ssh-keygen for the host key of {name}: install openssh-client")]
    Spawn {
        /// The VM.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `ssh-keygen` ran and failed.
    #[error("ssh-keygen failed making the host key of {name}: {stderr}")]
    Keygen {
        /// The VM.
        name: String,
        /// Its stderr.
        stderr: String,
    },
    /// The key files it wrote could not be read.
    #[error("could not read the host key ssh-keygen made for {name}")]
    Read {
        /// The VM.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl From<IdentityError> for BackendError {
    fn from(e: IdentityError) -> Self {
        BackendError::failed("generate identity", e)
    }
}

/// Random bytes as lowercase hex.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh machine-id: 32 lowercase hex characters, never all zero.
pub fn machine_id() -> String {
    loop {
        let id = random_hex(16);
        if id.bytes().any(|b| b != b'0') {
            return id;
        }
    }
}

/// A fresh proxy token: `bxt_` and 64 hex characters (256 random bits).
pub fn proxy_token() -> String {
    format!("bxt_{}", random_hex(32))
}

/// A fresh ed25519 key pair from `ssh-keygen`: (private key in OpenSSH format, public line).
/// The public line is `ssh-ed25519 AAAA… COMMENT`.
pub fn host_key(name: &str, comment: &str) -> Result<(String, String), IdentityError> {
    let dir = tempfile::Builder::new()
        .prefix("boxery-hostkey-")
        .tempdir()
        .map_err(|source| IdentityError::TempDir {
            name: name.into(),
            source,
        })?;
    let key = dir.path().join("key");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(&key)
        .output()
        .map_err(|source| IdentityError::Spawn {
            name: name.into(),
            source,
        })?;
    if !out.status.success() {
        return Err(IdentityError::Keygen {
            name: name.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| IdentityError::Read {
            name: name.into(),
            source,
        })
    };
    let private = read(&key)?;
    let public = read(&key.with_extension("pub"))?.trim().to_string();
    // The directory (and both halves in it) is removed when `dir` drops.
    drop(dir);
    Ok((private, public))
}

/// Generate a fresh identity for VM `name` with these `authorized_keys` (for the `agent`
/// user, replacing whatever the disk holds).
pub fn generate(name: &str, authorized_keys: &[String]) -> Result<Identity, IdentityError> {
    let host_key = host_key(name, &format!("{name}.boxery"))?;
    Ok(Identity {
        hostname: name.to_string(),
        machine_id: machine_id(),
        host_key: Some(host_key),
        authorized_keys: authorized_keys.to_vec(),
        proxy_token: Some(proxy_token()),
        display: None,
    })
}

/// The known_hosts line that pins `public` (`ssh-ed25519 AAAA… comment`) for `host`
/// (`[127.0.0.1]:PORT`, or an alias such as `dev1.boxery`): key type and key, no comment.
pub fn known_hosts_line(host: &str, public: &str) -> String {
    let mut parts = public.split_whitespace();
    let kind = parts.next().unwrap_or_default();
    let key = parts.next().unwrap_or_default();
    format!("{host} {kind} {key}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_fresh_identities() {
        let keys = vec!["ssh-ed25519 AAAAC3Nza test@host".to_string()];
        let a = generate("dev1", &keys).unwrap();
        let b = generate("dev1", &keys).unwrap();
        assert_eq!(a.hostname, "dev1");
        assert_eq!(a.authorized_keys, keys);
        assert_eq!(a.machine_id.len(), 32);
        assert!(
            a.machine_id
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a.machine_id, b.machine_id);
        assert_ne!(a.proxy_token, b.proxy_token);
        let (priv_a, pub_a) = a.host_key.clone().unwrap();
        let (_, pub_b) = b.host_key.clone().unwrap();
        assert!(priv_a.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));
        assert!(pub_a.starts_with("ssh-ed25519 "));
        assert!(pub_a.ends_with(" dev1.boxery"));
        assert_ne!(pub_a, pub_b);
        assert!(a.proxy_token.unwrap().starts_with("bxt_"));
    }

    #[test]
    fn known_hosts_line_drops_the_comment() {
        assert_eq!(
            known_hosts_line("[127.0.0.1]:22001", "ssh-ed25519 AAAAkey dev1.boxery"),
            "[127.0.0.1]:22001 ssh-ed25519 AAAAkey"
        );
    }
}
