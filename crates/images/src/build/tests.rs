//! The builder against a fake [`BuildHost`] that records every call: what
//! runs where and in which order, what the cache spares, what a failure
//! says and that every build sandbox is removed. No root, no sandbox.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::*;

/// A host failure, as the fake reports one.
#[derive(Debug, thiserror::Error)]
#[error("fake host: {0}")]
struct FakeError(String);

/// What the fake's `run` answers for a command containing a word.
struct Scripted {
    word: &'static str,
    executed: Executed,
}

/// An archive the fake unpacked: its entries (path, contents) and owner.
type Unpacked = (BTreeMap<String, String>, Option<String>);

#[derive(Default)]
struct FakeHost {
    /// Every call, in order, as `verb id-or-key detail`.
    calls: Mutex<Vec<String>>,
    /// Cache key -> layer.
    cache: Mutex<HashMap<String, String>>,
    /// Answers for commands; anything else exits 0 printing `ran`.
    scripted: Vec<Scripted>,
    /// `start` fails.
    refuse_start: bool,
    /// Paths `is_dir` says are directories.
    dirs: Vec<&'static str>,
    /// Another build keeps every step first: `keep_layer` answers this.
    raced_by: Option<&'static str>,
    /// Every archive unpacked.
    unpacked: Mutex<Vec<Unpacked>>,
    /// The sandbox of each `start`.
    started: Mutex<Vec<StepSandbox>>,
}

impl FakeHost {
    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    /// The calls without sandbox ids, which are random.
    fn verbs(&self) -> Vec<String> {
        self.calls()
            .iter()
            .map(|c| c.split(' ').next().unwrap().to_owned())
            .collect()
    }
}

#[async_trait]
impl BuildHost for FakeHost {
    type Sandbox = String;
    type Error = FakeError;

    async fn cached_layer(&self, key: &str) -> Result<Option<String>, FakeError> {
        self.record(format!("cached {key}"));
        Ok(self.cache.lock().unwrap().get(key).cloned())
    }

    async fn keep_layer(
        &self,
        key: &str,
        capture_id: &str,
        layer: &Path,
    ) -> Result<String, FakeError> {
        self.record(format!("keep {key} {capture_id}"));
        let layer = match self.raced_by {
            Some(theirs) => theirs.to_owned(),
            None => layer.display().to_string(),
        };
        self.cache
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_insert(layer.clone());
        Ok(layer)
    }

    async fn start(&self, sandbox: &StepSandbox) -> Result<String, FakeError> {
        self.record(format!("start {}", sandbox.id));
        assert!(sandbox.id.starts_with(BUILD_SANDBOX_PREFIX));
        self.started.lock().unwrap().push(sandbox.clone());
        if self.refuse_start {
            return Err(FakeError("no room for a sandbox".into()));
        }
        Ok(sandbox.id.clone())
    }

    async fn run(
        &self,
        sandbox: &String,
        argv: &[String],
        env: &BTreeMap<String, String>,
        workdir: Option<&str>,
    ) -> Result<Executed, FakeError> {
        let line = argv.join(" ");
        let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        self.record(format!(
            "run {sandbox} {line} [{}] in {}",
            env.join(","),
            workdir.unwrap_or("~")
        ));
        Ok(self
            .scripted
            .iter()
            .find(|s| line.contains(s.word))
            .map(|s| s.executed.clone())
            .unwrap_or(Executed {
                exit_code: 0,
                output: "ran".into(),
                timed_out: false,
            }))
    }

    async fn is_dir(&self, sandbox: &String, path: &str) -> Result<bool, FakeError> {
        self.record(format!("is_dir {sandbox} {path}"));
        Ok(self.dirs.contains(&path))
    }

    async fn unpack(
        &self,
        sandbox: &String,
        archive: &Path,
        owner: Option<&str>,
    ) -> Result<(), FakeError> {
        self.record(format!("unpack {sandbox}"));
        let mut entries = BTreeMap::new();
        let mut tar = tar::Archive::new(std::fs::File::open(archive).unwrap());
        for entry in tar.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().display().to_string();
            let mut body = String::new();
            std::io::Read::read_to_string(&mut entry, &mut body).unwrap();
            entries.insert(path, body);
        }
        self.unpacked
            .lock()
            .unwrap()
            .push((entries, owner.map(str::to_owned)));
        Ok(())
    }

    async fn stop(&self, sandbox: &String) -> Result<(), FakeError> {
        self.record(format!("stop {sandbox}"));
        Ok(())
    }

    async fn capture(&self, sandbox: &String, capture_id: &str) -> Result<PathBuf, FakeError> {
        self.record(format!("capture {sandbox} {capture_id}"));
        Ok(PathBuf::from(format!("/layers/{capture_id}")))
    }

    async fn destroy(&self, id: &str) {
        self.record(format!("destroy {id}"));
    }

    fn run_timeout(&self) -> Duration {
        Duration::from_secs(90)
    }
}

