"""Pause and connect with the official Python SDK, sync and async (what
the JS suite's pause.test.cjs covers)."""
import time

import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState

from conftest import TEMPLATE


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


def _sleeping(sbx):
    return [p for p in sbx.commands.list() if "sleep" in " ".join([p.cmd or "", *(p.args or [])])]


def test_pause_without_memory_keeps_the_disk_and_reboots(sandbox):
    """pause(mode="filesystem") (the API's memory: false): what the guest
    wrote is kept (synced by the node, not by the program), the memory is
    not; connect boots the sandbox again."""
    sandbox.files.write("/home/user/disk.txt", "on the disk")
    sandbox.commands.run("sleep 600", background=True, timeout=0)
    assert sandbox.pause(mode="filesystem") is True
    assert sandbox.get_info().state.value == "paused"
    again = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert again.files.read("/home/user/disk.txt") == "on the disk"
    assert _sleeping(again) == [], "a process survived a pause without memory"
    assert again.commands.run("echo booted").stdout == "booted\n"
    # And it pauses with memory again.
    assert again.pause() is True
    assert Sandbox.connect(sandbox.sandbox_id).files.read("/home/user/disk.txt") == "on the disk"


def test_connect_with_reboot_drops_the_memory(sandbox):
    """connect(on_resume="reboot") boots a sandbox paused with memory from
    its disk: its processes go; what it wrote stays, also what the guest had
    not flushed before the pause (the node restores the memory to sync it
    first, where E2B documents such writes as lost)."""
    sandbox.files.write("/home/user/r.txt", "written")
    sandbox.commands.run("sleep 600", background=True, timeout=0)
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id, on_resume="reboot")
    assert again.files.read("/home/user/r.txt") == "written"
    assert _sleeping(again) == []


def test_lifecycle_filesystem_pause_at_timeout():
    sbx = Sandbox.create(TEMPLATE, timeout=8, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        sbx.files.write("/home/user/t.txt", "before the timeout")
        deadline = time.time() + 90
        while sbx.get_info().state.value != "paused":
            assert time.time() < deadline, "not paused at its timeout"
            time.sleep(1)
        again = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.files.read("/home/user/t.txt") == "before the timeout"
    finally:
        sbx.kill()
