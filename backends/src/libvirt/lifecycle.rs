//! A domain's life: its XML, defining, starting and stopping it, creating and destroying a VM,
//! and its record in the definition.

use super::*;

impl Inner {
    /// The domain XML of `cfg` on `disk`; its NIC on the confined filter when `confined`.
    pub(super) fn domain_xml(
        &self,
        conn: &Connect,
        cfg: &VmConfig,
        disk: &Path,
        confined: bool,
    ) -> Result<String> {
        let base = self.storage.load_base(&cfg.base)?;
        let proxy = self.proxy_addr(conn)?;
        let gw = proxy.ip().to_string();
        let boot = self.storage.base_boot(&base);
        let p = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        Ok(xml::domain(&xml::DomainSpec {
            domain: &self.domain_name(&cfg.name),
            kind: self.config.kind,
            ns: &self.ns,
            cfg,
            disk: &disk.to_string_lossy(),
            seed: &self.vm_seed(&cfg.name).to_string_lossy(),
            kernel: &p(&boot.kernel),
            initrd: &p(&boot.initrd),
            cmdline: boot.cmdline.as_deref().unwrap_or(""),
            machine: boot.machine.as_deref().unwrap_or("q35"),
            serial: &self.vm_serial(&cfg.name).to_string_lossy(),
            network: &self.config.network,
            gateway: &gw,
            proxy_port: proxy.port(),
            isolation: self.config.isolation,
            confined,
        }))
    }

    /// Define (or redefine) the domain of `cfg` on `disk`; `confined`: its NIC on the confined
    /// filter (a redefinition passes what the definition had, [`Inner::is_confined`], so the
    /// egress policy set by `set_egress` outlives every regeneration of the XML).
    pub(super) fn define(
        &self,
        conn: &Connect,
        cfg: &VmConfig,
        disk: &Path,
        confined: bool,
    ) -> Result<Domain> {
        let x = self.domain_xml(conn, cfg, disk, confined)?;
        conn.define_domain_xml(&x)
            .map_err(|e| BackendError::failed(format!("define the domain of VM {}", cfg.name), e))
    }

    pub(super) fn active_disk(d: &Dom) -> Result<PathBuf> {
        let x = d
            .dom
            .xml_desc(0)
            .map_err(|e| BackendError::failed("read the domain XML", e))?;
        xml::vda_source(&x).map(PathBuf::from).ok_or_else(|| {
            BackendError::failed("find the disk", format!("VM {} has no vda", d.cfg.name))
        })
    }

    pub(super) fn is_running(d: &Dom) -> bool {
        d.dom.is_active().unwrap_or(false)
    }

    pub(super) fn start_domain(d: &Dom) -> Result<()> {
        d.dom
            .create()
            .map(drop)
            .map_err(|e| BackendError::failed(format!("start VM {}", d.cfg.name), e))
    }

    /// Start a stopped VM: flatten its disk, regenerate its XML (filter, accel, size), start.
    /// A suspended one is resumed as it was saved ([`Inner::resume`]).
    pub(super) async fn boot(self: &Arc<Self>, d: &Dom) -> Result<()> {
        let dd = d.clone();
        let (running, saved) = blocking(move || {
            Ok::<_, BackendError>((Self::is_running(&dd), Self::has_memory(&dd)?))
        })
        .await?;
        if running {
            return Ok(());
        }
        if saved {
            return self.resume(d).await;
        }
        let active = self.flatten(d).await?;
        let dd = d.clone();
        self.call(move |me, conn| {
            let confined = Self::is_confined(&dd)?;
            let dom = me.define(conn, &dd.cfg, &active, confined)?;
            Self::start_domain(&Dom { dom, cfg: dd.cfg })
        })
        .await
    }

