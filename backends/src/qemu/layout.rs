//! The qemu backend's state directory.
//!
//! ```text
//! $BOXERY_HOME/qemu/
//!   base/<id>/          a stock base, read-only (files 0444): disk.qcow2, vmlinuz, initrd.img,
//!                       base.json (boot: kernel, initrd, cmdline, machine); the directory is
//!                       renamed into place complete
//!   images/<name>.qcow2 an image: one qcow2 overlay on a base (0444)
//!   images/<name>.json  its record (mark, base, created); the image's commit point
//!   vms/<name>/         one VM: config.json (the commit point), disk-<gen>.qcow2 (its own
//!                       overlays; the highest generation is the active one), layer-<gen>.qcow2
//!                       (an image hard-linked in, read-only, until streamed up), seed.iso and
//!                       seed/, known_hosts, qemu.pid, qmp.sock, qga.sock, proxy.sock (the credential
//!                       proxy's channel, served by the control plane), net.sock, net.pid and
//!                       net.log (the VM's boxery-net, when it carries the network), serial.log,
//!                       qemu.log, qemu-run.log, .screen-PID-RANDOM.png (a screendump while it
//!                       is read back)
//!   ports/<port>        a loopback port reserved for a VM (holds its name)
//!   locks/vm-<name>.lock, locks/image-<name>.lock, locks/base-<id>.lock
//!                       flocks, each held for the length of a mutating operation
//! ```
//!
//! Every file is written with the storage module's primitives ([`crate::storage::files`]):
//! to a temporary name in the same directory, then renamed into place.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where everything of one qemu backend lives.
#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
}

/// A unix socket path may be at most this long (sun_path is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

