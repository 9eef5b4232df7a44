//! A safe wrapper over libslirp 4.7: one user-mode network stack, driven by a `poll(2)` loop
//! of the caller's.
//!
//! # Guarantees
//! - [`Slirp`] owns its stack: dropping it calls `slirp_cleanup` (which closes every socket
//!   slirp opened, the hostfwd listeners included) and frees the timers slirp created.
//! - Frames slirp emits reach [`Guest::send`] only from inside [`Slirp::input`],
//!   [`Slirp::dispatch`] (socket events and timers): never behind the caller's back.
//! - A timer freed or re-armed by an earlier timer callback of the same round is not fired.
//!
//! # Assumptions
//! - The system's libslirp is 4.7 (`libslirp.so.0`, Debian 12's libslirp0, a QEMU
//!   dependency): [`ffi`] mirrors its `libslirp.h` by hand, `SlirpConfig` version 4 and
//!   `SlirpCb` with the two fields version 4 added. The unit tests check the layout against
//!   offsets measured with gcc from that header, and that `slirp_new` accepts the config.
//! - One thread drives a [`Slirp`] (libslirp is not thread-safe): the type is neither `Send`
//!   nor `Sync`.
//!
//! # Caveats
//! - [`Slirp::wait`] and [`Slirp::dispatch`] go together: the indexes slirp hands to
//!   `get_revents` are those of the last `wait`.
//! - libslirp logs through glib (to stderr), e.g. `open_unix(): No such file or directory`
//!   when a guest connects to a [`Slirp::add_unix`] forward whose socket is absent; the guest's
//!   connection is then opened and closed at once.
#![allow(unsafe_code)] // the FFI to libslirp; each block says why it holds

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;

