"""`GET /metrics`: the server's metrics for Prometheus, behind the API key as
Prometheus scrape configs send it (`Authorization: Bearer`), read with the
Prometheus project's own parser.

Labels come only from closed sets (route templates, states, classes,
operations, statuses), so no sandbox id or name may appear anywhere in the
exposition. Counts are compared before and after the test's own work, as
the session's server is shared with other modules.
"""

from __future__ import annotations

import requests
from daytona import CreateSandboxFromSnapshotParams
from prometheus_client.parser import text_string_to_metric_families

from conftest import unique, vm_assets

CONTENT_TYPE = "text/plain; version=0.0.4"


def scrape(cove, key: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.get(f"{cove.base_url}/metrics", headers=headers, timeout=30)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the exposition, as (name, labels, value)."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def value(found: list, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(v for n, ls, v in found if n == name and labels.items() <= ls.items())


def types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def test_a_scrape_without_the_key_is_refused(cove):
    assert scrape(cove, None).status_code == 401
    assert scrape(cove, "not-the-key").status_code == 401
    answer = scrape(cove, cove.api_key)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.headers["content-type"].startswith(CONTENT_TYPE)


def test_a_new_sandbox_is_counted_by_class_and_operation_and_no_id_shows(cove, sandboxes):
    before = samples(scrape(cove, cove.api_key).text)
    name = unique("metrics")
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(name=name))
    # A toolbox request, counted under its route template.
    assert sandbox.process.exec("echo counted").result.strip() == "counted"
    # A refused scrape is counted too, under the same route.
    assert scrape(cove, None).status_code == 401
    answer = scrape(cove, cove.api_key)
    assert answer.status_code == 200
    text = answer.text
    after = samples(text)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    kinds = types(text)
    assert kinds["cove_sandboxes"] == "gauge"
    assert kinds["cove_sandbox_operations"] == "counter"
    assert kinds["cove_sandbox_operation_duration_seconds"] == "histogram"
    assert kinds["cove_http_requests"] == "counter"
    assert kinds["cove_http_request_duration_seconds"] == "histogram"

    # The default snapshot makes a container: one more started container.
    assert grew("cove_sandboxes", **{"state": "started", "class": "container"}) == 1
    assert value(after, "cove_runtime_processes", **{"class": "container", "process": "agent"}) >= 1

    create = {"operation": "create", "class": "container"}
    assert grew("cove_sandbox_operations_total", outcome="ok", **create) == 1
    assert grew("cove_sandbox_operation_duration_seconds_count", **create) == 1
    assert grew("cove_sandbox_operation_duration_seconds_bucket", le="+Inf", **create) == 1
    assert value(after, "cove_sandbox_operation_duration_seconds_sum", **create) > 0

    requests_by_route = {
        (ls["route"], ls["method"], ls["status"])
        for n, ls, _ in after
        if n == "cove_http_requests_total"
    }
    assert ("/api/sandbox", "POST", "200") in requests_by_route, requests_by_route
    assert ("/toolbox/{id}/{*path}", "POST", "200") in requests_by_route, requests_by_route
    assert grew("cove_http_requests_total", route="/metrics", method="GET", status="401") == 1
    assert grew("cove_http_request_duration_seconds_count", route="/api/sandbox") >= 1
    for route, _, status in requests_by_route:
        assert route.startswith("/") or route in {"unmatched", "preview-host"}, route
        assert status.isdigit(), status

    assert sandbox.id not in text, f"sandbox id {sandbox.id} is in the metrics"
    assert name not in text, f"sandbox name {name} is in the metrics"


def test_storage_pools_and_processes_are_read_from_the_host(cove):
    found = samples(scrape(cove, cove.api_key).text)
    for filesystem in ("data", "storage"):
        assert value(found, "cove_filesystem_used_bytes", filesystem=filesystem) > 0, filesystem
        assert value(found, "cove_filesystem_available_bytes", filesystem=filesystem) > 0, filesystem
    names = {(n, tuple(sorted(ls.items()))) for n, ls, _ in found}
    expected = [
        ("cove_runtime_processes", {"class": "container", "process": "agent"}),
        ("cove_warm_pool", {"pool": "network_namespaces", "class": "container"}),
        ("cove_snapshots", {}),
        ("cove_volumes", {}),
    ]
    if vm_assets() is not None:
        # The session's server runs VMs; its warm pool is off (conftest).
        expected += [
            ("cove_runtime_processes", {"class": "linux-vm", "process": "qemu"}),
            ("cove_warm_pool", {"pool": "machines", "class": "linux-vm"}),
        ]
        assert value(found, "cove_warm_pool", pool="machines", **{"class": "linux-vm"}) == 0
    for name, labels in expected:
        assert (name, tuple(sorted(labels.items()))) in names, (name, labels)
