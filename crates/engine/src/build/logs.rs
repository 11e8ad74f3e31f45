//! Build logs: the lines a build writes, kept in memory per snapshot while
//! the server runs, readable whole or followed as they come.

use std::sync::Mutex;

use tokio::sync::watch;

/// The log of one build.
#[derive(Debug)]
pub struct BuildLog {
    lines: Mutex<Vec<String>>,
    /// How many lines there are, and whether the build has ended.
    progress: watch::Sender<(usize, bool)>,
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
        let len = lines.len();
        self.progress.send_modify(|p| p.0 = len);
    }

    pub fn finish(&self) {
        self.progress.send_modify(|p| p.1 = true);
    }

    /// The lines from `from` on, and whether the build has ended.
    pub fn read(&self, from: usize) -> (Vec<String>, bool) {
        let done = self.progress.borrow().1;
        let lines = self.lines.lock().unwrap();
        (lines.get(from..).unwrap_or_default().to_vec(), done)
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
            loop {
                let (lines, done) = writer.read(seen.len());
                seen.extend(lines);
                if done {
                    return seen;
                }
                writer.wait(seen.len()).await;
            }
        });
        tokio::task::yield_now().await;
        log.line("two");
        log.finish();
        assert_eq!(follower.await.unwrap(), ["one", "two"]);
        assert_eq!(
            BuildLog::finished(vec!["x".into()]).read(0),
            (vec!["x".into()], true)
        );
    }
}