/// libslirp 4.7's C interface, written by hand from its `libslirp.h` (no bindgen, no
/// libslirp-dev at build time). Only what boxery-net uses is declared.
pub mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    /// The opaque slirp state (`struct Slirp`).
    #[repr(C)]
    pub struct Slirp {
        _private: [u8; 0],
        _not_send: std::marker::PhantomData<*mut u8>,
    }

    /// `SlirpWriteCb`: send a frame (or write saved state).
    pub type SlirpWriteCb =
        unsafe extern "C" fn(buf: *const c_void, len: usize, opaque: *mut c_void) -> isize;
    /// `SlirpTimerCb`: what a timer runs when it expires.
    pub type SlirpTimerCb = unsafe extern "C" fn(opaque: *mut c_void);
    /// `SlirpAddPollCb`: add `fd` for `events`, returning an index for `get_revents`.
    pub type SlirpAddPollCb =
        unsafe extern "C" fn(fd: c_int, events: c_int, opaque: *mut c_void) -> c_int;
    /// `SlirpGetREventsCb`: the events that happened on the fd of index `idx`.
    pub type SlirpGetREventsCb = unsafe extern "C" fn(idx: c_int, opaque: *mut c_void) -> c_int;

    /// `SLIRP_POLL_IN`.
    pub const SLIRP_POLL_IN: c_int = 1 << 0;
    /// `SLIRP_POLL_OUT`.
    pub const SLIRP_POLL_OUT: c_int = 1 << 1;
    /// `SLIRP_POLL_PRI`.
    pub const SLIRP_POLL_PRI: c_int = 1 << 2;
    /// `SLIRP_POLL_ERR`.
    pub const SLIRP_POLL_ERR: c_int = 1 << 3;
    /// `SLIRP_POLL_HUP`.
    pub const SLIRP_POLL_HUP: c_int = 1 << 4;

    /// `SLIRP_CONFIG_VERSION_MAX` of libslirp 4.7 (adds `disable_dhcp`, and the two last
    /// fields of [`SlirpCb`]).
    pub const SLIRP_CONFIG_VERSION: u32 = 4;

    /// `SlirpCb`: the application's callbacks. The struct must outlive the `Slirp`: slirp
    /// keeps the pointer.
    #[repr(C)]
    pub struct SlirpCb {
        /// A frame for the guest; may be dropped when the guest is not there.
        pub send_packet: Option<SlirpWriteCb>,
        /// A message about guest misbehaviour.
        pub guest_error: Option<unsafe extern "C" fn(msg: *const c_char, opaque: *mut c_void)>,
        /// The clock, in nanoseconds (timers are in milliseconds on the same scale).
        pub clock_get_ns: Option<unsafe extern "C" fn(opaque: *mut c_void) -> i64>,
        /// A new timer running `cb(cb_opaque)`.
        pub timer_new: Option<
            unsafe extern "C" fn(
                cb: Option<SlirpTimerCb>,
                cb_opaque: *mut c_void,
                opaque: *mut c_void,
            ) -> *mut c_void,
        >,
        /// Free a timer.
        pub timer_free: Option<unsafe extern "C" fn(timer: *mut c_void, opaque: *mut c_void)>,
        /// Arm a timer to expire at `expire_time` (ms).
        pub timer_mod:
            Option<unsafe extern "C" fn(timer: *mut c_void, expire_time: i64, opaque: *mut c_void)>,
        /// A fd to poll from now on (unused with `slirp_pollfds_fill`).
        pub register_poll_fd: Option<unsafe extern "C" fn(fd: c_int, opaque: *mut c_void)>,
        /// A fd no longer to poll.
        pub unregister_poll_fd: Option<unsafe extern "C" fn(fd: c_int, opaque: *mut c_void)>,
        /// Kick the loop (a socket can take more data).
        pub notify: Option<unsafe extern "C" fn(opaque: *mut c_void)>,
        /// Version 4: the `Slirp` was made (NULL: not called).
        pub init_completed: Option<unsafe extern "C" fn(slirp: *mut Slirp, opaque: *mut c_void)>,
        /// Version 4: timers by id, fired through `slirp_handle_timer` (NULL: `timer_new`
        /// is used).
        pub timer_new_opaque: Option<
            unsafe extern "C" fn(
                id: c_int,
                cb_opaque: *mut c_void,
                opaque: *mut c_void,
            ) -> *mut c_void,
        >,
    }

    /// `SlirpConfig`, version 4 (libslirp 4.7). C `bool` is Rust `bool`; `struct in6_addr`
    /// is 4-aligned (as `libc::in6_addr`), `size_t` is `usize`.
    #[repr(C)]
    pub struct SlirpConfig {
        /// Must be 1..=4; [`SLIRP_CONFIG_VERSION`].
        pub version: u32,
        /// Non-zero: the guest reaches only the host's forwards, no outside address.
        pub restricted: c_int,
        /// IPv4 on.
        pub in_enabled: bool,
        /// The virtual network.
        pub vnetwork: libc::in_addr,
        /// Its mask.
        pub vnetmask: libc::in_addr,
        /// The host's (gateway's) address in it.
        pub vhost: libc::in_addr,
        /// IPv6 on.
        pub in6_enabled: bool,
        /// The IPv6 prefix.
        pub vprefix_addr6: libc::in6_addr,
        /// Its length.
        pub vprefix_len: u8,
        /// The host's IPv6 address.
        pub vhost6: libc::in6_addr,
        /// The host name the DHCP server gives (NULL: none).
        pub vhostname: *const c_char,
        /// TFTP server name (NULL: none).
        pub tftp_server_name: *const c_char,
        /// TFTP root (NULL: TFTP off).
        pub tftp_path: *const c_char,
        /// BOOTP file name.
        pub bootfile: *const c_char,
        /// The first address DHCP leases.
        pub vdhcp_start: libc::in_addr,
        /// The DNS server's address.
        pub vnameserver: libc::in_addr,
        /// The IPv6 DNS server's address.
        pub vnameserver6: libc::in6_addr,
        /// DNS search list (`const char **`, NULL-terminated; NULL: none).
        pub vdnssearch: *mut *const c_char,
        /// DNS domain name (NULL: none).
        pub vdomainname: *const c_char,
        /// 0: the default MTU (1500).
        pub if_mtu: usize,
        /// 0: the default MRU (1500).
        pub if_mru: usize,
        /// Refuse guest connections to the host's loopback.
        pub disable_host_loopback: bool,
        /// The protocol emulation code (unsafe; off).
        pub enable_emu: bool,
        /// Version 2: the source address of outbound connections (NULL: any).
        pub outbound_addr: *mut libc::sockaddr_in,
        /// Version 2: the same for IPv6.
        pub outbound_addr6: *mut libc::sockaddr_in6,
        /// Version 3: no DNS forwarding at all.
        pub disable_dns: bool,
        /// Version 4: no DHCP server.
        pub disable_dhcp: bool,
    }

    // libslirp0's file is `libslirp.so.0`; without libslirp-dev there is no `libslirp.so`
    // for `-lslirp`, hence the verbatim name.
    #[link(name = "libslirp.so.0", kind = "dylib", modifiers = "+verbatim")]
    unsafe extern "C" {
        /// A new stack, or NULL when the config is refused.
        pub fn slirp_new(
            cfg: *const SlirpConfig,
            callbacks: *const SlirpCb,
            opaque: *mut c_void,
        ) -> *mut Slirp;
        /// Shut a stack down (closes its sockets, frees its timers through `timer_free`).
        pub fn slirp_cleanup(slirp: *mut Slirp);
        /// Before sleeping: add the fds to poll; lowers `*timeout` (ms).
        pub fn slirp_pollfds_fill(
            slirp: *mut Slirp,
            timeout: *mut u32,
            add_poll: SlirpAddPollCb,
            opaque: *mut c_void,
        );
        /// After sleeping: handle the fds' events (`select_error`: 1 when poll failed).
        pub fn slirp_pollfds_poll(
            slirp: *mut Slirp,
            select_error: c_int,
            get_revents: SlirpGetREventsCb,
            opaque: *mut c_void,
        );
        /// A frame from the guest.
        pub fn slirp_input(slirp: *mut Slirp, pkt: *const u8, pkt_len: c_int);
        /// Forward host `host_addr:host_port` to the guest's `guest_addr:guest_port`
        /// (0.0.0.0: the first DHCP address). 0, or -1 with errno set by the failed call.
        pub fn slirp_add_hostfwd(
            slirp: *mut Slirp,
            is_udp: c_int,
            host_addr: libc::in_addr,
            host_port: c_int,
            guest_addr: libc::in_addr,
            guest_port: c_int,
        ) -> c_int;
        /// Guest connections to `guest_addr:guest_port` are `connect()`ed to the unix socket
        /// `unixsock`. 0, or -1 (address outside the network, or taken).
        pub fn slirp_add_unix(
            slirp: *mut Slirp,
            unixsock: *const c_char,
            guest_addr: *mut libc::in_addr,
            guest_port: c_int,
        ) -> c_int;
        /// Remove the guest forward of `guest_addr:guest_port` (`slirp_add_unix`'s among
        /// them; connections already open stay). 0, or -1 when there was none.
        pub fn slirp_remove_guestfwd(
            slirp: *mut Slirp,
            guest_addr: libc::in_addr,
            guest_port: c_int,
        ) -> c_int;
        /// The library's version, e.g. "4.7.0".
        pub fn slirp_version_string() -> *const c_char;
    }
}

