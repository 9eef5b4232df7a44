//! boxery's home, `$BOXERY_HOME`: where each file lives ([`layout`]), and the control plane's
//! private state files with their one reader and writer each — the token store ([`tokens`]),
//! the grant state ([`grants`]), the egress policies ([`egress`]) — written whole or not at
//! all, 0600 ([`private`]), the one reader of a grant's `valueFrom` ([`values`]), each VM's
//! last-use mark ([`activity`]), and the usage ledger ([`usage`], SQLite).
//!
//! The reconcilers write these files; the credential proxy and the API server read them (and
//! the API server writes its own private files with [`private`]). None of them reaches the
//! store through this crate: it knows files, not objects.

pub mod activity;
pub mod egress;
pub mod grants;
pub mod journal;
pub mod layout;
pub mod private;
pub mod tokens;
pub mod usage;
pub mod values;
