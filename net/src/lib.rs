//! boxery-net: the per-VM network helper. libslirp (4.7, the system's `libslirp.so.0`) runs
//! here instead of inside QEMU, behind QEMU's `-netdev stream` on a unix socket, so a guest
//! connection to the proxy (10.0.2.100:80) is a `connect()` to the proxy's unix socket made
//! in this process (`slirp_add_unix`) rather than a relay QEMU forks and execs per
//! connection (docs/research/egress-connection-cost.md: +4.6 ms per connection, 0 here).
//!
//! - [`slirp`]: the hand-written FFI to libslirp and a safe wrapper around one stack.
//! - [`helper`]: the helper's options, set-up and poll loop.
//! - [`dns`]: the guest's name lookups taken out of its frames, and their answers put back.
//!
//! Only this crate links libslirp: `boxery` itself does not need it.

pub mod dns;
pub mod helper;
pub mod slirp;
mod sys;