/// The library's version string, e.g. `4.7.0`.
pub fn version() -> String {
    // SAFETY: slirp_version_string returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::slirp_version_string()) }
        .to_string_lossy()
        .into_owned()
}

/// What the guest side does with slirp's output.
pub trait Guest {
    /// An ethernet frame for the guest. Called from inside [`Slirp::input`] and
    /// [`Slirp::dispatch`]; dropping it is allowed (TCP retransmits).
    fn send(&mut self, frame: &[u8]);
    /// slirp's message about guest misbehaviour.
    fn guest_error(&mut self, msg: &str) {
        eprintln!("boxery-net: guest error: {msg}");
    }
}

/// The virtual network (IPv4 only; IPv6 is off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    /// The network address (10.0.2.0).
    pub network: Ipv4Addr,
    /// Its mask (255.255.255.0).
    pub netmask: Ipv4Addr,
    /// The host's address in it (10.0.2.2).
    pub host: Ipv4Addr,
    /// The first address DHCP gives (10.0.2.15).
    pub dhcp_start: Ipv4Addr,
    /// The DNS address (10.0.2.3).
    pub dns: Ipv4Addr,
    /// Restricted: the guest reaches nothing but the forwards (as QEMU's `restrict=on`).
    pub restricted: bool,
}

impl Default for Network {
    /// QEMU's user network, restricted: 10.0.2.0/24, host .2, DHCP from .15, DNS .3.
    fn default() -> Self {
        Network {
            network: Ipv4Addr::new(10, 0, 2, 0),
            netmask: Ipv4Addr::new(255, 255, 255, 0),
            host: Ipv4Addr::new(10, 0, 2, 2),
            dhcp_start: Ipv4Addr::new(10, 0, 2, 15),
            dns: Ipv4Addr::new(10, 0, 2, 3),
            restricted: true,
        }
    }
}

