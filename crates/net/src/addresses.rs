//! Which sandbox has which address, kept in `{state_dir}/addresses` (one
//! `id address` line each) so a sandbox keeps its address across stops and
//! server restarts. A new sandbox gets the lowest free address of the range, so
//! the allocation is deterministic. The file is rewritten (atomically, by
//! rename) only when an allocation changes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::PathBuf;

use crate::config::NetworkConfig;
use crate::NetError;

#[derive(Debug)]
pub(crate) struct AddressBook {
    path: PathBuf,
    /// Offsets into the range, by sandbox id.
    by_id: BTreeMap<String, u32>,
    used: BTreeSet<u32>,
    offsets: std::ops::RangeInclusive<u32>,
}

impl AddressBook {
    /// Reads the file if there is one. Entries outside the configured range
    /// (the range changed) are dropped: those sandboxes get new addresses.
    pub fn load(config: &NetworkConfig) -> Result<Self, NetError> {
        let path = config.addresses_file();
        let offsets = config.sandbox_offsets();
        let mut book = Self {
            path,
            by_id: BTreeMap::new(),
            used: BTreeSet::new(),
            offsets,
        };
        let text = match fs::read_to_string(&book.path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(book),
            Err(err) => {
                return Err(NetError::io(format!("read {}", book.path.display()))(err));
            }
        };
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(id), Some(address), None) = (words.next(), words.next(), words.next()) else {
                continue;
            };
            let offset = address
                .parse()
                .ok()
                .and_then(|a| config.offset_of(a))
                .filter(|o| book.offsets.contains(o) && !book.used.contains(o));
            match offset {
                Some(offset) => {
                    book.by_id.insert(id.to_owned(), offset);
                    book.used.insert(offset);
                }
                None => tracing::warn!(
                    sandbox = id,
                    address,
                    "dropping an address allocation outside the sandbox range"
                ),
            }
        }
        Ok(book)
    }

    /// The sandbox's offset, allocating the lowest free one if it has none.
    /// Returns whether the book changed (and must be saved).
    pub fn reserve(&mut self, id: &str) -> Option<(u32, bool)> {
        if let Some(offset) = self.by_id.get(id) {
            return Some((*offset, false));
        }
        let mut candidate = *self.offsets.start();
        for used in self.used.range(candidate..) {
            if *used != candidate {
                break;
            }
            candidate += 1;
        }
        if !self.offsets.contains(&candidate) {
            return None;
        }
        self.by_id.insert(id.to_owned(), candidate);
        self.used.insert(candidate);
        Some((candidate, true))
    }

    /// Forgets the sandbox's address; returns whether it had one.
    pub fn release(&mut self, id: &str) -> bool {
        match self.by_id.remove(id) {
            Some(offset) => {
                self.used.remove(&offset);
                true
            }
            None => false,
        }
    }

    pub fn save(&self, config: &NetworkConfig) -> Result<(), NetError> {
        let mut text = String::with_capacity(self.by_id.len() * 32);
        for (id, offset) in &self.by_id {
            text.push_str(&format!("{id} {}\n", config.sandbox_address(*offset)));
        }
        let partial = self.path.with_extension("partial");
        fs::write(&partial, text)
            .and_then(|()| fs::rename(&partial, &self.path))
            .map_err(NetError::io(format!("write {}", self.path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Uplink;
    use std::net::Ipv4Addr;

    fn config(dir: &std::path::Path, range: &str) -> NetworkConfig {
        let mut config = NetworkConfig::new(
            Uplink {
                interface: "eth0".into(),
                gateway: Ipv4Addr::new(192, 0, 2, 1),
            },
            vec![Ipv4Addr::new(192, 0, 2, 53)],
            dir.to_path_buf(),
        );
        config.range = range.parse().unwrap();
        config
    }

    #[test]
    fn lowest_free_address_first_and_kept_across_loads() {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path(), "10.77.0.0/29");
        let mut book = AddressBook::load(&config).unwrap();
        assert_eq!(book.reserve("a"), Some((2, true)));
        assert_eq!(book.reserve("b"), Some((3, true)));
        assert_eq!(book.reserve("c"), Some((4, true)));
        assert_eq!(book.reserve("a"), Some((2, false)));
        assert!(book.release("b"));
        assert!(!book.release("b"));
        assert_eq!(book.reserve("d"), Some((3, true)), "reuses the gap");
        book.save(&config).unwrap();

        let mut again = AddressBook::load(&config).unwrap();
        assert_eq!(again.reserve("c"), Some((4, false)));
        assert_eq!(again.reserve("d"), Some((3, false)));
        // A /29 has offsets 2..=6 for sandboxes.
        assert_eq!(again.reserve("e"), Some((5, true)));
        assert_eq!(again.reserve("f"), Some((6, true)));
        assert_eq!(again.reserve("g"), None);
    }

    #[test]
    fn allocations_outside_a_new_range_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("addresses"),
            "a 10.77.0.9\nb 10.88.0.2\nbroken line here\nc 10.77.0.9\n",
        )
        .unwrap();
        let mut book = AddressBook::load(&config(dir.path(), "10.77.0.0/24")).unwrap();
        assert_eq!(book.reserve("a"), Some((9, false)));
        assert_eq!(book.reserve("b"), Some((2, true)));
        assert_eq!(
            book.reserve("c"),
            Some((3, true)),
            "a taken address is not shared"
        );
    }
}
