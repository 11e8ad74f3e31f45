//! Build logs: the lines a build writes, kept in memory per snapshot while
//! the server runs, readable whole or followed as they come.
//!
//! A log is bounded, because what a `RUN` prints is the Dockerfile
//! author's to choose: its first `HEAD_BYTES` and its last `TAIL_BYTES`
//! are kept, with one line between them saying how much was dropped, and
//! a line longer than `MAX_LINE_BYTES` is cut. The store keeps what the
//! memory kept, so both are bounded alike.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::watch;

/// The beginning of a log kept whole (where a build says what it is doing).
pub(super) const HEAD_BYTES: usize = 256 << 10;
/// The end of a log kept (where a build says why it failed).
pub(super) const TAIL_BYTES: usize = 768 << 10;
/// The longest line kept; the rest of a longer one is dropped.
pub(super) const MAX_LINE_BYTES: usize = 16 << 10;

/// The log of one build.
#[derive(Debug)]
pub struct BuildLog {
    lines: Mutex<Lines>,
    /// How many lines were written, and whether the build has ended.
    progress: watch::Sender<(usize, bool)>,
}

/// The kept lines. Line `n` (counting every line ever written) is in
/// `head` while `n < head.len()`, else in `tail` if it is among the last.
#[derive(Debug, Default)]
struct Lines {
    head: Vec<String>,
    head_bytes: usize,
    /// Once the head is full.
    head_full: bool,
    tail: VecDeque<String>,
    tail_bytes: usize,
    /// Lines dropped between head and tail, and their bytes.
    dropped: usize,
    dropped_bytes: u64,
    written: usize,
}

/// What a line costs against the bounds: its bytes and its newline.
fn cost(line: &str) -> usize {
    line.len() + 1
}

impl Lines {
    fn push(&mut self, mut line: String) {
        if line.len() > MAX_LINE_BYTES {
            let mut cut = MAX_LINE_BYTES;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            let dropped = line.len() - cut;
            line.truncate(cut);
            line.push_str(&format!(" [... {dropped} more bytes of this line dropped]"));
        }
        self.written += 1;
        if !self.head_full && self.head_bytes + cost(&line) <= HEAD_BYTES {
            self.head_bytes += cost(&line);
            self.head.push(line);
            return;
        }
        self.head_full = true;
        self.tail_bytes += cost(&line);
        self.tail.push_back(line);
        while self.tail_bytes > TAIL_BYTES {
            let Some(old) = self.tail.pop_front() else {
                break;
            };
            self.tail_bytes -= cost(&old);
            self.dropped += 1;
            self.dropped_bytes += cost(&old) as u64;
        }
    }

    /// The kept lines from line `from` on, with the marker where lines
    /// were dropped.
    fn kept_from(&self, from: usize) -> Vec<String> {
        let mut lines: Vec<String> = self.head.get(from..).unwrap_or_default().to_vec();
        let tail_start = self.written - self.tail.len();
        if self.dropped > 0 && from < tail_start {
            lines.push(format!(
                "[... {} lines ({} bytes) of this build's output dropped: a log keeps its first {} KiB and last {} KiB ...]",
                self.dropped,
                self.dropped_bytes,
                HEAD_BYTES >> 10,
                TAIL_BYTES >> 10
            ));
        }
        let skip = from.saturating_sub(tail_start);
        lines.extend(self.tail.iter().skip(skip).cloned());
        lines
    }
}

impl Default for BuildLog {
    fn default() -> Self {
        BuildLog {
            lines: Mutex::default(),
            progress: watch::channel((0, false)).0,
        }
    }
}

impl BuildLog {
    /// A log that has ended with these lines.
    pub fn finished(lines: Vec<String>) -> BuildLog {
        let log = BuildLog::default();
        for line in lines {
            log.line(line);
        }
        log.finish();
        log
    }

    pub fn line(&self, line: impl Into<String>) {
        let mut lines = self.lines.lock().unwrap();
        lines.push(line.into());
        let written = lines.written;
        self.progress.send_modify(|p| p.0 = written);
    }

    pub fn finish(&self) {
        self.progress.send_modify(|p| p.1 = true);
    }

    /// The whole log as kept, and whether the build has ended.
    pub fn read_all(&self) -> (Vec<String>, bool) {
        let (lines, _, done) = self.read(0);
        (lines, done)
    }

    /// The lines from line `from` on (lines dropped meanwhile are one
    /// marker line), where to read on from, and whether the build has ended.
    pub fn read(&self, from: usize) -> (Vec<String>, usize, bool) {
        let done = self.progress.borrow().1;
        let lines = self.lines.lock().unwrap();
        (lines.kept_from(from), lines.written, done)
    }

    /// Waits until there is a line after the first `seen`, or the build ends.
    pub async fn wait(&self, seen: usize) {
        let mut progress = self.progress.subscribe();
        let _ = progress.wait_for(|(len, done)| *len > seen || *done).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_see_every_line_then_the_end() {
        let log = std::sync::Arc::new(BuildLog::default());
        log.line("one");
        let writer = log.clone();
        let follower = tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut next = 0;
            loop {
                let (lines, after, done) = writer.read(next);
                seen.extend(lines);
                next = after;
                if done {
                    return seen;
                }
                writer.wait(next).await;
            }
        });
        tokio::task::yield_now().await;
        log.line("two");
        log.finish();
        assert_eq!(follower.await.unwrap(), ["one", "two"]);
        assert_eq!(
            BuildLog::finished(vec!["x".into()]).read_all(),
            (vec!["x".into()], true)
        );
    }

    /// Attack: a `RUN` that prints without end (`yes`) made the server keep
    /// every line in memory and then in the store. Now the log keeps its
    /// first and last lines and says how many it dropped.
    #[test]
    fn a_flood_of_output_keeps_the_beginning_and_the_end() {
        let log = BuildLog::default();
        let total = 200_000;
        for n in 0..total {
            log.line(format!("line {n} {}", "y".repeat(90)));
        }
        log.line("z".repeat(10 << 20));
        let (lines, done) = log.read_all();
        assert!(!done);
        let kept: usize = lines.iter().map(|l| cost(l)).sum();
        assert!(kept <= HEAD_BYTES + TAIL_BYTES + 1024, "{kept} bytes kept");
        assert!(lines[0].starts_with("line 0 "), "{}", lines[0]);
        let marker = lines
            .iter()
            .find(|l| l.contains("dropped"))
            .expect("a marker line");
        assert!(marker.contains(" lines ("), "{marker}");
        let last = lines.last().unwrap();
        assert!(last.len() < MAX_LINE_BYTES + 100, "{} bytes", last.len());
        assert!(last.ends_with("more bytes of this line dropped]"), "{last}");
        assert!(lines[lines.len() - 2].starts_with(&format!("line {} ", total - 1)));

        // A follower that was in the head still learns of the gap.
        let (from_five, next, _) = log.read(5);
        assert!(from_five[0].starts_with("line 5 "));
        assert!(from_five.iter().any(|l| l == marker));
        assert_eq!(next, total + 1);
        assert_eq!(log.read(next).0, Vec::<String>::new());
    }
}
