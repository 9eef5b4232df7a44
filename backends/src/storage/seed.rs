//! The NoCloud seed of a VM: `meta-data` and `user-data` as docs/images.md ("Seed contract")
//! defines them (the same bytes `image/make-seed.sh` writes), packed into an ISO with volume
//! label `cidata` by `genisoimage`.
//!
//! The seed carries the identity: hostname, the pinned ed25519 host key (sshd's only key),
//! `authorized_keys` for `agent` (reset per instance), a fresh machine-id per instance (made in
//! the guest) and the proxy token. The
//! `instance-id` is new for every new VM (and VM made from an image) and kept for its life,
//! reimages included: a new instance-id is what makes the guest redo its per-instance steps.
//!
//! The ISO holds the host's private key and the token: it is written 0600.
//!
//! Also here: the hypervisor side of a new identity both drivers give a VM (seed 001,
//! "Identity"): a new UUID, MAC and instance-id, never the source's, and the VM's record.

use std::path::{Path, PathBuf};

use super::Storage;
use super::records::VmConfig;
use crate::{BackendError, Identity, NewVm};

/// A new MAC address in QEMU's locally administered range (`52:54:00:xx:xx:xx`).
pub(crate) fn random_mac() -> String {
    let b: [u8; 3] = rand::random();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2])
}

/// A new instance-id (`iid-<uuid>`, docs/images.md): new per identity, kept for the VM's life.
pub(crate) fn new_instance_id() -> String {
    format!("iid-{}", uuid::Uuid::new_v4())
}

/// `identity` made complete for VM `name`: a hostname (the name, `.` as `-`) and a host key
/// (generated when the request has none: every VM is pinned).
pub(crate) fn complete_identity(name: &str, identity: &Identity) -> crate::Result<Identity> {
    let mut id = identity.clone();
    if id.hostname.is_empty() {
        id.hostname = name.replace('.', "-");
    }
    if id.host_key.is_none() {
        id.host_key = Some(crate::identity::host_key(name, &format!("{name}.boxery"))?);
    }
    Ok(id)
}

/// The record of a new VM made from `vm` with the completed `identity`: a new UUID and MAC.
fn new_vm_record(
    vm: &NewVm,
    identity: &Identity,
    instance_id: String,
    image: &str,
    base: &str,
    disk_gib: u64,
    port: u16,
) -> VmConfig {
    VmConfig {
        name: vm.name.clone(),
        mark: vm.uid.clone(),
        uuid: uuid::Uuid::new_v4().to_string(),
        mac: random_mac(),
        port,
        cpus: vm.cpus,
        memory_mib: vm.memory_mib,
        disk_gib,
        base: base.into(),
        instance_id,
        hostname: identity.hostname.clone(),
        host_key: identity
            .host_key
            .as_ref()
            .map(|(_, public)| public.trim().to_string()),
        image: image.into(),
        created: boxery_api::now(),
    }
}

/// What a reimage does to the seed: the identity stays (same UUID, MAC, instance-id and
/// seed) unless the caller passes a different host key, which is a new identity: a new
/// instance-id, the new key and hostname in `cfg`, and the identity to write the new seed
/// with (`None`: keep the seed).
pub(crate) fn reseed(
    vm: &str,
    cfg: &mut VmConfig,
    identity: &Identity,
) -> crate::Result<Option<Identity>> {
    let new_key = identity
        .host_key
        .as_ref()
        .map(|(_, p)| p.trim().to_string());
    if new_key.is_none() || new_key == cfg.host_key {
        return Ok(None);
    }
    let id = complete_identity(vm, identity)?;
    cfg.instance_id = new_instance_id();
    cfg.host_key = new_key;
    cfg.hostname = id.hostname.clone();
    Ok(Some(id))
}

impl Storage {
    /// New VM `vm`'s seed ISO `iso` written (loose files in `work`), and its record
    /// ([`new_vm_record`]) on base `base` with a `disk_gib` disk and ssh port `port`: the
    /// request's identity completed (one without a host key still gets one: every VM is
    /// pinned) and a new instance-id.
    pub(crate) async fn seed_new_vm(
        &self,
        vm: &NewVm,
        base: &str,
        disk_gib: u64,
        port: u16,
        work: &Path,
        iso: &Path,
    ) -> crate::Result<VmConfig> {
        let crate::DiskSource::Image(image) = &vm.source;
        let identity = complete_identity(&vm.name, &vm.identity)?;
        let instance_id = new_instance_id();
        self.write_seed(&vm.name, &instance_id, &identity, base, work, iso)
            .await?;
        Ok(new_vm_record(
            vm,
            &identity,
            instance_id,
            image,
            base,
            disk_gib,
            port,
        ))
    }

