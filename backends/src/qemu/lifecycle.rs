//! A VM's life: launching and stopping its QEMU, its port, its seed, creating and destroying it.

use super::chain::node_name;
use super::*;

impl Inner {
    /// The command line's inputs; `chain` is the disk chain, top first, base last.
    pub(super) fn launch_spec(
        &self,
        cfg: &VmConfig,
        base: &BaseRecord,
        chain: &[PathBuf],
    ) -> LaunchSpec {
        let name = &cfg.name;
        let top = chain[0].clone();
        let backing = chain[1..chain.len() - 1]
            .iter()
            .rev()
            .enumerate()
            .map(|(i, p)| (p.clone(), node_name(p, i)))
            .collect();
        LaunchSpec {
            name: name.clone(),
            dir: self.vm_dir(name),
            uuid: cfg.uuid.clone(),
            mac: cfg.mac.clone(),
            port: cfg.port,
            cpus: cfg.cpus,
            memory_mib: cfg.memory_mib,
            base: self.base_disk(&cfg.base),
            backing,
            disk_node: node_name(&top, 0),
            disk: top,
            seed: self.layout.vm_seed(name),
            qmp: self.layout.vm_qmp(name),
            qga: self.layout.vm_qga(name),
            serial: self.layout.vm_serial(name),
            run_log: self.layout.vm_run_log(name),
            pidfile: self.layout.vm_pidfile(name),
            boot: self.storage.base_boot(base),
            accel: self.config.accel.accel,
            tcg_tb_size_mib: self.config.tcg_tb_size_mib,
            sandbox: self.config.sandbox,
            proxy: self.layout.vm_proxy(name),
            socat: self.config.socat.clone(),
            relay: self.config.relay.clone(),
            net: self
                .config
                .net
                .as_ref()
                .map(|_| self.layout.vm_net_sock(name)),
            incoming: false,
            ram: None,
            frozen: false,
            screen: true,
        }
    }

    /// What the VM's `boxery-net` is given.
    pub(super) fn net_spec(&self, name: &str, port: u16) -> super::net::NetSpec {
        super::net::NetSpec {
            dir: self.vm_dir(name),
            sock: self.layout.vm_net_sock(name),
            pidfile: self.layout.vm_net_pidfile(name),
            log: self.layout.vm_net_log(name),
            qemu_pidfile: self.layout.vm_pidfile(name),
            stats: self.layout.vm_net_stats(name),
            proxy: self.layout.vm_proxy(name),
            dns: self.layout.vm_dns(name),
            dns_tcp: self.layout.vm_dns_tcp(name),
            port,
        }
    }

    /// Boot a stopped VM, or resume a suspended one (lock held). Errors a person must fix are
    /// `Invalid`. A disk still more than one overlay deep (a linked image layer, a stream cut
    /// short) boots as it is and is streamed back to one overlay on its base in the background.
    pub(super) async fn boot(self: &Arc<Self>, cfg: &VmConfig) -> Result<()> {
        let name = &cfg.name;
        self.memory_repair(name).await?;
        if self.pid(name).is_some() {
            return Ok(());
        }
        // suspended: the same QEMU command line, waiting for its memory (super::memory)
        let saved = self.load_memory(name)?;
        let base = self.load_base(&cfg.base)?;
        let chain = self.offline_chain(cfg).await?;
        self.remove_unused(name, &chain)?;
        let mut spec = self.launch_spec(cfg, &base, &chain);
        if let Some(rec) = &saved {
            // a state saved before VMs had screens comes back without one
            spec.screen = process::had_screen(&rec.args);
            self.check_restorable(cfg, rec, &spec)?;
            spec.incoming = true;
            if rec.shared_ram {
                spec.ram = Some(process::RamFile::Private(self.layout.vm_memory_ram(name)));
            }
        } else {
            // a cold boot: the seed gives the guest its own identity
            self.forget_inherited(name)?;
        }
        // a network helper left by a boot cut short (a killed control plane) holds the
        // VM's port with no QEMU behind it: it goes (a new one is started below)
        self.stop_net(name).await;
        self.claim_port(name, cfg.port)?;
        self.wait_port(name, cfg.port).await?;
        let t = Instant::now();
        if let Some(bin) = &self.config.net {
            // the old QEMU's pidfile must not be taken for the new one's
            let _ = remove_file_if_exists(&spec.pidfile);
            let net = self.net_spec(name, cfg.port);
            let helper = super::net::start(bin, &net, Duration::from_secs(10))
                .await
                .map_err(|e| BackendError::failed(format!("start the network of VM {name}"), e))?;
            debug!(vm = name.as_str(), pid = helper, "boxery-net started");
        }
        let launched = process::launch(
            &self.config.qemu,
            &spec,
            &self.layout.vm_log(name),
            self.config.start_timeout,
        )
        .await;
        if launched.is_err() {
            self.stop_net(name).await;
        }
        let pid = launched.map_err(|e| match e {
            process::ProcessError::Missing { .. } | process::ProcessError::Start { .. } => {
                BackendError::Invalid(format!(
                    "{} ({})",
                    crate::error_chain(&e),
                    self.config.accel.reason
                ))
            }
            e => BackendError::failed(format!("start VM {name}"), e),
        })?;
        if let Some(rec) = &saved {
            self.load_saved(cfg, rec, pid, base.guest_agent).await?;
        }
        info!(vm = name.as_str(), pid, port = cfg.port, accel = %self.config.accel.accel, depth = chain.len() - 1, resumed = saved.is_some(), secs = t.elapsed().as_secs_f64(), "QEMU started");
        if chain.len() > 2 {
            let mut q = self.qmp(name).await?;
            q.block_stream(STREAM_JOB, &spec.disk_node, BASE_NODE)
                .await
                .map_err(|e| BackendError::failed(format!("stream the disk of VM {name}"), e))?;
            drop(q);
            self.settle_later(name.clone());
        }
        Ok(())
    }

