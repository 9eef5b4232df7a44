//! `metadata.generateName` on create, as the Kubernetes API does it: an object sent without a
//! name but with a `generateName` prefix is named the prefix and 5 random characters of
//! `bcdfghjklmnpqrstvwxz2456789` (no vowels, so no words; no `0`, `1`, `3`: no look-alikes).
//! The prefix is cut so the name fits the kind's length (63 for a label name, 253 for a
//! dotted one), and the name must be valid for the kind (a 422 naming `metadata.generateName`
//! otherwise). A name already taken is drawn again, up to 8 times in all ([`ATTEMPTS`]), as
//! Kubernetes 1.32 does. The object keeps its name, not the prefix (boxery's metadata has no
//! `generateName`).

use boxery_api::KindInfo;
use boxery_api::name::Name;
use rand::RngExt as _;
use serde_json::Value;

use crate::status::Failure;

/// The characters of a generated suffix (Kubernetes' `alphanums`).
const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
/// The suffix's length.
const SUFFIX: usize = 5;
/// How many names are drawn before a create is refused for a taken one.
pub const ATTEMPTS: usize = 8;

/// The prefix a create body asks names to be made from: `Some` when it has no
/// `metadata.name` and a `metadata.generateName`. Removes `generateName` from the body either
/// way (a name given wins, as in Kubernetes).
pub fn prefix_of(body: &mut Value) -> Option<String> {
    let meta = body.get_mut("metadata")?.as_object_mut()?;
    let prefix = meta.remove("generateName")?;
    let named = meta
        .get("name")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    match prefix {
        Value::String(p) if !named && !p.is_empty() => Some(p),
        _ => None,
    }
}

/// A name made from `prefix` for an object of `info`'s kind.
pub fn make(info: &KindInfo, prefix: &str) -> Result<String, Failure> {
    let max = (if info.dotted_names { 253 } else { 63 }) - SUFFIX;
    let mut cut = prefix;
    if cut.len() > max {
        let mut end = max;
        while !cut.is_char_boundary(end) {
            end -= 1;
        }
        cut = &cut[..end];
    }
    let mut rng = rand::rng();
    let mut name = cut.to_string();
    for _ in 0..SUFFIX {
        name.push(ALPHABET[rng.random_range(0..ALPHABET.len())] as char);
    }
    Name::for_kind(info, &name).map_err(|e| {
        let invalid = boxery_api::ValidationError {
            object: format!("{}/", info.kind),
            errors: vec![boxery_api::validate::FieldError::new(
                "metadata.generateName",
                format!(
                    "`{}` followed by 5 random characters is not a valid name: {e}",
                    boxery_api::name::shown(prefix)
                ),
            )],
        };
        Failure::from_store(&boxery_store::StoreError::Invalid(invalid))
    })?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_are_the_prefix_and_five_of_the_alphabet() {
        let vm = boxery_api::lookup_kind("Vm").unwrap();
        let n = make(vm, "dev-").unwrap();
        assert_eq!(n.len(), 9);
        assert!(n.starts_with("dev-"));
        assert!(n[4..].bytes().all(|b| ALPHABET.contains(&b)), "{n}");
        let long = "a".repeat(80);
        assert_eq!(make(vm, &long).unwrap().len(), 63);
        assert!(make(vm, "Bad_").is_err());
        assert!(make(vm, "a.b-").is_err(), "a Vm name has no dots");
        let image = boxery_api::lookup_kind("Image").unwrap();
        assert!(make(image, "a.b-").is_ok());
        let mut b = json!({"metadata": {"generateName": "x-"}});
        assert_eq!(prefix_of(&mut b).as_deref(), Some("x-"));
        assert_eq!(b, json!({"metadata": {}}));
        let mut b = json!({"metadata": {"name": "n", "generateName": "x-"}});
        assert_eq!(prefix_of(&mut b), None);
        assert_eq!(b, json!({"metadata": {"name": "n"}}));
    }
}
