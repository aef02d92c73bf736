"""Sandbox.fork with the official Python SDK (what the JS suite's
fork.test.cjs covers): children with the parent's files, processes and
metadata, independent of each other and of the parent."""
import os

import pytest
from e2b import AsyncSandbox, Sandbox

from conftest import TEMPLATE


def test_fork_clones_into_independent_children():
    tag = f"pyfork-{os.getpid()}"
    parent = Sandbox.create(TEMPLATE, timeout=300, metadata={"suite": tag})
    children = []
    try:
        parent.files.write("/home/user/parent.txt", "from the parent")
        bg = parent.commands.run("sleep 600", background=True, timeout=0)
        results = parent.fork(count=2, timeout=120)
        children = [r for r in results if not isinstance(r, Exception)]
        assert len(results) == 2 and len(children) == 2, results
        assert len({parent.sandbox_id, *(c.sandbox_id for c in children)}) == 3
        for i, child in enumerate(children):
            assert child.files.read("/home/user/parent.txt") == "from the parent"
            assert any(p.pid == bg.pid for p in child.commands.list()), f"child {i} lacks the process"
            child.files.write("/home/user/child.txt", f"child {i}")
            info = child.get_info()
            assert info.state.value == "running" and info.metadata["suite"] == tag
        assert [c.files.read("/home/user/child.txt") for c in children] == ["child 0", "child 1"]
        assert not parent.files.exists("/home/user/child.txt")
        assert parent.commands.run("echo parent").stdout == "parent\n"
    finally:
        for c in children:
            c.kill()
        parent.kill()


@pytest.mark.asyncio
async def test_fork_async(async_sandbox):
    await async_sandbox.files.write("/home/user/p.txt", "async parent")
    results = await async_sandbox.fork(count=1, timeout=120)
    child = results[0]
    assert not isinstance(child, Exception), child
    try:
        assert await child.files.read("/home/user/p.txt") == "async parent"
    finally:
        await child.kill()