fn base() -> BaseImage {
    BaseImage {
        id: "base-1".into(),
        rootfs: "/images/base".into(),
        layers: vec!["/layers/base-top".into()],
        env: BTreeMap::from([("PATH".into(), "/usr/bin".into())]),
        settings: ImageSettings::default(),
    }
}

async fn build_text(
    host: &FakeHost,
    text: &str,
    context: Option<&BuildContext>,
) -> (Result<BuiltImage, BuildError<FakeError>>, Vec<String>) {
    let plan = parse_dockerfile(text).unwrap();
    let log = BuildLog::default();
    let built = build(host, &plan, base(), context, &["ctx1".into()], &log).await;
    (built, log.read_all().0)
}

#[tokio::test]
async fn run_steps_run_in_order_each_in_its_own_sandbox() {
    let host = FakeHost::default();
    let (built, log) = build_text(
        &host,
        "FROM base\nARG V=1\nENV A=$V\nRUN echo one\nRUN echo two\nCMD [\"sh\"]\n",
        None,
    )
    .await;
    let built = built.unwrap();
    // Per RUN: a cache lookup, then a sandbox from start to destroy.
    let per_step = [
        "cached", "start", "run", "stop", "capture", "destroy", "keep",
    ];
    let expected: Vec<String> = per_step
        .iter()
        .chain(&per_step)
        .map(|s| s.to_string())
        .collect();
    assert_eq!(host.verbs(), expected);
    let runs: Vec<String> = host
        .calls()
        .into_iter()
        .filter(|c| c.starts_with("run "))
        .map(|c| {
            c.split_once(' ')
                .unwrap()
                .1
                .split_once(' ')
                .unwrap()
                .1
                .to_owned()
        })
        .collect();
    assert_eq!(
        runs,
        [
            "/bin/sh -c echo one [A=1,PATH=/usr/bin,V=1] in ~",
            "/bin/sh -c echo two [A=1,PATH=/usr/bin,V=1] in ~",
        ]
    );
    // Each step starts on the layers so far; the image's env, not the ARGs.
    let started = host.started.lock().unwrap().clone();
    assert_eq!(started[0].layers, [PathBuf::from("/layers/base-top")]);
    assert_eq!(started[1].layers.len(), 2);
    assert_eq!(started[1].layers[1], PathBuf::from("/layers/base-top"));
    assert!(!started[0].env.contains_key("V"));
    assert_ne!(started[0].id, started[1].id);
    // Layers are topmost first, over the base's.
    assert_eq!(built.layers.len(), 3);
    assert_eq!(built.layers[2], "/layers/base-top");
    assert_eq!(built.env["A"], "1");
    assert_eq!(built.settings.cmd, ["sh"]);
    assert!(
        log.contains(&"STEP 3/5: RUN echo one".to_owned()),
        "{log:?}"
    );
    assert!(log.contains(&"ran".to_owned()));
    assert_eq!(log.last().unwrap(), "build complete");
}

#[tokio::test]
async fn a_cached_step_is_not_run_again() {
    let host = FakeHost::default();
    let text = "FROM base\nRUN echo one\nRUN echo two\n";
    let (first, _) = build_text(&host, text, None).await;
    let first = first.unwrap();
    host.calls.lock().unwrap().clear();
    let (again, log) = build_text(&host, text, None).await;
    assert_eq!(again.unwrap(), first);
    assert_eq!(host.verbs(), ["cached", "cached"]);
    assert_eq!(log.iter().filter(|l| *l == " ---> using cache").count(), 2);
    // A Dockerfile that starts the same reuses the prefix, builds the rest.
    host.calls.lock().unwrap().clear();
    let (longer, _) = build_text(&host, "FROM base\nRUN echo one\nRUN echo three\n", None).await;
    let longer = longer.unwrap();
    assert_eq!(host.verbs().iter().filter(|v| *v == "start").count(), 1);
    assert_eq!(longer.layers[1], first.layers[1]);
    assert_ne!(longer.key, first.key);
}

#[tokio::test]
async fn a_failed_step_reports_its_code_and_output_and_is_cleaned_up() {
    let host = FakeHost {
        scripted: vec![Scripted {
            word: "false",
            executed: Executed {
                exit_code: 7,
                output: "it broke\n".into(),
                timed_out: false,
            },
        }],
        ..FakeHost::default()
    };
    let (built, _) = build_text(&host, "FROM base\nRUN false\nRUN echo never\n", None).await;
    let error = built.unwrap_err();
    assert!(matches!(error, BuildError::Exited { .. }), "{error}");
    assert_eq!(
        error.to_string(),
        "RUN false exited with code 7; output: it broke"
    );
    // Stopped and removed, never captured or kept; no later step ran.
    assert_eq!(host.verbs(), ["cached", "start", "run", "stop", "destroy"]);
}

#[tokio::test]
async fn a_timed_out_step_says_after_how_long() {
    let host = FakeHost {
        scripted: vec![Scripted {
            word: "sleep",
            executed: Executed {
                exit_code: -1,
                output: String::new(),
                timed_out: true,
            },
        }],
        ..FakeHost::default()
    };
    let (built, _) = build_text(&host, "FROM base\nRUN sleep 1000\n", None).await;
    let error = built.unwrap_err().to_string();
    assert!(
        error.contains("RUN sleep 1000 timed out after 90 s"),
        "{error}"
    );
}