    /// Power a running VM off (ACPI button when `graceful`, then destroy); a suspended VM's
    /// saved memory is discarded (it is off).
    pub(super) async fn shutdown(&self, d: &Dom, graceful: bool) -> Result<()> {
        let dd = d.clone();
        if !blocking(move || Self::is_running(&dd)).await {
            let dd = d.clone();
            return blocking(move || Self::discard_memory(&dd)).await;
        }
        let dd = d.clone();
        if graceful && blocking(move || dd.dom.shutdown().is_ok()).await {
            let deadline = Instant::now() + self.config.powerdown_timeout;
            while Instant::now() < deadline {
                let dd = d.clone();
                if !blocking(move || Self::is_running(&dd)).await {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            warn!(
                vm = d.cfg.name.as_str(),
                "no ACPI power-off in time; destroying"
            );
        }
        let dd = d.clone();
        blocking(move || match dd.dom.destroy() {
            Ok(()) => Ok(()),
            Err(_) if !Self::is_running(&dd) => Ok(()),
            Err(e) => Err(BackendError::failed(format!("stop VM {}", dd.cfg.name), e)),
        })
        .await
    }

    /// Remove VM `name`'s domain (when ours) and every file of it.
    pub(super) async fn destroy(self: &Arc<Self>, name: &str) -> Result<()> {
        let n = name.to_string();
        if let Some(d) = self.call(move |me, conn| me.lookup(conn, &n)).await? {
            self.shutdown(&d, false).await?;
            blocking(move || {
                d.dom
                    .undefine_flags(UNDEFINE_MANAGED_SAVE)
                    .or_else(|e| {
                        if is_code(&e, virt::error::ErrorNumber::NoDomain) {
                            Ok(())
                        } else {
                            Err(e)
                        }
                    })
                    .map_err(|e| {
                        BackendError::failed(format!("undefine the domain of VM {}", d.cfg.name), e)
                    })
            })
            .await?;
        }
        for g in self.generations(name)? {
            remove_file_if_exists(&self.vm_disk(name, g)).map_err(io("removing a VM disk"))?;
        }
        for p in [self.vm_seed(name), self.vm_serial(name)] {
            remove_file_if_exists(&p).map_err(io(format!("removing {}", p.display())))?;
        }
        // a create killed mid-copy leaves `.vm-NAME-G.qcow2.tmp-PID` or the seed's temp
        let (prefix, seed) = (format!("vm-{name}-"), format!("vm-{name}-seed.iso"));
        remove_temps(&self.pool_dir, |f| {
            f == seed
                || f.strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(".qcow2"))
                    .is_some_and(|g| g.parse::<u64>().is_ok())
        })
        .map_err(io(format!("removing temp files of VM {name}")))?;
        let _ = std::fs::remove_dir_all(self.seed_work(name));
        self.refresh_pool().await;
        Ok(())
    }

    pub(super) async fn create_inner(self: &Arc<Self>, vm: &NewVm) -> Result<()> {
        let crate::DiskSource::Image(image) = &vm.source;
        let rec = self.storage.usable_image(image)?;
        let disk = self.vm_disk(&vm.name, 1);
        self.storage
            .copy_image(image, &disk, vm.disk_gib * GIB)
            .await?;
        let base = self.storage.load_base(&rec.base)?;
        let disk_gib = vm.disk_gib.max(rec.virtual_size.div_ceil(GIB));
        let (work, iso) = (self.seed_work(&vm.name), self.vm_seed(&vm.name));
        let cfg = self
            .storage
            .seed_new_vm(vm, &base.id, disk_gib, 22, &work, &iso)
            .await?;
        let start = vm.start;
        let confined = vm.egress != EgressPolicy::Public;
        self.call(move |me, conn| {
            let dom = me.define(conn, &cfg, &disk, confined)?;
            if let Ok(p) = conn.lookup_storage_pool_by_name(&me.pool_name()) {
                let _ = p.refresh(0);
            }
            if start {
                Self::start_domain(&Dom { dom, cfg })?;
            }
            Ok(())
        })
        .await
    }

    pub(super) fn save_cfg(&self, conn: &Connect, d: &Dom, cfg: &VmConfig) -> Result<()> {
        // the persistent definition carries the record; a running domain gets the new metadata
        // live too (the rest applies at its next cold start)
        let active = Self::active_disk(d)?;
        self.define(conn, cfg, &active, Self::is_confined(d)?)?;
        if Self::is_running(d) {
            d.dom
                .set_metadata(
                    META_ELEMENT,
                    Some(&xml::metadata(&self.ns, cfg)),
                    Some(META_KEY),
                    Some(xml::META_URI),
                    AFFECT_LIVE,
                )
                .map_err(|e| {
                    BackendError::failed(format!("update the live record of VM {}", cfg.name), e)
                })?;
        }
        Ok(())
    }

    pub(super) async fn create(self: &Arc<Self>, vm: &NewVm) -> Result<()> {
        self.storage.check_name("VM", &vm.name)?;
        let confined = vm.egress != EgressPolicy::Public;
        if confined && !self.config.isolation {
            return Err(unconfinable(vm.egress));
        }
        crate::host::check_size(vm.cpus, vm.memory_mib)?;
        let _lock = self.lock(&format!("vm-{}", vm.name)).await?;
        let name = vm.name.clone();
        let found = self
            .call(move |me, conn| {
                Ok(match me.lookup(conn, &name)? {
                    Some(d) => Some(Some(d)),
                    // a domain with our prefix but not our mark
                    None if conn.lookup_domain_by_name(&me.domain_name(&name)).is_ok() => {
                        Some(None)
                    }
                    None => None,
                })
            })
            .await?;
        match found {
            Some(Some(d)) => {
                if !crate::mark::Mark::same_object(&d.cfg.mark, &vm.uid) {
                    return Err(BackendError::Invalid(format!(
                        "a VM named {} already exists in the libvirt backend for another object (uid {}): pick another name",
                        vm.name, d.cfg.mark
                    )));
                }
                // a create retried: the domain takes the request's egress before it boots
                if self.config.isolation {
                    let dd = d.clone();
                    self.call(move |me, conn| me.apply_egress(conn, &dd, confined))
                        .await?;
                }
                if vm.start {
                    self.boot(&d).await?;
                }
                return Ok(());
            }
            Some(None) => {
                return Err(BackendError::Invalid(format!(
                    "libvirt domain {} exists without boxery's mark: boxery never touches it; remove or rename it",
                    self.domain_name(&vm.name)
                )));
            }
            None => {}
        }
        // leftovers of a create that died
        self.destroy(&vm.name).await?;
        let res = self.create_inner(vm).await;
        if let Err(e) = &res {
            warn!(vm = vm.name.as_str(), error = %e.chain(), "create failed; removing what it made");
            if let Err(e2) = self.destroy(&vm.name).await {
                warn!(vm = vm.name.as_str(), error = %e2.chain(), "could not remove the failed create; cleanup_new retries");
            }
        }
        res
    }

    pub(super) async fn resize(self: &Arc<Self>, name: &str, size: VmSize) -> Result<()> {
        self.storage.check_name("VM", name)?;
        crate::host::check_size(size.cpus, size.memory_mib)?;
        let _lock = self.lock(&format!("vm-{name}")).await?;
        let n = name.to_string();
        let (d, was_running) = self
            .call(move |me, conn| {
                let d = me.require(conn, &n)?;
                let running = Inner::is_running(&d);
                Ok((d, running))
            })
            .await?;
        let mut cfg = d.cfg.clone();
        let Some(change) = cfg.resize_to(size)? else {
            return Ok(());
        };
        let dd = d.clone();
        if !was_running && blocking(move || Self::has_memory(&dd)).await? {
            return Err(BackendError::Invalid(format!(
                "VM {name} is suspended: its saved memory holds its size; resume it first (or stop it, which discards the memory)"
            )));
        }
        if was_running && !change.machine {
            cfg.disk_gib = size.disk_gib;
            return self
                .call(move |me, conn| {
                    d.dom
                        .block_resize("vda", size.disk_gib * GIB, BLOCK_RESIZE_BYTES)
                        .map_err(|e| {
                            BackendError::failed(format!("grow the disk of VM {}", d.cfg.name), e)
                        })?;
                    me.save_cfg(conn, &d, &cfg)
                })
                .await;
        }
        if was_running {
            self.shutdown(&d, true).await?;
        }
        let applied: Result<()> = async {
            if change.grow {
                let active = self.flatten(&d).await?;
                self.storage
                    .disks()
                    .resize(&active, size.disk_gib * GIB)
                    .await
                    .map_err(|e| BackendError::failed(format!("grow the disk of VM {name}"), e))?;
            }
            cfg.cpus = size.cpus;
            cfg.memory_mib = size.memory_mib;
            cfg.disk_gib = size.disk_gib;
            let d = d.clone();
            self.call(move |me, conn| me.save_cfg(conn, &d, &cfg)).await
        }
        .await;
        if was_running {
            let n = name.to_string();
            let d = self.call(move |me, conn| me.require(conn, &n)).await?;
            self.boot(&d).await?;
        }
        applied
    }

    pub(super) async fn reimage(
        self: &Arc<Self>,
        vm: &str,
        image: &str,
        identity: &Identity,
    ) -> Result<()> {
        self.storage.check_name("VM", vm)?;
        if !valid_name(image) {
            return Err(BackendError::Unchanged(format!(
                "image name `{image}` is not valid"
            )));
        }
        let _lock = self.lock(&format!("vm-{vm}")).await?;
        let unchanged = |e: BackendError| BackendError::Unchanged(e.chain());
        let n = vm.to_string();
        let d = self
            .call(move |me, conn| Ok(me.lookup(conn, &n)))
            .await
            .map_err(unchanged)??
            .ok_or_else(|| not_found(format!("VM {vm}")))?;
        let rec = self
            .storage
            .load_image(image)
            .map_err(unchanged)?
            .ok_or_else(|| {
                BackendError::Unchanged(format!(
                    "image {image} does not exist in the libvirt backend"
                ))
            })?;
        let _: BaseRecord = self.storage.load_base(&rec.base).map_err(unchanged)?;
        if !self.storage.image_disk(image).exists() {
            return Err(BackendError::Unchanged(format!(
                "image {image} has no disk in the libvirt backend"
            )));
        }
        // from here on the VM changes; every step is redone by a retry: the domain names either
        // the old disk or the complete new one
        self.shutdown(&d, false).await?;
        let mut cfg = d.cfg.clone();
        let disk = self.vm_disk(vm, self.next_generation(vm)?);
        self.storage
            .copy_image(image, &disk, cfg.disk_gib * GIB)
            .await?;
        if let Some(id) = seed::reseed(vm, &mut cfg, identity)? {
            let (work, iso) = (self.seed_work(vm), self.vm_seed(vm));
            self.storage
                .write_seed(vm, &cfg.instance_id, &id, &rec.base, &work, &iso)
                .await?;
        }
        cfg.base = rec.base.clone();
        cfg.image = image.into();
        cfg.disk_gib = cfg.disk_gib.max(rec.virtual_size.div_ceil(GIB));
        self.call(move |me, conn| {
            me.define(conn, &cfg, &disk, Inner::is_confined(&d)?)?;
            me.remove_stale_generations(&cfg.name, &disk)?;
            let d = me.require(conn, &cfg.name)?;
            Inner::start_domain(&d)
        })
        .await
    }
}
