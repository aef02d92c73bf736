"""Pause and connect with the official Python SDK, sync and async (what
the JS suite's pause.test.cjs covers)."""
import time

import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState


def test_pause_then_connect_resumes_where_it_stopped(sandbox):
    sandbox.files.write("/home/user/kept.txt", "kept across pause")
    bg = sandbox.commands.run("sleep 600", background=True, timeout=0)
    assert sandbox.pause() is True
    assert sandbox.is_running() is False
    assert sandbox.get_info().state.value == "paused"
    paused = []
    p = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]))
    while p.has_next:
        paused.extend(s.sandbox_id for s in p.next_items())
    assert sandbox.sandbox_id in paused
    assert sandbox.pause() is False  # already paused

    again = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert again.is_running()
    assert again.files.read("/home/user/kept.txt") == "kept across pause"
    assert any(p.pid == bg.pid for p in again.commands.list()), "the background process survived"
    assert again.commands.run("echo resumed").stdout == "resumed\n"
    ttl = again.get_info().end_at.timestamp() - time.time()
    assert 100 < ttl <= 121, ttl


@pytest.mark.asyncio
async def test_pause_and_connect_async(async_sandbox):
    await async_sandbox.files.write("/home/user/k.txt", "async kept")
    assert await async_sandbox.pause() is True
    again = await AsyncSandbox.connect(async_sandbox.sandbox_id, timeout=120)
    assert await again.files.read("/home/user/k.txt") == "async kept"
