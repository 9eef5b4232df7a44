//! A home serving the Kubernetes-compatible API (`serve --api-listen` on loopback) and the
//! clients the API tests drive it with: kubectl and curl.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use super::{Home, Serve, eventually};

/// A home with `serve --api-listen` running and a full-scope kubeconfig.
pub struct Api {
    pub home: Home,
    pub serve: Serve,
    pub kubeconfig: PathBuf,
}

impl Api {
    /// Start it (kubectl must be installed: a missing one fails, saying how to install it).
    pub fn start() -> Api {
        assert!(
            Command::new("kubectl")
                .arg("version")
                .arg("--client")
                .output()
                .is_ok_and(|o| o.status.success()),
            "kubectl is missing: scripts/install-deps.sh installs Debian's kubernetes-client"
        );
        let home = Home::new();
        let serve = home.serve(&["--api-listen", "127.0.0.1:0"]);
        serve.wait_leading();
        let addr = home.path().join("api/addr");
        eventually(Duration::from_secs(20), || addr.exists().then_some(()))
            .expect("serve wrote api/addr");
        let kc = home.ok(&["kubeconfig", "--name", "test"]);
        let kubeconfig = home.write("kubeconfig.yaml", &kc);
        Api {
            home,
            serve,
            kubeconfig,
        }
    }

    /// A kubeconfig of a new token of `scope`, named `name`.
    pub fn kubeconfig(&self, scope: &str, name: &str) -> PathBuf {
        let kc = self
            .home
            .ok(&["kubeconfig", "--scope", scope, "--name", name]);
        self.home.write(&format!("{name}.kubeconfig.yaml"), &kc)
    }

    /// kubectl with `kubeconfig`.
    pub fn kubectl_with(&self, kubeconfig: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
        Command::new("kubectl")
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("HOME", self.home.path())
            .envs(env.iter().copied())
            .output()
            .expect("run kubectl")
    }

    /// kubectl with the full token.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_with(&self.kubeconfig, args, &[])
    }

    /// kubectl that must succeed; its stdout.
    pub fn k(&self, args: &[&str]) -> String {
        let o = self.kubectl(args);
        assert!(
            o.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// kubectl that must fail; its stderr.
    pub fn k_err(&self, args: &[&str]) -> String {
        let o = self.kubectl(args);
        assert!(
            !o.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    /// A raw request with the token of `kubeconfig`: the HTTP status and the body as JSON.
    pub fn request(
        &self,
        kubeconfig: &Path,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, serde_json::Value) {
        let addr = std::fs::read_to_string(self.home.path().join("api/addr")).unwrap();
        let token = token_of(&std::fs::read_to_string(kubeconfig).unwrap());
        let mut c = Command::new("curl");
        c.args([
            "-s",
            "--max-time",
            "30",
            "-w",
            "\n%{http_code}",
            "-X",
            method,
            "--cacert",
            self.home.path().join("api/ca.crt").to_str().unwrap(),
            "-H",
            &format!("Authorization: Bearer {token}"),
        ]);
        if let Some(b) = body {
            c.args(["-H", "Content-Type: application/json", "--data-binary", b]);
        }
        let o = c
            .arg(format!("https://{}{path}", addr.trim()))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&o.stdout);
        let (body, code) = text.rsplit_once('\n').expect("curl printed the status");
        let value = serde_json::from_str(body).unwrap_or(serde_json::Value::String(body.into()));
        (code.trim().parse().expect("an HTTP status"), value)
    }
}

/// The secret of a kubeconfig `boxery kubeconfig` printed.
pub fn token_of(kubeconfig: &str) -> String {
    kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: ").map(String::from))
        .expect("a token in the kubeconfig")
}
