//! Charts as the SDK parses them (`Chart`, `ChartElement` in Daytona's toolbox
//! API), read from the side channel the Python prelude writes: one JSON chart
//! per line. The file is written by the user's program, so it is untrusted:
//! it is read only if it is a regular file, at most [`MAX_CHARTS_BYTES`] of it,
//! and every line that is not a well-formed chart is dropped. Re-serialising
//! through these types is what keeps the SDK's strict validation (numbers that
//! are numbers, strings that are strings) from failing on what a program wrote.

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Most bytes of the side channel read: room for dozens of figures' PNGs.
pub(super) const MAX_CHARTS_BYTES: u64 = 16 << 20;
/// Most charts answered for one run.
pub(super) const MAX_CHARTS: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chart {
    #[serde(rename = "type", default = "unknown")]
    pub kind: String,
    #[serde(flatten)]
    pub axes: Axes,
    #[serde(default)]
    pub elements: Vec<ChartElement>,
}

/// What a chart, and a composite's sub-chart, says of itself: its title, its
/// picture and its axes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Axes {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub png: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub y_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_ticks: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub y_ticks: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_tick_labels: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub y_tick_labels: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_scale: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub y_scale: Option<String>,
}

/// One element: a line's or scatter's points, a bar, a pie wedge, a box, or
/// (in a `composite_chart`) a whole sub-chart, whose own `elements` the SDK
/// keeps among its extra fields.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChartElement {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(flatten)]
    pub data: LeafElement,
    /// A sub-chart's own title and axes.
    #[serde(flatten)]
    pub axes: Axes,
    /// A sub-chart's elements; one level only (a composite of composites
    /// does not exist in matplotlib).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elements: Option<Vec<LeafElement>>,
}

/// An element of a sub-chart: anything of [`ChartElement`] but sub-charts.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LeafElement {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// A bar's height, as text (the SDK's type).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub points: Option<Vec<[f64; 2]>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub angle: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub radius: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_quartile: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub median: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub third_quartile: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outliers: Option<Vec<f64>>,
}

fn unknown() -> String {
    "unknown".to_owned()
}

/// The charts in the side channel at `path`; none if it does not exist or is
/// not a regular file (a program could put a FIFO or a link there).
pub(super) fn read(path: &Path) -> Vec<Chart> {
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return Vec::new();
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    if file.take(MAX_CHARTS_BYTES).read_to_end(&mut bytes).is_err() {
        return Vec::new();
    }
    parse(&bytes)
}

/// Every complete line of `bytes` that is a chart, at most [`MAX_CHARTS`];
/// a last line without its newline was cut off by the bound and is dropped.
pub fn parse(bytes: &[u8]) -> Vec<Chart> {
    let complete = match bytes.iter().rposition(|&b| b == b'\n') {
        Some(end) => &bytes[..end],
        None => return Vec::new(),
    };
    complete
        .split(|&b| b == b'\n')
        .filter_map(|line| serde_json::from_slice::<Chart>(line).ok())
        .take(MAX_CHARTS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_lines_become_charts_and_the_rest_is_dropped() {
        let input = concat!(
            r#"{"type":"line","title":"t","x_ticks":[0,1.5],"elements":[{"label":"a","points":[[0,1],[2,3]]}]}"#,
            "\n",
            "not json\n",
            r#"{"type":"bar","elements":[{"label":"x","value":3}]}"#,
            "\n",
            r#"{"type":"bar","elements":[{"label":"x","group":"g","value":"3"}],"extra":1}"#,
            "\n",
            r#"{"type":"pie","elements":[{"label":"cut off"#,
        );
        let charts = parse(input.as_bytes());
        assert_eq!(charts.len(), 2, "{charts:?}");
        assert_eq!(charts[0].kind, "line");
        assert_eq!(charts[0].axes.x_ticks, Some(vec![0.0, 1.5]));
        assert_eq!(
            charts[0].elements[0].data.points,
            Some(vec![[0.0, 1.0], [2.0, 3.0]])
        );
        // A number where the SDK wants text is not passed on.
        assert_eq!(charts[1].elements[0].data.value.as_deref(), Some("3"));
        let json = serde_json::to_value(&charts[1]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": "bar", "elements": [{"label": "x", "group": "g", "value": "3"}]})
        );
    }

    #[test]
    fn composites_keep_their_sub_charts_elements() {
        let input = concat!(
            r#"{"type":"composite_chart","title":"both","elements":["#,
            r#"{"type":"line","title":"l","elements":[{"label":"s","points":[[1,2]]}]},"#,
            r#"{"type":"bar","elements":[{"label":"b","value":"2"}]}]}"#,
            "\n"
        );
        let charts = parse(input.as_bytes());
        assert_eq!(charts.len(), 1);
        let sub = &charts[0].elements;
        assert_eq!(sub[0].kind.as_deref(), Some("line"));
        assert_eq!(sub[0].axes.title.as_deref(), Some("l"));
        assert_eq!(charts[0].axes.title.as_deref(), Some("both"));
        assert_eq!(
            sub[0].elements.as_ref().unwrap()[0].points,
            Some(vec![[1.0, 2.0]])
        );
        assert_eq!(
            sub[1].elements.as_ref().unwrap()[0].value.as_deref(),
            Some("2")
        );
    }

    #[test]
    fn the_count_and_the_bytes_read_are_bounded() {
        let many = "{\"type\":\"line\"}\n".repeat(MAX_CHARTS + 10);
        assert_eq!(parse(many.as_bytes()).len(), MAX_CHARTS);
        assert!(parse(b"").is_empty());
        assert!(
            parse(b"{\"type\":\"line\"}").is_empty(),
            "no newline: cut off"
        );

        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("charts.jsonl");
        // One line longer than the bound: cut off, so nothing.
        let line = format!(
            "{{\"type\":\"line\",\"title\":\"{}\"}}\n",
            "x".repeat(MAX_CHARTS_BYTES as usize)
        );
        std::fs::write(&big, line).unwrap();
        assert!(read(&big).is_empty());
        assert!(read(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn only_a_regular_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, "{\"type\":\"line\"}\n").unwrap();
        assert_eq!(read(&real).len(), 1);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(read(&link).is_empty(), "a link is not followed");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Would block forever if opened for a blocking read.
        assert!(read(&fifo).is_empty());
    }
}
