//! The controller runtime (to be written).
