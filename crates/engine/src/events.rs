//! The feed of sandbox changes: a new sandbox, and every change of state or
//! desired state the engine records, published right after the store has it,
//! so a subscriber that reads the sandbox on hearing of it sees the same.
//!
//! A broadcast channel: each subscriber has its own cursor, and one that
//! falls more than [`FEED_CAPACITY`] events behind loses the oldest (it is
//! told how many, and reads the sandbox again if it cares). Publishing never
//! waits on a subscriber. Knows nothing of who subscribes or of any wire
//! format (the API turns events into Socket.IO messages).

use cove_lifecycle::{DesiredState, SandboxState};
use cove_store::SandboxRecord;
use tokio::sync::broadcast;

/// How many events a subscriber may fall behind before it loses the oldest.
pub const FEED_CAPACITY: usize = 1024;

/// One change of a sandbox, with the sandbox as recorded after it.
#[derive(Clone, Debug)]
pub enum SandboxEvent {
    /// A new sandbox, announced once its create has ended (`started`, or
    /// `error`), not while it is `creating`: a create answers the sandbox
    /// as it ends, and a client that hears of it late (the SDKs take the
    /// state of a `sandbox.created` as it is) must not hear it older than
    /// that answer.
    Created { sandbox: SandboxRecord },
    /// Its state changed; a deleted sandbox's last one is `destroyed`.
    StateUpdated {
        sandbox: SandboxRecord,
        old_state: SandboxState,
    },
    /// What its user asked for changed.
    DesiredStateUpdated {
        sandbox: SandboxRecord,
        old_desired_state: DesiredState,
    },
}

impl SandboxEvent {
    /// The sandbox as recorded after the change.
    pub fn sandbox(&self) -> &SandboxRecord {
        match self {
            SandboxEvent::Created { sandbox }
            | SandboxEvent::StateUpdated { sandbox, .. }
            | SandboxEvent::DesiredStateUpdated { sandbox, .. } => sandbox,
        }
    }
}

/// What a sandbox's row said before a change: the two fields events report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Recorded {
    pub(crate) state: SandboxState,
    pub(crate) desired_state: DesiredState,
}

impl Recorded {
    pub(crate) fn of(record: &SandboxRecord) -> Recorded {
        Recorded {
            state: record.state,
            desired_state: record.desired_state,
        }
    }
}

pub(crate) struct Events {
    sender: broadcast::Sender<SandboxEvent>,
}

impl Events {
    pub(crate) fn new() -> Events {
        Events {
            sender: broadcast::Sender::new(FEED_CAPACITY),
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<SandboxEvent> {
        self.sender.subscribe()
    }

    /// Whether anyone listens: with no one, what a change was before need
    /// not be read.
    pub(crate) fn has_subscribers(&self) -> bool {
        self.sender.receiver_count() > 0
    }

    pub(crate) fn created(&self, sandbox: &SandboxRecord) {
        self.publish(SandboxEvent::Created {
            sandbox: sandbox.clone(),
        });
    }

    /// Publishes what changed from `before` to `sandbox`: its state, its
    /// desired state, both (state first) or nothing. A sandbox leaving
    /// `creating` is announced as created (one that never got there, its
    /// create undone, was never announced and is not now).
    pub(crate) fn changed(&self, before: Recorded, sandbox: &SandboxRecord) {
        if before.state == SandboxState::Creating {
            if !matches!(
                sandbox.state,
                SandboxState::Creating | SandboxState::Destroyed
            ) {
                self.created(sandbox);
            }
            return;
        }
        if before.state != sandbox.state {
            self.publish(SandboxEvent::StateUpdated {
                sandbox: sandbox.clone(),
                old_state: before.state,
            });
        }
        if before.desired_state != sandbox.desired_state {
            self.publish(SandboxEvent::DesiredStateUpdated {
                sandbox: sandbox.clone(),
                old_desired_state: before.desired_state,
            });
        }
    }

    fn publish(&self, event: SandboxEvent) {
        // An error only says that no one listens, which is no error here.
        let _ = self.sender.send(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: SandboxState, desired_state: DesiredState) -> SandboxRecord {
        SandboxRecord {
            state,
            desired_state,
            ..SandboxRecord::sample("s1", "s1")
        }
    }

    fn names(events: &mut broadcast::Receiver<SandboxEvent>) -> Vec<String> {
        let mut names = Vec::new();
        while let Ok(event) = events.try_recv() {
            names.push(match event {
                SandboxEvent::Created { sandbox } => format!("created {}", sandbox.state),
                SandboxEvent::StateUpdated { sandbox, old_state } => {
                    format!("state {old_state} -> {}", sandbox.state)
                }
                SandboxEvent::DesiredStateUpdated {
                    sandbox,
                    old_desired_state,
                } => format!(
                    "desired {} -> {}",
                    old_desired_state.as_str(),
                    sandbox.desired_state.as_str()
                ),
            });
        }
        names
    }

    #[test]
    fn only_what_changed_is_published_state_first() {
        let events = Events::new();
        let mut feed = events.subscribe();
        let started = record(SandboxState::Started, DesiredState::Started);
        let stopping = record(SandboxState::Stopping, DesiredState::Stopped);
        let stopped = record(SandboxState::Stopped, DesiredState::Stopped);

        events.changed(Recorded::of(&started), &stopping);
        events.changed(Recorded::of(&stopping), &stopped);
        events.changed(Recorded::of(&stopped), &stopped);

        assert_eq!(
            names(&mut feed),
            [
                "state started -> stopping",
                "desired started -> stopped",
                "state stopping -> stopped",
            ]
        );
    }

    #[test]
    fn a_new_sandbox_is_announced_once_as_its_create_ends_and_an_undone_one_never() {
        let events = Events::new();
        let mut feed = events.subscribe();
        let creating = record(SandboxState::Creating, DesiredState::Started);
        let started = record(SandboxState::Started, DesiredState::Started);
        let failed = record(SandboxState::Error, DesiredState::Started);
        let undone = record(SandboxState::Destroyed, DesiredState::Destroyed);

        events.changed(Recorded::of(&creating), &creating);
        events.changed(Recorded::of(&creating), &started);
        events.changed(Recorded::of(&creating), &failed);
        events.changed(Recorded::of(&creating), &undone);

        assert_eq!(names(&mut feed), ["created started", "created error"]);
    }

    #[test]
    fn a_subscriber_far_behind_loses_the_oldest_and_publishing_goes_on() {
        let events = Events::new();
        let mut feed = events.subscribe();
        let sandbox = record(SandboxState::Creating, DesiredState::Started);
        for _ in 0..FEED_CAPACITY + 10 {
            events.created(&sandbox);
        }
        assert!(matches!(
            feed.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(10))
        ));
        assert_eq!(names(&mut feed).len(), FEED_CAPACITY);
    }

    #[test]
    fn publishing_with_no_subscriber_is_fine() {
        let events = Events::new();
        assert!(!events.has_subscribers());
        events.created(&record(SandboxState::Creating, DesiredState::Started));
        let feed = events.subscribe();
        assert!(events.has_subscribers());
        drop(feed);
        assert!(!events.has_subscribers());
    }
}