impl Layout {
    /// A layout rooted at `root` (`$BOXERY_HOME/qemu`). Relative roots are made absolute,
    /// because QEMU runs with `/` as its working directory once daemonized.
    pub fn new(root: PathBuf) -> Self {
        let root = if root.is_absolute() {
            root
        } else {
            std::env::current_dir()
                .map(|d| d.join(&root))
                .unwrap_or(root)
        };
        Layout { root }
    }
    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// `base/`.
    pub fn bases(&self) -> PathBuf {
        self.root.join("base")
    }
    /// `base/<id>/`.
    pub fn base_dir(&self, id: &str) -> PathBuf {
        self.bases().join(id)
    }
    /// `images/`.
    pub fn images(&self) -> PathBuf {
        self.root.join("images")
    }
    /// `images/<name>.qcow2`.
    pub fn image_disk(&self, name: &str) -> PathBuf {
        self.images().join(format!("{name}.qcow2"))
    }
    /// `images/<name>.json`.
    pub fn image_record(&self, name: &str) -> PathBuf {
        self.images().join(format!("{name}.json"))
    }
    /// `image-memory/`: the memory images carry (`capture_memory`), beside `images/` (whose
    /// `*.json` are image records only).
    pub fn image_memories(&self) -> PathBuf {
        self.root.join("image-memory")
    }
    /// `image-memory/<name>.state`: the memory image `name` carries.
    pub fn image_memory(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!("{name}.state"))
    }
    /// `image-memory/<name>.json`: its record (written before the image's own record).
    pub fn image_memory_record(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!("{name}.json"))
    }
    /// `image-memory/<name>.ram`: the guest RAM of a memory image in shared form (a raw
    /// file VMs started from it map privately: their unwritten pages stay shared).
    pub fn image_memory_ram(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!("{name}.ram"))
    }
    /// `image-memory/<name>.dev`: the device state beside [`Self::image_memory_ram`].
    pub fn image_memory_dev(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!("{name}.dev"))
    }
    /// `image-memory/.<name>.convert/`: where a memory image is turned into its shared form.
    pub fn image_memory_scratch(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!(".{name}.convert"))
    }
    /// `image-memory/.<name>.state.part`: the memory while QEMU writes it.
    pub fn image_memory_part(&self, name: &str) -> PathBuf {
        self.image_memories().join(format!(".{name}.state.part"))
    }
    /// `vms/`.
    pub fn vms(&self) -> PathBuf {
        self.root.join("vms")
    }
    /// `vms/<name>/`.
    pub fn vm_dir(&self, name: &str) -> PathBuf {
        self.vms().join(name)
    }
    /// `vms/<name>/config.json`.
    pub fn vm_config(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("config.json")
    }
    /// `vms/<name>/disk-<gen>.qcow2`.
    pub fn vm_disk(&self, name: &str, generation: u64) -> PathBuf {
        self.vm_dir(name).join(format!("disk-{generation}.qcow2"))
    }
    /// `vms/<name>/seed.iso`.
    pub fn vm_seed(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("seed.iso")
    }
    /// `vms/<name>/known_hosts`.
    pub fn vm_known_hosts(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("known_hosts")
    }
    /// `vms/<name>/qemu.pid`.
    pub fn vm_pidfile(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("qemu.pid")
    }
    /// `vms/<name>/qmp.sock`.
    pub fn vm_qmp(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("qmp.sock")
    }
    /// `vms/<name>/qga.sock` (the guest agent's channel).
    pub fn vm_qga(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("qga.sock")
    }
    /// `vms/<name>/proxy.sock`: the credential proxy's channel for this VM, served by the
    /// control plane (`guestfwd` connects to it).
    pub fn vm_proxy(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("proxy.sock")
    }
    /// `vms/<name>/dns.sock`: the control plane's answers to this VM's name lookups (a
    /// datagram socket `boxery-net` sends them to).
    pub fn vm_dns(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("dns.sock")
    }
    /// `vms/<name>/dns-tcp.sock`: the control plane's end of this VM's name lookups over TCP
    /// (a stream socket `boxery-net`'s slirp connects each of them to).
    pub fn vm_dns_tcp(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("dns-tcp.sock")
    }
    /// `vms/<name>/net.sock`: where QEMU's stream netdev reaches the VM's `boxery-net`.
    pub fn vm_net_sock(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("net.sock")
    }
    /// `vms/<name>/net.pid`: the VM's `boxery-net`.
    pub fn vm_net_pidfile(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("net.pid")
    }
    /// `vms/<name>/net.stats`: the guest's network byte counts, kept by its `boxery-net`.
    pub fn vm_net_stats(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("net.stats")
    }
    /// `vms/<name>/net.log`: what the VM's `boxery-net` says.
    pub fn vm_net_log(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("net.log")
    }
    /// `vms/<name>/memory.state`: a suspended VM's memory and device state (QEMU's
    /// `mapped-ram` migration format, sparse).
    pub fn vm_memory(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("memory.state")
    }
    /// `vms/<name>/.memory.state.part`: the state while QEMU writes it.
    pub fn vm_memory_part(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join(".memory.state.part")
    }
    /// `vms/<name>/memory.json`: the saved state's record, its commit point (written last).
    pub fn vm_memory_record(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("memory.json")
    }
    /// `vms/<name>/memory.ram` and `memory.dev`: a memory image in shared form installed for
    /// the VM's next start (links to the image's files).
    pub fn vm_memory_ram(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("memory.ram")
    }
    /// See [`Self::vm_memory_ram`].
    pub fn vm_memory_dev(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("memory.dev")
    }
    /// `vms/<name>/inherited.json`: a VM started from another VM's memory, until its guest
    /// has taken its own identity ([`crate::Inherited`]; 0600, it holds a private key).
    pub fn vm_inherited(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("inherited.json")
    }
    /// `vms/<name>/serial.log`.
    pub fn vm_serial(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("serial.log")
    }
    /// `vms/<name>/qemu.log` (QEMU's stderr while it starts).
    pub fn vm_log(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("qemu.log")
    }
    /// `vms/<name>/qemu-run.log` (QEMU's stderr once daemonized: `-D`; what it says when it
    /// aborts, or which signal ended it).
    pub fn vm_run_log(&self, name: &str) -> PathBuf {
        self.vm_dir(name).join("qemu-run.log")
    }
    /// `ports/`.
    pub fn ports(&self) -> PathBuf {
        self.root.join("ports")
    }
    /// `ports/<port>`.
    pub fn port(&self, port: u16) -> PathBuf {
        self.ports().join(port.to_string())
    }
    /// `locks/`.
    pub fn locks(&self) -> PathBuf {
        self.root.join("locks")
    }
    /// `locks/vm-<name>.lock`.
    pub fn vm_lock(&self, name: &str) -> PathBuf {
        self.locks().join(format!("vm-{name}.lock"))
    }
    /// `locks/image-<name>.lock`.
    pub fn image_lock(&self, name: &str) -> PathBuf {
        self.locks().join(format!("image-{name}.lock"))
    }
    /// `base/<id>/base.json`.
    pub fn base_record(&self, id: &str) -> PathBuf {
        self.base_dir(id).join("base.json")
    }

    /// Create the directories (idempotent).
    pub fn ensure(&self) -> std::io::Result<()> {
        for d in [
            self.bases(),
            self.images(),
            self.image_memories(),
            self.vms(),
            self.ports(),
            self.locks(),
        ] {
            fs::create_dir_all(&d)?;
        }
        fs::set_permissions(&self.root, fs::Permissions::from_mode(0o700))?;
        Ok(())
    }
}
