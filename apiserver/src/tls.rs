//! The API's TLS: a CA and a server certificate made on first start under
//! `$BOXERY_HOME/api/` (`ca.crt`, `ca.key`, `server.crt`, `server.key`, keys 0600) with rcgen,
//! served with rustls. The server certificate names `localhost`, the loopback addresses, the
//! host's name and addresses and the listen address; it is made again (by the same CA, so
//! kubeconfigs stay valid) when a name it must carry is missing or it is within 30 days of
//! its end. `ca.crt` is what a kubeconfig carries.
//!
//! Two processes on a fresh home (`serve --api-listen` and `boxery kubeconfig`, or two
//! `serve`s) check and make these files under one exclusive lock (`api/tls.lock`), checking
//! again once it is held: one makes the CA (and the server certificate), the other reads
//! them, so a kubeconfig's CA is always the one that signed the server's certificate and a
//! server key is never beside another run's certificate.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use boxery_home::private;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use serde::{Deserialize, Serialize};

/// The directory of the API's files.
pub fn dir(home: &Path) -> PathBuf {
    boxery_home::layout::api(home)
}

/// The CA certificate (PEM) clients trust.
pub fn ca_file(home: &Path) -> PathBuf {
    dir(home).join("ca.crt")
}

/// What the server certificate was made for (`server.json`), so that it is made again only
/// when it must be.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Made {
    names: BTreeSet<String>,
    not_after: chrono::DateTime<chrono::Utc>,
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("no names");
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "boxery API CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    p
}

/// (year, month, day).
fn ymd(t: chrono::DateTime<chrono::Utc>) -> (i32, u8, u8) {
    use chrono::Datelike;
    (t.year(), t.month() as u8, t.day() as u8)
}

fn validity(p: &mut CertificateParams, days: i64) -> chrono::DateTime<chrono::Utc> {
    let now = chrono::Utc::now();
    let (y, m, d) = ymd(now - chrono::Duration::days(1));
    p.not_before = rcgen::date_time_ymd(y, m, d);
    let end = now + chrono::Duration::days(days);
    let (y, m, d) = ymd(end);
    p.not_after = rcgen::date_time_ymd(y, m, d);
    end
}

/// This host's name, when it has one.
pub fn hostname() -> Option<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let h = h.trim();
    (!h.is_empty()).then(|| h.to_string())
}

/// The names the server certificate must carry for a listener on `listen`.
fn names_for(listen: SocketAddr) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = ["localhost", "127.0.0.1", "::1"]
        .into_iter()
        .map(String::from)
        .collect();
    if let Some(h) = hostname() {
        names.insert(h);
    }
    if listen.ip().is_unspecified() {
        for i in if_addrs::get_if_addrs().unwrap_or_default() {
            names.insert(i.ip().to_string());
        }
    } else {
        names.insert(listen.ip().to_canonical().to_string());
    }
    names
}

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// The lock every check-and-make of the TLS files holds (released when dropped).
fn lock(home: &Path) -> std::io::Result<std::fs::File> {
    let d = dir(home);
    private::dir(&d)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(d.join("tls.lock"))?;
    f.lock()?;
    Ok(f)
}

/// The CA's key, made (with its certificate) when there is none; the caller holds [`lock`].
fn ca(home: &Path) -> std::io::Result<KeyPair> {
    let d = dir(home);
    let key_file = d.join("ca.key");
    if let (Ok(pem), true) = (std::fs::read_to_string(&key_file), ca_file(home).exists()) {
        return KeyPair::from_pem(&pem).map_err(io);
    }
    let key = KeyPair::generate().map_err(io)?;
    let mut p = ca_params();
    validity(&mut p, 3650);
    let cert = p.self_signed(&key).map_err(io)?;
    private::write(&key_file, key.serialize_pem().as_bytes(), true)?;
    // Public, but written the same way: whole or not at all.
    private::write(&ca_file(home), cert.pem().as_bytes(), true)?;
    Ok(key)
}

/// Make the CA when this home has none (a kubeconfig carries its certificate).
pub fn ensure_ca(home: &Path) -> std::io::Result<()> {
    let _lock = lock(home)?;
    ca(home).map(drop)
}

