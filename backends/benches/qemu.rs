//! qemu backend benchmarks (written next).
fn main() {}