/// The failures of [`Slirp`]'s set-up calls.
#[derive(Debug, thiserror::Error)]
pub enum SlirpError {
    /// `slirp_new` refused the configuration (libslirp logs why on stderr).
    #[error("libslirp {version} refused the network configuration (slirp_new returned NULL)")]
    New {
        /// The library's version.
        version: String,
    },
    /// The host port of a forward could not be bound.
    #[error("cannot forward {host}:{port} to the guest's port {guest_port}")]
    HostFwd {
        /// Host address.
        host: Ipv4Addr,
        /// Host port.
        port: u16,
        /// Guest port.
        guest_port: u16,
        /// Why (EADDRINUSE: the port is taken).
        #[source]
        source: io::Error,
    },
    /// A unix-socket forward was refused.
    #[error(
        "cannot forward the guest's {guest}:{port} to {path}: the address must be in the network, not the host's or the DNS one, and not forwarded already"
    )]
    Unix {
        /// Guest address.
        guest: Ipv4Addr,
        /// Guest port.
        port: u16,
        /// The socket path.
        path: String,
    },
    /// A path with a NUL byte.
    #[error("{0:?} contains a NUL byte")]
    Nul(String),
}

/// A timer slirp made with `timer_new`.
struct Timer {
    cb: Option<ffi::SlirpTimerCb>,
    opaque: *mut c_void,
    /// When armed: the expiry (ms, `clock_ms` scale).
    expire_ms: Option<i64>,
    /// Picked to fire in this round (cleared by `timer_mod`, so a re-armed timer waits).
    due: bool,
}

/// What the callbacks reach through slirp's `opaque` pointer.
struct Inner<G> {
    guest: G,
    /// This round's pollfds: the caller's first, then slirp's.
    pollfds: Vec<libc::pollfd>,
    poll_failed: bool,
    /// Every live timer (each a leaked `Box<Timer>`).
    timers: Vec<NonNull<Timer>>,
}

/// One slirp stack and the guest side `G` it sends frames to.
pub struct Slirp<G: Guest> {
    raw: NonNull<ffi::Slirp>,
    /// A leaked `Box<Inner<G>>`: slirp's opaque. Only reached through raw pointers while
    /// slirp may call back (no `&mut Inner` lives across an FFI call).
    inner: NonNull<Inner<G>>,
    /// slirp keeps a pointer to the callbacks: boxed so they stay put.
    _callbacks: Box<ffi::SlirpCb>,
}

fn in_addr(a: Ipv4Addr) -> libc::in_addr {
    libc::in_addr {
        s_addr: u32::from(a).to_be(),
    }
}

/// CLOCK_MONOTONIC in nanoseconds (as QEMU gives slirp; never near 0, which slirp's TCP
/// timers read as "not set").
fn clock_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

fn clock_ms() -> i64 {
    clock_ns() / 1_000_000
}

fn to_poll(slirp: c_int) -> i16 {
    let mut e = 0;
    for (s, p) in FLAGS {
        if slirp & s != 0 {
            e |= p;
        }
    }
    e
}

fn from_poll(revents: i16) -> c_int {
    let mut e = 0;
    for (s, p) in FLAGS {
        if revents & p != 0 {
            e |= s;
        }
    }
    e
}

const FLAGS: [(c_int, i16); 5] = [
    (ffi::SLIRP_POLL_IN, libc::POLLIN),
    (ffi::SLIRP_POLL_OUT, libc::POLLOUT),
    (ffi::SLIRP_POLL_PRI, libc::POLLPRI),
    (ffi::SLIRP_POLL_ERR, libc::POLLERR),
    (ffi::SLIRP_POLL_HUP, libc::POLLHUP),
];

/// The `Inner` behind an opaque pointer.
///
/// # Safety
/// `opaque` is the `Inner<G>` of a live [`Slirp<G>`], and no other reference to it is live
/// (slirp calls back only from inside the calls [`Slirp`] makes, none of which holds one).
unsafe fn inner<'a, G>(opaque: *mut c_void) -> &'a mut Inner<G> {
    // SAFETY: as the function's contract says.
    unsafe { &mut *opaque.cast::<Inner<G>>() }
}

unsafe extern "C" fn cb_send_packet<G: Guest>(
    buf: *const c_void,
    len: usize,
    opaque: *mut c_void,
) -> isize {
    // SAFETY: slirp passes the opaque given to slirp_new, and a frame of len bytes.
    let (inner, frame) = unsafe {
        (
            inner::<G>(opaque),
            std::slice::from_raw_parts(buf.cast::<u8>(), len),
        )
    };
    inner.guest.send(frame);
    len as isize
}

unsafe extern "C" fn cb_guest_error<G: Guest>(msg: *const c_char, opaque: *mut c_void) {
    // SAFETY: slirp passes its opaque and a NUL-terminated message.
    let (inner, msg) = unsafe { (inner::<G>(opaque), CStr::from_ptr(msg)) };
    inner.guest.guest_error(&msg.to_string_lossy());
}

unsafe extern "C" fn cb_clock_get_ns(_opaque: *mut c_void) -> i64 {
    clock_ns()
}

