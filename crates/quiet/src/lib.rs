//! When the server is quiet: background work that only prepares for later
//! requests (a pool's next waiting shim or network namespace) waits here
//! until no request is in flight, so it does not share the two cores, the
//! kernel's cgroup lock or its rtnl lock with a request that is.
//!
//! Requests mark themselves with [`Quiet::busy`]; a refill awaits
//! [`Quiet::settled`] before each piece of work. The wait is bounded
//! (`longest`): a server that is never idle still refills, only later.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;

/// How long no request must have been in flight before the server counts as
/// quiet: the gap between one request's answer and a client's next (a
/// create, then its first command) is well under it.
pub const SETTLE: Duration = Duration::from_millis(20);

/// The longest a refill waits for quiet; past it, it runs anyway.
pub const LONGEST: Duration = Duration::from_secs(1);

/// Shared by the request layer and the pools; cheap to clone.
#[derive(Clone)]
pub struct Quiet {
    inner: Arc<Inner>,
}

struct Inner {
    settle: Duration,
    longest: Duration,
    state: Mutex<State>,
    /// Told whenever the last request in flight ends.
    idle: Notify,
}

struct State {
    in_flight: usize,
    /// When the last request in flight ended (or the gate was made).
    since: Instant,
}

/// A request in flight, until dropped.
pub struct Busy {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Quiet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quiet")
            .field("in_flight", &self.inner.lock().in_flight)
            .finish_non_exhaustive()
    }
}

impl Default for Quiet {
    fn default() -> Self {
        Self::new(SETTLE, LONGEST)
    }
}

impl Quiet {
    pub fn new(settle: Duration, longest: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                settle,
                longest,
                state: Mutex::new(State {
                    in_flight: 0,
                    since: Instant::now(),
                }),
                idle: Notify::new(),
            }),
        }
    }

    /// Marks a request in flight until the guard is dropped.
    pub fn busy(&self) -> Busy {
        self.inner.lock().in_flight += 1;
        Busy {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Returns once no request has been in flight for `settle`, or after
    /// `longest` whatever happens.
    pub async fn settled(&self) {
        let deadline = Instant::now() + self.inner.longest;
        loop {
            // Registered before the check, so an end between the check and
            // the wait still wakes it.
            let idle = self.inner.idle.notified();
            let wait = {
                let state = self.inner.lock();
                if state.in_flight > 0 {
                    None
                } else {
                    Some(self.inner.settle.saturating_sub(state.since.elapsed()))
                }
            };
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            let left = deadline - now;
            match wait {
                Some(wait) if wait.is_zero() => return,
                Some(wait) => tokio::time::sleep(wait.min(left)).await,
                None => {
                    let _ = tokio::time::timeout(left, idle).await;
                }
            }
        }
    }
}

/// What a pool's refill waits on before it makes the next piece: nothing
/// while the pool is empty (its next request would make one on its own
/// path), otherwise quiet, cut short when the pool empties meanwhile.
#[derive(Default)]
pub struct Refill {
    emptied: Notify,
}

impl Refill {
    /// Called by the pool's `take` when it left the pool empty.
    pub fn emptied(&self) {
        self.emptied.notify_waiters();
    }

    /// Waits for the refill's turn; `is_empty` reads the pool.
    pub async fn turn(&self, quiet: &Quiet, is_empty: impl FnOnce() -> bool) {
        let emptied = self.emptied.notified();
        tokio::pin!(emptied);
        // Registered before the pool is read, so a take between the two
        // still cuts the wait short.
        emptied.as_mut().enable();
        if is_empty() {
            return;
        }
        tokio::select! {
            () = quiet.settled() => {}
            () = emptied => {}
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is two plain fields, whole after any panic.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.inner.lock();
        state.in_flight -= 1;
        if state.in_flight == 0 {
            state.since = Instant::now();
            drop(state);
            self.inner.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTLE: Duration = Duration::from_millis(30);
    const LONGEST: Duration = Duration::from_secs(3);

    #[tokio::test(start_paused = true)]
    async fn a_quiet_server_settles_after_the_settle_time() {
        let quiet = Quiet::new(SETTLE, LONGEST);
        let began = tokio::time::Instant::now();
        quiet.settled().await;
        assert_eq!(began.elapsed(), SETTLE);
        // Quiet for longer than that already: at once.
        tokio::time::sleep(SETTLE * 3).await;
        let again = tokio::time::Instant::now();
        quiet.settled().await;
        assert_eq!(again.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refill_waits_for_the_request_in_flight_and_then_the_settle_time() {
        let quiet = Quiet::new(SETTLE, LONGEST);
        let busy = quiet.busy();
        let waiter = tokio::spawn({
            let quiet = quiet.clone();
            async move {
                quiet.settled().await;
                tokio::time::Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !waiter.is_finished(),
            "settled while a request was in flight"
        );
        let ended = tokio::time::Instant::now();
        drop(busy);
        let settled = waiter.await.unwrap();
        assert!(
            settled >= ended + SETTLE,
            "settled {:?} after the request",
            settled - ended
        );
        assert!(settled < ended + SETTLE * 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_never_idle_still_refills_after_the_longest_wait() {
        let quiet = Quiet::new(SETTLE, LONGEST);
        let _busy = quiet.busy();
        let began = tokio::time::Instant::now();
        quiet.settled().await;
        assert!(began.elapsed() >= LONGEST);
        assert!(began.elapsed() < LONGEST + SETTLE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refill_waits_for_quiet_unless_the_pool_is_or_becomes_empty() {
        let quiet = Quiet::new(SETTLE, LONGEST);
        let refill = Arc::new(Refill::default());
        let _busy = quiet.busy();
        let began = tokio::time::Instant::now();
        refill.turn(&quiet, || true).await;
        assert_eq!(began.elapsed(), Duration::ZERO, "an empty pool waited");
        let waiter = tokio::spawn({
            let (quiet, refill) = (quiet.clone(), Arc::clone(&refill));
            async move { refill.turn(&quiet, || false).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !waiter.is_finished(),
            "a pool with shims ready refilled during a request"
        );
        refill.emptied();
        tokio::time::timeout(Duration::from_millis(1), waiter)
            .await
            .expect("a pool that emptied still waited")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_within_the_settle_time_restarts_it() {
        let quiet = Quiet::new(SETTLE, LONGEST);
        tokio::time::sleep(SETTLE).await;
        let began = tokio::time::Instant::now();
        drop(quiet.busy());
        quiet.settled().await;
        assert!(
            began.elapsed() >= SETTLE,
            "settled {:?} after a request ended",
            began.elapsed()
        );
    }
}
