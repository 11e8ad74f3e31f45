use cove_lifecycle::SandboxState;

use super::*;

const MINUTE: i64 = 60_000;

fn december() -> (i64, i64) {
    month_period("2026-12").unwrap()
}

fn sandbox(
    id: &str,
    state: SandboxState,
    cpu: i64,
    memory_mib: i64,
    from: i64,
    to: Option<i64>,
) -> Interval {
    Interval {
        resource_id: id.to_owned(),
        name: format!("{id}-name"),
        metered: Metered::Sandbox {
            state,
            cpu,
            memory_mib,
            disk_gib: 10,
        },
        started_ms: from,
        ended_ms: to,
    }
}

fn snapshot(id: &str, gib: i64, from: i64, to: Option<i64>) -> Interval {
    Interval {
        resource_id: id.to_owned(),
        name: id.to_owned(),
        metered: Metered::Snapshot {
            size_bytes: gib << 30,
        },
        started_ms: from,
        ended_ms: to,
    }
}

fn prices() -> Prices {
    Prices {
        currency: "USD".into(),
        vcpu_hour: 0.05,
        memory_gb_hour: 0.01,
        disk_gb_hour: 0.001,
        snapshot_gb_month: 0.05,
        snapshot_free_gb: 10.0,
        monthly_credits: 0.0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn running_time_pays_for_cpu_and_memory_and_every_stored_moment_for_disk() {
    let (start, end) = december();
    let t = start + 10 * HOUR_MS;
    let intervals = [
        sandbox("a", SandboxState::Starting, 2, 4096, t, Some(t + MINUTE)),
        sandbox(
            "a",
            SandboxState::Started,
            2,
            4096,
            t + MINUTE,
            Some(t + MINUTE + 2 * HOUR_MS),
        ),
        sandbox(
            "a",
            SandboxState::Stopped,
            2,
            4096,
            t + MINUTE + 2 * HOUR_MS,
            None,
        ),
    ];
    let now = t + MINUTE + 3 * HOUR_MS;
    let bill = bill(&intervals, start, end, now, &prices()).unwrap();
    assert_eq!(bill.lines.len(), 1);
    let line = &bill.lines[0];
    assert_eq!(line.sandbox_id.as_deref(), Some("a"));
    assert_eq!(line.name, "a-name");
    assert!(close(line.vcpu_hours, 4.0), "{line:?}");
    assert!(close(line.memory_gb_hours, 8.0), "{line:?}");
    // Disk from the first minute to now: 3 h 1 min of 10 GiB.
    assert!(
        close(line.disk_gb_hours, 10.0 * (3.0 + 1.0 / 60.0)),
        "{line:?}"
    );
    assert!(close(
        line.amount,
        4.0 * 0.05 + 8.0 * 0.01 + line.disk_gb_hours * 0.001
    ));
    assert!(close(bill.total, line.amount));
    assert_eq!(bill.from, "2026-12-01T00:00:00Z");
    assert_eq!(bill.to, "2027-01-01T00:00:00Z");
}

#[test]
fn paused_archived_and_failed_sandboxes_use_no_cpu_and_archived_ones_no_disk() {
    for state in [
        SandboxState::Paused,
        SandboxState::Stopped,
        SandboxState::Error,
    ] {
        assert!(!bills_compute(state), "{state}");
        assert!(bills_disk(state), "{state}");
    }
    assert!(!bills_compute(SandboxState::Archived));
    assert!(!bills_disk(SandboxState::Archived));
    for state in [
        SandboxState::Started,
        SandboxState::Snapshotting,
        SandboxState::Forking,
    ] {
        assert!(bills_compute(state), "{state}");
    }
}

#[test]
fn a_resize_splits_the_time_at_the_change() {
    let (start, end) = december();
    let intervals = [
        sandbox(
            "a",
            SandboxState::Started,
            1,
            1024,
            start,
            Some(start + HOUR_MS),
        ),
        sandbox(
            "a",
            SandboxState::Started,
            4,
            2048,
            start + HOUR_MS,
            Some(start + 3 * HOUR_MS),
        ),
    ];
    let bill = bill(&intervals, start, end, end, &prices()).unwrap();
    assert!(close(bill.lines[0].vcpu_hours, 1.0 + 8.0));
    assert!(close(bill.lines[0].memory_gb_hours, 1.0 + 4.0));
}

#[test]
fn an_open_interval_ends_now_and_the_period_cuts_the_rest() {
    let (start, end) = december();
    // Started in November, still running: only December's part, up to now.
    let intervals = [sandbox(
        "a",
        SandboxState::Started,
        1,
        1024,
        start - 5 * HOUR_MS,
        None,
    )];
    let now = start + 2 * HOUR_MS;
    let bill = bill(&intervals, start, end, now, &prices()).unwrap();
    assert!(close(bill.lines[0].vcpu_hours, 2.0));
    // A period that ended before now is not stretched to it.
    let earlier = super::bill(&intervals, start, start + HOUR_MS, now, &prices()).unwrap();
    assert!(close(earlier.lines[0].vcpu_hours, 1.0));
    // A sandbox with no time in the period has no line.
    let later = super::bill(&intervals, now + HOUR_MS, end, now, &prices()).unwrap();
    assert!(later.lines.is_empty());
}

#[test]
fn a_restart_that_closes_and_reopens_intervals_counts_each_moment_once() {
    let (start, end) = december();
    let recovery = start + 2 * HOUR_MS;
    // Before the crash: one interval, closed by the recovery at its time,
    // and the same state opened again from it.
    let split = [
        sandbox("a", SandboxState::Started, 2, 1024, start, Some(recovery)),
        sandbox(
            "a",
            SandboxState::Started,
            2,
            1024,
            recovery,
            Some(recovery + HOUR_MS),
        ),
    ];
    let whole = [sandbox(
        "a",
        SandboxState::Started,
        2,
        1024,
        start,
        Some(recovery + HOUR_MS),
    )];
    let a = bill(&split, start, end, end, &prices()).unwrap();
    let b = bill(&whole, start, end, end, &prices()).unwrap();
    assert_eq!(a.lines, b.lines);
    // Were an interval left open at a crash next to the one the recovery
    // opened, the overlap is still counted once.
    let overlapping = [
        sandbox("a", SandboxState::Started, 2, 1024, start, None),
        sandbox(
            "a",
            SandboxState::Started,
            2,
            1024,
            recovery,
            Some(recovery + HOUR_MS),
        ),
    ];
    let c = bill(&overlapping, start, end, recovery + HOUR_MS, &prices()).unwrap();
    assert_eq!(c.lines, b.lines);
}

#[test]
fn snapshot_storage_is_counted_in_months_of_the_calendar_and_the_first_gigabytes_are_free() {
    let (december, _) = december();
    let (november, _) = month_period("2026-11").unwrap();
    let (_, january_end) = month_period("2027-01").unwrap();
    // 30 GiB from 16 November to 15 January: half of November (30 days),
    // all of December, 14 of January's 31 days.
    let from = november + 15 * 24 * HOUR_MS;
    let to = december + (31 + 14) * 24 * HOUR_MS;
    let intervals = [snapshot("s", 30, from, Some(to))];
    let bill = bill(&intervals, november, january_end, january_end, &prices()).unwrap();
    let months = 0.5 + 1.0 + 14.0 / 31.0;
    assert!(
        close(bill.lines[0].snapshot_gb_months, 30.0 * months),
        "{:?}",
        bill.lines
    );
    assert_eq!(bill.lines[0].snapshot_id.as_deref(), Some("s"));
    assert_eq!(bill.lines[0].sandbox_id, None);
    let allowance = &bill.lines[1];
    assert!(
        close(allowance.snapshot_gb_months, -10.0 * months),
        "{allowance:?}"
    );
    assert!(close(bill.total, 20.0 * months * 0.05));
}

#[test]
fn the_allowance_covers_the_total_stored_at_each_moment_not_each_snapshot() {
    let (start, end) = december();
    let half = start + (end - start) / 2;
    // 4 GiB all month, 8 GiB more in its second half: over 10 GiB only then.
    let intervals = [snapshot("a", 4, start, None), snapshot("b", 8, half, None)];
    let bill = bill(&intervals, start, end, end, &prices()).unwrap();
    let stored: f64 = bill.lines.iter().map(|l| l.snapshot_gb_months).sum();
    assert!(close(stored, 2.0 * 0.5), "{:?}", bill.lines);
    // Under the allowance, storage costs nothing.
    let small = super::bill(&intervals[..1], start, end, end, &prices()).unwrap();
    assert!(close(small.total, 0.0));
}

#[test]
fn credits_are_shared_out_by_month_and_the_total_never_goes_below_zero() {
    let (start, end) = december();
    let prices = Prices {
        monthly_credits: 3.0,
        ..prices()
    };
    let intervals = [sandbox(
        "a",
        SandboxState::Started,
        1,
        1024,
        start,
        Some(start + HOUR_MS),
    )];
    let bill = bill(&intervals, start, end, end, &prices).unwrap();
    assert!(close(bill.credits, 3.0));
    assert_eq!(bill.total, 0.0);
    // Half of December and half of January: half the credits of each.
    let (january, january_end) = month_period("2027-01").unwrap();
    let spanning = super::bill(
        &[],
        start + (end - start) / 2,
        january + (january_end - january) / 2,
        january_end,
        &prices,
    )
    .unwrap();
    assert!(close(spanning.credits, 3.0), "{}", spanning.credits);
    // Costs above the credits are what is left of them.
    let busy = [sandbox(
        "a",
        SandboxState::Started,
        4,
        8192,
        start,
        Some(end),
    )];
    let busy = super::bill(&busy, start, end, end, &prices).unwrap();
    let sum: f64 = busy.lines.iter().map(|l| l.amount).sum();
    assert!(close(busy.total, sum - 3.0));
}

#[test]
fn every_line_is_its_figures_at_the_bills_prices() {
    let (start, end) = december();
    let intervals = [
        sandbox(
            "a",
            SandboxState::Started,
            2,
            3072,
            start,
            Some(start + 7 * MINUTE),
        ),
        sandbox("a", SandboxState::Paused, 2, 3072, start + 7 * MINUTE, None),
        sandbox(
            "b",
            SandboxState::Started,
            1,
            512,
            start + MINUTE,
            Some(start + 90 * MINUTE),
        ),
        snapshot("s", 12, start, None),
    ];
    let prices = Prices::default();
    let bill = bill(&intervals, start, end, start + 5 * HOUR_MS, &prices).unwrap();
    for line in &bill.lines {
        let priced = line.vcpu_hours * prices.vcpu_hour
            + line.memory_gb_hours * prices.memory_gb_hour
            + line.disk_gb_hours * prices.disk_gb_hour
            + line.snapshot_gb_months * prices.snapshot_gb_month;
        assert!(close(line.amount, priced), "{line:?}");
    }
    let json = serde_json::to_value(&bill).unwrap();
    assert_eq!(json["currency"], "USD");
    assert_eq!(json["prices"]["memoryGbHour"], 0.0077);
    assert!(json["lines"][0]["vcpuHours"].is_number());
    assert!(json["lines"][0]["sandboxId"] == "a");
}

#[test]
fn a_period_must_end_after_it_starts_and_a_month_is_written_yyyy_mm() {
    assert!(bill(&[], 10, 10, 10, &prices()).is_err());
    assert!(month_period("2026-13").is_err());
    assert!(month_period("december").is_err());
    // The calendar's last month ends at the end of time, not in a panic.
    let (last, after) = month_period("9999-12").unwrap();
    assert_eq!(after, i64::MAX);
    assert!(months(last, last + HOUR_MS) > 0.0);
    // No bill walks more than ten years.
    assert!(bill(&[], 0, MAX_PERIOD_MS + 1, 0, &prices()).is_err());
    assert!(bill(&[], -5, 10, 0, &prices()).is_err());
    let (start, end) = month_period("2028-02").unwrap();
    assert_eq!((end - start) / (24 * HOUR_MS), 29);
    assert_eq!(month_start(start + 5), start);
}
