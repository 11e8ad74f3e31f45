//! `POST /process/code-run`: one program's code run to its end in a fresh
//! process (unlike the stateful `interpreter/`), with its output, exit code
//! and, for Python, the matplotlib figures it showed or left open, as the
//! SDK's typed charts.
//!
//! Each run gets a private directory under the agent's state dir holding the
//! code (and, for Python, the prelude that hooks matplotlib and the chart side
//! channel), removed when the run ends. The process itself runs as
//! `/process/execute` runs a command ([`crate::execute::run`]): in the work
//! dir, stdout and stderr in one ordered `result`, a deadline that kills its
//! process group and answers exit code 124 with `timedOut`.

mod charts;
mod runtime;

use std::collections::BTreeMap;
use std::ops::Not as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use serde::{Deserialize, Serialize};

pub use charts::{parse as parse_charts, Chart, ChartElement};
pub use runtime::Language;

use crate::error::{ApiError, Json};
use crate::AppState;

/// The prelude Python code runs under (see its own header).
const PYTHON_PRELUDE: &str = include_str!("prelude.py");

pub fn routes() -> Router<AppState> {
    Router::new().route("/process/code-run", post(code_run))
}

/// The SDK's `CodeRunRequest`.
#[derive(Debug, Deserialize)]
pub struct CodeRunRequest {
    code: String,
    language: String,
    #[serde(default)]
    argv: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    /// Seconds; absent or 0 means the agent's default deadline.
    #[serde(default)]
    timeout: Option<u64>,
}

/// The SDK's `CodeRunResponse`, with `timedOut` as `/process/execute` has it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CodeRunResponse {
    exit_code: i32,
    result: String,
    artifacts: Artifacts,
    #[serde(skip_serializing_if = "<&bool>::not")]
    timed_out: bool,
}

#[derive(Debug, Serialize)]
struct Artifacts {
    /// The same as `result`, as the SDK's `ExecutionArtifacts` has it.
    stdout: String,
    charts: Vec<Chart>,
}

async fn code_run(
    State(state): State<AppState>,
    Json(request): Json<CodeRunRequest>,
) -> Result<Json<CodeRunResponse>, ApiError> {
    let settings = &state.settings;
    let language = Language::parse(&request.language)?;
    let deadline = match request.timeout {
        Some(seconds) if seconds > 0 => Duration::from_secs(seconds),
        _ => settings.default_exec_timeout,
    };
    let path = request
        .envs
        .get("PATH")
        .map(Into::into)
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    let run_dir = RunDir::create(&settings.state_dir)?;
    let code_file = run_dir.path.join(language.code_file());
    let invocation = {
        let (code_file, path) = (code_file.clone(), path.clone());
        // A TypeScript lookup may run `node --version`.
        tokio::task::spawn_blocking(move || runtime::invocation(language, &code_file, &path))
            .await
            .map_err(|e| ApiError::internal("choosing the runtime", e.into()))??
    };
    let write = |path: &Path, contents: &str| {
        std::fs::write(path, contents).map_err(|e| ApiError::internal("writing the code", e))
    };
    write(&code_file, &request.code)?;

    let mut command = std::process::Command::new(&invocation.program);
    command
        .args(&invocation.args)
        .args(&request.argv)
        .env("PWD", &settings.work_dir)
        .envs(&request.envs);
    if language == Language::Python {
        write(&run_dir.path.join("cove_code_run.py"), PYTHON_PRELUDE)?;
        // After the caller's variables: the prelude must find its directory.
        command.env("COVE_CODE_RUN_DIR", &run_dir.path);
        if !request.envs.contains_key("PYTHONUNBUFFERED") {
            // Unbuffered, so stdout and stderr keep their order in `result`.
            command.env("PYTHONUNBUFFERED", "1");
        }
    }
    let finished = crate::execute::run(command, &settings.work_dir, deadline).await?;

    let charts = if language == Language::Python {
        let side_channel = run_dir.path.join("charts.jsonl");
        tokio::task::spawn_blocking(move || charts::read(&side_channel))
            .await
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let result = String::from_utf8_lossy(&finished.output).into_owned();
    Ok(Json(CodeRunResponse {
        exit_code: finished.exit_code,
        artifacts: Artifacts {
            stdout: result.clone(),
            charts,
        },
        result,
        timed_out: finished.timed_out,
    }))
}

/// A run's private directory (mode 0700), removed on drop.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(state_dir: &Path) -> Result<Self, ApiError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let path = state_dir.join(format!("code-run-{}", uuid::Uuid::new_v4().simple()));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)
            .map_err(|e| ApiError::internal("creating the run's directory", e))?;
        Ok(Self { path })
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // Does not follow links the program may have left in it.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
