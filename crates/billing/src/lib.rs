//! The meter and the bill of cove, as pure functions.
//!
//! The store writes an [`Interval`] for every stretch of time a sandbox (or a
//! snapshot) spent unchanged: its state and size from one change to the
//! next, written in the same transaction as the change. This crate decides
//! what those stretches cost: which states use vCPUs and memory, which hold
//! disk, how snapshot storage is counted against its free allowance across
//! calendar months, and how monthly credits are shared out over a period.
//! It reads no clock: "now" is an argument, so every rule is tested with
//! made-up times.

use std::collections::BTreeMap;

use cove_lifecycle::SandboxState;
use serde::Serialize;
use time::format_description::well_known::Rfc3339;
use time::{Date, Month, OffsetDateTime};

pub const HOUR_MS: i64 = 3_600_000;
/// The longest period one bill covers: ten years of 366 days, so that no
/// request can make the server walk centuries of months.
pub const MAX_PERIOD_MS: i64 = 10 * 366 * 24 * HOUR_MS;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// What was metered over an interval.
#[derive(Clone, Debug, PartialEq)]
pub enum Metered {
    Sandbox {
        state: SandboxState,
        cpu: i64,
        memory_mib: i64,
        disk_gib: i64,
    },
    /// A snapshot's stored bytes.
    Snapshot { size_bytes: i64 },
}

/// One resource, unchanged from `started_ms` to `ended_ms` (still so when
/// `ended_ms` is `None`).
#[derive(Clone, Debug, PartialEq)]
pub struct Interval {
    pub resource_id: String,
    pub name: String,
    pub metered: Metered,
    pub started_ms: i64,
    pub ended_ms: Option<i64>,
}

/// Whether a sandbox in `state` pays for its vCPUs and memory: while its
/// processes may run. Stopped, paused (the memory is on disk), archived and
/// failed sandboxes do not.
pub fn bills_compute(state: SandboxState) -> bool {
    state.is_running()
}

/// Whether a sandbox in `state` pays for its disk: while the disk is on this
/// server, which is every state but archived (the archive holds it) and
/// destroyed.
pub fn bills_disk(state: SandboxState) -> bool {
    !matches!(state, SandboxState::Archived | SandboxState::Destroyed)
}

/// The price table of a server.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Prices {
    #[serde(skip)]
    pub currency: String,
    pub vcpu_hour: f64,
    pub memory_gb_hour: f64,
    pub disk_gb_hour: f64,
    pub snapshot_gb_month: f64,
    /// Snapshot storage that costs nothing, GB at any moment.
    pub snapshot_free_gb: f64,
    /// Credits given every calendar month, shared out over a period by the
    /// part of each month it covers.
    pub monthly_credits: f64,
}

impl Default for Prices {
    /// Seed 003's figures where it gives them (memory, snapshots and their
    /// free 10 GB, the monthly credits); cove's own for vCPUs and disk.
    fn default() -> Self {
        Prices {
            currency: "USD".to_owned(),
            vcpu_hour: 0.0504,
            memory_gb_hour: 0.0077,
            disk_gb_hour: 0.000108,
            snapshot_gb_month: 0.05,
            snapshot_free_gb: 10.0,
            monthly_credits: 3.0,
        }
    }
}

/// One line of a bill: a sandbox, a snapshot, or the snapshot allowance
/// (negative GB-months).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Line {
    pub sandbox_id: Option<String>,
    pub snapshot_id: Option<String>,
    pub name: String,
    pub vcpu_hours: f64,
    pub memory_gb_hours: f64,
    pub disk_gb_hours: f64,
    pub snapshot_gb_months: f64,
    pub amount: f64,
}

impl Line {
    fn priced(mut self, prices: &Prices) -> Line {
        self.amount = self.vcpu_hours * prices.vcpu_hour
            + self.memory_gb_hours * prices.memory_gb_hour
            + self.disk_gb_hours * prices.disk_gb_hour
            + self.snapshot_gb_months * prices.snapshot_gb_month;
        self
    }
}