    /// Wait (bounded) until the VM's ssh port is free: a QEMU that has just exited may still
    /// be releasing it.
    pub(super) async fn wait_port(&self, name: &str, port: u16) -> Result<()> {
        let mut tries = 0;
        while !process::port_free(port) && tries < 20 {
            tries += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if process::port_free(port) {
            return Ok(());
        }
        Err(BackendError::failed(
            format!("start VM {name}"),
            format!(
                "its ssh port 127.0.0.1:{port} is taken by another process (not a boxery VM): free it (`ss -ltnp sport = :{port}`) and retry"
            ),
        ))
    }

    /// Power a running VM off (lock held): ACPI button when the guest handles it, then `quit`,
    /// then signals.
    /// A suspended VM's saved memory is discarded (it is off).
    pub(super) async fn shutdown(&self, name: &str, graceful: bool) -> Result<()> {
        let dir = self.vm_dir(name);
        self.memory_repair(name).await?;
        self.discard_memory(name)?;
        let Some(pid) = self.pid(name) else {
            self.after_exit(name).await;
            return Ok(());
        };
        let acpi = match self.load_vm(name)? {
            Some(cfg) => self
                .load_base(&cfg.base)
                .map(|b| b.boot.acpi_shutdown)
                .unwrap_or(true),
            None => false,
        };
        if graceful
            && acpi
            && let Ok(mut q) = self.qmp(name).await
            && q.system_powerdown().await.is_ok()
        {
            drop(q);
            if process::wait_gone(pid, self.config.powerdown_timeout).await {
                self.after_exit(name).await;
                return Ok(());
            }
            warn!(vm = name, timeout = ?self.config.powerdown_timeout, "the guest did not power off on the ACPI button; quitting QEMU");
        }
        if let Ok(Ok(mut q)) = tokio::time::timeout(Duration::from_secs(5), self.qmp(name)).await {
            let _ = q.quit().await;
            drop(q);
            if process::wait_gone(pid, Duration::from_secs(10)).await {
                self.after_exit(name).await;
                return Ok(());
            }
        }
        process::terminate(pid, &dir, Duration::from_secs(5))
            .await
            .map_err(|e| BackendError::failed(format!("stop VM {name}"), e))?;
        self.after_exit(name).await;
        Ok(())
    }

    /// Why the running VM `name` (its QEMU `qemu`) has no network: that QEMU was started on
    /// a `boxery-net` (its netdev names the VM's `net.sock`) and no helper of this VM runs.
    /// `None` when one does, or when the VM is on QEMU's own network.
    pub(super) fn net_down(&self, name: &str, qemu: i32) -> Option<String> {
        let sock = self.layout.vm_net_sock(name);
        if !process::names_path(qemu, &sock) {
            return None;
        }
        let helper = process::read_pid(&self.layout.vm_net_pidfile(name));
        if helper.is_some_and(|p| super::net::is_our_helper(p, &self.vm_dir(name))) {
            return None;
        }
        Some("its network helper (boxery-net) is not running, so the guest has no network".into())
    }

    /// Start the network helper of a running VM whose helper died (lock held): QEMU's stream
    /// netdev reconnects to the new one within a fraction of a second; connections that went
    /// through the old one (an ssh session) are lost, the guest keeps running.
    pub(super) async fn restart_net(&self, cfg: &VmConfig) -> Result<()> {
        let name = &cfg.name;
        let Some(qemu) = self.pid(name) else {
            return Ok(());
        };
        if self.net_down(name, qemu).is_none() {
            return Ok(());
        }
        let step = || format!("start the network of VM {name} again");
        let Some(bin) = &self.config.net else {
            return Err(BackendError::failed(
                step(),
                "this control plane runs without boxery-net (BOXERY_NET=off, or the binary is not beside boxery): build it (cargo build --release -p boxery-net) or stop and start the VM to put it on QEMU's own network",
            ));
        };
        let pid = super::net::start(bin, &self.net_spec(name, cfg.port), Duration::from_secs(10))
            .await
            .map_err(|e| BackendError::failed(step(), e))?;
        info!(
            vm = name.as_str(),
            pid, qemu, "boxery-net started again under the running VM"
        );
        Ok(())
    }

    /// End the VM's `boxery-net`, if one runs (it ends by itself once QEMU has; this makes
    /// it now, before the VM's directory changes).
    pub(super) async fn stop_net(&self, name: &str) {
        super::net::stop(&self.layout.vm_net_pidfile(name), &self.vm_dir(name)).await;
    }

    /// QEMU has exited: its network helper goes too, then the runtime files.
    async fn after_exit(&self, name: &str) {
        self.stop_net(name).await;
        self.clear_runtime_files(name);
    }

    pub(super) fn clear_runtime_files(&self, name: &str) {
        for p in [
            self.layout.vm_pidfile(name),
            self.layout.vm_qmp(name),
            self.layout.vm_qga(name),
        ] {
            let _ = remove_file_if_exists(&p);
        }
        // screendumps a killed control plane did not get to remove
        if let Ok(entries) = std::fs::read_dir(self.vm_dir(name)) {
            for e in entries.flatten() {
                if super::screen::is_dump_file(&e.file_name().to_string_lossy()) {
                    let _ = remove_file_if_exists(&e.path());
                }
            }
        }
    }

    /// Reserve a free loopback port for VM `name` (`ports/<port>` made with O_EXCL).
    pub(super) fn reserve_port(&self, name: &str) -> Result<u16> {
        let range = self.config.ports.clone();
        let len = u32::from(*range.end() - *range.start()) + 1;
        let offset = rand::random::<u32>() % len;
        for i in 0..len {
            let port = *range.start() + ((offset + i) % len) as u16;
            let path = self.layout.port(port);
            if path.exists() || !process::port_free(port) {
                continue;
            }
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(name.as_bytes())
                        .map_err(io(format!("reserving port {port}")))?;
                    return Ok(port);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(BackendError::io(format!("reserving port {port}"), e)),
            }
        }
        Err(BackendError::failed(
            "reserve an ssh port",
            format!(
                "no free loopback port in {}-{} (BOXERY_QEMU_PORTS)",
                range.start(),
                range.end()
            ),
        ))
    }

