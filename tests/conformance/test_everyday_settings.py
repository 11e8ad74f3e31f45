"""Daytona's everyday habits (issue 23, item 5), as its documentation shows
them through the SDK: network allow lists read back as the networks they
stand for, lists sorted and paged as asked, auto-archive 0 as the longest
interval, the server's regions, and file listings with clean paths.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from daytona import (
    CreateSandboxFromSnapshotParams,
    DaytonaValidationError,
    ListSandboxesQuery,
    SandboxListSortDirection,
    SandboxListSortField,
)
from daytona_api_client import OrganizationsApi, Region, RegionsApi

from conftest import unique

# Daytona's longest auto-archive interval: 30 days, in minutes.
MAX_AUTO_ARCHIVE = 43200

CURL = "curl -s -m 3 -o /dev/null -w '%{http_code}' "


def fetch(sandbox, url: str) -> str:
    return sandbox.process.exec(CURL + url, timeout=15).result.strip()


# Network settings


def test_allow_lists_read_back_as_the_networks_they_stand_for(daytona, sandboxes, fake_internet):
    # Daytona's own example writes a /16 with host bits set.
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(
        network_allow_list="192.168.1.0/16, 198.51.100.77/24,10.0.0.0/8"))
    assert sandbox.network_allow_list == "192.168.0.0/16,198.51.100.0/24,10.0.0.0/8"
    assert daytona.get(sandbox.id).network_allow_list == sandbox.network_allow_list
    # The firewall applies the masked network: all of 198.51.100.0/24.
    assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
    assert fetch(sandbox, f"http://{fake_internet.DENIED}/") == "000"

    sandbox.update_network_settings(network_allow_list="203.0.113.99/24")
    assert sandbox.network_allow_list == "203.0.113.0/24"
    assert daytona.get(sandbox.id).network_allow_list == "203.0.113.0/24"
    sandbox.update_network_settings(network_allow_list="198.51.100.0/24,203.0.113.0/25")
    assert daytona.get(sandbox.id).network_allow_list == "198.51.100.0/24,203.0.113.0/25"


def test_allow_lists_keep_daytonas_limits(cove, daytona, sandbox):
    before = cove.sandbox_ids()
    six = ",".join(f"10.{i}.0.0/16" for i in range(6))
    with pytest.raises(DaytonaValidationError) as info:
        daytona.create(CreateSandboxFromSnapshotParams(network_allow_list=six))
    assert "at most 5" in str(info.value)
    for garbage in ("10.0.0.0/33", "10.0.0/8", "example.com/24"):
        with pytest.raises(DaytonaValidationError) as info:
            daytona.create(CreateSandboxFromSnapshotParams(network_allow_list=garbage))
        assert garbage in str(info.value)
        assert "192.168.1.0/24" in str(info.value), "the message shows the form expected"
    assert cove.sandbox_ids() == before
    with pytest.raises(DaytonaValidationError):
        sandbox.update_network_settings(network_allow_list=six)
    five = ",".join(f"10.{i}.0.0/16" for i in range(5))
    sandbox.update_network_settings(network_allow_list=five)
    assert daytona.get(sandbox.id).network_allow_list == five


# Sorting and paging


def test_lists_sort_and_page_as_asked(cove, daytona, sandboxes):
    tag = unique("srt")
    # Names whose order is neither the order of creation nor its reverse.
    names = [f"{tag}-b", f"{tag}-c", f"{tag}-a"]
    made = [sandboxes(CreateSandboxFromSnapshotParams(name=name, labels={"srt": tag})) for name in names]
    mine = ListSandboxesQuery(labels={"srt": tag})

    def listed(**query) -> list[str]:
        q = ListSandboxesQuery(labels={"srt": tag}, **query)
        return [s.name for s in daytona.list(q)]

    by_name = sorted(names)
    assert listed(sort=SandboxListSortField.NAME, order=SandboxListSortDirection.ASC) == by_name
    assert listed(sort=SandboxListSortField.NAME, order=SandboxListSortDirection.DESC) == by_name[::-1]
    newest_first = [s.name for s in reversed(made)]
    assert listed(sort=SandboxListSortField.CREATEDAT, order=SandboxListSortDirection.DESC) == newest_first
    assert listed(sort=SandboxListSortField.CREATEDAT, order=SandboxListSortDirection.ASC) == names
    # Daytona's default: newest first.
    assert [s.name for s in daytona.list(mine)] == newest_first

    # One per page: the SDK follows nextCursor, and the pages neither repeat
    # nor skip a sandbox.
    for sort, order, expected in (
        (SandboxListSortField.NAME, SandboxListSortDirection.ASC, by_name),
        (SandboxListSortField.NAME, SandboxListSortDirection.DESC, by_name[::-1]),
        (SandboxListSortField.CREATEDAT, SandboxListSortDirection.DESC, newest_first),
    ):
        assert listed(sort=sort, order=order, limit=1) == expected
    # Two per page by hand: the boundary falls in the same place.
    params = {"labels": f'{{"srt": "{tag}"}}', "sort": "name", "order": "desc", "limit": 2}
    first = cove.request("GET", "/sandbox", params=params).json()
    assert [s["name"] for s in first["items"]] == by_name[::-1][:2]
    second = cove.request("GET", "/sandbox", params={**params, "cursor": first["nextCursor"]}).json()
    assert [s["name"] for s in second["items"]] == by_name[::-1][2:]
    assert not second.get("nextCursor")


def test_lists_filter_by_every_field_the_sdk_sends(cove, daytona, sandboxes):
    """`ListSandboxesQuery`'s filters narrow the list as Daytona's do (id and
    name are case-insensitive prefixes); one cove cannot answer is a 400
    naming it, never a list that ignores it."""
    tag = unique("flt")
    small = sandboxes(CreateSandboxFromSnapshotParams(name=f"{tag}-small", labels={"flt": tag}))
    big = sandboxes(CreateSandboxFromSnapshotParams(name=f"{tag}-Big", labels={"flt": tag}))
    both = {small.name, big.name}

    def listed(**query) -> set[str]:
        return {s.name for s in daytona.list(ListSandboxesQuery(labels={"flt": tag}, **query))}

    assert listed() == both
    assert listed(id=small.id[:8].upper()) == {small.name}
    assert listed(name=f"{tag}-b".upper()) == {big.name}
    assert listed(name="no-such-prefix") == set()
    assert listed(snapshots=[small.snapshot]) == both
    assert listed(snapshots=["no-such-snapshot"]) == set()
    assert listed(min_cpu=small.cpu, max_cpu=small.cpu) == both
    assert listed(min_cpu=small.cpu + 1) == set()
    assert listed(max_memory_gib=small.memory) == both
    assert listed(min_disk_gib=small.disk + 1) == set()
    assert listed(is_public=True) == set()
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert listed(created_at_after=later) == set()
    assert listed(created_at_before=later) == both
    r = cove.request("GET", "/sandbox", params={"isRecoverable": "true"})
    assert r.status_code == 400 and "isRecoverable" in r.json()["message"], r.text
    r = cove.request("GET", "/sandbox", params={"minCpu": "many"})
    assert r.status_code == 400 and "minCpu" in r.json()["message"], r.text


def test_unknown_sort_fields_and_orders_name_the_allowed_ones(cove):
    r = cove.request("GET", "/sandbox", params={"sort": "size"})
    assert r.status_code == 400, r.text
    assert "size" in r.json()["message"]
    assert "createdAt" in r.json()["message"] and "name" in r.json()["message"]
    r = cove.request("GET", "/sandbox", params={"sort": "name", "order": "sideways"})
    assert r.status_code == 400, r.text
    assert "asc, desc" in r.json()["message"]
    r = cove.request("GET", "/snapshots", params={"sort": "cpu"})
    assert r.status_code == 400, r.text
    assert "lastUsedAt" in r.json()["message"]


def test_snapshots_sort_as_asked(cove, daytona):
    for order in ("asc", "desc"):
        page = cove.request("GET", "/snapshots", params={"sort": "name", "order": order}).json()
        names = [s["name"] for s in page["items"]]
        assert names == sorted(names, reverse=order == "desc"), names
    # The SDK's own call keeps working.
    assert daytona.snapshot.list().items


# Auto-archive


def test_auto_archive_zero_is_the_longest_interval(daytona, sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(auto_archive_interval=0))
    assert sandbox.auto_archive_interval == MAX_AUTO_ARCHIVE
    assert daytona.get(sandbox.id).auto_archive_interval == MAX_AUTO_ARCHIVE

    sandbox.set_auto_archive_interval(60)
    sandbox.refresh_data()
    assert sandbox.auto_archive_interval == 60
    sandbox.set_auto_archive_interval(0)
    sandbox.refresh_data()
    assert sandbox.auto_archive_interval == MAX_AUTO_ARCHIVE
    # Longer than the longest is cut to it, as Daytona does.
    sandbox.set_auto_archive_interval(MAX_AUTO_ARCHIVE * 2)
    assert daytona.get(sandbox.id).auto_archive_interval == MAX_AUTO_ARCHIVE


# Regions


def test_regions_list_this_servers_one_region(daytona, sandbox):
    regions = OrganizationsApi(daytona._api_client).list_available_regions()
    assert [r.id for r in regions] == [sandbox.target]
    assert isinstance(regions[0], Region) and regions[0].name == sandbox.target
    shared = RegionsApi(daytona._api_client).list_shared_regions()
    assert [r.id for r in shared] == [sandbox.target]


def test_a_known_target_is_honoured_and_an_unknown_one_refused(cove, daytona, sandboxes):
    here = OrganizationsApi(daytona._api_client).list_available_regions()[0].id
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(target=here))
    assert sandbox.target == here
    assert [s.id for s in daytona.list(ListSandboxesQuery(id=sandbox.id, targets=[here]))
            if s.id == sandbox.id] == [sandbox.id]
    assert sandbox.id not in {s.id for s in daytona.list(ListSandboxesQuery(targets=["mars"]))}

    before = cove.sandbox_ids()
    with pytest.raises(DaytonaValidationError) as info:
        daytona.create(CreateSandboxFromSnapshotParams(target="mars"))
    assert "mars" in str(info.value) and f'"{here}"' in str(info.value)
    assert cove.sandbox_ids() == before


# File listings


def test_listed_paths_are_clean(sandbox):
    home = sandbox.get_user_home_dir()
    listed = sandbox.fs.list_files(".")
    assert listed, "the home directory has files"
    for f in listed:
        assert f.path == f"{home}/{f.name}", f.path

    root = f"/tmp/ev-{uuid.uuid4().hex[:8]}"
    sandbox.fs.upload_file(b"needle\n", f"{root}/sub/notes.txt")
    expected = f"{root}/sub/notes.txt"
    for path in (f"{root}/sub", f"{root}/./sub/", f"{root}//sub/../sub/."):
        assert [(f.name, f.path) for f in sandbox.fs.list_files(path)] == [("notes.txt", expected)], path
    deep = sandbox.fs.list_files(f"{root}/.", depth=2)
    assert sorted(f.path for f in deep) == [f"{root}/sub", expected]
    info = sandbox.fs.get_file_info(f"{root}/./sub/.")
    assert (info.name, info.path) == ("sub", f"{root}/sub")

    assert sandbox.fs.search_files(f"{root}/./", "*.txt").files == [expected]
    assert [m.file for m in sandbox.fs.find_files(f"{root}/sub/..", "needle")] == [expected]
