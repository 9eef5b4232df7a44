//! Real-QEMU tests of the qemu backend (written next).
