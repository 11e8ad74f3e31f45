//! A runtime that runs nothing, for tests of the engine and the API.
//!
//! It keeps the state a real backend would have (prepared, running) so tests can
//! check that the engine drove it correctly, and it can be told to fail.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use async_trait::async_trait;
use tokio::sync::oneshot;

use crate::SandboxId;
use crate::{AgentEndpoint, Runtime, RuntimeError, SandboxSpec, Started};

#[derive(Debug, Default)]
struct Machine {
    running: bool,
    /// Holds saved memory (after pause or fork): the next start continues from it.
    memory: bool,
    /// Fires `Started::exited` when the machine is stopped or crashes.
    exit: Option<oneshot::Sender<String>>,
}

/// The fake runtime.
/// Makes the error a failing start answers, from the sandbox's id.
pub type StartFailure = fn(&str) -> RuntimeError;

#[derive(Debug, Default)]
pub struct FakeRuntime {
    machines: Mutex<HashMap<String, Machine>>,
    fail_start: Mutex<Option<String>>,
    fail_start_with: Mutex<Option<StartFailure>>,
    /// The hostname (the sandbox's name) whose starts fail.
    fail_start_of: Mutex<Option<String>>,
    calls: Mutex<Vec<String>>,
}

impl FakeRuntime {
    pub fn new() -> FakeRuntime {
        FakeRuntime::default()
    }

    /// Makes every following `start` fail with `reason`, or succeed again with `None`.
    pub fn fail_start(&self, reason: Option<&str>) {
        *self.fail_start.lock().unwrap() = reason.map(str::to_owned);
    }

    /// Makes every following `start` fail with the error `make` gives for
    /// the sandbox's id (of any kind), or succeed again with `None`.
    pub fn fail_start_with(&self, make: Option<StartFailure>) {
        *self.fail_start_with.lock().unwrap() = make;
    }

    /// Makes every following `start` of the sandbox whose hostname is `name`
    /// fail, or no longer with `None`.
    pub fn fail_start_of(&self, name: Option<&str>) {
        *self.fail_start_of.lock().unwrap() = name.map(str::to_owned);
    }

    /// Ends a running machine as if it had crashed.
    pub fn crash(&self, id: &str) {
        if let Some(machine) = self.machines.lock().unwrap().get_mut(id) {
            machine.running = false;
            if let Some(exit) = machine.exit.take() {
                let _ = exit.send("killed by the test".into());
            }
        }
    }

