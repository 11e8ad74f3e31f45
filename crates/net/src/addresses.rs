//! Which sandbox has which address and MAC, kept in `{state_dir}/addresses`
//! (one `id address mac` line each) so a sandbox keeps both across stops,
//! pauses and server restarts: a paused VM's saved memory holds its NIC's MAC.
//! A new sandbox gets the lowest free address of the range, so the allocation
//! is deterministic, and a random MAC (locally administered, unicast), so no
//! sandbox can tell another's from its address. The bridge pins each MAC to
//! its sandbox's port. The file is rewritten (atomically, by rename) only
//! when an allocation changes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Read};
use std::path::PathBuf;

use crate::config::NetworkConfig;
use crate::NetError;

/// An Ethernet address.
pub(crate) type Mac = [u8; 6];

#[derive(Debug)]
pub(crate) struct AddressBook {
    path: PathBuf,
    /// Offsets into the range and MACs, by sandbox id.
    by_id: BTreeMap<String, (u32, Mac)>,
    used: BTreeSet<u32>,
    macs: BTreeSet<Mac>,
    offsets: std::ops::RangeInclusive<u32>,
}

impl AddressBook {
    /// Reads the file if there is one. Entries outside the configured range
    /// (the range changed) are dropped: those sandboxes get new addresses.
    pub(crate) fn load(config: &NetworkConfig) -> Result<Self, NetError> {
        let path = config.addresses_file();
        let offsets = config.sandbox_offsets();
        let mut book = Self {
            path,
            by_id: BTreeMap::new(),
            used: BTreeSet::new(),
            macs: BTreeSet::new(),
            offsets,
        };
        let text = match fs::read_to_string(&book.path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(book),
            Err(err) => {
                return Err(NetError::io(format!("read {}", book.path.display()))(err));
            }
        };
        let mut upgraded = false;
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(id), Some(address), mac, None) =
                (words.next(), words.next(), words.next(), words.next())
            else {
                continue;
            };
            let offset = address
                .parse()
                .ok()
                .and_then(|a| config.offset_of(a))
                .filter(|o| book.offsets.contains(o) && !book.used.contains(o));
            match offset {
                Some(offset) => {
                    // A file of a version before MACs were kept, or a MAC
                    // another sandbox has: a new one.
                    let mac = match mac.and_then(parse_mac) {
                        Some(mac) if !book.macs.contains(&mac) => mac,
                        _ => {
                            upgraded = true;
                            book.new_mac()?
                        }
                    };
                    book.by_id.insert(id.to_owned(), (offset, mac));
                    book.used.insert(offset);
                    book.macs.insert(mac);
                }
                None => tracing::warn!(
                    sandbox = id,
                    address,
                    "dropping an address allocation outside the sandbox range"
                ),
            }
        }
        if upgraded {
            book.save(config)?;
        }
        Ok(book)
    }

    /// A random MAC no sandbox in the book has.
    fn new_mac(&self) -> Result<Mac, NetError> {
        loop {
            let mut mac = [0u8; 6];
            fs::File::open("/dev/urandom")
                .and_then(|mut random| random.read_exact(&mut mac))
                .map_err(NetError::io("read random bytes for a MAC"))?;
            // Locally administered (bit 1), unicast (bit 0 clear).
            mac[0] = (mac[0] & 0xfc) | 0x02;
            if !self.macs.contains(&mac) {
                return Ok(mac);
            }
        }
    }

    /// The sandbox's offset and MAC, allocating the lowest free offset and a
    /// new MAC if it has none. Returns whether the book changed (and must be
    /// saved); `None` when the range is full.
    pub(crate) fn reserve(&mut self, id: &str) -> Result<Option<(u32, Mac, bool)>, NetError> {
        if let Some((offset, mac)) = self.by_id.get(id) {
            return Ok(Some((*offset, *mac, false)));
        }
        let mut candidate = *self.offsets.start();
        for used in self.used.range(candidate..) {
            if *used != candidate {
                break;
            }
            candidate += 1;
        }
        if !self.offsets.contains(&candidate) {
            return Ok(None);
        }
        let mac = self.new_mac()?;
        self.by_id.insert(id.to_owned(), (candidate, mac));
        self.used.insert(candidate);
        self.macs.insert(mac);
        Ok(Some((candidate, mac, true)))
    }

    /// Forgets the sandbox's address; returns whether it had one.
    pub(crate) fn release(&mut self, id: &str) -> bool {
        match self.by_id.remove(id) {
            Some((offset, mac)) => {
                self.used.remove(&offset);
                self.macs.remove(&mac);
                true
            }
            None => false,
        }
    }

    pub(crate) fn save(&self, config: &NetworkConfig) -> Result<(), NetError> {
        let mut text = String::with_capacity(self.by_id.len() * 32);
        for (id, (offset, mac)) in &self.by_id {
            text.push_str(&format!(
                "{id} {} {}\n",
                config.sandbox_address(*offset),
                mac_text(mac)
            ));
        }
        let partial = self.path.with_extension("partial");
        fs::write(&partial, text)
            .and_then(|()| fs::rename(&partial, &self.path))
            .map_err(NetError::io(format!("write {}", self.path.display())))
    }
}