unsafe extern "C" fn cb_timer_new<G>(
    cb: Option<ffi::SlirpTimerCb>,
    cb_opaque: *mut c_void,
    opaque: *mut c_void,
) -> *mut c_void {
    // SAFETY: slirp passes the opaque given to slirp_new.
    let inner = unsafe { inner::<G>(opaque) };
    let timer = NonNull::from(Box::leak(Box::new(Timer {
        cb,
        opaque: cb_opaque,
        expire_ms: None,
        due: false,
    })));
    inner.timers.push(timer);
    timer.as_ptr().cast()
}

unsafe extern "C" fn cb_timer_free<G>(timer: *mut c_void, opaque: *mut c_void) {
    // SAFETY: slirp passes the opaque given to slirp_new.
    let inner = unsafe { inner::<G>(opaque) };
    if let Some(i) = inner.timers.iter().position(|t| t.as_ptr().cast() == timer) {
        let t = inner.timers.swap_remove(i);
        // SAFETY: t came from Box::leak in cb_timer_new and was still registered.
        drop(unsafe { Box::from_raw(t.as_ptr()) });
    }
}

unsafe extern "C" fn cb_timer_mod<G>(timer: *mut c_void, expire_ms: i64, opaque: *mut c_void) {
    // SAFETY: slirp passes the opaque given to slirp_new.
    let inner = unsafe { inner::<G>(opaque) };
    if let Some(t) = inner.timers.iter().find(|t| t.as_ptr().cast() == timer) {
        // SAFETY: a registered timer is a live Box; nothing else borrows it now.
        let t = unsafe { &mut *t.as_ptr() };
        t.expire_ms = Some(expire_ms);
        t.due = false;
    }
}

unsafe extern "C" fn cb_fd_noop(_fd: c_int, _opaque: *mut c_void) {}

unsafe extern "C" fn cb_notify_noop(_opaque: *mut c_void) {}

unsafe extern "C" fn cb_add_poll<G>(fd: c_int, events: c_int, opaque: *mut c_void) -> c_int {
    // SAFETY: Slirp::wait passes its Inner as the opaque of slirp_pollfds_fill.
    let inner = unsafe { inner::<G>(opaque) };
    inner.pollfds.push(libc::pollfd {
        fd,
        events: to_poll(events),
        revents: 0,
    });
    (inner.pollfds.len() - 1) as c_int
}

unsafe extern "C" fn cb_get_revents<G>(idx: c_int, opaque: *mut c_void) -> c_int {
    // SAFETY: Slirp::dispatch passes its Inner as the opaque of slirp_pollfds_poll.
    let inner = unsafe { inner::<G>(opaque) };
    usize::try_from(idx)
        .ok()
        .and_then(|i| inner.pollfds.get(i))
        .map_or(0, |p| from_poll(p.revents))
}

impl<G: Guest> Slirp<G> {
    /// A new stack on `net` (IPv6 off, DNS and DHCP served as slirp does) sending to `guest`.
    pub fn new(net: &Network, guest: G) -> Result<Self, SlirpError> {
        let callbacks = Box::new(ffi::SlirpCb {
            send_packet: Some(cb_send_packet::<G>),
            guest_error: Some(cb_guest_error::<G>),
            clock_get_ns: Some(cb_clock_get_ns),
            timer_new: Some(cb_timer_new::<G>),
            timer_free: Some(cb_timer_free::<G>),
            timer_mod: Some(cb_timer_mod::<G>),
            register_poll_fd: Some(cb_fd_noop),
            unregister_poll_fd: Some(cb_fd_noop),
            notify: Some(cb_notify_noop),
            init_completed: None,
            timer_new_opaque: None,
        });
        let unspecified6 = libc::in6_addr { s6_addr: [0; 16] };
        let cfg = ffi::SlirpConfig {
            version: ffi::SLIRP_CONFIG_VERSION,
            restricted: c_int::from(net.restricted),
            in_enabled: true,
            vnetwork: in_addr(net.network),
            vnetmask: in_addr(net.netmask),
            vhost: in_addr(net.host),
            in6_enabled: false,
            vprefix_addr6: unspecified6,
            vprefix_len: 0,
            vhost6: unspecified6,
            vhostname: std::ptr::null(),
            tftp_server_name: std::ptr::null(),
            tftp_path: std::ptr::null(),
            bootfile: std::ptr::null(),
            vdhcp_start: in_addr(net.dhcp_start),
            vnameserver: in_addr(net.dns),
            vnameserver6: unspecified6,
            vdnssearch: std::ptr::null_mut(),
            vdomainname: std::ptr::null(),
            if_mtu: 0,
            if_mru: 0,
            disable_host_loopback: false,
            enable_emu: false,
            outbound_addr: std::ptr::null_mut(),
            outbound_addr6: std::ptr::null_mut(),
            disable_dns: false,
            disable_dhcp: false,
        };
        let inner = NonNull::from(Box::leak(Box::new(Inner {
            guest,
            pollfds: Vec::with_capacity(64),
            poll_failed: false,
            timers: Vec::new(),
        })));
        // SAFETY: cfg is a complete version-4 config (slirp copies what it keeps); the
        // callbacks are boxed and live as long as the Slirp; inner is the opaque the
        // callbacks expect.
        let raw = unsafe { ffi::slirp_new(&cfg, &*callbacks, inner.as_ptr().cast()) };
        let Some(raw) = NonNull::new(raw) else {
            // SAFETY: inner came from Box::leak above and slirp did not keep it.
            drop(unsafe { Box::from_raw(inner.as_ptr()) });
            return Err(SlirpError::New { version: version() });
        };
        Ok(Slirp {
            raw,
            inner,
            _callbacks: callbacks,
        })
    }

