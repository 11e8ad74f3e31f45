//! Walking the accessibility tree: where a walk starts (`scope`), how far it
//! may go, and which nodes a find keeps.
//!
//! The nodes come from the sandbox's applications, so every walk is bounded
//! whatever they answer: at most [`MAX_NODES`] nodes, [`MAX_DEPTH`] levels,
//! [`MAX_CHILDREN`] children of one node, [`MAX_ANSWER_BYTES`] of answer and
//! [`WALK_DEADLINE`] of time; a node seen twice (a cycle) is skipped, and an
//! application that lets one call time out is not asked again in that walk.
//! A walk that stopped early says `truncated`. A node that vanishes while the
//! walk goes by is left out, as applications change under any reader.

use std::collections::HashSet;
use std::time::Duration;

use tokio::time::Instant;
use zbus::names::BusName;

use super::bus::{A11yBus, CallError};
use super::node::{clip, has_state, state_names, Node, NodeId, STATE_ACTIVE};
use super::A11yError;

/// Most nodes one walk asks about, whether they answer or not.
pub(crate) const MAX_NODES: usize = 10_000;
/// Deepest level a walk descends to, whatever `maxDepth` says: the answer
/// is nested JSON, written and dropped recursively.
pub(crate) const MAX_DEPTH: usize = 128;
/// Most children of one node a walk visits.
pub(crate) const MAX_CHILDREN: usize = 1_000;
/// About how large one answer may grow (names, descriptions, actions).
pub(crate) const MAX_ANSWER_BYTES: usize = 16 << 20;
/// How long one walk may take in all.
pub(crate) const WALK_DEADLINE: Duration = Duration::from_secs(30);
/// Most matches a find returns when it names no limit, and at most.
pub(crate) const DEFAULT_FIND_LIMIT: usize = 500;
pub(crate) const MAX_FIND_LIMIT: usize = 5_000;

const MAX_ROLE_BYTES: usize = 64;
const MAX_TEXT_BYTES: usize = 1_024;
const MAX_ACTIONS: usize = 16;
const MAX_ACTION_BYTES: usize = 64;
/// Most windows of one application looked at for the `active` one.
const MAX_WINDOWS: usize = 64;

/// Where a walk starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The application whose window is active (else the first one).
    Focused,
    /// The application served by this process.
    Pid(u32),
    /// The desktop, every application under it.
    All,
}

impl Scope {
    /// `scope` (`focused`, the default, `pid` or `all`) and `pid`, which
    /// `pid` needs and the others ignore, as Daytona's daemon reads them.
    pub(crate) fn parse(scope: Option<&str>, pid: Option<i64>) -> Result<Self, A11yError> {
        match scope.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
            None | Some("" | "focused") => Ok(Self::Focused),
            Some("all") => Ok(Self::All),
            Some("pid") => match pid.and_then(|pid| u32::try_from(pid).ok()) {
                Some(pid) if pid > 0 => Ok(Self::Pid(pid)),
                _ => Err(A11yError::InvalidRequest(
                    "scope pid needs a positive pid".to_owned(),
                )),
            },
            Some(_) => Err(A11yError::InvalidRequest(format!(
                "invalid accessibility scope {:?}: expected focused, pid or all",
                clip(scope.unwrap_or_default(), 64)
            ))),
        }
    }
}

/// How a find compares names.
#[derive(Debug)]
enum NameMatch {
    Exact(String),
    Substring(String),
    Regex(regex::Regex),
}

/// What a find keeps: every field given must hold (roles compare without
/// case, names with it; an empty field asks nothing).
#[derive(Debug)]
pub(crate) struct Filter {
    role: Option<String>,
    name: Option<NameMatch>,
    states: Vec<String>,
}

