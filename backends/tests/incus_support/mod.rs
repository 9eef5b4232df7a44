//! Shared by the incus tests and the contract suite: an incusd (started by
//! `scripts/incusd.sh start` when it does not answer; the tests FAIL, never skip, when Incus is
//! missing), and the clean-up every test runs even when it fails (everything its home made in
//! incusd and on the host: `IncusBackend::teardown`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use boxery_backends::incus::{IncusBackend, IncusConfig};

/// The repository.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Start incusd (by scripts/incusd.sh) unless it answers; fail with the reason otherwise.
pub fn need_incusd() {
    let out = std::process::Command::new(repo().join("scripts/incusd.sh"))
        .arg("start")
        .output()
        .expect("scripts/incusd.sh runs");
    assert!(
        out.status.success(),
        "incusd is not running and scripts/incusd.sh could not start it (install it with \
         scripts/install-incus.sh; these tests need a real incusd): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A home of the incus backend in a temporary directory, torn down when dropped (also when
/// the test fails).
pub struct Home {
    pub backend: IncusBackend,
    pub dir: tempfile::TempDir,
}

impl Home {
    /// A new home (incusd started when needed), initialised.
    pub async fn new() -> Home {
        need_incusd();
        let dir = tempfile::Builder::new()
            .prefix("bxi")
            .tempdir_in("/tmp")
            .unwrap();
        let mut config = IncusConfig::from_env();
        config.stop_timeout = std::time::Duration::from_secs(10);
        let backend = IncusBackend::with_config(dir.path().join("incus"), config);
        let home = Home { backend, dir };
        use boxery_backends::Backend;
        home.backend
            .init()
            .await
            .unwrap_or_else(|e| panic!("init: projects, pool, network: {}", e.chain()));
        home
    }

    /// The same kind of backend, at an incusd socket that is not there.
    pub fn unreachable(&self) -> IncusBackend {
        let mut config = IncusConfig::from_env();
        config.socket = self.dir.path().join("gone.sock");
        IncusBackend::with_config(self.dir.path().join("elsewhere"), config)
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let b = self.backend.clone();
        // a runtime of its own: a drop cannot wait on the test's
        let done = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(b.teardown())
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("incus teardown failed: {}", e.chain()),
            Err(_) => eprintln!("incus teardown panicked"),
        }
    }
}
