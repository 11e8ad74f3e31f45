//! Content digests: parsing them strictly (they become file names in the cache)
//! and computing them over streams.

use std::fmt;
use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

/// A `sha256:<64 hex>` digest. Only sha256 is accepted: it is what every
/// registry and tool writes, and a strict form keeps digests safe as file names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Digest {
    hex: String,
}

impl Digest {
    /// Parses `sha256:<hex>`; `None` for any other algorithm or a malformed value.
    pub(crate) fn parse(text: &str) -> Option<Digest> {
        let hex = text.strip_prefix("sha256:")?;
        let well_formed = hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| Digest {
            hex: hex.to_owned(),
        })
    }

    pub(crate) fn of_bytes(bytes: &[u8]) -> Digest {
        Digest {
            hex: hex::encode(Sha256::digest(bytes)),
        }
    }

    /// The 64 hex characters, without the algorithm.
    pub(crate) fn hex(&self) -> &str {
        &self.hex
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

/// A reader that hashes everything read through it and counts the bytes.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// Reads the rest of the stream (so the digest covers all of it), then
    /// returns the digest and the total length.
    pub(crate) fn finish(mut self) -> io::Result<(Digest, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((
            Digest {
                hex: hex::encode(self.hasher.finalize()),
            },
            self.bytes,
        ))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Hashes data pushed into it, for downloads that arrive as chunks.
pub(crate) struct StreamHasher {
    hasher: Sha256,
}

impl StreamHasher {
    pub(crate) fn new() -> Self {
        StreamHasher {
            hasher: Sha256::new(),
        }
    }

    pub(crate) fn update(&mut self, chunk: &[u8]) {
        self.hasher.update(chunk);
    }

    pub(crate) fn finish(self) -> Digest {
        Digest {
            hex: hex::encode(self.hasher.finalize()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_well_formed_sha256() {
        let good = format!("sha256:{}", "a1".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().to_string(), good);
        for bad in [
            "sha256:abc",
            "sha512:00",
            "a1a1",
            &format!("sha256:{}", "A1".repeat(32)),
            &format!("sha256:../{}", "a".repeat(61)),
        ] {
            assert!(Digest::parse(bad).is_none(), "{bad} should not parse");
        }
    }

    #[test]
    fn hashing_reader_covers_the_unread_rest() {
        let data = b"hello world".to_vec();
        let mut reader = HashingReader::new(&data[..]);
        let mut first = [0u8; 5];
        reader.read_exact(&mut first).unwrap();
        let (digest, len) = reader.finish().unwrap();
        assert_eq!(len, 11);
        assert_eq!(digest, Digest::of_bytes(&data));
    }
}
