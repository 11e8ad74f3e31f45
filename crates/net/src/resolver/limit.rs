//! Per-sandbox shares of the resolver: how many TCP connections and queries
//! in flight each source address may hold at once. The resolver serves every
//! sandbox from one pool of tasks and one global cap (`MAX_IN_FLIGHT`); without
//! a share per source, one sandbox opening connections or sending queries
//! that upstream never answers would hold all of it and the others' lookups
//! would fail. The bridge table keeps source addresses honest, so a sandbox
//! cannot spread its load over others' addresses.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

/// Counts what each source holds of one resource, up to `cap` each.
#[derive(Debug)]
pub(crate) struct PerSource {
    what: &'static str,
    cap: usize,
    held: Mutex<HashMap<Ipv4Addr, Holding>>,
}

#[derive(Debug, Default)]
struct Holding {
    count: usize,
    /// Whether this source's refusals were logged since it last held nothing.
    logged: bool,
}

/// One unit held by a source; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    limiter: Arc<PerSource>,
    source: Ipv4Addr,
}

/// A source at its cap; `first` when this is the first refusal since it last
/// held nothing (the one that was logged).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub first: bool,
}

impl PerSource {
    /// `what` names the resource in the log line of a refusal.
    pub(super) fn new(what: &'static str, cap: usize) -> Arc<Self> {
        Arc::new(Self {
            what,
            cap,
            held: Mutex::default(),
        })
    }

    /// A unit for `source`, or a refusal if it holds `cap` already. A refused
    /// source is logged once (at debug: a sandbox can make this happen at
    /// will) until it has given back everything it held.
    pub(super) fn try_take(self: &Arc<Self>, source: Ipv4Addr) -> Result<Slot, Refused> {
        let mut held = self.lock();
        let holding = held.entry(source).or_default();
        if holding.count >= self.cap {
            let first = !holding.logged;
            if first {
                holding.logged = true;
                tracing::debug!(sandbox = %source, cap = self.cap, "resolver: too many {} from one sandbox; refusing more", self.what);
            }
            return Err(Refused { first });
        }
        holding.count += 1;
        Ok(Slot {
            limiter: Arc::clone(self),
            source,
        })
    }

    /// How many units `source` holds.
    #[cfg(test)]
    pub(super) fn held(&self, source: Ipv4Addr) -> usize {
        self.lock().get(&source).map_or(0, |h| h.count)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ipv4Addr, Holding>> {
        self.held.lock().expect("resolver limit lock")
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.limiter.lock();
        if let Some(holding) = held.get_mut(&self.source) {
            holding.count -= 1;
            // A source that holds nothing is forgotten: the map stays as
            // small as the number of sandboxes asking right now.
            if holding.count == 0 {
                held.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
    const B: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);

    #[test]
    fn a_source_gets_at_most_its_cap_and_others_are_not_affected() {
        let limiter = PerSource::new("queries", 3);
        let held: Vec<Slot> = (0..3).map(|_| limiter.try_take(A).unwrap()).collect();
        assert_eq!(limiter.held(A), 3);
        assert_eq!(limiter.try_take(A).unwrap_err(), Refused { first: true });
        assert_eq!(limiter.try_take(A).unwrap_err(), Refused { first: false });
        let other = limiter.try_take(B).expect("another sandbox is not starved");
        assert_eq!(limiter.held(B), 1);
        drop(other);
        assert_eq!(limiter.held(B), 0);
        drop(held);
        assert_eq!(limiter.held(A), 0);
    }

    #[test]
    fn a_given_back_slot_can_be_taken_again() {
        let limiter = PerSource::new("connections", 1);
        let first = limiter.try_take(A).unwrap();
        assert!(limiter.try_take(A).is_err());
        drop(first);
        let again = limiter.try_take(A).expect("the slot was given back");
        assert!(limiter.try_take(A).is_err());
        drop(again);
    }

    #[test]
    fn a_source_is_logged_again_only_after_it_held_nothing() {
        let limiter = PerSource::new("queries", 2);
        let one = limiter.try_take(A).unwrap();
        let two = limiter.try_take(A).unwrap();
        assert_eq!(limiter.try_take(A).unwrap_err(), Refused { first: true });
        drop(one);
        // Still holding one: the episode goes on, no new log line.
        let three = limiter.try_take(A).unwrap();
        assert_eq!(limiter.try_take(A).unwrap_err(), Refused { first: false });
        drop((two, three));
        let _four = limiter.try_take(A).unwrap();
        let _five = limiter.try_take(A).unwrap();
        assert_eq!(limiter.try_take(A).unwrap_err(), Refused { first: true });
    }

    #[test]
    fn slots_are_counted_across_threads() {
        let limiter = PerSource::new("queries", 64);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let limiter = Arc::clone(&limiter);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let slot = limiter.try_take(A);
                        drop(slot);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(limiter.held(A), 0);
    }
}
