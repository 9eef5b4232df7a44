//! Byte quantities written as Kubernetes writes them: `512Mi`, `4Gi`, `20G`, `1073741824`.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The pattern every quantity matches.
pub const QUANTITY_PATTERN: &str = r"^[0-9]{1,19}(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$";

/// A number of bytes, written with an optional binary (`Ki`, `Mi`, `Gi`, `Ti`, `Pi`) or
/// decimal (`k`, `M`, `G`, `T`, `P`) suffix.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Quantity(u64);

/// A quantity that does not parse; holds the input as [`shown`](crate::name::shown): escaped
/// and cut, so the message is safe to print whatever was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a quantity: write a whole number of bytes with an optional suffix, like 512Mi, 4Gi or 20G"
)]
pub struct QuantityError(pub String);

impl Quantity {
    /// A quantity of `bytes`.
    pub const fn from_bytes(bytes: u64) -> Self {
        Quantity(bytes)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Quantity(n << 20)
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Quantity(n << 30)
    }
    /// The number of bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
    /// Whole MiB, rounded up.
    pub const fn as_mib(self) -> u64 {
        self.0.div_ceil(1 << 20)
    }
    /// Whole GiB, rounded up.
    pub const fn as_gib(self) -> u64 {
        self.0.div_ceil(1 << 30)
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || QuantityError(crate::name::shown(s));
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, suffix) = s.split_at(split);
        if num.is_empty() {
            return Err(err());
        }
        let n: u64 = num.parse().map_err(|_| err())?;
        let mult: u64 = match suffix {
            "" => 1,
            "k" => 1000,
            "M" => 1000u64.pow(2),
            "G" => 1000u64.pow(3),
            "T" => 1000u64.pow(4),
            "P" => 1000u64.pow(5),
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            "Pi" => 1 << 50,
            _ => return Err(err()),
        };
        n.checked_mul(mult).map(Quantity).ok_or_else(err)
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (shift, unit) in [(50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
            if b != 0 && b.is_multiple_of(1u64 << shift) {
                return write!(f, "{}{}", b >> shift, unit);
            }
        }
        write!(f, "{b}")
    }
}

impl fmt::Debug for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Quantity({self})")
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(u64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Num(n) => Ok(Quantity(n)),
            Raw::Str(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl JsonSchema for Quantity {
    fn schema_name() -> Cow<'static, str> {
        "Quantity".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A number of bytes with an optional suffix: 512Mi, 4Gi, 20G.",
            "type": "string",
            "pattern": QUANTITY_PATTERN,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("4Gi".parse::<Quantity>().unwrap(), Quantity::gib(4));
        assert_eq!("512Mi".parse::<Quantity>().unwrap().as_mib(), 512);
        assert_eq!("20G".parse::<Quantity>().unwrap().bytes(), 20_000_000_000);
        assert_eq!(Quantity::gib(4).to_string(), "4Gi");
        assert_eq!(Quantity::from_bytes(1000).to_string(), "1000");
        for bad in [
            "",
            "-1",
            "4gb",
            "Gi",
            "1.5Gi",
            "99999999999999999999",
            "18446744073709551615Ki",
        ] {
            assert!(bad.parse::<Quantity>().is_err(), "{bad}");
        }
        let e = "4Gi\u{1b}[2J".parse::<Quantity>().unwrap_err().to_string();
        assert!(e.starts_with("`4Gi\\u{1b}[2J` is not a quantity"), "{e}");
    }
}
