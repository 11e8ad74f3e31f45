//! The timer loop: checks every sandbox's timers and runs what is due through the
//! same operations a user would call.

use cove_lifecycle::{due_action, TimerView};

use super::Sandboxes;
use crate::{now_ms, EngineError};

impl Sandboxes {
    /// Checks timers every tick, forever.
    pub async fn run_timers(&self) {
        let mut tick = tokio::time::interval(self.shared.config.timer_tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = self.check_timers(now_ms()).await {
                tracing::error!(error = %crate::error::describe(&error), "checking timers");
            }
        }
    }

    /// One pass: flushes the idle clocks, then runs every due timer. Returns what ran,
    /// as (sandbox id, timer name).
    pub async fn check_timers(&self, now: i64) -> Result<Vec<(String, &'static str)>, EngineError> {
        self.shared.activity.flush(&self.shared.store).await?;
        let mut fired = Vec::new();
        for record in self.shared.store.list_sandboxes().await? {
            let view = TimerView {
                state: record.state,
                settings: record.timers,
                last_activity_ms: record.last_activity_ms,
                state_since_ms: record.state_since_ms,
                ttl_deadline_ms: record.ttl_deadline_ms,
                can_archive: self.check_can_archive(&record).is_ok(),
            };
            let Some(action) = due_action(&view, now) else {
                continue;
            };
            tracing::info!(sandbox = %record.id, timer = action.as_str(), "timer fired");
            let result = match action.operation() {
                cove_lifecycle::Operation::Stop => self.stop(&record.id).await.map(drop),
                cove_lifecycle::Operation::Archive => self.archive(&record.id).await.map(drop),
                cove_lifecycle::Operation::Pause => self.pause(&record.id).await.map(drop),
                operation => self.run(&record.id, operation).await.map(drop),
            };
            match result {
                Ok(()) => fired.push((record.id, action.as_str())),
                Err(error) => {
                    tracing::warn!(sandbox = %record.id, timer = action.as_str(), error = %crate::error::describe(&error), "timer could not act")
                }
            }
        }
        Ok(fired)
    }
}
