"""Live events over Socket.IO (`/api/socket.io/`): the SDK connects with its key,
and its waits end on the server's `sandbox.state.updated` event instead of a poll.

The SDK polls `GET /sandbox/{id}` once at the start of every wait and then once a
second until a poll or an event shows the state it waits for. So a wait that ends
although none of its polls showed that state ended on the event: without the
feed the SDK would have to poll until it saw it.
"""

from __future__ import annotations

import threading

from daytona import Daytona, DaytonaConfig, SandboxState

from conftest import wait_until


def connected_client() -> Daytona:
    """A client of its own (its own Socket.IO connection), once connected."""
    client = Daytona()
    dispatcher = client._event_dispatcher
    assert dispatcher is not None, "the SDK runs without events (DAYTONA_USE_DEPRECATED_POLLING?)"
    dispatcher.ensure_connected()
    assert wait_until(lambda: dispatcher.is_connected or dispatcher.is_failed, timeout=30), "no answer"
    assert dispatcher.is_connected, dispatcher.fail_error
    return client


def close(client: Daytona) -> None:
    client._event_dispatcher.disconnect()


def test_the_sdk_connects_with_its_key_and_a_wrong_key_is_refused(cove):
    close(connected_client())

    stranger = Daytona(DaytonaConfig(api_key="not-a-key", api_url=cove.api_url))
    dispatcher = stranger._event_dispatcher
    dispatcher.ensure_connected()
    # Refused with connect_error (its message, "invalid API key", is the Rust
    # tests' to check: python-socketio replaces it with its own).
    assert wait_until(lambda: dispatcher.is_failed, timeout=30)
    assert not dispatcher.is_connected
    close(stranger)


def test_a_wait_ends_on_the_event_not_on_a_poll(cove, sandboxes):
    client = connected_client()
    sandbox = client.create()
    sandboxes.track(sandbox.id)

    # Every GET the SDK sends for this sandbox, with the state it answered.
    polled: list[SandboxState] = []
    first_poll = threading.Event()
    api = sandbox._sandbox_api
    get_sandbox = api.get_sandbox

    def counting_get(sandbox_id, *args, **kwargs):
        answer = get_sandbox(sandbox_id, *args, **kwargs)
        if sandbox_id == sandbox.id:
            polled.append(answer.state)
            first_poll.set()
        return answer

    api.get_sandbox = counting_get

    # What the feed says about this sandbox, heard beside the SDK's own handler.
    heard: list[str] = []
    client._event_dispatcher.subscribe(
        sandbox.id,
        lambda _event, data: heard.append(data["sandbox"]["state"]),
        ["sandbox.state.updated"],
    )

    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            sandbox.wait_for_sandbox_stop(timeout=60)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    waiter = threading.Thread(target=wait)
    try:
        waiter.start()
        # Once the wait's first poll has answered `started`, stop the sandbox
        # behind the SDK's back: only a poll or an event can tell the waiter.
        assert first_poll.wait(timeout=60), "the wait never polled"
        assert polled[0] == SandboxState.STARTED
        assert cove.request("POST", f"/sandbox/{sandbox.id}/stop").status_code == 200
        waiter.join(timeout=120)
        assert not waiter.is_alive(), "the wait did not end"
    finally:
        api.get_sandbox = get_sandbox
    assert outcome == [None], outcome
    assert sandbox.state == SandboxState.STOPPED
    assert "stopped" in heard, heard
    # The wait learnt `stopped` from the event: none of its polls saw it.
    assert SandboxState.STOPPED not in polled, polled
    close(client)


def test_create_stop_and_delete_wait_for_nothing(cove, sandboxes):
    """Each answers the state it waits for, so the SDK sends one GET (the
    refresh `stop` always makes) and never enters a poll loop."""
    client = connected_client()
    api = client._sandbox_api
    get_sandbox = api.get_sandbox
    polls: list[str] = []

    def counting_get(sandbox_id, *args, **kwargs):
        polls.append(sandbox_id)
        return get_sandbox(sandbox_id, *args, **kwargs)

    api.get_sandbox = counting_get
    try:
        sandbox = client.create()
        sandboxes.track(sandbox.id)
        assert sandbox.state == SandboxState.STARTED
        assert polls == []
        sandbox.stop()
        assert sandbox.state == SandboxState.STOPPED
        assert polls == [sandbox.id]
        sandbox.delete(wait=True)
        assert sandbox.state == SandboxState.DESTROYED
        assert polls == [sandbox.id]
    finally:
        api.get_sandbox = get_sandbox
    close(client)