    /// Make sure `ports/<port>` names VM `name` (recreated when missing).
    pub(super) fn claim_port(&self, name: &str, port: u16) -> Result<()> {
        let path = self.layout.port(port);
        match std::fs::read_to_string(&path) {
            Ok(owner) if owner.trim() == name => Ok(()),
            Ok(owner) => Err(BackendError::failed(
                format!("start VM {name}"),
                format!(
                    "its port {port} is reserved for VM {} in {}",
                    owner.trim(),
                    path.display()
                ),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                crate::storage::files::write_atomic(&path, name.as_bytes(), 0o644)
                    .map_err(io(format!("reserving port {port}")))
            }
            Err(e) => Err(BackendError::io(format!("reading {}", path.display()), e)),
        }
    }

    /// Release every port reserved for VM `name`.
    pub(super) fn release_ports(&self, name: &str) -> Result<()> {
        let dir = self.layout.ports();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(BackendError::io(format!("listing {}", dir.display()), e)),
        };
        for e in entries.flatten() {
            if std::fs::read_to_string(e.path()).is_ok_and(|o| o.trim() == name) {
                remove_file_if_exists(&e.path())
                    .map_err(io(format!("releasing {}", e.path().display())))?;
            }
        }
        Ok(())
    }

    /// Remove VM `name` entirely: its QEMU (when ours), its directory, its port (lock held).
    pub(super) async fn destroy(&self, name: &str) -> Result<()> {
        if self.pid(name).is_some() {
            self.shutdown(name, false).await?;
        }
        self.stop_net(name).await;
        remove_dir_if_exists(&self.vm_dir(name))
            .map_err(io(format!("removing {}", self.vm_dir(name).display())))?;
        self.release_ports(name)
    }

