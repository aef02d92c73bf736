"""Snapshots with the official Python SDK: a snapshot's sandboxes, the
sandboxID filter and pages of list_snapshots, delete_snapshot, and a
snapshot of a sandbox that itself started from a snapshot."""
from e2b import Sandbox


def list_all(**kw):
    p = Sandbox.list_snapshots(**kw)
    out = []
    while p.has_next:
        out.extend(p.next_items())
    return out


def test_snapshot_list_filter_pages_and_delete(sandbox):
    sandbox.commands.run("echo kept > /home/user/state")
    other = Sandbox.create(timeout=120)
    try:
        mine = [sandbox.create_snapshot().snapshot_id for _ in range(3)]
        theirs = other.create_snapshot().snapshot_id
        # The filter: only this sandbox's snapshots, in pages of one.
        listed = list_all(sandbox_id=sandbox.sandbox_id, limit=1)
        ids = [s.snapshot_id for s in listed]
        assert sorted(ids) == sorted(mine), ids
        assert theirs not in ids
        # A sandbox from a snapshot holds what the source had.
        child = Sandbox.create(mine[0], timeout=120)
        try:
            assert child.commands.run("cat /home/user/state").stdout == "kept\n"
        finally:
            child.kill()
        # delete_snapshot removes it: gone from the list, unusable.
        assert Sandbox.delete_snapshot(mine[0]) is True
        ids = [s.snapshot_id for s in list_all(sandbox_id=sandbox.sandbox_id)]
        assert mine[0] not in ids and len(ids) == 2, ids
        assert Sandbox.delete_snapshot(mine[0]) is False
        for s in mine[1:] + [theirs]:
            Sandbox.delete_snapshot(s)
    finally:
        other.kill()


def test_snapshot_of_a_sandbox_from_a_snapshot(sandbox):
    sandbox.commands.run("echo one > /home/user/gen")
    first = sandbox.create_snapshot().snapshot_id
    child = Sandbox.create(first, timeout=120)
    try:
        child.commands.run("echo two >> /home/user/gen")
        second = child.create_snapshot().snapshot_id
        grandchild = Sandbox.create(second, timeout=120)
        try:
            assert grandchild.commands.run("cat /home/user/gen").stdout == "one\ntwo\n"
        finally:
            grandchild.kill()
    finally:
        child.kill()
        for s in (first, locals().get("second")):
            if s:
                Sandbox.delete_snapshot(s)


def test_filesystem_snapshot(sandbox):
    """mode="filesystem": the source runs on; a sandbox made from the
    snapshot has its files but boots fresh (none of its processes)."""
    bg = sandbox.commands.run("sleep 600", background=True, timeout=0)
    sandbox.files.write("/home/user/fs.txt", "on disk")
    snap = sandbox.create_snapshot(mode="filesystem").snapshot_id
    try:
        assert sandbox.is_running()
        assert any(p.pid == bg.pid for p in sandbox.commands.list()), "the source lost its process"
        fresh = Sandbox.create(snap, timeout=120)
        try:
            assert fresh.files.read("/home/user/fs.txt") == "on disk"
            assert fresh.commands.run("pgrep -x sleep || echo none").stdout == "none\n"
        finally:
            fresh.kill()
    finally:
        Sandbox.delete_snapshot(snap)
