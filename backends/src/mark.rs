//! boxery's mark on what a backend makes: which object, of which store, it was made for.
//!
//! A mark is `<object uid>@<store uid>`: the uid of the Vm or Image it was made for and the
//! identity of the store that object lives in. Backends store it as an opaque string and
//! compare it whole; the reconcilers read it through this module. Marks written before stores
//! had an identity are the object uid alone ([`Mark::store`] is `None`).
//!
//! # Guarantees
//! - [`Mark::is_for`] compares only object uids (random UUIDs, never reused), so an object's
//!   things are recognised whichever store wrote the mark.
//! - Parsing never fails: an unexpected mark is read as an object uid with no store.

/// A parsed mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark<'a> {
    /// The uid of the object it was made for.
    pub object: &'a str,
    /// The identity of the store that object lives in (`None` for a mark from before stores
    /// had one).
    pub store: Option<&'a str>,
}

impl<'a> Mark<'a> {
    /// Read a mark.
    pub fn parse(mark: &'a str) -> Mark<'a> {
        match mark.split_once('@') {
            Some((object, store)) => Mark {
                object,
                store: Some(store),
            },
            None => Mark {
                object: mark,
                store: None,
            },
        }
    }

    /// Whether a backend thing marked `mark` was made for the object with `uid`.
    pub fn is_for(mark: Option<&str>, uid: Option<&str>) -> bool {
        match (mark, uid) {
            (Some(m), Some(u)) => Mark::parse(m).object == u,
            _ => false,
        }
    }

    /// Whether two marks name the same object.
    pub fn same_object(a: &str, b: &str) -> bool {
        Mark::parse(a).object == Mark::parse(b).object
    }
}

/// The mark for the object `object_uid` of the store `store_uid`.
pub fn mark(object_uid: &str, store_uid: &str) -> String {
    format!("{object_uid}@{store_uid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_name_an_object_and_its_store() {
        let m = mark("o1", "s1");
        assert_eq!(
            Mark::parse(&m),
            Mark {
                object: "o1",
                store: Some("s1")
            }
        );
        assert_eq!(Mark::parse("o1").store, None);
        assert!(Mark::is_for(Some(&m), Some("o1")));
        assert!(Mark::is_for(Some("o1"), Some("o1")), "a wave-1 mark");
        assert!(!Mark::is_for(Some(&m), Some("o2")));
        assert!(!Mark::is_for(None, Some("o1")));
        assert!(Mark::same_object(&m, "o1"));
        assert!(Mark::same_object(&m, &mark("o1", "s2")));
    }
}