    pub(super) fn check_tools(&self) -> Result<()> {
        if self.tools_ok.get().is_some() {
            return Ok(());
        }
        let runs = |bin: &Path, arg: &str| {
            std::process::Command::new(bin)
                .arg(arg)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let mut missing = Vec::new();
        if !runs(&self.config.qemu, "--version") {
            missing.push(format!(
                "{} (package qemu-system-x86, from bookworm-backports on Debian 12)",
                self.config.qemu.display()
            ));
        }
        if !runs(&self.config.storage.qemu_img, "--version") {
            missing.push(format!(
                "{} (package qemu-utils)",
                self.config.storage.qemu_img.display()
            ));
        }
        if !runs(&self.config.storage.genisoimage, "-version") {
            missing.push("genisoimage (package genisoimage)".into());
        }
        if !runs(Path::new("ssh-keygen"), "-?") && !Path::new("/usr/bin/ssh-keygen").exists() {
            missing.push("ssh-keygen (package openssh-client)".into());
        }
        if let Some(n) = &self.config.net
            && !n.is_file()
        {
            missing.push(format!(
                "{} (BOXERY_NET: it runs the VMs' network; BOXERY_NET=off uses QEMU's own)",
                n.display()
            ));
        }
        if let Some(r) = &self.config.relay {
            if !r.is_file() {
                missing.push(format!(
                    "{} (BOXERY_RELAY: it carries the guest's proxy channel)",
                    r.display()
                ));
            }
        } else if !runs(&self.config.socat, "-V") {
            missing.push(format!(
                "{} (package socat: it carries the guest's credential proxy channel)",
                self.config.socat.display()
            ));
        }
        if missing.is_empty() {
            let _ = self.tools_ok.set(());
            Ok(())
        } else {
            Err(BackendError::Invalid(format!(
                "the qemu backend needs {}: run scripts/install-deps.sh",
                missing.join(", ")
            )))
        }
    }

    /// VM `name`'s seed: the directory of its loose files and the ISO.
    pub(super) fn seed_files(&self, name: &str) -> (PathBuf, PathBuf) {
        (self.vm_dir(name).join("seed"), self.layout.vm_seed(name))
    }

    pub(super) fn write_known_hosts(&self, cfg: &VmConfig) -> Result<()> {
        let path = self.layout.vm_known_hosts(&cfg.name);
        match &cfg.host_key {
            Some(key) => {
                // two lines, one key: for `-p PORT agent@127.0.0.1` and for `HostKeyAlias NAME.boxery`
                let by_port =
                    crate::identity::known_hosts_line(&format!("[127.0.0.1]:{}", cfg.port), key);
                let by_alias =
                    crate::identity::known_hosts_line(&format!("{}.boxery", cfg.name), key);
                crate::storage::files::write_atomic(
                    &path,
                    format!("{by_port}\n{by_alias}\n").as_bytes(),
                    0o644,
                )
                .map_err(io(format!("writing {}", path.display())))
            }
            None => {
                remove_file_if_exists(&path).map_err(io(format!("removing {}", path.display())))
            }
        }
    }

    pub(super) async fn create_inner(self: &Arc<Self>, vm: &NewVm) -> Result<()> {
        let name = vm.name.as_str();
        let crate::DiskSource::Image(image) = &vm.source;
        let rec = self.storage.usable_image(image)?;
        let base = self.load_base(&rec.base)?;
        let want = vm.disk_gib.saturating_mul(GIB);
        if want < rec.virtual_size {
            return Err(BackendError::Invalid(format!(
                "a {} GiB disk is smaller than image {image} ({:.1} GiB): ask for at least {} GiB",
                vm.disk_gib,
                rec.virtual_size as f64 / GIB as f64,
                rec.virtual_size.div_ceil(GIB)
            )));
        }

        let dir = self.vm_dir(name);
        let t = Instant::now();
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io(format!("chmod {}", dir.display())))?;
        }
        let port = self.reserve_port(name)?;
        self.attach_image(name, image, 1, want).await?;
        let (work, iso) = self.seed_files(name);
        let cfg = self
            .storage
            .seed_new_vm(vm, &base.id, vm.disk_gib, port, &work, &iso)
            .await?;
        if vm.memory {
            // the guest continues from the image's instant with its source's identity: it
            // is given its own over ssh (`inherited`); its seed holds that one for a cold boot
            let rec = self.memory_to_start(&cfg, &base, image)?;
            let inherited = crate::Inherited {
                answers_with: rec.host_key.clone().unwrap_or_default(),
                identity: vm.identity.clone(),
                mac: Some(cfg.mac.clone()),
            };
            let path = self.layout.vm_inherited(name);
            crate::storage::files::write_json(&path, &inherited, 0o600)
                .map_err(io(format!("writing {}", path.display())))?;
            self.install_image_memory(name, image, &rec)?;
        }
        self.write_known_hosts(&cfg)?;
        self.save_vm(&cfg)?;
        info!(
            vm = name,
            image = image.as_str(),
            port,
            secs = t.elapsed().as_secs_f64(),
            "VM created"
        );
        if vm.start {
            self.boot(&cfg).await?;
        }
        Ok(())
    }
}
