//! The code interpreter (`/process/interpreter...`): Python contexts whose
//! globals persist across runs, each one long-lived `python3` process running
//! an embedded driver; runs stream over a WebSocket and a timeout interrupts
//! the run, not the context. Owns the context limit.

pub(crate) mod execute;
pub(crate) mod routes;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use nix::unistd::Pid;
use serde::Serialize;

pub use routes::routes;

use crate::error::ApiError;
use crate::Settings;

/// Id of the context runs use when they name none; it cannot be deleted.
pub const DEFAULT_CONTEXT: &str = "default";
/// The only language so far.
pub const PYTHON: &str = "python";

/// `InterpreterContext` of the toolbox API.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContextInfo {
    pub id: String,
    pub active: bool,
    pub created_at: String,
    pub cwd: String,
    pub language: String,
}

pub struct Context {
    id: String,
    cwd: PathBuf,
    created_at: String,
    /// The driver, started on demand; held for a whole run, so runs of one
    /// context take turns.
    worker: tokio::sync::Mutex<Option<worker::Worker>>,
    /// Process group of the current driver, to kill it while a run holds `worker`.
    group: Mutex<Option<Pid>>,
}

impl Context {
    fn new(id: String, cwd: PathBuf) -> Arc<Self> {
        Arc::new(Self {
            id,
            cwd,
            created_at: time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            worker: tokio::sync::Mutex::default(),
            group: Mutex::default(),
        })
    }

    pub fn info(&self) -> ContextInfo {
        ContextInfo {
            id: self.id.clone(),
            active: true,
            created_at: self.created_at.clone(),
            cwd: self.cwd.to_string_lossy().into_owned(),
            language: PYTHON.into(),
        }
    }

    /// Starts the driver if none runs; the caller holds the worker lock.
    fn ensure_worker<'a>(
        &self,
        slot: &'a mut Option<worker::Worker>,
        settings: &Settings,
    ) -> Result<&'a mut worker::Worker, ApiError> {
        if slot.is_none() {
            let started = worker::Worker::spawn(&settings.state_dir, &self.cwd).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound && self.cwd.is_dir() {
                    ApiError::internal("starting python3 (is it installed?)", e)
                } else if !self.cwd.is_dir() {
                    ApiError::io(&self.cwd, e)
                } else {
                    ApiError::internal("starting the interpreter driver", e)
                }
            })?;
            *self.group.lock().unwrap() = Some(started.group());
            *slot = Some(started);
        }
        Ok(slot.as_mut().expect("just started"))
    }

    /// Kills the driver held in `slot` (its `Drop` does); the next run starts
    /// a fresh one.
    fn discard_worker(&self, slot: &mut Option<worker::Worker>) {
        *slot = None;
        *self.group.lock().unwrap() = None;
    }

    /// Kills the driver even while a run is using it.
    fn kill(&self) {
        if let Some(group) = self.group.lock().unwrap().take() {
            worker::signal_group(group, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Every interpreter context of this agent.
#[derive(Default)]
pub struct Registry {
    contexts: Mutex<BTreeMap<String, Arc<Context>>>,
}

impl Registry {
    /// A new context in `cwd` with its driver already started, so a broken
    /// Python shows up here rather than at the first run.
    pub async fn create(
        &self,
        settings: &Settings,
        cwd: PathBuf,
        limit: usize,
    ) -> Result<Arc<Context>, ApiError> {
        if !cwd.is_dir() {
            return Err(ApiError::BadRequest(format!(
                "cwd is not a directory: {}",
                cwd.display()
            )));
        }
        let context = Context::new(uuid::Uuid::new_v4().to_string(), cwd);
        {
            let mut contexts = self.contexts.lock().unwrap();
            let user_contexts = contexts.keys().filter(|id| *id != DEFAULT_CONTEXT).count();
            if user_contexts >= limit {
                return Err(ApiError::LimitReached {
                    what: "interpreter contexts",
                    limit,
                });
            }
            contexts.insert(context.id.clone(), context.clone());
        }
        let mut slot = context.worker.lock().await;
        if let Err(e) = context.ensure_worker(&mut slot, settings) {
            self.contexts.lock().unwrap().remove(&context.id);
            return Err(e);
        }
        drop(slot);
        Ok(context)
    }

    /// Context `id`, or the default one (made on first use) when `id` is `None`.
    pub fn get(&self, id: Option<&str>, settings: &Settings) -> Result<Arc<Context>, ApiError> {
        let mut contexts = self.contexts.lock().unwrap();
        match id {
            Some(id) => contexts
                .get(id)
                .cloned()
                .ok_or_else(|| ApiError::ContextNotFound(id.to_string())),
            None => Ok(contexts
                .entry(DEFAULT_CONTEXT.to_string())
                .or_insert_with(|| {
                    Context::new(DEFAULT_CONTEXT.to_string(), settings.work_dir.clone())
                })
                .clone()),
        }
    }

    /// The contexts users created; the default one is not listed, as in Daytona.
    pub fn list(&self) -> Vec<ContextInfo> {
        self.contexts
            .lock()
            .unwrap()
            .values()
            .filter(|c| c.id != DEFAULT_CONTEXT)
            .map(|c| c.info())
            .collect()
    }

    pub fn delete(&self, id: &str) -> Result<(), ApiError> {
        if id == DEFAULT_CONTEXT {
            return Err(ApiError::BadRequest(
                "the default interpreter context cannot be deleted".into(),
            ));
        }
        let context = self
            .contexts
            .lock()
            .unwrap()
            .remove(id)
            .ok_or_else(|| ApiError::ContextNotFound(id.to_string()))?;
        context.kill();
        Ok(())
    }
}
