//! Value parsers for names given on the command line: every name is checked here, before a
//! command does anything, so `boxery fork v1 ok1 Bad_Name` fails before `ok1` is made and
//! `boxery lease release ..` never reaches the filesystem.

use boxery_api::Name;

/// A Vm, Pool, Lease or Grant name (a DNS-1123 label).
pub fn label(s: &str) -> Result<String, String> {
    Name::label(s).map(Name::into_string).map_err(|e| e.0)
}

/// An Image name (dot-separated labels), or any object name when the kind is not known yet.
pub fn any_name(s: &str) -> Result<String, String> {
    Name::new(s).map(Name::into_string).map_err(|e| e.0)
}