    fn opaque(&self) -> *mut c_void {
        self.inner.as_ptr().cast()
    }

    /// The inner state, outside any FFI call.
    fn inner_mut(&mut self) -> &mut Inner<G> {
        // SAFETY: &mut self: no FFI call is running, so no callback holds a reference.
        unsafe { &mut *self.inner.as_ptr() }
    }

    /// The guest side.
    pub fn guest(&mut self) -> &mut G {
        &mut self.inner_mut().guest
    }

    /// Forward TCP `host:port` on the host to the guest's `guest_port` (at the first DHCP
    /// address).
    pub fn add_hostfwd(
        &mut self,
        host: Ipv4Addr,
        port: u16,
        guest_port: u16,
    ) -> Result<(), SlirpError> {
        // SAFETY: raw is live; the addresses are passed by value.
        let r = unsafe {
            ffi::slirp_add_hostfwd(
                self.raw.as_ptr(),
                0,
                in_addr(host),
                c_int::from(port),
                in_addr(Ipv4Addr::UNSPECIFIED),
                c_int::from(guest_port),
            )
        };
        if r == 0 {
            return Ok(());
        }
        let source = io::Error::last_os_error();
        let source = if source.raw_os_error() == Some(0) {
            io::Error::other("libslirp gave no reason")
        } else {
            source
        };
        Err(SlirpError::HostFwd {
            host,
            port,
            guest_port,
            source,
        })
    }

