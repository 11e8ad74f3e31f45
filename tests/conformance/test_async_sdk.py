"""The asynchronous client (AsyncDaytona, aiohttp) against the same server."""

from __future__ import annotations

import asyncio
import os

from daytona import AsyncDaytona, DaytonaConfig, SessionExecuteRequest


def test_async_client_round_trip(cove):
    payload = os.urandom(256 * 1024)

    async def scenario():
        async with AsyncDaytona(DaytonaConfig(api_key=cove.api_key, api_url=cove.api_url)) as client:
            sandbox = await client.create()
            try:
                response = await sandbox.process.exec("echo hi")
                assert response.exit_code == 0
                assert response.result.strip() == "hi"

                await sandbox.fs.upload_file(payload, "/tmp/async.bin")
                assert await sandbox.fs.download_file("/tmp/async.bin") == payload

                await sandbox.process.create_session("a1")
                done = await sandbox.process.execute_session_command(
                    "a1", SessionExecuteRequest(command="export V=7; echo $V")
                )
                assert done.exit_code == 0
                assert done.output.strip() == "7"
                background = await sandbox.process.execute_session_command(
                    "a1", SessionExecuteRequest(command="sleep 0.3; echo $V", run_async=True)
                )
                assert background.cmd_id
                for _ in range(50):
                    command = await sandbox.process.get_session_command("a1", background.cmd_id)
                    if command.exit_code is not None:
                        break
                    await asyncio.sleep(0.1)
                assert command.exit_code == 0
                logs = await sandbox.process.get_session_command_logs("a1", background.cmd_id)
                assert logs.stdout.strip() == "7"

                await sandbox.stop()
                await sandbox.start()
                assert await sandbox.fs.download_file("/tmp/async.bin") == payload
            finally:
                await sandbox.delete()
            return sandbox.id

    sandbox_id = asyncio.run(scenario())
    assert sandbox_id not in cove.sandbox_ids()
