//! The few system calls std lacks: SIGTERM and SIGINT as a readable fd (signalfd) for the
//! poll loop (the signals are blocked and read in the loop, so a stop never interrupts slirp
//! halfway through a call), and the umask around creating the socket.
#![allow(unsafe_code)] // sigprocmask, signalfd, reading its struct, umask: libc calls

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The stop signals, readable in a poll loop.
#[derive(Debug)]
pub struct StopSignals {
    fd: OwnedFd,
}

impl StopSignals {
    /// Block SIGTERM and SIGINT in this thread (call it before starting any other) and open
    /// a non-blocking signalfd for them.
    pub fn new() -> io::Result<Self> {
        let mut set = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigemptyset initialises the set; sigaddset with valid signals; the mask is
        // changed for this thread only and the fd we get is owned from here on.
        unsafe {
            libc::sigemptyset(set.as_mut_ptr());
            libc::sigaddset(set.as_mut_ptr(), libc::SIGTERM);
            libc::sigaddset(set.as_mut_ptr(), libc::SIGINT);
            let set = set.assume_init();
            let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if r != 0 {
                return Err(io::Error::from_raw_os_error(r));
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(StopSignals {
                fd: OwnedFd::from_raw_fd(fd),
            })
        }
    }

    /// The signal pending, if any (after poll said the fd is readable).
    pub fn take(&self) -> Option<i32> {
        let mut info = MaybeUninit::<libc::signalfd_siginfo>::uninit();
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: reading at most size bytes into info; signalfd writes whole structs.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), size) };
        if n != size as isize {
            return None;
        }
        // SAFETY: the read filled the whole struct.
        Some(unsafe { info.assume_init() }.ssi_signo as i32)
    }
}

impl AsFd for StopSignals {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Run `f` with the process umask set to `mask`, then restore it. Only while the process has
/// one thread (boxery-net never starts another).
pub fn with_umask<T>(mask: libc::mode_t, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask cannot fail; it is process-wide, and boxery-net is single-threaded.
    let old = unsafe { libc::umask(mask) };
    let r = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r
}
