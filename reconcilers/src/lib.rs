//! Reconcilers (to be written).
