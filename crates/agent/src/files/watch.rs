//! `GET /files/watch?path=&recursive=true` (a cove extension): upgraded to a
//! WebSocket that streams changes under `path`, read from inotify.
//!
//! Each change is one text message holding one JSON object:
//!
//! ```json
//! {"type": "create", "path": "/root/a.txt", "isDir": false}
//! {"type": "modify", "path": "/root/a.txt", "isDir": false}
//! {"type": "delete", "path": "/root/a.txt", "isDir": false}
//! {"type": "rename", "path": "/root/b.txt", "oldPath": "/root/a.txt", "isDir": false}
//! {"type": "overflow", "path": "/root", "isDir": true}
//! ```
//!
//! - `create`: a file or directory appeared (also one moved in from outside the
//!   watched tree). With `recursive=true` a new directory is watched at once and
//!   what it already holds is reported as `create` too, so nothing written
//!   between its creation and its watch is missed (an entry may be reported twice).
//! - `modify`: contents or metadata (mode, owner, times) changed.
//! - `delete`: removed (also moved out of the watched tree).
//! - `rename`: moved within the watched tree; inotify pairs the two halves by
//!   cookie. A half whose pair does not arrive within [`PAIR_WAIT`] is reported
//!   as `delete` (moved out) or `create` (moved in).
//! - `overflow`: the kernel queue overflowed and events were lost; rescan.
//!
//! Paths are absolute. Watching a single file reports its own changes with its
//! own path. When the watched path itself is deleted or moved away, the server
//! sends that event and closes with 1000; when the client closes, watching stops
//! and the inotify descriptor is released. Without `recursive` only the
//! directory's direct entries are watched. Subdirectories on kernel
//! pseudo-filesystems are not entered (see [`walk`](super::walk)).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse as _, Response};
use futures_util::StreamExt as _;
use inotify::{EventMask, EventOwned, Inotify, WatchDescriptor, WatchMask, Watches};
use serde::{Deserialize, Serialize};

use super::walk::{walk, Cancel};
use crate::error::{ApiError, Query};
use crate::AppState;

/// How long the first half of a rename waits for its second half.
pub(crate) const PAIR_WAIT: Duration = Duration::from_millis(50);

#[derive(Debug, Deserialize)]
pub struct WatchQuery {
    path: String,
    #[serde(default)]
    recursive: bool,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Change {
    #[serde(rename = "type")]
    kind: ChangeKind,
    path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    old_path: Option<String>,
    is_dir: bool,
}

#[derive(Debug, Serialize, PartialEq, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ChangeKind {
    Create,
    Modify,
    Delete,
    Rename,
    Overflow,
}

pub(crate) async fn watch(
    State(state): State<AppState>,
    Query(query): Query<WatchQuery>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    if query.path.is_empty() {
        return Err(ApiError::BadRequest("path is required".into()));
    }
    let root = state.settings.resolve(&query.path);
    let recursive = query.recursive;
    // Watches are placed before the upgrade, so a missing path is a plain 404
    // and every change after the 101 answer is reported.
    let watcher = tokio::task::spawn_blocking(move || Watcher::new(root, recursive))
        .await
        .map_err(|e| ApiError::internal("starting a watch", std::io::Error::other(e)))??;
    let upgrade = upgrade
        .map_err(|_| ApiError::BadRequest("/files/watch needs a WebSocket upgrade".into()))?;
    Ok(upgrade
        .on_upgrade(move |socket| watcher.run(socket))
        .into_response())
}

const MASK: WatchMask = WatchMask::CREATE
    .union(WatchMask::MODIFY)
    .union(WatchMask::ATTRIB)
    .union(WatchMask::DELETE)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::DONT_FOLLOW);

struct Watcher {
    /// Taken by [`Watcher::run`] to become the event stream.
    inotify: Option<Inotify>,
    watches: Watches,
    root: PathBuf,
    root_wd: WatchDescriptor,
    root_is_dir: bool,
    recursive: bool,
    /// The directory (or file) each watch stands for; renames rewrite it.
    paths: HashMap<WatchDescriptor, PathBuf>,
    /// The first half of a rename: (cookie, old path, is a directory).
    pending_move: Option<(u32, PathBuf, bool)>,
}

impl Watcher {
    fn new(root: PathBuf, recursive: bool) -> Result<Self, ApiError> {
        let metadata = std::fs::metadata(&root).map_err(|e| ApiError::io(&root, e))?;
        let inotify = Inotify::init().map_err(|e| ApiError::internal("inotify_init", e))?;
        let mut watches = inotify.watches();
        // The root itself may be a symlink the client named on purpose.
        let root_wd = watches
            .add(&root, MASK.difference(WatchMask::DONT_FOLLOW))
            .map_err(|e| ApiError::io(&root, e))?;
        let mut watcher = Self {
            inotify: Some(inotify),
            watches,
            root: root.clone(),
            root_wd: root_wd.clone(),
            root_is_dir: metadata.is_dir(),
            recursive,
            paths: HashMap::from([(root_wd, root.clone())]),
            pending_move: None,
        };
        if recursive && metadata.is_dir() {
            watcher.watch_tree(&root, None);
        }
        Ok(watcher)
    }