    /// Write VM `name`'s seed ISO `iso` for `identity` on base `base` (loose files in
    /// `work`); a cloud image's seed also makes the `agent` user. An identity that cannot be
    /// seeded is `Invalid`.
    pub async fn write_seed(
        &self,
        name: &str,
        instance_id: &str,
        identity: &Identity,
        base: &str,
        work: &Path,
        iso: &Path,
    ) -> crate::Result<()> {
        let guest = if self.load_base(base)?.cloud_image {
            Guest::CloudImage
        } else {
            Guest::Boxery
        };
        write_seed_iso(
            &self.config.genisoimage,
            name,
            instance_id,
            identity,
            guest,
            work,
            iso,
        )
        .await
        .map_err(|e| match e {
            SeedError::Identity { .. } => BackendError::Invalid(e.to_string()),
            e => BackendError::failed(format!("write the seed of VM {name}"), e),
        })
    }
}

/// A failed seed write.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The identity lacks something the seed needs.
    #[error("the identity of {name} cannot be seeded: {why}")]
    Identity {
        /// The VM.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// Writing the seed's files failed.
    #[error("could not write the seed files of {name}")]
    Io {
        /// The VM.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `genisoimage` could not be run.
    #[error(
        "could not run genisoimage for the seed of {name}: run scripts/install-deps.sh (package genisoimage)"
    )]
    Spawn {
        /// The VM.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `genisoimage` failed.
    #[error("genisoimage failed for the seed of {name}: {stderr}")]
    Iso {
        /// The VM.
        name: String,
        /// Its stderr.
        stderr: String,
    },
}

/// Standard base64 with padding, one line (as `base64 -w0`).
pub fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Whether `h` is a hostname the seed accepts: `[a-zA-Z0-9-]`, not starting with `-`.
pub fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && !h.starts_with('-')
        && h.len() <= 63
        && h.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
}

/// `meta-data`.
pub fn meta_data(instance_id: &str, hostname: &str) -> String {
    format!("instance-id: {instance_id}\nlocal-hostname: {hostname}\n")
}

/// What the seed can count on in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guest {
    /// An image boxery built: the `agent` user is there (the plumbing layer), and cloud-init
    /// gives the seed's keys to it.
    Boxery,
    /// A distribution's cloud image: the seed makes `agent` (passwordless sudo, keys only)
    /// with the keys, and writes the token once the user exists.
    CloudImage,
}

/// `user-data` (cloud-config) for `identity` in a `guest`.
pub fn user_data(name: &str, identity: &Identity, guest: Guest) -> Result<String, SeedError> {
    let bad = |why: &str| SeedError::Identity {
        name: name.into(),
        why: why.into(),
    };
    if !valid_hostname(&identity.hostname) {
        return Err(bad("the hostname must be letters, digits and '-'"));
    }
    let Some((private, public)) = &identity.host_key else {
        return Err(bad("it has no host key (identity::generate makes one)"));
    };
    let token = identity.proxy_token.as_deref().unwrap_or("");
    let mut s = String::new();
    s.push_str("#cloud-config\n# boxery seed v1 (docs/images.md, \"Seed contract\")\n");
    s.push_str(&format!("hostname: {}\n", identity.hostname));
    s.push_str(
        "preserve_hostname: false\nmanage_etc_hosts: true\ndisable_root: true\nbootcmd:\n\
         \x20 - [cloud-init-per, instance, boxery-reset-authorized-keys, rm, -f, /home/agent/.ssh/authorized_keys]\n\
         \x20 - [cloud-init-per, instance, boxery-machine-id, sh, -c, \"rm -f /etc/machine-id /var/lib/dbus/machine-id && systemd-machine-id-setup\"]\n",
    );
    let indent = match guest {
        Guest::Boxery => {
            s.push_str("ssh_authorized_keys:\n");
            "  "
        }
        Guest::CloudImage => {
            // sshd presents only the seed's key: one fast host key of the image's own (an
            // RSA key alone costs about 40 s under emulation)
            s.push_str("ssh_deletekeys: true\nssh_genkeytypes: [ed25519]\n");
            s.push_str(
                "users:\n  - name: agent\n    gecos: boxery agent\n    shell: /bin/bash\n\
                 \x20   sudo: \"ALL=(ALL) NOPASSWD:ALL\"\n    lock_passwd: true\n\
                 \x20   ssh_authorized_keys:\n",
            );
            "      "
        }
    };
    for key in &identity.authorized_keys {
        let key = key.trim();
        if key.is_empty() || key.starts_with('#') {
            continue;
        }
        if key.contains('\n') {
            return Err(bad("an authorized key spans several lines"));
        }
        // quoted (JSON is YAML): no key comment can break the document
        s.push_str(&format!("{indent}- {}\n", serde_json::Value::from(key)));
    }
    let public_file = format!("{}\n", public.trim());
    let file = |path: &str, perm: &str, owner: Option<&str>, content: &[u8]| {
        let mut f = format!("  - path: {path}\n");
        if let Some(o) = owner {
            f.push_str(&format!("    owner: {o}\n"));
        }
        f.push_str(&format!(
            "    permissions: '{perm}'\n    encoding: b64\n    content: {}\n",
            base64(content)
        ));
        f
    };
    s.push_str("write_files:\n");
    if let Some(d) = &identity.display {
        // before the desktop layer's display first starts (its unit is ordered after
        // cloud-init), so it starts at its size
        s.push_str(&file(
            boxery_api::vm::Display::FILE,
            "0644",
            None,
            d.file_text().as_bytes(),
        ));
    }
    s.push_str(&file(
        "/etc/ssh/boxery_host_ed25519_key",
        "0600",
        None,
        private.as_bytes(),
    ));
    s.push_str(&file(
        "/etc/ssh/boxery_host_ed25519_key.pub",
        "0644",
        None,
        public_file.as_bytes(),
    ));
    s.push_str(&file(
        "/etc/ssh/sshd_config.d/05-boxery-hostkey.conf",
        "0644",
        None,
        b"HostKey /etc/ssh/boxery_host_ed25519_key\n",
    ));
    let mut token_file = file(
        "/home/agent/.boxery/token",
        "0600",
        Some("agent:agent"),
        token.as_bytes(),
    );
    if guest == Guest::CloudImage {
        // written in cloud-init's final stage, once `users` has made agent
        token_file.push_str("    defer: true\n");
    }
    s.push_str(&token_file);
    Ok(s)
}