    /// Ids of the machines that exist (prepared and not destroyed).
    pub fn machines(&self) -> Vec<String> {
        let mut ids: Vec<_> = self.machines.lock().unwrap().keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Every call so far, as "operation id".
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, operation: &str, id: &str) {
        self.calls.lock().unwrap().push(format!("{operation} {id}"));
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        self.record("prepare", &spec.id);
        self.machines
            .lock()
            .unwrap()
            .entry(spec.id.to_string())
            .or_default();
        Ok(())
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError> {
        let resumes = self
            .machines
            .lock()
            .unwrap()
            .get(spec.id.as_str())
            .is_some_and(|m| m.memory);
        self.record(if resumes { "resume" } else { "start" }, &spec.id);
        if let Some(make) = *self.fail_start_with.lock().unwrap() {
            return Err(make(&spec.id));
        }
        let named = self.fail_start_of.lock().unwrap().clone();
        if named.is_some_and(|name| name == spec.hostname) {
            return Err(RuntimeError::Start {
                id: spec.id.to_string(),
                reason: format!("the test fails the start of {}", spec.hostname),
            });
        }
        if let Some(reason) = self.fail_start.lock().unwrap().clone() {
            return Err(RuntimeError::Start {
                id: spec.id.to_string(),
                reason,
            });
        }
        let mut machines = self.machines.lock().unwrap();
        let machine = machines
            .get_mut(spec.id.as_str())
            .ok_or_else(|| RuntimeError::Other {
                id: spec.id.to_string(),
                reason: "started before it was prepared".into(),
            })?;
        let (exit, exited) = oneshot::channel();
        machine.running = true;
        machine.memory = false;
        machine.exit = Some(exit);
        Ok(Started {
            agent: AgentEndpoint::Unix(PathBuf::from("/nonexistent")),
            exited,
            accelerator: None,
        })
    }

    async fn stop(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.record("stop", id);
        if let Some(machine) = self.machines.lock().unwrap().get_mut(id) {
            machine.running = false;
            machine.memory = false;
            if let Some(exit) = machine.exit.take() {
                let _ = exit.send("stopped".into());
            }
        }
        Ok(())
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.record("destroy", id);
        self.machines.lock().unwrap().remove(id);
        Ok(())
    }

    async fn is_running(&self, id: &SandboxId) -> bool {
        let id = id.as_str();
        self.machines
            .lock()
            .unwrap()
            .get(id)
            .is_some_and(|m| m.running)
    }

    async fn sandbox_ids(&self) -> Result<Vec<String>, RuntimeError> {
        Ok(self.machines())
    }

    /// A running machine counts as one agent; the fake has no QEMU and no pool.
    fn census(&self) -> crate::Census {
        let machines = self.machines.lock().unwrap();
        crate::Census {
            agents: machines.values().filter(|m| m.running).count(),
            ..crate::Census::default()
        }
    }

    async fn capture(&self, id: &SandboxId, capture_id: &str) -> Result<PathBuf, RuntimeError> {
        let id = id.as_str();
        self.record("capture", &format!("{id} {capture_id}"));
        Ok(PathBuf::from(format!("/captures/{capture_id}")))
    }

    async fn discard_capture(&self, capture_id: &str) -> Result<(), RuntimeError> {
        self.record("discard", capture_id);
        Ok(())
    }

    async fn revert(&self, spec: &SandboxSpec, capture_id: &str) -> Result<(), RuntimeError> {
        self.record("revert", &format!("{} {capture_id}", spec.id));
        let running = self
            .machines
            .lock()
            .unwrap()
            .get(spec.id.as_str())
            .is_some_and(|m| m.running);
        if running {
            return Err(RuntimeError::Running {
                id: spec.id.to_string(),
                action: "be reverted",
            });
        }
        Ok(())
    }

    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.record("pause", id);
        let mut machines = self.machines.lock().unwrap();
        match machines.get_mut(id) {
            Some(machine) if machine.running => {
                machine.running = false;
                machine.memory = true;
                if let Some(exit) = machine.exit.take() {
                    let _ = exit.send("paused".into());
                }
                Ok(())
            }
            _ => Err(RuntimeError::NotRunning { id: id.to_owned() }),
        }
    }

    async fn discard_memory(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.record("discard-memory", id);
        if let Some(machine) = self.machines.lock().unwrap().get_mut(id) {
            machine.memory = false;
        }
        Ok(())
    }

    async fn capture_with_memory(
        &self,
        id: &SandboxId,
        capture_id: &str,
    ) -> Result<PathBuf, RuntimeError> {
        let (sandbox, id) = (id, id.as_str());
        self.record("capture-memory", &format!("{id} {capture_id}"));
        if !self.is_running(sandbox).await {
            return Err(RuntimeError::NotRunning { id: id.to_owned() });
        }
        Ok(PathBuf::from(format!("/captures/{capture_id}")))
    }

    async fn fork(&self, parent: &SandboxId, child: &SandboxSpec) -> Result<(), RuntimeError> {
        self.record("fork", &format!("{parent} {}", child.id));
        if !self.is_running(parent).await {
            let parent = parent.as_str();
            return Err(RuntimeError::NotRunning {
                id: parent.to_owned(),
            });
        }
        let mut machines = self.machines.lock().unwrap();
        machines.entry(child.id.to_string()).or_default().memory = true;
        Ok(())
    }

    async fn fork_many(
        &self,
        parent: &SandboxId,
        children: &[SandboxSpec],
    ) -> Result<(), RuntimeError> {
        let ids: Vec<&str> = children.iter().map(|c| c.id.as_str()).collect();
        self.record("fork-many", &format!("{parent} {}", ids.join(",")));
        if !self.is_running(parent).await {
            return Err(RuntimeError::NotRunning {
                id: parent.to_string(),
            });
        }
        let mut machines = self.machines.lock().unwrap();
        for id in ids {
            machines.entry(id.to_owned()).or_default().memory = true;
        }
        Ok(())
    }
}