/// What a period costs: its lines at `prices`, less `credits`, never below
/// zero.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Bill {
    pub from: String,
    pub to: String,
    pub currency: String,
    pub prices: Prices,
    pub lines: Vec<Line>,
    pub credits: f64,
    pub total: f64,
}

/// Why a period cannot be billed.
#[derive(Debug, PartialEq, Eq)]
pub struct BadPeriod(pub String);

/// The bill of `[from_ms, to_ms)` from `intervals`, with intervals still
/// open ending at `now_ms`.
pub fn bill(
    intervals: &[Interval],
    from_ms: i64,
    to_ms: i64,
    now_ms: i64,
    prices: &Prices,
) -> Result<Bill, BadPeriod> {
    if to_ms <= from_ms {
        return Err(BadPeriod("the period must end after it starts".into()));
    }
    if from_ms < 0 || to_ms - from_ms > MAX_PERIOD_MS {
        return Err(BadPeriod(
            "a bill covers at most ten years, from 1970 on; ask for a shorter period".into(),
        ));
    }
    let spans = clipped(intervals, from_ms, to_ms, now_ms);
    let mut lines: Vec<Line> = Vec::new();
    let mut index: BTreeMap<(bool, &str), usize> = BTreeMap::new();
    for span in &spans {
        let snapshot = matches!(span.metered, Metered::Snapshot { .. });
        let at = *index
            .entry((snapshot, span.resource_id))
            .or_insert_with(|| {
                let id = Some(span.resource_id.to_owned());
                lines.push(Line {
                    sandbox_id: if snapshot { None } else { id.clone() },
                    snapshot_id: if snapshot { id } else { None },
                    ..Line::default()
                });
                lines.len() - 1
            });
        let line = &mut lines[at];
        line.name = span.name.to_owned();
        let hours = (span.end - span.start) as f64 / HOUR_MS as f64;
        match *span.metered {
            Metered::Sandbox {
                state,
                cpu,
                memory_mib,
                disk_gib,
            } => {
                if bills_compute(state) {
                    line.vcpu_hours += cpu as f64 * hours;
                    line.memory_gb_hours += memory_mib as f64 / 1024.0 * hours;
                }
                if bills_disk(state) {
                    line.disk_gb_hours += disk_gib as f64 * hours;
                }
            }
            Metered::Snapshot { size_bytes } => {
                line.snapshot_gb_months += size_bytes as f64 / GIB * months(span.start, span.end);
            }
        }
    }
    let free = free_snapshot_gb_months(&spans, from_ms, to_ms, prices.snapshot_free_gb);
    if free > 0.0 {
        lines.push(Line {
            name: format!("snapshot allowance (first {} GB)", prices.snapshot_free_gb),
            snapshot_gb_months: -free,
            ..Line::default()
        });
    }
    let lines: Vec<Line> = lines.into_iter().map(|l| l.priced(prices)).collect();
    let credits = prices.monthly_credits * months(from_ms, to_ms);
    let sum: f64 = lines.iter().map(|l| l.amount).sum();
    Ok(Bill {
        from: rfc3339(from_ms),
        to: rfc3339(to_ms),
        currency: prices.currency.clone(),
        prices: prices.clone(),
        lines,
        credits,
        total: (sum - credits).max(0.0),
    })
}

/// An interval cut to the period, with a definite end.
struct Span<'a> {
    resource_id: &'a str,
    name: &'a str,
    metered: &'a Metered,
    start: i64,
    end: i64,
}

/// The intervals' parts inside `[from, to)`, open ones ending at `now`. The
/// intervals of one resource never overlap in a sound store; should two ever
/// do, the later one starts where the earlier ended, so no time is counted
/// twice.
fn clipped(intervals: &[Interval], from: i64, to: i64, now: i64) -> Vec<Span<'_>> {
    let mut sorted: Vec<&Interval> = intervals.iter().collect();
    sorted.sort_by_key(|i| (i.started_ms, i.ended_ms.unwrap_or(i64::MAX)));
    let mut covered: BTreeMap<(bool, &str), i64> = BTreeMap::new();
    let mut spans = Vec::new();
    for interval in sorted {
        let key = (
            matches!(interval.metered, Metered::Snapshot { .. }),
            interval.resource_id.as_str(),
        );
        let end = interval.ended_ms.unwrap_or(now).min(to);
        let already = covered.get(&key).copied().unwrap_or(i64::MIN);
        let start = interval.started_ms.max(from).max(already);
        if end > start {
            covered.insert(key, end);
            spans.push(Span {
                resource_id: &interval.resource_id,
                name: &interval.name,
                metered: &interval.metered,
                start,
                end,
            });
        }
    }
    spans
}

