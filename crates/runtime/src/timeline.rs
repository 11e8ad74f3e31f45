//! The milliseconds of an operation, step by step: a [`Timeline`] notes the
//! end of each step and logs them all as one `debug` line when the operation
//! is done, so the budget of a create is visible with `COVE_LOG=debug`
//! without a tracing span per step on the hot path. It measures; it never
//! decides anything.

use std::fmt::Write;
use std::time::Instant;

/// Steps of one operation and how long each took.
#[derive(Debug)]
pub struct Timeline {
    what: &'static str,
    began: Instant,
    last: Instant,
    steps: Vec<(&'static str, u64)>,
}

impl Timeline {
    /// Starts timing `what` (logged as its message).
    pub fn start(what: &'static str) -> Timeline {
        let now = Instant::now();
        Timeline {
            what,
            began: now,
            last: now,
            steps: Vec::with_capacity(8),
        }
    }

    /// Notes that `step` ended now: it took the time since the previous one.
    pub fn step(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps
            .push((step, now.duration_since(self.last).as_micros() as u64));
        self.last = now;
    }

    /// Notes a step that ended now and began at `began_ns` on the monotonic
    /// clock (see [`monotonic_ns`]), possibly in another process; the next
    /// step is timed from now.
    pub fn step_since(&mut self, step: &'static str, began_ns: u64) {
        let micros = monotonic_ns().saturating_sub(began_ns) / 1000;
        self.steps.push((step, micros));
        self.last = Instant::now();
    }

    /// The steps as `name=µs` pairs, in order.
    pub fn steps(&self) -> &[(&'static str, u64)] {
        &self.steps
    }

    /// `name=1.23ms ...`, the steps in order.
    pub fn summary(&self) -> String {
        let mut line = String::new();
        for (step, micros) in &self.steps {
            let _ = write!(line, "{step}={:.2}ms ", *micros as f64 / 1000.0);
        }
        line.truncate(line.trim_end().len());
        line
    }

    /// Logs the steps at `debug` for `sandbox`, with the total.
    pub fn log(&self, sandbox: &str) {
        tracing::debug!(
            sandbox,
            total_ms = self.began.elapsed().as_micros() as f64 / 1000.0,
            steps = %self.summary(),
            "{}",
            self.what
        );
    }
}

/// Now on the monotonic clock, in nanoseconds: the same clock in every process
/// of the host, so one process can time a step another began.
#[allow(unsafe_code)]
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_kept_in_order_and_named_in_the_summary() {
        let mut timeline = Timeline::start("create");
        timeline.step("first");
        timeline.step("second");
        let names: Vec<_> = timeline.steps().iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["first", "second"]);
        let summary = timeline.summary();
        assert!(summary.starts_with("first="), "{summary}");
        assert!(summary.contains(" second="), "{summary}");
        assert!(summary.ends_with("ms"), "{summary}");
    }
}
