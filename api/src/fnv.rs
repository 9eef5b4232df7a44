//! FNV-1a, 64 bits: a small hash fixed forever, for names and revisions that must come out
//! the same in every build and across restarts (file names, Event names, content digests).
//! Not for anything an attacker may aim at: it is not collision-resistant.

/// An FNV-1a hasher.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Add `bytes`.
    pub fn write(&mut self, bytes: &[u8]) -> &mut Self {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }
    /// Add `bytes` and a zero byte after them, so `["ab", "c"]` and `["a", "bc"]` differ.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        self.write(bytes).write(&[0])
    }
    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    Fnv::default().write(bytes).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(Fnv::default().part(b"").finish(), 0xaf63bd4c8601b7df);
        assert_ne!(
            Fnv::default().part(b"ab").part(b"c").finish(),
            Fnv::default().part(b"a").part(b"bc").finish()
        );
    }
}