impl Filter {
    /// `name_match` is `exact`, `substring` (the default) or `regex`.
    pub(crate) fn new(
        role: Option<&str>,
        name: Option<&str>,
        name_match: Option<&str>,
        states: &[String],
    ) -> Result<Self, A11yError> {
        let name = name.filter(|name| !name.is_empty());
        let name = match (name_match.unwrap_or_default(), name) {
            ("" | "substring", Some(name)) => Some(NameMatch::Substring(name.to_owned())),
            ("exact", Some(name)) => Some(NameMatch::Exact(name.to_owned())),
            ("regex", Some(pattern)) => Some(NameMatch::Regex(
                regex::RegexBuilder::new(pattern)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| {
                        A11yError::InvalidRequest(format!("invalid regex for the name: {e}"))
                    })?,
            )),
            ("" | "substring" | "exact" | "regex", None) => None,
            (other, _) => {
                return Err(A11yError::InvalidRequest(format!(
                    "unknown nameMatch {:?}: expected exact, substring or regex",
                    clip(other, 64)
                )))
            }
        };
        Ok(Self {
            role: role.filter(|role| !role.is_empty()).map(str::to_lowercase),
            name,
            // Also as "multi-line" or "Multi Line": the names are the enum's.
            states: states
                .iter()
                .map(|state| state.trim().to_lowercase().replace([' ', '-'], "_"))
                .collect(),
        })
    }

    pub(crate) fn matches(&self, node: &Node) -> bool {
        if let Some(role) = &self.role {
            if node.role.to_lowercase() != *role {
                return false;
            }
        }
        let name_matches = match &self.name {
            None => true,
            Some(NameMatch::Exact(name)) => node.name == *name,
            Some(NameMatch::Substring(name)) => node.name.contains(name.as_str()),
            Some(NameMatch::Regex(pattern)) => pattern.is_match(&node.name),
        };
        name_matches
            && self
                .states
                .iter()
                .all(|wanted| node.states.iter().any(|state| state == wanted))
    }
}

/// The node a walk of `scope` starts at. The registry's list of
/// applications is asked first in every scope: a bus without it is an
/// accessibility stack that is not running (503).
pub(crate) async fn scope_root(bus: &A11yBus, scope: Scope) -> Result<NodeId, A11yError> {
    let desktop = A11yBus::desktop();
    let mut applications = bus
        .children(&desktop)
        .await
        .map_err(|e| A11yError::Unavailable(format!("the registry's applications: {e}")))?;
    applications.truncate(MAX_CHILDREN);
    match scope {
        Scope::All => Ok(desktop),
        Scope::Focused => {
            let first = applications
                .first()
                .cloned()
                .ok_or_else(|| A11yError::NoApplication("registered".to_owned()))?;
            // Asked all at once: a hung application costs one timeout, not one each.
            let active = futures_util::future::join_all(
                applications.iter().map(|app| has_active_window(bus, app)),
            )
            .await;
            Ok(applications
                .into_iter()
                .zip(active)
                .find_map(|(app, active)| active.then_some(app))
                .unwrap_or(first))
        }
        Scope::Pid(pid) => {
            let pids = futures_util::future::join_all(
                applications
                    .iter()
                    .map(|app| bus.connection_pid(app.bus_name())),
            )
            .await;
            applications
                .into_iter()
                .zip(pids)
                .find_map(|(app, found)| (found.ok() == Some(pid)).then_some(app))
                .ok_or_else(|| A11yError::NoApplication(format!("of process {pid}")))
        }
    }
}

async fn has_active_window(bus: &A11yBus, application: &NodeId) -> bool {
    let Ok(mut windows) = bus.children(application).await else {
        return false;
    };
    windows.truncate(MAX_WINDOWS);
    let states = futures_util::future::join_all(windows.iter().map(|w| bus.state(w))).await;
    states
        .into_iter()
        .any(|state| state.is_ok_and(|words| has_state(&words, STATE_ACTIVE)))
}

/// The tree under `root`, `max_depth` levels down (`None`: as far as the
/// walk may go), and whether the walk stopped early.
pub(crate) async fn tree(
    bus: &A11yBus,
    root: NodeId,
    max_depth: Option<usize>,
) -> Result<(Node, bool), A11yError> {
    let mut walk = Walk::new(bus, root, max_depth);
    // Nodes in the order visited (parents before their children), each
    // with its parent's index; joined into one tree once the walk is done.
    let mut visited: Vec<(Option<Node>, Option<usize>)> = Vec::new();
    while let Some(visit) = walk.next().await? {
        visited.push((Some(visit.node), visit.parent));
    }
    for index in (1..visited.len()).rev() {
        let (node, parent) = &mut visited[index];
        let mut node = node.take().expect("each node is moved once");
        if let Some(children) = &mut node.children {
            children.reverse();
        }
        let parent = parent.expect("only the root has no parent");
        let siblings = visited[parent].0.as_mut().expect("parents come first");
        siblings.children.get_or_insert_with(Vec::new).push(node);
    }
    let mut root = visited
        .first_mut()
        .and_then(|(node, _)| node.take())
        .expect("a walk that did not fail visits its root");
    if let Some(children) = &mut root.children {
        children.reverse();
    }
    Ok((root, walk.truncated))
}