#[tokio::test]
async fn a_sandbox_that_does_not_start_is_still_removed() {
    let host = FakeHost {
        refuse_start: true,
        ..FakeHost::default()
    };
    let (built, _) = build_text(&host, "FROM base\nRUN echo hi\n", None).await;
    let error = built.unwrap_err();
    assert!(
        matches!(
            error,
            BuildError::Step {
                error: StepError::Host(_),
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "RUN echo hi: fake host: no room for a sandbox"
    );
    assert_eq!(host.verbs(), ["cached", "start", "destroy"]);
}

#[tokio::test]
async fn workdir_and_user_shape_later_steps() {
    let host = FakeHost::default();
    let (built, _) = build_text(
        &host,
        "FROM base\nUSER app\nWORKDIR /srv\nWORKDIR app\nRUN pwd\n",
        None,
    )
    .await;
    let built = built.unwrap();
    let runs: Vec<String> = host
        .calls()
        .into_iter()
        .filter(|c| c.starts_with("run "))
        .collect();
    assert!(
        runs[0].contains("mkdir -p '/srv' && chown 'app' '/srv' [] in ~"),
        "{runs:?}"
    );
    assert!(runs[1].contains("mkdir -p '/srv/app'"), "{runs:?}");
    assert!(runs[2].ends_with("in /srv/app"), "{runs:?}");
    // WORKDIR runs as root, RUN as the image's user.
    let users: Vec<Option<String>> = host
        .started
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.user.clone())
        .collect();
    assert_eq!(users, [None, None, Some("app".to_owned())]);
    assert_eq!(built.settings.workdir.as_deref(), Some("/srv/app"));
    assert_eq!(built.settings.user.as_deref(), Some("app"));
}

#[tokio::test]
async fn copy_goes_through_the_host_as_one_archive() {
    let scratch = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let archive = files.path().join("context.tar");
    {
        let mut tar = tar::Builder::new(std::fs::File::create(&archive).unwrap());
        let mut header = tar::Header::new_gnu();
        header.set_size(5);
        header.set_mode(0o644);
        tar.append_data(&mut header, "app/main.py", &b"print"[..])
            .unwrap();
        tar.finish().unwrap();
    }
    let context = BuildContext::new(vec![archive], scratch.path().join("build"));
    let host = FakeHost {
        dirs: vec!["/srv"],
        ..FakeHost::default()
    };
    let (built, log) = build_text(
        &host,
        "FROM base\nCOPY --chown=app app/main.py /srv\n",
        Some(&context),
    )
    .await;
    built.unwrap();
    assert_eq!(
        host.verbs(),
        ["cached", "start", "is_dir", "unpack", "stop", "capture", "destroy", "keep"]
    );
    let unpacked = host.unpacked.lock().unwrap().clone();
    assert_eq!(
        unpacked,
        [(
            BTreeMap::from([("srv/main.py".to_owned(), "print".to_owned())]),
            Some("app".to_owned())
        )]
    );
    assert!(
        log.contains(&"copied 1 entries to /srv".to_owned()),
        "{log:?}"
    );
    // The step's archive is gone; the scratch goes with the context.
    assert!(!scratch.path().join("build/copy.tar").exists());
    drop(context);
    assert!(!scratch.path().join("build").exists());
}

#[tokio::test]
async fn a_missing_copy_source_fails_its_step() {
    let scratch = tempfile::tempdir().unwrap();
    let context = BuildContext::new(Vec::new(), scratch.path().join("build"));
    let host = FakeHost::default();
    let (built, _) = build_text(&host, "FROM base\nCOPY nothing.txt /\n", Some(&context)).await;
    let error = built.unwrap_err();
    assert!(
        matches!(
            error,
            BuildError::Step {
                error: StepError::Copy(CopyError::NotInContext { .. }),
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(host.verbs(), ["cached", "start", "destroy"]);
}

#[tokio::test]
async fn a_step_another_build_kept_first_uses_its_layer() {
    let host = FakeHost {
        raced_by: Some("/layers/theirs"),
        ..FakeHost::default()
    };
    let (built, _) = build_text(&host, "FROM base\nRUN echo hi\n", None).await;
    assert_eq!(built.unwrap().layers[0], "/layers/theirs");
}

#[tokio::test]
async fn an_env_that_does_not_read_is_a_dockerfile_error() {
    let host = FakeHost::default();
    let plan = DockerfilePlan {
        base: "base".into(),
        steps: vec![dockerfile::Step {
            text: "ENV A=\"open".into(),
            kind: StepKind::Env("A=\"open".into()),
        }],
    };
    let built = build(&host, &plan, base(), None, &[], &BuildLog::default()).await;
    assert!(matches!(
        built,
        Err(BuildError::Dockerfile(DockerfileError::Invalid { .. }))
    ));
    assert!(host.calls().is_empty());
}