    /// Guest connections to `guest:port` are connected to the unix socket `path` (by slirp,
    /// in this process, at each connection; the socket need not exist yet).
    pub fn add_unix(&mut self, path: &Path, guest: Ipv4Addr, port: u16) -> Result<(), SlirpError> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| SlirpError::Nul(path.display().to_string()))?;
        let mut addr = in_addr(guest);
        // SAFETY: raw is live; slirp copies the path (g_strdup) and reads addr.
        let r = unsafe {
            ffi::slirp_add_unix(self.raw.as_ptr(), c.as_ptr(), &mut addr, c_int::from(port))
        };
        if r == 0 {
            Ok(())
        } else {
            Err(SlirpError::Unix {
                guest,
                port,
                path: path.display().to_string(),
            })
        }
    }

    /// Remove the forward of `guest:port` made by [`Slirp::add_unix`]; `false` when there was
    /// none. Connections it carries stay open.
    pub fn remove_unix(&mut self, guest: Ipv4Addr, port: u16) -> bool {
        // SAFETY: raw is live; slirp only reads the address.
        unsafe {
            ffi::slirp_remove_guestfwd(self.raw.as_ptr(), in_addr(guest), c_int::from(port)) == 0
        }
    }

    /// A frame from the guest (without the stream's length prefix).
    pub fn input(&mut self, frame: &[u8]) {
        let Ok(len) = c_int::try_from(frame.len()) else {
            return;
        };
        // SAFETY: raw is live; frame is len readable bytes; no &mut Inner is held.
        unsafe { ffi::slirp_input(self.raw.as_ptr(), frame.as_ptr(), len) }
    }

    /// One round's sleep: poll `own` fds (with their `POLL*` events) together with slirp's,
    /// for at most `max_ms` (slirp and its timers lower it). Returns the `revents` of `own`,
    /// in order. Call [`Slirp::dispatch`] after it, also when it fails.
    pub fn wait<const N: usize>(
        &mut self,
        own: [(BorrowedFd<'_>, i16); N],
        max_ms: u32,
    ) -> io::Result<[i16; N]> {
        let inner = self.inner_mut();
        inner.pollfds.clear();
        inner
            .pollfds
            .extend(own.iter().map(|(fd, events)| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: *events,
                revents: 0,
            }));
        let mut timeout = max_ms;
        // SAFETY: raw is live; the opaque is our Inner, which cb_add_poll expects; no
        // reference to Inner is held across the call.
        unsafe {
            ffi::slirp_pollfds_fill(
                self.raw.as_ptr(),
                &mut timeout,
                cb_add_poll::<G>,
                self.opaque(),
            )
        };
        let timeout = timeout.min(self.timers_timeout());
        let inner = self.inner_mut();
        // SAFETY: pollfds is a valid array of its length.
        let r = unsafe {
            libc::poll(
                inner.pollfds.as_mut_ptr(),
                inner.pollfds.len() as libc::nfds_t,
                c_int::try_from(timeout).unwrap_or(c_int::MAX),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            inner.poll_failed = true;
            inner.pollfds.iter_mut().for_each(|p| p.revents = 0);
            return Err(e);
        }
        inner.poll_failed = false;
        Ok(std::array::from_fn(|i| inner.pollfds[i].revents))
    }

    /// After [`Slirp::wait`]: let slirp handle its sockets' events, then fire the expired
    /// timers.
    pub fn dispatch(&mut self) {
        let failed = c_int::from(self.inner_mut().poll_failed);
        // SAFETY: raw is live; the opaque is our Inner, which cb_get_revents expects.
        unsafe {
            ffi::slirp_pollfds_poll(
                self.raw.as_ptr(),
                failed,
                cb_get_revents::<G>,
                self.opaque(),
            )
        };
        self.run_timers();
    }

    /// Milliseconds until the first armed timer expires (`u32::MAX`: none).
    fn timers_timeout(&mut self) -> u32 {
        let now = clock_ms();
        self.inner_mut()
            .timers
            .iter()
            // SAFETY: registered timers are live boxes.
            .filter_map(|t| unsafe { t.as_ref() }.expire_ms)
            .map(|e| u32::try_from((e - now).max(0)).unwrap_or(u32::MAX))
            .min()
            .unwrap_or(u32::MAX)
    }

    /// Fire the timers expired now. Each runs once; a timer an earlier callback freed or
    /// re-armed is skipped.
    fn run_timers(&mut self) {
        let now = clock_ms();
        let due: Vec<NonNull<Timer>> = self
            .inner_mut()
            .timers
            .iter()
            .copied()
            .filter(|t| {
                // SAFETY: registered timers are live boxes, not borrowed elsewhere now.
                let t = unsafe { &mut *t.as_ptr() };
                let expired = t.expire_ms.is_some_and(|e| e <= now);
                if expired {
                    t.expire_ms = None;
                    t.due = true;
                }
                expired
            })
            .collect();
        for t in due {
            if !self.inner_mut().timers.contains(&t) {
                continue; // freed by an earlier callback
            }
            // SAFETY: still registered, so a live box; the reference ends before the call.
            let (cb, opaque) = {
                let t = unsafe { &mut *t.as_ptr() };
                if !t.due {
                    continue; // re-armed by an earlier callback
                }
                t.due = false;
                (t.cb, t.opaque)
            };
            if let Some(cb) = cb {
                // SAFETY: slirp's own timer callback with its own opaque; no reference to
                // Inner or the timer is held (it may free or re-arm timers).
                unsafe { cb(opaque) };
            }
        }
    }
}

impl<G: Guest> Drop for Slirp<G> {
    fn drop(&mut self) {
        // SAFETY: raw is live and dropped once; slirp_cleanup may call timer_free, which
        // needs Inner, freed only after.
        unsafe { ffi::slirp_cleanup(self.raw.as_ptr()) };
        // SAFETY: inner came from Box::leak in new; slirp no longer refers to it.
        let inner = unsafe { Box::from_raw(self.inner.as_ptr()) };
        for t in inner.timers.iter() {
            // SAFETY: timers still registered are live boxes nobody else frees.
            drop(unsafe { Box::from_raw(t.as_ptr()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn the_library_is_libslirp_4_7() {
        let v = version();
        assert!(
            v.starts_with("4.7."),
            "libslirp version {v}, expected 4.7.x"
        );
    }

    /// Offsets measured with gcc (x86_64) from libslirp-dev 4.7.0's libslirp.h
    /// (`offsetof` on every field): the hand-written mirror must match them exactly.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_layout_matches_libslirp_4_7() {
        use ffi::{SlirpCb, SlirpConfig};
        assert_eq!(
            (size_of::<SlirpConfig>(), align_of::<SlirpConfig>()),
            (184, 8)
        );
        let offsets = [
            (offset_of!(SlirpConfig, version), 0),
            (offset_of!(SlirpConfig, restricted), 4),
            (offset_of!(SlirpConfig, in_enabled), 8),
            (offset_of!(SlirpConfig, vnetwork), 12),
            (offset_of!(SlirpConfig, vnetmask), 16),
            (offset_of!(SlirpConfig, vhost), 20),
            (offset_of!(SlirpConfig, in6_enabled), 24),
            (offset_of!(SlirpConfig, vprefix_addr6), 28),
            (offset_of!(SlirpConfig, vprefix_len), 44),
            (offset_of!(SlirpConfig, vhost6), 48),
            (offset_of!(SlirpConfig, vhostname), 64),
            (offset_of!(SlirpConfig, tftp_server_name), 72),
            (offset_of!(SlirpConfig, tftp_path), 80),
            (offset_of!(SlirpConfig, bootfile), 88),
            (offset_of!(SlirpConfig, vdhcp_start), 96),
            (offset_of!(SlirpConfig, vnameserver), 100),
            (offset_of!(SlirpConfig, vnameserver6), 104),
            (offset_of!(SlirpConfig, vdnssearch), 120),
            (offset_of!(SlirpConfig, vdomainname), 128),
            (offset_of!(SlirpConfig, if_mtu), 136),
            (offset_of!(SlirpConfig, if_mru), 144),
            (offset_of!(SlirpConfig, disable_host_loopback), 152),
            (offset_of!(SlirpConfig, enable_emu), 153),
            (offset_of!(SlirpConfig, outbound_addr), 160),
            (offset_of!(SlirpConfig, outbound_addr6), 168),
            (offset_of!(SlirpConfig, disable_dns), 176),
            (offset_of!(SlirpConfig, disable_dhcp), 177),
        ];
        for (i, (got, want)) in offsets.iter().enumerate() {
            assert_eq!(got, want, "SlirpConfig field #{i}");
        }
        assert_eq!(size_of::<SlirpCb>(), 88);
        assert_eq!(offset_of!(SlirpCb, notify), 64);
        assert_eq!(offset_of!(SlirpCb, init_completed), 72);
        assert_eq!(offset_of!(SlirpCb, timer_new_opaque), 80);
    }

    struct Frames(Vec<Vec<u8>>);
    impl Guest for Frames {
        fn send(&mut self, frame: &[u8]) {
            self.0.push(frame.to_vec());
        }
    }

    #[test]
    fn slirp_new_accepts_the_config_and_answers_arp() {
        let net = Network::default();
        let mut s = Slirp::new(&net, Frames(vec![])).expect("slirp_new");
        // the guest (10.0.2.15) asks who has 10.0.2.2: slirp answers as the host
        let mut arp = vec![0xff; 6];
        arp.extend([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        arp.extend([0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
        arp.extend([0x52, 0x54, 0, 0x12, 0x34, 0x56, 10, 0, 2, 15]);
        arp.extend([0, 0, 0, 0, 0, 0, 10, 0, 2, 2]);
        s.input(&arp);
        let frames = std::mem::take(&mut s.guest().0);
        assert_eq!(frames.len(), 1, "one ARP reply");
        let reply = &frames[0];
        assert_eq!(&reply[12..14], &[0x08, 0x06], "an ARP frame");
        assert_eq!(&reply[20..22], &[0, 2], "an ARP reply");
        assert_eq!(&reply[28..32], &[10, 0, 2, 2], "for 10.0.2.2");
        // a round of the loop with nothing to do returns at once with a 0 ms cap
        let [] = s.wait([], 0).unwrap();
        s.dispatch();
    }

    #[test]
    fn a_taken_port_is_a_clear_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let mut s = Slirp::new(&Network::default(), Frames(vec![])).unwrap();
        let e = s
            .add_hostfwd(Ipv4Addr::LOCALHOST, port, 22)
            .expect_err("the port is taken");
        let SlirpError::HostFwd { source, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(source.kind(), io::ErrorKind::AddrInUse, "{e}: {source}");
        s.add_unix(
            Path::new("/nonexistent/proxy.sock"),
            Ipv4Addr::new(10, 0, 2, 100),
            80,
        )
        .unwrap();
        assert!(
            s.add_unix(Path::new("/x"), Ipv4Addr::new(192, 168, 1, 1), 80)
                .is_err(),
            "an address outside the network is refused"
        );
    }
}