/// The nodes under `root` (itself included) that `filter` keeps, at most
/// `limit`, without their children; `truncated` when the walk stopped
/// early or the limit was reached.
pub(crate) async fn find(
    bus: &A11yBus,
    root: NodeId,
    filter: &Filter,
    limit: usize,
) -> Result<(Vec<Node>, bool), A11yError> {
    let mut walk = Walk::new(bus, root, None);
    let mut matches = Vec::new();
    while let Some(visit) = walk.next().await? {
        if filter.matches(&visit.node) {
            let mut node = visit.node;
            node.children = None;
            matches.push(node);
            if matches.len() >= limit {
                return Ok((matches, true));
            }
        }
    }
    Ok((matches, walk.truncated))
}

/// A node visited, and the index of its parent among those visited before.
struct Visit {
    node: Node,
    parent: Option<usize>,
}

struct Pending {
    id: NodeId,
    depth: usize,
    parent: Option<usize>,
}

/// A depth-first walk, one node at a time, parents first.
struct Walk<'a> {
    bus: &'a A11yBus,
    pending: Vec<Pending>,
    seen: HashSet<NodeId>,
    /// Applications that let a call time out in this walk.
    hung: HashSet<BusName<'static>>,
    /// Nodes asked about so far, and of those, nodes given.
    asked: usize,
    visited: usize,
    answer_bytes: usize,
    max_depth: usize,
    deadline: Instant,
    truncated: bool,
}

impl<'a> Walk<'a> {
    fn new(bus: &'a A11yBus, root: NodeId, max_depth: Option<usize>) -> Self {
        Self {
            bus,
            pending: vec![Pending {
                id: root,
                depth: 0,
                parent: None,
            }],
            seen: HashSet::new(),
            hung: HashSet::new(),
            asked: 0,
            visited: 0,
            answer_bytes: 0,
            max_depth: max_depth.map_or(MAX_DEPTH, |depth| depth.min(MAX_DEPTH)),
            deadline: Instant::now() + WALK_DEADLINE,
            truncated: false,
        }
    }

    /// The next node, with its children (if it is above `max_depth`) queued
    /// to come next; `None` at the end. Only the root's failure is an error.
    async fn next(&mut self) -> Result<Option<Visit>, A11yError> {
        while let Some(Pending { id, depth, parent }) = self.pending.pop() {
            if self.asked >= MAX_NODES
                || self.answer_bytes >= MAX_ANSWER_BYTES
                || Instant::now() >= self.deadline
            {
                self.truncated = true;
                self.pending.clear();
                return Ok(None);
            }
            if self.hung.contains(id.bus_name()) {
                self.truncated = true;
                continue;
            }
            if !self.seen.insert(id.clone()) {
                continue;
            }
            self.asked += 1;
            let mut node = match describe(self.bus, &id).await {
                Ok(node) => node,
                Err(error) if parent.is_none() => {
                    return Err(A11yError::from_call(&id, "a description", error))
                }
                Err(error) => {
                    self.skip(&id, &error);
                    continue;
                }
            };
            let index = self.visited;
            self.visited += 1;
            self.answer_bytes += node.weight();
            if depth < self.max_depth {
                match self.bus.children(&id).await {
                    Ok(mut children) => {
                        if children.len() > MAX_CHILDREN {
                            children.truncate(MAX_CHILDREN);
                            self.truncated = true;
                        }
                        node.children = Some(Vec::new());
                        self.pending
                            .extend(children.into_iter().rev().map(|child| Pending {
                                id: child,
                                depth: depth + 1,
                                parent: Some(index),
                            }));
                    }
                    Err(error) => self.skip(&id, &error),
                }
            }
            return Ok(Some(Visit { node, parent }));
        }
        Ok(None)
    }

    /// A node left out: gone is the ordinary change of a live tree; a hung
    /// application is not asked again.
    fn skip(&mut self, id: &NodeId, error: &CallError) {
        match error {
            CallError::Timeout(_) => {
                tracing::warn!(node = %id, "an application did not answer; leaving it out");
                self.hung.insert(id.bus_name().clone());
                self.truncated = true;
            }
            CallError::Gone(_) | CallError::Unsupported(_) => {}
            CallError::Other(error) => {
                tracing::debug!(node = %id, %error, "leaving a node out");
            }
        }
    }
}

