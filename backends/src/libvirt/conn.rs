//! The connection to libvirtd and the calls that run on it off the async workers; looking up
//! this home's domains (never one without our mark).

use super::*;

/// Run blocking work (libvirt's synchronous calls) on tokio's blocking threads, never on an
/// async worker; a panic in it is re-raised here.
pub(super) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(t) => t,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

impl Inner {
    pub(super) fn domain_name(&self, name: &str) -> String {
        format!("bx-{}-{name}", self.ns)
    }

    /// The connection: the open one while it is alive, else a new one. Blocking.
    pub(super) fn conn(&self) -> Result<Connect> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref()
            && c.is_alive().unwrap_or(false)
        {
            return Ok(c.clone());
        }
        *slot = None;
        let c = Connect::open(Some(&self.config.uri)).map_err(|e| {
            unreachable(format!(
                "cannot connect to libvirtd at {}: {e} (start it: scripts/libvirtd.sh start, or `systemctl start libvirtd`)",
                self.config.uri
            ))
        })?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Run `f` with the connection on a blocking thread. A failure on a connection that has
    /// dropped meanwhile is `Unreachable`, and the next call connects again.
    pub(super) async fn call<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Inner, &Connect) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = Arc::clone(self);
        blocking(move || {
            let conn = me.conn()?;
            let res = f(&me, &conn);
            match res {
                Err(e) if !conn.is_alive().unwrap_or(false) => {
                    let mut slot = me.conn.lock().unwrap_or_else(|p| p.into_inner());
                    *slot = None;
                    Err(match e {
                        e @ BackendError::Unreachable { .. } => e,
                        e => unreachable(format!(
                            "the connection to libvirtd at {} dropped: {}",
                            me.config.uri,
                            e.chain()
                        )),
                    })
                }
                res => res,
            }
        })
        .await
    }

    /// Our domain `name`, or `None` when there is none or it is not ours (never touched).
    pub(super) fn lookup(&self, conn: &Connect, name: &str) -> Result<Option<Dom>> {
        let dom = match conn.lookup_domain_by_name(&self.domain_name(name)) {
            Ok(d) => d,
            Err(e) if is_code(&e, virt::error::ErrorNumber::NoDomain) => return Ok(None),
            Err(e) => {
                return Err(unreachable(format!(
                    "looking up domain {}: {e}",
                    self.domain_name(name)
                )));
            }
        };
        Ok(self.ours(dom))
    }

    /// Our domain `name`, else `NotFound`.
    pub(super) fn require(&self, conn: &Connect, name: &str) -> Result<Dom> {
        self.lookup(conn, name)?
            .ok_or_else(|| not_found(format!("VM {name}")))
    }

    /// `Some` when `dom` carries our mark for this namespace.
    pub(super) fn ours(&self, dom: Domain) -> Option<Dom> {
        let meta = dom.metadata(META_ELEMENT, Some(xml::META_URI), 0).ok()?;
        let (ns, cfg) = xml::parse_metadata(&meta)?;
        // The metadata names the VM: only a valid name that is this very domain's counts (a
        // domain defined by hand with our mark must not point boxery at other paths).
        let named_here =
            valid_name(&cfg.name) && dom.name().is_ok_and(|d| d == self.domain_name(&cfg.name));
        (ns == self.ns && named_here).then_some(Dom { dom, cfg })
    }

    pub(super) async fn check(self: &Arc<Self>) -> Result<()> {
        self.call(|me, conn| {
            conn.hyp_version().map_err(|e| {
                unreachable(format!(
                    "libvirtd at {} does not answer: {e}",
                    me.config.uri
                ))
            })?;
            for tool in [&me.config.storage.qemu_img, &me.config.storage.genisoimage] {
                if std::process::Command::new(tool)
                    .arg("--version")
                    .output()
                    .is_err()
                {
                    return Err(BackendError::Invalid(format!(
                        "{} is missing: run scripts/install-deps.sh",
                        tool.display()
                    )));
                }
            }
            Ok(())
        })
        .await
    }

    /// VM `name`'s lock, then its domain (`NotFound` when there is none).
    pub(super) async fn lock_domain(self: &Arc<Self>, name: &str) -> Result<(FileLock, Dom)> {
        self.storage.check_name("VM", name)?;
        let lock = self.lock(&format!("vm-{name}")).await?;
        let n = name.to_string();
        let d = self.call(move |me, conn| me.require(conn, &n)).await?;
        Ok((lock, d))
    }
}