/// Write the seed ISO for `identity` to `iso` (temp file + rename, mode 0600). The loose
/// files stay in `work` (created 0700, files 0600; they hold what the ISO holds) for
/// inspection.
pub async fn write_seed_iso(
    genisoimage: &Path,
    name: &str,
    instance_id: &str,
    identity: &Identity,
    guest: Guest,
    work: &Path,
    iso: &Path,
) -> Result<(), SeedError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| SeedError::Io {
        name: name.into(),
        source,
    };
    let user = user_data(name, identity, guest)?;
    let meta = meta_data(instance_id, &identity.hostname);
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work).map_err(io)?;
    std::fs::set_permissions(work, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    super::files::write_atomic(&work.join("user-data"), user.as_bytes(), 0o600).map_err(io)?;
    super::files::write_atomic(&work.join("meta-data"), meta.as_bytes(), 0o600).map_err(io)?;
    pack(genisoimage, name, work, iso).await
}

async fn pack(genisoimage: &Path, name: &str, work: &Path, iso: &Path) -> Result<(), SeedError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |source| SeedError::Io {
        name: name.into(),
        source,
    };
    let tmp: PathBuf = super::files::temp_path(iso);
    let out = tokio::process::Command::new(genisoimage)
        .arg("-quiet")
        .arg("-output")
        .arg(&tmp)
        .args(["-volid", "cidata", "-joliet", "-rock"])
        .arg(work.join("user-data"))
        .arg(work.join("meta-data"))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| SeedError::Spawn {
            name: name.into(),
            source,
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(SeedError::Iso {
            name: name.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().into(),
        });
    }
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    std::fs::rename(&tmp, iso).map_err(io)?;
    super::files::sync_dir(iso).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_coreutils() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(
            base64(b"HostKey /etc/ssh/boxery_host_ed25519_key\n"),
            "SG9zdEtleSAvZXRjL3NzaC9ib3hlcnlfaG9zdF9lZDI1NTE5X2tleQo="
        );
    }

    fn identity() -> Identity {
        Identity {
            hostname: "dev1".into(),
            machine_id: "0".repeat(32),
            host_key: Some((
                "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----\n"
                    .into(),
                "ssh-ed25519 AAAA dev1.boxery".into(),
            )),
            authorized_keys: vec!["ssh-ed25519 BBBB me@laptop".into()],
            proxy_token: Some("bxt_1".into()),
            display: None,
        }
    }

    #[test]
    fn user_data_follows_the_contract() {
        let u = user_data("dev1", &identity(), Guest::Boxery).unwrap();
        assert!(u.starts_with("#cloud-config\n"));
        assert!(u.contains("hostname: dev1\n"));
        assert!(u.contains("ssh_authorized_keys:\n  - \"ssh-ed25519 BBBB me@laptop\"\n"));
        assert!(u.contains("  - path: /etc/ssh/boxery_host_ed25519_key\n    permissions: '0600'\n    encoding: b64\n"));
        assert!(u.contains(&format!("content: {}\n", base64(b"bxt_1"))));
        assert!(u.contains("    owner: agent:agent\n"));
        let mut no_key = identity();
        no_key.host_key = None;
        assert!(user_data("dev1", &no_key, Guest::Boxery).is_err());
        let mut bad_host = identity();
        bad_host.hostname = "a.b".into();
        assert!(user_data("dev1", &bad_host, Guest::Boxery).is_err());
        // no spec.display: no file for the desktop; one: the size it first starts at
        assert!(!u.contains("desktop.env"), "{u}");
        let mut desk = identity();
        desk.display = Some(boxery_api::vm::Display {
            width: 1024,
            height: 768,
        });
        let doc: serde_json::Value =
            serde_saphyr::from_str(&user_data("dev1", &desk, Guest::Boxery).unwrap()).unwrap();
        let f = doc["write_files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == "/etc/boxery/desktop.env")
            .expect("the desktop's size");
        assert_eq!(f["permissions"], "0644");
        assert_eq!(
            f["content"],
            base64(b"# boxery: spec.display\nBOXERY_DISPLAY=1024x768\n")
        );
    }

    /// A cloud image's seed makes `agent` with the keys (none at the top, where they would go
    /// to the image's default user) and writes the token after the user exists.
    #[test]
    fn a_cloud_image_seed_makes_the_agent_user() {
        let u = user_data("dev1", &identity(), Guest::CloudImage).unwrap();
        let doc: serde_json::Value = serde_saphyr::from_str(&u).unwrap();
        assert!(doc.get("ssh_authorized_keys").is_none(), "{u}");
        let user = &doc["users"][0];
        assert_eq!(user["name"], "agent");
        assert_eq!(user["sudo"], "ALL=(ALL) NOPASSWD:ALL");
        assert_eq!(user["lock_passwd"], true);
        assert_eq!(doc["ssh_genkeytypes"][0], "ed25519");
        assert_eq!(user["ssh_authorized_keys"][0], "ssh-ed25519 BBBB me@laptop");
        let files = doc["write_files"].as_array().unwrap();
        let token = files
            .iter()
            .find(|f| f["path"] == "/home/agent/.boxery/token")
            .unwrap();
        assert_eq!(token["defer"], true);
        assert!(
            files
                .iter()
                .filter(|f| f["path"] != "/home/agent/.boxery/token")
                .all(|f| f.get("defer").is_none())
        );
        // a boxery image's seed is the reference's, with no users entry
        let b: serde_json::Value =
            serde_saphyr::from_str(&user_data("dev1", &identity(), Guest::Boxery).unwrap())
                .unwrap();
        assert!(b.get("users").is_none());
        assert_eq!(b["ssh_authorized_keys"][0], "ssh-ed25519 BBBB me@laptop");
    }

    /// The same identity gives the same bytes as image/make-seed.sh (the reference).
    #[test]
    fn matches_make_seed_sh() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../image/make-seed.sh");
        let have = |c: &str| {
            std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {c}"))
                .output()
                .is_ok_and(|o| o.status.success())
        };
        assert!(script.exists(), "{} is missing", script.display());
        assert!(
            have("genisoimage"),
            "genisoimage is missing: scripts/install-deps.sh installs it"
        );
        let d = tempfile::tempdir().unwrap();
        let id = crate::identity::generate("dev1", &["ssh-ed25519 BBBB me@laptop".into()]).unwrap();
        let (private, public) = id.host_key.clone().unwrap();
        std::fs::write(d.path().join("hk"), &private).unwrap();
        std::fs::write(d.path().join("hk.pub"), format!("{public}\n")).unwrap();
        std::fs::write(d.path().join("ak"), "ssh-ed25519 BBBB me@laptop\n").unwrap();
        std::fs::write(d.path().join("tok"), id.proxy_token.clone().unwrap()).unwrap();
        let out = std::process::Command::new("bash")
            .arg(&script)
            .args(["--instance-id", "iid-1", "--hostname", "dev1", "--host-key"])
            .arg(d.path().join("hk"))
            .arg("--authorized-keys")
            .arg(d.path().join("ak"))
            .arg("--token")
            .arg(d.path().join("tok"))
            .arg(d.path().join("seed"))
            .arg(d.path().join("seed.iso"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reference = std::fs::read_to_string(d.path().join("seed/user-data")).unwrap();
        assert_eq!(user_data("dev1", &id, Guest::Boxery).unwrap(), reference);
        assert_eq!(
            meta_data("iid-1", "dev1"),
            std::fs::read_to_string(d.path().join("seed/meta-data")).unwrap()
        );
    }
}