/// The server's certificate chain and key for `listen`, made or made again when needed.
pub fn server_identity(
    home: &Path,
    listen: SocketAddr,
) -> std::io::Result<Arc<rustls::ServerConfig>> {
    let d = dir(home);
    let _lock = lock(home)?;
    let ca_key = ca(home)?;
    let need = names_for(listen);
    let made: Option<Made> = std::fs::read(d.join("server.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let fresh = made.as_ref().is_some_and(|m| {
        need.is_subset(&m.names) && m.not_after > chrono::Utc::now() + chrono::Duration::days(30)
    }) && d.join("server.crt").exists()
        && d.join("server.key").exists();
    if !fresh {
        // Keep the names of the last certificate too: another listen address of this home
        // keeps working.
        let mut names = need.clone();
        if let Some(m) = made {
            names.extend(m.names);
        }
        let key = KeyPair::generate().map_err(io)?;
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(io)?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, "boxery API");
        p.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => n.clone().try_into().map(SanType::DnsName),
            })
            .collect::<Result<_, _>>()
            .map_err(io)?;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let not_after = validity(&mut p, 365);
        let issuer = Issuer::new(ca_params(), ca_key);
        let cert = p.signed_by(&key, &issuer).map_err(io)?;
        private::write(&d.join("server.key"), key.serialize_pem().as_bytes(), true)?;
        private::write(&d.join("server.crt"), cert.pem().as_bytes(), true)?;
        let made = Made { names, not_after };
        private::write(
            &d.join("server.json"),
            &serde_json::to_vec_pretty(&made).map_err(io)?,
            true,
        )?;
    }
    config(&d)
}

fn config(d: &Path) -> std::io::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(d.join("server.crt"))
        .map_err(io)?
        .collect::<Result<_, _>>()
        .map_err(io)?;
    let key = PrivateKeyDer::from_pem_file(d.join("server.key")).map_err(io)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(io)?;
    // HTTP/1.1 only: watches are chunked responses, and every client speaks it.
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openssl ARGS` succeeds; its stdout.
    fn openssl(args: &[&str]) -> String {
        let o = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl");
        assert!(
            o.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Many first uses at once on a fresh home (`serve --api-listen` and `boxery kubeconfig`
    /// racing): one CA is made, the server certificate is that CA's, and the server key is
    /// the certificate's.
    #[test]
    fn concurrent_first_uses_make_one_consistent_set() {
        for round in 0..3 {
            let d = tempfile::tempdir().unwrap();
            let a: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let barrier = std::sync::Barrier::new(8);
            let cas: Vec<Vec<u8>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..8)
                    .map(|i| {
                        let (barrier, home) = (&barrier, d.path());
                        s.spawn(move || {
                            barrier.wait();
                            if i % 2 == 0 {
                                ensure_ca(home).unwrap();
                            } else {
                                server_identity(home, a).unwrap();
                            }
                            std::fs::read(ca_file(home)).unwrap()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let f = |n: &str| dir(d.path()).join(n).display().to_string();
            for ca in &cas {
                assert_eq!(
                    ca,
                    &std::fs::read(ca_file(d.path())).unwrap(),
                    "round {round}"
                );
            }
            let verified = openssl(&["verify", "-CAfile", &f("ca.crt"), &f("server.crt")]);
            assert!(verified.contains("OK"), "round {round}: {verified}");
            let cert_key = openssl(&["x509", "-noout", "-pubkey", "-in", &f("server.crt")]);
            let key = openssl(&["pkey", "-pubout", "-in", &f("server.key")]);
            assert_eq!(
                cert_key, key,
                "round {round}: the server key is not the certificate's"
            );
            let ca_cert_key = openssl(&["x509", "-noout", "-pubkey", "-in", &f("ca.crt")]);
            let ca_key = openssl(&["pkey", "-pubout", "-in", &f("ca.key")]);
            assert_eq!(
                ca_cert_key, ca_key,
                "round {round}: the CA key is not the CA's"
            );
        }
    }

    #[test]
    fn made_once_and_again_for_a_new_address() {
        let d = tempfile::tempdir().unwrap();
        let a: SocketAddr = "127.0.0.1:0".parse().unwrap();
        server_identity(d.path(), a).unwrap();
        let ca1 = std::fs::read(ca_file(d.path())).unwrap();
        let crt1 = std::fs::read(dir(d.path()).join("server.crt")).unwrap();
        server_identity(d.path(), a).unwrap();
        assert_eq!(
            crt1,
            std::fs::read(dir(d.path()).join("server.crt")).unwrap()
        );
        let b: SocketAddr = "192.0.2.77:6443".parse().unwrap();
        server_identity(d.path(), b).unwrap();
        assert_ne!(
            crt1,
            std::fs::read(dir(d.path()).join("server.crt")).unwrap()
        );
        assert_eq!(
            ca1,
            std::fs::read(ca_file(d.path())).unwrap(),
            "the CA stays"
        );
        let made: Made =
            serde_json::from_slice(&std::fs::read(dir(d.path()).join("server.json")).unwrap())
                .unwrap();
        assert!(made.names.contains("192.0.2.77") && made.names.contains("127.0.0.1"));
        use std::os::unix::fs::PermissionsExt;
        for f in ["ca.key", "server.key"] {
            let m = std::fs::metadata(dir(d.path()).join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(m & 0o777, 0o600, "{f}");
        }
    }
}