    /// Watches every directory below `dir` (and `dir`); with `found`, also
    /// collects what is already there as `create` changes.
    fn watch_tree(&mut self, dir: &Path, mut found: Option<&mut Vec<Change>>) {
        let (watches, paths) = (&mut self.watches, &mut self.paths);
        let _ = walk(dir, &Cancel::default(), |entry| {
            if entry.depth > 0 {
                if let Some(found) = found.as_deref_mut() {
                    let is_dir = entry.metadata.is_dir();
                    found.push(change(ChangeKind::Create, entry.path, is_dir));
                }
            }
            if entry.metadata.is_dir() {
                if let Ok(wd) = watches.add(entry.path, MASK) {
                    paths.insert(wd, entry.path.to_path_buf());
                }
            }
            true
        });
    }

    async fn run(mut self, mut socket: WebSocket) {
        let stream = self
            .inotify
            .take()
            .map(|inotify| inotify.into_event_stream(vec![0u8; 64 << 10]));
        let Some(Ok(mut events)) = stream else {
            let _ = socket.send(close(1011, "inotify stream failed")).await;
            return;
        };
        loop {
            let holding = self.pending_move.is_some();
            let changes = tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => self.on_event(event),
                    _ => break,
                },
                () = tokio::time::sleep(PAIR_WAIT), if holding => {
                    self.flush_pending_move().into_iter().collect()
                }
                incoming = socket.recv() => match incoming {
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                    Some(Ok(_)) => continue,
                },
            };
            let mut root_gone = false;
            for change in changes {
                root_gone |=
                    change.kind == ChangeKind::Delete && Path::new(&change.path) == self.root;
                let text = serde_json::to_string(&change).unwrap_or_default();
                if socket.send(Message::Text(text.into())).await.is_err() {
                    return;
                }
            }
            if root_gone {
                let _ = socket.send(close(1000, "watched path is gone")).await;
                return;
            }
        }
        let _ = socket.send(close(1011, "inotify stream ended")).await;
    }

    /// Turns one inotify event into the changes to report, keeping the watch
    /// table in step with renames and new directories.
    fn on_event(&mut self, event: EventOwned) -> Vec<Change> {
        let mut out = Vec::new();
        if event.mask.contains(EventMask::Q_OVERFLOW) {
            out.extend(self.flush_pending_move());
            out.push(change(ChangeKind::Overflow, &self.root, self.root_is_dir));
            return out;
        }
        if event.mask.contains(EventMask::IGNORED) {
            self.paths.remove(&event.wd);
            return out;
        }
        let Some(base) = self.paths.get(&event.wd).cloned() else {
            return out;
        };
        let is_dir = event.mask.contains(EventMask::ISDIR);
        let path = match &event.name {
            Some(name) => base.join(name),
            None => base,
        };
        // A second half arriving for the held first half makes a rename; any
        // other event means the held half gets no pair.
        if event.mask.contains(EventMask::MOVED_TO) {
            if let Some((cookie, old, was_dir)) = self.pending_move.take() {
                if cookie == event.cookie {
                    self.rebase(&old, &path);
                    out.push(Change {
                        kind: ChangeKind::Rename,
                        path: path.to_string_lossy().into_owned(),
                        old_path: Some(old.to_string_lossy().into_owned()),
                        is_dir: was_dir,
                    });
                    return out;
                }
                self.pending_move = Some((cookie, old, was_dir));
            }
        }
        out.extend(self.flush_pending_move());
        // Events a directory reports about itself also reach its parent's
        // watch, which names it; only the root's own are news.
        let on_itself = event.name.is_none();
        if on_itself && event.wd != self.root_wd {
            return out;
        }
        if event.mask.contains(EventMask::MOVED_FROM) {
            self.pending_move = Some((event.cookie, path, is_dir));
        } else if event
            .mask
            .intersects(EventMask::CREATE | EventMask::MOVED_TO)
        {
            out.push(change(ChangeKind::Create, &path, is_dir));
            if is_dir && self.recursive {
                self.watch_tree(&path, Some(&mut out));
            }
        } else if event.mask.intersects(EventMask::MODIFY | EventMask::ATTRIB) {
            let is_dir = if on_itself { self.root_is_dir } else { is_dir };
            out.push(change(ChangeKind::Modify, &path, is_dir));
        } else if event.mask.contains(EventMask::DELETE) {
            out.push(change(ChangeKind::Delete, &path, is_dir));
        } else if event
            .mask
            .intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF)
        {
            out.push(change(ChangeKind::Delete, &self.root, self.root_is_dir));
        }
        out
    }

    /// Reports a held first half as a move out of the tree, dropping the
    /// watches below it (inotify would go on watching it wherever it went).
    fn flush_pending_move(&mut self) -> Option<Change> {
        let (_, old, is_dir) = self.pending_move.take()?;
        if is_dir {
            let watches = &mut self.watches;
            self.paths.retain(|wd, path| {
                let below = path.starts_with(&old);
                if below {
                    let _ = watches.remove(wd.clone());
                }
                !below
            });
        }
        Some(change(ChangeKind::Delete, &old, is_dir))
    }

    /// Rewrites the watched paths under `old` to sit under `new`.
    fn rebase(&mut self, old: &Path, new: &Path) {
        for path in self.paths.values_mut() {
            if let Ok(rest) = path.strip_prefix(old) {
                *path = if rest.as_os_str().is_empty() {
                    new.to_path_buf()
                } else {
                    new.join(rest)
                };
            }
        }
    }
}

fn change(kind: ChangeKind, path: &Path, is_dir: bool) -> Change {
    Change {
        kind,
        path: path.to_string_lossy().into_owned(),
        old_path: None,
        is_dir,
    }
}

fn close(code: u16, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}