/// Everything about one node but its children. Its role is what makes it
/// an accessible at all; the rest is left empty where the node has none.
async fn describe(bus: &A11yBus, id: &NodeId) -> Result<Node, CallError> {
    let (role, name, description, state, interfaces) = tokio::join!(
        bus.role_name(id),
        bus.text_property(id, "Name"),
        bus.text_property(id, "Description"),
        bus.state(id),
        bus.interfaces(id),
    );
    let role = role?;
    let interfaces = optional(interfaces)?;
    let has = |interface: &str| interfaces.iter().any(|i| i == interface);
    let (bounds, actions) = tokio::join!(
        async {
            match has("org.a11y.atspi.Component") {
                true => optional(bus.extents(id).await),
                false => Ok(Default::default()),
            }
        },
        async {
            match has("org.a11y.atspi.Action") {
                true => optional(bus.action_names(id).await),
                false => Ok(Vec::new()),
            }
        },
    );
    Ok(Node {
        id: id.to_string(),
        role: clip(&role, MAX_ROLE_BYTES),
        name: clip(&optional(name)?, MAX_TEXT_BYTES),
        description: clip(&optional(description)?, MAX_TEXT_BYTES),
        states: state_names(&optional(state)?),
        actions: actions?
            .iter()
            .take(MAX_ACTIONS)
            .map(|action| clip(action, MAX_ACTION_BYTES))
            .collect(),
        bounds: bounds?,
        children: None,
    })
}

/// A field the node may lack: empty then, but a timeout still counts.
fn optional<T: Default>(answer: Result<T, CallError>) -> Result<T, CallError> {
    match answer {
        Err(CallError::Timeout(limit)) => Err(CallError::Timeout(limit)),
        other => Ok(other.unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::computeruse::a11y::node::Bounds;

    fn node(role: &str, name: &str, states: &[&'static str]) -> Node {
        Node {
            id: ":1.1:/n".to_owned(),
            role: role.to_owned(),
            name: name.to_owned(),
            description: String::new(),
            states: states.to_vec(),
            actions: Vec::new(),
            bounds: Bounds::default(),
            children: None,
        }
    }

    fn given(text: &str) -> Option<&str> {
        Some(text).filter(|text| !text.is_empty())
    }

    fn filter(role: &str, name: &str, mode: &str, states: &[&str]) -> Filter {
        let states: Vec<String> = states.iter().map(|s| s.to_string()).collect();
        Filter::new(given(role), given(name), given(mode), &states).unwrap()
    }

    #[test]
    fn names_match_exactly_by_substring_or_by_regex() {
        let ok = node("push button", "OK", &["enabled"]);
        let okay = node("push button", "Okay then", &[]);
        for (name, mode, matches_ok, matches_okay) in [
            ("OK", "exact", true, false),
            ("Ok", "exact", false, false),
            ("OK", "", true, false),
            ("Ok", "substring", false, true),
            ("then", "substring", false, true),
            ("^O[Kk]", "regex", true, true),
            ("^OK$", "regex", true, false),
            ("", "exact", true, true),
        ] {
            let filter = filter("", name, mode, &[]);
            assert_eq!(filter.matches(&ok), matches_ok, "{name} {mode} on OK");
            assert_eq!(filter.matches(&okay), matches_okay, "{name} {mode} on Okay");
        }
    }

    #[test]
    fn roles_ignore_case_and_every_state_asked_must_be_set() {
        let ok = node("push button", "OK", &["enabled", "focusable", "multi_line"]);
        assert!(filter("Push Button", "", "", &[]).matches(&ok));
        assert!(!filter("button", "", "", &[]).matches(&ok));
        assert!(filter("", "", "", &["enabled", "focusable"]).matches(&ok));
        assert!(filter("", "", "", &["Multi-Line"]).matches(&ok));
        assert!(!filter("", "", "", &["enabled", "focused"]).matches(&ok));
        assert!(filter("push button", "OK", "exact", &["enabled"]).matches(&ok));
    }

    #[test]
    fn unknown_modes_and_bad_patterns_are_the_clients_error() {
        for (mode, name) in [("fuzzy", "x"), ("fuzzy", ""), ("regex", "(")] {
            let error = Filter::new(None, Some(name), Some(mode), &[]).unwrap_err();
            assert!(
                matches!(error, A11yError::InvalidRequest(_)),
                "{mode} {name}"
            );
        }
    }

    #[test]
    fn scopes_default_to_focused_and_pid_needs_a_pid() {
        assert_eq!(Scope::parse(None, Some(3)).unwrap(), Scope::Focused);
        assert_eq!(Scope::parse(Some("ALL"), None).unwrap(), Scope::All);
        assert_eq!(Scope::parse(Some("pid"), Some(42)).unwrap(), Scope::Pid(42));
        for pid in [None, Some(0), Some(-1), Some(1 << 40)] {
            assert!(Scope::parse(Some("pid"), pid).is_err(), "{pid:?}");
        }
        let error = Scope::parse(Some("window"), None).unwrap_err();
        assert!(error.to_string().contains("focused, pid or all"), "{error}");
    }
}