/// The snapshot storage the allowance covers: at every moment the smaller
/// of the stored total and the free GB, counted in GB-months of the
/// calendar month the moment is in.
fn free_snapshot_gb_months(spans: &[Span<'_>], from: i64, to: i64, free_gb: f64) -> f64 {
    let sizes: Vec<(i64, i64, f64)> = spans
        .iter()
        .filter_map(|s| match s.metered {
            Metered::Snapshot { size_bytes } => Some((s.start, s.end, *size_bytes as f64 / GIB)),
            Metered::Sandbox { .. } => None,
        })
        .collect();
    if sizes.is_empty() || free_gb <= 0.0 {
        return 0.0;
    }
    let mut cuts: Vec<i64> = sizes.iter().flat_map(|&(a, b, _)| [a, b]).collect();
    let mut month = month_start(from);
    while month < to {
        cuts.push(month.max(from));
        month = next_month(month);
    }
    cuts.push(to);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| {
            let stored: f64 = sizes
                .iter()
                .filter(|&&(a, b, _)| a <= w[0] && b >= w[1])
                .map(|&(_, _, gb)| gb)
                .sum();
            stored.min(free_gb) * months(w[0], w[1])
        })
        .sum()
}

/// How many calendar months `[from, to)` covers: each month's part is its
/// share of that month's length.
pub fn months(from: i64, to: i64) -> f64 {
    let mut total = 0.0;
    let mut start = month_start(from);
    while start < to {
        let end = next_month(start);
        let overlap = end.min(to) - start.max(from);
        if overlap > 0 {
            total += overlap as f64 / (end - start) as f64;
        }
        start = end;
    }
    total
}

fn datetime(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

fn ms_of(date: Date) -> i64 {
    (date.midnight().assume_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

/// The first millisecond of the calendar month (UTC) holding `ms`.
pub fn month_start(ms: i64) -> i64 {
    let date = datetime(ms).date();
    ms_of(Date::from_calendar_date(date.year(), date.month(), 1).expect("day 1 exists"))
}

/// The calendar month (UTC) holding `ms`, as `[start, end)`.
pub fn month_containing(ms: i64) -> (i64, i64) {
    let start = month_start(ms);
    (start, next_month(start))
}

/// The first millisecond of the month after the one starting at `start`;
/// past the last date the calendar holds (9999), the end of time.
fn next_month(start: i64) -> i64 {
    let date = datetime(start).date();
    let (year, month) = match date.month() {
        Month::December => (date.year() + 1, Month::January),
        other => (date.year(), other.next()),
    };
    Date::from_calendar_date(year, month, 1).map_or(i64::MAX, ms_of)
}

/// The calendar month `YYYY-MM` as `[start, end)` in milliseconds.
pub fn month_period(month: &str) -> Result<(i64, i64), BadPeriod> {
    let bad = || BadPeriod(format!("{month:?} is not a month: write it as YYYY-MM"));
    let (year, number) = month.split_once('-').ok_or_else(bad)?;
    let year: i32 = year.parse().map_err(|_| bad())?;
    let number: u8 = number.parse().map_err(|_| bad())?;
    let month = Month::try_from(number).map_err(|_| bad())?;
    let start = ms_of(Date::from_calendar_date(year, month, 1).map_err(|_| bad())?);
    Ok((start, next_month(start)))
}

fn rfc3339(ms: i64) -> String {
    datetime(ms)
        .format(&Rfc3339)
        .unwrap_or_else(|_| ms.to_string())
}

#[cfg(test)]
mod tests;