/// `aa:bb:cc:dd:ee:ff`, lower case.
pub(crate) fn mac_text(mac: &Mac) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A MAC as `mac_text` writes it; only a locally administered unicast one.
fn parse_mac(text: &str) -> Option<Mac> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    (parts.next().is_none() && mac[0] & 0x03 == 0x02).then_some(mac)
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
        assert_eq!(offset(&mut book, "a"), Some((2, true)));
        assert_eq!(offset(&mut book, "b"), Some((3, true)));
        assert_eq!(offset(&mut book, "c"), Some((4, true)));
        assert_eq!(offset(&mut book, "a"), Some((2, false)));
        assert!(book.release("b"));
        assert!(!book.release("b"));
        assert_eq!(offset(&mut book, "d"), Some((3, true)), "reuses the gap");
        book.save(&config).unwrap();

        let mut again = AddressBook::load(&config).unwrap();
        assert_eq!(offset(&mut again, "c"), Some((4, false)));
        assert_eq!(offset(&mut again, "d"), Some((3, false)));
        // A /29 has offsets 2..=6 for sandboxes.
        assert_eq!(offset(&mut again, "e"), Some((5, true)));
        assert_eq!(offset(&mut again, "f"), Some((6, true)));
        assert_eq!(offset(&mut again, "g"), None);
    }

    fn offset(book: &mut AddressBook, id: &str) -> Option<(u32, bool)> {
        book.reserve(id)
            .unwrap()
            .map(|(offset, _, changed)| (offset, changed))
    }

    fn mac(book: &mut AddressBook, id: &str) -> Mac {
        book.reserve(id).unwrap().unwrap().1
    }

    #[test]
    fn macs_are_random_local_unicast_and_kept_across_loads() {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path(), "10.77.0.0/24");
        let mut book = AddressBook::load(&config).unwrap();
        let a = mac(&mut book, "a");
        let b = mac(&mut book, "b");
        assert_ne!(a, b);
        for m in [a, b] {
            assert_eq!(
                m[0] & 0x03,
                0x02,
                "{m:02x?} is locally administered unicast"
            );
        }
        // Not derived from the address, as it was (02:76 and the address).
        assert_ne!(a, [0x02, 0x76, 10, 77, 0, 2]);
        assert_eq!(mac(&mut book, "a"), a, "the same on every attach");
        book.save(&config).unwrap();
        let mut again = AddressBook::load(&config).unwrap();
        assert_eq!(mac(&mut again, "a"), a);
        assert_eq!(mac(&mut again, "b"), b);
        assert!(again.release("a"));
        assert_ne!(
            mac(&mut again, "a"),
            a,
            "a released sandbox's MAC goes with it"
        );
    }

    #[test]
    fn a_file_without_macs_gets_them_once() {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path(), "10.77.0.0/24");
        fs::write(
            dir.path().join("addresses"),
            "a 10.77.0.9\nb 10.77.0.3 01:00:5e:00:00:01\n",
        )
        .unwrap();
        let mut book = AddressBook::load(&config).unwrap();
        let a = mac(&mut book, "a");
        let text = fs::read_to_string(dir.path().join("addresses")).unwrap();
        assert!(
            text.contains(&format!("a 10.77.0.9 {}", mac_text(&a))),
            "{text}"
        );
        assert!(
            !text.contains("01:00:5e"),
            "a multicast MAC is replaced: {text}"
        );
        let mut again = AddressBook::load(&config).unwrap();
        assert_eq!(mac(&mut again, "a"), a);
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
        assert_eq!(offset(&mut book, "a"), Some((9, false)));
        assert_eq!(offset(&mut book, "b"), Some((2, true)));
        assert_eq!(
            offset(&mut book, "c"),
            Some((3, true)),
            "a taken address is not shared"
        );
    }
}
