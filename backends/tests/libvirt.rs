//! libvirt backend tests (being written).
